//! fio over NBD with crc32c verification, in every cache mode, with a 16 MiB cache over a 256 MiB
//! core (each run writes 142 MiB of it) so eviction and (in wb/wo) cleaning under pressure happen all the time.
//!
//! Per mode: random and sequential writes with block sizes 4 KiB to 1 MiB at iodepth 1 and 32,
//! each read back and verified; then a second pass re-reads everything (`verify_only`) after the
//! other jobs have evicted it, so data that only lived in the cache must have reached the core.

mod common;

use common::{file_cache, fio, need, FileCache};

fn run_mode(mode: &str) {
    if !need(&["fio"]) {
        return;
    }
    let FileCache {
        dir,
        core,
        daemon: d,
        ..
    } = file_cache(16 << 20, 256 << 20, &["-c", mode]);
    let uri = d.uri("cas1-1");

    let mut args: Vec<String> = [
        "--ioengine=nbd".to_string(),
        // fio would otherwise leave verify state files in the crate directory.
        "--verify_state_save=0".to_string(),
        format!("--uri={uri}"),
        "--verify=crc32c".into(),
        "--verify_fatal=1".into(),
        "--randrepeat=1".into(),
    ]
    .into();
    // (name, rw, block sizes, iodepth, offset MiB, size MiB)
    let jobs = [
        ("randwrite-qd32", "randwrite", "4k-1m", 32, 0, 40),
        ("seqwrite-qd1", "write", "4k-1m", 1, 40, 24),
        ("randwrite-qd1", "randwrite", "4k-1m", 1, 64, 24),
        ("seqwrite-qd32", "write", "1m", 32, 88, 24),
        ("randwrite-4k-qd32", "randwrite", "4k", 32, 112, 6),
        ("randwrite-64k-qd32", "randwrite", "64k", 32, 118, 24),
    ];
    for (name, rw, bs, depth, off, size) in jobs {
        args.extend([
            format!("--name={name}"),
            "--stonewall".into(),
            format!("--rw={rw}"),
            if bs.contains('-') {
                format!("--bsrange={bs}")
            } else {
                format!("--bs={bs}")
            },
            format!("--iodepth={depth}"),
            format!("--offset={off}m"),
            format!("--size={size}m"),
        ]);
    }
    let report = fio(dir.path(), &format!("{mode}-write"), &args);
    assert_eq!(report["jobs"].as_array().map(Vec::len), Some(jobs.len()));

    // Everything again, reading only: the data must have survived eviction.
    let mut again = args.clone();
    again.push("--verify_only".into());
    fio(dir.path(), &format!("{mode}-reverify"), &again);

    let stats: serde_json::Value =
        serde_json::from_str(&d.ok(&["-P", "-i", "1", "-o", "json"])).expect("stats JSON");
    assert_eq!(stats["errors"]["total_errors"]["count"], 0, "{stats}");
    assert!(
        stats["blocks"]["exported_writes"]["count"]
            .as_u64()
            .unwrap()
            >= (128 << 20) / 4096,
        "{stats}"
    );

    // After a flush the core file alone holds the data: verify it without the cache.
    d.ok(&["-F", "-i", "1"]);
    let mut direct: Vec<String> = args
        .iter()
        .filter(|a| !a.starts_with("--ioengine") && !a.starts_with("--uri"))
        .cloned()
        .collect();
    direct.insert(0, "--ioengine=psync".into());
    direct.insert(1, format!("--filename={}", core.display()));
    direct.push("--verify_only".into());
    fio(dir.path(), &format!("{mode}-core"), &direct);
}

#[test]
fn fio_verify_wt() {
    run_mode("wt");
}

#[test]
fn fio_verify_wb() {
    run_mode("wb");
}

#[test]
fn fio_verify_wa() {
    run_mode("wa");
}

#[test]
fn fio_verify_wi() {
    run_mode("wi");
}

#[test]
fn fio_verify_wo() {
    run_mode("wo");
}

#[test]
fn fio_verify_pt() {
    run_mode("pt");
}

//! Batched write hits through NBD (issue 32; engine write_batch.rs, the NBD reader's write
//! batches, opt-in with `HYBRIDCACHE_NBD_WRITE_BATCH=1`): fio write hits at iodepth 32 verified with crc32c, mixed with flushes, land
//! intact (FUA's place in a batch: crates/nbd/tests/write_batch.rs); `-P` shows that they were batched (`Write hits written to cache in
//! batches`); and after a flush the core file alone holds the data.

mod common;

use common::{fio, need, sparse_file, workdir, Daemon};

#[test]
fn write_hits_at_qd32_are_batched_and_verify() {
    if !need(&["fio"]) {
        return;
    }
    let dir = workdir();
    let cache = dir.path().join("cache.img");
    let core = dir.path().join("core.img");
    sparse_file(&cache, 64 << 20);
    sparse_file(&core, 128 << 20);
    // Write batching is opt-in (docs/performance.md §11).
    let d = Daemon::start_with_env(dir.path(), &[], &[("HYBRIDCACHE_NBD_WRITE_BATCH", "1")]);
    let spec = format!("file:{}", cache.display());
    d.ok(&["-S", "-d", &spec, "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", core.to_str().expect("UTF-8 path")]);
    let uri = d.uri("cas1-1");
    let base: Vec<String> = vec![
        "--ioengine=nbd".into(),
        "--verify_state_save=0".into(),
        format!("--uri={uri}"),
        "--offset=0".into(),
        "--size=16m".into(),
    ];
    // Map the region first: what follows are write hits.
    let mut fill = base.clone();
    fill.extend(["--name=fill".into(), "--rw=write".into(), "--bs=1m".into()]);
    fio(dir.path(), "fill", &fill);
    let before = d.stats_json(1, None);

    let verify = [
        "--verify=crc32c".to_string(),
        "--verify_fatal=1".into(),
        "--randrepeat=1".into(),
    ];
    let mut hits = base.clone();
    hits.extend(verify.iter().cloned());
    hits.extend([
        "--name=hits-qd32".into(),
        "--rw=randwrite".into(),
        "--bs=4k".into(),
        "--iodepth=32".into(),
        // A flush every 256 writes: a flush ends a batch and covers the writes before it.
        "--fsync=256".into(),
        "--name=hits-fua-qd32".into(),
        "--stonewall".into(),
        "--rw=randwrite".into(),
        "--bsrange=4k-64k".into(),
        "--iodepth=32".into(),
        // A flush every fourth write: batches of at most four.
        "--fsync=4".into(),
    ]);
    let report = fio(dir.path(), "hits", &hits);
    assert_eq!(report["jobs"].as_array().map(Vec::len), Some(2));
    // Everything again, reading only.
    let mut again = hits.clone();
    again.push("--verify_only".into());
    fio(dir.path(), "reverify", &again);

    let after = d.stats_json(1, None);
    let count = |v: &serde_json::Value, section: &str, key: &str| {
        v[section][key]["count"]
            .as_u64()
            .unwrap_or_else(|| panic!("no {section}.{key}: {v}"))
    };
    let batched = count(&after, "policies", "write_hits_batched")
        - count(&before, "policies", "write_hits_batched");
    let hits_done =
        count(&after, "requests", "write_hits") - count(&before, "requests", "write_hits");
    eprintln!("{batched} of {hits_done} write hits batched");
    assert!(hits_done >= 4096, "{after}");
    // How many of them reach the reader together depends on the machine's load (and a debug
    // build's speed: batches slower than 50 us a request are left to the workers, but for one
    // in 64); that some do is what this checks, the share is bench device's to measure.
    assert!(
        batched >= 64,
        "{batched} of {hits_done} write hits batched: {after}"
    );
    assert_eq!(count(&after, "errors", "total_errors"), 0, "{after}");
    let table = d.ok(&["-P", "-i", "1"]);
    assert!(
        table.contains("Write hits written to cache in batches"),
        "{table}"
    );

    // After a flush the core file alone holds every write.
    d.ok(&["-F", "-i", "1"]);
    let mut direct: Vec<String> = hits
        .iter()
        .filter(|a| !a.starts_with("--ioengine") && !a.starts_with("--uri"))
        .cloned()
        .collect();
    direct.insert(0, "--ioengine=psync".into());
    direct.insert(1, format!("--filename={}", core.display()));
    direct.push("--verify_only".into());
    fio(dir.path(), "core", &direct);
}

//! One failing core cannot block the others, through the real daemon: core 1 is a remote NBD
//! export served by nbdkit (memory plugin behind the error filter, which then starts failing
//! every request, and is finally killed), core 2 a file. fio writes core 2's export with crc32c
//! verification and fsyncs throughout, and core 1's server is killed while it writes; then the
//! daemon is killed with SIGKILL, the cache loaded again, and fio's `verify_only` must find
//! every one of core 2's writes.

mod common;

use std::time::{Duration, Instant};

use common::{fio, nbdkit, need, sparse_file, workdir, Daemon};

#[test]
fn a_dead_remote_core_does_not_block_another_cores_flushes() {
    if !need(&["nbdkit", "fio"]) {
        return;
    }
    let dir = workdir();
    let sock = dir.path().join("nbdkit.sock");
    let inject = dir.path().join("inject");
    let mut nbdkit = nbdkit(
        &sock,
        &[
            "--filter=error".into(),
            "memory".into(),
            "64M".into(),
            "error-rate=100%".into(),
            format!("error-file={}", inject.display()),
        ],
    );
    let cache = dir.path().join("cache.img");
    let core2 = dir.path().join("core2.img");
    sparse_file(&cache, 64 << 20);
    sparse_file(&core2, 64 << 20);
    let spec = format!("file:{}", cache.display());
    let mut d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", &spec, "-c", "wb"]);
    let remote = format!("nbd+unix:///?socket={}", sock.display());
    d.ok(&["-A", "-i", "1", "-d", &remote]);
    d.ok(&["-A", "-i", "1", "-d", core2.to_str().expect("UTF-8 path")]);

    // Core 1 holds dirty data, then its server fails every request.
    let mut c1 = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-1").unwrap();
    c1.write(&[0xa5; 1 << 20], 0, false).unwrap();
    c1.flush().unwrap();
    std::fs::write(&inject, b"").unwrap();
    let err = d.fails(&["-F", "-i", "1", "-j", "1"]);
    assert!(!err.is_empty());
    // A client read that needs the failing device fails, and the daemon's log says where.
    let mut buf = vec![0u8; 4096];
    assert!(c1.read(&mut buf, 32 << 20).is_err());
    let log = d.log_text();
    assert!(
        log.contains("cas1-1: device error: read failed on"),
        "no device error in the log: {log}"
    );

    // The daemon started after the kill listens on the same socket path.
    let uri = d.uri("cas1-2");
    let job = |name: &str, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = vec![
            "--ioengine=nbd".into(),
            "--verify_state_save=0".into(),
            format!("--uri={uri}"),
            format!("--name={name}"),
            "--rw=randwrite".into(),
            "--bsrange=4k-256k".into(),
            "--iodepth=8".into(),
            "--size=24m".into(),
            "--verify=crc32c".into(),
            "--verify_fatal=1".into(),
            "--randrepeat=1".into(),
            // A flush every 16 writes, and one at the end: each must succeed on core 2.
            "--fsync=16".into(),
            "--end_fsync=1".into(),
        ];
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    // One verify run on core 2, its writes slowed to 2 MiB/s (12 s) so that it is still writing
    // when core 1's server goes: it starts while core 1 fails every request, and core 1 dies
    // under it.
    let run = {
        let (dir, args) = (dir.path().to_path_buf(), job("core2", &["--rate=,2m"]));
        std::thread::spawn(move || fio(&dir, "core2", &args))
    };
    let exported = |d: &Daemon| {
        d.stats_json(1, Some(2))["blocks"]["exported_writes"]["count"]
            .as_u64()
            .unwrap_or(0)
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while exported(&d) == 0 {
        assert!(!run.is_finished(), "fio ended before writing");
        assert!(Instant::now() < deadline, "fio never wrote to cas1-2");
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = nbdkit.0.kill();
    let _ = nbdkit.0.wait();
    // In 4 KiB blocks: the run's 24 MiB were not all written when the server went.
    let at_kill = exported(&d);
    assert!(
        at_kill < 6144,
        "core 1 was killed after fio's writes, not during them ({at_kill} blocks written)"
    );
    let report = run.join().expect("the fio thread");
    assert_eq!(
        report["jobs"][0]["write"]["io_bytes"].as_u64(),
        Some(24 << 20),
        "fio wrote all of its run"
    );
    // A client's own flush on cas1-2 (fio's nbd engine does not say whether its flushes failed).
    let mut c2 = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-2").unwrap();
    c2.flush()
        .expect("a flush on cas1-2 succeeds while core 1 is gone");
    c2.disconnect().unwrap();
    // (A flush on cas1-1 may succeed too: its acknowledged writes are dirty in the cache,
    // durable there, and no write reached core 1 since its last good flush.)
    d.ok(&["-F", "-i", "1", "-j", "2"]);
    let core1 = d.stats_json(1, Some(1));
    let core2_stats = d.stats_json(1, Some(2));
    assert!(
        core1["errors"]["total_errors"]["count"]
            .as_u64()
            .unwrap_or(0)
            > 0,
        "core 1's errors are counted on core 1: {core1}"
    );
    assert_eq!(
        core2_stats["errors"]["total_errors"]["count"], 0,
        "and none on core 2: {core2_stats}"
    );
    assert!(
        core1["usage"]["dirty"]["count"].as_u64().unwrap_or(0) > 0,
        "core 1's dirty data stays in the cache: {core1}"
    );

    // Crash: everything core 2's flushes acknowledged must be back after a load.
    d.kill();
    let d = Daemon::start(dir.path());
    let out = d.ok(&["-S", "-d", &spec, "--load"]);
    assert!(
        out.starts_with("cache 1 loaded\n") && out.contains("core 1 of cache 1 is inactive"),
        "{out}"
    );
    fio(dir.path(), "reverify", &job("core2", &["--verify_only"]));
}

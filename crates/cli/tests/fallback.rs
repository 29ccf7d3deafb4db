//! Fallback pass-through through the real daemon (issue 34; docs/cli.md "Fallback
//! pass-through"): the cache device is an nbdkit export behind the error filter. With a
//! threshold set, the device starts failing every request: reads of clean data keep working
//! through NBD (from the core), the errors reach the threshold, `-L`/`-P` show the fallback,
//! the log says so at ERROR, new writes go to the core, and `-Z` caches again.

mod common;

use common::{fio, nbdkit, need, sparse_file, workdir, Daemon};

const MIB: u64 = 1 << 20;

fn job(uri: &str, name: &str, offset_mib: u64, extra: &[&str]) -> Vec<String> {
    let mut a = vec![
        "--ioengine=nbd".to_string(),
        format!("--uri={uri}"),
        format!("--name={name}"),
        "--verify_state_save=0".into(),
        "--bs=64k".into(),
        format!("--offset={}", offset_mib * MIB),
        "--size=8m".into(),
        "--verify=crc32c".into(),
        "--verify_fatal=1".into(),
    ];
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

#[test]
fn a_failing_cache_device_falls_back_to_pass_through_and_clean_data_keeps_serving() {
    if !need(&["nbdkit", "fio"]) {
        return;
    }
    let dir = workdir();
    let sock = dir.path().join("cache.sock");
    let inject = dir.path().join("inject");
    let _nbdkit = nbdkit(
        &sock,
        &[
            "--filter=error".into(),
            "memory".into(),
            "64M".into(),
            "error-rate=100%".into(),
            format!("error-file={}", inject.display()),
        ],
    );
    let core = dir.path().join("core.img");
    sparse_file(&core, 64 * MIB);
    let d = Daemon::start(dir.path());
    let cache_dev = format!("nbd+unix:///?socket={}", sock.display());
    d.ok(&[
        "-S",
        "-d",
        &cache_dev,
        "-c",
        "wt",
        "--fallback-pt-threshold",
        "4",
        "--fallback-pt-window",
        "300",
    ]);
    assert_eq!(d.param("fallback-pt", 1, "Error threshold"), "4");
    assert_eq!(d.param("fallback-pt", 1, "Error window [s]"), "300");
    d.ok(&["-A", "-i", "1", "-d", core.to_str().expect("UTF-8 path")]);
    d.ok(&["-X", "-n", "fallback-pt", "-i", "1", "-t", "8"]);
    assert_eq!(d.param("fallback-pt", 1, "Error threshold"), "8");
    assert_eq!(d.param("fallback-pt", 1, "Error window [s]"), "300");
    let uri = d.uri("cas1-1");

    // Written and read back while the device is healthy: cached, and clean (write-through).
    fio(
        dir.path(),
        "healthy",
        &job(&uri, "healthy", 0, &["--rw=write"]),
    );
    assert!(d.ok(&["-L"]).contains("Running"));

    // The device fails every request from here: the reads of the cached data fail on it and
    // come from the core, right (fio verifies), until the errors reach the threshold.
    std::fs::write(&inject, b"").unwrap();
    fio(
        dir.path(),
        "reread",
        &job(&uri, "healthy", 0, &["--rw=read", "--verify_only"]),
    );
    let table = d.ok(&["-L"]);
    assert!(table.contains("Fallback pass-through"), "{table}");
    let listed: serde_json::Value =
        serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("-L JSON");
    let f = &listed["caches"][0]["fallback"];
    assert_eq!(f["active"], true, "{listed}");
    assert!(f["errors"].as_u64().unwrap_or(0) >= 8, "{listed}");
    assert_eq!(
        listed["caches"][0]["mode"], "wt",
        "the mode set stays: {listed}"
    );
    let stats = d.ok(&["-P", "-i", "1"]);
    assert!(
        stats.contains("Fallback Pass-Through") && stats.contains("Unreadable Dirty Lines"),
        "{stats}"
    );

    // New writes and reads go to the core only.
    fio(
        dir.path(),
        "fallback",
        &job(&uri, "fallback", 16, &["--rw=write"]),
    );
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while !d.log_text().contains("reached the fallback-pt threshold 8") {
        assert!(
            std::time::Instant::now() < deadline,
            "no ERROR line for the fallback:\n{}",
            d.log_text()
        );
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    assert!(d.log_text().contains("ERROR"));

    // The device heals; a reset of the counters caches again.
    std::fs::remove_file(&inject).unwrap();
    d.ok(&["-Z", "-i", "1"]);
    let table = d.ok(&["-L"]);
    assert!(!table.contains("Fallback pass-through"), "{table}");
    fio(
        dir.path(),
        "again",
        &job(&uri, "again", 32, &["--rw=write"]),
    );
}

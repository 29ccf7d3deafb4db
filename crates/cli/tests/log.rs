//! The daemon's log: every line has a timestamp and a level, `RUST_LOG` filters it, and what no
//! client waits for is logged too: device errors of background cleaning (device, operation,
//! offset, length) and cleaning that has stalled, then resumed.

mod common;

use std::time::{Duration, Instant};

use common::{nbdkit, need, workdir, Daemon};

fn wait_for(d: &Daemon, what: &str, found: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let log = d.log_text();
        if log.lines().any(&found) {
            return log;
        }
        assert!(Instant::now() < deadline, "no {what} in the log:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn background_cleaning_errors_and_a_stall_are_logged() {
    if !need(&["nbdkit"]) {
        return;
    }
    let dir = workdir();
    let sock = dir.path().join("nbdkit.sock");
    let inject = dir.path().join("inject");
    // Writes to the core fail while `inject` exists; reads and flushes work.
    let _nbdkit = nbdkit(
        &sock,
        &[
            "--filter=error".into(),
            "memory".into(),
            "64M".into(),
            "error-pwrite-rate=100%".into(),
            format!("error-pwrite-file={}", inject.display()),
        ],
    );
    let d = Daemon::start_with(dir.path(), &["--cleaning-stall-warn", "2"]);
    d.ok(&["-S", "-d", "ram:64M", "-c", "wb"]);
    let remote = format!("nbd+unix:///?socket={}", sock.display());
    d.ok(&["-A", "-i", "1", "-d", &remote]);
    // Clean a line a second after its last write, busy or not.
    d.ok(&[
        "-X",
        "-n",
        "cleaning-alru",
        "-i",
        "1",
        "-w",
        "1",
        "-s",
        "1",
        "-t",
        "0",
    ]);

    std::fs::write(&inject, b"").unwrap();
    // Write-back: the client's writes succeed in the cache; only cleaning meets the core.
    let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-1").unwrap();
    c.write(&[0x5a; 256 << 10], 4 << 20, false).unwrap();
    c.flush().unwrap();

    let log = wait_for(&d, "cleaning device error", |l| {
        l.contains(" WARN ")
            && l.contains("cache 1: cleaning: device error: core 1: write failed on")
    });
    let line = log
        .lines()
        .find(|l| l.contains("cleaning: device error"))
        .unwrap();
    assert!(
        line.contains("nbd+unix") && line.contains(" at offset ") && line.contains(" length "),
        "{line}"
    );
    // Logged at most once a second, not once per failed write.
    let log = wait_for(&d, "cleaning stall", |l| {
        l.contains(" WARN ") && l.contains("cache 1: cleaning has stalled")
    });
    let stall = log
        .lines()
        .find(|l| l.contains("cleaning has stalled"))
        .unwrap();
    assert!(
        stall.contains("64 dirty lines")
            && stall.contains("last cleaning error: core 1: write failed"),
        "{stall}"
    );
    let errors = log
        .lines()
        .filter(|l| l.contains("cleaning: device error"))
        .count();
    assert!(errors <= 5, "{errors} error lines in a few seconds:\n{log}");

    // The core heals. A core whose write failed is passed by until a flush succeeds on it (so
    // that it cannot starve the other cores' cleaning): the client's next flush finds it
    // working, cleaning resumes, and the log says so.
    std::fs::remove_file(&inject).unwrap();
    c.flush().unwrap();
    wait_for(&d, "end of the stall", |l| {
        l.contains(" INFO ") && l.contains("cache 1: cleaning is no longer stalled")
    });
    let deadline = Instant::now() + Duration::from_secs(30);
    while d.stats_json(1, None)["raw"]["dirty_lines"].as_u64() != Some(0) {
        assert!(Instant::now() < deadline, "cleaning never finished");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// "2026-11-25T10:13:19.123456Z": the UTC timestamp every log line starts with.
fn is_timestamp(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() >= 20
        && s.ends_with('Z')
        && b[4] == b'-'
        && b[7] == b'-'
        && b[10] == b'T'
        && b[13] == b':'
        && b[16] == b':'
        && [0, 1, 2, 3, 5, 6, 8, 9, 11, 12, 14, 15, 17, 18]
            .iter()
            .all(|&i| b[i].is_ascii_digit())
}

#[test]
fn every_log_line_has_a_timestamp_and_a_level() {
    let dir = workdir();
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", "ram:16M"]);
    let _ = d.fails(&["-X", "-n", "cleaning-alru", "-i", "1", "-w", "99999"]);
    let log = wait_for(&d, "refusal", |l| l.contains(" WARN "));
    let lines: Vec<&str> = log.lines().filter(|l| !l.is_empty()).collect();
    assert!(lines.len() >= 3, "{log}");
    for l in lines {
        let mut words = l.split_whitespace();
        let (time, level) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
        assert!(is_timestamp(time), "no timestamp: {l}");
        assert!(
            ["TRACE", "DEBUG", "INFO", "WARN", "ERROR"].contains(&level),
            "no level: {l}"
        );
    }
}

#[test]
fn rust_log_warn_hides_info_lines() {
    let dir = workdir();
    let d = Daemon::start_with_env(dir.path(), &[], &[("RUST_LOG", "warn")]);
    // Logged at INFO: the start and the change; at WARN: the refusal.
    d.ok(&["-S", "-d", "ram:16M"]);
    d.ok(&["-X", "-n", "cleaning-alru", "-i", "1", "-w", "5"]);
    let _ = d.fails(&["-X", "-n", "cleaning-alru", "-i", "1", "-w", "99999"]);
    let log = wait_for(&d, "refusal", |l| {
        l.contains(" WARN ") && l.contains("refused")
    });
    assert!(
        !log.lines().any(|l| l.contains(" INFO ")),
        "INFO lines under RUST_LOG=warn:\n{log}"
    );
}

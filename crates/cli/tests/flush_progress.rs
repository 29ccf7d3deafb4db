//! `-F` on a slow core: `-L` shows "Flushing (x %)" with a rising percentage and `-P` the dirty
//! age; Ctrl-C (SIGINT) on the `-F` command stops the flush after its current batch, the command
//! says how far it got, and the data stays exactly right; a second `-F` finishes. A mode switch
//! that flushes (`-Q -c wt -f yes`) shows as `wb->wt` in `-L` and `Flushing (x %)` in `-P`.

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

fn flushing_percent(d: &Daemon) -> Option<f64> {
    let v: serde_json::Value = serde_json::from_str(&d.ok(&["-L", "-o", "json"])).ok()?;
    let c = &v["caches"][0];
    let status = c["status"].as_str()?;
    if !status.starts_with("Flushing (") {
        return None;
    }
    c["flush"]["percent"].as_f64()
}

#[test]
fn flush_shows_progress_and_can_be_interrupted() {
    if !need(&["fio"]) {
        return;
    }
    let dir = workdir();
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", "ram:256M", "-i", "1", "-c", "wb"]);
    // About 24 MB/s to the core: a 96 MiB flush takes a few seconds.
    d.ok(&["-A", "-i", "1", "-d", "throttle:bw=24M:ram:512M"]);
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    d.ok(&["-X", "-n", "seq-cutoff", "-i", "1", "-p", "never"]);
    let job = |extra: &[&str]| -> Vec<String> {
        let mut v: Vec<String> = vec![
            "--name=data".into(),
            "--ioengine=nbd".into(),
            format!("--uri={}", d.uri("cas1-1")),
            "--rw=write".into(),
            "--bs=256k".into(),
            "--size=96m".into(),
            "--iodepth=8".into(),
            "--verify=crc32c".into(),
        ];
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    fio(dir.path(), "fill", &job(&["--do_verify=0"]));
    let dirty_before = d.stats_json(1, None)["raw"]["dirty_lines"]
        .as_u64()
        .unwrap();
    assert!(dirty_before >= 24_000, "{dirty_before}");
    let p = d.ok(&["-P", "-i", "1"]);
    assert!(p.contains("Dirty for [s]"), "{p}");

    let flush = Command::new(BIN)
        .args(["-F", "-i", "1", "--control"])
        .arg(&d.control)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The percentage shows up and rises.
    let deadline = Instant::now() + Duration::from_secs(60);
    let first = loop {
        if let Some(p) = flushing_percent(&d) {
            break p;
        }
        assert!(Instant::now() < deadline, "never saw Flushing in -L");
        std::thread::sleep(Duration::from_millis(20));
    };
    let risen = loop {
        match flushing_percent(&d) {
            Some(p) if p > first => break p,
            Some(_) => {}
            None => panic!("the flush ended before it could be interrupted"),
        }
        assert!(Instant::now() < deadline, "the percentage never rose");
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(risen < 100.0);

    // Ctrl-C on the command: the daemon stops the flush after the current batch.
    // SAFETY: signalling our own child by its pid.
    unsafe { libc::kill(flush.id() as libc::pid_t, libc::SIGINT) };
    let out = flush.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("interrupted"), "{err}");
    assert!(flushing_percent(&d).is_none());
    let dirty_after = d.stats_json(1, None)["raw"]["dirty_lines"]
        .as_u64()
        .unwrap();
    assert!(
        dirty_after > 0 && dirty_after < dirty_before,
        "{dirty_before} -> {dirty_after}"
    );
    // Nothing was lost or mixed up by the interruption.
    fio(dir.path(), "verify1", &job(&["--verify_only"]));

    // A flush run to the end leaves nothing dirty, and the data still reads right.
    d.ok(&["-F", "-i", "1"]);
    assert_eq!(
        d.stats_json(1, None)["raw"]["dirty_lines"].as_u64(),
        Some(0)
    );
    fio(dir.path(), "verify2", &job(&["--verify_only"]));

    // A mode switch that flushes: -L shows the change in progress and -P the flush.
    fio(dir.path(), "refill", &job(&["--do_verify=0"]));
    let mut switch = Command::new(BIN)
        .args(["-Q", "-c", "wt", "-i", "1", "-f", "yes", "--control"])
        .arg(&d.control)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let (mut saw_mode, mut saw_flushing) = (false, false);
    let deadline = Instant::now() + Duration::from_secs(60);
    while !(saw_mode && saw_flushing) {
        let list = d.ok(&["-L"]);
        let cache_row = list.lines().find(|l| l.starts_with("cache")).unwrap_or("");
        saw_mode |= cache_row.contains("wb->wt");
        saw_flushing |= d.ok(&["-P", "-i", "1"]).contains("Flushing (");
        if let Some(status) = switch.try_wait().unwrap() {
            panic!("the switch ended ({status}) before -L showed wb->wt ({saw_mode}) and -P Flushing ({saw_flushing}): {list}");
        }
        assert!(Instant::now() < deadline, "{list}");
        std::thread::sleep(Duration::from_millis(20));
    }
    let out = switch.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let list = d.ok(&["-L"]);
    let cache_row = list.lines().find(|l| l.starts_with("cache")).unwrap();
    assert!(
        cache_row.contains(" wt ") && !cache_row.contains("Flushing"),
        "{list}"
    );
    fio(dir.path(), "verify3", &job(&["--verify_only"]));
}

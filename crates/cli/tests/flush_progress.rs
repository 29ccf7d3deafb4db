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

/// `-L -o json`'s flush figures while a flush runs: (done_lines, total_lines).
fn flush_lines(d: &Daemon) -> Option<(u64, u64)> {
    let v: serde_json::Value = serde_json::from_str(&d.ok(&["-L", "-o", "json"])).ok()?;
    let f = &v["caches"][0]["flush"];
    Some((f["done_lines"].as_u64()?, f["total_lines"].as_u64()?))
}

/// "cleaned 1,234 of 3,000 dirty lines" in `text`, as numbers.
fn cleaned_of(text: &str) -> Option<(u64, u64)> {
    let rest = &text[text.find("cleaned ")? + "cleaned ".len()..];
    let (cleaned, rest) = rest.split_once(" of ")?;
    let (total, _) = rest.split_once(" dirty lines")?;
    let number = |s: &str| s.replace(',', "").parse::<u64>().ok();
    Some((number(cleaned)?, number(total)?))
}

/// Issue 30 case 8: the progress moves while a batch is cleaned (not only when a whole batch of
/// up to 4096 lines is done), and an interrupted `-F` says how many lines it cleaned, the count
/// `-P` confirms (dirty lines before minus after), not "interrupted at 0.0 %".
#[test]
fn an_interrupted_flush_reports_the_lines_it_cleaned() {
    if !need(&["fio"]) {
        return;
    }
    let dir = workdir();
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", "ram:64M", "-i", "1", "-c", "wb"]);
    // A thousand core writes a second, and every dirty line is a write of its own: the one
    // batch of about 3,000 lines takes 3 s.
    d.ok(&["-A", "-i", "1", "-d", "throttle:iops=1000:ram:64M"]);
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    d.ok(&["-X", "-n", "seq-cutoff", "-i", "1", "-p", "never"]);
    // Every other 4 KiB block, so no two dirty lines merge into one core write.
    fio(
        dir.path(),
        "fill",
        &[
            "--name=scattered".into(),
            "--ioengine=nbd".into(),
            format!("--uri={}", d.uri("cas1-1")),
            "--rw=write:4k".into(),
            "--bs=4k".into(),
            "--size=24m".into(),
            "--io_size=12m".into(),
        ],
    );
    let dirty = || {
        d.stats_json(1, None)["raw"]["dirty_lines"]
            .as_u64()
            .expect("dirty_lines")
    };
    let dirty_before = dirty();
    assert!(
        (3000..4096).contains(&dirty_before),
        "one flush batch of scattered lines: {dirty_before}"
    );

    let flush = Command::new(BIN)
        .args(["-F", "-i", "1", "--control"])
        .arg(&d.control)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Within the batch, the count rises line by line, not from 0 straight to the end.
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen = Vec::new();
    loop {
        match flush_lines(&d) {
            Some((done, total)) => {
                assert_eq!(total, dirty_before);
                if seen.last() != Some(&done) {
                    seen.push(done);
                }
                if seen.iter().filter(|&&n| n > 0 && n < total).count() >= 2 {
                    break;
                }
            }
            None if seen.is_empty() => {}
            None => panic!("the flush ended before its progress moved within the batch: {seen:?}"),
        }
        assert!(Instant::now() < deadline, "{seen:?}");
        std::thread::sleep(Duration::from_millis(20));
    }

    // Ctrl-C: the count the command reports is the engine's, and -P agrees with it.
    // SAFETY: signalling our own child by its pid.
    unsafe { libc::kill(flush.id() as libc::pid_t, libc::SIGINT) };
    let out = flush.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    let (cleaned, total) = cleaned_of(&err).unwrap_or_else(|| panic!("no cleaned count: {err}"));
    assert_eq!(total, dirty_before, "{err}");
    let dirty_after = dirty();
    assert!(cleaned > 0 && dirty_after > 0, "{err}");
    assert_eq!(cleaned, dirty_before - dirty_after, "{err}");
    assert!(
        err.contains(&format!(
            "{} stay dirty",
            dirty_after
                .to_string()
                .as_bytes()
                .rchunks(3)
                .rev()
                .map(|c| std::str::from_utf8(c).unwrap())
                .collect::<Vec<_>>()
                .join(",")
        )),
        "{err}"
    );
    assert!(err.contains("iB of "), "{err}");
    assert!(flush_lines(&d).is_none());
}

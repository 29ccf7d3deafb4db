//! `hybridcache top` in a real terminal: tmux runs it in an 80x24 window (what an ssh session
//! gives), capture-pane reads the screen while fio runs, and `q` ends it.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

fn tmux(args: &[&str]) -> String {
    let out = Command::new("tmux").args(args).output().expect("run tmux");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The IOPS column of the `cache 1` row, if the screen shows one.
fn cache_iops(screen: &str) -> Option<u64> {
    let line = screen.lines().find(|l| l.contains("cache 1 "))?;
    line.trim_matches(|c| c == '│' || c == ' ')
        .split_whitespace()
        .nth(4)?
        .parse()
        .ok()
}

struct Session(String);

impl Drop for Session {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.0])
            .output();
    }
}

#[test]
fn top_shows_the_caches_and_moves_while_fio_runs() {
    if !have("tmux") || !have("fio") {
        eprintln!("SKIPPED: tmux and fio are needed (make deps installs them)");
        return;
    }
    let dir = workdir();
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", "ram:64M", "-i", "1", "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", "ram:512M"]);
    let name = format!("hctop{}", std::process::id());
    let session = Session(name.clone());
    let cmd = format!("{BIN} top --control {}", d.control.display());
    let out = Command::new("tmux")
        .args([
            "new-session",
            "-d",
            "-s",
            &name,
            "-x",
            "80",
            "-y",
            "24",
            &cmd,
        ])
        .output()
        .expect("tmux new-session");
    assert!(out.status.success(), "{out:?}");
    let screen = || tmux(&["capture-pane", "-p", "-t", &name]);

    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = screen();
        if s.contains("cache 1") && s.contains(" core 1") && s.contains("hybridcache top") {
            assert_eq!(cache_iops(&s), Some(0), "idle cache:\n{s}");
            break;
        }
        assert!(
            Instant::now() < deadline,
            "top never showed the cache:\n{s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // Every line fits the 80 columns.
    assert!(screen().lines().all(|l| l.chars().count() <= 80));

    let fio = {
        let uri = d.uri("cas1-1");
        let out = dir.path().join("fio.json");
        std::thread::spawn(move || {
            Command::new("fio")
                .args([
                    "--name=w",
                    "--ioengine=nbd",
                    &format!("--uri={uri}"),
                    "--rw=randwrite",
                    "--bs=4k",
                    "--size=32m",
                    "--iodepth=4",
                    "--time_based=1",
                    "--runtime=5",
                    &format!("--output={}", out.display()),
                    "--output-format=json",
                ])
                .status()
                .expect("fio")
        })
    };
    // The figures move: IOPS above zero while fio writes.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = screen();
        if cache_iops(&s).is_some_and(|v| v > 0) {
            break;
        }
        assert!(Instant::now() < deadline, "IOPS never moved:\n{s}");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(fio.join().unwrap().success());

    tmux(&["send-keys", "-t", &name, "q"]);
    let deadline = Instant::now() + Duration::from_secs(10);
    while Command::new("tmux")
        .args(["has-session", "-t", &name])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        assert!(Instant::now() < deadline, "q did not end top");
        std::thread::sleep(Duration::from_millis(100));
    }
    drop(session);
}

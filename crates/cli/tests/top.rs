//! `hybridcache top` in a real terminal: tmux runs it in an 80x24 window (what an ssh session
//! gives), capture-pane reads the screen while fio runs; with a second cache, Tab selects it and
//! `s` sorts by IOPS, dirty % and id again; `q` ends it.

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

/// The cells of the `cache 1` row from the state on (the name split off): state (mode and
/// status), IOPS, MB/s, hit%, occ%, dirty%, clean, p99us, errs, conns.
fn cache_cells(screen: &str) -> Option<Vec<String>> {
    let line = screen.lines().find(|l| l.contains("cache 1 "))?;
    let cells: Vec<String> = line
        .trim_matches(|c| c == '│' || c == ' ')
        .split_whitespace()
        .skip(2)
        .map(str::to_string)
        .collect();
    Some(cells)
}

/// The screen line of cache `id`'s row in the table.
fn row(screen: &str, id: u16) -> Option<usize> {
    let label = format!("cache {id} ");
    screen.lines().position(|l| l.contains(&label))
}

/// The cache whose detail the screen shows ("cache 2: 4096 lines of 4 KiB, alru").
fn detail(screen: &str) -> Option<u16> {
    let at = screen.find(" lines of ")?;
    let head = screen[..at].rsplit("cache ").next()?;
    head.split(':').next()?.parse().ok()
}

struct Session(String);

impl Drop for Session {
    fn drop(&mut self) {
        let _ = Command::new("tmux")
            .args(["kill-session", "-t", &self.0])
            .output();
    }
}

fn wait_for(screen: &dyn Fn() -> String, what: &str, ok: &dyn Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = screen();
        if ok(&s) {
            return s;
        }
        assert!(Instant::now() < deadline, "never saw {what}:\n{s}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// `top -i N` of a cache that does not exist is refused before the terminal is taken over,
/// with the caches that do exist.
#[test]
fn top_of_a_cache_that_does_not_exist_is_an_error() {
    let dir = workdir();
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", "ram:16M", "-i", "1"]);
    let out = d.cli(&["top", "-i", "9"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(
        err.trim_end(),
        "hybridcache: cache 9 does not exist (running: 1)",
        "{err}"
    );
    d.ok(&["-T", "-i", "1"]);
    let err = String::from_utf8_lossy(&d.cli(&["top", "-i", "9"]).stderr).into_owned();
    assert!(
        err.contains("cache 9 does not exist (no caches running)"),
        "{err}"
    );
}

#[test]
fn top_shows_the_caches_and_moves_while_fio_runs() {
    if !need(&["tmux", "fio"]) {
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
    // Every line fits the 80 columns, the new columns too.
    let s = screen();
    assert!(s.lines().all(|l| l.chars().count() <= 80), "{s}");
    let header = s.lines().find(|l| l.contains("IOPS")).unwrap_or_default();
    let names: Vec<&str> = header
        .trim_matches(|c| c == '│' || c == ' ')
        .split_whitespace()
        .collect();
    assert_eq!(
        names,
        ["state", "IOPS", "MB/s", "hit%", "occ%", "dirty%", "clean", "p99us", "errs", "conns"],
        "{s}"
    );
    // Idle and empty: nothing cached, no error, no connection.
    let idle = cache_cells(&s).unwrap_or_default();
    assert_eq!(idle.len(), 11, "{s}");
    assert_eq!(
        (idle[5].as_str(), idle[9].as_str(), idle[10].as_str()),
        ("0.0", "0", "0"),
        "{s}"
    );

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
    // The figures move: IOPS above zero while fio writes, through one NBD connection, and the
    // cache fills.
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut connected = false;
    loop {
        let s = screen();
        let cells = cache_cells(&s).unwrap_or_default();
        connected |= cells.get(10).is_some_and(|c| c == "1");
        if cache_iops(&s).is_some_and(|v| v > 0) && connected {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "IOPS or the connection never showed:\n{s}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(fio.join().unwrap().success());
    let s = wait_for(&screen, "occupancy", &|s| {
        cache_cells(s)
            .and_then(|c| c.get(5)?.parse::<f64>().ok())
            .is_some_and(|o| o > 0.0)
    });
    let occ: f64 = cache_cells(&s).unwrap_or_default()[5]
        .parse()
        .unwrap_or(0.0);
    let stats = d.stats_json(1, None);
    let want = stats["usage"]["occupancy"]["percent"]
        .as_f64()
        .unwrap_or(-1.0);
    assert!(
        (occ - want).abs() < 0.2,
        "occupancy {occ} vs -P {want}:\n{s}"
    );

    // A second cache, dirtier than the first (cache 1 has at most 32 of its 64 MiB dirty).
    d.ok(&["-S", "-d", "ram:16M", "-i", "2", "-c", "wb"]);
    d.ok(&["-A", "-i", "2", "-d", "ram:64M"]);
    d.ok(&["-X", "-n", "seq-cutoff", "-i", "2", "-p", "never"]);
    let mut c2 = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas2-1").unwrap();
    for i in 0..14u64 {
        c2.write(&[0x77; 1 << 20], i << 20, false).unwrap();
    }
    let wait = |what: &str, ok: &dyn Fn(&str) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let s = screen();
            if ok(&s) {
                return s;
            }
            assert!(
                Instant::now() < deadline,
                "never saw {what}:
{s}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let s = wait("cache 2", &|s| row(s, 1).is_some() && row(s, 2).is_some());
    // Sorted by id, the first cache is selected: its detail shows.
    assert!(row(&s, 1) < row(&s, 2), "{s}");
    assert!(detail(&s) == Some(1), "{s}");
    tmux(&["send-keys", "-t", &name, "Tab"]);
    wait("cache 2 selected", &|s| detail(s) == Some(2));
    tmux(&["send-keys", "-t", &name, "s"]);
    wait("sort by IOPS", &|s| s.contains("sort: IOPS"));
    tmux(&["send-keys", "-t", &name, "s"]);
    // By dirty %: cache 2 comes first, and stays the selected one.
    let s = wait("sort by dirty %", &|s| {
        s.contains("sort: dirty %") && row(s, 2) < row(s, 1)
    });
    assert_eq!(detail(&s), Some(2), "{s}");
    tmux(&["send-keys", "-t", &name, "s"]);
    wait("sort by id", &|s| {
        s.contains("sort: id") && row(s, 1) < row(s, 2)
    });

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

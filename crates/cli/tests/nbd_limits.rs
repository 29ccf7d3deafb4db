//! The daemon's NBD limits: command-line flags and `[daemon]` keys reach the server, the
//! command line wins over the file, refusals appear in the daemon's log with the peer, and a
//! limit that cannot work is refused at start.

mod common;

use std::time::{Duration, Instant};

use common::{daemon_refuses_to_start, workdir, Daemon};
use hybridcache_nbd::Client;

fn wait_log(d: &Daemon, what: &[&str]) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if d.log_text()
            .lines()
            .any(|l| what.iter().all(|w| l.contains(w)))
        {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn limits_from_flags_and_file_are_enforced_and_logged() {
    let dir = workdir();
    let cfg = dir.path().join("hybridcache.toml");
    std::fs::write(
        &cfg,
        "[daemon]\nnbd_max_connections_per_export = 1\nnbd_max_connections_per_client = 7\n\
         nbd_memory_limit = \"384M\"\nnbd_stall_timeout = 0\n\n\
         [[cache]]\nid = 1\ndevice = \"ram:16M\"\n\n\
         [[core]]\ncache = 1\nid = 1\ndevice = \"ram:16M\"\n\n\
         [[core]]\ncache = 1\nid = 2\ndevice = \"ram:16M\"\n",
    )
    .unwrap();
    // The flag overrides the file's per-client limit.
    let d = Daemon::start_with(
        dir.path(),
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--nbd-max-connections-per-client",
            "2",
            "--nbd-max-connections",
            "100",
        ],
    );
    assert!(
        wait_log(
            &d,
            &["NBD limits: 100 connections, 2 per client, 1 per export, memory 384 MiB"]
        ),
        "{}",
        d.log_text()
    );
    let mut a = Client::connect_unix(&d.nbd, "cas1-1").unwrap();
    // cas1-1 is full: a second connection to it is refused, one to cas1-2 is not.
    assert!(Client::connect_unix(&d.nbd, "cas1-1").is_err());
    assert!(
        wait_log(
            &d,
            &[
                "connection refused",
                "unix uid",
                "cas1-1",
                "max_connections_per_export"
            ]
        ),
        "{}",
        d.log_text()
    );
    // The refused connection counts against this user until the daemon has seen it close.
    let deadline = Instant::now() + Duration::from_secs(5);
    let _b = loop {
        match Client::connect_unix(&d.nbd, "cas1-2") {
            Ok(c) => break c,
            Err(e) => assert!(Instant::now() < deadline, "{e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // Two connections from this user: a third is refused at once.
    assert!(Client::connect_unix(&d.nbd, "cas1-2").is_err());
    assert!(
        wait_log(
            &d,
            &[
                "connection refused",
                "unix uid",
                "max_connections_per_client"
            ]
        ),
        "{}",
        d.log_text()
    );
    // The admitted clients are served.
    a.write(&[9u8; 4096], 0, false).unwrap();
    let mut back = [0u8; 4096];
    a.read(&mut back, 0).unwrap();
    assert_eq!(back, [9u8; 4096]);
}

#[test]
fn impossible_limits_stop_the_daemon_from_starting() {
    let dir = workdir();
    for (args, msg) in [
        (
            &["--nbd-memory-limit", "64M", "--nbd-max-connections", "256"][..],
            "too small for 256 connections",
        ),
        (&["--nbd-max-connections", "0"][..], "at least 1"),
        (&["--nbd-handshake-timeout", "0"][..], "at least 1 second"),
    ] {
        let err = daemon_refuses_to_start(dir.path(), args);
        assert!(err.contains(msg), "{args:?}: {err}");
    }
}

//! The daemon's threads follow the work, not the NBD connection count (issue 32): 256 idle
//! connections to an export cost it fewer than 64 threads in all, and every one of them still
//! serves when its client speaks again. (The daemon used to run 16 worker threads per
//! connection whatever the connection did: 64 idle connections cost 1,031 threads.)

mod common;

use std::time::{Duration, Instant};

use common::{workdir, Daemon};
use hybridcache_nbd::Client;

const CONNECTIONS: usize = 256;
const MAX_THREADS: usize = 64;

fn threads(d: &Daemon) -> usize {
    let pid = d.pid().expect("daemon running");
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .expect("/proc/PID/task")
        .count()
}

/// The daemon's thread count once it has settled below `MAX_THREADS` (connections that just
/// went quiet may keep their threads a moment), or the last count seen after 10 s.
fn settled_threads(d: &Daemon) -> usize {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let n = threads(d);
        if n < MAX_THREADS || Instant::now() >= deadline {
            return n;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn idle_nbd_connections_cost_the_daemon_no_threads() {
    let dir = workdir();
    // The default limits keep one local process to 64 connections and one export to 192; this
    // test is one process holding 256 to one export.
    let d = Daemon::start_with(
        dir.path(),
        &[
            "--nbd-max-connections-per-client",
            "256",
            "--nbd-max-connections-per-user",
            "256",
            "--nbd-max-connections-per-export",
            "256",
        ],
    );
    d.ok(&["-S", "-d", "ram:16M", "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", "ram:16M"]);
    let idle_daemon = threads(&d);
    let mut clients: Vec<Client> = (0..CONNECTIONS)
        .map(|i| {
            Client::connect_unix(&d.nbd, "cas1-1").unwrap_or_else(|e| panic!("connection {i}: {e}"))
        })
        .collect();
    let idle = settled_threads(&d);
    eprintln!(
        "daemon threads: {idle_daemon} without clients, {idle} with {CONNECTIONS} idle connections"
    );
    assert!(
        idle < MAX_THREADS,
        "{idle} daemon threads with {CONNECTIONS} idle NBD connections (want < {MAX_THREADS})"
    );
    // Each connection serves again: a write and its read back.
    for (i, c) in clients.iter_mut().enumerate() {
        let data = vec![i as u8; 4096];
        let off = (i as u64 % 4096) * 4096;
        c.write(&data, off, false)
            .unwrap_or_else(|e| panic!("write on {i}: {e}"));
        let mut back = vec![0u8; 4096];
        c.read(&mut back, off)
            .unwrap_or_else(|e| panic!("read on {i}: {e}"));
        assert!(back == data, "connection {i} read back other data");
    }
    let quiet = settled_threads(&d);
    eprintln!("daemon threads after a request on each, quiet again: {quiet}");
    assert!(
        quiet < MAX_THREADS,
        "{quiet} daemon threads after the requests"
    );
}

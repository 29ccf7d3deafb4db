//! A core that hangs (rather than fails) does not hold up another core's flush (issue 30,
//! case 7): core 1 is an NBD export behind nbdkit's delay filter, whose writes take ten minutes,
//! core 2 a file. Both hold dirty data. `-F -j 2` and `-F` finish within the test's own bound:
//! core 2's data reaches its file, core 1's flush is reported timed out, and the daemon still
//! stops promptly.

mod common;

use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{nbdkit, need, sparse_file, workdir, Daemon, BIN};
use hybridcache_nbd::Client;

/// Run the CLI against `d`, killing it after `limit`: a hang is a failure, not a stuck CI job.
fn cli_within(d: &Daemon, args: &[&str], limit: Duration) -> Output {
    let mut child = Command::new(BIN)
        .args(args)
        .arg("--control")
        .arg(&d.control)
        .env_remove("HYBRIDCACHE_CONTROL")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the CLI");
    let deadline = Instant::now() + limit;
    while child.try_wait().expect("wait for the CLI").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "hybridcache {args:?} did not finish within {limit:?}\n{}",
                d.log_text()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("CLI output")
}

fn dirty(d: &Daemon, core: u16) -> u64 {
    d.stats_json(1, Some(core))["usage"]["dirty"]["count"]
        .as_u64()
        .unwrap_or(u64::MAX)
}

#[test]
fn a_hung_core_does_not_hold_up_another_cores_flush() {
    if !need(&["nbdkit"]) {
        return;
    }
    let dir = workdir();
    let sock = dir.path().join("hung.sock");
    let hung_file = dir.path().join("hung.img");
    let core2 = dir.path().join("core2.img");
    let cache = dir.path().join("cache.img");
    sparse_file(&hung_file, 32 << 20);
    sparse_file(&core2, 32 << 20);
    sparse_file(&cache, 64 << 20);
    let _hung = nbdkit(
        &sock,
        &[
            "--filter=delay".into(),
            "file".into(),
            hung_file.display().to_string(),
            "wdelay=600".into(),
        ],
    );
    let mut d = Daemon::start_with(dir.path(), &["--core-flush-timeout", "3"]);
    let spec = format!("file:{}", cache.display());
    d.ok(&["-S", "-d", &spec, "-c", "wb"]);
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    let remote = format!("nbd+unix:///?socket={}", sock.display());
    d.ok(&["-A", "-i", "1", "-d", &remote]);
    d.ok(&["-A", "-i", "1", "-d", core2.to_str().expect("UTF-8 path")]);

    let data: Vec<u8> = (0..(2 << 20)).map(|i| (i % 251) as u8).collect();
    for export in ["cas1-1", "cas1-2"] {
        let mut c = Client::connect_unix(&d.nbd, export).expect("connect");
        c.write(&data, 0, false).expect("write-back write");
        c.flush().expect("client flush");
        c.disconnect().expect("disconnect");
    }
    assert!(dirty(&d, 1) > 0 && dirty(&d, 2) > 0);

    // Core 1's own flush hangs in its device; it is reported timed out on core 1.
    let started = Instant::now();
    let out = cli_within(&d, &["-F", "-i", "1", "-j", "1"], Duration::from_secs(40));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "core 1 cannot have been flushed");
    assert!(
        err.contains("core 1") && err.contains("timed out after 3 s"),
        "{err}"
    );
    assert!(started.elapsed() < Duration::from_secs(20), "{err}");

    // Core 2 alone: flushed while core 1's flush is still stuck in the device.
    let out = cli_within(&d, &["-F", "-i", "1", "-j", "2"], Duration::from_secs(30));
    assert!(
        out.status.success(),
        "-F -j 2 failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(dirty(&d, 2), 0);

    // Every core: core 2 completes (nothing left to do), core 1 is reported, exit non-zero.
    let mut c = Client::connect_unix(&d.nbd, "cas1-2").expect("connect");
    c.write(&data, 8 << 20, false).expect("write-back write");
    c.disconnect().expect("disconnect");
    let out = cli_within(&d, &["-F", "-i", "1"], Duration::from_secs(30));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "core 1 cannot have been flushed");
    assert!(
        err.contains("core 1") && err.contains("timed out") && err.contains("core 2 flushed"),
        "{err}"
    );
    assert_eq!(dirty(&d, 2), 0, "core 2 was flushed by -F");
    assert!(dirty(&d, 1) > 0, "core 1's lines stay dirty");
    let on_file = std::fs::read(&core2).expect("read core 2");
    assert!(
        on_file[..data.len()] == data[..] && on_file[8 << 20..(8 << 20) + data.len()] == data[..]
    );

    // A stop (SIGTERM) does not wait for the hung core either.
    let started = Instant::now();
    d.stop();
    assert!(
        started.elapsed() < Duration::from_secs(15),
        "the daemon took {:?} to stop",
        started.elapsed()
    );
}

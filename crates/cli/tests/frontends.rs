//! Front-ends through the daemon on this host: choosing one per core, remembering it across a
//! kill -9 and a load, and refusing what cannot be served without changing anything. The ublk
//! block device itself needs the kernel's ublk driver, which only the guest has
//! (scripts/guest/ublk-daemon-guest.sh).

mod common;

use std::process::Command;

use common::{daemon_refuses_to_start, sparse_file, workdir, Daemon, BIN};

fn ublk_driver_here() -> bool {
    std::path::Path::new("/dev/ublk-control").exists()
}

/// The front-end each core had comes back with `--load` even when the restarted daemon's
/// default is another one: an NBD core must not turn into a ublk device (its clients would
/// find no export).
#[test]
fn a_core_keeps_its_front_end_across_a_kill_and_a_load() {
    let dir = workdir();
    let cache = dir.path().join("cache.img");
    let core = dir.path().join("core.img");
    sparse_file(&cache, 16 << 20);
    sparse_file(&core, 64 << 20);
    let mut d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", cache.to_str().unwrap(), "-c", "wb"]);
    d.ok(&[
        "-A",
        "-i",
        "1",
        "-d",
        core.to_str().unwrap(),
        "--frontend",
        "nbd",
    ]);
    {
        let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-1").expect("connect");
        c.write(&[0x5a; 4096], 0, true).expect("write");
        c.disconnect().unwrap();
    }
    d.kill();

    let d = Daemon::start_with(dir.path(), &["--frontend", "ublk"]);
    d.ok(&["-S", "-d", cache.to_str().unwrap(), "--load"]);
    let csv = d.ok(&["-L", "-o", "csv"]);
    assert!(csv.contains(",cas1-1,0"), "{csv}");
    let json: serde_json::Value = serde_json::from_str(&d.ok(&["-L", "-o", "json"])).unwrap();
    assert_eq!(json["caches"][0]["cores"][0]["frontend"], "nbd", "{json}");
    let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-1").expect("connect");
    let mut buf = [0u8; 4096];
    c.read(&mut buf, 0).expect("read");
    assert!(buf.iter().all(|&b| b == 0x5a));
    c.disconnect().unwrap();
}

/// Where the kernel has no ublk driver, a ublk core is refused with the reason, and nothing
/// changes: no core is left behind, and the same device can then be added over NBD.
#[test]
fn a_ublk_core_that_cannot_be_served_changes_nothing() {
    if ublk_driver_here() {
        // This host can serve it: the guest test covers that path.
        return;
    }
    let dir = workdir();
    let cache = dir.path().join("cache.img");
    let core = dir.path().join("core.img");
    sparse_file(&cache, 16 << 20);
    sparse_file(&core, 64 << 20);
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", cache.to_str().unwrap()]);
    let e = d.fails(&[
        "-A",
        "-i",
        "1",
        "-d",
        core.to_str().unwrap(),
        "--frontend",
        "ublk",
    ]);
    assert!(
        e.contains("cannot export cas1-1: cannot create a ublk device"),
        "{e}"
    );
    let csv = d.ok(&["-L", "-o", "csv"]);
    assert!(!csv.contains("core,"), "{csv}");
    assert_eq!(
        d.ok(&["-A", "-i", "1", "-d", core.to_str().unwrap()]),
        "core 1 added to cache 1, exported as cas1-1\n"
    );
}

#[test]
fn unknown_front_ends_are_refused_on_the_command_line_and_in_the_configuration() {
    let out = Command::new(BIN)
        .args(["daemon", "--frontend", "scsi"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("scsi"));

    let dir = workdir();
    let cfg = dir.path().join("hc.toml");
    std::fs::write(
        &cfg,
        "[[cache]]\nid = 1\ndevice = \"ram:16M\"\n\n[[core]]\ncache = 1\nid = 1\n\
         device = \"ram:16M\"\nfrontend = \"scsi\"\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .arg("daemon")
        .arg("--control")
        .arg(dir.path().join("c.sock"))
        .arg("--nbd-socket")
        .arg(dir.path().join("n.sock"))
        .arg("--state-dir")
        .arg(dir.path())
        .arg("--config")
        .arg(&cfg)
        .env_remove("HYBRIDCACHE_CONTROL")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("configuration refused, nothing was changed")
            && err.contains("unknown front-end 'scsi'"),
        "{err}"
    );
}

/// A queue count the ublk driver cannot take stops the daemon before it serves anything, from
/// the command line and from `[daemon]` alike, instead of failing at the first ublk core.
#[test]
fn impossible_ublk_queue_counts_stop_the_daemon_from_starting() {
    let dir = workdir();
    let cfg = dir.path().join("hc.toml");
    std::fs::write(&cfg, "[daemon]\nublk_queues = 5000\n").unwrap();
    for (args, msg) in [
        (&["--ublk-queues", "0"][..], "between 1 and 4096, not 0"),
        (&["--config", cfg.to_str().unwrap()][..], "not 5000"),
    ] {
        let err = daemon_refuses_to_start(dir.path(), args);
        assert!(err.contains(msg), "{args:?}: {err}");
    }
}

/// A client that has disconnected does not hold off a stop or a removal issued right after:
/// its connection may still be winding down on the server's side when the next command
/// arrives (seen as a refused `-T` in a test that disconnected and stopped at once), and a
/// script that unmounts or disconnects and then stops must not be refused for that.
#[test]
fn a_client_that_just_disconnected_does_not_hold_off_remove_or_stop() {
    let dir = workdir();
    let cache = dir.path().join("cache.img");
    let core = dir.path().join("core.img");
    sparse_file(&cache, 16 << 20);
    sparse_file(&core, 32 << 20);
    let d = Daemon::start(dir.path());
    // Write-through: a removal never meets dirty data, so only the client can refuse it.
    d.ok(&["-S", "-d", cache.to_str().unwrap(), "-c", "wt"]);
    for round in 0..50 {
        d.ok(&["-A", "-i", "1", "-j", "1", "-d", core.to_str().unwrap()]);
        let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-1").expect("connect");
        c.write(&[round as u8; 4096], 0, true).expect("write");
        c.disconnect().unwrap();
        let out = d.cli(&["-R", "-i", "1", "-j", "1"]);
        assert!(
            out.status.success(),
            "round {round}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    assert!(
        hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-1").is_err(),
        "the export outlived its core"
    );
    d.ok(&["-A", "-i", "1", "-j", "1", "-d", core.to_str().unwrap()]);
    let c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-1").expect("connect");
    c.disconnect().unwrap();
    d.ok(&["-T", "-i", "1"]);
}

/// A cache's export says it is rotational exactly when its core is a disk, as dm-cache and
/// bcache devices do: a client's kernel then treats it as the disk it fronts (Ceph's BlueStore
/// defers small writes only there, which is what keeps its random writes in the cache;
/// docs/ceph.md). A core in memory is served as not rotational.
#[test]
fn an_export_is_rotational_when_its_core_is_a_disk() {
    let dir = workdir();
    let cache = dir.path().join("cache.img");
    sparse_file(&cache, 16 << 20);
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", cache.to_str().unwrap(), "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", "hdd:size=64M,nodata"]);
    d.ok(&["-A", "-i", "1", "-d", "ram:64M"]);
    let rotational = |export: &str| {
        let c = hybridcache_nbd::Client::connect_unix(&d.nbd, export).expect("connect");
        let flag = c.flags() & hybridcache_nbd::proto::FLAG_ROTATIONAL != 0;
        c.disconnect().unwrap();
        flag
    };
    assert!(
        rotational("cas1-1"),
        "a cache in front of an HDD must say rotational"
    );
    assert!(!rotational("cas1-2"), "a cache in front of memory must not");
}

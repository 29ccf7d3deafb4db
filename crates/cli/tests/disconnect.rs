//! `--script --disconnect-cache` / `--script --connect-cache`: a cache device goes away and
//! comes back (or is replaced) while NBD clients keep their connection to the exports.
//!
//! The clients are real NBD clients over the daemon's socket: the crate's own (one connection
//! held across the whole test) and fio's nbd engine with crc32c verification.

mod common;

use std::path::Path;
use std::time::Duration;

use common::{file_cache, fio, need, sparse_file, workdir, Daemon, FileCache};
use hybridcache_nbd::client::Client;

const MIB: u64 = 1 << 20;

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_add((i / 512) as u8) ^ (i as u8))
        .collect()
}

fn client(d: &Daemon) -> Client {
    Client::connect_unix(&d.nbd, "cas1-1").expect("NBD connection to cas1-1")
}

fn read(c: &mut Client, offset: u64, len: usize) -> Vec<u8> {
    let mut buf = vec![0u8; len];
    c.read(&mut buf, offset).expect("read");
    buf
}

/// Compares data without printing megabytes of it.
#[track_caller]
fn same(got: &[u8], want: &[u8]) {
    if let Some(i) = (0..want.len()).find(|i| got.get(*i) != want.get(*i)) {
        panic!("data differs at byte {i} of {}", want.len());
    }
    assert_eq!(got.len(), want.len());
}

fn file_bytes(path: &Path, offset: u64, len: usize) -> Vec<u8> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path).expect("open");
    let mut buf = vec![0u8; len];
    f.read_exact_at(&mut buf, offset).expect("read file");
    buf
}

/// `-L`'s JSON entry of cache 1 (None when it is not listed).
fn listed(d: &Daemon) -> Option<serde_json::Value> {
    let v: serde_json::Value = serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("JSON");
    let caches = v
        .as_array()
        .cloned()
        .or_else(|| v["caches"].as_array().cloned())
        .unwrap_or_default();
    caches.into_iter().find(|c| c["id"] == 1)
}

fn status(d: &Daemon) -> String {
    listed(d).map_or("(not listed)".into(), |c| {
        c["status"].as_str().unwrap_or_default().to_string()
    })
}

fn dirty_lines(d: &Daemon) -> u64 {
    d.stats_json(1, None)["usage"]["dirty"]["count"]
        .as_u64()
        .expect("dirty count")
}

#[test]
fn a_request_made_while_disconnected_completes_after_connect_on_one_connection() {
    let FileCache {
        dir,
        core,
        spec,
        daemon: d,
        ..
    } = file_cache(64 * MIB, 64 * MIB, &["-c", "wb"]);
    let mut c = client(&d);
    let a = pattern(1, 64 << 10);
    c.write(&a, 0, false).expect("write before");

    let out = d.ok(&["--script", "--disconnect-cache", "-i", "1"]);
    assert!(out.contains("disconnected"), "{out}");
    assert_eq!(status(&d), "Disconnected");
    let entry = listed(&d).expect("listed");
    assert_eq!(entry["cores"][0]["status"], "Frozen", "{entry}");
    // The flush before the disconnect put the write-back data on the core.
    same(&file_bytes(&core, 0, a.len()), &a);

    // Frozen: the request waits for the connect.
    let b = pattern(2, 64 << 10);
    let b2 = b.clone();
    let writer = std::thread::spawn(move || {
        c.write(&b2, 4 * MIB, false)
            .expect("write while disconnected");
        c
    });
    std::thread::sleep(Duration::from_millis(700));
    assert!(
        !writer.is_finished(),
        "a request to a disconnected cache must wait, not fail or complete"
    );
    let out = d.ok(&["--script", "--connect-cache", "-d", &spec]);
    assert!(out.contains("loaded from"), "{out}");
    let mut c = writer.join().expect("writer");
    assert_eq!(status(&d), "Running");
    same(&read(&mut c, 0, a.len()), &a);
    same(&read(&mut c, 4 * MIB, b.len()), &b);
    c.flush().expect("flush");
    drop(c);
    // And it went through the cache: after a flush of the cache the core holds it.
    d.ok(&["-F", "-i", "1"]);
    same(&file_bytes(&core, 4 * MIB, b.len()), &b);
    drop(dir);
}

#[test]
fn pass_through_serves_the_core_and_no_stale_line_after_connect() {
    let FileCache {
        dir: _dir,
        core,
        spec,
        daemon: d,
        ..
    } = file_cache(64 * MIB, 64 * MIB, &["-c", "wt"]);
    let mut c = client(&d);
    let old = pattern(3, 128 << 10);
    c.write(&old, MIB, false).expect("write");
    // Read it so it is certainly cached.
    same(&read(&mut c, MIB, old.len()), &old);

    d.ok(&[
        "--script",
        "--disconnect-cache",
        "-i",
        "1",
        "--pass-through",
    ]);
    let entry = listed(&d).expect("listed");
    assert_eq!(entry["status"], "Disconnected", "{entry}");
    assert_eq!(entry["cores"][0]["status"], "Pass-through", "{entry}");
    // Served while disconnected, straight from and to the core.
    let new = pattern(4, 128 << 10);
    c.write(&new, MIB, false).expect("write in pass-through");
    same(&read(&mut c, MIB, new.len()), &new);
    c.flush().expect("flush in pass-through");
    same(&file_bytes(&core, MIB, new.len()), &new);

    // The same device comes back purged: a new cache, which must not serve `old`.
    let out = d.ok(&["--script", "--connect-cache", "-d", &spec]);
    assert!(out.contains("a new cache started on"), "{out}");
    assert_eq!(status(&d), "Running");
    same(&read(&mut c, MIB, new.len()), &new);
    // And the cache works again: hits after a read.
    same(&read(&mut c, MIB, new.len()), &new);
}

#[test]
fn a_cache_device_is_replaced_by_a_blank_one_under_live_exports() {
    let FileCache {
        dir,
        core,
        daemon: d,
        ..
    } = file_cache(64 * MIB, 64 * MIB, &["-c", "wb"]);
    d.ok(&["-X", "-n", "cleaning", "-p", "nop", "-i", "1"]);
    let mut c = client(&d);
    let a = pattern(5, 256 << 10);
    c.write(&a, 0, false).expect("write");
    d.ok(&["--script", "--disconnect-cache", "-i", "1"]);
    let fresh = dir.path().join("new-cache.img");
    sparse_file(&fresh, 64 * MIB);
    let out = d.ok(&[
        "--script",
        "--connect-cache",
        "-d",
        fresh.to_str().expect("UTF-8"),
    ]);
    assert!(out.contains("a new cache started on"), "{out}");
    let entry = listed(&d).expect("listed");
    assert!(
        entry["device"]
            .as_str()
            .is_some_and(|s| s.ends_with("new-cache.img")),
        "{entry}"
    );
    // Mode and parameters followed the cache to its new device.
    assert_eq!(entry["mode"], "wb", "{entry}");
    assert!(d.ok(&["-G", "-n", "cleaning", "-i", "1"]).contains("nop"));
    same(&read(&mut c, 0, a.len()), &a);
    same(&file_bytes(&core, 0, a.len()), &a);
}

#[test]
fn no_flush_keeps_dirty_data_and_only_that_device_connects() {
    let FileCache {
        dir,
        cache,
        core,
        spec,
        daemon: d,
    } = file_cache(64 * MIB, 64 * MIB, &["-c", "wb"]);
    d.ok(&["-X", "-n", "cleaning", "-p", "nop", "-i", "1"]);
    let mut c = client(&d);
    let a = pattern(6, 64 << 10);
    c.write(&a, 2 * MIB, false).expect("write");
    c.flush().expect("flush");

    d.ok(&["--script", "--disconnect-cache", "-i", "1", "--no-flush"]);
    assert_eq!(status(&d), "Disconnected");
    assert!(
        file_bytes(&core, 2 * MIB, a.len()) != a,
        "--no-flush must leave the dirty data on the cache device"
    );

    // A blank device: refused while dirty data is recorded on the old one.
    let blank = dir.path().join("blank.img");
    sparse_file(&blank, 64 * MIB);
    let err = d.fails(&[
        "--script",
        "--connect-cache",
        "-d",
        blank.to_str().expect("UTF-8"),
    ]);
    assert!(err.contains("dirty"), "{err}");
    // A copy of the cache device (its metadata, another device): refused too.
    let copy = dir.path().join("copy.img");
    std::fs::copy(&cache, &copy).expect("copy the cache device");
    let err = d.fails(&[
        "--script",
        "--connect-cache",
        "-d",
        copy.to_str().expect("UTF-8"),
    ]);
    assert!(err.contains("not the device"), "{err}");
    assert_eq!(
        status(&d),
        "Disconnected",
        "a refused connect changes nothing"
    );

    // The cache device itself: loaded, dirty data and all.
    let out = d.ok(&["--script", "--connect-cache", "-d", &spec]);
    assert!(out.contains("loaded from"), "{out}");
    same(&read(&mut c, 2 * MIB, a.len()), &a);
    d.ok(&["-F", "-i", "1"]);
    same(&file_bytes(&core, 2 * MIB, a.len()), &a);
}

#[test]
fn refusals_change_nothing() {
    let FileCache {
        dir: _dir,
        spec,
        daemon: d,
        ..
    } = file_cache(64 * MIB, 64 * MIB, &["-c", "wb"]);
    d.ok(&["-X", "-n", "cleaning", "-p", "nop", "-i", "1"]);
    let mut c = client(&d);
    let a = pattern(7, 64 << 10);
    c.write(&a, 0, false).expect("write");
    let dirty = dirty_lines(&d);
    assert!(dirty > 0);

    let err = d.fails(&[
        "--script",
        "--disconnect-cache",
        "-i",
        "1",
        "--pass-through",
        "--no-flush",
    ]);
    assert!(
        err.contains("--no-flush is not allowed with --pass-through"),
        "{err}"
    );
    assert_eq!(status(&d), "Running");

    let err = d.fails(&["--script", "--disconnect-cache", "-i", "7"]);
    assert!(err.contains("cache 7 does not exist"), "{err}");

    let err = d.fails(&["--script", "--connect-cache", "-d", &spec]);
    assert!(err.contains("no cache is disconnected"), "{err}");

    // Still served through the cache, dirty data in place.
    assert_eq!(status(&d), "Running");
    same(&read(&mut c, 0, a.len()), &a);
    assert_eq!(dirty_lines(&d), dirty, "the dirty data stays where it was");
}

#[test]
fn a_volatile_cache_is_not_disconnected_with_no_flush() {
    let dir = workdir();
    let core = dir.path().join("core.img");
    sparse_file(&core, 64 * MIB);
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", "ram:64M", "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", core.to_str().expect("UTF-8")]);
    let mut c = client(&d);
    let a = pattern(8, 64 << 10);
    c.write(&a, 0, false).expect("write");
    let err = d.fails(&["--script", "--disconnect-cache", "-i", "1", "--no-flush"]);
    assert!(err.contains("RAM"), "{err}");
    assert_eq!(status(&d), "Running");
    same(&read(&mut c, 0, a.len()), &a);

    // With a flush it goes, and a RAM device (new, as RAM always is) takes it back.
    d.ok(&["--script", "--disconnect-cache", "-i", "1"]);
    let out = d.ok(&["--script", "--connect-cache", "-d", "ram:32M"]);
    assert!(out.contains("a new cache started on"), "{out}");
    same(&read(&mut c, 0, a.len()), &a);
}

#[test]
fn a_disconnected_cache_is_stopped_with_t_and_refuses_r() {
    let FileCache {
        dir: _dir,
        spec,
        daemon: d,
        ..
    } = file_cache(64 * MIB, 64 * MIB, &["-c", "wt"]);
    d.ok(&["--script", "--disconnect-cache", "-i", "1"]);
    let err = d.fails(&["-R", "-i", "1", "-j", "1"]);
    assert!(err.contains("disconnected"), "{err}");
    let err = d.fails(&["-S", "-d", &spec, "--load"]);
    assert!(err.contains("disconnected"), "{err}");
    d.ok(&["-T", "-i", "1"]);
    assert_eq!(status(&d), "(not listed)");
    // Its exports are gone, and its device loads as a stopped cache's would.
    assert!(Client::connect_unix(&d.nbd, "cas1-1").is_err());
    d.ok(&["-S", "-d", &spec, "--load"]);
    assert_eq!(status(&d), "Running");
    client(&d);
}

#[test]
fn fio_verifies_across_disconnect_and_connect() {
    if !need(&["fio"]) {
        return;
    }
    let FileCache {
        dir,
        spec,
        daemon: d,
        ..
    } = file_cache(16 * MIB, 64 * MIB, &["-c", "wb"]);
    let args: Vec<String> = vec![
        "--ioengine=nbd".into(),
        "--verify_state_save=0".into(),
        format!("--uri={}", d.uri("cas1-1")),
        "--name=across".into(),
        "--rw=randwrite".into(),
        "--bs=4k".into(),
        "--iodepth=4".into(),
        "--size=16m".into(),
        // Slow enough that both switches land in the write phase.
        "--rate_iops=800".into(),
        "--verify=crc32c".into(),
        "--verify_fatal=1".into(),
        "--randrepeat=1".into(),
    ];
    let dir_path = dir.path().to_path_buf();
    let job = std::thread::spawn(move || fio(&dir_path, "across", &args));
    std::thread::sleep(Duration::from_millis(1000));
    d.ok(&["--script", "--disconnect-cache", "-i", "1"]);
    std::thread::sleep(Duration::from_millis(500));
    d.ok(&["--script", "--connect-cache", "-d", &spec]);
    std::thread::sleep(Duration::from_millis(500));
    d.ok(&[
        "--script",
        "--disconnect-cache",
        "-i",
        "1",
        "--pass-through",
    ]);
    std::thread::sleep(Duration::from_millis(500));
    d.ok(&["--script", "--connect-cache", "-d", &spec]);
    let report = job.join().expect("fio");
    let written = report["jobs"][0]["write"]["io_bytes"].as_u64().unwrap_or(0);
    assert_eq!(written, 16 * MIB, "{report}");
    assert_eq!(status(&d), "Running");
}

/// A daemon that stops and starts again during the gap (`--save-config`) brings the cache back
/// from its saved configuration: with the dirty data a `--no-flush` left, or new on a device that
/// `--pass-through` purged, never with stale lines.
#[test]
fn a_restart_during_the_gap_brings_the_cache_back_from_the_saved_configuration() {
    for how in ["--no-flush", "--pass-through"] {
        let dir = workdir();
        let cache = dir.path().join("cache.img");
        let core = dir.path().join("core.img");
        sparse_file(&cache, 64 * MIB);
        sparse_file(&core, 64 * MIB);
        let cfg = dir.path().join("hybridcache.toml");
        std::fs::write(&cfg, "").expect("config file");
        let cfg_s = cfg.to_str().expect("UTF-8");
        let args = ["--config", cfg_s, "--save-config"];
        let mut d = Daemon::start_with(dir.path(), &args);
        let spec = format!("file:{}", cache.display());
        d.ok(&["-S", "-d", &spec, "-c", "wb"]);
        d.ok(&["-A", "-i", "1", "-d", core.to_str().expect("UTF-8")]);
        d.ok(&["-X", "-n", "cleaning", "-p", "nop", "-i", "1"]);
        let mut c = client(&d);
        let a = pattern(9, 64 << 10);
        c.write(&a, 0, false).expect("write");
        c.flush().expect("flush");
        d.ok(&["--script", "--disconnect-cache", "-i", "1", how]);
        let b = pattern(10, 64 << 10);
        if how == "--pass-through" {
            c.write(&b, 0, false).expect("write in pass-through");
            c.flush().expect("flush in pass-through");
        }
        drop(c);
        assert!(
            d.stop(),
            "{how}: the daemon stops cleanly: {}",
            d.log_text()
        );
        let d = Daemon::start_with(dir.path(), &args);
        assert_eq!(status(&d), "Running", "{how}: {}", d.log_text());
        let mut c = client(&d);
        if how == "--no-flush" {
            assert!(dirty_lines(&d) > 0, "the dirty data was loaded");
            same(&read(&mut c, 0, a.len()), &a);
        } else {
            same(&read(&mut c, 0, b.len()), &b);
        }
    }
}

/// Requests held for a disconnected cache do not hold up the daemon's stop: they fail, and it
/// stops.
#[test]
fn stopping_the_daemon_fails_the_requests_held_and_stops() {
    let FileCache {
        dir: _dir,
        mut daemon,
        ..
    } = file_cache(64 * MIB, 64 * MIB, &["-c", "wt"]);
    let mut c = client(&daemon);
    daemon.ok(&["--script", "--disconnect-cache", "-i", "1"]);
    let held = std::thread::spawn(move || c.write(&[1u8; 4096], 0, false));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!held.is_finished());
    let began = std::time::Instant::now();
    daemon.stop();
    assert!(
        began.elapsed() < Duration::from_secs(10),
        "the stop took {:?}",
        began.elapsed()
    );
    assert!(held.join().expect("client thread").is_err());
}

/// A core in RAM lives only as long as the cache holds it: disconnecting would drop its data, so
/// it is refused; a cache with two cores on files goes and comes back with both.
#[test]
fn a_ram_core_is_refused_and_two_file_cores_both_come_back() {
    let FileCache {
        dir,
        spec,
        daemon: d,
        ..
    } = file_cache(64 * MIB, 64 * MIB, &["-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", "ram:16M", "-j", "2"]);
    let mut c2 = Client::connect_unix(&d.nbd, "cas1-2").expect("cas1-2");
    let a = pattern(11, 64 << 10);
    c2.write(&a, 0, false).expect("write to the RAM core");
    let err = d.fails(&["--script", "--disconnect-cache", "-i", "1"]);
    assert!(err.contains("ram:16M"), "{err}");
    assert_eq!(status(&d), "Running");
    same(&read(&mut c2, 0, a.len()), &a);
    drop(c2);
    d.ok(&["-R", "-i", "1", "-j", "2"]);

    let core2 = dir.path().join("core2.img");
    sparse_file(&core2, 32 * MIB);
    d.ok(&[
        "-A",
        "-i",
        "1",
        "-d",
        core2.to_str().expect("UTF-8"),
        "-j",
        "2",
    ]);
    let mut c1 = client(&d);
    let mut c2 = Client::connect_unix(&d.nbd, "cas1-2").expect("cas1-2");
    let b = pattern(12, 64 << 10);
    c1.write(&a, MIB, false).expect("write core 1");
    c2.write(&b, MIB, false).expect("write core 2");
    d.ok(&["--script", "--disconnect-cache", "-i", "1", "--no-flush"]);
    d.ok(&["--script", "--connect-cache", "-d", &spec]);
    same(&read(&mut c1, MIB, a.len()), &a);
    same(&read(&mut c2, MIB, b.len()), &b);
}

/// `-T` on a disconnected cache is refused while a client holds its export, as for a running
/// cache; with `-f` the held request fails and the export goes.
#[test]
fn stop_of_a_disconnected_cache_with_a_client_needs_force_and_fails_what_is_held() {
    let FileCache {
        dir: _dir,
        daemon: d,
        ..
    } = file_cache(64 * MIB, 64 * MIB, &["-c", "wt"]);
    let mut c = client(&d);
    d.ok(&["--script", "--disconnect-cache", "-i", "1"]);
    let err = d.fails(&["-T", "-i", "1"]);
    assert!(err.contains("client"), "{err}");
    assert_eq!(status(&d), "Disconnected");
    let held = std::thread::spawn(move || c.write(&[2u8; 4096], 0, false));
    std::thread::sleep(Duration::from_millis(300));
    assert!(!held.is_finished());
    d.ok(&["-T", "-i", "1", "-f"]);
    assert!(held.join().expect("client thread").is_err());
    assert_eq!(status(&d), "(not listed)");
}

/// casadm's `--detach-cache` / `--attach-cache`: the cache device goes (dirty data flushed first,
/// the cores served directly and listed `Detached`), a new one is attached under the same
/// connection; a device holding a file system is refused without `-f` and nothing changes.
#[test]
fn detach_and_attach_cache_as_casadm() {
    let FileCache {
        dir,
        cache,
        core,
        daemon: d,
        ..
    } = file_cache(64 * MIB, 64 * MIB, &["-c", "wb"]);
    d.ok(&["-X", "-n", "cleaning", "-p", "nop", "-i", "1"]);
    let mut c = client(&d);
    let a = pattern(9, 256 << 10);
    c.write(&a, MIB, false).expect("write");
    assert!(dirty_lines(&d) > 0);

    let out = d.ok(&["--detach-cache", "-i", "1"]);
    assert!(out.contains("detached"), "{out}");
    assert_eq!(status(&d), "Detached");
    // Flushed before the device went: the core has the data, and serves it directly.
    same(&file_bytes(&core, MIB, a.len()), &a);
    same(&read(&mut c, MIB, a.len()), &a);
    let b = pattern(10, 64 << 10);
    c.write(&b, 0, false).expect("write while detached");
    same(&file_bytes(&core, 0, b.len()), &b);
    // The old device no longer loads as this cache: its contents were dropped.
    let err = d.fails(&["-S", "-d", cache.to_str().expect("UTF-8"), "--load"]);
    assert!(!err.is_empty());

    // A device with a file system: refused without -f, untouched.
    let fs = dir.path().join("fs.img");
    sparse_file(&fs, 64 * MIB);
    if need(&["mkfs.ext4"]) {
        let made = std::process::Command::new("mkfs.ext4")
            .args(["-q", "-F"])
            .arg(&fs)
            .status()
            .expect("mkfs.ext4");
        assert!(made.success());
        let before = std::fs::read(&fs).expect("read");
        let err = d.fails(&[
            "--attach-cache",
            "-i",
            "1",
            "-d",
            fs.to_str().expect("UTF-8"),
        ]);
        assert!(err.contains("ext4"), "{err}");
        assert_eq!(
            std::fs::read(&fs).expect("read"),
            before,
            "changed by a refusal"
        );
        assert_eq!(status(&d), "Detached");
    }
    let out = d.ok(&[
        "--attach-cache",
        "-i",
        "1",
        "-d",
        fs.to_str().expect("UTF-8"),
        "-f",
    ]);
    assert!(
        out.contains("cache 1 attached: a new cache started on"),
        "{out}"
    );
    assert_eq!(status(&d), "Running");
    let entry = listed(&d).expect("listed");
    assert_eq!(entry["mode"], "wb", "{entry}");
    same(&read(&mut c, 0, b.len()), &b);
    same(&read(&mut c, MIB, a.len()), &a);
    c.disconnect().expect("disconnect");
}

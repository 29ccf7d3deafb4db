//! Caches that outlive the daemon: `start-cache --load` after a clean stop, after `stop -n`
//! (dirty data kept on the cache device), after kill -9 (fio verifies what an fsync made
//! durable), with a core device missing at load (inactive, then attached again), over an
//! existing cache (refused without --force), and through the configuration file.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{file_cache, fio, need, sparse_file, workdir, Daemon, FileCache};
use hybridcache_nbd::Client;

/// Deterministic bytes for one test region.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| {
            (i as u32)
                .wrapping_mul(2_654_435_761)
                .rotate_left(seed as u32 % 32) as u8
                ^ seed
        })
        .collect()
}

fn write_flush(d: &Daemon, export: &str, data: &[u8], offset: u64) {
    let mut c = Client::connect_unix(&d.nbd, export).expect("connect");
    for (i, chunk) in data.chunks(1 << 20).enumerate() {
        c.write(chunk, offset + (i as u64) * (1 << 20), false)
            .expect("write");
    }
    c.flush().expect("flush");
    c.disconnect().unwrap();
}

fn read(d: &Daemon, export: &str, len: usize, offset: u64) -> Vec<u8> {
    let mut c = Client::connect_unix(&d.nbd, export).expect("connect");
    let mut buf = vec![0u8; len];
    for (i, chunk) in buf.chunks_mut(1 << 20).enumerate() {
        c.read(chunk, offset + (i as u64) * (1 << 20))
            .expect("read");
    }
    c.disconnect().unwrap();
    buf
}

fn dirty(d: &Daemon, cache: u16) -> u64 {
    d.stats_json(cache, None)["usage"]["dirty"]["count"]
        .as_u64()
        .expect("dirty count")
}

fn file_range(path: &Path, offset: usize, len: usize) -> Vec<u8> {
    std::fs::read(path).unwrap()[offset..offset + len].to_vec()
}

#[test]
fn start_over_an_existing_cache_needs_force() {
    let dir = workdir();
    let cache = dir.path().join("cache.img");
    let core = dir.path().join("core.img");
    sparse_file(&cache, 16 << 20);
    sparse_file(&core, 32 << 20);
    let cache_s = cache.to_str().unwrap();
    let core_s = core.to_str().unwrap();
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", cache_s, "-i", "4", "-c", "wb"]);
    d.ok(&["-A", "-i", "4", "-d", core_s]);
    d.ok(&["-T", "-i", "4"]);

    let err = d.fails(&["-S", "-d", cache_s]);
    assert!(
        err.contains("holds cache 4") && err.contains(core_s) && err.contains("force"),
        "{err}"
    );
    let err = d.fails(&["-S", "-d", &format!("file:{cache_s}"), "-c", "wt"]);
    assert!(err.contains("holds cache 4"), "{err}");
    assert_eq!(d.ok(&["-L"]), "No caches running\n");

    // --force overwrites it: a new, empty cache.
    let out = d.ok(&["-S", "-d", cache_s, "--force"]);
    assert!(
        out.starts_with("destroyed cache 4 on")
            && out.ends_with("(it was clean)\ncache 1 started\n"),
        "{out}"
    );
    assert!(!d.ok(&["-L"]).contains("core"));
    d.ok(&["-T", "-i", "1"]);
    assert_eq!(d.ok(&["-S", "-d", cache_s, "--load"]), "cache 1 loaded\n");
    let list = d.ok(&["-L"]);
    assert!(list.contains("Running") && !list.contains("core"), "{list}");
    let err = d.fails(&["-S", "-d", cache_s, "--load", "-i", "2"]);
    assert!(err.contains("already in use"), "{err}");
    d.ok(&["-T", "-i", "1"]);
    let err = d.fails(&["-S", "-d", cache_s, "--load", "-i", "2"]);
    assert!(err.contains("holds cache 1, not cache 2"), "{err}");
    let err = d.fails(&["-S", "-d", cache_s, "--load", "-c", "wb"]);
    assert!(err.contains("omit -c"), "{err}");
    assert_eq!(d.ok(&["-L"]), "No caches running\n");
}

#[test]
fn stop_without_flush_keeps_dirty_data() {
    let FileCache {
        dir,
        core,
        spec,
        daemon: mut d,
        ..
    } = file_cache(16 << 20, 64 << 20, &["-c", "wb", "-x", "8"]);
    let data = pattern(3, 4 << 20);
    write_flush(&d, "cas1-1", &data, 1 << 20);
    let before = dirty(&d, 1);
    assert!(before > 0, "wb keeps the writes dirty");

    d.ok(&["-T", "-i", "1", "-n"]);
    assert_eq!(d.ok(&["-L"]), "No caches running\n");
    assert!(
        file_range(&core, 1 << 20, data.len())
            .iter()
            .all(|&b| b == 0),
        "-n must not write the dirty data to the core"
    );
    // A new daemon, so nothing but the cache device carries the data.
    assert!(d.stop(), "{}", d.log_text());
    let d = Daemon::start(dir.path());
    assert_eq!(d.ok(&["-S", "-d", &spec, "--load"]), "cache 1 loaded\n");
    let list = d.ok(&["-L"]);
    assert!(
        list.contains("Running") && list.contains("wb") && list.contains("Active"),
        "{list}"
    );
    assert_eq!(d.param("cache-line-size", 1, "Cache line size [KiB]"), "8");
    assert_eq!(dirty(&d, 1), before, "the dirty lines survive");
    assert!(
        read(&d, "cas1-1", data.len(), 1 << 20) == data,
        "data verifies"
    );

    // A normal stop flushes them to the core.
    d.ok(&["-T", "-i", "1"]);
    assert!(file_range(&core, 1 << 20, data.len()) == data);
}

#[test]
fn missing_core_is_inactive_until_attached() {
    let dir = workdir();
    let cache = dir.path().join("cache.img");
    let core = dir.path().join("core.img");
    let other = dir.path().join("other.img");
    let moved = dir.path().join("core.moved");
    sparse_file(&cache, 16 << 20);
    sparse_file(&core, 32 << 20);
    sparse_file(&other, 32 << 20);
    let cache_s = cache.to_str().unwrap();
    let core_s = core.to_str().unwrap();
    let mut d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", cache_s, "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", core_s]);
    d.ok(&["-A", "-i", "1", "-d", other.to_str().unwrap()]);
    let data = pattern(7, 2 << 20);
    let data2 = pattern(9, 1 << 20);
    write_flush(&d, "cas1-1", &data, 0);
    write_flush(&d, "cas1-2", &data2, 0);
    d.ok(&["-T", "-i", "1", "-n"]);
    assert!(d.stop(), "{}", d.log_text());
    std::fs::rename(&core, &moved).unwrap();

    let d = Daemon::start(dir.path());
    let out = d.ok(&["-S", "-d", cache_s, "--load"]);
    assert!(
        out.starts_with("cache 1 loaded\n") && out.contains("core 1 of cache 1 is inactive"),
        "{out}"
    );
    let list = d.ok(&["-L"]);
    let line1 = list.lines().find(|l| l.contains("cas1-1")).expect("core 1");
    let line2 = list.lines().find(|l| l.contains("cas1-2")).expect("core 2");
    assert!(
        line1.contains("Inactive") && line1.contains(core_s),
        "{list}"
    );
    assert!(line2.contains("Active"), "{list}");
    assert!(list.contains("Incomplete"), "{list}");
    let json: serde_json::Value = serde_json::from_str(&d.ok(&["-L", "-o", "json"])).unwrap();
    assert!(json.to_string().contains("Inactive"), "{json}");

    // The inactive core's export is not served; the other one is, with its data.
    assert!(Client::connect_unix(&d.nbd, "cas1-1").is_err());
    if need(&["nbdinfo"]) {
        let info = |export: &str| {
            Command::new("nbdinfo")
                .arg(d.uri(export))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status()
                .unwrap()
                .success()
        };
        assert!(!info("cas1-1"), "nbdinfo must fail for the inactive core");
        assert!(info("cas1-2"));
    }
    assert!(read(&d, "cas1-2", data2.len(), 0) == data2);
    for args in [
        &["-P", "-i", "1", "-j", "1"][..],
        &["-F", "-i", "1", "-j", "1"],
        &["-Z", "-i", "1", "-j", "1"],
    ] {
        let err = d.fails(args);
        assert!(
            err.contains("inactive") && err.contains("add-core"),
            "{err}"
        );
    }
    // Attaching it from another device is refused and changes nothing: it is not the device
    // the core was added as, and even when forced, its size differs from the recorded one.
    let wrong = dir.path().join("wrong.img");
    sparse_file(&wrong, 16 << 20);
    let err = d.fails(&["-A", "-i", "1", "-j", "1", "-d", wrong.to_str().unwrap()]);
    assert!(err.contains("not the device it was added as"), "{err}");
    let err = d.fails(&[
        "-A",
        "-i",
        "1",
        "-j",
        "1",
        "-d",
        wrong.to_str().unwrap(),
        "-f",
    ]);
    assert!(err.contains("bytes"), "{err}");
    assert!(d.ok(&["-L"]).contains("Inactive"));
    assert!(dirty(&d, 1) > 0, "the inactive core's dirty data is kept");

    // The device comes back: attach it again, and its dirty data is served.
    std::fs::rename(&moved, &core).unwrap();
    assert_eq!(
        d.ok(&["-A", "-i", "1", "-j", "1", "-d", core_s]),
        "core 1 attached again to cache 1, exported as cas1-1\n"
    );
    let list = d.ok(&["-L"]);
    assert!(
        !list.contains("Inactive") && list.contains("Running"),
        "{list}"
    );
    assert!(read(&d, "cas1-1", data.len(), 0) == data, "data verifies");
    d.ok(&["-T", "-i", "1"]);
    assert!(file_range(&core, 0, data.len()) == data);
    assert!(file_range(&other, 0, data2.len()) == data2);
}

/// casadm's `--remove-inactive` takes a core whose device is missing, and only such a core;
/// its dirty data is lost, so that needs `--force`. `-E` (casadm's `--flush-core`) flushes one
/// core, as `-F -j` does.
#[test]
fn remove_inactive_takes_only_a_missing_core_and_flush_core_flushes_one() {
    let dir = workdir();
    let cache = dir.path().join("cache.img");
    let core = dir.path().join("core.img");
    let other = dir.path().join("other.img");
    sparse_file(&cache, 16 << 20);
    sparse_file(&core, 32 << 20);
    sparse_file(&other, 32 << 20);
    let cache_s = cache.to_str().unwrap();
    let mut d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", cache_s, "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", core.to_str().unwrap()]);
    d.ok(&["-A", "-i", "1", "-d", other.to_str().unwrap()]);
    let data = pattern(3, 1 << 20);
    let data2 = pattern(4, 1 << 20);
    write_flush(&d, "cas1-1", &data, 0);
    write_flush(&d, "cas1-2", &data2, 0);
    d.ok(&["-T", "-i", "1", "-n"]);
    assert!(d.stop(), "{}", d.log_text());
    std::fs::remove_file(&core).unwrap();

    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", cache_s, "--load"]);
    let err = d.fails(&["--remove-inactive", "-i", "1", "-j", "2"]);
    assert!(err.contains("core 2 of cache 1 is active"), "{err}");
    let err = d.fails(&["--remove-inactive", "-i", "1", "-j", "1"]);
    assert!(err.contains("dirty"), "{err}");
    assert!(
        d.ok(&["-L"]).contains("Inactive"),
        "a refusal changes nothing"
    );

    d.ok(&["-E", "-i", "1", "-j", "2"]);
    assert!(
        file_range(&other, 0, data2.len()) == data2,
        "-E wrote core 2's data"
    );
    let core2 = d.stats_json(1, Some(2));
    assert_eq!(
        core2["usage"]["dirty"]["count"].as_u64(),
        Some(0),
        "{core2}"
    );
    assert!(dirty(&d, 1) > 0, "core 1's dirty data is still held");

    d.ok(&["--remove-inactive", "-i", "1", "-j", "1", "--force"]);
    let list = d.ok(&["-L"]);
    assert!(
        !list.contains("Inactive") && !list.contains("cas1-1") && list.contains("cas1-2"),
        "{list}"
    );
    assert_eq!(dirty(&d, 1), 0, "nothing of the removed core is left dirty");
    assert!(read(&d, "cas1-2", data2.len(), 0) == data2);
    d.ok(&["-T", "-i", "1"]);
}

#[test]
fn config_file_loads_the_cache_on_its_device() {
    let dir = workdir();
    let cache = dir.path().join("cache.img");
    let core = dir.path().join("core.img");
    sparse_file(&cache, 16 << 20);
    sparse_file(&core, 64 << 20);
    let cfg = dir.path().join("hybridcache.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[cache]]\nid = 2\ndevice = \"{}\"\nmode = \"wb\"\n\n[[core]]\ncache = 2\nid = 3\ndevice = \"{}\"\n",
            cache.display(),
            core.display()
        ),
    )
    .unwrap();
    let cfg_s = cfg.to_str().unwrap();
    let mut d = Daemon::start_with(dir.path(), &["--config", cfg_s]);
    assert!(
        d.log_text().contains("started persistent cache 2"),
        "{}",
        d.log_text()
    );
    let data = pattern(11, 3 << 20);
    write_flush(&d, "cas2-3", &data, 5 << 20);
    let before = dirty(&d, 2);
    assert!(before > 0);
    // Switched at run time: the device records it, and a loaded cache keeps it.
    d.ok(&["-Q", "-c", "wo", "-i", "2"]);
    // A crash: only what the NBD flush made durable is there.
    d.kill();

    let d = Daemon::start_with(dir.path(), &["--config", cfg_s]);
    assert!(d.log_text().contains("loaded cache 2"), "{}", d.log_text());
    let list = d.ok(&["-L"]);
    assert!(list.contains("cas2-3") && list.contains("wo"), "{list}");
    assert_eq!(dirty(&d, 2), before);
    assert!(read(&d, "cas2-3", data.len(), 5 << 20) == data);
}

fn crash_job(uri: &str, mode: &str) -> Vec<String> {
    vec![
        "--ioengine=nbd".into(),
        // fio would otherwise leave verify state files in the crate directory.
        "--verify_state_save=0".into(),
        format!("--uri={uri}"),
        format!("--name=crash-{mode}"),
        "--rw=randwrite".into(),
        "--bsrange=4k-64k".into(),
        "--iodepth=16".into(),
        "--size=48m".into(),
        "--verify=crc32c".into(),
        "--verify_fatal=1".into(),
        "--randrepeat=1".into(),
    ]
}

/// fio writes with end_fsync, the daemon is killed, a new one loads the cache and fio verifies.
fn kill_after_fsync(mode: &str) {
    if !need(&["fio"]) {
        return;
    }
    let FileCache {
        dir,
        spec,
        daemon: mut d,
        ..
    } = file_cache(16 << 20, 128 << 20, &["-c", mode]);
    let job = crash_job(&d.uri("cas1-1"), mode);
    let mut write = job.clone();
    write.extend(["--do_verify=0".into(), "--end_fsync=1".into()]);
    fio(dir.path(), &format!("{mode}-write"), &write);
    if mode != "wt" {
        assert!(dirty(&d, 1) > 0, "some data is only on the cache device");
    }
    d.kill();

    let d = Daemon::start(dir.path());
    assert_eq!(d.ok(&["-S", "-d", &spec, "--load"]), "cache 1 loaded\n");
    assert!(d.ok(&["-L"]).contains("Active"));
    let mut verify = job;
    verify.push("--verify_only".into());
    let report = fio(dir.path(), &format!("{mode}-verify"), &verify);
    let read_bytes = report["jobs"][0]["read"]["io_bytes"].as_u64().unwrap_or(0);
    assert!(
        read_bytes >= 48 << 20,
        "fio verified everything: {read_bytes}"
    );
    let stats = d.stats_json(1, None);
    assert_eq!(stats["errors"]["total_errors"]["count"], 0, "{stats}");
}

#[test]
fn kill9_after_fsync_wb() {
    kill_after_fsync("wb");
}

#[test]
fn kill9_after_fsync_wt() {
    kill_after_fsync("wt");
}

#[test]
fn kill9_after_fsync_wo() {
    kill_after_fsync("wo");
}

/// Killed while fio writes: the cache loads and every byte reads (old or new content).
#[test]
fn kill9_mid_write_loads_and_reads() {
    if !need(&["fio"]) {
        return;
    }
    let FileCache {
        dir,
        spec,
        daemon: mut d,
        ..
    } = file_cache(16 << 20, 128 << 20, &["-c", "wb"]);
    let mut job = crash_job(&d.uri("cas1-1"), "mid");
    job.retain(|a| !a.starts_with("--verify"));
    job.extend([
        "--size=128m".into(),
        "--time_based".into(),
        "--runtime=60".into(),
        format!("--output={}", dir.path().join("mid.json").display()),
    ]);
    let mut child = Command::new("fio")
        .args(&job)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("fio");
    // Let it write (with cleaning under pressure) before the crash.
    let deadline = Instant::now() + Duration::from_secs(20);
    while d.stats_json(1, None)["blocks"]["exported_writes"]["count"]
        .as_u64()
        .unwrap_or(0)
        < (32 << 20) / 4096
    {
        assert!(Instant::now() < deadline, "fio wrote too little");
        std::thread::sleep(Duration::from_millis(100));
    }
    d.kill();
    let deadline = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();

    let d = Daemon::start(dir.path());
    assert_eq!(
        d.ok(&["-S", "-d", &spec, "--load"]),
        "cache 1 loaded\n",
        "{}",
        d.log_text()
    );
    // Every byte reads without error.
    let all = read(&d, "cas1-1", 128 << 20, 0);
    assert_eq!(all.len(), 128 << 20);
    // And the cache keeps working: write, read back, stop cleanly, load again.
    let data = pattern(5, 1 << 20);
    write_flush(&d, "cas1-1", &data, 64 << 20);
    assert!(read(&d, "cas1-1", data.len(), 64 << 20) == data);
    let stats = d.stats_json(1, None);
    assert_eq!(stats["errors"]["total_errors"]["count"], 0, "{stats}");
    d.ok(&["-T", "-i", "1"]);
    d.ok(&["-S", "-d", &spec, "--load"]);
    assert!(read(&d, "cas1-1", data.len(), 64 << 20) == data);
}

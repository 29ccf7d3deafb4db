//! A mirrored write-back cache through the real daemon (issue 34; docs/cli.md "Mirrored
//! caches"): one device is an NBD export served by nbdkit (memory plugin behind the error
//! filter), the other a file. fio writes the exported volume with crc32c verification and
//! flushes; in the middle of the run the NBD device starts failing every request (the primary
//! in one test, the mirror in the other). fio must complete without an error (with the primary
//! lost, the dirty data is drained to the core from the mirror), `-L` must say which device is
//! lost, and after `-T` the core file alone must verify.
//! Then the failover: a crash (kill -9) of a daemon whose primary is gone, and the cache
//! brought up on a new daemon from the mirror alone with `--load-mirror`.

mod common;

use std::time::{Duration, Instant};

use common::{fio, nbd_flush, nbdkit, nbdkit_tcp, need, sparse_file, workdir, Daemon};

const MIB: u64 = 1 << 20;

fn job(uri_or_file: &[String], name: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = uri_or_file.to_vec();
    a.extend([
        "--verify_state_save=0".to_string(),
        format!("--name={name}"),
        "--rw=randwrite".into(),
        "--bsrange=4k-128k".into(),
        "--iodepth=4".into(),
        "--size=24m".into(),
        "--verify=crc32c".into(),
        "--verify_fatal=1".into(),
        "--randrepeat=1".into(),
        "--fsync=16".into(),
        "--end_fsync=1".into(),
    ]);
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// fio's arguments for the cache's export `cas1-1` through its NBD engine.
fn through_export(d: &Daemon) -> [String; 2] {
    [
        "--ioengine=nbd".to_string(),
        format!("--uri={}", d.uri("cas1-1")),
    ]
}

/// Cache 1's dirty lines, as `-P -o json` counts them.
fn dirty_lines(d: &Daemon) -> u64 {
    d.stats_json(1, None)["usage"]["dirty"]["count"]
        .as_u64()
        .unwrap_or(0)
}

/// One NBD flush after a run (fio's end_fsync may not follow its last write: `nbd_flush` says
/// why), then cache 1's dirty lines, which `what` must have left.
fn flushed_dirty_lines(d: &Daemon, what: &str) -> u64 {
    nbd_flush(&d.uri("cas1-1"));
    let dirty = dirty_lines(d);
    assert!(dirty > 0, "{what} left nothing dirty");
    dirty
}

/// fio's `verify_only` of job `name` through the daemon's cas1-1 (as fio run `label`), then `-T`
/// (which flushes the dirty lines) and the same verify on the core file alone.
fn verify_then_core_alone(d: &Daemon, dir: &std::path::Path, label: &str, name: &str, core: &str) {
    let uri = through_export(d);
    fio(dir, label, &job(&uri, name, &["--verify_only"]));
    d.ok(&["-T", "-i", "1"]);
    let file = ["--ioengine=psync".to_string(), format!("--filename={core}")];
    fio(dir, "core-alone", &job(&file, name, &["--verify_only"]));
}

fn exported_writes(d: &Daemon) -> u64 {
    d.stats_json(1, Some(1))["blocks"]["exported_writes"]["count"]
        .as_u64()
        .unwrap_or(0)
}

/// fio's verifying job (`job`) on the daemon's export cas1-1, on a thread of its own.
fn fio_in_background(
    d: &Daemon,
    dir: &std::path::Path,
    name: &'static str,
    rate: &str,
) -> std::thread::JoinHandle<serde_json::Value> {
    let uri = through_export(d);
    let (dir, args) = (dir.to_path_buf(), job(&uri, name, &[rate]));
    std::thread::spawn(move || fio(&dir, name, &args))
}

/// Wait until fio has written 512 blocks to cas1-1, while it still runs: what comes next
/// (`next`) happens in the middle of its run.
fn wait_for_writes(
    d: &Daemon,
    run: &std::thread::JoinHandle<serde_json::Value>,
    deadline: Instant,
    next: &str,
) {
    while exported_writes(d) < 512 {
        assert!(!run.is_finished(), "fio ended before {next}");
        assert!(Instant::now() < deadline, "fio never wrote to cas1-1");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn fio_verify_survives_the_primary_failing_mid_run_and_the_core_alone_has_it() {
    one_device_fails_mid_run(true);
}

#[test]
fn fio_verify_survives_the_mirror_failing_mid_run_and_the_core_alone_has_it() {
    one_device_fails_mid_run(false);
}

/// The device that fails is an nbdkit export behind the error filter, the other a file.
fn one_device_fails_mid_run(primary_fails: bool) {
    if !need(&["nbdkit", "fio"]) {
        return;
    }
    let (state, shown, level) = if primary_fails {
        ("primary lost", "Primary lost", "ERROR")
    } else {
        ("mirror lost", "Mirror lost", "WARN")
    };
    let dir = workdir();
    let (_nbdkit, remote, inject) = failing_device(dir.path(), "failing");
    let file = dir.path().join("device.img");
    let core = dir.path().join("core.img");
    sparse_file(&file, 64 * MIB);
    sparse_file(&core, 64 * MIB);
    let file_spec = format!("file:{}", file.display());
    let (primary, mirror_spec) = if primary_fails {
        (remote, file_spec)
    } else {
        (file_spec, remote)
    };
    let core_path = core.to_str().expect("UTF-8 path");
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", &primary, "--mirror", &mirror_spec, "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", core_path]);
    let listed: serde_json::Value =
        serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("-L JSON");
    assert_eq!(
        listed["caches"][0]["mirror"]["state"], "redundant",
        "{listed}"
    );
    // Nothing drains the dirty data behind fio's back: what it reads back comes from the cache.
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);

    let run = fio_in_background(&d, dir.path(), "mirrored", "--rate=,3m");
    let deadline = Instant::now() + Duration::from_secs(60);
    wait_for_writes(&d, &run, deadline, "the primary failed");
    // The failing device fails every request from here on.
    std::fs::write(&inject, b"").unwrap();
    let at_failure = exported_writes(&d);
    let report = run.join().expect("the fio thread");
    assert_eq!(
        report["jobs"][0]["write"]["io_bytes"].as_u64(),
        Some(24 * MIB),
        "fio wrote all of its run"
    );
    assert!(
        at_failure < 6144,
        "the device failed after fio's writes, not during them ({at_failure} blocks)"
    );
    let listed: serde_json::Value =
        serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("-L JSON");
    assert_eq!(listed["caches"][0]["mirror"]["state"], state, "{listed}");
    let table = d.ok(&["-L"]);
    assert!(table.contains(shown), "{table}");
    let stats = d.ok(&["-P", "-i", "1"]);
    assert!(
        stats.contains("Mirror State") && stats.contains(shown),
        "{stats}"
    );
    // The log says what is at risk, once the watcher has looked.
    let deadline = Instant::now() + Duration::from_secs(10);
    while !d.log_text().contains(state) {
        assert!(Instant::now() < deadline, "no log line: {}", d.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        d.log_text()
            .lines()
            .any(|l| l.contains(state) && l.contains(level)),
        "{}",
        d.log_text()
    );

    // Stop: what is still dirty drains to the core (from the mirror when the primary is lost);
    // the core file then verifies alone.
    d.ok(&["-T", "-i", "1"]);
    let file = [
        "--ioengine=psync".to_string(),
        format!("--filename={core_path}"),
    ];
    fio(
        dir.path(),
        "core-alone",
        &job(&file, "mirrored", &["--verify_only"]),
    );
}

#[test]
fn load_mirror_brings_every_flushed_write_back_after_the_primary_is_gone() {
    if !need(&["fio", "qemu-io"]) {
        return;
    }
    let dir = workdir();
    let primary = dir.path().join("primary.img");
    let mirror = dir.path().join("mirror.img");
    let core = dir.path().join("core.img");
    sparse_file(&primary, 64 * MIB);
    sparse_file(&mirror, 64 * MIB);
    sparse_file(&core, 64 * MIB);
    let primary_spec = format!("file:{}", primary.display());
    let mirror_spec = format!("file:{}", mirror.display());
    let core_path = core.to_str().expect("UTF-8 path");
    // Declared in the configuration file (its `mirror` key): created at the first start,
    // loaded with its mirror at the next.
    let config = dir.path().join("hybridcache.toml");
    std::fs::write(
        &config,
        format!(
            "[[cache]]\nid = 1\ndevice = \"{primary_spec}\"\nmode = \"wb\"\nmirror = \"{mirror_spec}\"\nmirror_lost = \"keep\"\n\n[[core]]\ncache = 1\nid = 1\ndevice = \"{core_path}\"\n"
        ),
    )
    .unwrap();
    let config = config.to_str().expect("UTF-8 path");
    let mut d = Daemon::start_with(dir.path(), &["--config", config]);
    assert!(d.stop());
    d = Daemon::start_with(dir.path(), &["--config", config]);
    let listed: serde_json::Value =
        serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("-L JSON");
    let mirror = &listed["caches"][0]["mirror"];
    assert_eq!(mirror["state"], "redundant", "{listed}\n{}", d.log_text());
    assert_eq!(mirror["mirror_lost"], "keep", "{listed}");
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    // The mirror is claimed: nothing else may use it.
    let err = d.fails(&["-S", "-d", &mirror_spec, "-i", "2"]);
    assert!(err.contains("the mirror of cache 1"), "{err}");
    let uri = through_export(&d);
    fio(dir.path(), "before", &job(&uri, "failover", &[]));
    // The flush that covers every write of the run (fio's end_fsync may not; nbd_flush says
    // why): what the failover must bring back is what was acknowledged before a flush.
    flushed_dirty_lines(&d, "the run");
    // The host dies and its primary with it.
    d.kill();
    std::fs::remove_file(&primary).unwrap();
    let d = Daemon::start(dir.path());
    // A plain load of the mirror is refused: it would trust lines the mirror never got.
    let err = d.fails(&["-S", "-d", &mirror_spec, "--load"]);
    assert!(err.contains("--load-mirror"), "{err}");
    let out = d.ok(&["-S", "-d", &mirror_spec, "--load-mirror"]);
    assert!(out.starts_with("cache 1 loaded"), "{out}");
    assert!(
        d.log_text().contains("brought up from its mirror"),
        "{}",
        d.log_text()
    );
    verify_then_core_alone(&d, dir.path(), "after", "failover", core_path);
}

/// The failover to another host: the core is shared (an NBD export both hosts reach, as a
/// SAN LUN or an RBD image would be) and the mirror is on the other host, reached over NBD. Host
/// A runs the cache (its primary a local file) and dies with it (kill -9, its primary gone);
/// host B, another daemon with a state of its own, brings the cache up from the mirror's export
/// alone with `--load-mirror` and serves the core there: every write acknowledged before a
/// flush on host A reads back right on host B, and after `-T` the core alone holds them.
#[test]
fn failover_to_another_host_brings_every_flushed_write_back_over_nbd() {
    if !need(&["nbdkit", "fio", "qemu-io"]) {
        return;
    }
    let dir = workdir();
    let (host_a, host_b) = (dir.path().join("host-a"), dir.path().join("host-b"));
    std::fs::create_dir_all(&host_a).unwrap();
    std::fs::create_dir_all(&host_b).unwrap();
    let primary = host_a.join("primary.img");
    let mirror = host_b.join("mirror.img");
    let core = dir.path().join("core.img");
    sparse_file(&primary, 64 * MIB);
    sparse_file(&mirror, 64 * MIB);
    sparse_file(&core, 64 * MIB);
    // Host B serves its mirror device over TCP, as another host would; the storage network
    // serves the core.
    let (_mirror_server, mirror_uri) =
        nbdkit_tcp(&["file".into(), format!("file={}", mirror.display())]);
    let core_sock = dir.path().join("core.sock");
    let _core_server = nbdkit(
        &core_sock,
        &["file".into(), format!("file={}", core.display())],
    );
    let core_uri = format!("nbd+unix:///?socket={}", core_sock.display());

    let mut a = Daemon::start(&host_a);
    a.ok(&[
        "-S",
        "-d",
        &format!("file:{}", primary.display()),
        "--mirror",
        &mirror_uri,
        "-c",
        "wb",
    ]);
    a.ok(&["-A", "-i", "1", "-d", &core_uri]);
    a.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    let uri = through_export(&a);
    fio(dir.path(), "host-a", &job(&uri, "failover", &[]));
    let dirty = flushed_dirty_lines(&a, "the run");
    // Host A dies, and its cache device with it. (The fencing rule, docs/cli.md: host A must
    // not write the core again; here it is dead.)
    a.kill();
    std::fs::remove_file(&primary).unwrap();

    let b = Daemon::start(&host_b);
    let out = b.ok(&["-S", "-d", &mirror_uri, "--load-mirror"]);
    assert!(out.starts_with("cache 1 loaded"), "{out}");
    let listed = b.ok(&["-L"]);
    assert!(listed.contains("cas1-1"), "{listed}");
    let loaded = dirty_lines(&b);
    assert_eq!(loaded, dirty, "host B has every dirty line host A had");
    verify_then_core_alone(
        &b,
        dir.path(),
        "host-b",
        "failover",
        core.to_str().expect("UTF-8 path"),
    );
}

/// An nbdkit memory export behind the error filter: its URI and the file whose existence makes
/// every request fail.
fn failing_device(dir: &std::path::Path, name: &str) -> (common::Kill, String, std::path::PathBuf) {
    let sock = dir.join(format!("{name}.sock"));
    let inject = dir.join(format!("{name}.inject"));
    let server = nbdkit(
        &sock,
        &[
            "--filter=error".into(),
            "memory".into(),
            "64M".into(),
            "error-rate=100%".into(),
            format!("error-file={}", inject.display()),
        ],
    );
    (
        server,
        format!("nbd+unix:///?socket={}", sock.display()),
        inject,
    )
}

fn mirror_state(d: &Daemon) -> serde_json::Value {
    let listed: serde_json::Value =
        serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("-L JSON");
    listed["caches"][0]["mirror"]["state"].clone()
}

/// The issue's "a rebuild onto a new device under load, then the primary killed: still nothing
/// lost": the mirror fails while fio writes, `--attach-mirror` rebuilds onto a new file while fio
/// goes on writing, and then the primary fails too. Every write fio made, before the rebuild, during
/// it and after, is read back right (the dirty data from the new mirror alone), and after `-T`
/// the core file alone verifies.
#[test]
fn a_mirror_rebuilt_under_load_keeps_every_write_when_the_primary_fails_next() {
    if !need(&["nbdkit", "fio"]) {
        return;
    }
    let dir = workdir();
    let (_primary_server, primary, primary_fails) = failing_device(dir.path(), "primary");
    let (_mirror_server, mirror, mirror_fails) = failing_device(dir.path(), "mirror");
    let new_mirror = dir.path().join("new-mirror.img");
    let core = dir.path().join("core.img");
    sparse_file(&new_mirror, 64 * MIB);
    sparse_file(&core, 64 * MIB);
    let core_path = core.to_str().expect("UTF-8 path");
    let d = Daemon::start(dir.path());
    // `keep`: the dirty lines stay on the cache while the mirror is lost, so the rebuild has
    // them to copy (with `drain` they would go to the core first).
    d.ok(&[
        "-S",
        "-d",
        &primary,
        "--mirror",
        &mirror,
        "--mirror-lost",
        "keep",
        "-c",
        "wb",
    ]);
    d.ok(&["-A", "-i", "1", "-d", core_path]);
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    // A new mirror that is the cache's own device, or a second cache's, is refused.
    let refused = d.fails(&["--attach-mirror", "-i", "1", "-d", &primary]);
    assert!(refused.contains("own device"), "{refused}");
    let refused = d.fails(&[
        "--attach-mirror",
        "-i",
        "1",
        "-d",
        &new_mirror.display().to_string(),
    ]);
    assert!(refused.contains("redundant already"), "{refused}");

    let run = fio_in_background(&d, dir.path(), "rebuilt", "--rate=,2m");
    let deadline = Instant::now() + Duration::from_secs(60);
    wait_for_writes(&d, &run, deadline, "the mirror failed");
    std::fs::write(&mirror_fails, b"").unwrap();
    while mirror_state(&d) != "mirror lost" {
        assert!(!run.is_finished(), "fio ended before the mirror was lost");
        assert!(Instant::now() < deadline, "the mirror was never lost");
        std::thread::sleep(Duration::from_millis(50));
    }
    let attached = d.ok(&[
        "--attach-mirror",
        "-i",
        "1",
        "-d",
        &new_mirror.display().to_string(),
    ]);
    assert!(attached.contains("redundant again"), "{attached}");
    assert!(
        !run.is_finished(),
        "fio ended before the rebuild: not under load"
    );
    assert_eq!(mirror_state(&d), "redundant");
    let table = d.ok(&["-L"]);
    assert!(table.contains(&new_mirror.display().to_string()), "{table}");
    // fio goes on writing onto the rebuilt pair, then the primary fails.
    let written = exported_writes(&d);
    while exported_writes(&d) < written + 256 && !run.is_finished() {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::fs::write(&primary_fails, b"").unwrap();
    let report = run.join().expect("the fio thread");
    assert_eq!(
        report["jobs"][0]["write"]["io_bytes"].as_u64(),
        Some(24 * MIB),
        "fio wrote all of its run"
    );
    assert_eq!(mirror_state(&d), "primary lost");
    assert!(
        d.log_text().contains("mirror rebuilt on"),
        "{}",
        d.log_text()
    );
    d.ok(&["-T", "-i", "1"]);
    let file = [
        "--ioengine=psync".to_string(),
        format!("--filename={core_path}"),
    ];
    fio(
        dir.path(),
        "core-alone",
        &job(&file, "rebuilt", &["--verify_only"]),
    );
}

/// The rebuild for the other device: the primary fails under fio, `--attach-cache`
/// gives the cache a new primary (a file) while fio goes on writing, and the cache is redundant
/// and write-back again. fio completes without an error; then the host dies (kill -9) and the
/// mirror with it: the new primary alone, loaded with `--load`, serves every write fio made, and
/// after `-T` the core file alone verifies.
#[test]
fn a_new_primary_attached_under_load_holds_every_write_when_the_mirror_is_gone_next() {
    if !need(&["nbdkit", "fio"]) {
        return;
    }
    let dir = workdir();
    let (_primary_server, primary, primary_fails) = failing_device(dir.path(), "primary");
    let mirror = dir.path().join("mirror.img");
    let new_primary = dir.path().join("new-primary.img");
    let small = dir.path().join("small.img");
    let core = dir.path().join("core.img");
    sparse_file(&mirror, 64 * MIB);
    sparse_file(&new_primary, 64 * MIB);
    sparse_file(&small, 16 * MIB);
    sparse_file(&core, 64 * MIB);
    let mirror_spec = format!("file:{}", mirror.display());
    let new_spec = format!("file:{}", new_primary.display());
    let small_spec = format!("file:{}", small.display());
    let core_path = core.to_str().expect("UTF-8 path");
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", &primary, "--mirror", &mirror_spec, "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", core_path]);
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    // A cache whose primary works gets no new one, nor does a running cache without a mirror.
    let refused = d.fails(&["--attach-cache", "-i", "1", "-d", &new_spec]);
    assert!(refused.contains("redundant"), "{refused}");
    let plain = dir.path().join("plain.img");
    sparse_file(&plain, 16 * MIB);
    d.ok(&["-S", "-d", plain.to_str().expect("UTF-8 path"), "-i", "2"]);
    let refused = d.fails(&["--attach-cache", "-i", "2", "-d", &new_spec]);
    assert!(refused.contains("has no mirror"), "{refused}");

    let run = fio_in_background(&d, dir.path(), "newprimary", "--rate=,2m");
    let deadline = Instant::now() + Duration::from_secs(60);
    wait_for_writes(&d, &run, deadline, "the primary failed");
    std::fs::write(&primary_fails, b"").unwrap();
    while mirror_state(&d) != "primary lost" {
        assert!(!run.is_finished(), "fio ended before the primary was lost");
        assert!(Instant::now() < deadline, "the primary was never lost");
        std::thread::sleep(Duration::from_millis(50));
    }
    // Too small a device, and the cache's own mirror, are refused, saying why.
    let refused = d.fails(&["--attach-cache", "-i", "1", "-d", &small_spec]);
    assert!(
        refused.contains(&(16 * MIB).to_string()) && refused.contains("at least"),
        "{refused}"
    );
    let refused = d.fails(&["--attach-cache", "-i", "1", "-d", &mirror_spec]);
    assert!(refused.contains("mirror"), "{refused}");
    let refused = d.fails(&[
        "--attach-cache",
        "-i",
        "1",
        "-d",
        plain.to_str().expect("UTF-8 path"),
    ]);
    assert!(
        refused.contains("in use as the cache device of cache 2"),
        "{refused}"
    );

    let attached = d.ok(&["--attach-cache", "-i", "1", "-d", &new_spec]);
    assert!(
        attached.contains("redundant again")
            && attached.contains(&format!("new primary {new_spec}")),
        "{attached}"
    );
    assert!(
        !run.is_finished(),
        "fio ended before the new primary was attached: not under load"
    );
    let listed: serde_json::Value =
        serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("-L JSON");
    let cache = &listed["caches"][0];
    assert_eq!(cache["mirror"]["state"], "redundant", "{listed}");
    assert_eq!(cache["device"], new_spec.as_str(), "{listed}");
    assert_eq!(cache["mode"], "wb", "write-back again: {listed}");
    // fio goes on writing onto the new pair (write-back: dirty on both), to its end.
    let written = exported_writes(&d);
    while exported_writes(&d) < written + 256 && !run.is_finished() {
        std::thread::sleep(Duration::from_millis(50));
    }
    let report = run.join().expect("the fio thread");
    assert_eq!(
        report["jobs"][0]["write"]["io_bytes"].as_u64(),
        Some(24 * MIB),
        "fio wrote all of its run"
    );
    let log = d.log_text();
    assert!(
        log.lines().any(|l| l.contains("INFO")
            && l.contains("new primary")
            && l.contains("redundant again")),
        "{log}"
    );
    let dirty = dirty_lines(&d);
    assert!(
        dirty > 0,
        "nothing dirty on the new pair: the load below proves nothing"
    );

    // The host dies and the mirror with it: the new primary alone has every write.
    let mut d = d;
    d.kill();
    std::fs::remove_file(&mirror).unwrap();
    let d = Daemon::start(dir.path());
    let out = d.ok(&["-S", "-d", &new_spec, "--load"]);
    assert!(out.starts_with("cache 1 loaded"), "{out}");
    verify_then_core_alone(&d, dir.path(), "after", "newprimary", core_path);
}

/// The rebuild for a cache that never had a mirror: a write-back cache started without
/// one takes fio's verifying writes, `--attach-mirror` gives it a mirror (a file) while fio goes
/// on writing, and then the primary fails. fio completes without an error; every write it made,
/// before the mirror came, while it was filled and after, reads back right through the export
/// (the dirty data from the mirror alone), and after `-T` from the core file alone.
#[test]
fn a_mirror_given_to_a_running_cache_under_load_keeps_every_write_when_the_primary_fails() {
    if !need(&["nbdkit", "fio"]) {
        return;
    }
    let dir = workdir();
    let (_primary_server, primary, primary_fails) = failing_device(dir.path(), "primary");
    let mirror = dir.path().join("mirror.img");
    let small = dir.path().join("small.img");
    let core = dir.path().join("core.img");
    sparse_file(&mirror, 64 * MIB);
    sparse_file(&small, 16 * MIB);
    sparse_file(&core, 64 * MIB);
    let mirror_spec = format!("file:{}", mirror.display());
    let small_spec = format!("file:{}", small.display());
    let core_path = core.to_str().expect("UTF-8 path");
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", &primary, "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", core_path]);
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    assert!(mirror_state(&d).is_null(), "a mirror before any was given");
    // A device smaller than the cache device's lines, and the cache's own device, are refused.
    let refused = d.fails(&["--attach-mirror", "-i", "1", "-d", &small_spec]);
    assert!(
        refused.contains(&(16 * MIB).to_string()) && refused.contains("at least"),
        "{refused}"
    );
    let refused = d.fails(&["--attach-mirror", "-i", "1", "-d", &primary]);
    assert!(refused.contains("own device"), "{refused}");

    let run = fio_in_background(&d, dir.path(), "attached", "--rate=,2m");
    let deadline = Instant::now() + Duration::from_secs(60);
    wait_for_writes(&d, &run, deadline, "the mirror was attached");
    let attached = d.ok(&["--attach-mirror", "-i", "1", "-d", &mirror_spec]);
    assert!(
        attached.starts_with(&format!(
            "cache 1 is redundant: its mirror {mirror_spec} holds every dirty line ("
        )),
        "{attached}"
    );
    assert!(
        !run.is_finished(),
        "fio ended before the mirror was attached: not under load"
    );
    assert_eq!(mirror_state(&d), "redundant");
    let table = d.ok(&["-L"]);
    assert!(table.contains(&mirror_spec), "{table}");
    let stats = d.ok(&["-P", "-i", "1"]);
    assert!(
        stats.contains("Mirror State") && stats.contains("Redundant"),
        "{stats}"
    );
    let log = d.log_text();
    assert!(
        log.lines()
            .any(|l| l.contains("INFO") && l.contains("giving it the mirror")),
        "{log}"
    );
    assert!(
        log.lines()
            .any(|l| l.contains("INFO") && l.contains("is redundant")),
        "{log}"
    );
    // fio goes on writing onto the pair, then the primary fails.
    let written = exported_writes(&d);
    while exported_writes(&d) < written + 256 && !run.is_finished() {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::fs::write(&primary_fails, b"").unwrap();
    let report = run.join().expect("the fio thread");
    assert_eq!(
        report["jobs"][0]["write"]["io_bytes"].as_u64(),
        Some(24 * MIB),
        "fio wrote all of its run"
    );
    assert_eq!(mirror_state(&d), "primary lost");
    verify_then_core_alone(&d, dir.path(), "after", "attached", core_path);
}

/// A mirror given to a running cache is the cache's as if it had been started with it: the
/// daemon's recorded state names it, so a restart of the daemon loads the pair, and so does
/// `-S --load -d PRIMARY --mirror SECOND`; every flushed write reads back right from the pair.
#[test]
fn a_mirror_given_to_a_running_cache_is_loaded_with_it_after_a_restart() {
    if !need(&["fio", "qemu-io"]) {
        return;
    }
    let dir = workdir();
    let primary = dir.path().join("primary.img");
    let mirror = dir.path().join("mirror.img");
    let core = dir.path().join("core.img");
    sparse_file(&primary, 64 * MIB);
    sparse_file(&mirror, 64 * MIB);
    sparse_file(&core, 64 * MIB);
    let primary_spec = format!("file:{}", primary.display());
    let mirror_spec = format!("file:{}", mirror.display());
    let core_path = core.to_str().expect("UTF-8 path");
    // With a configuration file the daemon keeps its run-time setup (docs/cli.md, "State
    // directory"); this one declares no cache: the cache is made at run time.
    let config = dir.path().join("hybridcache.toml");
    std::fs::write(&config, "# caches are started at run time\n").unwrap();
    let config = config.to_str().expect("UTF-8 path");
    let mut d = Daemon::start_with(dir.path(), &["--config", config]);
    d.ok(&["-S", "-d", &primary_spec, "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", core_path]);
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    let uri = through_export(&d);
    fio(dir.path(), "before", &job(&uri, "restarted", &[]));
    d.ok(&["--attach-mirror", "-i", "1", "-d", &mirror_spec]);
    flushed_dirty_lines(&d, "the run");
    // The daemon's own state: its next start loads the cache with the mirror it was given.
    // (`stop` is SIGTERM, which flushes every cache first.)
    assert!(d.stop());
    let mut d = Daemon::start_with(dir.path(), &["--config", config]);
    let listed: serde_json::Value =
        serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("-L JSON");
    let m = &listed["caches"][0]["mirror"];
    assert_eq!(m["state"], "redundant", "{listed}\n{}", d.log_text());
    assert_eq!(m["device"], mirror_spec.as_str(), "{listed}");
    // The daemon's stop flushed the cache: the same writes again, so that the pair holds
    // dirty lines for what follows.
    let uri = through_export(&d);
    fio(dir.path(), "again", &job(&uri, "restarted", &[]));
    let dirty = flushed_dirty_lines(&d, "the second run");
    // Stopped without flushing (the dirty lines stay), then loaded by hand with the pair.
    d.ok(&["-T", "-i", "1", "-n"]);
    let out = d.ok(&[
        "-S",
        "--load",
        "-d",
        &primary_spec,
        "--mirror",
        &mirror_spec,
    ]);
    assert!(out.starts_with("cache 1 loaded"), "{out}");
    assert_eq!(mirror_state(&d), "redundant");
    let loaded = dirty_lines(&d);
    assert_eq!(
        loaded,
        dirty,
        "the pair has every dirty line\n{}",
        d.log_text()
    );
    // The mirror alone holds them too: the primary's host dies, the mirror comes up alone.
    d.kill();
    std::fs::remove_file(&primary).unwrap();
    let other_host = dir.path().join("other-host");
    std::fs::create_dir_all(&other_host).unwrap();
    let d = Daemon::start(&other_host);
    let out = d.ok(&["-S", "-d", &mirror_spec, "--load-mirror"]);
    assert!(out.starts_with("cache 1 loaded"), "{out}");
    verify_then_core_alone(&d, dir.path(), "after", "restarted", core_path);
}

/// Issue 34's "the mirror may be smaller than the cache": a mirror a quarter of the primary's
/// size covers the first cache lines only, and every dirty line is kept among them (writes
/// wait for cleaning when they are all dirty). fio writes more than that region holds, with
/// flushes; the primary fails in the middle of the run; fio completes, every write reads back
/// right through the export (the dirty data from the small mirror), and after `-T` from the
/// core file alone.
#[test]
fn a_mirror_a_quarter_of_the_cache_keeps_every_write_when_the_primary_fails_mid_run() {
    if !need(&["nbdkit", "fio"]) {
        return;
    }
    let dir = workdir();
    let (_nbdkit, primary, inject) = failing_device(dir.path(), "primary");
    let mirror = dir.path().join("mirror.img");
    let core = dir.path().join("core.img");
    sparse_file(&mirror, 16 * MIB);
    sparse_file(&core, 64 * MIB);
    let mirror_spec = format!("file:{}", mirror.display());
    let core_path = core.to_str().expect("UTF-8 path");
    let d = Daemon::start(dir.path());
    let out = d.ok(&["-S", "-d", &primary, "--mirror", &mirror_spec, "-c", "wb"]);
    assert!(
        out.contains("it covers") && out.contains("writes wait for cleaning"),
        "-S names the mirror and what it covers: {out}"
    );
    d.ok(&["-A", "-i", "1", "-d", core_path]);
    let listed: serde_json::Value =
        serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("-L JSON");
    let m = &listed["caches"][0]["mirror"];
    assert_eq!(m["state"], "redundant", "{listed}");
    let covered = m["lines"].as_u64().unwrap_or(0);
    let lines = listed["caches"][0]["lines"].as_u64().unwrap_or(0);
    assert!(
        covered > 0 && covered * 3 < lines && m["bytes"].as_u64() <= Some(16 * MIB),
        "the mirror covers its size's worth of the cache's lines: {listed}"
    );
    // Cleaning runs only when writes want room: fio's 24 MiB do not fit the mirror's region,
    // so writes wait for it.
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    let run = fio_in_background(&d, dir.path(), "small", "--rate=,3m");
    let deadline = Instant::now() + Duration::from_secs(60);
    wait_for_writes(&d, &run, deadline, "the primary failed");
    let listed: serde_json::Value =
        serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("-L JSON");
    let dirty = listed["caches"][0]["mirror"]["dirty_lines"].as_u64();
    assert!(
        dirty.is_some_and(|n| n > 0 && n <= covered),
        "every dirty line is among those the mirror covers: {listed}"
    );
    std::fs::write(&inject, b"").unwrap();
    let report = run.join().expect("the fio thread");
    assert_eq!(
        report["jobs"][0]["write"]["io_bytes"].as_u64(),
        Some(24 * MIB),
        "fio wrote all of its run"
    );
    assert_eq!(mirror_state(&d), "primary lost");
    let stats = d.ok(&["-P", "-i", "1"]);
    assert!(stats.contains("Mirror Dirty"), "{stats}");

    verify_then_core_alone(&d, dir.path(), "after", "small", core_path);
}

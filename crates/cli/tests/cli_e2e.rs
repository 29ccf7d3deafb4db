//! End to end through the daemon: every management verb, output formats, exact errors that
//! change nothing, the configuration file, and data written over NBD surviving a flush.

mod common;

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::process::Command;

use common::{sparse_file, workdir, Daemon, BIN};

#[test]
fn management_verbs_end_to_end() {
    let dir = workdir();
    let cache = dir.path().join("cache.img");
    let core = dir.path().join("core.img");
    let core2 = dir.path().join("core2.img");
    sparse_file(&cache, 16 << 20);
    sparse_file(&core, 256 << 20);
    sparse_file(&core2, 64 << 20);
    let d = Daemon::start(dir.path());
    let mode = std::fs::metadata(&d.control).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "control socket mode");

    let cache_spec = format!("file:{}", cache.display());
    let core_s = core.to_str().unwrap();
    assert_eq!(
        d.ok(&["-S", "-d", &cache_spec, "-c", "wb"]),
        "cache 1 started\n"
    );
    assert_eq!(
        d.ok(&["--add-core", "-i", "1", "-d", core_s]),
        "core 1 added to cache 1, exported as cas1-1\n"
    );
    let list = d.ok(&["-L"]);
    let lines: Vec<&str> = list.lines().collect();
    assert_eq!(lines.len(), 3, "{list}");
    assert!(
        lines[1].starts_with("cache") && lines[1].contains("wb") && lines[1].contains("Running"),
        "{list}"
    );
    assert!(
        lines[2].starts_with("└core") && lines[2].ends_with("cas1-1   0"),
        "{list}"
    );

    // Write through the export with a real client so the statistics have something to count.
    {
        let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-1").expect("connect");
        assert!(c.can_multi_conn());
        c.write(&[0xab; 65536], 0, false).expect("write");
        c.disconnect().unwrap();
    }

    let table = d.ok(&["-P", "-i", "1"]);
    for section in [
        "Usage statistics",
        "Request statistics",
        "Block statistics",
        "Error statistics",
    ] {
        assert!(table.contains(section), "{table}");
    }
    let csv = d.ok(&["--stats", "-i", "1", "-j", "1", "-o", "csv"]);
    let by_id = d.ok(&["-P", "-i", "1", "-j", "1", "-o", "csv", "-b", "-f", "conf"]);
    assert!(by_id.contains(core_s), "{by_id}");
    let rows: Vec<&str> = csv.lines().collect();
    assert_eq!(rows.len(), 2, "{csv}");
    assert_eq!(rows[0].split(',').count(), rows[1].split(',').count());
    let json: serde_json::Value =
        serde_json::from_str(&d.ok(&["stats", "-i", "1", "-o", "json"])).expect("stats JSON");
    assert_eq!(json["info"]["cache_id"], 1);
    assert_eq!(json["info"]["write_policy"], "wb");
    {
        assert_eq!(json["blocks"]["exported_writes"]["count"], 16, "{json}");
        assert!(
            json["usage"]["dirty"]["count"].as_u64().unwrap() > 0,
            "{json}"
        );
    }
    // As casadm, -R without --force flushes a core's dirty data to it, then removes it.
    {
        let core3 = dir.path().join("core3.img");
        sparse_file(&core3, 16 << 20);
        d.ok(&["-A", "-i", "1", "-j", "7", "-d", core3.to_str().unwrap()]);
        let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-7").expect("connect");
        c.write(&[0xcd; 65536], 4096, false).expect("write");
        c.disconnect().unwrap();
        let json: serde_json::Value =
            serde_json::from_str(&d.ok(&["-P", "-i", "1", "-j", "7", "-o", "json"])).unwrap();
        assert!(
            json["usage"]["dirty"]["count"].as_u64().unwrap() > 0,
            "{json}"
        );
        d.ok(&["-R", "-i", "1", "-j", "7"]);
        assert!(!d.ok(&["-L"]).contains("cas1-7"));
        let on_core = std::fs::read(&core3).unwrap();
        assert!(
            on_core[4096..4096 + 65536].iter().all(|b| *b == 0xcd),
            "the dirty data did not reach the core"
        );
        assert!(on_core[..4096].iter().all(|b| *b == 0));
    }

    // Parameters.
    assert_eq!(d.param("cache-mode", 1, "Cache mode"), "wb");
    assert_eq!(d.param("cache-line-size", 1, "Cache line size [KiB]"), "4");
    let err = d.fails(&["-X", "-n", "cache-line-size", "-i", "1", "-v", "8"]);
    assert!(err.contains("read-only"), "{err}");
    // An unknown group is a bad command line, refused before the daemon is asked.
    let out = d.cli(&["-G", "-n", "nope", "-i", "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("invalid value 'nope' for '--name <GROUP>'"),
        "{err}"
    );

    // Flush, then the mode switch and the data survive.
    d.ok(&["-F", "-i", "1"]);
    let json: serde_json::Value =
        serde_json::from_str(&d.ok(&["-P", "-i", "1", "-o", "json"])).unwrap();
    assert_eq!(json["usage"]["dirty"]["count"], 0, "{json}");
    d.ok(&["-Q", "-c", "wt", "-i", "1", "-f", "yes"]);
    assert_eq!(d.param("cache-mode", 1, "Cache mode"), "wt");
    d.ok(&["-X", "-n", "cache-mode", "-i", "1", "-v", "wa"]);
    assert_eq!(d.param("cache-mode", 1, "Cache mode"), "wa");
    d.ok(&["-Z", "-i", "1", "-j", "1"]);
    let json: serde_json::Value =
        serde_json::from_str(&d.ok(&["-P", "-i", "1", "-j", "1", "-o", "json"])).unwrap();
    assert_eq!(json["requests"]["total_requests"]["count"], 0, "{json}");
    d.ok(&["-Z", "-i", "1"]);
    let json: serde_json::Value =
        serde_json::from_str(&d.ok(&["-P", "-i", "1", "-o", "json"])).unwrap();
    assert_eq!(json["requests"]["total_requests"]["count"], 0, "{json}");
    {
        let data = std::fs::read(&core).unwrap();
        assert!(
            data[..65536].iter().all(|&b| b == 0xab),
            "flushed data on the core"
        );
    }

    // Exact errors, each leaving the setup as it was.
    let before = d.ok(&["-L"]);
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec![
                "-S".into(),
                "-d".into(),
                "ram:16M".into(),
                "-i".into(),
                "1".into(),
            ],
            "cache 1 already exists",
        ),
        (
            vec!["-S".into(), "-d".into(), cache.display().to_string()],
            "is already in use as the cache device of cache 1",
        ),
        (
            vec![
                "-A".into(),
                "-i".into(),
                "1".into(),
                "-d".into(),
                format!("file:{core_s}"),
            ],
            "is already in use as core 1 of cache 1",
        ),
        (
            vec![
                "-A".into(),
                "-i".into(),
                "1".into(),
                "-d".into(),
                core2.display().to_string(),
                "-j".into(),
                "1".into(),
            ],
            "core 1 already exists in cache 1",
        ),
        (
            vec![
                "-A".into(),
                "-i".into(),
                "7".into(),
                "-d".into(),
                "ram:1M".into(),
            ],
            "cache 7 does not exist",
        ),
        (
            vec![
                "-R".into(),
                "-i".into(),
                "1".into(),
                "-j".into(),
                "9".into(),
            ],
            "core 9 does not exist in cache 1",
        ),
        (
            vec![
                "-A".into(),
                "-i".into(),
                "1".into(),
                "-d".into(),
                dir.path().join("missing.img").display().to_string(),
            ],
            "no such file",
        ),
        (
            vec![
                "-S".into(),
                "-d".into(),
                "ram:2K".into(),
                "-x".into(),
                "4".into(),
            ],
            "too small",
        ),
        (
            vec![
                "-A".into(),
                "-i".into(),
                "1".into(),
                "-d".into(),
                "null:1000".into(),
            ],
            "multiple of 512",
        ),
        (
            vec!["-S".into(), "-d".into(), "ram:16M".into(), "--load".into()],
            "cannot hold a cache to load",
        ),
        (
            vec![
                "-S".into(),
                "-d".into(),
                cache_spec.clone(),
                "--load".into(),
            ],
            "is already in use as the cache device of cache 1",
        ),
        (
            vec![
                "-S".into(),
                "-d".into(),
                core2.display().to_string(),
                "--load".into(),
            ],
            "no hybridcache cache found",
        ),
        (
            vec![
                "-S".into(),
                "-d".into(),
                core2.display().to_string(),
                "--load".into(),
                "--force".into(),
            ],
            "contradict",
        ),
        (
            vec![
                "-Z".into(),
                "-i".into(),
                "1".into(),
                "-j".into(),
                "3".into(),
            ],
            "core 3 does not exist in cache 1",
        ),
        (
            vec![
                "-F".into(),
                "-i".into(),
                "1".into(),
                "-j".into(),
                "3".into(),
            ],
            "core 3 does not exist in cache 1",
        ),
    ];
    for (args, want) in cases {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let err = d.fails(&args);
        assert!(err.contains(want), "{args:?}: {err}");
        assert_eq!(d.ok(&["-L"]), before, "{args:?} changed the setup");
    }

    // A second core by its own id, then removal of both, then stop.
    d.ok(&["-A", "-i", "1", "-d", "ram:32M", "-j", "5"]);
    assert!(d.ok(&["-L"]).contains("cas1-5"));
    d.ok(&["-R", "-i", "1", "-j", "5"]);
    d.ok(&["-R", "-i", "1", "-j", "1"]);
    d.ok(&["-T", "-i", "1"]);
    assert_eq!(d.ok(&["-L"]), "No caches running\n");
    // Freed devices can be used again; the stopped cache is still on its device, so a new one
    // needs --force.
    let err = d.fails(&["-S", "-d", cache.to_str().unwrap(), "-i", "2"]);
    assert!(err.contains("holds cache 1"), "{err}");
    d.ok(&["-S", "-d", cache.to_str().unwrap(), "-i", "2", "--force"]);
    // --zero-metadata: refused while the cache runs; afterwards a new cache needs no --force.
    let err = d.fails(&["--zero-metadata", "-d", cache.to_str().unwrap()]);
    assert!(err.contains("running cache 2"), "{err}");
    d.ok(&["-T", "-i", "2"]);
    d.ok(&["--zero-metadata", "-d", cache.to_str().unwrap()]);
    let err = d.fails(&["--zero-metadata", "-d", cache.to_str().unwrap()]);
    assert!(err.contains("holds no hybridcache metadata"), "{err}");
    d.ok(&["--zero-metadata", "-d", cache.to_str().unwrap(), "-f"]);
    let err = d.fails(&["-S", "-d", cache.to_str().unwrap(), "-i", "2", "--load"]);
    assert!(!err.is_empty());
    d.ok(&["-S", "-d", cache.to_str().unwrap(), "-i", "2"]);
    d.ok(&["-T", "-i", "2"]);
    let v = d.ok(&["-V"]);
    assert!(v.contains("│ 0.") || v.contains("│ 1."), "{v}");
    // -b: a file is shown as given (only disks have /dev/disk/by-id names).
    assert_eq!(d.ok(&["-L", "-b"]), d.ok(&["-L"]));
    let v = d.ok(&["-V", "-o", "csv"]);
    assert!(
        v.starts_with("Name,Version\nhybridcache Cache Daemon,"),
        "{v}"
    );
    assert!(v.contains("\nhybridcache CLI Utility,"), "{v}");
}

#[test]
fn cli_errors_without_daemon() {
    let dir = workdir();
    let sock = dir.path().join("none.sock");
    let out = Command::new(BIN)
        .args(["-L", "--control"])
        .arg(&sock)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot reach the daemon"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");

    // The environment variable names the socket too.
    let out = Command::new(BIN)
        .arg("-L")
        .env("HYBRIDCACHE_CONTROL", &sock)
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains(&*sock.to_string_lossy()));

    // -V without a daemon is casadm's -V without its module: the daemon's row says
    // "Not Loaded", and exit 0 (tests/casadm_compat.rs).
    let out = Command::new(BIN)
        .args(["-V", "--control"])
        .arg(&sock)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("Not Loaded"));

    // Usage errors exit 2 with one line.
    let out = Command::new(BIN)
        .args(["-S", "-d", "x", "-c", "fast"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("unknown cache mode 'fast'"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

#[test]
fn config_file_applied_and_saved() {
    let dir = workdir();
    let core = dir.path().join("core.img");
    sparse_file(&core, 64 << 20);
    let cfg = dir.path().join("hybridcache.toml");
    let mut f = std::fs::File::create(&cfg).unwrap();
    write!(
        f,
        "[[cache]]\nid = 3\ndevice = \"ram:16M\"\nline_size = 8\nmode = \"wb\"\n\n\
         [[core]]\ncache = 3\nid = 2\ndevice = \"{}\"\n",
        core.display()
    )
    .unwrap();
    drop(f);
    let cfg_s = cfg.to_str().unwrap();
    let mut d = Daemon::start_with(dir.path(), &["--config", cfg_s, "--save-config"]);
    let list = d.ok(&["-L"]);
    assert!(list.contains("cas3-2") && list.contains("wb"), "{list}");
    assert_eq!(d.param("cache-line-size", 3, "Cache line size [KiB]"), "8");
    d.ok(&["-A", "-i", "3", "-d", "ram:8M", "-j", "4"]);
    // Leaving wb needs -f yes|no, as casadm.
    let err = d.fails(&["-Q", "-c", "wt", "-i", "3"]);
    assert!(err.contains("--flush-cache (-f) yes or no"), "{err}");
    assert!(d.ok(&["-L"]).contains("wb"));
    // As casadm, -L shows the mode the cache runs: after `-f no` that is wt, with the dirty
    // data left in -P's Dirty rows until it drains (here: flushed; cleaning nop keeps it until
    // then); `wb->wt` only while a flush switches the mode (tests/flush_progress.rs); after a
    // stop without flush and a load too (tests/casadm_compat.rs).
    d.ok(&["-X", "-n", "cleaning", "-i", "3", "-p", "nop"]);
    {
        let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas3-2").expect("connect");
        c.write(&[0x5a; 65536], 0, false).expect("write");
        c.disconnect().unwrap();
    }
    d.ok(&["-Q", "-c", "wt", "-i", "3", "-f", "no"]);
    let mode = |d: &Daemon| -> String {
        let csv = d.ok(&["-L", "-o", "csv"]);
        csv.lines()
            .find(|l| l.starts_with("cache,3,"))
            .and_then(|l| l.split(',').nth(4))
            .unwrap_or_default()
            .to_string()
    };
    assert_eq!(mode(&d), "wt");
    assert!(d.stats_json(3, None)["usage"]["dirty"]["count"].as_u64() > Some(0));
    d.ok(&["-F", "-i", "3"]);
    let list = d.ok(&["-L"]);
    assert!(list.contains("wt") && !list.contains("wb->wt"), "{list}");
    // The file is the operator's and stays as written; the run-time setup is recorded in the
    // state directory (the harness's --state-dir) and `config export` writes it out.
    let written = std::fs::read_to_string(&cfg).unwrap();
    assert!(!written.contains("id = 4"), "{written}");
    let saved = d.ok(&["config", "export"]);
    assert!(
        saved.contains("id = 4") && saved.contains("ram:8M"),
        "{saved}"
    );
    assert!(!saved.contains("mode = "), "wt is the default: {saved}");
    assert!(d.stop(), "clean shutdown: {}", d.log_text());
    assert!(!d.control.exists() && !d.nbd.exists(), "sockets removed");

    // The file and the recorded run-time setup start the same setup again.
    let d = Daemon::start_with(dir.path(), &["--config", cfg_s]);
    let list = d.ok(&["-L"]);
    assert!(list.contains("cas3-2") && list.contains("cas3-4"), "{list}");

    // A broken file stops the daemon from starting, with the line of the mistake.
    let bad = dir.path().join("bad.toml");
    std::fs::write(
        &bad,
        "[[cache]]\nid = 1\ndevice = \"ram:1M\"\nmdoe = \"wb\"\n",
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["daemon", "--config", bad.to_str().unwrap(), "--control"])
        .arg(dir.path().join("x.sock"))
        .arg("--state-dir")
        .arg(dir.path())
        .arg("--nbd-socket")
        .arg(dir.path().join("y.sock"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("line 4") && err.contains("mdoe"), "{err}");
}

#[test]
fn second_daemon_on_the_same_socket_is_refused() {
    let dir = workdir();
    let d = Daemon::start(dir.path());
    let out = Command::new(BIN)
        .args(["daemon", "--control"])
        .arg(&d.control)
        .arg("--state-dir")
        .arg(dir.path())
        .arg("--nbd-socket")
        .arg(dir.path().join("other.sock"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("another daemon"), "{err}");
    // The first one still answers.
    d.ok(&["-L"]);
}

#[test]
fn sigterm_flushes_dirty_data_and_removes_sockets() {
    let dir = workdir();
    let core = dir.path().join("core.img");
    sparse_file(&core, 32 << 20);
    let mut d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", "ram:8M", "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", core.to_str().unwrap()]);
    let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-1").unwrap();
    c.write(&[0x5a; 1 << 20], 4 << 20, false).unwrap();
    c.disconnect().unwrap();
    let json: serde_json::Value =
        serde_json::from_str(&d.ok(&["-P", "-i", "1", "-o", "json"])).unwrap();
    assert!(json["usage"]["dirty"]["count"].as_u64().unwrap() > 0);
    assert!(d.stop(), "clean exit: {}", d.log_text());
    assert!(!d.control.exists() && !d.nbd.exists());
    let data = std::fs::read(&core).unwrap();
    assert!(data[4 << 20..5 << 20].iter().all(|&b| b == 0x5a));
}

#[test]
fn remote_nbd_export_as_core() {
    if !common::need(&["nbdkit"]) {
        return;
    }
    let dir = workdir();
    let sock = dir.path().join("nbdkit.sock");
    let _nbdkit = common::nbdkit(&sock, &["memory".into(), "64M".into()]);
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", "ram:4M", "-c", "wb"]);
    let remote = format!("nbd+unix:///?socket={}", sock.display());
    d.ok(&["-A", "-i", "1", "-d", &remote]);
    let err = d.fails(&["-A", "-i", "1", "-d", &remote]);
    assert!(err.contains("already in use as core 1"), "{err}");
    let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-1").unwrap();
    assert_eq!(c.size(), 64 << 20);
    let data: Vec<u8> = (0..8 << 20).map(|i: u32| (i % 251) as u8).collect();
    c.write(&data, 1 << 20, false).unwrap();
    c.disconnect().unwrap();
    d.ok(&["-F", "-i", "1"]);
    // Read the remote export directly: the flushed data is there.
    let mut r = hybridcache_nbd::Client::connect_unix(&sock, "").unwrap();
    let mut back = vec![0u8; data.len()];
    r.read(&mut back, 1 << 20).unwrap();
    assert!(back == data, "remote core holds the data");
}

/// Every management change is logged with who asked (pid, uid), what, and for settings the
/// fields that changed from what to what; refusals too; read-only requests are not.
#[test]
fn management_changes_are_logged_with_who_asked_and_what_changed() {
    let dir = workdir();
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", "ram:32M", "-i", "1", "-c", "wb"]);
    d.ok(&["-Q", "-c", "wt", "-i", "1", "-f", "no"]);
    d.ok(&["-X", "-n", "cleaning-alru", "-i", "1", "-w", "5"]);
    d.fails(&["-X", "-n", "cleaning-alru", "-i", "1", "-w", "99999"]);
    d.ok(&["-L"]);
    let log = d.log_text();
    let lines: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("control request from pid "))
        .collect();
    assert!(
        lines
            .iter()
            .any(|l| l.contains("set-cache-mode") && l.contains("mode wb -> wt")),
        "{log}"
    );
    assert!(
        lines.iter().any(|l| l.contains("cleaning-alru")
            && l.contains("wake-up 20 -> 5")
            && !l.contains("staleness")),
        "{log}"
    );
    assert!(
        lines
            .iter()
            .any(|l| l.contains(" WARN ") && l.contains("refused")),
        "{log}"
    );
    assert!(lines.iter().all(|l| l.contains(" uid ")), "{log}");
    assert!(!lines.iter().any(|l| l.contains("\"list\"")), "{log}");
}

/// Core ids start at 0 as casadm's (OCF_CORE_ID_MIN): `-j 0` adds, serves, shows, reports and
/// removes core 0 like any other, and the configuration file takes `id = 0`.
#[test]
fn core_id_0_end_to_end() {
    let dir = workdir();
    let cache = dir.path().join("cache.img");
    let core0 = dir.path().join("core0.img");
    let core1 = dir.path().join("core1.img");
    sparse_file(&cache, 64 << 20);
    sparse_file(&core0, 16 << 20);
    sparse_file(&core1, 16 << 20);
    let d = Daemon::start(dir.path());
    let cache_spec = format!("file:{}", cache.display());
    d.ok(&["-S", "-d", &cache_spec, "-c", "wb"]);
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    d.ok(&["-A", "-i", "1", "-j", "0", "-d", core0.to_str().unwrap()]);
    // Without -j the lowest free id from 1, as casadm: 0 is taken only when asked for.
    d.ok(&["-A", "-i", "1", "-d", core1.to_str().unwrap()]);
    let list = d.ok(&["-L"]);
    assert!(list.contains("cas1-0") && list.contains("cas1-1"), "{list}");
    let v: serde_json::Value = serde_json::from_str(&d.ok(&["-L", "-o", "json"])).unwrap();
    let ids: Vec<u64> = v["caches"][0]["cores"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_u64().unwrap())
        .collect();
    assert_eq!(ids, [0, 1], "{v}");

    let data: Vec<u8> = (0..1 << 20).map(|i: u32| (i * 7 + 3) as u8).collect();
    {
        let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-0").expect("cas1-0");
        c.write(&data, 1 << 20, false).expect("write");
        let mut back = vec![0u8; data.len()];
        c.read(&mut back, 1 << 20).expect("read");
        assert_eq!(back, data);
        c.disconnect().unwrap();
    }
    let stats = d.stats_json(1, Some(0));
    let text = stats.to_string();
    assert!(
        text.contains("cas1-0") || text.contains(core0.to_str().unwrap()),
        "{text}"
    );
    let core_stats = d.ok(&["-P", "-i", "1", "-j", "0"]);
    assert!(
        core_stats.contains("Core Id") && core_stats.contains(" 0"),
        "{core_stats}"
    );
    // Core 0's statistics are its own, not the cache's: core 1 has nothing dirty.
    let dirty = |j: &str| {
        let v: serde_json::Value =
            serde_json::from_str(&d.ok(&["-P", "-i", "1", "-j", j, "-o", "json"])).unwrap();
        v["usage"]["dirty"]["count"].as_u64().unwrap_or(0)
    };
    assert!(dirty("0") > 0);
    assert_eq!(dirty("1"), 0);

    // -R flushes core 0 to its device, then removes it.
    d.ok(&["-R", "-i", "1", "-j", "0"]);
    let on_disk = std::fs::read(&core0).unwrap();
    assert_eq!(&on_disk[1 << 20..2 << 20], &data[..]);
    let list = d.ok(&["-L"]);
    assert!(
        !list.contains("cas1-0") && list.contains("cas1-1"),
        "{list}"
    );
    let err = d.fails(&["-P", "-i", "1", "-j", "0"]);
    assert!(err.contains("core 0"), "{err}");

    // The range ends at 4095.
    let out = d.cli(&["-A", "-i", "1", "-j", "4096", "-d", "ram:8M"]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("(0..4095)") && !err.contains("..="), "{err}");
    drop(d);

    // id = 0 in the configuration file, kept in the running setup.
    let cfg = dir.path().join("hybridcache.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[cache]]\nid = 2\ndevice = \"ram:16M\"\n\n[[core]]\ncache = 2\nid = 0\ndevice = \"{}\"\n",
            core0.display()
        ),
    )
    .unwrap();
    let d = Daemon::start_with(
        dir.path(),
        &["--config", cfg.to_str().unwrap(), "--save-config"],
    );
    let list = d.ok(&["-L"]);
    assert!(list.contains("cas2-0"), "{list}");
    {
        let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas2-0").expect("cas2-0");
        let mut back = vec![0u8; data.len()];
        c.read(&mut back, 1 << 20).expect("read");
        assert_eq!(back, data);
        c.disconnect().unwrap();
    }
    d.ok(&["-A", "-i", "2", "-d", "ram:8M"]);
    let saved =
        hybridcache_daemon::config::ConfigFile::parse(&d.ok(&["config", "export"])).unwrap();
    let ids: Vec<u16> = saved.cores.iter().map(|c| c.id).collect();
    assert_eq!(ids, [0, 1], "{saved:?}");
}

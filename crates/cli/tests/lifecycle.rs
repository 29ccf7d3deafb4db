//! Device lifecycle through the daemon (issue 12, cases 5-7 and stopping): a configuration is
//! one transaction, late cache devices wait and start, inactive cores attach again by
//! themselves, remote cores reconnect after their server restarts, and `stop-daemon` stops the
//! daemon cleanly.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{fio, need, sparse_file, workdir, Daemon, BIN};
use hybridcache_daemon::config::ConfigFile;
use hybridcache_nbd::Client;

/// Statuses `-L` shows: the cache's, then each core's.
fn statuses(d: &Daemon, cache: u16) -> Option<(String, Vec<String>)> {
    let v: serde_json::Value = serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("JSON");
    let c = v["caches"]
        .as_array()?
        .iter()
        .find(|c| c["id"].as_u64() == Some(cache as u64))?;
    let cores = c["cores"]
        .as_array()?
        .iter()
        .map(|k| k["status"].as_str().unwrap_or("").to_string())
        .collect();
    Some((c["status"].as_str()?.to_string(), cores))
}

/// Wait (up to 20 s) until `ok` holds for cache `cache`'s statuses.
fn wait_status(d: &Daemon, cache: u16, what: &str, ok: impl Fn(&str, &[String]) -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if let Some((c, cores)) = statuses(d, cache) {
            if ok(&c, &cores) {
                return;
            }
        }
        assert!(
            Instant::now() < deadline,
            "cache {cache} never became {what}: {:?}\n{}",
            statuses(d, cache),
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn write_file(path: &Path, text: &str) {
    std::fs::write(path, text).expect("write the configuration");
}

/// A content hash of a file (FNV-1a over every byte), to show that it did not change.
fn hash(path: &Path) -> u64 {
    let data = std::fs::read(path).expect("read a device file");
    data.iter().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ *b as u64).wrapping_mul(0x100000001b3)
    })
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn a_missing_cache_device_waits_and_the_others_start() {
    let dir = workdir();
    let p = dir.path();
    let cache1 = p.join("cache1.img");
    let core1 = p.join("core1.img");
    let core2 = p.join("core2.img");
    let late_dir = p.join("late");
    let cache2 = late_dir.join("cache2.img");
    sparse_file(&cache1, 64 << 20);
    sparse_file(&core1, 64 << 20);
    sparse_file(&core2, 64 << 20);
    let cfg = p.join("hybridcache.toml");
    let text = format!(
        "[[cache]]\nid = 1\ndevice = \"{}\"\nmode = \"wb\"\n\n[[cache]]\nid = 2\ndevice = \"{}\"\nmode = \"wt\"\nline_size = 8\n\n[cache.params]\n\"cleaning-alru.wake-up\" = \"5\"\n\n[[core]]\ncache = 1\nid = 1\ndevice = \"{}\"\n\n[[core]]\ncache = 2\nid = 1\ndevice = \"{}\"\n",
        cache1.display(),
        cache2.display(),
        core1.display(),
        core2.display()
    );
    write_file(&cfg, &text);
    let cfg_s = cfg.to_str().expect("UTF-8 path");
    let d = Daemon::start_with(p, &["--config", cfg_s, "--save-config"]);

    // Cache 1 runs and serves; cache 2 waits.
    let (s1, cores1) = statuses(&d, 1).expect("cache 1 listed");
    assert_eq!(
        (s1.as_str(), cores1),
        ("Running", vec!["Active".to_string()])
    );
    let (s2, _) = statuses(&d, 2).expect("cache 2 listed");
    assert_eq!(s2, "Waiting for device");
    let data = pattern(1, 1 << 20);
    let mut c = Client::connect_unix(&d.nbd, "cas1-1").expect("cas1-1 is served");
    c.write(&data, 0, false).expect("write");
    c.flush().expect("flush");
    c.disconnect().expect("disconnect");

    // The run-time setup in the state directory still names cache 2 and its core, as the file
    // had them; the file itself is never written.
    assert_eq!(std::fs::read_to_string(&cfg).expect("the file"), text);
    let saved = recorded(p);
    let given = ConfigFile::parse(&text).expect("the given file");
    let c2 = saved.caches.iter().find(|c| c.id == 2);
    assert_eq!(
        c2,
        given.caches.iter().find(|c| c.id == 2),
        "cache 2 as given"
    );
    // The run-time setup names each core's front-end, which the file leaves to the default.
    let cores2 = |c: &ConfigFile| {
        c.cores
            .iter()
            .filter(|k| k.cache == 2)
            .cloned()
            .map(|mut k| {
                k.frontend.get_or_insert_with(|| "nbd".into());
                k
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(cores2(&saved), cores2(&given), "cache 2's core as given");

    // The device appears (its directory too): the cache starts, as the file says.
    std::fs::create_dir(&late_dir).expect("mkdir");
    sparse_file(&cache2, 64 << 20);
    wait_status(&d, 2, "running", |c, cores| {
        c == "Running" && cores == ["Active"]
    });
    let list = d.ok(&["-L"]);
    assert!(list.contains("cas2-1"), "{list}");
    let got = d.ok(&["-G", "-n", "cleaning-alru", "-i", "2", "-o", "csv"]);
    assert!(got.contains(",5"), "the file's parameters apply: {got}");
    let mut c = Client::connect_unix(&d.nbd, "cas2-1").expect("cas2-1 is served");
    c.write(&data, 4096, false).expect("write");
    let mut back = vec![0u8; data.len()];
    c.read(&mut back, 4096).expect("read");
    assert_eq!(back, data);
    c.disconnect().expect("disconnect");
    let log = d.log_text();
    assert!(log.contains("device") && log.contains("appeared"), "{log}");
    // Cache 2 was created with the file's line size and mode.
    let (_, _) = statuses(&d, 2).expect("listed");
    let v: serde_json::Value = serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("JSON");
    let c2 = &v["caches"][1];
    assert_eq!(c2["line_size_kib"].as_u64(), Some(8), "{v}");
    assert_eq!(c2["mode"].as_str(), Some("wt"), "{v}");
}

/// The run-time setup a daemon with its state directory in `p` recorded (the test harness's
/// `--state-dir`), as a configuration: the file it was started with is never written.
fn recorded(p: &Path) -> ConfigFile {
    let text = std::fs::read_to_string(p.join("setup.json")).expect("setup.json");
    let setup: hybridcache_daemon::state::Setup = serde_json::from_str(&text).expect("JSON");
    ConfigFile {
        caches: setup.caches,
        cores: setup.cores,
        ..ConfigFile::default()
    }
}

/// Start a daemon that must refuse its configuration; returns its stderr.
fn refused_daemon(dir: &Path, cfg: &Path) -> String {
    let out = Command::new(BIN)
        .arg("daemon")
        .arg("--control")
        .arg(dir.join("control.sock"))
        .arg("--nbd-socket")
        .arg(dir.join("nbd.sock"))
        .arg("--state-dir")
        .arg(dir)
        .arg("--config")
        .arg(cfg)
        .arg("--save-config")
        .env_remove("HYBRIDCACHE_CONTROL")
        .stdin(Stdio::null())
        .output()
        .expect("run the daemon");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "the daemon should refuse: {err}");
    err
}

#[test]
fn a_refused_configuration_changes_no_device_and_not_the_file() {
    let dir = workdir();
    let p = dir.path();
    let devices: Vec<PathBuf> = ["c1.img", "k1.img", "c2.img", "k2.img", "c3.img", "k3.img"]
        .iter()
        .map(|n| p.join(n))
        .collect();
    for d in &devices {
        sparse_file(d, 32 << 20);
    }
    // Some content, so "unchanged" means more than "still zero".
    for (i, d) in devices.iter().enumerate() {
        std::fs::write(d, pattern(i as u8, 32 << 20)).expect("fill");
    }
    let entries = |third_cache: &str, third_params: &str| {
        format!(
            "[[cache]]\nid = 1\ndevice = \"{}\"\n\n[[cache]]\nid = 2\ndevice = \"{}\"\n\n[[cache]]\nid = 3\ndevice = \"{third_cache}\"\n{third_params}\n[[core]]\ncache = 1\nid = 1\ndevice = \"{}\"\n\n[[core]]\ncache = 2\nid = 1\ndevice = \"{}\"\n\n[[core]]\ncache = 3\nid = 1\ndevice = \"{}\"\n",
            devices[0].display(),
            devices[2].display(),
            devices[1].display(),
            devices[3].display(),
            devices[5].display()
        )
    };
    // The third cache's device is the first cache's file by another name (a symlink).
    let alias = p.join("alias.img");
    std::os::unix::fs::symlink(&devices[0], &alias).expect("symlink");
    let bad_param = "[cache.params]\n\"cleaning-alru.wake-up\" = \"99999\"\n";
    let cases = [
        (
            "an aliased device",
            entries(alias.to_str().expect("UTF-8"), ""),
            "same device",
        ),
        (
            "a parameter out of range",
            entries(devices[4].to_str().expect("UTF-8"), bad_param),
            "wake-up",
        ),
    ];
    for (what, text, reason) in cases {
        let cfg = p.join("hybridcache.toml");
        write_file(&cfg, &text);
        let before: Vec<u64> = devices.iter().map(|d| hash(d)).collect();
        let cfg_before = std::fs::read(&cfg).expect("read");
        let err = refused_daemon(p, &cfg);
        let after: Vec<u64> = devices.iter().map(|d| hash(d)).collect();
        assert_eq!(before, after, "{what}: a device changed: {err}");
        assert_eq!(
            std::fs::read(&cfg).expect("read"),
            cfg_before,
            "{what}: the file was rewritten"
        );
        assert!(
            err.contains("configuration refused") && err.contains(reason),
            "{what}: {err}"
        );
    }
}

/// A write-back cache (device `spec`) on cache.img in `p` with one core on core.img, holding
/// `data` dirty at `offset` of that core, stopped with `-T -n` so the dirty data stays on the
/// cache device, and its daemon stopped.
fn stopped_with_dirty_data(p: &Path, data: &[u8], offset: u64) -> (String, PathBuf) {
    let cache = p.join("cache.img");
    let core = p.join("core.img");
    sparse_file(&cache, 64 << 20);
    sparse_file(&core, 64 << 20);
    let mut d = Daemon::start(p);
    let spec = format!("file:{}", cache.display());
    d.ok(&["-S", "-d", &spec, "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", core.to_str().expect("UTF-8")]);
    let mut c = Client::connect_unix(&d.nbd, "cas1-1").expect("connect");
    c.write(data, offset, false).expect("write");
    c.flush().expect("flush");
    c.disconnect().expect("disconnect");
    d.ok(&["-T", "-i", "1", "-n"]);
    assert!(d.stop());
    (spec, core)
}

#[test]
fn an_inactive_core_attaches_again_when_its_file_reappears() {
    let dir = workdir();
    let p = dir.path();
    let data = pattern(7, 2 << 20);
    let (spec, core) = stopped_with_dirty_data(p, &data, 1 << 20);
    let away = p.join("core.away");
    std::fs::rename(&core, &away).expect("move the core away");

    let d = Daemon::start(p);
    d.ok(&["-S", "-d", &spec, "--load"]);
    let (_, cores) = statuses(&d, 1).expect("listed");
    assert_eq!(cores, ["Inactive"]);
    // The core's file comes back under its recorded name: it attaches by itself.
    std::fs::rename(&away, &core).expect("move the core back");
    wait_status(&d, 1, "complete", |c, cores| {
        c == "Running" && cores == ["Active"]
    });
    assert!(
        d.log_text().contains("attached again by itself"),
        "{}",
        d.log_text()
    );
    // Its dirty data is served, and cleaned to the core.
    let mut c = Client::connect_unix(&d.nbd, "cas1-1").expect("connect");
    let mut back = vec![0u8; data.len()];
    c.read(&mut back, 1 << 20).expect("read");
    assert_eq!(back, data);
    c.disconnect().expect("disconnect");
    d.ok(&["-F", "-i", "1"]);
    assert_eq!(
        d.stats_json(1, None)["usage"]["dirty"]["count"].as_u64(),
        Some(0)
    );
    let on_core = std::fs::read(&core).expect("read the core");
    assert_eq!(&on_core[1 << 20..(1 << 20) + data.len()], &data[..]);
}

#[test]
fn a_core_of_the_wrong_size_is_not_attached() {
    let dir = workdir();
    let p = dir.path();
    let cache = p.join("cache.img");
    let core = p.join("core.img");
    sparse_file(&cache, 64 << 20);
    sparse_file(&core, 64 << 20);
    let mut d = Daemon::start(p);
    let spec = format!("file:{}", cache.display());
    d.ok(&["-S", "-d", &spec, "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", core.to_str().expect("UTF-8")]);
    d.ok(&["-T", "-i", "1", "-n"]);
    assert!(d.stop());
    std::fs::remove_file(&core).expect("remove the core");
    let d = Daemon::start(p);
    d.ok(&["-S", "-d", &spec, "--load"]);
    // Another device under the recorded name: the size tells it apart.
    sparse_file(&core, 32 << 20);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !d.log_text().contains("cannot be attached") {
        assert!(Instant::now() < deadline, "{}", d.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
    let (_, cores) = statuses(&d, 1).expect("listed");
    assert_eq!(cores, ["Inactive"]);
    // Logged once, not every second.
    std::thread::sleep(Duration::from_millis(2500));
    assert_eq!(d.log_text().matches("cannot be attached").count(), 1);
}

/// Another device of the same size under a core's recorded name (disks renamed at boot, a file
/// replaced) is not that core: its dirty data must not be written there. The load leaves the
/// core inactive, the watcher does not attach it, and only a forced attach does.
#[test]
fn another_device_of_the_same_size_under_the_core_s_name_is_not_attached() {
    let dir = workdir();
    let p = dir.path();
    let data = pattern(5, 1 << 20);
    let (spec, core) = stopped_with_dirty_data(p, &data, 0);
    let core_s = core.to_str().expect("UTF-8");
    // Keep the old file (so its inode number stays taken) and put another in its place.
    let away = p.join("core.away");
    std::fs::rename(&core, &away).expect("move the core away");
    sparse_file(&core, 64 << 20);
    let impostor = hash(&core);

    let d = Daemon::start(p);
    let out = d.ok(&["-S", "-d", &spec, "--load"]);
    assert!(
        out.contains("core 1 of cache 1 is inactive")
            && out.contains("is not the device it was added as"),
        "{out}"
    );
    let (_, cores) = statuses(&d, 1).expect("listed");
    assert_eq!(cores, ["Inactive"]);
    // The watcher looks at it and refuses it too, once.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !d.log_text().contains("cannot be attached") {
        assert!(Instant::now() < deadline, "{}", d.log_text());
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        d.log_text().contains("is not the device it was added as"),
        "{}",
        d.log_text()
    );
    let err = d.fails(&["-A", "-i", "1", "-j", "1", "-d", core_s]);
    assert!(err.contains("--force"), "{err}");
    let (_, cores) = statuses(&d, 1).expect("listed");
    assert_eq!(cores, ["Inactive"]);
    assert_eq!(
        hash(&core),
        impostor,
        "nothing was written to the other device"
    );

    // The operator says it is the core: it attaches, and takes the dirty data.
    d.ok(&["-A", "-i", "1", "-j", "1", "-d", core_s, "--force"]);
    d.ok(&["-F", "-i", "1"]);
    let on_core = std::fs::read(&core).expect("read the core");
    assert_eq!(&on_core[..data.len()], &data[..]);
}

#[test]
fn stop_daemon_flushes_and_stops() {
    let dir = workdir();
    let p = dir.path();
    let cache = p.join("cache.img");
    let core = p.join("core.img");
    sparse_file(&cache, 64 << 20);
    sparse_file(&core, 64 << 20);
    let d = Daemon::start(p);
    let spec = format!("file:{}", cache.display());
    d.ok(&["-S", "-d", &spec, "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", core.to_str().expect("UTF-8")]);
    let data = pattern(3, 1 << 20);
    let mut c = Client::connect_unix(&d.nbd, "cas1-1").expect("connect");
    c.write(&data, 0, false).expect("write");
    c.disconnect().expect("disconnect");
    let out = d.ok(&["stop-daemon"]);
    assert_eq!(out, "daemon stopped: 1 cache flushed and stopped\n");
    // The sockets are gone and the dirty data is on the core.
    assert!(!d.control.exists() && !d.nbd.exists());
    assert_eq!(
        &std::fs::read(&core).expect("core")[..data.len()],
        &data[..]
    );
    let log = d.log_text();
    assert!(
        log.contains("stop-daemon requested") && log.contains("stopped"),
        "{log}"
    );
    // A second request finds no daemon.
    let again = d.cli(&["stop-daemon"]);
    assert!(!again.status.success());
    assert!(String::from_utf8_lossy(&again.stderr).contains("cannot reach the daemon"));
}

/// nbdkit serving a file over a Unix socket, in the foreground, so it can be killed.
struct Nbdkit {
    child: Option<Child>,
    socket: PathBuf,
    file: PathBuf,
}

impl Nbdkit {
    fn start(socket: &Path, file: &Path) -> Nbdkit {
        let _ = std::fs::remove_file(socket);
        let child = Command::new("nbdkit")
            .args(["--foreground", "--unix"])
            .arg(socket)
            .arg("file")
            .arg(format!("file={}", file.display()))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start nbdkit");
        let deadline = Instant::now() + Duration::from_secs(10);
        while Client::connect_unix(socket, "").is_err() {
            assert!(Instant::now() < deadline, "nbdkit did not start");
            std::thread::sleep(Duration::from_millis(20));
        }
        Nbdkit {
            child: Some(child),
            socket: socket.to_path_buf(),
            file: file.to_path_buf(),
        }
    }

    /// SIGKILL, as a crash or an operator's restart would.
    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn restart(&mut self) {
        self.kill();
        *self = Nbdkit::start(&self.socket.clone(), &self.file.clone());
    }
}

impl Drop for Nbdkit {
    fn drop(&mut self) {
        self.kill();
    }
}

#[test]
fn a_remote_core_reconnects_after_its_server_restarts_during_fio() {
    if !need(&["nbdkit", "fio"]) {
        return;
    }
    let dir = workdir();
    let p = dir.path();
    let cache = p.join("cache.img");
    let core = p.join("core.img");
    let sock = p.join("remote.sock");
    sparse_file(&cache, 128 << 20);
    sparse_file(&core, 256 << 20);
    let mut server = Nbdkit::start(&sock, &core);
    let d = Daemon::start(p);
    let spec = format!("file:{}", cache.display());
    d.ok(&["-S", "-d", &spec, "-c", "wb"]);
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    d.ok(&["-A", "-i", "1", "-d", &uri]);
    // Clean all the time, so core writes are in flight when the server goes.
    d.ok(&[
        "-X",
        "-n",
        "cleaning",
        "-i",
        "1",
        "-p",
        "acp-very-aggressive",
    ]);
    let (_, cores) = statuses(&d, 1).expect("listed");
    assert_eq!(cores, ["Active"]);

    // 32 MiB of 4 KiB random writes, paced to take about 4 s, then verified by reading back.
    let job = |extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "--name=lifecycle",
            "--ioengine=nbd",
            "--rw=randwrite",
            "--bs=4k",
            "--size=32m",
            "--iodepth=8",
            "--verify=crc32c",
            "--randseed=1234",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let run_uri = format!("--uri={}", d.uri("cas1-1"));
    let fio_args = job(&[&run_uri, "--rate_iops=2000"]);
    let fio_dir = p.to_path_buf();
    let run = std::thread::spawn(move || fio(&fio_dir, "during-restart", &fio_args));

    std::thread::sleep(Duration::from_millis(1000));
    assert!(
        !run.is_finished(),
        "fio is still running when the server goes"
    );
    server.kill();
    wait_status(&d, 1, "detached", |_, cores| {
        cores.len() == 1 && cores[0].starts_with("Reconnecting (server gone since ")
    });
    // While the server is gone: reads that need the core fail with EIO (the range past
    // fio's was never written, so it is not in the cache), and a flush of the core fails.
    let mut c = Client::connect_unix(&d.nbd, "cas1-1").expect("connect");
    let mut buf = vec![0u8; 4096];
    let e = c
        .read(&mut buf, 200 << 20)
        .expect_err("a read miss needs the core");
    assert!(
        e.to_string().contains("server error 5 "),
        "EIO expected: {e}"
    );
    // A write-back write lands in the cache and reads back from it.
    let mine = pattern(9, 8192);
    c.write(&mine, 210 << 20, false)
        .expect("wb writes land in the cache");
    let mut back = vec![0u8; mine.len()];
    c.read(&mut back, 210 << 20).expect("a hit needs no core");
    assert_eq!(back, mine);
    c.disconnect().expect("disconnect");
    d.fails(&["-F", "-i", "1"]);
    std::thread::sleep(Duration::from_millis(1000));
    server.restart();
    wait_status(&d, 1, "reconnected", |_, cores| cores == ["Active"]);

    let report = run.join().expect("fio thread");
    let written = report["jobs"][0]["write"]["io_bytes"].as_u64().unwrap_or(0);
    assert_eq!(written, 32 << 20, "fio wrote everything");
    // The cache is cleaned to the restarted server, without a restart of the daemon.
    d.ok(&["-F", "-i", "1"]);
    assert_eq!(
        &std::fs::read(&core).expect("core")[210 << 20..(210 << 20) + mine.len()],
        &mine[..],
        "the write made during the outage reached the core"
    );
    assert_eq!(
        d.stats_json(1, None)["usage"]["dirty"]["count"].as_u64(),
        Some(0)
    );
    let log = d.log_text();
    assert!(
        log.contains("connection lost") && log.contains("reconnected"),
        "{log}"
    );
    let mut d = d;
    assert!(d.stop(), "clean stop");
    server.kill();
    // What is on the core file is what fio wrote: verify it there, without the cache.
    let verify = job(&[
        &format!("--filename={}", core.display()),
        "--ioengine=psync",
        "--verify_only",
    ]);
    let mut verify = verify;
    verify.retain(|a| a != "--ioengine=nbd");
    fio(p, "verify-core", &verify);
}

#[test]
fn an_inactive_remote_core_attaches_when_its_server_answers() {
    if !need(&["nbdkit"]) {
        return;
    }
    let dir = workdir();
    let p = dir.path();
    let cache = p.join("cache.img");
    let core = p.join("core.img");
    let sock = p.join("remote.sock");
    sparse_file(&cache, 64 << 20);
    sparse_file(&core, 64 << 20);
    let mut server = Nbdkit::start(&sock, &core);
    let mut d = Daemon::start(p);
    let spec = format!("file:{}", cache.display());
    d.ok(&["-S", "-d", &spec, "-c", "wb"]);
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    d.ok(&["-A", "-i", "1", "-d", &uri]);
    let data = pattern(5, 1 << 20);
    let mut c = Client::connect_unix(&d.nbd, "cas1-1").expect("connect");
    c.write(&data, 4 << 20, false).expect("write");
    c.flush().expect("flush");
    c.disconnect().expect("disconnect");
    d.ok(&["-T", "-i", "1", "-n"]);
    assert!(d.stop());
    server.kill();

    // The server is down when the cache loads: the core is inactive, its dirty data kept.
    let d = Daemon::start(p);
    d.ok(&["-S", "-d", &spec, "--load"]);
    let (_, cores) = statuses(&d, 1).expect("listed");
    assert_eq!(cores, ["Inactive"]);
    assert!(std::fs::read(&core).expect("core")[4 << 20..5 << 20]
        .iter()
        .all(|&b| b == 0));
    let _server = Nbdkit::start(&sock, &core);
    wait_status(&d, 1, "complete", |c, cores| {
        c == "Running" && cores == ["Active"]
    });
    d.ok(&["-F", "-i", "1"]);
    assert_eq!(
        &std::fs::read(&core).expect("core")[4 << 20..5 << 20],
        &data[..],
        "the dirty data reached the remote core"
    );
}

#[test]
fn stop_daemon_with_its_remote_core_gone_keeps_the_dirty_data_and_says_so() {
    if !need(&["nbdkit"]) {
        return;
    }
    let dir = workdir();
    let p = dir.path();
    let cache = p.join("cache.img");
    let core = p.join("core.img");
    let sock = p.join("remote.sock");
    sparse_file(&cache, 64 << 20);
    sparse_file(&core, 64 << 20);
    let mut server = Nbdkit::start(&sock, &core);
    let mut d = Daemon::start(p);
    let spec = format!("file:{}", cache.display());
    d.ok(&["-S", "-d", &spec, "-c", "wb"]);
    let uri = format!("nbd+unix:///?socket={}", sock.display());
    d.ok(&["-A", "-i", "1", "-d", &uri]);
    let data = pattern(11, 1 << 20);
    let mut c = Client::connect_unix(&d.nbd, "cas1-1").expect("connect");
    c.write(&data, 0, false).expect("write");
    c.flush().expect("flush");
    c.disconnect().expect("disconnect");
    server.kill();

    let err = d.fails(&["stop-daemon"]);
    assert!(
        err.contains("some dirty data could not be flushed"),
        "{err}"
    );
    assert!(!d.stop(), "the daemon exits non-zero");
    assert!(
        d.log_text().contains("dirty data is kept"),
        "{}",
        d.log_text()
    );

    // The server is back: the dirty data loads with the cache and is cleaned to it.
    let _server = Nbdkit::start(&sock, &core);
    let d = Daemon::start(p);
    d.ok(&["-S", "-d", &spec, "--load"]);
    wait_status(&d, 1, "complete", |c, cores| {
        c == "Running" && cores == ["Active"]
    });
    d.ok(&["-F", "-i", "1"]);
    assert_eq!(
        &std::fs::read(&core).expect("core")[..data.len()],
        &data[..]
    );
}

/// opencas.conf's `ioclass_file` (docs/cli.md, "From opencas.conf"): a `[[cache]]`'s
/// `ioclass_file` is loaded when the cache starts and kept in the recorded run-time setup; a class file
/// that would be refused refuses the whole configuration, named by line and column.
#[test]
fn a_configured_ioclass_file_is_loaded_and_a_bad_one_refuses_the_file() {
    let dir = workdir();
    let p = dir.path();
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/ioclass-config.csv");
    let bad = p.join("fs-rules.csv");
    write_file(
        &bad,
        "IO class id,IO class name,Eviction priority,Allocation\n0,unclassified,22,1\n1,metadata&done,0,1\n",
    );
    let cache = p.join("cache.img");
    sparse_file(&cache, 64 << 20);
    let cfg = p.join("hybridcache.toml");
    let text = |classes: &Path| {
        format!(
            "[[cache]]\nid = 1\ndevice = \"{}\"\nioclass_file = \"{}\"\n",
            cache.display(),
            classes.display()
        )
    };

    write_file(&cfg, &text(&bad));
    let err = refused_daemon(p, &cfg);
    assert!(
        err.contains("cache 1: ioclass_file") && err.contains("line 3, column 3"),
        "{err}"
    );

    write_file(&cfg, &text(&example));
    let cfg_s = cfg.to_str().expect("UTF-8 path");
    let d = Daemon::start_with(p, &["--config", cfg_s, "--save-config"]);
    let listed = d.ok(&["-C", "-L", "-i", "1", "-o", "csv"]);
    assert!(
        listed.contains("5,request_size:gt:262144&done,20,0.50"),
        "{listed}"
    );
    let saved = recorded(p);
    assert_eq!(
        saved.caches[0].ioclass_file.as_deref(),
        Some(example.as_path())
    );
}

/// docs/policies.md, "In the configuration file": a loaded cache keeps its superblock's policies
/// for what the file does not name, and the file's `[cache.params]` win over them.
#[test]
fn the_file_s_parameters_win_over_the_superblock_s() {
    let dir = workdir();
    let p = dir.path();
    let cache = p.join("cache.img");
    sparse_file(&cache, 64 << 20);
    let plain = p.join("plain.toml");
    let with_params = p.join("params.toml");
    let section = format!("[[cache]]\nid = 1\ndevice = \"{}\"\n", cache.display());
    write_file(&plain, &section);
    write_file(
        &with_params,
        &format!("{section}[cache.params]\n\"cleaning.policy\" = \"acp\"\n"),
    );
    let start = |cfg: &Path| Daemon::start_with(p, &["--config", cfg.to_str().expect("UTF-8")]);

    let mut d = start(&plain);
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    assert!(d.stop(), "the first daemon stops cleanly");
    let mut d = start(&plain);
    assert_eq!(
        d.param("cleaning", 1, "Cleaning policy type"),
        "nop",
        "kept"
    );
    assert!(d.stop(), "the second daemon stops cleanly");
    let d = start(&with_params);
    assert_eq!(
        d.param("cleaning", 1, "Cleaning policy type"),
        "acp",
        "the file wins"
    );
}

/// opencas.conf's `lazy_startup = false`: the daemon is ready (READY=1 to systemd, the "ready"
/// line) only once the core's late device has appeared and the core serves, and the run-time setup
/// keeps the key.
#[test]
fn a_core_that_is_not_lazy_holds_readiness_until_it_appears() {
    use std::os::unix::net::UnixDatagram;
    use std::sync::{Arc, Mutex};
    let dir = workdir();
    let p = dir.path();
    let (cfg, late_dir, core) = cache_with_a_late_core_that_is_not_lazy(p, 30);
    let notify = p.join("notify.sock");
    let listener = UnixDatagram::bind(&notify).expect("bind the notify socket");
    listener.set_nonblocking(true).expect("nonblocking");
    let created: Arc<Mutex<Option<Instant>>> = Arc::default();
    let creator = {
        let created = created.clone();
        let (late_dir, core) = (late_dir.clone(), core.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(1500));
            std::fs::create_dir(&late_dir).expect("mkdir");
            sparse_file(&core, 32 << 20);
            *created.lock().expect("lock") = Some(Instant::now());
        })
    };
    let d = Daemon::start_with_env(
        p,
        &["--config", cfg.to_str().expect("UTF-8"), "--save-config"],
        &[("NOTIFY_SOCKET", notify.to_str().expect("UTF-8"))],
    );
    let ready_seen = Instant::now();
    let appeared = *created.lock().expect("lock");
    let appeared =
        appeared.unwrap_or_else(|| panic!("ready before the core appeared: {}", d.log_text()));
    assert!(appeared <= ready_seen);
    creator.join().expect("creator");
    let mut buf = [0u8; 64];
    let n = listener.recv(&mut buf).expect("READY=1 was sent");
    assert_eq!(&buf[..n], b"READY=1");
    let (status, cores) = statuses(&d, 1).expect("cache 1 listed");
    assert_eq!(
        (status.as_str(), cores),
        ("Running", vec!["Active".to_string()])
    );
    let data = pattern(3, 1 << 20);
    let mut c = Client::connect_unix(&d.nbd, "cas1-1").expect("cas1-1 is served");
    c.write(&data, 0, false).expect("write");
    let mut back = vec![0u8; data.len()];
    c.read(&mut back, 0).expect("read");
    assert_eq!(back, data);
    c.disconnect().expect("disconnect");
    let log = d.log_text();
    assert!(
        log.contains(&core.display().to_string()) && log.contains("lazy_startup"),
        "{log}"
    );
    let saved = recorded(p);
    assert_eq!(saved.cores[0].lazy_startup, Some(false), "{saved:?}");
    let file = ConfigFile::load(&cfg).expect("the file");
    assert_eq!(file.daemon.device_timeout, Some(30), "{file:?}");
}

/// A 64 MiB cache file and a configuration whose core (in `late/`, not there yet) is marked
/// `lazy_startup = false`, with `device_timeout` seconds: (configuration, late dir, core path).
fn cache_with_a_late_core_that_is_not_lazy(
    p: &Path,
    timeout_s: u64,
) -> (PathBuf, PathBuf, PathBuf) {
    let cache = p.join("cache.img");
    sparse_file(&cache, 64 << 20);
    let late_dir = p.join("late");
    let core = late_dir.join("core.img");
    let cfg = p.join("hybridcache.toml");
    write_file(
        &cfg,
        &format!(
            "[daemon]\ndevice_timeout = {timeout_s}\n\n[[cache]]\nid = 1\ndevice = \"{}\"\nmode = \"wb\"\n\n[[core]]\ncache = 1\nid = 1\ndevice = \"{}\"\nlazy_startup = false\n",
            cache.display(),
            core.display()
        ),
    );
    (cfg, late_dir, core)
}

/// A daemon on `cfg` with its sockets in `p` and its stderr in `p/daemon.err`, not waited for.
fn spawn_daemon(p: &Path, cfg: &Path, extra: &[&str]) -> Child {
    Command::new(BIN)
        .arg("daemon")
        .arg("--control")
        .arg(p.join("control.sock"))
        .arg("--nbd-socket")
        .arg(p.join("nbd.sock"))
        .arg("--state-dir")
        .arg(p)
        .arg("--config")
        .arg(cfg)
        .args(extra)
        .env_remove("HYBRIDCACHE_CONTROL")
        .stdin(Stdio::null())
        .stderr(std::fs::File::create(p.join("daemon.err")).expect("stderr file"))
        .spawn()
        .expect("run the daemon")
}

/// Run a daemon on `cfg` (with --save-config) that must give up by itself and exit with 1;
/// returns how long it ran and its stderr. One that does not give up is killed after 30 s
/// rather than left to hang the test.
fn daemon_that_gives_up(p: &Path, cfg: &Path) -> (Duration, String) {
    let started = Instant::now();
    let err_file = p.join("daemon.err");
    let mut child = spawn_daemon(p, cfg, &["--save-config"]);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break Some(status);
        }
        if started.elapsed() > Duration::from_secs(30) {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = started.elapsed();
    let err = std::fs::read_to_string(&err_file).unwrap_or_default();
    let status = status.unwrap_or_else(|| panic!("still running after 30 s: {err}"));
    assert_eq!(status.code(), Some(1), "{err}");
    (took, err)
}

/// A device that is not lazy and never appears fails the start after `device_timeout`, naming
/// the device, before anything is written to any device or to the file.
#[test]
fn a_device_that_is_not_lazy_and_never_appears_fails_the_start_and_changes_nothing() {
    let dir = workdir();
    let p = dir.path();
    let cache1 = p.join("cache1.img");
    let core1 = p.join("core1.img");
    std::fs::write(&cache1, pattern(1, 16 << 20)).expect("fill");
    std::fs::write(&core1, pattern(2, 16 << 20)).expect("fill");
    let never = p.join("never").join("cache2.img");
    let cfg = p.join("hybridcache.toml");
    write_file(
        &cfg,
        &format!(
            "[daemon]\ndevice_timeout = 2\n\n[[cache]]\nid = 1\ndevice = \"{}\"\n\n[[cache]]\nid = 2\ndevice = \"{}\"\nlazy_startup = false\n\n[[core]]\ncache = 1\nid = 1\ndevice = \"{}\"\n",
            cache1.display(),
            never.display(),
            core1.display()
        ),
    );
    let before = (
        hash(&cache1),
        hash(&core1),
        std::fs::read(&cfg).expect("read"),
    );
    let (took, err) = daemon_that_gives_up(p, &cfg);
    assert!(
        took >= Duration::from_secs(2),
        "gave up after {took:?}: {err}"
    );
    assert!(took < Duration::from_secs(15), "took {took:?}: {err}");
    assert!(
        err.contains(&never.display().to_string()) && err.contains("cache 2"),
        "{err}"
    );
    assert_eq!(
        (
            hash(&cache1),
            hash(&core1),
            std::fs::read(&cfg).expect("read")
        ),
        before,
        "a device or the file changed: {err}"
    );
    assert!(
        !p.join("control.sock").exists(),
        "control socket left behind"
    );
}

/// Lazy devices (the default, or `lazy_startup = true`) are not waited for: the daemon is ready
/// at once and they wait in the background.
#[test]
fn lazy_devices_do_not_hold_readiness() {
    let dir = workdir();
    let p = dir.path();
    let cache1 = p.join("cache1.img");
    sparse_file(&cache1, 64 << 20);
    let cfg = p.join("hybridcache.toml");
    write_file(
        &cfg,
        &format!(
            "[daemon]\ndevice_timeout = 60\n\n[[cache]]\nid = 1\ndevice = \"{}\"\n\n[[cache]]\nid = 2\ndevice = \"{}\"\nlazy_startup = true\n\n[[core]]\ncache = 1\nid = 1\ndevice = \"{}\"\n\n[[core]]\ncache = 2\nid = 1\ndevice = \"{}\"\nlazy_startup = true\n",
            cache1.display(),
            p.join("no-cache2.img").display(),
            p.join("no-core1.img").display(),
            p.join("no-core2.img").display()
        ),
    );
    let started = Instant::now();
    let d = Daemon::start_with(p, &["--config", cfg.to_str().expect("UTF-8")]);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{}",
        d.log_text()
    );
    let (s1, cores1) = statuses(&d, 1).expect("cache 1 listed");
    assert_eq!(
        (s1.as_str(), cores1),
        ("Incomplete", vec!["Waiting for device".to_string()])
    );
    let (s2, _) = statuses(&d, 2).expect("cache 2 listed");
    assert_eq!(s2, "Waiting for device");
}

/// A core that is not lazy whose device is present but cannot be attached (another size than
/// recorded) holds readiness until `device_timeout`; then the daemon stops as SIGTERM would,
/// naming the core, and the cache keeps the core's dirty data for the next start.
#[test]
fn a_core_that_is_not_lazy_and_cannot_be_attached_stops_the_daemon_after_the_timeout() {
    let dir = workdir();
    let p = dir.path();
    let data = pattern(9, 1 << 20);
    let (spec, core) = stopped_with_dirty_data(p, &data, 0);
    let away = p.join("core.away");
    std::fs::rename(&core, &away).expect("move the core away");
    sparse_file(&core, 32 << 20);
    let cfg = p.join("hybridcache.toml");
    let text = |timeout: u64, lazy: &str| {
        format!(
            "[daemon]\ndevice_timeout = {timeout}\n\n[[cache]]\nid = 1\ndevice = \"{spec}\"\n\n[[core]]\ncache = 1\nid = 1\ndevice = \"{}\"\n{lazy}",
            core.display()
        )
    };
    write_file(&cfg, &text(3, "lazy_startup = false\n"));
    let (took, err) = daemon_that_gives_up(p, &cfg);
    assert!(
        took >= Duration::from_secs(3),
        "gave up after {took:?}: {err}"
    );
    assert!(
        err.contains(&core.display().to_string()) && err.contains("not attached"),
        "{err}"
    );
    assert!(
        err.contains("stopped cache 1") || err.contains("stopping"),
        "{err}"
    );

    // The right core back: its dirty data was kept on the cache device.
    std::fs::rename(&away, &core).expect("move the core back");
    write_file(&cfg, &text(3, "lazy_startup = false\n"));
    let d = Daemon::start_with(p, &["--config", cfg.to_str().expect("UTF-8")]);
    let mut c = Client::connect_unix(&d.nbd, "cas1-1").expect("cas1-1 is served");
    let mut back = vec![0u8; data.len()];
    c.read(&mut back, 0).expect("read");
    assert_eq!(back, data);
    c.disconnect().expect("disconnect");
    assert!(
        d.stats_json(1, None)["usage"]["dirty"]["count"].as_u64() > Some(0),
        "the dirty data is still dirty"
    );
}

/// A command sent while the daemon waits for a device that is not lazy waits with it, however
/// long that takes, and is then answered; it is not taken for a socket that is not ours (the CLI
/// gives a silent socket 6 s before it says so, so the device here comes after 7 s).
#[test]
fn a_command_sent_while_the_daemon_waits_for_a_device_is_answered_after_it() {
    let dir = workdir();
    let p = dir.path();
    let (cfg, late_dir, core) = cache_with_a_late_core_that_is_not_lazy(p, 60);
    let control = p.join("control.sock");
    let mut child = spawn_daemon(p, &cfg, &[]);
    let started = Instant::now();
    while !control.exists() && started.elapsed() < Duration::from_secs(20) {
        std::thread::sleep(Duration::from_millis(20));
    }
    let creator = {
        let (late_dir, core) = (late_dir.clone(), core.clone());
        std::thread::spawn(move || {
            std::thread::sleep(Duration::from_secs(7));
            std::fs::create_dir(&late_dir).expect("mkdir");
            sparse_file(&core, 32 << 20);
        })
    };
    let asked = Instant::now();
    let out = Command::new(BIN)
        .arg("--control")
        .arg(&control)
        .arg("-L")
        .env_remove("HYBRIDCACHE_CONTROL")
        .output()
        .expect("run -L");
    let took = asked.elapsed();
    creator.join().expect("creator");
    let _ = Command::new("kill").arg(child.id().to_string()).status();
    let _ = child.wait();
    let err = std::fs::read_to_string(p.join("daemon.err")).unwrap_or_default();
    assert!(
        out.status.success(),
        "-L failed after {took:?}: {}\ndaemon: {err}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        took >= Duration::from_secs(6),
        "answered before the device came: {took:?}"
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("cache") && text.contains(&core.display().to_string()),
        "{text}"
    );
}

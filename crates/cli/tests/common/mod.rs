//! Shared test harness: a daemon per test on sockets in a private directory, the CLI against it,
//! and helpers for the external tools (fio, qemu-img, nbdfuse) the tests drive.
//!
//! Everything lives under the target directory (not /tmp, which may be tmpfs without O_DIRECT),
//! and the daemon is stopped by a Drop guard, so a failing test leaves no process behind.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_hybridcache");

/// A private directory under the target directory.
pub fn workdir() -> tempfile::TempDir {
    tempfile::Builder::new()
        .prefix("hc")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .expect("create a work directory")
}

/// The workspace's one skip rule (crates/testtools): a test that needs a missing tool or
/// privilege calls `need`/`skip`, which fail in CI or with HC_REQUIRE_TOOLS=1 instead of
/// letting the test pass without running.
#[allow(unused_imports)] // Each test binary uses a different subset.
pub use hybridcache_testtools::{have, need, skip, tools_required};

/// A child process killed (and reaped) when dropped.
pub struct Kill(pub Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// nbdkit in the foreground on the Unix socket `sock`, with `args` (filters, plugin and its
/// parameters), once its socket exists.
pub fn nbdkit(sock: &Path, args: &[String]) -> Kill {
    let child = Kill(
        Command::new("nbdkit")
            .args(["-f", "-U"])
            .arg(sock)
            .args(args)
            .spawn()
            .expect("nbdkit"),
    );
    let deadline = Instant::now() + Duration::from_secs(10);
    while !sock.exists() {
        assert!(Instant::now() < deadline, "nbdkit did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

/// nbdkit serving `args` on a TCP port of 127.0.0.1 (a device on another host, as far as the
/// client can tell): the server and its URI without an export name, `nbd://127.0.0.1:PORT`.
pub fn nbdkit_tcp(args: &[String]) -> (Kill, String) {
    // A port the kernel just handed out and nothing listens on; nbdkit may lose it to another
    // test in between, so a start that does not answer is tried again on a new port.
    for _ in 0..5 {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let mut child = Kill(
            Command::new("nbdkit")
                .args(["-f", "-i", "127.0.0.1", "-p"])
                .arg(port.to_string())
                .args(args)
                .spawn()
                .expect("nbdkit"),
        );
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.0.try_wait() {
                break;
            }
            if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
                return (child, format!("nbd://127.0.0.1:{port}"));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
    panic!("nbdkit did not start on a TCP port");
}

/// Make a sparse file of `size` bytes.
pub fn sparse_file(path: &Path, size: u64) {
    let f = std::fs::File::create(path).expect("create file");
    f.set_len(size).expect("size file");
}

/// What most tests start from, in a fresh work directory: sparse files `cache.img` and
/// `core.img`, a daemon, cache 1 started on the cache file (`spec`) with `start_args` such as
/// `["-c", "wb"]`, and the core added, exported as `cas1-1`. Destructure it with the daemon last,
/// so that it stops before the directory goes.
pub struct FileCache {
    pub dir: tempfile::TempDir,
    pub cache: PathBuf,
    pub core: PathBuf,
    pub spec: String,
    pub daemon: Daemon,
}

pub fn file_cache(cache_bytes: u64, core_bytes: u64, start_args: &[&str]) -> FileCache {
    let dir = workdir();
    let cache = dir.path().join("cache.img");
    let core = dir.path().join("core.img");
    sparse_file(&cache, cache_bytes);
    sparse_file(&core, core_bytes);
    let spec = format!("file:{}", cache.display());
    let daemon = Daemon::start(dir.path());
    let mut args = vec!["-S", "-d", spec.as_str()];
    args.extend_from_slice(start_args);
    daemon.ok(&args);
    daemon.ok(&["-A", "-i", "1", "-d", core.to_str().expect("UTF-8 path")]);
    FileCache {
        dir,
        cache,
        core,
        spec,
        daemon,
    }
}

/// A running daemon; stopped (SIGTERM, then SIGKILL after 20 s) when dropped.
pub struct Daemon {
    child: Option<Child>,
    pub control: PathBuf,
    pub nbd: PathBuf,
    pub log: PathBuf,
}

impl Daemon {
    pub fn start(dir: &Path) -> Daemon {
        Self::start_with(dir, &[])
    }

    pub fn start_with(dir: &Path, extra: &[&str]) -> Daemon {
        Self::start_with_env(dir, extra, &[])
    }

    /// As [`Daemon::start_with`], with environment variables for the daemon (e.g. `RUST_LOG`).
    pub fn start_with_env(dir: &Path, extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        let control = dir.join("control.sock");
        let nbd = dir.join("nbd.sock");
        let log = dir.join("daemon.log");
        let logf = std::fs::File::create(&log).expect("daemon log");
        // Each test's own state directory (the default, /var/lib/hybridcache, is the host's);
        // the control socket's directory, where it was before it had a default of its own.
        // A test that plays systemd gives STATE_DIRECTORY instead.
        let state_dir: &[&std::ffi::OsStr] =
            if extra.contains(&"--state-dir") || env.iter().any(|(k, _)| *k == "STATE_DIRECTORY") {
                &[]
            } else {
                &["--state-dir".as_ref(), dir.as_os_str()]
            };
        let child = Command::new(BIN)
            .arg("daemon")
            .arg("--control")
            .arg(&control)
            .arg("--nbd-socket")
            .arg(&nbd)
            .args(state_dir)
            .args(extra)
            .env_remove("HYBRIDCACHE_CONTROL")
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(logf)
            .spawn()
            .expect("spawn daemon");
        let mut d = Daemon {
            child: Some(child),
            control,
            nbd,
            log,
        };
        // A log filtered below INFO has no "ready" line: then the control socket answering says
        // it.
        d.wait_ready(env.iter().any(|(k, _)| *k == "RUST_LOG"));
        d
    }

    fn wait_ready(&mut self, by_socket: bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(c) = self.child.as_mut() {
                if let Ok(Some(status)) = c.try_wait() {
                    panic!("daemon exited early ({status}): {}", self.log_text());
                }
            }
            // The daemon prints "ready" once it accepts control requests.
            if self.log_text().contains(" ready: ") {
                return;
            }
            if by_socket && self.cli(&["-L"]).status.success() {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "daemon not ready: {}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The daemon's process id, while it runs (for /proc/PID/status).
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Run the CLI against this daemon.
    pub fn cli(&self, args: &[&str]) -> Output {
        Command::new(BIN)
            .args(args)
            .arg("--control")
            .arg(&self.control)
            .env_remove("HYBRIDCACHE_CONTROL")
            .output()
            .expect("run the CLI")
    }

    /// Run the CLI and require success; returns stdout.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        assert!(
            out.status.success(),
            "hybridcache {args:?} failed: {}{}",
            String::from_utf8_lossy(&out.stderr),
            self.log_text()
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// Run the CLI and require failure with exit code 1; returns the one-line stderr.
    pub fn fails(&self, args: &[&str]) -> String {
        let out = self.cli(args);
        let err = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(
            out.status.code(),
            Some(1),
            "hybridcache {args:?} should fail: stdout {} stderr {err}",
            String::from_utf8_lossy(&out.stdout)
        );
        assert_eq!(err.lines().count(), 1, "one line expected: {err}");
        err
    }

    /// The NBD URI of an export.
    pub fn uri(&self, export: &str) -> String {
        format!("nbd+unix:///{export}?socket={}", self.nbd.display())
    }

    /// Stop with SIGTERM and wait; returns whether it exited successfully.
    pub fn stop(&mut self) -> bool {
        let Some(mut child) = self.child.take() else {
            return true;
        };
        // SAFETY: signalling our own child by its pid.
        unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return status.success();
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Daemon {
    /// Kill with SIGKILL, as a crash would, and wait for the process to go.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The statistics of a cache (or one core) as JSON.
    pub fn stats_json(&self, cache: u16, core: Option<u16>) -> serde_json::Value {
        let cache = cache.to_string();
        let mut args = vec!["-P", "-i", &cache, "-o", "json"];
        let core = core.map(|c| c.to_string());
        if let Some(c) = &core {
            args.extend(["-j", c]);
        }
        serde_json::from_str(&self.ok(&args)).expect("stats JSON")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Run fio with a job description and return its JSON report; panics on any job error.
pub fn fio(dir: &Path, name: &str, args: &[String]) -> serde_json::Value {
    let out_file = dir.join(format!("{name}.json"));
    let out = Command::new("fio")
        .arg(format!("--output={}", out_file.display()))
        .arg("--output-format=json")
        .args(args)
        .output()
        .expect("run fio");
    let report = std::fs::read_to_string(&out_file).unwrap_or_default();
    assert!(
        out.status.success(),
        "fio {name} failed: {}\n{}\n{report}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    // fio may print non-JSON lines before the report even in the file; start at the first '{'.
    let start = report.find('{').unwrap_or(0);
    let v: serde_json::Value =
        serde_json::from_str(&report[start..]).unwrap_or_else(|e| panic!("fio {name}: {e}"));
    for job in v["jobs"].as_array().expect("fio jobs") {
        assert_eq!(
            job["error"].as_i64(),
            Some(0),
            "fio {name} job {} failed: {job}",
            job["jobname"]
        );
    }
    v
}

/// One NBD FLUSH on `uri` (qemu-io's `flush`), sent after every write before it was
/// acknowledged: it covers all of them. fio's `end_fsync` cannot be relied on for that with
/// `--fsync=N` at an iodepth above 1: fio skips the final flush when the last request to
/// *complete* was a flush (`last_was_sync`, set in its `io_completed`), and a periodic flush sent
/// while the last writes were in flight can complete after them; NBD's flush covers only writes
/// acknowledged before it was sent, so those last writes are covered by nothing.
pub fn nbd_flush(uri: &str) {
    let out = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "flush", uri])
        .output()
        .expect("run qemu-io");
    assert!(
        out.status.success(),
        "qemu-io flush of {uri} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Total IOPS of a fio report (reads plus writes over all jobs).
pub fn fio_iops(v: &serde_json::Value) -> f64 {
    v["jobs"]
        .as_array()
        .map(|jobs| {
            jobs.iter()
                .map(|j| {
                    j["read"]["iops"].as_f64().unwrap_or(0.0)
                        + j["write"]["iops"].as_f64().unwrap_or(0.0)
                })
                .sum()
        })
        .unwrap_or(0.0)
}

/// Start a daemon in `dir` with `args` that must refuse to start: it exits 1, leaves no control
/// socket behind, and its stderr (returned) says why.
pub fn daemon_refuses_to_start(dir: &Path, args: &[&str]) -> String {
    let out = Command::new(BIN)
        .arg("daemon")
        .arg("--control")
        .arg(dir.join("c.sock"))
        .arg("--nbd-socket")
        .arg(dir.join("n.sock"))
        .arg("--state-dir")
        .arg(dir)
        .args(args)
        .env_remove("HYBRIDCACHE_CONTROL")
        .output()
        .expect("run the daemon");
    assert_eq!(out.status.code(), Some(1), "{args:?}");
    assert!(
        !dir.join("c.sock").exists(),
        "{args:?}: control socket left behind"
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

impl Daemon {
    /// One row of `-G -n GROUP -i CACHE -o csv`, looked up by casadm's label, as scripts read
    /// it (tests/casadm_compat.rs checks the labels).
    pub fn param(&self, group: &str, cache: u16, label: &str) -> String {
        let csv = self.ok(&["-G", "-n", group, "-i", &cache.to_string(), "-o", "csv"]);
        csv.lines()
            .skip(1)
            .find_map(|l| l.strip_prefix(label)?.strip_prefix(','))
            .unwrap_or_else(|| panic!("no row '{label}' in -G -n {group}: {csv}"))
            .to_string()
    }
}

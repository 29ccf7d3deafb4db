//! The processes a benchmark starts and stops itself: the bare-core export (`hybridcache serve`),
//! a daemon with its cache, nbdkit with its cache filter, and fio; plus Ctrl-C handling.
//!
//! Every child gets its own process group, so a Ctrl-C at the terminal reaches only the runner,
//! which then stops the children in order (fio first, then the servers) instead of each child
//! reacting on its own (a daemon taking SIGINT would start flushing its dirty data to a slow core,
//! which can take minutes). Each child also gets `PR_SET_PDEATHSIG`: if the runner itself is
//! killed, its children die with it rather than holding sockets and CPU.
//!
//! The daemon is stopped with SIGKILL: its cache is scratch space for one cell, and a clean stop
//! would flush the dirty data to the (slow, emulated) core first. The next cell starts a new cache
//! (`--force`), so nothing carries over.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use crate::protocol::{CleaningData, StatsData};

static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_sig: libc::c_int) {
    // Only an atomic store: the one thing that is async-signal-safe here.
    INTERRUPTED.store(true, Ordering::SeqCst);
}

/// Take SIGINT and SIGTERM as "stop cleanly" requests (see [`interrupted`]).
pub fn install_interrupt_handler() {
    // SAFETY: sigaction with a handler that only stores to an atomic; the struct is zeroed and
    // then filled in as sigaction(2) requires.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as libc::sighandler_t;
        libc::sigemptyset(&mut sa.sa_mask);
        sa.sa_flags = libc::SA_RESTART;
        libc::sigaction(libc::SIGINT, &sa, std::ptr::null_mut());
        libc::sigaction(libc::SIGTERM, &sa, std::ptr::null_mut());
    }
}

pub fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::SeqCst)
}

/// The error a phase returns when the user asked to stop.
#[derive(Debug)]
pub struct Interrupted;

impl std::fmt::Display for Interrupted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("interrupted")
    }
}

impl std::error::Error for Interrupted {}

/// Sleep up to `d`, waking early on an interrupt.
pub fn sleep_checked(d: Duration) -> Result<()> {
    let end = Instant::now() + d;
    while Instant::now() < end {
        if interrupted() {
            return Err(Interrupted.into());
        }
        std::thread::sleep((end - Instant::now()).min(Duration::from_millis(100)));
    }
    Ok(())
}

/// How a child is asked to stop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StopWith {
    /// SIGTERM, then SIGKILL after a grace period.
    Term,
    /// SIGKILL at once (scratch state nobody needs).
    Kill,
}

/// A child process that is stopped when dropped.
pub struct Proc {
    pub name: String,
    child: Child,
    stop: StopWith,
    pub log: PathBuf,
}

/// A command set up as every child of the runner is: own process group, dies with the runner,
/// stdin closed, stdout and stderr to `log`.
pub fn command(program: &Path, log: &Path) -> Result<Command> {
    let out = File::create(log).with_context(|| format!("cannot create {}", log.display()))?;
    let err = out.try_clone()?;
    let mut cmd = Command::new(program);
    cmd.stdin(Stdio::null())
        .stdout(Stdio::from(out))
        .stderr(Stdio::from(err))
        .process_group(0);
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    Ok(cmd)
}

impl Proc {
    pub fn spawn(name: &str, mut cmd: Command, log: &Path, stop: StopWith) -> Result<Proc> {
        let child = cmd.spawn().with_context(|| {
            format!(
                "cannot start {name} ({})",
                cmd.get_program().to_string_lossy()
            )
        })?;
        Ok(Proc {
            name: name.to_string(),
            child,
            stop,
            log: log.to_path_buf(),
        })
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Whether it has exited (and with what), without waiting.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    pub fn signal(&self, sig: libc::c_int) {
        // SAFETY: kill(2) on our own child's pid; a stale pid is impossible while we hold the
        // un-reaped Child.
        unsafe {
            libc::kill(self.pid(), sig);
        }
    }

    /// The last lines of its log, for error messages.
    pub fn log_tail(&self) -> String {
        log_tail(&self.log)
    }

    /// Stop it (per its [`StopWith`]) and reap it.
    pub fn stop(&mut self) {
        if self.exited().is_some() {
            return;
        }
        match self.stop {
            StopWith::Kill => self.signal(libc::SIGKILL),
            StopWith::Term => {
                self.signal(libc::SIGTERM);
                let end = Instant::now() + Duration::from_secs(10);
                while Instant::now() < end {
                    if self.exited().is_some() {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
                self.signal(libc::SIGKILL);
            }
        }
        let _ = self.child.wait();
    }

    /// Wait until it exits; on an interrupt, SIGINT it (fio then still writes its JSON) and
    /// return [`Interrupted`] once it is gone.
    pub fn wait(&mut self) -> Result<std::process::ExitStatus> {
        loop {
            if let Some(s) = self.exited() {
                return Ok(s);
            }
            if interrupted() {
                self.signal(libc::SIGINT);
                let end = Instant::now() + Duration::from_secs(5);
                while Instant::now() < end && self.exited().is_none() {
                    std::thread::sleep(Duration::from_millis(20));
                }
                self.stop = StopWith::Kill;
                self.stop();
                return Err(Interrupted.into());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.stop();
    }
}

pub fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let tail = &lines[lines.len().saturating_sub(3)..];
    tail.join(" | ")
}

/// Wait until something listens on the Unix socket `path`, the process exits, or 15 s pass.
pub fn wait_for_socket(proc: &mut Proc, path: &Path) -> Result<()> {
    let end = Instant::now() + Duration::from_secs(15);
    loop {
        if std::os::unix::net::UnixStream::connect(path).is_ok() {
            return Ok(());
        }
        if let Some(status) = proc.exited() {
            bail!(
                "{} exited ({status}) before listening on {}: {}",
                proc.name,
                path.display(),
                proc.log_tail()
            );
        }
        if Instant::now() > end {
            bail!(
                "{} did not listen on {} within 15 s: {}",
                proc.name,
                path.display(),
                proc.log_tail()
            );
        }
        if interrupted() {
            return Err(Interrupted.into());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Management of the bench's own daemon through the casadm-style CLI (our own binary), so the
/// bench drives the cache exactly as a user would and needs no private API.
#[derive(Debug, Clone)]
pub struct CacheCtl {
    pub bin: PathBuf,
    pub control: PathBuf,
    pub id: u16,
}

impl CacheCtl {
    /// Run `hybridcache --control CTL ARGS...`; stdout on success, stderr's line as the error.
    pub fn run(&self, args: &[String]) -> Result<String> {
        let out = Command::new(&self.bin)
            .arg("--control")
            .arg(&self.control)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .with_context(|| format!("cannot run {}", self.bin.display()))?;
        if !out.status.success() {
            let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
            bail!("hybridcache {}: {err}", args.join(" "));
        }
        Ok(String::from_utf8_lossy(&out.stdout).to_string())
    }

    fn id(&self) -> String {
        self.id.to_string()
    }

    /// `hybridcache -P -i ID -o json`, its `raw` counters.
    pub fn stats(&self) -> Result<StatsData> {
        self.stats_and_cleaning().map(|(s, _)| s)
    }

    /// The raw counters and, when the daemon reports them, cleaning's.
    pub fn stats_and_cleaning(&self) -> Result<(StatsData, Option<CleaningData>)> {
        let text = self.run(&[
            "-P".into(),
            "-i".into(),
            self.id(),
            "-o".into(),
            "json".into(),
        ])?;
        let v: serde_json::Value =
            serde_json::from_str(&text).context("the statistics JSON does not parse")?;
        let raw = serde_json::from_value(v["raw"].clone())
            .context("the statistics JSON has no raw counters")?;
        Ok((raw, serde_json::from_value(v["cleaning"].clone()).ok()))
    }

    /// `hybridcache -X -n cleaning -i ID -p POLICY`.
    pub fn set_cleaning(&self, policy: &str) -> Result<()> {
        self.run(&[
            "-X".into(),
            "-n".into(),
            "cleaning".into(),
            "-i".into(),
            self.id(),
            "-p".into(),
            policy.into(),
        ])
        .map(|_| ())
    }

    /// `hybridcache -X -n NAME -i ID` plus the given flags (cleaning-alru, cleaning-acp,
    /// seq-cutoff); nothing is sent when there are no flags.
    pub fn set_params(&self, name: &str, flags: &[(&str, String)]) -> Result<()> {
        if flags.is_empty() {
            return Ok(());
        }
        let mut args: Vec<String> = vec!["-X".into(), "-n".into(), name.into(), "-i".into()];
        args.push(self.id());
        for (f, v) in flags {
            args.push((*f).into());
            args.push(v.clone());
        }
        self.run(&args).map(|_| ())
    }

    /// `hybridcache -F -i ID`: write every dirty line to the core.
    pub fn flush(&self) -> Result<()> {
        self.run(&["-F".into(), "-i".into(), self.id()]).map(|_| ())
    }
}

/// `fio --version`, `nbdkit --version`: the first line, or why not.
pub fn tool_version(program: &str) -> String {
    match Command::new(program).arg("--version").output() {
        Ok(o) if o.status.success() => String::from_utf8_lossy(&o.stdout)
            .lines()
            .next()
            .unwrap_or("")
            .trim()
            .to_string(),
        Ok(o) => format!("unknown (exit {})", o.status),
        Err(e) => format!("not available ({e})"),
    }
}

/// Whether `program` can be run at all.
pub fn have(program: &str) -> bool {
    Command::new(program)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Our own binary, for `serve` and `daemon` children and management commands.
pub fn our_binary() -> Result<PathBuf> {
    std::env::current_exe().map_err(|e| anyhow!("cannot find the hybridcache binary itself: {e}"))
}

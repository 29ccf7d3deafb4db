//! The real [`Target`]: one configuration set up with real processes for one cell.
//!
//! Every cell starts from scratch: a `hybridcache serve` process exports the core spec (so an
//! emulated core starts with an idle model and, with RAM backing, no data), then for `cache` a
//! daemon whose cache (`-S --force`) has the core spec itself as its core (`core_path =
//! "direct"`, the default: a fresh device, as a cache sits on its local array; the bare export
//! is stopped first) or the bare export (`-A -d nbd+unix://...`, `core_path = "nbd"`), and for
//! `nbdkit-cache` nbdkit's `nbd` plugin behind its `cache` filter, connected to the bare export.
//! fio then talks to the configuration's own socket. Dropping the rig stops everything.
//!
//! While fio runs, the rig samples the cache's statistics once a second (`hybridcache -P -o
//! json`) for the dirty/occupancy series and the client throughput (exported bytes per second);
//! where there are no statistics the throughput comes from fio's 1 s bandwidth log.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use hybridcache_nbd::Client;

use super::fio::{self, FioJob};
use super::matrix::{Config, CorePath, Matrix, ProtocolName};
use super::procs::{self, CacheCtl, Interrupted, Proc, StopWith};
use super::protocol::{PhaseRun, Sample, Target};
use crate::protocol::StatsData;

/// Export name of the bare core.
pub const CORE_EXPORT: &str = "core";

pub struct Rig {
    config: Config,
    /// fio's target.
    pub uri: String,
    /// Where this cell's fio output goes.
    cell_dir: PathBuf,
    core_socket: PathBuf,
    ctl: Option<CacheCtl>,
    cache_bytes: Option<u64>,
    // Stopped in reverse order of start by `Drop` (the front ends before the core).
    procs: Vec<Proc>,
}

impl Rig {
    /// Start `config` for one cell. `run_dir` holds sockets and logs (short path: sockets
    /// names are limited to 107 bytes), `cell_dir` the cell's files.
    pub fn start(
        config: Config,
        m: &Matrix,
        bin: &Path,
        run_dir: &Path,
        cell_dir: &Path,
    ) -> Result<Rig> {
        std::fs::create_dir_all(cell_dir)
            .with_context(|| format!("cannot create {}", cell_dir.display()))?;
        let (serve, core_socket) =
            start_serve(bin, &m.core_device, m.core_workers, run_dir, cell_dir)?;
        let core_size = Client::connect_unix(&core_socket, CORE_EXPORT)
            .map_err(|e| anyhow!("cannot connect to the bare core export: {e}"))?
            .size();
        let mut rig = Rig {
            config,
            uri: core_uri(&core_socket),
            cell_dir: cell_dir.to_path_buf(),
            core_socket: core_socket.clone(),
            ctl: None,
            cache_bytes: None,
            procs: vec![serve],
        };
        // steady measures on a fresh region right after the filled one.
        let regions = if m.protocol.name == ProtocolName::Steady {
            2
        } else {
            1
        };
        let needed = m.offset + regions * m.size;
        if needed > core_size {
            bail!(
                "the core ({core_size} bytes) is smaller than matrix.offset + {regions} x matrix.size ({needed} bytes){}",
                if regions == 2 { " (steady measures on a fresh region after the filled one)" } else { "" }
            );
        }
        match config {
            Config::Core => {}
            Config::Cache => {
                if m.cache.core_path == CorePath::Direct {
                    // The daemon opens the core itself: the bare export only told its size (and
                    // must not hold a file the daemon claims).
                    rig.stop();
                }
                rig.start_daemon(m, bin, run_dir, cell_dir)?
            }
            Config::Nbdkit => rig.start_nbdkit(m, run_dir, cell_dir)?,
        }
        Ok(rig)
    }

    fn start_daemon(
        &mut self,
        m: &Matrix,
        bin: &Path,
        run_dir: &Path,
        log_dir: &Path,
    ) -> Result<()> {
        let control = run_dir.join("control.sock");
        let nbd = run_dir.join("nbd.sock");
        let _ = std::fs::remove_file(&control);
        let _ = std::fs::remove_file(&nbd);
        let log = log_dir.join("daemon.log");
        let mut cmd = procs::command(bin, &log)?;
        cmd.arg("daemon")
            .arg("--control")
            .arg(&control)
            .arg("--nbd-socket")
            .arg(&nbd)
            // The run's own state directory, not the host's /var/lib/hybridcache.
            .arg("--state-dir")
            .arg(run_dir)
            .arg("--nbd-workers")
            .arg(m.cache.nbd_workers.to_string());
        let mut daemon = Proc::spawn("hybridcache daemon", cmd, &log, StopWith::Kill)?;
        procs::wait_for_socket(&mut daemon, &control)?;
        self.procs.push(daemon);
        let ctl = CacheCtl {
            bin: bin.to_path_buf(),
            control,
            id: 1,
        };
        let c = &m.cache;
        ctl.run(&[
            "-S".into(),
            "-d".into(),
            c.device.clone(),
            "-i".into(),
            "1".into(),
            "-c".into(),
            c.mode.clone(),
            "-x".into(),
            c.line_size_kib.to_string(),
            "--force".into(),
        ])?;
        let core = match c.core_path {
            CorePath::Direct => m.core_device.clone(),
            CorePath::Nbd => core_uri(&self.core_socket),
        };
        ctl.run(&["-A".into(), "-i".into(), "1".into(), "-d".into(), core])?;
        for (group, flags) in c.param_commands() {
            ctl.set_params(group, &flags)?;
        }
        if let Some(p) = &c.cleaning {
            ctl.set_cleaning(p)?;
        }
        let s = ctl.stats()?;
        self.cache_bytes = Some(s.total_lines * s.line_size as u64);
        self.ctl = Some(ctl);
        self.uri = format!("nbd+unix:///cas1-1?socket={}", nbd.display());
        Ok(())
    }

    fn start_nbdkit(&mut self, m: &Matrix, run_dir: &Path, log_dir: &Path) -> Result<()> {
        let sock = run_dir.join("nbdkit.sock");
        let _ = std::fs::remove_file(&sock);
        let log = log_dir.join("nbdkit.log");
        let n = &m.nbdkit;
        let mut cmd = procs::command(Path::new("nbdkit"), &log)?;
        // TMPDIR is where the cache filter keeps its (unlinked) cache file.
        cmd.env("TMPDIR", &n.cache_dir)
            .arg("-f")
            .arg("--exit-with-parent")
            .arg("-U")
            .arg(&sock);
        if let Some(t) = n.threads {
            cmd.arg("--threads").arg(t.to_string());
        }
        cmd.arg("--filter=cache")
            .arg("nbd")
            .arg(format!("socket={}", self.core_socket.display()))
            .arg(format!("export={CORE_EXPORT}"))
            .arg(format!("cache={}", n.mode))
            .arg(format!("cache-min-block-size={}", n.min_block_size));
        if let Some(max) = n.max_size {
            cmd.arg(format!("cache-max-size={max}"));
        }
        let mut p = Proc::spawn("nbdkit", cmd, &log, StopWith::Term)
            .context("nbdkit-cache needs nbdkit (Debian: apt-get install nbdkit)")?;
        procs::wait_for_socket(&mut p, &sock)?;
        self.procs.push(p);
        self.cache_bytes = n.max_size;
        self.uri = format!("nbd+unix:///?socket={}", sock.display());
        Ok(())
    }

    /// Stop everything (also done on drop).
    pub fn stop(&mut self) {
        while let Some(mut p) = self.procs.pop() {
            p.stop();
        }
    }

    /// `prev`: the time, exported bytes and cleaned lines of the previous sample.
    fn sample(&self, t: f64, prev: &mut Option<(Instant, u64, Option<u64>)>) -> Sample {
        let Some(ctl) = &self.ctl else {
            return Sample {
                t,
                ..Default::default()
            };
        };
        match ctl.stats_and_cleaning() {
            Ok((s, cleaning)) => {
                let bytes = s.exported_read_bytes + s.exported_written_bytes;
                let cleaned = cleaning.map(|c| c.cleaned_lines);
                let now = Instant::now();
                let mut sample = Sample::from_stats(t, &s, None);
                if let Some((at, b, c)) = *prev {
                    let secs = now.duration_since(at).as_secs_f64();
                    sample.mb_s = Some(bytes.saturating_sub(b) as f64 / secs / 1e6);
                    if let (Some(c), Some(now_c)) = (c, cleaned) {
                        sample.cleaned_lines_s = Some(now_c.saturating_sub(c) as f64 / secs);
                    }
                }
                *prev = Some((now, bytes, cleaned));
                sample
            }
            Err(_) => Sample {
                t,
                ..Default::default()
            },
        }
    }
}

impl Drop for Rig {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Start `hybridcache serve` for `spec` in `run_dir` and wait until it listens.
pub fn start_serve(
    bin: &Path,
    spec: &str,
    workers: usize,
    run_dir: &Path,
    log_dir: &Path,
) -> Result<(Proc, PathBuf)> {
    let socket = run_dir.join("core.sock");
    let _ = std::fs::remove_file(&socket);
    let log = log_dir.join("serve.log");
    let mut cmd = procs::command(bin, &log)?;
    cmd.arg("serve")
        .arg("--core")
        .arg(spec)
        .arg("--socket")
        .arg(&socket)
        .arg("--name")
        .arg(CORE_EXPORT)
        .arg("--workers")
        .arg(workers.to_string());
    let mut serve = Proc::spawn("hybridcache serve", cmd, &log, StopWith::Term)?;
    procs::wait_for_socket(&mut serve, &socket)?;
    Ok((serve, socket))
}

/// Run one fio job to its end (no sampling), writing DIR/NAME.json; an interrupt stops it.
pub fn run_fio(job: &FioJob, dir: &Path) -> Result<fio::FioResult> {
    let json = dir.join(format!("{}.json", job.name));
    let log = dir.join(format!("{}.log", job.name));
    let mut cmd = procs::command(Path::new("fio"), &log)?;
    cmd.args(job.args(&json, None));
    let mut p = Proc::spawn("fio", cmd, &log, StopWith::Term)
        .context("this needs fio (Debian: apt-get install fio)")?;
    let status = p.wait()?;
    if !status.success() {
        bail!(
            "fio ({}) failed ({status}): {}",
            job.name,
            procs::log_tail(&log)
        );
    }
    let text = std::fs::read_to_string(&json).unwrap_or_default();
    fio::parse_json(&text).with_context(|| format!("fio ({}): {}", job.name, procs::log_tail(&log)))
}

pub fn core_uri(socket: &Path) -> String {
    format!("nbd+unix:///{CORE_EXPORT}?socket={}", socket.display())
}

impl Target for Rig {
    fn config(&self) -> Config {
        self.config
    }

    fn has_stats(&self) -> bool {
        self.ctl.is_some()
    }

    fn cache_bytes(&self) -> Option<u64> {
        self.cache_bytes
    }

    fn run(
        &mut self,
        phase: &str,
        job: &FioJob,
        stop: &mut dyn FnMut(&Sample) -> bool,
    ) -> Result<PhaseRun> {
        let json = self.cell_dir.join(format!("{phase}.json"));
        let bw_prefix = self.cell_dir.join(phase);
        let log = self.cell_dir.join(format!("{phase}.log"));
        let _ = std::fs::remove_file(&json);
        let mut cmd = procs::command(Path::new("fio"), &log)?;
        cmd.args(job.args(&json, Some(&bw_prefix)));
        let started = Instant::now();
        let mut fio = Proc::spawn("fio", cmd, &log, StopWith::Term)
            .context("the bench needs fio (Debian: apt-get install fio)")?;
        let mut series = Vec::new();
        let mut prev = None;
        // The baseline for the first second's throughput, and the series' starting point.
        let first = self.sample(0.0, &mut prev);
        if self.has_stats() {
            series.push(first);
        }
        let mut next = Duration::from_secs(1);
        let mut stopped_early = false;
        let status = loop {
            if let Some(s) = fio.exited() {
                break s;
            }
            if procs::interrupted() {
                fio.wait()?; // SIGINTs fio and returns Interrupted
            }
            if started.elapsed() >= next {
                let s = self.sample(next.as_secs_f64(), &mut prev);
                series.push(s);
                next += Duration::from_secs(1);
                if !stopped_early && stop(&s) {
                    stopped_early = true;
                    // fio stops its jobs on SIGINT and still writes the JSON.
                    fio.signal(libc::SIGINT);
                }
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let seconds = started.elapsed().as_secs_f64();
        let text = std::fs::read_to_string(&json).unwrap_or_default();
        if !status.success() && !stopped_early {
            bail!("fio ({phase}) failed ({status}): {}", procs::log_tail(&log));
        }
        let result = fio::parse_json(&text)
            .with_context(|| format!("fio ({phase}): {}", procs::log_tail(&log)))?;
        if !self.has_stats() {
            // Throughput per second from fio's own log, where no cache statistics exist.
            series = fio::read_bw_logs(&bw_prefix)
                .into_iter()
                .map(|(t, mb)| Sample {
                    t,
                    mb_s: Some(mb),
                    ..Default::default()
                })
                .collect();
        }
        Ok(PhaseRun {
            fio: result,
            series,
            stopped_early,
            seconds,
        })
    }

    fn stats(&mut self) -> Result<Option<StatsData>> {
        match &self.ctl {
            Some(c) => c.stats().map(Some),
            None => Ok(None),
        }
    }

    fn set_cleaning(&mut self, policy: &str) -> Result<()> {
        match &self.ctl {
            Some(c) => c.set_cleaning(policy),
            None => Ok(()),
        }
    }

    fn flush(&mut self) -> Result<()> {
        match (&self.ctl, self.config) {
            (Some(c), _) => c.flush(),
            (None, Config::Nbdkit) => {
                // nbdkit's cache filter in write-back writes its dirty blocks on an NBD flush.
                let sock = self.uri.rsplit("socket=").next().unwrap_or_default();
                let mut client = Client::connect_unix(sock, "")
                    .map_err(|e| anyhow!("cannot connect to nbdkit to flush: {e}"))?;
                client
                    .flush()
                    .map_err(|e| anyhow!("nbdkit's flush failed: {e}"))?;
                let _ = client.disconnect();
                Ok(())
            }
            (None, _) => Ok(()),
        }
    }

    fn tick(&mut self) -> Result<()> {
        procs::sleep_checked(Duration::from_secs(1))
    }
}

/// Turn an interrupt deep inside a phase into the runner's stop, other errors into a failed cell.
pub fn is_interrupt(e: &anyhow::Error) -> bool {
    e.downcast_ref::<Interrupted>().is_some()
}

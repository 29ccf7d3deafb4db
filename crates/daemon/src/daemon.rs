//! The daemon proper: owns every cache, serves the exported volumes through their front-ends
//! (NBD, ublk; frontend.rs), and answers management requests on the control socket until
//! SIGTERM/SIGINT.
//!
//! Threads: the main thread sets everything up and then waits for a signal (`sigwait`; the
//! signals are blocked in every thread, so no handler runs in an arbitrary context); the control
//! socket has an accept thread plus one thread per client connection; the NBD server has its own.
//! Management requests that change the setup run one at a time under the state lock; long
//! operations that only use a cache (flush, mode switch with flush) take a handle and release the
//! lock, so statistics stay readable meanwhile.
//!
//! Every request validates everything it can before changing anything, so an error leaves the
//! setup as it was.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::SocketAddr;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use hybridcache_engine::{
    Cache, CacheConfig, CacheMode, CoreRecord, CoreStatus, EngineError, LineSize,
};
use hybridcache_nbd::{ExportRegistry, Server, ServerConfig};
use parking_lot::{Condvar, Mutex};
use serde_json::{json, Value};

use crate::claims::{ClaimedVolume, OwnEndpoints};
use crate::config::{CacheSection, ConfigFile, CoreSection, DaemonSection};
use crate::devices::{device_key, is_missing, open_device, DeviceKey};
use crate::frontend::{ExportSpec, Frontend, Frontends, NbdFrontend};
use crate::metrics::{CacheView, CoreView, MetricsServer};
use crate::nbd_volume::is_nbd_uri;
use crate::params;

mod check;
mod disconnect;
mod health;
mod startup;
mod watch;
use crate::protocol::{self, CacheInfo, CoreInfo, Request, Response, StatsReport};
use crate::safety::{self, Consent, Consents, Loss};
use crate::target::Target;
use disconnect::Disconnected;
use hybridcache_volume::VolumeRef;

pub const DEFAULT_CONTROL: &str = "/run/hybridcache/control.sock";
pub const DEFAULT_NBD_SOCKET: &str = "/run/hybridcache/nbd.sock";
/// Requests in flight per NBD connection unless configured. A write hit is a cache-device write
/// that a worker waits for, so this is the queue depth the cache device sees for writes: at 4,
/// 4 KiB write hits at qd32 reached 0.26-0.29 of the raw file's IOPS, at 16 about twice that
/// (docs/performance.md §6). 16 is also nbdkit's default thread count.
pub const DEFAULT_NBD_WORKERS: usize = 16;
const MAX_CACHE_ID: u16 = 16384;
/// How long a stop or removal waits for clients that are disconnecting before it refuses.
const CLIENT_GONE_GRACE: Duration = Duration::from_secs(2);
/// What `--zero-metadata` writes over: the two config slots (engine's format.rs META_OFFSET).
const ZEROED_BYTES: u64 = 2 << 20;
/// The ublk driver's own limit on hardware queues per device (UBLK_MAX_NR_QUEUES).
const MAX_UBLK_QUEUES: u16 = 4096;
/// A control request line longer than this is refused (a request is a few hundred bytes).
const MAX_LINE: usize = 64 << 10;

/// Daemon options from the command line; each overrides the configuration file's `[daemon]`.
#[derive(Debug, Clone, Default)]
pub struct DaemonOptions {
    pub config: Option<PathBuf>,
    pub control: Option<PathBuf>,
    pub nbd_socket: Option<PathBuf>,
    pub nbd_listen: Option<String>,
    pub nbd_workers: Option<usize>,
    /// `--save-config`: accepted for older units; it only logs a WARN (the file is never
    /// written).
    pub save_config: bool,
    /// Serve Prometheus metrics over HTTP here (`--metrics-listen`); off when None.
    pub metrics_listen: Option<String>,
    /// NBD limits from the command line; each overrides the file's key.
    pub nbd_limits: NbdLimits,
    /// The front-end of cores that name none (`--frontend`): "nbd" (default) or "ublk".
    pub frontend: Option<String>,
    /// Queues of each ublk device (`--ublk-queues`); None: one per CPU.
    pub ublk_queues: Option<u16>,
    /// The daemon's state directory (`--state-dir`, state.rs); default `$STATE_DIRECTORY`,
    /// else /var/lib/hybridcache.
    pub state_dir: Option<PathBuf>,
    /// Seconds of due cleaning without progress before a stall is logged
    /// (`--cleaning-stall-warn`).
    pub cleaning_stall_warn: Option<u64>,
    /// Seconds a core's device may go without completing an outstanding write or flush before
    /// that core's flush is given up as timed out (`--core-flush-timeout`).
    pub core_flush_timeout: Option<u64>,
}

/// NBD server limits as the command line gives them (`--nbd-max-connections` ...); None
/// leaves the `[daemon]` key of the configuration file, or else the server's default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NbdLimits {
    pub max_connections: Option<usize>,
    pub max_connections_per_client: Option<usize>,
    pub max_connections_per_user: Option<usize>,
    pub max_connections_per_export: Option<usize>,
    /// Seconds.
    pub handshake_timeout: Option<u64>,
    /// Seconds; 0 never drops a stalled client.
    pub stall_timeout: Option<u64>,
    /// Bytes.
    pub memory_limit: Option<u64>,
}

/// The NBD server's configuration: command line over file over defaults, each limit checked.
pub fn nbd_server_config(
    workers: usize,
    cli: &NbdLimits,
    file: &DaemonSection,
) -> Result<ServerConfig> {
    let d = ServerConfig::default();
    let count = |name: &str, cli: Option<usize>, file: Option<usize>, default: usize| {
        let n = cli.or(file).unwrap_or(default);
        if n == 0 {
            bail!("{name} must be at least 1");
        }
        Ok(n)
    };
    let max_connections_set = cli.max_connections.or(file.nbd_max_connections).is_some();
    let mut max_connections = count(
        "nbd max connections",
        cli.max_connections,
        file.nbd_max_connections,
        d.max_connections,
    )?;
    let per_client = count(
        "nbd max connections per client",
        cli.max_connections_per_client,
        file.nbd_max_connections_per_client,
        d.max_connections_per_client,
    )?;
    let per_user = count(
        "nbd max connections per user",
        cli.max_connections_per_user,
        file.nbd_max_connections_per_user,
        d.max_connections_per_user,
    )?;
    let per_export = count(
        "nbd max connections per export",
        cli.max_connections_per_export,
        file.nbd_max_connections_per_export,
        d.max_connections_per_export,
    )?;
    let handshake = match cli.handshake_timeout.or(file.nbd_handshake_timeout) {
        Some(0) => bail!("nbd handshake timeout must be at least 1 second"),
        Some(s) => Some(Duration::from_secs(s)),
        None => d.handshake_timeout,
    };
    let stall = match cli.stall_timeout.or(file.nbd_stall_timeout) {
        Some(0) => None,
        Some(s) => Some(Duration::from_secs(s)),
        None => d.stall_timeout,
    };
    let memory_limit = match (cli.memory_limit, &file.nbd_memory_limit) {
        (Some(b), _) => b,
        (None, Some(text)) => {
            hybridcache_volume::parse_size(text).map_err(|e| anyhow!("nbd_memory_limit: {e}"))?
        }
        (None, None) => d.memory_limit,
    };
    let mut cfg = ServerConfig {
        workers_per_connection: workers,
        max_connections,
        max_connections_per_client: per_client,
        max_connections_per_user: per_user,
        max_connections_per_export: per_export,
        handshake_timeout: handshake,
        stall_timeout: stall,
        memory_limit,
        ..d
    };
    // The bound must leave room for at least a few in-flight requests beside what every
    // connection holds on its own; otherwise the server would exceed it by design. Many
    // workers per connection make connections dearer: unless the connection count was set
    // explicitly, it shrinks to what the limit holds.
    let per_conn = cfg.connection_overhead();
    let room = memory_limit.saturating_sub(48 << 20);
    if !max_connections_set && (max_connections as u64) * per_conn > room {
        let fits = (room / per_conn) as usize;
        if fits >= 16 {
            tracing::warn!(
                "NBD: {max_connections} connections of {workers} workers do not fit in the \
                 memory limit of {} MiB; serving at most {fits} (set nbd_max_connections or \
                 nbd_memory_limit to choose)",
                memory_limit >> 20
            );
            max_connections = fits;
            cfg.max_connections = fits;
        }
    }
    let fixed = max_connections as u64 * per_conn;
    if memory_limit < fixed + (32 << 20) {
        bail!(
            "nbd memory limit {} MiB is too small for {max_connections} connections \
             ({} MiB for the connections alone, plus 32 MiB): raise it or lower max connections",
            memory_limit >> 20,
            fixed >> 20
        );
    }
    Ok(cfg)
}

struct CoreEntry {
    device: String,
    /// None for an inactive core (its device was missing at load) and for ram:/null: devices.
    key: Option<DeviceKey>,
    /// False while the core is inactive: no export, its dirty data waits on the cache device.
    active: bool,
    /// An inactive core the engine does not know: the configuration names it, but its device
    /// was missing, so it was never added (it is added when the device appears).
    pending: bool,
    /// The front-end serving (or, while inactive, to serve) its export.
    frontend: &'static str,
    /// What its export's requests go to (None while inactive): kept so that a disconnect can
    /// swap the cache out from under the export.
    target: Option<Target>,
    /// The configuration file's `lazy_startup`, kept so that saving the file keeps it.
    lazy_startup: Option<bool>,
}

/// A cache of the configuration file that is not running: its device was missing at start (it
/// starts when the device appears), or starting it failed. Kept exactly as the file had it.
struct Waiting {
    section: CacheSection,
    cores: Vec<CoreSection>,
    /// What `-L` shows: "Waiting for device", or why starting failed.
    status: String,
}

const WAITING_FOR_DEVICE: &str = "Waiting for device";

/// How `start-cache` gets its cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// A new cache; `force` overwrites a cache the device holds.
    Create { force: bool },
    /// The cache the device holds (`--load`).
    Load,
    /// The configuration file: load the cache the device holds, create one otherwise.
    LoadOrCreate,
}

/// Give up a cache just loaded: stop it keeping its dirty data, so it loads again later.
fn abandon(cache: &Cache) {
    if let Err(e) = cache.stop(false) {
        tracing::warn!(
            "releasing cache {} again failed: {}",
            cache.id(),
            engine_err(e)
        );
    }
}

struct CacheEntry {
    cache: Cache,
    device: String,
    key: Option<DeviceKey>,
    cores: BTreeMap<u16, CoreEntry>,
    /// The configuration file's `ioclass_file` and `ioclass_ignore_unsupported`, kept so that
    /// saving the file keeps them (the classes themselves are in the superblock).
    ioclass: (Option<PathBuf>, Option<bool>),
    /// The configuration file's `lazy_startup`, kept so that saving the file keeps it.
    lazy_startup: Option<bool>,
    /// The write-back mode a `-Q ... -f no` left while dirty data remained: `-L` shows
    /// `wb->wt` until that data has drained.
    left_mode: Option<CacheMode>,
}

#[derive(Default)]
struct State {
    caches: BTreeMap<u16, CacheEntry>,
    /// Caches of the configuration file that are not running (yet).
    waiting: BTreeMap<u16, Waiting>,
    /// Caches taken away by `--script --disconnect-cache`, their exports kept.
    disconnected: BTreeMap<u16, Disconnected>,
}

struct Daemon {
    state: Mutex<State>,
    /// The NBD server's exports (block traces observe them there).
    registry: ExportRegistry,
    frontends: Frontends,
    /// Front-ends the configuration file names for its cores, by export name: a core of a
    /// loaded cache gets its export from here when no front-end remembers serving it.
    preferred: Mutex<BTreeMap<String, String>>,
    /// The front-end each export had, across restarts of the daemon.
    kinds: crate::frontend::KindMemory,
    /// The state directory's run-time setup (state.rs); None for a daemon without `--config`,
    /// which starts with no cache, as it always did.
    store: Option<crate::state::SetupStore>,
    /// The operator's configuration file as read at start (never written).
    file_cfg: ConfigFile,
    stopping: AtomicBool,
    /// Set while the configuration file is applied: the setup is recorded once at the end,
    /// never half-applied.
    applying: AtomicBool,
    /// Active block traces (`hybridcache trace`).
    traces: crate::trace::Tracers,
    /// This daemon's NBD endpoints: its own exports are refused as devices.
    own: OwnEndpoints,
    /// `stop-daemon` requests wait here for the outcome of the shutdown (clean or not).
    shutdown_outcome: Mutex<Option<bool>>,
    shutdown_done: Condvar,
    shutdown_waiters: AtomicUsize,
    /// Due cleaning without progress for this long is logged as a stall (health.rs).
    stall_warn: Duration,
    /// Set once the configuration file is applied. The control socket accepts connections from
    /// the start so that a client can tell a starting daemon from a socket that is not ours
    /// (`version` is answered at once); every other request waits here, as it waited in the
    /// listen backlog before, while devices that are not lazy are waited for and caches load.
    started: Mutex<bool>,
    started_cv: Condvar,
}

type Reply = std::result::Result<Value, String>;

/// What an interrupted flush did, from the engine's count of the lines it cleaned and the dirty
/// lines left now: "flush of cache 1 interrupted: cleaned 1,234 of 3,000 dirty lines (4.8 MiB of
/// 11.7 MiB); 1,766 stay dirty". Nothing is lost, so it is logged at INFO.
fn interrupted_flush_text(
    handle: &Cache,
    cache: u16,
    core: Option<u16>,
    cleaned: u64,
    total: u64,
) -> String {
    let line = handle.line_size().bytes() as u64;
    let dirty_now = match core {
        Some(j) => handle.core_stats(j).map(|s| s.usage.dirty_lines),
        None => Ok(handle.stats().usage.dirty_lines),
    };
    let what = match core {
        Some(j) => format!("cache {cache} core {j}"),
        None => format!("cache {cache}"),
    };
    let left = match dirty_now {
        Ok(n) => format!("; {} stay dirty", crate::safety::count_text(n)),
        // The core went away meanwhile; its lines are no longer this cache's to count.
        Err(_) => String::new(),
    };
    let text = format!(
        "flush of {what} interrupted: cleaned {} of {} dirty lines ({} of {}){left}",
        crate::safety::count_text(cleaned),
        crate::safety::count_text(total),
        crate::trace::size_text(cleaned * line),
        crate::trace::size_text(total * line),
    );
    tracing::info!("{text}");
    text
}

fn engine_err(e: EngineError) -> String {
    match e {
        EngineError::Volume(v) => crate::devices::volume_error_text(&v),
        other => other.to_string(),
    }
}

impl State {
    fn cache(&self, id: u16) -> std::result::Result<&CacheEntry, String> {
        self.caches
            .get(&id)
            .ok_or_else(|| match self.disconnected.get(&id) {
                Some(d) => disconnect::not_connected_text(id, d),
                None => format!("cache {id} does not exist"),
            })
    }

    /// Whether a cache id is taken: by a running, a waiting or a disconnected cache.
    fn id_taken(&self, id: u16) -> bool {
        self.caches.contains_key(&id)
            || self.waiting.contains_key(&id)
            || self.disconnected.contains_key(&id)
    }

    fn core(&self, cache: u16, core: u16) -> std::result::Result<&CoreEntry, String> {
        self.cache(cache)?
            .cores
            .get(&core)
            .ok_or_else(|| format!("core {core} does not exist in cache {cache}"))
    }

    /// A core that is attached; an inactive one is refused with how to bring it back.
    fn active_core(&self, cache: u16, core: u16) -> std::result::Result<&CoreEntry, String> {
        let entry = self.core(cache, core)?;
        if !entry.active {
            return Err(inactive_text(cache, core, &entry.device));
        }
        Ok(entry)
    }

    /// Who already uses the device with this identity, if anyone.
    fn user_of(&self, key: &DeviceKey) -> Option<String> {
        for (id, c) in &self.caches {
            if c.key.as_ref().is_some_and(|k| k.conflicts(key)) {
                return Some(format!("the cache device of cache {id}"));
            }
            for (core_id, core) in &c.cores {
                if core.key.as_ref().is_some_and(|k| k.conflicts(key)) {
                    return Some(format!("core {core_id} of cache {id}"));
                }
            }
        }
        for (id, d) in &self.disconnected {
            if let Some(user) = d.user_of(*id, key) {
                return Some(user);
            }
        }
        None
    }

    fn check_free(&self, spec: &str) -> std::result::Result<Option<DeviceKey>, String> {
        let key = device_key(spec);
        if let Some(k) = &key {
            if let Some(user) = self.user_of(k) {
                return Err(format!("device {spec} is already in use as {user}"));
            }
        }
        Ok(key)
    }

    fn to_config(&self, daemon: &DaemonSection, default_frontend: &str) -> ConfigFile {
        let mut cfg = ConfigFile {
            daemon: daemon.clone(),
            ..ConfigFile::default()
        };
        for (id, c) in &self.caches {
            let (cache, cores) = cache_config(*id, c, default_frontend);
            cfg.caches.push(cache);
            cfg.cores.extend(cores);
        }
        for (id, d) in &self.disconnected {
            let (cache, cores) = d.config(*id, default_frontend);
            cfg.caches.push(cache);
            cfg.cores.extend(cores);
        }
        // Caches that are not running stay in the file as they were.
        for w in self.waiting.values() {
            cfg.caches.push(w.section.clone());
            cfg.cores.extend(w.cores.iter().cloned());
        }
        cfg.caches.sort_by_key(|c| c.id);
        cfg.cores.sort_by_key(|c| (c.cache, c.id));
        cfg
    }
}

/// The parameter values (`GROUP.FIELD`) a new cache of this mode and line size has, from a
/// scratch cache in RAM; empty if none can be made (then every value counts as set).
fn param_defaults(mode: Option<&str>, line_kib: Option<u32>) -> BTreeMap<String, String> {
    let scratch = (|| -> Option<Cache> {
        let mode: CacheMode = mode.unwrap_or("wt").parse().ok()?;
        let line_size = LineSize::from_kib(line_kib.unwrap_or(4)).ok()?;
        let volume =
            hybridcache_volume::open_volume(&format!("ram:{}", 64 * line_size.bytes() as u64))
                .ok()?;
        Cache::new(
            volume,
            CacheConfig {
                id: 1,
                line_size,
                mode,
            },
        )
        .ok()
    })();
    let Some(scratch) = scratch else {
        return BTreeMap::new();
    };
    let mut out = BTreeMap::new();
    for g in params::GROUPS
        .iter()
        .filter(|g| g.in_config && g.set.is_some())
    {
        if let Ok(values) = (g.get)(&scratch, None) {
            for (f, v) in g.fields.iter().zip(values) {
                out.insert(format!("{}.{}", g.name, f.key), v);
            }
        }
    }
    // In RAM: nothing to keep.
    let _ = scratch.stop(false);
    out
}

/// A running cache as the configuration file would say it: its parameters as they are now.
fn cache_config(
    id: u16,
    c: &CacheEntry,
    default_frontend: &str,
) -> (CacheSection, Vec<CoreSection>) {
    let mut params = BTreeMap::new();
    for g in params::GROUPS
        .iter()
        .filter(|g| g.in_config && g.set.is_some())
    {
        if let Ok(values) = (g.get)(&c.cache, None) {
            for (f, v) in g.fields.iter().zip(values) {
                params.insert(format!("{}.{}", g.name, f.key), v);
            }
        }
    }
    let cache = CacheSection {
        id,
        device: c.device.clone(),
        line_size: Some(c.cache.line_size().kib()),
        mode: Some(c.cache.mode().to_string()),
        params,
        ioclass_file: c.ioclass.0.clone(),
        ioclass_ignore_unsupported: c.ioclass.1,
        lazy_startup: c.lazy_startup,
    };
    let cores = c
        .cores
        .iter()
        .map(|(core_id, core)| CoreSection {
            cache: id,
            id: *core_id,
            device: core.device.clone(),
            frontend: (core.frontend != "nbd" || default_frontend != "nbd")
                .then(|| core.frontend.to_string()),
            lazy_startup: core.lazy_startup,
        })
        .collect();
    (cache, cores)
}

fn cache_info(id: u16, c: &CacheEntry, frontends: &Frontends) -> CacheInfo {
    let sizes: BTreeMap<u16, u64> = c.cache.cores().iter().map(|i| (i.id, i.size)).collect();
    // As Open CAS: a cache with a core missing is "Incomplete".
    let mut status = if c.cores.values().all(|core| core.active) {
        "Running".to_string()
    } else {
        "Incomplete".to_string()
    };
    let flush = c.cache.flush_status().map(|f| {
        let elapsed = f.elapsed.as_secs_f64();
        let line = c.cache.line_size().bytes() as f64;
        let rate = if elapsed > 0.0 {
            f.done_lines as f64 * line / elapsed
        } else {
            0.0
        };
        let left = f.total_lines.saturating_sub(f.done_lines) as f64 * line;
        protocol::FlushInfo {
            percent: (f.percent() * 10.0).round() / 10.0,
            total_lines: f.total_lines,
            done_lines: f.done_lines,
            cleaned_lines: f.cleaned_lines,
            done_bytes: f.done_lines * line as u64,
            total_bytes: f.total_lines * line as u64,
            elapsed_s: elapsed,
            bytes_per_s: rate,
            eta_s: (rate > 0.0).then(|| left / rate),
            mode_change: f.mode_change.map(|(a, b)| format!("{a}->{b}")),
        }
    });
    let mut mode = c.cache.mode().to_string();
    if let Some(from) = c.left_mode {
        // Dirty data left by a switch without flush drains: as casadm, "wb->wt".
        if c.cache.dirty_for(None).is_some() {
            mode = format!("{from}->{mode}");
        }
    }
    if let Some(f) = &flush {
        // As casadm: "Flushing" with how far, and the mode switch in progress.
        status = format!("Flushing ({:.1} %)", f.percent);
        if let Some(change) = &f.mode_change {
            mode = change.clone();
        }
    }
    CacheInfo {
        id,
        device: c.device.clone(),
        status,
        flush,
        dirty_for_s: c.cache.dirty_for(None).map(|d| d.as_secs()),
        mode,
        line_size_kib: c.cache.line_size().kib(),
        lines: c.cache.line_count(),
        cleaning: c.cache.cleaning().policy_name(),
        promotion: c.cache.promotion().policy.to_string(),
        lazy_flush: hybridcache_engine::policy::on_off(c.cache.lazy_flush().enabled).into(),
        prefetch: c.cache.prefetch().policy.to_string(),
        inactive_cores: c.cores.values().filter(|core| !core.active).count(),
        metadata_bytes: c.cache.metadata_bytes(),
        cores: c
            .cores
            .iter()
            .map(|(core_id, core)| {
                let mut info =
                    core_info(id, *core_id, core, sizes.get(core_id).copied(), frontends);
                info.dirty_for_s = c.cache.dirty_for(Some(*core_id)).map(|d| d.as_secs());
                if let Ok(seq) = c.cache.seq_cutoff(*core_id) {
                    info.seq_cutoff_threshold_kib = Some(seq.threshold_kib);
                    info.seq_cutoff_policy = Some(seq.policy.to_string());
                }
                info
            })
            .collect(),
    }
}

fn core_info(
    cache: u16,
    id: u16,
    core: &CoreEntry,
    size: Option<u64>,
    frontends: &Frontends,
) -> CoreInfo {
    let name = export_name(cache, id);
    let frontend = frontends.get(Some(core.frontend)).ok();
    CoreInfo {
        clients: frontend.and_then(|f| f.clients(&name)).unwrap_or(0),
        id,
        device: core.device.clone(),
        size: size.unwrap_or(0),
        status: core_status(core),
        block_device: frontend.and_then(|f| f.device(&name)),
        frontend: core.frontend.to_string(),
        export: name,
        dirty_for_s: None,
        seq_cutoff_threshold_kib: None,
        seq_cutoff_policy: None,
    }
}

/// Attempts of a flush that failed while a remote core was reconnecting: each after the
/// reconnection, so a server restarted while nothing was sent to it costs no failed flush.
const FLUSH_ATTEMPTS: u32 = 3;
/// How long a flush waits for a remote core's reconnection before it tries again: the
/// reconnection's backoff reaches its 3 s cap within this.
const RECONNECT_WAIT: Duration = Duration::from_secs(10);

/// Run `flush` (of a cache or a core) and, when it fails while one of the `remote` cores it
/// covers is reconnecting (a dead connection found by the flush itself), wait for the
/// reconnection and run it again: the lines it could not clean are still dirty and are
/// cleaned again; lines are recorded clean only after a core flush that covers them.
/// Requests sent while the volume is detached fail at once, so one breakage may fail several
/// of the attempt's writes although the volume reconnected within it.
fn flush_retrying(
    remote: &[String],
    mut flush: impl FnMut() -> std::result::Result<(), EngineError>,
) -> std::result::Result<(), EngineError> {
    let mut attempt = 1;
    loop {
        let before: Vec<Option<u64>> = remote
            .iter()
            .map(|uri| crate::nbd_volume::breakages(uri))
            .collect();
        let e = match flush() {
            Ok(()) => return Ok(()),
            Err(e @ EngineError::FlushInterrupted { .. }) => return Err(e),
            Err(e) => e,
        };
        // Down now, or broken and back during the attempt (its other requests then failed).
        let down: Vec<&String> = remote
            .iter()
            .zip(&before)
            .filter(|(uri, before)| {
                crate::nbd_volume::link_status(uri).is_some()
                    || crate::nbd_volume::breakages(uri) != **before
            })
            .map(|(uri, _)| uri)
            .collect();
        if attempt >= FLUSH_ATTEMPTS || down.is_empty() {
            return Err(e);
        }
        if !down
            .iter()
            .all(|uri| crate::nbd_volume::wait_connected(uri, RECONNECT_WAIT))
        {
            return Err(e);
        }
        attempt += 1;
        tracing::warn!(
            "flush failed while a remote core reconnected ({}); flushing again (attempt {attempt} of {FLUSH_ATTEMPTS})",
            engine_err(e)
        );
    }
}

/// What `-L` shows for a core.
fn core_status(core: &CoreEntry) -> String {
    if !core.active {
        return if core.pending {
            WAITING_FOR_DEVICE.into()
        } else {
            "Inactive".into()
        };
    }
    // A remote core's connection state is read from its volume at each call, so `-L` tells
    // the truth at every moment; a core whose device failed says so too.
    crate::nbd_volume::link_status(&core.device).unwrap_or_else(|| "Active".into())
}

/// Why the device at `spec` is not the one `rec` was added as, if it is not: its identity
/// differs from the recorded one, or it has none where one was recorded. Nothing to compare
/// (a record without identity) accepts it, as path and size always did.
fn not_the_recorded_device(rec: &CoreRecord, spec: &str) -> Option<String> {
    let want = rec.identity.as_deref()?;
    match crate::devices::identity(spec) {
        Some(found) if found == want => None,
        found => Some(format!(
            "{spec} is not the device it was added as (recorded: {want}; found: {})",
            found.as_deref().unwrap_or("no identity")
        )),
    }
}

/// `-L`'s entry for a cache that is not running.
fn waiting_info(w: &Waiting) -> CacheInfo {
    CacheInfo {
        id: w.section.id,
        device: w.section.device.clone(),
        status: w.status.clone(),
        mode: w.section.mode.clone().unwrap_or_else(|| "wt".into()),
        line_size_kib: w.section.line_size.unwrap_or(4),
        lines: 0,
        cleaning: String::new(),
        promotion: String::new(),
        lazy_flush: String::new(),
        prefetch: String::new(),
        flush: None,
        dirty_for_s: None,
        inactive_cores: w.cores.len(),
        metadata_bytes: 0,
        cores: w
            .cores
            .iter()
            .map(|c| CoreInfo {
                id: c.id,
                device: c.device.clone(),
                size: 0,
                status: "Inactive".into(),
                export: export_name(c.cache, c.id),
                clients: 0,
                frontend: c.frontend.clone().unwrap_or_default(),
                block_device: None,
                dirty_for_s: None,
                seq_cutoff_threshold_kib: None,
                seq_cutoff_policy: None,
            })
            .collect(),
    }
}

fn inactive_text(cache: u16, core: u16, device: &str) -> String {
    format!(
        "core {core} of cache {cache} is inactive (its device {device} was missing when the cache was loaded); attach it again with add-core -i {cache} -j {core} -d DEVICE"
    )
}

fn export_name(cache: u16, core: u16) -> String {
    format!("cas{cache}-{core}")
}

impl Daemon {
    /// Hold a control request until the configuration file is applied (see `started`).
    fn wait_started(&self) {
        let mut started = self.started.lock();
        while !*started {
            self.started_cv.wait(&mut started);
        }
    }

    fn set_started(&self) {
        *self.started.lock() = true;
        self.started_cv.notify_all();
    }

    fn handle(&self, req: Request) -> Reply {
        if self.stopping.load(Ordering::SeqCst) {
            return Err("the daemon is shutting down".into());
        }
        match req {
            Request::StartCache {
                device,
                id,
                mode,
                line_size_kib,
                force,
                load,
            } => {
                if load && force {
                    return Err("--load and --force contradict each other: --force overwrites the cache that --load would load".into());
                }
                let how = if load {
                    Start::Load
                } else {
                    Start::Create { force }
                };
                self.start_cache(&device, id, mode.as_deref(), line_size_kib, how)
            }
            Request::StopCache {
                id,
                no_data_flush,
                force,
                disconnect_clients,
            } => {
                // -T's old --force only ever overrode the client check (it flushes): it stays
                // an alias of --disconnect-clients for the scripts that use it.
                let given =
                    Consents::none().with(Consent::DisconnectClients, disconnect_clients || force);
                self.stop_cache(id, no_data_flush, &given)
            }
            Request::AddCore {
                cache,
                device,
                core,
                force,
                frontend,
            } => self.add_core(cache, &device, core, force, frontend.as_deref()),
            Request::RemoveCore {
                cache,
                core,
                force,
                disconnect_clients,
                inactive_only,
            } => {
                // casadm's -R -f: remove without flushing.
                let given = Consents::none()
                    .with(Consent::DiscardDirty, force)
                    .with(Consent::DisconnectClients, disconnect_clients);
                self.remove_core(cache, core, &given, inactive_only)
            }
            Request::DisconnectCache {
                id,
                no_flush,
                pass_through,
                detach,
            } => self.disconnect_cache(id, no_flush, pass_through || detach, detach),
            Request::ConnectCache { device, id, force } => self.connect_cache(&device, id, force),
            Request::List => {
                let st = self.state.lock();
                let mut caches: Vec<CacheInfo> = st
                    .caches
                    .iter()
                    .map(|(id, c)| cache_info(*id, c, &self.frontends))
                    .collect();
                caches.extend(
                    st.disconnected
                        .iter()
                        .map(|(id, d)| d.info(*id, &self.frontends)),
                );
                caches.extend(st.waiting.values().map(waiting_info));
                caches.sort_by_key(|c| c.id);
                Ok(json!({ "caches": caches }))
            }
            Request::Stats {
                cache,
                core,
                io_class,
            } => self.stats(cache, core, io_class),
            Request::LoadIoClasses {
                cache,
                csv,
                ignore_unsupported,
            } => {
                let handle = self.checked(cache, None)?;
                let opts = hybridcache_engine::ioclass::LoadOptions { ignore_unsupported };
                let classes =
                    hybridcache_engine::ioclass::IoClasses::parse(&csv, &opts).map_err(|e| {
                        format!("IO class file refused, nothing changed: {e}").replace(
                            "load with ignore_unsupported",
                            "load with --ignore-unsupported",
                        )
                    })?;
                handle.load_io_classes(classes).map_err(engine_err)?;
                Ok(json!({}))
            }
            Request::ListIoClasses { cache } => {
                let handle = self.checked(cache, None)?;
                let classes = handle.io_classes().iter().map(io_class_info).collect();
                serde_json::to_value(protocol::IoClassList { classes }).map_err(|e| e.to_string())
            }
            Request::ResetCounters { cache, core } => {
                let st = self.state.lock();
                let c = st.cache(cache)?;
                match core {
                    Some(core) => {
                        st.active_core(cache, core)?;
                        c.cache.reset_core_stats(core).map_err(engine_err)?;
                    }
                    None => c.cache.reset_stats(),
                }
                Ok(json!({}))
            }
            Request::SetCacheMode { cache, mode, flush } => {
                let mode: CacheMode = mode.parse()?;
                let handle = self.state.lock().cache(cache)?.cache.clone();
                let lazy = |m: CacheMode| matches!(m, CacheMode::Wb | CacheMode::Wo);
                let from = handle.mode();
                let flush = match flush {
                    Some(f) => f,
                    // As casadm: leaving write-back or write-only, the operator chooses.
                    None if lazy(from) && !lazy(mode) => {
                        return Err(format!(
                            "cache {cache} leaves {from} for {mode}: say whether to flush its dirty data first with --flush-cache (-f) yes or no"
                        ))
                    }
                    None => false,
                };
                handle.set_mode(mode, flush).map_err(engine_err)?;
                if let Some(c) = self.state.lock().caches.get_mut(&cache) {
                    c.left_mode = (lazy(from) && !lazy(mode) && !flush).then_some(from);
                }
                self.save();
                Ok(json!({}))
            }
            Request::ZeroMetadata { device, force } => self.zero_metadata(&device, force),
            Request::InterruptFlush { cache } => {
                let handle = self.state.lock().cache(cache)?.cache.clone();
                if !handle.interrupt_flush() {
                    return Err(format!("cache {cache} is not flushing"));
                }
                tracing::info!("cache {cache}: flush interrupted on request");
                Ok(json!({}))
            }
            Request::Flush { cache, core } => {
                let handle = {
                    let st = self.state.lock();
                    let c = st.cache(cache)?;
                    if let Some(core) = core {
                        st.active_core(cache, core)?;
                    }
                    c.cache.clone()
                };
                let remote = self.remote_cores(cache, core);
                let flushed = flush_retrying(&remote, || match core {
                    Some(core) => handle.flush_core(core),
                    None => handle.flush(),
                });
                match flushed {
                    Err(EngineError::FlushInterrupted {
                        cleaned_lines,
                        total_lines,
                    }) => Err(interrupted_flush_text(
                        &handle,
                        cache,
                        core,
                        cleaned_lines,
                        total_lines,
                    )),
                    other => other.map(|()| json!({})).map_err(engine_err),
                }
            }
            Request::SetParam {
                cache,
                core,
                name,
                value,
                mut values,
            } => {
                let g = params::find(&name)?;
                let set = g
                    .set
                    .ok_or_else(|| format!("parameter '{name}' is read-only"))?;
                if !value.is_empty() {
                    values.insert(g.fields[0].key.to_string(), value);
                }
                if values.is_empty() {
                    return Err(format!(
                        "nothing to set for '{name}': give {}",
                        g.fields
                            .iter()
                            .map(|f| format!("{} ({})", f.flag, f.key))
                            .collect::<Vec<_>>()
                            .join(", ")
                    ));
                }
                if core.is_some() && !g.per_core {
                    return Err(format!("parameter '{name}' is per cache; drop -j"));
                }
                let handle = self.checked(cache, core)?;
                set(&handle, core, &values)?;
                self.save();
                Ok(json!({}))
            }
            Request::GetParam { cache, core, name } => {
                let g = params::find(&name)?;
                let handle = self.checked(cache, core)?;
                let fields =
                    |core: Option<u16>| -> std::result::Result<Vec<protocol::ParamField>, String> {
                        Ok((g.get)(&handle, core)?
                            .into_iter()
                            .zip(g.fields)
                            .map(|(value, f)| protocol::ParamField {
                                key: f.key.into(),
                                label: f.label.into(),
                                value,
                            })
                            .collect())
                    };
                let (fields, cores) = if g.per_core && core.is_none() {
                    let mut cores = Vec::new();
                    for info in handle.cores() {
                        cores.push(protocol::CoreParams {
                            core: info.id,
                            fields: fields(Some(info.id))?,
                        });
                    }
                    (Vec::new(), cores)
                } else {
                    (fields(core)?, Vec::new())
                };
                let first = fields
                    .first()
                    .or_else(|| cores.first().and_then(|c| c.fields.first()))
                    .map(|f| f.value.clone())
                    .unwrap_or_default();
                Ok(serde_json::to_value(protocol::ParamValue {
                    name: g.name.into(),
                    value: first,
                    read_only: g.set.is_none(),
                    fields,
                    cores,
                })
                .map_err(|e| e.to_string())?)
            }
            Request::Version => Ok(json!({ "version": env!("CARGO_PKG_VERSION") })),
            Request::Shutdown => {
                let caches = self.state.lock().caches.len();
                tracing::info!("stop-daemon requested on the control socket");
                self.shutdown_waiters.fetch_add(1, Ordering::SeqCst);
                // The main thread's sigwait takes it from here, as for an operator's SIGTERM;
                // the reply waits for the outcome, so the caller knows whether every cache
                // was flushed.
                // SAFETY: kill(2) on our own pid with a valid signal number.
                unsafe { libc::kill(libc::getpid(), libc::SIGTERM) };
                let mut outcome = self.shutdown_outcome.lock();
                while outcome.is_none() {
                    self.shutdown_done.wait(&mut outcome);
                }
                let clean = outcome.unwrap_or(false);
                drop(outcome);
                Ok(json!({ "clean": clean, "caches": caches }))
            }
            Request::TraceStart {
                cache,
                core,
                file,
                max_size,
            } => self.trace_start(cache, core, &file, max_size),
            Request::TraceStop { cache, core } => self.traces.stop(&self.registry, cache, core),
            Request::TraceStatus => self.traces.status(),
            Request::ExportConfig => self.export_config(),
        }
    }

    /// `trace start`: the cores to trace are checked and the trace attached under the state
    /// lock, so no core can be removed in between.
    fn trace_start(&self, cache: u16, core: Option<u16>, file: &str, max: Option<u64>) -> Reply {
        let st = self.state.lock();
        let c = st.cache(cache)?;
        let cores: Vec<(u16, String)> = match core {
            Some(j) => {
                st.active_core(cache, j)?;
                vec![(j, export_name(cache, j))]
            }
            None => c
                .cores
                .iter()
                .filter(|(_, e)| e.active)
                .map(|(j, _)| (*j, export_name(cache, *j)))
                .collect(),
        };
        self.traces
            .start(&self.registry, cache, core, &cores, Path::new(file), max)
    }

    /// The remote (NBD) cores a flush of `cache` (or of its core `core`) covers, by URI.
    fn remote_cores(&self, cache: u16, core: Option<u16>) -> Vec<String> {
        let st = self.state.lock();
        st.caches.get(&cache).map_or_else(Vec::new, |c| {
            c.cores
                .iter()
                .filter(|(id, e)| core.map_or(true, |j| j == **id) && is_nbd_uri(&e.device))
                .map(|(_, e)| e.device.clone())
                .collect()
        })
    }

    /// A handle to cache `cache` after checking that `core` (if given) exists in it.
    fn checked(&self, cache: u16, core: Option<u16>) -> std::result::Result<Cache, String> {
        let st = self.state.lock();
        let c = st.cache(cache)?;
        if let Some(core) = core {
            st.core(cache, core)?;
        }
        Ok(c.cache.clone())
    }

    fn start_cache(
        &self,
        device: &str,
        id: Option<u16>,
        mode: Option<&str>,
        line_kib: Option<u32>,
        how: Start,
    ) -> Reply {
        let mut st = self.state.lock();
        // The device watcher calls this outside `handle`: once shutdown holds the lock no cache
        // may start, or it would escape the shutdown's flush.
        if self.stopping.load(Ordering::SeqCst) {
            return Err("the daemon is shutting down".into());
        }
        if let Some(id) = id {
            if id == 0 || id > MAX_CACHE_ID {
                return Err(format!(
                    "cache id {id} is out of range (1..={MAX_CACHE_ID})"
                ));
            }
            if st.caches.contains_key(&id) {
                return Err(format!("cache {id} already exists"));
            }
            if st.disconnected.contains_key(&id) {
                return Err(format!(
                    "cache {id} is disconnected, its exports kept; connect it with --script --connect-cache or stop it with -T -i {id}"
                ));
            }
            if let Some(w) = st.waiting.get(&id) {
                return Err(format!(
                    "cache {id} of the configuration is not running ({}: {}); stop it with -T -i {id} to drop it first",
                    w.status, w.section.device
                ));
            }
        }
        // ram: and null: devices start empty every time: their metadata stays in RAM.
        let volatile = device.starts_with("ram:") || device.starts_with("null:");
        if how == Start::Load {
            if mode.is_some() || line_kib.is_some() {
                return Err("--load takes the cache mode and line size recorded on the device; omit -c and -x (switch the mode afterwards with set-cache-mode)".into());
            }
            if volatile {
                return Err(format!(
                    "{device} cannot hold a cache to load: ram: and null: devices start empty"
                ));
            }
            let key = st.check_free(device)?;
            let volume = self.open_claimed(device, false)?;
            let loaded = self.load_locked(&mut st, device, key, id, volume);
            if let Err(e) = &loaded {
                self.abandon_exports(device, e);
            }
            return loaded;
        }
        let mode: CacheMode = mode.unwrap_or("wt").parse()?;
        let line_size = LineSize::from_kib(line_kib.unwrap_or(4))?;
        let id = match id {
            Some(id) => id,
            None => (1..=MAX_CACHE_ID)
                .find(|i| !st.id_taken(*i))
                .ok_or("every cache id is in use")?,
        };
        let key = st.check_free(device)?;
        let volume = self.open_claimed(device, false)?;
        let what = format!("starting a cache on {device}");
        let accepted = match how {
            Start::Create { force } if !volatile => {
                let given = Consents::none().with(Consent::Overwrite, force);
                safety::decide(&what, device_losses(device, &*volume)?, &given)?
            }
            Start::LoadOrCreate if !volatile => {
                check_signatures(device, &*volume, how)?;
                Vec::new()
            }
            _ => Vec::new(),
        };
        let config = CacheConfig {
            id,
            line_size,
            mode,
        };
        let created = if volatile {
            Cache::new(volume, config)
        } else {
            let force = matches!(how, Start::Create { force: true });
            match Cache::create(volume.clone(), config, force) {
                Err(EngineError::ExistingCache { .. }) if how == Start::LoadOrCreate => {
                    return self.load_locked(&mut st, device, key, Some(id), volume);
                }
                other => other,
            }
        };
        let cache = created.map_err(|e| format!("{device}: {}", engine_err(e)))?;
        let persistent = cache.persistent();
        st.caches.insert(
            id,
            CacheEntry {
                cache,
                device: device.to_string(),
                key,
                cores: BTreeMap::new(),
                ioclass: (None, None),
                lazy_startup: None,
                left_mode: None,
            },
        );
        self.save_locked(&st);
        tracing::info!(
            "started {} cache {id} on {device} ({mode}, {} KiB lines)",
            if persistent { "persistent" } else { "volatile" },
            line_size.kib()
        );
        let mut started = serde_json::to_value(protocol::Started {
            id,
            loaded: false,
            inactive: Vec::new(),
            why_inactive: Default::default(),
        })
        .map_err(|e| e.to_string())?;
        started["losses"] = safety::record(&what, &accepted);
        Ok(started)
    }

    /// Load the cache `volume` holds (the device named `device`, not in use elsewhere), reopen
    /// its cores from their recorded devices (missing ones stay inactive) and export them.
    fn load_locked(
        &self,
        st: &mut State,
        device: &str,
        key: Option<DeviceKey>,
        want_id: Option<u16>,
        volume: VolumeRef,
    ) -> Reply {
        let mut notes = Vec::new();
        let mut in_use: Option<String> = None;
        let loaded = {
            let st: &State = st;
            let mut open_core = |rec: &CoreRecord| -> Option<VolumeRef> {
                if let Some(user) = device_key(&rec.path).and_then(|k| st.user_of(&k)) {
                    in_use.get_or_insert(format!(
                        "core {} of the cache on {device} ({}) is already in use as {user}",
                        rec.id, rec.path
                    ));
                    return None;
                }
                match self.open_claimed(&rec.path, false) {
                    Ok(v) => match not_the_recorded_device(rec, &rec.path) {
                        None => Some(v),
                        Some(why) => {
                            notes.push((rec.id, why));
                            None
                        }
                    },
                    Err(e) => {
                        notes.push((rec.id, format!("its device cannot be opened ({e})")));
                        None
                    }
                }
            };
            Cache::load(volume, &mut open_core)
        };
        let cache =
            loaded.map_err(|e| format!("cannot load the cache on {device}: {}", engine_err(e)))?;
        let id = cache.id();
        let problem = if let Some(p) = in_use {
            Some(p)
        } else if want_id.is_some_and(|w| w != id) {
            Some(format!(
                "{device} holds cache {id}, not cache {}",
                want_id.unwrap_or(0)
            ))
        } else if st.caches.contains_key(&id) {
            Some(format!(
                "{device} holds cache {id}, but cache {id} already exists; stop it first"
            ))
        } else if st.disconnected.contains_key(&id) {
            Some(format!(
                "{device} holds cache {id}, which is disconnected; bring it back with --script --connect-cache -d {device}"
            ))
        } else {
            None
        };
        if let Some(p) = problem {
            abandon(&cache);
            return Err(p);
        }
        let line = cache.line_size().bytes();
        let mut cores = BTreeMap::new();
        let mut exported: Vec<(String, &Arc<dyn Frontend>)> = Vec::new();
        let mut inactive = Vec::new();
        for info in cache.cores() {
            let active = info.status == CoreStatus::Active;
            let name = export_name(id, info.id);
            let frontend = self.frontend_at_load(&name, device);
            let mut target = None;
            if active {
                let description = format!("core {} ({}) of cache {id}", info.id, info.name);
                let added = cache.core(info.id).map_err(engine_err).and_then(|core| {
                    let t = Target::new(core);
                    target = Some(t.clone());
                    frontend.start(ExportSpec {
                        name: name.clone(),
                        description,
                        core: t,
                        line_size: line,
                        cache_device: device.to_string(),
                    })
                });
                if let Err(e) = added {
                    for (n, f) in &exported {
                        f.stop(n);
                    }
                    abandon(&cache);
                    return Err(format!("cannot export {name}: {e}"));
                }
                self.kinds.set(&name, device, frontend.kind());
                exported.push((name, frontend));
            } else {
                inactive.push(info.id);
            }
            cores.insert(
                info.id,
                CoreEntry {
                    key: if active { device_key(&info.name) } else { None },
                    device: info.name,
                    active,
                    pending: false,
                    frontend: frontend.kind(),
                    target,
                    lazy_startup: None,
                },
            );
        }
        let mode = cache.mode();
        let line_kib = cache.line_size().kib();
        let count = cores.len();
        st.caches.insert(
            id,
            CacheEntry {
                cache,
                device: device.to_string(),
                key,
                cores,
                ioclass: (None, None),
                lazy_startup: None,
                left_mode: None,
            },
        );
        self.save_locked(st);
        tracing::info!(
            "loaded cache {id} from {device} ({mode}, {line_kib} KiB lines, {count} cores, {} inactive)",
            inactive.len()
        );
        for (core, why) in &notes {
            tracing::info!("cache {id}: core {core} is inactive: {why}");
        }
        serde_json::to_value(protocol::Started {
            id,
            loaded: true,
            inactive,
            why_inactive: notes.into_iter().collect(),
        })
        .map_err(|e| e.to_string())
    }

    /// `-T`: connected clients are the only loss (dirty data is flushed, or with `-n` kept on
    /// the cache device for the next load), so `--disconnect-clients` is the only consent.
    fn stop_cache(&self, id: u16, no_data_flush: bool, given: &Consents) -> Reply {
        let mut st = self.state.lock();
        if let Some(w) = st.waiting.remove(&id) {
            // Not running: nothing to flush; the operator drops it from the setup.
            self.save_locked(&st);
            tracing::info!(
                "cache {id} ({}, {}) dropped from the setup",
                w.section.device,
                w.status
            );
            return Ok(json!({}));
        }
        if st.disconnected.contains_key(&id) {
            return self.stop_disconnected(&mut st, id, given);
        }
        let entry = st.cache(id)?;
        let what = format!("stopping cache {id}");
        let names: Vec<(String, &'static str)> = entry
            .cores
            .iter()
            .map(|(c, e)| (export_name(id, *c), e.frontend))
            .collect();
        let clients = self.clients_of(&names, !given.gives(Consent::DisconnectClients));
        let accepted = safety::decide(&what, clients, given)?;
        let cache = entry.cache.clone();
        let device = entry.device.clone();
        if no_data_flush && !cache.persistent() && cache.stats().usage.dirty_lines != 0 {
            return Err(format!(
                "cache {id} on {device} keeps its metadata in RAM only, so its dirty data cannot outlive a stop; stop it without --no-data-flush"
            ));
        }
        // Its traces end here, before the exports go (trace.rs); they stay listed.
        self.traces.cache_stopped(&self.registry, id);
        // New connections must not reach a cache that is going away; established ones get
        // errors once the engine stops it.
        let removed: Vec<_> = entry
            .cores
            .iter()
            .filter(|(_, c)| c.active)
            .filter_map(|(c, e)| {
                let name = export_name(id, *c);
                let frontend = self.frontends.get(Some(e.frontend)).ok()?;
                frontend.stop(&name).then_some((
                    *c,
                    e.device.clone(),
                    name,
                    frontend,
                    e.target.clone(),
                ))
            })
            .collect();
        if !no_data_flush {
            // Flush first while the cache still serves: a failure here changes nothing.
            let remote: Vec<String> = entry
                .cores
                .values()
                .filter(|e| is_nbd_uri(&e.device))
                .map(|e| e.device.clone())
                .collect();
            if let Err(e) = flush_retrying(&remote, || cache.flush()) {
                let line = cache.line_size().bytes();
                for (core_id, core_device, name, frontend, target) in &removed {
                    // The entry's own target goes back, so a later disconnect finds it.
                    let target = match target {
                        Some(t) => Ok(t.clone()),
                        None => cache.core(*core_id).map(Target::new).map_err(engine_err),
                    };
                    let back = target.and_then(|core| {
                        frontend.start(ExportSpec {
                            name: name.clone(),
                            description: format!("core {core_id} ({core_device}) of cache {id}"),
                            core,
                            line_size: line,
                            cache_device: device.clone(),
                        })
                    });
                    if let Err(e) = back {
                        tracing::error!("cache {id}: {name} cannot be served again: {e}");
                    }
                }
                return Err(format!(
                    "cache {id} was not stopped: flushing failed: {}",
                    engine_err(e)
                ));
            }
        }
        let stopped = cache.stop(!no_data_flush);
        // From here on the engine refuses requests: the cache is gone either way.
        self.note_stop(&st, id);
        st.caches.remove(&id);
        self.save_locked(&st);
        let losses = safety::record(&what, &accepted);
        match stopped {
            Ok(()) => {
                let dirty = cache.stats().usage.dirty_lines;
                tracing::info!(
                    "stopped cache {id}{}",
                    if dirty > 0 {
                        format!(" ({dirty} dirty lines kept on {device})")
                    } else {
                        String::new()
                    }
                );
                Ok(json!({ "losses": losses }))
            }
            Err(e) => {
                let e = engine_err(e);
                tracing::error!("cache {id}: stopping failed: {e}");
                if !no_data_flush && cache.persistent() && cache.stop(false).is_ok() {
                    Err(format!("cache {id} was stopped without flushing all dirty data ({e}); the dirty data is kept on {device}: load it with start-cache --load"))
                } else if cache.persistent() {
                    Err(format!("cache {id} was stopped, but writing its metadata failed ({e}); the next start-cache --load recovers it as after a crash"))
                } else {
                    Err(format!("cache {id} was stopped with an error: {e}"))
                }
            }
        }
    }

    fn add_core(
        &self,
        cache_id: u16,
        device: &str,
        core: Option<u16>,
        force: bool,
        frontend: Option<&str>,
    ) -> Reply {
        let mut st = self.state.lock();
        if self.stopping.load(Ordering::SeqCst) {
            return Err("the daemon is shutting down".into());
        }
        if let Some(w) = st.waiting.get(&cache_id) {
            return Err(format!(
                "cache {cache_id} is not running ({}: {})",
                w.status, w.section.device
            ));
        }
        let c = st.cache(cache_id)?;
        // An inactive core comes back by its id, or by the device it was recorded with. A
        // pending core (never added: its device was missing at start) is added with its id.
        let inactive = |e: &CoreEntry| !e.active && !e.pending;
        let reattach = match core {
            Some(j) => match c.cores.get(&j) {
                Some(e) if inactive(e) => Some(j),
                Some(e) if e.pending => None,
                Some(_) => return Err(format!("core {j} already exists in cache {cache_id}")),
                None => None,
            },
            None => c
                .cores
                .iter()
                .find(|(_, e)| inactive(e) && e.device == device)
                .map(|(j, _)| *j),
        };
        // A core attached again (or one waiting for its device) keeps the front-end it had
        // unless one is named.
        let known = reattach.or(core).and_then(|j| c.cores.get(&j));
        let frontend = match (frontend, known) {
            (None, Some(e)) => self.frontends.get(Some(e.frontend))?,
            (kind, _) => self.frontends.get(kind)?,
        };
        let key = st.check_free(device)?;
        let volume = self.open_claimed(device, force)?;
        // A mounted block device taken with --force (claims.rs): the operator's call, said as
        // the loss it risks.
        let accepted: Vec<Loss> = if force {
            mounted_block(device)
                .map(|mounts| Loss::Mounted {
                    device: device.to_string(),
                    mounts,
                })
                .into_iter()
                .collect()
        } else {
            Vec::new()
        };
        let c = st.cache(cache_id)?;
        let line = c.cache.line_size().bytes();
        let identity = crate::devices::identity(device);
        let core_id = match reattach {
            Some(j) => {
                if let Some(why) = c
                    .cache
                    .core_record(j)
                    .and_then(|rec| not_the_recorded_device(&rec, device))
                {
                    if !force {
                        return Err(format!(
                            "cache {cache_id}: core {j}: {why}; attach it with --force if it is that core's device"
                        ));
                    }
                    tracing::warn!("cache {cache_id}: core {j}: {why}; attached as forced");
                }
                c.cache
                    .attach_identified_core(j, volume, identity)
                    .map_err(|e| format!("cache {cache_id}: {}", engine_err(e)))?;
                j
            }
            None => c
                .cache
                .add_identified_core(volume, core, identity)
                .map_err(engine_err)?,
        };
        let name = export_name(cache_id, core_id);
        let description = format!("core {core_id} ({device}) of cache {cache_id}");
        let mut target = None;
        let exported = c.cache.core(core_id).map_err(engine_err).and_then(|core| {
            let t = Target::new(core);
            target = Some(t.clone());
            frontend
                .start(ExportSpec {
                    name: name.clone(),
                    description,
                    core: t,
                    line_size: line,
                    cache_device: c.device.clone(),
                })
                .map_err(|e| format!("cannot export {name}: {e}"))
        });
        if let Err(e) = &exported {
            if reattach.is_none() {
                // Undo, so a failure changes nothing.
                let _ = c.cache.remove_core(core_id, true);
                return Err(e.clone());
            }
            // An attached core cannot be detached again without losing its dirty data: keep
            // it attached (flush or remove it to get rid of it) and say what failed.
            tracing::warn!("cache {cache_id}: core {core_id} attached but {e}");
        }
        if let Some(c) = st.caches.get_mut(&cache_id) {
            // An inactive core attached again keeps what the file said of it.
            let lazy_startup = c.cores.get(&core_id).and_then(|e| e.lazy_startup);
            c.cores.insert(
                core_id,
                CoreEntry {
                    device: device.to_string(),
                    key,
                    active: true,
                    pending: false,
                    frontend: frontend.kind(),
                    target,
                    lazy_startup,
                },
            );
        }
        self.save_locked(&st);
        exported?;
        if let Some(c) = st.caches.get(&cache_id) {
            self.kinds.set(&name, &c.device, frontend.kind());
        }
        tracing::info!(
            "cache {cache_id}: {} core {core_id} ({device}) as {name}{}",
            if reattach.is_some() {
                "attached again"
            } else {
                "added"
            },
            frontend
                .device(&name)
                .map(|d| format!(" on {d}"))
                .unwrap_or_default()
        );
        let mut added = serde_json::to_value(protocol::CoreAdded {
            cache: cache_id,
            core: core_id,
            block_device: frontend.device(&name),
            export: name,
            reattached: reattach.is_some(),
        })
        .map_err(|e| e.to_string())?;
        added["losses"] = safety::record(
            &format!("adding core {core_id} to cache {cache_id}"),
            &accepted,
        );
        Ok(added)
    }

    /// `--zero-metadata`: under the state lock, so no cache can start on the device meanwhile.
    /// As casadm, a cache with dirty data is refused unless forced; so is a device without
    /// hybridcache metadata (its content is unknown) and one whose metadata cannot be read.
    fn zero_metadata(&self, device: &str, force: bool) -> Reply {
        let st = self.state.lock();
        if let Some((id, _)) = st.caches.iter().find(|(_, c)| c.device == device) {
            return Err(format!(
                "{device} is the device of running cache {id}; stop it first"
            ));
        }
        // The exclusive claim refuses a device another cache, a mount or a program holds.
        let volume = self.open_claimed(device, false)?;
        let given = Consents::none().with(Consent::Overwrite, force);
        let what = format!("zeroing the metadata of {device}");
        let losses = match hybridcache_engine::read_summary(&*volume) {
            Ok(Some(summary)) if summary.total_dirty_lines() > 0 => vec![Loss::CacheMetadata {
                device: device.to_string(),
                cache: summary.superblock.cache_id,
                cores: cores_text(&summary.superblock),
                dirty_lines: summary.total_dirty_lines(),
                dirty_bytes: summary.dirty_bytes(),
            }],
            // A clean cache's data is all on its cores: only the cache goes.
            Ok(Some(_)) => Vec::new(),
            Ok(None) if hybridcache_engine::holds_metadata(&*volume).map_err(engine_err)? => {
                Vec::new()
            }
            Ok(None) => vec![Loss::DeviceContent {
                device: device.to_string(),
                bytes: ZEROED_BYTES.min(volume.size()),
            }],
            Err(e) if !force => {
                return Err(format!(
                    "zeroing the metadata of {device} refused, nothing was changed: its metadata cannot be read ({}), so whether it holds dirty data is unknown: load it with start-cache --load to see, or give --force to zero it anyway",
                    engine_err(e)
                ))
            }
            Err(e) => {
                tracing::warn!(
                    "{device}: metadata unreadable ({}); zeroed as forced",
                    engine_err(e)
                );
                Vec::new()
            }
        };
        let accepted = safety::decide(&what, losses, &given)?;
        hybridcache_engine::zero_metadata(&*volume).map_err(engine_err)?;
        drop(st);
        tracing::info!("{device}: hybridcache metadata zeroed");
        Ok(json!({ "losses": safety::record(&what, &accepted) }))
    }

    /// `-R` / `--remove-inactive`. An active core's dirty data goes to it first unless
    /// `--force` (casadm's "without flush") discards it; an inactive core's cannot be flushed,
    /// so removing it with dirty data needs `--force` too. Connected clients need
    /// `--disconnect-clients`, whatever else is given.
    fn remove_core(
        &self,
        cache_id: u16,
        core: u16,
        given: &Consents,
        inactive_only: bool,
    ) -> Reply {
        let what = format!("removing core {core} of cache {cache_id}");
        let name = export_name(cache_id, core);
        let discard = given.gives(Consent::DiscardDirty);
        let found = {
            let st = self.state.lock();
            let c = st.cache(cache_id)?;
            match c.cores.get(&core) {
                None => return Err(format!("core {core} does not exist in cache {cache_id}")),
                Some(e) if inactive_only && e.active => {
                    return Err(format!(
                    "core {core} of cache {cache_id} is active; remove it with --remove-core (-R)"
                ))
                }
                Some(e) => (
                    c.cache.clone(),
                    e.frontend,
                    e.active && !e.pending,
                    e.pending,
                ),
            }
        };
        let (handle, kind, active, pending) = found;
        let mut losses = Vec::new();
        if active {
            losses.extend(self.clients_of(
                &[(name.clone(), kind)],
                !given.gives(Consent::DisconnectClients),
            ));
        }
        let line = handle.line_size().bytes() as u64;
        let dirty = if pending {
            0
        } else {
            handle.core_dirty_lines(core)
        };
        if dirty > 0 && (discard || !active) {
            losses.push(Loss::DirtyData {
                cache: cache_id,
                core,
                lines: dirty,
                bytes: dirty * line,
            });
        }
        let mut accepted = safety::decide(&what, losses, given)?;
        if active && !discard {
            // As casadm: the dirty data goes to the core first, outside the state lock (a
            // flush takes as long as the data), while the clients are still served.
            handle.flush_core(core).map_err(|e| {
                format!("cache {cache_id}: flushing core {core}: {}", engine_err(e))
            })?;
        }
        let mut st = self.state.lock();
        let c = st.cache(cache_id)?;
        match c.cores.get(&core) {
            None => return Err(format!("core {core} does not exist in cache {cache_id}")),
            Some(e) if e.pending => {
                // The engine never had it: only the setup names it.
                if let Some(c) = st.caches.get_mut(&cache_id) {
                    c.cores.remove(&core);
                }
                self.save_locked(&st);
                tracing::info!(
                    "cache {cache_id}: dropped core {core}, whose device never appeared"
                );
                return Ok(json!({}));
            }
            Some(_) => {}
        }
        if active && !given.gives(Consent::DisconnectClients) {
            // A client may have connected since the check: it still needs the consent.
            let late = self.clients_of(&[(name.clone(), kind)], false);
            safety::decide(&what, late, given)?;
        }
        // Consented clients lose the export now, so no write of theirs lands between the last
        // flush and the removal.
        let frontend = self.frontends.get(Some(kind)).ok();
        let unexported = active && frontend.as_ref().is_some_and(|f| f.stop(&name));
        if active && !discard {
            if let Err(e) = c.cache.flush_core(core) {
                if unexported {
                    self.serve_again(c, cache_id, core, kind);
                }
                return Err(format!(
                    "cache {cache_id}: flushing core {core}: {}",
                    engine_err(e)
                ));
            }
        }
        let discarded = match c.cache.remove_core_counted(core, discard) {
            Ok(n) => n,
            Err(e) => {
                if unexported {
                    self.serve_again(c, cache_id, core, kind);
                }
                return Err(format!("cache {cache_id}: {}", engine_err(e)));
            }
        };
        // What was discarded is what the engine dropped once the core was quiet, which may
        // differ from the count the decision saw.
        accepted.retain(|l| !matches!(l, Loss::DirtyData { .. }));
        if discarded > 0 {
            accepted.push(Loss::DirtyData {
                cache: cache_id,
                core,
                lines: discarded,
                bytes: discarded * line,
            });
        }
        self.traces.core_removed(&self.registry, cache_id, core);
        self.kinds.forget(&name);
        if let Some(c) = st.caches.get_mut(&cache_id) {
            c.cores.remove(&core);
        }
        self.save_locked(&st);
        tracing::info!("cache {cache_id}: removed core {core}");
        Ok(json!({ "losses": safety::record(&what, &accepted) }))
    }

    /// Export core `core` of cache `cache_id` (entry `c`) again after a removal that failed
    /// once its export was stopped, so its clients can reconnect.
    fn serve_again(&self, c: &CacheEntry, cache_id: u16, core: u16, kind: &'static str) {
        let name = export_name(cache_id, core);
        let back = (|| -> std::result::Result<(), String> {
            let e = c
                .cores
                .get(&core)
                .ok_or_else(|| format!("core {core} is gone"))?;
            let target = match &e.target {
                Some(t) => t.clone(),
                None => Target::new(c.cache.core(core).map_err(engine_err)?),
            };
            self.frontends.get(Some(kind))?.start(ExportSpec {
                name: name.clone(),
                description: format!("core {core} ({}) of cache {cache_id}", e.device),
                core: target,
                line_size: c.cache.line_size().bytes(),
                cache_device: c.device.clone(),
            })
        })();
        if let Err(e) = back {
            tracing::error!("cache {cache_id}: {name} cannot be served again: {e}");
        }
    }

    /// Open the device `spec` names under an exclusive claim (claims.rs) held as long as the
    /// volume is open. `allow_mounted`: see [`crate::claims::claim`].
    fn open_claimed(
        &self,
        spec: &str,
        allow_mounted: bool,
    ) -> std::result::Result<VolumeRef, String> {
        if is_nbd_uri(spec) && self.own.serves(spec) {
            return Err(format!(
                "{spec} is an export of this daemon: a cache cannot use its own export as a device (its I/O would come back into itself and deadlock)"
            ));
        }
        let claim = crate::claims::claim(spec, allow_mounted)?;
        let volume = open_device(spec)?;
        Ok(match claim {
            Some(claim) => Arc::new(ClaimedVolume::new(volume, claim)),
            None => volume,
        })
    }

    /// The in-use guard: taking an export away from connected clients gives them I/O errors
    /// (a mounted file system aborts its journal), so each busy export is a [`Loss`] that needs
    /// `--disconnect-clients`. With `grace`, a client that has just disconnected (still counted
    /// until its connection has wound down on the server's side) is waited for a moment: a
    /// script that disconnects and then stops must not be refused for that.
    fn clients_of(&self, exports: &[(String, &'static str)], grace: bool) -> Vec<Loss> {
        let deadline = Instant::now() + CLIENT_GONE_GRACE;
        loop {
            let busy = self.clients_now(exports);
            if busy.is_empty() || !grace || Instant::now() >= deadline {
                return busy;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn clients_now(&self, exports: &[(String, &'static str)]) -> Vec<Loss> {
        exports
            .iter()
            .filter_map(|(name, kind)| {
                let frontend = self.frontends.get(Some(kind)).ok()?;
                let n = frontend.busy(name).unwrap_or(0);
                (n > 0).then(|| Loss::Clients {
                    export: name.clone(),
                    // A block device is named too: that is what the operator sees mounted.
                    block_device: frontend.device(name),
                    connections: n,
                })
            })
            .collect()
    }

    fn stats(&self, cache_id: u16, core: Option<u16>, io_class: Option<u8>) -> Reply {
        let st = self.state.lock();
        let c = st.cache(cache_id)?;
        let info = cache_info(cache_id, c, &self.frontends);
        let core_info = |core: u16| {
            info.cores
                .iter()
                .find(|i| i.id == core)
                .cloned()
                .ok_or_else(|| format!("core {core} does not exist in cache {cache_id}"))
        };
        if let Some(id) = io_class {
            let (core_info, stats) = match core {
                Some(core) => {
                    let ci = core_info(core)?;
                    st.active_core(cache_id, core)?;
                    (
                        Some(ci),
                        c.cache.core_io_class_stats(core, id).map_err(engine_err)?,
                    )
                }
                None => (None, c.cache.io_class_stats(id).map_err(engine_err)?),
            };
            let class = c.cache.io_classes().get(id).map(io_class_info);
            return serde_json::to_value(StatsReport {
                cache: info,
                core: core_info,
                io_class: class,
                stats: stats.into(),
                latency: Vec::new(),
                cleaning: None,
                inactive: None,
            })
            .map_err(|e| e.to_string());
        }
        let (core_info, stats, latency) = match core {
            Some(core) => {
                let ci = core_info(core)?;
                st.active_core(cache_id, core)?;
                (
                    Some(ci),
                    c.cache.core_stats(core).map_err(engine_err)?,
                    c.cache.core_latency(core).map_err(engine_err)?,
                )
            }
            None => (None, c.cache.stats(), c.cache.latency()),
        };
        serde_json::to_value(StatsReport {
            cache: info,
            core: core_info,
            io_class: None,
            stats: stats.into(),
            latency: protocol::LatencyRow::rows(&latency),
            cleaning: core.is_none().then(|| {
                let c = c.cache.cleaning_stats();
                protocol::CleaningData {
                    cleaned_lines: c.cleaned_lines,
                    core_writes: c.core_writes,
                    core_write_bytes: c.core_write_bytes,
                }
            }),
            inactive: core
                .is_none()
                .then(|| c.cache.inactive_usage())
                .flatten()
                .map(|u| protocol::InactiveUsage {
                    occupancy_lines: u.occupancy_lines,
                    dirty_lines: u.dirty_lines,
                }),
        })
        .map_err(|e| e.to_string())
    }

    /// What a metrics scrape sees: every cache and core, read under the state lock (the
    /// figures themselves are read from the engine afterwards, outside it).
    fn metrics_view(&self) -> Vec<CacheView> {
        let st = self.state.lock();
        st.caches
            .iter()
            .map(|(id, c)| CacheView {
                id: *id,
                device: c.device.clone(),
                // A label must not change with every scrape: the percentage has its own metric.
                status: cache_info(*id, c, &self.frontends)
                    .status
                    .split(" (")
                    .next()
                    .unwrap_or_default()
                    .to_string(),
                cache: c.cache.clone(),
                cores: c
                    .cores
                    .iter()
                    .map(|(core_id, core)| CoreView {
                        id: *core_id,
                        device: core.device.clone(),
                        active: core.active,
                        clients: self
                            .frontends
                            .get(Some(core.frontend))
                            .ok()
                            .and_then(|f| f.clients(&export_name(*id, *core_id)))
                            .unwrap_or(0),
                    })
                    .collect(),
            })
            .collect()
    }

    /// The front-end of a core whose cache is being loaded: the one that served it before
    /// the daemon restarted (it resumes the same device), else the configuration's, else the
    /// one it had last (the state directory), else the default.
    fn frontend_at_load(&self, name: &str, cache_device: &str) -> &Arc<dyn Frontend> {
        if let Some(f) = self
            .frontends
            .all()
            .find(|f| f.remembers(name, cache_device))
        {
            return f;
        }
        let preferred = self
            .preferred
            .lock()
            .get(name)
            .cloned()
            .or_else(|| self.kinds.get(name, cache_device));
        self.frontends
            .get(preferred.as_deref())
            .or_else(|_| self.frontends.get(None))
            .expect("the default front-end exists")
    }

    /// The cache on `device` cannot be loaded: exports a previous daemon left for it (ublk
    /// devices holding their requests) are given up, with the reason in the log.
    fn abandon_exports(&self, device: &str, why: &str) {
        for f in self.frontends.all() {
            f.abandon(device, why);
        }
    }

    fn save(&self) {
        let st = self.state.lock();
        self.save_locked(&st);
    }

    /// Record the setup as it runs now in the state directory (state.rs), so a restart
    /// brings it back. The configuration file is never written.
    fn save_locked(&self, st: &State) {
        if self.applying.load(Ordering::SeqCst) {
            return;
        }
        if let Some(store) = &self.store {
            let default_frontend = self.frontends.default_kind();
            store.record(
                st.to_config(&DaemonSection::default(), default_frontend),
                &self.file_cfg,
                default_frontend,
            );
        }
    }

    /// A cache about to be dropped from the setup by a stop: if it keeps dirty data on its
    /// device (`-T -n`, or a flush that failed), the state records it, so the next start loads
    /// it again and its core is not left without its newest data.
    fn note_stop(&self, st: &State, id: u16) {
        let (Some(store), Some(c)) = (&self.store, st.caches.get(&id)) else {
            return;
        };
        let dirty_lines = c.cache.stats().usage.dirty_lines;
        if !c.cache.persistent() || dirty_lines == 0 {
            return;
        }
        let (cache, cores) = cache_config(id, c, self.frontends.default_kind());
        store.stopped_dirty(crate::state::StoppedCache {
            cache,
            cores,
            dirty_lines,
        });
    }

    /// `config export`: the running setup in the configuration file's format, with the
    /// file's `[daemon]` section; values at their defaults are left out (parameters: those of
    /// a new cache of the same mode and line size).
    fn export_config(&self) -> Reply {
        let st = self.state.lock();
        let mut daemon = self.file_cfg.daemon.clone();
        // Not an option any more (it no longer writes anything); left out so the export
        // does not carry it on.
        daemon.save_config = None;
        let mut cfg = st.to_config(&daemon, self.frontends.default_kind());
        drop(st);
        for c in &mut cfg.caches {
            let defaults = param_defaults(c.mode.as_deref(), c.line_size);
            c.params.retain(|k, v| defaults.get(k) != Some(v));
            if c.mode.as_deref() == Some("wt") {
                c.mode = None;
            }
            if c.line_size == Some(4) {
                c.line_size = None;
            }
        }
        let text = cfg.to_toml().map_err(|e| e.to_string())?;
        Ok(json!({ "toml": text }))
    }

    /// Apply a configuration file as one transaction: the whole file is checked first
    /// (daemon/check.rs) and a refused file changes nothing, neither a device nor the file.
    /// Then each cache starts in file order: a cache whose device already holds a cache is
    /// loaded (its recorded mode, line size and cores win), otherwise a new one is created. A
    /// cache whose device is missing waits for it (daemon/watch.rs) and the others start; so
    /// does a cache that fails to start. The setup is recorded once, at the end, and keeps
    /// every entry that is not running exactly as it was. A cache in `load_only` (stopped with
    /// dirty data) is loaded from its device, never created anew.
    fn apply(&self, cfg: &ConfigFile, load_only: &std::collections::BTreeSet<u16>) -> Result<()> {
        self.check_file(cfg)?;
        self.preferred.lock().extend(
            cfg.cores
                .iter()
                .filter_map(|c| c.frontend.clone().map(|f| (export_name(c.cache, c.id), f))),
        );
        self.applying.store(true, Ordering::SeqCst);
        for c in &cfg.caches {
            let cores: Vec<CoreSection> = cfg
                .cores
                .iter()
                .filter(|k| k.cache == c.id)
                .cloned()
                .collect();
            let status = if is_missing(&c.device) {
                tracing::warn!(
                    "cache {}: device {} is missing; the cache waits for it",
                    c.id,
                    c.device
                );
                WAITING_FOR_DEVICE.to_string()
            } else {
                let how = if load_only.contains(&c.id) {
                    Start::Load
                } else {
                    Start::LoadOrCreate
                };
                match self.start_configured(c, &cores, how) {
                    Ok(()) => continue,
                    Err(e) => {
                        tracing::error!("cache {}: not started: {e}", c.id);
                        self.abandon_exports(&c.device, &e);
                        format!("Not started: {e}")
                    }
                }
            };
            self.state.lock().waiting.insert(
                c.id,
                Waiting {
                    section: c.clone(),
                    cores,
                    status,
                },
            );
        }
        self.applying.store(false, Ordering::SeqCst);
        self.save();
        Ok(())
    }

    /// The checks of [`Daemon::apply`], which change nothing.
    fn check_file(&self, cfg: &ConfigFile) -> Result<()> {
        {
            let st = self.state.lock();
            check::check_config(cfg, &st)
                .map_err(|e| anyhow!("configuration refused, nothing was changed: {e}"))?;
        }
        for core in &cfg.cores {
            if let Err(e) = self.frontends.get(core.frontend.as_deref()) {
                bail!(
                    "configuration refused, nothing was changed: core {} of cache {}: {e}",
                    core.id,
                    core.cache
                );
            }
        }
        Ok(())
    }

    /// Wait for the devices the file marks `lazy_startup = false` to be present (startup.rs,
    /// step 1), before anything is applied. A file that would be refused is refused first,
    /// rather than after the wait; it is checked again when applied, with the devices that
    /// appeared meanwhile.
    fn wait_for_devices(
        &self,
        cfg: &ConfigFile,
        needed: &[startup::Needed],
        deadline: Instant,
        timeout: Duration,
        signals: &libc::sigset_t,
    ) -> Result<Option<i32>> {
        if !needed.iter().any(|n| is_missing(&n.device)) {
            return Ok(None);
        }
        self.check_file(cfg).context("applying the configuration")?;
        match startup::wait_present(needed, deadline, timeout, signals) {
            startup::Wait::Done => Ok(None),
            startup::Wait::Signal(sig) => Ok(Some(sig)),
            startup::Wait::Failed(e) => bail!("{e}"),
        }
    }

    /// Start one cache of the configuration, then set its parameters and add its cores. Only
    /// the start itself can fail; parameters were checked with the file, and a core whose
    /// device is missing or unusable stays inactive (it is attached when its device appears).
    fn start_configured(
        &self,
        c: &CacheSection,
        cores: &[CoreSection],
        how: Start,
    ) -> std::result::Result<(), String> {
        // A load takes the mode and line size recorded on the device.
        let (mode, line_size) = match how {
            Start::Load => (None, None),
            _ => (c.mode.as_deref(), c.line_size),
        };
        self.start_cache(&c.device, Some(c.id), mode, line_size, how)?;
        // One request per group, so each group's fields are applied together.
        let mut groups: BTreeMap<&str, BTreeMap<String, String>> = BTreeMap::new();
        for (key, value) in &c.params {
            match params::split_key(key) {
                Ok((g, field)) => {
                    groups
                        .entry(g.name)
                        .or_default()
                        .insert(field, value.clone());
                }
                Err(e) => tracing::error!("cache {}: parameter {key}: {e}", c.id),
            }
        }
        for (name, values) in groups {
            if let Err(e) = self.set_param_group(c.id, name, values) {
                tracing::error!("cache {}: parameter {name}: {e}", c.id);
            }
        }
        if let Some(entry) = self.state.lock().caches.get_mut(&c.id) {
            entry.ioclass = (c.ioclass_file.clone(), c.ioclass_ignore_unsupported);
            entry.lazy_startup = c.lazy_startup;
        }
        match crate::config::load_ioclass_file(c) {
            None => {}
            Some(Err(e)) => tracing::error!("cache {}: {e}", c.id),
            Some(Ok(classes)) => {
                let loaded = self
                    .checked(c.id, None)
                    .and_then(|h| h.load_io_classes(classes).map_err(engine_err));
                if let Err(e) = loaded {
                    tracing::error!("cache {}: ioclass_file: {e}", c.id);
                }
            }
        }
        for core in cores {
            let known = {
                let st = self.state.lock();
                st.core(core.cache, core.id)
                    .ok()
                    .map(|e| (e.active, e.device == core.device))
            };
            match known {
                // As loaded; an inactive core on its recorded device is the watcher's.
                Some((true, _)) | Some((false, true)) => continue,
                Some((false, false)) => {
                    if let Err(e) = self.add_core(
                        core.cache,
                        &core.device,
                        Some(core.id),
                        false,
                        core.frontend.as_deref(),
                    ) {
                        tracing::warn!(
                            "core {} of cache {} stays inactive: {e}",
                            core.id,
                            core.cache
                        );
                        // The file's spelling is what is watched and saved.
                        let mut st = self.state.lock();
                        if let Some(entry) = st
                            .caches
                            .get_mut(&core.cache)
                            .and_then(|c| c.cores.get_mut(&core.id))
                        {
                            entry.device = core.device.clone();
                        }
                    }
                }
                None => {
                    let result = if is_missing(&core.device) {
                        Err(format!("its device {} is missing", core.device))
                    } else {
                        self.add_core(
                            core.cache,
                            &core.device,
                            Some(core.id),
                            false,
                            core.frontend.as_deref(),
                        )
                        .map(|_| ())
                    };
                    if let Err(e) = result {
                        tracing::warn!(
                            "core {} of cache {} waits for its device: {e}",
                            core.id,
                            core.cache
                        );
                        let mut st = self.state.lock();
                        if let Some(c) = st.caches.get_mut(&core.cache) {
                            c.cores.insert(
                                core.id,
                                CoreEntry {
                                    device: core.device.clone(),
                                    key: None,
                                    active: false,
                                    pending: true,
                                    frontend: self
                                        .frontends
                                        .get(core.frontend.as_deref())
                                        .map_or("nbd", |f| f.kind()),
                                    target: None,
                                    lazy_startup: core.lazy_startup,
                                },
                            );
                        }
                    }
                }
            }
        }
        let mut st = self.state.lock();
        if let Some(entry) = st.caches.get_mut(&c.id) {
            for core in cores {
                if let Some(e) = entry.cores.get_mut(&core.id) {
                    e.lazy_startup = core.lazy_startup;
                }
            }
        }
        Ok(())
    }

    fn set_param_group(
        &self,
        cache: u16,
        name: &str,
        values: BTreeMap<String, String>,
    ) -> std::result::Result<(), String> {
        let g = params::find(name)?;
        let set = g
            .set
            .ok_or_else(|| format!("parameter '{name}' is read-only"))?;
        let handle = self.checked(cache, None)?;
        set(&handle, None, &values)?;
        self.save();
        Ok(())
    }

    /// Stop every cache, flushing its dirty data; returns false if some dirty data could not be
    /// written (it is then kept on the cache device where the cache is persistent).
    fn shutdown(&self) -> bool {
        self.stopping.store(true, Ordering::SeqCst);
        self.traces.stop_all(&self.registry);
        let mut st = self.state.lock();
        // Requests held for a disconnected cache fail now rather than hold up the front-ends'
        // stop (and a pass-through route lets go of its core).
        for d in st.disconnected.values() {
            d.take_down();
        }
        st.disconnected.clear();
        // Block devices go before their caches stop, so their last requests are served.
        for f in self.frontends.all() {
            f.stop_all();
        }
        let mut clean = true;
        for (id, c) in &st.caches {
            if let Err(e) = c.cache.stop(true) {
                tracing::error!(
                    "cache {id}: stopping with a flush failed: {}",
                    engine_err(e)
                );
                clean = false;
                if c.cache.persistent() {
                    match c.cache.stop(false) {
                        Ok(()) => tracing::info!(
                            "cache {id}: its dirty data is kept on {}",
                            c.device
                        ),
                        Err(e) => tracing::error!(
                            "cache {id}: writing the metadata failed too ({}); the next load recovers it as after a crash",
                            engine_err(e)
                        ),
                    }
                }
            }
        }
        st.caches.clear();
        clean
    }
}

/// Block SIGINT and SIGTERM in the calling thread and every thread it starts afterwards, and
/// return the set for `sigwait`.
pub fn block_signals() -> libc::sigset_t {
    // SAFETY: plain libc calls on a zero-initialised sigset_t we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

pub fn wait_for_signal(set: &libc::sigset_t) -> i32 {
    let mut sig: libc::c_int = 0;
    loop {
        // SAFETY: `set` is a valid, initialised signal set; `sig` is a valid out pointer.
        let rc = unsafe { libc::sigwait(set, &mut sig) };
        if rc == 0 {
            return sig;
        }
    }
}

/// Bind the control socket, readable and writable by the owner only. A socket file nobody
/// listens on is left over from a crash and is replaced; a live one means another daemon.
fn bind_control(path: &Path) -> Result<UnixListener> {
    if path.exists() {
        match UnixStream::connect(path) {
            Ok(_) => bail!(
                "another daemon is already listening on {} (stop it first)",
                path.display()
            ),
            Err(_) => std::fs::remove_file(path)
                .with_context(|| format!("cannot remove stale socket {}", path.display()))?,
        }
    }
    // The umask makes the socket 0600 from the start; chmod afterwards would leave a window.
    // SAFETY: umask only changes this process's file creation mask.
    let old = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old) };
    bound.with_context(|| format!("cannot listen on {}", path.display()))
}

/// A listen address: a bare `PORT` (or `:PORT`) means loopback only; `flag` names the option in
/// errors.
fn parse_listen(flag: &str, text: &str) -> Result<SocketAddr> {
    if let Ok(port) = text.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    if let Some(port) = text.strip_prefix(':') {
        let port: u16 = port
            .parse()
            .map_err(|_| anyhow!("{flag} {text}: bad port"))?;
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    text.parse()
        .map_err(|_| anyhow!("{flag} {text}: expected PORT or ADDRESS:PORT (e.g. 127.0.0.1:10809)"))
}

fn ensure_parent(path: &Path) -> Result<()> {
    if let Some(dir) = path.parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create directory {}", dir.display()))?;
        }
    }
    Ok(())
}

/// Who is on the other end of a control connection (the kernel's SO_PEERCRED), for the log.
fn peer_text(stream: &UnixStream) -> String {
    match hybridcache_nbd::unix_peer_credentials(stream) {
        Some(c) => format!("pid {} uid {}", c.pid, c.uid),
        None => "an unknown peer".into(),
    }
}

/// Requests that change the setup; the others only read it.
fn changes_something(req: &Request) -> bool {
    !matches!(
        req,
        Request::List
            | Request::Stats { .. }
            | Request::GetParam { .. }
            | Request::ListIoClasses { .. }
            | Request::Version
            | Request::TraceStatus
    )
}

/// The settings a request is about to change, read before it runs, so the log can say what
/// they were ("from what to what"): the cache mode, or the parameter group's fields, by name
/// (per-core groups prefixed with the core).
fn settings(daemon: &Daemon, req: &Request) -> Option<Vec<(String, String)>> {
    let (cache, core, name) = match req {
        Request::SetCacheMode { cache, .. } => (*cache, None, "cache-mode".to_string()),
        Request::SetParam {
            cache, core, name, ..
        } => (*cache, *core, name.clone()),
        _ => return None,
    };
    let v = daemon
        .handle(Request::GetParam { cache, core, name })
        .ok()?;
    let p: protocol::ParamValue = serde_json::from_value(v).ok()?;
    let mut out: Vec<(String, String)> = p
        .fields
        .iter()
        .map(|f| (f.key.clone(), f.value.clone()))
        .collect();
    for c in &p.cores {
        out.extend(
            c.fields
                .iter()
                .map(|f| (format!("core {} {}", c.core, f.key), f.value.clone())),
        );
    }
    Some(out)
}

/// One log line per management change: who asked, what, and for settings what changed from
/// what to what.
fn log_change(
    daemon: &Daemon,
    peer: &str,
    req: &Request,
    before: Option<Vec<(String, String)>>,
    result: &Reply,
) {
    let mut what = serde_json::to_string(req).unwrap_or_default();
    if let Request::LoadIoClasses { cache, csv, .. } = req {
        what = format!(
            "load IO classes of cache {cache} ({} lines)",
            csv.lines().count()
        );
    }
    match result {
        Ok(_) => {
            let mut change = String::new();
            if let (Some(before), Some(after)) = (before, settings(daemon, req)) {
                let diffs: Vec<String> = after
                    .iter()
                    .filter_map(|(k, new)| {
                        let old = before.iter().find(|(bk, _)| bk == k).map(|(_, v)| v)?;
                        (old != new).then(|| format!("{k} {old} -> {new}"))
                    })
                    .collect();
                change = if diffs.is_empty() {
                    ": nothing changed".into()
                } else {
                    format!(": {}", diffs.join(", "))
                };
            }
            tracing::info!("control request from {peer}: {what} done{change}");
        }
        Err(e) => tracing::warn!("control request from {peer}: {what} refused: {e}"),
    }
}

fn serve_control_client(daemon: &Daemon, stream: UnixStream) {
    let peer = peer_text(&stream);
    let Ok(write_half) = stream.try_clone() else {
        return;
    };
    let mut writer = write_half;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        match (&mut reader).take(MAX_LINE as u64).read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if !line.ends_with('\n') && line.len() >= MAX_LINE {
            let _ = writeln!(writer, "{}", reply_text(Response::err("request too long")));
            return;
        }
        if line.trim().is_empty() {
            continue;
        }
        let mut stop_request = false;
        let response = match serde_json::from_str::<Request>(&line) {
            Ok(req) => {
                if req != Request::Version {
                    daemon.wait_started();
                }
                stop_request = req == Request::Shutdown;
                let audit = changes_something(&req).then(|| (req.clone(), settings(daemon, &req)));
                let result = daemon.handle(req);
                if let Some((req, before)) = audit {
                    log_change(daemon, &peer, &req, before, &result);
                }
                match result {
                    Ok(v) => Response::ok(v),
                    Err(e) => {
                        // Refused (the daemon was already stopping): nobody waits for it.
                        stop_request = false;
                        Response::err(e)
                    }
                }
            }
            Err(e) => Response::err(format!("bad request: {e}")),
        };
        let sent = writeln!(writer, "{}", reply_text(response));
        if stop_request {
            daemon.shutdown_waiters.fetch_sub(1, Ordering::SeqCst);
        }
        if sent.is_err() {
            return;
        }
    }
}

fn reply_text(r: Response) -> String {
    serde_json::to_string(&r)
        .unwrap_or_else(|_| r#"{"ok":false,"error":"cannot encode the reply"}"#.to_string())
}

use std::io::Read as _;

/// Run the daemon in the foreground until SIGTERM/SIGINT (or a `shutdown` request).
pub fn run(opts: DaemonOptions) -> Result<()> {
    crate::log::init();
    let file_cfg = match &opts.config {
        Some(path) if !path.exists() && opts.save_config => ConfigFile::default(),
        Some(path) => ConfigFile::load(path)?,
        None => ConfigFile::default(),
    };
    let d = &file_cfg.daemon;
    let control = opts
        .control
        .clone()
        .or_else(|| d.control.clone())
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CONTROL));
    let nbd_socket = opts
        .nbd_socket
        .clone()
        .or_else(|| d.nbd_socket.clone())
        .unwrap_or_else(|| PathBuf::from(DEFAULT_NBD_SOCKET));
    let nbd_listen = opts.nbd_listen.clone().or_else(|| d.nbd_listen.clone());
    let workers = opts
        .nbd_workers
        .or(d.nbd_workers)
        .unwrap_or(DEFAULT_NBD_WORKERS);
    if workers == 0 || workers > 256 {
        bail!("nbd workers must be between 1 and 256, not {workers}");
    }
    let stall_warn = match opts.cleaning_stall_warn.or(d.cleaning_stall_warn) {
        Some(0) => bail!("cleaning stall warn must be at least 1 second"),
        s => Duration::from_secs(s.unwrap_or(health::DEFAULT_STALL_WARN_S)),
    };
    // Kept so that an older unit or file still starts (an upgrade must not leave the host
    // without its caches), but the operator's file is never written any more.
    let save_config_asked = opts.save_config || d.save_config.unwrap_or(false);
    if save_config_asked && opts.config.is_none() {
        bail!("--save-config needs --config FILE");
    }
    let core_flush_timeout = match opts.core_flush_timeout.or(d.core_flush_timeout) {
        Some(0) => bail!("core flush timeout must be at least 1 second"),
        Some(s) => Duration::from_secs(s),
        None => hybridcache_engine::DEFAULT_CORE_FLUSH_TIMEOUT,
    };
    hybridcache_engine::set_core_flush_timeout(core_flush_timeout);

    let signals = block_signals();
    ensure_parent(&control)?;
    ensure_parent(&nbd_socket)?;
    let listener = bind_control(&control)?;
    let cleanup_control = || {
        let _ = std::fs::remove_file(&control);
    };

    let registry = ExportRegistry::new();
    // The state directory is the daemon's own (state.rs): not /run, which systemd empties
    // whenever the service stops, restarts included.
    let state_dir = opts
        .state_dir
        .clone()
        .or_else(|| d.state_dir.clone())
        .or_else(crate::state::systemd_state_directory)
        .unwrap_or_else(|| PathBuf::from(crate::state::DEFAULT_STATE_DIR));
    let state = crate::state::StateDir::new(&state_dir);
    state.forget_other_boots();
    let file_name = opts
        .config
        .as_ref()
        .map_or_else(String::new, |p| p.display().to_string());
    if save_config_asked {
        tracing::warn!(
            "--save-config / save_config = true no longer write {file_name}: the file is left as \
             it is. Changes made at run time are kept in {} and applied again at the next \
             start; `hybridcache config export -o PATH` writes the running setup to a file",
            state.setup_path().display()
        );
    }
    // Only a daemon with a configuration file keeps a run-time setup: one started by hand
    // without it starts with no cache, as it always did.
    let recorded = opts.config.as_ref().and_then(|_| state.load_setup());
    let merged = match &recorded {
        Some(setup) => crate::state::merge(&file_cfg, &file_name, setup, &|c| {
            param_defaults(c.mode.as_deref(), c.line_size)
        }),
        None => crate::state::Merged {
            config: file_cfg.clone(),
            notes: file_cfg
                .caches
                .iter()
                .map(|c| (c.id, format!("from {file_name}")))
                .collect(),
            ..Default::default()
        },
    };
    let store = opts.config.as_ref().map(|_| {
        crate::state::SetupStore::new(
            crate::state::StateDir::new(&state_dir),
            recorded.clone().unwrap_or_default(),
        )
    });
    let default_frontend = opts
        .frontend
        .clone()
        .or_else(|| d.frontend.clone())
        .unwrap_or_else(|| "nbd".into());
    let ublk_queues = opts.ublk_queues.or(d.ublk_queues);
    if let Some(q) = ublk_queues {
        if q == 0 || q > MAX_UBLK_QUEUES {
            cleanup_control();
            bail!("ublk queues must be between 1 and {MAX_UBLK_QUEUES}, not {q}");
        }
    }
    let kinds = crate::frontend::KindMemory::new(&state_dir);
    let frontends = Frontends::new(
        vec![
            Arc::new(NbdFrontend::new(registry.clone())),
            Arc::new(crate::ublk_export::UblkFrontend::new(
                state_dir,
                ublk_queues,
            )),
        ],
        &default_frontend,
    )
    .map_err(|e| {
        cleanup_control();
        anyhow!("--frontend: {e}")
    })?;
    let server_config = nbd_server_config(workers, &opts.nbd_limits, d).inspect_err(|_| {
        cleanup_control();
    })?;
    tracing::info!(
        "NBD limits: {} connections, {} per client, {} per local user, {} per export, \
         memory {} MiB ({} MiB for in-flight requests)",
        server_config.max_connections,
        server_config.max_connections_per_client,
        server_config.max_connections_per_user,
        server_config.max_connections_per_export,
        server_config.memory_limit >> 20,
        server_config.effective_budget() >> 20
    );
    let server = Server::with_config(registry.clone(), server_config);
    let started = (|| -> Result<Option<SocketAddr>> {
        server
            .serve_unix(&nbd_socket)
            .with_context(|| format!("cannot serve NBD on {}", nbd_socket.display()))?;
        match &nbd_listen {
            Some(text) => {
                let addr = parse_listen("--nbd-listen", text)?;
                Ok(Some(
                    server
                        .serve_tcp(addr)
                        .with_context(|| format!("cannot serve NBD on {addr}"))?,
                ))
            }
            None => Ok(None),
        }
    })();
    let tcp = match started {
        Ok(tcp) => tcp,
        Err(e) => {
            server.shutdown();
            cleanup_control();
            return Err(e);
        }
    };

    let daemon = Arc::new(Daemon {
        state: Mutex::new(State::default()),
        registry,
        frontends,
        preferred: Mutex::new(BTreeMap::new()),
        kinds,
        store,
        file_cfg: file_cfg.clone(),
        stopping: AtomicBool::new(false),
        applying: AtomicBool::new(false),
        traces: Default::default(),
        own: OwnEndpoints::new(&nbd_socket, tcp),
        shutdown_outcome: Mutex::new(None),
        shutdown_done: Condvar::new(),
        shutdown_waiters: AtomicUsize::new(0),
        stall_warn,
        started: Mutex::new(false),
        started_cv: Condvar::new(),
    });
    // The metrics endpoint comes up before the configuration is applied (a refused address
    // must not leave devices touched), and shows the caches as they start.
    let metrics_listen = opts
        .metrics_listen
        .clone()
        .or_else(|| d.metrics_listen.clone());
    let metrics = match metrics_listen
        .as_deref()
        .map(|text| -> Result<MetricsServer> {
            let addr = parse_listen("--metrics-listen", text)?;
            let view = daemon.clone();
            MetricsServer::start(addr, Arc::new(move || view.metrics_view()))
        })
        .transpose()
    {
        Ok(m) => m,
        Err(e) => {
            server.shutdown();
            cleanup_control();
            return Err(e);
        }
    };
    let device_timeout = Duration::from_secs(
        d.device_timeout
            .unwrap_or(startup::DEFAULT_DEVICE_TIMEOUT_S),
    );
    let deadline = Instant::now() + device_timeout;
    {
        let daemon = daemon.clone();
        std::thread::Builder::new()
            .name("control-accept".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    let Ok(stream) = stream else { continue };
                    let daemon = daemon.clone();
                    let _ = std::thread::Builder::new()
                        .name("control".into())
                        .spawn(move || serve_control_client(&daemon, stream));
                }
            })
            .context("cannot start the control thread")?;
    }
    // The state's setup is only added to a file that is accepted on its own, and a merged
    // setup that the checks refuse falls back to the file: the file alone always starts.
    let mut merged = merged;
    if recorded.is_some() && merged.config != file_cfg {
        if let Err(e) = daemon
            .check_file(&file_cfg)
            .and_then(|()| daemon.check_file(&merged.config))
        {
            // Kept aside for the operator: the next record would overwrite it.
            let kept = daemon.store.as_ref().map(|s| {
                let path = s.dir.setup_path();
                let aside = path.with_extension("json.refused");
                match std::fs::copy(&path, &aside) {
                    Ok(_) => aside.display().to_string(),
                    Err(_) => path.display().to_string(),
                }
            });
            tracing::error!(
                "the run-time setup in the state directory is not applied (kept as {}): {e:#}",
                kept.unwrap_or_default()
            );
            merged = crate::state::Merged {
                config: file_cfg.clone(),
                ..Default::default()
            };
        }
    }
    for (id, note) in &merged.notes {
        tracing::info!("cache {id}: {note}");
    }
    let setup = &merged.config;
    let needed = startup::needed(setup);
    let applied = match daemon.wait_for_devices(setup, &needed, deadline, device_timeout, &signals)
    {
        Ok(None) => daemon
            .apply(setup, &merged.load_only)
            .map(|()| None)
            .context("applying the configuration"),
        other => other,
    };
    match applied {
        Ok(None) => {}
        stopped_or_failed => {
            daemon.shutdown();
            server.shutdown();
            if let Some(m) = &metrics {
                m.shutdown();
            }
            cleanup_control();
            return match stopped_or_failed {
                Ok(sig) => {
                    tracing::info!(
                        "signal {}: stopped while waiting for devices; nothing was started",
                        sig.unwrap_or(0)
                    );
                    Ok(())
                }
                Err(e) => Err(e),
            };
        }
    }
    daemon.set_started();
    watch::spawn(daemon.clone()).context("cannot start the device watcher")?;

    // The control socket answers while devices that are not lazy are waited for, so `-L`
    // shows what is missing; readiness waits (startup.rs, step 2).
    let mut failed = None;
    let sig = match daemon.wait_running(&needed, deadline, device_timeout, &signals) {
        startup::Wait::Done => {
            tracing::info!(
                "daemon {} ready: control {}, NBD {}{}",
                env!("CARGO_PKG_VERSION"),
                control.display(),
                nbd_socket.display(),
                tcp.map(|a| format!(" and tcp {a}")).unwrap_or_default()
            );
            // Under systemd's Type=notify the unit (and what is ordered after it) waits for
            // this: the control socket listens, the configuration is applied and what is not
            // lazy runs. A failed send is logged, not fatal: systemd then times the start out,
            // which says more than exiting here would.
            match crate::notify::notify("READY=1") {
                Ok(true) => tracing::info!("told systemd the daemon is ready"),
                Ok(false) => {}
                Err(e) => tracing::warn!("cannot notify systemd (NOTIFY_SOCKET): {e}"),
            }
            wait_for_signal(&signals)
        }
        startup::Wait::Signal(sig) => sig,
        startup::Wait::Failed(e) => {
            tracing::error!("{e}; stopping");
            failed = Some(e);
            0
        }
    };
    if sig != 0 {
        tracing::info!("signal {sig}: shutting down");
    }
    // Stop taking requests first: the management lock and the NBD connections, then flush.
    daemon.stopping.store(true, Ordering::SeqCst);
    cleanup_control();
    // The NBD server's stop waits for its connections, so none may be left waiting for a
    // disconnected cache.
    daemon.release_held();
    server.shutdown();
    if let Some(m) = &metrics {
        m.shutdown();
    }
    let clean = daemon.shutdown();
    // A stop-daemon request waits for this outcome; give it the time to send its reply.
    *daemon.shutdown_outcome.lock() = Some(clean);
    daemon.shutdown_done.notify_all();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    while daemon.shutdown_waiters.load(Ordering::SeqCst) > 0 && std::time::Instant::now() < deadline
    {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    if let Some(e) = failed {
        bail!("{e}");
    }
    if !clean {
        bail!("some dirty data could not be flushed at shutdown");
    }
    tracing::info!("stopped");
    Ok(())
}

/// Where the block device `spec` names is mounted; None for anything else or when unmounted.
fn mounted_block(spec: &str) -> Option<Vec<String>> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = std::fs::metadata(crate::claims::spec_path(spec)?).ok()?;
    if !meta.file_type().is_block_device() {
        return None;
    }
    let mounts = crate::claims::mounts_of_block(meta.rdev());
    (!mounts.is_empty()).then_some(mounts)
}

/// A cache's cores as its superblock records them, for a refusal ("1 (/dev/sdb)").
fn cores_text(sb: &hybridcache_engine::Superblock) -> String {
    sb.cores
        .iter()
        .map(|c| format!("{} ({})", c.id, c.path))
        .collect::<Vec<_>>()
        .join(", ")
}

/// What formatting `device` as a new cache destroys: the cache it holds (with its dirty lines,
/// read from its metadata without loading it), hybridcache metadata that cannot be read, or a
/// file system or other signature (signature.rs).
fn device_losses(
    device: &str,
    volume: &dyn hybridcache_volume::Volume,
) -> std::result::Result<Vec<Loss>, String> {
    match hybridcache_engine::read_summary(volume) {
        Ok(Some(summary)) => {
            return Ok(vec![Loss::CacheMetadata {
                device: device.to_string(),
                cache: summary.superblock.cache_id,
                cores: cores_text(&summary.superblock),
                dirty_lines: summary.total_dirty_lines(),
                dirty_bytes: summary.dirty_bytes(),
            }])
        }
        Ok(None) => {}
        // A newer build's cache, or metadata damaged in both copies: what it holds cannot be
        // told, only that --force destroys it.
        Err(e) => {
            return Ok(vec![Loss::Signature {
                device: device.to_string(),
                what: format!(
                    "hybridcache metadata this build cannot read ({})",
                    engine_err(e)
                ),
            }])
        }
    }
    if hybridcache_engine::holds_metadata(volume).map_err(engine_err)? {
        return Ok(vec![Loss::Signature {
            device: device.to_string(),
            what: "a damaged hybridcache superblock (no copy of it loads)".into(),
        }]);
    }
    let Some(path) = crate::claims::spec_path(device) else {
        return Ok(Vec::new());
    };
    Ok(crate::signature::detect(Path::new(path))?
        .map(|what| Loss::Signature {
            device: device.to_string(),
            what,
        })
        .into_iter()
        .collect())
}

/// Refuse to format a device that holds data of another kind (signature.rs). A hybridcache
/// cache is left to the engine, which refuses it unless forced and lets the configuration file
/// load it.
fn check_signatures(
    device: &str,
    volume: &dyn hybridcache_volume::Volume,
    how: Start,
) -> std::result::Result<(), String> {
    if Cache::peek(volume).is_ok() {
        return Ok(());
    }
    let Some(path) = crate::claims::spec_path(device) else {
        return Ok(());
    };
    match crate::signature::detect(Path::new(path))? {
        None => Ok(()),
        Some(found) if how == Start::LoadOrCreate => Err(format!(
            "{device} holds {found}; the configuration file does not overwrite it (format it with start-cache --force, or fix the device name)"
        )),
        Some(found) => Err(format!(
            "{device} holds {found}; use --force to overwrite it"
        )),
    }
}

fn io_class_info(c: &hybridcache_engine::ioclass::IoClass) -> protocol::IoClassInfo {
    protocol::IoClassInfo {
        id: c.id,
        name: c.name.clone(),
        eviction_priority: c
            .eviction_priority
            .map_or("Pinned".to_string(), |p| p.to_string()),
        allocation: c.allocation_str(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listen_addresses() {
        assert_eq!(
            parse_listen("--nbd-listen", "10809").unwrap(),
            "127.0.0.1:10809".parse().unwrap()
        );
        assert_eq!(
            parse_listen("--nbd-listen", "0.0.0.0:1").unwrap(),
            "0.0.0.0:1".parse().unwrap()
        );
        assert!(parse_listen("--nbd-listen", "localhost").is_err());
    }

    #[test]
    fn nbd_limits_merge_and_fit_the_memory_limit() {
        let file = DaemonSection {
            nbd_max_connections_per_client: Some(5),
            nbd_max_connections_per_user: Some(7),
            nbd_memory_limit: Some("1G".into()),
            nbd_stall_timeout: Some(0),
            ..DaemonSection::default()
        };
        let cli = NbdLimits {
            max_connections_per_client: Some(3),
            ..NbdLimits::default()
        };
        let c = nbd_server_config(4, &cli, &file).unwrap();
        assert_eq!(c.max_connections_per_client, 3, "the command line wins");
        assert_eq!(
            c.max_connections_per_user, 7,
            "the file's key over the default"
        );
        assert_eq!(c.memory_limit, 1 << 30);
        assert_eq!(c.stall_timeout, None);
        assert_eq!(c.max_connections, 256);
        // Many workers make connections dear: the default count shrinks to fit 512 MiB...
        let c = nbd_server_config(64, &NbdLimits::default(), &DaemonSection::default()).unwrap();
        assert!(c.max_connections < 256 && c.max_connections >= 16);
        assert!(
            c.max_connections as u64 * c.connection_overhead() + (48 << 20) <= 512 << 20,
            "{c:?}"
        );
        // ... but a count given explicitly is kept, and refused if it cannot fit.
        let cli = NbdLimits {
            max_connections: Some(256),
            ..NbdLimits::default()
        };
        let e = nbd_server_config(64, &cli, &DaemonSection::default()).unwrap_err();
        assert!(e.to_string().contains("too small"), "{e}");
        let bad = DaemonSection {
            nbd_memory_limit: Some("lots".into()),
            ..DaemonSection::default()
        };
        assert!(nbd_server_config(4, &NbdLimits::default(), &bad).is_err());
    }
}

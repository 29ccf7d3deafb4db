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
//!
//! This file holds the registry ([`State`]), the daemon ([`Daemon`]), the request dispatcher
//! and `run`. The rooms, under daemon/: caches.rs (start, load, stop, shutdown), cores.rs (add,
//! remove, zero-metadata), configure.rs (the configuration applied, the setup recorded and
//! exported), info.rs (listings, statistics, the metrics view), requests.rs (flush, mode,
//! parameters, IO classes, traces), guards.rs (claims, clients in the way), control.rs (the
//! control socket), nbd_limits.rs, purge.rs (casadm's purge and check-cache-device), pool.rs
//! (the core pool), and check.rs, disconnect.rs, health.rs, startup.rs and watch.rs.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use hybridcache_engine::{Cache, EngineError, MirrorLostPolicy, MirrorState};
use hybridcache_nbd::{ExportRegistry, Server};
use parking_lot::{Condvar, Mutex};
use serde_json::{json, Value};

use crate::claims::OwnEndpoints;
use crate::config::{CacheSection, ConfigFile, CoreSection};
use crate::devices::{device_key, DeviceKey};
use crate::frontend::{Frontends, NbdFrontend};
use crate::metrics::MetricsServer;

mod caches;
mod casctl;
mod check;
mod configure;
mod control;
mod cores;
mod disconnect;
mod guards;
mod health;
mod info;
mod mirror;
mod nbd_limits;
mod pool;
mod purge;
mod requests;
mod startup;
mod watch;
use crate::protocol::Request;
use crate::safety::{Consent, Consents};
use crate::target::Target;
use caches::{abandon, check_signatures, cores_text, Start};
use configure::param_defaults;
use control::bind_control;
use cores::not_the_recorded_device;
use disconnect::Disconnected;
use info::{core_info, io_class_info};
pub use nbd_limits::{nbd_server_config, NbdLimits};
use requests::flush_retrying;

pub const DEFAULT_CONTROL: &str = "/run/hybridcache/control.sock";
pub const DEFAULT_NBD_SOCKET: &str = "/run/hybridcache/nbd.sock";
/// Requests in flight per NBD connection unless configured. A write hit is a cache-device write
/// that a worker waits for, so this is the queue depth the cache device sees for writes: at 4,
/// 4 KiB write hits at qd32 reached 0.26-0.29 of the raw file's IOPS, at 16 about twice that
/// (docs/performance.md §6). 16 is also nbdkit's default thread count.
pub const DEFAULT_NBD_WORKERS: usize = 16;
const MAX_CACHE_ID: u16 = 16384;
/// The ublk driver's own limit on hardware queues per device (UBLK_MAX_NR_QUEUES).
const MAX_UBLK_QUEUES: u16 = 4096;

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

struct MirrorEntry {
    device: String,
    key: Option<DeviceKey>,
    policy: MirrorLostPolicy,
    /// The state last logged, so that each change is logged once.
    logged: MirrorState,
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
    /// A mirrored cache's mirror device (claimed as the cache device is).
    mirror: Option<MirrorEntry>,
}

#[derive(Default)]
struct State {
    caches: BTreeMap<u16, CacheEntry>,
    /// Caches of the configuration file that are not running (yet).
    waiting: BTreeMap<u16, Waiting>,
    /// Caches taken away by `--script --disconnect-cache`, their exports kept.
    disconnected: BTreeMap<u16, Disconnected>,
    /// Cores added with `--try-add` before their cache runs (pool.rs).
    core_pool: Vec<pool::Pooled>,
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
            if let Some(m) = &c.mirror {
                if m.key.as_ref().is_some_and(|k| k.conflicts(key)) {
                    return Some(format!("the mirror of cache {id}"));
                }
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
        self.pool_user_of(key)
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

    /// One control request, dispatched. Requests that only read or reset what the registry
    /// holds (`-L`, `-P`, counter resets) are [`State`] handlers run under the state lock. The
    /// others are methods of the daemon because they need what the registry does not hold:
    /// devices opened under claims (guards.rs), the front-ends' exports and their clients, the
    /// state directory's store, block traces: cache lifecycle in caches.rs, core lifecycle in
    /// cores.rs, the configuration in configure.rs, running-cache requests in requests.rs,
    /// disconnect and connect in disconnect.rs.
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
                mirror,
                load_mirror,
                mirror_lost,
                fallback_pt_threshold,
                fallback_pt_window,
            } => {
                let mut fallback_pt = BTreeMap::new();
                if let Some(t) = fallback_pt_threshold {
                    fallback_pt.insert("threshold".to_string(), t.to_string());
                }
                if let Some(w) = fallback_pt_window {
                    fallback_pt.insert("window".to_string(), w.to_string());
                }
                // Refused before anything starts, so a bad value leaves no cache behind.
                let defaults = hybridcache_engine::FallbackPt::default();
                hybridcache_engine::FallbackPt {
                    threshold: fallback_pt_threshold.unwrap_or(defaults.threshold),
                    window_s: fallback_pt_window.unwrap_or(defaults.window_s),
                }
                .validate()
                .map_err(|e| e.to_string())?;
                if (load || load_mirror) && force {
                    return Err("--load and --force contradict each other: --force overwrites the cache that --load would load".into());
                }
                if load && load_mirror {
                    return Err("--load loads a cache from its cache device, --load-mirror from its mirror alone: give one".into());
                }
                let how = if load_mirror {
                    Start::LoadMirror
                } else if load {
                    Start::Load
                } else {
                    Start::Create { force }
                };
                let mirror = mirror.as_deref().map(|m| (m, mirror_lost.as_deref()));
                let started =
                    self.start_cache(&device, id, mode.as_deref(), line_size_kib, how, mirror)?;
                if !fallback_pt.is_empty() {
                    if let Some(id) = started["id"].as_u64().and_then(|i| u16::try_from(i).ok()) {
                        self.set_param(id, None, "fallback-pt", String::new(), fallback_pt)?;
                    }
                }
                Ok(self.attach_pooled_after_start(started))
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
                detach,
            } => {
                // casadm's -R -f: remove without flushing.
                let given = Consents::none()
                    .with(Consent::DiscardDirty, force)
                    .with(Consent::DisconnectClients, disconnect_clients);
                if detach {
                    self.detach_core(cache, core, &given)
                } else {
                    self.remove_core(cache, core, &given, inactive_only)
                }
            }
            Request::CasctlStart { config } => self.casctl_start(&config),
            Request::UpdateCorePath {
                cache,
                core,
                device,
            } => self.update_core_path(cache, core, &device),
            Request::DisconnectCache {
                id,
                no_flush,
                pass_through,
                detach,
            } => self.disconnect_cache(id, no_flush, pass_through || detach, detach),
            Request::ConnectCache { device, id, force } => self.connect_cache(&device, id, force),
            Request::CheckCacheDevice { device } => self.check_cache_device(&device),
            Request::TryAddCore {
                cache,
                core,
                device,
            } => self.try_add_core(cache, core, &device),
            Request::RemoveDetached { device } => self.remove_detached(&device),
            Request::AttachMirror {
                cache,
                device,
                force,
            } => self.attach_mirror(cache, &device, force),
            Request::PurgeCache { cache } => self.purge_cache(cache),
            Request::PurgeCore { cache, core } => self.purge_core(cache, core),
            Request::List => self.state.lock().list(&self.frontends),
            Request::Stats {
                cache,
                core,
                io_class,
            } => self
                .state
                .lock()
                .stats(&self.frontends, cache, core, io_class),
            Request::LoadIoClasses {
                cache,
                csv,
                ignore_unsupported,
            } => self.load_io_classes(cache, &csv, ignore_unsupported),
            Request::ListIoClasses { cache } => self.list_io_classes(cache),
            Request::ResetCounters { cache, core } => self.state.lock().reset_counters(cache, core),
            Request::SetCacheMode { cache, mode, flush } => {
                self.set_cache_mode(cache, &mode, flush)
            }
            Request::ZeroMetadata { device, force } => self.zero_metadata(&device, force),
            Request::InterruptFlush { cache } => self.interrupt_flush(cache),
            Request::Flush { cache, core } => self.flush(cache, core),
            Request::SetParam {
                cache,
                core,
                name,
                value,
                values,
            } => self.set_param(cache, core, &name, value, values),
            Request::GetParam { cache, core, name } => self.get_param(cache, core, &name),
            Request::Version => Ok(json!({ "version": env!("CARGO_PKG_VERSION") })),
            Request::Shutdown => self.stop_daemon(),
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
            MetricsServer::start(
                addr,
                Arc::new(move || view.state.lock().metrics_view(&view.frontends)),
            )
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
    control::spawn_accept(daemon.clone(), listener).context("cannot start the control thread")?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::DaemonSection;

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

//! `--script --disconnect-cache` and `--script --connect-cache` (Open CAS 26.09's hidden
//! script commands): take a cache device away and bring one back while the cache's exported
//! volumes stay, so clients (VMs, file systems) never see their devices go.
//!
//! Disconnect flushes (unless `--no-flush`), holds every request of the cache's exports
//! ([`Route::Frozen`], draining those in flight), stops the engine and lets go of the cache
//! device. The exports' requests then wait for the connect, bounded only by the client's own
//! timeout, as Open CAS freezes its exported objects' queues; or, with `--pass-through`, go to
//! the core devices directly. Pass-through needs a clean cache (flushed, so nothing written
//! meanwhile hides behind dirty data) and purges it (its metadata is wiped), so no line that
//! the cores have since overwritten can be served after the reconnect: Open CAS purges too.
//!
//! Connect loads the cache the device holds when it is the device the cache was disconnected
//! from (its identity, claims.rs/devices.rs, not only its path); a device without hybridcache
//! metadata gets a new cache with the disconnected cache's id, mode, line size, cores, IO
//! classes and parameters: that is how a cache device is replaced. (Open CAS's connect only
//! loads, and refuses a device without metadata; a new device there means stopping the cache.)
//! A cache disconnected with dirty data kept (`--no-flush`) only takes its own device back.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use hybridcache_engine::{Cache, CacheConfig, CacheMode, CoreRecord, CoreStatus, LineSize};
use hybridcache_volume::VolumeRef;
use serde_json::json;

use super::{
    abandon, check_signatures, core_info, engine_err, export_name, not_the_recorded_device,
    CacheEntry, CoreEntry, Daemon, Reply, Start, State,
};
use crate::config::{CacheSection, CoreSection};
use crate::devices::{device_key, DeviceKey};
use crate::frontend::Frontends;
use crate::params;
use crate::protocol::{self, CacheInfo};
use crate::target::{Route, Target};

/// How long a device the engine has just let go of may take to be free to claim again (a
/// background thread of the stopped cache may still hold a handle for a moment).
const RELEASE_WAIT: Duration = Duration::from_secs(3);

/// `-L`'s status of a disconnected cache: the word of casadm's "Successfully disconnected
/// cache" (casadm itself lists no cache once it is disconnected; here its exports stay, so it
/// stays listed).
pub(super) const DISCONNECTED: &str = "Disconnected";
/// casadm's word for a cache whose device was detached with `--detach-cache`.
pub(super) const DETACHED: &str = "Detached";

/// A cache whose engine is stopped while its cores' exports stay.
pub(super) struct Disconnected {
    /// The cache device it was disconnected from.
    device: String,
    key: Option<DeviceKey>,
    /// That device's identity: only it holds this cache's data.
    identity: Option<String>,
    /// Dirty lines left on `device` (`--no-flush`): no other device may be connected.
    dirty_lines: u64,
    /// The exports go to the cores directly (else their requests wait).
    pass_through: bool,
    /// Made by `--detach-cache` (casadm's verb; always pass-through): listed as `Detached`.
    detached: bool,
    mode: CacheMode,
    line_size: LineSize,
    /// Parameter groups (name, core, field values) to give a new cache on another device.
    settings: Vec<(&'static str, Option<u16>, BTreeMap<String, String>)>,
    io_classes: hybridcache_engine::ioclass::IoClasses,
    ioclass: (Option<std::path::PathBuf>, Option<bool>),
    /// The configuration file's `lazy_startup` for the cache (its cores keep theirs).
    lazy_startup: Option<bool>,
    cores: BTreeMap<u16, CoreEntry>,
    records: BTreeMap<u16, CoreRecord>,
}

pub(super) fn not_connected_text(id: u16, d: &Disconnected) -> String {
    format!(
        "cache {id} is disconnected (its exports are kept, their requests {}); connect a cache device with --script --connect-cache -d DEVICE ({} was its device), or stop it with -T -i {id}",
        if d.pass_through {
            "go to the cores"
        } else {
            "wait"
        },
        d.device
    )
}

impl Disconnected {
    fn targets(&self) -> impl Iterator<Item = (u16, &Target)> {
        self.cores
            .iter()
            .filter_map(|(j, c)| c.target.as_ref().map(|t| (*j, t)))
    }

    /// Who of this disconnected cache uses a device with this identity: its cores always (they
    /// come back with it), its cache device while it keeps dirty data there.
    pub(super) fn user_of(&self, id: u16, key: &DeviceKey) -> Option<String> {
        if self.dirty_lines > 0 && self.key.as_ref().is_some_and(|k| k.conflicts(key)) {
            return Some(format!(
                "the cache device of disconnected cache {id} (it keeps dirty data)"
            ));
        }
        self.core_user_of(id, key)
    }

    fn core_user_of(&self, id: u16, key: &DeviceKey) -> Option<String> {
        self.cores
            .iter()
            .find(|(_, c)| c.key.as_ref().is_some_and(|k| k.conflicts(key)))
            .map(|(j, _)| format!("core {j} of disconnected cache {id}"))
    }

    /// Whether `device` is the very device the cache was disconnected from.
    fn same_device(&self, device: &str) -> bool {
        match &self.identity {
            Some(want) => crate::devices::identity(device).as_deref() == Some(want.as_str()),
            None => device == self.device,
        }
    }

    /// Fail the requests held and let go of pass-through devices (stop, shutdown).
    pub(super) fn take_down(&self) {
        for (_, t) in self.targets() {
            drop(t.switch(Route::Gone));
        }
    }

    pub(super) fn info(&self, id: u16, frontends: &Frontends) -> CacheInfo {
        let status = if self.pass_through {
            "Pass-through"
        } else {
            "Frozen"
        };
        CacheInfo {
            id,
            device: self.device.clone(),
            status: if self.detached {
                DETACHED
            } else {
                DISCONNECTED
            }
            .into(),
            mode: if self.pass_through {
                "pt".into()
            } else {
                self.mode.to_string()
            },
            line_size_kib: self.line_size.kib(),
            lines: 0,
            cleaning: String::new(),
            promotion: String::new(),
            lazy_flush: String::new(),
            prefetch: String::new(),
            flush: None,
            dirty_for_s: None,
            inactive_cores: 0,
            metadata_bytes: 0,
            mirror: None,
            fallback: None,
            cores: self
                .cores
                .iter()
                .map(|(j, c)| {
                    let size = self.records.get(j).map(|r| r.size);
                    let mut info = core_info(id, *j, c, size, frontends);
                    info.status = status.into();
                    info
                })
                .collect(),
        }
    }

    /// The configuration file's entries: the cache as it was, so a restarted daemon loads it.
    pub(super) fn config(
        &self,
        id: u16,
        default_frontend: &str,
    ) -> (CacheSection, Vec<CoreSection>) {
        let mut values = BTreeMap::new();
        for (name, core, fields) in &self.settings {
            let in_config = params::find(name).is_ok_and(|g| g.in_config);
            if core.is_none() && in_config {
                for (k, v) in fields {
                    values.insert(format!("{name}.{k}"), v.clone());
                }
            }
        }
        let cache = CacheSection {
            id,
            device: self.device.clone(),
            line_size: Some(self.line_size.kib()),
            mode: Some(self.mode.to_string()),
            params: values,
            ioclass_file: self.ioclass.0.clone(),
            ioclass_ignore_unsupported: self.ioclass.1,
            lazy_startup: self.lazy_startup,
            mirror: None,
            mirror_lost: None,
        };
        let cores = self
            .cores
            .iter()
            .map(|(j, c)| CoreSection {
                cache: id,
                id: *j,
                device: c.device.clone(),
                frontend: (c.frontend != "nbd" || default_frontend != "nbd")
                    .then(|| c.frontend.to_string()),
                lazy_startup: c.lazy_startup,
            })
            .collect();
        (cache, cores)
    }
}

/// The settable parameter groups of `cache` as they are (the mode aside: it goes with the
/// cache's configuration).
fn settings_of(
    cache: &Cache,
    cores: &[u16],
) -> Vec<(&'static str, Option<u16>, BTreeMap<String, String>)> {
    let mut out = Vec::new();
    for g in params::GROUPS
        .iter()
        .filter(|g| g.set.is_some() && g.name != "cache-mode")
    {
        let scopes: Vec<Option<u16>> = if g.per_core {
            cores.iter().map(|j| Some(*j)).collect()
        } else {
            vec![None]
        };
        for core in scopes {
            if let Ok(values) = (g.get)(cache, core) {
                let fields = g
                    .fields
                    .iter()
                    .zip(values)
                    .map(|(f, v)| (f.key.to_string(), v))
                    .collect();
                out.push((g.name, core, fields));
            }
        }
    }
    out
}

impl Daemon {
    /// Claim a device the engine has just let go of, giving a stopped cache's last handles a
    /// moment to drop.
    pub(super) fn claim_released(&self, spec: &str) -> std::result::Result<VolumeRef, String> {
        let deadline = Instant::now() + RELEASE_WAIT;
        loop {
            match self.open_claimed(spec, false) {
                Ok(v) => return Ok(v),
                Err(e) if Instant::now() >= deadline => return Err(e),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    /// Send the exports of `d` to its cores; on failure their requests stay held.
    fn route_to_cores(&self, id: u16, d: &Disconnected) -> std::result::Result<(), String> {
        let mut volumes = Vec::new();
        for (j, t) in d.targets() {
            let device = d.cores.get(&j).map_or("", |c| c.device.as_str());
            let v = self.claim_released(device).map_err(|e| {
                format!("core {j} of cache {id} cannot be opened for pass-through: {e}")
            })?;
            volumes.push((t, v));
        }
        for (t, v) in volumes {
            drop(t.switch(Route::PassThrough(v)));
        }
        Ok(())
    }

    pub(super) fn disconnect_cache(
        &self,
        id: u16,
        no_flush: bool,
        pass_through: bool,
        detach: bool,
    ) -> Reply {
        if no_flush && pass_through {
            // casadm's refusal, word for word where it applies.
            return Err("pass-through mode requires a cache flush and purge to avoid stale data on reconnect: --no-flush is not allowed with --pass-through".into());
        }
        let mut st = self.state.lock();
        if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("the daemon is shutting down".into());
        }
        if st.disconnected.contains_key(&id) {
            return Err(format!("cache {id} is already disconnected"));
        }
        if let Some(w) = st.waiting.get(&id) {
            return Err(format!(
                "cache {id} is not running ({}: {})",
                w.status, w.section.device
            ));
        }
        let entry = st.cache(id)?;
        let cache = entry.cache.clone();
        let device = entry.device.clone();
        if let Some((j, _)) = entry.cores.iter().find(|(_, c)| !c.active) {
            return Err(format!(
                "cache {id} is incomplete (core {j} is inactive); as in Open CAS, an incomplete cache cannot be disconnected: attach or remove that core first"
            ));
        }
        // The engine holds a RAM core's only copy: once it lets go, the data is gone, and
        // opening the same spec again makes a new, empty one.
        if let Some((j, c)) = entry
            .cores
            .iter()
            .find(|(_, c)| c.device.starts_with("ram:") || c.device.starts_with("null:"))
        {
            return Err(format!(
                "core {j} of cache {id} is on {}, whose data lives only while the cache holds it: the cache cannot be disconnected (nothing changed)",
                c.device
            ));
        }
        if no_flush && !cache.persistent() {
            return Err(format!(
                "cache {id} on {device} keeps its metadata in RAM only: its dirty data cannot outlive the disconnect, so --no-flush is refused; disconnect it without --no-flush"
            ));
        }
        let mut targets = Vec::new();
        for (j, c) in &entry.cores {
            let t = c
                .target
                .clone()
                .ok_or_else(|| format!("core {j} of cache {id} has no export to keep"))?;
            targets.push((*j, t));
        }
        if !no_flush {
            // While the cache still serves: the bulk of the dirty data goes before any request
            // is held, and a failure here changes nothing.
            cache.flush().map_err(|e| {
                format!(
                    "cache {id} was not disconnected: flushing failed: {}",
                    engine_err(e)
                )
            })?;
        }
        // Each switch waits for the requests in flight; those after it wait for the route.
        for (_, t) in &targets {
            drop(t.switch(Route::Frozen));
        }
        let serve_again = |why: String| -> Reply {
            for (j, t) in &targets {
                match cache.core(*j) {
                    Ok(core) => drop(t.switch(Route::Cache(core))),
                    Err(e) => tracing::error!(
                        "cache {id}: core {j}'s export cannot be served again: {}",
                        engine_err(e)
                    ),
                }
            }
            Err(why)
        };
        if !no_flush {
            // What was written between the first flush and the freeze.
            if let Err(e) = cache.flush() {
                return serve_again(format!(
                    "cache {id} was not disconnected: flushing failed: {}",
                    engine_err(e)
                ));
            }
        }
        let dirty = cache.stats().usage.dirty_lines;
        if pass_through && dirty != 0 {
            return serve_again(format!(
                "cache {id} still holds {dirty} dirty lines after its flush; pass-through needs a clean cache (nothing changed)"
            ));
        }
        let core_ids: Vec<u16> = entry.cores.keys().copied().collect();
        let settings = settings_of(&cache, &core_ids);
        let io_classes = (*cache.io_classes()).clone();
        let records: BTreeMap<u16, CoreRecord> = core_ids
            .iter()
            .filter_map(|j| cache.core_record(*j).map(|r| (*j, r)))
            .collect();
        let mode = cache.mode();
        let line_size = cache.line_size();
        let persistent = cache.persistent();
        let stopped = cache.stop(!no_flush);
        let dirty_lines = cache.stats().usage.dirty_lines;
        let Some(entry) = st.caches.remove(&id) else {
            return Err(format!("cache {id} does not exist"));
        };
        let CacheEntry {
            cache: engine,
            key,
            cores,
            ioclass,
            lazy_startup,
            ..
        } = entry;
        // The engine lets go of the cache and core devices once its last handle is gone.
        drop(engine);
        drop(cache);
        let mut d = Disconnected {
            identity: crate::devices::identity(&device),
            device: device.clone(),
            key,
            dirty_lines,
            pass_through: false,
            detached: detach,
            mode,
            line_size,
            settings,
            io_classes,
            ioclass,
            lazy_startup,
            cores,
            records,
        };
        let mut problem = stopped.err().map(|e| {
            format!(
                "cache {id} was disconnected, but stopping it reported: {}; its requests wait: connect {device} to load it as after a crash",
                engine_err(e)
            )
        });
        if pass_through && problem.is_none() {
            // The purge: nothing the cache holds may be served after the cores change under
            // it. A volatile cache forgets by itself.
            let purged = if persistent {
                self.claim_released(&device)
                    .and_then(|v| hybridcache_engine::zero_metadata(&*v).map_err(engine_err))
            } else {
                Ok(())
            };
            match purged.and_then(|()| self.route_to_cores(id, &d)) {
                Ok(()) => d.pass_through = true,
                Err(e) => {
                    problem = Some(format!(
                        "cache {id} was disconnected, but not into pass-through ({e}); its requests wait for --script --connect-cache"
                    ))
                }
            }
        }
        st.disconnected.insert(id, d);
        self.save_locked(&st);
        tracing::info!(
            "disconnected cache {id} from {device}{}; its exports stay, their requests {}",
            if dirty_lines > 0 {
                format!(" ({dirty_lines} dirty lines kept there)")
            } else {
                String::new()
            },
            if st.disconnected.get(&id).is_some_and(|d| d.pass_through) {
                "go to the cores"
            } else {
                "wait"
            }
        );
        match problem {
            Some(p) => {
                tracing::error!("{p}");
                Err(p)
            }
            None => Ok(json!({})),
        }
    }

    pub(super) fn connect_cache(&self, device: &str, want: Option<u16>, force: bool) -> Reply {
        let mut st = self.state.lock();
        if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("the daemon is shutting down".into());
        }
        // A running mirrored cache is not disconnected: the device is a new primary (mirror.rs).
        if let Some(c) = want.and_then(|w| st.caches.get(&w)) {
            let id = c.cache.id();
            if c.mirror.is_none() {
                return Err(format!(
                    "cache {id} is running (not detached or disconnected) and has no mirror: a cache device is attached to a detached cache, or as a new primary to a mirrored cache whose primary is lost"
                ));
            }
            drop(st);
            return self.attach_primary(id, device, force);
        }
        if st.disconnected.is_empty() {
            return Err("no cache is disconnected".into());
        }
        if let Some(w) = want {
            if !st.disconnected.contains_key(&w) {
                return Err(if st.caches.contains_key(&w) {
                    format!("cache {w} is not disconnected")
                } else {
                    format!("cache {w} does not exist")
                });
            }
        }
        // In use by a running cache, or as a core of a disconnected one: refused. Its own
        // disconnected cache's claim on it is what this is about to settle.
        let key = device_key(device);
        if let Some(k) = &key {
            for (id, c) in &st.caches {
                if c.key.as_ref().is_some_and(|ck| ck.conflicts(k)) {
                    return Err(format!(
                        "{device} is already in use as the cache device of cache {id}"
                    ));
                }
                if let Some((j, _)) = c
                    .cores
                    .iter()
                    .find(|(_, e)| e.key.as_ref().is_some_and(|ek| ek.conflicts(k)))
                {
                    return Err(format!(
                        "{device} is already in use as core {j} of cache {id}"
                    ));
                }
            }
            for (id, d) in &st.disconnected {
                if let Some(user) = d.core_user_of(*id, k) {
                    return Err(format!("{device} is already in use as {user}"));
                }
            }
        }
        let volatile = device.starts_with("ram:") || device.starts_with("null:");
        let volume = self.open_claimed(device, false)?;
        let held = if volatile {
            None
        } else {
            match Cache::peek(&*volume) {
                Ok(sb) => Some(sb),
                Err(hybridcache_engine::EngineError::NoCache(_)) => None,
                Err(e) => return Err(format!("{device}: {}", engine_err(e))),
            }
        };
        // `--attach-cache -f` formats over metadata that is not a disconnected cache's own
        // (another cache's, a copy), as `-S --force` would; a disconnected cache's own device is
        // always loaded, so its data is never formatted away.
        let held = match held {
            Some(sb)
                if force
                    && !st
                        .disconnected
                        .get(&sb.cache_id)
                        .is_some_and(|d| d.same_device(device)) =>
            {
                None
            }
            held => held,
        };
        let id = match &held {
            Some(sb) => {
                let id = sb.cache_id;
                let Some(d) = st.disconnected.get(&id) else {
                    return Err(format!(
                        "{device} holds cache {id}, which is not disconnected (nothing changed)"
                    ));
                };
                if want.is_some_and(|w| w != id) {
                    return Err(format!(
                        "{device} holds cache {id}, not cache {}",
                        want.unwrap_or(0)
                    ));
                }
                if !d.same_device(device) {
                    // A copy of the cache's metadata elsewhere (a cloned or an old device)
                    // would serve data the cores have since moved past.
                    return Err(format!(
                        "{device} holds hybridcache metadata of cache {id} but is not the device cache {id} was disconnected from ({}); connect that one, or wipe this one with --zero-metadata to connect it as a new cache device (nothing changed)",
                        d.device
                    ));
                }
                id
            }
            None => {
                let id = match want {
                    Some(w) => w,
                    None => {
                        let ids: Vec<String> =
                            st.disconnected.keys().map(|i| i.to_string()).collect();
                        match ids.as_slice() {
                            [_] => st.disconnected.keys().next().copied().unwrap_or(0),
                            _ => {
                                return Err(format!(
                                    "{device} holds no cache and caches {} are disconnected: name the one it is to serve with -i",
                                    ids.join(", ")
                                ))
                            }
                        }
                    }
                };
                let Some(d) = st.disconnected.get(&id) else {
                    return Err(format!("cache {id} is not disconnected"));
                };
                if d.dirty_lines > 0 {
                    return Err(format!(
                        "cache {id} was disconnected with --no-flush and keeps {} dirty lines on {}; only that device can be connected ({device} is not it; nothing changed)",
                        d.dirty_lines, d.device
                    ));
                }
                // Forced (`--attach-cache -f`), a signature is overwritten as by `-S --force`;
                // the claim above still refuses a mounted or busy device.
                if !volatile && !force {
                    check_signatures(device, &*volume, Start::Create { force })?;
                }
                id
            }
        };
        let Some(d) = st.disconnected.remove(&id) else {
            return Err(format!("cache {id} is not disconnected"));
        };
        // Requests in flight on the cores finish; the pass-through devices are let go, so the
        // cache can claim them.
        for (_, t) in d.targets() {
            drop(t.switch(Route::Frozen));
        }
        let built = if held.is_some() {
            self.load_disconnected(id, &d, device, volume)
        } else {
            self.start_disconnected(id, &d, device, volume, volatile, force)
        };
        let cache = match built {
            Ok(cache) => cache,
            Err(e) => {
                if d.pass_through {
                    if let Err(again) = self.route_to_cores(id, &d) {
                        tracing::error!("{again}; its requests wait");
                    }
                }
                st.disconnected.insert(id, d);
                return Err(format!("{e} (cache {id} stays disconnected)"));
            }
        };
        for (j, t) in d.targets() {
            match cache.core(j) {
                Ok(core) => drop(t.switch(Route::Cache(core))),
                // Checked by load/start: every core is there and active.
                Err(e) => tracing::error!("cache {id}: core {j}: {}", engine_err(e)),
            }
        }
        let loaded = held.is_some();
        let Disconnected {
            cores,
            ioclass,
            lazy_startup,
            ..
        } = d;
        for (j, c) in &cores {
            self.kinds.set(&export_name(id, *j), device, c.frontend);
        }
        st.caches.insert(
            id,
            CacheEntry {
                cache,
                device: device.to_string(),
                key,
                cores,
                ioclass,
                lazy_startup,
                mirror: None,
            },
        );
        self.save_locked(&st);
        tracing::info!(
            "connected cache {id}: {} {device}; its exports are served by it again",
            if loaded {
                "loaded from"
            } else {
                "a new cache on"
            }
        );
        serde_json::to_value(protocol::Connected { id, loaded }).map_err(|e| e.to_string())
    }

    /// Load the cache `volume` holds: every core of `d` must come back active.
    fn load_disconnected(
        &self,
        id: u16,
        d: &Disconnected,
        device: &str,
        volume: VolumeRef,
    ) -> std::result::Result<Cache, String> {
        let mut notes = BTreeMap::new();
        let mut open_core = |rec: &CoreRecord| -> Option<VolumeRef> {
            match self.claim_released(&rec.path) {
                Ok(v) => match not_the_recorded_device(rec, &rec.path) {
                    None => Some(v),
                    Some(why) => {
                        notes.insert(rec.id, why);
                        None
                    }
                },
                Err(e) => {
                    notes.insert(rec.id, e);
                    None
                }
            }
        };
        let cache = Cache::load(volume, &mut open_core)
            .map_err(|e| format!("cannot load the cache on {device}: {}", engine_err(e)))?;
        let problem = if cache.id() != id {
            Some(format!(
                "{device} holds cache {}, not cache {id}",
                cache.id()
            ))
        } else {
            let active: Vec<u16> = cache
                .cores()
                .iter()
                .filter(|c| c.status == CoreStatus::Active)
                .map(|c| c.id)
                .collect();
            d.cores.keys().find(|j| !active.contains(j)).map(|j| {
                format!(
                    "core {j} of cache {id} did not come back: {}",
                    notes
                        .get(j)
                        .map_or("not recorded on the device", String::as_str)
                )
            })
        };
        if let Some(p) = problem {
            abandon(&cache);
            return Err(p);
        }
        Ok(cache)
    }

    /// A new cache on `volume` (no hybridcache metadata) with `d`'s configuration and cores.
    fn start_disconnected(
        &self,
        id: u16,
        d: &Disconnected,
        device: &str,
        volume: VolumeRef,
        volatile: bool,
        force: bool,
    ) -> std::result::Result<Cache, String> {
        // The cores first: a core that cannot be opened leaves the new device untouched.
        let mut cores = Vec::new();
        for (j, c) in &d.cores {
            let v = self
                .claim_released(&c.device)
                .map_err(|e| format!("core {j}: {e}"))?;
            if let Some(why) = d
                .records
                .get(j)
                .and_then(|rec| not_the_recorded_device(rec, &c.device))
            {
                return Err(format!("core {j}: {why}"));
            }
            cores.push((*j, v, crate::devices::identity(&c.device)));
        }
        let config = CacheConfig {
            id,
            line_size: d.line_size,
            mode: d.mode,
        };
        let cache = if volatile {
            Cache::new(volume, config)
        } else {
            Cache::create(volume, config, force)
        }
        .map_err(|e| format!("{device}: {}", engine_err(e)))?;
        for (j, v, identity) in cores {
            if let Err(e) = cache.add_identified_core(v, Some(j), identity) {
                // Leave the device as it was found: without metadata.
                let _ = cache.stop(false);
                drop(cache);
                if !volatile {
                    if let Err(z) = self
                        .claim_released(device)
                        .and_then(|v| hybridcache_engine::zero_metadata(&*v).map_err(engine_err))
                    {
                        tracing::warn!(
                            "{device}: wiping the new cache's metadata again failed: {z}"
                        );
                    }
                }
                return Err(format!("core {j}: {}", engine_err(e)));
            }
        }
        // The settings follow the cache to its new device; one that does not take is logged,
        // not fatal: the exports matter more.
        if let Err(e) = cache.load_io_classes(d.io_classes.clone()) {
            tracing::warn!("cache {id}: IO classes not carried over: {}", engine_err(e));
        }
        for (name, core, values) in &d.settings {
            if let Some(set) = params::find(name).ok().and_then(|g| g.set) {
                if let Err(e) = set(&cache, *core, values) {
                    tracing::warn!("cache {id}: {name} not carried over: {e}");
                }
            }
        }
        Ok(cache)
    }

    /// Fail the requests held for disconnected caches (the daemon is stopping).
    pub(super) fn release_held(&self) {
        let st = self.state.lock();
        for d in st.disconnected.values() {
            d.take_down();
        }
    }

    /// `-T` on a disconnected cache: its kept exports go (their held requests fail); the
    /// cache is dropped from the setup. Dirty data kept on its device stays there for a later
    /// `start-cache --load`.
    pub(super) fn stop_disconnected(
        &self,
        st: &mut State,
        id: u16,
        given: &crate::safety::Consents,
    ) -> Reply {
        use crate::safety::{self, Consent};
        let Some(d) = st.disconnected.get(&id) else {
            return Err(format!("cache {id} does not exist"));
        };
        let names: Vec<(String, &'static str)> = d
            .cores
            .iter()
            .map(|(j, c)| (export_name(id, *j), c.frontend))
            .collect();
        let what = format!("stopping disconnected cache {id}");
        let clients = self.clients_of(&names, !given.gives(Consent::DisconnectClients));
        let accepted = safety::decide(&what, clients, given)?;
        self.traces.cache_stopped(&self.registry, id);
        d.take_down();
        for (name, kind) in &names {
            if let Ok(f) = self.frontends.get(Some(kind)) {
                f.stop(name);
            }
        }
        let dirty = d.dirty_lines;
        let device = d.device.clone();
        // Its dirty data stays on the cache device: the next start must load it, as after -T -n
        // of a running cache, or its cores would be left without their newest data.
        if let (Some(store), true) = (&self.store, dirty > 0) {
            let (cache, cores) = d.config(id, self.frontends.default_kind());
            store.stopped_dirty(crate::state::StoppedCache {
                cache,
                cores,
                dirty_lines: dirty,
            });
        }
        st.disconnected.remove(&id);
        self.save_locked(st);
        tracing::info!(
            "stopped disconnected cache {id}{}",
            if dirty > 0 {
                format!(" ({dirty} dirty lines kept on {device}: load it with start-cache --load)")
            } else {
                String::new()
            }
        );
        Ok(json!({ "losses": safety::record(&what, &accepted) }))
    }
}

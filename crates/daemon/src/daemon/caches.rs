//! Cache lifecycle: `start-cache` (create, `--load`, or the configuration file's load-or-create),
//! loading what a cache device holds, `-T` (stop), and the daemon's shutdown, which stops them all.
//!
//! These handlers are methods of [`Daemon`], not of [`State`]: besides the registry they open
//! devices under claims (`open_claimed`, which refuses the daemon's own exports), start and stop
//! exports on the front-ends, record the setup in the state directory, and end block traces.
//! Each takes the state lock itself and holds it from its checks to its last change, so no other
//! request sees a cache half started or half stopped.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use hybridcache_engine::{
    Cache, CacheConfig, CacheMode, CoreRecord, CoreStatus, EngineError, LineSize, MirrorLostPolicy,
    MirrorState,
};
use hybridcache_volume::VolumeRef;
use serde_json::json;

use super::{
    engine_err, export_name, flush_retrying, not_the_recorded_device, CacheEntry, CoreEntry,
    Daemon, MirrorEntry, Reply, State, MAX_CACHE_ID,
};
use crate::devices::{device_key, DeviceKey};
use crate::frontend::{ExportSpec, Frontend};
use crate::nbd_volume::is_nbd_uri;
use crate::protocol;
use crate::safety::{self, Consent, Consents, Loss};
use crate::target::Target;

/// How `start-cache` gets its cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Start {
    /// A new cache; `force` overwrites a cache the device holds.
    Create { force: bool },
    /// The cache the device holds (`--load`).
    Load,
    /// The configuration file: load the cache the device holds, create one otherwise.
    LoadOrCreate,
    /// The cache whose mirror the device is, from the mirror alone (`--load-mirror`).
    LoadMirror,
}

/// Which devices a load takes a cache from.
enum LoadFrom {
    /// The cache device alone.
    Device,
    /// The primary with its mirror: (device, its claim key, volume, policy).
    Mirrored(String, Option<DeviceKey>, VolumeRef, MirrorLostPolicy),
    /// The mirror alone.
    MirrorAlone,
}

/// Give up a cache just loaded: stop it keeping its dirty data, so it loads again later.
pub(super) fn abandon(cache: &Cache) {
    if let Err(e) = cache.stop(false) {
        tracing::warn!(
            "releasing cache {} again failed: {}",
            cache.id(),
            engine_err(e)
        );
    }
}

/// What formatting `device` as a new cache destroys: the cache it holds (with its dirty lines,
/// read from its metadata without loading it), hybridcache metadata that cannot be read, or a
/// file system or other signature (signature.rs).
pub(super) fn device_losses(
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
pub(super) fn check_signatures(
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

/// A cache's cores as its superblock records them, for a refusal ("1 (/dev/sdb)").
pub(super) fn cores_text(sb: &hybridcache_engine::Superblock) -> String {
    sb.cores
        .iter()
        .map(|c| format!("{} ({})", c.id, c.path))
        .collect::<Vec<_>>()
        .join(", ")
}

impl Daemon {
    pub(super) fn start_cache(
        &self,
        device: &str,
        id: Option<u16>,
        mode: Option<&str>,
        line_kib: Option<u32>,
        how: Start,
        mirror: Option<(&str, Option<&str>)>,
    ) -> Reply {
        let policy: MirrorLostPolicy = match mirror.and_then(|(_, p)| p) {
            Some(p) => p.parse()?,
            None => MirrorLostPolicy::default(),
        };
        let mirror = mirror.map(|(m, _)| m);
        let mut st = self.state.lock();
        // The device watcher calls this outside `handle`: once shutdown holds the lock no cache
        // may start, or it would escape the shutdown's flush.
        if self.stopping.load(Ordering::SeqCst) {
            return Err("the daemon is shutting down".into());
        }
        if let Some(id) = id {
            if id == 0 || id > MAX_CACHE_ID {
                return Err(format!("cache id {id} is out of range (1..{MAX_CACHE_ID})"));
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
        if volatile && (mirror.is_some() || how == Start::LoadMirror) {
            return Err(format!(
                "{device} keeps its metadata in RAM: a volatile cache has nothing a mirror could keep"
            ));
        }
        if mirror == Some(device) {
            return Err(format!("{device} cannot be its own mirror"));
        }
        if how == Start::LoadMirror {
            if mode.is_some() || line_kib.is_some() {
                return Err("--load-mirror takes the cache mode and line size recorded on the mirror; omit -c and -x".into());
            }
            if mirror.is_some() {
                return Err("--load-mirror brings the cache up from its mirror (-d) alone; giving it a new primary (--mirror) is not supported yet".into());
            }
            let key = st.check_free(device)?;
            let volume = self.open_claimed(device, false)?;
            let loaded = self.load_locked(&mut st, device, key, id, volume, LoadFrom::MirrorAlone);
            if let Err(e) = &loaded {
                self.abandon_exports(device, e);
            }
            return loaded;
        }
        // The mirror is claimed as the cache device is: nothing else may write it.
        let mirror_volume = match mirror {
            Some(m) => {
                let mkey = st.check_free(m)?;
                Some((m, mkey, self.open_claimed(m, false)?))
            }
            None => None,
        };
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
            let from = match mirror_volume {
                Some((m, mkey, mv)) => LoadFrom::Mirrored(m.to_string(), mkey, mv, policy),
                None => LoadFrom::Device,
            };
            let loaded = self.load_locked(&mut st, device, key, id, volume, from);
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
                let mut losses = device_losses(device, &*volume)?;
                if let Some((m, _, mv)) = &mirror_volume {
                    losses.extend(device_losses(m, &**mv)?);
                }
                safety::decide(&what, losses, &given)?
            }
            Start::LoadOrCreate if !volatile => {
                check_signatures(device, &*volume, how)?;
                if let Some((m, _, mv)) = &mirror_volume {
                    check_signatures(m, &**mv, how)?;
                }
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
            let created = match &mirror_volume {
                Some((_, _, mv)) => {
                    Cache::create_mirrored(volume.clone(), mv.clone(), config, force, policy)
                }
                None => Cache::create(volume.clone(), config, force),
            };
            match created {
                Err(EngineError::ExistingCache { .. }) if how == Start::LoadOrCreate => {
                    let from = match mirror_volume {
                        Some((m, mkey, mv)) => LoadFrom::Mirrored(m.to_string(), mkey, mv, policy),
                        None => LoadFrom::Device,
                    };
                    return self.load_locked(&mut st, device, key, Some(id), volume, from);
                }
                other => other,
            }
        };
        let cache = created.map_err(|e| match e {
            EngineError::CacheTooSmall { bytes, line } => too_small(device, bytes, line, volatile),
            e => format!("{device}: {}", engine_err(e)),
        })?;
        let persistent = cache.persistent();
        let mirror = mirror_volume.map(|(m, mkey, _)| MirrorEntry {
            device: m.to_string(),
            key: mkey,
            policy,
            logged: MirrorState::Redundant,
        });
        // A smaller mirror covers the first lines only, and dirty data is kept to them: the
        // operator learns how much write-back room that leaves.
        let covers = cache.mirror_status().and_then(|s| {
            (s.lines < cache.line_count()).then(|| {
                format!(
                    "; it covers {} of the cache's {} lines ({} bytes with the metadata): dirty data is kept to them, and writes wait for cleaning when they are all dirty",
                    crate::safety::count_text(s.lines),
                    crate::safety::count_text(cache.line_count()),
                    s.bytes
                )
            })
        });
        let mirror_note = mirror.as_ref().map(|m| {
            format!(
                "cache {id} is mirrored on {}{}",
                m.device,
                covers.as_deref().unwrap_or("")
            )
        });
        let mirrored = mirror
            .as_ref()
            .map(|m| {
                format!(
                    ", mirrored on {}{}",
                    m.device,
                    covers.as_deref().unwrap_or("")
                )
            })
            .unwrap_or_default();
        st.caches.insert(
            id,
            CacheEntry {
                cache,
                device: device.to_string(),
                key,
                cores: BTreeMap::new(),
                ioclass: (None, None),
                lazy_startup: None,
                mirror,
            },
        );
        self.save_locked(&st);
        tracing::info!(
            "started {} cache {id} on {device} ({mode}, {} KiB lines{mirrored})",
            if persistent { "persistent" } else { "volatile" },
            line_size.kib()
        );
        let mut started = serde_json::to_value(protocol::Started {
            id,
            loaded: false,
            inactive: Vec::new(),
            why_inactive: Default::default(),
            mirror: mirror_note,
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
        from: LoadFrom,
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
            match &from {
                LoadFrom::Device => Cache::load(volume, &mut open_core),
                LoadFrom::Mirrored(_, _, mv, policy) => {
                    Cache::load_mirrored(volume, mv.clone(), &mut open_core, *policy)
                }
                LoadFrom::MirrorAlone => Cache::load_mirror(volume, &mut open_core),
            }
        };
        let cache =
            loaded.map_err(|e| format!("cannot load the cache on {device}: {}", engine_err(e)))?;
        if matches!(from, LoadFrom::MirrorAlone) {
            tracing::warn!(
                "cache {} brought up from its mirror {device} alone: every dirty line it recorded is back; clean lines were not on it and are read from the cores again; the cache runs on {device} without a mirror",
                cache.id()
            );
        }
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
        let mirror = match from {
            LoadFrom::Mirrored(m, mkey, _, policy) => Some(MirrorEntry {
                device: m,
                key: mkey,
                policy,
                logged: MirrorState::Redundant,
            }),
            _ => None,
        };
        st.caches.insert(
            id,
            CacheEntry {
                cache,
                device: device.to_string(),
                key,
                cores,
                ioclass: (None, None),
                lazy_startup: None,
                mirror,
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
            mirror: None,
        })
        .map_err(|e| e.to_string())
    }

    /// `-T`: connected clients are the only loss (dirty data is flushed, or with `-n` kept on
    /// the cache device for the next load), so `--disconnect-clients` is the only consent.
    pub(super) fn stop_cache(&self, id: u16, no_data_flush: bool, given: &Consents) -> Reply {
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
    pub(super) fn abandon_exports(&self, device: &str, why: &str) {
        for f in self.frontends.all() {
            f.abandon(device, why);
        }
    }

    /// `stop-daemon`: the reply waits for the shutdown's outcome.
    pub(super) fn stop_daemon(&self) -> Reply {
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

    /// Stop every cache, flushing its dirty data; returns false if some dirty data could not be
    /// written (it is then kept on the cache device where the cache is persistent).
    pub(super) fn shutdown(&self) -> bool {
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

/// What a persistent cache device holds besides its lines: the two 1 MiB superblock slots, then
/// the per-line metadata, rounded up to a MiB so that lines stay aligned (docs/format.md). For
/// one line that metadata is a few sectors, so the smallest cache device is this plus one line
/// (crates/cli/tests/casadm_compat.rs starts one of exactly that size and one a sector smaller).
const PERSISTENT_OVERHEAD: u64 = 3 << 20;

/// A cache device too small for one line: the refusal says how large it must be at least.
fn too_small(device: &str, bytes: u64, line: u32, volatile: bool) -> String {
    let line = u64::from(line);
    let (min, what) = if volatile {
        (line, "one line")
    } else {
        (
            PERSISTENT_OVERHEAD + line,
            "3 MiB of superblock and metadata, and one line",
        )
    };
    format!(
        "{device} is too small for a cache: it holds {} bytes, and a {} cache with {} KiB lines \
         needs at least {} bytes ({what})",
        safety::count_text(bytes),
        if volatile { "volatile" } else { "persistent" },
        line / 1024,
        safety::count_text(min),
    )
}

impl Daemon {
    /// Log a cache's fall back to pass-through once, with its error count, and each dirty
    /// range found unreadable (the data lost unless the device heals), as they are found.
    pub(super) fn fallback_tick(&self) {
        let st = self.state.lock();
        for (id, c) in st.caches.iter() {
            if let Some(errors) = c.cache.take_fallback_entered() {
                let p = c.cache.fallback_pt();
                let dirty = c.cache.stats().usage.dirty_lines;
                tracing::error!(
                    "cache {id}: {errors} errors of the cache device {} within {} s reached the fallback-pt threshold {}: new I/O goes pass-through to the cores; its {dirty} dirty lines ({} bytes) are still read from it; `-Z -i {id}` (reset counters) or a higher threshold caches again",
                    c.device,
                    p.window_s,
                    p.threshold,
                    dirty * c.cache.line_size().bytes() as u64,
                );
            }
            for u in c.cache.take_unreadable_dirty() {
                tracing::error!(
                    "cache {id}: dirty data unreadable on the cache device {}: core {} offset {} length {} bytes",
                    c.device,
                    u.core,
                    u.core_offset,
                    u.len,
                );
            }
        }
    }

    /// Log each change of a mirrored cache's state once, saying what is at risk: ERROR when
    /// the primary is lost (the dirty lines are on the mirror alone), WARN when the mirror is.
    pub(super) fn mirror_tick(&self) {
        let mut st = self.state.lock();
        for (id, c) in st.caches.iter_mut() {
            let (Some(m), Some(status)) = (c.mirror.as_mut(), c.cache.mirror_status()) else {
                continue;
            };
            if status.state == m.logged {
                continue;
            }
            m.logged = status.state;
            let usage = c.cache.stats().usage;
            let dirty = usage.dirty_lines;
            let bytes = dirty * c.cache.line_size().bytes() as u64;
            let why = status.reason.unwrap_or_default();
            match status.state {
                MirrorState::PrimaryLost => tracing::error!(
                    "cache {id}: primary lost ({why}); its {dirty} dirty lines ({bytes} bytes) are on the mirror {} alone: served from it and drained to the cores; the cache serves as pass-through until a new primary is attached (--attach-cache) or it is loaded again",
                    m.device
                ),
                MirrorState::MirrorLost => tracing::warn!(
                    "cache {id}: mirror lost ({why}); its {dirty} dirty lines ({bytes} bytes) are on {} alone{}",
                    c.device,
                    match m.policy {
                        MirrorLostPolicy::Drain => ": draining them to the cores, write-through from now on",
                        MirrorLostPolicy::Keep => ", and write-back goes on unprotected (mirror_lost = keep)",
                    }
                ),
                MirrorState::Rebuilding => tracing::info!(
                    "cache {id}: rebuilding its mirror onto {}: {dirty} dirty lines ({bytes} bytes) to copy",
                    status.device
                ),
                MirrorState::RebuildingPrimary => tracing::info!(
                    "cache {id}: filling its new primary {} from its mirror {}: {dirty} dirty lines ({bytes} bytes) to copy",
                    c.device,
                    m.device
                ),
                MirrorState::Redundant => {}
            }
        }
    }
}

//! Configuration: the configuration file applied as one transaction (checked whole first,
//! daemon/check.rs), each of its caches started with its parameters, IO classes and cores, the
//! devices the file does not let start lazily waited for, and the running setup recorded in the
//! state directory after each change (state.rs) or exported in the file's format (`config
//! export`).
//!
//! Recording and export read only the registry ([`State::to_config`], `cache_config`); the
//! methods of [`Daemon`] here add what the registry does not hold: the state directory's store,
//! the operator's file as read at start, the front-ends (their default kind), and the starting
//! and adding of caches and cores.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use hybridcache_engine::{Cache, CacheConfig, CacheMode, LineSize};
use serde_json::json;

use super::{
    check, engine_err, export_name, startup, CacheEntry, CoreEntry, Daemon, Reply, Start, State,
    Waiting, WAITING_FOR_DEVICE,
};
use crate::config::{CacheSection, ConfigFile, CoreSection, DaemonSection};
use crate::devices::is_missing;
use crate::params;

/// The parameter values (`GROUP.FIELD`) a new cache of this mode and line size has, from a
/// scratch cache in RAM; empty if none can be made (then every value counts as set).
pub(super) fn param_defaults(
    mode: Option<&str>,
    line_kib: Option<u32>,
) -> BTreeMap<String, String> {
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
        // As set: a mirrored cache that lost a device serves in another mode meanwhile.
        mode: Some(c.cache.configured_mode().to_string()),
        params,
        ioclass_file: c.ioclass.0.clone(),
        ioclass_ignore_unsupported: c.ioclass.1,
        lazy_startup: c.lazy_startup,
        mirror: c.mirror.as_ref().map(|m| m.device.clone()),
        mirror_lost: c.mirror.as_ref().map(|m| m.policy.as_str().to_string()),
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

impl State {
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

impl Daemon {
    pub(super) fn save(&self) {
        let st = self.state.lock();
        self.save_locked(&st);
    }

    /// Record the setup as it runs now in the state directory (state.rs), so a restart
    /// brings it back. The configuration file is never written.
    pub(super) fn save_locked(&self, st: &State) {
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
    pub(super) fn note_stop(&self, st: &State, id: u16) {
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
    pub(super) fn export_config(&self) -> Reply {
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
    pub(super) fn apply(
        &self,
        cfg: &ConfigFile,
        load_only: &std::collections::BTreeSet<u16>,
    ) -> Result<()> {
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
    pub(super) fn check_file(&self, cfg: &ConfigFile) -> Result<()> {
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
    pub(super) fn wait_for_devices(
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
    pub(super) fn start_configured(
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
        let mirror = c.mirror.as_deref().map(|m| (m, c.mirror_lost.as_deref()));
        self.start_cache(&c.device, Some(c.id), mode, line_size, how, mirror)?;
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
}

//! The core pool: cores added with `--script --add-core --try-add` before their cache runs, kept
//! detached until it does, as Open CAS keeps them (OCF's `ocf_mngt_core_pool_add`, used by
//! casadm's `--try-add` when the cache does not exist; casctl and Open CAS's udev rules add cores
//! this way at boot, whichever device comes first).
//!
//! With the cache running, `--try-add` only attaches a core its metadata records and that is not
//! active (OCF's `_ocf_mngt_cache_try_add_core`); it never adds a new one. Without it, the core
//! waits in the pool, listed by `-L` under `core pool` as `Detached`, until its cache is started
//! or loaded: if that cache records the core (by id) as inactive, the pooled device is attached
//! to it, as a load takes a pooled core in Open CAS. `--remove-detached -d DEV` takes a device
//! out of the pool. Like Open CAS's (kernel memory), the pool does not outlive the daemon.
//!
//! A pooled device is counted as in use: no cache or core may be started on it meanwhile.

use serde_json::{json, Value};

use super::{Daemon, Reply, State};
use crate::devices::{device_key, is_missing, DeviceKey};

/// A core device waiting in the pool for cache `cache`, to be its core `core`.
pub(super) struct Pooled {
    pub(super) device: String,
    pub(super) key: Option<DeviceKey>,
    pub(super) cache: u16,
    pub(super) core: u16,
}

impl State {
    /// Who holds a device in the pool, for [`State::user_of`].
    pub(super) fn pool_user_of(&self, key: &DeviceKey) -> Option<String> {
        self.core_pool
            .iter()
            .find(|p| p.key.as_ref().is_some_and(|k| k.conflicts(key)))
            .map(|p| {
                format!(
                    "a core in the core pool (for core {} of cache {})",
                    p.core, p.cache
                )
            })
    }

    /// The pooled devices, as `-L` lists them.
    pub(super) fn pool_devices(&self) -> Vec<String> {
        self.core_pool.iter().map(|p| p.device.clone()).collect()
    }
}

impl Daemon {
    /// `--script --add-core --try-add -i CACHE -j CORE -d DEVICE`.
    pub(super) fn try_add_core(&self, cache: u16, core: u16, device: &str) -> Reply {
        let mut st = self.state.lock();
        if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("the daemon is shutting down".into());
        }
        if let Some(c) = st.caches.get(&cache) {
            match c.cores.get(&core) {
                Some(e) if !e.active => {
                    drop(st);
                    return self.add_core(cache, device, Some(core), false, None);
                }
                Some(e) => {
                    return Err(format!(
                        "core {core} of cache {cache} is already active (on {})",
                        e.device
                    ))
                }
                None => {
                    return Err(format!(
                        "cache {cache} does not record a core {core}: --try-add only attaches a core the cache already has; add a new core without --try-add"
                    ))
                }
            }
        }
        // A disconnected cache has its cores under kept exports: refused with how to connect it.
        if st.disconnected.contains_key(&cache) {
            st.cache(cache)?;
        }
        if is_missing(device) {
            return Err(format!("device {device} not found"));
        }
        if let Some(p) = st.core_pool.iter().find(|p| p.device == device) {
            return Err(format!(
                "{device} is already in the core pool (for core {} of cache {})",
                p.core, p.cache
            ));
        }
        if let Some(p) = st
            .core_pool
            .iter()
            .find(|p| p.cache == cache && p.core == core)
        {
            return Err(format!(
                "core {core} of cache {cache} is already in the core pool (on {})",
                p.device
            ));
        }
        let key = st.check_free(device)?;
        st.core_pool.push(Pooled {
            device: device.to_string(),
            key,
            cache,
            core,
        });
        tracing::info!(
            "{device} added to the core pool: cache {cache} does not run yet; it is attached as core {core} when cache {cache} starts with that core"
        );
        Ok(json!({ "pooled": true }))
    }

    /// `--remove-detached -d DEVICE`.
    pub(super) fn remove_detached(&self, device: &str) -> Reply {
        let mut st = self.state.lock();
        let key = device_key(device);
        let at = st.core_pool.iter().position(|p| {
            p.device == device || matches!((&p.key, &key), (Some(a), Some(b)) if a.conflicts(b))
        });
        let Some(at) = at else {
            return Err(format!("{device} is not in the core pool"));
        };
        let p = st.core_pool.remove(at);
        tracing::info!("{} removed from the core pool", p.device);
        Ok(json!({}))
    }

    /// A `-S` reply, once the pooled cores of the cache it started are attached: those are no
    /// longer listed inactive.
    pub(super) fn attach_pooled_after_start(&self, mut started: Value) -> Value {
        let Some(id) = started["id"].as_u64().and_then(|i| u16::try_from(i).ok()) else {
            return started;
        };
        let attached = self.attach_pooled(id);
        if let Some(inactive) = started.get_mut("inactive").and_then(Value::as_array_mut) {
            inactive.retain(|j| {
                !j.as_u64()
                    .is_some_and(|j| attached.iter().any(|a| u64::from(*a) == j))
            });
        }
        started
    }

    /// After cache `id` started or loaded: each pooled core it records as inactive is attached
    /// from the pool; returns their ids. What fails stays in the pool and is logged.
    pub(super) fn attach_pooled(&self, id: u16) -> Vec<u16> {
        let wanted: Vec<(u16, String)> = {
            let mut st = self.state.lock();
            let Some(c) = st.caches.get(&id) else {
                return Vec::new();
            };
            let inactive: Vec<u16> = c
                .cores
                .iter()
                .filter(|(_, e)| !e.active)
                .map(|(j, _)| *j)
                .collect();
            let mut out = Vec::new();
            st.core_pool.retain(|p| {
                let take = p.cache == id && inactive.contains(&p.core);
                if take {
                    out.push((p.core, p.device.clone()));
                }
                !take
            });
            out
        };
        let mut attached = Vec::new();
        for (j, device) in wanted {
            match self.add_core(id, &device, Some(j), false, None) {
                Ok(_) => {
                    tracing::info!("cache {id}: core {j} attached from the core pool ({device})");
                    attached.push(j);
                }
                Err(e) => {
                    tracing::warn!(
                        "cache {id}: core {j} could not be attached from the core pool ({device}): {e}; it stays in the pool"
                    );
                    let key = device_key(&device);
                    self.state.lock().core_pool.push(Pooled {
                        device,
                        key,
                        cache: id,
                        core: j,
                    });
                }
            }
        }
        attached
    }
}

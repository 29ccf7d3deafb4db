//! casctl's `start` (utils/casctl `start`): every cache of a configuration file (hybridcache's
//! TOML, or Open CAS's opencas.conf read as it is) loaded from its device, never created: a
//! device that holds no cache is reported and left alone, as casctl's `casadm -S --load`
//! fails on it. A cache already running is left as it is. What cannot be loaded now (its
//! device missing) waits for its device, as the daemon's own `--config` does at boot; its
//! cores come back with the load, and a core whose device was missing is attached when it
//! appears.

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::json;

use super::{Daemon, Reply};
use crate::config::ConfigFile;

impl Daemon {
    pub(super) fn casctl_start(&self, path: &str) -> Reply {
        let mut cfg = ConfigFile::load(Path::new(path)).map_err(|e| format!("{e:#}"))?;
        // Running, or kept waiting from an earlier start: the daemon has them already.
        let (running, waiting): (BTreeSet<u16>, Vec<_>) = {
            let st = self.state.lock();
            let running = cfg
                .caches
                .iter()
                .map(|c| c.id)
                .filter(|id| st.caches.contains_key(id))
                .collect();
            let waiting = cfg
                .caches
                .iter()
                .filter_map(|c| st.waiting.get(&c.id).map(|w| (c, w)))
                .map(|(c, w)| json!({ "id": c.id, "device": c.device, "loaded": false, "why": w.status }))
                .collect();
            (running, waiting)
        };
        let known: BTreeSet<u16> = running
            .iter()
            .copied()
            .chain(
                waiting
                    .iter()
                    .filter_map(|w| w["id"].as_u64().map(|i| i as u16)),
            )
            .collect();
        cfg.caches.retain(|c| !known.contains(&c.id));
        cfg.cores.retain(|c| !known.contains(&c.cache));
        let ids: BTreeSet<u16> = cfg.caches.iter().map(|c| c.id).collect();
        self.apply(&cfg, &ids).map_err(|e| format!("{e:#}"))?;
        let st = self.state.lock();
        let caches: Vec<_> = waiting
            .into_iter()
            .chain(cfg.caches.iter().map(|c| match st.waiting.get(&c.id) {
                Some(w) => {
                    json!({ "id": c.id, "device": c.device, "loaded": false, "why": w.status })
                }
                None => json!({ "id": c.id, "device": c.device, "loaded": true }),
            }))
            .collect();
        Ok(json!({ "caches": caches, "running": running }))
    }
}

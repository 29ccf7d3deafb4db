//! What the daemon shows of its caches: `-L`'s entries, `-P`'s statistics report, the IO
//! classes' rows and the metrics endpoint's view, all read from the registry ([`State`]) and
//! the front-ends (which export serves a core, how many clients it has).

use std::collections::BTreeMap;

use serde_json::json;

use super::{
    engine_err, export_name, CacheEntry, CoreEntry, Reply, State, Waiting, WAITING_FOR_DEVICE,
};
use crate::frontend::Frontends;
use crate::metrics::{CacheView, CoreView};
use crate::protocol::{self, CacheInfo, CoreInfo, StatsReport};

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
    let fallback = protocol::FallbackInfo::of(&c.cache.fallback_status());
    if fallback.as_ref().is_some_and(|f| f.active) {
        // Not a mode: the mode set stays and comes back with a reset of the counters.
        status = "Fallback pass-through".to_string();
    }
    let mut mode = c.cache.mode().to_string();
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
        // The policy casadm knows, never a preset's name (casadm has none; docs/policies.md).
        cleaning: c.cache.cleaning().policy.to_string(),
        promotion: c.cache.promotion().policy.to_string(),
        lazy_flush: hybridcache_engine::policy::on_off(c.cache.lazy_flush().enabled).into(),
        prefetch: c.cache.prefetch().policy.to_string(),
        inactive_cores: c.cores.values().filter(|core| !core.active).count(),
        metadata_bytes: c.cache.metadata_bytes(),
        mirror: c.cache.mirror_status().map(|m| protocol::MirrorInfo {
            device: c.mirror.as_ref().map_or(m.device, |e| e.device.clone()),
            state: m.state.as_str().into(),
            mirror_lost: m.policy.as_str().into(),
            reason: m.reason,
            rebuild: m.rebuild,
            lines: m.lines,
            dirty_lines: m.dirty_lines,
            bytes: m.bytes,
        }),
        fallback,
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

pub(super) fn core_info(
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
        mirror: None,
        fallback: None,
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

pub(super) fn io_class_info(c: &hybridcache_engine::ioclass::IoClass) -> protocol::IoClassInfo {
    protocol::IoClassInfo {
        id: c.id,
        name: c.name.clone(),
        eviction_priority: c
            .eviction_priority
            .map_or("Pinned".to_string(), |p| p.to_string()),
        allocation: c.allocation_str(),
    }
}

impl State {
    /// `-L`: running caches, disconnected ones and those of the configuration not running.
    pub(super) fn list(&self, frontends: &Frontends) -> Reply {
        let mut caches: Vec<CacheInfo> = self
            .caches
            .iter()
            .map(|(id, c)| cache_info(*id, c, frontends))
            .collect();
        caches.extend(
            self.disconnected
                .iter()
                .map(|(id, d)| d.info(*id, frontends)),
        );
        caches.extend(self.waiting.values().map(waiting_info));
        caches.sort_by_key(|c| c.id);
        Ok(json!({ "caches": caches, "core_pool": self.pool_devices() }))
    }

    pub(super) fn reset_counters(&self, cache: u16, core: Option<u16>) -> Reply {
        let c = self.cache(cache)?;
        match core {
            Some(core) => {
                self.active_core(cache, core)?;
                c.cache.reset_core_stats(core).map_err(engine_err)?;
            }
            None => c.cache.reset_stats(),
        }
        Ok(json!({}))
    }

    pub(super) fn stats(
        &self,
        frontends: &Frontends,
        cache_id: u16,
        core: Option<u16>,
        io_class: Option<u8>,
    ) -> Reply {
        let c = self.cache(cache_id)?;
        let info = cache_info(cache_id, c, frontends);
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
                    self.active_core(cache_id, core)?;
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
                self.active_core(cache_id, core)?;
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
    pub(super) fn metrics_view(&self, frontends: &Frontends) -> Vec<CacheView> {
        self.caches
            .iter()
            .map(|(id, c)| CacheView {
                id: *id,
                device: c.device.clone(),
                // A label must not change with every scrape: the percentage has its own metric.
                status: cache_info(*id, c, frontends)
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
                        clients: frontends
                            .get(Some(core.frontend))
                            .ok()
                            .and_then(|f| f.clients(&export_name(*id, *core_id)))
                            .unwrap_or(0),
                    })
                    .collect(),
            })
            .collect()
    }
}

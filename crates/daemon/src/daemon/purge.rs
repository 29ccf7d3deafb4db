//! casadm's hidden script commands `--script --purge-cache`, `--script --purge-core` and
//! `--script --check-cache-device` (casadm/cas_main.c, `script_handle`; cas_lib.c,
//! `purge_cache`, `purge_core`, `check_cache_device`).
//!
//! A purge is Open CAS's `ocf_mngt_cache_purge` / `ocf_mngt_core_purge`: flush, then invalidate.
//! Dirty data is never discarded: what cannot be flushed (an inactive core, a core that fails)
//! refuses the purge with nothing changed, as casadm's purge fails with its flush. The exports
//! stay up and their clients keep them; only what the cache held goes, and the cores have all
//! of it.
//!
//! The engine has no call that invalidates lines without detaching their core (and is not ours
//! to change here), so a purge is made of calls it has. A cache: the pass-through disconnect
//! (flush, wipe the metadata, serve the cores directly) and a connect on the same device, which
//! starts the cache anew with its id, mode, line size, parameters, IO classes and cores. A core:
//! its export held ([`Route::Frozen`], draining requests in flight), flushed, removed from the
//! engine (which drops its lines) and added back with the same id, device identity and
//! sequential cutoff, then served again. Either way the statistics of what was purged start
//! from zero, as after a restart.

use serde_json::json;

use super::{engine_err, Daemon, Reply};
use crate::protocol::{CacheDeviceCheck, Purged};
use crate::target::Route;

impl Daemon {
    pub(super) fn check_cache_device(&self, device: &str) -> Reply {
        let st = self.state.lock();
        if let Some((id, _)) = st.caches.iter().find(|(_, c)| c.device == device) {
            return Err(format!(
                "{device} is the device of running cache {id}; a device is checked while no cache runs on it"
            ));
        }
        // The exclusive claim refuses a device a cache, a mount or a program holds, so the
        // metadata read is not one being written.
        let volume = self.open_claimed(device, false)?;
        drop(st);
        let check = match hybridcache_engine::read_summary(&*volume) {
            Ok(Some(s)) => CacheDeviceCheck {
                is_cache: true,
                cache_id: Some(s.superblock.cache_id),
                clean_shutdown: Some(s.superblock.clean_shutdown),
                dirty_lines: s.total_dirty_lines(),
                dirty_bytes: s.dirty_bytes(),
            },
            Ok(None) => CacheDeviceCheck {
                is_cache: false,
                cache_id: None,
                clean_shutdown: None,
                dirty_lines: 0,
                dirty_bytes: 0,
            },
            Err(e) => {
                return Err(format!(
                    "the metadata on {device} cannot be read: {}",
                    engine_err(e)
                ))
            }
        };
        serde_json::to_value(check).map_err(|e| e.to_string())
    }

    pub(super) fn purge_cache(&self, id: u16) -> Reply {
        let (device, dirty, held) = {
            let st = self.state.lock();
            let c = st.cache(id)?;
            if let Some((j, core)) = c.cores.iter().find(|(_, k)| !k.active) {
                let dirty = c.cache.core_dirty_lines(*j);
                return Err(format!(
                    "cache {id} was not purged, nothing was changed: core {j} is inactive ({} is missing){}; attach it with -A -i {id} -j {j} -d DEVICE, or remove it with --remove-inactive -i {id} -j {j}",
                    core.device,
                    if dirty > 0 {
                        format!(
                            " and its {} cannot be flushed",
                            dirty_text(dirty, c.cache.line_size().bytes() as u64)
                        )
                    } else {
                        String::new()
                    }
                ));
            }
            let usage = c.cache.stats().usage;
            (c.device.clone(), usage.dirty_lines, usage.occupancy_lines)
        };
        self.disconnect_cache(id, false, true, false)
            .map_err(|e| format!("cache {id} was not purged: {e}"))?;
        // Flushed, metadata wiped, cores served directly: a new cache on the same device with
        // everything the old one had but its lines.
        self.connect_cache(&device, Some(id), false).map_err(|e| {
            let msg = format!(
                "cache {id} was flushed and emptied, but starting it again on {device} failed: {e}; its cores are served directly: bring it back with --script --connect-cache -d {device} -i {id}"
            );
            tracing::error!("{msg}");
            msg
        })?;
        tracing::info!("cache {id} purged: {dirty} dirty lines flushed, {held} lines invalidated");
        serde_json::to_value(Purged {
            flushed_lines: dirty,
            invalidated_lines: held,
        })
        .map_err(|e| e.to_string())
    }

    pub(super) fn purge_core(&self, id: u16, j: u16) -> Reply {
        let st = self.state.lock();
        if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("the daemon is shutting down".into());
        }
        let refused = |why: String| {
            format!("core {j} of cache {id} was not purged, nothing was changed: {why}")
        };
        let entry = st.cache(id)?;
        let core = st.active_core(id, j).map_err(refused)?;
        // Removing a RAM core from the engine would drop its only copy.
        if core.device.starts_with("ram:") {
            return Err(refused(format!(
                "it is on {}, whose data lives only while the cache holds it",
                core.device
            )));
        }
        let cache = entry.cache.clone();
        let device = core.device.clone();
        let target = core
            .target
            .clone()
            .ok_or_else(|| refused("it has no export".into()))?;
        let line = cache.line_size().bytes() as u64;
        let dirty = cache.core_dirty_lines(j);
        // The bulk of the flush while the core still serves: a failure here changes nothing.
        cache.flush_core(j).map_err(|e| {
            refused(format!(
                "flushing its {} failed: {}",
                dirty_text(dirty, line),
                engine_err(e)
            ))
        })?;
        drop(target.switch(Route::Frozen));
        let serve_again = |why: String| -> Reply {
            match cache.core(j) {
                Ok(c) => drop(target.switch(Route::Cache(c))),
                Err(e) => tracing::error!(
                    "cache {id}: core {j}'s export cannot be served again: {}",
                    engine_err(e)
                ),
            }
            Err(refused(why))
        };
        // What was written between the flush and the hold.
        if let Err(e) = cache.flush_core(j) {
            return serve_again(format!("flushing failed: {}", engine_err(e)));
        }
        let left = cache.core_dirty_lines(j);
        if left != 0 {
            return serve_again(format!(
                "{} are still dirty after its flush",
                dirty_text(left, line)
            ));
        }
        let held = match cache.core_stats(j) {
            Ok(s) => s.usage.occupancy_lines,
            Err(e) => return serve_again(engine_err(e)),
        };
        let seq_cutoff = match cache.seq_cutoff(j) {
            Ok(s) => s,
            Err(e) => return serve_again(engine_err(e)),
        };
        let identity = cache.core_record(j).and_then(|r| r.identity);
        // Clean, held: the removal drops its lines and nothing is lost.
        if let Err(e) = cache.remove_core(j, false) {
            return serve_again(engine_err(e));
        }
        let back = self.claim_released(&device).and_then(|volume| {
            cache
                .add_identified_core(volume, Some(j), identity)
                .map_err(engine_err)?;
            cache
                .set_seq_cutoff(Some(j), seq_cutoff)
                .map_err(engine_err)?;
            cache.core(j).map_err(engine_err)
        });
        match back {
            Ok(c) => drop(target.switch(Route::Cache(c))),
            Err(e) => {
                // Its data is all on the core: serve it from there rather than hold it.
                let msg = match self.claim_released(&device) {
                    Ok(v) => {
                        drop(target.switch(Route::PassThrough(v)));
                        format!("core {j} of cache {id} was flushed and emptied, but adding it back failed: {e}; its export is served from {device} directly; remove it with -R -i {id} -j {j} and add it again")
                    }
                    Err(e2) => format!("core {j} of cache {id} was flushed and emptied, but adding it back failed: {e}; opening {device} for its export failed too ({e2}): its requests wait; remove it with -R -i {id} -j {j} and add it again"),
                };
                tracing::error!("{msg}");
                return Err(msg);
            }
        }
        self.save_locked(&st);
        drop(st);
        tracing::info!(
            "core {j} of cache {id} purged: {dirty} dirty lines flushed, {held} lines invalidated"
        );
        Ok(json!(Purged {
            flushed_lines: dirty,
            invalidated_lines: held,
        }))
    }
}

fn dirty_text(lines: u64, line_bytes: u64) -> String {
    format!(
        "{} dirty lines ({})",
        crate::safety::count_text(lines),
        crate::safety::size_text(lines * line_bytes)
    )
}

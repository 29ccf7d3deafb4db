//! casadm's hidden script commands `--script --purge-cache`, `--script --purge-core` and
//! `--script --check-cache-device` (casadm/cas_main.c, `script_handle`; cas_lib.c,
//! `purge_cache`, `purge_core`, `check_cache_device`).
//!
//! A purge is Open CAS's `ocf_mngt_cache_purge` / `ocf_mngt_core_purge`: flush, then
//! invalidate, done by the engine ([`Cache::purge`](hybridcache_engine::Cache::purge)). Dirty
//! data is never discarded: what cannot be flushed (an inactive core with dirty lines, a core
//! that fails) refuses the purge with nothing changed, as casadm's purge fails with its flush.
//! The cores keep their place in the cache's metadata, their settings and their statistics, as
//! in Open CAS; the exports stay up and their clients keep them. The bulk of the flush runs
//! while the exports serve; the engine's part (what was written since, and the invalidation)
//! runs with them held, their requests waiting.

use serde_json::json;

use super::{engine_err, Daemon, Reply};
use crate::protocol::{CacheDeviceCheck, Purged};
use crate::target::{Route, Target};

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
        let st = self.state.lock();
        if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("the daemon is shutting down".into());
        }
        let c = st.cache(id)?;
        let cache = c.cache.clone();
        let line = cache.line_size().bytes() as u64;
        for (j, core) in c.cores.iter().filter(|(_, k)| !k.active) {
            let dirty = cache.core_dirty_lines(*j);
            if dirty > 0 {
                return Err(format!(
                    "cache {id} was not purged, nothing was changed: core {j} is inactive ({} is missing) and its {} cannot be flushed; attach it with -A -i {id} -j {j} -d DEVICE, or remove it with --remove-inactive -i {id} -j {j}",
                    core.device,
                    dirty_text(dirty, line)
                ));
            }
        }
        let targets: Vec<_> = c.cores.values().filter_map(|k| k.target.clone()).collect();
        let dirty = cache.stats().usage.dirty_lines;
        // The bulk of the flush while the cores still serve: a failure here changes nothing.
        cache.flush().map_err(|e| {
            format!(
                "cache {id} was not purged, nothing was changed: flushing its {} failed: {}",
                dirty_text(dirty, line),
                engine_err(e)
            )
        })?;
        let invalidated = frozen(&targets, || cache.purge(None)).map_err(|e| {
            format!(
                "cache {id} was not purged, nothing was changed: {}",
                engine_err(e)
            )
        })?;
        drop(st);
        tracing::info!(
            "cache {id} purged: {dirty} dirty lines flushed, {invalidated} lines invalidated"
        );
        Ok(json!(Purged {
            flushed_lines: dirty,
            invalidated_lines: invalidated,
        }))
    }

    pub(super) fn purge_core(&self, id: u16, j: u16) -> Reply {
        let st = self.state.lock();
        if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
            return Err("the daemon is shutting down".into());
        }
        let refused = |why: String| {
            format!("core {j} of cache {id} was not purged, nothing was changed: {why}")
        };
        let cache = st.cache(id)?.cache.clone();
        let core = st.active_core(id, j).map_err(refused)?;
        let targets: Vec<_> = core.target.iter().cloned().collect();
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
        let invalidated =
            frozen(&targets, || cache.purge(Some(j))).map_err(|e| refused(engine_err(e)))?;
        drop(st);
        tracing::info!(
            "core {j} of cache {id} purged: {dirty} dirty lines flushed, {invalidated} lines invalidated"
        );
        Ok(json!(Purged {
            flushed_lines: dirty,
            invalidated_lines: invalidated,
        }))
    }
}

/// Run `purge` with the exports held: the engine refuses a purged core's requests while it
/// quiesces it, so the clients' requests wait in their exports instead (those in flight drain
/// first), and go on through the same route once it is done, whatever its outcome.
fn frozen<T>(targets: &[Target], purge: impl FnOnce() -> T) -> T {
    let routes: Vec<Route> = targets.iter().map(|t| t.switch(Route::Frozen)).collect();
    let out = purge();
    for (t, r) in targets.iter().zip(routes) {
        t.switch(r);
    }
    out
}

fn dirty_text(lines: u64, line_bytes: u64) -> String {
    format!(
        "{} dirty lines ({})",
        crate::safety::count_text(lines),
        crate::safety::size_text(lines * line_bytes)
    )
}

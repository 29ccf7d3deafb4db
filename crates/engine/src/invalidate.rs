//! Purge: flush, then invalidate every line of a core or of the whole cache, as Open CAS's
//! `ocf_mngt_core_purge` and `ocf_mngt_cache_purge` do (ocf/src/mngt/ocf_mngt_flush.c: a flush
//! step, then `ocf_metadata_sparse_range` under the metadata's exclusive access).
//!
//! The cores stay what they were: in the superblock with their uuid and identity, their
//! settings, statistics and sequential streams untouched (OCF resets no counter in a purge).
//! Only the lines go, and only once the cores have their data: the purged cores are quiesced
//! first, so no write can dirty a line between the flush and the invalidation, and a line left
//! dirty refuses the purge before anything is invalidated.
//!
//! Crash safety needs no step of its own. Nothing leaves the superblock. Until the commit
//! that ends the purge, the device records the lines as the flush left them, clean and valid,
//! which a load after a crash drops anyway (only dirty sectors are trusted); after it, free.

use std::sync::Arc;

use crate::core_state::CoreState;
use crate::inner::CacheInner;
use crate::{CoreId, EngineError, Result};

/// The cores a purge quiesced: they serve again when it ends, however it ends.
struct Held(Vec<Arc<CoreState>>);

impl Drop for Held {
    fn drop(&mut self) {
        for core in &self.0 {
            core.cancel_removal();
        }
    }
}

impl CacheInner {
    /// [`Cache::purge`](crate::Cache::purge): core `core` (active, or inactive without dirty
    /// lines), or every core for None.
    pub(crate) fn purge(self: &Arc<Self>, core: Option<CoreId>) -> Result<u64> {
        let (active, inactive) = match core {
            None => (
                self.cores.all(),
                self.cores.inactive_records().iter().map(|r| r.id).collect(),
            ),
            Some(id) => match self.core_by_id(id) {
                Ok(core) => (vec![core], Vec::new()),
                Err(_) if self.cores.is_inactive(id) => (Vec::new(), vec![id]),
                Err(e) => return Err(e),
            },
        };
        self.purge_cores(active, inactive)
    }

    /// Flush, then invalidate every line of the `active` cores and of the `inactive` core ids;
    /// returns how many lines were invalidated. An inactive core's dirty lines cannot be
    /// flushed: they refuse the purge with nothing changed, as does a flush that fails.
    ///
    /// Requests to an active core during the purge fail as [`EngineError::CoreRemoved`]; a
    /// front-end that must not see that holds its requests meanwhile (the daemon freezes the
    /// export).
    fn purge_cores(
        self: &Arc<Self>,
        active: Vec<Arc<CoreState>>,
        inactive: Vec<CoreId>,
    ) -> Result<u64> {
        if let Some((id, dirty_lines)) = inactive
            .iter()
            .map(|&id| (id, self.dirty_lines_of(id)))
            .find(|&(_, dirty)| dirty != 0)
        {
            return Err(EngineError::CoreDirty { id, dirty_lines });
        }
        let mut held = Held(Vec::with_capacity(active.len()));
        for core in &active {
            // Another removal (or a stop) owns this core's quiesce: not ours to undo.
            if !core.begin_removal() {
                return Err(EngineError::CoreRemoved(core.id()));
            }
            held.0.push(core.clone());
        }
        for core in &active {
            core.quiesce();
        }
        let dirty: u64 = active.iter().map(|c| self.dirty_lines_of(c.id())).sum();
        {
            let _progress = self.flush_progress.begin(dirty);
            crate::cleaner::flush_cores_dirty(self, active.clone())?;
        }
        // With the cores quiesced nothing dirties a line again; what a flush could not clean
        // without failing is refused here, before any line is dropped.
        if let Some((id, dirty_lines)) = active
            .iter()
            .map(|c| (c.id(), self.dirty_lines_of(c.id())))
            .find(|&(_, dirty)| dirty != 0)
        {
            return Err(EngineError::CoreDirty { id, dirty_lines });
        }
        let ids: Vec<CoreId> = active.iter().map(|c| c.id()).chain(inactive).collect();
        let mut invalidated = 0;
        for &id in &ids {
            invalidated += self.usage(Some(id)).occupancy_lines;
            self.drop_core_lines(id);
        }
        self.commit()?;
        drop(held);
        Ok(invalidated)
    }

    fn dirty_lines_of(&self, id: CoreId) -> u64 {
        self.lines
            .gauges()
            .get(id as usize)
            .map_or(0, |g| g.dirty())
    }
}

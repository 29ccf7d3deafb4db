//! casadm's `--script --remove-core --detach` and `--script --add-core --update-path`
//! (casadm/cas_main.c `script_handle`; the kernel's `cache_mngt_remove_core_from_cache` and
//! `cache_mngt_update_core_uuid`, which call OCF's `ocf_mngt_cache_detach_core` and
//! `ocf_mngt_core_set_uuid`).
//!
//! A detached core is what a load leaves of a core whose device is missing: inactive, still in
//! the superblock with its lines, dirty ones included, until its device is attached again
//! ([`Cache::attach_core`]) or it is removed. These are `impl Cache` here rather than in
//! cache.rs, which is at the architecture test's length limit.

use crate::cache::Cache;
use crate::format::CoreRecord;
use crate::{CoreId, EngineError, Result};

impl Cache {
    /// Make active core `id` inactive, as if its device had been missing at load: its requests
    /// are waited for, then it leaves the active cores with every line it holds (dirty data
    /// stays on the cache device, nothing is lost) and stays in the superblock. The caller
    /// flushes first when the core's device is to have the data (casadm does unless
    /// `--no-flush`). Returns the dirty lines it kept.
    pub fn detach_core(&self, id: CoreId) -> Result<u64> {
        let inner = &self.inner;
        let core = inner.core_by_id(id)?;
        if !core.begin_removal() {
            return Err(EngineError::CoreRemoved(id));
        }
        core.quiesce();
        let record = self.core_record(id).unwrap_or_else(|| CoreRecord {
            id,
            path: core.volume().name().to_string(),
            size: core.size(),
            uuid: String::new(),
            identity: None,
        });
        if !inner.cores.deactivate(id, record, core.seq().params()) {
            core.cancel_removal();
            return Err(EngineError::NoSuchCore(id));
        }
        Ok(self.core_dirty_lines(id))
    }

    /// Record `path` (and `identity`) as where active core `id` is found from now on: the
    /// caller has checked that it names the device the core is on (a renamed device node, a
    /// new by-id link). Nothing else changes; a later load looks there.
    pub fn set_core_path(&self, id: CoreId, path: &str, identity: Option<String>) -> Result<()> {
        let inner = &self.inner;
        inner.core_by_id(id)?;
        if let Some(p) = &inner.persist {
            p.update_superblock(&**inner.devices.volume(), |sb| {
                if let Some(c) = sb.cores.iter_mut().find(|c| c.id == id) {
                    c.path = path.to_string();
                    c.identity = identity;
                }
            })?;
        }
        Ok(())
    }
}

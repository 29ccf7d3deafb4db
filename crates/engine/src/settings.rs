//! The facade's run-time settings (policy.rs; docs/policies.md): cleaning, sequential cutoff,
//! promotion, lazy flush, offload, fallback pass-through, read-ahead and the IO classes.
//!
//! Invariant: a setting changes in RAM and in the superblock together. Each setter validates
//! first (an invalid value changes nothing), applies the value, then records every policy
//! (`save_policies`); when that write fails it puts the old value back, so what serves and what
//! the next load reads never differ.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use crate::cache::Cache;
use crate::core_state::CoreState;
use crate::ioclass::IoClasses;
use crate::offload::Offload;
use crate::policy::{CleaningConfig, LazyFlush, Prefetch, Promotion, SeqCutoff};
use crate::{CoreId, Result};

impl Cache {
    /// The cleaning policy and every policy's tunables.
    pub fn cleaning(&self) -> CleaningConfig {
        *self.inner.cleaning.read()
    }

    /// Change the cleaning configuration at run time; recorded in the superblock. Invalid values
    /// are refused and change nothing.
    pub fn set_cleaning(&self, config: CleaningConfig) -> Result<()> {
        config.validate()?;
        let old = std::mem::replace(&mut *self.inner.cleaning.write(), config);
        if let Err(e) = self.inner.save_policies() {
            *self.inner.cleaning.write() = old;
            return Err(e);
        }
        // The new policy's wake-up counts from now, not from the old policy's schedule.
        self.inner.cleaner.lock().reset_schedule();
        Ok(())
    }

    /// A core's sequential cutoff settings.
    pub fn seq_cutoff(&self, core: CoreId) -> Result<SeqCutoff> {
        if let Some(s) = self.inner.cores.inactive_seq_cutoff(core) {
            return Ok(s);
        }
        Ok(self.inner.core_by_id(core)?.seq().params())
    }

    /// Set sequential cutoff for one core, or for every core when `core` is None.
    pub fn set_seq_cutoff(&self, core: Option<CoreId>, params: SeqCutoff) -> Result<()> {
        params.validate()?;
        let targets: Vec<Arc<CoreState>> = match core {
            Some(id) => {
                // The guard must be gone before save_policies reads the map again.
                let old = self.inner.cores.replace_inactive_seq_cutoff(id, params);
                if let Some(old) = old {
                    if let Err(e) = self.inner.save_policies() {
                        self.inner.cores.replace_inactive_seq_cutoff(id, old);
                        return Err(e);
                    }
                    return Ok(());
                }
                vec![self.inner.core_by_id(id)?]
            }
            None => {
                self.inner.cores.set_inactive_seq_cutoffs(params);
                self.inner.cores.all()
            }
        };
        let old: Vec<SeqCutoff> = targets.iter().map(|c| c.seq().params()).collect();
        for c in &targets {
            c.seq().set_params(params);
        }
        if let Err(e) = self.inner.save_policies() {
            for (c, o) in targets.iter().zip(old) {
                c.seq().set_params(o);
            }
            return Err(e);
        }
        Ok(())
    }

    /// The promotion policy and nhit's tunables.
    pub fn promotion(&self) -> Promotion {
        self.inner.promotion.params()
    }

    /// Change promotion at run time; recorded in the superblock.
    pub fn set_promotion(&self, params: Promotion) -> Result<()> {
        params.validate()?;
        let old = self.inner.promotion.params();
        self.inner
            .promotion
            .set_params(params, self.inner.lines.count());
        if let Err(e) = self.inner.save_policies() {
            self.inner
                .promotion
                .set_params(old, self.inner.lines.count());
            return Err(e);
        }
        Ok(())
    }

    /// Lazy flush (policy.rs `LazyFlush`).
    pub fn lazy_flush(&self) -> LazyFlush {
        LazyFlush {
            enabled: self.inner.lazy_flush.load(Ordering::Relaxed),
        }
    }

    /// Switch lazy flush at run time; recorded in the superblock.
    pub fn set_lazy_flush(&self, params: LazyFlush) -> Result<()> {
        let old = self
            .inner
            .lazy_flush
            .swap(params.enabled, Ordering::Relaxed);
        if let Err(e) = self.inner.save_policies() {
            self.inner.lazy_flush.store(old, Ordering::Relaxed);
            return Err(e);
        }
        Ok(())
    }

    /// Offload's settings (offload.rs).
    pub fn offload(&self) -> Offload {
        self.inner.devices.offload().params()
    }

    /// Change offload at run time; recorded in the superblock. Invalid values are refused and
    /// change nothing.
    pub fn set_offload(&self, params: Offload) -> Result<()> {
        params.validate()?;
        let old = self.inner.devices.offload().params();
        self.inner.devices.offload().set_params(params);
        if let Err(e) = self.inner.save_policies() {
            self.inner.devices.offload().set_params(old);
            return Err(e);
        }
        Ok(())
    }

    /// Fallback pass-through's settings (fallback.rs).
    pub fn fallback_pt(&self) -> crate::FallbackPt {
        self.inner.devices.fallback().params()
    }

    /// Change fallback pass-through; recorded in the superblock. A threshold above the errors
    /// in the window (or 0) leaves the fallback, one at or below them enters it.
    pub fn set_fallback_pt(&self, params: crate::FallbackPt) -> Result<()> {
        params.validate()?;
        let old = self.inner.devices.fallback().params();
        self.inner.devices.fallback().set_params(params);
        if let Err(e) = self.inner.save_policies() {
            self.inner.devices.fallback().set_params(old);
            return Err(e);
        }
        Ok(())
    }

    /// Whether the cache serves in fallback pass-through, its error count and the dirty data
    /// found unreadable. A mirrored cache never falls back (its mirror states say more).
    pub fn fallback_status(&self) -> crate::FallbackStatus {
        let mut s = self.inner.devices.fallback().status();
        s.active = self.inner.devices.fallback_active();
        s
    }

    /// The cache-device error count with which the cache fell back to pass-through, once per
    /// fallback, to log.
    pub fn take_fallback_entered(&self) -> Option<u64> {
        self.inner.devices.fallback().take_entered()
    }

    /// The dirty ranges found unreadable since the last call (each once), to log.
    pub fn take_unreadable_dirty(&self) -> Vec<crate::UnreadableDirty> {
        self.inner.devices.fallback().take_unreadable()
    }

    /// Read-ahead's settings (policy.rs `Prefetch`).
    pub fn prefetch(&self) -> Prefetch {
        self.inner.prefetch.params()
    }

    /// Change read-ahead at run time; recorded in the superblock. Invalid values are refused
    /// and change nothing.
    pub fn set_prefetch(&self, params: Prefetch) -> Result<()> {
        params.validate()?;
        let old = self.inner.prefetch.params();
        self.inner
            .prefetch
            .set_params(params, self.inner.lines.count());
        if let Err(e) = self.inner.save_policies() {
            self.inner
                .prefetch
                .set_params(old, self.inner.lines.count());
            return Err(e);
        }
        Ok(())
    }

    /// The IO classes in force (the default single class until a file is loaded).
    pub fn io_classes(&self) -> Arc<IoClasses> {
        self.inner.lines.classes().table()
    }

    /// Replace the IO classes; recorded in the superblock. Lines keep the class they were
    /// inserted with. The caller parses the file, so a refused file never gets here.
    pub fn load_io_classes(&self, classes: IoClasses) -> Result<()> {
        let old = self
            .inner
            .lines
            .classes()
            .active()
            .then(|| self.inner.lines.classes().table());
        let gauges = &self.inner.lines.gauges();
        self.inner
            .lines
            .classes()
            .install(classes, self.inner.lines.table(), |id| {
                gauges[id as usize].classes()
            });
        if let Err(e) = self.inner.save_policies() {
            self.inner.lines.classes().restore(old);
            return Err(e);
        }
        Ok(())
    }
}

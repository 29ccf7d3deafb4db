//! The holder: a cache's subsystems side by side. `CacheInner` owns the line room (`Lines`, a
//! struct with private fields), the devices room (`Devices`, likewise), the cores,
//! persistence, the policies' state, and the signals between requests and background threads;
//! the rooms that act work on it through structs of references it lends (`Reader`,
//! `ReadAhead`, `Writer`, `Cleaner`, `Commit`, `Admission`; each lender in its room's file),
//! invalidate.rs (purge) and recovery.rs (the load, which builds it) still on the holder itself.
//! This file knows only the lower rooms' types, never the rooms that use it; it hands the line
//! room what a line change also touches (persistence, read-ahead's marks).
//!
//! Invariants: `line_size`, `line_bytes` and the line count never change after `build` (nor
//! do the devices' volume and data offset, devices.rs); `mode` changes only through `Cache::set_mode`; the cores' registry
//! (`Cores`, core_state.rs) keeps a core active from the end of its attach to the start of its
//! removal, and inactive only while its device is missing, never both.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

use hybridcache_volume::VolumeRef;
use parking_lot::{Mutex, RwLock};

use crate::bits::Mask;
use crate::cleaning_state::{CleanerState, CleaningCounters, Pacer};
use crate::core_state::{CoreState, Cores};
use crate::devices::Devices;
use crate::lines::Lines;
use crate::meta::Key;
use crate::persist::Persist;
use crate::policy::PolicyRecord;
use crate::policy::PromotionState;
use crate::prefetch::PrefetchState;
use crate::progress::FlushProgress;
use crate::room_wait::CleanerSignal;
use crate::stats::BackgroundErrorLog;
use crate::stats::{Stats, Usage};
use crate::CacheConfig;
use crate::CleaningConfig;
use crate::LazyFlush;
use crate::LineSize;
use crate::Promotion;
use crate::{CacheMode, CoreId, EngineError, Result};

pub(crate) struct CacheInner {
    pub(crate) id: u16,
    pub(crate) line_size: LineSize,
    pub(crate) line_bytes: u64,
    /// The devices room (devices.rs): the cache volume, a mirror, offload's queue depths.
    pub(crate) devices: Devices,
    /// The line room (lines.rs).
    pub(crate) lines: Lines,
    pub(crate) mode: AtomicU8,
    /// The active and inactive cores (core_state.rs).
    pub(crate) cores: Cores,
    /// None for a volatile cache (metadata in RAM only).
    pub(crate) persist: Option<Persist>,
    pub(crate) cleaning: RwLock<CleaningConfig>,
    pub(crate) cleaner: Mutex<CleanerState>,
    pub(crate) prefetch: PrefetchState,
    pub(crate) cleaner_signal: Arc<CleanerSignal>,
    /// Lazy flush is on (policy.rs `LazyFlush`): read on every write-back write that lacks a line.
    pub(crate) lazy_flush: AtomicBool,
    pub(crate) pacer: Pacer,
    pub(crate) cleaning_counters: CleaningCounters,
    /// Device errors of read-ahead (cleaning's are in `cleaning_counters`).
    pub(crate) prefetch_errors: BackgroundErrorLog,
    pub(crate) promotion: PromotionState,
    pub(crate) flush_progress: FlushProgress,
}

/// The mode a cache whose set mode is the word `mode` (`CacheInner::mode`) serves in now: a
/// mirrored cache that lost a device serves in a degraded one, a cache in fallback
/// pass-through in pt. Read per request, as a switch may come between two.
#[inline]
pub(crate) fn serving_mode(mode: &AtomicU8, devices: &Devices) -> CacheMode {
    let set = CacheMode::ALL[mode.load(Ordering::Relaxed) as usize];
    match devices.mirror() {
        Some(m) => m.effective_mode(set),
        None if devices.fallback_active() => CacheMode::Pt,
        None => set,
    }
}

impl CacheInner {
    /// The mode the cache was set to; a mirrored cache that lost a device, or one in fallback
    /// pass-through, serves in another (`serving_mode`).
    #[inline]
    pub(crate) fn set_mode(&self) -> CacheMode {
        CacheMode::ALL[self.mode.load(Ordering::Relaxed) as usize]
    }

    #[inline]
    pub(crate) fn cache_off(&self, line: u32, sector: u32) -> u64 {
        self.devices.cache_off(line, sector)
    }

    pub(crate) fn core_by_id(&self, id: CoreId) -> Result<Arc<CoreState>> {
        self.cores.get(id).ok_or(EngineError::NoSuchCore(id))
    }

    pub(crate) fn core_stats(&self, core: &CoreState) -> Stats {
        let (requests, blocks, errors) = core.counters().snapshot();
        Stats {
            usage: self.usage(Some(core.id())),
            requests,
            blocks,
            errors,
        }
    }
}

impl CacheInner {
    pub(crate) fn build(
        volume: VolumeRef,
        config: &CacheConfig,
        lines: u32,
        data_offset: u64,
        persist: Option<Persist>,
    ) -> CacheInner {
        let line_bytes = config.line_size.bytes() as u64;
        let lines = Lines::new(lines, config.line_size);
        CacheInner {
            id: config.id,
            line_size: config.line_size,
            line_bytes,
            devices: Devices::new(volume, data_offset, line_bytes, lines.shared_gauges()),
            lines,
            mode: AtomicU8::new(config.mode as u8),
            cores: Cores::default(),
            persist,
            cleaning: RwLock::new(CleaningConfig::default()),
            cleaner: Mutex::new(CleanerState::default()),
            prefetch: PrefetchState::new(),
            cleaner_signal: Arc::new(CleanerSignal::default()),
            lazy_flush: AtomicBool::new(LazyFlush::default().enabled),
            pacer: Pacer::default(),
            cleaning_counters: CleaningCounters::default(),
            prefetch_errors: BackgroundErrorLog::default(),
            promotion: PromotionState::new(Promotion::default()),
            flush_progress: FlushProgress::default(),
        }
    }

    /// The policies as the superblock records them.
    fn policy_record(&self) -> PolicyRecord {
        let seq_cutoff = self.cores.seq_cutoffs();
        PolicyRecord {
            cleaning: *self.cleaning.read(),
            promotion: self.promotion.params(),
            seq_cutoff,
            io_classes: self
                .lines
                .classes()
                .active()
                .then(|| self.lines.classes().table().to_csv()),
            lazy_flush: LazyFlush {
                enabled: self.lazy_flush.load(Ordering::Relaxed),
            },
            prefetch: self.prefetch.params(),
            offload: self.devices.offload().params(),
            fallback_pt: self.devices.fallback().params(),
        }
    }

    /// Record the policies in the superblock (persistent caches), so a load restores them.
    pub(crate) fn save_policies(&self) -> Result<()> {
        let Some(p) = &self.persist else {
            return Ok(());
        };
        let record = self.policy_record();
        let serde_json::Value::Object(map) =
            serde_json::to_value(&record).expect("policies serialise")
        else {
            unreachable!("a struct serialises to an object");
        };
        p.update_superblock(&**self.devices.volume(), |sb| sb.params = map)
    }
}

/// The line room's changes that also touch persistence (which lines a commit must write, which
/// may not be reused yet) and read-ahead's marks: the holder hands both over.
impl CacheInner {
    #[inline]
    pub(crate) fn update_line(&self, line: u32, key: Key, valid: Mask, dirty: Mask, touch: bool) {
        self.lines
            .update_line(self.persist.as_ref(), line, key, valid, dirty, touch)
    }

    pub(crate) fn drop_core_lines(&self, id: CoreId) {
        self.lines.drop_core_lines(self.persist.as_ref(), id)
    }

    pub(crate) fn check_invariants(&self) {
        let known_core = |id: CoreId| self.cores.known(id);
        self.lines
            .check_invariants(self.persist.is_some(), &known_core)
    }

    #[inline]
    pub(crate) fn usage(&self, core: Option<CoreId>) -> Usage {
        self.lines.usage(core)
    }
}

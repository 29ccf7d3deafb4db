//! The holder: a cache's subsystems side by side. `CacheInner` owns the line room's state (table,
//! lists, stripe locks, gauges), the cores, persistence, the policies' state, and the signals
//! between requests and background threads; the rooms (lines.rs, devices.rs, admission.rs,
//! read.rs, write.rs, cleaner.rs, cleaning.rs, commit.rs, readahead.rs, recovery.rs) work on
//! it. This file knows only the lower rooms' types, never the rooms that use it.
//!
//! Invariants: `line_size`, `line_bytes`, `lines`, `volume` and `data_offset` never change
//! after `build`; `mode` changes only through `Cache::set_mode`; a core is in `cores` from the
//! end of its attach to the start of its removal, and its id in `inactive` only while its
//! device is missing, never in both.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use hybridcache_volume::VolumeRef;
use parking_lot::{Mutex, RwLock};

use crate::classes::ClassState;
use crate::cleaning_state::{CleanerState, CleaningCounters, Pacer};
use crate::core_state::{CoreGauges, CoreState};
use crate::format::CoreRecord;
use crate::lists::{Lists, RUN};
use crate::locks::StripedLocks;
use crate::meta::{Key, LineTable};
use crate::offload::OffloadState;
use crate::persist::Persist;
use crate::policy::PromotionState;
use crate::policy::{PolicyRecord, SeqCutoff};
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
use crate::{CacheMode, CoreId, EngineError, Result, MAX_CORES, SECTOR};

pub(crate) struct CacheInner {
    pub(crate) id: u16,
    pub(crate) line_size: LineSize,
    pub(crate) line_bytes: u64,
    pub(crate) lines: u32,
    pub(crate) volume: VolumeRef,
    /// Where line 0 starts on the cache volume.
    pub(crate) data_offset: u64,
    pub(crate) mode: AtomicU8,
    pub(crate) table: LineTable,
    pub(crate) lists: Lists,
    pub(crate) locks: StripedLocks,
    pub(crate) cores: RwLock<BTreeMap<CoreId, Arc<CoreState>>>,
    /// Per-core line counts, indexed by core id, so eviction can update them without a registry
    /// lookup.
    pub(crate) gauges: Box<[CoreGauges]>,
    pub(crate) free_lines: AtomicU64,
    /// None for a volatile cache (metadata in RAM only).
    pub(crate) persist: Option<Persist>,
    /// Cores recorded in the superblock whose device was missing at load.
    pub(crate) inactive: RwLock<BTreeMap<CoreId, CoreRecord>>,
    pub(crate) cleaning: RwLock<CleaningConfig>,
    pub(crate) cleaner: Mutex<CleanerState>,
    pub(crate) prefetch: PrefetchState,
    pub(crate) cleaner_signal: Arc<CleanerSignal>,
    /// Lazy flush is on (policy.rs `LazyFlush`): read on every write-back write that lacks a line.
    pub(crate) lazy_flush: AtomicBool,
    /// Offload (offload.rs): queue depths of the devices and the share of requests to route.
    pub(crate) offload: OffloadState,
    pub(crate) pacer: Pacer,
    pub(crate) cleaning_counters: CleaningCounters,
    /// Device errors of read-ahead (cleaning's are in `cleaning_counters`).
    pub(crate) prefetch_errors: BackgroundErrorLog,
    pub(crate) promotion: PromotionState,
    pub(crate) classes: ClassState,
    pub(crate) flush_progress: FlushProgress,
    /// Sequential cutoff settings of cores recorded but not attached (inactive), kept so that
    /// the superblock keeps them.
    pub(crate) seq_cutoff_inactive: RwLock<BTreeMap<CoreId, SeqCutoff>>,
}

impl CacheInner {
    pub(crate) fn mode(&self) -> CacheMode {
        CacheMode::ALL[self.mode.load(Ordering::Relaxed) as usize]
    }

    pub(crate) fn cache_off(&self, line: u32, sector: u32) -> u64 {
        self.data_offset + line as u64 * self.line_bytes + sector as u64 * SECTOR
    }

    pub(crate) fn core_off(&self, key: Key, sector: u32) -> u64 {
        key.line() * self.line_bytes + sector as u64 * SECTOR
    }

    pub(crate) fn check(
        &self,
        core: &CoreState,
        offset: u64,
        len: u64,
        max: Option<u64>,
    ) -> Result<()> {
        crate::check_request(core.size, offset, len, max)
    }

    pub(crate) fn core_by_id(&self, id: CoreId) -> Result<Arc<CoreState>> {
        self.cores
            .read()
            .get(&id)
            .cloned()
            .ok_or(EngineError::NoSuchCore(id))
    }

    // ---- reads ----------------------------------------------------------------------------

    // ---- writes ---------------------------------------------------------------------------

    // ---- device IO with accounting --------------------------------------------------------

    // ---- statistics ----------------------------------------------------------------------

    pub(crate) fn usage(&self, core: Option<CoreId>) -> Usage {
        let (occupancy, dirty) = match core {
            Some(id) => {
                let g = &self.gauges[id as usize];
                (
                    g.occupancy.load(Ordering::Relaxed),
                    g.dirty.load(Ordering::Relaxed),
                )
            }
            None => self.gauges.iter().fold((0, 0), |(o, d), g| {
                (
                    o + g.occupancy.load(Ordering::Relaxed),
                    d + g.dirty.load(Ordering::Relaxed),
                )
            }),
        };
        Usage {
            line_size: self.line_bytes as u32,
            total_lines: self.lines as u64,
            occupancy_lines: occupancy,
            free_lines: self.free_lines.load(Ordering::Relaxed),
            dirty_lines: dirty,
        }
    }

    pub(crate) fn core_stats(&self, core: &CoreState) -> Stats {
        let (requests, blocks, errors) = core.counters.snapshot();
        Stats {
            usage: self.usage(Some(core.id)),
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
        // Enough stripes that unrelated requests rarely meet, few enough to stay small.
        let stripes = (lines as usize).next_power_of_two().clamp(64, 1 << 16);
        let shards = (lines.div_ceil(RUN) as usize).clamp(1, 64);
        CacheInner {
            id: config.id,
            line_size: config.line_size,
            line_bytes: config.line_size.bytes() as u64,
            lines,
            volume,
            data_offset,
            mode: AtomicU8::new(config.mode as u8),
            table: LineTable::new(lines, config.line_size.sectors(), stripes),
            lists: Lists::new(lines, shards),
            locks: StripedLocks::new(stripes),
            cores: RwLock::new(BTreeMap::new()),
            gauges: (0..MAX_CORES).map(|_| CoreGauges::default()).collect(),
            free_lines: AtomicU64::new(lines as u64),
            persist,
            inactive: RwLock::new(BTreeMap::new()),
            cleaning: RwLock::new(CleaningConfig::default()),
            cleaner: Mutex::new(CleanerState::default()),
            prefetch: PrefetchState::new(),
            cleaner_signal: Arc::new(CleanerSignal::default()),
            lazy_flush: AtomicBool::new(LazyFlush::default().enabled),
            offload: OffloadState::new(MAX_CORES as usize),
            pacer: Pacer::default(),
            cleaning_counters: CleaningCounters::default(),
            prefetch_errors: BackgroundErrorLog::default(),
            promotion: PromotionState::new(Promotion::default()),
            classes: ClassState::new(lines),
            flush_progress: FlushProgress::default(),
            seq_cutoff_inactive: RwLock::new(BTreeMap::new()),
        }
    }

    /// The policies as the superblock records them.
    fn policy_record(&self) -> PolicyRecord {
        let mut seq_cutoff = self.seq_cutoff_inactive.read().clone();
        for (id, c) in self.cores.read().iter() {
            seq_cutoff.insert(*id, c.seq.params());
        }
        PolicyRecord {
            cleaning: *self.cleaning.read(),
            promotion: self.promotion.params(),
            seq_cutoff,
            io_classes: self.classes.active().then(|| self.classes.table().to_csv()),
            lazy_flush: LazyFlush {
                enabled: self.lazy_flush.load(Ordering::Relaxed),
            },
            prefetch: self.prefetch.params(),
            offload: self.offload.params(),
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
        p.update_superblock(&*self.volume, |sb| sb.params = map)
    }
}

impl CacheInner {}

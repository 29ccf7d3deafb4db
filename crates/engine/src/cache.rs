//! The cache's public facade, `Cache` and `Core`, and the story of a request; the request path
//! itself is in read.rs and write.rs, the line state in lines.rs (docs/architecture.md).
//!
//! A request runs in three steps on the caller's thread:
//! 1. cut it into segments, one per core line it touches, and lock the stripes of those core lines
//!    in ascending order (overlapping requests therefore serialise; disjoint ones do not meet);
//! 2. look every segment up and decide, by mode, what goes to the cache and what to the core;
//!    new cache lines come from the free lists or by evicting the least recently used clean line
//!    whose stripe can be taken without waiting;
//! 3. do the device IO, merging neighbouring pieces, then update metadata, still under the locks.
//!    A write around the cache that finds no cached copy unlocks before its core write and marks
//!    its core lines instead (locks.rs), as cleaning does between its cache read and marking the
//!    lines clean.
//!
//! A write-back write that finds no line to take (every line dirty, or locked by others) drops its
//! locks without having changed anything, cleans the oldest dirty lines, and tries again; after a
//! few rounds it writes the remaining segments straight to the core, which is always correct.
//! With lazy flush on it does that at once and asks the cleaner thread for room instead; while
//! background cleaning is under way it first waits up to `ROOM_WAIT` for a line cleaning frees,
//! so that a full cache in front of a slow core does not send random writes to a core busy with
//! sorted cleaning. On a volatile cache a cleaned line is reusable at once. On a persistent one it
//! stays durably dirty (not reusable: a crash would map the core line to new data) until a
//! commit records it clean; so background cleaning commits part way through a batch, between
//! its core writes, once it has cleaned `AHEAD_LINES` since the last commit, writes want room (or
//! free lines are short) and the last commit began `AHEAD_INTERVAL_MS` ago (cleaning.rs,
//! `commit_ahead`). The commit flushes the cores: cleaning pays for it, never a client write,
//! which waits only for the commit's wake-up. Writes that wait go first: while some wait, a
//! write that has not waited takes no line but joins them (`CleanerSignal::waiters`), else the
//! lines a commit frees go to whichever writes come back first and a waiting one can lose every
//! round until it times out.
//!
//! A read that continues a sequential stream may queue read-ahead (prefetch.rs) after it has
//! released its locks; the prefetch worker fills only invalid sectors, under the same locks.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use hybridcache_volume::{Volume, VolumeRef};
use parking_lot::Mutex;

use crate::cleaning::CleanerThread;
use crate::cleaning_state::{CleaningStats, CleaningTick};
use crate::core_state::CoreState;
use crate::exported::Core;
use crate::format::{ConfigSlot, CoreRecord, Superblock};
use crate::inner::CacheInner;
use crate::ioclass::ClassId;
use crate::latency::LatencyStats;
use crate::meta::{MAX_CORE_LINES, NONE};
use crate::persist::{self, new_uuid};
use crate::policy::SeqCutoff;
use crate::progress::FlushStatus;
use crate::readahead::PrefetchThread;
use crate::recovery::LoadSource;
use crate::stats::{BackgroundErrors, Stats, Usage};
use crate::{CacheConfig, CacheMode, CoreId, EngineError, LineSize, Result, SECTOR};

/// A cache: one cache volume serving one or more cores. Cheap to clone (a shared handle).
#[derive(Clone)]
pub struct Cache {
    pub(crate) inner: Arc<CacheInner>,
    threads: Arc<Threads>,
}

/// A cache's background threads; they hold the cache weakly, so dropping every handle ends
/// them.
#[derive(Default)]
struct Threads {
    cleaner: Mutex<Option<CleanerThread>>,
    prefetch: Mutex<Option<PrefetchThread>>,
}

/// Whether a core's device is attached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CoreStatus {
    Active,
    /// Its device was missing when the cache was loaded: its dirty data is kept, its exported
    /// volume is not served until [`Cache::attach_core`] brings it back.
    Inactive,
}

/// Description of an attached core.
#[derive(Debug, Clone)]
pub struct CoreInfo {
    pub id: CoreId,
    /// The device as the user named it (path or volume URI).
    pub name: String,
    pub size: u64,
    pub status: CoreStatus,
}

impl Cache {
    /// Start a new, empty, volatile cache on `cache_volume`: the whole volume holds cache lines
    /// and the metadata lives in RAM only (nothing survives a restart).
    pub fn new(cache_volume: VolumeRef, config: CacheConfig) -> Result<Cache> {
        let line_bytes = config.line_size.bytes() as u64;
        let lines = cache_volume.size() / line_bytes;
        if lines == 0 {
            return Err(EngineError::CacheTooSmall {
                bytes: cache_volume.size(),
                line: config.line_size.bytes(),
            });
        }
        if lines >= NONE as u64 {
            return Err(EngineError::Invalid(format!(
                "the cache volume holds {lines} cache lines; at most {} are supported (use a larger cache line size)",
                NONE - 1
            )));
        }
        Ok(Cache::started(CacheInner::build(
            cache_volume,
            &config,
            lines as u32,
            0,
            None,
        )))
    }

    /// Wrap a built cache and start its cleaner thread.
    pub(crate) fn started(inner: CacheInner) -> Cache {
        // Dirty data a load brought back has been dirty at least since the load.
        for g in inner.lines.gauges().iter() {
            let _ = g.dirty_for();
        }
        let inner = Arc::new(inner);
        let threads = Threads {
            cleaner: Mutex::new(Some(CleanerThread::start(&inner))),
            prefetch: Mutex::new(Some(PrefetchThread::start(&inner))),
        };
        Cache {
            inner,
            threads: Arc::new(threads),
        }
    }

    /// Load the cache held by `cache_volume`, after a clean stop or a crash. `open_core` opens
    /// each recorded core's device; a core it cannot open (None) is loaded inactive, its dirty
    /// data kept. Everything is checked before anything is written: corrupt metadata, a core of
    /// the wrong size or a volume of the wrong size is refused and the devices stay untouched
    /// (recovery.rs).
    pub fn load(
        cache_volume: VolumeRef,
        open_core: &mut dyn FnMut(&CoreRecord) -> Option<VolumeRef>,
    ) -> Result<Cache> {
        Ok(Cache::started(crate::recovery::load(
            cache_volume,
            LoadSource::Plain,
            open_core,
        )?))
    }

    /// Read the superblock of the cache `cache_volume` holds, without loading it or writing
    /// anything: what `casadm` shows before deciding to load.
    pub fn peek(cache_volume: &dyn Volume) -> Result<Superblock> {
        let slots = persist::read_config(cache_volume)?;
        persist::refuse_newer(&slots)?;
        if let Some((_, sb, _)) = persist::newest(&slots) {
            return Ok(sb.clone());
        }
        Err(
            match slots.iter().find_map(|s| match s {
                ConfigSlot::Corrupt(why) => Some(why.clone()),
                _ => None,
            }) {
                Some(why) => EngineError::DamagedSuperblock(why),
                None => EngineError::NoCache(cache_volume.name().to_string()),
            },
        )
    }

    /// Whether this cache keeps its metadata on the cache volume.
    pub fn persistent(&self) -> bool {
        self.inner.persist.is_some()
    }

    /// The superblock as last written (persistent caches only).
    pub fn superblock(&self) -> Option<Superblock> {
        self.inner.persist.as_ref().map(|p| p.superblock())
    }

    /// Stop the cache: refuse new requests, wait for those in flight, flush dirty data to the
    /// cores unless `flush_data` is false (then it stays in the cache for the next load), and
    /// write the metadata with the clean-shutdown mark. A volatile cache cannot keep dirty data.
    pub fn stop(&self, flush_data: bool) -> Result<()> {
        if !flush_data && self.inner.persist.is_none() && self.inner.usage(None).dirty_lines != 0 {
            return Err(EngineError::Invalid(
                "a volatile cache cannot keep dirty data across a stop; flush it".into(),
            ));
        }
        self.stop_background_cleaner();
        self.stop_background_prefetch();
        let cores: Vec<Arc<CoreState>> = self.inner.cores.all();
        for c in &cores {
            c.stop();
        }
        if flush_data {
            crate::cleaner::flush_cores_dirty(&self.inner, cores)?;
        }
        self.inner.commit()?;
        if let Some(p) = &self.inner.persist {
            p.update_superblock(&**self.inner.devices.volume(), |sb| {
                sb.clean_shutdown = true
            })?;
        }
        Ok(())
    }

    pub fn id(&self) -> u16 {
        self.inner.id
    }

    pub fn line_size(&self) -> LineSize {
        self.inner.line_size
    }

    /// Number of cache lines.
    pub fn line_count(&self) -> u64 {
        self.inner.lines.count() as u64
    }

    /// The mode the cache serves in: the mode set, or a mirrored cache's degraded one. Fallback
    /// pass-through is not a mode (`fallback_status`): it would otherwise be shown and saved as
    /// the mode set, and outlive the errors that caused it.
    pub fn mode(&self) -> CacheMode {
        let set = self.inner.set_mode();
        self.inner
            .devices
            .mirror()
            .map_or(set, |m| m.effective_mode(set))
    }

    /// The cache volume's name.
    pub fn volume_name(&self) -> &str {
        self.inner.devices.volume().name()
    }

    /// Switch the cache mode. When leaving wb/wo for a mode that holds no dirty data and
    /// `flush_first` is set, all dirty data is flushed after new writes stop creating dirty data;
    /// otherwise dirty lines stay and drain by cleaning (reads of them are still served from the
    /// cache, and every mode keeps them correct).
    pub fn set_mode(&self, mode: CacheMode, flush_first: bool) -> Result<()> {
        if let Some(p) = &self.inner.persist {
            p.update_superblock(&**self.inner.devices.volume(), |sb| {
                sb.mode = mode.as_str().into()
            })?;
        }
        let old = self.mode();
        self.inner.mode.store(mode as u8, Ordering::Relaxed);
        if flush_first && !mode.makes_dirty() {
            // One progress entry over every pass, showing the change as -L's status does.
            let _progress = self
                .inner
                .flush_progress
                .begin(self.inner.usage(None).dirty_lines);
            self.inner.flush_progress.set_mode_change(Some((old, mode)));
            // Requests that read the old mode before the switch may still be adding dirty data;
            // they finish quickly, so a few passes leave none.
            for _ in 0..1000 {
                self.flush_cores()?;
                if self.inner.usage(None).dirty_lines == 0 {
                    return Ok(());
                }
                std::thread::yield_now();
            }
            return Err(EngineError::Invalid(
                "dirty data kept appearing while switching mode; flush again".into(),
            ));
        }
        Ok(())
    }

    /// Attach a core. `id` None picks the lowest free id starting at 1.
    pub fn add_core(&self, volume: VolumeRef, id: Option<CoreId>) -> Result<CoreId> {
        self.add_identified_core(volume, id, None)
    }

    /// [`Cache::add_core`], recording what the device is ([`CoreRecord::identity`]) in the same
    /// superblock write, so that a load or a re-attach can tell it from another device that
    /// takes its path.
    pub fn add_identified_core(
        &self,
        volume: VolumeRef,
        id: Option<CoreId>,
        identity: Option<String>,
    ) -> Result<CoreId> {
        let size = volume.size();
        if size % SECTOR != 0 {
            return Err(EngineError::Invalid(format!(
                "core {} is {size} bytes, not a multiple of 512",
                volume.name()
            )));
        }
        if size.div_ceil(self.inner.line_bytes) > MAX_CORE_LINES {
            return Err(EngineError::Invalid(format!(
                "core {} is too large ({size} bytes) for {} KiB cache lines",
                volume.name(),
                self.inner.line_size.kib()
            )));
        }
        let id = self.inner.cores.add(id, |id| {
            if let Some(p) = &self.inner.persist {
                let record = CoreRecord {
                    id,
                    path: volume.name().to_string(),
                    size,
                    uuid: new_uuid(),
                    identity,
                };
                p.update_superblock(&**self.inner.devices.volume(), |sb| sb.cores.push(record))?;
            }
            Ok(self
                .inner
                .lines
                .new_core_state(id, volume, SeqCutoff::default()))
        })?;
        // A new core starts with the default seq cutoff; the superblock forgets a removed
        // core's settings. A failure here leaves the old record, which a load reads as default.
        self.inner.save_policies()?;
        Ok(id)
    }

    /// Detach a core. With dirty data it refuses unless `force`, which discards the dirty data.
    pub fn remove_core(&self, id: CoreId, force: bool) -> Result<()> {
        self.remove_core_counted(id, force).map(|_| ())
    }

    /// Lines of core `id` (active or inactive) that hold data the core does not have yet.
    pub fn core_dirty_lines(&self, id: CoreId) -> u64 {
        self.inner
            .lines
            .gauges()
            .get(id as usize)
            .map_or(0, |g| g.dirty())
    }

    /// [`Cache::remove_core`], returning how many dirty lines a forced removal discarded
    /// (counted once the core's requests are quiesced, so it is what was lost).
    pub fn remove_core_counted(&self, id: CoreId, force: bool) -> Result<u64> {
        let core = match self.inner.core_by_id(id) {
            Ok(core) => Some(core),
            Err(e) if !self.inner.cores.is_inactive(id) => return Err(e),
            Err(_) => None,
        };
        if let Some(core) = &core {
            if !core.begin_removal() {
                return Err(EngineError::CoreRemoved(id));
            }
            core.quiesce();
        }
        let dirty = self.inner.lines.gauges()[id as usize].dirty();
        if dirty != 0 && !force {
            if let Some(core) = &core {
                core.cancel_removal();
            }
            return Err(EngineError::CoreDirty {
                id,
                dirty_lines: dirty,
            });
        }
        // No request of this core can run now; drop every line it holds so the id can be reused.
        self.inner.drop_core_lines(id);
        if let Some(p) = &self.inner.persist {
            // The device must record the lines free before the core leaves the superblock, or a
            // crash in between would leave lines of an unknown core.
            let recorded = self.inner.commit().and_then(|()| {
                p.update_superblock(&**self.inner.devices.volume(), |sb| {
                    sb.cores.retain(|c| c.id != id)
                })
            });
            if let Err(e) = recorded {
                // The core stays attached, only its cached lines are gone, so a retry can work.
                if let Some(core) = &core {
                    core.cancel_removal();
                }
                return Err(e);
            }
        }
        self.inner.cores.remove(id);
        self.inner.save_policies()?;
        Ok(dirty)
    }

    /// Core `id` as the superblock records it (persistent caches only).
    pub fn core_record(&self, id: CoreId) -> Option<CoreRecord> {
        let p = self.inner.persist.as_ref()?;
        p.superblock().cores.into_iter().find(|c| c.id == id)
    }

    /// Bring back an inactive core (its device was missing at load). The device must have the
    /// size the cache recorded.
    pub fn attach_core(&self, id: CoreId, volume: VolumeRef) -> Result<()> {
        self.attach_identified_core(id, volume, None)
    }

    /// [`Cache::attach_core`], recording the identity of the device it is attached to now (None:
    /// not known) in the superblock write that records its path: a later load compares against
    /// the device the operator chose, forced or not.
    pub fn attach_identified_core(
        &self,
        id: CoreId,
        volume: VolumeRef,
        identity: Option<String>,
    ) -> Result<()> {
        self.inner.cores.activate(id, |rec, seq| {
            if volume.size() != rec.size {
                return Err(EngineError::CoreMismatch {
                    id,
                    why: format!(
                        "{} is {} bytes but the cache recorded {} bytes for {}",
                        volume.name(),
                        volume.size(),
                        rec.size,
                        rec.path
                    ),
                });
            }
            if let Some(p) = &self.inner.persist {
                // The next load must look where the core is now.
                let path = volume.name().to_string();
                p.update_superblock(&**self.inner.devices.volume(), |sb| {
                    if let Some(c) = sb.cores.iter_mut().find(|c| c.id == id) {
                        c.path = path;
                        c.identity = identity;
                    }
                })?;
            }
            Ok(self.inner.lines.new_core_state(id, volume, seq))
        })
    }

    /// The exported volume of a core.
    pub fn core(&self, id: CoreId) -> Result<Core> {
        if self.inner.cores.is_inactive(id) {
            return Err(EngineError::CoreInactive(id));
        }
        Ok(Core::new(self.inner.clone(), self.inner.core_by_id(id)?))
    }

    pub fn cores(&self) -> Vec<CoreInfo> {
        let mut out: Vec<CoreInfo> = self
            .inner
            .cores
            .active()
            .values()
            .map(|c| CoreInfo {
                id: c.id(),
                name: c.volume().name().to_string(),
                size: c.size(),
                status: CoreStatus::Active,
            })
            .collect();
        out.extend(
            self.inner
                .cores
                .inactive_records()
                .into_iter()
                .map(|r| CoreInfo {
                    id: r.id,
                    name: r.path,
                    size: r.size,
                    status: CoreStatus::Inactive,
                }),
        );
        out.sort_by_key(|c| c.id);
        out
    }

    /// Write all dirty data of every core to the cores, mark it clean, and flush the cores.
    pub fn flush(&self) -> Result<()> {
        let _progress = self
            .inner
            .flush_progress
            .begin(self.inner.usage(None).dirty_lines);
        self.flush_cores()
    }

    /// Flush every core, counted in the progress entry the caller began. Each core flushes
    /// on its own, bounded by the core flush timeout: a hung core is reported, not waited for.
    fn flush_cores(&self) -> Result<()> {
        let cores: Vec<Arc<CoreState>> = self.inner.cores.all();
        crate::cleaner::flush_cores_dirty(&self.inner, cores)
    }

    /// As [`flush`](Cache::flush), for one core.
    pub fn flush_core(&self, id: CoreId) -> Result<()> {
        let core = self.inner.core_by_id(id)?;
        let _progress = self
            .inner
            .flush_progress
            .begin(self.inner.usage(Some(id)).dirty_lines);
        crate::cleaner::flush_cores_dirty(&self.inner, vec![core])
    }

    /// Open CAS's purge of core `core`, or of every core for None (`ocf_mngt_core_purge`,
    /// `ocf_mngt_cache_purge`; invalidate.rs): dirty data flushed, then every line invalidated
    /// and committed; the cores, their uuids, settings and statistics stay. Returns the lines
    /// invalidated. Requests to a purged core fail as `CoreRemoved` while it runs.
    pub fn purge(&self, core: Option<CoreId>) -> Result<u64> {
        self.inner.purge(core)
    }

    /// How long the cache (or one core) has held dirty data: since the oldest core's last
    /// transition from clean to dirty (after a load, since the load). None while clean.
    pub fn dirty_for(&self, core: Option<CoreId>) -> Option<std::time::Duration> {
        match core {
            Some(id) => self.inner.lines.gauges().get(id as usize)?.dirty_for(),
            None => self
                .inner
                .lines
                .gauges()
                .iter()
                .filter_map(|g| g.dirty_for())
                .max(),
        }
    }

    /// How far the running flushes have got; None when none runs.
    pub fn flush_status(&self) -> Option<FlushStatus> {
        self.inner.flush_progress.status()
    }

    /// Stop the running flushes once their core writes in flight complete: what they cleaned is
    /// recorded clean, the rest stays dirty, and they fail with [`EngineError::FlushInterrupted`]
    /// saying how many lines they cleaned. False when no flush runs.
    pub fn interrupt_flush(&self) -> bool {
        self.inner.flush_progress.interrupt()
    }

    /// Stop the prefetch worker thread (it is not restarted): queued read-ahead then waits for
    /// [`run_prefetch`](Cache::run_prefetch). For tests that need a deterministic order.
    pub fn stop_background_prefetch(&self) {
        let thread = self.threads.prefetch.lock().take();
        if let Some(t) = thread {
            t.stop();
        }
    }

    /// Run the queued read-ahead on the calling thread; returns how many prefetch jobs ran.
    pub fn run_prefetch(&self) -> usize {
        self.inner.drain_prefetch()
    }

    /// Statistics of one IO class: its lines (occupancy, dirty) and the requests classified
    /// into it, across cores. Device byte counts are per core only; a class has exported bytes.
    /// The counters are the sum over the attached cores (like the cache's own counters).
    pub fn io_class_stats(&self, id: ClassId) -> Result<Stats> {
        let table = self.inner.lines.classes().table();
        if table.get(id).is_none() {
            return Err(EngineError::Invalid(format!(
                "IO class {id} is not configured"
            )));
        }
        let c = &self.inner.lines.classes();
        let (mut requests, mut blocks, mut errors): (
            crate::RequestStats,
            crate::BlockStats,
            crate::ErrorStats,
        ) = Default::default();
        for core in self.inner.cores.active().values() {
            if let Some(k) = core.classes().counters(id) {
                let (r, b, e) = k.snapshot();
                requests.add(&r);
                blocks.add(&b);
                errors.add(&e);
            }
        }
        let (occupancy_lines, dirty_lines) = c.lines(id);
        Ok(Stats {
            usage: Usage {
                line_size: self.inner.line_bytes as u32,
                total_lines: self.inner.lines.count() as u64,
                occupancy_lines,
                free_lines: self.inner.lines.free_lines().load(Ordering::Relaxed),
                dirty_lines,
            },
            requests,
            blocks,
            errors,
        })
    }

    /// One core's share of an IO class' statistics (`casadm -P -j CORE -d CLASS`): the class'
    /// lines mapped to the core and the core's requests classified into it. Over the attached
    /// cores these add up to [`Cache::io_class_stats`] (lines of inactive cores are in the
    /// cache-wide gauges only).
    pub fn core_io_class_stats(&self, core: CoreId, id: ClassId) -> Result<Stats> {
        let state = self.inner.core_by_id(core)?;
        if self.inner.lines.classes().table().get(id).is_none() {
            return Err(EngineError::Invalid(format!(
                "IO class {id} is not configured"
            )));
        }
        let (occupancy, dirty) = self.inner.lines.gauges()[core as usize].classes().lines(id);
        let (requests, blocks, errors) = state
            .classes()
            .counters(id)
            .map(|k| k.snapshot())
            .unwrap_or_default();
        Ok(Stats {
            usage: Usage {
                line_size: self.inner.line_bytes as u32,
                total_lines: self.inner.lines.count() as u64,
                occupancy_lines: occupancy,
                free_lines: self.inner.lines.free_lines().load(Ordering::Relaxed),
                dirty_lines: dirty,
            },
            requests,
            blocks,
            errors,
        })
    }

    /// Lines of the inactive cores (recorded, device missing at load): casadm's "Inactive
    /// usage statistics". `occupancy_lines` and `dirty_lines` are theirs; None while every
    /// recorded core is attached.
    pub fn inactive_usage(&self) -> Option<Usage> {
        let inactive = self.inner.cores.inactive_records();
        if inactive.is_empty() {
            return None;
        }
        let mut usage = Usage {
            line_size: self.inner.line_bytes as u32,
            total_lines: self.inner.lines.count() as u64,
            free_lines: self.inner.lines.free_lines().load(Ordering::Relaxed),
            ..Usage::default()
        };
        for r in &inactive {
            let g = &self.inner.lines.gauges()[r.id as usize];
            usage.occupancy_lines += g.occupancy();
            usage.dirty_lines += g.dirty();
        }
        Some(usage)
    }

    /// What cleaning (background, eviction and flushes) has written since the cache started.
    pub fn cleaning_stats(&self) -> CleaningStats {
        self.inner.cleaning_counters.snapshot()
    }

    /// Device errors of read-ahead (those of cleaning are in [`Cache::cleaning_stats`]).
    pub fn prefetch_errors(&self) -> BackgroundErrors {
        self.inner.prefetch_errors.snapshot()
    }

    /// Stop the background cleaner thread (it is not restarted). For tests that drive the
    /// cleaner with their own clock through [`cleaner_tick`](Cache::cleaner_tick), and for stop.
    pub fn stop_background_cleaner(&self) {
        let thread = self.threads.cleaner.lock().take();
        if let Some(t) = thread {
            t.stop();
        }
    }

    /// Run the cleaner once as if the time were `now_ms` (milliseconds from any fixed origin,
    /// never decreasing): the injected clock of the cleaning tests.
    pub fn cleaner_tick(&self, now_ms: u64) -> CleaningTick {
        self.inner.cleaner_room().cleaner_tick(now_ms)
    }

    pub fn stats(&self) -> Stats {
        let mut total = Stats {
            usage: self.inner.usage(None),
            ..Stats::default()
        };
        for core in self.inner.cores.active().values() {
            let (r, b, e) = core.counters().snapshot();
            total.requests.add(&r);
            total.blocks.add(&b);
            total.errors.add(&e);
        }
        total
    }

    pub fn core_stats(&self, id: CoreId) -> Result<Stats> {
        let core = self.inner.core_by_id(id)?;
        Ok(self.inner.core_stats(&core))
    }

    /// Reset one core's counters (`casadm -Z -j`).
    pub fn reset_core_stats(&self, id: CoreId) -> Result<()> {
        let core = self.inner.core_by_id(id)?;
        core.counters().reset();
        core.latency().reset();
        core.classes().reset();
        Ok(())
    }

    /// One core's request latency histograms.
    pub fn core_latency(&self, id: CoreId) -> Result<LatencyStats> {
        Ok(self.inner.core_by_id(id)?.latency().snapshot())
    }

    /// Request latency histograms of every attached core, merged.
    pub fn latency(&self) -> LatencyStats {
        let mut all = LatencyStats::default();
        for core in self.inner.cores.active().values() {
            all.merge(&core.latency().snapshot());
        }
        all
    }

    /// Reset every core's counters, and the cache device's error count: a cache in fallback
    /// pass-through caches again (as Open CAS's `casadm -Z`).
    pub fn reset_stats(&self) {
        for core in self.inner.cores.active().values() {
            core.counters().reset();
            core.latency().reset();
            core.classes().reset();
        }
        self.inner.devices.fallback().reset();
    }

    /// Bytes of RAM the per-line metadata takes, over the whole cache.
    pub fn metadata_bytes(&self) -> u64 {
        self.inner.lines.table().bytes()
            + self.inner.lines.lists().bytes()
            + self.inner.persist.as_ref().map_or(0, |p| p.bytes())
            + self.inner.promotion.table().map_or(0, |t| t.bytes())
            + self.inner.lines.classes().bytes()
            + self.inner.prefetch.bytes()
    }

    /// Check internal invariants (list membership, counters, hash chains); panics with a
    /// description when one is broken. Costs O(lines) and expects no request in flight: for tests.
    pub fn check_invariants(&self) {
        self.inner.check_invariants()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::meta::Key;
    use crate::policy::{Prefetch, PrefetchPolicy};
    use crate::write::ROOM_WAIT;
    use hybridcache_volume::RamVolume;

    const KIB: u64 = 1024;

    fn cache(mode: CacheMode) -> (Cache, Core, CoreId) {
        let line = LineSize::from_kib(4).unwrap();
        let vol: VolumeRef = Arc::new(RamVolume::new("ram:cache", 256 * 4 * KIB).unwrap());
        let config = CacheConfig {
            id: 1,
            line_size: line,
            mode,
        };
        let cache = Cache::new(vol, config).unwrap();
        let core_vol: VolumeRef = Arc::new(RamVolume::new("ram:core", 1 << 20).unwrap());
        let id = cache.add_core(core_vol, None).unwrap();
        let core = cache.core(id).unwrap();
        (cache, core, id)
    }

    /// A hit that finds its line's stripe held by another request is served once the stripe is
    /// free, and counted as a hit and as deferred; a hit that takes its stripe at once is not
    /// deferred, and neither is a miss that waited (Open CAS counts a deferred hit only).
    #[test]
    fn a_hit_that_waits_for_a_stripe_is_deferred() {
        let (cache, core, id) = cache(CacheMode::Wt);
        core.write(&[1u8; 4096], 0).unwrap();
        let stripe = cache.inner.lines.table().stripe(Key::new(id, 0));
        let miss_stripe = cache.inner.lines.table().stripe(Key::new(id, 1));
        let mut stripes = vec![stripe, miss_stripe];
        stripes.sort_unstable();
        stripes.dedup();
        let held = cache.inner.lines.locks().lock_sorted(stripes);
        let waiters: Vec<_> = [(0, true), (0, false), (4096, true)]
            .into_iter()
            .map(|(off, read)| {
                let core = core.clone();
                std::thread::spawn(move || {
                    if read {
                        let mut buf = [0u8; 4096];
                        core.read(&mut buf, off).unwrap();
                    } else {
                        core.write(&[2u8; 4096], off).unwrap();
                    }
                })
            })
            .collect();
        // Long enough for the three requests to reach the held stripes.
        std::thread::sleep(std::time::Duration::from_millis(300));
        drop(held);
        for w in waiters {
            w.join().unwrap();
        }
        let mut buf = [0u8; 4096];
        core.read(&mut buf, 0).unwrap();

        let r = cache.core_stats(id).unwrap().requests;
        assert_eq!((r.read_hits, r.read_deferred), (2, 1), "{r:?}");
        assert_eq!(r.read_full_misses, 1, "{r:?}");
        // The first write was a miss, the second a hit that waited.
        assert_eq!((r.write_hits, r.write_deferred), (1, 1), "{r:?}");
        assert_eq!(r.write_full_misses, 1, "{r:?}");
        assert_eq!(cache.stats().requests.read_deferred, 1);

        cache.reset_stats();
        let r = cache.core_stats(id).unwrap().requests;
        assert_eq!((r.read_deferred, r.write_deferred), (0, 0));
    }

    /// A persistent write-back cache full of dirty lines, each of a core line apart from the
    /// others (one core write each when cleaned), with the background cleaner stopped.
    fn full_persistent_cache() -> (Cache, Core, CoreId) {
        let vol: VolumeRef = Arc::new(RamVolume::new("ram:cache", 8 << 20).unwrap());
        let config = CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        };
        let cache = Cache::create(vol, config, true).unwrap();
        cache.stop_background_cleaner();
        let core_vol: VolumeRef = Arc::new(RamVolume::new("ram:core", 64 << 20).unwrap());
        let id = cache.add_core(core_vol, None).unwrap();
        let core = cache.core(id).unwrap();
        for i in 0..cache.line_count() {
            core.write(&[1u8; 4096], i * 8 * KIB).unwrap();
        }
        assert_eq!(cache.stats().usage.dirty_lines, cache.line_count());
        // Recorded dirty on the device: from now on a cleaned line needs a commit to be reused.
        cache.inner.commit().unwrap();
        (cache, core, id)
    }

    fn lazy_writes(cache: &Cache) -> u64 {
        cache.stats().requests.lazy_flush_writes
    }

    /// A room request cleans a large batch, sorted into one sweep of the core, whatever the
    /// policy's own batch: plain alru's 100-line batches crossed the whole region each time and
    /// drained a full cache in front of the study's RAID at 740 lines/s, 4,096-line batches at
    /// 1,270 (issue 20). An eighth of a small cache at most: not every dirty line of it.
    #[test]
    fn a_room_request_cleans_a_large_batch_whatever_the_policy() {
        let (cache, _core, _) = full_persistent_cache();
        let cfg = cache.cleaning();
        assert_eq!(cfg.policy, crate::policy::CleaningPolicy::Alru);
        assert!(cfg.alru.flush_max_buffers < 128);
        let lines = cache.line_count();
        let dirty = cache.stats().usage.dirty_lines;
        assert_eq!(dirty, lines);
        assert!(lines / 8 > 128, "{lines}");
        cache.inner.cleaner_signal.want_room();
        let tick = cache.cleaner_tick(1);
        // An eighth of this small cache (about 250 of 2,000 lines), not the policy's 100.
        assert_eq!(tick.cleaned, lines / 8, "{tick:?}");
        assert_eq!(cache.stats().usage.dirty_lines, lines - lines / 8);
        cache.check_invariants();
    }

    /// Background cleaning on a persistent cache commits part way through a batch while writes
    /// want room, so the lines it cleaned become reusable before the batch ends; cleaning that
    /// does not commit ahead leaves them durably dirty and a write that finds no line goes to
    /// the core.
    #[test]
    fn background_cleaning_commits_ahead_so_cleaned_lines_are_reusable() {
        let (cache, core, _) = full_persistent_cache();
        let inner = &cache.inner;
        let all: Vec<u32> = (0..inner.lines.count()).collect();
        let far = inner.lines.count() as u64 * 8 * KIB;

        // Not background cleaning (as a flush's): no commit ahead, nothing reusable yet.
        inner.cleaner_signal.want_room();
        let half: Vec<u32> = all[..all.len() / 2].to_vec();
        inner.clean_lines(half, 1, false).unwrap();
        assert_eq!(cache.cleaning_stats().ahead_commits, 0);
        let before = lazy_writes(&cache);
        core.write(&[2u8; 4096], far).unwrap();
        assert_eq!(
            lazy_writes(&cache),
            before + 1,
            "a cleaned, uncommitted line was reused"
        );
        inner.commit().unwrap();

        // Background cleaning, writes wanting room: commits between its core writes.
        // The half cleaned above is reusable now: fill it with dirty lines again.
        for i in 0..(inner.lines.count() as u64) {
            core.write(&[3u8; 4096], far + (i + 1) * 8 * KIB).unwrap();
        }
        inner.commit().unwrap();
        inner.cleaner_signal.want_room();
        let dirty: Vec<u32> = (0..inner.lines.count())
            .filter(|&l| inner.lines.table().dirty(l) != 0)
            .collect();
        assert!(dirty.len() as u64 > crate::commit::AHEAD_LINES * 2);
        // Past the interval since the commit above.
        std::thread::sleep(std::time::Duration::from_millis(
            crate::commit::AHEAD_INTERVAL_MS + 5,
        ));
        inner.clean_lines(dirty, 1, true).unwrap();
        let before = lazy_writes(&cache);
        core.write(&[4u8; 4096], 2 * far + 8 * KIB).unwrap();
        assert_eq!(
            lazy_writes(&cache),
            before,
            "no cleaned line was committed ahead"
        );
        assert!(cache.cleaning_stats().ahead_commits >= 1);
        cache.check_invariants();
    }

    /// Between two room batches (one asked for, none under way yet) a write that finds no line
    /// waits for the next batch like one that comes during a batch. It went to the core at
    /// once: with a stream of 64 KiB writes into a full cache in front of the study RAID, each
    /// gap between back-to-back batches sent some to the core, each a part of a RAID stripe
    /// (a read-modify-write in the disks' queues ahead of cleaning's whole stripes; issue 20).
    #[test]
    fn a_write_waits_for_a_room_batch_asked_for_but_not_begun() {
        let (cache, core, _) = full_persistent_cache();
        let sig = cache.inner.cleaner_signal.clone();
        let far = cache.line_count() * 8 * KIB;
        // As if the cleaner thread ran, between two batches, with room asked for.
        sig.set_running(true);
        assert_eq!(sig.batches_under_way(), 0);
        sig.want_room();
        let before = lazy_writes(&cache);
        let writer = {
            let core = core.clone();
            std::thread::spawn(move || core.write(&[2u8; 4096], far).unwrap())
        };
        // The write waits (counted among the waiters) until room is made, here by the batch.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while sig.waiting() == 0 && !writer.is_finished() {
            assert!(std::time::Instant::now() < deadline);
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        let waited = !writer.is_finished();
        if waited {
            cache.cleaner_tick(1);
        }
        writer.join().unwrap();
        sig.set_running(false);
        assert!(waited, "the write did not wait for the batch asked for");
        assert_eq!(lazy_writes(&cache), before, "the write went to the core");
        cache.check_invariants();
    }

    /// While writes wait for a line, a write that has not waited does not take one ahead of
    /// them: it joins the wait (and takes a line when woken, or at its deadline).
    #[test]
    fn a_write_queues_behind_writes_waiting_for_a_line() {
        use std::time::{Duration, Instant};
        let (cache, core, _) = cache(CacheMode::Wb);
        cache.stop_background_cleaner();
        let sig = cache.inner.cleaner_signal.clone();
        // As if background cleaning were under way.
        sig.set_running(true);
        let under_way = sig.batch();
        let t = Instant::now();
        core.write(&[1u8; 4096], 0).unwrap();
        assert!(t.elapsed() < ROOM_WAIT / 2, "nobody waits: no queue");

        let waiting = sig.join_waiters();
        let waker = {
            let sig = sig.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(30));
                sig.room_made();
            })
        };
        let t = Instant::now();
        core.write(&[2u8; 4096], 4096).unwrap();
        let took = t.elapsed();
        waker.join().unwrap();
        assert!(took >= Duration::from_millis(25), "did not queue: {took:?}");
        assert!(took < ROOM_WAIT, "not woken: {took:?}");
        // It took a free line when woken: cached, not sent to the core.
        assert_eq!(cache.stats().requests.lazy_flush_writes, 0);
        assert_eq!(cache.stats().usage.dirty_lines, 2);
        drop(waiting);
        drop(under_way);
        sig.set_running(false);
    }

    /// Commits ahead of need are bounded: not before `AHEAD_INTERVAL_MS` since the last commit
    /// began, not with fewer than `AHEAD_LINES` lines waiting unless `AHEAD_STALE_MS` have
    /// passed, never with no line waiting, and not while free lines are plenty and no write
    /// wants room.
    #[test]
    fn commits_ahead_of_need_are_bounded() {
        use crate::commit::{AHEAD_INTERVAL_MS, AHEAD_LINES, AHEAD_STALE_MS};
        use std::time::Duration;
        let (cache, _core, _) = full_persistent_cache();
        let inner = &cache.inner;
        let sig = &inner.cleaner_signal;
        let ahead = || cache.cleaning_stats().ahead_commits;
        inner.commit().unwrap();
        sig.want_room();
        assert_eq!(
            sig.uncommitted(),
            0,
            "the commit above took every cleaned line"
        );
        sig.cleaned_uncommitted(AHEAD_LINES);
        inner.commit_ahead();
        assert_eq!(ahead(), 0, "within the interval");
        std::thread::sleep(Duration::from_millis(AHEAD_INTERVAL_MS + 5));
        inner.commit_ahead();
        assert_eq!(ahead(), 1);
        assert_eq!(sig.uncommitted(), 0);

        std::thread::sleep(Duration::from_millis(AHEAD_INTERVAL_MS + 5));
        inner.commit_ahead();
        assert_eq!(ahead(), 1, "no line waiting");
        sig.cleaned_uncommitted(1);
        inner.commit_ahead();
        assert_eq!(ahead(), 1, "too few lines, too soon");
        std::thread::sleep(Duration::from_millis(AHEAD_STALE_MS));
        inner.commit_ahead();
        assert_eq!(ahead(), 2, "few lines, but waiting long");

        // The cache is full (no free line): the low-water mark asks for commits even with no
        // write wanting room; the flag is cleared as the cleaner's tick clears it.
        sig.take_room_request();
        std::thread::sleep(Duration::from_millis(AHEAD_STALE_MS));
        assert_eq!(
            sig.uncommitted(),
            0,
            "the commit above took every cleaned line"
        );
        sig.cleaned_uncommitted(AHEAD_LINES);
        inner.commit_ahead();
        assert_eq!(ahead(), 3, "free lines under the low-water mark");
    }

    /// The cleaner's writes are counted on their core (requests and blocks) as internal work,
    /// outside the client request totals; `-Z` resets them.
    #[test]
    fn cleaner_writes_are_counted_on_their_core() {
        let (cache, core, id) = cache(CacheMode::Wb);
        // Two neighbouring dirty lines and one apart: at least two core writes.
        core.write(&[1u8; 8192], 0).unwrap();
        core.write(&[2u8; 4096], 64 * KIB).unwrap();
        cache.flush().unwrap();
        let s = cache.core_stats(id).unwrap();
        assert!(s.requests.cleaner_requests >= 2, "{s:?}");
        assert_eq!(s.blocks.cleaner_core_written_bytes, 12 * KIB);
        assert_eq!(s.blocks.cleaner_cache_read_bytes, 12 * KIB);
        assert_eq!(s.requests.total(), 2, "cleaning is no client request");
        assert_eq!(
            cache.stats().requests.cleaner_requests,
            s.requests.cleaner_requests
        );
        cache.reset_stats();
        let s = cache.core_stats(id).unwrap();
        assert_eq!(s.requests.cleaner_requests, 0);
        assert_eq!(s.blocks.cleaner_core_written_bytes, 0);
    }

    /// Read-ahead counts its request, the blocks it read from the core and those it wrote to
    /// the cache, none of them as a client request; `-Z` resets them.
    #[test]
    fn readahead_counts_its_requests_and_blocks() {
        let (cache, core, id) = cache(CacheMode::Wt);
        cache.stop_background_prefetch();
        cache
            .set_prefetch(Prefetch {
                policy: PrefetchPolicy::Readahead,
                threshold_kib: 8,
                distance_kib: 64,
                max_in_flight: 4,
            })
            .unwrap();
        let mut buf = [0u8; 4096];
        core.read(&mut buf, 0).unwrap();
        core.read(&mut buf, 4096).unwrap();
        assert_eq!(cache.run_prefetch(), 1);
        let s = cache.core_stats(id).unwrap();
        assert_eq!(s.requests.prefetch_requests, 1);
        assert_eq!(s.blocks.prefetch_read_bytes, 64 * KIB);
        assert_eq!(s.blocks.prefetch_written_bytes, 64 * KIB);
        assert_eq!(s.requests.total(), 2, "read-ahead is no client request");
        cache.reset_stats();
        let s = cache.core_stats(id).unwrap();
        assert_eq!(s.requests.prefetch_requests, 0);
        assert_eq!(s.blocks.prefetch_written_bytes, 0);
    }
}

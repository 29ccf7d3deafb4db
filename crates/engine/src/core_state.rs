//! A core as the cache serves it: its device, counters, sequential-cutoff and read-ahead
//! streams, the requests in flight on it, and the per-core line gauges.
//!
//! Invariants:
//! - `CoreState` is created when a core is attached (or loaded) and shared by its exported
//!   volume and the cache's registry; its device and size never change afterwards.
//! - A request runs between [`CoreState::enter`] and the drop of its [`Entered`]: once
//!   removal or stop has begun (`quiesce`), no new request enters, and `quiesce` returns only
//!   when every request that entered has left. Both sides use SeqCst, so either the remover
//!   sees the request or the request sees the removal.
//! - `CoreGauges` (one per core id, owned by the cache, not by `CoreState`, so that a line
//!   can be counted without looking its core up) are changed only by the line room
//!   (cache.rs: `insert_line`, `update_line`, eviction) while it holds the line's stripe;
//!   `dirty_since_ms` changes only on the 0 <-> 1 transitions of `dirty`.
//! - `unflushed` is set (`mark_unflushed`) after every write that reached the device and
//!   cleared (`take_unflushed`) only by a commit that then flushes it (commit.rs), so a commit
//!   that records a line clean has flushed the core write that cleaned it.
//! - `failing` is set by a failed core write or flush and cleared by a successful flush
//!   (`set_failing`); commits and cleaning read it through `failing`.
//! - Both structs keep their fields private: the other rooms read a core's parts through
//!   `#[inline]` accessors (references to the counters, streams, latency; copies of id and
//!   size), and change only the gauges, through the line room.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use hybridcache_volume::VolumeRef;
use parking_lot::{Mutex, RwLock, RwLockReadGuard};

use crate::classes::{CoreClassCounters, CoreClassGauges};
use crate::core_flush::CoreWatch;
use crate::format::CoreRecord;
use crate::latency::Latency;
use crate::policy::{SeqCutoff, SeqState};
use crate::prefetch::ReadStreams;
use crate::stats::{thread_slot, Counters, SLOTS};
use crate::{CoreId, EngineError, Result, MAX_CORE_ID};

/// Size of an acp chunk of core address space.
pub(crate) const ACP_CHUNK_BYTES: u64 = 100 << 20;
#[derive(Default)]
pub(crate) struct CoreGauges {
    occupancy: AtomicU64,
    dirty: AtomicU64,
    /// When the core last went from no dirty line to some (ms on the process clock), 0 while
    /// clean: "Dirty for" in -P. Written only on those transitions, never per request.
    dirty_since_ms: AtomicU64,
    /// Dirty lines per 100 MiB chunk of the core, for acp. Sized when the core is attached.
    chunks: RwLock<Box<[AtomicU32]>>,
    /// The core's device failed a write or a flush, and no flush has succeeded since: commits
    /// record its lines dirty (persist.rs) and background cleaning passes it by.
    failing: AtomicBool,
    /// The core's lines by IO class (`-P -j CORE -d`).
    classes: CoreClassGauges,
}

impl CoreGauges {
    /// Lines mapped to the core.
    #[inline]
    pub(crate) fn occupancy(&self) -> u64 {
        self.occupancy.load(Ordering::Relaxed)
    }

    /// Dirty lines of the core.
    #[inline]
    pub(crate) fn dirty(&self) -> u64 {
        self.dirty.load(Ordering::Relaxed)
    }

    /// Recovery counted the core's lines: set the gauges before any request runs.
    pub(crate) fn restore(&self, occupancy: u64, dirty: u64) {
        self.occupancy.store(occupancy, Ordering::Relaxed);
        self.dirty.store(dirty, Ordering::Relaxed);
    }

    #[inline]
    pub(crate) fn occupancy_up(&self) {
        self.occupancy.fetch_add(1, Ordering::Relaxed);
    }

    #[inline]
    pub(crate) fn occupancy_down(&self) {
        let was = self.occupancy.fetch_sub(1, Ordering::Relaxed);
        debug_assert!(was > 0, "a core's occupancy went below 0");
    }

    /// Whether the core's device is failing (see `failing`).
    #[inline]
    pub(crate) fn failing(&self) -> bool {
        self.failing.load(Ordering::SeqCst)
    }

    /// Mark the core's device failing, or recovered; returns whether it was failing.
    pub(crate) fn set_failing(&self, failing: bool) -> bool {
        self.failing.swap(failing, Ordering::SeqCst)
    }

    /// The core's lines by IO class.
    #[inline]
    pub(crate) fn classes(&self) -> &CoreClassGauges {
        &self.classes
    }

    /// Dirty lines per acp chunk, under the chunks' read lock.
    pub(crate) fn chunks(&self) -> RwLockReadGuard<'_, Box<[AtomicU32]>> {
        self.chunks.read()
    }

    /// Replace the acp chunk counters (the core was attached or loaded).
    pub(crate) fn set_chunks(&self, counts: Box<[AtomicU32]>) {
        *self.chunks.write() = counts;
    }

    /// Count a line of chunk `i` becoming dirty (`up`) or clean.
    #[inline]
    pub(crate) fn chunk_dirty(&self, i: u64, up: bool) {
        let chunks = self.chunks.read();
        if let Some(c) = chunks.get(i as usize) {
            if up {
                c.fetch_add(1, Ordering::Relaxed);
            } else {
                c.fetch_sub(1, Ordering::Relaxed);
            }
        }
    }

    pub(crate) fn dirty_up(&self) {
        if self.dirty.fetch_add(1, Ordering::Relaxed) == 0 {
            let _ = self.dirty_since_ms.compare_exchange(
                0,
                clock_ms(),
                Ordering::Relaxed,
                Ordering::Relaxed,
            );
        }
    }

    pub(crate) fn dirty_down(&self) {
        if self.dirty.fetch_sub(1, Ordering::Relaxed) == 1 {
            self.dirty_since_ms.store(0, Ordering::Relaxed);
        }
    }

    /// How long the core has held dirty data; None while clean. A race between the last line
    /// going clean and a new one going dirty can leave the mark unset: it is set on read then.
    pub(crate) fn dirty_for(&self) -> Option<std::time::Duration> {
        if self.dirty() == 0 {
            return None;
        }
        let now = clock_ms();
        let since =
            match self
                .dirty_since_ms
                .compare_exchange(0, now, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => now,
                Err(since) => since,
            };
        Some(std::time::Duration::from_millis(now.saturating_sub(since)))
    }
}

/// Milliseconds on a process-wide monotonic clock, never 0 (0 means "unset").
fn clock_ms() -> u64 {
    static START: OnceLock<std::time::Instant> = OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
        + 1
}

#[repr(align(128))]
struct InFlight(AtomicU64);

pub(crate) struct CoreState {
    id: CoreId,
    volume: VolumeRef,
    size: u64,
    counters: Counters,
    /// Set when the core is being removed or the cache stopped; new requests are refused.
    removed: AtomicBool,
    stopped: AtomicBool,
    /// Requests in progress, per thread slot; removal waits for these to drain.
    in_flight: Box<[InFlight]>,
    seq: SeqState,
    /// Writes reached the device since its last flush: the next commit flushes it.
    unflushed: AtomicBool,
    read_streams: ReadStreams,
    latency: Latency,
    /// The core's requests and blocks by IO class (`-P -j CORE -d`).
    classes: CoreClassCounters,
    /// Its device's outstanding writes and flushes, to bound flushes on a hung device
    /// (core_flush.rs).
    watch: Arc<CoreWatch>,
}

/// Held by a request for its duration; see [`CoreState::enter`].
pub(crate) struct Entered<'a>(&'a CoreState, usize);

impl CoreState {
    pub(crate) fn new(id: CoreId, volume: VolumeRef, seq: SeqCutoff) -> CoreState {
        CoreState {
            id,
            size: volume.size(),
            volume,
            counters: Counters::new(),
            removed: AtomicBool::new(false),
            stopped: AtomicBool::new(false),
            in_flight: (0..SLOTS).map(|_| InFlight(AtomicU64::new(0))).collect(),
            seq: SeqState::new(seq),
            unflushed: AtomicBool::new(false),
            read_streams: ReadStreams::default(),
            latency: Latency::new(),
            classes: CoreClassCounters::default(),
            watch: Arc::new(CoreWatch::default()),
        }
    }

    #[inline]
    pub(crate) fn id(&self) -> CoreId {
        self.id
    }

    #[inline]
    pub(crate) fn volume(&self) -> &VolumeRef {
        &self.volume
    }

    /// The core device's size in bytes (fixed at attach).
    #[inline]
    pub(crate) fn size(&self) -> u64 {
        self.size
    }

    #[inline]
    pub(crate) fn counters(&self) -> &Counters {
        &self.counters
    }

    /// The sequential cutoff's streams and setting.
    #[inline]
    pub(crate) fn seq(&self) -> &SeqState {
        &self.seq
    }

    #[inline]
    pub(crate) fn read_streams(&self) -> &ReadStreams {
        &self.read_streams
    }

    #[inline]
    pub(crate) fn latency(&self) -> &Latency {
        &self.latency
    }

    /// The core's requests and blocks by IO class.
    #[inline]
    pub(crate) fn classes(&self) -> &CoreClassCounters {
        &self.classes
    }

    /// Its device's outstanding writes and flushes (core_flush.rs).
    #[inline]
    pub(crate) fn watch(&self) -> &Arc<CoreWatch> {
        &self.watch
    }

    /// A write reached the core's device: the next commit flushes it. Set before the write is
    /// reported done, so a commit that sees the write's effect sees this too.
    #[inline]
    pub(crate) fn mark_unflushed(&self) {
        self.unflushed.store(true, Ordering::SeqCst);
    }

    /// A commit takes the mark to flush the device; whether it was set.
    pub(crate) fn take_unflushed(&self) -> bool {
        self.unflushed.swap(false, Ordering::SeqCst)
    }

    /// Register a request. Fails once removal has begun. The increment comes before the check
    /// (both SeqCst) and removal sets the flag before summing, so either removal sees this request
    /// or this request sees removal.
    pub(crate) fn enter(&self) -> Result<Entered<'_>> {
        let slot = thread_slot() % SLOTS;
        self.in_flight[slot].0.fetch_add(1, Ordering::SeqCst);
        let entered = Entered(self, slot);
        if self.removed.load(Ordering::SeqCst) {
            return Err(if self.stopped.load(Ordering::SeqCst) {
                EngineError::Stopped
            } else {
                EngineError::CoreRemoved(self.id)
            });
        }
        Ok(entered)
    }

    /// Stop new requests and wait for those in flight.
    pub(crate) fn quiesce(&self) {
        self.removed.store(true, Ordering::SeqCst);
        while self.in_flight() != 0 {
            std::thread::yield_now();
        }
    }

    /// The cache stops: new requests are refused as `Stopped`, those in flight are waited for.
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::SeqCst);
        self.quiesce();
    }

    /// Begin removing the core: false when a removal is under way already. Then quiesce.
    pub(crate) fn begin_removal(&self) -> bool {
        !self.removed.swap(true, Ordering::SeqCst)
    }

    /// A removal was refused or failed: the core serves requests again.
    pub(crate) fn cancel_removal(&self) {
        self.removed.store(false, Ordering::SeqCst);
    }

    fn in_flight(&self) -> u64 {
        self.in_flight
            .iter()
            .map(|c| c.0.load(Ordering::SeqCst))
            .sum()
    }
}

impl Drop for Entered<'_> {
    fn drop(&mut self) {
        let was = self.0.in_flight[self.1].0.fetch_sub(1, Ordering::SeqCst);
        debug_assert!(
            was > 0,
            "a request left core {} without entering",
            self.0.id
        );
    }
}

/// A cache's registry of cores: the active ones (attached, serving requests) and the inactive
/// ones (recorded in the superblock, their device missing since the load), each inactive one
/// with the seq cutoff settings it gets back when it returns.
///
/// Invariants: an id is active or inactive, never both (checked whenever one is registered;
/// always on, since two states of one core would count its lines twice); an active core is
/// registered from the end of its attach to the start of its removal.
///
/// Changes (add, activate, remove, load) run one at a time under `changes`, which is held while
/// a change writes the superblock; `active` and `inactive` are only ever held briefly, never
/// across a device write or another room's lock. A commit holds persistence's lock while it
/// looks the cores up to flush them: an add that held `active` across its superblock write
/// (which waits for that lock) would wait for the commit forever, and the commit for it.
#[derive(Default)]
pub(crate) struct Cores {
    changes: Mutex<()>,
    active: RwLock<BTreeMap<CoreId, Arc<CoreState>>>,
    inactive: RwLock<BTreeMap<CoreId, (CoreRecord, SeqCutoff)>>,
}

impl Cores {
    /// Active core `id`.
    #[inline]
    pub(crate) fn get(&self, id: CoreId) -> Option<Arc<CoreState>> {
        self.active.read().get(&id).cloned()
    }

    /// The active cores, for a look at each of them (the registry cannot change meanwhile).
    pub(crate) fn active(&self) -> RwLockReadGuard<'_, BTreeMap<CoreId, Arc<CoreState>>> {
        self.active.read()
    }

    /// The active cores as they are now, to work on without holding the registry.
    pub(crate) fn all(&self) -> Vec<Arc<CoreState>> {
        self.active.read().values().cloned().collect()
    }

    pub(crate) fn is_inactive(&self, id: CoreId) -> bool {
        self.inactive.read().contains_key(&id)
    }

    /// Whether `id` names a core of the cache, active or inactive.
    pub(crate) fn known(&self, id: CoreId) -> bool {
        self.active.read().contains_key(&id) || self.inactive.read().contains_key(&id)
    }

    /// The inactive cores' records, by id.
    pub(crate) fn inactive_records(&self) -> Vec<CoreRecord> {
        self.inactive
            .read()
            .values()
            .map(|(r, _)| r.clone())
            .collect()
    }

    /// Every core's seq cutoff, the inactive ones' as kept for their return.
    pub(crate) fn seq_cutoffs(&self) -> BTreeMap<CoreId, SeqCutoff> {
        let mut out: BTreeMap<CoreId, SeqCutoff> = self
            .inactive
            .read()
            .iter()
            .map(|(id, (_, s))| (*id, *s))
            .collect();
        for (id, c) in self.active.read().iter() {
            out.insert(*id, c.seq().params());
        }
        out
    }

    /// Inactive core `id`'s seq cutoff.
    pub(crate) fn inactive_seq_cutoff(&self, id: CoreId) -> Option<SeqCutoff> {
        self.inactive.read().get(&id).map(|(_, s)| *s)
    }

    /// Give inactive core `id` the seq cutoff `params`; its previous one, or None when `id` is
    /// not inactive.
    pub(crate) fn replace_inactive_seq_cutoff(
        &self,
        id: CoreId,
        params: SeqCutoff,
    ) -> Option<SeqCutoff> {
        let mut inactive = self.inactive.write();
        inactive
            .get_mut(&id)
            .map(|(_, s)| std::mem::replace(s, params))
    }

    /// Give every inactive core the seq cutoff `params`.
    pub(crate) fn set_inactive_seq_cutoffs(&self, params: SeqCutoff) {
        for (_, s) in self.inactive.write().values_mut() {
            *s = params;
        }
    }

    /// Add a core with id `id`, or the lowest free one as casadm's find_free_core_id (from 1,
    /// and 0 only when every other is taken, so that ids given without -j match Open CAS's).
    /// `make` records and builds it; no other change of the registry runs meanwhile, so the id
    /// stays free.
    pub(crate) fn add(
        &self,
        id: Option<CoreId>,
        make: impl FnOnce(CoreId) -> Result<Arc<CoreState>>,
    ) -> Result<CoreId> {
        let _change = self.changes.lock();
        let id = self.free_id(id)?;
        let state = make(id)?;
        assert_eq!(state.id(), id, "core {id} registered under its own id");
        self.active.write().insert(id, state);
        Ok(id)
    }

    /// `id` if it is free, or the lowest free id (see `add`).
    fn free_id(&self, id: Option<CoreId>) -> Result<CoreId> {
        let active = self.active.read();
        let inactive = self.inactive.read();
        let taken = |i: &CoreId| active.contains_key(i) || inactive.contains_key(i);
        Ok(match id {
            Some(id) if id as u32 > MAX_CORE_ID => return Err(EngineError::BadCoreId(id as u32)),
            Some(id) if taken(&id) => return Err(EngineError::DuplicateCore(id)),
            Some(id) => id,
            None => (1..=MAX_CORE_ID as CoreId)
                .chain([0])
                .find(|i| !taken(i))
                .ok_or(EngineError::TooManyCores)?,
        })
    }

    /// Bring inactive core `id` back: `make` checks its record, records where it is now and
    /// builds it from its kept seq cutoff; no other change of the registry runs meanwhile.
    pub(crate) fn activate(
        &self,
        id: CoreId,
        make: impl FnOnce(&CoreRecord, SeqCutoff) -> Result<Arc<CoreState>>,
    ) -> Result<()> {
        let _change = self.changes.lock();
        let found = self.inactive.read().get(&id).cloned();
        let Some((rec, seq)) = found else {
            return Err(if self.active.read().contains_key(&id) {
                EngineError::DuplicateCore(id)
            } else {
                EngineError::NoSuchCore(id)
            });
        };
        let state = make(&rec, seq)?;
        assert_eq!(state.id(), id, "core {id} registered under its own id");
        // A seq cutoff set on the inactive core while `make` ran is the one it comes back with.
        if let Some((_, seq)) = self.inactive.write().remove(&id) {
            state.seq().set_params(seq);
        }
        self.active.write().insert(id, state);
        Ok(())
    }

    /// Forget core `id`, active or inactive (its removal has completed).
    pub(crate) fn remove(&self, id: CoreId) {
        let _change = self.changes.lock();
        self.active.write().remove(&id);
        self.inactive.write().remove(&id);
    }

    /// Register the cores a load found: `active` with their devices, `inactive` with the seq
    /// cutoff each keeps for its return.
    pub(crate) fn load(
        &self,
        active: Vec<Arc<CoreState>>,
        inactive: BTreeMap<CoreId, (CoreRecord, SeqCutoff)>,
    ) {
        let _change = self.changes.lock();
        let mut a = self.active.write();
        let mut i = self.inactive.write();
        for c in active {
            assert!(
                !inactive.contains_key(&c.id()),
                "core {} loaded both active and inactive",
                c.id()
            );
            a.insert(c.id(), c);
        }
        *i = inactive;
    }
}

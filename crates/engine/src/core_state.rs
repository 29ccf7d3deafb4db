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
//! - `unflushed` is set after every write that reached the device and cleared only by a
//!   commit that flushed it (persist.rs), so a commit that records a line clean has flushed the
//!   core write that cleaned it.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

use hybridcache_volume::VolumeRef;
use parking_lot::RwLock;

use crate::classes::{CoreClassCounters, CoreClassGauges};
use crate::core_flush::CoreWatch;
use crate::latency::Latency;
use crate::policy::{SeqCutoff, SeqState};
use crate::prefetch::ReadStreams;
use crate::stats::{thread_slot, Counters, SLOTS};
use crate::{CoreId, EngineError, Result};

/// Size of an acp chunk of core address space.
pub(crate) const ACP_CHUNK_BYTES: u64 = 100 << 20;
#[derive(Default)]
pub(crate) struct CoreGauges {
    pub(crate) occupancy: AtomicU64,
    pub(crate) dirty: AtomicU64,
    /// When the core last went from no dirty line to some (ms on the process clock), 0 while
    /// clean: "Dirty for" in -P. Written only on those transitions, never per request.
    dirty_since_ms: AtomicU64,
    /// Dirty lines per 100 MiB chunk of the core, for acp. Sized when the core is attached.
    pub(crate) chunks: RwLock<Box<[std::sync::atomic::AtomicU32]>>,
    /// The core's device failed a write or a flush, and no flush has succeeded since: commits
    /// record its lines dirty (persist.rs) and background cleaning passes it by.
    pub(crate) failing: AtomicBool,
    /// The core's lines by IO class (`-P -j CORE -d`).
    pub(crate) classes: CoreClassGauges,
}

impl CoreGauges {
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
        if self.dirty.load(Ordering::Relaxed) == 0 {
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
    pub(crate) id: CoreId,
    pub(crate) volume: VolumeRef,
    pub(crate) size: u64,
    pub(crate) counters: Counters,
    /// Set when the core is being removed or the cache stopped; new requests are refused.
    removed: AtomicBool,
    stopped: AtomicBool,
    /// Requests in progress, per thread slot; removal waits for these to drain.
    in_flight: Box<[InFlight]>,
    pub(crate) seq: SeqState,
    /// Writes reached the device since its last flush: the next commit flushes it.
    pub(crate) unflushed: AtomicBool,
    pub(crate) read_streams: ReadStreams,
    pub(crate) latency: Latency,
    /// The core's requests and blocks by IO class (`-P -j CORE -d`).
    pub(crate) classes: CoreClassCounters,
    /// Its device's outstanding writes and flushes, to bound flushes on a hung device
    /// (core_flush.rs).
    pub(crate) watch: Arc<CoreWatch>,
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

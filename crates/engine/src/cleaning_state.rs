//! What cleaning keeps between its ticks and batches: the policy's schedule (`CleanerState`,
//! changed only by the cleaner's tick, cleaning.rs, under the cache's `cleaner` mutex), the
//! pacing of its core writes, and the counters `-P` shows (`CleaningStats`).
//!
//! Invariants: the counters only grow (they are not reset with the request counters);
//! `in_flight` is raised before a cleaning core write is issued and lowered after it ends, and
//! `max_in_flight` is never below any value `in_flight` had.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::Relaxed};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::stats::{BackgroundErrorLog, BackgroundErrors};

/// Core writes by size, for the cleaning statistics: bucket i counts writes of at most 4 KiB << i
/// (the last bucket takes everything larger).
pub const WRITE_SIZE_BUCKETS: usize = 12;

/// What cleaning has done since the cache started (not reset with the request counters).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CleaningStats {
    /// Dirty lines written to their core and marked clean.
    pub cleaned_lines: u64,
    /// Core writes issued by cleaning, and their bytes.
    pub core_writes: u64,
    pub core_write_bytes: u64,
    /// `core_writes` by size; see [`WRITE_SIZE_BUCKETS`].
    pub write_sizes: [u64; WRITE_SIZE_BUCKETS],
    /// Most core writes cleaning had in flight at once.
    pub max_in_flight: u64,
    /// Commits background cleaning made part way through a batch so that the lines it had
    /// cleaned became reusable (persistent cache, writes wanting room).
    pub ahead_commits: u64,
    /// Core writes (and the cache reads before them) that failed; the lines stay dirty.
    pub errors: BackgroundErrors,
    /// The policy has no cleaning due: it is nop, the cache has not been idle for the activity
    /// threshold, no dirty line is old enough yet, or its last run cleaned what was due and it
    /// waits for its wake-up time. While this is false and lines are dirty, cleaning should be
    /// making progress; when it makes none, cleaning has stalled (a failing or blocked core).
    pub waiting: bool,
}

#[derive(Default)]
pub(crate) struct CleaningCounters {
    lines: AtomicU64,
    writes: AtomicU64,
    bytes: AtomicU64,
    sizes: [AtomicU64; WRITE_SIZE_BUCKETS],
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
    ahead_commits: AtomicU64,
    errors: BackgroundErrorLog,
    waiting: AtomicBool,
}

impl CleaningCounters {
    pub(crate) fn snapshot(&self) -> CleaningStats {
        CleaningStats {
            cleaned_lines: self.lines.load(Relaxed),
            core_writes: self.writes.load(Relaxed),
            core_write_bytes: self.bytes.load(Relaxed),
            write_sizes: std::array::from_fn(|i| self.sizes[i].load(Relaxed)),
            max_in_flight: self.max_in_flight.load(Relaxed),
            ahead_commits: self.ahead_commits.load(Relaxed),
            errors: self.errors.snapshot(),
            waiting: self.waiting.load(Relaxed),
        }
    }

    /// A cleaning core write is issued: counted in flight (and in the highest count seen).
    pub(crate) fn write_begins(&self) {
        let now = self.in_flight.fetch_add(1, Relaxed) + 1;
        self.max_in_flight.fetch_max(now, Relaxed);
    }

    pub(crate) fn write_ends(&self) {
        self.in_flight.fetch_sub(1, Relaxed);
    }

    /// A cleaning core write (or the cache read before it) failed on `core`.
    pub(crate) fn failed(&self, core: crate::CoreId, e: &crate::EngineError) {
        self.errors.record(core, e);
    }

    /// `n` lines were cleaned.
    pub(crate) fn cleaned(&self, n: u64) {
        self.lines.fetch_add(n, Relaxed);
    }

    /// A commit ahead of need completed.
    pub(crate) fn ahead_commit(&self) {
        self.ahead_commits.fetch_add(1, Relaxed);
    }

    /// Whether the policy has cleaning due (`CleaningStats::waiting`).
    pub(crate) fn set_waiting(&self, waiting: bool) {
        self.waiting.store(waiting, Relaxed);
    }

    pub(crate) fn record(&self, len: usize) {
        self.writes.fetch_add(1, Relaxed);
        self.bytes.fetch_add(len as u64, Relaxed);
        let bucket = (len
            .div_ceil(4096)
            .max(1)
            .next_power_of_two()
            .trailing_zeros() as usize)
            .min(WRITE_SIZE_BUCKETS - 1);
        self.sizes[bucket].fetch_add(1, Relaxed);
    }
}

/// Paces cleaning's core writes to a bandwidth cap: each write reserves its share of time.
#[derive(Default)]
pub(crate) struct Pacer {
    next: Mutex<Option<Instant>>,
}

impl Pacer {
    pub(crate) fn wait(&self, bytes: usize, mib_per_s: u32) {
        if mib_per_s == 0 {
            return;
        }
        let cost = Duration::from_secs_f64(bytes as f64 / (mib_per_s as f64 * 1048576.0));
        let now = Instant::now();
        let start = {
            let mut next = self.next.lock();
            // Unused time is not banked beyond one write's worth, so a long idle spell does not
            // turn into a burst.
            let start = next.map_or(now, |n| n.max(now.checked_sub(cost).unwrap_or(now)));
            *next = Some(start + cost);
            start
        };
        if start > now {
            std::thread::sleep(start - now);
        }
    }
}

/// What one tick did; for tests and logs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CleaningTick {
    /// The policy ran (its wake-up time had come and its conditions held).
    pub ran: bool,
    /// Lines cleaned.
    pub cleaned: u64,
    /// The policy found more work than one run may do: the next tick runs at once.
    pub more: bool,
}

/// The cleaning policy's schedule, kept between the cleaner's ticks (cleaning.rs), under the
/// cache's `cleaner` mutex. Times are the tick's clock (ms); a clock that goes back starts a
/// new schedule (`restart`).
#[derive(Default)]
pub(crate) struct CleanerState {
    /// Requests seen so far (sum of the cores' exported bytes: any change is activity).
    io_marker: u64,
    last_activity_ms: u64,
    next_run_ms: u64,
    last_fence_ms: Option<u64>,
    /// alru's dirty-ratio trigger is on (hysteresis between threshold and threshold - inertia).
    ratio_active: bool,
    /// Where alru's next run starts among the shards, so every shard gets its turn.
    next_shard: usize,
    /// The previous tick's time: a tick with an earlier one is on a new clock.
    last_now: Option<u64>,
}

impl CleanerState {
    /// Forget when the policy should next run (after a change of policy or tunables).
    pub(crate) fn reset_schedule(&mut self) {
        self.next_run_ms = 0;
        self.ratio_active = false;
    }

    /// Forget every time recorded on the old clock; the cache counts as active at `now`.
    pub(crate) fn restart(&mut self, now: u64) {
        self.last_fence_ms = None;
        self.next_run_ms = 0;
        self.last_activity_ms = now;
    }

    /// The cleaner thread stopped: whoever ticks next starts on a clock of its own.
    pub(crate) fn forget_clock(&mut self) {
        self.restart(0);
        self.last_now = None;
    }

    /// A tick at `now`: whether the clock went back since the last one (a new clock).
    pub(crate) fn tick_at(&mut self, now: u64) -> bool {
        let back = self.last_now.is_some_and(|t| now < t);
        self.last_now = Some(now);
        back
    }

    /// The requests seen so far are `marker`: a change means activity at `now`.
    pub(crate) fn requests_seen(&mut self, marker: u64, now: u64) {
        if marker != self.io_marker {
            self.io_marker = marker;
            self.last_activity_ms = now;
        }
    }

    /// How long the cache has been without requests at `now`.
    pub(crate) fn idle_for(&self, now: u64) -> u64 {
        now.saturating_sub(self.last_activity_ms)
    }

    /// Whether age marks were placed since the last restart; forgets that they were.
    pub(crate) fn take_fences(&mut self) -> bool {
        self.last_fence_ms.take().is_some()
    }

    /// Whether alru's next age marks are due at `now`, `spacing` after the last ones.
    pub(crate) fn fence_due(&self, now: u64, spacing: u64) -> bool {
        self.last_fence_ms.map_or(true, |t| now >= t + spacing)
    }

    pub(crate) fn fences_placed(&mut self, now: u64) {
        self.last_fence_ms = Some(now);
    }

    pub(crate) fn ratio_active(&self) -> bool {
        self.ratio_active
    }

    pub(crate) fn set_ratio_active(&mut self, on: bool) {
        self.ratio_active = on;
    }

    /// When the policy runs next (0: at the next tick).
    pub(crate) fn next_run_ms(&self) -> u64 {
        self.next_run_ms
    }

    pub(crate) fn run_next_at(&mut self, ms: u64) {
        self.next_run_ms = ms;
    }

    /// The shard alru's next run starts at, of `shards`; the next run starts at the one after.
    pub(crate) fn take_shard(&mut self, shards: usize) -> usize {
        debug_assert!(shards > 0);
        let first = self.next_shard % shards;
        self.next_shard = (first + 1) % shards;
        first
    }
}

//! Room waiting: how writes that find no cache line meet the cleaning that makes room.
//!
//! A write-back write that finds every line dirty (or locked) asks the cleaner thread for room
//! (`want_room`) and, while background cleaning is under way (`room_coming`), waits a little
//! for a line (`wait_room`) rather than send a random write to a busy core. Cleaning bumps the
//! room generation (`room_made`) each time lines become reusable.
//!
//! Invariants:
//! - this is the bottom room: it knows no other part of the engine, and it owns only counters
//!   and flags; which lines are free is the line room's business.
//! - `waiters` counts the live [`RoomWaiter`]s exactly (incremented by `join_waiters`,
//!   decremented on drop); while it is above 0 a write that has not waited takes no line.
//! - `active` counts the live [`CleaningBatch`]es the same way (`batch`, then drop), so a
//!   batch that ends early (an error, a panic) cannot leave writes waiting for room it will
//!   never make. The fields are private: every room goes through these methods.
//! - `uncommitted` counts lines cleaned since the last commit began: `commit_begins` takes
//!   them all, `commit_failed` gives back what a failed commit took.
//! - the room generation only grows, under its own mutex, and every bump wakes every waiter.
//! - `stopped` is set once by `stop_thread` and read under its mutex by `pause`, the mutex
//!   `want_room` notifies under.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

/// How requests reach the cleaner thread: lazy flush asks for room here instead of cleaning
/// inside the request.
#[derive(Default)]
pub(crate) struct CleanerSignal {
    stopped: Mutex<bool>,
    cv: Condvar,
    /// A write found no free or clean line and went to the core: the next tick cleans the
    /// oldest dirty lines whatever the policy (nop included).
    room_wanted: AtomicBool,
    /// The cleaner thread is running (not stopped by a test).
    running: AtomicBool,
    /// Background cleaning batches under way: lines are about to become clean.
    active: AtomicUsize,
    /// Bumped each time lines become reusable (cleaned on a volatile cache, committed clean on a
    /// persistent one), so that writes waiting for a line try again.
    room_gen: Mutex<u64>,
    room_cv: Condvar,
    /// Writes waiting for a line (`ROOM_WAIT`, cache.rs): while there are some, a write that
    /// has not waited takes no line but joins them.
    waiters: AtomicUsize,
    /// Persistent cache: lines cleaned since the last commit began. They are durably dirty
    /// (not reusable) until a commit records them clean.
    uncommitted: AtomicU64,
    /// A commit ahead of need is under way (one at a time; the other workers keep cleaning).
    committing: AtomicBool,
    /// When the last commit (of any kind) began, in ms on the signal's clock; 0 for never.
    last_commit_ms: AtomicU64,
    /// When the signal was made: the clock of `last_commit_ms`.
    epoch: OnceLock<Instant>,
}

/// One cleaning batch counted in `CleanerSignal::active`, until dropped: while it lives, writes
/// that find no line may wait for the lines it cleans.
pub(crate) struct CleaningBatch<'a>(&'a CleanerSignal);

impl Drop for CleaningBatch<'_> {
    fn drop(&mut self) {
        let was = self.0.active.fetch_sub(1, Ordering::SeqCst);
        debug_assert!(was > 0, "a cleaning batch ended that never began");
    }
}

/// One write counted in `CleanerSignal::waiters`, until dropped.
pub(crate) struct RoomWaiter<'a>(&'a CleanerSignal);

impl Drop for RoomWaiter<'_> {
    fn drop(&mut self) {
        let was = self.0.waiters.fetch_sub(1, Ordering::SeqCst);
        debug_assert!(was > 0, "a room waiter left that never joined");
    }
}

impl CleanerSignal {
    /// The cleaner thread runs (or, in tests, stands as if it ran): `room_coming` may say yes.
    pub(crate) fn set_running(&self, running: bool) {
        self.running.store(running, Ordering::SeqCst);
    }

    /// A cleaning batch begins; it is under way until the returned guard is dropped.
    #[inline]
    pub(crate) fn batch(&self) -> CleaningBatch<'_> {
        self.active.fetch_add(1, Ordering::SeqCst);
        CleaningBatch(self)
    }

    /// How many cleaning batches are under way.
    #[cfg(test)]
    pub(crate) fn batches_under_way(&self) -> usize {
        self.active.load(Ordering::SeqCst)
    }

    /// Whether a write asked for room since the cleaner last took the request.
    #[inline]
    pub(crate) fn room_wanted(&self) -> bool {
        self.room_wanted.load(Ordering::SeqCst)
    }

    /// The cleaner takes the request for room (clearing it): whether there was one.
    pub(crate) fn take_room_request(&self) -> bool {
        self.room_wanted.swap(false, Ordering::SeqCst)
    }

    /// A persistent cache's cleaning made `n` lines clean: they wait for a commit.
    #[inline]
    pub(crate) fn cleaned_uncommitted(&self, n: u64) {
        self.uncommitted.fetch_add(n, Ordering::Relaxed);
    }

    /// Lines cleaned since the last commit began.
    #[inline]
    pub(crate) fn uncommitted(&self) -> u64 {
        self.uncommitted.load(Ordering::Relaxed)
    }

    /// How many writes wait for a line now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiters.load(Ordering::SeqCst)
    }

    pub(crate) fn join_waiters(&self) -> RoomWaiter<'_> {
        self.waiters.fetch_add(1, Ordering::SeqCst);
        RoomWaiter(self)
    }

    /// When the last commit began, on [`now_ms`](Self::now_ms)'s clock; 0 for never.
    pub(crate) fn last_commit_ms(&self) -> u64 {
        self.last_commit_ms.load(Ordering::Relaxed)
    }

    /// Begin a commit ahead of need unless one is under way: whether this caller makes it.
    pub(crate) fn begin_ahead_commit(&self) -> bool {
        !self.committing.swap(true, Ordering::SeqCst)
    }

    pub(crate) fn end_ahead_commit(&self) {
        self.committing.store(false, Ordering::SeqCst);
    }

    pub(crate) fn now_ms(&self) -> u64 {
        self.epoch.get_or_init(Instant::now).elapsed().as_millis() as u64 + 1
    }

    /// A commit begins: the lines cleaned so far are in its snapshot. Returns how many, to give
    /// back with [`CleanerSignal::commit_failed`] should it fail.
    pub(crate) fn commit_begins(&self) -> u64 {
        self.last_commit_ms.store(self.now_ms(), Ordering::Relaxed);
        self.uncommitted.swap(0, Ordering::Relaxed)
    }

    /// The commit that began with `taken` cleaned lines failed: they still wait for one.
    pub(crate) fn commit_failed(&self, taken: u64) {
        self.uncommitted.fetch_add(taken, Ordering::Relaxed);
    }

    /// Whether lines are about to be made reusable, so that a write finding none may wait for
    /// one: the cleaner thread runs, and a batch is under way or a room batch has been asked
    /// for (the next tick runs it: between back-to-back room batches, neither under way).
    pub(crate) fn room_coming(&self) -> bool {
        self.running.load(Ordering::Relaxed)
            && (self.active.load(Ordering::Relaxed) > 0 || self.room_wanted.load(Ordering::Relaxed))
    }

    /// Cleaning just made lines reusable: wake the writes waiting for one.
    pub(crate) fn room_made(&self) {
        *self.room_gen.lock() += 1;
        self.room_cv.notify_all();
    }

    pub(crate) fn room_generation(&self) -> u64 {
        *self.room_gen.lock()
    }

    /// Wait until lines were made reusable after `seen`, or `deadline`. Returns whether some were.
    pub(crate) fn wait_room(&self, seen: u64, deadline: Instant) -> bool {
        let mut g = self.room_gen.lock();
        while *g == seen {
            if self.room_cv.wait_until(&mut g, deadline).timed_out() {
                return *g != seen;
            }
        }
        true
    }

    /// The cleaner thread's pause after a tick: none when the tick has `more` to do or room is
    /// wanted, else up to `wait`. False once the thread is stopped. The flag is looked at under
    /// the lock `want_room` notifies under, so a request for room cannot be missed.
    pub(crate) fn pause(&self, more: bool, wait: Duration) -> bool {
        let mut stopped = self.stopped.lock();
        if *stopped {
            return false;
        }
        if !more && !self.room_wanted.load(Ordering::SeqCst) {
            self.cv.wait_for(&mut stopped, wait);
            if *stopped {
                return false;
            }
        }
        true
    }

    /// Stop the cleaner thread: its next look at the flag ends it.
    pub(crate) fn stop_thread(&self) {
        self.running.store(false, Ordering::SeqCst);
        *self.stopped.lock() = true;
        self.cv.notify_all();
    }

    /// Ask for room and wake the thread. Only the request that raises the flag pays for the
    /// wake-up; the lock around the notify pairs with the thread's look at the flag under the
    /// same lock, so the wake-up cannot fall between that look and its wait.
    pub(crate) fn want_room(&self) {
        if !self.room_wanted.swap(true, Ordering::SeqCst) {
            let _g = self.stopped.lock();
            self.cv.notify_one();
        }
    }
}

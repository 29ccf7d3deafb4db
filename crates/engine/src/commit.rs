//! The commit protocol (persist.rs's module doc has the contract and its two rules): the
//! snapshot of changed metadata blocks, the device flushes, the block writes and the commit
//! record; commits ahead of need while writes wait for room; failing cores; the superblock's
//! note that a mirror missed writes. All of it on a `Commit`, a struct of references built by
//! whoever holds them (the holder's `committer()`, a `Cleaner`, a `Writer` through its cleaner).
//!
//! Invariants:
//! - one commit at a time (`Persist`'s state mutex); a line's metadata is snapshotted under its
//!   stripe, so the snapshot never sees a half-updated line;
//! - a line is recorded clean only after the core write that cleaned it has been flushed: the
//!   commit flushes every core marked `unflushed` before it writes the snapshot, and a core
//!   whose flush fails is marked failing and the snapshot taken again with its lines dirty;
//! - lines in limbo (unmapped while durably dirty) go to the free list only after a commit
//!   recorded them free (`release_limbo`), never before: always checked, a violation would let
//!   a crash serve another address's data.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use hybridcache_volume::Volume;

use crate::cleaning_state::CleaningCounters;
use crate::core_flush;
use crate::core_state::{CoreState, Cores};
use crate::devices::Devices;
use crate::format::Entry;
use crate::inner::CacheInner;
use crate::lines::Lines;
use crate::lists::ListKind;
use crate::persist::Persist;
use crate::room_wait::CleanerSignal;
use crate::stats::Counter;
use crate::{CoreId, Result};

/// A commit ahead of need (persistent cache) waits for at least this many cleaned lines: each
/// commit flushes the cores, which costs a real disk array far more than one line's write.
pub(crate) const AHEAD_LINES: u64 = 32;
/// ... and for this long since the previous commit began, so that commits cannot flood the
/// cores with flushes. Well under `ROOM_WAIT` (cache.rs), so that a write waiting for a line
/// sees one or more commits before it gives up.
pub(crate) const AHEAD_INTERVAL_MS: u64 = 15;
/// ... or, with fewer lines than `AHEAD_LINES` cleaned, this long: half of `ROOM_WAIT`.
pub(crate) const AHEAD_STALE_MS: u64 = 50;

/// How one attempt at a commit ended.
enum Attempt {
    Done,
    /// A core's flush failed for the first time after the snapshot was taken, which may call
    /// lines of that core clean on the strength of writes that are not durable: snapshot again.
    Retry,
}

/// What a commit works on, each by reference, lent for one commit by whoever holds them (the
/// holder's `committer()`, the cleaner's and the writer's): the devices (the cache volume, and a
/// mirror whose loss the superblock must record), persistence (its bits and sequence, through a
/// [`crate::persist::CommitTurn`]), the line room (the lines' states for the snapshot, limbo),
/// the cores to flush and the signal that wakes writes waiting for room.
pub(crate) struct Commit<'a> {
    volume: &'a dyn Volume,
    devices: &'a Devices,
    persist: Option<&'a Persist>,
    lines: &'a Lines,
    cores: &'a Cores,
    signal: &'a CleanerSignal,
}

impl CacheInner {
    pub(crate) fn committer(&self) -> Commit<'_> {
        Commit::new(
            &self.devices,
            self.persist.as_ref(),
            &self.lines,
            &self.cores,
            &self.cleaner_signal,
        )
    }

    /// [`Commit::commit`] on the holder's rooms, for the facade and the load.
    pub(crate) fn commit(&self) -> Result<()> {
        self.committer().commit()
    }

    /// [`Commit::commit_ahead`] on the holder's rooms (unit tests drive it directly).
    #[cfg(test)]
    pub(crate) fn commit_ahead(&self) {
        self.committer().commit_ahead(&self.cleaning_counters)
    }
}

impl<'a> Commit<'a> {
    #[inline]
    pub(crate) fn new(
        devices: &'a Devices,
        persist: Option<&'a Persist>,
        lines: &'a Lines,
        cores: &'a Cores,
        signal: &'a CleanerSignal,
    ) -> Commit<'a> {
        Commit {
            volume: &**devices.volume(),
            devices,
            persist,
            lines,
            cores,
            signal,
        }
    }

    /// Make everything acknowledged so far durable (see the module doc). Without persistence it
    /// only flushes the devices. Fails only when the cache volume fails: a core whose flush
    /// fails has the error counted on it and its lines recorded dirty, so that it cannot keep
    /// the other cores' writes from becoming durable.
    pub(crate) fn commit(&self) -> Result<()> {
        self.run()?;
        self.note_mirror_lost()
    }

    /// After a commit: if `core` is failing, its acknowledged writes are not known durable, and
    /// a flush on it must fail, unless its device flushes now.
    pub(crate) fn retry_failing_core(&self, core: &CoreState) -> Result<()> {
        if !self.lines.gauges()[core.id() as usize].failing() {
            return Ok(());
        }
        core_flush::flush_device(core.id(), core.watch(), core.volume())
            .inspect_err(|_| core.counters().add(Counter::CoreWriteErrors, 1))?;
        // Everything written to it before this flush is durable now.
        self.core_recovered(core.id());
        Ok(())
    }

    /// Record in the primary's superblock that the mirror missed writes, once: a later load
    /// must not take the stale mirror for a copy.
    pub(crate) fn note_mirror_lost(&self) -> Result<()> {
        let (Some(m), Some(p)) = (self.devices.mirror(), self.persist) else {
            return Ok(());
        };
        if m.state() != crate::MirrorState::MirrorLost
            || !p.superblock().mirror.as_ref().is_some_and(|r| !r.lost)
        {
            return Ok(());
        }
        p.update_superblock(self.volume, |sb| {
            if let Some(r) = sb.mirror.as_mut() {
                r.lost = true;
            }
        })
    }

    /// Called by background cleaning's workers between units (no stripe held): on a persistent
    /// cache, commit now if lines cleaned since the last commit wait to be reusable, writes want
    /// room (or free lines are short), and the last commit is not too recent. Cleaned lines are
    /// durably dirty until a commit records them clean; without this they would wait for the
    /// end of the batch (seconds in front of a disk array, alru-very-aggressive's 8192 lines)
    /// while every write that finds no line goes to the core (issue 20). The commit flushes the
    /// cores: that price is paid here, by cleaning, never by a client request. A commit made
    /// is counted in `counters`.
    pub(crate) fn commit_ahead(&self, counters: &CleaningCounters) {
        if self.persist.is_none() {
            return;
        }
        let sig = self.signal;
        let waiting = sig.uncommitted();
        if waiting == 0 {
            return;
        }
        let low_water = (self.lines.count() as u64 / 64).max(1);
        if !sig.room_wanted() && self.lines.free_lines().load(Ordering::Relaxed) >= low_water {
            return;
        }
        let last = sig.last_commit_ms();
        let since = sig.now_ms().saturating_sub(last);
        // Fewer lines than `AHEAD_LINES` go too once they have waited `AHEAD_STALE_MS`, so that
        // cleaned lines never wait long for their commit while writes want room (at the end of
        // a batch its last, slow core writes trickle in).
        if last != 0
            && (since < AHEAD_INTERVAL_MS || (waiting < AHEAD_LINES && since < AHEAD_STALE_MS))
        {
            return;
        }
        if !sig.begin_ahead_commit() {
            return;
        }
        // A failure (the cache volume's) is counted by the device; the batch's own commit at its
        // end tries again and reports it.
        if self.commit().is_ok() {
            counters.ahead_commit();
        }
        sig.end_ahead_commit();
    }
}

impl Commit<'_> {
    fn run(&self) -> Result<()> {
        let Some(p) = self.persist else {
            self.volume.flush()?;
            self.flush_cores();
            return Ok(());
        };
        let taken = self.signal.commit_begins();
        // Each retry follows a core newly marked failing, so there are at most as many as cores.
        loop {
            match self.once(p) {
                Ok(Attempt::Retry) => {}
                Ok(Attempt::Done) => return Ok(()),
                Err(e) => {
                    self.signal.commit_failed(taken);
                    return Err(e);
                }
            }
        }
    }

    /// One attempt: the snapshot (step 1), the flushes that make its data durable (step 2; a
    /// core failing for the first time asks for a new snapshot), the writes (steps 3 to 5).
    /// An attempt that does not complete leaves its blocks to the next (`CommitTurn`'s drop).
    fn once(&self, p: &Persist) -> Result<Attempt> {
        let turn = p.begin_commit();
        let snap = turn.snapshot(self.lines.count(), |line| self.snapshot_entry(line));
        self.volume.flush()?;
        if self.flush_cores() {
            return Ok(Attempt::Retry);
        }
        if !turn.is_empty() {
            turn.write(self.volume, &snap)?;
        }
        if turn.completed(snap) {
            self.release_limbo(p);
            // Lines cleaned before the snapshot are reusable now: wake the writes waiting for one.
            self.signal.room_made();
        }
        Ok(Attempt::Done)
    }

    /// Flush the cores that took writes since their last flush, and the failing ones (to learn
    /// whether they came back). Returns whether a core failed that was not failing before.
    /// The cores flush in parallel, each bounded by the core flush timeout (core_flush.rs): a
    /// hung core counts as failed, so it cannot hold this commit (and every other core's
    /// durability) hostage.
    fn flush_cores(&self) -> bool {
        let cores: Vec<Arc<CoreState>> = self.cores.all();
        let mut pending = Vec::new();
        for c in cores {
            let was_failing = self.lines.gauges()[c.id() as usize].failing();
            if !c.take_unflushed() && !was_failing {
                continue;
            }
            let flush = core_flush::start_device_flush(c.id(), c.watch(), c.volume());
            pending.push((c, was_failing, flush));
        }
        let deadline = Instant::now() + core_flush::core_flush_timeout();
        let mut newly_failing = false;
        for (c, was_failing, flush) in pending {
            match flush.wait(deadline) {
                Ok(()) => {
                    if was_failing {
                        self.core_recovered(c.id());
                    }
                }
                Err(_) => {
                    c.mark_unflushed();
                    c.counters().add(Counter::CoreWriteErrors, 1);
                    if !was_failing {
                        self.lines.gauges()[c.id() as usize].set_failing(true);
                        newly_failing = true;
                    }
                }
            }
        }
        newly_failing
    }

    /// A failing core's flush succeeded: commits may record its lines as they are again. Its
    /// blocks are rewritten at the next commit, or lines recorded dirty while it failed would
    /// stay dirty on the device (and not reusable) until something else changed their block.
    fn core_recovered(&self, id: CoreId) {
        self.lines.gauges()[id as usize].set_failing(false);
        if let Some(p) = self.persist {
            for line in 0..self.lines.count() {
                if self.lines.table().key(line).is_some_and(|k| k.core() == id) {
                    p.touch(line);
                }
            }
        }
    }

    /// A line's state as it goes on disk: only consistent combinations.
    fn snapshot_entry(&self, line: u32) -> Entry {
        let key = self.lines.table().key(line);
        let valid = self.lines.table().valid(line);
        // A racing update may show new valid with old dirty bits; dirty data outside valid
        // sectors cannot exist, so it is dropped here.
        let mut dirty = self.lines.table().dirty(line) & valid;
        if key.is_some_and(|k| self.lines.gauges()[k.core() as usize].failing()) {
            // The core may not hold what cleaning wrote to it (its flush failed): the cache's
            // copy stays the one to trust. Valid sectors hold the newest data, so this never
            // serves anything older; the line is only cleaned again later.
            dirty = valid;
        }
        match key {
            Some(k) if valid != 0 => Entry {
                key: Some(k),
                valid,
                dirty,
            },
            _ => Entry {
                key: None,
                valid: 0,
                dirty: 0,
            },
        }
    }

    /// Move lines that are no longer durably dirty from limbo to the free lists.
    fn release_limbo(&self, p: &Persist) {
        for shard in 0..self.lines.lists().shard_count() {
            let mut s = self.lines.lists().lock(shard);
            let mut cur = s.first(ListKind::Limbo);
            while let Some(line) = cur {
                cur = self.lines.lists().next(line);
                if !p.recorded_dirty(line) {
                    // Always checked: a mapped line on the free list would be handed out while
                    // it still holds data.
                    assert!(
                        self.lines.table().key(line).is_none(),
                        "line {line} in limbo is mapped"
                    );
                    self.lines
                        .lists()
                        .move_back(&mut s, ListKind::Limbo, ListKind::Free, line);
                    self.lines.free_lines().fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
}

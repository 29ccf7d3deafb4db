//! The write path, by mode (cache.rs's module doc tells the whole story): write-back as
//! phases (plan, decide, place, apply, core part), write-through and write-around,
//! write-invalidate and pass-through, discards and zeroes, and a client's flush. All of it on a
//! `Writer`, a struct of references the holder lends per request (`CacheInner::writer()`).
//!
//! Invariants: a write changes nothing before its cache write has succeeded (a line turns
//! dirty only once its data is on the cache device); a write that gives up its locks to wait
//! for room or make room has changed nothing yet and keeps only the free lines it took; the
//! core part runs without the stripes only when no cached copy of its sectors exists.

use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::OnceLock;

use crate::admission::Admission;
use crate::bits::Mask;
use crate::classes::ReqClass;
use crate::cleaner::Cleaner;
use crate::core_state::CoreState;
use crate::devices::Devices;
use crate::inner::{serving_mode, CacheInner};
use crate::latency::{self};
use crate::lines::Lines;
use crate::locks::{SpanKind, StripeGuard, WaitFor};
use crate::meta::Key;
use crate::persist::Persist;
use crate::policy::FLUSH_BUFFERS;
use crate::prefetch::PrefetchState;
use crate::room_wait::{CleanerSignal, RoomWaiter};
use crate::segment::{push_run, span_of, Run, Runs, Seg};
use crate::stats::{classify, Counter};
use crate::{CacheMode, Result, MAX_REQUEST, SECTOR};
/// A write's segments with a home line: (segment index, line, newly taken). Inline for the
/// requests of up to 4 lines that make most of a client's writes (no heap allocation per hit).
pub(crate) type Targets = smallvec::SmallVec<[(usize, u32, bool); 4]>;

/// How many times a write-back write gives up its locks to make room before it writes the rest
/// straight to the core.
const MAKE_ROOM_ROUNDS: usize = 8;
/// With lazy flush on, how long a write that finds no line waits for one that background
/// cleaning frees (and, on a persistent cache, a commit makes reusable), before it goes to the
/// core.
pub(crate) const ROOM_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

/// A write-back write's one admission decision (`decide_write_back`).
#[derive(Clone, Copy)]
struct Decision {
    /// Promotion (nhit) declines to insert its unmapped lines.
    declined: bool,
    /// Offload sends it to the core.
    offloaded: bool,
}

/// A write-back write between its rounds of placing: the lines it has taken (kept across
/// rounds) and its place in the room-waiting protocol (room_wait.rs).
#[derive(Default)]
struct Placing<'a> {
    spare: Vec<u32>,
    round: usize,
    deadline: Option<std::time::Instant>,
    /// Counted among the writes waiting for a line while set.
    waiter: Option<RoomWaiter<'a>>,
    /// It waited for another request's stripes (a hit is then also deferred).
    waited: bool,
}

impl<'a> Placing<'a> {
    fn placed(self, locks: StripeGuard<'a>, decision: Decision, short: bool) -> Placed<'a> {
        debug_assert!(
            self.waiter.is_none(),
            "a placed write has left the room waiters"
        );
        Placed {
            locks,
            spare: self.spare,
            decision,
            waited: self.waited,
            short,
        }
    }
}

/// A placed write-back write: its stripes, the new lines it holds, and whether what has no
/// line goes to the core (lazy flush).
struct Placed<'a> {
    locks: StripeGuard<'a>,
    spare: Vec<u32>,
    decision: Decision,
    waited: bool,
    short: bool,
}

/// What the write path works on, each by reference, lent per request by the holder
/// (`writer()`): the line room (segments, locks, lookup, line updates, allocation), the devices
/// (cache and core writes), persistence and read-ahead's marks (which a line change also
/// touches), admission, the mode set, lazy flush, the room signal (waiting for the room
/// cleaning makes) and a [`Cleaner`] to make room with, committing through its
/// [`crate::commit::Commit`]. Built for a few stores per request; the holder is not named past
/// `writer()`.
pub(crate) struct Writer<'a> {
    lines: &'a Lines,
    devices: &'a Devices,
    persist: Option<&'a Persist>,
    prefetch: &'a PrefetchState,
    admission: Admission<'a>,
    /// The mode set; a mirror or fallback may serve another (`serving_mode`).
    mode: &'a AtomicU8,
    /// Lazy flush is on (policy.rs `LazyFlush`).
    lazy_flush: &'a AtomicBool,
    cleaner_signal: &'a CleanerSignal,
    /// Makes room when a write finds no line (`make_room`), and commits.
    cleaner: Cleaner<'a>,
    line_bytes: u64,
}

impl CacheInner {
    /// The write path's view of this cache.
    #[inline]
    pub(crate) fn writer(&self) -> Writer<'_> {
        Writer {
            lines: &self.lines,
            devices: &self.devices,
            persist: self.persist.as_ref(),
            prefetch: &self.prefetch,
            admission: self.admission(),
            mode: &self.mode,
            lazy_flush: &self.lazy_flush,
            cleaner_signal: &self.cleaner_signal,
            cleaner: self.cleaner_room(),
            line_bytes: self.line_bytes,
        }
    }
}

/// The rooms' calls the write path makes, on the references it holds.
impl<'a> Writer<'a> {
    /// The line room, for write_batch.rs (the batched write hits).
    #[inline]
    pub(crate) fn lines(&self) -> &'a Lines {
        self.lines
    }

    /// The devices room, for write_batch.rs.
    #[inline]
    pub(crate) fn devices(&self) -> &'a Devices {
        self.devices
    }

    #[inline]
    fn mode(&self) -> CacheMode {
        serving_mode(self.mode, self.devices)
    }

    #[inline]
    fn admission(&self) -> &Admission<'a> {
        &self.admission
    }

    #[inline]
    pub(crate) fn check(
        &self,
        core: &CoreState,
        offset: u64,
        len: u64,
        max: Option<u64>,
    ) -> Result<()> {
        crate::check_request(core.size(), offset, len, max)
    }

    #[inline]
    fn core_off(&self, key: Key, sector: u32) -> u64 {
        key.line() * self.line_bytes + sector as u64 * SECTOR
    }

    #[inline]
    fn cache_off(&self, line: u32, sector: u32) -> u64 {
        self.devices.cache_off(line, sector)
    }

    #[inline]
    fn update_line(&self, line: u32, key: Key, valid: Mask, dirty: Mask, touch: bool) {
        self.lines
            .update_line(self.persist, line, key, valid, dirty, touch)
    }

    #[inline]
    fn insert_line(&self, line: u32, key: Key, valid: Mask, dirty: Mask, class: Option<ReqClass>) {
        self.lines
            .insert_line(self.persist, self.prefetch, line, key, valid, dirty, class)
    }

    #[inline]
    fn alloc_line(&self, class: Option<ReqClass>) -> Option<u32> {
        self.lines.alloc_line(self.persist, class)
    }
}

impl<'w> Writer<'w> {
    #[inline]
    pub(crate) fn write(&self, core: &CoreState, buf: &[u8], offset: u64) -> Result<()> {
        self.check(core, offset, buf.len() as u64, Some(MAX_REQUEST))?;
        if buf.is_empty() {
            return Ok(());
        }
        let _entered = core.enter()?;
        let (mode, class, cut) = self.write_admit(core, buf.len() as u64, offset);
        self.write_routed(core, buf, offset, mode, class, cut)
    }

    /// What a write is, decided once per request: the mode it is served in, its IO class, and
    /// whether it is pass-through (seq cutoff, a class with allocation 0); its bytes counted.
    #[inline]
    pub(crate) fn write_admit(
        &self,
        core: &CoreState,
        len: u64,
        offset: u64,
    ) -> (CacheMode, Option<ReqClass>, bool) {
        let mode = self.mode();
        core.counters().add(Counter::ExportedWrittenBytes, len);
        let class = self.lines.classes().classify(core.id(), offset, len, true);
        self.lines
            .classes()
            .count(core.classes(), class, Counter::ExportedWrittenBytes, len);
        // A write sequential cutoff turns away goes to the core; the cache drops its copy of
        // those sectors, dirty or not (the core now has newer data). wa inserts nothing anyway
        // and keeps its mapped copies up to date instead.
        // A class with allocation 0 is never cached: its writes are pass-through too.
        let cut = mode != CacheMode::Pt
            && (class.is_some_and(|c| c.cap == 0)
                || self.admission().cut_off(core, offset, len, true));
        (mode, class, cut)
    }

    /// A write admitted by [`write_admit`](Self::write_admit), served by its mode.
    #[inline]
    pub(crate) fn write_routed(
        &self,
        core: &CoreState,
        buf: &[u8],
        offset: u64,
        mode: CacheMode,
        class: Option<ReqClass>,
        cut: bool,
    ) -> Result<()> {
        match mode {
            CacheMode::Wa => self.write_through(core, buf, offset, false, class),
            _ if cut => self.write_invalidate(core, buf, offset, CacheMode::Pt, class),
            CacheMode::Wb | CacheMode::Wo => self.write_back(core, buf, offset, class),
            CacheMode::Wt => self.write_through(core, buf, offset, true, class),
            CacheMode::Wi | CacheMode::Pt => self.write_invalidate(core, buf, offset, mode, class),
        }
    }

    /// `waited`: the write waited for another request's stripes (a hit is then also deferred).
    #[inline]
    pub(crate) fn count_write(
        &self,
        core: &CoreState,
        segs: &[Seg],
        class: Option<ReqClass>,
        waited: bool,
    ) {
        let total: u64 = segs.iter().map(|s| s.count as u64).sum();
        let valid: u64 = segs
            .iter()
            .map(|s| (s.mask() & s.valid).count_ones() as u64)
            .sum();
        let outcome = classify(
            valid,
            total,
            Counter::WriteHits,
            Counter::WritePartialMisses,
            Counter::WriteFullMisses,
        );
        core.counters().add(outcome, 1);
        self.lines
            .classes()
            .count(core.classes(), class, outcome, 1);
        if waited && matches!(outcome, Counter::WriteHits) {
            core.counters().add(Counter::WriteDeferred, 1);
            self.lines
                .classes()
                .count(core.classes(), class, Counter::WriteDeferred, 1);
        }
    }

    #[inline]
    fn count_pass_through_write(&self, core: &CoreState, class: Option<ReqClass>) {
        core.counters().add(Counter::PassThroughWrites, 1);
        self.lines
            .classes()
            .count(core.classes(), class, Counter::PassThroughWrites, 1);
    }

    /// Write-back: the request's lines take the data and turn dirty; cleaning takes it to the
    /// core later. In phases: plan (segments; each round locks and looks them up), decide (one
    /// promotion and offload decision), place (lines for the unmapped segments, or room
    /// waiting), apply (the cache write, then the line updates), and the core part (what got no
    /// line, or whose cache write failed).
    #[inline]
    pub(crate) fn write_back(
        &self,
        core: &CoreState,
        buf: &[u8],
        offset: u64,
        class: Option<ReqClass>,
    ) -> Result<()> {
        let mut segs = self
            .lines
            .segments_small(core.id(), offset, buf.len() as u64);
        let Placed {
            locks,
            mut spare,
            decision,
            waited,
            short,
        } = self.place_write_back(core, &mut segs, class)?;
        self.count_write_back(core, &segs, class, decision, waited);
        // Lines were taken in ascending order and are handed out by pop(): reversed, so that
        // neighbouring segments get neighbouring lines and their copies (and later their
        // cleaning reads) merge into one.
        spare.reverse();
        let (targets, core_runs) = self.homes(&segs, spare);
        if short {
            self.count_lazy_flush(core, class, &core_runs);
            self.cleaner_signal.want_room();
        }
        let fallback = self.apply_write_back(core, buf, &segs, &targets, class);
        self.write_back_core_part(core, buf, &segs, locks, core_runs, fallback)
    }

    /// Decide, once per write-back write (under its first locks): whether promotion declines
    /// its unmapped lines, or offload sends them to the core.
    #[inline]
    fn decide_write_back(&self, core: &CoreState, segs: &[Seg]) -> Decision {
        let declined = self.admission().promotion_declines(segs);
        // Offload takes only write misses: with no core line mapped (under the locks) there is
        // no cached copy that the core's new data could leave stale.
        let offloaded = !declined
            && segs.iter().all(|s| !s.mapped())
            && self.devices.offload().take(core.id() as usize);
        Decision {
            declined,
            offloaded,
        }
    }

    /// Place: lock and look the segments up, decide, and take a line for every unmapped
    /// segment, making room (or, with lazy flush, waiting for the room cleaning makes) as the
    /// module doc says. Returns with the stripes locked; `short` when what has no line goes to
    /// the core (lazy flush). On an error nothing has changed and no line is kept.
    #[inline]
    fn place_write_back<'a>(
        &'a self,
        core: &CoreState,
        segs: &mut [Seg],
        class: Option<ReqClass>,
    ) -> Result<Placed<'a>> {
        let lazy = self.lazy_flush.load(Ordering::Relaxed);
        let sig = self.cleaner_signal;
        let mut p = Placing::default();
        let mut decision = None;
        loop {
            let locks = self.lines.lock_segs(segs, WaitFor::All);
            p.waited |= locks.waited();
            self.lines.lookup(segs);
            // Dirty data stays within a smaller mirror's region (lines.rs).
            self.lines.leave_unmirrored(self.persist, segs);
            // Promotion is asked once: a retry after making room must not count accesses again.
            let d = *decision.get_or_insert_with(|| self.decide_write_back(core, segs));
            // Declined or offloaded: unmapped segments go to the core, mapped ones are still
            // updated here.
            let needed = if d.declined || d.offloaded {
                0
            } else {
                segs.iter().filter(|s| !s.mapped()).count()
            };
            let can_wait = lazy && sig.room_coming();
            self.take_lines(&mut p, needed, class, can_wait);
            // A class at its allocation takes only its own clean lines: cleaning other lines
            // would not make room for it, so what it cannot place goes to the core.
            let capped = class.is_some_and(|c| self.lines.classes().full(c));
            if p.spare.len() >= needed || p.round == MAKE_ROOM_ROUNDS || capped {
                if p.waiter.take().is_some() && needed > 0 {
                    // Lines may be left: let the next waiting write look.
                    sig.room_made();
                }
                return Ok(p.placed(locks, d, false));
            }
            if lazy {
                // Background cleaning is under way: the lines it cleans become reusable at once
                // on a volatile cache, and at the next commit on a persistent one, which
                // cleaning makes ahead of need while writes want room (`commit_ahead`). So wait
                // a little for one rather than send a random write to a core that cleaning
                // keeps busy (issue 20). Nothing has changed yet, so the locks can go
                // meanwhile. With no cleaning under way the write goes to the core at once, as
                // before, and asks for room.
                if can_wait {
                    let deadline = *p
                        .deadline
                        .get_or_insert_with(|| std::time::Instant::now() + ROOM_WAIT);
                    if std::time::Instant::now() < deadline {
                        let seen = sig.room_generation();
                        drop(locks);
                        if p.waiter.is_none() {
                            p.waiter = Some(sig.join_waiters());
                        }
                        sig.want_room();
                        sig.wait_room(seen, deadline);
                        continue;
                    }
                }
                drop(p.waiter.take());
                // Lazy flush: what has no line goes to the core now (those core lines are not
                // mapped, so no cached copy can go stale), and background cleaning makes room
                // for the writes to come.
                return Ok(p.placed(locks, d, true));
            }
            // Nothing has changed yet, so the locks can go while cleaning makes room.
            drop(locks);
            p.round += 1;
            if let Err(e) = self.make_room(needed - p.spare.len()) {
                for line in p.spare.drain(..) {
                    self.lines.release_line(line);
                }
                return Err(e);
            }
        }
    }

    /// Take lines until the write has `needed`, unless it must queue. Writes already waiting
    /// for a line go first: one that has not waited takes none while others wait, and joins
    /// them. Otherwise the lines a commit frees go to the writes that happen to come back first
    /// (those that just got one), and a waiting write can lose every round until it times out
    /// and goes to the core. A class at its allocation takes its own lines, which waiting
    /// writes of other classes could not take: it does not queue.
    #[inline]
    fn take_lines(
        &self,
        p: &mut Placing<'_>,
        needed: usize,
        class: Option<ReqClass>,
        can_wait: bool,
    ) {
        let queued = can_wait
            && !class.is_some_and(|c| self.lines.classes().full(c))
            && p.waiter.is_none()
            && p.spare.len() < needed
            && self.cleaner_signal.waiting() > 0;
        while !queued && p.spare.len() < needed {
            match self.lines.alloc_dirty_line(self.persist, class) {
                Some(line) => p.spare.push(line),
                None => break,
            }
        }
    }

    #[inline]
    fn count_write_back(
        &self,
        core: &CoreState,
        segs: &[Seg],
        class: Option<ReqClass>,
        d: Decision,
        waited: bool,
    ) {
        if d.declined || d.offloaded {
            self.count_pass_through_write(core, class);
        } else {
            self.count_write(core, segs, class, waited);
        }
        if d.offloaded {
            core.counters().add(Counter::OffloadWrites, 1);
            self.lines
                .classes()
                .count(core.classes(), class, Counter::OffloadWrites, 1);
        }
    }

    #[inline]
    fn count_lazy_flush(&self, core: &CoreState, class: Option<ReqClass>, core_runs: &[Run]) {
        let bytes: u64 = core_runs.iter().map(|r| r.len as u64).sum();
        core.counters().add(Counter::LazyFlushWrites, 1);
        core.counters().add(Counter::LazyFlushBytes, bytes);
        self.lines
            .classes()
            .count(core.classes(), class, Counter::LazyFlushWrites, 1);
        self.lines
            .classes()
            .count(core.classes(), class, Counter::LazyFlushBytes, bytes);
    }

    /// Each segment's home: its mapped line, a new line from `spare` (`true`), or (no line)
    /// the core, as runs. Lines left over go back.
    #[inline]
    fn homes(&self, segs: &[Seg], mut spare: Vec<u32>) -> (Targets, Runs) {
        let mut targets = Targets::with_capacity(segs.len());
        let mut core_runs = Runs::new();
        for (i, s) in segs.iter().enumerate() {
            if s.mapped() {
                targets.push((i, s.line, false));
            } else if let Some(line) = spare.pop() {
                targets.push((i, line, true));
            } else {
                push_run(
                    &mut core_runs,
                    self.core_off(s.key, s.first),
                    s.buf_off,
                    s.count as usize * SECTOR as usize,
                );
            }
        }
        for line in spare {
            self.lines.release_line(line);
        }
        (targets, core_runs)
    }

    /// Apply: the cache write of every segment with a home line, then the line updates (dirty
    /// only once the data is on the cache device). A failed cache write drops those sectors
    /// from the cache; their runs are returned for the core.
    #[inline]
    fn apply_write_back(
        &self,
        core: &CoreState,
        buf: &[u8],
        segs: &[Seg],
        targets: &[(usize, u32, bool)],
        class: Option<ReqClass>,
    ) -> Runs {
        let cache_runs = self.write_back_runs(segs, targets);
        let cache_ok = self
            .devices
            .cache_write_dirty(core, buf, &cache_runs)
            .is_ok();
        self.write_back_applied(segs, targets, class, cache_ok)
    }

    /// The cache runs of the segments with a home line (`targets`, as `homes` gives them).
    #[inline]
    pub(crate) fn write_back_runs(&self, segs: &[Seg], targets: &[(usize, u32, bool)]) -> Runs {
        let mut cache_runs = Runs::new();
        for &(i, line, _) in targets {
            let s = &segs[i];
            push_run(
                &mut cache_runs,
                self.cache_off(line, s.first),
                s.buf_off,
                s.count as usize * SECTOR as usize,
            );
        }
        cache_runs
    }

    /// The line updates once the cache write of `targets` is done (`cache_ok`) or failed;
    /// returns the runs a failure sends to the core.
    #[inline]
    pub(crate) fn write_back_applied(
        &self,
        segs: &[Seg],
        targets: &[(usize, u32, bool)],
        class: Option<ReqClass>,
        cache_ok: bool,
    ) -> Runs {
        let mut fallback = Runs::new();
        for &(i, line, new) in targets {
            let s = &segs[i];
            let m = s.mask();
            match (cache_ok, new) {
                (true, true) => self.insert_line(line, s.key, m, m, class),
                (true, false) => self.update_line(line, s.key, s.valid | m, s.dirty | m, true),
                (false, new) => {
                    // The cache copy of these sectors may be torn: the core gets the data and
                    // the sectors are dropped from the cache.
                    if new {
                        self.lines.release_line(line);
                    } else {
                        self.update_line(line, s.key, s.valid & !m, s.dirty & !m, false);
                    }
                    push_run(
                        &mut fallback,
                        self.core_off(s.key, s.first),
                        s.buf_off,
                        s.count as usize * SECTOR as usize,
                    );
                }
            }
        }
        fallback
    }

    /// The core part of a write-back write: what has no line, and what a failed cache write
    /// sends back.
    #[inline]
    pub(crate) fn write_back_core_part(
        &self,
        core: &CoreState,
        buf: &[u8],
        segs: &[Seg],
        locks: StripeGuard<'_>,
        mut core_runs: Runs,
        fallback: Runs,
    ) -> Result<()> {
        if fallback.is_empty() && !core_runs.is_empty() {
            // What has no line (lazy flush, a declined promotion, offload) has no cached copy
            // either, so the stripes need not stay locked across its core write: a stripe held
            // there kept cleaning, and other writes whose lines share it, waiting for a RAID
            // that waits for the rest of its stripe (issue 20; locks.rs). The cached part is
            // in place already, and the span keeps reads and writes of these lines out.
            let _in_flight = locks.begin(span_of(segs), SpanKind::Around);
            drop(locks);
            return self.devices.core_write(core, buf, &core_runs);
        }
        core_runs.extend(fallback);
        let result = self.devices.core_write(core, buf, &core_runs);
        drop(locks);
        result
    }

    /// Clean up to `want` of the oldest dirty lines so that eviction finds clean ones. Caller holds
    /// no stripe.
    fn make_room(&self, want: usize) -> Result<()> {
        // The request that waits here waits for the core (cleaning may run on other threads).
        latency::touched_core();
        // Each round ends in a commit (device flushes), so clean enough lines to spread that
        // cost over many writes; these are the oldest dirty lines, due for cleaning anyway.
        let picked = self.lines.oldest_dirty(want.max(64));
        // A client waits for this room: not paced. A core whose lines fail to clean has the
        // error counted on it and is marked failing; the room then has to come from the other
        // cores' lines, or this write goes around the cache, never failing for that core.
        let _ = self
            .cleaner
            .clean_lines(picked, FLUSH_BUFFERS as usize, false);
        if self.persist.is_some() {
            // Cleaned lines (and lines in limbo) become reusable once the device records them.
            self.cleaner.committer().commit()?;
        }
        Ok(())
    }

    /// wt (insert) and wa (no insert): the core first, then the cache copy of mapped lines.
    #[inline]
    fn write_through(
        &self,
        core: &CoreState,
        buf: &[u8],
        offset: u64,
        insert: bool,
        class: Option<ReqClass>,
    ) -> Result<()> {
        let mut segs = self.lines.segments(core.id(), offset, buf.len() as u64);
        let locks = self.lines.lock_segs(&segs, WaitFor::All);
        let waited = locks.waited();
        self.lines.lookup(&mut segs);
        let declined = insert && self.admission().promotion_declines(&segs);
        // As in write-back: offload takes write misses only (nothing mapped, nothing stale).
        let offloaded = insert
            && !declined
            && segs.iter().all(|s| !s.mapped())
            && self.devices.offload().take(core.id() as usize);
        let insert = insert && !declined && !offloaded;
        if declined || offloaded {
            self.count_pass_through_write(core, class);
        } else {
            self.count_write(core, &segs, class, waited);
        }
        if offloaded {
            core.counters().add(Counter::OffloadWrites, 1);
            self.lines
                .classes()
                .count(core.classes(), class, Counter::OffloadWrites, 1);
        }
        let whole = [Run {
            dev_off: offset,
            buf_off: 0,
            len: buf.len(),
        }];
        self.devices.core_write(core, buf, &whole)?;
        for s in &segs {
            let m = s.mask();
            if s.mapped() {
                if self
                    .devices
                    .cache_write_mask(core, buf, s, s.line, m)
                    .is_ok()
                {
                    self.update_line(s.line, s.key, s.valid | m, s.dirty & !m, true);
                } else {
                    self.update_line(s.line, s.key, s.valid & !m, s.dirty & !m, false);
                }
            } else if insert {
                let Some(line) = self.alloc_line(class) else {
                    continue;
                };
                if self.devices.cache_write_mask(core, buf, s, line, m).is_ok() {
                    self.insert_line(line, s.key, m, 0, class);
                } else {
                    self.lines.release_line(line);
                }
            }
        }
        Ok(())
    }

    /// wi and pt: the core gets the data; cached copies of the written sectors are dropped.
    #[inline]
    fn write_invalidate(
        &self,
        core: &CoreState,
        buf: &[u8],
        offset: u64,
        mode: CacheMode,
        class: Option<ReqClass>,
    ) -> Result<()> {
        let mut segs = self.lines.segments(core.id(), offset, buf.len() as u64);
        let locks = self.lines.lock_segs(&segs, WaitFor::All);
        self.lines.lookup(&mut segs);
        if mode == CacheMode::Pt {
            self.count_pass_through_write(core, class);
        } else {
            self.count_write(core, &segs, class, locks.waited());
        }
        let whole = [Run {
            dev_off: offset,
            buf_off: 0,
            len: buf.len(),
        }];
        if segs.iter().all(|s| s.valid & s.mask() == 0) {
            // No cached copy to drop: the stripes need not stay locked across the core write
            // (the common case: a stream that seq cutoff sends around the cache). locks.rs.
            let _in_flight = locks.begin(span_of(&segs), SpanKind::Around);
            drop(locks);
            return self.devices.core_write(core, buf, &whole);
        }
        self.devices.core_write(core, buf, &whole)?;
        self.invalidate(&segs);
        Ok(())
    }

    /// Drop the segments' sectors from the cache. Caller holds their stripes.
    #[inline]
    fn invalidate(&self, segs: &[Seg]) {
        for s in segs.iter().filter(|s| s.mapped()) {
            let m = s.mask();
            if s.valid & m != 0 {
                self.update_line(s.line, s.key, s.valid & !m, s.dirty & !m, false);
            }
        }
    }

    pub(crate) fn discard(&self, core: &CoreState, offset: u64, len: u64) -> Result<()> {
        self.check(core, offset, len, None)?;
        let _entered = core.enter()?;
        let mut done = 0;
        while done < len {
            let n = (len - done).min(MAX_REQUEST);
            let mut segs = self.lines.segments(core.id(), offset + done, n);
            let _locks = self.lines.lock_segs(&segs, WaitFor::All);
            self.lines.lookup(&mut segs);
            // Invalidate first: the discard supersedes even dirty data, and the core is told
            // while the lines are still locked, so no reader sees a half-discarded range.
            self.invalidate(&segs);
            core.volume()
                .discard(offset + done, n)
                .inspect_err(|_| core.counters().add(Counter::CoreWriteErrors, 1))?;
            core.mark_unflushed();
            done += n;
        }
        Ok(())
    }

    pub(crate) fn write_zeroes(&self, core: &CoreState, offset: u64, len: u64) -> Result<()> {
        self.check(core, offset, len, None)?;
        // Zeroes take the ordinary write path so that every mode treats them as it treats data.
        static ZEROES: OnceLock<Vec<u8>> = OnceLock::new();
        let zeroes = ZEROES.get_or_init(|| vec![0; MAX_REQUEST as usize]);
        let mut done = 0;
        while done < len {
            let n = (len - done).min(MAX_REQUEST);
            self.write(core, &zeroes[..n as usize], offset + done)?;
            done += n;
        }
        Ok(())
    }

    pub(crate) fn flush_request(&self, core: &CoreState) -> Result<()> {
        let _entered = core.enter()?;
        let commit = self.cleaner.committer();
        commit.commit()?;
        // A commit passes a failing core by: this core's own flush must still say so.
        commit.retry_failing_core(core)
    }
}

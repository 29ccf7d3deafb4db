//! Striped locks over core lines, and the writes in flight to the core that hold none.
//!
//! A core line's stripe lock protects its hash bucket (so its lookup), the metadata of the cache
//! line mapped to it, and that cache line's data. Every path that holds more than one stripe takes
//! them in ascending order; paths that already hold stripes only ever `try_lock` another one
//! (eviction). Together that rules out deadlock without a global lock.
//!
//! Two kinds of core write do not hold their stripes while the core takes them, since every
//! request whose lines merely hash to the same stripes would wait for the core too (issue 20: on
//! a RAID, a waiting write holds up the stripe of the array it belongs to, whose other writes
//! then wait out the array's merge window; a default-cutoff stream of 16 KiB writes at qd32 ran
//! at a third of the bare core's speed, and client writes waited behind cleaning's 256 stripes
//! per merged megabyte). Instead each registers the core lines it covers, a [`Span`], under its
//! stripes, unlocks them, writes, and removes the span:
//! - a write around the cache (seq cutoff, pt, wi) that found no cached copy of what it writes,
//!   and the part of a write-back write that finds no line (lazy flush, a declined promotion,
//!   offload), written to the core after its cached part ([`SpanKind::Around`]);
//! - cleaning, between reading lines from the cache and marking them clean
//!   ([`SpanKind::Cleaning`]).
//!
//! Whoever then takes the stripes of lines a span covers waits for it, as it would have waited
//! for the stripe: a read for writes around the cache (it must not put the core's old data in
//! the cache, and requests stay atomic to one another), a write, a discard or cleaning for both
//! kinds (cleaning must not land older data after a write's, nor mark clean what a write has
//! dirtied since). A span is registered only under the stripes of every line it covers, so once
//! a request holds its stripes no new span can overlap it; to wait, it unlocks them, because
//! cleaning takes its stripes again to mark its lines clean ([`StripedLocks::lock_clear`]).
//! Nobody waits for a span while holding a stripe, so span waits cannot deadlock either.

use std::sync::atomic::{AtomicUsize, Ordering::SeqCst};
use std::time::Duration;

use parking_lot::lock_api::RawMutex as _;
use parking_lot::{Condvar, Mutex, RawMutex};
use smallvec::SmallVec;

use crate::meta::Key;

/// The stripes a request holds: inline up to 16 (a 64 KiB request on 4 KiB lines), so that
/// locking a request's stripes allocates nothing.
pub(crate) type Stripes = SmallVec<[u32; 16]>;

/// What a core write in flight without its stripes is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SpanKind {
    /// A write around the cache: what it covers has no cached copy.
    Around,
    /// A cleaning write: the cache's dirty data of what it covers on its way to the core.
    Cleaning,
}

/// The core lines a request covers: `first..=last` of one core.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Span {
    first: Key,
    last: Key,
}

impl Span {
    /// The span from `first` to `last`, keys of one core.
    pub(crate) fn new(first: Key, last: Key) -> Span {
        debug_assert!(first.core() == last.core() && first <= last);
        Span { first, last }
    }

    /// A span of no line, which overlaps none.
    pub(crate) fn none() -> Span {
        Span {
            first: Key::from_raw(u64::MAX),
            last: Key::from_raw(0),
        }
    }

    fn overlaps(&self, other: &Span) -> bool {
        self.first <= other.last && other.first <= self.last
    }
}

/// Which spans in flight a request waits for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WaitFor {
    /// Writes around the cache (a read).
    Around,
    /// Every kind (a write, a discard, cleaning).
    All,
}

impl WaitFor {
    fn blocks(self, kind: SpanKind) -> bool {
        self == WaitFor::All || kind == SpanKind::Around
    }
}

pub(crate) struct StripedLocks {
    locks: Box<[RawMutex]>,
    /// The spans in flight. Few (at most the requests and cleaning writes in flight) and
    /// pairwise disjoint: each waited for those it overlaps before it was registered.
    in_flight: Mutex<Vec<(Span, SpanKind)>>,
    /// `in_flight.len()`, read without its lock: requests find none in flight that way.
    count: AtomicUsize,
    /// Woken when a span ends.
    ended: Condvar,
}

impl StripedLocks {
    pub(crate) fn new(count: usize) -> Self {
        assert!(count.is_power_of_two());
        StripedLocks {
            locks: (0..count).map(|_| RawMutex::INIT).collect(),
            in_flight: Mutex::new(Vec::new()),
            count: AtomicUsize::new(0),
            ended: Condvar::new(),
        }
    }

    /// Take and release every stripe, one at a time: every request that held a stripe when
    /// this began has finished. Callers hold no stripe.
    pub(crate) fn pass_every_stripe(&self) {
        for s in 0..self.locks.len() as u32 {
            drop(self.lock_sorted(vec![s]));
        }
    }

    /// Lock `stripes` (sorted ascending, no duplicates) and return a guard that unlocks them.
    /// The guard tells whether some stripe was held by another request (the statistics call
    /// such a hit "deferred"); trying first costs nothing more than `lock`'s own fast path.
    /// Callers hold no stripe.
    pub(crate) fn lock_sorted(&self, stripes: impl Into<Stripes>) -> StripeGuard<'_> {
        let held = stripes.into();
        let waited = self.lock_each(&held);
        StripeGuard {
            locks: self,
            held,
            waited,
        }
    }

    /// Lock each of `stripes` (sorted ascending, no duplicates), waiting for those held; whether
    /// some was. The caller unlocks them (a guard, or `unlock_each`).
    #[inline]
    fn lock_each(&self, stripes: &[u32]) -> bool {
        debug_assert!(stripes.windows(2).all(|w| w[0] < w[1]));
        let mut waited = false;
        for &s in stripes {
            let l = &self.locks[s as usize];
            if !l.try_lock() {
                waited = true;
                l.lock();
            }
        }
        waited
    }

    /// Unlock `stripes`, each locked by this thread through `lock_each`, in reverse order.
    #[inline]
    fn unlock_each(&self, stripes: &[u32]) {
        for &s in stripes.iter().rev() {
            // SAFETY: the caller locked exactly these stripes and unlocks each once.
            unsafe { self.locks[s as usize].unlock() };
        }
    }

    /// Lock `stripes` (sorted ascending, no duplicates: those of every line of `span`) once no
    /// span in flight that `wait` names overlaps `span`. Callers hold no stripe.
    pub(crate) fn lock_clear(
        &self,
        stripes: impl Into<Stripes>,
        span: Span,
        wait: WaitFor,
    ) -> StripeGuard<'_> {
        let held = stripes.into();
        let mut waited = false;
        loop {
            waited |= self.lock_each(&held);
            if !self.blocked(span, wait) {
                return StripeGuard {
                    locks: self,
                    held,
                    waited,
                };
            }
            // Unlocked while waiting: cleaning needs its stripes back to end its span.
            self.unlock_each(&held);
            waited = true;
            let mut spans = self.in_flight.lock();
            while spans
                .iter()
                .any(|(s, k)| wait.blocks(*k) && s.overlaps(&span))
            {
                // `end` notifies under `in_flight`, so no wakeup is missed; the timeout is a
                // second line of defence only.
                self.ended.wait_for(&mut spans, Duration::from_millis(10));
            }
        }
    }

    /// Lock `stripes` (sorted ascending, no duplicates: those of every line of `span`) if
    /// every one is free now and no span in flight that `wait` names overlaps `span`;
    /// otherwise take none of them.
    pub(crate) fn try_lock_clear(
        &self,
        stripes: &[u32],
        span: Span,
        wait: WaitFor,
    ) -> Option<StripeGuard<'_>> {
        debug_assert!(stripes.windows(2).all(|w| w[0] < w[1]));
        for (i, &s) in stripes.iter().enumerate() {
            if !self.locks[s as usize].try_lock() {
                for &t in stripes[..i].iter().rev() {
                    // SAFETY: locked just above by this call, unlocked once.
                    unsafe { self.locks[t as usize].unlock() };
                }
                return None;
            }
        }
        let guard = StripeGuard {
            locks: self,
            held: Stripes::from_slice(stripes),
            waited: false,
        };
        (!self.blocked(span, wait)).then_some(guard)
    }

    /// Try to lock one stripe without waiting.
    pub(crate) fn try_lock(&self, stripe: u32) -> Option<StripeGuard<'_>> {
        if self.locks[stripe as usize].try_lock() {
            Some(StripeGuard {
                locks: self,
                held: smallvec::smallvec![stripe],
                waited: false,
            })
        } else {
            None
        }
    }

    /// Whether a span in flight that `wait` names overlaps `span`. Called holding the stripes
    /// of `span`'s lines: a span that overlaps it was registered before they were taken (under
    /// one of them), so `count` shows it.
    fn blocked(&self, span: Span, wait: WaitFor) -> bool {
        self.count.load(SeqCst) > 0
            && self
                .in_flight
                .lock()
                .iter()
                .any(|(s, k)| wait.blocks(*k) && s.overlaps(&span))
    }

    fn end(&self, span: Span) {
        let mut spans = self.in_flight.lock();
        let at = spans.iter().position(|(s, _)| *s == span);
        debug_assert!(at.is_some(), "{span:?} was not in flight");
        if let Some(at) = at {
            spans.swap_remove(at);
            self.count.fetch_sub(1, SeqCst);
        }
        self.ended.notify_all();
    }
}

/// Holds a set of stripes; unlocks them when dropped.
pub(crate) struct StripeGuard<'a> {
    locks: &'a StripedLocks,
    held: Stripes,
    waited: bool,
}

impl<'a> StripeGuard<'a> {
    /// Whether taking these stripes had to wait for another holder.
    pub(crate) fn waited(&self) -> bool {
        self.waited
    }

    /// Register `span` as in flight, a core write of `kind`. The guard holds the stripes of every line it covers and
    /// took them with [`StripedLocks::lock_clear`] and [`WaitFor::All`], so nothing in flight
    /// overlaps it. It is removed when the returned value is dropped.
    pub(crate) fn begin(&self, span: Span, kind: SpanKind) -> InFlight<'a> {
        let mut spans = self.locks.in_flight.lock();
        debug_assert!(
            !spans.iter().any(|(s, _)| s.overlaps(&span)),
            "{span:?} overlaps"
        );
        spans.push((span, kind));
        self.locks.count.fetch_add(1, SeqCst);
        InFlight {
            locks: self.locks,
            span,
        }
    }
}

impl Drop for StripeGuard<'_> {
    fn drop(&mut self) {
        // This guard locked exactly these stripes (`lock_each` or `try_lock`), once.
        self.locks.unlock_each(&self.held);
    }
}

/// A core write in flight without its stripes: its span, removed on drop.
pub(crate) struct InFlight<'a> {
    locks: &'a StripedLocks,
    span: Span,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.locks.end(self.span);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use hybridcache_volume::{RamVolume, Result, Volume, VolumeRef};
    use parking_lot::{Condvar, Mutex};

    use crate::meta::Key;
    use crate::{Cache, CacheConfig, CacheMode, Core, CoreId, LineSize};

    /// A core whose writes wait while the gate is closed; counts the writes waiting.
    struct Gate {
        inner: RamVolume,
        state: Mutex<(bool, usize)>,
        cv: Condvar,
    }

    impl Gate {
        fn open(&self) {
            self.state.lock().0 = false;
            self.cv.notify_all();
        }

        /// Whether `n` writes are waiting at the gate within `within`.
        fn writers_arrive(&self, n: usize, within: Duration) -> bool {
            let deadline = Instant::now() + within;
            let mut s = self.state.lock();
            while s.1 < n {
                if Instant::now() >= deadline {
                    return false;
                }
                self.cv.wait_for(&mut s, Duration::from_millis(20));
            }
            true
        }
    }

    impl Volume for Gate {
        fn name(&self) -> &str {
            "gated core"
        }
        fn size(&self) -> u64 {
            self.inner.size()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
            self.inner.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
            let mut s = self.state.lock();
            s.1 += 1;
            self.cv.notify_all();
            while s.0 {
                self.cv.wait(&mut s);
            }
            s.1 -= 1;
            drop(s);
            self.inner.write_at(buf, offset)
        }
        fn flush(&self) -> Result<()> {
            self.inner.flush()
        }
        fn discard(&self, offset: u64, len: u64) -> Result<()> {
            self.inner.discard(offset, len)
        }
    }

    const LINE: u64 = 4096;

    /// A 1 MiB cache of 4 KiB lines in `mode` over a 4 MiB gated core (gate open).
    fn rig(mode: CacheMode) -> (Cache, Core, CoreId, Arc<Gate>) {
        let gate = Arc::new(Gate {
            inner: RamVolume::new("core", 4 << 20).unwrap(),
            state: Mutex::new((false, 0)),
            cv: Condvar::new(),
        });
        let config = CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode,
        };
        let cache =
            Cache::new(Arc::new(RamVolume::new("cache", 1 << 20).unwrap()), config).unwrap();
        let id = cache.add_core(gate.clone() as VolumeRef, None).unwrap();
        let core = cache.core(id).unwrap();
        (cache, core, id, gate)
    }

    /// Two core lines whose keys share a stripe.
    fn same_stripe(cache: &Cache, id: CoreId) -> (u64, u64) {
        let table = &cache.inner.lines.table();
        let first = table.stripe(Key::new(id, 0));
        let other = (1..1024)
            .find(|&l| table.stripe(Key::new(id, l)) == first)
            .expect("1,024 core lines over 256 stripes: one shares line 0's");
        (0, other)
    }

    /// Write byte `i + 1` to the `i`th of `lines`, each from its own thread, one after the
    /// other: a write starts once the ones before it are waiting at the (closed) gate.
    fn write_in_turn<const N: usize>(
        core: &Core,
        gate: &Arc<Gate>,
        lines: [u64; N],
    ) -> Vec<std::thread::JoinHandle<()>> {
        (0..N)
            .map(|i| {
                let (core, gate, line) = (core.clone(), gate.clone(), lines[i]);
                std::thread::spawn(move || {
                    assert!(gate.writers_arrive(i, Duration::from_secs(10)));
                    core.write(&[i as u8 + 1; LINE as usize], line * LINE)
                        .unwrap();
                })
            })
            .collect()
    }

    /// The `i`th of `lines` reads byte `i + 1` throughout (what `write_in_turn` wrote).
    fn assert_core_reads<const N: usize>(core: &Core, lines: [u64; N]) {
        for (i, line) in lines.into_iter().enumerate() {
            let mut buf = [0u8; LINE as usize];
            core.read(&mut buf, line * LINE).unwrap();
            assert!(
                buf.iter().all(|&x| x == i as u8 + 1),
                "line {line}: {}",
                buf[0]
            );
        }
    }

    /// Two writes around the cache whose lines share a stripe are in flight to the core at once.
    /// They ran in turn while the first held the stripe across its core write, and on a RAID
    /// each then waited out its stripe's merge window (issue 20: a default-cutoff stream of 16 KiB
    /// writes at qd32 ran at a third of the bare core's speed).
    #[test]
    fn writes_around_the_cache_under_one_stripe_reach_the_core_together() {
        let (cache, core, id, gate) = rig(CacheMode::Pt);
        let (a, b) = same_stripe(&cache, id);
        gate.state.lock().0 = true;
        let writers = write_in_turn(&core, &gate, [a, b]);
        let together = gate.writers_arrive(2, Duration::from_secs(2));
        gate.open();
        for w in writers {
            w.join().unwrap();
        }
        assert!(together, "the second write waited for the first's stripe");
        assert_core_reads(&core, [a, b]);
    }

    /// A read miss of a line whose write around the cache is in flight waits for it, and then
    /// caches the new data: had it read the core meanwhile, it would have cached the old data,
    /// and every later hit would have served it. A read of another line of the same stripe does
    /// not wait.
    #[test]
    fn a_read_under_a_write_around_in_flight_waits_and_caches_the_new_data() {
        let (cache, core, id, gate) = rig(CacheMode::Wi);
        let (a, b) = same_stripe(&cache, id);
        for line in [a, b] {
            core.write(&[1u8; LINE as usize], line * LINE).unwrap();
        }
        gate.state.lock().0 = true;
        let writer = {
            let core = core.clone();
            std::thread::spawn(move || core.write(&[2u8; LINE as usize], a * LINE).unwrap())
        };
        assert!(gate.writers_arrive(1, Duration::from_secs(10)));
        let readers: Vec<_> = [a, b]
            .into_iter()
            .map(|line| {
                let core = core.clone();
                std::thread::spawn(move || {
                    let mut buf = [0u8; LINE as usize];
                    core.read(&mut buf, line * LINE).unwrap();
                    buf[0]
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let early: Vec<bool> = readers.iter().map(|r| r.is_finished()).collect();
        gate.open();
        writer.join().unwrap();
        let seen: Vec<u8> = readers.into_iter().map(|r| r.join().unwrap()).collect();
        assert_eq!(
            early,
            vec![false, true],
            "(line written, other line) done before the write"
        );
        assert_eq!(seen, vec![2, 1]);
        let before = cache.core_stats(id).unwrap().requests.read_hits;
        let mut buf = [0u8; LINE as usize];
        core.read(&mut buf, a * LINE).unwrap();
        assert!(buf.iter().all(|&x| x == 2), "served {}", buf[0]);
        assert_eq!(cache.core_stats(id).unwrap().requests.read_hits, before + 1);
    }

    /// Lazy flush: with the cache full of dirty lines, writes that find no line go to the core,
    /// and two of them whose lines share a stripe are in flight there at once. The first held
    /// the stripe across its core write, so the second (and cleaning's writes, which lock the
    /// stripes of every line they take) waited for it; on the study RAID a write that is part
    /// of a stripe waits out the stripe's merge window, and a full cache drained a stream of
    /// 64 KiB writes at a quarter of the bare core's speed (issue 20). A read of the line being
    /// written waits for it and then reads the new data.
    #[test]
    fn lazy_flush_writes_under_one_stripe_reach_the_core_together() {
        let (cache, core, id, gate) = rig(CacheMode::Wb);
        cache.stop_background_cleaner();
        assert!(cache.lazy_flush().enabled);
        let (a, b) = same_stripe(&cache, id);
        // Fill the cache (1 MiB) with dirty lines away from a and b, out of order (seq cutoff
        // would send a stream to the core).
        let scattered = (0..1024u64).map(|i| i * 389 % 1024);
        for l in scattered.filter(|&l| l != a && l != b).take(300) {
            core.write(&[9u8; LINE as usize], l * LINE).unwrap();
        }
        let flushed = cache.stats().requests.lazy_flush_writes;
        assert!(flushed > 0, "the cache is not full");
        gate.state.lock().0 = true;
        let writers = write_in_turn(&core, &gate, [a, b]);
        let together = gate.writers_arrive(2, Duration::from_secs(2));
        let reader = {
            let core = core.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; LINE as usize];
                core.read(&mut buf, a * LINE).unwrap();
                buf[0]
            })
        };
        std::thread::sleep(Duration::from_millis(100));
        let read_early = reader.is_finished();
        gate.open();
        for w in writers {
            w.join().unwrap();
        }
        assert!(
            together,
            "the second lazy-flush write waited for the first's stripe"
        );
        assert!(
            !read_early,
            "a read of a line being written did not wait for it"
        );
        assert_eq!(reader.join().unwrap(), 1);
        assert_eq!(cache.stats().requests.lazy_flush_writes, flushed + 2);
        assert_core_reads(&core, [a, b]);
    }

    /// While cleaning writes a line to the core, a write of another line of its stripe is not
    /// held up (client writes used to wait behind the 256 stripes of each merged cleaning
    /// megabyte, issue 20), and a write of the line being cleaned waits: marking the line clean
    /// after it would lose it. The line reads the newer data, dirty, afterwards.
    #[test]
    fn cleaning_in_flight_holds_up_writes_of_its_lines_only() {
        let (cache, core, id, gate) = rig(CacheMode::Wb);
        cache.stop_background_cleaner();
        let (a, b) = same_stripe(&cache, id);
        core.write(&[1u8; LINE as usize], a * LINE).unwrap();
        assert_eq!(cache.stats().usage.dirty_lines, 1);
        gate.state.lock().0 = true;
        let flusher = {
            let cache = cache.clone();
            std::thread::spawn(move || cache.flush().unwrap())
        };
        assert!(gate.writers_arrive(1, Duration::from_secs(10)));
        let writers: Vec<_> = [a, b]
            .into_iter()
            .map(|line| {
                let core = core.clone();
                std::thread::spawn(move || core.write(&[3u8; LINE as usize], line * LINE).unwrap())
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        let early: Vec<bool> = writers.iter().map(|w| w.is_finished()).collect();
        gate.open();
        flusher.join().unwrap();
        for w in writers {
            w.join().unwrap();
        }
        assert_eq!(
            early,
            vec![false, true],
            "(line cleaned, other line) done during cleaning"
        );
        // Both lines hold the new data, dirty: the cleaning of the old did not mark them clean.
        assert_eq!(cache.stats().usage.dirty_lines, 2);
        cache.flush().unwrap();
        for line in [a, b] {
            let mut buf = [0u8; LINE as usize];
            gate.inner.read_at(&mut buf, line * LINE).unwrap();
            assert!(
                buf.iter().all(|&x| x == 3),
                "core line {line} holds {}",
                buf[0]
            );
        }
    }
}

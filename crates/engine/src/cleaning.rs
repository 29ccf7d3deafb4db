//! Background cleaning: the policies that decide which dirty lines to clean, and when.
//!
//! One cleaner thread per cache calls [`Cleaner::cleaner_tick`] (on the rooms the holder lends,
//! `cleaner_room()`) about ten times a second (at
//! once again while a policy has more work). Everything time-dependent goes through the tick's
//! `now` argument, in milliseconds, so tests drive the same code with an injected clock
//! ([`crate::Cache::cleaner_tick`] after [`crate::Cache::stop_background_cleaner`]).
//!
//! - alru: lines are old enough when the dirty list's age marks (`Shard::fences` in `lists.rs`)
//!   say they were last written `staleness-time` ago; nothing is cleaned until the cache has seen
//!   no request for `activity-threshold`, except when the dirty share passes
//!   `dirty-ratio-threshold` (then the oldest lines go whatever their age, until dirty falls
//!   below the threshold minus `dirty-ratio-inertia`).
//! - acp: the core's address space is cut into 100 MiB chunks with a dirty-line count each; every
//!   `wake-up` ms the cleaner takes the dirtiest chunk (the highest of 11 buckets by dirty share)
//!   and cleans up to `flush-max-buffers` of its lines, busy or not.
//!
//! Either way the chosen lines go through `clean_lines` (cleaner.rs): sorted by core address,
//! merged into large writes, `flush-max-buffers` in flight. A persistent cache then commits, so
//! the cleaned lines become reusable; while writes want room it also commits part way through a
//! batch (`commit_ahead`, at most every `AHEAD_INTERVAL_MS` and after `AHEAD_LINES` cleaned
//! lines), so that they do not wait for the end of a batch of thousands of lines.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::cleaner::Cleaner;
use crate::cleaning_state::CleanerState;
use crate::core_state::ACP_CHUNK_BYTES;
use crate::inner::CacheInner;
use crate::lists::ListKind;
use crate::meta::Key;
use crate::policy::CleaningPolicy;
use crate::room_wait::CleanerSignal;
use crate::CleaningTick;
use crate::Result;

/// How often the cleaner looks, at most, when it has nothing to do.
const TICK: Duration = Duration::from_millis(100);
/// Lines cleaned per room request (the policy's flush-max-buffers when larger). Sorted
/// by core address, a large batch goes to the core as a sweep; plain alru's 100-line batches
/// (wake-up, staleness and activity keep its own runs away under load, so room requests are all
/// of its cleaning) crossed the whole region each time and drained a full cache in front of the
/// study's RAID at 740 lines/s, against 1,270 with 4,096 (issue 20). Writes do not wait for the
/// batch: each merged write frees its lines (and commits ahead of need make them reusable on a
/// persistent cache). At most an eighth of the cache's lines (but `ROOM_DEPTH`): room is a part of
/// the cache, and a batch of a small cache's every dirty line would leave write-back nothing to
/// hold.
const ROOM_BATCH: usize = 4096;
/// Core writes in flight for room at least (the policy's flush-max-buffers when larger; at most
/// cleaner.rs's `MAX_IN_FLIGHT`).
const ROOM_DEPTH: usize = 128;
/// Age marks kept per shard (see `Lists::place_fence`).
const FENCES: usize = 40;
/// The cleaner thread of a cache.
pub(crate) struct CleanerThread {
    signal: Arc<CleanerSignal>,
    handle: JoinHandle<()>,
    cache: Weak<CacheInner>,
}

impl CleanerThread {
    pub(crate) fn start(cache: &Arc<CacheInner>) -> CleanerThread {
        let weak: Weak<CacheInner> = Arc::downgrade(cache);
        let signal = cache.cleaner_signal.clone();
        signal.set_running(true);
        let sig = signal.clone();
        let epoch = Instant::now();
        let handle = std::thread::Builder::new()
            .name(format!("hc-cleaner-{}", cache.id))
            .spawn(move || loop {
                let (tick, wait) = match weak.upgrade() {
                    Some(cache) => {
                        let now = epoch.elapsed().as_millis() as u64;
                        let cleaner = cache.cleaner_room();
                        let tick = cleaner.cleaner_tick(now);
                        (tick, cleaner.cleaner_wait(now, &tick))
                    }
                    None => return,
                };
                if !sig.pause(tick.more, wait) {
                    return;
                }
            })
            .expect("spawning the cleaner thread");
        CleanerThread {
            signal,
            handle,
            cache: Arc::downgrade(cache),
        }
    }

    /// Stop the thread. Its clock goes with it: whoever ticks the cleaner next (a test with its
    /// own clock) starts from a clean schedule.
    pub(crate) fn stop(self) {
        self.signal.stop_thread();
        let _ = self.handle.join();
        if let Some(cache) = self.cache.upgrade() {
            let mut st = cache.cleaner.lock();
            st.forget_clock();
            cache.cleaner_room().clear_fences();
        }
    }
}

impl Cleaner<'_> {
    /// Any request since the last look changes this.
    fn io_marker(&self) -> u64 {
        self.cores()
            .active()
            .values()
            .map(|c| {
                let (_, b, _) = c.counters().snapshot();
                b.exported_read_bytes.wrapping_add(b.exported_written_bytes)
            })
            .fold(0u64, u64::wrapping_add)
    }

    /// Drop alru's age marks from every shard.
    fn clear_fences(&self) {
        for i in 0..self.lines().lists().shard_count() {
            self.lines().lists().lock(i).clear_fences();
        }
    }

    /// Forget every time recorded on the old clock, which means nothing on the next one. Age
    /// marks are dropped: lines get later marks (cleaned later, never too early).
    fn restart_clock(&self, st: &mut CleanerState, now: u64) {
        st.restart(now);
        self.clear_fences();
    }

    /// How long the cleaner thread sleeps after a tick at `now` that did not ask to run again
    /// at once: until the policy's next run when the tick cleaned something (acp's wake-up is
    /// in milliseconds, well below the thread's 100 ms look), else a tick's time, so an idle
    /// cleaner never spins.
    fn cleaner_wait(&self, now: u64, tick: &CleaningTick) -> Duration {
        if tick.cleaned == 0 {
            return TICK;
        }
        let next = self.schedule().lock().next_run_ms();
        Duration::from_millis(next.saturating_sub(now)).min(TICK)
    }

    /// Record whether the policy has cleaning due (see `CleaningStats::waiting`). A look that
    /// only waits for the policy's wake-up time keeps the last run's verdict.
    fn set_waiting(&self, waiting: bool) {
        self.counters().set_waiting(waiting);
    }

    /// One look by the cleaner at time `now` (ms since any fixed origin, never decreasing).
    pub(crate) fn cleaner_tick(&self, now: u64) -> CleaningTick {
        let cfg = *self.cleaning().read();
        let mut st = self.schedule().lock();
        if st.tick_at(now) {
            // Time went back: a new clock.
            self.restart_clock(&mut st, now);
        }
        st.requests_seen(self.io_marker(), now);
        if cfg.policy != CleaningPolicy::Alru && st.take_fences() {
            self.clear_fences();
        }
        let result = match cfg.policy {
            CleaningPolicy::Nop => {
                self.set_waiting(true);
                Ok(CleaningTick::default())
            }
            CleaningPolicy::Alru => self.alru_tick(&mut st, now),
            CleaningPolicy::Acp => self.acp_tick(&mut st, now),
        };
        // A failed clean leaves its lines dirty; the next run tries again. The error is already
        // counted in the core's error statistics.
        let mut tick = result.unwrap_or(CleaningTick {
            ran: true,
            cleaned: 0,
            more: false,
        });
        // A mirrored cache that lost a device drains its dirty lines as room requests do: they
        // are on one device only (or on a mirror it no longer serves from but in need).
        let drain = self
            .devices()
            .mirror()
            .is_some_and(|m| m.drains() && self.lines().usage(None).dirty_lines > 0);
        if self.signal().take_room_request() || drain {
            // Lazy flush sent writes to the core for want of a line: make room now, under any
            // policy (nop means no periodic cleaning, not no room). The oldest dirty lines go,
            // as an inline make-room would have taken them, `ROOM_BATCH` (an eighth of a small
            // cache, or the policy's flush-max-buffers when larger) at a time, with the policy's
            // depth.
            let depth = match cfg.policy {
                CleaningPolicy::Nop => ROOM_DEPTH,
                CleaningPolicy::Alru => cfg.alru.flush_max_buffers as usize,
                CleaningPolicy::Acp => cfg.acp.flush_max_buffers as usize,
            }
            .max(ROOM_DEPTH);
            let batch = ROOM_BATCH.min(self.lines().count() as usize / 8).max(depth);
            // Under way from here: writes that find no line wait for this batch while it is
            // picked (`room_coming`).
            let under_way = self.signal().batch();
            let picked = self.whole_windows(self.lines().oldest_dirty(batch), batch);
            let cleaned = self.clean_and_commit(picked, depth).unwrap_or(0);
            drop(under_way);
            tick.ran = true;
            tick.cleaned += cleaned;
        }
        // Writes that found no room since the look above: go again at once.
        tick.more |= self.signal().room_wanted();
        tick.more |= drain && tick.cleaned > 0;
        tick
    }

    fn alru_tick(&self, st: &mut CleanerState, now: u64) -> Result<CleaningTick> {
        let p = self.cleaning().read().alru;
        let staleness = p.staleness_time_s as u64 * 1000;
        // Nothing is old enough before `staleness` has passed on this clock (a mark at 0 says
        // "written at or before 0", which is not staleness ago at time 0).
        let stale = now.checked_sub(staleness);
        // Marks spaced by a sixteenth of the staleness time: ages are known to within that.
        let spacing = (staleness / 16).max(TICK.as_millis() as u64);
        if st.fence_due(now, spacing) {
            for i in 0..self.lines().lists().shard_count() {
                let mut s = self.lines().lists().lock(i);
                self.lines()
                    .lists()
                    .place_fence(&mut s, now, stale.unwrap_or(0), FENCES);
            }
            st.fences_placed(now);
        }
        // The dirty-ratio trigger is looked at on every tick: crossing the threshold starts
        // cleaning at once, whatever wake-up or activity said at the last run.
        let usage = self.lines().usage(None);
        let was_active = st.ratio_active();
        if p.dirty_ratio_threshold >= 100 {
            st.set_ratio_active(false);
        } else {
            let threshold = self.lines().count() as u64 * p.dirty_ratio_threshold as u64 / 100;
            let inertia = (p.dirty_ratio_inertia_mib as u64) << 20;
            let inertia_lines = inertia.div_ceil(self.line_bytes());
            if usage.dirty_lines > 0 && usage.dirty_lines >= threshold {
                st.set_ratio_active(true);
            } else if usage.dirty_lines + inertia_lines < threshold || usage.dirty_lines == 0 {
                st.set_ratio_active(false);
            }
        }
        let ratio_started = st.ratio_active() && !was_active;
        if now < st.next_run_ms() && !ratio_started {
            return Ok(CleaningTick::default());
        }
        let idle_for = st.idle_for(now);
        if !st.ratio_active() && idle_for < p.activity_threshold_ms as u64 {
            // Not idle long enough: look again at the next tick (not only once the cache could
            // have been idle long enough, so that the dirty-ratio trigger is not missed).
            self.set_waiting(true);
            return Ok(CleaningTick::default());
        }
        let budget = p.flush_max_buffers as usize;
        let (picked, passed_failing) = match (st.ratio_active(), stale) {
            (true, _) => self.alru_pick(st, budget, None),
            (false, Some(stale)) => self.alru_pick(st, budget, Some(stale)),
            (false, None) => (Vec::new(), false),
        };
        // Nothing picked and nothing passed by: no dirty line is old enough yet. Otherwise
        // cleaning is due until a run ends well: a run that fails or blocks on the core leaves
        // it due, and the daemon reports a stall.
        self.set_waiting(picked.is_empty() && !passed_failing);
        let more = picked.len() >= budget;
        let cleaned = self.clean_and_commit(picked, budget)?;
        self.set_waiting(!more && !passed_failing);
        st.run_next_at(if more {
            now
        } else {
            now + p.wake_up_s as u64 * 1000
        });
        Ok(CleaningTick {
            ran: true,
            cleaned,
            more,
        })
    }

    /// Up to `budget` dirty lines from the old ends of the shards' dirty lists: with `stale`,
    /// only lines the age marks say were last written at or before it. Also whether lines of a
    /// failing core were passed by.
    fn alru_pick(
        &self,
        st: &mut CleanerState,
        budget: usize,
        stale: Option<u64>,
    ) -> (Vec<u32>, bool) {
        let n = self.lines().lists().shard_count();
        let mut picked = Vec::new();
        // Several passes, each taking an even share from every shard, so the oldest of all shards
        // go first rather than all of one shard.
        let share = budget.div_ceil(n).max(1);
        let mut progress = true;
        let mut taken = vec![0usize; n];
        let mut passed_failing = false;
        let first = st.take_shard(n);
        while picked.len() < budget && progress {
            progress = false;
            for i in 0..n {
                let shard = (first + i) % n;
                let s = self.lines().lists().lock(shard);
                let end = match stale {
                    Some(t) => match self.lines().lists().stale_end(&s, t) {
                        Some(l) => Some(l),
                        None => continue,
                    },
                    None => None,
                };
                let mut cur = s.first(ListKind::Dirty);
                let mut skip = taken[shard];
                let mut got = 0;
                while let Some(line) = cur {
                    if picked.len() >= budget || got >= share {
                        break;
                    }
                    if skip > 0 {
                        skip -= 1;
                    } else if !self.lines().of_failing_core(line) {
                        picked.push(line);
                        got += 1;
                    } else {
                        // Passed by, and by the next pass over this shard too.
                        taken[shard] += 1;
                        passed_failing = true;
                    }
                    if Some(line) == end {
                        break;
                    }
                    cur = self.lines().lists().next(line);
                }
                taken[shard] += got;
                progress |= got > 0;
            }
        }
        (picked, passed_failing)
    }

    fn acp_tick(&self, st: &mut CleanerState, now: u64) -> Result<CleaningTick> {
        if now < st.next_run_ms() {
            return Ok(CleaningTick::default());
        }
        let p = self.cleaning().read().acp;
        st.run_next_at(now + p.wake_up_ms as u64);
        let budget = p.flush_max_buffers as usize;
        let Some((core, chunk, dirty)) = self.dirtiest_chunk() else {
            // Dirty lines but no chunk to clean: they are all of failing cores.
            self.set_waiting(self.lines().usage(None).dirty_lines == 0);
            return Ok(CleaningTick {
                ran: true,
                cleaned: 0,
                more: false,
            });
        };
        let picked = self.chunk_dirty_lines(core, chunk, budget.min(dirty as usize));
        self.set_waiting(false);
        let cleaned = self.clean_and_commit(picked, budget)?;
        self.set_waiting(true);
        Ok(CleaningTick {
            ran: true,
            cleaned,
            more: false,
        })
    }

    /// The chunk with the highest dirty share (of 11 buckets: 0%, 10%, ... 100%), as
    /// (core, chunk index, dirty lines). Ties go to the lowest core and address.
    fn dirtiest_chunk(&self) -> Option<(u16, u64, u64)> {
        let per_chunk = (ACP_CHUNK_BYTES / self.line_bytes()).max(1);
        let mut best: Option<(u64, u64, u16, u64)> = None; // (bucket, dirty, core, chunk)
        let cores: Vec<u16> = self.cores().active().keys().copied().collect();
        // A failing core's chunks cannot be cleaned; trying them on every run would starve the
        // other cores.
        let cores = cores
            .into_iter()
            .filter(|&id| !self.lines().gauges()[id as usize].failing());
        for id in cores {
            let chunks = self.lines().gauges()[id as usize].chunks();
            for (i, c) in chunks.iter().enumerate() {
                let dirty = c.load(Ordering::Relaxed) as u64;
                if dirty == 0 {
                    continue;
                }
                let bucket = dirty * 10 / per_chunk;
                if best.map_or(true, |(b, d, _, _)| (bucket, dirty) > (b, d)) {
                    best = Some((bucket, dirty, id, i as u64));
                }
            }
        }
        best.map(|(_, dirty, core, chunk)| (core, chunk, dirty))
    }

    /// Room cleaning's batch from `picked` (the oldest dirty lines, oldest first per shard): a
    /// picked line that shares its merge window (merge-max-aligned core lines: whole RAID
    /// stripes, as cleaning cuts its writes) with another picked line brings every dirty line of
    /// that window. A shard holds the lines its threads wrote, so a stream that several threads
    /// served (an NBD server's workers) has its oldest lines spread over the shards: one shard's
    /// oldest left gaps between the merged writes, each a partial stripe and a read-modify-write
    /// (issue 20: a full cache drained 64 KiB sequential writes at 330 MB/s in writes of 655 KiB
    /// on average). A line alone in its window goes alone. At most `batch` lines: a small cache
    /// must keep dirty lines (the cap in `tick`).
    fn whole_windows(&self, picked: Vec<u32>, batch: usize) -> Vec<u32> {
        let merge = self.cleaning().read().io.merge_max_kib as u64 * 1024;
        // As `merged_writes` aligns: to merge-max rounded down to a power of two.
        let align = 1u64 << (63 - merge.max(1).leading_zeros());
        let per_window = (align / self.line_bytes()).max(1);
        let window = |line: u32| {
            self.lines()
                .table()
                .key(line)
                .map(|k| (k.core(), k.line() / per_window))
        };
        // A window is looked through when two of its lines were picked. Random writes have
        // such windows too, and their other dirty lines join the sweep: cleaned 4 KiB random
        // writes at qd32 went from 1,237 to 1,452 a second on the study RAID.
        const FILL_FROM: u32 = 2;
        let mut counts: std::collections::HashMap<(u16, u64), u32> = Default::default();
        for &line in &picked {
            if let Some(w) = window(line) {
                *counts.entry(w).or_default() += 1;
            }
        }
        let mut out = Vec::with_capacity(batch);
        let mut filled = std::collections::HashSet::new();
        for &line in &picked {
            if out.len() >= batch {
                break;
            }
            let Some(w) = window(line) else { continue };
            if counts.get(&w).copied().unwrap_or(0) < FILL_FROM {
                out.push(line);
                continue;
            }
            if !filled.insert(w) {
                continue;
            }
            let (core, index) = w;
            for core_line in index * per_window..(index + 1) * per_window {
                if out.len() >= batch {
                    break;
                }
                let key = Key::new(core, core_line);
                // A busy stripe is skipped, not waited for: a request may hold it across core
                // I/O (a read miss, a write-through), and waiting for hundreds of those (lazy
                // flush held them too, until it wrote under a span) kept a whole batch from
                // starting while writes went to the core.
                let Some(_stripe) = self
                    .lines()
                    .locks()
                    .try_lock(self.lines().table().stripe(key))
                else {
                    continue;
                };
                if let Some(l) = self.lines().table().lookup(key) {
                    if self.lines().table().dirty(l) != 0 && !self.lines().of_failing_core(l) {
                        out.push(l);
                    }
                }
            }
        }
        out
    }

    /// Up to `want` dirty lines of one chunk, found by looking its core lines up in order.
    fn chunk_dirty_lines(&self, core: u16, chunk: u64, want: usize) -> Vec<u32> {
        let per_chunk = (ACP_CHUNK_BYTES / self.line_bytes()).max(1);
        let mut out = Vec::with_capacity(want);
        for core_line in chunk * per_chunk..(chunk + 1) * per_chunk {
            if out.len() >= want {
                break;
            }
            let key = Key::new(core, core_line);
            let _stripe = self
                .lines()
                .locks()
                .lock_sorted(vec![self.lines().table().stripe(key)]);
            if let Some(line) = self.lines().table().lookup(key) {
                if self.lines().table().dirty(line) != 0 {
                    out.push(line);
                }
            }
        }
        out
    }

    fn clean_and_commit(&self, lines: Vec<u32>, depth: usize) -> Result<u64> {
        if lines.is_empty() {
            return Ok(0);
        }
        let under_way = self.signal().batch();
        let cleaned = self.clean_lines(lines, depth, true);
        drop(under_way);
        // Lines of other cores may have been cleaned even when one core failed.
        if !matches!(cleaned, Ok(0)) && self.persist().is_some() {
            // Cleaned lines are reusable only once the device records them clean.
            self.committer().commit()?;
        }
        Ok(cleaned? as u64)
    }
}

/// The policies' choices on the holder's rooms, for this file's unit tests.
#[cfg(test)]
impl CacheInner {
    fn whole_windows(&self, picked: Vec<u32>, batch: usize) -> Vec<u32> {
        self.cleaner_room().whole_windows(picked, batch)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use hybridcache_volume::{RamVolume, VolumeRef};

    use crate::meta::Key;
    use crate::{Cache, CacheConfig, CacheMode, LineSize};

    /// Room cleaning's batch: a line picked with another of its merge window brings the rest of
    /// that window's dirty lines, whole stripes for the core; a line alone in its window goes
    /// alone. Never more than the batch; never a wait for a stripe.
    #[test]
    fn room_batches_take_whole_merge_windows() {
        const LINE: u64 = 4096;
        let config = CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        };
        let cache =
            Cache::new(Arc::new(RamVolume::new("cache", 8 << 20).unwrap()), config).unwrap();
        cache.stop_background_cleaner();
        let core_vol: VolumeRef = Arc::new(RamVolume::new("core", 64 << 20).unwrap());
        let id = cache.add_core(core_vol, None).unwrap();
        let core = cache.core(id).unwrap();
        // Window 0 (1 MiB, merge-max's default): all 256 lines dirty. Window 4: lines 1024 and
        // 1025. Window 8: lines 2048 and 2049.
        for l in (0..256).chain([1024, 1025, 2048, 2049]) {
            core.write(&[1u8; LINE as usize], l * LINE).unwrap();
        }
        let inner = &cache.inner;
        assert_eq!(inner.cleaning.read().io.merge_max_kib, 1024);
        let line_of = |l: u64| {
            let key = Key::new(id, l);
            let _s = inner
                .lines
                .locks()
                .lock_sorted(vec![inner.lines.table().stripe(key)]);
            inner.lines.table().lookup(key).unwrap()
        };
        let core_lines = |lines: Vec<u32>| {
            let mut v: Vec<u64> = lines
                .iter()
                .map(|&l| inner.lines.table().key(l).unwrap().line())
                .collect();
            v.sort_unstable();
            v
        };
        // Two of window 0 and one of window 8.
        let picked = vec![line_of(3), line_of(200), line_of(2048)];
        let batch = core_lines(inner.whole_windows(picked, 4096));
        let want: Vec<u64> = (0..256).chain([2048]).collect();
        assert_eq!(batch, want);
        // Never more than the batch, even within a window.
        let picked = vec![line_of(1024), line_of(1025), line_of(3), line_of(4)];
        let batch = core_lines(inner.whole_windows(picked, 2));
        assert_eq!(batch, vec![1024, 1025]);
        let some_of_0 = vec![line_of(3), line_of(4)];
        assert_eq!(inner.whole_windows(some_of_0.clone(), 100).len(), 100);
        // A stripe held by a request is skipped, not waited for.
        let held = inner
            .lines
            .locks()
            .lock_sorted(vec![inner.lines.table().stripe(Key::new(id, 255))]);
        let batch = core_lines(inner.whole_windows(some_of_0, 4096));
        drop(held);
        assert!(
            !batch.contains(&255) && batch.len() >= 200,
            "{}",
            batch.len()
        );
    }
}

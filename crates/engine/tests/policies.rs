//! The policies mean what Open CAS says they mean (domain.md §4-6): every cleaning tunable,
//! sequential cutoff and nhit promotion, checked against what reaches the core device.
//!
//! The cleaner runs on an injected clock: each test stops the background thread and calls
//! `cleaner_tick(t)` with times it chooses, ticking every 100 ms of fake time as the real thread
//! does (alru's age marks are placed by ticks). The core sits behind a [`RecordingVolume`], so a
//! test sees exactly which core writes a tick issued. Only the bandwidth and in-flight tests look
//! at the real clock, because timing is what they measure; their bounds are loose.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::recording::RecordingVolume;
use common::*;
use hybridcache_engine::{
    AcpParams, AlruParams, Cache, CacheConfig, CacheMode, CleaningConfig, CleaningPolicy,
    CleaningTick, Core, CoreId, LineSize, Promotion, PromotionPolicy, SeqCutoff, SeqCutoffPolicy,
    WRITE_SIZE_BUCKETS,
};
use hybridcache_volume::{FaultConfig, FaultyVolume, NullVolume, RamVolume, VolumeRef};

const KIB: u64 = 1024;
const MIB: u64 = 1 << 20;

/// A volatile cache whose cleaner only runs when the test ticks it, with one core behind a
/// recorder.
struct Rig {
    cache: Cache,
    core: Core,
    id: CoreId,
    rec: Arc<RecordingVolume>,
    /// The device behind the recorder (None for a null core).
    core_vol: Option<Arc<RamVolume>>,
    line: u64,
}

fn rig(line_kib: u32, lines: u64, mode: CacheMode, core_bytes: u64) -> Rig {
    let core_vol = ram("ram:core", core_bytes);
    rig_on(line_kib, lines, mode, as_ref(&core_vol), Some(core_vol))
}

/// As [`rig`] with a null core: large sparse address spaces for free.
fn rig_null(line_kib: u32, lines: u64, mode: CacheMode, core_bytes: u64) -> Rig {
    let null: VolumeRef = Arc::new(NullVolume::new("null:core", core_bytes).unwrap());
    rig_on(line_kib, lines, mode, null, None)
}

fn rig_on(
    line_kib: u32,
    lines: u64,
    mode: CacheMode,
    core: VolumeRef,
    core_vol: Option<Arc<RamVolume>>,
) -> Rig {
    let (cache, _cache_vol) = new_cache(line_kib, lines, mode);
    cache.stop_background_cleaner();
    let rec = RecordingVolume::new(core);
    let id = cache.add_core(rec.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    // The cleaning tests write lines in sequence; sequential cutoff (full, by default) would
    // send some around the cache once it fills. The cutoff tests set their own.
    cache
        .set_seq_cutoff(None, seq(SeqCutoffPolicy::Never, 1024, 8))
        .unwrap();
    Rig {
        cache,
        core,
        id,
        rec,
        core_vol,
        line: line_kib as u64 * KIB,
    }
}

impl Rig {
    fn alru(&self, f: impl FnOnce(&mut AlruParams)) {
        let mut c = self.cache.cleaning();
        c.policy = CleaningPolicy::Alru;
        f(&mut c.alru);
        self.cache.set_cleaning(c).unwrap();
    }

    fn acp(&self, f: impl FnOnce(&mut AcpParams)) {
        let mut c = self.cache.cleaning();
        c.policy = CleaningPolicy::Acp;
        f(&mut c.acp);
        self.cache.set_cleaning(c).unwrap();
    }

    fn merge_max_kib(&self, kib: u32) {
        let mut c = self.cache.cleaning();
        c.io.merge_max_kib = kib;
        self.cache.set_cleaning(c).unwrap();
    }

    /// Write one whole cache line (core line `l`) stamped with `tag`.
    fn write_line(&self, l: u64, tag: u64) {
        let data = stamped(self.line, tag, l * self.line / SECTOR);
        self.core.write(&data, l * self.line).unwrap();
    }

    /// A read: client activity that dirties nothing.
    fn poke(&self) {
        let mut b = vec![0u8; 4096];
        self.core.read(&mut b, 0).unwrap();
    }

    fn dirty(&self) -> u64 {
        self.cache.stats().usage.dirty_lines
    }

    fn occupancy(&self) -> u64 {
        self.cache.stats().usage.occupancy_lines
    }

    /// Core lines the core writes recorded since the last call touch.
    fn cleaned_lines(&self) -> BTreeSet<u64> {
        lines_of(&self.rec.take_writes(), self.line)
    }

    fn tick(&self, t: u64) -> CleaningTick {
        self.cache.cleaner_tick(t)
    }

    fn pass_through(&self) -> (u64, u64) {
        let r = self.cache.core_stats(self.id).unwrap().requests;
        (r.pass_through_reads, r.pass_through_writes)
    }
}

/// alru that cleans a line one second after its last write, busy or not, and looks every tick.
fn eager(a: &mut AlruParams) {
    a.staleness_time_s = 1;
    a.activity_threshold_ms = 0;
    a.wake_up_s = 0;
}

fn lines_of(writes: &[(u64, u64)], line: u64) -> BTreeSet<u64> {
    writes
        .iter()
        .flat_map(|&(off, len)| off / line..(off + len).div_ceil(line))
        .collect()
}

/// Cleaning claims its writes in core address order and has at most `depth` in flight, so a
/// write can arrive after at most `depth - 1` writes to higher addresses.
fn assert_sorted_within(writes: &[(u64, u64)], depth: usize) {
    for (i, &(off, _)) in writes.iter().enumerate() {
        let later_lower = writes[i + 1..].iter().filter(|&&(o, _)| o < off).count();
        assert!(
            later_lower < depth.max(1),
            "core write at {off} arrived before {later_lower} writes to lower addresses (depth {depth}): {writes:?}"
        );
    }
}

/// Writes neither overlap nor touch each other unless merging had to stop at `merge_max` or at
/// an address that is a multiple of it (rounded down to a power of two).
fn assert_merged(writes: &[(u64, u64)], merge_max: u64) {
    let align = 1u64 << (63 - merge_max.leading_zeros());
    let mut sorted = writes.to_vec();
    sorted.sort_unstable();
    for w in sorted.windows(2) {
        let ((a, al), (b, bl)) = (w[0], w[1]);
        assert!(
            a + al <= b,
            "cleaning writes overlap: {:?} {:?}",
            w[0],
            w[1]
        );
        if a + al == b && b % align != 0 {
            assert!(
                al + bl > merge_max,
                "adjacent cleaning writes {:?} {:?} were not merged (merge-max {merge_max})",
                w[0],
                w[1]
            );
        }
    }
    for &(o, l) in writes {
        assert!(l <= merge_max, "core write ({o}, {l}) exceeds merge-max");
    }
}

// ---- alru ------------------------------------------------------------------------------------

/// alru does nothing until the cache has been idle for activity-threshold: a write at t, a
/// tick at t + threshold - 1 cleans nothing, a tick at t + threshold cleans. New activity
/// restarts the wait.
#[test]
fn alru_waits_for_activity_threshold_of_idleness() {
    let r = rig(4, 256, CacheMode::Wb, 4 * MIB);
    r.alru(|a| {
        a.staleness_time_s = 1;
        a.activity_threshold_ms = 5000;
        a.wake_up_s = 0;
    });
    for l in 0..10 {
        r.write_line(l * 2, 1);
    }
    let t0 = 1000;
    let mut t = t0;
    while t < t0 + 5000 {
        let tick = r.tick(t);
        assert_eq!(
            tick.cleaned, 0,
            "cleaned at {t}, before 5000 ms of idleness"
        );
        t += 100;
    }
    assert_eq!(r.tick(t0 + 4999).cleaned, 0);
    assert_eq!(r.dirty(), 10);
    let tick = r.tick(t0 + 5000);
    assert!(tick.ran && tick.cleaned == 10, "{tick:?}");
    assert_eq!(r.dirty(), 0);
    assert_eq!(r.cleaned_lines(), (0..10).map(|l| l * 2).collect());

    // Activity again at t1 (seen by the tick at t1): the wait starts over, even though the
    // new lines are long stale by then.
    for l in 0..5 {
        r.write_line(100 + l * 2, 2);
    }
    let t1 = t0 + 20_000;
    assert_eq!(r.tick(t1).cleaned, 0);
    t = t1 + 100;
    while t < t1 + 3000 {
        assert_eq!(r.tick(t).cleaned, 0);
        t += 100;
    }
    // More activity at t1 + 3000 pushes the start to t1 + 8000.
    r.poke();
    t = t1 + 3000;
    while t < t1 + 8000 {
        assert_eq!(
            r.tick(t).cleaned,
            0,
            "cleaned at {t}, activity at {}",
            t1 + 3000
        );
        t += 100;
    }
    assert_eq!(r.tick(t1 + 8000).cleaned, 5);
}

/// Cleaning due but failing: the error is recorded with its device, offset and length (no
/// client waits for it, so the daemon logs it from here), and the policy does not count as
/// waiting, which is what tells the daemon that cleaning has stalled. While the cache is busy
/// (activity threshold), the policy is waiting.
#[test]
fn failed_cleaning_is_recorded_and_leaves_cleaning_due() {
    let faulty = Arc::new(FaultyVolume::new(as_ref(&ram("ram:core", 4 * MIB))));
    let r = rig_on(4, 256, CacheMode::Wb, faulty.clone(), None);
    r.alru(|a| {
        a.staleness_time_s = 1;
        a.activity_threshold_ms = 2000;
        a.wake_up_s = 0;
    });
    for l in 0..4 {
        r.write_line(10 + l, 1);
    }
    // Busy: the activity threshold holds cleaning back (the ticks place alru's age marks).
    let mut t = 1000;
    while t <= 3000 {
        if t == 3000 {
            r.poke();
        }
        assert_eq!(r.tick(t).cleaned, 0);
        assert!(r.cache.cleaning_stats().waiting, "at {t}");
        t += 100;
    }

    faulty.set_config(FaultConfig {
        fail_writes_in: Some(0..u64::MAX),
        ..FaultConfig::default()
    });
    let tick = r.tick(5000);
    assert_eq!(tick.cleaned, 0, "{tick:?}");
    let s = r.cache.cleaning_stats();
    assert!(!s.waiting, "cleaning is due and failing: {s:?}");
    assert!(s.errors.count >= 1, "{s:?}");
    let fault = s.errors.last.expect("the last cleaning error");
    assert_eq!(
        (fault.core, fault.op.as_str(), fault.device.as_str()),
        (r.id, "write", "ram:core")
    );
    // The four lines are neighbours: one merged write.
    assert_eq!((fault.offset, fault.len), (10 * r.line, 4 * r.line));
    assert!(!fault.error.is_empty());
    assert_eq!(r.dirty(), 4);
    // Still due on the next look, though the core's lines are now passed by as failing.
    assert_eq!(r.tick(5100).cleaned, 0);
    assert!(!r.cache.cleaning_stats().waiting);

    // The device heals; a flush that succeeds on it ends its failing state.
    faulty.set_config(FaultConfig::default());
    r.core.flush().unwrap();
    assert_eq!(r.tick(5200).cleaned, 4);
    assert!(r.cache.cleaning_stats().waiting);
    assert_eq!(r.dirty(), 0);
}

/// Nothing is cleaned before staleness-time has passed since its last write: A written at t0,
/// B at t0 + 1500; A goes at t0 + staleness, B only at its own.
#[test]
fn alru_cleans_nothing_younger_than_staleness_time() {
    let r = rig(4, 256, CacheMode::Wb, 4 * MIB);
    r.alru(|a| {
        a.staleness_time_s = 3;
        a.activity_threshold_ms = 0;
        a.wake_up_s = 0;
    });
    // Time starts at 0, as for the real cleaner thread right after the cache starts.
    let mut t = 0;
    r.write_line(1, 1);
    let mut cleaned_at: BTreeMap<u64, u64> = BTreeMap::new();
    while t <= 6000 {
        if t == 1500 {
            r.write_line(7, 2);
        }
        let tick = r.tick(t);
        for l in r.cleaned_lines() {
            cleaned_at.insert(l, t);
        }
        assert!(!tick.more);
        t += 100;
    }
    assert_eq!(
        cleaned_at.get(&1).copied(),
        Some(3000),
        "A: written at 0, staleness 3 s: {cleaned_at:?}"
    );
    let b = cleaned_at.get(&7).copied();
    assert!(
        b.is_some_and(|b| (4500..=4500 + 300).contains(&b)),
        "B: written at 1500, staleness 3 s, cleaned at {b:?}"
    );
    // Rewriting a dirty line makes it young again: written at w, rewritten at w + 2500, it is
    // not cleaned at w + 3000 but 3 s after the rewrite.
    r.write_line(3, 3);
    let w = t;
    while r.dirty() > 0 {
        if t == w + 2500 {
            r.write_line(3, 4);
        }
        if r.tick(t).cleaned > 0 {
            break;
        }
        t += 100;
        assert!(t < w + 20_000);
    }
    assert!(
        t >= w + 2500 + 3000,
        "line 3 rewritten at {} cleaned at {t}",
        w + 2500
    );
}

/// Lines written at pseudo-random fake times, a tick every 100 ms: every line the cleaner writes
/// was last written at least staleness-time before, and none stays dirty much longer.
#[test]
fn alru_staleness_holds_for_every_line() {
    let r = rig(4, 2048, CacheMode::Wb, 16 * MIB);
    let staleness = 2000u64;
    r.alru(|a| {
        a.staleness_time_s = 2;
        a.activity_threshold_ms = 0;
        a.wake_up_s = 0;
        a.flush_max_buffers = 10_000;
    });
    let mut rng = seed(7);
    let mut next = || {
        rng = rng
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        rng >> 33
    };
    let mut last_write: BTreeMap<u64, u64> = BTreeMap::new();
    for t in (0..20_000u64).step_by(100) {
        if t < 14_000 {
            // A few writes between ticks, some rewriting lines that are still dirty.
            for k in 0..(next() % 6) {
                let l = next() % 600;
                let wt = t + k * 10;
                r.write_line(l, wt);
                last_write.insert(l, wt);
            }
        }
        let tick = r.tick(t + 95);
        let now = t + 95;
        for l in r.cleaned_lines() {
            let w = last_write.remove(&l).expect("a cleaned line was dirty");
            assert!(
                w + staleness <= now,
                "line {l} last written at {w} cleaned at {now}, staleness {staleness}"
            );
        }
        // Marks are at most max(staleness/16, 100 ms) apart: with a tick's slack, everything
        // older than staleness + 300 ms is gone.
        for (&l, &w) in &last_write {
            assert!(
                w + staleness + 300 > now,
                "line {l} last written at {w} still dirty at {now} ({tick:?})"
            );
        }
    }
    assert!(last_write.is_empty());
    assert_eq!(r.dirty(), 0);
}

/// A run cleans at most flush-max-buffers lines and says when more work is waiting.
#[test]
fn alru_cleans_at_most_flush_max_buffers_per_run() {
    let r = rig(4, 1024, CacheMode::Wb, 8 * MIB);
    r.alru(|a| {
        a.staleness_time_s = 1;
        a.activity_threshold_ms = 0;
        a.wake_up_s = 0;
        a.flush_max_buffers = 100;
    });
    for l in 0..250 {
        r.write_line(l * 3, 1);
    }
    assert_eq!(r.tick(0).cleaned, 0);
    let t = 1000;
    let ticks: Vec<CleaningTick> = (0..3).map(|_| r.tick(t)).collect();
    assert_eq!(
        ticks
            .iter()
            .map(|k| (k.cleaned, k.more))
            .collect::<Vec<_>>(),
        [(100, true), (100, true), (50, false)]
    );
    assert_eq!(r.cleaned_lines().len(), 250);
    assert_eq!(r.dirty(), 0);
}

/// With nothing (or less than a full run) to do, alru sleeps wake-up seconds before it looks
/// again.
#[test]
fn alru_sleeps_wake_up_between_runs_without_work() {
    let r = rig(4, 256, CacheMode::Wb, 4 * MIB);
    r.alru(eager);
    for l in 0..10 {
        r.write_line(l, 1);
    }
    // wake-up 0: every tick looks; the lines go one second after they were written.
    let mut t = 0;
    loop {
        let k = r.tick(t);
        assert!(k.ran, "wake-up 0: ran at {t}");
        if k.cleaned > 0 {
            assert_eq!((k.cleaned, k.more), (10, false));
            break;
        }
        t += 100;
    }
    assert_eq!(t, 1000);
    // wake-up 5 s: a run that finds nothing old enough sleeps 5 s, even though new lines
    // become old enough meanwhile.
    r.alru(|a| a.wake_up_s = 5);
    for l in 20..25 {
        r.write_line(l, 2);
    }
    let first = 1100;
    let k = r.tick(first);
    assert!(k.ran && k.cleaned == 0, "{k:?}");
    t = first + 100;
    while t < first + 5000 {
        let k = r.tick(t);
        assert!(!k.ran && k.cleaned == 0, "ran at {t}: {k:?}");
        t += 100;
    }
    let k = r.tick(first + 5000);
    assert!(k.ran && k.cleaned == 5, "{k:?}");
}

/// dirty-ratio-threshold: above it cleaning starts while the cache is busy and whatever the
/// lines' age, stops once dirty is below threshold minus inertia, and does not start again
/// until the threshold is reached again.
#[test]
fn alru_dirty_ratio_threshold_with_inertia() {
    let r = rig(4, 1000, CacheMode::Wb, 16 * MIB);
    r.alru(|a| {
        a.staleness_time_s = 3600;
        a.activity_threshold_ms = 1_000_000;
        a.wake_up_s = 0;
        a.flush_max_buffers = 50;
        a.dirty_ratio_threshold = 50;
        a.dirty_ratio_inertia_mib = 1;
    });
    // threshold: 500 lines; inertia: 1 MiB = 256 lines; stop below 244.
    let mut t = 0;
    let mut next_line = 0;
    let mut write_to = |r: &Rig, dirty: u64| {
        while r.dirty() < dirty {
            r.write_line(next_line, 1);
            next_line += 1;
        }
    };
    write_to(&r, 499);
    for _ in 0..20 {
        r.poke();
        assert_eq!(r.tick(t).cleaned, 0, "below the threshold at {t}");
        t += 100;
    }
    write_to(&r, 600);
    let mut history = vec![r.dirty()];
    loop {
        r.poke(); // busy all along
        let k = r.tick(t);
        t += 100;
        if k.cleaned == 0 {
            break;
        }
        assert_eq!(k.cleaned, 50);
        history.push(r.dirty());
        assert!(history.len() < 100, "never stopped: {history:?}");
    }
    let last = *history.last().unwrap();
    assert!(
        (194..244).contains(&last),
        "forced cleaning should stop just below 500 - 256 = 244 dirty lines: {history:?}"
    );
    // From the old end of the dirty lists: the first line written went.
    assert!(r.cleaned_lines().contains(&0));
    // Climbing back to just below the threshold does not restart it...
    write_to(&r, 499);
    for _ in 0..20 {
        r.poke();
        assert_eq!(r.tick(t).cleaned, 0, "restarted below the threshold");
        t += 100;
    }
    // ...reaching it does.
    write_to(&r, 500);
    r.poke();
    assert_eq!(r.tick(t).cleaned, 50);
}

/// The presets set their documented values, and alru-very-aggressive behaves accordingly:
/// lines one second old are cleaned while the cache is busy, many per run.
#[test]
fn cleaning_presets_apply_their_values() {
    let r = rig(4, 1024, CacheMode::Wb, 8 * MIB);
    for (name, policy) in [
        ("alru-very-aggressive", CleaningPolicy::Alru),
        ("acp-very-aggressive", CleaningPolicy::Acp),
        ("alru-lazy", CleaningPolicy::Alru),
    ] {
        let mut c = r.cache.cleaning();
        c.apply_preset(name).unwrap();
        r.cache.set_cleaning(c).unwrap();
        let got = r.cache.cleaning();
        assert_eq!(got.policy, policy, "{name}");
        match name {
            "alru-very-aggressive" => assert_eq!(
                (
                    got.alru.wake_up_s,
                    got.alru.staleness_time_s,
                    got.alru.flush_max_buffers,
                    got.alru.activity_threshold_ms
                ),
                (0, 1, 8192, 0)
            ),
            "acp-very-aggressive" => {
                assert_eq!((got.acp.wake_up_ms, got.acp.flush_max_buffers), (1, 8192))
            }
            _ => assert_eq!(
                (
                    got.alru.wake_up_s,
                    got.alru.staleness_time_s,
                    got.alru.flush_max_buffers,
                    got.alru.activity_threshold_ms
                ),
                (2, 5, 256, 500)
            ),
        }
    }
    let mut c = r.cache.cleaning();
    c.apply_preset("alru-very-aggressive").unwrap();
    r.cache.set_cleaning(c).unwrap();
    for l in 0..900 {
        r.write_line(l, 1);
    }
    let mut t = 0;
    while t < 1000 {
        r.poke();
        assert_eq!(r.tick(t).cleaned, 0);
        t += 100;
    }
    r.poke();
    let k = r.tick(1000);
    assert_eq!((k.cleaned, k.more), (900, false));
    assert!(r.cache.cleaning().apply_preset("turbo").is_err());
}

// ---- acp -------------------------------------------------------------------------------------

/// acp cleans the dirtiest 100 MiB chunk first (11 buckets by dirty share, then dirty count,
/// ties to the lowest address), at most flush-max-buffers lines per run.
#[test]
fn acp_cleans_the_dirtiest_chunk_first() {
    // 64 KiB lines: a chunk is 1600 lines, a bucket 160.
    let r = rig_null(64, 1000, CacheMode::Wb, 2 << 30);
    let chunk_lines = (100 * MIB) / r.line;
    r.acp(|a| {
        a.wake_up_ms = 0;
        a.flush_max_buffers = 100;
    });
    // (chunk, dirty lines): buckets 2, 1, 0, 1.
    let plan: [(u64, u64); 4] = [(2, 400), (5, 200), (7, 50), (9, 170)];
    let mut model: BTreeMap<u64, u64> = BTreeMap::new();
    let longest = plan.iter().map(|p| p.1).max().unwrap();
    for i in 0..longest {
        for &(chunk, n) in &plan {
            if i < n {
                // Every third line: nothing merges, so one write per line.
                r.write_line(chunk * chunk_lines + i * 3, 1);
                *model.entry(chunk).or_default() += 1;
            }
        }
    }
    assert_eq!(r.dirty(), 820);
    let mut t = 0;
    let mut order = Vec::new();
    while r.dirty() > 0 {
        let (&want, &n) = model
            .iter()
            .max_by_key(|&(&c, &d)| (d * 10 / chunk_lines, d, std::cmp::Reverse(c)))
            .unwrap();
        r.poke();
        let k = r.tick(t);
        t += 100;
        let writes = r.rec.take_writes();
        let chunks: BTreeSet<u64> = writes
            .iter()
            .map(|&(o, _)| o / (100 * MIB))
            .collect::<BTreeSet<_>>();
        assert_eq!(
            chunks,
            BTreeSet::from([want]),
            "tick at {t}: expected chunk {want} of {model:?}"
        );
        assert_eq!(k.cleaned, n.min(100));
        assert_eq!(writes.len() as u64, k.cleaned);
        assert_sorted_within(&writes, 100);
        assert_merged(&writes, 1024 * KIB);
        *model.get_mut(&want).unwrap() -= k.cleaned;
        model.retain(|_, d| *d > 0);
        order.push(want);
        assert!(order.len() < 100);
    }
    assert_eq!(order[0], 2);
    assert!(r.tick(t).ran && r.tick(t + 1).cleaned == 0);
}

/// acp runs every wake-up ms, busy or not, at most flush-max-buffers lines each time.
#[test]
fn acp_wake_up_and_flush_max_buffers_and_ignores_activity() {
    let r = rig(4, 1024, CacheMode::Wb, 16 * MIB);
    r.acp(|a| {
        a.wake_up_ms = 50;
        a.flush_max_buffers = 10;
    });
    for l in 0..100 {
        r.write_line(l * 2, 1);
    }
    let mut runs = Vec::new();
    for t in 0..500u64 {
        r.poke();
        let k = r.tick(t);
        if k.ran {
            assert_eq!(k.cleaned, 10);
            runs.push(t);
        }
    }
    assert_eq!(runs, (0..500).step_by(50).collect::<Vec<_>>());
    assert_eq!(r.dirty(), 0);
    // wake-up 0: every tick runs.
    r.acp(|a| a.wake_up_ms = 0);
    r.write_line(1, 2);
    assert_eq!(r.tick(600).cleaned, 1);
    assert!(r.tick(600).ran);
}

// ---- nop -------------------------------------------------------------------------------------

/// nop never cleans on its own; a flush still writes everything.
#[test]
fn nop_never_cleans_but_flush_does() {
    let r = rig(4, 256, CacheMode::Wb, 4 * MIB);
    let mut c = r.cache.cleaning();
    c.policy = CleaningPolicy::Nop;
    eager(&mut c.alru);
    r.cache.set_cleaning(c).unwrap();
    for l in 0..50 {
        r.write_line(l, l);
    }
    for t in (0..200_000).step_by(1000) {
        let k = r.tick(t);
        assert_eq!(k, CleaningTick::default());
    }
    assert_eq!(r.dirty(), 50);
    assert!(r.rec.take_writes().is_empty());
    r.cache.flush().unwrap();
    assert_eq!(r.dirty(), 0);
    let direct = read_vol(&**r.core_vol.as_ref().unwrap(), 0, 50 * 4096);
    for l in 0..50u64 {
        let want = stamped(4096, l, l * 8);
        assert_eq!(
            &direct[(l * 4096) as usize..((l + 1) * 4096) as usize],
            &want
        );
    }
    // Switching to alru later cleans what nop left (here: nothing left, new lines).
    c.policy = CleaningPolicy::Alru;
    r.cache.set_cleaning(c).unwrap();
    r.write_line(60, 1);
    r.tick(300_000);
    assert_eq!(r.tick(301_000).cleaned, 1);
}

// ---- how cleaning writes ---------------------------------------------------------------------

/// A cache written line by line in random order goes back to the core sorted by address and
/// merged: a 4 MiB region of 4 KiB lines as 64 KiB writes with merge-max 64 KiB, as 1 MiB
/// writes with the default; the same for background cleaning and a user flush.
#[test]
fn cleaning_writes_are_sorted_and_merged() {
    let r = rig(4, 2048, CacheMode::Wb, 16 * MIB);
    let mut order: Vec<u64> = (0..1024).collect();
    let mut x = seed(11);
    for i in (1..order.len()).rev() {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        order.swap(i, (x >> 33) as usize % (i + 1));
    }
    let fill = |tag| {
        for &l in &order {
            r.write_line(l, tag);
        }
        assert_eq!(r.dirty(), 1024);
    };
    let expect_tiles = |writes: &[(u64, u64)], size: u64| {
        let mut sorted = writes.to_vec();
        sorted.sort_unstable();
        let want: Vec<(u64, u64)> = (0..4 * MIB / size).map(|i| (i * size, size)).collect();
        assert_eq!(sorted, want, "writes of {size} bytes tiling 4 MiB");
    };
    // Background alru, merge-max 64 KiB.
    r.alru(|a| {
        eager(a);
        a.flush_max_buffers = 10_000;
    });
    r.merge_max_kib(64);
    fill(1);
    r.tick(0);
    assert_eq!(r.tick(1000).cleaned, 1024);
    let writes = r.rec.take_writes();
    expect_tiles(&writes, 64 * KIB);
    assert_sorted_within(&writes, 32);
    // User flush, merge-max 64 KiB.
    fill(2);
    r.cache.flush().unwrap();
    let writes = r.rec.take_writes();
    expect_tiles(&writes, 64 * KIB);
    assert_sorted_within(&writes, 32);
    // Default merge-max (1 MiB).
    r.merge_max_kib(1024);
    fill(3);
    r.cache.flush().unwrap();
    expect_tiles(&r.rec.take_writes(), MIB);
    // merge-max 4 KiB: one write per line.
    r.merge_max_kib(4);
    fill(4);
    r.cache.flush().unwrap();
    expect_tiles(&r.rec.take_writes(), 4 * KIB);
    // And the data is right.
    let direct = read_all(r.core_vol.as_ref().unwrap());
    assert!(first_difference(&stamped(4 * MIB, 4, 0), &direct[..(4 * MIB) as usize], 0).is_none());

    // Scattered dirty sectors: runs of sectors merge across line boundaries, gaps split writes.
    r.merge_max_kib(1024);
    let pieces = [(8 * KIB + 3584, 1024), (64 * KIB, 512), (65 * KIB, 512)];
    for &(off, len) in &pieces {
        r.core.write(&stamped(len, 9, off / SECTOR), off).unwrap();
    }
    r.cache.flush().unwrap();
    let mut writes = r.rec.take_writes();
    writes.sort_unstable();
    assert_eq!(writes, pieces.to_vec());
}

/// A dirty run that starts in the middle of a megabyte goes back as a short write up to the next
/// megabyte, then whole aligned megabytes: a disk array's stripes divide them. Cut by size alone
/// its writes all straddled stripes (512 KiB to 1.5 MiB, 1.5 to 2.5).
#[test]
fn cleaning_writes_are_cut_at_aligned_addresses() {
    let r = rig(4, 1024, CacheMode::Wb, 16 * MIB);
    r.merge_max_kib(1024);
    let (from, to) = (512 * KIB, 2 * MIB + 512 * KIB);
    r.core
        .write(&stamped(to - from, 5, from / SECTOR), from)
        .unwrap();
    r.cache.flush().unwrap();
    let mut writes = r.rec.take_writes();
    writes.sort_unstable();
    assert_eq!(
        writes,
        vec![(512 * KIB, 512 * KIB), (MIB, MIB), (2 * MIB, 512 * KIB)]
    );
    assert_merged(&writes, MIB);
}

/// At most flush-max-buffers core writes are in flight, for alru and acp; with 1, one at a time.
#[test]
fn cleaning_keeps_at_most_flush_max_buffers_in_flight() {
    let r = rig(4, 1024, CacheMode::Wb, 16 * MIB);
    r.rec.set_delay(Duration::from_millis(20));
    let dirty = |tag| {
        for l in 0..64 {
            // Every other line: no merging.
            r.write_line(l * 2, tag);
        }
    };
    let mut t = 0;
    for (policy, fmb) in [
        (CleaningPolicy::Alru, 8),
        (CleaningPolicy::Alru, 1),
        (CleaningPolicy::Acp, 4),
    ] {
        dirty(fmb as u64);
        let mut c = r.cache.cleaning();
        c.policy = policy;
        eager(&mut c.alru);
        c.alru.flush_max_buffers = fmb;
        c.acp = AcpParams {
            wake_up_ms: 0,
            flush_max_buffers: fmb,
        };
        r.cache.set_cleaning(c).unwrap();
        // alru: the tick at t marks the lines, the one at t + 1000 finds them old enough.
        r.tick(t);
        r.rec.take_writes();
        r.rec.reset_max_in_flight();
        let k = r.tick(t + 1000);
        t += 2000;
        assert_eq!(k.cleaned, fmb as u64, "{policy} {fmb}");
        let max = r.rec.max_in_flight();
        assert!(
            max <= fmb as usize,
            "{policy}: {max} writes in flight, flush-max-buffers {fmb}"
        );
        // Observable parallelism (loose: the machine is shared).
        if fmb > 1 {
            assert!(
                max >= 2,
                "{policy}: only {max} in flight with {fmb} allowed"
            );
        }
        let writes = r.rec.take_writes();
        assert_sorted_within(&writes, fmb as usize);
        assert_merged(&writes, 1024 * KIB);
        r.cache.flush().unwrap();
    }
    assert!(r.cache.cleaning_stats().max_in_flight >= 2);
}

/// The bandwidth cap holds: 4 MiB at 8 MiB/s takes about half a second.
#[test]
fn cleaning_bandwidth_cap_holds() {
    let r = rig(4, 2048, CacheMode::Wb, 16 * MIB);
    let mut c = r.cache.cleaning();
    c.apply_preset("alru-very-aggressive").unwrap();
    c.io.merge_max_kib = 64;
    c.io.max_bandwidth_mib_s = 8;
    r.cache.set_cleaning(c).unwrap();
    for l in 0..1024 {
        r.write_line(l, 1);
    }
    r.tick(0);
    let start = Instant::now();
    assert_eq!(r.tick(1000).cleaned, 1024);
    let took = start.elapsed();
    assert!(
        took >= Duration::from_millis(450) && took < Duration::from_secs(20),
        "4 MiB at 8 MiB/s took {took:?}"
    );
    // A user flush is what its caller waits for: the cap does not slow it.
    for l in 0..1024 {
        r.write_line(l, 2);
    }
    let start = Instant::now();
    r.cache.flush().unwrap();
    let took = start.elapsed();
    assert!(
        took < Duration::from_millis(400),
        "a flush of 4 MiB was paced: {took:?}"
    );
}

/// `cleaning_stats()` counts exactly the core writes cleaning issued, by size bucket.
#[test]
fn cleaning_stats_match_the_core_writes() {
    let r = rig(4, 2048, CacheMode::Wb, 32 * MIB);
    let before = r.cache.cleaning_stats();
    // Dirty runs of 1..=20 lines with one-line gaps, plus a lone sector.
    let mut l = 0;
    let mut lines = 0;
    for n in 1..=20u64 {
        let data = stamped(n * 4096, n, l * 8);
        r.core.write(&data, l * 4096).unwrap();
        l += n + 1;
        lines += n;
    }
    r.core.write(&stamped(512, 99, l * 8), l * 4096).unwrap();
    lines += 1;
    r.alru(|a| {
        eager(a);
        a.flush_max_buffers = 10_000;
    });
    r.tick(0);
    assert_eq!(r.tick(1000).cleaned, lines);
    let writes = r.rec.take_writes();
    assert_eq!(writes.len(), 21);
    assert_merged(&writes, 1024 * KIB);
    let after = r.cache.cleaning_stats();
    let mut want = [0u64; WRITE_SIZE_BUCKETS];
    for &(_, len) in &writes {
        let bucket = (0..WRITE_SIZE_BUCKETS)
            .find(|&i| len <= 4096 << i)
            .unwrap_or(WRITE_SIZE_BUCKETS - 1);
        want[bucket] += 1;
    }
    let got: Vec<u64> = (0..WRITE_SIZE_BUCKETS)
        .map(|i| after.write_sizes[i] - before.write_sizes[i])
        .collect();
    assert_eq!(got, want);
    assert_eq!(after.core_writes - before.core_writes, 21);
    assert_eq!(
        after.core_write_bytes - before.core_write_bytes,
        writes.iter().map(|w| w.1).sum::<u64>()
    );
    assert_eq!(after.cleaned_lines - before.cleaned_lines, lines);
    assert!(after.max_in_flight >= 1);
}

// ---- sequential cutoff -----------------------------------------------------------------------

fn seq(policy: SeqCutoffPolicy, threshold_kib: u32, promotion_count: u32) -> SeqCutoff {
    SeqCutoff {
        policy,
        threshold_kib,
        promotion_count,
        promotion_threshold_kib: 0,
    }
}

/// Eight interleaved sequential streams of 16 KiB requests, threshold 64 KiB and promotion
/// count 4: each stream is cut off from its 4th request, reads and writes alike; cut-off data is
/// not inserted, and the later of threshold and count decides.
#[test]
fn seq_cutoff_recognises_interleaved_streams() {
    for write in [false, true] {
        let r = rig(4, 4096, CacheMode::Wt, 512 * MIB);
        r.cache
            .set_seq_cutoff(Some(r.id), seq(SeqCutoffPolicy::Always, 64, 4))
            .unwrap();
        let streams = 8u64;
        let req = 16 * KIB;
        let io = |s: u64, i: u64| {
            let off = s * 32 * MIB + i * req;
            if write {
                r.core.write(&stamped(req, s, off / SECTOR), off).unwrap();
            } else {
                let mut b = vec![0u8; req as usize];
                r.core.read(&mut b, off).unwrap();
            }
        };
        for i in 0..10 {
            for s in 0..streams {
                io(s, i);
            }
        }
        let (ptr, ptw) = r.pass_through();
        assert_eq!(
            if write { ptw } else { ptr },
            streams * 7,
            "write {write}: streams cut from their 4th request"
        );
        assert_eq!(if write { ptr } else { ptw }, 0);
        assert_eq!(r.occupancy(), streams * 3 * 4, "write {write}");
        // Threshold 128 KiB, count 2: cut from the 8th request (128 KiB moved).
        r.cache
            .set_seq_cutoff(None, seq(SeqCutoffPolicy::Always, 128, 2))
            .unwrap();
        for i in 0..10 {
            for s in 0..streams {
                io(s + 8, i);
            }
        }
        let (ptr2, ptw2) = r.pass_through();
        assert_eq!(if write { ptw2 - ptw } else { ptr2 - ptr }, streams * 3);
        assert_eq!(r.occupancy(), streams * 3 * 4 + streams * 7 * 4);
        // Everything reads back as written (cut-off writes went to the core).
        if write {
            for s in 0..16 {
                let off = s * 32 * MIB;
                let mut b = vec![0u8; (10 * req) as usize];
                r.core.read(&mut b, off).unwrap();
                assert!(first_difference(&stamped(10 * req, s, off / SECTOR), &b, 0).is_none());
            }
        }
    }
}

/// A stream that turns random stops being cut off (and its requests are cached again); back to
/// sequential it has to qualify anew.
#[test]
fn seq_cutoff_stream_that_turns_random_is_cached_again() {
    let r = rig(4, 4096, CacheMode::Wt, 512 * MIB);
    r.cache
        .set_seq_cutoff(None, seq(SeqCutoffPolicy::Always, 16, 3))
        .unwrap();
    let read = |off: u64| {
        let mut b = vec![0u8; 8192];
        r.core.read(&mut b, off).unwrap();
    };
    for i in 0..10 {
        read(i * 8192);
    }
    assert_eq!(r.pass_through().0, 8);
    let occ = r.occupancy();
    assert_eq!(occ, 4);
    // Random: offsets far apart, none continuing another.
    for i in 0..10u64 {
        read(MIB + (i * 7919 % 101) * 3 * 8192);
    }
    assert_eq!(r.pass_through().0, 8, "random requests were cut off");
    assert_eq!(r.occupancy(), occ + 20);
    // Sequential again from somewhere new: requests 1 and 2 cached, then cut.
    for i in 0..5 {
        read(300 * MIB + i * 8192);
    }
    assert_eq!(r.pass_through().0, 8 + 3);
}

/// `full` cuts off only when the cache is nearly full: free lines <= 512 + the request's lines.
#[test]
fn seq_cutoff_full_depends_on_free_space() {
    let r = rig(4, 2000, CacheMode::Wt, 512 * MIB);
    r.cache
        .set_seq_cutoff(Some(r.id), seq(SeqCutoffPolicy::Full, 16, 2))
        .unwrap();
    let read = |off: u64, len: u64| {
        let mut b = vec![0u8; len as usize];
        r.core.read(&mut b, off).unwrap();
    };
    // Plenty of room: a long stream is cached.
    for i in 0..10 {
        read(i * 16 * KIB, 16 * KIB);
    }
    assert_eq!(r.pass_through().0, 0);
    assert_eq!(r.occupancy(), 40);
    // Fill with scattered single lines until 522 are free: a stream's 16 KiB request (4
    // lines) still goes into the cache; once the cache is nearly full, it is cut off.
    // (The exact margin is checked by `seq_cutoff_full_margin_is_512_plus_the_request_lines`.)
    let mut l = 0;
    while 2000 - r.occupancy() > 518 + 4 {
        read(100 * MIB + l * 3 * 4096, 4096);
        l += 1;
    }
    assert_eq!(r.pass_through().0, 0);
    // Request 1 of a new stream (not cut: too short) leaves 518 free.
    read(200 * MIB, 16 * KIB);
    assert_eq!(2000 - r.occupancy(), 518);
    read(200 * MIB + 16 * KIB, 16 * KIB);
    assert_eq!(r.pass_through().0, 0, "518 free: not nearly full");
    assert_eq!(2000 - r.occupancy(), 514);
    read(200 * MIB + 32 * KIB, 16 * KIB);
    assert_eq!(r.pass_through().0, 1, "514 free: nearly full");
    assert_eq!(2000 - r.occupancy(), 514);
    // Random requests are still cached.
    read(300 * MIB, 4096);
    assert_eq!(2000 - r.occupancy(), 513);
    // `never`: even a full cache caches sequential IO.
    r.cache
        .set_seq_cutoff(Some(r.id), seq(SeqCutoffPolicy::Never, 1, 1))
        .unwrap();
    for i in 0..200 {
        read(400 * MIB + i * 64 * KIB, 64 * KIB);
    }
    assert_eq!(r.pass_through().0, 1);
    // `always` on an empty cache.
    let r2 = rig(4, 2000, CacheMode::Wt, 64 * MIB);
    r2.cache
        .set_seq_cutoff(Some(r2.id), seq(SeqCutoffPolicy::Always, 16, 2))
        .unwrap();
    for i in 0..10 {
        let mut b = vec![0u8; 16384];
        r2.core.read(&mut b, i * 16 * KIB).unwrap();
    }
    assert_eq!(r2.pass_through().0, 9);
    assert_eq!(r2.occupancy(), 4);
}

/// domain.md §5: "nearly full" is free lines <= 512 + the request's lines. A 16 KiB request
/// on 4 KiB lines touches 4 lines: 517 free is not nearly full, 516 is.
///
/// Ignored until cache.rs `cut_off` counts the lines a request touches instead of
/// `len.div_ceil(line) + 1` (one too many for an aligned request); see the h-poltest report.
#[test]
fn seq_cutoff_full_margin_is_512_plus_the_request_lines() {
    let r = rig(4, 2000, CacheMode::Wt, 512 * MIB);
    r.cache
        .set_seq_cutoff(Some(r.id), seq(SeqCutoffPolicy::Full, 16, 2))
        .unwrap();
    let read = |off: u64, len: u64| {
        let mut b = vec![0u8; len as usize];
        r.core.read(&mut b, off).unwrap();
    };
    let mut l = 0;
    while 2000 - r.occupancy() > 517 + 4 {
        read(100 * MIB + l * 3 * 4096, 4096);
        l += 1;
    }
    read(200 * MIB, 16 * KIB);
    assert_eq!(2000 - r.occupancy(), 517);
    read(200 * MIB + 16 * KIB, 16 * KIB);
    assert_eq!(r.pass_through().0, 0, "517 free > 512 + 4: not nearly full");
    // 513 free now; an unaligned 16 KiB request touches 5 lines.
    read(200 * MIB + 32 * KIB, 16 * KIB);
    assert_eq!(r.pass_through().0, 1, "513 free: nearly full");
}

/// Seq cutoff per core, or for every core when none is named.
#[test]
fn seq_cutoff_per_core_and_all_cores() {
    let (cache, _v) = new_cache(4, 4096, CacheMode::Wt);
    let a = add_core(&cache, 64 * MIB);
    let b = add_core(&cache, 64 * MIB);
    assert_eq!(cache.seq_cutoff(a.id).unwrap(), SeqCutoff::default());
    let always = seq(SeqCutoffPolicy::Always, 16, 2);
    cache.set_seq_cutoff(Some(a.id), always).unwrap();
    assert_eq!(cache.seq_cutoff(a.id).unwrap(), always);
    assert_eq!(cache.seq_cutoff(b.id).unwrap(), SeqCutoff::default());
    let stream = |c: &TestCore, base: u64| {
        for i in 0..8 {
            let mut buf = vec![0u8; 8192];
            c.core.read(&mut buf, base + i * 8192).unwrap();
        }
        cache.core_stats(c.id).unwrap().requests.pass_through_reads
    };
    assert_eq!(stream(&a, 0), 7);
    assert_eq!(stream(&b, 0), 0);
    let never = seq(SeqCutoffPolicy::Never, 16, 2);
    cache.set_seq_cutoff(None, never).unwrap();
    assert_eq!(cache.seq_cutoff(a.id).unwrap(), never);
    assert_eq!(cache.seq_cutoff(b.id).unwrap(), never);
    assert_eq!(stream(&a, MIB), 7);
    cache.set_seq_cutoff(None, always).unwrap();
    assert_eq!(stream(&b, 2 * MIB), 7);
    assert!(cache.set_seq_cutoff(Some(99), always).is_err());
}

/// A cut-off write over dirty cached data: reads return the newer data, the sectors it did not
/// cover keep their dirty data, and cleaning never writes the old data over the new.
#[test]
fn seq_cutoff_write_over_dirty_data_stays_correct() {
    let r = rig(4, 1024, CacheMode::Wb, 16 * MIB);
    r.alru(eager);
    // Dirty lines 100 and 101 (400..408 KiB), tag 1.
    let d = 400 * KIB;
    r.core.write(&stamped(8 * KIB, 1, d / SECTOR), d).unwrap();
    let mut model = vec![0u8; (16 * MIB) as usize];
    model[d as usize..(d + 8 * KIB) as usize].copy_from_slice(&stamped(8 * KIB, 1, d / SECTOR));
    r.cache
        .set_seq_cutoff(None, seq(SeqCutoffPolicy::Always, 12, 2))
        .unwrap();
    // A write stream of 6 KiB requests from 388 KiB: the 2nd (12 KiB moved) on is cut off; the
    // 3rd covers 400..406 KiB, line 100 and half of line 101.
    for i in 0..3 {
        let off = 388 * KIB + i * 6 * KIB;
        let data = stamped(6 * KIB, 2 + i, off / SECTOR);
        r.core.write(&data, off).unwrap();
        model[off as usize..(off + 6 * KIB) as usize].copy_from_slice(&data);
    }
    assert_eq!(r.pass_through().1, 2);
    // Dirty: line 97 and half of 98 (the first request, cached) and line 101's uncovered
    // half; line 100 is gone.
    assert_eq!(r.dirty(), 3);
    // A cut-off read stream over the rest returns the dirty sectors from the cache.
    for i in 0..4 {
        let off = 396 * KIB + i * 4 * KIB;
        let mut b = vec![0u8; 4096];
        r.core.read(&mut b, off).unwrap();
        let want = &model[off as usize..(off + 4096) as usize];
        assert!(first_difference(want, &b, off / SECTOR).is_none());
    }
    let mut b = vec![0u8; (32 * KIB) as usize];
    r.core.read(&mut b, 384 * KIB).unwrap();
    assert!(first_difference(&model[(384 * KIB) as usize..(416 * KIB) as usize], &b, 0).is_none());
    // Clean in the background, then flush: the core holds the model.
    r.tick(0);
    r.tick(1000);
    r.cache.flush().unwrap();
    assert_eq!(r.dirty(), 0);
    let direct = read_all(r.core_vol.as_ref().unwrap());
    if let Some(diff) = first_difference(&model, &direct, 0) {
        panic!("core after cleaning: {diff}");
    }
}

// ---- promotion -------------------------------------------------------------------------------

/// nhit: below the trigger occupancy everything is inserted; above it a core line is inserted
/// only on its threshold-th access, and declined requests count as pass-through.
#[test]
fn promotion_nhit_inserts_on_the_threshold_th_access_above_trigger() {
    for mode in [CacheMode::Wt, CacheMode::Wb] {
        let r = rig(4, 100, mode, 16 * MIB);
        let nhit = Promotion {
            policy: PromotionPolicy::Nhit,
            threshold: 3,
            trigger_pct: 50,
        };
        r.cache.set_promotion(nhit).unwrap();
        assert_eq!(r.cache.promotion(), nhit);
        let read = |l: u64| {
            let mut b = vec![0u8; 4096];
            r.core.read(&mut b, l * 4096).unwrap();
        };
        for i in 0..50 {
            read(i * 2);
            assert_eq!(r.occupancy(), i + 1, "{mode}: below the trigger");
        }
        assert_eq!(r.pass_through(), (0, 0));
        // At 50%: a new line needs three accesses.
        read(1001);
        read(1001);
        assert_eq!((r.occupancy(), r.pass_through().0), (50, 2), "{mode}");
        read(1001);
        assert_eq!((r.occupancy(), r.pass_through().0), (51, 2), "{mode}");
        let hits = r.cache.core_stats(r.id).unwrap().requests.read_hits;
        read(1001);
        assert_eq!(
            r.cache.core_stats(r.id).unwrap().requests.read_hits,
            hits + 1
        );
        // Mapped lines are hits whatever their count.
        read(0);
        assert_eq!(r.pass_through().0, 2);
        // Writes alike; a declined write goes to the core.
        for k in 1..=3 {
            r.write_line(2001, k);
            let want = if k < 3 { (51, k) } else { (52, 2) };
            assert_eq!(
                (r.occupancy(), r.pass_through().1),
                want,
                "{mode} write {k}"
            );
        }
        let direct = read_vol(&**r.core_vol.as_ref().unwrap(), 2000 * 4096, 2 * 4096);
        if mode == CacheMode::Wb {
            assert_eq!(
                &direct[4096..],
                &stamped(4096, 2, 2001 * 8)[..],
                "declined write"
            );
        }
        let mut b = vec![0u8; 4096];
        r.core.read(&mut b, 2001 * 4096).unwrap();
        assert_eq!(b, stamped(4096, 3, 2001 * 8));
        // trigger 100: inserted at once until the cache is full.
        r.cache
            .set_promotion(Promotion {
                trigger_pct: 100,
                ..nhit
            })
            .unwrap();
        read(3001);
        assert_eq!(r.occupancy(), 53);
        // Back to always.
        r.cache.set_promotion(Promotion::default()).unwrap();
        read(4001);
        assert_eq!(r.occupancy(), 54);
    }
}

// ---- parameters ------------------------------------------------------------------------------

/// Out-of-range values are refused with a message naming the parameter and its range, and
/// nothing changes; the bounds themselves are accepted.
#[test]
fn out_of_range_parameters_are_refused_and_change_nothing() {
    let r = rig(4, 256, CacheMode::Wb, 4 * MIB);
    let base = r.cache.cleaning();
    type Edit = fn(&mut CleaningConfig, bool);
    let cases: &[(Edit, &str)] = &[
        (
            |c, bad| c.alru.wake_up_s = if bad { 3601 } else { 3600 },
            "wake-up 3601 is out of range 0..3600 s",
        ),
        (
            |c, bad| c.alru.staleness_time_s = if bad { 0 } else { 1 },
            "staleness-time 0 is out of range 1..3600 s",
        ),
        (
            |c, bad| c.alru.staleness_time_s = if bad { 3601 } else { 3600 },
            "staleness-time 3601 is out of range 1..3600 s",
        ),
        (
            |c, bad| c.alru.flush_max_buffers = if bad { 0 } else { 1 },
            "flush-max-buffers 0 is out of range 1..10000",
        ),
        (
            |c, bad| c.alru.flush_max_buffers = if bad { 10_001 } else { 10_000 },
            "flush-max-buffers 10001 is out of range 1..10000",
        ),
        (
            |c, bad| c.alru.activity_threshold_ms = if bad { 1_000_001 } else { 1_000_000 },
            "activity-threshold 1000001 is out of range 0..1000000 ms",
        ),
        (
            |c, bad| c.alru.dirty_ratio_threshold = if bad { 101 } else { 0 },
            "dirty-ratio-threshold 101 is out of range 0..100 %",
        ),
        (
            |c, bad| c.acp.wake_up_ms = if bad { 10_001 } else { 10_000 },
            "wake-up 10001 is out of range 0..10000 ms",
        ),
        (
            |c, bad| c.acp.flush_max_buffers = if bad { 0 } else { 10_000 },
            "flush-max-buffers 0 is out of range 1..10000",
        ),
        (
            |c, bad| c.io.merge_max_kib = if bad { 3 } else { 4 },
            "merge-max 3 is out of range 4..4096 KiB",
        ),
        (
            |c, bad| c.io.merge_max_kib = if bad { 4097 } else { 4096 },
            "merge-max 4097 is out of range 4..4096 KiB",
        ),
    ];
    for &(edit, msg) in cases {
        let mut c = base;
        edit(&mut c, true);
        let e = r.cache.set_cleaning(c).unwrap_err().to_string();
        assert!(e.contains(msg), "expected '{msg}' in '{e}'");
        assert_eq!(
            r.cache.cleaning(),
            base,
            "a refused change changed something"
        );
        let mut ok = base;
        edit(&mut ok, false);
        r.cache.set_cleaning(ok).unwrap();
        assert_eq!(r.cache.cleaning(), ok);
        r.cache.set_cleaning(base).unwrap();
    }
    let s0 = r.cache.seq_cutoff(r.id).unwrap();
    for (bad, msg) in [
        (
            seq(SeqCutoffPolicy::Always, 0, 8),
            "threshold 0 is out of range 1..4194181 KiB",
        ),
        (
            seq(SeqCutoffPolicy::Always, 4_194_182, 8),
            "threshold 4194182 is out of range 1..4194181 KiB",
        ),
        (
            seq(SeqCutoffPolicy::Never, 1024, 0),
            "promotion-count 0 is out of range 1..65535",
        ),
        (
            seq(SeqCutoffPolicy::Never, 1024, 65_536),
            "promotion-count 65536 is out of range 1..65535",
        ),
    ] {
        for target in [Some(r.id), None] {
            let e = r.cache.set_seq_cutoff(target, bad).unwrap_err().to_string();
            assert!(e.contains(msg), "expected '{msg}' in '{e}'");
            assert_eq!(r.cache.seq_cutoff(r.id).unwrap(), s0);
        }
    }
    r.cache
        .set_seq_cutoff(None, seq(SeqCutoffPolicy::Always, 4_194_181, 65_535))
        .unwrap();
    let p0 = r.cache.promotion();
    for (bad, msg) in [
        ((1, 80), "threshold 1 is out of range 2..1000"),
        ((1001, 80), "threshold 1001 is out of range 2..1000"),
        ((3, 101), "trigger 101 is out of range 0..100 %"),
    ] {
        let p = Promotion {
            policy: PromotionPolicy::Nhit,
            threshold: bad.0,
            trigger_pct: bad.1,
        };
        let e = r.cache.set_promotion(p).unwrap_err().to_string();
        assert!(e.contains(msg), "expected '{msg}' in '{e}'");
        assert_eq!(r.cache.promotion(), p0);
    }
    for (threshold, trigger_pct) in [(2, 0), (1000, 100)] {
        let p = Promotion {
            policy: PromotionPolicy::Nhit,
            threshold,
            trigger_pct,
        };
        r.cache.set_promotion(p).unwrap();
        assert_eq!(r.cache.promotion(), p);
    }
}

/// Policies switch at run time and keep every policy's tunables, as Open CAS does.
#[test]
fn switching_cleaning_policy_keeps_tunables() {
    let r = rig(4, 256, CacheMode::Wb, 4 * MIB);
    let mut c = r.cache.cleaning();
    assert_eq!(c, CleaningConfig::default());
    c.alru.staleness_time_s = 42;
    c.acp.flush_max_buffers = 7;
    r.cache.set_cleaning(c).unwrap();
    for p in [
        CleaningPolicy::Acp,
        CleaningPolicy::Nop,
        CleaningPolicy::Alru,
    ] {
        let mut c = r.cache.cleaning();
        c.policy = p;
        r.cache.set_cleaning(c).unwrap();
        let got = r.cache.cleaning();
        assert_eq!(got.policy, p);
        assert_eq!(
            (got.alru.staleness_time_s, got.acp.flush_max_buffers),
            (42, 7)
        );
    }
}

fn every_parameter() -> (CleaningConfig, Promotion, SeqCutoff, SeqCutoff) {
    let mut c = CleaningConfig {
        policy: CleaningPolicy::Acp,
        ..CleaningConfig::default()
    };
    c.alru = AlruParams {
        wake_up_s: 7,
        staleness_time_s: 9,
        flush_max_buffers: 11,
        activity_threshold_ms: 13,
        dirty_ratio_threshold: 60,
        dirty_ratio_inertia_mib: 17,
    };
    c.acp = AcpParams {
        wake_up_ms: 19,
        flush_max_buffers: 23,
    };
    c.io.merge_max_kib = 256;
    c.io.max_bandwidth_mib_s = 29;
    let p = Promotion {
        policy: PromotionPolicy::Nhit,
        threshold: 5,
        trigger_pct: 0,
    };
    (
        c,
        p,
        seq(SeqCutoffPolicy::Always, 77, 5),
        seq(SeqCutoffPolicy::Never, 99, 6),
    )
}

/// Every parameter survives stop and load, and the loaded policies act (nhit declines).
#[test]
fn policies_persist_across_stop_and_load() {
    let cache_vol = ram("cache", 16 * MIB);
    let core3 = ram("core3", 8 * MIB);
    let core5 = ram("core5", 8 * MIB);
    let config = CacheConfig {
        id: 4,
        line_size: LineSize::from_kib(4).unwrap(),
        mode: CacheMode::Wt,
    };
    let cache = Cache::create(as_ref(&cache_vol), config, false).unwrap();
    cache.add_core(as_ref(&core3), Some(3)).unwrap();
    cache.add_core(as_ref(&core5), Some(5)).unwrap();
    let (c, p, s3, s5) = every_parameter();
    cache.set_cleaning(c).unwrap();
    cache.set_promotion(p).unwrap();
    cache.set_seq_cutoff(None, s5).unwrap();
    cache.set_seq_cutoff(Some(3), s3).unwrap();
    cache.stop(true).unwrap();
    drop(cache);
    let (v3, v5) = (as_ref(&core3), as_ref(&core5));
    let cache = Cache::load(as_ref(&cache_vol), &mut |rec| match rec.id {
        3 => Some(v3.clone()),
        5 => Some(v5.clone()),
        _ => None,
    })
    .unwrap();
    cache.stop_background_cleaner();
    assert_eq!(cache.cleaning(), c);
    assert_eq!(cache.promotion(), p);
    assert_eq!(cache.seq_cutoff(3).unwrap(), s3);
    assert_eq!(cache.seq_cutoff(5).unwrap(), s5);
    // nhit with trigger 0 declines first accesses after the load too.
    let core = cache.core(5).unwrap();
    let mut b = vec![0u8; 4096];
    for _ in 0..5 {
        core.read(&mut b, 4096 * 100).unwrap();
    }
    let st = cache.core_stats(5).unwrap();
    assert_eq!(st.requests.pass_through_reads, 4, "{st:?}");
}

/// A core whose device is missing at load keeps its seq cutoff, which can be changed while it
/// is inactive and is kept by the next load.
///
/// Ignored: `Cache::set_seq_cutoff(Some(inactive core))` deadlocks in cache.rs (the write guard
/// of `seq_cutoff_inactive` taken in the `if let` scrutinee is still held when `save_policies`
/// reads it); see the h-poltest report. The watchdog turns the hang into a failure.
#[test]
fn seq_cutoff_of_an_inactive_core_persists() {
    let _watchdog = Watchdog::new("inactive core seq cutoff", Duration::from_secs(30));
    let cache_vol = ram("cache", 16 * MIB);
    let core3 = ram("core3", 8 * MIB);
    let core5 = ram("core5", 8 * MIB);
    let config = CacheConfig {
        id: 4,
        line_size: LineSize::from_kib(4).unwrap(),
        mode: CacheMode::Wt,
    };
    let cache = Cache::create(as_ref(&cache_vol), config, false).unwrap();
    cache.add_core(as_ref(&core3), Some(3)).unwrap();
    cache.add_core(as_ref(&core5), Some(5)).unwrap();
    let (c, _, s3, s5) = every_parameter();
    cache.set_cleaning(c).unwrap();
    cache.set_seq_cutoff(None, s5).unwrap();
    cache.set_seq_cutoff(Some(3), s3).unwrap();
    cache.stop(true).unwrap();
    drop(cache);
    let v3 = as_ref(&core3);
    let cache = Cache::load(as_ref(&cache_vol), &mut |rec| {
        (rec.id == 3).then(|| v3.clone())
    })
    .unwrap();
    assert_eq!(cache.seq_cutoff(5).unwrap(), s5);
    let s = seq(SeqCutoffPolicy::Full, 5, 5);
    cache.set_seq_cutoff(Some(5), s).unwrap();
    cache.stop(true).unwrap();
    drop(cache);
    let cache = Cache::load(as_ref(&cache_vol), &mut |_| None).unwrap();
    assert_eq!(cache.seq_cutoff(5).unwrap(), s);
    assert_eq!(cache.seq_cutoff(3).unwrap(), s3);
    assert_eq!(cache.cleaning(), c);
}

/// A volatile cache takes and reports every parameter too.
#[test]
fn volatile_cache_takes_every_parameter() {
    let (cache, _v) = new_cache(4, 256, CacheMode::Wt);
    let a = add_core(&cache, 4 * MIB);
    let (c, p, s3, _) = every_parameter();
    cache.set_cleaning(c).unwrap();
    cache.set_promotion(p).unwrap();
    cache.set_seq_cutoff(None, s3).unwrap();
    assert_eq!(cache.cleaning(), c);
    assert_eq!(cache.promotion(), p);
    assert_eq!(cache.seq_cutoff(a.id).unwrap(), s3);
    assert!(!cache.persistent());
}

//! Model-based randomized test: whatever the mode, line size, cache size, number of cores and
//! sequence of requests, every read returns the newest data written (a plain byte array per core
//! is the model), and after a flush every core device holds exactly the model.
//!
//! Policy changes join the sequence (cleaning policy and tunables, including tiny
//! flush-max-buffers and 4 KiB merge-max; sequential cutoff with small thresholds so it
//! triggers; nhit promotion with a low trigger; lazy flush on and off; offload on and off with
//! threshold 0 so that it routes clean hits and write misses to the core here, where no queue
//! builds up; read-ahead on and off with
//! small thresholds, fed by reads that continue the previous one), the cleaner runs on a fake
//! clock that the ops advance, and queued read-ahead runs when an op says so: none of it may
//! change what reads return.
//!
//! Operations address sectors through "shapes" resolved against the core size at run time, so
//! shrinking by proptest keeps every operation valid. Written data is stamped with (core, op
//! number, sector), so a failure message says which write a wrong sector came from.

mod common;

use std::time::Duration;

use common::*;
use hybridcache_engine::{
    Cache, CacheMode, CleaningConfig, CleaningPolicy, LazyFlush, LineSize, Offload, Prefetch,
    PrefetchPolicy, Promotion, PromotionPolicy, SeqCutoff, SeqCutoffPolicy,
};
use proptest::prelude::*;
use proptest::test_runner::TestCaseError;

#[derive(Debug, Clone, Copy)]
enum Kind {
    Read,
    Write,
    Discard,
    WriteZeroes,
    /// `Core::flush`: a durability request on the exported volume.
    CoreFlush,
    /// `Cache::flush`: write back everything.
    CacheFlush,
    /// `Cache::flush_core` of the op's core.
    FlushCore,
    SetMode(CacheMode, bool),
    /// A cleaning configuration chosen by the op's `a` and `b` (see [`cleaning_config`]).
    SetCleaning,
    /// Advance the fake clock by `a % 2500` ms and run the cleaner once.
    Tick,
    /// Sequential cutoff for the op's core or all cores (see [`seq_cutoff`]).
    SetSeqCutoff,
    /// Promotion always or nhit (see [`promotion`]).
    SetPromotion,
    /// Lazy flush on (odd `a`) or off.
    SetLazyFlush,
    /// Read-ahead on with small thresholds, or off (see [`prefetch`]).
    SetPrefetch,
    /// Offload on with threshold 0 and some share, or off (see [`offload`]).
    SetOffload,
    /// Run the queued read-ahead (the worker thread is stopped, so it runs only here).
    RunPrefetch,
    /// A read starting where the core's previous read ended: sequential streams for read-ahead.
    ReadNext,
}

/// One generated operation. `shape`, `a` and `b` are resolved to an offset and a length once the
/// core size is known (see [`resolve`]).
#[derive(Clone)]
struct RawOp {
    kind: Kind,
    core: u8,
    shape: u8,
    a: u32,
    b: u32,
}

/// One line per op, so a shrunk scenario prints compactly.
impl std::fmt::Debug for RawOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?}@{}/{}/{}/{}",
            self.kind, self.core, self.shape, self.a, self.b
        )
    }
}

#[derive(Debug, Clone)]
struct Scenario {
    line_kib: u32,
    mode: CacheMode,
    cache_lines: u64,
    /// Per core: whole lines, plus extra sectors so the last core line is usually partial.
    cores: Vec<(u64, u64)>,
    ops: Vec<RawOp>,
}

fn mode() -> impl Strategy<Value = CacheMode> {
    prop::sample::select(CacheMode::ALL.to_vec())
}

fn kind() -> impl Strategy<Value = Kind> {
    prop_oneof![
        30 => Just(Kind::Read),
        30 => Just(Kind::Write),
        6 => Just(Kind::Discard),
        5 => Just(Kind::WriteZeroes),
        3 => Just(Kind::CoreFlush),
        2 => Just(Kind::CacheFlush),
        2 => Just(Kind::FlushCore),
        4 => (mode(), any::<bool>()).prop_map(|(m, f)| Kind::SetMode(m, f)),
        2 => Just(Kind::SetCleaning),
        6 => Just(Kind::Tick),
        2 => Just(Kind::SetSeqCutoff),
        2 => Just(Kind::SetPromotion),
        2 => Just(Kind::SetLazyFlush),
        2 => Just(Kind::SetPrefetch),
        2 => Just(Kind::SetOffload),
        5 => Just(Kind::RunPrefetch),
        12 => Just(Kind::ReadNext),
    ]
}

fn raw_op() -> impl Strategy<Value = RawOp> {
    (kind(), 0u8..3, 0u8..100, any::<u32>(), any::<u32>()).prop_map(|(kind, core, shape, a, b)| {
        RawOp {
            kind,
            core,
            shape,
            a,
            b,
        }
    })
}

fn scenario(cache_lines: impl Strategy<Value = u64>) -> impl Strategy<Value = Scenario> {
    (
        prop::sample::select(LineSize::ALL_KIB.to_vec()),
        mode(),
        cache_lines,
        prop::collection::vec(
            (8u64..96, prop_oneof![Just(0u64), Just(7u64), 1u64..127]),
            1..=3,
        ),
        prop::collection::vec(raw_op(), 1..300),
    )
        .prop_map(|(line_kib, mode, cache_lines, cores, ops)| Scenario {
            line_kib,
            mode,
            cache_lines,
            cores,
            ops,
        })
}

/// Turn a shape into (first sector, sector count) inside a core of `n` sectors with lines of
/// `ls` sectors. Most requests hit a small hot region so lines are reused and evicted; some sit
/// at the partial last line; some are large (up to 1 MiB), a few are several MiB.
fn resolve(op: &RawOp, n: u64, ls: u64) -> (u64, u64) {
    let (a, b) = (op.a as u64, op.b as u64);
    let (start, len) = if op.shape < 55 {
        let hot = n.min(16 * ls);
        (a % hot, 1 + b % (2 * ls))
    } else if op.shape < 70 {
        let tail = n.min(3 * ls);
        (n - 1 - a % tail, 1 + b % (2 * ls))
    } else if op.shape < 95 {
        (a % n, 1 + b % 2048)
    } else {
        let len = (2048 + b % 6144).min(n);
        (a % (n - len + 1), len)
    };
    (start, len.min(n - start))
}

fn describe(kind: Kind, core: usize, start: u64, len: u64) -> String {
    match kind {
        Kind::Read | Kind::ReadNext | Kind::Write | Kind::Discard | Kind::WriteZeroes => format!(
            "{kind:?} core#{core} sectors {start}..{} (offset {}, len {})",
            start + len,
            start * SECTOR,
            len * SECTOR
        ),
        Kind::CoreFlush | Kind::FlushCore => format!("{kind:?} core#{core}"),
        _ => format!("{kind:?}"),
    }
}

/// A cleaning configuration from two random words: any policy, eager alru (stale after a
/// second) with or without an activity wait and a dirty-ratio trigger, acp with short wake-ups,
/// flush-max-buffers from 1 up, merge-max from 4 KiB up. No bandwidth cap (it only costs time).
fn cleaning_config(a: u32, b: u32) -> CleaningConfig {
    let mut c = CleaningConfig {
        policy: CleaningPolicy::ALL[a as usize % 3],
        ..CleaningConfig::default()
    };
    c.alru.wake_up_s = [0, 0, 1][(a >> 4) as usize % 3];
    c.alru.staleness_time_s = 1;
    c.alru.activity_threshold_ms = [0, 0, 500][(a >> 8) as usize % 3];
    c.alru.flush_max_buffers = [1, 3, 100, 10_000][b as usize % 4];
    c.alru.dirty_ratio_threshold = [100, 100, 0, 30, 60][(b >> 4) as usize % 5];
    c.alru.dirty_ratio_inertia_mib = [0, 1][(b >> 8) as usize % 2];
    c.acp.wake_up_ms = [0, 1, 10][(a >> 12) as usize % 3];
    c.acp.flush_max_buffers = [1, 4, 128][(b >> 12) as usize % 3];
    c.io.merge_max_kib = [4, 8, 64, 1024][(b >> 16) as usize % 4];
    c
}

/// Sequential cutoff with thresholds small enough to trigger on these cores.
fn seq_cutoff(a: u32, b: u32) -> SeqCutoff {
    SeqCutoff {
        policy: SeqCutoffPolicy::ALL[a as usize % 3],
        threshold_kib: 1 + b % 64,
        promotion_count: 1 + (b >> 8) % 4,
        // Off in half the runs; on, a stream may be promoted by its bytes before its count.
        promotion_threshold_kib: [0, 0, 8, 64][(b >> 12) as usize % 4],
    }
}

/// Promotion always, or nhit with a low threshold and trigger.
fn promotion(a: u32, b: u32) -> Promotion {
    Promotion {
        policy: if a % 3 == 0 {
            PromotionPolicy::Always
        } else {
            PromotionPolicy::Nhit
        },
        threshold: 2 + b % 3,
        trigger_pct: (b >> 4) % 60,
    }
}

/// Read-ahead with thresholds and distances small enough to trigger on these cores, or none.
fn prefetch(a: u32, b: u32) -> Prefetch {
    Prefetch {
        policy: if a % 3 == 0 {
            PrefetchPolicy::None
        } else {
            PrefetchPolicy::Readahead
        },
        threshold_kib: 1 + b % 16,
        distance_kib: 4 + (b >> 8) % 61,
        max_in_flight: 1 + (b >> 16) % 3,
    }
}

/// Offload off (a % 3 == 0), or on with threshold 0 (a single thread never builds a queue, so
/// any higher threshold would never offload) and a share of 1..100%.
fn offload(a: u32, b: u32) -> Offload {
    Offload {
        enabled: a % 3 != 0,
        share_pct: 1 + b % 100,
        threshold: 0,
    }
}

/// The log of resolved operations, for failure messages.
struct Log(Vec<String>);

impl Log {
    fn fail(&self, scenario: &Scenario, msg: String) -> TestCaseError {
        let from = self.0.len().saturating_sub(40);
        let mut text = format!(
            "{msg}\nscenario: line {} KiB, initial mode {}, {} cache lines, cores (lines, extra sectors) {:?}\nlast operations:\n",
            scenario.line_kib, scenario.mode, scenario.cache_lines, scenario.cores
        );
        for (i, line) in self.0.iter().enumerate().skip(from) {
            text.push_str(&format!("  #{i}: {line}\n"));
        }
        TestCaseError::fail(text)
    }
}

fn check_usage(cache: &Cache) -> Result<(), String> {
    let u = cache.stats().usage;
    if u.occupancy_lines + u.free_lines != u.total_lines || u.dirty_lines > u.occupancy_lines {
        return Err(format!("inconsistent usage statistics: {u:?}"));
    }
    Ok(())
}

fn run(s: &Scenario) -> Result<(), TestCaseError> {
    let _watchdog = Watchdog::new("model scenario", Duration::from_secs(120));
    let (cache, _cache_vol) = new_cache(s.line_kib, s.cache_lines, s.mode);
    // The cleaner runs only when an op ticks it, on the ops' fake clock.
    cache.stop_background_cleaner();
    // Read-ahead too runs only when an op says so.
    cache.stop_background_prefetch();
    let mut now_ms = 0u64;
    let ls = (s.line_kib as u64 * 1024) / SECTOR;
    let cores: Vec<TestCore> = s
        .cores
        .iter()
        .map(|&(lines, extra)| add_core(&cache, (lines * ls + extra) * SECTOR))
        .collect();
    let mut model: Vec<Vec<u8>> = cores
        .iter()
        .map(|c| vec![0u8; c.core.size() as usize])
        .collect();
    let mut log = Log(Vec::new());
    // Where each core's last read ended, in sectors (for ReadNext).
    let mut read_end = vec![0u64; cores.len()];

    macro_rules! check {
        ($res:expr, $what:expr) => {
            if let Err(e) = $res {
                return Err(log.fail(s, format!("{} failed: {e}", $what)));
            }
        };
    }

    for (i, op) in s.ops.iter().enumerate() {
        let ci = op.core as usize % cores.len();
        let c = &cores[ci];
        let n = c.core.size() / SECTOR;
        let (start, len) = match op.kind {
            Kind::ReadNext => {
                let len = (1 + op.b as u64 % (2 * ls)).min(n);
                let start = if read_end[ci] + len <= n {
                    read_end[ci]
                } else {
                    0
                };
                (start, len)
            }
            _ => resolve(op, n, ls),
        };
        if matches!(op.kind, Kind::Read | Kind::ReadNext) {
            read_end[ci] = start + len;
        }
        let (off, bytes) = (start * SECTOR, len * SECTOR);
        let range = off as usize..(off + bytes) as usize;
        log.0.push(match op.kind {
            Kind::SetCleaning => format!("SetCleaning {:?}", cleaning_config(op.a, op.b)),
            Kind::Tick => format!("Tick at {} ms", now_ms + (op.a % 2500) as u64),
            Kind::SetSeqCutoff => format!(
                "SetSeqCutoff {} {:?}",
                if op.shape % 2 == 0 {
                    "all cores".to_string()
                } else {
                    format!("core#{ci}")
                },
                seq_cutoff(op.a, op.b)
            ),
            Kind::SetPromotion => format!("SetPromotion {:?}", promotion(op.a, op.b)),
            Kind::SetLazyFlush => format!("SetLazyFlush {}", op.a % 2 == 1),
            Kind::SetPrefetch => format!("SetPrefetch {:?}", prefetch(op.a, op.b)),
            Kind::SetOffload => format!("SetOffload {:?}", offload(op.a, op.b)),
            _ => describe(op.kind, ci, start, len),
        });
        let what = format!("op #{i}");
        match op.kind {
            Kind::Read | Kind::ReadNext => {
                // Pre-fill with junk so a read that leaves bytes untouched is caught.
                let mut buf = vec![0xEEu8; bytes as usize];
                check!(c.core.read(&mut buf, off), what);
                if let Some(diff) = first_difference(&model[ci][range], &buf, start) {
                    return Err(log.fail(s, format!("op #{i}: read returned wrong data: {diff}")));
                }
            }
            Kind::Write => {
                let tag = ((ci as u64) << 32) | i as u64;
                let data = stamped(bytes, tag, start);
                check!(c.core.write(&data, off), what);
                model[ci][range].copy_from_slice(&data);
            }
            Kind::Discard => {
                check!(c.core.discard(off, bytes), what);
                model[ci][range].fill(0);
            }
            Kind::WriteZeroes => {
                check!(c.core.write_zeroes(off, bytes), what);
                model[ci][range].fill(0);
            }
            Kind::CoreFlush => check!(c.core.flush(), what),
            Kind::CacheFlush => {
                check!(cache.flush(), what);
                let dirty = cache.stats().usage.dirty_lines;
                if dirty != 0 {
                    return Err(log.fail(
                        s,
                        format!("op #{i}: {dirty} dirty lines after a cache flush"),
                    ));
                }
                // A flush makes every core device hold the model.
                for (j, cj) in cores.iter().enumerate() {
                    let direct = read_all(&cj.vol);
                    if let Some(diff) = first_difference(&model[j], &direct, 0) {
                        return Err(log.fail(
                            s,
                            format!("op #{i}: after cache flush core#{j} device differs: {diff}"),
                        ));
                    }
                }
            }
            Kind::FlushCore => {
                check!(cache.flush_core(c.id), what);
                let dirty = cache.core_stats(c.id).map(|st| st.usage.dirty_lines);
                if !matches!(dirty, Ok(0)) {
                    return Err(log.fail(
                        s,
                        format!("op #{i}: core dirty lines after flush_core: {dirty:?}"),
                    ));
                }
                let direct = read_all(&c.vol);
                if let Some(diff) = first_difference(&model[ci], &direct, 0) {
                    return Err(log.fail(
                        s,
                        format!("op #{i}: after flush_core core#{ci} device differs: {diff}"),
                    ));
                }
            }
            Kind::SetMode(mode, flush_first) => {
                check!(cache.set_mode(mode, flush_first), what);
                if cache.mode() != mode {
                    return Err(log.fail(
                        s,
                        format!("op #{i}: mode is {} after set_mode({mode})", cache.mode()),
                    ));
                }
                let dirty = cache.stats().usage.dirty_lines;
                if flush_first && !mode.makes_dirty() && dirty != 0 {
                    return Err(log.fail(
                        s,
                        format!("op #{i}: {dirty} dirty lines after set_mode({mode}, flush_first)"),
                    ));
                }
            }
            Kind::SetCleaning => {
                let c = cleaning_config(op.a, op.b);
                check!(cache.set_cleaning(c), what);
                if cache.cleaning() != c {
                    return Err(log.fail(s, format!("op #{i}: cleaning config not applied")));
                }
            }
            Kind::Tick => {
                now_ms += (op.a % 2500) as u64;
                cache.cleaner_tick(now_ms);
            }
            Kind::SetSeqCutoff => {
                let target = (op.shape % 2 == 1).then_some(c.id);
                check!(cache.set_seq_cutoff(target, seq_cutoff(op.a, op.b)), what);
            }
            Kind::SetPromotion => check!(cache.set_promotion(promotion(op.a, op.b)), what),
            Kind::SetLazyFlush => check!(
                cache.set_lazy_flush(LazyFlush {
                    enabled: op.a % 2 == 1
                }),
                what
            ),
            Kind::SetPrefetch => check!(cache.set_prefetch(prefetch(op.a, op.b)), what),
            Kind::SetOffload => check!(cache.set_offload(offload(op.a, op.b)), what),
            Kind::RunPrefetch => {
                cache.run_prefetch();
            }
        }
        if let Err(e) = check_usage(&cache) {
            return Err(log.fail(s, format!("after op #{i}: {e}")));
        }
        if i % 64 == 63 {
            cache.check_invariants();
        }
    }

    // Every exported volume reads as the model, before and after a final flush; after the flush
    // the core devices themselves hold it.
    for (j, c) in cores.iter().enumerate() {
        if let Some(diff) = first_difference(&model[j], &read_core_all(&c.core), 0) {
            return Err(log.fail(s, format!("final read of core#{j} differs: {diff}")));
        }
    }
    cache.check_invariants();
    check!(cache.flush(), "final flush");
    let dirty = cache.stats().usage.dirty_lines;
    if dirty != 0 {
        return Err(log.fail(s, format!("{dirty} dirty lines after the final flush")));
    }
    for (j, c) in cores.iter().enumerate() {
        let direct = read_all(&c.vol);
        if let Some(diff) = first_difference(&model[j], &direct, 0) {
            return Err(log.fail(
                s,
                format!("after the final flush core#{j} device differs: {diff}"),
            ));
        }
        if let Some(diff) = first_difference(&model[j], &read_core_all(&c.core), 0) {
            return Err(log.fail(
                s,
                format!("after the final flush core#{j} reads differ: {diff}"),
            ));
        }
    }
    cache.check_invariants();
    Ok(())
}

/// Cases per test: `PROPTEST_CASES` overrides the default, which keeps the file under a minute.
fn config(default_cases: u32) -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default_cases);
    ProptestConfig {
        cases,
        max_shrink_iters: 2000,
        // The failure message prints the minimal scenario; no regression files in the tree.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// A handful of lines: nearly every request evicts, and in wb/wo writes wait for cleaning.
    #[test]
    fn model_tiny_cache(s in scenario(4u64..=16)) {
        run(&s)?;
    }
}

proptest! {
    #![proptest_config(config(256))]

    /// Somewhat smaller than the hot region plus the large requests: a mix of hits and eviction.
    #[test]
    fn model_medium_cache(s in scenario(17u64..=64)) {
        run(&s)?;
    }
}

proptest! {
    #![proptest_config(config(96))]

    /// Larger than all cores together: nothing is evicted, lines fill sector by sector.
    #[test]
    fn model_large_cache(s in scenario(300u64..=400)) {
        run(&s)?;
    }
}

/// Fixed scenarios that are worth running every time whatever proptest draws: every mode with
/// a request many times larger than a tiny cache, mode switches in between.
#[test]
fn model_fixed_large_requests_on_tiny_cache() {
    for line_kib in [4, 64] {
        for mode in CacheMode::ALL {
            let ops = (0..40u32)
                .map(|i| RawOp {
                    kind: match i % 8 {
                        0 | 3 | 5 => Kind::Write,
                        1 | 4 | 6 => Kind::Read,
                        2 => Kind::Discard,
                        _ => Kind::SetMode(CacheMode::ALL[(i as usize / 8) % 6], i % 16 == 7),
                    },
                    core: (i % 2) as u8,
                    shape: if i % 3 == 0 { 99 } else { 50 + (i % 50) as u8 },
                    a: i.wrapping_mul(2_654_435_761),
                    b: i.wrapping_mul(40_503),
                })
                .collect();
            let s = Scenario {
                line_kib,
                mode,
                cache_lines: 4,
                cores: vec![(80, 7), (33, 0)],
                ops,
            };
            if let Err(e) = run(&s) {
                panic!("{e}");
            }
        }
    }
}

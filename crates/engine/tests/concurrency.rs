//! Concurrency: several threads issue requests against one cache while another switches modes,
//! flushes, and switches lazy flush, offload (by real queue depths, or threshold 0) and read-ahead
//! (whose worker thread then fills lines next to the requests).
//!
//! Every write stamps each sector with (thread, sequence number, sector), so any sector read can
//! be traced to the write that produced it (see `common::stamp`).
//!
//! - Disjoint ranges: each thread owns a range (range boundaries fall inside cache lines, so
//!   neighbours share lines). A thread is then the only writer of its sectors, so every read must
//!   equal the thread's own model exactly, and so must the core after the final flush.
//! - Overlapping ranges: all threads hammer one small region. Results must be explainable by SOME
//!   serial order of whole requests: every sector holds zeroes or a stamp of a write of that very
//!   sector; a thread never sees its own older data once it has overwritten it; and, for the
//!   final state and for every read, the "W' came before W" relations implied by what is visible
//!   (W visible on a sector W' also wrote), together with each thread's program order, have no
//!   cycle. A cycle means two requests were interleaved within their overlap.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use common::*;
use hybridcache_engine::{Cache, CacheMode, Core, LazyFlush, Offload, Prefetch, PrefetchPolicy};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const THREADS: usize = 6;
/// Seeds per configuration; each seed is a fresh cache and a fresh plan.
const ROUNDS: u64 = 4;

/// The seeds to run: `HC_TEST_SEED` replays exactly one, otherwise `ROUNDS` from `base`
/// (`HC_TEST_ROUNDS` overrides the count for longer hunts).
fn seeds(base: u64) -> Vec<u64> {
    if std::env::var("HC_TEST_SEED").is_ok() {
        return vec![seed(base)];
    }
    let rounds = std::env::var("HC_TEST_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(ROUNDS);
    (0..rounds).map(|r| base + r * 7_777).collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Read,
    Write,
    Discard,
    WriteZeroes,
    Flush,
}

#[derive(Debug, Clone, Copy)]
struct Planned {
    kind: Kind,
    start: u64,
    len: u64,
}

fn tag_of(thread: usize, seq: usize) -> u64 {
    ((thread as u64 + 1) << 32) | seq as u64
}

fn split_tag(tag: u64) -> (usize, usize) {
    (
        ((tag >> 32) as usize).wrapping_sub(1),
        (tag & 0xffff_ffff) as usize,
    )
}

/// A random plan for one thread inside sectors `lo..hi`: mostly reads and writes of up to two
/// lines, sometimes a request spanning most of the range (many line locks at once).
fn plan(rng: &mut StdRng, lo: u64, hi: u64, ls: u64, ops: usize) -> Vec<Planned> {
    let mut read_end = lo;
    (0..ops)
        .map(|_| {
            let kind = match rng.gen_range(0..100) {
                0..=39 => Kind::Read,
                40..=79 => Kind::Write,
                80..=87 => Kind::Discard,
                88..=93 => Kind::WriteZeroes,
                _ => Kind::Flush,
            };
            let mut start = rng.gen_range(lo..hi);
            // Some reads continue the previous one: streams for read-ahead.
            if matches!(kind, Kind::Read) && read_end < hi && rng.gen_bool(0.4) {
                start = read_end;
            }
            let max = if rng.gen_bool(0.2) { hi - lo } else { 2 * ls };
            let len = rng.gen_range(1..=max).min(hi - start);
            if matches!(kind, Kind::Read) {
                read_end = start + len;
            }
            Planned { kind, start, len }
        })
        .collect()
}

/// The thread that switches modes and flushes while the workers run, until `done`.
fn switcher(cache: &Cache, seed: u64, done: &AtomicBool) -> Result<usize, String> {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x5157);
    let mut n = 0;
    while !done.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_micros(rng.gen_range(20..500)));
        let r = match rng.gen_range(0..15) {
            0..=6 => {
                let mode = CacheMode::ALL[rng.gen_range(0..6)];
                cache.set_mode(mode, rng.gen_bool(0.5))
            }
            7 | 8 => cache.flush(),
            // Lazy flush and read-ahead (its worker thread running) switched under load.
            10 => cache.set_lazy_flush(LazyFlush {
                enabled: rng.gen_bool(0.5),
            }),
            11 | 12 => cache.set_prefetch(Prefetch {
                policy: if rng.gen_bool(0.7) {
                    PrefetchPolicy::Readahead
                } else {
                    PrefetchPolicy::None
                },
                threshold_kib: rng.gen_range(1..16),
                distance_kib: rng.gen_range(4..128),
                max_in_flight: rng.gen_range(1..4),
            }),
            13 | 14 => cache.set_offload(Offload {
                enabled: rng.gen_bool(0.7),
                share_pct: rng.gen_range(0..=100),
                threshold: rng.gen_range(0..3),
            }),
            _ => {
                let ids: Vec<_> = cache.cores().iter().map(|c| c.id).collect();
                cache.flush_core(ids[rng.gen_range(0..ids.len())])
            }
        };
        r.map_err(|e| format!("switcher action #{n} failed: {e}"))?;
        n += 1;
    }
    Ok(n)
}

/// Run `workers` (one closure per thread) next to the switcher; collect every failure.
fn run_threads<F>(cache: &Cache, seed: u64, workers: Vec<F>) -> Vec<String>
where
    F: FnOnce() -> Result<(), String> + Send,
{
    let done = AtomicBool::new(false);
    std::thread::scope(|scope| {
        let sw = scope.spawn(|| switcher(cache, seed, &done));
        let handles: Vec<_> = workers.into_iter().map(|w| scope.spawn(w)).collect();
        let mut errors: Vec<String> = handles
            .into_iter()
            .enumerate()
            .filter_map(|(t, h)| match h.join() {
                Ok(Ok(())) => None,
                Ok(Err(e)) => Some(format!("thread {t}: {e}")),
                Err(_) => Some(format!("thread {t} panicked")),
            })
            .collect();
        done.store(true, Ordering::Release);
        match sw.join() {
            Ok(Ok(n)) => eprintln!("switcher performed {n} mode switches/flushes"),
            Ok(Err(e)) => errors.push(e),
            Err(_) => errors.push("switcher panicked".into()),
        }
        errors
    })
}

fn fail_if(errors: Vec<String>, what: &str, seed: u64) {
    if !errors.is_empty() {
        panic!(
            "{what} (seed {seed}; replay with HC_TEST_SEED={seed}):\n{}",
            errors.join("\n")
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Disjoint ranges

fn disjoint_ranges(line_kib: u32, cache_lines: u64, ops: usize) {
    for seed in seeds(0xD15_0000 + line_kib as u64 * 1000 + cache_lines) {
        disjoint_ranges_once(line_kib, cache_lines, ops, seed);
    }
}

fn disjoint_ranges_once(line_kib: u32, cache_lines: u64, ops: usize, seed: u64) {
    eprintln!("disjoint ranges: line {line_kib} KiB, {cache_lines} lines, seed {seed}");
    let _watchdog = Watchdog::new("disjoint_ranges", Duration::from_secs(120));
    let t0 = Instant::now();
    let (cache, _cache_vol) = new_cache(line_kib, cache_lines, CacheMode::Wb);
    let ls = line_kib as u64 * 1024 / SECTOR;
    // Not a multiple of the line: neighbouring threads share a line at each boundary.
    let region = 5 * ls + 3;
    let c = add_core(&cache, (THREADS as u64 * region + ls / 2 + 1) * SECTOR);
    let models: Vec<std::sync::Mutex<Vec<u8>>> = (0..THREADS)
        .map(|_| std::sync::Mutex::new(vec![0u8; (region * SECTOR) as usize]))
        .collect();

    let workers: Vec<_> = (0..THREADS)
        .map(|t| {
            let core = c.core.clone();
            let model = &models[t];
            move || -> Result<(), String> {
                let mut rng = StdRng::seed_from_u64(seed ^ (t as u64 * 7919));
                let lo = t as u64 * region;
                let mut model = model.lock().unwrap();
                for (i, op) in plan(&mut rng, lo, lo + region, ls, ops)
                    .into_iter()
                    .enumerate()
                {
                    let off = op.start * SECTOR;
                    let bytes = op.len * SECTOR;
                    let m = ((op.start - lo) * SECTOR) as usize
                        ..((op.start - lo + op.len) * SECTOR) as usize;
                    let ctx = |e: &dyn std::fmt::Display| {
                        format!(
                            "op #{i} {:?} sectors {}..{}: {e}",
                            op.kind,
                            op.start,
                            op.start + op.len
                        )
                    };
                    match op.kind {
                        Kind::Read => {
                            let mut buf = vec![0xEEu8; bytes as usize];
                            core.read(&mut buf, off).map_err(|e| ctx(&e))?;
                            if let Some(d) = first_difference(&model[m], &buf, op.start) {
                                return Err(ctx(&format!(
                                    "read differs from this thread's own writes: {d}"
                                )));
                            }
                        }
                        Kind::Write => {
                            let data = stamped(bytes, tag_of(t, i), op.start);
                            core.write(&data, off).map_err(|e| ctx(&e))?;
                            model[m].copy_from_slice(&data);
                        }
                        Kind::Discard => {
                            core.discard(off, bytes).map_err(|e| ctx(&e))?;
                            model[m].fill(0);
                        }
                        Kind::WriteZeroes => {
                            core.write_zeroes(off, bytes).map_err(|e| ctx(&e))?;
                            model[m].fill(0);
                        }
                        Kind::Flush => core.flush().map_err(|e| ctx(&e))?,
                    }
                }
                Ok(())
            }
        })
        .collect();
    fail_if(
        run_threads(&cache, seed, workers),
        "disjoint ranges failed",
        seed,
    );

    // Final state: the exported volume and, after a flush, the core device hold every thread's
    // model exactly; the sectors past the last range were never written.
    let mut want: Vec<u8> = models
        .iter()
        .flat_map(|m| m.lock().unwrap().clone())
        .collect();
    want.resize(c.core.size() as usize, 0);
    if let Some(d) = first_difference(&want, &read_core_all(&c.core), 0) {
        panic!("seed {seed}: exported volume differs from the threads' writes: {d}");
    }
    cache.check_invariants();
    cache.flush().expect("final flush");
    assert_eq!(
        cache.stats().usage.dirty_lines,
        0,
        "seed {seed}: dirty lines after flush"
    );
    if let Some(d) = first_difference(&want, &read_all(&c.vol), 0) {
        panic!("seed {seed}: core device differs from the threads' writes after flush: {d}");
    }
    cache.check_invariants();
    eprintln!("disjoint ranges done in {:?}", t0.elapsed());
}

#[test]
fn disjoint_ranges_4k_tiny_cache() {
    disjoint_ranges(4, 8, 4000);
}

#[test]
fn disjoint_ranges_4k_medium_cache() {
    disjoint_ranges(4, 256, 4000);
}

#[test]
fn disjoint_ranges_64k_tiny_cache() {
    disjoint_ranges(64, 6, 1000);
}

#[test]
fn disjoint_ranges_64k_medium_cache() {
    disjoint_ranges(64, 48, 1000);
}

// ---------------------------------------------------------------------------------------------
// Overlapping ranges

/// All writes of all threads, known before the run (plans are generated up front).
struct Catalog {
    /// tag -> (first sector, sector count)
    writes: HashMap<u64, (u64, u64)>,
    /// Per sector: the tags of the writes that cover it.
    covering: Vec<Vec<u64>>,
    /// Per sector: whether any discard or write_zeroes covers it (zeroes are then legitimate).
    zeroed: Vec<bool>,
}

impl Catalog {
    fn new(plans: &[Vec<Planned>], sectors: u64) -> Catalog {
        let mut cat = Catalog {
            writes: HashMap::new(),
            covering: vec![Vec::new(); sectors as usize],
            zeroed: vec![false; sectors as usize],
        };
        for (t, p) in plans.iter().enumerate() {
            for (i, op) in p.iter().enumerate() {
                let r = op.start as usize..(op.start + op.len) as usize;
                match op.kind {
                    Kind::Write => {
                        cat.writes.insert(tag_of(t, i), (op.start, op.len));
                        for s in r {
                            cat.covering[s].push(tag_of(t, i));
                        }
                    }
                    Kind::Discard | Kind::WriteZeroes => cat.zeroed[r].fill(true),
                    _ => {}
                }
            }
        }
        cat
    }

    fn covers(&self, tag: u64, sector: u64) -> bool {
        self.writes
            .get(&tag)
            .is_some_and(|&(s, n)| s <= sector && sector < s + n)
    }

    fn describe(&self, tag: u64) -> String {
        let (t, i) = split_tag(tag);
        match self.writes.get(&tag) {
            Some(&(s, n)) => format!("write thread {t} op #{i} sectors {s}..{}", s + n),
            None => format!("unknown tag {tag:#x}"),
        }
    }
}

/// Check that "before" edges over `nodes` have no cycle; the edges are: `a` before `b` when `b`
/// is visible on a sector `a` also covers, and program order within a thread. `visible` maps a
/// sector to the write visible on it. Returns a description of one cycle if there is one.
fn find_cycle(cat: &Catalog, nodes: &[u64], visible: &[(u64, u64)]) -> Option<String> {
    let index: HashMap<u64, usize> = nodes.iter().enumerate().map(|(i, &t)| (t, i)).collect();
    let mut edges: Vec<HashSet<usize>> = vec![HashSet::new(); nodes.len()];
    // Why an edge exists, for the message: the sector that implied it.
    let mut why: HashMap<(usize, usize), u64> = HashMap::new();
    // With few nodes (a read) test each node against the sector; with all writes as nodes (the
    // final state) walk the sector's list of covering writes instead.
    let few = nodes.len() < 64;
    for &(sector, w) in visible {
        let b = index[&w];
        let mut edge = |other: u64| {
            if other != w {
                if let Some(&a) = index.get(&other) {
                    edges[a].insert(b);
                    why.entry((a, b)).or_insert(sector);
                }
            }
        };
        if few {
            nodes
                .iter()
                .filter(|&&o| cat.covers(o, sector))
                .for_each(|&o| edge(o));
        } else {
            cat.covering[sector as usize].iter().for_each(|&o| edge(o));
        }
    }
    // Program order: each thread's writes, in sequence order, form a chain.
    let mut by_thread: HashMap<usize, Vec<(usize, usize)>> = HashMap::new();
    for (i, &tag) in nodes.iter().enumerate() {
        let (t, seq) = split_tag(tag);
        by_thread.entry(t).or_default().push((seq, i));
    }
    for chain in by_thread.values_mut() {
        chain.sort_unstable();
        for w in chain.windows(2) {
            edges[w[0].1].insert(w[1].1);
        }
    }
    let edges: Vec<Vec<usize>> = edges.into_iter().map(|s| s.into_iter().collect()).collect();

    // Iterative DFS; 0 = unvisited, 1 = on the stack, 2 = done.
    let mut color = vec![0u8; nodes.len()];
    for root in 0..nodes.len() {
        if color[root] != 0 {
            continue;
        }
        let mut stack: Vec<(usize, usize)> = vec![(root, 0)];
        color[root] = 1;
        while let Some(&mut (node, ref mut next)) = stack.last_mut() {
            if *next < edges[node].len() {
                let to = edges[node][*next];
                *next += 1;
                match color[to] {
                    0 => {
                        color[to] = 1;
                        stack.push((to, 0));
                    }
                    1 => {
                        let pos = stack.iter().position(|&(n, _)| n == to).unwrap();
                        let cycle: Vec<usize> = stack[pos..].iter().map(|&(n, _)| n).collect();
                        let mut text = String::from("no serial order explains the data; cycle:\n");
                        for (k, &a) in cycle.iter().enumerate() {
                            let b = cycle[(k + 1) % cycle.len()];
                            let reason = match why.get(&(a, b)) {
                                Some(s) => format!("the latter is visible on sector {s}, which the former also wrote"),
                                None => "program order".to_string(),
                            };
                            text.push_str(&format!(
                                "  {} before {} ({reason})\n",
                                cat.describe(nodes[a]),
                                cat.describe(nodes[b])
                            ));
                        }
                        return Some(text);
                    }
                    _ => {}
                }
            } else {
                color[node] = 2;
                stack.pop();
            }
        }
    }
    None
}

/// A thread's latest op on a sector: (sequence number, whether it was a write).
type OwnLast = Option<(usize, bool)>;

/// Who reads: (thread, sequence number of the read, what the thread last did to the sector).
type Reader = Option<(usize, usize, OwnLast)>;

/// Check one sector's content against the catalog; `own_last` is this thread's latest op on
/// the sector before now (seq, was a write), for reads; None for the final state.
fn check_sector(
    cat: &Catalog,
    sector: u64,
    content: Content,
    reader: Reader,
) -> Result<Option<u64>, String> {
    match content {
        Content::Garbage(_) => Err(format!("sector {sector} holds {content}")),
        Content::Stamp { tag, sector: s } => {
            if s != sector {
                return Err(format!(
                    "sector {sector} holds data of sector {s}: {content}"
                ));
            }
            if !cat.covers(tag, sector) {
                return Err(format!(
                    "sector {sector} holds {content}, which no write of this sector produced"
                ));
            }
            if let Some((t, seq, own_last)) = reader {
                let (wt, wseq) = split_tag(tag);
                if wt == t && wseq >= seq {
                    return Err(format!(
                        "sector {sector}: read #{seq} sees this thread's future write #{wseq}"
                    ));
                }
                if let Some((last, _)) = own_last {
                    if wt == t && wseq < last {
                        return Err(format!(
                            "sector {sector}: stale data, sees this thread's write #{wseq} after its own op #{last} replaced it"
                        ));
                    }
                }
            }
            Ok(Some(tag))
        }
        Content::Zero => {
            let own_wrote = matches!(reader, Some((_, _, Some((_, true)))));
            let ever_written = !cat.covering[sector as usize].is_empty();
            if !cat.zeroed[sector as usize] && (own_wrote || (reader.is_none() && ever_written)) {
                return Err(format!(
                    "sector {sector} reads zeroes but was written and nothing discards or zeroes it"
                ));
            }
            Ok(None)
        }
    }
}

fn check_buffer(
    cat: &Catalog,
    buf: &[u8],
    start: u64,
    reader: Option<(usize, usize, &[OwnLast])>,
) -> Result<(), String> {
    let mut visible = Vec::new();
    let mut nodes = HashSet::new();
    for (k, s) in buf.chunks_exact(SECTOR as usize).enumerate() {
        let sector = start + k as u64;
        let r = reader.map(|(t, seq, last)| (t, seq, last[sector as usize]));
        if let Some(tag) = check_sector(cat, sector, decode(s), r)? {
            visible.push((sector, tag));
            nodes.insert(tag);
        }
    }
    // A read is ordered only after the writes it shows; the final state comes after all writes.
    let mut nodes: Vec<u64> = if reader.is_some() {
        nodes.into_iter().collect()
    } else {
        cat.writes.keys().copied().collect()
    };
    nodes.sort_unstable();
    match find_cycle(cat, &nodes, &visible) {
        Some(c) => Err(c),
        None => Ok(()),
    }
}

fn overlapping_ranges(line_kib: u32, cache_lines: u64, ops: usize) {
    for seed in seeds(0x0E7_0000 + line_kib as u64 * 1000 + cache_lines) {
        overlapping_ranges_once(line_kib, cache_lines, ops, seed);
    }
}

fn overlapping_ranges_once(line_kib: u32, cache_lines: u64, ops: usize, seed: u64) {
    eprintln!("overlapping ranges: line {line_kib} KiB, {cache_lines} lines, seed {seed}");
    let _watchdog = Watchdog::new("overlapping_ranges", Duration::from_secs(120));
    let t0 = Instant::now();
    let (cache, _cache_vol) = new_cache(line_kib, cache_lines, CacheMode::Wb);
    let ls = line_kib as u64 * 1024 / SECTOR;
    // The whole core is the shared region; its last line is partial.
    let sectors = 6 * ls + 5;
    let c = add_core(&cache, sectors * SECTOR);
    let plans: Vec<Vec<Planned>> = (0..THREADS)
        .map(|t| {
            plan(
                &mut StdRng::seed_from_u64(seed ^ (t as u64 * 104_729)),
                0,
                sectors,
                ls,
                ops,
            )
        })
        .collect();
    let cat = Catalog::new(&plans, sectors);

    let workers: Vec<_> = plans
        .iter()
        .enumerate()
        .map(|(t, p)| {
            let core: Core = c.core.clone();
            let cat = &cat;
            move || -> Result<(), String> {
                let mut own_last: Vec<OwnLast> = vec![None; sectors as usize];
                for (i, op) in p.iter().enumerate() {
                    let off = op.start * SECTOR;
                    let bytes = op.len * SECTOR;
                    let ctx = |e: &dyn std::fmt::Display| {
                        format!(
                            "op #{i} {:?} sectors {}..{}: {e}",
                            op.kind,
                            op.start,
                            op.start + op.len
                        )
                    };
                    match op.kind {
                        Kind::Read => {
                            let mut buf = vec![0xEEu8; bytes as usize];
                            core.read(&mut buf, off).map_err(|e| ctx(&e))?;
                            check_buffer(cat, &buf, op.start, Some((t, i, &own_last)))
                                .map_err(|e| ctx(&e))?;
                        }
                        Kind::Write => {
                            core.write(&stamped(bytes, tag_of(t, i), op.start), off)
                                .map_err(|e| ctx(&e))?;
                        }
                        Kind::Discard => core.discard(off, bytes).map_err(|e| ctx(&e))?,
                        Kind::WriteZeroes => core.write_zeroes(off, bytes).map_err(|e| ctx(&e))?,
                        Kind::Flush => core.flush().map_err(|e| ctx(&e))?,
                    }
                    if matches!(op.kind, Kind::Write | Kind::Discard | Kind::WriteZeroes) {
                        let w = op.kind == Kind::Write;
                        own_last[op.start as usize..(op.start + op.len) as usize]
                            .fill(Some((i, w)));
                    }
                }
                Ok(())
            }
        })
        .collect();
    fail_if(
        run_threads(&cache, seed, workers),
        "overlapping ranges failed",
        seed,
    );

    // Final state: what the exported volume shows must be what the core holds after a flush, and
    // both must be explained by a serial order of all the writes.
    let exported = read_core_all(&c.core);
    cache.check_invariants();
    cache.flush().expect("final flush");
    assert_eq!(
        cache.stats().usage.dirty_lines,
        0,
        "seed {seed}: dirty lines after flush"
    );
    let direct = read_all(&c.vol);
    if let Some(d) = first_difference(&exported, &direct, 0) {
        panic!("seed {seed}: after flush the core device differs from what the exported volume showed: {d}");
    }
    if let Err(e) = check_buffer(&cat, &direct, 0, None) {
        panic!("seed {seed}: final state: {e}");
    }
    cache.check_invariants();
    eprintln!("overlapping ranges done in {:?}", t0.elapsed());
}

#[test]
fn overlapping_ranges_4k_tiny_cache() {
    overlapping_ranges(4, 4, 3000);
}

#[test]
fn overlapping_ranges_4k_medium_cache() {
    overlapping_ranges(4, 256, 3000);
}

#[test]
fn overlapping_ranges_64k_tiny_cache() {
    overlapping_ranges(64, 4, 800);
}

#[test]
fn overlapping_ranges_64k_medium_cache() {
    overlapping_ranges(64, 48, 800);
}

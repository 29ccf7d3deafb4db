//! The engine benchmark of docs/perf.md §1, as a library: `cargo bench -p hybridcache-engine`
//! and the CLI both call [`run`] and print the same [`EngineBenchReport`].
//!
//! Setup (perf.md): a RAM cache volume (4 GiB, pre-faulted), a 64 GiB null core, write-back, a
//! fresh cache per run, queue depth 1 per thread. Persistence on means `Cache::create` on the RAM
//! volume and a client flush every [`EngineBenchOptions::flush_every`] requests; off means
//! `Cache::new` (metadata in RAM only) with the same flushes, so the two differ by the cost of
//! persistence alone. Two threads split the same work over disjoint halves of the address range.
//! Repetitions run rep-major (every case once, then every case again...), so drift of a shared
//! machine hits all cases alike; figures are medians with min and max.
//!
//! Tests: `seqwrite` (sequential writes from 0 over 85% of the cache: all misses), `randwrite`
//! (85% of the cache's worth of writes, random without replacement from a region 4x the cache),
//! `randwrite_hit` (pre-fill 42.5% with 64 KiB writes, then twice as many random overwrites
//! inside it), `randread_hit` (same pre-fill, random reads inside it), `seqread_hit` (same
//! pre-fill, sequential reads through it twice), `flush` (fill 85% dirty with 64 KiB writes, then
//! time a full flush).

use std::sync::{Arc, Barrier};
use std::time::Instant;

use hybridcache_volume::{NullVolume, RamVolume, SplitMix64, VolumeRef};
use serde::Serialize;

use crate::{Cache, CacheConfig, CacheMode, Core, CoreId, EngineError, LineSize, Result};

/// The tests of perf.md §1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Test {
    Seqwrite,
    Randwrite,
    RandwriteHit,
    RandreadHit,
    SeqreadHit,
    Flush,
}

impl Test {
    pub const ALL: [Test; 6] = [
        Test::Seqwrite,
        Test::Randwrite,
        Test::RandwriteHit,
        Test::RandreadHit,
        Test::SeqreadHit,
        Test::Flush,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Test::Seqwrite => "seqwrite",
            Test::Randwrite => "randwrite",
            Test::RandwriteHit => "randwrite_hit",
            Test::RandreadHit => "randread_hit",
            Test::SeqreadHit => "seqread_hit",
            Test::Flush => "flush",
        }
    }

    pub fn from_name(s: &str) -> Option<Test> {
        Test::ALL.into_iter().find(|t| t.name() == s)
    }
}

/// What to run. [`Default`] is the full run of perf.md; [`EngineBenchOptions::quick`] is a
/// small one for CI.
#[derive(Debug, Clone, Serialize)]
pub struct EngineBenchOptions {
    /// Size of the RAM cache volume.
    pub cache_bytes: u64,
    /// Size of the null core.
    pub core_bytes: u64,
    pub reps: usize,
    /// Tests to run (empty: all).
    pub tests: Vec<Test>,
    /// Request sizes in KiB (flush ignores it: it always fills with 64 KiB writes).
    pub request_kib: Vec<u32>,
    pub line_kib: Vec<u32>,
    /// Persistence on (true) and/or off (false).
    pub persistence: Vec<bool>,
    pub threads: Vec<usize>,
    /// A client flush after every this many requests of each thread (0: never).
    pub flush_every: u64,
    /// Extra filter: a case runs only if its label contains every one of these strings.
    pub filter: Vec<String>,
    /// Every combination of the lists above (about 90 cases: half an hour at 4 GiB). When
    /// false, only the standard cases within them ([`Case::is_standard`]): a few minutes.
    pub all_combinations: bool,
    /// Lazy flush on or off for every case (None: the engine's default), to measure the
    /// cache-full write cases (randwrite 4k on 64k lines) with and without it.
    pub lazy_flush: Option<bool>,
}

impl Default for EngineBenchOptions {
    fn default() -> Self {
        EngineBenchOptions {
            cache_bytes: 4 << 30,
            core_bytes: 64 << 30,
            reps: 7,
            tests: Vec::new(),
            request_kib: vec![4, 64],
            line_kib: vec![4, 64],
            persistence: vec![true, false],
            threads: vec![1, 2],
            flush_every: 64,
            filter: Vec::new(),
            all_combinations: false,
            lazy_flush: None,
        }
    }
}

impl EngineBenchOptions {
    /// A 256 MiB cache and 3 repetitions: the same cases in seconds, for CI and quick checks
    /// (figures are lower-confidence and not comparable to OCF's 4 GiB marks).
    pub fn quick() -> Self {
        EngineBenchOptions {
            cache_bytes: 256 << 20,
            reps: 3,
            ..Default::default()
        }
    }

    /// Every case these options select, in run order.
    pub fn cases(&self) -> Vec<Case> {
        let tests: Vec<Test> = if self.tests.is_empty() {
            Test::ALL.to_vec()
        } else {
            self.tests.clone()
        };
        let mut out = Vec::new();
        for &persistent in &self.persistence {
            for &threads in &self.threads {
                for &test in &tests {
                    for &line_kib in &self.line_kib {
                        // Flush always fills with 64 KiB writes: one case per line size.
                        let reqs: Vec<u32> = if test == Test::Flush {
                            vec![64]
                        } else {
                            self.request_kib.clone()
                        };
                        for request_kib in reqs {
                            let case = Case {
                                test,
                                request_kib,
                                line_kib,
                                persistent,
                                threads,
                            };
                            let label = case.label();
                            if (self.all_combinations || case.is_standard())
                                && self.filter.iter().all(|f| label.contains(f.as_str()))
                            {
                                out.push(case);
                            }
                        }
                    }
                }
            }
        }
        out
    }
}

/// One configuration measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Case {
    pub test: Test,
    pub request_kib: u32,
    pub line_kib: u32,
    pub persistent: bool,
    pub threads: usize,
}

impl Case {
    pub fn label(&self) -> String {
        let req = if self.test == Test::Flush {
            String::new()
        } else {
            format!(" {}k", self.request_kib)
        };
        format!(
            "{}{} line={}k {} t={}",
            self.test.name(),
            req,
            self.line_kib,
            if self.persistent {
                "persistent"
            } else {
                "volatile"
            },
            self.threads
        )
    }

    /// OCF's median from perf.md for this case, if it has one (one thread only), and its unit.
    pub fn ocf_mark(&self) -> Option<OcfMark> {
        if self.threads != 1 {
            return None;
        }
        let iops = |v: f64| {
            Some(OcfMark {
                value: v,
                unit: "IOPS",
            })
        };
        let gbs = |v: f64| {
            Some(OcfMark {
                value: v,
                unit: "GB/s",
            })
        };
        match (self.test, self.request_kib, self.line_kib, self.persistent) {
            (Test::Seqwrite, 4, 4, true) => iops(566e3),
            (Test::Seqwrite, 4, 4, false) => iops(883e3),
            (Test::Seqwrite, 64, 4, true) => iops(81e3),
            (Test::Seqwrite, 64, 4, false) => iops(93e3),
            (Test::Seqwrite, 64, 64, true) => iops(133e3),
            (Test::Randwrite, 4, 4, true) => iops(495e3),
            (Test::Randwrite, 4, 4, false) => iops(702e3),
            (Test::RandwriteHit, 4, 4, true) => iops(634e3),
            (Test::RandreadHit, 4, 4, true) => iops(764e3),
            (Test::Flush, _, 4, true) => gbs(4.8),
            (Test::Flush, _, 64, true) => gbs(5.2),
            _ => None,
        }
    }

    /// The cases a default run measures: every case OCF has a mark for, the sequential-read
    /// analogue, and two threads for the main 4 KiB-line tests (scaling).
    pub fn is_standard(&self) -> bool {
        let sizes = (self.request_kib, self.line_kib);
        match (self.threads, self.persistent) {
            (1, true) => {
                self.ocf_mark().is_some()
                    || (self.test == Test::SeqreadHit && matches!(sizes, (4, 4) | (64, 64)))
            }
            (1, false) => self.ocf_mark().is_some(),
            (2, true) => match self.test {
                Test::Seqwrite => matches!(sizes, (4, 4) | (64, 64)),
                Test::Flush => self.line_kib == 4,
                _ => sizes == (4, 4),
            },
            _ => false,
        }
    }

    /// The perf.md target as a multiple of OCF's persistent mark.
    pub fn target_ratio(&self) -> f64 {
        if self.test == Test::Flush {
            1.5
        } else {
            2.0
        }
    }
}

/// A mark from perf.md.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct OcfMark {
    pub value: f64,
    pub unit: &'static str,
}

/// One timed run.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Sample {
    /// Requests timed (0 for flush).
    pub ops: u64,
    /// Bytes moved by the timed part.
    pub bytes: u64,
    pub seconds: f64,
    /// CPU time of the whole process (every thread: the workers, and the cache's own) over the
    /// timed part: unlike `seconds`, it does not grow while the machine is busy with others, so
    /// it compares builds on a shared machine (issue 31; docs/performance.md §10).
    pub cpu_seconds: f64,
}

/// CPU time the process has used so far, in seconds.
fn process_cpu() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec to the pointer it is given, which is valid.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0.0;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// Median, min and max of one figure over the repetitions.
#[derive(Debug, Clone, Copy, Serialize)]
pub struct Summary {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Summary {
    fn of(mut v: Vec<f64>) -> Summary {
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Summary {
            median,
            min: v[0],
            max: v[n - 1],
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct CaseResult {
    pub case: Case,
    pub label: String,
    pub samples: Vec<Sample>,
    /// Requests per second (None for flush).
    pub iops: Option<Summary>,
    /// Bytes per second.
    pub bytes_per_sec: Summary,
    pub ocf: Option<OcfMark>,
    /// Our median over OCF's mark, in the mark's unit.
    pub ratio_to_ocf: Option<f64>,
    pub target_ratio: Option<f64>,
}

/// The machine the figures come from.
#[derive(Debug, Clone, Serialize)]
pub struct Machine {
    pub cpu_model: String,
    pub cpus: usize,
    pub kernel: String,
}

impl Machine {
    pub fn detect() -> Machine {
        let cpu_model = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split(':').nth(1))
                    .map(|m| m.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".into());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .map(|s| s.trim().to_string())
            .unwrap_or_else(|_| "unknown".into());
        Machine {
            cpu_model,
            cpus: std::thread::available_parallelism().map_or(0, |n| n.get()),
            kernel,
        }
    }
}

#[derive(Debug, Clone, Serialize)]
pub struct EngineBenchReport {
    pub options: EngineBenchOptions,
    pub machine: Machine,
    pub setup: String,
    /// RAM for per-line metadata of a persistent cache of `cache_bytes`, per line size in KiB.
    pub metadata_bytes_per_line: Vec<(u32, f64)>,
    pub results: Vec<CaseResult>,
    pub total_seconds: f64,
}

/// Everything about one fresh cache for a run, in one place: a cache of `line_kib` lines on
/// `ram` (persistent: `Cache::create`, else `Cache::new`), write-back, and `cores` null cores
/// of `core_bytes` with ids 1..., cleaning nop and seq cutoff never, as perf.md sets OCF up.
pub fn setup_cache(
    ram: &VolumeRef,
    line_kib: u32,
    persistent: bool,
    core_bytes: u64,
    cores: usize,
) -> Result<(Cache, Vec<Core>)> {
    let config = CacheConfig {
        id: 1,
        line_size: LineSize::from_kib(line_kib).map_err(EngineError::Invalid)?,
        mode: CacheMode::Wb,
    };
    let cache = if persistent {
        Cache::create(ram.clone(), config, true)?
    } else {
        Cache::new(ram.clone(), config)?
    };
    // perf.md's setup: cleaning nop, seq cutoff never (promotion stays always).
    cache.stop_background_cleaner();
    let mut cleaning = cache.cleaning();
    cleaning.policy = crate::CleaningPolicy::Nop;
    cache.set_cleaning(cleaning)?;
    let mut handles = Vec::with_capacity(cores);
    for i in 0..cores {
        let core: VolumeRef = Arc::new(NullVolume::new(&format!("null-core-{i}"), core_bytes)?);
        let id = cache.add_core(core, Some(i as CoreId + 1))?;
        handles.push(cache.core(id)?);
    }
    cache.set_seq_cutoff(
        None,
        crate::SeqCutoff {
            policy: crate::SeqCutoffPolicy::Never,
            ..crate::SeqCutoff::default()
        },
    )?;
    Ok((cache, handles))
}

/// What one thread does in the timed part.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Write,
    Read,
}

/// Offsets of random requests of `req` bytes without replacement: `n` of the `slots` slots of
/// `req` bytes starting at `base` (partial Fisher-Yates).
fn random_offsets(rng: &mut SplitMix64, base: u64, slots: u64, n: u64, req: u64) -> Vec<u64> {
    let mut order: Vec<u64> = (0..slots).collect();
    let n = n.min(slots) as usize;
    for i in 0..n {
        let j = i + (rng.next_u64() % (slots - i as u64)) as usize;
        order.swap(i, j);
    }
    order.truncate(n);
    order.into_iter().map(|s| base + s * req).collect()
}

/// Fill `[from, to)` with 64 KiB writes, then commit, so none of it is in the timed part.
fn prefill(core: &Core, from: u64, to: u64) -> Result<()> {
    let buf = vec![0x5au8; 64 << 10];
    let mut off = from;
    while off < to {
        let n = (to - off).min(64 << 10) as usize;
        core.write(&buf[..n], off)?;
        off += n as u64;
    }
    core.flush()
}

/// Work that runs beside each case's timed part, such as a metrics scraper: called with the
/// case's cache just before the clock starts; what it returns is dropped just after the clock
/// stops (so a guard that ends the work on drop keeps it out of the next case).
pub type Beside<'a> = &'a (dyn Fn(&Cache) -> Box<dyn std::any::Any> + Sync);

/// Run one case once on a fresh cache on `ram`.
pub fn run_once(ram: &VolumeRef, opts: &EngineBenchOptions, case: &Case) -> Result<Sample> {
    run_once_with(ram, opts, case, None)
}

/// [`run_once`] with `beside` running during the timed part.
pub fn run_once_with(
    ram: &VolumeRef,
    opts: &EngineBenchOptions,
    case: &Case,
    beside: Option<Beside>,
) -> Result<Sample> {
    let start_beside = |cache: &Cache| beside.map(|b| b(cache));
    let cache_bytes = ram.size();
    let threads = case.threads.max(1);
    let req = case.request_kib as u64 * 1024;
    let cores = if case.test == Test::Flush { threads } else { 1 };
    let (cache, handles) =
        setup_cache(ram, case.line_kib, case.persistent, opts.core_bytes, cores)?;
    if let Some(enabled) = opts.lazy_flush {
        cache.set_lazy_flush(crate::LazyFlush { enabled })?;
    }
    let align = |x: u64| x / (64 << 10) * (64 << 10);
    let fill = align(cache_bytes * 85 / 100);
    let hit_region = align(cache_bytes * 425 / 1000);
    let per_thread = |total: u64| align(total / threads as u64);

    if case.test == Test::Flush {
        // Each thread flushes its own core, filled with its share.
        let share = per_thread(fill);
        for h in &handles {
            prefill(h, 0, share)?;
        }
        // The prefill's commit records the lines dirty; they stay dirty until the timed flush.
        let barrier = Barrier::new(threads + 1);
        let running = start_beside(&cache);
        let elapsed = std::thread::scope(|s| -> Result<(f64, f64)> {
            let workers: Vec<_> = handles
                .iter()
                .map(|h| {
                    let (barrier, cache) = (&barrier, &cache);
                    s.spawn(move || {
                        barrier.wait();
                        cache.flush_core(h.id())
                    })
                })
                .collect();
            barrier.wait();
            let t = Instant::now();
            let cpu = process_cpu();
            for w in workers {
                w.join().expect("bench thread panicked")?;
            }
            Ok((t.elapsed().as_secs_f64(), process_cpu() - cpu))
        })?;
        drop(running);
        return Ok(Sample {
            ops: 0,
            bytes: share * threads as u64,
            seconds: elapsed.0,
            cpu_seconds: elapsed.1,
        });
    }

    let core = &handles[0];
    let mut rng = SplitMix64(0x5eed);
    // Per thread: what it does and where, computed before the clock starts.
    let mut plans: Vec<(Kind, Vec<u64>)> = Vec::with_capacity(threads);
    for t in 0..threads as u64 {
        let plan = match case.test {
            Test::Seqwrite => {
                let share = per_thread(fill);
                let base = t * share;
                (
                    Kind::Write,
                    (0..share / req).map(|i| base + i * req).collect(),
                )
            }
            Test::Randwrite => {
                let share = per_thread(cache_bytes * 4);
                let n = per_thread(fill) / req;
                (
                    Kind::Write,
                    random_offsets(&mut rng, t * share, share / req, n, req),
                )
            }
            Test::RandwriteHit | Test::RandreadHit => {
                let share = per_thread(hit_region);
                let slots = share / req;
                let base = t * share;
                let offs = (0..slots * 2)
                    .map(|_| base + rng.next_u64() % slots * req)
                    .collect();
                let kind = if case.test == Test::RandwriteHit {
                    Kind::Write
                } else {
                    Kind::Read
                };
                (kind, offs)
            }
            Test::SeqreadHit => {
                let share = per_thread(hit_region);
                let base = t * share;
                let slots = share / req;
                (
                    Kind::Read,
                    (0..slots * 2).map(|i| base + i % slots * req).collect(),
                )
            }
            Test::Flush => unreachable!("handled above"),
        };
        plans.push(plan);
    }
    if matches!(
        case.test,
        Test::RandwriteHit | Test::RandreadHit | Test::SeqreadHit
    ) {
        prefill(core, 0, per_thread(hit_region) * threads as u64)?;
    }

    let flush_every = opts.flush_every;
    let barrier = Barrier::new(threads + 1);
    let running = start_beside(&cache);
    let elapsed = std::thread::scope(|s| -> Result<(f64, f64)> {
        let workers: Vec<_> = plans
            .iter()
            .map(|(kind, offs)| {
                let barrier = &barrier;
                let core = core.clone();
                let kind = *kind;
                s.spawn(move || -> Result<()> {
                    let mut buf = vec![0xa5u8; req as usize];
                    barrier.wait();
                    for (i, &off) in offs.iter().enumerate() {
                        match kind {
                            Kind::Write => core.write(&buf, off)?,
                            Kind::Read => core.read(&mut buf, off)?,
                        }
                        if flush_every != 0 && (i as u64 + 1) % flush_every == 0 {
                            core.flush()?;
                        }
                    }
                    Ok(())
                })
            })
            .collect();
        barrier.wait();
        let t = Instant::now();
        let cpu = process_cpu();
        for w in workers {
            w.join().expect("bench thread panicked")?;
        }
        Ok((t.elapsed().as_secs_f64(), process_cpu() - cpu))
    })?;
    drop(running);
    let ops: u64 = plans.iter().map(|p| p.1.len() as u64).sum();
    // Keep the cache alive until the clock stopped; dropping it is not part of the test.
    drop(cache);
    Ok(Sample {
        ops,
        bytes: ops * req,
        seconds: elapsed.0,
        cpu_seconds: elapsed.1,
    })
}

/// The RAM cache volume, allocated and pre-faulted once and reused by every run (each run formats
/// a fresh cache on it), so page faults and 4 GiB of zeroing stay out of every figure.
pub fn ram_volume(bytes: u64) -> Result<VolumeRef> {
    let ram = RamVolume::new("ram-cache", bytes)?;
    ram.prefault();
    Ok(Arc::new(ram))
}

/// Run every case of `opts` `opts.reps` times, rep-major. `progress` gets one line per sample.
pub fn run(opts: &EngineBenchOptions, progress: &mut dyn FnMut(&str)) -> Result<EngineBenchReport> {
    run_with(opts, progress, None)
}

/// [`run`] with `beside` running during every case's timed part.
pub fn run_with(
    opts: &EngineBenchOptions,
    progress: &mut dyn FnMut(&str),
    beside: Option<Beside>,
) -> Result<EngineBenchReport> {
    let started = Instant::now();
    let cases = opts.cases();
    let ram = ram_volume(opts.cache_bytes)?;
    let mut metadata_bytes_per_line = Vec::new();
    for &line_kib in &opts.line_kib {
        let (cache, _) = setup_cache(&ram, line_kib, true, opts.core_bytes, 1)?;
        metadata_bytes_per_line.push((
            line_kib,
            cache.metadata_bytes() as f64 / cache.line_count() as f64,
        ));
    }
    let mut samples: Vec<Vec<Sample>> = vec![Vec::new(); cases.len()];
    let reps = opts.reps.max(1);
    for rep in 0..reps {
        for (i, case) in cases.iter().enumerate() {
            let s = run_once_with(&ram, opts, case, beside)?;
            progress(&format!(
                "rep {}/{reps} {:<40} {:>10.0} IOPS {:>8.0} MB/s {:.3} s",
                rep + 1,
                case.label(),
                s.ops as f64 / s.seconds,
                s.bytes as f64 / s.seconds / 1e6,
                s.seconds
            ));
            samples[i].push(s);
        }
    }
    let results = cases
        .iter()
        .zip(samples)
        .map(|(case, samples)| {
            let iops = (case.test != Test::Flush)
                .then(|| Summary::of(samples.iter().map(|s| s.ops as f64 / s.seconds).collect()));
            let bytes_per_sec =
                Summary::of(samples.iter().map(|s| s.bytes as f64 / s.seconds).collect());
            let ocf = case.ocf_mark();
            let ratio_to_ocf = ocf.map(|m| match (m.unit, iops) {
                ("IOPS", Some(i)) => i.median / m.value,
                _ => bytes_per_sec.median / 1e9 / m.value,
            });
            CaseResult {
                case: *case,
                label: case.label(),
                samples,
                iops,
                bytes_per_sec,
                ocf,
                ratio_to_ocf,
                target_ratio: (ocf.is_some() && case.persistent).then(|| case.target_ratio()),
            }
        })
        .collect();
    Ok(EngineBenchReport {
        options: opts.clone(),
        machine: Machine::detect(),
        setup: format!(
            "RAM cache volume {} MiB (pre-faulted), null core {} GiB, write-back, fresh cache per run, \
             queue depth 1 per thread, client flush every {} requests per thread; persistent = \
             Cache::create (metadata committed at each flush), volatile = Cache::new; cleaning nop, \
             seq cutoff never",
            opts.cache_bytes >> 20,
            opts.core_bytes >> 30,
            opts.flush_every
        ),
        metadata_bytes_per_line,
        results,
        total_seconds: started.elapsed().as_secs_f64(),
    })
}

fn si(v: f64) -> String {
    if v >= 1e6 {
        format!("{:.2}M", v / 1e6)
    } else if v >= 1e3 {
        format!("{:.0}k", v / 1e3)
    } else {
        format!("{v:.0}")
    }
}

impl EngineBenchReport {
    /// The table for people: medians with [min-max], OCF's mark, our ratio to it and the target.
    pub fn table(&self) -> String {
        use std::fmt::Write;
        let mut out = String::new();
        let _ = writeln!(
            out,
            "engine bench: {}\nmachine: {} ({} CPUs), kernel {}; {} repetitions, rep-major; {:.0} s",
            self.setup,
            self.machine.cpu_model,
            self.machine.cpus,
            self.machine.kernel,
            self.options.reps,
            self.total_seconds
        );
        if self.options.cache_bytes != 4 << 30 || self.options.core_bytes != 64 << 30 {
            let _ = writeln!(
                out,
                "note: OCF's marks are for a 4 GiB cache and a 64 GiB core; ratios to them are indicative only"
            );
        }
        let _ = writeln!(
            out,
            "{:<40} {:>24} {:>20} {:>14} {:>7} {:>6}",
            "case", "IOPS median [min-max]", "GB/s median [min-max]", "OCF", "ours/OCF", "target"
        );
        for r in &self.results {
            let iops = r.iops.map_or("-".to_string(), |i| {
                format!("{} [{}-{}]", si(i.median), si(i.min), si(i.max))
            });
            let b = r.bytes_per_sec;
            let gbs = format!(
                "{:.2} [{:.2}-{:.2}]",
                b.median / 1e9,
                b.min / 1e9,
                b.max / 1e9
            );
            let ocf = r.ocf.map_or("-".to_string(), |m| {
                if m.unit == "IOPS" {
                    format!("{} IOPS", si(m.value))
                } else {
                    format!("{:.1} GB/s", m.value)
                }
            });
            let ratio = r.ratio_to_ocf.map_or("-".into(), |x| format!("{x:.2}x"));
            let target = r.target_ratio.map_or("-".into(), |x| {
                let met = r.ratio_to_ocf.is_some_and(|v| v >= x);
                format!("{x:.1}x{}", if met { "" } else { " !" })
            });
            let _ = writeln!(
                out,
                "{:<40} {iops:>24} {gbs:>20} {ocf:>14} {ratio:>7} {target:>6}",
                r.label
            );
        }
        // Scaling from one thread to two, for cases run with both.
        for r2 in self.results.iter().filter(|r| r.case.threads == 2) {
            let one = Case {
                threads: 1,
                ..r2.case
            };
            if let Some(r1) = self.results.iter().find(|r| r.case == one) {
                let _ = writeln!(
                    out,
                    "scaling 1->2 threads {:<32} {:.2}x",
                    one.label().trim_end_matches(" t=1"),
                    r2.bytes_per_sec.median / r1.bytes_per_sec.median
                );
            }
        }
        for (kib, b) in &self.metadata_bytes_per_line {
            let _ = writeln!(
                out,
                "RAM for metadata: {b:.1} bytes per {kib} KiB cache line (target <= 24; OCF about 78)"
            );
        }
        out
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\": \"{e}\"}}"))
    }
}

//! Load benchmark (issue 15, perf.md's load target): how long `Cache::load` takes for a cache
//! whose every 4 KiB line is mapped and dirty, after a clean stop and after a crash, at several
//! sizes (to show the time grows linearly with the line count), and what the largest size
//! extrapolates to for 1 TiB (target: under 60 s).
//!
//! `cargo bench -p hybridcache-engine --bench load [-- OPTIONS]`:
//! `--gib 1,4,16` (cache sizes; default 1,4,16), `--reps N` (default 3; medians),
//! `--threads 1,2` (load threads, `hybridcache_engine::set_load_threads`; each repetition
//! runs every count in turn, so their figures share the machine's load; default: 0, the
//! engine's own choice),
//! `--file` (the cache volume is a sparse file under target/tmp, or `HC_BENCH_DIR`, opened as
//! the daemon opens one, so reading the metadata from the disk is timed too; default: a RAM
//! volume, which times the engine alone).
//!
//! Either way the cache volume keeps its metadata region and drops writes to the data region,
//! so the fill writes only metadata (about 5 MiB per GiB of cache, both copies) and neither RAM
//! nor disk holds the 16 GiB of lines.
//!
//! Each repetition times a load after a crash (the cache was filled and committed, then dropped
//! without a stop: the superblock says "not stopped cleanly", so only dirty sectors are trusted)
//! and a load after a clean stop. Wall time is what the target is about; the process's CPU time
//! is printed too, because on this shared machine wall time also counts waiting for a CPU.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use hybridcache_engine::{
    Cache, CacheConfig, CacheMode, CleaningPolicy, LineSize, SeqCutoff, SeqCutoffPolicy,
};
use hybridcache_volume::{FileVolume, NullVolume, RamVolume, Volume, VolumeRef};

/// A cache volume that keeps what is written below `data_from` (superblocks and metadata) and
/// drops data writes above it: the benchmark fills every line of a large cache without storing
/// its data. Reads above `data_from` return whatever the inner volume holds (zeros).
struct MetadataOnly {
    inner: Box<dyn Volume>,
    /// Everything is kept until the cache is created and its data offset known.
    data_from: AtomicU64,
}

impl Volume for MetadataOnly {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> hybridcache_volume::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> hybridcache_volume::Result<()> {
        if offset >= self.data_from.load(Ordering::Relaxed) {
            return Ok(());
        }
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> hybridcache_volume::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        self.inner.discard(offset, len)
    }
}

fn usage(why: &str) -> ! {
    eprintln!("load bench: {why}\nusage: load [--gib 1,4,16] [--reps N] [--file]");
    std::process::exit(2)
}

/// CPU time of the whole process (user + system, every thread), in seconds.
fn process_cpu() -> f64 {
    // SAFETY: getrusage only writes the struct we pass.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let tv = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    tv(ru.ru_utime) + tv(ru.ru_stime)
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

struct Sized {
    gib: u64,
    threads: usize,
    lines: u64,
    meta_bytes: u64,
    ram_per_line: f64,
    fill_s: f64,
    /// (wall, cpu) seconds per repetition.
    crash: Vec<(f64, f64)>,
    clean: Vec<(f64, f64)>,
}

fn time_load(vol: &VolumeRef, core: &VolumeRef, lines: u64, what: &str) -> (Cache, f64, f64) {
    let (t, cpu) = (Instant::now(), process_cpu());
    let cache = Cache::load(vol.clone(), &mut |_| Some(core.clone()))
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let times = (t.elapsed().as_secs_f64(), process_cpu() - cpu);
    // The load must bring back every line, dirty: a bench that loads less measures nothing.
    assert_eq!(cache.stats().usage.dirty_lines, lines, "{what} lost lines");
    (cache, times.0, times.1)
}

fn run_size(gib: u64, reps: usize, threads: &[usize], on_file: bool) -> Vec<Sized> {
    let size = gib << 30;
    let path = std::path::Path::new(
        &std::env::var("HC_BENCH_DIR").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into()),
    )
    .join("load-bench-cache.img");
    let inner: Box<dyn Volume> = if on_file {
        let _ = std::fs::remove_file(&path);
        Box::new(FileVolume::create(&path, size).expect("sparse cache file"))
    } else {
        // Anonymous memory, allocated on first touch: only the metadata region ever is.
        Box::new(RamVolume::new("load-bench-cache", size).expect("RAM volume"))
    };
    let meta = Arc::new(MetadataOnly {
        inner,
        data_from: AtomicU64::new(u64::MAX),
    });
    let vol: VolumeRef = meta.clone();
    let core: VolumeRef = Arc::new(NullVolume::new("null-core", size * 2).expect("null"));
    let config = CacheConfig {
        id: 1,
        line_size: LineSize::from_kib(4).expect("line size"),
        mode: CacheMode::Wb,
    };
    let cache = Cache::create(vol.clone(), config, true).expect("create");
    let sb = cache.superblock().expect("persistent");
    meta.data_from.store(sb.data_offset, Ordering::Relaxed);
    // Nothing may clean or bypass the cache while it fills: every line must end up dirty.
    cache.stop_background_cleaner();
    let mut cleaning = cache.cleaning();
    cleaning.policy = CleaningPolicy::Nop;
    cache.set_cleaning(cleaning).expect("cleaning nop");
    cache.add_core(core.clone(), Some(1)).expect("core");
    cache
        .set_seq_cutoff(
            None,
            SeqCutoff {
                policy: SeqCutoffPolicy::Never,
                ..SeqCutoff::default()
            },
        )
        .expect("seq cutoff never");
    let lines = cache.line_count();
    let ram_per_line = cache.metadata_bytes() as f64 / lines as f64;
    let handle = cache.core(1).expect("core");
    let buf = vec![1u8; 1 << 20];
    let t = Instant::now();
    for off in (0..lines * 4096).step_by(1 << 20) {
        let len = (lines * 4096 - off).min(1 << 20) as usize;
        handle.write(&buf[..len], off).expect("fill");
    }
    // Commit, then drop without a stop: what a crash right after a flush leaves.
    handle.flush().expect("commit");
    let fill_s = t.elapsed().as_secs_f64();
    drop(handle);
    assert_eq!(
        cache.stats().usage.dirty_lines,
        lines,
        "the fill left lines clean"
    );
    cache.stop_background_prefetch();
    drop(cache);
    eprintln!("{gib} GiB: filled {lines} lines in {fill_s:.1} s");
    let mut out: Vec<Sized> = threads
        .iter()
        .map(|&threads| Sized {
            gib,
            threads,
            lines,
            meta_bytes: sb.data_offset,
            ram_per_line,
            fill_s,
            crash: Vec::new(),
            clean: Vec::new(),
        })
        .collect();
    for rep in 0..reps {
        for r in out.iter_mut() {
            hybridcache_engine::set_load_threads(r.threads);
            let (cache, wall, cpu) = time_load(&vol, &core, lines, "load after a crash");
            r.crash.push((wall, cpu));
            cache.stop(false).expect("clean stop");
            drop(cache);
            // The load marks the superblock "not stopped cleanly" before it returns, so
            // dropping this cache leaves the device as a crash would for the next load.
            let (cache, wall, cpu) = time_load(&vol, &core, lines, "load after a clean stop");
            r.clean.push((wall, cpu));
            drop(cache);
            eprintln!(
                "{gib} GiB, {} threads, rep {rep}: crash {:.3} s, clean {:.3} s (load {})",
                r.threads,
                r.crash[rep].0,
                r.clean[rep].0,
                load_average()
            );
        }
    }
    hybridcache_engine::set_load_threads(0);
    if on_file {
        let _ = std::fs::remove_file(&path);
    }
    out
}

fn threads_label(n: usize) -> String {
    if n == 0 {
        format!(
            "auto ({} CPUs)",
            std::thread::available_parallelism().map_or(1, |n| n.get())
        )
    } else {
        n.to_string()
    }
}

fn main() {
    let mut gibs: Vec<u64> = vec![1, 4, 16];
    let mut reps: usize = 3;
    let mut on_file = false;
    let mut threads: Vec<usize> = vec![0];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {}
            "--gib" => {
                let v = args.next().unwrap_or_else(|| usage("--gib needs sizes"));
                gibs = v
                    .split(',')
                    .map(|g| {
                        g.trim()
                            .parse()
                            .ok()
                            .filter(|&g: &u64| g > 0)
                            .unwrap_or_else(|| usage(&format!("bad size '{g}'")))
                    })
                    .collect();
            }
            "--reps" => {
                reps = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .filter(|&r| r > 0)
                    .unwrap_or_else(|| usage("--reps needs a positive number"))
            }
            "--threads" => {
                let v = args
                    .next()
                    .unwrap_or_else(|| usage("--threads needs counts"));
                threads = v
                    .split(',')
                    .map(|t| {
                        t.trim()
                            .parse()
                            .unwrap_or_else(|_| usage(&format!("bad thread count '{t}'")))
                    })
                    .collect();
            }
            "--file" => on_file = true,
            f => usage(&format!("unknown argument {f}")),
        }
    }
    let before = load_average();
    let results: Vec<Sized> = gibs
        .iter()
        .flat_map(|&g| run_size(g, reps, &threads, on_file))
        .collect();
    println!(
        "load of a cache of 4 KiB lines, every line dirty, {} volume, median of {reps}; load average {before} before, {} after",
        if on_file { "file" } else { "RAM" },
        load_average()
    );
    println!("| cache | lines | threads | metadata on the device | RAM per line | fill | after a crash: wall (CPU) | after a clean stop: wall (CPU) | wall ns per line (crash, clean) |");
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in &results {
        let wall = |v: &[(f64, f64)]| median(&v.iter().map(|x| x.0).collect::<Vec<_>>());
        let cpu = |v: &[(f64, f64)]| median(&v.iter().map(|x| x.1).collect::<Vec<_>>());
        let ns = |s: f64| s * 1e9 / r.lines as f64;
        println!(
            "| {} GiB | {} | {} | {:.1} MiB | {:.2} B | {:.1} s | {:.3} s ({:.3} s) | {:.3} s ({:.3} s) | {:.0}, {:.0} |",
            r.gib,
            r.lines,
            threads_label(r.threads),
            r.meta_bytes as f64 / (1 << 20) as f64,
            r.ram_per_line,
            r.fill_s,
            wall(&r.crash),
            cpu(&r.crash),
            wall(&r.clean),
            cpu(&r.clean),
            ns(wall(&r.crash)),
            ns(wall(&r.clean)),
        );
    }
    let largest = results.iter().map(|r| r.lines).max().unwrap_or(0);
    for r in results.iter().filter(|r| r.lines == largest) {
        let tib_lines = (1u64 << 40) as f64 / 4096.0;
        let scale = tib_lines / r.lines as f64;
        let wall = |v: &[(f64, f64)]| median(&v.iter().map(|x| x.0).collect::<Vec<_>>()) * scale;
        let cpu = |v: &[(f64, f64)]| median(&v.iter().map(|x| x.1).collect::<Vec<_>>()) * scale;
        let verdict = |s: f64| if s < 60.0 { "met" } else { "missed" };
        println!(
            "1 TiB of 4 KiB lines, extrapolated from {} GiB, {} threads: after a crash {:.1} s (CPU {:.1} s), after a clean stop {:.1} s (CPU {:.1} s); target < 60 s: {}, {}",
            r.gib,
            threads_label(r.threads),
            wall(&r.crash),
            cpu(&r.crash),
            wall(&r.clean),
            cpu(&r.clean),
            verdict(wall(&r.crash)),
            verdict(wall(&r.clean)),
        );
    }
}

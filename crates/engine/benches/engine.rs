//! Engine benchmark (docs/perf.md §1; the library is `hybridcache_engine::bench`).
//!
//! `cargo bench -p hybridcache-engine [-- OPTIONS] [FILTER...]` prints a table (medians with
//! min-max, OCF's marks and our ratio to them) and writes every figure as JSON.
//!
//! Options: `--quick` (256 MiB cache, 3 reps: seconds instead of minutes), `--reps N`,
//! `--all` (every combination of the lists below, not just the standard cases: about 30 min),
//! `--cache-mib N`, `--test NAME` (repeatable: seqwrite, randwrite, randwrite_hit,
//! randread_hit, seqread_hit, flush), `--threads 1,2`, `--req 4,64`, `--line 4,64`,
//! `--persistence on,off`, `--flush-every N`, `--lazy-flush on|off` (default: the engine's), `--json PATH` (default
//! target/tmp/engine-bench.json), `--load` (also time loading a 16 GiB cache; HC_BENCH_LOAD_GIB).
//! Other words filter cases by label (every word must occur), e.g. `t=1 persistent`.

use std::sync::Arc;
use std::time::Instant;

use hybridcache_engine::bench::{self, EngineBenchOptions, Test};
use hybridcache_engine::{Cache, CacheConfig, CacheMode, LineSize};
use hybridcache_volume::{FileVolume, NullVolume, Volume, VolumeRef};

fn wb(line_kib: u32) -> CacheConfig {
    CacheConfig {
        id: 1,
        line_size: LineSize::from_kib(line_kib).expect("line size"),
        mode: CacheMode::Wb,
    }
}

/// A volume that keeps metadata but drops data writes past `data_from`: lets the load benchmark
/// fill every line of a 16 GiB cache without writing 16 GiB.
struct MetadataOnly {
    inner: FileVolume,
    data_from: u64,
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
        if offset >= self.data_from {
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

/// Load time of a cache with every line mapped and dirty, after a clean stop and after a crash.
fn load_times(gib: u64) {
    let dir = std::env::var("HC_BENCH_DIR").unwrap_or_else(|_| env!("CARGO_TARGET_TMPDIR").into());
    let path = std::path::Path::new(&dir).join("load-bench-cache.img");
    let _ = std::fs::remove_file(&path);
    let size = gib << 30;
    let file = FileVolume::create(&path, size).expect("sparse cache file");
    // The superblock is written at creation; the data region starts after the metadata (< 1%).
    let vol: VolumeRef = Arc::new(MetadataOnly {
        inner: file,
        data_from: size / 50,
    });
    let core: VolumeRef = Arc::new(NullVolume::new("null-core", size * 2).expect("null"));
    let cache = Cache::create(vol.clone(), wb(4), true).expect("create");
    cache.add_core(core.clone(), Some(1)).expect("core");
    let lines = cache.line_count();
    let handle = cache.core(1).expect("core");
    let buf = vec![1u8; 1 << 20];
    for off in (0..lines * 4096).step_by(1 << 20) {
        let len = (lines * 4096 - off).min(1 << 20) as usize;
        handle.write(&buf[..len], off).expect("fill");
    }
    drop(handle);
    cache.stop(false).expect("stop");
    drop(cache);
    let t = Instant::now();
    let cache = Cache::load(vol.clone(), &mut |_| Some(core.clone())).expect("clean load");
    let clean = t.elapsed().as_secs_f64();
    assert_eq!(cache.stats().usage.dirty_lines, lines);
    drop(cache); // the load marked the cache unclean: the next load is a recovery
    let t = Instant::now();
    let cache = Cache::load(vol, &mut |_| Some(core.clone())).expect("recovery");
    let recovery = t.elapsed().as_secs_f64();
    assert_eq!(cache.stats().usage.dirty_lines, lines);
    let mlines = lines as f64 / 1e6;
    println!(
        "load of a {gib} GiB cache, {lines} lines of 4 KiB, all dirty: clean {clean:.2} s ({:.2} s per GiB, {:.2} s per million lines), recovery {recovery:.2} s ({:.2} s per million lines); 1 TiB at 4 KiB lines by extrapolation: {:.0} s",
        clean / gib as f64,
        clean / mlines,
        recovery / mlines,
        recovery / gib as f64 * 1024.0
    );
    drop(cache);
    let _ = std::fs::remove_file(&path);
}

fn list<T: std::str::FromStr>(arg: &str, what: &str) -> Vec<T> {
    arg.split(',')
        .map(|v| {
            v.trim()
                .parse()
                .unwrap_or_else(|_| usage(&format!("bad {what} '{v}'")))
        })
        .collect()
}

fn usage(why: &str) -> ! {
    eprintln!("engine bench: {why}\nsee the header of crates/engine/benches/engine.rs for options");
    std::process::exit(2)
}

fn main() {
    let mut opts = EngineBenchOptions::default();
    // cargo runs benches in the package directory; the target dir is where people look.
    let mut json = format!("{}/engine-bench.json", env!("CARGO_TARGET_TMPDIR"));
    let mut load = false;
    let mut tests = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || {
            args.next()
                .unwrap_or_else(|| usage(&format!("{a} needs a value")))
        };
        match a.as_str() {
            // cargo bench passes --bench.
            "--bench" => {}
            "--quick" => {
                opts = EngineBenchOptions {
                    tests: opts.tests,
                    filter: opts.filter,
                    lazy_flush: opts.lazy_flush,
                    ..EngineBenchOptions::quick()
                }
            }
            "--reps" => opts.reps = list::<usize>(&value(), "repetitions")[0],
            "--cache-mib" => opts.cache_bytes = list::<u64>(&value(), "size")[0] << 20,
            "--test" => {
                let v = value();
                tests.push(Test::from_name(&v).unwrap_or_else(|| usage(&format!("no test '{v}'"))))
            }
            "--threads" => opts.threads = list(&value(), "thread count"),
            "--req" => opts.request_kib = list(&value(), "request size"),
            "--line" => opts.line_kib = list(&value(), "line size"),
            "--persistence" => {
                opts.persistence = value()
                    .split(',')
                    .map(|v| match v {
                        "on" => true,
                        "off" => false,
                        _ => usage(&format!("persistence is on or off, not '{v}'")),
                    })
                    .collect()
            }
            "--lazy-flush" => {
                let v = value();
                let on = hybridcache_engine::policy::parse_on_off("--lazy-flush", &v);
                opts.lazy_flush = Some(on.unwrap_or_else(|e| usage(&e)));
            }
            "--flush-every" => opts.flush_every = list::<u64>(&value(), "count")[0],
            "--json" => json = value(),
            "--load" => load = true,
            "--all" => opts.all_combinations = true,
            f if f.starts_with("--") => usage(&format!("unknown option {f}")),
            f => opts.filter.push(f.to_string()),
        }
    }
    opts.tests = tests;
    if opts.cases().is_empty() && !load {
        usage("no case matches");
    }
    if !opts.cases().is_empty() {
        let report = bench::run(&opts, &mut |line| eprintln!("{line}")).expect("engine bench");
        print!("{}", report.table());
        match std::fs::write(&json, report.to_json()) {
            Ok(()) => println!("JSON: {json}"),
            Err(e) => eprintln!("could not write {json}: {e}"),
        }
    }
    if load {
        let gib = std::env::var("HC_BENCH_LOAD_GIB")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(16);
        load_times(gib);
    }
}

//! Engine micro-benchmark: the engine alone, no network. RAM cache volume, null core, write-back.
//!
//! `cargo bench -p hybridcache-engine` prints IOPS and MB/s for 4 KiB random writes (all misses),
//! 4 KiB random read hits, 64 KiB sequential writes, and flushing a cache full of dirty data,
//! each as the median of a few repetitions on a fresh cache. Set HC_BENCH_CACHE_MIB to change the
//! cache size (default 1024) and HC_BENCH_REPS the repetitions (default 5).

use std::sync::Arc;
use std::time::Instant;

use hybridcache_engine::{Cache, CacheConfig, CacheMode, LineSize};
use hybridcache_volume::{FileVolume, NullVolume, RamVolume, SplitMix64 as Rng, Volume, VolumeRef};

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn wb(line_kib: u32) -> CacheConfig {
    CacheConfig {
        id: 1,
        line_size: LineSize::from_kib(line_kib).expect("line size"),
        mode: CacheMode::Wb,
    }
}

fn fresh(cache_bytes: u64, line_kib: u32) -> (Cache, hybridcache_engine::Core) {
    fresh_with(cache_bytes, line_kib, false)
}

fn fresh_with(
    cache_bytes: u64,
    line_kib: u32,
    persistent: bool,
) -> (Cache, hybridcache_engine::Core) {
    let ram = RamVolume::new("ram-cache", cache_bytes).expect("ram volume");
    ram.prefault();
    let cache = if persistent {
        Cache::create(Arc::new(ram), wb(line_kib), true)
    } else {
        Cache::new(Arc::new(ram), wb(line_kib))
    }
    .expect("cache");
    let core = NullVolume::new("null-core", 64 << 30).expect("null volume");
    let id = cache.add_core(Arc::new(core), None).expect("core");
    let core = cache.core(id).expect("core handle");
    (cache, core)
}

/// One test: returns (operations, bytes, seconds) of the timed part.
fn run(test: &str, cache_bytes: u64, line_kib: u32) -> (u64, u64, f64) {
    let (cache, core) = fresh(cache_bytes, line_kib);
    let mut rng = Rng(42);
    let fill = cache_bytes * 85 / 100;
    match test {
        "randwrite-4k" => {
            // Random without replacement from a region 4x the cache: every write is a miss.
            let slots = cache_bytes * 4 / 4096;
            let n = fill / 4096;
            let stride = (slots / n).max(1);
            let buf = vec![0xabu8; 4096];
            let mut order: Vec<u64> = (0..n).collect();
            for i in (1..order.len()).rev() {
                order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            let t = Instant::now();
            for &i in &order {
                core.write(&buf, i * stride * 4096).expect("write");
            }
            (n, n * 4096, t.elapsed().as_secs_f64())
        }
        "randread-hit-4k" => {
            let region = cache_bytes * 425 / 1000 / 65536 * 65536;
            let big = vec![0x5au8; 65536];
            for off in (0..region).step_by(65536) {
                core.write(&big, off).expect("prefill");
            }
            let n = region / 4096 * 2;
            let mut buf = vec![0u8; 4096];
            let t = Instant::now();
            for _ in 0..n {
                core.read(&mut buf, rng.next_u64() % (region / 4096) * 4096)
                    .expect("read");
            }
            (n, n * 4096, t.elapsed().as_secs_f64())
        }
        "seqwrite-64k" => {
            let buf = vec![0x33u8; 65536];
            let n = fill / 65536;
            let t = Instant::now();
            for i in 0..n {
                core.write(&buf, i * 65536).expect("write");
            }
            (n, n * 65536, t.elapsed().as_secs_f64())
        }
        "flush" => {
            let buf = vec![0x77u8; 65536];
            let n = fill / 65536;
            for i in 0..n {
                core.write(&buf, i * 65536).expect("fill");
            }
            let t = Instant::now();
            cache.flush().expect("flush");
            (1, n * 65536, t.elapsed().as_secs_f64())
        }
        other => panic!("unknown test {other}"),
    }
}

/// 4 KiB random write-back writes (all misses) with a client flush every 64 writes: the price
/// of persistence is the metadata commit at each flush. Returns IOPS.
fn randwrite_flush64(cache_bytes: u64, persistent: bool) -> f64 {
    let (_cache, core) = fresh_with(cache_bytes, 4, persistent);
    let mut rng = Rng(7);
    let n = cache_bytes * 85 / 100 / 4096 / 64 * 64;
    let buf = vec![0x42u8; 4096];
    let t = Instant::now();
    for i in 0..n {
        core.write(&buf, rng.next_u64() % (cache_bytes * 4 / 4096) * 4096)
            .expect("write");
        if i % 64 == 63 {
            core.flush().expect("flush");
        }
    }
    n as f64 / t.elapsed().as_secs_f64()
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

fn main() {
    // `cargo bench` passes --bench; any other argument filters tests by name.
    let filter: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let cache_bytes = env("HC_BENCH_CACHE_MIB", 1024) << 20;
    let reps = env("HC_BENCH_REPS", 5).max(1);
    println!(
        "engine bench: RAM cache {} MiB, null core, write-back, {} repetitions, medians",
        cache_bytes >> 20,
        reps
    );
    println!(
        "{:<28} {:>12} {:>10} {:>9}",
        "test", "IOPS", "MB/s", "seconds"
    );
    let tests = [
        ("randwrite-4k", 4),
        ("randread-hit-4k", 4),
        ("seqwrite-64k", 4),
        ("seqwrite-64k", 64),
        ("flush", 4),
        ("flush", 64),
    ];
    for (test, line_kib) in tests {
        let label = format!("{test} (line {line_kib} KiB)");
        if !filter.is_empty() && !filter.iter().any(|f| label.contains(f.as_str())) {
            continue;
        }
        let mut results: Vec<(u64, u64, f64)> = (0..reps)
            .map(|_| run(test, cache_bytes, line_kib))
            .collect();
        results.sort_by(|a, b| a.2.total_cmp(&b.2));
        let (ops, bytes, secs) = results[results.len() / 2];
        let iops = if test == "flush" {
            String::from("-")
        } else {
            format!("{:.0}", ops as f64 / secs)
        };
        println!(
            "{label:<28} {iops:>12} {:>10.0} {secs:>9.3}",
            bytes as f64 / secs / 1e6
        );
    }
    if filter.is_empty() || filter.iter().any(|f| "persist".contains(f.as_str())) {
        let mut ratios: Vec<(f64, f64)> = (0..reps)
            .map(|_| {
                // Interleaved, so both see the same machine.
                let volatile = randwrite_flush64(cache_bytes, false);
                let persistent = randwrite_flush64(cache_bytes, true);
                (volatile, persistent)
            })
            .collect();
        ratios.sort_by(|a, b| (a.1 / a.0).total_cmp(&(b.1 / b.0)));
        let (v, p) = ratios[ratios.len() / 2];
        println!(
            "randwrite-4k, flush every 64: volatile {v:.0} IOPS, persistent {p:.0} IOPS, ratio {:.2}",
            p / v
        );
    }
    if filter.is_empty() || filter.iter().any(|f| "load".contains(f.as_str())) {
        load_times(env("HC_BENCH_LOAD_GIB", 16));
    }
    // The size perf.md uses; the RAM volume is lazily allocated, so this costs little.
    let (cache, _core) = fresh_with(4 << 30, 4, true);
    println!(
        "RAM for metadata (4 GiB persistent cache): {:.1} bytes per 4 KiB cache line",
        cache.metadata_bytes() as f64 / cache.line_count() as f64
    );
}

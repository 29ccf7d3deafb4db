//! Engine micro-benchmark: the engine alone, no network. RAM cache volume, null core, write-back.
//!
//! `cargo bench -p hybridcache-engine` prints IOPS and MB/s for 4 KiB random writes (all misses),
//! 4 KiB random read hits, 64 KiB sequential writes, and flushing a cache full of dirty data,
//! each as the median of a few repetitions on a fresh cache. Set HC_BENCH_CACHE_MIB to change the
//! cache size (default 1024) and HC_BENCH_REPS the repetitions (default 5).

use std::sync::Arc;
use std::time::Instant;

use hybridcache_engine::{Cache, CacheConfig, CacheMode, LineSize};
use hybridcache_volume::{NullVolume, RamVolume};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        // splitmix64: cheap and good enough to scatter offsets.
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

fn env(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn fresh(cache_bytes: u64, line_kib: u32) -> (Cache, hybridcache_engine::Core) {
    let ram = RamVolume::new("ram-cache", cache_bytes).expect("ram volume");
    ram.prefault();
    let cache = Cache::new(
        Arc::new(ram),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(line_kib).expect("line size"),
            mode: CacheMode::Wb,
        },
    )
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
                order.swap(i, (rng.next() % (i as u64 + 1)) as usize);
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
                core.read(&mut buf, rng.next() % (region / 4096) * 4096)
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
    let (cache, _core) = fresh(64 << 20, 4);
    println!(
        "RAM for metadata: {:.1} bytes per 4 KiB cache line",
        cache.metadata_bytes() as f64 / cache.line_count() as f64
    );
}

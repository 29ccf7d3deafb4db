//! Cleaning benchmark: how fast dirty data leaves the cache, and in what core writes.
//!
//! `cargo bench -p hybridcache-engine --bench cleaning` prints three tables:
//!
//! 1. Throughput to a null core: a RAM cache (HC_BENCH_CACHE_MIB, default 1024) 85% dirty,
//!    written sequentially or at random lines of a region four times its size, drained by a
//!    user flush, by background acp-very-aggressive and by background alru-very-aggressive, with
//!    4 KiB and 64 KiB lines. Background times run from the first core write to the last line
//!    cleaned (alru-very-aggressive waits its 1 s staleness first, not counted).
//! 2. The size distribution of cleaning's core writes (`cleaning_stats().write_sizes`) for the
//!    sequentially and the randomly written cache (4 KiB lines, flush).
//! 3. A slow core (`throttle:latency_us=1000` over null): time to clean 2000 scattered lines
//!    with 1 write in flight, with flush-max-buffers 8 and 32, and by a user flush.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hybridcache_engine::{
    Cache, CacheConfig, CacheMode, CleaningConfig, CleaningStats, LineSize, WRITE_SIZE_BUCKETS,
};
use hybridcache_volume::{
    NullVolume, RamVolume, SplitMix64 as Rng, ThrottleConfig, ThrottledVolume, VolumeRef,
};

const MIB: u64 = 1 << 20;

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

#[derive(Clone, Copy, PartialEq)]
enum Fill {
    Seq,
    Random,
}

impl Fill {
    fn name(self) -> &'static str {
        match self {
            Fill::Seq => "seq",
            Fill::Random => "random",
        }
    }
}

/// A volatile write-back cache on RAM over `core`, `fill` written until 85% of its lines are
/// dirty. Sequential cutoff is off (the sequential fill must go into the cache).
fn dirty_cache(cache_bytes: u64, line_kib: u32, fill: Fill, core: VolumeRef) -> Cache {
    let ram = RamVolume::new("ram-cache", cache_bytes).expect("ram volume");
    ram.prefault();
    let cache = Cache::new(Arc::new(ram), wb(line_kib)).expect("cache");
    let mut c = cache.cleaning();
    c.policy = hybridcache_engine::CleaningPolicy::Nop;
    cache.set_cleaning(c).expect("nop");
    let id = cache.add_core(core, None).expect("core");
    cache
        .set_seq_cutoff(
            None,
            hybridcache_engine::SeqCutoff {
                policy: hybridcache_engine::SeqCutoffPolicy::Never,
                ..Default::default()
            },
        )
        .expect("seq cutoff");
    let handle = cache.core(id).expect("core handle");
    let line = line_kib as u64 * 1024;
    let n = cache_bytes * 85 / 100 / line;
    match fill {
        Fill::Seq => {
            let buf = vec![0x5au8; MIB as usize];
            let mut off = 0;
            while off < n * line {
                let len = (n * line - off).min(MIB);
                handle.write(&buf[..len as usize], off).expect("fill");
                off += len;
            }
        }
        Fill::Random => {
            // Distinct random lines of a region four times the cache: scattered dirty lines.
            let slots = n * 4;
            let mut order: Vec<u64> = (0..slots).collect();
            let mut rng = Rng(42);
            for i in (1..order.len()).rev() {
                order.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
            }
            let buf = vec![0xa5u8; line as usize];
            for &slot in &order[..n as usize] {
                handle.write(&buf, slot * line).expect("fill");
            }
        }
    }
    assert_eq!(cache.stats().usage.dirty_lines, n);
    cache
}

fn null_core() -> VolumeRef {
    Arc::new(NullVolume::new("null-core", 64 << 30).expect("null"))
}

/// Drain by `how`; returns (seconds, cleaning stats of the drain).
fn drain(cache: &Cache, how: &str) -> (f64, CleaningStats) {
    let before = cache.cleaning_stats();
    let secs = if how == "flush" {
        let t = Instant::now();
        cache.flush().expect("flush");
        t.elapsed().as_secs_f64()
    } else {
        let mut c: CleaningConfig = cache.cleaning();
        c.apply_preset(how).expect("preset");
        cache.set_cleaning(c).expect("set cleaning");
        // From the first core write to the last line cleaned (lines count as cleaned only
        // once their whole run is written; writes count one by one).
        let deadline = Instant::now() + Duration::from_secs(600);
        while cache.cleaning_stats().core_writes == before.core_writes {
            assert!(Instant::now() < deadline, "{how} never started");
            std::thread::sleep(Duration::from_micros(200));
        }
        let t = Instant::now();
        while cache.stats().usage.dirty_lines > 0 {
            assert!(Instant::now() < deadline, "{how} never finished");
            std::thread::sleep(Duration::from_micros(500));
        }
        t.elapsed().as_secs_f64()
    };
    let after = cache.cleaning_stats();
    let diff = CleaningStats {
        cleaned_lines: after.cleaned_lines - before.cleaned_lines,
        core_writes: after.core_writes - before.core_writes,
        core_write_bytes: after.core_write_bytes - before.core_write_bytes,
        write_sizes: std::array::from_fn(|i| after.write_sizes[i] - before.write_sizes[i]),
        max_in_flight: after.max_in_flight,
        ..CleaningStats::default()
    };
    (secs, diff)
}

fn bucket_name(i: usize) -> String {
    let size = |kib: u64| {
        if kib >= 1024 {
            format!("{}M", kib / 1024)
        } else {
            format!("{kib}K")
        }
    };
    if i == WRITE_SIZE_BUCKETS - 1 {
        format!(">{}", size(4 << (i - 1)))
    } else {
        format!("<={}", size(4 << i))
    }
}

fn main() {
    // `cargo bench` passes --bench; a test run (`cargo test --benches`) passes nothing useful.
    let cache_mib = env("HC_BENCH_CACHE_MIB", 1024);
    let cache_bytes = cache_mib * MIB;

    println!("## Cleaning throughput to a null core ({cache_mib} MiB RAM cache, 85% dirty)");
    println!(
        "{:<6} {:<7} {:<21} {:>9} {:>8} {:>9} {:>11} {:>10} {:>9}",
        "line",
        "fill",
        "drained by",
        "dirty MiB",
        "seconds",
        "MiB/s",
        "core writes",
        "avg KiB",
        "in flight"
    );
    let mut histograms = Vec::new();
    for line_kib in [4u32, 64] {
        for fill in [Fill::Seq, Fill::Random] {
            for how in ["flush", "acp-very-aggressive", "alru-very-aggressive"] {
                let cache = dirty_cache(cache_bytes, line_kib, fill, null_core());
                let dirty_mib = cache.stats().usage.dirty_lines * line_kib as u64 / 1024;
                let (secs, st) = drain(&cache, how);
                println!(
                    "{:<6} {:<7} {:<21} {:>9} {:>8.3} {:>9.0} {:>11} {:>10.1} {:>9}",
                    format!("{line_kib}K"),
                    fill.name(),
                    how,
                    dirty_mib,
                    secs,
                    dirty_mib as f64 / secs,
                    st.core_writes,
                    st.core_write_bytes as f64 / st.core_writes.max(1) as f64 / 1024.0,
                    st.max_in_flight,
                );
                if line_kib == 4 && how == "flush" {
                    histograms.push((fill, st));
                }
                cache.stop_background_cleaner();
            }
        }
    }

    println!();
    println!("## Size of cleaning's core writes, 4 KiB lines, flush (count per size bucket)");
    print!("{:<7}", "fill");
    for i in 0..WRITE_SIZE_BUCKETS {
        print!(" {:>8}", bucket_name(i));
    }
    println!();
    for (fill, st) in &histograms {
        print!("{:<7}", fill.name());
        for n in st.write_sizes {
            print!(" {n:>8}");
        }
        println!();
    }

    println!();
    println!("## Slow core (1 ms latency per request, null behind): 2000 scattered 4 KiB lines");
    println!(
        "{:<34} {:>8} {:>11} {:>9}",
        "cleaned by", "seconds", "core writes", "in flight"
    );
    let slow = |depth: Option<u32>| {
        let core: VolumeRef = Arc::new(ThrottledVolume::new(
            null_core(),
            ThrottleConfig {
                latency: Duration::from_millis(1),
                iops: None,
                bandwidth: None,
            },
        ));
        // 2000 dirty lines of 4 KiB scattered (85% of a 2353-line cache, random over 4x).
        let cache = dirty_cache(2353 * 4096, 4, Fill::Random, core);
        cache.stop_background_cleaner();
        let before = cache.cleaning_stats();
        let t = Instant::now();
        match depth {
            None => cache.flush().expect("flush"),
            Some(fmb) => {
                let mut c = cache.cleaning();
                c.apply_preset("alru-very-aggressive").expect("preset");
                c.alru.flush_max_buffers = fmb;
                cache.set_cleaning(c).expect("set");
                // Lines are a second old at the fake time 1000; each run cleans fmb of them.
                cache.cleaner_tick(0);
                while cache.stats().usage.dirty_lines > 0 {
                    cache.cleaner_tick(1000);
                }
            }
        }
        let secs = t.elapsed().as_secs_f64();
        let after = cache.cleaning_stats();
        let what = match depth {
            Some(1) => "alru, flush-max-buffers 1".to_string(),
            Some(n) => format!("alru, flush-max-buffers {n}"),
            None => "user flush".to_string(),
        };
        println!(
            "{:<34} {:>8.3} {:>11} {:>9}",
            what,
            secs,
            after.core_writes - before.core_writes,
            after.max_in_flight
        );
    };
    for depth in [Some(1), Some(8), Some(32), None] {
        slow(depth);
    }
}

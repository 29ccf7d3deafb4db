//! A load split over threads (`set_load_threads`) gives the same cache as a load on one thread:
//! the same lines mapped, clean and dirty, the same data read back, the same invariants; after
//! a clean stop and after a crash. One test function, so no other test of this binary changes
//! the thread count while it runs.

use std::sync::Arc;

use hybridcache_engine::{
    set_load_threads, Cache, CacheConfig, CacheMode, CleaningPolicy, LineSize, Usage, MAX_REQUEST,
};
use hybridcache_volume::{RamVolume, Volume, VolumeRef};

/// About 9,500 lines of 4 KiB: 200 metadata blocks, so every thread count below gets a range.
const CACHE_BYTES: u64 = 40 << 20;
/// Larger than the cache, so writes evict lines and move core lines between cache lines.
const CORE_BYTES: u64 = 64 << 20;
const SECTOR: u64 = 512;

fn copy_of(v: &dyn Volume) -> VolumeRef {
    let mut b = vec![0u8; v.size() as usize];
    v.read_at(&mut b, 0).unwrap();
    let out = RamVolume::new("cache-copy", v.size()).unwrap();
    out.write_at(&b, 0).unwrap();
    Arc::new(out)
}

/// Deterministic pseudo-random numbers (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// What a loaded cache shows: its usage and every byte of the core as read through it.
fn observe(cache: &Cache) -> (Usage, Vec<u8>) {
    cache.check_invariants();
    let usage = cache.stats().usage;
    let mut data = vec![0u8; CORE_BYTES as usize];
    let core = cache.core(1).unwrap();
    for (i, chunk) in data.chunks_mut(MAX_REQUEST as usize).enumerate() {
        core.read(chunk, i as u64 * MAX_REQUEST).unwrap();
    }
    (usage, data)
}

#[test]
fn every_thread_count_loads_the_same_cache() {
    let vol = Arc::new(RamVolume::new("cache", CACHE_BYTES).unwrap());
    let core: VolumeRef = Arc::new(RamVolume::new("core", CORE_BYTES).unwrap());
    let cache = Cache::create(
        vol.clone(),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        },
        false,
    )
    .unwrap();
    cache.stop_background_cleaner();
    let mut cleaning = cache.cleaning();
    cleaning.policy = CleaningPolicy::Nop;
    cache.set_cleaning(cleaning).unwrap();
    // With the cleaner stopped, lazy flush would leave every line dirty: cleaning inside the
    // writes gives the mix of clean and dirty lines a load must restore.
    cache
        .set_lazy_flush(hybridcache_engine::LazyFlush { enabled: false })
        .unwrap();
    cache.add_core(core.clone(), Some(1)).unwrap();
    let lines = cache.line_count();
    let handle = cache.core(1).unwrap();
    // The expected content of the core as clients see it.
    let mut model = vec![0u8; CORE_BYTES as usize];
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut buf = Vec::new();
    for round in 0..3u64 {
        for i in 0..5_000u64 {
            let sectors = 1 + rng.next() % 24;
            let first = rng.next() % (CORE_BYTES / SECTOR - sectors);
            buf.clear();
            buf.extend((0..sectors * SECTOR).map(|b| (b ^ i ^ round << 5 ^ first) as u8));
            handle.write(&buf, first * SECTOR).unwrap();
            let at = (first * SECTOR) as usize;
            model[at..at + buf.len()].copy_from_slice(&buf);
        }
        if round == 0 {
            // Clean lines too: the first round goes to the core.
            cache.flush().unwrap();
        } else {
            handle.flush().unwrap();
        }
    }
    drop(handle);
    let usage = cache.stats().usage;
    assert!(
        usage.dirty_lines > lines / 4 && usage.occupancy_lines > usage.dirty_lines,
        "the cache holds clean and dirty lines: {usage:?}"
    );
    cache.stop(false).unwrap();
    drop(cache);

    let stopped = copy_of(&*vol);
    let mut crashed = None;
    let mut first: Option<(Usage, Vec<u8>)> = None;
    for threads in [1, 2, 3, 7] {
        set_load_threads(threads);
        let dev = copy_of(&*stopped);
        let cache = Cache::load(dev.clone(), &mut |_| Some(core.clone())).unwrap();
        if threads == 1 {
            // A load marks the cache "not stopped cleanly" before it returns: the device now
            // holds what a crash leaves.
            crashed = Some(copy_of(&*dev));
        }
        let seen = observe(&cache);
        assert!(
            seen.1 == model,
            "{threads} threads: data differs from what was written"
        );
        match &first {
            None => first = Some(seen),
            Some(f) => assert_eq!(
                f.0, seen.0,
                "{threads} threads: usage differs from 1 thread"
            ),
        }
    }
    let crashed = crashed.unwrap();
    let mut first: Option<Usage> = None;
    for threads in [1, 2, 3, 7] {
        set_load_threads(threads);
        let cache = Cache::load(copy_of(&*crashed), &mut |_| Some(core.clone())).unwrap();
        let seen = observe(&cache);
        assert!(
            seen.1 == model,
            "{threads} threads after a crash: data differs"
        );
        match &first {
            None => first = Some(seen.0),
            Some(f) => assert_eq!(*f, seen.0, "{threads} threads after a crash: usage differs"),
        }
    }
    set_load_threads(0);
}

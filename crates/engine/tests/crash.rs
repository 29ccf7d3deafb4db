//! Power-cut simulation: thousands of crash points, each checked against the durability contract.
//!
//! Both the cache volume and the core are `CrashVolume`s: writes since their last flush are
//! volatile. A shared budget of volume operations picks the crash point: once it runs out the
//! devices are "dead" (writes and flushes silently vanish), the operation in progress finishes
//! against dead devices, then each device loses an arbitrary subset of its volatile writes and
//! tears some. The cache is loaded from what is left and every sector must hold either its
//! content as of the last completed flush or content written after it; never older data, never
//! another sector's data, never garbage.
//!
//! `HC_CRASH_POINTS` sets the number of crash points (default 10000); a failure prints the seed,
//! and `HC_CRASH_SEED` replays one.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use hybridcache_engine::{
    Cache, CacheConfig, CacheMode, Core, LazyFlush, LineSize, Offload, Prefetch, PrefetchPolicy,
};
use hybridcache_volume::{CrashVolume, RamVolume, Volume, VolumeRef};

mod durability;
use durability::{decode, fill, power_cut, Model, Mortal, Rng, SECTOR};

struct Rig {
    cache_media: Arc<CrashVolume>,
    core_media: Arc<CrashVolume>,
    budget: Arc<AtomicI64>,
}

impl Rig {
    fn mortal(&self, v: &Arc<CrashVolume>) -> VolumeRef {
        Arc::new(Mortal {
            inner: v.clone(),
            budget: self.budget.clone(),
        })
    }
}

fn check_all(core: &Core, model: &Model, seed: u64, when: &str) {
    let size = core.size();
    let mut buf = vec![0u8; size as usize];
    core.read(&mut buf, 0)
        .unwrap_or_else(|e| panic!("seed {seed}: read after {when}: {e}"));
    model.check(&buf, &format!("seed {seed}: after {when}"));
}

/// One crash point. Returns the number of operations run before the crash.
fn crash_round(seed: u64) -> usize {
    let mut rng = Rng(seed);
    let line_kib = LineSize::ALL_KIB[rng.below(5) as usize];
    let line = line_kib as u64 * 1024;
    // Data starts at 3 MiB for a small volume; a handful of lines forces eviction and cleaning.
    let cache_lines = [2, 4, 16][rng.below(3) as usize];
    let core_bytes = [256 << 10, 1 << 20][rng.below(2) as usize] + 7 * 512;
    let rig = Rig {
        cache_media: Arc::new(CrashVolume::new(Arc::new(
            RamVolume::new("cache", (3 << 20) + cache_lines * line).unwrap(),
        ))),
        core_media: Arc::new(CrashVolume::new(Arc::new(
            RamVolume::new("core", core_bytes).unwrap(),
        ))),
        budget: Arc::new(AtomicI64::new(i64::MAX)),
    };
    let mode = CacheMode::ALL[rng.below(6) as usize];
    let cache = Cache::create(
        rig.mortal(&rig.cache_media),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(line_kib).unwrap(),
            mode,
        },
        false,
    )
    .unwrap();
    let core_vol = rig.mortal(&rig.core_media);
    let id = cache.add_core(core_vol, None).unwrap();
    let core = cache.core(id).unwrap();
    // Offload is on in some rounds, with threshold 0: one thread never builds a queue, so it
    // routes its share of clean hits and write misses to the core whatever the depths.
    if rng.below(2) == 0 {
        let share_pct = 1 + rng.below(100) as u32;
        cache
            .set_offload(Offload {
                enabled: true,
                share_pct,
                threshold: 0,
            })
            .unwrap();
    }
    // Lazy flush and read-ahead are on in some rounds; cleaning (lazy flush's room) and read-ahead
    // run only when an op says so, on this thread, so a seed replays the same crash.
    cache.stop_background_cleaner();
    cache.stop_background_prefetch();
    if rng.below(2) == 0 {
        cache.set_lazy_flush(LazyFlush { enabled: true }).unwrap();
    }
    if rng.below(2) == 0 {
        let p = Prefetch {
            policy: PrefetchPolicy::Readahead,
            threshold_kib: 1 + rng.below(8) as u32,
            distance_kib: 4 + rng.below(61) as u32,
            max_in_flight: 1 + rng.below(3) as u32,
        };
        cache.set_prefetch(p).unwrap();
    }
    let mut now_ms = 0u64;
    let mut read_end = 0u64;
    let sectors = core_bytes / 512;
    let mut model = Model::new(sectors as usize);
    // Everything so far is durable (create and add_core flush); now pick the crash point.
    rig.cache_media.flush().unwrap();
    rig.core_media.flush().unwrap();
    rig.budget.store(rng.below(300) as i64, Ordering::SeqCst);

    let mut ops = 0;
    let mut stamp = 0u32;
    for _ in 0..80 {
        if rig.budget.load(Ordering::SeqCst) <= 0 {
            break;
        }
        ops += 1;
        // Small region so lines are reused, evicted and cleaned.
        let region = sectors.min(64 * 8);
        let (first, count) = if rng.below(3) == 0 {
            // Whole, aligned lines: a write-through or write-invalidate write then covers every
            // dirty sector of a line, the way lines become clean outside the cleaner.
            let per_line = line / 512;
            let first = rng.below(region / per_line) * per_line;
            (first, (per_line * (1 + rng.below(2))).min(sectors - first))
        } else {
            let first = rng.below(region);
            (first, (1 + rng.below(24)).min(sectors - first))
        };
        let dead_before = rig.budget.load(Ordering::SeqCst) <= 0;
        let r = rng.below(112);
        let (first, count) = if r >= 106 {
            // A read continuing the previous one: read-ahead's streams.
            let first = if read_end + count <= sectors {
                read_end
            } else {
                0
            };
            (first, count)
        } else {
            (first, count)
        };
        let durable_point = match r {
            0..=49 => {
                stamp += 1;
                let mut buf = vec![0u8; (count * 512) as usize];
                fill(&mut buf, stamp, first);
                let fua = rng.below(10) == 0;
                if fua {
                    core.write_fua(&buf, first * 512).unwrap();
                } else {
                    core.write(&buf, first * 512).unwrap();
                }
                model.write(first, count, stamp);
                fua
            }
            50..=64 | 106..=111 => {
                read_end = first + count;
                let mut buf = vec![0u8; (count * 512) as usize];
                core.read(&mut buf, first * 512).unwrap();
                if rig.budget.load(Ordering::SeqCst) > 0 {
                    for (i, s) in buf.chunks(SECTOR).enumerate() {
                        let sec = first as usize + i;
                        assert_eq!(
                            decode(s, sec as u64),
                            Some(model.latest[sec]),
                            "seed {seed}: live read of sector {sec}"
                        );
                    }
                }
                false
            }
            65..=69 => {
                core.discard(first * 512, count * 512).unwrap();
                model.write(first, count, 0);
                false
            }
            70..=74 => {
                core.write_zeroes(first * 512, count * 512).unwrap();
                model.write(first, count, 0);
                false
            }
            75..=84 => {
                core.flush().unwrap();
                true
            }
            85..=87 => {
                cache.flush().unwrap();
                true
            }
            88..=97 => {
                let next = CacheMode::ALL[rng.below(6) as usize];
                let flush_first = rng.below(2) == 0;
                cache.set_mode(next, flush_first).unwrap();
                flush_first && !next.makes_dirty()
            }
            98 => {
                cache.flush_core(id).unwrap();
                true
            }
            99 => {
                // Flush, then invalidate: a crash anywhere in it loses nothing and keeps the
                // core (the load below finds it by id).
                cache.purge(Some(id)).unwrap();
                true
            }
            100..=102 => {
                // The cleaner: the policy's run and lazy flush's room.
                now_ms += rng.below(2500);
                cache.cleaner_tick(now_ms);
                false
            }
            103..=104 => {
                cache.run_prefetch();
                false
            }
            _ => {
                if rng.below(2) == 0 {
                    let on = !cache.lazy_flush().enabled;
                    cache.set_lazy_flush(LazyFlush { enabled: on }).unwrap();
                } else {
                    let mut o = cache.offload();
                    o.enabled = !o.enabled;
                    o.threshold = 0;
                    cache.set_offload(o).unwrap();
                }
                false
            }
        };
        // A durability point counts only if the devices were alive through all of it.
        if durable_point && !dead_before && rig.budget.load(Ordering::SeqCst) > 0 {
            model.flushed();
        }
    }
    drop(core);
    // Power cut: each device keeps an arbitrary part of what it had not flushed.
    power_cut(&rig.budget);
    drop(cache);
    rig.cache_media.crash(rng.next_u64()).unwrap();
    rig.core_media.crash(rng.next_u64()).unwrap();

    let core_media = rig.core_media.clone();
    let cache = Cache::load(rig.cache_media.clone(), &mut |_| {
        Some(core_media.clone() as VolumeRef)
    })
    .unwrap_or_else(|e| panic!("seed {seed}: load after crash failed: {e}"));
    cache.check_invariants();
    let core = cache.core(id).unwrap();
    check_all(&core, &model, seed, "crash recovery");

    // What was read is now the content; a clean stop keeping dirty data and a load must give it
    // back exactly.
    let mut buf = vec![0u8; core_bytes as usize];
    core.read(&mut buf, 0).unwrap();
    cache.stop(rng.below(2) == 0).unwrap();
    drop(core);
    drop(cache);
    let core_media = rig.core_media.clone();
    let cache = Cache::load(rig.cache_media.clone(), &mut |_| {
        Some(core_media.clone() as VolumeRef)
    })
    .unwrap_or_else(|e| panic!("seed {seed}: load after clean stop failed: {e}"));
    cache.check_invariants();
    let mut again = vec![0u8; core_bytes as usize];
    cache.core(id).unwrap().read(&mut again, 0).unwrap();
    assert!(
        again == buf,
        "seed {seed}: content changed across a clean stop and load"
    );
    ops
}

#[test]
fn power_cuts_never_lose_flushed_writes_or_serve_wrong_data() {
    if let Ok(seed) = std::env::var("HC_CRASH_SEED") {
        crash_round(seed.parse().expect("HC_CRASH_SEED is a number"));
        return;
    }
    let points: u64 = std::env::var("HC_CRASH_POINTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let base = 0x5eed_0000u64;
    let mut ops = 0;
    for i in 0..points {
        ops += crash_round(base + i);
    }
    println!("{points} crash points, {ops} operations before the crashes");
}

/// Writes `lines` whole 4 KiB lines of `stamp`-tagged data starting at line `first`.
fn write_lines(core: &Core, first: u64, lines: u64, stamp: u32) {
    let mut buf = vec![0u8; (lines * 4096) as usize];
    fill(&mut buf, stamp, first * 8);
    core.write(&buf, first * 4096).unwrap();
}

/// A cache whose metadata on the device says line L holds core line 0 dirty, while in RAM that
/// line has been made reusable; then the process dies (every write reached the device, nothing
/// more was committed). Loading must not serve another core line's data as core line 0's.
fn reuse_before_commit(make_reusable: impl Fn(&Cache, &Core)) {
    let cache_media = Arc::new(RamVolume::new("cache", (3 << 20) + 4 * 4096).unwrap());
    let core_media = Arc::new(RamVolume::new("core", 1 << 20).unwrap());
    let cache = Cache::create(
        cache_media.clone(),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        },
        false,
    )
    .unwrap();
    let id = cache.add_core(core_media.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    write_lines(&core, 0, 1, 1);
    core.flush().unwrap();
    make_reusable(&cache, &core);
    // Four more lines fill the 4-line cache: the fourth needs line 0's cache line, and none of
    // them triggers cleaning (whose commit would record the reuse).
    for i in 1..5 {
        write_lines(&core, i, 1, 100 + i as u32);
    }
    eprintln!(
        "before kill: {:?} {:?}",
        cache.stats().usage,
        cache.stats().requests
    );
    drop(core);
    drop(cache); // kill -9: no stop, no commit
    let cache = Cache::load(cache_media, &mut |_| Some(core_media.clone() as VolumeRef)).unwrap();
    let mut buf = vec![0u8; 4096];
    eprintln!("loaded: {:?}", cache.stats().usage);
    cache.core(id).unwrap().read(&mut buf, 0).unwrap();
    eprintln!(
        "stamps: {:?}",
        buf.chunks(512)
            .enumerate()
            .map(|(i, s)| decode(s, i as u64))
            .collect::<Vec<_>>()
    );
    for (i, s) in buf.chunks(SECTOR).enumerate() {
        let got = decode(s, i as u64);
        assert!(
            matches!(got, Some(0) | Some(1) | Some(2)),
            "sector {i} of core line 0 holds {got:?}: another line's data"
        );
    }
}

#[test]
fn a_line_cleaned_by_write_through_is_not_reused_before_the_device_knows() {
    reuse_before_commit(|cache, core| {
        cache.set_mode(CacheMode::Wt, false).unwrap();
        // Covers every dirty sector: the line is clean in RAM, still dirty on the device.
        write_lines(core, 0, 1, 2);
    });
}

#[test]
fn a_dirty_line_dropped_by_discard_is_not_reused_before_the_device_knows() {
    reuse_before_commit(|_, core| core.discard(0, 4096).unwrap());
}

/// A crash at every volume operation of a core removal: the cache always loads, the other
/// core's flushed data is intact, and the removed core is either still there with its data or
/// gone.
#[test]
fn crash_at_every_step_of_a_core_removal() {
    for crash_at in 0..40 {
        let budget = Arc::new(AtomicI64::new(i64::MAX));
        let cache_media = Arc::new(CrashVolume::new(Arc::new(
            RamVolume::new("cache", (3 << 20) + (64 << 10)).unwrap(),
        )));
        let cores: Vec<Arc<CrashVolume>> = (0..2)
            .map(|i| {
                Arc::new(CrashVolume::new(Arc::new(
                    RamVolume::new(&format!("core{i}"), 256 << 10).unwrap(),
                )))
            })
            .collect();
        let rig = Rig {
            cache_media: cache_media.clone(),
            core_media: cores[0].clone(),
            budget: budget.clone(),
        };
        let cache = Cache::create(
            rig.mortal(&cache_media),
            CacheConfig {
                id: 1,
                line_size: LineSize::from_kib(4).unwrap(),
                mode: CacheMode::Wb,
            },
            false,
        )
        .unwrap();
        for c in &cores {
            cache.add_core(rig.mortal(c), None).unwrap();
        }
        for (id, stamp) in [(1u16, 11u32), (2, 22)] {
            let mut buf = vec![0u8; 16 * 512];
            fill(&mut buf, stamp, 0);
            cache.core(id).unwrap().write(&buf, 0).unwrap();
        }
        cache.flush_core(2).unwrap();
        cache.core(1).unwrap().flush().unwrap();
        budget.store(crash_at, Ordering::SeqCst);
        let _ = cache.remove_core(2, false);
        power_cut(&budget);
        drop(cache);
        cache_media.crash(crash_at as u64).unwrap();
        for c in &cores {
            c.crash(crash_at as u64 + 1).unwrap();
        }
        let cache = Cache::load(cache_media.clone(), &mut |rec| {
            Some(cores[rec.id as usize - 1].clone() as VolumeRef)
        })
        .unwrap_or_else(|e| panic!("crash at {crash_at}: load failed: {e}"));
        cache.check_invariants();
        for core in cache.cores() {
            let stamp = if core.id == 1 { 11 } else { 22 };
            let mut buf = vec![0u8; 16 * 512];
            cache.core(core.id).unwrap().read(&mut buf, 0).unwrap();
            for (i, s) in buf.chunks(SECTOR).enumerate() {
                assert_eq!(
                    decode(s, i as u64),
                    Some(stamp),
                    "crash at {crash_at}: core {} sector {i}",
                    core.id
                );
            }
        }
        assert!(
            cache.cores().iter().any(|c| c.id == 1),
            "crash at {crash_at}: core 1 lost"
        );
    }
}

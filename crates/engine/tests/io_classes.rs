//! IO classes applied by the engine: allocation 0 is never cached, a class at its allocation
//! replaces its own lines, pinned lines survive other classes' pressure, eviction priority
//! orders eviction, per-class statistics, and the table survives a stop and load.

mod common;

use common::*;
use hybridcache_engine::ioclass::{IoClasses, LoadOptions};
use hybridcache_engine::{Cache, CacheConfig, CacheMode, LineSize};

fn classes(csv: &str) -> IoClasses {
    IoClasses::parse(csv, &LoadOptions::default()).expect("valid class file")
}

const HEADER: &str = "IO class id,IO class name,Eviction priority,Allocation\n";

#[test]
fn allocation_zero_is_never_cached_and_counted_as_pass_through() {
    let (cache, _) = new_cache(4, 64, CacheMode::Wb);
    let c = add_core(&cache, 1 << 20);
    // Requests of 64 KiB or more are class 1, never cached.
    cache
        .load_io_classes(classes(&format!(
            "{HEADER}0,unclassified,22,1\n1,request_size:ge:65536,1,0\n"
        )))
        .unwrap();
    let big = stamped(65536, 1, 0);
    c.core.write(&big, 0).unwrap();
    assert_eq!(
        read_vol(&*c.vol, 0, 65536),
        big,
        "written through to the core"
    );
    assert_eq!(cache.stats().usage.occupancy_lines, 0);
    let small = stamped(4096, 2, 256);
    c.core.write(&small, 131072).unwrap();
    assert_eq!(cache.stats().usage.occupancy_lines, 1);
    let s1 = cache.io_class_stats(1).unwrap();
    assert_eq!(s1.requests.pass_through_writes, 1);
    assert_eq!(s1.usage.occupancy_lines, 0);
    let s0 = cache.io_class_stats(0).unwrap();
    assert_eq!(s0.requests.write_full_misses, 1);
    assert_eq!((s0.usage.occupancy_lines, s0.usage.dirty_lines), (1, 1));
    let mut buf = vec![0; 65536];
    c.core.read(&mut buf, 0).unwrap();
    assert_eq!(buf, big);
    assert_eq!(
        cache.io_class_stats(1).unwrap().requests.pass_through_reads,
        1
    );
    assert!(cache.io_class_stats(2).is_err());
    cache.check_invariants();
}

#[test]
fn a_class_at_its_allocation_replaces_its_own_lines() {
    let (cache, _) = new_cache(4, 100, CacheMode::Wt);
    let c = add_core(&cache, 8 << 20);
    // LBA (sector) 8192 and up = the second 4 MiB: class 1, at most 20% of the cache.
    cache
        .load_io_classes(classes(&format!(
            "{HEADER}0,unclassified,22,1\n1,lba:ge:8192,5,0.2\n"
        )))
        .unwrap();
    let mut buf = vec![0; 4096];
    for i in 0..60u64 {
        c.core.read(&mut buf, (4 << 20) + i * 4096).unwrap();
        assert!(cache.io_class_stats(1).unwrap().usage.occupancy_lines <= 20);
    }
    assert_eq!(cache.io_class_stats(1).unwrap().usage.occupancy_lines, 20);
    // The rest of the cache is still free for class 0.
    for i in 0..70u64 {
        c.core.read(&mut buf, i * 4096).unwrap();
    }
    assert_eq!(cache.io_class_stats(0).unwrap().usage.occupancy_lines, 70);
    cache.check_invariants();
}

#[test]
fn pinned_lines_survive_other_classes_and_priority_orders_eviction() {
    let (cache, _) = new_cache(4, 64, CacheMode::Wt);
    let c = add_core(&cache, 8 << 20);
    // Class 1 (first MiB) pinned; class 2 (second MiB) evicted first (255); class 0 in between.
    cache
        .load_io_classes(classes(&format!(
            "{HEADER}0,unclassified,100,1\n1,lba:lt:2048,,1\n2,lba:ge:2048&lba:lt:4096,255,1\n"
        )))
        .unwrap();
    let mut buf = vec![0; 4096];
    for i in 0..16u64 {
        c.core.read(&mut buf, i * 4096).unwrap(); // class 1, pinned
        c.core.read(&mut buf, (1 << 20) + i * 4096).unwrap(); // class 2
    }
    // Class 0 streams through the rest of the cache and keeps going.
    for i in 0..200u64 {
        c.core.read(&mut buf, (4 << 20) + i * 4096).unwrap();
    }
    let pinned = cache.io_class_stats(1).unwrap().usage.occupancy_lines;
    let low = cache.io_class_stats(2).unwrap().usage.occupancy_lines;
    assert_eq!(pinned, 16, "pinned lines were evicted");
    assert_eq!(low, 0, "priority 255 lines should go before class 0's");
    cache.check_invariants();
}

#[test]
fn io_classes_survive_stop_and_load() {
    let vol = ram("ram:cache", 64 << 20);
    let core = ram("ram:core", 16 << 20);
    let config = CacheConfig {
        id: 3,
        line_size: LineSize::from_kib(4).unwrap(),
        mode: CacheMode::Wb,
    };
    let cache = Cache::create(as_ref(&vol), config, false).unwrap();
    cache.add_core(as_ref(&core), Some(1)).unwrap();
    let table = classes(&format!(
        "{HEADER}0,unclassified,22,1\n1,request_size:le:4096&done,1,0.5\n2,core_id:eq:1|io_direction:write,,0.70\n"
    ));
    cache.load_io_classes(table.clone()).unwrap();
    cache.stop(true).unwrap();
    drop(cache);
    let loaded = Cache::load(as_ref(&vol), &mut |_| Some(as_ref(&core))).unwrap();
    assert_eq!(*loaded.io_classes(), table);
    loaded.stop(true).unwrap();
}

#[test]
fn a_class_load_that_cannot_be_recorded_changes_nothing() {
    use hybridcache_volume::{FaultConfig, FaultyVolume};
    use std::sync::Arc;
    let cache_vol = Arc::new(FaultyVolume::new(as_ref(&ram("ram:cache", 64 << 20))));
    let config = CacheConfig {
        id: 1,
        line_size: LineSize::from_kib(4).unwrap(),
        mode: CacheMode::Wb,
    };
    let cache = Cache::create(cache_vol.clone(), config, false).unwrap();
    let first = classes(&format!(
        "{HEADER}0,unclassified,22,1\n1,request_size:ge:65536,1,0\n"
    ));
    let second = classes(&format!("{HEADER}0,unclassified,9,1\n"));
    for (before, next) in [(IoClasses::default(), first.clone()), (first, second)] {
        cache_vol.set_config(FaultConfig {
            fail_next_writes: 2,
            ..FaultConfig::default()
        });
        assert!(cache.load_io_classes(next.clone()).is_err());
        assert_eq!(*cache.io_classes(), before, "the refused table stays out");
        cache_vol.set_config(FaultConfig::default());
        cache.load_io_classes(next).unwrap();
    }
}

/// Class 33 (casadm's highest id since OCF's prefetch class) counts lines and requests like any
/// other, and a table holding it survives a stop and load; a table without it (what builds whose
/// limit was 32 saved) loads as before.
#[test]
fn class_33_is_counted_and_survives_stop_and_load() {
    let vol = ram("ram:cache", 64 << 20);
    let core = ram("ram:core", 16 << 20);
    let config = CacheConfig {
        id: 4,
        line_size: LineSize::from_kib(4).unwrap(),
        mode: CacheMode::Wb,
    };
    let cache = Cache::create(as_ref(&vol), config, false).unwrap();
    let c = cache.add_core(as_ref(&core), Some(1)).unwrap();
    let old = classes(&format!(
        "{HEADER}0,unclassified,22,1\n32,request_size:le:4096,1,1\n"
    ));
    cache.load_io_classes(old.clone()).unwrap();
    cache.stop(true).unwrap();
    drop((c, cache));
    let cache = Cache::load(as_ref(&vol), &mut |_| Some(as_ref(&core))).unwrap();
    assert_eq!(*cache.io_classes(), old);

    let table = classes(&format!(
        "{HEADER}0,unclassified,22,1\n32,request_size:le:4096,1,1\n33,request_size:gt:4096,2,0.50\n"
    ));
    cache.load_io_classes(table.clone()).unwrap();
    let c = cache.core(1).unwrap();
    c.write(&stamped(8192, 1, 0), 0).unwrap();
    let s33 = cache.io_class_stats(33).unwrap();
    assert_eq!(s33.usage.occupancy_lines, 2);
    assert_eq!(s33.requests.write_full_misses, 1);
    assert!(cache.io_class_stats(34).is_err());
    cache.check_invariants();
    cache.stop(true).unwrap();
    drop((c, cache));
    let loaded = Cache::load(as_ref(&vol), &mut |_| Some(as_ref(&core))).unwrap();
    assert_eq!(*loaded.io_classes(), table);
    // Which class each line was in is not saved: after a load the lines count as class 0.
    assert!(loaded.io_class_stats(33).is_ok());
    loaded.stop(true).unwrap();
}

/// The cleaner's writes are counted on the class of the lines they clean: one request for each
/// class a write touches, the blocks of each line on its own class; `-Z` resets them.
#[test]
fn cleaner_writes_are_counted_on_their_lines_classes() {
    let (cache, _) = new_cache(4, 64, CacheMode::Wb);
    let c = add_core(&cache, 1 << 20);
    // Sector 16 and up (8 KiB): class 1.
    cache
        .load_io_classes(classes(&format!(
            "{HEADER}0,unclassified,22,1\n1,lba:ge:16,1,1\n"
        )))
        .unwrap();
    // Two neighbouring lines of class 0 (one cleaner write), one line of class 1 apart.
    c.core.write(&stamped(8192, 1, 0), 0).unwrap();
    c.core.write(&stamped(4096, 2, 256), 131072).unwrap();
    cache.flush().unwrap();
    let s0 = cache.io_class_stats(0).unwrap();
    let s1 = cache.io_class_stats(1).unwrap();
    assert_eq!(s0.requests.cleaner_requests, 1, "{s0:?}");
    assert_eq!(s0.blocks.cleaner_core_written_bytes, 8192);
    assert_eq!(s0.blocks.cleaner_cache_read_bytes, 8192);
    assert_eq!(s1.requests.cleaner_requests, 1, "{s1:?}");
    assert_eq!(s1.blocks.cleaner_core_written_bytes, 4096);
    cache.reset_stats();
    assert_eq!(
        cache.io_class_stats(0).unwrap().requests.cleaner_requests,
        0
    );
}

/// The sum of every attached core's share of a class, to compare with the cache-wide figures.
fn sum_over_cores(cache: &Cache, cores: &[u16], class: u8) -> hybridcache_engine::Stats {
    let mut sum = cache.core_io_class_stats(cores[0], class).unwrap();
    for &id in &cores[1..] {
        let s = cache.core_io_class_stats(id, class).unwrap();
        sum.usage.occupancy_lines += s.usage.occupancy_lines;
        sum.usage.dirty_lines += s.usage.dirty_lines;
        let (r, b, e) = (&mut sum.requests, &mut sum.blocks, &mut sum.errors);
        r.read_hits += s.requests.read_hits;
        r.read_full_misses += s.requests.read_full_misses;
        r.read_partial_misses += s.requests.read_partial_misses;
        r.write_hits += s.requests.write_hits;
        r.write_full_misses += s.requests.write_full_misses;
        r.write_partial_misses += s.requests.write_partial_misses;
        r.pass_through_reads += s.requests.pass_through_reads;
        r.pass_through_writes += s.requests.pass_through_writes;
        r.cleaner_requests += s.requests.cleaner_requests;
        b.exported_read_bytes += s.blocks.exported_read_bytes;
        b.exported_written_bytes += s.blocks.exported_written_bytes;
        b.cleaner_cache_read_bytes += s.blocks.cleaner_cache_read_bytes;
        b.cleaner_core_written_bytes += s.blocks.cleaner_core_written_bytes;
        e.core_read += s.errors.core_read;
    }
    sum
}

fn assert_sum_is_cache_wide(cache: &Cache, cores: &[u16], class: u8) {
    assert_eq!(
        sum_over_cores(cache, cores, class),
        cache.io_class_stats(class).unwrap(),
        "class {class}: the cache-wide figures are not the sum over cores"
    );
}

/// `-P -j CORE -d CLASS`: each core's lines and requests of a class, which add up to the
/// cache-wide class figures; `-Z -j` resets one core's share only.
#[test]
fn class_statistics_per_core_add_up_to_the_cache_wide() {
    let (cache, _) = new_cache(4, 64, CacheMode::Wb);
    let a = add_core(&cache, 1 << 20);
    let b = add_core(&cache, 1 << 20);
    let (ia, ib) = (a.id, b.id);
    // Requests over 4 KiB: class 1.
    cache
        .load_io_classes(classes(&format!(
            "{HEADER}0,unclassified,22,1\n1,request_size:gt:4096,1,1\n"
        )))
        .unwrap();
    a.core.write(&stamped(4096, 1, 0), 0).unwrap();
    a.core.write(&stamped(8192, 2, 64), 32768).unwrap();
    b.core.write(&stamped(8192, 3, 0), 0).unwrap();
    b.core.write(&stamped(8192, 4, 64), 32768).unwrap();
    let mut buf = vec![0; 4096];
    b.core.read(&mut buf, 65536).unwrap();

    let lines = |core, class| {
        let s = cache.core_io_class_stats(core, class).unwrap();
        (s.usage.occupancy_lines, s.usage.dirty_lines)
    };
    assert_eq!(lines(ia, 0), (1, 1));
    assert_eq!(lines(ia, 1), (2, 2));
    assert_eq!(lines(ib, 0), (1, 0));
    assert_eq!(lines(ib, 1), (4, 4));
    let req = |core, class| cache.core_io_class_stats(core, class).unwrap().requests;
    assert_eq!(req(ia, 0).write_full_misses, 1);
    assert_eq!(req(ia, 1).write_full_misses, 1);
    assert_eq!(req(ib, 0).write_full_misses, 0);
    assert_eq!(req(ib, 0).read_full_misses, 1);
    assert_eq!(req(ib, 1).write_full_misses, 2);
    let blocks = cache.core_io_class_stats(ib, 1).unwrap().blocks;
    assert_eq!(blocks.exported_written_bytes, 16384);
    for class in [0, 1] {
        assert_sum_is_cache_wide(&cache, &[ia, ib], class);
    }
    assert!(
        cache.core_io_class_stats(ia, 2).is_err(),
        "class 2 is not configured"
    );
    assert!(cache.core_io_class_stats(99, 0).is_err(), "no core 99");

    // A read hit on core a, then cleaning: dirty lines leave every core's gauges.
    a.core.read(&mut buf, 0).unwrap();
    assert_eq!(req(ia, 0).read_hits, 1);
    cache.flush().unwrap();
    assert_eq!(lines(ia, 1), (2, 0));
    assert_eq!(lines(ib, 1), (4, 0));
    assert_eq!(req(ib, 1).cleaner_requests, 2);
    for class in [0, 1] {
        assert_sum_is_cache_wide(&cache, &[ia, ib], class);
    }

    // -Z -j a: a's counters only; its lines are state, not statistics.
    cache.reset_core_stats(ia).unwrap();
    assert_eq!(req(ia, 0), Default::default());
    assert_eq!(req(ia, 1), Default::default());
    assert_eq!(lines(ia, 1), (2, 0));
    assert_eq!(req(ib, 1).write_full_misses, 2);
    for class in [0, 1] {
        assert_sum_is_cache_wide(&cache, &[ia, ib], class);
    }
    // -Z: every core's.
    cache.reset_stats();
    assert_eq!(req(ib, 1), Default::default());
    assert_eq!(
        cache.io_class_stats(1).unwrap().requests,
        Default::default()
    );
    cache.check_invariants();
}

/// Which class a line was in is not saved, so a load counts every line in class 0: in the
/// cache-wide gauges and in each core's, an inactive core's included ("Inactive usage").
#[test]
fn per_core_class_gauges_are_rebuilt_at_load_and_inactive_lines_counted() {
    let vol = ram("ram:cache", 64 << 20);
    let core_a = ram("ram:core-a", 16 << 20);
    let core_b = ram("ram:core-b", 16 << 20);
    let config = CacheConfig {
        id: 5,
        line_size: LineSize::from_kib(4).unwrap(),
        mode: CacheMode::Wb,
    };
    let cache = Cache::create(as_ref(&vol), config, false).unwrap();
    cache.add_core(as_ref(&core_a), Some(1)).unwrap();
    cache.add_core(as_ref(&core_b), Some(2)).unwrap();
    let (a, b) = (cache.core(1).unwrap(), cache.core(2).unwrap());
    cache
        .load_io_classes(classes(&format!(
            "{HEADER}0,unclassified,22,1\n1,request_size:gt:4096,1,1\n"
        )))
        .unwrap();
    a.write(&stamped(8192, 1, 0), 0).unwrap();
    a.write(&stamped(4096, 2, 64), 32768).unwrap();
    b.write(&stamped(12288, 3, 0), 0).unwrap();
    let mut buf = vec![0; 4096];
    b.read(&mut buf, 65536).unwrap();
    assert!(cache.inactive_usage().is_none(), "every core is attached");
    // Dirty data stays in the cache for the load.
    cache.stop(false).unwrap();
    drop((a, b, cache));

    let loaded = Cache::load(as_ref(&vol), &mut |r| match r.id {
        1 => Some(as_ref(&core_a)),
        2 => Some(as_ref(&core_b)),
        _ => None,
    })
    .unwrap();
    let lines = |cache: &Cache, core, class| {
        let s = cache.core_io_class_stats(core, class).unwrap();
        (s.usage.occupancy_lines, s.usage.dirty_lines)
    };
    assert_eq!(lines(&loaded, 1, 0), (3, 3));
    assert_eq!(lines(&loaded, 2, 0), (4, 3));
    assert_eq!(lines(&loaded, 1, 1), (0, 0));
    assert_eq!(lines(&loaded, 2, 1), (0, 0));
    for class in [0, 1] {
        assert_sum_is_cache_wide(&loaded, &[1, 2], class);
    }
    // New requests count from here, per core.
    loaded
        .core(2)
        .unwrap()
        .write(&stamped(8192, 4, 256), 131072)
        .unwrap();
    assert_eq!(lines(&loaded, 2, 1), (2, 2));
    assert_sum_is_cache_wide(&loaded, &[1, 2], 1);
    loaded.stop(false).unwrap();
    drop(loaded);

    // Core 2's device is missing: its lines are the inactive usage, and stay in class 0's
    // cache-wide gauges.
    let partial = Cache::load(as_ref(&vol), &mut |r| (r.id == 1).then(|| as_ref(&core_a))).unwrap();
    let inactive = partial.inactive_usage().expect("core 2 is inactive");
    assert_eq!((inactive.occupancy_lines, inactive.dirty_lines), (6, 5));
    assert_eq!(inactive.total_lines, partial.stats().usage.total_lines);
    assert_eq!(inactive.clean_lines(), 1);
    assert!(
        partial.core_io_class_stats(2, 0).is_err(),
        "core 2 is inactive"
    );
    let all = partial.io_class_stats(0).unwrap().usage;
    assert_eq!((all.occupancy_lines, all.dirty_lines), (3 + 6, 3 + 5));
    assert_eq!(lines(&partial, 1, 0), (3, 3));
    partial.stop(false).unwrap();
}

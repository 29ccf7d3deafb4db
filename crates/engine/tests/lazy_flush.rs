//! Lazy flush: a write-back write that finds no free or clean line goes to the core instead of
//! cleaning inside the request, any cached copy stays exact, background cleaning makes room
//! (under nop too), and the switch and its statistics behave as documented.

mod common;

use common::*;
use hybridcache_engine::{Cache, CacheConfig, CacheMode, CleaningPolicy, LazyFlush, LineSize};

const KIB: u64 = 1024;

/// A write-back cache of `lines` 4 KiB lines under nop cleaning with the background cleaner
/// stopped, so only the test's ticks clean.
fn quiet_cache(lines: u64) -> (Cache, TestCore) {
    let (cache, _vol) = new_cache(4, lines, CacheMode::Wb);
    cache.stop_background_cleaner();
    let mut cfg = cache.cleaning();
    cfg.policy = CleaningPolicy::Nop;
    cache.set_cleaning(cfg).unwrap();
    let c = add_core(&cache, 1 << 20);
    (cache, c)
}

fn write(c: &TestCore, off: u64, len: u64, tag: u64) -> Vec<u8> {
    let data = stamped(len, tag, off / SECTOR);
    c.core.write(&data, off).unwrap();
    data
}

fn read(c: &TestCore, off: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    c.core.read(&mut buf, off).unwrap();
    buf
}

#[test]
fn on_by_default_and_switched_off_a_full_cache_cleans_inline() {
    let (cache, c) = quiet_cache(4);
    assert!(cache.lazy_flush().enabled);
    cache.set_lazy_flush(LazyFlush { enabled: false }).unwrap();
    for i in 0..4 {
        write(&c, i * 4 * KIB, 4 * KIB, i);
    }
    assert_eq!(cache.stats().usage.dirty_lines, 4);
    write(&c, 64 * KIB, 4 * KIB, 9);
    // The inline make-room cleaned victims: nothing went around the cache.
    let s = cache.core_stats(c.id).unwrap();
    assert_eq!(s.requests.lazy_flush_writes, 0);
    assert!(
        cache.cleaning_stats().cleaned_lines > 0,
        "{:?}",
        cache.cleaning_stats()
    );
}

#[test]
fn a_write_without_a_line_goes_to_the_core_and_asks_for_room() {
    let (cache, c) = quiet_cache(4);
    cache.set_lazy_flush(LazyFlush { enabled: true }).unwrap();
    let mut expect = vec![0u8; 1 << 20];
    for i in 0..4 {
        let d = write(&c, i * 4 * KIB, 4 * KIB, i);
        expect[(i * 4 * KIB) as usize..][..d.len()].copy_from_slice(&d);
    }
    // Spans the mapped line 3 and the unmapped lines 4 and 5: line 3 is updated in the cache,
    // lines 4 and 5 go to the core.
    let d = write(&c, 12 * KIB, 12 * KIB, 7);
    expect[(12 * KIB) as usize..][..d.len()].copy_from_slice(&d);
    assert_eq!(
        cache.cleaning_stats().cleaned_lines,
        0,
        "nothing cleaned inline"
    );
    let s = cache.core_stats(c.id).unwrap();
    assert_eq!(s.requests.lazy_flush_writes, 1, "{s:?}");
    assert_eq!(s.blocks.lazy_flush_bytes, 8 * KIB, "{s:?}");
    assert_eq!(s.blocks.core_written_bytes, 8 * KIB, "{s:?}");
    assert_eq!(s.usage.dirty_lines, 4);
    // The core has lines 4 and 5; line 3's new data is only in the cache (dirty).
    assert_eq!(read_vol(&*c.vol, 16 * KIB, 8 * KIB), &d[4 * KIB as usize..]);
    assert_ne!(read_vol(&*c.vol, 12 * KIB, 4 * KIB), &d[..4 * KIB as usize]);
    assert_eq!(read(&c, 0, 1 << 20), expect);

    // nop does no periodic cleaning, but the room request is served by the next tick.
    let t = cache.cleaner_tick(1);
    assert!(t.ran && t.cleaned == 4, "{t:?}");
    assert_eq!(cache.stats().usage.dirty_lines, 0);
    // With room, writes are cached again.
    write(&c, 40 * KIB, 4 * KIB, 8);
    let s = cache.core_stats(c.id).unwrap();
    assert_eq!(s.requests.lazy_flush_writes, 1);
    assert_eq!(s.usage.dirty_lines, 1);
    // A tick with no request for room under nop does nothing.
    let t = cache.cleaner_tick(2);
    assert_eq!(t.cleaned, 0, "{t:?}");
    cache.check_invariants();
}

#[test]
fn a_write_to_the_core_leaves_no_stale_copy_after_the_room_is_made() {
    // Line 4 is written around the cache while full, then the cache makes room and the same
    // sectors are read (inserted from the core) and rewritten: every read is the newest.
    let (cache, c) = quiet_cache(4);
    cache.set_lazy_flush(LazyFlush { enabled: true }).unwrap();
    for i in 0..4 {
        write(&c, i * 4 * KIB, 4 * KIB, i);
    }
    let a = write(&c, 16 * KIB, 4 * KIB, 20);
    cache.cleaner_tick(1);
    assert_eq!(read(&c, 16 * KIB, 4 * KIB), a);
    let b = write(&c, 16 * KIB, 2 * KIB, 21);
    let got = read(&c, 16 * KIB, 4 * KIB);
    assert_eq!(&got[..2048], &b[..]);
    assert_eq!(&got[2048..], &a[2048..]);
    cache.flush().unwrap();
    assert_eq!(read_vol(&*c.vol, 16 * KIB, 2 * KIB), b);
    cache.check_invariants();
}

#[test]
fn the_background_thread_makes_room_under_nop() {
    let (cache, _vol) = new_cache(4, 8, CacheMode::Wb);
    let mut cfg = cache.cleaning();
    cfg.policy = CleaningPolicy::Nop;
    cache.set_cleaning(cfg).unwrap();
    cache.set_lazy_flush(LazyFlush { enabled: true }).unwrap();
    let c = add_core(&cache, 1 << 20);
    for i in 0..9 {
        write(&c, i * 4 * KIB, 4 * KIB, i);
    }
    // The ninth write went to the core and woke the cleaner; wait for its room (a watchdog
    // bounds the wait, no timing is asserted).
    let _dog = Watchdog::new("room under nop", std::time::Duration::from_secs(60));
    while cache.stats().usage.dirty_lines != 0 {
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    assert_eq!(
        cache.core_stats(c.id).unwrap().requests.lazy_flush_writes,
        1
    );
}

#[test]
fn the_switch_survives_a_load() {
    let line = LineSize::from_kib(4).unwrap();
    let vol = ram("ram:cache", 16 << 20);
    let config = CacheConfig {
        id: 1,
        line_size: line,
        mode: CacheMode::Wb,
    };
    let cache = Cache::create(as_ref(&vol), config, false).unwrap();
    cache.set_lazy_flush(LazyFlush { enabled: true }).unwrap();
    cache.stop(true).unwrap();
    drop(cache);
    let cache = Cache::load(as_ref(&vol), &mut |_| None).unwrap();
    assert!(cache.lazy_flush().enabled);
    cache.set_lazy_flush(LazyFlush { enabled: false }).unwrap();
    cache.stop(true).unwrap();
    drop(cache);
    let cache = Cache::load(as_ref(&vol), &mut |_| None).unwrap();
    assert!(!cache.lazy_flush().enabled);
}

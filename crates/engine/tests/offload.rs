//! Offload: a share of clean read hits and of write misses goes to the core while the cache
//! device's queue is deeper than the core's. A hit on a line with a dirty sector never goes to
//! the core, an offloaded write miss leaves nothing cached, and the statistics count both kinds.
//!
//! The tests run on one thread, where no queue builds up, so they use threshold 0 ("whatever the
//! depths"); the queue-depth rule itself is unit-tested in offload.rs. To see where a read was
//! served from, the core's volume is changed behind the cache's back: the cache's clean copy and
//! the core then differ, and the data read says which one answered.

mod common;

use common::*;
use hybridcache_engine::{Cache, CacheMode, CleaningPolicy, Offload};
use hybridcache_volume::Volume;

const KIB: u64 = 1024;

fn cache(mode: CacheMode) -> (Cache, TestCore) {
    let (cache, _vol) = new_cache(4, 64, mode);
    cache.stop_background_cleaner();
    let mut cfg = cache.cleaning();
    cfg.policy = CleaningPolicy::Nop;
    cache.set_cleaning(cfg).unwrap();
    let c = add_core(&cache, 1 << 20);
    (cache, c)
}

fn offload(cache: &Cache, share_pct: u32, threshold: u32) {
    cache
        .set_offload(Offload {
            enabled: true,
            share_pct,
            threshold,
        })
        .unwrap();
}

fn read(c: &TestCore, off: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    c.core.read(&mut buf, off).unwrap();
    buf
}

#[test]
fn off_by_default() {
    let (cache, _c) = cache(CacheMode::Wb);
    assert_eq!(cache.offload(), Offload::default());
    assert!(!cache.offload().enabled);
    let bad = Offload {
        share_pct: 200,
        ..Offload::default()
    };
    assert!(cache.set_offload(bad).is_err());
    assert_eq!(
        cache.offload(),
        Offload::default(),
        "a refused value changes nothing"
    );
}

#[test]
fn a_dirty_hit_is_never_served_by_the_core() {
    let (cache, c) = cache(CacheMode::Wb);
    let x = stamped(4 * KIB, 1, 0);
    c.core.write(&x, 0).unwrap();
    offload(&cache, 100, 0);
    // The core still holds zeros. (A bypassed read takes dirty sectors from the cache anyway,
    // so the data alone cannot tell; the count says whether the core was asked.)
    assert_eq!(read(&c, 0, 4 * KIB), x);
    assert_eq!(cache.stats().requests.offload_reads, 0);
    // Partly dirty counts as dirty: the line's other sectors are dirty, this one is clean.
    let (cache2, c2) = self::cache(CacheMode::Wb);
    let y = stamped(8 * KIB, 2, 0);
    c2.core.write(&y, 0).unwrap();
    cache2.flush().unwrap();
    c2.core.write(&stamped(512, 3, 0), 0).unwrap();
    offload(&cache2, 100, 0);
    assert_eq!(read(&c2, 512, 512), y[512..1024].to_vec());
    assert_eq!(cache2.stats().requests.offload_reads, 0);
}

#[test]
fn a_clean_hit_goes_to_the_core_in_the_share_asked() {
    let (cache, c) = cache(CacheMode::Wb);
    let x = stamped(4 * KIB, 1, 0);
    c.core.write(&x, 0).unwrap();
    cache.flush().unwrap();
    // Behind the cache's back: the core now differs from the clean copy, so the data read says
    // which device answered.
    let y = stamped(4 * KIB, 2, 0);
    c.vol.write_at(&y, 0).unwrap();
    assert_eq!(read(&c, 0, 4 * KIB), x, "offload off: the cache answers");
    offload(&cache, 100, 0);
    assert_eq!(read(&c, 0, 4 * KIB), y, "offloaded: the core answers");
    let s = cache.stats().requests;
    assert_eq!((s.offload_reads, s.pass_through_reads), (1, 1));
    // Still cached, still clean: offload moved the read, not the line.
    assert_eq!(cache.stats().usage.occupancy_lines, 1);

    offload(&cache, 50, 0);
    let from_core = (0..10).filter(|_| read(&c, 0, 4 * KIB) == y).count();
    assert_eq!(from_core, 5);
    assert_eq!(cache.stats().requests.offload_reads, 6);

    // With a threshold the cache's queue must be deeper than the core's; on one thread
    // neither has a queue, so nothing is offloaded.
    offload(&cache, 100, 1);
    assert_eq!(read(&c, 0, 4 * KIB), x);
    assert_eq!(cache.stats().requests.offload_reads, 6);
}

#[test]
fn a_read_miss_is_not_offload_s_business() {
    let (cache, c) = cache(CacheMode::Wb);
    offload(&cache, 100, 0);
    let _ = read(&c, 0, 4 * KIB);
    let s = cache.stats();
    assert_eq!(s.requests.offload_reads, 0);
    assert_eq!(s.requests.read_full_misses, 1);
    assert_eq!(s.usage.occupancy_lines, 1, "the miss is inserted as usual");
}

#[test]
fn a_write_miss_goes_to_the_core_and_caches_nothing() {
    for mode in [CacheMode::Wb, CacheMode::Wt, CacheMode::Wo] {
        let (cache, c) = cache(mode);
        offload(&cache, 100, 0);
        let z = stamped(8 * KIB, 7, 0);
        c.core.write(&z, 64 * KIB).unwrap();
        let s = cache.stats();
        assert_eq!(s.requests.offload_writes, 1, "{mode:?}");
        assert_eq!(s.requests.pass_through_writes, 1, "{mode:?}");
        assert_eq!(s.usage.occupancy_lines, 0, "{mode:?}: nothing cached");
        assert_eq!(read_vol(&*c.vol, 64 * KIB, 8 * KIB), z, "{mode:?}");
        assert_eq!(read(&c, 64 * KIB, 8 * KIB), z, "{mode:?}");
    }
}

#[test]
fn a_write_touching_a_cached_line_stays_in_the_cache() {
    let (cache, c) = cache(CacheMode::Wb);
    c.core.write(&stamped(4 * KIB, 1, 0), 0).unwrap();
    offload(&cache, 100, 0);
    // One line mapped, one not: not a miss, so the mapped copy is updated as usual.
    let w = stamped(8 * KIB, 2, 0);
    c.core.write(&w, 0).unwrap();
    let s = cache.stats();
    assert_eq!(s.requests.offload_writes, 0);
    assert_eq!(read(&c, 0, 8 * KIB), w);
    cache.flush().unwrap();
    assert_eq!(read_vol(&*c.vol, 0, 8 * KIB), w);
}

#[test]
fn wa_and_pt_are_left_alone() {
    for mode in [CacheMode::Wa, CacheMode::Pt, CacheMode::Wi] {
        let (cache, c) = cache(mode);
        offload(&cache, 100, 0);
        c.core.write(&stamped(4 * KIB, 1, 0), 0).unwrap();
        assert_eq!(cache.stats().requests.offload_writes, 0, "{mode:?}");
    }
}

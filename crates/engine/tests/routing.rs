//! Routing: what each cache mode does with a request, shown through statistics and through the
//! contents of the cache and core devices (separate RAM volumes we keep handles to).
//!
//! Core devices start filled with an "old" stamp rather than zeroes, so data read from the core
//! is told apart from data that never arrived.

mod common;

use std::sync::Arc;

use common::*;
use hybridcache_engine::{
    BlockStats, Cache, CacheConfig, CacheMode, EngineError, LineSize, RequestStats, Stats,
    MAX_REQUEST,
};
use hybridcache_volume::{RamVolume, Volume};

const OLD: u64 = 0xD1D;
const KIB: u64 = 1024;

/// A core device already holding data (stamped with [`OLD`]).
fn old_core_vol(size: u64) -> Arc<RamVolume> {
    let vol = ram("ram:core", size);
    vol.write_at(&stamped(size, OLD, 0), 0).expect("fill core");
    vol
}

struct Fixture {
    cache: Cache,
    cache_vol: Arc<RamVolume>,
    c: TestCore,
}

impl Fixture {
    fn new(line_kib: u32, lines: u64, mode: CacheMode) -> Fixture {
        let (cache, cache_vol) = new_cache(line_kib, lines, mode);
        let c = add_core_vol(&cache, old_core_vol(1 << 20));
        Fixture {
            cache,
            cache_vol,
            c,
        }
    }

    /// Write `len` bytes stamped with `tag` at `off`; returns the data.
    fn write(&self, off: u64, len: u64, tag: u64) -> Vec<u8> {
        let data = stamped(len, tag, off / SECTOR);
        self.c.core.write(&data, off).expect("write");
        data
    }

    fn read(&self, off: u64, len: u64) -> Vec<u8> {
        let mut buf = vec![0xEEu8; len as usize];
        self.c.core.read(&mut buf, off).expect("read");
        buf
    }

    /// What the core device itself holds, bypassing the engine.
    fn core_dev(&self, off: u64, len: u64) -> Vec<u8> {
        read_vol(&*self.c.vol, off, len)
    }

    /// Whether the cache device holds `data` anywhere (sector aligned): layout-agnostic evidence
    /// that data went to the cache.
    fn cache_dev_holds(&self, data: &[u8]) -> bool {
        let all = read_vol(&*self.cache_vol, 0, self.cache_vol.size());
        (0..=all.len() - data.len())
            .step_by(SECTOR as usize)
            .any(|p| all[p..p + data.len()] == *data)
    }

    fn stats(&self) -> Stats {
        self.cache.stats()
    }
}

/// Old core content of a range, as the fixture's core device was filled.
fn old(off: u64, len: u64) -> Vec<u8> {
    stamped(len, OLD, off / SECTOR)
}

fn assert_data(what: &str, want: &[u8], got: &[u8], off: u64) {
    if let Some(d) = first_difference(want, got, off / SECTOR) {
        panic!("{what}: {d}");
    }
}

#[test]
fn wb_write_goes_to_cache_only_until_flush() {
    let f = Fixture::new(4, 16, CacheMode::Wb);
    f.cache.reset_stats();
    let data = f.write(8 * KIB, 4 * KIB, 1);
    let s = f.stats();
    assert_data(
        "core device after wb write",
        &old(8 * KIB, 4 * KIB),
        &f.core_dev(8 * KIB, 4 * KIB),
        8 * KIB,
    );
    assert!(f.cache_dev_holds(&data), "wb write not on the cache device");
    assert_eq!(s.blocks.core_written_bytes, 0, "{s:?}");
    assert_eq!(s.blocks.cache_written_bytes, 4 * KIB, "{s:?}");
    assert_eq!(s.blocks.exported_written_bytes, 4 * KIB, "{s:?}");
    assert_eq!(
        (s.usage.occupancy_lines, s.usage.dirty_lines),
        (1, 1),
        "{s:?}"
    );
    assert_eq!(s.requests.write_full_misses, 1, "{s:?}");

    // The re-read is a hit that never touches the core.
    f.cache.reset_stats();
    assert_data("re-read", &data, &f.read(8 * KIB, 4 * KIB), 8 * KIB);
    let s = f.stats();
    assert_eq!(s.requests.read_hits, 1, "{s:?}");
    assert_eq!(s.blocks.core_read_bytes, 0, "{s:?}");
    assert_eq!(s.blocks.cache_read_bytes, 4 * KIB, "{s:?}");
    assert_eq!(s.blocks.exported_read_bytes, 4 * KIB, "{s:?}");

    // A flush writes exactly the dirty sectors to the core and keeps the line cached, clean.
    f.cache.reset_stats();
    f.cache.flush().unwrap();
    let s = f.stats();
    assert_data(
        "core device after flush",
        &data,
        &f.core_dev(8 * KIB, 4 * KIB),
        8 * KIB,
    );
    assert_eq!(s.blocks.core_written_bytes, 4 * KIB, "{s:?}");
    assert_eq!(
        (s.usage.occupancy_lines, s.usage.dirty_lines),
        (1, 0),
        "{s:?}"
    );
    f.cache.check_invariants();
}

#[test]
fn wt_write_goes_to_core_and_cache() {
    let f = Fixture::new(4, 16, CacheMode::Wt);
    f.cache.reset_stats();
    let data = f.write(12 * KIB, 4 * KIB, 1);
    let s = f.stats();
    assert_data(
        "core device after wt write",
        &data,
        &f.core_dev(12 * KIB, 4 * KIB),
        12 * KIB,
    );
    assert!(
        f.cache_dev_holds(&data),
        "wt write not inserted in the cache device"
    );
    assert_eq!(
        (s.usage.occupancy_lines, s.usage.dirty_lines),
        (1, 0),
        "{s:?}"
    );
    assert_eq!(s.blocks.core_written_bytes, 4 * KIB, "{s:?}");
    assert_eq!(s.blocks.cache_written_bytes, 4 * KIB, "{s:?}");

    f.cache.reset_stats();
    assert_data("re-read", &data, &f.read(12 * KIB, 4 * KIB), 12 * KIB);
    let s = f.stats();
    assert_eq!(s.requests.read_hits, 1, "{s:?}");
    assert_eq!(s.blocks.core_read_bytes, 0, "{s:?}");
    f.cache.check_invariants();
}

#[test]
fn wt_read_miss_inserts_then_hits() {
    let f = Fixture::new(4, 16, CacheMode::Wt);
    assert_data("miss", &old(0, 4 * KIB), &f.read(0, 4 * KIB), 0);
    let s = f.stats();
    assert_eq!(s.requests.read_full_misses, 1, "{s:?}");
    assert_eq!(s.usage.occupancy_lines, 1, "{s:?}");
    assert_eq!(s.blocks.core_read_bytes, 4 * KIB, "{s:?}");
    assert_eq!(s.blocks.cache_written_bytes, 4 * KIB, "{s:?}");
    f.cache.reset_stats();
    assert_data("hit", &old(0, 4 * KIB), &f.read(0, 4 * KIB), 0);
    let s = f.stats();
    assert_eq!(
        (s.requests.read_hits, s.blocks.core_read_bytes),
        (1, 0),
        "{s:?}"
    );
}

#[test]
fn wa_write_does_not_insert_but_updates_mapped_lines() {
    let f = Fixture::new(4, 16, CacheMode::Wa);
    let off = 20 * KIB;
    let data = f.write(off, 4 * KIB, 1);
    let s = f.stats();
    assert_eq!(s.usage.occupancy_lines, 0, "wa write inserted: {s:?}");
    assert_eq!(s.blocks.cache_written_bytes, 0, "{s:?}");
    assert_data(
        "core device after wa write",
        &data,
        &f.core_dev(off, 4 * KIB),
        off,
    );
    assert!(!f.cache_dev_holds(&data));

    // A read maps the line; a write to the mapped line then updates the cached copy.
    assert_data("read miss", &data, &f.read(off, 4 * KIB), off);
    assert_eq!(f.stats().usage.occupancy_lines, 1);
    let data2 = f.write(off, 4 * KIB, 2);
    assert_data(
        "core device after wa update",
        &data2,
        &f.core_dev(off, 4 * KIB),
        off,
    );
    assert_eq!(f.stats().usage.dirty_lines, 0);
    f.cache.reset_stats();
    assert_data("re-read after update", &data2, &f.read(off, 4 * KIB), off);
    let s = f.stats();
    assert_eq!(
        (s.requests.read_hits, s.blocks.core_read_bytes),
        (1, 0),
        "{s:?}"
    );
    f.cache.check_invariants();
}

#[test]
fn wi_write_invalidates_mapped_line() {
    let f = Fixture::new(4, 16, CacheMode::Wi);
    let off = 16 * KIB;
    f.read(off, 4 * KIB);
    assert_eq!(f.stats().usage.occupancy_lines, 1);
    let data = f.write(off, 4 * KIB, 1);
    assert_data(
        "core device after wi write",
        &data,
        &f.core_dev(off, 4 * KIB),
        off,
    );
    assert_eq!(f.stats().usage.dirty_lines, 0);
    // The cached copy was invalidated: the next read is a miss served by the core.
    f.cache.reset_stats();
    assert_data("read after wi write", &data, &f.read(off, 4 * KIB), off);
    let s = f.stats();
    assert_eq!(s.requests.read_hits, 0, "{s:?}");
    assert_eq!(s.requests.read_full_misses, 1, "{s:?}");
    assert_eq!(s.blocks.core_read_bytes, 4 * KIB, "{s:?}");
    f.cache.check_invariants();
}

#[test]
fn wo_reads_bypass_writes_are_dirty_and_served_from_cache() {
    let f = Fixture::new(4, 16, CacheMode::Wo);
    let off = 24 * KIB;
    f.cache.reset_stats();
    assert_data("wo read", &old(off, 4 * KIB), &f.read(off, 4 * KIB), off);
    let s = f.stats();
    assert_eq!(s.usage.occupancy_lines, 0, "wo read inserted: {s:?}");
    assert_eq!(s.requests.pass_through_reads, 1, "{s:?}");
    assert_eq!(s.blocks.core_read_bytes, 4 * KIB, "{s:?}");
    assert_eq!(s.blocks.cache_written_bytes, 0, "{s:?}");

    let data = f.write(off, 4 * KIB, 1);
    assert_eq!(f.stats().usage.dirty_lines, 1);
    assert_data(
        "core device after wo write",
        &old(off, 4 * KIB),
        &f.core_dev(off, 4 * KIB),
        off,
    );
    f.cache.reset_stats();
    assert_data("read of dirty data", &data, &f.read(off, 4 * KIB), off);
    let s = f.stats();
    assert_eq!(
        s.blocks.core_read_bytes, 0,
        "dirty data must come from the cache: {s:?}"
    );
    assert_eq!(s.blocks.cache_read_bytes, 4 * KIB, "{s:?}");

    // Half a line dirty: a read of the whole line mixes cache (dirty half) and core (rest).
    let off2 = 28 * KIB;
    let half = f.write(off2, 2 * KIB, 2);
    let mut want = half.clone();
    want.extend(old(off2 + 2 * KIB, 2 * KIB));
    assert_data("mixed read", &want, &f.read(off2, 4 * KIB), off2);
    f.cache.flush().unwrap();
    assert_data(
        "core device after flush",
        &want,
        &f.core_dev(off2, 4 * KIB),
        off2,
    );
    assert_data(
        "core device after flush",
        &data,
        &f.core_dev(off, 4 * KIB),
        off,
    );
    assert_eq!(f.stats().usage.dirty_lines, 0);
    f.cache.check_invariants();
}

#[test]
fn pt_goes_to_core_but_serves_dirty_sectors_until_flushed() {
    let f = Fixture::new(4, 16, CacheMode::Wb);
    let (l1, l2, l9) = (4 * KIB, 8 * KIB, 36 * KIB);
    let a1 = f.write(l1, 4 * KIB, 1);
    let a2 = f.write(l2, 4 * KIB, 2);
    f.cache.set_mode(CacheMode::Pt, false).unwrap();
    assert_eq!(f.cache.mode(), CacheMode::Pt);
    assert_data(
        "core device keeps old data",
        &old(l1, 4 * KIB),
        &f.core_dev(l1, 4 * KIB),
        l1,
    );
    // Dirty data is still served from the cache.
    assert_data("dirty read in pt", &a1, &f.read(l1, 4 * KIB), l1);
    assert_data("dirty read in pt", &a2, &f.read(l2, 4 * KIB), l2);

    // Unmapped data: pass-through both ways, nothing inserted.
    let occupancy = f.stats().usage.occupancy_lines;
    f.cache.reset_stats();
    assert_data("pt read", &old(l9, 4 * KIB), &f.read(l9, 4 * KIB), l9);
    let b = f.write(l9, 4 * KIB, 9);
    let s = f.stats();
    assert_eq!(s.requests.pass_through_reads, 1, "{s:?}");
    assert_eq!(s.requests.pass_through_writes, 1, "{s:?}");
    assert_eq!(s.usage.occupancy_lines, occupancy, "{s:?}");
    assert_eq!(s.blocks.cache_written_bytes, 0, "{s:?}");
    assert_data(
        "core device after pt write",
        &b,
        &f.core_dev(l9, 4 * KIB),
        l9,
    );

    // A pt write over dirty sectors wins, now and after the flush (the old dirty copy must not
    // be cleaned over it).
    let e2 = f.write(l2, 4 * KIB, 3);
    let c1 = f.write(l1, 2 * KIB, 4);
    let mut want1 = c1.clone();
    want1.extend_from_slice(&a1[2 * KIB as usize..]);
    assert_data(
        "line 2 after pt write over dirty",
        &e2,
        &f.read(l2, 4 * KIB),
        l2,
    );
    assert_data(
        "line 1 after partial pt write over dirty",
        &want1,
        &f.read(l1, 4 * KIB),
        l1,
    );
    f.cache.flush().unwrap();
    assert_eq!(f.stats().usage.dirty_lines, 0);
    assert_data(
        "core device line 1 after flush",
        &want1,
        &f.core_dev(l1, 4 * KIB),
        l1,
    );
    assert_data(
        "core device line 2 after flush",
        &e2,
        &f.core_dev(l2, 4 * KIB),
        l2,
    );
    assert_data("line 1 after flush", &want1, &f.read(l1, 4 * KIB), l1);
    assert_data("line 2 after flush", &e2, &f.read(l2, 4 * KIB), l2);
    f.cache.check_invariants();
}

#[test]
fn validity_is_per_sector() {
    let f = Fixture::new(64, 8, CacheMode::Wb);
    f.cache.reset_stats();
    let data = f.write(8 * KIB, 4 * KIB, 1);
    let s = f.stats();
    assert_eq!(
        s.blocks.cache_written_bytes,
        4 * KIB,
        "a small write must not fill the line: {s:?}"
    );
    assert_eq!(s.blocks.core_read_bytes, 0, "{s:?}");
    assert_eq!(s.blocks.core_written_bytes, 0, "{s:?}");

    // Elsewhere in the same line: those sectors are not valid, exactly they come from the core.
    f.cache.reset_stats();
    assert_data(
        "miss in a mapped line",
        &old(32 * KIB, 4 * KIB),
        &f.read(32 * KIB, 4 * KIB),
        32 * KIB,
    );
    let s = f.stats();
    assert_eq!(s.blocks.core_read_bytes, 4 * KIB, "{s:?}");
    assert_eq!(s.requests.read_full_misses, 1, "{s:?}");
    assert_data("written sectors", &data, &f.read(8 * KIB, 4 * KIB), 8 * KIB);
    f.cache.check_invariants();
}

#[test]
fn partial_miss_reads_only_missing_sectors() {
    let f = Fixture::new(64, 8, CacheMode::Wt);
    f.read(0, 4 * KIB);
    f.cache.reset_stats();
    assert_data("partial miss", &old(0, 8 * KIB), &f.read(0, 8 * KIB), 0);
    let s = f.stats();
    assert_eq!(s.requests.read_partial_misses, 1, "{s:?}");
    assert_eq!(
        (s.requests.read_hits, s.requests.read_full_misses),
        (0, 0),
        "{s:?}"
    );
    assert_eq!(s.blocks.core_read_bytes, 4 * KIB, "{s:?}");
    // Now all of it is valid.
    f.cache.reset_stats();
    f.read(0, 8 * KIB);
    assert_eq!(f.stats().requests.read_hits, 1);
}

#[test]
fn reset_stats_zeroes_counters_but_not_usage() {
    let f = Fixture::new(4, 16, CacheMode::Wb);
    f.write(0, 8 * KIB, 1);
    f.read(0, 16 * KIB);
    f.cache.set_mode(CacheMode::Pt, false).unwrap();
    f.read(64 * KIB, 4 * KIB);
    f.write(64 * KIB, 4 * KIB, 2);
    let before = f.stats();
    assert_ne!(before.requests, RequestStats::default());
    assert_ne!(before.blocks, BlockStats::default());
    f.cache.reset_stats();
    let after = f.stats();
    assert_eq!(after.requests, RequestStats::default());
    assert_eq!(after.blocks, BlockStats::default());
    assert_eq!(after.usage, before.usage);
    let core = f.cache.core_stats(f.c.id).unwrap();
    assert_eq!(core.requests, RequestStats::default());
    assert_eq!(core.blocks, BlockStats::default());
}

#[test]
fn stats_and_data_are_per_core() {
    let (cache, _cache_vol) = new_cache(4, 16, CacheMode::Wb);
    let a = add_core(&cache, 1 << 20);
    let b = add_core(&cache, (1 << 20) + 7 * SECTOR);
    assert_ne!(a.id, b.id);
    assert_eq!(b.core.size(), (1 << 20) + 7 * SECTOR);
    assert_eq!(cache.cores().len(), 2);
    // The same offset on two cores is two different lines.
    let da = stamped(4 * KIB, 1, 0);
    let db = stamped(8 * KIB, 2, 0);
    a.core.write(&da, 0).unwrap();
    b.core.write(&db, 0).unwrap();
    let mut buf = vec![0u8; 4 * KIB as usize];
    a.core.read(&mut buf, 0).unwrap();
    assert_data("core a", &da, &buf, 0);
    b.core.read(&mut buf, 0).unwrap();
    assert_data("core b", &db[..4 * KIB as usize], &buf, 0);

    let (sa, sb) = (
        cache.core_stats(a.id).unwrap(),
        cache.core_stats(b.id).unwrap(),
    );
    assert_eq!(
        (sa.usage.occupancy_lines, sa.usage.dirty_lines),
        (1, 1),
        "{sa:?}"
    );
    assert_eq!(
        (sb.usage.occupancy_lines, sb.usage.dirty_lines),
        (2, 2),
        "{sb:?}"
    );
    let all = cache.stats();
    assert_eq!(all.usage.dirty_lines, 3, "{all:?}");
    assert_eq!(all.usage.free_lines, 13, "{all:?}");
    assert_eq!(all.blocks.exported_written_bytes, 12 * KIB, "{all:?}");
    assert_eq!(sa.blocks.exported_written_bytes, 4 * KIB, "{sa:?}");

    // Flushing one core leaves the other's dirty data alone.
    cache.flush_core(a.id).unwrap();
    assert_data("core a device", &da, &read_vol(&*a.vol, 0, 4 * KIB), 0);
    assert_data(
        "core b device",
        &vec![0; 8 * KIB as usize],
        &read_vol(&*b.vol, 0, 8 * KIB),
        0,
    );
    assert_eq!(cache.core_stats(a.id).unwrap().usage.dirty_lines, 0);
    assert_eq!(cache.core_stats(b.id).unwrap().usage.dirty_lines, 2);
    cache.flush().unwrap();
    assert_data("core b device", &db, &read_vol(&*b.vol, 0, 8 * KIB), 0);
    cache.check_invariants();
}

#[test]
fn discard_and_write_zeroes_drop_cached_data_dirty_included() {
    let f = Fixture::new(4, 16, CacheMode::Wb);
    f.write(0, 16 * KIB, 1);
    assert_eq!(f.stats().usage.dirty_lines, 4);
    // Whole lines 0 and 1, and half of line 2.
    f.c.core.discard(0, 10 * KIB).unwrap();
    f.c.core.write_zeroes(12 * KIB, 4 * KIB).unwrap();
    let mut want = vec![0u8; 16 * KIB as usize];
    want[10 * KIB as usize..12 * KIB as usize].copy_from_slice(&stamped(
        2 * KIB,
        1,
        10 * KIB / SECTOR,
    ));
    assert_data("after discard", &want, &f.read(0, 16 * KIB), 0);
    let dirty = f.stats().usage.dirty_lines;
    assert!(dirty <= 2, "discarded lines still dirty: {dirty}");
    f.cache.flush().unwrap();
    // The discarded dirty data must not be cleaned onto the core afterwards.
    assert_data(
        "core device after flush",
        &want,
        &f.core_dev(0, 16 * KIB),
        0,
    );
    assert_data("after flush", &want, &f.read(0, 16 * KIB), 0);
    f.cache.check_invariants();
}

#[test]
fn set_mode_flush_first_leaves_no_dirty_data() {
    for target in [CacheMode::Wt, CacheMode::Wa, CacheMode::Wi, CacheMode::Pt] {
        let f = Fixture::new(4, 16, CacheMode::Wb);
        let data = f.write(0, 24 * KIB, 1);
        f.cache.set_mode(target, true).unwrap();
        let s = f.stats();
        assert_eq!(s.usage.dirty_lines, 0, "wb -> {target} with flush: {s:?}");
        assert_data("core device", &data, &f.core_dev(0, 24 * KIB), 0);
        assert_data("read", &data, &f.read(0, 24 * KIB), 0);
        // Without flush_first the dirty data stays readable (and drains by cleaning).
        f.cache.set_mode(CacheMode::Wo, false).unwrap();
        let data2 = f.write(4 * KIB, 8 * KIB, 2);
        f.cache.set_mode(target, false).unwrap();
        let mut want = data.clone();
        want[4 * KIB as usize..12 * KIB as usize].copy_from_slice(&data2);
        assert_data(
            "read after switch without flush",
            &want,
            &f.read(0, 24 * KIB),
            0,
        );
        f.cache.flush().unwrap();
        assert_data(
            "core device after flush",
            &want,
            &f.core_dev(0, 24 * KIB),
            0,
        );
        f.cache.check_invariants();
    }
}

#[test]
fn eviction_keeps_occupancy_at_cache_size() {
    let f = Fixture::new(4, 8, CacheMode::Wt);
    assert_eq!(f.cache.line_count(), 8);
    let mut written = Vec::new();
    for i in 0..13u64 {
        written.push(f.write(i * 4 * KIB, 4 * KIB, 100 + i));
        let s = f.stats();
        assert_eq!(
            s.usage.occupancy_lines,
            (i + 1).min(8),
            "after write {i}: {s:?}"
        );
        assert_eq!(s.usage.total_lines, 8, "{s:?}");
        assert_eq!(s.usage.free_lines, 8 - (i + 1).min(8), "{s:?}");
    }
    for (i, d) in written.iter().enumerate() {
        let off = i as u64 * 4 * KIB;
        assert_data("core device", d, &f.core_dev(off, 4 * KIB), off);
        assert_data("read", d, &f.read(off, 4 * KIB), off);
    }
    f.cache.check_invariants();
}

#[test]
fn wb_with_all_lines_dirty_cleans_to_make_room() {
    let f = Fixture::new(4, 8, CacheMode::Wb);
    let mut written = Vec::new();
    for i in 0..24u64 {
        written.push(f.write(i * 4 * KIB, 4 * KIB, 200 + i));
        let s = f.stats();
        assert!(s.usage.occupancy_lines <= 8, "{s:?}");
    }
    let s = f.stats();
    assert!(
        s.blocks.core_written_bytes >= 16 * 4 * KIB,
        "dirty lines were not cleaned: {s:?}"
    );
    for (i, d) in written.iter().enumerate() {
        let off = i as u64 * 4 * KIB;
        assert_data("read", d, &f.read(off, 4 * KIB), off);
    }
    f.cache.flush().unwrap();
    for (i, d) in written.iter().enumerate() {
        let off = i as u64 * 4 * KIB;
        assert_data("core device", d, &f.core_dev(off, 4 * KIB), off);
    }
    f.cache.check_invariants();
}

#[test]
fn requests_larger_than_the_cache_work_in_every_mode() {
    for mode in CacheMode::ALL {
        // 4 lines of 64 KiB = 256 KiB of cache; requests of 768 KiB.
        let f = Fixture::new(64, 4, mode);
        let data = f.write(64 * KIB + 4 * KIB, 768 * KIB, 1);
        assert_data(
            "read",
            &data,
            &f.read(64 * KIB + 4 * KIB, 768 * KIB),
            68 * KIB,
        );
        let s = f.stats();
        assert!(s.usage.occupancy_lines <= 4, "{mode}: {s:?}");
        f.cache.flush().unwrap();
        assert_data(
            "core device",
            &data,
            &f.core_dev(68 * KIB, 768 * KIB),
            68 * KIB,
        );
        f.cache.check_invariants();
    }
}

#[test]
fn partial_last_core_line() {
    // A core of 3 lines and 7 sectors: the last line covers only 7 sectors.
    let (cache, _cv) = new_cache(4, 4, CacheMode::Wb);
    let c = add_core_vol(&cache, old_core_vol(12 * KIB + 7 * SECTOR));
    let data = stamped(7 * SECTOR + 2 * KIB, 5, (10 * KIB) / SECTOR);
    c.core.write(&data, 10 * KIB).unwrap();
    let mut buf = vec![0u8; data.len()];
    c.core.read(&mut buf, 10 * KIB).unwrap();
    assert_data("tail read", &data, &buf, 10 * KIB);
    cache.set_mode(CacheMode::Wt, true).unwrap();
    assert_data(
        "tail on device",
        &data,
        &read_vol(&*c.vol, 10 * KIB, data.len() as u64),
        10 * KIB,
    );
    cache.check_invariants();
}

fn expect_err<T: std::fmt::Debug>(
    what: &str,
    r: Result<T, EngineError>,
    ok: impl Fn(&EngineError) -> bool,
) {
    match r {
        Err(e) if ok(&e) => {}
        other => panic!("{what}: unexpected result {other:?}"),
    }
}

#[test]
fn request_errors() {
    let (cache, _cv) = new_cache(4, 8, CacheMode::Wt);
    let size = 40 << 20;
    let c = add_core(&cache, size);
    let core = &c.core;
    let mut buf = vec![0u8; 512];
    let unaligned = |e: &EngineError| matches!(e, EngineError::Unaligned { .. });
    let out_of_range = |e: &EngineError| matches!(e, EngineError::OutOfRange { .. });
    let too_large = |e: &EngineError| matches!(e, EngineError::TooLarge { .. });

    expect_err("read at offset 100", core.read(&mut buf, 100), unaligned);
    expect_err(
        "read of 100 bytes",
        core.read(&mut buf[..100], 0),
        unaligned,
    );
    expect_err("write at offset 100", core.write(&buf, 100), unaligned);
    expect_err("write of 700 bytes", core.write(&[0u8; 700], 0), unaligned);
    expect_err("discard at offset 7", core.discard(7, 512), unaligned);
    expect_err("discard of 100 bytes", core.discard(0, 100), unaligned);
    expect_err("write_zeroes at 7", core.write_zeroes(7, 512), unaligned);

    expect_err(
        "read past end",
        core.read(&mut [0u8; 1024], size - 512),
        out_of_range,
    );
    expect_err("read at end", core.read(&mut buf, size), out_of_range);
    expect_err(
        "write past end",
        core.write(&[0u8; 1024], size - 512),
        out_of_range,
    );
    expect_err(
        "discard past end",
        core.discard(size - 512, 1024),
        out_of_range,
    );
    expect_err(
        "write_zeroes past end",
        core.write_zeroes(size, 512),
        out_of_range,
    );
    expect_err(
        "huge offset",
        core.read(&mut buf, u64::MAX - 511),
        out_of_range,
    );

    let mut big = vec![0u8; (MAX_REQUEST + 512) as usize];
    expect_err("read over 32 MiB", core.read(&mut big, 0), too_large);
    expect_err("write over 32 MiB", core.write(&big, 0), too_large);
    // Exactly 32 MiB is fine.
    core.read(&mut big[..MAX_REQUEST as usize], 0).unwrap();
    core.write(&big[..MAX_REQUEST as usize], 512).unwrap();

    // Nothing was counted as written for the refused requests.
    let s = cache.stats();
    assert_eq!(s.blocks.exported_written_bytes, MAX_REQUEST, "{s:?}");
    cache.check_invariants();
}

/// As casadm (find_free_core_id): without an id a core gets the lowest free one from 1; 0 is
/// given only when every other id is taken, and can always be asked for.
#[test]
fn core_ids_start_at_1_and_0_is_asked_for() {
    let (cache, _cv) = new_cache(4, 8, CacheMode::Wt);
    let auto = cache
        .add_core(as_ref(&ram("ram:a", 1 << 20)), None)
        .unwrap();
    assert_eq!(auto, 1);
    let zero = cache
        .add_core(as_ref(&ram("ram:z", 1 << 20)), Some(0))
        .unwrap();
    assert_eq!(zero, 0);
    let next = cache
        .add_core(as_ref(&ram("ram:b", 1 << 20)), None)
        .unwrap();
    assert_eq!(next, 2);
    cache.remove_core(1, false).unwrap();
    let again = cache
        .add_core(as_ref(&ram("ram:c", 1 << 20)), None)
        .unwrap();
    assert_eq!(again, 1);
    let ids: Vec<u16> = cache.cores().iter().map(|c| c.id).collect();
    assert_eq!(ids, [0, 1, 2]);
    expect_err(
        "duplicate id 0",
        cache.add_core(as_ref(&ram("ram:x", 1 << 20)), Some(0)),
        |e| matches!(e, EngineError::DuplicateCore(0)),
    );
}

#[test]
fn core_management_errors() {
    let (cache, _cv) = new_cache(4, 8, CacheMode::Wb);
    let c = add_core(&cache, 1 << 20);
    let no_such = |e: &EngineError| matches!(e, EngineError::NoSuchCore(99));
    expect_err("core(99)", cache.core(99).map(|_| ()), no_such);
    expect_err("flush_core(99)", cache.flush_core(99), no_such);
    expect_err("core_stats(99)", cache.core_stats(99), no_such);
    expect_err("remove_core(99)", cache.remove_core(99, false), no_such);

    let id = c.id;
    expect_err(
        "duplicate id",
        cache.add_core(as_ref(&ram("ram:x", 1 << 20)), Some(id)),
        |e| matches!(e, EngineError::DuplicateCore(d) if *d == id),
    );
    expect_err(
        "id 4096",
        cache.add_core(as_ref(&ram("ram:x", 1 << 20)), Some(4096)),
        |e| matches!(e, EngineError::BadCoreId(4096)),
    );
    assert_eq!(cache.cores().len(), 1);

    // Dirty data blocks removal until flushed.
    c.core.write(&stamped(8 * KIB, 1, 0), 0).unwrap();
    expect_err(
        "remove dirty core",
        cache.remove_core(id, false),
        |e| matches!(e, EngineError::CoreDirty { id: i, dirty_lines: 2 } if *i == id),
    );
    cache.flush_core(id).unwrap();
    cache.remove_core(id, false).unwrap();
    assert!(cache.cores().is_empty());
    expect_err("core() after removal", cache.core(id).map(|_| ()), |e| {
        matches!(e, EngineError::NoSuchCore(_))
    });
    // A handle kept across the removal fails rather than touching a detached device.
    let r = c.core.read(&mut [0u8; 512], 0);
    assert!(r.is_err(), "read through a removed core's handle succeeded");
    let s = cache.stats();
    assert_eq!(
        (s.usage.occupancy_lines, s.usage.free_lines),
        (0, 8),
        "{s:?}"
    );
    assert_data(
        "core device",
        &stamped(8 * KIB, 1, 0),
        &read_vol(&*c.vol, 0, 8 * KIB),
        0,
    );

    // Forced removal drops dirty data: the core device keeps its old content.
    let c2 = add_core_vol(&cache, old_core_vol(1 << 20));
    c2.core.write(&stamped(4 * KIB, 2, 0), 0).unwrap();
    cache.remove_core(c2.id, true).unwrap();
    let s = cache.stats();
    assert_eq!(
        (s.usage.dirty_lines, s.usage.occupancy_lines),
        (0, 0),
        "{s:?}"
    );
    assert_data(
        "core device after forced removal",
        &old(0, 4 * KIB),
        &read_vol(&*c2.vol, 0, 4 * KIB),
        0,
    );
    cache.check_invariants();
}

#[test]
fn cache_too_small() {
    let vol = ram("ram:tiny", 2048);
    let config = CacheConfig {
        id: 1,
        line_size: LineSize::from_kib(4).unwrap(),
        mode: CacheMode::Wt,
    };
    expect_err(
        "2 KiB cache with 4 KiB lines",
        Cache::new(as_ref(&vol), config).map(|_| ()),
        |e| matches!(e, EngineError::CacheTooSmall { .. }),
    );
}

//! Stop, load, refusal and corruption: what an operator meets around a persistent cache.

use std::sync::Arc;

use hybridcache_engine::{Cache, CacheConfig, CacheMode, CoreStatus, EngineError, LineSize};
use hybridcache_volume::{FaultConfig, FaultyVolume, RamVolume, Volume, VolumeRef};

mod durability;
use durability::{decode, fill, SECTOR};

const CACHE_BYTES: u64 = (3 << 20) + (512 << 10);
const CORE_BYTES: u64 = 1 << 20;

fn ram(name: &str, size: u64) -> Arc<RamVolume> {
    Arc::new(RamVolume::new(name, size).unwrap())
}

fn config(mode: CacheMode) -> CacheConfig {
    CacheConfig {
        id: 7,
        line_size: LineSize::from_kib(4).unwrap(),
        mode,
    }
}

fn contents(v: &dyn Volume) -> Vec<u8> {
    let mut b = vec![0u8; v.size() as usize];
    v.read_at(&mut b, 0).unwrap();
    b
}

fn write_stamp(cache: &Cache, core: u16, first_sector: u64, sectors: u64, stamp: u32) {
    let mut buf = vec![0u8; sectors as usize * SECTOR];
    fill(&mut buf, stamp, first_sector);
    cache
        .core(core)
        .unwrap()
        .write(&buf, first_sector * 512)
        .unwrap();
}

fn stamps(cache: &Cache, core: u16, first_sector: u64, sectors: u64) -> Vec<Option<u32>> {
    let mut buf = vec![0u8; sectors as usize * SECTOR];
    cache
        .core(core)
        .unwrap()
        .read(&mut buf, first_sector * 512)
        .unwrap();
    buf.chunks(SECTOR)
        .enumerate()
        .map(|(i, s)| decode(s, first_sector + i as u64))
        .collect()
}

/// A wb cache with one core holding dirty data (stamp 5 on sectors 0..64).
fn dirty_cache() -> (Arc<RamVolume>, Arc<RamVolume>, Cache) {
    let cache_vol = ram("cache", CACHE_BYTES);
    let core_vol = ram("core", CORE_BYTES);
    let cache = Cache::create(cache_vol.clone(), config(CacheMode::Wb), false).unwrap();
    cache.add_core(core_vol.clone(), Some(3)).unwrap();
    write_stamp(&cache, 3, 0, 64, 5);
    (cache_vol, core_vol, cache)
}

fn reload(cache_vol: &Arc<RamVolume>, core: Option<VolumeRef>) -> Result<Cache, EngineError> {
    Cache::load(cache_vol.clone(), &mut |_| core.clone())
}

#[test]
fn stop_flushes_by_default_and_load_gives_everything_back() {
    let (cache_vol, core_vol, cache) = dirty_cache();
    cache.stop(true).unwrap();
    assert!(
        decode(&contents(&*core_vol)[..512], 0) == Some(5),
        "stop wrote dirty data to the core"
    );
    let cache = reload(&cache_vol, Some(core_vol.clone())).unwrap();
    assert_eq!(cache.id(), 7);
    assert_eq!(cache.mode(), CacheMode::Wb);
    assert_eq!(cache.stats().usage.dirty_lines, 0);
    // Clean lines survive a clean stop: the data is still cached.
    assert_eq!(cache.stats().usage.occupancy_lines, 8);
    assert!(stamps(&cache, 3, 0, 64).iter().all(|s| *s == Some(5)));
    cache.check_invariants();
}

#[test]
fn stop_without_data_flush_keeps_dirty_data_for_the_next_load() {
    let (cache_vol, core_vol, cache) = dirty_cache();
    cache.stop(false).unwrap();
    assert!(
        contents(&*core_vol).iter().all(|&b| b == 0),
        "the core must not have the data yet"
    );
    let cache = reload(&cache_vol, Some(core_vol.clone())).unwrap();
    assert_eq!(cache.stats().usage.dirty_lines, 8);
    assert!(stamps(&cache, 3, 0, 64).iter().all(|s| *s == Some(5)));
    cache.flush().unwrap();
    assert_eq!(decode(&contents(&*core_vol)[512..1024], 1), Some(5));
}

/// What `--zero-metadata` and `start-cache` tell the operator before destroying a cache: its
/// dirty lines per core, read from the device without loading it or writing to it.
#[test]
fn the_summary_counts_dirty_lines_without_loading_or_writing() {
    let (cache_vol, core_vol, cache) = dirty_cache();
    cache.stop(false).unwrap();
    let before = contents(&*cache_vol);
    let s = hybridcache_engine::read_summary(&*cache_vol)
        .unwrap()
        .expect("the volume holds a cache");
    assert_eq!(s.superblock.cache_id, 7);
    assert_eq!(s.dirty_lines.get(&3), Some(&8));
    assert_eq!(s.total_dirty_lines(), 8);
    assert_eq!(s.dirty_bytes(), 8 * 4096);
    assert!(contents(&*cache_vol) == before, "reading the summary wrote");
    // Flushed and stopped: still a cache, nothing dirty.
    let cache = reload(&cache_vol, Some(core_vol.clone())).unwrap();
    cache.stop(true).unwrap();
    let s = hybridcache_engine::read_summary(&*cache_vol)
        .unwrap()
        .expect("still a cache");
    assert_eq!(s.total_dirty_lines(), 0);
    hybridcache_engine::zero_metadata(&*cache_vol).unwrap();
    assert!(hybridcache_engine::read_summary(&*cache_vol)
        .unwrap()
        .is_none());
}

#[test]
fn a_volume_holding_a_cache_is_refused_unless_forced() {
    let (cache_vol, _core, cache) = dirty_cache();
    cache.stop(false).unwrap();
    let err = Cache::create(cache_vol.clone(), config(CacheMode::Wt), false)
        .err()
        .expect("refused");
    let msg = err.to_string();
    assert!(
        msg.contains("holds cache 7") && msg.contains("3 (core)"),
        "{msg}"
    );
    let forced = Cache::create(cache_vol.clone(), config(CacheMode::Wt), true).unwrap();
    assert!(forced.cores().is_empty());
    assert!(matches!(
        reload(&ram("empty", CACHE_BYTES), None),
        Err(EngineError::NoCache(_))
    ));
}

#[test]
fn a_missing_core_loads_inactive_keeps_its_dirty_data_and_comes_back() {
    let (cache_vol, core_vol, cache) = dirty_cache();
    cache.stop(false).unwrap();
    let cache = reload(&cache_vol, None).unwrap();
    let info = cache.cores();
    assert_eq!(info.len(), 1);
    assert_eq!(info[0].status, CoreStatus::Inactive);
    assert!(matches!(cache.core(3), Err(EngineError::CoreInactive(3))));
    assert_eq!(cache.stats().usage.dirty_lines, 8, "dirty data kept");
    cache.flush().unwrap(); // cannot clean an absent core, and must not fail or lose it
    assert_eq!(cache.stats().usage.dirty_lines, 8);
    let wrong = ram("other", CORE_BYTES * 2);
    assert!(matches!(
        cache.attach_core(3, wrong),
        Err(EngineError::CoreMismatch { .. })
    ));
    let moved = ram("core-moved", CORE_BYTES);
    moved.write_at(&contents(&*core_vol), 0).unwrap();
    cache.attach_core(3, moved.clone()).unwrap();
    assert_eq!(
        cache.superblock().unwrap().cores[0].path,
        "core-moved",
        "the new place is recorded"
    );
    assert!(stamps(&cache, 3, 0, 64).iter().all(|s| *s == Some(5)));
    cache.stop(true).unwrap();
    assert_eq!(decode(&contents(&*moved)[..512], 0), Some(5));
    assert_eq!(
        Cache::peek(&*cache_vol).unwrap().cores[0].path,
        "core-moved"
    );
    assert!(matches!(
        Cache::peek(&*ram("blank", CACHE_BYTES)),
        Err(EngineError::NoCache(_))
    ));
}

#[test]
fn a_core_of_the_wrong_size_is_refused_and_nothing_is_written() {
    let (cache_vol, _core, cache) = dirty_cache();
    cache.stop(false).unwrap();
    let before = contents(&*cache_vol);
    let wrong = ram("core", CORE_BYTES + 4096);
    let err = reload(&cache_vol, Some(wrong.clone()))
        .err()
        .expect("refused");
    assert!(err.to_string().contains("recorded 1048576 bytes"), "{err}");
    assert!(
        contents(&*cache_vol) == before,
        "a refused load wrote to the cache volume"
    );
    assert!(
        contents(&*wrong).iter().all(|&b| b == 0),
        "a refused load wrote to the core"
    );
}

#[test]
fn a_cache_volume_of_the_wrong_size_is_refused() {
    let (cache_vol, core_vol, cache) = dirty_cache();
    cache.stop(false).unwrap();
    let bigger = ram("cache", CACHE_BYTES + (1 << 20));
    bigger.write_at(&contents(&*cache_vol), 0).unwrap();
    let err = Cache::load(bigger, &mut |_| Some(core_vol.clone() as VolumeRef))
        .err()
        .expect("refused");
    assert!(
        err.to_string().contains("is this the right device"),
        "{err}"
    );
}

/// Flip one byte at `offset`.
fn flip(v: &RamVolume, offset: u64) {
    let mut b = vec![0u8; 512];
    let at = offset / 512 * 512;
    v.read_at(&mut b, at).unwrap();
    b[(offset - at) as usize] ^= 0x40;
    v.write_at(&b, at).unwrap();
}

#[test]
fn corrupt_superblocks_are_refused_with_where_and_what() {
    let (cache_vol, core_vol, cache) = dirty_cache();
    cache.stop(false).unwrap();
    // A damaged newest copy: the older copy still loads (it is a valid, earlier superblock of
    // the same cache; the metadata blocks decide the lines).
    let before = contents(&*cache_vol);
    flip(&cache_vol, 40);
    flip(&cache_vol, (1 << 20) + 40);
    let before_load = contents(&*cache_vol);
    let err = reload(&cache_vol, Some(core_vol.clone()))
        .err()
        .expect("refused");
    let msg = err.to_string();
    assert!(
        msg.contains("superblock copy A (offset 0): checksum mismatch")
            && msg.contains("superblock copy B (offset 1 MiB): checksum mismatch"),
        "{msg}"
    );
    assert!(contents(&*cache_vol) == before_load, "nothing written");
    assert!(
        contents(&*core_vol).iter().all(|&b| b == 0),
        "nothing written to the core"
    );
    // With one copy intact the cache loads.
    cache_vol.write_at(&before[..4096], 0).unwrap();
    let newest_ok = reload(&cache_vol, Some(core_vol.clone()));
    let other_ok = {
        cache_vol.write_at(&before_load[..4096], 0).unwrap();
        cache_vol
            .write_at(&before[1 << 20..(1 << 20) + 4096], 1 << 20)
            .unwrap();
        reload(&cache_vol, Some(core_vol.clone()))
    };
    assert!(newest_ok.is_ok() || other_ok.is_ok());
}

#[test]
fn a_metadata_block_damaged_in_both_copies_is_refused() {
    let (cache_vol, core_vol, cache) = dirty_cache();
    cache.stop(false).unwrap();
    // Block 0 lives at 2 MiB (copy 0) and 2 MiB + 512 (copy 1).
    flip(&cache_vol, (2 << 20) + 100);
    flip(&cache_vol, (2 << 20) + 512 + 100);
    let before = contents(&*cache_vol);
    let err = reload(&cache_vol, Some(core_vol.clone()))
        .err()
        .expect("refused");
    let msg = err.to_string();
    assert!(
        msg.contains("metadata block 0")
            && msg.contains("both copies")
            && msg.contains("at byte offset 2097152")
            && msg.contains("nothing was written"),
        "{msg}"
    );
    assert!(contents(&*cache_vol) == before);
    assert!(contents(&*core_vol).iter().all(|&b| b == 0));
}

/// The byte offset of the copy of metadata block `block` with the higher sequence number.
fn newest_copy(cache_vol: &RamVolume, block: u64) -> u64 {
    let c = contents(cache_vol);
    let at = |copy: u64| (2 << 20) + (block * 2 + copy) * 512;
    let seq = |copy: u64| {
        let o = at(copy) as usize;
        u64::from_le_bytes(c[o + 16..o + 24].try_into().unwrap())
    };
    if seq(1) > seq(0) {
        at(1)
    } else {
        at(0)
    }
}

/// Issue 13's reproduction: new data written and flushed in wb, `-T -n`, then one bit of the
/// sequence number of block 0's newest copy flipped. The older copy is valid, and loading it
/// served the core's old data. The commit record says which version must be found.
#[test]
fn damage_to_the_newest_copy_of_a_completed_commit_is_refused_not_rolled_back() {
    // 16 lines: one metadata block, whichever lines the writes get.
    let cache_vol = ram("cache", (3 << 20) + 16 * 4096);
    let core_vol = ram("core", CORE_BYTES);
    let mut old = vec![0u8; 8 * SECTOR];
    fill(&mut old, 1, 0);
    core_vol.write_at(&old, 0).unwrap();
    let cache = Cache::create(cache_vol.clone(), config(CacheMode::Wb), false).unwrap();
    cache.add_core(core_vol.clone(), Some(3)).unwrap();
    // Two commits touching block 0, so that both of its copies are valid versions.
    write_stamp(&cache, 3, 64, 8, 9);
    cache.core(3).unwrap().flush().unwrap();
    write_stamp(&cache, 3, 0, 8, 2);
    cache.core(3).unwrap().flush().unwrap();
    cache.stop(false).unwrap();
    drop(cache);
    let newest = newest_copy(&cache_vol, 0);
    flip(&cache_vol, newest + 17);
    let before = contents(&*cache_vol);
    let core_before = contents(&*core_vol);
    let err = reload(&cache_vol, Some(core_vol.clone()))
        .err()
        .expect("refused, not rolled back");
    let msg = err.to_string();
    assert!(
        msg.contains("does not match the last completed commit")
            && msg.contains("block 0 (lines 0..")
            && msg.contains(&format!("copy at byte offset {newest} checksum mismatch"))
            && msg.contains("nothing was written"),
        "{msg}"
    );
    assert!(
        contents(&*cache_vol) == before,
        "nothing written to the cache"
    );
    assert!(
        contents(&*core_vol) == core_before,
        "nothing written to the core"
    );
}

#[test]
fn mode_and_cores_survive_restart() {
    let cache_vol = ram("cache", CACHE_BYTES);
    let cores: Vec<Arc<RamVolume>> = (0..3)
        .map(|i| ram(&format!("core{i}"), CORE_BYTES))
        .collect();
    let cache = Cache::create(cache_vol.clone(), config(CacheMode::Wt), false).unwrap();
    for c in &cores {
        cache.add_core(c.clone(), None).unwrap();
    }
    cache.remove_core(2, false).unwrap();
    cache.set_mode(CacheMode::Wo, false).unwrap();
    write_stamp(&cache, 3, 10, 3, 9);
    drop(cache); // crash, not stop
    let cache = Cache::load(cache_vol, &mut |rec| {
        cores
            .iter()
            .find(|c| c.name() == rec.path)
            .map(|c| c.clone() as VolumeRef)
    })
    .unwrap();
    assert_eq!(cache.mode(), CacheMode::Wo);
    let ids: Vec<u16> = cache.cores().iter().map(|c| c.id).collect();
    assert_eq!(ids, vec![1, 3]);
}

#[test]
fn a_core_removal_that_cannot_be_recorded_leaves_the_core_attached() {
    let cache_vol = Arc::new(FaultyVolume::new(ram("cache", CACHE_BYTES)));
    let core_vol = ram("core", CORE_BYTES);
    let cache = Cache::create(cache_vol.clone(), config(CacheMode::Wt), false).unwrap();
    cache.add_core(core_vol.clone(), Some(3)).unwrap();
    write_stamp(&cache, 3, 0, 8, 4);
    cache_vol.set_config(FaultConfig {
        fail_flushes: true,
        ..FaultConfig::default()
    });
    assert!(
        cache.remove_core(3, false).is_err(),
        "the commit cannot complete"
    );
    // Still attached and serving; only its cached lines were dropped.
    assert!(stamps(&cache, 3, 0, 8).iter().all(|s| *s == Some(4)));
    cache_vol.set_config(FaultConfig::default());
    cache.remove_core(3, false).unwrap();
    assert!(cache.cores().is_empty());
    cache.check_invariants();
}

/// casadm allows core ids from 0 (OCF_CORE_ID_MIN): core 0 is an ordinary core, also across a
/// load with dirty data, next to another core (nothing takes 0 to mean "no core").
#[test]
fn core_id_0_keeps_its_dirty_data_across_a_load_and_is_flushed_and_removed() {
    let cache_vol = ram("cache", CACHE_BYTES);
    let core0 = ram("core0", CORE_BYTES);
    let core1 = ram("core1", CORE_BYTES);
    let cache = Cache::create(cache_vol.clone(), config(CacheMode::Wb), false).unwrap();
    cache.add_core(core0.clone(), Some(0)).unwrap();
    cache.add_core(core1.clone(), Some(1)).unwrap();
    write_stamp(&cache, 0, 0, 64, 9);
    write_stamp(&cache, 1, 0, 16, 4);
    assert_eq!(cache.core_stats(0).unwrap().usage.dirty_lines, 8);
    cache.stop(false).unwrap();
    assert!(contents(&*core0).iter().all(|&b| b == 0));

    let cache = Cache::load(cache_vol.clone(), &mut |rec| match rec.id {
        0 => Some(core0.clone() as VolumeRef),
        1 => Some(core1.clone() as VolumeRef),
        _ => None,
    })
    .unwrap();
    let ids: Vec<u16> = cache.cores().iter().map(|c| c.id).collect();
    assert_eq!(ids, [0, 1]);
    assert_eq!(cache.core_stats(0).unwrap().usage.dirty_lines, 8);
    assert_eq!(cache.core_stats(1).unwrap().usage.dirty_lines, 2);
    assert!(stamps(&cache, 0, 0, 64).iter().all(|s| *s == Some(9)));
    cache.check_invariants();

    // Dirty data keeps core 0 from going until it is flushed to core 0's device.
    assert!(matches!(
        cache.remove_core(0, false),
        Err(EngineError::CoreDirty { id: 0, .. })
    ));
    cache.flush_core(0).unwrap();
    assert_eq!(decode(&contents(&*core0)[512..1024], 1), Some(9));
    assert!(
        contents(&*core1).iter().all(|&b| b == 0),
        "core 1 untouched"
    );
    cache.remove_core(0, false).unwrap();
    let ids: Vec<u16> = cache.cores().iter().map(|c| c.id).collect();
    assert_eq!(ids, [1]);
    cache.check_invariants();
    cache.stop(false).unwrap();
    let cache = reload(&cache_vol, Some(core1.clone())).unwrap();
    let ids: Vec<u16> = cache.cores().iter().map(|c| c.id).collect();
    assert_eq!(ids, [1], "the removal of core 0 was recorded");
}

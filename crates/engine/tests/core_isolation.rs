//! One failing core cannot block the others: a flush on a core makes that core's acknowledged
//! writes durable whatever the state of the other cores, and a failing core's errors are counted
//! on that core.
//!
//! Core 1 sits behind a fault-injecting volume; every device is a `CrashVolume`, so a simulated
//! power cut at the end shows what the flushes really made durable.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use hybridcache_engine::{Cache, CacheConfig, CacheMode, CleaningPolicy, LineSize};
use hybridcache_volume::{
    CrashVolume, FaultConfig, FaultyVolume, RamVolume, Result as VolumeResult, Volume, VolumeRef,
};

mod durability;
use durability::{decode, fill, Model, SECTOR};

const CORE_BYTES: u64 = 1 << 20;

struct Rig {
    cache_media: Arc<CrashVolume>,
    core1_media: Arc<CrashVolume>,
    core1: Arc<FaultyVolume>,
    core2_media: Arc<CrashVolume>,
    cache: Cache,
}

fn crash_media(name: &str, size: u64) -> Arc<CrashVolume> {
    Arc::new(CrashVolume::new(Arc::new(
        RamVolume::new(name, size).unwrap(),
    )))
}

fn rig() -> Rig {
    let cache_media = crash_media("cache", (3 << 20) + 128 * 4096);
    let core1_media = crash_media("core1", CORE_BYTES);
    let core1 = Arc::new(FaultyVolume::new(core1_media.clone()));
    let core2_media = crash_media("core2", CORE_BYTES);
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
    // The test drives cleaning itself, with its own clock.
    cache.stop_background_cleaner();
    assert_eq!(cache.add_core(core1.clone(), Some(1)).unwrap(), 1);
    assert_eq!(cache.add_core(core2_media.clone(), Some(2)).unwrap(), 2);
    Rig {
        cache_media,
        core1_media,
        core1,
        core2_media,
        cache,
    }
}

fn write(cache: &Cache, core: u16, first: u64, count: u64, stamp: u32) {
    let mut buf = vec![0u8; count as usize * SECTOR];
    fill(&mut buf, stamp, first);
    cache.core(core).unwrap().write(&buf, first * 512).unwrap();
}

fn dead() -> FaultConfig {
    FaultConfig {
        fail_reads_in: Some(0..u64::MAX),
        fail_writes_in: Some(0..u64::MAX),
        fail_flushes: true,
        ..FaultConfig::default()
    }
}

/// Power cut on every device, then a load with core 1 healthy again; returns the loaded cache.
fn crash_and_load(rig: Rig) -> Cache {
    let Rig {
        cache_media,
        core1_media,
        core2_media,
        cache,
        ..
    } = rig;
    drop(cache);
    cache_media.crash(1).unwrap();
    core1_media.crash(2).unwrap();
    core2_media.crash(3).unwrap();
    Cache::load(cache_media, &mut |rec| {
        Some(if rec.id == 1 {
            core1_media.clone() as VolumeRef
        } else {
            core2_media.clone() as VolumeRef
        })
    })
    .unwrap()
}

fn check(cache: &Cache, core: u16, model: &Model) {
    let mut buf = vec![0u8; CORE_BYTES as usize];
    cache.core(core).unwrap().read(&mut buf, 0).unwrap();
    for (i, s) in buf.chunks(SECTOR).enumerate() {
        let got = decode(s, i as u64);
        assert!(
            matches!(got, Some(stamp) if model.allowed(i, stamp)),
            "core {core} sector {i} holds {got:?}; allowed: durable {} or written since {:?}",
            model.durable[i],
            model.since[i]
        );
    }
}

#[test]
fn a_dead_core_does_not_fail_another_cores_flush_and_loses_nothing() {
    let rig = rig();
    let cache = &rig.cache;
    let mut m1 = Model::new((CORE_BYTES / 512) as usize);
    let mut m2 = Model::new((CORE_BYTES / 512) as usize);
    write(cache, 1, 0, 64, 11);
    m1.write(0, 64, 11);
    write(cache, 2, 0, 64, 21);
    m2.write(0, 64, 21);
    cache.core(1).unwrap().flush().unwrap();
    m1.flushed();
    m2.flushed();

    // Core 1's device goes: every request fails, flushes too.
    rig.core1.set_config(dead());
    // Core 1 may still take writes into the cache (write-back), but cleaning them fails.
    write(cache, 1, 64, 64, 12);
    m1.write(64, 64, 12);
    assert!(cache.flush_core(1).is_err(), "core 1 cannot be flushed");
    // Core 2 keeps writing and flushing, through flushes of its own and cleaning to its core.
    for round in 0..4u32 {
        write(cache, 2, 64 + round as u64 * 16, 16, 30 + round);
        m2.write(64 + round as u64 * 16, 16, 30 + round);
        cache
            .core(2)
            .unwrap()
            .flush()
            .unwrap_or_else(|e| panic!("round {round}: core 2's flush failed: {e}"));
        m2.flushed();
    }
    cache
        .flush_core(2)
        .unwrap_or_else(|e| panic!("flushing core 2's dirty data failed: {e}"));
    assert_eq!(cache.core_stats(2).unwrap().usage.dirty_lines, 0);
    // A flush on core 1 reports core 1's failure.
    assert!(cache.core(1).unwrap().flush().is_err());
    let e1 = cache.core_stats(1).unwrap().errors;
    let e2 = cache.core_stats(2).unwrap().errors;
    assert!(
        e1.core_write > 0,
        "core 1's errors are counted on core 1: {e1:?}"
    );
    assert_eq!(e2.core_write + e2.core_read, 0, "and not on core 2: {e2:?}");
    // Core 1's dirty data stays dirty in the cache.
    assert_eq!(cache.core_stats(1).unwrap().usage.dirty_lines, 16);

    let cache = crash_and_load(rig);
    check(&cache, 2, &m2);
    // Core 1 never lost what was flushed before it failed, nor the dirty data it kept.
    check(&cache, 1, &m1);
    let mut buf = vec![0u8; 64 * SECTOR];
    cache.core(1).unwrap().read(&mut buf, 64 * 512).unwrap();
    assert!(
        buf.chunks(SECTOR)
            .enumerate()
            .all(|(i, s)| decode(s, 64 + i as u64) == Some(12)
                || decode(s, 64 + i as u64) == Some(0)),
        "core 1's unflushed dirty data is either there or never written"
    );
}

/// Core 1's cleaning writes reach its device, but the flush that would make them durable fails.
/// The lines are clean in RAM; the metadata must still record them dirty, or a power cut that
/// drops core 1's unflushed writes loses data that was flushed into the cache.
#[test]
fn lines_cleaned_to_a_core_whose_flush_fails_stay_dirty_on_the_device() {
    let rig = rig();
    let cache = &rig.cache;
    let mut m1 = Model::new((CORE_BYTES / 512) as usize);
    let mut m2 = Model::new((CORE_BYTES / 512) as usize);
    write(cache, 1, 0, 64, 11);
    m1.write(0, 64, 11);
    write(cache, 2, 0, 8, 21);
    m2.write(0, 8, 21);
    cache.core(1).unwrap().flush().unwrap();
    m1.flushed();
    m2.flushed();
    rig.core1.set_config(FaultConfig {
        fail_flushes: true,
        ..FaultConfig::default()
    });
    assert!(cache.flush_core(1).is_err(), "core 1's flush fails");
    write(cache, 2, 8, 8, 22);
    m2.write(8, 8, 22);
    cache.core(2).unwrap().flush().unwrap();
    m2.flushed();
    let cache = crash_and_load(rig);
    check(&cache, 1, &m1);
    check(&cache, 2, &m2);
}

/// Background cleaning with acp, which picks the dirtiest chunk: core 1's. Its writes fail; the
/// cleaner must go on to core 2 instead of trying core 1 forever.
#[test]
fn the_cleaner_is_not_wedged_by_a_dead_core() {
    let rig = rig();
    let cache = &rig.cache;
    let mut c = cache.cleaning();
    c.policy = CleaningPolicy::Acp;
    cache.set_cleaning(c).unwrap();
    write(cache, 1, 0, 512, 11);
    write(cache, 2, 0, 64, 21);
    rig.core1.set_config(dead());
    let mut t = 0;
    for _ in 0..50 {
        t += 1000;
        cache.cleaner_tick(t);
    }
    assert_eq!(
        cache.core_stats(2).unwrap().usage.dirty_lines,
        0,
        "core 2 was cleaned"
    );
    assert_eq!(cache.core_stats(1).unwrap().usage.dirty_lines, 64);
    cache.core(2).unwrap().flush().unwrap();
}

/// Every cache line holds dirty data of core 1 when its device dies. Room cannot be made by
/// cleaning core 1's lines; core 2's writes must still succeed (they go around the cache), read
/// back, and survive a power cut once flushed.
#[test]
fn a_cache_full_of_a_dead_cores_dirty_data_still_serves_the_other_core() {
    let rig = rig();
    let cache = &rig.cache;
    let mut m1 = Model::new((CORE_BYTES / 512) as usize);
    let mut m2 = Model::new((CORE_BYTES / 512) as usize);
    // 128 lines of 4 KiB: the whole cache.
    write(cache, 1, 0, 1024, 11);
    m1.write(0, 1024, 11);
    cache.core(1).unwrap().flush().unwrap();
    m1.flushed();
    assert_eq!(cache.core_stats(1).unwrap().usage.dirty_lines, 128);
    rig.core1.set_config(dead());
    // The first write that needs room finds out that core 1 is dead; from then on its lines are
    // passed by.
    for round in 0..8u64 {
        write(cache, 2, round * 64, 64, 40 + round as u32);
        m2.write(round * 64, 64, 40 + round as u32);
        cache.core(2).unwrap().flush().unwrap();
        m2.flushed();
    }
    check(cache, 2, &m2);
    assert_eq!(cache.core_stats(1).unwrap().usage.dirty_lines, 128);
    let cache = crash_and_load(rig);
    check(&cache, 1, &m1);
    check(&cache, 2, &m2);
}

/// A core volume that counts the flushes reaching it.
struct FlushCounting {
    inner: VolumeRef,
    flushes: AtomicU64,
}

impl Volume for FlushCounting {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> VolumeResult<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> VolumeResult<()> {
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> VolumeResult<()> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> VolumeResult<()> {
        self.inner.discard(offset, len)
    }
}

fn counting(name: &str) -> Arc<FlushCounting> {
    Arc::new(FlushCounting {
        inner: Arc::new(RamVolume::new(name, CORE_BYTES).unwrap()),
        flushes: AtomicU64::new(0),
    })
}

/// A flush of a core device costs a round trip (and, for a remote or failing core, may never
/// return): a commit flushes only the cores its cleaning wrote to since their last flush. Core 1
/// was written and flushed once, then stays idle while core 2 is written, flushed, cleaned by
/// hand and by the background cleaner: none of that reaches core 1's device.
#[test]
fn a_commit_flushes_only_the_cores_written_since_their_last_flush() {
    let cache = Cache::create(
        Arc::new(RamVolume::new("cache", (3 << 20) + 128 * 4096).unwrap()),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        },
        false,
    )
    .unwrap();
    // The test drives the cleaner with its own clock; acp cleans whatever is dirty at once.
    cache.stop_background_cleaner();
    let mut c = cache.cleaning();
    c.policy = CleaningPolicy::Acp;
    cache.set_cleaning(c).unwrap();
    let core1 = counting("core1");
    let core2 = counting("core2");
    assert_eq!(cache.add_core(core1.clone(), Some(1)).unwrap(), 1);
    assert_eq!(cache.add_core(core2.clone(), Some(2)).unwrap(), 2);
    write(&cache, 1, 0, 64, 11);
    cache.flush_core(1).unwrap();
    assert_eq!(cache.core_stats(1).unwrap().usage.dirty_lines, 0);
    let idle_from = core1.flushes.load(Ordering::SeqCst);
    let core2_from = core2.flushes.load(Ordering::SeqCst);

    let mut t = 0;
    for round in 0..4u64 {
        write(&cache, 2, round * 64, 64, 20 + round as u32);
        cache.core(2).unwrap().flush().unwrap();
        for _ in 0..20 {
            t += 1000;
            cache.cleaner_tick(t);
        }
        write(&cache, 2, 512 + round * 64, 64, 30 + round as u32);
        cache.flush_core(2).unwrap();
    }
    assert_eq!(cache.core_stats(2).unwrap().usage.dirty_lines, 0);
    // The count can see flushes: core 2's cleaning made its device flush.
    assert!(core2.flushes.load(Ordering::SeqCst) > core2_from);
    assert_eq!(
        core1.flushes.load(Ordering::SeqCst) - idle_from,
        0,
        "the idle core 1 was flushed"
    );
}

//! Fallback pass-through (fallback.rs): a cache device whose errors within a window reach the
//! threshold stops taking new I/O; clean data keeps coming from the core, and dirty data whose
//! read fails is named.

use std::sync::Arc;
use std::time::Duration;

use hybridcache_engine::{Cache, CacheConfig, CacheMode, FallbackPt, LineSize, UnreadableDirty};
use hybridcache_volume::{FaultConfig, FaultyVolume, RamVolume, VolumeRef};

const LINE: usize = 4096;
const CORE_BYTES: u64 = 1 << 20;

struct Rig {
    cache_dev: Arc<FaultyVolume>,
    core_dev: VolumeRef,
    cache: Cache,
    /// What every byte of the core must read as through the cache.
    model: Vec<u8>,
}

fn rig(mode: CacheMode, threshold: u32, window_s: u32) -> Rig {
    let cache_dev = Arc::new(FaultyVolume::new(Arc::new(
        RamVolume::new("cache", 256 * LINE as u64).unwrap(),
    )));
    let core_dev: VolumeRef = Arc::new(RamVolume::new("core", CORE_BYTES).unwrap());
    let cache = Cache::new(
        cache_dev.clone(),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode,
        },
    )
    .unwrap();
    cache.stop_background_cleaner();
    cache.stop_background_prefetch();
    cache.add_core(core_dev.clone(), Some(1)).unwrap();
    cache
        .set_fallback_pt(FallbackPt {
            threshold,
            window_s,
        })
        .unwrap();
    Rig {
        cache_dev,
        core_dev,
        cache,
        model: vec![0; CORE_BYTES as usize],
    }
}

impl Rig {
    fn write_line(&mut self, line: usize, stamp: u8) {
        let buf = vec![stamp; LINE];
        self.cache
            .core(1)
            .unwrap()
            .write(&buf, (line * LINE) as u64)
            .unwrap();
        self.model[line * LINE..(line + 1) * LINE].copy_from_slice(&buf);
    }

    fn read_line(&self, line: usize) -> hybridcache_engine::Result<Vec<u8>> {
        let mut buf = vec![0u8; LINE];
        self.cache
            .core(1)
            .unwrap()
            .read(&mut buf, (line * LINE) as u64)?;
        Ok(buf)
    }

    fn check_line(&self, line: usize) {
        let got = self.read_line(line).expect("a clean line reads");
        assert!(
            got == self.model[line * LINE..(line + 1) * LINE],
            "line {line} reads wrong data"
        );
    }

    fn fail(&self, config: FaultConfig) {
        self.cache_dev.set_config(config);
    }

    fn occupancy(&self) -> u64 {
        self.cache.stats().usage.occupancy_lines
    }
}

fn dead() -> FaultConfig {
    FaultConfig {
        fail_reads_in: Some(0..u64::MAX),
        fail_writes_in: Some(0..u64::MAX),
        ..FaultConfig::default()
    }
}

#[test]
fn errors_below_the_threshold_keep_caching() {
    let mut r = rig(CacheMode::Wt, 3, 0);
    for line in 0..4 {
        r.write_line(line, line as u8 + 1);
    }
    r.fail(FaultConfig {
        fail_next_reads: 2,
        ..FaultConfig::default()
    });
    r.check_line(0);
    r.check_line(1);
    let s = r.cache.fallback_status();
    assert_eq!((s.errors, s.active), (2, false), "{s:?}");
    assert_eq!(r.cache.mode(), CacheMode::Wt);
    let before = r.occupancy();
    r.write_line(50, 0x50);
    assert_eq!(r.occupancy(), before + 1, "a new write is still cached");
    r.check_line(50);
}

#[test]
fn reaching_the_threshold_turns_new_io_into_pass_through() {
    let mut r = rig(CacheMode::Wt, 2, 0);
    for line in 0..8 {
        r.write_line(line, line as u8 + 1);
    }
    r.fail(FaultConfig {
        fail_next_reads: 2,
        ..FaultConfig::default()
    });
    r.check_line(0);
    r.check_line(1);
    let s = r.cache.fallback_status();
    assert!(s.active && s.errors == 2, "{s:?}");
    assert_eq!(r.cache.mode(), CacheMode::Wt, "the mode set stays");

    // The device now fails everything: new writes and reads must not touch it at all.
    r.fail(dead());
    let faults = r.cache_dev.injected_faults();
    let before = r.occupancy();
    for line in 100..110 {
        r.write_line(line, (line as u8).wrapping_add(0xa0));
    }
    r.write_line(3, 0x33);
    for line in (100..110).chain(0..8) {
        r.check_line(line);
    }
    assert_eq!(
        r.cache_dev.injected_faults(),
        faults,
        "pass-through sent I/O to the failing cache device"
    );
    assert!(r.occupancy() <= before, "pass-through inserted lines");
    // The core itself holds every write.
    let mut core = vec![0u8; CORE_BYTES as usize];
    r.core_dev.read_at(&mut core, 0).unwrap();
    assert!(core == r.model, "the core misses pass-through writes");
}

#[test]
fn dirty_lines_whose_read_fails_are_reported() {
    let mut r = rig(CacheMode::Wb, 1, 0);
    // Clean cached lines: written to the core behind the cache's back, then read in.
    let clean = vec![0xc1u8; 3 * LINE];
    r.core_dev.write_at(&clean, 10 * LINE as u64).unwrap();
    r.model[10 * LINE..13 * LINE].copy_from_slice(&clean);
    for line in 10..13 {
        r.check_line(line);
    }
    for line in 0..4 {
        r.write_line(line, 0xd0 + line as u8);
    }
    assert_eq!(r.cache.stats().usage.dirty_lines, 4);

    r.fail(FaultConfig {
        fail_reads_in: Some(0..u64::MAX),
        ..FaultConfig::default()
    });
    for line in 10..13 {
        r.check_line(line);
    }
    assert!(r.cache.fallback_status().active);
    assert!(
        r.read_line(2).is_err(),
        "a lost dirty line reads as an error"
    );
    assert!(
        r.cache.flush().is_err(),
        "cleaning cannot read the dirty lines"
    );
    let s = r.cache.fallback_status();
    assert_eq!(
        (s.unreadable_dirty_lines, s.unreadable_dirty_bytes),
        (4, 4 * LINE as u64),
        "{s:?}"
    );
    let mut found = r.cache.take_unreadable_dirty();
    found.sort_by_key(|u| u.core_offset);
    let lines: Vec<u64> = found.iter().map(|u| u.core_offset / LINE as u64).collect();
    assert_eq!(lines, vec![0, 1, 2, 3], "{found:?}");
    assert!(found.iter().all(|u| *u
        == UnreadableDirty {
            core: 1,
            core_offset: u.core_offset,
            len: LINE as u64
        }));
    // Found again by the next cleaning, but named once.
    let _ = r.cache.flush();
    assert!(r.cache.take_unreadable_dirty().is_empty());

    // The device heals: the dirty data was never lost, only unreadable for a while.
    r.fail(FaultConfig::default());
    r.check_line(2);
}

#[test]
fn old_errors_expire_with_the_window() {
    let mut r = rig(CacheMode::Wt, 2, 1);
    r.write_line(0, 1);
    r.fail(FaultConfig {
        fail_next_reads: 1,
        ..FaultConfig::default()
    });
    r.check_line(0);
    assert_eq!(r.cache.fallback_status().errors, 1);
    std::thread::sleep(Duration::from_millis(1100));
    assert_eq!(r.cache.fallback_status().errors, 0, "the error aged out");
    r.fail(FaultConfig {
        fail_next_reads: 1,
        ..FaultConfig::default()
    });
    r.check_line(0);
    let s = r.cache.fallback_status();
    assert!(!s.active && s.errors == 1, "{s:?}");
    r.fail(FaultConfig {
        fail_next_reads: 1,
        ..FaultConfig::default()
    });
    r.check_line(0);
    assert!(r.cache.fallback_status().active);
}

#[test]
fn reset_or_a_higher_threshold_leaves_the_fallback() {
    let mut r = rig(CacheMode::Wt, 1, 0);
    r.write_line(0, 1);
    r.fail(FaultConfig {
        fail_next_reads: 1,
        ..FaultConfig::default()
    });
    r.check_line(0);
    assert!(r.cache.fallback_status().active);
    let before = r.occupancy();
    r.write_line(5, 5);
    assert_eq!(r.occupancy(), before, "pass-through");
    r.cache.reset_stats();
    let s = r.cache.fallback_status();
    assert!(!s.active && s.errors == 0, "{s:?}");
    r.write_line(6, 6);
    assert_eq!(r.occupancy(), before + 1, "caching again after the reset");

    r.fail(FaultConfig {
        fail_next_reads: 1,
        ..FaultConfig::default()
    });
    r.check_line(0);
    assert!(r.cache.fallback_status().active);
    r.cache
        .set_fallback_pt(FallbackPt {
            threshold: 5,
            window_s: 0,
        })
        .unwrap();
    assert!(!r.cache.fallback_status().active);
    let before = r.occupancy();
    r.write_line(7, 7);
    assert_eq!(r.occupancy(), before + 1, "caching again");
}

//! The mirror (issue 34; docs/format.md, "The mirror"): a write-back cache whose dirty data and
//! metadata also go to a second device keeps every acknowledged write when either device fails,
//! and comes back from the mirror alone after a power cut.
//!
//! The live tests run random writes, reads and flushes against a byte model of the core, fail
//! one device (a `FaultyVolume` failing everything), go on, and check that every read matches
//! the model, and that after `Cache::flush` the core device alone holds it. The crash test cuts
//! the power of all three devices at a random operation (as tests/crash.rs does) and loads the
//! cache from the mirror alone, or from both: every write flushed before the cut is there.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use hybridcache_engine::{
    Cache, CacheConfig, CacheMode, CleaningPolicy, Core, LazyFlush, LineSize, MirrorLostPolicy,
    MirrorState,
};
use hybridcache_volume::{CrashVolume, FaultConfig, FaultyVolume, RamVolume, Volume, VolumeRef};

mod durability;
use durability::{decode, fail_everything, fill, power_cut, Model, Mortal, Rng, SECTOR};

const MIB: u64 = 1 << 20;

struct Live {
    cache: Cache,
    core: Core,
    primary: Arc<FaultyVolume>,
    mirror: Arc<FaultyVolume>,
    core_media: Arc<RamVolume>,
    model: Vec<u8>,
    rng: Rng,
    stamp: u32,
}

impl Live {
    fn new(seed: u64, policy: MirrorLostPolicy) -> Live {
        let mut rng = Rng(seed);
        let line_kib = LineSize::ALL_KIB[rng.below(5) as usize];
        // A few lines: writes evict, clean and reuse lines all the time.
        let lines = [4, 16, 64][rng.below(3) as usize];
        let cache_bytes = 3 * MIB + lines * line_kib as u64 * 1024;
        let primary = Arc::new(FaultyVolume::new(Arc::new(
            RamVolume::new("primary", cache_bytes).unwrap(),
        )));
        // A larger mirror is fine: line for line, its extra bytes stay unused.
        let mirror = Arc::new(FaultyVolume::new(Arc::new(
            RamVolume::new("mirror", cache_bytes + rng.below(2) * MIB).unwrap(),
        )));
        let core_media = Arc::new(RamVolume::new("core", 2 * MIB).unwrap());
        let cache = Cache::create_mirrored(
            primary.clone(),
            mirror.clone(),
            CacheConfig {
                id: 1,
                line_size: LineSize::from_kib(line_kib).unwrap(),
                mode: CacheMode::Wb,
            },
            false,
            policy,
        )
        .unwrap();
        let id = cache.add_core(core_media.clone(), None).unwrap();
        let core = cache.core(id).unwrap();
        Live {
            cache,
            core,
            primary,
            mirror,
            core_media,
            model: vec![0; 2 * MIB as usize],
            rng,
            stamp: 0,
        }
    }

    /// `ops` random writes, reads (checked against the model) and flushes.
    fn run(&mut self, ops: usize, when: &str) {
        let sectors = self.model.len() as u64 / 512;
        for _ in 0..ops {
            let first = self.rng.below(sectors - 256);
            let count = 1 + self.rng.below(255);
            let (off, len) = (first * 512, (count * 512) as usize);
            match self.rng.below(10) {
                0..=4 => self.write(first, count, when),
                5..=8 => {
                    let mut buf = vec![0u8; len];
                    self.core
                        .read(&mut buf, off)
                        .unwrap_or_else(|e| panic!("{when}: read at {off}: {e}"));
                    self.check(&buf, first, when);
                }
                _ => self
                    .core
                    .flush()
                    .unwrap_or_else(|e| panic!("{when}: flush: {e}")),
            }
        }
    }

    fn write(&mut self, first: u64, count: u64, when: &str) {
        let (off, len) = (first * 512, (count * 512) as usize);
        self.stamp += 1;
        let mut buf = vec![0u8; len];
        fill(&mut buf, self.stamp, first);
        self.core
            .write(&buf, off)
            .unwrap_or_else(|e| panic!("{when}: write at {off}: {e}"));
        self.model[off as usize..off as usize + len].copy_from_slice(&buf);
    }

    fn check(&self, buf: &[u8], first: u64, when: &str) {
        for (i, s) in buf.chunks(SECTOR).enumerate() {
            let sec = first as usize + i;
            let want = &self.model[sec * SECTOR..(sec + 1) * SECTOR];
            assert!(
                s == want,
                "{when}: sector {sec} holds {:?}, the model {:?}",
                decode(s, sec as u64),
                decode(want, sec as u64)
            );
        }
    }

    fn check_all(&self, when: &str) {
        let mut buf = vec![0u8; self.model.len()];
        self.core
            .read(&mut buf, 0)
            .unwrap_or_else(|e| panic!("{when}: read: {e}"));
        self.check(&buf, 0, when);
    }

    /// Flush everything to the core, then read the core device itself.
    fn check_core_alone(&self, when: &str) {
        self.cache
            .flush()
            .unwrap_or_else(|e| panic!("{when}: flush: {e}"));
        assert_eq!(
            self.cache.stats().usage.dirty_lines,
            0,
            "{when}: dirty left"
        );
        let mut buf = vec![0u8; self.model.len()];
        self.core_media.read_at(&mut buf, 0).unwrap();
        self.check(&buf, 0, &format!("{when}, the core device alone"));
    }
}

#[test]
fn primary_lost_every_acknowledged_write_reads_back_and_drains_to_the_core() {
    for seed in 0..12u64 {
        let mut t = Live::new(0x3100 + seed, MirrorLostPolicy::Drain);
        // Deterministic: no background cleaning, and writes wait for room instead of going
        // around the cache, so the last write is dirty when the primary fails. The drain at the
        // end (`Cache::flush`) is cleaning's code, reading from the mirror.
        t.cache.stop_background_cleaner();
        t.cache
            .set_lazy_flush(LazyFlush { enabled: false })
            .unwrap();
        t.run(150, &format!("seed {seed}, redundant"));
        t.write(8, 16, "the last write before the failure");
        assert!(
            t.cache.stats().usage.dirty_lines > 0,
            "seed {seed}: nothing dirty to lose"
        );
        t.primary.set_config(fail_everything());
        t.check_all(&format!("seed {seed}, primary just failed"));
        let st = t.cache.mirror_status().unwrap();
        assert_eq!(st.state, MirrorState::PrimaryLost, "seed {seed}");
        assert!(st.reason.unwrap().contains("primary"), "seed {seed}");
        assert_eq!(
            t.cache.mode(),
            CacheMode::Pt,
            "seed {seed}: serves around the cache"
        );
        assert_eq!(t.cache.configured_mode(), CacheMode::Wb, "seed {seed}");
        t.run(150, &format!("seed {seed}, primary lost"));
        t.check_all(&format!("seed {seed}, primary lost"));
        t.check_core_alone(&format!("seed {seed}, primary lost"));
    }
}

#[test]
fn mirror_lost_keeps_serving_and_drains_by_default() {
    for seed in 0..12u64 {
        let mut t = Live::new(0x3200 + seed, MirrorLostPolicy::Drain);
        t.run(150, &format!("seed {seed}, redundant"));
        t.mirror.set_config(fail_everything());
        t.run(150, &format!("seed {seed}, mirror failing"));
        let st = t.cache.mirror_status().unwrap();
        assert_eq!(st.state, MirrorState::MirrorLost, "seed {seed}");
        assert_eq!(
            t.cache.mode(),
            CacheMode::Wt,
            "seed {seed}: drain runs write-through"
        );
        // The cleaner drains what is dirty (background thread; wait for it).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        while t.cache.stats().usage.dirty_lines > 0 && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        assert_eq!(
            t.cache.stats().usage.dirty_lines,
            0,
            "seed {seed}: the drain left dirty lines"
        );
        t.check_all(&format!("seed {seed}, mirror lost"));
        // The primary's superblock says the mirror is stale: a load with it is refused.
        assert!(
            t.cache.superblock().unwrap().mirror.unwrap().lost,
            "seed {seed}"
        );
        t.check_core_alone(&format!("seed {seed}, mirror lost"));
    }
}

#[test]
fn mirror_lost_with_keep_stays_write_back() {
    let mut t = Live::new(0x3300, MirrorLostPolicy::Keep);
    t.run(100, "redundant");
    t.mirror.set_config(fail_everything());
    t.run(200, "mirror lost, keep");
    assert_eq!(
        t.cache.mirror_status().unwrap().state,
        MirrorState::MirrorLost
    );
    assert_eq!(t.cache.mode(), CacheMode::Wb);
    t.check_all("mirror lost, keep");
    t.check_core_alone("mirror lost, keep");
}

#[test]
fn a_failed_primary_read_of_a_dirty_line_is_served_from_the_mirror() {
    let mut t = Live::new(0x3400, MirrorLostPolicy::Drain);
    t.cache.stop_background_cleaner();
    t.run(100, "redundant");
    // Reads only fail: the first failed read loses the primary.
    t.primary.set_config(FaultConfig {
        fail_reads_in: Some(3 * MIB..u64::MAX),
        ..FaultConfig::default()
    });
    t.check_all("primary reads failing");
    assert_eq!(
        t.cache.mirror_status().unwrap().state,
        MirrorState::PrimaryLost
    );
}

/// The pairing is checked: a foreign mirror, a mirror loaded as a cache device, and a stale
/// mirror are refused, saying why.
#[test]
fn a_load_checks_that_the_two_devices_belong_together() {
    let mk = |name: &str| -> Arc<RamVolume> { Arc::new(RamVolume::new(name, 4 * MIB).unwrap()) };
    let (p1, m1, p2, m2) = (mk("p1"), mk("m1"), mk("p2"), mk("m2"));
    let core_media = Arc::new(RamVolume::new("core", MIB).unwrap());
    let config = CacheConfig {
        id: 1,
        line_size: LineSize::from_kib(4).unwrap(),
        mode: CacheMode::Wb,
    };
    for (p, m) in [(&p1, &m1), (&p2, &m2)] {
        let c = Cache::create_mirrored(
            p.clone(),
            m.clone(),
            config.clone(),
            false,
            MirrorLostPolicy::Drain,
        )
        .unwrap();
        c.add_core(core_media.clone(), None).unwrap();
        c.stop(false).unwrap();
    }
    let mut open = |_: &_| Some(core_media.clone() as VolumeRef);
    let foreign = Cache::load_mirrored(p1.clone(), m2.clone(), &mut open, Default::default())
        .err()
        .expect("a foreign mirror is refused")
        .to_string();
    assert!(
        foreign.contains("is not the mirror of cache 1"),
        "{foreign}"
    );
    let as_cache = Cache::load(m1.clone(), &mut open)
        .err()
        .expect("a mirror is not a cache device")
        .to_string();
    assert!(as_cache.contains("--load-mirror"), "{as_cache}");
    let not_mirror = Cache::load_mirror(p1.clone(), &mut open)
        .err()
        .expect("a primary is not a mirror")
        .to_string();
    assert!(not_mirror.contains("not the mirror"), "{not_mirror}");
    // Both together load; a load without the mirror makes it stale.
    let c = Cache::load_mirrored(p1.clone(), m1.clone(), &mut open, Default::default()).unwrap();
    assert_eq!(c.mirror_status().unwrap().state, MirrorState::Redundant);
    c.stop(false).unwrap();
    drop(c);
    let c = Cache::load(p1.clone(), &mut open).unwrap();
    c.stop(false).unwrap();
    drop(c);
    let stale = Cache::load_mirrored(p1.clone(), m1.clone(), &mut open, Default::default())
        .err()
        .expect("a stale mirror is refused")
        .to_string();
    assert!(stale.contains("stale"), "{stale}");
}

/// A clean stop leaves clean lines on the primary, which the mirror never got: loaded alone, the
/// mirror must not serve them (its copy of their lines is stale or empty).
#[test]
fn the_mirror_alone_never_serves_a_clean_line() {
    let primary = Arc::new(RamVolume::new("primary", 4 * MIB).unwrap());
    let mirror = Arc::new(RamVolume::new("mirror", 4 * MIB).unwrap());
    let core_media = Arc::new(RamVolume::new("core", MIB).unwrap());
    let cache = Cache::create_mirrored(
        primary.clone(),
        mirror.clone(),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        },
        false,
        MirrorLostPolicy::Drain,
    )
    .unwrap();
    let id = cache.add_core(core_media.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    let mut a = vec![0u8; 8192];
    fill(&mut a, 1, 0);
    core.write(&a, 0).unwrap();
    cache.flush().unwrap();
    // Now clean, then written around the cache straight on the core device (as another host
    // may after failover): the cache's copy is stale, and a load that trusted it would show it.
    let mut b = vec![0u8; 8192];
    fill(&mut b, 2, 0);
    let mut c = vec![0u8; 4096];
    fill(&mut c, 3, 32);
    core.write(&c, 32 * 512).unwrap();
    core.flush().unwrap();
    drop(core);
    cache.stop(false).unwrap();
    drop(cache);
    core_media.write_at(&b, 0).unwrap();
    let cache = Cache::load_mirror(mirror.clone(), &mut |_| {
        Some(core_media.clone() as VolumeRef)
    })
    .unwrap();
    cache.check_invariants();
    let core = cache.core(id).unwrap();
    let mut got = vec![0u8; 8192];
    core.read(&mut got, 0).unwrap();
    assert!(
        got == b,
        "the mirror served a clean line: {:?}",
        decode(&got[..512], 0)
    );
    let mut got = vec![0u8; 4096];
    core.read(&mut got, 32 * 512).unwrap();
    assert!(
        got == c,
        "the dirty line is lost: {:?}",
        decode(&got[..512], 32)
    );
    assert!(cache.mirror_status().is_none());
}

struct Rig {
    primary: Arc<CrashVolume>,
    mirror: Arc<CrashVolume>,
    core: Arc<CrashVolume>,
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

/// One power cut of a mirrored cache, then a load from the mirror alone (`alone`) or from both.
fn crash_round(seed: u64, alone: bool) {
    let mut rng = Rng(seed);
    let line_kib = LineSize::ALL_KIB[rng.below(5) as usize];
    let line = line_kib as u64 * 1024;
    let cache_lines = [2, 4, 16][rng.below(3) as usize];
    let core_bytes = [256 << 10, 1 << 20][rng.below(2) as usize];
    let media = |name: &str, bytes: u64| {
        Arc::new(CrashVolume::new(Arc::new(
            RamVolume::new(name, bytes).unwrap(),
        )))
    };
    let rig = Rig {
        primary: media("primary", 3 * MIB + cache_lines * line),
        mirror: media("mirror", 3 * MIB + cache_lines * line),
        core: media("core", core_bytes),
        budget: Arc::new(AtomicI64::new(i64::MAX)),
    };
    let cache = Cache::create_mirrored(
        rig.mortal(&rig.primary),
        rig.mortal(&rig.mirror),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(line_kib).unwrap(),
            mode: CacheMode::Wb,
        },
        false,
        MirrorLostPolicy::Drain,
    )
    .unwrap();
    let id = cache.add_core(rig.mortal(&rig.core), None).unwrap();
    let core = cache.core(id).unwrap();
    cache.stop_background_cleaner();
    cache.stop_background_prefetch();
    let sectors = core_bytes / 512;
    let mut model = Model::new(sectors as usize);
    for v in [&rig.primary, &rig.mirror, &rig.core] {
        v.flush().unwrap();
    }
    rig.budget.store(rng.below(400) as i64, Ordering::SeqCst);
    let mut stamp = 0u32;
    let mut now_ms = 0;
    for _ in 0..80 {
        if rig.budget.load(Ordering::SeqCst) <= 0 {
            break;
        }
        let region = sectors.min(64 * 8);
        let first = rng.below(region);
        let count = (1 + rng.below(24)).min(sectors - first);
        let dead_before = rig.budget.load(Ordering::SeqCst) <= 0;
        let durable_point = match rng.below(100) {
            0..=59 => {
                stamp += 1;
                let mut buf = vec![0u8; (count * 512) as usize];
                fill(&mut buf, stamp, first);
                core.write(&buf, first * 512).unwrap();
                model.write(first, count, stamp);
                false
            }
            60..=74 => {
                let mut buf = vec![0u8; (count * 512) as usize];
                core.read(&mut buf, first * 512).unwrap();
                false
            }
            75..=89 => {
                core.flush().unwrap();
                true
            }
            90..=94 => {
                now_ms += rng.below(2500);
                cache.cleaner_tick(now_ms);
                false
            }
            _ => {
                cache.flush().unwrap();
                true
            }
        };
        if durable_point && !dead_before && rig.budget.load(Ordering::SeqCst) > 0 {
            model.flushed();
        }
    }
    drop(core);
    power_cut(&rig.budget);
    drop(cache);
    rig.primary.crash(rng.next_u64()).unwrap();
    rig.mirror.crash(rng.next_u64()).unwrap();
    rig.core.crash(rng.next_u64()).unwrap();
    let core_media = rig.core.clone();
    let mut open = |_: &_| Some(core_media.clone() as VolumeRef);
    let cache = if alone {
        Cache::load_mirror(rig.mirror.clone(), &mut open)
    } else {
        Cache::load_mirrored(
            rig.primary.clone(),
            rig.mirror.clone(),
            &mut open,
            MirrorLostPolicy::Drain,
        )
    }
    .unwrap_or_else(|e| panic!("seed {seed}: load (mirror alone: {alone}) failed: {e}"));
    cache.check_invariants();
    let core = cache.core(id).unwrap();
    let mut buf = vec![0u8; core_bytes as usize];
    core.read(&mut buf, 0).unwrap();
    model.check(&buf, &format!("seed {seed} (mirror alone: {alone})"));
}

#[test]
fn after_a_power_cut_the_mirror_alone_has_every_flushed_write() {
    let points: u64 = std::env::var("HC_CRASH_POINTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1500);
    for i in 0..points {
        crash_round(0x3500_0000 + i, true);
    }
}

#[test]
fn after_a_power_cut_the_pair_loads_with_every_flushed_write() {
    let points: u64 = std::env::var("HC_CRASH_POINTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1500);
    for i in 0..points {
        crash_round(0x3600_0000 + i, false);
    }
}

/// On files (io_uring, O_DIRECT), a dirty write and a commit's metadata go to both devices in
/// one submission (`write_together`): two threads write random ranges (whole 4 KiB blocks, in
/// aligned and misaligned memory, and 512-byte pieces the direct path cannot take) with flushes;
/// then, the primary gone, the mirror alone loads with every write, and after `Cache::flush` the
/// core alone has them.
#[test]
fn on_files_both_devices_are_written_together_and_the_mirror_alone_has_every_write() {
    use hybridcache_volume::FileVolume;
    let dir = tempfile::tempdir().unwrap();
    let file = |name: &str, bytes: u64| -> VolumeRef {
        let path = dir.path().join(name);
        std::fs::File::create(&path)
            .and_then(|f| f.set_len(bytes))
            .unwrap();
        Arc::new(FileVolume::open(&path).unwrap())
    };
    let cache_bytes = 3 * MIB + 512 * 4096;
    let (primary, mirror) = (file("primary", cache_bytes), file("mirror", cache_bytes));
    let core_media = Arc::new(RamVolume::new("core", 4 * MIB).unwrap());
    let cache = Cache::create_mirrored(
        primary.clone(),
        mirror.clone(),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        },
        false,
        MirrorLostPolicy::Drain,
    )
    .unwrap();
    // No cleaning: what the last flush committed is what the mirror must bring back, line
    // for line (a line cleaned after it would still be recorded dirty there, rightly). Lazy
    // flush off too: its room batches are cleaned by the cleaner thread, which may still be
    // cleaning (and committing) a batch a write asked for after the writes have returned.
    let mut cleaning = cache.cleaning();
    cleaning.policy = CleaningPolicy::Nop;
    cache.set_cleaning(cleaning).unwrap();
    cache.set_lazy_flush(LazyFlush { enabled: false }).unwrap();
    let id = cache.add_core(core_media.clone(), None).unwrap();
    // Each thread owns half of the core (no two writes race for a sector): its model is its own.
    let halves: Vec<Vec<u8>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..2u64)
            .map(|t| {
                let core = cache.core(id).unwrap();
                s.spawn(move || {
                    let base = t * 2 * MIB;
                    let mut model = vec![0u8; 2 * MIB as usize];
                    let mut rng = Rng(0x5eed + t);
                    // Page-aligned memory, so that the aligned case is really aligned.
                    let mut room = vec![0u8; 72 * 1024];
                    let start = room.as_ptr().align_offset(4096);
                    for stamp in 1..=1500u32 {
                        let small = rng.below(4) == 0;
                        let (first, count) = if small {
                            (rng.below(4096 - 8), 1 + rng.below(7))
                        } else {
                            (rng.below(512 - 16) * 8, 8 * (1 + rng.below(16)))
                        };
                        let len = (count * 512) as usize;
                        let at = start + if rng.below(2) == 0 { 0 } else { 512 };
                        let buf = &mut room[at..at + len];
                        fill(buf, stamp + 100_000 * t as u32, first + base / 512);
                        core.write(buf, base + first * 512).unwrap();
                        model[first as usize * 512..][..len].copy_from_slice(buf);
                        if rng.below(16) == 0 {
                            core.flush().unwrap();
                        }
                    }
                    core.flush().unwrap();
                    model
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    let dirty = cache.stats().usage.dirty_lines;
    assert!(dirty > 0, "the run left lines dirty");
    // The host dies with its primary: no stop, the mirror alone comes up.
    drop(cache);
    let mut open = |_: &_| Some(core_media.clone() as VolumeRef);
    let cache = Cache::load_mirror(mirror.clone(), &mut open).unwrap();
    cache.check_invariants();
    assert_eq!(
        cache.stats().usage.dirty_lines,
        dirty,
        "every dirty line came back"
    );
    let core = cache.core(id).unwrap();
    let check = |buf: &[u8], what: &str| {
        for (t, half) in halves.iter().enumerate() {
            let got = &buf[t * 2 * MIB as usize..][..half.len()];
            for (i, (g, w)) in got.chunks(SECTOR).zip(half.chunks(SECTOR)).enumerate() {
                let sec = t * 4096 + i;
                assert!(
                    g == w,
                    "{what}: sector {sec} holds {:?}, the model {:?}",
                    decode(g, sec as u64),
                    decode(w, sec as u64)
                );
            }
        }
    };
    let mut buf = vec![0u8; 4 * MIB as usize];
    core.read(&mut buf, 0).unwrap();
    check(&buf, "from the mirror alone");
    cache.flush().unwrap();
    core_media.read_at(&mut buf, 0).unwrap();
    check(&buf, "the core alone, after the flush");
}

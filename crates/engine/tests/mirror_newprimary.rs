//! A new primary for a mirrored cache whose primary is lost (`Cache::attach_primary`, issue 34
//! "Rebuild"; docs/format.md, "A new primary"): the copy runs while another thread keeps
//! writing and reading, the cache is redundant and write-back again afterwards, and the new
//! primary alone serves every acknowledged write when the mirror fails next. The old primary is
//! stale: a load of it with the mirror is refused. A power cut in the middle of the copy never
//! leaves a device set that loads with a flushed write missing.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use hybridcache_engine::{
    Cache, CacheConfig, CacheMode, Core, LineSize, MirrorLostPolicy, MirrorState,
};
use hybridcache_volume::{CrashVolume, FaultConfig, FaultyVolume, RamVolume, Volume, VolumeRef};
use parking_lot::Mutex;

mod durability;
use durability::{
    decode, fail_everything, fill, modelled_write, power_cut, Model, Mortal, Rng, SECTOR,
};

const MIB: u64 = 1 << 20;
const CORE_BYTES: u64 = 2 * MIB;

fn config(line_kib: u32) -> CacheConfig {
    CacheConfig {
        id: 1,
        line_size: LineSize::from_kib(line_kib).unwrap(),
        mode: CacheMode::Wb,
    }
}

/// A random write, read (checked against `model`) or, one time in eight, flush through `core`,
/// under the model's lock so the model's order is the cache's. Reads fill clean lines: those
/// filled before the primary failed are on the old primary only.
fn random_op(core: &Core, model: &Mutex<Vec<u8>>, rng: &mut Rng, stamp: u32, when: &str) {
    let sectors = CORE_BYTES / 512;
    match rng.below(8) {
        0 => {
            core.flush()
                .unwrap_or_else(|e| panic!("{when}: flush: {e}"));
            return;
        }
        1 | 2 => {
            let first = rng.below(sectors - 64);
            let count = 1 + rng.below(63);
            let mut buf = vec![0u8; (count * 512) as usize];
            let m = model.lock();
            core.read(&mut buf, first * 512)
                .unwrap_or_else(|e| panic!("{when}: read at sector {first}: {e}"));
            let at = (first * 512) as usize;
            check(&buf, &m[at..at + buf.len()], first, when);
            return;
        }
        _ => {}
    }
    let first = rng.below(sectors - 64);
    let count = 1 + rng.below(63);
    let mut buf = vec![0u8; (count * 512) as usize];
    fill(&mut buf, stamp, first);
    let mut m = model.lock();
    core.write(&buf, first * 512)
        .unwrap_or_else(|e| panic!("{when}: write at sector {first}: {e}"));
    m[(first * 512) as usize..(first * 512) as usize + buf.len()].copy_from_slice(&buf);
}

fn check(buf: &[u8], model: &[u8], first_sector: u64, when: &str) {
    for (i, (s, want)) in buf.chunks(SECTOR).zip(model.chunks(SECTOR)).enumerate() {
        let sector = first_sector + i as u64;
        assert!(
            s == want,
            "{when}: sector {sector} holds {:?}, the model {:?}",
            decode(s, sector),
            decode(want, sector)
        );
    }
}

fn new_primary_under_load(seed: u64) {
    let mut rng = Rng(seed);
    let line_kib = LineSize::ALL_KIB[rng.below(5) as usize];
    let lines = [16, 64, 256][rng.below(3) as usize];
    let cache_bytes = 3 * MIB + lines * line_kib as u64 * 1024;
    let device = |name: &str, bytes: u64| {
        Arc::new(FaultyVolume::new(Arc::new(
            RamVolume::new(name, bytes).unwrap(),
        )))
    };
    // Every other seed the new primary is larger than the old: it is used up to the old size.
    let new_bytes = cache_bytes + (seed % 2) * MIB;
    let (primary, mirror, new_primary) = (
        device("primary", cache_bytes),
        device("mirror", cache_bytes),
        device("new primary", new_bytes),
    );
    let core_media = Arc::new(RamVolume::new("core", CORE_BYTES).unwrap());
    let cache = Cache::create_mirrored(
        primary.clone(),
        mirror.clone(),
        config(line_kib),
        false,
        MirrorLostPolicy::Drain,
    )
    .unwrap();
    // Nothing drains the dirty lines behind the test's back: the copy has them to copy.
    cache.stop_background_cleaner();
    let id = cache.add_core(core_media.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    let model = Mutex::new(vec![0u8; CORE_BYTES as usize]);
    let mut stamp = 0;
    for _ in 0..150 {
        stamp += 1;
        random_op(
            &core,
            &model,
            &mut rng,
            stamp,
            &format!("seed {seed}, redundant"),
        );
    }
    // Cleaned lines stay mapped, clean: their data is on the old primary only.
    cache.flush().unwrap();
    for _ in 0..8 {
        stamp += 1;
        random_op(
            &core,
            &model,
            &mut rng,
            stamp,
            &format!("seed {seed}, redundant"),
        );
    }
    assert!(
        cache.stats().usage.clean_lines() > 0,
        "seed {seed}: no clean line for the new primary to drop"
    );
    primary.set_config(fail_everything());
    for _ in 0..100 {
        stamp += 1;
        random_op(
            &core,
            &model,
            &mut rng,
            stamp,
            &format!("seed {seed}, primary lost"),
        );
    }
    assert_eq!(
        cache.mirror_status().unwrap().state,
        MirrorState::PrimaryLost
    );
    assert_eq!(cache.mode(), CacheMode::Pt);
    assert!(
        cache.stats().usage.dirty_lines > 0,
        "seed {seed}: nothing dirty to copy"
    );
    let mut writer_rng = Rng(rng.next_u64());
    let (copied, _) = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            for i in 0..300u32 {
                random_op(
                    &core,
                    &model,
                    &mut writer_rng,
                    1_000_000 + i,
                    &format!("seed {seed}, during the attach"),
                );
            }
        });
        let r = cache
            .attach_primary(new_primary.clone(), false)
            .unwrap_or_else(|e| panic!("seed {seed}: attach: {e}"));
        writer.join().unwrap();
        r
    });
    assert!(copied > 0, "seed {seed}: the pass copied no dirty line");
    let status = cache.mirror_status().unwrap();
    assert_eq!(status.state, MirrorState::Redundant, "seed {seed}");
    assert_eq!(status.reason, None);
    assert_eq!(cache.mode(), CacheMode::Wb, "seed {seed}: write-back again");
    for _ in 0..150 {
        stamp += 1;
        random_op(
            &core,
            &model,
            &mut rng,
            stamp,
            &format!("seed {seed}, new primary"),
        );
    }
    assert!(
        cache.stats().usage.dirty_lines > 0,
        "seed {seed}: nothing dirty on the new pair"
    );
    // The mirror fails next: the new primary alone serves every sector.
    mirror.set_config(fail_everything());
    stamp += 1;
    random_op(
        &core,
        &model,
        &mut rng,
        stamp,
        &format!("seed {seed}, mirror failing"),
    );
    let model = model.into_inner();
    let mut buf = vec![0u8; CORE_BYTES as usize];
    core.read(&mut buf, 0)
        .unwrap_or_else(|e| panic!("seed {seed}: read after the mirror failed: {e}"));
    check(
        &buf,
        &model,
        0,
        &format!("seed {seed}, from the new primary"),
    );
    cache
        .flush()
        .unwrap_or_else(|e| panic!("seed {seed}: flush: {e}"));
    assert_eq!(
        cache.mirror_status().unwrap().state,
        MirrorState::MirrorLost,
        "seed {seed}"
    );
    assert_eq!(
        cache.stats().usage.dirty_lines,
        0,
        "seed {seed}: dirty left"
    );
    core_media.read_at(&mut buf, 0).unwrap();
    check(
        &buf,
        &model,
        0,
        &format!("seed {seed}, the core device alone"),
    );
}

#[test]
fn a_new_primary_attached_under_load_then_the_mirror_lost_keeps_every_write() {
    for seed in 0..8u64 {
        new_primary_under_load(0x3800_0000 + seed);
    }
}

#[test]
fn a_new_primary_is_refused_unless_the_primary_is_lost_and_onto_a_small_or_used_device() {
    let v = |name: &str, bytes| {
        Arc::new(FaultyVolume::new(Arc::new(
            RamVolume::new(name, bytes).unwrap(),
        )))
    };
    let (primary, mirror) = (v("primary", 4 * MIB), v("mirror", 4 * MIB));
    let cache = Cache::create_mirrored(
        primary.clone(),
        mirror.clone(),
        config(4),
        false,
        MirrorLostPolicy::Keep,
    )
    .unwrap();
    let id = cache
        .add_core(Arc::new(RamVolume::new("core", MIB).unwrap()), None)
        .unwrap();
    let core = cache.core(id).unwrap();
    let e = cache
        .attach_primary(v("spare", 4 * MIB), false)
        .unwrap_err();
    assert!(e.to_string().contains("redundant"), "{e}");
    // Mirror lost: the new device it needs is a mirror.
    mirror.set_config(fail_everything());
    core.write(&[7u8; 4096], 0).unwrap();
    core.flush().unwrap();
    assert_eq!(
        cache.mirror_status().unwrap().state,
        MirrorState::MirrorLost
    );
    let e = cache
        .attach_primary(v("spare", 4 * MIB), false)
        .unwrap_err();
    assert!(e.to_string().contains("--attach-mirror"), "{e}");

    // A second cache, its primary lost.
    let (primary, mirror) = (v("primary 2", 4 * MIB), v("mirror 2", 4 * MIB));
    let cache = Cache::create_mirrored(
        primary.clone(),
        mirror.clone(),
        config(4),
        false,
        MirrorLostPolicy::Keep,
    )
    .unwrap();
    let id = cache
        .add_core(Arc::new(RamVolume::new("core", MIB).unwrap()), None)
        .unwrap();
    let core = cache.core(id).unwrap();
    core.write(&[7u8; 4096], 0).unwrap();
    primary.set_config(fail_everything());
    core.write(&[8u8; 4096], 8192).unwrap();
    core.flush().unwrap();
    assert_eq!(
        cache.mirror_status().unwrap().state,
        MirrorState::PrimaryLost
    );
    let e = cache
        .attach_primary(v("tiny", 4 * MIB - 4096), false)
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains(&(4 * MIB - 4096).to_string())
            && text.contains(&format!("at least {}", 4 * MIB)),
        "{text}"
    );
    // Its own mirror, not even with force.
    let e = cache.attach_primary(mirror.clone(), true).unwrap_err();
    assert!(e.to_string().contains("cannot be its primary too"), "{e}");
    // A device that holds a cache is overwritten only with force.
    let used: VolumeRef = Arc::new(RamVolume::new("used", 4 * MIB).unwrap());
    drop(Cache::create(used.clone(), config(4), false).unwrap());
    let e = cache.attach_primary(used.clone(), false).unwrap_err();
    assert!(
        e.to_string().contains("holds cache") && e.to_string().contains("--force"),
        "{e}"
    );
    assert_eq!(
        cache.mirror_status().unwrap().state,
        MirrorState::PrimaryLost
    );
    cache.attach_primary(used, true).unwrap();
    assert_eq!(cache.mirror_status().unwrap().state, MirrorState::Redundant);
    let mut buf = vec![0u8; 4096];
    core.read(&mut buf, 0).unwrap();
    assert_eq!(buf, vec![7u8; 4096]);
    core.read(&mut buf, 8192).unwrap();
    assert_eq!(buf, vec![8u8; 4096]);
    let e = cache
        .attach_primary(v("spare", 4 * MIB), false)
        .unwrap_err();
    assert!(e.to_string().contains("redundant"), "{e}");
}

/// After a new primary, the old one is stale: a load of it with the mirror is refused, and the
/// new pair loads with every write (the old primary's clean lines are not trusted from it).
#[test]
fn the_old_primary_is_refused_with_the_mirror_after_a_new_primary() {
    let ram = |name: &str| Arc::new(RamVolume::new(name, 4 * MIB).unwrap());
    let (old_media, mirror, new_primary, core_media) = (
        ram("primary"),
        ram("mirror"),
        ram("new primary"),
        ram("core"),
    );
    let old = Arc::new(FaultyVolume::new(old_media.clone()));
    let cache = Cache::create_mirrored(
        old.clone(),
        mirror.clone(),
        config(4),
        false,
        MirrorLostPolicy::Drain,
    )
    .unwrap();
    cache.stop_background_cleaner();
    let id = cache.add_core(core_media.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    let mut model = vec![0u8; 64 * 4096];
    for (i, chunk) in model.chunks_mut(4096).enumerate() {
        chunk.fill(i as u8 + 1);
        core.write(chunk, i as u64 * 4096).unwrap();
    }
    old.set_config(fail_everything());
    core.write(&[0xee; 4096], 0).unwrap();
    model[..4096].fill(0xee);
    cache.attach_primary(new_primary.clone(), false).unwrap();
    core.write(&[0xdd; 4096], 4096).unwrap();
    model[4096..8192].fill(0xdd);
    cache.stop(false).unwrap();
    drop(core);
    drop(cache);
    let open = |_: &_| Some(core_media.clone() as VolumeRef);
    let e = Cache::load_mirrored(
        old_media.clone(),
        mirror.clone(),
        &mut { open },
        MirrorLostPolicy::Drain,
    )
    .err()
    .expect("the old primary loaded with the mirror");
    assert!(e.to_string().contains("stale"), "{e}");
    let cache = Cache::load_mirrored(
        new_primary.clone(),
        mirror.clone(),
        &mut { open },
        MirrorLostPolicy::Drain,
    )
    .unwrap();
    assert_eq!(cache.mirror_status().unwrap().state, MirrorState::Redundant);
    let core = cache.core(id).unwrap();
    let mut buf = vec![0u8; model.len()];
    core.read(&mut buf, 0).unwrap();
    assert!(buf == model, "the new pair lost writes");
}

/// A power cut at a random device operation during a new primary's copy: what loads afterwards
/// (the mirror alone always; the new primary once the attach finished) has every flushed write,
/// and a new primary whose copy did not finish holds no cache.
fn cut_mid_copy(seed: u64) {
    let mut rng = Rng(seed);
    let line_kib = LineSize::ALL_KIB[rng.below(5) as usize];
    let cache_bytes = 3 * MIB + 16 * line_kib as u64 * 1024;
    let core_bytes = MIB;
    let media = |name: &str, bytes: u64| {
        Arc::new(CrashVolume::new(Arc::new(
            RamVolume::new(name, bytes).unwrap(),
        )))
    };
    let (primary, mirror, new_primary, core_dev) = (
        media("primary", cache_bytes),
        media("mirror", cache_bytes),
        media("new primary", cache_bytes),
        media("core", core_bytes),
    );
    let budget = Arc::new(AtomicI64::new(i64::MAX));
    let mortal = |v: &Arc<CrashVolume>| -> VolumeRef {
        Arc::new(Mortal {
            inner: v.clone(),
            budget: budget.clone(),
        })
    };
    // A used disk: what the copy leaves out reads as junk, never as a plausible zero.
    new_primary
        .write_at(&vec![0xa5; cache_bytes as usize], 0)
        .unwrap();
    let failing_primary = Arc::new(FaultyVolume::new(mortal(&primary)));
    let cache = Cache::create_mirrored(
        failing_primary.clone(),
        mortal(&mirror),
        config(line_kib),
        false,
        MirrorLostPolicy::Keep,
    )
    .unwrap();
    cache.stop_background_cleaner();
    cache.stop_background_prefetch();
    let id = cache.add_core(mortal(&core_dev), None).unwrap();
    let core = cache.core(id).unwrap();
    let sectors = core_bytes / 512;
    let mut model = Model::new(sectors as usize);
    let mut stamp = 0;
    let mut write =
        |model: &mut Model, rng: &mut Rng| modelled_write(&core, model, rng, &mut stamp, sectors);
    for _ in 0..40 {
        write(&mut model, &mut rng);
    }
    failing_primary.set_config(fail_everything());
    for _ in 0..20 {
        write(&mut model, &mut rng);
    }
    core.flush().unwrap();
    model.flushed();
    for v in [&mirror, &new_primary, &core_dev] {
        v.flush().unwrap();
    }
    // Pass-through writes not flushed: they drop the dirty lines they overwrite from memory,
    // while the committed metadata still names them dirty (their data is on the mirror only).
    for _ in 0..10 {
        write(&mut model, &mut rng);
    }
    // An attach here takes some 35 device operations: cuts fall all through it, and after.
    budget.store(rng.below(48) as i64, Ordering::SeqCst);
    let attached = cache.attach_primary(mortal(&new_primary), false).is_ok()
        && budget.load(Ordering::SeqCst) > 0;
    drop(core);
    power_cut(&budget);
    drop(cache);
    for v in [&mirror, &new_primary, &core_dev] {
        v.crash(rng.next_u64()).unwrap();
    }
    let verify = |cache: Cache, what: &str| {
        cache.check_invariants();
        let core = cache.core(id).unwrap();
        let mut buf = vec![0u8; core_bytes as usize];
        core.read(&mut buf, 0).unwrap();
        model.check(
            &buf,
            &format!("seed {seed} ({what}; attach finished: {attached})"),
        );
    };
    let core_media = core_dev.clone();
    let mut open = |_: &_| Some(core_media.clone() as VolumeRef);
    // Each load writes only to its own device; the core may move on by cleaning, which the
    // model allows (every write was flushed before the attach).
    match Cache::load(new_primary.clone(), &mut open) {
        Ok(cache) => verify(cache, "the new primary alone"),
        Err(e) => assert!(
            !attached,
            "seed {seed}: the finished attach's new primary does not load: {e}"
        ),
    }
    let cache = Cache::load_mirror(mirror.clone(), &mut open)
        .unwrap_or_else(|e| panic!("seed {seed}: load of the mirror alone: {e}"));
    verify(cache, "the mirror alone");
}

#[test]
fn a_power_cut_mid_copy_leaves_devices_that_load_with_every_flushed_write() {
    let points: u64 = std::env::var("HC_CRASH_POINTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    for i in 0..points {
        cut_mid_copy(0x3900_0000 + i);
    }
}

/// A new primary that fails during the copy ends the attach: the cache is `primary lost` again,
/// still serves every write from its mirror and the core, and takes another new primary.
#[test]
fn a_new_primary_failing_mid_copy_leaves_the_cache_primary_lost_and_whole() {
    let v = |name: &str| {
        Arc::new(FaultyVolume::new(Arc::new(
            RamVolume::new(name, 4 * MIB).unwrap(),
        )))
    };
    let (primary, mirror, bad, good) = (v("primary"), v("mirror"), v("bad"), v("good"));
    let cache = Cache::create_mirrored(
        primary.clone(),
        mirror.clone(),
        config(4),
        false,
        MirrorLostPolicy::Drain,
    )
    .unwrap();
    cache.stop_background_cleaner();
    let id = cache
        .add_core(Arc::new(RamVolume::new("core", MIB).unwrap()), None)
        .unwrap();
    let core = cache.core(id).unwrap();
    let mut model = vec![0u8; MIB as usize];
    for (i, chunk) in model.chunks_mut(4096).enumerate().take(64) {
        chunk.fill(i as u8 + 1);
        core.write(chunk, i as u64 * 4096).unwrap();
    }
    primary.set_config(fail_everything());
    core.write(&[0xee; 4096], 0).unwrap();
    model[..4096].fill(0xee);
    assert!(cache.stats().usage.dirty_lines > 0);
    // Its superblock slots are wiped; everything past them fails.
    bad.set_config(FaultConfig {
        fail_writes_in: Some(2 * MIB..u64::MAX),
        ..FaultConfig::default()
    });
    let e = cache.attach_primary(bad.clone(), false).unwrap_err();
    let status = cache.mirror_status().unwrap();
    assert_eq!(status.state, MirrorState::PrimaryLost, "{e}");
    assert!(
        status
            .reason
            .as_deref()
            .is_some_and(|r| r.contains("made the new primary")),
        "{status:?}"
    );
    assert_eq!(cache.mode(), CacheMode::Pt);
    // The lost primary is the cache's device again, as in the daemon's record.
    assert_eq!(cache.volume_name(), "primary");
    let mut buf = vec![0u8; model.len()];
    core.read(&mut buf, 0).unwrap();
    assert!(
        buf == model,
        "the cache lost writes when its new primary failed"
    );
    core.write(&[0xdd; 4096], 4096).unwrap();
    model[4096..8192].fill(0xdd);
    cache.attach_primary(good.clone(), false).unwrap();
    assert_eq!(cache.mirror_status().unwrap().state, MirrorState::Redundant);
    assert_eq!(cache.volume_name(), "good");
    mirror.set_config(fail_everything());
    core.read(&mut buf, 0).unwrap();
    assert!(buf == model, "the second new primary lost writes");
}

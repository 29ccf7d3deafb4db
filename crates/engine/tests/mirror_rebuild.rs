//! Rebuilding a lost mirror onto a new device (`Cache::attach_mirror`, issue 34; docs/format.md,
//! "The mirror"): the copy runs while another thread keeps writing, and afterwards the new
//! mirror alone serves every acknowledged write when the primary fails. A power cut in the
//! middle of a rebuild never leaves the new device loadable as a mirror with writes missing.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use hybridcache_engine::{Cache, CacheConfig, CacheMode, LineSize, MirrorLostPolicy, MirrorState};
use hybridcache_volume::{CrashVolume, FaultyVolume, RamVolume, Volume, VolumeRef};
use parking_lot::Mutex;

mod durability;
use durability::{
    check, fail_everything, modelled_write, power_cut, random_op, while_writing, Model, Mortal, Rng,
};

const MIB: u64 = 1 << 20;
const CORE_BYTES: u64 = 2 * MIB;

fn rebuild_under_load(seed: u64) {
    let mut rng = Rng(seed);
    let line_kib = LineSize::ALL_KIB[rng.below(5) as usize];
    let lines = [16, 64, 256][rng.below(3) as usize];
    let cache_bytes = 3 * MIB + lines * line_kib as u64 * 1024;
    let device = |name: &str| {
        Arc::new(FaultyVolume::new(Arc::new(
            RamVolume::new(name, cache_bytes).unwrap(),
        )))
    };
    let (primary, old_mirror, new_mirror) =
        (device("primary"), device("mirror"), device("new mirror"));
    let core_media = Arc::new(RamVolume::new("core", CORE_BYTES).unwrap());
    // `keep`: the cache stays write-back without its mirror, so there are dirty lines to copy.
    let cache = Cache::create_mirrored(
        primary.clone(),
        old_mirror.clone(),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(line_kib).unwrap(),
            mode: CacheMode::Wb,
        },
        false,
        MirrorLostPolicy::Keep,
    )
    .unwrap();
    cache.stop_background_cleaner();
    let id = cache.add_core(core_media.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    let model = Mutex::new(vec![0u8; CORE_BYTES as usize]);
    let mut stamp = 0;
    for _ in 0..150 {
        stamp += 1;
        random_op(&core, &model, &mut rng, stamp, CORE_BYTES);
    }
    old_mirror.set_config(fail_everything());
    for _ in 0..100 {
        stamp += 1;
        random_op(&core, &model, &mut rng, stamp, CORE_BYTES);
    }
    assert_eq!(
        cache.mirror_status().unwrap().state,
        MirrorState::MirrorLost
    );
    assert!(
        cache.stats().usage.dirty_lines > 0,
        "seed {seed}: nothing dirty to copy"
    );
    let (copied, _) = while_writing(&core, &model, &mut rng, CORE_BYTES, || {
        cache
            .attach_mirror(new_mirror.clone(), false)
            .unwrap_or_else(|e| panic!("seed {seed}: attach: {e}"))
    });
    let status = cache.mirror_status().unwrap();
    assert_eq!(status.state, MirrorState::Redundant, "seed {seed}");
    assert_eq!(status.device, "new mirror");
    assert!(copied > 0, "seed {seed}: the pass copied no dirty line");
    // The old mirror never serves again: a load of the pair with it is refused.
    primary.set_config(fail_everything());
    let model = model.into_inner();
    let mut buf = vec![0u8; CORE_BYTES as usize];
    core.read(&mut buf, 0)
        .unwrap_or_else(|e| panic!("seed {seed}: read after the primary failed: {e}"));
    check(&buf, &model, &format!("seed {seed}, from the new mirror"));
    cache
        .flush()
        .unwrap_or_else(|e| panic!("seed {seed}: flush: {e}"));
    assert_eq!(
        cache.stats().usage.dirty_lines,
        0,
        "seed {seed}: dirty left"
    );
    core_media.read_at(&mut buf, 0).unwrap();
    check(&buf, &model, &format!("seed {seed}, the core device alone"));
}

#[test]
fn a_rebuild_under_load_then_the_primary_lost_keeps_every_acknowledged_write() {
    for seed in 0..8u64 {
        rebuild_under_load(0x3400_0000 + seed);
    }
}

#[test]
fn a_rebuild_is_refused_on_a_redundant_cache_and_onto_a_small_device() {
    let v = |name: &str, bytes| Arc::new(RamVolume::new(name, bytes).unwrap()) as VolumeRef;
    let cache = Cache::create_mirrored(
        v("primary", 4 * MIB),
        v("mirror", 4 * MIB),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        },
        false,
        MirrorLostPolicy::Keep,
    )
    .unwrap();
    let e = cache.attach_mirror(v("spare", 4 * MIB), false).unwrap_err();
    assert!(e.to_string().contains("redundant already"), "{e}");
    let e = cache.attach_mirror(v("tiny", MIB), false).unwrap_err();
    assert!(e.to_string().contains("needs at least"), "{e}");
    assert_eq!(cache.mirror_status().unwrap().state, MirrorState::Redundant);
}

/// A power cut at a random device operation during a rebuild: the new device alone loads with
/// every flushed write or is refused; the primary loads with every flushed write.
fn cut_mid_rebuild(seed: u64) {
    let mut rng = Rng(seed);
    let line_kib = LineSize::ALL_KIB[rng.below(5) as usize];
    let cache_bytes = 3 * MIB + 16 * line_kib as u64 * 1024;
    let core_bytes = MIB;
    let media = |name: &str, bytes: u64| {
        Arc::new(CrashVolume::new(Arc::new(
            RamVolume::new(name, bytes).unwrap(),
        )))
    };
    let (primary, old_mirror, new_mirror, core_dev) = (
        media("primary", cache_bytes),
        media("mirror", cache_bytes),
        media("new mirror", cache_bytes),
        media("core", core_bytes),
    );
    let budget = Arc::new(AtomicI64::new(i64::MAX));
    let mortal = |v: &Arc<CrashVolume>| -> VolumeRef {
        Arc::new(Mortal {
            inner: v.clone(),
            budget: budget.clone(),
        })
    };
    let failing_mirror = Arc::new(FaultyVolume::new(mortal(&old_mirror)));
    let cache = Cache::create_mirrored(
        mortal(&primary),
        failing_mirror.clone(),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(line_kib).unwrap(),
            mode: CacheMode::Wb,
        },
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
    failing_mirror.set_config(fail_everything());
    for _ in 0..20 {
        write(&mut model, &mut rng);
    }
    core.flush().unwrap();
    model.flushed();
    for v in [&primary, &new_mirror, &core_dev] {
        v.flush().unwrap();
    }
    budget.store(rng.below(120) as i64, Ordering::SeqCst);
    let attached = cache.attach_mirror(mortal(&new_mirror), false).is_ok()
        && budget.load(Ordering::SeqCst) > 0;
    drop(core);
    power_cut(&budget);
    drop(cache);
    for v in [&primary, &new_mirror, &core_dev] {
        v.crash(rng.next_u64()).unwrap();
    }
    let verify = |cache: Cache, what: &str| {
        cache.check_invariants();
        let core = cache.core(id).unwrap();
        let mut buf = vec![0u8; core_bytes as usize];
        core.read(&mut buf, 0).unwrap();
        model.check(
            &buf,
            &format!("seed {seed} ({what}; rebuild finished: {attached})"),
        );
    };
    let core_media = core_dev.clone();
    let mut open = |_: &_| Some(core_media.clone() as VolumeRef);
    match Cache::load_mirror(new_mirror.clone(), &mut open) {
        Ok(cache) => verify(cache, "the new mirror alone"),
        Err(e) => assert!(
            !attached,
            "seed {seed}: the finished rebuild's mirror does not load: {e}"
        ),
    }
    // Loading the mirror alone wrote to the new device only; the core copy may have moved on,
    // which the model allows (every write was flushed before the rebuild).
    let cache = Cache::load(primary.clone(), &mut open)
        .unwrap_or_else(|e| panic!("seed {seed}: load of the primary: {e}"));
    verify(cache, "the primary");
}

#[test]
fn a_power_cut_mid_rebuild_never_trusts_a_half_built_mirror() {
    let points: u64 = std::env::var("HC_CRASH_POINTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300);
    for i in 0..points {
        cut_mid_rebuild(0x3700_0000 + i);
    }
}

/// A line dropped from memory before a rebuild's pass (here by a discard of its dirty sectors)
/// is still recorded dirty by the last commit; its data is on the primary only. Once the
/// rebuild is done and the power cut, the new mirror alone must not serve that record's data.
#[test]
fn a_line_dropped_before_the_rebuild_pass_is_not_served_from_the_new_mirror() {
    for seed in 0..40u64 {
        dropped_before_the_pass(0x3a00_0000 + seed);
    }
}

fn dropped_before_the_pass(seed: u64) {
    let mut rng = Rng(seed);
    let line_kib = 4;
    let cache_bytes = 3 * MIB + 64 * line_kib as u64 * 1024;
    let core_bytes = MIB;
    let media = |name: &str, bytes: u64| {
        Arc::new(CrashVolume::new(Arc::new(
            RamVolume::new(name, bytes).unwrap(),
        )))
    };
    let (primary, old_mirror, new_mirror, core_dev) = (
        media("primary", cache_bytes),
        media("mirror", cache_bytes),
        media("new mirror", cache_bytes),
        media("core", core_bytes),
    );
    new_mirror
        .write_at(&vec![0xa5; cache_bytes as usize], 0)
        .unwrap();
    let failing_mirror = Arc::new(FaultyVolume::new(old_mirror.clone() as VolumeRef));
    let cache = Cache::create_mirrored(
        primary.clone(),
        failing_mirror.clone(),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(line_kib).unwrap(),
            mode: CacheMode::Wb,
        },
        false,
        MirrorLostPolicy::Keep,
    )
    .unwrap();
    cache.stop_background_cleaner();
    cache.stop_background_prefetch();
    let id = cache.add_core(core_dev.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    let sectors = core_bytes / 512;
    let mut model = Model::new(sectors as usize);
    let mut stamp = 0;
    for _ in 0..30 {
        modelled_write(&core, &mut model, &mut rng, &mut stamp, sectors);
    }
    failing_mirror.set_config(fail_everything());
    core.write(&[0u8; 4096], 0).unwrap();
    model.write(0, 8, 0);
    core.flush().unwrap();
    model.flushed();
    // Discards of written ranges, not flushed: their lines leave memory, still recorded dirty.
    for _ in 0..4 {
        let first = rng.below(sectors / 8 - 4) * 8;
        core.discard(first * 512, 4 * 4096).unwrap();
        model.write(first, 32, 0);
    }
    cache.attach_mirror(new_mirror.clone(), false).unwrap();
    drop(core);
    drop(cache);
    for v in [&new_mirror, &core_dev] {
        v.crash(rng.next_u64()).unwrap();
    }
    let core_media = core_dev.clone();
    let mut open = |_: &_| Some(core_media.clone() as VolumeRef);
    let cache = Cache::load_mirror(new_mirror.clone(), &mut open)
        .unwrap_or_else(|e| panic!("seed {seed}: the rebuilt mirror does not load: {e}"));
    let core = cache.core(id).unwrap();
    let mut buf = vec![0u8; core_bytes as usize];
    core.read(&mut buf, 0).unwrap();
    model.check(&buf, &format!("seed {seed}"));
}

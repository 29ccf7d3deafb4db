//! A first mirror for a running cache that has none (`Cache::attach_mirror` on a cache created
//! without one, issue 34; docs/format.md, "The mirror"): the copy runs while another thread
//! keeps writing, and afterwards the mirror alone serves every acknowledged write when the
//! primary fails. A power cut at any point of the attach leaves the primary loadable as the
//! cache it was (without a mirror until the last step) with every flushed write, and the new
//! device loadable only once the pairing is written.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use hybridcache_engine::{
    Cache, CacheConfig, CacheMode, Core, LineSize, MirrorLostPolicy, MirrorState,
};
use hybridcache_volume::{CrashVolume, FaultConfig, FaultyVolume, RamVolume, Volume, VolumeRef};
use parking_lot::Mutex;

mod durability;
use durability::{
    check, fail_everything, modelled_write, power_cut, random_op, while_writing, Model, Mortal, Rng,
};

const MIB: u64 = 1 << 20;
const CORE_BYTES: u64 = 2 * MIB;

fn config(line_kib: u32, mode: CacheMode) -> CacheConfig {
    CacheConfig {
        id: 1,
        line_size: LineSize::from_kib(line_kib).unwrap(),
        mode,
    }
}

/// The primary fails: every sector must read back as the model has it (dirty ones from the
/// mirror, the rest from the core), and after a flush from the core device alone.
fn primary_fails_then_check(
    cache: &Cache,
    core: &Core,
    primary: &FaultyVolume,
    core_media: &RamVolume,
    model: &[u8],
    when: &str,
) {
    primary.set_config(fail_everything());
    let mut buf = vec![0u8; CORE_BYTES as usize];
    core.read(&mut buf, 0)
        .unwrap_or_else(|e| panic!("{when}: read after the primary failed: {e}"));
    check(
        &buf,
        model,
        &format!("{when}, served with the primary lost"),
    );
    assert_eq!(
        cache.mirror_status().unwrap().state,
        MirrorState::PrimaryLost,
        "{when}"
    );
    cache
        .flush()
        .unwrap_or_else(|e| panic!("{when}: flush: {e}"));
    assert_eq!(cache.stats().usage.dirty_lines, 0, "{when}: dirty left");
    core_media.read_at(&mut buf, 0).unwrap();
    check(&buf, model, &format!("{when}, the core device alone"));
}

fn attach_under_load(seed: u64) {
    let mut rng = Rng(seed);
    let line_kib = LineSize::ALL_KIB[rng.below(5) as usize];
    let lines = [16, 64, 256][rng.below(3) as usize];
    let cache_bytes = 3 * MIB + lines * line_kib as u64 * 1024;
    let device = |name: &str| {
        Arc::new(FaultyVolume::new(Arc::new(
            RamVolume::new(name, cache_bytes).unwrap(),
        )))
    };
    let (primary, mirror) = (device("primary"), device("mirror"));
    let core_media = Arc::new(RamVolume::new("core", CORE_BYTES).unwrap());
    let cache = Cache::create(primary.clone(), config(line_kib, CacheMode::Wb), false).unwrap();
    cache.stop_background_cleaner();
    let id = cache.add_core(core_media.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    let model = Mutex::new(vec![0u8; CORE_BYTES as usize]);
    for stamp in 1..=200 {
        random_op(&core, &model, &mut rng, stamp, CORE_BYTES);
    }
    assert!(cache.mirror_status().is_none(), "seed {seed}");
    assert!(
        cache.stats().usage.dirty_lines > 0,
        "seed {seed}: nothing dirty to copy"
    );
    let (copied, _) = while_writing(&core, &model, &mut rng, CORE_BYTES, || {
        cache
            .attach_mirror(mirror.clone(), false)
            .unwrap_or_else(|e| panic!("seed {seed}: attach: {e}"))
    });
    let status = cache.mirror_status().unwrap();
    assert_eq!(status.state, MirrorState::Redundant, "seed {seed}");
    assert_eq!(status.device, "mirror");
    assert_eq!(status.policy, MirrorLostPolicy::Drain);
    assert_eq!(cache.mode(), CacheMode::Wb, "seed {seed}: write-back still");
    assert!(copied > 0, "seed {seed}: the pass copied no dirty line");
    let sb = cache.superblock().unwrap();
    let record = sb
        .mirror
        .expect("the primary's superblock names its mirror");
    assert_eq!(
        (record.role.as_str(), record.path.as_str()),
        ("primary", "mirror")
    );
    // Writes after the attach go to both devices.
    for i in 0..100u32 {
        random_op(&core, &model, &mut rng, 2_000_000 + i, CORE_BYTES);
    }
    let model = model.into_inner();
    primary_fails_then_check(
        &cache,
        &core,
        &primary,
        &core_media,
        &model,
        &format!("seed {seed}"),
    );
}

#[test]
fn a_first_mirror_attached_under_load_then_the_primary_lost_keeps_every_acknowledged_write() {
    for seed in 0..8u64 {
        attach_under_load(0x3b00_0000 + seed);
    }
}

#[test]
fn a_first_mirror_is_refused_onto_a_small_or_used_device_and_on_a_redundant_or_volatile_cache() {
    let v = |name: &str, bytes| Arc::new(RamVolume::new(name, bytes).unwrap()) as VolumeRef;
    let primary = v("primary", 4 * MIB);
    let cache = Cache::create(primary.clone(), config(4, CacheMode::Wb), false).unwrap();
    let e = cache.attach_mirror(v("tiny", MIB), false).unwrap_err();
    let needs = e.to_string();
    assert!(
        needs.contains("needs at least") && needs.contains(&MIB.to_string()),
        "{e}"
    );
    let e = cache.attach_mirror(primary.clone(), true).unwrap_err();
    assert!(e.to_string().contains("own device"), "{e}");
    // A device that holds another cache is overwritten only with force.
    let used = v("used", 4 * MIB);
    drop(Cache::create(used.clone(), config(4, CacheMode::Wb), false).unwrap());
    let e = cache.attach_mirror(used.clone(), false).unwrap_err();
    assert!(e.to_string().contains("--force overwrites it"), "{e}");
    assert!(
        cache.mirror_status().is_none(),
        "a refusal gave it a mirror"
    );
    cache.attach_mirror(used, true).unwrap();
    assert_eq!(cache.mirror_status().unwrap().state, MirrorState::Redundant);
    // Now mirrored and redundant: a second mirror is refused.
    let e = cache.attach_mirror(v("spare", 4 * MIB), false).unwrap_err();
    assert!(e.to_string().contains("redundant already"), "{e}");
    // A volatile cache keeps no metadata a mirror could hold.
    let volatile = Cache::new(v("ram", 4 * MIB), config(4, CacheMode::Wb)).unwrap();
    let e = volatile
        .attach_mirror(v("spare", 4 * MIB), false)
        .unwrap_err();
    assert!(e.to_string().contains("volatile"), "{e}");
    assert!(volatile.mirror_status().is_none());
}

/// Accepted in write-through (docs/cli.md says why): the mirror gets the metadata at once, and
/// the dirty lines from the first write after the switch to write-back.
#[test]
fn a_write_through_cache_takes_a_mirror_and_is_protected_once_switched_to_write_back() {
    let cache_bytes = 4 * MIB;
    let device = |name: &str| {
        Arc::new(FaultyVolume::new(Arc::new(
            RamVolume::new(name, cache_bytes).unwrap(),
        )))
    };
    let (primary, mirror) = (device("primary"), device("mirror"));
    let core_media = Arc::new(RamVolume::new("core", CORE_BYTES).unwrap());
    let cache = Cache::create(primary.clone(), config(4, CacheMode::Wt), false).unwrap();
    cache.stop_background_cleaner();
    let id = cache.add_core(core_media.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    let model = Mutex::new(vec![0u8; CORE_BYTES as usize]);
    let mut rng = Rng(0x3c00_0001);
    for stamp in 1..=50 {
        random_op(&core, &model, &mut rng, stamp, CORE_BYTES);
    }
    let (lines, _) = cache.attach_mirror(mirror.clone(), false).unwrap();
    assert_eq!(lines, 0, "write-through has no dirty line to copy");
    assert_eq!(cache.mirror_status().unwrap().state, MirrorState::Redundant);
    assert_eq!(cache.mode(), CacheMode::Wt);
    cache.set_mode(CacheMode::Wb, false).unwrap();
    for stamp in 51..=250 {
        random_op(&core, &model, &mut rng, stamp, CORE_BYTES);
    }
    assert!(cache.stats().usage.dirty_lines > 0);
    let model = model.into_inner();
    primary_fails_then_check(&cache, &core, &primary, &core_media, &model, "wt then wb");
}

/// A first mirror whose device fails during the copy: the attach fails, and the cache is the
/// one it was (no mirror, write-back, every write served); a second attach onto a good device
/// then succeeds.
#[test]
fn a_first_mirror_that_fails_to_fill_leaves_the_cache_without_one_and_can_be_tried_again() {
    let cache_bytes = 3 * MIB + 64 * 4096;
    let device = |name: &str| {
        Arc::new(FaultyVolume::new(Arc::new(
            RamVolume::new(name, cache_bytes).unwrap(),
        )))
    };
    let (primary, bad, good) = (device("primary"), device("bad"), device("good"));
    let core_media = Arc::new(RamVolume::new("core", CORE_BYTES).unwrap());
    let cache = Cache::create(primary.clone(), config(4, CacheMode::Wb), false).unwrap();
    cache.stop_background_cleaner();
    let id = cache.add_core(core_media.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    let model = Mutex::new(vec![0u8; CORE_BYTES as usize]);
    let mut rng = Rng(0x3d00_0001);
    for stamp in 1..=100 {
        random_op(&core, &model, &mut rng, stamp, CORE_BYTES);
    }
    // The superblock slots can be wiped; the line data cannot be written.
    bad.set_config(FaultConfig {
        fail_writes_in: Some(2 * MIB..u64::MAX),
        ..FaultConfig::default()
    });
    let e = cache.attach_mirror(bad.clone(), false).unwrap_err();
    assert!(e.to_string().contains("bad"), "{e}");
    assert!(
        cache.mirror_status().is_none(),
        "a failed attach left a mirror"
    );
    assert_eq!(cache.mode(), CacheMode::Wb);
    assert!(cache.superblock().unwrap().mirror.is_none());
    for stamp in 101..=200 {
        random_op(&core, &model, &mut rng, stamp, CORE_BYTES);
    }
    cache.attach_mirror(good.clone(), false).unwrap();
    assert_eq!(cache.mirror_status().unwrap().state, MirrorState::Redundant);
    assert_eq!(cache.mirror_status().unwrap().device, "good");
    for stamp in 201..=300 {
        random_op(&core, &model, &mut rng, stamp, CORE_BYTES);
    }
    let model = model.into_inner();
    primary_fails_then_check(&cache, &core, &primary, &core_media, &model, "retried");
}

/// What a run of `cut_mid_attach` saw: whether the attach finished before the cut, and which
/// devices loaded.
struct Outcome {
    attached: bool,
    mirror_loaded: bool,
}

/// A power cut after `budget` device operations of an attach onto a cache without a mirror
/// (`budget` None: no cut; returns the operations the attach took in `spent`).
fn cut_mid_attach(seed: u64, budget: Option<i64>, spent: &mut i64) -> Outcome {
    let mut rng = Rng(seed);
    let line_kib = LineSize::ALL_KIB[rng.below(5) as usize];
    let cache_bytes = 3 * MIB + 16 * line_kib as u64 * 1024;
    let core_bytes = MIB;
    let media = |name: &str, bytes: u64| {
        Arc::new(CrashVolume::new(Arc::new(
            RamVolume::new(name, bytes).unwrap(),
        )))
    };
    let (primary, new_mirror, core_dev) = (
        media("primary", cache_bytes),
        media("new mirror", cache_bytes),
        media("core", core_bytes),
    );
    // What the device held before: a cut must never make it look like a mirror.
    new_mirror
        .write_at(&vec![0xa5; cache_bytes as usize], 0)
        .unwrap();
    let ops = Arc::new(AtomicI64::new(i64::MAX / 2));
    let mortal = |v: &Arc<CrashVolume>| -> VolumeRef {
        Arc::new(Mortal {
            inner: v.clone(),
            budget: ops.clone(),
        })
    };
    let cache = Cache::create(mortal(&primary), config(line_kib, CacheMode::Wb), false).unwrap();
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
    core.flush().unwrap();
    model.flushed();
    // Written after the last flush: the model allows them to be there or not.
    for _ in 0..10 {
        write(&mut model, &mut rng);
    }
    for v in [&primary, &new_mirror, &core_dev] {
        v.flush().unwrap();
    }
    let start = budget.unwrap_or(i64::MAX / 2);
    ops.store(start, Ordering::SeqCst);
    let attached =
        cache.attach_mirror(mortal(&new_mirror), false).is_ok() && ops.load(Ordering::SeqCst) > 0;
    *spent = start - ops.load(Ordering::SeqCst);
    drop(core);
    power_cut(&ops);
    drop(cache);
    for v in [&primary, &new_mirror, &core_dev] {
        v.crash(rng.next_u64()).unwrap();
    }
    let when =
        format!("seed {seed}, cut after {budget:?} operations (attach finished: {attached})");
    let verify = |cache: Cache, what: &str| {
        cache.check_invariants();
        let core = cache.core(id).unwrap();
        let mut buf = vec![0u8; core_bytes as usize];
        core.read(&mut buf, 0).unwrap();
        model.check(&buf, &format!("{when}: {what}"));
    };
    let core_media = core_dev.clone();
    let mut open = |_: &_| Some(core_media.clone() as VolumeRef);
    let paired = Cache::peek(&*primary)
        .unwrap_or_else(|e| panic!("{when}: the primary's superblock: {e}"))
        .mirror;
    assert!(
        !attached || paired.is_some(),
        "{when}: the attach finished and the primary does not name its mirror"
    );
    // Before the last step the primary is the mirrorless cache it was: a load of it with the
    // new device is refused, and so is the new device alone (it holds no superblock).
    match Cache::load_mirrored(
        primary.clone(),
        new_mirror.clone(),
        &mut open,
        MirrorLostPolicy::Keep,
    ) {
        Ok(cache) => {
            assert!(
                paired.is_some(),
                "{when}: a pair loaded from a mirrorless primary"
            );
            assert_eq!(
                cache.mirror_status().unwrap().state,
                MirrorState::Redundant,
                "{when}"
            );
            verify(cache, "the pair");
        }
        Err(e) => {
            assert!(
                !attached,
                "{when}: the finished attach's pair does not load: {e}"
            );
            if paired.is_none() {
                assert!(e.to_string().contains("has no mirror"), "{when}: {e}");
            }
        }
    }
    let mirror_loaded = match Cache::load_mirror(new_mirror.clone(), &mut open) {
        Ok(cache) => {
            verify(cache, "the new mirror alone");
            true
        }
        Err(e) => {
            assert!(
                !attached,
                "{when}: the finished attach's mirror does not load alone: {e}"
            );
            false
        }
    };
    if paired.is_none() {
        assert!(
            Cache::peek(&*new_mirror).is_err() || mirror_loaded,
            "{when}: unreachable: a superblock on the new device that does not load"
        );
    }
    // Loading the mirror alone wrote to the new device only; the core copy may have moved on,
    // which the model allows.
    let cache = Cache::load(primary.clone(), &mut open)
        .unwrap_or_else(|e| panic!("{when}: load of the primary: {e}"));
    assert!(cache.mirror_status().is_none(), "{when}");
    verify(cache, "the primary alone");
    Outcome {
        attached,
        mirror_loaded,
    }
}

#[test]
fn a_power_cut_at_every_step_of_a_first_mirror_keeps_the_cache_and_never_trusts_the_mirror_early() {
    let seeds: u64 = std::env::var("HC_CRASH_POINTS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(4, |points| (points / 75).max(1));
    for s in 0..seeds {
        let seed = 0x3e00_0000 + s;
        let mut all = 0;
        let whole = cut_mid_attach(seed, None, &mut all);
        assert!(whole.attached && whole.mirror_loaded, "seed {seed}");
        let (mut refused, mut finished) = (0, 0);
        // Every operation of the attach, and one past its end.
        for budget in 0..=all + 1 {
            let mut spent = 0;
            let o = cut_mid_attach(seed, Some(budget), &mut spent);
            refused += u32::from(!o.mirror_loaded);
            finished += u32::from(o.attached);
        }
        eprintln!(
            "seed {seed}: {all} cut points, {refused} refused the new device, {finished} finished"
        );
        assert!(
            refused > 0 && finished > 0,
            "seed {seed}: {all} cut points, {refused} refused the new device, {finished} finished"
        );
    }
}

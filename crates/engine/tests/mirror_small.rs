//! A mirror smaller than the cache (issue 34; docs/format.md, "A smaller mirror"): the mirror
//! holds the metadata and the first cache lines, line for line, and every dirty line is kept
//! among those. Two threads write, read, flush and discard at random against their own halves
//! of the core (each with its byte model), on caches of 4, 16 and 64 KiB lines whose mirror is
//! 1/8 to 1/2 of their lines; then the primary fails: every sector reads back right from the
//! cache (its dirty data from the small mirror), and after `Cache::flush` from the core alone.
//! When the region holds only dirty lines, writes wait for cleaning and complete (alru, and nop
//! with lazy flush). Power cuts, then the small mirror alone loads with every flushed write. A
//! dirty line beyond the region is damage: the load is refused, naming it, the device untouched.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hybridcache_engine::{
    Cache, CacheConfig, CacheMode, CleaningPolicy, Core, LazyFlush, LineSize, MirrorLostPolicy,
    MirrorState,
};
use hybridcache_volume::{CrashVolume, FaultyVolume, RamVolume, Volume, VolumeRef};

mod durability;
use durability::{decode, fail_everything, fill, power_cut, Model, Mortal, Rng, SECTOR};

const MIB: u64 = 1 << 20;

fn config(line_kib: u32) -> CacheConfig {
    CacheConfig {
        id: 1,
        line_size: LineSize::from_kib(line_kib).unwrap(),
        mode: CacheMode::Wb,
    }
}

/// The bytes of a primary of about `lines` lines, and of a mirror holding all but
/// `lines - covered` of them (the metadata before the lines is the same on both).
fn sizes(line_kib: u32, lines: u64, covered: u64) -> (u64, u64) {
    let line = line_kib as u64 * 1024;
    let primary = 3 * MIB + lines * line;
    (primary, primary - (lines - covered) * line)
}

/// Panic at the first sector of `got` (sectors from `first`) that is not the model's.
fn check(got: &[u8], model: &[u8], first: u64, when: &str) {
    for (i, (g, w)) in got.chunks(SECTOR).zip(model.chunks(SECTOR)).enumerate() {
        let sec = first + i as u64;
        assert!(
            g == w,
            "{when}: sector {sec} holds {:?}, the model {:?}",
            decode(g, sec),
            decode(w, sec)
        );
    }
}

/// One thread's random writes, reads (checked), flushes and discards on its half of the core,
/// starting at byte `base`; returns its model.
fn worker(core: &Core, base: u64, half: u64, seed: u64, ops: usize, tag: u32) -> Vec<u8> {
    let mut rng = Rng(seed);
    let sectors = half / 512;
    let mut model = vec![0u8; half as usize];
    for n in 0..ops {
        let first = rng.below(sectors - 256);
        let count = 1 + rng.below(255);
        let (off, len) = (first * 512, (count * 512) as usize);
        match rng.below(20) {
            0..=10 => {
                let mut buf = vec![0u8; len];
                fill(&mut buf, tag + n as u32, first + base / 512);
                core.write(&buf, base + off)
                    .unwrap_or_else(|e| panic!("seed {seed:#x}: write at {off}: {e}"));
                model[off as usize..][..len].copy_from_slice(&buf);
            }
            11..=16 => {
                let mut buf = vec![0u8; len];
                core.read(&mut buf, base + off)
                    .unwrap_or_else(|e| panic!("seed {seed:#x}: read at {off}: {e}"));
                check(
                    &buf,
                    &model[off as usize..][..len],
                    first + base / 512,
                    &format!("seed {seed:#x}, op {n}"),
                );
            }
            17..=18 => core
                .flush()
                .unwrap_or_else(|e| panic!("seed {seed:#x}: flush: {e}")),
            _ => {
                // Whole 4 KiB blocks: what a discard zeroes is the core's to say, so the model
                // is what the core reads back there afterwards.
                let (first, count) = (first & !7, (count + 7) & !7);
                let (off, len) = (first * 512, (count * 512) as usize);
                core.discard(base + off, len as u64)
                    .unwrap_or_else(|e| panic!("seed {seed:#x}: discard at {off}: {e}"));
                let mut buf = vec![0u8; len];
                core.read(&mut buf, base + off)
                    .unwrap_or_else(|e| panic!("seed {seed:#x}: read at {off}: {e}"));
                model[off as usize..][..len].copy_from_slice(&buf);
            }
        }
    }
    model
}

/// Two threads on a cache whose mirror covers `1/fraction` of its lines, then the primary
/// fails; `nop_lazy`: cleaning only when writes want room, with lazy flush on.
fn two_threads_then_the_primary_fails(line_kib: u32, fraction: u64, nop_lazy: bool, seed: u64) {
    let lines = 512;
    let (primary_bytes, mirror_bytes) = sizes(line_kib, lines, lines / fraction);
    let primary = Arc::new(FaultyVolume::new(Arc::new(
        RamVolume::new("primary", primary_bytes).unwrap(),
    )));
    let mirror = Arc::new(RamVolume::new("mirror", mirror_bytes).unwrap());
    // Twice the cache: lines are evicted and reused all the time.
    let core_bytes = 2 * lines * line_kib as u64 * 1024;
    let core_media = Arc::new(RamVolume::new("core", core_bytes).unwrap());
    let cache = Cache::create_mirrored(
        primary.clone(),
        mirror.clone(),
        config(line_kib),
        false,
        MirrorLostPolicy::Drain,
    )
    .unwrap_or_else(|e| panic!("{line_kib} KiB lines, 1/{fraction}: {e}"));
    let st = cache.mirror_status().unwrap();
    assert!(
        st.lines < cache.stats().usage.total_lines && st.lines >= lines / fraction,
        "the mirror covers {} of {} lines",
        st.lines,
        cache.stats().usage.total_lines
    );
    if nop_lazy {
        let mut cleaning = cache.cleaning();
        cleaning.policy = CleaningPolicy::Nop;
        cache.set_cleaning(cleaning).unwrap();
        cache.set_lazy_flush(LazyFlush { enabled: true }).unwrap();
    }
    let id = cache.add_core(core_media.clone(), None).unwrap();
    let half = core_bytes / 2;
    let when = format!("{line_kib} KiB lines, mirror 1/{fraction}, nop+lazy {nop_lazy}");
    let _watchdog = common_watchdog(&when);
    let halves: Vec<Vec<u8>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..2u64)
            .map(|t| {
                let core = cache.core(id).unwrap();
                s.spawn(move || {
                    worker(&core, t * half, half, seed + t, 400, 1 + 100_000 * t as u32)
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    let model: Vec<u8> = halves.concat();
    // A commit first: lines a discard dropped wait in limbo until one records them free.
    cache.core(id).unwrap().flush().unwrap();
    cache.check_invariants();
    let st = cache.mirror_status().unwrap();
    assert!(
        st.dirty_lines <= st.lines,
        "{when}: {} dirty lines, the mirror covers {}",
        st.dirty_lines,
        st.lines
    );
    primary.set_config(fail_everything());
    let core = cache.core(id).unwrap();
    let mut buf = vec![0u8; core_bytes as usize];
    for (i, chunk) in buf.chunks_mut(16 << 20).enumerate() {
        core.read(chunk, i as u64 * (16 << 20))
            .unwrap_or_else(|e| panic!("{when}: read with the primary lost: {e}"));
    }
    check(&buf, &model, 0, &format!("{when}, primary lost"));
    assert_eq!(
        cache.mirror_status().unwrap().state,
        MirrorState::PrimaryLost,
        "{when}"
    );
    cache
        .flush()
        .unwrap_or_else(|e| panic!("{when}: flush from the mirror: {e}"));
    core_media.read_at(&mut buf, 0).unwrap();
    check(&buf, &model, 0, &format!("{when}, the core alone"));
}

fn common_watchdog(what: &str) -> Watchdog {
    Watchdog::new(what, Duration::from_secs(240))
}

/// Aborts the test process when a run takes far longer than it should (a deadlock of writes
/// waiting for room), naming it.
struct Watchdog(Option<std::sync::mpsc::Sender<()>>);

impl Watchdog {
    fn new(what: &str, limit: Duration) -> Watchdog {
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let what = what.to_string();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
                eprintln!("{what}: no progress for {limit:?} (writes waiting for room forever?)");
                std::process::abort();
            }
        });
        Watchdog(Some(tx))
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.0.take());
    }
}

#[test]
fn two_threads_on_a_small_mirror_then_the_primary_fails_and_every_sector_is_right() {
    let mut seed = 0x3700;
    for line_kib in [4, 16, 64] {
        for fraction in [2, 4, 8] {
            seed += 2;
            two_threads_then_the_primary_fails(line_kib, fraction, false, seed);
        }
    }
}

#[test]
fn a_region_full_of_dirty_lines_makes_writes_wait_for_cleaning_and_they_complete() {
    // nop with lazy flush: writes wait for the room the cleaning they ask for makes, and after
    // a while go to the core; alru (above): the background cleaner makes room as it runs.
    let mut seed = 0x3800;
    for line_kib in [4, 64] {
        seed += 2;
        two_threads_then_the_primary_fails(line_kib, 8, true, seed);
    }
    // Synchronous room making (no background cleaner, no lazy flush): a write waits while
    // cleaning under its own thread frees lines of the region.
    let (primary_bytes, mirror_bytes) = sizes(4, 512, 64);
    let primary = Arc::new(RamVolume::new("primary", primary_bytes).unwrap());
    let mirror = Arc::new(RamVolume::new("mirror", mirror_bytes).unwrap());
    let core_media = Arc::new(RamVolume::new("core", 8 * MIB).unwrap());
    let cache =
        Cache::create_mirrored(primary, mirror, config(4), false, MirrorLostPolicy::Drain).unwrap();
    cache.stop_background_cleaner();
    cache.set_lazy_flush(LazyFlush { enabled: false }).unwrap();
    let covered = cache.mirror_status().unwrap().lines;
    let id = cache.add_core(core_media.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    let _watchdog = common_watchdog("synchronous room making");
    // Four times the region, in 64 KiB writes: the region fills with dirty lines three times.
    let total = 4 * covered * 4096;
    let mut model = vec![0u8; total as usize];
    for (n, at) in (0..total).step_by(64 << 10).enumerate() {
        let mut buf = vec![0u8; 64 << 10];
        fill(&mut buf, 1 + n as u32, at / 512);
        core.write(&buf, at).unwrap();
        model[at as usize..][..buf.len()].copy_from_slice(&buf);
        let st = cache.mirror_status().unwrap();
        assert!(
            st.dirty_lines <= covered,
            "{} dirty lines, the mirror covers {covered}",
            st.dirty_lines
        );
    }
    let stats = cache.stats();
    assert!(
        stats.usage.dirty_lines > covered / 2,
        "the region is mostly dirty: {} of {covered}",
        stats.usage.dirty_lines
    );
    cache.check_invariants();
    let mut buf = vec![0u8; total as usize];
    core.read(&mut buf, 0).unwrap();
    check(&buf, &model, 0, "through the cache");
    cache.flush().unwrap();
    core_media.read_at(&mut buf, 0).unwrap();
    check(&buf, &model, 0, "the core alone");
}

/// One power cut of a cache whose mirror covers half or a quarter of its lines, then a load of
/// the mirror alone: every write flushed before the cut is there.
fn crash_round(seed: u64) {
    let mut rng = Rng(seed);
    let line_kib = [4, 16][rng.below(2) as usize];
    let line = line_kib as u64 * 1024;
    let lines = 256;
    let fraction = [2, 4][rng.below(2) as usize];
    let (primary_bytes, mirror_bytes) = sizes(line_kib, lines, lines / fraction);
    let core_bytes = 2 * MIB;
    let media = |name: &str, bytes: u64| {
        Arc::new(CrashVolume::new(Arc::new(
            RamVolume::new(name, bytes).unwrap(),
        )))
    };
    let (primary, mirror, core_dev) = (
        media("primary", primary_bytes),
        media("mirror", mirror_bytes),
        media("core", core_bytes),
    );
    let budget = Arc::new(AtomicI64::new(i64::MAX));
    let mortal = |v: &Arc<CrashVolume>| -> VolumeRef {
        Arc::new(Mortal {
            inner: v.clone(),
            budget: budget.clone(),
        })
    };
    let cache = Cache::create_mirrored(
        mortal(&primary),
        mortal(&mirror),
        config(line_kib),
        false,
        MirrorLostPolicy::Drain,
    )
    .unwrap();
    let id = cache.add_core(mortal(&core_dev), None).unwrap();
    let core = cache.core(id).unwrap();
    cache.stop_background_cleaner();
    cache.stop_background_prefetch();
    let sectors = core_bytes / 512;
    let mut model = Model::new(sectors as usize);
    for v in [&primary, &mirror, &core_dev] {
        v.flush().unwrap();
    }
    budget.store(rng.below(1500) as i64, Ordering::SeqCst);
    let mut stamp = 0u32;
    let mut now_ms = 0;
    // Writes over more than the mirror's lines: the region fills and writes make room.
    let span = sectors.min(lines * line / 512);
    for _ in 0..150 {
        if budget.load(Ordering::SeqCst) <= 0 {
            break;
        }
        let first = rng.below(span);
        let count = (1 + rng.below(64)).min(sectors - first);
        let dead_before = budget.load(Ordering::SeqCst) <= 0;
        let durable_point = match rng.below(100) {
            0..=64 => {
                stamp += 1;
                let mut buf = vec![0u8; (count * 512) as usize];
                fill(&mut buf, stamp, first);
                core.write(&buf, first * 512).unwrap();
                model.write(first, count, stamp);
                false
            }
            65..=79 => {
                let mut buf = vec![0u8; (count * 512) as usize];
                core.read(&mut buf, first * 512).unwrap();
                false
            }
            80..=92 => {
                core.flush().unwrap();
                true
            }
            93..=96 => {
                now_ms += rng.below(2500);
                cache.cleaner_tick(now_ms);
                false
            }
            _ => {
                cache.flush().unwrap();
                true
            }
        };
        if durable_point && !dead_before && budget.load(Ordering::SeqCst) > 0 {
            model.flushed();
        }
    }
    drop(core);
    power_cut(&budget);
    drop(cache);
    primary.crash(rng.next_u64()).unwrap();
    mirror.crash(rng.next_u64()).unwrap();
    core_dev.crash(rng.next_u64()).unwrap();
    let core_media = core_dev.clone();
    let mut open = |_: &_| Some(core_media.clone() as VolumeRef);
    let cache = Cache::load_mirror(mirror.clone(), &mut open)
        .unwrap_or_else(|e| panic!("seed {seed:#x}: load of the small mirror failed: {e}"));
    cache.check_invariants();
    let core = cache.core(id).unwrap();
    let mut buf = vec![0u8; core_bytes as usize];
    core.read(&mut buf, 0).unwrap();
    model.check(&buf, &format!("seed {seed:#x} (small mirror alone)"));
    // It runs on the small mirror: fills take none of the lines beyond its end.
    for at in (0..core_bytes).step_by(64 << 10) {
        let mut buf = vec![0u8; 64 << 10];
        core.read(&mut buf, at)
            .unwrap_or_else(|e| panic!("seed {seed:#x}: read after the load: {e}"));
    }
    cache.check_invariants();
}

#[test]
fn after_a_power_cut_the_small_mirror_alone_has_every_flushed_write() {
    let points: u64 = std::env::var("HC_CRASH_POINTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(400);
    for i in 0..points {
        crash_round(0x3900_0000 + i);
    }
}

/// Rewrite both superblock copies of `v` with `edit` applied to their JSON body (the header:
/// magic, version, crc32c, sequence, body length; docs/format.md).
fn edit_superblocks(v: &dyn Volume, edit: impl Fn(&mut serde_json::Value)) {
    const SLOT: u64 = 1 << 20;
    const HEADER: usize = 32;
    for slot in [0, SLOT] {
        let mut head = vec![0u8; SLOT as usize];
        v.read_at(&mut head, slot).unwrap();
        let body_len = u32::from_le_bytes(head[24..28].try_into().unwrap()) as usize;
        let mut sb: serde_json::Value =
            serde_json::from_slice(&head[HEADER..HEADER + body_len]).unwrap();
        edit(&mut sb);
        let body = serde_json::to_vec(&sb).unwrap();
        let len = HEADER + body.len();
        let mut out = vec![0u8; len.div_ceil(512) * 512];
        out[..HEADER].copy_from_slice(&head[..HEADER]);
        out[24..28].copy_from_slice(&(body.len() as u32).to_le_bytes());
        out[HEADER..len].copy_from_slice(&body);
        let crc = crc32c::crc32c_append(crc32c::crc32c(&out[0..12]), &out[16..len]);
        out[12..16].copy_from_slice(&crc.to_le_bytes());
        v.write_at(&out, slot).unwrap();
    }
}

#[test]
fn a_dirty_line_beyond_the_mirrored_lines_is_refused_on_load_and_nothing_changes() {
    // A cache mirrored whole, every line dirty; then its superblock is made to say that the
    // mirror covers only the first 64 lines: the dirty lines beyond are damage.
    let (bytes, _) = sizes(4, 256, 256);
    let primary = Arc::new(RamVolume::new("primary", bytes).unwrap());
    let mirror = Arc::new(RamVolume::new("mirror", bytes).unwrap());
    let core_media = Arc::new(RamVolume::new("core", 4 * MIB).unwrap());
    let cache = Cache::create_mirrored(
        primary.clone(),
        mirror.clone(),
        config(4),
        false,
        MirrorLostPolicy::Drain,
    )
    .unwrap();
    cache.stop_background_cleaner();
    let id = cache.add_core(core_media.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    let lines = cache.stats().usage.total_lines;
    let mut buf = vec![0u8; (lines * 4096) as usize];
    fill(&mut buf, 1, 0);
    core.write(&buf, 0).unwrap();
    assert_eq!(cache.stats().usage.dirty_lines, lines, "every line dirty");
    drop(core);
    cache.stop(false).unwrap();
    drop(cache);
    edit_superblocks(&*primary, |sb| sb["mirror"]["lines"] = 64.into());
    let image = |v: &RamVolume| {
        let mut b = vec![0u8; v.size() as usize];
        v.read_at(&mut b, 0).unwrap();
        b
    };
    let before = image(&primary);
    let mut open = |_: &_| Some(core_media.clone() as VolumeRef);
    let err = match Cache::load(primary.clone(), &mut open) {
        Ok(_) => panic!("a dirty line beyond the mirror's lines was loaded"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains("is dirty") && err.contains("beyond the 64 cache lines the mirror covers"),
        "{err}"
    );
    assert!(
        image(&primary) == before,
        "a refused load changed the device"
    );
}

/// `--attach-mirror` of a cache with a smaller mirror: a device holding the lines it covers
/// is enough (a rebuild copies only dirty lines, all among them), a smaller one is refused.
#[test]
fn a_rebuild_needs_a_device_as_large_as_the_mirrored_lines_only() {
    let (primary_bytes, mirror_bytes) = sizes(4, 512, 128);
    let primary = Arc::new(RamVolume::new("primary", primary_bytes).unwrap());
    let mirror = Arc::new(FaultyVolume::new(Arc::new(
        RamVolume::new("mirror", mirror_bytes).unwrap(),
    )));
    let core_media = Arc::new(RamVolume::new("core", 4 * MIB).unwrap());
    let cache = Cache::create_mirrored(
        primary.clone(),
        mirror.clone(),
        config(4),
        false,
        MirrorLostPolicy::Keep,
    )
    .unwrap();
    cache.stop_background_cleaner();
    let id = cache.add_core(core_media.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    let mut model = vec![0u8; 4 * MIB as usize];
    for n in 0..64u64 {
        let mut buf = vec![0u8; 32 << 10];
        let at = (n * 37 % 120) * (32 << 10);
        fill(&mut buf, 1 + n as u32, at / 512);
        core.write(&buf, at).unwrap();
        model[at as usize..][..buf.len()].copy_from_slice(&buf);
        if n == 20 {
            mirror.set_config(fail_everything());
            // The commit reaches the mirror whatever the writes found room for.
            core.flush().unwrap();
        }
    }
    assert_eq!(
        cache.mirror_status().unwrap().state,
        MirrorState::MirrorLost
    );
    let too_small = Arc::new(RamVolume::new("too small", mirror_bytes - 4096).unwrap());
    let err = cache
        .attach_mirror(too_small, false)
        .unwrap_err()
        .to_string();
    assert!(err.contains("cache lines its mirror covers"), "{err}");
    let new_mirror = Arc::new(RamVolume::new("new mirror", mirror_bytes).unwrap());
    cache.attach_mirror(new_mirror.clone(), false).unwrap();
    assert_eq!(cache.mirror_status().unwrap().state, MirrorState::Redundant);
    // The primary dies: the new small mirror alone brings every write back.
    drop(core);
    drop(cache);
    let mut open = |_: &_| Some(core_media.clone() as VolumeRef);
    let cache = Cache::load_mirror(new_mirror, &mut open).unwrap();
    cache.check_invariants();
    let core = cache.core(id).unwrap();
    let mut buf = vec![0u8; 4 * MIB as usize];
    core.read(&mut buf, 0).unwrap();
    check(&buf, &model, 0, "from the rebuilt small mirror alone");
}

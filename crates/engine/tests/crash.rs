//! Power-cut simulation: thousands of crash points, each checked against the durability contract.
//!
//! Both the cache volume and the core are `CrashVolume`s: writes since their last flush are
//! volatile. A shared budget of volume operations picks the crash point: once it runs out the
//! devices are "dead" (writes and flushes silently vanish), the operation in progress finishes
//! against dead devices, then each device loses an arbitrary subset of its volatile writes and
//! tears some. The cache is loaded from what is left and every sector must hold either its
//! content as of the last completed flush or content written after it; never older data, never
//! another sector's data, never garbage.
//!
//! `HC_CRASH_POINTS` sets the number of crash points (default 10000); a failure prints the seed,
//! and `HC_CRASH_SEED` replays one.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use hybridcache_engine::{Cache, CacheConfig, CacheMode, Core, LineSize};
use hybridcache_volume::{CrashVolume, RamVolume, Volume, VolumeRef};

/// A device that dies when the shared operation budget runs out.
struct Mortal {
    inner: Arc<CrashVolume>,
    budget: Arc<AtomicI64>,
}

impl Mortal {
    fn alive(&self) -> bool {
        self.budget.fetch_sub(1, Ordering::SeqCst) > 0
    }
}

impl Volume for Mortal {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> hybridcache_volume::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> hybridcache_volume::Result<()> {
        if self.alive() {
            self.inner.write_at(buf, offset)
        } else {
            Ok(())
        }
    }
    fn flush(&self) -> hybridcache_volume::Result<()> {
        if self.alive() {
            self.inner.flush()
        } else {
            Ok(())
        }
    }
    fn discard(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        if self.alive() {
            self.inner.discard(offset, len)
        } else {
            Ok(())
        }
    }
    fn discard_zeroes(&self) -> bool {
        true
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        if self.alive() {
            self.inner.write_zeroes(offset, len)
        } else {
            Ok(())
        }
    }
}

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

const SECTOR: usize = 512;

/// Sector content for write `stamp` at sector `sector`: identifies both, so a sector holding
/// another address's data or a torn mix is caught. Stamp 0 is all zeroes (never written).
fn fill(buf: &mut [u8], stamp: u32, first_sector: u64) {
    for (i, s) in buf.chunks_mut(SECTOR).enumerate() {
        if stamp == 0 {
            s.fill(0);
            continue;
        }
        let tag = [
            stamp.to_le_bytes(),
            ((first_sector + i as u64) as u32).to_le_bytes(),
        ]
        .concat();
        for c in s.chunks_mut(8) {
            c.copy_from_slice(&tag);
        }
    }
}

/// What a sector read back as: Some(stamp) if it is a well-formed sector of that stamp for this
/// sector (0 for zeroes), None for anything else.
fn decode(s: &[u8], sector: u64) -> Option<u32> {
    if s.iter().all(|&b| b == 0) {
        return Some(0);
    }
    let stamp = u32::from_le_bytes(s[0..4].try_into().unwrap());
    let mut expect = vec![0u8; SECTOR];
    fill(&mut expect, stamp, sector);
    (s == &expect[..]).then_some(stamp)
}

/// Per sector: content as of the last completed flush, and what was written since.
struct Model {
    durable: Vec<u32>,
    latest: Vec<u32>,
    since: Vec<Vec<u32>>,
}

impl Model {
    fn new(sectors: usize) -> Model {
        Model {
            durable: vec![0; sectors],
            latest: vec![0; sectors],
            since: vec![Vec::new(); sectors],
        }
    }
    fn write(&mut self, first: u64, count: u64, stamp: u32) {
        for s in first..first + count {
            self.latest[s as usize] = stamp;
            self.since[s as usize].push(stamp);
        }
    }
    fn flushed(&mut self) {
        self.durable.clone_from(&self.latest);
        for s in &mut self.since {
            s.clear();
        }
    }
    fn allowed(&self, sector: usize, stamp: u32) -> bool {
        self.durable[sector] == stamp || self.since[sector].contains(&stamp)
    }
}

struct Rig {
    cache_media: Arc<CrashVolume>,
    core_media: Arc<CrashVolume>,
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

fn check_all(core: &Core, model: &Model, seed: u64, when: &str) {
    let size = core.size();
    let mut buf = vec![0u8; size as usize];
    core.read(&mut buf, 0)
        .unwrap_or_else(|e| panic!("seed {seed}: read after {when}: {e}"));
    for (i, s) in buf.chunks(SECTOR).enumerate() {
        let got = decode(s, i as u64);
        match got {
            Some(stamp) if model.allowed(i, stamp) => {}
            _ => panic!(
                "seed {seed}: after {when}, sector {i} holds {got:?}; allowed: durable {} or written since {:?}",
                model.durable[i], model.since[i]
            ),
        }
    }
}

/// One crash point. Returns the number of operations run before the crash.
fn crash_round(seed: u64) -> usize {
    let mut rng = Rng(seed);
    let line_kib = LineSize::ALL_KIB[rng.below(5) as usize];
    let line = line_kib as u64 * 1024;
    // Data starts at 3 MiB for a small volume; a handful of lines forces eviction and cleaning.
    let cache_lines = [2, 4, 16][rng.below(3) as usize];
    let core_bytes = [256 << 10, 1 << 20][rng.below(2) as usize] + 7 * 512;
    let rig = Rig {
        cache_media: Arc::new(CrashVolume::new(Arc::new(
            RamVolume::new("cache", (3 << 20) + cache_lines * line).unwrap(),
        ))),
        core_media: Arc::new(CrashVolume::new(Arc::new(
            RamVolume::new("core", core_bytes).unwrap(),
        ))),
        budget: Arc::new(AtomicI64::new(i64::MAX)),
    };
    let mode = CacheMode::ALL[rng.below(6) as usize];
    let cache = Cache::create(
        rig.mortal(&rig.cache_media),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(line_kib).unwrap(),
            mode,
        },
        false,
    )
    .unwrap();
    let core_vol = rig.mortal(&rig.core_media);
    let id = cache.add_core(core_vol, None).unwrap();
    let core = cache.core(id).unwrap();
    let sectors = core_bytes / 512;
    let mut model = Model::new(sectors as usize);
    // Everything so far is durable (create and add_core flush); now pick the crash point.
    rig.cache_media.flush().unwrap();
    rig.core_media.flush().unwrap();
    rig.budget.store(rng.below(300) as i64, Ordering::SeqCst);

    let mut ops = 0;
    let mut stamp = 0u32;
    for _ in 0..80 {
        if rig.budget.load(Ordering::SeqCst) <= 0 {
            break;
        }
        ops += 1;
        // Small region so lines are reused, evicted and cleaned.
        let region = sectors.min(64 * 8);
        let (first, count) = if rng.below(3) == 0 {
            // Whole, aligned lines: a write-through or write-invalidate write then covers every
            // dirty sector of a line, the way lines become clean outside the cleaner.
            let per_line = line / 512;
            let first = rng.below(region / per_line) * per_line;
            (first, (per_line * (1 + rng.below(2))).min(sectors - first))
        } else {
            let first = rng.below(region);
            (first, (1 + rng.below(24)).min(sectors - first))
        };
        let dead_before = rig.budget.load(Ordering::SeqCst) <= 0;
        let r = rng.below(100);
        let durable_point = match r {
            0..=49 => {
                stamp += 1;
                let mut buf = vec![0u8; (count * 512) as usize];
                fill(&mut buf, stamp, first);
                let fua = rng.below(10) == 0;
                if fua {
                    core.write_fua(&buf, first * 512).unwrap();
                } else {
                    core.write(&buf, first * 512).unwrap();
                }
                model.write(first, count, stamp);
                fua
            }
            50..=64 => {
                let mut buf = vec![0u8; (count * 512) as usize];
                core.read(&mut buf, first * 512).unwrap();
                if rig.budget.load(Ordering::SeqCst) > 0 {
                    for (i, s) in buf.chunks(SECTOR).enumerate() {
                        let sec = first as usize + i;
                        assert_eq!(
                            decode(s, sec as u64),
                            Some(model.latest[sec]),
                            "seed {seed}: live read of sector {sec}"
                        );
                    }
                }
                false
            }
            65..=69 => {
                core.discard(first * 512, count * 512).unwrap();
                model.write(first, count, 0);
                false
            }
            70..=74 => {
                core.write_zeroes(first * 512, count * 512).unwrap();
                model.write(first, count, 0);
                false
            }
            75..=84 => {
                core.flush().unwrap();
                true
            }
            85..=87 => {
                cache.flush().unwrap();
                true
            }
            88..=97 => {
                let next = CacheMode::ALL[rng.below(6) as usize];
                let flush_first = rng.below(2) == 0;
                cache.set_mode(next, flush_first).unwrap();
                flush_first && !next.makes_dirty()
            }
            _ => {
                cache.flush_core(id).unwrap();
                true
            }
        };
        // A durability point counts only if the devices were alive through all of it.
        if durable_point && !dead_before && rig.budget.load(Ordering::SeqCst) > 0 {
            model.flushed();
        }
    }
    drop(core);
    drop(cache);
    // Power cut: each device keeps an arbitrary part of what it had not flushed.
    rig.cache_media.crash(rng.next()).unwrap();
    rig.core_media.crash(rng.next()).unwrap();

    let core_media = rig.core_media.clone();
    let cache = Cache::load(rig.cache_media.clone(), &mut |_| {
        Some(core_media.clone() as VolumeRef)
    })
    .unwrap_or_else(|e| panic!("seed {seed}: load after crash failed: {e}"));
    cache.check_invariants();
    let core = cache.core(id).unwrap();
    check_all(&core, &model, seed, "crash recovery");

    // What was read is now the content; a clean stop keeping dirty data and a load must give it
    // back exactly.
    let mut buf = vec![0u8; core_bytes as usize];
    core.read(&mut buf, 0).unwrap();
    cache.stop(rng.below(2) == 0).unwrap();
    drop(core);
    drop(cache);
    let core_media = rig.core_media.clone();
    let cache = Cache::load(rig.cache_media.clone(), &mut |_| {
        Some(core_media.clone() as VolumeRef)
    })
    .unwrap_or_else(|e| panic!("seed {seed}: load after clean stop failed: {e}"));
    cache.check_invariants();
    let mut again = vec![0u8; core_bytes as usize];
    cache.core(id).unwrap().read(&mut again, 0).unwrap();
    assert!(
        again == buf,
        "seed {seed}: content changed across a clean stop and load"
    );
    ops
}

#[test]
fn power_cuts_never_lose_flushed_writes_or_serve_wrong_data() {
    if let Ok(seed) = std::env::var("HC_CRASH_SEED") {
        crash_round(seed.parse().expect("HC_CRASH_SEED is a number"));
        return;
    }
    let points: u64 = std::env::var("HC_CRASH_POINTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    let base = 0x5eed_0000u64;
    let mut ops = 0;
    for i in 0..points {
        ops += crash_round(base + i);
    }
    println!("{points} crash points, {ops} operations before the crashes");
}

/// Writes `lines` whole 4 KiB lines of `stamp`-tagged data starting at line `first`.
fn write_lines(core: &Core, first: u64, lines: u64, stamp: u32) {
    let mut buf = vec![0u8; (lines * 4096) as usize];
    fill(&mut buf, stamp, first * 8);
    core.write(&buf, first * 4096).unwrap();
}

/// A cache whose metadata on the device says line L holds core line 0 dirty, while in RAM that
/// line has been made reusable; then the process dies (every write reached the device, nothing
/// more was committed). Loading must not serve another core line's data as core line 0's.
fn reuse_before_commit(make_reusable: impl Fn(&Cache, &Core)) {
    let cache_media = Arc::new(RamVolume::new("cache", (3 << 20) + 4 * 4096).unwrap());
    let core_media = Arc::new(RamVolume::new("core", 1 << 20).unwrap());
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
    let id = cache.add_core(core_media.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    write_lines(&core, 0, 1, 1);
    core.flush().unwrap();
    make_reusable(&cache, &core);
    // Four more lines fill the 4-line cache: the fourth needs line 0's cache line, and none of
    // them triggers cleaning (whose commit would record the reuse).
    for i in 1..5 {
        write_lines(&core, i, 1, 100 + i as u32);
    }
    eprintln!(
        "before kill: {:?} {:?}",
        cache.stats().usage,
        cache.stats().requests
    );
    drop(core);
    drop(cache); // kill -9: no stop, no commit
    let cache = Cache::load(cache_media, &mut |_| Some(core_media.clone() as VolumeRef)).unwrap();
    let mut buf = vec![0u8; 4096];
    eprintln!("loaded: {:?}", cache.stats().usage);
    cache.core(id).unwrap().read(&mut buf, 0).unwrap();
    eprintln!(
        "stamps: {:?}",
        buf.chunks(512)
            .enumerate()
            .map(|(i, s)| decode(s, i as u64))
            .collect::<Vec<_>>()
    );
    for (i, s) in buf.chunks(SECTOR).enumerate() {
        let got = decode(s, i as u64);
        assert!(
            matches!(got, Some(0) | Some(1) | Some(2)),
            "sector {i} of core line 0 holds {got:?}: another line's data"
        );
    }
}

#[test]
fn a_line_cleaned_by_write_through_is_not_reused_before_the_device_knows() {
    reuse_before_commit(|cache, core| {
        cache.set_mode(CacheMode::Wt, false).unwrap();
        // Covers every dirty sector: the line is clean in RAM, still dirty on the device.
        write_lines(core, 0, 1, 2);
    });
}

#[test]
fn a_dirty_line_dropped_by_discard_is_not_reused_before_the_device_knows() {
    reuse_before_commit(|_, core| core.discard(0, 4096).unwrap());
}

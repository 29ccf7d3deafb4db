//! Batched writes (`Core::write_batch`, engine write_batch.rs): a batch leaves the cache as the
//! same writes one by one in request order would, whatever it holds (the same sector twice,
//! overlapping ranges, hits, misses, requests beyond the end), mixed with single writes, FUA
//! writes, flushes and reads, in every mode and line size; on two threads; on a cache device
//! that fails writes; on a mirrored cache, whose mirror alone has every write after a flush;
//! and through power cuts in the middle of a batch.

mod common;
mod durability;

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use hybridcache_engine::{Cache, CacheConfig, CacheMode, Core, LineSize, MirrorLostPolicy};
use hybridcache_volume::{
    CrashVolume, FaultConfig, FaultyVolume, RamVolume, SplitMix64 as Rng, Volume, VolumeRef,
};

const CORE: u64 = 1 << 20;

/// Random writes of a batch: sector-aligned, 1..=24 sectors inside `region` bytes; some repeat
/// an earlier request's range exactly, some start inside one (the same sectors twice).
fn requests(rng: &mut Rng, n: usize, region: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(n);
    for _ in 0..n {
        if !out.is_empty() && rng.next_u64() % 4 == 0 {
            let (off, len) = out[(rng.next_u64() % out.len() as u64) as usize];
            let shift = rng.next_u64() % (len / SECTOR) * SECTOR;
            out.push(((off + shift).min(region - len), len));
            continue;
        }
        let sectors = 1 + rng.next_u64() % 24;
        let first = rng.next_u64() % (region / SECTOR - sectors);
        out.push((first * SECTOR, sectors * SECTOR));
    }
    out
}

/// The exported volume and what it must hold, request by request.
struct Checked<'a> {
    core: &'a Core,
    model: Vec<u8>,
    tag: u64,
    what: String,
}

impl Checked<'_> {
    /// One batch of `reqs`, applied to the model in request order.
    fn batch(&mut self, reqs: &[(u64, u64)]) {
        let data: Vec<Vec<u8>> = reqs
            .iter()
            .map(|&(off, len)| {
                self.tag += 1;
                stamped(len, self.tag, off / SECTOR)
            })
            .collect();
        let batch: Vec<(&[u8], u64)> = data
            .iter()
            .zip(reqs)
            .map(|(d, &(off, _))| (&d[..], off))
            .collect();
        let results = self.core.write_batch(&batch);
        assert_eq!(results.len(), reqs.len(), "{}", self.what);
        for (i, (r, (d, &(off, len)))) in results.iter().zip(data.iter().zip(reqs)).enumerate() {
            assert!(
                r.is_ok(),
                "{}: request {i} at {off}+{len}: {r:?}",
                self.what
            );
            self.model[off as usize..(off + len) as usize].copy_from_slice(d);
        }
    }

    fn single(&mut self, off: u64, len: u64, fua: bool) {
        self.tag += 1;
        let d = stamped(len, self.tag, off / SECTOR);
        if fua {
            self.core.write_fua(&d, off).unwrap();
        } else {
            self.core.write(&d, off).unwrap();
        }
        self.model[off as usize..(off + len) as usize].copy_from_slice(&d);
    }

    fn check(&self, off: u64, len: u64) {
        let mut buf = vec![0xEE; len as usize];
        self.core.read(&mut buf, off).unwrap();
        let want = &self.model[off as usize..(off + len) as usize];
        if let Some(d) = first_difference(want, &buf, off / SECTOR) {
            panic!("{}: read at {off}+{len}: {d}", self.what);
        }
    }
}

/// A round of random work on `c`: batches, single and FUA writes, flushes and reads.
fn random_work(c: &mut Checked<'_>, rng: &mut Rng, region: u64, rounds: u64) {
    for round in 0..rounds {
        c.what = format!(
            "{} round {round}",
            c.what.split(" round").next().unwrap_or("")
        );
        match rng.next_u64() % 8 {
            0 => c.core.flush().unwrap(),
            1 => {
                let (off, len) = requests(rng, 1, region)[0];
                c.single(off, len, rng.next_u64() % 2 == 0);
            }
            2 => {
                let (off, len) = requests(rng, 1, region)[0];
                c.check(off, len);
            }
            _ => {
                let n = 2 + (rng.next_u64() % 31) as usize;
                c.batch(&requests(rng, n, region));
            }
        }
    }
    c.check(0, region);
}

#[test]
fn a_batch_writes_what_single_writes_in_order_write_in_every_mode() {
    let seed = seed(0x5eed_3b7c);
    eprintln!("seed {seed}");
    for (m, mode) in CacheMode::ALL.into_iter().enumerate() {
        for line_kib in [4u32, 16, 64] {
            let mut rng = Rng(seed ^ (m as u64) << 8 ^ line_kib as u64);
            // Half the core fits: hits, misses, eviction and cleaning all happen.
            let lines = (CORE / 2) / LineSize::from_kib(line_kib).unwrap().bytes() as u64;
            let (cache, _vol) = new_cache(line_kib, lines, mode);
            let t = add_core(&cache, CORE);
            let mut c = Checked {
                core: &t.core,
                model: vec![0; CORE as usize],
                tag: 0,
                what: format!("{mode:?} {line_kib}K"),
            };
            // Mostly inside what fits (write hits), then over the whole core.
            random_work(&mut c, &mut rng, CORE / 4, 150);
            random_work(&mut c, &mut rng, CORE, 50);
            let before = cache.core_stats(t.id).unwrap().requests;
            let reqs = requests(&mut rng, 20, CORE / 4);
            c.batch(&reqs);
            let after = cache.core_stats(t.id).unwrap().requests;
            let writes = |s: &hybridcache_engine::RequestStats| {
                s.write_hits + s.write_partial_misses + s.write_full_misses + s.pass_through_writes
            };
            assert_eq!(
                writes(&after) - writes(&before),
                reqs.len() as u64,
                "{mode:?} {line_kib}K: each request of a batch counted once"
            );
            cache.flush().unwrap();
            c.check(0, CORE);
            cache.check_invariants();
        }
    }
}

#[test]
fn a_bad_request_fails_alone() {
    let (cache, _vol) = new_cache(4, 256, CacheMode::Wb);
    let t = add_core(&cache, CORE);
    let a = stamped(4096, 1, 0);
    let b = stamped(4096, 2, 8);
    t.core.write(&a, 0).unwrap();
    let results = t
        .core
        .write_batch(&[(&b[..], 0), (&a[..], CORE), (&a[..512], 4096 + 1)]);
    assert!(results[0].is_ok(), "{results:?}");
    assert!(results[1].is_err(), "beyond the core's end: {results:?}");
    assert!(results[2].is_err(), "not sector-aligned: {results:?}");
    assert_eq!(read_vol(&t.core, 0, 4096), b);
}

/// Counts the batched submissions that reach the cache device.
struct Counting {
    inner: Arc<RamVolume>,
    batches: AtomicU64,
    pieces: AtomicU64,
}

impl Volume for Counting {
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
        self.inner.write_at(buf, offset)
    }
    fn write_batch(&self, pieces: &[(&[u8], u64)]) -> hybridcache_volume::Result<()> {
        self.batches.fetch_add(1, Ordering::SeqCst);
        self.pieces.fetch_add(pieces.len() as u64, Ordering::SeqCst);
        self.inner.write_batch(pieces)
    }
    fn flush(&self) -> hybridcache_volume::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        self.inner.discard(offset, len)
    }
}

/// The write hits of a batch reach the cache device as one submission; a request that needs a
/// line, or overlaps a planned hit, ends the submission before it.
#[test]
fn write_hits_reach_the_cache_device_as_one_submission() {
    let dev = Arc::new(Counting {
        inner: ram("cache", 256 * 4096),
        batches: AtomicU64::new(0),
        pieces: AtomicU64::new(0),
    });
    let cache = Cache::new(
        dev.clone(),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        },
    )
    .unwrap();
    let t = add_core(&cache, CORE);
    t.core.write(&stamped(64 * 4096, 1, 0), 0).unwrap();
    let data: Vec<Vec<u8>> = (0..32u64).map(|i| stamped(4096, 100 + i, i * 16)).collect();
    let batch: Vec<(&[u8], u64)> = (0..32u64)
        .map(|i| (&data[i as usize][..], i * 2 * 4096))
        .collect();
    assert!(t.core.write_batch(&batch).iter().all(|r| r.is_ok()));
    // Lines whose stripes collide (the stripe is a hash of the core line) end a submission
    // like an overlap: a few submissions, not one per request.
    let (batches, pieces) = (
        dev.batches.load(Ordering::SeqCst),
        dev.pieces.load(Ordering::SeqCst),
    );
    eprintln!("32 write hits: {batches} submissions of {pieces} pieces");
    assert!(
        batches <= 4 && pieces >= 28,
        "{batches} submissions of {pieces} pieces"
    );
    for (i, d) in data.iter().enumerate() {
        let off = i as u64 * 2 * 4096;
        let got = read_vol(&t.core, off, 4096);
        assert!(
            first_difference(d, &got, off / SECTOR).is_none(),
            "request {i}"
        );
    }
    // hit, hit, miss (needs a line), hit, the first hit's sector again, hit: the two hits go
    // together, the miss alone, the hit after it alone (the overlap ends it; one request is a
    // plain write), then the last two together.
    let offs = [0u64, 4096, 100 * 4096, 8192, 0, 12288];
    let data: Vec<Vec<u8>> = offs
        .iter()
        .enumerate()
        .map(|(i, &o)| stamped(4096, 200 + i as u64, o / SECTOR))
        .collect();
    let batch: Vec<(&[u8], u64)> = data.iter().zip(offs).map(|(d, o)| (&d[..], o)).collect();
    dev.batches.store(0, Ordering::SeqCst);
    assert!(t.core.write_batch(&batch).iter().all(|r| r.is_ok()));
    let batches = dev.batches.load(Ordering::SeqCst);
    eprintln!("hit, hit, miss, hit, overlap, hit: {batches} submissions");
    assert!((1..=2).contains(&batches), "{batches} submissions");
    let got = read_vol(&t.core, 0, 4096);
    assert!(
        first_difference(&data[4], &got, 0).is_none(),
        "the later write wins: {:?}",
        first_difference(&data[4], &got, 0)
    );
    assert!(read_vol(&t.core, 100 * 4096, 4096) == data[2], "the miss");
}

/// Two threads batching into their own halves of one core, whose lines share stripes and
/// compete for the cache's lines: no deadlock, and each half holds its own thread's writes.
#[test]
fn two_threads_batching_keep_their_writes() {
    let _dog = Watchdog::new("write batches on two threads", Duration::from_secs(120));
    for line_kib in [4u32, 64] {
        let lines = (CORE / 4) / LineSize::from_kib(line_kib).unwrap().bytes() as u64;
        let (cache, _vol) = new_cache(line_kib, lines, CacheMode::Wb);
        let t = add_core(&cache, CORE);
        let half = CORE / 2;
        let models: Vec<Vec<u8>> = std::thread::scope(|s| {
            let workers: Vec<_> = (0..2u64)
                .map(|n| {
                    let core = &t.core;
                    s.spawn(move || {
                        let mut rng = Rng(0x77 + n + line_kib as u64);
                        let mut model = vec![0u8; half as usize];
                        let base = n * half;
                        for round in 0..300u64 {
                            let reqs = requests(&mut rng, 1 + (round % 32) as usize, half / 2);
                            let data: Vec<Vec<u8>> = reqs
                                .iter()
                                .enumerate()
                                .map(|(i, &(off, len))| {
                                    stamped(
                                        len,
                                        n << 40 | round << 8 | i as u64,
                                        (base + off) / SECTOR,
                                    )
                                })
                                .collect();
                            let batch: Vec<(&[u8], u64)> = data
                                .iter()
                                .zip(&reqs)
                                .map(|(d, &(off, _))| (&d[..], base + off))
                                .collect();
                            for r in core.write_batch(&batch) {
                                r.unwrap();
                            }
                            for (d, &(off, len)) in data.iter().zip(&reqs) {
                                model[off as usize..(off + len) as usize].copy_from_slice(d);
                            }
                            if round % 50 == 49 {
                                core.flush().unwrap();
                            }
                        }
                        model
                    })
                })
                .collect();
            workers.into_iter().map(|w| w.join().unwrap()).collect()
        });
        for (n, model) in models.iter().enumerate() {
            let got = read_vol(&t.core, n as u64 * half, half);
            if let Some(d) = first_difference(model, &got, n as u64 * half / SECTOR) {
                panic!("{line_kib}K thread {n}: {d}");
            }
        }
        cache.check_invariants();
    }
}

/// A cache device that fails some writes: a request whose cache write fails still lands
/// (its data goes to the core, its sectors leave the cache), and no other request of the batch
/// is lost with it.
#[test]
fn failed_cache_writes_in_a_batch_lose_nothing() {
    let seed = seed(0xfa17_ba7c);
    eprintln!("seed {seed}");
    let mut rng = Rng(seed);
    let dev = Arc::new(FaultyVolume::new(ram("cache", 128 * 4096)));
    let cache = Cache::new(
        dev.clone(),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        },
    )
    .unwrap();
    let t = add_core(&cache, CORE);
    let mut c = Checked {
        core: &t.core,
        model: vec![0; CORE as usize],
        tag: 0,
        what: "failing cache device".into(),
    };
    for round in 0..200 {
        if round % 3 == 0 {
            dev.set_config(FaultConfig {
                fail_next_writes: 1 + rng.next_u64() % 3,
                ..FaultConfig::default()
            });
        }
        let n = 2 + (rng.next_u64() % 20) as usize;
        c.batch(&requests(&mut rng, n, 64 * 4096));
        dev.set_config(FaultConfig::default());
        c.check(0, 64 * 4096);
    }
    assert!(
        cache.stats().errors.cache_write > 0,
        "the device failed no write"
    );
}

/// A mirrored cache: batched write hits go to both devices, so after a flush the mirror alone
/// (what `--load-mirror` loads) has every write.
#[test]
fn the_mirror_alone_has_every_batched_write_after_a_flush() {
    let mut rng = Rng(seed(0x3b1c));
    let line = LineSize::from_kib(4).unwrap();
    let bytes = (3 << 20) + 128 * 4096;
    let primary: VolumeRef = ram("primary", bytes);
    let mirror: VolumeRef = ram("mirror", bytes);
    let core_media = ram("core", CORE);
    let cache = Cache::create_mirrored(
        primary,
        mirror.clone(),
        CacheConfig {
            id: 1,
            line_size: line,
            mode: CacheMode::Wb,
        },
        false,
        MirrorLostPolicy::Drain,
    )
    .unwrap();
    cache.stop_background_cleaner();
    let id = cache.add_core(core_media.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    let mut c = Checked {
        core: &core,
        model: vec![0; CORE as usize],
        tag: 0,
        what: "mirrored".into(),
    };
    // Map the region first so the batches below are write hits.
    c.single(0, 64 * 4096, false);
    for _ in 0..40 {
        let n = 2 + (rng.next_u64() % 30) as usize;
        c.batch(&requests(&mut rng, n, 64 * 4096));
    }
    core.flush().unwrap();
    let model = c.model.clone();
    drop(c);
    drop(core);
    // The primary is gone for good: the mirror alone must serve every write.
    drop(cache);
    let cache = Cache::load_mirror(mirror, &mut |_| Some(core_media.clone() as VolumeRef))
        .expect("the mirror alone loads");
    let core = cache.core(id).unwrap();
    let got = read_vol(&core, 0, CORE);
    if let Some(d) = first_difference(&model, &got, 0) {
        panic!("the mirror alone: {d}");
    }
}

/// Power cuts in the middle of batches (the crash volume records each piece of a batched
/// submission as its own write, so a cut falls between them): after recovery every sector
/// holds what the last completed flush left or something written since; never older data,
/// never another sector's, never garbage; and after a later flush nothing older comes back.
#[test]
fn power_cuts_in_a_batch_lose_no_flushed_write() {
    use durability::{decode, fill, power_cut, Model, Mortal};
    let points: u64 = std::env::var("HC_CRASH_POINTS")
        .ok()
        .and_then(|v| v.parse().ok())
        .map_or(600, |p: u64| p / 10);
    for i in 0..points {
        let seed = 0xba7c_0000 + i;
        let mut rng = Rng(seed);
        let line_kib = LineSize::ALL_KIB[rng.below(3) as usize];
        let sectors = (256u64 << 10) / 512;
        let cache_media = Arc::new(CrashVolume::new(Arc::new(
            RamVolume::new("cache", (3 << 20) + 256 * 1024).unwrap(),
        )));
        let core_media = Arc::new(CrashVolume::new(Arc::new(
            RamVolume::new("core", sectors * 512).unwrap(),
        )));
        let budget = Arc::new(AtomicI64::new(i64::MAX));
        let mortal = |v: &Arc<CrashVolume>| -> VolumeRef {
            Arc::new(Mortal {
                inner: v.clone(),
                budget: budget.clone(),
            })
        };
        let cache = Cache::create(
            mortal(&cache_media),
            CacheConfig {
                id: 1,
                line_size: LineSize::from_kib(line_kib).unwrap(),
                mode: CacheMode::Wb,
            },
            false,
        )
        .unwrap();
        cache.stop_background_cleaner();
        let id = cache.add_core(mortal(&core_media), None).unwrap();
        let core = cache.core(id).unwrap();
        let mut model = Model::new(sectors as usize);
        let mut stamp = 0u32;
        // Map the region the batches write (most of them are then pure hits), durably.
        let region = sectors / 2;
        stamp += 1;
        let mut buf = vec![0u8; (region * 512) as usize];
        fill(&mut buf, stamp, 0);
        core.write(&buf, 0).unwrap();
        model.write(0, region, stamp);
        core.flush().unwrap();
        cache_media.flush().unwrap();
        core_media.flush().unwrap();
        model.flushed();
        budget.store(rng.below(400) as i64, Ordering::SeqCst);
        for _ in 0..40 {
            if budget.load(Ordering::SeqCst) <= 0 {
                break;
            }
            let dead_before = budget.load(Ordering::SeqCst) <= 0;
            let durable = if rng.below(6) == 0 {
                core.flush().unwrap();
                true
            } else {
                let n = 2 + rng.below(24) as usize;
                let mut reqs = Vec::with_capacity(n);
                for _ in 0..n {
                    let count = 1 + rng.below(16);
                    // Now and then outside the mapped region: a miss among the hits.
                    let limit = if rng.below(8) == 0 { sectors } else { region };
                    let first = rng.below(limit - count);
                    stamp += 1;
                    let mut d = vec![0u8; (count * 512) as usize];
                    fill(&mut d, stamp, first);
                    reqs.push((first, count, stamp, d));
                }
                let batch: Vec<(&[u8], u64)> =
                    reqs.iter().map(|(f, _, _, d)| (&d[..], f * 512)).collect();
                for r in core.write_batch(&batch) {
                    r.unwrap();
                }
                for &(first, count, stamp, _) in &reqs {
                    model.write(first, count, stamp);
                }
                false
            };
            if durable && !dead_before && budget.load(Ordering::SeqCst) > 0 {
                model.flushed();
            }
        }
        drop(core);
        power_cut(&budget);
        drop(cache);
        cache_media.crash(rng.next_u64()).unwrap();
        core_media.crash(rng.next_u64()).unwrap();
        let cm = core_media.clone();
        let cache = Cache::load(cache_media.clone(), &mut |_| Some(cm.clone() as VolumeRef))
            .unwrap_or_else(|e| panic!("seed {seed}: load after the cut: {e}"));
        cache.check_invariants();
        let core = cache.core(id).unwrap();
        let got = read_vol(&core, 0, sectors * 512);
        for (s, bytes) in got.chunks(512).enumerate() {
            let found = decode(bytes, s as u64);
            assert!(
                found.is_some_and(|st| model.allowed(s, st)),
                "seed {seed}: sector {s} holds {found:?}; allowed: durable {} or written since {:?}",
                model.durable[s],
                model.since[s]
            );
        }
        // What recovery serves is now the content; a flush and a reload must keep it.
        core.flush().unwrap();
        drop(core);
        cache.stop(false).unwrap();
        drop(cache);
        let cm = core_media.clone();
        let cache = Cache::load(cache_media.clone(), &mut |_| Some(cm.clone() as VolumeRef))
            .unwrap_or_else(|e| panic!("seed {seed}: load after the flush: {e}"));
        let again = read_vol(&cache.core(id).unwrap(), 0, sectors * 512);
        assert!(again == got, "seed {seed}: a flushed recovery changed");
    }
}

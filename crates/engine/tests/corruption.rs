//! Corruption fuzz: damage one sector before the data region (superblock slots, commit records,
//! metadata block copies, or the empty space among them) of a cache that was stopped clean,
//! stopped keeping its dirty data (`stop(false)`, `-T -n`), or crashed mid-run, then load it.
//! Damage that changes nothing is drawn again, so every trial loads a damaged image. Each trial must either be refused with both devices byte-identical to before the load, or
//! load and read back every sector as the durability contract (docs/format.md) allows: after a
//! stop exactly the last acknowledged content, after a crash the content as of the last completed
//! flush or content written after it. Silent rollback to older metadata fails the trial.
//!
//! `HC_CORRUPTION_TRIALS` sets the number of trials (default 1200); a failure names the seed,
//! and `HC_CORRUPTION_SEED` replays one (checking the undamaged load first).
//!
//! Half of the trials run with lazy flush on (`HC_CORRUPTION_LAZY_FLUSH=1` puts it on in every
//! trial), so the background cleaner makes room and commits while requests run. A power cut
//! (`power_cut`) stops every device before the cache is dropped: the cleaner may still be in a
//! run, and a real power cut stops it too.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use hybridcache_engine::{Cache, CacheConfig, CacheMode, Core, LineSize};
use hybridcache_volume::{CrashVolume, RamVolume, Volume, VolumeRef};

mod durability;
use durability::{decode, fill, power_cut, Model, Mortal, Rng, SECTOR};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ending {
    /// `stop(true)`: dirty data flushed to the core, then the clean-stop mark.
    CleanStop,
    /// `stop(false)`: dirty data kept in the cache for the next load.
    StopKeepingDirty,
    /// Power cut at a random volume operation, possibly inside a commit.
    Crash,
}

/// What a run left on the devices, and what each sector may read back as.
struct Case {
    cache_image: Vec<u8>,
    core_image: Vec<u8>,
    model: Model,
    /// After a stop every acknowledged write must read back exactly (`model.latest`).
    exact: bool,
    core_id: u16,
    meta_blocks: u64,
    data_offset: u64,
}

fn image(v: &dyn Volume) -> Vec<u8> {
    let mut b = vec![0u8; v.size() as usize];
    v.read_at(&mut b, 0).unwrap();
    b
}

fn ram_with(name: &str, bytes: &[u8]) -> Arc<RamVolume> {
    let v = RamVolume::new(name, bytes.len() as u64).unwrap();
    v.write_at(bytes, 0).unwrap();
    Arc::new(v)
}

/// Run a random workload on a fresh cache and end it as `ending` says.
fn run_case(seed: u64, line_kib: u32, ending: Ending) -> Case {
    let mut rng = Rng(seed);
    let line = line_kib as u64 * 1024;
    let cache_lines: u64 = if line_kib == 4 {
        [4, 16, 64][rng.below(3) as usize]
    } else {
        [4, 16][rng.below(2) as usize]
    };
    let core_bytes: u64 = if line_kib == 4 { 1 << 20 } else { 2 << 20 };
    let cache_media = Arc::new(CrashVolume::new(Arc::new(
        RamVolume::new("cache", (3 << 20) + cache_lines * line).unwrap(),
    )));
    let core_media = Arc::new(CrashVolume::new(Arc::new(
        RamVolume::new("core", core_bytes).unwrap(),
    )));
    let budget = Arc::new(AtomicI64::new(i64::MAX));
    let mortal = |v: &Arc<CrashVolume>| -> VolumeRef {
        Arc::new(Mortal {
            inner: v.clone(),
            budget: budget.clone(),
        })
    };
    // Mostly modes that keep dirty data: they give the metadata the most to lose.
    let mode = match rng.below(10) {
        0..=5 => CacheMode::Wb,
        6 => CacheMode::Wo,
        _ => CacheMode::ALL[rng.below(6) as usize],
    };
    let cache = Cache::create(
        mortal(&cache_media),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(line_kib).unwrap(),
            mode,
        },
        false,
    )
    .unwrap();
    let id = cache.add_core(mortal(&core_media), None).unwrap();
    let lazy = rng.below(2) == 0;
    if lazy || std::env::var("HC_CORRUPTION_LAZY_FLUSH").is_ok_and(|v| v == "1") {
        cache
            .set_lazy_flush(hybridcache_engine::LazyFlush { enabled: true })
            .unwrap();
    }
    let core = cache.core(id).unwrap();
    let sb = cache.superblock().unwrap();
    let sectors = core_bytes / 512;
    let mut model = Model::new(sectors as usize);
    cache_media.flush().unwrap();
    core_media.flush().unwrap();
    if ending == Ending::Crash {
        budget.store(rng.below(400) as i64, Ordering::SeqCst);
    }
    let mut stamp = 0u32;
    for _ in 0..60 {
        if budget.load(Ordering::SeqCst) <= 0 {
            break;
        }
        let per_line = line / 512;
        let (first, count) = if rng.below(3) == 0 {
            let first = rng.below(sectors / per_line) * per_line;
            (first, per_line.min(sectors - first))
        } else {
            let first = rng.below(sectors);
            (first, (1 + rng.below(24)).min(sectors - first))
        };
        let dead_before = budget.load(Ordering::SeqCst) <= 0;
        let durable_point = match rng.below(100) {
            0..=59 => {
                stamp += 1;
                let mut buf = vec![0u8; (count * 512) as usize];
                fill(&mut buf, stamp, first);
                core.write(&buf, first * 512).unwrap();
                model.write(first, count, stamp);
                false
            }
            60..=64 => {
                core.write_zeroes(first * 512, count * 512).unwrap();
                model.write(first, count, 0);
                false
            }
            65..=79 => {
                core.flush().unwrap();
                true
            }
            80..=84 => {
                cache.flush().unwrap();
                true
            }
            85..=89 => {
                let next = CacheMode::ALL[rng.below(6) as usize];
                let flush_first = rng.below(2) == 0;
                cache.set_mode(next, flush_first).unwrap();
                flush_first && !next.makes_dirty()
            }
            _ => {
                let mut buf = vec![0u8; (count * 512) as usize];
                core.read(&mut buf, first * 512).unwrap();
                false
            }
        };
        if durable_point && !dead_before && budget.load(Ordering::SeqCst) > 0 {
            model.flushed();
        }
    }
    drop(core);
    let exact = match ending {
        Ending::CleanStop | Ending::StopKeepingDirty => {
            cache.stop(ending == Ending::CleanStop).unwrap();
            model.flushed();
            true
        }
        Ending::Crash => false,
    };
    // Power goes after a stop too: a stop must have made everything durable.
    power_cut(&budget);
    drop(cache);
    cache_media.crash(rng.next_u64()).unwrap();
    core_media.crash(rng.next_u64()).unwrap();
    Case {
        cache_image: image(&**cache_media.inner()),
        core_image: image(&**core_media.inner()),
        model,
        exact,
        core_id: id,
        meta_blocks: sb.meta_blocks,
        data_offset: sb.data_offset,
    }
}

/// Compare what `core` reads with the model; Err names the first sectors that differ.
fn check(core: &Core, model: &Model, exact: bool) -> Result<(), String> {
    let mut buf = vec![0u8; core.size() as usize];
    core.read(&mut buf, 0).map_err(|e| format!("read: {e}"))?;
    let mut bad = Vec::new();
    for (i, s) in buf.chunks(SECTOR).enumerate() {
        let got = decode(s, i as u64);
        let ok = match got {
            Some(stamp) if exact => stamp == model.latest[i],
            Some(stamp) => model.allowed(i, stamp),
            None => false,
        };
        if !ok {
            bad.push(format!(
                "sector {i} holds {got:?} (expected {}{})",
                model.latest[i],
                if exact {
                    String::new()
                } else {
                    format!(
                        ", or durable {} or since {:?}",
                        model.durable[i], model.since[i]
                    )
                }
            ));
        }
    }
    if bad.is_empty() {
        Ok(())
    } else {
        let n = bad.len();
        bad.truncate(4);
        Err(format!("{n} sectors wrong: {}", bad.join("; ")))
    }
}

/// Load the images; Ok(true) loaded and verified, Ok(false) refused with the devices unchanged.
fn load_and_check(case: &Case, cache_image: &[u8]) -> Result<bool, String> {
    let cache_vol = ram_with("cache", cache_image);
    let core_vol = ram_with("core", &case.core_image);
    let core_ref: VolumeRef = core_vol.clone();
    match Cache::load(cache_vol.clone(), &mut |_| Some(core_ref.clone())) {
        Err(e) => {
            if image(&*cache_vol) != cache_image || image(&*core_vol) != case.core_image {
                return Err(format!("refused ({e}) but the devices changed"));
            }
            Ok(false)
        }
        Ok(cache) => {
            cache.check_invariants();
            let core = cache.core(case.core_id).map_err(|e| e.to_string())?;
            check(&core, &case.model, case.exact)?;
            Ok(true)
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Damage {
    BitFlip,
    MultiBitFlip,
    Zeroed,
    /// Another sector of the device (before the data region or in it) written in place of this
    /// one.
    Misdirected,
}

/// The copy of metadata block `block` that carries the higher sequence number (bytes 16..24),
/// as the byte offset of its sector.
fn newest_copy(case: &Case, block: u64) -> u64 {
    let at = |c: u64| (2 << 20) + (block * 2 + c) * 512;
    let seq = |c: u64| {
        let o = at(c) as usize;
        u64::from_le_bytes(case.cache_image[o + 16..o + 24].try_into().unwrap())
    };
    if seq(1) > seq(0) {
        at(1)
    } else {
        at(0)
    }
}

/// Where damage was aimed: the newest copy of a metadata block, either copy of one, a sector of
/// the format's structures whether it holds something or not (each config slot's sectors in use
/// and its first one, both commit record slots, every metadata block copy), or any sector before
/// the data region at all (mostly the empty space in the slots and after the metadata, which a
/// loader must not trust either).
const TARGETS: [&str; 4] = [
    "newest block copy",
    "any block copy",
    "any structure sector",
    "any sector before data",
];

/// Sectors of the format's structures, used or empty: an empty superblock or commit record slot
/// damaged into something that looks like one is as dangerous as damage to a used one.
fn structure_sectors(case: &Case) -> Vec<u64> {
    const SLOT: u64 = 2048;
    let used = |s: u64| {
        case.cache_image[(s * 512) as usize..((s + 1) * 512) as usize]
            .iter()
            .any(|&x| x != 0)
    };
    let mut out: Vec<u64> = (0..2 * SLOT)
        .filter(|&s| s % SLOT == 0 || s % SLOT == SLOT - 1 || used(s))
        .collect();
    out.extend(2 * SLOT..2 * SLOT + 2 * case.meta_blocks);
    out
}

/// How many draws in a row may change nothing before the fuzz gives up on a case: bit flips
/// always change a sector, so a handful suffice; more means the draw itself is broken.
const MAX_DRAWS: u64 = 64;

/// Damage one sector of the cache image. Draws again while the damage changed nothing
/// (zeroing an all-zero sector, a sector misdirected onto its own copy): such a trial would
/// pass without testing anything. Returns the damaged image, what was done, the target kind
/// (an index into TARGETS) and how many draws changed nothing.
fn damage(case: &Case, rng: &mut Rng) -> (Vec<u8>, String, usize, u64) {
    let before_data = case.data_offset / 512;
    let all_sectors = case.cache_image.len() as u64 / 512;
    let structures = structure_sectors(case);
    let mut unchanged = 0;
    loop {
        let mut img = case.cache_image.clone();
        let (target, aim) = match rng.below(10) {
            // Newest-copy-only damage: the copy a completed commit wrote last.
            0..=2 => (newest_copy(case, rng.below(case.meta_blocks)), 0),
            3..=4 => ((2 << 20) + rng.below(case.meta_blocks * 2) * 512, 1),
            5..=7 => (
                structures[rng.below(structures.len() as u64) as usize] * 512,
                2,
            ),
            _ => (rng.below(before_data) * 512, 3),
        };
        let kind = [
            Damage::BitFlip,
            Damage::MultiBitFlip,
            Damage::Zeroed,
            Damage::Misdirected,
        ][rng.below(4) as usize];
        let mut what = format!("{kind:?} at byte offset {target}");
        let sector = &mut img[target as usize..target as usize + 512];
        match kind {
            Damage::BitFlip => {
                let bit = rng.below(512 * 8);
                sector[(bit / 8) as usize] ^= 1 << (bit % 8);
            }
            Damage::MultiBitFlip => {
                for _ in 0..2 + rng.below(15) {
                    let bit = rng.below(512 * 8);
                    sector[(bit / 8) as usize] ^= 1 << (bit % 8);
                }
            }
            Damage::Zeroed => sector.fill(0),
            Damage::Misdirected => {
                // A write meant for any other sector of the device, the data region included
                // (a data line can look like anything, even a metadata block).
                let from = if rng.below(2) == 0 {
                    rng.below(before_data)
                } else {
                    before_data + rng.below(all_sectors - before_data)
                } * 512;
                sector.copy_from_slice(&case.cache_image[from as usize..from as usize + 512]);
                what = format!("{what} (from byte offset {from})");
            }
        }
        if img != case.cache_image {
            return (img, what, aim, unchanged);
        }
        unchanged += 1;
        assert!(
            unchanged < MAX_DRAWS,
            "{MAX_DRAWS} draws in a row changed nothing"
        );
    }
}

/// What happened to the trials of one ending and target.
#[derive(Default, Clone, Copy)]
struct Tally {
    refused: u64,
    verified: u64,
    failed: u64,
    /// Draws that changed nothing and were drawn again (not trials).
    unchanged: u64,
}

#[derive(Default)]
struct Counts {
    trials: u64,
    unchanged: u64,
    refused: u64,
    verified: u64,
    failed: u64,
    /// Per ending, then per target.
    by: [[Tally; 4]; 3],
}

/// One trial: the damaged images must load right or be refused cleanly. Every third trial also
/// loads the undamaged images first, which must load right: the run itself is sound (crash.rs
/// covers undamaged loads at length; here it keeps the fuzz honest at a third of the cost).
fn trial(seed: u64, counts: &mut Counts) -> Result<(), String> {
    let line_kib = if seed % 2 == 0 { 4 } else { 64 };
    let ending =
        [Ending::CleanStop, Ending::StopKeepingDirty, Ending::Crash][(seed / 2 % 3) as usize];
    let case = run_case(seed, line_kib, ending);
    if seed % 3 == 0 || std::env::var("HC_CORRUPTION_SEED").is_ok() {
        match load_and_check(&case, &case.cache_image) {
            Ok(true) => {}
            Ok(false) => return Err(format!("seed {seed}: the undamaged cache was refused")),
            Err(e) => return Err(format!("seed {seed}: undamaged load: {e}")),
        }
    }
    let mut rng = Rng(seed ^ 0xdead_beef);
    let (img, what, aim, unchanged) = damage(&case, &mut rng);
    let by = &mut counts.by[(seed / 2 % 3) as usize][aim];
    counts.trials += 1;
    counts.unchanged += unchanged;
    by.unchanged += unchanged;
    match load_and_check(&case, &img) {
        Ok(true) => {
            counts.verified += 1;
            by.verified += 1;
        }
        Ok(false) => {
            counts.refused += 1;
            by.refused += 1;
        }
        Err(e) => {
            counts.failed += 1;
            by.failed += 1;
            return Err(format!(
                "seed {seed} ({line_kib} KiB lines, {ending:?}, {what}): {e}"
            ));
        }
    }
    Ok(())
}

#[test]
fn damaged_metadata_is_refused_or_loads_exactly_right() {
    if let Ok(seed) = std::env::var("HC_CORRUPTION_SEED") {
        let mut counts = Counts::default();
        let seed = seed.parse().expect("HC_CORRUPTION_SEED is a number");
        if let Err(e) = trial(seed, &mut counts) {
            panic!("{e}");
        }
        return;
    }
    let trials: u64 = std::env::var("HC_CORRUPTION_TRIALS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1200);
    let base = 0xc0de_0000u64;
    let mut counts = Counts::default();
    let mut failures = Vec::new();
    for i in 0..trials {
        if let Err(e) = trial(base + i, &mut counts) {
            failures.push(e);
        }
    }
    println!(
        "corruption fuzz: {} trials, {} refused, {} loaded and verified, {} failed ({} draws changed nothing and were drawn again)",
        counts.trials,
        counts.refused,
        counts.verified,
        counts.failed,
        counts.unchanged
    );
    for (e, ending) in ["clean stop", "stop keeping dirty", "crash"]
        .iter()
        .enumerate()
    {
        for (t, target) in TARGETS.iter().enumerate() {
            let c = counts.by[e][t];
            println!(
                "  {ending}, {target}: {} refused, {} loaded and verified, {} failed, {} unchanged",
                c.refused, c.verified, c.failed, c.unchanged
            );
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} trials served wrong data or changed the devices; first: {}",
        failures.len(),
        trials,
        failures
            .iter()
            .take(5)
            .cloned()
            .collect::<Vec<_>>()
            .join("\n")
    );
    // Every trial damaged the image (unchanged draws were drawn again), so the default run
    // tests at least the 1,000 damaged loads issue 13 asks for.
    assert_eq!(counts.trials, trials);
    if std::env::var("HC_CORRUPTION_TRIALS").is_err() {
        assert!(counts.trials >= 1000, "{} trials", counts.trials);
    }
    // Most damage lands where a copy still holds the committed state; a loader that refused
    // everything would not be a loader.
    assert!(
        counts.verified > counts.trials / 5,
        "only {} of {} damaged caches loaded",
        counts.verified,
        counts.trials
    );
}

/// The checker must be able to fail: a cache device rolled back as a whole to an image taken
/// before the last flush is consistent, loads, and serves the older data, which the checker
/// has to report.
#[test]
fn negative_control_the_checker_catches_a_rolled_back_load() {
    let cache_media = Arc::new(RamVolume::new("cache", (3 << 20) + 16 * 4096).unwrap());
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
    let mut model = Model::new(2048);
    let mut buf = vec![0u8; 8 * 512];
    fill(&mut buf, 1, 0);
    core.write(&buf, 0).unwrap();
    core.flush().unwrap();
    model.write(0, 8, 1);
    model.flushed();
    let old = image(&*cache_media);
    fill(&mut buf, 2, 0);
    core.write(&buf, 0).unwrap();
    core.flush().unwrap();
    model.write(0, 8, 2);
    model.flushed();
    cache.stop(false).unwrap();
    drop(core);
    drop(cache);
    let case = Case {
        cache_image: image(&*cache_media),
        core_image: image(&*core_media),
        model,
        exact: true,
        core_id: id,
        meta_blocks: 1,
        data_offset: 3 << 20,
    };
    assert_eq!(load_and_check(&case, &case.cache_image), Ok(true));
    let e = load_and_check(&case, &old).expect_err("the rolled-back load must be caught");
    assert!(e.contains("sector 0 holds Some(1) (expected 2"), "{e}");
}

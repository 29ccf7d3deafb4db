//! Recovery: bringing a cache back from its device after a clean stop or a crash, the checks
//! and the order of a load (`load`). The superblock, the pairing of a mirror, the geometry, the
//! core records and devices and the recorded policies are checked; then the metadata is
//! restored (restore.rs: decoded on several threads, the newest mapping of each core line wins,
//! the line table, lists and gauges rebuilt); then the policies and cores are installed; only
//! then is anything written.
//!
//! Invariant: nothing is written to any device before every check has passed (superblock,
//! geometry, cores, policies, metadata blocks, the commit record): a refused load leaves the
//! devices as they were.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering;

use std::sync::Arc;

use hybridcache_volume::{Volume, VolumeRef};

use crate::format::{ConfigSlot, CoreRecord, Geometry, MirrorRecord, Superblock};
use crate::inner::CacheInner;
use crate::ioclass::IoClasses;
use crate::mirror::{Mirror, MirrorLostPolicy};
use crate::persist::{self, Persist};
use crate::policy::PolicyRecord;
use crate::restore::restore;
use crate::window::Window;
use crate::{CacheConfig, CacheMode, CoreId, EngineError, LineSize, Result, MAX_CORE_ID, SECTOR};

/// A cache loaded from `cache_volume` (`Cache::load`): the checks (superblock, geometry, core
/// records, the cores' devices, policies), then the metadata, then the policies and cores;
/// only once all of them passed does the device change (the loaded state is recorded, the
/// clean-stop mark cleared).
pub(crate) fn load(
    cache_volume: VolumeRef,
    source: LoadSource,
    open_core: &mut dyn FnMut(&CoreRecord) -> Option<VolumeRef>,
) -> Result<CacheInner> {
    let (sb_seq, sb, version) = newest_superblock(&*cache_volume)?;
    let (cache_volume, whole) = check_pairing(cache_volume, &sb, &source)?;
    let (line_size, mode, recorded) = check_superblock(&sb, &*cache_volume)?;
    let (active, inactive) = open_cores(&sb, open_core)?;
    let policies = recorded_policies(&sb)?;
    let config = CacheConfig {
        id: sb.cache_id,
        line_size,
        mode,
    };
    let mask_bytes = line_size.sectors() as usize / 8;
    let persist = Persist::new(recorded, sb.nonce, mask_bytes, sb.clone(), 0, sb_seq);
    let mut inner = CacheInner::build(
        cache_volume.clone(),
        &config,
        recorded.lines,
        recorded.data_offset,
        Some(persist),
    );
    let mirrored = sb.mirror.as_ref().and_then(|r| r.lines);
    if let Some(covered) = mirrored {
        check_mirrored_lines(covered, recorded.lines)?;
        inner.lines.set_region(covered, whole);
    }
    restore(
        &mut inner,
        &*cache_volume,
        &sb,
        line_size.sectors(),
        version,
    )?;
    apply_policies(&inner, &policies)?;
    attach_loaded_cores(&inner, active, inactive, &policies);
    // From here on the device changes: a crash must be recovered as a crash.
    if let LoadSource::Mirrored(mirror, policy) = source {
        // The primary's metadata is the truth; a crash may have left the mirror's a commit
        // behind or ahead. Its dirty data needs no copy (mirror.rs).
        let m = Arc::new(
            Mirror::new(cache_volume.clone(), mirror, recorded.data_offset, policy)
                .covering(inner.lines.mirrored_lines(), recorded.lines),
        );
        m.copy_metadata()?;
        inner.devices.set_mirror(m);
    }
    let p = inner
        .persist
        .as_ref()
        .expect("a loaded cache is persistent");
    p.record_loaded_state(&**inner.devices.volume())?;
    // Both slots: an older superblock left with the clean-stop mark would make a load that
    // falls back to it (the newer damaged) trust clean lines written over since.
    let mirrored = inner.devices.mirror().is_some();
    for _ in 0..2 {
        p.update_superblock(&**inner.devices.volume(), |sb| {
            sb.clean_shutdown = false;
            if let Some(r) = sb.mirror.as_mut() {
                // Without its mirror (a plain load of the primary, or the mirror brought up
                // alone) the cache runs unprotected from here: a mirror it had is stale.
                if !mirrored {
                    r.role = MirrorRecord::PRIMARY.into();
                    r.lost = true;
                }
            }
        })?;
    }
    Ok(inner)
}

/// Where a load takes the cache from.
pub(crate) enum LoadSource {
    /// A cache device (the primary of a mirrored cache loaded without its mirror).
    Plain,
    /// The primary, with its mirror.
    Mirrored(VolumeRef, MirrorLostPolicy),
    /// The mirror alone (failover): its dirty sectors only.
    MirrorAlone,
}

/// Check that the devices of a load belong together (docs/format.md, "The mirror"): a mirror is
/// loaded only as one, and only with the primary whose uuid and nonce it carries. Returns the
/// volume to load from, cut to the primary's size when the device is larger (a mirror may be)
/// and shown at that size when it is a smaller mirror (docs/format.md, "A smaller mirror"),
/// and whether the device holds every cache line (not such a mirror).
fn check_pairing(
    volume: VolumeRef,
    sb: &Superblock,
    source: &LoadSource,
) -> Result<(VolumeRef, bool)> {
    let role = sb.mirror.as_ref().map(|r| r.role.as_str());
    let name = volume.name().to_string();
    let what = format!("cache {} ({})", sb.cache_id, sb.uuid);
    match (source, role) {
        (LoadSource::Plain, Some(MirrorRecord::MIRROR)) => {
            return Err(EngineError::Invalid(format!(
                "{name} is the mirror of {what}, not a cache device: bring the cache up from it with --load-mirror (it trusts only the mirror's dirty data)"
            )))
        }
        (LoadSource::MirrorAlone, r) if r != Some(MirrorRecord::MIRROR) => {
            return Err(EngineError::Invalid(format!(
                "{name} holds {what}, not the mirror of a cache: load it with --load"
            )))
        }
        (LoadSource::Mirrored(mirror, _), _) => {
            let Some(rec) = sb.mirror.as_ref().filter(|r| r.role == MirrorRecord::PRIMARY) else {
                return Err(EngineError::Invalid(format!(
                    "{what} on {name} has no mirror: load it without --mirror, then give it one with --attach-mirror"
                )));
            };
            if rec.lost {
                return Err(EngineError::Invalid(format!(
                    "the mirror of {what} missed writes (it failed, or the cache ran without it) and is stale: load the cache without --mirror, then give it a new one with --attach-mirror"
                )));
            }
            let (_, msb, _) = newest_superblock(&**mirror).map_err(|e| {
                EngineError::Invalid(format!(
                    "{} is not the mirror of {what}: {e}",
                    mirror.name()
                ))
            })?;
            let is_mirror = msb.mirror.as_ref().is_some_and(|r| r.role == MirrorRecord::MIRROR);
            if msb.uuid != sb.uuid || msb.nonce != sb.nonce || !is_mirror {
                return Err(EngineError::Invalid(format!(
                    "{} is not the mirror of {what}: it holds cache {} ({}){}",
                    mirror.name(),
                    msb.cache_id,
                    msb.uuid,
                    if is_mirror { "" } else { " as a cache device" }
                )));
            }
            let pairing = msb.mirror.as_ref().map_or(0, |r| r.generation);
            if pairing != rec.generation {
                // Which one was replaced cannot be told from here: a pairing is drawn at
                // random, and either device may be the older.
                return Err(EngineError::Invalid(format!(
                    "{} and {name} were not paired last (pairing {pairing} on the mirror, {} on the cache device): the mirror was replaced since by --attach-mirror, or the cache device by --attach-cache; the replaced one missed writes and is stale",
                    mirror.name(),
                    rec.generation
                )));
            }
            let covered = rec.lines.unwrap_or(sb.lines).min(sb.lines);
            let need = sb.data_offset + covered as u64 * sb.line_size as u64;
            if mirror.size() < need {
                return Err(EngineError::Invalid(format!(
                    "the mirror {} holds {} bytes; it covers the cache's metadata and {covered} cache lines, which end at {need}",
                    mirror.name(),
                    mirror.size()
                )));
            }
        }
        _ => {}
    }
    Ok(match sb.mirror.as_ref() {
        Some(r) if r.size != 0 && volume.size() > r.size => {
            (Arc::new(Window::new(volume, r.size)) as VolumeRef, true)
        }
        Some(r) if r.size != 0 && volume.size() < r.size => {
            // A smaller mirror (or a cache brought up from one): it must hold the lines it
            // covers; the geometry is the primary's, and no line beyond them is used.
            let covered = r.lines.unwrap_or(sb.lines).min(sb.lines);
            let need = sb.data_offset + covered as u64 * sb.line_size as u64;
            if volume.size() < need {
                return Err(EngineError::Invalid(format!(
                    "{name} holds {} bytes; the cache on it covers its metadata and {covered} cache lines, which end at {need}: is this the right device?",
                    volume.size()
                )));
            }
            (Arc::new(Window::new(volume, r.size)) as VolumeRef, false)
        }
        _ => (volume, true),
    })
}

/// A smaller mirror's recorded line count is possible: at least the minimum, fewer than the
/// cache's lines (a mirror of every line records none).
fn check_mirrored_lines(covered: u32, lines: u32) -> Result<()> {
    if covered < crate::mirror::MIN_MIRRORED_LINES.min(lines) || covered >= lines {
        return Err(EngineError::Corrupt(format!(
            "superblock: the mirror covers {covered} of the cache's {lines} lines, which is impossible"
        )));
    }
    Ok(())
}

/// The newest intact superblock (its sequence number and format version), or why there is none.
fn newest_superblock(cache_volume: &dyn Volume) -> Result<(u64, Superblock, u32)> {
    let slots = persist::read_config(cache_volume)?;
    persist::refuse_newer(&slots)?;
    let Some((sb_seq, sb, version)) = persist::newest(&slots) else {
        let damaged: Vec<String> = slots
            .iter()
            .zip(["A (offset 0)", "B (offset 1 MiB)"])
            .filter_map(|(s, name)| match s {
                ConfigSlot::Corrupt(why) => Some(format!("superblock copy {name}: {why}")),
                _ => None,
            })
            .collect();
        return Err(if damaged.is_empty() {
            EngineError::NoCache(cache_volume.name().to_string())
        } else {
            EngineError::Corrupt(damaged.join("; "))
        });
    };
    Ok((sb_seq, sb.clone(), version))
}

/// The superblock's line size, mode and geometry, checked against itself and the volume.
fn check_superblock(
    sb: &Superblock,
    cache_volume: &dyn Volume,
) -> Result<(LineSize, CacheMode, Geometry)> {
    let line_size = check_line_size(sb.line_size)?;
    let mode = sb
        .mode()
        .map_err(|e| EngineError::Corrupt(format!("superblock: {e}")))?;
    let recorded = Geometry {
        lines: sb.lines,
        entries_per_block: sb.entries_per_block,
        meta_blocks: sb.meta_blocks,
        data_offset: sb.data_offset,
    };
    if Geometry::compute(cache_volume.size(), sb.line_size as u64) != Some(recorded) {
        return Err(EngineError::Invalid(format!(
            "{} is {} bytes, but the cache on it was created for a device with {} lines of {} KiB; is this the right device?",
            cache_volume.name(),
            cache_volume.size(),
            sb.lines,
            sb.line_size / 1024
        )));
    }
    let mut ids = std::collections::BTreeSet::new();
    for c in &sb.cores {
        if c.id as u32 > MAX_CORE_ID || !ids.insert(c.id) || c.size % SECTOR != 0 {
            return Err(EngineError::Corrupt(format!(
                "superblock: core record {c:?} is impossible"
            )));
        }
    }
    Ok((line_size, mode, recorded))
}

/// The recorded cores whose devices `open_core` opens (active), and the others (inactive).
/// A device of another size than recorded is refused.
#[allow(clippy::type_complexity)]
fn open_cores(
    sb: &Superblock,
    open_core: &mut dyn FnMut(&CoreRecord) -> Option<VolumeRef>,
) -> Result<(Vec<(CoreId, VolumeRef)>, BTreeMap<CoreId, CoreRecord>)> {
    let mut active = Vec::new();
    let mut inactive = BTreeMap::new();
    for rec in &sb.cores {
        match open_core(rec) {
            Some(vol) if vol.size() != rec.size => {
                return Err(EngineError::CoreMismatch {
                    id: rec.id,
                    why: format!(
                        "{} is {} bytes but the cache recorded {} bytes for it (uuid {}); refusing to load",
                        rec.path,
                        vol.size(),
                        rec.size,
                        rec.uuid
                    ),
                })
            }
            Some(vol) => active.push((rec.id, vol)),
            None => {
                inactive.insert(rec.id, rec.clone());
            }
        }
    }
    Ok((active, inactive))
}

/// The policies the superblock records, checked.
fn recorded_policies(sb: &Superblock) -> Result<PolicyRecord> {
    let policies: PolicyRecord =
        serde_json::from_value(serde_json::Value::Object(sb.params.clone())).map_err(|e| {
            EngineError::Corrupt(format!("superblock: unreadable policy parameters: {e}"))
        })?;
    let valid = policies.cleaning.validate().and_then(|()| {
        policies.promotion.validate()?;
        policies.prefetch.validate()?;
        policies.seq_cutoff.values().try_for_each(|s| s.validate())
    });
    if let Err(e) = valid {
        return Err(EngineError::Corrupt(format!(
            "superblock: impossible policy parameters: {e}"
        )));
    }
    Ok(policies)
}

/// Install the recorded policies in a restored cache (IO classes, cleaning, lazy flush,
/// promotion, prefetch, offload). Fails only on an unreadable IO class table.
fn apply_policies(inner: &CacheInner, policies: &PolicyRecord) -> Result<()> {
    if let Some(csv) = &policies.io_classes {
        // Loaded leniently: a file accepted with file-system rules ignored reads back.
        let opts = crate::ioclass::LoadOptions {
            ignore_unsupported: true,
        };
        let table = IoClasses::parse(csv, &opts).map_err(|e| {
            EngineError::Corrupt(format!("superblock: unreadable IO class table: {e}"))
        })?;
        inner
            .lines
            .classes()
            .install(table, inner.lines.table(), |id| {
                inner.lines.gauges()[id as usize].classes()
            });
    }
    *inner.cleaning.write() = policies.cleaning;
    inner
        .lazy_flush
        .store(policies.lazy_flush.enabled, Ordering::Relaxed);
    inner
        .promotion
        .set_params(policies.promotion, inner.lines.count());
    inner
        .prefetch
        .set_params(policies.prefetch, inner.lines.count());
    inner.devices.offload().set_params(policies.offload);
    inner.devices.fallback().set_params(policies.fallback_pt);
    Ok(())
}

/// Register the restored cores: the active ones with their devices, the inactive ones with
/// their acp counters and seq cutoff kept for when they come back.
fn attach_loaded_cores(
    inner: &CacheInner,
    active: Vec<(CoreId, VolumeRef)>,
    inactive: BTreeMap<CoreId, CoreRecord>,
    policies: &PolicyRecord,
) {
    let seq_of = |id: CoreId| policies.seq_cutoff.get(&id).copied().unwrap_or_default();
    let active = active
        .into_iter()
        .map(|(id, vol)| inner.lines.new_core_state(id, vol, seq_of(id)))
        .collect();
    for (id, rec) in &inactive {
        inner.lines.rebuild_chunks(*id, rec.size);
    }
    let inactive = inactive
        .into_iter()
        .map(|(id, rec)| (id, (rec, seq_of(id))))
        .collect();
    inner.cores.load(active, inactive);
}

fn check_line_size(line_size: u32) -> Result<LineSize> {
    LineSize::from_kib(line_size / 1024)
        .ok()
        .filter(|l| l.bytes() == line_size)
        .ok_or_else(|| {
            EngineError::Corrupt(format!(
                "superblock: cache line size {line_size} is impossible"
            ))
        })
}

//! Creating a persistent cache, with or without a mirror, and the rest of a mirrored cache's
//! facade (docs/format.md, "The mirror"): loading it with its mirror or from the mirror alone
//! (failover), and its state. The pair itself is mirror.rs; the load's checks of the pairing
//! are recovery.rs's.

use hybridcache_volume::VolumeRef;

use crate::cache::Cache;
use crate::format::{ConfigSlot, CoreRecord, Geometry, MirrorRecord, Superblock};
use crate::inner::CacheInner;
use crate::mirror::{Mirror, MirrorLostPolicy, MirrorStatus};
use crate::persist;
use crate::persist::new_uuid;
use crate::recovery::LoadSource;
use crate::{CacheConfig, CacheMode, EngineError, Result};

impl Cache {
    /// Create a new persistent cache on `cache_volume` (docs/format.md). A volume that already
    /// holds a cache is refused unless `force`.
    pub fn create(cache_volume: VolumeRef, config: CacheConfig, force: bool) -> Result<Cache> {
        Cache::create_on(cache_volume, None, config, force)
    }
    /// Create a new persistent cache on `primary` with `mirror` as its mirror (docs/format.md,
    /// "The mirror"): dirty data and metadata go to both. The mirror must hold at least the
    /// primary's data region; a volume that already holds a cache is refused unless `force`.
    pub fn create_mirrored(
        primary: VolumeRef,
        mirror: VolumeRef,
        config: CacheConfig,
        force: bool,
        policy: MirrorLostPolicy,
    ) -> Result<Cache> {
        Cache::create_on(primary, Some((mirror, policy)), config, force)
    }

    /// Load a mirrored cache from its primary, with its mirror: both must carry the same cache
    /// (uuid and nonce) in their roles, and the mirror must not have missed writes. The
    /// primary's metadata is copied onto the mirror before anything else is written.
    pub fn load_mirrored(
        primary: VolumeRef,
        mirror: VolumeRef,
        open_core: &mut dyn FnMut(&CoreRecord) -> Option<VolumeRef>,
        policy: MirrorLostPolicy,
    ) -> Result<Cache> {
        Ok(Cache::started(crate::recovery::load(
            primary,
            LoadSource::Mirrored(mirror, policy),
            open_core,
        )?))
    }

    /// Bring a cache up from its mirror alone (failover, or a lost primary): every dirty sector
    /// the mirror's last commit records, as after a crash; clean lines are not on a mirror and
    /// come back uncached. The mirror is from then on the cache's only device, and its
    /// superblock a primary's whose mirror is lost.
    pub fn load_mirror(
        mirror: VolumeRef,
        open_core: &mut dyn FnMut(&CoreRecord) -> Option<VolumeRef>,
    ) -> Result<Cache> {
        Ok(Cache::started(crate::recovery::load(
            mirror,
            LoadSource::MirrorAlone,
            open_core,
        )?))
    }

    /// A mirrored cache's mirror: its device, state, policy and why it left `redundant`.
    /// None for a cache without one.
    pub fn mirror_status(&self) -> Option<MirrorStatus> {
        let inner = &self.inner;
        inner.devices.mirror().map(|m| {
            let covered = inner.lines.mirrored_lines() as u64;
            MirrorStatus {
                lines: covered,
                dirty_lines: inner.lines.usage(None).dirty_lines,
                bytes: inner.devices.data_offset() + covered * inner.line_bytes,
                ..m.status()
            }
        })
    }

    /// Give the cache a mirror on `device` while I/O goes on (`--attach-mirror`;
    /// docs/format.md, "Rebuilding onto a new mirror"): a mirrored cache whose mirror is lost
    /// gets a new one, and a cache without a mirror its first (with `policy` for when it is
    /// lost; a mirrored cache keeps its own). From the switch on every dirty write and metadata
    /// write goes to it too; a pass copies the dirty lines that existed before, each under its
    /// stripe; the metadata is copied; then a superblock naming a new pairing makes it the
    /// mirror (a lost one is stale from then on). Until that superblock a cut leaves the cache
    /// as it was (without a mirror, or with its mirror lost) and the device holding no cache.
    /// A device that holds a cache is refused unless `force`. Returns the dirty lines and bytes
    /// copied by the pass.
    pub fn attach_mirror_with(
        &self,
        device: VolumeRef,
        force: bool,
        policy: MirrorLostPolicy,
    ) -> Result<(u64, u64)> {
        let inner = &self.inner;
        let Some(p) = inner.persist.as_ref() else {
            return Err(EngineError::Invalid(
                "the cache keeps its metadata in RAM: a volatile cache has nothing a mirror could keep".into(),
            ));
        };
        self.refuse_a_small_mirror(&*device)?;
        if device.name() == inner.devices.volume().name() {
            return Err(EngineError::Invalid(format!(
                "{} is the cache's own device; it cannot be its mirror",
                device.name()
            )));
        }
        let first = inner.devices.mirror().is_none();
        if first && inner.devices.fallback_active() {
            return Err(EngineError::Invalid(format!(
                "the cache device {} failed too often and the cache serves pass-through (fallback): its dirty lines cannot be copied from it reliably; flush or stop the cache instead",
                inner.devices.volume().name()
            )));
        }
        if !force {
            refuse_a_used_mirror(&*device)?;
        }
        let m = inner.devices.pair_with(device.clone(), policy);
        m.begin_rebuild(device)?;
        let copied = self.fill_new_mirror(m).and_then(|copied| {
            // A line dropped from memory before the pass (a discard, an invalidating write, a
            // cleaned line reused) may still be recorded dirty by the last commit, its data on
            // the primary only: this commit, to both devices, records it free before the
            // metadata the new mirror gets can name it. It also waits for a commit that wrote
            // to the primary alone before the switch (it holds the commit turn).
            inner.commit()?;
            m.finish_rebuild()?;
            Ok(copied)
        });
        let copied = match copied {
            Ok(c) => c,
            Err(e) => {
                m.abandon_rebuild(&e);
                return Err(e);
            }
        };
        let generation = persist::random_u64().max(1);
        let path = m.status().device;
        let record = m.record();
        // The last step, the only one that makes the pairing: the primary's superblock gets
        // the `mirror` object (a first mirror) or its new generation, the mirror's role mirror.
        p.update_superblock(&**inner.devices.volume(), |sb| {
            let r = sb.mirror.get_or_insert(record);
            r.path = path;
            r.lost = false;
            r.generation = generation;
        })?;
        Ok(copied)
    }

    /// [`attach_mirror_with`](Self::attach_mirror_with), a first mirror with the default
    /// `mirror_lost` policy (drain).
    pub fn attach_mirror(&self, device: VolumeRef, force: bool) -> Result<(u64, u64)> {
        self.attach_mirror_with(device, force, MirrorLostPolicy::default())
    }

    /// A mirror holds the cache device's data region line for line, up to the lines a smaller
    /// mirror covers (part of the cache's layout): `device` must reach their end.
    fn refuse_a_small_mirror(&self, device: &dyn hybridcache_volume::Volume) -> Result<()> {
        let inner = &self.inner;
        let covered = inner.lines.mirrored_lines();
        let data_end = inner.devices.data_offset() + covered as u64 * inner.line_bytes;
        if device.size() < data_end {
            return Err(EngineError::Invalid(format!(
                "{} holds {} bytes; the mirror of this cache (line for line) needs at least {data_end}{}",
                device.name(),
                device.size(),
                if covered < inner.lines.count() {
                    format!(" (its metadata and the {covered} cache lines its mirror covers)")
                } else {
                    String::new()
                }
            )));
        }
        Ok(())
    }

    /// The pass of `attach_mirror`: every line dirty after the pass over the stripes gets its
    /// dirty sectors copied from the primary onto the new mirror, under its stripe.
    fn fill_new_mirror(&self, m: &crate::mirror::Mirror) -> Result<(u64, u64)> {
        let inner = &self.inner;
        // A write that saw no mirror, or the mirror lost (and skipped it), holds its stripes
        // until its line's dirty mask is updated: past this, those lines show dirty to the
        // pass below, and every later write goes to the new mirror itself.
        inner.lines.locks().pass_every_stripe();
        let table = inner.lines.table();
        let dirty_lines = (0..inner.lines.count())
            .filter(|&l| table.key(l).is_some() && table.dirty(l) != 0)
            .count() as u64;
        m.rebuild_progress(0, dirty_lines);
        let (mut lines, mut bytes) = (0u64, 0u64);
        for line in 0..inner.lines.count() {
            let Some(key) = table.key(line) else { continue };
            if table.dirty(line) == 0 {
                continue;
            }
            // Under the stripe a write to the line has finished (it reached the new mirror, or
            // began before the switch and is read back here) or has not begun (it will).
            let _stripe = inner.lines.locks().lock_sorted(vec![table.stripe(key)]);
            if table.key(line) != Some(key) {
                continue;
            }
            let dirty = table.dirty(line);
            for (first, count) in crate::bits::runs(dirty) {
                let len = count as usize * crate::SECTOR as usize;
                m.rebuild_copy(inner.cache_off(line, first), len)?;
                bytes += len as u64;
            }
            if dirty != 0 {
                lines += 1;
                m.rebuild_progress(lines, dirty_lines.max(lines));
            }
        }
        Ok((lines, bytes))
    }

    /// Give a mirrored cache whose primary is lost a new primary, `device`, while I/O goes on
    /// (`--attach-cache`; docs/format.md, "A new primary"): from the switch on every dirty
    /// write and metadata write goes to it too (nothing is read from it); a pass copies each
    /// dirty line from the mirror under its stripe and drops the clean sectors the metadata
    /// maps (their data was on the old primary only); the metadata is copied; then a
    /// superblock naming a new pairing makes it the primary, the cache is redundant and back in
    /// its configured mode, and the old primary is stale. The device must hold the old
    /// primary's size; one that holds a cache is refused unless `force`. Returns the dirty
    /// lines and bytes copied by the pass.
    pub fn attach_primary(&self, device: VolumeRef, force: bool) -> Result<(u64, u64)> {
        let inner = &self.inner;
        let Some(m) = inner.devices.mirror() else {
            return Err(EngineError::Invalid(
                "the cache has no mirror, so no lost primary to replace".into(),
            ));
        };
        let p = inner
            .persist
            .as_ref()
            .expect("a mirrored cache is persistent");
        // The geometry was computed from the primary's size: a new one must hold all of it.
        let size = p
            .superblock()
            .mirror
            .as_ref()
            .map_or(0, |r| r.size)
            .max(inner.devices.volume().size());
        if device.size() < size {
            return Err(EngineError::Invalid(format!(
                "{} holds {} bytes; the primary of this cache needs at least {size} (the size of the primary it replaces, whose geometry the cache has)",
                device.name(),
                device.size()
            )));
        }
        let mirror = m.status().device;
        if device.name() == mirror {
            return Err(EngineError::Invalid(format!(
                "{mirror} is the cache's mirror, which holds the dirty lines the new primary is filled from; it cannot be its primary too"
            )));
        }
        if !force {
            refuse_a_used_device(&*device, "the new primary")?;
        }
        let old = m.begin_primary_rebuild(device, size)?;
        let copied = self.fill_new_primary(m).and_then(|copied| {
            // A line dropped from memory before the pass (a pass-through write over its dirty
            // sectors) may still be recorded dirty by the last commit, its data on the mirror
            // only: this commit, to both devices, records it free before the metadata the new
            // primary gets from the mirror can name it. Lines dropped after the pass were
            // copied by it.
            inner.commit()?;
            m.finish_primary_rebuild()?;
            Ok(copied)
        });
        let copied = match copied {
            Ok(c) => c,
            Err(e) => {
                m.abandon_primary_rebuild(&e, old);
                return Err(e);
            }
        };
        let generation = persist::random_u64().max(1);
        p.update_superblock(&**inner.devices.volume(), |sb| {
            if let Some(r) = sb.mirror.as_mut() {
                r.lost = false;
                r.generation = generation;
            }
        })?;
        Ok(copied)
    }

    /// The pass of `attach_primary`: every mapped line, under its stripe, gets its dirty
    /// sectors copied from the mirror onto the new primary, and loses its clean ones.
    fn fill_new_primary(&self, m: &crate::mirror::Mirror) -> Result<(u64, u64)> {
        let inner = &self.inner;
        // A write that began before the switch holds its stripes until its line's masks are
        // updated: past this, the pass sees what it did, and every later write reaches the new
        // primary itself.
        inner.lines.locks().pass_every_stripe();
        let table = inner.lines.table();
        let dirty_lines = (0..inner.lines.count())
            .filter(|&l| table.key(l).is_some() && table.dirty(l) != 0)
            .count() as u64;
        m.rebuild_progress(0, dirty_lines);
        let (mut lines, mut bytes) = (0u64, 0u64);
        for line in 0..inner.lines.count() {
            let Some(key) = table.key(line) else { continue };
            // Under the stripe a write or cleaning of the line has finished or not begun; a
            // cleaning marks clean only sectors this copied (or a later write put on both).
            let _stripe = inner.lines.locks().lock_sorted(vec![table.stripe(key)]);
            if table.key(line) != Some(key) {
                continue;
            }
            let (valid, dirty) = (table.valid(line), table.dirty(line));
            for (first, count) in crate::bits::runs(dirty) {
                let len = count as usize * crate::SECTOR as usize;
                m.primary_rebuild_copy(inner.cache_off(line, first), len)?;
                bytes += len as u64;
            }
            // A clean sector's data was on the old primary (or nowhere: cleaned while the
            // primary was lost); the new one would serve garbage for it.
            if valid != dirty {
                inner.update_line(line, key, dirty, dirty, false);
            }
            if dirty != 0 {
                lines += 1;
                m.rebuild_progress(lines, dirty_lines.max(lines));
            }
        }
        Ok((lines, bytes))
    }

    /// The mode the cache was set to. It serves in another while a mirrored cache misses a
    /// device ([`mode`](Self::mode)).
    pub fn configured_mode(&self) -> CacheMode {
        self.inner.set_mode()
    }

    pub(crate) fn create_on(
        cache_volume: VolumeRef,
        mirror: Option<(VolumeRef, MirrorLostPolicy)>,
        config: CacheConfig,
        force: bool,
    ) -> Result<Cache> {
        let slots = persist::read_config(&*cache_volume)?;
        if !force {
            persist::refuse_newer(&slots)?;
            if let Some((_, sb, _)) = persist::newest(&slots) {
                return Err(EngineError::ExistingCache {
                    id: sb.cache_id,
                    uuid: sb.uuid.clone(),
                    line_kib: sb.line_size / 1024,
                    cores: sb.describe_cores(),
                });
            }
            for slot in &slots {
                if let ConfigSlot::Corrupt(why) = slot {
                    return Err(EngineError::DamagedSuperblock(why.clone()));
                }
            }
            // After the cache device's checks: a cache it holds is `ExistingCache`, which the
            // configuration file loads (with this mirror) instead.
            if let Some((m, _)) = &mirror {
                refuse_a_used_mirror(&**m)?;
            }
        }
        let line_bytes = config.line_size.bytes() as u64;
        let geometry = Geometry::compute(cache_volume.size(), line_bytes).ok_or(
            EngineError::CacheTooSmall {
                bytes: cache_volume.size(),
                line: config.line_size.bytes(),
            },
        )?;
        let mut sb = Superblock {
            cache_id: config.id,
            uuid: new_uuid(),
            nonce: persist::random_u64(),
            line_size: config.line_size.bytes(),
            lines: geometry.lines,
            data_offset: geometry.data_offset,
            meta_blocks: geometry.meta_blocks,
            entries_per_block: geometry.entries_per_block,
            mode: config.mode.as_str().into(),
            clean_shutdown: false,
            cores: Vec::new(),
            params: Default::default(),
            mirror: None,
        };
        let (cache_volume, pair, mirrored) = Mirror::wrap(
            cache_volume,
            mirror,
            geometry.data_offset,
            line_bytes,
            geometry.lines,
        )?;
        sb.mirror = pair.as_ref().map(|m| m.record());
        let mask_bytes = config.line_size.sectors() as usize / 8;
        let persist = persist::format_volume(&*cache_volume, geometry, &sb, mask_bytes)?;
        let mut inner = CacheInner::build(
            cache_volume,
            &config,
            geometry.lines,
            geometry.data_offset,
            Some(persist),
        );
        inner.lines.set_region(mirrored, true);
        if let Some(m) = pair {
            inner.devices.set_mirror(m);
        }
        inner.save_policies()?;
        Ok(Cache::started(inner))
    }
}

/// A mirror that holds a cache (or a cache's mirror) is overwritten only with `force`.
fn refuse_a_used_mirror(mirror: &dyn hybridcache_volume::Volume) -> Result<()> {
    refuse_a_used_device(mirror, "the mirror")
}

/// A device that holds a cache (or a cache's mirror) becomes `what` only with `force`.
fn refuse_a_used_device(device: &dyn hybridcache_volume::Volume, what: &str) -> Result<()> {
    let slots = persist::read_config(device)?;
    persist::refuse_newer(&slots)?;
    if let Some((_, sb, _)) = persist::newest(&slots) {
        return Err(EngineError::Invalid(format!(
            "{what} {} holds cache {} ({}){}; its metadata would be lost: --force overwrites it",
            device.name(),
            sb.cache_id,
            sb.uuid,
            match sb.mirror.as_ref() {
                Some(r) if r.role == MirrorRecord::MIRROR => " as its mirror",
                _ => "",
            }
        )));
    }
    Ok(())
}

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
        self.inner.devices.mirror().map(|m| m.status())
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
        let data_end = geometry.data_offset + geometry.lines as u64 * line_bytes;
        let (cache_volume, pair) =
            Mirror::wrap(cache_volume, mirror, geometry.data_offset, data_end)?;
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
        if let Some(m) = pair {
            inner.devices.set_mirror(m);
        }
        inner.save_policies()?;
        Ok(Cache::started(inner))
    }
}

/// A mirror that holds a cache (or a cache's mirror) is overwritten only with `force`.
fn refuse_a_used_mirror(mirror: &dyn hybridcache_volume::Volume) -> Result<()> {
    let slots = persist::read_config(mirror)?;
    persist::refuse_newer(&slots)?;
    if let Some((_, sb, _)) = persist::newest(&slots) {
        return Err(EngineError::Invalid(format!(
            "the mirror {} holds cache {} ({}){}; its metadata would be lost: --force overwrites it",
            mirror.name(),
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

//! Device I/O with its accounting: reads and writes of the cache volume and of the cores, run
//! by run, counted per core (bytes and errors) and in offload's queue depths. `Devices` owns
//! the cache volume (a mirrored cache's pair, mirror.rs), where the line data starts on it,
//! offload's queue-depth accounting, and the cores' `failing` marks a failed core write sets
//! (shared with the line room, which owns the other gauges).
//!
//! It also counts the cache device's errors for fallback pass-through (fallback.rs) and, when
//! a dirty range cannot be read, records it there as lost.
//!
//! Invariants: a core write sets the core's `unflushed` before it returns, so any commit that
//! sees the line it cleaned as clean also flushes the core; a failed core write marks the core
//! failing (commits then record its lines dirty). Callers hold the stripes of what they write.
//! `data_offset` and `line_bytes` never change after `new`.
//!
//! The cache volume switches once, one way, from the primary to a pair (mirror.rs): a mirrored
//! cache's load or creation makes the switch before any I/O (`set_mirror`), and a running cache
//! without a mirror makes it when it is given one (`pair_with`, `--attach-mirror`;
//! docs/format.md, "A mirror for a cache that has none"). The switch is a `OnceLock` in
//! `CacheVolume`: every I/O reads it with one acquire load of a word that is written once, so
//! it stays in every core's cache and costs what a plain load costs (no lock, no reference
//! count); on x86 an acquire load is an ordinary `mov`. A lock or an `ArcSwap` per I/O would
//! cost an atomic read-modify-write on a shared line instead. Invariants of the switch:
//! - it never goes back: a pair whose first mirror failed to fill stays in place in the state
//!   `unpaired`, in which it passes everything to the primary alone and `mirror()` is None, so
//!   the cache serves exactly as it did without one;
//! - the metadata paths (`volume()`: superblocks, commits, a load) get `CacheVolume` itself,
//!   which looks at the switch on each call: a commit that took the volume before the switch
//!   and writes after it writes through the pair. A metadata write that went to the primary
//!   alone before the switch holds the commit turn (or the superblock's lock), so the commit the
//!   attach runs after its pass waits for it;
//! - a data write that looked before the switch (or while the pair was `unpaired`) and wrote
//!   the primary alone holds its line's stripe until the line's dirty mask shows it, so the
//!   attach's pass over every stripe (mirror.rs, step 3) sees it and copies the line.

use std::sync::{Arc, OnceLock};

use hybridcache_volume::{DirectWrite, ReadPiece, Volume, VolumeRef};

use crate::bits::{self, Mask};
use crate::core_state::{CoreGauges, CoreState};
use crate::fallback::FallbackState;
use crate::latency::{self};
use crate::meta::Key;
use crate::mirror::{Mirror, MirrorLostPolicy};
use crate::offload::OffloadState;
use crate::segment::{push_run, Run, Seg};
use crate::stats::Counter;
use crate::{CoreId, Result, MAX_CORES, SECTOR};

/// The cache volume: the primary until the cache gets a mirror, the pair from then on.
struct CacheVolume {
    primary: VolumeRef,
    pair: OnceLock<Paired>,
}

/// The pair and the same object as a `Volume`, so that `current` lends a `&VolumeRef`.
struct Paired {
    mirror: Arc<Mirror>,
    volume: VolumeRef,
}

impl CacheVolume {
    #[inline]
    fn current(&self) -> &VolumeRef {
        match self.pair.get() {
            Some(p) => &p.volume,
            None => &self.primary,
        }
    }
}

/// What the metadata paths write through: each call goes to the volume of the moment.
impl Volume for CacheVolume {
    fn name(&self) -> &str {
        self.current().name()
    }
    fn size(&self) -> u64 {
        self.current().size()
    }
    fn logical_block_size(&self) -> u32 {
        self.current().logical_block_size()
    }
    fn rotational(&self) -> bool {
        self.current().rotational()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> hybridcache_volume::Result<()> {
        self.current().read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> hybridcache_volume::Result<()> {
        self.current().write_at(buf, offset)
    }
    fn flush(&self) -> hybridcache_volume::Result<()> {
        self.current().flush()
    }
    fn discard(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        self.current().discard(offset, len)
    }
    fn discard_zeroes(&self) -> bool {
        self.current().discard_zeroes()
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        self.current().write_zeroes(offset, len)
    }
    fn read_batch(&self, pieces: &mut [ReadPiece<'_>]) -> hybridcache_volume::Result<()> {
        self.current().read_batch(pieces)
    }
    fn direct_write(&self, len: usize, offset: u64) -> Option<DirectWrite> {
        self.current().direct_write(len, offset)
    }
    fn write_batch(&self, pieces: &[(&[u8], u64)]) -> hybridcache_volume::Result<()> {
        self.current().write_batch(pieces)
    }
}

pub(crate) struct Devices {
    /// The data paths' view of the cache volume (`current()`, one load per I/O).
    cache: Arc<CacheVolume>,
    /// The same object as a `Volume`, lent to the metadata paths (`volume()`).
    meta: VolumeRef,
    /// Where line 0 starts on the cache volume.
    data_offset: u64,
    line_bytes: u64,
    /// Queue depths of the devices and the share of requests to route (offload.rs).
    offload: OffloadState,
    /// The line room's per-core gauges: a failed core write marks its core failing there.
    gauges: Arc<[CoreGauges]>,
    /// The cache device's errors and the fallback they trip (fallback.rs).
    fallback: FallbackState,
}

impl Devices {
    pub(crate) fn new(
        volume: VolumeRef,
        data_offset: u64,
        line_bytes: u64,
        gauges: Arc<[CoreGauges]>,
    ) -> Devices {
        let cache = Arc::new(CacheVolume {
            primary: volume,
            pair: OnceLock::new(),
        });
        Devices {
            meta: cache.clone(),
            cache,
            data_offset,
            line_bytes,
            offload: OffloadState::new(MAX_CORES as usize),
            gauges,
            fallback: FallbackState::new(),
        }
    }

    #[inline]
    pub(crate) fn fallback(&self) -> &FallbackState {
        &self.fallback
    }

    /// Whether new requests go pass-through because the cache device failed too often; never
    /// on a mirrored cache, whose lost device its own states handle.
    #[inline]
    pub(crate) fn fallback_active(&self) -> bool {
        self.mirror().is_none() && self.fallback.active()
    }

    #[cold]
    fn cache_error(&self, core: &CoreState, counter: Counter) {
        core.counters().add(counter, 1);
        if self.mirror().is_none() {
            self.fallback.error();
        }
    }

    /// After a failed read of dirty data (`pieces`: core offset, cache offset, length), read
    /// each piece again alone and record those that fail as unreadable: on a cache without a
    /// mirror that data exists nowhere else. The probes are not counted again as errors.
    pub(crate) fn find_unreadable_dirty(
        &self,
        core: CoreId,
        pieces: impl Iterator<Item = (u64, u64, usize)>,
    ) {
        if self.mirror().is_some() {
            return;
        }
        let mut scratch = Vec::new();
        for (core_off, cache_off, len) in pieces {
            scratch.resize(len, 0);
            if self
                .cache
                .current()
                .read_at(&mut scratch, cache_off)
                .is_err()
            {
                self.fallback
                    .unreadable(core, core_off, len as u64, self.line_bytes);
            }
        }
    }

    /// Serve the cache through the pair `m` (a new or loaded mirrored cache), before any I/O.
    pub(crate) fn set_mirror(&mut self, m: Arc<Mirror>) {
        let paired = Paired {
            volume: m.clone(),
            mirror: m,
        };
        if self.cache.pair.set(paired).is_err() {
            unreachable!("a cache is paired once, before any I/O");
        }
    }

    /// The pair of a running cache that had no mirror (`--attach-mirror`): made here over the
    /// primary with `mirror` as its mirror, in the state `unpaired` (it passes everything to
    /// the primary alone until `Mirror::begin_rebuild` starts filling the mirror), or the pair
    /// it has already (a mirrored cache's, or one a first attach left). The switch never goes
    /// back (module doc).
    pub(crate) fn pair_with(&self, mirror: VolumeRef, policy: MirrorLostPolicy) -> &Arc<Mirror> {
        &self
            .cache
            .pair
            .get_or_init(|| {
                let m = Arc::new(Mirror::unpaired(
                    self.cache.primary.clone(),
                    mirror,
                    self.data_offset,
                    policy,
                ));
                Paired {
                    volume: m.clone(),
                    mirror: m,
                }
            })
            .mirror
    }

    /// The cache volume, for metadata I/O (superblock, commits, recovery): it follows the
    /// switch to a pair at each call (module doc).
    #[inline]
    pub(crate) fn volume(&self) -> &VolumeRef {
        &self.meta
    }

    /// A mirrored cache's pair; None without a mirror, and while a pair is `unpaired` (a
    /// first mirror that failed to fill: the cache serves as without one).
    #[inline]
    pub(crate) fn mirror(&self) -> Option<&Arc<Mirror>> {
        self.cache
            .pair
            .get()
            .map(|p| &p.mirror)
            .filter(|m| m.paired())
    }

    #[inline]
    pub(crate) fn offload(&self) -> &OffloadState {
        &self.offload
    }

    #[inline]
    pub(crate) fn data_offset(&self) -> u64 {
        self.data_offset
    }

    #[inline]
    pub(crate) fn cache_off(&self, line: u32, sector: u32) -> u64 {
        self.data_offset + line as u64 * self.line_bytes + sector as u64 * SECTOR
    }

    #[inline]
    fn core_off(&self, key: Key, sector: u32) -> u64 {
        key.line() * self.line_bytes + sector as u64 * SECTOR
    }

    /// Read several requests' cache runs in one batch (`pieces`, one per run); `requests` of
    /// them count in offload's queue depth, as single reads would. Bytes are the caller's to
    /// count (per request, once it knows the batch succeeded); a failed batch counts nothing.
    pub(crate) fn cache_read_batch(&self, pieces: &mut [ReadPiece<'_>], requests: usize) -> bool {
        let _queued: Vec<_> = (0..requests).map(|_| self.offload.cache_io()).collect();
        self.cache.current().read_batch(pieces).is_ok()
    }

    #[inline]
    pub(crate) fn core_read(&self, core: &CoreState, buf: &mut [u8], runs: &[Run]) -> Result<()> {
        if !runs.is_empty() {
            latency::touched_core();
        }
        let _queued = self.offload.core_io(core.id() as usize);
        for r in runs {
            core.volume()
                .read_at(&mut buf[r.buf_off..r.buf_off + r.len], r.dev_off)
                .inspect_err(|_| core.counters().add(Counter::CoreReadErrors, 1))?;
            core.counters().add(Counter::CoreReadBytes, r.len as u64);
        }
        Ok(())
    }

    #[inline]
    pub(crate) fn core_write(&self, core: &CoreState, buf: &[u8], runs: &[Run]) -> Result<()> {
        if !runs.is_empty() {
            latency::touched_core();
        }
        let _queued = self.offload.core_io(core.id() as usize);
        for r in runs {
            let op = core.watch().begin();
            let written = core
                .volume()
                .write_at(&buf[r.buf_off..r.buf_off + r.len], r.dev_off);
            drop(op);
            written.inspect_err(|_| {
                core.counters().add(Counter::CoreWriteErrors, 1);
                self.gauges[core.id() as usize].set_failing(true);
            })?;
            // Before the caller can mark anything clean: a commit that sees the line clean
            // then sees this too, and flushes the core.
            core.mark_unflushed();
            core.counters().add(Counter::CoreWrittenBytes, r.len as u64);
        }
        Ok(())
    }

    #[inline]
    pub(crate) fn cache_read(&self, core: &CoreState, buf: &mut [u8], runs: &[Run]) -> Result<()> {
        let _queued = self.offload.cache_io();
        let volume = self.cache.current();
        for r in runs {
            volume
                .read_at(&mut buf[r.buf_off..r.buf_off + r.len], r.dev_off)
                .inspect_err(|_| self.cache_error(core, Counter::CacheReadErrors))?;
            core.counters().add(Counter::CacheReadBytes, r.len as u64);
        }
        Ok(())
    }

    #[inline]
    pub(crate) fn cache_write(&self, core: &CoreState, buf: &[u8], runs: &[Run]) -> Result<()> {
        let _queued = self.offload.cache_io();
        let volume = self.cache.current();
        for r in runs {
            volume
                .write_at(&buf[r.buf_off..r.buf_off + r.len], r.dev_off)
                .inspect_err(|_| self.cache_error(core, Counter::CacheWriteErrors))?;
            core.counters()
                .add(Counter::CacheWrittenBytes, r.len as u64);
        }
        Ok(())
    }

    /// Write data that makes sectors dirty: on a mirrored cache to both devices (mirror.rs).
    #[inline]
    pub(crate) fn cache_write_dirty(
        &self,
        core: &CoreState,
        buf: &[u8],
        runs: &[Run],
    ) -> Result<()> {
        let Some(m) = self.mirror() else {
            return self.cache_write(core, buf, runs);
        };
        let _queued = self.offload.cache_io();
        for r in runs {
            m.write_dirty(&buf[r.buf_off..r.buf_off + r.len], r.dev_off)
                .inspect_err(|_| self.cache_error(core, Counter::CacheWriteErrors))?;
            core.counters()
                .add(Counter::CacheWrittenBytes, r.len as u64);
        }
        Ok(())
    }

    /// Whether write hits may share one cache-device submission: without a mirror, or with
    /// both devices in service (a mirror lost or being rebuilt changes where dirty data goes,
    /// and those writes keep the single path).
    #[inline]
    pub(crate) fn batches_dirty_writes(&self) -> bool {
        match self.mirror() {
            Some(m) => m.state() == crate::mirror::MirrorState::Redundant,
            None => true,
        }
    }

    /// Write several requests' dirty data (`writes`: each request's buffer and cache runs,
    /// which must not overlap one another), one result per request. Without a mirror, one
    /// [`Volume::write_batch`](hybridcache_volume::Volume::write_batch) for all of them (one
    /// `io_uring_enter` on a file volume); a mirrored cache writes each run to both devices
    /// through `Mirror::write_dirty`, as a single write does.
    pub(crate) fn cache_write_dirty_batch(
        &self,
        core: &CoreState,
        writes: &[(&[u8], &[Run])],
    ) -> Vec<Result<()>> {
        if self.mirror().is_some() || writes.len() < 2 {
            return writes
                .iter()
                .map(|(buf, runs)| self.cache_write_dirty(core, buf, runs))
                .collect();
        }
        let batched = {
            // One cache I/O per request, as single writes count them for offload's view.
            let _queued: Vec<_> = writes.iter().map(|_| self.offload.cache_io()).collect();
            let pieces: Vec<(&[u8], u64)> = writes
                .iter()
                .flat_map(|(buf, runs)| {
                    runs.iter()
                        .map(move |r| (&buf[r.buf_off..r.buf_off + r.len], r.dev_off))
                })
                .collect();
            self.cache.current().write_batch(&pieces).is_ok()
        };
        if !batched {
            // Which one failed: each writes again alone, counting its own bytes or error
            // (writing the same data twice does no harm).
            return writes
                .iter()
                .map(|(buf, runs)| self.cache_write(core, buf, runs))
                .collect();
        }
        for (_, runs) in writes {
            let bytes: usize = runs.iter().map(|r| r.len).sum();
            core.counters()
                .add(Counter::CacheWrittenBytes, bytes as u64);
        }
        core.counters()
            .add(Counter::WriteHitsBatched, writes.len() as u64);
        writes.iter().map(|_| Ok(())).collect()
    }

    /// Read dirty sectors: on a mirrored cache from the mirror when the primary fails.
    #[inline]
    pub(crate) fn cache_read_dirty(
        &self,
        core: &CoreState,
        buf: &mut [u8],
        runs: &[Run],
    ) -> Result<()> {
        let Some(m) = self.mirror() else {
            return self.cache_read(core, buf, runs);
        };
        let _queued = self.offload.cache_io();
        for r in runs {
            m.read_dirty(&mut buf[r.buf_off..r.buf_off + r.len], r.dev_off)
                .inspect_err(|_| self.cache_error(core, Counter::CacheReadErrors))?;
            core.counters().add(Counter::CacheReadBytes, r.len as u64);
        }
        Ok(())
    }

    /// A read of `segs` whose cache read failed, again: dirty sectors from the mirror (through
    /// `cache_read_dirty`), the rest from the core. Without a mirror, a dirty sector exists
    /// nowhere else and the read fails with `failed`. Caller holds the segments' stripes.
    pub(crate) fn read_around_cache(
        &self,
        core: &CoreState,
        buf: &mut [u8],
        segs: &[Seg],
        failed: crate::EngineError,
    ) -> Result<()> {
        let (mut core_runs, mut dirty_runs) = (Vec::new(), Vec::new());
        // Without a mirror, each dirty run is tried alone on the cache device again, and the
        // core offset of each kept, to name the data lost if it fails.
        let mut dirty_at = Vec::new();
        let mirror = self.mirror();
        for s in segs {
            let m = s.mask();
            let dirty = if s.mapped() { m & s.dirty } else { 0 };
            for (first, n) in bits::runs(m & !dirty) {
                let buf_off = s.buf_off + (first - s.first) as usize * SECTOR as usize;
                let len = n as usize * SECTOR as usize;
                push_run(&mut core_runs, self.core_off(s.key, first), buf_off, len);
            }
            for (first, n) in bits::runs(dirty) {
                let buf_off = s.buf_off + (first - s.first) as usize * SECTOR as usize;
                let len = n as usize * SECTOR as usize;
                if mirror.is_none() {
                    dirty_at.push(self.core_off(s.key, first));
                    dirty_runs.push(Run {
                        dev_off: self.cache_off(s.line, first),
                        buf_off,
                        len,
                    });
                } else {
                    push_run(&mut dirty_runs, self.cache_off(s.line, first), buf_off, len);
                }
            }
        }
        self.core_read(core, buf, &core_runs)?;
        if mirror.is_some() {
            return self.cache_read_dirty(core, buf, &dirty_runs);
        }
        let mut lost = false;
        for (r, &core_off) in dirty_runs.iter().zip(&dirty_at) {
            if self.cache_read(core, buf, std::slice::from_ref(r)).is_err() {
                self.fallback
                    .unreadable(core.id(), core_off, r.len as u64, self.line_bytes);
                lost = true;
            }
        }
        if lost {
            return Err(failed);
        }
        Ok(())
    }

    /// Write the sectors `mask` of segment `s` from the request buffer into cache line `line`.
    #[inline]
    pub(crate) fn cache_write_mask(
        &self,
        core: &CoreState,
        buf: &[u8],
        s: &Seg,
        line: u32,
        mask: Mask,
    ) -> Result<()> {
        let mut runs = Vec::new();
        for (first, n) in bits::runs(mask) {
            let buf_off = s.buf_off + (first - s.first) as usize * SECTOR as usize;
            push_run(
                &mut runs,
                self.cache_off(line, first),
                buf_off,
                n as usize * SECTOR as usize,
            );
        }
        self.cache_write(core, buf, &runs)
    }
}

//! The mirror (docs/format.md, "The mirror"): a second device that holds a line-for-line copy of
//! what cannot be read again from the core, the dirty data and the metadata.
//!
//! `Mirror` is the cache volume of a mirrored cache: a `Volume` over the primary and the mirror.
//! What the rooms write through the plain `Volume` calls is what both devices need (metadata
//! blocks, commit records, superblocks, flushes) or clean data (read fills, read-ahead,
//! write-through copies), told apart by offset: below `data_offset` goes to both, above to the
//! primary only. Data that makes sectors dirty goes through [`Mirror::write_dirty`], to both;
//! dirty data read back (cleaning, a read whose primary copy failed) through
//! [`Mirror::read_dirty`], which falls back to the mirror.
//!
//! Invariants: a sector the metadata records dirty is on every device not lost (its data was
//! written to both before the line turned dirty, and a commit flushes both before it writes the
//! metadata naming it); the mirror's superblock has role `mirror` and never the clean-stop mark,
//! so any load of it trusts dirty sectors only; a device once lost is never written again by
//! this run (it is stale from the first write it missed).
//!
//! A new primary (`--attach-cache` on a cache whose primary is lost; `Cache::attach_primary`)
//! keeps them so: while it is filled (`rebuilding primary`) the mirror stays the only trusted
//! device. The new primary gets every metadata write but the superblocks, every flush and every
//! dirty write, and is never read; the cache serves as with the primary lost. Its superblock is
//! written only after the copy, with a new pairing generation on both, so a load of the old
//! primary with the mirror is refused, and a cut before then leaves the mirror loadable alone
//! with everything and the new device holding no cache.
//!
//! A first mirror (`--attach-mirror` on a running cache that has none; `Cache::attach_mirror`)
//! is the rebuild onto a new mirror with a pair that did not exist before: the cache volume
//! switches to a pair in the state `unpaired` (devices.rs), in which it is the primary alone
//! (no write, flush or read reaches the mirror, and the cache shows no mirror), and the rebuild
//! starts from there (`attaching`: as `rebuilding`, but the cache stays in its mode, since
//! before the attach it was no better protected). The primary's superblock has no `mirror`
//! object until the last step writes the pairing, so a cut before it leaves the cache the
//! mirrorless one it was. A first mirror that fails to fill puts the pair back to `unpaired`.

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

use hybridcache_volume::{
    write_together, ErrorKind, Op, ReadPiece, Volume, VolumeError, VolumeRef,
};
use parking_lot::{Mutex, RwLock};

use crate::format::{decode_config, encode_config, ConfigSlot, MirrorRecord, CONFIG_SLOT_BYTES};
pub(crate) use crate::mirror_status::mirrored_lines;
pub use crate::mirror_status::{MirrorLostPolicy, MirrorState, MirrorStatus, MIN_MIRRORED_LINES};
use crate::pair_io::copy_commits_and_blocks;
use crate::CacheMode;

const REDUNDANT: u8 = 0;
const PRIMARY_LOST: u8 = 1;
const MIRROR_LOST: u8 = 2;
const REBUILDING: u8 = 3;
const REBUILDING_PRIMARY: u8 = 4;
/// A first mirror being filled: shown as `rebuilding`, served in the cache's own mode.
const ATTACHING: u8 = 5;
/// No mirror: a running cache's pair before its first mirror is filled, or after that failed.
const UNPAIRED: u8 = 6;

pub(crate) struct Mirror {
    /// Replaced by `begin_primary_rebuild`, only while the state is `primary lost`.
    primary: RwLock<VolumeRef>,
    /// The pair's name (`Volume::name`): the primary's when the pair was made, until a new
    /// primary replaces it (`renamed`).
    name: String,
    /// The new primary's name. `name` lends a `&str` that may outlive a replacement, so each
    /// name a replacement gives is kept for the rest of the process (a few bytes per
    /// `--attach-cache`).
    renamed: RwLock<Option<&'static str>>,
    /// Replaced by a rebuild (`begin_rebuild`), only while the state is `mirror lost` or
    /// `unpaired`.
    mirror: RwLock<VolumeRef>,
    /// Where cache line 0 starts: below it everything goes to both devices.
    data_offset: u64,
    policy: MirrorLostPolicy,
    state: AtomicU8,
    reason: Mutex<Option<String>>,
    /// Held shared by every metadata write to both devices, exclusively by a rebuild's copy of
    /// the metadata region: a commit racing the copy cannot be overwritten by an older block.
    meta_copy: RwLock<()>,
    rebuild_copied: AtomicU64,
    rebuild_total: AtomicU64,
    /// A smaller mirror: it holds the first this many cache lines only, and every dirty line
    /// is among them (lines.rs). None: every line.
    lines: Option<u32>,
}

impl Mirror {
    /// The cache volume of a new cache of `lines` cache lines of `line_bytes` from
    /// `data_offset`: the primary itself, or with a mirror the pair. The mirror holds the
    /// metadata and, line for line, the first lines it has room for (docs/format.md, "A smaller
    /// mirror"): every line, or at least [`MIN_MIRRORED_LINES`]. Returns the volume, the pair,
    /// and how many lines the mirror covers (`lines` without a mirror).
    pub(crate) fn wrap(
        primary: VolumeRef,
        mirror: Option<(VolumeRef, MirrorLostPolicy)>,
        data_offset: u64,
        line_bytes: u64,
        lines: u32,
    ) -> crate::Result<(VolumeRef, Option<Arc<Mirror>>, u32)> {
        let Some((mirror, policy)) = mirror else {
            return Ok((primary, None, lines));
        };
        let covered = mirrored_lines(mirror.size(), data_offset, line_bytes, lines);
        if covered < lines.min(MIN_MIRRORED_LINES) {
            let need = data_offset + lines.min(MIN_MIRRORED_LINES) as u64 * line_bytes;
            return Err(crate::EngineError::Invalid(format!(
                "the mirror {} holds {} bytes; a mirror of {} needs at least {need}: its metadata ({data_offset} bytes) and {} cache lines of {} KiB (a mirror of {} bytes covers all {lines} lines of the cache)",
                mirror.name(),
                mirror.size(),
                primary.name(),
                lines.min(MIN_MIRRORED_LINES),
                line_bytes / 1024,
                data_offset + lines as u64 * line_bytes,
            )));
        }
        let pair =
            Arc::new(Mirror::new(primary, mirror, data_offset, policy).covering(covered, lines));
        Ok((pair.clone(), Some(pair), covered))
    }

    /// The pair covers only the first `covered` of the cache's `lines` (a smaller mirror).
    pub(crate) fn covering(mut self, covered: u32, lines: u32) -> Mirror {
        self.lines = (covered < lines).then_some(covered);
        self
    }

    /// What the primary's superblock records of the pair.
    pub(crate) fn record(&self) -> MirrorRecord {
        MirrorRecord {
            role: MirrorRecord::PRIMARY.into(),
            path: self.mirror().name().to_string(),
            size: self.primary().size(),
            lost: false,
            generation: 0,
            lines: self.lines,
        }
    }

    pub(crate) fn new(
        primary: VolumeRef,
        mirror: VolumeRef,
        data_offset: u64,
        policy: MirrorLostPolicy,
    ) -> Mirror {
        Mirror::in_state(primary, mirror, data_offset, policy, REDUNDANT)
    }

    /// The pair of a running cache that has no mirror yet: the primary alone until
    /// `begin_rebuild` fills `mirror` (nothing is written to it before).
    pub(crate) fn unpaired(
        primary: VolumeRef,
        mirror: VolumeRef,
        data_offset: u64,
        policy: MirrorLostPolicy,
    ) -> Mirror {
        Mirror::in_state(primary, mirror, data_offset, policy, UNPAIRED)
    }

    fn in_state(
        primary: VolumeRef,
        mirror: VolumeRef,
        data_offset: u64,
        policy: MirrorLostPolicy,
        state: u8,
    ) -> Mirror {
        Mirror {
            name: primary.name().to_string(),
            renamed: RwLock::new(None),
            primary: RwLock::new(primary),
            mirror: RwLock::new(mirror),
            data_offset,
            policy,
            state: AtomicU8::new(state),
            reason: Mutex::new(None),
            meta_copy: RwLock::new(()),
            rebuild_copied: AtomicU64::new(0),
            rebuild_total: AtomicU64::new(0),
            lines: None,
        }
    }

    fn mirror(&self) -> VolumeRef {
        self.mirror.read().clone()
    }

    fn primary(&self) -> VolumeRef {
        self.primary.read().clone()
    }

    /// Whether the cache has a mirror (filled or being filled): not `unpaired`.
    #[inline]
    pub(crate) fn paired(&self) -> bool {
        self.state.load(Ordering::SeqCst) != UNPAIRED
    }

    /// The state as shown: a first mirror being filled is `rebuilding`; `unpaired` is never
    /// shown (the cache has no mirror then) and reads as `mirror lost`.
    pub(crate) fn state(&self) -> MirrorState {
        match self.state.load(Ordering::SeqCst) {
            PRIMARY_LOST => MirrorState::PrimaryLost,
            MIRROR_LOST | UNPAIRED => MirrorState::MirrorLost,
            REBUILDING | ATTACHING => MirrorState::Rebuilding,
            REBUILDING_PRIMARY => MirrorState::RebuildingPrimary,
            _ => MirrorState::Redundant,
        }
    }

    pub(crate) fn status(&self) -> MirrorStatus {
        let state = self.state();
        MirrorStatus {
            device: self.mirror().name().to_string(),
            state,
            policy: self.policy,
            reason: self.reason.lock().clone(),
            rebuild: matches!(
                state,
                MirrorState::Rebuilding | MirrorState::RebuildingPrimary
            )
            .then(|| {
                (
                    self.rebuild_copied.load(Ordering::Relaxed),
                    self.rebuild_total.load(Ordering::Relaxed),
                )
            }),
            lines: 0,
            dirty_lines: 0,
            bytes: 0,
        }
    }

    /// The mode the cache serves in, given the mode it was set to: pass-through without the
    /// primary (dirty data still comes from the mirror), write-through without the mirror when
    /// the policy drains.
    pub(crate) fn effective_mode(&self, mode: CacheMode) -> CacheMode {
        if self.first_mirror_pending() {
            return mode;
        }
        match self.state() {
            MirrorState::Redundant => mode,
            MirrorState::PrimaryLost | MirrorState::RebuildingPrimary => CacheMode::Pt,
            MirrorState::MirrorLost | MirrorState::Rebuilding => match self.policy {
                MirrorLostPolicy::Drain if mode.makes_dirty() => CacheMode::Wt,
                _ => mode,
            },
        }
    }

    /// Whether cleaning should drain every dirty line: they are on one device only, or on a
    /// device the cache no longer serves from.
    pub(crate) fn drains(&self) -> bool {
        if self.first_mirror_pending() {
            return false;
        }
        match self.state() {
            MirrorState::Redundant => false,
            MirrorState::PrimaryLost | MirrorState::RebuildingPrimary => true,
            MirrorState::MirrorLost | MirrorState::Rebuilding => {
                self.policy == MirrorLostPolicy::Drain
            }
        }
    }

    /// A first mirror is being filled, or none is: the cache was unprotected before the attach
    /// and serves as it did (no drain, its own mode) until the mirror holds everything.
    fn first_mirror_pending(&self) -> bool {
        matches!(self.state.load(Ordering::SeqCst), ATTACHING | UNPAIRED)
    }

    fn lose(&self, which: u8, what: &str, e: &VolumeError) {
        // The first loss wins: with both devices gone the operations fail anyway, and the state
        // says which one went first (the other still holds everything up to then).
        if self
            .state
            .compare_exchange(REDUNDANT, which, Ordering::SeqCst, Ordering::SeqCst)
            .is_ok()
        {
            let device = if which == PRIMARY_LOST {
                self.primary().name().to_string()
            } else {
                self.mirror().name().to_string()
            };
            *self.reason.lock() = Some(format!("{what} of {device} failed: {e}"));
        } else if which == MIRROR_LOST
            && self
                .state
                .compare_exchange(REBUILDING, MIRROR_LOST, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            // The rebuild is over, unfinished: the new device never got a superblock.
            let device = self.mirror().name().to_string();
            *self.reason.lock() = Some(format!(
                "{what} of {device} failed while rebuilding onto it: {e}"
            ));
        } else if which == MIRROR_LOST
            && self
                .state
                .compare_exchange(ATTACHING, UNPAIRED, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        {
            // A first mirror that failed: the cache is the mirrorless one it was.
            let device = self.mirror().name().to_string();
            *self.reason.lock() = Some(format!(
                "{what} of {device} failed while it was made the cache's mirror: {e}"
            ));
        }
        // A primary failing while rebuilding changes nothing: the new mirror is not trusted, so
        // the primary's errors reach the callers (the rebuild fails on them too). Likewise the
        // mirror failing while a new primary is filled: the mirror's errors reach the callers
        // and the copy, which then ends the rebuild.
    }

    /// End the filling of a new primary that failed: the cache is `primary lost` again, and
    /// the device is not written again by this run.
    fn primary_rebuild_failed(&self, what: &str, e: &dyn std::fmt::Display) {
        if self
            .state
            .compare_exchange(
                REBUILDING_PRIMARY,
                PRIMARY_LOST,
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_ok()
        {
            *self.reason.lock() = Some(format!(
                "{what} of {} failed while it was made the new primary: {e}",
                self.primary().name()
            ));
        }
    }

    /// A new mirror is being filled (a lost one's replacement, or a first one).
    fn rebuilding(&self) -> bool {
        matches!(self.state.load(Ordering::SeqCst), REBUILDING | ATTACHING)
    }

    fn rebuilding_primary(&self) -> bool {
        self.state.load(Ordering::SeqCst) == REBUILDING_PRIMARY
    }

    /// Whether the primary is trusted: read, and written with clean data.
    fn primary_usable(&self) -> bool {
        !matches!(
            self.state.load(Ordering::SeqCst),
            PRIMARY_LOST | REBUILDING_PRIMARY
        )
    }

    fn mirror_usable(&self) -> bool {
        !matches!(self.state.load(Ordering::SeqCst), MIRROR_LOST | UNPAIRED)
    }

    fn primary_gone(&self, op: Op, offset: u64, len: usize) -> VolumeError {
        VolumeError::new(
            self.primary().name(),
            op,
            offset,
            len as u64,
            ErrorKind::Invalid("lost earlier (this cache runs from its mirror)".into()),
        )
    }

    /// Write to both devices (those not lost). Fails only when no device took the write.
    fn write_both(&self, buf: &[u8], offset: u64) -> hybridcache_volume::Result<()> {
        let _copy = self.meta_copy.read();
        let mut done = false;
        let mut last = None;
        // A mirror or primary being rebuilt gets its superblock only when the copy is done: a
        // load of it before that finds none and refuses it.
        let superblock_slot = offset == 0 || offset == CONFIG_SLOT_BYTES;
        let to_mirror = (self.mirror_usable() && !(superblock_slot && self.rebuilding()))
            .then(|| self.as_mirror_superblock(buf, offset));
        let (primary, mirror) = (self.primary(), self.mirror());
        let mut writes: Vec<(&dyn Volume, &[u8], u64)> = Vec::with_capacity(2);
        let mut whose = Vec::with_capacity(2);
        if self.primary_usable() {
            writes.push((&*primary, buf, offset));
            whose.push(PRIMARY_LOST);
        } else if self.rebuilding_primary() && !superblock_slot {
            writes.push((&*primary, buf, offset));
            whose.push(REBUILDING_PRIMARY);
        }
        if let Some(converted) = &to_mirror {
            writes.push((&*mirror, converted.as_deref().unwrap_or(buf), offset));
            whose.push(MIRROR_LOST);
        }
        // Both at once where the devices allow it (a commit's blocks cost one device's time).
        for (r, which) in write_together(&writes).into_iter().zip(whose) {
            match r {
                // A new primary is not trusted yet: its write counts for nothing, and its
                // failure ends the rebuild, not the caller's write.
                Ok(()) if which == REBUILDING_PRIMARY => {}
                Err(e) if which == REBUILDING_PRIMARY => {
                    self.primary_rebuild_failed("a metadata write", &e)
                }
                Ok(()) => done = true,
                Err(e) => {
                    self.lose(which, "a write", &e);
                    last = Some(e);
                }
            }
        }
        match (done, last) {
            (true, _) => Ok(()),
            (false, Some(e)) => Err(e),
            (false, None) => Err(self.primary_gone(Op::Write, offset, buf.len())),
        }
    }

    /// A superblock written to a config slot, as the mirror keeps it: role `mirror`, never the
    /// clean-stop mark (a load of the mirror must trust its dirty sectors only). None for
    /// anything else (a wipe, a commit record, a metadata block).
    fn as_mirror_superblock(&self, buf: &[u8], offset: u64) -> Option<Vec<u8>> {
        if offset != 0 && offset != CONFIG_SLOT_BYTES {
            return None;
        }
        match decode_config(buf, &mut |_| None) {
            ConfigSlot::Valid { seq, mut sb, .. } => {
                sb.clean_shutdown = false;
                let primary = sb.mirror.take();
                sb.mirror = Some(MirrorRecord {
                    role: MirrorRecord::MIRROR.into(),
                    path: String::new(),
                    size: primary.as_ref().map_or(0, |p| p.size),
                    lost: false,
                    lines: primary.as_ref().and_then(|p| p.lines),
                    generation: primary.map_or(0, |p| p.generation),
                });
                Some(encode_config(&sb, seq))
            }
            _ => None,
        }
    }

    /// Write data that makes sectors dirty: to both devices before the caller acknowledges
    /// it. Fails when the primary cannot take it (the caller then sends it to the core); a
    /// failed mirror only loses the mirror.
    pub(crate) fn write_dirty(&self, buf: &[u8], offset: u64) -> hybridcache_volume::Result<()> {
        if self.rebuilding_primary() {
            // The mirror is the trusted copy; the new primary gets it too, or the rebuild ends.
            self.mirror().write_at(buf, offset)?;
            if let Err(e) = self.primary().write_at(buf, offset) {
                self.primary_rebuild_failed("a dirty-data write", &e);
            }
            return Ok(());
        }
        if !self.primary_usable() {
            return Err(self.primary_gone(Op::Write, offset, buf.len()));
        }
        if !self.mirror_usable() {
            return self
                .primary()
                .write_at(buf, offset)
                .inspect_err(|e| self.lose(PRIMARY_LOST, "a dirty-data write", e));
        }
        // Both at once (one io_uring submission for two files or block devices): the write
        // costs the slower device's time, not the sum. Should the primary fail, the mirror
        // holds data no metadata names dirty (the caller sends it to the core): harmless.
        let (primary, mirror) = (self.primary(), self.mirror());
        let mut results =
            write_together(&[(&*primary, buf, offset), (&*mirror, buf, offset)]).into_iter();
        let (primary, mirrored) = (results.next(), results.next());
        if let Some(Err(e)) = mirrored {
            self.lose(MIRROR_LOST, "a dirty-data write", &e);
        }
        match primary {
            Some(Err(e)) => {
                self.lose(PRIMARY_LOST, "a dirty-data write", &e);
                Err(e)
            }
            _ => Ok(()),
        }
    }

    /// Read dirty data: from the primary, or from the mirror once the primary fails.
    pub(crate) fn read_dirty(&self, buf: &mut [u8], offset: u64) -> hybridcache_volume::Result<()> {
        if self.primary_usable() {
            match self.primary().read_at(buf, offset) {
                Ok(()) => return Ok(()),
                Err(e) => {
                    self.lose(PRIMARY_LOST, "a read", &e);
                    if !self.mirror_usable() || self.rebuilding() {
                        return Err(e);
                    }
                }
            }
        }
        self.mirror().read_at(buf, offset)
    }

    /// Copy the primary's metadata region (config slots, commit records, metadata blocks) onto
    /// the mirror, superblocks as the mirror keeps them, then flush: after a crash that left
    /// the two a commit apart, the mirror's metadata is the primary's again.
    pub(crate) fn copy_metadata(&self) -> hybridcache_volume::Result<()> {
        const CHUNK: u64 = 1 << 20;
        let mut buf = vec![0u8; CHUNK as usize];
        let mut at = 0;
        while at < self.data_offset {
            let n = (self.data_offset - at).min(CHUNK) as usize;
            self.primary().read_at(&mut buf[..n], at)?;
            if at == 0 || at == CONFIG_SLOT_BYTES {
                if let Some(sb) = self.as_mirror_superblock(&buf[..n], at) {
                    buf[..sb.len()].copy_from_slice(&sb);
                    // The rest of the slot: what the primary has after its superblock is no
                    // part of it, and the commit record at the slot's end is copied as is.
                    buf[sb.len()..n.min(CONFIG_SLOT_BYTES as usize - 512)].fill(0);
                }
            }
            self.mirror().write_at(&buf[..n], at)?;
            at += n as u64;
        }
        self.mirror().flush()
    }

    /// Start a rebuild onto `new` (`--attach-mirror`), refused unless the mirror is lost or the
    /// cache has none (`unpaired`: a first mirror). The device's superblock slots are wiped
    /// first (a cut from here on leaves it holding no cache); from the switch on, every
    /// metadata write and every dirty-data write goes to it too, so what the copy pass reads
    /// later is all it can miss.
    pub(crate) fn begin_rebuild(&self, new: VolumeRef) -> crate::Result<()> {
        let (from, to) = match self.state.load(Ordering::SeqCst) {
            UNPAIRED => (UNPAIRED, ATTACHING),
            MIRROR_LOST => (MIRROR_LOST, REBUILDING),
            _ => return Err(self.refuse_a_rebuild()),
        };
        let zeros = vec![0u8; (2 * CONFIG_SLOT_BYTES) as usize];
        new.write_at(&zeros, 0)?;
        new.flush()?;
        let mut mirror = self.mirror.write();
        // Again under the lock: of two attaches racing, one fills its device. (The refusal
        // names the mirror: it reads it, so not under this lock.)
        if self.state.load(Ordering::SeqCst) != from {
            drop(mirror);
            return Err(self.refuse_a_rebuild());
        }
        self.rebuild_copied.store(0, Ordering::Relaxed);
        self.rebuild_total.store(0, Ordering::Relaxed);
        *mirror = new;
        self.state.store(to, Ordering::SeqCst);
        Ok(())
    }

    /// Why a rebuild cannot start in the present state (any but `mirror lost` and `unpaired`).
    fn refuse_a_rebuild(&self) -> crate::EngineError {
        match self.state() {
            MirrorState::MirrorLost => {
                crate::EngineError::Invalid("another rebuild began meanwhile".into())
            }
            MirrorState::Redundant => {
                crate::EngineError::Invalid(format!(
                    "the cache is redundant already (its mirror {} holds every dirty line); nothing to rebuild",
                    self.mirror().name()
                ))
            }
            MirrorState::Rebuilding => {
                crate::EngineError::Invalid(format!(
                    "a rebuild onto {} is under way",
                    self.mirror().name()
                ))
            }
            MirrorState::PrimaryLost => {
                crate::EngineError::Invalid(format!(
                    "the primary {} is lost, not the mirror: the cache runs from its mirror and needs a new primary (--attach-cache -d DEVICE)",
                    self.primary().name()
                ))
            }
            MirrorState::RebuildingPrimary => {
                crate::EngineError::Invalid(format!(
                    "a new primary {} is being filled from the mirror {}; the mirror is not lost",
                    self.primary().name(),
                    self.mirror().name()
                ))
            }
        }
    }

    /// A rebuild that stopped on an error of something other than the new device (a read of
    /// the primary, a commit): the new device is not written again, and the cache is
    /// `mirror lost` again, or `unpaired` (without a mirror) for a first one. Nothing reads the
    /// new device, and its superblock was never written, so this is safe while requests run.
    pub(crate) fn abandon_rebuild(&self, why: &crate::EngineError) {
        for (from, to) in [(REBUILDING, MIRROR_LOST), (ATTACHING, UNPAIRED)] {
            if self
                .state
                .compare_exchange(from, to, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
            {
                *self.reason.lock() = Some(format!(
                    "the rebuild onto {} stopped: {why}",
                    self.mirror().name()
                ));
            }
        }
    }

    pub(crate) fn rebuild_progress(&self, copied: u64, total: u64) {
        self.rebuild_total.store(total, Ordering::Relaxed);
        self.rebuild_copied.store(copied, Ordering::Relaxed);
    }

    /// Copy dirty sectors read from the primary onto the mirror being rebuilt. The caller
    /// holds the line's stripe, so no write to them races the copy.
    pub(crate) fn rebuild_copy(&self, offset: u64, len: usize) -> crate::Result<()> {
        let mut buf = vec![0u8; len];
        self.primary().read_at(&mut buf, offset)?;
        if !self.rebuilding() {
            return Err(self.rebuild_aborted());
        }
        self.mirror()
            .write_at(&buf, offset)
            .inspect_err(|e| self.lose(MIRROR_LOST, "a rebuild write", e))?;
        Ok(())
    }

    fn rebuild_aborted(&self) -> crate::EngineError {
        crate::EngineError::Invalid(format!(
            "the rebuild onto {} stopped: {}",
            self.mirror().name(),
            self.reason
                .lock()
                .clone()
                .unwrap_or_else(|| "the mirror was lost".into())
        ))
    }

    /// End a rebuild: the metadata region below the superblocks (commit records, metadata
    /// blocks) copied under the exclusive metadata lock, flushed, then the state redundant.
    /// The mirror still has no superblock: the caller writes one (through the pair) that
    /// names the new pairing, and only that makes the mirror loadable.
    pub(crate) fn finish_rebuild(&self) -> crate::Result<()> {
        let _copy = self.meta_copy.write();
        let mirror = self.mirror();
        // Flush first: the dirty sectors copied by the pass are durable before any metadata
        // naming them is.
        mirror.flush()?;
        copy_commits_and_blocks(&*self.primary(), &*mirror, self.data_offset, |_| {})?;
        mirror
            .flush()
            .inspect_err(|e| self.lose(MIRROR_LOST, "a rebuild flush", e))?;
        let done = [REBUILDING, ATTACHING].into_iter().any(|from| {
            self.state
                .compare_exchange(from, REDUNDANT, Ordering::SeqCst, Ordering::SeqCst)
                .is_ok()
        });
        if !done {
            return Err(self.rebuild_aborted());
        }
        *self.reason.lock() = None;
        Ok(())
    }

    /// Start filling `new` as the primary (`--attach-cache` on a cache whose primary is lost),
    /// refused in any other state. `size` is the primary's size the geometry was computed
    /// from: a larger device is used up to it. The device's superblock slots are wiped first (a
    /// cut from here on leaves it holding no cache); from the switch on, every metadata write
    /// but the superblocks, every flush and every dirty-data write goes to it too, and nothing
    /// is read from it.
    /// Returns what `abandon_primary_rebuild` puts back if the filling fails.
    pub(crate) fn begin_primary_rebuild(
        &self,
        new: VolumeRef,
        size: u64,
    ) -> crate::Result<ReplacedPrimary> {
        self.refuse_a_new_primary()?;
        let zeros = vec![0u8; (2 * CONFIG_SLOT_BYTES) as usize];
        new.write_at(&zeros, 0)?;
        new.flush()?;
        let new: VolumeRef = if new.size() > size {
            Arc::new(crate::window::Window::new(new, size))
        } else {
            new
        };
        let mut primary = self.primary.write();
        // Again under the lock: two attaches racing, only one replaces the primary. (The
        // refusal names the primary: it reads it, so not under this lock.)
        if self.state.load(Ordering::SeqCst) != PRIMARY_LOST {
            drop(primary);
            self.refuse_a_new_primary()?;
            return Err(crate::EngineError::Invalid(
                "another new primary was attached meanwhile".into(),
            ));
        }
        self.rebuild_copied.store(0, Ordering::Relaxed);
        self.rebuild_total.store(0, Ordering::Relaxed);
        let name = self
            .renamed
            .write()
            .replace(Box::leak(new.name().to_string().into_boxed_str()));
        let volume = std::mem::replace(&mut *primary, new);
        self.state.store(REBUILDING_PRIMARY, Ordering::SeqCst);
        Ok(ReplacedPrimary { volume, name })
    }

    fn refuse_a_new_primary(&self) -> crate::Result<()> {
        let why = match self.state() {
            MirrorState::PrimaryLost => return Ok(()),
            MirrorState::Redundant => format!(
                "the cache is redundant (its primary {} and its mirror {} both work); a new primary replaces only a lost one",
                self.primary().name(),
                self.mirror().name()
            ),
            MirrorState::MirrorLost => format!(
                "the mirror {} is lost, not the primary {}: give the cache a new mirror with --attach-mirror",
                self.mirror().name(),
                self.primary().name()
            ),
            MirrorState::Rebuilding => format!(
                "a rebuild onto the new mirror {} is under way, and the primary {} works",
                self.mirror().name(),
                self.primary().name()
            ),
            MirrorState::RebuildingPrimary => format!(
                "a new primary {} is being filled already",
                self.primary().name()
            ),
        };
        Err(crate::EngineError::Invalid(why))
    }

    /// Copy dirty sectors read from the mirror onto the new primary. The caller holds the
    /// line's stripe, so no write to them races the copy.
    pub(crate) fn primary_rebuild_copy(&self, offset: u64, len: usize) -> crate::Result<()> {
        let mut buf = vec![0u8; len];
        self.mirror().read_at(&mut buf, offset)?;
        if !self.rebuilding_primary() {
            return Err(self.primary_rebuild_aborted());
        }
        self.primary()
            .write_at(&buf, offset)
            .inspect_err(|e| self.primary_rebuild_failed("a rebuild write", e))?;
        Ok(())
    }

    fn primary_rebuild_aborted(&self) -> crate::EngineError {
        crate::EngineError::Invalid(format!(
            "filling the new primary {} stopped: {}",
            self.primary().name(),
            self.reason
                .lock()
                .clone()
                .unwrap_or_else(|| "the primary was lost".into())
        ))
    }

    /// A new primary that failed to fill: `primary lost` again (if a failure of the device had
    /// not said so already), `what` the reason, and the lost primary the pair's again (its name
    /// in messages, as in the daemon's record). Nothing uses a lost primary, so it can be put
    /// back while requests run.
    pub(crate) fn abandon_primary_rebuild(&self, what: &crate::EngineError, old: ReplacedPrimary) {
        self.primary_rebuild_failed("filling", what);
        let mut primary = self.primary.write();
        if self.state.load(Ordering::SeqCst) == PRIMARY_LOST {
            *primary = old.volume;
            *self.renamed.write() = old.name;
        }
    }

    /// End the filling of a new primary: the metadata region below the superblocks (commit
    /// records, metadata blocks) copied from the mirror under the exclusive metadata lock,
    /// flushed, then the state redundant (the primary read again, the configured mode back).
    /// The new primary still has no superblock: the caller writes one (through the pair) that
    /// names the new pairing, and only that makes it loadable.
    pub(crate) fn finish_primary_rebuild(&self) -> crate::Result<()> {
        let _copy = self.meta_copy.write();
        let (primary, mirror) = (self.primary(), self.mirror());
        // Flush first: the dirty sectors copied by the pass are durable before any metadata
        // naming them is.
        primary
            .flush()
            .inspect_err(|e| self.primary_rebuild_failed("a rebuild flush", e))?;
        copy_commits_and_blocks(&*mirror, &*primary, self.data_offset, |e| {
            self.primary_rebuild_failed("a rebuild write", e)
        })?;
        primary
            .flush()
            .inspect_err(|e| self.primary_rebuild_failed("a rebuild flush", e))?;
        if self
            .state
            .compare_exchange(
                REBUILDING_PRIMARY,
                REDUNDANT,
                Ordering::SeqCst,
                Ordering::SeqCst,
            )
            .is_err()
        {
            return Err(self.primary_rebuild_aborted());
        }
        *self.reason.lock() = None;
        Ok(())
    }
}

impl Volume for Mirror {
    fn name(&self) -> &str {
        match *self.renamed.read() {
            Some(name) => name,
            None => &self.name,
        }
    }

    fn size(&self) -> u64 {
        self.primary().size()
    }

    fn logical_block_size(&self) -> u32 {
        self.primary().logical_block_size()
    }

    /// Metadata from the primary, or the mirror once it fails. Data only from the primary: a
    /// clean line's copy on the mirror is stale (dirty data is read through `read_dirty`).
    fn read_at(&self, buf: &mut [u8], offset: u64) -> hybridcache_volume::Result<()> {
        if offset < self.data_offset {
            return self.read_dirty(buf, offset);
        }
        if !self.primary_usable() {
            return Err(self.primary_gone(Op::Read, offset, buf.len()));
        }
        self.primary()
            .read_at(buf, offset)
            .inspect_err(|e| self.lose(PRIMARY_LOST, "a read", e))
    }

    fn read_batch(&self, pieces: &mut [ReadPiece<'_>]) -> hybridcache_volume::Result<()> {
        if pieces.iter().any(|p| p.offset < self.data_offset) {
            for p in pieces.iter_mut() {
                self.read_at(p.buf, p.offset)?;
            }
            return Ok(());
        }
        if !self.primary_usable() {
            let (offset, len) = pieces.first().map_or((0, 0), |p| (p.offset, p.buf.len()));
            return Err(self.primary_gone(Op::Read, offset, len));
        }
        // Called as the trait's: the rooms' own `read_batch` is another thing.
        Volume::read_batch(&*self.primary(), pieces)
            .inspect_err(|e| self.lose(PRIMARY_LOST, "a read", e))
    }

    /// Metadata to both devices; clean data (read fills, read-ahead, write-through copies) to
    /// the primary only.
    fn write_at(&self, buf: &[u8], offset: u64) -> hybridcache_volume::Result<()> {
        if offset < self.data_offset {
            return self.write_both(buf, offset);
        }
        if !self.primary_usable() {
            return Err(self.primary_gone(Op::Write, offset, buf.len()));
        }
        self.primary()
            .write_at(buf, offset)
            .inspect_err(|e| self.lose(PRIMARY_LOST, "a write", e))
    }

    fn flush(&self) -> hybridcache_volume::Result<()> {
        let mut done = false;
        let mut last = None;
        if self.primary_usable() {
            match self.primary().flush() {
                Ok(()) => done = true,
                Err(e) => {
                    self.lose(PRIMARY_LOST, "a flush", &e);
                    last = Some(e);
                }
            }
        } else if self.rebuilding_primary() {
            if let Err(e) = self.primary().flush() {
                self.primary_rebuild_failed("a flush", &e);
            }
        }
        if self.mirror_usable() {
            match self.mirror().flush() {
                Ok(()) => done = true,
                Err(e) => {
                    self.lose(MIRROR_LOST, "a flush", &e);
                    last = Some(e);
                }
            }
        }
        match (done, last) {
            (true, _) => Ok(()),
            (false, Some(e)) => Err(e),
            (false, None) => Err(self.primary_gone(Op::Flush, 0, 0)),
        }
    }

    fn discard(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        if !self.primary_usable() {
            return Err(self.primary_gone(Op::Discard, offset, len as usize));
        }
        Volume::discard(&*self.primary(), offset, len)
    }

    fn discard_zeroes(&self) -> bool {
        self.primary().discard_zeroes()
    }
}

/// The primary a new one replaced, kept until the filling is done.
pub(crate) struct ReplacedPrimary {
    volume: VolumeRef,
    name: Option<&'static str>,
}

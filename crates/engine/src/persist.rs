//! Persistence: committing per-line metadata to the cache volume, and loading it back.
//!
//! The contract is a disk's with a volatile write cache: writes acknowledged before a completed
//! flush (or a FUA write) survive a crash; later ones may or may not. A commit makes that true:
//! 1. snapshot the metadata blocks whose lines changed since the last commit;
//! 2. flush the cache volume and the cores written since their last flush, so all data the
//!    snapshot refers to is durable (including core writes of lines the snapshot calls clean);
//!    a core whose flush fails is marked failing and the snapshot is taken again, recording its
//!    lines dirty, so that one core's failure never fails a commit;
//! 3. write each block to the slot that does not hold its last committed copy;
//! 4. flush the cache volume;
//! 5. write the commit record (sequence number and digest of the metadata), flush again: only
//!    now has the commit completed, and a load insists on finding what it recorded.
//!
//! Two rules keep a crash from ever serving another address's data:
//! - a line the device may record as dirty ("durably dirty") is never reused for another core
//!   line until a commit has recorded it clean or free: eviction skips it, and unmapping puts it
//!   in the limbo list instead of the free list;
//! - after a crash only dirty sectors are trusted (clean lines may have been overwritten in
//!   place by later, unflushed writes), so recovery keeps `valid = dirty` and drops clean lines.
//!   After a clean stop everything was committed and clean lines are kept too.

use std::sync::atomic::{fence, AtomicU64, Ordering};

use hybridcache_volume::Volume;
use parking_lot::{Mutex, MutexGuard};

use crate::format::{
    block_crc, decode_block, decode_config, digest_term, encode_block, encode_commit,
    encode_config, CommitRecord, ConfigSlot, Entry, Geometry, Superblock, BLOCK, COMMIT_SLOTS,
    CONFIG_SLOT_BYTES,
};
use crate::meta::Key;
use crate::CoreId;
use crate::{EngineError, Result};

/// A bitmap of atomics, one bit per item.
pub(crate) struct Bits(Box<[AtomicU64]>);

impl Bits {
    pub(crate) fn new(n: u64) -> Bits {
        Bits((0..n.div_ceil(64)).map(|_| AtomicU64::new(0)).collect())
    }
    pub(crate) fn get(&self, i: u64) -> bool {
        self.0[(i / 64) as usize].load(Ordering::SeqCst) & (1 << (i % 64)) != 0
    }
    pub(crate) fn set(&self, i: u64, on: bool) {
        let w = &self.0[(i / 64) as usize];
        if on {
            w.fetch_or(1 << (i % 64), Ordering::SeqCst);
        } else {
            w.fetch_and(!(1 << (i % 64)), Ordering::SeqCst);
        }
    }
    /// Set the bits of `bits` in word `word` (items `64 * word ..`); `u64::MAX` as `word` is
    /// no word (nothing to set). Relaxed: for a load, whose threads are joined before the
    /// bits are read.
    pub(crate) fn or_word(&self, word: u64, bits: u64) {
        if word != u64::MAX && bits != 0 {
            self.0[word as usize].fetch_or(bits, Ordering::Relaxed);
        }
    }
    fn bytes(&self) -> u64 {
        self.0.len() as u64 * 8
    }
    /// Take every set bit, clearing them.
    pub(crate) fn take_all(&self) -> Vec<u64> {
        let mut out = Vec::new();
        for (w, word) in self.0.iter().enumerate() {
            if word.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut bits = word.swap(0, Ordering::SeqCst);
            while bits != 0 {
                out.push(w as u64 * 64 + bits.trailing_zeros() as u64);
                bits &= bits - 1;
            }
        }
        out
    }
}

/// Persistence's state: the geometry of the metadata area, the bits of changed blocks, of which
/// copy holds each block's last commit and of durably dirty lines, and the commit sequence and
/// digest. Private: the commit protocol (commit.rs) works on it through a [`CommitTurn`], a load
/// (recovery.rs) through the `load_*` methods, the line room through `touch` and
/// `durably_dirty`.
///
/// Invariants: `slot` and `durable_dirty` change only under `state`'s lock, in a commit turn
/// (or while a load owns the cache alone); a block's bit in `changed` is cleared only by a
/// turn, which sets it again unless its commit completed.
pub(crate) struct Persist {
    geometry: Geometry,
    nonce: u64,
    mask_bytes: usize,
    /// Blocks whose lines changed since the last snapshot.
    changed: Bits,
    /// Per block, which slot holds its newest committed copy.
    slot: Bits,
    /// Per line: the device may record this line as dirty.
    durable_dirty: Bits,
    state: Mutex<PersistState>,
}

/// The commit sequence and digest, and the superblock as last written: under `Persist`'s lock.
pub(crate) struct PersistState {
    /// Sequence of the last metadata commit (completed or failed: a failed one's number is
    /// never reused, so two versions of a block never share a sequence number).
    seq: u64,
    /// Per block, its term in the digest of the metadata as last recorded complete.
    terms: Vec<u32>,
    /// Sum of `terms`: what the next commit record's digest starts from.
    digest: u64,
    /// Sequence of the last superblock write; its parity picks the config slot.
    sb_seq: u64,
    sb: Superblock,
}

/// A snapshot of the changed metadata blocks, encoded, with what completing it records.
pub(crate) struct Snapshot {
    buf: Vec<u8>,
    /// Per block, which of its lines the snapshot records dirty.
    dirty_lines: Vec<Vec<bool>>,
    /// Per block, its term in the digest; and the record's digest.
    terms: Vec<u32>,
    digest: u64,
}

/// One commit under way (commit.rs runs the protocol): holds persistence's lock from taking the
/// changed blocks to recording the outcome, so commits run one at a time. Dropped without
/// [`CommitTurn::completed`], its blocks go back into the next commit (nothing of it is known
/// durable) and its sequence number stays burnt.
pub(crate) struct CommitTurn<'a> {
    p: &'a Persist,
    st: MutexGuard<'a, PersistState>,
    blocks: Vec<u64>,
    seq: u64,
    done: bool,
}

pub(crate) fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    // RandomState is seeded from the OS; hashing the time on top keeps successive calls distinct.
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish()
}

pub(crate) fn new_uuid() -> String {
    let (a, b) = (random_u64(), random_u64());
    format!(
        "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
        a >> 32,
        (a >> 16) & 0xffff,
        a & 0xffff,
        b >> 48,
        b & 0xffff_ffff_ffff
    )
}

impl Persist {
    pub(crate) fn new(
        geometry: Geometry,
        nonce: u64,
        mask_bytes: usize,
        sb: Superblock,
        seq: u64,
        sb_seq: u64,
    ) -> Persist {
        Persist {
            geometry,
            nonce,
            mask_bytes,
            changed: Bits::new(geometry.meta_blocks),
            slot: Bits::new(geometry.meta_blocks),
            durable_dirty: Bits::new(geometry.lines as u64),
            state: Mutex::new(PersistState {
                seq,
                terms: vec![0; geometry.meta_blocks as usize],
                digest: 0,
                sb_seq,
                sb,
            }),
        }
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.changed.bytes()
            + self.slot.bytes()
            + self.durable_dirty.bytes()
            + self.geometry.meta_blocks * 4
    }

    /// Write a commit record for the state a load found (its newest block versions), so that
    /// versions of a commit that never completed become the committed ones before anything
    /// overwrites their older copies.
    pub(crate) fn record_loaded_state(&self, volume: &dyn Volume) -> Result<()> {
        let st = self.state.lock();
        let rec = CommitRecord {
            seq: st.seq,
            digest: st.digest,
        };
        write_commit(volume, rec, self.nonce, self.geometry.meta_blocks)
    }

    #[inline]
    pub(crate) fn geometry(&self) -> Geometry {
        self.geometry
    }

    #[inline]
    pub(crate) fn mask_bytes(&self) -> usize {
        self.mask_bytes
    }

    /// Note that `line`'s state changed. Called after the change.
    #[inline]
    pub(crate) fn touch(&self, line: u32) {
        let block = line as u64 / self.geometry.entries_per_block as u64;
        if !self.changed.get(block) {
            self.changed.set(block, true);
        }
    }

    /// Whether the device may record `line` as dirty. Callers that act on a `false` (reuse the
    /// line) must have changed the line's state before asking: with the SeqCst fence here and the
    /// one in the snapshot, either the snapshot sees the change or this sees the snapshot's bit.
    #[inline]
    pub(crate) fn durably_dirty(&self, line: u32) -> bool {
        fence(Ordering::SeqCst);
        self.durable_dirty.get(line as u64)
    }

    /// `line`'s durably-dirty bit without the fence: for whoever orders itself after the
    /// commits that set it (the committer releasing limbo, a load that owns the cache alone).
    pub(crate) fn recorded_dirty(&self, line: u32) -> bool {
        self.durable_dirty.get(line as u64)
    }

    /// Start a commit: wait for the one under way, take the blocks changed since the last
    /// snapshot and the next sequence number.
    pub(crate) fn begin_commit(&self) -> CommitTurn<'_> {
        let st = self.state.lock();
        let blocks = self.changed.take_all();
        let seq = st.seq + 1;
        CommitTurn {
            p: self,
            st,
            blocks,
            seq,
            done: false,
        }
    }

    // ---- a load (recovery.rs), which owns the cache alone --------------------------------

    /// Block `block`'s copy in `slot` is the one the load used (the newest committed).
    pub(crate) fn load_slot(&self, block: u64, slot: u32) {
        debug_assert!(slot < 2);
        if slot == 1 {
            self.slot.set(block, true);
        }
    }

    /// Lines `64 * word ..` whose bits are set in `bits` are recorded dirty on the device.
    pub(crate) fn load_dirty_word(&self, word: u64, bits: u64) {
        self.durable_dirty.or_word(word, bits);
    }

    /// Block `block` must be rewritten by the next commit (a load dropped one of its lines).
    pub(crate) fn load_changed(&self, block: u64) {
        self.changed.set(block, true);
    }

    /// The commit state the load found: the last sequence number seen and the blocks' terms.
    pub(crate) fn load_commit_state(&self, seq: u64, terms: Vec<u32>) {
        assert_eq!(
            terms.len() as u64,
            self.geometry.meta_blocks,
            "one digest term per metadata block"
        );
        let mut st = self.state.lock();
        st.seq = seq;
        st.digest = terms.iter().map(|&t| t as u64).sum();
        st.terms = terms;
    }

    pub(crate) fn superblock(&self) -> Superblock {
        self.state.lock().sb.clone()
    }

    /// Change the superblock and write it (alternating slots), then flush.
    pub(crate) fn update_superblock(
        &self,
        volume: &dyn Volume,
        change: impl FnOnce(&mut Superblock),
    ) -> Result<()> {
        let mut st = self.state.lock();
        let mut sb = st.sb.clone();
        change(&mut sb);
        let seq = st.sb_seq + 1;
        write_config(volume, &sb, seq)?;
        st.sb = sb;
        st.sb_seq = seq;
        Ok(())
    }
}

impl CommitTurn<'_> {
    /// No line changed since the last snapshot: the commit only flushes.
    pub(crate) fn is_empty(&self) -> bool {
        self.blocks.is_empty()
    }

    /// Step 1: the snapshot of the changed blocks of `lines` lines, each line's state read by
    /// `entry` (under its stripe, so never half updated). A line's durably-dirty bit is raised
    /// before its state is read (Dekker with [`Persist::durably_dirty`]): either a reuser of
    /// the line sees the bit, or this sees its change.
    pub(crate) fn snapshot(&self, lines: u32, mut entry: impl FnMut(u32) -> Entry) -> Snapshot {
        let p = self.p;
        let epb = p.geometry.entries_per_block as u64;
        let mut buf = vec![0u8; self.blocks.len() * BLOCK];
        let mut dirty_lines: Vec<Vec<bool>> = Vec::with_capacity(self.blocks.len());
        for (i, &b) in self.blocks.iter().enumerate() {
            let first = b * epb;
            let last = (first + epb).min(lines as u64);
            let mut entries = Vec::with_capacity((last - first) as usize);
            let mut dirty = Vec::with_capacity(entries.capacity());
            for line in first..last {
                let was = p.durable_dirty.get(line);
                p.durable_dirty.set(line, true);
                fence(Ordering::SeqCst);
                let e = entry(line as u32);
                if e.dirty == 0 && !was {
                    p.durable_dirty.set(line, false);
                }
                dirty.push(e.dirty != 0);
                entries.push(e);
            }
            encode_block(
                &mut buf[i * BLOCK..(i + 1) * BLOCK],
                b,
                self.seq,
                p.nonce,
                p.mask_bytes,
                &entries,
            );
            dirty_lines.push(dirty);
        }
        let (terms, digest) = self.next_digest(&buf);
        Snapshot {
            buf,
            dirty_lines,
            terms,
            digest,
        }
    }

    /// The terms of the snapshot's blocks and the record's digest: the last commit's with these
    /// blocks' terms replaced.
    fn next_digest(&self, buf: &[u8]) -> (Vec<u32>, u64) {
        let terms: Vec<u32> = self
            .blocks
            .iter()
            .enumerate()
            .map(|(i, &b)| digest_term(b, self.seq, block_crc(&buf[i * BLOCK..])))
            .collect();
        let mut digest = self.st.digest;
        for (&b, &t) in self.blocks.iter().zip(&terms) {
            digest = digest
                .wrapping_sub(self.st.terms[b as usize] as u64)
                .wrapping_add(t as u64);
        }
        (terms, digest)
    }

    /// Steps 3 to 5, once the data the snapshot refers to is durable: each block to the copy
    /// that does not hold its last commit, a flush, then the commit record (and its flush).
    pub(crate) fn write(&self, volume: &dyn Volume, snap: &Snapshot) -> Result<()> {
        let p = self.p;
        for (i, &b) in self.blocks.iter().enumerate() {
            let slot = !p.slot.get(b) as u32;
            volume.write_at(
                &snap.buf[i * BLOCK..(i + 1) * BLOCK],
                p.geometry.slot_offset(b, slot),
            )?;
        }
        volume.flush()?;
        // Only now, with every block durable, may the record say the commit completed: a
        // loader then insists on exactly these versions (docs/format.md).
        let record = CommitRecord {
            seq: self.seq,
            digest: snap.digest,
        };
        write_commit(volume, record, p.nonce, p.geometry.meta_blocks)
    }

    /// The commit completed (or, with no block changed, needed no writes): the new copies are
    /// the committed ones, and the lines the snapshot records clean are no longer durably
    /// dirty. Returns whether any block was committed.
    pub(crate) fn completed(mut self, snap: Snapshot) -> bool {
        let p = self.p;
        let epb = p.geometry.entries_per_block as u64;
        self.st.seq = self.seq;
        self.st.digest = snap.digest;
        for (&b, &t) in self.blocks.iter().zip(&snap.terms) {
            self.st.terms[b as usize] = t;
        }
        for (i, &b) in self.blocks.iter().enumerate() {
            p.slot.set(b, !p.slot.get(b));
            for (j, &dirty) in snap.dirty_lines[i].iter().enumerate() {
                p.durable_dirty.set(b * epb + j as u64, dirty);
            }
        }
        self.done = true;
        !self.blocks.is_empty()
    }
}

impl Drop for CommitTurn<'_> {
    fn drop(&mut self) {
        // A failed commit's number is burnt: its blocks may have reached the device, and the
        // retry must not give other contents the same sequence number.
        self.st.seq = self.seq;
        if !self.done {
            // Nothing is known to be durable: the blocks go back into the next commit.
            for &b in &self.blocks {
                self.p.changed.set(b, true);
            }
        }
    }
}

/// Write commit record `rec` to its slot (`seq % 2`) and flush. One sector: a device writes
/// it whole or not at all, so a torn record write leaves the previous record in the other slot.
pub(crate) fn write_commit(
    volume: &dyn Volume,
    rec: CommitRecord,
    nonce: u64,
    meta_blocks: u64,
) -> Result<()> {
    let bytes = encode_commit(rec, nonce, meta_blocks);
    volume.write_at(&bytes, COMMIT_SLOTS[(rec.seq % 2) as usize])?;
    volume.flush()?;
    Ok(())
}

fn write_config(volume: &dyn Volume, sb: &Superblock, seq: u64) -> Result<()> {
    let bytes = encode_config(sb, seq);
    // The last sector of each slot holds a commit record.
    if bytes.len() as u64 > CONFIG_SLOT_BYTES - BLOCK as u64 {
        return Err(EngineError::Invalid(
            "the superblock outgrew its 1 MiB slot (too many cores?)".into(),
        ));
    }
    volume.write_at(&bytes, (seq % 2) * CONFIG_SLOT_BYTES)?;
    volume.flush()?;
    Ok(())
}

/// Read both config slots.
pub(crate) fn read_config(volume: &dyn Volume) -> Result<[ConfigSlot; 2]> {
    let mut out = [ConfigSlot::Empty, ConfigSlot::Empty];
    for (slot, found) in out.iter_mut().enumerate() {
        let base = slot as u64 * CONFIG_SLOT_BYTES;
        if base + 4096 > volume.size() {
            continue;
        }
        let mut head = vec![0u8; 4096];
        volume.read_at(&mut head, base)?;
        *found = decode_config(&head, &mut |len| {
            let len = len.div_ceil(BLOCK) * BLOCK;
            let mut b = vec![0u8; len];
            volume.read_at(&mut b, base).ok().map(|_| b)
        });
    }
    Ok(out)
}

/// The newest valid superblock, with its sequence number and format version.
/// Refuse a volume that a newer build wrote to: its older slot, if any, is not the cache's
/// state any more (the newer build has moved on from it), and loading or overwriting it on
/// the strength of the other slot would roll the cache back or destroy it.
pub(crate) fn refuse_newer(slots: &[ConfigSlot; 2]) -> Result<()> {
    match slots.iter().find_map(|s| match s {
        ConfigSlot::Newer(v) => Some(*v),
        _ => None,
    }) {
        Some(found) => Err(EngineError::NewerFormat {
            found,
            oldest: crate::format::OLDEST_VERSION,
            newest: crate::format::VERSION,
        }),
        None => Ok(()),
    }
}

pub(crate) fn newest(slots: &[ConfigSlot; 2]) -> Option<(u64, &Superblock, u32)> {
    slots
        .iter()
        .filter_map(|s| match s {
            ConfigSlot::Valid { seq, sb, version } => Some((*seq, &**sb, *version)),
            _ => None,
        })
        .max_by_key(|(seq, _, _)| *seq)
}

/// What a cache volume holds, read without loading it or writing anything: the newest
/// superblock and, per core id, how many core lines its metadata records as dirty. Used to
/// say what a destructive command (`--zero-metadata`, `start-cache --force`) would discard.
#[derive(Debug, Clone)]
pub struct MetadataSummary {
    pub superblock: Superblock,
    pub dirty_lines: std::collections::BTreeMap<CoreId, u64>,
}

impl MetadataSummary {
    pub fn total_dirty_lines(&self) -> u64 {
        self.dirty_lines.values().sum()
    }

    pub fn dirty_bytes(&self) -> u64 {
        self.total_dirty_lines() * self.superblock.line_size as u64
    }
}

/// Read the [`MetadataSummary`] of `volume`; None when it holds no loadable superblock. Each
/// metadata block is taken in its newest intact copy, and a core line recorded dirty by two
/// cache lines (one left from before it moved) counts once. A block damaged in both copies is
/// an error: what it held cannot be told.
pub fn read_summary(volume: &dyn Volume) -> Result<Option<MetadataSummary>> {
    let slots = read_config(volume)?;
    refuse_newer(&slots)?;
    let Some((_, sb, _)) = newest(&slots) else {
        return Ok(None);
    };
    let sb = sb.clone();
    let geometry = Geometry {
        lines: sb.lines,
        entries_per_block: sb.entries_per_block,
        meta_blocks: sb.meta_blocks,
        data_offset: sb.data_offset,
    };
    if sb.line_size < 4096 || sb.line_size % 4096 != 0 || sb.entries_per_block == 0 {
        return Err(EngineError::Corrupt(format!(
            "superblock: line size {} with {} entries per block is impossible",
            sb.line_size, sb.entries_per_block
        )));
    }
    let mask_bytes = (sb.line_size / 512 / 8) as usize;
    let mut dirty = std::collections::HashSet::new();
    let mut buf = vec![0u8; 2 * BLOCK];
    let (mut first, mut second) = (Vec::new(), Vec::new());
    for block in 0..geometry.meta_blocks {
        volume.read_at(&mut buf, geometry.slot_offset(block, 0))?;
        let count = geometry.lines_in_block(block);
        let copies = [
            decode_block(
                &buf[..BLOCK],
                block,
                sb.nonce,
                mask_bytes,
                count,
                &mut first,
            ),
            decode_block(
                &buf[BLOCK..],
                block,
                sb.nonce,
                mask_bytes,
                count,
                &mut second,
            ),
        ];
        let entries = match copies {
            [Ok(s0), Ok(s1)] if s1 > s0 => &second,
            [Ok(_), _] => &first,
            [Err(_), Ok(_)] => &second,
            [Err(_), Err(_)] => {
                return Err(EngineError::Corrupt(format!(
                    "metadata block {block} is damaged in both copies"
                )))
            }
        };
        for e in entries.iter().filter(|e| e.dirty != 0) {
            if let Some(key) = e.key {
                dirty.insert(key.raw());
            }
        }
    }
    let mut dirty_lines = std::collections::BTreeMap::new();
    for raw in dirty {
        *dirty_lines.entry(Key::from_raw(raw).core()).or_insert(0) += 1;
    }
    Ok(Some(MetadataSummary {
        superblock: sb,
        dirty_lines,
    }))
}

/// Create the persistent state for a new cache: wipe old superblocks, write empty metadata,
/// then the superblock. A crash part way leaves a volume with no cache, never a half one.
pub(crate) fn format_volume(
    volume: &dyn Volume,
    geometry: Geometry,
    sb: &Superblock,
    mask_bytes: usize,
) -> Result<Persist> {
    let zero = vec![0u8; 4096];
    volume.write_at(&zero, 0)?;
    volume.write_at(&zero, CONFIG_SLOT_BYTES)?;
    volume.flush()?;
    // Write slot 0 of every block, a few MiB at a time; slot 1 stays as it is (it fails its
    // checksum or carries a foreign nonce, and loses to slot 0 either way).
    const CHUNK_BLOCKS: u64 = 4096;
    let mut buf = vec![0u8; (CHUNK_BLOCKS * 2) as usize * BLOCK];
    let mut terms = Vec::with_capacity(geometry.meta_blocks as usize);
    for (b, n) in geometry.block_runs(CHUNK_BLOCKS) {
        // Each block's slot 1 is read back first so the chunk write leaves it unchanged.
        let len = (n * 2) as usize * BLOCK;
        volume.read_at(&mut buf[..len], geometry.slot_offset(b, 0))?;
        for i in 0..n {
            let block = b + i;
            let count = geometry.lines_in_block(block);
            let entries = vec![
                Entry {
                    key: None,
                    valid: 0,
                    dirty: 0
                };
                count
            ];
            let at = (i * 2) as usize * BLOCK;
            encode_block(
                &mut buf[at..at + BLOCK],
                block,
                0,
                sb.nonce,
                mask_bytes,
                &entries,
            );
            terms.push(digest_term(block, 0, block_crc(&buf[at..])));
        }
        volume.write_at(&buf[..len], geometry.slot_offset(b, 0))?;
    }
    volume.flush()?;
    let digest = terms.iter().map(|&t| t as u64).sum();
    // Commit 0 is the empty metadata; the other record slot may hold a record of an earlier
    // cache, which its nonce already disowns, but a wiped slot is plainer to read.
    volume.write_at(&vec![0u8; BLOCK], COMMIT_SLOTS[1])?;
    write_commit(
        volume,
        CommitRecord { seq: 0, digest },
        sb.nonce,
        geometry.meta_blocks,
    )?;
    write_config(volume, sb, 1)?;
    let p = Persist::new(geometry, sb.nonce, mask_bytes, sb.clone(), 0, 1);
    p.load_commit_state(0, terms);
    Ok(p)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use hybridcache_volume::{RamVolume, Volume, VolumeRef};

    use super::*;
    use crate::{Cache, CacheConfig, CacheMode, LineSize};

    /// A stopped cache whose metadata block 0 gets a well-formed newer copy (right checksum,
    /// index and nonce, newest sequence) holding `entry` for line 0.
    fn load_with_entry(entry: Entry) -> EngineError {
        let vol = Arc::new(RamVolume::new("cache", (3 << 20) + (64 << 10)).unwrap());
        let core: VolumeRef = Arc::new(RamVolume::new("core", 1 << 20).unwrap());
        let cache = Cache::create(
            vol.clone(),
            CacheConfig {
                id: 1,
                line_size: LineSize::from_kib(4).unwrap(),
                mode: CacheMode::Wb,
            },
            false,
        )
        .unwrap();
        cache.add_core(core.clone(), Some(1)).unwrap();
        let sb = cache.superblock().unwrap();
        cache.stop(true).unwrap();
        let mut block = vec![0u8; BLOCK];
        let count = (sb.lines as usize).min(sb.entries_per_block as usize);
        let mut entries = vec![
            Entry {
                key: None,
                valid: 0,
                dirty: 0
            };
            count
        ];
        entries[0] = entry;
        encode_block(&mut block, 0, u64::MAX / 2, sb.nonce, 1, &entries);
        // In the copy that the last commit did not write: the entries are then read as those
        // of a commit that never completed, which passes the commit record's check.
        vol.write_at(&block, crate::format::META_OFFSET + BLOCK as u64)
            .unwrap();
        Cache::load(vol, &mut |_| Some(core.clone()))
            .err()
            .expect("refused")
    }

    #[test]
    fn impossible_entries_are_refused_by_name() {
        let e = load_with_entry(Entry {
            key: Some(Key::new(9, 0)),
            valid: 1,
            dirty: 1,
        });
        assert!(
            e.to_string()
                .contains("belongs to core 9, which the superblock does not list"),
            "{e}"
        );
        let e = load_with_entry(Entry {
            key: Some(Key::new(1, 256)),
            valid: 1,
            dirty: 0,
        });
        assert!(e.to_string().contains("beyond the end of core 1"), "{e}");
        let e = load_with_entry(Entry {
            key: Some(Key::new(1, 3)),
            valid: 1,
            dirty: 3,
        });
        assert!(e.to_string().contains("impossible sector masks"), "{e}");
        let e = load_with_entry(Entry {
            key: None,
            valid: 1,
            dirty: 0,
        });
        assert!(
            e.to_string().contains("free line 0 has sector state"),
            "{e}"
        );
    }
}

#[cfg(test)]
mod duplicate_tests {
    use std::sync::Arc;

    use hybridcache_volume::{RamVolume, Volume, VolumeRef};

    use super::*;
    use crate::meta::Key;
    use crate::restore::set_load_threads;
    use crate::{Cache, CacheConfig, CacheMode, LineSize};

    /// A newer copy of metadata block `block`, with sequence number `seq`.
    struct Craft {
        block: u64,
        seq: u64,
    }

    /// A stopped cache of about 2,300 lines (48 blocks) with core line 5 written (stamp 1),
    /// then `crafts`: newer copies of blocks each mapping core line 5 from their first line,
    /// whose data carries the block number as stamp. Loaded on `threads` threads: Ok(the stamp
    /// read back from core line 5) or the refusal.
    fn load_crafted(crafts: &[Craft], threads: usize) -> std::result::Result<u8, String> {
        let core: VolumeRef = Arc::new(RamVolume::new("core", 1 << 20).unwrap());
        // The line core line 5 gets is in the writing thread's home shard, which depends on how
        // many threads the process made before (`stats::thread_slot`). In a crafted block, the
        // craft would overwrite the stop's commit of it and the load would rightly refuse the
        // cache; so the line is written from fresh threads until it lands outside them. (Written
        // from the test's own thread, it did so after some sets of other tests.)
        let (vol, sb) = (0..64)
            .find_map(|_| {
                let vol = Arc::new(RamVolume::new("cache", 12 << 20).unwrap());
                let cache = Cache::create(
                    vol.clone(),
                    CacheConfig {
                        id: 1,
                        line_size: LineSize::from_kib(4).unwrap(),
                        mode: CacheMode::Wb,
                    },
                    false,
                )
                .unwrap();
                cache.add_core(core.clone(), Some(1)).unwrap();
                let writer = cache.core(1).unwrap();
                std::thread::spawn(move || writer.write(&[1u8; 4096], 5 * 4096).unwrap())
                    .join()
                    .unwrap();
                let sb = cache.superblock().unwrap();
                let line = (0..sb.lines)
                    .find(|&l| cache.inner.lines.table().key(l) == Some(Key::new(1, 5)))
                    .unwrap();
                cache.stop(false).unwrap();
                let block = line as u64 / sb.entries_per_block as u64;
                (!crafts.iter().any(|c| c.block == block)).then_some((vol, sb))
            })
            .unwrap();
        assert!(sb.meta_blocks >= 32);
        let epb = sb.entries_per_block as u64;
        for c in crafts {
            let count = (sb.lines as u64 - c.block * epb).min(epb) as usize;
            let mut entries = vec![
                Entry {
                    key: None,
                    valid: 0,
                    dirty: 0
                };
                count
            ];
            entries[0] = Entry {
                key: Some(Key::new(1, 5)),
                valid: 0xff,
                dirty: 0xff,
            };
            let mut block = vec![0u8; BLOCK];
            encode_block(&mut block, c.block, c.seq, sb.nonce, 1, &entries);
            // Slot 1: never written by a commit for these blocks, so this copy reads as one a
            // commit that never completed left, newer than slot 0's.
            let at = crate::format::META_OFFSET + (c.block * 2 + 1) * BLOCK as u64;
            vol.write_at(&block, at).unwrap();
            let line = c.block * epb;
            vol.write_at(&[c.block as u8; 4096], sb.data_offset + line * 4096)
                .unwrap();
        }
        set_load_threads(threads);
        let loaded = Cache::load(vol, &mut |_| Some(core.clone()));
        set_load_threads(0);
        let cache = loaded.map_err(|e| e.to_string())?;
        // The losers wait in limbo (the device still calls them dirty) until a commit.
        cache.core(1).unwrap().flush().unwrap();
        cache.check_invariants();
        assert_eq!(
            cache.stats().usage.occupancy_lines,
            1,
            "one mapping survives"
        );
        let mut buf = [0u8; 4096];
        cache.core(1).unwrap().read(&mut buf, 5 * 4096).unwrap();
        assert!(buf.iter().all(|&b| b == buf[0]));
        Ok(buf[0])
    }

    /// A core line mapped by lines of several blocks keeps the newest block version's line,
    /// whichever thread decodes or links which block; two in one version are refused.
    #[test]
    fn the_newest_mapping_wins_on_any_thread_count() {
        for threads in [1, 2, 4, 32] {
            let newest = load_crafted(
                &[
                    Craft {
                        block: 20,
                        seq: 1000,
                    },
                    Craft {
                        block: 9,
                        seq: 2000,
                    },
                    Craft {
                        block: 27,
                        seq: 1500,
                    },
                ],
                threads,
            );
            assert_eq!(newest, Ok(9), "{threads} threads");
            let older_first = load_crafted(
                &[
                    Craft { block: 3, seq: 900 },
                    Craft {
                        block: 30,
                        seq: 3000,
                    },
                ],
                threads,
            );
            assert_eq!(older_first, Ok(30), "{threads} threads");
            let twice = load_crafted(
                &[
                    Craft {
                        block: 12,
                        seq: 700,
                    },
                    Craft {
                        block: 25,
                        seq: 700,
                    },
                ],
                threads,
            )
            .expect_err("refused");
            assert!(
                twice.contains("is mapped twice in one commit"),
                "{threads} threads: {twice}"
            );
            // Blocks 4 and 5 begin at lines 192 and 240, which a load links in one batch: the
            // second must see the first's mapping although its walk ran before it existed.
            for (a, b, winner) in [(1000, 1200, 5), (1200, 1000, 4)] {
                let one_batch = load_crafted(
                    &[Craft { block: 4, seq: a }, Craft { block: 5, seq: b }],
                    threads,
                );
                assert_eq!(
                    one_batch,
                    Ok(winner),
                    "{threads} threads, sequences {a} {b}"
                );
            }
            let twice = load_crafted(
                &[Craft { block: 4, seq: 800 }, Craft { block: 5, seq: 800 }],
                threads,
            )
            .expect_err("refused");
            assert!(
                twice.contains("is mapped twice in one commit"),
                "{threads} threads: {twice}"
            );
        }
    }
}

#[cfg(test)]
mod version_tests {
    use std::sync::Arc;

    use hybridcache_volume::{RamVolume, Volume, VolumeRef};

    use super::*;
    use crate::format::{config_crc, COMMIT_SLOTS, VERSION};
    use crate::{Cache, CacheConfig, CacheMode, LineSize};

    /// A stopped wb cache holding dirty data, with both superblock slots rewritten as format
    /// `version` (checksums fixed up) and, when `version` is 1, no commit records (version 1
    /// had none).
    fn stopped_as_version(version: u32) -> (Arc<RamVolume>, VolumeRef) {
        let vol = Arc::new(RamVolume::new("cache", (3 << 20) + (64 << 10)).unwrap());
        let core: VolumeRef = Arc::new(RamVolume::new("core", 1 << 20).unwrap());
        let cache = Cache::create(
            vol.clone(),
            CacheConfig {
                id: 1,
                line_size: LineSize::from_kib(4).unwrap(),
                mode: CacheMode::Wb,
            },
            false,
        )
        .unwrap();
        let id = cache.add_core(core.clone(), Some(1)).unwrap();
        cache.core(id).unwrap().write(&[7u8; 4096], 8192).unwrap();
        cache.stop(false).unwrap();
        for slot in 0..2u64 {
            let mut head = vec![0u8; 4096];
            vol.read_at(&mut head, slot * CONFIG_SLOT_BYTES).unwrap();
            let len = 32 + u32::from_le_bytes(head[24..28].try_into().unwrap()) as usize;
            head[8..12].copy_from_slice(&version.to_le_bytes());
            let crc = config_crc(&head[..len]);
            head[12..16].copy_from_slice(&crc.to_le_bytes());
            vol.write_at(&head, slot * CONFIG_SLOT_BYTES).unwrap();
        }
        if version == 1 {
            for at in COMMIT_SLOTS {
                vol.write_at(&[0u8; BLOCK], at).unwrap();
            }
        }
        (vol, core)
    }

    #[test]
    fn a_version_1_cache_loads_and_is_upgraded() {
        let (vol, core) = stopped_as_version(1);
        let cache = Cache::load(vol.clone(), &mut |_| Some(core.clone())).unwrap();
        let mut buf = vec![0u8; 4096];
        cache.core(1).unwrap().read(&mut buf, 8192).unwrap();
        assert!(buf.iter().all(|&b| b == 7), "dirty data came back");
        // The load wrote a commit record and version-2 superblocks, so it now loads by the
        // version-2 rules.
        let slots = read_config(&*vol).unwrap();
        assert_eq!(newest(&slots).map(|(_, _, v)| v), Some(VERSION));
        cache.stop(false).unwrap();
        drop(cache);
        let cache = Cache::load(vol, &mut |_| Some(core.clone())).unwrap();
        cache.core(1).unwrap().read(&mut buf, 8192).unwrap();
        assert!(buf.iter().all(|&b| b == 7));
    }

    #[test]
    fn a_newer_version_is_refused_by_name() {
        let (vol, core) = stopped_as_version(VERSION + 1);
        let before = {
            let mut b = vec![0u8; vol.size() as usize];
            vol.read_at(&mut b, 0).unwrap();
            b
        };
        let e = Cache::load(vol.clone(), &mut |_| Some(core.clone()))
            .err()
            .expect("refused");
        let newer = format!("made by a newer hybridcache (format {})", VERSION + 1);
        assert!(
            e.to_string().contains(&newer) && !e.to_string().contains("force"),
            "{e}"
        );
        // Starting a new cache on it without force is refused the same way (it is not damaged,
        // so force is not offered), and so is a look at it.
        let config = CacheConfig {
            id: 2,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wt,
        };
        let e = Cache::create(vol.clone(), config, false)
            .err()
            .expect("refused");
        assert!(e.to_string().contains(&newer), "{e}");
        let e = Cache::peek(&*vol).expect_err("refused");
        assert!(e.to_string().contains(&newer), "{e}");
        let mut after = vec![0u8; vol.size() as usize];
        vol.read_at(&mut after, 0).unwrap();
        assert!(before == after, "a refused load wrote nothing");
    }

    /// A newer build that rewrote only one slot (its next superblock write) still owns the
    /// cache: the older slot must not be loaded in its place.
    #[test]
    fn one_slot_of_a_newer_version_is_enough_to_refuse() {
        let (vol, core) = stopped_as_version(VERSION);
        let mut head = vec![0u8; 4096];
        vol.read_at(&mut head, CONFIG_SLOT_BYTES).unwrap();
        let len = 32 + u32::from_le_bytes(head[24..28].try_into().unwrap()) as usize;
        head[8..12].copy_from_slice(&(VERSION + 1).to_le_bytes());
        let crc = config_crc(&head[..len]);
        head[12..16].copy_from_slice(&crc.to_le_bytes());
        vol.write_at(&head, CONFIG_SLOT_BYTES).unwrap();
        let e = Cache::load(vol.clone(), &mut |_| Some(core.clone()))
            .err()
            .expect("refused");
        assert!(e.to_string().contains("newer hybridcache"), "{e}");
    }

    /// A version field beyond ours in a slot whose checksum fails is damage, reported as such.
    #[test]
    fn a_damaged_slot_claiming_a_newer_version_is_damage() {
        let (vol, core) = stopped_as_version(VERSION);
        for slot in 0..2u64 {
            let mut head = vec![0u8; 4096];
            vol.read_at(&mut head, slot * CONFIG_SLOT_BYTES).unwrap();
            head[8..12].copy_from_slice(&(VERSION + 1).to_le_bytes());
            vol.write_at(&head, slot * CONFIG_SLOT_BYTES).unwrap();
        }
        let e = Cache::load(vol.clone(), &mut |_| Some(core.clone()))
            .err()
            .expect("refused");
        let e = e.to_string();
        assert!(
            !e.contains("newer hybridcache") && e.contains("is not supported"),
            "{e}"
        );
    }
}

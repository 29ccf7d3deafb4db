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

use std::sync::atomic::{fence, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

use hybridcache_volume::Volume;
use parking_lot::Mutex;

use crate::bits::Mask;
use crate::cache::CacheInner;
use crate::core_state::CoreState;
use crate::core_flush;
use crate::format::{
    block_crc, decode_block, decode_commit, decode_config, digest_term, encode_block,
    encode_commit, encode_config, BlockError, CommitRecord, CommitSlot, ConfigSlot, Entry,
    Geometry, Superblock, BLOCK, COMMIT_SLOTS, CONFIG_SLOT_BYTES,
};
use crate::lists::ListKind;
use crate::meta::{Key, LineTable, Walks, FREE};
use crate::stats::Counter;
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
    fn or_word(&self, word: u64, bits: u64) {
        if word != u64::MAX && bits != 0 {
            self.0[word as usize].fetch_or(bits, Ordering::Relaxed);
        }
    }
    fn bytes(&self) -> u64 {
        self.0.len() as u64 * 8
    }
    /// Take every set bit, clearing them.
    fn take_all(&self) -> Vec<u64> {
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

pub(crate) struct Persist {
    pub(crate) geometry: Geometry,
    pub(crate) nonce: u64,
    mask_bytes: usize,
    /// Blocks whose lines changed since the last snapshot.
    changed: Bits,
    /// Per block, which slot holds its newest committed copy.
    slot: Bits,
    /// Per line: the device may record this line as dirty.
    durable_dirty: Bits,
    state: Mutex<PersistState>,
}

struct PersistState {
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

    /// Note that `line`'s state changed. Called after the change.
    pub(crate) fn touch(&self, line: u32) {
        let block = line as u64 / self.geometry.entries_per_block as u64;
        if !self.changed.get(block) {
            self.changed.set(block, true);
        }
    }

    /// Whether the device may record `line` as dirty. Callers that act on a `false` (reuse the
    /// line) must have changed the line's state before asking: with the SeqCst fence here and the
    /// one in the snapshot, either the snapshot sees the change or this sees the snapshot's bit.
    pub(crate) fn durably_dirty(&self, line: u32) -> bool {
        fence(Ordering::SeqCst);
        self.durable_dirty.get(line as u64)
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

/// Write commit record `rec` to its slot (`seq % 2`) and flush. One sector: a device writes
/// it whole or not at all, so a torn record write leaves the previous record in the other slot.
fn write_commit(
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

/// How one attempt at a commit ended.
enum Attempt {
    Done,
    /// A core's flush failed for the first time after the snapshot was taken, which may call
    /// lines of that core clean on the strength of writes that are not durable: snapshot again.
    Retry,
}

impl CacheInner {
    /// Make everything acknowledged so far durable (see the module doc). Without persistence it
    /// only flushes the devices. Fails only when the cache volume fails: a core whose flush
    /// fails has the error counted on it and its lines recorded dirty, so that it cannot keep
    /// the other cores' writes from becoming durable.
    pub(crate) fn commit(&self) -> Result<()> {
        let Some(p) = &self.persist else {
            self.volume.flush()?;
            self.flush_cores();
            return Ok(());
        };
        let taken = self.cleaner_signal.commit_begins();
        // Each retry follows a core newly marked failing, so there are at most as many as cores.
        loop {
            match self.commit_once(p) {
                Ok(Attempt::Retry) => {}
                Ok(Attempt::Done) => return Ok(()),
                Err(e) => {
                    self.cleaner_signal.commit_failed(taken);
                    return Err(e);
                }
            }
        }
    }

    /// Whether `line` holds data of a core whose device is failing (a hint: no lock is taken).
    pub(crate) fn of_failing_core(&self, line: u32) -> bool {
        self.table.key(line).is_some_and(|k| {
            self.gauges[k.core() as usize]
                .failing
                .load(Ordering::Relaxed)
        })
    }

    /// Flush the cores that took writes since their last flush, and the failing ones (to learn
    /// whether they came back). Returns whether a core failed that was not failing before.
    /// The cores flush in parallel, each bounded by the core flush timeout (core_flush.rs): a
    /// hung core counts as failed, so it cannot hold this commit (and every other core's
    /// durability) hostage.
    fn flush_cores(&self) -> bool {
        let cores: Vec<Arc<CoreState>> = self.cores.read().values().cloned().collect();
        let mut pending = Vec::new();
        for c in cores {
            let was_failing = self.gauges[c.id as usize].failing.load(Ordering::SeqCst);
            if !c.unflushed.swap(false, Ordering::SeqCst) && !was_failing {
                continue;
            }
            let flush = core_flush::start_device_flush(&c);
            pending.push((c, was_failing, flush));
        }
        let deadline = Instant::now() + core_flush::core_flush_timeout();
        let mut newly_failing = false;
        for (c, was_failing, flush) in pending {
            match flush.wait(deadline) {
                Ok(()) => {
                    if was_failing {
                        self.core_recovered(c.id);
                    }
                }
                Err(_) => {
                    c.unflushed.store(true, Ordering::SeqCst);
                    c.counters.add(Counter::CoreWriteErrors, 1);
                    if !was_failing {
                        self.gauges[c.id as usize]
                            .failing
                            .store(true, Ordering::SeqCst);
                        newly_failing = true;
                    }
                }
            }
        }
        newly_failing
    }

    /// A failing core's flush succeeded: commits may record its lines as they are again. Its
    /// blocks are rewritten at the next commit, or lines recorded dirty while it failed would
    /// stay dirty on the device (and not reusable) until something else changed their block.
    fn core_recovered(&self, id: CoreId) {
        self.gauges[id as usize]
            .failing
            .store(false, Ordering::SeqCst);
        if let Some(p) = &self.persist {
            for line in 0..self.lines {
                if self.table.key(line).is_some_and(|k| k.core() == id) {
                    p.touch(line);
                }
            }
        }
    }

    /// After a commit: if `core` is failing, its acknowledged writes are not known durable, and
    /// a flush on it must fail, unless its device flushes now.
    pub(crate) fn retry_failing_core(&self, core: &CoreState) -> Result<()> {
        if !self.gauges[core.id as usize].failing.load(Ordering::SeqCst) {
            return Ok(());
        }
        core_flush::flush_device(core)
            .inspect_err(|_| core.counters.add(Counter::CoreWriteErrors, 1))?;
        // Everything written to it before this flush is durable now.
        self.core_recovered(core.id);
        Ok(())
    }

    fn commit_once(&self, p: &Persist) -> Result<Attempt> {
        let mut st = p.state.lock();
        let blocks = p.changed.take_all();
        let epb = p.geometry.entries_per_block as u64;
        let seq = st.seq + 1;
        let mut buf = vec![0u8; blocks.len() * BLOCK];
        // Per block, which of its lines the snapshot records as dirty.
        let mut dirty_lines: Vec<Vec<bool>> = Vec::with_capacity(blocks.len());
        for (i, &b) in blocks.iter().enumerate() {
            let first = b * epb;
            let last = (first + epb).min(self.lines as u64);
            let mut entries = Vec::with_capacity((last - first) as usize);
            let mut dirty = Vec::with_capacity(entries.capacity());
            for line in first..last {
                let line = line as u32;
                // Raise the bit before reading the state (Dekker with `durably_dirty`).
                let was = p.durable_dirty.get(line as u64);
                p.durable_dirty.set(line as u64, true);
                fence(Ordering::SeqCst);
                let e = self.snapshot_entry(line);
                if e.dirty == 0 && !was {
                    p.durable_dirty.set(line as u64, false);
                }
                dirty.push(e.dirty != 0);
                entries.push(e);
            }
            encode_block(
                &mut buf[i * BLOCK..(i + 1) * BLOCK],
                b,
                seq,
                p.nonce,
                p.mask_bytes,
                &entries,
            );
            dirty_lines.push(dirty);
        }
        // The record's digest: the last one with these blocks' terms replaced.
        let terms: Vec<u32> = blocks
            .iter()
            .enumerate()
            .map(|(i, &b)| digest_term(b, seq, block_crc(&buf[i * BLOCK..])))
            .collect();
        let mut digest = st.digest;
        for (&b, &t) in blocks.iter().zip(&terms) {
            digest = digest
                .wrapping_sub(st.terms[b as usize] as u64)
                .wrapping_add(t as u64);
        }
        let result = (|| -> Result<Attempt> {
            self.volume.flush()?;
            if self.flush_cores() {
                return Ok(Attempt::Retry);
            }
            if blocks.is_empty() {
                return Ok(Attempt::Done);
            }
            for (i, &b) in blocks.iter().enumerate() {
                let slot = !p.slot.get(b) as u32;
                self.volume.write_at(
                    &buf[i * BLOCK..(i + 1) * BLOCK],
                    p.geometry.slot_offset(b, slot),
                )?;
            }
            self.volume.flush()?;
            // Only now, with every block durable, may the record say the commit completed: a
            // loader then insists on exactly these versions (docs/format.md).
            write_commit(
                &*self.volume,
                CommitRecord { seq, digest },
                p.nonce,
                p.geometry.meta_blocks,
            )?;
            Ok(Attempt::Done)
        })();
        // A failed commit's number is burnt: its blocks may have reached the device, and the
        // retry must not give other contents the same sequence number.
        st.seq = seq;
        if !matches!(result, Ok(Attempt::Done)) {
            // Nothing is known to be durable: the blocks go back into the next commit.
            for &b in &blocks {
                p.changed.set(b, true);
            }
            return result;
        }
        st.digest = digest;
        for (&b, &t) in blocks.iter().zip(&terms) {
            st.terms[b as usize] = t;
        }
        for (i, &b) in blocks.iter().enumerate() {
            p.slot.set(b, !p.slot.get(b));
            for (j, &dirty) in dirty_lines[i].iter().enumerate() {
                p.durable_dirty.set(b * epb + j as u64, dirty);
            }
        }
        drop(st);
        if !blocks.is_empty() {
            self.release_limbo();
            // Lines cleaned before the snapshot are reusable now: wake the writes waiting for one.
            self.cleaner_signal.room_made();
        }
        Ok(Attempt::Done)
    }

    /// A line's state as it goes on disk: only consistent combinations.
    fn snapshot_entry(&self, line: u32) -> Entry {
        let key = self.table.key(line);
        let valid = self.table.valid(line);
        // A racing update may show new valid with old dirty bits; dirty data outside valid
        // sectors cannot exist, so it is dropped here.
        let mut dirty = self.table.dirty(line) & valid;
        if key.is_some_and(|k| {
            self.gauges[k.core() as usize]
                .failing
                .load(Ordering::SeqCst)
        }) {
            // The core may not hold what cleaning wrote to it (its flush failed): the cache's
            // copy stays the one to trust. Valid sectors hold the newest data, so this never
            // serves anything older; the line is only cleaned again later.
            dirty = valid;
        }
        match key {
            Some(k) if valid != 0 => Entry {
                key: Some(k),
                valid,
                dirty,
            },
            _ => Entry {
                key: None,
                valid: 0,
                dirty: 0,
            },
        }
    }

    /// Move lines that are no longer durably dirty from limbo to the free lists.
    pub(crate) fn release_limbo(&self) {
        let Some(p) = &self.persist else { return };
        for shard in 0..self.lists.shard_count() {
            let mut s = self.lists.lock(shard);
            let mut cur = s.first(ListKind::Limbo);
            while let Some(line) = cur {
                cur = self.lists.next(line);
                if !p.durable_dirty.get(line as u64) {
                    self.lists
                        .move_back(&mut s, ListKind::Limbo, ListKind::Free, line);
                    self.free_lines.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    }
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
    {
        let mut st = p.state.lock();
        st.terms = terms;
        st.digest = digest;
    }
    Ok(p)
}

/// The last commit that completed, from the two record slots: the valid one with the higher
/// sequence number. A damaged newest record only makes the loader insist on the commit before;
/// that commit's block versions are still on the device, since the commit after it wrote only
/// the other copies.
fn last_commit(volume: &dyn Volume, nonce: u64, meta_blocks: u64) -> Result<CommitRecord> {
    let mut found = Vec::with_capacity(2);
    let mut buf = vec![0u8; BLOCK];
    for at in COMMIT_SLOTS {
        volume.read_at(&mut buf, at)?;
        found.push((at, decode_commit(&buf, nonce, meta_blocks)));
    }
    if let Some(rec) = found
        .iter()
        .filter_map(|(_, s)| match s {
            CommitSlot::Valid(r) => Some(*r),
            _ => None,
        })
        .max_by_key(|r| r.seq)
    {
        return Ok(rec);
    }
    let why: Vec<String> = found
        .iter()
        .map(|(at, s)| {
            let what = match s {
                CommitSlot::Empty => "empty".to_string(),
                CommitSlot::Foreign => "belongs to another cache".to_string(),
                CommitSlot::Corrupt(why) => why.clone(),
                CommitSlot::Valid(_) => unreachable!("handled above"),
            };
            format!("at byte offset {at} {what}")
        })
        .collect();
    Err(EngineError::Corrupt(format!(
        "no valid commit record, so the last completed commit is unknown: {}",
        why.join(", ")
    )))
}

/// Threads a load may use; 0 picks them (see [`set_load_threads`]).
static LOAD_THREADS: AtomicUsize = AtomicUsize::new(0);

/// Below this many metadata blocks per thread (48k lines of 4 KiB), a load that picks its own
/// thread count does not split: starting a thread costs more than it saves.
const MIN_BLOCKS_PER_THREAD: u64 = 1024;

/// How many threads [`crate::Cache::load`] uses to read and decode the metadata and to rebuild
/// the lookup table: `0` (the default) takes one per available CPU, at most 8, and one for a
/// small cache; any other value is used as given (up to one thread per metadata block). Every
/// count yields the same cache; this only trades load time against CPUs taken from others.
pub fn set_load_threads(threads: usize) {
    LOAD_THREADS.store(threads, Ordering::Relaxed);
}

fn load_threads(blocks: u64) -> usize {
    let n = match LOAD_THREADS.load(Ordering::Relaxed) {
        0 => std::thread::available_parallelism()
            .map_or(1, |n| n.get())
            .min(8)
            .min((blocks / MIN_BLOCKS_PER_THREAD).max(1) as usize),
        n => n,
    };
    n.clamp(1, blocks.max(1) as usize)
}

/// `f(0)`, ..., `f(n - 1)` at once: `f(0)` on this thread, the others on scoped threads (or on
/// this thread too, in turn, when one cannot be started). Results in order.
fn in_parallel<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync) -> Vec<R> {
    if n <= 1 {
        return vec![f(0)];
    }
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = (1..n)
            .map(|i| {
                std::thread::Builder::new()
                    .name("hc-load".into())
                    .spawn_scoped(s, move || f(i))
                    .ok()
            })
            .collect();
        let mut out = Vec::with_capacity(n);
        out.push(f(0));
        for (i, h) in handles.into_iter().enumerate() {
            out.push(match h {
                Some(h) => h.join().unwrap_or_else(|e| std::panic::resume_unwind(e)),
                None => f(i + 1),
            });
        }
        out
    })
}

/// Part `i` of `n` of `0..total`: contiguous, sizes differing by at most one.
fn share(total: u64, n: usize, i: usize) -> std::ops::Range<u64> {
    let (n, i) = (n as u64, i as u64);
    (total * i / n)..(total * (i + 1) / n)
}

/// What every thread of a load's first pass (read, check and decode blocks) needs.
struct Decode<'a> {
    volume: &'a dyn Volume,
    table: &'a LineTable,
    p: &'a Persist,
    nonce: u64,
    record: Option<CommitRecord>,
    crashed: bool,
    /// Every sector of a line.
    full: Mask,
    /// (core id, lines of that core) for each core the superblock lists.
    core_lines: &'a [(CoreId, u64)],
}

/// What the first pass found in one range of blocks.
struct Decoded {
    /// Per block of the range: its term of the digest of the metadata as found.
    terms: Vec<u32>,
    /// Per block of the range: the sequence number of the copy used.
    seqs: Vec<u64>,
    /// Sum of the terms of the versions the last completed commit left.
    committed_digest: u64,
    /// Blocks with a damaged copy whose other copy might be older than that commit.
    suspects: Vec<String>,
    /// Per core id: (lines, dirty lines) given a state.
    gauges: Vec<(u64, u64)>,
}

impl Decode<'_> {
    /// Read, check and decode `blocks`, and give each line they describe its key and masks
    /// (not linked into the lookup table yet: [`Link::buckets`] does that).
    fn blocks(&self, blocks: std::ops::Range<u64>) -> Result<Decoded> {
        const CHUNK_BLOCKS: u64 = 8192;
        let p = self.p;
        let geometry = p.geometry;
        let mask_bytes = p.mask_bytes;
        let epb = geometry.entries_per_block as u64;
        let table = self.table;
        let corrupt = EngineError::Corrupt;
        let first = blocks.start;
        let count = (blocks.end - blocks.start) as usize;
        let mut out = Decoded {
            terms: vec![0; count],
            seqs: vec![0; count],
            committed_digest: 0,
            suspects: Vec::new(),
            gauges: vec![(0, 0); crate::MAX_CORES as usize],
        };
        let mut buf = vec![0u8; (CHUNK_BLOCKS.min(count as u64) * 2) as usize * BLOCK];
        let mut entries = Vec::with_capacity(epb as usize);
        let mut other_entries = Vec::with_capacity(epb as usize);
        // Durably-dirty bits gathered a word at a time: one atomic OR per 64 lines, not per line.
        let mut dirty_word: (u64, u64) = (u64::MAX, 0);
        let mut b = first;
        while b < blocks.end {
            let n = (blocks.end - b).min(CHUNK_BLOCKS);
            let len = (n * 2) as usize * BLOCK;
            self.volume
                .read_at(&mut buf[..len], geometry.slot_offset(b, 0))?;
            for i in 0..n {
                let block = b + i;
                let k = (block - first) as usize;
                let count = geometry.lines_in_block(block);
                let at = (i * 2) as usize * BLOCK;
                let copies = [
                    decode_block(
                        &buf[at..at + BLOCK],
                        block,
                        self.nonce,
                        mask_bytes,
                        count,
                        &mut entries,
                    ),
                    decode_block(
                        &buf[at + BLOCK..at + 2 * BLOCK],
                        block,
                        self.nonce,
                        mask_bytes,
                        count,
                        &mut other_entries,
                    ),
                ];
                let crcs = [block_crc(&buf[at..]), block_crc(&buf[at + BLOCK..])];
                let why = |e: &BlockError| match e {
                    BlockError::Checksum => "checksum mismatch".to_string(),
                    BlockError::WrongIndex(i) => format!("holds block {i}"),
                    BlockError::ForeignNonce => "belongs to another cache".to_string(),
                };
                let lines = format!("lines {}..{}", block * epb, block * epb + count as u64);
                let (slot, seq) = match &copies {
                    [Ok(s0), Ok(s1)] if s1 > s0 => (1, *s1),
                    [Ok(s0), _] => (0, *s0),
                    [Err(_), Ok(s1)] => (1, *s1),
                    [Err(e0), Err(e1)] => {
                        return Err(corrupt(format!(
                            "metadata block {block} ({lines}) is damaged in both copies: at byte offset {} {}, at byte offset {} {}",
                            geometry.slot_offset(block, 0),
                            why(e0),
                            geometry.slot_offset(block, 1),
                            why(e1)
                        )));
                    }
                };
                if slot == 1 {
                    std::mem::swap(&mut entries, &mut other_entries);
                }
                out.terms[k] = digest_term(block, seq, crcs[slot]);
                if let Some(rec) = self.record {
                    // The version the last completed commit left: the newest copy not newer
                    // than it.
                    let committed = (0..2)
                        .filter_map(|c| match copies[c] {
                            Ok(s) if s <= rec.seq => Some((s, c)),
                            _ => None,
                        })
                        .max();
                    let Some((cseq, c)) = committed else {
                        let describe = |c: usize| match &copies[c] {
                            Ok(s) => format!("sequence {s}, from a commit that never completed"),
                            Err(e) => why(e),
                        };
                        return Err(corrupt(format!(
                            "metadata block {block} ({lines}) has no copy as of the last completed commit {}: at byte offset {} {}, at byte offset {} {}",
                            rec.seq,
                            geometry.slot_offset(block, 0),
                            describe(0),
                            geometry.slot_offset(block, 1),
                            describe(1)
                        )));
                    };
                    out.committed_digest = out
                        .committed_digest
                        .wrapping_add(digest_term(block, cseq, crcs[c]) as u64);
                    if let Some(bad) = (0..2).find(|&c| copies[c].is_err()) {
                        if let Err(e) = &copies[bad] {
                            out.suspects.push(format!(
                                "block {block} ({lines}): copy at byte offset {} {}, copy at byte offset {} has sequence {cseq}",
                                geometry.slot_offset(block, bad as u32),
                                why(e),
                                geometry.slot_offset(block, 1 - bad as u32),
                            ));
                        }
                    }
                }
                if slot == 1 {
                    p.slot.set(block, true);
                }
                out.seqs[k] = seq;
                let mut changed = false;
                for (j, e) in entries.iter().enumerate() {
                    let line = (block * epb + j as u64) as u32;
                    let Some(key) = e.key else {
                        if e.valid != 0 || e.dirty != 0 {
                            return Err(corrupt(format!(
                                "metadata block {block}: free line {line} has sector state"
                            )));
                        }
                        continue;
                    };
                    if e.valid == 0 || e.dirty & !e.valid != 0 || e.valid & !self.full != 0 {
                        return Err(corrupt(format!(
                            "metadata block {block}: line {line} has impossible sector masks (valid {:#x}, dirty {:#x})",
                            e.valid, e.dirty
                        )));
                    }
                    let Some(&(_, lines_of_core)) =
                        self.core_lines.iter().find(|c| c.0 == key.core())
                    else {
                        return Err(corrupt(format!(
                            "metadata block {block}: line {line} belongs to core {}, which the superblock does not list",
                            key.core()
                        )));
                    };
                    if key.line() >= lines_of_core {
                        return Err(corrupt(format!(
                            "metadata block {block}: line {line} maps core line {} beyond the end of core {}",
                            key.line(),
                            key.core()
                        )));
                    }
                    if e.dirty != 0 {
                        let word = line as u64 / 64;
                        if word != dirty_word.0 {
                            p.durable_dirty.or_word(dirty_word.0, dirty_word.1);
                            dirty_word = (word, 0);
                        }
                        dirty_word.1 |= 1 << (line % 64);
                    }
                    // After a crash, clean sectors may have been overwritten in place by writes
                    // that were never committed: only dirty ones are trusted.
                    let valid = if self.crashed { e.dirty } else { e.valid };
                    if valid == 0 {
                        // The device must learn the line is free before a later clean load
                        // could trust its content.
                        changed = true;
                        continue;
                    }
                    table.set_state(line, key, valid, e.dirty);
                    let g = &mut out.gauges[key.core() as usize];
                    g.0 += 1;
                    g.1 += (e.dirty != 0) as u64;
                }
                if changed {
                    p.changed.set(block, true);
                }
            }
            b += n;
        }
        p.durable_dirty.or_word(dirty_word.0, dirty_word.1);
        Ok(out)
    }
}

/// What every thread of a load's second pass (link lines into the lookup table) needs.
struct Link<'a> {
    table: &'a LineTable,
    p: &'a Persist,
    lines: u32,
    /// Per block, the sequence number of the copy its lines came from.
    block_seq: &'a [u64],
}

impl Link<'_> {
    /// Link every line whose key falls in `buckets` into its chain, in line order. A core line
    /// given by two lines keeps the one from the newer block version (the other is a leftover
    /// of a line dropped since); two in the same version are corruption. Only this thread
    /// changes these buckets' chains, and whether a line's key falls in them never changes, so
    /// the threads need no lock. Returns per core id the (lines, dirty lines) dropped, or the
    /// first line found corrupt with the error.
    fn buckets(
        &self,
        buckets: std::ops::Range<u64>,
    ) -> std::result::Result<Vec<(u64, u64)>, (u32, EngineError)> {
        const BATCH: u32 = 64;
        let table = self.table;
        let epb = self.p.geometry.entries_per_block as u64;
        let mut dropped = vec![(0u64, 0u64); crate::MAX_CORES as usize];
        let (lo, hi) = (buckets.start, buckets.end);
        let mut lines = [0u32; BATCH as usize + 1];
        let mut keys = [None; BATCH as usize + 1];
        let mut walks = Walks::default();
        let mut start = 0;
        while start < self.lines {
            let end = start.saturating_add(BATCH).min(self.lines);
            // Pick this thread's lines without a branch per line: whether a line is ours is a
            // coin toss the branch predictor loses, and this scan visits every line.
            let mut n = 0;
            for line in start..end {
                // Another thread may free a line of its own buckets meanwhile: either value
                // read puts the line outside these buckets.
                let raw = table.key_raw(line);
                let b = table.bucket(Key::from_raw(raw)) as u64;
                lines[n] = line;
                keys[n] = Some(Key::from_raw(raw));
                n += (raw != FREE && lo <= b && b < hi) as usize;
            }
            start = end;
            let (lines, keys) = (&lines[..n], &keys[..n]);
            // Whether each key is mapped already, for the whole batch at once: one lookup at a
            // time is a chain of DRAM misses, which dominated the load.
            table.lookup_many(keys, &mut walks);
            for (j, &line) in lines.iter().enumerate() {
                let Some(key) = keys[j] else { continue };
                let bucket = walks.buckets[j];
                // The walk's answer holds unless this batch's earlier lines changed the chain:
                // they only link a line at the head of its bucket (after unlinking an older
                // mapping of the same key), so an unchanged head means an unchanged chain.
                let found = if table.bucket_head(bucket) == walks.heads[j] {
                    walks.found[j]
                } else {
                    table.lookup(key)
                };
                if let Some(other) = found {
                    let block = line as u64 / epb;
                    let (seq, other_seq) = (
                        self.block_seq[block as usize],
                        self.block_seq[(other as u64 / epb) as usize],
                    );
                    if other_seq == seq {
                        return Err((
                            line,
                            EngineError::Corrupt(format!(
                                "metadata block {block}: core {} line {} is mapped twice in one commit",
                                key.core(),
                                key.line()
                            )),
                        ));
                    }
                    let g = &mut dropped[key.core() as usize];
                    if other_seq > seq {
                        g.0 += 1;
                        g.1 += (table.dirty(line) != 0) as u64;
                        table.clear_state(line);
                        self.p.changed.set(block, true);
                        continue;
                    }
                    g.0 += 1;
                    g.1 += (table.dirty(other) != 0) as u64;
                    table.unmap(other, key);
                    self.p.changed.set(other as u64 / epb, true);
                }
                table.link(line, bucket);
            }
        }
        Ok(dropped)
    }
}

/// Read and check every metadata block and rebuild `inner`'s lines from them. Nothing is
/// written. `inner` is fresh (every line free) and not yet shared, so no lock is needed. Fails
/// with a message saying what is corrupt and where.
///
/// From format version 2 on, the commit record names the last commit that completed and the
/// digest of the block versions it left. Each block must still have that version (its newest
/// valid copy with a sequence number up to the record's): anything else is damage, and the
/// load is refused. A newer copy can only come from a commit that never completed; it is
/// used, as its data was flushed before the block was written.
///
/// Two passes, each split over threads ([`set_load_threads`]): the first reads, checks and
/// decodes ranges of blocks and gives each line its state; the second links the lines into
/// the lookup table, each thread owning a range of buckets. A loaded cache is the same
/// whatever the thread count.
pub(crate) fn restore(
    inner: &mut CacheInner,
    volume: &dyn Volume,
    sb: &Superblock,
    line_sectors: u32,
    version: u32,
) -> Result<()> {
    let p = inner.persist.as_ref().expect("restore needs persistence");
    let geometry = p.geometry;
    let record = if version >= 2 {
        Some(last_commit(volume, sb.nonce, geometry.meta_blocks)?)
    } else {
        None
    };
    let full: Mask = if line_sectors == 128 {
        Mask::MAX
    } else {
        (1 << line_sectors) - 1
    };
    let core_lines: Vec<(CoreId, u64)> = sb
        .cores
        .iter()
        .map(|c| (c.id, c.size.div_ceil(sb.line_size as u64)))
        .collect();
    let decode = Decode {
        volume,
        table: &inner.table,
        p,
        nonce: sb.nonce,
        record,
        crashed: !sb.clean_shutdown,
        full,
        core_lines: &core_lines,
    };
    let threads = load_threads(geometry.meta_blocks);
    let parts = in_parallel(threads, |i| {
        decode.blocks(share(geometry.meta_blocks, threads, i))
    });
    // The digest of the versions found for the recorded commit, and blocks with a damaged copy
    // whose other copy might be an older version than that commit left (named on refusal).
    let mut committed_digest = 0u64;
    let mut suspects: Vec<String> = Vec::new();
    let mut terms = Vec::with_capacity(geometry.meta_blocks as usize);
    // Sequence of the copy each block was read from: settles a core line mapped by two lines
    // (the newer mapping wins; the older is a leftover of a line dropped since).
    let mut block_seq = Vec::with_capacity(geometry.meta_blocks as usize);
    let mut gauges = vec![(0u64, 0u64); crate::MAX_CORES as usize];
    // Parts are in block order, so the first error is the one a single pass would meet first.
    for part in parts {
        let part = part?;
        committed_digest = committed_digest.wrapping_add(part.committed_digest);
        suspects.extend(part.suspects);
        terms.extend(part.terms);
        block_seq.extend(part.seqs);
        for (g, d) in gauges.iter_mut().zip(&part.gauges) {
            g.0 += d.0;
            g.1 += d.1;
        }
    }
    let max_seq = block_seq.iter().copied().max().unwrap_or(0);
    let link = Link {
        table: &inner.table,
        p,
        lines: inner.lines,
        block_seq: &block_seq,
    };
    let buckets = inner.table.bucket_count() as u64;
    let linked = in_parallel(threads, |i| link.buckets(share(buckets, threads, i)));
    let mut first_error: Option<(u32, EngineError)> = None;
    for part in linked {
        match part {
            Ok(dropped) => {
                for (g, d) in gauges.iter_mut().zip(&dropped) {
                    g.0 -= d.0;
                    g.1 -= d.1;
                }
            }
            Err((line, e)) => {
                if !first_error.as_ref().is_some_and(|(l, _)| *l < line) {
                    first_error = Some((line, e));
                }
            }
        }
    }
    if let Some((_, e)) = first_error {
        return Err(e);
    }
    if let Some(rec) = record {
        if committed_digest != rec.digest {
            let found = if suspects.is_empty() {
                "every block has a valid copy, so one holds an older or misplaced version (a stale or misdirected sector)".to_string()
            } else {
                let n = suspects.len();
                suspects.truncate(8);
                format!(
                    "{n} blocks have a damaged copy, and the other copy of at least one is older than that commit: {}",
                    suspects.join("; ")
                )
            };
            return Err(EngineError::Corrupt(format!(
                "the metadata does not match the last completed commit {} (commit record in slot {} at byte offset {}): {found}",
                rec.seq,
                rec.seq % 2,
                COMMIT_SLOTS[(rec.seq % 2) as usize]
            )));
        }
    }
    {
        let mut st = p.state.lock();
        st.seq = record.map_or(max_seq, |r| r.seq.max(max_seq));
        st.digest = terms.iter().map(|&t| t as u64).sum();
        st.terms = terms;
    }
    for (id, (occupancy, dirty)) in gauges.into_iter().enumerate() {
        inner.gauges[id]
            .occupancy
            .store(occupancy, Ordering::Relaxed);
        inner.gauges[id].dirty.store(dirty, Ordering::Relaxed);
    }
    // Lines the device may still record as dirty for a mapping that lost to a newer one wait in
    // limbo until a commit rewrites their block.
    let table = &inner.table;
    let durable = &p.durable_dirty;
    let free = inner.lists.rebuild(|line| match table.key(line) {
        Some(_) if table.dirty(line) != 0 => ListKind::Dirty,
        Some(_) => ListKind::Clean,
        None if durable.get(line as u64) => ListKind::Limbo,
        None => ListKind::Free,
    });
    inner.free_lines.store(free, Ordering::Relaxed);
    Ok(())
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
                    .find(|&l| cache.inner.table.key(l) == Some(Key::new(1, 5)))
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

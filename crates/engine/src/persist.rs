//! Persistence: committing per-line metadata to the cache volume, and loading it back.
//!
//! The contract is a disk's with a volatile write cache: writes acknowledged before a completed
//! flush (or a FUA write) survive a crash; later ones may or may not. A commit makes that true:
//! 1. snapshot the metadata blocks whose lines changed since the last commit;
//! 2. flush the cache volume and every core, so all data the snapshot refers to is durable
//!    (including core writes of lines the snapshot calls clean);
//! 3. write each block to the slot that does not hold its last committed copy;
//! 4. flush the cache volume.
//!
//! Two rules keep a crash from ever serving another address's data:
//! - a line the device may record as dirty ("durably dirty") is never reused for another core
//!   line until a commit has recorded it clean or free: eviction skips it, and unmapping puts it
//!   in the limbo list instead of the free list;
//! - after a crash only dirty sectors are trusted (clean lines may have been overwritten in
//!   place by later, unflushed writes), so recovery keeps `valid = dirty` and drops clean lines.
//!   After a clean stop everything was committed and clean lines are kept too.

use std::sync::atomic::{fence, AtomicU64, Ordering};

use hybridcache_volume::{Volume, VolumeRef};
use parking_lot::Mutex;

use crate::bits::Mask;
use crate::cache::CacheInner;
use crate::format::{
    decode_block, decode_config, encode_block, encode_config, BlockError, ConfigSlot, Entry,
    Geometry, Superblock, BLOCK, CONFIG_SLOT_BYTES,
};
use crate::lists::ListKind;
use crate::meta::Key;
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
    /// Sequence of the last metadata commit.
    seq: u64,
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
    fn new(
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
            state: Mutex::new(PersistState { seq, sb_seq, sb }),
        }
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.changed.bytes() + self.slot.bytes() + self.durable_dirty.bytes()
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

fn write_config(volume: &dyn Volume, sb: &Superblock, seq: u64) -> Result<()> {
    let bytes = encode_config(sb, seq);
    if bytes.len() as u64 > CONFIG_SLOT_BYTES {
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

/// The newest valid superblock, with its sequence number.
pub(crate) fn newest(slots: &[ConfigSlot; 2]) -> Option<(u64, &Superblock)> {
    slots
        .iter()
        .filter_map(|s| match s {
            ConfigSlot::Valid { seq, sb } => Some((*seq, &**sb)),
            _ => None,
        })
        .max_by_key(|(seq, _)| *seq)
}

impl CacheInner {
    /// Make everything acknowledged so far durable (see the module doc). Without persistence it
    /// only flushes the devices.
    pub(crate) fn commit(&self) -> Result<()> {
        let cores: Vec<VolumeRef> = self
            .cores
            .read()
            .values()
            .map(|c| c.volume.clone())
            .collect();
        let Some(p) = &self.persist else {
            self.volume.flush()?;
            for c in cores {
                c.flush()?;
            }
            return Ok(());
        };
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
        let result = (|| -> Result<()> {
            self.volume.flush()?;
            for c in &cores {
                c.flush()?;
            }
            if blocks.is_empty() {
                return Ok(());
            }
            for (i, &b) in blocks.iter().enumerate() {
                let slot = !p.slot.get(b) as u32;
                self.volume.write_at(
                    &buf[i * BLOCK..(i + 1) * BLOCK],
                    p.geometry.slot_offset(b, slot),
                )?;
            }
            self.volume.flush()?;
            Ok(())
        })();
        if let Err(e) = result {
            // Nothing is known to be durable: the blocks go back into the next commit.
            for &b in &blocks {
                p.changed.set(b, true);
            }
            return Err(e);
        }
        st.seq = seq;
        for (i, &b) in blocks.iter().enumerate() {
            p.slot.set(b, !p.slot.get(b));
            for (j, &dirty) in dirty_lines[i].iter().enumerate() {
                p.durable_dirty.set(b * epb + j as u64, dirty);
            }
        }
        drop(st);
        if !blocks.is_empty() {
            self.release_limbo();
        }
        Ok(())
    }

    /// A line's state as it goes on disk: only consistent combinations.
    fn snapshot_entry(&self, line: u32) -> Entry {
        let key = self.table.key(line);
        let valid = self.table.valid(line);
        // A racing update may show new valid with old dirty bits; dirty data outside valid
        // sectors cannot exist, so it is dropped here.
        let dirty = self.table.dirty(line) & valid;
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
    let epb = geometry.entries_per_block as u64;
    // Write slot 0 of every block, a few MiB at a time; slot 1 stays as it is (it fails its
    // checksum or carries a foreign nonce, and loses to slot 0 either way).
    const CHUNK_BLOCKS: u64 = 4096;
    let mut buf = vec![0u8; (CHUNK_BLOCKS * 2) as usize * BLOCK];
    let mut b = 0;
    while b < geometry.meta_blocks {
        let n = (geometry.meta_blocks - b).min(CHUNK_BLOCKS);
        // Each block's slot 1 is read back first so the chunk write leaves it unchanged.
        let len = (n * 2) as usize * BLOCK;
        volume.read_at(&mut buf[..len], geometry.slot_offset(b, 0))?;
        for i in 0..n {
            let block = b + i;
            let count = (geometry.lines as u64 - block * epb).min(epb) as usize;
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
        }
        volume.write_at(&buf[..len], geometry.slot_offset(b, 0))?;
        b += n;
    }
    volume.flush()?;
    write_config(volume, sb, 1)?;
    Ok(Persist::new(
        geometry,
        sb.nonce,
        mask_bytes,
        sb.clone(),
        0,
        1,
    ))
}

/// A cache line recovered from the device.
pub(crate) struct Recovered {
    pub(crate) line: u32,
    pub(crate) key: Key,
    pub(crate) valid: Mask,
    pub(crate) dirty: Mask,
}

/// Read and check every metadata block. Nothing is written. Returns the persistence state and
/// the lines to map, or a message saying what is corrupt and where.
pub(crate) fn read_metadata(
    volume: &dyn Volume,
    sb: &Superblock,
    sb_seq: u64,
    geometry: Geometry,
    mask_bytes: usize,
    line_sectors: u32,
) -> Result<(Persist, Vec<Recovered>)> {
    let persist = Persist::new(geometry, sb.nonce, mask_bytes, sb.clone(), 0, sb_seq);
    let epb = geometry.entries_per_block as u64;
    let crashed = !sb.clean_shutdown;
    let mut lines: Vec<Recovered> = Vec::new();
    // Best block sequence per key, to settle duplicates: the newer mapping wins.
    let mut owner: std::collections::HashMap<Key, (u64, usize)> = std::collections::HashMap::new();
    let mut max_seq = 0;
    const CHUNK_BLOCKS: u64 = 8192;
    let mut buf = vec![0u8; (CHUNK_BLOCKS * 2) as usize * BLOCK];
    let corrupt = |what: String| EngineError::Corrupt(what);
    let mut b = 0;
    while b < geometry.meta_blocks {
        let n = (geometry.meta_blocks - b).min(CHUNK_BLOCKS);
        let len = (n * 2) as usize * BLOCK;
        volume.read_at(&mut buf[..len], geometry.slot_offset(b, 0))?;
        for i in 0..n {
            let block = b + i;
            let count = (geometry.lines as u64 - block * epb).min(epb) as usize;
            let at = (i * 2) as usize * BLOCK;
            let copies = [
                decode_block(&buf[at..at + BLOCK], block, sb.nonce, mask_bytes, count),
                decode_block(
                    &buf[at + BLOCK..at + 2 * BLOCK],
                    block,
                    sb.nonce,
                    mask_bytes,
                    count,
                ),
            ];
            let (slot, seq, entries) = match copies {
                [Ok((s0, e0)), Ok((s1, e1))] => {
                    if s1 > s0 {
                        (1, s1, e1)
                    } else {
                        (0, s0, e0)
                    }
                }
                [Ok((s, e)), Err(_)] => (0, s, e),
                [Err(_), Ok((s, e))] => (1, s, e),
                [Err(e0), Err(e1)] => {
                    let why = |e: &BlockError| match e {
                        BlockError::Checksum => "checksum mismatch".to_string(),
                        BlockError::WrongIndex(i) => format!("holds block {i}"),
                        BlockError::ForeignNonce => "belongs to another cache".to_string(),
                    };
                    return Err(corrupt(format!(
                        "metadata block {block} (lines {}..{}) is damaged in both copies: at byte offset {} {}, at byte offset {} {}",
                        block * epb,
                        block * epb + count as u64,
                        geometry.slot_offset(block, 0),
                        why(&e0),
                        geometry.slot_offset(block, 1),
                        why(&e1)
                    )));
                }
            };
            persist.slot.set(block, slot == 1);
            max_seq = max_seq.max(seq);
            for (j, e) in entries.into_iter().enumerate() {
                let line = block * epb + j as u64;
                let Some(key) = e.key else {
                    if e.valid != 0 || e.dirty != 0 {
                        return Err(corrupt(format!(
                            "metadata block {block}: free line {line} has sector state"
                        )));
                    }
                    continue;
                };
                let full: Mask = if line_sectors == 128 {
                    Mask::MAX
                } else {
                    (1 << line_sectors) - 1
                };
                if e.valid == 0 || e.dirty & !e.valid != 0 || e.valid & !full != 0 {
                    return Err(corrupt(format!(
                        "metadata block {block}: line {line} has impossible sector masks (valid {:#x}, dirty {:#x})",
                        e.valid, e.dirty
                    )));
                }
                let Some(core) = sb.cores.iter().find(|c| c.id == key.core()) else {
                    return Err(corrupt(format!(
                        "metadata block {block}: line {line} belongs to core {}, which the superblock does not list",
                        key.core()
                    )));
                };
                let line_bytes = sb.line_size as u64;
                if key.line() >= core.size.div_ceil(line_bytes) {
                    return Err(corrupt(format!(
                        "metadata block {block}: line {line} maps core line {} beyond the end of core {} ({} bytes)",
                        key.line(),
                        core.id,
                        core.size
                    )));
                }
                let valid = if crashed { e.dirty } else { e.valid };
                if valid == 0 {
                    // A clean line dropped after a crash: the device must learn it is free before
                    // a later clean load could trust its (possibly stale) content.
                    persist.changed.set(block, true);
                    continue;
                }
                if e.dirty != 0 {
                    persist.durable_dirty.set(line, true);
                }
                let rec = Recovered {
                    line: line as u32,
                    key,
                    valid,
                    dirty: e.dirty,
                };
                match owner.get(&key) {
                    Some(&(other_seq, _)) if other_seq == seq => {
                        return Err(corrupt(format!(
                            "metadata block {block}: core {} line {} is mapped twice in one commit",
                            key.core(),
                            key.line()
                        )));
                    }
                    // The other mapping is newer: this one is a leftover of a line that was
                    // dropped and whose block had not been rewritten.
                    Some(&(other_seq, _)) if other_seq > seq => {
                        persist.changed.set(block, true);
                        continue;
                    }
                    Some(&(_, idx)) => {
                        persist.changed.set(lines[idx].line as u64 / epb, true);
                        owner.insert(key, (seq, idx));
                        lines[idx] = rec;
                    }
                    None => {
                        owner.insert(key, (seq, lines.len()));
                        lines.push(rec);
                    }
                }
            }
        }
        b += n;
    }
    persist.state.lock().seq = max_seq;
    Ok((persist, lines))
}

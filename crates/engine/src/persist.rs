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
    // Write slot 0 of every block, a few MiB at a time; slot 1 stays as it is (it fails its
    // checksum or carries a foreign nonce, and loses to slot 0 either way).
    const CHUNK_BLOCKS: u64 = 4096;
    let mut buf = vec![0u8; (CHUNK_BLOCKS * 2) as usize * BLOCK];
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
        }
        volume.write_at(&buf[..len], geometry.slot_offset(b, 0))?;
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

/// Read and check every metadata block and rebuild `inner`'s lines from them. Nothing is
/// written. `inner` is fresh (every line free) and not yet shared, so no lock is needed. Fails
/// with a message saying what is corrupt and where.
pub(crate) fn restore(
    inner: &mut CacheInner,
    volume: &dyn Volume,
    sb: &Superblock,
    line_sectors: u32,
) -> Result<()> {
    let p = inner.persist.as_ref().expect("restore needs persistence");
    let geometry = p.geometry;
    let mask_bytes = p.mask_bytes;
    let epb = geometry.entries_per_block as u64;
    let crashed = !sb.clean_shutdown;
    // Sequence of the copy each block was read from: settles a core line mapped by two lines
    // (the newer mapping wins; the older is a leftover of a line dropped since).
    let mut block_seq = vec![0u64; geometry.meta_blocks as usize];
    let mut max_seq = 0;
    let mut gauges = vec![(0u64, 0u64); crate::MAX_CORES as usize + 1];
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
    let corrupt = EngineError::Corrupt;
    const CHUNK_BLOCKS: u64 = 8192;
    let mut buf = vec![0u8; (CHUNK_BLOCKS * 2) as usize * BLOCK];
    let mut entries = Vec::with_capacity(epb as usize);
    let mut other_entries = Vec::with_capacity(epb as usize);
    for (b, n) in geometry.block_runs(CHUNK_BLOCKS) {
        let len = (n * 2) as usize * BLOCK;
        volume.read_at(&mut buf[..len], geometry.slot_offset(b, 0))?;
        for i in 0..n {
            let block = b + i;
            let count = geometry.lines_in_block(block);
            let at = (i * 2) as usize * BLOCK;
            let copies = [
                decode_block(
                    &buf[at..at + BLOCK],
                    block,
                    sb.nonce,
                    mask_bytes,
                    count,
                    &mut entries,
                ),
                decode_block(
                    &buf[at + BLOCK..at + 2 * BLOCK],
                    block,
                    sb.nonce,
                    mask_bytes,
                    count,
                    &mut other_entries,
                ),
            ];
            let (slot, seq) = match copies {
                [Ok(s0), Ok(s1)] if s1 > s0 => {
                    std::mem::swap(&mut entries, &mut other_entries);
                    (1, s1)
                }
                [Ok(s0), _] => (0, s0),
                [Err(_), Ok(s1)] => {
                    std::mem::swap(&mut entries, &mut other_entries);
                    (1, s1)
                }
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
            p.slot.set(block, slot == 1);
            block_seq[block as usize] = seq;
            max_seq = max_seq.max(seq);
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
                if e.valid == 0 || e.dirty & !e.valid != 0 || e.valid & !full != 0 {
                    return Err(corrupt(format!(
                        "metadata block {block}: line {line} has impossible sector masks (valid {:#x}, dirty {:#x})",
                        e.valid, e.dirty
                    )));
                }
                let Some(&(_, lines_of_core)) = core_lines.iter().find(|c| c.0 == key.core())
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
                    p.durable_dirty.set(line as u64, true);
                }
                // After a crash, clean sectors may have been overwritten in place by writes that
                // were never committed: only dirty ones are trusted.
                let valid = if crashed { e.dirty } else { e.valid };
                if valid == 0 {
                    // The device must learn the line is free before a later clean load could
                    // trust its content.
                    p.changed.set(block, true);
                    continue;
                }
                if let Some(other) = inner.table.lookup(key) {
                    let other_seq = block_seq[(other as u64 / epb) as usize];
                    if other_seq == seq {
                        return Err(corrupt(format!(
                            "metadata block {block}: core {} line {} is mapped twice in one commit",
                            key.core(),
                            key.line()
                        )));
                    }
                    if other_seq > seq {
                        p.changed.set(block, true);
                        continue;
                    }
                    let g = &mut gauges[key.core() as usize];
                    g.0 -= 1;
                    if inner.table.dirty(other) != 0 {
                        g.1 -= 1;
                    }
                    inner.table.unmap(other, key);
                    p.changed.set(other as u64 / epb, true);
                }
                inner.table.map(line, key, valid, e.dirty);
                let g = &mut gauges[key.core() as usize];
                g.0 += 1;
                if e.dirty != 0 {
                    g.1 += 1;
                }
            }
        }
    }
    p.state.lock().seq = max_seq;
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
    use crate::meta::Key;
    use crate::{Cache, CacheConfig, CacheMode, LineSize};

    /// A stopped cache whose metadata block 0 is replaced by a well-formed block (right checksum,
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
        vol.write_at(&block, crate::format::META_OFFSET).unwrap();
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

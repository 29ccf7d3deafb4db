//! Restoring a cache's line state from its metadata blocks: the second half of a load
//! (recovery.rs runs the checks before it and installs policies and cores after it). The blocks
//! are read and decoded on several threads, the newest mapping of each core line wins, and the
//! line table, lists and gauges are rebuilt. Nothing here writes to a device.
//!
//! Invariants:
//! - the versions found are the ones the last completed commit left (their digest is the
//!   commit record's), or the load is refused naming the suspect blocks;
//! - after a crash only dirty sectors are trusted (`valid = dirty`), after a clean stop clean
//!   lines are kept too (persist.rs's module doc);
//! - a core line is mapped by at most one cache line: of two entries naming it, the one in the
//!   newer block copy wins, and the loser is freed (always checked: two mappings of one core
//!   line would serve stale data).

use std::sync::atomic::{AtomicUsize, Ordering};

use hybridcache_volume::Volume;

use crate::bits::Mask;
use crate::format::{
    block_crc, decode_block, decode_commit, digest_term, BlockError, CommitRecord, CommitSlot,
    Entry, Superblock, BLOCK, COMMIT_SLOTS,
};
use crate::inner::CacheInner;
use crate::lists::ListKind;
use crate::meta::{Key, LineTable, Walks, FREE};
use crate::persist::Persist;
use crate::{CoreId, EngineError, Result};

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
    /// The lines a smaller mirror covers (every line without one): no dirty line lies beyond.
    mirrored: u32,
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

/// A thread's buffers for decoding, reused from block to block.
struct Scratch {
    /// The entries of the copy in use, and of the other copy.
    entries: Vec<Entry>,
    other: Vec<Entry>,
    /// Durably-dirty bits gathered a word at a time (word, bits): one atomic OR per 64 lines,
    /// not per line.
    dirty_word: (u64, u64),
}

/// A copy of a block that failed its checks, in words.
fn why(e: &BlockError) -> String {
    match e {
        BlockError::Checksum => "checksum mismatch".to_string(),
        BlockError::WrongIndex(i) => format!("holds block {i}"),
        BlockError::ForeignNonce => "belongs to another cache".to_string(),
    }
}

impl Decode<'_> {
    /// Read, check and decode `blocks`, and give each line they describe its key and masks
    /// (not linked into the lookup table yet: [`Link::buckets`] does that).
    fn blocks(&self, blocks: std::ops::Range<u64>) -> Result<Decoded> {
        const CHUNK_BLOCKS: u64 = 8192;
        let geometry = self.p.geometry();
        let epb = geometry.entries_per_block as usize;
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
        let mut scratch = Scratch {
            entries: Vec::with_capacity(epb),
            other: Vec::with_capacity(epb),
            dirty_word: (u64::MAX, 0),
        };
        let mut b = first;
        while b < blocks.end {
            let n = (blocks.end - b).min(CHUNK_BLOCKS);
            let len = (n * 2) as usize * BLOCK;
            self.volume
                .read_at(&mut buf[..len], geometry.slot_offset(b, 0))?;
            for i in 0..n {
                let at = (i * 2) as usize * BLOCK;
                let block = b + i;
                let k = (block - first) as usize;
                self.block(block, k, &buf[at..at + 2 * BLOCK], &mut out, &mut scratch)?;
            }
            b += n;
        }
        self.p
            .load_dirty_word(scratch.dirty_word.0, scratch.dirty_word.1);
        Ok(out)
    }

    /// Block `block` (the `k`th of this thread's range) from its two copies in `copies`: the
    /// copy to use, its term of the digest, the check against the commit record, and its lines.
    fn block(
        &self,
        block: u64,
        k: usize,
        copies: &[u8],
        out: &mut Decoded,
        s: &mut Scratch,
    ) -> Result<()> {
        let geometry = self.p.geometry();
        let count = geometry.lines_in_block(block);
        let mask_bytes = self.p.mask_bytes();
        let (first, second) = copies.split_at(BLOCK);
        let found = [
            decode_block(first, block, self.nonce, mask_bytes, count, &mut s.entries),
            decode_block(second, block, self.nonce, mask_bytes, count, &mut s.other),
        ];
        let crcs = [block_crc(first), block_crc(second)];
        let (slot, seq) = self.pick_copy(block, count, &found)?;
        if slot == 1 {
            std::mem::swap(&mut s.entries, &mut s.other);
        }
        out.terms[k] = digest_term(block, seq, crcs[slot]);
        if let Some(rec) = self.record {
            self.committed_copy(block, count, rec, &found, &crcs, out)?;
        }
        self.p.load_slot(block, slot as u32);
        out.seqs[k] = seq;
        if self.restore_lines(block, &s.entries, out, &mut s.dirty_word)? {
            // The device must learn a dropped line is free before a later clean load could
            // trust its content.
            self.p.load_changed(block);
        }
        Ok(())
    }

    /// Which copy of `block` to use, and its sequence number: the newer valid one. Both
    /// damaged is corruption.
    fn pick_copy(
        &self,
        block: u64,
        count: usize,
        found: &[std::result::Result<u64, BlockError>; 2],
    ) -> Result<(usize, u64)> {
        let geometry = self.p.geometry();
        match found {
            [Ok(s0), Ok(s1)] if s1 > s0 => Ok((1, *s1)),
            [Ok(s0), _] => Ok((0, *s0)),
            [Err(_), Ok(s1)] => Ok((1, *s1)),
            [Err(e0), Err(e1)] => Err(EngineError::Corrupt(format!(
                "metadata block {block} ({}) is damaged in both copies: at byte offset {} {}, at byte offset {} {}",
                self.lines_of_block(block, count),
                geometry.slot_offset(block, 0),
                why(e0),
                geometry.slot_offset(block, 1),
                why(e1)
            ))),
        }
    }

    /// The version of `block` the last completed commit (`rec`) left: the newest copy not
    /// newer than it, whose term goes into the digest the record must match. None is
    /// corruption; a damaged copy beside it is a suspect, named if the digest does not match.
    fn committed_copy(
        &self,
        block: u64,
        count: usize,
        rec: CommitRecord,
        found: &[std::result::Result<u64, BlockError>; 2],
        crcs: &[u32; 2],
        out: &mut Decoded,
    ) -> Result<()> {
        let geometry = self.p.geometry();
        let committed = (0..2)
            .filter_map(|c| match found[c] {
                Ok(s) if s <= rec.seq => Some((s, c)),
                _ => None,
            })
            .max();
        let Some((cseq, c)) = committed else {
            let describe = |c: usize| match &found[c] {
                Ok(s) => format!("sequence {s}, from a commit that never completed"),
                Err(e) => why(e),
            };
            return Err(EngineError::Corrupt(format!(
                "metadata block {block} ({}) has no copy as of the last completed commit {}: at byte offset {} {}, at byte offset {} {}",
                self.lines_of_block(block, count),
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
        if let Some(bad) = (0..2).find(|&c| found[c].is_err()) {
            if let Err(e) = &found[bad] {
                out.suspects.push(format!(
                    "block {block} ({}): copy at byte offset {} {}, copy at byte offset {} has sequence {cseq}",
                    self.lines_of_block(block, count),
                    geometry.slot_offset(block, bad as u32),
                    why(e),
                    geometry.slot_offset(block, 1 - bad as u32),
                ));
            }
        }
        Ok(())
    }

    /// "lines a..b": the lines `block` describes, for messages.
    fn lines_of_block(&self, block: u64, count: usize) -> String {
        let epb = self.p.geometry().entries_per_block as u64;
        format!("lines {}..{}", block * epb, block * epb + count as u64)
    }

    /// Check `block`'s entries and give each mapped line its key and masks; count them in the
    /// gauges and gather their durably-dirty bits in `dirty_word`. Returns whether a line was
    /// dropped (recorded mapped, but with no sector left to trust after a crash).
    fn restore_lines(
        &self,
        block: u64,
        entries: &[Entry],
        out: &mut Decoded,
        dirty_word: &mut (u64, u64),
    ) -> Result<bool> {
        let epb = self.p.geometry().entries_per_block as u64;
        let corrupt = EngineError::Corrupt;
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
            self.check_entry(block, line, key, e)?;
            if e.dirty != 0 && line >= self.mirrored {
                // Its data would be on the primary only: the mirror never held it, and a load
                // of the mirror alone would miss it. Damage, never repaired silently.
                return Err(corrupt(format!(
                    "metadata block {block}: line {line} is dirty (core {} line {}, sectors {:#x}) but lies beyond the {} cache lines the mirror covers",
                    key.core(),
                    key.line(),
                    e.dirty,
                    self.mirrored
                )));
            }
            if e.dirty != 0 {
                let word = line as u64 / 64;
                if word != dirty_word.0 {
                    self.p.load_dirty_word(dirty_word.0, dirty_word.1);
                    *dirty_word = (word, 0);
                }
                dirty_word.1 |= 1 << (line % 64);
            }
            // After a crash, clean sectors may have been overwritten in place by writes
            // that were never committed: only dirty ones are trusted.
            let valid = if self.crashed { e.dirty } else { e.valid };
            if valid == 0 {
                changed = true;
                continue;
            }
            self.table.set_state(line, key, valid, e.dirty);
            let g = &mut out.gauges[key.core() as usize];
            g.0 += 1;
            g.1 += (e.dirty != 0) as u64;
        }
        Ok(changed)
    }

    /// A mapped entry is possible: sector masks that fit a line (dirty within valid), a core
    /// the superblock lists, a core line within that core.
    fn check_entry(&self, block: u64, line: u32, key: Key, e: &Entry) -> Result<()> {
        let corrupt = EngineError::Corrupt;
        if e.valid == 0 || e.dirty & !e.valid != 0 || e.valid & !self.full != 0 {
            return Err(corrupt(format!(
                "metadata block {block}: line {line} has impossible sector masks (valid {:#x}, dirty {:#x})",
                e.valid, e.dirty
            )));
        }
        let Some(&(_, lines_of_core)) = self.core_lines.iter().find(|c| c.0 == key.core()) else {
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
        Ok(())
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
        let epb = self.p.geometry().entries_per_block as u64;
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
                        self.p.load_changed(block);
                        continue;
                    }
                    g.0 += 1;
                    g.1 += (table.dirty(other) != 0) as u64;
                    table.unmap(other, key);
                    self.p.load_changed(other as u64 / epb);
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
    let meta_blocks = p.geometry().meta_blocks;
    let record = if version >= 2 {
        Some(last_commit(volume, sb.nonce, meta_blocks)?)
    } else {
        None
    };
    let threads = load_threads(meta_blocks);
    let mut found = decode_all(inner, p, volume, sb, line_sectors, record, threads)?;
    link_all(inner, p, threads, &found.block_seq, &mut found.gauges)?;
    if let Some(rec) = record {
        check_digest(rec, found.committed_digest, found.suspects)?;
    }
    let max_seq = found.block_seq.iter().copied().max().unwrap_or(0);
    p.load_commit_state(record.map_or(max_seq, |r| r.seq.max(max_seq)), found.terms);
    for (id, (occupancy, dirty)) in found.gauges.into_iter().enumerate() {
        inner.lines.gauges()[id].restore(occupancy, dirty);
    }
    // Lines the device may still record as dirty for a mapping that lost to a newer one wait in
    // limbo until a commit rewrites their block.
    let free = inner
        .lines
        .rebuild_lists(|table, line| match table.key(line) {
            Some(_) if table.dirty(line) != 0 => ListKind::Dirty,
            Some(_) => ListKind::Clean,
            None if p.recorded_dirty(line) => ListKind::Limbo,
            None => ListKind::Free,
        });
    inner.lines.free_lines().store(free, Ordering::Relaxed);
    Ok(())
}

/// What the first pass found in all blocks, its threads' parts joined in block order.
struct Found {
    /// The digest of the versions found for the recorded commit.
    committed_digest: u64,
    /// Blocks with a damaged copy whose other copy might be an older version than that commit
    /// left (named on refusal).
    suspects: Vec<String>,
    /// Per block, its term of the digest of the metadata as found.
    terms: Vec<u32>,
    /// Sequence of the copy each block was read from: settles a core line mapped by two lines
    /// (the newer mapping wins; the older is a leftover of a line dropped since).
    block_seq: Vec<u64>,
    /// Per core id: (lines, dirty lines) given a state.
    gauges: Vec<(u64, u64)>,
}

/// The first pass over `threads` threads: every block read, checked and decoded.
fn decode_all(
    inner: &CacheInner,
    p: &Persist,
    volume: &dyn Volume,
    sb: &Superblock,
    line_sectors: u32,
    record: Option<CommitRecord>,
    threads: usize,
) -> Result<Found> {
    let meta_blocks = p.geometry().meta_blocks;
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
        table: inner.lines.table(),
        p,
        nonce: sb.nonce,
        record,
        crashed: !sb.clean_shutdown,
        full,
        core_lines: &core_lines,
        mirrored: inner.lines.mirrored_lines(),
    };
    let parts = in_parallel(threads, |i| decode.blocks(share(meta_blocks, threads, i)));
    let mut found = Found {
        committed_digest: 0,
        suspects: Vec::new(),
        terms: Vec::with_capacity(meta_blocks as usize),
        block_seq: Vec::with_capacity(meta_blocks as usize),
        gauges: vec![(0u64, 0u64); crate::MAX_CORES as usize],
    };
    // Parts are in block order, so the first error is the one a single pass would meet first.
    for part in parts {
        let part = part?;
        found.committed_digest = found.committed_digest.wrapping_add(part.committed_digest);
        found.suspects.extend(part.suspects);
        found.terms.extend(part.terms);
        found.block_seq.extend(part.seqs);
        for (g, d) in found.gauges.iter_mut().zip(&part.gauges) {
            g.0 += d.0;
            g.1 += d.1;
        }
    }
    debug_assert_eq!(found.terms.len() as u64, meta_blocks);
    Ok(found)
}

/// The second pass over `threads` threads: every line linked into the lookup table, a core
/// line mapped twice settled by `block_seq`; the lines dropped so are taken off `gauges`.
/// Of the errors, the one at the lowest line, as a single pass would meet it first.
fn link_all(
    inner: &CacheInner,
    p: &Persist,
    threads: usize,
    block_seq: &[u64],
    gauges: &mut [(u64, u64)],
) -> Result<()> {
    let link = Link {
        table: inner.lines.table(),
        p,
        lines: inner.lines.count(),
        block_seq,
    };
    let buckets = inner.lines.table().bucket_count() as u64;
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
    match first_error {
        Some((_, e)) => Err(e),
        None => Ok(()),
    }
}

/// The versions found must be the ones the last completed commit (`rec`) left: their digest
/// is the record's, or the load is refused, naming the suspect blocks.
fn check_digest(rec: CommitRecord, committed_digest: u64, mut suspects: Vec<String>) -> Result<()> {
    if committed_digest == rec.digest {
        return Ok(());
    }
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
    Err(EngineError::Corrupt(format!(
        "the metadata does not match the last completed commit {} (commit record in slot {} at byte offset {}): {found}",
        rec.seq,
        rec.seq % 2,
        COMMIT_SLOTS[(rec.seq % 2) as usize]
    )))
}

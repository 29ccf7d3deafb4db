//! Per-cache-line metadata in RAM, as a structure of arrays.
//!
//! For every cache line: its key (which core line it holds), a hash-chain link, and two sector
//! masks (valid, dirty). The lookup table is a bucket array of chain heads with four buckets per nine
//! lines. Together with the two list links in `lists.rs` and persistence's bit per line, that is,
//! for 4 KiB lines, 8 + 4 + 1.8 + 1 + 1 + 8 + 0.2 = 24.0 bytes per line (the 0.2 includes the
//! commit digest's 4 bytes per metadata block).
//!
//! Fields are atomics only so that safe Rust can share them between threads; their consistency
//! comes from the striped locks (`locks.rs`): whoever changes a mapped line holds the stripe of
//! that line's bucket. Relaxed ordering is enough because the locks order the accesses.

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering::Relaxed};

use crate::bits::Mask;
use crate::CoreId;

/// Marks a line that is not mapped to any core line.
pub(crate) const FREE: u64 = u64::MAX;
/// End of a chain or list.
pub(crate) const NONE: u32 = u32::MAX;
/// Core lines are numbered in 44 bits (64 PiB of core at 4 KiB lines).
pub(crate) const MAX_CORE_LINES: u64 = (1 << 44) - 1;

/// A core line as stored in a cache line's key: core id in the top 12 bits, core line number in
/// the next 44. The low 8 bits are kept free (zero) for the IO class.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub(crate) struct Key(u64);

impl Key {
    pub(crate) fn new(core: CoreId, line: u64) -> Key {
        debug_assert!(line <= MAX_CORE_LINES && core < 4096);
        Key((core as u64) << 52 | line << 8)
    }
    pub(crate) fn core(self) -> CoreId {
        (self.0 >> 52) as CoreId
    }
    pub(crate) fn line(self) -> u64 {
        (self.0 >> 8) & MAX_CORE_LINES
    }
    pub(crate) fn raw(self) -> u64 {
        self.0
    }
    pub(crate) fn from_raw(raw: u64) -> Key {
        Key(raw)
    }
}

pub(crate) struct LineTable {
    keys: Box<[AtomicU64]>,
    hash_next: Box<[AtomicU32]>,
    buckets: Box<[AtomicU32]>,
    valid: Box<[AtomicU8]>,
    dirty: Box<[AtomicU8]>,
    /// Bytes of each mask per line: sectors per line / 8.
    mask_bytes: usize,
    stripe_mask: u32,
}

/// `n` values from `f`, on transparent huge pages where the kernel allows (THP is often in
/// madvise mode). Requests touch these arrays at random, one entry each: with 4 KiB pages
/// nearly every access of a large cache also misses the TLB.
pub(crate) fn atomics<T, F: Fn() -> T>(n: usize, f: F) -> Box<[T]> {
    let mut v: Vec<T> = Vec::with_capacity(n);
    advise_huge(v.as_mut_ptr().cast(), n * std::mem::size_of::<T>());
    v.extend((0..n).map(|_| f()));
    // Length equals capacity: no reallocation, so the advice stays with the memory.
    v.into_boxed_slice()
}

/// Ask for huge pages on the 2 MiB-aligned part of `[p, p + len)`, before it is first touched
/// (pages faulted in already stay small). Purely advisory: failure changes nothing.
fn advise_huge(p: *mut u8, len: usize) {
    const HUGE: usize = 2 << 20;
    if len < 2 * HUGE {
        return;
    }
    let start = (p as usize).next_multiple_of(HUGE);
    let end = (p as usize + len) / HUGE * HUGE;
    if end > start {
        // SAFETY: the range lies inside an allocation we own; MADV_HUGEPAGE only changes how
        // the kernel backs it, never its content.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

/// Ask the CPU to bring `v`'s cache line in, without waiting for it.
#[inline(always)]
fn prefetch<T>(v: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetching is a hint that never faults, and `v` is a valid reference anyway.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
            (v as *const T).cast(),
        )
    };
    #[cfg(not(target_arch = "x86_64"))]
    let _ = v;
}

/// Scratch space and results of [`LineTable::lookup_many`], reused across calls.
#[derive(Default)]
pub(crate) struct Walks {
    /// Per key, the line holding it.
    pub(crate) found: Vec<Option<u32>>,
    /// Per key, its bucket's head when the walk began (NONE for a skipped key).
    pub(crate) heads: Vec<u32>,
    /// Per key, its bucket (NONE for a skipped key).
    pub(crate) buckets: Vec<u32>,
    cursor: Vec<u32>,
}

impl LineTable {
    pub(crate) fn new(lines: u32, sectors_per_line: u32, stripes: usize) -> LineTable {
        let n = lines as usize;
        let mask_bytes = (sectors_per_line / 8) as usize;
        LineTable {
            keys: atomics(n, || AtomicU64::new(FREE)),
            hash_next: atomics(n, || AtomicU32::new(NONE)),
            // 4 buckets per 9 lines: chains average 2.25 lines, and the table stays under 2 bytes
            // a line. Never fewer buckets than stripes: keys of a small cache would otherwise all
            // share a few stripes, and a request could never evict (it holds the victim's stripe).
            buckets: atomics((n * 4 / 9).max(stripes), || AtomicU32::new(NONE)),
            valid: atomics(n * mask_bytes, || AtomicU8::new(0)),
            dirty: atomics(n * mask_bytes, || AtomicU8::new(0)),
            mask_bytes,
            stripe_mask: stripes as u32 - 1,
        }
    }

    /// RAM taken by this table, in bytes.
    pub(crate) fn bytes(&self) -> u64 {
        (self.keys.len() * 8
            + self.hash_next.len() * 4
            + self.buckets.len() * 4
            + self.valid.len()
            + self.dirty.len()) as u64
    }

    pub(crate) fn bucket(&self, key: Key) -> u32 {
        // A 64-bit mix (murmur3's finaliser) so that neighbouring core lines land in unrelated
        // buckets, then a multiply-shift to bring it into range without a division.
        let mut x = key.raw();
        x ^= x >> 33;
        x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
        x ^= x >> 33;
        x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
        x ^= x >> 33;
        ((x as u128 * self.buckets.len() as u128) >> 64) as u32
    }

    /// The stripe lock that protects the bucket (and so the line) of `key`.
    pub(crate) fn stripe(&self, key: Key) -> u32 {
        self.bucket(key) & self.stripe_mask
    }

    pub(crate) fn key(&self, line: u32) -> Option<Key> {
        match self.keys[line as usize].load(Relaxed) {
            FREE => None,
            k => Some(Key(k)),
        }
    }

    /// The raw key of `line`, [`FREE`] when unmapped.
    pub(crate) fn key_raw(&self, line: u32) -> u64 {
        self.keys[line as usize].load(Relaxed)
    }

    pub(crate) fn valid(&self, line: u32) -> Mask {
        self.load_mask(&self.valid, line)
    }

    pub(crate) fn dirty(&self, line: u32) -> Mask {
        self.load_mask(&self.dirty, line)
    }

    pub(crate) fn set_valid(&self, line: u32, mask: Mask) {
        self.store_mask(&self.valid, line, mask)
    }

    pub(crate) fn set_dirty(&self, line: u32, mask: Mask) {
        self.store_mask(&self.dirty, line, mask)
    }

    fn load_mask(&self, arr: &[AtomicU8], line: u32) -> Mask {
        let base = line as usize * self.mask_bytes;
        let mut m: Mask = 0;
        for (i, b) in arr[base..base + self.mask_bytes].iter().enumerate() {
            m |= (b.load(Relaxed) as Mask) << (8 * i);
        }
        m
    }

    fn store_mask(&self, arr: &[AtomicU8], line: u32, mask: Mask) {
        let base = line as usize * self.mask_bytes;
        for (i, b) in arr[base..base + self.mask_bytes].iter().enumerate() {
            b.store((mask >> (8 * i)) as u8, Relaxed);
        }
    }

    /// The head of `bucket`'s chain. [`LineTable::map`] pushes at the head, so a chain that
    /// gained a line since an earlier look has another head.
    pub(crate) fn bucket_head(&self, bucket: u32) -> u32 {
        self.buckets[bucket as usize].load(Relaxed)
    }

    /// [`LineTable::lookup`] of many keys at once, for a load that walks millions. One lookup
    /// of a large table is a chain of dependent DRAM misses (bucket, then each chain line's key
    /// and link), about 80% of a load's time when done one by one. Here every walk advances one
    /// step per round and prefetches its next step, so the misses of all walks overlap.
    ///
    /// For each `keys[i]` (None: skipped) it leaves in `w.found[i]` the line holding it, and in
    /// `w.heads[i]` its bucket's head as the walk found it, so a caller that changes the table
    /// between the walk and the use can tell a stale answer ([`LineTable::bucket_head`]).
    /// The caller holds every key's stripe, or owns the table alone (a load).
    pub(crate) fn lookup_many(&self, keys: &[Option<Key>], w: &mut Walks) {
        w.found.clear();
        w.found.resize(keys.len(), None);
        w.buckets.clear();
        w.buckets
            .extend(keys.iter().map(|k| k.map_or(NONE, |k| self.bucket(k))));
        for &b in &w.buckets {
            if b != NONE {
                prefetch(&self.buckets[b as usize]);
            }
        }
        w.heads.clear();
        w.heads.extend(w.buckets.iter().map(|&b| {
            if b == NONE {
                return NONE;
            }
            let head = self.buckets[b as usize].load(Relaxed);
            if head != NONE {
                prefetch(&self.keys[head as usize]);
                prefetch(&self.hash_next[head as usize]);
            }
            head
        }));
        w.cursor.clear();
        w.cursor.extend_from_slice(&w.heads);
        let mut walking = w.cursor.iter().filter(|&&c| c != NONE).count();
        while walking > 0 {
            for (i, cur) in w.cursor.iter_mut().enumerate() {
                if *cur == NONE {
                    continue;
                }
                let line = *cur as usize;
                if Some(self.keys[line].load(Relaxed)) == keys[i].map(Key::raw) {
                    w.found[i] = Some(*cur);
                    *cur = NONE;
                } else {
                    *cur = self.hash_next[line].load(Relaxed);
                    if *cur != NONE {
                        prefetch(&self.keys[*cur as usize]);
                        prefetch(&self.hash_next[*cur as usize]);
                    }
                }
                if *cur == NONE {
                    walking -= 1;
                }
            }
        }
    }

    /// The cache line holding `key`, if any. Caller holds `key`'s stripe.
    pub(crate) fn lookup(&self, key: Key) -> Option<u32> {
        let mut line = self.buckets[self.bucket(key) as usize].load(Relaxed);
        while line != NONE {
            if self.keys[line as usize].load(Relaxed) == key.raw() {
                return Some(line);
            }
            line = self.hash_next[line as usize].load(Relaxed);
        }
        None
    }

    /// Map free `line` to `key` with the given masks. Caller holds `key`'s stripe and owns `line`.
    pub(crate) fn map(&self, line: u32, key: Key, valid: Mask, dirty: Mask) {
        debug_assert!(self.key(line).is_none());
        self.set_state(line, key, valid, dirty);
        self.link(line, self.bucket(key));
    }

    /// The first half of [`LineTable::map`], for a load: give free `line` its key and masks
    /// without putting it in a chain yet, so lookups do not find it until
    /// [`LineTable::link`]. A load fills lines from many threads (each line from one) and links
    /// them later, bucket range by bucket range.
    pub(crate) fn set_state(&self, line: u32, key: Key, valid: Mask, dirty: Mask) {
        debug_assert!(valid != 0 && dirty & !valid == 0);
        self.set_valid(line, valid);
        self.set_dirty(line, dirty);
        self.keys[line as usize].store(key.raw(), Relaxed);
    }

    /// Undo [`LineTable::set_state`] of a line that was never linked.
    pub(crate) fn clear_state(&self, line: u32) {
        self.keys[line as usize].store(FREE, Relaxed);
        self.set_valid(line, 0);
        self.set_dirty(line, 0);
    }

    /// The second half of [`LineTable::map`]: put `line`, whose key is in `bucket`, at the head
    /// of that bucket's chain. Caller holds the bucket's stripe, or owns the bucket (a load).
    pub(crate) fn link(&self, line: u32, bucket: u32) {
        let head = &self.buckets[bucket as usize];
        self.hash_next[line as usize].store(head.load(Relaxed), Relaxed);
        head.store(line, Relaxed);
    }

    pub(crate) fn bucket_count(&self) -> u32 {
        self.buckets.len() as u32
    }

    /// Unmap `line` from `key`. Caller holds `key`'s stripe.
    pub(crate) fn unmap(&self, line: u32, key: Key) {
        debug_assert_eq!(self.key(line), Some(key));
        let head = &self.buckets[self.bucket(key) as usize];
        let next = self.hash_next[line as usize].load(Relaxed);
        let mut cur = head.load(Relaxed);
        if cur == line {
            head.store(next, Relaxed);
        } else {
            loop {
                assert!(cur != NONE, "line {line} missing from its hash chain");
                let link = &self.hash_next[cur as usize];
                let after = link.load(Relaxed);
                if after == line {
                    link.store(next, Relaxed);
                    break;
                }
                cur = after;
            }
        }
        self.hash_next[line as usize].store(NONE, Relaxed);
        self.keys[line as usize].store(FREE, Relaxed);
        self.set_valid(line, 0);
        self.set_dirty(line, 0);
    }

    /// Walk every chain; for tests. Returns (line, bucket) pairs.
    pub(crate) fn chained(&self) -> Vec<(u32, u32)> {
        let mut out = Vec::new();
        for (b, head) in self.buckets.iter().enumerate() {
            let mut line = head.load(Relaxed);
            while line != NONE {
                out.push((line, b as u32));
                line = self.hash_next[line as usize].load(Relaxed);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The batched walk finds exactly what one lookup at a time finds, over long chains
    /// (few buckets), absent keys and skipped entries.
    #[test]
    fn lookup_many_agrees_with_lookup() {
        let lines = 2000u32;
        let table = LineTable::new(lines, 8, 64);
        // Map every other line, to keys spread over two cores.
        for line in (0..lines).step_by(2) {
            table.map(
                line,
                Key::new(1 + (line % 2) as CoreId, line as u64 * 7),
                1,
                0,
            );
        }
        let mut keys: Vec<Option<Key>> = (0..3000u64)
            .map(|i| Some(Key::new(1 + (i % 2) as CoreId, i * 7)))
            .collect();
        keys[5] = None;
        let mut w = Walks::default();
        table.lookup_many(&keys, &mut w);
        let mut hits = 0;
        for (i, k) in keys.iter().enumerate() {
            let want = k.and_then(|k| table.lookup(k));
            assert_eq!(w.found[i], want, "key {i}");
            hits += want.is_some() as usize;
            if let Some(k) = k {
                assert_eq!(w.buckets[i], table.bucket(*k));
                assert_eq!(w.heads[i], table.bucket_head(w.buckets[i]));
            }
        }
        assert!(hits > 500, "the test maps keys it looks up ({hits})");
    }
}

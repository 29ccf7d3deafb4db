//! Sharded lists of cache lines: free, clean (in LRU order), dirty (oldest write first) and limbo.
//!
//! Every line sits in exactly one list of its shard, except while a request owns a free line it
//! has taken. Lines are spread over shards in runs of 64 so that a thread allocating from its home
//! shard gets neighbouring cache lines (large sequential writes then merge on the cache device).
//! A shard is a short mutex-protected critical section (link updates only, never IO), so the hit
//! path touches one shard lock and no global one. Lock order: a line's stripe, then its shard.
//!
//! A cache whose mirror is smaller than it (docs/format.md, "A smaller mirror") has two zones:
//! the mirrored region (lines below `zone`) and the rest, each with shards of its own, so that
//! allocation for dirty data looks in the region's shards only and fills in the others first.
//! Without a region every shard is the region's, as before.

use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering::Relaxed};

use parking_lot::{Mutex, MutexGuard};

use crate::meta::{atomics, NONE};
use crate::stats::SLOTS;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ListKind {
    Free = 0,
    Clean = 1,
    Dirty = 2,
    /// Unmapped, but the metadata on the cache device may still say dirty: reusable only once a
    /// commit has recorded it free (see `persist.rs`).
    Limbo = 3,
}

#[derive(Clone, Copy)]
struct Head {
    first: u32,
    last: u32,
    len: u64,
}

pub(crate) struct Shard {
    heads: [Head; 4],
    /// alru's age marks on the dirty list, oldest first: `(line, t)` says that the line and every
    /// line before it in the dirty list were last written at or before time `t` (ms). The dirty
    /// list is in last-write order, so a few marks give every line's age to within the marks'
    /// spacing, without a timestamp per line. Empty unless alru is the cleaning policy.
    fences: Vec<(u32, u64)>,
}

impl Shard {
    /// Forget the dirty list's age marks (a change of cleaning policy or clock).
    pub(crate) fn clear_fences(&mut self) {
        self.fences.clear();
    }

    pub(crate) fn len(&self, kind: ListKind) -> u64 {
        self.heads[kind as usize].len
    }
    pub(crate) fn first(&self, kind: ListKind) -> Option<u32> {
        match self.heads[kind as usize].first {
            NONE => None,
            l => Some(l),
        }
    }
}

/// Keeps the mutexes of different shards on different cache lines.
#[repr(align(128))]
struct Padded(Mutex<Shard>);

pub(crate) struct Lists {
    prev: Box<[AtomicU32]>,
    next: Box<[AtomicU32]>,
    shards: Box<[Padded]>,
    /// Per thread slot, the shard where its allocations last found a free line outside their
    /// home shard. A filling cache drains the free lists shard after shard; without this hint
    /// every allocation would lock each drained shard on its way (a third of a random write's
    /// time with 64 shards). One per slot, starting at the slot's home: with one shared hint
    /// every thread drained the same shard, and two threads writing at random spent a third
    /// more CPU than one on the same work, fighting over that shard's lock and list head.
    /// Only hints: a scan from one still visits every shard.
    free_cursors: Box<[Cursor]>,
    /// The first line outside the mirrored region (the line count when there is none).
    zone: u32,
    /// The shards of the mirrored region: `0..region_shards`; the rest are the other lines'.
    region_shards: usize,
}

/// Keeps each slot's cursor on its own cache line.
#[repr(align(128))]
struct Cursor(AtomicUsize);

/// The home shard of thread slot `slot` among `n`: slots spread by the golden ratio, so the
/// homes of threads that started one after the other (consecutive slots) lie far apart, and
/// their allocations, each moving on from its own home, do not meet for long.
pub(crate) fn home_of(slot: usize, n: usize) -> usize {
    let frac = (slot as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    ((frac as u128 * n as u128) >> 64) as usize
}

pub(crate) const RUN: u32 = 64;

/// The shard of `line` given the zone boundary and each zone's shard count.
#[inline]
fn shard_in(line: u32, zone: u32, region_shards: usize, shards: usize) -> usize {
    if line < zone {
        (line / RUN) as usize % region_shards
    } else {
        region_shards + ((line - zone) / RUN) as usize % (shards - region_shards)
    }
}

/// Shards for `lines` lines: enough that each holds a few runs, at most 64.
fn shards_for(lines: u32) -> usize {
    (lines.div_ceil(RUN) as usize).clamp(1, 64)
}

impl Lists {
    /// All `lines` start in the free lists. The first `region` lines are the mirrored region
    /// (`region >= lines`: no region, every line is in it).
    pub(crate) fn new(lines: u32, region: u32) -> Lists {
        let zone = region.min(lines);
        let region_shards = shards_for(zone);
        let shards = region_shards
            + if zone < lines {
                shards_for(lines - zone)
            } else {
                0
            };
        let n = lines as usize;
        let empty = Head {
            first: NONE,
            last: NONE,
            len: 0,
        };
        let mut lists = Lists {
            prev: atomics(n, || AtomicU32::new(NONE)),
            next: atomics(n, || AtomicU32::new(NONE)),
            shards: (0..shards)
                .map(|_| {
                    Padded(Mutex::new(Shard {
                        heads: [empty; 4],
                        fences: Vec::new(),
                    }))
                })
                .collect(),
            free_cursors: (0..SLOTS)
                .map(|slot| Cursor(AtomicUsize::new(home_of(slot, shards))))
                .collect(),
            zone,
            region_shards,
        };
        lists.rebuild(|_| ListKind::Free);
        lists
    }

    /// Put every line in the list `kind_of` names, in line order; returns how many are free.
    /// Takes `&mut self`: only for a cache nobody else sees yet, so no lock is needed.
    pub(crate) fn rebuild(&mut self, kind_of: impl Fn(u32) -> ListKind) -> u64 {
        let empty = Head {
            first: NONE,
            last: NONE,
            len: 0,
        };
        let Lists {
            prev,
            next,
            shards,
            zone,
            region_shards,
            ..
        } = self;
        let (zone, region_shards) = (*zone, *region_shards);
        for s in shards.iter_mut() {
            s.0.get_mut().heads = [empty; 4];
            s.0.get_mut().fences.clear();
        }
        let mut free = 0;
        for line in 0..prev.len() as u32 {
            let kind = kind_of(line);
            free += (kind == ListKind::Free) as u64;
            let shard = shard_in(line, zone, region_shards, shards.len());
            let h = &mut shards[shard].0.get_mut().heads[kind as usize];
            prev[line as usize].store(h.last, Relaxed);
            next[line as usize].store(NONE, Relaxed);
            if h.last == NONE {
                h.first = line;
            } else {
                next[h.last as usize].store(line, Relaxed);
            }
            h.last = line;
            h.len += 1;
        }
        free
    }

    pub(crate) fn bytes(&self) -> u64 {
        (self.prev.len() * 4 + self.next.len() * 4) as u64
    }

    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    pub(crate) fn shard_of(&self, line: u32) -> usize {
        shard_in(line, self.zone, self.region_shards, self.shards.len())
    }

    /// The first line outside the mirrored region (the line count when there is none).
    pub(crate) fn zone(&self) -> u32 {
        self.zone
    }

    /// The shards of the mirrored region (all of them when there is no region).
    pub(crate) fn region_shards(&self) -> std::ops::Range<usize> {
        0..self.region_shards
    }

    /// The shards of the lines outside the mirrored region (none when there is no region).
    pub(crate) fn outside_shards(&self) -> std::ops::Range<usize> {
        self.region_shards..self.shards.len()
    }

    /// Where thread slot `slot` looks for free lines after its home shard.
    pub(crate) fn free_cursor(&self, slot: usize) -> usize {
        self.free_cursors[slot % SLOTS].0.load(Relaxed) % self.shards.len()
    }

    pub(crate) fn set_free_cursor(&self, slot: usize, shard: usize) {
        self.free_cursors[slot % SLOTS].0.store(shard, Relaxed);
    }

    pub(crate) fn lock(&self, shard: usize) -> MutexGuard<'_, Shard> {
        self.shards[shard].0.lock()
    }

    pub(crate) fn next(&self, line: u32) -> Option<u32> {
        match self.next[line as usize].load(Relaxed) {
            NONE => None,
            l => Some(l),
        }
    }

    pub(crate) fn push_back(&self, s: &mut Shard, kind: ListKind, line: u32) {
        let h = &mut s.heads[kind as usize];
        self.prev[line as usize].store(h.last, Relaxed);
        self.next[line as usize].store(NONE, Relaxed);
        if h.last == NONE {
            h.first = line;
        } else {
            self.next[h.last as usize].store(line, Relaxed);
        }
        h.last = line;
        h.len += 1;
    }

    pub(crate) fn remove(&self, s: &mut Shard, kind: ListKind, line: u32) {
        let p = self.prev[line as usize].load(Relaxed);
        if kind == ListKind::Dirty && !s.fences.is_empty() {
            Self::fence_leaves(s, line, p);
        }
        let h = &mut s.heads[kind as usize];
        let n = self.next[line as usize].load(Relaxed);
        if p == NONE {
            debug_assert_eq!(h.first, line);
            h.first = n;
        } else {
            self.next[p as usize].store(n, Relaxed);
        }
        if n == NONE {
            debug_assert_eq!(h.last, line);
            h.last = p;
        } else {
            self.prev[n as usize].store(p, Relaxed);
        }
        self.prev[line as usize].store(NONE, Relaxed);
        self.next[line as usize].store(NONE, Relaxed);
        h.len -= 1;
    }

    /// A dirty line is leaving its place: a fence on it moves to the line before it (written no
    /// later), or goes when nothing is before it or an older fence already marks that line.
    fn fence_leaves(s: &mut Shard, line: u32, prev: u32) {
        let Some(i) = s.fences.iter().position(|&(l, _)| l == line) else {
            return;
        };
        if prev == NONE || (i > 0 && s.fences[i - 1].0 == prev) {
            s.fences.remove(i);
        } else {
            s.fences[i].0 = prev;
        }
    }

    /// Mark the dirty list's newest line as written at or before `now` (ms). At most `cap` marks
    /// are kept: when full, the oldest goes if the next one is itself at or before `stale` (its
    /// lines stay old enough), otherwise no mark is added (lines get the next mark's later time:
    /// cleaned a little later, never too early).
    pub(crate) fn place_fence(&self, s: &mut Shard, now: u64, stale: u64, cap: usize) {
        let Some(last) = (match s.heads[ListKind::Dirty as usize].last {
            NONE => None,
            l => Some(l),
        }) else {
            return;
        };
        if s.fences.last().is_some_and(|&(l, _)| l == last) {
            return;
        }
        if s.fences.len() >= cap {
            if s.fences.len() >= 2 && s.fences[1].1 <= stale {
                s.fences.remove(0);
            } else {
                return;
            }
        }
        s.fences.push((last, now));
    }

    /// The newest dirty line last written at or before `stale` (ms), per the fences: it and every
    /// dirty line before it are old enough to clean.
    pub(crate) fn stale_end(&self, s: &Shard, stale: u64) -> Option<u32> {
        s.fences
            .iter()
            .rev()
            .find(|&&(_, t)| t <= stale)
            .map(|&(l, _)| l)
    }

    pub(crate) fn pop_front(&self, s: &mut Shard, kind: ListKind) -> Option<u32> {
        let line = s.first(kind)?;
        self.remove(s, kind, line);
        Some(line)
    }

    /// Move `line` from list `from` to the back of list `to` (the same list: mark most recent).
    pub(crate) fn move_back(&self, s: &mut Shard, from: ListKind, to: ListKind, line: u32) {
        if from == to && s.heads[to as usize].last == line {
            // Already the newest; but a fence on it says "written at or before" a time that is
            // now past, so it moves to the line before, as when the line leaves.
            if to == ListKind::Dirty && s.fences.last().is_some_and(|&(l, _)| l == line) {
                let prev = self.prev[line as usize].load(Relaxed);
                Self::fence_leaves(s, line, prev);
            }
            return;
        }
        self.remove(s, from, line);
        self.push_back(s, to, line);
    }

    /// Lines of one list, front to back; for invariant checks.
    pub(crate) fn members(&self, s: &Shard, kind: ListKind) -> Vec<u32> {
        let mut out = Vec::new();
        let mut cur = s.first(kind);
        while let Some(line) = cur {
            out.push(line);
            cur = self.next(line);
        }
        out
    }
}

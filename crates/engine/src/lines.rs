//! The line room: the line table (which cache line holds which core line, and its valid and
//! dirty sectors), the LRU lists (free, clean, dirty, limbo) in shards, the stripe locks of core
//! lines, the per-core gauges and the free-line count; lookup, locking, line updates,
//! allocation and eviction.
//!
//! Invariants (checked together by `check_invariants`, in tests):
//! - a line's key, masks and list change only under its core line's stripe (`lock_segs`,
//!   `stripes_of`: stripes are always taken in ascending order), and its list membership only
//!   under its shard's mutex as well;
//! - dirty sectors are valid (`dirty & !valid == 0`); a line with no valid sector is unmapped;
//! - a mapped line is on the clean list when it has no dirty sector, else on the dirty list;
//!   an unmapped line is on the free list, or on the limbo list while the device may still
//!   record it dirty (`Persist::durably_dirty`);
//! - `free_lines` equals the length of the free lists; each core's gauges count its mapped
//!   and dirty lines; only this room changes them;
//! - a line with a dirty sector is never evicted (always checked: evicting it loses data), and
//!   a durably dirty line is never reused before a commit records it clean;
//! - with a mirror smaller than the cache (docs/format.md, "A smaller mirror"), no line at or
//!   beyond the mirrored region (`Lists::zone`) has a dirty sector: write-back takes lines for
//!   dirty data from the region only (`alloc_dirty_line`), a write-back write moves a clean hit
//!   beyond it into the region (`leave_unmirrored`), and turning a line beyond it dirty is
//!   refused always (`update_line`, `insert_line`: its data would be on the primary only).
//!   Fills take lines beyond the region first, so that the region stays for dirty data; on a
//!   cache brought up from a small mirror alone, whose device ends at the region, never.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use hybridcache_volume::VolumeRef;

use crate::bits::Mask;
use crate::classes::ClassState;
use crate::classes::ReqClass;
use crate::core_state::CoreGauges;
use crate::core_state::{CoreState, ACP_CHUNK_BYTES};
use crate::ioclass::{ClassId, IoClasses};
use crate::lists::ListKind;
use crate::lists::Lists;
use crate::locks::StripedLocks;
use crate::locks::{Span, StripeGuard, Stripes, WaitFor};
use crate::meta::LineTable;
use crate::meta::{Key, NONE};
use crate::persist::Persist;
use crate::policy::SeqCutoff;
use crate::prefetch::PrefetchState;
use crate::segment::{span_of, Seg, Segs};
use crate::stats::thread_slot;
use crate::stats::Usage;
use crate::{CoreId, LineSize, MAX_CORES, SECTOR};
use std::sync::atomic::AtomicU64;
fn home_shard(n: usize) -> usize {
    crate::lists::home_of(thread_slot(), n)
}

/// The line room's state. Private: the other rooms read it through the accessors below (the
/// table, lists and locks have their own narrow methods) and change lines only through this
/// room's methods.
pub(crate) struct Lines {
    line_bytes: u64,
    count: u32,
    table: LineTable,
    lists: Lists,
    locks: StripedLocks,
    /// Per-core line counts, indexed by core id, so eviction can update them without a registry
    /// lookup.
    /// Shared with the devices room, which marks a core failing when a write to it fails.
    gauges: Arc<[CoreGauges]>,
    free_lines: AtomicU64,
    classes: ClassState,
    /// Whether the cache device holds the lines beyond the mirrored region (not when it is a
    /// smaller mirror brought up alone).
    outside_usable: bool,
}

impl Lines {
    pub(crate) fn new(count: u32, line_size: LineSize) -> Lines {
        // Enough stripes that unrelated requests rarely meet, few enough to stay small.
        let stripes = (count as usize).next_power_of_two().clamp(64, 1 << 16);
        Lines {
            line_bytes: line_size.bytes() as u64,
            count,
            table: LineTable::new(count, line_size.sectors(), stripes),
            lists: Lists::new(count, count),
            locks: StripedLocks::new(stripes),
            gauges: (0..MAX_CORES).map(|_| CoreGauges::default()).collect(),
            free_lines: AtomicU64::new(count as u64),
            classes: ClassState::new(count),
            outside_usable: true,
        }
    }

    /// Keep dirty data to the first `region` lines, those a smaller mirror covers; without
    /// `outside_usable` (the device is such a mirror, brought up alone) no line beyond them is
    /// ever taken. Only before the cache is used (creation, a load before its restore): the
    /// lists start over, every line free.
    pub(crate) fn set_region(&mut self, region: u32, outside_usable: bool) {
        debug_assert!(
            self.free_lines.load(Ordering::Relaxed) == self.count as u64,
            "the region is set on an unused cache"
        );
        self.lists = Lists::new(self.count, region);
        self.outside_usable = outside_usable || region >= self.count;
        self.free_lines
            .store(self.usable_free_lines(), Ordering::Relaxed);
    }

    /// The shards whose lines the cache device holds.
    fn usable_shards(&self) -> std::ops::Range<usize> {
        if self.outside_usable {
            0..self.lists.shard_count()
        } else {
            self.lists.region_shards()
        }
    }

    /// The free lines the cache may take: the lines beyond a small mirror brought up alone
    /// stay on their free lists, never taken and not counted.
    fn usable_free_lines(&self) -> u64 {
        self.usable_shards()
            .map(|i| self.lists.lock(i).len(ListKind::Free))
            .sum()
    }

    /// The lines the mirror covers: every line without a smaller mirror.
    #[inline]
    pub(crate) fn mirrored_lines(&self) -> u32 {
        self.lists.zone()
    }

    /// How many cache lines the cache has.
    #[inline]
    pub(crate) fn count(&self) -> u32 {
        self.count
    }

    #[inline]
    pub(crate) fn table(&self) -> &LineTable {
        &self.table
    }

    #[inline]
    pub(crate) fn lists(&self) -> &Lists {
        &self.lists
    }

    /// Recovery: rebuild the lists from the restored table, each line in the list
    /// `kind_of(table, line)` names. Returns the free lines.
    pub(crate) fn rebuild_lists(&mut self, kind_of: impl Fn(&LineTable, u32) -> ListKind) -> u64 {
        let table = &self.table;
        self.lists.rebuild(|line| kind_of(table, line));
        self.usable_free_lines()
    }

    #[inline]
    pub(crate) fn locks(&self) -> &StripedLocks {
        &self.locks
    }

    #[inline]
    pub(crate) fn gauges(&self) -> &[CoreGauges] {
        &self.gauges
    }

    /// The gauges, for the devices room to mark a core failing.
    pub(crate) fn shared_gauges(&self) -> Arc<[CoreGauges]> {
        self.gauges.clone()
    }

    /// The free-line count: changed by this room and by commits that release limbo lines.
    #[inline]
    pub(crate) fn free_lines(&self) -> &AtomicU64 {
        &self.free_lines
    }

    #[inline]
    pub(crate) fn classes(&self) -> &ClassState {
        &self.classes
    }

    pub(crate) fn usage(&self, core: Option<CoreId>) -> Usage {
        let (occupancy, dirty) = match core {
            Some(id) => {
                let g = &self.gauges[id as usize];
                (g.occupancy(), g.dirty())
            }
            None => self
                .gauges
                .iter()
                .fold((0, 0), |(o, d), g| (o + g.occupancy(), d + g.dirty())),
        };
        Usage {
            line_size: self.line_bytes as u32,
            total_lines: self.count as u64,
            occupancy_lines: occupancy,
            free_lines: self.free_lines.load(Ordering::Relaxed),
            dirty_lines: dirty,
        }
    }

    #[inline]
    pub(crate) fn segments(&self, core: CoreId, offset: u64, len: u64) -> Vec<Seg> {
        let mut segs = Vec::with_capacity((len / self.line_bytes + 2) as usize);
        self.cut(core, offset, len, |s| segs.push(s));
        segs
    }

    /// [`segments`](Self::segments) without a heap allocation for a request of up to 4 lines.
    #[inline]
    pub(crate) fn segments_small(&self, core: CoreId, offset: u64, len: u64) -> Segs {
        let lines = (offset + len).div_ceil(self.line_bytes) - offset / self.line_bytes;
        let mut segs = Segs::with_capacity(lines as usize);
        self.cut(core, offset, len, |s| segs.push(s));
        segs
    }

    /// Cut a request into one segment per core line it touches, in order.
    #[inline]
    fn cut(&self, core: CoreId, offset: u64, len: u64, mut push: impl FnMut(Seg)) {
        let mut pos = offset;
        let end = offset + len;
        while pos < end {
            let line = pos / self.line_bytes;
            let in_line = pos % self.line_bytes;
            let n = (self.line_bytes - in_line).min(end - pos);
            push(Seg {
                key: Key::new(core, line),
                first: (in_line / SECTOR) as u32,
                count: (n / SECTOR) as u32,
                buf_off: (pos - offset) as usize,
                line: NONE,
                valid: 0,
                dirty: 0,
            });
            pos += n;
        }
    }

    /// Lock the stripes of `segs` (consecutive core lines of one core, at least one) once no
    /// core write in flight that `wait` names overlaps them (locks.rs).
    #[inline]
    pub(crate) fn lock_segs(&self, segs: &[Seg], wait: WaitFor) -> StripeGuard<'_> {
        self.locks
            .lock_clear(self.stripes_small(segs), span_of(segs), wait)
    }

    /// The stripes of `keys`, sorted and without duplicates: the order every locker takes them.
    #[inline]
    pub(crate) fn stripes_of(&self, keys: impl IntoIterator<Item = Key>) -> Vec<u32> {
        let mut stripes: Vec<u32> = keys.into_iter().map(|k| self.table.stripe(k)).collect();
        stripes.sort_unstable();
        stripes.dedup();
        stripes
    }

    /// [`stripes_of`](Self::stripes_of) the segments of a request, without a heap allocation
    /// for up to 16 stripes (a 64 KiB request on 4 KiB lines).
    #[inline(always)]
    pub(crate) fn stripes_small(&self, segs: &[Seg]) -> Stripes {
        if let [s] = segs {
            return smallvec::smallvec![self.table.stripe(s.key)];
        }
        self.stripes_sorted(segs)
    }

    fn stripes_sorted(&self, segs: &[Seg]) -> Stripes {
        let mut stripes = Stripes::new();
        for s in segs {
            stripes.push(self.table.stripe(s.key));
        }
        if stripes.len() > 1 {
            stripes.sort_unstable();
            stripes.dedup();
        }
        stripes
    }

    /// Fill in each segment's line and masks. Caller holds the segments' stripes.
    #[inline]
    pub(crate) fn lookup(&self, segs: &mut [Seg]) {
        for s in segs.iter_mut() {
            match self.table.lookup(s.key) {
                Some(line) => {
                    s.line = line;
                    s.valid = self.table.valid(line);
                    s.dirty = self.table.dirty(line);
                }
                None => {
                    s.line = NONE;
                    s.valid = 0;
                    s.dirty = 0;
                }
            }
        }
    }

    /// Count a line of `key` becoming dirty (+1) or clean (-1) in its acp chunk.
    #[inline]
    fn chunk_dirty(&self, key: Key, up: bool) {
        let i = key.line() * self.line_bytes / ACP_CHUNK_BYTES;
        self.gauges[key.core() as usize].chunk_dirty(i, up);
    }

    /// Size a core's acp chunk counters and count its dirty lines into them.
    pub(crate) fn rebuild_chunks(&self, id: CoreId, core_size: u64) {
        let n = core_size.div_ceil(ACP_CHUNK_BYTES) as usize;
        let counts: Box<[std::sync::atomic::AtomicU32]> = (0..n)
            .map(|_| std::sync::atomic::AtomicU32::new(0))
            .collect();
        for line in 0..self.count {
            if let Some(key) = self.table.key(line) {
                if key.core() == id && self.table.dirty(line) != 0 {
                    let i = (key.line() * self.line_bytes / ACP_CHUNK_BYTES) as usize;
                    if let Some(c) = counts.get(i) {
                        c.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
        }
        self.gauges[id as usize].set_chunks(counts);
    }

    #[inline]
    fn list_of(dirty: Mask) -> ListKind {
        if dirty == 0 {
            ListKind::Clean
        } else {
            ListKind::Dirty
        }
    }

    /// Change a mapped line's masks and keep lists and gauges in step. `touch` marks it most
    /// recently used within its list. A line left with no valid sector is unmapped and freed.
    /// Caller holds the line's stripe.
    #[inline]
    pub(crate) fn update_line(
        &self,
        persist: Option<&Persist>,
        line: u32,
        key: Key,
        valid: Mask,
        dirty: Mask,
        touch: bool,
    ) {
        debug_assert!(dirty & !valid == 0);
        self.assert_mirrored(line, dirty);
        let old_dirty = self.table.dirty(line);
        let old_valid = self.table.valid(line);
        let from = Self::list_of(old_dirty);
        let gauges = &self.gauges[key.core() as usize];
        if valid == 0 {
            self.classes
                .unmapped(gauges.classes(), line, old_dirty != 0);
            self.table.unmap(line, key);
            // The device may still map this line to `key` as dirty: it waits in limbo until a
            // commit records it free (asked after the unmap; see `Persist::durably_dirty`).
            let to = match persist {
                Some(p) => {
                    p.touch(line);
                    if p.durably_dirty(line) {
                        ListKind::Limbo
                    } else {
                        ListKind::Free
                    }
                }
                None => ListKind::Free,
            };
            let mut s = self.lists.lock(self.lists.shard_of(line));
            self.lists.move_back(&mut s, from, to, line);
            if to == ListKind::Free {
                self.free_lines.fetch_add(1, Ordering::Relaxed);
            }
            drop(s);
            gauges.occupancy_down();
            if old_dirty != 0 {
                gauges.dirty_down();
                self.chunk_dirty(key, false);
            }
            return;
        }
        self.table.set_valid(line, valid);
        self.table.set_dirty(line, dirty);
        if valid != old_valid || dirty != old_dirty {
            if let Some(p) = persist {
                p.touch(line);
            }
        }
        let to = Self::list_of(dirty);
        if from != to || touch {
            let mut s = self.lists.lock(self.lists.shard_of(line));
            self.lists.move_back(&mut s, from, to, line);
        }
        match (old_dirty != 0, dirty != 0) {
            (false, true) => {
                gauges.dirty_up();
                self.chunk_dirty(key, true);
                self.classes.dirtied(gauges.classes(), line, true);
            }
            (true, false) => {
                gauges.dirty_down();
                self.chunk_dirty(key, false);
                self.classes.dirtied(gauges.classes(), line, false);
            }
            _ => {}
        }
    }

    /// Always checked: a dirty sector beyond a smaller mirror's region would be on the primary
    /// only, and lost with it.
    #[inline]
    fn assert_mirrored(&self, line: u32, dirty: Mask) {
        assert!(
            dirty == 0 || line < self.lists.zone(),
            "line {line} beyond the mirrored region ({} lines) would turn dirty",
            self.lists.zone()
        );
    }

    /// Map an owned free line. Caller holds `key`'s stripe.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub(crate) fn insert_line(
        &self,
        persist: Option<&Persist>,
        prefetch: &PrefetchState,
        line: u32,
        key: Key,
        valid: Mask,
        dirty: Mask,
        class: Option<ReqClass>,
    ) {
        self.assert_mirrored(line, dirty);
        self.table.map(line, key, valid, dirty);
        prefetch.clear_mark(line);
        self.classes.mapped(
            self.gauges[key.core() as usize].classes(),
            line,
            class.map_or(0, |c| c.id),
            dirty != 0,
        );
        if let Some(p) = persist {
            p.touch(line);
        }
        let mut s = self.lists.lock(self.lists.shard_of(line));
        self.lists.push_back(&mut s, Self::list_of(dirty), line);
        drop(s);
        let g = &self.gauges[key.core() as usize];
        g.occupancy_up();
        if dirty != 0 {
            g.dirty_up();
            self.chunk_dirty(key, true);
        }
    }

    /// Give back an owned, unmapped line.
    #[inline]
    pub(crate) fn release_line(&self, line: u32) {
        debug_assert!(
            self.table.key(line).is_none(),
            "line {line} released while mapped"
        );
        let mut s = self.lists.lock(self.lists.shard_of(line));
        self.lists.push_back(&mut s, ListKind::Free, line);
        self.free_lines.fetch_add(1, Ordering::Relaxed);
    }

    /// Take a line for clean data (a read fill, a write-through copy): a free one, or else evict
    /// the least recently used clean line whose stripe is free right now; beyond a smaller
    /// mirror's region first, so that the region stays for dirty data. Never waits for a
    /// stripe, so it is safe while holding others.
    #[inline]
    pub(crate) fn alloc_line(
        &self,
        persist: Option<&Persist>,
        class: Option<ReqClass>,
    ) -> Option<u32> {
        let outside = self.lists.outside_shards();
        if self.outside_usable && !outside.is_empty() {
            if let Some(line) = self.alloc_in(persist, class, outside) {
                return Some(line);
            }
        }
        self.alloc_in(persist, class, self.lists.region_shards())
    }

    /// Take a line for dirty data (write-back): as `alloc_line`, but only within the mirrored
    /// region (every line without a smaller mirror). None when the region holds only dirty
    /// lines (or lines not reusable yet): the write waits for room as in a full cache.
    #[inline]
    pub(crate) fn alloc_dirty_line(
        &self,
        persist: Option<&Persist>,
        class: Option<ReqClass>,
    ) -> Option<u32> {
        let line = self.alloc_in(persist, class, self.lists.region_shards())?;
        debug_assert!(line < self.lists.zone(), "a dirty line from the region");
        Some(line)
    }

    /// A write-back write is about to make `segs` dirty: a clean line beyond the mirrored region
    /// among them is dropped (its sectors are clean, the core has them) and its segment left
    /// unmapped, so that placement gives it a line in the region as to a miss. Moving costs a
    /// cache write the write did anyway; writing it through instead would put the core's
    /// latency on the write. Caller holds the segments' stripes.
    #[inline]
    pub(crate) fn leave_unmirrored(&self, persist: Option<&Persist>, segs: &mut [Seg]) {
        let zone = self.lists.zone();
        if zone >= self.count {
            return;
        }
        for s in segs.iter_mut().filter(|s| s.mapped() && s.line >= zone) {
            assert_eq!(
                s.dirty, 0,
                "line {} beyond the mirrored region ({zone} lines) is dirty",
                s.line
            );
            self.update_line(persist, s.line, s.key, 0, 0, false);
            s.line = NONE;
            s.valid = 0;
            s.dirty = 0;
        }
    }

    /// A free line, never an evicted one; beyond the mirrored region first.
    #[inline]
    pub(crate) fn take_free_line(&self) -> Option<u32> {
        let outside = self.lists.outside_shards();
        if self.outside_usable && !outside.is_empty() {
            if let Some(line) = self.alloc_free(outside) {
                return Some(line);
            }
        }
        self.alloc_free(self.lists.region_shards())
    }

    /// A free line of the `shards`, or else an evicted clean one.
    #[inline]
    fn alloc_in(
        &self,
        persist: Option<&Persist>,
        class: Option<ReqClass>,
        shards: std::ops::Range<usize>,
    ) -> Option<u32> {
        let (base, n) = (shards.start, shards.len());
        let home = base + home_shard(n);
        if let Some(c) = class {
            // A class at its allocation replaces one of its own lines rather than grow.
            let table = self.classes.table();
            let own = self.classes.full(c);
            if !own && self.free_lines.load(Ordering::Relaxed) > 0 {
                if let Some(line) = self.alloc_free(shards.clone()) {
                    return Some(line);
                }
            }
            return (0..n).find_map(|i| {
                self.evict_from(
                    persist,
                    base + (home - base + i) % n,
                    Some((&table, c.id, own)),
                )
            });
        }
        if self.free_lines.load(Ordering::Relaxed) > 0 {
            if let Some(line) = self.alloc_free(shards) {
                return Some(line);
            }
        }
        (0..n).find_map(|i| self.evict_from(persist, base + (home - base + i) % n, None))
    }

    #[inline]
    fn alloc_free(&self, shards: std::ops::Range<usize>) -> Option<u32> {
        let (base, n) = (shards.start, shards.len());
        let home = base + home_shard(n);
        // Home first (one thread's lines stay neighbours), then every shard from the hint.
        let slot = thread_slot();
        let hint = self.lists.free_cursor(slot);
        let start = if shards.contains(&hint) { hint } else { home } - base;
        for i in 0..=n {
            let shard = if i == 0 {
                home
            } else {
                base + (start + i - 1) % n
            };
            let mut s = self.lists.lock(shard);
            if let Some(line) = self.lists.pop_front(&mut s, ListKind::Free) {
                self.free_lines.fetch_sub(1, Ordering::Relaxed);
                if i > 1 {
                    self.lists.set_free_cursor(slot, shard);
                }
                return Some(line);
            }
        }
        None
    }

    /// Evict one of the oldest clean lines of a shard. With IO classes, `classes` is (table,
    /// requesting class, own lines only): candidates are ranked by their class' eviction
    /// priority (highest number first, oldest first among equals), pinned classes' lines are
    /// left to their own class.
    fn evict_from(
        &self,
        persist: Option<&Persist>,
        shard: usize,
        classes: Option<(&IoClasses, ClassId, bool)>,
    ) -> Option<u32> {
        // Looking a little past the oldest line keeps one busy stripe from blocking eviction.
        const SCAN: usize = 16;
        let mut s = self.lists.lock(shard);
        let mut cur = s.first(ListKind::Clean);
        let mut order = [(0u16, NONE); SCAN];
        let mut candidates = 0;
        for _ in 0..SCAN {
            let Some(line) = cur else { break };
            cur = self.lists.next(line);
            order[candidates] = (0, line);
            if let Some((table, class, own)) = classes {
                if own && self.classes.class_of(line) != class {
                    continue;
                }
                match self.classes.rank(table, line, class) {
                    Some(rank) => order[candidates].0 = rank,
                    None => {
                        // Pinned for another class: send it to the back so that pinned lines
                        // gathering at the old end do not hide every other line from eviction.
                        self.lists
                            .move_back(&mut s, ListKind::Clean, ListKind::Clean, line);
                        continue;
                    }
                }
            }
            candidates += 1;
        }
        // Stable: the oldest first among lines of equal rank.
        order[..candidates].sort_by_key(|&(rank, _)| std::cmp::Reverse(rank));
        for &(_, line) in &order[..candidates] {
            let Some(key) = self.table.key(line) else {
                continue;
            };
            let Some(_stripe) = self.locks.try_lock(self.table.stripe(key)) else {
                continue;
            };
            // Holding both the shard and the stripe: the line cannot change under us, and a line
            // in the clean list with its stripe free has no dirty sector. Always checked:
            // evicting a dirty line would lose its data.
            assert_eq!(
                self.table.dirty(line),
                0,
                "line {line} on the clean list has dirty sectors"
            );
            if persist.is_some_and(|p| p.durably_dirty(line)) {
                // Cleaned, but the device does not know yet: reusing it could let a crash
                // serve another address's data as this one's.
                continue;
            }
            self.lists.remove(&mut s, ListKind::Clean, line);
            drop(s);
            self.classes
                .unmapped(self.gauges[key.core() as usize].classes(), line, false);
            self.table.unmap(line, key);
            if let Some(p) = persist {
                p.touch(line);
            }
            self.gauges[key.core() as usize].occupancy_down();
            return Some(line);
        }
        None
    }

    /// Up to `want` of the oldest dirty lines, from every shard starting at the caller's.
    pub(crate) fn oldest_dirty(&self, want: usize) -> Vec<u32> {
        let n = self.lists.shard_count();
        let home = home_shard(n);
        let mut picked = Vec::with_capacity(want);
        for i in 0..n {
            let s = self.lists.lock((home + i) % n);
            let mut cur = s.first(ListKind::Dirty);
            while let Some(line) = cur {
                if picked.len() >= want {
                    break;
                }
                // A failing core's lines cannot be cleaned; room must come from the others.
                if !self.of_failing_core(line) {
                    picked.push(line);
                }
                cur = self.lists.next(line);
            }
            if picked.len() >= want {
                break;
            }
        }
        picked
    }

    #[inline]
    pub(crate) fn touch_clean(&self, line: u32) {
        let mut s = self.lists.lock(self.lists.shard_of(line));
        self.lists
            .move_back(&mut s, ListKind::Clean, ListKind::Clean, line);
    }

    /// A core's state; its acp chunk counters are sized (and counted) here too.
    pub(crate) fn new_core_state(
        &self,
        id: CoreId,
        volume: VolumeRef,
        seq: SeqCutoff,
    ) -> Arc<CoreState> {
        self.rebuild_chunks(id, volume.size());
        self.gauges[id as usize].set_failing(false);
        Arc::new(CoreState::new(id, volume, seq))
    }

    pub(crate) fn drop_core_lines(&self, persist: Option<&Persist>, id: CoreId) {
        for line in 0..self.count {
            let Some(key) = self.table.key(line) else {
                continue;
            };
            if key.core() != id {
                continue;
            }
            let one = Span::new(key, key);
            let _lock = self
                .locks
                .lock_clear(vec![self.table.stripe(key)], one, WaitFor::All);
            // Re-check under the lock: eviction may have taken the line meanwhile.
            if self.table.key(line) == Some(key) {
                self.update_line(persist, line, key, 0, 0, false);
            }
        }
    }

    /// `persistent`: whether limbo lines may exist; `known_core`: whether a core id is attached
    /// or recorded inactive.
    pub(crate) fn check_invariants(&self, persistent: bool, known_core: &dyn Fn(CoreId) -> bool) {
        let free = self.check_lists(persistent);
        self.check_chains(free, known_core);
    }

    /// Every line is in exactly one list of its own shard, and its state is the list's (free:
    /// none; clean: mapped, valid, no dirty sector; dirty: its dirty sectors valid; limbo: only
    /// on a persistent cache). Returns the free lines, checked against the free-line count.
    fn check_lists(&self, persistent: bool) -> u64 {
        let mut seen = vec![None; self.count as usize];
        let (mut free, mut usable) = (0u64, 0u64);
        for shard in 0..self.lists.shard_count() {
            let s = self.lists.lock(shard);
            for kind in [
                ListKind::Free,
                ListKind::Clean,
                ListKind::Dirty,
                ListKind::Limbo,
            ] {
                let members = self.lists.members(&s, kind);
                assert_eq!(
                    members.len() as u64,
                    s.len(kind),
                    "shard {shard} {kind:?} length"
                );
                for line in members {
                    assert_eq!(
                        self.lists.shard_of(line),
                        shard,
                        "line {line} in a foreign shard"
                    );
                    assert!(seen[line as usize].is_none(), "line {line} in two lists");
                    seen[line as usize] = Some(kind);
                    let key = self.table.key(line);
                    let (valid, dirty) = (self.table.valid(line), self.table.dirty(line));
                    match kind {
                        ListKind::Free => {
                            free += 1;
                            usable += self.usable_shards().contains(&shard) as u64;
                            assert!(
                                key.is_none() && valid == 0 && dirty == 0,
                                "free line {line} has state"
                            );
                        }
                        ListKind::Clean => assert!(
                            key.is_some()
                                && valid != 0
                                && dirty == 0
                                && self.usable_shards().contains(&shard),
                            "clean line {line}: key {key:?} valid {valid:#x} dirty {dirty:#x}"
                        ),
                        ListKind::Dirty => assert!(
                            key.is_some()
                                && dirty != 0
                                && dirty & !valid == 0
                                && line < self.lists.zone(),
                            "dirty line {line}: valid {valid:#x} dirty {dirty:#x} (mirrored region: {} lines)",
                            self.lists.zone()
                        ),
                        ListKind::Limbo => assert!(
                            key.is_none() && valid == 0 && persistent,
                            "limbo line {line} has state"
                        ),
                    }
                }
            }
        }
        assert!(seen.iter().all(|s| s.is_some()), "a line is in no list");
        assert_eq!(
            usable,
            self.free_lines.load(Ordering::Relaxed),
            "free line count"
        );
        free
    }

    /// The hash chains hold every mapped line once, in its key's bucket, where lookup finds it;
    /// the per-core gauges count them; no line belongs to a core that is gone.
    fn check_chains(&self, free: u64, known_core: &dyn Fn(CoreId) -> bool) {
        let mut occupancy = vec![(0u64, 0u64); MAX_CORES as usize];
        let chained = self.table.chained();
        assert_eq!(
            chained.len() as u64,
            self.count as u64 - free,
            "hash chains hold every mapped line once"
        );
        for (line, bucket) in chained {
            let key = self.table.key(line).expect("chained line is mapped");
            assert_eq!(
                self.table.bucket(key),
                bucket,
                "line {line} in the wrong bucket"
            );
            assert_eq!(self.table.lookup(key), Some(line), "lookup of line {line}");
            let o = &mut occupancy[key.core() as usize];
            o.0 += 1;
            if self.table.dirty(line) != 0 {
                o.1 += 1;
            }
        }
        for (id, (occ, dirty)) in occupancy.into_iter().enumerate() {
            let g = &self.gauges[id];
            assert_eq!(g.occupancy(), occ, "core {id} occupancy");
            assert_eq!(g.dirty(), dirty, "core {id} dirty lines");
            if occ != 0 {
                let id = id as CoreId;
                assert!(known_core(id), "lines of a removed core {id}");
            }
        }
    }

    /// Whether `line` holds data of a core whose device is failing (a hint: no lock is taken).
    pub(crate) fn of_failing_core(&self, line: u32) -> bool {
        self.table
            .key(line)
            .is_some_and(|k| self.gauges[k.core() as usize].failing())
    }
}

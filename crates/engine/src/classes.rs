//! A cache's IO classes at run time: which class each request and each cache line belongs to,
//! how many lines each class holds, and per-class statistics.
//!
//! The rules themselves are parsed and evaluated by `ioclass.rs`; this module applies the
//! result (domain.md §7): a class with allocation 0 is never cached (its requests go around the
//! cache), a class at its allocation replaces its own lines instead of taking new ones, and
//! eviction takes lines of the highest eviction priority number first, never a pinned class'
//! line for another class.
//!
//! Until a class file is loaded everything is class 0 and none of this costs anything on the
//! request path (one relaxed load). The per-line class array (1 byte a line) is allocated on the
//! first load, so a cache that never uses classes keeps its RAM per line.

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering::Relaxed};
use std::sync::{Arc, OnceLock};

use parking_lot::RwLock;

use crate::ioclass::{ClassId, IoClasses, IoRequest, MAX_CLASS_ID};
use crate::meta::LineTable;
use crate::stats::{Counter, Counters};
use crate::CoreId;

const CLASSES: usize = MAX_CLASS_ID as usize + 1;

/// What the request path needs to know of a request's class.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ReqClass {
    pub(crate) id: ClassId,
    /// Lines the class may hold (allocation × cache lines); 0 = never cached.
    pub(crate) cap: u64,
}

pub(crate) struct ClassState {
    active: AtomicBool,
    table: RwLock<Arc<IoClasses>>,
    line_class: OnceLock<Box<[AtomicU8]>>,
    /// Lines of each class, and dirty lines: moved only by `mapped`, `unmapped`, `dirtied` (the
    /// line room, under the line's stripe) and `install` (recounted under every stripe).
    occupancy: [AtomicU64; CLASSES],
    dirty: [AtomicU64; CLASSES],
    lines: u32,
}

impl ClassState {
    pub(crate) fn new(lines: u32) -> ClassState {
        ClassState {
            active: AtomicBool::new(false),
            table: RwLock::new(Arc::new(IoClasses::default())),
            line_class: OnceLock::new(),
            occupancy: std::array::from_fn(|_| AtomicU64::new(0)),
            dirty: std::array::from_fn(|_| AtomicU64::new(0)),
            lines,
        }
    }

    pub(crate) fn active(&self) -> bool {
        self.active.load(Relaxed)
    }

    /// (occupancy, dirty) lines of class `id` over the whole cache.
    pub(crate) fn lines(&self, id: ClassId) -> (u64, u64) {
        (
            self.occupancy[id as usize].load(Relaxed),
            self.dirty[id as usize].load(Relaxed),
        )
    }

    pub(crate) fn table(&self) -> Arc<IoClasses> {
        self.table.read().clone()
    }

    /// Install a class table. The first time, every line mapped now is counted as class 0
    /// (what it was), cache-wide and in the gauges of its core (`core_gauges` by core id).
    pub(crate) fn install<'a>(
        &self,
        table: IoClasses,
        lines: &LineTable,
        core_gauges: impl Fn(CoreId) -> &'a CoreClassGauges,
    ) {
        if self.line_class.get().is_none() {
            let mut occ = 0;
            let mut dirty = 0;
            for line in 0..self.lines {
                let Some(key) = lines.key(line) else {
                    continue;
                };
                let d = (lines.dirty(line) != 0) as u64;
                occ += 1;
                dirty += d;
                let g = core_gauges(key.core()).get();
                g.occupancy[0].fetch_add(1, Relaxed);
                g.dirty[0].fetch_add(d, Relaxed);
            }
            self.occupancy[0].store(occ, Relaxed);
            self.dirty[0].store(dirty, Relaxed);
            let _ = self
                .line_class
                .set((0..self.lines).map(|_| AtomicU8::new(0)).collect());
        }
        *self.table.write() = Arc::new(table);
        self.active.store(true, Relaxed);
    }

    /// Go back to what was in force before an install that could not be recorded: `old`, or
    /// no class file at all.
    pub(crate) fn restore(&self, old: Option<Arc<IoClasses>>) {
        match old {
            Some(t) => *self.table.write() = t,
            None => {
                self.active.store(false, Relaxed);
                *self.table.write() = Arc::new(IoClasses::default());
            }
        }
    }

    /// The class of a request, or None while no class file is loaded.
    pub(crate) fn classify(
        &self,
        core: u16,
        offset: u64,
        len: u64,
        write: bool,
    ) -> Option<ReqClass> {
        if !self.active() {
            return None;
        }
        let table = self.table.read();
        let id = table.classify(&IoRequest {
            core_id: core,
            lba: offset / crate::SECTOR,
            size: len,
            write,
        });
        let allocation = table.get(id).map_or(100, |c| c.allocation) as u64;
        Some(ReqClass {
            id,
            cap: self.lines as u64 * allocation / 100,
        })
    }

    /// Whether the class holds as many lines as an allocation below 1.00 allows (a class
    /// allowed the whole cache competes for lines like any other).
    pub(crate) fn full(&self, c: ReqClass) -> bool {
        c.cap < self.lines as u64 && self.occupancy[c.id as usize].load(Relaxed) >= c.cap
    }

    /// Whether the class may grow by `more` lines beyond those it holds (read-ahead takes its
    /// lines before inserting any of them).
    pub(crate) fn has_room(&self, c: ReqClass, more: u64) -> bool {
        c.cap >= self.lines as u64 || self.occupancy[c.id as usize].load(Relaxed) + more < c.cap
    }

    pub(crate) fn class_of(&self, line: u32) -> ClassId {
        self.line_class
            .get()
            .map_or(0, |a| a[line as usize].load(Relaxed))
    }

    /// Eviction rank of a line for a request of class `for_class`: higher goes first; None =
    /// may not be taken (a pinned class' line, for another class).
    pub(crate) fn rank(&self, table: &IoClasses, line: u32, for_class: ClassId) -> Option<u16> {
        let c = self.class_of(line);
        match table.get(c).map(|k| k.eviction_priority) {
            Some(None) if c != for_class => None,
            Some(None) => Some(0),
            Some(Some(p)) => Some(p as u16 + 1),
            // Its class was dropped by a later load: evict it before anything else.
            None => Some(u16::MAX),
        }
    }

    /// `core` is the gauges of the core the line is mapped to: every change to a class gauge
    /// is made to the core's as well, so the cache-wide figures are the sum over cores.
    pub(crate) fn mapped(&self, core: &CoreClassGauges, line: u32, class: ClassId, dirty: bool) {
        if let Some(a) = self.line_class.get() {
            a[line as usize].store(class, Relaxed);
            let g = core.get();
            self.occupancy[class as usize].fetch_add(1, Relaxed);
            g.occupancy[class as usize].fetch_add(1, Relaxed);
            if dirty {
                self.dirty[class as usize].fetch_add(1, Relaxed);
                g.dirty[class as usize].fetch_add(1, Relaxed);
            }
        }
    }

    pub(crate) fn unmapped(&self, core: &CoreClassGauges, line: u32, was_dirty: bool) {
        if let Some(a) = self.line_class.get() {
            let c = a[line as usize].load(Relaxed) as usize;
            let g = core.get();
            dec(&self.occupancy[c]);
            dec(&g.occupancy[c]);
            if was_dirty {
                dec(&self.dirty[c]);
                dec(&g.dirty[c]);
            }
        }
    }

    pub(crate) fn dirtied(&self, core: &CoreClassGauges, line: u32, up: bool) {
        if let Some(a) = self.line_class.get() {
            let c = a[line as usize].load(Relaxed) as usize;
            let g = core.get();
            if up {
                self.dirty[c].fetch_add(1, Relaxed);
                g.dirty[c].fetch_add(1, Relaxed);
            } else {
                dec(&self.dirty[c]);
                dec(&g.dirty[c]);
            }
        }
    }

    /// Count `n` on the request's class in `core`'s counters (the core the request was
    /// addressed to). A class' cache-wide counters are the sum over cores, as in OCF: one
    /// counter per event, in the counting thread's slot.
    pub(crate) fn count(
        &self,
        core: &CoreClassCounters,
        class: Option<ReqClass>,
        c: Counter,
        n: u64,
    ) {
        if let Some(class) = class {
            core.get(class.id).add(c, n);
        }
    }

    /// Count `n` on the class `line` belongs to (work that is not a client request, such as
    /// cleaning, has no request class).
    pub(crate) fn count_line(&self, core: &CoreClassCounters, line: u32, c: Counter, n: u64) {
        if self.line_class.get().is_some() {
            core.get(self.class_of(line)).add(c, n);
        }
    }

    /// RAM of the per-line class array (allocated on the first class load).
    pub(crate) fn bytes(&self) -> u64 {
        self.line_class.get().map_or(0, |a| a.len() as u64)
    }
}

/// One core's lines by class: what `-P -j CORE -d` shows as the class' occupancy and dirty.
pub(crate) struct ClassGauges {
    occupancy: [AtomicU64; CLASSES],
    dirty: [AtomicU64; CLASSES],
}

/// A core's class gauges, kept by core id beside its other line gauges (so an inactive core's
/// lines are counted too). Allocated the first time a line of the core is counted while a class
/// file is loaded: `CLASSES` × 2 × 8 = 544 bytes a core; 16 bytes while unused.
#[derive(Default)]
pub(crate) struct CoreClassGauges(OnceLock<Box<ClassGauges>>);

impl CoreClassGauges {
    fn get(&self) -> &ClassGauges {
        self.0.get_or_init(|| {
            Box::new(ClassGauges {
                occupancy: std::array::from_fn(|_| AtomicU64::new(0)),
                dirty: std::array::from_fn(|_| AtomicU64::new(0)),
            })
        })
    }

    /// (occupancy, dirty) lines of class `id`.
    pub(crate) fn lines(&self, id: ClassId) -> (u64, u64) {
        self.0.get().map_or((0, 0), |g| {
            (
                g.occupancy[id as usize].load(Relaxed),
                g.dirty[id as usize].load(Relaxed),
            )
        })
    }
}

/// A core's request and block counters by class, sharded per thread slot like every counter
/// (stats.rs), so the request path adds no shared atomic. A class' counters (16 slots of 256
/// bytes, 4 KiB) are allocated the first time the core counts a request of that class; the
/// table itself is `CLASSES` × 24 = 816 bytes a core.
pub(crate) struct CoreClassCounters(Box<[OnceLock<Counters>]>);

impl Default for CoreClassCounters {
    fn default() -> Self {
        CoreClassCounters((0..CLASSES).map(|_| OnceLock::new()).collect())
    }
}

impl CoreClassCounters {
    fn get(&self, id: ClassId) -> &Counters {
        self.0[id as usize].get_or_init(Counters::new)
    }

    pub(crate) fn counters(&self, id: ClassId) -> Option<&Counters> {
        self.0.get(id as usize).and_then(|c| c.get())
    }

    pub(crate) fn reset(&self) {
        for c in self.0.iter().filter_map(|c| c.get()) {
            c.reset();
        }
    }
}

/// Gauges are exact while the request path and the first install do not race; if they do, a
/// line may be counted in the wrong class once. Never wrap below zero because of it.
fn dec(a: &AtomicU64) {
    let _ = a.fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(1)));
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The RAM docs/io-classes.md states per core: 16 bytes by core id until a line of the
    /// core is counted in a class, then 544; 816 bytes of counter table per attached core, and
    /// 4 KiB of counters per class it counts a request of.
    #[test]
    fn per_core_class_statistics_memory() {
        assert_eq!(std::mem::size_of::<CoreClassGauges>(), 16);
        assert_eq!(std::mem::size_of::<ClassGauges>(), 544);
        assert_eq!(CLASSES * std::mem::size_of::<OnceLock<Counters>>(), 816);
        assert_eq!(Counters::new().bytes(), 4096);
    }
}

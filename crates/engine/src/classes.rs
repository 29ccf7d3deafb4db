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
    pub(crate) occupancy: [AtomicU64; CLASSES],
    pub(crate) dirty: [AtomicU64; CLASSES],
    counters: OnceLock<Box<[Counters]>>,
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
            counters: OnceLock::new(),
            lines,
        }
    }

    pub(crate) fn active(&self) -> bool {
        self.active.load(Relaxed)
    }

    pub(crate) fn table(&self) -> Arc<IoClasses> {
        self.table.read().clone()
    }

    /// Install a class table. The first time, every line mapped now is counted as class 0
    /// (what it was).
    pub(crate) fn install(&self, table: IoClasses, lines: &LineTable) {
        if self.line_class.get().is_none() {
            let mut occ = 0;
            let mut dirty = 0;
            for line in 0..self.lines {
                occ += lines.key(line).is_some() as u64;
                dirty += (lines.dirty(line) != 0) as u64;
            }
            self.occupancy[0].store(occ, Relaxed);
            self.dirty[0].store(dirty, Relaxed);
            let _ = self
                .line_class
                .set((0..self.lines).map(|_| AtomicU8::new(0)).collect());
            let _ = self
                .counters
                .set((0..CLASSES).map(|_| Counters::new()).collect());
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

    pub(crate) fn mapped(&self, line: u32, class: ClassId, dirty: bool) {
        if let Some(a) = self.line_class.get() {
            a[line as usize].store(class, Relaxed);
            self.occupancy[class as usize].fetch_add(1, Relaxed);
            if dirty {
                self.dirty[class as usize].fetch_add(1, Relaxed);
            }
        }
    }

    pub(crate) fn unmapped(&self, line: u32, was_dirty: bool) {
        if let Some(a) = self.line_class.get() {
            let c = a[line as usize].load(Relaxed) as usize;
            dec(&self.occupancy[c]);
            if was_dirty {
                dec(&self.dirty[c]);
            }
        }
    }

    pub(crate) fn dirtied(&self, line: u32, up: bool) {
        if let Some(a) = self.line_class.get() {
            let c = a[line as usize].load(Relaxed) as usize;
            if up {
                self.dirty[c].fetch_add(1, Relaxed);
            } else {
                dec(&self.dirty[c]);
            }
        }
    }

    pub(crate) fn count(&self, class: Option<ReqClass>, c: Counter, n: u64) {
        if let (Some(class), Some(counters)) = (class, self.counters.get()) {
            counters[class.id as usize].add(c, n);
        }
    }

    /// Count `n` on the class `line` belongs to (work that is not a client request, such as
    /// cleaning, has no request class).
    pub(crate) fn count_line(&self, line: u32, c: Counter, n: u64) {
        if let Some(counters) = self.counters.get() {
            counters[self.class_of(line) as usize].add(c, n);
        }
    }

    pub(crate) fn counters(&self, id: ClassId) -> Option<&Counters> {
        self.counters.get().and_then(|c| c.get(id as usize))
    }

    /// RAM of the per-line class array (allocated on the first class load).
    pub(crate) fn bytes(&self) -> u64 {
        self.line_class.get().map_or(0, |a| a.len() as u64)
    }

    pub(crate) fn reset(&self) {
        if let Some(cs) = self.counters.get() {
            for c in cs.iter() {
                c.reset();
            }
        }
    }
}

/// Gauges are exact while the request path and the first install do not race; if they do, a
/// line may be counted in the wrong class once. Never wrap below zero because of it.
fn dec(a: &AtomicU64) {
    let _ = a.fetch_update(Relaxed, Relaxed, |v| Some(v.saturating_sub(1)));
}

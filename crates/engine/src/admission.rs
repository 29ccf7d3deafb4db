//! Admission: whether a request's data enters the cache at all. Sequential cutoff sends
//! streams around the cache; promotion (nhit) declines lines not yet accessed often enough
//! once the cache fills. The mode itself is read by the request path (`CacheInner::mode`).
//!
//! Invariants: both decisions are made once per request, under its stripes for promotion (a
//! retry after making room does not count the accesses again); neither changes any line.

use std::sync::atomic::Ordering;

use crate::core_state::CoreState;
use crate::inner::CacheInner;
use crate::lines::Lines;
use crate::policy::{PromotionPolicy, PromotionState};
use crate::segment::Seg;

/// What admission looks at, by reference: the line room's free-line count and size, and
/// promotion's parameters and access table. Built per request for free (three references).
pub(crate) struct Admission<'a> {
    lines: &'a Lines,
    promotion: &'a PromotionState,
    line_bytes: u64,
}

impl CacheInner {
    /// Admission's view of this cache.
    #[inline]
    pub(crate) fn admission(&self) -> Admission<'_> {
        Admission {
            lines: &self.lines,
            promotion: &self.promotion,
            line_bytes: self.line_bytes,
        }
    }
}

impl Admission<'_> {
    /// Whether sequential cutoff sends this request around the cache (and records it in the
    /// core's streams).
    #[inline]
    pub(crate) fn cut_off(&self, core: &CoreState, offset: u64, len: u64, write: bool) -> bool {
        core.seq().cut_off(offset, len, write, || {
            // "Nearly full", as Open CAS: free lines at most 512 plus the lines this request
            // touches.
            let need = (offset + len).div_ceil(self.line_bytes) - offset / self.line_bytes;
            self.lines.free_lines().load(Ordering::Relaxed) <= 512 + need
        })
    }

    /// Whether nhit declines to insert the request's unmapped lines: some has not yet been
    /// accessed `threshold` times, and occupancy has passed `trigger`. Every unmapped line's
    /// access is counted, so the counts grow before the trigger is reached too.
    #[inline]
    pub(crate) fn promotion_declines(&self, segs: &[Seg]) -> bool {
        let p = self.promotion.params();
        if p.policy != PromotionPolicy::Nhit {
            return false;
        }
        let Some(table) = self.promotion.table() else {
            return false;
        };
        let mut short = false;
        for s in segs.iter().filter(|s| !s.mapped()) {
            short |= table.access(s.key.raw()) < p.threshold;
        }
        if !short {
            return false;
        }
        let occupied = (self.lines.count() as u64)
            .saturating_sub(self.lines.free_lines().load(Ordering::Relaxed));
        occupied * 100 >= p.trigger_pct as u64 * self.lines.count() as u64
    }
}

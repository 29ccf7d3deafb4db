//! Fallback pass-through: a cache device that keeps failing stops taking new I/O. As Open
//! CAS's `fallback_pt_error_threshold` (0 = off, up to 1,000,000 errors) and bcache's
//! `io_error_limit`/`io_error_halflife`: once the cache device's errors within a window reach
//! the threshold, every new request of a cache without a mirror is served pass-through (a
//! mirrored cache has its own degraded states, mirror.rs). The configured mode stays; only the
//! mode served changes, until the counters are reset or the threshold is raised above the
//! errors counted.
//!
//! Dirty data exists only on the cache device: the fallback still reads it from there, and a
//! dirty range whose read fails is recorded (core, core offset, length), once, so the operator
//! learns which data is lost (`unreadable_dirty`, drained by the daemon into its log).
//!
//! Invariants: `active` is set only by an error that brings the window's count to the
//! threshold (or a threshold lowered to at most the count), and cleared only by `reset` or a
//! threshold above the count; the window holds at most `threshold` instants.

use std::collections::{BTreeMap, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::bits::{self, Mask};
use crate::{CoreId, EngineError, Result, SECTOR};

/// The most errors a threshold may ask for (Open CAS's limit).
pub const MAX_THRESHOLD: u32 = 1_000_000;
/// The longest window: a week.
pub const MAX_WINDOW_S: u32 = 7 * 24 * 3600;

/// Fallback pass-through's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct FallbackPt {
    /// Cache-device errors within the window that turn the cache to pass-through; 0 turns the
    /// fallback off (Open CAS's default).
    pub threshold: u32,
    /// Seconds an error counts for; 0 counts errors until the counters are reset (as Open CAS,
    /// which has no window).
    pub window_s: u32,
}

impl Default for FallbackPt {
    /// Off, with a 10-minute window once a threshold is set: a burst of transient errors
    /// (a reset link, a few bad sectors remapped) ages out, while a device failing a steady
    /// share of its I/O reaches any sensible threshold well within ten minutes.
    fn default() -> Self {
        FallbackPt {
            threshold: 0,
            window_s: 600,
        }
    }
}

impl FallbackPt {
    pub fn validate(&self) -> Result<()> {
        if self.threshold > MAX_THRESHOLD {
            return Err(EngineError::Invalid(format!(
                "fallback-pt threshold {} is out of range (0..{MAX_THRESHOLD}; 0 turns it off)",
                self.threshold
            )));
        }
        if self.window_s > MAX_WINDOW_S {
            return Err(EngineError::Invalid(format!(
                "fallback-pt window {} s is out of range (0..{MAX_WINDOW_S}; 0 never forgets)",
                self.window_s
            )));
        }
        Ok(())
    }
}

/// What `-P`/`-L` show of the fallback.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FallbackStatus {
    pub params: FallbackPt,
    /// The cache serves every new request pass-through.
    pub active: bool,
    /// Cache-device errors counted in the window now (0 while the fallback is off).
    pub errors: u64,
    /// Dirty lines with at least one sector whose read from the cache device failed, and
    /// those sectors' bytes, since the last reset.
    pub unreadable_dirty_lines: u64,
    pub unreadable_dirty_bytes: u64,
}

/// A dirty range whose read from the cache device failed: its data is nowhere else.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnreadableDirty {
    pub core: CoreId,
    pub core_offset: u64,
    pub len: u64,
}

#[derive(Default)]
struct Unreadable {
    /// Per (core, core line): the sectors found unreadable.
    sectors: BTreeMap<(CoreId, u64), Mask>,
    /// Found since the last `take_unreadable`.
    fresh: Vec<UnreadableDirty>,
}

pub(crate) struct FallbackState {
    params: Mutex<FallbackPt>,
    active: AtomicBool,
    /// When each error in the window happened, oldest first.
    errors: Mutex<VecDeque<Instant>>,
    /// The error count that last made the cache fall back, until reported (`take_entered`).
    entered: Mutex<Option<u64>>,
    unreadable: Mutex<Unreadable>,
}

impl FallbackState {
    pub(crate) fn new() -> FallbackState {
        FallbackState {
            params: Mutex::new(FallbackPt::default()),
            active: AtomicBool::new(false),
            errors: Mutex::new(VecDeque::new()),
            entered: Mutex::new(None),
            unreadable: Mutex::new(Unreadable::default()),
        }
    }

    #[inline]
    pub(crate) fn active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    pub(crate) fn params(&self) -> FallbackPt {
        *self.params.lock()
    }

    /// New settings: a threshold at or below the errors in the window enters the fallback, one
    /// above them (or 0) leaves it.
    pub(crate) fn set_params(&self, p: FallbackPt) {
        *self.params.lock() = p;
        let mut errors = self.errors.lock();
        expire(&mut errors, p.window_s, Instant::now());
        while errors.len() > p.threshold as usize {
            errors.pop_front();
        }
        let reached = p.threshold > 0 && errors.len() >= p.threshold as usize;
        self.active.store(reached, Ordering::Relaxed);
    }

    /// One error of the cache device. Returns the count in the window when this error made the
    /// cache fall back (once), for the caller to report.
    pub(crate) fn error(&self) -> Option<u64> {
        let p = self.params();
        if p.threshold == 0 {
            return None;
        }
        let mut errors = self.errors.lock();
        let now = Instant::now();
        expire(&mut errors, p.window_s, now);
        if errors.len() >= p.threshold as usize {
            errors.pop_front();
        }
        errors.push_back(now);
        let reached = errors.len() >= p.threshold as usize;
        let entered =
            (reached && !self.active.swap(true, Ordering::Relaxed)).then_some(errors.len() as u64);
        if entered.is_some() {
            *self.entered.lock() = entered;
        }
        entered
    }

    /// The error count with which the cache last fell back, once (for the log).
    pub(crate) fn take_entered(&self) -> Option<u64> {
        self.entered.lock().take()
    }

    /// Forget the errors and the unreadable ranges found: the cache caches again.
    pub(crate) fn reset(&self) {
        self.errors.lock().clear();
        self.active.store(false, Ordering::Relaxed);
        *self.unreadable.lock() = Unreadable::default();
    }

    pub(crate) fn status(&self) -> FallbackStatus {
        let params = self.params();
        let errors = {
            let mut e = self.errors.lock();
            expire(&mut e, params.window_s, Instant::now());
            e.len() as u64
        };
        let u = self.unreadable.lock();
        let sectors: u64 = u.sectors.values().map(|m| m.count_ones() as u64).sum();
        FallbackStatus {
            params,
            active: self.active(),
            errors,
            unreadable_dirty_lines: u.sectors.len() as u64,
            unreadable_dirty_bytes: sectors * SECTOR,
        }
    }

    /// Record the dirty range `core_offset .. + len` of core `core` (within one or more cache
    /// lines of `line_bytes`) as unreadable; sectors already recorded are not again.
    pub(crate) fn unreadable(&self, core: CoreId, core_offset: u64, len: u64, line_bytes: u64) {
        let mut u = self.unreadable.lock();
        let (mut at, end) = (core_offset, core_offset + len);
        while at < end {
            let line = at / line_bytes;
            let in_line = at % line_bytes;
            let n = (line_bytes - in_line).min(end - at);
            let mask = bits::range((in_line / SECTOR) as u32, (n / SECTOR) as u32);
            let known = u.sectors.entry((core, line)).or_insert(0);
            let new = mask & !*known;
            *known |= new;
            for (first, count) in bits::runs(new) {
                u.fresh.push(UnreadableDirty {
                    core,
                    core_offset: line * line_bytes + first as u64 * SECTOR,
                    len: count as u64 * SECTOR,
                });
            }
            at += n;
        }
    }

    /// The unreadable dirty ranges found since the last call, for the log.
    pub(crate) fn take_unreadable(&self) -> Vec<UnreadableDirty> {
        std::mem::take(&mut self.unreadable.lock().fresh)
    }
}

fn expire(errors: &mut VecDeque<Instant>, window_s: u32, now: Instant) {
    if window_s == 0 {
        return;
    }
    let window = Duration::from_secs(window_s as u64);
    while errors
        .front()
        .is_some_and(|t| now.duration_since(*t) >= window)
    {
        errors.pop_front();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unreadable_sectors_are_counted_once_per_line() {
        let f = FallbackState::new();
        f.unreadable(1, 4096, 8192, 4096);
        f.unreadable(1, 4096 + 512, 512, 4096);
        let s = f.status();
        assert_eq!(
            (s.unreadable_dirty_lines, s.unreadable_dirty_bytes),
            (2, 8192)
        );
        assert_eq!(f.take_unreadable().len(), 2);
        assert!(f.take_unreadable().is_empty());
    }

    #[test]
    fn the_threshold_trips_once_and_a_higher_one_leaves() {
        let f = FallbackState::new();
        f.set_params(FallbackPt {
            threshold: 3,
            window_s: 0,
        });
        assert_eq!((f.error(), f.error()), (None, None));
        assert_eq!(f.error(), Some(3));
        assert_eq!(f.error(), None);
        assert!(f.active());
        f.set_params(FallbackPt {
            threshold: 5,
            window_s: 0,
        });
        assert!(!f.active());
    }
}

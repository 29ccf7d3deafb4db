//! Flush progress: how much of the dirty data a running flush (`-F`, a mode switch that flushes,
//! a stop) has written, for `-L`/`-P` ("Flushing (42 %)") and `-F`'s progress bar, and a way to
//! interrupt it without harm (the lines not yet cleaned simply stay dirty).
//!
//! The count moves as each core write of the flush completes (a few lines, or one), not once per
//! batch of thousands: a batch over a slow core takes minutes, and a count that stood still
//! through it made an interrupted flush report "0.0 %" after having cleaned 40% (issue 30). The
//! counters are atomics, added to by the flush's worker threads; the rest is behind a mutex,
//! touched when flushes begin and end. The request path never touches this.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::CacheMode;

/// A snapshot of the flushes running on a cache.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlushStatus {
    /// Dirty lines the running flushes set out to clean.
    pub total_lines: u64,
    /// Of those, lines done so far: cleaned by the flushes, or found clean already (cleaned by
    /// something else meanwhile).
    pub done_lines: u64,
    /// Of those, lines the running flushes wrote to their core and marked clean.
    pub cleaned_lines: u64,
    /// Since the first of the running flushes began.
    pub elapsed: Duration,
    /// Set while a mode switch flushes: (from, to).
    pub mode_change: Option<(CacheMode, CacheMode)>,
}

impl FlushStatus {
    /// Percent done, 0..=100.
    pub fn percent(&self) -> f64 {
        if self.total_lines == 0 {
            return 100.0;
        }
        (self.done_lines.min(self.total_lines) as f64 * 100.0) / self.total_lines as f64
    }
}

struct Running {
    flushes: u32,
    total: u64,
    started: Instant,
    mode_change: Option<(CacheMode, CacheMode)>,
}

#[derive(Default)]
pub(crate) struct FlushProgress {
    running: Mutex<Option<Running>>,
    /// Lines cleaned by the running flushes; zeroed when the first of them begins.
    cleaned: AtomicU64,
    /// Lines of their batches the running flushes found clean already.
    skipped: AtomicU64,
    cancel: AtomicBool,
}

/// Ends the flush it was begun for when dropped (also on an error or an interruption).
pub(crate) struct FlushGuard<'a>(&'a FlushProgress);

impl Drop for FlushGuard<'_> {
    fn drop(&mut self) {
        let mut r = self.0.running.lock();
        if let Some(run) = r.as_mut() {
            run.flushes -= 1;
            if run.flushes == 0 {
                *r = None;
                // An interruption applies to the flushes it found running, not to later ones.
                self.0.cancel.store(false, Ordering::SeqCst);
            }
        }
    }
}

impl FlushProgress {
    /// A flush of `lines` dirty lines begins.
    pub(crate) fn begin(&self, lines: u64) -> FlushGuard<'_> {
        let mut r = self.running.lock();
        match r.as_mut() {
            Some(run) => {
                run.flushes += 1;
                run.total += lines;
            }
            None => {
                // No flush runs, so no worker of one adds to the counters now.
                self.cleaned.store(0, Ordering::Relaxed);
                self.skipped.store(0, Ordering::Relaxed);
                *r = Some(Running {
                    flushes: 1,
                    total: lines,
                    started: Instant::now(),
                    mode_change: None,
                })
            }
        }
        FlushGuard(self)
    }

    /// A core write of a flush completed: `lines` lines are clean.
    pub(crate) fn cleaned(&self, lines: u64) {
        self.cleaned.fetch_add(lines, Ordering::Relaxed);
    }

    /// A batch of a flush ended with `lines` of its lines clean without the flush's writes.
    pub(crate) fn skipped(&self, lines: u64) {
        self.skipped.fetch_add(lines, Ordering::Relaxed);
    }

    pub(crate) fn set_mode_change(&self, change: Option<(CacheMode, CacheMode)>) {
        if let Some(run) = self.running.lock().as_mut() {
            run.mode_change = change;
        }
    }

    pub(crate) fn status(&self) -> Option<FlushStatus> {
        self.running.lock().as_ref().map(|run| {
            let cleaned = self.cleaned.load(Ordering::Relaxed);
            FlushStatus {
                total_lines: run.total,
                done_lines: cleaned + self.skipped.load(Ordering::Relaxed),
                cleaned_lines: cleaned,
                elapsed: run.started.elapsed(),
                mode_change: run.mode_change,
            }
        })
    }

    /// Ask the running flushes to stop once their core writes in flight complete; false if
    /// none runs.
    pub(crate) fn interrupt(&self) -> bool {
        let running = self.running.lock().is_some();
        if running {
            self.cancel.store(true, Ordering::SeqCst);
        }
        running
    }

    pub(crate) fn interrupted(&self) -> bool {
        self.cancel.load(Ordering::SeqCst)
    }

    /// The error an interrupted flush returns, with what the running flushes cleaned.
    pub(crate) fn interrupted_error(&self) -> crate::EngineError {
        let (cleaned_lines, total_lines) = self
            .status()
            .map_or((0, 0), |s| (s.cleaned_lines, s.total_lines));
        crate::EngineError::FlushInterrupted {
            cleaned_lines,
            total_lines,
        }
    }
}

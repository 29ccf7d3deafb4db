//! Flush progress: how much of the dirty data a running flush (`-F`, a mode switch that flushes,
//! a stop) has written, for `-L`/`-P` ("Flushing (42 %)") and `-F`'s progress bar, and a way to
//! interrupt it between batches without harm (the lines not yet cleaned simply stay dirty).
//!
//! Flushes are rare and long, so a mutex is fine here; the request path never touches this.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use crate::CacheMode;

/// A snapshot of the flushes running on a cache.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FlushStatus {
    /// Dirty lines the running flushes set out to clean.
    pub total_lines: u64,
    /// Of those, lines cleaned so far.
    pub done_lines: u64,
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
    done: u64,
    started: Instant,
    mode_change: Option<(CacheMode, CacheMode)>,
}

#[derive(Default)]
pub(crate) struct FlushProgress {
    running: Mutex<Option<Running>>,
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
                *r = Some(Running {
                    flushes: 1,
                    total: lines,
                    done: 0,
                    started: Instant::now(),
                    mode_change: None,
                })
            }
        }
        FlushGuard(self)
    }

    pub(crate) fn advance(&self, lines: u64) {
        if let Some(run) = self.running.lock().as_mut() {
            run.done += lines;
        }
    }

    pub(crate) fn set_mode_change(&self, change: Option<(CacheMode, CacheMode)>) {
        if let Some(run) = self.running.lock().as_mut() {
            run.mode_change = change;
        }
    }

    pub(crate) fn status(&self) -> Option<FlushStatus> {
        self.running.lock().as_ref().map(|run| FlushStatus {
            total_lines: run.total,
            done_lines: run.done,
            elapsed: run.started.elapsed(),
            mode_change: run.mode_change,
        })
    }

    /// Ask the running flushes to stop after their current batch; false if none runs.
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
}

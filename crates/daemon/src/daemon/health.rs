//! Background work that no client waits for: device errors of cleaning and prefetch
//! (read-ahead), and cleaning that has stalled. A client's failed request is logged where it
//! fails (export.rs); these would otherwise only be counted. The engine keeps a count and the
//! last error of each kind of work, and whether its cleaning policy has cleaning due; the device
//! watcher's thread looks once a second (watch.rs) and logs what changed since its last look, so
//! the log gets at most one line per cache and kind of error a second however fast a device
//! fails.

use std::collections::HashMap;
use std::time::Duration;

use hybridcache_engine::{BackgroundErrors, CleaningPolicy, DeviceFault};

use super::Daemon;

/// Seconds of due cleaning without progress before a stall is logged, unless the daemon is
/// told otherwise (`--cleaning-stall-warn`).
pub const DEFAULT_STALL_WARN_S: u64 = 30;

/// What the watcher remembers per cache between looks.
#[derive(Default)]
pub(super) struct Health {
    caches: HashMap<u16, CacheHealth>,
}

#[derive(Default)]
struct CacheHealth {
    /// Errors of each kind of background work already logged.
    cleaning_errors: u64,
    prefetch_errors: u64,
    stall: StallWatch,
}

/// One look at a cache's cleaning.
#[derive(Debug, Clone, Copy)]
pub(crate) struct CleaningLook {
    pub dirty_lines: u64,
    /// The cleaning policy is not nop.
    pub policy_cleans: bool,
    /// The policy has nothing due (engine `CleaningStats::waiting`).
    pub waiting: bool,
    pub cleaned_lines: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum StallEvent {
    /// Cleaning has been due this long without cleaning a line.
    Stalled(Duration),
    /// A stall reported before has ended (lines were cleaned, or none are due any more)
    /// after lasting this long.
    Resumed(Duration),
}

/// Tells a cleaning stall (due, and nothing cleaned for `warn_after`) from a policy that waits,
/// from looks at times the caller gives, so tests need no clock.
#[derive(Debug, Default)]
pub(crate) struct StallWatch {
    cleaned: u64,
    /// Since when cleaning has been due without progress.
    due_since: Option<Duration>,
    /// When the stall now reported began.
    reported: Option<Duration>,
}

impl StallWatch {
    pub(crate) fn look(
        &mut self,
        now: Duration,
        look: CleaningLook,
        warn_after: Duration,
    ) -> Option<StallEvent> {
        let progress = look.cleaned_lines != self.cleaned;
        self.cleaned = look.cleaned_lines;
        let due = look.dirty_lines > 0 && look.policy_cleans && !look.waiting;
        self.due_since = match (due, progress) {
            (false, _) => None,
            (true, true) => Some(now),
            (true, false) => Some(self.due_since.unwrap_or(now)),
        };
        if progress || !due {
            return self
                .reported
                .take()
                .map(|began| StallEvent::Resumed(now.saturating_sub(began)));
        }
        let since = self.due_since?;
        if self.reported.is_none() && now.saturating_sub(since) >= warn_after {
            self.reported = Some(since);
            return Some(StallEvent::Stalled(now - since));
        }
        None
    }
}

/// "core 1: write failed on DEVICE at offset X length Y: WHY".
pub(crate) fn fault_text(f: &DeviceFault) -> String {
    format!(
        "core {}: {}",
        f.core,
        crate::export::device_failure(&f.op, &f.device, f.offset, f.len, &f.error)
    )
}

/// Log the errors of `work` since `seen`, one line for all of them.
fn log_new_errors(cache: u16, work: &str, errors: &BackgroundErrors, seen: &mut u64) {
    if errors.count <= *seen {
        // Fewer than seen: a new cache object under the same id (stopped and started again).
        *seen = errors.count;
        return;
    }
    let new = errors.count - *seen;
    *seen = errors.count;
    let Some(last) = &errors.last else { return };
    let more = if new > 1 {
        format!(" ({} more since the last report)", new - 1)
    } else {
        String::new()
    };
    tracing::warn!(
        "cache {cache}: {work}: device error: {}{more}",
        fault_text(last)
    );
}

impl Daemon {
    /// One look at every running cache's background work, at `now` (any fixed origin).
    pub(super) fn health_tick(&self, health: &mut Health, now: Duration) {
        let caches: Vec<(u16, hybridcache_engine::Cache)> = {
            let st = self.state.lock();
            st.caches
                .iter()
                .map(|(id, c)| (*id, c.cache.clone()))
                .collect()
        };
        health
            .caches
            .retain(|id, _| caches.iter().any(|(c, _)| c == id));
        for (id, cache) in caches {
            let h = health.caches.entry(id).or_default();
            let cleaning = cache.cleaning_stats();
            log_new_errors(id, "cleaning", &cleaning.errors, &mut h.cleaning_errors);
            log_new_errors(
                id,
                "prefetch",
                &cache.prefetch_errors(),
                &mut h.prefetch_errors,
            );
            let policy = cache.cleaning().policy;
            let dirty_lines = cache.stats().usage.dirty_lines;
            let look = CleaningLook {
                dirty_lines,
                policy_cleans: policy != CleaningPolicy::Nop,
                waiting: cleaning.waiting,
                cleaned_lines: cleaning.cleaned_lines,
            };
            match h.stall.look(now, look, self.stall_warn) {
                Some(StallEvent::Stalled(d)) => {
                    let last = cleaning
                        .errors
                        .last
                        .as_ref()
                        .map(|f| format!("; last cleaning error: {}", fault_text(f)))
                        .unwrap_or_else(|| "; no cleaning error: a core may be blocking".into());
                    tracing::warn!(
                        "cache {id}: cleaning has stalled: {dirty_lines} dirty lines, nothing \
                         cleaned for {} s (cleaning policy {policy}){last}",
                        d.as_secs()
                    );
                }
                Some(StallEvent::Resumed(d)) => tracing::info!(
                    "cache {id}: cleaning is no longer stalled (after {} s; {dirty_lines} dirty \
                     lines)",
                    d.as_secs()
                ),
                None => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const WARN: Duration = Duration::from_secs(30);

    fn look(dirty_lines: u64, waiting: bool, cleaned_lines: u64) -> CleaningLook {
        CleaningLook {
            dirty_lines,
            policy_cleans: true,
            waiting,
            cleaned_lines,
        }
    }

    fn at(s: u64) -> Duration {
        Duration::from_secs(s)
    }

    #[test]
    fn a_stall_is_due_cleaning_without_progress_for_the_whole_time() {
        let mut w = StallWatch::default();
        assert_eq!(w.look(at(0), look(10, false, 0), WARN), None);
        assert_eq!(w.look(at(29), look(10, false, 0), WARN), None);
        assert_eq!(
            w.look(at(30), look(10, false, 0), WARN),
            Some(StallEvent::Stalled(at(30)))
        );
        // Reported once, not at every look.
        assert_eq!(w.look(at(31), look(10, false, 0), WARN), None);
        assert_eq!(
            w.look(at(40), look(8, false, 2), WARN),
            Some(StallEvent::Resumed(at(40)))
        );
        // Progress restarts the clock.
        assert_eq!(w.look(at(69), look(8, false, 2), WARN), None);
        assert!(matches!(
            w.look(at(70), look(8, false, 2), WARN),
            Some(StallEvent::Stalled(_))
        ));
    }

    #[test]
    fn a_waiting_policy_nop_or_a_clean_cache_is_no_stall() {
        for (dirty, cleans, waiting) in [(10, true, true), (10, false, false), (0, true, false)] {
            let mut w = StallWatch::default();
            for s in 0..100 {
                let l = CleaningLook {
                    dirty_lines: dirty,
                    policy_cleans: cleans,
                    waiting,
                    cleaned_lines: 0,
                };
                assert_eq!(w.look(at(s), l, WARN), None, "{l:?} at {s}");
            }
        }
        // Waiting for a moment restarts the clock: the stall must last the whole time.
        let mut w = StallWatch::default();
        assert_eq!(w.look(at(0), look(10, false, 0), WARN), None);
        assert_eq!(w.look(at(20), look(10, true, 0), WARN), None);
        assert_eq!(w.look(at(45), look(10, false, 0), WARN), None);
        assert_eq!(w.look(at(74), look(10, false, 0), WARN), None);
        assert_eq!(
            w.look(at(75), look(10, false, 0), WARN),
            Some(StallEvent::Stalled(at(30)))
        );
        // Once reported, the policy going back to waiting ends it.
        assert_eq!(
            w.look(at(80), look(10, true, 0), WARN),
            Some(StallEvent::Resumed(at(35)))
        );
    }
}

//! Offload (`-X -n offload -p on|off`, `-X -n offload-queue --share PCT -t DEPTH`; the ASPLOS'23
//! study's "selective offloading", domain.md §12).
//!
//! With a fast core (an SSD array) behind a RAM or NVMe cache, the cache device and the cache's
//! own path can be the bottleneck: every hit and every write miss lands on the cache device while
//! the core idles. Offload sends a share of two kinds of requests to the core instead, only while
//! the cache device is the busier of the two:
//!
//! - read hits of lines with no dirty sector: the core holds the same data, so reading it there
//!   is correct (a dirty line's newer data exists only in the cache, so those are never offloaded);
//! - write misses (no core line of the request mapped) in wb, wo and wt: the data goes to the core
//!   and nothing is inserted. Unmapped under the request's locks means no cached copy exists that
//!   could go stale; the write path still invalidates whatever is mapped, as lazy flush does.
//!
//! "Busier" is measured by **queue depth**: requests in flight on the cache device against those
//! in flight on the request's core, counted around each device IO. Why not EWMA latency: the
//! two devices differ in speed by orders of magnitude (a RAM cache answers in microseconds, an SSD
//! array in a hundred), so a latency comparison would always call the core the busier one, and
//! the latency of a device that has just been relieved stays high for the EWMA's memory. Queue
//! depth says where work is waiting now, needs no clock in the request path, and balances itself:
//! offloading raises the core's depth until it meets the cache's.
//!
//! The share is exact rather than random: of the eligible requests, `share` in 100 go to the
//! core, spread evenly (a Bresenham counter), so a test can predict it and two runs compare.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::EngineError;

/// Offload's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Offload {
    /// Off by default: it trades hit ratio for bandwidth, a win only when the core is fast.
    pub enabled: bool,
    /// Percent of the eligible requests sent to the core (0..100).
    pub share_pct: u32,
    /// How many more requests must be in flight on the cache device than on the core before
    /// anything is offloaded (0..1024). 0 offloads the share whatever the queues.
    pub threshold: u32,
}

impl Default for Offload {
    fn default() -> Self {
        Offload {
            enabled: false,
            share_pct: 25,
            threshold: 1,
        }
    }
}

impl Offload {
    pub fn validate(&self) -> crate::Result<()> {
        if self.share_pct > 100 {
            return Err(EngineError::Invalid(format!(
                "share {} is out of range 0..100 %",
                self.share_pct
            )));
        }
        if self.threshold > 1024 {
            return Err(EngineError::Invalid(format!(
                "threshold {} is out of range 0..1024",
                self.threshold
            )));
        }
        Ok(())
    }
}

/// Cache-wide offload state: settings, queue depths and the share counter.
pub(crate) struct OffloadState {
    enabled: AtomicBool,
    share_pct: AtomicU32,
    threshold: AtomicU32,
    cache_in_flight: AtomicU32,
    /// Per core id.
    core_in_flight: Box<[AtomicU32]>,
    eligible: AtomicU64,
}

/// One device IO counted in flight; dropping it ends the count.
pub(crate) struct InFlight<'a>(Option<&'a AtomicU32>);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.0 {
            c.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

impl OffloadState {
    pub(crate) fn new(cores: usize) -> OffloadState {
        let d = Offload::default();
        OffloadState {
            enabled: AtomicBool::new(d.enabled),
            share_pct: AtomicU32::new(d.share_pct),
            threshold: AtomicU32::new(d.threshold),
            cache_in_flight: AtomicU32::new(0),
            core_in_flight: (0..cores).map(|_| AtomicU32::new(0)).collect(),
            eligible: AtomicU64::new(0),
        }
    }

    pub(crate) fn params(&self) -> Offload {
        Offload {
            enabled: self.enabled.load(Ordering::Relaxed),
            share_pct: self.share_pct.load(Ordering::Relaxed),
            threshold: self.threshold.load(Ordering::Relaxed),
        }
    }

    pub(crate) fn set_params(&self, p: Offload) {
        self.share_pct.store(p.share_pct, Ordering::Relaxed);
        self.threshold.store(p.threshold, Ordering::Relaxed);
        self.enabled.store(p.enabled, Ordering::Relaxed);
    }

    /// Count an IO on the cache device while the guard lives. Queues are tracked only while
    /// offload is on, so the default path pays one relaxed load and no shared write.
    #[inline]
    pub(crate) fn cache_io(&self) -> InFlight<'_> {
        self.track(&self.cache_in_flight)
    }

    #[inline]
    pub(crate) fn core_io(&self, core: usize) -> InFlight<'_> {
        match self.core_in_flight.get(core) {
            Some(c) => self.track(c),
            None => InFlight(None),
        }
    }

    #[inline]
    fn track<'a>(&self, c: &'a AtomicU32) -> InFlight<'a> {
        if self.enabled.load(Ordering::Relaxed) {
            c.fetch_add(1, Ordering::Relaxed);
            InFlight(Some(c))
        } else {
            InFlight(None)
        }
    }

    /// Whether an eligible request (a clean read hit or a write miss) for `core` goes to the
    /// core: offload on, the cache device's queue deeper than the core's by `threshold`, and
    /// this request's turn in the share.
    pub(crate) fn take(&self, core: usize) -> bool {
        if !self.enabled.load(Ordering::Relaxed) {
            return false;
        }
        let share = self.share_pct.load(Ordering::Relaxed) as u64;
        if share == 0 {
            return false;
        }
        let threshold = self.threshold.load(Ordering::Relaxed) as i64;
        // Threshold 0 means "whatever the queues": a core deeper than the cache must not stop
        // it (a fast core's queue is deeper than a RAM cache's most of the time).
        if threshold > 0 {
            let cache = self.cache_in_flight.load(Ordering::Relaxed) as i64;
            let core_q = self
                .core_in_flight
                .get(core)
                .map_or(0, |c| c.load(Ordering::Relaxed)) as i64;
            if cache - core_q < threshold {
                return false;
            }
        }
        // Request n is offloaded when the running total n * share / 100 steps up: exactly
        // `share` of every 100 eligible requests, evenly spread.
        let n = self.eligible.fetch_add(1, Ordering::Relaxed);
        (n + 1) * share / 100 != n * share / 100
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_share_is_exact_and_spread() {
        let s = OffloadState::new(4);
        s.set_params(Offload {
            enabled: true,
            share_pct: 25,
            threshold: 0,
        });
        let taken: Vec<bool> = (0..100).map(|_| s.take(1)).collect();
        assert_eq!(taken.iter().filter(|t| **t).count(), 25);
        // Never two in a row at 25%.
        assert!(taken.windows(2).all(|w| !(w[0] && w[1])));
        s.set_params(Offload {
            enabled: true,
            share_pct: 100,
            threshold: 0,
        });
        assert!((0..10).all(|_| s.take(1)));
        s.set_params(Offload {
            enabled: true,
            share_pct: 0,
            threshold: 0,
        });
        assert!((0..10).all(|_| !s.take(1)));
    }

    #[test]
    fn only_when_the_cache_queue_is_deeper() {
        let s = OffloadState::new(4);
        s.set_params(Offload {
            enabled: true,
            share_pct: 100,
            threshold: 2,
        });
        assert!(!s.take(1), "both idle");
        let c1 = s.cache_io();
        let c2 = s.cache_io();
        assert!(s.take(1), "cache 2 deep, core idle");
        let k = s.core_io(1);
        assert!(!s.take(1), "cache 2, core 1");
        assert!(s.take(2), "another core is idle");
        drop((c1, c2, k));
        assert!(!s.take(1));
        // Off: nothing is offloaded and nothing is counted.
        s.set_params(Offload::default());
        let _g = s.cache_io();
        assert_eq!(s.cache_in_flight.load(Ordering::Relaxed), 0);
        assert!(!s.take(1));
    }

    #[test]
    fn threshold_0_ignores_the_queues() {
        let s = OffloadState::new(4);
        s.set_params(Offload {
            enabled: true,
            share_pct: 100,
            threshold: 0,
        });
        // The core's queue is deeper than the cache's (a fast core behind a RAM cache).
        let k1 = s.core_io(1);
        let k2 = s.core_io(1);
        assert!(s.take(1));
        drop((k1, k2));
    }

    #[test]
    fn ranges() {
        assert!(Offload::default().validate().is_ok());
        let bad = Offload {
            share_pct: 101,
            ..Offload::default()
        };
        assert!(bad.validate().is_err());
        let bad = Offload {
            threshold: 1025,
            ..Offload::default()
        };
        assert!(bad.validate().is_err());
    }
}

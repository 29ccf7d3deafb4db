//! Time for the emulated devices: a [`Clock`] trait so tests can run the timing models on a
//! [`VirtualClock`] (no sleeping, deterministic) while real use runs on [`RealClock`].
//!
//! Times are nanoseconds since the clock's own epoch ([`Nanos`]); the models only compare and
//! add them, so the epoch does not matter.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// Nanoseconds since a clock's epoch.
pub type Nanos = u64;

/// Convert a duration to [`Nanos`], saturating (a duration of centuries is "never").
pub fn nanos(d: Duration) -> Nanos {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// A source of time that can also wait.
pub trait Clock: Send + Sync {
    /// The current time.
    fn now(&self) -> Nanos;
    /// Return once `now() >= t`.
    fn sleep_until(&self, t: Nanos);
    /// Whether time only moves when someone sleeps (then waiting for another thread would
    /// block forever: sleep instead).
    fn is_virtual(&self) -> bool {
        false
    }
}

/// Shared clock handle as the emulated devices hold it.
pub type ClockRef = Arc<dyn Clock>;

/// Wall-clock time: `Instant` plus `thread::sleep`, spinning for the last stretch because
/// `thread::sleep` overshoots, which would swamp a 100 µs device. The overshoot is mostly the
/// kernel's timer slack (50 µs by default), so a sleeping thread first sets its own slack to
/// 1 µs and then spins only the last [`SPIN_BELOW`]: with dozens of requests waiting at once
/// (an array's merged stripe completes 32 of them together), long spins kept the CPUs busy and
/// delayed the very threads that deliver the replies and read the next requests by
/// milliseconds on a small machine.
#[derive(Debug, Default, Clone, Copy)]
pub struct RealClock;

/// Below this, wait by spinning instead of sleeping.
pub(crate) const SPIN_BELOW: Nanos = 20_000;

/// The timer slack of the threads that sleep on the real clock, in nanoseconds.
const TIMER_SLACK_NS: libc::c_ulong = 1_000;

/// Set this thread's timer slack to [`TIMER_SLACK_NS`] once (a per-thread setting), so its
/// sleeps and timed waits end within microseconds of their deadline.
pub(crate) fn precise_timers() {
    thread_local! {
        static DONE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
    }
    DONE.with(|d| {
        if !d.replace(true) {
            // SAFETY: PR_SET_TIMERSLACK takes an integer and touches only this thread's
            // scheduling state; a failure (an old kernel) leaves the default slack.
            unsafe {
                libc::prctl(libc::PR_SET_TIMERSLACK, TIMER_SLACK_NS, 0, 0, 0);
            }
        }
    });
}

fn epoch() -> Instant {
    // One epoch per process, so every RealClock agrees and times can be compared across devices.
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    *EPOCH.get_or_init(Instant::now)
}

impl RealClock {
    pub fn new() -> RealClock {
        RealClock
    }

    /// A shared handle to the real clock.
    pub fn shared() -> ClockRef {
        Arc::new(RealClock)
    }
}

impl Clock for RealClock {
    fn now(&self) -> Nanos {
        nanos(epoch().elapsed())
    }

    fn sleep_until(&self, t: Nanos) {
        precise_timers();
        loop {
            let now = self.now();
            if now >= t {
                return;
            }
            let left = t - now;
            if left > SPIN_BELOW {
                std::thread::sleep(Duration::from_nanos(left - SPIN_BELOW / 2));
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// Time that only moves when someone sleeps: `sleep_until(t)` jumps the clock to `t`. For
/// single-threaded tests of timing properties (a thread sleeping on it never blocks).
#[derive(Debug, Default)]
pub struct VirtualClock {
    now: AtomicU64,
}

impl VirtualClock {
    pub fn new() -> VirtualClock {
        VirtualClock::default()
    }

    /// Move time forward by `d`.
    pub fn advance(&self, d: Duration) {
        self.now.fetch_add(nanos(d), Ordering::SeqCst);
    }
}

impl Clock for VirtualClock {
    fn now(&self) -> Nanos {
        self.now.load(Ordering::SeqCst)
    }

    fn sleep_until(&self, t: Nanos) {
        self.now.fetch_max(t, Ordering::SeqCst);
    }

    fn is_virtual(&self) -> bool {
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn virtual_clock_jumps() {
        let c = VirtualClock::new();
        assert_eq!(c.now(), 0);
        c.sleep_until(5_000);
        assert_eq!(c.now(), 5_000);
        c.sleep_until(10); // the past: no change
        assert_eq!(c.now(), 5_000);
        c.advance(Duration::from_micros(1));
        assert_eq!(c.now(), 6_000);
    }

    #[test]
    fn real_clock_waits() {
        let c = RealClock::new();
        let start = c.now();
        c.sleep_until(start + 300_000);
        assert!(c.now() >= start + 300_000);
    }
}

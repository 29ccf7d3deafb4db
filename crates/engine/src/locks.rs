//! Striped locks over core lines.
//!
//! A core line's stripe lock protects its hash bucket (so its lookup), the metadata of the cache
//! line mapped to it, and that cache line's data. Every path that holds more than one stripe takes
//! them in ascending order; paths that already hold stripes only ever `try_lock` another one
//! (eviction). Together that rules out deadlock without a global lock.

use parking_lot::lock_api::RawMutex as _;
use parking_lot::RawMutex;

pub(crate) struct StripedLocks {
    locks: Box<[RawMutex]>,
}

impl StripedLocks {
    pub(crate) fn new(count: usize) -> Self {
        assert!(count.is_power_of_two());
        StripedLocks {
            locks: (0..count).map(|_| RawMutex::INIT).collect(),
        }
    }

    /// Lock `stripes` (sorted ascending, no duplicates) and return a guard that unlocks them.
    /// The guard tells whether some stripe was held by another request (the statistics call
    /// such a hit "deferred"); trying first costs nothing more than `lock`'s own fast path.
    pub(crate) fn lock_sorted(&self, stripes: Vec<u32>) -> StripeGuard<'_> {
        debug_assert!(stripes.windows(2).all(|w| w[0] < w[1]));
        let mut waited = false;
        for &s in &stripes {
            let l = &self.locks[s as usize];
            if !l.try_lock() {
                waited = true;
                l.lock();
            }
        }
        StripeGuard {
            locks: self,
            held: stripes,
            waited,
        }
    }

    /// Lock `stripes` (sorted ascending, no duplicates) if every one is free now; otherwise
    /// take none of them.
    pub(crate) fn try_lock_sorted(&self, stripes: &[u32]) -> Option<StripeGuard<'_>> {
        debug_assert!(stripes.windows(2).all(|w| w[0] < w[1]));
        for (i, &s) in stripes.iter().enumerate() {
            if !self.locks[s as usize].try_lock() {
                for &t in stripes[..i].iter().rev() {
                    // SAFETY: locked just above by this call, unlocked once.
                    unsafe { self.locks[t as usize].unlock() };
                }
                return None;
            }
        }
        Some(StripeGuard {
            locks: self,
            held: stripes.to_vec(),
            waited: false,
        })
    }

    /// Try to lock one stripe without waiting.
    pub(crate) fn try_lock(&self, stripe: u32) -> Option<StripeGuard<'_>> {
        if self.locks[stripe as usize].try_lock() {
            Some(StripeGuard {
                locks: self,
                held: vec![stripe],
                waited: false,
            })
        } else {
            None
        }
    }
}

/// Holds a set of stripes; unlocks them when dropped.
pub(crate) struct StripeGuard<'a> {
    locks: &'a StripedLocks,
    held: Vec<u32>,
    waited: bool,
}

impl StripeGuard<'_> {
    /// Whether taking these stripes had to wait for another holder.
    pub(crate) fn waited(&self) -> bool {
        self.waited
    }
}

impl Drop for StripeGuard<'_> {
    fn drop(&mut self) {
        for &s in self.held.iter().rev() {
            // SAFETY: this guard locked exactly these stripes and unlocks each once.
            unsafe { self.locks.locks[s as usize].unlock() };
        }
    }
}

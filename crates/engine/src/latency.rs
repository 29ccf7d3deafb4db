//! Request latency histograms: per core, for reads and writes, split by whether the request was
//! served by the cache alone or had to wait for the core.
//!
//! Recording takes no lock: each thread adds to its own slot of atomic bucket counters (the same
//! slot scheme as the statistics counters), and a snapshot sums the slots. Buckets are
//! log-linear, eight per power of two (a bucket's width is at most 1/8 of its lower bound, so a
//! percentile read from the buckets is within 12.5% of the true value), from 1 ns to about 18
//! minutes; anything slower lands in the last bucket.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::stats::{thread_slot, SLOTS};

/// Sub-buckets per power of two: 2^SUB_BITS.
const SUB_BITS: u32 = 3;
const SUB: usize = 1 << SUB_BITS;
/// Powers of two covered: values up to 2^40 ns (about 18 minutes).
const MAX_POWER: usize = 40;
pub const BUCKETS: usize = (MAX_POWER - SUB_BITS as usize + 2) * SUB;

/// What a request was, for its histogram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LatencyKind {
    /// A read served from the cache device alone (a hit).
    ReadCache,
    /// A read that read from the core (a miss, a partial miss or pass-through).
    ReadCore,
    /// A write that did not wait for the core (write-back into the cache).
    WriteCache,
    /// A write that waited for the core (write-through, pass-through, or room made by cleaning).
    WriteCore,
}

impl LatencyKind {
    pub const ALL: [LatencyKind; 4] = [
        LatencyKind::ReadCache,
        LatencyKind::ReadCore,
        LatencyKind::WriteCache,
        LatencyKind::WriteCore,
    ];

    fn index(self) -> usize {
        self as usize
    }

    pub fn is_read(self) -> bool {
        matches!(self, LatencyKind::ReadCache | LatencyKind::ReadCore)
    }

    /// "cache" or "core": where the request was served from.
    pub fn served_by(self) -> &'static str {
        match self {
            LatencyKind::ReadCache | LatencyKind::WriteCache => "cache",
            LatencyKind::ReadCore | LatencyKind::WriteCore => "core",
        }
    }
}

/// The bucket a latency of `ns` nanoseconds falls in.
pub fn bucket_of(ns: u64) -> usize {
    if ns < SUB as u64 {
        return ns as usize;
    }
    let power = 63 - ns.leading_zeros() as usize;
    if power > MAX_POWER {
        return BUCKETS - 1;
    }
    let sub = ((ns >> (power - SUB_BITS as usize)) as usize) & (SUB - 1);
    (power - SUB_BITS as usize + 1) * SUB + sub
}

/// The largest latency (ns) bucket `i` holds; a percentile reports this bound.
pub fn bucket_upper(i: usize) -> u64 {
    if i < SUB {
        return i as u64;
    }
    let power = i / SUB + SUB_BITS as usize - 1;
    let sub = (i % SUB) as u64;
    let base = 1u64 << power;
    let width = base >> SUB_BITS;
    base + (sub + 1) * width - 1
}

#[repr(align(128))]
struct Slot {
    counts: [[AtomicU64; BUCKETS]; 4],
    sum_ns: [AtomicU64; 4],
}

/// One core's histograms.
pub(crate) struct Latency {
    slots: Box<[Slot]>,
}

impl Latency {
    pub(crate) fn new() -> Latency {
        Latency {
            slots: (0..SLOTS)
                .map(|_| Slot {
                    counts: std::array::from_fn(|_| std::array::from_fn(|_| AtomicU64::new(0))),
                    sum_ns: std::array::from_fn(|_| AtomicU64::new(0)),
                })
                .collect(),
        }
    }

    pub(crate) fn record(&self, kind: LatencyKind, elapsed: Duration) {
        let ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        let slot = &self.slots[thread_slot() % SLOTS];
        slot.counts[kind.index()][bucket_of(ns)].fetch_add(1, Relaxed);
        slot.sum_ns[kind.index()].fetch_add(ns, Relaxed);
    }

    pub(crate) fn snapshot(&self) -> LatencyStats {
        let mut out = LatencyStats::default();
        for kind in LatencyKind::ALL {
            let h = &mut out.histograms[kind.index()];
            for slot in self.slots.iter() {
                for (b, c) in h.counts.iter_mut().zip(slot.counts[kind.index()].iter()) {
                    *b += c.load(Relaxed);
                }
                h.sum_ns += slot.sum_ns[kind.index()].load(Relaxed);
            }
        }
        out
    }

    pub(crate) fn reset(&self) {
        for slot in self.slots.iter() {
            for kind in &slot.counts {
                for c in kind {
                    c.store(0, Relaxed);
                }
            }
            for s in &slot.sum_ns {
                s.store(0, Relaxed);
            }
        }
    }
}

/// One histogram: counts per bucket (see [`bucket_upper`]) and the sum of all latencies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Histogram {
    pub counts: Box<[u64; BUCKETS]>,
    pub sum_ns: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: Box::new([0; BUCKETS]),
            sum_ns: 0,
        }
    }
}

impl Histogram {
    pub fn count(&self) -> u64 {
        self.counts.iter().sum()
    }

    /// The latency (ns) below which a fraction `q` (0..=1) of the requests completed: the upper
    /// bound of the bucket holding that rank. None when empty.
    pub fn quantile(&self, q: f64) -> Option<u64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (i, c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return Some(bucket_upper(i));
            }
        }
        Some(bucket_upper(BUCKETS - 1))
    }

    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(other.counts.iter()) {
            *a += b;
        }
        self.sum_ns += other.sum_ns;
    }
}

/// A core's (or, merged, a cache's) latency histograms, one per [`LatencyKind`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LatencyStats {
    pub histograms: [Histogram; 4],
}

impl LatencyStats {
    pub fn get(&self, kind: LatencyKind) -> &Histogram {
        &self.histograms[kind.index()]
    }

    /// Reads (or writes) whatever served them.
    pub fn direction(&self, read: bool) -> Histogram {
        let mut h = Histogram::default();
        for kind in LatencyKind::ALL.into_iter().filter(|k| k.is_read() == read) {
            h.merge(self.get(kind));
        }
        h
    }

    pub fn merge(&mut self, other: &LatencyStats) {
        for (a, b) in self.histograms.iter_mut().zip(other.histograms.iter()) {
            a.merge(b);
        }
    }
}

thread_local! {
    /// Set when the request running on this thread touched its core device.
    static TOUCHED_CORE: Cell<bool> = const { Cell::new(false) };
}

/// Note that the current request waited for the core.
pub(crate) fn touched_core() {
    TOUCHED_CORE.with(|t| t.set(true));
}

/// Start timing a request on this thread.
pub(crate) fn begin() -> std::time::Instant {
    TOUCHED_CORE.with(|t| t.set(false));
    std::time::Instant::now()
}

/// Whether the request begun on this thread touched its core.
pub(crate) fn ended_on_core() -> bool {
    TOUCHED_CORE.with(|t| t.get())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_cover_every_value_in_order() {
        let mut last = 0;
        for ns in (0..5000u64).chain([1 << 20, (1 << 20) + 1, 123_456_789, 1 << 40]) {
            let b = bucket_of(ns);
            assert!(b >= last, "{ns}");
            assert!(bucket_upper(b) >= ns, "{ns} above its bucket {b}");
            if b > 0 {
                assert!(bucket_upper(b - 1) < ns, "{ns} belongs below bucket {b}");
            }
            last = b;
        }
        assert_eq!(bucket_of(u64::MAX), BUCKETS - 1);
    }

    #[test]
    fn bucket_width_is_within_an_eighth() {
        for i in SUB..BUCKETS - 1 {
            let lower = bucket_upper(i - 1) + 1;
            let upper = bucket_upper(i);
            assert!(upper - lower < lower.div_ceil(8).max(1), "bucket {i}");
        }
    }

    #[test]
    fn quantiles_from_a_known_distribution() {
        let l = Latency::new();
        // 990 requests at 100 us, 9 at 10 ms, 1 at 1 s.
        for _ in 0..990 {
            l.record(LatencyKind::ReadCache, Duration::from_micros(100));
        }
        for _ in 0..9 {
            l.record(LatencyKind::ReadCache, Duration::from_millis(10));
        }
        l.record(LatencyKind::ReadCache, Duration::from_secs(1));
        let s = l.snapshot();
        let h = s.get(LatencyKind::ReadCache);
        assert_eq!(h.count(), 1000);
        let near = |got: u64, want: u64| got >= want && got <= want + want / 8;
        assert!(near(h.quantile(0.5).unwrap(), 100_000));
        assert!(near(h.quantile(0.99).unwrap(), 100_000));
        assert!(near(h.quantile(0.999).unwrap(), 10_000_000));
        assert!(near(h.quantile(0.9999).unwrap(), 1_000_000_000));
        assert_eq!(s.get(LatencyKind::WriteCore).quantile(0.5), None);
        l.reset();
        assert_eq!(l.snapshot().get(LatencyKind::ReadCache).count(), 0);
    }
}

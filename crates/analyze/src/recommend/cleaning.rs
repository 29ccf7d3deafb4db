//! Cleaning and lazy flush: how dirty data of the cached writes goes back to the core, and what
//! a write miss does when the cache is full of it.

use super::{AcpParams, AlruParams, CacheMode, Cleaning, Judged, Reason, Verdicts};
use crate::signature::{ratio, Timeline};
use crate::units::{bytes, num, pct};

/// The cached jobs whose writes the cache takes, their writes over time added up, and the rate
/// cleaning drains them at (the slowest writer's; infinite when none writes).
pub(super) struct CachedWrites<'a> {
    writers: Vec<Judged<'a>>,
    timeline: Timeline,
    drain: f64,
}

impl<'a> CachedWrites<'a> {
    pub(super) fn of(v: &Verdicts<'a>) -> CachedWrites<'a> {
        let writers: Vec<_> = v
            .cached
            .iter()
            .filter(|(_, r)| r.writes.as_ref().is_some_and(|w| w.cache))
            .copied()
            .collect();
        let mut wtl = Timeline {
            start_ns: v.sig.overall.timeline.start_ns,
            bucket_ns: v.sig.overall.timeline.bucket_ns,
            buckets: Vec::new(),
        };
        for (s, _) in &writers {
            if wtl.buckets.len() < s.timeline.buckets.len() {
                wtl.buckets
                    .resize(s.timeline.buckets.len(), Default::default());
            }
            for (a, b) in wtl.buckets.iter_mut().zip(&s.timeline.buckets) {
                a.write_ops += b.write_ops;
                a.write_bytes += b.write_bytes;
                a.read_ops += b.read_ops;
                a.read_bytes += b.read_bytes;
            }
        }
        let drain = writers
            .iter()
            .filter_map(|(_, r)| r.writes.as_ref().map(|w| w.drain_mb_s))
            .fold(f64::INFINITY, f64::min);
        CachedWrites {
            writers,
            timeline: wtl,
            drain,
        }
    }

    /// The most dirty data write bursts pile up above what cleaning drains, for a mode that
    /// holds dirty data; 0 otherwise.
    pub(super) fn backlog(&self, mode: CacheMode) -> u64 {
        if mode.dirty() && self.drain.is_finite() {
            self.timeline.peak_backlog(self.drain)
        } else {
            0
        }
    }

    pub(super) fn drain(&self) -> f64 {
        self.drain
    }
}

/// Cleaning: nop for a mode without dirty data, else the policy the load's idle time, metadata
/// share and write density call for.
pub(super) fn cleaning_rule(mode: CacheMode, v: &Verdicts, w: &CachedWrites) -> (Cleaning, Reason) {
    let (cleaning, text) = if !mode.dirty() {
        (
            Cleaning::Nop,
            format!(
                "nop: {} never holds dirty data, so a cleaner would have nothing to do",
                mode.long_name()
            ),
        )
    } else {
        busy_cleaning(v, w)
    };
    let reason = Reason {
        setting: format!("cleaning {}", cleaning.preset().unwrap_or(cleaning.name())),
        text,
    };
    (cleaning, reason)
}

/// The cleaning policy for a mode with dirty data: lazy for parallel metadata writers, in the
/// idle gaps when there are some and cleaning keeps up with the peak, else as fast as it can
/// (acp where the writes are dense enough for its chunks to merge neighbours).
fn busy_cleaning(v: &Verdicts, w: &CachedWrites) -> (Cleaning, String) {
    let (sig, writers, wtl, drain) = (v.sig, &w.writers, &w.timeline, w.drain);
    let writes: u64 = writers.iter().map(|(s, _)| s.writes.requests).sum();
    let meta: u64 = writers.iter().map(|(s, _)| s.meta_writes).sum();
    let meta_share = ratio(meta, writes);
    let idle = wtl.idle_share();
    let peak = wtl.peak_write_mb_s();
    let (wblocks, chunks) = writers.iter().fold((0u64, 0u64), |(b, c), (s, _)| {
        (
            b + s.working_set.write_blocks,
            c + s.working_set.write_chunks,
        )
    });
    // 100 MiB ACP chunks hold 25600 blocks of 4 KiB.
    let density = ratio(wblocks, chunks * 25_600);
    if meta_share >= 0.3 && sig.jobs.len() >= 4 {
        (
            Cleaning::Alru(AlruParams::LAZY),
            format!(
                "alru-lazy (2, 5, 256, 500): {} of cached writes are metadata from {} jobs in parallel; deferred, batched cleaning leaves the core to them",
                pct(meta_share),
                sig.jobs.len()
            ),
        )
    } else if idle >= 0.2 && peak <= drain {
        let p = AlruParams {
            wake_up: 1,
            staleness_time: 1,
            flush_max_buffers: 8192,
            activity_threshold: 1000,
            dirty_ratio_threshold: 100,
        };
        (
            Cleaning::Alru(p),
            format!(
                "alru cleaning in the idle gaps (wake-up 1 s, staleness 1 s, 8192 buffers, activity threshold 1000 ms): {} of the seconds see no IO and even the peak of {} MB/s of writes stays below the {} MB/s cleaning drains, so cleaning can wait for quiet moments instead of competing with clients",
                pct(idle),
                num(peak),
                num(drain)
            ),
        )
    } else if density >= 0.5 {
        (
            Cleaning::Acp(AcpParams::VERY_AGGRESSIVE),
            format!(
                "acp-very-aggressive (wake-up 1 ms, 8192 buffers): the load leaves no idle time ({} of seconds idle) and writes are concentrated ({} of the blocks of the 100 MiB chunks they touch), so cleaning the dirtiest chunk first, while busy, merges the most neighbours per pass",
                pct(idle),
                pct(density)
            ),
        )
    } else {
        (
            Cleaning::Alru(AlruParams::VERY_AGGRESSIVE),
            format!(
                "alru-very-aggressive (wake-up 0, staleness 1 s, 8192 buffers, activity threshold 0): the sustained write speed is the cleaning rate ({} MB/s at the core's deepest measured queue) and the load leaves no idle time ({} of seconds idle), so cleaning must run at full depth while clients are busy",
                num(drain),
                pct(idle)
            ),
        )
    }
}

/// Lazy flush: on when the cache takes writes faster than cleaning drains them, so a burst
/// long enough fills it with dirty data and every further write miss would wait for cleaning.
pub(super) fn lazy_flush_rule(mode: CacheMode, w: &CachedWrites) -> (bool, Reason) {
    let (lazy_flush, text) = lazy_flush_choice(mode, &w.writers, &w.timeline, w.drain);
    let reason = Reason {
        setting: format!("lazy-flush {}", if lazy_flush { "on" } else { "off" }),
        text,
    };
    (lazy_flush, reason)
}

fn lazy_flush_choice(
    mode: CacheMode,
    writers: &[Judged],
    wtl: &Timeline,
    drain: f64,
) -> (bool, String) {
    if !mode.dirty() {
        return (
            false,
            format!(
                "off: {} holds no dirty data, so no write ever waits for cleaning",
                mode.long_name()
            ),
        );
    }
    let absorb = writers
        .iter()
        .filter_map(|(_, r)| r.writes.as_ref().map(|w| w.absorb_mb_s))
        .fold(0.0, f64::max);
    let backlog = if drain.is_finite() {
        wtl.peak_backlog(drain)
    } else {
        0
    };
    if backlog > 0 {
        (
            true,
            format!(
                "on: write bursts pile up to {} of dirty data above the {} MB/s cleaning drains; once a burst fills the cache, write misses that find no clean line go to the core instead of each waiting for cleaning",
                bytes(backlog),
                num(drain)
            ),
        )
    } else if drain.is_finite() && absorb > drain * 1.2 {
        (
            true,
            format!(
                "on: the cache absorbs these writes at {} MB/s and cleaning drains them at only {} MB/s, so a burst longer than the cache's size / {} MB/s fills it with dirty data; then write misses that find no clean line go to the core instead of each waiting for cleaning",
                num(absorb),
                num(drain),
                num(absorb - drain)
            ),
        )
    } else {
        (
            false,
            format!(
                "off: cleaning drains {} MB/s, as fast as the cache absorbs the writes ({} MB/s), so dirty data does not pile up",
                num(drain),
                num(absorb)
            ),
        )
    }
}

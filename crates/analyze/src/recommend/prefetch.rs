//! Read-ahead: whether sequential readers of the cache get their stream fetched ahead of them.

use super::{CacheMode, Judged, ReadAhead, Reason};
use crate::units::{bytes, num, pct};

/// Read-ahead: on when a cached job reads sequentially and the core feeds a prefetching stream
/// (large requests, several in flight) faster than the job's own reads.
pub(super) fn readahead_rule(mode: CacheMode, cached: &[Judged]) -> (Option<ReadAhead>, Reason) {
    let (prefetch, text) = readahead_choice(mode, cached);
    let setting = match prefetch {
        Some(ra) => format!("prefetch readahead {} KiB", ra.threshold),
        None => "prefetch none".into(),
    };
    (prefetch, Reason { setting, text })
}

fn readahead_choice(mode: CacheMode, cached: &[Judged]) -> (Option<ReadAhead>, String) {
    if !mode.caches_reads() {
        return (
            None,
            format!(
                "none: {} inserts no read misses, and read-ahead prefetches only what reads would insert",
                mode.long_name()
            ),
        );
    }
    let best = cached
        .iter()
        .filter_map(|(s, r)| {
            let x = r.reads.as_ref()?;
            let ra = x.readahead_mb_s.filter(|_| x.cache)?;
            Some((s, x, ra))
        })
        .max_by(|a, b| a.0.reads.requests.cmp(&b.0.reads.requests));
    match best {
        Some((s, x, ra)) => {
            let p = ReadAhead::for_block(x.block);
            (
                Some(p),
                format!(
                    "readahead (threshold {} KiB, distance {} KiB, {} in flight): {} reads sequentially ({} of its reads, {} at iodepth {}), which the core serves at {} MB/s, while {} KiB read-ahead requests {} deep arrive at {} MB/s; {} of reads go to blocks read before, so prefetched lines are also hit again",
                    p.threshold,
                    p.distance,
                    p.max_in_flight,
                    s.name,
                    pct(s.reads.sequential_share()),
                    bytes(x.block),
                    x.queue_depth,
                    num(x.core_mb_s),
                    p.distance,
                    p.max_in_flight,
                    num(ra),
                    pct(x.reuse)
                ),
            )
        }
        None => (
            None,
            "none: no cached job reads sequentially faster with read-ahead than with its own requests".into(),
        ),
    }
}

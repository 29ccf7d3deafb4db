//! The promotion policy: whether a read miss is inserted at once or only once the block is read
//! again.

use super::{CacheMode, Promotion, Reason, Verdicts};
use crate::signature::ratio;
use crate::units::{factor, pct};

/// Promotion: always where there is nothing to filter; nhit 2 when most read blocks are read once
/// while re-reads matter (or a cached job's reads gain more with it); nhit 3 when the cache reads
/// less than twice as fast as the core; else always.
pub(super) fn promotion_rule(mode: CacheMode, v: &Verdicts) -> (Promotion, Reason) {
    let cached = &v.cached;
    let (rb, once, reuse_refs, refs) = cached.iter().fold((0u64, 0u64, 0u64, 0u64), |a, (s, _)| {
        (
            a.0 + s.working_set.read_blocks,
            a.1 + s.working_set.read_once_blocks,
            a.2 + s.reads.reused_refs,
            a.3 + s.reads.block_refs,
        )
    });
    let once_share = ratio(once, rb);
    let reuse = ratio(reuse_refs, refs);
    let cache_ratio = cached
        .iter()
        .filter_map(|(_, r)| {
            r.reads
                .as_ref()
                .filter(|x| x.cache)
                .map(|x| x.cache_mb_s / x.core_mb_s.max(1e-9))
        })
        .fold(f64::INFINITY, f64::min);
    let reason = |setting: &str, text: String| Reason {
        setting: setting.into(),
        text,
    };
    if !mode.caches_reads() {
        let text = format!(
            "always: {} inserts no read misses, so there is nothing to filter",
            mode.long_name()
        );
        (Promotion::Always, reason("promotion always", text))
    } else if rb == 0 {
        let text = "always: the cached jobs do not read, so there is nothing to filter".into();
        (Promotion::Always, reason("promotion always", text))
    } else if (once_share >= 0.5 && reuse >= 0.1)
        || cached
            .iter()
            .any(|(_, r)| r.reads.as_ref().is_some_and(|x| x.cache && x.nhit))
    {
        let text = format!(
            "nhit (threshold 2, trigger 80%): {} of read blocks are read only once while {} of read references are re-reads; inserting on the second access keeps the one-time blocks from evicting the re-read ones",
            pct(once_share),
            pct(reuse)
        );
        let nhit = Promotion::Nhit {
            threshold: 2,
            trigger: 80,
        };
        (nhit, reason("promotion nhit 2/80", text))
    } else if cache_ratio < 2.0 {
        let text = format!(
            "nhit (threshold 3, trigger 80%): the cache reads only {} as fast as the core, so fewer insertions keep some load on the core and balance the two",
            factor(cache_ratio)
        );
        let nhit = Promotion::Nhit {
            threshold: 3,
            trigger: 80,
        };
        (nhit, reason("promotion nhit 3/80", text))
    } else {
        let text = format!(
            "always: only {} of read blocks are read once, so every miss is worth inserting",
            pct(once_share)
        );
        (Promotion::Always, reason("promotion always", text))
    }
}

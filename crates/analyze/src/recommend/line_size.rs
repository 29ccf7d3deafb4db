//! The cache line size: the dominant size of the requests the cache will take.

use std::collections::BTreeMap;

use super::{pow2_floor, CacheMode, Reason, Verdicts};
use crate::signature::ratio;
use crate::units::{bytes, pct};

/// The line size (KiB): the dominant request size among what the cached jobs' modes insert (the
/// whole trace's writes when nothing is cached), as a power of two within 4..64 KiB.
pub(super) fn line_size_rule(v: &Verdicts) -> (u32, Reason) {
    let mut sizes: BTreeMap<u64, u64> = BTreeMap::new();
    for (s, r) in &v.cached {
        let (rd, wr) = (
            r.mode.caches_reads(),
            r.mode.dirty() || r.mode == CacheMode::Wb,
        );
        if rd {
            for (k, n) in &s.reads.sizes {
                *sizes.entry(*k).or_default() += n;
            }
        }
        if wr {
            for (k, n) in &s.writes.sizes {
                *sizes.entry(*k).or_default() += n;
            }
        }
    }
    let line_basis = if sizes.is_empty() {
        &v.sig.overall.writes.sizes
    } else {
        &sizes
    };
    let total_sized: u64 = line_basis.values().sum();
    let (dom, dom_n) = line_basis
        .iter()
        .max_by(|a, b| a.1.cmp(b.1).then(a.0.cmp(b.0)))
        .map_or((4096, 0), |(s, n)| (*s, *n));
    let line_kib = (pow2_floor(dom / 1024).clamp(4, 64)) as u32;
    let reason = Reason {
        setting: format!("cache line size {line_kib} KiB"),
        text: format!(
            "{line_kib} KiB lines: {} of the requests the cache takes are {}; lines {} them waste neither cache space nor core reads for partial lines",
            pct(ratio(dom_n, total_sized)),
            bytes(dom),
            if line_kib as u64 * 1024 == dom { "equal to" } else { "no larger than" }
        ),
    };
    (line_kib, reason)
}

//! The cache size: from the cached jobs' miss-ratio curves and the write bursts to absorb.

use super::cleaning::CachedWrites;
use super::{CacheMode, Reason, RecommendOptions, Verdicts};
use crate::units::{bytes, num, pct};

const MIB: u64 = 1 << 20;

/// 4 KiB blocks reaching `o.hit_fraction` of the achievable hit ratio, and that ratio: the whole
/// trace's curve when every job is cached, else the cached jobs' curves (ratio weighted by
/// requests).
fn hit_need(v: &Verdicts, o: &RecommendOptions) -> (u64, f64) {
    let (cached, curve) = (&v.cached, &v.sig.overall.mrc);
    if v.bypassed.is_empty() {
        return (
            curve.size_for_fraction(o.hit_fraction),
            curve.max_hit_ratio(),
        );
    }
    let blocks = cached
        .iter()
        .map(|(s, _)| s.mrc.size_for_fraction(o.hit_fraction))
        .sum();
    let max_hit = cached
        .iter()
        .map(|(s, _)| s.mrc.max_hit_ratio() * s.requests() as f64)
        .sum::<f64>()
        / cached
            .iter()
            .map(|(s, _)| s.requests() as f64)
            .sum::<f64>()
            .max(1.0);
    (blocks, max_hit)
}

/// The cache size (bytes, whole MiB): the larger of what the hit ratio needs and what write
/// bursts pile up; the working set within 64 MiB..1 GiB when neither needs any.
pub(super) fn size_rule(
    mode: CacheMode,
    v: &Verdicts,
    w: &CachedWrites,
    o: &RecommendOptions,
) -> (u64, Reason) {
    let (mrc_blocks, max_hit) = hit_need(v, o);
    let backlog = w.backlog(mode);
    // Modes that insert no reads are sized by their writes alone.
    let mrc_bytes = if mode.caches_reads() {
        mrc_blocks * 4096
    } else {
        0
    };
    let ws: u64 = v.cached.iter().map(|(s, _)| s.working_set.bytes()).sum();
    let (size, text) = if v.cached.is_empty() {
        (0, "no cache needed: nothing is cached".to_string())
    } else if mrc_bytes == 0 && backlog == 0 {
        let s = ws.clamp(64 * MIB, 1 << 30);
        (
            s,
            format!(
                "{}: {} and cleaning keeps up with the writes, so the size hardly matters; this is the cached jobs' {} working set, kept between 64 MiB and 1 GiB",
                bytes(s.div_ceil(MIB) * MIB),
                if mode.caches_reads() {
                    format!("the trace shows no reuse (maximum hit ratio {})", pct(max_hit))
                } else {
                    format!("{} inserts no reads, so hits do not size it", mode.long_name())
                },
                bytes(ws)
            ),
        )
    } else {
        let s = mrc_bytes.max(backlog);
        let mut t = format!("{}: ", bytes(s.div_ceil(MIB) * MIB));
        if mrc_bytes > 0 {
            t += &format!(
                "the miss-ratio curve reaches {} of the achievable {} hit ratio at {}",
                pct(o.hit_fraction),
                pct(max_hit),
                bytes(mrc_bytes)
            );
        }
        if backlog > 0 {
            if mrc_bytes > 0 {
                t += "; ";
            }
            t += &format!(
                "write bursts pile up to {} of dirty data above what cleaning drains at {} MB/s",
                bytes(backlog),
                num(w.drain())
            );
        }
        (s, t)
    };
    let reason = Reason {
        setting: "cache size".into(),
        text,
    };
    (size.div_ceil(MIB) * MIB, reason)
}

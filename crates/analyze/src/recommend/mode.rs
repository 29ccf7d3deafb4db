//! The cache mode: the cached jobs' verdicts combined, then the write-back tail rule.

use super::job::mode_for;
use super::{CacheMode, JobRecommendation, Judged, Reason, Verdicts};
use crate::profile::{DeviceProfile, Dir, Pattern};
use crate::signature::JobSignature;
use crate::units::{num, pct};

/// The mode: writes cached if any cached job caches them, reads by request-weighted majority;
/// then the write-back tail rule, since on a fast core a write-back queue of deferred writes
/// costs more tail latency than it gains (the vendor's RAID-controller measurements, issue 16).
pub(super) fn mode_rule(v: &Verdicts, profile: &DeviceProfile) -> (CacheMode, Reason) {
    let mode = combined_mode(&v.cached);
    let tail = tail_rule(mode, &v.cached, profile);
    let mode = tail.as_ref().map_or(mode, |t| t.0);
    let text = match tail {
        Some((_, text)) => text,
        None => mode_reason(mode, v),
    };
    (
        mode,
        Reason {
            setting: format!("cache mode {}", mode.as_str()),
            text,
        },
    )
}

/// One mode for all cached jobs: a single job's own, else writes cached if any cached job caches
/// them and reads by request-weighted majority.
fn combined_mode(cached: &[Judged]) -> CacheMode {
    let w_any = cached
        .iter()
        .any(|(_, r)| r.writes.as_ref().is_some_and(|w| w.cache));
    let (r_yes, r_no) = cached
        .iter()
        .fold((0u64, 0u64), |(y, n), (s, r)| match &r.reads {
            Some(a) if a.cache => (y + s.reads.requests, n),
            Some(_) => (y, n + s.reads.requests),
            None => (y, n),
        });
    let r_opt = if r_yes + r_no == 0 {
        None
    } else {
        Some(r_yes >= r_no)
    };
    let rewrites = cached.iter().any(|(_, r)| r.mode == CacheMode::Wa);
    if cached.is_empty() {
        CacheMode::Pt
    } else if cached.len() == 1 {
        cached[0].1.mode
    } else {
        let w_opt = if cached.iter().any(|(_, r)| r.writes.is_some()) {
            Some(w_any)
        } else {
            None
        };
        mode_for(w_opt, r_opt, rewrites)
    }
}

/// The mode's reason when the tail rule did not fire: the jobs' own reasons.
fn mode_reason(mode: CacheMode, v: &Verdicts) -> String {
    let (cached, jobs) = (&v.cached, v.jobs);
    if cached.is_empty() {
        if jobs.len() == 1 {
            jobs[0].reason.clone()
        } else {
            format!(
                "pass-through: none of the {} jobs gains from the cache (per-job reasons below)",
                jobs.len()
            )
        }
    } else if cached.len() == 1 && v.bypassed.is_empty() {
        cached[0].1.reason.clone()
    } else {
        format!(
            "{}: the cached jobs ({}; {} of requests) need it: {}",
            mode.long_name(),
            Verdicts::names(cached),
            pct(v.share_of(cached)),
            // The job's reason without its own leading mode name.
            cached[0]
                .1
                .reason
                .split_once(": ")
                .map_or(cached[0].1.reason.as_str(), |x| x.1)
        )
    }
}

/// Why the core counts as fast (flash, or random 4 KiB writes at its deepest measured queue
/// within 4x of the cache's), or None.
pub fn fast_core(profile: &DeviceProfile) -> Option<String> {
    if profile.core.flash {
        return Some(format!("the core ({}) is flash", profile.core.name));
    }
    let deepest = |m: &crate::profile::DeviceModel| {
        let qd = m.max_queue_depth(Pattern::Random, Dir::Write);
        m.estimate(Pattern::Random, Dir::Write, 4096, qd)
            .map(|e| (e.iops, qd))
    };
    let (core, qd) = deepest(&profile.core)?;
    let (cache, _) = deepest(&profile.cache)?;
    (core * 4.0 >= cache).then(|| {
        format!(
            "the core writes random 4 KiB at {} IOPS at iodepth {qd}, within 4x of the cache's {} IOPS",
            num(core),
            num(cache)
        )
    })
}

/// The write-back tail rule fires from this share of the core's deepest random-write IOPS,
/// reached by the cached writes' depth on the core or by their measured peak: the study's tails
/// grew above about 80k IOPS on an array good for about that, where a write-back queue can only
/// grow; below it the queue drains and write-back's absorbed writes win.
const TAIL_LOAD: f64 = 0.5;

/// The write-back tail rule: a mode holding dirty data becomes its write-through sibling (wb ->
/// wt, wo -> pt: wo's reads were not worth caching) when the core is fast and the cached writes
/// load it near its limit, by their depth or their measured rate. Returns the new mode and the
/// reason.
fn tail_rule(
    mode: CacheMode,
    cached: &[(&JobSignature, &JobRecommendation)],
    profile: &DeviceProfile,
) -> Option<(CacheMode, String)> {
    if !mode.dirty() {
        return None;
    }
    let fast = fast_core(profile)?;
    let core_max = profile
        .core
        .estimate(
            Pattern::Random,
            Dir::Write,
            4096,
            profile.core.max_queue_depth(Pattern::Random, Dir::Write),
        )
        .map_or(f64::INFINITY, |e| e.iops);
    let writers: Vec<_> = cached
        .iter()
        .filter(|(_, r)| r.writes.as_ref().is_some_and(|w| w.cache))
        .collect();
    // What the deepest cached writer's depth alone gets from the core.
    let (depth, at_depth) = writers
        .iter()
        .filter_map(|(_, r)| r.writes.as_ref())
        .map(|w| (w.queue_depth, w.core_iops))
        .max_by(|a, b| a.1.total_cmp(&b.1))?;
    let peak: f64 = writers
        .iter()
        .map(|(s, _)| s.timeline.peak_write_iops())
        .sum();
    let limit = TAIL_LOAD * core_max;
    if at_depth < limit && peak < limit {
        return None;
    }
    let to = if mode == CacheMode::Wb {
        CacheMode::Wt
    } else {
        CacheMode::Pt
    };
    Some((
        to,
        format!(
            "{} instead of {} (the write-back tail rule): {fast}, and the cached writes {}; in front of fast SSD arrays a write-back queue of deferred writes made p99.99 latency 10x worse than write-through above about 80k IOPS, and write-through delivered 3-4x the IOPS at a 1 ms mean-latency target",
            to.long_name(),
            mode.long_name(),
            if at_depth >= limit {
                format!(
                    "run at iodepth {depth}, where the core alone gives {} IOPS, {} of the {} IOPS of its deepest queue",
                    num(at_depth),
                    pct(at_depth / core_max),
                    num(core_max)
                )
            } else {
                format!(
                    "peak at {} IOPS, {} of the core's {} IOPS",
                    num(peak),
                    pct(peak / core_max),
                    num(core_max)
                )
            }
        ),
    ))
}

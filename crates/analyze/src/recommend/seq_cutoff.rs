//! The sequential cutoff and IO classes: the two ways the configuration keeps bypassed jobs out
//! of the cache, by their streams or by their request sizes.

use std::collections::BTreeMap;

use super::{pow2_floor, speed, IoClass, Judged, Reason, SeqCutoff, SeqCutoffPolicy, Verdicts};
use crate::profile::Pattern;
use crate::signature::{ratio, JobSignature};
use crate::units::{bytes, factor, pct};

/// Sizes with a non-negligible share of a job's requests in the given directions.
fn common_sizes(sig: &JobSignature, reads: bool, writes: bool) -> Vec<u64> {
    let mut m: BTreeMap<u64, u64> = BTreeMap::new();
    let mut total = 0;
    if reads {
        for (s, n) in &sig.reads.sizes {
            *m.entry(*s).or_default() += n;
            total += n;
        }
    }
    if writes {
        for (s, n) in &sig.writes.sizes {
            *m.entry(*s).or_default() += n;
            total += n;
        }
    }
    m.into_iter()
        .filter(|(_, n)| *n * 100 >= total)
        .map(|(s, _)| s)
        .collect()
}

/// The largest common request size of the cached jobs (reads only where their mode inserts
/// them), 0 when none.
fn cached_max(v: &Verdicts) -> u64 {
    v.cached
        .iter()
        .flat_map(|(s, r)| common_sizes(s, r.mode.caches_reads(), true))
        .max()
        .unwrap_or(0)
}

/// The smallest common request size of the bypassed jobs, 0 when none.
fn bypass_min(v: &Verdicts) -> u64 {
    v.bypassed
        .iter()
        .flat_map(|(s, _)| common_sizes(s, true, true))
        .min()
        .unwrap_or(0)
}

/// Whether the job's main direction (writes on a tie) is sequential.
fn job_sequential(s: &JobSignature, r: &super::JobRecommendation) -> bool {
    let w = r.writes.as_ref().map(|w| w.pattern == Pattern::Sequential);
    let rd = r.reads.as_ref().map(|x| x.pattern == Pattern::Sequential);
    match (w, rd) {
        (Some(a), Some(b)) => {
            if s.write_share() >= s.read_share() {
                a
            } else {
                b
            }
        }
        (Some(a), None) => a,
        (None, Some(b)) => b,
        _ => false,
    }
}

/// The first job's sequential stream and what the core makes of it.
fn describe(v: &[Judged]) -> String {
    let (s, r) = v[0];
    let (pat, blk, qd, core) = match (&r.writes, &r.reads) {
        (Some(w), _) if s.write_share() >= s.read_share() => (
            "writes",
            w.block,
            w.queue_depth,
            speed(w.core_mb_s, w.block),
        ),
        (_, Some(x)) => ("reads", x.block, x.queue_depth, speed(x.core_mb_s, x.block)),
        (Some(w), None) => (
            "writes",
            w.block,
            w.queue_depth,
            speed(w.core_mb_s, w.block),
        ),
        (None, None) => (
            "requests",
            s.dominant_size(),
            s.queue_depth.effective(),
            String::from("?"),
        ),
    };
    format!(
        "{}'s sequential {} {pat} at iodepth {qd} run at {core} on the core",
        s.name,
        bytes(blk)
    )
}

/// The sequential cutoff: always, just above the cached jobs' requests, when only bypassed jobs
/// are sequential; never when a cached job gains from its sequential IO; else the default.
pub(super) fn seq_cutoff_rule(v: &Verdicts) -> (SeqCutoff, Reason) {
    let bypass_seq: Vec<_> = v
        .bypassed
        .iter()
        .filter(|(s, r)| job_sequential(s, r))
        .copied()
        .collect();
    let cached_seq: Vec<_> = v
        .cached
        .iter()
        .filter(|(s, r)| {
            let w = r
                .writes
                .as_ref()
                .is_some_and(|w| w.cache && w.pattern == Pattern::Sequential);
            let rd = r
                .reads
                .as_ref()
                .is_some_and(|x| x.cache && x.pattern == Pattern::Sequential);
            (w || rd) && job_sequential(s, r)
        })
        .copied()
        .collect();
    if !bypass_seq.is_empty() && cached_seq.is_empty() {
        cutoff_always(v, &bypass_seq)
    } else if !cached_seq.is_empty() {
        let reason = Reason {
            setting: "seq-cutoff never".into(),
            text: format!(
                "never: {} gains from caching its sequential IO ({}), which a cutoff would send to the core{}",
                cached_seq[0].0.name,
                cached_seq[0].1.writes.as_ref().map_or_else(|| "reads".to_string(), |w| factor(w.gain)),
                if bypass_seq.is_empty() { "" } else { "; the bypassed sequential jobs are kept out by IO class instead, if sizes allow" }
            ),
        };
        let cutoff = SeqCutoff {
            policy: SeqCutoffPolicy::Never,
            threshold: 1024,
        };
        (cutoff, reason)
    } else {
        let overall = &v.sig.overall;
        let reason = Reason {
            setting: "seq-cutoff full".into(),
            text: format!(
                "full (the default, 1024 KiB): {} of requests are sequential and no job needs sequential IO kept out, so streams are cut off only when the cache is nearly full",
                pct(ratio(
                    overall.reads.sequential + overall.writes.sequential,
                    overall.requests()
                ))
            ),
        };
        let cutoff = SeqCutoff {
            policy: SeqCutoffPolicy::Full,
            threshold: 1024,
        };
        (cutoff, reason)
    }
}

/// Cutoff always, at twice the cached jobs' largest request (16 KiB at least), so only the
/// bypassed sequential jobs' streams go to the core.
fn cutoff_always(v: &Verdicts, bypass_seq: &[Judged]) -> (SeqCutoff, Reason) {
    let cached_max = cached_max(v);
    let thr = (2 * cached_max / 1024)
        .max(16)
        .next_power_of_two()
        .min(1 << 20) as u32;
    let thr = if v.cached.is_empty() { 16 } else { thr };
    let reason = Reason {
        setting: format!("seq-cutoff always {thr} KiB"),
        text: format!(
            "always at {thr} KiB: {}, more than the cache can absorb and clean{}",
            describe(bypass_seq),
            if v.cached.is_empty() {
                String::new()
            } else {
                format!(
                    "; no cached job is sequential (their requests are at most {}), so cutting streams after {thr} KiB sends only the bypassed jobs to the core",
                    bytes(cached_max)
                )
            }
        ),
    };
    let cutoff = SeqCutoff {
        policy: SeqCutoffPolicy::Always,
        threshold: thr,
    };
    (cutoff, reason)
}

/// IO classes: cache only requests up to a size bound when every bypassed job's requests lie
/// above every cached job's.
pub(super) fn io_class_rule(v: &Verdicts) -> (Vec<IoClass>, Reason) {
    let (cached_max, bypass_min) = (cached_max(v), bypass_min(v));
    if v.bypassed.is_empty() || v.cached.is_empty() {
        let reason = Reason {
            setting: "io classes none".into(),
            text: if v.cached.is_empty() {
                "no IO class rules: nothing is cached".into()
            } else {
                "no IO class rules: every job is worth caching".into()
            },
        };
        return (Vec::new(), reason);
    }
    if cached_max == 0 || cached_max >= bypass_min {
        let reason = Reason {
            setting: "io classes none".into(),
            text: format!(
                "no IO class rules: the bypassed jobs' request sizes (from {}) overlap the cached jobs' (up to {}), so size cannot tell them apart on a block device",
                bytes(bypass_min),
                bytes(cached_max)
            ),
        };
        return (Vec::new(), reason);
    }
    let bound = pow2_floor(bypass_min - 1).max(cached_max);
    let classes = vec![
        IoClass {
            id: 0,
            name: "unclassified".into(),
            eviction_priority: Some(22),
            allocation: 0.0,
        },
        IoClass {
            id: 1,
            name: format!("request_size:le:{bound}"),
            eviction_priority: Some(1),
            allocation: 1.0,
        },
    ];
    let reason = Reason {
        setting: format!("io class request_size:le:{bound}"),
        text: format!(
            "IO classes cache requests of at most {} only: the cached jobs' requests are at most {} and the bypassed jobs' ({}) at least {}",
            bytes(bound),
            bytes(cached_max),
            Verdicts::names(&v.bypassed),
            bytes(bypass_min)
        ),
    };
    (classes, reason)
}

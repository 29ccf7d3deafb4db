//! One job judged on its own: whether the cache makes its writes and its reads faster than the
//! core alone, and the mode that follows (the first three points of the parent module's comment).

use super::{
    speed, CacheMode, Decision, JobRecommendation, ReadAhead, ReadAnalysis, RecommendOptions,
    WriteAnalysis,
};
use crate::profile::{DeviceProfile, Dir, Pattern};
use crate::signature::{ratio, JobSignature};
use crate::units::{bytes, factor, num, pct};

/// The first-read penalty: how much longer a read miss that is inserted takes than the same
/// read on the core alone. The engine writes the block into the cache before it completes the
/// read, so the miss costs the core read plus a cache write of the same size at the same depth:
/// 1 + core read speed / cache write speed.
fn miss_penalty(p: &DeviceProfile, pattern: Pattern, block: u64, qd: u32, core_mb_s: f64) -> f64 {
    p.cache
        .estimate(pattern, Dir::Write, block, qd)
        .map_or(f64::INFINITY, |w| 1.0 + core_mb_s / w.mb_s.max(1e-9))
}

/// Jobs that read and write at least this share each count as mixed.
const MIXED_SHARE: f64 = 0.2;

fn pattern_of(random_share: f64) -> Pattern {
    if random_share >= 0.5 {
        Pattern::Random
    } else {
        Pattern::Sequential
    }
}

fn pat_word(p: Pattern) -> &'static str {
    match p {
        Pattern::Random => "random",
        Pattern::Sequential => "sequential",
    }
}

fn analyze_writes(
    sig: &JobSignature,
    p: &DeviceProfile,
    o: &RecommendOptions,
) -> Option<WriteAnalysis> {
    if sig.write_share() < o.min_share || sig.writes.requests == 0 {
        return None;
    }
    let pattern = pattern_of(sig.writes.random_share());
    let block = sig.writes.dominant_size().max(512);
    let qd = sig.queue_depth.effective();
    let mixed = sig.read_share() >= MIXED_SHARE && sig.write_share() >= MIXED_SHARE;
    let wqd = if mixed {
        ((qd as f64 * sig.write_share()).round() as u32).max(1)
    } else {
        qd
    };
    let core = p.core.estimate(pattern, Dir::Write, block, wqd)?;
    let absorb = p.cache.estimate(pattern, Dir::Write, block, qd)?;
    let drain_qd = p.core.max_queue_depth(pattern, Dir::Write);
    let drain_block = match pattern {
        Pattern::Random => block,
        Pattern::Sequential => block.max(p.core.max_block(Pattern::Sequential, Dir::Write)),
    };
    let mut drain = p
        .core
        .estimate(pattern, Dir::Write, drain_block, drain_qd)?
        .mb_s;
    if let Some(limit) = p.cleaning_limit_mb_s {
        drain = drain.min(limit);
    }
    let gain = absorb.mb_s.min(drain) / core.mb_s.max(1e-9);
    Some(WriteAnalysis {
        pattern,
        block,
        queue_depth: wqd,
        core_mb_s: core.mb_s,
        core_iops: core.iops,
        absorb_mb_s: absorb.mb_s,
        drain_mb_s: drain,
        drain_queue_depth: drain_qd,
        gain,
        cache: gain >= o.min_gain,
    })
}

fn analyze_reads(
    sig: &JobSignature,
    p: &DeviceProfile,
    o: &RecommendOptions,
) -> Option<ReadAnalysis> {
    if sig.read_share() < o.min_share || sig.reads.requests == 0 {
        return None;
    }
    let pattern = pattern_of(sig.reads.random_share());
    let block = sig.reads.dominant_size().max(512);
    let qd = sig.queue_depth.effective();
    let mixed = sig.read_share() >= MIXED_SHARE && sig.write_share() >= MIXED_SHARE;
    let rqd = if mixed {
        ((qd as f64 * sig.read_share()).round() as u32).max(1)
    } else {
        qd
    };
    let core = p.core.estimate(pattern, Dir::Read, block, rqd)?;
    let cache = p.cache.estimate(pattern, Dir::Read, block, rqd)?;
    let h = sig.reads.reuse_share();
    let penalty = miss_penalty(p, pattern, block, rqd, core.mb_s);
    let t = h / cache.mb_s.max(1e-9) + (1.0 - h) * penalty / core.mb_s.max(1e-9);
    let mut gain = (1.0 / core.mb_s.max(1e-9)) / t;
    let mut nhit = false;
    if let Some(g) = nhit_gain(sig, core.mb_s, cache.mb_s, penalty) {
        if g > gain * 1.05 {
            gain = g;
            nhit = true;
        }
    }
    let mut readahead_mb_s = None;
    if pattern == Pattern::Sequential {
        if let Some((g, feed)) = readahead_gain(p, block, h, core.mb_s, cache.mb_s) {
            if g > gain {
                gain = g;
                readahead_mb_s = Some(feed);
                nhit = false;
            }
        }
    }
    Some(ReadAnalysis {
        pattern,
        block,
        queue_depth: rqd,
        core_mb_s: core.mb_s,
        cache_mb_s: cache.mb_s,
        reuse: h,
        miss_penalty: penalty,
        gain,
        cache: gain >= o.min_gain,
        readahead_mb_s,
        nhit,
    })
}

/// The reads' gain with nhit 2: every first access passes through at the core's speed without
/// the penalty, a re-read block's second access is the penalised miss, and only later accesses
/// hit. None when the job references no blocks.
fn nhit_gain(sig: &JobSignature, core_mb_s: f64, cache_mb_s: f64, penalty: f64) -> Option<f64> {
    let refs = sig.reads.block_refs as f64;
    if refs <= 0.0 {
        return None;
    }
    let reused = sig.reads.reused_refs as f64;
    let twice = (sig
        .working_set
        .read_blocks
        .saturating_sub(sig.working_set.read_once_blocks) as f64)
        .min(reused);
    let t_n = ((reused - twice) / cache_mb_s.max(1e-9)
        + (refs - reused) / core_mb_s.max(1e-9)
        + twice * penalty / core_mb_s.max(1e-9))
        / refs;
    Some((1.0 / core_mb_s.max(1e-9)) / t_n)
}

/// The gain of a sequential stream with read-ahead, and the speed prefetch feeds it at: its
/// misses can be fetched ahead of it in `distance`-sized requests, `max-in-flight` deep, which a
/// core serves faster than the client's own small reads at its depth; the client then reads at
/// what prefetch delivers (no faster than the cache).
fn readahead_gain(
    p: &DeviceProfile,
    block: u64,
    reuse: f64,
    core_mb_s: f64,
    cache_mb_s: f64,
) -> Option<(f64, f64)> {
    let ra = ReadAhead::for_block(block);
    let e = p.core.estimate(
        Pattern::Sequential,
        Dir::Read,
        ra.distance as u64 * 1024,
        ra.max_in_flight,
    )?;
    let feed = e.mb_s.min(cache_mb_s);
    // The prefetcher inserts what it fetched before the stream reads it from the cache.
    let ra_penalty = miss_penalty(
        p,
        Pattern::Sequential,
        ra.distance as u64 * 1024,
        ra.max_in_flight,
        feed,
    );
    let t_ra = reuse / cache_mb_s.max(1e-9) + (1.0 - reuse) * ra_penalty / feed.max(1e-9);
    Some(((1.0 / core_mb_s.max(1e-9)) / t_ra, feed))
}

/// Mode from (writes cached?, reads cached?), as the module comment says.
pub(super) fn mode_for(w: Option<bool>, r: Option<bool>, rewrites_read: bool) -> CacheMode {
    match (w, r) {
        (Some(true), Some(true)) | (Some(true), None) => CacheMode::Wb,
        (Some(true), Some(false)) => CacheMode::Wo,
        (Some(false), Some(true)) if rewrites_read => CacheMode::Wa,
        (Some(false), Some(true)) => CacheMode::Wi,
        (None, Some(true)) => CacheMode::Wt,
        _ => CacheMode::Pt,
    }
}

fn write_sentence(sig: &JobSignature, w: &WriteAnalysis) -> String {
    let share = match w.pattern {
        Pattern::Random => sig.writes.random_share(),
        Pattern::Sequential => sig.writes.sequential_share(),
    };
    format!(
        "{} of requests are writes and {} of writes are {} {}, which the core serves at {} at iodepth {}",
        pct(sig.write_share()),
        pct(share),
        pat_word(w.pattern),
        bytes(w.block),
        speed(w.core_mb_s, w.block),
        w.queue_depth
    )
}

fn read_sentence(sig: &JobSignature, r: &ReadAnalysis) -> String {
    format!(
        "{} of requests are reads, {} {} at iodepth {} ({} on the core), and {} of reads went to blocks touched before",
        pct(sig.read_share()),
        pat_word(r.pattern),
        bytes(r.block),
        r.queue_depth,
        speed(r.core_mb_s, r.block),
        pct(r.reuse)
    )
}

fn drain_clause(w: &WriteAnalysis) -> String {
    format!(
        "the cache absorbs them at {} and cleaning drains them at {} (iodepth {}), {} the core",
        speed(w.absorb_mb_s, w.block),
        speed(w.drain_mb_s, w.block),
        w.drain_queue_depth,
        factor(w.gain)
    )
}

/// Judges one job.
pub fn recommend_job(
    sig: &JobSignature,
    profile: &DeviceProfile,
    o: &RecommendOptions,
) -> JobRecommendation {
    let writes = analyze_writes(sig, profile, o);
    let mut reads = analyze_reads(sig, profile, o);
    // With the writes cached the cache exists anyway: inserting the reads (wb rather than wo)
    // needs only to be no slower than leaving them to the core.
    let writes_cached = writes.as_ref().is_some_and(|w| w.cache);
    if let Some(r) = reads.as_mut() {
        if writes_cached && !r.cache && r.gain >= 1.0 {
            r.cache = true;
        }
    }
    let rewrites_read = ratio(
        sig.working_set.read_write_blocks,
        sig.working_set.write_blocks,
    ) >= 0.3;
    let mode = mode_for(
        writes.as_ref().map(|w| w.cache),
        reads.as_ref().map(|r| r.cache),
        rewrites_read,
    );
    let decision = if mode == CacheMode::Pt {
        Decision::Bypass
    } else {
        Decision::Cache
    };
    let name = mode.long_name();
    let reason = match (mode, &writes, &reads) {
        (CacheMode::Wb, Some(w), r) => write_back_reason(sig, w, r.as_ref(), o),
        (CacheMode::Wo, Some(w), Some(r)) => format!(
            "{name}: mixed random read/write ({} reads / {} writes); writes gain {} ({} in the mix on the core, cleaning drains {}), but only {} of reads went to blocks touched before, so inserting reads would mostly add the first-read penalty ({:.2}x the core read: the cache writes {} as fast as the core reads) and slow them to {:.2}x",
            pct(sig.read_share()),
            pct(sig.write_share()),
            factor(w.gain),
            speed(w.core_mb_s, w.block),
            speed(w.drain_mb_s, w.block),
            pct(r.reuse),
            r.miss_penalty,
            factor(1.0 / (r.miss_penalty - 1.0).max(1e-9)),
            r.gain
        ),
        (CacheMode::Wt | CacheMode::Wa | CacheMode::Wi, _, Some(r)) => {
            read_mode_reason(sig, mode, writes.as_ref(), r)
        }
        _ => bypass_reason(sig, writes.as_ref(), reads.as_ref()),
    };
    JobRecommendation {
        job: sig.name.clone(),
        decision,
        mode,
        writes,
        reads,
        reason,
    }
}

/// Why write-back: the writes, how cleaning drains them, and what inserting the reads gains.
fn write_back_reason(
    sig: &JobSignature,
    w: &WriteAnalysis,
    r: Option<&ReadAnalysis>,
    o: &RecommendOptions,
) -> String {
    let name = CacheMode::Wb.long_name();
    let mut s = format!("{name}: {}; {}", write_sentence(sig, w), drain_clause(w));
    if let Some(r) = r {
        let gain = if r.gain < o.min_gain {
            format!("{:.2}x", r.gain)
        } else {
            factor(r.gain)
        };
        s += &format!(
            "; reads gain {gain} because {} of reads went to blocks touched before",
            pct(r.reuse)
        );
        if r.gain < o.min_gain {
            s += &format!(
                ", and the cache is there for the writes anyway: a first read costs only {:.2}x the core read, since the cache writes {} as fast as the core reads",
                r.miss_penalty,
                factor(1.0 / (r.miss_penalty - 1.0).max(1e-9))
            );
        }
    }
    s
}

/// Why a mode that caches reads only (wt, wa, wi): what the reads gain, and where the writes go.
fn read_mode_reason(
    sig: &JobSignature,
    mode: CacheMode,
    writes: Option<&WriteAnalysis>,
    r: &ReadAnalysis,
) -> String {
    let mut s = format!(
        "{}: {}, so the cache gives reads {}",
        mode.long_name(),
        read_sentence(sig, r),
        factor(r.gain)
    );
    if let Some(ra) = r.readahead_mb_s {
        s += &format!(
            " with read-ahead feeding the stream at {} MB/s from the core",
            num(ra)
        );
    }
    match (writes, mode) {
        (Some(w), CacheMode::Wa) => s += &format!("; writes gain only {} so they go to the core, and {} of written blocks are also read, so mapped lines are updated", factor(w.gain), pct(ratio(sig.working_set.read_write_blocks, sig.working_set.write_blocks))),
        (Some(w), CacheMode::Wi) => s += &format!("; writes gain only {} so they go to the core, and few written blocks are read, so mapped lines are just invalidated", factor(w.gain)),
        _ => s += "; writes are too few to matter",
    }
    s
}

/// Why the job is left on the core: what the cache would give its writes and its reads.
fn bypass_reason(
    sig: &JobSignature,
    writes: Option<&WriteAnalysis>,
    reads: Option<&ReadAnalysis>,
) -> String {
    let mut parts = Vec::new();
    if let Some(w) = writes {
        parts.push(format!(
            "{}; the cache could absorb and clean them at only {}, {} the core",
            write_sentence(sig, w),
            speed(w.absorb_mb_s.min(w.drain_mb_s), w.block),
            factor(w.gain)
        ));
    }
    if let Some(r) = reads {
        parts.push(format!(
            "{}, so caching reads gives {}",
            read_sentence(sig, r),
            factor(r.gain)
        ));
    }
    if parts.is_empty() {
        parts.push("no reads or writes to judge".into());
    }
    format!("bypass: {}", parts.join("; "))
}

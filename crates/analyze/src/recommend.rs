//! From signatures and a device profile to a cache configuration, every choice with its reason.
//!
//! The rules compare speeds looked up in the [`DeviceProfile`], never fixed tables:
//!
//! - Writes of a job are worth caching when the speed a cache sustains for them beats the core:
//!   sustained = min(what the cache device absorbs at the job's pattern and depth, what cleaning
//!   drains to the core: the same pattern at the deepest measured depth, sequential data merged
//!   into the largest measured block), gain = sustained / core speed at the job's depth. Under
//!   steady load a write-back cache runs at its cleaning rate (domain.md §9), which is why
//!   deep-queue large sequential writes (5415 MB/s on the study's RAID) lose and random 4 KiB
//!   writes at depth 1 (63 IOPS) gain most. In a mixed job the writes hold only their share of
//!   the queue, so the core baseline is taken at that share of the depth.
//! - Reads are worth caching when hits pay for misses: time per byte = h / cache + (1 - h) x
//!   penalty / core, with h the share of read references to blocks touched before and the
//!   first-read penalty = 1 + core read speed / cache write speed (at the reads' block and
//!   depth): the engine writes a missed block into the cache before it completes the read, so
//!   a miss costs the core read plus that cache write (§9's flashcache users saw 1.25 with a
//!   cache four times the core; a RAM cache in front of an HDD RAID costs ~1.02).
//! - Mode from (writes cached?, reads cached?): both -> wb, writes only -> wo (wb when the job
//!   has no reads), reads only -> wt (wa when written blocks are re-read, wi when not, if the
//!   job writes), neither -> pt. When the writes are cached, the cache is there anyway and the
//!   reads decide only between wb and wo: they are inserted when that is no slower than
//!   leaving them to the core (read gain >= 1), not only when it gains the 1.2x that pays for
//!   a cache.
//! - A job is bypassed when its mode is pt; the overall configuration keeps bypassed jobs out
//!   with the sequential cutoff (when they are sequential and no cached job is) and IO classes
//!   (when their request sizes lie above all cached ones).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::profile::{DeviceProfile, Dir, Pattern};
use crate::signature::{ratio, JobSignature, Signature, Timeline};
use crate::units::{bytes, factor, num, pct};

/// Cache modes (Open CAS names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CacheMode {
    Wt,
    Wb,
    Wa,
    Wi,
    Wo,
    Pt,
}

impl CacheMode {
    pub fn as_str(self) -> &'static str {
        match self {
            CacheMode::Wt => "wt",
            CacheMode::Wb => "wb",
            CacheMode::Wa => "wa",
            CacheMode::Wi => "wi",
            CacheMode::Wo => "wo",
            CacheMode::Pt => "pt",
        }
    }
    pub fn long_name(self) -> &'static str {
        match self {
            CacheMode::Wt => "write-through",
            CacheMode::Wb => "write-back",
            CacheMode::Wa => "write-around",
            CacheMode::Wi => "write-invalidate",
            CacheMode::Wo => "write-only",
            CacheMode::Pt => "pass-through",
        }
    }
    /// Whether the mode can hold dirty data (and so needs cleaning).
    pub fn dirty(self) -> bool {
        matches!(self, CacheMode::Wb | CacheMode::Wo)
    }
    /// Whether read misses are inserted.
    pub fn caches_reads(self) -> bool {
        matches!(
            self,
            CacheMode::Wt | CacheMode::Wb | CacheMode::Wa | CacheMode::Wi
        )
    }
}

/// Cache it or leave it on the core.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Decision {
    Cache,
    Bypass,
}

/// alru parameters, Open CAS names and units.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct AlruParams {
    /// s
    pub wake_up: u32,
    /// s
    pub staleness_time: u32,
    pub flush_max_buffers: u32,
    /// ms
    pub activity_threshold: u32,
    /// %, 100 = off
    pub dirty_ratio_threshold: u32,
}

impl AlruParams {
    pub const DEFAULT: AlruParams = AlruParams {
        wake_up: 20,
        staleness_time: 120,
        flush_max_buffers: 100,
        activity_threshold: 10_000,
        dirty_ratio_threshold: 100,
    };
    pub const VERY_AGGRESSIVE: AlruParams = AlruParams {
        wake_up: 0,
        staleness_time: 1,
        flush_max_buffers: 8192,
        activity_threshold: 0,
        dirty_ratio_threshold: 100,
    };
    pub const LAZY: AlruParams = AlruParams {
        wake_up: 2,
        staleness_time: 5,
        flush_max_buffers: 256,
        activity_threshold: 500,
        dirty_ratio_threshold: 100,
    };
}

/// acp parameters, Open CAS names and units.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct AcpParams {
    /// ms
    pub wake_up: u32,
    pub flush_max_buffers: u32,
}

impl AcpParams {
    pub const DEFAULT: AcpParams = AcpParams {
        wake_up: 10,
        flush_max_buffers: 128,
    };
    pub const VERY_AGGRESSIVE: AcpParams = AcpParams {
        wake_up: 1,
        flush_max_buffers: 8192,
    };
}

/// Cleaning policy with its parameters.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "policy")]
pub enum Cleaning {
    Nop,
    Alru(AlruParams),
    Acp(AcpParams),
}

impl Cleaning {
    pub fn name(&self) -> &'static str {
        match self {
            Cleaning::Nop => "nop",
            Cleaning::Alru(_) => "alru",
            Cleaning::Acp(_) => "acp",
        }
    }
    /// The named preset these parameters are, if any.
    pub fn preset(&self) -> Option<&'static str> {
        match self {
            Cleaning::Alru(p) if *p == AlruParams::VERY_AGGRESSIVE => Some("alru-very-aggressive"),
            Cleaning::Alru(p) if *p == AlruParams::LAZY => Some("alru-lazy"),
            Cleaning::Acp(p) if *p == AcpParams::VERY_AGGRESSIVE => Some("acp-very-aggressive"),
            _ => None,
        }
    }
    /// Whether this cleans as fast as it can while clients are busy.
    pub fn is_aggressive(&self) -> bool {
        match self {
            Cleaning::Alru(p) => p.activity_threshold == 0 && p.staleness_time <= 1,
            Cleaning::Acp(p) => p.flush_max_buffers >= 1024,
            Cleaning::Nop => false,
        }
    }
}

/// Sequential cutoff policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SeqCutoffPolicy {
    Always,
    Full,
    Never,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeqCutoff {
    pub policy: SeqCutoffPolicy,
    /// KiB
    pub threshold: u32,
}

impl SeqCutoffPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            SeqCutoffPolicy::Always => "always",
            SeqCutoffPolicy::Full => "full",
            SeqCutoffPolicy::Never => "never",
        }
    }
}

/// Promotion policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase", tag = "policy")]
pub enum Promotion {
    Always,
    Nhit {
        threshold: u32,
        /// %
        trigger: u32,
    },
}

/// Read-ahead (`-n prefetch -p readahead`, `-n prefetch-readahead`), Open CAS v26.09's names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct ReadAhead {
    /// KiB a stream must have read before read-ahead starts.
    pub threshold: u32,
    /// KiB read ahead of the stream.
    pub distance: u32,
    /// Prefetch requests queued or running per cache.
    pub max_in_flight: u32,
}

impl ReadAhead {
    /// The settings for a stream of `block`-byte reads: it must have read four requests
    /// (at least 64 KiB, at most 1 MiB) before it counts, so a few neighbouring random reads
    /// start nothing; the distance covers at least eight requests ahead (1 MiB at least), and
    /// the daemon's default of 4 requests in flight keeps prefetch from crowding out clients.
    pub fn for_block(block: u64) -> ReadAhead {
        let kib = (block / 1024).max(4);
        ReadAhead {
            threshold: (4 * kib).clamp(64, 1024).next_power_of_two() as u32,
            distance: (8 * kib).clamp(1024, 32768).next_power_of_two() as u32,
            max_in_flight: 4,
        }
    }
}

/// Offload (`-n offload -p on`, `-n offload-queue`): a share of clean read hits and write
/// misses goes to the core while the cache device's queue is deeper than the core's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub struct Offload {
    /// % of eligible requests.
    pub share: u32,
    /// Cache queue depth minus the core's, at least.
    pub threshold: u32,
}

/// One IO class (a line of Open CAS's CSV).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct IoClass {
    pub id: u32,
    pub name: String,
    /// None = pinned.
    pub eviction_priority: Option<u8>,
    pub allocation: f64,
}

impl IoClass {
    pub fn csv_line(&self) -> String {
        let prio = self
            .eviction_priority
            .map(|p| p.to_string())
            .unwrap_or_default();
        let alloc = if self.allocation == self.allocation.round() {
            format!("{}", self.allocation as u32)
        } else {
            format!("{:.2}", self.allocation)
        };
        format!("{},{},{},{}", self.id, self.name, prio, alloc)
    }
}

/// The configuration, serializable.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CacheConfig {
    pub mode: CacheMode,
    pub line_size_kib: u32,
    /// Recommended cache size.
    pub cache_size_bytes: u64,
    pub cleaning: Cleaning,
    pub seq_cutoff: SeqCutoff,
    pub promotion: Promotion,
    /// Empty: no IO class rules needed.
    pub io_classes: Vec<IoClass>,
    /// Write misses that find no clean line go to the core instead of waiting for cleaning.
    #[serde(default)]
    pub lazy_flush: bool,
    /// Read-ahead; None: `prefetch none`.
    #[serde(default)]
    pub prefetch: Option<ReadAhead>,
    /// Offload to a fast core; None: off.
    #[serde(default)]
    pub offload: Option<Offload>,
}

/// A setting and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reason {
    pub setting: String,
    pub text: String,
}

/// What the rules found for a job's writes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct WriteAnalysis {
    pub pattern: Pattern,
    pub block: u64,
    pub queue_depth: u32,
    pub core_mb_s: f64,
    pub core_iops: f64,
    pub absorb_mb_s: f64,
    pub drain_mb_s: f64,
    pub drain_queue_depth: u32,
    pub gain: f64,
    pub cache: bool,
}

/// What the rules found for a job's reads.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ReadAnalysis {
    pub pattern: Pattern,
    pub block: u64,
    pub queue_depth: u32,
    pub core_mb_s: f64,
    pub cache_mb_s: f64,
    pub reuse: f64,
    /// The first-read penalty: 1 + core read speed / cache write speed.
    #[serde(default)]
    pub miss_penalty: f64,
    pub gain: f64,
    pub cache: bool,
    /// Sequential reads: the speed read-ahead's large, deep core reads would feed the stream at
    /// (MB/s), when it gains more than caching alone.
    #[serde(default)]
    pub readahead_mb_s: Option<f64>,
    /// Inserting a block only on its second access (nhit 2) gains more than inserting every
    /// miss: the one-time reads then skip the first-read penalty.
    #[serde(default)]
    pub nhit: bool,
}

/// The verdict for one job.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobRecommendation {
    pub job: String,
    pub decision: Decision,
    pub mode: CacheMode,
    pub writes: Option<WriteAnalysis>,
    pub reads: Option<ReadAnalysis>,
    pub reason: String,
}

/// Knobs of the rules.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct RecommendOptions {
    /// A direction is cached only when the cache makes it at least this much faster.
    pub min_gain: f64,
    /// The cache size reaches this fraction of the achievable hit ratio.
    pub hit_fraction: f64,
    /// Directions below this share of a job's requests are not judged.
    pub min_share: f64,
}

impl Default for RecommendOptions {
    fn default() -> Self {
        RecommendOptions {
            min_gain: 1.2,
            hit_fraction: 0.9,
            min_share: 0.05,
        }
    }
}

/// The result: per job and overall, with reasons.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Recommendation {
    pub profile: String,
    pub jobs: Vec<JobRecommendation>,
    /// The whole trace judged as one job (what a cache would see without classes).
    pub overall_job: JobRecommendation,
    pub config: CacheConfig,
    /// One per setting of `config`, in the order of the commands.
    pub reasons: Vec<Reason>,
    /// Cache size (4 KiB blocks) at the knee of the miss-ratio curve, and its hit ratio.
    pub knee: Option<(u64, f64)>,
}

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

/// `63 IOPS` for small blocks, `5415 MB/s` for large ones (how fio users read them).
fn speed(mb_s: f64, block: u64) -> String {
    if block <= 16384 {
        format!("{} IOPS", num(mb_s * 1e6 / block as f64))
    } else {
        format!("{} MB/s", num(mb_s))
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
    // nhit 2: every first access passes through at the core's speed without the penalty, a
    // re-read block's second access is the penalised miss, and only later accesses hit.
    let mut nhit = false;
    let refs = sig.reads.block_refs as f64;
    if refs > 0.0 {
        let reused = sig.reads.reused_refs as f64;
        let twice = (sig
            .working_set
            .read_blocks
            .saturating_sub(sig.working_set.read_once_blocks) as f64)
            .min(reused);
        let t_n = ((reused - twice) / cache.mb_s.max(1e-9)
            + (refs - reused) / core.mb_s.max(1e-9)
            + twice * penalty / core.mb_s.max(1e-9))
            / refs;
        let g = (1.0 / core.mb_s.max(1e-9)) / t_n;
        if g > gain * 1.05 {
            gain = g;
            nhit = true;
        }
    }
    // A sequential stream's misses can be fetched ahead of it in `distance`-sized requests,
    // `max-in-flight` deep, which a core serves faster than the client's own small reads at its
    // depth; the client then reads at what prefetch delivers (no faster than the cache).
    let mut readahead_mb_s = None;
    if pattern == Pattern::Sequential {
        let ra = ReadAhead::for_block(block);
        if let Some(e) = p.core.estimate(
            Pattern::Sequential,
            Dir::Read,
            ra.distance as u64 * 1024,
            ra.max_in_flight,
        ) {
            let feed = e.mb_s.min(cache.mb_s);
            // The prefetcher inserts what it fetched before the stream reads it from the cache.
            let ra_penalty = miss_penalty(
                p,
                Pattern::Sequential,
                ra.distance as u64 * 1024,
                ra.max_in_flight,
                feed,
            );
            let t_ra = h / cache.mb_s.max(1e-9) + (1.0 - h) * ra_penalty / feed.max(1e-9);
            let g = (1.0 / core.mb_s.max(1e-9)) / t_ra;
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

fn mode_for(w: Option<bool>, r: Option<bool>, rewrites_read: bool) -> CacheMode {
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
        (CacheMode::Wb, Some(w), r) => {
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
            let mut s = format!(
                "{name}: {}, so the cache gives reads {}",
                read_sentence(sig, r),
                factor(r.gain)
            );
            if let Some(ra) = r.readahead_mb_s {
                s += &format!(
                    " with read-ahead feeding the stream at {} MB/s from the core",
                    num(ra)
                );
            }
            match (&writes, mode) {
                (Some(w), CacheMode::Wa) => s += &format!("; writes gain only {} so they go to the core, and {} of written blocks are also read, so mapped lines are updated", factor(w.gain), pct(ratio(sig.working_set.read_write_blocks, sig.working_set.write_blocks))),
                (Some(w), CacheMode::Wi) => s += &format!("; writes gain only {} so they go to the core, and few written blocks are read, so mapped lines are just invalidated", factor(w.gain)),
                _ => s += "; writes are too few to matter",
            }
            s
        }
        _ => {
            let mut parts = Vec::new();
            if let Some(w) = &writes {
                parts.push(format!(
                    "{}; the cache could absorb and clean them at only {}, {} the core",
                    write_sentence(sig, w),
                    speed(w.absorb_mb_s.min(w.drain_mb_s), w.block),
                    factor(w.gain)
                ));
            }
            if let Some(r) = &reads {
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

/// Recommends with default options.
pub fn recommend(sig: &Signature, profile: &DeviceProfile) -> Recommendation {
    recommend_with(sig, profile, &RecommendOptions::default())
}

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

fn pow2_floor(x: u64) -> u64 {
    if x == 0 {
        0
    } else {
        1 << (63 - x.leading_zeros())
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

/// Lazy flush: on when the cache takes writes faster than cleaning drains them, so a burst
/// long enough fills it with dirty data and every further write miss would wait for cleaning.
fn lazy_flush_rule(
    mode: CacheMode,
    writers: &[(&JobSignature, &JobRecommendation)],
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

/// Read-ahead: on when a cached job reads sequentially and the core feeds a prefetching stream
/// (large requests, several in flight) faster than the job's own reads.
fn readahead_rule(
    mode: CacheMode,
    cached: &[(&JobSignature, &JobRecommendation)],
) -> (Option<ReadAhead>, String) {
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

/// The core serves at least this share of what the cache device does for offload to pay: the
/// study's selective offloading gained where a RAM cache and an SSD array were within a few
/// times of each other; against a core 10x slower it would only lose hits.
const OFFLOAD_MIN_RATIO: f64 = 0.25;

/// Offload: on when the core is fast and, for the busiest cached job's main direction at its
/// depth, serves at least a quarter of what the cache device does. The share balances the two:
/// the core's part of their combined speed, in steps of 5%, 5..50%.
fn offload_rule(
    mode: CacheMode,
    cached: &[(&JobSignature, &JobRecommendation)],
    profile: &DeviceProfile,
) -> (Option<Offload>, String) {
    if cached.is_empty() || mode == CacheMode::Pt {
        return (
            None,
            "off: nothing is cached, so there is nothing to offload".into(),
        );
    }
    let Some(fast) = fast_core(profile) else {
        return (
            None,
            format!(
                "off: the core ({}) is neither flash nor within 4x of the cache, so every request it takes waits longer than in the cache",
                profile.core.name
            ),
        );
    };
    let Some((s, r)) = cached.iter().max_by_key(|(s, _)| s.requests()) else {
        return (None, "off: nothing is cached".into());
    };
    let main = match (&r.reads, &r.writes) {
        (Some(x), Some(w)) if s.read_share() < s.write_share() => {
            Some(("writes", w.core_mb_s, w.absorb_mb_s, w.block, w.queue_depth))
        }
        (Some(x), _) => Some(("reads", x.core_mb_s, x.cache_mb_s, x.block, x.queue_depth)),
        (None, Some(w)) => Some(("writes", w.core_mb_s, w.absorb_mb_s, w.block, w.queue_depth)),
        (None, None) => None,
    };
    let Some((dir, core, cache, block, qd)) = main else {
        return (None, "off: the cached jobs neither read nor write".into());
    };
    let ratio = core / cache.max(1e-9);
    if ratio < OFFLOAD_MIN_RATIO {
        return (
            None,
            format!(
                "off: {fast}, but at iodepth {qd} it serves {}'s {dir} at {}, only {} of the cache's {}, so requests sent there would wait longer than in the cache",
                s.name,
                speed(core, block),
                pct(ratio),
                speed(cache, block)
            ),
        );
    }
    let share = ((100.0 * core / (core + cache) / 5.0).round() as u32 * 5).clamp(5, 50);
    (
        Some(Offload {
            share,
            threshold: 1,
        }),
        format!(
            "on (share {share}%, threshold 1): {fast}, and at iodepth {qd} it serves {}'s {dir} at {}, {} of the cache's {}; while the cache device's queue is deeper, sending {share}% of clean read hits and write misses to the core (its part of the two devices' combined speed) uses both, as the ASPLOS'23 study's selective offloading did",
            s.name,
            speed(core, block),
            pct(ratio),
            speed(cache, block)
        ),
    )
}

/// Recommends: judges every job, then combines the verdicts into one configuration.
pub fn recommend_with(
    sig: &Signature,
    profile: &DeviceProfile,
    o: &RecommendOptions,
) -> Recommendation {
    let jobs: Vec<JobRecommendation> = sig
        .jobs
        .iter()
        .map(|j| recommend_job(j, profile, o))
        .collect();
    let overall_job = recommend_job(&sig.overall, profile, o);
    let pairs: Vec<(&JobSignature, &JobRecommendation)> = sig.jobs.iter().zip(&jobs).collect();
    let cached: Vec<_> = pairs
        .iter()
        .filter(|(_, r)| r.decision == Decision::Cache)
        .copied()
        .collect();
    let bypassed: Vec<_> = pairs
        .iter()
        .filter(|(_, r)| r.decision == Decision::Bypass)
        .copied()
        .collect();
    let total_reqs = sig.overall.requests().max(1);
    let names = |v: &[(&JobSignature, &JobRecommendation)]| -> String {
        let mut n: Vec<String> = v.iter().take(3).map(|(s, _)| s.name.clone()).collect();
        if v.len() > 3 {
            n.push(format!("{} more", v.len() - 3));
        }
        n.join(", ")
    };
    let share_of = |v: &[(&JobSignature, &JobRecommendation)]| -> f64 {
        v.iter().map(|(s, _)| s.requests()).sum::<u64>() as f64 / total_reqs as f64
    };
    let mut reasons = Vec::new();

    // Mode: writes cached if any cached job caches them; reads by request-weighted majority.
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
    let mode = if cached.is_empty() {
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
    };
    // The write-back tail rule: on a fast core a write-back queue of deferred writes costs
    // more tail latency than it gains (the vendor's RAID-controller measurements, issue 16).
    let tail = tail_rule(mode, &cached, profile);
    let mode = tail.as_ref().map_or(mode, |t| t.0);
    let mode_reason = if let Some((_, text)) = &tail {
        text.clone()
    } else if cached.is_empty() {
        if jobs.len() == 1 {
            jobs[0].reason.clone()
        } else {
            format!(
                "pass-through: none of the {} jobs gains from the cache (per-job reasons below)",
                jobs.len()
            )
        }
    } else if cached.len() == 1 && bypassed.is_empty() {
        cached[0].1.reason.clone()
    } else {
        format!(
            "{}: the cached jobs ({}; {} of requests) need it: {}",
            mode.long_name(),
            names(&cached),
            pct(share_of(&cached)),
            // The job's reason without its own leading mode name.
            cached[0]
                .1
                .reason
                .split_once(": ")
                .map_or(cached[0].1.reason.as_str(), |x| x.1)
        )
    };
    reasons.push(Reason {
        setting: format!("cache mode {}", mode.as_str()),
        text: mode_reason,
    });

    // Line size: the dominant size of the requests the cache will take.
    let mut sizes: BTreeMap<u64, u64> = BTreeMap::new();
    for (s, r) in &cached {
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
        &sig.overall.writes.sizes
    } else {
        &sizes
    };
    let total_sized: u64 = line_basis.values().sum();
    let (dom, dom_n) = line_basis
        .iter()
        .max_by(|a, b| a.1.cmp(b.1).then(a.0.cmp(b.0)))
        .map_or((4096, 0), |(s, n)| (*s, *n));
    let line_kib = (pow2_floor(dom / 1024).clamp(4, 64)) as u32;
    reasons.push(Reason {
        setting: format!("cache line size {line_kib} KiB"),
        text: format!(
            "{line_kib} KiB lines: {} of the requests the cache takes are {}; lines {} them waste neither cache space nor core reads for partial lines",
            pct(ratio(dom_n, total_sized)),
            bytes(dom),
            if line_kib as u64 * 1024 == dom { "equal to" } else { "no larger than" }
        ),
    });

    // Cleaning.
    let writers: Vec<_> = cached
        .iter()
        .filter(|(_, r)| r.writes.as_ref().is_some_and(|w| w.cache))
        .copied()
        .collect();
    let mut wtl = Timeline {
        start_ns: sig.overall.timeline.start_ns,
        bucket_ns: sig.overall.timeline.bucket_ns,
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
    let (cleaning, cleaning_reason) = if !mode.dirty() {
        (
            Cleaning::Nop,
            format!(
                "nop: {} never holds dirty data, so a cleaner would have nothing to do",
                mode.long_name()
            ),
        )
    } else {
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
    };
    reasons.push(Reason {
        setting: format!("cleaning {}", cleaning.preset().unwrap_or(cleaning.name())),
        text: cleaning_reason,
    });
    let (lazy_flush, lazy_reason) = lazy_flush_rule(mode, &writers, &wtl, drain);
    reasons.push(Reason {
        setting: format!("lazy-flush {}", if lazy_flush { "on" } else { "off" }),
        text: lazy_reason,
    });

    // Sequential cutoff and IO classes: keep bypassed jobs out.
    let job_sequential = |s: &JobSignature, r: &JobRecommendation| -> bool {
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
    };
    let bypass_seq: Vec<_> = bypassed
        .iter()
        .filter(|(s, r)| job_sequential(s, r))
        .copied()
        .collect();
    let cached_seq: Vec<_> = cached
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
    let cached_max = cached
        .iter()
        .flat_map(|(s, r)| common_sizes(s, r.mode.caches_reads(), true))
        .max()
        .unwrap_or(0);
    let bypass_min = bypassed
        .iter()
        .flat_map(|(s, _)| common_sizes(s, true, true))
        .min()
        .unwrap_or(0);
    let describe = |v: &[(&JobSignature, &JobRecommendation)]| -> String {
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
    };
    let seq_cutoff = if !bypass_seq.is_empty() && cached_seq.is_empty() {
        let thr = (2 * cached_max / 1024)
            .max(16)
            .next_power_of_two()
            .min(1 << 20) as u32;
        let thr = if cached.is_empty() { 16 } else { thr };
        reasons.push(Reason {
            setting: format!("seq-cutoff always {thr} KiB"),
            text: format!(
                "always at {thr} KiB: {}, more than the cache can absorb and clean{}",
                describe(&bypass_seq),
                if cached.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; no cached job is sequential (their requests are at most {}), so cutting streams after {thr} KiB sends only the bypassed jobs to the core",
                        bytes(cached_max)
                    )
                }
            ),
        });
        SeqCutoff {
            policy: SeqCutoffPolicy::Always,
            threshold: thr,
        }
    } else if !cached_seq.is_empty() {
        reasons.push(Reason {
            setting: "seq-cutoff never".into(),
            text: format!(
                "never: {} gains from caching its sequential IO ({}), which a cutoff would send to the core{}",
                cached_seq[0].0.name,
                cached_seq[0].1.writes.as_ref().map_or_else(|| "reads".to_string(), |w| factor(w.gain)),
                if bypass_seq.is_empty() { "" } else { "; the bypassed sequential jobs are kept out by IO class instead, if sizes allow" }
            ),
        });
        SeqCutoff {
            policy: SeqCutoffPolicy::Never,
            threshold: 1024,
        }
    } else {
        reasons.push(Reason {
            setting: "seq-cutoff full".into(),
            text: format!(
                "full (the default, 1024 KiB): {} of requests are sequential and no job needs sequential IO kept out, so streams are cut off only when the cache is nearly full",
                pct(ratio(
                    sig.overall.reads.sequential + sig.overall.writes.sequential,
                    sig.overall.requests()
                ))
            ),
        });
        SeqCutoff {
            policy: SeqCutoffPolicy::Full,
            threshold: 1024,
        }
    };

    let mut io_classes = Vec::new();
    if !bypassed.is_empty() && !cached.is_empty() {
        if cached_max > 0 && cached_max < bypass_min {
            let bound = pow2_floor(bypass_min - 1).max(cached_max);
            io_classes.push(IoClass {
                id: 0,
                name: "unclassified".into(),
                eviction_priority: Some(22),
                allocation: 0.0,
            });
            io_classes.push(IoClass {
                id: 1,
                name: format!("request_size:le:{bound}"),
                eviction_priority: Some(1),
                allocation: 1.0,
            });
            reasons.push(Reason {
                setting: format!("io class request_size:le:{bound}"),
                text: format!(
                    "IO classes cache requests of at most {} only: the cached jobs' requests are at most {} and the bypassed jobs' ({}) at least {}",
                    bytes(bound),
                    bytes(cached_max),
                    names(&bypassed),
                    bytes(bypass_min)
                ),
            });
        } else {
            reasons.push(Reason {
                setting: "io classes none".into(),
                text: format!(
                    "no IO class rules: the bypassed jobs' request sizes (from {}) overlap the cached jobs' (up to {}), so size cannot tell them apart on a block device",
                    bytes(bypass_min),
                    bytes(cached_max)
                ),
            });
        }
    } else {
        reasons.push(Reason {
            setting: "io classes none".into(),
            text: if cached.is_empty() {
                "no IO class rules: nothing is cached".into()
            } else {
                "no IO class rules: every job is worth caching".into()
            },
        });
    }

    // Promotion.
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
    let promotion = if !mode.caches_reads() {
        reasons.push(Reason {
            setting: "promotion always".into(),
            text: format!(
                "always: {} inserts no read misses, so there is nothing to filter",
                mode.long_name()
            ),
        });
        Promotion::Always
    } else if rb == 0 {
        reasons.push(Reason {
            setting: "promotion always".into(),
            text: "always: the cached jobs do not read, so there is nothing to filter".into(),
        });
        Promotion::Always
    } else if (once_share >= 0.5 && reuse >= 0.1)
        || cached
            .iter()
            .any(|(_, r)| r.reads.as_ref().is_some_and(|x| x.cache && x.nhit))
    {
        reasons.push(Reason {
            setting: "promotion nhit 2/80".into(),
            text: format!(
                "nhit (threshold 2, trigger 80%): {} of read blocks are read only once while {} of read references are re-reads; inserting on the second access keeps the one-time blocks from evicting the re-read ones",
                pct(once_share),
                pct(reuse)
            ),
        });
        Promotion::Nhit {
            threshold: 2,
            trigger: 80,
        }
    } else if cache_ratio < 2.0 {
        reasons.push(Reason {
            setting: "promotion nhit 3/80".into(),
            text: format!(
                "nhit (threshold 3, trigger 80%): the cache reads only {} as fast as the core, so fewer insertions keep some load on the core and balance the two",
                factor(cache_ratio)
            ),
        });
        Promotion::Nhit {
            threshold: 3,
            trigger: 80,
        }
    } else {
        reasons.push(Reason {
            setting: "promotion always".into(),
            text: format!(
                "always: only {} of read blocks are read once, so every miss is worth inserting",
                pct(once_share)
            ),
        });
        Promotion::Always
    };

    let (prefetch, prefetch_reason) = readahead_rule(mode, &cached);
    reasons.push(Reason {
        setting: match prefetch {
            Some(ra) => format!("prefetch readahead {} KiB", ra.threshold),
            None => "prefetch none".into(),
        },
        text: prefetch_reason,
    });

    let (offload, offload_reason) = offload_rule(mode, &cached, profile);
    reasons.push(Reason {
        setting: match offload {
            Some(o) => format!("offload on {}%", o.share),
            None => "offload off".into(),
        },
        text: offload_reason,
    });

    // Cache size: miss-ratio curve of the cached jobs, and the write bursts to absorb.
    let mrc_blocks: u64 = if !bypassed.is_empty() {
        cached
            .iter()
            .map(|(s, _)| s.mrc.size_for_fraction(o.hit_fraction))
            .sum()
    } else {
        sig.overall.mrc.size_for_fraction(o.hit_fraction)
    };
    let curve = &sig.overall.mrc;
    let max_hit = if bypassed.is_empty() {
        curve.max_hit_ratio()
    } else {
        cached
            .iter()
            .map(|(s, _)| s.mrc.max_hit_ratio() * s.requests() as f64)
            .sum::<f64>()
            / cached
                .iter()
                .map(|(s, _)| s.requests() as f64)
                .sum::<f64>()
                .max(1.0)
    };
    let backlog = if mode.dirty() && drain.is_finite() {
        wtl.peak_backlog(drain)
    } else {
        0
    };
    // Modes that insert no reads are sized by their writes alone.
    let mrc_bytes = if mode.caches_reads() {
        mrc_blocks * 4096
    } else {
        0
    };
    let ws: u64 = cached.iter().map(|(s, _)| s.working_set.bytes()).sum();
    let mib = 1u64 << 20;
    let (size, size_reason) = if cached.is_empty() {
        (0, "no cache needed: nothing is cached".to_string())
    } else if mrc_bytes == 0 && backlog == 0 {
        let s = ws.clamp(64 * mib, 1 << 30);
        (
            s,
            format!(
                "{}: {} and cleaning keeps up with the writes, so the size hardly matters; this is the cached jobs' {} working set, kept between 64 MiB and 1 GiB",
                bytes(s.div_ceil(mib) * mib),
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
        let mut t = format!("{}: ", bytes(s.div_ceil(mib) * mib));
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
                num(drain)
            );
        }
        (s, t)
    };
    let size = size.div_ceil(mib) * mib;
    reasons.push(Reason {
        setting: "cache size".into(),
        text: size_reason,
    });
    let knee = curve.knee().map(|p| (p.cache_blocks, p.hit_ratio));

    // Reasons are in command order: mode, line, cleaning, lazy flush, seq cutoff, io class,
    // promotion, prefetch, offload, size.
    let config = CacheConfig {
        mode,
        line_size_kib: line_kib,
        cache_size_bytes: size,
        cleaning,
        seq_cutoff,
        promotion,
        io_classes,
        lazy_flush,
        prefetch,
        offload,
    };
    Recommendation {
        profile: profile.name.clone(),
        jobs,
        overall_job,
        config,
        reasons,
        knee,
    }
}

impl Recommendation {
    /// The configuration as `hybridcache` (casadm-style) commands for cache `id`. Lines starting
    /// with `#` are comments.
    pub fn commands(&self, id: u32) -> Vec<String> {
        let c = &self.config;
        let mut v = vec![
            format!(
                "# new cache: hybridcache -S -d CACHE_DEVICE -i {id} -c {} -x {}",
                c.mode.as_str(),
                c.line_size_kib
            ),
            // Leaving wb or wo for a mode that does not write back needs -f (as casadm):
            // flush first, so the recommended mode holds no data it would not write.
            if matches!(c.mode, CacheMode::Wb | CacheMode::Wo) {
                format!("hybridcache -Q -c {} -i {id}", c.mode.as_str())
            } else {
                format!("hybridcache -Q -c {} -i {id} -f yes", c.mode.as_str())
            },
            // A preset by its name, as the daemon reads it back; its tunables follow anyway.
            format!(
                "hybridcache -X -n cleaning -i {id} -p {}",
                c.cleaning.preset().unwrap_or(c.cleaning.name())
            ),
        ];
        match c.cleaning {
            Cleaning::Alru(p) => {
                let mut l = format!(
                    "hybridcache -X -n cleaning-alru -i {id} -w {} -s {} -b {} -t {}",
                    p.wake_up, p.staleness_time, p.flush_max_buffers, p.activity_threshold
                );
                if p.dirty_ratio_threshold != 100 {
                    l += &format!(" --dirty-ratio-threshold {}", p.dirty_ratio_threshold);
                }
                v.push(l);
            }
            Cleaning::Acp(p) => v.push(format!(
                "hybridcache -X -n cleaning-acp -i {id} -w {} -b {}",
                p.wake_up, p.flush_max_buffers
            )),
            Cleaning::Nop => {}
        }
        v.push(format!(
            "hybridcache -X -n lazy-flush -i {id} -p {}",
            if c.lazy_flush { "on" } else { "off" }
        ));
        v.push(format!(
            "hybridcache -X -n seq-cutoff -i {id} -p {} -t {}",
            c.seq_cutoff.policy.as_str(),
            c.seq_cutoff.threshold
        ));
        match c.promotion {
            Promotion::Always => v.push(format!("hybridcache -X -n promotion -i {id} -p always")),
            Promotion::Nhit { threshold, trigger } => {
                v.push(format!("hybridcache -X -n promotion -i {id} -p nhit"));
                v.push(format!(
                    "hybridcache -X -n promotion-nhit -i {id} -t {threshold} -o {trigger}"
                ));
            }
        }
        if !c.io_classes.is_empty() {
            v.push(format!("hybridcache -C -C -i {id} -f ioclass.csv"));
        }
        match c.prefetch {
            Some(ra) => {
                v.push(format!(
                    "hybridcache -X -n prefetch-readahead -i {id} -t {} --distance {} --max-in-flight {}",
                    ra.threshold, ra.distance, ra.max_in_flight
                ));
                v.push(format!("hybridcache -X -n prefetch -i {id} -p readahead"));
            }
            None => v.push(format!("hybridcache -X -n prefetch -i {id} -p none")),
        }
        match c.offload {
            Some(o) => {
                v.push(format!(
                    "hybridcache -X -n offload-queue -i {id} --share {} -t {}",
                    o.share, o.threshold
                ));
                v.push(format!("hybridcache -X -n offload -i {id} -p on"));
            }
            None => v.push(format!("hybridcache -X -n offload -i {id} -p off")),
        }
        v
    }

    /// The IO class file (Open CAS CSV with its header), empty when no rules are needed.
    pub fn io_class_csv(&self) -> String {
        if self.config.io_classes.is_empty() {
            return String::new();
        }
        let mut s = String::from("IO class id,IO class name,Eviction priority,Allocation\n");
        for c in &self.config.io_classes {
            s += &c.csv_line();
            s.push('\n');
        }
        s
    }

    /// The configuration as a fragment of hybridcache's TOML config file, reasons as comments.
    pub fn toml_fragment(&self, id: u32) -> String {
        let frag = ConfigFragment {
            cache: vec![CacheSection {
                id,
                line_size: self.config.line_size_kib,
                mode: self.config.mode,
                params: config_params(&self.config),
            }],
        };
        let mut s = String::new();
        for r in &self.reasons {
            s += &format!("# {}: {}\n", r.setting, r.text);
        }
        let c = &self.config;
        s += &format!(
            "# recommended cache size: {} bytes\n# per core, after the cores are added: hybridcache -X -n seq-cutoff -i {id} -p {} -t {}\n",
            c.cache_size_bytes,
            c.seq_cutoff.policy.as_str(),
            c.seq_cutoff.threshold
        );
        if !c.io_classes.is_empty() {
            s += &format!("# IO classes: hybridcache -C -C -i {id} -f ioclass.csv\n");
        }
        s += &toml::to_string(&frag).unwrap_or_default();
        s
    }
}

/// `[[cache]]` tables as in docs/cli.md, with `[cache.params]` by parameter name.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ConfigFragment {
    pub cache: Vec<CacheSection>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CacheSection {
    pub id: u32,
    /// KiB
    pub line_size: u32,
    pub mode: CacheMode,
    pub params: std::collections::BTreeMap<String, String>,
}

/// The cache's `params` table as hybridcache's configuration file reads it: `"GROUP.FIELD"` to a
/// value, for the cache-wide groups (docs/policies.md). Sequential cutoff (per core) and IO
/// classes are not configuration-file settings: the fragment gives them as commands in comments.
pub fn config_params(c: &CacheConfig) -> std::collections::BTreeMap<String, String> {
    let mut m = std::collections::BTreeMap::new();
    let mut put = |k: &str, v: String| {
        m.insert(k.to_string(), v);
    };
    put("cleaning.policy", c.cleaning.name().into());
    match c.cleaning {
        Cleaning::Alru(p) => {
            put("cleaning-alru.wake-up", p.wake_up.to_string());
            put("cleaning-alru.staleness-time", p.staleness_time.to_string());
            put(
                "cleaning-alru.flush-max-buffers",
                p.flush_max_buffers.to_string(),
            );
            put(
                "cleaning-alru.activity-threshold",
                p.activity_threshold.to_string(),
            );
            put(
                "cleaning-alru.dirty-ratio-threshold",
                p.dirty_ratio_threshold.to_string(),
            );
        }
        Cleaning::Acp(p) => {
            put("cleaning-acp.wake-up", p.wake_up.to_string());
            put(
                "cleaning-acp.flush-max-buffers",
                p.flush_max_buffers.to_string(),
            );
        }
        Cleaning::Nop => {}
    }
    put(
        "lazy-flush.policy",
        if c.lazy_flush { "on" } else { "off" }.into(),
    );
    match c.prefetch {
        Some(ra) => {
            put("prefetch.policy", "readahead".into());
            put("prefetch-readahead.threshold", ra.threshold.to_string());
            put("prefetch-readahead.distance", ra.distance.to_string());
            put(
                "prefetch-readahead.max-in-flight",
                ra.max_in_flight.to_string(),
            );
        }
        None => put("prefetch.policy", "none".into()),
    }
    match c.offload {
        Some(o) => {
            put("offload.policy", "on".into());
            put("offload-queue.share", o.share.to_string());
            put("offload-queue.threshold", o.threshold.to_string());
        }
        None => put("offload.policy", "off".into()),
    }
    match c.promotion {
        Promotion::Always => put("promotion.policy", "always".into()),
        Promotion::Nhit { threshold, trigger } => {
            put("promotion.policy", "nhit".into());
            put("promotion-nhit.threshold", threshold.to_string());
            put("promotion-nhit.trigger", trigger.to_string());
        }
    }
    m
}

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
//!
//! Layout: [`job`] judges one job; then one rule per setting, each in its own file, reads the
//! verdicts ([`Verdicts`]) and returns its setting with the reason: [`mode`] (with the
//! write-back tail rule), [`line_size`], [`cleaning`] (and lazy flush), [`seq_cutoff`] (and IO
//! classes), [`promotion`], [`prefetch`], [`offload`], [`size`]. [`recommend_with`] is the list
//! of rules, in the order of the commands.

mod cleaning;
mod job;
mod line_size;
mod mode;
mod offload;
mod prefetch;
mod promotion;
mod seq_cutoff;
mod size;

use serde::{Deserialize, Serialize};

use crate::profile::{DeviceProfile, Pattern};
use crate::signature::{JobSignature, Signature};
use crate::units::num;

pub use job::recommend_job;
pub use mode::fast_core;

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

/// `63 IOPS` for small blocks, `5415 MB/s` for large ones (how fio users read them).
fn speed(mb_s: f64, block: u64) -> String {
    if block <= 16384 {
        format!("{} IOPS", num(mb_s * 1e6 / block as f64))
    } else {
        format!("{} MB/s", num(mb_s))
    }
}

fn pow2_floor(x: u64) -> u64 {
    if x == 0 {
        0
    } else {
        1 << (63 - x.leading_zeros())
    }
}

/// A job's signature with its verdict.
type Judged<'a> = (&'a JobSignature, &'a JobRecommendation);

/// What every setting rule reads: the trace, every job's verdict, and the cached and bypassed
/// jobs apart.
struct Verdicts<'a> {
    sig: &'a Signature,
    jobs: &'a [JobRecommendation],
    cached: Vec<Judged<'a>>,
    bypassed: Vec<Judged<'a>>,
}

impl<'a> Verdicts<'a> {
    fn new(sig: &'a Signature, jobs: &'a [JobRecommendation]) -> Verdicts<'a> {
        let pairs: Vec<Judged<'a>> = sig.jobs.iter().zip(jobs).collect();
        let with = |d: Decision| -> Vec<Judged<'a>> {
            pairs
                .iter()
                .filter(|(_, r)| r.decision == d)
                .copied()
                .collect()
        };
        Verdicts {
            sig,
            jobs,
            cached: with(Decision::Cache),
            bypassed: with(Decision::Bypass),
        }
    }

    /// Up to three job names, then how many more.
    fn names(v: &[Judged]) -> String {
        let mut n: Vec<String> = v.iter().take(3).map(|(s, _)| s.name.clone()).collect();
        if v.len() > 3 {
            n.push(format!("{} more", v.len() - 3));
        }
        n.join(", ")
    }

    /// The share of the trace's requests that `v`'s jobs issue.
    fn share_of(&self, v: &[Judged]) -> f64 {
        let total_reqs = self.sig.overall.requests().max(1);
        v.iter().map(|(s, _)| s.requests()).sum::<u64>() as f64 / total_reqs as f64
    }
}

/// Recommends with default options.
pub fn recommend(sig: &Signature, profile: &DeviceProfile) -> Recommendation {
    recommend_with(sig, profile, &RecommendOptions::default())
}

/// Keeps a rule's reason (in rule order) and hands back its setting.
fn take<T>(reasons: &mut Vec<Reason>, (setting, reason): (T, Reason)) -> T {
    reasons.push(reason);
    setting
}

/// Recommends: judges every job, then runs one rule per setting over the verdicts. Reasons are
/// in command order: mode, line, cleaning, lazy flush, seq cutoff, io class, promotion,
/// prefetch, offload, size.
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
    let v = Verdicts::new(sig, &jobs);
    let mut reasons = Vec::new();
    let r = &mut reasons;
    let mode = take(r, mode::mode_rule(&v, profile));
    let line_size_kib = take(r, line_size::line_size_rule(&v));
    let writes = cleaning::CachedWrites::of(&v);
    let cleaning = take(r, cleaning::cleaning_rule(mode, &v, &writes));
    let lazy_flush = take(r, cleaning::lazy_flush_rule(mode, &writes));
    let seq_cutoff = take(r, seq_cutoff::seq_cutoff_rule(&v));
    let io_classes = take(r, seq_cutoff::io_class_rule(&v));
    let promotion = take(r, promotion::promotion_rule(mode, &v));
    let prefetch = take(r, prefetch::readahead_rule(mode, &v.cached));
    let offload = take(r, offload::offload_rule(mode, &v.cached, profile));
    let cache_size_bytes = take(r, size::size_rule(mode, &v, &writes, o));
    let knee = sig
        .overall
        .mrc
        .knee()
        .map(|p| (p.cache_blocks, p.hit_ratio));
    let config = CacheConfig {
        mode,
        line_size_kib,
        cache_size_bytes,
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

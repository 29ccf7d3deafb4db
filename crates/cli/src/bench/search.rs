//! `hybridcache bench search`: the analyzer proven against grid search (issue 16, part 5).
//!
//! For each workload shape (a fio workload on an emulated core), the search
//! 1. runs the shape once through a pass-through cache while our own tracer records it
//!    (`hybridcache trace start`): what the future core would see, as blktrace on it would, and
//!    the grid's `pt` point at the same time;
//! 2. runs every configuration of a trimmed grid mode x cleaning x lazy flush x seq cutoff x
//!    promotion x read-ahead, each cell from scratch (fresh core model, fresh cache, as `bench
//!    run` does), for a few seconds;
//! 3. gives the trace to the analyzer (`hybridcache analyze` with the core's profile) and runs
//!    its recommended configuration the same way;
//! 4. measures the best grid configuration and the recommendation again, back to back, and
//!    takes the ratio from that pair: the best of many noisy cells is biased upwards (it won
//!    partly by luck), so comparing a single recommended run with it would understate the
//!    analyzer on a shared machine.
//!
//! The grid is trimmed by where a knob can act at all, never by what the analyzer says:
//! - modes that differ only in how they treat a direction the shape does not have are one mode
//!   (no writes: wt stands for wb/wa/wi, pt for wo; no reads: wb for wo, pt for wa/wi);
//! - cleaning (`alru-very-aggressive`, `acp-very-aggressive`) and lazy flush only in modes that
//!   hold dirty data; the daemon's default alru (20 s wake-up) cleans nothing in a few seconds,
//!   which `nop` cannot beat either, so neither is a grid point;
//! - seq cutoff (`full`, `never`, `always`) only where the shape has sequential streams;
//! - promotion (`always`, `nhit` 2/80) only in modes that insert reads, for shapes that read;
//! - read-ahead (`none`, `readahead` with the daemon's defaults) only there and only for shapes
//!   with sequential reads.
//!
//! Offload is not a grid dimension (it landed as the search was being run; its rule does not
//! fire with the measured profiles, see docs/analyzer.md). Line size is the shape's dominant
//! request size (4..64 KiB) for the grid; the recommendation runs with its own line size, and
//! with its own tunables (alru/acp parameters, nhit threshold, read-ahead distances, IO
//! classes, offload). The recommended cache size is not applied: every cell
//! has the shape's cache device, the point being which policies win on the same hardware.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use hybridcache_analyze::recommend::{Cleaning, Promotion, Recommendation};
use hybridcache_analyze::{parse_trace, recommend, DeviceProfile, Format, Signature};
use serde::{Deserialize, Serialize};

use super::fio::{self, FioResult};
use super::matrix::{
    self, AcpParams, AlruParams, CacheSettings, Config, Matrix, MatrixFile, OffloadParams,
    Overrides, PrefetchParams, PromotionParams, SeqCutoff,
};
use super::procs::{self, CacheCtl, Proc, StopWith};
use super::rig::Rig;
use super::UsageError;

/// `bench search`.
#[derive(Debug, Clone, Args)]
pub struct SearchArgs {
    /// Shapes to search (default: all of them; `--list` names them).
    #[arg(value_name = "SHAPE")]
    pub shapes: Vec<String>,
    /// Output directory (search.json, search.md, cells/, traces/).
    #[arg(long, short = 'o', value_name = "DIR", default_value = "search-out")]
    pub out: PathBuf,
    /// Seconds fio runs per cell.
    #[arg(long, value_name = "S", default_value_t = 4)]
    pub runtime: u64,
    /// Run at most N grid configurations per shape besides the traced pt cell (0: all); for a
    /// quick check, not for the verdict.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub max_configs: usize,
    /// Rounds of the closing back-to-back runs of the best grid configuration and the
    /// recommendation (0: compare the grid's figures as they are).
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub confirm: u32,
    /// The analyzer's profile for the HDD RAID shapes: a built-in name or a TOML/JSON file
    /// (docs/analyzer.md, Profiles) [default: raid60-study].
    #[arg(long, value_name = "PROFILE")]
    pub profile_hdd: Option<String>,
    /// The same for the SSD RAID shapes [default: ssd-raid5x9].
    #[arg(long, value_name = "PROFILE")]
    pub profile_ssd: Option<String>,
    /// Print the shapes and their grids and exit.
    #[arg(long)]
    pub list: bool,
}

/// Which emulated core a shape runs on, and the analyzer profile that describes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CoreKind {
    /// `raid:preset=study60` (the study's 40-HDD RAID 60), profile `raid60-study`.
    Hdd,
    /// `ssd:preset=sata-raid5x9` (nine SATA SSDs, RAID 5), profile `ssd-raid5x9`.
    Ssd,
}

impl CoreKind {
    pub fn spec(self) -> &'static str {
        match self {
            CoreKind::Hdd => "raid:preset=study60,disk_size=64G,nodata",
            CoreKind::Ssd => "ssd:size=64G,preset=sata-raid5x9,nodata",
        }
    }
    pub fn profile(self) -> &'static str {
        match self {
            CoreKind::Hdd => "raid60-study",
            CoreKind::Ssd => "ssd-raid5x9",
        }
    }
    pub fn label(self) -> &'static str {
        match self {
            CoreKind::Hdd => "HDD RAID 60 (study60)",
            CoreKind::Ssd => "SSD RAID 5 (sata-raid5x9)",
        }
    }
}

/// One fio job of a shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct JobShape {
    pub name: String,
    /// fio's --rw.
    pub rw: String,
    pub bs: u64,
    pub iodepth: u32,
    pub rwmixread: Option<u8>,
    /// fio's --random_distribution (zipf:1.2 for skew).
    pub distribution: Option<String>,
    pub offset: u64,
    pub size: u64,
}

impl JobShape {
    fn reads(&self) -> bool {
        self.rw.contains("read") || self.rw.contains("rw")
    }
    fn writes(&self) -> bool {
        self.rw.contains("write") || self.rw.contains("rw")
    }
    fn sequential(&self) -> bool {
        !self.rw.starts_with("rand")
    }
}

/// What a shape is judged by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Metric {
    Iops,
    Mbs,
}

impl Metric {
    pub fn of(self, f: &FioResult) -> f64 {
        match self {
            Metric::Iops => f.iops,
            Metric::Mbs => f.mb_s,
        }
    }
    pub fn unit(self) -> &'static str {
        match self {
            Metric::Iops => "IOPS",
            Metric::Mbs => "MB/s",
        }
    }
}

/// A workload shape on an emulated core.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Shape {
    pub name: String,
    pub about: String,
    pub core: CoreKind,
    /// The cache device (RAM) size.
    pub cache_bytes: u64,
    pub jobs: Vec<JobShape>,
    pub metric: Metric,
}

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

fn job(name: &str, rw: &str, bs: u64, iodepth: u32, offset: u64, size: u64) -> JobShape {
    JobShape {
        name: name.into(),
        rw: rw.into(),
        bs,
        iodepth,
        rwmixread: None,
        distribution: None,
        offset,
        size,
    }
}

/// The shapes of issue 16: random write burst, mixed 70/30, read-intensive skewed, sequential
/// read, sequential write, a two-job mix; the burst and the mix on both cores.
pub fn shapes() -> Vec<Shape> {
    let burst = |core| Shape {
        name: format!("randwrite-burst-{}", core_tag(core)),
        about:
            "random 4 KiB writes at iodepth 8 over 1 GiB: a burst of several times the 64 MiB cache"
                .into(),
        core,
        cache_bytes: 64 * MIB,
        jobs: vec![job("burst", "randwrite", 4096, 8, 0, GIB)],
        metric: Metric::Iops,
    };
    let mixed = |core| {
        let mut j = job("oltp", "randrw", 4096, 8, 0, GIB);
        j.rwmixread = Some(70);
        Shape {
            name: format!("mixed7030-{}", core_tag(core)),
            about: "random 4 KiB, 70% reads / 30% writes, iodepth 8, over 1 GiB, 64 MiB cache"
                .into(),
            core,
            cache_bytes: 64 * MIB,
            jobs: vec![j],
            metric: Metric::Iops,
        }
    };
    let mut skew = job("web", "randrw", 4096, 4, 0, GIB);
    skew.rwmixread = Some(90);
    skew.distribution = Some("zipf:1.2".into());
    vec![
        burst(CoreKind::Hdd),
        burst(CoreKind::Ssd),
        mixed(CoreKind::Hdd),
        mixed(CoreKind::Ssd),
        Shape {
            name: "readskew-ssd".into(),
            about: "random 4 KiB, 90% reads, zipf 1.2 over 1 GiB (a hot set and many one-time reads), iodepth 4, 64 MiB cache".into(),
            core: CoreKind::Ssd,
            cache_bytes: 64 * MIB,
            jobs: vec![skew],
            metric: Metric::Iops,
        },
        Shape {
            name: "seqread-hdd".into(),
            // 32 MiB: the first, cold pass must end well within a cell even at the RAID's
            // slowest (~15 MB/s at depth 1), or a cell measures only whether it happened to.
            about: "sequential 64 KiB reads at iodepth 1 over 32 MiB, read again and again, 128 MiB cache".into(),
            core: CoreKind::Hdd,
            cache_bytes: 128 * MIB,
            jobs: vec![job("scan", "read", 65536, 1, 0, 32 * MIB)],
            metric: Metric::Mbs,
        },
        Shape {
            name: "seqwrite-hdd".into(),
            about: "sequential 64 KiB writes at iodepth 8 over 4 GiB, 64 MiB cache".into(),
            core: CoreKind::Hdd,
            cache_bytes: 64 * MIB,
            jobs: vec![job("ingest", "write", 65536, 8, 0, 4 * GIB)],
            metric: Metric::Mbs,
        },
        Shape {
            name: "twojob-hdd".into(),
            about: "two jobs: random 4 KiB writes at iodepth 1 over 256 MiB, and sequential 512 KiB writes at iodepth 4 over 4 GiB elsewhere, 64 MiB cache".into(),
            core: CoreKind::Hdd,
            cache_bytes: 64 * MIB,
            jobs: vec![
                job("db", "randwrite", 4096, 1, 0, 256 * MIB),
                job("backup", "write", 512 * 1024, 4, 8 * GIB, 4 * GIB),
            ],
            metric: Metric::Iops,
        },
    ]
}

fn core_tag(c: CoreKind) -> &'static str {
    match c {
        CoreKind::Hdd => "hdd",
        CoreKind::Ssd => "ssd",
    }
}

impl Shape {
    fn reads(&self) -> bool {
        self.jobs.iter().any(JobShape::reads)
    }
    fn writes(&self) -> bool {
        self.jobs.iter().any(JobShape::writes)
    }
    fn sequential(&self) -> bool {
        self.jobs.iter().any(JobShape::sequential)
    }
    fn sequential_reads(&self) -> bool {
        self.jobs.iter().any(|j| j.sequential() && j.reads())
    }
    /// The grid's line size: the requests most jobs issue, 4..64 KiB.
    fn line_kib(&self) -> u32 {
        let bs = self.jobs.iter().map(|j| j.bs).min().unwrap_or(4096);
        ((bs / 1024).clamp(4, 64) as u32).next_power_of_two()
    }
    /// End of the furthest region: the core must be at least this large.
    fn span(&self) -> u64 {
        self.jobs
            .iter()
            .map(|j| j.offset + j.size)
            .max()
            .unwrap_or(0)
    }

    /// fio's arguments for this shape against `uri`, JSON into `json`.
    pub fn fio_args(&self, uri: &str, runtime: u64, json: &Path) -> Vec<String> {
        let mut a = vec![
            "--ioengine=nbd".to_string(),
            format!("--uri={uri}"),
            "--group_reporting".into(),
            "--percentile_list=50:99:99.9:99.99".into(),
            "--randrepeat=0".into(),
            "--norandommap".into(),
            "--time_based".into(),
            format!("--runtime={runtime}"),
            "--output-format=json".into(),
            format!("--output={}", json.display()),
        ];
        for j in &self.jobs {
            a.push(format!("--name={}", j.name));
            a.push(format!("--rw={}", j.rw));
            a.push(format!("--bs={}", j.bs));
            a.push(format!("--iodepth={}", j.iodepth));
            a.push(format!("--offset={}", j.offset));
            a.push(format!("--size={}", j.size));
            if let Some(m) = j.rwmixread {
                a.push(format!("--rwmixread={m}"));
            }
            if let Some(d) = &j.distribution {
                a.push(format!("--random_distribution={d}"));
            }
        }
        a
    }
}

/// One point of the grid.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GridPoint {
    pub mode: String,
    /// A cleaning preset (dirty modes only).
    pub cleaning: Option<String>,
    pub lazy_flush: Option<bool>,
    pub seq_cutoff: Option<String>,
    /// nhit threshold/trigger; None: always.
    pub nhit: Option<(u32, u32)>,
    pub readahead: bool,
}

impl GridPoint {
    pub fn label(&self) -> String {
        let mut s = self.mode.clone();
        if let Some(c) = &self.cleaning {
            s += &format!(" {}", c.replace("-very-aggressive", "-va"));
        }
        if self.lazy_flush == Some(true) {
            s += " lazy";
        }
        if let Some(c) = &self.seq_cutoff {
            s += &format!(" sc-{c}");
        }
        if let Some((t, o)) = self.nhit {
            s += &format!(" nhit{t}/{o}");
        }
        if self.readahead {
            s += " ra";
        }
        s
    }

    fn settings(&self, base: &CacheSettings) -> CacheSettings {
        let mut c = base.clone();
        c.mode = self.mode.clone();
        c.cleaning = self.cleaning.clone();
        c.lazy_flush = self.lazy_flush;
        c.seq_cutoff = self.seq_cutoff.as_ref().map(|p| SeqCutoff {
            policy: p.clone(),
            threshold_kib: None,
        });
        c.promotion = self.nhit.map(|(t, o)| PromotionParams {
            policy: "nhit".into(),
            threshold: Some(t),
            trigger: Some(o),
        });
        c.prefetch = self.readahead.then(|| PrefetchParams {
            policy: "readahead".into(),
            threshold_kib: None,
            distance: None,
            max_in_flight: None,
        });
        c
    }
}

/// The trimmed grid for a shape (module docs: where each knob can act).
pub fn grid(shape: &Shape) -> Vec<GridPoint> {
    let (reads, writes) = (shape.reads(), shape.writes());
    let modes: Vec<&str> = match (reads, writes) {
        (true, true) => vec!["wb", "wo", "wt", "wa", "pt"],
        (true, false) => vec!["wt", "pt"],
        _ => vec!["wb", "wt", "pt"],
    };
    let cutoffs: Vec<Option<&str>> = if shape.sequential() {
        vec![Some("full"), Some("never"), Some("always")]
    } else {
        vec![None]
    };
    let mut out = Vec::new();
    for mode in modes {
        let dirty = matches!(mode, "wb" | "wo") && writes;
        let inserts_reads = matches!(mode, "wb" | "wt" | "wa" | "wi") && reads;
        let cleanings: Vec<Option<&str>> = if dirty {
            vec![Some("alru-very-aggressive"), Some("acp-very-aggressive")]
        } else {
            vec![None]
        };
        let lazies: Vec<Option<bool>> = if dirty {
            vec![Some(false), Some(true)]
        } else {
            vec![None]
        };
        let promotions: Vec<Option<(u32, u32)>> = if inserts_reads {
            vec![None, Some((2, 80))]
        } else {
            vec![None]
        };
        let readaheads: Vec<bool> = if inserts_reads && shape.sequential_reads() {
            vec![false, true]
        } else {
            vec![false]
        };
        // pt passes everything to the core: no knob acts (the traced cell is this point).
        let cutoffs_here: Vec<Option<&str>> = if mode == "pt" {
            vec![None]
        } else {
            cutoffs.clone()
        };
        for cleaning in &cleanings {
            for lazy in &lazies {
                for sc in &cutoffs_here {
                    for nhit in &promotions {
                        for ra in &readaheads {
                            out.push(GridPoint {
                                mode: mode.into(),
                                cleaning: cleaning.map(str::to_string),
                                lazy_flush: *lazy,
                                seq_cutoff: sc.map(str::to_string),
                                nhit: *nhit,
                                readahead: *ra,
                            });
                        }
                    }
                }
            }
        }
    }
    out
}

/// The analyzer's recommendation as the bench's cache settings (line size and tunables
/// included); IO classes go separately, as a CSV file.
pub fn recommended_settings(rec: &Recommendation, base: &CacheSettings) -> CacheSettings {
    let c = &rec.config;
    let mut s = base.clone();
    s.mode = c.mode.as_str().into();
    s.line_size_kib = c.line_size_kib;
    s.cleaning = Some(c.cleaning.name().into());
    s.alru = None;
    s.acp = None;
    match c.cleaning {
        Cleaning::Alru(p) => {
            s.alru = Some(AlruParams {
                wake_up: Some(p.wake_up.into()),
                staleness: Some(p.staleness_time.into()),
                flush_max: Some(p.flush_max_buffers.into()),
                activity: Some(p.activity_threshold.into()),
                dirty_pct: Some(p.dirty_ratio_threshold.into()),
            })
        }
        Cleaning::Acp(p) => {
            s.acp = Some(AcpParams {
                wake_up: Some(p.wake_up.into()),
                flush_max: Some(p.flush_max_buffers.into()),
            })
        }
        Cleaning::Nop => {}
    }
    s.seq_cutoff = Some(SeqCutoff {
        policy: c.seq_cutoff.policy.as_str().into(),
        threshold_kib: Some(c.seq_cutoff.threshold.into()),
    });
    s.promotion = Some(match c.promotion {
        Promotion::Always => PromotionParams {
            policy: "always".into(),
            threshold: None,
            trigger: None,
        },
        Promotion::Nhit { threshold, trigger } => PromotionParams {
            policy: "nhit".into(),
            threshold: Some(threshold),
            trigger: Some(trigger),
        },
    });
    s.lazy_flush = Some(c.lazy_flush);
    s.offload = Some(match c.offload {
        Some(o) => OffloadParams {
            enabled: true,
            share: Some(o.share),
            threshold: Some(o.threshold),
        },
        None => OffloadParams {
            enabled: false,
            share: None,
            threshold: None,
        },
    });
    s.prefetch = Some(match c.prefetch {
        Some(ra) => PrefetchParams {
            policy: "readahead".into(),
            threshold_kib: Some(ra.threshold),
            distance: Some(ra.distance),
            max_in_flight: Some(ra.max_in_flight),
        },
        None => PrefetchParams {
            policy: "none".into(),
            threshold_kib: None,
            distance: None,
            max_in_flight: None,
        },
    });
    s
}

/// The analyzer's configuration in the grid's terms, to say which grid point it is (if any).
pub fn recommended_label(rec: &Recommendation) -> String {
    let c = &rec.config;
    let mut s = format!("{} {}K", c.mode.as_str(), c.line_size_kib);
    if c.mode.dirty() {
        s += &format!(" {}", c.cleaning.preset().unwrap_or(c.cleaning.name()));
        if c.lazy_flush {
            s += " lazy";
        }
    }
    s += &format!(" sc-{}", c.seq_cutoff.policy.as_str());
    if let Promotion::Nhit { threshold, trigger } = c.promotion {
        s += &format!(" nhit{threshold}/{trigger}");
    }
    if c.prefetch.is_some() {
        s += " ra";
    }
    if !c.io_classes.is_empty() {
        s += &format!(" {} io classes", c.io_classes.len());
    }
    if let Some(o) = c.offload {
        s += &format!(" offload{}", o.share);
    }
    s.replace("-very-aggressive", "-va")
}

/// The grid point the recommendation is, when it is one (same line size, no IO classes, a
/// grid cleaning preset, default read-ahead distances): then the comparison measures only the
/// run-to-run spread.
pub fn grid_point_of(rec: &Recommendation, shape: &Shape) -> Option<GridPoint> {
    let c = &rec.config;
    if c.line_size_kib != shape.line_kib() || !c.io_classes.is_empty() || c.offload.is_some() {
        return None;
    }
    let dirty = c.mode.dirty() && shape.writes();
    let cleaning = if dirty {
        Some(c.cleaning.preset()?.to_string())
    } else {
        None
    };
    let seq_cutoff = if c.mode.as_str() == "pt" {
        None
    } else if shape.sequential() {
        Some(c.seq_cutoff.policy.as_str().to_string())
    } else if c.seq_cutoff.policy.as_str() == "full" {
        None
    } else {
        return None;
    };
    let inserts_reads = c.mode.caches_reads() && shape.reads();
    let nhit = match c.promotion {
        Promotion::Nhit { threshold, trigger } if inserts_reads => Some((threshold, trigger)),
        _ => None,
    };
    let readahead = match c.prefetch {
        Some(ra) if inserts_reads && shape.sequential_reads() => {
            if (ra.threshold, ra.distance, ra.max_in_flight) != (256, 1024, 4) {
                return None;
            }
            true
        }
        _ => false,
    };
    let p = GridPoint {
        mode: c.mode.as_str().into(),
        cleaning,
        lazy_flush: dirty.then_some(c.lazy_flush),
        seq_cutoff,
        nhit,
        readahead,
    };
    grid(shape).contains(&p).then_some(p)
}

/// One measured configuration.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Measured {
    pub label: String,
    pub settings: Option<CacheSettings>,
    pub figure: f64,
    pub fio: FioResult,
    pub error: Option<String>,
    pub seconds: f64,
}

/// A shape's search.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShapeResult {
    pub shape: Shape,
    pub profile: String,
    pub trace: String,
    pub trace_requests: u64,
    pub grid: Vec<Measured>,
    pub recommended: Measured,
    pub reasons: Vec<(String, String)>,
    /// The back-to-back pairs (best grid point, recommendation), one per round.
    pub confirm: Vec<(Measured, Measured)>,
    pub best: String,
    /// The recommendation is the best grid point itself.
    pub same_as_best: bool,
    pub best_figure: f64,
    pub recommended_figure: f64,
    pub ratio: f64,
    pub pass: bool,
}

/// Everything, as search.json holds it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SearchReport {
    pub runtime: u64,
    pub max_configs: usize,
    pub confirm: u32,
    pub shapes: Vec<ShapeResult>,
}

/// The analyzer must reach this share of the best configuration's figure.
pub const TARGET: f64 = 0.9;

pub fn run(a: &SearchArgs) -> Result<u8> {
    let all = shapes();
    let chosen: Vec<Shape> = if a.shapes.is_empty() {
        all.clone()
    } else {
        a.shapes
            .iter()
            .map(|n| {
                all.iter().find(|s| &s.name == n).cloned().ok_or_else(|| {
                    anyhow!(UsageError(format!(
                        "'{n}' is not a shape ({})",
                        all.iter()
                            .map(|s| s.name.as_str())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )))
                })
            })
            .collect::<Result<_>>()?
    };
    if a.list {
        for s in &chosen {
            let g = grid(s);
            println!(
                "{} on {}: {} ({} grid points, {})",
                s.name,
                s.core.label(),
                s.about,
                g.len(),
                s.metric.unit()
            );
            for p in g {
                println!("    {}", p.label());
            }
        }
        return Ok(0);
    }
    // A bad profile is the command line's fault: say so before an hour of cells.
    for s in &chosen {
        profile_for(s.core, a)?;
    }
    if a.runtime == 0 {
        bail!(UsageError("--runtime must be at least 1 second".into()));
    }
    if !procs::have("fio") {
        bail!("bench search needs fio (Debian: apt-get install fio)");
    }
    procs::install_interrupt_handler();
    let bin = procs::our_binary()?;
    std::fs::create_dir_all(&a.out)
        .with_context(|| format!("cannot create {}", a.out.display()))?;
    let out = a
        .out
        .canonicalize()
        .with_context(|| format!("cannot resolve {}", a.out.display()))?;
    // Sockets live under a short path (107-byte limit).
    let run_dir = std::env::temp_dir().join(format!("hc-search-{}", std::process::id()));
    std::fs::create_dir_all(&run_dir)?;
    let mut report = SearchReport {
        runtime: a.runtime,
        max_configs: a.max_configs,
        confirm: a.confirm,
        shapes: Vec::new(),
    };
    let started = Instant::now();
    let result = (|| -> Result<()> {
        for shape in &chosen {
            let r = search_shape(shape, a, &bin, &run_dir, &out)?;
            report.shapes.push(r);
            write_outputs(&out, &report)?;
        }
        Ok(())
    })();
    let _ = std::fs::remove_dir_all(&run_dir);
    write_outputs(&out, &report)?;
    println!("\n{}", table(&report));
    println!(
        "{} shapes in {:.0} s; search.json and search.md in {}",
        report.shapes.len(),
        started.elapsed().as_secs_f64(),
        out.display()
    );
    match result {
        Ok(()) => Ok(0),
        Err(e) if super::rig::is_interrupt(&e) => Ok(130),
        Err(e) => Err(e),
    }
}

/// The analyzer's profile for a core: `--profile-hdd`/`--profile-ssd`, or the built-in one.
fn profile_for(core: CoreKind, a: &SearchArgs) -> Result<DeviceProfile> {
    let spec = match core {
        CoreKind::Hdd => a.profile_hdd.as_deref(),
        CoreKind::Ssd => a.profile_ssd.as_deref(),
    }
    .unwrap_or(core.profile());
    crate::analyze::load_profile(Some(spec)).map_err(|e| {
        anyhow!(UsageError(format!(
            "--profile-{}: {}",
            core_tag(core),
            e.message
        )))
    })
}

fn base_matrix(shape: &Shape, runtime: u64) -> Result<Matrix> {
    let mut file = MatrixFile::default();
    file.core.device = Some(shape.core.spec().into());
    file.cache.device = Some(format!("ram:{}M", shape.cache_bytes / MIB));
    file.cache.line_size = Some(shape.line_kib());
    let mut m = matrix::resolve(
        &file,
        &Overrides {
            configs: Some(vec!["cache".into()]),
            runtime: Some(runtime),
            // The rig checks offset + size against the core: the shape's whole span.
            size: Some(shape.span().to_string()),
            ..Default::default()
        },
    )?;
    m.cache.mode = "pt".into();
    Ok(m)
}

fn search_shape(
    shape: &Shape,
    a: &SearchArgs,
    bin: &Path,
    run_dir: &Path,
    out: &Path,
) -> Result<ShapeResult> {
    let base = base_matrix(shape, a.runtime)?;
    let dir = out.join("cells").join(&shape.name);
    std::fs::create_dir_all(out.join("traces"))?;
    let trace = out.join("traces").join(format!("{}.trace", shape.name));
    println!(
        "== {} on {}: {}",
        shape.name,
        shape.core.label(),
        shape.about
    );

    // 1. The traced run, which is also the grid's pt point.
    let mut pt_settings = base.cache.clone();
    pt_settings.mode = "pt".into();
    let traced = measure(
        shape,
        &base,
        "pt (traced)",
        &pt_settings,
        None,
        Some(&trace),
        bin,
        run_dir,
        &dir.join("pt-traced"),
    )?;
    println!("  {:<40} {}", traced.label, figure_text(shape, &traced));
    let mut measured = vec![traced];

    // 2. The grid.
    let mut points = grid(shape);
    points.retain(|p| p.mode != "pt");
    if a.max_configs > 0 {
        points.truncate(a.max_configs);
    }
    for (i, p) in points.iter().enumerate() {
        let m = measure(
            shape,
            &base,
            &p.label(),
            &p.settings(&base.cache),
            None,
            None,
            bin,
            run_dir,
            &dir.join(format!("g{i:03}")),
        )?;
        println!("  {:<40} {}", m.label, figure_text(shape, &m));
        measured.push(m);
    }

    // 3. The analyzer on the trace.
    let file = std::fs::File::open(&trace)
        .with_context(|| format!("cannot open the trace {}", trace.display()))?;
    let t = parse_trace(std::io::BufReader::new(file), Format::Blkparse)
        .map_err(|e| anyhow!("the trace {} does not parse: {e}", trace.display()))?;
    let sig = Signature::from_trace(&t);
    let profile = profile_for(shape.core, a)?;
    let rec = recommend(&sig, &profile);
    let rec_settings = recommended_settings(&rec, &base.cache);
    let csv = rec.io_class_csv();
    let classes = (!csv.is_empty()).then_some(csv.as_str());
    let rec_label = format!("analyzer: {}", recommended_label(&rec));
    let recommended = measure(
        shape,
        &base,
        &rec_label,
        &rec_settings,
        classes,
        None,
        bin,
        run_dir,
        &dir.join("analyzer"),
    )?;
    println!(
        "  {:<40} {}",
        recommended.label,
        figure_text(shape, &recommended)
    );

    // 4. The best grid point and the recommendation again, back to back.
    let best = measured
        .iter()
        .filter(|m| m.error.is_none())
        .max_by(|x, y| x.figure.total_cmp(&y.figure))
        .cloned()
        .ok_or_else(|| anyhow!("{}: no grid cell succeeded", shape.name))?;
    let mut confirm = Vec::new();
    if a.confirm > 0 {
        let settings = best.settings.clone().unwrap_or_else(|| pt_settings.clone());
        for round in 0..a.confirm {
            // Alternate who goes first, so a drift of the machine within a round (or whatever
            // the previous cell left behind) does not always favour the same side.
            let best_first = round % 2 == 0;
            let mut pair = Vec::new();
            for side in 0..2 {
                let is_best = (side == 0) == best_first;
                let m = if is_best {
                    measure(
                        shape,
                        &base,
                        &format!("again: {}", best.label),
                        &settings,
                        None,
                        None,
                        bin,
                        run_dir,
                        &dir.join(format!("confirm{round}-best")),
                    )?
                } else {
                    measure(
                        shape,
                        &base,
                        &format!("again: {}", recommended.label),
                        &rec_settings,
                        classes,
                        None,
                        bin,
                        run_dir,
                        &dir.join(format!("confirm{round}-analyzer")),
                    )?
                };
                println!("  {:<40} {}", m.label, figure_text(shape, &m));
                pair.push((is_best, m));
            }
            pair.sort_by_key(|(is_best, _)| !*is_best);
            let mut it = pair.into_iter().map(|(_, m)| m);
            if let (Some(b), Some(r)) = (it.next(), it.next()) {
                confirm.push((b, r));
            }
        }
    }
    let mean = |v: Vec<f64>| v.iter().sum::<f64>() / v.len().max(1) as f64;
    let (best_figure, rec_figure) = if confirm.is_empty() {
        (best.figure, recommended.figure)
    } else {
        // Both from the interleaved re-runs: the grid's maximum is the one figure selected
        // for being high, so it is not compared with anything.
        (
            mean(confirm.iter().map(|(b, _)| b.figure).collect()),
            mean(confirm.iter().map(|(_, r)| r.figure).collect()),
        )
    };
    // A recommendation that beat the grid's best is 100% of the best.
    let top = best_figure.max(rec_figure);
    let ratio = if top > 0.0 { rec_figure / top } else { 0.0 };
    Ok(ShapeResult {
        shape: shape.clone(),
        profile: profile.name.clone(),
        trace: trace.display().to_string(),
        trace_requests: sig.overall.requests(),
        grid: measured,
        recommended,
        reasons: rec
            .reasons
            .iter()
            .map(|r| (r.setting.clone(), r.text.clone()))
            .collect(),
        confirm,
        same_as_best: grid_point_of(&rec, shape).is_some_and(|p| p.label() == best.label),
        best: best.label,
        best_figure,
        recommended_figure: rec_figure,
        ratio,
        pass: ratio >= TARGET,
    })
}

fn figure_text(shape: &Shape, m: &Measured) -> String {
    match &m.error {
        Some(e) => format!("failed: {e}"),
        None => format!(
            "{:>9.1} {}  (p99 {:.2} ms)",
            m.figure,
            shape.metric.unit(),
            m.fio.main_dir().lat_p99_us / 1000.0
        ),
    }
}

/// Run one cell: a fresh core and cache with `settings`, fio for the shape; with `trace`, the
/// daemon's tracer records the run into that file. A failed cell is recorded, not fatal.
#[allow(clippy::too_many_arguments)]
fn measure(
    shape: &Shape,
    base: &Matrix,
    label: &str,
    settings: &CacheSettings,
    io_classes: Option<&str>,
    trace: Option<&Path>,
    bin: &Path,
    run_dir: &Path,
    cell_dir: &Path,
) -> Result<Measured> {
    let started = Instant::now();
    let mut m = base.clone();
    m.cache = settings.clone();
    let r = run_cell(shape, &m, io_classes, trace, bin, run_dir, cell_dir);
    let seconds = started.elapsed().as_secs_f64();
    match r {
        Ok(fio) => Ok(Measured {
            label: label.into(),
            settings: Some(settings.clone()),
            figure: shape.metric.of(&fio),
            fio,
            error: None,
            seconds,
        }),
        Err(e) if super::rig::is_interrupt(&e) => Err(e),
        Err(e) => Ok(Measured {
            label: label.into(),
            settings: Some(settings.clone()),
            error: Some(format!("{e:#}").replace('\n', " ")),
            seconds,
            ..Default::default()
        }),
    }
}

fn run_cell(
    shape: &Shape,
    m: &Matrix,
    io_classes: Option<&str>,
    trace: Option<&Path>,
    bin: &Path,
    run_dir: &Path,
    cell_dir: &Path,
) -> Result<FioResult> {
    let mut rig = Rig::start(Config::Cache, m, bin, run_dir, cell_dir)?;
    // The rig's daemon listens here (rig.rs); the tracer and IO classes go through the same CLI.
    let ctl = CacheCtl {
        bin: bin.to_path_buf(),
        control: run_dir.join("control.sock"),
        id: 1,
    };
    if let Some(csv) = io_classes {
        let f = cell_dir.join("ioclass.csv");
        std::fs::write(&f, csv)?;
        ctl.run(&[
            "-C".into(),
            "-C".into(),
            "-i".into(),
            "1".into(),
            "-f".into(),
            f.display().to_string(),
        ])?;
    }
    if let Some(t) = trace {
        ctl.run(&[
            "trace".into(),
            "start".into(),
            "-i".into(),
            "1".into(),
            "-j".into(),
            "1".into(),
            "-o".into(),
            t.display().to_string(),
        ])?;
    }
    let json = cell_dir.join("fio.json");
    let log = cell_dir.join("fio.log");
    let _ = std::fs::remove_file(&json);
    let mut cmd = procs::command(Path::new("fio"), &log)?;
    cmd.args(shape.fio_args(&rig.uri, m.runtime, &json));
    let mut p = Proc::spawn("fio", cmd, &log, StopWith::Term)
        .context("bench search needs fio (Debian: apt-get install fio)")?;
    let status = p.wait()?;
    if trace.is_some() {
        ctl.run(&["trace".into(), "stop".into(), "-i".into(), "1".into()])?;
    }
    rig.stop();
    if !status.success() {
        bail!("fio failed ({status}): {}", procs::log_tail(&log));
    }
    let text = std::fs::read_to_string(&json).unwrap_or_default();
    fio::parse_json(&text).with_context(|| format!("fio: {}", procs::log_tail(&log)))
}

/// The verdict table (Markdown).
pub fn table(r: &SearchReport) -> String {
    let mut s = String::from(
        "| shape | core | grid points | best configuration | best | analyzer's configuration | analyzer | ratio | >= 90% |\n|---|---|---|---|---|---|---|---|---|\n",
    );
    for x in &r.shapes {
        let unit = x.shape.metric.unit();
        s += &format!(
            "| {} | {} | {} | {} | {:.0} {unit} | {}{} | {:.0} {unit} | {:.0}% | {} |\n",
            x.shape.name,
            x.shape.core.label(),
            x.grid.len(),
            x.best,
            x.best_figure,
            x.recommended.label.trim_start_matches("analyzer: "),
            if x.same_as_best { " (= best)" } else { "" },
            x.recommended_figure,
            x.ratio * 100.0,
            if x.pass { "yes" } else { "**no**" }
        );
    }
    s
}

fn write_outputs(out: &Path, r: &SearchReport) -> Result<()> {
    let json = serde_json::to_string_pretty(r)?;
    std::fs::write(out.join("search.json"), json)?;
    let mut md = format!(
        "# Grid search against the analyzer\n\n{} s per cell{}; best and analyzer compared over {} interleaved re-runs each.\n\n{}\n",
        r.runtime,
        if r.max_configs > 0 {
            format!(", at most {} grid points per shape", r.max_configs)
        } else {
            String::new()
        },
        r.confirm,
        table(r)
    );
    for x in &r.shapes {
        md += &format!(
            "\n## {} ({})\n\n{}; trace {} ({} requests), profile {}.\n\n| configuration | {} |\n|---|---|\n",
            x.shape.name,
            x.shape.core.label(),
            x.shape.about,
            x.trace,
            x.trace_requests,
            x.profile,
            x.shape.metric.unit()
        );
        for m in x.grid.iter().chain([&x.recommended]) {
            md += &format!(
                "| {} | {} |\n",
                m.label,
                m.error
                    .as_ref()
                    .map_or_else(|| format!("{:.1}", m.figure), |e| format!("failed: {e}"))
            );
        }
        for (b, a) in &x.confirm {
            md += &format!(
                "| {} | {:.1} |\n| {} | {:.1} |\n",
                b.label, b.figure, a.label, a.figure
            );
        }
        md += "\nThe analyzer's reasons:\n\n";
        for (k, v) in &x.reasons {
            md += &format!("- {k}: {v}\n");
        }
    }
    std::fs::write(out.join("search.md"), md)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_vary_only_what_can_act() {
        let all = shapes();
        let by = |n: &str| all.iter().find(|s| s.name == n).unwrap();
        // Random writes: no seq cutoff, no promotion, no read-ahead; cleaning x lazy in wb.
        let g = grid(by("randwrite-burst-hdd"));
        assert_eq!(g.len(), 4 + 1 + 1, "{:?}", g);
        assert!(g
            .iter()
            .all(|p| p.seq_cutoff.is_none() && p.nhit.is_none() && !p.readahead));
        // Sequential reads: wt x cutoff x promotion x read-ahead, and pt.
        let g = grid(by("seqread-hdd"));
        assert_eq!(g.len(), 3 * 2 * 2 + 1);
        assert!(g.iter().any(|p| p.readahead));
        assert!(g.iter().all(|p| p.cleaning.is_none()));
        // The mix: every mode; promotion only where reads are inserted.
        let g = grid(by("mixed7030-hdd"));
        assert!(g
            .iter()
            .filter(|p| p.mode == "wo")
            .all(|p| p.nhit.is_none()));
        assert!(g.iter().any(|p| p.mode == "wb" && p.nhit.is_some()));
        assert_eq!(g.len(), 8 + 4 + 2 + 2 + 1);
        // Labels are distinct: they name the cells.
        let mut labels: Vec<String> = g.iter().map(GridPoint::label).collect();
        labels.sort();
        labels.dedup();
        assert_eq!(labels.len(), g.len());
    }

    #[test]
    fn shapes_fit_their_cores_and_name_fio_jobs() {
        for s in shapes() {
            assert!(s.span() <= 64 * GIB, "{}", s.name);
            let args = s.fio_args("nbd+unix:///x?socket=/s", 3, Path::new("/j.json"));
            assert_eq!(
                args.iter().filter(|a| a.starts_with("--name=")).count(),
                s.jobs.len()
            );
            assert!(args.contains(&"--runtime=3".to_string()));
        }
        assert_eq!(shapes().len(), 8);
    }
}

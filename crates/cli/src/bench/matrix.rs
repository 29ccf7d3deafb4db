//! The benchmark matrix: what `hybridcache bench run` measures, from a TOML file and/or flags.
//!
//! A matrix is the product patterns × block sizes × numjobs × iodepths, each cell run against
//! every selected configuration (`core`, `cache`, `nbdkit-cache`) under one protocol. The file
//! mirrors the flags (docs/bench.md shows both); flags given on the command line override the
//! file's keys. Every key is checked here, before anything is started, and a bad one is named in
//! the error (`matrix.block_sizes: '3q' is not a size ...`): an hour-long matrix should not die in
//! its last cell on a typo. Unknown keys are refused too (serde's `deny_unknown_fields`), because
//! a misspelled optional key would otherwise be silently ignored.

use std::fmt;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use hybridcache_volume::parse_size;
use serde::{Deserialize, Serialize};

/// An I/O pattern as fio names it; `randrw` carries its read share (fio's rwmixread).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum Pattern {
    RandWrite,
    RandRead,
    RandRw(u8),
    Write,
    Read,
}

impl Pattern {
    /// fio's `--rw` value.
    pub fn fio_rw(self) -> &'static str {
        match self {
            Pattern::RandWrite => "randwrite",
            Pattern::RandRead => "randread",
            Pattern::RandRw(_) => "randrw",
            Pattern::Write => "write",
            Pattern::Read => "read",
        }
    }

    pub fn writes(self) -> bool {
        !matches!(self, Pattern::RandRead | Pattern::Read)
    }

    pub fn reads(self) -> bool {
        !matches!(self, Pattern::RandWrite | Pattern::Write)
    }

    pub fn sequential(self) -> bool {
        matches!(self, Pattern::Write | Pattern::Read)
    }

    pub fn rwmixread(self) -> Option<u8> {
        match self {
            Pattern::RandRw(r) => Some(r),
            _ => None,
        }
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Pattern::RandRw(r) => write!(f, "randrw{r}"),
            p => f.write_str(p.fio_rw()),
        }
    }
}

impl std::str::FromStr for Pattern {
    type Err = String;

    /// `randwrite`, `randread`, `write`, `read`, `randrw` (50% reads), `randrw70` or `randrw:70`.
    fn from_str(s: &str) -> Result<Pattern, String> {
        let t = s.trim().to_ascii_lowercase();
        Ok(match t.as_str() {
            "randwrite" => Pattern::RandWrite,
            "randread" => Pattern::RandRead,
            "write" => Pattern::Write,
            "read" => Pattern::Read,
            "randrw" => Pattern::RandRw(50),
            _ => {
                let mix = t
                    .strip_prefix("randrw")
                    .map(|r| r.trim_start_matches(':'))
                    .and_then(|r| r.parse::<u8>().ok())
                    .filter(|r| *r <= 100);
                match mix {
                    Some(r) => Pattern::RandRw(r),
                    None => {
                        return Err(format!(
                        "'{s}' is not a pattern (randwrite, randread, randrw, randrw70, write, read)"
                    ))
                    }
                }
            }
        })
    }
}

impl From<Pattern> for String {
    fn from(p: Pattern) -> String {
        p.to_string()
    }
}

impl TryFrom<String> for Pattern {
    type Error = String;
    fn try_from(s: String) -> Result<Pattern, String> {
        s.parse()
    }
}

/// The three things a cell can be run against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub enum Config {
    /// (a) fio → the bare core export.
    #[serde(rename = "core")]
    Core,
    /// (b) fio → hybridcache daemon → the bare core export.
    #[serde(rename = "cache")]
    Cache,
    /// (c) fio → nbdkit nbd plugin + cache filter → the bare core export.
    #[serde(rename = "nbdkit-cache")]
    Nbdkit,
}

impl Config {
    pub fn name(self) -> &'static str {
        match self {
            Config::Core => "core",
            Config::Cache => "cache",
            Config::Nbdkit => "nbdkit-cache",
        }
    }
}

impl std::str::FromStr for Config {
    type Err = String;
    fn from_str(s: &str) -> Result<Config, String> {
        match s.trim() {
            "core" => Ok(Config::Core),
            "cache" | "hybridcache" => Ok(Config::Cache),
            "nbdkit-cache" | "nbdkit" => Ok(Config::Nbdkit),
            other => Err(format!(
                "'{other}' is not a configuration (core, cache, nbdkit-cache)"
            )),
        }
    }
}

/// Experiment protocols (docs/bench.md describes each).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ProtocolName {
    /// Measure right away, on whatever state the fresh setup is in (a cold cache).
    Plain,
    /// Fill until the cache is full or dirty stops rising, settle, measure at a fresh offset.
    Steady,
    /// Cleaning nop; measure from empty until just before the cache is full.
    Fill,
    /// Cleaning nop; fill with dirty data, then time a full flush (or a cleaning policy's drain).
    Flush,
    /// Warm the region, then measure on it (hits).
    Hits,
    /// From an empty cache, write `burst_factor` times the cache's size and measure all of it
    /// (IOPS over time and the tail as the cache fills with dirty data).
    Burst,
}

impl ProtocolName {
    pub fn name(self) -> &'static str {
        match self {
            ProtocolName::Plain => "plain",
            ProtocolName::Steady => "steady",
            ProtocolName::Fill => "fill",
            ProtocolName::Flush => "flush",
            ProtocolName::Hits => "hits",
            ProtocolName::Burst => "burst",
        }
    }
}

// ------------------------------------------------------------------------------------------
// The file, as written (strings for sizes so "4K" and 4096 both work).

/// A size in a matrix file: `"64K"` or a plain number of bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SizeText {
    Bytes(u64),
    Text(String),
}

impl SizeText {
    fn bytes(&self, key: &str) -> Result<u64> {
        match self {
            SizeText::Bytes(n) => Ok(*n),
            SizeText::Text(t) => parse_size(t).map_err(|e| anyhow!("{key}: {e}")),
        }
    }
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatrixFile {
    #[serde(default)]
    pub matrix: MatrixSection,
    #[serde(default)]
    pub core: CoreSection,
    #[serde(default)]
    pub cache: CacheSection,
    #[serde(default)]
    pub nbdkit: NbdkitSection,
    #[serde(default)]
    pub protocol: ProtocolSection,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MatrixSection {
    pub patterns: Option<Vec<String>>,
    pub block_sizes: Option<Vec<SizeText>>,
    pub iodepths: Option<Vec<u32>>,
    pub numjobs: Option<Vec<u32>>,
    /// Seconds of measurement per cell.
    pub runtime: Option<u64>,
    /// fio's ramp_time: seconds run before measuring starts.
    pub ramp: Option<u64>,
    /// Bytes of the device one phase works on (split between jobs).
    pub size: Option<SizeText>,
    /// Where the first phase starts on the device.
    pub offset: Option<SizeText>,
    /// Which configurations: "core", "cache", "nbdkit-cache".
    pub configs: Option<Vec<String>>,
    /// Repetitions of every cell (the report shows the median).
    pub repeat: Option<u32>,
    /// fio's random_distribution for random patterns: "random" (uniform), "zipf:1.2",
    /// "pareto:0.9", "normal:10", "zoned:...": skewed workloads for promotion and offload.
    pub distribution: Option<String>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoreSection {
    pub device: Option<String>,
    /// NBD workers of the bare-core export (the queue depth the core can see per connection).
    pub workers: Option<usize>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AlruParams {
    pub wake_up: Option<u64>,
    pub staleness: Option<u64>,
    pub flush_max: Option<u64>,
    pub activity: Option<u64>,
    pub dirty_pct: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct AcpParams {
    pub wake_up: Option<u64>,
    pub flush_max: Option<u64>,
}

#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct SeqCutoff {
    pub policy: String,
    pub threshold_kib: Option<u64>,
}

/// `-X -n prefetch -p POLICY` and `-X -n prefetch-readahead -t KIB --distance KIB --max-in-flight N`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PrefetchParams {
    pub policy: String,
    pub threshold_kib: Option<u32>,
    pub distance: Option<u32>,
    pub max_in_flight: Option<u32>,
}

/// `-X -n offload -p on|off` and `-X -n offload-queue --share PCT -t DEPTH`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct OffloadParams {
    pub enabled: bool,
    pub share: Option<u32>,
    pub threshold: Option<u32>,
}

/// `-X -n promotion -p POLICY` and `-X -n promotion-nhit -t N -o PCT`.
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct PromotionParams {
    pub policy: String,
    pub threshold: Option<u32>,
    pub trigger: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheSection {
    pub device: Option<String>,
    pub mode: Option<String>,
    pub line_size: Option<u32>,
    pub cleaning: Option<String>,
    pub alru: Option<AlruParams>,
    pub acp: Option<AcpParams>,
    pub seq_cutoff: Option<SeqCutoff>,
    pub lazy_flush: Option<bool>,
    pub prefetch: Option<PrefetchParams>,
    pub promotion: Option<PromotionParams>,
    pub offload: Option<OffloadParams>,
    pub nbd_workers: Option<usize>,
    pub core_path: Option<CorePath>,
}

/// How the `cache` configuration's daemon reaches the core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum CorePath {
    /// The daemon opens the core device spec itself, as a cache sits on its local disk array.
    #[default]
    Direct,
    /// Through the bare core's export over NBD (how nbdkit's cache filter reaches it): every
    /// core request of the cache, cleaning's included, pays an NBD round trip.
    Nbd,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NbdkitSection {
    /// writeback, writethrough or unsafe.
    pub mode: Option<String>,
    /// Directory of the cache filter's file (its TMPDIR).
    pub cache_dir: Option<String>,
    pub max_size: Option<SizeText>,
    pub min_block_size: Option<SizeText>,
    pub threads: Option<u32>,
}

#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProtocolSection {
    pub name: Option<ProtocolName>,
    /// steady: seconds to keep writing after the cache is full (or dirty stopped rising).
    pub settle: Option<u64>,
    /// steady/flush: give up filling after this many seconds.
    pub fill_max: Option<u64>,
    /// steady: dirty % that rose less than 0.5 points over this many seconds has stopped rising.
    pub plateau: Option<u64>,
    /// fill: stop measuring at this occupancy (%).
    pub stop_pct: Option<f64>,
    /// flush: fill until this dirty share (%).
    pub dirty_pct: Option<f64>,
    /// flush: "flush" (hybridcache -F) or a cleaning policy to switch to ("alru", "acp").
    pub flush_via: Option<String>,
    /// flush: give up waiting for the drain after this many seconds.
    pub drain_max: Option<u64>,
    /// burst: bytes written, as a multiple of the cache's size.
    pub burst_factor: Option<f64>,
}

// ------------------------------------------------------------------------------------------
// Resolved, validated settings.

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheSettings {
    pub device: String,
    pub mode: String,
    pub line_size_kib: u32,
    pub cleaning: Option<String>,
    pub alru: Option<AlruParams>,
    pub acp: Option<AcpParams>,
    pub seq_cutoff: Option<SeqCutoff>,
    /// None: the daemon's default (results.json files written before these keys read as None).
    #[serde(default)]
    pub lazy_flush: Option<bool>,
    #[serde(default)]
    pub prefetch: Option<PrefetchParams>,
    #[serde(default)]
    pub promotion: Option<PromotionParams>,
    #[serde(default)]
    pub offload: Option<OffloadParams>,
    pub nbd_workers: usize,
    /// results.json files written before this key ran their caches through NBD.
    #[serde(default = "core_path_of_old_runs")]
    pub core_path: CorePath,
}

fn core_path_of_old_runs() -> CorePath {
    CorePath::Nbd
}

impl CacheSettings {
    /// The `-X -n GROUP` commands (group, flags) that set this cache's policies, in the order
    /// they are sent; the cleaning policy itself is set last, separately. A group whose keys are
    /// all absent sends nothing, so the daemon's defaults stay.
    pub fn param_commands(&self) -> Vec<(&'static str, Vec<(&'static str, String)>)> {
        fn some<T: ToString>(pairs: &[(&'static str, Option<T>)]) -> Vec<(&'static str, String)> {
            pairs
                .iter()
                .filter_map(|(f, v)| v.as_ref().map(|v| (*f, v.to_string())))
                .collect()
        }
        let mut out = Vec::new();
        if let Some(a) = &self.alru {
            out.push((
                "cleaning-alru",
                some(&[
                    ("-w", a.wake_up),
                    ("-s", a.staleness),
                    ("-b", a.flush_max),
                    ("-t", a.activity),
                    ("-d", a.dirty_pct),
                ]),
            ));
        }
        if let Some(a) = &self.acp {
            out.push((
                "cleaning-acp",
                some(&[("-w", a.wake_up), ("-b", a.flush_max)]),
            ));
        }
        if let Some(s) = &self.seq_cutoff {
            let mut f = vec![("-p", s.policy.clone())];
            f.extend(some(&[("-t", s.threshold_kib)]));
            out.push(("seq-cutoff", f));
        }
        if let Some(p) = &self.promotion {
            // Tunables first: switching to nhit then applies the wanted threshold at once.
            out.push((
                "promotion-nhit",
                some(&[("-t", p.threshold), ("-o", p.trigger)]),
            ));
            out.push(("promotion", vec![("-p", p.policy.clone())]));
        }
        if let Some(on) = self.lazy_flush {
            out.push((
                "lazy-flush",
                vec![("-p", hybridcache_engine::policy::on_off(on).to_string())],
            ));
        }
        if let Some(p) = &self.prefetch {
            out.push((
                "prefetch-readahead",
                some(&[
                    ("-t", p.threshold_kib),
                    ("--distance", p.distance),
                    ("--max-in-flight", p.max_in_flight),
                ]),
            ));
            out.push(("prefetch", vec![("-p", p.policy.clone())]));
        }
        if let Some(o) = &self.offload {
            out.push((
                "offload-queue",
                some(&[("--share", o.share), ("-t", o.threshold)]),
            ));
            out.push((
                "offload",
                vec![(
                    "-p",
                    hybridcache_engine::policy::on_off(o.enabled).to_string(),
                )],
            ));
        }
        out.retain(|(_, f)| !f.is_empty());
        out
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NbdkitSettings {
    pub mode: String,
    pub cache_dir: String,
    pub max_size: Option<u64>,
    pub min_block_size: u64,
    pub threads: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProtocolSettings {
    pub name: ProtocolName,
    pub settle: u64,
    pub fill_max: u64,
    pub plateau: u64,
    pub stop_pct: f64,
    pub dirty_pct: f64,
    pub flush_via: String,
    pub drain_max: u64,
    /// Absent in results.json files written before the burst protocol.
    #[serde(default = "default_burst_factor")]
    pub burst_factor: f64,
}

fn default_burst_factor() -> f64 {
    4.0
}

/// Everything a run needs, checked. Stored verbatim in results.json ("the exact configuration").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Matrix {
    pub patterns: Vec<Pattern>,
    pub block_sizes: Vec<u64>,
    pub iodepths: Vec<u32>,
    pub numjobs: Vec<u32>,
    pub runtime: u64,
    pub ramp: u64,
    pub size: u64,
    pub offset: u64,
    pub repeat: u32,
    /// fio's random_distribution (None: fio's uniform default).
    #[serde(default)]
    pub distribution: Option<String>,
    pub configs: Vec<Config>,
    pub core_device: String,
    pub core_workers: usize,
    pub cache: CacheSettings,
    pub nbdkit: NbdkitSettings,
    pub protocol: ProtocolSettings,
}

/// One measurement to make.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cell {
    pub config: Config,
    pub pattern: Pattern,
    pub bs: u64,
    pub numjobs: u32,
    pub iodepth: u32,
    pub rep: u32,
}

impl Cell {
    /// A stable name: also the directory of the cell's files and the resume key.
    pub fn key(&self) -> String {
        format!(
            "{}/{}/{}/{}x{}/r{}",
            self.config.name(),
            self.pattern,
            size_label(self.bs),
            self.numjobs,
            self.iodepth,
            self.rep
        )
    }
}

/// `4096` → `4K`, `1048576` → `1M`; sizes that are not whole units stay in bytes.
pub fn size_label(bytes: u64) -> String {
    for (shift, unit) in [(40, "T"), (30, "G"), (20, "M"), (10, "K")] {
        if bytes >= 1 << shift && bytes % (1 << shift) == 0 {
            return format!("{}{unit}", bytes >> shift);
        }
    }
    bytes.to_string()
}

impl Matrix {
    /// Every cell, configurations interleaved within each workload point: a drift of the
    /// machine then affects the cells being compared alike.
    pub fn cells(&self) -> Vec<Cell> {
        let mut out = Vec::new();
        for rep in 0..self.repeat {
            for &pattern in &self.patterns {
                for &bs in &self.block_sizes {
                    for &numjobs in &self.numjobs {
                        for &iodepth in &self.iodepths {
                            for &config in &self.configs {
                                out.push(Cell {
                                    config,
                                    pattern,
                                    bs,
                                    numjobs,
                                    iodepth,
                                    rep,
                                });
                            }
                        }
                    }
                }
            }
        }
        out
    }
}

/// Command-line overrides (the `bench run` flags); `None` leaves the file's value or default.
#[derive(Debug, Clone, Default)]
pub struct Overrides {
    pub patterns: Option<Vec<String>>,
    pub block_sizes: Option<Vec<String>>,
    pub iodepths: Option<Vec<u32>>,
    pub numjobs: Option<Vec<u32>>,
    pub runtime: Option<u64>,
    pub size: Option<String>,
    pub offset: Option<String>,
    pub configs: Option<Vec<String>>,
    pub repeat: Option<u32>,
    pub core: Option<String>,
    pub core_workers: Option<usize>,
    pub cache: Option<String>,
    pub cache_mode: Option<String>,
    pub line_size: Option<u32>,
    pub cleaning: Option<String>,
    pub lazy_flush: Option<bool>,
    pub core_path: Option<CorePath>,
    pub protocol: Option<ProtocolName>,
    pub settle: Option<u64>,
    pub nbdkit_max_size: Option<String>,
}

/// Read and parse a matrix file; TOML errors name the key and line.
pub fn load_file(path: &Path) -> Result<MatrixFile> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read the matrix file {}", path.display()))?;
    parse_file(&text).with_context(|| format!("matrix file {}", path.display()))
}

pub fn parse_file(text: &str) -> Result<MatrixFile> {
    toml::from_str(text).map_err(|e| {
        // toml's message spans several lines (a source excerpt); keep it, but on one line.
        anyhow!("{}", e.to_string().trim().replace('\n', " "))
    })
}

fn nonempty<T>(key: &str, v: Vec<T>) -> Result<Vec<T>> {
    if v.is_empty() {
        bail!("{key}: the list is empty");
    }
    Ok(v)
}

fn check_cleaning(key: &str, p: &str) -> Result<()> {
    let presets = hybridcache_engine::policy::CLEANING_PRESETS;
    match p {
        "nop" | "alru" | "acp" => Ok(()),
        _ if presets.contains(&p) => Ok(()),
        other => bail!(
            "{key}: '{other}' is not a cleaning policy (nop, alru, acp) or preset ({})",
            presets.join(", ")
        ),
    }
}

/// Merge file and flags, apply defaults, check every value.
pub fn resolve(file: &MatrixFile, o: &Overrides) -> Result<Matrix> {
    let m = &file.matrix;
    let patterns: Vec<String> = o
        .patterns
        .clone()
        .or_else(|| m.patterns.clone())
        .unwrap_or_else(|| vec!["randwrite".into()]);
    let patterns = nonempty("matrix.patterns", patterns)?
        .iter()
        .map(|p| p.parse().map_err(|e| anyhow!("matrix.patterns: {e}")))
        .collect::<Result<Vec<Pattern>>>()?;
    let block_sizes: Vec<SizeText> = match &o.block_sizes {
        Some(v) => v.iter().map(|s| SizeText::Text(s.clone())).collect(),
        None => m
            .block_sizes
            .clone()
            .unwrap_or_else(|| vec![SizeText::Text("4K".into())]),
    };
    let block_sizes = nonempty("matrix.block_sizes", block_sizes)?
        .iter()
        .map(|s| s.bytes("matrix.block_sizes"))
        .collect::<Result<Vec<u64>>>()?;
    for &bs in &block_sizes {
        if bs == 0 || bs % 512 != 0 || bs > 32 << 20 {
            bail!("matrix.block_sizes: {bs} is not a multiple of 512 bytes between 512 and 32M");
        }
    }
    let iodepths = nonempty(
        "matrix.iodepths",
        o.iodepths
            .clone()
            .or_else(|| m.iodepths.clone())
            .unwrap_or_else(|| vec![1]),
    )?;
    if let Some(d) = iodepths.iter().find(|d| **d == 0 || **d > 1024) {
        bail!("matrix.iodepths: {d} is not between 1 and 1024");
    }
    let numjobs = nonempty(
        "matrix.numjobs",
        o.numjobs
            .clone()
            .or_else(|| m.numjobs.clone())
            .unwrap_or_else(|| vec![1]),
    )?;
    if let Some(n) = numjobs.iter().find(|n| **n == 0 || **n > 256) {
        bail!("matrix.numjobs: {n} is not between 1 and 256");
    }
    let runtime = o.runtime.or(m.runtime).unwrap_or(10);
    if runtime == 0 {
        bail!("matrix.runtime: must be at least 1 second");
    }
    let size = match &o.size {
        Some(s) => parse_size(s).map_err(|e| anyhow!("matrix.size: {e}"))?,
        None => m
            .size
            .as_ref()
            .map(|s| s.bytes("matrix.size"))
            .transpose()?
            .unwrap_or(1 << 30),
    };
    let max_bs = block_sizes.iter().copied().max().unwrap_or(4096);
    let max_jobs = numjobs.iter().copied().max().unwrap_or(1) as u64;
    if size < max_bs * max_jobs {
        bail!(
            "matrix.size: {} is smaller than one block ({}) per job ({max_jobs})",
            size_label(size),
            size_label(max_bs)
        );
    }
    let offset = match &o.offset {
        Some(s) => parse_size(s).map_err(|e| anyhow!("matrix.offset: {e}"))?,
        None => m
            .offset
            .as_ref()
            .map(|s| s.bytes("matrix.offset"))
            .transpose()?
            .unwrap_or(0),
    };
    if offset % 4096 != 0 {
        bail!("matrix.offset: {offset} is not a multiple of 4096");
    }
    let repeat = o.repeat.or(m.repeat).unwrap_or(1);
    if repeat == 0 || repeat > 100 {
        bail!("matrix.repeat: {repeat} is not between 1 and 100");
    }
    let distribution = m.distribution.clone();
    if let Some(d) = &distribution {
        let (kind, arg) = d.split_once(':').unwrap_or((d.as_str(), ""));
        let ok = match kind {
            "random" => arg.is_empty(),
            "zipf" | "pareto" | "normal" => arg.parse::<f64>().is_ok_and(|v| v > 0.0),
            // zoned:60/10:30/20:10/70 and friends: fio checks the zones' sums itself.
            "zoned" | "zoned_abs" => !arg.is_empty(),
            _ => false,
        };
        if !ok {
            bail!("matrix.distribution: '{d}' is not one of random, zipf:THETA, pareto:H, normal:PCT, zoned:...");
        }
    }
    let mut configs = o
        .configs
        .clone()
        .or_else(|| m.configs.clone())
        .unwrap_or_else(|| vec!["core".into(), "cache".into()])
        .iter()
        .map(|c| c.parse().map_err(|e| anyhow!("matrix.configs: {e}")))
        .collect::<Result<Vec<Config>>>()?;
    configs = nonempty("matrix.configs", configs)?;
    configs.sort();
    configs.dedup();

    let core_device = o
        .core
        .clone()
        .or_else(|| file.core.device.clone())
        .ok_or_else(|| {
            anyhow!("core.device: no core device given (--core SPEC or [core] device = \"...\")")
        })?;
    let core_workers = o.core_workers.or(file.core.workers).unwrap_or(32);
    if core_workers == 0 || core_workers > 256 {
        bail!("core.workers: {core_workers} is not between 1 and 256");
    }

    let c = &file.cache;
    let cache_device = o.cache.clone().or_else(|| c.device.clone());
    if configs.contains(&Config::Cache) && cache_device.is_none() {
        bail!("cache.device: the cache configuration needs a cache device (--cache SPEC or [cache] device = \"...\")");
    }
    let mode = o
        .cache_mode
        .clone()
        .or_else(|| c.mode.clone())
        .unwrap_or_else(|| "wb".into());
    mode.parse::<hybridcache_engine::CacheMode>()
        .map_err(|e| anyhow!("cache.mode: {e}"))?;
    let line_size_kib = o.line_size.or(c.line_size).unwrap_or(4);
    hybridcache_engine::LineSize::from_kib(line_size_kib)
        .map_err(|e| anyhow!("cache.line_size: {e}"))?;
    let cleaning = o.cleaning.clone().or_else(|| c.cleaning.clone());
    if let Some(p) = &cleaning {
        check_cleaning("cache.cleaning", p)?;
    }
    if let Some(s) = &c.seq_cutoff {
        if !matches!(s.policy.as_str(), "always" | "full" | "never") {
            bail!(
                "cache.seq_cutoff.policy: '{}' is not one of always, full, never",
                s.policy
            );
        }
    }
    if let Some(p) = &c.promotion {
        let policy = p
            .policy
            .parse::<hybridcache_engine::PromotionPolicy>()
            .map_err(|e| anyhow!("cache.promotion.policy: {e}"))?;
        let d = hybridcache_engine::Promotion::default();
        hybridcache_engine::Promotion {
            policy,
            threshold: p.threshold.unwrap_or(d.threshold),
            trigger_pct: p.trigger.unwrap_or(d.trigger_pct),
        }
        .validate()
        .map_err(|e| anyhow!("cache.promotion: {e}"))?;
    }
    if let Some(p) = &c.prefetch {
        let policy = p
            .policy
            .parse::<hybridcache_engine::PrefetchPolicy>()
            .map_err(|e| anyhow!("cache.prefetch.policy: {e}"))?;
        let d = hybridcache_engine::Prefetch::default();
        hybridcache_engine::Prefetch {
            policy,
            threshold_kib: p.threshold_kib.unwrap_or(d.threshold_kib),
            distance_kib: p.distance.unwrap_or(d.distance_kib),
            max_in_flight: p.max_in_flight.unwrap_or(d.max_in_flight),
        }
        .validate()
        .map_err(|e| anyhow!("cache.prefetch: {e}"))?;
    }
    if let Some(o) = &c.offload {
        let d = hybridcache_engine::Offload::default();
        hybridcache_engine::Offload {
            enabled: o.enabled,
            share_pct: o.share.unwrap_or(d.share_pct),
            threshold: o.threshold.unwrap_or(d.threshold),
        }
        .validate()
        .map_err(|e| anyhow!("cache.offload: {e}"))?;
    }
    let nbd_workers = c.nbd_workers.unwrap_or(32);
    if nbd_workers == 0 || nbd_workers > 256 {
        bail!("cache.nbd_workers: {nbd_workers} is not between 1 and 256");
    }
    let cache = CacheSettings {
        device: cache_device.unwrap_or_default(),
        mode,
        line_size_kib,
        cleaning,
        alru: c.alru.clone(),
        acp: c.acp.clone(),
        seq_cutoff: c.seq_cutoff.clone(),
        lazy_flush: o.lazy_flush.or(c.lazy_flush),
        prefetch: c.prefetch.clone(),
        promotion: c.promotion.clone(),
        offload: c.offload.clone(),
        nbd_workers,
        core_path: o.core_path.or(c.core_path).unwrap_or_default(),
    };

    let n = &file.nbdkit;
    let nb_mode = n.mode.clone().unwrap_or_else(|| "writeback".into());
    if !matches!(nb_mode.as_str(), "writeback" | "writethrough" | "unsafe") {
        bail!("nbdkit.mode: '{nb_mode}' is not one of writeback, writethrough, unsafe");
    }
    let max_size = match &o.nbdkit_max_size {
        Some(s) => Some(parse_size(s).map_err(|e| anyhow!("nbdkit.max_size: {e}"))?),
        None => match &n.max_size {
            Some(s) => Some(s.bytes("nbdkit.max_size")?),
            // The same capacity as hybridcache's cache when that is a RAM device or a file.
            None => cache_capacity(&cache.device),
        },
    };
    let min_block_size = n
        .min_block_size
        .as_ref()
        .map(|s| s.bytes("nbdkit.min_block_size"))
        .transpose()?
        .unwrap_or(4096);
    if min_block_size < 4096 || !min_block_size.is_power_of_two() {
        bail!("nbdkit.min_block_size: {min_block_size} must be a power of two >= 4096 (nbdkit's rule)");
    }
    let nbdkit = NbdkitSettings {
        mode: nb_mode,
        cache_dir: n.cache_dir.clone().unwrap_or_else(|| "/dev/shm".into()),
        max_size,
        min_block_size,
        threads: n.threads,
    };

    let p = &file.protocol;
    let flush_via = p.flush_via.clone().unwrap_or_else(|| "flush".into());
    if flush_via != "flush" {
        check_cleaning("protocol.flush_via", &flush_via)?;
        if flush_via == "nop" {
            bail!("protocol.flush_via: nop never drains; use flush, alru or acp");
        }
    }
    let stop_pct = p.stop_pct.unwrap_or(95.0);
    let dirty_pct = p.dirty_pct.unwrap_or(90.0);
    for (key, v) in [
        ("protocol.stop_pct", stop_pct),
        ("protocol.dirty_pct", dirty_pct),
    ] {
        if !(v > 0.0 && v <= 100.0) {
            bail!("{key}: {v} is not a percentage in (0, 100]");
        }
    }
    let burst_factor = p.burst_factor.unwrap_or_else(default_burst_factor);
    if !(burst_factor > 0.0 && burst_factor <= 1000.0) {
        bail!("protocol.burst_factor: {burst_factor} is not in (0, 1000]");
    }
    let protocol = ProtocolSettings {
        name: o.protocol.or(p.name).unwrap_or(ProtocolName::Plain),
        settle: o.settle.or(p.settle).unwrap_or(60),
        fill_max: p.fill_max.unwrap_or(1800),
        plateau: p.plateau.unwrap_or(10).max(1),
        stop_pct,
        dirty_pct,
        flush_via,
        drain_max: p.drain_max.unwrap_or(1800),
        burst_factor,
    };
    let matrix = Matrix {
        patterns,
        block_sizes,
        iodepths,
        numjobs,
        runtime,
        ramp: m.ramp.unwrap_or(0),
        size,
        offset,
        repeat,
        distribution,
        configs,
        core_device,
        core_workers,
        cache,
        nbdkit,
        protocol,
    };
    if let ProtocolName::Flush | ProtocolName::Burst = matrix.protocol.name {
        if let Some(p) = matrix.patterns.iter().find(|p| !p.writes()) {
            bail!(
                "protocol.name: {} needs write patterns to fill the cache with dirty data, and {p} only reads",
                matrix.protocol.name.name()
            );
        }
    }
    if matrix.protocol.name == ProtocolName::Burst && cache_capacity(&matrix.cache.device).is_none()
    {
        bail!("protocol.name: burst writes a multiple of the cache's size, so cache.device must be ram:SIZE or an existing file (got '{}')", matrix.cache.device);
    }
    Ok(matrix)
}

/// The capacity of a cache device spec when it can be told without opening it.
pub fn cache_capacity(spec: &str) -> Option<u64> {
    if let Some(s) = spec.strip_prefix("ram:") {
        return parse_size(s).ok();
    }
    let path = spec.strip_prefix("file:").unwrap_or(spec);
    std::fs::metadata(path)
        .ok()
        .filter(|m| m.is_file())
        .map(|m| m.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn resolve_text(text: &str) -> Result<Matrix> {
        resolve(&parse_file(text)?, &Overrides::default())
    }

    const GOOD: &str = r#"
[matrix]
patterns = ["randwrite", "randrw70", "write"]
block_sizes = ["4K", 65536]
iodepths = [1, 32]
numjobs = [1, 4]
runtime = 3
size = "1G"
configs = ["core", "cache", "nbdkit-cache"]

[core]
device = "ram:4G"

[cache]
device = "ram:512M"
mode = "wb"
cleaning = "alru"
alru = { wake_up = 1, staleness = 1 }
seq_cutoff = { policy = "never" }

[protocol]
name = "steady"
settle = 5
"#;

    #[test]
    fn a_full_file_resolves() {
        let m = resolve_text(GOOD).unwrap();
        assert_eq!(
            m.patterns,
            vec![Pattern::RandWrite, Pattern::RandRw(70), Pattern::Write]
        );
        assert_eq!(m.block_sizes, vec![4096, 65536]);
        assert_eq!(m.protocol.name, ProtocolName::Steady);
        assert_eq!(m.nbdkit.max_size, Some(512 << 20));
        assert_eq!(m.cells().len(), 3 * 2 * 2 * 2 * 3);
        let c = &m.cells()[0];
        assert_eq!(c.key(), "core/randwrite/4K/1x1/r0");
    }

    #[test]
    fn flags_override_the_file() {
        let f = parse_file(GOOD).unwrap();
        let o = Overrides {
            iodepths: Some(vec![4]),
            configs: Some(vec!["core".into()]),
            protocol: Some(ProtocolName::Plain),
            ..Default::default()
        };
        let m = resolve(&f, &o).unwrap();
        assert_eq!(m.iodepths, vec![4]);
        assert_eq!(m.configs, vec![Config::Core]);
        assert_eq!(m.protocol.name, ProtocolName::Plain);
    }

    #[test]
    fn the_cache_opens_its_core_itself_unless_told_to_go_through_nbd() {
        assert_eq!(
            resolve_text(GOOD).unwrap().cache.core_path,
            CorePath::Direct
        );
        let nbd = format!("{GOOD}\n").replace("[cache]\n", "[cache]\ncore_path = \"nbd\"\n");
        let f = parse_file(&nbd).unwrap();
        assert_eq!(
            resolve(&f, &Overrides::default()).unwrap().cache.core_path,
            CorePath::Nbd
        );
        let o = Overrides {
            core_path: Some(CorePath::Direct),
            ..Default::default()
        };
        assert_eq!(resolve(&f, &o).unwrap().cache.core_path, CorePath::Direct);
        let bad = format!("{GOOD}\n").replace("[cache]\n", "[cache]\ncore_path = \"tcp\"\n");
        let e = format!("{:#}", parse_file(&bad).unwrap_err());
        assert!(e.contains("core_path") || e.contains("tcp"), "{e}");
        // A results.json written before the key ran its cache through the bare export.
        let old: CacheSettings = serde_json::from_value(serde_json::json!({
            "device": "ram:1G", "mode": "wb", "line_size_kib": 4, "cleaning": null, "alru": null,
            "acp": null, "seq_cutoff": null, "nbd_workers": 32
        }))
        .unwrap();
        assert_eq!(old.core_path, CorePath::Nbd);
    }

    #[test]
    fn bad_files_name_the_key() {
        let err = |t: &str| format!("{:#}", resolve_text(t).unwrap_err());
        let e = err("[matrix]\nblok_sizes = [\"4K\"]\n[core]\ndevice=\"ram:1G\"");
        assert!(e.contains("blok_sizes"), "{e}");
        let e = err("[matrix]\nblock_sizes = [\"3q\"]\n[core]\ndevice=\"ram:1G\"");
        assert!(e.contains("matrix.block_sizes") && e.contains("3q"), "{e}");
        let e = err("[matrix]\npatterns = [\"randomwrite\"]\n[core]\ndevice=\"ram:1G\"");
        assert!(
            e.contains("matrix.patterns") && e.contains("randomwrite"),
            "{e}"
        );
        let e = err("[matrix]\niodepths = [0]\n[core]\ndevice=\"ram:1G\"");
        assert!(e.contains("matrix.iodepths"), "{e}");
        let e = err("[matrix]\niodepths = \"8\"\n[core]\ndevice=\"ram:1G\"");
        assert!(e.contains("iodepths"), "{e}");
        let e = err("[matrix]\nruntime = 1");
        assert!(e.contains("core.device"), "{e}");
        let e = err("[core]\ndevice=\"ram:1G\"");
        assert!(e.contains("cache.device"), "{e}");
        let e = err("[core]\ndevice=\"ram:1G\"\n[cache]\ndevice=\"ram:1G\"\ncleaning=\"fast\"");
        assert!(e.contains("cache.cleaning") && e.contains("fast"), "{e}");
        let e = err("[core]\ndevice=\"ram:1G\"\n[cache]\ndevice=\"ram:1G\"\nmode=\"xx\"");
        assert!(e.contains("cache.mode"), "{e}");
        let e =
            err("[core]\ndevice=\"ram:1G\"\n[cache]\ndevice=\"ram:1G\"\n[protocol]\nname=\"warm\"");
        assert!(e.contains("warm"), "{e}");
        let e = err("[core]\ndevice=\"ram:1G\"\n[cache]\ndevice=\"ram:1G\"\n[matrix]\npatterns=[\"randread\"]\n[protocol]\nname=\"flush\"");
        assert!(e.contains("protocol.name"), "{e}");
        let e = err("[core]\ndevice=\"ram:1G\"\n[cache]\ndevice=\"ram:1G\"\n[matrix]\nsize=\"4K\"\nblock_sizes=[\"64K\"]");
        assert!(e.contains("matrix.size"), "{e}");
    }

    #[test]
    fn policy_keys_become_the_cli_commands() {
        let m = resolve_text(
            r#"
[core]
device = "ram:1G"
[cache]
device = "ram:64M"
lazy_flush = true
prefetch = { policy = "readahead", threshold_kib = 128, distance = 2048, max_in_flight = 8 }
promotion = { policy = "nhit", threshold = 2, trigger = 0 }
offload = { enabled = true, share = 40, threshold = 0 }
seq_cutoff = { policy = "never" }
"#,
        )
        .unwrap();
        let cmds = m.cache.param_commands();
        let flat: Vec<String> = cmds
            .iter()
            .map(|(g, f)| {
                let f: Vec<String> = f.iter().map(|(k, v)| format!("{k} {v}")).collect();
                format!("{g}: {}", f.join(" "))
            })
            .collect();
        assert_eq!(
            flat,
            vec![
                "seq-cutoff: -p never",
                "promotion-nhit: -t 2 -o 0",
                "promotion: -p nhit",
                "lazy-flush: -p on",
                "prefetch-readahead: -t 128 --distance 2048 --max-in-flight 8",
                "prefetch: -p readahead",
                "offload-queue: --share 40 -t 0",
                "offload: -p on",
            ]
        );

        // Only the policy: the tunables keep the daemon's values; lazy flush off is sent (it
        // must override whatever the daemon's default is).
        let m = resolve_text(
            "[core]\ndevice=\"ram:1G\"\n[cache]\ndevice=\"ram:1G\"\nlazy_flush = false\nprefetch = { policy = \"none\" }\npromotion = { policy = \"always\" }",
        )
        .unwrap();
        let groups: Vec<_> = m.cache.param_commands();
        assert_eq!(
            groups,
            vec![
                ("promotion", vec![("-p", "always".to_string())]),
                ("lazy-flush", vec![("-p", "off".to_string())]),
                ("prefetch", vec![("-p", "none".to_string())]),
            ]
        );
        // Absent keys send nothing at all.
        let m = resolve_text("[core]\ndevice=\"ram:1G\"\n[cache]\ndevice=\"ram:1G\"").unwrap();
        assert!(m.cache.param_commands().is_empty());
    }

    #[test]
    fn bad_policy_keys_name_the_key() {
        let err = |extra: &str| {
            let t = format!("[core]\ndevice=\"ram:1G\"\n[cache]\ndevice=\"ram:1G\"\n{extra}");
            format!("{:#}", resolve_text(&t).unwrap_err())
        };
        let e = err("lazy_flush = \"maybe\"");
        assert!(e.contains("lazy_flush"), "{e}");
        let e = err("prefetch = { policy = \"ahead\" }");
        assert!(
            e.contains("cache.prefetch.policy") && e.contains("ahead"),
            "{e}"
        );
        let e = err("prefetch = { policy = \"readahead\", distance = 1 }");
        assert!(
            e.contains("cache.prefetch") && e.contains("distance"),
            "{e}"
        );
        let e = err("prefetch = { policy = \"readahead\", threshold = 1 }");
        assert!(e.contains("threshold"), "{e}");
        let e = err("promotion = { policy = \"sometimes\" }");
        assert!(e.contains("cache.promotion.policy"), "{e}");
        let e = err("promotion = { policy = \"nhit\", threshold = 1 }");
        assert!(
            e.contains("cache.promotion") && e.contains("threshold"),
            "{e}"
        );
        let e = err("promotion = { policy = \"nhit\", trigger = 101 }");
        assert!(e.contains("trigger"), "{e}");
        let e = err("offload = { enabled = true, share = 101 }");
        assert!(e.contains("cache.offload") && e.contains("share"), "{e}");
        let e = err("offload = { share = 10 }");
        assert!(e.contains("enabled"), "{e}");
        let e = err("[matrix]\ndistribution = \"zipf\"");
        assert!(e.contains("matrix.distribution"), "{e}");
        let e = err("[matrix]\ndistribution = \"lognormal:3\"");
        assert!(e.contains("matrix.distribution"), "{e}");
        let ok = |d: &str| {
            let t = format!("[matrix]\ndistribution = \"{d}\"\n[core]\ndevice=\"ram:1G\"\n[cache]\ndevice=\"ram:1G\"");
            resolve_text(&t).unwrap().distribution
        };
        assert_eq!(ok("zipf:1.2").as_deref(), Some("zipf:1.2"));
        assert_eq!(
            ok("zoned:60/10:40/90").as_deref(),
            Some("zoned:60/10:40/90")
        );
    }

    #[test]
    fn results_written_before_the_policy_keys_still_load() {
        let m = resolve_text(GOOD).unwrap();
        let mut v = serde_json::to_value(&m).unwrap();
        let cache = v["cache"].as_object_mut().unwrap();
        for k in ["lazy_flush", "prefetch", "promotion", "offload"] {
            assert!(cache.remove(k).is_some(), "{k}");
        }
        assert!(v.as_object_mut().unwrap().remove("distribution").is_some());
        let back: Matrix = serde_json::from_value(v).unwrap();
        assert_eq!(back, m);
    }

    #[test]
    fn patterns_parse_and_print() {
        for (t, p) in [
            ("randwrite", Pattern::RandWrite),
            ("randrw", Pattern::RandRw(50)),
            ("randrw:30", Pattern::RandRw(30)),
            ("randrw70", Pattern::RandRw(70)),
            ("READ", Pattern::Read),
        ] {
            assert_eq!(t.parse::<Pattern>().unwrap(), p, "{t}");
        }
        assert!("randrw101".parse::<Pattern>().is_err());
        assert_eq!(Pattern::RandRw(30).to_string(), "randrw30");
        assert_eq!(size_label(65536), "64K");
        assert_eq!(size_label(1000), "1000");
    }
}

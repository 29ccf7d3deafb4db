//! `hybridcache bench`: benchmarks that produce the tables storage engineers publish.
//!
//! A subcommand group:
//! - `bench run`: fio through NBD over a matrix (patterns × block sizes × numjobs × iodepths)
//!   against the core alone, a hybridcache cache in front of it, and optionally nbdkit's cache
//!   filter in front of the very same core, under one of the field's protocols; writes
//!   results.json, report.md and PNG charts into an output directory, and can be interrupted
//!   and resumed (`--resume`).
//! - `bench calibration`: the emulated RAID 60's no-cache figures next to the study's
//!   (docs/devices.md), from the in-process simulation and/or through fio and NBD for real.
//!
//! - `bench device`: a cache hit against the cache device itself, raw and through nbdkit
//!   (perf.md §4).
//! - `bench engine`: the engine alone (`hybridcache_engine::bench`, also `cargo bench`) against
//!   Open CAS's engine marks.
//!
//! docs/bench.md is the user's guide.

pub mod calibration;
pub mod device;
pub mod engine;
pub mod fio;
pub mod matrix;
pub mod procs;
pub mod protocol;
pub mod report;
pub mod rig;
pub mod run;
pub mod search;

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, Subcommand};

use matrix::ProtocolName;

#[derive(Debug, Clone, Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    pub command: BenchCommand,
}

#[derive(Debug, Clone, Subcommand)]
pub enum BenchCommand {
    /// Run fio over a matrix against the core alone, a cache, and nbdkit's cache filter.
    Run(Box<RunArgs>),
    /// Print the emulated RAID 60's no-cache figures next to the study's (domain.md §10).
    Calibration(calibration::CalibrationArgs),
    /// The engine alone against Open CAS's engine marks (docs/performance.md §1).
    Engine(engine::EngineArgs),
    /// A cache hit against the cache device itself: fio raw, through hybridcache, through
    /// nbdkit's file plugin (docs/performance.md §6). WRITES to the device.
    Device(device::DeviceArgs),
    /// Grid-search cache configurations per workload shape and run the analyzer's
    /// recommendation from a trace of the same workload (docs/analyzer.md).
    Search(search::SearchArgs),
    /// IOPS over time of several runs' cells in one chart (e.g. lazy flush on and off).
    Overlay(OverlayArgs),
}

/// `bench overlay -o FILE.png LABEL=DIR...`.
#[derive(Debug, Clone, Args)]
pub struct OverlayArgs {
    /// The PNG to write.
    #[arg(long, short = 'o', value_name = "FILE")]
    pub out: PathBuf,
    /// Which configuration's cells: core, cache, nbdkit-cache.
    #[arg(long, default_value = "cache")]
    pub config: String,
    /// The chart's title.
    #[arg(long, default_value = "IOPS over time")]
    pub title: String,
    /// Runs as LABEL=DIR (a `bench run` output directory).
    #[arg(required = true, value_name = "LABEL=DIR")]
    pub runs: Vec<String>,
}

fn overlay(a: &OverlayArgs) -> Result<()> {
    let config: matrix::Config = a
        .config
        .parse()
        .map_err(|e: String| anyhow::Error::new(UsageError(e)))?;
    let mut runs = Vec::new();
    for r in &a.runs {
        let Some((label, dir)) = r.split_once('=') else {
            return Err(UsageError(format!("'{r}' is not LABEL=DIR")).into());
        };
        runs.push((label.to_string(), PathBuf::from(dir)));
    }
    let n = report::overlay(&runs, config, &a.title, &a.out)?;
    println!("{}: {n} series", a.out.display());
    Ok(())
}

/// `bench run`. Lists are comma-separated (`--bs 4K,64K`); every flag overrides the same key
/// of the matrix file.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Matrix file (TOML; see docs/bench.md).
    #[arg(long, short = 'm', value_name = "FILE")]
    pub matrix: Option<PathBuf>,
    /// Output directory (results.json, report.md, charts/, cells/).
    #[arg(long, short = 'o', value_name = "DIR", default_value = "bench-out")]
    pub out: PathBuf,
    /// Skip the cells already measured in DIR/results.json.
    #[arg(long)]
    pub resume: bool,
    /// Print the cells and exit.
    #[arg(long)]
    pub dry_run: bool,
    /// Patterns: randwrite, randread, randrw (50% reads), randrw70, randrw30, write, read.
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub pattern: Option<Vec<String>>,
    /// Block sizes (4K,64K).
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub bs: Option<Vec<String>>,
    /// Queue depths per job (1,4,8,16,32).
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub iodepth: Option<Vec<u32>>,
    /// fio jobs (1,4).
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub numjobs: Option<Vec<u32>>,
    /// Seconds measured per cell.
    #[arg(long, value_name = "S")]
    pub runtime: Option<u64>,
    /// Bytes of the device a phase works on (split between jobs) [default: 1G].
    #[arg(long, value_name = "SIZE")]
    pub size: Option<String>,
    /// Where the region starts [default: 0].
    #[arg(long, value_name = "SIZE")]
    pub offset: Option<String>,
    /// Repetitions of every cell (tables show the median).
    #[arg(long, value_name = "N")]
    pub repeat: Option<u32>,
    /// Configurations: core, cache, nbdkit-cache [default: core,cache].
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub configs: Option<Vec<String>>,
    /// Core device spec (e.g. raid:preset=study60,disk_size=64G,nodata).
    #[arg(long, value_name = "SPEC")]
    pub core: Option<String>,
    /// NBD workers of the bare-core export [default: 32].
    #[arg(long, value_name = "N")]
    pub core_workers: Option<usize>,
    /// Cache device spec (ram:1G, a file).
    #[arg(long, value_name = "SPEC")]
    pub cache: Option<String>,
    /// Cache mode [default: wb].
    #[arg(long, value_name = "MODE")]
    pub cache_mode: Option<String>,
    /// Cache line size, KiB [default: 4].
    #[arg(long, value_name = "KIB")]
    pub line_size: Option<u32>,
    /// Cleaning policy: nop, alru, acp [default: the daemon's].
    #[arg(long, value_name = "POLICY")]
    pub cleaning: Option<String>,
    /// How the cache reaches the core: direct (the daemon opens the core spec itself, as on a
    /// local array) or nbd (through the bare export, the rig before issue 20) [default: direct].
    #[arg(long, value_enum, value_name = "PATH")]
    pub core_path: Option<matrix::CorePath>,
    /// Lazy flush: on or off [default: the daemon's].
    #[arg(long, value_name = "on|off", value_parser = on_off)]
    pub lazy_flush: Option<bool>,
    /// Protocol [default: plain].
    #[arg(long, value_enum)]
    pub protocol: Option<ProtocolName>,
    /// steady: seconds to keep writing once the cache is full [default: 60].
    #[arg(long, value_name = "S")]
    pub settle: Option<u64>,
    /// nbdkit-cache: cache-max-size [default: the cache device's size].
    #[arg(long, value_name = "SIZE")]
    pub nbdkit_max_size: Option<String>,
}

fn on_off(v: &str) -> Result<bool, String> {
    hybridcache_engine::policy::parse_on_off("--lazy-flush", v)
}

/// Run a `bench` subcommand. Returns the process exit code (130 after an interruption).
pub fn main(args: &BenchArgs) -> Result<u8> {
    match &args.command {
        BenchCommand::Run(a) => run::run(a),
        BenchCommand::Calibration(a) => calibration::run(a).map(|()| 0),
        BenchCommand::Engine(a) => engine::run(a).map(|()| 0),
        BenchCommand::Device(a) => device::run(a).map(|()| 0),
        BenchCommand::Search(a) => search::run(a),
        BenchCommand::Overlay(a) => overlay(a).map(|()| 0),
    }
}

/// A bad matrix file or flag: the command line's fault (exit code 2), not the run's.
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for UsageError {}

pub fn is_usage_error(e: &anyhow::Error) -> bool {
    e.downcast_ref::<UsageError>().is_some()
}

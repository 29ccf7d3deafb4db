//! What a benchmark leaves behind: `results.json` (every figure, the exact configuration, tool
//! versions and the machine), tables in the field's form (rows block size, columns
//! numjobs/iodepth such as `1/32`), ratio tables against the core alone, PNG charts, and
//! `report.md` embedding them.
//!
//! With `repeat > 1` every table cell is the median of the repetitions (figures from a shared
//! machine drift by tens of percent; the median is robust to one bad run).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::matrix::{size_label, Cell, Config, CorePath, Matrix, Pattern, ProtocolName};
use super::protocol::{CellOutcome, Sample};
use crate::chart::{bar_chart, line_chart, LineChart, Series};

/// Format marker of results.json, bumped when its meaning changes.
pub const FORMAT: &str = "hybridcache-bench/1";

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Versions {
    pub hybridcache: String,
    pub fio: String,
    pub nbdkit: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    pub cpu: String,
    pub cores: usize,
    pub kernel: String,
    pub memory_bytes: u64,
}

impl Machine {
    pub fn probe() -> Machine {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find_map(|l| l.strip_prefix("model name"))
            .and_then(|l| l.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
            .unwrap_or_else(|| "unknown".into());
        let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
        let memory_bytes = meminfo
            .lines()
            .find_map(|l| l.strip_prefix("MemTotal:"))
            .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
            .map(|kib| kib * 1024)
            .unwrap_or(0);
        Machine {
            cpu,
            cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            kernel: std::fs::read_to_string("/proc/sys/kernel/osrelease")
                .map(|s| format!("Linux {}", s.trim()))
                .unwrap_or_else(|_| "unknown".into()),
            memory_bytes,
        }
    }
}

/// One cell's record in results.json.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CellResult {
    pub key: String,
    pub cell: Cell,
    pub protocol: ProtocolName,
    /// "ok" or "failed".
    pub status: String,
    pub error: Option<String>,
    pub finished_unix: u64,
    pub outcome: Option<CellOutcome>,
}

impl CellResult {
    pub fn ok(&self) -> bool {
        self.status == "ok" && self.outcome.is_some()
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Results {
    pub format: String,
    pub command: Vec<String>,
    pub started_unix: u64,
    pub updated_unix: u64,
    /// Every cell of the matrix is in `cells` (false after an interruption).
    pub complete: bool,
    pub versions: Versions,
    pub machine: Machine,
    pub matrix: Matrix,
    pub cells: Vec<CellResult>,
}

impl Results {
    pub fn load(path: &Path) -> Result<Results> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("{} does not parse", path.display()))
    }

    /// Write atomically (temp file + rename), so an interruption never leaves half a file.
    pub fn save(&self, path: &Path) -> Result<()> {
        let tmp = path.with_extension("json.tmp");
        let text = serde_json::to_string_pretty(self).context("encoding the results")?;
        std::fs::write(&tmp, text).with_context(|| format!("cannot write {}", tmp.display()))?;
        std::fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
    }
}

/// A figure taken from one cell's outcome.
pub type Metric = fn(&CellOutcome) -> Option<f64>;

pub fn iops(o: &CellOutcome) -> Option<f64> {
    Some(o.fio.iops)
}
pub fn mb_s(o: &CellOutcome) -> Option<f64> {
    Some(o.fio.mb_s)
}
pub fn lat_mean_ms(o: &CellOutcome) -> Option<f64> {
    Some(o.fio.main_dir().lat_mean_us / 1000.0)
}
pub fn lat_p99_ms(o: &CellOutcome) -> Option<f64> {
    Some(o.fio.main_dir().lat_p99_us / 1000.0)
}
pub fn lat_p9999_ms(o: &CellOutcome) -> Option<f64> {
    Some(o.fio.main_dir().lat_p9999_us / 1000.0)
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    })
}

/// A table: rows block size, columns numjobs/iodepth.
#[derive(Debug, Clone, PartialEq)]
pub struct Grid {
    pub columns: Vec<String>,
    pub rows: Vec<(String, Vec<Option<f64>>)>,
}

fn columns(m: &Matrix) -> Vec<(u32, u32)> {
    let mut c = Vec::new();
    for &nj in &m.numjobs {
        for &qd in &m.iodepths {
            c.push((nj, qd));
        }
    }
    c
}

/// The median of `metric` over the repetitions of every (bs, numjobs, iodepth) point.
pub fn grid(res: &Results, config: Config, pattern: Pattern, metric: Metric) -> Grid {
    let m = &res.matrix;
    let cols = columns(m);
    let mut values: BTreeMap<(u64, u32, u32), Vec<f64>> = BTreeMap::new();
    for c in res.cells.iter().filter(|c| c.ok()) {
        if c.cell.config != config || c.cell.pattern != pattern {
            continue;
        }
        if let Some(v) = c.outcome.as_ref().and_then(metric) {
            values
                .entry((c.cell.bs, c.cell.numjobs, c.cell.iodepth))
                .or_default()
                .push(v);
        }
    }
    Grid {
        columns: cols.iter().map(|(nj, qd)| format!("{nj}/{qd}")).collect(),
        rows: m
            .block_sizes
            .iter()
            .map(|&bs| {
                (
                    size_label(bs),
                    cols.iter()
                        .map(|&(nj, qd)| values.get(&(bs, nj, qd)).and_then(|v| median(v.clone())))
                        .collect(),
                )
            })
            .collect(),
    }
}

/// Cell-wise a / b.
pub fn ratio(a: &Grid, b: &Grid) -> Grid {
    Grid {
        columns: a.columns.clone(),
        rows: a
            .rows
            .iter()
            .zip(&b.rows)
            .map(|((label, x), (_, y))| {
                (
                    label.clone(),
                    x.iter()
                        .zip(y)
                        .map(|(x, y)| match (x, y) {
                            (Some(x), Some(y)) if *y > 0.0 => Some(x / y),
                            _ => None,
                        })
                        .collect(),
                )
            })
            .collect(),
    }
}

/// Figures with about three significant digits: 63, 201, 1.22k style is for charts; tables
/// keep plain numbers people can copy.
pub fn fmt_value(v: f64) -> String {
    let a = v.abs();
    if a >= 100.0 {
        format!("{v:.0}")
    } else if a >= 10.0 {
        format!("{v:.1}")
    } else if a >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

/// A Markdown table; `suffix` follows each value (e.g. "x" for ratios).
pub fn markdown(g: &Grid, corner: &str, suffix: &str) -> String {
    let mut s = format!("| {corner} | {} |\n", g.columns.join(" | "));
    let _ = writeln!(s, "|---|{}", "---:|".repeat(g.columns.len()));
    for (label, vals) in &g.rows {
        let cells: Vec<String> = vals
            .iter()
            .map(|v| match v {
                Some(v) => format!("{}{suffix}", fmt_value(*v)),
                None => "-".into(),
            })
            .collect();
        let _ = writeln!(s, "| {label} | {} |", cells.join(" | "));
    }
    s
}

fn configs_present(res: &Results) -> Vec<Config> {
    res.matrix.configs.clone()
}

fn chart_name(kind: &str, pattern: Pattern, bs: u64) -> String {
    format!("charts/{kind}-{pattern}-{}.png", size_label(bs))
}

/// Draw every chart; returns the relative paths written.
pub fn charts(res: &Results, out: &Path) -> Result<Vec<String>> {
    let dir = out.join("charts");
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let m = &res.matrix;
    let mut written = Vec::new();
    for &pattern in &m.patterns {
        for &bs in &m.block_sizes {
            // IOPS vs iodepth, one line per configuration (and numjobs when there are several).
            let mut series = Vec::new();
            for config in configs_present(res) {
                let g = grid(res, config, pattern, iops);
                let row = g
                    .rows
                    .iter()
                    .find(|(l, _)| *l == size_label(bs))
                    .map(|(_, v)| v.clone())
                    .unwrap_or_default();
                for &nj in &m.numjobs {
                    let points: Vec<(f64, f64)> = columns(m)
                        .iter()
                        .zip(&row)
                        .filter(|((n, _), _)| *n == nj)
                        .filter_map(|((_, qd), v)| v.map(|v| (*qd as f64, v)))
                        .collect();
                    if points.is_empty() {
                        continue;
                    }
                    let label = if m.numjobs.len() > 1 {
                        format!("{} numjobs {nj}", config.name())
                    } else {
                        config.name().to_string()
                    };
                    series.push(Series { label, points });
                }
            }
            if series.is_empty() {
                continue;
            }
            let name = chart_name("iops", pattern, bs);
            let title = format!("{pattern} {}: IOPS vs iodepth", size_label(bs));
            if m.iodepths.len() > 1 {
                line_chart(
                    &out.join(&name),
                    &LineChart {
                        title: &title,
                        x_label: "iodepth",
                        y_label: "IOPS",
                        series: &series,
                        log_x: true,
                        log_y: true,
                    },
                )?;
            } else {
                let bars: Vec<(String, f64)> = series
                    .iter()
                    .filter_map(|s| s.points.first().map(|p| (s.label.clone(), p.1)))
                    .collect();
                bar_chart(&out.join(&name), &title, "configuration", "IOPS", &bars)?;
            }
            written.push(name);

            // burst: IOPS over time, one line per configuration and iodepth (first numjobs,
            // first rep): the shape of the burst is the finding, not its average.
            if m.protocol.name == ProtocolName::Burst {
                let over_time = first_rep_series(res, m, pattern, bs, iops_series);
                if !over_time.is_empty() {
                    let name = chart_name("iops-time", pattern, bs);
                    line_chart(
                        &out.join(&name),
                        &LineChart {
                            title: &format!("{pattern} {}: IOPS during the burst", size_label(bs)),
                            x_label: "time (s)",
                            y_label: "IOPS",
                            series: &over_time,
                            log_x: false,
                            log_y: false,
                        },
                    )?;
                    written.push(name);
                }
            }

            // The steady state over the measured run, one line per iodepth (first numjobs,
            // first rep): the dirty share, cleaning's throughput, and the lines a write can take.
            let over_time = |field: fn(&Sample) -> Option<f64>| {
                first_rep_series(res, m, pattern, bs, |c| {
                    c.outcome
                        .iter()
                        .flat_map(|o| &o.series)
                        .filter_map(|s| field(s).map(|v| (s.t, v)))
                        .collect()
                })
            };
            let steady = [
                (
                    "dirty",
                    "dirty share of the cache",
                    "dirty (%)",
                    over_time(|s| s.dirty_pct),
                ),
                (
                    "cleaning",
                    "cleaning, lines written to the core and marked clean",
                    "lines/s",
                    over_time(|s| s.cleaned_lines_s),
                ),
                // Free and clean apart: one chart of both had more lines than the palette has
                // colours.
                (
                    "free",
                    "free lines (a write takes one at once)",
                    "% of the cache's lines",
                    over_time(|s| s.free_pct),
                ),
                (
                    "clean",
                    "clean lines (a write takes one once evicted)",
                    "% of the cache's lines",
                    over_time(|s| s.clean_pct),
                ),
            ];
            for (kind, what, y_label, series) in steady {
                if series.is_empty() {
                    continue;
                }
                let name = chart_name(kind, pattern, bs);
                line_chart(
                    &out.join(&name),
                    &LineChart {
                        title: &format!("{pattern} {}: {what}", size_label(bs)),
                        x_label: "time (s)",
                        y_label,
                        series: &series,
                        log_x: false,
                        log_y: false,
                    },
                )?;
                written.push(name);
            }
        }
    }
    Ok(written)
}

/// One line per configuration and iodepth of a pattern and block size, from the first numjobs
/// and first repetition of its successful cells; `points` gives a cell's line (cells without
/// points are left out).
fn first_rep_series(
    res: &Results,
    m: &Matrix,
    pattern: Pattern,
    bs: u64,
    points: impl Fn(&CellResult) -> Vec<(f64, f64)>,
) -> Vec<Series> {
    res.cells
        .iter()
        .filter(|c| {
            c.ok()
                && c.cell.pattern == pattern
                && c.cell.bs == bs
                && c.cell.rep == 0
                && c.cell.numjobs == m.numjobs[0]
        })
        .filter_map(|c| {
            let points = points(c);
            (!points.is_empty()).then(|| Series {
                label: format!("{} iodepth {}", c.cell.config.name(), c.cell.iodepth),
                points,
            })
        })
        .collect()
}

/// IOPS over time of one cell's measured phase (the series' throughput over the block size).
fn iops_series(c: &CellResult) -> Vec<(f64, f64)> {
    c.outcome
        .iter()
        .flat_map(|o| &o.series)
        .filter_map(|s| s.mb_s.map(|v| (s.t, v * 1e6 / c.cell.bs as f64)))
        .collect()
}

/// `bench overlay`: IOPS over time of the `config` cells (first repetition) of several runs in
/// one chart, a line per run (and per cell when a run has several), labelled as given. For
/// comparing runs that differ in a setting the matrix does not vary (lazy flush on and off).
pub fn overlay(
    runs: &[(String, std::path::PathBuf)],
    config: Config,
    title: &str,
    out: &Path,
) -> Result<usize> {
    let mut series = Vec::new();
    for (label, dir) in runs {
        let res = Results::load(&dir.join("results.json"))?;
        let cells: Vec<&CellResult> = res
            .cells
            .iter()
            .filter(|c| c.ok() && c.cell.config == config && c.cell.rep == 0)
            .collect();
        if cells.is_empty() {
            anyhow::bail!(
                "{}: no measured {} cell in {}",
                label,
                config.name(),
                dir.display()
            );
        }
        for c in &cells {
            let label = if cells.len() > 1 {
                format!("{label} {}", c.key)
            } else {
                label.clone()
            };
            series.push(Series {
                label,
                points: iops_series(c),
            });
        }
    }
    line_chart(
        out,
        &LineChart {
            title,
            x_label: "time (s)",
            y_label: "IOPS",
            series: &series,
            log_x: false,
            log_y: false,
        },
    )?;
    Ok(series.len())
}

/// The tables for one pattern, in Markdown (also what the console shows).
pub fn tables(res: &Results, pattern: Pattern, full: bool) -> String {
    let mut s = String::new();
    let configs = configs_present(res);
    let corner = "bs \\ nj/qd";
    let metrics: Vec<(&str, Metric)> = if full {
        vec![
            ("IOPS", iops as Metric),
            ("MB/s", mb_s),
            ("mean latency, ms", lat_mean_ms),
            ("p99 latency, ms", lat_p99_ms),
            ("p99.99 latency, ms", lat_p9999_ms),
        ]
    } else {
        vec![("IOPS", iops as Metric), ("p99 latency, ms", lat_p99_ms)]
    };
    for (what, metric) in metrics {
        for &config in &configs {
            let _ = writeln!(s, "**{pattern}, {what}: {}**\n", config.name());
            s.push_str(&markdown(&grid(res, config, pattern, metric), corner, ""));
            s.push('\n');
        }
    }
    if configs.contains(&Config::Core) {
        let core = grid(res, Config::Core, pattern, iops);
        for other in [Config::Cache, Config::Nbdkit] {
            if configs.contains(&other) {
                let _ = writeln!(
                    s,
                    "**{pattern}, IOPS ratio {} / core (no cache)**\n",
                    other.name()
                );
                s.push_str(&markdown(
                    &ratio(&grid(res, other, pattern, iops), &core),
                    corner,
                    "x",
                ));
                s.push('\n');
            }
        }
    }
    s
}

fn pct(part: u64, whole: u64) -> String {
    if whole == 0 {
        "-".into()
    } else {
        format!("{:.1}", part as f64 * 100.0 / whole as f64)
    }
}

/// The whole report.md.
pub fn markdown_report(res: &Results, chart_files: &[String]) -> String {
    let m = &res.matrix;
    let mut s = String::from("# hybridcache bench report\n\n");
    let _ = writeln!(s, "- command: `{}`", res.command.join(" "));
    let _ = writeln!(
        s,
        "- protocol: **{}**; runtime {} s per cell; region {} at offset {}; repeat {}",
        m.protocol.name.name(),
        m.runtime,
        size_label(m.size),
        size_label(m.offset),
        m.repeat
    );
    let _ = writeln!(
        s,
        "- core: `{}` exported bare by `hybridcache serve` ({} workers per connection)",
        m.core_device, m.core_workers
    );
    if m.configs.contains(&Config::Cache) {
        let c = &m.cache;
        let _ = writeln!(
            s,
            "- cache: `{}`, mode {}, {} KiB lines, cleaning {}, daemon NBD workers {}, core {}",
            c.device,
            c.mode,
            c.line_size_kib,
            c.cleaning.as_deref().unwrap_or("(daemon default)"),
            c.nbd_workers,
            match c.core_path {
                CorePath::Direct => "opened by the daemon (direct)",
                CorePath::Nbd => "through the bare export over NBD",
            }
        );
    }
    if m.configs.contains(&Config::Nbdkit) {
        let n = &m.nbdkit;
        let _ = writeln!(
            s,
            "- nbdkit-cache: `nbdkit --filter=cache nbd` cache={} min block {} max size {} in {}",
            n.mode,
            size_label(n.min_block_size),
            n.max_size
                .map(size_label)
                .unwrap_or_else(|| "unbounded".into()),
            n.cache_dir
        );
    }
    let v = &res.versions;
    let _ = writeln!(
        s,
        "- versions: hybridcache {}, {}, {}",
        v.hybridcache, v.fio, v.nbdkit
    );
    let mc = &res.machine;
    let _ = writeln!(
        s,
        "- machine: {} ({} cores), {}, {:.1} GiB RAM",
        mc.cpu,
        mc.cores,
        mc.kernel,
        mc.memory_bytes as f64 / (1u64 << 30) as f64
    );
    let done = res.cells.iter().filter(|c| c.ok()).count();
    let _ = writeln!(
        s,
        "- cells: {done} measured{}\n",
        if res.complete {
            String::new()
        } else {
            " (incomplete run: resume with --resume)".into()
        }
    );
    s.push_str(
        "Tables: rows are block sizes, columns numjobs/iodepth (fio). Latency is fio's completion \
         latency of writes (of reads for read-only patterns).\n\n",
    );
    for &pattern in &m.patterns {
        let _ = writeln!(s, "## {pattern}\n");
        s.push_str(&tables(res, pattern, true));
        for f in chart_files
            .iter()
            .filter(|f| f.contains(&format!("-{pattern}-")))
        {
            let _ = writeln!(s, "![{f}]({f})\n");
        }
    }

    // Cache statistics per cell.
    let stat_cells: Vec<_> = res
        .cells
        .iter()
        .filter(|c| c.ok() && c.cell.config == Config::Cache)
        .collect();
    if !stat_cells.is_empty() {
        s.push_str("## Cache statistics (measured phase)\n\n");
        s.push_str("| cell | dirty % before | dirty % after | occupancy % after | read hits % | write hits % | pass-through reads | pass-through writes |\n|---|---:|---:|---:|---:|---:|---:|---:|\n");
        for c in stat_cells {
            let Some(o) = &c.outcome else { continue };
            let (Some(b), Some(a)) = (&o.stats_before, &o.stats_after) else {
                continue;
            };
            let rh = a.read_hits.saturating_sub(b.read_hits);
            let rt = rh
                + a.read_partial_misses.saturating_sub(b.read_partial_misses)
                + a.read_full_misses.saturating_sub(b.read_full_misses);
            let wh = a.write_hits.saturating_sub(b.write_hits);
            let wt = wh
                + a.write_partial_misses
                    .saturating_sub(b.write_partial_misses)
                + a.write_full_misses.saturating_sub(b.write_full_misses);
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                c.key,
                pct(b.dirty_lines, b.total_lines),
                pct(a.dirty_lines, a.total_lines),
                pct(a.occupancy_lines, a.total_lines),
                pct(rh, rt),
                pct(wh, wt),
                a.pass_through_reads.saturating_sub(b.pass_through_reads),
                a.pass_through_writes.saturating_sub(b.pass_through_writes),
            );
        }
        s.push('\n');
    }

    // The steady state over the measured phase, from the per-second samples.
    let mut over_time = String::new();
    for c in res
        .cells
        .iter()
        .filter(|c| c.ok() && c.cell.config == Config::Cache)
    {
        let Some(o) = &c.outcome else { continue };
        let range = |f: fn(&Sample) -> Option<f64>| {
            let v: Vec<f64> = o.series.iter().filter_map(f).collect();
            let min = v.iter().copied().fold(f64::INFINITY, f64::min);
            let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let mean = v.iter().sum::<f64>() / v.len().max(1) as f64;
            (!v.is_empty()).then_some((min, mean, max))
        };
        let span = |r: Option<(f64, f64, f64)>| {
            r.map(|(a, _, b)| format!("{a:.1}-{b:.1}"))
                .unwrap_or_else(|| "-".into())
        };
        let cleaned = range(|s| s.cleaned_lines_s);
        if cleaned.is_none() && range(|s| s.free_pct).is_none() {
            continue;
        }
        let _ = writeln!(
            over_time,
            "| {} | {} | {} | {} | {} | {} |",
            c.key,
            span(range(|s| s.dirty_pct)),
            span(range(|s| s.clean_pct)),
            span(range(|s| s.free_pct)),
            cleaned
                .map(|(_, m, _)| fmt_value(m))
                .unwrap_or_else(|| "-".into()),
            cleaned
                .map(|(a, _, b)| format!("{}-{}", fmt_value(a), fmt_value(b)))
                .unwrap_or_else(|| "-".into()),
        );
    }
    if !over_time.is_empty() {
        s.push_str("## Steady state over the measured phase (per-second samples)\n\n");
        s.push_str("| cell | dirty % min-max | clean % min-max | free % min-max | cleaned lines/s mean | cleaned lines/s min-max |\n|---|---:|---:|---:|---:|---:|\n");
        s.push_str(&over_time);
        s.push('\n');
    }

    let flushes: Vec<_> = res
        .cells
        .iter()
        .filter_map(|c| Some((c, c.outcome.as_ref()?.flush.as_ref()?)))
        .collect();
    if !flushes.is_empty() {
        s.push_str("## Flush\n\n| cell | via | dirty MiB | seconds | MB/s | complete |\n|---|---|---:|---:|---:|---|\n");
        for (c, f) in flushes {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {:.2} | {} | {} |",
                c.key,
                f.via,
                f.dirty_bytes
                    .map(|b| format!("{:.1}", b as f64 / (1u64 << 20) as f64))
                    .unwrap_or_else(|| "-".into()),
                f.seconds,
                f.mb_s.map(fmt_value).unwrap_or_else(|| "-".into()),
                if f.complete { "yes" } else { "no" }
            );
        }
        s.push('\n');
    }

    let mut notes = String::new();
    for c in &res.cells {
        if let Some(e) = &c.error {
            let _ = writeln!(notes, "- {} failed: {e}", c.key);
        }
        if let Some(o) = &c.outcome {
            for n in &o.notes {
                let _ = writeln!(notes, "- {}: {n}", c.key);
            }
        }
    }
    if !notes.is_empty() {
        s.push_str("## Notes\n\n");
        s.push_str(&notes);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_ratio() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![1.0, 2.0]), Some(1.5));
        assert_eq!(median(vec![]), None);
        let a = Grid {
            columns: vec!["1/1".into()],
            rows: vec![("4K".into(), vec![Some(100.0)])],
        };
        let b = Grid {
            columns: vec!["1/1".into()],
            rows: vec![("4K".into(), vec![Some(50.0)])],
        };
        let r = ratio(&a, &b);
        assert_eq!(r.rows[0].1[0], Some(2.0));
        let md = markdown(&r, "bs", "x");
        assert!(md.contains("| 4K | 2.00x |"), "{md}");
        assert!(md.starts_with("| bs | 1/1 |"));
    }
}

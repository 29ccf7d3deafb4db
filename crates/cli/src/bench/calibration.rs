//! `hybridcache bench calibration`: the emulated RAID 60 (`raid:preset=study60`) next to the
//! study's no-cache baselines (domain.md §10, every table: random writes, sequential writes,
//! mixed reads and writes), in the study's layout (rows: what, columns: iodepth 1/4/8/16/32;
//! each cell "ours (study) ours/study"), then the worst cell.
//!
//! Two ways to get "ours", and the output always says which:
//! - `sim` (default, seconds): the volume crate's closed-loop simulation on virtual time
//!   (`calibration_cells`), the same numbers `cargo test -p hybridcache-volume calibration`
//!   prints: the model alone, no fio, no NBD.
//! - `fio` (minutes: `ramp + runtime` × 37 jobs): for real, fio's nbd engine against a fresh
//!   `hybridcache serve` per job exporting `raid:preset=study60,...,nodata`, time really
//!   elapsing in the model. This
//!   adds the NBD transport and the server's workers, so very high rates (the multi-GB/s
//!   full-stripe cells) are capped by the transport on small machines.
//!
//! The full-stripe cells (a stripe's worth of writes in flight, 512 KiB) are where a transport
//! shows: the array writes a stripe only once all of its writes have arrived, so each stripe
//! waits for the round trip of all of them, which on a small machine costs more than the
//! stripe's own write. For those cells the fio method also prints what the model gives with
//! fio behind a transport like this machine's NBD (`Transport::nbd_here`), and `--check` holds
//! them to that instead of the study.
//!
//! The study's numbers are taken from the volume crate (`STUDY_*`), never copied here.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, ValueEnum};
use hybridcache_volume::{
    measured, parse_size, simulate_study_job_through, study_cells as volume_study_cells,
    EmulConfig, Measure, Pattern as SimPattern, RaidConfig, StudyJob, Transport, STUDY_DEPTHS,
    STUDY_SPAN,
};
use serde::Serialize;

use super::fio::{FioJob, FioResult};
use super::matrix::Pattern;
use super::procs;
use super::rig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// In-process simulation on virtual time (seconds).
    Sim,
    /// fio through NBD against `hybridcache serve` (about runtime × 37 jobs).
    Fio,
    /// Both, side by side.
    Both,
}

#[derive(Debug, Clone, Args)]
pub struct CalibrationArgs {
    /// sim: the model in virtual time, in-process; fio: fio through NBD and `serve`; both.
    #[arg(long, value_enum, default_value = "sim")]
    pub method: Method,
    /// fio: seconds per job (a mixed job gives two cells).
    #[arg(long, default_value_t = 5, value_name = "S")]
    pub runtime: u64,
    /// fio: seconds of each job run before measuring (fio's ramp_time): the start of a stream
    /// through NBD (the server still learning the device is slow) is not its steady state.
    #[arg(long, default_value_t = 1, value_name = "S")]
    pub ramp: u64,
    /// Size of each emulated disk (the array holds 32 of them worth of data).
    #[arg(long, default_value = "4T", value_name = "SIZE")]
    pub disk_size: String,
    /// sim: measured requests per random job (4x for sequential jobs).
    #[arg(long, default_value_t = 300, value_name = "N")]
    pub requests: u64,
    /// sim: put fio behind a transport like NBD on a small machine (a reply and the next
    /// request 80-180 µs apart, requests reaching the server one at a time), to see what the
    /// fio method should give here.
    #[arg(long)]
    pub transport: bool,
    /// Only the random 4 KiB write row (5 cells): a quick check.
    #[arg(long, conflicts_with = "quick")]
    pub random_only: bool,
    /// A few cells of every table (10 jobs, 16 cells): the ends of the random row, sequential
    /// writes below the full-stripe jump (the cells above it are capped by NBD on small
    /// machines, docs/devices.md), mixed 50/50 at depth 1, 8 and 32, every mix at depth 32.
    #[arg(long)]
    pub quick: bool,
    /// Exit with an error when a measured cell is further than FACTOR from the study
    /// (ours/study outside 1/FACTOR..FACTOR), after printing the table; a full-stripe cell
    /// measured through fio, from the model behind NBD's transport instead.
    #[arg(long, value_name = "FACTOR")]
    pub check: Option<f64>,
    /// Also write calibration.json and calibration.md here.
    #[arg(long, short = 'o', value_name = "DIR")]
    pub out: Option<PathBuf>,
}

/// One cell: what, iodepth, study's figure, ours by simulation and by fio.
#[derive(Debug, Clone, Serialize)]
pub struct CalCell {
    pub row: String,
    pub unit: &'static str,
    pub iodepth: u32,
    pub study: f64,
    pub sim: Option<f64>,
    pub fio: Option<f64>,
    /// A full-stripe cell measured through fio: the model's figure with fio behind a transport
    /// like NBD's here, which bounds it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub behind_transport: Option<f64>,
    #[serde(skip)]
    job: StudyJob,
    #[serde(skip)]
    measure: Measure,
}

/// The cells of the `--quick` selection: (row, depth).
const QUICK: [(&str, u32); 18] = [
    ("randwrite 4K", 1),
    ("randwrite 4K", 32),
    ("write 4K", 1),
    ("write 8K", 4),
    ("write 8K", 32),
    ("write 16K", 16),
    ("write 16K", 32),
    ("write 64K", 16),
    ("randrw 50/50 4K read", 1),
    ("randrw 50/50 4K write", 1),
    ("randrw 50/50 4K read", 32),
    ("randrw 50/50 4K write", 32),
    ("randrw 30/70 4K read", 32),
    ("randrw 30/70 4K write", 32),
    ("randrw 70/30 4K read", 32),
    ("randrw 70/30 4K write", 32),
    ("randrw 50/50 4K read", 8),
    ("randrw 50/50 4K write", 8),
];

/// The cells in the study's order (the volume crate's `study_cells`): the random row,
/// sequential writes by block size, mixed 50/50 by depth, the other mixes at depth 32.
fn study_cells(random_only: bool, quick: bool) -> Vec<CalCell> {
    volume_study_cells()
        .into_iter()
        .filter(|c| !random_only || c.row == "randwrite 4K")
        .filter(|c| !quick || QUICK.contains(&(c.row.as_str(), c.job.iodepth)))
        .map(|c| CalCell {
            unit: c.measure.unit(),
            iodepth: c.job.iodepth,
            study: c.study,
            sim: None,
            fio: None,
            behind_transport: None,
            row: c.row,
            job: c.job,
            measure: c.measure,
        })
        .collect()
}

/// Run each distinct job once (a mixed job's two cells are neighbours) and fill its cells.
fn fill<R: Clone>(
    cells: &mut [CalCell],
    mut run: impl FnMut(usize, &CalCell) -> Result<R>,
    mut put: impl FnMut(&mut CalCell, R),
) -> Result<()> {
    let mut last: Option<(StudyJob, R)> = None;
    for (i, c) in cells.iter_mut().enumerate() {
        let r = match last {
            Some((j, r)) if j == c.job => r,
            _ => run(i, c)?,
        };
        last = Some((c.job, r.clone()));
        put(c, r);
    }
    Ok(())
}

fn ratio(ours: f64, study: f64) -> f64 {
    ours / study
}

/// How far off a ratio is, as a factor of at least 1.
fn off(ratio: f64) -> f64 {
    if ratio >= 1.0 {
        ratio
    } else if ratio > 0.0 {
        1.0 / ratio
    } else {
        f64::INFINITY
    }
}

fn within(ours: f64, study: f64) -> bool {
    off(ratio(ours, study)) <= 1.5
}

/// Whether a cell keeps a whole stripe (512 KiB of data) or more of writes in flight: the cells
/// above the study's jump, where a transport's round trip per stripe bounds fio through NBD.
fn full_stripe(job: &StudyJob) -> bool {
    job.pattern == SimPattern::Sequential && job.block_size * u64::from(job.iodepth) >= 512 << 10
}

/// The section of the fio method on the full-stripe cells: fio's figure against the model's
/// with fio behind the transport.
fn transport_section(cells: &[CalCell]) -> String {
    let mut s = String::from(
        "Full-stripe cells through NBD, against the model with fio behind a transport like NBD's \
         here (`--method sim --transport`): a stripe is written once all its writes have arrived, \
         so each stripe also waits for their round trip through the transport.\n\n\
         | cell | unit | fio | model behind the transport | fio / model | study |\n\
         |---|---|---:|---:|---:|---:|\n",
    );
    for c in cells {
        if let (Some(v), Some(t)) = (c.fio, c.behind_transport) {
            let _ = writeln!(
                s,
                "| {} qd{} | {} | {} | {} | {:.2} | {} |",
                c.row,
                c.iodepth,
                c.unit,
                fmt(v),
                fmt(t),
                v / t,
                fmt(c.study)
            );
        }
    }
    s
}

fn fmt(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// The measured cell furthest from the study: (cell, ours).
fn worst(cells: &[CalCell], pick: fn(&CalCell) -> Option<f64>) -> Option<(&CalCell, f64)> {
    cells
        .iter()
        .filter_map(|c| Some((c, pick(c)?)))
        .max_by(|a, b| off(ratio(a.1, a.0.study)).total_cmp(&off(ratio(b.1, b.0.study))))
}

/// The study-layout table for one method: each cell "ours (study) ratio", ratio = ours/study;
/// `*` marks cells off by more than 1.5x. Then the count within 1.5x and the worst cell.
pub fn table(cells: &[CalCell], pick: fn(&CalCell) -> Option<f64>) -> String {
    let mut s = String::from("| | unit |");
    for d in STUDY_DEPTHS {
        let _ = write!(s, " qd{d} |");
    }
    s.push_str("\n|---|---|");
    s.push_str(&"---:|".repeat(STUDY_DEPTHS.len()));
    s.push('\n');
    let mut rows: Vec<&str> = Vec::new();
    for c in cells {
        if !rows.contains(&c.row.as_str()) {
            rows.push(&c.row);
        }
    }
    for row in rows {
        let mut line = String::new();
        let mut unit = "";
        for d in STUDY_DEPTHS {
            let Some(c) = cells.iter().find(|c| c.row == row && c.iodepth == d) else {
                line.push_str(" |");
                continue;
            };
            unit = c.unit;
            match pick(c) {
                Some(v) => {
                    let mark = if within(v, c.study) { "" } else { " *" };
                    let _ = write!(
                        line,
                        " {} ({}) {:.2}{mark} |",
                        fmt(v),
                        fmt(c.study),
                        ratio(v, c.study)
                    );
                }
                None => line.push_str(" - |"),
            }
        }
        let _ = writeln!(s, "| {row} | {unit} |{line}");
    }
    let measured: Vec<_> = cells.iter().filter_map(|c| Some((pick(c)?, c))).collect();
    let ok = measured.iter().filter(|(v, c)| within(*v, c.study)).count();
    let _ = writeln!(
        s,
        "\n{ok} of {} cells within a factor of 1.5 of the study (ours (study) ours/study; * = outside).",
        measured.len()
    );
    if let Some((c, v)) = worst(cells, pick) {
        let _ = writeln!(
            s,
            "Worst cell: {} qd{}: {} {} against the study's {} (ratio {:.2}, {:.2}x off).",
            c.row,
            c.iodepth,
            fmt(v),
            c.unit,
            fmt(c.study),
            ratio(v, c.study),
            off(ratio(v, c.study))
        );
    }
    s
}

/// The fio job of a cell.
fn fio_job(c: &CalCell, uri: &str, runtime: u64, ramp: u64) -> FioJob {
    let j = c.job;
    let (pattern, what) = match (j.pattern, j.read_pct) {
        (SimPattern::Sequential, _) => (Pattern::Write, "write".to_string()),
        (SimPattern::Random, 0) => (Pattern::RandWrite, "randwrite".to_string()),
        (SimPattern::Random, p) => (Pattern::RandRw(p as u8), format!("randrw{p}")),
    };
    FioJob {
        name: format!("cal-{what}-{}k-qd{}", j.block_size >> 10, j.iodepth),
        uri: uri.to_string(),
        pattern,
        bs: j.block_size,
        iodepth: j.iodepth,
        numjobs: 1,
        offset: 0,
        size: STUDY_SPAN,
        runtime: Some(runtime),
        ramp,
        io_size: None,
        distribution: None,
    }
}

fn fio_figure(r: &FioResult, m: Measure) -> f64 {
    match m {
        Measure::Iops => r.iops,
        Measure::MbPerS => r.mb_s,
        Measure::ReadIops => r.read.iops,
        Measure::WriteIops => r.write.iops,
    }
}

pub fn run(a: &CalibrationArgs) -> Result<()> {
    let disk_size = parse_size(&a.disk_size).map_err(|e| anyhow!("--disk-size: {e}"))?;
    if a.runtime == 0 {
        return Err(anyhow!("--runtime: must be at least 1 second"));
    }
    if let Some(f) = a.check {
        if f.is_nan() || f < 1.0 {
            bail!("--check: a factor of at least 1, not {f}");
        }
    }
    let mut cells = study_cells(a.random_only, a.quick);
    let mut text = String::from(
        "# Calibration: emulated RAID 60 (raid:preset=study60) vs the study (docs/devices.md)\n\n\
         4 groups of 10 disks (8 data + 2 parity), 7200 rpm, 64 KiB strip; no cache; fio numjobs 1;\n\
         a 1 TiB region (the study does not say how much of the array fio touched: an assumption).\n\n",
    );

    let cfg = EmulConfig::Raid(RaidConfig::study_raid60(disk_size));
    let n = a.requests.max(10);
    if matches!(a.method, Method::Sim | Method::Both) {
        let transport = a.transport.then(Transport::nbd_here);
        fill(
            &mut cells,
            |_, c| Ok(simulate_study_job_through(&cfg, &c.job, n, transport)),
            |c, r| c.sim = Some(measured(&r, c.measure)),
        )?;
        let how = if a.transport {
            "fio behind a transport like NBD's here"
        } else {
            "no fio, no NBD"
        };
        text.push_str(&format!(
            "## Method: in-process simulation (virtual time, {n} requests per random cell; {how})\n\n",
        ));
        text.push_str(&table(&cells, |c| c.sim));
        text.push('\n');
    }

    if matches!(a.method, Method::Fio | Method::Both) {
        if !procs::have("fio") {
            return Err(anyhow!(
                "--method fio needs fio (Debian: apt-get install fio)"
            ));
        }
        procs::install_interrupt_handler();
        let dir = match &a.out {
            Some(d) => d.join("calibration-fio"),
            None => std::env::temp_dir().join(format!("hybridcache-cal-{}", std::process::id())),
        };
        std::fs::create_dir_all(&dir)
            .with_context(|| format!("cannot create {}", dir.display()))?;
        let spec = format!(
            "raid:preset=study60,disk_size={},nodata",
            a.disk_size.trim()
        );
        let bin = procs::our_binary()?;
        // Sockets in a short private directory (Unix socket paths are limited to 107 bytes).
        let run_dir =
            std::env::temp_dir().join(format!("hybridcache-calrun-{}", std::process::id()));
        std::fs::create_dir_all(&run_dir)?;
        let jobs = {
            let mut n = 0;
            let mut last = None;
            for c in &cells {
                if last != Some(c.job) {
                    n += 1;
                }
                last = Some(c.job);
            }
            n
        };
        let mut done = 0;
        let res = fill(
            &mut cells,
            |_, c| {
                done += 1;
                eprint!("\r[{done}/{jobs}] {} qd{}        ", c.row, c.iodepth);
                // A fresh array per job, as the simulation has: a job must not inherit the
                // heads, queues and dirty stripe cache of the one before.
                let (mut serve, socket) = rig::start_serve(&bin, &spec, 64, &run_dir, &dir)?;
                let job = fio_job(c, &rig::core_uri(&socket), a.runtime, a.ramp);
                let r = rig::run_fio(&job, &dir);
                serve.stop();
                r
            },
            |c, r| c.fio = Some(fio_figure(&r, c.measure)),
        );
        eprintln!();
        let _ = std::fs::remove_dir_all(&run_dir);
        res?;
        text.push_str(&format!(
            "## Method: fio through NBD ({}, {} s per job after {} s of ramp, a fresh server per job) against `hybridcache serve --core {spec}`\n\n",
            procs::tool_version("fio"),
            a.runtime,
            a.ramp
        ));
        text.push_str(&table(&cells, |c| c.fio));
        text.push('\n');
        for c in cells
            .iter_mut()
            .filter(|c| c.fio.is_some() && full_stripe(&c.job))
        {
            let r = simulate_study_job_through(&cfg, &c.job, n, Some(Transport::nbd_here()));
            c.behind_transport = Some(measured(&r, c.measure));
        }
        if cells.iter().any(|c| c.behind_transport.is_some()) {
            text.push_str(&transport_section(&cells));
            text.push('\n');
        }
    }

    print!("{text}");
    if let Some(out) = &a.out {
        std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
        let json = serde_json::json!({
            "method": a.method,
            "disk_size": disk_size,
            "runtime_s": a.runtime,
            "requests": a.requests,
            "hybridcache": env!("CARGO_PKG_VERSION"),
            "fio": procs::tool_version("fio"),
            "cells": cells,
        });
        std::fs::write(
            out.join("calibration.json"),
            serde_json::to_string_pretty(&json).context("encoding the calibration")?,
        )
        .context("cannot write calibration.json")?;
        std::fs::write(out.join("calibration.md"), &text).context("cannot write calibration.md")?;
    }
    if let Some(f) = a.check {
        // (cell, ours, what it is held to, which)
        let held = cells.iter().flat_map(|c| {
            let sim = c.sim.map(|v| (c, v, c.study, "the study"));
            let fio = c.fio.map(|v| match c.behind_transport {
                Some(t) => (c, v, t, "the model behind NBD's transport"),
                None => (c, v, c.study, "the study"),
            });
            [sim, fio].into_iter().flatten()
        });
        let bad: Vec<String> = held
            .filter(|(_, v, to, _)| off(ratio(*v, *to)) > f)
            .map(|(c, v, to, what)| {
                format!(
                    "{} qd{}: {} against {} ({what})",
                    c.row,
                    c.iodepth,
                    fmt(v),
                    fmt(to)
                )
            })
            .collect();
        if !bad.is_empty() {
            bail!(
                "{} cell(s) further than {f}x from the study: {}",
                bad.len(),
                bad.join("; ")
            );
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hybridcache_volume::calibration_cells;

    #[test]
    fn cells_follow_the_study_and_the_simulation_order() {
        let cells = study_cells(false, false);
        assert_eq!(cells.len(), 44);
        assert_eq!(cells[0].study, 63.0);
        assert_eq!(cells[5].row, "write 4K");
        assert_eq!(cells[29].job.block_size, 64 << 10);
        assert_eq!(cells[30].row, "randrw 50/50 4K read");
        assert_eq!(cells[43].row, "randrw 70/30 4K write");
        assert_eq!(cells[43].study, 399.0);
        // The simulation lists its cells in the same order, with the same study figures.
        let sim = calibration_cells(&EmulConfig::Raid(RaidConfig::study_raid60(4 << 40)), 20);
        assert_eq!(sim.len(), cells.len());
        for (c, (_, _, study)) in cells.iter().zip(&sim) {
            assert_eq!(c.study, *study);
        }
        // The quick selection has cells of every table.
        let quick = study_cells(false, true);
        assert_eq!(quick.len(), QUICK.len());
        assert_eq!(quick.iter().filter(|c| full_stripe(&c.job)).count(), 2);
        for row in [
            "randwrite",
            "write 4K",
            "write 16K",
            "randrw 50/50",
            "randrw 30/70",
            "randrw 70/30",
        ] {
            assert!(quick.iter().any(|c| c.row.starts_with(row)), "{row}");
        }
    }

    #[test]
    fn table_marks_cells_off_by_more_than_one_and_a_half() {
        let mut cells = study_cells(true, false);
        for c in cells.iter_mut() {
            c.sim = Some(c.study);
        }
        cells[0].sim = Some(200.0);
        let t = table(&cells, |c| c.sim);
        assert!(
            t.contains("| randwrite 4K | IOPS | 200 (63.0) 3.17 * | 201 (201) 1.00 |"),
            "{t}"
        );
        assert!(t.contains("4 of 5 cells"), "{t}");
        assert!(t.contains("Worst cell: randwrite 4K qd1: 200 IOPS"), "{t}");
    }

    #[test]
    fn mixed_rows_place_cells_by_depth() {
        let mut cells = study_cells(false, false);
        for c in cells.iter_mut() {
            c.sim = Some(c.study);
        }
        let t = table(&cells, |c| c.sim);
        assert!(
            t.contains("| randrw 70/30 4K read | IOPS | | | | | 930 (930) 1.00 |"),
            "{t}"
        );
    }
}

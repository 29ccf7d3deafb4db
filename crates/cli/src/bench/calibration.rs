//! `hybridcache bench calibration`: the emulated RAID 60 (`raid:preset=study60`) next to the
//! study's no-cache baselines (domain.md §10), in the study's layout (rows: what, columns:
//! iodepth 1/4/8/16/32; each cell "ours (study)").
//!
//! Two ways to get "ours", and the output always says which:
//! - `sim` (default, seconds): the volume crate's closed-loop simulation on virtual time
//!   (`calibration_cells`), the same numbers `cargo test -p hybridcache-volume calibration`
//!   prints: the model alone, no fio, no NBD.
//! - `fio` (minutes: `runtime` × 30 cells): for real, fio's nbd engine against `hybridcache
//!   serve` exporting `raid:preset=study60,...,nodata`, time really elapsing in the model. This
//!   adds the NBD transport and the server's workers, so very high rates (the multi-GB/s
//!   full-stripe cells) are capped by the transport on small machines.
//!
//! The study's numbers are taken from the volume crate (`STUDY_*`), never copied here.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{anyhow, Context, Result};
use clap::{Args, ValueEnum};
use hybridcache_volume::{
    calibration_cells, parse_size, EmulConfig, RaidConfig, STUDY_DEPTHS, STUDY_RANDOM_WRITE_IOPS,
    STUDY_SEQ_WRITE_MBS, STUDY_SPAN,
};
use serde::Serialize;

use super::fio::FioJob;
use super::matrix::Pattern;
use super::procs;
use super::rig;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Method {
    /// In-process simulation on virtual time (seconds).
    Sim,
    /// fio through NBD against `hybridcache serve` (about runtime × 30 cells).
    Fio,
    /// Both, side by side.
    Both,
}

#[derive(Debug, Clone, Args)]
pub struct CalibrationArgs {
    /// sim: the model in virtual time, in-process; fio: fio through NBD and `serve`; both.
    #[arg(long, value_enum, default_value = "sim")]
    pub method: Method,
    /// fio: seconds per cell.
    #[arg(long, default_value_t = 5, value_name = "S")]
    pub runtime: u64,
    /// Size of each emulated disk (the array holds 32 of them worth of data).
    #[arg(long, default_value = "4T", value_name = "SIZE")]
    pub disk_size: String,
    /// sim: measured requests per random cell (4x for sequential cells).
    #[arg(long, default_value_t = 300, value_name = "N")]
    pub requests: u64,
    /// Only the random 4 KiB write row (5 cells): a quick check.
    #[arg(long)]
    pub random_only: bool,
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
}

/// The cells in the study's order: the random row, then sequential writes by block size.
fn study_cells(random_only: bool) -> Vec<CalCell> {
    let mut out = Vec::new();
    for (i, &d) in STUDY_DEPTHS.iter().enumerate() {
        out.push(CalCell {
            row: "randwrite 4K".into(),
            unit: "IOPS",
            iodepth: d,
            study: STUDY_RANDOM_WRITE_IOPS[i],
            sim: None,
            fio: None,
        });
    }
    if !random_only {
        for (bs, row) in STUDY_SEQ_WRITE_MBS {
            for (i, &d) in STUDY_DEPTHS.iter().enumerate() {
                out.push(CalCell {
                    row: format!("write {}K", bs >> 10),
                    unit: "MB/s",
                    iodepth: d,
                    study: row[i],
                    sim: None,
                    fio: None,
                });
            }
        }
    }
    out
}

fn block_size(row: &str) -> u64 {
    row.rsplit(' ')
        .next()
        .and_then(|k| k.trim_end_matches('K').parse::<u64>().ok())
        .unwrap_or(4)
        << 10
}

fn within(ours: f64, study: f64) -> bool {
    (1.0 / 1.5..=1.5).contains(&(ours / study))
}

fn fmt(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.1}")
    }
}

/// The study-layout table for one method; `*` marks cells off by more than 1.5x.
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
        for c in cells.iter().filter(|c| c.row == row) {
            unit = c.unit;
            match pick(c) {
                Some(v) => {
                    let mark = if within(v, c.study) { "" } else { " *" };
                    let _ = write!(line, " {} ({}){mark} |", fmt(v), fmt(c.study));
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
        "\n{ok} of {} cells within a factor of 1.5 of the study (ours (study); * = outside).",
        measured.len()
    );
    s
}

pub fn run(a: &CalibrationArgs) -> Result<()> {
    let disk_size = parse_size(&a.disk_size).map_err(|e| anyhow!("--disk-size: {e}"))?;
    if a.runtime == 0 {
        return Err(anyhow!("--runtime: must be at least 1 second"));
    }
    let mut cells = study_cells(a.random_only);
    let mut text = String::from(
        "# Calibration: emulated RAID 60 (raid:preset=study60) vs the study (domain.md §10)\n\n\
         4 groups of 10 disks (8 data + 2 parity), 7200 rpm, 64 KiB strip; no cache; fio numjobs 1;\n\
         a 1 TiB region (the study does not say how much of the array fio touched: an assumption).\n\n",
    );

    if matches!(a.method, Method::Sim | Method::Both) {
        let cfg = EmulConfig::Raid(RaidConfig::study_raid60(disk_size));
        let sim = calibration_cells(&cfg, a.requests.max(10));
        // Same order as study_cells (random row first, then sequential rows).
        for (c, (_, model, _)) in cells.iter_mut().zip(sim) {
            c.sim = Some(model);
        }
        text.push_str(&format!(
            "## Method: in-process simulation (virtual time, {} requests per random cell; no fio, no NBD)\n\n",
            a.requests.max(10)
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
        let (mut serve, socket) = rig::start_serve(&bin, &spec, 64, &run_dir, &dir)?;
        let uri = rig::core_uri(&socket);
        let total = cells.len();
        let res = (|| -> Result<()> {
            for (i, c) in cells.iter_mut().enumerate() {
                let bs = block_size(&c.row);
                let random = c.row.starts_with("randwrite");
                let job = FioJob {
                    name: format!(
                        "cal-{}-{}k-qd{}",
                        if random { "randwrite" } else { "write" },
                        bs >> 10,
                        c.iodepth
                    ),
                    uri: uri.clone(),
                    pattern: if random {
                        Pattern::RandWrite
                    } else {
                        Pattern::Write
                    },
                    bs,
                    iodepth: c.iodepth,
                    numjobs: 1,
                    offset: 0,
                    size: STUDY_SPAN,
                    runtime: Some(a.runtime),
                    ramp: 0,
                    io_size: None,
                    distribution: None,
                };
                eprint!("\r[{}/{total}] {} qd{}        ", i + 1, c.row, c.iodepth);
                let r = rig::run_fio(&job, &dir)?;
                c.fio = Some(if random { r.iops } else { r.mb_s });
            }
            eprintln!();
            Ok(())
        })();
        serve.stop();
        let _ = std::fs::remove_dir_all(&run_dir);
        res?;
        text.push_str(&format!(
            "## Method: fio through NBD ({}, {} s per cell) against `hybridcache serve --core {spec}`\n\n",
            procs::tool_version("fio"),
            a.runtime
        ));
        text.push_str(&table(&cells, |c| c.fio));
        text.push('\n');
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
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cells_follow_the_study_and_the_simulation_order() {
        let cells = study_cells(false);
        assert_eq!(cells.len(), 30);
        assert_eq!(cells[0].study, 63.0);
        assert_eq!(cells[5].row, "write 4K");
        assert_eq!(block_size(&cells[29].row), 64 << 10);
        // The simulation lists its cells in the same order, with the same study figures.
        let sim = calibration_cells(&EmulConfig::Raid(RaidConfig::study_raid60(4 << 40)), 20);
        for (c, (_, _, study)) in cells.iter().zip(&sim) {
            assert_eq!(c.study, *study);
        }
    }

    #[test]
    fn table_marks_cells_off_by_more_than_one_and_a_half() {
        let mut cells = study_cells(true);
        for c in cells.iter_mut() {
            c.sim = Some(c.study);
        }
        cells[0].sim = Some(200.0);
        let t = table(&cells, |c| c.sim);
        assert!(
            t.contains("| randwrite 4K | IOPS | 200 (63.0) * | 201 (201) |"),
            "{t}"
        );
        assert!(t.contains("4 of 5 cells"), "{t}");
    }
}

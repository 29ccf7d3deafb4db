//! `hybridcache bench run`: the matrix loop, with progress, interruption and resume.
//!
//! results.json is rewritten (atomically) after every cell, so an interrupted matrix keeps
//! everything measured so far; `--resume` reads it back, checks that the matrix is the same
//! (mixing figures of two configurations in one table would be wrong), skips the cells already
//! measured and retries the ones that failed. Ctrl-C (or SIGTERM) stops the running fio (which
//! still writes its JSON), tears the setup down, saves, writes the report of what is there and
//! exits with 130.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressStyle};

use super::matrix::{self, Cell, Config, MatrixFile, Overrides};
use super::procs;
use super::protocol;
use super::report::{self, CellResult, Machine, Results, Versions};
use super::rig::{self, Rig};
use super::{RunArgs, UsageError};

pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A directory for sockets: Unix socket paths are limited to 107 bytes, and an output directory
/// deep in a tree would exceed that, so long paths fall back to a private directory in /tmp.
/// Returns the directory and whether it is such a private one (removed at the end).
fn run_dir(out: &Path) -> Result<(PathBuf, bool)> {
    let preferred = out.join("run");
    let (dir, private) = if preferred.as_os_str().len() + "/control.sock".len() < 100 {
        (preferred, false)
    } else {
        let d = std::env::temp_dir().join(format!("hybridcache-bench-{}", std::process::id()));
        (d, true)
    };
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    Ok((dir, private))
}

fn overrides(a: &RunArgs) -> Overrides {
    Overrides {
        patterns: a.pattern.clone(),
        block_sizes: a.bs.clone(),
        iodepths: a.iodepth.clone(),
        numjobs: a.numjobs.clone(),
        runtime: a.runtime,
        size: a.size.clone(),
        offset: a.offset.clone(),
        configs: a.configs.clone(),
        repeat: a.repeat,
        core: a.core.clone(),
        core_workers: a.core_workers,
        cache: a.cache.clone(),
        cache_mode: a.cache_mode.clone(),
        line_size: a.line_size,
        cleaning: a.cleaning.clone(),
        lazy_flush: a.lazy_flush,
        core_path: a.core_path,
        protocol: a.protocol,
        settle: a.settle,
        nbdkit_max_size: a.nbdkit_max_size.clone(),
    }
}

fn summary(c: &CellResult) -> String {
    match (&c.outcome, &c.error) {
        (Some(o), _) => {
            let d = o.fio.main_dir();
            let mut s = format!(
                "{:<40} {:>10.0} IOPS {:>9.1} MB/s  mean {:.3} ms  p99 {:.3} ms  p99.99 {:.3} ms",
                c.key,
                o.fio.iops,
                o.fio.mb_s,
                d.lat_mean_us / 1000.0,
                d.lat_p99_us / 1000.0,
                d.lat_p9999_us / 1000.0
            );
            if let Some(a) = &o.stats_after {
                s.push_str(&format!(
                    "  dirty {:.0}%",
                    a.dirty_lines as f64 * 100.0 / a.total_lines.max(1) as f64
                ));
            }
            if let Some(f) = &o.flush {
                s.push_str(&format!("  flush {:.1} s", f.seconds));
            }
            s
        }
        (None, Some(e)) => format!("{:<40} FAILED: {e}", c.key),
        (None, None) => format!("{:<40} no result", c.key),
    }
}

pub fn run(a: &RunArgs) -> Result<u8> {
    let usage = |e: anyhow::Error| anyhow::Error::new(UsageError(format!("{e:#}")));
    let file = match &a.matrix {
        Some(p) => matrix::load_file(p).map_err(usage)?,
        None => MatrixFile::default(),
    };
    let m = matrix::resolve(&file, &overrides(a)).map_err(usage)?;
    let cells = m.cells();
    if a.dry_run {
        for c in &cells {
            println!("{}", c.key());
        }
        println!(
            "{} cells, at least {} s of measurement",
            cells.len(),
            cells.len() as u64 * m.runtime
        );
        return Ok(0);
    }
    if !procs::have("fio") {
        bail!("fio is not installed (Debian: apt-get install fio; 'make deps' installs it)");
    }
    if m.configs.contains(&Config::Nbdkit) && !procs::have("nbdkit") {
        bail!("the nbdkit-cache configuration needs nbdkit (Debian: apt-get install nbdkit)");
    }
    let bin = procs::our_binary()?;
    std::fs::create_dir_all(&a.out)
        .with_context(|| format!("cannot create {}", a.out.display()))?;
    let results_path = a.out.join("results.json");
    let command: Vec<String> = std::env::args().collect();
    let mut results = if results_path.exists() {
        if !a.resume {
            bail!(
                "{} already holds results.json: add --resume to continue that run, or choose another --out",
                a.out.display()
            );
        }
        let r = Results::load(&results_path)?;
        if r.matrix != m {
            bail!(
                "--resume: the matrix differs from the one in {} (resume with the same matrix file and flags, or choose another --out)",
                results_path.display()
            );
        }
        r
    } else {
        Results {
            format: report::FORMAT.into(),
            command: command.clone(),
            started_unix: now_unix(),
            updated_unix: now_unix(),
            complete: false,
            versions: Versions {
                hybridcache: env!("CARGO_PKG_VERSION").into(),
                fio: procs::tool_version("fio"),
                nbdkit: if m.configs.contains(&Config::Nbdkit) {
                    procs::tool_version("nbdkit")
                } else {
                    "not used".into()
                },
            },
            machine: Machine::probe(),
            matrix: m.clone(),
            cells: Vec::new(),
        }
    };
    // Failed cells are measured again; measured ones are kept.
    results.cells.retain(|c| c.ok());
    let done: HashSet<String> = results.cells.iter().map(|c| c.key.clone()).collect();
    let todo: Vec<&Cell> = cells.iter().filter(|c| !done.contains(&c.key())).collect();
    if !done.is_empty() {
        eprintln!(
            "resuming: {} of {} cells already measured, {} to go",
            done.len(),
            cells.len(),
            todo.len()
        );
    }

    procs::install_interrupt_handler();
    let (run_dir, private_run_dir) = run_dir(&a.out)?;
    let pb = ProgressBar::new(todo.len() as u64);
    if let Ok(style) = ProgressStyle::with_template(
        "{elapsed_precise} [{bar:30.cyan/blue}] {pos}/{len} cells, eta {eta}  {msg}",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    let mut interrupted = false;
    let mut failed = 0usize;
    for cell in todo {
        if procs::interrupted() {
            interrupted = true;
            break;
        }
        let key = cell.key();
        pb.set_message(key.clone());
        let cell_dir = a.out.join("cells").join(key.replace('/', "_"));
        let outcome = (|| {
            let mut rig = Rig::start(cell.config, &m, &bin, &run_dir, &cell_dir)?;
            let uri = rig.uri.clone();
            let o = protocol::run_cell(&mut rig, &m, cell, &uri);
            rig.stop();
            o
        })();
        let record = match outcome {
            Ok(o) => CellResult {
                key: key.clone(),
                cell: cell.clone(),
                protocol: m.protocol.name,
                status: "ok".into(),
                error: None,
                finished_unix: now_unix(),
                outcome: Some(o),
            },
            Err(e) if rig::is_interrupt(&e) || procs::interrupted() => {
                interrupted = true;
                break;
            }
            Err(e) => {
                failed += 1;
                CellResult {
                    key: key.clone(),
                    cell: cell.clone(),
                    protocol: m.protocol.name,
                    status: "failed".into(),
                    error: Some(format!("{e:#}").replace('\n', " ")),
                    finished_unix: now_unix(),
                    outcome: None,
                }
            }
        };
        // Without a terminal indicatif draws nothing, println included: logs still get the line.
        if pb.is_hidden() {
            eprintln!("{}", summary(&record));
        } else {
            pb.println(summary(&record));
        }
        results.cells.push(record);
        results.updated_unix = now_unix();
        results.save(&results_path)?;
        pb.inc(1);
    }
    pb.finish_and_clear();
    if private_run_dir {
        let _ = std::fs::remove_dir_all(&run_dir);
    }

    // Matrix order, whatever order the runs (and resumes) happened in.
    let order: Vec<String> = cells.iter().map(|c| c.key()).collect();
    results
        .cells
        .sort_by_key(|c| order.iter().position(|k| *k == c.key).unwrap_or(usize::MAX));
    let present: HashSet<&str> = results.cells.iter().map(|c| c.key.as_str()).collect();
    results.complete = !interrupted && order.iter().all(|k| present.contains(k.as_str()));
    results.updated_unix = now_unix();
    results.save(&results_path)?;

    let chart_files = report::charts(&results, &a.out)?;
    let md = report::markdown_report(&results, &chart_files);
    let md_path = a.out.join("report.md");
    std::fs::write(&md_path, md).with_context(|| format!("cannot write {}", md_path.display()))?;

    for &p in &m.patterns {
        println!("\n## {p}\n");
        print!("{}", report::tables(&results, p, false));
    }
    println!(
        "report: {}  results: {}  charts: {}",
        md_path.display(),
        results_path.display(),
        a.out.join("charts").display()
    );
    if interrupted {
        let measured = results.cells.iter().filter(|c| c.ok()).count();
        eprintln!(
            "hybridcache: interrupted after {measured} of {} cells; the same command with --resume continues",
            cells.len()
        );
        return Ok(130);
    }
    if failed > 0 {
        eprintln!(
            "hybridcache: {failed} cell(s) failed (see report.md, Notes); --resume retries them"
        );
        return Ok(1);
    }
    Ok(0)
}

//! `hybridcache trace`: the built-in block tracer.
//!
//! `trace start -i ID [-j CORE] -o FILE [--max-size SIZE]` records every request on the
//! exported volume of one core (or of every active core of the cache) to FILE in blkparse's
//! default text form, which `hybridcache analyze` (crates/analyze's blkparse parser) reads like a
//! trace taken with blktrace. `trace stop` ends it, `trace status` lists the traces.
//!
//! What is recorded: for each request the NBD server accepts, a queue event (Q) stamped when the
//! server received it, and a completion event (C) when its reply was queued, through the NBD
//! crate's request observer. Columns: `CACHE,CORE cpu seq seconds.nanoseconds conn action RWBS
//! sector + sectors [nbd/EXPORT]`; the "pid" column is the NBD connection id, so the analyzer's
//! per-job signatures are per connection. RWBS: R read, W write (also write-zeroes, as the
//! kernel traces them), D discard (trim), FN flush, N the cache hint (no data direction, ignored
//! by the analysis), with F after the direction for FUA. C events carry `[0]` in the bracket
//! (the reply's error is not reported to observers). Times count from the trace's start.
//!
//! Overhead: the observer only appends a small record to an in-memory buffer under a mutex; a
//! background thread formats and writes them every few milliseconds. If the writer falls far
//! behind (over a million buffered events) further events are dropped and counted rather than
//! letting memory grow. At `--max-size` the events stop; the trace stays listed as ended until
//! `trace stop`. Every trace file ends with a short summary block that blkparse's parser skips
//! (it starts like blkparse's own per-CPU summary), saying how and why the trace ended.
//!
//! A trace ends on `trace stop`, when the traced core is removed (a cache-wide trace keeps the
//! other cores), when its cache is stopped, or when the daemon stops.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use clap::{Args, Subcommand};

use hybridcache_daemon::protocol::{Request, TraceInfo, TraceList};
use hybridcache_daemon::trace::{size_text, target_text};

// ---- command line ---------------------------------------------------------------------------

/// Arguments of `hybridcache trace`.
#[derive(Debug, Clone, Args)]
pub struct TraceArgs {
    #[command(subcommand)]
    pub cmd: TraceCmd,
}

#[derive(Debug, Clone, Subcommand)]
pub enum TraceCmd {
    /// Record every request on a cache's exported volumes to FILE (blkparse text).
    Start {
        /// Cache id (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = crate::cli::cache_id)]
        id: u16,
        /// Trace only this core [default: every active core of the cache].
        #[arg(short = 'j', long = "core-id", value_parser = core_id)]
        core: Option<u16>,
        /// Trace file, written by the daemon (replaced if it exists).
        #[arg(short = 'o', long = "output", value_name = "FILE")]
        output: PathBuf,
        /// Stop recording when the file reaches this size: bytes, or with K/M/G/T (KiB...).
        #[arg(long = "max-size", value_parser = parse_size, value_name = "SIZE")]
        max_size: Option<u64>,
    },
    /// Stop tracing (every trace of the cache, or only the one started with -j CORE).
    Stop {
        /// Cache id (1..16384).
        #[arg(short = 'i', long = "cache-id", value_parser = crate::cli::cache_id)]
        id: u16,
        /// Stop only the trace started with this core [default: every trace of the cache].
        #[arg(short = 'j', long = "core-id", value_parser = core_id)]
        core: Option<u16>,
    },
    /// List the traces: recording, or ended and not yet stopped.
    Status {
        /// Print JSON instead of a table.
        #[arg(long)]
        json: bool,
    },
}

fn core_id(s: &str) -> Result<u16, String> {
    match s.parse::<u32>() {
        Ok(n @ 0..=4095) => Ok(n as u16),
        _ => Err(format!("'{s}' is not a core id (0..4095)")),
    }
}

/// A size: plain bytes, or a number with K, M, G or T (binary multiples, optional "iB"/"B").
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let bad = || format!("'{s}' is not a size (bytes, or a number with K, M, G or T)");
    let digits = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(digits);
    let num: f64 = num.parse().map_err(|_| bad())?;
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(bad()),
    };
    let bytes = num * (1u64 << shift) as f64;
    if !bytes.is_finite() || bytes < 1.0 || bytes > u64::MAX as f64 {
        return Err(bad());
    }
    Ok(bytes as u64)
}

/// Runs `hybridcache trace ...` against the daemon.
pub fn run_cli(args: &TraceArgs, control: &Path) -> Result<()> {
    match &args.cmd {
        TraceCmd::Start {
            id,
            core,
            output,
            max_size,
        } => {
            // The daemon opens the file, and its working directory is not ours.
            let file =
                crate::cli::from_here(output).context("cannot resolve the trace file's path")?;
            let req = Request::TraceStart {
                cache: *id,
                core: *core,
                file: file.to_string_lossy().into_owned(),
                max_size: *max_size,
            };
            let t: TraceInfo = crate::call(control, &req)?;
            println!(
                "tracing {} ({}) to {}{}",
                target_text(t.cache, t.core),
                t.exports.join(", "),
                t.file,
                t.max_size
                    .map(|m| format!(", at most {}", size_text(m)))
                    .unwrap_or_default()
            );
        }
        TraceCmd::Stop { id, core } => {
            let req = Request::TraceStop {
                cache: *id,
                core: *core,
            };
            let list: TraceList = crate::call(control, &req)?;
            for t in &list.traces {
                println!(
                    "trace of {} stopped: {} events, {} in {} ({})",
                    target_text(t.cache, t.core),
                    t.events,
                    size_text(t.bytes),
                    t.file,
                    t.state
                );
                if t.dropped > 0 {
                    println!(
                        "warning: {} events were dropped because the trace file could not be written fast enough",
                        t.dropped
                    );
                }
            }
        }
        TraceCmd::Status { json } => {
            let list: TraceList = crate::call(control, &Request::TraceStatus)?;
            if *json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&list).context("encoding the trace list")?
                );
            } else {
                print!("{}", status_table(&list));
            }
        }
    }
    Ok(())
}

fn status_table(list: &TraceList) -> String {
    if list.traces.is_empty() {
        return "no traces\n".into();
    }
    let rows: Vec<[String; 7]> = list
        .traces
        .iter()
        .map(|t| {
            [
                t.cache.to_string(),
                t.core
                    .map(|c| c.to_string())
                    .unwrap_or_else(|| "all".into()),
                t.state.clone(),
                t.events.to_string(),
                size_text(t.bytes),
                format!("{:.1}", t.seconds),
                t.file.clone(),
            ]
        })
        .collect();
    let head = [
        "cache", "core", "state", "events", "size", "seconds", "file",
    ];
    let mut w = head.map(str::len);
    for r in &rows {
        for (i, c) in r.iter().enumerate() {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    for r in std::iter::once(head.map(String::from)).chain(rows) {
        let line: Vec<String> = r
            .iter()
            .enumerate()
            .map(|(i, c)| format!("{c:<w$}", w = w[i]))
            .collect();
        let _ = writeln!(out, "{}", line.join("  ").trim_end());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("10M"), Ok(10 << 20));
        assert_eq!(parse_size("1GiB"), Ok(1 << 30));
        assert_eq!(parse_size("512k"), Ok(512 << 10));
        assert_eq!(parse_size("1.5K"), Ok(1536));
        assert!(parse_size("0").is_err());
        assert!(parse_size("ten").is_err());
        assert!(parse_size("5X").is_err());
        assert!(parse_size("").is_err());
    }
}

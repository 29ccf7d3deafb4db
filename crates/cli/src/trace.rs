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
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use hybridcache_nbd::{ExportRegistry, ObservedRequest, RequestKind, RequestObserver};
use parking_lot::{Condvar, Mutex};
use serde_json::Value;

use crate::protocol::{Request, TraceInfo, TraceList};

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
        #[arg(short = 'i', long = "cache-id", value_parser = crate::cli::cache_id)]
        id: u16,
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
        Ok(n @ 1..=4095) => Ok(n as u16),
        _ => Err(format!("'{s}' is not a core id (1..=4095)")),
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
            let file = if output.is_absolute() {
                output.clone()
            } else {
                std::env::current_dir()
                    .context("cannot resolve the trace file's path")?
                    .join(output)
            };
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

fn target_text(cache: u16, core: Option<u16>) -> String {
    match core {
        Some(j) => format!("cache {cache} core {j}"),
        None => format!("cache {cache}"),
    }
}

fn size_text(b: u64) -> String {
    hybridcache_analyze::units::bytes(b)
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

// ---- the recorder (daemon side) -----------------------------------------------------------

/// Events buffered beyond this are dropped (and counted): the writer cannot keep up, and memory
/// must not grow without bound on the data path's account. About 40 MB of records.
const MAX_PENDING: usize = 1 << 20;
/// The writer wakes at least this often, so `trace status` and the file stay current.
const WRITE_INTERVAL: Duration = Duration::from_millis(20);
/// The writer is woken early when this many events are waiting.
const WAKE_BATCH: usize = 8192;
/// Events are written in time order, as blkparse's are and as the analyzer's Q/C matching
/// needs. A queue event is stamped with its arrival but reported when the server parses it, at
/// most a request's inline run later (the NBD server hands reading over after ~0.5 ms), so
/// events are held this long before being written, and sorted.
const HOLD: Duration = Duration::from_millis(200);

/// One recorded event, as small as it can be: formatting happens on the writer thread.
#[derive(Clone, Copy)]
struct Ev {
    time_ns: u64,
    connection: u64,
    offset: u64,
    len: u32,
    /// Index of the traced export in the trace's target list.
    target: u16,
    kind: RequestKind,
    fua: bool,
    complete: bool,
}

#[derive(Default)]
struct Pending {
    events: Vec<Ev>,
    /// Set when the trace must end; the writer drains what is left and finishes the file.
    stop: Option<String>,
}

/// Shared between the observers (data path), the writer thread and the control requests.
struct Recorder {
    start: Instant,
    pending: Mutex<Pending>,
    wake: Condvar,
    /// False once the trace ended: observers still attached to old connections record nothing.
    recording: AtomicBool,
    dropped: AtomicU64,
    /// Written so far (events, bytes of event lines).
    events: AtomicU64,
    bytes: AtomicU64,
    /// Why the trace ended; None while recording.
    ended: Mutex<Option<String>>,
}

impl Recorder {
    fn record(&self, target: u16, req: &ObservedRequest, complete: bool) {
        if !self.recording.load(Ordering::Relaxed) {
            return;
        }
        let mut p = self.pending.lock();
        if p.events.len() >= MAX_PENDING {
            drop(p);
            self.dropped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        // Queue events carry their arrival time, which can precede events already buffered;
        // the writer sorts (see HOLD).
        let time_ns = req.time.saturating_duration_since(self.start).as_nanos() as u64;
        p.events.push(Ev {
            time_ns,
            connection: req.connection,
            offset: req.offset,
            len: req.len,
            target,
            kind: req.kind,
            fua: req.fua,
            complete,
        });
        if p.events.len() == WAKE_BATCH {
            self.wake.notify_one();
        }
    }
}

/// The observer attached to one traced export.
struct Tap {
    rec: Arc<Recorder>,
    target: u16,
}

impl RequestObserver for Tap {
    fn received(&self, req: &ObservedRequest) {
        self.rec.record(self.target, req, false);
    }
    fn replied(&self, req: &ObservedRequest) {
        self.rec.record(self.target, req, true);
    }
}

/// One traced export: its device numbers in the file and the name in the process column.
#[derive(Clone)]
struct Target {
    cache: u16,
    core: u16,
    export: String,
    /// Still attached (a removed core is detached while the rest of the trace goes on).
    attached: bool,
}

struct Trace {
    cache: u16,
    core: Option<u16>,
    targets: Vec<Target>,
    file: PathBuf,
    max_size: Option<u64>,
    rec: Arc<Recorder>,
    writer: Option<JoinHandle<()>>,
    /// When it ended, for `seconds` in the status.
    ended_at: Option<Instant>,
}

impl Trace {
    fn info(&self) -> TraceInfo {
        let rec = &self.rec;
        let state = match &*rec.ended.lock() {
            Some(why) => format!("ended: {why}"),
            None => "recording".to_string(),
        };
        let seconds = self
            .ended_at
            .unwrap_or_else(Instant::now)
            .saturating_duration_since(rec.start)
            .as_secs_f64();
        TraceInfo {
            cache: self.cache,
            core: self.core,
            exports: self.targets.iter().map(|t| t.export.clone()).collect(),
            file: self.file.display().to_string(),
            max_size: self.max_size,
            state,
            events: rec.events.load(Ordering::Relaxed),
            bytes: rec.bytes.load(Ordering::Relaxed),
            dropped: rec.dropped.load(Ordering::Relaxed),
            seconds,
        }
    }

    /// Ends the trace (idempotent): detaches the observers, lets the writer drain and finish the
    /// file, waits for it.
    fn end(&mut self, registry: &ExportRegistry, why: &str) {
        for t in &mut self.targets {
            if t.attached {
                registry.set_observer(&t.export, None);
                t.attached = false;
            }
        }
        self.rec.recording.store(false, Ordering::Relaxed);
        {
            let mut p = self.rec.pending.lock();
            if p.stop.is_none() {
                p.stop = Some(why.to_string());
            }
        }
        self.rec.wake.notify_one();
        if let Some(w) = self.writer.take() {
            let _ = w.join();
        }
        if self.ended_at.is_none() {
            self.ended_at = Some(Instant::now());
        }
    }
}

/// The daemon's traces.
#[derive(Default)]
pub struct Tracers {
    traces: Mutex<Vec<Trace>>,
}

type Reply = std::result::Result<Value, String>;

fn to_value<T: serde::Serialize>(v: &T) -> Reply {
    serde_json::to_value(v).map_err(|e| e.to_string())
}

impl Tracers {
    /// Starts a trace of `cores` (core id, export name) of cache `cache`; `core` is what the
    /// user asked for (None: the whole cache). Validates everything before touching anything.
    pub fn start(
        &self,
        registry: &ExportRegistry,
        cache: u16,
        core: Option<u16>,
        cores: &[(u16, String)],
        file: &Path,
        max_size: Option<u64>,
    ) -> Reply {
        if !file.is_absolute() {
            return Err(format!(
                "trace file {} must be an absolute path",
                file.display()
            ));
        }
        if file.is_dir() {
            return Err(format!("trace file {} is a directory", file.display()));
        }
        if max_size == Some(0) {
            return Err("--max-size must be at least 1 byte".into());
        }
        if cores.is_empty() {
            return Err(format!("cache {cache} has no active core to trace"));
        }
        let mut traces = self.traces.lock();
        for t in traces.iter() {
            if t.rec.recording.load(Ordering::Relaxed) {
                if let Some(busy) = t
                    .targets
                    .iter()
                    .find(|x| x.attached && cores.iter().any(|(_, e)| *e == x.export))
                {
                    return Err(format!(
                        "{} is already traced to {} (trace stop -i {}{} first)",
                        busy.export,
                        t.file.display(),
                        t.cache,
                        t.core.map(|c| format!(" -j {c}")).unwrap_or_default()
                    ));
                }
            }
            if t.file == file {
                return Err(format!(
                    "{} is the file of another trace (of {}); stop that one first or choose another file",
                    file.display(),
                    target_text(t.cache, t.core)
                ));
            }
        }
        let f = File::create(file)
            .map_err(|e| format!("cannot create trace file {}: {e}", file.display()))?;
        let rec = Arc::new(Recorder {
            start: Instant::now(),
            pending: Mutex::new(Pending::default()),
            wake: Condvar::new(),
            recording: AtomicBool::new(true),
            dropped: AtomicU64::new(0),
            events: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            ended: Mutex::new(None),
        });
        let targets: Vec<Target> = cores
            .iter()
            .map(|(j, e)| Target {
                cache,
                core: *j,
                export: e.clone(),
                attached: false,
            })
            .collect();
        let writer = {
            let rec = rec.clone();
            let targets = targets.clone();
            let name = file.display().to_string();
            std::thread::Builder::new()
                .name("trace-writer".into())
                .spawn(move || write_loop(&rec, f, &targets, max_size, &name))
                .map_err(|e| format!("cannot start the trace writer: {e}"))?
        };
        let mut trace = Trace {
            cache,
            core,
            targets,
            file: file.to_path_buf(),
            max_size,
            rec: rec.clone(),
            writer: Some(writer),
            ended_at: None,
        };
        for (i, t) in trace.targets.iter_mut().enumerate() {
            let tap = Arc::new(Tap {
                rec: rec.clone(),
                target: i as u16,
            });
            t.attached = registry.set_observer(&t.export, Some(tap));
        }
        if trace.targets.iter().all(|t| !t.attached) {
            trace.end(registry, "nothing to trace");
            let _ = std::fs::remove_file(file);
            return Err(format!("cache {cache} has no exported volume to trace"));
        }
        let info = trace.info();
        // An ended trace of the same target is replaced by the new one.
        traces.retain(|t| !(t.cache == cache && t.core == core));
        traces.push(trace);
        eprintln!(
            "hybridcache: tracing {} to {}",
            target_text(cache, core),
            file.display()
        );
        to_value(&info)
    }

    /// `trace stop`: every trace of the cache, or the one started with `-j core`.
    pub fn stop(&self, registry: &ExportRegistry, cache: u16, core: Option<u16>) -> Reply {
        let mut traces = self.traces.lock();
        let matching = |t: &Trace| t.cache == cache && (core.is_none() || t.core == core);
        if !traces.iter().any(matching) {
            let what = match core {
                Some(j) => {
                    let wide = traces.iter().any(|t| t.cache == cache && t.core.is_none());
                    if wide {
                        format!("no trace of cache {cache} core {j} (cache {cache} is traced as a whole: trace stop -i {cache})")
                    } else {
                        format!("no trace of cache {cache} core {j}")
                    }
                }
                None => format!("no trace of cache {cache}"),
            };
            return Err(what);
        }
        let mut stopped = Vec::new();
        let mut keep = Vec::new();
        for mut t in traces.drain(..) {
            if matching(&t) {
                t.end(registry, "stopped by trace stop");
                stopped.push(t.info());
                eprintln!(
                    "hybridcache: trace of {} to {} stopped",
                    target_text(t.cache, t.core),
                    t.file.display()
                );
            } else {
                keep.push(t);
            }
        }
        *traces = keep;
        to_value(&TraceList { traces: stopped })
    }

    pub fn status(&self) -> Reply {
        let traces = self.traces.lock();
        to_value(&TraceList {
            traces: traces.iter().map(Trace::info).collect(),
        })
    }

    /// A core was removed: detach it; a trace left with nothing attached ends.
    pub fn core_removed(&self, registry: &ExportRegistry, cache: u16, core: u16) {
        let mut traces = self.traces.lock();
        for t in traces.iter_mut().filter(|t| t.cache == cache) {
            for x in t
                .targets
                .iter_mut()
                .filter(|x| x.core == core && x.attached)
            {
                registry.set_observer(&x.export, None);
                x.attached = false;
            }
            if t.writer.is_some() && t.targets.iter().all(|x| !x.attached) {
                t.end(registry, &format!("core {core} removed"));
            }
        }
    }

    /// The cache is stopping: its traces end (and stay listed until `trace stop`).
    pub fn cache_stopped(&self, registry: &ExportRegistry, cache: u16) {
        let mut traces = self.traces.lock();
        for t in traces
            .iter_mut()
            .filter(|t| t.cache == cache && t.writer.is_some())
        {
            t.end(registry, "cache stopped");
        }
    }

    /// The daemon is stopping: every trace file is finished.
    pub fn stop_all(&self, registry: &ExportRegistry) {
        let mut traces = self.traces.lock();
        for t in traces.iter_mut() {
            t.end(registry, "daemon stopped");
        }
    }
}

// ---- the writer ---------------------------------------------------------------------------

/// Per-trace totals for the closing summary.
#[derive(Default)]
struct Totals {
    reads: (u64, u64),
    writes: (u64, u64),
    discards: (u64, u64),
    flushes: u64,
    other: u64,
    completions: u64,
}

fn write_loop(rec: &Recorder, f: File, targets: &[Target], max_size: Option<u64>, name: &str) {
    let mut out = BufWriter::with_capacity(256 << 10, f);
    let mut seq: u64 = 0;
    let mut written: u64 = 0;
    let mut totals = Totals::default();
    let mut line = String::with_capacity(128);
    let mut batch: Vec<Ev> = Vec::new();
    // Received but not yet written: sorted by time, the newest held back (HOLD).
    let mut held: Vec<Ev> = Vec::new();
    let mut full = false;
    let mut io_error: Option<String> = None;
    let why = loop {
        let stop = {
            let mut p = rec.pending.lock();
            if p.events.is_empty() && p.stop.is_none() {
                rec.wake.wait_for(&mut p, WRITE_INTERVAL);
            }
            // Fetched before the stop flag is read: the final pass takes every event.
            std::mem::swap(&mut batch, &mut p.events);
            p.stop.clone()
        };
        held.append(&mut batch);
        // Stable: events of equal time keep the order they were reported in (Q before its C).
        held.sort_by_key(|e| e.time_ns);
        let ready = if stop.is_some() {
            held.len()
        } else {
            let horizon = rec.start.elapsed().saturating_sub(HOLD).as_nanos() as u64;
            held.partition_point(|e| e.time_ns <= horizon)
        };
        batch.extend(held.drain(..ready));
        for e in batch.drain(..) {
            if full || io_error.is_some() {
                break;
            }
            line.clear();
            format_event(&mut line, &e, targets, seq);
            if let Some(max) = max_size {
                if written + line.len() as u64 > max {
                    full = true;
                    rec.recording.store(false, Ordering::Relaxed);
                    break;
                }
            }
            if let Err(e) = out.write_all(line.as_bytes()) {
                io_error = Some(e.to_string());
                rec.recording.store(false, Ordering::Relaxed);
                break;
            }
            seq += 1;
            written += line.len() as u64;
            count(&mut totals, &e);
            rec.events.fetch_add(1, Ordering::Relaxed);
            rec.bytes.store(written, Ordering::Relaxed);
        }
        batch.clear();
        if io_error.is_none() {
            if let Err(e) = out.flush() {
                io_error = Some(e.to_string());
                rec.recording.store(false, Ordering::Relaxed);
            }
        }
        let ended = if let Some(e) = &io_error {
            Some(format!("writing the trace file failed: {e}"))
        } else if full {
            Some(format!(
                "max size {} reached",
                size_text(max_size.unwrap_or(0))
            ))
        } else {
            None
        };
        if let Some(why) = &ended {
            // Recorded for `trace status` now; the summary is written once stopped.
            let mut slot = rec.ended.lock();
            if slot.is_none() {
                eprintln!("hybridcache: trace {name}: {why}");
                *slot = Some(why.clone());
            }
        }
        if let Some(stop) = stop {
            // A trace that ended by itself keeps that reason.
            break ended.unwrap_or(stop);
        }
        if ended.is_some() {
            // Nothing more is recorded; wait for the stop without spinning.
            let mut p = rec.pending.lock();
            p.events.clear();
            held.clear();
            if p.stop.is_none() {
                rec.wake.wait_for(&mut p, Duration::from_millis(500));
            }
        }
    };
    {
        let mut slot = rec.ended.lock();
        if slot.is_none() {
            *slot = Some(why.clone());
        }
    }
    if io_error.is_none() {
        let summary = summary(targets, &totals, seq, rec, &why, rec.start.elapsed());
        let _ = out.write_all(summary.as_bytes());
        let _ = out.flush();
        let _ = out.get_ref().sync_data();
    }
}

fn count(t: &mut Totals, e: &Ev) {
    if e.complete {
        t.completions += 1;
        return;
    }
    let add = |x: &mut (u64, u64)| {
        x.0 += 1;
        x.1 += u64::from(e.len);
    };
    match e.kind {
        RequestKind::Read => add(&mut t.reads),
        RequestKind::Write | RequestKind::WriteZeroes => add(&mut t.writes),
        RequestKind::Trim => add(&mut t.discards),
        RequestKind::Flush => t.flushes += 1,
        RequestKind::Cache => t.other += 1,
    }
}

/// blkparse's RWBS letters for a request.
fn rwbs(kind: RequestKind, fua: bool) -> &'static str {
    match (kind, fua) {
        (RequestKind::Read, _) => "R",
        (RequestKind::Write | RequestKind::WriteZeroes, false) => "W",
        (RequestKind::Write | RequestKind::WriteZeroes, true) => "WF",
        (RequestKind::Trim, false) => "D",
        (RequestKind::Trim, true) => "DF",
        (RequestKind::Flush, _) => "FN",
        (RequestKind::Cache, _) => "N",
    }
}

/// One event in blkparse's default format:
/// `%3d,%-3d %2d %8d %5d.%09d %5d  %c %3s sector + count [name]`.
fn format_event(out: &mut String, e: &Ev, targets: &[Target], seq: u64) {
    let t = &targets[e.target as usize];
    let secs = e.time_ns / 1_000_000_000;
    let nanos = e.time_ns % 1_000_000_000;
    // The pid column is 32-bit in blkparse; connection ids stay far below that in practice.
    let pid = e.connection % (1 << 31);
    let action = if e.complete { 'C' } else { 'Q' };
    let _ = write!(
        out,
        "{:>3},{:<3} {:>2} {:>8} {:>5}.{:09} {:>5}  {} {:>3} ",
        t.cache,
        t.core,
        0,
        seq + 1,
        secs,
        nanos,
        pid,
        action,
        rwbs(e.kind, e.fua)
    );
    if e.kind != RequestKind::Flush {
        // Sectors of 512 bytes; an unaligned request is widened to the sectors it touches.
        let first = e.offset / 512;
        let end = (e.offset + u64::from(e.len)).div_ceil(512);
        let _ = write!(out, "{} + {} ", first, end - first);
    }
    if e.complete {
        out.push_str("[0]\n");
    } else {
        let _ = writeln!(out, "[nbd/{}]", t.export);
    }
}

/// The closing block, shaped like blkparse's per-CPU summary so its parser skips it.
fn summary(
    targets: &[Target],
    t: &Totals,
    events: u64,
    rec: &Recorder,
    why: &str,
    elapsed: Duration,
) -> String {
    let kib = |b: u64| b / 1024;
    let names: Vec<&str> = targets.iter().map(|t| t.export.as_str()).collect();
    let mut s = String::new();
    let _ = writeln!(s, "CPU0 (hybridcache trace of {}):", names.join(", "));
    let _ = writeln!(
        s,
        " Reads Queued:    {:>10}, {:>10}KiB\t Writes Queued:    {:>10}, {:>10}KiB",
        t.reads.0,
        kib(t.reads.1),
        t.writes.0,
        kib(t.writes.1)
    );
    let _ = writeln!(
        s,
        " Discards Queued: {:>10}, {:>10}KiB\t Flushes Queued:   {:>10}",
        t.discards.0,
        kib(t.discards.1),
        t.flushes
    );
    let _ = writeln!(s, " Completions:     {:>10}", t.completions);
    let _ = writeln!(
        s,
        "\nTrace ended: {why}, after {:.3} s; {events} events written, {} dropped",
        elapsed.as_secs_f64(),
        rec.dropped.load(Ordering::Relaxed)
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev(kind: RequestKind, complete: bool, offset: u64, len: u32, fua: bool) -> Ev {
        Ev {
            time_ns: 1_500_000_123,
            connection: 7,
            offset,
            len,
            target: 0,
            kind,
            fua,
            complete,
        }
    }

    fn targets() -> Vec<Target> {
        vec![Target {
            cache: 1,
            core: 2,
            export: "cas1-2".into(),
            attached: true,
        }]
    }

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

    /// Every kind of event must come back through the analyzer's own parser unchanged.
    #[test]
    fn lines_parse_back_as_blkparse() {
        let t = targets();
        let mut text = String::new();
        let cases = [
            (ev(RequestKind::Read, false, 8192, 4096, false), "R"),
            (ev(RequestKind::Read, true, 8192, 4096, false), "R"),
            (ev(RequestKind::Write, false, 0, 65536, true), "WF"),
            (ev(RequestKind::WriteZeroes, false, 0, 4096, false), "W"),
            (ev(RequestKind::Trim, false, 0, 1 << 20, false), "D"),
            (ev(RequestKind::Flush, false, 0, 0, false), "FN"),
            (ev(RequestKind::Flush, true, 0, 0, false), "FN"),
            (ev(RequestKind::Cache, false, 100, 10, false), "N"),
        ];
        for (i, (e, letters)) in cases.iter().enumerate() {
            let mut l = String::new();
            format_event(&mut l, e, &t, i as u64);
            assert!(l.contains(&format!(" {letters} ")), "{l}");
            text += &l;
        }
        text += &summary(
            &t,
            &Totals::default(),
            8,
            &Recorder {
                start: Instant::now(),
                pending: Mutex::new(Pending::default()),
                wake: Condvar::new(),
                recording: AtomicBool::new(false),
                dropped: AtomicU64::new(0),
                events: AtomicU64::new(0),
                bytes: AtomicU64::new(0),
                ended: Mutex::new(None),
            },
            "stopped by trace stop",
            Duration::from_secs(2),
        );
        let trace = hybridcache_analyze::parse_trace(
            text.as_bytes(),
            hybridcache_analyze::Format::Blkparse,
        )
        .expect("parses");
        let r = &trace.report;
        assert_eq!(r.bad, 0, "{r}");
        assert_eq!(r.events, 8);
        assert!(r.summary >= 4, "{r}");
        assert_eq!(trace.devices, vec!["1,2".to_string()]);
        assert_eq!(trace.jobs, vec!["nbd/cas1-2 (pid 7)".to_string()]);
        let e = &trace.events[0];
        assert_eq!((e.offset, e.len, e.time_ns), (8192, 4096, 1_500_000_123));
        assert_eq!(trace.events[2].len, 65536);
        assert!(trace.events[2].rwbs.has(hybridcache_analyze::Rwbs::FUA));
        assert_eq!(trace.events[4].op(), hybridcache_analyze::Op::Discard);
        assert_eq!(trace.events[5].op(), hybridcache_analyze::Op::Flush);
        // The unaligned cache hint is widened to whole sectors.
        assert_eq!((trace.events[7].offset, trace.events[7].len), (0, 512));
    }
}

//! The daemon's block tracer: the recording half of `hybridcache trace`.
//!
//! Observers attached to the NBD server's exports append a small record per request event to an
//! in-memory buffer; a writer thread formats them in blkparse's default text form (see the CLI's
//! `trace` module doc for the columns and what is recorded) and writes the trace file. The CLI
//! sends `trace start/stop/status` over the control socket; [`Tracers`] answers them.

use std::fmt::Write as _;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use hybridcache_nbd::{ExportRegistry, ObservedRequest, RequestKind, RequestObserver};
use parking_lot::{Condvar, Mutex};
use serde_json::Value;

use crate::protocol::{TraceInfo, TraceList};

/// "cache 1 core 2", or "cache 1" for a cache-wide trace.
pub fn target_text(cache: u16, core: Option<u16>) -> String {
    match core {
        Some(j) => format!("cache {cache} core {j}"),
        None => format!("cache {cache}"),
    }
}

/// A byte count for people ("1.5 MiB").
pub fn size_text(b: u64) -> String {
    hybridcache_analyze::units::bytes(b)
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
        tracing::info!("tracing {} to {}", target_text(cache, core), file.display());
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
                tracing::info!(
                    "trace of {} to {} stopped",
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
                tracing::info!("trace {name}: {why}");
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

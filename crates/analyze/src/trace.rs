//! The common trace model every parser produces, and the entry point [`parse_trace`].
//!
//! All formats are reduced to one event list so that the signature code has a single input:
//! blkparse keeps its action codes; MSR Cambridge rows become a queue and a completion event;
//! fio iologs become queue events only (they record no completions).

use std::collections::HashMap;
use std::fmt;
use std::io::{BufRead, BufReader, Read};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::{blkparse, fio, msr};

/// Bytes per sector in blkparse traces.
pub const SECTOR: u64 = 512;

/// How many bad lines a [`ParseReport`] keeps verbatim.
pub const BAD_LINES_KEPT: usize = 5;

/// Input format of a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Format {
    /// Guess from the first lines (fio headers, MSR's 7-field CSV, else blkparse).
    Auto,
    /// blkparse's default text output (also hybridcache's own traces).
    Blkparse,
    /// SNIA / MSR Cambridge CSV.
    Msr,
    /// `fio version 2 iolog`.
    FioV2,
    /// `fio version 3 iolog` (lines start with a timestamp in ms).
    FioV3,
}

impl fmt::Display for Format {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Format::Auto => "auto",
            Format::Blkparse => "blkparse",
            Format::Msr => "msr",
            Format::FioV2 => "fio-v2",
            Format::FioV3 => "fio-v3",
        })
    }
}

impl FromStr for Format {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "auto" => Ok(Format::Auto),
            "blkparse" | "blktrace" => Ok(Format::Blkparse),
            "msr" | "snia" | "csv" => Ok(Format::Msr),
            "fio-v2" | "fio2" | "fio" => Ok(Format::FioV2),
            "fio-v3" | "fio3" => Ok(Format::FioV3),
            other => Err(format!(
                "unknown trace format `{other}` (auto, blkparse, msr, fio-v2, fio-v3)"
            )),
        }
    }
}

/// What happened to a request at this event (blkparse's action codes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Action {
    /// Q: the request entered the block layer (the request stream the study analysed).
    Queue,
    /// G: a request structure was allocated.
    GetRequest,
    /// I: inserted into the IO scheduler.
    Insert,
    /// D: issued to the driver.
    Issue,
    /// C: completed.
    Complete,
    /// M: back merge with a queued request.
    BackMerge,
    /// F: front merge with a queued request.
    FrontMerge,
    /// X: split.
    Split,
    /// A: remapped from another device (device mapper, partitions).
    Remap,
    /// P: plug.
    Plug,
    /// U: unplug.
    Unplug,
    /// UT / T: unplug by timer.
    TimerUnplug,
    /// S: sleep (no request available).
    Sleep,
    /// B: bounced.
    Bounce,
    /// R: requeued.
    Requeue,
    /// m: a message from the kernel (text, no request).
    Message,
}

impl Action {
    /// Parses a blkparse action token.
    pub fn from_code(code: &str) -> Option<Action> {
        Some(match code {
            "Q" => Action::Queue,
            "G" => Action::GetRequest,
            "I" => Action::Insert,
            "D" => Action::Issue,
            "C" => Action::Complete,
            "M" => Action::BackMerge,
            "F" => Action::FrontMerge,
            "X" => Action::Split,
            "A" => Action::Remap,
            "P" => Action::Plug,
            "U" => Action::Unplug,
            "UT" | "T" => Action::TimerUnplug,
            "S" => Action::Sleep,
            "B" => Action::Bounce,
            "R" => Action::Requeue,
            "m" => Action::Message,
            _ => return None,
        })
    }
}

/// Direction of a request, derived from the RWBS flags.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Op {
    Read,
    Write,
    Discard,
    Flush,
    /// No data direction (messages, plugs, `N` requests).
    None,
}

/// blkparse's RWBS field as a set of flags.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Rwbs(pub u16);

impl Rwbs {
    pub const READ: u16 = 1;
    pub const WRITE: u16 = 1 << 1;
    pub const DISCARD: u16 = 1 << 2;
    /// A leading `F`: preflush.
    pub const FLUSH: u16 = 1 << 3;
    /// An `F` after the direction letter: forced unit access.
    pub const FUA: u16 = 1 << 4;
    pub const SYNC: u16 = 1 << 5;
    pub const META: u16 = 1 << 6;
    pub const AHEAD: u16 = 1 << 7;
    pub const NONE: u16 = 1 << 8;
    pub const SECURE: u16 = 1 << 9;
    /// Old kernels' barrier flag.
    pub const BARRIER: u16 = 1 << 10;

    /// Parses an RWBS token; `None` on letters blktrace never prints.
    pub fn parse(s: &str) -> Option<Rwbs> {
        if s.is_empty() || s.len() > 8 {
            return None;
        }
        let mut bits = 0u16;
        // blktrace prints the preflush F before the direction letter and FUA's F after it, so
        // the meaning of F depends on whether a direction was seen yet.
        let mut seen_dir = false;
        for c in s.chars() {
            bits |= match c {
                'R' => {
                    seen_dir = true;
                    Self::READ
                }
                'W' => {
                    seen_dir = true;
                    Self::WRITE
                }
                'D' => {
                    seen_dir = true;
                    Self::DISCARD
                }
                'N' => {
                    seen_dir = true;
                    Self::NONE
                }
                'E' => {
                    seen_dir = true;
                    Self::SECURE
                }
                'F' if seen_dir => Self::FUA,
                'F' => Self::FLUSH,
                'S' => Self::SYNC,
                'M' => Self::META,
                'A' => Self::AHEAD,
                'B' => Self::BARRIER,
                _ => return None,
            };
        }
        Some(Rwbs(bits))
    }

    pub fn has(self, flag: u16) -> bool {
        self.0 & flag != 0
    }

    /// The data direction: discard (and secure erase) before write before read; a request with
    /// only a preflush is a flush.
    pub fn op(self) -> Op {
        if self.has(Self::DISCARD | Self::SECURE) {
            Op::Discard
        } else if self.has(Self::WRITE) {
            Op::Write
        } else if self.has(Self::READ) {
            Op::Read
        } else if self.has(Self::FLUSH | Self::FUA) {
            Op::Flush
        } else {
            Op::None
        }
    }

    pub fn from_op(op: Op) -> Rwbs {
        Rwbs(match op {
            Op::Read => Self::READ,
            Op::Write => Self::WRITE,
            Op::Discard => Self::DISCARD,
            Op::Flush => Self::FLUSH,
            Op::None => Self::NONE,
        })
    }
}

/// One trace event, in the units every format shares (ns, bytes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    /// Time since the trace's own epoch, ns (absolute for MSR, relative for blkparse).
    pub time_ns: u64,
    /// Index into [`Trace::devices`].
    pub device: u32,
    /// Index into [`Trace::jobs`].
    pub job: u32,
    pub cpu: u32,
    pub action: Action,
    pub rwbs: Rwbs,
    /// Byte offset on the device.
    pub offset: u64,
    /// Bytes; 0 for events without a range.
    pub len: u64,
}

impl Event {
    pub fn op(&self) -> Op {
        self.rwbs.op()
    }
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.len)
    }
}

/// A line that did not parse.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct BadLine {
    /// 1-based.
    pub line: u64,
    /// The line, cut to 200 characters.
    pub text: String,
    pub why: String,
}

/// What the parser made of the input, line by line.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParseReport {
    pub lines: u64,
    /// Lines that produced events.
    pub parsed: u64,
    pub events: u64,
    pub blank: u64,
    /// Headers and comments (fio's version line, MSR's column names, fio file actions).
    pub headers: u64,
    /// blkparse's summary block.
    pub summary: u64,
    pub bad: u64,
    pub first_bad: Vec<BadLine>,
}

impl ParseReport {
    pub(crate) fn bad_line(&mut self, line: u64, text: &str, why: impl Into<String>) {
        self.bad += 1;
        if self.first_bad.len() < BAD_LINES_KEPT {
            self.first_bad.push(BadLine {
                line,
                text: text.chars().take(200).collect(),
                why: why.into(),
            });
        }
    }
}

impl fmt::Display for ParseReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} lines: {} parsed into {} events, {} skipped (blank {}, header {}, summary {}), {} bad",
            self.lines,
            self.parsed,
            self.events,
            self.blank + self.headers + self.summary,
            self.blank,
            self.headers,
            self.summary,
            self.bad
        )?;
        for b in &self.first_bad {
            write!(f, "\n  line {}: {} ({})", b.line, b.text, b.why)?;
        }
        if self.bad > self.first_bad.len() as u64 {
            write!(
                f,
                "\n  ... and {} more",
                self.bad - self.first_bad.len() as u64
            )?;
        }
        Ok(())
    }
}

/// Errors of [`parse_trace`].
#[derive(Debug, thiserror::Error)]
pub enum ParseError {
    #[error("reading the trace: {0}")]
    Io(#[from] std::io::Error),
    #[error("nothing parseable in the trace (format {format}): {report}")]
    NothingParseable { format: Format, report: ParseReport },
}

/// A parsed trace: events in input order (MSR: sorted by time), names, and the parse report.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Trace {
    /// The format actually parsed (never `Auto`).
    pub format: Format,
    pub events: Vec<Event>,
    /// Device names: `maj,min` for blkparse, `host/disk` for MSR, the file for fio.
    pub devices: Vec<String>,
    /// Job names: `process (pid N)` / `pid N` for blkparse (for hybridcache's traces the pid is the
    /// NBD connection id), `host/disk` for MSR, the file name for fio.
    pub jobs: Vec<String>,
    pub report: ParseReport,
}

/// Interns names and collects events; shared by the parsers.
#[derive(Default)]
pub(crate) struct Builder {
    pub events: Vec<Event>,
    pub devices: Vec<String>,
    device_ix: HashMap<String, u32>,
    pub jobs: Vec<String>,
    job_ix: HashMap<String, u32>,
    pub report: ParseReport,
}

impl Builder {
    pub fn device(&mut self, name: &str) -> u32 {
        intern(&mut self.devices, &mut self.device_ix, name)
    }
    pub fn job(&mut self, key: &str) -> u32 {
        intern(&mut self.jobs, &mut self.job_ix, key)
    }
}

fn intern(names: &mut Vec<String>, ix: &mut HashMap<String, u32>, name: &str) -> u32 {
    if let Some(&i) = ix.get(name) {
        return i;
    }
    let i = names.len() as u32;
    names.push(name.to_string());
    ix.insert(name.to_string(), i);
    i
}

/// A per-format line parser.
pub(crate) trait LineParser {
    /// Handles one line (without its newline). Returns the outcome so the driver can count it.
    fn line(&mut self, no: u64, line: &str, out: &mut Builder) -> Outcome;
    /// Called after the last line (to name jobs, sort events, ...).
    fn finish(&mut self, _out: &mut Builder) {}
}

pub(crate) enum Outcome {
    Events,
    Header,
    Summary,
    Bad(String),
}

/// Guesses the format from the first lines of a trace.
pub fn detect_format<S: AsRef<str>>(lines: &[S]) -> Format {
    for l in lines
        .iter()
        .map(|l| l.as_ref().trim())
        .filter(|l| !l.is_empty())
    {
        if l.starts_with("fio version 2 iolog") {
            return Format::FioV2;
        }
        if l.starts_with("fio version 3 iolog") {
            return Format::FioV3;
        }
        if l.starts_with("Timestamp,Hostname") || msr::looks_like_row(l) {
            return Format::Msr;
        }
        if blkparse::looks_like_event(l) {
            return Format::Blkparse;
        }
    }
    Format::Blkparse
}

/// How many lines auto-detection looks at.
const DETECT_LINES: usize = 32;

/// Parses a trace. `Format::Auto` guesses from the first lines. Lines that do not parse are
/// counted and the first few kept in [`Trace::report`]; a trace without a single event is an
/// error. Invalid UTF-8 is replaced, never fatal, because traces come from many tools.
pub fn parse_trace<R: Read>(reader: R, format: Format) -> Result<Trace, ParseError> {
    let mut reader = BufReader::new(reader);
    let mut buf = Vec::new();
    let mut head: Vec<String> = Vec::new();
    let mut eof = false;
    let format = if format == Format::Auto {
        // Buffer a few lines to look at; they are replayed below.
        while head.len() < DETECT_LINES {
            buf.clear();
            if reader.read_until(b'\n', &mut buf)? == 0 {
                eof = true;
                break;
            }
            head.push(line_text(&buf));
        }
        detect_format(&head)
    } else {
        format
    };
    let mut parser: Box<dyn LineParser> = match format {
        Format::Msr => Box::new(msr::Parser),
        Format::FioV2 => Box::new(fio::Parser::new(false)),
        Format::FioV3 => Box::new(fio::Parser::new(true)),
        Format::Blkparse | Format::Auto => Box::new(blkparse::Parser::default()),
    };
    let mut out = Builder::default();
    let mut no = 0u64;
    let mut handle = |text: &str, out: &mut Builder| {
        no += 1;
        out.report.lines += 1;
        if text.trim().is_empty() {
            out.report.blank += 1;
            return;
        }
        let before = out.events.len();
        match parser.line(no, text, out) {
            Outcome::Events => {
                out.report.parsed += 1;
                out.report.events += (out.events.len() - before) as u64;
            }
            Outcome::Header => out.report.headers += 1,
            Outcome::Summary => out.report.summary += 1,
            Outcome::Bad(why) => out.report.bad_line(no, text, why),
        }
    };
    for l in &head {
        handle(l, &mut out);
    }
    // The buffered head already hit the end of the input when `eof` is set.
    if !eof {
        loop {
            buf.clear();
            if reader.read_until(b'\n', &mut buf)? == 0 {
                break;
            }
            let text = line_text(&buf);
            handle(&text, &mut out);
        }
    }
    parser.finish(&mut out);
    let format = if format == Format::Auto {
        Format::Blkparse
    } else {
        format
    };
    if out.events.is_empty() {
        return Err(ParseError::NothingParseable {
            format,
            report: out.report,
        });
    }
    Ok(Trace {
        format,
        events: out.events,
        devices: out.devices,
        jobs: out.jobs,
        report: out.report,
    })
}

fn line_text(buf: &[u8]) -> String {
    let mut s = String::from_utf8_lossy(buf).into_owned();
    while s.ends_with('\n') || s.ends_with('\r') {
        s.pop();
    }
    s
}

/// Parses `seconds.fraction` into ns without going through f64 (blkparse prints 9 digits and
/// f64 would lose ns after ~100 days).
pub(crate) fn parse_seconds(s: &str) -> Option<u64> {
    let (int, frac) = match s.split_once('.') {
        Some((i, f)) => (i, f),
        None => (s, ""),
    };
    if int.is_empty() && frac.is_empty() {
        return None;
    }
    let secs: u64 = if int.is_empty() { 0 } else { int.parse().ok()? };
    if !frac.chars().all(|c| c.is_ascii_digit()) {
        return None;
    }
    let mut ns = 0u64;
    for (i, c) in frac.chars().take(9).enumerate() {
        ns += (c as u64 - '0' as u64) * 10u64.pow(8 - i as u32);
    }
    secs.checked_mul(1_000_000_000)?.checked_add(ns)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rwbs_flags() {
        let r = Rwbs::parse("FWFS").unwrap();
        assert!(r.has(Rwbs::FLUSH) && r.has(Rwbs::WRITE) && r.has(Rwbs::FUA) && r.has(Rwbs::SYNC));
        assert_eq!(r.op(), Op::Write);
        assert_eq!(Rwbs::parse("FN").unwrap().op(), Op::Flush);
        assert_eq!(Rwbs::parse("DE").unwrap().op(), Op::Discard);
        assert_eq!(Rwbs::parse("RA").unwrap().op(), Op::Read);
        assert_eq!(Rwbs::parse("N").unwrap().op(), Op::None);
        assert!(Rwbs::parse("WQ").is_none());
        assert!(Rwbs::parse("").is_none());
    }

    #[test]
    fn seconds() {
        assert_eq!(parse_seconds("0.000237516"), Some(237_516));
        assert_eq!(parse_seconds("12.5"), Some(12_500_000_000));
        assert_eq!(parse_seconds("3"), Some(3_000_000_000));
        assert_eq!(parse_seconds("x.1"), None);
        assert_eq!(parse_seconds("."), None);
    }

    #[test]
    fn format_names() {
        for f in [
            Format::Auto,
            Format::Blkparse,
            Format::Msr,
            Format::FioV2,
            Format::FioV3,
        ] {
            assert_eq!(f.to_string().parse::<Format>().unwrap(), f);
        }
        assert!("xyz".parse::<Format>().is_err());
    }
}

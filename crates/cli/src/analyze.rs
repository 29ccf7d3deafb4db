//! `hybridcache analyze`: a block trace in, a workload report and a recommended cache
//! configuration out (docs/analyzer.md). Pure analysis through `hybridcache-analyze`: no daemon
//! is needed, except for `--apply`, which applies the recommended configuration (mode, cleaning,
//! seq cutoff, promotion, IO classes) to a running cache (apply.rs).
//!
//! Exit codes: 0 on success; 2 for a trace that cannot be read or holds nothing parseable, and
//! for a bad profile (like a bad command line); 1 when an output file cannot be written or the
//! daemon refuses `--apply`.

use std::fs::File;
use std::io::{BufRead, BufReader, Cursor, Read, Write};
use std::path::{Path, PathBuf};

use clap::Args;
use hybridcache_analyze::{
    detect_format, parse_trace, recommend, DeviceProfile, Format, ParseError, ProfileError,
    Recommendation, Report, Signature, Trace,
};

/// Built-in device profiles `--profile` accepts by name.
pub const BUILTIN_PROFILES: &str = "raid60-study, ssd-raid5x9, nvme";

/// `--format`: the trace formats, with `fio` meaning either iolog version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceFormat {
    Auto,
    Blkparse,
    Msr,
    /// fio iolog, version 2 or 3 (read from its first line).
    Fio,
    FioV2,
    FioV3,
}

fn trace_format(s: &str) -> Result<TraceFormat, String> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "auto" => TraceFormat::Auto,
        "blkparse" | "blktrace" => TraceFormat::Blkparse,
        "msr" | "snia" | "csv" => TraceFormat::Msr,
        "fio" | "iolog" => TraceFormat::Fio,
        "fio-v2" | "fio2" => TraceFormat::FioV2,
        "fio-v3" | "fio3" => TraceFormat::FioV3,
        _ => {
            return Err(format!(
                "unknown trace format '{s}' (auto, blkparse, msr, fio, fio-v2, fio-v3)"
            ))
        }
    })
}

/// Arguments of `hybridcache analyze`.
#[derive(Debug, Clone, Args)]
pub struct AnalyzeArgs {
    /// Trace file: blkparse text, SNIA/MSR CSV or fio iolog; '-' reads standard input.
    #[arg(value_name = "TRACE")]
    pub trace: PathBuf,
    /// Trace format [default: auto, guessed from the first lines].
    #[arg(long, value_parser = trace_format, default_value = "auto", hide_default_value = true,
          value_name = "auto|blkparse|msr|fio")]
    pub format: TraceFormat,
    /// Device profile: a built-in name (raid60-study, ssd-raid5x9, nvme) or a TOML/JSON file [default: raid60-study].
    #[arg(long, value_name = "raid60-study|ssd-raid5x9|nvme|FILE")]
    pub profile: Option<String>,
    /// Render the report as Markdown instead of text.
    #[arg(long)]
    pub markdown: bool,
    /// Write the report to FILE instead of standard output.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: Option<PathBuf>,
    /// Write the recommended commands as a shell script to FILE.
    #[arg(long, value_name = "FILE")]
    pub commands: Option<PathBuf>,
    /// Also write DIR/report.md (Markdown) with PNG charts: request sizes, queue depth, IOPS and
    /// throughput over time, miss-ratio curve.
    #[arg(long = "report-dir", value_name = "DIR")]
    pub report_dir: Option<PathBuf>,
    /// Write the recommended configuration as a TOML fragment ([[cache]]) to FILE.
    #[arg(long = "config-out", value_name = "FILE")]
    pub config_out: Option<PathBuf>,
    /// Cache id used in the commands and the TOML fragment [default: 1]; the cache --apply changes.
    #[arg(short = 'i', long = "cache-id", value_parser = crate::cli::cache_id)]
    pub id: Option<u16>,
    /// Apply the recommended configuration (mode, cleaning, seq cutoff on every core, promotion,
    /// IO classes) to the running cache -i ID.
    #[arg(long, requires = "id")]
    pub apply: bool,
}

/// Why `analyze` failed: the exit code and the message (one line, except that a trace with
/// nothing parseable lists its first bad lines below).
#[derive(Debug)]
pub struct Failure {
    pub code: u8,
    pub message: String,
}

fn usage(message: String) -> Failure {
    Failure { code: 2, message }
}

fn failed(message: String) -> Failure {
    Failure { code: 1, message }
}

/// Everything one analysis produced.
pub struct Analysis {
    pub trace: Trace,
    pub signature: Signature,
    pub recommendation: Recommendation,
    pub report: Report,
}

/// Resolves `--profile`: built-in names first, then a file.
pub fn load_profile(spec: Option<&str>) -> Result<DeviceProfile, Failure> {
    let Some(spec) = spec else {
        return Ok(DeviceProfile::raid60_study());
    };
    if let Ok(p) = DeviceProfile::builtin(spec) {
        return Ok(p);
    }
    let path = Path::new(spec);
    if !path.exists() {
        return Err(usage(format!(
            "profile '{spec}' is neither a built-in profile ({BUILTIN_PROFILES}) nor a file"
        )));
    }
    DeviceProfile::load(path).map_err(|e| {
        let why = match &e {
            // toml's own text draws the offending line over several lines; keep the message.
            ProfileError::Toml(t) => format!("profile TOML: {}", t.message().trim()),
            e => e
                .to_string()
                .split_whitespace()
                .collect::<Vec<_>>()
                .join(" "),
        };
        usage(format!("bad profile {spec}: {why}"))
    })
}

/// How many lines are read to tell fio's iolog versions apart.
const HEAD_LINES: usize = 32;

/// Reads and parses the trace (`-` is standard input).
pub fn read_trace(path: &Path, format: TraceFormat) -> Result<Trace, Failure> {
    let name = path.display();
    let input: Box<dyn Read> = if path == Path::new("-") {
        Box::new(std::io::stdin().lock())
    } else {
        match File::open(path) {
            Ok(f) if f.metadata().is_ok_and(|m| m.is_dir()) => {
                return Err(usage(format!(
                    "cannot read trace {name}: it is a directory"
                )))
            }
            Ok(f) => Box::new(f),
            Err(e) => return Err(usage(format!("cannot read trace {name}: {e}"))),
        }
    };
    let mut reader = BufReader::new(input);
    // The first lines are buffered to decide between fio versions, then replayed.
    let mut head = Vec::new();
    let mut head_lines = Vec::new();
    while head_lines.len() < HEAD_LINES {
        let mut line = Vec::new();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) => break,
            Ok(_) => {
                head_lines.push(String::from_utf8_lossy(&line).into_owned());
                head.extend_from_slice(&line);
            }
            Err(e) => return Err(usage(format!("cannot read trace {name}: {e}"))),
        }
    }
    let format = match format {
        TraceFormat::Auto => Format::Auto,
        TraceFormat::Blkparse => Format::Blkparse,
        TraceFormat::Msr => Format::Msr,
        TraceFormat::FioV2 => Format::FioV2,
        TraceFormat::FioV3 => Format::FioV3,
        TraceFormat::Fio => match detect_format(&head_lines) {
            Format::FioV3 => Format::FioV3,
            _ => Format::FioV2,
        },
    };
    if head.is_empty() {
        return Err(usage(format!("trace {name} is empty")));
    }
    parse_trace(Cursor::new(head).chain(reader), format).map_err(|e| match e {
        ParseError::Io(e) => usage(format!("cannot read trace {name}: {e}")),
        e @ ParseError::NothingParseable { .. } => usage(format!("trace {name}: {e}")),
    })
}

/// Parses, computes the signature and the recommendation, builds the report.
pub fn analyze(args: &AnalyzeArgs) -> Result<Analysis, Failure> {
    let profile = load_profile(args.profile.as_deref())?;
    let trace = read_trace(&args.trace, args.format)?;
    let sig = Signature::from_trace(&trace);
    let recommendation = recommend(&sig, &profile);
    let report = Report::new(&trace, &sig, &recommendation, cache_id(args));
    Ok(Analysis {
        trace,
        signature: sig,
        recommendation,
        report,
    })
}

fn cache_id(args: &AnalyzeArgs) -> u32 {
    u32::from(args.id.unwrap_or(1))
}

/// The recommended commands as a shell script (the IO class file, when needed, written by a
/// here-document before the command that loads it).
pub fn commands_script(args: &AnalyzeArgs, rec: &Recommendation) -> String {
    let id = cache_id(args);
    let c = &rec.config;
    let mut s = String::from("#!/bin/sh\n");
    s += &format!(
        "# Cache configuration recommended by 'hybridcache analyze' for {}\n# (profile: {}).\n",
        args.trace.display(),
        rec.profile
    );
    s += &format!(
        "# Mode {}, {} KiB lines, cleaning {}, lazy flush {}, seq-cutoff {} {} KiB, prefetch {}, cache size {} bytes.\n",
        c.mode.as_str(),
        c.line_size_kib,
        c.cleaning.preset().unwrap_or(c.cleaning.name()),
        if c.lazy_flush { "on" } else { "off" },
        c.seq_cutoff.policy.as_str(),
        c.seq_cutoff.threshold,
        if c.prefetch.is_some() { "readahead" } else { "none" },
        c.cache_size_bytes
    );
    s += "#\n";
    for r in &rec.reasons {
        s += &format!("# {}: {}\n", r.setting, r.text);
    }
    s += "#\n# Seq cutoff applies to the cores the cache has when it runs; the script stops at the\n\
          # first command the daemon refuses.\n";
    s += "set -e\n";
    let csv = rec.io_class_csv();
    for line in rec.commands(id) {
        if line.starts_with("hybridcache -C") && !csv.is_empty() {
            s += "cat > ioclass.csv <<'EOF'\n";
            s += &csv;
            s += "EOF\n";
        }
        s += &line;
        s.push('\n');
    }
    s
}

fn write_file(path: &Path, text: &str, what: &str) -> Result<(), Failure> {
    std::fs::write(path, text).map_err(|e| {
        failed(format!(
            "cannot write the {what} to {}: {e}",
            path.display()
        ))
    })
}

/// Runs the command; the caller prints the failure and exits with its code.
pub fn run(args: &AnalyzeArgs, control: &Path) -> Result<(), Failure> {
    let a = analyze(args)?;
    let r = &a.trace.report;
    if r.bad > 0 {
        let first = r
            .first_bad
            .first()
            .map(|b| format!(" (first: line {}: {})", b.line, b.why))
            .unwrap_or_default();
        eprintln!(
            "hybridcache: warning: {}: {} of {} lines did not parse{first}; they are listed in the report",
            args.trace.display(),
            r.bad,
            r.lines
        );
    }
    let text = if args.markdown {
        a.report.render_markdown()
    } else {
        a.report.render_text()
    };
    match &args.output {
        Some(path) => write_file(path, &text, "report")?,
        None => {
            let mut out = std::io::stdout().lock();
            // A closed pipe (`| head`) is not an error worth reporting.
            let _ = out.write_all(text.as_bytes()).and_then(|()| out.flush());
        }
    }
    if let Some(dir) = &args.report_dir {
        let path = crate::report_charts::write_report_dir(dir, &a.trace, &a.signature, &a.report)
            .map_err(|e| failed(format!("--report-dir: {e:#}")))?;
        eprintln!(
            "hybridcache: report with charts written to {}",
            path.display()
        );
    }
    if let Some(path) = &args.commands {
        write_file(path, &commands_script(args, &a.recommendation), "commands")?;
        use std::os::unix::fs::PermissionsExt;
        let _ = std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755));
    }
    if let Some(path) = &args.config_out {
        write_file(
            path,
            &a.recommendation.toml_fragment(cache_id(args)),
            "configuration",
        )?;
    }
    if args.apply {
        let id = args.id.expect("clap requires -i with --apply");
        match crate::apply::apply(control, &a.recommendation, id) {
            Ok(done) => eprintln!("hybridcache: applied to cache {id}: {}", done.join(", ")),
            Err((done, why)) => {
                let before = if done.is_empty() {
                    "nothing was applied".to_string()
                } else {
                    format!("applied before it: {}", done.join(", "))
                };
                return Err(failed(format!(
                    "--apply to cache {id} stopped at {why}; {before}"
                )));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_parse() {
        assert_eq!(trace_format("fio"), Ok(TraceFormat::Fio));
        assert_eq!(trace_format("MSR"), Ok(TraceFormat::Msr));
        assert_eq!(trace_format("fio-v3"), Ok(TraceFormat::FioV3));
        assert!(trace_format("xml")
            .unwrap_err()
            .contains("unknown trace format 'xml'"));
    }

    #[test]
    fn profiles_resolve() {
        assert!(load_profile(None).is_ok());
        assert!(load_profile(Some("nvme")).is_ok());
        assert!(load_profile(Some("raid60-study")).is_ok());
        let e = load_profile(Some("no-such-profile")).unwrap_err();
        assert_eq!(e.code, 2);
        assert!(
            e.message.contains("neither a built-in profile"),
            "{}",
            e.message
        );
    }

    #[test]
    fn fio_version_is_read_from_the_header() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("v3.log");
        std::fs::write(
            &p,
            "fio version 3 iolog\n0 /dev/x add\n0 /dev/x open\n5 /dev/x write 0 4096\n10 /dev/x read 4096 4096\n",
        )
        .unwrap();
        let t = read_trace(&p, TraceFormat::Fio).unwrap();
        assert_eq!(t.format, Format::FioV3);
    }
}

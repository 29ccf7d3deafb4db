//! Analyse a trace file and print the report (until the CLI grows an `analyze` command).
//!
//! `cargo run -p hybridcache-analyze --example analyze -- TRACE [FORMAT] [--markdown] [--profile FILE]`

use std::process::ExitCode;

use hybridcache_analyze::*;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(path) = args.first() else {
        eprintln!(
            "usage: analyze TRACE [auto|blkparse|msr|fio-v2|fio-v3] [--markdown] [--profile FILE]"
        );
        return ExitCode::from(2);
    };
    let format = args
        .get(1)
        .filter(|a| !a.starts_with("--"))
        .map_or(Ok(Format::Auto), |f| f.parse::<Format>());
    let format = match format {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(2);
        }
    };
    let profile = match args.iter().position(|a| a == "--profile") {
        Some(i) => match args
            .get(i + 1)
            .map(|p| DeviceProfile::load(std::path::Path::new(p)))
        {
            Some(Ok(p)) => p,
            Some(Err(e)) => {
                eprintln!("{e}");
                return ExitCode::from(2);
            }
            None => {
                eprintln!("--profile needs a file");
                return ExitCode::from(2);
            }
        },
        None => DeviceProfile::raid60_study(),
    };
    let file = match std::fs::File::open(path) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("{path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let trace = match parse_trace(file, format) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("{path}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let sig = Signature::from_trace(&trace);
    let rec = recommend(&sig, &profile);
    let report = Report::new(&trace, &sig, &rec, 1);
    if args.iter().any(|a| a == "--markdown") {
        print!("{}", report.render_markdown());
    } else {
        print!("{}", report.render_text());
    }
    ExitCode::SUCCESS
}

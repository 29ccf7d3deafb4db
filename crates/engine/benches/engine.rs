//! Engine benchmark (docs/perf.md §1; the library is `hybridcache_engine::bench`).
//!
//! `cargo bench -p hybridcache-engine [-- OPTIONS] [FILTER...]` prints a table (medians with
//! min-max, OCF's marks and our ratio to them) and writes every figure as JSON.
//!
//! Options: `--quick` (256 MiB cache, 3 reps: seconds instead of minutes), `--reps N`,
//! `--all` (every combination of the lists below, not just the standard cases: about 30 min),
//! `--cache-mib N`, `--test NAME` (repeatable: seqwrite, randwrite, randwrite_hit,
//! randread_hit, seqread_hit, flush), `--threads 1,2`, `--req 4,64`, `--line 4,64`,
//! `--persistence on,off`, `--flush-every N`, `--lazy-flush on|off` (default: the engine's),
//! `--json PATH` (default target/tmp/engine-bench.json). Load times are the `load` bench
//! (benches/load.rs).
//! Other words filter cases by label (every word must occur), e.g. `t=1 persistent`.

use hybridcache_engine::bench::{self, EngineBenchOptions, Test};

fn list<T: std::str::FromStr>(arg: &str, what: &str) -> Vec<T> {
    arg.split(',')
        .map(|v| {
            v.trim()
                .parse()
                .unwrap_or_else(|_| usage(&format!("bad {what} '{v}'")))
        })
        .collect()
}

fn usage(why: &str) -> ! {
    eprintln!("engine bench: {why}\nsee the header of crates/engine/benches/engine.rs for options");
    std::process::exit(2)
}

fn main() {
    let mut opts = EngineBenchOptions::default();
    // cargo runs benches in the package directory; the target dir is where people look.
    let mut json = format!("{}/engine-bench.json", env!("CARGO_TARGET_TMPDIR"));
    let mut tests = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || {
            args.next()
                .unwrap_or_else(|| usage(&format!("{a} needs a value")))
        };
        match a.as_str() {
            // cargo bench passes --bench.
            "--bench" => {}
            "--quick" => {
                opts = EngineBenchOptions {
                    tests: opts.tests,
                    filter: opts.filter,
                    lazy_flush: opts.lazy_flush,
                    ..EngineBenchOptions::quick()
                }
            }
            "--reps" => opts.reps = list::<usize>(&value(), "repetitions")[0],
            "--cache-mib" => opts.cache_bytes = list::<u64>(&value(), "size")[0] << 20,
            "--test" => {
                let v = value();
                tests.push(Test::from_name(&v).unwrap_or_else(|| usage(&format!("no test '{v}'"))))
            }
            "--threads" => opts.threads = list(&value(), "thread count"),
            "--req" => opts.request_kib = list(&value(), "request size"),
            "--line" => opts.line_kib = list(&value(), "line size"),
            "--persistence" => {
                opts.persistence = value()
                    .split(',')
                    .map(|v| match v {
                        "on" => true,
                        "off" => false,
                        _ => usage(&format!("persistence is on or off, not '{v}'")),
                    })
                    .collect()
            }
            "--lazy-flush" => {
                let v = value();
                let on = hybridcache_engine::policy::parse_on_off("--lazy-flush", &v);
                opts.lazy_flush = Some(on.unwrap_or_else(|e| usage(&e)));
            }
            "--flush-every" => opts.flush_every = list::<u64>(&value(), "count")[0],
            "--json" => json = value(),
            "--all" => opts.all_combinations = true,
            f if f.starts_with("--") => usage(&format!("unknown option {f}")),
            f => opts.filter.push(f.to_string()),
        }
    }
    opts.tests = tests;
    if opts.cases().is_empty() {
        usage("no case matches");
    }
    let report = bench::run(&opts, &mut |line| eprintln!("{line}")).expect("engine bench");
    print!("{}", report.table());
    match std::fs::write(&json, report.to_json()) {
        Ok(()) => println!("JSON: {json}"),
        Err(e) => eprintln!("could not write {json}: {e}"),
    }
}

//! `hybridcache bench engine`: the engine alone, as perf.md §1 defines it (a RAM cache volume, a
//! null core, write-back, cleaning nop, seq cutoff never), against Open CAS's engine marks.
//! The benchmark itself is `hybridcache_engine::bench`, shared with `cargo bench`.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use hybridcache_engine::bench::{self, EngineBenchOptions, Test};

#[derive(Debug, Clone, Args)]
pub struct EngineArgs {
    /// A 256 MiB cache and 3 repetitions: seconds instead of minutes, lower confidence.
    #[arg(long)]
    pub quick: bool,
    /// Repetitions of every case (interleaved; medians are reported) [default: 7, quick 3].
    #[arg(long, value_name = "N")]
    pub reps: Option<usize>,
    /// Cache volume size in MiB [default: 4096, quick 256].
    #[arg(long, value_name = "MIB")]
    pub cache_mib: Option<u64>,
    /// Tests: seqwrite, randwrite, randwrite_hit, randread_hit, seqread_hit, flush [default: all].
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub test: Vec<String>,
    /// Thread counts [default: 1,2].
    #[arg(long, value_delimiter = ',', value_name = "LIST")]
    pub threads: Option<Vec<usize>>,
    /// Persistence: on, off or both [default: on,off].
    #[arg(long, value_delimiter = ',', value_name = "on|off")]
    pub persistence: Option<Vec<String>>,
    /// Every combination of the lists, not only the standard cases (about half an hour).
    #[arg(long)]
    pub all: bool,
    /// Also write every figure as JSON to FILE.
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// Keep only cases whose label contains every one of these words (e.g. `t=1 persistent`).
    pub filter: Vec<String>,
}

pub fn run(a: &EngineArgs) -> Result<()> {
    let mut opts = if a.quick {
        EngineBenchOptions::quick()
    } else {
        EngineBenchOptions::default()
    };
    if let Some(r) = a.reps {
        if r == 0 {
            bail!("--reps must be at least 1");
        }
        opts.reps = r;
    }
    if let Some(m) = a.cache_mib {
        if m < 16 {
            bail!("--cache-mib must be at least 16");
        }
        opts.cache_bytes = m << 20;
    }
    for t in &a.test {
        opts.tests.push(Test::from_name(t).with_context(|| {
            format!("unknown test '{t}' (seqwrite, randwrite, randwrite_hit, randread_hit, seqread_hit, flush)")
        })?);
    }
    if let Some(t) = &a.threads {
        if t.is_empty() || t.iter().any(|&n| n == 0 || n > 64) {
            bail!("--threads takes counts from 1 to 64");
        }
        opts.threads = t.clone();
    }
    if let Some(p) = &a.persistence {
        opts.persistence = p
            .iter()
            .map(|v| match v.as_str() {
                "on" => Ok(true),
                "off" => Ok(false),
                other => bail!("--persistence: '{other}' is not on or off"),
            })
            .collect::<Result<_>>()?;
    }
    opts.all_combinations = a.all;
    opts.filter = a.filter.clone();
    if opts.cases().is_empty() {
        bail!("no case matches these options");
    }
    let report =
        bench::run(&opts, &mut |line| eprintln!("{line}")).map_err(|e| anyhow::anyhow!("{e}"))?;
    print!("{}", report.table());
    if let Some(path) = &a.json {
        std::fs::write(path, report.to_json())
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("figures written to {}", path.display());
    }
    Ok(())
}

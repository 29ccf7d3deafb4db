//! `hybridcache bench engine`: the engine alone, as perf.md §1 defines it (a RAM cache volume, a
//! null core, write-back, cleaning nop, seq cutoff never), against Open CAS's engine marks.
//! The benchmark itself is `hybridcache_engine::bench`, shared with `cargo bench`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use hybridcache_daemon::metrics::{self, CacheView, CoreView};
use hybridcache_engine::bench::{self, EngineBenchOptions, Test};
use hybridcache_engine::Cache;

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
    /// During every case, render the daemon's /metrics body for the bench's cache at once and
    /// then every MS milliseconds, as a Prometheus scraper makes the daemon do (to measure what
    /// a scraper costs the request path).
    #[arg(long, value_name = "MS")]
    pub scrape_every_ms: Option<u64>,
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
    let scrapes = Arc::new(AtomicU64::new(0));
    let every = match a.scrape_every_ms {
        Some(0) => bail!("--scrape-every-ms must be at least 1"),
        Some(ms) => Some(Duration::from_millis(ms)),
        None => None,
    };
    let start_scraper = |cache: &Cache| -> Box<dyn std::any::Any> {
        match every {
            Some(every) => Box::new(Scraper::start(cache, every, scrapes.clone())),
            None => Box::new(()),
        }
    };
    let report = bench::run_with(
        &opts,
        &mut |line| eprintln!("{line}"),
        every.is_some().then_some(&start_scraper as bench::Beside),
    )
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    print!("{}", report.table());
    if let Some(every) = every {
        println!(
            "metrics scraped every {} ms during the timed parts: {} scrapes",
            every.as_millis(),
            scrapes.load(Ordering::Relaxed)
        );
    }
    if let Some(path) = &a.json {
        std::fs::write(path, report.to_json())
            .with_context(|| format!("writing {}", path.display()))?;
        eprintln!("figures written to {}", path.display());
    }
    Ok(())
}

/// A thread that renders the metrics of one cache as the daemon's endpoint does, until dropped.
struct Scraper {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<JoinHandle<()>>,
}

impl Scraper {
    fn start(cache: &Cache, every: Duration, scrapes: Arc<AtomicU64>) -> Scraper {
        let cache = cache.clone();
        let source: metrics::Source = Arc::new(move || {
            vec![CacheView {
                id: 1,
                device: "ram-cache".into(),
                status: "Running".into(),
                cores: cache
                    .cores()
                    .iter()
                    .map(|c| CoreView {
                        id: c.id,
                        device: c.name.clone(),
                        active: true,
                        clients: 1,
                    })
                    .collect(),
                cache: cache.clone(),
            }]
        });
        let (stop, stopped) = mpsc::channel::<()>();
        let thread = std::thread::spawn(move || loop {
            std::hint::black_box(metrics::render(&source).ok());
            scrapes.fetch_add(1, Ordering::Relaxed);
            // The sender goes when the scraper is dropped: that ends the wait at once.
            if stopped.recv_timeout(every) != Err(mpsc::RecvTimeoutError::Timeout) {
                return;
            }
        });
        Scraper {
            stop: Some(stop),
            thread: Some(thread),
        }
    }
}

impl Drop for Scraper {
    fn drop(&mut self) {
        drop(self.stop.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

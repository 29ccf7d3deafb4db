//! What casadm's hidden script commands print (`--script --check-cache-device`,
//! `--script --purge-cache`, `--script --purge-core`), and casctl's `stop`.

use std::path::Path;

use anyhow::{anyhow, Result};

use crate::protocol::{self, CacheList, Request};

/// `--script --check-cache-device`, as casadm prints it in every format (cas_lib.c,
/// `check_cache_device`: RAW_CSV, `no,-,-` for a device without a cache).
pub fn cache_device_check(c: &protocol::CacheDeviceCheck) -> String {
    let yes_no = |b: bool| if b { "yes" } else { "no" };
    let row = match (c.is_cache, c.clean_shutdown) {
        (true, Some(clean)) => format!("yes,{},{}", yes_no(clean), yes_no(c.dirty_lines > 0)),
        _ => "no,-,-".to_string(),
    };
    format!("Is cache,Clean Shutdown,Cache dirty\n{row}\n")
}

/// What a purge did, in lines.
pub fn purged(p: &protocol::Purged) -> String {
    format!(
        "{} dirty lines flushed, {} lines invalidated",
        hybridcache_daemon::safety::count_text(p.flushed_lines),
        hybridcache_daemon::safety::count_text(p.invalidated_lines)
    )
}

#[derive(Debug, Clone, clap::Args)]
pub struct CasctlArgs {
    #[command(subcommand)]
    pub cmd: CasctlCmd,
}

#[derive(Debug, Clone, clap::Subcommand)]
pub enum CasctlCmd {
    /// Stop every cache as casctl stop does: without --flush the dirty data stays on the cache
    /// devices (as stop-cache -n), where the next start loads it; with --flush it is written
    /// to the cores first. The daemon keeps running. A cache that cannot be stopped (clients
    /// connected, a RAM cache without --flush) is named and the others are still stopped.
    Stop {
        /// Flush dirty data to the cores before stopping.
        #[arg(long)]
        flush: bool,
    },
    /// Load every cache of the configuration file (opencas.conf as Open CAS has it, or a
    /// hybridcache TOML file) from its device, as casctl start does: never a new cache; a
    /// device without one is reported, a missing device waited for. Running caches are left.
    Start {
        /// The configuration file; read by the daemon.
        #[arg(long, value_name = "FILE", default_value = "/etc/opencas/opencas.conf")]
        config: std::path::PathBuf,
    },
    /// Wait until every cache and core of the configuration file runs, as casctl settle does:
    /// up to --timeout, looking every --interval; fails when a device not marked lazy
    /// (`lazy_startup = false`, opencas.conf's default) is still not running. A missing file
    /// is not a failure (casctl does not fail the boot for it).
    Settle {
        /// The configuration file whose caches and cores to wait for.
        #[arg(long, value_name = "FILE", default_value = "/etc/opencas/opencas.conf")]
        config: std::path::PathBuf,
        /// How long to wait, seconds.
        #[arg(long, default_value_t = 270)]
        timeout: u64,
        /// How often to look, seconds.
        #[arg(long, default_value_t = 5)]
        interval: u64,
    },
}

type Call = fn(&Path, &Request) -> Result<serde_json::Value>;

/// casctl's `stop` (utils/casctl, utils/opencas.py `stop`): its cores are detached with or
/// without flush, then every cache stopped with `--no-data-flush`; the outcome is the same as
/// stopping each cache with or without its flush.
pub fn casctl(args: &CasctlArgs, control: &Path, call: Call) -> Result<()> {
    let flush = match &args.cmd {
        CasctlCmd::Stop { flush } => *flush,
        CasctlCmd::Start { config } => return casctl_start(config, control, call),
        CasctlCmd::Settle {
            config,
            timeout,
            interval,
        } => return casctl_settle(config, *timeout, *interval, control, call),
    };
    let list: CacheList = serde_json::from_value(call(control, &Request::List)?)
        .map_err(|e| anyhow!("the daemon's list is not what this CLI expects ({e})"))?;
    let mut failed = Vec::new();
    for cache in &list.caches {
        let req = Request::StopCache {
            id: cache.id,
            no_data_flush: !flush,
            force: false,
            disconnect_clients: false,
        };
        match call(control, &req) {
            Ok(_) => println!(
                "cache {} stopped{}",
                cache.id,
                if flush {
                    ", its dirty data flushed"
                } else {
                    ", its dirty data kept on its device for the next start"
                }
            ),
            Err(e) => failed.push(format!("cache {} ({}): {e:#}", cache.id, cache.device)),
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(anyhow!("unable to stop {}", failed.join("; ")))
    }
}

/// casctl's `start` (utils/casctl `start`): the daemon loads each cache of the file; one that
/// cannot be loaded is reported as casctl reports it ("Unable to load cache ..."), and the
/// command fails when any could not.
fn casctl_start(config: &Path, control: &Path, call: Call) -> Result<()> {
    let config = std::path::absolute(config)
        .map_err(|e| anyhow!("{}: {e}", config.display()))?
        .to_string_lossy()
        .into_owned();
    let v = call(control, &Request::CasctlStart { config })?;
    let mut failed = Vec::new();
    for id in v["running"].as_array().into_iter().flatten() {
        println!("cache {id} is running already: left as it is");
    }
    for c in v["caches"].as_array().into_iter().flatten() {
        let (id, device) = (&c["id"], c["device"].as_str().unwrap_or_default());
        if c["loaded"].as_bool() == Some(true) {
            println!("cache {id} loaded from {device}");
        } else {
            failed.push(format!(
                "Unable to load cache {id} ({device}): {}",
                c["why"].as_str().unwrap_or_default()
            ));
        }
    }
    if failed.is_empty() {
        Ok(())
    } else {
        // The daemon keeps each one waiting (`-L`): a missing device is taken when it appears.
        Err(anyhow!("{}", failed.join("; ")))
    }
}

/// casctl's `settle` (utils/opencas.py `wait_for_startup`): the daemon attaches devices as they
/// appear (its device watcher), so this only waits and reports.
fn casctl_settle(
    config: &Path,
    timeout: u64,
    interval: u64,
    control: &Path,
    call: Call,
) -> Result<()> {
    let cfg = match hybridcache_daemon::config::ConfigFile::load(config) {
        Ok(cfg) => cfg,
        Err(e) => {
            eprintln!("{e:#}");
            return Ok(());
        }
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(timeout);
    loop {
        let list: CacheList = serde_json::from_value(call(control, &Request::List)?)
            .map_err(|e| anyhow!("the daemon's list is not what this CLI expects ({e})"))?;
        let cache_runs = |id: u16| {
            list.caches
                .iter()
                .any(|c| c.id == id && (c.status == "Running" || c.status == "Incomplete"))
        };
        let core_runs = |cache: u16, id: u16| {
            list.caches.iter().any(|c| {
                c.id == cache
                    && c.cores.iter().any(|k| {
                        k.id == id && k.status != "Inactive" && !k.status.starts_with("Waiting")
                    })
            })
        };
        // (device, lazy) of each not running.
        let mut not_running: Vec<(&str, bool)> = cfg
            .caches
            .iter()
            .filter(|c| !cache_runs(c.id))
            .map(|c| (c.device.as_str(), c.lazy_startup != Some(false)))
            .collect();
        not_running.extend(
            cfg.cores
                .iter()
                .filter(|k| !core_runs(k.cache, k.id))
                .map(|k| (k.device.as_str(), k.lazy_startup != Some(false))),
        );
        let waiting = not_running.iter().any(|(_, lazy)| !lazy);
        if !waiting || std::time::Instant::now() >= deadline {
            if waiting {
                let devices: Vec<&str> = not_running.iter().map(|(d, _)| *d).collect();
                return Err(anyhow!(
                    "initialization failed: couldn't initialize {} in {timeout} s (a device not marked lazy must run: lazy_startup = false)",
                    devices.join(", ")
                ));
            }
            for (device, _) in &not_running {
                eprintln!("Couldn't initialize device {device} (lazy: not waited for)");
            }
            return Ok(());
        }
        std::thread::sleep(std::time::Duration::from_secs(interval.max(1)));
    }
}

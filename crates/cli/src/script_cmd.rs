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
}

type Call = fn(&Path, &Request) -> Result<serde_json::Value>;

/// casctl's `stop` (utils/casctl, utils/opencas.py `stop`): its cores are detached with or
/// without flush, then every cache stopped with `--no-data-flush`; the outcome is the same as
/// stopping each cache with or without its flush.
pub fn casctl(args: &CasctlArgs, control: &Path, call: Call) -> Result<()> {
    let flush = match &args.cmd {
        CasctlCmd::Stop { flush } => *flush,
        CasctlCmd::Start { config } => return casctl_start(config, control, call),
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

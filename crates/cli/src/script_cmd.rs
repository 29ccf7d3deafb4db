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
}

type Call = fn(&Path, &Request) -> Result<serde_json::Value>;

/// casctl's `stop` (utils/casctl, utils/opencas.py `stop`): its cores are detached with or
/// without flush, then every cache stopped with `--no-data-flush`; the outcome is the same as
/// stopping each cache with or without its flush.
pub fn casctl(args: &CasctlArgs, control: &Path, call: Call) -> Result<()> {
    let CasctlCmd::Stop { flush } = args.cmd;
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

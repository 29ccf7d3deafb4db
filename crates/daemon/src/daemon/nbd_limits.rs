//! The NBD server's limits: the command line over the configuration file's `[daemon]` keys
//! over the server's defaults, each checked, and the memory limit checked against what the
//! connections alone need.

use std::time::Duration;

use anyhow::{anyhow, bail, Result};
use hybridcache_nbd::ServerConfig;

use crate::config::DaemonSection;

/// NBD server limits as the command line gives them (`--nbd-max-connections` ...); None
/// leaves the `[daemon]` key of the configuration file, or else the server's default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NbdLimits {
    pub max_connections: Option<usize>,
    pub max_connections_per_client: Option<usize>,
    pub max_connections_per_user: Option<usize>,
    pub max_connections_per_export: Option<usize>,
    /// Seconds.
    pub handshake_timeout: Option<u64>,
    /// Seconds; 0 never drops a stalled client.
    pub stall_timeout: Option<u64>,
    /// Bytes.
    pub memory_limit: Option<u64>,
}

/// The NBD server's configuration: command line over file over defaults, each limit checked.
pub fn nbd_server_config(
    workers: usize,
    cli: &NbdLimits,
    file: &DaemonSection,
) -> Result<ServerConfig> {
    let d = ServerConfig::default();
    let count = |name: &str, cli: Option<usize>, file: Option<usize>, default: usize| {
        let n = cli.or(file).unwrap_or(default);
        if n == 0 {
            bail!("{name} must be at least 1");
        }
        Ok(n)
    };
    let max_connections_set = cli.max_connections.or(file.nbd_max_connections).is_some();
    let mut max_connections = count(
        "nbd max connections",
        cli.max_connections,
        file.nbd_max_connections,
        d.max_connections,
    )?;
    let per_client = count(
        "nbd max connections per client",
        cli.max_connections_per_client,
        file.nbd_max_connections_per_client,
        d.max_connections_per_client,
    )?;
    let per_user = count(
        "nbd max connections per user",
        cli.max_connections_per_user,
        file.nbd_max_connections_per_user,
        d.max_connections_per_user,
    )?;
    let per_export = count(
        "nbd max connections per export",
        cli.max_connections_per_export,
        file.nbd_max_connections_per_export,
        d.max_connections_per_export,
    )?;
    let handshake = match cli.handshake_timeout.or(file.nbd_handshake_timeout) {
        Some(0) => bail!("nbd handshake timeout must be at least 1 second"),
        Some(s) => Some(Duration::from_secs(s)),
        None => d.handshake_timeout,
    };
    let stall = match cli.stall_timeout.or(file.nbd_stall_timeout) {
        Some(0) => None,
        Some(s) => Some(Duration::from_secs(s)),
        None => d.stall_timeout,
    };
    let memory_limit = match (cli.memory_limit, &file.nbd_memory_limit) {
        (Some(b), _) => b,
        (None, Some(text)) => {
            hybridcache_volume::parse_size(text).map_err(|e| anyhow!("nbd_memory_limit: {e}"))?
        }
        (None, None) => d.memory_limit,
    };
    let mut cfg = ServerConfig {
        workers_per_connection: workers,
        max_connections,
        max_connections_per_client: per_client,
        max_connections_per_user: per_user,
        max_connections_per_export: per_export,
        handshake_timeout: handshake,
        stall_timeout: stall,
        memory_limit,
        ..d
    };
    // The bound must leave room for at least a few in-flight requests beside what every
    // connection holds on its own; otherwise the server would exceed it by design. Many
    // workers per connection make connections dearer: unless the connection count was set
    // explicitly, it shrinks to what the limit holds.
    let per_conn = cfg.connection_overhead();
    let room = memory_limit.saturating_sub(48 << 20);
    if !max_connections_set && (max_connections as u64) * per_conn > room {
        let fits = (room / per_conn) as usize;
        if fits >= 16 {
            tracing::warn!(
                "NBD: {max_connections} connections of {workers} workers do not fit in the \
                 memory limit of {} MiB; serving at most {fits} (set nbd_max_connections or \
                 nbd_memory_limit to choose)",
                memory_limit >> 20
            );
            max_connections = fits;
            cfg.max_connections = fits;
        }
    }
    let fixed = max_connections as u64 * per_conn;
    if memory_limit < fixed + (32 << 20) {
        bail!(
            "nbd memory limit {} MiB is too small for {max_connections} connections \
             ({} MiB for the connections alone, plus 32 MiB): raise it or lower max connections",
            memory_limit >> 20,
            fixed >> 20
        );
    }
    Ok(cfg)
}

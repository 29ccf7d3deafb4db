//! The daemon's configuration file (TOML): daemon options, caches, cores and their parameters.
//!
//! ```toml
//! [daemon]
//! control = "/run/hybridcache/control.sock"
//! nbd_socket = "/run/hybridcache/nbd.sock"
//! nbd_listen = "127.0.0.1:10809"   # optional; TCP is off without it
//! nbd_workers = 16                 # requests in flight per NBD connection
//! save_config = true               # accepted, ignored: the daemon never writes this file
//! metrics_listen = "127.0.0.1:9563" # optional; Prometheus metrics at /metrics
//! cleaning_stall_warn = 30         # seconds of due cleaning without progress before a WARN
//! core_flush_timeout = 30          # seconds a hung core may hold up its flush
//! nbd_max_connections = 256        # NBD limits (docs/cli.md, "Limits")
//! nbd_max_connections_per_client = 64
//! nbd_max_connections_per_export = 192
//! nbd_handshake_timeout = 10       # seconds
//! nbd_stall_timeout = 60           # seconds, 0 = never
//! nbd_memory_limit = "512M"
//! frontend = "nbd"                 # or "ublk": cores without a front-end of their own
//! state_dir = "/var/lib/hybridcache" # the daemon's run-time state (state.rs); this is the default
//! device_timeout = 90              # seconds to wait at start for devices that are not lazy
//!
//! [[cache]]
//! id = 1
//! device = "/dev/nvme0n1p1"
//! line_size = 4                    # KiB
//! mode = "wb"
//! ioclass_file = "/etc/hybridcache/ioclass-config.csv" # optional; Open CAS IO class file
//! ioclass_ignore_unsupported = false # load its file-system rules as never true
//! lazy_startup = false             # readiness waits for this device (default true: it does not)
//! [cache.params]                   # policy fields, "GROUP.FIELD" = "VALUE" (docs/policies.md)
//!
//! [[core]]
//! cache = 1
//! id = 1
//! device = "/dev/sdb"
//! frontend = "ublk"                # optional: served as /dev/ublkbN instead of over NBD
//! ```
//!
//! Unknown keys are errors, so a typo never silently changes nothing. The file is the
//! operator's: the daemon reads it and never writes it; what changes at run time is kept in
//! the state directory (state.rs), and `hybridcache config export` writes the running setup
//! where the operator says.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    #[serde(default)]
    pub daemon: DaemonSection,
    #[serde(default, rename = "cache", skip_serializing_if = "Vec::is_empty")]
    pub caches: Vec<CacheSection>,
    #[serde(default, rename = "core", skip_serializing_if = "Vec::is_empty")]
    pub cores: Vec<CoreSection>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DaemonSection {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub control: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_socket: Option<PathBuf>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_listen: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_workers: Option<usize>,
    /// Queues of each ublk device; absent: one per CPU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ublk_queues: Option<u16>,
    /// Accepted so that an older file still loads; the file is never written (a WARN says so).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub save_config: Option<bool>,
    /// Prometheus metrics endpoint, `PORT` (loopback) or `ADDRESS:PORT`; off when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub metrics_listen: Option<String>,
    /// Seconds of due cleaning without progress before the log reports a stall (default 30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cleaning_stall_warn: Option<u64>,
    /// Seconds a hung core may hold up its flush before it is reported timed out (default 30).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub core_flush_timeout: Option<u64>,
    /// NBD limits; absent keys keep the server's defaults (docs/cli.md, "Limits").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_max_connections: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_max_connections_per_client: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_max_connections_per_user: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_max_connections_per_export: Option<usize>,
    /// Seconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_handshake_timeout: Option<u64>,
    /// Seconds; 0 never drops a stalled client.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_stall_timeout: Option<u64>,
    /// A size such as "512M" or a number of bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nbd_memory_limit: Option<String>,
    /// The front-end a core gets when none is named: "nbd" (the default) or "ublk".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frontend: Option<String>,
    /// The daemon's state directory (state.rs): the run-time setup, front-ends, ublk devices;
    /// default /var/lib/hybridcache.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state_dir: Option<PathBuf>,
    /// Seconds the daemon waits at start for the devices marked `lazy_startup = false` before
    /// it gives up and exits (default 90, systemd's device timeout).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_timeout: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheSection {
    pub id: u16,
    pub device: String,
    /// Cache line size in KiB (4, 8, 16, 32, 64); default 4.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub line_size: Option<u32>,
    /// Cache mode; default wt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode: Option<String>,
    /// Further parameters by their `get-param` names, applied after the cache starts.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub params: BTreeMap<String, String>,
    /// An Open CAS IO class file (opencas.conf's `ioclass_file`), loaded when the cache starts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ioclass_file: Option<PathBuf>,
    /// Load `ioclass_file` with file-system rules never true (`--ignore-unsupported`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ioclass_ignore_unsupported: Option<bool>,
    /// opencas.conf's `lazy_startup`: false makes the daemon's readiness wait for the device
    /// and the cache running on it; absent or true: not waited for (the device is waited for
    /// in the background).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lazy_startup: Option<bool>,
    /// The mirror of the cache's dirty data and metadata (`-S --mirror`; docs/format.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror: Option<String>,
    /// What the cache does when its mirror is lost: `drain` (default) or `keep`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror_lost: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CoreSection {
    pub cache: u16,
    pub id: u16,
    pub device: String,
    /// "nbd" or "ublk"; absent: the daemon's default front-end.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub frontend: Option<String>,
    /// As [`CacheSection::lazy_startup`], for the core (and so its cache's device too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lazy_startup: Option<bool>,
}

impl ConfigFile {
    pub fn load(path: &Path) -> Result<ConfigFile> {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read configuration file {}", path.display()))?;
        if crate::opencas_conf::looks_like_opencas(&text) {
            return Self::load_opencas(&text, path);
        }
        Self::parse(&text).with_context(|| format!("configuration file {}", path.display()))
    }

    /// casctl's file, read as it is: what it names starts as `hybridcache config import` would
    /// write it, and what cannot be carried over is logged at WARN with its line.
    fn load_opencas(text: &str, path: &Path) -> Result<ConfigFile> {
        let conf = crate::opencas_conf::OpenCasConf::parse(text)
            .with_context(|| format!("opencas.conf file {}", path.display()))?;
        tracing::info!(
            "{}: read as Open CAS's opencas.conf (version={}): {} caches, {} cores",
            path.display(),
            conf.version,
            conf.caches.len(),
            conf.cores.len()
        );
        for note in conf.notes() {
            tracing::warn!("{}: {note}", path.display());
        }
        Ok(conf.config())
    }

    pub fn parse(text: &str) -> Result<ConfigFile> {
        // toml's messages span several lines (a source excerpt); the first says what is wrong.
        toml::from_str(text).map_err(|e| {
            let msg = e.to_string();
            let first = msg.lines().next().unwrap_or("").trim();
            match e.span() {
                Some(span) => {
                    let line = text[..span.start.min(text.len())].matches('\n').count() + 1;
                    anyhow::anyhow!("line {line}: {}", e.message().trim())
                }
                None => anyhow::anyhow!("{first}"),
            }
        })
    }

    pub fn to_toml(&self) -> Result<String> {
        Ok(toml::to_string_pretty(self)?)
    }
}

/// Read and parse a cache's `ioclass_file`; a refused file is named with its line and column.
pub fn load_ioclass_file(
    c: &CacheSection,
) -> Option<std::result::Result<hybridcache_engine::ioclass::IoClasses, String>> {
    let path = c.ioclass_file.as_ref()?;
    let opts = hybridcache_engine::ioclass::LoadOptions {
        ignore_unsupported: c.ioclass_ignore_unsupported.unwrap_or(false),
    };
    Some(
        std::fs::read_to_string(path)
            .map_err(|e| format!("ioclass_file {}: {e}", path.display()))
            .and_then(|text| {
                hybridcache_engine::ioclass::IoClasses::parse(&text, &opts)
                    .map_err(|e| format!("ioclass_file {}: {e}", path.display()))
            }),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_example() {
        let text = r#"
[daemon]
control = "/tmp/c.sock"
nbd_listen = "127.0.0.1:10809"
save_config = true

[[cache]]
id = 1
device = "ram:64M"
line_size = 8
mode = "wb"

[[core]]
cache = 1
id = 1
device = "null:1G"
"#;
        let c = ConfigFile::parse(text).unwrap();
        assert_eq!(c.caches.len(), 1);
        assert_eq!(c.caches[0].line_size, Some(8));
        assert_eq!(c.cores[0].device, "null:1G");
        assert_eq!(c.daemon.save_config, Some(true));
        let again = ConfigFile::parse(&c.to_toml().unwrap()).unwrap();
        assert_eq!(again, c);
    }

    #[test]
    fn unknown_keys_are_errors_with_a_line() {
        let e = ConfigFile::parse("[[cache]]\nid = 1\ndevice = \"x\"\nmdoe = \"wb\"\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 4") && e.contains("mdoe"), "{e}");
        assert!(!e.contains('\n'));
    }
}

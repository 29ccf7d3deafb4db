//! The hybridcache daemon, front-end agnostic: it owns every cache, keeps the registry of
//! exported volumes, answers management requests on the control socket, reads the
//! configuration file (never writes it) and keeps its run-time setup in its state directory
//! ([`state`]), opens the devices users name, and records block traces.
//!
//! Boundaries: the caching itself is the engine's (`hybridcache-engine`); devices come from
//! `hybridcache-volume`; front-ends ([`frontend`]) serve the exports: NBD (`hybridcache-nbd`)
//! and ublk block devices (`hybridcache-ublk`, [`ublk_export`]). The command
//! line, output formats, the bench runner and the analyzer glue are the CLI's (`crates/cli`),
//! which talks to the daemon only through [`protocol`] over the control socket.

pub mod claims;
pub mod config;
pub mod daemon;
pub mod devices;
pub mod export;
pub mod frontend;
pub mod log;
pub mod metrics;
pub mod nbd_volume;
pub mod notify;
pub mod opencas_conf;
pub mod params;
pub mod protocol;
pub mod safety;
pub mod signature;
pub mod state;
pub mod target;
pub mod trace;
pub mod ublk_export;

pub use daemon::{run, DaemonOptions, DEFAULT_CONTROL, DEFAULT_NBD_SOCKET};

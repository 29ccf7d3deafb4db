//! `hybridcache serve`: export one device over NBD with no cache in front of it (a *bare core*).
//!
//! Why: a benchmark comparing "the core alone", "hybridcache in front of the core" and "nbdkit's
//! cache filter in front of the core" is only fair when all three see the very same core. With an
//! emulated device (`raid:`, `hdd:`, `throttle:`) the core lives inside a process, so this command
//! puts it in one process of its own and serves it on a Unix socket: fio connects to it directly,
//! a daemon adds it as a remote NBD core (`nbd+unix:///NAME?socket=PATH`), and nbdkit's `nbd`
//! plugin connects to it behind its cache filter.
//!
//! It runs in the foreground until SIGTERM or SIGINT, like the daemon (signals are blocked and
//! taken with `sigwait`, so no handler runs in an arbitrary thread), then closes the connections
//! after in-flight requests finish, flushes the device and removes the socket.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use hybridcache_nbd::{
    BlockSizes, Capabilities, Export, ExportError, ExportRegistry, ExportResult, Server,
    ServerConfig, ZeroFlags,
};
use hybridcache_volume::{VolumeError, VolumeRef};

use crate::devices::open_device;

/// Largest request the bare export takes in one piece (the NBD server's default maximum).
const MAX_REQUEST: u32 = 32 << 20;

#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Device to export: any device spec (a path, ram:SIZE, null:SIZE, throttle:, hdd:, raid:,
    /// an NBD URI).
    #[arg(long, value_name = "SPEC")]
    pub core: String,
    /// NBD Unix socket to serve on (created; a stale one is replaced).
    #[arg(long, value_name = "PATH")]
    pub socket: PathBuf,
    /// Export name.
    #[arg(long, default_value = "core")]
    pub name: String,
    /// Requests executed in parallel per NBD connection: the queue depth a slow core can see
    /// through one connection.
    #[arg(long, default_value_t = 32, value_name = "N", value_parser = crate::cli::whole::<usize>)]
    pub workers: usize,
}

/// A volume served as is: every NBD request becomes one volume call.
pub struct VolumeExport {
    vol: VolumeRef,
}

impl VolumeExport {
    pub fn new(vol: VolumeRef) -> VolumeExport {
        VolumeExport { vol }
    }
}

fn to_export_error(e: VolumeError) -> ExportError {
    ExportError::new(crate::export::volume_error_kind(&e), e.to_string())
}

impl Export for VolumeExport {
    fn size(&self) -> u64 {
        self.vol.size()
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> ExportResult<()> {
        self.vol.read_at(buf, offset).map_err(to_export_error)
    }

    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> ExportResult<()> {
        self.vol.write_at(buf, offset).map_err(to_export_error)?;
        if fua {
            // Volumes have no FUA of their own; a flush after the write gives the same promise.
            self.vol.flush().map_err(to_export_error)?;
        }
        Ok(())
    }

    fn flush(&self) -> ExportResult<()> {
        self.vol.flush().map_err(to_export_error)
    }

    fn trim(&self, offset: u64, len: u64) -> ExportResult<()> {
        self.vol.discard(offset, len).map_err(to_export_error)
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> ExportResult<()> {
        if flags.fast_zero {
            return Err(ExportError::not_fast());
        }
        self.vol.write_zeroes(offset, len).map_err(to_export_error)
    }

    fn block_sizes(&self) -> BlockSizes {
        let min = self.vol.logical_block_size().max(512);
        BlockSizes {
            min,
            preferred: min.max(4096),
            max: MAX_REQUEST,
        }
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read_only: false,
            can_flush: true,
            can_fua: true,
            can_trim: true,
            can_write_zeroes: true,
            can_fast_zero: false,
            can_cache: false,
            // A flush flushes the whole volume, which covers writes completed on any connection.
            can_multi_conn: true,
            // The device served as it is: a disk says so, and the client's kernel treats it
            // as one (a cache's export is never rotational; see the daemon's export).
            rotational: self.vol.rotational(),
        }
    }
}

/// Run `hybridcache serve` until SIGTERM/SIGINT.
pub fn run(args: &ServeArgs) -> Result<()> {
    if args.workers == 0 || args.workers > 256 {
        bail!("--workers must be between 1 and 256, not {}", args.workers);
    }
    if args.name.is_empty() || args.name.len() > 4096 {
        bail!("--name must be 1 to 4096 bytes long");
    }
    let signals = crate::daemon::block_signals();
    let vol = open_device(&args.core).map_err(|e| anyhow!("--core: {e}"))?;
    let size = vol.size();
    let description = vol.name().to_string();
    let registry = ExportRegistry::new();
    registry
        .add_with_description(
            &args.name,
            &description,
            Arc::new(VolumeExport::new(vol.clone())),
        )
        .map_err(|e| anyhow!("cannot export {}: {e}", args.name))?;
    // Clients that ask for the default export ("") get this one too (fio's URI without a name).
    registry.set_default(Some(&args.name));
    if let Some(dir) = args.socket.parent() {
        if !dir.as_os_str().is_empty() {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("cannot create directory {}", dir.display()))?;
        }
    }
    let server = Server::with_config(
        registry,
        ServerConfig {
            workers_per_connection: args.workers,
            ..ServerConfig::default()
        },
    );
    server
        .serve_unix(&args.socket)
        .with_context(|| format!("cannot serve NBD on {}", args.socket.display()))?;
    eprintln!(
        "hybridcache: serving {description} ({size} bytes, no cache) as nbd+unix:///{}?socket={} with {} workers per connection",
        args.name,
        args.socket.display(),
        args.workers
    );
    let sig = crate::daemon::wait_for_signal(&signals);
    eprintln!("hybridcache: signal {sig}: shutting down");
    server.shutdown();
    let flushed = vol.flush();
    let _ = std::fs::remove_file(&args.socket);
    flushed.map_err(|e| anyhow!("final flush failed: {e}"))?;
    eprintln!("hybridcache: stopped");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hybridcache_volume::open_volume;

    /// A client's kernel picks HDD or SSD behaviour from this flag (Ceph's BlueStore defers
    /// small writes only on a rotational device), so a served disk must say it is one.
    #[test]
    fn a_disk_is_served_as_rotational_and_memory_is_not() {
        let hdd = open_volume("hdd:size=64M,nodata").unwrap();
        assert!(VolumeExport::new(hdd).capabilities().rotational);
        let raid = open_volume("raid:preset=study60,disk_size=1G,nodata").unwrap();
        assert!(VolumeExport::new(raid).capabilities().rotational);
        let ram = open_volume("ram:1M").unwrap();
        assert!(!VolumeExport::new(ram).capabilities().rotational);
    }

    #[test]
    fn volume_export_reads_back_what_it_wrote() {
        let vol = open_volume("ram:1M").unwrap();
        let e = VolumeExport::new(vol);
        assert_eq!(e.size(), 1 << 20);
        e.write(&[7u8; 4096], 8192, true).unwrap();
        let mut buf = [0u8; 4096];
        e.read(&mut buf, 8192).unwrap();
        assert_eq!(buf, [7u8; 4096]);
        e.write_zeroes(8192, 4096, ZeroFlags::default()).unwrap();
        e.read(&mut buf, 8192).unwrap();
        assert_eq!(buf, [0u8; 4096]);
        assert!(e
            .write_zeroes(
                0,
                4096,
                ZeroFlags {
                    fast_zero: true,
                    ..Default::default()
                }
            )
            .is_err());
        assert_eq!(e.block_sizes().validate(), Ok(()));
    }

    #[test]
    fn out_of_range_is_invalid() {
        let e = VolumeExport::new(open_volume("ram:64K").unwrap());
        let err = e.write(&[0u8; 4096], 1 << 20, false).unwrap_err();
        assert_eq!(err.kind, hybridcache_nbd::ErrorKind::Invalid);
    }
}

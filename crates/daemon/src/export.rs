//! A core's exported volume as an NBD export.
//!
//! Everything the engine's `Core` does is advertised: flush, FUA (`Core::write_fua`), trim
//! (discard), write-zeroes, cache (prefetch) and multi-conn. Multi-conn is sound because a flush
//! on any connection flushes the cache volume and the core, which covers every write completed on
//! any connection. The preferred block size is the cache line size: smaller writes still work,
//! but a whole line is what the cache maps.

use std::sync::atomic::{AtomicU64, Ordering};

use hybridcache_engine::{EngineError, MAX_REQUEST, SECTOR};
use hybridcache_nbd::{
    BlockSizes, Capabilities, ErrorKind, Export, ExportError, ExportResult, ZeroFlags,
};

/// Prefetch reads this much at a time, so a large `NBD_CMD_CACHE` does not need a large buffer.
const PREFETCH_CHUNK: u64 = 1 << 20;

use crate::target::Target;

pub struct CoreExport {
    core: Target,
    line_size: u32,
    errors: ErrorLog,
}

impl CoreExport {
    pub fn new(core: Target, line_size: u32) -> CoreExport {
        CoreExport {
            core,
            line_size,
            errors: ErrorLog::default(),
        }
    }

    /// The NBD error for an engine error; device errors are logged (device, operation, offset,
    /// length), at most [`ERRORS_PER_SECOND`] a second per export so a dying disk cannot flood
    /// the log.
    fn error(&self, e: EngineError) -> ExportError {
        if let EngineError::Volume(v) = &e {
            self.errors.log(&self.core.export_name(), v);
        }
        to_export_error(e)
    }
}

/// Zeroes `len` bytes at `offset` in calls the engine accepts: it serves at most
/// [`MAX_REQUEST`] per call, and a client may ask for far more. Every front-end zeroes this way.
pub(crate) fn write_zeroes_chunked(
    core: &Target,
    offset: u64,
    len: u64,
) -> Result<(), EngineError> {
    let mut done = 0;
    while done < len {
        let n = (len - done).min(MAX_REQUEST);
        core.write_zeroes(offset + done, n)?;
        done += n;
    }
    Ok(())
}

const ERRORS_PER_SECOND: u64 = 10;

/// How a failed device request reads in the log, from the client path and from background work
/// alike, so one grep finds both.
pub(crate) fn device_failure(
    op: &dyn std::fmt::Display,
    device: &str,
    offset: u64,
    len: u64,
    why: &dyn std::fmt::Display,
) -> String {
    format!("{op} failed on {device} at offset {offset} length {len}: {why}")
}

#[derive(Default)]
pub(crate) struct ErrorLog {
    /// The second (since the epoch) the count is for, the count, and what was left out.
    second: AtomicU64,
    count: AtomicU64,
    suppressed: AtomicU64,
}

impl ErrorLog {
    pub(crate) fn log(&self, export: &str, v: &hybridcache_volume::VolumeError) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        if self.second.swap(now, Ordering::Relaxed) != now {
            self.count.store(0, Ordering::Relaxed);
            let left_out = self.suppressed.swap(0, Ordering::Relaxed);
            if left_out > 0 {
                tracing::warn!("{export}: {left_out} more device errors were not logged");
            }
        }
        if self.count.fetch_add(1, Ordering::Relaxed) < ERRORS_PER_SECOND {
            tracing::error!(
                "{export}: device error: {}",
                device_failure(&v.op, &v.device, v.offset, v.len, &v.kind)
            );
        } else {
            self.suppressed.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Whether the NBD reader hands buffered writes to the engine as batches
/// (`HYBRIDCACHE_NBD_WRITE_BATCH=1` in the daemon's environment). Off by default: measured on
/// this project's test machine, write hits at queue depth 32 ran slower batched on the reader
/// than one by one on the connection's workers (docs/performance.md §11).
fn write_batching() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("HYBRIDCACHE_NBD_WRITE_BATCH").is_ok_and(|v| v == "1"))
}

fn to_export_error(e: EngineError) -> ExportError {
    let kind = match &e {
        EngineError::Unaligned { .. }
        | EngineError::OutOfRange { .. }
        | EngineError::TooLarge { .. } => ErrorKind::Invalid,
        EngineError::Volume(v) => volume_error_kind(v),
        _ => ErrorKind::Io,
    };
    ExportError::new(kind, e.to_string())
}

/// The NBD error a volume error becomes: the OS error where there is one (so ENOSPC stays
/// ENOSPC), EINVAL for requests the volume refuses as malformed, EIO otherwise.
pub fn volume_error_kind(v: &hybridcache_volume::VolumeError) -> ErrorKind {
    match &v.kind {
        hybridcache_volume::ErrorKind::Io(io) => {
            let copy = match io.raw_os_error() {
                Some(errno) => std::io::Error::from_raw_os_error(errno),
                None => std::io::Error::from(io.kind()),
            };
            ExportError::from(copy).kind
        }
        hybridcache_volume::ErrorKind::Unaligned { .. }
        | hybridcache_volume::ErrorKind::OutOfRange { .. }
        | hybridcache_volume::ErrorKind::Invalid(_) => ErrorKind::Invalid,
        _ => ErrorKind::Io,
    }
}

impl Export for CoreExport {
    fn size(&self) -> u64 {
        self.core.size()
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> ExportResult<()> {
        self.core.read(buf, offset).map_err(|e| self.error(e))
    }

    fn read_batch(&self, reqs: &mut [(&mut [u8], u64)]) -> Vec<ExportResult<()>> {
        self.core
            .read_batch(reqs)
            .into_iter()
            .map(|r| r.map_err(|e| self.error(e)))
            .collect()
    }

    /// Cache hits in a batch are read from the cache device together (engine read_batch.rs).
    fn batches_reads(&self) -> bool {
        true
    }

    fn write_batch(&self, reqs: &[(&[u8], u64)]) -> Vec<ExportResult<()>> {
        self.core
            .write_batch(reqs)
            .into_iter()
            .map(|r| r.map_err(|e| self.error(e)))
            .collect()
    }

    /// Write-back hits in a batch are written to the cache device together (engine
    /// write_batch.rs), when `HYBRIDCACHE_NBD_WRITE_BATCH=1`.
    fn batches_writes(&self) -> bool {
        write_batching()
    }

    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> ExportResult<()> {
        if fua {
            self.core.write_fua(buf, offset)
        } else {
            self.core.write(buf, offset)
        }
        .map_err(|e| self.error(e))
    }

    fn flush(&self) -> ExportResult<()> {
        self.core.flush().map_err(|e| self.error(e))
    }

    fn trim(&self, offset: u64, len: u64) -> ExportResult<()> {
        self.core.discard(offset, len).map_err(|e| self.error(e))
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> ExportResult<()> {
        if flags.fast_zero {
            // The engine zeroes by writing through the cache; never faster than a write.
            return Err(ExportError::not_fast());
        }
        write_zeroes_chunked(&self.core, offset, len).map_err(|e| self.error(e))
    }

    /// Prefetch: reading through the exported volume inserts the range into the cache (in modes
    /// that insert on read; elsewhere it is a harmless read).
    fn cache(&self, offset: u64, len: u64) -> ExportResult<()> {
        let mut buf = vec![0u8; PREFETCH_CHUNK.min(len) as usize];
        let mut done = 0;
        while done < len {
            let n = (len - done).min(PREFETCH_CHUNK) as usize;
            self.core
                .read(&mut buf[..n], offset + done)
                .map_err(|e| self.error(e))?;
            done += n as u64;
        }
        Ok(())
    }

    fn block_sizes(&self) -> BlockSizes {
        BlockSizes {
            min: SECTOR as u32,
            preferred: self.line_size,
            max: MAX_REQUEST as u32,
        }
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            read_only: false,
            can_flush: true,
            can_fua: true,
            can_trim: true,
            can_write_zeroes: true,
            can_fast_zero: true,
            can_cache: true,
            can_multi_conn: true,
            // As dm-cache and bcache devices: misses and cut-off streams go to the disk, and
            // a client tuned for one sends what the cache keeps best (docs/ceph.md).
            rotational: self.core.rotational(),
        }
    }
}

//! A core's exported volume, `Core`: the address space clients read and write, and the entry of
//! the request path (read.rs, write.rs). It holds the cache and the core's state, so a request
//! needs no lookup of either; it is itself a `Volume`, so it can be served, benchmarked or
//! stacked like any device.
//!
//! Invariant: a `Core` is only made by [`crate::Cache::core`] for an active core; a removal
//! or stop in the meantime is caught by the request's entry (`CoreState::enter`), not here.

use std::sync::Arc;

use hybridcache_volume::{Volume, VolumeError};

use crate::core_state::CoreState;
use crate::inner::CacheInner;
use crate::latency::{self, LatencyKind};
use crate::{CoreId, EngineError, Result, SECTOR};

/// One core's exported volume: the address space clients read and write.
#[derive(Clone)]
pub struct Core {
    cache: Arc<CacheInner>,
    core: Arc<CoreState>,
}

impl Core {
    pub(crate) fn new(cache: Arc<CacheInner>, core: Arc<CoreState>) -> Core {
        Core { cache, core }
    }
}

impl Core {
    pub fn id(&self) -> CoreId {
        self.core.id()
    }

    /// Size of the exported volume in bytes (the core's size).
    pub fn size(&self) -> u64 {
        self.core.size()
    }

    /// Whether the core is a disk (or an array of them). The front-ends serve the cached
    /// volume as rotational when it is, as dm-cache and bcache do: misses and cut-off streams
    /// go to the disk, and a client that knows it talks to one (Ceph's BlueStore defers small
    /// writes only on rotational devices) sends what a cache keeps best (docs/ceph.md).
    pub fn rotational(&self) -> bool {
        self.core.volume().rotational()
    }

    /// The exported volume's name, as Open CAS names exported objects: `cas<cache>-<core>`.
    pub fn export_name(&self) -> String {
        format!("cas{}-{}", self.cache.id, self.core.id())
    }

    pub fn read(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let start = latency::begin();
        self.cache.reader().read(&self.core, buf, offset)?;
        let kind = if latency::ended_on_core() {
            LatencyKind::ReadCore
        } else {
            LatencyKind::ReadCache
        };
        self.core.latency().record(kind, start.elapsed());
        Ok(())
    }

    /// Serve several reads at once, one result per request in order: what a pipelining client
    /// has queued. Each is the read [`read`](Self::read) would do; the cache hits among them are
    /// read from the cache device together (read_batch.rs).
    pub fn read_batch(&self, reqs: &mut [(&mut [u8], u64)]) -> Vec<Result<()>> {
        if let [(buf, offset)] = reqs {
            return vec![self.read(buf, *offset)];
        }
        self.cache.reader().read_batch(&self.core, reqs)
    }

    pub fn write(&self, buf: &[u8], offset: u64) -> Result<()> {
        let start = latency::begin();
        self.cache.writer().write(&self.core, buf, offset)?;
        let kind = if latency::ended_on_core() {
            LatencyKind::WriteCore
        } else {
            LatencyKind::WriteCache
        };
        self.core.latency().record(kind, start.elapsed());
        Ok(())
    }

    /// Serve several writes at once, one result per request in order: what a pipelining
    /// client has queued. Each is the write [`write`](Self::write) would do; the write-back
    /// hits among them are written to the cache device together (write_batch.rs). A FUA
    /// write or a flush is not part of a batch: it ends one.
    pub fn write_batch(&self, reqs: &[(&[u8], u64)]) -> Vec<Result<()>> {
        if let [(buf, offset)] = reqs {
            return vec![self.write(buf, *offset)];
        }
        self.cache.writer().write_batch(&self.core, reqs)
    }

    /// A write that is durable when it returns (NBD's FUA): the write, then a flush.
    pub fn write_fua(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.write(buf, offset)?;
        self.flush()
    }

    /// Make every acknowledged write to this exported volume durable.
    pub fn flush(&self) -> Result<()> {
        self.cache.writer().flush_request(&self.core)
    }

    /// Drop the range: cached sectors (dirty ones too) are invalidated and the core is told.
    pub fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.cache.writer().discard(&self.core, offset, len)
    }

    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.cache.writer().write_zeroes(&self.core, offset, len)
    }

    /// Whether discarded ranges read back as zeroes (they do when the core's discard zeroes).
    pub fn discard_zeroes(&self) -> bool {
        self.core.volume().discard_zeroes()
    }
}

/// An exported volume is itself a volume, so it can be served, benchmarked or stacked like any.
impl Volume for Core {
    fn name(&self) -> &str {
        self.core.volume().name()
    }
    fn size(&self) -> u64 {
        self.core.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> hybridcache_volume::Result<()> {
        self.read(buf, offset).map_err(|e| {
            to_volume_error(
                self,
                hybridcache_volume::Op::Read,
                offset,
                buf.len() as u64,
                e,
            )
        })
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> hybridcache_volume::Result<()> {
        self.write(buf, offset).map_err(|e| {
            to_volume_error(
                self,
                hybridcache_volume::Op::Write,
                offset,
                buf.len() as u64,
                e,
            )
        })
    }
    fn flush(&self) -> hybridcache_volume::Result<()> {
        Core::flush(self).map_err(|e| to_volume_error(self, hybridcache_volume::Op::Flush, 0, 0, e))
    }
    fn discard(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        Core::discard(self, offset, len)
            .map_err(|e| to_volume_error(self, hybridcache_volume::Op::Discard, offset, len, e))
    }
    fn discard_zeroes(&self) -> bool {
        Core::discard_zeroes(self)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        Core::write_zeroes(self, offset, len)
            .map_err(|e| to_volume_error(self, hybridcache_volume::Op::WriteZeroes, offset, len, e))
    }
}

fn to_volume_error(
    core: &Core,
    op: hybridcache_volume::Op,
    offset: u64,
    len: u64,
    e: EngineError,
) -> VolumeError {
    use hybridcache_volume::ErrorKind;
    match e {
        EngineError::Volume(v) => v,
        EngineError::Unaligned { .. } => VolumeError::new(
            &core.export_name(),
            op,
            offset,
            len,
            ErrorKind::Unaligned {
                block: SECTOR as u32,
            },
        ),
        EngineError::OutOfRange { size, .. } => VolumeError::new(
            &core.export_name(),
            op,
            offset,
            len,
            ErrorKind::OutOfRange {
                end: offset.saturating_add(len),
                size,
            },
        ),
        other => VolumeError::new(
            &core.export_name(),
            op,
            offset,
            len,
            ErrorKind::Invalid(other.to_string()),
        ),
    }
}

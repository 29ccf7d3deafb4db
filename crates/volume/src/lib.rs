//! Block devices behind one trait.
//!
//! Job: give the rest of hybridcache a single, synchronous, thread-safe view of a block device
//! ([`Volume`]) and the implementations it needs: a file or block device (O_DIRECT where the
//! alignment allows), RAM, null, and fault-injecting and power-cut-simulating wrappers for tests.
//!
//! Boundaries: nothing here knows about caching, cache lines or NBD. A volume is an array of bytes
//! addressed by byte offset; callers keep requests aligned to [`Volume::logical_block_size`].
//! All methods take `&self` and may be called from many threads at once; requests that overlap
//! in flight have no ordering guarantee (as on a real disk), so callers serialise those themselves.

use std::fmt;
use std::sync::Arc;

mod emul;
mod fault;
mod file;
mod null;
mod ram;
mod together;
mod uri;
mod uring;

pub use emul::{
    calibration_cells, calibration_table, nanos, simulate, Backing, Cell, Clock, ClockRef,
    EmulConfig, EmulatedVolume, HddConfig, IoKind, Nanos, ParityEngine, Pattern, RaidConfig,
    RaidLevel, RealClock, SimResult, SplitMix64, SsdConfig, SsdVolume, ThrottleConfig,
    ThrottledVolume, VirtualClock, Workload, STARVATION_LIMIT, STUDY_DEPTHS,
    STUDY_RANDOM_WRITE_IOPS, STUDY_SEQ_WRITE_MBS, STUDY_SPAN,
};
pub use emul::{
    calibration_cells_through, measured, simulate_study_job, simulate_study_job_through,
    study_cells, Measure, StudyCell, StudyJob, Transport, STUDY_MIXED_5050_IOPS,
    STUDY_MIXED_QD32_IOPS,
};
pub use fault::{CrashVolume, FaultConfig, FaultyVolume, WriteFate};
pub use file::{FileVolume, IoEngine, IoPath};
pub use null::NullVolume;
pub use ram::RamVolume;
pub use together::{write_together, DirectWrite};
pub use uri::{open_volume, FORMS as VOLUME_FORMS};
pub use uring::{IoChoice, IO_ENV};

/// The operation that failed, for error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Open,
    Read,
    Write,
    Flush,
    Discard,
    WriteZeroes,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Op::Open => "open",
            Op::Read => "read",
            Op::Write => "write",
            Op::Flush => "flush",
            Op::Discard => "discard",
            Op::WriteZeroes => "write-zeroes",
        })
    }
}

/// Why a volume operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ErrorKind {
    #[error("offset and length must be multiples of {block} bytes")]
    Unaligned { block: u32 },
    #[error("range ends at byte {end}, past the end of the device ({size} bytes)")]
    OutOfRange { end: u64, size: u64 },
    #[error("{0}")]
    Io(#[from] std::io::Error),
    #[error("injected fault")]
    Injected,
    #[error("{0}")]
    Invalid(String),
}

/// A failed volume operation: which device, which operation, where, and why.
#[derive(Debug, thiserror::Error)]
#[error("{device}: {op} of {len} bytes at offset {offset} failed: {kind}")]
pub struct VolumeError {
    pub device: String,
    pub op: Op,
    pub offset: u64,
    pub len: u64,
    #[source]
    pub kind: ErrorKind,
}

impl VolumeError {
    pub fn new(device: &str, op: Op, offset: u64, len: u64, kind: ErrorKind) -> Self {
        VolumeError {
            device: device.to_string(),
            op,
            offset,
            len,
            kind,
        }
    }
}

pub type Result<T> = std::result::Result<T, VolumeError>;

/// A block device. Offsets and lengths are in bytes and must be multiples of
/// [`logical_block_size`](Volume::logical_block_size); buffers may have any memory alignment.
pub trait Volume: Send + Sync {
    /// A name for messages and statistics (a path, or `ram:1G`).
    fn name(&self) -> &str;
    /// Size in bytes, a multiple of the logical block size.
    fn size(&self) -> u64;
    /// The smallest addressable unit; 512 for everything hybridcache ships except devices that say
    /// otherwise.
    fn logical_block_size(&self) -> u32 {
        512
    }
    /// Whether the device has moving heads (a disk, or an array of them). A front-end serving
    /// the device as it is says so to its clients (NBD's ROTATIONAL flag), whose kernel then
    /// picks HDD behaviour (Ceph's BlueStore, for one, defers small writes only on rotational
    /// devices); a cache in front of one is served as not rotational, as Open CAS does.
    fn rotational(&self) -> bool {
        false
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()>;
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()>;
    /// Make every completed write durable (fdatasync for files).
    fn flush(&self) -> Result<()>;
    /// Tell the device the range is unused. Afterwards the range reads as zeroes if
    /// [`discard_zeroes`](Volume::discard_zeroes) says so, otherwise its content is unspecified.
    fn discard(&self, offset: u64, len: u64) -> Result<()>;
    /// Whether a discarded range reads back as zeroes.
    fn discard_zeroes(&self) -> bool {
        false
    }
    /// Make the range read as zeroes.
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        write_zeroes_by_writing(self, offset, len)
    }
    /// Read several ranges. A device that can have them in flight together does so and submits
    /// them with one system call (a file volume on io_uring); the default reads one after
    /// another. On an error, which pieces were read is unspecified: a caller that must know
    /// which failed reads them again one by one.
    fn read_batch(&self, pieces: &mut [ReadPiece<'_>]) -> Result<()> {
        for p in pieces.iter_mut() {
            self.read_at(p.buf, p.offset)?;
        }
        Ok(())
    }
    /// This volume's direct path for a write of `len` bytes at `offset`, for [`write_together`],
    /// which submits writes to several volumes with one `io_uring_enter` and makes them itself,
    /// without calling [`write_at`](Volume::write_at). None (the default): no such path, and
    /// `write_together` calls `write_at`. A wrapper that only passes requests on forwards it;
    /// one that must see every write itself (fault injection, a crash log) keeps the default.
    fn direct_write(&self, len: usize, offset: u64) -> Option<DirectWrite> {
        let _ = (len, offset);
        None
    }
    /// Write several `(data, offset)` ranges. A device that can have them in flight together
    /// does so with one system call (a file volume on io_uring); the default writes one after
    /// another, in order. The ranges must not overlap (their order on the device is then
    /// unspecified). On an error, which pieces were written is unspecified: a caller that must
    /// know writes them again one by one (rewriting the same data is harmless).
    fn write_batch(&self, pieces: &[(&[u8], u64)]) -> Result<()> {
        for &(buf, offset) in pieces {
            self.write_at(buf, offset)?;
        }
        Ok(())
    }
}

/// One range of a [`Volume::read_batch`]: `buf.len()` bytes at `offset` go into `buf`.
pub struct ReadPiece<'a> {
    pub buf: &'a mut [u8],
    pub offset: u64,
}

/// Shared, dynamically typed volume handle as the engine and servers hold it.
pub type VolumeRef = Arc<dyn Volume>;

/// Check that `[offset, offset + len)` is aligned to the volume's block size and inside it.
pub fn check_range<V: Volume + ?Sized>(vol: &V, op: Op, offset: u64, len: u64) -> Result<()> {
    let block = vol.logical_block_size();
    if offset % block as u64 != 0 || len % block as u64 != 0 {
        return Err(VolumeError::new(
            vol.name(),
            op,
            offset,
            len,
            ErrorKind::Unaligned { block },
        ));
    }
    let end = offset.checked_add(len);
    match end {
        Some(end) if end <= vol.size() => Ok(()),
        _ => Err(VolumeError::new(
            vol.name(),
            op,
            offset,
            len,
            ErrorKind::OutOfRange {
                end: end.unwrap_or(u64::MAX),
                size: vol.size(),
            },
        )),
    }
}

/// Zero a range with ordinary writes, 1 MiB at a time; the fallback for devices with no cheaper way.
pub fn write_zeroes_by_writing<V: Volume + ?Sized>(vol: &V, offset: u64, len: u64) -> Result<()> {
    check_range(vol, Op::WriteZeroes, offset, len)?;
    const CHUNK: u64 = 1 << 20;
    let zeroes = vec![0u8; CHUNK.min(len) as usize];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(CHUNK);
        vol.write_at(&zeroes[..n as usize], offset + done)?;
        done += n;
    }
    Ok(())
}

/// Parse a size such as `4096`, `64K`, `512M`, `2G`, `1T` (binary units, optional `iB`/`B`).
pub fn parse_size(text: &str) -> std::result::Result<u64, String> {
    let t = text.trim();
    let digits_end = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    if digits_end == 0 {
        return Err(format!(
            "'{text}' is not a size (expected e.g. 4096, 64K, 512M, 2G)"
        ));
    }
    let n: u64 = t[..digits_end]
        .parse()
        .map_err(|_| format!("'{text}' is too large"))?;
    let shift = match t[digits_end..].to_ascii_uppercase().as_str() {
        "" | "B" => 0,
        "K" | "KB" | "KIB" => 10,
        "M" | "MB" | "MIB" => 20,
        "G" | "GB" | "GIB" => 30,
        "T" | "TB" | "TIB" => 40,
        other => {
            return Err(format!(
                "'{text}': unknown unit '{other}' (use K, M, G or T)"
            ))
        }
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("'{text}' is too large"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_sizes() {
        assert_eq!(parse_size("4096"), Ok(4096));
        assert_eq!(parse_size("64K"), Ok(65536));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert!(parse_size("x").is_err());
        assert!(parse_size("1Q").is_err());
        assert!(parse_size("99999999999999999999T").is_err());
    }
}

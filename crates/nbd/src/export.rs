//! The `Export` trait: what the server needs from anything it serves.

use std::borrow::Cow;
use std::fmt;
use std::io;

use crate::proto;

/// Errno-like classes of export failure; each maps to one NBD error value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorKind {
    /// `EIO`: the backing store failed.
    Io,
    /// `EINVAL`: the request is not acceptable.
    Invalid,
    /// `ENOSPC`: out of space (also for `EDQUOT`/`EFBIG`, as the spec asks).
    NoSpace,
    /// `EPERM`: e.g. a write to something read-only.
    Permission,
    /// `ENOTSUP`: only meaningful for write-zeroes with `fast_zero`.
    NotSupported,
    /// `EOVERFLOW`.
    Overflow,
}

impl ErrorKind {
    /// The NBD error value sent on the wire.
    pub fn nbd_errno(self) -> u32 {
        match self {
            ErrorKind::Io => proto::EIO,
            ErrorKind::Invalid => proto::EINVAL,
            ErrorKind::NoSpace => proto::ENOSPC,
            ErrorKind::Permission => proto::EPERM,
            ErrorKind::NotSupported => proto::ENOTSUP,
            ErrorKind::Overflow => proto::EOVERFLOW,
        }
    }

    /// Inverse of [`ErrorKind::nbd_errno`]; the spec tells clients to treat
    /// unknown values as `EINVAL`, and `ENOMEM`/`ESHUTDOWN` as I/O trouble.
    pub fn from_nbd_errno(errno: u32) -> ErrorKind {
        match errno {
            proto::EIO | proto::ENOMEM | proto::ESHUTDOWN => ErrorKind::Io,
            proto::ENOSPC => ErrorKind::NoSpace,
            proto::EPERM => ErrorKind::Permission,
            proto::ENOTSUP => ErrorKind::NotSupported,
            proto::EOVERFLOW => ErrorKind::Overflow,
            _ => ErrorKind::Invalid,
        }
    }
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ErrorKind::Io => "I/O error",
            ErrorKind::Invalid => "invalid argument",
            ErrorKind::NoSpace => "no space left",
            ErrorKind::Permission => "operation not permitted",
            ErrorKind::NotSupported => "operation not supported",
            ErrorKind::Overflow => "value too large",
        })
    }
}

/// An export's failure: a kind for the wire plus a message for humans (sent
/// in structured error chunks).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExportError {
    pub kind: ErrorKind,
    pub message: Cow<'static, str>,
}

impl ExportError {
    pub fn new(kind: ErrorKind, message: impl Into<Cow<'static, str>>) -> Self {
        ExportError {
            kind,
            message: message.into(),
        }
    }

    pub fn io(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(ErrorKind::Io, message)
    }

    pub fn invalid(message: impl Into<Cow<'static, str>>) -> Self {
        Self::new(ErrorKind::Invalid, message)
    }

    /// What `write_zeroes` returns when `fast_zero` is set but zeroing would
    /// be no faster than writing.
    pub fn not_fast() -> Self {
        Self::new(ErrorKind::NotSupported, "fast zero not possible")
    }
}

impl fmt::Display for ExportError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.message.is_empty() {
            write!(f, "{}", self.kind)
        } else {
            write!(f, "{}: {}", self.kind, self.message)
        }
    }
}

impl std::error::Error for ExportError {}

impl From<ErrorKind> for ExportError {
    fn from(kind: ErrorKind) -> Self {
        ExportError::new(kind, "")
    }
}

impl From<io::Error> for ExportError {
    fn from(e: io::Error) -> Self {
        let kind = match e.raw_os_error() {
            Some(libc::ENOSPC) | Some(libc::EDQUOT) | Some(libc::EFBIG) => ErrorKind::NoSpace,
            Some(libc::EPERM) | Some(libc::EACCES) | Some(libc::EROFS) => ErrorKind::Permission,
            Some(libc::EINVAL) => ErrorKind::Invalid,
            Some(libc::EOPNOTSUPP) => ErrorKind::NotSupported,
            Some(libc::EOVERFLOW) => ErrorKind::Overflow,
            Some(_) => ErrorKind::Io,
            None => match e.kind() {
                io::ErrorKind::InvalidInput => ErrorKind::Invalid,
                io::ErrorKind::PermissionDenied => ErrorKind::Permission,
                io::ErrorKind::Unsupported => ErrorKind::NotSupported,
                _ => ErrorKind::Io,
            },
        };
        ExportError::new(kind, e.to_string())
    }
}

pub type ExportResult<T> = Result<T, ExportError>;

/// Block size constraints advertised with `NBD_INFO_BLOCK_SIZE`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockSizes {
    /// Smallest addressable unit; a power of two, at most 64 KiB.
    pub min: u32,
    /// Size below which I/O becomes inefficient; a power of two >= max(min, 512).
    pub preferred: u32,
    /// Largest request length; a multiple of `min`, >= `preferred`.
    pub max: u32,
}

/// Largest `BlockSizes::max` the server accepts: a request buffer is
/// allocated per in-flight request, so this bounds memory per worker.
pub const MAX_BLOCK_LIMIT: u32 = 64 << 20;

impl Default for BlockSizes {
    fn default() -> Self {
        BlockSizes {
            min: 512,
            preferred: 4096,
            max: 32 << 20,
        }
    }
}

impl BlockSizes {
    /// Checks the spec's constraints plus this server's allocation cap.
    pub fn validate(&self) -> Result<(), &'static str> {
        if !self.min.is_power_of_two() || self.min > 65536 {
            return Err("minimum block size must be a power of two <= 64 KiB");
        }
        if !self.preferred.is_power_of_two() || self.preferred < self.min.max(512) {
            return Err("preferred block size must be a power of two >= max(min, 512)");
        }
        if !self.max.is_multiple_of(self.min) || self.max < self.preferred {
            return Err("maximum block size must be a multiple of min and >= preferred");
        }
        if self.max > MAX_BLOCK_LIMIT {
            return Err("maximum block size above the server's 64 MiB limit");
        }
        Ok(())
    }
}

/// What an export can do; each field drives one transmission flag, so the
/// server never advertises something the export does not do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// Reject writes, trims and zeroing with `EPERM`.
    pub read_only: bool,
    /// `flush()` makes completed writes durable (`NBD_FLAG_SEND_FLUSH`).
    pub can_flush: bool,
    /// `write(.., fua = true)` is durable on return (`NBD_FLAG_SEND_FUA`).
    pub can_fua: bool,
    pub can_trim: bool,
    pub can_write_zeroes: bool,
    /// `write_zeroes` honours `fast_zero` (maybe by failing with
    /// `NotSupported`); only advertised together with `can_write_zeroes`.
    pub can_fast_zero: bool,
    pub can_cache: bool,
    /// True only if a flush (or FUA write) on one connection makes the writes
    /// completed on *all* connections durable and visible
    /// (`NBD_FLAG_CAN_MULTI_CONN`).
    pub can_multi_conn: bool,
    pub rotational: bool,
}

impl Default for Capabilities {
    /// Writable, flush and FUA (the default `flush` is a no-op, right for
    /// exports whose writes are durable on return), write-zeroes via the
    /// default emulation, no trim/fast-zero/cache/multi-conn.
    fn default() -> Self {
        Capabilities {
            read_only: false,
            can_flush: true,
            can_fua: true,
            can_trim: false,
            can_write_zeroes: true,
            can_fast_zero: false,
            can_cache: false,
            can_multi_conn: false,
            rotational: false,
        }
    }
}

/// Flags of a write-zeroes request.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ZeroFlags {
    /// The area must stay allocated (no hole may be punched).
    pub no_hole: bool,
    /// Fail with [`ErrorKind::NotSupported`] unless zeroing is faster than
    /// writing zeroes.
    pub fast_zero: bool,
}

/// Something the NBD server can serve: a fixed-size range of bytes.
///
/// The server validates every request before calling in: ranges lie within
/// `size()` (as sampled when the connection entered transmission), lengths
/// are non-zero, and offsets/lengths are multiples of `block_sizes().min`
/// (unaligned client requests are turned into aligned read-modify-write by
/// the server). Methods are called concurrently from several threads and
/// connections.
pub trait Export: Send + Sync {
    /// Size in bytes; should be a multiple of `block_sizes().min`.
    fn size(&self) -> u64;

    /// Fills `buf` with the bytes at `offset`.
    fn read(&self, buf: &mut [u8], offset: u64) -> ExportResult<()>;

    /// Several reads at once, one result per `(buffer, offset)` in order: what a pipelining
    /// client has queued. The default reads one after another.
    fn read_batch(&self, reqs: &mut [(&mut [u8], u64)]) -> Vec<ExportResult<()>> {
        reqs.iter_mut()
            .map(|(buf, offset)| self.read(buf, *offset))
            .collect()
    }

    /// Whether the server should hand buffered reads to [`read_batch`](Self::read_batch)
    /// together: true for an export that serves a batch faster than its reads one by one (one
    /// device submission for all). A batch's replies leave together, so the server batches
    /// only while reads have been fast on average; slow ones keep running in parallel on the
    /// connection's workers.
    fn batches_reads(&self) -> bool {
        false
    }

    /// Stores `buf` at `offset`; with `fua`, durable before returning.
    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> ExportResult<()>;

    /// Several writes at once (none of them FUA), one result per `(data, offset)` in order:
    /// what a pipelining client has queued. They must land as if written one after another in
    /// that order (two of them may cover the same sectors). The default writes one by one.
    fn write_batch(&self, reqs: &[(&[u8], u64)]) -> Vec<ExportResult<()>> {
        reqs.iter()
            .map(|(buf, offset)| self.write(buf, *offset, false))
            .collect()
    }

    /// Whether the server should hand buffered writes to [`write_batch`](Self::write_batch)
    /// together: true for an export that serves a batch faster than its writes one by one. As
    /// for reads, the server batches only while batches have been fast on average.
    fn batches_writes(&self) -> bool {
        false
    }

    /// Makes every write that has returned so far durable.
    fn flush(&self) -> ExportResult<()> {
        Ok(())
    }

    /// Hint that the range is no longer needed; contents become unspecified.
    fn trim(&self, _offset: u64, _len: u64) -> ExportResult<()> {
        Ok(())
    }

    /// Makes the range read as zeroes. The default writes zero buffers, which
    /// is never "fast", so it refuses `fast_zero`.
    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> ExportResult<()> {
        if flags.fast_zero {
            return Err(ExportError::not_fast());
        }
        const CHUNK: u64 = 1 << 20;
        let zeroes = vec![0u8; CHUNK.min(len) as usize];
        let mut done = 0;
        while done < len {
            let n = CHUNK.min(len - done);
            self.write(&zeroes[..n as usize], offset + done, false)?;
            done += n;
        }
        Ok(())
    }

    /// Prefetch hint (`NBD_CMD_CACHE`).
    fn cache(&self, _offset: u64, _len: u64) -> ExportResult<()> {
        Ok(())
    }

    fn block_sizes(&self) -> BlockSizes {
        BlockSizes::default()
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_block_sizes_are_valid() {
        assert_eq!(BlockSizes::default().validate(), Ok(()));
        let bad = [
            BlockSizes {
                min: 3,
                ..Default::default()
            },
            BlockSizes {
                preferred: 256,
                ..Default::default()
            },
            BlockSizes {
                max: 4097,
                ..Default::default()
            },
            BlockSizes {
                max: 128 << 20,
                ..Default::default()
            },
        ];
        for b in bad {
            assert!(b.validate().is_err(), "{b:?}");
        }
    }

    #[test]
    fn io_errors_map_to_kinds() {
        let e: ExportError = io::Error::from_raw_os_error(libc::EDQUOT).into();
        assert_eq!(e.kind, ErrorKind::NoSpace);
        let e: ExportError = io::Error::from_raw_os_error(libc::EROFS).into();
        assert_eq!(e.kind, ErrorKind::Permission);
        let e: ExportError = io::Error::other("boom").into();
        assert_eq!(e.kind, ErrorKind::Io);
        for k in [
            ErrorKind::Io,
            ErrorKind::Invalid,
            ErrorKind::NoSpace,
            ErrorKind::Permission,
            ErrorKind::NotSupported,
            ErrorKind::Overflow,
        ] {
            assert_eq!(ErrorKind::from_nbd_errno(k.nbd_errno()), k);
        }
    }
}

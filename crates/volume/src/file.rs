//! A volume on a regular file or a block device.
//!
//! I/O goes through O_DIRECT where possible, so cached data is not held a second time in the
//! kernel page cache and a completed write has left the process for the device. But O_DIRECT only
//! takes requests whose offset and length are multiples of the direct-I/O alignment, which can be
//! larger than the 512-byte blocks callers use (4 KiB-sector disks under a file system), and some
//! file systems (tmpfs) refuse O_DIRECT outright. So the volume keeps a second, buffered
//! descriptor: requests direct I/O cannot take go through it, and so does everything when O_DIRECT
//! is unavailable ([`FileVolume::io_path`] says which). Aligned requests in misaligned memory keep
//! the direct path by going through an aligned bounce buffer. Mixing the two paths is coherent:
//! Linux writes back and invalidates cached pages in the range of every direct request.
//!
//! Direct requests go through io_uring (a ring per thread, uring.rs) where the kernel allows it,
//! else through pread/pwrite; `HYBRIDCACHE_VOLUME_IO` overrides the choice
//! ([`FileVolume::io_engine`] says which, and the open logs it).

use std::alloc::{self, Layout};
use std::cell::RefCell;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::Path;
use std::ptr::NonNull;

use rustix::fs::{AtFlags, FallocateFlags, StatxFlags};
use rustix::io::Errno;
use rustix::ioctl::{self, opcode, Opcode};

use crate::uring::{self, IoChoice};
use crate::{
    check_range, write_zeroes_by_writing, ErrorKind, Op, ReadPiece, Result, Volume, VolumeError,
};

/// How a [`FileVolume`] reaches its device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoPath {
    /// O_DIRECT for requests that meet its alignment, the page cache for the rest.
    Direct,
    /// Everything through the page cache, because the file system refused O_DIRECT.
    Buffered,
}

/// What carries a [`FileVolume`]'s direct requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoEngine {
    /// io_uring, one ring per thread.
    Uring,
    /// pread(2)/pwrite(2) (also every buffered request).
    Pread,
}

/// A regular file or block device used as a volume.
pub struct FileVolume {
    name: String,
    buffered: File,
    direct: Option<Direct>,
    size: u64,
    block: u32,
    block_device: bool,
    /// What the kernel says of a block device (`queue/rotational`); false for a file.
    rotational: bool,
}

struct Direct {
    file: File,
    mem_align: usize,
    offset_align: u64,
    engine: IoEngine,
}

/// Bounce buffers are this aligned: a page satisfies every device's DMA alignment in practice.
const BOUNCE_ALIGN: usize = 4096;
/// Large misaligned requests are bounced in pieces of this size, so the per-thread buffer stays
/// small.
const BOUNCE_MAX: usize = 1 << 20;
/// The most a batch of misaligned reads bounces at once; larger batches go one by one.
const BATCH_BOUNCE_MAX: usize = 8 << 20;

const BLKGETSIZE64: Opcode = opcode::read::<libc::size_t>(0x12, 114);
const BLKDISCARD: Opcode = opcode::none(0x12, 119);
const BLKZEROOUT: Opcode = opcode::none(0x12, 127);

impl FileVolume {
    /// Open an existing regular file or block device for reading and writing.
    /// Direct requests use the I/O engine `HYBRIDCACHE_VOLUME_IO` names (auto if unset).
    pub fn open(path: &Path) -> Result<FileVolume> {
        let io = IoChoice::from_env().map_err(|msg| {
            VolumeError::new(
                &path.display().to_string(),
                Op::Open,
                0,
                0,
                ErrorKind::Invalid(msg),
            )
        })?;
        Self::open_with(path, true, io)
    }

    /// As [`FileVolume::open`] with the I/O engine chosen by the caller, not the environment.
    pub fn open_with_io(path: &Path, io: IoChoice) -> Result<FileVolume> {
        Self::open_with(path, true, io)
    }

    fn open_with(path: &Path, try_direct: bool, io: IoChoice) -> Result<FileVolume> {
        let name = path.display().to_string();
        let fail = |kind: ErrorKind| VolumeError::new(&name, Op::Open, 0, 0, kind);
        let invalid = |msg: String| fail(ErrorKind::Invalid(msg));
        let buffered = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|e| fail(e.into()))?;
        let meta = buffered.metadata().map_err(|e| fail(e.into()))?;
        let (size, block, block_device) = if meta.file_type().is_file() {
            (meta.len(), 512, false)
        } else if meta.file_type().is_block_device() {
            let size = blkgetsize64(&buffered).map_err(|e| fail(e.into()))?;
            let block = rustix::fs::ioctl_blksszget(&buffered)
                .map_err(|e| fail(io::Error::from(e).into()))?;
            (size, block, true)
        } else {
            return Err(invalid("not a regular file or block device".into()));
        };
        if !block.is_power_of_two() {
            return Err(invalid(format!("odd logical block size {block}")));
        }
        if size == 0 {
            return Err(invalid("the device is empty (0 bytes)".into()));
        }
        if size % u64::from(block) != 0 {
            return Err(invalid(format!(
                "size {size} is not a multiple of the {block}-byte logical block size"
            )));
        }
        let direct = if try_direct {
            Direct::open(path, block, size, io).map_err(invalid)?
        } else {
            None
        };
        match &direct {
            Some(d) if d.engine == IoEngine::Uring => {
                tracing::info!("{name}: direct I/O through io_uring (a ring per thread)")
            }
            Some(_) => tracing::info!(
                "{name}: direct I/O through pread/pwrite ({})",
                match (io, uring::available()) {
                    (IoChoice::Pread, _) => format!("{}=pread", uring::IO_ENV),
                    (_, Err(why)) => format!("io_uring unavailable: {why}"),
                    (_, Ok(())) => "io_uring failed on this file".to_string(),
                }
            ),
            None => tracing::info!("{name}: buffered I/O through pread/pwrite (no O_DIRECT here)"),
        }
        Ok(FileVolume {
            direct,
            name,
            buffered,
            size,
            block,
            block_device,
            rotational: block_device && sysfs_rotational(meta.rdev()),
        })
    }

    /// Create a sparse regular file of `size` bytes (a non-zero multiple of 512) and open it.
    /// An existing empty file is extended; an existing file of exactly `size` bytes is opened
    /// as is; any other existing file is an error rather than silently resized.
    pub fn create(path: &Path, size: u64) -> Result<FileVolume> {
        Self::create_then(path, size, Self::open)
    }

    /// As [`FileVolume::create`] with the I/O engine chosen by the caller.
    pub fn create_with_io(path: &Path, size: u64, io: IoChoice) -> Result<FileVolume> {
        Self::create_then(path, size, |p| Self::open_with_io(p, io))
    }

    fn create_then(
        path: &Path,
        size: u64,
        open: impl FnOnce(&Path) -> Result<FileVolume>,
    ) -> Result<FileVolume> {
        let name = path.display().to_string();
        let fail = |kind: ErrorKind| VolumeError::new(&name, Op::Open, 0, size, kind);
        let invalid = |msg: String| fail(ErrorKind::Invalid(msg));
        if size == 0 || size % 512 != 0 {
            return Err(invalid(format!(
                "size {size} must be a non-zero multiple of 512 bytes"
            )));
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(|e| fail(e.into()))?;
        let meta = file.metadata().map_err(|e| fail(e.into()))?;
        if !meta.file_type().is_file() {
            return Err(invalid(
                "exists and is not a regular file (open a block device instead of creating it)"
                    .into(),
            ));
        }
        match meta.len() {
            0 => file.set_len(size).map_err(|e| fail(e.into()))?,
            len if len == size => {}
            len => {
                return Err(invalid(format!(
                    "already exists with {len} bytes, not {size}; refusing to resize it"
                )))
            }
        }
        drop(file);
        open(path)
    }

    /// Whether requests can use O_DIRECT (see the module documentation).
    pub fn io_path(&self) -> IoPath {
        match self.direct {
            Some(_) => IoPath::Direct,
            None => IoPath::Buffered,
        }
    }

    /// What carries direct requests (buffered ones always use pread/pwrite).
    pub fn io_engine(&self) -> IoEngine {
        self.direct.as_ref().map_or(IoEngine::Pread, |d| d.engine)
    }

    /// Whether this volume is a block device rather than a regular file.
    pub fn is_block_device(&self) -> bool {
        self.block_device
    }

    fn direct_for(&self, offset: u64, len: usize) -> Option<&Direct> {
        self.direct
            .as_ref()
            .filter(|d| offset % d.offset_align == 0 && len as u64 % d.offset_align == 0)
    }

    fn err(&self, op: Op, offset: u64, len: u64, e: io::Error) -> VolumeError {
        VolumeError::new(&self.name, op, offset, len, ErrorKind::Io(e))
    }
}

impl Direct {
    /// The O_DIRECT descriptor, its alignment rules and I/O engine, or None if direct I/O will
    /// not work here; an error only if io_uring was demanded and does not work.
    fn open(
        path: &Path,
        block: u32,
        size: u64,
        io: IoChoice,
    ) -> std::result::Result<Option<Direct>, String> {
        let Some(mut d) = Self::open_pread(path, block, size) else {
            return Ok(None);
        };
        if io == IoChoice::Pread {
            return Ok(Some(d));
        }
        let works = uring::available().and_then(|()| {
            d.engine = IoEngine::Uring;
            // The same first-block read as for O_DIRECT itself, through the ring: a file
            // system may take O_DIRECT and still fail io_uring's requests.
            if size >= d.offset_align {
                with_bounce(d.offset_align as usize, |b| d.read(b, 0))
                    .map_err(|e| format!("io_uring read: {e}"))?;
            }
            Ok(())
        });
        match (works, io) {
            (Ok(()), _) => Ok(Some(d)),
            (Err(why), IoChoice::Uring) => Err(format!(
                "{}=uring, but io_uring does not work here: {why}",
                uring::IO_ENV
            )),
            (Err(_), _) => {
                d.engine = IoEngine::Pread;
                Ok(Some(d))
            }
        }
    }

    fn open_pread(path: &Path, block: u32, size: u64) -> Option<Direct> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(path)
            .ok()?;
        let (mem_align, offset_align) =
            match rustix::fs::statx(&file, "", AtFlags::EMPTY_PATH, StatxFlags::DIOALIGN) {
                Ok(st) if st.stx_mask & StatxFlags::DIOALIGN.bits() != 0 => {
                    if st.stx_dio_offset_align == 0 {
                        // The file system says this file cannot do direct I/O.
                        return None;
                    }
                    (
                        st.stx_dio_mem_align as usize,
                        u64::from(st.stx_dio_offset_align),
                    )
                }
                // Before Linux 6.1, or where the file system does not say: the logical block
                // size is what direct I/O has traditionally required, and a wrong guess only
                // costs a retry through the buffered descriptor (see read_at).
                _ => (block as usize, u64::from(block)),
            };
        let mem_align = mem_align.max(1);
        let offset_align = offset_align.max(u64::from(block));
        if !mem_align.is_power_of_two()
            || mem_align > BOUNCE_ALIGN
            || !offset_align.is_power_of_two()
            || offset_align > BOUNCE_MAX as u64
        {
            return None;
        }
        // Some file systems (FUSE, older tmpfs variants) accept the open flag but fail the I/O;
        // find out now so io_path() tells the truth.
        if size >= offset_align {
            with_bounce(offset_align as usize, |b| file.read_exact_at(b, 0)).ok()?;
        }
        Some(Direct {
            file,
            mem_align,
            offset_align,
            engine: IoEngine::Pread,
        })
    }

    /// One aligned read with this descriptor's engine.
    fn read_aligned(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        match self.engine {
            IoEngine::Uring => uring::read_exact_at(self.file.as_raw_fd(), buf, offset),
            IoEngine::Pread => self.file.read_exact_at(buf, offset),
        }
    }

    fn write_aligned(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        match self.engine {
            IoEngine::Uring => uring::write_all_at(self.file.as_raw_fd(), buf, offset),
            IoEngine::Pread => self.file.write_all_at(buf, offset),
        }
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        if buf.as_ptr() as usize % self.mem_align == 0 {
            return self.read_aligned(buf, offset);
        }
        with_bounce(buf.len().min(BOUNCE_MAX), |bounce| {
            for (i, piece) in buf.chunks_mut(BOUNCE_MAX).enumerate() {
                let b = &mut bounce[..piece.len()];
                self.read_aligned(b, offset + (i * BOUNCE_MAX) as u64)?;
                piece.copy_from_slice(b);
            }
            Ok(())
        })
    }

    fn write(&self, buf: &[u8], offset: u64) -> io::Result<()> {
        if buf.as_ptr() as usize % self.mem_align == 0 {
            return self.write_aligned(buf, offset);
        }
        with_bounce(buf.len().min(BOUNCE_MAX), |bounce| {
            for (i, piece) in buf.chunks(BOUNCE_MAX).enumerate() {
                let b = &mut bounce[..piece.len()];
                b.copy_from_slice(piece);
                self.write_aligned(b, offset + (i * BOUNCE_MAX) as u64)?;
            }
            Ok(())
        })
    }
}

impl Direct {
    /// Several aligned reads in flight together through this thread's ring (io_uring only).
    /// Pieces in misaligned memory go through one shared bounce buffer, carved per piece.
    fn read_batch(&self, pieces: &mut [ReadPiece<'_>]) -> io::Result<()> {
        if self.engine != IoEngine::Uring {
            return Err(io::Error::other("batched reads need io_uring"));
        }
        let misaligned = |b: &[u8]| b.as_ptr() as usize % self.mem_align != 0;
        let room = |len: usize| len.next_multiple_of(BOUNCE_ALIGN);
        let bounce_len: usize = pieces
            .iter()
            .filter(|p| misaligned(p.buf))
            .map(|p| room(p.buf.len()))
            .sum();
        if bounce_len > BATCH_BOUNCE_MAX {
            return Err(io::Error::other("batch too large to bounce"));
        }
        with_bounce(bounce_len.max(BOUNCE_ALIGN), |bounce| {
            {
                let mut rest = &mut bounce[..];
                let mut list: Vec<(&mut [u8], u64)> = Vec::with_capacity(pieces.len());
                for p in pieces.iter_mut() {
                    if misaligned(p.buf) {
                        let (b, r) = std::mem::take(&mut rest).split_at_mut(room(p.buf.len()));
                        rest = r;
                        list.push((&mut b[..p.buf.len()], p.offset));
                    } else {
                        list.push((&mut *p.buf, p.offset));
                    }
                }
                uring::read_batch(self.file.as_raw_fd(), &mut list)?;
            }
            let mut at = 0;
            for p in pieces.iter_mut() {
                if misaligned(p.buf) {
                    let n = p.buf.len();
                    p.buf.copy_from_slice(&bounce[at..at + n]);
                    at += room(n);
                }
            }
            Ok(())
        })
    }

    /// Several aligned writes in flight together through this thread's ring (io_uring only).
    /// Pieces in misaligned memory are first copied into one shared bounce buffer.
    fn write_batch(&self, pieces: &[(&[u8], u64)]) -> io::Result<()> {
        if self.engine != IoEngine::Uring {
            return Err(io::Error::other("batched writes need io_uring"));
        }
        let misaligned = |b: &[u8]| b.as_ptr() as usize % self.mem_align != 0;
        let room = |len: usize| len.next_multiple_of(BOUNCE_ALIGN);
        let bounce_len: usize = pieces
            .iter()
            .filter(|p| misaligned(p.0))
            .map(|p| room(p.0.len()))
            .sum();
        if bounce_len > BATCH_BOUNCE_MAX {
            return Err(io::Error::other("batch too large to bounce"));
        }
        with_bounce(bounce_len.max(BOUNCE_ALIGN), |bounce| {
            let mut rest = &mut bounce[..];
            let mut list: Vec<(&[u8], u64)> = Vec::with_capacity(pieces.len());
            for &(buf, offset) in pieces {
                if misaligned(buf) {
                    let (b, r) = std::mem::take(&mut rest).split_at_mut(room(buf.len()));
                    rest = r;
                    b[..buf.len()].copy_from_slice(buf);
                    list.push((&b[..buf.len()], offset));
                } else {
                    list.push((buf, offset));
                }
            }
            uring::write_batch(self.file.as_raw_fd(), &list)
        })
    }
}

/// EINVAL from a direct request means the alignment guess was wrong (or the file system changed
/// its mind); the buffered descriptor can still serve the request.
fn retry_buffered(e: &io::Error) -> bool {
    e.raw_os_error() == Some(libc::EINVAL)
}

fn unsupported(e: Errno) -> bool {
    e == Errno::OPNOTSUPP || e == Errno::NOTTY
}

fn blkgetsize64(f: &File) -> io::Result<u64> {
    // SAFETY: BLKGETSIZE64 writes one u64 to the pointer it is given.
    unsafe { Ok(ioctl::ioctl(f, ioctl::Getter::<BLKGETSIZE64, u64>::new())?) }
}

/// BLKDISCARD and BLKZEROOUT: both take a pointer to `[start, length]` in bytes.
fn blk_range_ioctl<const OPCODE: Opcode>(
    f: &File,
    offset: u64,
    len: u64,
) -> rustix::io::Result<()> {
    // SAFETY: both opcodes read a `u64[2]` through the pointer and write nothing back.
    unsafe { ioctl::ioctl(f, ioctl::Setter::<OPCODE, [u64; 2]>::new([offset, len])) }
}

/// A zeroed, page-aligned heap buffer.
struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

impl AlignedBuf {
    fn new(len: usize) -> AlignedBuf {
        let layout = Self::layout(len);
        // SAFETY: the layout has a non-zero size. Zeroed, so the buffer is initialised memory
        // before the first read(2) fills it.
        let p = unsafe { alloc::alloc_zeroed(layout) };
        let ptr = NonNull::new(p).unwrap_or_else(|| alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, len }
    }

    fn layout(len: usize) -> Layout {
        Layout::from_size_align(len.max(1), BOUNCE_ALIGN).expect("bounce buffer layout")
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in new() with the same layout.
        unsafe { alloc::dealloc(self.ptr.as_ptr(), Self::layout(self.len)) };
    }
}

thread_local! {
    /// Reused across requests: an aligned allocation of up to 1 MiB per request would mostly
    /// be an mmap/munmap pair.
    static BOUNCE: RefCell<Option<AlignedBuf>> = const { RefCell::new(None) };
}

/// Run `f` with a page-aligned scratch buffer of `len` bytes (content unspecified).
fn with_bounce<R>(len: usize, f: impl FnOnce(&mut [u8]) -> R) -> R {
    BOUNCE.with(|cell| {
        // Never borrowed twice: `f` only does syscalls and copies.
        let mut slot = cell.borrow_mut();
        let too_small = match &*slot {
            Some(b) => b.len < len,
            None => true,
        };
        if too_small {
            *slot = Some(AlignedBuf::new(len));
        }
        let b = slot.as_mut().expect("bounce buffer was just allocated");
        // SAFETY: the allocation holds `b.len >= len` initialised bytes, and the RefCell borrow
        // makes this the only reference to it.
        f(unsafe { std::slice::from_raw_parts_mut(b.ptr.as_ptr(), len) })
    })
}

/// The kernel's `rotational` flag of the block device `rdev`. A partition has no queue of its
/// own: its disk's is one directory up. Unknown reads as not rotational, the safe side for a
/// client (it then does not wait to batch small writes for a disk that is not there).
fn sysfs_rotational(rdev: u64) -> bool {
    let dir = format!(
        "/sys/dev/block/{}:{}",
        rustix::fs::major(rdev),
        rustix::fs::minor(rdev)
    );
    ["queue/rotational", "../queue/rotational"]
        .iter()
        .find_map(|f| std::fs::read_to_string(format!("{dir}/{f}")).ok())
        .is_some_and(|v| v.trim() == "1")
}

impl Volume for FileVolume {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn logical_block_size(&self) -> u32 {
        self.block
    }

    fn rotational(&self) -> bool {
        self.rotational
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        check_range(self, Op::Read, offset, len)?;
        if let Some(d) = self.direct_for(offset, buf.len()) {
            match d.read(buf, offset) {
                Ok(()) => return Ok(()),
                Err(e) if retry_buffered(&e) => {}
                Err(e) => return Err(self.err(Op::Read, offset, len, e)),
            }
        }
        self.buffered
            .read_exact_at(buf, offset)
            .map_err(|e| self.err(Op::Read, offset, len, e))
    }

    fn read_batch(&self, pieces: &mut [ReadPiece<'_>]) -> Result<()> {
        let direct = pieces.len() > 1
            && pieces.iter().all(|p| {
                check_range(self, Op::Read, p.offset, p.buf.len() as u64).is_ok()
                    && self.direct_for(p.offset, p.buf.len()).is_some()
            });
        if let Some(d) = self.direct.as_ref().filter(|_| direct) {
            if d.read_batch(pieces).is_ok() {
                return Ok(());
            }
        }
        // One by one: each piece gets its own error, and the buffered path where direct I/O
        // refuses.
        for p in pieces.iter_mut() {
            self.read_at(p.buf, p.offset)?;
        }
        Ok(())
    }

    fn write_batch(&self, pieces: &[(&[u8], u64)]) -> Result<()> {
        let direct = pieces.len() > 1
            && pieces.iter().all(|&(buf, offset)| {
                check_range(self, Op::Write, offset, buf.len() as u64).is_ok()
                    && self.direct_for(offset, buf.len()).is_some()
            });
        if let Some(d) = self.direct.as_ref().filter(|_| direct) {
            if d.write_batch(pieces).is_ok() {
                return Ok(());
            }
        }
        // One by one: each piece gets its own error, and the buffered path where direct I/O
        // refuses. Pieces the batch did write are written again with the same data.
        for &(buf, offset) in pieces {
            self.write_at(buf, offset)?;
        }
        Ok(())
    }

    /// The O_DIRECT descriptor on io_uring, for a write in range whose offset and length suit
    /// it; `write_together` copies a misaligned buffer itself.
    fn direct_write(&self, len: usize, offset: u64) -> Option<crate::DirectWrite> {
        check_range(self, Op::Write, offset, len as u64).ok()?;
        let d = self.direct_for(offset, len)?;
        (d.engine == IoEngine::Uring).then(|| crate::DirectWrite {
            fd: d.file.as_raw_fd(),
            mem_align: d.mem_align,
        })
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        check_range(self, Op::Write, offset, len)?;
        if let Some(d) = self.direct_for(offset, buf.len()) {
            match d.write(buf, offset) {
                Ok(()) => return Ok(()),
                Err(e) if retry_buffered(&e) => {}
                Err(e) => return Err(self.err(Op::Write, offset, len, e)),
            }
        }
        self.buffered
            .write_all_at(buf, offset)
            .map_err(|e| self.err(Op::Write, offset, len, e))
    }

    fn flush(&self) -> Result<()> {
        // One descriptor's fdatasync covers the inode, so writes made through the direct
        // descriptor are included (and on a block device it also flushes the device cache).
        rustix::fs::fdatasync(&self.buffered).map_err(|e| self.err(Op::Flush, 0, 0, e.into()))
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self, Op::Discard, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let r = if self.block_device {
            blk_range_ioctl::<BLKDISCARD>(&self.buffered, offset, len)
        } else {
            let mode = FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE;
            rustix::fs::fallocate(&self.buffered, mode, offset, len)
        };
        match r {
            Ok(()) => Ok(()),
            // Discard is only a hint on a block device...
            Err(e) if unsupported(e) && self.block_device => Ok(()),
            // ...but a file promises (discard_zeroes) that the range reads back as zeroes.
            Err(e) if unsupported(e) => self.write_zeroes(offset, len),
            Err(e) => Err(self.err(Op::Discard, offset, len, e.into())),
        }
    }

    fn discard_zeroes(&self) -> bool {
        !self.block_device
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self, Op::WriteZeroes, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let r = if self.block_device {
            blk_range_ioctl::<BLKZEROOUT>(&self.buffered, offset, len)
        } else {
            let mode = FallocateFlags::ZERO_RANGE | FallocateFlags::KEEP_SIZE;
            rustix::fs::fallocate(&self.buffered, mode, offset, len)
        };
        match r {
            Ok(()) => Ok(()),
            Err(e) if unsupported(e) => write_zeroes_by_writing(self, offset, len),
            Err(e) => Err(self.err(Op::WriteZeroes, offset, len, e.into())),
        }
    }
}

impl fmt::Debug for FileVolume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FileVolume")
            .field("name", &self.name)
            .field("size", &self.size)
            .field("block", &self.block)
            .field("io_path", &self.io_path())
            .field("io_engine", &self.io_engine())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;
    use std::sync::Arc;

    /// A scratch directory on a file system that takes O_DIRECT: the system temp dir if it
    /// does (it may be tmpfs), else the workspace's target directory.
    fn dio_dir() -> tempfile::TempDir {
        let target = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../target");
        let _ = std::fs::create_dir_all(&target);
        for base in [std::env::temp_dir(), target] {
            let Ok(dir) = tempfile::tempdir_in(&base) else {
                continue;
            };
            let probe = dir.path().join("probe");
            let ok = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .custom_flags(libc::O_DIRECT)
                .open(&probe)
                .is_ok();
            if ok {
                return dir;
            }
        }
        panic!("no scratch directory accepts O_DIRECT");
    }

    fn pattern(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(13) ^ seed)
            .collect()
    }

    fn read_vec(v: &FileVolume, offset: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0xEEu8; len];
        v.read_at(&mut buf, offset).unwrap();
        buf
    }

    fn round_trips_direct(io: IoChoice) {
        let dir = dio_dir();
        let path = dir.path().join("vol");
        let v = FileVolume::create_with_io(&path, 4 << 20, io).unwrap();
        assert_eq!(v.io_path(), IoPath::Direct);
        assert_eq!((v.size(), v.logical_block_size()), (4 << 20, 512));
        assert_eq!(read_vec(&v, 0, 8192), vec![0; 8192]);
        let cases = [
            (0u64, 4096usize),
            (512, 512),
            (4096 + 512, 3 * 512),
            (8192, 3 << 20),
            ((4 << 20) - 512, 512),
        ];
        for (i, &(off, len)) in cases.iter().enumerate() {
            let data = pattern(i as u8, len);
            v.write_at(&data, off).unwrap();
            assert_eq!(read_vec(&v, off, len), data, "case {i}");
        }
        v.flush().unwrap();
        drop(v);
        let v = FileVolume::open_with_io(&path, io).unwrap();
        assert_eq!(read_vec(&v, (4 << 20) - 512, 512), pattern(4, 512));
    }

    fn misaligned_memory_goes_through_bounce_buffer(io: IoChoice) {
        let dir = dio_dir();
        let v = FileVolume::create_with_io(&dir.path().join("vol"), 4 << 20, io).unwrap();
        assert_eq!(v.io_path(), IoPath::Direct);
        // Larger than BOUNCE_MAX so the piecewise copy is exercised.
        let len = BOUNCE_MAX + 8192;
        let mut backing = vec![0u8; len + 1];
        let data = pattern(9, len);
        backing[1..].copy_from_slice(&data);
        v.write_at(&backing[1..], 4096).unwrap();
        let mut back = vec![0u8; len + 1];
        v.read_at(&mut back[1..], 4096).unwrap();
        assert_eq!(&back[1..], &data[..]);
        assert_eq!(read_vec(&v, 4096, len), data);
    }

    fn buffered_and_direct_requests_see_each_other(io: IoChoice) {
        let dir = dio_dir();
        let v = FileVolume::create_with_io(&dir.path().join("vol"), 1 << 20, io).unwrap();
        // A lone 512-byte write may take the buffered path (when the DIO alignment is larger);
        // the surrounding 4 KiB read is direct either way.
        v.write_at(&[7u8; 4096], 0).unwrap();
        v.write_at(&[9u8; 512], 1024).unwrap();
        let got = read_vec(&v, 0, 4096);
        assert!(got[..1024].iter().all(|&b| b == 7));
        assert!(got[1024..1536].iter().all(|&b| b == 9));
        assert!(got[1536..].iter().all(|&b| b == 7));
        v.write_at(&[3u8; 4096], 0).unwrap();
        assert_eq!(read_vec(&v, 1024, 512), vec![3u8; 512]);
    }

    fn rejects_bad_requests(io: IoChoice) {
        let dir = dio_dir();
        let path = dir.path().join("vol");
        let v = FileVolume::create_with_io(&path, 1 << 20, io).unwrap();
        let e = v.write_at(&[0; 512], 256).unwrap_err();
        assert!(matches!(e.kind, ErrorKind::Unaligned { block: 512 }));
        let e = v.read_at(&mut [0; 700], 0).unwrap_err();
        assert!(matches!(e.kind, ErrorKind::Unaligned { block: 512 }));
        let e = v.read_at(&mut [0; 1024], (1 << 20) - 512).unwrap_err();
        assert!(matches!(e.kind, ErrorKind::OutOfRange { .. }));
        assert_eq!((e.op, e.offset, e.len), (Op::Read, (1 << 20) - 512, 1024));
        assert!(e.to_string().contains(&path.display().to_string()), "{e}");
        assert!(v.discard(1 << 20, 512).is_err());
        assert!(v.write_zeroes(0, 100).is_err());
    }

    fn open_and_create_errors(io: IoChoice) {
        let dir = dio_dir();
        let missing = dir.path().join("missing");
        let e = FileVolume::open_with_io(&missing, io).unwrap_err();
        assert!(matches!(e.kind, ErrorKind::Io(_)));
        assert_eq!(e.op, Op::Open);
        assert!(e.to_string().contains("missing"), "{e}");

        let odd = dir.path().join("odd");
        std::fs::write(&odd, [0u8; 1000]).unwrap();
        let e = FileVolume::open_with_io(&odd, io).unwrap_err();
        assert!(e.to_string().contains("multiple of the 512-byte"), "{e}");
        let e = FileVolume::create_with_io(&odd, 4096, io).unwrap_err();
        assert!(e.to_string().contains("refusing to resize"), "{e}");

        let empty = dir.path().join("empty");
        std::fs::write(&empty, []).unwrap();
        assert!(FileVolume::open_with_io(&empty, io).is_err());
        assert_eq!(
            FileVolume::create_with_io(&empty, 8192, io).unwrap().size(),
            8192
        );
        assert_eq!(
            FileVolume::create_with_io(&empty, 8192, io).unwrap().size(),
            8192
        );
        assert!(FileVolume::create_with_io(&dir.path().join("new"), 1000, io).is_err());
        assert!(FileVolume::open_with_io(dir.path(), io).is_err());
    }

    fn discard_and_write_zeroes_read_back_zeroes(io: IoChoice) {
        let dir = dio_dir();
        let path = dir.path().join("vol");
        let v = FileVolume::create_with_io(&path, 1 << 20, io).unwrap();
        assert!(v.discard_zeroes());
        v.write_at(&vec![0x5A; 1 << 20], 0).unwrap();
        v.discard(8192, 64 << 10).unwrap();
        v.discard(512, 512).unwrap();
        v.write_zeroes(256 << 10, 4096 + 1024).unwrap();
        let all = read_vec(&v, 0, 1 << 20);
        for (i, &b) in all.iter().enumerate() {
            let zero = (8192..8192 + (64 << 10)).contains(&i)
                || (512..1024).contains(&i)
                || ((256 << 10)..(256 << 10) + 5120).contains(&i);
            assert_eq!(b, if zero { 0 } else { 0x5A }, "byte {i}");
        }
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 20);
    }

    fn buffered_only_path_works(io: IoChoice) {
        let dir = dio_dir();
        let path = dir.path().join("vol");
        FileVolume::create_with_io(&path, 1 << 20, io).unwrap();
        let v = FileVolume::open_with(&path, false, io).unwrap();
        assert_eq!(v.io_path(), IoPath::Buffered);
        let mut backing = vec![0u8; 8192 + 1];
        backing[1..].copy_from_slice(&pattern(3, 8192));
        v.write_at(&backing[1..], 512).unwrap();
        assert_eq!(read_vec(&v, 512, 8192), pattern(3, 8192));
        v.write_zeroes(1024, 512).unwrap();
        v.discard(4096, 1024).unwrap();
        let got = read_vec(&v, 512, 8192);
        assert!(got[512..1024].iter().all(|&b| b == 0));
        assert!(got[3584..4608].iter().all(|&b| b == 0));
        assert_eq!(got[4608..], pattern(3, 8192)[4608..]);
        v.flush().unwrap();
    }

    // tmpfs refused O_DIRECT before Linux 6.6; either way the volume must work there.
    fn tmpfs_works_whichever_path_it_allows(io: IoChoice) {
        let shm = Path::new("/dev/shm");
        let Ok(dir) = tempfile::tempdir_in(shm) else {
            return;
        };
        let path = dir.path().join("vol");
        let v = FileVolume::create_with_io(&path, 1 << 20, io).unwrap();
        let direct_ok = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .is_ok();
        if !direct_ok {
            assert_eq!(v.io_path(), IoPath::Buffered);
        }
        let data = pattern(1, 8192);
        v.write_at(&data, 4096).unwrap();
        assert_eq!(read_vec(&v, 4096, 8192), data);
        v.discard(4096, 4096).unwrap();
        assert_eq!(read_vec(&v, 4096, 4096), vec![0; 4096]);
        v.flush().unwrap();
    }

    fn concurrent_threads_with_bounce_buffers(io: IoChoice) {
        let dir = dio_dir();
        let v = Arc::new(FileVolume::create_with_io(&dir.path().join("vol"), 4 << 20, io).unwrap());
        let handles: Vec<_> = (0..4u8)
            .map(|t| {
                let v = Arc::clone(&v);
                std::thread::spawn(move || {
                    let base = u64::from(t) << 20;
                    for i in 0..64u64 {
                        let data = pattern(t.wrapping_mul(64).wrapping_add(i as u8), 16384 + 1);
                        // Odd start in memory: every request bounces.
                        v.write_at(&data[1..], base + i * 16384).unwrap();
                    }
                    for i in 0..64u64 {
                        let data = pattern(t.wrapping_mul(64).wrapping_add(i as u8), 16384 + 1);
                        let mut back = vec![0u8; 16384 + 3];
                        v.read_at(&mut back[3..], base + i * 16384).unwrap();
                        assert_eq!(&back[3..], &data[1..]);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    }

    /// A batch reads what each piece would read alone: aligned and misaligned memory, more
    /// pieces than a ring holds, pieces of different sizes, the same range twice; a piece out
    /// of range fails the batch with that piece's error.
    fn batched_reads_match_single_reads(io: IoChoice) {
        let dir = dio_dir();
        let v = FileVolume::create_with_io(&dir.path().join("vol"), 4 << 20, io).unwrap();
        let data = pattern(3, 4 << 20);
        v.write_at(&data, 0).unwrap();
        let sizes = [512usize, 4096, 8192, 65536, 4096];
        // (offset, len, misaligned memory)
        let wanted: Vec<(u64, usize, bool)> = (0..150u64)
            .map(|i| {
                let len = sizes[i as usize % sizes.len()];
                let off = (i * 7919 * 512) % ((4 << 20) - len as u64);
                (off - off % 512, len, i % 3 == 0)
            })
            .chain([(0, 4096, false), (0, 4096, true)])
            .collect();
        let mut backing: Vec<Vec<u8>> = wanted
            .iter()
            .map(|&(_, len, _)| vec![0xEE; len + 1])
            .collect();
        let mut pieces: Vec<ReadPiece<'_>> = backing
            .iter_mut()
            .zip(&wanted)
            .map(|(b, &(off, len, odd))| ReadPiece {
                buf: if odd { &mut b[1..] } else { &mut b[..len] },
                offset: off,
            })
            .collect();
        v.read_batch(&mut pieces).unwrap();
        drop(pieces);
        for (b, &(off, len, odd)) in backing.iter().zip(&wanted) {
            let got = if odd { &b[1..] } else { &b[..len] };
            assert_eq!(
                got,
                &data[off as usize..off as usize + len],
                "piece at {off}+{len}"
            );
        }
        let mut a = vec![0u8; 4096];
        let mut b = vec![0u8; 4096];
        let mut bad = [
            ReadPiece {
                buf: &mut a,
                offset: 0,
            },
            ReadPiece {
                buf: &mut b,
                offset: 4 << 20,
            },
        ];
        let e = v.read_batch(&mut bad).unwrap_err();
        assert!(
            e.to_string().contains("beyond") || e.to_string().contains("range"),
            "{e}"
        );
    }

    /// A batch of writes (aligned and misaligned memory, many sizes, more pieces than the ring
    /// holds) lands exactly as the same writes one by one; a piece out of range fails the batch.
    fn batched_writes_land_as_single_writes(io: IoChoice) {
        let dir = dio_dir();
        let v = FileVolume::create_with_io(&dir.path().join("vol"), 4 << 20, io).unwrap();
        // Disjoint pieces: piece i at i * 16 KiB, 512 B to 16 KiB long, every third misaligned.
        let backing: Vec<Vec<u8>> = (0..200u64)
            .map(|i| pattern(i as u8 ^ 0x5a, 512 * (1 + (i as usize * 7) % 32) + 1))
            .collect();
        let pieces: Vec<(&[u8], u64)> = backing
            .iter()
            .enumerate()
            .map(|(i, b)| {
                let data = if i % 3 == 0 {
                    &b[1..]
                } else {
                    &b[..b.len() - 1]
                };
                (data, i as u64 * 16384)
            })
            .collect();
        v.write_batch(&pieces).unwrap();
        for &(data, offset) in &pieces {
            assert_eq!(read_vec(&v, offset, data.len()), data, "piece at {offset}");
        }
        let a = vec![1u8; 4096];
        let e = v
            .write_batch(&[(&a[..], 0), (&a[..], 4 << 20)])
            .unwrap_err();
        assert!(
            e.to_string().contains("beyond") || e.to_string().contains("range"),
            "{e}"
        );
    }

    /// Every test above runs once per I/O engine. The io_uring runs are skipped, saying so,
    /// where the kernel or a seccomp profile refuses io_uring.
    macro_rules! per_engine {
        ($($name:ident),* $(,)?) => {
            mod with_pread {
                $(#[test]
                fn $name() {
                    super::$name(super::IoChoice::Pread)
                })*
            }
            mod with_uring {
                $(#[test]
                fn $name() {
                    if let Err(why) = crate::uring::available() {
                        eprintln!("skipped: io_uring does not work here: {why}");
                        return;
                    }
                    super::$name(super::IoChoice::Uring)
                })*
            }
        };
    }

    per_engine!(
        round_trips_direct,
        misaligned_memory_goes_through_bounce_buffer,
        buffered_and_direct_requests_see_each_other,
        rejects_bad_requests,
        open_and_create_errors,
        discard_and_write_zeroes_read_back_zeroes,
        buffered_only_path_works,
        tmpfs_works_whichever_path_it_allows,
        concurrent_threads_with_bounce_buffers,
        batched_reads_match_single_reads,
        batched_writes_land_as_single_writes,
    );

    #[test]
    fn engine_is_the_one_chosen() {
        let dir = dio_dir();
        let path = dir.path().join("vol");
        let v = FileVolume::create_with_io(&path, 1 << 20, IoChoice::Pread).unwrap();
        assert_eq!(v.io_engine(), IoEngine::Pread);
        let auto = FileVolume::open_with_io(&path, IoChoice::Auto).unwrap();
        match crate::uring::available() {
            Ok(()) => {
                assert_eq!(auto.io_engine(), IoEngine::Uring);
                let v = FileVolume::open_with_io(&path, IoChoice::Uring).unwrap();
                assert_eq!(v.io_engine(), IoEngine::Uring);
            }
            Err(_) => {
                assert_eq!(auto.io_engine(), IoEngine::Pread);
                assert!(FileVolume::open_with_io(&path, IoChoice::Uring).is_err());
            }
        }
        // Without O_DIRECT there is nothing for io_uring to carry.
        let b = FileVolume::open_with(&path, false, IoChoice::Uring).unwrap();
        assert_eq!(b.io_engine(), IoEngine::Pread);
    }
}

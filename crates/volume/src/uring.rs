//! io_uring for a file volume's direct I/O: one ring per thread, created on the thread's first
//! request and kept for its life, so threads never contend for a ring and a request costs one
//! `io_uring_enter` (submit and wait together) instead of a `pread`/`pwrite`.
//!
//! Whether io_uring works is found out once per process ([`available`]): a ring is set up and a
//! no-op goes through it, because container seccomp profiles often refuse `io_uring_setup` or
//! `io_uring_enter`, and old kernels lack it. [`IoChoice`] picks the engine (the
//! `HYBRIDCACHE_VOLUME_IO` environment variable: `auto`, `uring` or `pread`; docs/devices.md).
//!
//! Every request waits for its own completion before returning (the [`crate::Volume`] trait is
//! synchronous), so the caller's buffer outlives the kernel's use of it, and registered buffers
//! would not help: the buffers are the callers' and change with every request. A caller with
//! several reads at once (the NBD server's pipelined cache hits) batches them with
//! [`read_batch`]: one `io_uring_enter` submits them all and waits for all, so the device sees
//! them together and the virtio doorbell rings once per batch, not once per read.

use std::cell::RefCell;
use std::io;
use std::os::fd::RawFd;
use std::sync::OnceLock;

use io_uring::{opcode, types, IoUring};

/// Entries per thread's ring: a batch ([`read_batch`]) puts up to this many reads in flight at
/// once; a single request uses one.
const RING_ENTRIES: u32 = 64;

/// Which I/O engine a file volume's direct requests use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoChoice {
    /// io_uring where the kernel allows it, pread/pwrite otherwise.
    Auto,
    /// io_uring, or refuse to open the volume.
    Uring,
    /// pread/pwrite always.
    Pread,
}

/// The environment variable that overrides the choice for every file volume of a process.
pub const IO_ENV: &str = "HYBRIDCACHE_VOLUME_IO";

impl IoChoice {
    /// From `HYBRIDCACHE_VOLUME_IO` (unset or empty: auto).
    pub fn from_env() -> Result<IoChoice, String> {
        match std::env::var(IO_ENV) {
            Err(_) => Ok(IoChoice::Auto),
            Ok(v) => IoChoice::parse(&v),
        }
    }

    pub fn parse(text: &str) -> Result<IoChoice, String> {
        match text.trim() {
            "" | "auto" => Ok(IoChoice::Auto),
            "uring" | "io_uring" => Ok(IoChoice::Uring),
            "pread" => Ok(IoChoice::Pread),
            other => Err(format!("{IO_ENV}={other}: expected auto, uring or pread")),
        }
    }
}

/// Whether io_uring works in this process, or why not; probed once.
pub fn available() -> Result<(), String> {
    static PROBE: OnceLock<Result<(), String>> = OnceLock::new();
    PROBE.get_or_init(probe).clone()
}

fn probe() -> Result<(), String> {
    let mut ring = IoUring::new(2).map_err(|e| format!("io_uring_setup: {e}"))?;
    let nop = opcode::Nop::new().build().user_data(1);
    // SAFETY: a no-op references no memory.
    unsafe { ring.submission().push(&nop) }.map_err(|_| "io_uring: queue full".to_string())?;
    ring.submit_and_wait(1)
        .map_err(|e| format!("io_uring_enter: {e}"))?;
    let done = ring.completion().next();
    match done {
        Some(c) if c.result() >= 0 => Ok(()),
        Some(c) => Err(format!(
            "io_uring no-op: {}",
            io::Error::from_raw_os_error(-c.result())
        )),
        None => Err("io_uring no-op: no completion".into()),
    }
}

/// A ring for one thread. Only this thread submits to it and it waits for every completion
/// itself, so the kernel may run completion work only when the thread waits (single issuer,
/// deferred task work: Linux 6.1) instead of interrupting it; older kernels get a plain ring.
fn new_ring() -> io::Result<IoUring> {
    IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(RING_ENTRIES)
        .or_else(|_| IoUring::new(RING_ENTRIES))
}

thread_local! {
    /// This thread's ring; None until the first request, or after a ring broke (the next
    /// request makes a new one).
    static RING: RefCell<Option<IoUring>> = const { RefCell::new(None) };
    /// The ring of [`write_spread`]: its writes stay in flight while the thread makes other
    /// writes meanwhile, which may go through `RING` (a volume without a direct path that
    /// wraps a file), so the two never share a ring.
    static SPREAD_RING: RefCell<Option<IoUring>> = const { RefCell::new(None) };
}

type RingKey = std::thread::LocalKey<RefCell<Option<IoUring>>>;

#[derive(Clone, Copy)]
enum Dir {
    Read,
    Write,
}

/// Reads exactly `buf.len()` bytes at `offset` of `fd` through this thread's ring.
pub(crate) fn read_exact_at(fd: RawFd, buf: &mut [u8], offset: u64) -> io::Result<()> {
    transfer(fd, buf.as_mut_ptr(), buf.len(), offset, Dir::Read)
}

/// Writes all of `buf` at `offset` of `fd` through this thread's ring.
pub(crate) fn write_all_at(fd: RawFd, buf: &[u8], offset: u64) -> io::Result<()> {
    // The pointer is only read from for a write.
    transfer(fd, buf.as_ptr().cast_mut(), buf.len(), offset, Dir::Write)
}

fn transfer(fd: RawFd, ptr: *mut u8, len: usize, offset: u64, dir: Dir) -> io::Result<()> {
    let mut done = 0usize;
    while done < len {
        // Requests above 2 GiB go in pieces (the length field is 32 bits).
        let n = (len - done).min(1 << 30);
        // SAFETY: `ptr + done .. + n` lies within the caller's buffer, which outlives the call,
        // and `one` returns only once the kernel has finished with it.
        let got = unsafe { one(fd, ptr.add(done), n as u32, offset + done as u64, dir)? };
        if got == 0 {
            return Err(match dir {
                Dir::Read => io::Error::from(io::ErrorKind::UnexpectedEof),
                Dir::Write => io::Error::from(io::ErrorKind::WriteZero),
            });
        }
        done += got;
    }
    Ok(())
}

/// One read or write; returns the bytes transferred.
///
/// # Safety
/// `ptr` must be valid for `len` bytes (writable for a read) until this returns.
unsafe fn one(fd: RawFd, ptr: *mut u8, len: u32, offset: u64, dir: Dir) -> io::Result<usize> {
    RING.with(|cell| {
        // Never borrowed twice: nothing below calls back into this module.
        let mut slot = cell.borrow_mut();
        if slot.is_none() {
            *slot = Some(new_ring()?);
        }
        let ring = slot.as_mut().expect("the ring was just created");
        let sqe = match dir {
            Dir::Read => opcode::Read::new(types::Fd(fd), ptr, len)
                .offset(offset)
                .build(),
            Dir::Write => opcode::Write::new(types::Fd(fd), ptr, len)
                .offset(offset)
                .build(),
        };
        // SAFETY: the caller keeps the buffer valid until the completion is reaped below.
        if unsafe { ring.submission().push(&sqe.user_data(1)) }.is_err() {
            // Cannot happen with one request in flight; a ring in that state is not trusted.
            *slot = None;
            return Err(io::Error::other("io_uring submission queue full"));
        }
        loop {
            match ring.submit_and_wait(1) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                    ) => {}
                Err(e) => {
                    if !ring.submission().is_empty() {
                        // The kernel never took the request: dropping the ring discards it
                        // unexecuted, so the buffer is free again.
                        *slot = None;
                        return Err(e);
                    }
                    // The kernel has it: its completion must be waited for whatever happens,
                    // or it could still write into the buffer after we return.
                }
            }
            if let Some(c) = ring.completion().next() {
                let r = c.result();
                return if r < 0 {
                    Err(io::Error::from_raw_os_error(-r))
                } else {
                    Ok(r as usize)
                };
            }
        }
    })
}

/// Reads each `(buffer, offset)` fully, up to [`RING_ENTRIES`] in flight at once. Every
/// submitted read is reaped before this returns, whatever fails, so no buffer is written after.
pub(crate) fn read_batch(fd: RawFd, pieces: &mut [(&mut [u8], u64)]) -> io::Result<()> {
    let mut first_error = None;
    for group in pieces.chunks_mut(RING_ENTRIES as usize) {
        // Bytes each read transferred, or its error.
        let mut got: Vec<io::Result<usize>> = Vec::with_capacity(group.len());
        let raw: Vec<(RawFd, *mut u8, usize, u64)> = group
            .iter_mut()
            .map(|(b, o)| (fd, b.as_mut_ptr(), b.len(), *o))
            .collect();
        // SAFETY: every buffer stays borrowed (and so valid) until `submit_group` returns, and
        // it returns only after reaping every completion it submitted.
        unsafe { submit_group(&RING, Dir::Read, &raw, &mut got, &mut None) }?;
        for ((buf, offset), r) in group.iter_mut().zip(got) {
            let res = match r {
                // A short read (end of a file, or a partial transfer): the rest one at a time.
                Ok(n) if n < buf.len() => read_exact_at(fd, &mut buf[n..], *offset + n as u64),
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            };
            if let Err(e) = res {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Writes each `(data, offset)` fully, up to [`RING_ENTRIES`] in flight at once. Every
/// submitted write is reaped before this returns, whatever fails, so no buffer is read after.
pub(crate) fn write_batch(fd: RawFd, pieces: &[(&[u8], u64)]) -> io::Result<()> {
    let mut first_error = None;
    for group in pieces.chunks(RING_ENTRIES as usize) {
        let mut got: Vec<io::Result<usize>> = Vec::with_capacity(group.len());
        // The kernel only reads these buffers (IORING_OP_WRITE); the pointer is `*mut` only
        // because the submission helper serves reads too.
        let raw: Vec<(RawFd, *mut u8, usize, u64)> = group
            .iter()
            .map(|(b, o)| (fd, b.as_ptr() as *mut u8, b.len(), *o))
            .collect();
        // SAFETY: every buffer stays borrowed until `submit_group` returns, which is after it
        // reaped every completion it submitted.
        unsafe { submit_group(&RING, Dir::Write, &raw, &mut got, &mut None) }?;
        for ((buf, offset), r) in group.iter().zip(got) {
            let res = match r {
                // A short write: the rest one at a time.
                Ok(n) if n < buf.len() => write_all_at(fd, &buf[n..], *offset + n as u64),
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            };
            if let Err(e) = res {
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Writes each `(fd, data, offset)` fully, all in flight together (one `io_uring_enter` for
/// at most [`RING_ENTRIES`]): the same data to several devices takes the time of the slowest,
/// not the sum. `meanwhile` runs once, on this thread, while the first [`RING_ENTRIES`] writes
/// are in flight (a write to a device with no direct path, such as a remote NBD export, then
/// overlaps them instead of following them); it runs whatever fails. One result per piece, in
/// order; every submitted write is reaped first.
pub(crate) fn write_spread(
    pieces: &[(RawFd, &[u8], u64)],
    meanwhile: &mut dyn FnMut(),
) -> Vec<io::Result<()>> {
    let mut meanwhile = Some(meanwhile);
    let mut out = Vec::with_capacity(pieces.len());
    for group in pieces.chunks(RING_ENTRIES as usize) {
        let mut got: Vec<io::Result<usize>> = Vec::with_capacity(group.len());
        let raw: Vec<(RawFd, *mut u8, usize, u64)> = group
            .iter()
            .map(|&(fd, b, o)| (fd, b.as_ptr() as *mut u8, b.len(), o))
            .collect();
        // SAFETY: every buffer stays borrowed until `submit_group` returns, which is after it
        // reaped every completion it submitted.
        if let Err(e) =
            unsafe { submit_group(&SPREAD_RING, Dir::Write, &raw, &mut got, &mut meanwhile) }
        {
            // Nothing of the group was submitted: each piece reports the error.
            out.extend(
                group
                    .iter()
                    .map(|_| Err(io::Error::new(e.kind(), e.to_string()))),
            );
            continue;
        }
        for (&(fd, buf, offset), r) in group.iter().zip(got) {
            out.push(match r {
                Ok(n) if n < buf.len() => write_all_at(fd, &buf[n..], offset + n as u64),
                Ok(_) => Ok(()),
                Err(e) => Err(e),
            });
        }
    }
    if let Some(m) = meanwhile {
        m();
    }
    out
}

/// Submits one read or write per piece of `group` (at most the ring's size; each piece names
/// its descriptor) on this thread's ring `key`, runs `meanwhile` (taken, if any) once they are
/// submitted, and reaps them all into `got`, in the group's order.
///
/// # Safety
/// Each piece's buffer must stay valid (and, for reads, unaliased) until this returns.
unsafe fn submit_group(
    key: &'static RingKey,
    dir: Dir,
    group: &[(RawFd, *mut u8, usize, u64)],
    got: &mut Vec<io::Result<usize>>,
    meanwhile: &mut Option<&mut dyn FnMut()>,
) -> io::Result<()> {
    key.with(|cell| {
        // Only `meanwhile` could come back here (a volume that spreads its own writes): its
        // caller then writes without this ring.
        let Ok(mut slot) = cell.try_borrow_mut() else {
            return Err(io::Error::other("this thread's io_uring ring is in use"));
        };
        if slot.is_none() {
            *slot = Some(new_ring()?);
        }
        let ring = slot.as_mut().expect("the ring was just created");
        for (i, &(fd, ptr, len, offset)) in group.iter().enumerate() {
            // Pieces above 1 GiB are not batched by any caller; clamp rather than truncate
            // silently: the short-transfer path finishes the rest.
            let len = len.min(1 << 30) as u32;
            let sqe = match dir {
                Dir::Read => opcode::Read::new(types::Fd(fd), ptr, len)
                    .offset(offset)
                    .build(),
                Dir::Write => opcode::Write::new(types::Fd(fd), ptr, len)
                    .offset(offset)
                    .build(),
            };
            let sqe = sqe.user_data(i as u64);
            // SAFETY: the caller keeps the buffer valid until its completion is reaped below.
            if unsafe { ring.submission().push(&sqe) }.is_err() {
                // More entries than the ring holds: only possible if the group was too large.
                // Nothing was submitted yet, so dropping the ring discards the entries.
                *slot = None;
                return Err(io::Error::other("io_uring submission queue full"));
            }
        }
        got.clear();
        got.extend(group.iter().map(|_| Ok(0)));
        if let Some(m) = meanwhile.take() {
            // The device starts on them now; an error here comes back from the submission
            // below, which tries again.
            let _ = ring.submit();
            m();
        }
        let mut reaped = 0;
        while reaped < group.len() {
            match ring.submit_and_wait(group.len() - reaped) {
                Ok(_) => {}
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                    ) => {}
                Err(e) => {
                    if reaped == 0 && ring.submission().len() == group.len() {
                        // The kernel took none of them: dropping the ring discards them.
                        *slot = None;
                        return Err(e);
                    }
                    // Some are in the kernel's hands: keep waiting for their completions, or
                    // the kernel could write into a buffer after we return.
                }
            }
            for c in ring.completion() {
                let i = c.user_data() as usize;
                let r = c.result();
                got[i] = if r < 0 {
                    Err(io::Error::from_raw_os_error(-r))
                } else {
                    Ok(r as usize)
                };
                reaped += 1;
            }
        }
        Ok(())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_parse() {
        assert_eq!(IoChoice::parse("auto"), Ok(IoChoice::Auto));
        assert_eq!(IoChoice::parse(""), Ok(IoChoice::Auto));
        assert_eq!(IoChoice::parse("uring"), Ok(IoChoice::Uring));
        assert_eq!(IoChoice::parse("pread"), Ok(IoChoice::Pread));
        assert!(IoChoice::parse("aio").unwrap_err().contains(IO_ENV));
    }
}

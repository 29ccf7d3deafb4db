//! Writes of the same moment to several volumes (a mirrored cache's dirty data and metadata go
//! to both of its devices), made at once where the volumes allow it: the caller then waits for
//! the slowest device instead of the sum of both.
//!
//! A volume takes part through [`Volume::direct_write`]: a file or block device on io_uring
//! names its O_DIRECT descriptor and alignment, and [`write_together`] submits every such
//! write with one `io_uring_enter` on the calling thread's ring, then waits for all of them. A
//! write to any other volume (RAM, remote NBD, emulated, fault-injecting) goes through
//! `write_at` on the calling thread while the submitted ones are in flight: a mirror on another
//! host (an NBD export) is written during the local device's write, not after it.

use std::os::fd::RawFd;

use crate::{Result, Volume};

/// A volume's direct path for one write ([`Volume::direct_write`]): the descriptor to submit it
/// on, and the memory alignment its buffer needs (a misaligned buffer is copied first).
#[derive(Debug, Clone, Copy)]
pub struct DirectWrite {
    pub(crate) fd: RawFd,
    pub(crate) mem_align: usize,
}

/// Bounce buffers are page-aligned: that satisfies every device's DMA alignment in practice.
const BOUNCE_ALIGN: usize = 4096;

/// Write `(volume, data, offset)` for each entry, at once: the writes of volumes with a direct
/// path for theirs are submitted together, and the others are made through `write_at`, one
/// after another, while those are in flight (see the module doc). One result per entry, in
/// order, each a volume's own: a direct write that fails is made again through that volume's
/// `write_at`, which gives it its own error (or the buffered path where direct I/O refuses);
/// writing the same data twice does no harm.
pub fn write_together(writes: &[(&dyn Volume, &[u8], u64)]) -> Vec<Result<()>> {
    let direct: Vec<Option<DirectWrite>> = if writes.len() > 1 {
        writes
            .iter()
            .map(|&(v, buf, offset)| v.direct_write(buf.len(), offset))
            .collect()
    } else {
        vec![None; writes.len()]
    };
    if direct.iter().all(Option::is_none) {
        return writes
            .iter()
            .map(|&(v, buf, offset)| v.write_at(buf, offset))
            .collect();
    }
    // Copies of misaligned buffers, made once per distinct buffer (a mirror writes the same
    // data to both devices).
    let mut copies: Vec<(*const u8, Vec<u8>, usize)> = Vec::new();
    // The copy that serves `buf`: made from the same memory, and holding its length.
    let copy_of = |copies: &[(*const u8, Vec<u8>, usize)], buf: &[u8]| {
        copies
            .iter()
            .position(|c| c.0 == buf.as_ptr() && c.1.len() >= buf.len() + BOUNCE_ALIGN)
    };
    for (&(_, buf, _), d) in writes.iter().zip(&direct) {
        let Some(d) = d else { continue };
        let misaligned = buf.as_ptr() as usize % d.mem_align.max(1) != 0;
        if misaligned && copy_of(&copies, buf).is_none() {
            let mut room = vec![0u8; buf.len() + BOUNCE_ALIGN];
            let start = room.as_ptr().align_offset(BOUNCE_ALIGN);
            room[start..start + buf.len()].copy_from_slice(buf);
            copies.push((buf.as_ptr(), room, start));
        }
    }
    let pieces: Vec<(RawFd, &[u8], u64)> = writes
        .iter()
        .zip(&direct)
        .filter_map(|(&(_, buf, offset), d)| {
            let d = d.as_ref()?;
            let data = match copy_of(&copies, buf) {
                Some(i) if buf.as_ptr() as usize % d.mem_align.max(1) != 0 => {
                    let (_, room, start) = &copies[i];
                    &room[*start..*start + buf.len()]
                }
                _ => buf,
            };
            Some((d.fd, data, offset))
        })
        .collect();
    // The volumes without a direct path, written while the direct writes are in flight.
    let mut others: Vec<Option<Result<()>>> = writes.iter().map(|_| None).collect();
    let mut meanwhile = || {
        for ((&(v, buf, offset), d), out) in writes.iter().zip(&direct).zip(others.iter_mut()) {
            if d.is_none() {
                *out = Some(v.write_at(buf, offset));
            }
        }
    };
    let mut spread = crate::uring::write_spread(&pieces, &mut meanwhile).into_iter();
    writes
        .iter()
        .zip(&direct)
        .zip(others)
        .map(|((&(v, buf, offset), d), other)| match (d, other) {
            (None, Some(r)) => r,
            // `write_spread` runs `meanwhile` whatever fails; were it not to, write here.
            (None, None) => v.write_at(buf, offset),
            (Some(_), _) => match spread.next() {
                Some(Ok(())) => Ok(()),
                _ => v.write_at(buf, offset),
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{FaultConfig, FaultyVolume, FileVolume, IoChoice, RamVolume, VolumeRef};
    use std::sync::Arc;

    fn file(dir: &std::path::Path, name: &str) -> Arc<FileVolume> {
        let path = dir.join(name);
        std::fs::File::create(&path)
            .and_then(|f| f.set_len(8 << 20))
            .expect("file");
        Arc::new(FileVolume::open_with_io(&path, IoChoice::Auto).expect("open"))
    }

    fn read(v: &dyn Volume, offset: u64, len: usize) -> Vec<u8> {
        let mut b = vec![0u8; len];
        v.read_at(&mut b, offset).expect("read");
        b
    }

    #[test]
    fn the_same_data_reaches_every_volume_aligned_or_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let (a, b) = (file(dir.path(), "a"), file(dir.path(), "b"));
        if crate::uring::available().is_ok() {
            // The path under test: both writes submitted together.
            assert!(a.direct_write(4096, 0).is_some() && b.direct_write(4096, 0).is_some());
            assert!(
                a.direct_write(4096, 8 << 20).is_none(),
                "out of range: no direct path"
            );
        }
        let data: Vec<u8> = (0..16384 + 1).map(|i| (i * 7 % 251) as u8).collect();
        // An aligned buffer and a misaligned one (one byte in), to two files and to a file and
        // a RAM volume (no direct path: one after another).
        let ram: VolumeRef = Arc::new(RamVolume::new("ram:8M", 8 << 20).expect("ram"));
        for (at, buf) in [(0u64, &data[..16384]), (65536, &data[1..16385])] {
            let r = write_together(&[(&*a, buf, at), (&*b, buf, at + 4096)]);
            assert!(r.iter().all(|r| r.is_ok()), "{r:?}");
            assert_eq!(read(&*a, at, buf.len()), buf);
            assert_eq!(read(&*b, at + 4096, buf.len()), buf);
            let far = at + (1 << 20);
            let r = write_together(&[(&*a, buf, far), (&*ram, buf, at)]);
            assert!(r.iter().all(|r| r.is_ok()), "{r:?}");
            assert_eq!(read(&*a, far, buf.len()), buf);
            assert_eq!(read(&*ram, at, buf.len()), buf);
        }
    }

    #[test]
    fn each_volume_gets_its_own_result() {
        let dir = tempfile::tempdir().expect("tempdir");
        let a = file(dir.path(), "a");
        let data = vec![5u8; 4096];
        // Past the end of b: its write fails with its own error, a's is made.
        let b = file(dir.path(), "b");
        let r = write_together(&[(&*a, &data, 0), (&*b, &data, 8 << 20)]);
        assert!(r[0].is_ok(), "{:?}", r[0]);
        assert!(r[1].is_err());
        assert_eq!(read(&*a, 0, 4096), data);
        // A fault-injecting volume has no direct path: it sees its write and fails it alone.
        let faulty = FaultyVolume::with_config(
            b.clone(),
            FaultConfig {
                fail_writes_in: Some(0..4096),
                ..FaultConfig::default()
            },
        );
        let r = write_together(&[(&*a, &data, 4096), (&faulty, &data, 0)]);
        assert!(r[0].is_ok(), "{:?}", r[0]);
        assert!(r[1].is_err(), "the fault volume's own write failed");
        assert_eq!(read(&*a, 4096, 4096), data);
    }

    /// A volume without a direct path (as a remote NBD export) whose write completes only once
    /// `file` holds the same data at the same offset: it stands for a device written while the
    /// local one's write is in flight, and fails (after 10 s) when that write waits for it.
    struct AfterFile {
        file: std::fs::File,
    }

    impl Volume for AfterFile {
        fn name(&self) -> &str {
            "after-file"
        }
        fn size(&self) -> u64 {
            8 << 20
        }
        fn read_at(&self, _buf: &mut [u8], _offset: u64) -> Result<()> {
            Ok(())
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
            use std::os::unix::fs::FileExt;
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            let mut seen = vec![0u8; buf.len()];
            loop {
                let len = buf.len() as u64;
                let fail = |kind| {
                    crate::VolumeError::new("after-file", crate::Op::Write, offset, len, kind)
                };
                self.file
                    .read_exact_at(&mut seen, offset)
                    .map_err(|e| fail(crate::ErrorKind::Io(e)))?;
                if seen == buf {
                    return Ok(());
                }
                if std::time::Instant::now() > deadline {
                    return Err(fail(crate::ErrorKind::Invalid(
                        "the file's write was not in flight".into(),
                    )));
                }
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        }
        fn flush(&self) -> Result<()> {
            Ok(())
        }
        fn discard(&self, _offset: u64, _len: u64) -> Result<()> {
            Ok(())
        }
    }

    #[test]
    fn a_volume_without_a_direct_path_is_written_while_the_direct_writes_are_in_flight() {
        if crate::uring::available().is_err() {
            return;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let a = file(dir.path(), "a");
        let remote = AfterFile {
            file: std::fs::File::open(dir.path().join("a")).expect("open a"),
        };
        // Listed first: written one after another in the order given, it would wait for a
        // write that had not begun.
        for (i, fill) in [(0u64, 3u8), (1, 4), (2, 5)] {
            let data = vec![fill; 8192];
            let at = i * 65536;
            let r = write_together(&[(&remote, &data, at), (&*a, &data, at)]);
            assert!(r.iter().all(|r| r.is_ok()), "{r:?}");
            assert_eq!(read(&*a, at, data.len()), data);
        }
    }
}

//! Device-to-device pieces of a mirrored cache that need none of its state (mirror.rs holds
//! the pair): a volume cut to a size (`Window`: a mirror or a new primary larger than the
//! geometry's device), and the copy of the metadata region from one device onto another
//! (`copy_commits_and_blocks`, the end of every rebuild: a new mirror, a first mirror, a new
//! primary).

use hybridcache_volume::{DirectWrite, ReadPiece, Volume, VolumeError, VolumeRef};

/// Copy the metadata region below the superblocks (both commit records, then the metadata
/// blocks up to `data_offset`) from `from` to `to`, a MiB at a time: the end of either
/// rebuild. `write_failed` is told of a write of `to` that fails (the error is returned too).
pub(crate) fn copy_commits_and_blocks(
    from: &dyn Volume,
    to: &dyn Volume,
    data_offset: u64,
    write_failed: impl Fn(&VolumeError),
) -> crate::Result<()> {
    const CHUNK: u64 = 1 << 20;
    let mut buf = vec![0u8; CHUNK as usize];
    let mut copy = |at: u64, n: usize| -> crate::Result<()> {
        from.read_at(&mut buf[..n], at)?;
        to.write_at(&buf[..n], at).inspect_err(&write_failed)?;
        Ok(())
    };
    for slot in crate::format::COMMIT_SLOTS {
        copy(slot, crate::format::BLOCK)?;
    }
    let mut at = crate::format::META_OFFSET;
    while at < data_offset {
        let n = (data_offset - at).min(CHUNK) as usize;
        copy(at, n)?;
        at += n as u64;
    }
    Ok(())
}

/// The first `size` bytes of a volume: a mirror larger than its primary, loaded alone, shows
/// the geometry the primary's size gave.
pub(crate) struct Window {
    inner: VolumeRef,
    size: u64,
}

impl Window {
    pub(crate) fn new(inner: VolumeRef, size: u64) -> Window {
        Window { inner, size }
    }
}

impl Volume for Window {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn size(&self) -> u64 {
        self.size
    }
    fn logical_block_size(&self) -> u32 {
        self.inner.logical_block_size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> hybridcache_volume::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> hybridcache_volume::Result<()> {
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> hybridcache_volume::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        Volume::discard(&*self.inner, offset, len)
    }
    fn discard_zeroes(&self) -> bool {
        self.inner.discard_zeroes()
    }
    fn read_batch(&self, pieces: &mut [ReadPiece<'_>]) -> hybridcache_volume::Result<()> {
        Volume::read_batch(&*self.inner, pieces)
    }
    fn direct_write(&self, len: usize, offset: u64) -> Option<DirectWrite> {
        (offset.checked_add(len as u64)? <= self.size)
            .then(|| self.inner.direct_write(len, offset))
            .flatten()
    }
}

//! A window onto a volume (docs/format.md, "The mirror"): a mirror loaded alone shows the
//! geometry its primary's size gave, whether it is larger (cut to that size) or a smaller
//! mirror (shown at that size; nothing beyond its end is used).

use hybridcache_volume::{DirectWrite, ErrorKind, Op, ReadPiece, Volume, VolumeError, VolumeRef};

/// The first `size` bytes of a volume: a mirror larger than its primary, loaded alone, shows
/// the geometry the primary's size gave. A smaller mirror loaded alone shows it too, though it
/// ends sooner: nothing beyond its end is used (lines.rs takes no line there), and an I/O that
/// reached there would fail rather than grow a file.
pub(crate) struct Window {
    inner: VolumeRef,
    size: u64,
}

impl Window {
    pub(crate) fn new(inner: VolumeRef, size: u64) -> Window {
        Window { inner, size }
    }

    fn within(&self, op: Op, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        let end = self.inner.size();
        if offset.checked_add(len).is_some_and(|e| e <= end) {
            return Ok(());
        }
        Err(VolumeError::new(
            self.inner.name(),
            op,
            offset,
            len,
            ErrorKind::Invalid(format!(
                "beyond the end of this smaller mirror ({end} bytes)"
            )),
        ))
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
        self.within(Op::Read, offset, buf.len() as u64)?;
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> hybridcache_volume::Result<()> {
        self.within(Op::Write, offset, buf.len() as u64)?;
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> hybridcache_volume::Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        self.within(Op::Discard, offset, len)?;
        Volume::discard(&*self.inner, offset, len)
    }
    fn discard_zeroes(&self) -> bool {
        self.inner.discard_zeroes()
    }
    fn read_batch(&self, pieces: &mut [ReadPiece<'_>]) -> hybridcache_volume::Result<()> {
        for p in pieces.iter() {
            self.within(Op::Read, p.offset, p.buf.len() as u64)?;
        }
        Volume::read_batch(&*self.inner, pieces)
    }
    fn direct_write(&self, len: usize, offset: u64) -> Option<DirectWrite> {
        (offset.checked_add(len as u64)? <= self.size.min(self.inner.size()))
            .then(|| self.inner.direct_write(len, offset))
            .flatten()
    }
}

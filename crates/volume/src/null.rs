//! A volume that stores nothing: writes vanish and reads return zeroes. For measuring the cache
//! engine without any device cost, and as a stand-in backing device.

use crate::{check_range, ErrorKind, Op, Result, Volume, VolumeError};

/// Discards writes, reads zeroes; requests are still range-checked like a real device.
#[derive(Debug)]
pub struct NullVolume {
    name: String,
    size: u64,
}

impl NullVolume {
    /// A volume of `size` bytes (a non-zero multiple of 512).
    pub fn new(name: &str, size: u64) -> Result<NullVolume> {
        if size == 0 || size % 512 != 0 {
            let msg = format!("null volume size {size} must be a non-zero multiple of 512 bytes");
            return Err(VolumeError::new(
                name,
                Op::Open,
                0,
                size,
                ErrorKind::Invalid(msg),
            ));
        }
        Ok(NullVolume {
            name: name.to_string(),
            size,
        })
    }
}

impl Volume for NullVolume {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self, Op::Read, offset, buf.len() as u64)?;
        buf.fill(0);
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        check_range(self, Op::Write, offset, buf.len() as u64)
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self, Op::Discard, offset, len)
    }

    fn discard_zeroes(&self) -> bool {
        true
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self, Op::WriteZeroes, offset, len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_vanish_reads_zero() {
        let v = NullVolume::new("null:1M", 1 << 20).unwrap();
        v.write_at(&[0xFF; 4096], 8192).unwrap();
        let mut buf = [0xEEu8; 4096];
        v.read_at(&mut buf, 8192).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        v.flush().unwrap();
        v.discard(0, 1 << 20).unwrap();
        v.write_zeroes(512, 512).unwrap();
        assert!(v.discard_zeroes());
    }

    #[test]
    fn rejects_bad_sizes() {
        for size in [0, 100, 4097] {
            let e = NullVolume::new("null:x", size).unwrap_err();
            assert!(matches!(e.kind, ErrorKind::Invalid(_)), "{e}");
        }
    }

    #[test]
    fn checks_ranges() {
        let v = NullVolume::new("null:1M", 1 << 20).unwrap();
        let e = v.write_at(&[0; 512], 1).unwrap_err();
        assert!(matches!(e.kind, ErrorKind::Unaligned { block: 512 }));
        let e = v.read_at(&mut [0; 512], 1 << 20).unwrap_err();
        assert!(matches!(e.kind, ErrorKind::OutOfRange { .. }));
        assert!(v.discard(0, (1 << 20) + 512).is_err());
        assert!(v.write_zeroes(3, 512).is_err());
    }
}

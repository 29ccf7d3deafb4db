//! A volume in anonymous memory, for cache devices in benchmarks and tests.
//!
//! The memory is an anonymous private mapping, so it is zeroed and allocated lazily: an untouched
//! 4 GiB volume costs nothing until [`RamVolume::prefault`] or I/O touches it. Threads share it
//! through a raw pointer, so every copy runs under a striped lock (one stripe per 64 KiB chunk,
//! shared for reads, exclusive for writes): that keeps concurrent requests free of data races
//! without serialising requests to unrelated chunks.

use std::fmt;
use std::ptr::{self, NonNull};

use parking_lot::RwLock;

use crate::{check_range, ErrorKind, Op, Result, Volume, VolumeError};

const CHUNK_SHIFT: u32 = 16;
const CHUNK: u64 = 1 << CHUNK_SHIFT;
const STRIPES: usize = 1024;
const PAGE: usize = 4096;

/// Padded to a cache line so threads working on neighbouring chunks do not bounce one line
/// between cores.
#[repr(align(64))]
struct Stripe(RwLock<()>);

/// A volume held in memory; its content is lost when it is dropped.
pub struct RamVolume {
    name: String,
    base: NonNull<u8>,
    size: u64,
    stripes: Box<[Stripe]>,
}

// SAFETY: the mapping is owned by the volume and only reached through `base`; every access to it
// holds the stripe lock of the chunk it touches (shared for reads, exclusive for writes), so
// sharing the volume between threads cannot produce a data race.
unsafe impl Send for RamVolume {}
unsafe impl Sync for RamVolume {}

impl RamVolume {
    /// A zero-filled volume of `size` bytes (a non-zero multiple of 512). Memory is allocated
    /// on first touch.
    pub fn new(name: &str, size: u64) -> Result<RamVolume> {
        let invalid =
            |msg: String| VolumeError::new(name, Op::Open, 0, size, ErrorKind::Invalid(msg));
        if size == 0 || size % 512 != 0 {
            return Err(invalid(format!(
                "RAM volume size {size} must be a non-zero multiple of 512 bytes"
            )));
        }
        let len = usize::try_from(size)
            .ok()
            .filter(|&l| l <= isize::MAX as usize)
            .ok_or_else(|| invalid(format!("RAM volume size {size} is too large")))?;
        // SAFETY: a fresh anonymous mapping; no existing memory is affected.
        let p = unsafe {
            libc::mmap(
                ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                // NORESERVE: the kernel's overcommit heuristic should not refuse a volume bigger
                // than free memory that may never be fully touched.
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(VolumeError::new(
                name,
                Op::Open,
                0,
                size,
                ErrorKind::Io(std::io::Error::last_os_error()),
            ));
        }
        // Huge pages cut TLB misses on the memcpy-bound hot path (lazy allocation then comes in
        // 2 MiB steps). Purely advisory, so a refusal (THP disabled) is fine.
        // SAFETY: advice on our own fresh mapping.
        unsafe { libc::madvise(p, len, libc::MADV_HUGEPAGE) };
        let base =
            NonNull::new(p.cast::<u8>()).ok_or_else(|| invalid("mmap returned null".into()))?;
        Ok(RamVolume {
            name: name.to_string(),
            base,
            size,
            stripes: (0..STRIPES).map(|_| Stripe(RwLock::new(()))).collect(),
        })
    }

    /// Allocate every page now, so benchmarks do not measure page faults. Content is unchanged.
    pub fn prefault(&self) {
        let len = self.size as usize;
        // SAFETY: MADV_POPULATE_WRITE (Linux 5.14+) faults pages in writable without changing
        // their content, so it cannot disturb concurrent requests.
        let r = unsafe { libc::madvise(self.base.as_ptr().cast(), len, libc::MADV_POPULATE_WRITE) };
        if r == 0 {
            return;
        }
        // Older kernels: write each page's first byte back to itself under the chunk's lock.
        for (off, _, n) in chunks(0, self.size) {
            let _g = self.stripe(off).write();
            let mut page = 0;
            while page < n {
                // SAFETY: in bounds (off + page < size) and we hold the chunk exclusively.
                unsafe {
                    let p = self.base.as_ptr().add(off as usize + page);
                    ptr::write_volatile(p, ptr::read_volatile(p));
                }
                page += PAGE;
            }
        }
    }

    fn stripe(&self, offset: u64) -> &RwLock<()> {
        &self.stripes[(offset >> CHUNK_SHIFT) as usize % STRIPES].0
    }

    fn zero(&self, op: Op, offset: u64, len: u64) -> Result<()> {
        check_range(self, op, offset, len)?;
        for (off, _, n) in chunks(offset, len) {
            let _g = self.stripe(off).write();
            // SAFETY: check_range keeps [off, off + n) inside the mapping; the chunk is ours.
            unsafe { ptr::write_bytes(self.base.as_ptr().add(off as usize), 0, n) };
        }
        Ok(())
    }
}

/// Below this, a write goes through the CPU caches as usual.
#[cfg(target_arch = "x86_64")]
const STREAM_MIN: usize = 4096;

/// Copy `n` bytes into the volume's memory. On x86_64, writes of a page or more use
/// non-temporal stores: the volume is large and touched at random, so its lines are almost never
/// in a CPU cache, and an ordinary copy first reads every destination line from RAM (read for
/// ownership) only to overwrite it. Streaming skips that read, and does not evict the caller's
/// hot data. The trailing `sfence` orders the streamed stores before the caller's lock release,
/// so a reader that takes the lock next sees the data.
///
/// # Safety
/// `src` and `dst` are valid for `n` bytes and do not overlap; `dst` is 16-byte aligned whenever
/// `n >= STREAM_MIN` (volume offsets are multiples of 512 from a page-aligned mapping).
unsafe fn copy_to_volume(src: *const u8, dst: *mut u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    if n >= STREAM_MIN && dst as usize % 16 == 0 {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_sfence, _mm_stream_si128};
        let mut i = 0;
        // SSE2 is part of x86_64, so these need no feature detection.
        while i + 64 <= n {
            let s = src.add(i) as *const __m128i;
            let d = dst.add(i) as *mut __m128i;
            let (a, b, c, e) = (
                _mm_loadu_si128(s),
                _mm_loadu_si128(s.add(1)),
                _mm_loadu_si128(s.add(2)),
                _mm_loadu_si128(s.add(3)),
            );
            _mm_stream_si128(d, a);
            _mm_stream_si128(d.add(1), b);
            _mm_stream_si128(d.add(2), c);
            _mm_stream_si128(d.add(3), e);
            i += 64;
        }
        ptr::copy_nonoverlapping(src.add(i), dst.add(i), n - i);
        _mm_sfence();
        return;
    }
    ptr::copy_nonoverlapping(src, dst, n);
}

/// Split `[offset, offset + len)` at chunk boundaries: (volume offset, offset in request, length).
fn chunks(offset: u64, len: u64) -> impl Iterator<Item = (u64, usize, usize)> {
    let end = offset + len;
    let mut off = offset;
    std::iter::from_fn(move || {
        if off >= end {
            return None;
        }
        let next = ((off >> CHUNK_SHIFT) + 1).saturating_mul(CHUNK).min(end);
        let item = (off, (off - offset) as usize, (next - off) as usize);
        off = next;
        Some(item)
    })
}

impl Volume for RamVolume {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self, Op::Read, offset, buf.len() as u64)?;
        for (off, pos, n) in chunks(offset, buf.len() as u64) {
            let _g = self.stripe(off).read();
            // SAFETY: the source is inside the mapping (range checked) and only written under the
            // exclusive lock we exclude; `buf` is a separate allocation (we never hand out
            // references into the mapping) with room for `pos + n` bytes.
            unsafe {
                ptr::copy_nonoverlapping(
                    self.base.as_ptr().add(off as usize),
                    buf.as_mut_ptr().add(pos),
                    n,
                )
            };
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        check_range(self, Op::Write, offset, buf.len() as u64)?;
        for (off, pos, n) in chunks(offset, buf.len() as u64) {
            let _g = self.stripe(off).write();
            // SAFETY: as in read_at, with the chunk held exclusively.
            unsafe {
                copy_to_volume(
                    buf.as_ptr().add(pos),
                    self.base.as_ptr().add(off as usize),
                    n,
                )
            };
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.zero(Op::Discard, offset, len)
    }

    fn discard_zeroes(&self) -> bool {
        true
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.zero(Op::WriteZeroes, offset, len)
    }
}

impl Drop for RamVolume {
    fn drop(&mut self) {
        // SAFETY: the mapping was created in new() with this length and nothing borrows it now.
        unsafe { libc::munmap(self.base.as_ptr().cast(), self.size as usize) };
    }
}

impl fmt::Debug for RamVolume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RamVolume")
            .field("name", &self.name)
            .field("size", &self.size)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use std::sync::Arc;

    fn pattern(seed: u8, len: usize) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn new_rejects_bad_sizes() {
        for size in [0, 511, 4097] {
            let e = RamVolume::new("ram:x", size).unwrap_err();
            assert!(matches!(e.kind, ErrorKind::Invalid(_)), "{e}");
            assert!(e.to_string().contains("multiple of 512"), "{e}");
        }
    }

    #[test]
    fn starts_zeroed_and_round_trips() {
        let v = RamVolume::new("ram:4M", 4 << 20).unwrap();
        let mut buf = vec![1u8; 8192];
        v.read_at(&mut buf, (4 << 20) - 8192).unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        // Sizes and offsets that start, end and straddle 64 KiB chunk boundaries.
        let cases = [
            (0u64, 512usize),
            (512, 4096),
            (CHUNK - 512, 1024),
            (CHUNK * 3 - 4096, CHUNK as usize * 2 + 8192),
            ((4 << 20) - 512, 512),
        ];
        for (i, &(off, len)) in cases.iter().enumerate() {
            let data = pattern(i as u8, len);
            v.write_at(&data, off).unwrap();
            let mut back = vec![0u8; len];
            v.read_at(&mut back, off).unwrap();
            assert_eq!(back, data, "case {i}");
        }
    }

    #[test]
    fn rejects_unaligned_and_out_of_range() {
        let v = RamVolume::new("ram:1M", 1 << 20).unwrap();
        let e = v.write_at(&[0; 512], 100).unwrap_err();
        assert!(matches!(e.kind, ErrorKind::Unaligned { block: 512 }));
        assert_eq!((e.op, e.offset, e.len), (Op::Write, 100, 512));
        let e = v.read_at(&mut [0; 100], 0).unwrap_err();
        assert!(matches!(e.kind, ErrorKind::Unaligned { .. }));
        let e = v.read_at(&mut [0; 1024], (1 << 20) - 512).unwrap_err();
        assert!(matches!(e.kind, ErrorKind::OutOfRange { .. }));
        let e = v.discard(u64::MAX - 511, 512).unwrap_err();
        assert!(matches!(e.kind, ErrorKind::OutOfRange { .. }));
        assert_eq!(e.device, "ram:1M");
    }

    #[test]
    fn discard_and_write_zeroes_zero_the_range() {
        let v = RamVolume::new("ram:1M", 1 << 20).unwrap();
        assert!(v.discard_zeroes());
        v.write_at(&vec![0xAB; 1 << 20], 0).unwrap();
        v.discard(4096, CHUNK * 2).unwrap();
        v.write_zeroes(CHUNK * 4 + 512, 1024).unwrap();
        let mut all = vec![0u8; 1 << 20];
        v.read_at(&mut all, 0).unwrap();
        for (i, &b) in all.iter().enumerate() {
            let i = i as u64;
            let zero = (4096..4096 + CHUNK * 2).contains(&i)
                || (CHUNK * 4 + 512..CHUNK * 4 + 1536).contains(&i);
            assert_eq!(b, if zero { 0 } else { 0xAB }, "byte {i}");
        }
    }

    #[test]
    fn prefault_keeps_content() {
        let v = RamVolume::new("ram:8M", 8 << 20).unwrap();
        let data = pattern(7, 4096);
        v.write_at(&data, 1 << 20).unwrap();
        v.prefault();
        let mut back = vec![0u8; 4096];
        v.read_at(&mut back, 1 << 20).unwrap();
        assert_eq!(back, data);
    }

    #[test]
    fn concurrent_disjoint_writers() {
        const THREADS: usize = 8;
        const PER_THREAD: u64 = 1 << 20;
        let v = Arc::new(RamVolume::new("ram:8M", THREADS as u64 * PER_THREAD).unwrap());
        let handles: Vec<_> = (0..THREADS)
            .map(|t| {
                let v = Arc::clone(&v);
                std::thread::spawn(move || {
                    let mut rng = rand::rngs::StdRng::seed_from_u64(t as u64);
                    let base = t as u64 * PER_THREAD;
                    // Random-sized writes that cross chunk boundaries, while other threads
                    // write neighbouring chunks that share stripes.
                    for _ in 0..500 {
                        let sectors = rng.gen_range(1..=64u64);
                        let start = rng.gen_range(0..PER_THREAD / 512 - sectors);
                        let data = vec![t as u8 + 1; sectors as usize * 512];
                        v.write_at(&data, base + start * 512).unwrap();
                        let mut back = vec![0u8; data.len()];
                        v.read_at(&mut back, base + start * 512).unwrap();
                        assert_eq!(back, data);
                    }
                    v.write_at(&vec![t as u8 + 1; PER_THREAD as usize], base)
                        .unwrap();
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        for t in 0..THREADS {
            let mut back = vec![0u8; PER_THREAD as usize];
            v.read_at(&mut back, t as u64 * PER_THREAD).unwrap();
            assert!(back.iter().all(|&b| b == t as u8 + 1), "thread {t}'s range");
        }
    }
}

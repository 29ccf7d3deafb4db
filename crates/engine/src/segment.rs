//! A request as the engine works on it: cut into segments, one per core line it touches, and
//! device I/O gathered into runs (contiguous on the device and in the request buffer).
//!
//! These are values, not state: a request builds them, the rooms below it read them. A
//! segment's `line`, `valid` and `dirty` are a lookup's result and hold only while the caller
//! keeps the segment's stripe locked.

use smallvec::SmallVec;

use crate::bits::{self, Mask};
use crate::locks::Span;
use crate::meta::{Key, NONE};

/// A request's segments where the read path keeps them: on the stack up to 2 lines (a request
/// within a line, or across one line boundary), on the heap beyond. Allocating and freeing a `Vec` for
/// them was about a fifth of a 4 KiB read hit's instructions (docs/performance.md §12).
pub(crate) type Segs = SmallVec<[Seg; 2]>;

/// A request's device runs where the read path keeps them: a hit of lines that follow each other
/// on the cache device is one run whatever its length.
pub(crate) type Runs = SmallVec<[Run; 2]>;

/// The part of a request that falls in one core line.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Seg {
    pub(crate) key: Key,
    /// First sector within the line, and sector count.
    pub(crate) first: u32,
    pub(crate) count: u32,
    /// Byte offset of this segment in the request buffer.
    pub(crate) buf_off: usize,
    /// The cache line holding this core line, or NONE.
    pub(crate) line: u32,
    pub(crate) valid: Mask,
    pub(crate) dirty: Mask,
}

impl Seg {
    pub(crate) fn mask(&self) -> Mask {
        bits::range(self.first, self.count)
    }
    pub(crate) fn mapped(&self) -> bool {
        self.line != NONE
    }
}

/// A contiguous piece of device IO covering a contiguous piece of the request buffer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Run {
    pub(crate) dev_off: u64,
    pub(crate) buf_off: usize,
    pub(crate) len: usize,
}

/// Append a run, merging it into the previous one when both the device and buffer ranges continue.
#[inline]
pub(crate) fn push_run<V>(runs: &mut V, dev_off: u64, buf_off: usize, len: usize)
where
    V: std::ops::DerefMut<Target = [Run]> + Extend<Run>,
{
    if let Some(last) = runs.last_mut() {
        if last.dev_off + last.len as u64 == dev_off && last.buf_off + last.len == buf_off {
            last.len += len;
            return;
        }
    }
    runs.extend(std::iter::once(Run {
        dev_off,
        buf_off,
        len,
    }));
}

/// The core lines `segs` cover: a request's segments are consecutive lines of one core.
pub(crate) fn span_of(segs: &[Seg]) -> Span {
    match (segs.first(), segs.last()) {
        (Some(first), Some(last)) => Span::new(first.key, last.key),
        _ => Span::none(),
    }
}

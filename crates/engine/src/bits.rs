//! Sector masks: one bit per 512-byte sector of a cache line (at most 128 sectors, 64 KiB).

/// A set of sectors within one cache line; bit i is sector i.
pub(crate) type Mask = u128;

/// Sectors `first .. first + count` (count may be 0).
#[inline]
pub(crate) fn range(first: u32, count: u32) -> Mask {
    debug_assert!(first + count <= 128);
    if count == 0 {
        0
    } else if count == 128 {
        Mask::MAX
    } else {
        ((1u128 << count) - 1) << first
    }
}

/// Runs of set bits as (first sector, sector count), in ascending order.
pub(crate) fn runs(mut mask: Mask) -> impl Iterator<Item = (u32, u32)> {
    std::iter::from_fn(move || {
        if mask == 0 {
            return None;
        }
        let first = mask.trailing_zeros();
        let len = (!(mask >> first)).trailing_zeros().min(128 - first);
        mask &= !range(first, len);
        Some((first, len))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_and_runs() {
        assert_eq!(range(0, 0), 0);
        assert_eq!(range(0, 8), 0xff);
        assert_eq!(range(120, 8), 0xffu128 << 120);
        assert_eq!(range(0, 128), u128::MAX);
        let m = range(1, 3) | range(8, 2) | range(127, 1);
        assert_eq!(runs(m).collect::<Vec<_>>(), vec![(1, 3), (8, 2), (127, 1)]);
        assert_eq!(runs(u128::MAX).collect::<Vec<_>>(), vec![(0, 128)]);
        assert_eq!(runs(0).count(), 0);
    }
}

//! Device-to-device pieces of a mirrored cache that need none of its state (mirror.rs holds
//! the pair): the copy of the metadata region from one device onto another
//! (`copy_commits_and_blocks`, the end of every rebuild: a new mirror, a first mirror, a new
//! primary). A volume cut to a size is window.rs's `Window`.

use hybridcache_volume::{Volume, VolumeError};

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

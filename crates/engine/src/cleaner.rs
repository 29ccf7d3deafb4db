//! Cleaning: writing dirty sectors to the core and marking them clean.
//!
//! One mechanism serves the user's flush, eviction under dirty pressure, and (later) background
//! cleaning policies: take a batch of dirty lines, sort them by core address, lock their stripes
//! in ascending order, and write their dirty sectors to the core with neighbouring sectors merged
//! into writes of up to [`MAX_MERGE`] bytes. A 1 MiB sequential write that was cached as 256 lines
//! of 4 KiB therefore goes back to the core as one 1 MiB write, not 256 small ones.

use crate::bits;
use crate::cache::{push_run, CacheInner, CoreState, Run};
use crate::meta::Key;
use crate::{Result, SECTOR};

/// Largest single core write cleaning issues.
pub(crate) const MAX_MERGE: usize = 1 << 20;
/// Dirty data cleaned under one set of locks by a flush; bounds how long client requests to
/// those lines wait.
const BATCH_BYTES: u64 = 4 << 20;

/// A dirty run of one line: where it lives on the core and in the cache.
struct Piece {
    item: usize,
    core_off: u64,
    cache_off: u64,
    len: usize,
}

impl CacheInner {
    /// Clean the given lines (those still dirty when locked). Caller holds no stripe.
    /// Returns how many lines were cleaned.
    pub(crate) fn clean_lines(&self, lines: Vec<u32>) -> Result<usize> {
        let mut items: Vec<(Key, u32)> = lines
            .into_iter()
            .filter_map(|l| self.table.key(l).map(|k| (k, l)))
            .collect();
        if items.is_empty() {
            return Ok(0);
        }
        items.sort_unstable();
        items.dedup();
        let mut stripes: Vec<u32> = items.iter().map(|(k, _)| self.table.stripe(*k)).collect();
        stripes.sort_unstable();
        stripes.dedup();
        let _locks = self.locks.lock_sorted(stripes);
        // The snapshot was taken without locks: keep only lines that still hold that key and
        // still have something dirty.
        items.retain(|&(k, l)| self.table.key(l) == Some(k) && self.table.dirty(l) != 0);

        let mut cleaned = 0;
        let mut first_error = None;
        for group in items.chunk_by(|a, b| a.0.core() == b.0.core()) {
            let core = match self.cores.read().get(&group[0].0.core()) {
                Some(c) => c.clone(),
                // Its lines are being dropped by core removal.
                None => continue,
            };
            match self.clean_group(&core, group) {
                Ok(n) => cleaned += n,
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(cleaned),
        }
    }

    /// Clean lines of one core, sorted by core line. Caller holds their stripes.
    fn clean_group(&self, core: &CoreState, items: &[(Key, u32)]) -> Result<usize> {
        let mut pieces = Vec::new();
        for (i, &(key, line)) in items.iter().enumerate() {
            for (first, n) in bits::runs(self.table.dirty(line)) {
                pieces.push(Piece {
                    item: i,
                    core_off: key.line() * self.line_bytes + first as u64 * SECTOR,
                    cache_off: self.data_offset
                        + line as u64 * self.line_bytes
                        + first as u64 * SECTOR,
                    len: n as usize * SECTOR as usize,
                });
            }
        }
        let mut failed = vec![false; items.len()];
        let mut first_error = None;
        let mut buf = Vec::new();
        let mut start = 0;
        while start < pieces.len() {
            // Extend the write while the core addresses continue and it stays under MAX_MERGE.
            let mut end = start + 1;
            let mut len = pieces[start].len;
            while end < pieces.len()
                && pieces[end].core_off == pieces[end - 1].core_off + pieces[end - 1].len as u64
                && len + pieces[end].len <= MAX_MERGE
            {
                len += pieces[end].len;
                end += 1;
            }
            let group = &pieces[start..end];
            buf.resize(len, 0);
            let mut reads = Vec::new();
            let mut at = 0;
            for p in group {
                push_run(&mut reads, p.cache_off, at, p.len);
                at += p.len;
            }
            let write = [Run {
                dev_off: group[0].core_off,
                buf_off: 0,
                len,
            }];
            let result = self
                .cache_read(core, &mut buf, &reads)
                .and_then(|()| self.core_write(core, &buf, &write));
            if let Err(e) = result {
                for p in group {
                    failed[p.item] = true;
                }
                first_error.get_or_insert(e);
            }
            start = end;
        }
        let mut cleaned = 0;
        for (i, &(key, line)) in items.iter().enumerate() {
            if !failed[i] {
                self.update_line(line, key, self.table.valid(line), 0, false);
                cleaned += 1;
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(cleaned),
        }
    }

    /// Clean every line of `core` that is dirty now, in core address order, then commit.
    pub(crate) fn flush_core_dirty(&self, core: &CoreState) -> Result<()> {
        let mut items: Vec<(Key, u32)> = (0..self.lines)
            .filter_map(|l| {
                let k = self.table.key(l)?;
                (k.core() == core.id && self.table.dirty(l) != 0).then_some((k, l))
            })
            .collect();
        items.sort_unstable();
        let batch = (BATCH_BYTES / self.line_bytes).max(1) as usize;
        for chunk in items.chunks(batch) {
            self.clean_lines(chunk.iter().map(|&(_, l)| l).collect())?;
        }
        // The flush is done when the core has the data durably and, for a persistent cache, the
        // device records the lines clean.
        self.commit()
    }
}

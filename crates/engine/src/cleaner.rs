//! Cleaning: writing dirty sectors to the core and marking them clean.
//!
//! One mechanism serves the user's flush, eviction under dirty pressure, and (later) background
//! cleaning policies: take a batch of dirty lines, sort them by core address, and write their
//! dirty sectors to the core with neighbouring sectors merged into writes of up to merge-max bytes
//! (1 MiB by default), and keep up to `depth` of those writes in flight at once (the policy's
//! flush-max-buffers, [`FLUSH_BUFFERS`] for flushes). A 1 MiB sequential write cached as 256
//! lines of 4 KiB goes back to the core as one 1 MiB write, not 256 small ones; scattered dirty
//! lines go back as many writes in parallel, so a disk array sees a queue it can reorder instead
//! of one write at a time.
//!
//! Each merged write locks only its own lines' stripes (in ascending order), from reading their
//! dirty masks to marking them clean. Holding the whole batch's stripes instead made client writes
//! to any of thousands of stripes wait for the whole batch: seconds in front of a disk array with
//! alru-very-aggressive's 8192-line batches (issue 20).
//!
//! [`FLUSH_BUFFERS`]: crate::policy::FLUSH_BUFFERS

use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use parking_lot::{Mutex, RwLock};

use crate::bits;
use crate::cleaning_state::{CleanerState, CleaningCounters, Pacer};
use crate::commit::Commit;
use crate::core_flush;
use crate::core_state::{CoreState, Cores};
use crate::devices::Devices;
use crate::inner::CacheInner;
use crate::lines::Lines;
use crate::locks::{InFlight, Span, SpanKind, WaitFor};
use crate::meta::Key;
use crate::persist::Persist;
use crate::policy::FLUSH_BUFFERS;
use crate::progress::FlushProgress;
use crate::room_wait::CleanerSignal;
use crate::segment::{push_run, Run};
use crate::stats::Counter;
use crate::{CleaningConfig, CoreId, EngineError, Result, SECTOR};

/// Dirty data cleaned under one set of locks by a flush; bounds how long client requests to
/// those lines wait.
const BATCH_BYTES: u64 = 64 << 20;
/// Most core writes cleaning keeps in flight at once, whatever flush-max-buffers allows: beyond
/// this, threads cost more than any device's queue gains.
const MAX_IN_FLIGHT: usize = 32;

/// A dirty run of one line: where it lives on the core and in the cache.
struct Piece {
    item: usize,
    core_off: u64,
    cache_off: u64,
    len: usize,
}

/// What cleaning works on, each by reference, lent by the holder (`cleaner_room()`) to the
/// cleaner thread's tick, to a flush of a core's dirty data, and to a write that makes room
/// (write.rs's `Writer` holds one): the line room (what is dirty, its locks, marking lines
/// clean), the devices (cache reads, core writes), the cores, persistence (cleaned lines wait
/// for a commit), cleaning's configuration, schedule, counters and pacing, the room signal and
/// a flush's progress.
///
/// Invariants: a line is marked clean only under its stripe, after the core write of every one
/// of its dirty runs succeeded, and only if it still holds the key it was read with (a debug
/// assertion in `mark_cleaned`: the unit's cleaning span keeps writes, discards and other
/// cleaning of it out meanwhile); on a persistent cache a cleaned line becomes reusable only
/// through a commit (`committer()`), never here.
pub(crate) struct Cleaner<'a> {
    lines: &'a Lines,
    devices: &'a Devices,
    cores: &'a Cores,
    persist: Option<&'a Persist>,
    cleaning: &'a RwLock<CleaningConfig>,
    /// The background policies' schedule (cleaning.rs), under its own mutex.
    cleaner: &'a Mutex<CleanerState>,
    cleaning_counters: &'a CleaningCounters,
    pacer: &'a Pacer,
    cleaner_signal: &'a CleanerSignal,
    flush_progress: &'a FlushProgress,
    line_bytes: u64,
}

impl CacheInner {
    #[inline]
    pub(crate) fn cleaner_room(&self) -> Cleaner<'_> {
        Cleaner {
            lines: &self.lines,
            devices: &self.devices,
            cores: &self.cores,
            persist: self.persist.as_ref(),
            cleaning: &self.cleaning,
            cleaner: &self.cleaner,
            cleaning_counters: &self.cleaning_counters,
            pacer: &self.pacer,
            cleaner_signal: &self.cleaner_signal,
            flush_progress: &self.flush_progress,
            line_bytes: self.line_bytes,
        }
    }

    /// [`Cleaner::clean_lines`] on the holder's rooms (unit tests drive it directly).
    #[cfg(test)]
    pub(crate) fn clean_lines(&self, lines: Vec<u32>, depth: usize, paced: bool) -> Result<usize> {
        self.cleaner_room().clean_lines(lines, depth, paced)
    }
}

impl<'a> Cleaner<'a> {
    /// The commit protocol on the rooms cleaning holds.
    #[inline]
    pub(crate) fn committer(&self) -> Commit<'a> {
        Commit::new(
            self.devices,
            self.persist,
            self.lines,
            self.cores,
            self.cleaner_signal,
        )
    }

    #[inline]
    pub(crate) fn lines(&self) -> &'a Lines {
        self.lines
    }

    #[inline]
    pub(crate) fn cores(&self) -> &'a Cores {
        self.cores
    }

    #[inline]
    pub(crate) fn persist(&self) -> Option<&'a Persist> {
        self.persist
    }

    #[inline]
    pub(crate) fn cleaning(&self) -> &'a RwLock<CleaningConfig> {
        self.cleaning
    }

    #[inline]
    pub(crate) fn schedule(&self) -> &'a Mutex<CleanerState> {
        self.cleaner
    }

    #[inline]
    pub(crate) fn signal(&self) -> &'a CleanerSignal {
        self.cleaner_signal
    }

    #[inline]
    pub(crate) fn devices(&self) -> &'a Devices {
        self.devices
    }

    #[inline]
    pub(crate) fn counters(&self) -> &'a CleaningCounters {
        self.cleaning_counters
    }

    #[inline]
    pub(crate) fn line_bytes(&self) -> u64 {
        self.line_bytes
    }

    /// Clean the given lines (those still dirty when locked), `depth` core writes at most in
    /// flight, `paced` by the cleaning bandwidth cap and committing ahead of need between units
    /// (`commit_ahead`; both for background cleaning only). Caller holds
    /// no stripe. Returns how many lines were cleaned.
    ///
    /// Stripes are locked per unit of work (the lines of one merged core write), never for the
    /// whole batch: a batch of thousands of scattered lines takes seconds on a disk array, and a
    /// client request to any of those stripes would wait for all of it (issue 20).
    pub(crate) fn clean_lines(&self, lines: Vec<u32>, depth: usize, paced: bool) -> Result<usize> {
        self.clean_lines_for(lines, depth, paced, None)
    }

    /// As [`clean_lines`](Cleaner::clean_lines), for a flush: each core write that completes
    /// counts its lines in `flush`'s progress, and once the flush is interrupted no further
    /// write starts (the writes in flight complete and their lines are recorded clean).
    fn clean_lines_for(
        &self,
        lines: Vec<u32>,
        depth: usize,
        paced: bool,
        flush: Option<&FlushProgress>,
    ) -> Result<usize> {
        let mut items: Vec<(Key, u32)> = lines
            .into_iter()
            .filter_map(|l| self.lines.table().key(l).map(|k| (k, l)))
            .collect();
        // The snapshot is taken without locks; each unit looks again under its stripes.
        items.retain(|&(_, l)| self.lines.table().dirty(l) != 0);
        if items.is_empty() {
            return Ok(0);
        }
        items.sort_unstable();
        items.dedup();

        let mut cleaned = 0;
        let mut first_error = None;
        for group in items.chunk_by(|a, b| a.0.core() == b.0.core()) {
            let core = match self.cores.get(group[0].0.core()) {
                Some(c) => c,
                // Its lines are being dropped by core removal.
                None => continue,
            };
            match self.clean_group(&core, group, depth, paced, flush) {
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

    /// The dirty runs of `items` (sorted by core line) as pieces, with the dirty masks read now.
    fn pieces(&self, items: &[(Key, u32)]) -> Vec<Piece> {
        let mut pieces = Vec::new();
        for (i, &(key, line)) in items.iter().enumerate() {
            for (first, n) in bits::runs(self.lines.table().dirty(line)) {
                pieces.push(Piece {
                    item: i,
                    core_off: key.line() * self.line_bytes + first as u64 * SECTOR,
                    cache_off: self.devices.data_offset()
                        + line as u64 * self.line_bytes
                        + first as u64 * SECTOR,
                    len: n as usize * SECTOR as usize,
                });
            }
        }
        pieces
    }

    /// Core writes of `pieces`: ranges `(start, end, bytes)` of pieces whose core addresses
    /// continue, `merge_max` bytes at most each, and cut where the core address is a multiple of
    /// `merge_max` (rounded down to a power of two). A disk array's stripe divides such a size,
    /// so a long dirty run goes back in whole stripes: cut only by size, its writes started
    /// wherever the run did, and each one began and ended in the middle of a stripe, two
    /// read-modify-writes each on a RAID 6 (a full cache of sequential data drained to the study
    /// RAID at a fraction of what whole stripes take, issue 20).
    fn merged_writes(pieces: &[Piece], merge_max: usize) -> Vec<(usize, usize, usize)> {
        let align = 1u64 << (usize::BITS - 1 - merge_max.max(1).leading_zeros());
        let mut writes = Vec::new();
        let mut start = 0;
        while start < pieces.len() {
            let mut end = start + 1;
            let mut len = pieces[start].len;
            while end < pieces.len()
                && pieces[end].core_off == pieces[end - 1].core_off + pieces[end - 1].len as u64
                && len + pieces[end].len <= merge_max
                && pieces[end].core_off % align != 0
            {
                len += pieces[end].len;
                end += 1;
            }
            writes.push((start, end, len));
            start = end;
        }
        writes
    }

    /// Clean lines of one core, sorted by core line. Caller holds no stripe.
    ///
    /// The batch is cut into units: the lines of one merged core write (or of a few, when a
    /// line with several dirty runs shares writes with both neighbours). Up to `depth` workers
    /// each take a unit and clean it (`clean_unit`): under its stripes (ascending; a worker
    /// holds one unit's at a time, so workers cannot deadlock each other or a request) it reads
    /// its lines' dirty masks again and registers the unit's span, then writes without the
    /// stripes and takes them again to mark the lines clean. A write waits only for a unit that
    /// covers one of its lines, one core write, not for the batch; other requests do not wait.
    fn clean_group(
        &self,
        core: &CoreState,
        items: &[(Key, u32)],
        depth: usize,
        paced: bool,
        flush: Option<&FlushProgress>,
    ) -> Result<usize> {
        let io = self.cleaning.read().io;
        let merge_max = io.merge_max_kib as usize * 1024;
        // Units from the unlocked snapshot: consecutive writes that share a line stay together,
        // since a line is marked clean only once all of its runs are written.
        let pieces = self.pieces(items);
        let mut units: Vec<std::ops::Range<usize>> = Vec::new();
        for (start, end, _) in Self::merged_writes(&pieces, merge_max) {
            let (first, last) = (pieces[start].item, pieces[end - 1].item);
            match units.last_mut() {
                Some(u) if u.end > first => u.end = last + 1,
                _ => units.push(first..last + 1),
            }
        }
        drop(pieces);

        let first_error = Mutex::new(None);
        let next = AtomicUsize::new(0);
        let cleaned = AtomicUsize::new(0);
        let worker = || {
            let mut buf = Vec::new();
            loop {
                if flush.is_some_and(|f| f.interrupted()) {
                    break;
                }
                let u = next.fetch_add(1, Relaxed);
                let Some(range) = units.get(u) else {
                    break;
                };
                match self.clean_unit(core, &items[range.clone()], &mut buf, merge_max, paced) {
                    Ok(n) => {
                        cleaned.fetch_add(n, Relaxed);
                        if let Some(f) = flush {
                            f.cleaned(n as u64);
                        }
                    }
                    Err(e) => {
                        first_error.lock().get_or_insert(e);
                    }
                }
                if paced {
                    // Background cleaning, between units (no stripe held).
                    self.committer().commit_ahead(self.cleaning_counters);
                }
            }
        };
        let threads = units.len().min(depth).clamp(1, MAX_IN_FLIGHT);
        if threads == 1 {
            worker();
        } else {
            std::thread::scope(|s| {
                for _ in 1..threads {
                    s.spawn(worker);
                }
                worker();
            });
        }
        let cleaned = cleaned.into_inner();
        match first_error.into_inner() {
            Some(e) => Err(e),
            None => Ok(cleaned),
        }
    }

    /// Count one cleaner write of `len` bytes (read from the cache, written to the core) on its
    /// core, and on the IO classes of the lines in it: a request for each class it touched, the
    /// bytes of each line's piece on that line's class.
    fn count_cleaner_write(
        &self,
        core: &CoreState,
        items: &[(Key, u32)],
        group: &[Piece],
        len: usize,
    ) {
        let c = &core.counters();
        c.add(Counter::CleanerRequests, 1);
        c.add(Counter::CleanerCacheReadBytes, len as u64);
        c.add(Counter::CleanerCoreWrittenBytes, len as u64);
        if !self.lines.classes().active() {
            return;
        }
        let mut seen: Vec<crate::ioclass::ClassId> = Vec::new();
        for p in group {
            let line = items[p.item].1;
            let class = self.lines.classes().class_of(line);
            if !seen.contains(&class) {
                seen.push(class);
                self.lines
                    .classes()
                    .count_line(core.classes(), line, Counter::CleanerRequests, 1);
            }
            self.lines.classes().count_line(
                core.classes(),
                line,
                Counter::CleanerCacheReadBytes,
                p.len as u64,
            );
            self.lines.classes().count_line(
                core.classes(),
                line,
                Counter::CleanerCoreWrittenBytes,
                p.len as u64,
            );
        }
    }

    /// Clean one unit of lines (sorted by core line): what is dirty in them now goes to the core,
    /// then they are marked clean. The stripes are held to find what is dirty and to mark it
    /// clean, not across the core writes: the unit's span keeps writes to its lines out
    /// meanwhile (locks.rs), and requests for other lines of its stripes go on. Returns how many
    /// lines were cleaned; a line whose write failed stays dirty (the first error is returned
    /// once the others are done).
    fn clean_unit(
        &self,
        core: &CoreState,
        unit: &[(Key, u32)],
        buf: &mut Vec<u8>,
        merge_max: usize,
        paced: bool,
    ) -> Result<usize> {
        let (Some(&(first, _)), Some(&(last, _))) = (unit.first(), unit.last()) else {
            return Ok(0);
        };
        let span = Span::new(first, last);
        let stripes = self.lines.stripes_of(unit.iter().map(|&(k, _)| k));
        let locks = self
            .lines
            .locks()
            .lock_clear(stripes.clone(), span, WaitFor::All);
        // Keep only lines that still hold that key and still have something dirty.
        let items: Vec<(Key, u32)> = unit
            .iter()
            .copied()
            .filter(|&(k, l)| {
                self.lines.table().key(l) == Some(k) && self.lines.table().dirty(l) != 0
            })
            .collect();
        if items.is_empty() {
            return Ok(0);
        }
        // Until the lines are marked clean, no write, discard or other cleaning of them runs,
        // so their dirty sectors stay those read here; reads may still fill in others.
        let in_flight = locks.begin(span, SpanKind::Cleaning);
        drop(locks);
        let (failed, first_error) = self.write_pieces(core, &items, buf, merge_max, paced);
        let cleaned = self.mark_cleaned(stripes, &items, &failed, in_flight);
        // Counted as they go, so that cleaning's throughput can be sampled during a batch.
        self.cleaning_counters.cleaned(cleaned as u64);
        if cleaned > 0 {
            if self.persist.is_none() {
                // Reusable at once (no commit needed): writes waiting for a line may take them.
                self.cleaner_signal.room_made();
            } else {
                // Reusable once a commit records them clean (`commit_ahead`).
                self.cleaner_signal.cleaned_uncommitted(cleaned as u64);
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(cleaned),
        }
    }

    /// The merged core writes of a unit's dirty pieces (cache read, then core write, paced when
    /// `paced`), counted as they go. Which items failed, and the first error.
    fn write_pieces(
        &self,
        core: &CoreState,
        items: &[(Key, u32)],
        buf: &mut Vec<u8>,
        merge_max: usize,
        paced: bool,
    ) -> (Vec<bool>, Option<EngineError>) {
        let pieces = self.pieces(items);
        let mut failed = vec![false; items.len()];
        let mut first_error = None;
        let max_bandwidth = self.cleaning.read().io.max_bandwidth_mib_s;
        for (start, end, len) in Self::merged_writes(&pieces, merge_max) {
            let group = &pieces[start..end];
            // Grow only: the runs below address the first `len` bytes, and re-zeroing a
            // megabyte per write costs a tenth of the copy.
            if buf.len() < len {
                buf.resize(len, 0);
            }
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
            if paced {
                self.pacer.wait(len, max_bandwidth);
            }
            let c = &self.cleaning_counters;
            c.write_begins();
            let result = self
                .devices
                .cache_read_dirty(core, buf, &reads)
                .inspect_err(|_| {
                    // Which of the group's dirty data is lost, to name it.
                    let pieces = group.iter().map(|p| (p.core_off, p.cache_off, p.len));
                    self.devices.find_unreadable_dirty(core.id(), pieces);
                })
                .and_then(|()| self.devices.core_write(core, buf, &write));
            c.write_ends();
            match result {
                Ok(()) => {
                    c.record(len);
                    self.count_cleaner_write(core, items, group, len);
                }
                Err(e) => {
                    for p in group {
                        failed[p.item] = true;
                    }
                    c.failed(core.id(), &e);
                    first_error.get_or_insert(e);
                }
            }
        }
        (failed, first_error)
    }

    /// Mark the unit's written lines clean, under their stripes again, and end the cleaning span
    /// that held writes of them off meanwhile. How many were marked.
    fn mark_cleaned(
        &self,
        stripes: Vec<u32>,
        items: &[(Key, u32)],
        failed: &[bool],
        in_flight: InFlight<'_>,
    ) -> usize {
        let locks = self.lines.locks().lock_sorted(stripes);
        let mut cleaned = 0;
        for (i, &(key, line)) in items.iter().enumerate() {
            debug_assert_eq!(
                self.lines.table().key(line),
                Some(key),
                "a line changed under cleaning"
            );
            if !failed[i] {
                let valid = self.lines.table().valid(line);
                self.lines
                    .update_line(self.persist, line, key, valid, 0, false);
                cleaned += 1;
            }
        }
        drop(in_flight);
        drop(locks);
        cleaned
    }

    /// Clean every line of `core` that is dirty now, in core address order, then commit.
    fn flush_core_dirty(&self, core: &CoreState) -> Result<()> {
        let mut items: Vec<(Key, u32)> = (0..self.lines.count())
            .filter_map(|l| {
                let k = self.lines.table().key(l)?;
                (k.core() == core.id() && self.lines.table().dirty(l) != 0).then_some((k, l))
            })
            .collect();
        items.sort_unstable();
        let batch = (BATCH_BYTES / self.line_bytes).clamp(1, FLUSH_BUFFERS as u64) as usize;
        for chunk in items.chunks(batch) {
            // A flush is what its caller waits for: never paced by the bandwidth cap.
            let cleaned = self.clean_lines_for(
                chunk.iter().map(|&(_, l)| l).collect(),
                FLUSH_BUFFERS as usize,
                false,
                Some(self.flush_progress),
            )?;
            if self.flush_progress.interrupted() {
                // What was cleaned so far is recorded clean by the commit; the rest stays dirty.
                self.committer().commit()?;
                return Err(self.flush_progress.interrupted_error());
            }
            // Lines of the batch something else cleaned first are done too.
            self.flush_progress
                .skipped((chunk.len() as u64).saturating_sub(cleaned as u64));
        }
        // The flush is done when the core has the data durably and, for a persistent cache, the
        // device records the lines clean.
        let commit = self.committer();
        commit.commit()?;
        commit.retry_failing_core(core)
    }
}

/// Flush the dirty data of `cores`, each on its own thread, giving up on a core whose device
/// hangs (see the module doc). One core: its own error. Several: the per-core results when any
/// failed, or the interruption when the flush was interrupted.
pub(crate) fn flush_cores_dirty(inner: &Arc<CacheInner>, cores: Vec<Arc<CoreState>>) -> Result<()> {
    let (tx, rx) = mpsc::channel::<(CoreId, Result<()>)>();
    let limit = core_flush::core_flush_timeout();
    let mut results: Vec<(CoreId, Result<()>)> = Vec::new();
    let running = start_dirty_flushes(inner, cores, &tx, limit, &mut results);
    drop(tx);
    wait_dirty_flushes(&rx, running, limit, &mut results);
    dirty_flushes_outcome(inner, results)
}

/// Start a thread flushing each of `cores`' dirty data; returns the cores whose flush runs.
/// A core whose earlier flush hangs, or flushed here for want of a thread, has its result in
/// `results` instead.
fn start_dirty_flushes(
    inner: &Arc<CacheInner>,
    cores: Vec<Arc<CoreState>>,
    tx: &mpsc::Sender<(CoreId, Result<()>)>,
    limit: Duration,
    results: &mut Vec<(CoreId, Result<()>)>,
) -> Vec<Arc<CoreState>> {
    let mut running = Vec::new();
    for core in cores {
        // Flushes of one core may run together (two operators, -F during a stop); a new one is
        // refused only while an earlier one waits on a hung device.
        let earlier = core.watch().dirty_flush_begins();
        if earlier > 0 && core.watch().hung(limit) {
            core.watch().dirty_flush_ends();
            let e = core_flush::timed_out(
                core.id(),
                "its previous flush is still waiting for the device",
            );
            results.push((core.id(), Err(e)));
            continue;
        }
        let (tx, job_inner, job_core) = (tx.clone(), inner.clone(), core.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("core{}-flush-dirty", core.id()))
            .spawn(move || {
                let r = job_inner.cleaner_room().flush_core_dirty(&job_core);
                job_core.watch().dirty_flush_ends();
                let _ = tx.send((job_core.id(), r));
            });
        match spawned {
            Ok(_) => running.push(core),
            Err(_) => {
                // No thread to spare: flush here, unbounded, rather than not at all.
                let r = inner.cleaner_room().flush_core_dirty(&core);
                core.watch().dirty_flush_ends();
                results.push((core.id(), r));
            }
        }
    }
    running
}

/// Collect the results of the `running` flushes into `results`, a core whose device completes
/// nothing for `limit` counting as timed out (its thread goes on waiting).
fn wait_dirty_flushes(
    rx: &mpsc::Receiver<(CoreId, Result<()>)>,
    mut running: Vec<Arc<CoreState>>,
    limit: Duration,
    results: &mut Vec<(CoreId, Result<()>)>,
) {
    while !running.is_empty() {
        match rx.recv_timeout(Duration::from_millis(100).min(limit)) {
            Ok((id, r)) => {
                running.retain(|c| c.id() != id);
                results.push((id, r));
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                for c in running.drain(..) {
                    let e = EngineError::Invalid(format!(
                        "core {}: the flush thread ended without a result",
                        c.id()
                    ));
                    results.push((c.id(), Err(e)));
                }
                break;
            }
        }
        running.retain(|c| {
            if c.watch().hung(limit) {
                // Its thread goes on waiting for the device; the core's lines stay dirty.
                results.push((
                    c.id(),
                    Err(core_flush::timed_out(
                        c.id(),
                        "its device completed no write or flush",
                    )),
                ));
                false
            } else {
                true
            }
        });
    }
}

/// The flush's result from each core's: one core, its own; several, the interruption if any
/// was interrupted, else every core's result when any failed.
fn dirty_flushes_outcome(inner: &CacheInner, mut results: Vec<(CoreId, Result<()>)>) -> Result<()> {
    results.sort_by_key(|(id, _)| *id);
    if results.len() == 1 {
        return results.pop().map_or(Ok(()), |(_, r)| r);
    }
    if results
        .iter()
        .any(|(_, r)| matches!(r, Err(EngineError::FlushInterrupted { .. })))
    {
        // Counted over every core's flush (the progress entry they share).
        return Err(inner.flush_progress.interrupted_error());
    }
    if results.iter().all(|(_, r)| r.is_ok()) {
        return Ok(());
    }
    Err(EngineError::CoreFlushes(
        results
            .into_iter()
            .map(|(id, r)| (id, r.err().map(|e| e.to_string())))
            .collect(),
    ))
}

//! The read path: a single read (`read`: plan, device I/O, finish) and batched reads of one
//! core (several requests of a pipelining client at once). It runs on a `Reader`, the rooms it
//! uses by reference, which the holder lends per request; it queues read-ahead, whose worker is
//! readahead.rs.
//!
//! Batched reads: each request goes through the same steps as a single read (`read_plan` and
//! `read_finish`, with the same statistics and policy side effects); what changes is that the
//! cache device reads of the requests that are pure cache hits are submitted together
//! ([`Volume::read_batch`]: one `io_uring_enter` for the batch on a file volume), so the device
//! sees them in parallel and one thread serves a whole batch without a wake-up per request.
//!
//! Locks: a batch holds the stripes of every hit it has planned until their data is read. A
//! request whose stripes are not free at once (or are already held by the batch) first finishes
//! the planned hits, releasing their stripes, and only then waits for its own: the thread never
//! waits for a stripe while it holds another, so the locking rule of locks.rs still holds.
//! A request that needs the core (a miss, pass-through, offload) finishes the planned hits first
//! too, so hits never wait behind a slow core read.
//!
//! Invariants: a read changes lines only to insert what it fetched from the core (invalid
//! sectors, never a dirty one) and to touch them in the LRU, under its stripes; a failed cache
//! read falls back to the core only when none of its sectors is dirty.

use std::sync::atomic::{AtomicU8, Ordering};
use std::time::Instant;

use hybridcache_volume::ReadPiece;

use crate::admission::Admission;
use crate::bits::{self};
use crate::classes::ReqClass;
use crate::core_state::{CoreState, Entered};
use crate::devices::Devices;
use crate::inner::{serving_mode, CacheInner};
use crate::latency::{self, LatencyKind};
use crate::lines::Lines;
use crate::locks::{Span, StripeGuard, Stripes, WaitFor};
use crate::meta::Key;
use crate::persist::Persist;
use crate::prefetch::{reserve, Job, PrefetchState, ReadStreams};
use crate::segment::{push_run, span_of, Run, Runs, Seg, Segs};
use crate::stats::{classify, Counter};
use crate::{CacheMode, CoreId, Result, MAX_REQUEST, SECTOR};

/// What the read path works on, by reference, as the holder lends it (`CacheInner::reader`):
/// the line room (lookup, stripes, line updates), the devices, persistence (a line a read
/// inserts or fills is recorded for the next commit), read-ahead's state (its marks, its queue),
/// admission, and the mode as set. Built per request for free (a few references); a read
/// reaches nothing else of the cache.
pub(crate) struct Reader<'a> {
    lines: &'a Lines,
    devices: &'a Devices,
    persist: Option<&'a Persist>,
    prefetch: &'a PrefetchState,
    admission: Admission<'a>,
    /// The mode set; a mirror or fallback may serve another (`serving_mode`).
    mode: &'a AtomicU8,
    line_bytes: u64,
}

impl CacheInner {
    /// The read path's view of this cache.
    #[inline]
    pub(crate) fn reader(&self) -> Reader<'_> {
        Reader {
            lines: &self.lines,
            devices: &self.devices,
            persist: self.persist.as_ref(),
            prefetch: &self.prefetch,
            admission: self.admission(),
            mode: &self.mode,
            line_bytes: self.line_bytes,
        }
    }
}

/// A read planned up to its device I/O (see `Reader::read_plan`). Holds its stripes and its
/// registration with the core.
pub(crate) struct ReadPlan<'a> {
    pub(crate) _entered: Entered<'a>,
    pub(crate) locks: StripeGuard<'a>,
    pub(crate) segs: Segs,
    pub(crate) core_runs: Runs,
    pub(crate) cache_runs: Runs,
    pub(crate) bypass: bool,
    pub(crate) class: Option<ReqClass>,
}

/// What a read found in the cache: its valid sectors, and the lines read-ahead filled that it
/// hits first.
#[derive(Default, Clone, Copy)]
struct Found {
    cached_sectors: u64,
    prefetch_hits: u64,
}

/// A planned pure hit waiting for the batch's cache read: its request's index and plan.
type Pending<'a> = Vec<(usize, ReadPlan<'a>)>;

impl<'a> Reader<'a> {
    /// The mode reads are served in now (read per request, as a switch may come between two).
    #[inline]
    fn mode(&self) -> CacheMode {
        serving_mode(self.mode, self.devices)
    }

    #[inline]
    fn core_off(&self, key: Key, sector: u32) -> u64 {
        key.line() * self.line_bytes + sector as u64 * SECTOR
    }

    #[inline]
    pub(crate) fn read(&self, core: &CoreState, buf: &mut [u8], offset: u64) -> Result<()> {
        let Some(plan) = self.read_plan(core, buf.len(), offset, |stripes, span| {
            self.lines
                .locks()
                .lock_clear(stripes, span, WaitFor::Around)
        })?
        else {
            return Ok(());
        };
        self.devices.core_read(core, buf, &plan.core_runs)?;
        let cached = self.devices.cache_read(core, buf, &plan.cache_runs);
        self.read_finish(core, buf, offset, plan, cached)
    }

    /// Everything a read does before its device I/O: the checks, classification, seq cutoff,
    /// locking (by `lock`, given the sorted stripes and the span of core lines), lookup,
    /// promotion and offload decisions, statistics, and which sectors come from the core and
    /// which from the cache. None for an empty read. The plan holds the stripes until
    /// [`read_finish`](Self::read_finish).
    #[inline]
    fn read_plan(
        &self,
        core: &'a CoreState,
        len: usize,
        offset: u64,
        lock: impl FnOnce(Stripes, Span) -> StripeGuard<'a>,
    ) -> Result<Option<ReadPlan<'a>>> {
        crate::check_request(core.size(), offset, len as u64, Some(MAX_REQUEST))?;
        if len == 0 {
            return Ok(None);
        }
        let entered = core.enter()?;
        let mode = self.mode();
        // In wo and pt, and for a request sequential cutoff or promotion turns away, only dirty
        // sectors come from the cache and nothing is inserted.
        let class = self
            .lines
            .classes()
            .classify(core.id(), offset, len as u64, false);
        let mut bypass = matches!(mode, CacheMode::Wo | CacheMode::Pt)
            || class.is_some_and(|c| c.cap == 0)
            || self.admission.cut_off(core, offset, len as u64, false);
        let mut segs = self.lines.segments_small(core.id(), offset, len as u64);
        let locks = lock(self.lines.stripes_small(&segs), span_of(&segs));
        let waited = locks.waited();
        self.lines.lookup(&mut segs);
        bypass = bypass || self.admission.promotion_declines(&segs);
        // Offload may serve a hit from the core only when no line it touches has a dirty
        // sector: the core then holds the very data the cache does. The stripes stay locked
        // through the core read, so no write can dirty them meanwhile.
        let offloaded = !bypass
            && segs
                .iter()
                .all(|s| s.mapped() && s.dirty == 0 && s.mask() & !s.valid == 0)
            && self.devices.offload().take(core.id() as usize);
        bypass = bypass || offloaded;

        let (core_runs, cache_runs, found) = self.read_runs(&segs, bypass);
        self.count_read(core, class, len, bypass, offloaded, waited, found);
        Ok(Some(ReadPlan {
            _entered: entered,
            locks,
            segs,
            core_runs,
            cache_runs,
            bypass,
            class,
        }))
    }

    /// Which sectors of `segs` a read takes from the core and which from the cache (only dirty
    /// ones when `bypass`), as device runs; what it found cached, and how many lines read-ahead
    /// brought in are hit for the first time.
    #[inline]
    fn read_runs(&self, segs: &[Seg], bypass: bool) -> (Runs, Runs, Found) {
        let mut core_runs = Runs::new();
        let mut cache_runs = Runs::new();
        let mut found = Found::default();
        for s in segs {
            let m = s.mask();
            let from_cache = m & if bypass { s.dirty } else { s.valid };
            if from_cache != 0 && self.prefetch.take_mark(s.line) {
                found.prefetch_hits += 1;
            }
            found.cached_sectors += (m & s.valid).count_ones() as u64;
            // The usual cases, a segment wholly from the cache (a hit) or wholly from the core
            // (a miss), are one run each: no walk over the mask's runs.
            if from_cache == m || from_cache == 0 {
                let (runs, dev_off) = if from_cache == m {
                    (&mut cache_runs, self.devices.cache_off(s.line, s.first))
                } else {
                    (&mut core_runs, self.core_off(s.key, s.first))
                };
                push_run(runs, dev_off, s.buf_off, s.count as usize * SECTOR as usize);
                continue;
            }
            for (first, n) in bits::runs(m & !from_cache) {
                let len = n as usize * SECTOR as usize;
                let buf_off = s.buf_off + (first - s.first) as usize * SECTOR as usize;
                push_run(&mut core_runs, self.core_off(s.key, first), buf_off, len);
            }
            for (first, n) in bits::runs(from_cache) {
                let len = n as usize * SECTOR as usize;
                let buf_off = s.buf_off + (first - s.first) as usize * SECTOR as usize;
                push_run(
                    &mut cache_runs,
                    self.devices.cache_off(s.line, first),
                    buf_off,
                    len,
                );
            }
        }
        (core_runs, cache_runs, found)
    }

    /// A read's statistics: its outcome (hit, partial or full miss, pass-through), deferral,
    /// offload, bytes and read-ahead hits, on the core and on its IO class.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    fn count_read(
        &self,
        core: &CoreState,
        class: Option<ReqClass>,
        len: usize,
        bypass: bool,
        offloaded: bool,
        waited: bool,
        found: Found,
    ) {
        let c = &core.counters();
        let total = len as u64 / SECTOR;
        let outcome = if bypass {
            Counter::PassThroughReads
        } else {
            classify(
                found.cached_sectors,
                total,
                Counter::ReadHits,
                Counter::ReadPartialMisses,
                Counter::ReadFullMisses,
            )
        };
        c.add(outcome, 1);
        if waited && matches!(outcome, Counter::ReadHits) {
            c.add(Counter::ReadDeferred, 1);
        }
        if offloaded {
            c.add(Counter::OffloadReads, 1);
        }
        c.add(Counter::ExportedReadBytes, len as u64);
        c.add(Counter::PrefetchHits, found.prefetch_hits);
        // A request has a class only while IO classes are loaded.
        if class.is_some() {
            let (classes, of_core) = (self.lines.classes(), core.classes());
            classes.count(of_core, class, outcome, 1);
            if waited && matches!(outcome, Counter::ReadHits) {
                classes.count(of_core, class, Counter::ReadDeferred, 1);
            }
            if offloaded {
                classes.count(of_core, class, Counter::OffloadReads, 1);
            }
            classes.count(of_core, class, Counter::PrefetchHits, found.prefetch_hits);
            classes.count(of_core, class, Counter::ExportedReadBytes, len as u64);
        }
    }

    /// The rest of a read once its core runs are in `buf` and its cache runs were read with
    /// result `cached`: the fallback for a failed cache read, insertion, and read-ahead.
    #[inline]
    fn read_finish(
        &self,
        core: &CoreState,
        buf: &mut [u8],
        offset: u64,
        plan: ReadPlan<'_>,
        cached: Result<()>,
    ) -> Result<()> {
        let ReadPlan {
            locks,
            segs,
            bypass,
            class,
            ..
        } = plan;
        if let Err(e) = cached {
            // The cache device failed: clean sectors can still come from the core, dirty ones
            // only from a mirror.
            return self.devices.read_around_cache(core, buf, &segs, e);
        }

        if bypass {
            for s in segs.iter().filter(|s| s.mapped() && s.dirty == 0) {
                self.lines.touch_clean(s.line);
            }
            return Ok(());
        }
        self.insert_after_read(core, buf, &segs, class);
        drop(locks);
        if self.prefetch.enabled() {
            // Only queued here: the worker does the IO, this read does not wait for it.
            let len = buf.len() as u64;
            self.queue_readahead(
                core.id(),
                core.read_streams(),
                core.size(),
                offset,
                len,
                class,
            );
        }
        Ok(())
    }

    /// Put what a read fetched from the core into the cache: missing sectors of mapped lines, and
    /// new lines for unmapped ones when a line can be had.
    #[inline]
    fn insert_after_read(
        &self,
        core: &CoreState,
        buf: &[u8],
        segs: &[Seg],
        class: Option<ReqClass>,
    ) {
        // Once no line can be had, later unmapped segments are just served from the core; mapped
        // ones still get their missing sectors.
        let mut lines_left = true;
        for s in segs {
            let m = s.mask();
            let missing = m & !s.valid;
            if s.mapped() {
                if missing != 0
                    && self
                        .devices
                        .cache_write_mask(core, buf, s, s.line, missing)
                        .is_ok()
                {
                    self.lines.update_line(
                        self.persist,
                        s.line,
                        s.key,
                        s.valid | missing,
                        s.dirty,
                        s.dirty == 0,
                    );
                } else if s.dirty == 0 {
                    self.lines.touch_clean(s.line);
                }
                continue;
            }
            if !lines_left {
                continue;
            }
            let Some(line) = self.lines.alloc_line(self.persist, class) else {
                lines_left = false;
                continue;
            };
            if self.devices.cache_write_mask(core, buf, s, line, m).is_ok() {
                self.lines
                    .insert_line(self.persist, self.prefetch, line, s.key, m, 0, class);
            } else {
                self.lines.release_line(line);
            }
        }
    }

    /// After a client read that the cache served (not bypassed): queue read-ahead if the read
    /// continues a stream past the threshold (readahead.rs's worker runs the job). Caller holds
    /// no stripe.
    fn queue_readahead(
        &self,
        core: CoreId,
        streams: &ReadStreams,
        core_size: u64,
        offset: u64,
        len: u64,
        class: Option<ReqClass>,
    ) {
        let p = self.prefetch.params();
        let Some((from, n, stream)) = streams.plan(offset, len, core_size, &p) else {
            return;
        };
        if self.lines.free_lines().load(Ordering::Relaxed) <= reserve(self.lines.count()) {
            return;
        }
        let job = Job {
            core,
            offset: from,
            len: n,
            class,
        };
        if self.prefetch.push(job, p.max_in_flight as usize) {
            streams.commit(stream, from + n);
        }
    }

    /// Serve `reqs` (buffer, offset) as reads of `core`; one result per request, in order.
    pub(crate) fn read_batch(
        &self,
        core: &CoreState,
        reqs: &mut [(&mut [u8], u64)],
    ) -> Vec<Result<()>> {
        let started = Instant::now();
        let mut results: Vec<Result<()>> = (0..reqs.len()).map(|_| Ok(())).collect();
        let mut pending: Pending<'_> = Vec::new();
        for i in 0..reqs.len() {
            let (len, offset) = (reqs[i].0.len(), reqs[i].1);
            // Timing for a request served on its own (not a batched hit).
            let own_start = latency::begin();
            let plan = self.read_plan(core, len, offset, |stripes, span| {
                match self
                    .lines
                    .locks()
                    .try_lock_clear(&stripes, span, WaitFor::Around)
                {
                    Some(guard) => guard,
                    None => {
                        self.finish_hits(core, reqs, &mut pending, &mut results, started);
                        self.lines
                            .locks()
                            .lock_clear(stripes, span, WaitFor::Around)
                    }
                }
            });
            let plan = match plan {
                Ok(Some(plan)) => plan,
                Ok(None) => continue,
                Err(e) => {
                    results[i] = Err(e);
                    continue;
                }
            };
            if plan.core_runs.is_empty() {
                pending.push((i, plan));
                continue;
            }
            // Needs the core: the planned hits go first, then this one as a single read would.
            self.finish_hits(core, reqs, &mut pending, &mut results, started);
            let buf = &mut *reqs[i].0;
            results[i] = self
                .devices
                .core_read(core, buf, &plan.core_runs)
                .and_then(|()| {
                    let cached = self.devices.cache_read(core, buf, &plan.cache_runs);
                    self.read_finish(core, buf, offset, plan, cached)
                });
            if results[i].is_ok() {
                let kind = if latency::ended_on_core() {
                    LatencyKind::ReadCore
                } else {
                    LatencyKind::ReadCache
                };
                core.latency().record(kind, own_start.elapsed());
            }
        }
        self.finish_hits(core, reqs, &mut pending, &mut results, started);
        results
    }

    /// Read the planned hits' cache runs in one batch, then finish each of them.
    fn finish_hits(
        &self,
        core: &CoreState,
        reqs: &mut [(&mut [u8], u64)],
        pending: &mut Pending<'_>,
        results: &mut [Result<()>],
        started: Instant,
    ) {
        if pending.is_empty() {
            return;
        }
        let batched = {
            let mut pieces: Vec<ReadPiece<'_>> = Vec::new();
            let mut next = pending.iter().peekable();
            for (i, (buf, _)) in reqs.iter_mut().enumerate() {
                let Some((_, plan)) = next.next_if(|(j, _)| *j == i) else {
                    continue;
                };
                let mut runs: Vec<&Run> = plan.cache_runs.iter().collect();
                runs.sort_unstable_by_key(|r| r.buf_off);
                // Disjoint pieces of this request's buffer, one per run, in buffer order.
                let mut rest: &mut [u8] = &mut buf[..];
                let mut at = 0;
                for r in runs {
                    let (_, tail) = std::mem::take(&mut rest).split_at_mut(r.buf_off - at);
                    let (piece, tail) = tail.split_at_mut(r.len);
                    pieces.push(ReadPiece {
                        buf: piece,
                        offset: r.dev_off,
                    });
                    rest = tail;
                    at = r.buf_off + r.len;
                }
            }
            // One cache I/O per request, as single reads count them for offload's view.
            self.devices.cache_read_batch(&mut pieces, pending.len())
        };
        for (i, plan) in pending.drain(..) {
            let (buf, offset) = (&mut *reqs[i].0, reqs[i].1);
            let cached = if batched {
                let bytes: usize = plan.cache_runs.iter().map(|r| r.len).sum();
                core.counters().add(Counter::CacheReadBytes, bytes as u64);
                Ok(())
            } else {
                // Which one failed: each reads again alone, counting its own bytes or error.
                self.devices.cache_read(core, buf, &plan.cache_runs)
            };
            results[i] = self.read_finish(core, buf, offset, plan, cached);
            if results[i].is_ok() {
                core.latency()
                    .record(LatencyKind::ReadCache, started.elapsed());
            }
        }
    }
}

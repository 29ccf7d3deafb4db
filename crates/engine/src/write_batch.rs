//! Batched writes of one core (several requests of a pipelining client at once): the write-side
//! twin of read.rs's `read_batch`, on the single path's `Writer` (write.rs), whose rooms it reads
//! through `lines()` and `devices()`.
//!
//! Each request is admitted and planned as a single write is (checks, `enter`, mode, IO class,
//! seq cutoff; in write-back its stripes, lookup). A request whose every line is already mapped
//! in write-back (or write-only) is a pure hit: it needs no line, no room, no admission decision
//! (promotion and offload only ever decide about unmapped lines) and no core I/O. The pure hits'
//! cache writes are submitted together (`Devices::cache_write_dirty_batch`: one
//! `Volume::write_batch`, so one `io_uring_enter` on a file volume), then each is finished as
//! the single path finishes it: the line updates (dirty only once its data is on the cache
//! device), the fallback to the core for a failed cache write, statistics and latency.
//!
//! Anything else (a miss, a partial miss needing a line, write-through, pass-through, a mirror
//! that lost a device) first finishes the planned hits, releasing their stripes, then runs the
//! single path: it may wait for room, which cleaning makes under stripes the batch would hold.
//!
//! Locks: as for read batches, the thread never waits for a stripe while it holds another. A
//! request whose stripes are not free at once, or are held by a hit the batch planned (an
//! overlapping write), first finishes the planned hits; so two writes of one batch to one
//! sector land in request order, and the pieces of one submission never overlap.

use std::time::Instant;

use crate::classes::ReqClass;
use crate::core_state::{CoreState, Entered};
use crate::latency::{self, LatencyKind};
use crate::locks::{Span, StripeGuard, WaitFor};
use crate::segment::{span_of, Run, Runs, Seg};
use crate::write::Writer;
use crate::{CacheMode, Result, MAX_REQUEST};

/// A planned pure write hit, holding its stripes until the batch's cache write is done.
struct Hit<'a> {
    /// Its request's index in the batch.
    index: usize,
    _entered: Entered<'a>,
    locks: StripeGuard<'a>,
    segs: Vec<Seg>,
    /// Every segment's home: its own mapped line.
    targets: Vec<(usize, u32, bool)>,
    /// The cache runs of its data.
    runs: Runs,
    class: Option<ReqClass>,
}

/// What planning one request of a batch came to.
enum Planned<'a> {
    /// Finished already (refused, or empty): its result.
    Done(Result<()>),
    /// A pure hit, waiting for the batch's cache write.
    Hit(Hit<'a>),
    /// Admitted, for the single path once the planned hits are finished: its mode, IO class
    /// and whether seq cutoff turned it away.
    Single(Entered<'a>, CacheMode, Option<ReqClass>, bool),
}

impl Writer<'_> {
    /// Serve `reqs` (data, offset) as writes to `core`; one result per request, in order.
    pub(crate) fn write_batch(&self, core: &CoreState, reqs: &[(&[u8], u64)]) -> Vec<Result<()>> {
        let started = Instant::now();
        let mut results: Vec<Result<()>> = (0..reqs.len()).map(|_| Ok(())).collect();
        let mut hits: Vec<Hit<'_>> = Vec::new();
        for (i, &(buf, offset)) in reqs.iter().enumerate() {
            // Timing for a request served on its own (not a batched hit).
            let own_start = latency::begin();
            let planned = self.plan_write(core, buf, offset, |stripes, span| {
                match self
                    .lines()
                    .locks()
                    .try_lock_clear(&stripes, span, WaitFor::All)
                {
                    Some(guard) => guard,
                    None => {
                        self.finish_write_hits(core, reqs, &mut hits, &mut results, started);
                        self.lines().locks().lock_clear(stripes, span, WaitFor::All)
                    }
                }
            });
            let (entered, mode, class, cut) = match planned {
                Planned::Done(res) => {
                    results[i] = res;
                    continue;
                }
                Planned::Hit(mut hit) => {
                    hit.index = i;
                    hits.push(hit);
                    continue;
                }
                Planned::Single(entered, mode, class, cut) => (entered, mode, class, cut),
            };
            self.finish_write_hits(core, reqs, &mut hits, &mut results, started);
            results[i] = self.write_routed(core, buf, offset, mode, class, cut);
            drop(entered);
            if results[i].is_ok() {
                let kind = if latency::ended_on_core() {
                    LatencyKind::WriteCore
                } else {
                    LatencyKind::WriteCache
                };
                core.latency().record(kind, own_start.elapsed());
            }
        }
        self.finish_write_hits(core, reqs, &mut hits, &mut results, started);
        results
    }

    /// Admit and plan one write of a batch: a pure hit holds its stripes (taken by `lock`,
    /// given the sorted stripes and the span of core lines) and is counted; anything else has
    /// changed nothing and is left to the single path.
    fn plan_write<'a>(
        &'a self,
        core: &'a CoreState,
        buf: &[u8],
        offset: u64,
        lock: impl FnOnce(Vec<u32>, Span) -> StripeGuard<'a>,
    ) -> Planned<'a> {
        let len = buf.len() as u64;
        if let Err(e) = self.check(core, offset, len, Some(MAX_REQUEST)) {
            return Planned::Done(Err(e));
        }
        if len == 0 {
            return Planned::Done(Ok(()));
        }
        let entered = match core.enter() {
            Ok(entered) => entered,
            Err(e) => return Planned::Done(Err(e)),
        };
        let (mode, class, cut) = self.write_admit(core, len, offset);
        if cut
            || !matches!(mode, CacheMode::Wb | CacheMode::Wo)
            || !self.devices().batches_dirty_writes()
        {
            return Planned::Single(entered, mode, class, cut);
        }
        let mut segs = self.lines().segments(core.id(), offset, len);
        let locks = lock(
            self.lines().stripes_of(segs.iter().map(|s| s.key)),
            span_of(&segs),
        );
        self.lines().lookup(&mut segs);
        // A hit beyond a smaller mirror's region moves into it: the single path does that.
        let zone = self.lines().mirrored_lines();
        if !segs.iter().all(|s| s.mapped() && s.line < zone) {
            // Nothing has changed and nothing was decided: the single path locks again, and
            // decides promotion and offload once.
            drop(locks);
            return Planned::Single(entered, mode, class, false);
        }
        self.count_write(core, &segs, class, locks.waited());
        let targets: Vec<(usize, u32, bool)> = segs
            .iter()
            .enumerate()
            .map(|(i, s)| (i, s.line, false))
            .collect();
        let runs = self.write_back_runs(&segs, &targets);
        Planned::Hit(Hit {
            index: 0,
            _entered: entered,
            locks,
            segs,
            targets,
            runs,
            class,
        })
    }

    /// Write the planned hits' data in one batch, then finish each of them as a single
    /// write-back write does: line updates, the core for a failed cache write, latency.
    fn finish_write_hits(
        &self,
        core: &CoreState,
        reqs: &[(&[u8], u64)],
        hits: &mut Vec<Hit<'_>>,
        results: &mut [Result<()>],
        started: Instant,
    ) {
        if hits.is_empty() {
            return;
        }
        let written = {
            let writes: Vec<(&[u8], &[Run])> = hits
                .iter()
                .map(|h| (reqs[h.index].0, &h.runs[..]))
                .collect();
            self.devices().cache_write_dirty_batch(core, &writes)
        };
        for (hit, cached) in hits.drain(..).zip(written) {
            let Hit {
                index,
                locks,
                segs,
                targets,
                class,
                ..
            } = hit;
            let buf = reqs[index].0;
            let fallback = self.write_back_applied(&segs, &targets, class, cached.is_ok());
            let on_core = !fallback.is_empty();
            results[index] =
                self.write_back_core_part(core, buf, &segs, locks, Runs::new(), fallback);
            if results[index].is_ok() {
                let kind = if on_core {
                    LatencyKind::WriteCore
                } else {
                    LatencyKind::WriteCache
                };
                core.latency().record(kind, started.elapsed());
            }
        }
    }
}

//! Batched reads: several read requests of one core at once (a pipelining NBD client's buffered
//! requests). Each request goes through the same steps as a single read (`CacheInner::read_plan`
//! and `read_finish`, with the same statistics and policy side effects); what changes is that the
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

use std::time::Instant;

use hybridcache_volume::ReadPiece;

use crate::cache::CacheInner;
use crate::core_state::{CoreState, Entered};
use crate::segment::{Run, Seg};
use crate::classes::ReqClass;
use crate::latency::{self, LatencyKind};
use crate::locks::{StripeGuard, WaitFor};
use crate::stats::Counter;
use crate::Result;

/// A read planned up to its device I/O (see `CacheInner::read_plan`). Holds its stripes and its
/// registration with the core.
pub(crate) struct ReadPlan<'a> {
    pub(crate) _entered: Entered<'a>,
    pub(crate) locks: StripeGuard<'a>,
    pub(crate) segs: Vec<Seg>,
    pub(crate) core_runs: Vec<Run>,
    pub(crate) cache_runs: Vec<Run>,
    pub(crate) bypass: bool,
    pub(crate) class: Option<ReqClass>,
}

/// A planned pure hit waiting for the batch's cache read: its request's index and plan.
type Pending<'a> = Vec<(usize, ReadPlan<'a>)>;

impl CacheInner {
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
                match self.locks.try_lock_clear(&stripes, span, WaitFor::Around) {
                    Some(guard) => guard,
                    None => {
                        self.finish_hits(core, reqs, &mut pending, &mut results, started);
                        self.locks.lock_clear(stripes, span, WaitFor::Around)
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
            results[i] = self.core_read(core, buf, &plan.core_runs).and_then(|()| {
                let cached = self.cache_read(core, buf, &plan.cache_runs);
                self.read_finish(core, buf, offset, plan, cached)
            });
            if results[i].is_ok() {
                let kind = if latency::ended_on_core() {
                    LatencyKind::ReadCore
                } else {
                    LatencyKind::ReadCache
                };
                core.latency.record(kind, own_start.elapsed());
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
            let _queued: Vec<_> = pending.iter().map(|_| self.offload.cache_io()).collect();
            self.volume.read_batch(&mut pieces).is_ok()
        };
        for (i, plan) in pending.drain(..) {
            let (buf, offset) = (&mut *reqs[i].0, reqs[i].1);
            let cached = if batched {
                let bytes: usize = plan.cache_runs.iter().map(|r| r.len).sum();
                core.counters.add(Counter::CacheReadBytes, bytes as u64);
                Ok(())
            } else {
                // Which one failed: each reads again alone, counting its own bytes or error.
                self.cache_read(core, buf, &plan.cache_runs)
            };
            results[i] = self.read_finish(core, buf, offset, plan, cached);
            if results[i].is_ok() {
                core.latency
                    .record(LatencyKind::ReadCache, started.elapsed());
            }
        }
    }
}

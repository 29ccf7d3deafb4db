//! Read-ahead (Open CAS v26.09's prefetch subsystem, policy `readahead`).
//!
//! A client read that continues a sequential read stream which has read at least `threshold`
//! bytes asks for the next `distance` bytes to be brought into the cache. The request path only
//! decides and queues (a mutex and a few compares); a prefetch worker thread per cache does the
//! IO, so the client's read never waits for it. The rules that keep it safe and useful:
//!
//! - it fills only invalid sectors, from the core: a dirty or valid sector is never overwritten.
//!   The worker takes the same stripe locks as a read, so a write to the same lines either comes
//!   first (its sectors are then valid and skipped) or after (and overwrites the prefetched data);
//! - never past the core's end, and one job is at most one request (32 MiB);
//! - at most `max-in-flight` jobs queued or running per cache; a stream whose job does not fit is
//!   skipped, never waited for;
//! - pressure: prefetch takes only free lines and leaves a reserve of them (an eighth of the cache,
//!   at most 512 lines, as seq cutoff's `full` margin); it never evicts. Speculative data must not
//!   push out lines clients used, and the reserve keeps room for clients' own misses;
//! - a class at its allocation gets no read-ahead lines (the request's class, which the lines join);
//! - reads that bypass the cache (pt and wo, seq cutoff, an IO class with allocation 0, nhit
//!   declining) start no read-ahead: prefetching what the cache would not insert would work around
//!   those policies.
//!
//! Streams are tracked per core here, not in seq cutoff's table: seq cutoff counts reads and
//! writes with its own promotion rule and is skipped under its `never` policy, while read-ahead
//! needs, per read stream, how far it has already prefetched.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use parking_lot::{Condvar, Mutex, RwLock};

use crate::classes::ReqClass;
use crate::policy::{continued_stream, Prefetch, PrefetchPolicy};
use crate::{CoreId, MAX_REQUEST};

/// Read streams tracked per core.
const STREAMS: usize = 16;

#[derive(Clone, Copy, Default)]
struct Stream {
    /// The end of the furthest read of the stream; 0 with `bytes` 0 = unused.
    next: u64,
    bytes: u64,
    /// Everything below this has been queued for prefetch already.
    prefetched_to: u64,
    stamp: u64,
    /// The clock value when the stream began: names it to `commit`, whose `next` may have moved.
    born: u64,
    /// A read once started exactly at the stream's end. Only then are reads out of order
    /// accepted (`policy::continued_stream`).
    confirmed: bool,
}

/// One core's read streams.
#[derive(Default)]
pub(crate) struct ReadStreams {
    table: Mutex<([Stream; STREAMS], u64)>,
}

/// A range of one core to bring into the cache.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Job {
    pub(crate) core: CoreId,
    pub(crate) offset: u64,
    pub(crate) len: u64,
    pub(crate) class: Option<ReqClass>,
}

struct Queue {
    jobs: VecDeque<Job>,
    /// Jobs queued plus running: what `max-in-flight` caps.
    in_flight: usize,
    stopped: bool,
}

/// Shared by the cache and its worker thread.
pub(crate) struct PrefetchQueue {
    queue: Mutex<Queue>,
    cv: Condvar,
}

pub(crate) struct PrefetchState {
    /// Read on every client read: the one check paid while read-ahead is off.
    enabled: AtomicBool,
    params: RwLock<Prefetch>,
    queue: Arc<PrefetchQueue>,
    /// One bit per cache line: filled by prefetch and not hit since. Allocated when read-ahead
    /// is first switched on.
    marks: OnceLock<Box<[AtomicU64]>>,
}

impl PrefetchQueue {
    /// The worker's wait for a job (bounded, so that a dropped cache ends the thread too).
    /// False once stopped.
    pub(crate) fn wait_for_job(&self) -> bool {
        let mut g = self.queue.lock();
        if g.stopped {
            return false;
        }
        if g.jobs.is_empty() {
            self.cv.wait_for(&mut g, Duration::from_millis(100));
            if g.stopped {
                return false;
            }
        }
        true
    }

    /// Stop the worker (`stopped` true) or let a new one run (false).
    pub(crate) fn set_stopped(&self, stopped: bool) {
        self.queue.lock().stopped = stopped;
        if stopped {
            self.cv.notify_all();
        }
    }
}

impl PrefetchState {
    /// The job queue, shared with the worker thread.
    pub(crate) fn queue(&self) -> Arc<PrefetchQueue> {
        self.queue.clone()
    }

    pub(crate) fn new() -> PrefetchState {
        PrefetchState {
            enabled: AtomicBool::new(false),
            params: RwLock::new(Prefetch::default()),
            queue: Arc::new(PrefetchQueue {
                queue: Mutex::new(Queue {
                    jobs: VecDeque::new(),
                    in_flight: 0,
                    stopped: false,
                }),
                cv: Condvar::new(),
            }),
            marks: OnceLock::new(),
        }
    }

    pub(crate) fn params(&self) -> Prefetch {
        *self.params.read()
    }

    pub(crate) fn set_params(&self, p: Prefetch, lines: u32) {
        let on = p.policy == PrefetchPolicy::Readahead;
        if on {
            self.marks
                .get_or_init(|| (0..lines.div_ceil(64)).map(|_| AtomicU64::new(0)).collect());
        }
        *self.params.write() = p;
        self.enabled.store(on, Ordering::Relaxed);
    }

    #[inline]
    pub(crate) fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    pub(crate) fn mark(&self, line: u32) {
        if let Some(m) = self.marks.get() {
            m[line as usize / 64].fetch_or(1 << (line % 64), Ordering::Relaxed);
        }
    }

    /// Forget a line's mark (it is being filled by something other than prefetch).
    #[inline]
    pub(crate) fn clear_mark(&self, line: u32) {
        if let Some(m) = self.marks.get() {
            let bit = 1u64 << (line % 64);
            let w = &m[line as usize / 64];
            if w.load(Ordering::Relaxed) & bit != 0 {
                w.fetch_and(!bit, Ordering::Relaxed);
            }
        }
    }

    /// A client read hit `line`: whether it was prefetched and not hit before (the mark goes).
    #[inline]
    pub(crate) fn take_mark(&self, line: u32) -> bool {
        let Some(m) = self.marks.get() else {
            return false;
        };
        let bit = 1u64 << (line % 64);
        let w = &m[line as usize / 64];
        w.load(Ordering::Relaxed) & bit != 0 && w.fetch_and(!bit, Ordering::Relaxed) & bit != 0
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.marks.get().map_or(0, |m| m.len() as u64 * 8)
    }

    /// Queue a job unless `max-in-flight` are already queued or running.
    pub(crate) fn push(&self, job: Job, max: usize) -> bool {
        let mut q = self.queue.queue.lock();
        if q.in_flight >= max {
            return false;
        }
        q.in_flight += 1;
        q.jobs.push_back(job);
        drop(q);
        self.queue.cv.notify_one();
        true
    }

    /// Take the next job (it stays counted in flight until [`done`](Self::done)).
    pub(crate) fn pop(&self) -> Option<Job> {
        self.queue.queue.lock().jobs.pop_front()
    }

    pub(crate) fn done(&self) {
        let mut q = self.queue.queue.lock();
        q.in_flight = q.in_flight.saturating_sub(1);
    }
}

impl ReadStreams {
    /// Record a read and say which range to prefetch, if any, with the stream's name for
    /// [`commit`](Self::commit), which records the range as queued once the job is accepted.
    pub(crate) fn plan(
        &self,
        offset: u64,
        len: u64,
        core_size: u64,
        p: &Prefetch,
    ) -> Option<(u64, u64, u64)> {
        let mut t = self.table.lock();
        t.1 += 1;
        let clock = t.1;
        let end = offset + len;
        let (streams, _) = &mut *t;
        let found = continued_stream(
            streams.iter().map(|s| (s.bytes > 0, s.next, s.confirmed)),
            offset,
            len,
        );
        let s = match found {
            Some((i, exact)) => {
                let s = &mut streams[i];
                s.confirmed |= exact;
                // A read that finished after a later one leaves the end where it is.
                s.next = s.next.max(end);
                s.bytes = s.bytes.saturating_add(len);
                s.stamp = clock;
                s
            }
            None => {
                let oldest = streams
                    .iter_mut()
                    .min_by_key(|s| s.stamp)
                    .expect("STREAMS > 0");
                *oldest = Stream {
                    next: end,
                    bytes: len,
                    prefetched_to: end,
                    stamp: clock,
                    born: clock,
                    confirmed: false,
                };
                // One read is no stream yet, however large: only a read that continues one
                // starts read-ahead, so random reads never do.
                return None;
            }
        };
        if s.bytes < p.threshold_kib as u64 * 1024 {
            return None;
        }
        let distance = p.distance_kib as u64 * 1024;
        let end = s.next;
        // Go again only once half the distance has been read: fewer, larger prefetch requests.
        if s.prefetched_to >= end + distance / 2 {
            return None;
        }
        let from = s.prefetched_to.max(end);
        let to = (end + distance).min(core_size).min(from + MAX_REQUEST);
        (to > from).then_some((from, to - from, s.born))
    }

    pub(crate) fn commit(&self, born: u64, to: u64) {
        let mut t = self.table.lock();
        if let Some(s) = t.0.iter_mut().find(|s| s.bytes > 0 && s.born == born) {
            s.prefetched_to = s.prefetched_to.max(to);
        }
    }
}

/// Free lines prefetch leaves alone.
pub(crate) fn reserve(lines: u32) -> u64 {
    (lines as u64 / 8).min(512)
}

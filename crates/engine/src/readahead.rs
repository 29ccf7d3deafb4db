//! The read-ahead worker: what a read queues (read.rs, `queue_readahead`), done through the
//! cache.
//!
//! prefetch.rs owns read-ahead's state (the policy, the per-core read streams, the job queue,
//! the marks of prefetched lines); this room runs the jobs, on a struct of references the holder
//! lends (`ReadAhead`). A job takes the same stripe locks
//! as a client read and fills only invalid sectors of free lines (never evicting, leaving
//! `prefetch::reserve` free lines alone), so it can never overwrite newer data.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;

use crate::bits::{self, Mask};
use crate::classes::ReqClass;
use crate::core_state::{CoreState, Cores};
use crate::devices::Devices;
use crate::inner::{serving_mode, CacheInner};
use crate::lines::Lines;
use crate::locks::WaitFor;
use crate::persist::Persist;
use crate::prefetch::{reserve, Job, PrefetchQueue, PrefetchState};
use crate::segment::{push_run, Run, Seg};
use crate::stats::{BackgroundErrorLog, Counter};
use crate::{CacheMode, SECTOR};

/// What the read-ahead worker works on, by reference, as the holder lends it
/// (`CacheInner::drain_prefetch`): the cores (a job names its core by id), the line room, the
/// devices, persistence (a filled line is recorded for the next commit), read-ahead's state and
/// its error log, and the mode as set. A job reaches nothing else of the cache.
struct ReadAhead<'a> {
    cores: &'a Cores,
    lines: &'a Lines,
    devices: &'a Devices,
    persist: Option<&'a Persist>,
    prefetch: &'a PrefetchState,
    errors: &'a BackgroundErrorLog,
    /// The mode set; a mirror or fallback may serve another (`serving_mode`).
    mode: &'a AtomicU8,
    line_bytes: u64,
}

impl CacheInner {
    /// Run queued prefetch jobs on the calling thread until none is left; how many ran.
    pub(crate) fn drain_prefetch(&self) -> usize {
        ReadAhead {
            cores: &self.cores,
            lines: &self.lines,
            devices: &self.devices,
            persist: self.persist.as_ref(),
            prefetch: &self.prefetch,
            errors: &self.prefetch_errors,
            mode: &self.mode,
            line_bytes: self.line_bytes,
        }
        .drain()
    }
}

impl ReadAhead<'_> {
    fn drain(&self) -> usize {
        let mut ran = 0;
        while let Some(job) = self.prefetch.pop() {
            self.run_prefetch_job(job);
            self.prefetch.done();
            ran += 1;
        }
        ran
    }

    /// Run one prefetch job: bring the invalid sectors of its range into the cache.
    fn run_prefetch_job(&self, job: Job) {
        let Some(core) = self.cores.get(job.core) else {
            return;
        };
        let Ok(_entered) = core.enter() else {
            return;
        };
        if matches!(
            serving_mode(self.mode, self.devices),
            CacheMode::Pt | CacheMode::Wo
        ) {
            return;
        }
        // Checked as a client request is: a job must never read past the core's end.
        if job.offset % SECTOR != 0
            || job.len % SECTOR != 0
            || job
                .offset
                .checked_add(job.len)
                .map_or(true, |e| e > core.size())
        {
            return;
        }
        let mut segs = self.lines.segments(core.id(), job.offset, job.len);
        // As a read: it puts the core's data in the cache.
        let _locks = self.lines.lock_segs(&segs, WaitFor::Around);
        self.lines.lookup(&mut segs);
        let plan = self.plan_prefetch(&segs, &job);
        if plan.is_empty() {
            return;
        }
        let mut buf = vec![0u8; job.len as usize];
        let (core_runs, cache_runs) = self.prefetch_runs(&segs, &plan);
        let read: u64 = core_runs.iter().map(|r| r.len as u64).sum();
        let result = self
            .devices
            .core_read(&core, &mut buf, &core_runs)
            .and_then(|()| self.devices.cache_write(&core, &buf, &cache_runs));
        if let Err(e) = &result {
            self.errors.record(core.id(), e);
        }
        let ok = result.is_ok();
        self.count_prefetch(&core, &job, ok, read, &cache_runs);
        self.apply_prefetch(&segs, &plan, ok, job.class);
    }

    /// The line updates of a job whose I/O ended `ok`: new lines mapped and marked prefetched,
    /// mapped ones given the filled sectors; after a failure the new lines go back, unchanged.
    fn apply_prefetch(
        &self,
        segs: &[Seg],
        plan: &[(usize, u32, bool, Mask)],
        ok: bool,
        class: Option<ReqClass>,
    ) {
        for &(i, line, new, missing) in plan {
            let s = &segs[i];
            match (ok, new) {
                (true, true) => {
                    self.lines.insert_line(
                        self.persist,
                        self.prefetch,
                        line,
                        s.key,
                        missing,
                        0,
                        class,
                    );
                    self.prefetch.mark(line);
                }
                // Not touched: speculative data does not make a line recently used.
                (true, false) => self.lines.update_line(
                    self.persist,
                    line,
                    s.key,
                    s.valid | missing,
                    s.dirty,
                    false,
                ),
                // Nothing changed in the metadata: the sectors stay invalid.
                (false, true) => self.lines.release_line(line),
                (false, false) => {}
            }
        }
    }

    /// Which sectors a job fills: the invalid ones of mapped lines, and new free lines (while
    /// more than the reserve is free and the class has room) for unmapped ones. (segment, line,
    /// newly taken, sectors to fill).
    fn plan_prefetch(&self, segs: &[Seg], job: &Job) -> Vec<(usize, u32, bool, Mask)> {
        let reserve = reserve(self.lines.count());
        // (segment, line, newly taken, sectors to fill)
        let mut plan = Vec::new();
        // New lines taken so far (not yet counted in their class).
        let mut taken = 0u64;
        for (i, s) in segs.iter().enumerate() {
            let m = bits::range(s.first, s.count);
            if s.line != crate::meta::NONE {
                let missing = m & !s.valid;
                if missing != 0 {
                    plan.push((i, s.line, false, missing));
                }
                continue;
            }
            if self.lines.free_lines().load(Ordering::Relaxed) <= reserve {
                break;
            }
            // Read-ahead never grows a class past its allocation (it never evicts to stay in it).
            if job
                .class
                .is_some_and(|c| !self.lines.classes().has_room(c, taken))
            {
                break;
            }
            match self.lines.take_free_line() {
                Some(line) => {
                    plan.push((i, line, true, m));
                    taken += 1;
                }
                None => break,
            }
        }
        plan
    }

    /// The core reads and cache writes of a planned job.
    fn prefetch_runs(
        &self,
        segs: &[Seg],
        plan: &[(usize, u32, bool, Mask)],
    ) -> (Vec<Run>, Vec<Run>) {
        let mut core_runs = Vec::new();
        let mut cache_runs = Vec::new();
        for &(i, line, _, missing) in plan {
            let s = &segs[i];
            for (first, n) in bits::runs(missing) {
                let len = n as usize * SECTOR as usize;
                let buf_off = s.buf_off + (first - s.first) as usize * SECTOR as usize;
                push_run(
                    &mut core_runs,
                    s.key.line() * self.line_bytes + first as u64 * SECTOR,
                    buf_off,
                    len,
                );
                push_run(
                    &mut cache_runs,
                    self.devices.data_offset()
                        + line as u64 * self.line_bytes
                        + first as u64 * SECTOR,
                    buf_off,
                    len,
                );
            }
        }
        (core_runs, cache_runs)
    }

    /// A job's statistics, on its core and its IO class.
    fn count_prefetch(&self, core: &CoreState, job: &Job, ok: bool, read: u64, cache_runs: &[Run]) {
        core.counters().add(Counter::PrefetchRequests, 1);
        self.lines
            .classes()
            .count(core.classes(), job.class, Counter::PrefetchRequests, 1);
        if ok {
            let written: u64 = cache_runs.iter().map(|r| r.len as u64).sum();
            core.counters().add(Counter::PrefetchReadBytes, read);
            core.counters().add(Counter::PrefetchWrittenBytes, written);
            self.lines
                .classes()
                .count(core.classes(), job.class, Counter::PrefetchReadBytes, read);
            self.lines.classes().count(
                core.classes(),
                job.class,
                Counter::PrefetchWrittenBytes,
                written,
            );
        }
    }
}

/// The prefetch worker thread of a cache.
pub(crate) struct PrefetchThread {
    queue: Arc<PrefetchQueue>,
    handle: JoinHandle<()>,
}

impl PrefetchThread {
    pub(crate) fn start(cache: &Arc<CacheInner>) -> PrefetchThread {
        let weak: Weak<CacheInner> = Arc::downgrade(cache);
        let queue = cache.prefetch.queue();
        let q = queue.clone();
        let handle = std::thread::Builder::new()
            .name(format!("hc-prefetch-{}", cache.id))
            .spawn(move || loop {
                if !q.wait_for_job() {
                    return;
                }
                let Some(cache) = weak.upgrade() else {
                    return;
                };
                cache.drain_prefetch();
            })
            .expect("spawning the prefetch thread");
        PrefetchThread { queue, handle }
    }

    /// Stop the thread; queued jobs stay queued (a test then runs them itself).
    pub(crate) fn stop(self) {
        self.queue.set_stopped(true);
        let _ = self.handle.join();
        self.queue.set_stopped(false);
    }
}

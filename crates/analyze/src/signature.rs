//! Workload signatures: per job and for the whole trace, the figures the recommendation rests on.
//!
//! The request stream is the trace's Q events (the block layer's view of what the application
//! asked for, before merging — what the study analysed); traces without Q events fall back to
//! D, then C. Completions (C) only serve queue-depth tracking. A request is sequential when it
//! starts exactly where the previous request of the same job, device and direction ended.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::mrc::{MissRatioCurve, MrcBuilder, MrcOptions, MRC_BLOCK};
use crate::trace::{Action, Event, Op, Rwbs, Trace};

/// 4 KiB blocks per 100 MiB ACP chunk.
const ACP_CHUNK_BLOCKS: u64 = 100 * 256;

/// Options for [`Signature::from_trace_with`].
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SignatureOptions {
    pub mrc: MrcOptions,
    /// At most this many timeline buckets: buckets are 1 s unless the trace is longer.
    pub max_buckets: usize,
}

impl Default for SignatureOptions {
    fn default() -> Self {
        SignatureOptions {
            mrc: MrcOptions::default(),
            max_buckets: 3600,
        }
    }
}

/// Figures of one direction.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct DirStats {
    pub requests: u64,
    pub bytes: u64,
    /// Requests starting where the job's previous one (same device and direction) ended.
    pub sequential: u64,
    /// Requests starting elsewhere (the job's first request per device and direction is
    /// neither).
    pub random: u64,
    /// Request size (bytes) -> count.
    pub sizes: BTreeMap<u64, u64>,
    /// 4 KiB block references, and those that touched a block this job had touched before
    /// (an upper bound of the hit ratio an unbounded cache would give).
    pub block_refs: u64,
    pub reused_refs: u64,
}

impl DirStats {
    /// Share of classified requests that are random; a lone request counts as random.
    pub fn random_share(&self) -> f64 {
        let n = self.sequential + self.random;
        if n == 0 {
            return if self.requests > 0 { 1.0 } else { 0.0 };
        }
        self.random as f64 / n as f64
    }
    pub fn sequential_share(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            1.0 - self.random_share()
        }
    }
    /// The most frequent request size (ties to the larger), bytes; 0 without requests.
    pub fn dominant_size(&self) -> u64 {
        self.sizes
            .iter()
            .max_by(|a, b| a.1.cmp(b.1).then(a.0.cmp(b.0)))
            .map_or(0, |(s, _)| *s)
    }
    /// Share of requests that have the dominant size.
    pub fn dominant_share(&self) -> f64 {
        let d = self.dominant_size();
        ratio(self.sizes.get(&d).copied().unwrap_or(0), self.requests)
    }
    pub fn reuse_share(&self) -> f64 {
        ratio(self.reused_refs, self.block_refs)
    }
    pub fn mean_size(&self) -> f64 {
        if self.requests == 0 {
            0.0
        } else {
            self.bytes as f64 / self.requests as f64
        }
    }
    fn merge(&mut self, o: &DirStats) {
        self.requests += o.requests;
        self.bytes += o.bytes;
        self.sequential += o.sequential;
        self.random += o.random;
        for (s, n) in &o.sizes {
            *self.sizes.entry(*s).or_default() += n;
        }
        self.block_refs += o.block_refs;
        self.reused_refs += o.reused_refs;
    }
}

pub(crate) fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Queue depth, two ways.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct QueueDepth {
    /// Most requests in flight at once (Q .. C); None without completions.
    pub max_in_flight: Option<u32>,
    /// Median of the depth each request found on arrival, itself included.
    pub median_in_flight: Option<u32>,
    /// The study's method: the longest run of the job's Q events with no completion of its
    /// requests in between.
    pub study_run: Option<u32>,
}

impl QueueDepth {
    /// The depth the rules use: the study's run (the client's depth: how many requests it
    /// queues before waiting for one), else the median in flight, else 1. The median counts
    /// what the traced device had in flight, which a fast device keeps below the client's depth.
    pub fn effective(&self) -> u32 {
        self.study_run.or(self.median_in_flight).unwrap_or(1).max(1)
    }
    pub fn known(&self) -> bool {
        self.median_in_flight.is_some() || self.study_run.is_some()
    }
}

/// Requests and bytes in one timeline bucket.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    pub read_ops: u64,
    pub write_ops: u64,
    pub read_bytes: u64,
    pub write_bytes: u64,
}

/// Throughput and IOPS over time.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Timeline {
    /// Time of the first request of the trace, ns (buckets of all jobs share it).
    pub start_ns: u64,
    pub bucket_ns: u64,
    pub buckets: Vec<Bucket>,
}

impl Timeline {
    fn secs(&self) -> f64 {
        self.bucket_ns as f64 / 1e9
    }
    /// Buckets from the job's first to its last active one.
    fn active(&self) -> &[Bucket] {
        let busy = |b: &Bucket| b.read_ops + b.write_ops > 0;
        let first = self.buckets.iter().position(busy);
        let last = self.buckets.iter().rposition(busy);
        match (first, last) {
            (Some(f), Some(l)) => &self.buckets[f..=l],
            _ => &[],
        }
    }
    pub fn mean_iops(&self) -> f64 {
        let a = self.active();
        if a.is_empty() {
            return 0.0;
        }
        a.iter()
            .map(|b| (b.read_ops + b.write_ops) as f64)
            .sum::<f64>()
            / (a.len() as f64 * self.secs())
    }
    pub fn peak_iops(&self) -> f64 {
        self.buckets
            .iter()
            .map(|b| (b.read_ops + b.write_ops) as f64)
            .fold(0.0, f64::max)
            / self.secs()
    }
    pub fn mean_mb_s(&self) -> f64 {
        let a = self.active();
        if a.is_empty() {
            return 0.0;
        }
        a.iter()
            .map(|b| (b.read_bytes + b.write_bytes) as f64)
            .sum::<f64>()
            / 1e6
            / (a.len() as f64 * self.secs())
    }
    pub fn peak_mb_s(&self) -> f64 {
        self.buckets
            .iter()
            .map(|b| (b.read_bytes + b.write_bytes) as f64)
            .fold(0.0, f64::max)
            / 1e6
            / self.secs()
    }
    pub fn peak_write_mb_s(&self) -> f64 {
        self.buckets
            .iter()
            .map(|b| b.write_bytes as f64)
            .fold(0.0, f64::max)
            / 1e6
            / self.secs()
    }
    /// The busiest bucket's write requests per second.
    pub fn peak_write_iops(&self) -> f64 {
        self.buckets.iter().map(|b| b.write_ops).max().unwrap_or(0) as f64 / self.secs()
    }
    /// Share of buckets between the first and last active one that saw no request: the gaps a
    /// cleaner can use without competing with clients.
    pub fn idle_share(&self) -> f64 {
        let a = self.active();
        ratio(
            a.iter().filter(|b| b.read_ops + b.write_ops == 0).count() as u64,
            a.len() as u64,
        )
    }
    /// Peak dirty data (bytes) if every write were absorbed by a cache that drains at
    /// `drain_mb_s`: how large a write-back cache must be to take the bursts.
    pub fn peak_backlog(&self, drain_mb_s: f64) -> u64 {
        let drain = drain_mb_s * 1e6 * self.secs();
        let mut dirty = 0.0f64;
        let mut peak = 0.0f64;
        for b in &self.buckets {
            dirty = (dirty + b.write_bytes as f64 - drain).max(0.0);
            peak = peak.max(dirty);
        }
        peak as u64
    }
    fn add(&mut self, o: &Timeline) {
        if self.buckets.len() < o.buckets.len() {
            self.buckets.resize(o.buckets.len(), Bucket::default());
        }
        for (a, b) in self.buckets.iter_mut().zip(&o.buckets) {
            a.read_ops += b.read_ops;
            a.write_ops += b.write_ops;
            a.read_bytes += b.read_bytes;
            a.write_bytes += b.write_bytes;
        }
    }
}

/// Distinct 4 KiB blocks touched.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkingSet {
    pub read_blocks: u64,
    pub write_blocks: u64,
    /// Read or written.
    pub blocks: u64,
    /// Both read and written.
    pub read_write_blocks: u64,
    /// Read exactly once and never written (candidates nhit promotion keeps out).
    pub read_once_blocks: u64,
    /// Distinct 100 MiB chunks (ACP's unit) holding written blocks.
    pub write_chunks: u64,
}

impl WorkingSet {
    pub fn bytes(&self) -> u64 {
        self.blocks * MRC_BLOCK
    }
}

/// Signature of one job (or of the whole trace).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct JobSignature {
    pub name: String,
    pub devices: Vec<String>,
    pub reads: DirStats,
    pub writes: DirStats,
    pub discards: u64,
    pub flushes: u64,
    /// Writes flagged M (metadata) and S (sync) in blkparse traces.
    pub meta_writes: u64,
    pub sync_writes: u64,
    pub queue_depth: QueueDepth,
    pub timeline: Timeline,
    pub working_set: WorkingSet,
    pub mrc: MissRatioCurve,
    pub first_ns: u64,
    pub last_ns: u64,
}

impl JobSignature {
    /// Reads + writes.
    pub fn requests(&self) -> u64 {
        self.reads.requests + self.writes.requests
    }
    pub fn read_share(&self) -> f64 {
        ratio(self.reads.requests, self.requests())
    }
    pub fn write_share(&self) -> f64 {
        ratio(self.writes.requests, self.requests())
    }
    pub fn read_byte_share(&self) -> f64 {
        ratio(self.reads.bytes, self.reads.bytes + self.writes.bytes)
    }
    /// Size -> (reads, writes).
    pub fn block_sizes(&self) -> BTreeMap<u64, (u64, u64)> {
        let mut m: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
        for (s, n) in &self.reads.sizes {
            m.entry(*s).or_default().0 += n;
        }
        for (s, n) in &self.writes.sizes {
            m.entry(*s).or_default().1 += n;
        }
        m
    }
    /// The most frequent request size over both directions.
    pub fn dominant_size(&self) -> u64 {
        self.block_sizes()
            .into_iter()
            .max_by(|a, b| {
                (a.1 .0 + a.1 .1)
                    .cmp(&(b.1 .0 + b.1 .1))
                    .then(a.0.cmp(&b.0))
            })
            .map_or(0, |(s, _)| s)
    }
    pub fn duration_s(&self) -> f64 {
        (self.last_ns.saturating_sub(self.first_ns)) as f64 / 1e9
    }
}

/// Signatures of every job and of the whole trace.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Signature {
    /// Jobs with at least one read or write, most requests first.
    pub jobs: Vec<JobSignature>,
    pub overall: JobSignature,
    /// Which events were taken as requests (Q normally).
    pub request_action: Action,
    /// Whether the trace had completions (queue depth is unknown without them).
    pub has_completions: bool,
}

/// Per-job state of the single pass.
#[derive(Default)]
struct Acc {
    reads: DirStats,
    writes: DirStats,
    discards: u64,
    flushes: u64,
    meta: u64,
    sync: u64,
    last_end: HashMap<(u32, bool), u64>,
    in_flight: u32,
    max_in_flight: u32,
    depth_hist: Vec<u64>,
    run: u32,
    max_run: u32,
    tracked: bool,
    timeline: Timeline,
    read_blocks: HashMap<u64, u32>,
    write_blocks: HashSet<u64>,
    devices: BTreeSet<u32>,
    first: Option<u64>,
    last: u64,
    refs: u64,
}

impl Acc {
    fn queued(&mut self) {
        self.tracked = true;
        self.in_flight += 1;
        self.max_in_flight = self.max_in_flight.max(self.in_flight);
        let d = (self.in_flight as usize).min(1 << 16);
        if self.depth_hist.len() <= d {
            self.depth_hist.resize(d + 1, 0);
        }
        self.depth_hist[d] += 1;
        self.run += 1;
        self.max_run = self.max_run.max(self.run);
    }

    fn completed(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
        self.run = 0;
    }

    /// Counts a data request; `seq` was decided by the job's own history.
    fn request(&mut self, e: &Event, seq: Option<bool>, bucket: usize) {
        self.devices.insert(e.device);
        self.first.get_or_insert(e.time_ns);
        self.last = self.last.max(e.time_ns);
        if bucket >= self.timeline.buckets.len() {
            self.timeline.buckets.resize(bucket + 1, Bucket::default());
        }
        let b = &mut self.timeline.buckets[bucket];
        let write = e.op() == Op::Write;
        let d = if write {
            b.write_ops += 1;
            b.write_bytes += e.len;
            if e.rwbs.has(Rwbs::META) {
                self.meta += 1;
            }
            if e.rwbs.has(Rwbs::SYNC) {
                self.sync += 1;
            }
            &mut self.writes
        } else {
            b.read_ops += 1;
            b.read_bytes += e.len;
            &mut self.reads
        };
        d.requests += 1;
        d.bytes += e.len;
        *d.sizes.entry(e.len).or_default() += 1;
        match seq {
            Some(true) => d.sequential += 1,
            Some(false) => d.random += 1,
            None => {}
        }
        for key in blocks(e) {
            self.refs += 1;
            d.block_refs += 1;
            let seen = self.read_blocks.contains_key(&key) || self.write_blocks.contains(&key);
            if seen {
                d.reused_refs += 1;
            }
            if write {
                self.write_blocks.insert(key);
            } else {
                *self.read_blocks.entry(key).or_default() += 1;
            }
        }
    }

    fn into_signature(
        self,
        name: String,
        devices: &[String],
        mrc: MissRatioCurve,
        timeline: Timeline,
    ) -> JobSignature {
        let rw = self
            .write_blocks
            .iter()
            .filter(|b| self.read_blocks.contains_key(b))
            .count() as u64;
        let read_once = self
            .read_blocks
            .iter()
            .filter(|(b, n)| **n == 1 && !self.write_blocks.contains(b))
            .count() as u64;
        let write_chunks = self
            .write_blocks
            .iter()
            .map(|b| b / ACP_CHUNK_BLOCKS)
            .collect::<HashSet<u64>>()
            .len() as u64;
        let median = if self.tracked {
            let total: u64 = self.depth_hist.iter().sum();
            let mut cum = 0;
            self.depth_hist.iter().position(|n| {
                cum += n;
                cum * 2 >= total
            })
        } else {
            None
        };
        JobSignature {
            name,
            devices: self
                .devices
                .iter()
                .map(|d| devices[*d as usize].clone())
                .collect(),
            discards: self.discards,
            flushes: self.flushes,
            meta_writes: self.meta,
            sync_writes: self.sync,
            queue_depth: QueueDepth {
                max_in_flight: self.tracked.then_some(self.max_in_flight),
                median_in_flight: median.map(|m| m as u32),
                study_run: self.tracked.then_some(self.max_run),
            },
            timeline,
            working_set: WorkingSet {
                read_blocks: self.read_blocks.len() as u64,
                write_blocks: self.write_blocks.len() as u64,
                blocks: (self.read_blocks.len() + self.write_blocks.len()) as u64 - rw,
                read_write_blocks: rw,
                read_once_blocks: read_once,
                write_chunks,
            },
            mrc,
            first_ns: self.first.unwrap_or(0),
            last_ns: self.last,
            reads: self.reads,
            writes: self.writes,
        }
    }
}

/// The 4 KiB blocks a request touches, keyed by device so devices do not alias.
fn blocks(e: &Event) -> impl Iterator<Item = u64> {
    let dev = (e.device as u64) << 48;
    let (first, last) = if e.len == 0 {
        (1, 0)
    } else {
        (e.offset / MRC_BLOCK, (e.end() - 1) / MRC_BLOCK)
    };
    (first..=last).map(move |b| dev ^ b)
}

fn is_data(e: &Event) -> bool {
    matches!(e.op(), Op::Read | Op::Write)
}

impl Signature {
    pub fn from_trace(trace: &Trace) -> Signature {
        Self::from_trace_with(trace, &SignatureOptions::default())
    }

    pub fn from_trace_with(trace: &Trace, opts: &SignatureOptions) -> Signature {
        let has = |a: Action| trace.events.iter().any(|e| e.action == a);
        let request_action = [Action::Queue, Action::Issue, Action::Complete]
            .into_iter()
            .find(|a| has(*a))
            .unwrap_or(Action::Queue);
        // Queue depth needs completions on the device the requests were queued on (a Q on a
        // device-mapper device completes on the device below, which cannot be matched).
        let completing: HashSet<u32> = if request_action == Action::Complete {
            HashSet::new()
        } else {
            trace
                .events
                .iter()
                .filter(|e| e.action == Action::Complete)
                .map(|e| e.device)
                .collect()
        };
        let is_req = |e: &Event| e.action == request_action;
        let start = trace
            .events
            .iter()
            .filter(|e| is_req(e))
            .map(|e| e.time_ns)
            .min()
            .unwrap_or(0);
        let end = trace
            .events
            .iter()
            .filter(|e| is_req(e))
            .map(|e| e.time_ns)
            .max()
            .unwrap_or(0);
        let secs = (end - start) / 1_000_000_000 + 1;
        let per_bucket = secs.div_ceil(opts.max_buckets.max(1) as u64).max(1);
        let bucket_ns = per_bucket * 1_000_000_000;

        let nj = trace.jobs.len();
        let mut accs: Vec<Acc> = (0..nj).map(|_| Acc::default()).collect();
        let mut all = Acc::default();
        // Outstanding requests per device: offset -> (job, end).
        let mut outstanding: HashMap<u32, BTreeMap<u64, u32>> = HashMap::new();

        for e in &trace.events {
            if is_req(e) {
                let job = e.job as usize;
                match e.op() {
                    Op::Discard => {
                        accs[job].discards += 1;
                        all.discards += 1;
                    }
                    Op::Flush if e.len == 0 => {
                        accs[job].flushes += 1;
                        all.flushes += 1;
                    }
                    _ => {}
                }
                if e.len > 0 && completing.contains(&e.device) {
                    let map = outstanding.entry(e.device).or_default();
                    if let Some(old) = map.insert(e.offset, e.job) {
                        // Re-queued before completing: the old entry is gone.
                        accs[old as usize].completed();
                        all.completed();
                    }
                    accs[job].queued();
                    all.queued();
                }
                if is_data(e) {
                    let write = e.op() == Op::Write;
                    let seq = accs[job]
                        .last_end
                        .insert((e.device, write), e.end())
                        .map(|end| end == e.offset);
                    let bucket = ((e.time_ns - start) / bucket_ns) as usize;
                    accs[job].request(e, seq, bucket);
                    all.request(e, seq, bucket);
                }
            } else if e.action == Action::Complete && e.len > 0 {
                if let Some(map) = outstanding.get_mut(&e.device) {
                    let done: Vec<u64> = map.range(e.offset..e.end()).map(|(o, _)| *o).collect();
                    for o in done {
                        if let Some(job) = map.remove(&o) {
                            accs[job as usize].completed();
                            all.completed();
                        }
                    }
                }
            }
        }

        // Second pass: miss-ratio curves, sized now that each job's reference count is known.
        let mut builders: Vec<MrcBuilder> = accs
            .iter()
            .map(|a| MrcBuilder::new(opts.mrc.rate_for(a.refs)))
            .collect();
        let mut all_builder = MrcBuilder::new(opts.mrc.rate_for(all.refs));
        for e in trace.events.iter().filter(|e| is_req(e) && is_data(e)) {
            for b in blocks(e) {
                builders[e.job as usize].push(b);
                all_builder.push(b);
            }
        }

        let mut jobs = Vec::new();
        let mut overall_timeline = Timeline {
            start_ns: start,
            bucket_ns,
            buckets: Vec::new(),
        };
        for ((i, acc), builder) in accs.into_iter().enumerate().zip(builders) {
            if acc.reads.requests + acc.writes.requests == 0 {
                continue;
            }
            let mut tl = acc.timeline.clone();
            tl.start_ns = start;
            tl.bucket_ns = bucket_ns;
            overall_timeline.add(&tl);
            jobs.push(acc.into_signature(
                trace.jobs[i].clone(),
                &trace.devices,
                builder.finish(),
                tl,
            ));
        }
        jobs.sort_by(|a, b| b.requests().cmp(&a.requests()).then(a.name.cmp(&b.name)));
        // Overall sequential/random: the sum of the jobs' own classifications, already counted
        // in `all` because `seq` came from the job's history.
        let mut overall = all.into_signature(
            "all jobs".into(),
            &trace.devices,
            all_builder.finish(),
            overall_timeline,
        );
        // Keep the overall direction stats consistent with the jobs (same numbers, summed).
        let mut r = DirStats::default();
        let mut w = DirStats::default();
        for j in &jobs {
            r.merge(&j.reads);
            w.merge(&j.writes);
        }
        // Reuse across jobs is real reuse for a shared cache: keep the overall pass's counts.
        r.block_refs = overall.reads.block_refs;
        r.reused_refs = overall.reads.reused_refs;
        w.block_refs = overall.writes.block_refs;
        w.reused_refs = overall.writes.reused_refs;
        overall.reads = r;
        overall.writes = w;
        Signature {
            jobs,
            overall,
            request_action,
            has_completions: !completing.is_empty(),
        }
    }
}

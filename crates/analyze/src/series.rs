//! Time series for charts: IOPS, throughput and queue depth over time, per job and overall.
//!
//! The [`Signature`](crate::Signature)'s timeline uses whole seconds, right for the
//! recommendation rules (cleaning works on seconds of idle time) but too coarse to draw a trace
//! of a few seconds; the charts need a resolution chosen from the trace's length. This module
//! takes a second pass over the trace with buckets of a "nice" width (1, 2 or 5 times a power of
//! ten, at least 1 ms) giving about `points` points, and also follows the queue depth over time,
//! which the signature only summarises (median, maximum).
//!
//! Requests are the same events the signature takes (`request_action`); queue depth uses the
//! same Q/C matching by device and offset, so the two agree. Depth is time-weighted: a bucket's
//! mean is the average number of requests in flight over the bucket, its max the most at once.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use crate::trace::{Action, Event, Op, Trace};

/// One job's series, all of the same length (one value per bucket).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct JobSeries {
    pub name: String,
    pub read_iops: Vec<f64>,
    pub write_iops: Vec<f64>,
    /// MB/s (10^6 bytes per second).
    pub read_mb_s: Vec<f64>,
    pub write_mb_s: Vec<f64>,
    /// Time-weighted mean requests in flight; empty when the trace has no completions.
    pub depth_mean: Vec<f64>,
    /// Most requests in flight at once in the bucket; empty without completions.
    pub depth_max: Vec<u32>,
}

/// The series of a trace.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TimeSeries {
    /// Bucket width, seconds; bucket `i` starts at `i * bucket_s` after the first request.
    pub bucket_s: f64,
    pub overall: JobSeries,
    /// Jobs with at least one request, busiest first (as in the signature).
    pub jobs: Vec<JobSeries>,
}

impl TimeSeries {
    /// Start time (s) of every bucket.
    pub fn times(&self) -> Vec<f64> {
        (0..self.overall.read_iops.len())
            .map(|i| i as f64 * self.bucket_s)
            .collect()
    }
}

/// A width of 1, 2 or 5 times a power of ten (ns), at least 1 ms, giving at most about
/// `points` buckets over `span_ns`.
fn nice_bucket(span_ns: u64, points: usize) -> u64 {
    let want = (span_ns / points.max(1) as u64).max(1_000_000);
    let mut p = 1_000_000u64;
    loop {
        for m in [1, 2, 5] {
            if p.saturating_mul(m) >= want {
                return p * m;
            }
        }
        p = p.saturating_mul(10);
    }
}

#[derive(Default)]
struct Acc {
    read_ops: Vec<u64>,
    write_ops: Vec<u64>,
    read_bytes: Vec<u64>,
    write_bytes: Vec<u64>,
    /// Integral of the depth over each bucket, request-ns.
    area: Vec<f64>,
    max: Vec<u32>,
    in_flight: u32,
    /// Time of the last depth change.
    since: u64,
    requests: u64,
}

impl Acc {
    fn new(n: usize) -> Acc {
        Acc {
            read_ops: vec![0; n],
            write_ops: vec![0; n],
            read_bytes: vec![0; n],
            write_bytes: vec![0; n],
            area: vec![0.0; n],
            max: vec![0; n],
            ..Acc::default()
        }
    }

    /// Accounts the depth held since the last change, up to `t` (relative ns).
    fn advance(&mut self, t: u64, bucket: u64) {
        let n = self.area.len() as u64;
        let mut from = self.since.min(t);
        while from < t {
            let b = (from / bucket).min(n - 1);
            let end = ((b + 1) * bucket).min(t);
            let end = if b == n - 1 { t } else { end };
            self.area[b as usize] += f64::from(self.in_flight) * (end - from) as f64;
            if self.in_flight > self.max[b as usize] {
                self.max[b as usize] = self.in_flight;
            }
            from = end;
        }
        self.since = t;
    }

    fn change(&mut self, t: u64, bucket: u64, up: bool) {
        self.advance(t, bucket);
        if up {
            self.in_flight += 1;
        } else {
            self.in_flight = self.in_flight.saturating_sub(1);
        }
        let b = ((t / bucket) as usize).min(self.max.len() - 1);
        self.max[b] = self.max[b].max(self.in_flight);
    }

    fn count(&mut self, e: &Event, b: usize) {
        self.requests += 1;
        if e.op() == Op::Write {
            self.write_ops[b] += 1;
            self.write_bytes[b] += e.len;
        } else {
            self.read_ops[b] += 1;
            self.read_bytes[b] += e.len;
        }
    }

    fn finish(mut self, name: String, bucket: u64, end: u64, depth: bool) -> JobSeries {
        let secs = bucket as f64 / 1e9;
        let n = self.read_ops.len();
        if depth {
            self.advance(end, bucket);
        }
        let rate = |v: &[u64], div: f64| v.iter().map(|x| *x as f64 / div / secs).collect();
        // The last bucket is usually cut short by the end of the trace.
        let last_len = end.saturating_sub((n as u64 - 1) * bucket).max(1) as f64;
        let depth_mean = if depth {
            self.area
                .iter()
                .enumerate()
                .map(|(i, a)| {
                    let len = if i == n - 1 { last_len } else { bucket as f64 };
                    a / len
                })
                .collect()
        } else {
            Vec::new()
        };
        JobSeries {
            name,
            read_iops: rate(&self.read_ops, 1.0),
            write_iops: rate(&self.write_ops, 1.0),
            read_mb_s: rate(&self.read_bytes, 1e6),
            write_mb_s: rate(&self.write_bytes, 1e6),
            depth_mean,
            depth_max: if depth { self.max } else { Vec::new() },
        }
    }
}

fn is_data(e: &Event) -> bool {
    matches!(e.op(), Op::Read | Op::Write)
}

/// Time series of `trace` with about `points` buckets; `request_action` is the signature's
/// (`Signature::request_action`), so both count the same requests.
pub fn time_series(trace: &Trace, request_action: Action, points: usize) -> TimeSeries {
    let is_req = |e: &Event| e.action == request_action;
    let start = trace
        .events
        .iter()
        .filter(|e| is_req(e))
        .map(|e| e.time_ns)
        .min();
    let Some(start) = start else {
        return TimeSeries::default();
    };
    // The depth follows completions too, which may come after the last request.
    let end = trace
        .events
        .iter()
        .map(|e| e.time_ns)
        .max()
        .unwrap_or(start)
        .saturating_sub(start);
    let bucket = nice_bucket(end.max(1), points);
    let n = (end / bucket + 1) as usize;
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
    let depth = !completing.is_empty();
    let mut jobs: Vec<Acc> = (0..trace.jobs.len()).map(|_| Acc::new(n)).collect();
    let mut all = Acc::new(n);
    let mut outstanding: HashMap<u32, BTreeMap<u64, u32>> = HashMap::new();
    for e in &trace.events {
        // Events before the first request (completions of earlier ones) are left out.
        let Some(t) = e.time_ns.checked_sub(start) else {
            continue;
        };
        let b = ((t / bucket) as usize).min(n - 1);
        if is_req(e) {
            let j = e.job as usize;
            if e.len > 0 && completing.contains(&e.device) {
                let map = outstanding.entry(e.device).or_default();
                if let Some(old) = map.insert(e.offset, e.job) {
                    jobs[old as usize].change(t, bucket, false);
                    all.change(t, bucket, false);
                }
                jobs[j].change(t, bucket, true);
                all.change(t, bucket, true);
            }
            if is_data(e) {
                jobs[j].count(e, b);
                all.count(e, b);
            }
        } else if e.action == Action::Complete && e.len > 0 {
            if let Some(map) = outstanding.get_mut(&e.device) {
                let done: Vec<u64> = map.range(e.offset..e.end()).map(|(o, _)| *o).collect();
                for o in done {
                    if let Some(j) = map.remove(&o) {
                        jobs[j as usize].change(t, bucket, false);
                        all.change(t, bucket, false);
                    }
                }
            }
        }
    }
    let mut out: Vec<(u64, JobSeries)> = jobs
        .into_iter()
        .enumerate()
        .filter(|(_, a)| a.requests > 0)
        .map(|(i, a)| {
            let r = a.requests;
            (r, a.finish(trace.jobs[i].clone(), bucket, end, depth))
        })
        .collect();
    out.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.name.cmp(&b.1.name)));
    TimeSeries {
        bucket_s: bucket as f64 / 1e9,
        overall: all.finish("all jobs".into(), bucket, end, depth),
        jobs: out.into_iter().map(|(_, s)| s).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{parse_trace, Format};

    #[test]
    fn buckets_are_nice() {
        assert_eq!(nice_bucket(10_000_000_000, 200), 50_000_000);
        assert_eq!(nice_bucket(1_000, 200), 1_000_000);
        assert_eq!(nice_bucket(3_000_000_000, 100), 50_000_000);
    }

    #[test]
    fn depth_and_rates_follow_the_events() {
        // Two requests overlapping for 1 ms, then one alone; 1 s of trace.
        let text = "\
8,0 0 1 0.000000000 1 Q W 0 + 8 [a]
8,0 0 2 0.000000000 2 Q R 800 + 8 [b]
8,0 0 3 0.001000000 0 C W 0 + 8 [0]
8,0 0 4 0.500000000 0 C R 800 + 8 [0]
8,0 0 5 0.999000000 1 Q W 8 + 8 [a]
8,0 0 6 1.000000000 0 C W 8 + 8 [0]
";
        let t = parse_trace(text.as_bytes(), Format::Blkparse).unwrap();
        let s = time_series(&t, Action::Queue, 2);
        assert_eq!(s.bucket_s, 0.5);
        assert_eq!(s.overall.depth_max, vec![2, 1, 0]);
        // First half second: 2 in flight for 1 ms, then 1 for 499 ms.
        let m = s.overall.depth_mean[0];
        assert!((m - (2.0 * 0.001 + 0.499) / 0.5).abs() < 1e-9, "{m}");
        assert_eq!(s.overall.write_iops[0], 2.0);
        assert_eq!(s.overall.read_iops[0], 2.0);
        assert_eq!(s.jobs.len(), 2);
        assert_eq!(s.jobs[0].name, "a (pid 1)");
        assert_eq!(s.jobs[0].write_iops.iter().sum::<f64>(), 4.0);
        assert!((s.overall.write_mb_s[0] - 4096.0 * 2.0 / 1e6).abs() < 1e-9);
        assert_eq!(s.times(), vec![0.0, 0.5, 1.0]);
    }

    #[test]
    fn no_completions_no_depth() {
        let text = "8,0 0 1 0.0 1 Q W 0 + 8 [a]\n8,0 0 2 0.2 1 Q W 8 + 8 [a]\n";
        let t = parse_trace(text.as_bytes(), Format::Blkparse).unwrap();
        let s = time_series(&t, Action::Queue, 100);
        assert!(s.overall.depth_mean.is_empty());
        assert_eq!(s.overall.write_iops.iter().filter(|v| **v > 0.0).count(), 2);
    }
}

//! Signatures of synthetic traces of known shape.

mod common;

use common::{blkparse, JobSpec};
use hybridcache_analyze::*;

fn sig_of(jobs: &[JobSpec]) -> Signature {
    let text = blkparse(jobs);
    let t = parse_trace(text.as_bytes(), Format::Auto).unwrap();
    assert_eq!(t.report.bad, 0, "{}", t.report);
    Signature::from_trace(&t)
}

fn within_one(v: Option<u32>, want: u32) {
    let v = v.expect("queue depth known");
    assert!(v.abs_diff(want) <= 1, "{v} vs {want}");
}

#[test]
fn random_4k_writes_at_depth_1() {
    let s = sig_of(&[JobSpec::new(100, "fio")]);
    assert_eq!(s.jobs.len(), 1);
    let j = &s.jobs[0];
    assert_eq!(j.name, "fio (pid 100)");
    assert_eq!(j.writes.requests, 2000);
    assert_eq!(j.writes.dominant_size(), 4096);
    assert_eq!(j.writes.sizes.len(), 1);
    assert!(j.writes.random_share() > 0.99);
    assert_eq!(j.read_share(), 0.0);
    within_one(j.queue_depth.max_in_flight, 1);
    within_one(j.queue_depth.study_run, 1);
    assert_eq!(j.queue_depth.effective(), 1);
    // 1 ms per request: ~1000 IOPS over ~2 s.
    assert!(
        (j.timeline.mean_iops() - 1000.0).abs() < 60.0,
        "{}",
        j.timeline.mean_iops()
    );
    assert!(j.working_set.write_blocks > 1990);
}

#[test]
fn sequential_64k_writes_at_depth_8() {
    let mut spec = JobSpec::new(200, "fio");
    spec.size = 65536;
    spec.qd = 8;
    spec.sequential = true;
    let s = sig_of(&[spec]);
    let j = &s.jobs[0];
    assert_eq!(j.writes.dominant_size(), 65536);
    assert!(j.writes.sequential_share() > 0.99);
    within_one(j.queue_depth.max_in_flight, 8);
    within_one(j.queue_depth.study_run, 8);
    within_one(j.queue_depth.median_in_flight, 8);
    assert_eq!(j.working_set.write_blocks, 2000 * 16);
    // Every byte written once: 8 requests per ms of 64 KiB.
    assert!(j.timeline.mean_mb_s() > 60.0);
}

#[test]
fn mixed_70_30() {
    let mut spec = JobSpec::new(300, "mix");
    spec.read_share = 0.7;
    spec.qd = 4;
    spec.requests = 5000;
    let s = sig_of(&[spec]);
    let j = &s.jobs[0];
    assert!((j.read_share() - 0.7).abs() <= 0.02, "{}", j.read_share());
    assert!(j.reads.random_share() > 0.99 && j.writes.random_share() > 0.99);
    assert_eq!(j.dominant_size(), 4096);
    within_one(j.queue_depth.max_in_flight, 4);
}

#[test]
fn two_jobs_interleaved() {
    let a = JobSpec::new(100, "db");
    let mut b = JobSpec::new(200, "backup");
    b.size = 65536;
    b.qd = 32;
    b.sequential = true;
    b.base = 100 << 30;
    b.service_ns = 100_000;
    b.requests = 8000;
    b.device = "8,16";
    let s = sig_of(&[a, b]);
    assert_eq!(s.jobs.len(), 2);
    let db = s.jobs.iter().find(|j| j.name.starts_with("db")).unwrap();
    let bk = s
        .jobs
        .iter()
        .find(|j| j.name.starts_with("backup"))
        .unwrap();
    assert_eq!(db.writes.dominant_size(), 4096);
    assert!(db.writes.random_share() > 0.99);
    within_one(db.queue_depth.max_in_flight, 1);
    within_one(db.queue_depth.study_run, 1);
    assert_eq!(bk.writes.dominant_size(), 65536);
    assert!(bk.writes.sequential_share() > 0.99);
    within_one(bk.queue_depth.max_in_flight, 32);
    within_one(bk.queue_depth.study_run, 32);
    assert_eq!(bk.devices, vec!["8,16".to_string()]);
    // Overall: the jobs' classifications summed, depth of both together.
    let o = &s.overall;
    assert_eq!(o.writes.requests, 10_000);
    assert_eq!(
        o.writes.sequential,
        db.writes.sequential + bk.writes.sequential
    );
    assert!(o.queue_depth.max_in_flight.unwrap() >= 32);
    let sizes = o.block_sizes();
    assert_eq!(sizes.get(&4096), Some(&(0, 2000)));
    assert_eq!(sizes.get(&65536), Some(&(0, 8000)));
}

#[test]
fn timeline_buckets_per_second() {
    let mut spec = JobSpec::new(1, "slow");
    spec.service_ns = 10_000_000; // 100 IOPS
    spec.requests = 500; // 5 s
    let s = sig_of(&[spec]);
    let tl = &s.jobs[0].timeline;
    assert_eq!(tl.bucket_ns, 1_000_000_000);
    assert!(
        tl.buckets.len() >= 5 && tl.buckets.len() <= 6,
        "{}",
        tl.buckets.len()
    );
    assert!((tl.buckets[1].write_ops as i64 - 100).abs() <= 1);
    assert_eq!(tl.buckets[1].write_bytes, tl.buckets[1].write_ops * 4096);
    assert_eq!(tl.idle_share(), 0.0);
    // Draining faster than the writes arrive: no backlog; slower: it piles up.
    assert_eq!(tl.peak_backlog(1.0), 0);
    assert!(tl.peak_backlog(0.1) > 1_000_000);
}

//! `hybridcache trace` end to end: fio runs of known shape through NBD, recorded by the
//! built-in tracer, must come back from the analyzer with the shape fio was told to produce
//! (block size exactly, random/sequential, queue depth within one, read share within 2 points,
//! one job per NBD connection). Also: bad `trace start` arguments change nothing, `--max-size`
//! ends the events, and a trace ends cleanly when its core is removed or the daemon stops.

mod common;

use std::path::{Path, PathBuf};

use common::{fio, need, workdir, Daemon, BIN};
use hybridcache_analyze::{parse_trace, Format, JobSignature, Signature, Trace};

/// A daemon with a RAM cache and a 1 GiB RAM core (exported as cas1-1), and enough NBD workers
/// per connection that fio's depth reaches the core.
fn setup() -> (tempfile::TempDir, Daemon) {
    let dir = workdir();
    let d = Daemon::start_with(dir.path(), &["--nbd-workers", "16"]);
    d.ok(&["-S", "-d", "ram:256M", "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", "ram:1G"]);
    (dir, d)
}

fn parse(path: &Path) -> Trace {
    let text = std::fs::read(path).expect("trace file");
    parse_trace(&text[..], Format::Blkparse).expect("trace parses")
}

/// Traces one fio run; returns the parsed trace, its signature and fio's JSON report.
fn record(
    d: &Daemon,
    dir: &Path,
    name: &str,
    jobs: &[&[&str]],
) -> (Trace, Signature, serde_json::Value) {
    let file = dir.join(format!("{name}.trace"));
    let out = d.ok(&[
        "trace",
        "start",
        "-i",
        "1",
        "-j",
        "1",
        "-o",
        file.to_str().unwrap(),
    ]);
    assert!(out.contains("tracing cache 1 core 1 (cas1-1)"), "{out}");
    let mut args = vec![
        "--ioengine=nbd".to_string(),
        format!("--uri={}", d.uri("cas1-1")),
        "--randrepeat=1".into(),
    ];
    for (i, job) in jobs.iter().enumerate() {
        args.push(format!("--name={name}{i}"));
        args.extend(job.iter().map(|s| s.to_string()));
    }
    let report = fio(dir, name, &args);
    let out = d.ok(&["trace", "stop", "-i", "1"]);
    assert!(out.contains("stopped by trace stop"), "{out}");
    let trace = parse(&file);
    assert_eq!(trace.report.bad, 0, "{}", trace.report);
    let sig = Signature::from_trace(&trace);
    // The CLI reads it too, and writes the charted report.
    let rd = dir.join(format!("{name}-report"));
    let o = std::process::Command::new(BIN)
        .args(["analyze", file.to_str().unwrap(), "--report-dir"])
        .arg(&rd)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(rd.join("report.md").exists() && rd.join("queue-depth.png").exists());
    (trace, sig, report)
}

fn ios(report: &serde_json::Value, job: usize, dir: &str) -> u64 {
    report["jobs"][job][dir]["total_ios"]
        .as_u64()
        .expect("fio total_ios")
}

fn only_size(j: &JobSignature) -> u64 {
    let sizes = j.block_sizes();
    assert_eq!(sizes.len(), 1, "{}: sizes {sizes:?}", j.name);
    *sizes.keys().next().unwrap()
}

fn depth(j: &JobSignature) -> u32 {
    j.queue_depth.max_in_flight.expect("completions traced")
}

fn within_one(got: u32, want: u32, what: &str) {
    eprintln!("{what}: queue depth {got}, fio iodepth {want}");
    assert!(
        got.abs_diff(want) <= 1,
        "{what}: queue depth {got}, fio iodepth {want}"
    );
}

#[test]
fn fio_shapes_come_back_from_the_analyzer() {
    if !need(&["fio"]) {
        return;
    }
    let (dir, d) = setup();
    let dir = dir.path();

    // Random 4 KiB writes at iodepth 1.
    let (_, sig, rep) = record(
        &d,
        dir,
        "rand4k-qd1",
        &[&["--rw=randwrite", "--bs=4k", "--iodepth=1", "--io_size=8m"]],
    );
    assert_eq!(sig.jobs.len(), 1, "one connection, one job");
    let j = &sig.jobs[0];
    assert!(j.name.starts_with("nbd/cas1-1 (pid "), "{}", j.name);
    assert_eq!(j.writes.requests, ios(&rep, 0, "write"));
    assert_eq!(only_size(j), 4096);
    assert!(j.writes.random_share() > 0.98, "{:?}", j.writes);
    within_one(depth(j), 1, "rand4k-qd1");
    assert!(j.read_share() < 0.02);

    // Sequential 64 KiB writes at iodepth 8.
    let (_, sig, rep) = record(
        &d,
        dir,
        "seq64k-qd8",
        &[&["--rw=write", "--bs=64k", "--iodepth=8", "--size=128m"]],
    );
    let j = &sig.jobs[0];
    assert_eq!(j.writes.requests, ios(&rep, 0, "write"));
    assert_eq!(only_size(j), 65536);
    assert!(j.writes.sequential_share() > 0.98, "{:?}", j.writes);
    within_one(depth(j), 8, "seq64k-qd8");

    // 70/30 random mixed 4 KiB.
    let (_, sig, rep) = record(
        &d,
        dir,
        "mixed70",
        &[&[
            "--rw=randrw",
            "--rwmixread=70",
            "--bs=4k",
            "--iodepth=4",
            "--io_size=8m",
        ]],
    );
    let j = &sig.jobs[0];
    let (r, w) = (ios(&rep, 0, "read"), ios(&rep, 0, "write"));
    assert_eq!((j.reads.requests, j.writes.requests), (r, w));
    let fio_share = r as f64 / (r + w) as f64;
    assert!(
        (j.read_share() - fio_share).abs() <= 0.02 && (j.read_share() - 0.70).abs() <= 0.02,
        "read share {} (fio {fio_share})",
        j.read_share()
    );
    assert!(j.reads.random_share() > 0.98 && j.writes.random_share() > 0.98);
    assert_eq!(only_size(j), 4096);
    within_one(depth(j), 4, "mixed70");

    // Two jobs of different shape at once: two connections, two signatures.
    let (_, sig, rep) = record(
        &d,
        dir,
        "two",
        &[
            &[
                "--rw=randwrite",
                "--bs=4k",
                "--iodepth=1",
                "--io_size=4m",
                "--offset=0",
                "--size=256m",
            ],
            &[
                "--rw=read",
                "--bs=64k",
                "--iodepth=4",
                "--offset=512m",
                "--size=64m",
            ],
        ],
    );
    assert_eq!(sig.jobs.len(), 2, "{:?}", names(&sig));
    let small = sig
        .jobs
        .iter()
        .find(|j| j.dominant_size() == 4096)
        .expect("the 4 KiB job");
    let large = sig
        .jobs
        .iter()
        .find(|j| j.dominant_size() == 65536)
        .expect("the 64 KiB job");
    assert_ne!(small.name, large.name);
    // Nothing of one connection leaked into the other's signature.
    assert_eq!(only_size(small), 4096);
    assert_eq!(only_size(large), 65536);
    assert_eq!(small.writes.requests, ios(&rep, 0, "write"));
    assert_eq!(small.reads.requests, 0);
    assert_eq!(large.reads.requests, ios(&rep, 1, "read"));
    assert_eq!(large.writes.requests, 0);
    assert!(small.writes.random_share() > 0.98);
    assert!(large.reads.sequential_share() > 0.98);
    within_one(depth(small), 1, "two: 4 KiB job");
    within_one(depth(large), 4, "two: 64 KiB job");
}

fn names(sig: &Signature) -> Vec<String> {
    sig.jobs.iter().map(|j| j.name.clone()).collect()
}

#[test]
fn bad_trace_start_changes_nothing() {
    let (dir, d) = setup();
    let file = dir.path().join("t.trace");
    let f = file.to_str().unwrap();
    let status = || d.ok(&["trace", "status"]);
    assert_eq!(status(), "no traces\n");

    let e = d.fails(&["trace", "start", "-i", "9", "-o", f]);
    assert!(e.contains("cache 9 does not exist"), "{e}");
    let e = d.fails(&["trace", "start", "-i", "1", "-j", "7", "-o", f]);
    assert!(e.contains("core 7 does not exist in cache 1"), "{e}");
    let e = d.fails(&[
        "trace",
        "start",
        "-i",
        "1",
        "-o",
        "/nonexistent-dir/t.trace",
    ]);
    assert!(
        e.contains("cannot create trace file /nonexistent-dir/t.trace"),
        "{e}"
    );
    let e = d.fails(&[
        "trace",
        "start",
        "-i",
        "1",
        "-o",
        dir.path().to_str().unwrap(),
    ]);
    assert!(e.contains("is a directory"), "{e}");
    assert!(!file.exists(), "no file left behind");
    assert_eq!(status(), "no traces\n");

    // Command-line errors: exit code 2, nothing sent.
    for args in [
        &["trace", "start", "-i", "0", "-o", f][..],
        &["trace", "start", "-i", "1"],
        &["trace", "start", "-i", "1", "-o", f, "--max-size", "lots"],
        &["trace", "stop"],
    ] {
        let o = d.cli(args);
        assert_eq!(o.status.code(), Some(2), "{args:?}");
    }
    let e = d.fails(&["trace", "stop", "-i", "1"]);
    assert!(e.contains("no trace of cache 1"), "{e}");

    // One trace per export at a time; the first keeps running.
    d.ok(&["trace", "start", "-i", "1", "-o", f]);
    let other = dir.path().join("u.trace");
    let e = d.fails(&[
        "trace",
        "start",
        "-i",
        "1",
        "-j",
        "1",
        "-o",
        other.to_str().unwrap(),
    ]);
    assert!(e.contains("cas1-1 is already traced"), "{e}");
    assert!(!other.exists());
    let s = status();
    assert!(s.contains("recording") && s.contains("all"), "{s}");
    d.ok(&["trace", "stop", "-i", "1"]);
    assert_eq!(status(), "no traces\n");
}

/// Requests through the crate's own NBD client, for tests that need no fio.
fn some_io(d: &Daemon, n: u64) {
    let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-1").unwrap();
    let buf = vec![5u8; 4096];
    for i in 0..n {
        c.write(&buf, i * 4096, false).unwrap();
    }
    c.flush().unwrap();
    c.disconnect().unwrap();
}

#[test]
fn max_size_and_ends_of_a_trace() {
    let (dir, mut d) = setup();
    let path = |n: &str| -> PathBuf { dir.path().join(n) };

    // --max-size: the events stop there and status says so.
    let small = path("small.trace");
    d.ok(&[
        "trace",
        "start",
        "-i",
        "1",
        "-j",
        "1",
        "-o",
        small.to_str().unwrap(),
        "--max-size",
        "4K",
    ]);
    some_io(&d, 500);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !d
        .ok(&["trace", "status"])
        .contains("max size 4 KiB reached")
    {
        assert!(
            std::time::Instant::now() < deadline,
            "{}",
            d.ok(&["trace", "status"])
        );
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = d.ok(&["trace", "stop", "-i", "1", "-j", "1"]);
    assert!(out.contains("ended: max size 4 KiB reached"), "{out}");
    let text = std::fs::read_to_string(&small).unwrap();
    let events: usize = text
        .lines()
        .take_while(|l| !l.starts_with("CPU0"))
        .map(|l| l.len() + 1)
        .sum();
    assert!(events <= 4096 && events > 3000, "{events} bytes of events");
    assert!(text.contains("Trace ended: max size 4 KiB reached"));
    let t = parse(&small);
    assert_eq!(t.report.bad, 0, "{}", t.report);

    // Removing the core ends its trace; the file is complete and the trace listed as ended.
    let gone = path("gone.trace");
    d.ok(&["trace", "start", "-i", "1", "-o", gone.to_str().unwrap()]);
    some_io(&d, 10);
    d.ok(&["-R", "-i", "1", "-j", "1", "--force"]);
    let s = d.ok(&["trace", "status"]);
    assert!(s.contains("ended: core 1 removed"), "{s}");
    let out = d.ok(&["trace", "stop", "-i", "1"]);
    assert!(
        out.contains("22 events"),
        "10 writes + 1 flush, Q and C: {out}"
    );
    let t = parse(&gone);
    assert_eq!(t.report.bad, 0);
    assert_eq!(t.events.len(), 22);

    // The daemon stopping finishes the file.
    d.ok(&["-A", "-i", "1", "-d", "ram:1G"]);
    let last = path("last.trace");
    d.ok(&[
        "trace",
        "start",
        "-i",
        "1",
        "-j",
        "1",
        "-o",
        last.to_str().unwrap(),
    ]);
    some_io(&d, 3);
    assert!(d.stop(), "daemon stops cleanly");
    let text = std::fs::read_to_string(&last).unwrap();
    assert!(text.contains("Trace ended: daemon stopped"), "{text}");
    assert_eq!(parse(&last).events.len(), 8);
}

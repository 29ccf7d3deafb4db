//! `hybridcache bench device`: its argument handling, its refusals (it WRITES to the device),
//! and one short run when fio and nbdkit are installed (`make deps`).

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::{file_cache, need, sparse_file, workdir, BIN};

fn bench_device(args: &[&str]) -> Output {
    Command::new(BIN)
        .args(["bench", "device"])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run hybridcache bench device")
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

#[test]
fn bad_arguments_are_usage_errors() {
    let dir = workdir();
    let img = dir.path().join("cache.img");
    sparse_file(&img, 64 << 20);
    let c = path_str(&img);
    for (args, why) in [
        (vec!["--cache", c, "--reps", "0"], "--reps"),
        (vec!["--cache", c, "--runtime", "0"], "--runtime"),
        (vec!["--cache", c, "--size", "1000"], "multiple of 1 MiB"),
        (vec!["--cache", c, "--size", "lots"], "--size"),
        (
            vec!["--cache", c, "--pattern", "read"],
            "randread or randwrite",
        ),
        (vec!["--cache", c, "--iodepth", "0"], "--iodepth"),
        (vec!["--cache", c, "--variants", "workers=0"], "workers"),
        (vec!["--cache", c, "--variants", "io=aio"], "io must be"),
        (
            vec!["--cache", c, "--variants", "speed=9"],
            "unknown setting",
        ),
    ] {
        let o = bench_device(&args);
        assert_eq!(o.status.code(), Some(2), "{args:?}: {}", text(&o));
        assert!(
            String::from_utf8_lossy(&o.stderr).contains(why),
            "{args:?}: {}",
            text(&o)
        );
    }
    let o = bench_device(&[]);
    assert_eq!(o.status.code(), Some(2), "no --cache: {}", text(&o));
    let o = bench_device(&["--cache", path_str(&dir.path().join("missing"))]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(String::from_utf8_lossy(&o.stderr).contains("cannot find"));
}

#[test]
fn refuses_a_device_with_a_file_system() {
    if !need(&["mkfs.ext4"]) {
        return;
    }
    let dir = workdir();
    let img = dir.path().join("fs.img");
    sparse_file(&img, 64 << 20);
    let mk = Command::new("mkfs.ext4")
        .args(["-q", "-F", path_str(&img)])
        .output()
        .expect("mkfs.ext4");
    assert!(mk.status.success(), "{mk:?}");
    let before = std::fs::read(&img).unwrap();
    // --force overrides a cache's superblock, never a file system.
    for extra in [&[][..], &["--force"][..]] {
        let mut args = vec!["--cache", path_str(&img), "--runtime", "1"];
        args.extend_from_slice(extra);
        let o = bench_device(&args);
        assert_eq!(o.status.code(), Some(1), "{}", text(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("ext4 file system"), "{}", text(&o));
    }
    assert!(
        std::fs::read(&img).unwrap() == before,
        "the file system was touched"
    );
}

#[test]
fn refuses_a_device_in_use_and_a_cache_without_force() {
    let mut fc = file_cache(64 << 20, 64 << 20, &["-c", "wb"]);
    let cache = fc.cache.clone();
    let o = bench_device(&["--cache", path_str(&cache), "--runtime", "1"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("in use"),
        "{}",
        text(&o)
    );
    // Stopped: free again, but it holds the cache's metadata now.
    assert!(fc.daemon.stop());
    let o = bench_device(&["--cache", path_str(&cache), "--runtime", "1"]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("holds hybridcache cache 1"),
        "{}",
        text(&o)
    );
}

#[test]
fn short_run_prints_the_table_and_leaves_no_cache() {
    if !need(&["fio", "nbdkit"]) {
        return;
    }
    let dir = workdir();
    let img = dir.path().join("cache.img");
    sparse_file(&img, 64 << 20);
    let o = bench_device(&[
        "--cache",
        path_str(&img),
        "--size",
        "32M",
        "--runtime",
        "1",
        "--reps",
        "1",
        "--pattern",
        "randread",
        "--iodepth",
        "1",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let row = out
        .lines()
        .find(|l| l.starts_with("| default | randread qd1 |"))
        .unwrap_or_else(|| panic!("no table row: {}", text(&o)));
    // Three IOPS columns, each a positive figure in thousands.
    let cols: Vec<&str> = row.split('|').map(str::trim).collect();
    for c in &cols[3..6] {
        let k: f64 = c.trim_end_matches('k').parse().expect("IOPS column");
        assert!(k > 0.0, "{row}");
    }
    assert!(out.contains("ours/nbdkit"), "{out}");
    // The servers' CPU per request: both served requests, so both used CPU.
    for c in &cols[8..10] {
        let us: f64 = c.parse().expect("CPU column");
        assert!(us > 0.0, "{row}");
    }
    assert!(!out.contains("missed the cache"), "{out}");
    // The scratch cache's superblock is gone: a second run needs no --force.
    let head = std::fs::read(&img).unwrap();
    assert!(head[..2 << 20].iter().all(|&b| b == 0));
}

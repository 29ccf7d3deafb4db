//! `hybridcache bench search` end to end, short: one shape, two grid points, 1 s cells, one
//! confirming round (about 20 s). The full search (docs/analyzer.md's table) runs by hand.
//! Prints a reason and passes when fio is missing (`make deps` installs it).

mod common;

use std::process::{Command, Stdio};

use common::{have, workdir, BIN};
use serde_json::Value;

#[test]
fn short_search_traces_analyses_and_runs_the_recommendation() {
    if !have("fio") {
        eprintln!("skipped: fio is not installed (make deps)");
        return;
    }
    let dir = workdir();
    let out = dir.path().join("out");
    let o = Command::new(BIN)
        .args([
            "bench",
            "search",
            "randwrite-burst-hdd",
            "--max-configs",
            "2",
            "--runtime",
            "1",
            "--confirm",
            "1",
            "-o",
        ])
        .arg(&out)
        .stdin(Stdio::null())
        .output()
        .expect("run hybridcache bench search");
    let text = format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(o.status.success(), "{text}");
    let r: Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("search.json")).unwrap()).unwrap();
    let shapes = r["shapes"].as_array().unwrap();
    assert_eq!(shapes.len(), 1);
    let s = &shapes[0];

    // The tracer recorded the traced run, and the analyzer read it back.
    let trace = std::fs::read_to_string(s["trace"].as_str().unwrap()).unwrap();
    assert!(
        trace.contains(" Q   W "),
        "{}",
        &trace[..trace.len().min(400)]
    );
    assert!(trace.contains("Trace ended"), "{text}");
    assert!(s["trace_requests"].as_u64().unwrap() > 50, "{text}");

    // The traced pt cell plus two grid points, each measured.
    let grid = s["grid"].as_array().unwrap();
    assert_eq!(grid.len(), 3, "{text}");
    assert_eq!(grid[0]["label"], "pt (traced)");
    for g in grid {
        assert!(g["error"].is_null(), "{g}");
        assert!(g["figure"].as_f64().unwrap() > 0.0, "{g}");
    }

    // Random 4 KiB writes at depth 8 on the HDD RAID: write-back with lazy flush (the core
    // takes ~340 IOPS there, cleaning at depth 32 ~930, the cache far more), and those are the
    // settings the recommended cell ran with.
    let rec = &s["recommended"];
    assert!(rec["error"].is_null(), "{rec}");
    assert!(
        rec["label"]
            .as_str()
            .unwrap()
            .starts_with("analyzer: wb 4K"),
        "{rec}"
    );
    assert_eq!(rec["settings"]["mode"], "wb");
    assert_eq!(rec["settings"]["lazy_flush"], true);
    assert!(rec["figure"].as_f64().unwrap() > 0.0);
    let reasons = s["reasons"].as_array().unwrap();
    assert!(
        reasons.iter().any(|x| x[0] == "lazy-flush on"),
        "{reasons:?}"
    );

    // One confirming round; the verdict follows from its figures.
    let confirm = s["confirm"].as_array().unwrap();
    assert_eq!(confirm.len(), 1);
    let (b, a) = (
        confirm[0][0]["figure"].as_f64().unwrap(),
        confirm[0][1]["figure"].as_f64().unwrap(),
    );
    let ratio = s["ratio"].as_f64().unwrap();
    assert!((ratio - (a / b.max(a))).abs() < 1e-9, "{ratio} {a} {b}");
    assert_eq!(s["pass"].as_bool().unwrap(), ratio >= 0.9);
    let md = std::fs::read_to_string(out.join("search.md")).unwrap();
    assert!(
        md.contains("| randwrite-burst-hdd | HDD RAID 60 (study60) | 3 |"),
        "{md}"
    );
}

#[test]
fn unknown_shapes_are_a_usage_error() {
    let o = Command::new(BIN)
        .args(["bench", "search", "no-such-shape", "--list"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("'no-such-shape' is not a shape (randwrite-burst-hdd"),
        "{err}"
    );
}

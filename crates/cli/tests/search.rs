//! `hybridcache bench search` end to end, short: one shape, two grid points, 1 s cells, three
//! confirming rounds (about 25 s). The full search (docs/analyzer.md's table) runs by hand.
//! Prints a reason and passes when fio is missing (`make deps` installs it).

mod common;

use std::process::{Command, Stdio};

use common::{need, workdir, BIN};
use serde_json::Value;

#[test]
fn short_search_traces_analyses_and_runs_the_recommendation() {
    if !need(&["fio"]) {
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
            "3",
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

    // Three confirming rounds, alternating who runs first; the verdict follows from their
    // figures: the median of the per-round ratios analyzer / best, capped at 100%, and 100%
    // when the recommendation is the best grid point itself.
    let confirm = s["confirm"].as_array().unwrap();
    assert_eq!(confirm.len(), 3);
    let mut ratios: Vec<f64> = confirm
        .iter()
        .map(|pair| {
            assert!(pair[0]["label"].as_str().unwrap().starts_with("again: "));
            assert!(pair[1]["label"]
                .as_str()
                .unwrap()
                .starts_with("again: analyzer: "));
            let (b, a) = (
                pair[0]["figure"].as_f64().unwrap(),
                pair[1]["figure"].as_f64().unwrap(),
            );
            assert!(b > 0.0 && a > 0.0, "{pair}");
            a / b
        })
        .collect();
    let stored: Vec<f64> = s["round_ratios"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap())
        .collect();
    for (x, y) in ratios.iter().zip(&stored) {
        assert!((x - y).abs() < 1e-9, "{ratios:?} {stored:?}");
    }
    ratios.sort_by(f64::total_cmp);
    let median = ratios[1];
    assert!((s["measured_ratio"].as_f64().unwrap() - median).abs() < 1e-9);
    let same = s["same_as_best"].as_bool().unwrap();
    let ratio = s["ratio"].as_f64().unwrap();
    let expected = if same { 1.0 } else { median.min(1.0) };
    assert!((ratio - expected).abs() < 1e-9, "{ratio} {ratios:?} {same}");
    assert_eq!(s["pass"].as_bool().unwrap(), same || ratio >= 0.9);
    let md = std::fs::read_to_string(out.join("search.md")).unwrap();
    let row = "| randwrite-burst-hdd | HDD RAID 60 (study60) | 3 |";
    let line = md
        .lines()
        .find(|l| l.starts_with(row))
        .unwrap_or_else(|| panic!("{md}"));
    let ratio_cell = if same {
        "| 100% (same configuration) |".to_string()
    } else {
        format!("| {:.0}% |", ratio * 100.0)
    };
    assert!(line.contains(&ratio_cell), "{line}");
    assert!(
        line.contains(&format!("| {:.0}% (", median * 100.0)),
        "{line}"
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

//! `hybridcache bench` and `hybridcache serve` end to end, through the real binary.
//!
//! The matrix tests run fio against RAM/throttle devices for 1 s per cell, so the whole file
//! takes well under a minute; they print a reason and pass when fio is missing (`make test`
//! installs it, so in CI they run). Bad-input and `serve` tests need no external tool.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{need, workdir, BIN};
use serde_json::Value;

fn bench(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("bench")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run hybridcache bench")
}

fn text(o: &Output) -> String {
    format!(
        "exit {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The tiny matrix: 1 pattern x 1 block size x 2 iodepths x (core, cache), 1 s per cell.
fn tiny(out: &Path) -> Vec<String> {
    [
        "run",
        "--out",
        out.to_str().unwrap(),
        "--core",
        "throttle:latency_us=300:ram:256M",
        "--cache",
        "ram:32M",
        "--pattern",
        "randwrite",
        "--bs",
        "4K",
        "--iodepth",
        "1,4",
        "--runtime",
        "1",
        "--size",
        "16M",
        "--configs",
        "core,cache",
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn load(out: &Path) -> Value {
    let t = std::fs::read_to_string(out.join("results.json")).expect("results.json");
    serde_json::from_str(&t).expect("results.json parses")
}

fn is_png(path: &Path) -> bool {
    std::fs::read(path)
        .map(|b| b.starts_with(b"\x89PNG\r\n\x1a\n") && b.len() > 1000)
        .unwrap_or(false)
}

#[test]
fn tiny_matrix_end_to_end_then_resume() {
    if !need(&["fio"]) {
        return;
    }
    let dir = workdir();
    let out = dir.path().join("out");
    let args = tiny(&out);
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let o = bench(&argv);
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("| bs \\ nj/qd | 1/1 | 1/4 |"), "{stdout}");
    assert!(stdout.contains("IOPS ratio cache / core"), "{stdout}");

    let r = load(&out);
    assert_eq!(r["format"], "hybridcache-bench/1");
    assert_eq!(r["complete"], true);
    assert!(r["versions"]["fio"].as_str().unwrap().contains("fio"));
    assert!(r["machine"]["cores"].as_u64().unwrap() >= 1);
    assert_eq!(r["matrix"]["iodepths"], serde_json::json!([1, 4]));
    let cells = r["cells"].as_array().unwrap();
    assert_eq!(cells.len(), 4, "{cells:?}");
    for c in cells {
        assert_eq!(c["status"], "ok", "{c}");
        let fio = &c["outcome"]["fio"];
        assert!(fio["iops"].as_f64().unwrap() > 0.0, "{c}");
        assert!(fio["mb_s"].as_f64().unwrap() > 0.0, "{c}");
        let w = &fio["write"];
        for k in ["lat_mean_us", "lat_p99_us", "lat_p9999_us"] {
            assert!(w[k].as_f64().unwrap() > 0.0, "{k}: {c}");
        }
        if c["cell"]["config"] == "cache" {
            let after = &c["outcome"]["stats_after"];
            assert!(after["dirty_lines"].as_u64().unwrap() > 0, "{c}");
            let series = c["outcome"]["series"].as_array().unwrap();
            assert!(!series.is_empty(), "{c}");
            assert!(series.iter().any(|s| s["dirty_pct"].as_f64().is_some()));
        }
    }
    // The cache in front of a 300 us core beats it at iodepth 1.
    let iops = |cfg: &str, qd: u64| {
        cells
            .iter()
            .find(|c| c["cell"]["config"] == cfg && c["cell"]["iodepth"] == qd)
            .map(|c| c["outcome"]["fio"]["iops"].as_f64().unwrap())
            .unwrap()
    };
    assert!(iops("cache", 1) > iops("core", 1), "{r}");

    let md = std::fs::read_to_string(out.join("report.md")).expect("report.md");
    assert!(md.contains("# hybridcache bench report"));
    assert!(
        md.contains("![charts/iops-randwrite-4K.png](charts/iops-randwrite-4K.png)"),
        "{md}"
    );
    assert!(md.contains("## Cache statistics"), "{md}");
    assert!(is_png(&out.join("charts/iops-randwrite-4K.png")));
    assert!(is_png(&out.join("charts/dirty-randwrite-4K.png")));
    assert!(is_png(&out.join("charts/cleaning-randwrite-4K.png")));
    assert!(is_png(&out.join("charts/free-randwrite-4K.png")));
    assert!(is_png(&out.join("charts/clean-randwrite-4K.png")));
    assert!(
        md.contains("![charts/cleaning-randwrite-4K.png](charts/cleaning-randwrite-4K.png)"),
        "{md}"
    );

    // Without --resume an existing run is not overwritten.
    let o = bench(&argv);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("--resume"), "{}", text(&o));

    // Resume with nothing to do: no cell runs again.
    let mut resume = argv.clone();
    resume.push("--resume");
    let started = Instant::now();
    let o = bench(&resume);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("4 of 4 cells already measured, 0 to go"),
        "{}",
        text(&o)
    );
    assert!(started.elapsed() < Duration::from_secs(5));
    assert_eq!(load(&out)["cells"], r["cells"]);

    // Drop one cell: resume measures that one only.
    let mut r2 = r.clone();
    let removed = r2["cells"].as_array_mut().unwrap().remove(3);
    r2["complete"] = Value::Bool(false);
    std::fs::write(out.join("results.json"), r2.to_string()).unwrap();
    let o = bench(&resume);
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("3 of 4 cells already measured, 1 to go"),
        "{}",
        text(&o)
    );
    let r3 = load(&out);
    assert_eq!(r3["complete"], true);
    let cells3 = r3["cells"].as_array().unwrap();
    assert_eq!(cells3.len(), 4);
    assert_eq!(cells3[..3], r["cells"].as_array().unwrap()[..3]);
    assert_eq!(cells3[3]["key"], removed["key"]);
    assert_ne!(cells3[3]["outcome"], removed["outcome"]);

    // Another matrix is refused on resume.
    let mut other = resume.clone();
    other.extend(["--iodepth", "8"]);
    let o = bench(&other);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("matrix differs"), "{}", text(&o));
}

#[test]
fn ctrl_c_stops_cleanly_and_keeps_what_was_measured() {
    if !need(&["fio"]) {
        return;
    }
    let dir = workdir();
    let out = dir.path().join("out");
    let mut args = tiny(&out);
    // Two cells of 2 s, core only; interrupt during the second.
    for (k, v) in [
        ("--iodepth", "1,2"),
        ("--runtime", "2"),
        ("--configs", "core"),
    ] {
        let i = args.iter().position(|a| a == k).unwrap();
        args[i + 1] = v.to_string();
    }
    let child = Command::new(BIN)
        .arg("bench")
        .args(&args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    // Wait until the first cell is saved, then interrupt.
    let end = Instant::now() + Duration::from_secs(20);
    while !out.join("results.json").exists() && Instant::now() < end {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(700));
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(pid, libc::SIGINT) };
    let o = child.wait_with_output().unwrap();
    assert_eq!(o.status.code(), Some(130), "{}", text(&o));
    assert!(text(&o).contains("--resume continues"), "{}", text(&o));
    let r = load(&out);
    assert_eq!(r["complete"], false);
    assert_eq!(r["cells"].as_array().unwrap().len(), 1, "{r}");
    assert!(out.join("report.md").exists());
    // No child is left behind: the sockets' servers are gone.
    let sock = out.join("run/core.sock");
    assert!(std::os::unix::net::UnixStream::connect(&sock).is_err());
}

/// Runs a one-cell-per-pattern matrix (cache only, 1 s at depth 4, 16M over a RAM cache of
/// `cache` with no cleaning) with `extra` appended to `[cache]`; returns the cells by pattern.
fn policy_run(name: &str, cache: &str, patterns: &str, extra: &str) -> (Value, Vec<Value>) {
    let dir = workdir();
    let out = dir.path().join("out");
    let f = dir.path().join(format!("{name}.toml"));
    std::fs::write(
        &f,
        format!(
            "[matrix]\npatterns = {patterns}\niodepths = [4]\nruntime = 1\nsize = \"16M\"\nconfigs = [\"cache\"]\n[core]\ndevice = \"throttle:latency_us=200:ram:64M\"\n[cache]\ndevice = \"{cache}\"\ncleaning = \"nop\"\n{extra}\n"
        ),
    )
    .unwrap();
    let o = bench(&[
        "run",
        "-m",
        f.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let r = load(&out);
    let cells = r["cells"].as_array().unwrap().clone();
    for c in &cells {
        assert_eq!(c["status"], "ok", "{c}");
    }
    (r, cells)
}

fn after(cell: &Value, counter: &str) -> u64 {
    cell["outcome"]["stats_after"][counter]
        .as_u64()
        .unwrap_or_else(|| panic!("{counter}: {cell}"))
}

/// The `[cache]` policy keys reach the daemon: lazy flush sends writes to the core once the
/// cache is full of dirty data (no cleaning), read-ahead prefetches for a sequential read, and
/// nhit with trigger 0 inserts nothing seen once (those requests pass through).
#[test]
fn matrix_policy_keys_reach_the_daemon() {
    if !need(&["fio"]) {
        return;
    }
    // 4x the cache's size: it fills with dirty data, and with lazy flush off (it is on by
    // default) every write that finds no line cleans inside the request instead.
    let (r, cells) = policy_run("lazy", "ram:4M", r#"["randwrite"]"#, "lazy_flush = false");
    assert_eq!(r["matrix"]["cache"]["lazy_flush"], false);
    assert_eq!(after(&cells[0], "lazy_flush_writes"), 0, "{}", cells[0]);
    // The region fits: read-ahead is not held back by a full cache.
    let (_, cells) = policy_run(
        "readahead",
        "ram:64M",
        r#"["read"]"#,
        "prefetch = { policy = \"readahead\", threshold_kib = 64, distance = 512 }",
    );
    assert!(after(&cells[0], "prefetch_requests") > 0, "{}", cells[0]);

    let (r, cells) = policy_run(
        "nhit",
        "ram:4M",
        r#"["randread"]"#,
        "promotion = { policy = \"nhit\", threshold = 2, trigger = 0 }",
    );
    assert_eq!(r["matrix"]["cache"]["promotion"]["threshold"], 2);
    assert!(after(&cells[0], "pass_through_reads") > 0, "{}", cells[0]);
    // And without the keys, the daemon's defaults: lazy flush (the 4 MiB cache fills with
    // dirty data under nop), everything inserted.
    let (_, cells) = policy_run("defaults", "ram:4M", r#"["randwrite", "randread"]"#, "");
    assert!(after(&cells[0], "lazy_flush_writes") > 0, "{}", cells[0]);
    assert_eq!(after(&cells[1], "pass_through_reads"), 0, "{}", cells[1]);
}

/// The burst protocol writes a multiple of the cache from empty, for the core alone too, and
/// charts IOPS over time.
#[test]
fn burst_writes_twice_the_cache_and_charts_iops_over_time() {
    if !need(&["fio"]) {
        return;
    }
    let dir = workdir();
    let out = dir.path().join("out");
    let o = bench(&[
        "run",
        "-o",
        out.to_str().unwrap(),
        // 1000 IOPS at the core: once the cache is full the burst takes seconds, so the
        // once-a-second series has points whatever the machine's speed.
        "--core",
        "throttle:latency_us=100,iops=1000:ram:128M",
        "--cache",
        "ram:4M",
        "--pattern",
        "randwrite",
        "--iodepth",
        "8",
        "--size",
        "32M",
        "--protocol",
        "burst",
        "--lazy-flush",
        "on",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let r = load(&out);
    assert_eq!(r["matrix"]["protocol"]["burst_factor"], 4.0);
    assert_eq!(r["matrix"]["cache"]["lazy_flush"], true);
    for c in r["cells"].as_array().unwrap() {
        assert_eq!(c["status"], "ok", "{c}");
        let written = c["outcome"]["fio"]["write"]["bytes"].as_u64().unwrap();
        assert_eq!(written, 16 << 20, "{c}");
        assert!(
            c["outcome"]["fio"]["write"]["lat_p9999_us"]
                .as_f64()
                .unwrap()
                > 0.0
        );
        if c["cell"]["config"] == "cache" {
            assert_eq!(after(c, "exported_written_bytes"), 16 << 20, "{c}");
        }
    }
    assert!(is_png(&out.join("charts/iops-time-randwrite-4K.png")));
    let md = std::fs::read_to_string(out.join("report.md")).unwrap();
    assert!(md.contains("charts/iops-time-randwrite-4K.png"), "{md}");
    assert!(md.contains("p99.99 latency, ms"), "{md}");

    // Two runs in one chart (here the same run twice, labelled apart).
    let png = dir.path().join("overlay.png");
    let on = format!("on={}", out.display());
    let off = format!("off={}", out.display());
    let o = bench(&["overlay", "-o", png.to_str().unwrap(), &on, &off]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("2 series"), "{}", text(&o));
    assert!(is_png(&png));
    let o = bench(&["overlay", "-o", png.to_str().unwrap(), "nolabel"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let missing = format!("x={}", dir.path().join("nothing").display());
    let o = bench(&["overlay", "-o", png.to_str().unwrap(), &missing]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
}

#[test]
fn bad_matrix_files_name_the_key() {
    let dir = workdir();
    let cases = [
        ("[matrix]\nblok_sizes = [\"4K\"]\n", "blok_sizes"),
        (
            "[matrix]\nblock_sizes = [\"4Q\"]\n[core]\ndevice = \"ram:1G\"\n",
            "matrix.block_sizes",
        ),
        (
            "[matrix]\npatterns = [\"randomwrite\"]\n[core]\ndevice = \"ram:1G\"\n",
            "matrix.patterns",
        ),
        ("[core]\ndevice = \"ram:1G\"\n", "cache.device"),
        ("[matrix]\nruntime = \"ten\"\n", "runtime"),
    ];
    for (i, (toml, key)) in cases.iter().enumerate() {
        let f = dir.path().join(format!("m{i}.toml"));
        std::fs::write(&f, toml).unwrap();
        let o = bench(&["run", "-m", f.to_str().unwrap(), "--dry-run"]);
        assert_eq!(o.status.code(), Some(2), "{toml}: {}", text(&o));
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(key), "{toml}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{err}");
    }
    let o = bench(&["run", "-m", "/no/such/matrix.toml"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("/no/such/matrix.toml"));
    // A good file: --dry-run lists the cells.
    let f = dir.path().join("good.toml");
    std::fs::write(
        &f,
        "[matrix]\npatterns = [\"randwrite\", \"randrw70\"]\nblock_sizes = [\"4K\", 65536]\niodepths = [1, 32]\n[core]\ndevice = \"ram:1G\"\n[cache]\ndevice = \"ram:64M\"\n",
    )
    .unwrap();
    let o = bench(&["run", "-m", f.to_str().unwrap(), "--dry-run"]);
    assert!(o.status.success(), "{}", text(&o));
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(stdout.contains("cache/randrw70/64K/1x32/r0"), "{stdout}");
    assert!(stdout.contains("16 cells"), "{stdout}");
}

#[test]
fn calibration_by_simulation_prints_the_study_next_to_ours() {
    let o = bench(&[
        "calibration",
        "--method",
        "sim",
        "--random-only",
        "--requests",
        "50",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(s.contains("in-process simulation"), "{s}");
    assert!(s.contains("| randwrite 4K | IOPS |"), "{s}");
    assert!(
        s.contains("(63.0)") && s.contains("(929)") && s.contains("Worst cell"),
        "{s}"
    );
    assert!(s.contains("of 5 cells within a factor of 1.5"), "{s}");
}

#[test]
fn serve_exports_a_bare_device_until_sigterm() {
    let dir = workdir();
    let sock = dir.path().join("core.sock");
    let mut child = Command::new(BIN)
        .args(["serve", "--core", "ram:16M", "--name", "bare", "--socket"])
        .arg(&sock)
        .stdin(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let end = Instant::now() + Duration::from_secs(10);
    let mut client = loop {
        match hybridcache_nbd::Client::connect_unix(&sock, "bare") {
            Ok(c) => break c,
            Err(e) if Instant::now() > end => panic!("serve did not listen: {e}"),
            Err(_) => std::thread::sleep(Duration::from_millis(20)),
        }
    };
    assert_eq!(client.size(), 16 << 20);
    client.write(&[0x5a; 4096], 1 << 20, true).unwrap();
    let mut buf = [0u8; 4096];
    client.read(&mut buf, 1 << 20).unwrap();
    assert_eq!(buf, [0x5a; 4096]);
    client.flush().unwrap();
    drop(client);
    // The default export ("") is the same device.
    let c = hybridcache_nbd::Client::connect_unix(&sock, "").unwrap();
    assert_eq!(c.size(), 16 << 20);
    drop(c);
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert!(status.success(), "{status}");
    assert!(!sock.exists());

    let o = Command::new(BIN)
        .args(["serve", "--core", "bogus:1G", "--socket"])
        .arg(dir.path().join("x.sock"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--core"));
}

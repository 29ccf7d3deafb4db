//! `hybridcache analyze` end to end through the binary: a small synthetic blkparse trace
//! (tests/data/sample.blkparse, made by tests/data/gen_sample.py) in; the text and Markdown
//! reports, the commands script and the TOML fragment out; bad input refused with exit code 2.
//! No daemon is needed, except by the `--apply` test.

mod common;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{workdir, Daemon, BIN};

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn sample() -> String {
    data("sample.blkparse").display().to_string()
}

fn run(args: &[&str]) -> Output {
    Command::new(BIN)
        .arg("analyze")
        .args(args)
        .env_remove("HYBRIDCACHE_CONTROL")
        .output()
        .expect("run hybridcache analyze")
}

/// Runs and requires success; returns stdout.
fn ok(args: &[&str]) -> String {
    let out = run(args);
    assert!(
        out.status.success(),
        "analyze {args:?} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 report")
}

/// Runs and requires exit code 2; returns stderr.
fn refused(args: &[&str]) -> String {
    let out = run(args);
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert_eq!(
        out.status.code(),
        Some(2),
        "analyze {args:?} should exit 2: stdout {} stderr {err}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(out.stdout.is_empty(), "no report on failure");
    assert!(err.starts_with("hybridcache: "), "{err}");
    err
}

#[test]
fn text_report_names_block_size_and_mode() {
    let out = run(&[&sample()]);
    assert!(out.status.success());
    assert!(
        out.stderr.is_empty(),
        "clean trace, no warning: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report = String::from_utf8(out.stdout).unwrap();
    assert!(
        report.starts_with("hybridcache workload analysis"),
        "{report}"
    );
    // The trace: 2160 blkparse lines, two jobs.
    assert!(report.contains("Format blkparse"), "{report}");
    assert!(report.contains("2160 lines: 2160 parsed"), "{report}");
    assert!(report.contains("dbserver (pid 100)"), "{report}");
    assert!(report.contains("backup (pid 200)"), "{report}");
    // Dominant block size: 600 of 720 requests are 4 KiB.
    assert!(
        report.contains("83% of the requests the cache takes are 4 KiB"),
        "{report}"
    );
    assert!(
        report.contains("4 KiB (r 167, w 433)  600       83%"),
        "{report}"
    );
    // Random 4 KiB writes at depth 1 on the study's RAID: write-back.
    assert!(report.contains("Mode wb, 4 KiB lines"), "{report}");
    assert!(report.contains("cache mode wb: write-back"), "{report}");
    assert!(report.contains("hybridcache -Q -c wb -i 1"), "{report}");
}

#[test]
fn markdown_report_and_profile_choice() {
    let md = ok(&[&sample(), "--markdown", "--profile", "nvme"]);
    assert!(md.starts_with("# "), "{md}");
    assert!(md.contains("\n## Recommended configuration"), "{md}");
    assert!(md.contains("generic NVMe"), "profile named: {md}");
    assert!(md.contains("\n| "), "tables: {md}");
    assert!(md.contains("```"), "code blocks: {md}");
    // Same input, text and Markdown differ only in rendering.
    let text = ok(&[&sample(), "--profile", "nvme"]);
    assert_ne!(md, text);
}

#[test]
fn output_commands_and_config_files() {
    let dir = workdir();
    let report = dir.path().join("report.md");
    let script = dir.path().join("apply.sh");
    let toml_out = dir.path().join("cache.toml");
    let stdout = ok(&[
        &sample(),
        "--markdown",
        "-o",
        report.to_str().unwrap(),
        "--commands",
        script.to_str().unwrap(),
        "--config-out",
        toml_out.to_str().unwrap(),
        "-i",
        "5",
    ]);
    assert!(stdout.is_empty(), "report went to the file: {stdout}");
    let md = std::fs::read_to_string(&report).unwrap();
    assert!(md.starts_with("# ") && md.contains("hybridcache -Q -c wb -i 5"));

    let sh = std::fs::read_to_string(&script).unwrap();
    assert!(sh.starts_with("#!/bin/sh\n"), "{sh}");
    assert!(sh.contains("\nset -e\n"), "{sh}");
    assert!(sh.contains("\nhybridcache -Q -c wb -i 5\n"), "{sh}");
    assert!(
        sh.contains("\nhybridcache -X -n seq-cutoff -i 5 -p never -t 1024\n"),
        "{sh}"
    );
    assert!(
        sh.contains("# new cache: hybridcache -S -d CACHE_DEVICE -i 5 -c wb -x 4"),
        "{sh}"
    );
    assert!(sh.contains("# cache mode wb: write-back"), "reasons: {sh}");
    // Every line is a comment, `set -e` or a hybridcache command.
    for l in sh.lines() {
        assert!(
            l.starts_with('#') || l == "set -e" || l.starts_with("hybridcache "),
            "unexpected script line {l:?}"
        );
    }
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&script).unwrap().permissions().mode();
    assert_eq!(mode & 0o111, 0o111, "script is executable");
    let syntax = Command::new("sh").arg("-n").arg(&script).status().unwrap();
    assert!(syntax.success(), "sh -n {}", script.display());

    let text = std::fs::read_to_string(&toml_out).unwrap();
    let v: toml::Table = toml::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
    let cache = &v["cache"].as_array().expect("[[cache]]")[0];
    assert_eq!(cache["id"].as_integer(), Some(5));
    assert_eq!(cache["mode"].as_str(), Some("wb"));
    assert_eq!(cache["line_size"].as_integer(), Some(4));
    let params = cache["params"].as_table().expect("[cache.params]");
    assert_eq!(params["cleaning.policy"].as_str(), Some("alru"));
    assert!(params.contains_key("cleaning-alru.wake-up"), "{text}");
    assert!(text.contains("# recommended cache size: "), "{text}");
    assert!(
        text.contains("hybridcache -X -n seq-cutoff -i 5 -p never -t 1024"),
        "{text}"
    );
    assert!(
        text.starts_with("# cache mode wb:"),
        "reasons as comments: {text}"
    );
}

/// A profile whose core writes large sequential blocks faster than the cache: the backup job is
/// bypassed with a cutoff and IO classes, whose CSV the script writes with a here-document.
#[test]
fn io_classes_in_the_script_and_a_profile_file() {
    let dir = workdir();
    let profile = dir.path().join("raid6-optane.toml");
    std::fs::write(
        &profile,
        r#"name = "my RAID 6 + Optane"
[core]
name = "RAID 6"
points = [
  { pattern = "random", dir = "write", block_kib = 4, queue_depth = 1, iops = 90 },
  { pattern = "random", dir = "write", block_kib = 4, queue_depth = 32, iops = 700 },
  { pattern = "sequential", dir = "write", block_kib = 1024, queue_depth = 8, mb_s = 900 },
]
[cache]
name = "Optane"
points = [
  { pattern = "random", dir = "write", block_kib = 4, queue_depth = 1, iops = 100000 },
  { pattern = "sequential", dir = "write", block_kib = 1024, queue_depth = 8, mb_s = 6000 },
]
"#,
    )
    .unwrap();
    let script = dir.path().join("apply.sh");
    let cfg = dir.path().join("cache.toml");
    let report = ok(&[
        &sample(),
        "--profile",
        profile.to_str().unwrap(),
        "--commands",
        script.to_str().unwrap(),
        "--config-out",
        cfg.to_str().unwrap(),
    ]);
    assert!(report.contains("profile: my RAID 6 + Optane"), "{report}");
    let sh = std::fs::read_to_string(&script).unwrap();
    assert!(
        sh.contains(
            "cat > ioclass.csv <<'EOF'\nIO class id,IO class name,Eviction priority,Allocation\n"
        ),
        "{sh}"
    );
    assert!(
        sh.contains("\nEOF\nhybridcache -C -C -i 1 -f ioclass.csv\n"),
        "{sh}"
    );
    let syntax = Command::new("sh").arg("-n").arg(&script).status().unwrap();
    assert!(syntax.success());
    // IO classes are not a configuration-file setting: the fragment names the command.
    let text = std::fs::read_to_string(&cfg).unwrap();
    let _: toml::Table = toml::from_str(&text).unwrap();
    assert!(
        text.contains("# IO classes: hybridcache -C -C -i 1 -f ioclass.csv"),
        "{text}"
    );
}

#[test]
fn bad_input_exits_2_with_a_clear_message() {
    // Nothing parseable: the error names the trace and lists the first bad lines.
    let err = refused(&[data("bad.trace").to_str().unwrap()]);
    let first = err.lines().next().unwrap();
    assert!(first.contains("bad.trace"), "{err}");
    assert!(first.contains("nothing parseable"), "{err}");
    assert!(first.contains("3 bad"), "{err}");
    assert!(err.contains("\n  line 1: this is not a trace ("), "{err}");
    assert!(err.contains("\n  line 3: foo bar baz ("), "{err}");

    // Missing file, directory, empty file: one line each.
    let one_line = |err: String| {
        assert_eq!(err.lines().count(), 1, "{err}");
        err
    };
    let err = one_line(refused(&["/nonexistent/trace.blk"]));
    assert!(
        err.contains("cannot read trace /nonexistent/trace.blk"),
        "{err}"
    );
    let dir = workdir();
    let err = one_line(refused(&[dir.path().to_str().unwrap()]));
    assert!(err.contains("is a directory"), "{err}");
    let empty = dir.path().join("empty.blk");
    std::fs::write(&empty, "").unwrap();
    let err = one_line(refused(&[empty.to_str().unwrap()]));
    assert!(err.contains("is empty"), "{err}");

    // Bad profiles: unknown name, invalid file.
    let err = one_line(refused(&[&sample(), "--profile", "ssd-raid"]));
    assert!(
        err.contains(
            "profile 'ssd-raid' is neither a built-in profile (raid60-study, ssd-raid5x9, nvme)"
        ),
        "{err}"
    );
    let bad_profile = dir.path().join("p.toml");
    std::fs::write(&bad_profile, "name = \"x\"\n").unwrap();
    let err = one_line(refused(&[
        &sample(),
        "--profile",
        bad_profile.to_str().unwrap(),
    ]));
    assert!(
        err.contains("bad profile") && err.contains("missing field"),
        "{err}"
    );

    // Bad command lines exit 2 as well.
    let err = one_line(refused(&[&sample(), "--format", "xml"]));
    assert!(err.contains("unknown trace format 'xml'"), "{err}");
    let err = one_line(refused(&[&sample(), "--apply"]));
    assert!(err.contains("--cache-id"), "{err}");
}

#[test]
fn partly_bad_trace_warns_and_reports() {
    let dir = workdir();
    let p = dir.path().join("mixed.blk");
    let mut text = std::fs::read_to_string(data("sample.blkparse")).unwrap();
    text.insert_str(0, "garbage line here\n");
    std::fs::write(&p, text).unwrap();
    let out = run(&[p.to_str().unwrap()]);
    assert!(out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("hybridcache: warning:") && err.contains("1 of 2161 lines did not parse"),
        "{err}"
    );
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(report.contains("line 1: `garbage line here`"), "{report}");
}

#[test]
fn other_formats_and_stdin() {
    // fio iolog v3 with --format fio (the version comes from the header).
    let dir = workdir();
    let fio = dir.path().join("job.iolog");
    let mut s = String::from("fio version 3 iolog\n0 /dev/sdx add\n0 /dev/sdx open\n");
    for i in 0..200u64 {
        s += &format!(
            "{} /dev/sdx write {} 8192\n",
            i * 2,
            (i * 7919 % 1000) * 8192
        );
    }
    s += "400 /dev/sdx close\n";
    std::fs::write(&fio, s).unwrap();
    let report = ok(&[fio.to_str().unwrap(), "--format", "fio"]);
    assert!(report.contains("Format fio-v3"), "{report}");
    assert!(report.contains("8 KiB"), "{report}");

    // MSR CSV, detected automatically.
    let msr = dir.path().join("hm_0.csv");
    let mut s = String::new();
    for i in 0..200u64 {
        let op = if i % 3 == 0 { "Read" } else { "Write" };
        s += &format!(
            "{},hm,0,{op},{},4096,{}\n",
            128166372000000000u64 + i * 10_000,
            (i * 104729 % 5000) * 4096,
            500
        );
    }
    std::fs::write(&msr, s).unwrap();
    let report = ok(&[msr.to_str().unwrap()]);
    assert!(report.contains("Format msr"), "{report}");

    // Standard input.
    let mut child = Command::new(BIN)
        .args(["analyze", "-", "--markdown"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let input = std::fs::read(data("sample.blkparse")).unwrap();
    child.stdin.take().unwrap().write_all(&input).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let md = String::from_utf8_lossy(&out.stdout);
    assert!(md.contains("Mode wb, 4 KiB lines"), "{md}");
}

#[test]
fn apply_sets_the_recommended_configuration_of_a_running_cache() {
    let dir = workdir();
    let d = Daemon::start(dir.path());
    assert_eq!(
        d.ok(&["-S", "-d", "ram:16M", "-c", "wt"]),
        "cache 1 started\n"
    );
    d.ok(&["-A", "-i", "1", "-d", "ram:64M"]);
    let control = d.control.to_str().unwrap();
    let out = run(&[&sample(), "--apply", "-i", "1", "--control", control]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("applied to cache 1: cache mode wb") && err.contains("cleaning policy"),
        "{err}"
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("Mode wb"));
    assert_eq!(d.param("cache-mode", 1, "Cache mode"), "wb");
    // The cache now has what the printed commands say.
    let script = dir.path().join("apply.sh");
    ok(&[&sample(), "--commands", script.to_str().unwrap(), "-i", "1"]);
    let commands = std::fs::read_to_string(&script).unwrap();
    // A preset's command (`-p alru-lazy`) starts with its policy's, which is what -G shows.
    let cleaning = d.param("cleaning", 1, "Cleaning policy type");
    assert!(
        commands.contains(&format!("-X -n cleaning -i 1 -p {cleaning}")),
        "{cleaning} vs {commands}"
    );
    let seq = d.ok(&["-G", "-n", "seq-cutoff", "-i", "1", "-j", "1", "-o", "csv"]);
    let policy = seq
        .lines()
        .find_map(|l| l.strip_prefix("Sequential cutoff policy,"))
        .expect("policy row");
    assert!(
        commands.contains(&format!("-X -n seq-cutoff -i 1 -p {policy}")),
        "{seq} vs {commands}"
    );

    // A cache that does not exist: the daemon's refusal, exit 1, after the report.
    let out = run(&[&sample(), "--apply", "-i", "9", "--control", control]);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with("hybridcache: --apply to cache 9 stopped at cache mode wb:")
            && err.contains("nothing was applied"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
}

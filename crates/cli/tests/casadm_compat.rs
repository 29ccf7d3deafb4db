//! casadm's outputs as a casadm user's scripts read them (issue 33): `-G` prints casadm's
//! `Parameter name,Value` table in every format with casadm's labels, `-V` prints casadm's
//! `Name,Version` table and exits 0 without a daemon, and a script written for casadm runs
//! unchanged against hybridcache.

mod common;

use std::process::Command;

use common::*;

/// casadm's `-G` rows, group by group, in the order casadm prints them.
///
/// Labels: casadm/cas_main.c at v26.03, `cas_core_params` and `cas_cache_params`. Which rows a
/// group prints, and their order (the order of `kcas_core_param_id`/`kcas_cache_param_id` in
/// modules/include/cas_ioctl_codes.h, as `core_params_get`/`cache_params_get` in casadm/cas_lib.c
/// walk the table): `get_param_namespace_handle_option` in casadm/cas_main.c. `prefetch` and
/// `prefetch-readahead` (and `seq-detect`) exist only on casadm master (same file and
/// functions), so their labels are master's.
const CASADM_ROWS: &[(&str, &[&str])] = &[
    (
        "seq-cutoff",
        &[
            "Sequential cutoff threshold [KiB]",
            "Sequential cutoff policy",
            "Sequential cutoff promotion request count threshold",
        ],
    ),
    ("cleaning", &["Cleaning policy type"]),
    (
        "cleaning-alru",
        &[
            "Wake up time [s]",
            "Stale buffer time [s]",
            "Flush max buffers",
            "Activity threshold [ms]",
            "Dirty ratio trigger threshold [%]",
            "Dirty ratio trigger inertia [MiB]",
        ],
    ),
    ("cleaning-acp", &["Wake up time [ms]", "Flush max buffers"]),
    ("promotion", &["Promotion policy type"]),
    (
        "promotion-nhit",
        &["Insertion threshold", "Policy trigger [%]"],
    ),
    ("prefetch", &["Prefetch policy"]),
    ("prefetch-readahead", &["Readahead threshold [KiB]"]),
    // Master only, per core: `cas_core_params`' two seq-detect rows, in
    // `get_param_namespace_handle_option`'s order.
    (
        "seq-detect",
        &[
            "Sequence detector promotion request count",
            "Sequence detector promotion threshold [KiB]",
        ],
    ),
];

/// casadm's per-core groups: its `-G` names a core (`-j`).
const PER_CORE: &[&str] = &["seq-cutoff", "seq-detect"];

/// Groups casadm has no `-G` namespace for: every row is ours (and still in casadm's table).
const OURS_ONLY: &[&str] = &[
    "cache-mode",
    "cache-line-size",
    "cleaning-io",
    "lazy-flush",
    "offload",
    "offload-queue",
    // casadm sets the threshold with `-X -n fallback-pt -t`; the window is ours.
    "fallback-pt",
];

/// Every parameter group the CLI knows, as its refusal of an unknown one lists them: the test
/// then covers a group added later, or fails until it is classified above.
fn every_group() -> Vec<String> {
    let out = Command::new(BIN)
        .args(["-G", "-n", "no-such-group", "-i", "1"])
        .output()
        .expect("run the CLI");
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    let list = err
        .split("(valid: ")
        .nth(1)
        .and_then(|s| s.split(')').next())
        .unwrap_or_else(|| panic!("no group list in: {err}"));
    list.split(", ").map(str::to_string).collect()
}

/// The rows of casadm's text table: the lines between the header's rule and the bottom rule,
/// cells split on the column bars and trimmed.
fn table_rows(text: &str) -> (Vec<String>, Vec<Vec<String>>) {
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines.first().is_some_and(|l| l.starts_with('╔')) && lines.len() >= 4,
        "not casadm's table: {text}"
    );
    let cells = |l: &str| -> Vec<String> {
        l.trim_start_matches('║')
            .trim_end_matches('║')
            .split('│')
            .map(|c| c.trim().to_string())
            .collect()
    };
    assert!(lines[2].starts_with('╠'), "{text}");
    assert!(lines[lines.len() - 1].starts_with('╚'), "{text}");
    let head = cells(lines[1]);
    let rows = lines[3..lines.len() - 1].iter().map(|l| cells(l)).collect();
    (head, rows)
}

fn csv_rows(csv: &str) -> (Vec<String>, Vec<Vec<String>>) {
    let mut lines = csv.lines();
    let head = lines
        .next()
        .unwrap_or_default()
        .split(',')
        .map(str::to_string)
        .collect();
    let rows = lines
        .map(|l| l.split(',').map(str::to_string).collect())
        .collect();
    (head, rows)
}

#[test]
fn get_param_prints_casadms_table_with_casadms_labels_for_every_group() {
    let FileCache {
        dir: _dir,
        daemon: d,
        ..
    } = file_cache(64 << 20, 256 << 20, &["-c", "wb"]);
    let groups = every_group();
    // Every group named above exists.
    for name in CASADM_ROWS
        .iter()
        .map(|(n, _)| *n)
        .chain(OURS_ONLY.iter().copied())
    {
        assert!(groups.iter().any(|g| g == name), "{name} in {groups:?}");
    }
    for g in &groups {
        let casadm: &[&str] = match CASADM_ROWS.iter().find(|(n, _)| n == g) {
            Some((_, rows)) => rows,
            None => {
                assert!(
                    OURS_ONLY.contains(&g.as_str()),
                    "group {g} is neither casadm's nor listed as ours only: say which"
                );
                &[]
            }
        };
        let mut args = vec!["-G", "-n", g, "-i", "1"];
        if PER_CORE.contains(&g.as_str()) {
            args.extend(["-j", "1"]);
        }
        let (head, text_rows) = table_rows(&d.ok(&args));
        assert_eq!(head, ["Parameter name", "Value"], "{g}");
        args.extend(["-o", "csv"]);
        let csv = d.ok(&args);
        let (csv_head, csv_rows) = csv_rows(&csv);
        assert_eq!(csv_head, ["Parameter name", "Value"], "{g}: {csv}");
        // The same rows, in the same order, in both formats.
        assert_eq!(text_rows, csv_rows, "{g}");
        let labels: Vec<&str> = csv_rows.iter().map(|r| r[0].as_str()).collect();
        assert!(
            labels.len() >= casadm.len() && labels[..casadm.len()] == *casadm,
            "{g}: casadm's rows {casadm:?} first, field by field; got {labels:?}"
        );
        // Ours come after casadm's and never take one of casadm's names.
        for ours in &labels[casadm.len()..] {
            assert!(
                !CASADM_ROWS.iter().any(|(_, rows)| rows.contains(ours)),
                "{g}: {ours} is casadm's label for another parameter"
            );
        }
        assert!(
            csv_rows.iter().all(|r| r.len() == 2 && !r[1].is_empty()),
            "{csv}"
        );
    }
}

#[test]
fn a_one_value_group_is_a_table_too() {
    let FileCache {
        dir: _dir,
        daemon: d,
        ..
    } = file_cache(64 << 20, 256 << 20, &["-c", "wb"]);
    let text = d.ok(&["-G", "-n", "cleaning", "-i", "1"]);
    let (_, rows) = table_rows(&text);
    assert_eq!(rows, [["Cleaning policy type", "alru"]], "{text}");
    assert_eq!(
        d.ok(&["-G", "-n", "cleaning", "-i", "1", "-o", "csv"]),
        "Parameter name,Value\nCleaning policy type,alru\n"
    );
    let (_, rows) = table_rows(&d.ok(&["-G", "-n", "cache-mode", "-i", "1"]));
    assert_eq!(rows, [["Cache mode", "wb"]]);
}

/// A preset is ours (casadm has none): `-X` takes it, `-G` shows the policy casadm knows and the
/// tunables the preset set, never the preset's name.
#[test]
fn presets_show_as_casadms_policy_and_its_parameters() {
    let FileCache {
        dir: _dir,
        daemon: d,
        ..
    } = file_cache(64 << 20, 256 << 20, &["-c", "wb"]);
    let get = |g: &str| d.ok(&["-G", "-n", g, "-i", "1", "-o", "csv"]);
    d.ok(&[
        "-X",
        "-n",
        "cleaning",
        "-i",
        "1",
        "-p",
        "acp-very-aggressive",
    ]);
    assert_eq!(
        get("cleaning"),
        "Parameter name,Value\nCleaning policy type,acp\n"
    );
    assert_eq!(
        get("cleaning-acp"),
        "Parameter name,Value\nWake up time [ms],1\nFlush max buffers,8192\n"
    );
    let text = d.ok(&["-G", "-n", "cleaning", "-i", "1"]);
    assert!(!text.contains("aggressive"), "{text}");
    // -P's Cleaning Policy, casadm's row, likewise.
    let stats = d.ok(&["-P", "-i", "1", "-f", "conf", "-o", "csv"]);
    let (head, rows) = csv_rows(&stats);
    let col = head.iter().position(|h| h == "Cleaning Policy");
    assert_eq!(
        col.and_then(|i| rows.first()?.get(i)).map(String::as_str),
        Some("acp"),
        "{stats}"
    );

    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "alru-lazy"]);
    assert_eq!(
        get("cleaning"),
        "Parameter name,Value\nCleaning policy type,alru\n"
    );
    let alru = get("cleaning-alru");
    assert!(
        alru.contains("Wake up time [s],2\nStale buffer time [s],5\nFlush max buffers,256\nActivity threshold [ms],500\n"),
        "{alru}"
    );
    d.ok(&[
        "-X",
        "-n",
        "cleaning",
        "-i",
        "1",
        "-p",
        "alru-very-aggressive",
    ]);
    assert_eq!(
        get("cleaning"),
        "Parameter name,Value\nCleaning policy type,alru\n"
    );
}

/// casadm/cas_main.c `handle_version`: a `Name,Version` table, the module's row first ("Not
/// Loaded" when it is not), then the utility's; exit 0 either way.
#[test]
fn version_is_casadms_table_and_says_not_loaded_without_a_daemon() {
    let dir = workdir();
    let d = Daemon::start(dir.path());
    let csv = d.ok(&["-V", "-o", "csv"]);
    let (head, rows) = csv_rows(&csv);
    assert_eq!(head, ["Name", "Version"], "{csv}");
    assert_eq!(rows.len(), 2, "{csv}");
    assert_eq!(rows[0][0], "hybridcache Cache Daemon", "{csv}");
    assert_eq!(rows[1][0], "hybridcache CLI Utility", "{csv}");
    let version = env!("CARGO_PKG_VERSION");
    assert_eq!(rows[0][1], version, "{csv}");
    assert_eq!(rows[1][1], version, "{csv}");
    let (head, text_rows) = table_rows(&d.ok(&["-V"]));
    assert_eq!(head, ["Name", "Version"]);
    assert_eq!(text_rows, rows);

    let none = dir.path().join("none.sock");
    for format in ["table", "csv"] {
        let out = Command::new(BIN)
            .args(["-V", "-o", format, "--control"])
            .arg(&none)
            .env_remove("HYBRIDCACHE_CONTROL")
            .output()
            .expect("run the CLI");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert_eq!(out.status.code(), Some(0), "{format}: {out:?}");
        let (head, rows) = if format == "csv" {
            csv_rows(&stdout)
        } else {
            table_rows(&stdout)
        };
        assert_eq!(head, ["Name", "Version"], "{stdout}");
        assert_eq!(
            rows,
            [
                ["hybridcache Cache Daemon", "Not Loaded"],
                ["hybridcache CLI Utility", version]
            ],
            "{stdout}"
        );
    }
}

/// Run tests/data/casadm-user.sh, a script written for casadm, with `casadm` on PATH being a link
/// to this binary (`make install` installs no `casadm`: the link is the user's own) and the
/// daemon's socket in the environment; returns the exit code and KEY=VALUE lines.
fn casadm_script(
    dir: &std::path::Path,
    control: &std::path::Path,
) -> (Option<i32>, String, String) {
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).expect("bin directory");
    let link = bin.join("casadm");
    if !link.exists() {
        std::os::unix::fs::symlink(BIN, &link).expect("casadm link");
    }
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = Command::new("sh")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/data/casadm-user.sh"
        ))
        .args(["1", "1"])
        .env("PATH", path)
        .env("HYBRIDCACHE_CONTROL", control)
        .output()
        .expect("run sh");
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn a_casadm_users_script_runs_unchanged() {
    let FileCache { dir, daemon: d, .. } = file_cache(64 << 20, 256 << 20, &["-c", "wb"]);
    d.ok(&[
        "-X",
        "-n",
        "cleaning",
        "-i",
        "1",
        "-p",
        "acp-very-aggressive",
    ]);
    let (code, out, err) = casadm_script(dir.path(), &d.control);
    assert_eq!(code, Some(0), "stdout:\n{out}\nstderr:\n{err}");
    let report: std::collections::BTreeMap<&str, &str> =
        out.lines().filter_map(|l| l.split_once('=')).collect();
    let stats = d.stats_json(1, None);
    let occupancy = stats["usage"]["occupancy"]["count"].to_string();
    let dirty = stats["usage"]["dirty"]["count"].to_string();
    let version = env!("CARGO_PKG_VERSION");
    for (key, want) in [
        ("cli_version", version),
        ("cleaning_policy", "alru"),
        ("alru_wake_up", "30"),
        ("alru_staleness", "60"),
        ("alru_dirty_trigger", "100"),
        ("seq_cutoff_policy", "never"),
        ("seq_cutoff_threshold", "2048"),
        ("promotion_policy", "always"),
        ("status", "Running"),
        ("write_policy", "wb"),
        ("cores", "1"),
        ("stats_write_policy", "wb"),
        ("stats_cleaning_policy", "alru"),
        ("occupancy", occupancy.as_str()),
        ("dirty", dirty.as_str()),
    ] {
        assert_eq!(
            report.get(key).copied(),
            Some(want),
            "{key} in:\n{out}\n{err}"
        );
    }

    // Without a daemon the script's own check stops it, as casadm's "Not Loaded" would.
    let (code, out, err) = casadm_script(dir.path(), &dir.path().join("none.sock"));
    assert_eq!(code, Some(3), "stdout:\n{out}\nstderr:\n{err}");
    assert!(err.contains("cache engine not loaded"), "{err}");
}

/// One nbdfuse mount opens several NBD connections (4 by default): `-L` and the `-T` refusal
/// count connections and say so, the same number in both, rather than calling them clients.
#[test]
fn an_nbdfuse_mount_shows_as_connections() {
    if !need(&["nbdfuse", "fusermount3"]) {
        return;
    }
    let FileCache { dir, daemon: d, .. } = file_cache(32 << 20, 64 << 20, &["-c", "wt"]);
    let fuse_dir = dir.path().join("fuse");
    std::fs::create_dir_all(&fuse_dir).expect("mount point");
    let pidfile = dir.path().join("nbdfuse.pid");
    let child = Command::new("nbdfuse")
        .arg("-P")
        .arg(&pidfile)
        .arg(fuse_dir.join("disk"))
        .arg(d.uri("cas1-1"))
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn nbdfuse");
    let _fuse = Kill(child);
    let _unmount = Unmount(fuse_dir.clone());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    let connections = |d: &Daemon| -> usize {
        let csv = d.ok(&["-L", "-o", "csv"]);
        let (head, rows) = csv_rows(&csv);
        assert_eq!(
            head.last().map(String::as_str),
            Some("connections"),
            "{csv}"
        );
        rows.iter()
            .find(|r| r[0] == "core")
            .and_then(|r| r.last()?.parse().ok())
            .unwrap_or(0)
    };
    // nbdfuse opens its connections once it serves: wait for them all to settle.
    let mut seen = 0;
    loop {
        let n = connections(&d);
        if pidfile.exists() && n > 1 && n == seen {
            break;
        }
        seen = n;
        assert!(
            std::time::Instant::now() < deadline,
            "nbdfuse never connected (last count {n})"
        );
        std::thread::sleep(std::time::Duration::from_millis(300));
    }
    let err = d.fails(&["-T", "-i", "1"]);
    assert!(
        err.contains(&format!(
            "cas1-1 has {seen} NBD connections open: disconnect them first"
        )),
        "{err}"
    );
    let out = d.ok(&["-T", "-i", "1", "--disconnect-clients"]);
    assert!(
        out.contains(&format!("closed {seen} NBD connections of cas1-1")),
        "{out}"
    );
}

/// Unmounts a FUSE mount point when dropped, so a failing test leaves no mount behind.
struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = Command::new("fusermount3").arg("-u").arg(&self.0).output();
    }
}

/// A device that is not there is refused with every form a device can be named in, the NBD
/// URIs included (an operator moving a core to a remote server looks for them there).
#[test]
fn a_missing_device_is_refused_with_every_form_nbd_uris_included() {
    let FileCache { dir, daemon: d, .. } = file_cache(64 << 20, 64 << 20, &["-c", "wt"]);
    let missing = dir.path().join("no-such-disk");
    let missing = missing.to_str().expect("UTF-8 path");
    for args in [
        vec!["-S", "-d", missing, "-i", "2"],
        vec!["-A", "-i", "1", "-d", missing],
        vec!["-S", "-d", "nope:1", "-i", "2"],
    ] {
        let err = d.fails(&args);
        for form in [
            "path of an existing file or block device",
            "nbd://HOST[:PORT]/EXPORT",
            "nbd+unix:///EXPORT?socket=PATH",
            "ram:SIZE",
        ] {
            assert!(err.contains(form), "{args:?}: {form} in {err}");
        }
    }
}

/// `-S -H` names the cache id range once, and a bad id is refused in the help's words, not in
/// Rust's range syntax.
#[test]
fn id_ranges_are_said_once_and_never_in_rust_syntax() {
    let out = Command::new(BIN)
        .args(["-S", "-H"])
        .output()
        .expect("run the CLI");
    let help = String::from_utf8_lossy(&out.stdout);
    assert_eq!(help.matches("1..16384").count(), 1, "{help}");
    let id_line = help
        .lines()
        .find(|l| l.contains("--cache-id"))
        .unwrap_or_default();
    assert_eq!(id_line.matches("Cache id").count(), 1, "{id_line}");
    for (args, range) in [
        (vec!["-S", "-d", "ram:64M", "-i", "0"], "(1..16384)"),
        (vec!["-T", "-i", "16385"], "(1..16384)"),
        (vec!["-R", "-i", "1", "-j", "4096"], "(0..4095)"),
        (vec!["-P", "-i", "1", "-d", "34"], "(0..33)"),
    ] {
        let out = Command::new(BIN).args(&args).output().expect("run the CLI");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.contains(range) && !err.contains("..="),
            "{args:?}: {err}"
        );
    }
}

/// casadm's `-L` shows the mode a cache runs, and `wb->MODE` only while a flush switches it
/// (casadm/cas_lib.c, `list_caches`: the mode string is "wb->..." only when there is flush
/// progress). After `-Q -c wt -f no` the cache runs wt with dirty data left: `-L` says wt, as
/// it does after a stop without flush and a load of that cache; `-P` shows the dirty data.
#[test]
fn list_shows_the_mode_the_cache_runs_after_a_switch_without_flush() {
    let FileCache {
        dir: _dir,
        spec,
        daemon: d,
        ..
    } = file_cache(64 << 20, 64 << 20, &["-c", "wb"]);
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    {
        let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-1").expect("connect");
        c.write(&[0x5a; 65536], 0, false).expect("write");
        c.disconnect().expect("disconnect");
    }
    d.ok(&["-Q", "-c", "wt", "-i", "1", "-f", "no"]);
    let mode = |d: &Daemon| -> String {
        let csv = d.ok(&["-L", "-o", "csv"]);
        let (_, rows) = csv_rows(&csv);
        rows.iter()
            .find(|r| r[0] == "cache" && r[1] == "1")
            .map(|r| r[4].clone())
            .unwrap_or_default()
    };
    let dirty = |d: &Daemon| d.stats_json(1, None)["usage"]["dirty"]["count"].as_u64();
    assert_eq!(mode(&d), "wt");
    assert_eq!(dirty(&d), Some(16));
    d.ok(&["-T", "-i", "1", "-n"]);
    d.ok(&["-S", "-d", &spec, "--load"]);
    assert_eq!(mode(&d), "wt");
    assert_eq!(dirty(&d), Some(16));
}

/// A cache device too small for one line and its metadata is refused with the size it needs at
/// least: a file of exactly that size starts, one a sector smaller is refused.
#[test]
fn a_too_small_cache_device_is_refused_with_the_minimum_size() {
    let dir = workdir();
    let d = Daemon::start(dir.path());
    let file = dir.path().join("small.img");
    let spec = file.to_str().expect("UTF-8 path");
    // Two 1 MiB superblock slots, the metadata rounded up to a MiB, one line.
    for (kib, min) in [(4u64, 3_149_824u64), (64, 3_211_264)] {
        let kib_s = kib.to_string();
        for (size, starts) in [(1u64 << 20, false), (min - 512, false), (min, true)] {
            let _ = std::fs::remove_file(&file);
            sparse_file(&file, size);
            let args = ["-S", "-d", spec, "-i", "1", "-x", &kib_s];
            if starts {
                d.ok(&args);
                d.ok(&["-T", "-i", "1"]);
                continue;
            }
            let err = d.fails(&args);
            let grouped = |n: u64| {
                let s = n.to_string();
                let mut out = String::new();
                for (i, c) in s.chars().enumerate() {
                    if i > 0 && (s.len() - i) % 3 == 0 {
                        out.push(',');
                    }
                    out.push(c);
                }
                out
            };
            assert!(
                err.contains(&format!(
                    "{spec} is too small for a cache: it holds {} bytes, and a persistent cache \
                     with {kib} KiB lines needs at least {} bytes",
                    grouped(size),
                    grouped(min)
                )),
                "{err}"
            );
        }
    }
    let err = d.fails(&["-S", "-d", "ram:2K", "-i", "2"]);
    assert!(
        err.contains("a volatile cache with 4 KiB lines needs at least 4,096 bytes (one line)"),
        "{err}"
    );
    // The configuration file's id check says the range as the CLI does.
    let cfg = dir.path().join("bad.toml");
    std::fs::write(&cfg, "[[cache]]\nid = 16385\ndevice = \"ram:16M\"\n").expect("config");
    let other = workdir();
    let err = daemon_refuses_to_start(other.path(), &["--config", cfg.to_str().expect("UTF-8")]);
    assert!(
        err.contains("cache 16385: id out of range (1..16384)") && !err.contains("..="),
        "{err}"
    );
}

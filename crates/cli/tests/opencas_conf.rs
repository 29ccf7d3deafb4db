//! Open CAS's opencas.conf read as it is (issue 33): `hybridcache config import` writes the
//! equivalent TOML, and the daemon started with `--config` on an opencas.conf starts what it
//! names, as casctl would. The format is the one `utils/opencas.py` (`cas_config.from_file`,
//! open-cas-linux v26.03) reads.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};

use common::{daemon_refuses_to_start, sparse_file, workdir, Daemon, BIN};

/// `utils/opencas.conf` as Open CAS ships it (open-cas-linux v26.03, BSD-3-Clause), verbatim:
/// both entries are commented out examples.
const SHIPPED_CONF: &str = "version=19.3.0
# Version tag has to be first line in this file
#
# Open CAS configuration file - for reference on syntax
# of this file please refer to appropriate documentation

# NOTES:
# 1) It is required to specify cache/core device using links in
# /dev/disk/by-id/, preferably those using device WWN if available:
#   /dev/disk/by-id/wwn-0x123456789abcdef0
# Referencing devices via /dev/sd* is prohibited because
# may result in cache misconfiguration after system reboot
# due to change(s) in drive order. It is allowed to use /dev/cas*-*
# as a device path.

## Caches configuration section
[caches]
## Cache ID\tCache device\t\t\t\tCache mode\tExtra fields (optional)
## Uncomment and edit the below line for cache configuration
#1\t\t/dev/disk/by-id/nvme-INTEL_SSDP..\tWT

## Core devices configuration
[cores]
## Cache ID\tCore ID\t\tCore device\tExtra fields (optional)
## Uncomment and edit the below line for core configuration
#1\t\t1\t\t/dev/disk/by-id/wwn-0x123456789abcdef0

## To specify use of the IO Classification file, place content of the following line in the
## Caches configuration section under Extra fields (optional)
## ioclass_file=/etc/opencas/ioclass-config.csv

## If given cache/core pair is especially slow to start up, often doesn't come back
## up after reboot or you simply don't care if it does and don't want it to have
## an effect on your boot you can mark cores as lazy to prevent Open CAS from
## dropping boot to emergency shell because of this core failure. To do this
## put following line under in Extra fields (optional) section of core config:
## lazy_startup=true
## NOTE: This will cause open-cas.service to not wait for marked core while
## starting up - this option should be used with care to prevent races with
## other services for devices (e.g. mounts based on FS labels)
";

/// `utils/ioclass-config.csv` as Open CAS ships it (master; v26.03 lacks class 33): casadm's CSV
/// format, classes by file size and metadata, which a block export cannot see. The engine's tests
/// keep the verbatim copy (with its source in crates/engine/tests/data/README.md).
const SHIPPED_IOCLASS: &str =
    include_str!("../../engine/tests/data/open-cas-master-ioclass-config.csv");

const CACHE_BYTES: u64 = 64 << 20;
const CORE_BYTES: u64 = 256 << 20;

fn device(dir: &Path, name: &str, size: u64) -> String {
    let p = dir.join(name);
    sparse_file(&p, size);
    p.to_str().expect("UTF-8 path").to_string()
}

/// `hybridcache config import ARGS`, stdin from `input`; (exit code, stdout, stderr).
fn import(args: &[&str], input: &str) -> (i32, String, String) {
    let mut child = Command::new(BIN)
        .args(["config", "import"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run config import");
    std::io::Write::write_all(child.stdin.as_mut().expect("stdin"), input.as_bytes())
        .expect("write stdin");
    let out = child.wait_with_output().expect("config import");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `-L -o csv` rows as (type, id, disk, status, write policy).
fn list(d: &Daemon) -> Vec<Vec<String>> {
    d.ok(&["-L", "-o", "csv"])
        .lines()
        .skip(1)
        .map(|l| l.split(',').take(5).map(str::to_string).collect())
        .collect()
}

/// The shipped file with its two examples uncommented, on this test's devices.
fn shipped_uncommented(cache: &str, core: &str) -> String {
    let text = SHIPPED_CONF
        .replace(
            "#1\t\t/dev/disk/by-id/nvme-INTEL_SSDP..\tWT",
            &format!("1\t\t{cache}\tWT"),
        )
        .replace(
            "#1\t\t1\t\t/dev/disk/by-id/wwn-0x123456789abcdef0",
            &format!("1\t\t1\t\t{core}"),
        );
    assert_ne!(text, SHIPPED_CONF);
    text
}

#[test]
fn the_shipped_opencas_conf_imports_and_its_cache_starts() {
    let dir = workdir();
    let cache = device(dir.path(), "nvme.img", CACHE_BYTES);
    let core = device(dir.path(), "wwn.img", CORE_BYTES);

    // As shipped, every entry is a comment: nothing to start, and it is still a valid file.
    let shipped = dir.path().join("shipped.conf");
    std::fs::write(&shipped, SHIPPED_CONF).unwrap();
    let (code, toml, err) = import(&[shipped.to_str().unwrap()], "");
    assert_eq!(code, 0, "{err}");
    assert!(!toml.contains("[[cache]]"), "{toml}");
    assert!(toml.contains("version=19.3.0"), "{toml}");

    let conf = dir.path().join("opencas.conf");
    std::fs::write(&conf, shipped_uncommented(&cache, &core)).unwrap();
    let (code, toml, err) = import(&[conf.to_str().unwrap()], "");
    assert_eq!(code, 0, "{err}");
    assert!(toml.contains("# opencas.conf line 20: 1"), "{toml}");
    assert!(toml.contains("mode = \"wt\""), "{toml}");
    assert!(toml.contains("lazy_startup = false"), "{toml}");
    let imported = dir.path().join("hybridcache.toml");
    std::fs::write(&imported, &toml).unwrap();

    // The imported TOML starts the cache and its core.
    {
        let d = Daemon::start_with(dir.path(), &["--config", imported.to_str().unwrap()]);
        let rows = list(&d);
        assert_eq!(rows[0][..2], ["cache", "1"], "{rows:?}");
        assert_eq!(rows[0][2], cache);
        assert_eq!(rows[0][4], "wt");
        assert_eq!(
            rows[1][..4],
            ["core", "1", core.as_str(), "Active"],
            "{rows:?}"
        );
        d.ok(&["-T", "-i", "1"]);
    }
    // And so does the opencas.conf itself, given to --config as casctl's file: the cache on
    // the device is loaded (Open CAS's casctl start).
    let d = Daemon::start_with(dir.path(), &["--config", conf.to_str().unwrap()]);
    let rows = list(&d);
    assert_eq!(rows[0][..2], ["cache", "1"], "{rows:?}");
    assert_eq!(
        rows[1][..4],
        ["core", "1", core.as_str(), "Active"],
        "{rows:?}"
    );
    assert!(
        d.log_text()
            .contains("read as Open CAS's opencas.conf (version=19.3.0)"),
        "{}",
        d.log_text()
    );
}

#[test]
fn a_hand_written_opencas_conf_starts_with_every_extra_field() {
    let dir = workdir();
    let c1 = device(dir.path(), "c1.img", CACHE_BYTES);
    let c2 = device(dir.path(), "c2.img", CACHE_BYTES);
    let c3 = device(dir.path(), "c3.img", CACHE_BYTES);
    let k1 = device(dir.path(), "k1.img", CORE_BYTES);
    let k2 = device(dir.path(), "k2.img", CORE_BYTES);
    let k3 = device(dir.path(), "k3.img", CORE_BYTES);
    let ioclass = dir.path().join("ioclass-config.csv");
    std::fs::write(&ioclass, SHIPPED_IOCLASS).unwrap();
    let ioclass = ioclass.to_str().unwrap();
    let text = format!(
        "version=20.3.0\n\
         # caches, with tabs and spaces mixed, modes and names in upper case\n\
         [caches]\n\
         1\t{c1}   WB\tcache_line_size=16,CLEANING_POLICY=ACP,promotion_policy=NHIT,ioclass_file={ioclass}\n\
         2  {c2}\tpt\tlazy_startup=true,target_failover_state=active   # a comment after it\n\
         3\t{c3}\twt\ttarget_failover_state=standby\n\
         \n\
         [cores]\n\
         1\t1\t{k1}\n\
         2\t0\t{k2}\tlazy_startup=true\n\
         3\t1\t{k3}\n"
    );
    // Through stdin: a comment on each line not carried over as written.
    let (code, toml, err) = import(&["-"], &text);
    assert_eq!(code, 0, "{err}");
    assert!(
        toml.contains("# ioclass_file ") && toml.contains("IO classes 1, 11, 12"),
        "{toml}"
    );
    assert!(toml.contains("ioclass_ignore_unsupported = true"), "{toml}");
    assert!(
        toml.contains(
            "# Not carried over: target_failover_state=standby: hybridcache has no standby"
        ),
        "{toml}"
    );
    assert!(
        toml.contains("# Not carried over: its cache 3 (line 6) is not started."),
        "{toml}"
    );
    assert!(toml.contains("\"cleaning.policy\" = \"acp\""), "{toml}");

    let conf = dir.path().join("opencas.conf");
    std::fs::write(&conf, &text).unwrap();
    let d = Daemon::start_with(dir.path(), &["--config", conf.to_str().unwrap()]);
    let rows = list(&d);
    let caches: Vec<(&str, &str)> = rows
        .iter()
        .filter(|r| r[0] == "cache")
        .map(|r| (r[1].as_str(), r[4].as_str()))
        .collect();
    assert_eq!(caches, [("1", "wb"), ("2", "pt")], "{rows:?}");
    let cores: Vec<&str> = rows
        .iter()
        .filter(|r| r[0] == "core")
        .map(|r| r[2].as_str())
        .collect();
    assert_eq!(cores, [k1.as_str(), k2.as_str()], "{rows:?}");
    let get = |group: &str| d.ok(&["-G", "-n", group, "-i", "1", "-o", "csv"]);
    assert!(get("cleaning").contains(",acp"), "{}", get("cleaning"));
    assert!(get("promotion").contains(",nhit"), "{}", get("promotion"));
    let stats = d.stats_json(1, None);
    assert_eq!(
        stats["info"]["cache_line_size_kib"], 16,
        "cache_line_size=16: {stats}"
    );
    let classes = d.ok(&["-C", "-L", "-i", "1", "-o", "csv"]);
    assert!(classes.contains("file_size:le:4096&done"), "{classes}");
    assert!(
        !d.ok(&["-L"]).contains(&c3),
        "the standby cache is not started"
    );
    let log = d.log_text();
    assert!(
        log.contains("WARN") && log.contains("line 6: not started: target_failover_state=standby"),
        "{log}"
    );
    assert!(log.contains("line 4: ioclass_file"), "{log}");
}

#[test]
fn bad_opencas_conf_is_refused_by_line_and_nothing_starts() {
    let dir = workdir();
    let cache = device(dir.path(), "c.img", CACHE_BYTES);
    let core = device(dir.path(), "k.img", CACHE_BYTES);
    let cases = [
        (
            format!("version=1\n[caches]\n1 {cache} WB cache_line_size=12\n[cores]\n1 1 {core}\n"),
            "line 3: 12 is invalid cache line size",
        ),
        (
            format!("version=1\n[caches]\n1 {cache} wb\n[cores]\n1 1 {core} lazy_startup=yes\n"),
            "line 5: yes is invalid lazy_startup value",
        ),
        (
            format!("version=1\n[caches]\n1 {cache} XX\n"),
            "line 3: invalid cache mode 'XX'",
        ),
        (
            format!("[caches]\n1 {cache} wt\n"),
            "line 1: the first line must be the version tag",
        ),
        (
            format!("version=1\n[caches]\n1 {cache} wt\n[cores]\n2 1 {core}\n"),
            "line 5: cache id 2 doesn't exist",
        ),
    ];
    for (text, want) in &cases {
        let conf = dir.path().join("bad.conf");
        std::fs::write(&conf, text).unwrap();
        let (code, out, err) = import(&[conf.to_str().unwrap()], "");
        assert_eq!(code, 1, "{text}: {out}");
        assert!(err.contains(want), "{text}: {err}");
        let err = daemon_refuses_to_start(dir.path(), &["--config", conf.to_str().unwrap()]);
        assert!(err.contains(want), "{text}: {err}");
        // Nothing was written to either device: they are still all zeros.
        for dev in [&cache, &core] {
            let bytes = std::fs::read(dev).unwrap();
            assert!(bytes.iter().all(|b| *b == 0), "{dev} was written: {text}");
        }
    }
    // Without a path, Open CAS's own location is read.
    let (code, _, err) = import(&[], "");
    if !Path::new("/etc/opencas/opencas.conf").exists() {
        assert_eq!(code, 1);
        assert!(err.contains("/etc/opencas/opencas.conf"), "{err}");
    }
}

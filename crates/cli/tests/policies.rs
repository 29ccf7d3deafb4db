//! Policies from the command line: every `-X` group set and read back with `-G`, bad values
//! refused without changing anything, settings kept across a daemon restart (the superblock
//! holds them), background cleaning draining a cache written through NBD, and IO class files
//! loaded, listed and refused.

mod common;

use std::time::{Duration, Instant};

use common::*;

fn csv(d: &Daemon, name: &str) -> String {
    d.ok(&["-G", "-n", name, "-i", "1", "-o", "csv"])
}

fn dirty_lines(d: &Daemon) -> u64 {
    d.stats_json(1, None)["usage"]["dirty"]["count"]
        .as_u64()
        .expect("dirty count")
}

#[test]
fn every_group_is_set_read_back_and_survives_a_restart() {
    let FileCache {
        dir,
        spec,
        daemon: mut d,
        ..
    } = file_cache(64 << 20, 256 << 20, &["-c", "wb"]);
    // Open CAS's defaults first.
    assert_eq!(d.param("cleaning", 1, "Cleaning policy type"), "alru");
    assert_eq!(
        csv(&d, "cleaning-alru"),
        "Parameter name,Value\nWake up time [s],20\nStale buffer time [s],120\nFlush max buffers,100\n\
         Activity threshold [ms],10000\nDirty ratio trigger threshold [%],100\nDirty ratio trigger inertia [MiB],128\n"
    );
    assert_eq!(
        csv(&d, "cleaning-acp"),
        "Parameter name,Value\nWake up time [ms],10\nFlush max buffers,128\n"
    );
    assert!(
        csv(&d, "seq-cutoff").contains("1,Sequential cutoff policy,full"),
        "{}",
        csv(&d, "seq-cutoff")
    );
    assert_eq!(d.param("promotion", 1, "Promotion policy type"), "always");

    d.ok(&[
        "-X",
        "-n",
        "cleaning-alru",
        "-i",
        "1",
        "-w",
        "5",
        "-s",
        "30",
        "-b",
        "64",
    ]);
    d.ok(&[
        "-X",
        "-n",
        "cleaning-alru",
        "-i",
        "1",
        "-t",
        "250",
        "-d",
        "60",
    ]);
    d.ok(&[
        "-X",
        "-n",
        "cleaning-acp",
        "-i",
        "1",
        "-w",
        "50",
        "-b",
        "256",
    ]);
    d.ok(&["-X", "-n", "cleaning-io", "-i", "1", "--merge-max", "256"]);
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "acp"]);
    d.ok(&[
        "-X",
        "-n",
        "seq-cutoff",
        "-i",
        "1",
        "-j",
        "1",
        "-p",
        "always",
        "-t",
        "64",
    ]);
    d.ok(&[
        "-X",
        "-n",
        "seq-cutoff",
        "-i",
        "1",
        "--promotion-count",
        "3",
    ]);
    d.ok(&["-X", "-n", "promotion", "-i", "1", "-p", "nhit"]);
    d.ok(&[
        "-X",
        "-n",
        "promotion-nhit",
        "-i",
        "1",
        "-t",
        "4",
        "-o",
        "50",
    ]);
    let expect = |d: &Daemon| {
        assert_eq!(d.param("cleaning", 1, "Cleaning policy type"), "acp");
        let info = &d.stats_json(1, None)["info"];
        assert_eq!(info["cleaning_policy"], "acp", "{info}");
        assert_eq!(info["promotion_policy"], "nhit", "{info}");
        let alru = csv(d, "cleaning-alru");
        for row in [
            "Wake up time [s],5",
            "Stale buffer time [s],30",
            "Flush max buffers,64",
            "Activity threshold [ms],250",
            "Dirty ratio trigger threshold [%],60",
        ] {
            assert!(alru.contains(row), "{row} in {alru}");
        }
        assert!(csv(d, "cleaning-acp").contains("Wake up time [ms],50\nFlush max buffers,256"));
        assert!(csv(d, "cleaning-io").contains("Largest cleaning write [KiB],256"));
        let seq = csv(d, "seq-cutoff");
        assert!(seq.contains("1,Sequential cutoff policy,always"), "{seq}");
        assert!(
            seq.contains("1,Sequential cutoff threshold [KiB],64"),
            "{seq}"
        );
        assert!(seq.contains("request count threshold,3"), "{seq}");
        assert_eq!(d.param("promotion", 1, "Promotion policy type"), "nhit");
        assert!(csv(d, "promotion-nhit").contains("Insertion threshold,4\nPolicy trigger [%],50"));
    };
    expect(&d);

    // Bad values: refused, named, nothing changed (not even the valid field given with them).
    let err = d.fails(&["-X", "-n", "cleaning-alru", "-i", "1", "-w", "7", "-s", "0"]);
    assert!(
        err.contains("staleness-time 0 is out of range 1..3600"),
        "{err}"
    );
    let err = d.fails(&["-X", "-n", "cleaning-acp", "-i", "1", "-b", "10001"]);
    assert!(
        err.contains("flush-max-buffers 10001 is out of range"),
        "{err}"
    );
    let err = d.fails(&["-X", "-n", "cleaning-acp", "-i", "1", "-s", "3"]);
    assert!(err.contains("no field '-s'"), "{err}");
    let err = d.fails(&["-X", "-n", "cleaning", "-i", "1", "-p", "fast"]);
    assert!(err.contains("alru-very-aggressive"), "{err}");
    let err = d.fails(&["-X", "-n", "seq-cutoff", "-i", "1", "-p", "sometimes"]);
    assert!(err.contains("always, full or never"), "{err}");
    let err = d.fails(&["-X", "-n", "promotion-nhit", "-i", "1", "-t", "1"]);
    assert!(err.contains("threshold 1 is out of range 2..1000"), "{err}");
    let err = d.fails(&["-X", "-n", "cleaning-alru", "-i", "1", "-w", "soon"]);
    assert!(err.contains("not a whole number"), "{err}");
    let err = d.fails(&["-X", "-n", "cleaning", "-i", "1", "-j", "1", "-p", "nop"]);
    assert!(err.contains("per cache"), "{err}");
    let err = d.fails(&["-X", "-n", "cleaning-alru", "-i", "1"]);
    assert!(err.contains("nothing to set"), "{err}");
    expect(&d);

    // Presets set their values and select their policy.
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "alru-lazy"]);
    // A preset reads back as the policy casadm knows (-G, -P), its tunables holding its values:
    // casadm has no presets (tests/casadm_compat.rs).
    assert_eq!(d.param("cleaning", 1, "Cleaning policy type"), "alru");
    let p = d.ok(&["-P", "-i", "1", "-o", "csv"]);
    assert!(!p.contains("alru-lazy"), "{p}");
    assert!(csv(&d, "cleaning-alru").contains("Wake up time [s],2\nStale buffer time [s],5\nFlush max buffers,256\nActivity threshold [ms],500"));
    d.ok(&[
        "-X",
        "-n",
        "cleaning-alru",
        "-i",
        "1",
        "-w",
        "5",
        "-s",
        "30",
        "-b",
        "64",
        "-t",
        "250",
    ]);
    assert_eq!(d.param("cleaning", 1, "Cleaning policy type"), "alru");
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "acp"]);

    // A new daemon loading the cache finds everything as it was.
    d.ok(&["-T", "-i", "1"]);
    assert!(d.stop());
    let d = Daemon::start(dir.path());
    assert_eq!(d.ok(&["-S", "-d", &spec, "--load"]), "cache 1 loaded\n");
    expect(&d);
}

#[test]
fn offload_is_set_shown_and_kept() {
    let FileCache {
        dir,
        spec,
        daemon: d,
        ..
    } = file_cache(64 << 20, 256 << 20, &["-c", "wb"]);
    assert_eq!(d.param("offload", 1, "Offload"), "off");
    assert_eq!(
        csv(&d, "offload-queue"),
        "Parameter name,Value\nOffloaded share [%],25\nCache queue depth above the core's [requests],1\n"
    );
    d.ok(&["-X", "-n", "offload", "-i", "1", "-p", "on"]);
    d.ok(&[
        "-X",
        "-n",
        "offload-queue",
        "-i",
        "1",
        "--share",
        "40",
        "-t",
        "0",
    ]);
    let expect = |d: &Daemon| {
        assert_eq!(d.param("offload", 1, "Offload"), "on");
        assert_eq!(
            csv(d, "offload-queue"),
            "Parameter name,Value\nOffloaded share [%],40\nCache queue depth above the core's [requests],0\n"
        );
    };
    expect(&d);
    let err = d.fails(&["-X", "-n", "offload-queue", "-i", "1", "--share", "101"]);
    assert!(err.contains("share 101 is out of range 0..100"), "{err}");
    let err = d.fails(&["-X", "-n", "offload", "-i", "1", "-p", "some"]);
    assert!(err.contains("neither on nor off"), "{err}");
    expect(&d);
    let json = d.stats_json(1, None);
    assert_eq!(json["policies"]["offload_reads"]["count"], 0, "{json}");
    assert_eq!(json["policies"]["offload_writes"]["count"], 0, "{json}");
    let table = d.ok(&["-P", "-i", "1"]);
    assert!(
        table.contains("Read hits sent to core by offload"),
        "{table}"
    );

    d.ok(&["-T", "-i", "1"]);
    let mut d = d;
    assert!(d.stop());
    let d = Daemon::start(dir.path());
    assert_eq!(d.ok(&["-S", "-d", &spec, "--load"]), "cache 1 loaded\n");
    expect(&d);
}

#[test]
fn lazy_flush_and_prefetch_are_set_shown_and_kept() {
    let FileCache {
        dir,
        spec,
        daemon: d,
        ..
    } = file_cache(64 << 20, 256 << 20, &["-c", "wb"]);
    // Defaults: lazy flush on, read-ahead off.
    assert_eq!(d.param("lazy-flush", 1, "Lazy flush"), "on");
    assert_eq!(d.param("prefetch", 1, "Prefetch policy"), "none");
    assert_eq!(
        csv(&d, "prefetch-readahead"),
        "Parameter name,Value\nReadahead threshold [KiB],256\nReadahead distance [KiB],1024\n\
         Prefetch requests in flight at most,4\n"
    );
    d.ok(&["-X", "-n", "lazy-flush", "-i", "1", "-p", "off"]);
    d.ok(&["-X", "-n", "prefetch", "-i", "1", "-p", "readahead"]);
    d.ok(&[
        "-X",
        "-n",
        "prefetch-readahead",
        "-i",
        "1",
        "-t",
        "64",
        "--distance",
        "512",
        "--max-in-flight",
        "8",
    ]);
    let expect = |d: &Daemon| {
        assert_eq!(d.param("lazy-flush", 1, "Lazy flush"), "off");
        assert_eq!(d.param("prefetch", 1, "Prefetch policy"), "readahead");
        assert_eq!(
            csv(d, "prefetch-readahead"),
            "Parameter name,Value\nReadahead threshold [KiB],64\nReadahead distance [KiB],512\n\
             Prefetch requests in flight at most,8\n"
        );
    };
    expect(&d);
    let err = d.fails(&["-X", "-n", "lazy-flush", "-i", "1", "-p", "maybe"]);
    assert!(err.contains("neither on nor off"), "{err}");
    let err = d.fails(&["-X", "-n", "prefetch", "-i", "1", "-p", "always"]);
    assert!(err.contains("readahead or none"), "{err}");
    let err = d.fails(&[
        "-X",
        "-n",
        "prefetch-readahead",
        "-i",
        "1",
        "--distance",
        "1",
    ]);
    assert!(
        err.contains("distance 1 is out of range 4..32768 KiB"),
        "{err}"
    );
    expect(&d);

    // -P shows the new counters in every format.
    let json = d.stats_json(1, None);
    assert_eq!(json["info"]["lazy_flush"], "off", "{json}");
    assert_eq!(json["info"]["prefetch_policy"], "readahead", "{json}");
    assert_eq!(json["policies"]["lazy_flush_writes"]["count"], 0, "{json}");
    assert_eq!(json["policies"]["prefetch_hits"]["count"], 0, "{json}");
    let table = d.ok(&["-P", "-i", "1"]);
    assert!(
        table.contains("Writes sent to core by lazy flush"),
        "{table}"
    );
    assert!(table.contains("Prefetch core reads: readahead"), "{table}");
    let csv_out = d.ok(&["-P", "-i", "1", "-j", "1", "-o", "csv"]);
    assert!(
        csv_out.contains("Prefetch: readahead [Requests]"),
        "{csv_out}"
    );

    d.ok(&["-T", "-i", "1"]);
    let mut d = d;
    assert!(d.stop());
    let d = Daemon::start(dir.path());
    assert_eq!(d.ok(&["-S", "-d", &spec, "--load"]), "cache 1 loaded\n");
    expect(&d);
}

#[test]
fn background_cleaning_drains_what_nop_keeps() {
    if !need(&["fio"]) {
        return;
    }
    let FileCache { dir, daemon: d, .. } = file_cache(64 << 20, 256 << 20, &["-c", "wb"]);
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    let job: Vec<String> = [
        "--name=w",
        "--ioengine=nbd",
        "--rw=randwrite",
        "--bs=4k",
        "--size=16m",
        "--iodepth=4",
    ]
    .iter()
    .map(|s| s.to_string())
    .chain([format!("--uri={}", d.uri("cas1-1"))])
    .collect();
    fio(dir.path(), "fill", &job);
    let dirty = dirty_lines(&d);
    assert!(
        dirty > 1000,
        "{dirty} dirty lines after 16 MiB of random writes"
    );
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(dirty_lines(&d), dirty, "nop cleaned something");

    for preset in ["acp-very-aggressive", "alru-very-aggressive"] {
        d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
        fio(dir.path(), preset, &job);
        assert!(dirty_lines(&d) > 1000);
        d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", preset]);
        let deadline = Instant::now() + Duration::from_secs(60);
        while dirty_lines(&d) > 0 {
            assert!(
                Instant::now() < deadline,
                "{preset} left {} dirty lines after 60 s",
                dirty_lines(&d)
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

#[test]
fn io_class_files_load_list_and_refuse() {
    let FileCache { dir, daemon: d, .. } = file_cache(64 << 20, 64 << 20, &["-c", "wt"]);
    let default = d.ok(&["-C", "-L", "-i", "1", "-o", "csv"]);
    assert_eq!(
        default,
        "IO class id,IO class name,Eviction priority,Allocation\n0,unclassified,255,1.00\n"
    );
    let good = dir.path().join("classes.csv");
    std::fs::write(
        &good,
        "IO class id,IO class name,Eviction priority,Allocation\n\
         0,unclassified,22,1\n1,request_size:le:4096&done,1,1\n2,lba:ge:2000&lba:le:5000,5,0.2\n",
    )
    .unwrap();
    d.ok(&["-C", "-C", "-i", "1", "-f", good.to_str().unwrap()]);
    let listed = d.ok(&["-C", "-L", "-i", "1", "-o", "csv"]);
    assert_eq!(
        listed,
        "IO class id,IO class name,Eviction priority,Allocation\n\
         0,unclassified,22,1.00\n1,request_size:le:4096&done,1,1.00\n2,lba:ge:2000&lba:le:5000,5,0.20\n"
    );
    let table = d.ok(&["-C", "-L", "-i", "1"]);
    assert!(
        table.contains("│ lba:ge:2000&lba:le:5000   │ 5                 │ 0.20"),
        "{table}"
    );

    // Refused files change nothing, and say where the problem is.
    let bad = dir.path().join("bad.csv");
    std::fs::write(
        &bad,
        "IO class id,IO class name,Eviction priority,Allocation\n0,unclassified,22,1\n1,request_size:lq:4096,1,1\n",
    )
    .unwrap();
    let err = d.fails(&["-C", "-C", "-i", "1", "-f", bad.to_str().unwrap()]);
    assert!(err.contains("line 3, column"), "{err}");
    let fs_rule = dir.path().join("fs.csv");
    std::fs::write(
        &fs_rule,
        "IO class id,IO class name,Eviction priority,Allocation\n0,unclassified,22,1\n1,metadata&done,0,1\n",
    )
    .unwrap();
    let err = d.fails(&["-C", "-C", "-i", "1", "-f", fs_rule.to_str().unwrap()]);
    assert!(err.contains("--ignore-unsupported"), "{err}");
    let err = d.fails(&["-C", "-C", "-i", "1", "-f", "/nonexistent.csv"]);
    assert!(err.contains("/nonexistent.csv"), "{err}");
    assert_eq!(d.ok(&["-C", "-L", "-i", "1", "-o", "csv"]), listed);
    d.ok(&[
        "-C",
        "-C",
        "-i",
        "1",
        "-f",
        fs_rule.to_str().unwrap(),
        "--ignore-unsupported",
    ]);
    assert!(d.ok(&["-C", "-L", "-i", "1"]).contains("metadata&done"));

    // Per-class statistics.
    let stats = d.ok(&["-P", "-i", "1", "-d", "1", "-o", "csv"]);
    assert!(stats.contains("metadata&done"), "{stats}");
    let err = d.fails(&["-P", "-i", "1", "-d", "7"]);
    assert!(err.contains("IO class 7 is not configured"), "{err}");
    // `-d` without a value: every class, one CSV line each under one header.
    let classes = d.ok(&["-C", "-L", "-i", "1", "-o", "csv"]).lines().count() - 1;
    let all = d.ok(&["-P", "-i", "1", "-d", "-o", "csv"]);
    assert_eq!(all.lines().count(), classes + 1, "{all}");
    assert!(
        all.starts_with("IO class ID,IO class name,Eviction priority,Max size,"),
        "{all}"
    );
    assert!(all.contains("metadata&done"), "{all}");
    let usage = d.ok(&["-P", "-i", "1", "-f", "usage,err", "-o", "csv"]);
    assert!(usage.starts_with("Occupancy [4KiB Blocks],"), "{usage}");
    assert!(!usage.contains("Read hits"), "{usage}");
}

/// Issue 35, through the daemon as an operator saw it: after a 32 KiB sequential stream with
/// `seq-cutoff -p always -t 16`, eight 4 KiB writes 12-68 KiB past its end, none adjacent to
/// anything written. Round 2's reorder window passed all eight to the core
/// (`pass_through_writes` 8 more); Open CAS caches them, and so does the detector now. The stream
/// itself is still cut off.
#[test]
fn random_writes_near_a_sequential_stream_are_cached() {
    let FileCache {
        dir: _dir,
        daemon: d,
        ..
    } = file_cache(64 << 20, 256 << 20, &["-c", "wb"]);
    d.ok(&[
        "-X",
        "-n",
        "seq-cutoff",
        "-i",
        "1",
        "-j",
        "1",
        "-p",
        "always",
        "-t",
        "16",
        "--promotion-count",
        "1",
    ]);
    let pass_through = |d: &Daemon| {
        d.stats_json(1, Some(1))["requests"]["pass_through_writes"]["count"]
            .as_u64()
            .expect("pass_through_writes")
    };
    let base = 1u64 << 20;
    let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-1").expect("connect");
    for i in 0..8u64 {
        c.write(&[0x5a; 4096], base + i * 4096, false)
            .expect("write");
    }
    let after_stream = pass_through(&d);
    // From the 4th write on the stream has its 16 KiB.
    assert_eq!(after_stream, 5, "the stream's writes");
    let end = base + 32 * 1024;
    for k in 0..8u64 {
        c.write(&[0xa5; 4096], end + 12 * 1024 + k * 8192, false)
            .expect("write");
    }
    assert_eq!(
        pass_through(&d),
        after_stream,
        "random writes near the stream went around the cache"
    );
    // The stream goes on where it ended, and is still cut off.
    c.write(&[0x5a; 4096], end, false).expect("write");
    assert_eq!(pass_through(&d), after_stream + 1);
    c.disconnect().expect("disconnect");
}

//! The study's scenarios (domain.md §9-10) with the RAID 60 profile, and the outputs.

mod common;

use common::{blkparse, JobSpec};
use hybridcache_analyze::*;

fn analyse(jobs: &[JobSpec]) -> (Trace, Signature, Recommendation) {
    let text = blkparse(jobs);
    let t = parse_trace(text.as_bytes(), Format::Auto).unwrap();
    let s = Signature::from_trace(&t);
    let r = recommend(&s, &DeviceProfile::raid60_study());
    (t, s, r)
}

fn analyse_on(jobs: &[JobSpec], profile: &str) -> Recommendation {
    let text = blkparse(jobs);
    let t = parse_trace(text.as_bytes(), Format::Auto).unwrap();
    recommend(
        &Signature::from_trace(&t),
        &DeviceProfile::builtin(profile).unwrap(),
    )
}

fn reason<'a>(r: &'a Recommendation, setting: &str) -> &'a str {
    r.reasons
        .iter()
        .find(|x| x.setting.starts_with(setting))
        .map(|x| x.text.as_str())
        .unwrap_or_else(|| panic!("no reason for {setting}: {:?}", r.reasons))
}

fn random_4k_qd1() -> JobSpec {
    JobSpec::new(100, "db")
}

fn seq_64k_qd32() -> JobSpec {
    let mut b = JobSpec::new(200, "backup");
    b.size = 65536;
    b.qd = 32;
    b.sequential = true;
    b.base = 100 << 30;
    b.service_ns = 100_000;
    b.requests = 8000;
    b
}

#[test]
fn random_4k_writes_at_low_depth_go_write_back_with_aggressive_cleaning() {
    let (_, _, r) = analyse(&[random_4k_qd1()]);
    let j = &r.jobs[0];
    assert_eq!(j.decision, Decision::Cache);
    assert_eq!(j.mode, CacheMode::Wb);
    let w = j.writes.as_ref().unwrap();
    assert!((w.core_iops - 63.0).abs() < 0.5);
    assert!(w.gain > 10.0, "{}", w.gain);
    assert!(j.reason.contains("63 IOPS at iodepth 1"), "{}", j.reason);
    assert!(j.reason.starts_with(
        "write-back: 100% of requests are writes and 100% of writes are random 4 KiB"
    ));
    assert_eq!(r.config.mode, CacheMode::Wb);
    assert!(r.config.cleaning.is_aggressive(), "{:?}", r.config.cleaning);
    assert_eq!(r.config.line_size_kib, 4);
    assert!(r.config.io_classes.is_empty());
    // Every setting has a reason.
    assert_eq!(r.reasons.len(), 10);
    assert!(r.reasons.iter().all(|x| !x.text.is_empty()));
}

#[test]
fn large_sequential_writes_at_high_depth_bypass() {
    let (_, _, r) = analyse(&[seq_64k_qd32()]);
    let j = &r.jobs[0];
    assert_eq!(j.decision, Decision::Bypass);
    let w = j.writes.as_ref().unwrap();
    assert!((w.core_mb_s - 5415.0).abs() < 1.0, "{}", w.core_mb_s);
    assert!(w.gain < 1.0);
    assert!(j.reason.contains("5415 MB/s"), "{}", j.reason);
    assert_eq!(r.config.mode, CacheMode::Pt);
    assert_eq!(r.config.seq_cutoff.policy, SeqCutoffPolicy::Always);
}

#[test]
fn large_sequential_writes_at_depth_1_are_cached() {
    // The same 64 KiB stream at iodepth 1 runs at 64 MB/s on the RAID: low depth benefits.
    let mut s = seq_64k_qd32();
    s.qd = 1;
    s.requests = 2000;
    let (_, _, r) = analyse(&[s]);
    assert_eq!(r.jobs[0].decision, Decision::Cache);
    assert_eq!(r.config.line_size_kib, 64);
    assert_eq!(r.config.seq_cutoff.policy, SeqCutoffPolicy::Never);
}

#[test]
fn mixed_random_read_write_goes_write_only() {
    let mut m = JobSpec::new(300, "mix");
    m.read_share = 0.5;
    m.qd = 32;
    m.requests = 6000;
    let (_, _, r) = analyse(&[m]);
    let j = &r.jobs[0];
    assert_eq!(j.mode, CacheMode::Wo, "{}", j.reason);
    assert!(!j.reads.as_ref().unwrap().cache);
    assert!(j.writes.as_ref().unwrap().cache);
    assert_eq!(r.config.mode, CacheMode::Wo);
    assert!(
        r.config.cleaning.is_aggressive()
            || matches!(r.config.cleaning, Cleaning::Alru(_) | Cleaning::Acp(_))
    );
    assert_eq!(r.config.promotion, Promotion::Always);
}

/// An HDD RAID core behind a RAM cache, as measured through NBD on the search machine
/// (docs/search/hdd-measured.toml, rounded), with the cache's write speed scaled by
/// `cache_write`: the first-read penalty follows from the two devices.
fn ram_over_hdd(cache_write: f64) -> DeviceProfile {
    let w = |mb_s: f64| mb_s * cache_write;
    DeviceProfile::from_toml_str(&format!(
        r#"
name = "RAM cache over an HDD RAID"
[core]
name = "HDD RAID 60"
points = [
  {{ pattern = "random", dir = "write", block_kib = 4, queue_depth = 1, mb_s = 0.26 }},
  {{ pattern = "random", dir = "write", block_kib = 4, queue_depth = 8, mb_s = 1.83 }},
  {{ pattern = "random", dir = "write", block_kib = 4, queue_depth = 32, mb_s = 3.44 }},
  {{ pattern = "random", dir = "read", block_kib = 4, queue_depth = 1, mb_s = 0.63 }},
  {{ pattern = "random", dir = "read", block_kib = 4, queue_depth = 8, mb_s = 5.12 }},
  {{ pattern = "random", dir = "read", block_kib = 4, queue_depth = 32, mb_s = 13.91 }},
]
[cache]
name = "RAM"
points = [
  {{ pattern = "random", dir = "write", block_kib = 4, queue_depth = 1, mb_s = {} }},
  {{ pattern = "random", dir = "write", block_kib = 4, queue_depth = 8, mb_s = {} }},
  {{ pattern = "random", dir = "write", block_kib = 4, queue_depth = 32, mb_s = {} }},
  {{ pattern = "random", dir = "read", block_kib = 4, queue_depth = 1, mb_s = 67.7 }},
  {{ pattern = "random", dir = "read", block_kib = 4, queue_depth = 8, mb_s = 163.7 }},
  {{ pattern = "random", dir = "read", block_kib = 4, queue_depth = 32, mb_s = 121.0 }},
]
"#,
        w(113.0),
        w(159.3),
        w(162.9)
    ))
    .unwrap()
}

#[test]
fn mixed_reads_with_some_reuse_ride_along_in_write_back_on_a_fast_cache() {
    // 70/30 random 4 KiB at iodepth 8; a tenth of the requests go to a 1 MiB hot region, so
    // about 8% of reads find a block touched before: too few to pay for a cache by themselves.
    let mut m = JobSpec::new(310, "oltp");
    m.read_share = 0.7;
    m.qd = 8;
    m.requests = 6000;
    m.hot_share = 0.1;
    m.hot_span = 1 << 20;
    let text = blkparse(&[m]);
    let t = parse_trace(text.as_bytes(), Format::Auto).unwrap();
    let sig = Signature::from_trace(&t);
    let reuse = sig.jobs[0].reads.reuse_share();
    assert!((0.04..0.15).contains(&reuse), "reuse {reuse}");

    // The RAM cache writes ~35x as fast as the RAID reads: a first read costs ~1.03x, not
    // the 1.25x a fixed penalty assumed, and the writes bring the cache anyway, so the reads
    // are inserted (wb), although their gain is below the 1.2x that pays for a cache.
    let r = recommend(&sig, &ram_over_hdd(1.0));
    let j = &r.jobs[0];
    let reads = j.reads.as_ref().unwrap();
    assert!(
        reads.miss_penalty > 1.0 && reads.miss_penalty < 1.05,
        "{}",
        reads.miss_penalty
    );
    assert!(reads.gain >= 1.0 && reads.gain < 1.2, "{}", reads.gain);
    assert!(reads.cache);
    assert_eq!(j.mode, CacheMode::Wb, "{}", j.reason);
    assert_eq!(r.config.mode, CacheMode::Wb, "{:?}", r.reasons);
    let why = reason(&r, "cache mode wb");
    assert!(
        why.contains("the cache is there for the writes anyway")
            && why.contains("a first read costs only 1.0"),
        "{why}"
    );

    // The same trace in front of a cache that writes only 1.5x as fast as the core reads: a
    // first read costs ~1.7x the core read, the reads lose, and they stay on the core (wo).
    let r = recommend(&sig, &ram_over_hdd(0.055));
    let j = &r.jobs[0];
    let reads = j.reads.as_ref().unwrap();
    assert!(reads.miss_penalty > 1.5, "{}", reads.miss_penalty);
    assert!(reads.gain < 1.0 && !reads.cache, "{}", reads.gain);
    assert_eq!(r.config.mode, CacheMode::Wo, "{:?}", r.reasons);
    assert!(
        reason(&r, "cache mode wo").contains("first-read penalty (1."),
        "{:?}",
        r.reasons
    );
}

#[test]
fn reread_data_goes_write_through() {
    // Reads cycling over a small region: almost every read hits.
    let mut m = JobSpec::new(400, "reader");
    m.read_share = 1.0;
    m.span = 4 << 20;
    m.requests = 6000;
    let (_, _, r) = analyse(&[m]);
    assert_eq!(r.jobs[0].mode, CacheMode::Wt, "{}", r.jobs[0].reason);
    assert_eq!(r.config.cleaning, Cleaning::Nop);
    // The working set is 1024 blocks: the curve sizes the cache at about that.
    assert!(
        r.config.cache_size_bytes >= 4 << 20 && r.config.cache_size_bytes <= 8 << 20,
        "{}",
        r.config.cache_size_bytes
    );
}

#[test]
fn two_jobs_cache_one_bypass_the_other() {
    let (t, s, r) = analyse(&[random_4k_qd1(), seq_64k_qd32()]);
    let db = r.jobs.iter().find(|j| j.job.starts_with("db")).unwrap();
    let bk = r.jobs.iter().find(|j| j.job.starts_with("backup")).unwrap();
    assert_eq!((db.decision, db.mode), (Decision::Cache, CacheMode::Wb));
    assert_eq!(bk.decision, Decision::Bypass);
    let c = &r.config;
    assert_eq!(c.mode, CacheMode::Wb);
    assert!(c.cleaning.is_aggressive());
    assert_eq!(
        c.seq_cutoff,
        SeqCutoff {
            policy: SeqCutoffPolicy::Always,
            threshold: 16
        }
    );
    assert_eq!(c.line_size_kib, 4);
    let lines: Vec<String> = c.io_classes.iter().map(IoClass::csv_line).collect();
    assert_eq!(
        lines,
        vec![
            "0,unclassified,22,0".to_string(),
            "1,request_size:le:32768,1,1".to_string()
        ]
    );

    let cmds = r.commands(1);
    assert!(
        cmds.contains(&"hybridcache -Q -c wb -i 1".to_string()),
        "{cmds:?}"
    );
    assert!(cmds.contains(&"hybridcache -X -n seq-cutoff -i 1 -p always -t 16".to_string()));
    assert!(cmds.contains(&"hybridcache -C -C -i 1 -f ioclass.csv".to_string()));
    assert!(cmds
        .iter()
        .any(|c| c.starts_with("hybridcache -X -n cleaning -i 1 -p ")));
    assert!(r.io_class_csv().starts_with(
        "IO class id,IO class name,Eviction priority,Allocation\n0,unclassified,22,0\n"
    ));

    // TOML fragment parses back and carries the settings.
    let frag = r.toml_fragment(1);
    let v: toml::Value = toml::from_str(&frag).unwrap();
    let cache = &v["cache"][0];
    assert_eq!(cache["mode"].as_str(), Some("wb"));
    assert_eq!(cache["line_size"].as_integer(), Some(4));
    assert!(cache["params"]["cleaning.policy"].as_str().is_some());
    assert!(frag.contains("-X -n seq-cutoff -i 1 -p always"), "{frag}");
    assert!(
        frag.contains("# IO classes: hybridcache -C -C -i 1"),
        "{frag}"
    );
    assert!(frag.contains("# cache mode wb: "));

    // Reports.
    let rep = Report::new(&t, &s, &r, 1);
    let text = rep.render_text();
    let md = rep.render_markdown();
    for needle in [
        "Recommended configuration",
        "Miss-ratio curve",
        "Request sizes",
        "hybridcache -Q -c wb -i 1",
        "db (pid 100)",
    ] {
        assert!(text.contains(needle), "text lacks {needle}");
        assert!(md.contains(needle), "markdown lacks {needle}");
    }
    assert!(md.contains("| job | requests |"));
    assert!(md.contains("```sh\n"));
}

#[test]
fn alru_preset_commands() {
    let (_, _, r) = analyse(&[random_4k_qd1()]);
    let cmds = r.commands(3);
    match r.config.cleaning {
        Cleaning::Alru(p) if p == AlruParams::VERY_AGGRESSIVE => {
            assert!(
                cmds.contains(
                    &"hybridcache -X -n cleaning-alru -i 3 -w 0 -s 1 -b 8192 -t 0".to_string()
                ),
                "{cmds:?}"
            )
        }
        Cleaning::Acp(p) if p == AcpParams::VERY_AGGRESSIVE => {
            assert!(
                cmds.contains(&"hybridcache -X -n cleaning-acp -i 3 -w 1 -b 8192".to_string()),
                "{cmds:?}"
            )
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn profile_from_file() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("p.toml");
    std::fs::write(&p, DeviceProfile::raid60_study().to_toml_string()).unwrap();
    assert_eq!(
        DeviceProfile::load(&p).unwrap(),
        DeviceProfile::raid60_study()
    );
    let j = dir.path().join("p.json");
    std::fs::write(
        &j,
        serde_json::to_string(&DeviceProfile::raid60_study()).unwrap(),
    )
    .unwrap();
    assert_eq!(
        DeviceProfile::load(&j).unwrap().name,
        DeviceProfile::raid60_study().name
    );
    assert!(DeviceProfile::load(&dir.path().join("missing.toml")).is_err());
}

// The write-back tail rule (issue 16): a fast core takes deep or heavy writes write-through.

fn random_4k_writes(qd: usize) -> JobSpec {
    let mut j = JobSpec::new(500, "oltp");
    j.qd = qd;
    j.requests = 4000;
    j.service_ns = 100_000;
    j
}

#[test]
fn tail_rule_sends_deep_writes_on_an_ssd_raid_through() {
    let r = analyse_on(&[random_4k_writes(32)], "ssd-raid5x9");
    // The writes alone would be worth write-back (the core takes ~34k IOPS at depth 32, its
    // deepest queue ~69k)...
    assert_eq!(r.jobs[0].mode, CacheMode::Wb, "{}", r.jobs[0].reason);
    // ...but the tail rule turns the cache's mode to write-through.
    assert_eq!(r.config.mode, CacheMode::Wt);
    let why = reason(&r, "cache mode wt");
    assert!(why.starts_with("write-through instead of write-back (the write-back tail rule): the core (RAID 5, 9 SATA SSD"), "{why}");
    assert!(
        why.contains("run at iodepth 32, where the core alone gives 34"),
        "{why}"
    );
    assert_eq!(r.config.cleaning, Cleaning::Nop);
    assert!(!r.config.lazy_flush);
    assert!(r
        .commands(1)
        .contains(&"hybridcache -Q -c wt -i 1 -f yes".to_string()));
}

#[test]
fn tail_rule_leaves_shallow_light_writes_and_hdd_cores_alone() {
    // Depth 1 and depth 8 at 10k IOPS on the SSD RAID: far below the array's ceiling, so the
    // write-back queue drains.
    for qd in [1, 8] {
        let r = analyse_on(&[random_4k_writes(qd)], "ssd-raid5x9");
        assert_eq!(r.config.mode, CacheMode::Wb, "{:?}", r.reasons);
        assert!(!reason(&r, "cache mode wb").contains("tail rule"));
    }
    // The same deep writes on the HDD RAID: write-back.
    let r = analyse_on(&[random_4k_writes(16)], "raid60-study");
    assert_eq!(r.config.mode, CacheMode::Wb);
    assert!(fast_core(&DeviceProfile::raid60_study()).is_none());
    assert!(fast_core(&DeviceProfile::builtin("ssd-raid5x9").unwrap()).is_some());
}

#[test]
fn tail_rule_fires_on_load_alone() {
    // Depth 4, but 40k write IOPS: more than half of what the array's deepest queue gives.
    let mut j = random_4k_writes(4);
    j.service_ns = 25_000;
    // Longer than one 1 s timeline bucket, so the peak is a whole second's.
    j.requests = 90_000;
    let r = analyse_on(&[j], "ssd-raid5x9");
    assert_eq!(r.config.mode, CacheMode::Wt, "{:?}", r.reasons);
    assert!(
        reason(&r, "cache mode wt").contains("peak at 400"),
        "{}",
        reason(&r, "cache mode")
    );
}

// Lazy flush: on when writes arrive faster than cleaning drains them.

#[test]
fn lazy_flush_on_for_random_writes_that_outrun_cleaning() {
    let (_, _, r) = analyse(&[random_4k_qd1()]);
    assert!(r.config.lazy_flush);
    let why = reason(&r, "lazy-flush on");
    assert!(why.contains("cleaning drains"), "{why}");
    assert!(
        why.contains("go to the core instead of each waiting for cleaning"),
        "{why}"
    );
    assert!(r
        .commands(1)
        .contains(&"hybridcache -X -n lazy-flush -i 1 -p on".to_string()));
    assert_eq!(
        config_params(&r.config)
            .get("lazy-flush.policy")
            .map(String::as_str),
        Some("on")
    );
}

#[test]
fn lazy_flush_off_when_cleaning_keeps_up_or_nothing_is_dirty() {
    // Sequential 64 KiB at depth 1: the RAID drains full stripes at 5415 MB/s, faster than the
    // cache takes them (700 MB/s).
    let mut s = seq_64k_qd32();
    s.qd = 1;
    s.requests = 2000;
    s.service_ns = 1_000_000;
    let (_, _, r) = analyse(&[s]);
    assert_eq!(r.config.mode, CacheMode::Wb);
    assert!(!r.config.lazy_flush);
    assert!(reason(&r, "lazy-flush off").contains("does not pile up"));
    // Reads only: write-through holds no dirty data.
    let mut m = JobSpec::new(400, "reader");
    m.read_share = 1.0;
    m.span = 4 << 20;
    m.requests = 6000;
    let (_, _, r) = analyse(&[m]);
    assert!(!r.config.lazy_flush);
    assert!(reason(&r, "lazy-flush off").contains("holds no dirty data"));
}

// Read-ahead: sequential reads that a prefetching stream serves faster.

fn seq_reader(size: u64, qd: usize) -> JobSpec {
    let mut j = JobSpec::new(600, "scan");
    j.read_share = 1.0;
    j.sequential = true;
    j.size = size;
    j.qd = qd;
    j.requests = 3000;
    j
}

#[test]
fn readahead_for_sequential_reads_at_low_depth() {
    let r = analyse_on(&[seq_reader(65536, 1)], "raid60-study");
    let ra = r.config.prefetch.expect("read-ahead");
    assert_eq!(
        ra,
        ReadAhead {
            threshold: 256,
            distance: 1024,
            max_in_flight: 4
        }
    );
    assert!(r.config.mode.caches_reads());
    assert_eq!(r.config.seq_cutoff.policy, SeqCutoffPolicy::Never);
    let why = reason(&r, "prefetch readahead 256 KiB");
    assert!(why.contains("scan (pid 600) reads sequentially (100% of its reads, 64 KiB at iodepth 1), which the core serves at 64 MB/s"), "{why}");
    let cmds = r.commands(1);
    assert!(
        cmds.contains(
            &"hybridcache -X -n prefetch-readahead -i 1 -t 256 --distance 1024 --max-in-flight 4"
                .to_string()
        ),
        "{cmds:?}"
    );
    assert!(cmds.contains(&"hybridcache -X -n prefetch -i 1 -p readahead".to_string()));
}

#[test]
fn no_readahead_for_random_reads_or_deep_streams() {
    let mut j = JobSpec::new(700, "lookup");
    j.read_share = 1.0;
    j.span = 4 << 20;
    j.requests = 6000;
    let r = analyse_on(&[j], "raid60-study");
    assert_eq!(r.config.prefetch, None);
    assert!(reason(&r, "prefetch none").starts_with("none: no cached job reads sequentially"));
    // 64 KiB at depth 32: the RAID already streams at 5415 MB/s, more than read-ahead's 4
    // requests in flight give.
    let r = analyse_on(&[seq_reader(65536, 32)], "raid60-study");
    assert_eq!(r.config.prefetch, None, "{:?}", r.reasons);
}

// nhit promotion: read-intensive, skewed, many one-time reads.

#[test]
fn nhit_for_skewed_reads_with_many_one_time_blocks() {
    let mut j = JobSpec::new(800, "web");
    j.read_share = 0.9;
    j.span = 64 << 30;
    j.hot_span = 2 << 20;
    j.hot_share = 0.5;
    j.requests = 20000;
    let r = analyse_on(&[j], "ssd-raid5x9");
    assert!(r.config.mode.caches_reads(), "{:?}", r.reasons);
    assert_eq!(
        r.config.promotion,
        Promotion::Nhit {
            threshold: 2,
            trigger: 80
        },
        "{:?}",
        r.reasons
    );
    assert!(reason(&r, "promotion nhit 2/80").contains("read only once"));
    // Without the one-time reads, the one-time rule does not fire (the slow-cache rule may).
    let mut k = JobSpec::new(801, "hot");
    k.read_share = 0.9;
    k.span = 2 << 20;
    k.requests = 20000;
    let r = analyse_on(&[k.clone()], "ssd-raid5x9");
    assert_ne!(
        r.config.promotion,
        Promotion::Nhit {
            threshold: 2,
            trigger: 80
        },
        "{:?}",
        r.reasons
    );
    let r = analyse_on(&[k], "raid60-study");
    assert_eq!(r.config.promotion, Promotion::Always, "{:?}", r.reasons);
}

// Offload: a fast core that serves a fair part of what the cache device does takes a share.

#[test]
fn offload_on_when_the_fast_core_keeps_up_with_the_cache() {
    let mut j = JobSpec::new(900, "kv");
    j.read_share = 1.0;
    j.span = 4 << 20;
    j.qd = 32;
    j.requests = 8000;
    j.service_ns = 10_000;
    let r = analyse_on(&[j], "ssd-raid5x9");
    assert!(r.config.mode.caches_reads(), "{:?}", r.reasons);
    // The array reads 4 KiB at ~256k IOPS at depth 32, the NVMe cache at 400k: 39% of the two.
    assert_eq!(
        r.config.offload,
        Some(Offload {
            share: 40,
            threshold: 1
        })
    );
    let why = reason(&r, "offload on 40%");
    assert!(why.contains("kv (pid 900)'s reads at"), "{why}");
    let cmds = r.commands(1);
    assert!(cmds.contains(&"hybridcache -X -n offload-queue -i 1 --share 40 -t 1".to_string()));
    assert!(cmds.contains(&"hybridcache -X -n offload -i 1 -p on".to_string()));
}

#[test]
fn offload_off_for_slow_or_far_slower_cores() {
    // The HDD RAID is not fast.
    let (_, _, r) = analyse(&[random_4k_qd1()]);
    assert_eq!(r.config.offload, None);
    assert!(reason(&r, "offload off").contains("is neither flash nor within 4x of the cache"));
    // Random writes at depth 1 on the SSD RAID: 1075 IOPS against the cache's 50000.
    let r = analyse_on(&[random_4k_writes(1)], "ssd-raid5x9");
    assert_eq!(r.config.offload, None);
    let why = reason(&r, "offload off");
    assert!(why.contains("only 2.2% of the cache's 50000 IOPS"), "{why}");
    assert!(r
        .commands(1)
        .contains(&"hybridcache -X -n offload -i 1 -p off".to_string()));
}

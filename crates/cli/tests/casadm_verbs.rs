//! casadm's remaining verbs (issue 33), each through the daemon, in casadm's own forms
//! (casadm/cas_main.c, `script_params_options`, open-cas-linux v26.03 and master):
//! `--script --check-cache-device --cache-device DEV`, `--script --purge-cache --cache-id ID`,
//! `--script --purge-core --cache-id ID --core-id ID`, and casctl's `stop [--flush]`
//! (utils/casctl, utils/opencas.py `stop`).

mod common;

use std::path::{Path, PathBuf};

use common::{sparse_file, workdir, Daemon};
use hybridcache_nbd::client::Client;

const MIB: u64 = 1 << 20;
/// What each test writes through a client: 4 MiB, 1,024 lines of 4 KiB.
const WRITTEN: u64 = 4 * MIB;

fn path_str(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// A pattern no sparse file holds, per `seed`.
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29).wrapping_add(seed) | 1)
        .collect()
}

/// A write-back cache 1 with cleaning off (written data stays dirty) and `cores` cores on files.
struct Rig {
    dir: tempfile::TempDir,
    cache_file: PathBuf,
    spec: String,
    cores: Vec<PathBuf>,
    daemon: Option<Daemon>,
}

/// The client reads back what `Rig::write_dirty` wrote with `seed`.
fn assert_reads_back(c: &mut Client, seed: u8, when: &str) {
    let mut back = vec![0u8; WRITTEN as usize];
    c.read(&mut back, 0).expect(when);
    assert_eq!(back, pattern(seed, WRITTEN as usize), "{when}");
}

impl Rig {
    fn new(cores: usize) -> Rig {
        let dir = workdir();
        let cache_file = dir.path().join("cache.img");
        sparse_file(&cache_file, 64 * MIB);
        let spec = format!("file:{}", cache_file.display());
        let daemon = Daemon::start(dir.path());
        daemon.ok(&["-S", "-d", &spec, "-c", "wb"]);
        daemon.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
        let mut files = Vec::new();
        for j in 1..=cores {
            let core = dir.path().join(format!("core{j}.img"));
            sparse_file(&core, 32 * MIB);
            daemon.ok(&["-A", "-i", "1", "-j", &j.to_string(), "-d", path_str(&core)]);
            files.push(core);
        }
        Rig {
            dir,
            cache_file,
            spec,
            cores: files,
            daemon: Some(daemon),
        }
    }

    fn d(&self) -> &Daemon {
        self.daemon.as_ref().expect("daemon running")
    }

    fn client(&self, core: u16) -> Client {
        Client::connect_unix(&self.d().nbd, &format!("cas1-{core}")).expect("NBD connection")
    }

    /// Write `WRITTEN` bytes of pattern `seed` to core `core`'s export; they stay dirty.
    fn write_dirty(&self, c: &mut Client, seed: u8) {
        let data = pattern(seed, WRITTEN as usize);
        for (k, chunk) in data.chunks(MIB as usize).enumerate() {
            c.write(chunk, k as u64 * MIB, false).expect("write");
        }
        c.flush().expect("NBD flush");
    }

    /// (occupancy, dirty) lines of one core, or of the cache.
    fn lines(&self, core: Option<u16>) -> (u64, u64) {
        let s = self.d().stats_json(1, core);
        (
            s["raw"]["occupancy_lines"].as_u64().expect("occupancy"),
            s["raw"]["dirty_lines"].as_u64().expect("dirty"),
        )
    }

    fn core_has(&self, core: u16, seed: u8) -> bool {
        let bytes = std::fs::read(&self.cores[core as usize - 1]).expect("core file");
        bytes[..WRITTEN as usize] == pattern(seed, WRITTEN as usize)[..]
    }

    fn check(&self, device: &str) -> String {
        self.d()
            .ok(&["--script", "--check-cache-device", "--cache-device", device])
    }
}

#[test]
fn check_cache_device_prints_casadm_s_table() {
    let mut rig = Rig::new(1);
    let d = rig.d();
    // A device no cache ever used: casadm's `no,-,-`.
    let empty = rig.dir.path().join("empty.img");
    sparse_file(&empty, 64 * MIB);
    assert_eq!(
        rig.check(path_str(&empty)),
        "Is cache,Clean Shutdown,Cache dirty\nno,-,-\n"
    );
    // The device of a running cache is not checked under it.
    let e = d.fails(&["--script", "--check-cache-device", "-d", &rig.spec]);
    assert!(e.contains("is the device of running cache 1"), "{e}");

    let mut c = rig.client(1);
    rig.write_dirty(&mut c, 1);
    drop(c);
    d.ok(&["-T", "-i", "1", "-n"]);
    assert_eq!(
        rig.check(&rig.spec),
        "Is cache,Clean Shutdown,Cache dirty\nyes,yes,yes\n"
    );
    d.ok(&["-S", "-d", &rig.spec, "--load"]);
    d.ok(&["-T", "-i", "1"]);
    assert_eq!(
        rig.check(&rig.spec),
        "Is cache,Clean Shutdown,Cache dirty\nyes,yes,no\n"
    );
    // After a crash the clean-shutdown mark is missing.
    d.ok(&["-S", "-d", &rig.spec, "--load"]);
    if let Some(d) = rig.daemon.as_mut() {
        d.kill();
    }
    let d = Daemon::start_with(
        rig.dir.path(),
        &["--state-dir", path_str(&rig.dir.path().join("other-state"))],
    );
    let out = d.ok(&[
        "--script",
        "--check-cache-device",
        "--cache-device",
        &rig.spec,
    ]);
    assert_eq!(out, "Is cache,Clean Shutdown,Cache dirty\nyes,no,no\n");
    rig.daemon = Some(d);
}

#[test]
fn purge_cache_flushes_then_empties_the_cache_and_keeps_the_exports() {
    let rig = Rig::new(2);
    let d = rig.d();
    let mut c1 = rig.client(1);
    let mut c2 = rig.client(2);
    rig.write_dirty(&mut c1, 3);
    rig.write_dirty(&mut c2, 4);
    let (held, dirty) = rig.lines(None);
    assert_eq!(dirty, 2 * WRITTEN / 4096);
    assert!(held >= dirty);
    d.ok(&["-X", "-n", "seq-cutoff", "-i", "1", "-j", "2", "-t", "2048"]);

    let out = d.ok(&["--script", "--purge-cache", "--cache-id", "1"]);
    assert_eq!(
        out.trim(),
        format!(
            "cache 1 purged: 2,048 dirty lines flushed, {} lines invalidated",
            hybridcache_daemon::safety::count_text(held)
        )
    );
    assert_eq!(rig.lines(None), (0, 0), "the cache holds nothing");
    assert!(rig.core_has(1, 3) && rig.core_has(2, 4), "flushed first");
    // The same cache: mode, parameters and cores kept; the clients never lost their exports.
    let list = d.ok(&["-L", "-o", "csv"]);
    assert!(
        list.contains("cache,1,") && list.contains(",Running,wb,"),
        "{list}"
    );
    assert!(d
        .ok(&["-G", "-n", "cleaning", "-i", "1", "-o", "csv"])
        .contains(",nop"));
    assert!(d
        .ok(&["-G", "-n", "seq-cutoff", "-i", "1", "-j", "2", "-o", "csv"])
        .contains(",2048"));
    assert_reads_back(&mut c1, 3, "read after the purge");
    assert_reads_back(&mut c2, 4, "read after the purge");
    // casadm's short forms too.
    d.ok(&["--script", "--purge-cache", "-i", "1"]);
}

#[test]
fn purge_cache_of_an_incomplete_cache_is_refused_and_changes_nothing() {
    let mut rig = Rig::new(1);
    let mut c = rig.client(1);
    rig.write_dirty(&mut c, 5);
    drop(c);
    rig.d().ok(&["-T", "-i", "1", "-n"]);
    let moved = rig.cores[0].with_extension("away");
    std::fs::rename(&rig.cores[0], &moved).expect("move the core away");
    let out = rig.d().ok(&["-S", "-d", &rig.spec, "--load"]);
    assert!(out.contains("is inactive"), "{out}");
    let before = std::fs::read(&rig.cache_file).unwrap();
    let e = rig
        .d()
        .fails(&["--script", "--purge-cache", "--cache-id", "1"]);
    assert!(
        e.contains("cache 1 was not purged, nothing was changed: core 1 is inactive")
            && e.contains("1,024 dirty lines (4 MiB) cannot be flushed"),
        "{e}"
    );
    assert!(e.contains("--remove-inactive -i 1 -j 1"), "{e}");
    assert!(
        std::fs::read(&rig.cache_file).unwrap() == before,
        "a refused purge wrote"
    );
    if let Some(d) = rig.daemon.as_mut() {
        d.stop();
    }
}

#[test]
fn purge_core_empties_one_core_and_leaves_the_other() {
    let rig = Rig::new(2);
    let d = rig.d();
    let mut c1 = rig.client(1);
    let mut c2 = rig.client(2);
    rig.write_dirty(&mut c1, 6);
    rig.write_dirty(&mut c2, 7);
    let (held1, _) = rig.lines(Some(1));
    let before2 = rig.lines(Some(2));
    assert_eq!(before2.1, WRITTEN / 4096);
    d.ok(&[
        "-X",
        "-n",
        "seq-cutoff",
        "-i",
        "1",
        "-j",
        "1",
        "-p",
        "never",
    ]);

    let out = d.ok(&[
        "--script",
        "--purge-core",
        "--cache-id",
        "1",
        "--core-id",
        "1",
    ]);
    assert_eq!(
        out.trim(),
        format!(
            "core 1 of cache 1 purged: 1,024 dirty lines flushed, {} lines invalidated",
            hybridcache_daemon::safety::count_text(held1)
        )
    );
    assert_eq!(rig.lines(Some(1)), (0, 0), "core 1 holds nothing");
    assert_eq!(rig.lines(Some(2)), before2, "core 2 untouched, still dirty");
    assert!(rig.core_has(1, 6), "core 1 flushed first");
    assert!(!rig.core_has(2, 7), "core 2 not flushed");
    assert!(d
        .ok(&["-G", "-n", "seq-cutoff", "-i", "1", "-j", "1", "-o", "csv"])
        .contains(",never"));
    // The export stayed: the same connection reads its data and writes again.
    assert_reads_back(&mut c1, 6, "read after the purge");
    rig.write_dirty(&mut c1, 8);
    assert_eq!(rig.lines(Some(1)).1, WRITTEN / 4096);
    // The purged core is still in the cache's metadata: it comes back at a load.
    drop((c1, c2));
    d.ok(&["-T", "-i", "1", "-n"]);
    d.ok(&["-S", "-d", &rig.spec, "--load"]);
    assert_eq!(rig.lines(Some(1)).1, WRITTEN / 4096);
    let mut c1 = rig.client(1);
    assert_reads_back(&mut c1, 8, "read after the load");

    let e = d.fails(&["--script", "--purge-core", "-i", "1", "-j", "9"]);
    assert!(e.contains("core 9 does not exist in cache 1"), "{e}");
}

#[test]
fn casctl_stop_keeps_dirty_data_unless_flush() {
    let rig = Rig::new(1);
    let d = rig.d();
    let mut c = rig.client(1);
    rig.write_dirty(&mut c, 9);
    // A client connected: that cache is refused, and named; casctl's exit code is 1.
    let e = d.fails(&["casctl", "stop"]);
    assert!(
        e.contains("unable to stop cache 1") && e.contains("--disconnect-clients"),
        "{e}"
    );
    drop(c);
    let out = d.ok(&["casctl", "stop"]);
    assert_eq!(
        out.trim(),
        "cache 1 stopped, its dirty data kept on its device for the next start"
    );
    assert!(
        d.ok(&["-L", "-o", "csv"]).lines().count() <= 1,
        "no cache runs"
    );
    assert!(!rig.core_has(1, 9), "not flushed");
    assert_eq!(
        rig.check(&rig.spec),
        "Is cache,Clean Shutdown,Cache dirty\nyes,yes,yes\n"
    );
    d.ok(&["-S", "-d", &rig.spec, "--load"]);
    assert_eq!(
        rig.lines(Some(1)).1,
        WRITTEN / 4096,
        "loaded with its dirty data"
    );
    let out = d.ok(&["casctl", "stop", "--flush"]);
    assert_eq!(out.trim(), "cache 1 stopped, its dirty data flushed");
    assert!(rig.core_has(1, 9), "flushed");
    assert_eq!(
        rig.check(&rig.spec),
        "Is cache,Clean Shutdown,Cache dirty\nyes,yes,no\n"
    );
}

/// `-L -o csv` without its header.
fn list_rows(d: &Daemon) -> Vec<String> {
    d.ok(&["-L", "-o", "csv"])
        .lines()
        .skip(1)
        .map(str::to_string)
        .collect()
}

#[test]
fn try_add_keeps_a_core_in_the_pool_until_its_cache_loads() {
    let rig = Rig::new(1);
    let d = rig.d();
    let mut c = rig.client(1);
    rig.write_dirty(&mut c, 10);
    drop(c);
    d.ok(&["-T", "-i", "1", "-n"]);
    // The core's device comes back under another name, before its cache: casctl's and udev's
    // `--try-add` keeps it in the pool.
    let renamed = rig.cores[0].with_extension("renamed");
    std::fs::rename(&rig.cores[0], &renamed).expect("rename the core");
    let renamed = path_str(&renamed);
    let out = d.ok(&[
        "--script",
        "--add-core",
        "--try-add",
        "--cache-id",
        "1",
        "--core-id",
        "1",
        "--core-device",
        renamed,
    ]);
    assert!(out.contains("added to the core pool"), "{out}");
    assert_eq!(
        list_rows(d),
        [
            "core pool,-,-,-,-,-,-".to_string(),
            format!("core,-,{renamed},Detached,-,-,-")
        ]
    );
    let table = d.ok(&["-L"]);
    assert!(
        table.contains("core pool") && table.contains("Detached"),
        "{table}"
    );
    // A pooled device is in use.
    let e = d.fails(&["-S", "-d", renamed]);
    assert!(e.contains("core pool"), "{e}");
    // The load takes it from the pool: core 1 is active again, with its dirty data.
    let out = d.ok(&["-S", "-d", &rig.spec, "--load"]);
    assert!(!out.contains("inactive"), "{out}");
    let rows = list_rows(d);
    assert!(
        rows.iter()
            .any(|r| r.starts_with(&format!("core,1,{renamed},Active"))),
        "{rows:?}"
    );
    assert!(!rows.iter().any(|r| r.starts_with("core pool")), "{rows:?}");
    assert_eq!(rig.lines(Some(1)).1, WRITTEN / 4096);
    let mut c = rig.client(1);
    assert_reads_back(&mut c, 10, "read");
}

#[test]
fn try_add_to_a_running_cache_only_attaches_a_core_it_records() {
    let rig = Rig::new(1);
    let d = rig.d();
    let other = rig.dir.path().join("other.img");
    sparse_file(&other, 32 * MIB);
    let other = path_str(&other);
    let try_add = |j: &str, dev: &str| {
        d.fails(&[
            "--script",
            "--add-core",
            "--try-add",
            "-i",
            "1",
            "-j",
            j,
            "--core-device",
            dev,
        ])
    };
    assert!(try_add("2", other).contains("cache 1 does not record a core 2"));
    assert!(try_add("1", other).contains("core 1 of cache 1 is already active"));
    // casadm requires --core-id with --try-add.
    let out = d.cli(&[
        "--script",
        "--add-core",
        "--try-add",
        "-i",
        "1",
        "--core-device",
        other,
    ]);
    assert!(!out.status.success());
    // Without --try-add: a new core, as -A.
    let out = d.ok(&[
        "--script",
        "--add-core",
        "--cache-id",
        "1",
        "--core-device",
        other,
    ]);
    assert_eq!(out.trim(), "core 2 added to cache 1, exported as cas1-2");
    // --script --remove-core flushes first, as -R.
    let mut c = rig.client(1);
    rig.write_dirty(&mut c, 11);
    drop(c);
    d.ok(&[
        "--script",
        "--remove-core",
        "--cache-id",
        "1",
        "--core-id",
        "1",
    ]);
    assert!(rig.core_has(1, 11), "flushed before the removal");
    d.ok(&[
        "--script",
        "--remove-core",
        "-i",
        "1",
        "-j",
        "2",
        "--no-flush",
    ]);
    assert_eq!(list_rows(d).len(), 1, "only the cache is left");
}

#[test]
fn remove_detached_takes_a_device_out_of_the_pool() {
    let dir = workdir();
    let d = Daemon::start(dir.path());
    let dev = dir.path().join("core.img");
    sparse_file(&dev, 32 * MIB);
    let dev = path_str(&dev);
    d.ok(&[
        "--script",
        "--add-core",
        "--try-add",
        "-i",
        "5",
        "-j",
        "1",
        "--core-device",
        dev,
    ]);
    assert_eq!(list_rows(&d).len(), 2);
    let e = d.fails(&[
        "--script",
        "--add-core",
        "--try-add",
        "-i",
        "6",
        "-j",
        "1",
        "--core-device",
        dev,
    ]);
    assert!(e.contains("already in the core pool"), "{e}");
    let out = d.ok(&["--remove-detached", "-d", dev]);
    assert_eq!(out.trim(), format!("{dev} removed from the core pool"));
    assert_eq!(d.ok(&["-L"]), "No caches running\n");
    let e = d.fails(&["--remove-detached", "--device", dev]);
    assert!(e.contains("is not in the core pool"), "{e}");
    let e = d.fails(&[
        "--script",
        "--add-core",
        "--try-add",
        "-i",
        "5",
        "-j",
        "1",
        "--core-device",
        &format!("{dev}.missing"),
    ]);
    assert!(e.contains("not found"), "{e}");
}

/// casadm master's `-X -n seq-detect --promotion-count` (cas_main.c, `set_param_seq_detect_
/// handle_option`; label "Sequence detector promotion request count" from its
/// `core_param_seq_detect_promotion_count`): the engine's promotion count, which v26.03's
/// `seq-cutoff --promotion-count` sets too. Its `--promotion-threshold` has no equivalent.
#[test]
fn seq_detect_sets_the_promotion_count() {
    let rig = Rig::new(2);
    let d = rig.d();
    d.ok(&[
        "-X",
        "-n",
        "seq-detect",
        "-i",
        "1",
        "-j",
        "1",
        "--promotion-count",
        "3",
    ]);
    assert_eq!(
        d.ok(&["-G", "-n", "seq-detect", "-i", "1", "-j", "1", "-o", "csv"]),
        "Parameter name,Value\nSequence detector promotion request count,3\n\
         Sequence detector promotion threshold [KiB],0\n"
    );
    let cutoff = d.ok(&["-G", "-n", "seq-cutoff", "-i", "1", "-j", "1", "-o", "csv"]);
    assert!(
        cutoff.contains("promotion request count threshold,3"),
        "{cutoff}"
    );
    let other = d.ok(&["-G", "-n", "seq-detect", "-i", "1", "-j", "2", "-o", "csv"]);
    assert!(
        other.contains("request count,8\n"),
        "core 2 keeps the default: {other}"
    );
    // Without -j every core.
    d.ok(&[
        "-X",
        "-n",
        "seq-detect",
        "-i",
        "1",
        "--promotion-count",
        "5",
    ]);
    let other = d.ok(&["-G", "-n", "seq-detect", "-i", "1", "-j", "2", "-o", "csv"]);
    assert!(other.contains("request count,5\n"), "{other}");
    let e = d.fails(&[
        "-X",
        "-n",
        "seq-detect",
        "-i",
        "1",
        "-j",
        "1",
        "--promotion-count",
        "0",
    ]);
    assert!(e.contains("promotion-count"), "{e}");
}

/// The statistics a purge keeps: OCF's purge (ocf_mngt_flush.c, `ocf_mngt_core_purge`: flush,
/// then `ocf_metadata_sparse_range`) invalidates lines and resets no counter, so casadm's request
/// and block statistics after a purge are those before it; only usage (occupancy, dirty) and
/// what the purge's own flush moved (the cleaner's writes) change.
const KEPT_BY_A_PURGE: &[&str] = &[
    "read_hits",
    "read_partial_misses",
    "read_full_misses",
    "write_hits",
    "write_partial_misses",
    "write_full_misses",
    "pass_through_reads",
    "pass_through_writes",
    "exported_read_bytes",
    "exported_written_bytes",
    "cache_write_errors",
    "core_write_errors",
];

fn kept_counters(s: &serde_json::Value) -> Vec<(&'static str, u64)> {
    KEPT_BY_A_PURGE
        .iter()
        .map(|k| (*k, s["raw"][*k].as_u64().expect("counter")))
        .collect()
}

/// The cache's superblock as the device holds it (the daemon's file volume is written with
/// pwrite, so another reader sees it while the cache runs).
fn superblock(rig: &Rig) -> hybridcache_engine::Superblock {
    let v = hybridcache_volume::FileVolume::open(&rig.cache_file).expect("open the cache file");
    hybridcache_engine::Cache::peek(&v).expect("superblock")
}

fn core_uuid(rig: &Rig, core: u16) -> String {
    superblock(rig)
        .cores
        .into_iter()
        .find(|c| c.id == core)
        .map(|c| c.uuid)
        .expect("the core is in the superblock")
}

/// A purge is not a removal: the core keeps its place in the metadata (its uuid), its
/// statistics and its settings; only what the cache held goes.
#[test]
fn purge_core_keeps_its_statistics_and_its_place_in_the_metadata() {
    let rig = Rig::new(2);
    let d = rig.d();
    let mut c1 = rig.client(1);
    rig.write_dirty(&mut c1, 11);
    let mut back = vec![0u8; WRITTEN as usize];
    c1.read(&mut back, 0).expect("read hits");
    let before = d.stats_json(1, Some(1));
    assert!(before["raw"]["read_hits"].as_u64() > Some(0));
    let uuid = core_uuid(&rig, 1);

    d.ok(&["--script", "--purge-core", "-i", "1", "-j", "1"]);
    let after = d.stats_json(1, Some(1));
    assert_eq!(kept_counters(&after), kept_counters(&before));
    assert_eq!(rig.lines(Some(1)), (0, 0), "core 1 holds nothing");
    assert_eq!(
        core_uuid(&rig, 1),
        uuid,
        "the core was removed and added again"
    );
    assert_reads_back(&mut c1, 11, "read after the purge");
}

#[test]
fn purge_cache_keeps_its_statistics_and_its_metadata() {
    let rig = Rig::new(2);
    let d = rig.d();
    let mut c1 = rig.client(1);
    let mut c2 = rig.client(2);
    rig.write_dirty(&mut c1, 12);
    rig.write_dirty(&mut c2, 13);
    let mut back = vec![0u8; WRITTEN as usize];
    c1.read(&mut back, 0).expect("read hits");
    let before = (d.stats_json(1, None), d.stats_json(1, Some(2)));
    let sb = superblock(&rig);

    d.ok(&["--script", "--purge-cache", "-i", "1"]);
    let after = (d.stats_json(1, None), d.stats_json(1, Some(2)));
    assert_eq!(kept_counters(&after.0), kept_counters(&before.0));
    assert_eq!(kept_counters(&after.1), kept_counters(&before.1));
    assert_eq!(rig.lines(None), (0, 0), "the cache holds nothing");
    let now = superblock(&rig);
    assert_eq!(now.uuid, sb.uuid, "the cache was started anew");
    assert_eq!(now.cores, sb.cores, "the cores were added anew");
    assert_reads_back(&mut c1, 12, "read after the purge");
    assert_reads_back(&mut c2, 13, "read after the purge");
}

/// A core on RAM keeps its device through a purge (the last pass removed and re-added the
/// core, which would have dropped it, and so refused).
#[test]
fn purge_of_a_ram_core_keeps_its_data() {
    let dir = workdir();
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", "ram:16M", "-c", "wb"]);
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    d.ok(&["-A", "-i", "1", "-d", "ram:32M"]);
    let mut c = Client::connect_unix(&d.nbd, "cas1-1").expect("NBD connection");
    let data = pattern(14, MIB as usize);
    c.write(&data, 0, false).expect("write");
    d.ok(&["--script", "--purge-core", "-i", "1", "-j", "1"]);
    d.ok(&["--script", "--purge-cache", "-i", "1"]);
    let s = d.stats_json(1, None);
    assert_eq!(s["raw"]["occupancy_lines"], 0);
    let mut back = vec![0u8; MIB as usize];
    c.read(&mut back, 0).expect("read after the purges");
    assert_eq!(back, data);
}

/// casadm master's `--promotion-threshold` (cas_main.c: "Sequence detector stream promotion
/// threshold [KiB]", 0..4194181): as in OCF's ocf_seq_detect.c (`ocf_seq_detect_should_promote`),
/// a stream is promoted, and so can be cut off, once it has moved that many bytes even when it
/// has fewer requests than the promotion count; 0 leaves the count alone.
#[test]
fn seq_detect_promotion_threshold_promotes_a_stream_by_its_bytes() {
    let rig = Rig::new(2);
    let d = rig.d();
    for j in ["1", "2"] {
        d.ok(&[
            "-X",
            "-n",
            "seq-cutoff",
            "-i",
            "1",
            "-j",
            j,
            "-p",
            "always",
            "-t",
            "1",
        ]);
    }
    // A count no stream of this test reaches: only the byte threshold can promote.
    d.ok(&[
        "-X",
        "-n",
        "seq-detect",
        "-i",
        "1",
        "--promotion-count",
        "65535",
    ]);
    d.ok(&[
        "-X",
        "-n",
        "seq-detect",
        "-i",
        "1",
        "-j",
        "1",
        "--promotion-threshold",
        "64",
    ]);
    assert_eq!(
        d.ok(&["-G", "-n", "seq-detect", "-i", "1", "-j", "1", "-o", "csv"]),
        "Parameter name,Value\nSequence detector promotion request count,65535\n\
         Sequence detector promotion threshold [KiB],64\n"
    );
    let core2 = d.ok(&["-G", "-n", "seq-detect", "-i", "1", "-j", "2", "-o", "csv"]);
    assert!(core2.ends_with("promotion threshold [KiB],0\n"), "{core2}");
    // 4 MiB read in order, 64 KiB at a time, from each core.
    let chunk = 64 * 1024;
    for j in [1u16, 2] {
        let mut c = rig.client(j);
        let mut buf = vec![0u8; chunk as usize];
        for k in 0..WRITTEN / chunk {
            c.read(&mut buf, k * chunk).expect("sequential read");
        }
    }
    // Core 1: the stream's first request is cached, the rest cut off once it reached 64 KiB.
    let (held1, _) = rig.lines(Some(1));
    assert!(held1 <= 2 * chunk / 4096, "core 1 cached {held1} lines");
    // Core 2: never promoted, everything cached.
    assert_eq!(rig.lines(Some(2)).0, WRITTEN / 4096);

    let e = d.fails(&[
        "-X",
        "-n",
        "seq-detect",
        "-i",
        "1",
        "-j",
        "1",
        "--promotion-threshold",
        "4194182",
    ]);
    assert!(e.contains("promotion-threshold"), "{e}");
    // 0 turns the byte threshold off again.
    d.ok(&[
        "-X",
        "-n",
        "seq-detect",
        "-i",
        "1",
        "-j",
        "1",
        "--promotion-threshold",
        "0",
    ]);
}

/// casadm's `--script --remove-core --detach` (cas_main.c `script_handle` -> cas_lib.c
/// `remove_core(..., detach, no_flush)`; the kernel detaches the core with OCF's
/// `ocf_mngt_cache_detach_core`): the core leaves service but stays in the cache's metadata,
/// inactive, with its lines; with `--no-flush` its dirty data stays on the cache device.
#[test]
fn remove_core_detach_keeps_the_core_in_the_metadata() {
    let rig = Rig::new(1);
    let d = rig.d();
    let core = path_str(&rig.cores[0]);
    let mut c = rig.client(1);
    rig.write_dirty(&mut c, 15);
    drop(c);
    let out = d.ok(&[
        "--script",
        "--remove-core",
        "--cache-id",
        "1",
        "--core-id",
        "1",
        "--detach",
        "--no-flush",
    ]);
    assert!(
        out.contains("core 1 of cache 1 detached")
            && out.contains("with 1,024 dirty lines (4 MiB) on the cache device"),
        "{out}"
    );
    assert!(!rig.core_has(1, 15), "--no-flush flushed");
    assert_eq!(
        rig.lines(None).1,
        WRITTEN / 4096,
        "the dirty lines are kept"
    );
    let list = d.ok(&["-L", "-o", "csv"]);
    assert!(list.contains(",Inactive,"), "{list}");
    let e = d.fails(&[
        "--script",
        "--remove-core",
        "-i",
        "1",
        "-j",
        "1",
        "--detach",
    ]);
    assert!(e.contains("it is detached already"), "{e}");
    assert!(
        Client::connect_unix(&d.nbd, "cas1-1").is_err(),
        "still exported"
    );

    // Attached again, the core serves what its dirty lines hold.
    let out = d.ok(&["-A", "-i", "1", "-j", "1", "-d", core]);
    assert!(out.contains("attached again"), "{out}");
    let mut c = rig.client(1);
    assert_reads_back(&mut c, 15, "read after the attach");

    // Without --no-flush the core gets its data first; --try-add attaches it again.
    rig.write_dirty(&mut c, 16);
    drop(c);
    let out = d.ok(&[
        "--script",
        "--remove-core",
        "-i",
        "1",
        "-j",
        "1",
        "--detach",
    ]);
    assert!(out.contains("with 0 dirty lines"), "{out}");
    assert!(rig.core_has(1, 16), "flushed before the detach");
    d.ok(&[
        "--script",
        "--add-core",
        "--try-add",
        "-i",
        "1",
        "-j",
        "1",
        "--core-device",
        core,
    ]);
    // Still the same core of the metadata: a load finds it.
    d.ok(&["-T", "-i", "1", "-n"]);
    let out = d.ok(&["-S", "-d", &rig.spec, "--load"]);
    assert!(!out.contains("inactive"), "{out}");
}

/// casadm's `--script --add-core --update-path` (the kernel's `cache_mngt_update_core_uuid`:
/// the new path must name the core's own device): the path the cache records for the core
/// changes, so a load after the old path is gone finds the core.
#[test]
fn add_core_update_path_records_the_core_s_new_path() {
    let rig = Rig::new(1);
    let d = rig.d();
    let mut c = rig.client(1);
    rig.write_dirty(&mut c, 17);
    drop(c);
    let moved = rig.dir.path().join("renamed-core.img");
    std::fs::rename(&rig.cores[0], &moved).expect("rename the core");
    let other = rig.dir.path().join("other.img");
    sparse_file(&other, 32 * MIB);
    let e = d.fails(&[
        "--script",
        "--add-core",
        "--update-path",
        "-i",
        "1",
        "-j",
        "1",
        "--core-device",
        path_str(&other),
    ]);
    assert!(e.contains("is not the device of core 1 of cache 1"), "{e}");

    let out = d.ok(&[
        "--script",
        "--add-core",
        "--update-path",
        "--cache-id",
        "1",
        "--core-id",
        "1",
        "--core-device",
        path_str(&moved),
    ]);
    assert!(
        out.contains(&format!(
            "core 1 of cache 1 is now recorded on {}",
            moved.display()
        )),
        "{out}"
    );
    assert!(d.ok(&["-L", "-o", "csv"]).contains(path_str(&moved)));
    d.ok(&["-T", "-i", "1", "-n"]);
    let out = d.ok(&["-S", "-d", &rig.spec, "--load"]);
    assert!(!out.contains("inactive"), "{out}");
    let mut c = rig.client(1);
    assert_reads_back(&mut c, 17, "read after the load");
}

/// casctl's `start` (utils/casctl `start`: `casadm -S --load` of every cache of
/// opencas.conf): the cache stopped with its dirty data is loaded with its core; a device that
/// holds no cache is reported ("Unable to load cache"), never started anew.
#[test]
fn casctl_start_loads_the_caches_of_opencas_conf() {
    let rig = Rig::new(1);
    let d = rig.d();
    let mut c = rig.client(1);
    rig.write_dirty(&mut c, 18);
    drop(c);
    d.ok(&["-T", "-i", "1", "-n"]);
    let conf = rig.dir.path().join("opencas.conf");
    std::fs::write(
        &conf,
        format!(
            "version=19.3.0\n[caches]\n1\t{}\tWB\n[cores]\n1\t1\t{}\n",
            rig.cache_file.display(),
            rig.cores[0].display()
        ),
    )
    .unwrap();
    let out = d.ok(&["casctl", "start", "--config", path_str(&conf)]);
    assert!(out.contains("cache 1 loaded from"), "{out}");
    assert_eq!(rig.lines(None).1, WRITTEN / 4096, "its dirty data loaded");
    let mut c = rig.client(1);
    assert_reads_back(&mut c, 18, "read after casctl start");
    let out = d.ok(&["casctl", "start", "--config", path_str(&conf)]);
    assert!(out.contains("cache 1 is running already"), "{out}");

    // A device without a cache is not made one.
    let empty = rig.dir.path().join("empty.img");
    sparse_file(&empty, 64 * MIB);
    let conf2 = rig.dir.path().join("other.conf");
    std::fs::write(
        &conf2,
        format!("version=19.3.0\n[caches]\n2\t{}\tWT\n", empty.display()),
    )
    .unwrap();
    let e = d.fails(&["casctl", "start", "--config", path_str(&conf2)]);
    assert!(e.contains("Unable to load cache 2"), "{e}");
    assert!(
        std::fs::read(&empty).unwrap().iter().all(|&b| b == 0),
        "a cache was created"
    );
}

/// casctl's `settle` (utils/opencas.py `wait_for_startup`): done once every device of the file
/// runs; a device not marked lazy (opencas.conf's default) still missing at the timeout fails
/// it, naming the device; a lazy one is only named.
#[test]
fn casctl_settle_waits_for_the_devices_not_marked_lazy() {
    let rig = Rig::new(1);
    let d = rig.d();
    let conf = rig.dir.path().join("opencas.conf");
    let write = |cores: &str| {
        std::fs::write(
            &conf,
            format!(
                "version=19.3.0\n[caches]\n1\t{}\tWB\n[cores]\n1\t1\t{}\n{cores}",
                rig.cache_file.display(),
                rig.cores[0].display()
            ),
        )
        .unwrap()
    };
    write("");
    let settle = [
        "casctl",
        "settle",
        "--config",
        path_str(&conf),
        "--timeout",
        "1",
        "--interval",
        "1",
    ];
    d.ok(&settle);
    let missing = rig.dir.path().join("not-there.img");
    write(&format!("1\t2\t{}\tlazy_startup=true\n", missing.display()));
    d.ok(&settle);
    write(&format!("1\t2\t{}\n", missing.display()));
    let e = d.fails(&settle);
    assert!(
        e.contains("initialization failed: couldn't initialize") && e.contains(path_str(&missing)),
        "{e}"
    );
}

/// A purge under a client's writes: the writes in flight wait for it and none is lost.
#[test]
fn purge_core_under_writes_loses_none() {
    let rig = Rig::new(1);
    let d = rig.d();
    let writer = {
        let mut c = rig.client(1);
        std::thread::spawn(move || {
            let chunk = 64 * 1024;
            for pass in 0..6u8 {
                for k in 0..(WRITTEN / chunk) {
                    let data = pattern(20 + pass, chunk as usize);
                    c.write(&data, k * chunk, false)
                        .expect("write during the purge");
                }
            }
            c.flush().expect("NBD flush");
        })
    };
    let mut purges = 0;
    while !writer.is_finished() {
        d.ok(&["--script", "--purge-core", "-i", "1", "-j", "1"]);
        d.ok(&["--script", "--purge-cache", "-i", "1"]);
        purges += 1;
    }
    writer.join().expect("the writer");
    assert!(purges > 0);
    eprintln!("purges during the writes: {purges}");
    let chunk = 64 * 1024usize;
    let mut c = rig.client(1);
    let mut back = vec![0u8; WRITTEN as usize];
    c.read(&mut back, 0).expect("read");
    for (k, got) in back.chunks(chunk).enumerate() {
        assert!(
            got == &pattern(25, chunk)[..],
            "chunk {k} is not the last pass's"
        );
    }
    d.ok(&["-F", "-i", "1"]);
    assert!(std::fs::read(&rig.cores[0]).unwrap()[..WRITTEN as usize]
        .chunks(chunk)
        .all(|got| got == &pattern(25, chunk)[..]));
}

/// A cache of the configuration file waiting for its device takes its core from the pool when
/// the device appears.
#[test]
fn a_late_cache_takes_its_core_from_the_pool() {
    let dir = workdir();
    let cache = dir.path().join("late-cache.img");
    let core = dir.path().join("core.img");
    sparse_file(&core, 32 * MIB);
    let conf = dir.path().join("hybridcache.toml");
    std::fs::write(
        &conf,
        format!(
            "[[cache]]\nid = 1\ndevice = \"{}\"\nmode = \"wb\"\n\n[[core]]\ncache = 1\nid = 1\ndevice = \"{}\"\n",
            cache.display(),
            dir.path().join("core-old-name.img").display()
        ),
    )
    .unwrap();
    let d = Daemon::start_with(dir.path(), &["--config", path_str(&conf)]);
    let out = d.ok(&[
        "--script",
        "--add-core",
        "--try-add",
        "-i",
        "1",
        "-j",
        "1",
        "--core-device",
        path_str(&core),
    ]);
    assert!(out.contains("added to the core pool"), "{out}");
    sparse_file(&cache, 64 * MIB);
    let want = format!("core,1,{},Active", core.display());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    loop {
        let rows = list_rows(&d);
        if rows.iter().any(|r| r.starts_with(&want)) {
            assert!(!rows.iter().any(|r| r.starts_with("core pool")), "{rows:?}");
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "core 1 not attached from the pool: {rows:?}\n{}",
            d.log_text()
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    assert!(d.log_text().contains("core 1 attached from the core pool"));
}

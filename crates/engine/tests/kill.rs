//! kill -9 of a real process: a child drives a write-back cache on file volumes, logging each
//! write before it issues it and each flush after it completes; the parent kills it with SIGKILL
//! at a random moment, loads the cache, and checks every sector against the log: the content as
//! of the last completed flush, or something written after it.
//!
//! The child is this test binary re-run with HC_KILL_CHILD set (the ignored test below).
//! `HC_KILL_ROUNDS` sets the number of kills (default 100).

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use hybridcache_engine::{Cache, CacheConfig, CacheMode, LineSize};
use hybridcache_volume::{FileVolume, VolumeRef};

mod durability;
use durability::{decode, fill, Model, Rng, SECTOR};

const CACHE_BYTES: u64 = (3 << 20) + (256 << 10);
const CORE_BYTES: u64 = 2 << 20;

fn open_cache(dir: &Path) -> Cache {
    let cache_path = dir.join("cache.img");
    let core_path = dir.join("core.img");
    let core: VolumeRef = Arc::new(FileVolume::open(&core_path).expect("core file"));
    let cache_vol: VolumeRef = Arc::new(FileVolume::open(&cache_path).expect("cache file"));
    match Cache::load(cache_vol.clone(), &mut |_| Some(core.clone())) {
        // A child killed between creating the cache and adding its core (a slow start on a
        // loaded machine) leaves a cache without one: nothing was written yet, so add it now.
        Ok(cache) if cache.core(1).is_err() => {
            cache.add_core(core, Some(1)).expect("add core");
            cache
        }
        Ok(cache) => cache,
        Err(hybridcache_engine::EngineError::NoCache(_)) => {
            let cache = Cache::create(
                cache_vol,
                CacheConfig {
                    id: 1,
                    line_size: LineSize::from_kib(4).unwrap(),
                    mode: CacheMode::Wb,
                },
                false,
            )
            .expect("create cache");
            cache.add_core(core, Some(1)).expect("add core");
            cache
        }
        Err(e) => panic!("load: {e}"),
    }
}

/// The child: write and flush until killed.
#[test]
#[ignore = "run by kill_9_mid_load_never_loses_flushed_writes as its child process"]
fn kill_child() {
    let Ok(dir) = std::env::var("HC_KILL_CHILD") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let first_stamp: u32 = std::env::var("HC_KILL_STAMP").unwrap().parse().unwrap();
    let mut log = OpenOptions::new()
        .append(true)
        .open(dir.join("log"))
        .unwrap();
    let cache = open_cache(&dir);
    let core = cache.core(1).unwrap();
    let mut rng = Rng(first_stamp as u64);
    let sectors = CORE_BYTES / 512;
    let mut stamp = first_stamp;
    loop {
        if rng.below(12) == 0 {
            core.flush().unwrap();
            // Only a flush that returned is a durability point.
            log.write_all(b"F end\n").unwrap();
            continue;
        }
        if rng.below(30) == 0 {
            // A different mode now and then, so cleaning and write-through paths get killed too.
            let mode = [CacheMode::Wb, CacheMode::Wt, CacheMode::Wo][rng.below(3) as usize];
            cache.set_mode(mode, false).unwrap();
        }
        let first = rng.below(sectors - 64);
        let count = 1 + rng.below(64);
        // Logged before it is issued: a write in flight at the kill may land or not.
        writeln!(log, "W {stamp} {first} {count} end").unwrap();
        let mut buf = vec![0u8; count as usize * 512];
        fill(&mut buf, stamp, first);
        core.write(&buf, first * 512).unwrap();
        stamp += 1;
    }
}

#[test]
fn kill_9_mid_load_never_loses_flushed_writes() {
    let rounds: u64 = std::env::var("HC_KILL_ROUNDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100);
    // Under the target dir: /tmp may be tmpfs, and the point is real files.
    let dir = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    FileVolume::create(&dir.path().join("cache.img"), CACHE_BYTES).unwrap();
    FileVolume::create(&dir.path().join("core.img"), CORE_BYTES).unwrap();
    std::fs::write(dir.path().join("log"), b"").unwrap();
    let sectors = (CORE_BYTES / 512) as usize;
    let mut model = Model::new(sectors);
    let mut log_pos = 0;
    let mut next_stamp = 1u32;
    let mut rng = Rng(7);
    for round in 0..rounds {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "kill_child", "--ignored", "--nocapture"])
            .env("HC_KILL_CHILD", dir.path())
            .env("HC_KILL_STAMP", next_stamp.to_string())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(20 + rng.below(100)));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();

        let log = std::fs::read_to_string(dir.path().join("log")).unwrap();
        // A record is complete only with its closing "end": the kill can cut the last one short
        // (then that write never started), and the next child's first record follows it on the
        // same line.
        for line in log[log_pos..].lines() {
            let f: Vec<&str> = line.split(' ').collect();
            match f.as_slice() {
                [.., "F", "end"] => model.flushed(),
                [.., "W", stamp, first, count, "end"] => {
                    let (stamp, first, count): (u32, u64, u64) = (
                        stamp.parse().unwrap(),
                        first.parse().unwrap(),
                        count.parse().unwrap(),
                    );
                    model.write(first, count, stamp);
                    next_stamp = next_stamp.max(stamp + 1);
                }
                _ => {}
            }
        }
        log_pos = log.len();

        let cache = open_cache(dir.path());
        cache.check_invariants();
        let mut buf = vec![0u8; CORE_BYTES as usize];
        cache.core(1).unwrap().read(&mut buf, 0).unwrap();
        for (i, s) in buf.chunks(SECTOR).enumerate() {
            let got = decode(s, i as u64);
            assert!(
                got.is_some_and(|stamp| model.allowed(i, stamp)),
                "round {round}: sector {i} holds {got:?}; allowed: durable {} or written since {:?}",
                model.durable[i],
                model.since[i]
            );
            model.latest[i] = got.unwrap_or(0);
        }
        // What was read is now the durable content.
        model.flushed();
        if round % 2 == 0 {
            cache.stop(false).unwrap();
        }
    }
    println!("{rounds} kills, {} writes", next_stamp - 1);
}

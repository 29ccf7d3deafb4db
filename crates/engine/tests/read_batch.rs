//! Batched reads (`Core::read_batch`): each request of a batch reads what a single read would,
//! whatever mix of hits, misses, partial hits, repeated ranges and errors the batch holds, in
//! every mode; statistics count each request as a single read would; and batches on several
//! threads racing writers never deadlock and never read torn data.

mod common;

use std::sync::Arc;
use std::time::Duration;

use common::*;
use hybridcache_engine::{CacheMode, LineSize};
use hybridcache_volume::SplitMix64 as Rng;

const CORE: u64 = 4 << 20;

/// Random requests: sector-aligned, 1..=64 sectors, some repeated inside a batch.
fn requests(rng: &mut Rng, n: usize, limit: u64) -> Vec<(u64, usize)> {
    let mut out: Vec<(u64, usize)> = Vec::with_capacity(n);
    for _ in 0..n {
        if !out.is_empty() && rng.next_u64() % 8 == 0 {
            let again = out[(rng.next_u64() % out.len() as u64) as usize];
            out.push(again);
            continue;
        }
        let sectors = 1 + rng.next_u64() % 64;
        let first = rng.next_u64() % (limit / SECTOR - sectors);
        out.push((first * SECTOR, (sectors * SECTOR) as usize));
    }
    out
}

#[test]
fn a_batch_reads_what_single_reads_read_in_every_mode() {
    let seed = seed(0x5eed_ba7c);
    eprintln!("seed {seed}");
    for (m, mode) in CacheMode::ALL.into_iter().enumerate() {
        for line_kib in [4u32, 64] {
            let mut rng = Rng(seed ^ (m as u64) << 8 ^ line_kib as u64);
            let lines = (1 << 20) / LineSize::from_kib(line_kib).unwrap().bytes() as u64;
            let (cache, _vol) = new_cache(line_kib, lines, mode);
            let c = add_core(&cache, CORE);
            let mut model = vec![0u8; CORE as usize];
            for round in 0..20u64 {
                for (off, len) in requests(&mut rng, 8, CORE) {
                    let data = stamped(len as u64, round << 16 | off, off / SECTOR);
                    c.core.write(&data, off).unwrap();
                    model[off as usize..off as usize + len].copy_from_slice(&data);
                }
                let n = 1 + (rng.next_u64() % 40) as usize;
                let reqs = requests(&mut rng, n, CORE);
                let mut bufs: Vec<Vec<u8>> = reqs.iter().map(|&(_, len)| vec![0xEE; len]).collect();
                let mut batch: Vec<(&mut [u8], u64)> = bufs
                    .iter_mut()
                    .zip(&reqs)
                    .map(|(b, &(off, _))| (&mut b[..], off))
                    .collect();
                let before = cache.core_stats(c.id).unwrap().requests;
                let results = c.core.read_batch(&mut batch);
                assert_eq!(results.len(), reqs.len());
                for (i, ((r, b), &(off, len))) in results.iter().zip(&bufs).zip(&reqs).enumerate() {
                    assert!(
                        r.is_ok(),
                        "{mode:?} {line_kib}K round {round} request {i}: {r:?}"
                    );
                    if let Some(d) =
                        first_difference(&model[off as usize..off as usize + len], b, off / SECTOR)
                    {
                        panic!(
                            "{mode:?} {line_kib}K round {round} request {i} at {off}+{len}: {d}"
                        );
                    }
                }
                let after = cache.core_stats(c.id).unwrap().requests;
                let reads = |s: &hybridcache_engine::RequestStats| {
                    s.read_hits + s.read_partial_misses + s.read_full_misses + s.pass_through_reads
                };
                assert_eq!(
                    reads(&after) - reads(&before),
                    reqs.len() as u64,
                    "{mode:?}: each request counted once"
                );
            }
            cache.check_invariants();
        }
    }
}

#[test]
fn a_bad_request_fails_alone() {
    let (cache, _vol) = new_cache(4, 256, CacheMode::Wb);
    let c = add_core(&cache, CORE);
    let data = stamped(8192, 7, 0);
    c.core.write(&data, 0).unwrap();
    let mut a = vec![0u8; 4096];
    let mut b = vec![0u8; 4096];
    let mut d = vec![0u8; 4096];
    let mut batch: Vec<(&mut [u8], u64)> = vec![(&mut a, 0), (&mut b, CORE), (&mut d, 4096)];
    let results = c.core.read_batch(&mut batch);
    assert!(results[0].is_ok() && results[2].is_ok(), "{results:?}");
    assert!(results[1].is_err(), "beyond the core's end: {results:?}");
    assert_eq!(a, data[..4096]);
    assert_eq!(d, data[4096..]);
}

/// Batches of overlapping requests on several threads, racing writers on the same lines: every
/// request must read whole sectors of one write or another (never torn, never another address's
/// data), and nothing may deadlock (the watchdog aborts after 60 s).
#[test]
fn batches_race_writers_without_deadlock_or_torn_sectors() {
    let _dog = Watchdog::new("read batches racing writers", Duration::from_secs(60));
    let (cache, _vol) = new_cache(4, 64, CacheMode::Wb);
    let c = add_core(&cache, 256 << 10);
    let core = Arc::new(c.core);
    let mut threads = Vec::new();
    for t in 0..4u64 {
        let core = core.clone();
        threads.push(std::thread::spawn(move || {
            let mut rng = Rng(0xabc + t);
            for i in 0..400u64 {
                if t % 2 == 0 {
                    let sectors = 1 + rng.next_u64() % 16;
                    let first = rng.next_u64() % (512 - sectors);
                    let data = stamped(sectors * SECTOR, t << 32 | i, first);
                    core.write(&data, first * SECTOR).unwrap();
                } else {
                    let reqs = requests(&mut rng, 16, 256 << 10);
                    let mut bufs: Vec<Vec<u8>> =
                        reqs.iter().map(|&(_, len)| vec![0; len]).collect();
                    let mut batch: Vec<(&mut [u8], u64)> = bufs
                        .iter_mut()
                        .zip(&reqs)
                        .map(|(b, &(off, _))| (&mut b[..], off))
                        .collect();
                    for r in core.read_batch(&mut batch) {
                        r.unwrap();
                    }
                    for (b, &(off, _)) in bufs.iter().zip(&reqs) {
                        for (k, s) in b.chunks(SECTOR as usize).enumerate() {
                            match decode(s) {
                                Content::Zero => {}
                                Content::Stamp { sector, .. } => {
                                    assert_eq!(sector, off / SECTOR + k as u64, "another address")
                                }
                                other => panic!("torn or garbage sector: {other:?}"),
                            }
                        }
                    }
                }
            }
        }));
    }
    for t in threads {
        t.join().unwrap();
    }
}

//! A quick end-to-end pass through every mode on a tiny cache: the first thing to break.

use std::sync::Arc;

use hybridcache_engine::{Cache, CacheConfig, CacheMode, LineSize};
use hybridcache_volume::{RamVolume, Volume};

#[test]
fn every_mode_reads_back_what_was_written_through_eviction() {
    for kib in LineSize::ALL_KIB {
        for mode in CacheMode::ALL {
            let line = kib as u64 * 1024;
            let cache_vol = Arc::new(RamVolume::new("cache", 8 * line).unwrap());
            let core_vol = Arc::new(RamVolume::new("core", 64 * line + 3 * 512).unwrap());
            let cache = Cache::new(
                cache_vol,
                CacheConfig {
                    id: 1,
                    line_size: LineSize::from_kib(kib).unwrap(),
                    mode,
                },
            )
            .unwrap();
            let id = cache.add_core(core_vol.clone(), None).unwrap();
            let core = cache.core(id).unwrap();
            let size = core.size();
            let mut model = vec![0u8; size as usize];
            let mut x = 1u64;
            for i in 0..400u64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let off = (x % (size / 512)) * 512;
                let len = (((x >> 20) % 40 + 1) * 512).min(size - off);
                let o = off as usize;
                let l = len as usize;
                match i % 4 {
                    0 | 1 => {
                        let data: Vec<u8> = (0..l).map(|b| (i as u8) ^ (b / 512) as u8).collect();
                        core.write(&data, off).unwrap();
                        model[o..o + l].copy_from_slice(&data);
                    }
                    2 => {
                        let mut buf = vec![0u8; l];
                        core.read(&mut buf, off).unwrap();
                        assert!(
                            buf == model[o..o + l],
                            "{kib}K {mode} op {i} read at {off}+{len}"
                        );
                    }
                    _ => {
                        if x % 3 == 0 {
                            core.discard(off, len).unwrap();
                            model[o..o + l].fill(0);
                        } else {
                            core.write_zeroes(off, len).unwrap();
                            model[o..o + l].fill(0);
                        }
                    }
                }
                if i % 97 == 0 {
                    let next = CacheMode::ALL[(x % 6) as usize];
                    cache.set_mode(next, x % 2 == 0).unwrap();
                }
            }
            cache.check_invariants();
            cache.flush().unwrap();
            assert_eq!(cache.stats().usage.dirty_lines, 0);
            let mut on_core = vec![0u8; size as usize];
            core_vol.read_at(&mut on_core, 0).unwrap();
            assert!(
                on_core == model,
                "{kib}K {mode}: core differs from model after flush"
            );
            cache.check_invariants();
        }
    }
}

//! RAM for metadata stays at or below 24 bytes per 4 KiB cache line (perf.md §1; Open CAS
//! needs about 53, OCF in user space 59-78, dm-cache's smq about 25). Measured from the sizes
//! of the structures a cache allocates (`Cache::metadata_bytes`), persistent and volatile.

use std::sync::Arc;

use hybridcache_engine::{Cache, CacheConfig, CacheMode, LineSize};
use hybridcache_volume::{RamVolume, VolumeRef};

#[test]
fn metadata_takes_at_most_24_bytes_per_4k_line() {
    for persistent in [true, false] {
        // 1 GiB of anonymous memory that is never touched beyond the metadata.
        let vol: VolumeRef = Arc::new(RamVolume::new("cache", 1 << 30).unwrap());
        let config = CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        };
        let cache = if persistent {
            Cache::create(vol, config, true).unwrap()
        } else {
            Cache::new(vol, config).unwrap()
        };
        let per_line = cache.metadata_bytes() as f64 / cache.line_count() as f64;
        assert!(
            per_line <= 24.0,
            "{} cache: {per_line:.2} bytes of RAM per 4 KiB line (budget 24)",
            if persistent { "persistent" } else { "volatile" }
        );
        // The measure itself must count the big per-line arrays (keys, links, masks).
        assert!(
            per_line >= 20.0,
            "metadata_bytes misses structures: {per_line:.2}"
        );
    }
}

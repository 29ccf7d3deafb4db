//! The cores' registry (core_state.rs `Cores`) against the commit: adding a core writes the
//! superblock, which waits for the commit under way, and that commit looks the cores up to
//! flush them. Neither may wait for the other.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use common::{as_ref, ram};
use hybridcache_engine::{Cache, CacheConfig, CacheMode, LineSize};
use hybridcache_volume::{RamVolume, Result, Volume, VolumeRef};

/// A cache volume whose flushes wait while the gate is closed.
struct GatedVolume {
    inner: Arc<RamVolume>,
    closed: AtomicBool,
    /// Flushes waiting at the gate now.
    waiting: AtomicUsize,
}

impl Volume for GatedVolume {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> Result<()> {
        self.waiting.fetch_add(1, Ordering::SeqCst);
        while self.closed.load(Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(1));
        }
        self.waiting.fetch_sub(1, Ordering::SeqCst);
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.discard(offset, len)
    }
}

/// A core added while a commit waits for the cache device's flush: the add waits for the
/// commit (its superblock write), the commit then flushes the cores. Both must finish.
#[test]
fn adding_a_core_during_a_commit_finishes_both() {
    let vol = Arc::new(GatedVolume {
        inner: ram("ram:cache", 64 << 20),
        closed: AtomicBool::new(false),
        waiting: AtomicUsize::new(0),
    });
    let config = CacheConfig {
        id: 1,
        line_size: LineSize::from_kib(4).expect("line size"),
        mode: CacheMode::Wb,
    };
    let cache = Arc::new(Cache::create(vol.clone() as VolumeRef, config, true).expect("create"));
    cache.stop_background_cleaner();
    let id = cache
        .add_core(as_ref(&ram("ram:core1", 16 << 20)), None)
        .expect("add core");
    let core = cache.core(id).expect("core");
    core.write(&[7u8; 4096], 0).expect("write");

    vol.closed.store(true, Ordering::SeqCst);
    let (done, finished) = mpsc::channel();
    let flushing = done.clone();
    std::thread::spawn(move || {
        let r = core.flush();
        let _ = flushing.send(("the commit (core flush)", r.map(|_| ())));
    });
    // The commit holds persistence's lock while the cache device flushes.
    while vol.waiting.load(Ordering::SeqCst) == 0 {
        std::thread::sleep(Duration::from_millis(1));
    }
    let adder = cache.clone();
    std::thread::spawn(move || {
        let r = adder.add_core(as_ref(&ram("ram:core2", 16 << 20)), None);
        let _ = done.send(("the core's add", r.map(|_| ())));
    });
    // Time for the add to reach the superblock write, which waits for the commit.
    std::thread::sleep(Duration::from_millis(300));
    vol.closed.store(false, Ordering::SeqCst);
    for _ in 0..2 {
        match finished.recv_timeout(Duration::from_secs(10)) {
            Ok((what, r)) => r.unwrap_or_else(|e| panic!("{what} failed: {e}")),
            Err(_) => panic!(
                "the core's add and the commit wait for each other (no end after 10 s): the \
                 add holds the cores' registry while it waits for the commit, which waits for \
                 the registry to flush the cores"
            ),
        }
    }
    assert_eq!(cache.cores().len(), 2);
}

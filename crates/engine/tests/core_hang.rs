//! A core that hangs (its device flush or write never returns) does not hold up the other
//! cores: commits and flushes give up on it after the core flush timeout, report it on that
//! core, keep its lines dirty, and make the other cores' data clean and durable. Once the
//! device returns, the hung core flushes again.

use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hybridcache_engine::{Cache, CacheConfig, CacheMode, EngineError, LineSize};
use hybridcache_volume::{RamVolume, Result, Volume, VolumeRef};
use parking_lot::{Condvar, Mutex};

/// A core whose flushes (or writes) wait while its gate is closed, like a device stuck in the
/// kernel or a stopped NBD server.
struct Hang {
    inner: VolumeRef,
    hang_writes: bool,
    closed: Mutex<bool>,
    cv: Condvar,
}

impl Hang {
    fn new(hang_writes: bool) -> Arc<Hang> {
        Arc::new(Hang {
            inner: Arc::new(RamVolume::new("hung", 1 << 20).unwrap()),
            hang_writes,
            closed: Mutex::new(false),
            cv: Condvar::new(),
        })
    }
    fn set_closed(&self, closed: bool) {
        *self.closed.lock() = closed;
        self.cv.notify_all();
    }
    fn pass(&self) {
        let mut c = self.closed.lock();
        while *c {
            self.cv.wait(&mut c);
        }
    }
}

impl Volume for Hang {
    fn name(&self) -> &str {
        "hung core"
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        if self.hang_writes {
            self.pass();
        }
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> Result<()> {
        if !self.hang_writes {
            self.pass();
        }
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.discard(offset, len)
    }
}

fn rig(hung: Arc<Hang>) -> (Cache, Arc<RamVolume>) {
    let cache = Cache::create(
        Arc::new(RamVolume::new("cache", (3 << 20) + 128 * 4096).unwrap()),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        },
        false,
    )
    .unwrap();
    cache.stop_background_cleaner();
    let other = Arc::new(RamVolume::new("other", 1 << 20).unwrap());
    cache.add_core(hung, Some(1)).unwrap();
    cache.add_core(other.clone(), Some(2)).unwrap();
    for core in [1, 2] {
        cache
            .core(core)
            .unwrap()
            .write(&[0x5a; 64 << 10], 0)
            .unwrap();
    }
    (cache, other)
}

/// Run `f` on its own thread; None if it has not returned within `limit` (the test then fails
/// instead of hanging).
fn within<T: Send + 'static>(limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> Option<T> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    rx.recv_timeout(limit).ok()
}

fn dirty(cache: &Cache, core: u16) -> u64 {
    cache.core_stats(core).unwrap().usage.dirty_lines
}

#[test]
fn a_hung_device_flush_times_out_on_its_core_only() {
    hybridcache_engine::set_core_flush_timeout(Duration::from_millis(300));
    let hung = Hang::new(false);
    let (cache, other) = rig(hung.clone());
    hung.set_closed(true);

    // Core 1's writes go through, its device flush hangs: reported on core 1, in bounded time.
    let c = cache.clone();
    let started = Instant::now();
    let r = within(Duration::from_secs(20), move || c.flush_core(1))
        .expect("flush of the hung core did not return");
    let e = r.expect_err("a flush that did not complete cannot succeed");
    assert!(
        matches!(e, EngineError::CoreFlushTimedOut { core: 1, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("timed out after 300 ms"), "{e}");
    assert!(started.elapsed() < Duration::from_secs(10));
    // (Its lines were written to it, so they count clean in memory; the commits record them
    // dirty on the cache device while the core is failing: persist.rs, snapshot_entry.)

    // Core 2 flushes while core 1's device flush is still stuck.
    let c = cache.clone();
    within(Duration::from_secs(20), move || c.flush_core(2))
        .expect("flush of core 2 did not return")
        .expect("core 2 flushes");
    assert_eq!(dirty(&cache, 2), 0);
    let mut buf = vec![0u8; 64 << 10];
    other.read_at(&mut buf, 0).unwrap();
    assert!(buf.iter().all(|&b| b == 0x5a), "core 2 holds its data");

    // Every core: per-core results.
    cache.core(2).unwrap().write(&[0x77; 4096], 0).unwrap();
    let c = cache.clone();
    let e = within(Duration::from_secs(20), move || c.flush())
        .expect("flush of every core did not return")
        .expect_err("core 1 is still hung");
    let text = e.to_string();
    assert!(
        text.starts_with("core 1: flush timed out") && text.ends_with("; core 2 flushed"),
        "{text}"
    );
    assert_eq!(dirty(&cache, 2), 0);

    // The device returns: core 1 flushes again (its stuck flush returns first).
    hung.set_closed(false);
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match cache.flush_core(1) {
            Ok(()) => break,
            Err(e) => assert!(Instant::now() < deadline, "core 1 never flushed again: {e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(dirty(&cache, 1), 0);
    cache.stop(true).unwrap();
}

#[test]
fn a_hung_device_write_times_out_on_its_core_only() {
    hybridcache_engine::set_core_flush_timeout(Duration::from_millis(300));
    let hung = Hang::new(true);
    let (cache, _other) = rig(hung.clone());
    hung.set_closed(true);

    let c = cache.clone();
    let e = within(Duration::from_secs(20), move || c.flush())
        .expect("flush of every core did not return")
        .expect_err("core 1 is hung");
    let text = e.to_string();
    assert!(
        text.contains(
            "core 1: flush timed out after 300 ms (its device completed no write or flush)"
        ) && text.ends_with("; core 2 flushed"),
        "{text}"
    );
    assert_eq!(dirty(&cache, 2), 0);
    assert!(dirty(&cache, 1) > 0);

    hung.set_closed(false);
    let deadline = Instant::now() + Duration::from_secs(20);
    while let Err(e) = cache.flush_core(1) {
        assert!(Instant::now() < deadline, "core 1 never flushed again: {e}");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(dirty(&cache, 1), 0);
}

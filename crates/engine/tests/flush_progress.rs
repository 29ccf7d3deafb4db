//! Flush progress and interruption: a running flush reports how many of its dirty lines it has
//! written, and an interrupted flush stops once its core writes in flight complete, with
//! everything consistent (cleaned lines clean, the rest still dirty, every sector reading what
//! was written) and the count of the lines it cleaned.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hybridcache_engine::{Cache, CacheConfig, CacheMode, EngineError, LineSize};
use hybridcache_volume::{RamVolume, Result, Volume, VolumeRef};
use parking_lot::{Condvar, Mutex};

/// A core whose writes wait while the gate is closed, so a test can hold a flush mid-batch.
struct Gate {
    inner: VolumeRef,
    /// (closed, writers waiting)
    state: Mutex<(bool, usize)>,
    cv: Condvar,
}

impl Gate {
    fn set_closed(&self, closed: bool) {
        self.state.lock().0 = closed;
        self.cv.notify_all();
    }

    fn wait_for_blocked_writer(&self) {
        let deadline = Instant::now() + Duration::from_secs(30);
        let mut s = self.state.lock();
        while s.1 == 0 {
            assert!(Instant::now() < deadline, "no core write arrived");
            self.cv.wait_for(&mut s, Duration::from_millis(50));
        }
    }
}

impl Volume for Gate {
    fn name(&self) -> &str {
        "gated core"
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let mut s = self.state.lock();
        while s.0 {
            s.1 += 1;
            self.cv.notify_all();
            self.cv.wait(&mut s);
            s.1 -= 1;
        }
        drop(s);
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.discard(offset, len)
    }
}

#[test]
fn flush_reports_progress_and_stops_cleanly_when_interrupted() {
    const LINE: u64 = 4096;
    // Three flush batches' worth of dirty lines (a flush cleans 4096 lines per batch).
    const LINES: u64 = 3 * 4096;
    let gate = Arc::new(Gate {
        inner: Arc::new(RamVolume::new("core", 2 * LINES * LINE).unwrap()),
        state: Mutex::new((false, 0)),
        cv: Condvar::new(),
    });
    let cache = Cache::new(
        Arc::new(RamVolume::new("cache", (LINES + 1024) * LINE).unwrap()),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        },
    )
    .unwrap();
    let id = cache.add_core(gate.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    // Every other line, so lines are not neighbours on the core.
    let block = |i: u64| vec![(i % 251) as u8 + 1; LINE as usize];
    for i in 0..LINES {
        core.write(&block(i), 2 * i * LINE).unwrap();
    }
    assert_eq!(cache.stats().usage.dirty_lines, LINES);
    assert!(cache.flush_status().is_none());
    assert!(!cache.interrupt_flush(), "nothing to interrupt");

    gate.set_closed(true);
    let flusher = {
        let cache = cache.clone();
        std::thread::spawn(move || cache.flush())
    };
    gate.wait_for_blocked_writer();
    let s = cache.flush_status().expect("a flush is running");
    assert_eq!(
        (s.total_lines, s.done_lines, s.cleaned_lines),
        (LINES, 0, 0)
    );
    assert_eq!(s.percent(), 0.0);
    assert!(s.mode_change.is_none());

    // Interrupted during its first batch: the core writes in flight (one per cleaning thread at
    // most, 32) complete and count, no other write starts, and the error says how many lines
    // were cleaned: exactly the lines no longer dirty.
    assert!(cache.interrupt_flush());
    gate.set_closed(false);
    let result = flusher.join().unwrap();
    let Err(EngineError::FlushInterrupted {
        cleaned_lines,
        total_lines,
    }) = result
    else {
        panic!("{result:?}");
    };
    assert!(cache.flush_status().is_none());
    assert_eq!(total_lines, LINES);
    assert!((1..=32).contains(&cleaned_lines), "{cleaned_lines}");
    assert_eq!(cache.stats().usage.dirty_lines, LINES - cleaned_lines);
    cache.check_invariants();
    let mut buf = vec![0u8; LINE as usize];
    for i in 0..LINES {
        core.read(&mut buf, 2 * i * LINE).unwrap();
        assert_eq!(buf, block(i), "line {i} after the interrupted flush");
    }

    // The interruption applied to that flush only: the next one finishes.
    cache.flush().unwrap();
    assert_eq!(cache.stats().usage.dirty_lines, 0);
    for i in 0..LINES {
        gate.inner.read_at(&mut buf, 2 * i * LINE).unwrap();
        assert_eq!(buf, block(i), "line {i} on the core");
    }
}

#[test]
fn a_mode_switch_that_flushes_shows_the_change() {
    let gate = Arc::new(Gate {
        inner: Arc::new(RamVolume::new("core", 64 << 20).unwrap()),
        state: Mutex::new((false, 0)),
        cv: Condvar::new(),
    });
    let cache = Cache::new(
        Arc::new(RamVolume::new("cache", 32 << 20).unwrap()),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        },
    )
    .unwrap();
    let id = cache.add_core(gate.clone(), None).unwrap();
    let core = cache.core(id).unwrap();
    core.write(&vec![9u8; 1 << 20], 0).unwrap();
    gate.set_closed(true);
    let switcher = {
        let cache = cache.clone();
        std::thread::spawn(move || cache.set_mode(CacheMode::Wt, true))
    };
    gate.wait_for_blocked_writer();
    let s = cache.flush_status().expect("flushing");
    assert_eq!(s.mode_change, Some((CacheMode::Wb, CacheMode::Wt)));
    assert_eq!(s.total_lines, 256);
    gate.set_closed(false);
    switcher.join().unwrap().unwrap();
    assert!(cache.flush_status().is_none());
    assert_eq!(cache.stats().usage.dirty_lines, 0);
}

#[test]
fn dirty_for_counts_from_the_first_dirty_line_until_clean() {
    let cache = Cache::new(
        Arc::new(RamVolume::new("cache", 8 << 20).unwrap()),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        },
    )
    .unwrap();
    let id = cache
        .add_core(Arc::new(RamVolume::new("core", 64 << 20).unwrap()), None)
        .unwrap();
    let core = cache.core(id).unwrap();
    assert_eq!(cache.dirty_for(None), None);
    core.write(&[1u8; 4096], 0).unwrap();
    std::thread::sleep(Duration::from_millis(30));
    // A second dirty line does not restart the clock.
    core.write(&[2u8; 4096], 8192).unwrap();
    let d = cache.dirty_for(None).expect("dirty");
    assert!(d >= Duration::from_millis(30), "{d:?}");
    assert!(cache.dirty_for(Some(id)).expect("core dirty") >= d);
    cache.flush().unwrap();
    assert_eq!(cache.dirty_for(None), None);
    assert_eq!(cache.dirty_for(Some(id)), None);
    // Dirty again: the clock starts over (at most the time since the write began, plus the
    // clock's millisecond rounding).
    let again = Instant::now();
    core.write(&[3u8; 4096], 0).unwrap();
    let d2 = cache.dirty_for(None).expect("dirty again");
    assert!(d2 <= again.elapsed() + Duration::from_millis(1), "{d2:?}");
}

/// A core whose every write takes `delay`.
struct SlowCore {
    inner: VolumeRef,
    delay: Duration,
}

impl Volume for SlowCore {
    fn name(&self) -> &str {
        "slow core"
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        std::thread::sleep(self.delay);
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.discard(offset, len)
    }
}

/// Issue 30 case 8: within one batch (here the whole flush is one batch of 2,048 lines), the
/// count moves as core writes complete; it used to stay at 0 until the batch was done.
#[test]
fn progress_moves_within_a_batch() {
    const LINE: u64 = 4096;
    const LINES: u64 = 2048;
    let cache = Cache::new(
        Arc::new(RamVolume::new("cache", (LINES + 1024) * LINE).unwrap()),
        CacheConfig {
            id: 1,
            line_size: LineSize::from_kib(4).unwrap(),
            mode: CacheMode::Wb,
        },
    )
    .unwrap();
    let id = cache
        .add_core(
            Arc::new(SlowCore {
                inner: Arc::new(RamVolume::new("core", 2 * LINES * LINE).unwrap()),
                delay: Duration::from_millis(10),
            }),
            None,
        )
        .unwrap();
    let core = cache.core(id).unwrap();
    // Every other line, so each line is a core write of its own.
    for i in 0..LINES {
        core.write(&[1u8; LINE as usize], 2 * i * LINE).unwrap();
    }
    let flusher = {
        let cache = cache.clone();
        std::thread::spawn(move || cache.flush())
    };
    let mut seen = Vec::new();
    while !flusher.is_finished() {
        if let Some(s) = cache.flush_status() {
            assert_eq!(s.total_lines, LINES);
            assert_eq!(s.done_lines, s.cleaned_lines, "nothing else cleans");
            if s.done_lines > 0 && s.done_lines < LINES && seen.last() != Some(&s.done_lines) {
                seen.push(s.done_lines);
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    flusher.join().unwrap().unwrap();
    // 2,048 writes of 10 ms, 32 at a time: about 0.64 s, sampled every 5 ms.
    assert!(seen.len() >= 3, "{seen:?}");
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "{seen:?}");
    assert_eq!(cache.stats().usage.dirty_lines, 0);
}

//! A core volume that records what reaches it: every write's (offset, length) in arrival order,
//! and the most writes it had in flight at once. An optional delay per write keeps writes in
//! flight long enough for concurrency to be observable.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hybridcache_volume::{Result, Volume, VolumeRef};

pub struct RecordingVolume {
    inner: VolumeRef,
    name: String,
    writes: Mutex<Vec<(u64, u64)>>,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    delay_us: AtomicU64,
}

impl RecordingVolume {
    pub fn new(inner: VolumeRef) -> Arc<RecordingVolume> {
        Arc::new(RecordingVolume {
            name: format!("rec({})", inner.name()),
            inner,
            writes: Mutex::new(Vec::new()),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
            delay_us: AtomicU64::new(0),
        })
    }

    /// Every later write takes at least `d` (the data is written first, then the writer sleeps).
    pub fn set_delay(&self, d: Duration) {
        self.delay_us.store(d.as_micros() as u64, SeqCst);
    }

    /// The writes recorded since the last take, in arrival order; forgets them.
    pub fn take_writes(&self) -> Vec<(u64, u64)> {
        std::mem::take(&mut *self.writes.lock().unwrap())
    }

    /// Most writes in flight at once since the last reset.
    pub fn max_in_flight(&self) -> usize {
        self.max_in_flight.load(SeqCst)
    }

    pub fn reset_max_in_flight(&self) {
        self.max_in_flight.store(0, SeqCst);
    }
}

impl Volume for RecordingVolume {
    fn name(&self) -> &str {
        &self.name
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let now = self.in_flight.fetch_add(1, SeqCst) + 1;
        self.max_in_flight.fetch_max(now, SeqCst);
        self.writes.lock().unwrap().push((offset, buf.len() as u64));
        let result = self.inner.write_at(buf, offset);
        let delay = self.delay_us.load(SeqCst);
        if delay > 0 {
            std::thread::sleep(Duration::from_micros(delay));
        }
        self.in_flight.fetch_sub(1, SeqCst);
        result
    }
    fn flush(&self) -> Result<()> {
        self.inner.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.discard(offset, len)
    }
    fn discard_zeroes(&self) -> bool {
        self.inner.discard_zeroes()
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        self.inner.write_zeroes(offset, len)
    }
}

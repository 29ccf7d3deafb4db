//! [`ThrottledVolume`]: another volume seen through a fixed latency, an IOPS cap and a bandwidth
//! cap, for standing in for a slow device (a network disk, a cheap SSD) in benchmarks.
//!
//! The model is a pipe: requests are admitted at most `iops` per second, their data passes a link
//! of `bandwidth` bytes per second one request after another, and each completes `latency` after
//! its transfer. Requests from several threads overlap in the latency, so throughput grows with
//! the number of requests in flight until a cap is reached, as on a real device. The data itself
//! goes to the inner volume immediately; the caller then sleeps until the modelled completion.

use std::fmt;
use std::time::Duration;

use parking_lot::Mutex;

use super::clock::{nanos, ClockRef, Nanos, RealClock};
use crate::{Result, Volume, VolumeRef};

/// Limits of a [`ThrottledVolume`]. `None` means no cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ThrottleConfig {
    /// Added to every request, including flushes and discards.
    pub latency: Duration,
    /// Requests per second (reads, writes, discards, write-zeroes and flushes all count).
    pub iops: Option<u64>,
    /// Bytes per second moved by reads and writes.
    pub bandwidth: Option<u64>,
}

#[derive(Default)]
struct Pipe {
    /// Earliest admission of the next request under the IOPS cap.
    next_admit: Nanos,
    /// When the link has finished the transfers admitted so far.
    link_free: Nanos,
}

/// A volume slowed down by a [`ThrottleConfig`]; see the module documentation.
pub struct ThrottledVolume {
    inner: VolumeRef,
    config: ThrottleConfig,
    clock: ClockRef,
    name: String,
    pipe: Mutex<Pipe>,
}

impl ThrottledVolume {
    /// Throttle `inner` on the real clock.
    pub fn new(inner: VolumeRef, config: ThrottleConfig) -> ThrottledVolume {
        Self::with_clock(inner, config, RealClock::shared())
    }

    /// Throttle `inner` on the given clock (a [`VirtualClock`](super::VirtualClock) in tests).
    pub fn with_clock(
        inner: VolumeRef,
        config: ThrottleConfig,
        clock: ClockRef,
    ) -> ThrottledVolume {
        let name = format!("throttle({})", inner.name());
        ThrottledVolume {
            inner,
            config,
            clock,
            name,
            pipe: Mutex::new(Pipe::default()),
        }
    }

    /// Rename (the URI parser names the volume by its spec).
    pub fn named(mut self, name: &str) -> ThrottledVolume {
        self.name = name.to_string();
        self
    }

    pub fn config(&self) -> ThrottleConfig {
        self.config
    }

    pub fn inner(&self) -> &VolumeRef {
        &self.inner
    }

    /// Reserve the pipe for a request of `bytes` arriving now; returns its completion time.
    fn reserve(&self, bytes: u64) -> Nanos {
        let now = self.clock.now();
        let mut p = self.pipe.lock();
        let admit = now.max(p.next_admit);
        if let Some(iops) = self.config.iops {
            p.next_admit = admit + 1_000_000_000 / iops.max(1);
        }
        let mut done = admit;
        if let (Some(bw), true) = (self.config.bandwidth, bytes > 0) {
            let start = admit.max(p.link_free);
            let transfer = (bytes as u128 * 1_000_000_000 / bw.max(1) as u128) as Nanos;
            p.link_free = start + transfer;
            done = p.link_free;
        }
        done + nanos(self.config.latency)
    }

    fn timed<T>(&self, bytes: u64, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let done = self.reserve(bytes);
        let r = f();
        self.clock.sleep_until(done);
        r
    }
}

impl Volume for ThrottledVolume {
    fn name(&self) -> &str {
        &self.name
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_size(&self) -> u32 {
        self.inner.logical_block_size()
    }
    fn rotational(&self) -> bool {
        self.inner.rotational()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        self.timed(len, || self.inner.read_at(buf, offset))
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        self.timed(buf.len() as u64, || self.inner.write_at(buf, offset))
    }
    fn flush(&self) -> Result<()> {
        self.timed(0, || self.inner.flush())
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        self.timed(0, || self.inner.discard(offset, len))
    }
    fn discard_zeroes(&self) -> bool {
        self.inner.discard_zeroes()
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        // Zeroing moves no data over the link on devices that support it natively.
        self.timed(0, || self.inner.write_zeroes(offset, len))
    }
}

impl fmt::Debug for ThrottledVolume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ThrottledVolume")
            .field("name", &self.name)
            .field("config", &self.config)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emul::clock::{Clock, VirtualClock};
    use crate::RamVolume;
    use std::sync::Arc;

    fn ram() -> VolumeRef {
        Arc::new(RamVolume::new("ram", 1 << 20).unwrap())
    }

    #[test]
    fn latency_iops_and_bandwidth_on_a_virtual_clock() {
        let clock = Arc::new(VirtualClock::new());
        let cfg = ThrottleConfig {
            latency: Duration::from_micros(200),
            iops: Some(1000),
            bandwidth: Some(4096 * 1000), // 4 KiB takes 1 ms
        };
        let v = ThrottledVolume::with_clock(ram(), cfg, clock.clone());
        let mut buf = [0u8; 4096];
        v.read_at(&mut buf, 0).unwrap();
        assert_eq!(clock.now(), 1_200_000, "1 ms transfer + 200 µs latency");
        // Back to back: the bandwidth cap (1 ms per 4 KiB) rules.
        for _ in 0..9 {
            v.write_at(&buf, 4096).unwrap();
        }
        assert_eq!(clock.now(), 10 * 1_200_000);
        // Flushes move no data: only the latency and the IOPS cap apply.
        let before = clock.now();
        v.flush().unwrap();
        assert_eq!(clock.now() - before, 200_000);
    }

    #[test]
    fn iops_cap_spaces_requests() {
        let clock = Arc::new(VirtualClock::new());
        let cfg = ThrottleConfig {
            iops: Some(100),
            ..Default::default()
        };
        let v = ThrottledVolume::with_clock(ram(), cfg, clock.clone());
        let mut buf = [0u8; 512];
        for _ in 0..3 {
            v.read_at(&mut buf, 0).unwrap();
        }
        // Admitted at 0, 10 ms, 20 ms; no latency.
        assert_eq!(clock.now(), 20_000_000);
    }

    #[test]
    fn data_round_trips() {
        let v = ThrottledVolume::new(ram(), ThrottleConfig::default());
        v.write_at(&[7; 1024], 512).unwrap();
        let mut b = [0; 1024];
        v.read_at(&mut b, 512).unwrap();
        assert_eq!(b, [7; 1024]);
    }

    #[test]
    fn real_clock_latency_is_honoured() {
        let v = ThrottledVolume::new(
            ram(),
            ThrottleConfig {
                latency: Duration::from_millis(1),
                ..Default::default()
            },
        );
        let mut b = [0; 512];
        let start = std::time::Instant::now();
        for _ in 0..3 {
            v.read_at(&mut b, 0).unwrap();
        }
        assert!(
            start.elapsed() >= Duration::from_millis(3),
            "{:?}",
            start.elapsed()
        );
    }
}

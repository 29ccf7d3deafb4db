//! [`SsdVolume`]: a flash SSD (or an array of them behind a RAID controller) as a timing model,
//! with the data kept in a backing volume like the other emulated devices.
//!
//! The model has four parts, each one parameter family of `ssd:` (docs/devices.md):
//! - **internal parallelism**: `parallelism` units (a drive's channels and dies) each serve one
//!   flash page at a time. A request touches the 16 KiB flash pages its bytes fall in; each page
//!   goes to the unit that is free first. A page keeps its unit busy for `parallelism / iops`
//!   seconds (`read_iops` or `write_iops`), so with every unit busy the device does `iops`
//!   single-page requests per second, and one request alone takes `parallelism / iops`;
//! - **bandwidth**: one host link (SATA or the controller's bus) moves each request's bytes at
//!   `read_bw` or `write_bw`, one request after another;
//! - **latency**: a fixed `read_latency` or `write_latency` added to every request (command
//!   processing, interface, the controller), which requests overlap freely;
//! - **controller cap** (optional): requests are admitted at most `max_iops` per second, as a
//!   RAID controller's processor or a queue limit allows.
//!
//! A request completes when its last page is done and its transfer is done, plus the latency.
//! Not modelled: garbage collection and write amplification (steady-state figures are given
//! instead), the drive's own write cache (writes at queue depth 1 are therefore as slow as the
//! flash, the pessimistic case), a RAID controller's write-back cache, and parity
//! read-modify-write as separate IOs (a parity array is described by its net write rate).
//! Flushes and discards take the latency only.

use std::fmt;
use std::time::Duration;

use parking_lot::Mutex;

use super::clock::{nanos, ClockRef, Nanos, RealClock};
use super::device::Backing;
use crate::{check_range, ErrorKind, Op, Result, Volume, VolumeError, VolumeRef};

/// The flash page a unit serves at once.
pub(crate) const SSD_PAGE: u64 = 16 << 10;

/// What an [`SsdVolume`] emulates; see the module documentation for the meaning of each field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SsdConfig {
    pub size: u64,
    /// Units serving flash pages at once (1..=4096).
    pub parallelism: u32,
    /// Single-page reads (writes) per second with every unit busy.
    pub read_iops: u64,
    pub write_iops: u64,
    /// Bytes per second over the host link.
    pub read_bw: u64,
    pub write_bw: u64,
    /// Fixed time added to every read (write).
    pub read_latency: Duration,
    pub write_latency: Duration,
    /// Requests admitted per second at most (None: no cap).
    pub max_iops: Option<u64>,
}

impl SsdConfig {
    /// A datacenter SATA SSD in steady state (figures of the class of an Intel D3-S4510 960 GB:
    /// 4 KiB random reads about 95k IOPS, random writes about 36k, sequential 560 MB/s read and
    /// 510 MB/s write; eight units give a queue-depth-1 read of about 110 µs in all).
    pub fn sata(size: u64) -> SsdConfig {
        SsdConfig {
            size,
            parallelism: 8,
            read_iops: 95_000,
            write_iops: 36_000,
            read_bw: 560_000_000,
            write_bw: 510_000_000,
            read_latency: Duration::from_micros(25),
            write_latency: Duration::from_micros(25),
            max_iops: None,
        }
    }

    /// Nine of those SATA SSDs behind a hardware RAID controller as RAID 5 (8 data + 1 parity),
    /// the shape of the study's SSD array; `size` is the usable capacity. The figures:
    /// - parallelism 72 = 9 drives x 8 units;
    /// - reads 855k IOPS from the flash (9 x 95k), but the controller admits at most 450k
    ///   requests per second (a 12 Gb/s SAS RAID-on-chip controller's small-IO ceiling);
    /// - writes 81k IOPS: each small write costs a parity array four drive IOs (read data and
    ///   parity, write both), 9 x 36k / 4;
    /// - bandwidth: reads 4.5 GB/s (nine drives' 5 GB/s, less the controller's PCIe 3.0 x8
    ///   practical limit), writes 3.6 GB/s (eight data drives' 4.1 GB/s of full stripes, less
    ///   parity generation);
    /// - latency 40 µs: the drive's 25 µs plus the controller's firmware path (a queue-depth-1
    ///   4 KiB read then takes about 125 µs).
    ///
    /// Its controller's write-back cache is not modelled: this is the array as write-through
    /// sees it.
    pub fn sata_raid5x9(size: u64) -> SsdConfig {
        SsdConfig {
            size,
            parallelism: 72,
            read_iops: 855_000,
            write_iops: 81_000,
            read_bw: 4_500_000_000,
            write_bw: 3_600_000_000,
            read_latency: Duration::from_micros(40),
            write_latency: Duration::from_micros(40),
            max_iops: Some(450_000),
        }
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.size == 0 || self.size % 512 != 0 {
            return Err(format!(
                "size {} must be a positive multiple of 512",
                self.size
            ));
        }
        if !(1..=4096).contains(&self.parallelism) {
            return Err(format!(
                "parallelism {} out of range 1..=4096",
                self.parallelism
            ));
        }
        for (name, v) in [
            ("read_iops", self.read_iops),
            ("write_iops", self.write_iops),
            ("read_bw", self.read_bw),
            ("write_bw", self.write_bw),
            ("max_iops", self.max_iops.unwrap_or(1)),
        ] {
            if v == 0 {
                return Err(format!("{name} must be above 0"));
            }
        }
        Ok(())
    }

    fn describe(&self) -> String {
        format!(
            "emulated SSD ({} units, {}k/{}k IOPS read/write, {} / {} MB/s, {} / {} µs{})",
            self.parallelism,
            self.read_iops / 1000,
            self.write_iops / 1000,
            self.read_bw / 1_000_000,
            self.write_bw / 1_000_000,
            self.read_latency.as_micros(),
            self.write_latency.as_micros(),
            self.max_iops.map_or(String::new(), |m| format!(
                ", at most {}k requests/s",
                m / 1000
            ))
        )
    }
}

/// The timing state: when each unit and the link are next free.
struct Model {
    units: Vec<Nanos>,
    link_free: Nanos,
    next_admit: Nanos,
}

impl Model {
    /// Reserve the device for a request of `len` bytes at `offset` arriving at `now`; returns
    /// its completion time.
    fn reserve(&mut self, c: &SsdConfig, now: Nanos, write: bool, offset: u64, len: u64) -> Nanos {
        let (iops, bw, latency) = if write {
            (c.write_iops, c.write_bw, c.write_latency)
        } else {
            (c.read_iops, c.read_bw, c.read_latency)
        };
        let admit = now.max(self.next_admit);
        if let Some(max) = c.max_iops {
            self.next_admit = admit + 1_000_000_000 / max;
        }
        let mut done = admit;
        if len > 0 {
            let page_time = (c.parallelism as u128 * 1_000_000_000 / iops as u128) as Nanos;
            let pages = (offset + len).div_ceil(SSD_PAGE) - offset / SSD_PAGE;
            let p = self.units.len() as u64;
            // Whole rounds go to every unit at once (a large request spreads over all of them);
            // the rest, page by page, to the unit free first.
            let rounds = pages / p;
            if rounds > 0 {
                for u in &mut self.units {
                    *u = (*u).max(admit) + rounds * page_time;
                    done = done.max(*u);
                }
            }
            for _ in 0..pages % p {
                let u = self
                    .units
                    .iter_mut()
                    .min()
                    .expect("parallelism is at least 1");
                *u = (*u).max(admit) + page_time;
                done = done.max(*u);
            }
            let start = admit.max(self.link_free);
            self.link_free = start + (len as u128 * 1_000_000_000 / bw as u128) as Nanos;
            done = done.max(self.link_free);
        }
        done + nanos(latency)
    }
}

/// An emulated SSD; see the module documentation.
pub struct SsdVolume {
    name: String,
    description: String,
    config: SsdConfig,
    model: Mutex<Model>,
    clock: ClockRef,
    backing: VolumeRef,
}

impl SsdVolume {
    /// Emulate `config` on the real clock.
    pub fn new(name: &str, config: &SsdConfig, backing: Backing) -> Result<SsdVolume> {
        Self::with_clock(name, config, backing, RealClock::shared())
    }

    /// Emulate `config` on `clock` (a [`VirtualClock`](super::VirtualClock) in tests).
    pub fn with_clock(
        name: &str,
        config: &SsdConfig,
        backing: Backing,
        clock: ClockRef,
    ) -> Result<SsdVolume> {
        let invalid = |msg: String| VolumeError::new(name, Op::Open, 0, 0, ErrorKind::Invalid(msg));
        config.validate().map_err(invalid)?;
        let size = config.size;
        let (backing, name, description) = backing.open(name, size, config.describe())?;
        Ok(SsdVolume {
            name,
            description,
            config: *config,
            model: Mutex::new(Model {
                units: vec![0; config.parallelism as usize],
                link_free: 0,
                next_admit: 0,
            }),
            clock,
            backing,
        })
    }

    pub fn config(&self) -> &SsdConfig {
        &self.config
    }

    /// What is emulated, and whether data is kept.
    pub fn description(&self) -> &str {
        &self.description
    }

    fn timed<T>(&self, write: bool, offset: u64, len: u64, f: impl FnOnce() -> T) -> T {
        let done = self
            .model
            .lock()
            .reserve(&self.config, self.clock.now(), write, offset, len);
        let r = f();
        self.clock.sleep_until(done);
        r
    }
}

impl Volume for SsdVolume {
    fn name(&self) -> &str {
        &self.name
    }
    fn size(&self) -> u64 {
        self.config.size
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        check_range(self, Op::Read, offset, len)?;
        self.timed(false, offset, len, || self.backing.read_at(buf, offset))
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        check_range(self, Op::Write, offset, len)?;
        self.timed(true, offset, len, || self.backing.write_at(buf, offset))
    }
    fn flush(&self) -> Result<()> {
        self.timed(true, 0, 0, || self.backing.flush())
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self, Op::Discard, offset, len)?;
        self.timed(true, 0, 0, || self.backing.discard(offset, len))
    }
    fn discard_zeroes(&self) -> bool {
        self.backing.discard_zeroes()
    }
}

impl fmt::Debug for SsdVolume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SsdVolume")
            .field("name", &self.name)
            .field("description", &self.description)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emul::clock::{Clock, VirtualClock};
    use std::sync::Arc;

    fn device(config: SsdConfig) -> (SsdVolume, Arc<VirtualClock>) {
        let clock = Arc::new(VirtualClock::new());
        let v = SsdVolume::with_clock("ssd", &config, Backing::Ram, clock.clone()).unwrap();
        (v, clock)
    }

    /// A small round-number device: 4 units, 4000 page ops/s (1 ms per page per unit),
    /// 100 MB/s both ways, 100 µs latency.
    fn simple() -> SsdConfig {
        SsdConfig {
            size: 64 << 20,
            parallelism: 4,
            read_iops: 4000,
            write_iops: 2000,
            read_bw: 100_000_000,
            write_bw: 100_000_000,
            read_latency: Duration::from_micros(100),
            write_latency: Duration::from_micros(100),
            max_iops: None,
        }
    }

    /// Completion times of `n` requests issued at once (as `n` threads would), in order.
    fn burst(config: &SsdConfig, n: u64, write: bool, len: u64, stride: u64) -> Vec<Nanos> {
        let mut m = Model {
            units: vec![0; config.parallelism as usize],
            link_free: 0,
            next_admit: 0,
        };
        (0..n)
            .map(|i| m.reserve(config, 0, write, i * stride, len))
            .collect()
    }

    #[test]
    fn one_small_read_takes_a_page_time_transfer_and_latency() {
        let (v, clock) = device(simple());
        let mut b = [0u8; 4096];
        v.read_at(&mut b, 0).unwrap();
        // Page: 4 / 4000 s = 1 ms; transfer 4096 B at 100 MB/s = 40.96 µs (overlapped); +100 µs.
        assert_eq!(clock.now(), 1_100_000);
    }

    #[test]
    fn parallel_requests_use_every_unit_then_queue() {
        let c = simple();
        let done = burst(&c, 8, false, 4096, 1 << 20);
        // Four units: the first four finish together, the next four one page time later.
        assert_eq!(done[..4], [1_100_000; 4]);
        assert_eq!(done[4..], [2_100_000; 4]);
        // So the device does `read_iops` single-page reads per second at full parallelism.
        let n = 400;
        let last = *burst(&c, n, false, 4096, 1 << 20).last().unwrap();
        let iops = n as f64 * 1e9 / (last - 100_000) as f64;
        assert!((iops - 4000.0).abs() < 1.0, "{iops}");
        // Writes at their own rate: 2 ms per page.
        assert_eq!(burst(&c, 1, true, 4096, 0)[0], 2_100_000);
    }

    #[test]
    fn large_requests_spread_over_units_and_meet_the_link() {
        let mut c = simple();
        c.read_iops = 400_000; // 10 µs per page: the link rules
                               // 1 MiB = 64 pages over 4 units (160 µs), but the link needs 10.49 ms.
        let done = burst(&c, 1, false, 1 << 20, 0)[0];
        assert_eq!(done, 10_485_760 + 100_000);
        // Two of them share the link one after the other.
        let two = burst(&c, 2, false, 1 << 20, 1 << 20);
        assert_eq!(two[1], 2 * 10_485_760 + 100_000);
        // A request crossing a page boundary touches two pages: on one unit, twice the time.
        let mut c = simple();
        c.parallelism = 1; // 250 µs per page
        let mut m = Model {
            units: vec![0],
            link_free: 0,
            next_admit: 0,
        };
        assert_eq!(m.reserve(&c, 0, false, 0, 8192), 350_000);
        assert_eq!(m.reserve(&c, 350_000, false, 12 << 10, 8192), 950_000);
    }

    #[test]
    fn the_controller_cap_spaces_requests() {
        let mut c = simple();
        c.read_iops = 4_000_000; // flash far faster than the controller
        c.max_iops = Some(1000);
        let done = burst(&c, 3, false, 512, 0);
        // Admitted at 0, 1 ms, 2 ms.
        assert_eq!(done[2] - done[0], 2_000_000);
    }

    #[test]
    fn presets_match_their_documented_figures() {
        for (c, qd1_us, read_k, write_k) in [
            (SsdConfig::sata(1 << 30), 110, 95, 36),
            (SsdConfig::sata_raid5x9(1 << 30), 125, 450, 81),
        ] {
            c.validate().unwrap();
            let one = burst(&c, 1, false, 4096, 0)[0];
            assert!(
                one.abs_diff(qd1_us * 1000) < 10_000,
                "{c:?}: queue depth 1 read {one} ns"
            );
            // Saturated 4 KiB random reads and writes, many in flight.
            for (write, want_k) in [(false, read_k), (true, write_k)] {
                let n = 20_000;
                let times = burst(&c, n, write, 4096, 1 << 20);
                let span = times.last().unwrap() - times[0];
                let k = (n - 1) as f64 * 1e6 / span as f64;
                assert!(
                    (k - want_k as f64).abs() / (want_k as f64) < 0.02,
                    "{c:?} write {write}: {k:.1}k IOPS, documented {want_k}k"
                );
            }
            // Sequential 1 MiB reads reach the link's bandwidth.
            let times = burst(&c, 64, false, 1 << 20, 1 << 20);
            let mbs = 63.0 * (1 << 20) as f64 * 1e3 / (times[63] - times[0]) as f64;
            assert!(
                (mbs - c.read_bw as f64 / 1e6).abs() / mbs < 0.02,
                "{c:?}: {mbs:.0} MB/s"
            );
        }
    }

    #[test]
    fn data_round_trips_and_bad_configs_are_named() {
        let (v, _clock) = device(simple());
        v.write_at(&[3; 8192], 12 << 10).unwrap();
        let mut b = [0; 8192];
        v.read_at(&mut b, 12 << 10).unwrap();
        assert_eq!(b, [3; 8192]);
        let mut c = simple();
        c.parallelism = 0;
        let e = SsdVolume::new("s", &c, Backing::NoData).unwrap_err();
        assert!(e.to_string().contains("parallelism 0"), "{e}");
        let mut c = simple();
        c.write_bw = 0;
        let e = SsdVolume::new("s", &c, Backing::NoData).unwrap_err();
        assert!(e.to_string().contains("write_bw must be above 0"), "{e}");
    }
}

//! The model of one hard disk: [`HddConfig`] describes it, `Disk` is its timing state.
//!
//! A request's service time is a fixed command overhead, then positioning (seek plus rotational
//! wait), then the media transfer. Positioning:
//! - a request that starts where the previous one ended pays none (back-to-back sequential IO
//!   streams through the track buffer);
//! - otherwise the seek is `settle + k * sqrt(distance / capacity)` (zero within one track),
//!   with `settle` and `k` derived from the average and full-stroke seek (the average random
//!   distance is a third of the stroke and E[sqrt(distance)] = 8/15 of the full stroke's);
//! - then the head waits for the target sector to come round: the platter's angle follows the
//!   clock (`rpm`), a sector's angle is its offset within a track of `media_rate * revolution`
//!   bytes. That makes rotational waits depend on real timing, so a write straight after a read
//!   of the same sector costs about one revolution, as it does on a real disk.
//!
//! One actuator serves one request at a time. Queued requests are served first come first
//! served, or with command queueing (`ncq > 1`) the one among the first `ncq` queued with the
//! shortest positioning time (what NCQ's rotational position ordering does), except that a
//! request queued longer than [`STARVATION_LIMIT`] is served next.
//!
//! The disk does not know about clocks or threads: the caller gives it times. Decisions are lazy:
//! [`Disk::advance`] makes every dispatch decision due up to a time, each from the requests that
//! had arrived by the moment of the decision, so calling it late changes nothing.

use std::collections::HashMap;
use std::time::Duration;

use super::clock::{nanos, Nanos};

/// A request waiting this long is served next even if another is closer (NCQ's aging).
pub const STARVATION_LIMIT: Duration = Duration::from_secs(1);

/// What one emulated disk is like. [`HddConfig::new`] fills in a 7200 rpm SATA disk.
#[derive(Debug, Clone, PartialEq)]
pub struct HddConfig {
    /// Capacity in bytes (a multiple of 512).
    pub size: u64,
    /// Spindle speed, revolutions per minute.
    pub rpm: u32,
    /// Mean seek time over random distances.
    pub avg_seek: Duration,
    /// Seek time across the whole stroke.
    pub full_seek: Duration,
    /// Sustained media transfer rate, bytes per second.
    pub media_rate: u64,
    /// Fixed cost of every command (protocol and firmware).
    pub cmd_overhead: Duration,
    /// Command queue depth the disk reorders over; 0 or 1 means first come first served.
    pub ncq: u32,
}

impl HddConfig {
    /// A disk of `size` bytes at `rpm`, with seek times and transfer rate typical for that speed
    /// (7200 rpm: 8.5 ms average, 15 ms full stroke, 200 MB/s; faster spindles seek faster).
    pub fn new(size: u64, rpm: u32) -> HddConfig {
        let (avg, full, rate) = match rpm {
            0..=5999 => (12.0, 22.0, 150),
            6000..=8999 => (8.5, 15.0, 200),
            9000..=12000 => (5.0, 9.0, 220),
            _ => (3.8, 7.0, 250),
        };
        HddConfig {
            size,
            rpm,
            avg_seek: Duration::from_secs_f64(avg / 1e3),
            full_seek: Duration::from_secs_f64(full / 1e3),
            media_rate: rate * 1_000_000,
            cmd_overhead: Duration::from_micros(100),
            ncq: 0,
        }
    }

    /// Check the parameters; the message names the parameter and what it accepts.
    pub fn validate(&self) -> Result<(), String> {
        if self.size == 0 || self.size % 512 != 0 {
            return Err(format!(
                "disk size {} must be a non-zero multiple of 512 bytes",
                self.size
            ));
        }
        if !(1000..=30000).contains(&self.rpm) {
            return Err(format!("rpm {} out of range 1000..=30000", self.rpm));
        }
        if self.media_rate < 1_000_000 {
            return Err(format!(
                "media transfer rate {} B/s is below the accepted minimum of 1 MB/s",
                self.media_rate
            ));
        }
        if self.ncq > 256 {
            return Err(format!("ncq {} out of range 0..=256", self.ncq));
        }
        let (avg, full) = (self.avg_seek.as_secs_f64(), self.full_seek.as_secs_f64());
        if !(full > avg && avg > 0.0) {
            return Err(format!(
                "seek times: need 0 < avg_seek ({avg:.4} s) < full_seek ({full:.4} s)"
            ));
        }
        if avg < MEAN_SQRT * full {
            return Err(format!(
                "seek times: avg_seek ({:.2} ms) must be at least {:.0}% of full_seek ({:.2} ms) \
                 for a seek curve settle + k*sqrt(distance) with settle >= 0",
                avg * 1e3,
                MEAN_SQRT * 100.0,
                full * 1e3
            ));
        }
        Ok(())
    }

    /// One revolution.
    pub fn revolution(&self) -> Duration {
        Duration::from_nanos(60_000_000_000 / self.rpm as u64)
    }
}

/// E[sqrt(|x - y|)] for x, y uniform on [0, 1]: the mean seek distance term.
const MEAN_SQRT: f64 = 8.0 / 15.0;

/// Constants derived from an [`HddConfig`], in nanoseconds.
#[derive(Debug, Clone)]
pub(crate) struct HddModel {
    pub cfg: HddConfig,
    rev: Nanos,
    track: u64,
    settle: f64,
    k: f64,
    overhead: Nanos,
    starvation: Nanos,
    /// No positioning at all: a queue with a fixed cost per request and a transfer rate, which
    /// is how the RAID model's parity engine reuses this code.
    seekless: bool,
    /// How long after it could start the disk commits to a request (its command overhead):
    /// see [`Disk::advance`].
    lookahead: Nanos,
}

impl HddModel {
    pub fn new(cfg: HddConfig) -> HddModel {
        let rev = nanos(cfg.revolution());
        let track = (cfg.media_rate as u128 * rev as u128 / 1_000_000_000) as u64;
        let (avg, full) = (
            cfg.avg_seek.as_nanos() as f64,
            cfg.full_seek.as_nanos() as f64,
        );
        let k = (full - avg) / (1.0 - MEAN_SQRT);
        HddModel {
            rev,
            track: track.max(512),
            settle: (full - k).max(0.0),
            k,
            overhead: nanos(cfg.cmd_overhead),
            starvation: nanos(STARVATION_LIMIT),
            seekless: false,
            lookahead: nanos(cfg.cmd_overhead),
            cfg,
        }
    }

    /// A first-come-first-served server costing `per_request` plus `len / rate` per request.
    pub fn seekless(per_request: Duration, rate: u64) -> HddModel {
        let mut cfg = HddConfig::new(u64::MAX / 2, 7200);
        cfg.cmd_overhead = per_request;
        cfg.media_rate = rate.max(1);
        HddModel {
            seekless: true,
            lookahead: 0,
            ..HddModel::new(cfg)
        }
    }

    /// Seek time between two byte positions.
    pub fn seek(&self, from: u64, to: u64) -> Nanos {
        let d = from.abs_diff(to);
        if d < self.track {
            return 0;
        }
        (self.settle + self.k * (d as f64 / self.cfg.size as f64).sqrt()) as Nanos
    }

    /// Wait at time `t` until the sector at `offset` is under the head.
    fn rotation(&self, t: Nanos, offset: u64) -> Nanos {
        let target = (offset % self.track) as u128 * self.rev as u128 / self.track as u128;
        let now = (t % self.rev) as u128;
        ((target + self.rev as u128 - now) % self.rev as u128) as Nanos
    }

    fn transfer(&self, len: u64) -> Nanos {
        (len as u128 * 1_000_000_000 / self.cfg.media_rate as u128) as Nanos
    }

    /// Positioning time for a request at `offset` when the command starts at `t` with the head
    /// at `head`.
    fn positioning(&self, t: Nanos, head: u64, offset: u64) -> Nanos {
        if offset == head || self.seekless {
            return 0;
        }
        let seek = self.seek(head, offset);
        seek + self.rotation(t + self.overhead + seek, offset)
    }
}

#[derive(Debug, Clone)]
struct DiskReq {
    id: u64,
    arrival: Nanos,
    offset: u64,
    len: u64,
    /// How many waiters will [`Disk::forget`] it (a full-stripe write serves several requests).
    refs: u32,
}

/// Timing state of one disk: the actuator and its queue.
#[derive(Debug, Clone)]
pub(crate) struct Disk {
    model: std::sync::Arc<HddModel>,
    head: u64,
    busy_until: Nanos,
    /// In arrival order (arrivals never go back in time).
    queue: Vec<DiskReq>,
    done: HashMap<u64, (Nanos, u32)>,
    next_id: u64,
    /// Time the actuator spent serving, for utilisation figures.
    pub busy_total: Nanos,
}

impl Disk {
    pub fn new(model: std::sync::Arc<HddModel>) -> Disk {
        Disk {
            model,
            head: 0,
            busy_until: 0,
            queue: Vec::new(),
            done: HashMap::new(),
            next_id: 0,
            busy_total: 0,
        }
    }

    /// Queue a request arriving at `at` (not earlier than any time already advanced to), to be
    /// forgotten by `refs` waiters.
    pub fn submit(&mut self, at: Nanos, offset: u64, len: u64, refs: u32) -> u64 {
        self.advance(at);
        let id = self.next_id;
        self.next_id += 1;
        self.queue.push(DiskReq {
            id,
            arrival: at,
            offset,
            len,
            refs,
        });
        self.advance(at);
        id
    }

    /// The completion time of request `id`, once it has been dispatched.
    pub fn completion(&self, id: u64) -> Option<Nanos> {
        self.done.get(&id).map(|&(t, _)| t)
    }

    /// One waiter is done with a completed request; the last one removes it.
    pub fn forget(&mut self, id: u64) {
        if let Some((_, refs)) = self.done.get_mut(&id) {
            *refs -= 1;
            if *refs == 0 {
                self.done.remove(&id);
            }
        }
    }

    /// Requests queued or in service: how busy the disk is, for choosing a mirror.
    pub fn backlog(&self) -> (usize, Nanos) {
        (self.queue.len(), self.busy_until)
    }

    /// How far the head is from `offset`.
    pub fn distance(&self, offset: u64) -> u64 {
        self.head.abs_diff(offset)
    }

    /// When the next dispatch decision is due, if anything is queued: when the actuator is free
    /// and a request has arrived, plus the lookahead (see [`Disk::advance`]).
    pub fn next_event(&self) -> Option<Nanos> {
        let first = self.queue.first()?;
        Some(self.busy_until.max(first.arrival) + self.model.lookahead)
    }

    /// Make every dispatch decision due at or before `t`.
    ///
    /// The disk takes its pick `lookahead` (its command overhead) after it could start, from the
    /// requests arrived by then, and serves it from when it could start (or from its arrival):
    /// commands that arrive while the firmware is still processing one are considered with it.
    /// With command queueing it picks the one positioned best; without, the first to arrive,
    /// unless one of them continues exactly where the head is. A client whose requests leave in
    /// order but may reach the disk a few tens of microseconds out of order (several threads of
    /// a server racing) then keeps a sequential stream sequential, instead of paying a
    /// revolution each time a write lands just behind the head. Requests that arrive in order
    /// are served at exactly the times they would be without the lookahead.
    pub fn advance(&mut self, t: Nanos) {
        while let Some(d) = self.next_event() {
            if d > t {
                break;
            }
            let idx = self.choose(d);
            let r = self.queue.remove(idx);
            let start = self.busy_until.max(r.arrival);
            let m = &self.model;
            let service =
                m.overhead + m.positioning(start, self.head, r.offset) + m.transfer(r.len);
            self.busy_until = start + service;
            self.busy_total += service;
            self.head = r.offset + r.len;
            self.done.insert(r.id, (self.busy_until, r.refs));
        }
    }

    /// Which queued request to serve at decision time `d`.
    fn choose(&self, d: Nanos) -> usize {
        let arrived = self.queue.iter().take_while(|r| r.arrival <= d).count();
        if self.model.cfg.ncq <= 1 && !self.model.seekless {
            let at_head = self.queue[..arrived]
                .iter()
                .position(|r| r.offset == self.head);
            return at_head.unwrap_or(0);
        }
        let window = (self.model.cfg.ncq.max(1) as usize).min(arrived);
        if window <= 1 || d - self.queue[0].arrival > self.model.starvation {
            return 0;
        }
        let earliest = self.busy_until.max(self.queue[0].arrival);
        (0..window)
            .min_by_key(|&i| {
                let r = &self.queue[i];
                let start = earliest.max(r.arrival);
                (start - earliest) + self.model.positioning(start, self.head, r.offset)
            })
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn disk(ncq: u32) -> Disk {
        let mut cfg = HddConfig::new(1 << 40, 7200);
        cfg.ncq = ncq;
        cfg.validate().unwrap();
        Disk::new(Arc::new(HddModel::new(cfg)))
    }

    /// Serve one request at `at` on an idle disk; returns its service time.
    fn serve(d: &mut Disk, at: Nanos, offset: u64, len: u64) -> Nanos {
        let id = d.submit(at, offset, len, 1);
        d.advance(at + d.model.lookahead);
        d.completion(id).unwrap() - at
    }

    #[test]
    fn defaults_validate_and_bad_values_are_named() {
        HddConfig::new(1 << 30, 5400).validate().unwrap();
        HddConfig::new(1 << 30, 15000).validate().unwrap();
        let mut c = HddConfig::new(1 << 30, 7200);
        c.rpm = 10;
        assert!(c.validate().unwrap_err().contains("rpm"));
        let mut c = HddConfig::new(1 << 30, 7200);
        c.avg_seek = Duration::from_millis(20);
        assert!(c.validate().unwrap_err().contains("avg_seek"));
        let mut c = HddConfig::new(1 << 30, 7200);
        c.avg_seek = Duration::from_millis(2);
        assert!(c.validate().unwrap_err().contains("settle"));
    }

    #[test]
    fn seek_grows_with_distance_and_matches_calibration() {
        let d = disk(0);
        let m = &d.model;
        assert_eq!(m.seek(0, 4096), 0, "same track: no seek");
        let mut last = 0;
        for frac in [0.001, 0.01, 0.1, 0.3, 0.6, 1.0] {
            let s = m.seek(0, (m.cfg.size as f64 * frac) as u64);
            assert!(s > last, "seek({frac}) = {s} not above {last}");
            last = s;
        }
        let full = m.seek(0, m.cfg.size) as f64 / 1e6;
        assert!((full - 15.0).abs() < 0.01, "full stroke {full} ms");
        // The mean over random pairs is the configured average.
        let mut rng = crate::emul::sim::SplitMix64(7);
        let n = 20_000;
        let total: u64 = (0..n)
            .map(|_| m.seek(rng.below(m.cfg.size), rng.below(m.cfg.size)))
            .sum();
        let avg = total as f64 / n as f64 / 1e6;
        assert!((avg - 8.5).abs() < 0.2, "average seek {avg} ms");
    }

    #[test]
    fn back_to_back_sequential_pays_no_positioning() {
        let mut d = disk(0);
        let first = serve(&mut d, 0, 1 << 30, 65536);
        let t = d.busy_until + 3_000_000; // even after a pause
        let second = serve(&mut d, t, (1 << 30) + 65536, 65536);
        let m = &d.model;
        assert_eq!(second, m.overhead + m.transfer(65536));
        assert!(first > second);
    }

    #[test]
    fn sequential_faster_than_random() {
        let mut rng = crate::emul::sim::SplitMix64(1);
        let (mut seq, mut rnd) = (disk(0), disk(0));
        let (mut t_seq, mut t_rnd) = (0, 0);
        for i in 0..200u64 {
            t_seq += serve(&mut seq, t_seq, i * 4096, 4096);
            let off = rng.below(1 << 28) * 4096;
            t_rnd += serve(&mut rnd, t_rnd, off, 4096);
        }
        assert!(
            t_rnd > 50 * t_seq,
            "random {t_rnd} ns vs sequential {t_seq} ns"
        );
        // Random 4 KiB on a 7200 rpm disk: about 8.5 ms seek + 4.2 ms rotation.
        let per = t_rnd as f64 / 200.0 / 1e6;
        assert!((10.0..16.0).contains(&per), "{per} ms per random request");
    }

    #[test]
    fn a_sequential_write_arriving_just_behind_the_next_is_still_served_in_order() {
        // Two writes continuing a stream leave the client in order but reach the disk 30 µs
        // apart the other way round (two server threads racing): the disk, which serves in
        // arrival order otherwise, takes the one at its head first, and neither waits for the
        // platter.
        let mut d = disk(0);
        let base = 1 << 30;
        serve(&mut d, 0, base, 4096);
        let t = d.busy_until + 1_000_000;
        let second = d.submit(t, base + 8192, 4096, 1);
        let first = d.submit(t + 30_000, base + 4096, 4096, 1);
        d.advance(u64::MAX);
        let m = &d.model;
        let one = m.overhead + m.transfer(4096);
        let (a, b) = (d.completion(first).unwrap(), d.completion(second).unwrap());
        assert_eq!(a, t + 30_000 + one, "the write at the head goes first");
        assert_eq!(b, a + one, "and the other follows it without a revolution");
        // Arrivals further apart than the command overhead keep their order.
        let mut d = disk(0);
        serve(&mut d, 0, base, 4096);
        let t = d.busy_until + 1_000_000;
        let second = d.submit(t, base + 8192, 4096, 1);
        let first = d.submit(t + 2 * m.lookahead, base + 4096, 4096, 1);
        d.advance(u64::MAX);
        assert!(d.completion(second).unwrap() < d.completion(first).unwrap());
    }

    #[test]
    fn write_after_read_of_same_sector_waits_a_revolution() {
        let mut d = disk(0);
        serve(&mut d, 0, 1 << 30, 4096);
        let t = d.busy_until;
        let again = serve(&mut d, t, 1 << 30, 4096);
        let rev = d.model.rev;
        assert!(
            again > rev * 9 / 10 && again < rev + 1_000_000,
            "{again} vs rev {rev}"
        );
    }

    #[test]
    fn ncq_reorders_queued_requests() {
        let mut rng = crate::emul::sim::SplitMix64(3);
        let offsets: Vec<u64> = (0..32).map(|_| rng.below(1 << 28) * 4096).collect();
        let makespan = |ncq| {
            let mut d = disk(ncq);
            let ids: Vec<u64> = offsets.iter().map(|&o| d.submit(0, o, 4096, 1)).collect();
            d.advance(u64::MAX);
            ids.iter()
                .map(|&id| d.completion(id).unwrap())
                .max()
                .unwrap()
        };
        let (fifo, ncq) = (makespan(0), makespan(32));
        assert!(ncq * 3 < fifo * 2, "ncq {ncq} vs fifo {fifo}");
    }
}

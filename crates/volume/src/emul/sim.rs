//! Closed-loop simulation of an emulated device on virtual time: [`simulate`] keeps `iodepth`
//! requests of a synthetic stream outstanding (as fio with one job does) and reports the
//! throughput, without sleeping. Used to calibrate the models against measured devices
//! ([`calibration_table`] for the study's RAID 60 of domain.md §10).

use std::fmt::Write as _;
use std::time::Duration;

use super::clock::Nanos;
use super::device::EmulConfig;
use super::raid::{IoKind, Poll};

/// Where a synthetic stream's requests go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pattern {
    /// Uniformly random block-aligned offsets.
    Random,
    /// One after another; each new request takes the next offset.
    Sequential,
}

/// A synthetic request stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    pub pattern: Pattern,
    pub kind: IoKind,
    pub block_size: u64,
    pub iodepth: u32,
    /// Bytes from offset 0 the stream stays in (fio's file size); `None` for the whole device.
    pub span: Option<u64>,
    /// Requests measured, after `warmup` unmeasured ones.
    pub requests: u64,
    pub warmup: u64,
    pub seed: u64,
}

impl Workload {
    /// `requests` measured requests after a warm-up of a tenth as many.
    pub fn new(
        pattern: Pattern,
        kind: IoKind,
        block_size: u64,
        iodepth: u32,
        requests: u64,
    ) -> Self {
        Workload {
            pattern,
            kind,
            block_size,
            iodepth,
            span: None,
            requests,
            warmup: requests / 10,
            seed: 1,
        }
    }
}

/// What a simulation measured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimResult {
    pub iops: f64,
    /// Megabytes (10^6 bytes, as fio prints MB/s) per second.
    pub mb_per_s: f64,
    pub mean_latency: Duration,
    /// Virtual time the measured requests took.
    pub elapsed: Duration,
}

/// Run `workload` against a fresh model of `config` on virtual time. Panics on an invalid config.
pub fn simulate(config: &EmulConfig, workload: &Workload) -> SimResult {
    if let Err(e) = config.validate() {
        panic!("invalid config: {e}");
    }
    let mut model = config.model();
    let bs = workload.block_size.max(512);
    let span = workload.span.unwrap_or(u64::MAX).min(model.capacity()) / bs * bs;
    assert!(span >= bs, "span smaller than one block");
    let mut rng = SplitMix64(workload.seed);
    let mut next_seq = 0u64;
    let mut next_offset = || match workload.pattern {
        Pattern::Random => rng.below(span / bs) * bs,
        Pattern::Sequential => {
            let o = next_seq;
            next_seq = (next_seq + bs) % span;
            o
        }
    };
    let total = workload.warmup + workload.requests;
    let depth = workload.iodepth.max(1) as u64;
    // (handle, start time, known completion)
    let mut slots: Vec<(u64, Nanos, Option<Nanos>)> = Vec::new();
    let mut issued = 0u64;
    let mut completed = 0u64;
    let mut now: Nanos = 0;
    let (mut measure_start, mut lat_sum) = (0, 0u128);
    while issued < total.min(depth) {
        slots.push((
            model.start(now, workload.kind, next_offset(), bs),
            now,
            None,
        ));
        issued += 1;
    }
    while !slots.is_empty() {
        let mut wake = Nanos::MAX;
        let mut i = 0;
        while i < slots.len() {
            let (op, started, known) = slots[i];
            let done = match known {
                Some(t) => Some(t),
                None => match model.poll(now, op) {
                    Poll::Done(t) => Some(t),
                    Poll::Pending(t) => {
                        wake = wake.min(t);
                        None
                    }
                },
            };
            slots[i].2 = done;
            match done {
                Some(t) if t <= now => {
                    completed += 1;
                    if completed == workload.warmup {
                        measure_start = now;
                    }
                    if completed > workload.warmup {
                        lat_sum += (t - started) as u128;
                    }
                    if issued < total {
                        slots[i] = (
                            model.start(now, workload.kind, next_offset(), bs),
                            now,
                            None,
                        );
                        issued += 1;
                        continue; // poll the new request in this pass too
                    }
                    slots.swap_remove(i);
                    continue;
                }
                Some(t) => wake = wake.min(t),
                None => {}
            }
            i += 1;
        }
        if slots.is_empty() {
            break;
        }
        assert!(
            wake > now && wake != Nanos::MAX,
            "simulation made no progress at {now}"
        );
        now = wake;
    }
    let elapsed = (now - measure_start).max(1);
    let n = workload.requests.max(1) as f64;
    let secs = elapsed as f64 / 1e9;
    SimResult {
        iops: n / secs,
        mb_per_s: n * bs as f64 / secs / 1e6,
        mean_latency: Duration::from_nanos((lat_sum / n as u128) as u64),
        elapsed: Duration::from_nanos(elapsed),
    }
}

/// The study's queue depths (fio iodepth), columns of its tables.
pub const STUDY_DEPTHS: [u32; 5] = [1, 4, 8, 16, 32];
/// The study's random 4 KiB write IOPS per depth (domain.md §10).
pub const STUDY_RANDOM_WRITE_IOPS: [f64; 5] = [63.0, 201.0, 337.0, 560.0, 929.0];
/// The study's sequential write MB/s: (block size, MB/s per depth).
pub const STUDY_SEQ_WRITE_MBS: [(u64, [f64; 5]); 5] = [
    (4 << 10, [5.0, 12.0, 18.9, 26.8, 32.9]),
    (8 << 10, [10.0, 23.0, 26.4, 42.2, 39.8]),
    (16 << 10, [19.0, 47.0, 50.9, 66.6, 1220.0]),
    (32 << 10, [35.0, 69.0, 110.6, 1378.0, 2773.0]),
    (64 << 10, [64.0, 155.0, 1495.0, 2999.0, 5415.0]),
];
/// The part of the array the study's fio jobs are assumed to touch: the study does not say,
/// so this is an assumption (a test file of 1 TiB, small beside the array, keeps seeks short).
pub const STUDY_SPAN: u64 = 1 << 40;

/// One cell of the calibration table: (what, model, study).
pub type Cell = (String, f64, f64);

/// Simulate every cell of the study's tables on `config`; `requests` per cell trades precision
/// for speed. Random cells are IOPS, sequential cells MB/s.
pub fn calibration_cells(config: &EmulConfig, requests: u64) -> Vec<Cell> {
    let mut out = Vec::new();
    for (i, &depth) in STUDY_DEPTHS.iter().enumerate() {
        let mut w = Workload::new(Pattern::Random, IoKind::Write, 4096, depth, requests);
        w.span = Some(STUDY_SPAN);
        let r = simulate(config, &w);
        out.push((
            format!("randwrite 4K qd{depth} IOPS"),
            r.iops,
            STUDY_RANDOM_WRITE_IOPS[i],
        ));
    }
    for (bs, row) in STUDY_SEQ_WRITE_MBS {
        for (i, &depth) in STUDY_DEPTHS.iter().enumerate() {
            let mut w = Workload::new(Pattern::Sequential, IoKind::Write, bs, depth, requests * 4);
            w.span = Some(STUDY_SPAN);
            let r = simulate(config, &w);
            out.push((
                format!("write {}K qd{depth} MB/s", bs >> 10),
                r.mb_per_s,
                row[i],
            ));
        }
    }
    out
}

/// The calibration cells as a table: model, study, and the ratio (model / study).
pub fn calibration_table(cells: &[Cell]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<26} {:>10} {:>10} {:>7}",
        "cell", "model", "study", "ratio"
    );
    for (what, model, study) in cells {
        let ratio = model / study;
        let mark = if (1.0 / 1.5..=1.5).contains(&ratio) {
            ""
        } else {
            "  off"
        };
        let _ = writeln!(
            s,
            "{what:<26} {model:>10.1} {study:>10.1} {ratio:>7.2}{mark}"
        );
    }
    s
}

/// A small deterministic generator (splitmix64), so simulations repeat exactly.
#[derive(Debug, Clone)]
pub struct SplitMix64(pub u64);

impl SplitMix64 {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emul::hdd::HddConfig;
    use crate::emul::raid::{RaidConfig, RaidLevel};

    fn hdd(ncq: u32) -> EmulConfig {
        let mut c = HddConfig::new(1 << 40, 7200);
        c.ncq = ncq;
        EmulConfig::Hdd(c)
    }

    fn run(cfg: &EmulConfig, pattern: Pattern, kind: IoKind, bs: u64, depth: u32) -> SimResult {
        simulate(cfg, &Workload::new(pattern, kind, bs, depth, 400))
    }

    #[test]
    fn sequential_much_faster_than_random_on_a_disk() {
        let seq = run(&hdd(0), Pattern::Sequential, IoKind::Read, 4096, 1);
        let rnd = run(&hdd(0), Pattern::Random, IoKind::Read, 4096, 1);
        assert!(seq.iops > 30.0 * rnd.iops, "seq {seq:?} rnd {rnd:?}");
        assert!(
            (60.0..110.0).contains(&rnd.iops),
            "7200 rpm random: {rnd:?}"
        );
    }

    #[test]
    fn ncq_at_depth_32_beats_depth_1_for_random_reads() {
        let qd1 = run(&hdd(32), Pattern::Random, IoKind::Read, 4096, 1);
        let qd32 = run(&hdd(32), Pattern::Random, IoKind::Read, 4096, 32);
        let fifo32 = run(&hdd(0), Pattern::Random, IoKind::Read, 4096, 32);
        assert!(qd32.iops > 1.8 * qd1.iops, "qd1 {qd1:?} qd32 {qd32:?}");
        assert!(
            (fifo32.iops - qd1.iops).abs() < 0.1 * qd1.iops,
            "no NCQ, no gain: {fifo32:?}"
        );
    }

    #[test]
    fn raid0_scales_with_disks() {
        let iops = |disks| {
            let c = RaidConfig::new(
                RaidLevel::Raid0,
                1,
                disks,
                64 << 10,
                HddConfig::new(1 << 40, 7200),
            );
            run(
                &EmulConfig::Raid(c),
                Pattern::Random,
                IoKind::Read,
                4096,
                32,
            )
            .iops
        };
        let (one, four, eight) = (iops(1), iops(4), iops(8));
        assert!(
            four > 3.0 * one && eight > 1.6 * four,
            "{one} {four} {eight}"
        );
    }

    #[test]
    fn raid_partial_stripe_write_slower_than_full_stripe() {
        for level in [RaidLevel::Raid5, RaidLevel::Raid6] {
            let c = RaidConfig::new(level, 1, 6, 64 << 10, HddConfig::new(1 << 40, 7200));
            let data = c.data_disks() as u64 * (64 << 10);
            let cfg = EmulConfig::Raid(c);
            // One stripe's worth of data: written as one full stripe, or as 4 KiB partial writes
            // (read-modify-write each).
            let full = run(&cfg, Pattern::Random, IoKind::Write, data, 1);
            let partial = run(&cfg, Pattern::Random, IoKind::Write, 4096, 1);
            let full_ms = full.mean_latency.as_secs_f64() * 1e3;
            let partial_ms = partial.mean_latency.as_secs_f64() * 1e3;
            assert!(
                partial_ms > 1.3 * full_ms,
                "{level:?}: partial {partial_ms} ms, full {full_ms} ms"
            );
        }
    }

    #[test]
    fn merge_window_turns_sequential_writes_into_full_stripes() {
        let mut c = RaidConfig::new(
            RaidLevel::Raid6,
            1,
            10,
            64 << 10,
            HddConfig::new(1 << 40, 7200),
        );
        let without = run(
            &EmulConfig::Raid(c.clone()),
            Pattern::Sequential,
            IoKind::Write,
            64 << 10,
            8,
        );
        c.merge_window = Some(Duration::from_millis(1));
        let with = run(
            &EmulConfig::Raid(c),
            Pattern::Sequential,
            IoKind::Write,
            64 << 10,
            8,
        );
        assert!(
            with.mb_per_s > 3.0 * without.mb_per_s,
            "with {with:?} without {without:?}"
        );
    }

    #[test]
    fn study_raid60_calibration() {
        let cfg = EmulConfig::Raid(RaidConfig::study_raid60(4 << 40));
        let cells = calibration_cells(&cfg, 300);
        println!("{}", calibration_table(&cells));
        let within = |c: &Cell| (1.0 / 1.5..=1.5).contains(&(c.1 / c.2));
        // The random-write row, and sequential cells on both sides of the full-stripe jump:
        // 4K qd1, 4K qd32, 16K qd32, 32K qd4, 64K qd8, 64K qd32.
        for i in [0, 1, 2, 3, 4, 5, 9, 19, 21, 27, 29] {
            assert!(within(&cells[i]), "{:?}", cells[i]);
        }
    }
}

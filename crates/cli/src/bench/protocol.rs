//! Experiment protocols from the field, selectable by name (`--protocol`):
//!
//! - `plain`: measure right away on the fresh setup (a cold, empty cache).
//! - `steady`: fill until the cache is full or dirty stops rising, keep writing for `settle`
//!   seconds, then measure on a *fresh* region (offset + size) so hits do not flatter the
//!   result. This is how the study measured (fill, settle ~5 min, measure ~3 min).
//! - `fill`: cleaning `nop`; measure from empty until just before the cache is full
//!   (`stop_pct` occupancy): what the cache absorbs before cleaning matters.
//! - `flush`: cleaning `nop`; fill with dirty data up to `dirty_pct`, then time a full flush
//!   (`hybridcache -F`) or a switch to a cleaning policy (`flush_via = "alru"`) until clean.
//! - `hits`: warm the region with one sequential write pass, then measure on that region.
//! - `burst`: from an empty cache, write `burst_factor` times the cache's size and measure the
//!   whole burst: IOPS over time (the series) and the tail (fio's p99/p99.99) as the cache
//!   fills with dirty data and writes start to depend on cleaning (or on lazy flush).
//!
//! The protocol logic talks to a [`Target`], which the runner implements with real processes
//! (rig.rs) and the tests with a simulated cache, so every protocol's decisions (when the fill
//! stops, which offset is measured, what is timed) are tested without fio or a daemon. A
//! configuration without hybridcache's statistics (the core alone, nbdkit) gets the same phases
//! bounded by bytes instead of by observed occupancy: nbdkit's cache filter reports nothing.

use std::time::Instant;

use anyhow::{anyhow, Result};
use serde::{Deserialize, Serialize};

use super::fio::{FioJob, FioResult};
use super::matrix::{cache_capacity, Cell, Config, Matrix, Pattern, ProtocolName};
use crate::protocol::StatsData;

/// One point of a run's time series, one per second.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Seconds since the phase started.
    pub t: f64,
    /// Client throughput (reads + writes) over the last second, MB/s.
    pub mb_s: Option<f64>,
    pub dirty_pct: Option<f64>,
    pub occupancy_pct: Option<f64>,
    /// Free lines (unmapped, ready to take), % of the cache's lines (cache only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub free_pct: Option<f64>,
    /// Clean lines (mapped, nothing dirty: what eviction may take once committed), %.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub clean_pct: Option<f64>,
    /// Cleaning throughput: lines written to the core and marked clean over the last second.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cleaned_lines_s: Option<f64>,
}

impl Sample {
    pub fn from_stats(t: f64, s: &StatsData, mb_s: Option<f64>) -> Sample {
        let total = s.total_lines.max(1) as f64;
        Sample {
            t,
            mb_s,
            dirty_pct: Some(s.dirty_lines as f64 * 100.0 / total),
            occupancy_pct: Some(s.occupancy_lines as f64 * 100.0 / total),
            free_pct: Some(s.free_lines as f64 * 100.0 / total),
            clean_pct: Some(s.occupancy_lines.saturating_sub(s.dirty_lines) as f64 * 100.0 / total),
            cleaned_lines_s: None,
        }
    }
}

/// What running fio for one phase gave.
#[derive(Debug, Clone, Default)]
pub struct PhaseRun {
    pub fio: FioResult,
    pub series: Vec<Sample>,
    /// The stop rule ended the phase (fio was stopped before its runtime or size).
    pub stopped_early: bool,
    pub seconds: f64,
}

/// What a protocol needs from a configuration under test.
pub trait Target {
    fn config(&self) -> Config;
    /// Whether hybridcache's statistics are there (the `cache` configuration).
    fn has_stats(&self) -> bool;
    /// Bytes the cache holds (hybridcache's or nbdkit's), if there is one and it is known.
    fn cache_bytes(&self) -> Option<u64>;
    /// Run fio; `stop` sees a sample every second and ends the phase early by returning true.
    fn run(
        &mut self,
        phase: &str,
        job: &FioJob,
        stop: &mut dyn FnMut(&Sample) -> bool,
    ) -> Result<PhaseRun>;
    fn stats(&mut self) -> Result<Option<StatsData>>;
    fn set_cleaning(&mut self, policy: &str) -> Result<()>;
    /// Flush the cache's dirty data to the core (`-F` for hybridcache, an NBD flush for nbdkit).
    fn flush(&mut self) -> Result<()>;
    /// Wait about a second (virtual in tests).
    fn tick(&mut self) -> Result<()>;
}

/// A phase of a cell, for the record.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Phase {
    pub name: String,
    pub seconds: f64,
    pub offset: u64,
    pub note: String,
    pub fio: Option<FioResult>,
}

/// The `flush` protocol's result.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct FlushResult {
    /// "flush" (hybridcache -F / NBD flush) or the cleaning policy switched to.
    pub via: String,
    pub seconds: f64,
    /// Dirty bytes when the flush started (None when not known: nbdkit).
    pub dirty_bytes: Option<u64>,
    pub mb_s: Option<f64>,
    /// Whether everything was clean at the end (false: gave up after drain_max).
    pub complete: bool,
    pub series: Vec<Sample>,
}

/// Everything a protocol measured for one cell.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct CellOutcome {
    /// The figures of the measured phase: the table values.
    pub fio: FioResult,
    /// Time series of the measured phase.
    pub series: Vec<Sample>,
    pub phases: Vec<Phase>,
    pub stats_before: Option<StatsData>,
    pub stats_after: Option<StatsData>,
    pub flush: Option<FlushResult>,
    pub notes: Vec<String>,
}

fn job(m: &Matrix, cell: &Cell, name: &str, pattern: Pattern, offset: u64, uri: &str) -> FioJob {
    FioJob {
        name: name.into(),
        uri: uri.into(),
        pattern,
        bs: cell.bs,
        iodepth: cell.iodepth,
        numjobs: cell.numjobs,
        offset,
        size: m.size,
        runtime: Some(m.runtime),
        ramp: m.ramp,
        io_size: None,
        distribution: m.distribution.clone(),
    }
}

/// The write pattern that fills a cache the way the cell's workload would.
fn fill_pattern(p: Pattern) -> Pattern {
    if p.sequential() {
        Pattern::Write
    } else {
        Pattern::RandWrite
    }
}

fn full(s: &Sample) -> bool {
    s.occupancy_pct.unwrap_or(0.0) >= 99.5
}

/// Run the cell's protocol against `t`; `uri` is what fio connects to.
pub fn run_cell(t: &mut dyn Target, m: &Matrix, cell: &Cell, uri: &str) -> Result<CellOutcome> {
    let mut out = CellOutcome::default();
    let p = &m.protocol;
    let per_job = |bytes: u64| (bytes / cell.numjobs.max(1) as u64).max(cell.bs);
    let mut measure_offset = m.offset;
    let mut measure = job(m, cell, "measure", cell.pattern, m.offset, uri);
    // Stop rule of the measured phase (fill protocol only).
    let mut stop_at_occupancy: Option<f64> = None;

    match p.name {
        ProtocolName::Plain => {}
        ProtocolName::Steady => {
            if let (Config::Cache, Some(policy)) = (t.config(), &m.cache.cleaning) {
                t.set_cleaning(policy)?;
            }
            if t.config() != Config::Core {
                let mut fill = job(m, cell, "fill", fill_pattern(cell.pattern), m.offset, uri);
                fill.runtime = Some(p.fill_max);
                fill.ramp = 0;
                if t.has_stats() {
                    // Full, or dirty no longer rising over `plateau` seconds; then settle.
                    let mut history: Vec<f64> = Vec::new();
                    let mut reached: Option<(f64, &'static str)> = None;
                    let (plateau, settle) = (p.plateau as usize, p.settle as f64);
                    let mut rule = |s: &Sample| {
                        history.push(s.dirty_pct.unwrap_or(0.0));
                        if reached.is_none() {
                            let flat = history.len() > plateau
                                && history[history.len() - 1]
                                    - history[history.len() - 1 - plateau]
                                    < 0.5;
                            if full(s) {
                                reached = Some((s.t, "full"));
                            } else if flat {
                                reached = Some((s.t, "dirty stopped rising"));
                            }
                        }
                        matches!(reached, Some((at, _)) if s.t - at >= settle)
                    };
                    let r = t.run("fill", &fill, &mut rule)?;
                    let note = match reached {
                        Some((at, why)) => {
                            format!("{why} after {at:.0} s, then settled {settle:.0} s")
                        }
                        None => {
                            out.notes.push(format!(
                                "the fill did not reach a full cache or a dirty plateau within fill_max ({} s)",
                                p.fill_max
                            ));
                            "fill_max reached".into()
                        }
                    };
                    out.phases.push(Phase {
                        name: "fill+settle".into(),
                        seconds: r.seconds,
                        offset: m.offset,
                        note,
                        fio: Some(r.fio),
                    });
                } else {
                    // No statistics: write the cache's size once, then settle by time.
                    let cap = t.cache_bytes();
                    fill.io_size = cap.map(per_job);
                    let r = t.run("fill", &fill, &mut |_| false)?;
                    let mut seconds = r.seconds;
                    let mut note = match cap {
                        Some(c) => format!("wrote the cache's size ({} MiB)", c >> 20),
                        None => {
                            out.notes
                                .push("cache size unknown: filled for fill_max".into());
                            "fill_max".into()
                        }
                    };
                    if p.settle > 0 {
                        let mut settle = fill.clone();
                        settle.name = "settle".into();
                        settle.io_size = None;
                        settle.runtime = Some(p.settle);
                        let r = t.run("settle", &settle, &mut |_| false)?;
                        seconds += r.seconds;
                        note.push_str(&format!(", then settled {} s", p.settle));
                    }
                    out.phases.push(Phase {
                        name: "fill+settle".into(),
                        seconds,
                        offset: m.offset,
                        note,
                        fio: Some(r.fio),
                    });
                }
            }
            // A fresh region for every configuration alike, so the comparison is fair.
            measure_offset = m.offset + m.size;
        }
        ProtocolName::Fill => {
            if t.config() == Config::Cache {
                t.set_cleaning("nop")
                    .map_err(|e| anyhow!("the fill protocol needs cleaning nop: {e:#}"))?;
            }
            if t.has_stats() {
                stop_at_occupancy = Some(p.stop_pct);
            } else if let Some(c) = t.cache_bytes() {
                measure.io_size = Some(per_job((c as f64 * p.stop_pct / 100.0) as u64));
            }
        }
        ProtocolName::Flush => {
            if t.config() == Config::Cache {
                t.set_cleaning("nop")
                    .map_err(|e| anyhow!("the flush protocol needs cleaning nop: {e:#}"))?;
            }
            measure.name = "fill".into();
            measure.runtime = Some(p.fill_max);
            if !t.has_stats() {
                if let Some(c) = t.cache_bytes() {
                    measure.io_size = Some(per_job((c as f64 * p.dirty_pct / 100.0) as u64));
                } else {
                    measure.runtime = Some(m.runtime);
                }
            }
        }
        ProtocolName::Burst => {
            if let (Config::Cache, Some(policy)) = (t.config(), &m.cache.cleaning) {
                t.set_cleaning(policy)?;
            }
            // The core alone gets the same bytes as the cache configurations, so the three
            // bursts are the same workload.
            let cap = t
                .cache_bytes()
                .or_else(|| cache_capacity(&m.cache.device))
                .ok_or_else(|| anyhow!("burst: the cache's size is not known"))?;
            let bytes = (cap as f64 * p.burst_factor) as u64;
            measure.io_size = Some(per_job(bytes));
            measure.runtime = Some(p.fill_max);
            measure.ramp = 0;
            if m.size <= cap {
                out.notes.push(format!(
                    "the region ({} MiB) is not larger than the cache ({} MiB): the burst overwrites cached lines",
                    m.size >> 20,
                    cap >> 20
                ));
            }
        }
        ProtocolName::Hits => {
            let mut warm = job(m, cell, "warm", Pattern::Write, m.offset, uri);
            warm.bs = cell.bs.max(256 << 10);
            warm.iodepth = warm.iodepth.max(4);
            warm.runtime = None;
            warm.ramp = 0;
            let r = t.run("warm", &warm, &mut |_| false)?;
            if let Some(c) = t.cache_bytes() {
                if m.size > c {
                    out.notes.push(format!(
                        "the region ({} MiB) is larger than the cache ({} MiB): not every read can hit",
                        m.size >> 20,
                        c >> 20
                    ));
                }
            }
            out.phases.push(Phase {
                name: "warm".into(),
                seconds: r.seconds,
                offset: m.offset,
                note: "one sequential write pass over the region".into(),
                fio: Some(r.fio),
            });
        }
    }

    measure.offset = measure_offset;
    out.stats_before = t.stats()?;
    let r = if p.name == ProtocolName::Flush && t.has_stats() {
        let target = p.dirty_pct;
        let mut rule = |s: &Sample| s.dirty_pct.unwrap_or(0.0) >= target || full(s);
        t.run(&measure.name.clone(), &measure, &mut rule)?
    } else if let Some(limit) = stop_at_occupancy {
        let mut rule = |s: &Sample| s.occupancy_pct.unwrap_or(0.0) >= limit;
        t.run("measure", &measure, &mut rule)?
    } else {
        t.run("measure", &measure, &mut |_| false)?
    };
    out.stats_after = t.stats()?;
    out.phases.push(Phase {
        name: measure.name.clone(),
        seconds: r.seconds,
        offset: measure.offset,
        note: if r.stopped_early {
            match p.name {
                ProtocolName::Fill => format!("stopped at {}% occupancy", p.stop_pct),
                ProtocolName::Flush => format!("stopped at {}% dirty", p.dirty_pct),
                _ => "stopped early".into(),
            }
        } else {
            String::new()
        },
        fio: Some(r.fio),
    });
    if p.name == ProtocolName::Burst && r.seconds >= p.fill_max as f64 {
        let note = format!(
            "fill_max ({} s) reached before the whole burst was written",
            p.fill_max
        );
        out.notes.push(note.clone());
        if let Some(ph) = out.phases.last_mut() {
            ph.note = note;
        }
    }
    out.fio = r.fio;
    out.series = r.series;

    if p.name == ProtocolName::Flush {
        match t.config() {
            Config::Core => out
                .notes
                .push("no cache: the flush protocol only ran its fill workload".into()),
            _ => out.flush = Some(time_flush(t, m, out.stats_after)?),
        }
        out.stats_after = t.stats()?;
    }
    Ok(out)
}

/// Time the drain of the dirty data: one flush, or a cleaning policy until clean.
fn time_flush(t: &mut dyn Target, m: &Matrix, before: Option<StatsData>) -> Result<FlushResult> {
    let p = &m.protocol;
    let dirty_bytes = before.map(|s| s.dirty_lines * s.line_size as u64);
    let started = Instant::now();
    let mut series = Vec::new();
    let mut complete = true;
    let seconds = if p.flush_via == "flush" || !t.has_stats() {
        t.flush()?;
        started.elapsed().as_secs_f64()
    } else {
        t.set_cleaning(&p.flush_via)?;
        let mut waited = 0u64;
        loop {
            let Some(s) = t.stats()? else { break };
            let sample = Sample::from_stats(waited as f64, &s, None);
            series.push(sample);
            if s.dirty_lines == 0 {
                break;
            }
            if waited >= p.drain_max {
                complete = false;
                break;
            }
            t.tick()?;
            waited += 1;
        }
        // Virtual time in tests, wall time for real: whichever is larger is the truth.
        started.elapsed().as_secs_f64().max(waited as f64)
    };
    let via = if t.has_stats() {
        p.flush_via.clone()
    } else {
        "flush".into()
    };
    Ok(FlushResult {
        via,
        seconds,
        dirty_bytes,
        mb_s: dirty_bytes.map(|b| b as f64 / seconds.max(1e-6) / 1e6),
        complete,
        series,
    })
}

#[cfg(test)]
pub mod tests {
    use super::*;
    use crate::bench::matrix::{parse_file, resolve, Overrides};

    /// A cache simulated one second at a time: writes add lines, cleaning drains them.
    pub struct FakeTarget {
        pub config: Config,
        pub total_lines: u64,
        pub lines_per_s: u64,
        /// Lines cleaned per second unless the policy is nop.
        pub clean_per_s: u64,
        pub occupancy: u64,
        pub dirty: u64,
        pub policy: String,
        pub log: Vec<String>,
    }

    impl FakeTarget {
        pub fn new(config: Config) -> FakeTarget {
            FakeTarget {
                config,
                total_lines: 1000,
                lines_per_s: 100,
                clean_per_s: 60,
                occupancy: 0,
                dirty: 0,
                policy: "alru".into(),
                log: Vec::new(),
            }
        }

        fn data(&self) -> StatsData {
            StatsData {
                line_size: 4096,
                total_lines: self.total_lines,
                occupancy_lines: self.occupancy,
                free_lines: self.total_lines - self.occupancy,
                dirty_lines: self.dirty,
                ..Default::default()
            }
        }

        fn second(&mut self, writes: bool) {
            if writes {
                self.occupancy = (self.occupancy + self.lines_per_s).min(self.total_lines);
                self.dirty = (self.dirty + self.lines_per_s).min(self.total_lines);
            }
            if self.policy != "nop" {
                self.dirty = self.dirty.saturating_sub(self.clean_per_s);
            }
        }
    }

    impl Target for FakeTarget {
        fn config(&self) -> Config {
            self.config
        }
        fn has_stats(&self) -> bool {
            self.config == Config::Cache
        }
        fn cache_bytes(&self) -> Option<u64> {
            (self.config != Config::Core).then_some(self.total_lines * 4096)
        }
        fn run(
            &mut self,
            phase: &str,
            job: &FioJob,
            stop: &mut dyn FnMut(&Sample) -> bool,
        ) -> Result<PhaseRun> {
            let limit = job.runtime.unwrap_or(3600);
            let mut t = 0;
            let mut stopped = false;
            let mut series = Vec::new();
            let mut bytes = 0u64;
            while t < limit {
                t += 1;
                self.second(job.pattern.writes());
                bytes += self.lines_per_s * 4096;
                let s = if self.has_stats() {
                    Sample::from_stats(t as f64, &self.data(), Some(1.0))
                } else {
                    Sample {
                        t: t as f64,
                        mb_s: Some(1.0),
                        ..Default::default()
                    }
                };
                series.push(s);
                if stop(&s) {
                    stopped = true;
                    break;
                }
                let done = job.io_size.is_some_and(|n| bytes >= n * job.numjobs as u64);
                if job.runtime.is_none() || done {
                    break;
                }
            }
            self.log.push(format!(
                "{phase} {} off={} t={t}{}",
                job.pattern,
                job.offset,
                if stopped { " stopped" } else { "" }
            ));
            Ok(PhaseRun {
                fio: FioResult {
                    iops: 100.0,
                    mb_s: 0.4,
                    seconds: t as f64,
                    ..Default::default()
                },
                series,
                stopped_early: stopped,
                seconds: t as f64,
            })
        }
        fn stats(&mut self) -> Result<Option<StatsData>> {
            Ok(self.has_stats().then(|| self.data()))
        }
        fn set_cleaning(&mut self, policy: &str) -> Result<()> {
            self.log.push(format!("cleaning {policy}"));
            self.policy = policy.into();
            Ok(())
        }
        fn flush(&mut self) -> Result<()> {
            self.log.push("flush".into());
            self.dirty = 0;
            Ok(())
        }
        fn tick(&mut self) -> Result<()> {
            self.second(false);
            Ok(())
        }
    }

    fn matrix(protocol: &str, extra: &str) -> Matrix {
        let text = format!(
            "[matrix]\nsize = \"1G\"\nruntime = 5\n[core]\ndevice = \"ram:8G\"\n[cache]\ndevice = \"ram:4M\"\ncleaning = \"alru\"\n[protocol]\nname = \"{protocol}\"\nsettle = 3\nplateau = 4\nfill_max = 100\n{extra}"
        );
        resolve(&parse_file(&text).unwrap(), &Overrides::default()).unwrap()
    }

    fn cell(config: Config) -> Cell {
        Cell {
            config,
            pattern: Pattern::RandWrite,
            bs: 4096,
            numjobs: 1,
            iodepth: 1,
            rep: 0,
        }
    }

    #[test]
    fn burst_writes_a_multiple_of_the_cache_from_empty_for_every_config() {
        let m = matrix("burst", "burst_factor = 3");
        for config in [Config::Cache, Config::Core, Config::Nbdkit] {
            let mut t = FakeTarget::new(config);
            let o = run_cell(&mut t, &m, &cell(config), "uri").unwrap();
            // The fake cache's 1000 lines x 3 = 3000 lines at 100 lines a second: 30 s. The
            // core alone takes the size from the matrix's cache device, ram:4M: 3072 lines.
            let secs = if config == Config::Core { 31 } else { 30 };
            assert_eq!(o.phases.len(), 1, "{config:?}");
            assert_eq!(o.phases[0].name, "measure");
            assert_eq!(o.phases[0].seconds, secs as f64, "{config:?}: {:?}", t.log);
            assert_eq!(o.series.len(), secs);
            assert_eq!(
                t.log.last().unwrap(),
                &format!("measure randwrite off=0 t={secs}")
            );
            if config == Config::Cache {
                // The configured cleaning policy is set before the burst, never nop.
                assert_eq!(t.log[0], "cleaning alru");
                assert_eq!(o.stats_after.unwrap().occupancy_lines, 1000);
            }
        }
        // The burst is bounded by fill_max too.
        let m = matrix("burst", "burst_factor = 100");
        let mut t = FakeTarget::new(Config::Cache);
        let o = run_cell(&mut t, &m, &cell(Config::Cache), "uri").unwrap();
        assert_eq!(o.phases[0].seconds, 100.0);
        assert!(o.phases[0].note.contains("fill_max"), "{:?}", o.phases);
    }

    #[test]
    fn burst_needs_writes_and_a_known_cache_size() {
        let text = |extra: &str| {
            format!("[matrix]\nsize = \"1G\"\n[core]\ndevice = \"ram:8G\"\n[protocol]\nname = \"burst\"\n{extra}")
        };
        let err = |t: String| {
            format!(
                "{:#}",
                resolve(&parse_file(&t).unwrap(), &Overrides::default()).unwrap_err()
            )
        };
        let e = err(
            text("[cache]\ndevice = \"ram:4M\"\n[matrix]\npatterns = [\"randread\"]")
                .replace("[matrix]\nsize = \"1G\"\n", ""),
        );
        assert!(e.contains("burst needs write patterns"), "{e}");
        let e = err(text("[cache]\ndevice = \"/no/such/cache\""));
        assert!(e.contains("cache.device"), "{e}");
        let e = err(text("burst_factor = 0\n[cache]\ndevice = \"ram:4M\""));
        assert!(e.contains("protocol.burst_factor"), "{e}");
    }

    #[test]
    fn steady_fills_until_full_settles_and_measures_a_fresh_region() {
        let m = matrix("steady", "");
        let mut t = FakeTarget::new(Config::Cache);
        // Cleaning slower than writing: the cache fills up (100 lines/s in, 60 out).
        let o = run_cell(&mut t, &m, &cell(Config::Cache), "u").unwrap();
        assert_eq!(t.log[0], "cleaning alru");
        // Full (1000 lines) after 10 s, then 3 s of settling.
        assert_eq!(t.log[1], "fill randwrite off=0 t=13 stopped", "{:?}", t.log);
        assert!(
            o.phases[0].note.starts_with("full after 10 s"),
            "{:?}",
            o.phases
        );
        assert_eq!(
            t.log[2],
            format!("measure randwrite off={} t=5", 1u64 << 30)
        );
        assert_eq!(o.series.len(), 5);
        assert!(o.stats_before.is_some() && o.stats_after.is_some());
    }

    #[test]
    fn steady_stops_on_a_dirty_plateau() {
        let m = matrix("steady", "");
        let mut t = FakeTarget::new(Config::Cache);
        t.total_lines = 1_000_000; // never full
        t.clean_per_s = 100; // drains as fast as it fills: dirty flat at 0
        run_cell(&mut t, &m, &cell(Config::Cache), "u").unwrap();
        // Flat for 4 samples at t=5, settle 3 s more.
        assert_eq!(t.log[1], "fill randwrite off=0 t=8 stopped", "{:?}", t.log);
    }

    #[test]
    fn steady_without_statistics_fills_by_bytes_and_the_core_is_not_filled() {
        let m = matrix("steady", "");
        let mut t = FakeTarget::new(Config::Nbdkit);
        run_cell(&mut t, &m, &cell(Config::Nbdkit), "u").unwrap();
        assert_eq!(t.log[0], "fill randwrite off=0 t=10", "{:?}", t.log);
        assert_eq!(t.log[1], "settle randwrite off=0 t=3");
        assert!(t.log[2].starts_with(&format!("measure randwrite off={}", 1u64 << 30)));
        let mut core = FakeTarget::new(Config::Core);
        run_cell(&mut core, &m, &cell(Config::Core), "u").unwrap();
        assert_eq!(
            core.log,
            vec![format!("measure randwrite off={} t=5", 1u64 << 30)]
        );
    }

    #[test]
    fn fill_sets_nop_and_stops_before_full() {
        let m = matrix("fill", "stop_pct = 50");
        let mut t = FakeTarget::new(Config::Cache);
        let mut mm = m.clone();
        mm.runtime = 100;
        let o = run_cell(&mut t, &mm, &cell(Config::Cache), "u").unwrap();
        assert_eq!(
            t.log,
            vec!["cleaning nop", "measure randwrite off=0 t=5 stopped"]
        );
        assert!(o.phases.last().unwrap().note.contains("50% occupancy"));
    }

    #[test]
    fn flush_fills_dirty_then_times_the_flush_or_the_drain() {
        let m = matrix("flush", "dirty_pct = 80");
        let mut t = FakeTarget::new(Config::Cache);
        let o = run_cell(&mut t, &m, &cell(Config::Cache), "u").unwrap();
        assert_eq!(
            t.log,
            vec!["cleaning nop", "fill randwrite off=0 t=8 stopped", "flush"]
        );
        let f = o.flush.unwrap();
        assert_eq!(f.via, "flush");
        assert_eq!(f.dirty_bytes, Some(800 * 4096));
        assert!(f.complete);
        assert_eq!(o.stats_after.unwrap().dirty_lines, 0);

        let m = matrix("flush", "dirty_pct = 80\nflush_via = \"alru\"");
        let mut t = FakeTarget::new(Config::Cache);
        let o = run_cell(&mut t, &m, &cell(Config::Cache), "u").unwrap();
        assert_eq!(t.log[2], "cleaning alru");
        let f = o.flush.unwrap();
        // 800 dirty lines at 60 per second: 14 ticks.
        assert!(f.seconds >= 14.0, "{f:?}");
        assert_eq!(f.series.last().unwrap().dirty_pct, Some(0.0));
    }

    #[test]
    fn hits_warms_then_measures_the_same_region() {
        let m = matrix("hits", "");
        let mut t = FakeTarget::new(Config::Cache);
        let o = run_cell(&mut t, &m, &cell(Config::Cache), "u").unwrap();
        assert_eq!(t.log[0], "warm write off=0 t=1");
        assert_eq!(t.log[1], "measure randwrite off=0 t=5");
        // The 1 GiB region is larger than the 4 MiB cache.
        assert!(o.notes[0].contains("larger than the cache"));
    }
}

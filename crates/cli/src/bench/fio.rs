//! fio: the command line for one phase of a cell, and the figures read back from its JSON.
//!
//! fio's nbd engine prints a line on stdout before its JSON, so the JSON always goes to a file
//! (`--output=FILE --output-format=json`). Jobs are reported as one group (`--group_reporting`),
//! and with `numjobs > 1` each job gets its own slice of the region (`offset_increment`), as
//! a storage engineer would set it: jobs writing the same blocks would measure overwrites.
//! Latency figures are completion latency (`clat_ns`), the one fio's summaries and the study use.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::matrix::Pattern;

/// What one fio run does.
#[derive(Debug, Clone, PartialEq)]
pub struct FioJob {
    pub name: String,
    pub uri: String,
    pub pattern: Pattern,
    pub bs: u64,
    pub iodepth: u32,
    pub numjobs: u32,
    /// Region start and length (split between jobs).
    pub offset: u64,
    pub size: u64,
    /// Seconds; `None` means "until `size` is done once" (warm-up passes).
    pub runtime: Option<u64>,
    pub ramp: u64,
    /// Stop after this many bytes per job (fio's io_size), for bounded fills.
    pub io_size: Option<u64>,
    /// fio's random_distribution (random patterns only).
    pub distribution: Option<String>,
}

/// The percentiles we ask for; 99.99 is the tail the field quotes.
const PERCENTILES: &str = "50:99:99.9:99.99";

impl FioJob {
    /// fio's arguments, writing the JSON to `json` and the 1 s bandwidth log next to it.
    pub fn args(&self, json: &Path, bw_log_prefix: Option<&Path>) -> Vec<String> {
        let per_job = (self.size / self.numjobs.max(1) as u64) / self.bs * self.bs;
        let mut a = vec![
            format!("--name={}", self.name),
            "--ioengine=nbd".into(),
            format!("--uri={}", self.uri),
            format!("--rw={}", self.pattern.fio_rw()),
            format!("--bs={}", self.bs),
            format!("--iodepth={}", self.iodepth),
            format!("--numjobs={}", self.numjobs),
            format!("--offset={}", self.offset),
            format!("--size={per_job}"),
            format!("--offset_increment={per_job}"),
            "--group_reporting".into(),
            format!("--percentile_list={PERCENTILES}"),
            // Fresh random offsets every run: a repeated sequence would let caches see hits.
            "--randrepeat=0".into(),
            "--norandommap".into(),
            "--output-format=json".into(),
            format!("--output={}", json.display()),
        ];
        if let (Some(d), false) = (&self.distribution, self.pattern.sequential()) {
            a.push(format!("--random_distribution={d}"));
        }
        if let Some(mix) = self.pattern.rwmixread() {
            a.push(format!("--rwmixread={mix}"));
        }
        if let Some(rt) = self.runtime {
            // With a byte budget the runtime is only a cap: time_based would loop over io_size.
            if self.io_size.is_none() {
                a.push("--time_based".into());
            }
            a.push(format!("--runtime={rt}"));
        }
        if self.ramp > 0 {
            a.push(format!("--ramp_time={}", self.ramp));
        }
        if let Some(n) = self.io_size {
            a.push(format!("--io_size={n}"));
        }
        if let Some(prefix) = bw_log_prefix {
            a.push(format!("--write_bw_log={}", prefix.display()));
            a.push("--log_avg_msec=1000".into());
        }
        a
    }
}

/// One direction's figures.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct DirStats {
    pub iops: f64,
    /// 10^6 bytes per second, as fio's MB/s.
    pub mb_s: f64,
    pub bytes: u64,
    /// Completion latency, microseconds.
    pub lat_mean_us: f64,
    pub lat_p99_us: f64,
    pub lat_p9999_us: f64,
}

/// A fio run's figures: both directions and their sum.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct FioResult {
    pub read: DirStats,
    pub write: DirStats,
    pub iops: f64,
    pub mb_s: f64,
    /// Seconds fio measured (the longer direction).
    pub seconds: f64,
}

impl FioResult {
    /// The latency figures of the direction that carried the run (writes when both did).
    pub fn main_dir(&self) -> &DirStats {
        if self.write.bytes > 0 || self.read.bytes == 0 {
            &self.write
        } else {
            &self.read
        }
    }
}

fn num(v: &Value, path: &[&str]) -> f64 {
    let mut cur = v;
    for p in path {
        match cur.get(p) {
            Some(x) => cur = x,
            None => return 0.0,
        }
    }
    cur.as_f64().unwrap_or(0.0)
}

fn dir(job: &Value, name: &str) -> DirStats {
    let d = &job[name];
    let pct = |p: &str| num(d, &["clat_ns", "percentile", p]) / 1000.0;
    DirStats {
        iops: num(d, &["iops"]),
        mb_s: num(d, &["bw_bytes"]) / 1e6,
        bytes: num(d, &["io_bytes"]) as u64,
        lat_mean_us: num(d, &["clat_ns", "mean"]) / 1000.0,
        lat_p99_us: pct("99.000000"),
        lat_p9999_us: pct("99.990000"),
    }
}

/// Parse fio's JSON output (with `--group_reporting`, one job entry).
pub fn parse_json(text: &str) -> Result<FioResult> {
    // fio may print notes ("fio: ...") before the JSON even with --output; skip to the brace.
    let start = text
        .find('{')
        .ok_or_else(|| anyhow!("no JSON object in fio's output"))?;
    let v: Value = serde_json::from_str(&text[start..]).context("fio's JSON does not parse")?;
    let jobs = v["jobs"]
        .as_array()
        .ok_or_else(|| anyhow!("fio's JSON has no 'jobs' array"))?;
    let job = jobs
        .first()
        .ok_or_else(|| anyhow!("fio's JSON has no job"))?;
    if let Some(err) = job["error"].as_i64().filter(|e| *e != 0) {
        bail!("fio's job failed with error {err} ({})", libc_strerror(err));
    }
    let read = dir(job, "read");
    let write = dir(job, "write");
    let seconds = num(job, &["read", "runtime"]).max(num(job, &["write", "runtime"])) / 1000.0;
    Ok(FioResult {
        read,
        write,
        iops: read.iops + write.iops,
        mb_s: read.mb_s + write.mb_s,
        seconds,
    })
}

fn libc_strerror(errno: i64) -> String {
    std::io::Error::from_raw_os_error(errno as i32).to_string()
}

/// fio's `--write_bw_log` files with `log_avg_msec=1000`: `time_ms, KiB/s, dir, bs, offset`.
/// Returns (second, MB/s) summed over directions and over the per-job files given.
pub fn parse_bw_logs(texts: &[String]) -> Vec<(f64, f64)> {
    let mut by_second: std::collections::BTreeMap<u64, f64> = Default::default();
    for text in texts {
        for line in text.lines() {
            let mut f = line.split(',').map(str::trim);
            let (Some(t), Some(kib)) = (f.next(), f.next()) else {
                continue;
            };
            let (Ok(t), Ok(kib)) = (t.parse::<u64>(), kib.parse::<f64>()) else {
                continue;
            };
            // Samples land a little before or after each whole second; round to the nearest.
            let sec = (t + 500) / 1000;
            *by_second.entry(sec).or_default() += kib * 1024.0 / 1e6;
        }
    }
    by_second
        .into_iter()
        .map(|(s, mb)| (s as f64, mb))
        .collect()
}

/// Read the bandwidth logs fio wrote for `prefix` (`PREFIX_bw.N.log`, one per job).
pub fn read_bw_logs(prefix: &Path) -> Vec<(f64, f64)> {
    let (Some(dir), Some(stem)) = (prefix.parent(), prefix.file_name()) else {
        return Vec::new();
    };
    let stem = format!("{}_bw.", stem.to_string_lossy());
    let mut texts = Vec::new();
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with(&stem) && name.ends_with(".log") {
                if let Ok(t) = std::fs::read_to_string(e.path()) {
                    texts.push(t);
                }
            }
        }
    }
    parse_bw_logs(&texts)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = include_str!("testdata/fio-randrw70.json");

    #[test]
    fn parses_a_captured_randrw_run() {
        let r = parse_json(SAMPLE).unwrap();
        assert!(r.read.iops > 0.0 && r.write.iops > 0.0);
        assert!((r.iops - (r.read.iops + r.write.iops)).abs() < 1e-9);
        // 70% reads.
        let share = r.read.iops / r.iops;
        assert!((0.6..0.8).contains(&share), "{share}");
        assert!(r.read.lat_p9999_us >= r.read.lat_p99_us);
        assert!(r.read.lat_p99_us > 0.0 && r.read.lat_mean_us > 0.0);
        // 4 KiB blocks: MB/s = IOPS * 4096 / 1e6.
        assert!((r.mb_s - r.iops * 4096.0 / 1e6).abs() / r.mb_s < 0.05);
        assert!(r.seconds > 0.5);
        assert_eq!(r.main_dir(), &r.write);
    }

    #[test]
    fn leading_notes_and_failures() {
        let with_note = format!("note: nbd engine\n{SAMPLE}");
        assert!(parse_json(&with_note).is_ok());
        assert!(parse_json("fio: no such engine").is_err());
        let failed = r#"{"jobs":[{"error":5,"read":{},"write":{}}]}"#;
        let e = parse_json(failed).unwrap_err().to_string();
        assert!(e.contains("error 5"), "{e}");
    }

    #[test]
    fn bandwidth_logs_sum_jobs() {
        let log = include_str!("testdata/fio-bw.log").to_string();
        let s = parse_bw_logs(&[log.clone(), log]);
        assert_eq!(s.len(), 1);
        assert_eq!(s[0].0, 1.0);
        assert!(s[0].1 > 0.0);
    }

    #[test]
    fn job_arguments() {
        let j = FioJob {
            name: "m".into(),
            uri: "nbd+unix:///x?socket=/s".into(),
            pattern: Pattern::RandRw(30),
            bs: 4096,
            iodepth: 8,
            numjobs: 2,
            offset: 0,
            size: 1 << 20,
            runtime: Some(3),
            ramp: 0,
            io_size: None,
            distribution: None,
        };
        let a = j.args(Path::new("/o.json"), None);
        assert!(!a.iter().any(|x| x.starts_with("--random_distribution")));
        let zipf = FioJob {
            distribution: Some("zipf:1.2".into()),
            ..j.clone()
        };
        let a2 = zipf.args(Path::new("/o.json"), None);
        assert!(a2.contains(&"--random_distribution=zipf:1.2".to_string()));
        let seq = FioJob {
            pattern: Pattern::Read,
            ..zipf
        };
        let a3 = seq.args(Path::new("/o.json"), None);
        assert!(!a3.iter().any(|x| x.starts_with("--random_distribution")));
        assert!(a.contains(&"--rwmixread=30".to_string()));
        assert!(a.contains(&"--size=524288".to_string()));
        assert!(a.contains(&"--offset_increment=524288".to_string()));
        assert!(a.contains(&"--output=/o.json".to_string()));
        assert!(a.contains(&"--time_based".to_string()));
        let bounded = FioJob {
            io_size: Some(1 << 20),
            ..j
        };
        let a = bounded.args(Path::new("/o.json"), None);
        assert!(!a.contains(&"--time_based".to_string()));
        assert!(a.contains(&"--runtime=3".to_string()));
    }
}

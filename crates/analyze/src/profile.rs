//! Device profiles: how fast the core and the cache device are per access pattern, so the
//! recommendation rules can be derived from the hardware at hand instead of fixed tables.
//!
//! A profile lists measured points (pattern x direction x block size x queue depth -> IOPS or
//! MB/s, MB = 10^6 bytes as fio prints them). Lookups between points interpolate in log2(queue
//! depth) at the nearest measured block size; a block size with no measurement keeps the IOPS
//! of the nearest one for random IO (seek-bound) and its MB/s for sequential IO
//! (bandwidth-bound), capped by the device's `max_mb_s`. Reads without read figures fall back
//! to the write figures and say so in the estimate's `basis`.

use std::path::Path;

use serde::{Deserialize, Serialize};

/// Access pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    Random,
    Sequential,
}

/// Data direction.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Dir {
    Read,
    Write,
}

/// One measurement. Give `iops` or `mb_s` (or both).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PerfPoint {
    pub pattern: Pattern,
    pub dir: Dir,
    pub block_kib: u32,
    pub queue_depth: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iops: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mb_s: Option<f64>,
}

impl PerfPoint {
    fn mb_s(&self) -> f64 {
        self.mb_s
            .or_else(|| self.iops.map(|i| i * self.block_kib as f64 * 1024.0 / 1e6))
            .unwrap_or(0.0)
    }
}

/// One device's measured speeds.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceModel {
    pub name: String,
    /// Flash (an SSD or an SSD array): a write-back queue in front of it costs tail latency
    /// (the write-back tail rule in recommend.rs).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub flash: bool,
    /// Bandwidth ceiling (MB/s) for extrapolated points.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_mb_s: Option<f64>,
    pub points: Vec<PerfPoint>,
}

/// An estimated speed and where it came from.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Estimate {
    pub mb_s: f64,
    pub iops: f64,
    /// True when a measured point matched exactly.
    pub measured: bool,
    /// How it was obtained, for the report.
    pub basis: String,
}

impl DeviceModel {
    /// Speed of `pattern`/`dir` at `block` bytes and queue depth `qd`.
    pub fn estimate(&self, pattern: Pattern, dir: Dir, block: u64, qd: u32) -> Option<Estimate> {
        let qd = qd.max(1);
        let block = block.max(512);
        let other = match dir {
            Dir::Read => Dir::Write,
            Dir::Write => Dir::Read,
        };
        let (pts, fallback): (Vec<&PerfPoint>, Option<&str>) = {
            let exact: Vec<_> = self
                .points
                .iter()
                .filter(|p| p.pattern == pattern && p.dir == dir)
                .collect();
            if !exact.is_empty() {
                (exact, None)
            } else {
                let alt: Vec<_> = self
                    .points
                    .iter()
                    .filter(|p| p.pattern == pattern && p.dir == other)
                    .collect();
                if alt.is_empty() {
                    return None;
                }
                (
                    alt,
                    Some("no figure for this direction; the other direction's used"),
                )
            }
        };
        // Nearest measured block size in log2 (ties go to the larger).
        let lb = (block as f64).log2();
        let best_bs = pts.iter().map(|p| p.block_kib).min_by(|a, b| {
            let da = ((*a as f64 * 1024.0).log2() - lb).abs();
            let db = ((*b as f64 * 1024.0).log2() - lb).abs();
            da.total_cmp(&db).then(b.cmp(a))
        })?;
        let mut row: Vec<&PerfPoint> = pts.into_iter().filter(|p| p.block_kib == best_bs).collect();
        row.sort_by_key(|p| p.queue_depth);
        let (mb_s_at_bs, qd_exact) = interpolate(&row, qd);
        let bs_bytes = best_bs as u64 * 1024;
        let mut mb_s = if bs_bytes == block {
            mb_s_at_bs
        } else {
            match pattern {
                Pattern::Random => mb_s_at_bs / bs_bytes as f64 * block as f64,
                Pattern::Sequential => mb_s_at_bs,
            }
        };
        if let Some(cap) = self.max_mb_s {
            mb_s = mb_s.min(cap);
        }
        let measured = qd_exact && bs_bytes == block && fallback.is_none();
        let mut basis = if measured {
            "measured".to_string()
        } else {
            format!("estimated from {} KiB points", best_bs)
        };
        if let Some(f) = fallback {
            basis = format!("{basis}; {f}");
        }
        Some(Estimate {
            mb_s,
            iops: mb_s * 1e6 / block as f64,
            measured,
            basis,
        })
    }

    /// The deepest queue depth measured for a pattern (what a cleaner can drive the device at).
    pub fn max_queue_depth(&self, pattern: Pattern, dir: Dir) -> u32 {
        self.points
            .iter()
            .filter(|p| p.pattern == pattern && p.dir == dir)
            .map(|p| p.queue_depth)
            .max()
            .unwrap_or(1)
    }

    /// The largest block size measured for a pattern, bytes.
    pub fn max_block(&self, pattern: Pattern, dir: Dir) -> u64 {
        self.points
            .iter()
            .filter(|p| p.pattern == pattern && p.dir == dir)
            .map(|p| p.block_kib as u64 * 1024)
            .max()
            .unwrap_or(4096)
    }
}

/// Linear interpolation of MB/s in log2(qd) over points sorted by qd; clamps outside.
fn interpolate(row: &[&PerfPoint], qd: u32) -> (f64, bool) {
    if let Some(p) = row.iter().find(|p| p.queue_depth == qd) {
        return (p.mb_s(), true);
    }
    let first = row[0];
    let last = row[row.len() - 1];
    if qd <= first.queue_depth {
        return (first.mb_s(), false);
    }
    if qd >= last.queue_depth {
        return (last.mb_s(), false);
    }
    for w in row.windows(2) {
        let (a, b) = (w[0], w[1]);
        if a.queue_depth < qd && qd < b.queue_depth {
            let (la, lb, lq) = (
                (a.queue_depth as f64).log2(),
                (b.queue_depth as f64).log2(),
                (qd as f64).log2(),
            );
            let t = (lq - la) / (lb - la);
            return (a.mb_s() + t * (b.mb_s() - a.mb_s()), false);
        }
    }
    (last.mb_s(), false)
}

/// The core and the cache device, plus limits of the cache software.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct DeviceProfile {
    pub name: String,
    pub core: DeviceModel,
    pub cache: DeviceModel,
    /// Highest rate at which the cache software can clean, MB/s (None: only the core limits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cleaning_limit_mb_s: Option<f64>,
    /// Where the figures come from, which are estimates.
    #[serde(default)]
    pub notes: Vec<String>,
}

/// Errors loading a profile.
#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("reading {path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("profile TOML: {0}")]
    Toml(#[from] toml::de::Error),
    #[error("profile JSON: {0}")]
    Json(#[from] serde_json::Error),
    #[error("profile `{0}`: {1}")]
    Invalid(String, String),
    #[error("unknown built-in profile `{0}` (raid60-study, ssd-raid5x9, nvme)")]
    UnknownBuiltin(String),
}

fn pt(
    pattern: Pattern,
    dir: Dir,
    block_kib: u32,
    qd: u32,
    iops: Option<f64>,
    mb_s: Option<f64>,
) -> PerfPoint {
    PerfPoint {
        pattern,
        dir,
        block_kib,
        queue_depth: qd,
        iops,
        mb_s,
    }
}

const QDS: [u32; 5] = [1, 4, 8, 16, 32];

impl DeviceProfile {
    pub fn from_toml_str(s: &str) -> Result<DeviceProfile, ProfileError> {
        let p: DeviceProfile = toml::from_str(s)?;
        p.validate()?;
        Ok(p)
    }

    pub fn from_json_str(s: &str) -> Result<DeviceProfile, ProfileError> {
        let p: DeviceProfile = serde_json::from_str(s)?;
        p.validate()?;
        Ok(p)
    }

    /// Loads a `.json` file as JSON and anything else as TOML.
    pub fn load(path: &Path) -> Result<DeviceProfile, ProfileError> {
        let s = std::fs::read_to_string(path).map_err(|source| ProfileError::Io {
            path: path.display().to_string(),
            source,
        })?;
        if path.extension().is_some_and(|e| e == "json") {
            Self::from_json_str(&s)
        } else {
            Self::from_toml_str(&s)
        }
    }

    /// A built-in profile by name.
    pub fn builtin(name: &str) -> Result<DeviceProfile, ProfileError> {
        match name {
            "raid60-study" | "raid60-study-nvme" | "raid60" | "study60" => Ok(Self::raid60_study()),
            "ssd-raid5x9" | "sata-raid5x9" => Ok(Self::ssd_raid5x9()),
            "nvme" => Ok(DeviceProfile {
                name: "generic NVMe (as both devices)".into(),
                core: Self::generic_nvme(),
                cache: Self::generic_nvme(),
                cleaning_limit_mb_s: None,
                notes: vec![],
            }),
            other => Err(ProfileError::UnknownBuiltin(other.to_string())),
        }
    }

    pub fn to_toml_string(&self) -> String {
        toml::to_string(self).unwrap_or_default()
    }

    fn validate(&self) -> Result<(), ProfileError> {
        for (which, m) in [("core", &self.core), ("cache", &self.cache)] {
            if m.points.is_empty() {
                return Err(ProfileError::Invalid(
                    self.name.clone(),
                    format!("{which} has no points"),
                ));
            }
            for p in &m.points {
                let ok = p.block_kib > 0
                    && p.queue_depth > 0
                    && (p.iops.is_some_and(|v| v > 0.0) || p.mb_s.is_some_and(|v| v > 0.0));
                if !ok {
                    return Err(ProfileError::Invalid(
                        self.name.clone(),
                        format!("{which} point {p:?} needs block_kib, queue_depth > 0 and a positive iops or mb_s"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The study's 40-HDD RAID 60 (domain.md §10) as the core, with a generic NVMe cache.
    pub fn raid60_study() -> DeviceProfile {
        let mut points = Vec::new();
        // Random 4 KiB writes, measured.
        for (qd, iops) in QDS.iter().zip([63.0, 201.0, 337.0, 560.0, 929.0]) {
            points.push(pt(Pattern::Random, Dir::Write, 4, *qd, Some(iops), None));
        }
        // Sequential writes, MB/s, measured.
        let seq: [(u32, [f64; 5]); 5] = [
            (4, [5.0, 12.0, 18.9, 26.8, 32.9]),
            (8, [10.0, 23.0, 26.4, 42.2, 39.8]),
            (16, [19.0, 47.0, 50.9, 66.6, 1220.0]),
            (32, [35.0, 69.0, 110.6, 1378.0, 2773.0]),
            (64, [64.0, 155.0, 1495.0, 2999.0, 5415.0]),
        ];
        for (bs, row) in seq {
            for (qd, mb) in QDS.iter().zip(row) {
                points.push(pt(Pattern::Sequential, Dir::Write, bs, *qd, None, Some(mb)));
            }
        }
        // Random 4 KiB reads: only the mixed run was measured (590 read + 592 write IOPS at
        // iodepth 32); a pure read run is at least as fast, so 1182 at 32. The lower depths
        // scale like the write curve from one HDD's ~125 IOPS (estimates).
        for (qd, iops) in QDS.iter().zip([125.0, 330.0, 520.0, 800.0, 1182.0]) {
            points.push(pt(Pattern::Random, Dir::Read, 4, *qd, Some(iops), None));
        }
        DeviceProfile {
            name: "study RAID 60 (40 HDD) core + generic NVMe cache".into(),
            core: DeviceModel {
                name: "RAID 60, 40 HDD, stripe 64 KiB".into(),
                flash: false,
                max_mb_s: None,
                points,
            },
            cache: Self::generic_nvme(),
            cleaning_limit_mb_s: None,
            notes: vec![
                "core random/sequential write figures: measured in the study (docs/devices.md)".into(),
                "core random read figures: estimated (only a 50/50 mixed run at iodepth 32 was measured)".into(),
                "core sequential reads: not measured; the write figures stand in".into(),
                "cache: a generic NVMe SSD (400k IOPS 4 KiB random, 2.5 GB/s sequential)".into(),
            ],
        }
    }

    /// The emulated `ssd:preset=sata-raid5x9` (docs/devices.md: nine SATA SSDs behind a RAID 5
    /// controller, the ASPLOS'23 study's array) as the core, with a generic NVMe cache. The
    /// figures follow from the preset's model rather than from a measurement: a 16 KiB flash
    /// page keeps one of 72 units busy 72/iops seconds, plus 40 us of latency, so a request
    /// alone takes about 930 us to write and 125 us to read, and depth buys throughput until the
    /// units (or the controller's 450k request ceiling, or the link) run out.
    pub fn ssd_raid5x9() -> DeviceProfile {
        const UNITS: f64 = 72.0;
        const LAT_S: f64 = 40e-6;
        let page_s = |iops: f64| UNITS / iops;
        let mut points = Vec::new();
        for dir in [Dir::Read, Dir::Write] {
            let (iops, bw, cap) = match dir {
                Dir::Read => (855_000.0, 4.5e9, 450_000.0),
                Dir::Write => (81_000.0, 3.6e9, 450_000.0),
            };
            for qd in [1u32, 4, 8, 16, 32, 64] {
                for (pattern, kib) in [
                    (Pattern::Random, 4u32),
                    (Pattern::Sequential, 64),
                    (Pattern::Sequential, 1024),
                ] {
                    let bytes = kib as f64 * 1024.0;
                    let pages = (bytes / 16384.0).ceil();
                    // One request alone: its pages in parallel on free units, its transfer, the latency.
                    let alone = page_s(iops) * (pages / UNITS).ceil() + bytes / bw + LAT_S;
                    let by_depth = qd as f64 / alone;
                    let by_units = iops / pages;
                    let by_link = bw / bytes;
                    let req_s = by_depth.min(by_units).min(by_link).min(cap);
                    points.push(pt(pattern, dir, kib, qd, None, Some(req_s * bytes / 1e6)));
                }
            }
        }
        DeviceProfile {
            name: "emulated SSD RAID 5 (9 SATA SSD, sata-raid5x9) core + generic NVMe cache".into(),
            core: DeviceModel {
                name: "RAID 5, 9 SATA SSD (ssd:preset=sata-raid5x9)".into(),
                flash: true,
                max_mb_s: Some(4500.0),
                points,
            },
            cache: Self::generic_nvme(),
            cleaning_limit_mb_s: None,
            notes: vec![
                "core: derived from the ssd:preset=sata-raid5x9 model (docs/devices.md), not measured".into(),
                "cache: a generic NVMe SSD (400k IOPS 4 KiB random, 2.5 GB/s sequential)".into(),
            ],
        }
    }

    /// A generic NVMe SSD: 400k IOPS 4 KiB random at depth 32, 2.5 GB/s sequential.
    pub fn generic_nvme() -> DeviceModel {
        let mut points = Vec::new();
        for (qd, (r, w)) in QDS.iter().zip([
            (15_000.0, 50_000.0),
            (60_000.0, 150_000.0),
            (120_000.0, 250_000.0),
            (220_000.0, 350_000.0),
            (400_000.0, 400_000.0),
        ]) {
            points.push(pt(Pattern::Random, Dir::Read, 4, *qd, Some(r), None));
            points.push(pt(Pattern::Random, Dir::Write, 4, *qd, Some(w), None));
            // Sequential 4 KiB runs at the random rate on flash.
            points.push(pt(Pattern::Sequential, Dir::Read, 4, *qd, Some(r), None));
            points.push(pt(Pattern::Sequential, Dir::Write, 4, *qd, Some(w), None));
        }
        for (qd, mb) in QDS.iter().zip([700.0, 1800.0, 2500.0, 2500.0, 2500.0]) {
            for dir in [Dir::Read, Dir::Write] {
                points.push(pt(Pattern::Sequential, dir, 64, *qd, None, Some(mb)));
                points.push(pt(Pattern::Random, dir, 64, *qd, None, Some(mb * 0.9)));
            }
        }
        for (qd, mb) in QDS.iter().zip([1200.0, 2500.0, 2500.0, 2500.0, 2500.0]) {
            for dir in [Dir::Read, Dir::Write] {
                points.push(pt(Pattern::Sequential, dir, 128, *qd, None, Some(mb)));
            }
        }
        DeviceModel {
            name: "generic NVMe SSD".into(),
            flash: true,
            max_mb_s: Some(2500.0),
            points,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raid_lookups() {
        let p = DeviceProfile::raid60_study();
        let e = p
            .core
            .estimate(Pattern::Random, Dir::Write, 4096, 1)
            .unwrap();
        assert!(e.measured);
        assert!((e.iops - 63.0).abs() < 0.5);
        let e = p
            .core
            .estimate(Pattern::Sequential, Dir::Write, 65536, 32)
            .unwrap();
        assert!((e.mb_s - 5415.0).abs() < 1e-6);
        // Between depths 8 and 16: between the two figures.
        let e = p
            .core
            .estimate(Pattern::Random, Dir::Write, 4096, 12)
            .unwrap();
        assert!(e.iops > 337.0 && e.iops < 560.0 && !e.measured);
        // Sequential reads fall back to writes.
        let e = p
            .core
            .estimate(Pattern::Sequential, Dir::Read, 65536, 32)
            .unwrap();
        assert!(e.basis.contains("other direction"));
        // Random 8 KiB keeps the 4 KiB IOPS.
        let e = p
            .core
            .estimate(Pattern::Random, Dir::Write, 8192, 1)
            .unwrap();
        assert!((e.iops - 63.0).abs() < 0.5);
    }

    #[test]
    fn ssd_raid_follows_the_preset() {
        let p = DeviceProfile::builtin("sata-raid5x9").unwrap();
        assert!(p.core.flash);
        let w1 = p
            .core
            .estimate(Pattern::Random, Dir::Write, 4096, 1)
            .unwrap();
        // 72 / 81000 s of flash plus 40 us: about 1070 IOPS alone.
        assert!((w1.iops - 1070.0).abs() < 30.0, "{}", w1.iops);
        let w64 = p
            .core
            .estimate(Pattern::Random, Dir::Write, 4096, 64)
            .unwrap();
        assert!(w64.iops > 60_000.0 && w64.iops <= 81_000.0, "{}", w64.iops);
        let r1 = p
            .core
            .estimate(Pattern::Random, Dir::Read, 4096, 1)
            .unwrap();
        // docs/devices.md: a queue depth 1 random 4 KiB read takes about 125 us.
        assert!((r1.iops - 8000.0).abs() < 300.0, "{}", r1.iops);
        assert!(!DeviceProfile::raid60_study().core.flash);
    }

    #[test]
    fn toml_round_trip() {
        let p = DeviceProfile::raid60_study();
        let s = p.to_toml_string();
        let q = DeviceProfile::from_toml_str(&s).unwrap();
        assert_eq!(p, q);
        let j = serde_json::to_string(&p).unwrap();
        assert_eq!(DeviceProfile::from_json_str(&j).unwrap(), p);
        assert!(DeviceProfile::from_toml_str("name = \"x\"").is_err());
        assert!(DeviceProfile::builtin("nope").is_err());
    }
}

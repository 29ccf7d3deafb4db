//! Device specs as users type them on the command line.
//!
//! Plain devices: `ram:SIZE`, `null:SIZE`, `file:PATH`, or a path.
//!
//! Emulated slow devices (see [`crate::EmulatedVolume`], [`crate::ThrottledVolume`]); parameters
//! are `key=value` (or bare flags) separated by commas, sizes take K/M/G/T:
//! - `throttle:latency_us=200,iops=1000,bw=100M:INNER` wraps the volume INNER (any spec, e.g.
//!   `ram:1G`) in a fixed latency (`latency_us` or `latency_ms`), an IOPS cap and a bandwidth cap
//!   in bytes per second; each is optional.
//! - `hdd:size=1T[,rpm=7200][,ncq=32][,avg_seek_ms=8.5][,full_seek_ms=15][,rate=200M]
//!   [,overhead_us=100][,nodata|,file=PATH]`: one hard disk.
//! - `raid:level=60,groups=4,disks=10,disk_size=4T[,strip=64K][,rpm=..][,ncq=..][,merge_ms=0.5]
//!   [,stripe_cache=256][,ctrl_us=0][,parity_us=70,parity_write_us=110,parity_rate=300M][,nodata|,file=PATH]`:
//!   a RAID array (levels 0, 1, 5, 6 with one group; 10, 50, 60 with `groups` >= 2); the disk
//!   keys of `hdd:` apply to every member. `raid:preset=study60,disk_size=4T` starts from the
//!   calibrated RAID 60 of [`crate::RaidConfig::study_raid60`] and lets other keys override.
//!
//! - `ssd:size=1T[,preset=sata|sata-raid5x9][,parallelism=8][,iops=..|,read_iops=..,write_iops=..]
//!   [,bw=..|,read_bw=..,write_bw=..][,latency_us=..|,read_latency_us=..,write_latency_us=..]
//!   [,max_iops=..][,nodata|,file=PATH]`: a flash SSD ([`crate::SsdVolume`]); without a preset it
//!   starts from [`crate::SsdConfig::sata`], and `sata-raid5x9` is nine of those behind a RAID
//!   controller ([`crate::SsdConfig::sata_raid5x9`]); other keys override.
//!
//! Emulated devices keep their data in a lazily allocated RAM volume of their size, or with
//! `file=PATH` in a sparse file (created if missing; the path cannot contain a comma), or nowhere
//! with `nodata` (writes are dropped, reads return zeroes; the name says `nodata`). A big array
//! with data needs `file=` or `nodata`: RAM volumes are limited by the address space.

use std::path::Path;
use std::sync::Arc;

use std::time::Duration;

use crate::{
    parse_size, Backing, EmulConfig, EmulatedVolume, ErrorKind, FileVolume, HddConfig, NullVolume,
    Op, ParityEngine, RaidConfig, RaidLevel, RamVolume, Result, SsdConfig, SsdVolume,
    ThrottleConfig, ThrottledVolume, VolumeError, VolumeRef,
};

type ParamResult<T> = std::result::Result<T, String>;

/// `key=value` pairs and bare flags, in order; duplicates are an error.
fn params(text: &str) -> ParamResult<Vec<(&str, Option<&str>)>> {
    let mut out: Vec<(&str, Option<&str>)> = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let (k, v) = match item.split_once('=') {
            Some((k, v)) => (k.trim(), Some(v.trim())),
            None => (item, None),
        };
        if out.iter().any(|(seen, _)| *seen == k) {
            return Err(format!("parameter '{k}' given twice"));
        }
        out.push((k, v));
    }
    Ok(out)
}

fn value<'a>(key: &str, v: Option<&'a str>) -> ParamResult<&'a str> {
    v.filter(|v| !v.is_empty())
        .ok_or_else(|| format!("parameter '{key}' needs a value ({key}=...)"))
}

fn int(key: &str, v: Option<&str>, range: std::ops::RangeInclusive<u64>) -> ParamResult<u64> {
    let t = value(key, v)?;
    let n: u64 = t
        .parse()
        .map_err(|_| format!("parameter '{key}': '{t}' is not a whole number"))?;
    if !range.contains(&n) {
        return Err(format!(
            "parameter '{key}': {n} out of range {}..={}",
            range.start(),
            range.end()
        ));
    }
    Ok(n)
}

fn size(key: &str, v: Option<&str>) -> ParamResult<u64> {
    parse_size(value(key, v)?).map_err(|e| format!("parameter '{key}': {e}"))
}

/// A duration in `unit` seconds (1e-3 for ms, 1e-6 for µs), fractional values allowed.
fn time(key: &str, v: Option<&str>, unit: f64, max_s: f64) -> ParamResult<Duration> {
    let t = value(key, v)?;
    let x: f64 = t
        .parse()
        .map_err(|_| format!("parameter '{key}': '{t}' is not a number"))?;
    let secs = x * unit;
    if !(0.0..=max_s).contains(&secs) {
        return Err(format!(
            "parameter '{key}': {t} out of range 0..={:.0}",
            max_s / unit
        ));
    }
    Ok(Duration::from_secs_f64(secs))
}

fn throttle_config(text: &str) -> ParamResult<ThrottleConfig> {
    let mut c = ThrottleConfig::default();
    for (k, v) in params(text)? {
        match k {
            "latency_us" => c.latency = time(k, v, 1e-6, 60.0)?,
            "latency_ms" => c.latency = time(k, v, 1e-3, 60.0)?,
            "iops" => c.iops = Some(int(k, v, 1..=100_000_000)?),
            "bw" => {
                let bw = size(k, v)?;
                if bw == 0 {
                    return Err("parameter 'bw' must be above 0".into());
                }
                c.bandwidth = Some(bw);
            }
            _ => {
                return Err(format!(
                    "unknown parameter '{k}' (accepted: latency_us, latency_ms, iops, bw)"
                ))
            }
        }
    }
    Ok(c)
}

const HDD_KEYS: &str = "size, rpm, ncq, avg_seek_ms, full_seek_ms, rate, overhead_us, nodata, file";
const RAID_KEYS: &str = "level, groups, disks, disk_size, strip, merge_ms, stripe_cache, ctrl_us, \
     parity_us, parity_write_us, parity_rate, preset, rpm, ncq, avg_seek_ms, full_seek_ms, rate, overhead_us, \
     nodata, file";

/// The config and data backing of an `hdd:` (`raid` false) or `raid:` spec's parameters.
fn emul_config(text: &str, raid: bool) -> ParamResult<(EmulConfig, Backing)> {
    let ps = params(text)?;
    let get = |key: &str| ps.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
    let size_key = if raid { "disk_size" } else { "size" };
    let disk_size = size(
        size_key,
        get(size_key).ok_or_else(|| format!("parameter '{size_key}' is required"))?,
    )?;
    let rpm = match get("rpm") {
        Some(v) => int("rpm", v, 1000..=30000)? as u32,
        None => 7200,
    };
    let preset = match get("preset") {
        None => None,
        Some(v) if raid && value("preset", v)? == "study60" => {
            Some(RaidConfig::study_raid60(disk_size))
        }
        Some(v) => {
            return Err(format!(
                "parameter 'preset': '{}' is not a preset (accepted: study60)",
                v.unwrap_or("")
            ))
        }
    };
    let mut disk = match &preset {
        Some(p) if rpm == p.disk.rpm => p.disk.clone(),
        _ => HddConfig::new(disk_size, rpm),
    };
    let mut backing = Backing::Ram;
    let mut raid_cfg =
        preset.unwrap_or_else(|| RaidConfig::new(RaidLevel::Raid0, 1, 1, 64 << 10, disk.clone()));
    let (mut level_given, mut groups_given, mut disks_given) = (false, false, false);
    for &(k, v) in &ps {
        match k {
            "size" | "disk_size" if k == size_key => {}
            "rpm" | "preset" => {}
            "ncq" => disk.ncq = int(k, v, 0..=256)? as u32,
            "avg_seek_ms" => disk.avg_seek = time(k, v, 1e-3, 1.0)?,
            "full_seek_ms" => disk.full_seek = time(k, v, 1e-3, 1.0)?,
            "rate" => disk.media_rate = size(k, v)?,
            "overhead_us" => disk.cmd_overhead = time(k, v, 1e-6, 1.0)?,
            "nodata" if v.is_none() => backing = Backing::NoData,
            "file" => backing = Backing::File(value(k, v)?.into()),
            "level" if raid => {
                let n = int(k, v, 0..=60)? as u32;
                raid_cfg.level = RaidLevel::from_number(n).ok_or_else(|| {
                    format!("parameter 'level': {n} is not a RAID level (accepted: 0, 1, 5, 6, 10, 50, 60)")
                })?;
                level_given = true;
            }
            "groups" if raid => {
                raid_cfg.groups = int(k, v, 1..=64)? as u32;
                groups_given = true;
            }
            "disks" if raid => {
                raid_cfg.disks = int(k, v, 1..=64)? as u32;
                disks_given = true;
            }
            "strip" if raid => raid_cfg.strip = size(k, v)?,
            "merge_ms" if raid => {
                let w = time(k, v, 1e-3, 0.05)?;
                raid_cfg.merge_window = (!w.is_zero()).then_some(w);
            }
            "stripe_cache" if raid => raid_cfg.stripe_cache = int(k, v, 0..=1 << 20)? as usize,
            "ctrl_us" if raid => raid_cfg.ctrl_latency = time(k, v, 1e-6, 1.0)?,
            "parity_us" | "parity_write_us" | "parity_rate" if raid => {
                let mut e = raid_cfg.parity_engine.unwrap_or(ParityEngine {
                    per_update: Duration::ZERO,
                    per_write: Duration::ZERO,
                    rate: 200_000_000,
                });
                match k {
                    "parity_us" => e.per_update = time(k, v, 1e-6, 1.0)?,
                    "parity_write_us" => e.per_write = time(k, v, 1e-6, 1.0)?,
                    _ => e.rate = size(k, v)?.max(1),
                }
                raid_cfg.parity_engine = Some(e);
            }
            _ => {
                return Err(format!(
                    "unknown parameter '{k}' (accepted: {})",
                    if raid { RAID_KEYS } else { HDD_KEYS }
                ))
            }
        }
    }
    if !raid {
        return Ok((EmulConfig::Hdd(disk), backing));
    }
    let preset = get("preset").is_some();
    if !(preset || level_given && disks_given) {
        return Err("parameters 'level' and 'disks' are required (or preset=study60)".into());
    }
    if !preset && !groups_given {
        raid_cfg.groups = if raid_cfg.level.nested() { 2 } else { 1 };
    }
    raid_cfg.disk = disk;
    Ok((EmulConfig::Raid(raid_cfg), backing))
}

const SSD_KEYS: &str = "size, preset, parallelism, iops, read_iops, write_iops, bw, read_bw, \
     write_bw, latency_us, read_latency_us, write_latency_us, max_iops, nodata, file";

/// The config and data backing of an `ssd:` spec's parameters.
fn ssd_config(text: &str) -> ParamResult<(SsdConfig, Backing)> {
    let ps = params(text)?;
    let get = |key: &str| ps.iter().find(|(k, _)| *k == key).map(|(_, v)| *v);
    let bytes = size(
        "size",
        get("size").ok_or_else(|| "parameter 'size' is required".to_string())?,
    )?;
    let mut c = match get("preset") {
        None => SsdConfig::sata(bytes),
        Some(v) => match value("preset", v)? {
            "sata" => SsdConfig::sata(bytes),
            "sata-raid5x9" => SsdConfig::sata_raid5x9(bytes),
            other => {
                return Err(format!(
                    "parameter 'preset': '{other}' is not a preset (accepted: sata, sata-raid5x9)"
                ))
            }
        },
    };
    let rate = |k: &str, v: Option<&str>| -> ParamResult<u64> {
        let n = size(k, v)?;
        if n == 0 {
            return Err(format!("parameter '{k}' must be above 0"));
        }
        Ok(n)
    };
    let mut backing = Backing::Ram;
    for &(k, v) in &ps {
        match k {
            "size" | "preset" => {}
            "parallelism" => c.parallelism = int(k, v, 1..=4096)? as u32,
            "iops" => {
                let n = int(k, v, 1..=1_000_000_000)?;
                (c.read_iops, c.write_iops) = (n, n);
            }
            "read_iops" => c.read_iops = int(k, v, 1..=1_000_000_000)?,
            "write_iops" => c.write_iops = int(k, v, 1..=1_000_000_000)?,
            "max_iops" => c.max_iops = Some(int(k, v, 1..=1_000_000_000)?),
            "bw" => {
                let n = rate(k, v)?;
                (c.read_bw, c.write_bw) = (n, n);
            }
            "read_bw" => c.read_bw = rate(k, v)?,
            "write_bw" => c.write_bw = rate(k, v)?,
            "latency_us" => {
                let t = time(k, v, 1e-6, 1.0)?;
                (c.read_latency, c.write_latency) = (t, t);
            }
            "read_latency_us" => c.read_latency = time(k, v, 1e-6, 1.0)?,
            "write_latency_us" => c.write_latency = time(k, v, 1e-6, 1.0)?,
            "nodata" if v.is_none() => backing = Backing::NoData,
            "file" => backing = Backing::File(value(k, v)?.into()),
            _ => return Err(format!("unknown parameter '{k}' (accepted: {SSD_KEYS})")),
        }
    }
    Ok((c, backing))
}

/// The forms `open_volume` takes, as its errors list them (the daemon adds the NBD URIs it opens
/// itself: `hybridcache_daemon::devices::open_device`).
pub const FORMS: &str =
    "expected ram:SIZE, null:SIZE, file:PATH, throttle:PARAMS:SPEC, hdd:PARAMS, \
     raid:PARAMS, ssd:PARAMS, or the path of an existing file or block device";

/// Open the volume a spec names: `ram:SIZE` (e.g. `ram:1G`), `null:SIZE`, `file:PATH`, or a
/// plain path to an existing regular file or block device. RAM and null volumes are named by
/// their spec.
pub fn open_volume(spec: &str) -> Result<VolumeRef> {
    let invalid = |msg: String| VolumeError::new(spec, Op::Open, 0, 0, ErrorKind::Invalid(msg));
    let size_of = |text: &str| parse_size(text).map_err(|e| invalid(format!("{e}; {FORMS}")));
    if let Some(size) = spec.strip_prefix("ram:") {
        return Ok(Arc::new(RamVolume::new(spec, size_of(size)?)?));
    }
    if let Some(size) = spec.strip_prefix("null:") {
        return Ok(Arc::new(NullVolume::new(spec, size_of(size)?)?));
    }
    if let Some(rest) = spec.strip_prefix("throttle:") {
        let (params, inner) = rest.split_once(':').ok_or_else(|| {
            invalid(
                "throttle: expected throttle:PARAMS:SPEC, e.g. throttle:latency_us=200:ram:1G"
                    .into(),
            )
        })?;
        let config = throttle_config(params).map_err(|e| invalid(format!("throttle: {e}")))?;
        let inner = open_volume(inner)?;
        return Ok(Arc::new(ThrottledVolume::new(inner, config).named(spec)));
    }
    if let Some(params) = spec.strip_prefix("hdd:") {
        let (config, backing) =
            emul_config(params, false).map_err(|e| invalid(format!("hdd: {e}")))?;
        return Ok(Arc::new(EmulatedVolume::new(spec, &config, backing)?));
    }
    if let Some(params) = spec.strip_prefix("raid:") {
        let (config, backing) =
            emul_config(params, true).map_err(|e| invalid(format!("raid: {e}")))?;
        return Ok(Arc::new(EmulatedVolume::new(spec, &config, backing)?));
    }
    if let Some(params) = spec.strip_prefix("ssd:") {
        let (config, backing) = ssd_config(params).map_err(|e| invalid(format!("ssd: {e}")))?;
        return Ok(Arc::new(SsdVolume::new(spec, &config, backing)?));
    }
    let path = spec.strip_prefix("file:").unwrap_or(spec);
    if path.is_empty() {
        return Err(invalid(format!("no device given; {FORMS}")));
    }
    // A path that does not exist is more likely a mistyped spec than a missing file.
    if !Path::new(path).exists() {
        let msg = match spec.split_once(':') {
            Some((kind, _)) if !spec.starts_with("file:") && !kind.contains('/') => {
                format!("'{spec}': unknown volume kind '{kind}'; {FORMS}")
            }
            _ => format!("'{spec}': no such file or block device; {FORMS}"),
        };
        return Err(invalid(msg));
    }
    Ok(Arc::new(FileVolume::open(Path::new(path))?))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn invalid_msg(spec: &str) -> String {
        let e = open_volume(spec).err().expect("spec should be rejected");
        assert_eq!(e.op, Op::Open);
        assert_eq!(e.device, spec);
        match e.kind {
            ErrorKind::Invalid(msg) => msg,
            other => panic!("{spec}: expected Invalid, got {other:?}"),
        }
    }

    #[test]
    fn opens_memory_volumes() {
        let v = open_volume("ram:1M").unwrap();
        assert_eq!((v.name(), v.size()), ("ram:1M", 1 << 20));
        v.write_at(&[5; 512], 512).unwrap();
        let mut b = [0; 512];
        v.read_at(&mut b, 512).unwrap();
        assert_eq!(b, [5; 512]);
        let v = open_volume("null:2G").unwrap();
        assert_eq!(v.size(), 2 << 30);
    }

    #[test]
    fn opens_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("disk.img");
        std::fs::write(&path, vec![0u8; 8192]).unwrap();
        let text = path.to_str().unwrap();
        assert_eq!(open_volume(text).unwrap().size(), 8192);
        assert_eq!(open_volume(&format!("file:{text}")).unwrap().size(), 8192);
    }

    #[test]
    fn ssd_specs_start_from_a_preset_and_override_it() {
        let (c, b) = ssd_config("size=1G").unwrap();
        assert_eq!(c, SsdConfig::sata(1 << 30));
        assert!(matches!(b, Backing::Ram));
        let (c, b) = ssd_config("size=4T,preset=sata-raid5x9,write_iops=100000,nodata").unwrap();
        assert_eq!(
            c,
            SsdConfig {
                write_iops: 100_000,
                ..SsdConfig::sata_raid5x9(4 << 40)
            }
        );
        assert!(matches!(b, Backing::NoData));
        let (c, _) =
            ssd_config("size=1G,parallelism=16,iops=200000,bw=1G,latency_us=10,max_iops=5000")
                .unwrap();
        assert_eq!(
            (c.parallelism, c.read_iops, c.write_iops),
            (16, 200_000, 200_000)
        );
        assert_eq!((c.read_bw, c.write_bw), (1 << 30, 1 << 30));
        assert_eq!(c.read_latency, Duration::from_micros(10));
        assert_eq!(c.max_iops, Some(5000));
        for (spec, why) in [
            ("parallelism=8", "'size' is required"),
            ("size=1G,preset=nvme", "not a preset"),
            ("size=1G,parallelism=0", "out of range 1..=4096"),
            ("size=1G,bw=0", "'bw' must be above 0"),
            ("size=1G,speed=9", "accepted: size, preset"),
        ] {
            let e = ssd_config(spec).err().expect("refused");
            assert!(e.contains(why), "{spec}: {e}");
        }
        let v = open_volume("ssd:size=16M,latency_us=1").unwrap();
        assert_eq!(
            (v.name(), v.size()),
            ("ssd:size=16M,latency_us=1", 16 << 20)
        );
        v.write_at(&[6; 4096], 8192).unwrap();
        let mut b = [0; 4096];
        v.read_at(&mut b, 8192).unwrap();
        assert_eq!(b, [6; 4096]);
        assert!(invalid_msg("ssd:size=1G,preset=x").starts_with("ssd: parameter 'preset'"));
    }

    #[test]
    fn opens_emulated_devices() {
        let v = open_volume("throttle:latency_us=10,iops=100000,bw=1G:ram:1M").unwrap();
        assert_eq!(v.size(), 1 << 20);
        v.write_at(&[3; 4096], 0).unwrap();
        let mut b = [0; 4096];
        v.read_at(&mut b, 0).unwrap();
        assert_eq!(b, [3; 4096]);

        let v = open_volume("hdd:size=64M,rpm=15000,ncq=32").unwrap();
        assert_eq!(
            (v.name(), v.size()),
            ("hdd:size=64M,rpm=15000,ncq=32", 64 << 20)
        );
        v.write_at(&[4; 4096], 4096).unwrap();
        v.read_at(&mut b, 4096).unwrap();
        assert_eq!(b, [4; 4096]);

        let v =
            open_volume("raid:level=6,disks=5,strip=64K,disk_size=16M,rpm=15000,nodata").unwrap();
        assert_eq!(v.size(), 3 * (16 << 20));
        let v = open_volume("raid:level=60,groups=4,disks=10,disk_size=4T,nodata").unwrap();
        assert_eq!(v.size(), 4 * 8 * (4u64 << 40));
        let v = open_volume("raid:preset=study60,disk_size=1T,merge_ms=0,nodata").unwrap();
        assert!(v.name().contains("nodata"));
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("raid.img");
        let spec = format!(
            "raid:level=10,groups=2,disks=2,disk_size=8M,rpm=15000,file={}",
            path.display()
        );
        let v = open_volume(&spec).unwrap();
        assert_eq!(v.size(), 16 << 20);
        v.write_at(&[5; 4096], 1 << 20).unwrap();
        v.read_at(&mut b, 1 << 20).unwrap();
        assert_eq!(b, [5; 4096]);
    }

    #[test]
    fn rejects_bad_emulated_specs() {
        for (spec, want) in [
            ("throttle:latency_us=5", "throttle:PARAMS:SPEC"),
            ("throttle:speed=5:ram:1M", "unknown parameter 'speed'"),
            ("throttle:iops=0:ram:1M", "'iops': 0 out of range 1..="),
            ("hdd:rpm=7200", "'size' is required"),
            ("hdd:size=1G,rpm=99", "'rpm': 99 out of range 1000..=30000"),
            ("hdd:size=1G,ncq=999", "'ncq': 999 out of range 0..=256"),
            ("hdd:size=1G,avg_seek_ms=20", "avg_seek"),
            ("hdd:size=1G,level=5", "unknown parameter 'level'"),
            (
                "raid:disk_size=1G,disks=4",
                "'level' and 'disks' are required",
            ),
            ("raid:level=7,disks=4,disk_size=1G", "not a RAID level"),
            (
                "raid:level=5,disks=2,disk_size=1G",
                "disks 2 out of range 3..=64",
            ),
            (
                "raid:level=5,groups=2,disks=4,disk_size=1G",
                "groups 2 must be 1",
            ),
            (
                "raid:level=50,groups=1,disks=4,disk_size=1G",
                "groups 1 out of range 2..=64",
            ),
            ("raid:level=0,disks=4,strip=1000,disk_size=1G", "strip 1000"),
            (
                "raid:level=0,disks=4,disk_size=1G,merge_ms=99",
                "'merge_ms': 99 out of range",
            ),
        ] {
            let e = open_volume(spec)
                .err()
                .unwrap_or_else(|| panic!("{spec} accepted"));
            assert!(e.to_string().contains(want), "{spec}: {e}");
        }
    }

    #[test]
    fn rejects_bad_specs() {
        for spec in [
            "ram:",
            "ram:lots",
            "null:1Q",
            "",
            "file:",
            "nope:1G",
            "/no/such/disk",
        ] {
            let msg = invalid_msg(spec);
            assert!(msg.contains("ram:SIZE"), "{spec}: {msg}");
        }
        assert!(invalid_msg("nope:1G").contains("unknown volume kind 'nope'"));
        assert!(invalid_msg("/no/such/disk").contains("no such file"));
        assert!(invalid_msg("null:100").contains("multiple of 512"));
        let e = open_volume("ram:1000").err().expect("unaligned size");
        assert!(e.to_string().contains("multiple of 512"), "{e}");
    }
}

//! Opening the devices users name (paths, volume URIs, remote NBD exports) and telling when two
//! names mean the same device, so one device is never used twice.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::sync::Arc;

use hybridcache_volume::{open_volume, Op, VolumeError, VolumeRef};

use crate::nbd_volume::{is_nbd_uri, NbdVolume};

/// Identity of a device, independent of how it was spelled (symlinks, `file:` prefix, relative
/// paths, a loop device over a file). RAM and null volumes have none: each spec opens a fresh,
/// private volume. Two keys name overlapping devices when [`DeviceKey::conflicts`] says so.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceKey {
    /// A block device: its number, the number of the whole disk it belongs to (itself for a
    /// whole disk), and the file behind it when that disk is a loop device.
    Block {
        rdev: u64,
        disk: u64,
        backing: Option<(u64, u64)>,
    },
    /// A regular file, or a whole loop device bound to one (the loop device is its file).
    File {
        dev: u64,
        ino: u64,
    },
    Nbd(String),
}

impl DeviceKey {
    /// Whether the two devices share blocks: the same device, a partition and its disk, or a
    /// file and a partition of a loop device over it.
    pub fn conflicts(&self, other: &DeviceKey) -> bool {
        use DeviceKey::*;
        match (self, other) {
            (
                Block {
                    rdev: a, disk: da, ..
                },
                Block {
                    rdev: b, disk: db, ..
                },
            ) => a == b || da == b || db == a,
            (
                Block {
                    backing: Some(f), ..
                },
                File { dev, ino },
            )
            | (
                File { dev, ino },
                Block {
                    backing: Some(f), ..
                },
            ) => *f == (*dev, *ino),
            _ => self == other,
        }
    }
}

/// The key of a block device: a whole loop device is the file behind it.
fn block_key(rdev: u64) -> DeviceKey {
    let disk = crate::claims::whole_disk(rdev);
    let backing = crate::claims::loop_backing(rdev);
    match backing {
        Some((dev, ino)) if disk == rdev => DeviceKey::File { dev, ino },
        _ => DeviceKey::Block {
            rdev,
            disk,
            backing,
        },
    }
}

/// The identity of the device `spec` names, without opening it.
pub fn device_key(spec: &str) -> Option<DeviceKey> {
    if spec.starts_with("ram:") || spec.starts_with("null:") {
        return None;
    }
    if is_nbd_uri(spec) {
        return Some(DeviceKey::Nbd(spec.to_string()));
    }
    let path = crate::claims::spec_path(spec)?;
    match std::fs::metadata(Path::new(path)) {
        Ok(m) if m.file_type().is_block_device() => Some(block_key(m.rdev())),
        Ok(m) => Some(DeviceKey::File {
            dev: m.dev(),
            ino: m.ino(),
        }),
        // Opening reports the precise problem (missing file, unknown kind).
        Err(_) => None,
    }
}

/// What the device `spec` names is, to tell a core's device from another one that takes its
/// path later (disks renamed at boot, a file replaced by another of the same size): a file, or
/// a loop device over one, by its file system's device and its inode; a disk by the WWID or
/// serial number the kernel reports; a partition by its disk's and its number. None when
/// nothing stable is known (a disk that reports neither, remote, RAM and null devices).
pub fn identity(spec: &str) -> Option<String> {
    match device_key(spec)? {
        DeviceKey::File { dev, ino } => Some(format!("file {dev}:{ino}")),
        DeviceKey::Block {
            rdev,
            disk,
            backing,
        } => {
            let whole = match backing {
                Some((dev, ino)) => format!("file {dev}:{ino}"),
                None => format!("disk {}", crate::claims::disk_hardware_id(disk)?),
            };
            Some(match crate::claims::partition_number(rdev) {
                Some(n) if rdev != disk => format!("{whole} partition {n}"),
                _ => whole,
            })
        }
        DeviceKey::Nbd(_) => None,
    }
}

/// The device forms `open_device` takes, as a refusal lists them: a device of the machine
/// first, then the remote ones, then the emulated ones.
pub const DEVICE_FORMS: &str = "expected the path of an existing file or block device, \
     file:PATH, an NBD URI (nbd://HOST[:PORT]/EXPORT or nbd+unix:///EXPORT?socket=PATH), ram:SIZE, \
     null:SIZE, throttle:PARAMS:SPEC, hdd:PARAMS, raid:PARAMS or ssd:PARAMS";

/// Open the device `spec` names: anything `open_volume` takes, or an `nbd://` / `nbd+unix://` URI.
pub fn open_device(spec: &str) -> Result<VolumeRef, String> {
    let opened = if is_nbd_uri(spec) {
        NbdVolume::open(spec).map(|v| Arc::new(v) as VolumeRef)
    } else {
        open_volume(spec)
    };
    // The volume crate lists the forms it opens; the daemon opens NBD URIs too, which an
    // operator looking for how to name a remote device must find in the same list.
    opened
        .map_err(|e| volume_error_text(&e).replace(hybridcache_volume::VOLUME_FORMS, DEVICE_FORMS))
}

/// Whether `spec` names a local path that does not exist (yet): a late device, as opposed to
/// one that exists but cannot be used. RAM, null and remote devices are never missing; a wrapped
/// device is missing when the file holding its data is (an emulated device without `file=` never
/// is, nor is a spec of an unknown kind, which opening then reports).
pub fn is_missing(spec: &str) -> bool {
    if spec.starts_with("ram:") || spec.starts_with("null:") || is_nbd_uri(spec) {
        return false;
    }
    let Some(path) = crate::claims::spec_path(spec) else {
        return false;
    };
    matches!(std::fs::metadata(Path::new(path)), Err(e) if e.kind() == std::io::ErrorKind::NotFound)
}

/// What a watcher compares between two looks at a device: it is acted on only once this stays
/// the same for a whole poll interval, so a file still being copied or grown is not formatted
/// or loaded half-written. None while the device is missing or empty.
pub fn settle_mark(spec: &str) -> Option<(u64, i64, i64)> {
    let path = crate::claims::spec_path(spec)?;
    let m = std::fs::metadata(Path::new(path)).ok()?;
    let size = if m.file_type().is_block_device() {
        // A block device's metadata size is 0; its appearance is the event.
        1
    } else {
        m.len()
    };
    (size > 0).then_some((size, m.mtime(), m.mtime_nsec()))
}

/// An opening failure says what is wrong with the spec; offsets and lengths are noise there.
pub fn volume_error_text(e: &VolumeError) -> String {
    if e.op == Op::Open {
        let kind = e.kind.to_string();
        if kind.contains(&e.device) {
            kind
        } else {
            format!("{}: {kind}", e.device)
        }
    } else {
        e.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_file_by_two_names_has_one_key() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.img");
        std::fs::write(&p, vec![0u8; 4096]).unwrap();
        let plain = p.to_str().unwrap().to_string();
        let a = device_key(&plain);
        let b = device_key(&format!("file:{plain}"));
        assert!(a.is_some());
        assert_eq!(a, b);
        assert_eq!(device_key("ram:1G"), None);
        // A wrapped device is the file holding its data.
        assert_eq!(device_key(&format!("throttle:latency_us=1:{plain}")), a);
        assert_eq!(device_key(&format!("hdd:size=1M,file={plain}")), a);
        assert!(!is_missing(&format!("throttle:iops=5:{plain}")));
        assert!(is_missing(&format!("throttle:iops=5:{plain}.gone")));
        assert!(!is_missing("hdd:size=1M,nodata"));
    }

    #[test]
    fn a_file_is_known_by_its_inode_not_its_name() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("core.img");
        std::fs::write(&p, vec![0u8; 4096]).unwrap();
        let plain = p.to_str().unwrap().to_string();
        let first = identity(&plain).expect("a file has an identity");
        assert_eq!(identity(&format!("file:{plain}")).as_deref(), Some(&*first));
        let moved = dir.path().join("moved.img");
        std::fs::rename(&p, &moved).unwrap();
        std::fs::rename(&moved, &p).unwrap();
        assert_eq!(
            identity(&plain).as_deref(),
            Some(&*first),
            "moving keeps it"
        );
        std::fs::remove_file(&p).unwrap();
        // Hold the old inode's number so the new file cannot reuse it.
        let keep = dir.path().join("keep.img");
        std::fs::write(&keep, b"x").unwrap();
        std::fs::write(&p, vec![0u8; 4096]).unwrap();
        assert_ne!(
            identity(&plain),
            Some(first),
            "another file at the path is another device"
        );
        assert_eq!(identity("ram:1G"), None);
        assert_eq!(identity("nbd://127.0.0.1/x"), None);
    }

    #[test]
    fn partitions_conflict_with_their_disk_and_loop_partitions_with_the_file() {
        let disk = DeviceKey::Block {
            rdev: 0x800,
            disk: 0x800,
            backing: None,
        };
        let part = |n: u64| DeviceKey::Block {
            rdev: 0x800 + n,
            disk: 0x800,
            backing: None,
        };
        assert!(disk.conflicts(&part(1)) && part(1).conflicts(&disk));
        assert!(part(1).conflicts(&part(1)));
        assert!(!part(1).conflicts(&part(2)));
        let file = DeviceKey::File { dev: 1, ino: 2 };
        let loop_part = DeviceKey::Block {
            rdev: 0x10301,
            disk: 0x700,
            backing: Some((1, 2)),
        };
        assert!(loop_part.conflicts(&file) && file.conflicts(&loop_part));
        assert!(!loop_part.conflicts(&DeviceKey::File { dev: 1, ino: 3 }));
        assert!(!disk.conflicts(&file));
    }

    #[test]
    fn missing_file_is_reported_by_open() {
        let e = open_device("/no/such/file").err().unwrap();
        assert!(e.contains("no such file"), "{e}");
        assert!(!e.contains('\n'));
    }
}

//! Opening the devices users name (paths, volume URIs, remote NBD exports) and telling when two
//! names mean the same device, so one device is never used twice.

use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;
use std::sync::Arc;

use hybridcache_volume::{open_volume, Op, VolumeError, VolumeRef};

use crate::nbd_volume::{is_nbd_uri, NbdVolume};

/// Identity of a device, independent of how it was spelled (symlinks, `file:` prefix, relative
/// paths). RAM and null volumes have none: each spec opens a fresh, private volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceKey {
    Block(u64),
    File { dev: u64, ino: u64 },
    Nbd(String),
}

/// The identity of the device `spec` names, without opening it.
pub fn device_key(spec: &str) -> Option<DeviceKey> {
    if spec.starts_with("ram:") || spec.starts_with("null:") {
        return None;
    }
    if is_nbd_uri(spec) {
        return Some(DeviceKey::Nbd(spec.to_string()));
    }
    let path = spec.strip_prefix("file:").unwrap_or(spec);
    match std::fs::metadata(Path::new(path)) {
        Ok(m) if m.file_type().is_block_device() => Some(DeviceKey::Block(m.rdev())),
        Ok(m) => Some(DeviceKey::File {
            dev: m.dev(),
            ino: m.ino(),
        }),
        // Opening reports the precise problem (missing file, unknown kind).
        Err(_) => None,
    }
}

/// Open the device `spec` names: anything `open_volume` takes, or an `nbd://` / `nbd+unix://` URI.
pub fn open_device(spec: &str) -> Result<VolumeRef, String> {
    let opened = if is_nbd_uri(spec) {
        NbdVolume::open(spec).map(|v| Arc::new(v) as VolumeRef)
    } else {
        open_volume(spec)
    };
    opened.map_err(|e| volume_error_text(&e))
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
    }

    #[test]
    fn missing_file_is_reported_by_open() {
        let e = open_device("/no/such/file").err().unwrap();
        assert!(e.contains("no such file"), "{e}");
        assert!(!e.contains('\n'));
    }
}

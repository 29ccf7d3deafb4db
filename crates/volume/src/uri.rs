//! Device specs as users type them on the command line.

use std::path::Path;
use std::sync::Arc;

use crate::{
    parse_size, ErrorKind, FileVolume, NullVolume, Op, RamVolume, Result, VolumeError, VolumeRef,
};

const FORMS: &str =
    "expected ram:SIZE, null:SIZE, file:PATH, or the path of an existing file or block device";

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

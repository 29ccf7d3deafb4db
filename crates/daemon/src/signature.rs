//! What a device already holds, before `start-cache` formats it: a file system, a partition
//! table, an LVM, MD, bcache or swap signature (found by libblkid, the detector `blkid`, `wipefs`
//! and udev use), or an Open CAS cache (libblkid does not know it; see [`open_cas`]). A
//! hybridcache cache is the engine's to find (`Cache::create` refuses it without force).

use std::ffi::{c_char, c_int, CStr, CString};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::Path;

#[allow(non_camel_case_types)]
type blkid_probe = *mut std::ffi::c_void;

const BLKID_SUBLKS_LABEL: c_int = 1 << 1;
const BLKID_SUBLKS_UUID: c_int = 1 << 3;
const BLKID_SUBLKS_TYPE: c_int = 1 << 5;
const BLKID_SUBLKS_USAGE: c_int = 1 << 7;
const BLKID_PARTS_MAGIC: c_int = 1 << 3;

// The runtime library by its soname: libblkid1 is part of every Debian system (util-linux
// needs it), so building needs no -dev package for the unversioned libblkid.so link.
#[link(name = "libblkid.so.1", kind = "dylib", modifiers = "+verbatim")]
extern "C" {
    fn blkid_new_probe_from_filename(filename: *const c_char) -> blkid_probe;
    fn blkid_free_probe(pr: blkid_probe);
    fn blkid_probe_enable_superblocks(pr: blkid_probe, enable: c_int) -> c_int;
    fn blkid_probe_set_superblocks_flags(pr: blkid_probe, flags: c_int) -> c_int;
    fn blkid_probe_enable_partitions(pr: blkid_probe, enable: c_int) -> c_int;
    fn blkid_probe_set_partitions_flags(pr: blkid_probe, flags: c_int) -> c_int;
    fn blkid_do_safeprobe(pr: blkid_probe) -> c_int;
    fn blkid_probe_lookup_value(
        pr: blkid_probe,
        name: *const c_char,
        data: *mut *const c_char,
        len: *mut usize,
    ) -> c_int;
}

/// Frees the probe however the probing ends.
struct Probe(blkid_probe);

impl Drop for Probe {
    fn drop(&mut self) {
        // SAFETY: the probe came from blkid_new_probe_from_filename and is freed once.
        unsafe { blkid_free_probe(self.0) }
    }
}

impl Probe {
    fn value(&self, name: &str) -> Option<String> {
        let name = CString::new(name).ok()?;
        let mut data: *const c_char = std::ptr::null();
        let mut len = 0usize;
        // SAFETY: valid probe, NUL-terminated name, valid out pointers; libblkid returns a
        // NUL-terminated string owned by the probe, copied here before the probe is freed.
        let rc = unsafe { blkid_probe_lookup_value(self.0, name.as_ptr(), &mut data, &mut len) };
        if rc != 0 || data.is_null() {
            return None;
        }
        // SAFETY: see above.
        Some(
            unsafe { CStr::from_ptr(data) }
                .to_string_lossy()
                .into_owned(),
        )
    }
}

/// What the device at `path` holds, in words ("an ext4 file system (uuid ...)"), or None when
/// it holds nothing libblkid or the Open CAS check recognise.
pub fn detect(path: &Path) -> Result<Option<String>, String> {
    if let Some(found) = open_cas(path)? {
        return Ok(Some(found));
    }
    let cpath = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| format!("{}: the path contains a NUL byte", path.display()))?;
    // SAFETY: a NUL-terminated path; a null return is checked.
    let raw = unsafe { blkid_new_probe_from_filename(cpath.as_ptr()) };
    if raw.is_null() {
        return Err(format!(
            "{}: cannot probe it for existing data: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    let probe = Probe(raw);
    // SAFETY: calls on a valid probe.
    let rc = unsafe {
        blkid_probe_enable_superblocks(probe.0, 1);
        blkid_probe_set_superblocks_flags(
            probe.0,
            BLKID_SUBLKS_TYPE | BLKID_SUBLKS_UUID | BLKID_SUBLKS_LABEL | BLKID_SUBLKS_USAGE,
        );
        blkid_probe_enable_partitions(probe.0, 1);
        blkid_probe_set_partitions_flags(probe.0, BLKID_PARTS_MAGIC);
        blkid_do_safeprobe(probe.0)
    };
    match rc {
        0 => Ok(Some(describe(&probe))),
        1 => Ok(None),
        // Two signatures that contradict each other (e.g. a file system over an old RAID
        // member): something is there either way.
        -2 => Ok(Some(
            "more than one signature (see `wipefs --no-act`)".to_string(),
        )),
        _ => Err(format!(
            "{}: probing it for existing data failed",
            path.display()
        )),
    }
}

fn describe(probe: &Probe) -> String {
    if let Some(pt) = probe.value("PTTYPE") {
        let what = match pt.as_str() {
            "dos" => "an MBR (dos) partition table".to_string(),
            "gpt" => "a GPT partition table".to_string(),
            other => format!("a {other} partition table"),
        };
        return match probe.value("PTUUID") {
            Some(u) => format!("{what} (id {u})"),
            None => what,
        };
    }
    let kind = probe.value("TYPE").unwrap_or_else(|| "unknown".into());
    let usage = probe.value("USAGE").unwrap_or_default();
    let what = match kind.as_str() {
        "swap" => "a swap area".to_string(),
        "LVM2_member" => "an LVM2 physical volume".to_string(),
        "linux_raid_member" => "an MD RAID member".to_string(),
        "bcache" => "a bcache superblock".to_string(),
        k if usage == "filesystem" => format!("{} {k} file system", article(k)),
        k => format!("{} {k} signature", article(k)),
    };
    let mut details = Vec::new();
    if let Some(u) = probe.value("UUID") {
        details.push(format!("uuid {u}"));
    }
    if let Some(l) = probe.value("LABEL") {
        details.push(format!("label {l:?}"));
    }
    if details.is_empty() {
        what
    } else {
        format!("{what} ({})", details.join(", "))
    }
}

fn article(word: &str) -> &'static str {
    match word.chars().next().map(|c| c.to_ascii_lowercase()) {
        // "an xfs": the letter is spoken "ex".
        Some('a' | 'e' | 'i' | 'o' | 'u' | 'x') => "an",
        _ => "a",
    }
}

/// Open CAS (OCF) keeps its configuration superblock in the first page of the cache device;
/// its probe (`ocf_metadata_probe`) accepts it by the magic number 0x187E1CA6, stored little
/// endian at byte 4 (after the clean-shutdown and dirty-flushed bytes and a 16-bit field),
/// with clean-shutdown and dirty-flushed each 0 or 1. The metadata version follows at byte 8.
pub fn open_cas(path: &Path) -> Result<Option<String>, String> {
    const MAGIC: u32 = 0x187E_1CA6;
    let f = std::fs::File::open(path)
        .map_err(|e| format!("{}: cannot read it: {e}", path.display()))?;
    let mut head = [0u8; 12];
    if f.read_exact_at(&mut head, 0).is_err() {
        // Shorter than a superblock: nothing there.
        return Ok(None);
    }
    let magic = u32::from_le_bytes([head[4], head[5], head[6], head[7]]);
    if magic != MAGIC || head[0] > 1 || head[1] > 1 {
        return Ok(None);
    }
    let version = u32::from_le_bytes([head[8], head[9], head[10], head[11]]);
    let state = if head[1] == 0 {
        "with dirty data"
    } else {
        "flushed"
    };
    Ok(Some(format!(
        "an Open CAS cache (metadata version {version}, {state})"
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn open_cas_magic_is_found() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("ocf.img");
        let mut data = vec![0u8; 1 << 20];
        data[0] = 1;
        data[1] = 0;
        data[4..8].copy_from_slice(&0x187E_1CA6u32.to_le_bytes());
        data[8..12].copy_from_slice(&0x1503u32.to_le_bytes());
        std::fs::write(&p, &data).unwrap();
        let found = detect(&p).unwrap().unwrap();
        assert!(found.contains("Open CAS"), "{found}");
        assert!(found.contains("dirty"), "{found}");
        // Wrong flags: not OCF's superblock.
        data[0] = 7;
        std::fs::write(&p, &data).unwrap();
        assert_eq!(open_cas(&p).unwrap(), None);
    }

    #[test]
    fn zeroes_hold_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("z.img");
        std::fs::write(&p, vec![0u8; 1 << 20]).unwrap();
        assert_eq!(detect(&p).unwrap(), None);
    }
}

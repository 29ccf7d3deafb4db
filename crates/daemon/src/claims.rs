//! Exclusive claims on the devices the daemon uses as caches and cores.
//!
//! Two users of one device lose data (two daemons loading one cache, a cache formatted over a
//! running one through a loop device, a core under a mounted file system), so every device is
//! claimed for as long as its volume is open, the way the kernel's own users do it:
//! - a block device is opened with `O_EXCL`: the kernel refuses it while it is mounted, part of
//!   an MD/LVM/bcache stack, or held exclusively by anyone else (a partition and its whole disk
//!   conflict there too);
//! - a regular file gets a whole-file write lock on an open file description (`F_OFD_SETLK`),
//!   which conflicts with the same lock from any other process and from another open in this one;
//! - a loop device also locks its backing file, and a regular file is refused while a loop device
//!   over it is claimed or mounted, so a file and its loop alias are one device.
//!
//! The claim's descriptors live in [`ClaimedVolume`] beside the volume, so they are released
//! exactly when the engine lets go of the volume (stop, remove, a failed start).
//!
//! A refusal names the device and, where it can be found, who holds it: the mount point, the
//! processes that have it open (OFD locks do not record a pid, so `/proc/*/fd` is scanned for the
//! same file or device), and the hybridcache cache its superblock records.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use hybridcache_volume::{Result as VolumeResult, Volume, VolumeRef};

/// The descriptors that hold a device's claim; dropping them releases it.
#[derive(Debug)]
pub struct Claim {
    _fds: Vec<File>,
}

/// A volume together with the claim on its device.
pub struct ClaimedVolume {
    inner: VolumeRef,
    // Dropped after `inner`: the claim outlives every descriptor of the volume.
    _claim: Claim,
}

impl ClaimedVolume {
    pub fn new(inner: VolumeRef, claim: Claim) -> ClaimedVolume {
        ClaimedVolume {
            inner,
            _claim: claim,
        }
    }
}

impl Volume for ClaimedVolume {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn logical_block_size(&self) -> u32 {
        self.inner.logical_block_size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> VolumeResult<()> {
        self.inner.read_at(buf, offset)
    }
    fn read_batch(&self, pieces: &mut [hybridcache_volume::ReadPiece<'_>]) -> VolumeResult<()> {
        self.inner.read_batch(pieces)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> VolumeResult<()> {
        self.inner.write_at(buf, offset)
    }
    fn flush(&self) -> VolumeResult<()> {
        self.inner.flush()
    }
    fn direct_write(&self, len: usize, offset: u64) -> Option<hybridcache_volume::DirectWrite> {
        self.inner.direct_write(len, offset)
    }
    fn discard(&self, offset: u64, len: u64) -> VolumeResult<()> {
        self.inner.discard(offset, len)
    }
    fn discard_zeroes(&self) -> bool {
        self.inner.discard_zeroes()
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> VolumeResult<()> {
        self.inner.write_zeroes(offset, len)
    }
}

/// The file or block device that holds a spec's data: a plain path or `file:PATH`, and inside
/// the wrappers of the volume crate's spec grammar (`throttle:PARAMS:INNER`, and `hdd:`,
/// `ssd:`, `raid:` with `file=PATH`), which must be claimed, identified and checked for
/// signatures as that file, or a wrapping would get past all three. Volume URIs, RAM, remote
/// devices and emulated devices without `file=` have nothing to claim.
pub fn spec_path(spec: &str) -> Option<&str> {
    if let Some(p) = spec.strip_prefix("file:") {
        return Some(p);
    }
    if let Some(rest) = spec.strip_prefix("throttle:") {
        // Throttle parameters hold no colon: the inner spec is everything after the first.
        return spec_path(rest.split_once(':')?.1);
    }
    if let Some(params) = ["hdd:", "ssd:", "raid:"]
        .iter()
        .find_map(|kind| spec.strip_prefix(kind))
    {
        // `key=value` items separated by commas, spaces around either trimmed, as the volume
        // crate parses them (its `file=` path cannot contain a comma).
        return params
            .split(',')
            .filter_map(|item| item.split_once('='))
            .find(|(k, _)| k.trim() == "file")
            .map(|(_, v)| v.trim())
            .filter(|v| !v.is_empty());
    }
    // Every other volume kind is spelled `kind:...`; a path with a colon still starts with `/`
    // or `.` in practice, and a bare relative name without one is a path too.
    let kind = spec.split_once(':').map(|(k, _)| k);
    match kind {
        Some(k) if !k.contains('/') && !k.starts_with('.') => None,
        _ => Some(spec),
    }
}

/// Claim the device `spec` names. `Ok(None)` for devices without anything to claim (RAM,
/// null, emulated and remote devices) and for paths that do not exist (opening reports that).
/// `allow_mounted` lets a block device that is mounted (and so cannot be opened with O_EXCL)
/// through without an exclusive claim: `add-core --force`.
pub fn claim(spec: &str, allow_mounted: bool) -> Result<Option<Claim>, String> {
    let Some(path) = spec_path(spec) else {
        return Ok(None);
    };
    let path = Path::new(path);
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(None);
    };
    if meta.file_type().is_block_device() {
        claim_block(spec, path, meta.rdev(), allow_mounted).map(Some)
    } else if meta.file_type().is_file() {
        claim_file(spec, path, meta.dev(), meta.ino(), allow_mounted).map(Some)
    } else {
        Ok(None)
    }
}

fn claim_file(
    spec: &str,
    path: &Path,
    dev: u64,
    ino: u64,
    allow_mounted: bool,
) -> Result<Claim, String> {
    // A loop device over this file is the same device under another name: refuse while the
    // loop device is in use (mounted, or claimed by a daemon that uses it). A daemon using the
    // loop device also holds the file's lock, taken below.
    for lo in loop_devices_over(dev, ino) {
        if let Some(what) = block_in_use(&lo.dev_path, lo.rdev) {
            let mounted = mounts_of_block(lo.rdev);
            if allow_mounted && !mounted.is_empty() {
                tracing::warn!(
                    "{spec} is mounted through {} at {}; used anyway (--force)",
                    lo.dev_path.display(),
                    mounted.join(", ")
                );
                continue;
            }
            return Err(format!(
                "device {spec} is in use through the loop device {} ({what})",
                lo.dev_path.display()
            ));
        }
    }
    let file = lock_file(path).map_err(|e| match e.raw_os_error() {
        Some(libc::EAGAIN) | Some(libc::EACCES) => format!(
            "device {spec} is claimed by another user{}; stop that user first",
            describe_holders(path, Holder::File { dev, ino })
        ),
        _ => format!("device {spec}: cannot claim it: {e}"),
    })?;
    Ok(Claim { _fds: vec![file] })
}

fn lock_file(path: &Path) -> io::Result<File> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)?;
    // SAFETY: a zeroed flock is a valid value; the fields set describe a whole-file write lock.
    let mut lock: libc::flock = unsafe { std::mem::zeroed() };
    lock.l_type = libc::F_WRLCK as libc::c_short;
    lock.l_whence = libc::SEEK_SET as libc::c_short;
    lock.l_start = 0;
    lock.l_len = 0;
    // SAFETY: fcntl on a descriptor we own with a pointer to a valid flock.
    let rc = unsafe { libc::fcntl(file.as_raw_fd(), libc::F_OFD_SETLK, &lock) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(file)
}

fn claim_block(spec: &str, path: &Path, rdev: u64, allow_mounted: bool) -> Result<Claim, String> {
    let mut fds = Vec::new();
    match OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_EXCL | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(f) => fds.push(f),
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            let mounted = mounts_of_block(rdev);
            if !allow_mounted || mounted.is_empty() {
                let what = block_in_use(path, rdev).unwrap_or_else(|| "in use".into());
                let hint = if mounted.is_empty() {
                    "stop that user first"
                } else {
                    "unmount it first"
                };
                return Err(format!("device {spec} is {what}; {hint}"));
            }
            tracing::warn!(
                "{spec} is mounted at {}; used anyway without an exclusive claim (--force)",
                mounted.join(", ")
            );
        }
        Err(e) => return Err(format!("device {spec}: cannot claim it: {e}")),
    }
    // The file behind a loop device is claimed too, so the file's own name and every other
    // loop device over it conflict with this claim, in any process.
    if let Some((bdev, bino)) = loop_backing(rdev) {
        if let Some(backing) = loop_backing_path(rdev) {
            let same = std::fs::metadata(&backing)
                .map(|m| m.dev() == bdev && m.ino() == bino)
                .unwrap_or(false);
            if same {
                let f = lock_file(&backing).map_err(|e| match e.raw_os_error() {
                    Some(libc::EAGAIN) | Some(libc::EACCES) => format!(
                        "device {spec} is a loop device over {}, which is claimed by another user{}; stop that user first",
                        backing.display(),
                        describe_holders(&backing, Holder::File { dev: bdev, ino: bino })
                    ),
                    _ => format!(
                        "device {spec}: cannot claim its backing file {}: {e}",
                        backing.display()
                    ),
                })?;
                fds.push(f);
            }
        }
    }
    Ok(Claim { _fds: fds })
}

/// Why the block device is busy, if it is: its mounts, the processes holding it, the kernel
/// devices stacked on it.
fn block_in_use(path: &Path, rdev: u64) -> Option<String> {
    match OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL | libc::O_CLOEXEC)
        .open(path)
    {
        Ok(_) => None,
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            let mut parts = Vec::new();
            let mounts = mounts_of_block(rdev);
            if !mounts.is_empty() {
                parts.push(format!("mounted at {}", mounts.join(", ")));
            }
            let holders = kernel_holders(rdev);
            if !holders.is_empty() {
                parts.push(format!("held by {}", holders.join(", ")));
            }
            let pids = describe_holders(path, Holder::Block(rdev));
            Some(if parts.is_empty() {
                format!("claimed by another user{pids}")
            } else {
                format!("{}{pids}", parts.join(", "))
            })
        }
        Err(_) => None,
    }
}

#[derive(Clone, Copy)]
enum Holder {
    File { dev: u64, ino: u64 },
    Block(u64),
}

/// " (pid 123 hybridcache, which holds cache 1)" or "" when nothing more is known.
fn describe_holders(path: &Path, holder: Holder) -> String {
    let mut parts: Vec<String> = pids_holding(holder)
        .into_iter()
        .map(|(pid, comm)| {
            if pid == std::process::id() {
                format!("pid {pid} {comm}, this daemon")
            } else {
                format!("pid {pid} {comm}")
            }
        })
        .collect();
    if let Some(id) = cache_id_on(path) {
        parts.push(format!("it holds hybridcache cache {id}"));
    }
    if parts.is_empty() {
        String::new()
    } else {
        format!(" ({})", parts.join("; "))
    }
}

/// The processes with a descriptor open on the file or block device (pid, command name).
fn pids_holding(holder: Holder) -> Vec<(u32, String)> {
    let mut out = Vec::new();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return out;
    };
    for p in procs.flatten() {
        let Some(pid) = p.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
            continue;
        };
        let holds = fds.flatten().any(|fd| {
            std::fs::metadata(fd.path()).is_ok_and(|m| match holder {
                Holder::File { dev, ino } => m.dev() == dev && m.ino() == ino,
                Holder::Block(rdev) => m.file_type().is_block_device() && m.rdev() == rdev,
            })
        });
        if holds {
            let comm = std::fs::read_to_string(p.path().join("comm"))
                .map(|s| s.trim().to_string())
                .unwrap_or_default();
            out.push((pid, comm));
        }
    }
    out
}

/// The id of the hybridcache cache the device holds, read from its superblock.
fn cache_id_on(path: &Path) -> Option<u16> {
    let volume = hybridcache_volume::FileVolume::open(path).ok()?;
    hybridcache_engine::Cache::peek(&volume)
        .ok()
        .map(|sb| sb.cache_id)
}

/// `major:minor` as /proc/self/mountinfo and sysfs spell a device number.
fn dev_text(rdev: u64) -> String {
    format!("{}:{}", libc::major(rdev), libc::minor(rdev))
}

/// Mount points of the file systems on this block device or, for a whole disk, on its
/// partitions.
pub fn mounts_of_block(rdev: u64) -> Vec<String> {
    let Ok(text) = std::fs::read_to_string("/proc/self/mountinfo") else {
        return Vec::new();
    };
    let mut wanted = vec![dev_text(rdev)];
    wanted.extend(partitions_of(rdev).into_iter().map(dev_text));
    let mut out = Vec::new();
    for line in text.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        if fields.len() > 4 && wanted.iter().any(|w| w == fields[2]) {
            out.push(unescape_mount(fields[4]));
        }
    }
    out
}

/// mountinfo escapes space, tab, newline and backslash as octal.
fn unescape_mount(s: &str) -> String {
    s.replace("\\040", " ")
        .replace("\\011", "\t")
        .replace("\\012", "\n")
        .replace("\\134", "\\")
}

fn sysfs_dir(rdev: u64) -> PathBuf {
    PathBuf::from(format!("/sys/dev/block/{}", dev_text(rdev)))
}

fn read_dev_file(path: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(path).ok()?;
    let (maj, min) = text.trim().split_once(':')?;
    Some(libc::makedev(maj.parse().ok()?, min.parse().ok()?))
}

/// The whole disk a partition belongs to; the device itself when it is a whole disk.
pub fn whole_disk(rdev: u64) -> u64 {
    let dir = sysfs_dir(rdev);
    if !dir.join("partition").exists() {
        return rdev;
    }
    std::fs::canonicalize(&dir)
        .ok()
        .and_then(|d| d.parent().and_then(|p| read_dev_file(&p.join("dev"))))
        .unwrap_or(rdev)
}

/// What the kernel says a disk is, whatever its name: its WWID, or else its serial number.
/// None for a disk that reports neither (loop, RAM and many virtual disks).
pub fn disk_hardware_id(disk: u64) -> Option<String> {
    let dir = sysfs_dir(disk);
    ["wwid", "device/wwid", "serial", "device/serial"]
        .iter()
        .filter_map(|f| std::fs::read_to_string(dir.join(f)).ok())
        .map(|t| t.trim().to_string())
        .find(|t| !t.is_empty())
}

/// A partition's number on its disk (None for a whole disk).
pub fn partition_number(rdev: u64) -> Option<u32> {
    std::fs::read_to_string(sysfs_dir(rdev).join("partition"))
        .ok()?
        .trim()
        .parse()
        .ok()
}

fn partitions_of(rdev: u64) -> Vec<u64> {
    let Ok(dir) = std::fs::canonicalize(sysfs_dir(rdev)) else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(&dir) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.path().join("partition").exists())
        .filter_map(|e| read_dev_file(&e.path().join("dev")))
        .collect()
}

/// Kernel devices stacked on this one (md, dm, bcache), by name.
fn kernel_holders(rdev: u64) -> Vec<String> {
    std::fs::read_dir(sysfs_dir(rdev).join("holders"))
        .map(|d| {
            d.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

const LOOP_MAJOR: u32 = 7;
const LOOP_GET_STATUS64: libc::c_ulong = 0x4C05;

/// The kernel's `struct loop_info64`.
#[repr(C)]
struct LoopInfo64 {
    lo_device: u64,
    lo_inode: u64,
    lo_rdevice: u64,
    lo_offset: u64,
    lo_sizelimit: u64,
    lo_number: u32,
    lo_encrypt_type: u32,
    lo_encrypt_key_size: u32,
    lo_flags: u32,
    lo_file_name: [u8; 64],
    lo_crypt_name: [u8; 64],
    lo_encrypt_key: [u8; 32],
    lo_init: [u64; 2],
}

/// (st_dev, st_ino) of the file behind a loop device (or behind the loop device a partition
/// belongs to); None for other devices and unbound loop devices.
pub fn loop_backing(rdev: u64) -> Option<(u64, u64)> {
    let disk = whole_disk(rdev);
    if libc::major(disk) != LOOP_MAJOR {
        return None;
    }
    let node = PathBuf::from(format!("/dev/loop{}", libc::minor(disk)));
    let f = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(&node)
        .ok()?;
    if f.metadata().ok()?.rdev() != disk {
        return None;
    }
    // SAFETY: LoopInfo64 is plain data; all-zero is a valid value.
    let mut info: LoopInfo64 = unsafe { std::mem::zeroed() };
    // SAFETY: LOOP_GET_STATUS64 fills a struct loop_info64, which `info` is.
    let rc = unsafe { libc::ioctl(f.as_raw_fd(), LOOP_GET_STATUS64, &mut info) };
    (rc == 0).then_some((info.lo_device, info.lo_inode))
}

/// The path of a loop device's backing file as sysfs records it.
fn loop_backing_path(rdev: u64) -> Option<PathBuf> {
    let text =
        std::fs::read_to_string(sysfs_dir(whole_disk(rdev)).join("loop/backing_file")).ok()?;
    let p = text.trim_end_matches('\n');
    (!p.is_empty()).then(|| PathBuf::from(p))
}

struct LoopDevice {
    dev_path: PathBuf,
    rdev: u64,
}

/// The bound loop devices whose backing file is (dev, ino).
fn loop_devices_over(dev: u64, ino: u64) -> Vec<LoopDevice> {
    let Ok(entries) = std::fs::read_dir("/sys/block") else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with("loop"))
        .filter(|e| e.path().join("loop/backing_file").exists())
        .filter_map(|e| {
            let rdev = read_dev_file(&e.path().join("dev"))?;
            (loop_backing(rdev) == Some((dev, ino))).then(|| LoopDevice {
                dev_path: PathBuf::from("/dev").join(e.file_name()),
                rdev,
            })
        })
        .collect()
}

/// Where this daemon serves NBD, to recognise its own exports offered as a device: a cache
/// whose core is one of its own exports writes into itself and deadlocks.
#[derive(Debug, Clone, Default)]
pub struct OwnEndpoints {
    /// (st_dev, st_ino) of the Unix socket, so any spelling of its path matches.
    pub unix: Option<(u64, u64)>,
    pub tcp: Option<std::net::SocketAddr>,
}

impl OwnEndpoints {
    pub fn new(unix: &Path, tcp: Option<std::net::SocketAddr>) -> OwnEndpoints {
        OwnEndpoints {
            unix: std::fs::metadata(unix).ok().map(|m| (m.dev(), m.ino())),
            tcp,
        }
    }

    /// Whether the NBD URI `spec` reaches this daemon's own server.
    pub fn serves(&self, spec: &str) -> bool {
        use crate::nbd_volume::{parse_nbd_uri, NbdTarget};
        match parse_nbd_uri(spec) {
            Ok(NbdTarget::Unix { socket, .. }) => {
                self.unix.is_some()
                    && std::fs::metadata(&socket)
                        .is_ok_and(|m| Some((m.dev(), m.ino())) == self.unix)
            }
            Ok(NbdTarget::Tcp { host, port, .. }) => {
                let Some(own) = self.tcp else {
                    return false;
                };
                if port != own.port() {
                    return false;
                }
                use std::net::ToSocketAddrs;
                let Ok(addrs) = (host.as_str(), port).to_socket_addrs() else {
                    return false;
                };
                addrs.into_iter().any(|a| {
                    let ip = a.ip();
                    ip == own.ip()
                        || (own.ip().is_unspecified() && is_local(ip))
                        || (ip.is_unspecified() && is_local(own.ip()))
                })
            }
            Err(_) => false,
        }
    }
}

/// Whether `ip` is an address of this machine: only those can be bound.
fn is_local(ip: std::net::IpAddr) -> bool {
    ip.is_loopback() || ip.is_unspecified() || std::net::UdpSocket::bind((ip, 0)).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_with_paths() {
        assert_eq!(spec_path("/a/b"), Some("/a/b"));
        assert_eq!(spec_path("file:/a/b"), Some("/a/b"));
        assert_eq!(spec_path("rel.img"), Some("rel.img"));
        assert_eq!(spec_path("./x:y"), Some("./x:y"));
        assert_eq!(spec_path("ram:1G"), None);
        // Wrapped devices are the file that holds their data.
        assert_eq!(spec_path("throttle:latency_us=1:/a"), Some("/a"));
        assert_eq!(spec_path("throttle:iops=5:file:/a:b"), Some("/a:b"));
        assert_eq!(spec_path("throttle:iops=5:throttle:bw=1M:/a"), Some("/a"));
        assert_eq!(spec_path("throttle:iops=5:ram:1G"), None);
        assert_eq!(spec_path("hdd:size=1G,file=/a,rpm=5400"), Some("/a"));
        assert_eq!(spec_path("ssd:size=1G, file = /a"), Some("/a"));
        assert_eq!(
            spec_path("raid:level=1,disks=2,disk_size=1G,file=/a"),
            Some("/a")
        );
        assert_eq!(spec_path("hdd:size=1G"), None);
        assert_eq!(spec_path("hdd:size=1G,nodata"), None);
        assert_eq!(spec_path("nbd+unix:///x?socket=/s"), None);
    }

    #[test]
    fn a_file_is_claimed_once() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("d.img");
        std::fs::write(&p, vec![0u8; 4096]).unwrap();
        let spec = p.to_str().unwrap();
        let first = claim(spec, false).unwrap();
        assert!(first.is_some());
        let e = claim(&format!("file:{spec}"), false).unwrap_err();
        assert!(e.contains("claimed by another user"), "{e}");
        assert!(e.contains("this daemon"), "{e}");
        drop(first);
        assert!(claim(spec, false).unwrap().is_some());
    }

    #[test]
    fn own_exports_are_recognised_by_any_spelling() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("nbd.sock");
        let _l = std::os::unix::net::UnixListener::bind(&sock).unwrap();
        let own = OwnEndpoints::new(&sock, Some("0.0.0.0:10999".parse().unwrap()));
        let alias = format!("{}/./nbd.sock", dir.path().display());
        assert!(own.serves(&format!("nbd+unix:///cas1-1?socket={alias}")));
        assert!(!own.serves("nbd+unix:///cas1-1?socket=/no/such.sock"));
        assert!(own.serves("nbd://127.0.0.1:10999/cas1-1"));
        assert!(own.serves("nbd://localhost:10999/cas1-1"));
        assert!(!own.serves("nbd://127.0.0.1:10998/cas1-1"));
        let lo = OwnEndpoints::new(&sock, Some("127.0.0.1:10999".parse().unwrap()));
        assert!(lo.serves("nbd://127.0.0.1:10999/x"));
        assert!(!lo.serves("nbd://127.0.0.2:10999/x"));
    }

    #[test]
    fn unescapes_mount_points() {
        assert_eq!(unescape_mount("/mnt/a\\040b"), "/mnt/a b");
    }
}

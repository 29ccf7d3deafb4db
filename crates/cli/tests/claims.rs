//! Issue 12, cases 1-4 and 8: a device is used by one cache or core at a time, however it is
//! spelled and whoever asks (exclusive claims); `-S` does not format a device holding data of
//! another kind unless forced (signatures); `-T` and `-R` do not take an export away from its
//! clients unless forced (in-use guard); and a cache never uses its own daemon's export as a
//! device (self-loop).
//!
//! Loop devices, mounts, nbdfuse and fio are set up by drop guards, so a failing test leaves
//! none of them behind. A test whose tool is missing, or that cannot set up a loop device or a
//! mount here, says so and returns, except in CI or with HC_REQUIRE_TOOLS=1, where it fails.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{file_cache, have, need, skip, sparse_file, workdir, Daemon, FileCache};

const MIB: u64 = 1 << 20;

fn sh(cmd: &str, args: &[&str]) -> Result<String, String> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| format!("{cmd}: {e}"))?;
    if out.status.success() {
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    } else {
        Err(format!(
            "{cmd} {args:?} exited with {}: {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ))
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("UTF-8 path")
}

/// A loop device over a file, detached when dropped.
struct Loop(String);

impl Loop {
    fn over(file: &Path) -> Option<Loop> {
        match sh("losetup", &["-f", "--show", path_str(file)]) {
            Ok(dev) => Some(Loop(dev)),
            Err(e) => {
                skip(&format!("no loop device here ({e})"));
                None
            }
        }
    }
}

impl Drop for Loop {
    fn drop(&mut self) {
        let _ = sh("losetup", &["-d", &self.0]);
    }
}

/// A mount, lazily unmounted when dropped (before the loop device under it goes).
struct Mount(PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = sh("umount", &["-l", path_str(&self.0)]);
    }
}

/// A child process (nbdfuse, fio) killed when dropped; nbdfuse's mount is undone first.
struct Proc {
    child: Child,
    fuse_dir: Option<PathBuf>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        if let Some(d) = self.fuse_dir.take() {
            let _ = sh("fusermount3", &["-u", path_str(&d)]);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls until `f` holds (the daemon and its clients act on their own threads).
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !f() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn clients(d: &Daemon, cache: u16, core: u16) -> u64 {
    let v: serde_json::Value =
        serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("list JSON");
    v["caches"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|c| c["id"] == cache)
        .flat_map(|c| c["cores"].as_array().cloned().unwrap_or_default())
        .find(|k| k["id"] == core)
        .and_then(|k| k["clients"].as_u64())
        .unwrap_or(0)
}

/// A file of `len` bytes of a pattern that differs per 4 KiB block and per `seed`.
fn pattern_file(path: &Path, len: u64, seed: u8) {
    let data: Vec<u8> = (0..len)
        .map(|i| ((i / 4096) as u8).wrapping_mul(31).wrapping_add(seed) ^ (i as u8))
        .collect();
    std::fs::write(path, data).expect("write pattern");
}

#[test]
fn a_second_daemon_on_the_same_cache_device_is_refused() {
    if !need(&["nbdcopy"]) {
        return;
    }
    let fc = file_cache(64 * MIB, 64 * MIB, &["-c", "wb"]);
    let src = fc.dir.path().join("src.img");
    pattern_file(&src, 16 * MIB, 7);
    let uri = fc.daemon.uri("cas1-1");
    sh("nbdcopy", &[path_str(&src), &uri]).expect("write through cas1-1");

    // A daemon started by hand beside the first, on its own sockets.
    let dir2 = workdir();
    let second = Daemon::start(dir2.path());
    let core = path_str(&fc.core).to_string();
    let e = second.fails(&["-S", "-d", &fc.spec, "--load"]);
    assert!(e.contains("claimed by another user"), "{e}");
    assert!(e.contains("holds hybridcache cache 1"), "{e}");
    assert!(e.contains("pid "), "{e}");
    let e = second.fails(&["-S", "-d", &fc.spec, "--force", "-i", "2"]);
    assert!(e.contains("claimed by another user"), "{e}");
    // Its core too, by another spelling.
    second.ok(&["-S", "-d", "ram:64M", "-i", "3"]);
    let e = second.fails(&["-A", "-i", "3", "-d", &format!("file:{core}")]);
    assert!(e.contains("claimed by another user"), "{e}");

    // The first daemon kept serving: what it was given reads back, also after a flush.
    fc.daemon.ok(&["-F", "-i", "1"]);
    let got = read_export(&fc.daemon, "cas1-1", 16 * MIB, fc.dir.path());
    assert!(got == std::fs::read(&src).unwrap(), "cas1-1 lost data");
    // Once the first daemon lets go, the device is free again.
    drop(second);
    let FileCache {
        dir, spec, daemon, ..
    } = fc;
    drop(daemon);
    let third = Daemon::start(dir.path());
    third.ok(&["-S", "-d", &spec, "--load"]);
    let got = read_export(&third, "cas1-1", 16 * MIB, dir.path());
    assert!(
        got == std::fs::read(&src).unwrap(),
        "cas1-1 lost data across the restart"
    );
}

/// The first `len` bytes of an export, read with nbdcopy.
fn read_export(d: &Daemon, export: &str, len: u64, dir: &Path) -> Vec<u8> {
    let out = dir.join(format!("{export}.read"));
    let _ = std::fs::remove_file(&out);
    sh("nbdcopy", &[&d.uri(export), path_str(&out)]).expect("read the export");
    let mut data = std::fs::read(&out).expect("read copy");
    data.truncate(len as usize);
    data
}

/// One signature: the tool that makes it, and the words `-S` must name it by.
struct Maker {
    name: &'static str,
    tool: &'static str,
    expect: &'static str,
    make: fn(&Path) -> Result<(), String>,
}

fn mkfs(tool: &'static str, args: &'static [&'static str]) -> impl Fn(&Path) -> Result<(), String> {
    move |p: &Path| {
        let mut a: Vec<&str> = args.to_vec();
        a.push(path_str(p));
        sh(tool, &a).map(|_| ())
    }
}

fn sfdisk(p: &Path, label: &str) -> Result<(), String> {
    let mut child = Command::new("sfdisk")
        .args(["-q", path_str(p)])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("sfdisk: {e}"))?;
    use std::io::Write as _;
    child
        .stdin
        .take()
        .ok_or("sfdisk: no stdin")?
        .write_all(format!("label: {label}\n,,L\n").as_bytes())
        .map_err(|e| format!("sfdisk: {e}"))?;
    let out = child
        .wait_with_output()
        .map_err(|e| format!("sfdisk: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// pvcreate takes only block devices: through a loop device, detached afterwards.
fn pvcreate(p: &Path) -> Result<(), String> {
    let lo = Loop::over(p).ok_or("no loop device")?;
    sh("pvcreate", &["-ff", "-y", &lo.0]).map(|_| ())
}

/// An MD v1.2 member superblock written by hand: mdadm cannot create an array without the
/// kernel's md driver, which this machine lacks. Layout and checksum as in the kernel's
/// `struct mdp_superblock_1` (the checksum is checked by libblkid and `mdadm --examine`).
fn md_superblock(p: &Path) -> Result<(), String> {
    let size = std::fs::metadata(p).map_err(|e| e.to_string())?.len();
    let mut sb = vec![0u8; 256 + 2 * 2];
    let put32 =
        |sb: &mut Vec<u8>, at: usize, v: u32| sb[at..at + 4].copy_from_slice(&v.to_le_bytes());
    let put64 =
        |sb: &mut Vec<u8>, at: usize, v: u64| sb[at..at + 8].copy_from_slice(&v.to_le_bytes());
    put32(&mut sb, 0, 0xa92b_4efc); // magic
    put32(&mut sb, 4, 1); // major version
    for (i, b) in sb[16..32].iter_mut().enumerate() {
        *b = i as u8 + 1; // array uuid
    }
    sb[32..39].copy_from_slice(b"hc:test");
    put64(&mut sb, 64, 1_700_000_000); // ctime
    put32(&mut sb, 72, 1); // raid1
    put64(&mut sb, 80, (size >> 9) - 2048); // size in sectors
    put32(&mut sb, 92, 2); // raid disks
    put64(&mut sb, 128, 2048); // data offset
    put64(&mut sb, 136, (size >> 9) - 2048); // data size
    put64(&mut sb, 144, 8); // superblock offset (1.2: 4 KiB in)
    for (i, b) in sb[168..184].iter_mut().enumerate() {
        *b = i as u8 + 17; // device uuid
    }
    put64(&mut sb, 192, 1_700_000_000); // utime
    put64(&mut sb, 200, 1); // events
    put64(&mut sb, 208, u64::MAX); // resync offset: in sync
    put32(&mut sb, 220, 2); // max_dev
    sb[258] = 1; // dev_roles = [0, 1]
    let sum: u64 = sb
        .chunks(4)
        .map(|c| u64::from(u32::from_le_bytes([c[0], c[1], c[2], c[3]])))
        .sum();
    put32(&mut sb, 216, ((sum & 0xffff_ffff) + (sum >> 32)) as u32);
    use std::os::unix::fs::FileExt as _;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(p)
        .map_err(|e| e.to_string())?;
    f.write_all_at(&sb, 4096).map_err(|e| e.to_string())
}

/// Open CAS's superblock start: no tool makes one without its kernel module, so by hand, as
/// its metadata probe reads it (magic 0x187E1CA6 at byte 4 of the first page).
fn open_cas_superblock(p: &Path) -> Result<(), String> {
    let mut head = [0u8; 12];
    head[0] = 1; // clean shutdown
    head[1] = 1; // dirty data flushed
    head[4..8].copy_from_slice(&0x187E_1CA6u32.to_le_bytes());
    head[8..12].copy_from_slice(&0x1505u32.to_le_bytes());
    use std::os::unix::fs::FileExt as _;
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(p)
        .map_err(|e| e.to_string())?;
    f.write_all_at(&head, 0).map_err(|e| e.to_string())
}

#[test]
fn each_signature_is_refused_without_force_and_overwritten_with_it() {
    let makers: Vec<Maker> = vec![
        Maker {
            name: "ext2",
            tool: "mkfs.ext2",
            expect: "an ext2 file system (uuid ",
            make: |p| mkfs("mkfs.ext2", &["-q", "-F"])(p),
        },
        Maker {
            name: "ext3",
            tool: "mkfs.ext3",
            expect: "an ext3 file system (uuid ",
            make: |p| mkfs("mkfs.ext3", &["-q", "-F"])(p),
        },
        Maker {
            name: "ext4",
            tool: "mkfs.ext4",
            expect: "an ext4 file system (uuid ",
            make: |p| mkfs("mkfs.ext4", &["-q", "-F"])(p),
        },
        Maker {
            name: "xfs",
            tool: "mkfs.xfs",
            expect: "an xfs file system (uuid ",
            make: |p| mkfs("mkfs.xfs", &["-q", "-f"])(p),
        },
        Maker {
            name: "btrfs",
            tool: "mkfs.btrfs",
            expect: "a btrfs file system (uuid ",
            make: |p| mkfs("mkfs.btrfs", &["-q", "-f"])(p),
        },
        Maker {
            name: "swap",
            tool: "mkswap",
            expect: "a swap area (uuid ",
            make: |p| mkfs("mkswap", &["-q"])(p),
        },
        Maker {
            name: "lvm2",
            tool: "pvcreate",
            expect: "an LVM2 physical volume (uuid ",
            make: pvcreate,
        },
        Maker {
            name: "md",
            tool: "sh",
            expect: "an MD RAID member (uuid ",
            make: md_superblock,
        },
        Maker {
            name: "gpt",
            tool: "sfdisk",
            expect: "a GPT partition table",
            make: |p| sfdisk(p, "gpt"),
        },
        Maker {
            name: "mbr",
            tool: "sfdisk",
            expect: "an MBR (dos) partition table",
            make: |p| sfdisk(p, "dos"),
        },
        Maker {
            name: "bcache",
            tool: "make-bcache",
            expect: "a bcache superblock",
            make: |p| mkfs("make-bcache", &["-B"])(p),
        },
        Maker {
            name: "open-cas",
            tool: "sh",
            expect: "an Open CAS cache",
            make: open_cas_superblock,
        },
    ];
    let dir = workdir();
    let d = Daemon::start(dir.path());
    let mut skipped = Vec::new();
    for (i, m) in makers.iter().enumerate() {
        if !have(m.tool) {
            eprintln!("skipped {}: {} is not installed", m.name, m.tool);
            skipped.push(m.name);
            continue;
        }
        // xfs wants 300 MiB at least; sparse, so it costs nothing.
        let dev = dir.path().join(format!("{}.img", m.name));
        sparse_file(&dev, 320 * MIB);
        (m.make)(&dev).unwrap_or_else(|e| panic!("making {}: {e}", m.name));
        let before = std::fs::read(&dev).unwrap();
        let id = (i + 1).to_string();
        let e = d.fails(&["-S", "-d", path_str(&dev), "-i", &id]);
        assert!(e.contains(m.expect), "{}: {e}", m.name);
        assert!(
            e.contains("give --force to accept that it is overwritten"),
            "{}: {e}",
            m.name
        );
        assert!(
            std::fs::read(&dev).unwrap() == before,
            "{}: a refusal wrote to the device",
            m.name
        );
        d.ok(&["-S", "-d", path_str(&dev), "-i", &id, "--force"]);
        d.ok(&["-T", "-i", &id]);
        // Now it holds a hybridcache cache, which is refused as before.
        let e = d.fails(&["-S", "-d", path_str(&dev), "-i", &id]);
        assert!(e.contains("cache"), "{}: {e}", m.name);
        std::fs::remove_file(&dev).unwrap();
    }
    if !skipped.is_empty() {
        skip(&format!("signatures not tested: {skipped:?}"));
    }
}

#[test]
fn a_mounted_device_is_refused() {
    let dir = workdir();
    let img = dir.path().join("fs.img");
    sparse_file(&img, 64 * MIB);
    sh("mkfs.ext4", &["-q", "-F", path_str(&img)]).expect("mkfs.ext4");
    let Some(lo) = Loop::over(&img) else { return };
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    if let Err(e) = sh("mount", &[&lo.0, path_str(&mnt)]) {
        skip(&format!("cannot mount here ({e})"));
        return;
    }
    let _m = Mount(mnt.clone());
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", "ram:64M", "-i", "1"]);
    let e = d.fails(&["-A", "-i", "1", "-d", &lo.0]);
    assert!(
        e.contains("mounted at") && e.contains(path_str(&mnt)),
        "{e}"
    );
    // Its file, through the loop device.
    let e = d.fails(&["-A", "-i", "1", "-d", path_str(&img)]);
    assert!(
        e.contains("through the loop device") && e.contains("mounted at"),
        "{e}"
    );
    // Never formatted while mounted, forced or not.
    let e = d.fails(&["-S", "-d", &lo.0, "-i", "2", "--force"]);
    assert!(e.contains("mounted at"), "{e}");
    let e = d.fails(&["-S", "-d", path_str(&img), "-i", "2", "--force"]);
    assert!(e.contains("mounted at"), "{e}");
    // add-core --force takes it (the operator's call), and nothing has been written.
    let out = d.ok(&["-A", "-i", "1", "-d", &lo.0, "--force"]);
    assert!(
        out.contains("without an exclusive claim") && out.contains(path_str(&mnt)),
        "the accepted risk is printed: {out}"
    );
    d.ok(&["-R", "-i", "1", "-j", "1"]);
    drop(d);
    drop(_m);
    sh("e2fsck", &["-fn", path_str(&img)]).expect("the file system is intact");
}

#[test]
fn loop_aliases_of_a_cache_file_and_of_a_core_file_are_refused() {
    let fc = file_cache(64 * MIB, 64 * MIB, &["-c", "wb"]);
    let Some(cache_lo) = Loop::over(&fc.cache) else {
        return;
    };
    let Some(core_lo) = Loop::over(&fc.core) else {
        return;
    };
    let d = &fc.daemon;
    let e = d.fails(&["-S", "-d", &cache_lo.0, "-i", "2", "--force"]);
    assert!(e.contains("cache device of cache 1"), "{e}");
    d.ok(&["-S", "-d", "ram:64M", "-i", "2"]);
    let e = d.fails(&["-A", "-i", "2", "-d", &core_lo.0]);
    assert!(e.contains("core 1 of cache 1"), "{e}");
    // Another process meets the same claims through the loop devices.
    let dir2 = workdir();
    let second = Daemon::start(dir2.path());
    let e = second.fails(&["-S", "-d", &cache_lo.0, "-i", "1", "--force"]);
    assert!(
        e.contains("claimed by another user") && e.contains("holds hybridcache cache 1"),
        "{e}"
    );
    second.ok(&["-S", "-d", "ram:64M", "-i", "5"]);
    let e = second.fails(&["-A", "-i", "5", "-d", &core_lo.0]);
    assert!(e.contains("claimed by another user"), "{e}");
    // And the other way round: a cache on a loop device claims its file.
    drop(second);
    let img = fc.dir.path().join("third.img");
    sparse_file(&img, 64 * MIB);
    let Some(third_lo) = Loop::over(&img) else {
        return;
    };
    d.ok(&["-S", "-d", &third_lo.0, "-i", "3"]);
    let e = d.fails(&["-S", "-d", path_str(&img), "-i", "4", "--force"]);
    assert!(e.contains("cache device of cache 3"), "{e}");
    let dir3 = workdir();
    let other = Daemon::start(dir3.path());
    let e = other.fails(&["-S", "-d", path_str(&img), "-i", "4", "--force"]);
    assert!(
        e.contains("in use through the loop device") || e.contains("claimed"),
        "{e}"
    );
    drop(other);
    // Cache 1 survived all of it: it stops cleanly and loads again as cache 1.
    d.ok(&["-T", "-i", "3"]);
    d.ok(&["-T", "-i", "1"]);
    let out = d.ok(&["-S", "-d", &fc.spec, "--load"]);
    let _ = out;
    assert!(d.ok(&["-L"]).contains(&fc.spec), "cache 1 is back");
}

/// The specs that keep their data in `file`: throttled (any inner spelling) and emulated
/// devices with `file=`. Each is that file, for claims, identity and signatures.
fn wrapped(file: &str) -> Vec<String> {
    vec![
        format!("throttle:latency_us=1:{file}"),
        format!("throttle:iops=100000:file:{file}"),
        format!("throttle:latency_us=1:throttle:bw=1G:{file}"),
        format!("hdd:size=64M,file={file}"),
        format!("ssd:size=64M,file={file}"),
        format!("raid:level=1,disks=2,disk_size=64M,file={file}"),
    ]
}

#[test]
fn wrapped_specs_of_a_claimed_file_are_refused() {
    let fc = file_cache(64 * MIB, 64 * MIB, &["-c", "wb"]);
    let d = &fc.daemon;
    d.ok(&["-S", "-d", "ram:64M", "-i", "2"]);
    for (file, user) in [
        (path_str(&fc.cache), "cache device of cache 1"),
        (path_str(&fc.core), "core 1 of cache 1"),
    ] {
        for spec in wrapped(file) {
            let e = d.fails(&["-S", "-d", &spec, "-i", "3", "--force"]);
            assert!(e.contains(user), "{spec}: {e}");
            let e = d.fails(&["-A", "-i", "2", "-d", &spec, "--force"]);
            assert!(e.contains(user), "{spec}: {e}");
        }
    }
    // Another process meets the same claims.
    let dir2 = workdir();
    let second = Daemon::start(dir2.path());
    second.ok(&["-S", "-d", "ram:64M", "-i", "5"]);
    for spec in wrapped(path_str(&fc.core)) {
        let e = second.fails(&["-A", "-i", "5", "-d", &spec]);
        assert!(e.contains("claimed by another user"), "{spec}: {e}");
    }
    drop(second);
    // A wrapped device claims its file: the plain path and other wrappings are refused.
    let img = fc.dir.path().join("wrapped.img");
    sparse_file(&img, 64 * MIB);
    let throttled = format!("throttle:latency_us=1:{}", path_str(&img));
    d.ok(&["-A", "-i", "2", "-d", &throttled]);
    let e = d.fails(&["-A", "-i", "2", "-d", path_str(&img)]);
    assert!(e.contains("core 1 of cache 2"), "{e}");
    let e = d.fails(&[
        "-S",
        "-d",
        &format!("hdd:size=64M,file={}", path_str(&img)),
        "-i",
        "3",
        "--force",
    ]);
    assert!(e.contains("core 1 of cache 2"), "{e}");
    d.ok(&["-R", "-i", "2", "-j", "1"]);
    // Signatures are read through the wrapping: a throttled or emulated ext4 file is refused.
    let fs = fc.dir.path().join("fs.img");
    sparse_file(&fs, 64 * MIB);
    sh("mkfs.ext4", &["-q", "-F", path_str(&fs)]).expect("mkfs.ext4");
    let before = std::fs::read(&fs).unwrap();
    for spec in wrapped(path_str(&fs)) {
        let e = d.fails(&["-S", "-d", &spec, "-i", "3"]);
        assert!(
            e.contains("an ext4 file system") && e.contains("give --force"),
            "{spec}: {e}"
        );
    }
    assert!(
        std::fs::read(&fs).unwrap() == before,
        "a refusal wrote to the file"
    );
}

#[test]
fn stop_and_remove_are_refused_while_nbdfuse_holds_the_export() {
    if !need(&["nbdfuse", "fusermount3"]) {
        return;
    }
    let fc = file_cache(64 * MIB, 64 * MIB, &["-c", "wb"]);
    let d = &fc.daemon;
    let fuse = fc.dir.path().join("fuse");
    std::fs::create_dir(&fuse).unwrap();
    // Two connections (nbdfuse uses several where the server offers multi-conn, as ours does).
    let child = Command::new("nbdfuse")
        .args(["-C", "2"])
        .arg(fuse.join("disk"))
        .arg(d.uri("cas1-1"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start nbdfuse");
    let _p = Proc {
        child,
        fuse_dir: Some(fuse.clone()),
    };
    eventually("nbdfuse connected", || clients(d, 1, 1) == 2);
    // nbdfuse's connections alone hold the export, whatever the mount below does.
    let refused = || {
        let e = d.fails(&["-T", "-i", "1"]);
        assert!(
            e.contains("cas1-1 has 2 NBD connections open: disconnect them first, or give --disconnect-clients"),
            "{e}"
        );
        let e = d.fails(&["-R", "-i", "1", "-j", "1"]);
        assert!(e.contains("cas1-1 has 2 NBD connections open"), "{e}");
    };
    refused();
    // ext4 over the export, mounted through a loop device, as issue 12 found it.
    let disk = fuse.join("disk");
    let Some(lo) = Loop::over(&disk) else { return };
    sh("mkfs.ext4", &["-q", "-F", &lo.0]).expect("mkfs.ext4 on the export");
    let mnt = fc.dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    if let Err(e) = sh("mount", &[&lo.0, path_str(&mnt)]) {
        skip(&format!("cannot mount here ({e})"));
        return;
    }
    let m = Mount(mnt.clone());
    std::fs::write(mnt.join("kept"), vec![0x5a; 1 << 20]).unwrap();
    refused();
    // Both still there, and the counts show everywhere.
    let list = d.ok(&["-L"]);
    assert!(
        list.lines()
            .any(|l| l.contains("cas1-1") && l.trim_end().ends_with('2')),
        "{list}"
    );
    assert!(d.ok(&["-L", "-o", "csv"]).contains(",cas1-1,2"));
    let p = d.stats_json(1, Some(1));
    assert_eq!(p["info"]["clients"], 2, "{p}");
    assert_eq!(d.stats_json(1, None)["info"]["clients"], 2);
    assert!(d.ok(&["-P", "-i", "1"]).contains("NBD connections"));
    // The file system never noticed: it unmounts and checks clean, its file intact.
    sh("sync", &[]).expect("sync");
    assert_eq!(
        std::fs::read(mnt.join("kept")).unwrap(),
        vec![0x5a; 1 << 20]
    );
    drop(m);
    sh("e2fsck", &["-fn", &lo.0]).expect("ext4 on cas1-1 checks clean");
    drop(lo);
    d.ok(&["-T", "-i", "1", "--force"]);
    assert!(d.ok(&["-L"]).contains("No caches running"));
}

#[test]
fn stop_and_remove_are_refused_while_fio_runs() {
    if !need(&["fio"]) {
        return;
    }
    let fc = file_cache(64 * MIB, 64 * MIB, &["-c", "wb"]);
    let d = &fc.daemon;
    let out = fc.dir.path().join("fio.json");
    let child = Command::new("fio")
        .args([
            "--ioengine=nbd",
            &format!("--uri={}", d.uri("cas1-1")),
            "--rw=randwrite",
            "--bs=4k",
            "--size=16m",
            "--time_based",
            "--runtime=120",
            "--rate_iops=200",
            "--name=hold",
            &format!("--output={}", out.display()),
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start fio");
    let _p = Proc {
        child,
        fuse_dir: None,
    };
    // fio opens a first connection only to learn the size; its job's connection is the one
    // that writes.
    eventually("fio writing", || {
        clients(d, 1, 1) >= 1
            && d.stats_json(1, Some(1))["requests"]["write_total"]["count"]
                .as_u64()
                .unwrap_or(0)
                > 0
    });
    let e = d.fails(&["-R", "-i", "1", "-j", "1"]);
    assert!(e.contains("cas1-1 has 1 NBD connection open"), "{e}");
    let e = d.fails(&["-T", "-i", "1"]);
    assert!(e.contains("give --disconnect-clients"), "{e}");
    // --force alone discards the dirty data but does not take the export from fio (issue 30).
    let e = d.fails(&["-R", "-i", "1", "-j", "1", "--force"]);
    assert!(e.contains("cas1-1 has 1 NBD connection open"), "{e}");
    // Both consents: fio loses the export (and gets errors), the dirty data is discarded.
    let out = d.ok(&[
        "-R",
        "-i",
        "1",
        "-j",
        "1",
        "--force",
        "--disconnect-clients",
    ]);
    assert!(out.contains("closed 1 NBD connection of cas1-1"), "{out}");
    assert!(!d.ok(&["-L"]).contains("cas1-1"));
}

#[test]
fn the_daemons_own_export_is_refused_as_a_device() {
    // A free port for the TCP listener.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port");
    let dir = workdir();
    let cache = dir.path().join("cache.img");
    let core = dir.path().join("core.img");
    sparse_file(&cache, 64 * MIB);
    sparse_file(&core, 64 * MIB);
    let listen = format!("127.0.0.1:{port}");
    let d = Daemon::start_with(dir.path(), &["--nbd-listen", &listen]);
    d.ok(&["-S", "-d", path_str(&cache), "-i", "1"]);
    d.ok(&["-A", "-i", "1", "-d", path_str(&core)]);
    let alias = format!("{}/./nbd.sock", dir.path().display());
    for uri in [
        d.uri("cas1-1"),
        format!("nbd+unix:///cas1-1?socket={alias}"),
        format!("nbd://127.0.0.1:{port}/cas1-1"),
        format!("nbd://localhost:{port}/cas1-1"),
    ] {
        let e = d.fails(&["-A", "-i", "1", "-d", &uri]);
        assert!(e.contains("is an export of this daemon"), "{uri}: {e}");
        let e = d.fails(&["-S", "-d", &uri, "-i", "2", "--force"]);
        assert!(e.contains("is an export of this daemon"), "{uri}: {e}");
    }
    // Writes and a flush on cas1-1 still go through (the self-loop deadlocked them).
    if need(&["nbdcopy"]) {
        let src = dir.path().join("src.img");
        pattern_file(&src, 4 * MIB, 3);
        sh("nbdcopy", &[path_str(&src), &d.uri("cas1-1")]).expect("write and flush");
    }
    assert_eq!(
        d.ok(&["-L", "-o", "json"]).matches("\"cas1-").count(),
        1,
        "only the one core"
    );
}

#[test]
fn claims_are_released_by_remove_and_stop() {
    let fc = file_cache(64 * MIB, 64 * MIB, &["-c", "wt"]);
    let core = path_str(&fc.core).to_string();
    let dir2 = workdir();
    let second = Daemon::start(dir2.path());
    second.ok(&["-S", "-d", "ram:64M", "-i", "2"]);
    let e = second.fails(&["-A", "-i", "2", "-d", &core]);
    assert!(e.contains("claimed by another user"), "{e}");
    fc.daemon.ok(&["-R", "-i", "1", "-j", "1"]);
    second.ok(&["-A", "-i", "2", "-d", &core]);
    let e = second.fails(&["-S", "-d", &fc.spec, "--load"]);
    assert!(e.contains("claimed by another user"), "{e}");
    fc.daemon.ok(&["-T", "-i", "1"]);
    second.ok(&["-S", "-d", &fc.spec, "--load"]);
    // And back: the first daemon is now the one refused.
    let e = fc.daemon.fails(&["-S", "-d", &fc.spec, "--load"]);
    assert!(e.contains("claimed by another user"), "{e}");
}

/// Issue 12's first case as it happened: a second daemon, started by hand with a configuration
/// naming the same devices as the first. It must not serve the cache; the first keeps it.
#[test]
fn a_second_daemon_with_a_configuration_naming_the_device_does_not_serve_it() {
    let fc = file_cache(64 * MIB, 64 * MIB, &["-c", "wb"]);
    let dir2 = workdir();
    let cfg = dir2.path().join("hybridcache.toml");
    std::fs::write(
        &cfg,
        format!(
            "[[cache]]\nid = 1\ndevice = {:?}\nmode = \"wb\"\n\n[[core]]\ncache = 1\nid = 1\ndevice = {:?}\n",
            path_str(&fc.cache),
            path_str(&fc.core)
        ),
    )
    .unwrap();
    let control = dir2.path().join("control.sock");
    let log = dir2.path().join("daemon.log");
    let child = Command::new(common::BIN)
        .arg("daemon")
        .arg("--config")
        .arg(&cfg)
        .arg("--state-dir")
        .arg(dir2.path())
        .arg("--control")
        .arg(&control)
        .arg("--nbd-socket")
        .arg(dir2.path().join("nbd.sock"))
        .env_remove("HYBRIDCACHE_CONTROL")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn the second daemon");
    let mut p = Proc {
        child,
        fuse_dir: None,
    };
    // Either it gives up at once, or (where a device it cannot have is waited for) it keeps
    // running without the cache; in both cases its log names the claim.
    let text = || std::fs::read_to_string(&log).unwrap_or_default();
    eventually("the second daemon refuses or starts", || {
        matches!(p.child.try_wait(), Ok(Some(_))) || text().contains(" ready: ")
    });
    assert!(text().contains("claimed by another user"), "{}", text());
    if text().contains(" ready: ") {
        let out = Command::new(common::BIN)
            .args(["-L", "-o", "json", "--control"])
            .arg(&control)
            .output()
            .expect("list on the second daemon");
        let list = String::from_utf8_lossy(&out.stdout);
        assert!(!list.contains("\"Running\""), "{list}");
    }
    drop(p);
    // The first daemon still has its cache and core.
    let list = fc.daemon.ok(&["-L"]);
    assert!(
        list.contains("Running") && list.contains("cas1-1"),
        "{list}"
    );
}

//! A real file system on an exported volume: nbdfuse turns the export into a file, a loop device
//! turns that into a block device, and ext4 goes on top. Write a tree, unmount, fsck, mount
//! again and compare checksums; then once more after flushing the cache, switching modes,
//! stopping the daemon and loading the cache in a new one (`restart_point`).
//!
//! Skipped, with the reason printed, where nbdfuse, loop devices or mounting are not available
//! (containers without privileges); a failure instead in CI or with HC_REQUIRE_TOOLS=1
//! (`common::need`, `common::skip`).

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{file_cache, need, skip, Daemon, FileCache};

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

/// Undoes whatever was set up, in reverse, even when the test fails halfway.
#[derive(Default)]
struct Stack {
    fuse: Option<(Child, PathBuf)>,
    loopdev: Option<String>,
    mounted: Option<PathBuf>,
}

impl Stack {
    fn umount(&mut self) -> Result<(), String> {
        if let Some(m) = self.mounted.take() {
            sh("umount", &[m.to_str().unwrap_or_default()])?;
        }
        Ok(())
    }
}

impl Drop for Stack {
    fn drop(&mut self) {
        if let Some(m) = self.mounted.take() {
            let _ = sh("umount", &["-l", m.to_str().unwrap_or_default()]);
        }
        if let Some(l) = self.loopdev.take() {
            let _ = sh("losetup", &["-d", &l]);
        }
        if let Some((mut child, dir)) = self.fuse.take() {
            // A loop device just detached may hold the file a moment longer: retry the unmount.
            let deadline = Instant::now() + Duration::from_secs(5);
            while sh("fusermount3", &["-u", dir.to_str().unwrap_or_default()]).is_err()
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            let deadline = Instant::now() + Duration::from_secs(10);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Deterministic pseudo-random bytes.
fn content(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut v = Vec::with_capacity(len + 8);
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.extend_from_slice(&x.to_le_bytes());
    }
    v.truncate(len);
    v
}

fn checksum(data: &[u8]) -> u64 {
    // FNV-1a: enough to notice any corruption in a test.
    data.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

fn write_tree(root: &Path) -> BTreeMap<String, u64> {
    let mut sums = BTreeMap::new();
    for d in 0..8u64 {
        let dir = root.join(format!("dir{d}"));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        for f in 0..12u64 {
            let seed = d * 100 + f;
            // From a few bytes to 3 MiB, so small files, extents and indirect blocks all appear.
            let len = ((seed * 7919) % (3 << 20)) as usize + (f as usize) * 13;
            let data = content(seed, len);
            let rel = if f % 3 == 0 {
                format!("dir{d}/sub/f{f}")
            } else {
                format!("dir{d}/f{f}")
            };
            std::fs::write(root.join(&rel), &data).unwrap();
            sums.insert(rel, checksum(&data));
        }
    }
    sums
}

fn check_tree(root: &Path, sums: &BTreeMap<String, u64>) {
    for (rel, sum) in sums {
        let data = std::fs::read(root.join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"));
        assert_eq!(checksum(&data), *sum, "{rel} differs");
    }
}

/// nbdfuse turns an export into a file; a loop device turns that into a block device. None (with
/// the reason printed) where that is not permitted here.
fn attach(stack: &mut Stack, d: &Daemon, dir: &Path, export: &str) -> Option<String> {
    let fuse_dir = dir.join("fuse");
    std::fs::create_dir_all(&fuse_dir).unwrap();
    let pidfile = dir.join("nbdfuse.pid");
    let _ = std::fs::remove_file(&pidfile);
    let disk = fuse_dir.join("disk");
    let child = Command::new("nbdfuse")
        .arg("-P")
        .arg(&pidfile)
        .arg(&disk)
        .arg(d.uri(export))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn nbdfuse");
    stack.fuse = Some((child, fuse_dir.clone()));
    let deadline = Instant::now() + Duration::from_secs(20);
    while !pidfile.exists() {
        if let Some((c, _)) = stack.fuse.as_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                let mut err = String::new();
                if let Some(mut e) = c.stderr.take() {
                    use std::io::Read;
                    let _ = e.read_to_string(&mut err);
                }
                skip(&format!("nbdfuse exited ({status}): {err}"));
                stack.fuse = None;
                return None;
            }
        }
        assert!(Instant::now() < deadline, "nbdfuse did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    let disk_s = disk.to_str().unwrap();
    match sh("losetup", &["-f", "--show", "--direct-io=on", disk_s]) {
        Ok(l) => {
            stack.loopdev = Some(l.clone());
            Some(l)
        }
        Err(e) => {
            skip(&format!("loop devices are not permitted here: {e}"));
            None
        }
    }
}

#[test]
fn ext4_on_nbdfuse_loop_device() {
    if !need(&[
        "nbdfuse",
        "fusermount3",
        "losetup",
        "mkfs.ext4",
        "e2fsck",
        "mount",
        "umount",
    ]) {
        return;
    }
    let FileCache {
        dir,
        spec,
        daemon: mut d,
        ..
    } = file_cache(32 << 20, 256 << 20, &["-c", "wb"]);

    let mnt = dir.path().join("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let mut stack = Stack::default();
    let Some(loopdev) = attach(&mut stack, &d, dir.path(), "cas1-1") else {
        return;
    };
    sh("mkfs.ext4", &["-q", "-F", &loopdev]).expect("mkfs.ext4");
    let mnt_s = mnt.to_str().unwrap();
    if let Err(e) = sh("mount", &[&loopdev, mnt_s]) {
        skip(&format!("mounting is not permitted here: {e}"));
        return;
    }
    stack.mounted = Some(mnt.clone());
    let sums = write_tree(&mnt);
    stack.umount().expect("umount");
    sh("e2fsck", &["-fn", &loopdev]).expect("e2fsck after writing");

    // The data must not depend on staying in the cache.
    d.ok(&["-F", "-i", "1"]);
    d.ok(&["-Q", "-c", "wt", "-i", "1", "-f", "yes"]);

    // restart_point: take the stack down, stop the daemon (SIGTERM stops every cache cleanly),
    // start a new one, load the cache from its device and bring the stack up again.
    drop(std::mem::take(&mut stack));
    assert!(d.stop(), "clean shutdown: {}", d.log_text());
    let d = Daemon::start(dir.path());
    assert_eq!(
        d.ok(&["-S", "-d", &spec, "--load"]),
        "cache 1 loaded\n",
        "{}",
        d.log_text()
    );
    assert_eq!(d.param("cache-mode", 1, "Cache mode"), "wt");
    let loopdev = attach(&mut stack, &d, dir.path(), "cas1-1").expect("the same stack again");
    sh("e2fsck", &["-fn", &loopdev]).expect("e2fsck after the restart");

    sh("mount", &[&loopdev, mnt_s]).expect("mount again");
    stack.mounted = Some(mnt.clone());
    check_tree(&mnt, &sums);
    // Some changes in the new mode, then a final consistency check.
    std::fs::remove_dir_all(mnt.join("dir3")).unwrap();
    std::fs::write(mnt.join("late"), content(7, 1 << 20)).unwrap();
    stack.umount().expect("umount");
    sh("e2fsck", &["-fn", &loopdev]).expect("e2fsck after the mode switch");
    let stats: serde_json::Value =
        serde_json::from_str(&d.ok(&["-P", "-i", "1", "-o", "json"])).unwrap();
    assert_eq!(stats["errors"]["total_errors"]["count"], 0, "{stats}");
    drop(stack);
}

//! What `write_together` saves (a mirrored cache's dirty write goes to two devices): 4 KiB
//! random writes to two files on one machine's disk, O_DIRECT on io_uring, made three ways:
//! to one file alone, to both one after the other (`write_at` twice, as the mirror did), and to
//! both in one submission (`write_together`). Then a file and a device with no direct path (a
//! mirror on another host, reached over NBD: here a volume whose write takes `--remote-us`
//! µs, 200 by default, sleeping as a thread waiting for the network does), one after the other
//! and with `write_together` (the remote write made while the file's is in flight). The ways
//! alternate in blocks of 32 writes for the whole run, so a neighbour's load falls on all
//! alike; each way's latency is the median over its blocks of the mean write time in the block.
//!
//! `cargo bench -p hybridcache-volume --bench together [-- --seconds S --dir D --remote-us N]`
//! (default 10 s, /var/tmp, 200). Not a timed test: figures depend on the disk and the machine.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hybridcache_volume::{write_together, FileVolume, SplitMix64, Volume};

/// A device on another host: each write takes `us` µs of waiting, and has no direct path.
struct Remote {
    us: u64,
}

impl Volume for Remote {
    fn name(&self) -> &str {
        "remote"
    }
    fn size(&self) -> u64 {
        FILE
    }
    fn read_at(&self, _buf: &mut [u8], _offset: u64) -> hybridcache_volume::Result<()> {
        Ok(())
    }
    fn write_at(&self, _buf: &[u8], _offset: u64) -> hybridcache_volume::Result<()> {
        std::thread::sleep(Duration::from_micros(self.us));
        Ok(())
    }
    fn flush(&self) -> hybridcache_volume::Result<()> {
        Ok(())
    }
    fn discard(&self, _offset: u64, _len: u64) -> hybridcache_volume::Result<()> {
        Ok(())
    }
}

const FILE: u64 = 256 << 20;
const BLOCK: usize = 32;

fn file(dir: &Path, name: &str) -> Arc<FileVolume> {
    let path = dir.join(format!("hc-together-{}-{name}", std::process::id()));
    // Written whole once: no write below pays the file system's first allocation of a block.
    std::fs::write(&path, vec![0u8; FILE as usize]).expect("write the file");
    let v = FileVolume::open(&path).expect("open the file");
    let _ = std::fs::remove_file(&path);
    Arc::new(v)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let (mut seconds, mut dir, mut remote_us) = (10.0, PathBuf::from("/var/tmp"), 200);
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--seconds" => {
                seconds = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--seconds takes a number")
            }
            "--dir" => dir = PathBuf::from(args.next().expect("--dir takes a directory")),
            "--remote-us" => {
                remote_us = args
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("--remote-us takes a number")
            }
            _ => {}
        }
    }
    let (a, b) = (file(&dir, "a"), file(&dir, "b"));
    let remote = Remote { us: remote_us };
    if a.direct_write(4096, 0).is_none() {
        eprintln!(
            "no direct io_uring path on {}: nothing to compare",
            dir.display()
        );
        return;
    }
    let mut room = vec![7u8; 8192];
    let start = room.as_ptr().align_offset(4096);
    let buf = &mut room[start..start + 4096];
    let mut rng = SplitMix64(1);
    let mut at = || rng.next_u64() % (FILE / 4096) * 4096;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let mut times: [Vec<f64>; 5] = Default::default();
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < end {
        for (way, samples) in times.iter_mut().enumerate() {
            let t = Instant::now();
            for _ in 0..BLOCK {
                let off = at();
                buf[0] = buf[0].wrapping_add(1);
                match way {
                    0 => a.write_at(buf, off).expect("write"),
                    1 => {
                        a.write_at(buf, off).expect("write");
                        b.write_at(buf, off).expect("write");
                    }
                    2 => {
                        for r in write_together(&[(&*a, &*buf, off), (&*b, &*buf, off)]) {
                            r.expect("write");
                        }
                    }
                    3 => {
                        a.write_at(buf, off).expect("write");
                        remote.write_at(buf, off).expect("write");
                    }
                    _ => {
                        for r in write_together(&[(&*a, &*buf, off), (&remote, &*buf, off)]) {
                            r.expect("write");
                        }
                    }
                }
            }
            samples.push(t.elapsed().as_secs_f64() * 1e6 / BLOCK as f64);
        }
    }
    let blocks = times[0].len();
    let [o, s, t, rs, rt] = times.map(median);
    println!(
        "{} blocks of {BLOCK} writes each way, {seconds} s, {}; load average before: {}",
        blocks,
        dir.display(),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!();
    println!("| 4 KiB random write | µs per write (median of blocks) | against one device |");
    println!("|---|---|---|");
    println!("| one device | {o:.1} | 1.00 |");
    println!(
        "| two devices, one after the other | {s:.1} | {:.2} |",
        s / o
    );
    println!("| two devices, write_together | {t:.1} | {:.2} |", t / o);
    println!(
        "| a file and a remote device ({remote_us} µs), one after the other | {rs:.1} | {:.2} |",
        rs / o
    );
    println!(
        "| a file and a remote device ({remote_us} µs), write_together | {rt:.1} | {:.2} |",
        rt / o
    );
}

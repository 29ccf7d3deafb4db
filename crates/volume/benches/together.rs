//! What `write_together` saves (a mirrored cache's dirty write goes to two devices): 4 KiB
//! random writes to two files on one machine's disk, O_DIRECT on io_uring, made three ways:
//! to one file alone, to both one after the other (`write_at` twice, as the mirror did), and to
//! both in one submission (`write_together`). The three alternate in blocks of 32 writes for
//! the whole run, so a neighbour's load falls on all three alike; each way's latency is the
//! median over its blocks of the mean write time in the block.
//!
//! `cargo bench -p hybridcache-volume --bench together [-- --seconds S --dir D]` (default 10 s,
//! /var/tmp). Not a timed test: figures depend on the disk and the machine.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hybridcache_volume::{write_together, FileVolume, SplitMix64, Volume};

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
    let (mut seconds, mut dir) = (10.0, PathBuf::from("/var/tmp"));
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
            _ => {}
        }
    }
    let (a, b) = (file(&dir, "a"), file(&dir, "b"));
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
    let (mut one, mut serial, mut together) = (Vec::new(), Vec::new(), Vec::new());
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < end {
        for way in 0..3 {
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
                    _ => {
                        for r in write_together(&[(&*a, &*buf, off), (&*b, &*buf, off)]) {
                            r.expect("write");
                        }
                    }
                }
            }
            let us = t.elapsed().as_secs_f64() * 1e6 / BLOCK as f64;
            [&mut one, &mut serial, &mut together][way].push(us);
        }
    }
    let blocks = together.len();
    let (o, s, t) = (median(one), median(serial), median(together));
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
}

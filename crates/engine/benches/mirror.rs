//! What the mirror costs (issue 34): write-back without a mirror, with the mirror (dirty data
//! and metadata on both devices, clean data on the primary only), and an md-style full RAID1 of
//! the cache device (every write on both, the same code writing them one after the other), on
//! a RAM cache and on an emulated SATA SSD cache, in front of a RAM core.
//!
//! `cargo bench -p hybridcache-engine --bench mirror [-- --seconds S]` prints MiB/s per cell
//! and each layout's ratio to no mirror. Not a timed test: numbers depend on the machine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hybridcache_engine::{Cache, CacheConfig, CacheMode, LineSize, MirrorLostPolicy};
use hybridcache_volume::{open_volume, ReadPiece, Volume, VolumeRef};

const CACHE: u64 = 512 << 20;
const CORE: u64 = 2 << 30;

/// md RAID1 as the cache device: every write and flush on both, reads from the first.
struct FullMirror(VolumeRef, VolumeRef);

impl Volume for FullMirror {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> hybridcache_volume::Result<()> {
        self.0.read_at(buf, offset)
    }
    fn read_batch(&self, pieces: &mut [ReadPiece<'_>]) -> hybridcache_volume::Result<()> {
        self.0.read_batch(pieces)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> hybridcache_volume::Result<()> {
        self.0.write_at(buf, offset)?;
        self.1.write_at(buf, offset)
    }
    fn flush(&self) -> hybridcache_volume::Result<()> {
        self.0.flush()?;
        self.1.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        self.0.discard(offset, len)?;
        self.1.discard(offset, len)
    }
}

#[derive(Clone, Copy, PartialEq)]
enum Layout {
    Single,
    Mirror,
    Raid1,
}

#[derive(Clone, Copy)]
enum Load {
    RandWrite4k,
    SeqWrite64k,
    /// 70 % reads, 30 % writes, 4 KiB, over a range the cache holds (read-heavy: hits).
    Mix7030,
}

fn device(kind: &str) -> VolumeRef {
    let spec = match kind {
        "ram" => format!("ram:{CACHE}"),
        _ => format!("ssd:size={CACHE}"),
    };
    open_volume(&spec).expect("cache device")
}

fn run(kind: &str, layout: Layout, load: Load, seconds: f64) -> f64 {
    let config = CacheConfig {
        id: 1,
        line_size: LineSize::from_kib(4).expect("4 KiB lines"),
        mode: CacheMode::Wb,
    };
    let cache = match layout {
        Layout::Single => Cache::create(device(kind), config, true),
        Layout::Mirror => Cache::create_mirrored(
            device(kind),
            device(kind),
            config,
            true,
            MirrorLostPolicy::Drain,
        ),
        Layout::Raid1 => Cache::create(
            Arc::new(FullMirror(device(kind), device(kind))) as VolumeRef,
            config,
            true,
        ),
    }
    .expect("create the cache");
    let core_volume = open_volume(&format!("ram:{CORE}")).expect("core");
    let id = cache.add_core(core_volume, None).expect("add core");
    let core = cache.core(id).expect("core");
    // The working set fits in the cache: the cost measured is the cache device's, not cleaning's.
    let span = CACHE / 2;
    let mut rng = hybridcache_volume::SplitMix64(7);
    // Reads hit: fill the range once (clean lines, as read fills leave them).
    let mut buf = vec![0u8; 64 << 10];
    if matches!(load, Load::Mix7030) {
        let mut at = 0;
        while at < span {
            core.read(&mut buf, at).expect("fill");
            at += buf.len() as u64;
        }
    }
    let deadline = Instant::now() + Duration::from_secs_f64(seconds);
    let started = Instant::now();
    let (mut bytes, mut seq, mut ops) = (0u64, 0u64, 0u64);
    while Instant::now() < deadline {
        for _ in 0..64 {
            match load {
                Load::RandWrite4k => {
                    let at = rng.below(span / 4096) * 4096;
                    core.write(&buf[..4096], at).expect("write");
                    bytes += 4096;
                }
                Load::SeqWrite64k => {
                    core.write(&buf, seq).expect("write");
                    seq = (seq + buf.len() as u64) % span;
                    bytes += buf.len() as u64;
                }
                Load::Mix7030 => {
                    let at = rng.below(span / 4096) * 4096;
                    if rng.below(10) < 7 {
                        core.read(&mut buf[..4096], at).expect("read");
                    } else {
                        core.write(&buf[..4096], at).expect("write");
                    }
                    bytes += 4096;
                }
            }
            ops += 1;
            if ops % 1024 == 0 {
                core.flush().expect("flush");
            }
        }
    }
    let mib_s = bytes as f64 / (1 << 20) as f64 / started.elapsed().as_secs_f64();
    drop(core);
    cache.stop(false).expect("stop");
    mib_s
}

fn main() {
    let mut seconds = 3.0;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--seconds" {
            seconds = args
                .next()
                .and_then(|v| v.parse().ok())
                .expect("--seconds takes a number");
        }
    }
    println!("| cache device | workload | no mirror MiB/s | mirror MiB/s (ratio) | full RAID1 MiB/s (ratio) |");
    println!("|---|---|---|---|---|");
    for kind in ["ram", "ssd"] {
        for (name, load) in [
            ("random write 4 KiB", Load::RandWrite4k),
            ("sequential write 64 KiB", Load::SeqWrite64k),
            ("70/30 read/write 4 KiB", Load::Mix7030),
        ] {
            let single = run(kind, Layout::Single, load, seconds);
            let mirror = run(kind, Layout::Mirror, load, seconds);
            let raid1 = run(kind, Layout::Raid1, load, seconds);
            println!(
                "| {kind} | {name} | {single:.0} | {mirror:.0} ({:.2}) | {raid1:.0} ({:.2}) |",
                mirror / single,
                raid1 / single
            );
        }
    }
}

//! What the mirror costs (issue 34): write-back without a mirror, with the mirror (dirty data
//! and metadata on both devices, clean data on the primary only), and an md-style full RAID1 of
//! the cache device (every write on both at once where the devices allow it, as md submits
//! both), on a RAM cache, an emulated SATA SSD cache and files on this machine's disk
//! (`--dir`, default /var/tmp: O_DIRECT on io_uring, where a dirty write goes to both devices
//! in one submission), in front of a RAM core.
//!
//! `cargo bench -p hybridcache-engine --bench mirror [-- --seconds S --reps N --dir D]` prints MiB/s per
//! cell (medians of N interleaved repetitions), each layout's ratio to no mirror, and the device
//! operations per request that explain it. Not a timed test: numbers depend on the machine.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use hybridcache_engine::{Cache, CacheConfig, CacheMode, LineSize, MirrorLostPolicy};
use hybridcache_volume::{
    open_volume, write_together, DirectWrite, FileVolume, ReadPiece, Volume, VolumeRef,
};

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
        let r = write_together(&[(&*self.0, buf, offset), (&*self.1, buf, offset)]);
        r.into_iter().collect()
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

/// What the cache asked of one device: calls and bytes, to explain a cell's cost by the device
/// operations each request needs in each layout (the 70/30 cells are read-heavy, so the mirror
/// should cost less than a full RAID1 there; these counts say where the time goes).
#[derive(Default)]
struct Counts {
    reads: AtomicU64,
    read_bytes: AtomicU64,
    writes: AtomicU64,
    write_bytes: AtomicU64,
    flushes: AtomicU64,
}

struct Counted(VolumeRef, Arc<Counts>);

impl Volume for Counted {
    fn name(&self) -> &str {
        self.0.name()
    }
    fn size(&self) -> u64 {
        self.0.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> hybridcache_volume::Result<()> {
        self.1.reads.fetch_add(1, Relaxed);
        self.1.read_bytes.fetch_add(buf.len() as u64, Relaxed);
        self.0.read_at(buf, offset)
    }
    fn read_batch(&self, pieces: &mut [ReadPiece<'_>]) -> hybridcache_volume::Result<()> {
        self.1.reads.fetch_add(pieces.len() as u64, Relaxed);
        let bytes: usize = pieces.iter().map(|p| p.buf.len()).sum();
        self.1.read_bytes.fetch_add(bytes as u64, Relaxed);
        self.0.read_batch(pieces)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> hybridcache_volume::Result<()> {
        self.1.writes.fetch_add(1, Relaxed);
        self.1.write_bytes.fetch_add(buf.len() as u64, Relaxed);
        self.0.write_at(buf, offset)
    }
    fn flush(&self) -> hybridcache_volume::Result<()> {
        self.1.flushes.fetch_add(1, Relaxed);
        self.0.flush()
    }
    /// Counted here: `write_together` makes a direct write without calling `write_at`.
    fn direct_write(&self, len: usize, offset: u64) -> Option<DirectWrite> {
        let d = self.0.direct_write(len, offset)?;
        self.1.writes.fetch_add(1, Relaxed);
        self.1.write_bytes.fetch_add(len as u64, Relaxed);
        Some(d)
    }
    fn discard(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        self.0.discard(offset, len)
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
    /// Random 4 KiB reads over a range twice the cache: most miss and fill a line, which is
    /// where the mirror differs from a full RAID1 (a fill is clean: the primary alone).
    ReadMiss4k,
    /// 70 % reads, 30 % writes, 4 KiB, over a range twice the cache (read-heavy, with fills).
    Mix7030Miss,
}

fn device(kind: &str, counts: &Arc<Counts>, dir: &std::path::Path) -> VolumeRef {
    let volume: VolumeRef = match kind {
        "ram" => open_volume(&format!("ram:{CACHE}")).expect("cache device"),
        "file" => {
            // A new file per cell, written once whole so that no cell pays the file system's
            // first allocation of its blocks.
            static NEXT: AtomicU64 = AtomicU64::new(0);
            let path = dir.join(format!(
                "hc-mirror-bench-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Relaxed)
            ));
            std::fs::write(&path, vec![0u8; CACHE as usize]).expect("cache file");
            let v = FileVolume::open(&path).expect("open the cache file");
            // Unlinked now: the open descriptor keeps it until the cell ends.
            let _ = std::fs::remove_file(&path);
            Arc::new(v)
        }
        _ => open_volume(&format!("ssd:size={CACHE}")).expect("cache device"),
    };
    if kind == "ram" {
        // Fault the memory in before the cell: a RAM device's first write to a page costs the
        // kernel's zeroing of it, which would land in whichever layout ran first after the
        // allocator gave memory back (a profile showed 3.6-11% of a cell in clear_page).
        let zeroes = vec![0u8; 1 << 20];
        let mut at = 0;
        while at < volume.size() {
            let n = (volume.size() - at).min(zeroes.len() as u64) as usize;
            volume
                .write_at(&zeroes[..n], at)
                .expect("touch the RAM device");
            at += n as u64;
        }
    }
    Arc::new(Counted(volume, counts.clone()))
}

/// One cell: MiB/s, and per request what the first and the second device were asked (only
/// during the timed part).
struct Cell {
    mib_s: f64,
    first: [f64; 5],
    second: [f64; 5],
}

fn per_request(c: &Counts, before: [u64; 5], ops: u64) -> [f64; 5] {
    let now = snapshot(c);
    let mut v = [0.0; 5];
    for i in 0..5 {
        v[i] = (now[i] - before[i]) as f64 / ops.max(1) as f64;
    }
    v
}

fn snapshot(c: &Counts) -> [u64; 5] {
    [
        c.reads.load(Relaxed),
        c.read_bytes.load(Relaxed),
        c.writes.load(Relaxed),
        c.write_bytes.load(Relaxed),
        c.flushes.load(Relaxed),
    ]
}

fn run(kind: &str, layout: Layout, load: Load, seconds: f64, dir: &std::path::Path) -> Cell {
    let (first, second) = (Arc::new(Counts::default()), Arc::new(Counts::default()));
    let config = CacheConfig {
        id: 1,
        line_size: LineSize::from_kib(4).expect("4 KiB lines"),
        mode: CacheMode::Wb,
    };
    let cache = match layout {
        Layout::Single => Cache::create(device(kind, &first, dir), config, true),
        Layout::Mirror => Cache::create_mirrored(
            device(kind, &first, dir),
            device(kind, &second, dir),
            config,
            true,
            MirrorLostPolicy::Drain,
        ),
        Layout::Raid1 => Cache::create(
            Arc::new(FullMirror(
                device(kind, &first, dir),
                device(kind, &second, dir),
            )) as VolumeRef,
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
    let (first_before, second_before) = (snapshot(&first), snapshot(&second));
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
                Load::ReadMiss4k => {
                    let at = rng.below(2 * CACHE / 4096) * 4096;
                    core.read(&mut buf[..4096], at).expect("read");
                    bytes += 4096;
                }
                Load::Mix7030 | Load::Mix7030Miss => {
                    let range = if matches!(load, Load::Mix7030) {
                        span
                    } else {
                        2 * CACHE
                    };
                    let at = rng.below(range / 4096) * 4096;
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
    let cell = Cell {
        mib_s,
        first: per_request(&first, first_before, ops),
        second: per_request(&second, second_before, ops),
    };
    drop(core);
    cache.stop(false).expect("stop");
    cell
}

/// "reads/KiB, writes/KiB, flushes" per request on one device.
fn ops_text(v: [f64; 5]) -> String {
    format!(
        "{:.2} r {:.1} KiB, {:.2} w {:.1} KiB, {:.3} f",
        v[0],
        v[1] / 1024.0,
        v[2],
        v[3] / 1024.0,
        v[4]
    )
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

fn main() {
    let (mut seconds, mut reps) = (3.0, 3usize);
    // `--only TEXT`: the cells whose device or workload name contains TEXT (for a profile).
    let mut only = String::new();
    let mut dir = std::path::PathBuf::from("/var/tmp");
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--seconds" {
            seconds = args
                .next()
                .and_then(|v| v.parse().ok())
                .expect("--seconds takes a number");
        }
        if a == "--dir" {
            dir = std::path::PathBuf::from(args.next().expect("--dir takes a directory"));
        }
        if a == "--only" {
            only = args.next().expect("--only takes a text");
        }
        if a == "--reps" {
            reps = args
                .next()
                .and_then(|v| v.parse().ok())
                .filter(|&r: &usize| r > 0)
                .expect("--reps takes a positive number");
        }
    }
    println!(
        "{reps} interleaved repetitions of {seconds} s per cell, medians; load average before: {}",
        load_average()
    );
    println!();
    println!("| cache device | workload | no mirror MiB/s | mirror MiB/s (ratio) | full RAID1 MiB/s (ratio) |");
    println!("|---|---|---|---|---|");
    let mut ops = Vec::new();
    for kind in ["ram", "ssd", "file"] {
        for (name, load) in [
            ("random write 4 KiB", Load::RandWrite4k),
            ("sequential write 64 KiB", Load::SeqWrite64k),
            ("70/30 read/write 4 KiB, hits", Load::Mix7030),
            ("random read 4 KiB, misses", Load::ReadMiss4k),
            ("70/30 read/write 4 KiB, 2x the cache", Load::Mix7030Miss),
        ] {
            if !format!("{kind} {name}").contains(&only) {
                continue;
            }
            let (mut s, mut m, mut r) = (Vec::new(), Vec::new(), Vec::new());
            let (mut single, mut mirror, mut raid1) = (None, None, None);
            for _ in 0..reps {
                let cells = (
                    run(kind, Layout::Single, load, seconds, &dir),
                    run(kind, Layout::Mirror, load, seconds, &dir),
                    run(kind, Layout::Raid1, load, seconds, &dir),
                );
                s.push(cells.0.mib_s);
                m.push(cells.1.mib_s);
                r.push(cells.2.mib_s);
                (single, mirror, raid1) = (Some(cells.0), Some(cells.1), Some(cells.2));
            }
            let (Some(single), Some(mirror), Some(raid1)) = (single, mirror, raid1) else {
                continue;
            };
            let (ms, mm, mr) = (median(s), median(m), median(r));
            println!(
                "| {kind} | {name} | {ms:.0} | {mm:.0} ({:.2}) | {mr:.0} ({:.2}) |",
                mm / ms,
                mr / ms
            );
            for (layout, cell) in [
                ("no mirror", &single),
                ("mirror", &mirror),
                ("full RAID1", &raid1),
            ] {
                ops.push(format!(
                    "| {kind} | {name} | {layout} | {} | {} |",
                    ops_text(cell.first),
                    ops_text(cell.second)
                ));
            }
        }
    }
    println!();
    println!("Device operations per request in the last repetition (r: reads, w: writes, f: flushes; the second device is the mirror):");
    println!();
    println!("| cache device | workload | layout | first device | second device |");
    println!("|---|---|---|---|---|");
    for line in ops {
        println!("{line}");
    }
}

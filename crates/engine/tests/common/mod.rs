//! Helpers shared by the engine's integration tests: building caches on RAM volumes, a
//! self-describing data pattern, and a watchdog that turns a hang into a visible failure.
//!
//! Every test binary includes this module but uses only part of it.
#![allow(dead_code)]

pub mod recording;

use std::fmt;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use hybridcache_engine::{Cache, CacheConfig, CacheMode, Core, CoreId, LineSize};
use hybridcache_volume::{RamVolume, Volume, VolumeRef};

pub const SECTOR: u64 = 512;
const SECTOR_USIZE: usize = 512;

/// Magic at the start of every stamped sector, so stamps are told apart from zeroes and garbage.
const MAGIC: &[u8; 4] = b"HCtS";

/// A RAM volume we keep our own handle to, so tests can look at the device behind the engine.
pub fn ram(name: &str, size: u64) -> Arc<RamVolume> {
    Arc::new(RamVolume::new(name, size).expect("create RAM volume"))
}

pub fn as_ref(vol: &Arc<RamVolume>) -> VolumeRef {
    vol.clone() as VolumeRef
}

/// A cache of `lines` lines of `line_kib` KiB in `mode`, on its own RAM volume.
pub fn new_cache(line_kib: u32, lines: u64, mode: CacheMode) -> (Cache, Arc<RamVolume>) {
    let line = LineSize::from_kib(line_kib).expect("valid line size");
    let vol = ram("ram:cache", lines * line.bytes() as u64);
    let config = CacheConfig {
        id: 1,
        line_size: line,
        mode,
    };
    let cache = Cache::new(as_ref(&vol), config).expect("create cache");
    (cache, vol)
}

/// An attached core: the exported volume plus our own handle to the core device.
pub struct TestCore {
    pub id: CoreId,
    pub core: Core,
    pub vol: Arc<RamVolume>,
}

pub fn add_core(cache: &Cache, size: u64) -> TestCore {
    add_core_vol(cache, ram("ram:core", size))
}

pub fn add_core_vol(cache: &Cache, vol: Arc<RamVolume>) -> TestCore {
    let id = cache.add_core(as_ref(&vol), None).expect("add core");
    let core = cache.core(id).expect("core handle");
    TestCore { id, core, vol }
}

/// Read `len` bytes at `offset` straight from a device, bypassing the engine.
pub fn read_vol(vol: &dyn Volume, offset: u64, len: u64) -> Vec<u8> {
    let mut buf = vec![0u8; len as usize];
    vol.read_at(&mut buf, offset).expect("direct device read");
    buf
}

/// The whole content of a device, bypassing the engine.
pub fn read_all(vol: &Arc<RamVolume>) -> Vec<u8> {
    read_vol(&**vol, 0, vol.size())
}

/// Read through the engine in pieces the engine accepts (at most 32 MiB each).
pub fn read_core_all(core: &Core) -> Vec<u8> {
    let size = core.size();
    let mut out = vec![0u8; size as usize];
    let chunk = 8usize << 20;
    for (i, piece) in out.chunks_mut(chunk).enumerate() {
        core.read(piece, (i * chunk) as u64)
            .expect("read through the engine");
    }
    out
}

fn splitmix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = x;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Stamp one 512-byte sector with `tag` (who wrote it) and `sector` (where it belongs): a magic,
/// both numbers, then filler derived from them. Any torn, shifted or misplaced sector decodes as
/// something else, and a correct one says exactly which write produced it.
pub fn stamp_sector(out: &mut [u8], tag: u64, sector: u64) {
    debug_assert_eq!(out.len(), SECTOR_USIZE);
    out[0..4].copy_from_slice(MAGIC);
    out[4..12].copy_from_slice(&tag.to_le_bytes());
    out[12..20].copy_from_slice(&sector.to_le_bytes());
    let mut x = tag.rotate_left(17) ^ sector.wrapping_mul(0x2545_F491_4F6C_DD1D);
    for c in out[20..].chunks_mut(8) {
        x = splitmix(x);
        c.copy_from_slice(&x.to_le_bytes()[..c.len()]);
    }
}

/// Stamp every sector of `buf`, which starts at sector `first_sector`.
pub fn stamp(buf: &mut [u8], tag: u64, first_sector: u64) {
    for (i, s) in buf.chunks_exact_mut(SECTOR_USIZE).enumerate() {
        stamp_sector(s, tag, first_sector + i as u64);
    }
}

pub fn stamped(len: u64, tag: u64, first_sector: u64) -> Vec<u8> {
    let mut v = vec![0u8; len as usize];
    stamp(&mut v, tag, first_sector);
    v
}

/// What a sector holds, decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Content {
    Zero,
    Stamp { tag: u64, sector: u64 },
    Garbage([u8; 16]),
}

pub fn decode(s: &[u8]) -> Content {
    if s.iter().all(|&b| b == 0) {
        return Content::Zero;
    }
    if &s[0..4] == MAGIC {
        let tag = u64::from_le_bytes(s[4..12].try_into().unwrap());
        let sector = u64::from_le_bytes(s[12..20].try_into().unwrap());
        let mut want = [0u8; SECTOR_USIZE];
        stamp_sector(&mut want, tag, sector);
        if want[..] == s[..] {
            return Content::Stamp { tag, sector };
        }
    }
    Content::Garbage(s[0..16].try_into().unwrap())
}

impl fmt::Display for Content {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Content::Zero => write!(f, "zeroes"),
            Content::Stamp { tag, sector } => {
                write!(
                    f,
                    "stamp(tag {:#x} = {}:{}, sector {sector})",
                    tag,
                    tag >> 32,
                    tag & 0xffff_ffff
                )
            }
            Content::Garbage(head) => write!(f, "garbage (first bytes {head:02x?})"),
        }
    }
}

/// First sector where `actual` differs from `expected` (both start at sector `first_sector`),
/// described for a failure message; None when they are equal.
pub fn first_difference(expected: &[u8], actual: &[u8], first_sector: u64) -> Option<String> {
    if expected == actual {
        return None;
    }
    let sectors = expected.len() / SECTOR_USIZE;
    let mut bad = 0;
    let mut first = None;
    for i in 0..sectors {
        let range = i * SECTOR_USIZE..(i + 1) * SECTOR_USIZE;
        if expected[range.clone()] != actual[range.clone()] {
            bad += 1;
            if first.is_none() {
                first = Some((i, decode(&expected[range.clone()]), decode(&actual[range])));
            }
        }
    }
    let (i, want, got) = first.expect("buffers differ, so some sector does");
    Some(format!(
        "first differing sector {} (byte offset {}, index {i} of {sectors} in the request, {bad} sectors differ): expected {want}, got {got}",
        first_sector + i as u64,
        (first_sector + i as u64) * SECTOR,
    ))
}

/// Aborts the process when dropped too late: a deadlocked engine would otherwise hang the test
/// run with no message at all.
pub struct Watchdog {
    done: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Watchdog {
    pub fn new(what: &str, limit: Duration) -> Watchdog {
        let (tx, rx) = mpsc::channel::<()>();
        let what = what.to_string();
        let thread = std::thread::spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
                eprintln!(
                    "WATCHDOG: '{what}' did not finish within {limit:?}: probable deadlock or livelock in the engine; aborting"
                );
                std::process::abort();
            }
        });
        Watchdog {
            done: Some(tx),
            thread: Some(thread),
        }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        drop(self.done.take());
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Deterministic seed for randomness outside proptest: `HC_TEST_SEED` overrides it, and tests
/// print the one they use so a failure can be replayed.
pub fn seed(default: u64) -> u64 {
    std::env::var("HC_TEST_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

//! What the durability tests share: sector stamps that name their write and their sector, and
//! the model of what each sector may hold after a crash.
#![allow(dead_code)]

/// The workspace's deterministic generator; seeds printed on failure replay a run. (Not every
/// test binary that includes this module draws random numbers.)
#[allow(unused_imports)]
pub use hybridcache_volume::SplitMix64 as Rng;

pub const SECTOR: usize = 512;

/// Sector content for write `stamp` at sector `sector`: identifies both, so a sector holding
/// another address's data or a torn mix is caught. Stamp 0 is all zeroes (never written).
pub fn fill(buf: &mut [u8], stamp: u32, first_sector: u64) {
    for (i, s) in buf.chunks_mut(SECTOR).enumerate() {
        if stamp == 0 {
            s.fill(0);
            continue;
        }
        let tag = [
            stamp.to_le_bytes(),
            ((first_sector + i as u64) as u32).to_le_bytes(),
        ]
        .concat();
        for c in s.chunks_mut(8) {
            c.copy_from_slice(&tag);
        }
    }
}

/// What a sector read back as: Some(stamp) if it is a well-formed sector of that stamp for this
/// sector (0 for zeroes), None for anything else.
pub fn decode(s: &[u8], sector: u64) -> Option<u32> {
    if s.iter().all(|&b| b == 0) {
        return Some(0);
    }
    let stamp = u32::from_le_bytes(s[0..4].try_into().unwrap());
    let mut expect = vec![0u8; SECTOR];
    fill(&mut expect, stamp, sector);
    (s == &expect[..]).then_some(stamp)
}

/// Per sector: content as of the last completed flush, and what was written since.
pub struct Model {
    pub durable: Vec<u32>,
    pub latest: Vec<u32>,
    pub since: Vec<Vec<u32>>,
}

impl Model {
    pub fn new(sectors: usize) -> Model {
        Model {
            durable: vec![0; sectors],
            latest: vec![0; sectors],
            since: vec![Vec::new(); sectors],
        }
    }
    pub fn write(&mut self, first: u64, count: u64, stamp: u32) {
        for s in first..first + count {
            self.latest[s as usize] = stamp;
            self.since[s as usize].push(stamp);
        }
    }
    pub fn flushed(&mut self) {
        self.durable.clone_from(&self.latest);
        for s in &mut self.since {
            s.clear();
        }
    }
    pub fn allowed(&self, sector: usize, stamp: u32) -> bool {
        self.durable[sector] == stamp || self.since[sector].contains(&stamp)
    }
    /// Panic, naming `context`, at the first sector of `buf` (the whole core, read back) that
    /// holds neither its durable content nor anything written to it since.
    pub fn check(&self, buf: &[u8], context: &str) {
        for (i, s) in buf.chunks(SECTOR).enumerate() {
            let got = decode(s, i as u64);
            match got {
                Some(stamp) if self.allowed(i, stamp) => {}
                _ => panic!(
                    "{context}: sector {i} holds {got:?}; allowed: durable {} or written since {:?}",
                    self.durable[i], self.since[i]
                ),
            }
        }
    }
}

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;

use hybridcache_volume::{CrashVolume, Volume};

/// A device that dies when the shared operation budget runs out: once it is spent, writes,
/// flushes and discards are silently dropped, as a power cut would (the crash and corruption
/// tests share it).
pub struct Mortal {
    pub inner: Arc<CrashVolume>,
    pub budget: Arc<AtomicI64>,
}

impl Mortal {
    pub fn alive(&self) -> bool {
        self.budget.fetch_sub(1, Ordering::SeqCst) > 0
    }
}

/// Cut the power of every device sharing `budget`: from now on nothing they are asked to write
/// or flush reaches them. Call it before dropping the cache and before `CrashVolume::crash`: a
/// dropped cache's cleaner may still be finishing a run (it holds the cache while it runs), and
/// a power cut stops it too. Without this, that run's commit could reach the cache device
/// after the core device's crash had dropped the data the commit records as clean.
pub fn power_cut(budget: &AtomicI64) {
    budget.store(i64::MIN / 2, Ordering::SeqCst);
}

impl Volume for Mortal {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> hybridcache_volume::Result<()> {
        self.inner.read_at(buf, offset)
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> hybridcache_volume::Result<()> {
        if self.alive() {
            self.inner.write_at(buf, offset)
        } else {
            Ok(())
        }
    }
    fn flush(&self) -> hybridcache_volume::Result<()> {
        if self.alive() {
            self.inner.flush()
        } else {
            Ok(())
        }
    }
    fn discard(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        if self.alive() {
            self.inner.discard(offset, len)
        } else {
            Ok(())
        }
    }
    fn discard_zeroes(&self) -> bool {
        true
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
        if self.alive() {
            self.inner.write_zeroes(offset, len)
        } else {
            Ok(())
        }
    }
}

/// A device that fails every read, write and flush (a dead cache device).
pub fn fail_everything() -> hybridcache_volume::FaultConfig {
    hybridcache_volume::FaultConfig {
        fail_reads_in: Some(0..u64::MAX),
        fail_writes_in: Some(0..u64::MAX),
        fail_flushes: true,
        ..hybridcache_volume::FaultConfig::default()
    }
}

/// A random write (or, one time in eight, a flush) through `core` within its first
/// `core_bytes`, recorded in `model` under its lock so the model's order is the cache's.
pub fn random_op(
    core: &hybridcache_engine::Core,
    model: &parking_lot::Mutex<Vec<u8>>,
    rng: &mut Rng,
    stamp: u32,
    core_bytes: u64,
) {
    let sectors = core_bytes / 512;
    if rng.below(8) == 0 {
        core.flush().unwrap_or_else(|e| panic!("flush: {e}"));
        return;
    }
    let first = rng.below(sectors - 64);
    let count = 1 + rng.below(63);
    let mut buf = vec![0u8; (count * 512) as usize];
    fill(&mut buf, stamp, first);
    let mut m = model.lock();
    core.write(&buf, first * 512)
        .unwrap_or_else(|e| panic!("write at sector {first}: {e}"));
    m[(first * 512) as usize..(first * 512) as usize + buf.len()].copy_from_slice(&buf);
}

/// Every sector of `buf` (read from sector 0 on) as `model` says, or which one is not.
pub fn check(buf: &[u8], model: &[u8], when: &str) {
    for (i, (s, want)) in buf.chunks(SECTOR).zip(model.chunks(SECTOR)).enumerate() {
        assert!(
            s == want,
            "{when}: sector {i} holds {:?}, the model {:?}",
            decode(s, i as u64),
            decode(want, i as u64)
        );
    }
}

/// `work` (an attach or a rebuild) while another thread makes 300 random writes and flushes
/// through `core` (`random_op`, stamps from 1,000,000, its generator drawn from `rng`): what
/// `work` returns.
pub fn while_writing<T: Send>(
    core: &hybridcache_engine::Core,
    model: &parking_lot::Mutex<Vec<u8>>,
    rng: &mut Rng,
    core_bytes: u64,
    work: impl FnOnce() -> T + Send,
) -> T {
    let mut writer_rng = Rng(rng.next_u64());
    std::thread::scope(|s| {
        let writer = s.spawn(|| {
            for i in 0..300u32 {
                random_op(core, model, &mut writer_rng, 1_000_000 + i, core_bytes);
            }
        });
        let r = work();
        writer.join().unwrap();
        r
    })
}

/// A random write of 1 to 31 sectors within the first `sectors` of `core`, stamped with the next
/// `stamp` and recorded in `model` once acknowledged.
pub fn modelled_write(
    core: &hybridcache_engine::Core,
    model: &mut Model,
    rng: &mut Rng,
    stamp: &mut u32,
    sectors: u64,
) {
    *stamp += 1;
    let first = rng.below(sectors - 32);
    let count = 1 + rng.below(31);
    let mut buf = vec![0u8; (count * 512) as usize];
    fill(&mut buf, *stamp, first);
    core.write(&buf, first * 512).unwrap();
    model.write(first, count, *stamp);
}

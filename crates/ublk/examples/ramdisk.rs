//! A RAM disk served as /dev/ublkbN: the smallest real user of hybridcache-ublk, and what the
//! guest test (scripts/guest/ublk-guest.sh) formats, fills and checks.
//!
//!   ramdisk SIZE_MIB [--queues N] [--depth N] [--physical-block BYTES] [--delay-us N]
//!           [--file PATH] [--recovery] [--recover DEV_ID]
//!
//! Prints `ramdisk: /dev/ublkbN ready` once the device takes IO, serves it until SIGINT or
//! SIGTERM, then deletes the device and prints how many requests it served and the most it had
//! in the backend at once (`--delay-us` makes each request take that long, to show that a queue
//! does not wait for one request before starting the next).
//!
//! `--file PATH` keeps the data in a file of SIZE_MIB instead (created if missing), so that it
//! survives the server: with `--recovery` the device outlives a killed server, and
//! `--recover DEV_ID` (same file) takes it over again.

use hybridcache_ublk::{recover, serve, stop, BlockBackend, DeviceConfig};
use parking_lot::RwLock;
use std::io;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

enum Store {
    Ram(RwLock<Vec<u8>>),
    File(std::fs::File, u64),
}

struct RamDisk {
    data: Store,
    delay: Duration,
    requests: AtomicU64,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
}

impl RamDisk {
    /// Counts the request in flight for as long as the returned guard lives.
    fn enter(&self) -> InFlight<'_> {
        self.requests.fetch_add(1, Ordering::Relaxed);
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        if !self.delay.is_zero() {
            std::thread::sleep(self.delay);
        }
        InFlight(self)
    }
}

struct InFlight<'a>(&'a RamDisk);
impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

fn range(offset: u64, len: usize) -> std::ops::Range<usize> {
    offset as usize..offset as usize + len
}

impl BlockBackend for RamDisk {
    fn size(&self) -> u64 {
        match &self.data {
            Store::Ram(d) => d.read().len() as u64,
            Store::File(_, size) => *size,
        }
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let _g = self.enter();
        match &self.data {
            Store::Ram(d) => buf.copy_from_slice(&d.read()[range(offset, buf.len())]),
            Store::File(f, _) => f.read_exact_at(buf, offset)?,
        }
        Ok(())
    }
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
        let _g = self.enter();
        match &self.data {
            Store::Ram(d) => d.write()[range(offset, buf.len())].copy_from_slice(buf),
            Store::File(f, _) => {
                f.write_all_at(buf, offset)?;
                if fua {
                    f.sync_data()?;
                }
            }
        }
        Ok(())
    }
    fn flush(&self) -> io::Result<()> {
        let _g = self.enter();
        match &self.data {
            Store::Ram(_) => Ok(()),
            Store::File(f, _) => f.sync_data(),
        }
    }
    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        self.write_zeroes(offset, len)
    }
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        let _g = self.enter();
        match &self.data {
            Store::Ram(d) => d.write()[range(offset, len as usize)].fill(0),
            Store::File(f, _) => {
                let zeroes = vec![0u8; 1 << 16];
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(zeroes.len() as u64) as usize;
                    f.write_all_at(&zeroes[..n], offset + done)?;
                    done += n as u64;
                }
            }
        }
        Ok(())
    }
}

struct Args {
    size: u64,
    config: DeviceConfig,
    delay: Duration,
    file: Option<String>,
    recover: Option<u32>,
}

fn parse_args() -> Result<Args, String> {
    let mut args = std::env::args().skip(1);
    let mut config = DeviceConfig::default();
    let mut size_mib = None;
    let mut delay = Duration::ZERO;
    let (mut file, mut recover) = (None, None);
    while let Some(a) = args.next() {
        let mut value = |name: &str| -> Result<u64, String> {
            let v = args.next().ok_or(format!("{name} needs a value"))?;
            v.parse().map_err(|_| format!("{name}: not a number: {v}"))
        };
        match a.as_str() {
            "--queues" => {
                config.queues = Some(
                    value("--queues")?
                        .try_into()
                        .map_err(|_| "--queues: too large")?,
                )
            }
            "--depth" => {
                config.depth = value("--depth")?
                    .try_into()
                    .map_err(|_| "--depth: too large")?
            }
            "--physical-block" => {
                config.physical_block = value("--physical-block")?
                    .try_into()
                    .map_err(|_| "--physical-block: too large")?
            }
            "--delay-us" => delay = Duration::from_micros(value("--delay-us")?),
            "--recovery" => config.user_recovery = true,
            "--recover" => {
                recover = Some(
                    value("--recover")?
                        .try_into()
                        .map_err(|_| "--recover: too large")?,
                )
            }
            "--file" => file = Some(args.next().ok_or("--file needs a path")?),
            s if size_mib.is_none() => {
                size_mib = Some(s.parse::<u64>().map_err(|_| format!("bad size: {s}"))?)
            }
            s => return Err(format!("unexpected argument: {s}")),
        }
    }
    let size = size_mib.ok_or(
        "usage: ramdisk SIZE_MIB [--queues N] [--depth N] [--physical-block BYTES] [--delay-us N]",
    )?;
    Ok(Args {
        size: size << 20,
        config,
        delay,
        file,
        recover,
    })
}

/// Blocks SIGINT and SIGTERM in this thread and every thread it starts later, so that they
/// are taken only by the thread that waits for them.
fn block_signals() -> libc::sigset_t {
    // SAFETY: plain libc calls on a local signal set.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

fn main() {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("ramdisk: {e}");
            std::process::exit(2);
        }
    };
    let data = match &args.file {
        None => Store::Ram(RwLock::new(vec![0; args.size as usize])),
        Some(path) => {
            let opened = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(false)
                .open(path)
                .and_then(|f| f.set_len(args.size).map(|()| f));
            match opened {
                Ok(f) => Store::File(f, args.size),
                Err(e) => {
                    eprintln!("ramdisk: {path}: {e}");
                    std::process::exit(1);
                }
            }
        }
    };
    let disk = Arc::new(RamDisk {
        data,
        delay: args.delay,
        requests: AtomicU64::new(0),
        in_flight: AtomicU64::new(0),
        max_in_flight: AtomicU64::new(0),
    });
    let set = block_signals();
    let on_started = move |started: &hybridcache_ublk::Started| {
        println!(
            "ramdisk: {} ready ({} queues, depth {})",
            started.block_device, started.queues, started.depth
        );
        let dev_id = started.dev_id;
        std::thread::spawn(move || {
            let mut sig = 0;
            // SAFETY: waits on the signal set blocked above.
            unsafe { libc::sigwait(&set, &mut sig) };
            if let Err(e) = stop(dev_id) {
                eprintln!("ramdisk: cannot stop device {dev_id}: {e}");
            }
        });
    };
    let result = match args.recover {
        None => serve(disk.clone(), args.config, on_started),
        Some(id) => recover(id, disk.clone(), args.config, on_started),
    };
    if let Err(e) = result {
        eprintln!("ramdisk: {e}");
        std::process::exit(1);
    }
    println!(
        "ramdisk: stopped after {} requests, at most {} in flight at once",
        disk.requests.load(Ordering::Relaxed),
        disk.max_in_flight.load(Ordering::Relaxed)
    );
}

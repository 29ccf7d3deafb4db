//! The ublk front-end: a core's exported volume as `/dev/ublkbN`, served by `hybridcache-ublk`.
//!
//! Every device is created with `UBLK_F_USER_RECOVERY(_REISSUE)`, so when the daemon dies the
//! kernel keeps the block device and holds its requests. Which device id belongs to which export
//! is kept in a state file in the daemon's state directory (by default the control socket's
//! directory, `/run/hybridcache`): a tmpfs that the kernel's ublk devices and this file lose
//! together at reboot, so a record never outlives its device by a boot. The cache superblock
//! would keep the id across reboots, where it means nothing, and would make the engine's
//! on-disk format carry a front-end's detail. When the daemon loads the cache again, the export
//! resumes the same device through [`hybridcache_ublk::recover`]; if the cache cannot be loaded,
//! [`Frontend::abandon`] deletes the device and logs why.
//!
//! A kill -9 must not lose a write the kernel saw acknowledged: the file system above still runs
//! and will read that data back. The engine makes a write survive the death of its process only
//! once a flush commits the metadata, so the adapter acknowledges a write only once it is
//! durable (a FUA write), and write-zeroes only after a flush. This is the price of a device
//! that outlives its server; NBD clients, which lose their connection when the daemon dies,
//! keep the volatile-cache contract.

use std::collections::BTreeMap;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::Duration;

use hybridcache_engine::EngineError;
use hybridcache_ublk::{BlockBackend, DeviceConfig, Started};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::export::{write_zeroes_chunked, ErrorLog};
use crate::frontend::{ExportSpec, Frontend, FrontendResult};
use crate::target::Target;

/// How long a new or recovered device may take to come up. Recovery waits for the dead
/// server's descriptors to be released (libublk retries for up to 30 s).
const START_TIMEOUT: Duration = Duration::from_secs(45);

/// A core as a ublk block backend: the engine's calls, with device errors logged as the NBD
/// export logs them.
pub struct CoreBackend {
    core: Target,
    errors: ErrorLog,
}

impl CoreBackend {
    pub fn new(core: Target) -> CoreBackend {
        CoreBackend {
            core,
            errors: ErrorLog::default(),
        }
    }

    fn error(&self, e: EngineError) -> io::Error {
        let errno = match &e {
            EngineError::Unaligned { .. }
            | EngineError::OutOfRange { .. }
            | EngineError::TooLarge { .. } => libc::EINVAL,
            EngineError::Volume(v) => {
                self.errors.log(&self.core.export_name(), v);
                match &v.kind {
                    hybridcache_volume::ErrorKind::Io(io) => {
                        io.raw_os_error().filter(|&n| n > 0).unwrap_or(libc::EIO)
                    }
                    hybridcache_volume::ErrorKind::Unaligned { .. }
                    | hybridcache_volume::ErrorKind::OutOfRange { .. }
                    | hybridcache_volume::ErrorKind::Invalid(_) => libc::EINVAL,
                    _ => libc::EIO,
                }
            }
            _ => libc::EIO,
        };
        io::Error::from_raw_os_error(errno)
    }
}

impl BlockBackend for CoreBackend {
    fn size(&self) -> u64 {
        self.core.size()
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        self.core.read(buf, offset).map_err(|e| self.error(e))
    }

    fn write_at(&self, buf: &[u8], offset: u64, _fua: bool) -> io::Result<()> {
        // Durable before acknowledged, FUA or not: see the module comment.
        self.core.write_fua(buf, offset).map_err(|e| self.error(e))
    }

    fn flush(&self) -> io::Result<()> {
        self.core.flush().map_err(|e| self.error(e))
    }

    fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
        // Reads of a discarded range may return anything, so an uncommitted discard that a
        // restart undoes breaks no promise.
        self.core.discard(offset, len).map_err(|e| self.error(e))
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
        write_zeroes_chunked(&self.core, offset, len).map_err(|e| self.error(e))?;
        self.core.flush().map_err(|e| self.error(e))
    }
}

/// One export's record in the state file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
struct Record {
    dev_id: u32,
    cache_device: String,
}

struct Served {
    dev_id: u32,
    block_device: String,
    thread: JoinHandle<()>,
}

pub struct UblkFrontend {
    state_file: PathBuf,
    /// Queues per device (None: one per CPU).
    queues: Option<u16>,
    served: Mutex<BTreeMap<String, Served>>,
    /// The state file's contents: exports served now, and those of a previous daemon that
    /// were not resumed yet.
    records: Mutex<BTreeMap<String, Record>>,
}

impl UblkFrontend {
    /// `state_dir` holds the state file (`ublk-devices.json`); records left by a previous
    /// daemon are read from it.
    pub fn new(state_dir: PathBuf, queues: Option<u16>) -> UblkFrontend {
        let state_file = state_dir.join("ublk-devices.json");
        let records = match std::fs::read_to_string(&state_file) {
            Ok(text) => serde_json::from_str(&text).unwrap_or_else(|e| {
                tracing::warn!(
                    "ublk: ignoring unreadable state file {}: {e}",
                    state_file.display()
                );
                BTreeMap::new()
            }),
            Err(_) => BTreeMap::new(),
        };
        UblkFrontend {
            state_file,
            queues,
            served: Mutex::new(BTreeMap::new()),
            records: Mutex::new(records),
        }
    }

    /// Write the records atomically (state.rs), so a kill at any moment leaves either the old
    /// or the new list. The file is in the state directory, which systemd keeps across a
    /// restart of the service; records of an earlier boot are dropped there (state.rs).
    fn save(&self, records: &BTreeMap<String, Record>) {
        let write = || -> io::Result<()> {
            let text = serde_json::to_string_pretty(records).map_err(io::Error::other)?;
            crate::state::write_atomic(&self.state_file, text.as_bytes())
        };
        if let Err(e) = write() {
            tracing::error!(
                "ublk: cannot write the state file {}: {e}; a restarted daemon will not find \
                 its devices",
                self.state_file.display()
            );
        }
    }

    fn config(&self, line_size: u32, rotational: bool) -> DeviceConfig {
        DeviceConfig {
            queues: self.queues,
            physical_block: line_size,
            rotational,
            user_recovery: true,
            ..DeviceConfig::default()
        }
    }
}

impl Frontend for UblkFrontend {
    fn kind(&self) -> &'static str {
        "ublk"
    }

    fn start(&self, spec: ExportSpec) -> FrontendResult<()> {
        let mut served = self.served.lock();
        if served.contains_key(&spec.name) {
            return Err(format!("{} is already served over ublk", spec.name));
        }
        let previous = self
            .records
            .lock()
            .get(&spec.name)
            .filter(|r| r.cache_device == spec.cache_device)
            .cloned();
        let resume = previous
            .as_ref()
            .map(|r| r.dev_id)
            .filter(|&id| hybridcache_ublk::orphaned(id));
        let config = self.config(spec.line_size, spec.core.rotational());
        let backend = Arc::new(CoreBackend::new(spec.core));
        let (tx, rx) = mpsc::channel::<FrontendResult<Started>>();
        let name = spec.name.clone();
        let thread = std::thread::Builder::new()
            .name(format!("ublk-{name}"))
            .spawn(move || {
                let ready = tx.clone();
                let started = move |s: &Started| {
                    let _ = ready.send(Ok(s.clone()));
                };
                let result = match resume {
                    Some(id) => hybridcache_ublk::recover(id, backend, config, started),
                    None => hybridcache_ublk::serve(backend, config, started),
                };
                match result {
                    // The first send wins: after a start, this is the device's end.
                    Ok(()) => tracing::info!("{name}: ublk device stopped"),
                    Err(e) => {
                        tracing::error!("{name}: ublk device failed: {e}");
                        let _ = tx.send(Err(e.to_string()));
                    }
                }
            })
            .map_err(|e| format!("cannot start the ublk thread: {e}"))?;
        let started = match rx.recv_timeout(START_TIMEOUT) {
            Ok(Ok(s)) => s,
            Ok(Err(e)) => {
                let _ = thread.join();
                return Err(match resume {
                    Some(id) => format!("cannot resume /dev/ublkb{id}: {e}"),
                    None => format!("cannot create a ublk device: {e}"),
                });
            }
            Err(_) => {
                return Err(format!(
                    "the ublk device did not come up within {} s",
                    START_TIMEOUT.as_secs()
                ))
            }
        };
        match resume {
            Some(_) => tracing::info!(
                "{}: resumed {} after a restart (recovery)",
                spec.name,
                started.block_device
            ),
            None => {
                if let Some(r) = &previous {
                    tracing::warn!(
                        "{}: its earlier device /dev/ublkb{} is gone or served by another process; serving a new one",
                        spec.name,
                        r.dev_id
                    );
                }
                tracing::info!(
                    "{} served as {} ({} queues of depth {})",
                    spec.name,
                    started.block_device,
                    started.queues,
                    started.depth
                )
            }
        }
        let mut records = self.records.lock();
        records.insert(
            spec.name.clone(),
            Record {
                dev_id: started.dev_id,
                cache_device: spec.cache_device.clone(),
            },
        );
        self.save(&records);
        served.insert(
            spec.name,
            Served {
                dev_id: started.dev_id,
                block_device: started.block_device,
                thread,
            },
        );
        Ok(())
    }

    fn stop(&self, name: &str) -> bool {
        let Some(s) = self.served.lock().remove(name) else {
            return false;
        };
        if let Err(e) = hybridcache_ublk::stop(s.dev_id) {
            tracing::error!("{name}: stopping {} failed: {e}", s.block_device);
        }
        // serve/recover delete the device once its queues are down.
        let _ = s.thread.join();
        let mut records = self.records.lock();
        records.remove(name);
        self.save(&records);
        true
    }

    fn clients(&self, name: &str) -> Option<usize> {
        let dev = self.served.lock().get(name)?.block_device.clone();
        Some(usize::from(block_device_in_use(&dev, false)))
    }

    fn busy(&self, name: &str) -> Option<usize> {
        let dev = self.served.lock().get(name)?.block_device.clone();
        Some(usize::from(block_device_in_use(&dev, true)))
    }

    fn device(&self, name: &str) -> Option<String> {
        Some(self.served.lock().get(name)?.block_device.clone())
    }

    fn remembers(&self, name: &str, cache_device: &str) -> bool {
        self.records
            .lock()
            .get(name)
            .is_some_and(|r| r.cache_device == cache_device)
    }

    fn abandon(&self, cache_device: &str, why: &str) {
        let served = self.served.lock();
        let mut records = self.records.lock();
        let stale: Vec<(String, u32)> = records
            .iter()
            .filter(|(n, r)| r.cache_device == cache_device && !served.contains_key(*n))
            .map(|(n, r)| (n.clone(), r.dev_id))
            .collect();
        for (name, id) in &stale {
            // Only a device no live process serves: the id may have been given to another.
            if hybridcache_ublk::orphaned(*id) {
                match hybridcache_ublk::delete(*id) {
                    Ok(()) => tracing::error!(
                        "{name}: deleted /dev/ublkb{id}, left by a daemon that died: the cache \
                         on {cache_device} cannot be loaded ({why}); requests it held fail"
                    ),
                    Err(e) => tracing::error!(
                        "{name}: cannot delete /dev/ublkb{id} (the cache on {cache_device} \
                         cannot be loaded: {why}): {e}"
                    ),
                }
            }
            records.remove(name);
        }
        if !stale.is_empty() {
            self.save(&records);
        }
    }

    fn stop_all(&self) {
        let names: Vec<String> = self.served.lock().keys().cloned().collect();
        for name in names {
            self.stop(&name);
        }
    }
}

/// Whether a block device is held: claimed by another device (LVM, MD, a device-mapper
/// target: `holders/`), mounted (its major:minor in the mount table), or, with `probe`,
/// opened exclusively by anyone (swap, mkfs, another server). The kernel exposes no open
/// count for a block device, so an exclusive open is the probe: it fails with EBUSY whenever
/// the device is mounted or claimed. A plain shared open (dd, fio on the raw device) is not
/// seen. The probe is kept for the in-use guard: while it holds the device for a moment, a
/// `mount` by someone else would fail, which a listing must never cause.
pub fn block_device_in_use(dev: &str, probe: bool) -> bool {
    let base = dev.rsplit('/').next().unwrap_or(dev);
    let holders = std::fs::read_dir(format!("/sys/block/{base}/holders"))
        .map(|mut d| d.next().is_some())
        .unwrap_or(false);
    if holders {
        return true;
    }
    if let Ok(devno) = std::fs::read_to_string(format!("/sys/block/{base}/dev")) {
        let devno = devno.trim();
        let mounted = std::fs::read_to_string("/proc/self/mountinfo").is_ok_and(|t| {
            t.lines()
                .any(|l| l.split_whitespace().nth(2) == Some(devno))
        });
        if mounted {
            return true;
        }
    }
    if !probe {
        return false;
    }
    let probe = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL | libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open(dev);
    matches!(probe, Err(e) if e.raw_os_error() == Some(libc::EBUSY))
}

#[cfg(test)]
mod tests {
    use super::*;
    use hybridcache_engine::{Cache, CacheConfig, CacheMode, LineSize};
    use hybridcache_volume::VolumeRef;

    fn file_volume(path: &std::path::Path, size: u64) -> VolumeRef {
        let f = std::fs::File::create(path).unwrap();
        f.set_len(size).unwrap();
        crate::devices::open_device(path.to_str().unwrap()).unwrap()
    }

    #[test]
    fn records_survive_in_the_state_file_and_are_tied_to_their_cache_device() {
        let dir = tempfile::tempdir().unwrap();
        let f = UblkFrontend::new(dir.path().to_path_buf(), None);
        let mut r = BTreeMap::new();
        r.insert(
            "cas1-1".to_string(),
            Record {
                dev_id: 3,
                cache_device: "/dev/nvme0n1".into(),
            },
        );
        f.save(&r);
        let again = UblkFrontend::new(dir.path().to_path_buf(), None);
        assert!(again.remembers("cas1-1", "/dev/nvme0n1"));
        assert!(!again.remembers("cas1-1", "/dev/other"));
        assert!(!again.remembers("cas1-2", "/dev/nvme0n1"));
        // No such device here: abandoning only drops the record.
        again.abandon("/dev/nvme0n1", "test");
        let third = UblkFrontend::new(dir.path().to_path_buf(), None);
        assert!(!third.remembers("cas1-1", "/dev/nvme0n1"));
    }

    #[test]
    fn engine_errors_reach_the_driver_as_errnos_and_write_zeroes_reads_back_zeroes() {
        use hybridcache_volume::{FaultConfig, FaultyVolume};
        let cache = Cache::new(
            crate::devices::open_device("ram:16M").unwrap(),
            CacheConfig {
                id: 1,
                line_size: LineSize::from_kib(4).unwrap(),
                mode: CacheMode::Wt,
            },
        )
        .unwrap();
        let faulty = Arc::new(FaultyVolume::with_config(
            crate::devices::open_device("ram:8M").unwrap(),
            FaultConfig {
                fail_reads_in: Some(1 << 20..2 << 20),
                ..FaultConfig::default()
            },
        ));
        let id = cache.add_core(faulty, None).unwrap();
        let b = CoreBackend::new(cache.core(id).unwrap().into());
        let mut buf = vec![0u8; 4096];
        let e = b.read_at(&mut buf, 1 << 20).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
        let e = b.read_at(&mut buf[..100], 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
        let e = b.read_at(&mut buf, 8 << 20).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL), "{e}");
        b.write_at(&[0xee; 8192], 4 << 20, false).unwrap();
        b.write_zeroes(4 << 20, 4096).unwrap();
        let mut back = vec![0xffu8; 8192];
        b.read_at(&mut back, 4 << 20).unwrap();
        assert!(back[..4096].iter().all(|&x| x == 0));
        assert!(back[4096..].iter().all(|&x| x == 0xee));
    }

    /// A write acknowledged to the kernel must still be there when the daemon is killed and
    /// the cache loaded again: the file system above never saw a crash. Without the FUA in
    /// `write_at`, a write-back write lives only in uncommitted metadata and comes back stale.
    #[test]
    fn an_acknowledged_write_survives_a_daemon_killed_before_any_flush() {
        let dir = tempfile::tempdir().unwrap();
        let cache_path = dir.path().join("cache.img");
        let core_path = dir.path().join("core.img");
        let cache_vol = file_volume(&cache_path, 64 << 20);
        let core_vol = file_volume(&core_path, 16 << 20);
        let cache = Cache::create(
            cache_vol,
            CacheConfig {
                id: 1,
                line_size: LineSize::from_kib(4).unwrap(),
                mode: CacheMode::Wb,
            },
            false,
        )
        .unwrap();
        let id = cache.add_core(core_vol, None).unwrap();
        cache.flush().unwrap();
        let backend = CoreBackend::new(cache.core(id).unwrap().into());
        let data = vec![0x5a; 8192];
        backend.write_at(&data, 1 << 20, false).unwrap();
        // "kill -9": nothing more reaches the devices from this cache; its files stay as they
        // are now (the process's writes are in the host's page cache).
        std::mem::forget(backend);
        std::mem::forget(cache);
        let cache_vol = crate::devices::open_device(cache_path.to_str().unwrap()).unwrap();
        let loaded = Cache::load(cache_vol, &mut |rec: &hybridcache_engine::CoreRecord| {
            crate::devices::open_device(&rec.path).ok()
        })
        .unwrap();
        let mut back = vec![0u8; 8192];
        loaded.core(id).unwrap().read(&mut back, 1 << 20).unwrap();
        assert!(back == data, "the acknowledged write was lost");
    }
}

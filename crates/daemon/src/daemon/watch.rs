//! Late devices: a cache of the configuration whose device was missing starts when the device
//! appears, and an inactive core is attached again when a device with its recorded identity
//! appears (Open CAS does this with `lazy_startup` and udev rules).
//!
//! Detection is by polling once a second: one `stat` per missing device. It sees regular files
//! and block device nodes alike, whatever created them (udev, losetup, a mount, a copy), and
//! needs neither udev (absent in containers, where a user-space cache runs) nor a parent
//! directory that exists (inotify needs one to watch). A second is small next to how long a
//! late disk takes. A device is acted on only when two looks a poll apart agree on its size
//! and modification time, so a file still being copied is not formatted or loaded half-written.
//!
//! A remote core (an NBD URI) that was unreachable when its cache loaded, or when the
//! configuration named it, is tried every five seconds instead: there is nothing to `stat`.
//!
//! Identity of a core: the superblock records each core's path, size and a uuid of our own.
//! Nothing is written on the core device, so the uuid cannot be read back from it: what is
//! verified is the path (the device must appear under the recorded name, or the name the
//! configuration gives) and the size (the engine refuses any other, `attach_core`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::health::Health;
use super::{Daemon, Ordering, Start, WAITING_FOR_DEVICE};
use crate::devices::settle_mark;
use crate::nbd_volume::is_nbd_uri;

const POLL: Duration = Duration::from_secs(1);
/// A remote core cannot be looked at without connecting: try it every this many polls.
const REMOTE_EVERY: u64 = 5;

type Mark = (u64, i64, i64);

/// What the watcher remembers between polls.
#[derive(Default)]
struct Seen {
    /// Polls so far.
    tick: u64,
    /// The last look at each device that is waited for.
    marks: HashMap<String, Mark>,
    /// The last failure per device, so a device that keeps failing is logged once, not every
    /// second.
    errors: HashMap<String, String>,
}

impl Seen {
    /// Whether `spec` is present and has not changed since the previous poll.
    fn settled(&mut self, spec: &str) -> bool {
        if is_nbd_uri(spec) {
            return self.tick % REMOTE_EVERY == 0;
        }
        match settle_mark(spec) {
            None => {
                self.marks.remove(spec);
                false
            }
            Some(m) => self.marks.insert(spec.to_string(), m) == Some(m),
        }
    }

    /// Log a failure unless it is the one logged last time for this device.
    fn failed(&mut self, spec: &str, what: String) {
        if self.errors.get(spec) != Some(&what) {
            tracing::warn!("{what}");
            self.errors.insert(spec.to_string(), what);
        }
    }
}

/// Start the watcher thread; it ends when the daemon stops. It also looks at the caches'
/// background work once a poll (health.rs).
pub(super) fn spawn(daemon: Arc<Daemon>) -> std::io::Result<()> {
    std::thread::Builder::new()
        .name("device-watch".into())
        .spawn(move || {
            let mut seen = Seen::default();
            let mut health = Health::default();
            let epoch = Instant::now();
            loop {
                std::thread::sleep(POLL);
                if daemon.stopping.load(Ordering::SeqCst) {
                    return;
                }
                daemon.watch_tick(&mut seen);
                daemon.health_tick(&mut health, epoch.elapsed());
                daemon.mirror_tick();
                daemon.fallback_tick();
            }
        })
        .map(|_| ())
}

impl Daemon {
    fn watch_tick(&self, seen: &mut Seen) {
        seen.tick += 1;
        let (caches, cores) = {
            let st = self.state.lock();
            let caches: Vec<(u16, String)> = st
                .waiting
                .iter()
                .filter(|(_, w)| w.status.starts_with(WAITING_FOR_DEVICE))
                .map(|(id, w)| (*id, w.section.device.clone()))
                .collect();
            let cores: Vec<(u16, u16, String)> = st
                .caches
                .iter()
                .flat_map(|(id, c)| {
                    c.cores
                        .iter()
                        .filter(|(_, e)| !e.active)
                        .map(move |(j, e)| (*id, *j, e.device.clone()))
                })
                .collect();
            (caches, cores)
        };
        // Forget devices no longer waited for, so a device that goes and comes back is
        // looked at afresh.
        seen.marks.retain(|spec, _| {
            caches.iter().any(|(_, d)| d == spec) || cores.iter().any(|(_, _, d)| d == spec)
        });
        for (id, device) in caches {
            if seen.settled(&device) {
                self.start_waiting(id, &device, seen);
            }
        }
        for (cache, core, device) in cores {
            if !seen.settled(&device) {
                continue;
            }
            match self.add_core(cache, &device, Some(core), false, None) {
                Ok(_) => {
                    seen.errors.remove(&device);
                    tracing::info!(
                        "cache {cache}: core {core} attached again by itself: its device {device} appeared"
                    );
                }
                Err(e) => seen.failed(
                    &device,
                    format!("cache {cache}: core {core}: its device {device} is back but cannot be attached: {e}"),
                ),
            }
        }
    }

    /// Start a cache that waited for its device; on failure it goes on waiting.
    fn start_waiting(&self, id: u16, device: &str, seen: &mut Seen) {
        let w = {
            let mut st = self.state.lock();
            match st.waiting.remove(&id) {
                Some(w) => w,
                None => return,
            }
        };
        tracing::info!("cache {id}: its device {device} appeared; starting the cache");
        match self.start_configured(&w.section, &w.cores, Start::LoadOrCreate) {
            Ok(()) => {
                seen.errors.remove(device);
                tracing::info!("cache {id}: started on its late device {device}");
                self.attach_pooled(id);
                self.save();
            }
            Err(e) => {
                seen.failed(
                    device,
                    format!("cache {id}: its device {device} appeared but the cache cannot start: {e}; still waiting"),
                );
                let mut st = self.state.lock();
                if !st.caches.contains_key(&id) {
                    st.waiting.insert(
                        id,
                        super::Waiting {
                            status: format!("{WAITING_FOR_DEVICE} (last attempt: {e})"),
                            ..w
                        },
                    );
                }
            }
        }
    }
}

//! Bounded core flushes: a core whose device hangs (a write or a flush that never returns: a
//! stopped NBD server, a disk stuck in the kernel) must not hold up the other cores' flushes or
//! the commits that make their data durable.
//!
//! A blocking pwrite or fdatasync cannot be cancelled, so the waiting is what is bounded:
//! - a core's device flush (in a commit, or a failing core's retry) runs on its own thread; the
//!   caller waits at most the core flush timeout and then treats it as a failed flush (the core
//!   is marked failing and its lines stay recorded dirty, as for an error). One device flush
//!   runs per core at a time (a later one waits for the earlier, which may have begun before
//!   its writes completed); once one has run for the timeout it is stuck, and no second one is
//!   started on the core: its flushes fail at once;
//! - a flush of cores' dirty data (`-F`, `-F -j`, a stop) runs one thread per core and gives up
//!   on a core whose device has had writes or flushes outstanding with none completing for the
//!   timeout ("hung"), while the other cores' flushes go on. A slow core that keeps completing
//!   requests is never given up on, however long its flush takes.
//!
//! Never is a line recorded clean on a flush that timed out: the commit that would record it
//! counts the core as failing and records its lines dirty.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hybridcache_volume::VolumeRef;
use parking_lot::{Condvar, Mutex};

use crate::{CoreId, EngineError, Result};

/// Default of [`core_flush_timeout`]: long enough for a disk array's cache flush, short enough
/// that an operator waiting on `-F` learns which core hangs.
pub const DEFAULT_CORE_FLUSH_TIMEOUT: Duration = Duration::from_secs(30);

/// The timeout in milliseconds. Process-wide: it is a daemon setting, and every cache's
/// cores are devices of the same host.
static TIMEOUT_MS: AtomicU64 = AtomicU64::new(DEFAULT_CORE_FLUSH_TIMEOUT.as_millis() as u64);

/// Set how long a core's device may go without completing an outstanding write or flush before
/// that core's flush is given up as timed out (at least 1 ms).
pub fn set_core_flush_timeout(timeout: Duration) {
    TIMEOUT_MS.store((timeout.as_millis() as u64).max(1), Ordering::Relaxed);
}

/// See [`set_core_flush_timeout`].
pub fn core_flush_timeout() -> Duration {
    Duration::from_millis(TIMEOUT_MS.load(Ordering::Relaxed))
}

/// "3 s" or "250 ms", as the operator gave it.
fn duration_text(d: Duration) -> String {
    if d.as_millis() % 1000 == 0 {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_millis())
    }
}

/// The error of a core flush given up on.
pub(crate) fn timed_out(core: CoreId, what: &'static str) -> EngineError {
    EngineError::CoreFlushTimedOut {
        core,
        after: duration_text(core_flush_timeout()),
        what,
    }
}

/// The per-core results of a flush of several cores, for its error message.
pub(crate) fn results_text(results: &[(CoreId, Option<String>)]) -> String {
    results
        .iter()
        .map(|(id, err)| match err {
            None => format!("core {id} flushed"),
            Some(e) if e.starts_with(&format!("core {id}: ")) => e.clone(),
            Some(e) => format!("core {id}: {e}"),
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// Milliseconds on a process-wide monotonic clock.
fn now_ms() -> u64 {
    static START: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    START.get_or_init(Instant::now).elapsed().as_millis() as u64
}

/// What a core's device is doing, to tell a hung device from a slow one.
#[derive(Default)]
pub(crate) struct CoreWatch {
    /// Writes and flushes sent to the device and not returned.
    outstanding: AtomicU64,
    /// When one last returned, or the first of a busy period was sent (ms, [`now_ms`]).
    last_ms: AtomicU64,
    /// When the running device flush of this core began; None when none runs.
    device_flush: Mutex<Option<Instant>>,
    device_flush_done: Condvar,
    /// Flushes of this core's dirty data that have not returned.
    dirty_flushes: AtomicU64,
}

/// Held while a device request runs.
pub(crate) struct DeviceOp<'a>(&'a CoreWatch);

impl Drop for DeviceOp<'_> {
    fn drop(&mut self) {
        self.0.last_ms.store(now_ms(), Ordering::Relaxed);
        self.0.outstanding.fetch_sub(1, Ordering::Release);
    }
}

impl CoreWatch {
    pub(crate) fn begin(&self) -> DeviceOp<'_> {
        if self.outstanding.fetch_add(1, Ordering::Acquire) == 0 {
            self.last_ms.store(now_ms(), Ordering::Relaxed);
        }
        DeviceOp(self)
    }

    /// A flush of the core's dirty data begins; how many were under way already.
    pub(crate) fn dirty_flush_begins(&self) -> u64 {
        self.dirty_flushes.fetch_add(1, Ordering::SeqCst)
    }

    pub(crate) fn dirty_flush_ends(&self) {
        self.dirty_flushes.fetch_sub(1, Ordering::SeqCst);
    }

    /// Whether the device has requests outstanding and none returned for `limit`.
    pub(crate) fn hung(&self, limit: Duration) -> bool {
        self.outstanding.load(Ordering::Acquire) > 0
            && now_ms().saturating_sub(self.last_ms.load(Ordering::Relaxed))
                >= limit.as_millis() as u64
    }
}

/// A device flush running on its own thread.
pub(crate) struct PendingFlush {
    core: CoreId,
    rx: Option<mpsc::Receiver<Result<()>>>,
    /// Known without waiting (refused, or run on the caller's thread).
    done: Option<Result<()>>,
}

fn stuck(core: CoreId) -> EngineError {
    timed_out(core, "its previous device flush has not returned")
}

/// Start flushing `core`'s device on a thread of its own. Fails at once (as timed out) when the
/// core's running device flush has run for the timeout already.
pub(crate) fn start_device_flush(
    id: CoreId,
    watch: &Arc<CoreWatch>,
    volume: &VolumeRef,
) -> PendingFlush {
    let limit = core_flush_timeout();
    let known_stuck = watch
        .device_flush
        .lock()
        .is_some_and(|started| started.elapsed() >= limit);
    if known_stuck {
        return PendingFlush {
            core: id,
            rx: None,
            done: Some(Err(stuck(id))),
        };
    }
    let (tx, rx) = mpsc::sync_channel(1);
    let (thread_watch, thread_volume): (Arc<CoreWatch>, VolumeRef) =
        (watch.clone(), volume.clone());
    let spawned = std::thread::Builder::new()
        .name(format!("core{id}-flush"))
        .stack_size(256 << 10)
        .spawn(move || {
            let (watch, volume) = (thread_watch, thread_volume);
            let mut running = watch.device_flush.lock();
            while let Some(started) = *running {
                if started.elapsed() >= limit {
                    drop(running);
                    let _ = tx.send(Err(stuck(id)));
                    return;
                }
                watch
                    .device_flush_done
                    .wait_until(&mut running, started + limit);
            }
            *running = Some(Instant::now());
            drop(running);
            let op = watch.begin();
            let r = volume.flush().map_err(EngineError::from);
            drop(op);
            *watch.device_flush.lock() = None;
            watch.device_flush_done.notify_all();
            let _ = tx.send(r);
        });
    match spawned {
        Ok(_) => PendingFlush {
            core: id,
            rx: Some(rx),
            done: None,
        },
        Err(_) => {
            // No thread to spare: flush here, unbounded, rather than not at all.
            let op = watch.begin();
            let r = volume.flush().map_err(EngineError::from);
            drop(op);
            PendingFlush {
                core: id,
                rx: None,
                done: Some(r),
            }
        }
    }
}

impl PendingFlush {
    /// Its result, waiting until `deadline` at most.
    pub(crate) fn wait(mut self, deadline: Instant) -> Result<()> {
        if let Some(r) = self.done.take() {
            return r;
        }
        let Some(rx) = self.rx.take() else {
            return Ok(());
        };
        match rx.recv_timeout(deadline.saturating_duration_since(Instant::now())) {
            Ok(r) => r,
            Err(_) => Err(timed_out(self.core, "its device did not complete a flush")),
        }
    }
}

/// Flush core `id`'s device, waiting at most the core flush timeout.
pub(crate) fn flush_device(id: CoreId, watch: &Arc<CoreWatch>, volume: &VolumeRef) -> Result<()> {
    let deadline = Instant::now() + core_flush_timeout();
    start_device_flush(id, watch, volume).wait(deadline)
}

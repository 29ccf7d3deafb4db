//! Requests on a running cache that neither start nor stop anything: flush (retried across a
//! remote core's reconnection), block traces, and the handle to a cache that parameter and IO
//! class requests act on.

use std::time::Duration;

use hybridcache_engine::{Cache, EngineError};

use super::{engine_err, export_name, Daemon, Reply};
use crate::nbd_volume::is_nbd_uri;
use std::path::Path;

/// Attempts of a flush that failed while a remote core was reconnecting: each after the
/// reconnection, so a server restarted while nothing was sent to it costs no failed flush.
const FLUSH_ATTEMPTS: u32 = 3;

/// How long a flush waits for a remote core's reconnection before it tries again: the
/// reconnection's backoff reaches its 3 s cap within this.
const RECONNECT_WAIT: Duration = Duration::from_secs(10);

/// Run `flush` (of a cache or a core) and, when it fails while one of the `remote` cores it
/// covers is reconnecting (a dead connection found by the flush itself), wait for the
/// reconnection and run it again: the lines it could not clean are still dirty and are
/// cleaned again; lines are recorded clean only after a core flush that covers them.
/// Requests sent while the volume is detached fail at once, so one breakage may fail several
/// of the attempt's writes although the volume reconnected within it.
pub(super) fn flush_retrying(
    remote: &[String],
    mut flush: impl FnMut() -> std::result::Result<(), EngineError>,
) -> std::result::Result<(), EngineError> {
    let mut attempt = 1;
    loop {
        let before: Vec<Option<u64>> = remote
            .iter()
            .map(|uri| crate::nbd_volume::breakages(uri))
            .collect();
        let e = match flush() {
            Ok(()) => return Ok(()),
            Err(e @ EngineError::FlushInterrupted { .. }) => return Err(e),
            Err(e) => e,
        };
        // Down now, or broken and back during the attempt (its other requests then failed).
        let down: Vec<&String> = remote
            .iter()
            .zip(&before)
            .filter(|(uri, before)| {
                crate::nbd_volume::link_status(uri).is_some()
                    || crate::nbd_volume::breakages(uri) != **before
            })
            .map(|(uri, _)| uri)
            .collect();
        if attempt >= FLUSH_ATTEMPTS || down.is_empty() {
            return Err(e);
        }
        if !down
            .iter()
            .all(|uri| crate::nbd_volume::wait_connected(uri, RECONNECT_WAIT))
        {
            return Err(e);
        }
        attempt += 1;
        tracing::warn!(
            "flush failed while a remote core reconnected ({}); flushing again (attempt {attempt} of {FLUSH_ATTEMPTS})",
            engine_err(e)
        );
    }
}

/// What an interrupted flush did, from the engine's count of the lines it cleaned and the dirty
/// lines left now: "flush of cache 1 interrupted: cleaned 1,234 of 3,000 dirty lines (4.8 MiB of
/// 11.7 MiB); 1,766 stay dirty". Nothing is lost, so it is logged at INFO.
pub(super) fn interrupted_flush_text(
    handle: &Cache,
    cache: u16,
    core: Option<u16>,
    cleaned: u64,
    total: u64,
) -> String {
    let line = handle.line_size().bytes() as u64;
    let dirty_now = match core {
        Some(j) => handle.core_stats(j).map(|s| s.usage.dirty_lines),
        None => Ok(handle.stats().usage.dirty_lines),
    };
    let what = match core {
        Some(j) => format!("cache {cache} core {j}"),
        None => format!("cache {cache}"),
    };
    let left = match dirty_now {
        Ok(n) => format!("; {} stay dirty", crate::safety::count_text(n)),
        // The core went away meanwhile; its lines are no longer this cache's to count.
        Err(_) => String::new(),
    };
    let text = format!(
        "flush of {what} interrupted: cleaned {} of {} dirty lines ({} of {}){left}",
        crate::safety::count_text(cleaned),
        crate::safety::count_text(total),
        crate::trace::size_text(cleaned * line),
        crate::trace::size_text(total * line),
    );
    tracing::info!("{text}");
    text
}

impl Daemon {
    /// `trace start`: the cores to trace are checked and the trace attached under the state
    /// lock, so no core can be removed in between.
    pub(super) fn trace_start(
        &self,
        cache: u16,
        core: Option<u16>,
        file: &str,
        max: Option<u64>,
    ) -> Reply {
        let st = self.state.lock();
        let c = st.cache(cache)?;
        let cores: Vec<(u16, String)> = match core {
            Some(j) => {
                st.active_core(cache, j)?;
                vec![(j, export_name(cache, j))]
            }
            None => c
                .cores
                .iter()
                .filter(|(_, e)| e.active)
                .map(|(j, _)| (*j, export_name(cache, *j)))
                .collect(),
        };
        self.traces
            .start(&self.registry, cache, core, &cores, Path::new(file), max)
    }

    /// The remote (NBD) cores a flush of `cache` (or of its core `core`) covers, by URI.
    pub(super) fn remote_cores(&self, cache: u16, core: Option<u16>) -> Vec<String> {
        let st = self.state.lock();
        st.caches.get(&cache).map_or_else(Vec::new, |c| {
            c.cores
                .iter()
                .filter(|(id, e)| core.map_or(true, |j| j == **id) && is_nbd_uri(&e.device))
                .map(|(_, e)| e.device.clone())
                .collect()
        })
    }

    /// A handle to cache `cache` after checking that `core` (if given) exists in it.
    pub(super) fn checked(
        &self,
        cache: u16,
        core: Option<u16>,
    ) -> std::result::Result<Cache, String> {
        let st = self.state.lock();
        let c = st.cache(cache)?;
        if let Some(core) = core {
            st.core(cache, core)?;
        }
        Ok(c.cache.clone())
    }
}

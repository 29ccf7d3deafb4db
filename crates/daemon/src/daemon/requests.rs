//! Requests on a running cache that neither start nor stop anything: flush (retried across a
//! remote core's reconnection) and its interruption, the cache mode, parameters, IO classes and
//! block traces. Each takes a handle to the cache under the state lock and acts on it outside
//! the lock (a flush or a mode switch with a flush takes as long as the dirty data), except a
//! trace's start, which must see the cores it attaches to stay.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use hybridcache_engine::{Cache, CacheMode, EngineError};
use serde_json::json;

use super::{engine_err, export_name, io_class_info, Daemon, Reply};
use crate::nbd_volume::is_nbd_uri;
use crate::{params, protocol};

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
fn interrupted_flush_text(
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
    fn remote_cores(&self, cache: u16, core: Option<u16>) -> Vec<String> {
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

impl Daemon {
    /// `load-io-classes`: the whole file is parsed before the cache sees any of it.
    pub(super) fn load_io_classes(&self, cache: u16, csv: &str, ignore_unsupported: bool) -> Reply {
        let handle = self.checked(cache, None)?;
        let opts = hybridcache_engine::ioclass::LoadOptions { ignore_unsupported };
        let classes = hybridcache_engine::ioclass::IoClasses::parse(csv, &opts).map_err(|e| {
            format!("IO class file refused, nothing changed: {e}").replace(
                "load with ignore_unsupported",
                "load with --ignore-unsupported",
            )
        })?;
        handle.load_io_classes(classes).map_err(engine_err)?;
        Ok(json!({}))
    }

    pub(super) fn list_io_classes(&self, cache: u16) -> Reply {
        let handle = self.checked(cache, None)?;
        let classes = handle.io_classes().iter().map(io_class_info).collect();
        serde_json::to_value(protocol::IoClassList { classes }).map_err(|e| e.to_string())
    }

    /// `set-cache-mode`: the switch (and its flush) runs on a handle, outside the state lock.
    pub(super) fn set_cache_mode(&self, cache: u16, mode: &str, flush: Option<bool>) -> Reply {
        let mode: CacheMode = mode.parse()?;
        let handle = self.state.lock().cache(cache)?.cache.clone();
        let lazy = |m: CacheMode| matches!(m, CacheMode::Wb | CacheMode::Wo);
        let from = handle.mode();
        let flush = match flush {
            Some(f) => f,
            // As casadm: leaving write-back or write-only, the operator chooses.
            None if lazy(from) && !lazy(mode) => {
                return Err(format!(
                    "cache {cache} leaves {from} for {mode}: say whether to flush its dirty data first with --flush-cache (-f) yes or no"
                ))
            }
            None => false,
        };
        // As casadm, the cache runs the new mode at once; dirty data a switch without flush
        // leaves drains by cleaning, and `-L` shows the mode it runs (`wb->wt` only while a
        // flush switches it).
        handle.set_mode(mode, flush).map_err(engine_err)?;
        self.save();
        Ok(json!({}))
    }

    pub(super) fn interrupt_flush(&self, cache: u16) -> Reply {
        let handle = self.state.lock().cache(cache)?.cache.clone();
        if !handle.interrupt_flush() {
            return Err(format!("cache {cache} is not flushing"));
        }
        tracing::info!("cache {cache}: flush interrupted on request");
        Ok(json!({}))
    }

    /// `-F` / `-E`: the flush runs on a handle, outside the state lock, so statistics stay
    /// readable meanwhile.
    pub(super) fn flush(&self, cache: u16, core: Option<u16>) -> Reply {
        let handle = {
            let st = self.state.lock();
            let c = st.cache(cache)?;
            if let Some(core) = core {
                st.active_core(cache, core)?;
            }
            c.cache.clone()
        };
        let remote = self.remote_cores(cache, core);
        let flushed = flush_retrying(&remote, || match core {
            Some(core) => handle.flush_core(core),
            None => handle.flush(),
        });
        match flushed {
            Err(EngineError::FlushInterrupted {
                cleaned_lines,
                total_lines,
            }) => Err(interrupted_flush_text(
                &handle,
                cache,
                core,
                cleaned_lines,
                total_lines,
            )),
            other => other.map(|()| json!({})).map_err(engine_err),
        }
    }

    pub(super) fn set_param(
        &self,
        cache: u16,
        core: Option<u16>,
        name: &str,
        value: String,
        mut values: BTreeMap<String, String>,
    ) -> Reply {
        let g = params::find(name)?;
        let set = g
            .set
            .ok_or_else(|| format!("parameter '{name}' is read-only"))?;
        if !value.is_empty() {
            values.insert(g.fields[0].key.to_string(), value);
        }
        if values.is_empty() {
            return Err(format!(
                "nothing to set for '{name}': give {}",
                g.fields
                    .iter()
                    .map(|f| format!("{} ({})", f.flag, f.key))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        if core.is_some() && !g.per_core {
            return Err(format!("parameter '{name}' is per cache; drop -j"));
        }
        let handle = self.checked(cache, core)?;
        set(&handle, core, &values)?;
        self.save();
        Ok(json!({}))
    }

    pub(super) fn get_param(&self, cache: u16, core: Option<u16>, name: &str) -> Reply {
        let g = params::find(name)?;
        let handle = self.checked(cache, core)?;
        let fields = |core: Option<u16>| -> std::result::Result<Vec<protocol::ParamField>, String> {
            Ok((g.get)(&handle, core)?
                .into_iter()
                .zip(g.fields)
                .map(|(value, f)| protocol::ParamField {
                    key: f.key.into(),
                    label: f.label.into(),
                    value,
                })
                .collect())
        };
        let (fields, cores) = if g.per_core && core.is_none() {
            let mut cores = Vec::new();
            for info in handle.cores() {
                cores.push(protocol::CoreParams {
                    core: info.id,
                    fields: fields(Some(info.id))?,
                });
            }
            (Vec::new(), cores)
        } else {
            (fields(core)?, Vec::new())
        };
        let first = fields
            .first()
            .or_else(|| cores.first().and_then(|c| c.fields.first()))
            .map(|f| f.value.clone())
            .unwrap_or_default();
        serde_json::to_value(protocol::ParamValue {
            name: g.name.into(),
            value: first,
            read_only: g.set.is_none(),
            fields,
            cores,
        })
        .map_err(|e| e.to_string())
    }
}

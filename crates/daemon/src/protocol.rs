//! The control protocol between the CLI and the daemon: newline-delimited JSON over a Unix socket.
//!
//! One request per line, one response per line, in order; a connection may carry any number of
//! them. A request is an object tagged by `"cmd"` (see [`Request`]); a response is
//! `{"ok":true,"result":{...}}` or `{"ok":false,"error":"one-line message"}`. The daemon returns
//! raw numbers (bytes, lines, counters) and the CLI formats them, so scripts can talk to the
//! socket directly and get exact values.

use serde::{Deserialize, Serialize};

/// A management request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "kebab-case")]
pub enum Request {
    StartCache {
        device: String,
        #[serde(default)]
        id: Option<u16>,
        /// `wt`, `wb`, `wa`, `wi`, `wo` or `pt`; default `wt`.
        #[serde(default)]
        mode: Option<String>,
        /// Cache line size in KiB; default 4.
        #[serde(default)]
        line_size_kib: Option<u32>,
        #[serde(default)]
        force: bool,
        #[serde(default)]
        load: bool,
        /// A mirror for the dirty data and metadata (docs/format.md, "The mirror"): given to a
        /// new cache, or with `load` the mirror of the cache loaded.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mirror: Option<String>,
        /// Bring the cache up from `device`, its mirror, alone (failover).
        #[serde(default)]
        load_mirror: bool,
        /// What to do when the mirror is lost: `drain` (default) or `keep`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mirror_lost: Option<String>,
        /// Fallback pass-through's threshold and window (`-X -n fallback-pt`), set as the cache
        /// starts.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fallback_pt_threshold: Option<u32>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        fallback_pt_window: Option<u32>,
    },
    /// Result: `{"losses": [...]}`, the [`crate::safety::Loss`]es the operator accepted (also
    /// in the results of `remove-core`, `zero-metadata` and `start-cache`).
    StopCache {
        id: u16,
        #[serde(default)]
        no_data_flush: bool,
        /// The old name of `disconnect_clients` (`-T --force`), still accepted.
        #[serde(default)]
        force: bool,
        /// Stop even while clients are connected to the cache's exports (they get I/O errors).
        #[serde(default)]
        disconnect_clients: bool,
    },
    AddCore {
        cache: u16,
        device: String,
        #[serde(default)]
        core: Option<u16>,
        /// Take a core device that is mounted.
        #[serde(default)]
        force: bool,
        /// "nbd" or "ublk"; None: the daemon's default front-end.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        frontend: Option<String>,
    },
    RemoveCore {
        cache: u16,
        core: u16,
        /// casadm's `-R -f`: remove without flushing; the core's dirty data is discarded.
        #[serde(default)]
        force: bool,
        /// Remove even while clients are connected to the core's export.
        #[serde(default)]
        disconnect_clients: bool,
        /// `--remove-inactive`: refuse an active core instead of removing it.
        #[serde(default)]
        inactive_only: bool,
        /// `--script --remove-core --detach`: make the core inactive, kept in the cache's
        /// metadata with its lines, instead of removing it.
        #[serde(default)]
        detach: bool,
    },
    /// `--script --disconnect-cache`: stop the cache but keep its cores' exports; their
    /// requests wait for `ConnectCache` or, with `pass_through`, go to the cores directly.
    DisconnectCache {
        id: u16,
        /// Keep dirty data on the cache device (the reconnect must then load that device).
        #[serde(default)]
        no_flush: bool,
        #[serde(default)]
        pass_through: bool,
        /// casadm's `--detach-cache` (pass-through, listed as `Detached`).
        #[serde(default)]
        detach: bool,
    },
    /// `--script --connect-cache`: bring a disconnected cache back on `device` under its kept
    /// exports. Result: [`Connected`]. With `id` naming a running mirrored cache (its primary
    /// lost), `device` becomes its new primary instead (`--attach-cache`). Result:
    /// [`PrimaryAttached`].
    ConnectCache {
        device: String,
        /// Which disconnected cache a device without hybridcache metadata serves (needed only
        /// when several are disconnected).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        id: Option<u16>,
        /// `--attach-cache -f`: format the device even though it holds a file system, a
        /// partition table or another cache's metadata (never the metadata of a disconnected
        /// cache on its own device: that is loaded).
        #[serde(default)]
        force: bool,
    },
    List,
    Stats {
        cache: u16,
        #[serde(default)]
        core: Option<u16>,
        /// Statistics of one IO class instead of the cache or a core: with `core`, that core's
        /// share of the class.
        #[serde(default)]
        io_class: Option<u8>,
    },
    /// Replace the IO classes with those of an Open CAS class file (its text).
    LoadIoClasses {
        cache: u16,
        csv: String,
        #[serde(default)]
        ignore_unsupported: bool,
    },
    ListIoClasses {
        cache: u16,
    },
    ResetCounters {
        cache: u16,
        #[serde(default)]
        core: Option<u16>,
    },
    SetCacheMode {
        cache: u16,
        mode: String,
        /// Flush dirty data before leaving wb/wo (`-f yes|no`). Required, as casadm requires
        /// it, when the switch leaves wb or wo for a mode that does not write back; otherwise
        /// None means no.
        #[serde(default)]
        flush: Option<bool>,
    },
    Flush {
        cache: u16,
        #[serde(default)]
        core: Option<u16>,
    },
    /// Stop the running flushes of a cache after their current batch (`-F` interrupted).
    InterruptFlush {
        cache: u16,
    },
    /// Set fields of the parameter group `name` (params.rs): `values` maps field names to
    /// values; `value` alone sets the group's first field.
    SetParam {
        cache: u16,
        #[serde(default)]
        core: Option<u16>,
        name: String,
        #[serde(default)]
        value: String,
        #[serde(default)]
        values: std::collections::BTreeMap<String, String>,
    },
    GetParam {
        cache: u16,
        #[serde(default)]
        core: Option<u16>,
        name: String,
    },
    Version,
    /// Wipe a cache device's hybridcache metadata (superblocks, commit records) so it no
    /// longer loads; refused while a cache or any claim holds the device, and on a device
    /// without hybridcache metadata unless `force`.
    ZeroMetadata {
        device: String,
        #[serde(default)]
        force: bool,
    },
    /// `--script --check-cache-device -d DEV`: whether the device holds a hybridcache cache,
    /// stopped cleanly or not, with dirty data or not. Result: [`CacheDeviceCheck`].
    CheckCacheDevice {
        device: String,
    },
    /// `--script --add-core --try-add -i ID -j CORE --core-device DEV`: attach a core the
    /// running cache records as inactive, or, when the cache does not run, keep the device in
    /// the core pool until it does.
    TryAddCore {
        cache: u16,
        core: u16,
        device: String,
    },
    /// casctl's `start`: load every cache of the configuration file at `config` (a path the
    /// daemon reads: TOML or opencas.conf). Result: `{caches: [{id, device, loaded, why?}],
    /// running: [id]}`.
    CasctlStart {
        config: String,
    },
    /// `--script --add-core --update-path`: record a new path of an active core's device.
    UpdateCorePath {
        cache: u16,
        core: u16,
        device: String,
    },
    /// `--remove-detached -d DEV`: take a device out of the core pool.
    RemoveDetached {
        device: String,
    },
    /// `--attach-mirror -i ID -d DEV [--force]`: rebuild a mirrored cache's lost mirror onto
    /// DEV, or give a cache without a mirror its first, while clients are served. Result:
    /// [`MirrorAttached`].
    AttachMirror {
        cache: u16,
        device: String,
        force: bool,
    },
    /// `--script --purge-cache -i ID`: flush the cache, then invalidate every line it holds.
    /// Result: [`Purged`].
    PurgeCache {
        cache: u16,
    },
    /// `--script --purge-core -i ID -j CORE`: flush one core, then invalidate its lines.
    /// Result: [`Purged`].
    PurgeCore {
        cache: u16,
        core: u16,
    },
    /// Stop the daemon as SIGTERM would (flush every cache, remove the sockets). The reply
    /// ([`Stopped`]) comes once every cache is stopped.
    Shutdown,
    /// Record every request on the exported volume(s) of a core (or of every active core) to a
    /// blkparse-format file (trace.rs). Result: [`TraceInfo`].
    TraceStart {
        cache: u16,
        #[serde(default)]
        core: Option<u16>,
        /// Absolute path, opened by the daemon.
        file: String,
        /// Stop recording when the file reaches this many bytes.
        #[serde(default)]
        max_size: Option<u64>,
    },
    /// End the traces of a cache (or the one of `core`). Result: [`TraceList`] of the stopped.
    TraceStop {
        cache: u16,
        #[serde(default)]
        core: Option<u16>,
    },
    /// Result: [`TraceList`] of every trace, recording or ended but not yet stopped.
    TraceStatus,
    /// The running setup in the configuration file's format (`config export`). Result:
    /// `{"toml": TEXT}`. The daemon writes no file: the CLI writes where the operator says.
    ExportConfig,
}

/// The reply to one request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Response {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub result: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Response {
    pub fn ok(result: serde_json::Value) -> Response {
        Response {
            ok: true,
            result: Some(result),
            error: None,
        }
    }

    pub fn err(message: impl Into<String>) -> Response {
        // Keep the promise of one line per message, whatever the error text holds.
        let message: String = message.into();
        Response {
            ok: false,
            result: None,
            error: Some(message.replace('\n', " ")),
        }
    }
}

/// Result of `start-cache`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Started {
    pub id: u16,
    /// Loaded from the device (`--load`, or a configuration file naming a device with a cache).
    #[serde(default)]
    pub loaded: bool,
    /// Cores of a loaded cache whose device was missing: inactive until attached again.
    #[serde(default)]
    pub inactive: Vec<u16>,
    /// Why an inactive core is, where that is more than a missing device (it cannot be
    /// opened, or it is not the device the core was added as), by core id.
    #[serde(default)]
    pub why_inactive: std::collections::BTreeMap<u16, String>,
    /// A new mirrored cache: what its mirror covers, as the operator reads it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror: Option<String>,
}

/// Result of `add-core`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CoreAdded {
    pub cache: u16,
    pub core: u16,
    pub export: String,
    /// An inactive core brought back rather than a new core.
    #[serde(default)]
    pub reattached: bool,
    /// The block device serving it (`/dev/ublkbN`), for front-ends that make one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_device: Option<String>,
}

/// Result of `list`.
/// Result of `shutdown`, sent once the daemon has stopped every cache.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Stopped {
    /// Every cache's dirty data was flushed.
    pub clean: bool,
    /// Caches that were running.
    pub caches: usize,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CacheList {
    pub caches: Vec<CacheInfo>,
    /// Devices in the core pool (`--try-add` before their cache runs), listed by `-L` as casadm
    /// lists them.
    #[serde(default)]
    pub core_pool: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CacheInfo {
    pub id: u16,
    pub device: String,
    pub status: String,
    pub mode: String,
    pub line_size_kib: u32,
    pub lines: u64,
    /// Cleaning and promotion policy names, as `-P` shows them.
    #[serde(default)]
    pub cleaning: String,
    #[serde(default)]
    pub promotion: String,
    /// `on` or `off`, and the prefetch policy name (empty from older daemons).
    #[serde(default)]
    pub lazy_flush: String,
    #[serde(default)]
    pub prefetch: String,
    pub cores: Vec<CoreInfo>,
    /// Set while a flush runs (`-F`, a mode switch that flushes, a stop).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flush: Option<FlushInfo>,
    /// Seconds since the cache last went from clean to dirty; None while clean.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dirty_for_s: Option<u64>,
    /// Cores whose device is missing (inactive or waiting for their device).
    #[serde(default)]
    pub inactive_cores: usize,
    /// Bytes of RAM the cache's metadata takes (`-P`'s Metadata Memory Footprint).
    #[serde(default)]
    pub metadata_bytes: u64,
    /// A mirrored cache's mirror and whether the cache is still redundant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mirror: Option<MirrorInfo>,
    /// Fallback pass-through's errors and the dirty data found unreadable: set while the
    /// fallback is in force or some dirty data could not be read (engine fallback.rs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback: Option<FallbackInfo>,
}

/// Fallback pass-through as `-L` and `-P` show it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FallbackInfo {
    /// New I/O goes pass-through.
    pub active: bool,
    /// Cache-device errors counted in the window, and the threshold and window set.
    pub errors: u64,
    pub threshold: u32,
    pub window_s: u32,
    /// Dirty lines with data whose read from the cache device failed, and those bytes.
    pub unreadable_dirty_lines: u64,
    pub unreadable_dirty_bytes: u64,
}

impl FallbackInfo {
    pub fn of(s: &hybridcache_engine::FallbackStatus) -> Option<FallbackInfo> {
        (s.active || s.unreadable_dirty_lines > 0).then_some(FallbackInfo {
            active: s.active,
            errors: s.errors,
            threshold: s.params.threshold,
            window_s: s.params.window_s,
            unreadable_dirty_lines: s.unreadable_dirty_lines,
            unreadable_dirty_bytes: s.unreadable_dirty_bytes,
        })
    }
}

/// A mirrored cache's mirror, as `-L` and `-P` show it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct MirrorInfo {
    pub device: String,
    /// `redundant`, `primary lost`, `mirror lost`, `rebuilding` or `rebuilding primary`.
    pub state: String,
    /// `mirror_lost`: `drain` or `keep`.
    pub mirror_lost: String,
    /// Why the cache is no longer redundant: the failed operation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// While rebuilding (`--attach-mirror`, or `--attach-cache` of a new primary): dirty lines
    /// copied, and how many there were.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rebuild: Option<(u64, u64)>,
    /// The cache lines the mirror covers (all of them, or the first ones of a smaller
    /// mirror: every dirty line is kept among them), and how many of them are dirty.
    #[serde(default)]
    pub lines: u64,
    #[serde(default)]
    pub dirty_lines: u64,
    /// The bytes the mirror must hold: the metadata and the lines it covers.
    #[serde(default)]
    pub bytes: u64,
}

/// How far a running flush has got.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct FlushInfo {
    pub percent: f64,
    pub total_lines: u64,
    /// Lines done: cleaned by the flush, or found clean already.
    pub done_lines: u64,
    /// Lines the flush wrote to the core and marked clean so far.
    #[serde(default)]
    pub cleaned_lines: u64,
    /// `done_lines` and `total_lines` in bytes.
    #[serde(default)]
    pub done_bytes: u64,
    #[serde(default)]
    pub total_bytes: u64,
    pub elapsed_s: f64,
    /// Bytes written per second so far.
    pub bytes_per_s: f64,
    /// Seconds left at the rate so far; None until something was written.
    pub eta_s: Option<f64>,
    /// "wb->wt" while a mode switch flushes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mode_change: Option<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CoreInfo {
    pub id: u16,
    pub device: String,
    pub size: u64,
    pub status: String,
    /// NBD export name (`cas<cache>-<core>`).
    pub export: String,
    /// Clients holding the export: NBD connections, or 1 while a ublk device is held
    /// (mounted or opened exclusively).
    #[serde(default)]
    pub clients: usize,
    /// The front-end serving the export ("nbd", "ublk").
    #[serde(default)]
    pub frontend: String,
    /// The block device clients open (`/dev/ublkbN`), for front-ends that make one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_device: Option<String>,
    /// Seconds since the core last went from clean to dirty; None while clean.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dirty_for_s: Option<u64>,
    /// The core's sequential cutoff threshold in KiB and its policy (`always`, `full`,
    /// `never`); None where the daemon does not know them (a cache not running).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_cutoff_threshold_kib: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_cutoff_policy: Option<String>,
}

/// Result of `stats`: what the statistics describe plus the raw counters.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct StatsReport {
    pub cache: CacheInfo,
    /// Set when the statistics are of one core.
    pub core: Option<CoreInfo>,
    /// Set when the statistics are of one IO class.
    #[serde(default)]
    pub io_class: Option<IoClassInfo>,
    pub stats: StatsData,
    /// Request latency percentiles (none for IO class statistics).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub latency: Vec<LatencyRow>,
    /// What cleaning and flushes have written (cache statistics only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cleaning: Option<CleaningData>,
    /// Lines of the cache's inactive cores (cache statistics only, while it has some):
    /// casadm's "Inactive usage statistics".
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub inactive: Option<InactiveUsage>,
}

/// Lines held by cores whose device was missing at load, in cache lines.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct InactiveUsage {
    pub occupancy_lines: u64,
    pub dirty_lines: u64,
}

/// Counters of the cache's cleaning (background cleaning and flushes together).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CleaningData {
    pub cleaned_lines: u64,
    pub core_writes: u64,
    pub core_write_bytes: u64,
}

/// Latency of one kind of request, in microseconds (percentiles are bucket upper bounds, within
/// 12.5% of the true value). `None` where no request of the kind completed.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct LatencyRow {
    /// "read", "read from cache", "read from core", "write", ...
    pub name: String,
    /// Machine name: `read`, `read_cache`, `read_core`, `write`, `write_cache`, `write_core`.
    pub key: String,
    pub count: u64,
    pub mean_us: Option<f64>,
    pub p50_us: Option<f64>,
    pub p99_us: Option<f64>,
    pub p999_us: Option<f64>,
    pub p9999_us: Option<f64>,
}

impl LatencyRow {
    fn of(key: &str, name: &str, h: &hybridcache_engine::Histogram) -> LatencyRow {
        let count = h.count();
        let us = |q: f64| h.quantile(q).map(|ns| ns as f64 / 1000.0);
        LatencyRow {
            name: name.into(),
            key: key.into(),
            count,
            mean_us: (count > 0).then(|| h.sum_ns as f64 / count as f64 / 1000.0),
            p50_us: us(0.5),
            p99_us: us(0.99),
            p999_us: us(0.999),
            p9999_us: us(0.9999),
        }
    }

    /// The rows `-P` shows: reads and writes, each in all and split by what served them.
    pub fn rows(l: &hybridcache_engine::LatencyStats) -> Vec<LatencyRow> {
        use hybridcache_engine::LatencyKind as K;
        vec![
            LatencyRow::of("read", "Reads", &l.direction(true)),
            LatencyRow::of(
                "read_cache",
                "Reads served by the cache",
                l.get(K::ReadCache),
            ),
            LatencyRow::of("read_core", "Reads that read the core", l.get(K::ReadCore)),
            LatencyRow::of("write", "Writes", &l.direction(false)),
            LatencyRow::of(
                "write_cache",
                "Writes served by the cache",
                l.get(K::WriteCache),
            ),
            LatencyRow::of(
                "write_core",
                "Writes that waited for the core",
                l.get(K::WriteCore),
            ),
        ]
    }
}

/// One IO class as `-C -L` lists it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct IoClassInfo {
    pub id: u8,
    pub name: String,
    /// 0..255, or "Pinned".
    pub eviction_priority: String,
    /// 0.00..1.00.
    pub allocation: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct IoClassList {
    pub classes: Vec<IoClassInfo>,
}

/// Mirror of the engine's `Stats`, in the engine's units (lines and bytes).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsData {
    pub line_size: u32,
    pub total_lines: u64,
    pub occupancy_lines: u64,
    pub free_lines: u64,
    pub dirty_lines: u64,
    pub read_hits: u64,
    pub read_partial_misses: u64,
    pub read_full_misses: u64,
    pub write_hits: u64,
    pub write_partial_misses: u64,
    pub write_full_misses: u64,
    pub pass_through_reads: u64,
    pub pass_through_writes: u64,
    /// Missing in replies of older daemons.
    #[serde(default)]
    pub lazy_flush_writes: u64,
    #[serde(default)]
    pub lazy_flush_bytes: u64,
    #[serde(default)]
    pub prefetch_requests: u64,
    #[serde(default)]
    pub prefetch_read_bytes: u64,
    #[serde(default)]
    pub prefetch_hits: u64,
    #[serde(default)]
    pub offload_reads: u64,
    #[serde(default)]
    pub offload_writes: u64,
    /// Read and write hits that waited for another request's line locks (part of `read_hits`
    /// and `write_hits`; casadm's "Read deferred" and "Write deferred").
    #[serde(default)]
    pub read_deferred: u64,
    #[serde(default)]
    pub write_deferred: u64,
    /// Bytes read-ahead wrote to the cache (part of `cache_written_bytes`).
    #[serde(default)]
    pub prefetch_written_bytes: u64,
    /// The cleaner's core writes, the bytes it read from the cache and wrote to the core.
    #[serde(default)]
    pub cleaner_requests: u64,
    #[serde(default)]
    pub cleaner_cache_read_bytes: u64,
    #[serde(default)]
    pub cleaner_core_written_bytes: u64,
    /// Write hits whose data reached the cache device in one submission with other requests'.
    #[serde(default)]
    pub write_hits_batched: u64,
    pub core_read_bytes: u64,
    pub core_written_bytes: u64,
    pub cache_read_bytes: u64,
    pub cache_written_bytes: u64,
    pub exported_read_bytes: u64,
    pub exported_written_bytes: u64,
    pub cache_read_errors: u64,
    pub cache_write_errors: u64,
    pub core_read_errors: u64,
    pub core_write_errors: u64,
}

impl From<hybridcache_engine::Stats> for StatsData {
    fn from(s: hybridcache_engine::Stats) -> Self {
        StatsData {
            line_size: s.usage.line_size,
            total_lines: s.usage.total_lines,
            occupancy_lines: s.usage.occupancy_lines,
            free_lines: s.usage.free_lines,
            dirty_lines: s.usage.dirty_lines,
            read_hits: s.requests.read_hits,
            read_partial_misses: s.requests.read_partial_misses,
            read_full_misses: s.requests.read_full_misses,
            write_hits: s.requests.write_hits,
            write_partial_misses: s.requests.write_partial_misses,
            write_full_misses: s.requests.write_full_misses,
            pass_through_reads: s.requests.pass_through_reads,
            pass_through_writes: s.requests.pass_through_writes,
            lazy_flush_writes: s.requests.lazy_flush_writes,
            lazy_flush_bytes: s.blocks.lazy_flush_bytes,
            prefetch_requests: s.requests.prefetch_requests,
            prefetch_read_bytes: s.blocks.prefetch_read_bytes,
            prefetch_hits: s.requests.prefetch_hits,
            offload_reads: s.requests.offload_reads,
            offload_writes: s.requests.offload_writes,
            read_deferred: s.requests.read_deferred,
            write_deferred: s.requests.write_deferred,
            prefetch_written_bytes: s.blocks.prefetch_written_bytes,
            cleaner_requests: s.requests.cleaner_requests,
            write_hits_batched: s.requests.write_hits_batched,
            cleaner_cache_read_bytes: s.blocks.cleaner_cache_read_bytes,
            cleaner_core_written_bytes: s.blocks.cleaner_core_written_bytes,
            core_read_bytes: s.blocks.core_read_bytes,
            core_written_bytes: s.blocks.core_written_bytes,
            cache_read_bytes: s.blocks.cache_read_bytes,
            cache_written_bytes: s.blocks.cache_written_bytes,
            exported_read_bytes: s.blocks.exported_read_bytes,
            exported_written_bytes: s.blocks.exported_written_bytes,
            cache_read_errors: s.errors.cache_read,
            cache_write_errors: s.errors.cache_write,
            core_read_errors: s.errors.core_read,
            core_write_errors: s.errors.core_write,
        }
    }
}

/// Result of `get-param`: a group's fields, for the cache or for each core.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ParamValue {
    pub name: String,
    /// The first field's value (the whole value of single-field groups such as cache-mode).
    pub value: String,
    pub read_only: bool,
    pub fields: Vec<ParamField>,
    /// Per-core groups: one entry per core (then `fields` is empty).
    #[serde(default)]
    pub cores: Vec<CoreParams>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ParamField {
    pub key: String,
    pub label: String,
    pub value: String,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CoreParams {
    pub core: u16,
    pub fields: Vec<ParamField>,
}

/// One trace (`trace-start`, `trace-stop`, `trace-status`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TraceInfo {
    pub cache: u16,
    /// None: every active core of the cache.
    pub core: Option<u16>,
    /// The traced NBD exports.
    pub exports: Vec<String>,
    pub file: String,
    pub max_size: Option<u64>,
    /// `recording`, or `ended: <why>` (max size reached, core removed, cache stopped, ...).
    pub state: String,
    /// Events written to the file so far, and their bytes.
    pub events: u64,
    pub bytes: u64,
    /// Events lost because the writer fell behind.
    pub dropped: u64,
    pub seconds: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TraceList {
    pub traces: Vec<TraceInfo>,
}

/// Result of `version`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct VersionInfo {
    pub version: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_defaults_apply() {
        let r: Request =
            serde_json::from_str(r#"{"cmd":"start-cache","device":"ram:1G"}"#).unwrap();
        assert_eq!(
            r,
            Request::StartCache {
                device: "ram:1G".into(),
                id: None,
                mode: None,
                line_size_kib: None,
                force: false,
                load: false,
                mirror: None,
                load_mirror: false,
                mirror_lost: None,
                fallback_pt_threshold: None,
                fallback_pt_window: None,
            }
        );
        let line = serde_json::to_string(&Request::Flush {
            cache: 1,
            core: Some(2),
        })
        .unwrap();
        assert_eq!(line, r#"{"cmd":"flush","cache":1,"core":2}"#);
        assert!(serde_json::from_str::<Request>(r#"{"cmd":"explode"}"#).is_err());
    }

    #[test]
    fn error_responses_are_one_line() {
        let r = Response::err("a\nb");
        assert_eq!(r.error.as_deref(), Some("a b"));
    }
}

/// Result of [`Request::ConnectCache`].
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Connected {
    pub id: u16,
    /// True: the cache the device holds was loaded; false: a new cache was started on it with
    /// the disconnected cache's settings and cores.
    pub loaded: bool,
}

/// Result of [`Request::CheckCacheDevice`]; casadm prints it as `Is cache,Clean Shutdown,Cache
/// dirty`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CacheDeviceCheck {
    pub is_cache: bool,
    /// The cache id its superblock records (None when it is no cache).
    #[serde(default)]
    pub cache_id: Option<u16>,
    /// Stopped with its clean-shutdown mark (not after a crash or a kill).
    #[serde(default)]
    pub clean_shutdown: Option<bool>,
    #[serde(default)]
    pub dirty_lines: u64,
    #[serde(default)]
    pub dirty_bytes: u64,
}

/// Result of [`Request::AttachMirror`]: what the rebuild copied onto the new mirror.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct MirrorAttached {
    pub cache: u16,
    pub device: String,
    /// Dirty lines copied from the primary, and their dirty bytes.
    pub dirty_lines: u64,
    pub dirty_bytes: u64,
    pub seconds: f64,
    /// The cache had no mirror before (not a lost one replaced).
    #[serde(default)]
    pub first: bool,
}

/// Result of [`Request::ConnectCache`] (`--attach-cache`) on a mirrored cache whose primary is
/// lost: what was copied from the mirror onto the new primary.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct PrimaryAttached {
    pub cache: u16,
    /// The new primary.
    pub device: String,
    /// The mirror the dirty lines were copied from.
    pub mirror: String,
    /// Dirty lines copied from the mirror, and their dirty bytes.
    pub dirty_lines: u64,
    pub dirty_bytes: u64,
    pub seconds: f64,
}

/// Result of [`Request::PurgeCache`] and [`Request::PurgeCore`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Purged {
    /// Dirty lines written to the core(s) before the invalidation.
    pub flushed_lines: u64,
    /// Lines the cache held (so no longer holds) when the purge began, dirty ones included.
    pub invalidated_lines: u64,
}

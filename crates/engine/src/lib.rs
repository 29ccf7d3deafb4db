//! The cache engine: a fast cache volume in front of one or more slow core volumes.
//!
//! Job: map core lines to cache lines, route every request by the cache mode (wt, wb, wa, wi, wo,
//! pt), track validity and dirtiness per 512-byte sector, evict clean lines in LRU order, clean
//! dirty lines to the cores (sorted by core address, merged into large writes), and count what
//! happened. Each attached core is served as its own exported volume ([`Core`]).
//!
//! Boundaries: the engine sees devices only through [`hybridcache_volume::Volume`]; it knows
//! nothing of NBD, sockets, the CLI or configuration files. It is a library: callers bring their
//! own threads, and every request runs to completion on the calling thread.
//!
//! Concurrency, in short (details in `cache.rs`): requests lock the core lines they touch through
//! a table of striped locks, always in ascending stripe order, so overlapping requests run in some
//! serial order and disjoint ones run in parallel. There is no global lock on the request path.
//! Writes around the cache (lazy flush's part of a write-back write among them) and cleaning do
//! not hold their stripes across the core write: they mark the core lines they cover, and only
//! requests for those lines wait (`locks.rs`).

mod admission;
pub mod bench;
mod bits;
mod cache;
mod classes;
mod cleaner;
mod cleaning;
mod cleaning_state;
mod commit;
mod core_detach;
mod core_flush;
mod core_state;
mod create;
mod devices;
mod exported;
pub mod fallback;
mod format;
mod inner;
mod invalidate;
pub mod ioclass;
mod ioclass_file;
pub mod latency;
mod lines;
mod lists;
mod locks;
mod meta;
mod mirror;
mod mirror_status;
pub mod offload;
mod pair_io;
mod persist;
pub mod policy;
mod prefetch;
mod progress;
mod read;
mod readahead;
mod recovery;
mod restore;
mod room_wait;
mod segment;
mod settings;
mod stats;
mod window;
mod write;
mod write_batch;

pub use cache::{Cache, CoreInfo, CoreStatus};
pub use cleaning_state::{CleaningStats, CleaningTick, WRITE_SIZE_BUCKETS};
pub use core_flush::{core_flush_timeout, set_core_flush_timeout, DEFAULT_CORE_FLUSH_TIMEOUT};
pub use exported::Core;
pub use fallback::{FallbackPt, FallbackStatus, UnreadableDirty};
pub use format::{holds_metadata, zero_metadata, CoreRecord, MirrorRecord, Superblock};
pub use latency::{Histogram, LatencyKind, LatencyStats};
pub use mirror::{MirrorLostPolicy, MirrorState, MirrorStatus};
pub use offload::Offload;
pub use persist::{read_summary, MetadataSummary};
pub use policy::{
    AcpParams, AlruParams, CleaningConfig, CleaningIo, CleaningPolicy, LazyFlush, Prefetch,
    PrefetchPolicy, Promotion, PromotionPolicy, SeqCutoff, SeqCutoffPolicy,
};
pub use progress::FlushStatus;
pub use restore::set_load_threads;
pub use stats::{
    BackgroundErrors, BlockStats, DeviceFault, ErrorStats, RequestStats, Stats, Usage,
};

use std::fmt;
use std::str::FromStr;

use hybridcache_volume::VolumeError;

/// Sector size: the unit of validity and dirtiness, and the alignment every request needs.
pub const SECTOR: u64 = 512;

/// The checks every request to a core of `size` bytes passes before it is served: sector
/// alignment, at most `max` bytes (when given), and within the core. The engine makes them on
/// each request; a front-end that serves a core without the engine (pass-through while a cache
/// is disconnected) makes the same, so clients see the same refusals on either path.
pub fn check_request(size: u64, offset: u64, len: u64, max: Option<u64>) -> Result<()> {
    if offset % SECTOR != 0 || len % SECTOR != 0 {
        return Err(EngineError::Unaligned { offset, len });
    }
    if let Some(max) = max {
        if len > max {
            return Err(EngineError::TooLarge { len, max });
        }
    }
    match offset.checked_add(len) {
        Some(end) if end <= size => Ok(()),
        _ => Err(EngineError::OutOfRange { offset, len, size }),
    }
}
/// The largest request the engine serves in one piece (NBD's usual maximum).
pub const MAX_REQUEST: u64 = 32 << 20;
/// The highest core id (`OCF_CORE_ID_MAX`); ids start at 0 (`OCF_CORE_ID_MIN`), as casadm's.
pub const MAX_CORE_ID: u32 = 4095;
/// The largest number of cores one cache can serve: one per id, 0 included.
pub const MAX_CORES: u32 = MAX_CORE_ID + 1;

/// How the cache treats reads and writes (domain.md §3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CacheMode {
    /// Write-through: writes go to core and cache, acknowledged after both.
    Wt,
    /// Write-back: writes go to the cache only and are cleaned to the core later.
    Wb,
    /// Write-around: writes go to the core; mapped lines are updated, nothing is inserted.
    Wa,
    /// Write-invalidate: writes go to the core; mapped sectors are invalidated.
    Wi,
    /// Write-only: writes as write-back; reads come from the core and are never inserted.
    Wo,
    /// Pass-through: everything goes to the core; dirty sectors are still served from the cache.
    Pt,
}

impl CacheMode {
    pub const ALL: [CacheMode; 6] = [
        CacheMode::Wt,
        CacheMode::Wb,
        CacheMode::Wa,
        CacheMode::Wi,
        CacheMode::Wo,
        CacheMode::Pt,
    ];

    /// Whether writes in this mode create dirty data.
    pub fn makes_dirty(self) -> bool {
        matches!(self, CacheMode::Wb | CacheMode::Wo)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            CacheMode::Wt => "wt",
            CacheMode::Wb => "wb",
            CacheMode::Wa => "wa",
            CacheMode::Wi => "wi",
            CacheMode::Wo => "wo",
            CacheMode::Pt => "pt",
        }
    }

    /// The long name casadm prints.
    pub fn long_name(self) -> &'static str {
        match self {
            CacheMode::Wt => "write-through",
            CacheMode::Wb => "write-back",
            CacheMode::Wa => "write-around",
            CacheMode::Wi => "write-invalidate",
            CacheMode::Wo => "write-only",
            CacheMode::Pt => "pass-through",
        }
    }
}

impl fmt::Display for CacheMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CacheMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        CacheMode::ALL
            .into_iter()
            .find(|m| m.as_str() == s || m.long_name() == s)
            .ok_or_else(|| format!("unknown cache mode '{s}' (expected wt, wb, wa, wi, wo or pt)"))
    }
}

/// Cache line size: 4, 8, 16, 32 or 64 KiB, fixed when the cache is created.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LineSize(u32);

impl LineSize {
    pub const ALL_KIB: [u32; 5] = [4, 8, 16, 32, 64];

    pub fn from_kib(kib: u32) -> std::result::Result<LineSize, String> {
        if Self::ALL_KIB.contains(&kib) {
            Ok(LineSize(kib * 1024))
        } else {
            Err(format!(
                "cache line size {kib} KiB is not supported (expected 4, 8, 16, 32 or 64)"
            ))
        }
    }

    pub fn bytes(self) -> u32 {
        self.0
    }

    pub fn kib(self) -> u32 {
        self.0 / 1024
    }

    pub fn sectors(self) -> u32 {
        self.0 / SECTOR as u32
    }
}

impl Default for LineSize {
    fn default() -> Self {
        LineSize(4096)
    }
}

/// What a new cache starts with.
#[derive(Debug, Clone)]
pub struct CacheConfig {
    /// Cache id, as `casadm -i` (1..=16384).
    pub id: u16,
    pub line_size: LineSize,
    pub mode: CacheMode,
}

impl Default for CacheConfig {
    fn default() -> Self {
        CacheConfig {
            id: 1,
            line_size: LineSize::default(),
            // Open CAS starts in write-through; so do we.
            mode: CacheMode::Wt,
        }
    }
}

/// Identity of a core within its cache (casadm's `-j`).
pub type CoreId = u16;

/// Everything the engine can refuse or fail with.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("request at offset {offset} of {len} bytes is not aligned to 512-byte sectors")]
    Unaligned { offset: u64, len: u64 },
    #[error(
        "request at offset {offset} of {len} bytes ends past the end of the core ({size} bytes)"
    )]
    OutOfRange { offset: u64, len: u64, size: u64 },
    #[error("request of {len} bytes is larger than the {max} bytes the engine serves at once")]
    TooLarge { len: u64, max: u64 },
    #[error("the cache volume holds {bytes} bytes, too small for even one cache line of {line} bytes plus metadata")]
    CacheTooSmall { bytes: u64, line: u32 },
    #[error("core {0} does not exist in this cache")]
    NoSuchCore(CoreId),
    #[error("core id {0} is already in use in this cache")]
    DuplicateCore(CoreId),
    #[error("core id {0} is out of range (0..={MAX_CORE_ID})")]
    BadCoreId(u32),
    #[error("this cache already serves {MAX_CORES} cores")]
    TooManyCores,
    #[error("core {id} has {dirty_lines} dirty cache lines; flush it first or force the removal (the dirty data is then lost)")]
    CoreDirty { id: CoreId, dirty_lines: u64 },
    #[error("core {0} was removed")]
    CoreRemoved(CoreId),
    #[error("{0}")]
    Volume(#[from] VolumeError),
    #[error("the cache volume holds cache {id} (uuid {uuid}, {line_kib} KiB lines, cores: {cores}); load it, or force a new cache to overwrite it")]
    ExistingCache {
        id: u16,
        uuid: String,
        line_kib: u32,
        cores: String,
    },
    #[error("the cache volume holds a damaged hybridcache superblock ({0}); force a new cache to overwrite it")]
    DamagedSuperblock(String),
    #[error("the cache volume holds a cache made by a newer hybridcache (format {found}); this build reads formats {oldest} to {newest}: load it with that newer build (nothing was written)")]
    NewerFormat {
        found: u32,
        oldest: u32,
        newest: u32,
    },
    #[error("no hybridcache cache found on {0}")]
    NoCache(String),
    #[error("corrupt cache metadata: {0}; the cache was not loaded and nothing was written")]
    Corrupt(String),
    #[error("core {id}: {why}")]
    CoreMismatch { id: CoreId, why: String },
    #[error("core {0} is inactive (its device was missing at load); attach it again first")]
    CoreInactive(CoreId),
    #[error("the cache is stopped")]
    Stopped,
    /// Counted over every flush of the cache that ran at the time (usually just the one).
    #[error("the flush was interrupted after cleaning {cleaned_lines} of {total_lines} dirty lines; the lines not yet written stay dirty")]
    FlushInterrupted {
        cleaned_lines: u64,
        total_lines: u64,
    },
    /// A core's device hung: the flush stopped waiting for it and its lines stay dirty.
    #[error(
        "core {core}: flush timed out after {after} ({what}); its dirty lines stay in the cache"
    )]
    CoreFlushTimedOut {
        core: CoreId,
        after: String,
        what: &'static str,
    },
    /// A flush of several cores of which some failed: each core's result, in core order.
    #[error("{}", core_flush::results_text(.0))]
    CoreFlushes(Vec<(CoreId, Option<String>)>),
    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, EngineError>;

//! Statistics: what an operator reads after every benchmark (domain.md §8).

/// Cache occupancy, in cache lines (see the methods for 4 KiB blocks and percentages).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    pub line_size: u32,
    /// Lines in the whole cache.
    pub total_lines: u64,
    /// Lines mapped (to this core, for core statistics).
    pub occupancy_lines: u64,
    /// Lines not mapped to any core (cache-wide).
    pub free_lines: u64,
    /// Mapped lines with at least one dirty sector.
    pub dirty_lines: u64,
}

impl Usage {
    pub fn clean_lines(&self) -> u64 {
        self.occupancy_lines - self.dirty_lines
    }
}

/// Request counts by how the cache served them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RequestStats {
    /// Every read served whole from the cache, deferred or not.
    pub read_hits: u64,
    /// Read hits that waited for another request's line locks before they could be served
    /// (Open CAS's "deferred": a hit whose cache line locks were not granted at once). A subset
    /// of `read_hits`; a miss that waits stays a miss, as in Open CAS.
    pub read_deferred: u64,
    pub read_partial_misses: u64,
    pub read_full_misses: u64,
    /// Every write whose sectors all had a cache line, deferred or not.
    pub write_hits: u64,
    /// Write hits that waited for another request's line locks (a subset of `write_hits`).
    pub write_deferred: u64,
    pub write_partial_misses: u64,
    pub write_full_misses: u64,
    pub pass_through_reads: u64,
    pub pass_through_writes: u64,
    /// Write requests of which lazy flush sent some part to the core because no clean or free
    /// line was at hand (they are also counted as write hits or misses above).
    pub lazy_flush_writes: u64,
    /// Read-ahead requests issued to the core by the prefetch worker (not client requests, so
    /// not in the totals).
    pub prefetch_requests: u64,
    /// Cache lines filled by prefetch that a client read later hit (counted once per line).
    pub prefetch_hits: u64,
    /// Clean read hits offload served from the core (also counted as pass-through reads).
    pub offload_reads: u64,
    /// Write misses offload sent to the core (also counted as pass-through writes).
    pub offload_writes: u64,
    /// Core writes of the cleaner (background cleaning, flushes, and a write-back write making
    /// room): internal requests, not in the totals above.
    pub cleaner_requests: u64,
    /// Write hits whose data reached the cache device in one submission with other requests'
    /// (a batch of a pipelining client: `Core::write_batch`); part of `write_hits` and the
    /// partial misses whose lines were all mapped.
    pub write_hits_batched: u64,
}

/// Bytes moved, by device.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct BlockStats {
    pub core_read_bytes: u64,
    pub core_written_bytes: u64,
    pub cache_read_bytes: u64,
    pub cache_written_bytes: u64,
    pub exported_read_bytes: u64,
    pub exported_written_bytes: u64,
    /// Bytes lazy flush wrote to the core (part of `core_written_bytes`).
    pub lazy_flush_bytes: u64,
    /// Bytes prefetch read from the core (part of `core_read_bytes`).
    pub prefetch_read_bytes: u64,
    /// Bytes prefetch wrote to the cache (part of `cache_written_bytes`).
    pub prefetch_written_bytes: u64,
    /// Bytes the cleaner read from the cache (part of `cache_read_bytes`) and wrote to the core
    /// (part of `core_written_bytes`).
    pub cleaner_cache_read_bytes: u64,
    pub cleaner_core_written_bytes: u64,
}

/// Failed device operations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ErrorStats {
    pub cache_read: u64,
    pub cache_write: u64,
    pub core_read: u64,
    pub core_write: u64,
}

/// A failed device operation of background work (cleaning, read-ahead): no client request
/// waits for it, so nobody else would report it. The engine keeps the last one for the daemon
/// to log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceFault {
    pub core: crate::CoreId,
    /// What failed: "read", "write", ...
    pub op: String,
    /// The device as its volume names it.
    pub device: String,
    pub offset: u64,
    pub len: u64,
    pub error: String,
}

/// The device errors of one kind of background work, since the cache started (not reset with
/// the statistics).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BackgroundErrors {
    pub count: u64,
    pub last: Option<DeviceFault>,
}

/// Where background work records its device errors; only the error path takes the lock.
#[derive(Default)]
pub(crate) struct BackgroundErrorLog(parking_lot::Mutex<BackgroundErrors>);

impl BackgroundErrorLog {
    /// Record `e` if it is a device error (other errors, such as a removed core, are no fault
    /// of a device).
    pub(crate) fn record(&self, core: crate::CoreId, e: &crate::EngineError) {
        if let crate::EngineError::Volume(v) = e {
            let mut log = self.0.lock();
            log.count += 1;
            log.last = Some(DeviceFault {
                core,
                op: v.op.to_string(),
                device: v.device.clone(),
                offset: v.offset,
                len: v.len,
                error: v.kind.to_string(),
            });
        }
    }

    pub(crate) fn snapshot(&self) -> BackgroundErrors {
        self.0.lock().clone()
    }
}

/// A snapshot of statistics for a cache or one core.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    pub usage: Usage,
    pub requests: RequestStats,
    pub blocks: BlockStats,
    pub errors: ErrorStats,
}

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};

/// Each thread updates its own slot (modulo [`SLOTS`]) so that counting does not bounce one cache
/// line between cores; a snapshot sums the slots.
pub(crate) const SLOTS: usize = 16;

/// Index of the calling thread's slot, stable for the thread's life.
pub(crate) fn thread_slot() -> usize {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    thread_local!(static SLOT: Cell<usize> = const { Cell::new(usize::MAX) });
    SLOT.with(|s| {
        if s.get() == usize::MAX {
            s.set(NEXT.fetch_add(1, Relaxed));
        }
        s.get()
    })
}

#[derive(Debug, Clone, Copy)]
pub(crate) enum Counter {
    ReadHits,
    ReadPartialMisses,
    ReadFullMisses,
    WriteHits,
    WritePartialMisses,
    WriteFullMisses,
    PassThroughReads,
    PassThroughWrites,
    CoreReadBytes,
    CoreWrittenBytes,
    CacheReadBytes,
    CacheWrittenBytes,
    ExportedReadBytes,
    ExportedWrittenBytes,
    CacheReadErrors,
    CacheWriteErrors,
    CoreReadErrors,
    CoreWriteErrors,
    LazyFlushWrites,
    LazyFlushBytes,
    PrefetchRequests,
    PrefetchHits,
    PrefetchReadBytes,
    OffloadReads,
    OffloadWrites,
    ReadDeferred,
    WriteDeferred,
    PrefetchWrittenBytes,
    CleanerRequests,
    CleanerCacheReadBytes,
    CleanerCoreWrittenBytes,
    WriteHitsBatched,
}
const COUNTERS: usize = Counter::WriteHitsBatched as usize + 1;

#[repr(align(128))]
struct Slot([AtomicU64; COUNTERS]);

pub(crate) struct Counters {
    slots: Box<[Slot]>,
}

impl Counters {
    pub(crate) fn new() -> Counters {
        Counters {
            slots: (0..SLOTS)
                .map(|_| Slot(std::array::from_fn(|_| AtomicU64::new(0))))
                .collect(),
        }
    }

    /// RAM of the counters (their slots).
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> usize {
        std::mem::size_of_val(&*self.slots)
    }

    #[inline]
    pub(crate) fn add(&self, c: Counter, n: u64) {
        if n != 0 {
            self.slots[thread_slot() % SLOTS].0[c as usize].fetch_add(n, Relaxed);
        }
    }

    fn get(&self, c: Counter) -> u64 {
        self.slots
            .iter()
            .map(|s| s.0[c as usize].load(Relaxed))
            .sum()
    }

    pub(crate) fn reset(&self) {
        for s in self.slots.iter() {
            for c in &s.0 {
                c.store(0, Relaxed);
            }
        }
    }

    pub(crate) fn snapshot(&self) -> (RequestStats, BlockStats, ErrorStats) {
        use Counter::*;
        (
            RequestStats {
                read_hits: self.get(ReadHits),
                read_deferred: self.get(ReadDeferred),
                read_partial_misses: self.get(ReadPartialMisses),
                read_full_misses: self.get(ReadFullMisses),
                write_hits: self.get(WriteHits),
                write_deferred: self.get(WriteDeferred),
                write_partial_misses: self.get(WritePartialMisses),
                write_full_misses: self.get(WriteFullMisses),
                pass_through_reads: self.get(PassThroughReads),
                pass_through_writes: self.get(PassThroughWrites),
                lazy_flush_writes: self.get(LazyFlushWrites),
                prefetch_requests: self.get(PrefetchRequests),
                prefetch_hits: self.get(PrefetchHits),
                offload_reads: self.get(OffloadReads),
                offload_writes: self.get(OffloadWrites),
                cleaner_requests: self.get(CleanerRequests),
                write_hits_batched: self.get(WriteHitsBatched),
            },
            BlockStats {
                core_read_bytes: self.get(CoreReadBytes),
                core_written_bytes: self.get(CoreWrittenBytes),
                cache_read_bytes: self.get(CacheReadBytes),
                cache_written_bytes: self.get(CacheWrittenBytes),
                exported_read_bytes: self.get(ExportedReadBytes),
                exported_written_bytes: self.get(ExportedWrittenBytes),
                lazy_flush_bytes: self.get(LazyFlushBytes),
                prefetch_read_bytes: self.get(PrefetchReadBytes),
                prefetch_written_bytes: self.get(PrefetchWrittenBytes),
                cleaner_cache_read_bytes: self.get(CleanerCacheReadBytes),
                cleaner_core_written_bytes: self.get(CleanerCoreWrittenBytes),
            },
            ErrorStats {
                cache_read: self.get(CacheReadErrors),
                cache_write: self.get(CacheWriteErrors),
                core_read: self.get(CoreReadErrors),
                core_write: self.get(CoreWriteErrors),
            },
        )
    }
}

impl RequestStats {
    pub fn reads(&self) -> u64 {
        self.read_hits + self.read_partial_misses + self.read_full_misses + self.pass_through_reads
    }
    pub fn writes(&self) -> u64 {
        self.write_hits
            + self.write_partial_misses
            + self.write_full_misses
            + self.pass_through_writes
    }
    /// Requests the cache served (everything but pass-through).
    pub fn serviced(&self) -> u64 {
        self.total() - self.pass_through_reads - self.pass_through_writes
    }
    pub fn total(&self) -> u64 {
        self.reads() + self.writes()
    }
    pub(crate) fn add(&mut self, o: &RequestStats) {
        self.read_hits += o.read_hits;
        self.read_deferred += o.read_deferred;
        self.read_partial_misses += o.read_partial_misses;
        self.read_full_misses += o.read_full_misses;
        self.write_hits += o.write_hits;
        self.write_deferred += o.write_deferred;
        self.write_partial_misses += o.write_partial_misses;
        self.write_full_misses += o.write_full_misses;
        self.pass_through_reads += o.pass_through_reads;
        self.pass_through_writes += o.pass_through_writes;
        self.lazy_flush_writes += o.lazy_flush_writes;
        self.prefetch_requests += o.prefetch_requests;
        self.prefetch_hits += o.prefetch_hits;
        self.offload_reads += o.offload_reads;
        self.offload_writes += o.offload_writes;
        self.cleaner_requests += o.cleaner_requests;
        self.write_hits_batched += o.write_hits_batched;
    }
}

impl BlockStats {
    pub(crate) fn add(&mut self, o: &BlockStats) {
        self.core_read_bytes += o.core_read_bytes;
        self.core_written_bytes += o.core_written_bytes;
        self.cache_read_bytes += o.cache_read_bytes;
        self.cache_written_bytes += o.cache_written_bytes;
        self.exported_read_bytes += o.exported_read_bytes;
        self.exported_written_bytes += o.exported_written_bytes;
        self.lazy_flush_bytes += o.lazy_flush_bytes;
        self.prefetch_read_bytes += o.prefetch_read_bytes;
        self.prefetch_written_bytes += o.prefetch_written_bytes;
        self.cleaner_cache_read_bytes += o.cleaner_cache_read_bytes;
        self.cleaner_core_written_bytes += o.cleaner_core_written_bytes;
    }
}

impl ErrorStats {
    pub(crate) fn add(&mut self, o: &ErrorStats) {
        self.cache_read += o.cache_read;
        self.cache_write += o.cache_write;
        self.core_read += o.core_read;
        self.core_write += o.core_write;
    }
}

impl Usage {
    /// Lines expressed in 4 KiB blocks, the unit casadm reports.
    pub fn blocks_4k(&self, lines: u64) -> u64 {
        lines * (self.line_size as u64 / 4096)
    }
    /// Share of the whole cache, in percent.
    pub fn percent(&self, lines: u64) -> f64 {
        if self.total_lines == 0 {
            0.0
        } else {
            lines as f64 * 100.0 / self.total_lines as f64
        }
    }
}

pub(crate) fn classify(
    valid_sectors: u64,
    total_sectors: u64,
    hit: Counter,
    partial: Counter,
    full: Counter,
) -> Counter {
    if valid_sectors == total_sectors {
        hit
    } else if valid_sectors == 0 {
        full
    } else {
        partial
    }
}

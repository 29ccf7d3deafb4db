//! Policy parameters: cleaning (nop, alru, acp), sequential cutoff and promotion (always, nhit).
//!
//! Names, units, defaults and ranges are Open CAS's (domain.md §4-6), so that a configuration
//! written for Open CAS means the same here. This module only holds and checks values and the
//! small per-request state the routing decisions need (sequential streams, nhit counters); the
//! engine applies them in `cache.rs` (routing) and `cleaning.rs` (the background cleaner).
//! Everything here is serialised into the superblock's `params`, so a loaded cache keeps it.

use std::fmt;
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crate::{EngineError, Result};

fn check_range(name: &str, value: u64, min: u64, max: u64, unit: &str) -> Result<()> {
    if value < min || value > max {
        let unit = if unit.is_empty() {
            String::new()
        } else {
            format!(" {unit}")
        };
        return Err(EngineError::Invalid(format!(
            "{name} {value} is out of range {min}..{max}{unit}"
        )));
    }
    Ok(())
}

/// Background cleaning policy (domain.md §4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum CleaningPolicy {
    /// No background cleaning: dirty data leaves by flush or when eviction needs a line.
    Nop,
    /// Approximately LRU: clean lines not written for `staleness-time`, when the cache is idle.
    #[default]
    Alru,
    /// Aggressive: clean the dirtiest 100 MiB chunk of the core, busy or not.
    Acp,
}

impl CleaningPolicy {
    pub const ALL: [CleaningPolicy; 3] = [
        CleaningPolicy::Nop,
        CleaningPolicy::Alru,
        CleaningPolicy::Acp,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            CleaningPolicy::Nop => "nop",
            CleaningPolicy::Alru => "alru",
            CleaningPolicy::Acp => "acp",
        }
    }
}

impl fmt::Display for CleaningPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for CleaningPolicy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        CleaningPolicy::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| format!("unknown cleaning policy '{s}' (expected nop, alru or acp)"))
    }
}

/// alru's tunables (`-X -n cleaning-alru`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AlruParams {
    /// Seconds between cleaner runs when there is nothing to do (0..3600).
    pub wake_up_s: u32,
    /// Seconds a dirty line must go unwritten before it is cleaned (1..3600).
    pub staleness_time_s: u32,
    /// Lines cleaned per run: the cleaning queue depth (1..10000).
    pub flush_max_buffers: u32,
    /// Milliseconds without client IO before cleaning starts (0..1000000).
    pub activity_threshold_ms: u32,
    /// Dirty share (%) above which cleaning starts whatever staleness and activity say
    /// (0..100; 100 = off).
    pub dirty_ratio_threshold: u32,
    /// MiB below the threshold at which that forced cleaning stops again.
    pub dirty_ratio_inertia_mib: u32,
}

impl Default for AlruParams {
    fn default() -> Self {
        AlruParams {
            wake_up_s: 20,
            staleness_time_s: 120,
            flush_max_buffers: 100,
            activity_threshold_ms: 10_000,
            dirty_ratio_threshold: 100,
            dirty_ratio_inertia_mib: 128,
        }
    }
}

impl AlruParams {
    pub fn validate(&self) -> Result<()> {
        check_range("wake-up", self.wake_up_s as u64, 0, 3600, "s")?;
        check_range("staleness-time", self.staleness_time_s as u64, 1, 3600, "s")?;
        check_range(
            "flush-max-buffers",
            self.flush_max_buffers as u64,
            1,
            10_000,
            "",
        )?;
        check_range(
            "activity-threshold",
            self.activity_threshold_ms as u64,
            0,
            1_000_000,
            "ms",
        )?;
        check_range(
            "dirty-ratio-threshold",
            self.dirty_ratio_threshold as u64,
            0,
            100,
            "%",
        )?;
        check_range(
            "dirty-ratio-inertia",
            self.dirty_ratio_inertia_mib as u64,
            0,
            u32::MAX as u64 / 2,
            "MiB",
        )
    }
}

/// acp's tunables (`-X -n cleaning-acp`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct AcpParams {
    /// Milliseconds the cleaner sleeps between runs (0..10000).
    pub wake_up_ms: u32,
    /// Lines cleaned per run (1..10000).
    pub flush_max_buffers: u32,
}

impl Default for AcpParams {
    fn default() -> Self {
        AcpParams {
            wake_up_ms: 10,
            flush_max_buffers: 128,
        }
    }
}

impl AcpParams {
    pub fn validate(&self) -> Result<()> {
        check_range("wake-up", self.wake_up_ms as u64, 0, 10_000, "ms")?;
        check_range(
            "flush-max-buffers",
            self.flush_max_buffers as u64,
            1,
            10_000,
            "",
        )
    }
}

/// How cleaning talks to the core, whatever the policy (`-X -n cleaning-io`): hybridcache's own
/// knobs, which Open CAS does not have.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct CleaningIo {
    /// Largest core write cleaning issues, KiB: neighbouring dirty lines merge up to this
    /// (4..4096).
    pub merge_max_kib: u32,
    /// Cap on cleaning's core write bandwidth, MiB/s (0 = no cap), so cleaning does not starve
    /// client IO to the same core.
    pub max_bandwidth_mib_s: u32,
}

impl Default for CleaningIo {
    fn default() -> Self {
        CleaningIo {
            merge_max_kib: 1024,
            max_bandwidth_mib_s: 0,
        }
    }
}

impl CleaningIo {
    pub fn validate(&self) -> Result<()> {
        check_range("merge-max", self.merge_max_kib as u64, 4, 4096, "KiB")?;
        check_range(
            "max-bandwidth",
            self.max_bandwidth_mib_s as u64,
            0,
            1 << 20,
            "MiB/s",
        )
    }
}

/// The whole cleaning configuration. The tunables of every policy are kept when another policy
/// is selected, as Open CAS does, so switching back restores them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default)]
pub struct CleaningConfig {
    pub policy: CleaningPolicy,
    pub alru: AlruParams,
    pub acp: AcpParams,
    pub io: CleaningIo,
}

impl CleaningConfig {
    pub fn validate(&self) -> Result<()> {
        self.alru.validate()?;
        self.acp.validate()?;
        self.io.validate()
    }
}

/// Lines a user flush or a make-room clean keeps in flight at most. Flushes are what users wait
/// for, so they get a deep queue whatever the background policy's flush-max-buffers says.
pub(crate) const FLUSH_BUFFERS: u32 = 4096;

/// The presets users apply by name (domain.md §4); `-X -n cleaning -p NAME`.
pub const CLEANING_PRESETS: [&str; 3] =
    ["alru-very-aggressive", "acp-very-aggressive", "alru-lazy"];

impl CleaningConfig {
    /// Apply a preset: select its policy and set its tunables, keeping the other policy's.
    pub fn apply_preset(&mut self, name: &str) -> Result<()> {
        match name {
            "alru-very-aggressive" => {
                self.policy = CleaningPolicy::Alru;
                self.alru.wake_up_s = 0;
                self.alru.staleness_time_s = 1;
                self.alru.flush_max_buffers = 8192;
                self.alru.activity_threshold_ms = 0;
            }
            "acp-very-aggressive" => {
                self.policy = CleaningPolicy::Acp;
                self.acp.wake_up_ms = 1;
                self.acp.flush_max_buffers = 8192;
            }
            "alru-lazy" => {
                self.policy = CleaningPolicy::Alru;
                self.alru.wake_up_s = 2;
                self.alru.staleness_time_s = 5;
                self.alru.flush_max_buffers = 256;
                self.alru.activity_threshold_ms = 500;
            }
            _ => {
                return Err(EngineError::Invalid(format!(
                    "unknown cleaning policy or preset '{name}' (expected nop, alru, acp, {})",
                    CLEANING_PRESETS.join(", ")
                )))
            }
        }
        Ok(())
    }

    /// The preset these settings are, if any: its policy is selected and its tunables hold the
    /// preset's values. Derived rather than stored, so a preset set by name reads back by name
    /// (also after a load) and stops doing so once one of its tunables is changed.
    pub fn preset(&self) -> Option<&'static str> {
        CLEANING_PRESETS.into_iter().find(|name| {
            let mut c = *self;
            c.apply_preset(name).is_ok() && c == *self
        })
    }

    /// What `-G -n cleaning`, `-L` and `-P` show: the preset's name, or the policy's.
    pub fn policy_name(&self) -> String {
        self.preset()
            .map(str::to_string)
            .unwrap_or_else(|| self.policy.to_string())
    }
}

/// Sequential cutoff policy (domain.md §5).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum SeqCutoffPolicy {
    /// Cut sequential streams off whatever the cache's state.
    Always,
    /// Cut them off only when the cache is nearly full (Open CAS's default).
    #[default]
    Full,
    /// Cache sequential IO like any other.
    Never,
}

impl SeqCutoffPolicy {
    pub const ALL: [SeqCutoffPolicy; 3] = [
        SeqCutoffPolicy::Always,
        SeqCutoffPolicy::Full,
        SeqCutoffPolicy::Never,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SeqCutoffPolicy::Always => "always",
            SeqCutoffPolicy::Full => "full",
            SeqCutoffPolicy::Never => "never",
        }
    }
}

impl fmt::Display for SeqCutoffPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for SeqCutoffPolicy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        SeqCutoffPolicy::ALL
            .into_iter()
            .find(|p| p.as_str() == s)
            .ok_or_else(|| {
                format!("unknown seq cutoff policy '{s}' (expected always, full or never)")
            })
    }
}

/// A core's sequential cutoff settings (`-X -n seq-cutoff`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct SeqCutoff {
    pub policy: SeqCutoffPolicy,
    /// Bytes a stream must have moved before it is cut off, in KiB (1..4194181).
    pub threshold_kib: u32,
    /// Sequential requests a stream needs before it counts as sequential (1..65535).
    pub promotion_count: u32,
    /// Bytes, in KiB, after which a stream counts as sequential even with fewer requests than
    /// `promotion_count` (casadm master's seq-detect `--promotion-threshold`, 0..4194181);
    /// 0: requests only, as before master.
    pub promotion_threshold_kib: u32,
}

impl Default for SeqCutoff {
    fn default() -> Self {
        SeqCutoff {
            policy: SeqCutoffPolicy::Full,
            threshold_kib: 1024,
            promotion_count: 8,
            promotion_threshold_kib: 0,
        }
    }
}

impl SeqCutoff {
    pub fn validate(&self) -> Result<()> {
        // Open CAS: threshold 1..4194181 KiB (4 GiB - 1 sector... its own limit).
        check_range("threshold", self.threshold_kib as u64, 1, 4_194_181, "KiB")?;
        check_range(
            "promotion-count",
            self.promotion_count as u64,
            1,
            65_535,
            "",
        )?;
        // OCF_SEQ_DETECT_MAX_PROMOTION_THRESHOLD (4294841344 bytes) in KiB, as casadm checks it.
        check_range(
            "promotion-threshold",
            self.promotion_threshold_kib as u64,
            0,
            4_194_181,
            "KiB",
        )
    }

    /// Every field in one word: 2 bits of policy, then 23 bits of each KiB value (both below
    /// 2^23 once validated) and 16 of the count.
    fn pack(&self) -> u64 {
        (self.policy as u64)
            | (self.threshold_kib as u64 & 0x7f_ffff) << 2
            | (self.promotion_count as u64 & 0xffff) << 25
            | (self.promotion_threshold_kib as u64 & 0x7f_ffff) << 41
    }

    fn unpack(v: u64) -> SeqCutoff {
        SeqCutoff {
            policy: SeqCutoffPolicy::ALL[(v & 0b11) as usize % 3],
            threshold_kib: ((v >> 2) & 0x7f_ffff) as u32,
            promotion_count: ((v >> 25) & 0xffff) as u32,
            promotion_threshold_kib: ((v >> 41) & 0x7f_ffff) as u32,
        }
    }

    /// Whether a stream of `bytes` in `requests` counts as sequential (OCF's
    /// `ocf_seq_detect_should_promote`: by its byte threshold when set, or by its count).
    fn promoted(&self, bytes: u64, requests: u32) -> bool {
        (self.promotion_threshold_kib > 0 && bytes >= self.promotion_threshold_kib as u64 * 1024)
            || requests >= self.promotion_count
    }
}

/// Streams tracked per core, as Open CAS does.
pub(crate) const SEQ_STREAMS: usize = 128;

/// How far (in requests of the request's own size) a read may land from a confirmed read-ahead
/// stream's end and still continue it (prefetch.rs). A client keeping N sequential reads in
/// flight has them reach the cache in any order within N requests (an NBD server's workers race,
/// and reads finish out of order); 32 covers the usual queue depths. Sequential cutoff does not
/// use it: there a request must touch what its stream has covered (see [`SeqState`]).
pub(crate) const REORDER_REQUESTS: u64 = 32;

/// Which read-ahead stream a read of `len` bytes at `offset` continues, and whether exactly (it
/// starts where the stream ends). `streams` gives each stream as (usable for this request, its
/// end, confirmed: once continued exactly). A confirmed stream also takes a read that lands
/// within [`REORDER_REQUESTS`] requests of its end, before or after it; random requests near each
/// other never start exactly where another ended, so they never become a stream.
pub(crate) fn continued_stream(
    streams: impl Iterator<Item = (bool, u64, bool)> + Clone,
    offset: u64,
    len: u64,
) -> Option<(usize, bool)> {
    let window = len.saturating_mul(REORDER_REQUESTS);
    if let Some(i) = streams
        .clone()
        .position(|(usable, next, _)| usable && next == offset)
    {
        return Some((i, true));
    }
    streams
        .clone()
        .position(|(usable, next, confirmed)| {
            usable && confirmed && offset.abs_diff(next) <= window
        })
        .map(|i| (i, false))
}

/// One tracked run of adjacent requests: `[start, next)` is what it has covered.
#[derive(Clone, Copy, Default)]
struct Stream {
    /// Where the stream's first request started (bytes): a request that continues another
    /// stream and ends here fills the gap between the two, which become one.
    start: u64,
    /// Where the stream's next request would start (the end of its last request, bytes);
    /// with `requests` 0 the slot is unused.
    next: u64,
    bytes: u64,
    requests: u32,
    write: bool,
    /// Last use, for replacing the least recently used stream.
    stamp: u64,
}

/// One core's sequential cutoff: its settings (read on every request, so packed in an atomic)
/// and the streams it tracks.
///
/// A request counts as sequential only when it starts exactly where a tracked stream of its
/// direction ended, as in Open CAS (`ocf_seq_detect`): random requests that land near a stream
/// are never taken for part of it (the Ceph study's random writes next to BlueStore's
/// sequential ones were cached by Open CAS and must be here too). Requests that an NBD
/// server's workers hand over out of order stay one stream another way: a request that arrives
/// ahead of its turn starts a stream of its own (and is cached, as the first request of any
/// stream is), and the request that fills the gap continues the first stream exactly and ends
/// where the early one starts, so the two merge, counts added. Nothing that is not adjacent to
/// what a stream has covered ever joins it.
pub(crate) struct SeqState {
    params: AtomicU64,
    streams: Mutex<StreamTable>,
}

struct StreamTable {
    streams: [Stream; SEQ_STREAMS],
    clock: u64,
}

impl SeqState {
    pub(crate) fn new(params: SeqCutoff) -> SeqState {
        SeqState {
            params: AtomicU64::new(params.pack()),
            streams: Mutex::new(StreamTable {
                streams: [Stream::default(); SEQ_STREAMS],
                clock: 0,
            }),
        }
    }

    pub(crate) fn params(&self) -> SeqCutoff {
        SeqCutoff::unpack(self.params.load(Ordering::Relaxed))
    }

    pub(crate) fn set_params(&self, p: SeqCutoff) {
        self.params.store(p.pack(), Ordering::Relaxed);
    }

    /// Record a request and say whether it is cut off. `nearly_full` is asked only under the
    /// full policy (it costs a little).
    pub(crate) fn cut_off(
        &self,
        offset: u64,
        len: u64,
        write: bool,
        nearly_full: impl FnOnce() -> bool,
    ) -> bool {
        let p = self.params();
        if p.policy == SeqCutoffPolicy::Never {
            return false;
        }
        // As Open CAS: only a request that continues a tracked stream can be cut off, however
        // small the threshold; the first request of a stream is never sequential.
        let Some((bytes, requests)) = self.track(offset, len, write) else {
            return false;
        };
        if bytes < p.threshold_kib as u64 * 1024 || !p.promoted(bytes, requests) {
            return false;
        }
        match p.policy {
            SeqCutoffPolicy::Always => true,
            SeqCutoffPolicy::Full => nearly_full(),
            SeqCutoffPolicy::Never => false,
        }
    }

    /// Record a request and return its stream's bytes and requests including this one when the
    /// request continues a stream exactly (and then also the stream that starts where it ends,
    /// which arrived ahead of it); None when it starts a stream.
    fn track(&self, offset: u64, len: u64, write: bool) -> Option<(u64, u32)> {
        let mut t = self.streams.lock();
        t.clock += 1;
        let clock = t.clock;
        let end = offset + len;
        let live = |s: &Stream| s.requests > 0 && s.write == write;
        let continued = t.streams.iter().position(|s| live(s) && s.next == offset);
        let Some(i) = continued else {
            // A request that only ends where a stream starts joins nothing: Open CAS would start
            // a stream with it, and so do we, or the table would keep other streams than its.
            let oldest = t
                .streams
                .iter_mut()
                .min_by_key(|s| s.stamp)
                .expect("SEQ_STREAMS > 0");
            *oldest = Stream {
                start: offset,
                next: end,
                bytes: len,
                requests: 1,
                write,
                stamp: clock,
            };
            return None;
        };
        // A stream that arrived ahead of this request and starts where it ends.
        let ahead = t
            .streams
            .iter()
            .position(|s| live(s) && s.start == end)
            .filter(|&j| j != i);
        let (ahead_next, ahead_bytes, ahead_requests) = match ahead {
            Some(j) => {
                let ahead = std::mem::take(&mut t.streams[j]);
                (ahead.next, ahead.bytes, ahead.requests)
            }
            None => (end, 0, 0),
        };
        let s = &mut t.streams[i];
        debug_assert!(s.start <= s.next && s.next == offset);
        s.next = ahead_next;
        s.bytes = s.bytes.saturating_add(len).saturating_add(ahead_bytes);
        s.requests = s.requests.saturating_add(1).saturating_add(ahead_requests);
        s.stamp = clock;
        Some((s.bytes, s.requests))
    }
}

/// Promotion policy (domain.md §6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PromotionPolicy {
    /// Every miss is inserted.
    #[default]
    Always,
    /// A core line is inserted only after `threshold` accesses, once occupancy passes `trigger`.
    Nhit,
}

impl PromotionPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            PromotionPolicy::Always => "always",
            PromotionPolicy::Nhit => "nhit",
        }
    }
}

impl fmt::Display for PromotionPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PromotionPolicy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "always" => Ok(PromotionPolicy::Always),
            "nhit" => Ok(PromotionPolicy::Nhit),
            _ => Err(format!(
                "unknown promotion policy '{s}' (expected always or nhit)"
            )),
        }
    }
}

/// Promotion settings (`-X -n promotion`, `-X -n promotion-nhit`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Promotion {
    pub policy: PromotionPolicy,
    /// Accesses a core line needs before it is inserted (2..1000).
    pub threshold: u32,
    /// Occupancy (%) above which nhit starts declining (0..100).
    pub trigger_pct: u32,
}

impl Default for Promotion {
    fn default() -> Self {
        Promotion {
            policy: PromotionPolicy::Always,
            threshold: 3,
            trigger_pct: 80,
        }
    }
}

impl Promotion {
    pub fn validate(&self) -> Result<()> {
        check_range("threshold", self.threshold as u64, 2, 1000, "")?;
        check_range("trigger", self.trigger_pct as u64, 0, 100, "%")
    }

    fn pack(&self) -> u64 {
        (self.policy as u64) | (self.threshold as u64) << 8 | (self.trigger_pct as u64) << 40
    }

    fn unpack(v: u64) -> Promotion {
        Promotion {
            policy: if v & 0xff == 1 {
                PromotionPolicy::Nhit
            } else {
                PromotionPolicy::Always
            },
            threshold: ((v >> 8) & 0xffff_ffff) as u32,
            trigger_pct: (v >> 40) as u32,
        }
    }
}

/// Access counts of core lines for nhit, in a fixed table of packed words: a 48-bit tag (a hash
/// of the core line's key) and a 16-bit count. A collision replaces the older entry: a line may
/// then need a few more accesses than the threshold, never fewer (unless two keys share a tag
/// and a slot, which 48 bits make negligible).
pub(crate) struct NhitTable {
    slots: Box<[AtomicU64]>,
}

const COUNT_MASK: u64 = 0xffff;

impl NhitTable {
    pub(crate) fn new(entries: usize) -> NhitTable {
        NhitTable {
            slots: (0..entries.max(1024)).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.slots.len() as u64 * 8
    }

    /// Count an access to the core line `key` and return its count including this one
    /// (saturating at 65535).
    pub(crate) fn access(&self, key: u64) -> u32 {
        let h = (key ^ key >> 29).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let slot = &self.slots[(h as u32) as usize % self.slots.len()];
        // Never 0, so an empty slot matches no key.
        let tag = (h & !COUNT_MASK).max(1 << 16);
        let mut cur = slot.load(Ordering::Relaxed);
        loop {
            let count = if cur & !COUNT_MASK == tag {
                ((cur & COUNT_MASK) + 1).min(COUNT_MASK)
            } else {
                1
            };
            match slot.compare_exchange_weak(cur, tag | count, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return count as u32,
                Err(now) => cur = now,
            }
        }
    }
}

/// Cache-wide promotion state.
pub(crate) struct PromotionState {
    params: AtomicU64,
    table: std::sync::OnceLock<NhitTable>,
}

impl PromotionState {
    /// nhit's access counts, once promotion has been switched to nhit.
    pub(crate) fn table(&self) -> Option<&NhitTable> {
        self.table.get()
    }

    pub(crate) fn new(p: Promotion) -> PromotionState {
        PromotionState {
            params: AtomicU64::new(p.pack()),
            table: std::sync::OnceLock::new(),
        }
    }

    pub(crate) fn params(&self) -> Promotion {
        Promotion::unpack(self.params.load(Ordering::Relaxed))
    }

    pub(crate) fn set_params(&self, p: Promotion, lines: u32) {
        if p.policy == PromotionPolicy::Nhit {
            // Twice the lines: the candidates for insertion are the lines not in the cache.
            self.table
                .get_or_init(|| NhitTable::new((lines as usize * 2).min(1 << 24)));
        }
        self.params.store(p.pack(), Ordering::Relaxed);
    }
}

/// Lazy flush (`-X -n lazy-flush -p on|off`; ASPLOS'23's "lazy flushing"). With it on, a
/// write-back write that finds no free or clean line sends its unmapped sectors straight to the
/// core instead of cleaning victims inside the request, and asks background cleaning for room.
/// On by default: under a write burst it keeps the IOPS and cuts the p99 several times on
/// every core measured (docs/bench.md, "Lazy flush under a write burst").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct LazyFlush {
    pub enabled: bool,
}

impl Default for LazyFlush {
    fn default() -> LazyFlush {
        LazyFlush { enabled: true }
    }
}

/// `on`/`off`, the words the CLI and the configuration file use for switches.
pub fn on_off(enabled: bool) -> &'static str {
    if enabled {
        "on"
    } else {
        "off"
    }
}

/// Parse `on`/`off` (also `yes`/`no`, `true`/`false`, `1`/`0`).
pub fn parse_on_off(name: &str, v: &str) -> std::result::Result<bool, String> {
    match v.trim() {
        "on" | "yes" | "true" | "1" => Ok(true),
        "off" | "no" | "false" | "0" => Ok(false),
        _ => Err(format!("{name}: '{v}' is neither on nor off")),
    }
}

/// Prefetch policy (`-X -n prefetch -p readahead|none`; Open CAS v26.09).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "lowercase")]
pub enum PrefetchPolicy {
    #[default]
    None,
    Readahead,
}

impl PrefetchPolicy {
    pub fn as_str(self) -> &'static str {
        match self {
            PrefetchPolicy::None => "none",
            PrefetchPolicy::Readahead => "readahead",
        }
    }
}

impl fmt::Display for PrefetchPolicy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for PrefetchPolicy {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "none" => Ok(PrefetchPolicy::None),
            "readahead" => Ok(PrefetchPolicy::Readahead),
            _ => Err(format!(
                "unknown prefetch policy '{s}' (expected readahead or none)"
            )),
        }
    }
}

/// Read-ahead's settings (`-X -n prefetch` and `-X -n prefetch-readahead`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default)]
pub struct Prefetch {
    pub policy: PrefetchPolicy,
    /// Bytes a sequential read stream must have read before prefetching starts, KiB
    /// (1..4194181, Open CAS's range for seq cutoff's threshold).
    pub threshold_kib: u32,
    /// How far past a stream's last read prefetch reads, KiB (4..32768: one prefetch request
    /// at most, which is capped at the largest request, 32 MiB).
    pub distance_kib: u32,
    /// Prefetch requests queued or running at most, per cache (1..64); beyond it a stream's
    /// read-ahead is skipped, never waited for.
    pub max_in_flight: u32,
}

impl Default for Prefetch {
    fn default() -> Self {
        Prefetch {
            policy: PrefetchPolicy::None,
            threshold_kib: 256,
            distance_kib: 1024,
            max_in_flight: 4,
        }
    }
}

impl Prefetch {
    pub fn validate(&self) -> Result<()> {
        check_range("threshold", self.threshold_kib as u64, 1, 4_194_181, "KiB")?;
        check_range("distance", self.distance_kib as u64, 4, 32_768, "KiB")?;
        check_range("max-in-flight", self.max_in_flight as u64, 1, 64, "")
    }
}

/// Everything of this module as the superblock records it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PolicyRecord {
    pub cleaning: CleaningConfig,
    pub promotion: Promotion,
    /// Per core id.
    pub seq_cutoff: std::collections::BTreeMap<u16, SeqCutoff>,
    /// The loaded IO class file, as CSV (None: the default single class).
    pub io_classes: Option<String>,
    pub lazy_flush: LazyFlush,
    pub prefetch: Prefetch,
    pub offload: crate::offload::Offload,
    pub fallback_pt: crate::fallback::FallbackPt,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_open_cas_defaults() {
        let a = AlruParams::default();
        assert_eq!(
            (
                a.wake_up_s,
                a.staleness_time_s,
                a.flush_max_buffers,
                a.activity_threshold_ms
            ),
            (20, 120, 100, 10_000)
        );
        let c = AcpParams::default();
        assert_eq!((c.wake_up_ms, c.flush_max_buffers), (10, 128));
        let s = SeqCutoff::default();
        assert_eq!(
            (s.policy, s.threshold_kib, s.promotion_count),
            (SeqCutoffPolicy::Full, 1024, 8)
        );
        let p = Promotion::default();
        assert_eq!(
            (p.policy, p.threshold, p.trigger_pct),
            (PromotionPolicy::Always, 3, 80)
        );
        assert_eq!(CleaningConfig::default().policy, CleaningPolicy::Alru);
    }

    #[test]
    fn ranges_are_checked_and_named() {
        let mut a = AlruParams {
            flush_max_buffers: 0,
            ..AlruParams::default()
        };
        let e = a.validate().unwrap_err().to_string();
        assert!(
            e.contains("flush-max-buffers 0 is out of range 1..10000"),
            "{e}"
        );
        a.flush_max_buffers = 10_000;
        a.staleness_time_s = 3601;
        assert!(a
            .validate()
            .unwrap_err()
            .to_string()
            .contains("staleness-time"));
        let p = Promotion {
            threshold: 1,
            ..Promotion::default()
        };
        assert!(p.validate().is_err());
        let s = SeqCutoff {
            promotion_count: 0,
            ..SeqCutoff::default()
        };
        assert!(s.validate().is_err());
        let s = SeqCutoff {
            promotion_threshold_kib: 4_194_182,
            ..SeqCutoff::default()
        };
        let e = s.validate().unwrap_err().to_string();
        assert!(
            e.contains("promotion-threshold 4194182 is out of range"),
            "{e}"
        );
    }

    /// OCF's `ocf_seq_detect_should_promote`: bytes >= the promotion threshold (when not 0)
    /// or requests >= the promotion count, whichever comes first.
    #[test]
    fn a_stream_is_promoted_by_its_bytes_or_its_requests() {
        let s = SeqState::new(SeqCutoff {
            policy: SeqCutoffPolicy::Always,
            threshold_kib: 1,
            promotion_count: 65_535,
            promotion_threshold_kib: 64,
        });
        let cut: Vec<bool> = (0..4)
            .map(|i| s.cut_off(i * 32768, 32768, false, || false))
            .collect();
        // 32, 64, 96, 128 KiB: the first request starts the stream, the second reaches 64 KiB.
        assert_eq!(cut, [false, true, true, true]);
        s.set_params(SeqCutoff {
            promotion_threshold_kib: 0,
            ..s.params()
        });
        assert!(
            !s.cut_off(4 * 32768, 32768, false, || false),
            "0 turns the byte threshold off: 65,535 requests are needed again"
        );
        s.set_params(SeqCutoff {
            promotion_count: 3,
            promotion_threshold_kib: 4_194_181,
            ..s.params()
        });
        assert!(
            s.cut_off(5 * 32768, 32768, false, || false),
            "the count promotes without the bytes"
        );
    }

    #[test]
    fn packed_params_round_trip() {
        let s = SeqCutoff {
            policy: SeqCutoffPolicy::Always,
            threshold_kib: 4_194_181,
            promotion_count: 65_535,
            promotion_threshold_kib: 4_194_181,
        };
        assert_eq!(SeqCutoff::unpack(s.pack()), s);
        let s = SeqCutoff {
            policy: SeqCutoffPolicy::Never,
            threshold_kib: 1,
            promotion_count: 1,
            promotion_threshold_kib: 0,
        };
        assert_eq!(SeqCutoff::unpack(s.pack()), s);
        let p = Promotion {
            policy: PromotionPolicy::Nhit,
            threshold: 1000,
            trigger_pct: 100,
        };
        assert_eq!(Promotion::unpack(p.pack()), p);
    }

    #[test]
    fn presets_read_back_by_name_until_a_tunable_changes() {
        let mut c = CleaningConfig::default();
        assert_eq!(c.policy_name(), "alru");
        for name in CLEANING_PRESETS {
            c.apply_preset(name).unwrap();
            assert_eq!(c.policy_name(), name);
        }
        c.apply_preset("alru-very-aggressive").unwrap();
        c.alru.staleness_time_s = 2;
        assert_eq!(c.policy_name(), "alru");
        // The acp preset's tunables survive a switch to alru and back.
        c.apply_preset("acp-very-aggressive").unwrap();
        c.policy = CleaningPolicy::Alru;
        c.policy = CleaningPolicy::Acp;
        assert_eq!(c.policy_name(), "acp-very-aggressive");
        c.policy = CleaningPolicy::Nop;
        assert_eq!(c.policy_name(), "nop");
    }

    #[test]
    fn presets_set_the_documented_values() {
        let mut c = CleaningConfig::default();
        c.apply_preset("acp-very-aggressive").unwrap();
        assert_eq!(c.policy, CleaningPolicy::Acp);
        assert_eq!((c.acp.wake_up_ms, c.acp.flush_max_buffers), (1, 8192));
        c.apply_preset("alru-lazy").unwrap();
        assert_eq!(c.policy, CleaningPolicy::Alru);
        assert_eq!(
            (
                c.alru.wake_up_s,
                c.alru.staleness_time_s,
                c.alru.flush_max_buffers,
                c.alru.activity_threshold_ms
            ),
            (2, 5, 256, 500)
        );
        // acp's tunables were kept.
        assert_eq!(c.acp.flush_max_buffers, 8192);
        assert!(c.apply_preset("fast").is_err());
    }

    #[test]
    fn streams_are_tracked_separately_and_replaced_lru() {
        let s = SeqState::new(SeqCutoff {
            policy: SeqCutoffPolicy::Always,
            threshold_kib: 64,
            promotion_count: 2,
            promotion_threshold_kib: 0,
        });
        // Two interleaved streams of 16 KiB requests: each is cut off from its 4th request.
        let mut cut = Vec::new();
        for i in 0..6u64 {
            cut.push(s.cut_off(i * 16384, 16384, true, || false));
            cut.push(s.cut_off((1 << 30) + i * 16384, 16384, true, || false));
        }
        assert_eq!(
            cut,
            [false, false, false, false, false, false, true, true, true, true, true, true]
        );
        // A read continuing a write stream is a new stream.
        assert!(!s.cut_off(6 * 16384, 16384, false, || false));
        // 128 other streams push the first out.
        for i in 0..SEQ_STREAMS as u64 {
            s.cut_off((i + 2) << 32, 4096, true, || false);
        }
        assert!(!s.cut_off(6 * 16384, 16384, true, || false));
    }

    /// A client keeping 16 KiB writes in flight through NBD: the server's workers hand them to
    /// the cache slightly out of order. A write that arrives ahead of its turn touches nothing the
    /// stream has covered, so it is cached (as Open CAS would); the write that fills the gap
    /// joins the early one to the stream, which stays one stream and is cut off. Under the exact
    /// rule alone (no joining) the stream broke into pieces at the first early write and none of
    /// them was cut off again (issue 20); under the reorder window of round 2, random writes near
    /// the stream were cut off too (issue 35).
    #[test]
    fn a_stream_reordered_on_its_way_stays_one_stream() {
        let s = SeqState::new(SeqCutoff {
            policy: SeqCutoffPolicy::Always,
            threshold_kib: 64,
            promotion_count: 2,
            promotion_threshold_kib: 0,
        });
        let order = [0u64, 1, 2, 4, 3, 5, 7, 6, 8, 11, 9, 10, 12];
        let cut: Vec<bool> = order
            .iter()
            .map(|&i| s.cut_off(i * 16384, 16384, true, || false))
            .collect();
        // The early ones (4, 7, 11) are cached; every other write from the 4th on is cut off.
        assert_eq!(
            cut,
            [false, false, false, false, true, true, false, true, true, false, true, true, true]
        );
        // Requests near each other that never continue one exactly are no stream.
        let r = SeqState::new(SeqCutoff {
            policy: SeqCutoffPolicy::Always,
            threshold_kib: 4,
            promotion_count: 1,
            promotion_threshold_kib: 0,
        });
        for i in [10u64, 8, 13, 6, 15, 4, 2, 12] {
            assert!(!r.cut_off((1 << 30) + i * 8192, 4096, true, || false));
        }
    }

    /// A stream whose neighbouring writes swap places on the way (each pair reversed): half the
    /// writes arrive early and are cached, the other half fill a gap, join the early one and are
    /// cut off once the stream has its 16 KiB, and the stream never falls apart. With the exact
    /// rule alone none of the 16 was cut off.
    #[test]
    fn a_stream_reordered_in_pairs_is_still_cut_off() {
        let s = SeqState::new(SeqCutoff {
            policy: SeqCutoffPolicy::Always,
            threshold_kib: 16,
            promotion_count: 2,
            promotion_threshold_kib: 0,
        });
        let order: Vec<u64> = (0..16u64).map(|i| i ^ 1).collect();
        let cut = order
            .iter()
            .filter(|&&i| s.cut_off(i * 4096, 4096, true, || false))
            .count();
        // Written 1, 0, 3, 2, 5, 4, ...: 0 arrived after its stream's head and stays apart; 2
        // joins 1 and 3 (12 KiB), and 4, 6, ..., 14 each bring the stream past 16 KiB.
        assert_eq!(cut, 6, "every gap-filling write from the third pair on");
    }

    /// The issue 35 case: after a 32 KiB sequential stream (seq cutoff always, 16 KiB), eight
    /// 4 KiB writes 12-68 KiB past its end, none adjacent to anything written. Round 2's window
    /// passed all eight to the core; Open CAS caches them, and so must we.
    #[test]
    fn random_writes_near_a_stream_are_not_cut_off() {
        let s = SeqState::new(SeqCutoff {
            policy: SeqCutoffPolicy::Always,
            threshold_kib: 16,
            promotion_count: 1,
            promotion_threshold_kib: 0,
        });
        let base = 1u64 << 30;
        let stream: Vec<bool> = (0..8u64)
            .map(|i| s.cut_off(base + i * 4096, 4096, true, || false))
            .collect();
        assert_eq!(
            stream.iter().filter(|&&c| c).count(),
            5,
            "from the 4th write on"
        );
        let end = base + 32 * 1024;
        for k in 0..8u64 {
            let offset = end + 12 * 1024 + k * 8192;
            assert!(
                !s.cut_off(offset, 4096, true, || false),
                "a write {} KiB past the stream's end was cut off",
                (offset - end) / 1024
            );
        }
        // The stream itself still continues exactly where it ended.
        assert!(s.cut_off(end, 4096, true, || false));
    }

    /// Open CAS's detector (ocf/src/ocf_seq_cutoff.c, `ocf_core_seq_cutoff_check` and
    /// `_update`, with one IO queue and promotion count 1, where every stream lives in the
    /// core's table): a request continues a stream only when it starts where the stream's last
    /// request ended (same direction); it is cut off when that stream's bytes plus its own reach
    /// the threshold; 128 streams, the least recently used replaced.
    struct OcfOracle {
        /// (last, bytes, write, stamp)
        streams: Vec<(u64, u64, bool, u64)>,
        clock: u64,
        threshold: u64,
    }

    impl OcfOracle {
        fn cut_off(&mut self, addr: u64, len: u64, write: bool) -> bool {
            self.clock += 1;
            let clock = self.clock;
            if let Some(s) = self
                .streams
                .iter_mut()
                .find(|s| s.0 == addr && s.2 == write)
            {
                let cut = s.1 + len >= self.threshold;
                *s = (addr + len, s.1 + len, write, clock);
                return cut;
            }
            if self.streams.len() == SEQ_STREAMS {
                let oldest = (0..self.streams.len())
                    .min_by_key(|&i| self.streams[i].3)
                    .expect("full table");
                self.streams.remove(oldest);
            }
            self.streams.push((addr + len, len, write, clock));
            false
        }
    }

    /// Requests in order (interleaved sequential streams of both directions, rewrites just
    /// behind their ends, and random requests scattered over a large core): every decision is
    /// Open CAS's.
    #[test]
    fn in_order_requests_are_cut_off_exactly_as_open_cas_does() {
        use rand::{Rng, SeedableRng};
        for seed in 0..20u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let threshold_kib = [4u32, 16, 64, 1024][rng.gen_range(0..4)];
            let ours = SeqState::new(SeqCutoff {
                policy: SeqCutoffPolicy::Always,
                threshold_kib,
                promotion_count: 1,
                promotion_threshold_kib: 0,
            });
            let mut ocf = OcfOracle {
                streams: Vec::new(),
                clock: 0,
                threshold: threshold_kib as u64 * 1024,
            };
            // A few streams, or more than the 128-stream table holds (so it replaces some).
            let nstreams = if seed % 4 == 0 {
                140
            } else {
                rng.gen_range(1..40u64)
            };
            let mut next: Vec<u64> = (0..nstreams).map(|i| (i + 1) << 40).collect();
            let mut cuts = 0;
            for step in 0..4000 {
                let len = 4096 * rng.gen_range(1..32u64);
                let i = rng.gen_range(0..nstreams) as usize;
                let start = (i as u64 + 1) << 40;
                let (offset, len, write) = if rng.gen_bool(0.7) {
                    let o = next[i];
                    next[i] += len;
                    (o, len, i % 2 == 0)
                } else if rng.gen_bool(0.5) && next[i] - start >= 64 * 1024 {
                    // A 4 KiB rewrite of the stream's own data up to 32 requests behind its end
                    // (8 KiB-aligned, so two of them never touch), in its direction: Open CAS
                    // caches it, and round 2's window cut it off.
                    let back = 8192 * rng.gen_range(2..=32u64);
                    let o = next[i].saturating_sub(back).max(start) / 8192 * 8192;
                    (o, 4096, i % 2 == 0)
                } else {
                    // Random requests far from every stream: 4 KiB-aligned in the first TiB.
                    (
                        4096 * rng.gen_range(0..(1u64 << 28)),
                        len,
                        rng.gen_bool(0.5),
                    )
                };
                let expected = ocf.cut_off(offset, len, write);
                let got = ours.cut_off(offset, len, write, || false);
                assert_eq!(
                    got, expected,
                    "seed {seed} step {step}: {len} bytes at {offset} (write {write})"
                );
                cuts += got as u32;
            }
            assert!(
                nstreams > 100 || cuts > 100,
                "seed {seed}: the sequence must exercise cut-offs ({cuts})"
            );
        }
    }

    #[test]
    fn full_policy_asks_about_free_space_only_when_a_stream_qualifies() {
        let s = SeqState::new(SeqCutoff {
            policy: SeqCutoffPolicy::Full,
            threshold_kib: 8,
            promotion_count: 1,
            promotion_threshold_kib: 0,
        });
        assert!(!s.cut_off(0, 4096, false, || panic!("not yet")));
        assert!(!s.cut_off(4096, 4096, false, || false));
        assert!(s.cut_off(8192, 4096, false, || true));
    }

    #[test]
    fn nhit_counts_per_key_and_saturates() {
        let t = NhitTable::new(1024);
        assert_eq!(t.access(5 << 8), 1);
        assert_eq!(t.access(5 << 8), 2);
        assert_eq!(t.access(6 << 8), 1);
        assert_eq!(t.access(5 << 8), 3);
        assert_eq!(t.access(0), 1);
        assert_eq!(t.access(0), 2);
        for _ in 0..300 {
            t.access(7 << 8);
        }
        assert_eq!(t.access(7 << 8), 301);
    }
}

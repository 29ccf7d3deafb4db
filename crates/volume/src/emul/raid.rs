//! RAID arrays of emulated disks: [`RaidConfig`] describes one, `Array` is the timing model of the
//! controller and its disks (a single disk is the array with one member, so both device kinds
//! share this code).
//!
//! Layout. Levels 0, 1, 5 and 6 are one group of `disks` disks; levels 10, 50 and 60 are a RAID 0
//! over `groups` groups of RAID 1, 5 or 6 with `disks` disks each. RAID 0, 5 and 6 cut a group into
//! strips of `strip` bytes, one per disk per row; RAID 5 rotates the parity disk per row
//! (left-symmetric), RAID 6 puts Q on the disk after P. The outer RAID 0 of a nested level gives
//! each group a whole inner stripe in turn (`strip` for RAID 10), so one full stripe is one group's.
//!
//! Controller. Reads go to the data disks (the least busy mirror for RAID 1). Writes on parity
//! levels:
//! - a full-stripe write writes every data and parity strip at once, reading nothing;
//! - a partial-stripe write is a read-modify-write: read the old data and parity ranges, then
//!   write the new data and parity;
//! - with a stripe cache (`stripe_cache` stripes, least recently used out), the controller keeps
//!   the stripes it has touched in memory: a partial write to a cached stripe reads nothing, and
//!   new parity stays in the cache (dirty) until partial writes have written every data byte of
//!   the stripe (then it is written at once, where a sequential stream left the parity disks'
//!   heads) or the stripe is evicted (written in the background, by then far from the heads).
//!   That is what lets a sequential stream of small writes run at the data disk's speed instead
//!   of rewriting (and waiting a revolution for) the same parity sectors each time; random
//!   writes still pay every read and, on eviction, every parity write;
//! - with a parity engine, a partial-stripe update costs the engine a fixed time, a time per
//!   client write it covers and its bytes at the engine's rate, one update at a time;
//! - with a merge window, a partial-stripe write first waits up to `merge_window` for other
//!   writes to complete the stripe: if they do, all are written as one full stripe; if not, they
//!   go out together as one partial-stripe update (each disk writes their contiguous bytes at
//!   once, the engine updates their parity in one pass, and all complete together). While the
//!   parity engine is busy, an expired stripe keeps waiting until it is free (at most 20 windows
//!   from its first write): writes queued for the engine have not been processed yet and may
//!   still be merged. A stripe that follows one written full waits 4 windows instead of one:
//!   the stream is expected to continue, and its writes may arrive spread out.
//! - A client that keeps a stripe's worth of writes in flight (the most write bytes outstanding
//!   at once lately, counting those completed within the last window whose replacements have not
//!   arrived yet: through a transport some are always on their way) sends the rest of a stripe
//!   as its earlier writes complete. So for such a client each write to a stripe extends its
//!   wait by 4 windows (up to 20 from its first), and a stripe whose previous stripe in the
//!   stream still has partial writes in progress keeps waiting until a window after they finish.
//!   Without that, a stream whose writes arrive spread out (through NBD: 0.3-1 ms for a stripe's
//!   writes) or whose in-flight writes straddle two stripes falls to partial writes, and the
//!   revolutions those cost stall the next stripes, which then fall too. With `n` writes of `b`
//!   bytes in flight, a sequential stream fills stripes only when `n * b` reaches the stripe's
//!   data width, which is the jump in the study's sequential-write table.
//!
//! Every request also pays a fixed controller latency.
//!
//! The model is driven lazily with explicit times (see [`super::hdd`]): `start` and `poll` move it
//! to a time, make every decision due by then, and say when the request completes or when to look
//! again. It holds no data; the emulated volume keeps the data in a backing volume.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use super::clock::{nanos, Nanos};
use super::hdd::{Disk, HddConfig, HddModel};

/// A RAID level.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RaidLevel {
    Raid0,
    Raid1,
    Raid10,
    Raid5,
    Raid6,
    Raid50,
    Raid60,
}

impl RaidLevel {
    /// From its number: 0, 1, 10, 5, 6, 50 or 60.
    pub fn from_number(n: u32) -> Option<RaidLevel> {
        Some(match n {
            0 => RaidLevel::Raid0,
            1 => RaidLevel::Raid1,
            10 => RaidLevel::Raid10,
            5 => RaidLevel::Raid5,
            6 => RaidLevel::Raid6,
            50 => RaidLevel::Raid50,
            60 => RaidLevel::Raid60,
            _ => return None,
        })
    }

    pub fn number(self) -> u32 {
        match self {
            RaidLevel::Raid0 => 0,
            RaidLevel::Raid1 => 1,
            RaidLevel::Raid10 => 10,
            RaidLevel::Raid5 => 5,
            RaidLevel::Raid6 => 6,
            RaidLevel::Raid50 => 50,
            RaidLevel::Raid60 => 60,
        }
    }

    /// Whether this is a RAID 0 over groups.
    pub fn nested(self) -> bool {
        matches!(
            self,
            RaidLevel::Raid10 | RaidLevel::Raid50 | RaidLevel::Raid60
        )
    }

    fn inner(self) -> Inner {
        match self {
            RaidLevel::Raid0 => Inner::Stripe,
            RaidLevel::Raid1 | RaidLevel::Raid10 => Inner::Mirror,
            RaidLevel::Raid5 | RaidLevel::Raid50 => Inner::Parity(1),
            RaidLevel::Raid6 | RaidLevel::Raid60 => Inner::Parity(2),
        }
    }
}

/// An array of emulated disks and its controller.
#[derive(Debug, Clone, PartialEq)]
pub struct RaidConfig {
    pub level: RaidLevel,
    /// Groups under the outer RAID 0 (1 for the non-nested levels).
    pub groups: u32,
    /// Disks per group.
    pub disks: u32,
    /// Bytes per disk per stripe row (what controllers call the strip or stripe size).
    pub strip: u64,
    /// Every member disk.
    pub disk: HddConfig,
    /// How long a partial-stripe write waits for the rest of its stripe (parity levels only).
    pub merge_window: Option<Duration>,
    /// Stripes whose old data and parity the controller keeps (parity levels only).
    pub stripe_cache: usize,
    /// Fixed controller latency added to every request.
    pub ctrl_latency: Duration,
    /// The controller's parity computation for partial-stripe writes (parity levels only).
    pub parity_engine: Option<ParityEngine>,
}

/// A RAID controller's parity engine: it handles one parity update at a time, for a fixed cost
/// per update, a cost per client write it covers, and the bytes written at `rate` bytes per
/// second. An update is a partial-stripe write, or the writes to one stripe that waited in a
/// merge window together without filling it (the controller updates their parity in one pass).
/// It caps the small sequential writes of the study's array (a few thousand IOPS, falling with
/// the block size) while leaving full-stripe writes, which it does not handle, free to go faster.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParityEngine {
    pub per_update: Duration,
    pub per_write: Duration,
    pub rate: u64,
}

impl RaidConfig {
    /// An array with no merge window, no stripe cache and no controller latency.
    pub fn new(level: RaidLevel, groups: u32, disks: u32, strip: u64, disk: HddConfig) -> Self {
        RaidConfig {
            level,
            groups,
            disks,
            strip,
            disk,
            merge_window: None,
            stripe_cache: 0,
            ctrl_latency: Duration::ZERO,
            parity_engine: None,
        }
    }

    /// The study's array (domain.md §10), with the parameters tuned to reproduce its no-cache
    /// baselines: RAID 60, 4 groups of 10 disks of `disk_size` bytes (8 data + 2 parity),
    /// 7200 rpm, 64 KiB strips, disks that serve commands in arrival order (no NCQ: with it the
    /// model's mixed reads and writes ran up to 1.6x the study's at depth), a 0.5 ms merge
    /// window, a 256-stripe stripe cache and a parity engine of 70 µs per update + 100 µs per
    /// write + 300 MB/s.
    pub fn study_raid60(disk_size: u64) -> RaidConfig {
        let disk = HddConfig::new(disk_size, 7200);
        RaidConfig {
            merge_window: Some(Duration::from_micros(500)),
            stripe_cache: 256,
            parity_engine: Some(ParityEngine {
                per_update: Duration::from_micros(70),
                per_write: Duration::from_micros(110),
                rate: 300_000_000,
            }),
            ..RaidConfig::new(RaidLevel::Raid60, 4, 10, 64 << 10, disk)
        }
    }

    /// Data disks per group.
    pub fn data_disks(&self) -> u32 {
        match self.level.inner() {
            Inner::Stripe => self.disks,
            Inner::Mirror => 1,
            Inner::Parity(p) => self.disks.saturating_sub(p),
        }
    }

    /// Usable bytes of the array.
    pub fn capacity(&self) -> u64 {
        let per_disk = self.disk.size / self.strip.max(1) * self.strip;
        per_disk * self.data_disks() as u64 * self.groups as u64
    }

    /// Check the parameters; the message names the parameter and what it accepts.
    pub fn validate(&self) -> Result<(), String> {
        self.disk.validate()?;
        let level = self.level.number();
        let min_disks = match self.level.inner() {
            Inner::Stripe => 1,
            Inner::Mirror => 2,
            Inner::Parity(p) => p + 2,
        };
        if !(min_disks..=64).contains(&self.disks) {
            return Err(format!(
                "disks {} out of range {min_disks}..=64 for RAID {level}",
                self.disks
            ));
        }
        if self.level.nested() {
            if !(2..=64).contains(&self.groups) {
                return Err(format!(
                    "groups {} out of range 2..=64 for RAID {level}",
                    self.groups
                ));
            }
        } else if self.groups != 1 {
            return Err(format!(
                "groups {} must be 1 for RAID {level} (use level {level}0 for several groups)",
                self.groups
            ));
        }
        if self.strip < 4096 || self.strip > (64 << 20) || self.strip % 4096 != 0 {
            return Err(format!(
                "strip {} must be a multiple of 4 KiB in 4K..=64M",
                self.strip
            ));
        }
        if self.disk.size < self.strip {
            return Err(format!(
                "disk_size {} is smaller than one strip ({})",
                self.disk.size, self.strip
            ));
        }
        if self.stripe_cache > 1 << 20 {
            return Err(format!(
                "stripe_cache {} out of range 0..=1048576",
                self.stripe_cache
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Inner {
    Stripe,
    Mirror,
    Parity(u32),
}

/// Where requests land; derived from a config.
#[derive(Debug, Clone)]
struct Geometry {
    inner: Inner,
    groups: u64,
    disks: u64,
    strip: u64,
    data_disks: u64,
    /// Bytes of the logical volume given to one group before moving to the next.
    chunk: u64,
    capacity: u64,
}

/// One disk request of a step.
#[derive(Debug, Clone, Copy)]
struct SubIo {
    disk: usize,
    offset: u64,
    len: u64,
}

/// A partial-stripe write, kept whole until it is issued (it may wait in a merge window).
#[derive(Debug, Clone)]
struct Partial {
    key: (u64, u64),
    /// The bytes of the stripe's data it writes, sorted and merged.
    ranges: Vec<(u64, u64)>,
    data: Vec<SubIo>,
    parity: Vec<SubIo>,
    /// The client writes it stands for: one, or a merge group's that expired together.
    writes: u64,
}

impl Partial {
    /// One update for the writes of a merge group that expired together: each disk writes the
    /// group's contiguous bytes on it at once, and each parity disk the span of their parity.
    fn combine(key: (u64, u64), mut parts: Vec<Partial>) -> Partial {
        parts.sort_by_key(|p| p.ranges.first().map_or(0, |r| r.0));
        let mut out = Partial {
            key,
            ranges: Vec::new(),
            data: Vec::new(),
            parity: Vec::new(),
            writes: 0,
        };
        for p in parts {
            out.writes += p.writes;
            for (a, b) in p.ranges {
                add_range(&mut out.ranges, a, b);
            }
            for io in p.data {
                match out.data.last_mut() {
                    Some(last) if last.disk == io.disk && last.offset + last.len == io.offset => {
                        last.len += io.len
                    }
                    _ => out.data.push(io),
                }
            }
            for io in p.parity {
                match out.parity.iter_mut().find(|d| d.disk == io.disk) {
                    Some(d) => {
                        let end = (d.offset + d.len).max(io.offset + io.len);
                        d.offset = d.offset.min(io.offset);
                        d.len = end - d.offset;
                    }
                    None => out.parity.push(io),
                }
            }
        }
        out
    }
}

#[derive(Debug)]
enum PieceState {
    /// Waiting for disk requests (`inflight`), then issuing the remaining steps in order.
    Steps {
        pending: VecDeque<Vec<SubIo>>,
        inflight: Vec<(usize, u64)>,
    },
    /// In a merge window.
    Merging(Partial),
    /// Issued with the other writes of its merge group as one update, which the group's first
    /// piece carries (`Array::followers`): it finishes when that one does.
    Follows,
    Finished(Nanos),
}

#[derive(Debug)]
struct OpState {
    pieces: Vec<PieceState>,
    done_at: Option<Nanos>,
    /// Bytes written (0 for a read).
    write_bytes: u64,
}

/// A stripe in the controller's stripe cache, with the parity ranges not yet written.
#[derive(Debug)]
struct CachedStripe {
    key: (u64, u64),
    dirty: Vec<SubIo>,
    /// The stripe's data bytes written by partial writes while its parity is dirty, sorted and
    /// merged.
    written: Vec<(u64, u64)>,
    /// Last written as one full stripe.
    full: bool,
}

#[derive(Debug)]
struct MergeGroup {
    /// When the first write joined.
    first: Nanos,
    deadline: Nanos,
    members: Vec<(u64, usize)>,
    /// Covered byte ranges within the stripe's data, sorted and merged.
    covered: Vec<(u64, u64)>,
    /// Held past its window for the previous stripe's partial writes.
    held: bool,
}

/// A stripe that continues a full-stripe stream waits this many merge windows for the rest.
const STREAM_WINDOWS: u64 = 4;
/// A stripe waits for a busy parity engine at most this many windows from its first write.
const MERGE_DEFER_MAX: u64 = 20;

/// Whether a request reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoKind {
    Read,
    Write,
}

/// What a poll says about a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Poll {
    /// It completes at this time (perhaps in the future).
    Done(Nanos),
    /// Unknown yet; look again at this time.
    Pending(Nanos),
}

/// The timing model of an array (or of one disk): see the module documentation.
#[derive(Debug)]
pub struct Array {
    geo: Geometry,
    disks: Vec<Disk>,
    merge_window: Option<Nanos>,
    ctrl: Nanos,
    cache_cap: usize,
    cache: VecDeque<CachedStripe>,
    /// Disk requests nobody waits for (parity written back on eviction).
    background: Vec<(usize, u64)>,
    /// Index in `disks` of the parity engine, if modelled.
    engine: Option<usize>,
    /// The engine's cost per write it covers, in bytes at its rate.
    engine_write_bytes: u64,
    /// The pieces issued with a group's first piece (see [`PieceState::Follows`]), by that piece.
    followers: HashMap<(u64, usize), Vec<(u64, usize)>>,
    merges: HashMap<(u64, u64), MergeGroup>,
    /// Partial-stripe writes not yet finished, by stripe, and the stripe of each such piece
    /// (request, piece): a stream's next stripe may wait for them (see [`Array::advance`]).
    partials: HashMap<(u64, u64), u32>,
    partial_pieces: HashMap<(u64, usize), (u64, u64)>,
    /// The most write bytes outstanding at once lately, and when it was seen.
    peak_writes: (u64, Nanos),
    /// Writes that completed less than a merge window ago (completion time, bytes): their
    /// replies are on their way back, and the client sends the next writes when they arrive, so
    /// to the client they are still in flight.
    recent_done: VecDeque<(Nanos, u64)>,
    /// Merge groups written as one full stripe, and those whose window expired.
    merged_full: u64,
    merge_expired: u64,
    /// Requests whose completion time became known since [`Array::take_settled`] last ran.
    settled: Vec<u64>,
    /// Polls so far: see [`Array::polls`].
    polls: u64,
    ops: HashMap<u64, OpState>,
    next_op: u64,
    now: Nanos,
}

impl Array {
    /// The model of a validated RAID config.
    pub fn raid(cfg: &RaidConfig) -> Array {
        let inner = cfg.level.inner();
        let data_disks = cfg.data_disks() as u64;
        let chunk = match inner {
            Inner::Mirror => cfg.strip,
            _ => cfg.strip * data_disks,
        };
        let geo = Geometry {
            inner,
            groups: cfg.groups as u64,
            disks: cfg.disks as u64,
            strip: cfg.strip,
            data_disks,
            chunk,
            capacity: cfg.capacity(),
        };
        let merge = matches!(inner, Inner::Parity(_))
            .then_some(())
            .and(cfg.merge_window);
        let mut a = Self::build(geo, &cfg.disk, merge, cfg.stripe_cache, cfg.ctrl_latency);
        if let (Some(e), Inner::Parity(_)) = (cfg.parity_engine, inner) {
            a.engine = Some(a.disks.len());
            a.engine_write_bytes = (e.per_write.as_nanos() * e.rate as u128 / 1_000_000_000) as u64;
            let model = Arc::new(HddModel::seekless(e.per_update, e.rate));
            a.disks.push(Disk::new(model));
        }
        a
    }

    /// The model of one validated disk.
    pub fn single(cfg: &HddConfig) -> Array {
        let geo = Geometry {
            inner: Inner::Stripe,
            groups: 1,
            disks: 1,
            strip: cfg.size,
            data_disks: 1,
            chunk: cfg.size,
            capacity: cfg.size,
        };
        Self::build(geo, cfg, None, 0, Duration::ZERO)
    }

    fn build(
        geo: Geometry,
        disk: &HddConfig,
        merge: Option<Duration>,
        cache_cap: usize,
        ctrl: Duration,
    ) -> Array {
        let model = Arc::new(HddModel::new(disk.clone()));
        let n = (geo.groups * geo.disks) as usize;
        Array {
            disks: (0..n).map(|_| Disk::new(model.clone())).collect(),
            geo,
            merge_window: merge.map(nanos),
            ctrl: nanos(ctrl),
            cache_cap,
            cache: VecDeque::new(),
            background: Vec::new(),
            engine: None,
            engine_write_bytes: 0,
            followers: HashMap::new(),
            merges: HashMap::new(),
            partials: HashMap::new(),
            partial_pieces: HashMap::new(),
            peak_writes: (0, 0),
            recent_done: VecDeque::new(),
            merged_full: 0,
            merge_expired: 0,
            settled: Vec::new(),
            polls: 0,
            ops: HashMap::new(),
            next_op: 0,
            now: 0,
        }
    }

    pub fn capacity(&self) -> u64 {
        self.geo.capacity
    }

    /// Total time each disk's actuator has been busy.
    pub fn disk_busy(&self) -> Vec<Duration> {
        self.disks
            .iter()
            .map(|d| Duration::from_nanos(d.busy_total))
            .collect()
    }

    /// Merge groups written as one full stripe so far, and those whose window expired (their
    /// writes went out as partial-stripe writes).
    pub fn merge_counts(&self) -> (u64, u64) {
        (self.merged_full, self.merge_expired)
    }

    /// The requests whose completion time was decided since the last call (a merged stripe
    /// settles requests other than the one whose call made it): whoever waits for them should
    /// poll them now.
    pub fn take_settled(&mut self) -> Vec<u64> {
        std::mem::take(&mut self.settled)
    }

    /// How many times requests were polled so far (what waiting for them costs).
    pub fn polls(&self) -> u64 {
        self.polls
    }

    /// Begin a request at `now`; returns its handle for [`poll`](Self::poll).
    pub fn start(&mut self, now: Nanos, kind: IoKind, offset: u64, len: u64) -> u64 {
        self.advance(now);
        let now = self.now;
        let id = self.next_op;
        self.next_op += 1;
        self.ops.insert(
            id,
            OpState {
                pieces: Vec::new(),
                done_at: None,
                write_bytes: if kind == IoKind::Write { len } else { 0 },
            },
        );
        if kind == IoKind::Write {
            // How much the client keeps in flight: the most write bytes outstanding at once
            // lately (a stream's in-flight writes are all outstanding only between replies).
            // Through a transport some of them are always on their way (a reply back, the next
            // request out), which the writes completed within the last window stand for, less
            // one for each write that has arrived since (the one its reply let the client send).
            let window = self.merge_window.unwrap_or(0);
            while self
                .recent_done
                .front()
                .is_some_and(|&(t, _)| t + window <= now)
            {
                self.recent_done.pop_front();
            }
            self.recent_done.pop_front();
            let out: u64 = self.ops.values().map(|o| o.write_bytes).sum::<u64>()
                + self.recent_done.iter().map(|&(_, b)| b).sum::<u64>();
            let recent = self.peak_writes.1 + MERGE_DEFER_MAX * self.merge_window.unwrap_or(0);
            if out >= self.peak_writes.0 || now > recent {
                self.peak_writes = (out, now);
            }
        }
        for (group, inner_off, n) in self.geo.split_outer(offset, len) {
            self.plan(id, now, kind, group, inner_off, n);
        }
        self.finalize();
        id
    }

    /// Move to `now` and say whether request `op` is done. A done request is forgotten.
    pub fn poll(&mut self, now: Nanos, op: u64) -> Poll {
        self.polls += 1;
        self.advance(now);
        match self.take_done(op) {
            Some(t) => Poll::Done(t),
            None => Poll::Pending(self.next_wake()),
        }
    }

    /// When something is next due in the model (a poll then makes progress).
    pub fn next_wake(&self) -> Nanos {
        self.next_event()
            .unwrap_or(self.now + 1_000_000)
            .max(self.now)
    }

    /// The completion time of request `op` if it is settled, forgetting it (as a poll that
    /// finds it done does, without moving the model).
    pub fn take_done(&mut self, op: u64) -> Option<Nanos> {
        let t = self.ops.get(&op).and_then(|o| o.done_at)?;
        let bytes = self.ops.remove(&op).map_or(0, |o| o.write_bytes);
        if bytes > 0 && self.merge_window.is_some() {
            self.recent_done.push_back((t, bytes));
        }
        Some(t)
    }

    /// Add the pieces of one group's part of a request.
    fn plan(&mut self, op: u64, now: Nanos, kind: IoKind, group: u64, off: u64, len: u64) {
        let base = (group * self.geo.disks) as usize;
        match self.geo.inner {
            Inner::Stripe => {
                let ios = self.geo.split_strips(base, off, len);
                self.issue_piece(op, now, vec![ios]);
            }
            Inner::Mirror => {
                let members = base..base + self.geo.disks as usize;
                let ios = if kind == IoKind::Read {
                    // The mirror that will be free soonest, then the one whose head is nearest.
                    let disk = members
                        .min_by_key(|&d| (self.disks[d].backlog(), self.disks[d].distance(off)))
                        .unwrap_or(base);
                    vec![SubIo {
                        disk,
                        offset: off,
                        len,
                    }]
                } else {
                    members
                        .map(|disk| SubIo {
                            disk,
                            offset: off,
                            len,
                        })
                        .collect()
                };
                self.issue_piece(op, now, vec![ios]);
            }
            Inner::Parity(p) => {
                let row_bytes = self.geo.strip * self.geo.data_disks;
                let mut o = off;
                while o < off + len {
                    let row = o / row_bytes;
                    let end = ((row + 1) * row_bytes).min(off + len);
                    let (a, b) = (o - row * row_bytes, end - row * row_bytes);
                    self.plan_row(op, now, kind, group, row, p, a, b);
                    o = end;
                }
            }
        }
    }

    /// One stripe row's part of a request on a parity group: bytes `[a, b)` of the row's data.
    #[allow(clippy::too_many_arguments)]
    fn plan_row(
        &mut self,
        op: u64,
        now: Nanos,
        kind: IoKind,
        group: u64,
        row: u64,
        parity: u32,
        a: u64,
        b: u64,
    ) {
        let g = &self.geo;
        let n = g.disks;
        let base = group * n;
        let p_disk = (n - 1) - row % n;
        let disk_of = |slot: u64| (base + (p_disk + parity as u64 + slot) % n) as usize;
        let mut data = Vec::new();
        let (mut lo, mut hi) = (g.strip, 0);
        let mut s = a;
        while s < b {
            let slot = s / g.strip;
            let e = ((slot + 1) * g.strip).min(b);
            let in_strip = s - slot * g.strip;
            lo = lo.min(in_strip);
            hi = hi.max(in_strip + (e - s));
            data.push(SubIo {
                disk: disk_of(slot),
                offset: row * g.strip + in_strip,
                len: e - s,
            });
            s = e;
        }
        if kind == IoKind::Read {
            self.issue_piece(op, now, vec![data]);
            return;
        }
        let full = a == 0 && b == g.strip * g.data_disks;
        let (span_lo, span_hi) = if full { (0, g.strip) } else { (lo, hi) };
        let parity_ios: Vec<SubIo> = (0..parity as u64)
            .map(|i| SubIo {
                disk: (base + (p_disk + i) % n) as usize,
                offset: row * g.strip + span_lo,
                len: span_hi - span_lo,
            })
            .collect();
        let key = (group, row);
        if full {
            self.touch_cache(now, key, None);
            let mut ios = data;
            ios.extend(parity_ios);
            self.issue_piece(op, now, vec![ios]);
            return;
        }
        let partial = Partial {
            key,
            ranges: vec![(a, b)],
            data,
            parity: parity_ios,
            writes: 1,
        };
        let Some(window) = self.merge_window else {
            let steps = self.partial_steps(now, &partial);
            self.issue_piece(op, now, steps);
            return;
        };
        let op_state = self.ops.get_mut(&op).expect("op exists");
        let piece = op_state.pieces.len();
        op_state.pieces.push(PieceState::Merging(partial));
        let row_bytes = g.strip * g.data_disks;
        // A stripe right after one written full continues a full-stripe stream: the controller
        // holds it longer for the rest (a stream's writes may arrive a little spread out).
        let chunk = row * g.groups + group;
        let stream = chunk > 0 && {
            let prev = ((chunk - 1) % g.groups, (chunk - 1) / g.groups);
            self.cache.iter().rev().any(|e| e.key == prev && e.full)
        };
        let window = if stream {
            window * STREAM_WINDOWS
        } else {
            window
        };
        let m = self.merges.entry(key).or_insert_with(|| MergeGroup {
            first: now,
            deadline: now + window,
            members: Vec::new(),
            covered: Vec::new(),
            held: false,
        });
        m.members.push((op, piece));
        add_range(&mut m.covered, a, b);
        // A client that keeps a stripe's worth of writes in flight sends the rest of this stripe
        // as its earlier writes complete: while they keep coming, the stripe keeps waiting (up to
        // the cap), so a stream whose writes arrive spread out (through a transport, behind a
        // stalled stripe) still fills it instead of falling to partial writes.
        let base = self.merge_window.unwrap_or(0);
        if self.peak_writes.0 >= row_bytes {
            let cap = m.first + MERGE_DEFER_MAX * base;
            m.deadline = m.deadline.max((now + STREAM_WINDOWS * base).min(cap));
        }
        if m.covered == [(0, row_bytes)] {
            self.write_full_stripe(now, key);
        }
    }

    /// The steps of a partial-stripe write. Without a stripe cache: read old data and parity,
    /// then write new data and parity. With one, the new parity stays in the controller's cache
    /// (written when the stripe is evicted), and a cached stripe needs no reads either.
    fn partial_steps(&mut self, now: Nanos, w: &Partial) -> Vec<Vec<SubIo>> {
        let mut both = w.data.clone();
        both.extend(w.parity.iter().copied());
        let mut steps = if self.cache_cap == 0 {
            vec![both.clone(), both]
        } else {
            // A write that starts a stripe right after a cached one continues a sequential
            // stream: the controller expects the rest of the stripe and reads nothing.
            let (group, row) = w.key;
            let starts_row = w.data.first().is_some_and(|io| {
                io.offset == row * self.geo.strip
                    && (io.disk as u64 - group * self.geo.disks)
                        == ((self.geo.disks - 1) - row % self.geo.disks + self.geo.parity())
                            % self.geo.disks
            });
            let stream =
                starts_row && row > 0 && self.cache.iter().any(|e| e.key == (group, row - 1));
            if self.touch_cache(now, w.key, Some(w)) || stream {
                vec![w.data.clone()]
            } else {
                vec![both, w.data.clone()]
            }
        };
        if let Some(engine) = self.engine {
            // The engine's cost per write, as bytes at its rate (its model is a fixed cost per
            // request plus bytes at a rate).
            let len =
                w.data.iter().map(|io| io.len).sum::<u64>() + w.writes * self.engine_write_bytes;
            let head = self.disks[engine].distance(0);
            let at = steps.len() - 1;
            steps.insert(
                at,
                vec![SubIo {
                    disk: engine,
                    offset: head,
                    len,
                }],
            );
        }
        steps
    }

    /// Note a stripe as cached (most recently used), with a partial write's new dirty parity
    /// ranges and the data bytes it wrote or, for a full-stripe write, clean. Returns whether it
    /// already was cached. Once partial writes have written every data byte of a stripe, its
    /// parity is written at once, in the background, as a controller writes a stripe completed in
    /// its cache: the parity disks are then where a sequential stream left them, so the stream's
    /// next rows find every head in place. Otherwise dirty parity waits for the stripe's eviction,
    /// which writes it in the background, by then far from the disks' heads.
    fn touch_cache(&mut self, now: Nanos, key: (u64, u64), dirty: Option<&Partial>) -> bool {
        if self.cache_cap == 0 {
            return false;
        }
        let (mut entry, hit) = match self.cache.iter().position(|e| e.key == key) {
            Some(i) => (self.cache.remove(i).expect("index from position"), true),
            None => (
                CachedStripe {
                    key,
                    dirty: Vec::new(),
                    written: Vec::new(),
                    full: false,
                },
                false,
            ),
        };
        entry.full = dirty.is_none();
        match dirty {
            None => {
                entry.dirty.clear();
                entry.written.clear();
            }
            Some(w) => {
                for io in &w.parity {
                    match entry.dirty.iter_mut().find(|d| d.disk == io.disk) {
                        Some(d) => {
                            let end = (d.offset + d.len).max(io.offset + io.len);
                            d.offset = d.offset.min(io.offset);
                            d.len = end - d.offset;
                        }
                        None => entry.dirty.push(*io),
                    }
                }
                for &(a, b) in &w.ranges {
                    add_range(&mut entry.written, a, b);
                }
                if entry.written == [(0, self.geo.strip * self.geo.data_disks)] {
                    let parity = std::mem::take(&mut entry.dirty);
                    entry.written.clear();
                    let ids = self.submit_all(now, &parity);
                    self.background.extend(ids);
                }
            }
        }
        self.cache.push_back(entry);
        if self.cache.len() > self.cache_cap {
            if let Some(old) = self.cache.pop_front() {
                let ids = self.submit_all(now, &old.dirty);
                self.background.extend(ids);
            }
        }
        hit
    }

    /// A partial-stripe write to `key` finishes at `t`. Once its stripe has none left, the
    /// stream's next stripe, if held for them in its merge window, waits until a window after
    /// `t`: the client sends the rest of that stripe as these replies reach it.
    fn partial_done(&mut self, key: (u64, u64), t: Nanos) {
        match self.partials.get_mut(&key) {
            Some(n) if *n > 1 => {
                *n -= 1;
                return;
            }
            _ => {
                self.partials.remove(&key);
            }
        }
        let (Some(window), Some(next)) = (self.merge_window, self.geo.stream_neighbour(key, true))
        else {
            return;
        };
        if let Some(m) = self.merges.get_mut(&next).filter(|m| m.held) {
            let cap = m.first + MERGE_DEFER_MAX * window;
            m.deadline = m.deadline.max((t + window).min(cap));
        }
    }

    /// The merge group of `key` covers its stripe: write it whole for all its members.
    fn write_full_stripe(&mut self, now: Nanos, key: (u64, u64)) {
        let Some(m) = self.merges.remove(&key) else {
            return;
        };
        self.merged_full += 1;
        let (group, row) = key;
        let base = group * self.geo.disks;
        let ios: Vec<SubIo> = (0..self.geo.disks)
            .map(|d| SubIo {
                disk: (base + d) as usize,
                offset: row * self.geo.strip,
                len: self.geo.strip,
            })
            .collect();
        self.touch_cache(now, key, None);
        let refs = m.members.len() as u32;
        let ids: Vec<(usize, u64)> = ios
            .iter()
            .map(|io| {
                (
                    io.disk,
                    self.disks[io.disk].submit(now, io.offset, io.len, refs),
                )
            })
            .collect();
        for (op, piece) in m.members {
            if let Some(o) = self.ops.get_mut(&op) {
                o.pieces[piece] = PieceState::Steps {
                    pending: VecDeque::new(),
                    inflight: ids.clone(),
                };
            }
        }
    }

    /// The merge window of `key` expired: its writes go out together as one partial-stripe
    /// update, carried by the first one's piece; the others follow it.
    fn expire_merge(&mut self, now: Nanos, key: (u64, u64)) {
        let Some(m) = self.merges.remove(&key) else {
            return;
        };
        self.merge_expired += 1;
        let mut members = Vec::new();
        let mut parts = Vec::new();
        for (op, piece) in m.members {
            if let Some(PieceState::Merging(p)) = self.ops.get(&op).map(|o| &o.pieces[piece]) {
                members.push((op, piece));
                parts.push(p.clone());
            }
        }
        let Some(&leader) = members.first() else {
            return;
        };
        let update = Partial::combine(key, parts);
        let mut steps: VecDeque<Vec<SubIo>> = self.partial_steps(now, &update).into();
        let first = steps.pop_front().unwrap_or_default();
        let inflight = self.submit_all(now, &first);
        *self.partials.entry(key).or_insert(0) += 1;
        self.partial_pieces.insert(leader, key);
        self.ops.get_mut(&leader.0).expect("op exists").pieces[leader.1] = PieceState::Steps {
            pending: steps,
            inflight,
        };
        for &(op, piece) in &members[1..] {
            self.ops.get_mut(&op).expect("op exists").pieces[piece] = PieceState::Follows;
        }
        if members.len() > 1 {
            self.followers.insert(leader, members[1..].to_vec());
        }
    }

    fn submit_all(&mut self, now: Nanos, ios: &[SubIo]) -> Vec<(usize, u64)> {
        ios.iter()
            .map(|io| {
                (
                    io.disk,
                    self.disks[io.disk].submit(now, io.offset, io.len, 1),
                )
            })
            .collect()
    }

    fn issue_piece(&mut self, op: u64, now: Nanos, steps: Vec<Vec<SubIo>>) {
        let mut steps: VecDeque<Vec<SubIo>> = steps.into();
        let first = steps.pop_front().unwrap_or_default();
        let inflight = self.submit_all(now, &first);
        self.ops
            .get_mut(&op)
            .expect("op exists")
            .pieces
            .push(PieceState::Steps {
                pending: steps,
                inflight,
            });
    }

    /// When all of `inflight` complete, if known.
    fn step_done(&self, inflight: &[(usize, u64)]) -> Option<Nanos> {
        inflight.iter().try_fold(0, |acc: Nanos, &(d, id)| {
            self.disks[d].completion(id).map(|t| acc.max(t))
        })
    }

    /// The earliest time something is due: a dispatch, a merge deadline, or a next step.
    fn next_event(&self) -> Option<Nanos> {
        let disks = self.disks.iter().filter_map(|d| d.next_event());
        let merges = self.merges.values().map(|m| m.deadline);
        let steps = self
            .ops
            .values()
            .flat_map(|o| &o.pieces)
            .filter_map(|p| match p {
                PieceState::Steps { pending, inflight } if !pending.is_empty() => {
                    self.step_done(inflight)
                }
                _ => None,
            });
        disks.chain(merges).chain(steps).min()
    }

    /// Make every decision due up to `now`, in time order.
    fn advance(&mut self, now: Nanos) {
        let now = now.max(self.now);
        while let Some(t) = self.next_event().filter(|&t| t <= now) {
            let t = t.max(self.now);
            self.now = t;
            for d in &mut self.disks {
                d.advance(t);
            }
            let expired: Vec<(u64, u64)> = self
                .merges
                .iter()
                .filter(|(_, m)| m.deadline <= t)
                .map(|(&k, _)| k)
                .collect();
            // Writes waiting for the parity engine have not been processed yet: while it is busy,
            // an expired stripe keeps waiting (and may still fill up) until it is free, and then
            // goes out at once, so that the engine does not stand idle between updates.
            let engine_busy_until = self
                .engine
                .map(|e| self.disks[e].backlog().1)
                .filter(|&b| b > t);
            let window = self.merge_window.unwrap_or(0);
            let row_bytes = self.geo.strip * self.geo.data_disks;
            for key in expired {
                let m = &self.merges[&key];
                let within = t < m.first + MERGE_DEFER_MAX * window;
                // The stream's previous stripe still has partial writes in progress, and the
                // client keeps a stripe's worth of writes in flight: it sends this stripe's rest
                // as their replies reach it, so hold this one until they finish (`partial_done`
                // then gives it one more window). A client with less in flight could never
                // fill the stripe, and its writes are not held.
                let behind = self.peak_writes.0 >= row_bytes
                    && self
                        .geo
                        .stream_neighbour(key, false)
                        .is_some_and(|prev| self.partials.contains_key(&prev));
                let defer = engine_busy_until
                    .or(behind.then_some(t + window))
                    .filter(|_| within);
                match defer {
                    Some(d) => {
                        if let Some(m) = self.merges.get_mut(&key) {
                            m.deadline = d;
                            m.held |= behind;
                        }
                    }
                    None => self.expire_merge(t, key),
                }
            }
            // Pieces whose current step has completed issue their next one.
            let mut ready = Vec::new();
            for (&op, o) in &self.ops {
                for (i, p) in o.pieces.iter().enumerate() {
                    if let PieceState::Steps { pending, inflight } = p {
                        if !pending.is_empty() && self.step_done(inflight).is_some_and(|c| c <= t) {
                            ready.push((op, i));
                        }
                    }
                }
            }
            for (op, i) in ready {
                let (step, old) = match &mut self.ops.get_mut(&op).expect("op").pieces[i] {
                    PieceState::Steps { pending, inflight } => (
                        pending.pop_front().unwrap_or_default(),
                        std::mem::take(inflight),
                    ),
                    _ => continue,
                };
                for (d, id) in old {
                    self.disks[d].forget(id);
                }
                let new = self.submit_all(t, &step);
                if let PieceState::Steps { inflight, .. } =
                    &mut self.ops.get_mut(&op).expect("op").pieces[i]
                {
                    *inflight = new;
                }
            }
        }
        self.now = now;
        for d in &mut self.disks {
            d.advance(now);
        }
        self.finalize();
    }

    /// Settle pieces whose last step's completion is known, and requests whose pieces all are.
    fn finalize(&mut self) {
        let disks = &mut self.disks;
        self.background.retain(|&(d, id)| {
            let done = disks[d].completion(id).is_some();
            if done {
                disks[d].forget(id);
            }
            !done
        });
        let ids: Vec<u64> = self
            .ops
            .iter()
            .filter(|(_, o)| o.done_at.is_none())
            .map(|(&k, _)| k)
            .collect();
        for &op in &ids {
            let n = self.ops[&op].pieces.len();
            for i in 0..n {
                let finished = match &self.ops[&op].pieces[i] {
                    PieceState::Steps { pending, inflight } if pending.is_empty() => {
                        self.step_done(inflight).map(|t| (t, inflight.clone()))
                    }
                    _ => None,
                };
                if let Some((t, inflight)) = finished {
                    for (d, id) in inflight {
                        self.disks[d].forget(id);
                    }
                    if let Some(key) = self.partial_pieces.remove(&(op, i)) {
                        self.partial_done(key, t);
                    }
                    self.ops.get_mut(&op).expect("op").pieces[i] = PieceState::Finished(t);
                    for (f, j) in self.followers.remove(&(op, i)).unwrap_or_default() {
                        if let Some(o) = self.ops.get_mut(&f) {
                            o.pieces[j] = PieceState::Finished(t);
                        }
                    }
                }
            }
        }
        // Then whole requests, once every piece is finished (a follower's piece finishes with
        // its group's first, whichever request comes first here).
        for op in ids {
            let o = self.ops.get_mut(&op).expect("op");
            let all = o.pieces.iter().try_fold(0, |acc: Nanos, p| match p {
                PieceState::Finished(t) => Some(acc.max(*t)),
                _ => None,
            });
            if let Some(t) = all {
                o.done_at = Some(t + self.ctrl);
                self.settled.push(op);
            }
        }
    }
}

/// Add `[a, b)` to a sorted list of disjoint ranges, merging neighbours.
fn add_range(ranges: &mut Vec<(u64, u64)>, a: u64, b: u64) {
    ranges.push((a, b));
    ranges.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(ranges.len());
    for &(s, e) in ranges.iter() {
        match out.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => out.push((s, e)),
        }
    }
    *ranges = out;
}

impl Geometry {
    fn parity(&self) -> u64 {
        match self.inner {
            Inner::Parity(p) => p as u64,
            _ => 0,
        }
    }

    /// The stripe a sequential stream writes just before (`next` false) or after `key`
    /// (group, row): the outer RAID 0 takes the groups in turn.
    fn stream_neighbour(&self, (group, row): (u64, u64), next: bool) -> Option<(u64, u64)> {
        let chunk = row * self.groups + group;
        let n = if next {
            chunk.checked_add(1)?
        } else {
            chunk.checked_sub(1)?
        };
        Some((n % self.groups, n / self.groups))
    }

    /// Split a logical range by group: (group, offset inside the group, length).
    fn split_outer(&self, offset: u64, len: u64) -> Vec<(u64, u64, u64)> {
        let mut out = Vec::new();
        let mut o = offset;
        while o < offset + len {
            let chunk = o / self.chunk;
            let end = ((chunk + 1) * self.chunk).min(offset + len);
            let group = chunk % self.groups;
            let inner = (chunk / self.groups) * self.chunk + (o - chunk * self.chunk);
            out.push((group, inner, end - o));
            o = end;
        }
        out
    }

    /// Disk requests of a plain striped group starting at disk index `base`.
    fn split_strips(&self, base: usize, offset: u64, len: u64) -> Vec<SubIo> {
        let mut out = Vec::new();
        let mut o = offset;
        while o < offset + len {
            let strip = o / self.strip;
            let end = ((strip + 1) * self.strip).min(offset + len);
            let row = strip / self.data_disks;
            out.push(SubIo {
                disk: base + (strip % self.data_disks) as usize,
                offset: row * self.strip + (o - strip * self.strip),
                len: end - o,
            });
            o = end;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Poll every request until it completes; their completion times.
    fn run(a: &mut Array, ops: &[u64]) -> Vec<Nanos> {
        ops.iter()
            .map(|&op| {
                let mut now = a.now;
                loop {
                    match a.poll(now, op) {
                        Poll::Done(t) => break t,
                        Poll::Pending(t) => now = t,
                    }
                }
            })
            .collect()
    }

    #[test]
    fn writes_to_a_stripe_that_expire_together_are_one_parity_update() {
        let cfg = RaidConfig::study_raid60(1 << 40);
        let e = cfg
            .parity_engine
            .expect("the study's array has a parity engine");
        let mut a = Array::raid(&cfg);
        // Four 4 KiB writes to the start of one stripe, together: a quarter of a strip, so the
        // merge window expires and they go out as one partial-stripe update.
        let ops: Vec<u64> = (0..4)
            .map(|i| a.start(0, IoKind::Write, i * 4096, 4096))
            .collect();
        let done = run(&mut a, &ops);
        assert!(
            done.iter().all(|&t| t == done[0]),
            "complete together: {done:?}"
        );
        assert_eq!(a.merge_counts(), (0, 1));
        let engine = a.disk_busy()[a.engine.expect("engine")];
        let want =
            e.per_update + 4 * e.per_write + Duration::from_nanos(16384 * 1_000_000_000 / e.rate);
        let diff = engine.abs_diff(want);
        assert!(
            diff < Duration::from_micros(1),
            "one update: {engine:?}, want {want:?}"
        );
    }

    #[test]
    fn a_stripe_written_whole_by_partial_writes_writes_its_parity_at_once() {
        let mut cfg = RaidConfig::study_raid60(1 << 40);
        cfg.stripe_cache = 1 << 10; // nothing is evicted here
        let mut a = Array::raid(&cfg);
        // Row 0 of group 0, one 64 KiB write at a time (each expires alone). The first one
        // reads the old data and parity; the parity disks (P on the group's last disk, Q on its
        // first) are written once the eighth has gone, not when the stripe leaves the cache.
        let (p, q) = (9, 0);
        let mut now = 0;
        let mut before = (Duration::ZERO, Duration::ZERO);
        for i in 0..8u64 {
            before = (a.disk_busy()[p], a.disk_busy()[q]);
            let op = a.start(now, IoKind::Write, i << 16, 1 << 16);
            now = run(&mut a, &[op])[0];
        }
        a.advance(now + 100_000_000);
        let strip_write = Duration::from_nanos((1u64 << 16) * 1_000_000_000 / cfg.disk.media_rate);
        assert!(a.disk_busy()[p] >= before.0 + strip_write, "P not written");
        assert!(a.disk_busy()[q] >= before.1 + strip_write, "Q not written");
        let (full, expired) = a.merge_counts();
        assert_eq!((full, expired), (0, 8));
    }
}

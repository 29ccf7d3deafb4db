//! Transmission phase: request parsing, validation, execution and replies.
//!
//! Worker model: a connection runs up to `workers` threads, started when a
//! request needs one (to take over reading, or to execute a delegated
//! request) and all ended when the connection parks (see [`End::Parked`]).
//! One thread at a time holds the *reader role* and reads one request (a write payload goes
//! into that worker's own reusable buffer). Requests of a kind that has been
//! fast are then executed *inline* by the same thread, which keeps reading
//! afterwards; slower kinds are handed off (the role passes to a waiting
//! worker first). A waiting worker also rescues the role from an inline
//! request that runs longer than a tick, so a slow request never holds up
//! later ones for more than about a millisecond, and replies go out in
//! completion order. A slow request read while a worker waits idle is
//! *delegated*: queued for that worker, which executes it, while the reader
//! keeps reading, so pipelined slow requests reach the export as fast as
//! they arrive instead of one thread wakeup apart (a device that merges
//! requests arriving together, like an emulated RAID's full-stripe merge,
//! sees them together). Replies are queued whole and written by one thread at
//! a time; inline replies are batched until the reader would block. This
//! keeps queue-depth-1 traffic free of thread switches and lets pipelined
//! traffic use one read and one write system call per batch.
//!
//! Memory: request data lives in buffers charged to the server's budget
//! (memory.rs). The reader takes a read's buffer before it dispatches the
//! request and a write's buffer once its payload starts arriving, waiting
//! while the budget is spent, so an over-budget server stops reading. Reads
//! larger than a piece are streamed a piece at a time, so a client that
//! never reads its replies pins one piece per connection, not the whole read.
//! Deferred replies are bounded per connection: a worker whose reply finds
//! the queue full waits for the writer instead of growing the queue.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::export::{BlockSizes, ErrorKind, Export, ExportError, ExportResult, ZeroFlags};
use crate::handshake::{discard, Negotiated};
use crate::memory::{LargeBuf, Memory, Pool, PIECE};
use crate::observe::{self, ObserverSlot};
use crate::proto::*;

/// Largest write payload that is read and thrown away when the request is
/// rejected; above it (and above the export's maximum block size) the
/// connection is dropped instead. The spec says lengths below 32 MiB should
/// not be treated as denial of service.
pub const WRITE_DISCARD_LIMIT: u32 = 32 << 20;

/// The parts of the negotiated state request validation depends on.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Params {
    pub(crate) size: u64,
    pub(crate) flags: u16,
    pub(crate) bs: BlockSizes,
    pub(crate) structured: bool,
    pub(crate) block_size_negotiated: bool,
}

/// A validated request, ready to execute.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Job {
    Read {
        offset: u64,
        len: u32,
    },
    /// The payload is in the worker's data buffer.
    Write {
        offset: u64,
        len: u32,
        fua: bool,
    },
    Flush,
    Trim {
        offset: u64,
        len: u32,
        fua: bool,
    },
    WriteZeroes {
        offset: u64,
        len: u32,
        flags: ZeroFlags,
        fua: bool,
    },
    Cache {
        offset: u64,
        len: u32,
    },
}

/// A request refused before reaching the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Reject {
    pub(crate) errno: u32,
    pub(crate) msg: &'static str,
}

fn reject(errno: u32, msg: &'static str) -> Reject {
    Reject { errno, msg }
}

fn aligned(offset: u64, len: u64, min: u32) -> bool {
    let mask = u64::from(min) - 1;
    (offset | len) & mask == 0
}

/// Checks a request against the negotiated parameters. Pure, so the error
/// choices are unit-testable: unknown command or flag -> EINVAL; writes to a
/// read-only export -> EPERM; zero length, or READ/WRITE longer than the
/// maximum block size -> EINVAL; past the end -> ENOSPC for writes and
/// write-zeroes, EINVAL otherwise; unaligned -> EINVAL only if the client
/// negotiated block sizes (otherwise the server does read-modify-write).
pub(crate) fn validate(req: &Request, p: &Params) -> Result<Job, Reject> {
    let read_only = p.flags & FLAG_READ_ONLY != 0;
    let mut allowed = 0;
    if p.flags & FLAG_SEND_FUA != 0 {
        allowed |= CMD_FLAG_FUA;
    }
    match req.typ {
        CMD_READ if p.structured => allowed |= CMD_FLAG_DF,
        CMD_WRITE_ZEROES => {
            allowed |= CMD_FLAG_NO_HOLE;
            if p.flags & FLAG_SEND_FAST_ZERO != 0 {
                allowed |= CMD_FLAG_FAST_ZERO;
            }
        }
        CMD_READ | CMD_WRITE | CMD_FLUSH | CMD_TRIM | CMD_CACHE => {}
        _ => return Err(reject(EINVAL, "unknown command")),
    }
    if req.flags & !allowed != 0 {
        return Err(reject(EINVAL, "invalid command flags"));
    }
    let fua = req.flags & CMD_FLAG_FUA != 0;
    if req.typ == CMD_FLUSH {
        // Offset and length are reserved; tolerate garbage in them.
        return Ok(Job::Flush);
    }
    let writes = matches!(req.typ, CMD_WRITE | CMD_TRIM | CMD_WRITE_ZEROES);
    if writes && read_only {
        return Err(reject(EPERM, "export is read-only"));
    }
    match req.typ {
        CMD_TRIM if p.flags & FLAG_SEND_TRIM == 0 => {
            return Err(reject(EINVAL, "trim not supported"))
        }
        CMD_WRITE_ZEROES if p.flags & FLAG_SEND_WRITE_ZEROES == 0 => {
            return Err(reject(EINVAL, "write zeroes not supported"))
        }
        _ => {}
    }
    let len = req.length;
    if len == 0 {
        return Err(reject(EINVAL, "zero length"));
    }
    // Only READ and WRITE need a buffer of `len` bytes; the others are
    // accepted at any length the export size allows.
    if matches!(req.typ, CMD_READ | CMD_WRITE) && len > p.bs.max {
        return Err(reject(EINVAL, "length exceeds maximum block size"));
    }
    let past_end = match req.offset.checked_add(u64::from(len)) {
        Some(end) => end > p.size,
        None => true,
    };
    if past_end {
        return Err(if matches!(req.typ, CMD_WRITE | CMD_WRITE_ZEROES) {
            reject(ENOSPC, "request beyond end of export")
        } else {
            reject(EINVAL, "request beyond end of export")
        });
    }
    if p.block_size_negotiated && !aligned(req.offset, u64::from(len), p.bs.min) {
        return Err(reject(EINVAL, "request not aligned to minimum block size"));
    }
    let offset = req.offset;
    Ok(match req.typ {
        CMD_READ => Job::Read { offset, len },
        CMD_WRITE => Job::Write { offset, len, fua },
        CMD_TRIM => Job::Trim { offset, len, fua },
        CMD_WRITE_ZEROES => Job::WriteZeroes {
            offset,
            len,
            fua,
            flags: ZeroFlags {
                no_hole: req.flags & CMD_FLAG_NO_HOLE != 0,
                fast_zero: req.flags & CMD_FLAG_FAST_ZERO != 0,
            },
        },
        _ => Job::Cache { offset, len },
    })
}

/// A range cut at `min`-block boundaries: an unaligned head inside one
/// block, an aligned middle, an unaligned tail inside one block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Split {
    pub(crate) head: (u64, u64),
    pub(crate) mid: (u64, u64),
    pub(crate) tail: (u64, u64),
}

pub(crate) fn split(offset: u64, len: u64, min: u32) -> Split {
    let min = u64::from(min);
    let end = offset + len;
    let a = offset.next_multiple_of(min).min(end);
    let b = (end - end % min).max(a);
    Split {
        head: (offset, a - offset),
        mid: (a, b - a),
        tail: (b, end - b),
    }
}

/// Replies waiting to be written, and who is writing them. Waiters for
/// room in `pending` or for the writer role wait on `Conn::out_cv`.
#[derive(Default)]
struct OutQueue {
    pending: Vec<u8>,
    spare: Vec<u8>,
    /// A worker is in `flush_pending`; it writes whatever others append.
    flushing: bool,
    failed: bool,
}

/// Feed `ns` (capped at u32::MAX) into the moving average `avg` (weight 1/8 for the new
/// sample): the request timings that decide what runs inline and whether batches pay.
fn record_ns(avg: &AtomicU64, ns: u128) {
    let ns = ns.min(u128::from(u32::MAX)) as u64;
    let old = avg.load(Ordering::Relaxed);
    avg.store(old - old / 8 + ns / 8, Ordering::Relaxed);
}

/// Above this, deferred replies are written even if more requests are
/// buffered, and further replies wait for the writer: it bounds the queue's
/// memory (twice this plus one reply, with the batch being written) and
/// latency.
pub(crate) const MAX_DEFERRED: usize = 128 << 10;
/// Replies above this are never deferred or copied into the queue.
pub(crate) const MAX_DEFERRED_REPLY: usize = 64 << 10;
/// How often a waiting worker checks whether an inline request is taking
/// long enough that it should take over reading.
const RESCUE_TICK: Duration = Duration::from_micros(500);
/// After this many ticks without inline work the rescuer sleeps untimed, so
/// idle connections cost no wakeups.
const IDLE_TICKS: u32 = 200;
/// Requests whose kind recently took longer than this on average are not
/// run inline but handed off at once.
const SLOW_NS: u64 = 50_000;
/// The most buffered reads the reader takes into one batch ([`Export::read_batch`]).
const READ_BATCH: usize = 32;
/// The most buffered writes the reader takes into one batch ([`Export::write_batch`]).
const WRITE_BATCH: usize = 32;
/// While batches are slow, one chance in this many batches anyway (a probe).
const BATCH_PROBE: u64 = 64;

/// How long a connection with nothing in flight waits for its next request before it parks
/// (gives its threads back; the server's poller restarts it when the client speaks). A restart
/// costs thread starts and the connection's learned request timings (which decide what runs
/// inline), so this is long against a client's pauses within a workload: at 50 ms, a fio job
/// of 64 KiB writes at queue depth 8 (crates/cli/tests/trace.rs) sometimes reached only 4-6
/// requests in flight instead of 8 on the loaded test machine; at 1 s, 8 every time. Idle
/// connections still give their threads back within a second.
const PARK_AFTER: Duration = Duration::from_secs(1);

/// How a connection's transmission ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum End {
    /// The client disconnected or the connection failed; true if it was dropped for
    /// stalling (a socket timeout).
    Closed { stalled: bool },
    /// Nothing came for [`PARK_AFTER`] with nothing in flight: the caller waits for input
    /// without a thread and calls `run` again (with a fresh reader: nothing was buffered).
    Parked,
}

/// Waits up to the given time for the transport to have input (or a hangup); false if
/// nothing came.
pub(crate) type WaitInput<'a> = &'a (dyn Fn(Duration) -> bool + Sync);

/// A request read by the reader and queued for a waiting worker to execute.
type Delegated<'m> = (u64, Job, Buffers<'m>);

/// What a waiting worker gets.
enum Acquired<'m> {
    /// The reader role.
    Reader,
    /// A delegated request to execute.
    Job(Delegated<'m>),
    /// The connection closed and nothing is left to execute.
    Closed,
}

/// Who may read the next request. Protected by `Conn::role`.
#[derive(Default)]
struct Role<'m> {
    /// Workers waiting in `acquire_reader` (followers and the rescuer).
    waiting: usize,
    /// Delegated requests not yet taken by a waiting worker (never more than `waiting`).
    jobs: std::collections::VecDeque<Delegated<'m>>,
    /// A worker holds the reader role (is reading or about to).
    reader_busy: bool,
    /// The token of a request being executed inline by the worker that
    /// released the reader role for it; it resumes reading afterwards
    /// unless a waiting worker rescued the role in the meantime.
    inline: Option<u64>,
    /// The kind (`kind_index`) of the inline request, if a single one (not a read batch).
    inline_kind: Option<usize>,
    next_token: u64,
    /// One waiting worker does timed waits to rescue slow inline work.
    rescuer: bool,
    /// The rescuer sleeps untimed because the connection looked idle.
    rescuer_asleep: bool,
    closed: bool,
    /// The connection went quiet and is handed back to the server's poller (see `run`):
    /// every worker leaves.
    parked: bool,
    /// Worker threads running, this one included; started only when a request needs one, up
    /// to `max_workers`, so a connection's threads follow its requests in flight.
    workers: usize,
    /// Started but not yet waiting: counted as waiting, so a request is not given two.
    starting: usize,
    max_workers: usize,
}

/// A write payload as the worker holds it.
enum Payload {
    None,
    Pooled(Box<[u8]>),
    Large(LargeBuf),
}

/// The largest read-modify-write block a worker keeps between requests.
pub(crate) const KEPT_BLOCK: usize = 4 << 10;

/// The buffers of the request a worker is handling, and the budget they
/// cost. Released after each request (and on drop, whatever path the worker
/// leaves by), so an idle worker holds nothing but its RMW block.
struct Buffers<'m> {
    mem: &'m Memory,
    payload: Payload,
    /// A read's reply: header room followed by the data, or one piece of a
    /// streamed read.
    reply: Option<Box<[u8]>>,
    /// Budget held for `payload` and `reply`.
    charged: u64,
    /// Budget this worker holds for other requests it serves together with this one (a read
    /// batch): counted as held should it have to wait, so waiting can never deadlock on it.
    held_elsewhere: u64,
    /// One block for read-modify-write (at most the export's minimum block
    /// size, 64 KiB); kept across requests.
    block: Vec<u8>,
}

impl<'m> Buffers<'m> {
    fn new(mem: &'m Memory) -> Self {
        Buffers {
            mem,
            payload: Payload::None,
            reply: None,
            charged: 0,
            held_elsewhere: 0,
            block: Vec::new(),
        }
    }

    /// Gives the request's buffers back to the pool and its bytes back to
    /// the budget.
    fn finish(&mut self) {
        match std::mem::replace(&mut self.payload, Payload::None) {
            Payload::Pooled(b) => self.mem.pool.put(b),
            Payload::Large(b) => drop(b),
            Payload::None => {}
        }
        if let Some(b) = self.reply.take() {
            self.mem.pool.put(b);
        }
        if self.block.capacity() > KEPT_BLOCK {
            self.block = Vec::new();
        }
        self.mem.budget.release(std::mem::take(&mut self.charged));
    }
}

impl Drop for Buffers<'_> {
    fn drop(&mut self) {
        self.finish();
    }
}

fn grow(v: &mut Vec<u8>, len: usize) -> &mut [u8] {
    if v.len() < len {
        v.resize(len, 0);
    }
    &mut v[..len]
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

pub(crate) struct Conn<'a, R, W> {
    reader: Mutex<BufReader<R>>,
    writer: Mutex<W>,
    out: Mutex<OutQueue>,
    /// Room in `pending`, or the writer role, became free (or writing failed).
    out_cv: Condvar,
    role: Mutex<Role<'a>>,
    /// Waiting workers other than the rescuer.
    follow_cv: Condvar,
    /// The rescuer.
    rescue_cv: Condvar,
    /// Moving average of execution time (ns) per kind: read, write, other.
    ewma_ns: [AtomicU64; 3],
    /// Moving average of a batched read's share of its batch's time (ns), and a count of the
    /// batches declined since, to probe again now and then (see `batchable`).
    batch_ns: AtomicU64,
    batch_declined: AtomicU64,
    /// The same for write batches.
    write_batch_ns: AtomicU64,
    write_batch_declined: AtomicU64,
    /// Requests being executed now, inline or handed off.
    executing: AtomicUsize,
    export: &'a dyn Export,
    mem: &'a Memory,
    write_gate: &'a parking_lot::RwLock<()>,
    p: Params,
    on_fatal: &'a (dyn Fn() + Sync),
    /// Request observer hook (tracing) and this connection's id for it.
    observer: &'a ObserverSlot,
    conn_id: u64,
    /// The connection was dropped because the client stalled mid-request or did not take a
    /// reply within the socket's timeout.
    stalled: std::sync::atomic::AtomicBool,
    /// Time of the last socket read, while observed (requests found already buffered arrived
    /// with it). Only touched under the reader lock.
    last_fill: Mutex<Option<Instant>>,
    /// Lets the connection park when idle; None: it never parks (a stream without a socket).
    wait_input: Option<WaitInput<'a>>,
}

/// Serves requests until the client disconnects or the transport fails, or (with
/// `wait_input`) until the connection has been idle for [`PARK_AFTER`] with nothing in flight.
/// `on_fatal` must unblock a thread stuck reading the transport (e.g. shut
/// the socket down); it is called when a reply cannot be written. Up to `workers` threads
/// serve the connection (the calling one included), started as requests need them.
/// `conn_id` names the connection to request observers across parkings.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run<R: Read + Send, W: Write + Send>(
    reader: BufReader<R>,
    writer: W,
    n: &Negotiated,
    workers: usize,
    mem: &Memory,
    on_fatal: &(dyn Fn() + Sync),
    conn_id: u64,
    wait_input: Option<WaitInput<'_>>,
) -> End {
    let conn = Conn {
        reader: Mutex::new(reader),
        writer: Mutex::new(writer),
        out: Mutex::new(OutQueue::default()),
        out_cv: Condvar::new(),
        role: Mutex::new(Role {
            workers: 1,
            max_workers: workers.max(1),
            ..Role::default()
        }),
        follow_cv: Condvar::new(),
        rescue_cv: Condvar::new(),
        ewma_ns: Default::default(),
        batch_ns: AtomicU64::new(0),
        batch_declined: AtomicU64::new(0),
        write_batch_ns: AtomicU64::new(0),
        write_batch_declined: AtomicU64::new(0),
        executing: AtomicUsize::new(0),
        export: &*n.entry.export,
        mem,
        write_gate: &n.entry.write_gate,
        p: Params {
            size: n.size,
            flags: n.flags,
            bs: n.entry.block_sizes,
            structured: n.structured,
            block_size_negotiated: n.block_size_negotiated,
        },
        on_fatal,
        observer: &n.entry.observer,
        conn_id,
        last_fill: Mutex::new(None),
        stalled: Default::default(),
        wait_input,
    };
    std::thread::scope(|s| conn.worker_loop(s, false));
    if conn.role.lock().parked {
        return End::Parked;
    }
    End::Closed {
        stalled: conn.stalled.load(Ordering::Relaxed),
    }
}

/// `Write::write_all_vectored`, which is not stable yet.
fn write_all_vectored<W: Write>(w: &mut W, mut bufs: &mut [io::IoSlice<'_>]) -> io::Result<()> {
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(n) => io::IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

fn read_exact_or_eof<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<bool> {
    match r.read_exact(buf) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// What one turn at the reader produced.
enum Next {
    Job(u64, Job),
    Rejected(u64, Reject),
    /// `NBD_CMD_DISC` or end of stream: stop reading, finish in-flight work.
    Stop,
    /// Nothing came for [`PARK_AFTER`] and nothing is in flight: the connection is parked.
    Park,
}

fn kind_index(job: &Job) -> usize {
    match job {
        Job::Read { .. } => 0,
        Job::Write { .. } => 1,
        _ => 2,
    }
}

impl<'a, R: Read + Send, W: Write + Send> Conn<'a, R, W> {
    // ---- scheduling ---------------------------------------------------------
    //
    // The worker holding the reader role reads one request. If requests of
    // that kind have been fast, it runs it *inline*: it releases the role
    // without waking anybody, executes, defers the reply, and takes the role
    // straight back. At queue depth 1 and for fast exports this costs no
    // thread switch at all, and pipelined replies leave in batches. Because
    // an inline request might unexpectedly block (a cache miss, say), one
    // waiting worker, the rescuer, wakes every RESCUE_TICK and takes over
    // reading if the same inline request is still running, so later requests
    // are delayed by at most about a millisecond and then complete out of
    // order as usual. Kinds that are slow on average skip this and hand the
    // role to a waiting worker before executing.

    /// `fresh`: a thread just started for this connection (counted in `Role::starting`).
    fn worker_loop<'s>(&'s self, s: &'s std::thread::Scope<'s, '_>, mut fresh: bool) {
        let mut bufs = Buffers::new(self.mem);
        let mut holding = false;
        loop {
            if !holding {
                let got = self.acquire_reader(std::mem::take(&mut fresh));
                match got {
                    Acquired::Reader => {}
                    Acquired::Closed => return,
                    Acquired::Job((handle, job, mut b)) => {
                        // `executing` was counted by the delegating reader.
                        let res = self.timed(kind_index(&job), || {
                            self.execute(handle, job, &mut b, false)
                        });
                        self.executing.fetch_sub(1, Ordering::Relaxed);
                        b.finish();
                        if let Err(e) = res {
                            self.fail_with(&e);
                            return;
                        }
                        continue;
                    }
                }
            }
            let (next, more_buffered, writes_follow) = {
                let mut r = self.reader.lock();
                let next = self.next_request(&mut r, &mut bufs);
                let writes_follow = matches!(next, Ok(Next::Job(_, Job::Write { fua: false, .. })))
                    && self.next_batchable_write(&r);
                (next, r.buffer().len() >= REQUEST_LEN, writes_follow)
            };
            let (handle, job) = match next {
                Ok(Next::Job(h, j)) => (h, j),
                Ok(Next::Rejected(h, rej)) => {
                    // Cheap to answer; keep reading.
                    holding = true;
                    if self.send_error(h, rej.errno, rej.msg, true).is_err() {
                        self.fail();
                        return;
                    }
                    continue;
                }
                Ok(Next::Stop) => {
                    self.close();
                    let _ = self.flush_pending();
                    return;
                }
                Ok(Next::Park) => {
                    self.role.lock().parked = true;
                    self.close();
                    return;
                }
                Err(e) => {
                    self.fail_with(&e);
                    return;
                }
            };
            if let (Job::Read { offset, len }, true) = (job, more_buffered) {
                if self.batchable(offset, len) && self.batch_allowed() {
                    match self.read_batch(s, handle, offset, len, bufs) {
                        Ok(still_reader) => {
                            holding = still_reader;
                            bufs = Buffers::new(self.mem);
                            continue;
                        }
                        Err(e) => {
                            self.fail_with(&e);
                            return;
                        }
                    }
                }
            }
            if let (Job::Write { offset, len, .. }, true) = (job, writes_follow) {
                if self.write_batchable(offset, len)
                    && self.batch_allowed_by(&self.write_batch_ns, &self.write_batch_declined)
                {
                    match self.write_batch(s, handle, offset, len, bufs) {
                        Ok(still_reader) => {
                            holding = still_reader;
                            bufs = Buffers::new(self.mem);
                            continue;
                        }
                        Err(e) => {
                            self.fail_with(&e);
                            return;
                        }
                    }
                }
            }
            let kind = kind_index(&job);
            let slow = self.ewma_ns[kind].load(Ordering::Relaxed) > SLOW_NS;
            // A slow request is handed off only when another one could use the reader now: one
            // already buffered, or others in flight (a pipelining client). A client waiting for
            // each reply (queue depth 1) gets it inline, which saves waking a worker per request
            // (a cache hit on a device: ~100 us of I/O, the wakeup a tenth of it); should the
            // client send more meanwhile, the rescuer takes over reading after a tick.
            // A kind slower than a rescue tick is not run inline even then: the client may send
            // its next request meanwhile (a pipelining client whose replies all just left), and
            // it would wait a tick to be read; one wakeup is little beside such a request.
            let very_slow =
                self.ewma_ns[kind].load(Ordering::Relaxed) > RESCUE_TICK.as_nanos() as u64;
            let parallel = more_buffered || very_slow || self.executing.load(Ordering::Relaxed) > 0;
            self.executing.fetch_add(1, Ordering::Relaxed);
            if slow && parallel {
                match self.delegate(s, handle, job, bufs) {
                    Ok(()) => {
                        // Still the reader: read on while a waiting worker executes it.
                        holding = true;
                        bufs = Buffers::new(self.mem);
                        continue;
                    }
                    Err(b) => bufs = b,
                }
            }
            let res = if slow && parallel {
                self.hand_off(s);
                holding = false;
                self.timed(kind, || self.execute(handle, job, &mut bufs, false))
            } else {
                let token = self.go_inline(s, Some(kind));
                let res = self.timed(kind, || self.execute(handle, job, &mut bufs, true));
                holding = self.finish_inline(token);
                res
            };
            self.executing.fetch_sub(1, Ordering::Relaxed);
            bufs.finish();
            if let Err(e) = res {
                self.fail_with(&e);
                return;
            }
        }
    }

    /// Whether a read can join a batch: the export batches reads, the reply fits one buffer,
    /// and the read is aligned (no read-modify-write of a partial block).
    fn batchable(&self, offset: u64, len: u32) -> bool {
        self.export.batches_reads()
            && self.reply_prefix() + len as usize <= PIECE
            && aligned(offset, u64::from(len), self.min())
    }

    /// Whether to start a batch now. A batch's replies leave together, so batches that were
    /// slow per read (misses among them) stop batching, and those reads run in parallel on the
    /// workers instead; every BATCH_PROBE-th chance batches anyway, so a workload that turns to
    /// hits batches again.
    fn batch_allowed(&self) -> bool {
        self.batch_allowed_by(&self.batch_ns, &self.batch_declined)
    }

    /// `batch_allowed` for the batches whose average is `ns` and declines `declined`.
    fn batch_allowed_by(&self, ns: &AtomicU64, declined: &AtomicU64) -> bool {
        ns.load(Ordering::Relaxed) <= SLOW_NS
            || declined.fetch_add(1, Ordering::Relaxed) % BATCH_PROBE == BATCH_PROBE - 1
    }

    /// Whether a write can join a batch: the export batches writes, the payload fits one
    /// buffer, and the write is aligned (no read-modify-write of a partial block).
    fn write_batchable(&self, offset: u64, len: u32) -> bool {
        self.export.batches_writes()
            && len as usize <= PIECE
            && aligned(offset, u64::from(len), self.min())
    }

    /// The next buffered request, if it is a write that can join a batch with its whole
    /// payload buffered behind its header (the batch never waits for the client), no FUA (a
    /// FUA write or a flush ends a batch), and its payload fits the budget now.
    fn next_batchable_write(&self, r: &BufReader<R>) -> bool {
        let Some(hdr) = r.buffer().get(..REQUEST_LEN) else {
            return false;
        };
        let hdr: &[u8; REQUEST_LEN] = hdr.try_into().expect("a slice of REQUEST_LEN bytes");
        let Ok(req) = parse_request(hdr) else {
            return false;
        };
        let budget = &self.mem.budget;
        req.typ == CMD_WRITE
            && req.flags == 0
            && req.length > 0
            && r.buffer().len() >= REQUEST_LEN + req.length as usize
            && req
                .offset
                .checked_add(u64::from(req.length))
                .is_some_and(|end| end <= self.p.size)
            && self.write_batchable(req.offset, req.length)
            && budget.used() + Pool::cost(req.length as usize) <= budget.limit()
    }

    /// The next buffered request, if it is a whole header of a read that can join a batch and
    /// its reply buffer fits the budget now (a batch never waits for budget it holds itself).
    fn next_batchable(&self, r: &BufReader<R>) -> bool {
        let Some(hdr) = r.buffer().get(..REQUEST_LEN) else {
            return false;
        };
        let hdr: &[u8; REQUEST_LEN] = hdr.try_into().expect("a slice of REQUEST_LEN bytes");
        let Ok(req) = parse_request(hdr) else {
            return false;
        };
        let budget = &self.mem.budget;
        req.typ == CMD_READ
            && req.flags == 0
            && req.length > 0
            && req
                .offset
                .checked_add(u64::from(req.length))
                .is_some_and(|end| end <= self.p.size)
            && self.batchable(req.offset, req.length)
            && budget.used() + Pool::cost(self.reply_prefix() + req.length as usize)
                <= budget.limit()
    }

    /// A batch begun by `first` (handle, offset, length, buffers), with the requests buffered
    /// behind it, up to `max`, while `batchable` says the next one is of the batch's kind:
    /// those `member` accepts join it (it gives their offset and length); anything else read
    /// meanwhile is executed here, inline, never dropped; rejected requests are answered.
    /// Returns the batch and whether the connection stopped.
    #[allow(clippy::type_complexity)]
    fn gather_batch<'b>(
        &'b self,
        first: (u64, u64, u32, Buffers<'b>),
        max: usize,
        batchable: impl Fn(&BufReader<R>) -> bool,
        member: impl Fn(&Job) -> Option<(u64, u32)>,
    ) -> io::Result<(Vec<(u64, u64, u32, Buffers<'b>)>, bool)> {
        let mut batch = vec![first];
        let mut r = self.reader.lock();
        while batch.len() < max && batchable(&r) {
            let mut b = Buffers::new(self.mem);
            b.held_elsewhere = batch.iter().map(|(.., b)| b.charged).sum();
            match self.next_request(&mut r, &mut b)? {
                Next::Job(h, job) => match member(&job) {
                    Some((offset, len)) => batch.push((h, offset, len, b)),
                    // Checked by `batchable`; anything else would be a bug, never a reason to
                    // drop data.
                    None => {
                        drop(r);
                        self.executing.fetch_add(1, Ordering::Relaxed);
                        let res = self.execute(h, job, &mut b, false);
                        self.executing.fetch_sub(1, Ordering::Relaxed);
                        res?;
                        r = self.reader.lock();
                    }
                },
                Next::Rejected(h, rej) => self.send_error(h, rej.errno, rej.msg, true)?,
                // Parking is only considered when nothing is buffered.
                Next::Stop | Next::Park => {
                    self.close();
                    return Ok((batch, true));
                }
            }
        }
        Ok((batch, false))
    }

    /// Serves the read just read (in `first`) together with the reads buffered behind it, up to
    /// READ_BATCH: all executed inline with one [`Export::read_batch`], replies deferred (they
    /// leave in one write when the reader would block). Returns whether this worker still holds
    /// the reader role.
    fn read_batch<'s>(
        &'s self,
        s: &'s std::thread::Scope<'s, '_>,
        handle: u64,
        offset: u64,
        len: u32,
        first: Buffers<'_>,
    ) -> io::Result<bool> {
        let (mut batch, stopped) = self.gather_batch(
            (handle, offset, len, first),
            READ_BATCH,
            |r| self.next_batchable(r),
            |job| match *job {
                Job::Read { offset, len } => Some((offset, len)),
                _ => None,
            },
        )?;
        let prefix = self.reply_prefix();
        self.executing.fetch_add(batch.len(), Ordering::Relaxed);
        let token = self.go_inline(s, None);
        let t0 = Instant::now();
        let results = {
            let mut reqs: Vec<(&mut [u8], u64)> = Vec::with_capacity(batch.len());
            for (_, offset, len, b) in batch.iter_mut() {
                let Some(reply) = b.reply.as_deref_mut() else {
                    return Err(io::Error::other("read without a reply buffer"));
                };
                reqs.push((&mut reply[prefix..prefix + *len as usize], *offset));
            }
            self.export.read_batch(&mut reqs)
        };
        // Each read's share of the batch's time feeds the batches' average.
        record_ns(
            &self.batch_ns,
            t0.elapsed().as_nanos() / batch.len() as u128,
        );
        // The successful replies leave from their own buffers, header and data together, in
        // one vectored write (after any replies queued before them); failures are queued.
        let mut sent = Ok(());
        let mut replies: Vec<&[u8]> = Vec::with_capacity(batch.len());
        for ((h, offset, len, b), res) in batch.iter_mut().zip(results) {
            self.observe_replied(
                *h,
                &Job::Read {
                    offset: *offset,
                    len: *len,
                },
            );
            match res {
                Err(e) if sent.is_ok() => sent = self.send_export_error(*h, &e, false, true),
                Err(_) => {}
                Ok(()) => {
                    let reply = b.reply.as_deref_mut().expect("checked above");
                    let reply = &mut reply[..prefix + *len as usize];
                    self.encode_read_header(reply, *h, *offset, *len);
                    replies.push(reply);
                }
            }
        }
        if sent.is_ok() {
            sent = self.send_all(&replies);
        }
        drop(replies);
        let still_reader = self.finish_inline(token);
        self.executing.fetch_sub(batch.len(), Ordering::Relaxed);
        drop(batch);
        sent?;
        if stopped {
            // Nothing more will be read, so no reader flushes the deferred replies later.
            self.flush_pending()?;
        }
        Ok(still_reader)
    }

    /// Serves the write just read (in `first`) together with the writes buffered behind it, up
    /// to WRITE_BATCH: all executed inline with one [`Export::write_batch`], which lands them
    /// in request order; replies deferred, as an inline request's are. A FLUSH read after the
    /// batch is executed after every write of it is acknowledged, so it covers them all.
    /// Returns whether this worker still holds the reader role.
    fn write_batch<'s>(
        &'s self,
        s: &'s std::thread::Scope<'s, '_>,
        handle: u64,
        offset: u64,
        len: u32,
        first: Buffers<'_>,
    ) -> io::Result<bool> {
        let (batch, stopped) = self.gather_batch(
            (handle, offset, len, first),
            WRITE_BATCH,
            |r| self.next_batchable_write(r),
            |job| match *job {
                Job::Write {
                    offset,
                    len,
                    fua: false,
                } => Some((offset, len)),
                _ => None,
            },
        )?;
        self.executing.fetch_add(batch.len(), Ordering::Relaxed);
        let token = self.go_inline(s, None);
        let t0 = Instant::now();
        let results = {
            let reqs: Vec<(&[u8], u64)> = batch
                .iter()
                .map(|(_, offset, len, b)| {
                    let data = match &b.payload {
                        Payload::Pooled(p) => &p[..*len as usize],
                        Payload::Large(p) => &p[..*len as usize],
                        Payload::None => &[][..],
                    };
                    (data, *offset)
                })
                .collect();
            let _shared = self.write_gate.read();
            self.export.write_batch(&reqs)
        };
        // Each write's share of the batch's time feeds the write batches' average.
        record_ns(
            &self.write_batch_ns,
            t0.elapsed().as_nanos() / batch.len() as u128,
        );
        // The successes' replies go out as one piece; failures each with their message.
        let mut oks = Vec::with_capacity(batch.len() * SIMPLE_REPLY_LEN);
        let mut sent = if results.len() == batch.len() {
            Ok(())
        } else {
            Err(io::Error::other("write batch without a result per request"))
        };
        for ((h, offset, len, _), res) in batch.iter().zip(results) {
            self.observe_replied(
                *h,
                &Job::Write {
                    offset: *offset,
                    len: *len,
                    fua: false,
                },
            );
            match res {
                Ok(()) => {
                    let mut b = [0u8; SIMPLE_REPLY_LEN];
                    encode_simple_reply(&mut b, 0, *h);
                    oks.extend_from_slice(&b);
                }
                Err(e) if sent.is_ok() => sent = self.send_export_error(*h, &e, false, true),
                Err(_) => {}
            }
        }
        if sent.is_ok() && !oks.is_empty() {
            sent = self.send(&oks, true);
        }
        let still_reader = self.finish_inline(token);
        self.executing.fetch_sub(batch.len(), Ordering::Relaxed);
        drop(batch);
        sent?;
        if stopped {
            // Nothing more will be read, so no reader flushes the deferred replies later.
            self.flush_pending()?;
        }
        Ok(still_reader)
    }

    fn timed(&self, kind: usize, f: impl FnOnce() -> io::Result<()>) -> io::Result<()> {
        let t0 = Instant::now();
        let res = f();
        record_ns(&self.ewma_ns[kind], t0.elapsed().as_nanos());
        res
    }

    /// Queues a request for a waiting worker to execute, keeping the reader role; gives the
    /// buffers back when no worker waits idle (the caller then executes it itself).
    fn delegate<'s>(
        &'s self,
        s: &'s std::thread::Scope<'s, '_>,
        handle: u64,
        job: Job,
        bufs: Buffers<'a>,
    ) -> Result<(), Buffers<'a>> {
        let mut st = self.role.lock();
        if st.closed {
            return Err(bufs);
        }
        if st.waiting + st.starting <= st.jobs.len() && !self.recruit(s, &mut st) {
            return Err(bufs);
        }
        st.jobs.push_back((handle, job, bufs));
        if !self.follow_cv.notify_one() {
            self.rescue_cv.notify_one();
        }
        Ok(())
    }

    /// Starts another worker if none waits idle for the reader role or a delegated request
    /// and the connection has fewer than its maximum. True if one is starting (it counts as
    /// waiting until it waits). Called with the role locked; the new thread waits for it.
    fn recruit<'s>(
        &'s self,
        s: &'s std::thread::Scope<'s, '_>,
        st: &mut MutexGuard<'_, Role<'a>>,
    ) -> bool {
        if st.waiting + st.starting > st.jobs.len() || st.workers >= st.max_workers {
            return false;
        }
        let spawned = std::thread::Builder::new()
            .name("nbd-worker".into())
            .spawn_scoped(s, move || self.worker_loop(s, true));
        if spawned.is_err() {
            // Out of threads: serve with the workers there are rather than fail.
            return false;
        }
        st.workers += 1;
        st.starting += 1;
        true
    }

    /// Waits until this worker may read or has a delegated request to execute.
    fn acquire_reader(&self, fresh: bool) -> Acquired<'a> {
        // Deferred replies must not wait while this worker sleeps.
        if self.flush_pending().is_err() {
            self.fail();
            let mut st = self.role.lock();
            st.starting -= usize::from(fresh);
            return Acquired::Closed;
        }
        let mut st = self.role.lock();
        st.starting -= usize::from(fresh);
        st.waiting += 1;
        let got = self.acquire_locked(&mut st);
        st.waiting -= 1;
        got
    }

    fn acquire_locked(&self, st: &mut MutexGuard<'_, Role<'a>>) -> Acquired<'a> {
        loop {
            // Delegated requests first: the client is owed their replies even after a close.
            if let Some(j) = st.jobs.pop_front() {
                return Acquired::Job(j);
            }
            if st.closed {
                return Acquired::Closed;
            }
            if !st.reader_busy && st.inline.is_none() {
                st.reader_busy = true;
                return Acquired::Reader;
            }
            if !st.rescuer {
                st.rescuer = true;
                let got = self.rescue_wait(st);
                st.rescuer = false;
                return got;
            }
            self.follow_cv.wait(st);
        }
    }

    /// The rescuer's wait: takes the reader role when it is free, or when
    /// one inline request has been running for a full tick.
    fn rescue_wait(&self, st: &mut MutexGuard<'_, Role<'a>>) -> Acquired<'a> {
        let mut seen: Option<(u64, Instant)> = None;
        let mut idle = 0;
        loop {
            if let Some(j) = st.jobs.pop_front() {
                return Acquired::Job(j);
            }
            if st.closed {
                return Acquired::Closed;
            }
            if !st.reader_busy {
                match (st.inline, seen) {
                    (None, _) => {
                        st.reader_busy = true;
                        return Acquired::Reader;
                    }
                    (Some(t), Some((s, since))) if t == s && since.elapsed() >= RESCUE_TICK => {
                        st.inline = None;
                        st.reader_busy = true;
                        // A request of this kind has run a full tick: the kind is slow now, so
                        // the next ones are handed off or delegated at once instead of each
                        // waiting to be rescued (its own time corrects the average when it ends).
                        if let Some(k) = st.inline_kind {
                            self.ewma_ns[k].fetch_max(SLOW_NS + 1, Ordering::Relaxed);
                        }
                        return Acquired::Reader;
                    }
                    _ => {}
                }
            }
            match st.inline {
                Some(t) => {
                    idle = 0;
                    if seen.map(|(s, _)| s) != Some(t) {
                        seen = Some((t, Instant::now()));
                    }
                }
                None => idle += 1,
            }
            if idle > IDLE_TICKS {
                st.rescuer_asleep = true;
                self.rescue_cv.wait(st);
                st.rescuer_asleep = false;
                idle = 0;
            } else {
                self.rescue_cv.wait_for(st, RESCUE_TICK);
            }
        }
    }

    fn go_inline<'s>(&'s self, s: &'s std::thread::Scope<'s, '_>, kind: Option<usize>) -> u64 {
        let mut st = self.role.lock();
        // A waiting worker is the rescuer that takes over reading should this request block.
        self.recruit(s, &mut st);
        let token = st.next_token;
        st.next_token = token.wrapping_add(1);
        st.inline = Some(token);
        st.inline_kind = kind;
        st.reader_busy = false;
        if st.rescuer_asleep {
            st.rescuer_asleep = false;
            self.rescue_cv.notify_one();
        } else if !st.rescuer {
            // Recruit a rescuer; a no-op if nobody is waiting.
            self.follow_cv.notify_one();
        }
        token
    }

    /// True if this worker still holds the reader role (was not rescued).
    fn finish_inline(&self, token: u64) -> bool {
        let mut st = self.role.lock();
        if st.inline != Some(token) {
            return false;
        }
        st.inline = None;
        if st.closed {
            // After NBD_CMD_DISC nothing more may be read.
            return false;
        }
        st.reader_busy = true;
        true
    }

    fn hand_off<'s>(&'s self, s: &'s std::thread::Scope<'s, '_>) {
        let mut st = self.role.lock();
        // Someone must read while this worker executes.
        self.recruit(s, &mut st);
        st.reader_busy = false;
        if !self.follow_cv.notify_one() {
            self.rescue_cv.notify_one();
        }
    }

    fn close(&self) {
        let mut st = self.role.lock();
        st.closed = true;
        self.follow_cv.notify_all();
        self.rescue_cv.notify_all();
    }

    fn fail(&self) {
        self.close();
        (self.on_fatal)();
    }

    /// As `fail`, remembering whether the client was dropped for stalling (a socket timeout).
    fn fail_with(&self, e: &io::Error) {
        if is_timeout(e) {
            self.stalled.store(true, Ordering::Relaxed);
        }
        self.fail();
    }

    // ---- reading ------------------------------------------------------------

    /// Reads one request; an `Err` means the stream is unusable (bad magic,
    /// oversized write payload, transport error, a client stalling mid-request
    /// past the socket's timeout) and the connection must be dropped.
    /// Deferred replies are flushed before any read that may block. Takes the
    /// request's buffer and its budget (waiting while the budget is spent).
    fn next_request(&self, r: &mut BufReader<R>, bufs: &mut Buffers<'_>) -> io::Result<Next> {
        if r.buffer().len() < REQUEST_LEN {
            self.flush_pending()?;
        }
        let refill = r.buffer().len() < REQUEST_LEN;
        if r.buffer().is_empty() && self.quiet() {
            if let Some(wait) = self.wait_input {
                if !wait(PARK_AFTER) && self.quiet() {
                    return Ok(Next::Park);
                }
            }
        }
        // Between requests a client may stay silent as long as it likes: a
        // socket timeout here only means "still idle". Once a header has
        // started, the timeout applies (a stalled client is dropped).
        loop {
            match r.fill_buf() {
                Ok([]) => return Ok(Next::Stop),
                Ok(_) => break,
                Err(e) if is_timeout(&e) || e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        let mut hdr = [0u8; REQUEST_LEN];
        if !read_exact_or_eof(r, &mut hdr)? {
            return Ok(Next::Stop);
        }
        // Looked up after the read, which may have waited: an observer attached meanwhile
        // sees this request.
        let observer = self.observer.get();
        // The header's arrival: now if it took a socket read, else that of the last read.
        let arrived = observer.as_ref().map(|_| {
            let mut last = self.last_fill.lock();
            match *last {
                Some(t) if !refill => t,
                _ => *last.insert(Instant::now()),
            }
        });
        let req = parse_request(&hdr).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        if req.typ == CMD_DISC {
            return Ok(Next::Stop);
        }
        let checked = validate(&req, &self.p);
        // Stamped on receipt, before the payload: the trace's queue time.
        if let (Ok(job), Some(o), Some(at)) = (&checked, &observer, arrived) {
            o.received(&observe::observed(self.conn_id, req.handle, job, at));
        }
        match checked {
            Ok(Job::Read { len, .. }) => {
                // Small reads are answered from one buffer; larger ones are
                // streamed through one piece.
                let whole = self.reply_prefix() + len as usize;
                let n = if whole <= PIECE { whole } else { PIECE };
                self.charge(bufs, Pool::cost(n));
                bufs.reply = Some(self.mem.pool.get(n));
            }
            Ok(Job::Write { len, .. }) => {
                let len = len as usize;
                if r.buffer().len() < len {
                    self.flush_pending()?;
                }
                let refill = r.buffer().len() < len;
                if !self.read_payload(r, bufs, len)? {
                    return Ok(Next::Stop);
                }
                if refill && observer.is_some() {
                    // Headers behind this payload may have come in with it.
                    *self.last_fill.lock() = Some(Instant::now());
                }
            }
            Ok(_) => {}
            Err(_) if req.typ == CMD_WRITE => {
                // The payload must be consumed to stay in sync with the
                // stream, but not buffered.
                if req.length > WRITE_DISCARD_LIMIT.max(self.p.bs.max) {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "write payload too large",
                    ));
                }
                if !discard(r, u64::from(req.length))? {
                    return Ok(Next::Stop);
                }
            }
            Err(_) => {}
        }
        Ok(match checked {
            Ok(job) => Next::Job(req.handle, job),
            Err(rej) => Next::Rejected(req.handle, rej),
        })
    }

    /// Nothing in flight: no request executing or delegated, no reply queued or being written.
    /// Only the reader starts requests, so once the reader sees this, it stays so until the
    /// reader reads again.
    fn quiet(&self) -> bool {
        if self.executing.load(Ordering::Acquire) > 0 || !self.role.lock().jobs.is_empty() {
            return false;
        }
        let q = self.out.lock();
        !q.flushing && q.pending.is_empty()
    }

    /// Takes `n` bytes of budget for the request in `bufs`; while the budget
    /// is spent, this connection reads nothing, but first sends the replies
    /// it has queued (the client may be waiting for them).
    fn charge(&self, bufs: &mut Buffers<'_>, n: u64) {
        self.mem
            .budget
            .acquire(n, bufs.charged + bufs.held_elsewhere, || {
                let _ = self.flush_pending();
            });
        bufs.charged += n;
    }

    /// Reads a write payload of `len` bytes, taking its memory and budget
    /// only as the bytes arrive: a header without its payload holds nothing.
    /// False on end of stream.
    fn read_payload(
        &self,
        r: &mut BufReader<R>,
        bufs: &mut Buffers<'_>,
        len: usize,
    ) -> io::Result<bool> {
        if r.fill_buf()?.is_empty() {
            return Ok(false);
        }
        if len <= PIECE {
            self.charge(bufs, Pool::cost(len));
            let mut b = self.mem.pool.get(len);
            let ok = read_exact_or_eof(r, &mut b[..len]);
            bufs.payload = Payload::Pooled(b);
            return ok;
        }
        let mut b = LargeBuf::new(len)?;
        let mut done = 0;
        while done < len {
            if done > 0 && r.fill_buf()?.is_empty() {
                return Ok(false);
            }
            let n = PIECE.min(len - done);
            self.charge(bufs, n as u64);
            if !read_exact_or_eof(r, &mut b[done..done + n])? {
                return Ok(false);
            }
            done += n;
        }
        bufs.payload = Payload::Large(b);
        Ok(true)
    }

    // ---- replies ------------------------------------------------------------

    /// Queues a reply. Unless `defer`, it is written before returning (by
    /// this worker or by one already writing). Deferred replies go out with
    /// the next flush, which the reader does before it could block. The
    /// queue never holds more than MAX_DEFERRED (plus one small reply): a
    /// reply that does not fit waits for the worker that is writing.
    fn send(&self, bytes: &[u8], defer: bool) -> io::Result<()> {
        // Large replies are not worth batching and would only be copied.
        let small = bytes.len() <= MAX_DEFERRED_REPLY;
        let mut q = self.out.lock();
        loop {
            if q.failed {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            let fits = small && q.pending.len() + bytes.len() <= MAX_DEFERRED;
            if q.flushing {
                if fits {
                    // The writing worker takes it along before it stops.
                    q.pending.extend_from_slice(bytes);
                    return Ok(());
                }
                self.out_cv.wait(&mut q);
                continue;
            }
            if defer && fits {
                q.pending.extend_from_slice(bytes);
                return Ok(());
            }
            q.flushing = true;
            if small && !q.pending.is_empty() {
                q.pending.extend_from_slice(bytes);
                drop(q);
                return self.flush_loop();
            }
            drop(q);
            // Replies may go out in any order, so write this one directly
            // (no copy) and then whatever was queued.
            let res = self.write_out(bytes);
            return self.after_write(res);
        }
    }

    /// Waits until no other worker writes, then marks this one as the writer (`after_write`
    /// hands the role on); fails once the connection's writes have failed.
    fn become_writer(&self) -> io::Result<MutexGuard<'_, OutQueue>> {
        let mut q = self.out.lock();
        loop {
            if q.failed {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            if !q.flushing {
                break;
            }
            self.out_cv.wait(&mut q);
        }
        q.flushing = true;
        Ok(q)
    }

    /// Writes `replies` from where they are, with whatever was queued before them, in one
    /// vectored write (or as few as the socket takes), as the connection's writer: no copy
    /// into the queue.
    fn send_all(&self, replies: &[&[u8]]) -> io::Result<()> {
        if replies.is_empty() {
            return Ok(());
        }
        let mut q = self.become_writer()?;
        let mut queued = std::mem::take(&mut q.spare);
        std::mem::swap(&mut queued, &mut q.pending);
        self.out_cv.notify_all();
        drop(q);
        let res = {
            let mut slices: Vec<io::IoSlice<'_>> = std::iter::once(&queued[..])
                .chain(replies.iter().copied())
                .filter(|b| !b.is_empty())
                .map(io::IoSlice::new)
                .collect();
            let mut w = self.writer.lock();
            write_all_vectored(&mut *w, &mut slices).and_then(|()| w.flush())
        };
        queued.clear();
        self.out.lock().spare = queued;
        self.after_write(res)
    }

    /// Runs `f` as the only writer of this connection (after the worker
    /// writing now, if any), then writes what was queued meanwhile.
    fn with_writer(&self, f: impl FnOnce(&mut W) -> io::Result<()>) -> io::Result<()> {
        drop(self.become_writer()?);
        let res = f(&mut self.writer.lock());
        self.after_write(res)
    }

    fn write_out(&self, bytes: &[u8]) -> io::Result<()> {
        let mut w = self.writer.lock();
        w.write_all(bytes)?;
        w.flush()
    }

    /// Called by the flushing worker after a write: keeps writing what was
    /// queued meanwhile, then gives up the flusher role.
    fn after_write(&self, res: io::Result<()>) -> io::Result<()> {
        if let Err(e) = res {
            let mut q = self.out.lock();
            q.failed = true;
            q.flushing = false;
            self.out_cv.notify_all();
            return Err(e);
        }
        self.flush_loop()
    }

    fn flush_loop(&self) -> io::Result<()> {
        let mut q = self.out.lock();
        loop {
            if q.pending.is_empty() {
                q.flushing = false;
                self.out_cv.notify_all();
                return Ok(());
            }
            let mut batch = std::mem::take(&mut q.spare);
            std::mem::swap(&mut batch, &mut q.pending);
            // Room in the queue again.
            self.out_cv.notify_all();
            drop(q);
            let res = self.write_out(&batch);
            batch.clear();
            q = self.out.lock();
            q.spare = batch;
            if let Err(e) = res {
                q.failed = true;
                q.flushing = false;
                self.out_cv.notify_all();
                return Err(e);
            }
        }
    }

    /// Writes deferred replies now (or leaves them to the worker already
    /// writing, which picks them up before it stops).
    fn flush_pending(&self) -> io::Result<()> {
        let mut q = self.out.lock();
        if q.failed {
            return Err(io::ErrorKind::BrokenPipe.into());
        }
        if q.flushing || q.pending.is_empty() {
            return Ok(());
        }
        q.flushing = true;
        drop(q);
        self.flush_loop()
    }

    fn send_ok(&self, handle: u64, defer: bool) -> io::Result<()> {
        // A simple reply is allowed for any payload-less success, even with
        // structured replies negotiated, and is the shortest.
        let mut b = [0u8; SIMPLE_REPLY_LEN];
        encode_simple_reply(&mut b, 0, handle);
        self.send(&b, defer)
    }

    fn send_error(&self, handle: u64, errno: u32, msg: &str, defer: bool) -> io::Result<()> {
        if self.p.structured {
            let mut out = Vec::with_capacity(STRUCTURED_HEADER_LEN + 6 + msg.len());
            encode_structured_error(&mut out, handle, errno, msg);
            self.send(&out, defer)
        } else {
            let mut b = [0u8; SIMPLE_REPLY_LEN];
            encode_simple_reply(&mut b, errno, handle);
            self.send(&b, defer)
        }
    }

    fn send_export_error(
        &self,
        handle: u64,
        e: &ExportError,
        fast_zero: bool,
        defer: bool,
    ) -> io::Result<()> {
        // The spec reserves ENOTSUP for fast-zero refusals and EOVERFLOW for
        // "don't fragment" reads; anything else gets EINVAL instead.
        let errno = match e.kind {
            ErrorKind::NotSupported if !fast_zero => EINVAL,
            ErrorKind::Overflow => EINVAL,
            k => k.nbd_errno(),
        };
        let msg: &str = if e.message.is_empty() {
            "export error"
        } else {
            &e.message
        };
        self.send_error(handle, errno, msg, defer)
    }

    // ---- execution ----------------------------------------------------------

    fn execute(
        &self,
        handle: u64,
        job: Job,
        bufs: &mut Buffers<'_>,
        defer: bool,
    ) -> io::Result<()> {
        let res = match job {
            Job::Read { offset, len } => {
                return self.execute_read(handle, offset, len, bufs, defer)
            }
            Job::Write { offset, len, fua } => {
                let Buffers { payload, block, .. } = &mut *bufs;
                let data = match payload {
                    Payload::Pooled(b) => &b[..len as usize],
                    Payload::Large(b) => &b[..len as usize],
                    Payload::None => &[][..],
                };
                self.write(offset, data, fua, block)
            }
            Job::Flush => self.export.flush(),
            Job::Trim { offset, len, fua } => self.trim(offset, u64::from(len), fua),
            Job::WriteZeroes {
                offset,
                len,
                flags,
                fua,
            } => self.write_zeroes(offset, u64::from(len), flags, fua, &mut bufs.block),
            Job::Cache { offset, len } => self.cache(offset, u64::from(len)),
        };
        self.observe_replied(handle, &job);
        match res {
            Ok(()) => self.send_ok(handle, defer),
            Err(e) => {
                let fast = matches!(job, Job::WriteZeroes { flags, .. } if flags.fast_zero);
                self.send_export_error(handle, &e, fast, defer)
            }
        }
    }

    /// Bytes before a read's data in its reply.
    fn reply_prefix(&self) -> usize {
        if self.p.structured {
            STRUCTURED_HEADER_LEN + 8
        } else {
            SIMPLE_REPLY_LEN
        }
    }

    /// Fills in a successful read reply's header in `out[..prefix]`. The
    /// data goes out as one chunk (with DONE, for structured replies): a
    /// later error cannot be reported in-band, so it ends the connection.
    fn encode_read_header(&self, out: &mut [u8], handle: u64, offset: u64, len: u32) {
        if self.p.structured {
            encode_structured_header(
                out,
                REPLY_FLAG_DONE,
                REPLY_TYPE_OFFSET_DATA,
                handle,
                8 + len,
            );
            out[STRUCTURED_HEADER_LEN..STRUCTURED_HEADER_LEN + 8]
                .copy_from_slice(&offset.to_be_bytes());
        } else {
            encode_simple_reply(out, 0, handle);
        }
    }

    fn execute_read(
        &self,
        handle: u64,
        offset: u64,
        len: u32,
        bufs: &mut Buffers<'_>,
        defer: bool,
    ) -> io::Result<()> {
        let prefix = self.reply_prefix();
        let total = prefix + len as usize;
        let Buffers { reply, block, .. } = &mut *bufs;
        let Some(reply) = reply.as_deref_mut() else {
            return Err(io::Error::other("read without a reply buffer"));
        };
        if total > reply.len() {
            return self.stream_read(handle, offset, len, reply, block);
        }
        let reply = &mut reply[..total];
        let res = self.read(offset, &mut reply[prefix..], block);
        self.observe_replied(handle, &Job::Read { offset, len });
        if let Err(e) = res {
            return self.send_export_error(handle, &e, false, defer);
        }
        self.encode_read_header(reply, handle, offset, len);
        self.send(reply, defer)
    }

    /// A read larger than its buffer `piece`: the first piece is read before
    /// anything is sent (so an error then gets a proper error reply), then
    /// the header and the pieces go out one after another while this worker
    /// holds the writer. The memory held stays one piece, however long the
    /// client takes to read.
    fn stream_read(
        &self,
        handle: u64,
        offset: u64,
        len: u32,
        piece: &mut [u8],
        block: &mut Vec<u8>,
    ) -> io::Result<()> {
        let job = Job::Read { offset, len };
        let len = len as usize;
        let first = piece.len().min(len);
        if let Err(e) = self.read(offset, &mut piece[..first], block) {
            self.observe_replied(handle, &job);
            return self.send_export_error(handle, &e, false, false);
        }
        if first == len {
            self.observe_replied(handle, &job);
        }
        self.with_writer(|w| {
            let mut hdr = [0u8; STRUCTURED_HEADER_LEN + 8];
            let prefix = self.reply_prefix();
            self.encode_read_header(&mut hdr, handle, offset, len as u32);
            w.write_all(&hdr[..prefix])?;
            let mut done = 0;
            let mut n = first;
            loop {
                w.write_all(&piece[..n])?;
                done += n;
                if done == len {
                    return w.flush();
                }
                n = piece.len().min(len - done);
                let at = offset + done as u64;
                if let Err(e) = self.read(at, &mut piece[..n], block) {
                    self.observe_replied(handle, &job);
                    return Err(io::Error::other(format!(
                        "read error after the reply header was sent: {e}"
                    )));
                }
                if done + n == len {
                    self.observe_replied(handle, &job);
                }
            }
        })
    }

    /// Before the reply goes out, so the client's next request is never observed first.
    fn observe_replied(&self, handle: u64, job: &Job) {
        if let Some(o) = self.observer.get() {
            o.replied(&observe::observed(
                self.conn_id,
                handle,
                job,
                Instant::now(),
            ));
        }
    }

    fn min(&self) -> u32 {
        self.p.bs.min
    }

    /// The export-visible block around `offset`, clamped to the export size.
    fn block_around(&self, offset: u64) -> (u64, usize) {
        let min = u64::from(self.min());
        let start = offset - offset % min;
        let end = (start + min).min(self.p.size);
        (start, (end - start) as usize)
    }

    fn read(&self, offset: u64, out: &mut [u8], block: &mut Vec<u8>) -> ExportResult<()> {
        let len = out.len() as u64;
        if aligned(offset, len, self.min()) {
            return self.export.read(out, offset);
        }
        let s = split(offset, len, self.min());
        for (off, n) in [s.head, s.tail] {
            if n == 0 {
                continue;
            }
            let (bstart, blen) = self.block_around(off);
            let b = grow(block, blen);
            self.export.read(b, bstart)?;
            let at = (off - offset) as usize;
            let from = (off - bstart) as usize;
            out[at..at + n as usize].copy_from_slice(&b[from..from + n as usize]);
        }
        if s.mid.1 > 0 {
            let at = (s.mid.0 - offset) as usize;
            self.export
                .read(&mut out[at..at + s.mid.1 as usize], s.mid.0)?;
        }
        Ok(())
    }

    /// Rewrites the part `[off, off + n)` of one block with `src` (or zeroes).
    /// Caller holds the write gate exclusively.
    fn patch_block(
        &self,
        off: u64,
        n: u64,
        src: Option<&[u8]>,
        fua: bool,
        block: &mut Vec<u8>,
    ) -> ExportResult<()> {
        let (bstart, blen) = self.block_around(off);
        let b = grow(block, blen);
        self.export.read(b, bstart)?;
        let from = (off - bstart) as usize;
        let dst = &mut b[from..from + n as usize];
        match src {
            Some(s) => dst.copy_from_slice(s),
            None => dst.fill(0),
        }
        self.export.write(b, bstart, fua)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool, block: &mut Vec<u8>) -> ExportResult<()> {
        if aligned(offset, data.len() as u64, self.min()) {
            let _shared = self.write_gate.read();
            return self.export.write(data, offset, fua);
        }
        let _excl = self.write_gate.write();
        let s = split(offset, data.len() as u64, self.min());
        let part = |(off, n): (u64, u64)| {
            let at = (off - offset) as usize;
            &data[at..at + n as usize]
        };
        if s.head.1 > 0 {
            self.patch_block(s.head.0, s.head.1, Some(part(s.head)), fua, block)?;
        }
        if s.mid.1 > 0 {
            self.export.write(part(s.mid), s.mid.0, fua)?;
        }
        if s.tail.1 > 0 {
            self.patch_block(s.tail.0, s.tail.1, Some(part(s.tail)), fua, block)?;
        }
        Ok(())
    }

    fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        flags: ZeroFlags,
        fua: bool,
        block: &mut Vec<u8>,
    ) -> ExportResult<()> {
        if aligned(offset, len, self.min()) {
            let _shared = self.write_gate.read();
            self.export.write_zeroes(offset, len, flags)?;
        } else {
            if flags.fast_zero {
                // Partial blocks need read-modify-write: never fast, and the
                // spec wants the export left untouched on this failure.
                return Err(ExportError::not_fast());
            }
            let _excl = self.write_gate.write();
            let s = split(offset, len, self.min());
            if s.head.1 > 0 {
                self.patch_block(s.head.0, s.head.1, None, false, block)?;
            }
            if s.mid.1 > 0 {
                self.export.write_zeroes(s.mid.0, s.mid.1, flags)?;
            }
            if s.tail.1 > 0 {
                self.patch_block(s.tail.0, s.tail.1, None, false, block)?;
            }
        }
        if fua {
            self.export.flush()?;
        }
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64, fua: bool) -> ExportResult<()> {
        // Trim is advisory, so an unaligned one only discards the whole
        // blocks inside it, as the spec permits.
        let s = split(offset, len, self.min());
        if s.mid.1 > 0 {
            let _shared = self.write_gate.read();
            self.export.trim(s.mid.0, s.mid.1)?;
            if fua {
                self.export.flush()?;
            }
        }
        Ok(())
    }

    fn cache(&self, offset: u64, len: u64) -> ExportResult<()> {
        let min = u64::from(self.min());
        let start = offset - offset % min;
        let end = (offset + len).next_multiple_of(min).min(self.p.size);
        self.export.cache(start, end - start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> Params {
        Params {
            size: 1 << 20,
            flags: FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA | FLAG_SEND_WRITE_ZEROES,
            bs: BlockSizes::default(),
            structured: false,
            block_size_negotiated: false,
        }
    }

    fn req(typ: u16, flags: u16, offset: u64, length: u32) -> Request {
        Request {
            flags,
            typ,
            handle: 1,
            offset,
            length,
        }
    }

    #[test]
    fn validation_errors() {
        let p = params();
        let e = |r: Request, p: &Params| validate(&r, p).unwrap_err().errno;
        assert_eq!(e(req(99, 0, 0, 512), &p), EINVAL);
        assert_eq!(e(req(CMD_BLOCK_STATUS, 0, 0, 512), &p), EINVAL);
        assert_eq!(e(req(CMD_READ, CMD_FLAG_DF, 0, 512), &p), EINVAL);
        assert_eq!(e(req(CMD_READ, 1 << 9, 0, 512), &p), EINVAL);
        assert_eq!(e(req(CMD_READ, 0, 0, 0), &p), EINVAL);
        assert_eq!(e(req(CMD_READ, 0, 1 << 20, 512), &p), EINVAL);
        assert_eq!(e(req(CMD_READ, 0, u64::MAX, 512), &p), EINVAL);
        assert_eq!(e(req(CMD_WRITE, 0, 1 << 20, 512), &p), ENOSPC);
        assert_eq!(
            e(req(CMD_WRITE_ZEROES, 0, (1 << 20) - 512, 1024), &p),
            ENOSPC
        );
        assert_eq!(e(req(CMD_WRITE, 0, 0, (32 << 20) + 512), &p), EINVAL);
        assert_eq!(e(req(CMD_TRIM, 0, 0, 512), &p), EINVAL);
        assert_eq!(
            e(req(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 0, 512), &p),
            EINVAL
        );
        let ro = Params {
            flags: p.flags | FLAG_READ_ONLY,
            ..p
        };
        assert_eq!(e(req(CMD_WRITE, 0, 0, 512), &ro), EPERM);
        let neg = Params {
            block_size_negotiated: true,
            ..p
        };
        assert_eq!(e(req(CMD_WRITE, 0, 1, 512), &neg), EINVAL);
        assert_eq!(e(req(CMD_READ, 0, 0, 100), &neg), EINVAL);
    }

    #[test]
    fn validation_accepts() {
        let p = Params {
            structured: true,
            ..params()
        };
        assert_eq!(
            validate(&req(CMD_READ, CMD_FLAG_DF, 7, 100), &p),
            Ok(Job::Read {
                offset: 7,
                len: 100
            })
        );
        assert_eq!(
            validate(&req(CMD_WRITE, CMD_FLAG_FUA, 512, 512), &p),
            Ok(Job::Write {
                offset: 512,
                len: 512,
                fua: true
            })
        );
        assert_eq!(validate(&req(CMD_FLUSH, 0, 5, 5), &p), Ok(Job::Flush));
        assert!(matches!(
            validate(&req(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 0, 1 << 20), &p),
            Ok(Job::WriteZeroes {
                flags: ZeroFlags {
                    no_hole: true,
                    fast_zero: false
                },
                ..
            })
        ));
    }

    /// Takes at most 7 bytes per call, from at most two buffers.
    struct Trickle(Vec<u8>);

    impl Write for Trickle {
        fn write(&mut self, b: &[u8]) -> io::Result<usize> {
            let n = b.len().min(7);
            self.0.extend_from_slice(&b[..n]);
            Ok(n)
        }
        fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
            let mut left = 7;
            for b in bufs.iter().take(2) {
                let n = b.len().min(left);
                self.0.extend_from_slice(&b[..n]);
                left -= n;
            }
            Ok(7 - left)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn vectored_replies_survive_short_writes() {
        let parts: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i; 3 + 5 * i as usize]).collect();
        let mut slices: Vec<io::IoSlice<'_>> = parts.iter().map(|p| io::IoSlice::new(p)).collect();
        let mut w = Trickle(Vec::new());
        write_all_vectored(&mut w, &mut slices).unwrap();
        assert_eq!(w.0, parts.concat());
    }

    #[test]
    fn split_ranges() {
        assert_eq!(
            split(100, 600, 512),
            Split {
                head: (100, 412),
                mid: (512, 0),
                tail: (512, 188)
            }
        );
        assert_eq!(
            split(100, 10, 512),
            Split {
                head: (100, 10),
                mid: (110, 0),
                tail: (110, 0)
            }
        );
        assert_eq!(
            split(512, 1024, 512),
            Split {
                head: (512, 0),
                mid: (512, 1024),
                tail: (1536, 0)
            }
        );
        assert_eq!(
            split(500, 1100, 512),
            Split {
                head: (500, 12),
                mid: (512, 1024),
                tail: (1536, 64)
            }
        );
    }
}

//! A remote NBD export as a [`Volume`], so a network volume can be a core (or a cache) device.
//!
//! The nbd crate's client runs one request at a time, so the volume keeps a small pool of
//! connections and each request takes whichever is free; that gives the engine's threads
//! parallelism against the remote server. Requests larger than the server's maximum block size are
//! split. Flush goes to one connection when the server promises multi-conn consistency and to
//! every connection otherwise (only then are all connections' completed writes covered).

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant, SystemTime};

use hybridcache_nbd::proto::{FLAG_SEND_TRIM, FLAG_SEND_WRITE_ZEROES};
use hybridcache_nbd::{Client, ClientConfig, ClientError};
use hybridcache_volume::{check_range, ErrorKind, Op, Result, Volume, VolumeError};
use parking_lot::{Condvar, Mutex};

/// Connections opened per remote volume: each carries one request at a time, so this is the
/// queue depth the remote device sees. Cleaning keeps up to 32 core writes in flight (a disk
/// array behind the export needs that depth), so fewer connections would cap it.
const POOL: usize = 32;
/// Largest piece sent in one request when the server states no limit.
const DEFAULT_MAX: u64 = 32 << 20;

/// Where a remote export lives, parsed from an NBD URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NbdTarget {
    Unix {
        socket: String,
        export: String,
    },
    Tcp {
        host: String,
        port: u16,
        export: String,
    },
}

/// Whether a device spec names a remote NBD export.
pub fn is_nbd_uri(spec: &str) -> bool {
    spec.starts_with("nbd://") || spec.starts_with("nbd+unix://")
}

/// Parse `nbd+unix:///NAME?socket=PATH` or `nbd://HOST[:PORT][/NAME]` (the libnbd URI forms
/// without TLS and percent-escapes).
pub fn parse_nbd_uri(uri: &str) -> std::result::Result<NbdTarget, String> {
    if let Some(rest) = uri.strip_prefix("nbd+unix://") {
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        let export = path.strip_prefix('/').unwrap_or(path).to_string();
        if !path.is_empty() && !path.starts_with('/') {
            return Err(format!(
                "'{uri}': a Unix-socket NBD URI has no host (expected nbd+unix:///NAME?socket=PATH)"
            ));
        }
        let socket = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("socket="))
            .filter(|s| !s.is_empty())
            .ok_or_else(|| format!("'{uri}': missing ?socket=PATH"))?;
        return Ok(NbdTarget::Unix {
            socket: socket.to_string(),
            export,
        });
    }
    if let Some(rest) = uri.strip_prefix("nbd://") {
        let (authority, export) = match rest.split_once('/') {
            Some((a, e)) => (a, e.split('?').next().unwrap_or("").to_string()),
            None => (rest, String::new()),
        };
        if authority.is_empty() {
            return Err(format!(
                "'{uri}': missing host (expected nbd://HOST[:PORT]/NAME)"
            ));
        }
        // "[v6]:port", "host:port" or "host".
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let (h, after) = v6
                .split_once(']')
                .ok_or_else(|| format!("'{uri}': unterminated IPv6 address"))?;
            (h.to_string(), after.strip_prefix(':'))
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h.to_string(), Some(p)),
                None => (authority.to_string(), None),
            }
        };
        let port = match port {
            Some(p) => p
                .parse::<u16>()
                .map_err(|_| format!("'{uri}': bad port '{p}'"))?,
            None => 10809,
        };
        return Ok(NbdTarget::Tcp { host, port, export });
    }
    Err(format!(
        "'{uri}' is not an NBD URI (expected nbd+unix:///NAME?socket=PATH or nbd://HOST:PORT/NAME)"
    ))
}

/// Backoff between reconnection attempts: doubles from the first to the cap, so a short
/// server restart is noticed within a fraction of a second and a long outage costs one attempt
/// every few seconds.
const BACKOFF_FIRST: Duration = Duration::from_millis(100);
const BACKOFF_CAP: Duration = Duration::from_secs(3);

/// How long a request that finds its connection dead waits for the reconnection before it is
/// sent again on the new connection (once). A server that was restarted while nothing was sent
/// to it is back at the first attempt (0.1 s); a server still gone fails the request after this
/// wait, and later requests fail at once until it is back.
const RETRY_WAIT: Duration = Duration::from_secs(2);

/// How often idle connections are checked for a server that closed them, so that a server
/// killed while nothing is sent to it is noticed (and `-L` says so) without waiting for the
/// next request.
const HANGUP_CHECK: Duration = Duration::from_millis(500);

/// Writes sent since the last flush that covered them are kept (up to this many bytes) and sent
/// again on a new connection, so a server that lost what it had not flushed (a restart with a
/// volatile write cache) gets them back. Background cleaning flushes the core after every
/// batch, so this holds one batch of cleaning writes at most in practice.
const REPLAY_MAX: usize = 128 << 20;

/// A write kept for sending again after a reconnection.
struct Replay {
    seq: u64,
    offset: u64,
    /// None: write-zeroes of `len` bytes.
    data: Option<Vec<u8>>,
    len: u64,
    /// The server acknowledged it (a flush sent afterwards covers it).
    acked: bool,
}

/// The connection state of a remote volume, shared with its reconnection thread.
struct LinkState {
    connected: bool,
    /// Why the link went down (or why the last reconnection attempt failed).
    last_error: String,
    /// Counts breakages: a write acknowledged in an earlier epoch than the current one was
    /// acknowledged by a connection (maybe a server instance) that is gone.
    epoch: u64,
    /// Writes sent since the last flush that covered them, in the order they were sent.
    replay: Vec<Replay>,
    replay_bytes: usize,
    next_seq: u64,
    /// More than REPLAY_MAX bytes were unflushed, so the replay list was given up; if the
    /// connection breaks in that state, writes the server acknowledged may be lost, and the
    /// next flush reports it (EIO) instead of calling them durable.
    overflow: bool,
    lost: bool,
    /// When the link went down; None while connected.
    down_since: Option<SystemTime>,
    /// Reconnection attempts made since.
    attempts: u32,
}

struct Shared {
    name: String,
    target: NbdTarget,
    size: u64,
    conns: Vec<Mutex<Option<Client>>>,
    /// A second handle on each connection's socket, to notice a server that closed it while
    /// the connection was idle.
    hangup: Mutex<Vec<OwnedFd>>,
    next: AtomicUsize,
    state: Mutex<LinkState>,
    wake: Condvar,
}

impl Shared {
    /// A connection broke: mark the volume detached (once per breakage) and wake the
    /// reconnection thread. While connected every slot holds a connection of the current
    /// epoch (reconnection fills them all before it says so), so any breakage counts.
    fn detach(&self, why: &str) {
        let mut st = self.state.lock();
        if !st.connected {
            return;
        }
        st.connected = false;
        st.epoch += 1;
        st.last_error = why.to_string();
        st.down_since = Some(SystemTime::now());
        st.attempts = 0;
        if st.overflow {
            st.lost = true;
            st.overflow = false;
        }
        tracing::warn!(
            "remote volume {}: connection lost ({why}); detached, reconnecting",
            self.name
        );
        self.wake.notify_all();
    }

    /// Wait until connected, at most `timeout`; whether it is.
    fn wait_connected(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        let mut st = self.state.lock();
        while !st.connected {
            if self.wake.wait_until(&mut st, deadline).timed_out() {
                return st.connected;
            }
        }
        true
    }
}

/// A remote NBD export used as a block device. When the connection breaks (the server exits or
/// restarts), the volume turns detached: every request fails at once with EIO, and a thread
/// reconnects with exponential backoff; once it has, requests go through again. A request in
/// flight when the connection breaks fails with EIO (never silently): writes are idempotent,
/// so the caller may send them again; a flush is never reported successful for writes the lost
/// connection acknowledged (see [`LinkState::lost`]).
pub struct NbdVolume {
    shared: Arc<Shared>,
    max: u64,
    min: u32,
    multi_conn: bool,
    can_trim: bool,
    can_zero: bool,
}

/// A handle on a remote volume's connection state, for status displays.
#[derive(Clone)]
pub struct NbdLink(Arc<Shared>);

impl NbdLink {
    /// None while connected; the last error while detached and reconnecting.
    pub fn detached(&self) -> Option<String> {
        let st = self.0.state.lock();
        (!st.connected).then(|| st.last_error.clone())
    }
}

/// Every remote volume open in this process, by the URI it was opened with, so the daemon can
/// show a core's connection state by the device name it knows (one device is open once).
static LINKS: Mutex<BTreeMap<String, Weak<Shared>>> = Mutex::new(BTreeMap::new());

/// What `-L` shows for the remote volume open from `uri` while its connection is down, e.g.
/// "Reconnecting (server gone since 14:03:07 UTC, 4 attempts; last error: ...)"; None when
/// connected or when no such volume is open.
pub fn link_status(uri: &str) -> Option<String> {
    let shared = LINKS.lock().get(uri)?.upgrade()?;
    let st = shared.state.lock();
    if st.connected {
        return None;
    }
    let since = st.down_since.map(utc_time).unwrap_or_else(|| "?".into());
    let attempts = match st.attempts {
        1 => "1 attempt".to_string(),
        n => format!("{n} attempts"),
    };
    Some(format!(
        "Reconnecting (server gone since {since} UTC, {attempts}; last error: {})",
        st.last_error
    ))
}

/// How many times the connection of the remote volume open from `uri` broke (None when no
/// such volume is open): a flush that failed while it changed met a dead connection.
pub fn breakages(uri: &str) -> Option<u64> {
    let shared = LINKS.lock().get(uri)?.upgrade()?;
    let epoch = shared.state.lock().epoch;
    Some(epoch)
}

/// Wait until the remote volume open from `uri` is connected, at most `timeout`; true when it
/// is (or when no such volume is open, which has nothing to wait for).
pub fn wait_connected(uri: &str, timeout: Duration) -> bool {
    let Some(shared) = LINKS.lock().get(uri).and_then(Weak::upgrade) else {
        return true;
    };
    shared.wait_connected(timeout)
}

/// "HH:MM:SS" of a wall-clock time, in UTC.
fn utc_time(t: SystemTime) -> String {
    let s = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
        % 86_400;
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

/// A reply that takes longer than this means the server or the network is gone without
/// closing the connection (a host that died, a dropped route): the connection counts as broken
/// and is replaced, instead of hanging every request behind it. Generous, because a remote
/// disk array can legitimately take seconds for a flush.
const REPLY_TIMEOUT: Duration = Duration::from_secs(60);

/// A connection, and a second handle on its socket for [`hung_up`].
fn connect(target: &NbdTarget) -> std::result::Result<(Client, OwnedFd), ClientError> {
    match target {
        NbdTarget::Unix { socket, export } => {
            let s = std::os::unix::net::UnixStream::connect(socket)?;
            s.set_read_timeout(Some(REPLY_TIMEOUT))?;
            s.set_write_timeout(Some(REPLY_TIMEOUT))?;
            let watch = OwnedFd::from(s.try_clone()?);
            Ok((
                Client::handshake(Box::new(s), &ClientConfig::new(export))?,
                watch,
            ))
        }
        NbdTarget::Tcp { host, port, export } => {
            let s = std::net::TcpStream::connect((host.as_str(), *port))?;
            s.set_nodelay(true)?;
            s.set_read_timeout(Some(REPLY_TIMEOUT))?;
            s.set_write_timeout(Some(REPLY_TIMEOUT))?;
            let watch = OwnedFd::from(s.try_clone()?);
            Ok((
                Client::handshake(Box::new(s), &ClientConfig::new(export))?,
                watch,
            ))
        }
    }
}

/// A whole pool of connections, or the first failure.
fn connect_pool(
    target: &NbdTarget,
) -> std::result::Result<(Vec<Client>, Vec<OwnedFd>), ClientError> {
    let mut clients = Vec::with_capacity(POOL);
    let mut watches = Vec::with_capacity(POOL);
    for _ in 0..POOL {
        let (c, w) = connect(target)?;
        clients.push(c);
        watches.push(w);
    }
    Ok((clients, watches))
}

/// Whether the server closed one of the connections (or it failed): the peer's close shows as
/// a hang-up whether or not a request is in flight, unlike data, which a reply also brings.
fn hung_up(watches: &[OwnedFd]) -> bool {
    let mut fds: Vec<libc::pollfd> = watches
        .iter()
        .map(|w| libc::pollfd {
            fd: w.as_raw_fd(),
            events: libc::POLLRDHUP,
            revents: 0,
        })
        .collect();
    // SAFETY: `fds` is a valid array of pollfd of the given length; timeout 0 never blocks.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
    n > 0
        && fds
            .iter()
            .any(|p| p.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0)
}

/// Whether an error means the connection is unusable (as opposed to the server refusing one
/// request with an error reply, after which the connection goes on).
fn breaks_connection(e: &ClientError) -> bool {
    !matches!(e, ClientError::Server { .. })
}

impl NbdVolume {
    /// Connect to the export a URI names.
    pub fn open(uri: &str) -> Result<NbdVolume> {
        let invalid = |msg: String| VolumeError::new(uri, Op::Open, 0, 0, ErrorKind::Invalid(msg));
        let target = parse_nbd_uri(uri).map_err(invalid)?;
        let (conns, watches) = connect_pool(&target)
            .map_err(|e| invalid(format!("cannot connect to NBD export '{uri}': {e}")))?;
        let first = &conns[0];
        if first.is_read_only() {
            return Err(invalid(format!("NBD export '{uri}' is read-only")));
        }
        let size = first.size();
        let bs = first.block_sizes();
        let min = bs.map_or(512, |b| b.min.max(512));
        let max = bs.map_or(DEFAULT_MAX, |b| (b.max as u64).min(DEFAULT_MAX));
        if size == 0 || size % min as u64 != 0 {
            return Err(invalid(format!(
                "NBD export '{uri}' is {size} bytes, not a non-zero multiple of {min}"
            )));
        }
        let multi_conn = first.can_multi_conn();
        let can_trim = first.flags() & FLAG_SEND_TRIM != 0;
        let can_zero = first.flags() & FLAG_SEND_WRITE_ZEROES != 0;
        let shared = Arc::new(Shared {
            name: uri.to_string(),
            target,
            size,
            conns: conns.into_iter().map(|c| Mutex::new(Some(c))).collect(),
            hangup: Mutex::new(watches),
            next: AtomicUsize::new(0),
            state: Mutex::new(LinkState {
                connected: true,
                last_error: String::new(),
                epoch: 0,
                replay: Vec::new(),
                replay_bytes: 0,
                next_seq: 0,
                overflow: false,
                lost: false,
                down_since: None,
                attempts: 0,
            }),
            wake: Condvar::new(),
        });
        let weak = Arc::downgrade(&shared);
        let mut links = LINKS.lock();
        links.retain(|_, w| w.strong_count() > 0);
        links.insert(uri.to_string(), weak.clone());
        drop(links);
        std::thread::Builder::new()
            .name("nbd-reconnect".into())
            .spawn(move || reconnect_loop(weak))
            .map_err(|e| invalid(format!("cannot start the reconnection thread: {e}")))?;
        Ok(NbdVolume {
            shared,
            max,
            min,
            multi_conn,
            can_trim,
            can_zero,
        })
    }

    /// The connection state, for `-L`.
    pub fn link(&self) -> NbdLink {
        NbdLink(self.shared.clone())
    }

    fn detached_error(&self, op: Op, offset: u64, len: u64, why: &str) -> VolumeError {
        let io = std::io::Error::from_raw_os_error(libc::EIO);
        let msg = format!("detached (reconnecting: {why}): {io}");
        VolumeError::new(
            &self.shared.name,
            op,
            offset,
            len,
            ErrorKind::Io(std::io::Error::other(msg)),
        )
    }

    /// Run `f` on a free connection (or wait for the next one in turn when all are busy). While
    /// detached nothing is sent and the request fails at once. A transport failure detaches the
    /// volume and wakes the reconnection thread; the request that met it waits for the
    /// reconnection (up to [`RETRY_WAIT`]) and is sent again, once, on the new connection:
    /// reads and writes are idempotent, and a flush sent after the reconnection covers the
    /// writes sent again by it. Returns the epoch the request ran in.
    fn with_conn<T>(
        &self,
        op: Op,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&mut Client) -> std::result::Result<T, ClientError>,
    ) -> Result<(T, u64)> {
        let mut retried = false;
        loop {
            match self.try_conn(op, offset, len, &mut f) {
                Err((e, true)) if !retried => {
                    retried = true;
                    if !self.shared.wait_connected(RETRY_WAIT) {
                        return Err(e);
                    }
                    tracing::info!(
                        "remote volume {}: sending the {op} at offset {offset} again after reconnecting",
                        self.shared.name
                    );
                }
                Err((e, _)) => return Err(e),
                Ok(v) => return Ok(v),
            }
        }
    }

    /// One attempt of [`with_conn`](Self::with_conn); on failure, whether the connection broke
    /// under this request (as opposed to being known broken before it, or the server refusing it).
    fn try_conn<T>(
        &self,
        op: Op,
        offset: u64,
        len: u64,
        f: &mut impl FnMut(&mut Client) -> std::result::Result<T, ClientError>,
    ) -> std::result::Result<(T, u64), (VolumeError, bool)> {
        let sh = &*self.shared;
        let epoch = {
            let st = sh.state.lock();
            if !st.connected {
                return Err((self.detached_error(op, offset, len, &st.last_error), false));
            }
            st.epoch
        };
        let mut run = |slot: &mut Option<Client>| {
            let Some(client) = slot.as_mut() else {
                // Dropped by a breakage this request raced with.
                let why = sh.state.lock().last_error.clone();
                return Err((self.detached_error(op, offset, len, &why), true));
            };
            match f(client) {
                Ok(v) => Ok((v, epoch)),
                Err(e) => {
                    let broke = breaks_connection(&e);
                    if broke {
                        *slot = None;
                        sh.detach(&e.to_string());
                    }
                    Err((self.err(op, offset, len, e), broke))
                }
            }
        };
        for c in &sh.conns {
            if let Some(mut g) = c.try_lock() {
                return run(&mut g);
            }
        }
        let i = sh.next.fetch_add(1, Ordering::Relaxed) % sh.conns.len();
        let mut g = sh.conns[i].lock();
        run(&mut g)
    }

    /// Keep a write for replay before it is sent (so no breakage can come between its
    /// acknowledgement and its being kept); returns its sequence number.
    fn keep(&self, offset: u64, data: Option<&[u8]>, len: u64) -> Option<u64> {
        let mut st = self.shared.state.lock();
        // While detached the request fails without being sent: nothing to keep.
        if st.overflow || !st.connected {
            return None;
        }
        if st.replay_bytes + data.map_or(0, <[u8]>::len) > REPLAY_MAX {
            st.overflow = true;
            st.replay.clear();
            st.replay_bytes = 0;
            return None;
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        st.replay_bytes += data.map_or(0, <[u8]>::len);
        st.replay.push(Replay {
            seq,
            offset,
            data: data.map(<[u8]>::to_vec),
            len,
            acked: false,
        });
        Some(seq)
    }

    /// Kept write `seq` was acknowledged (a later flush covers it), or failed: then the caller
    /// has its error and writes it again if it still wants it (the engine keeps the line
    /// dirty), and no flush has to cover it, so it is not kept.
    fn settle(&self, seq: Option<u64>, acked: bool) {
        let Some(seq) = seq else { return };
        let mut st = self.shared.state.lock();
        if let Ok(i) = st.replay.binary_search_by_key(&seq, |r| r.seq) {
            if acked {
                st.replay[i].acked = true;
            } else {
                let r = st.replay.remove(i);
                st.replay_bytes -= r.data.map_or(0, |d| d.len());
            }
        }
    }

    fn err(&self, op: Op, offset: u64, len: u64, e: ClientError) -> VolumeError {
        let io = std::io::Error::other(e.to_string());
        VolumeError::new(&self.shared.name, op, offset, len, ErrorKind::Io(io))
    }

    /// Split `[offset, offset+len)` into pieces of at most the server's maximum request.
    fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let max = self.max;
        (0..len.div_ceil(max)).map(move |i| {
            let start = i * max;
            (offset + start, (len - start).min(max))
        })
    }

    fn flush_all(&self) -> Result<()> {
        if self.multi_conn {
            self.with_conn(Op::Flush, 0, 0, |c| c.flush())?;
            return Ok(());
        }
        // As with_conn: a flush that met a dead connection is sent again, once, after the
        // reconnection (which sent the unflushed writes again first).
        match self.flush_every_conn() {
            Err((e, true)) => {
                if !self.shared.wait_connected(RETRY_WAIT) {
                    return Err(e);
                }
                self.flush_every_conn().map_err(|(e, _)| e)
            }
            r => r.map_err(|(e, _)| e),
        }
    }

    /// Without multi-conn only a flush on every connection covers every connection's writes.
    /// On failure, whether a connection broke under it.
    fn flush_every_conn(&self) -> std::result::Result<(), (VolumeError, bool)> {
        let sh = &*self.shared;
        {
            let st = sh.state.lock();
            if !st.connected {
                return Err((self.detached_error(Op::Flush, 0, 0, &st.last_error), false));
            }
        }
        for c in &sh.conns {
            let mut g = c.lock();
            let Some(client) = g.as_mut() else {
                let why = sh.state.lock().last_error.clone();
                return Err((self.detached_error(Op::Flush, 0, 0, &why), true));
            };
            if let Err(e) = client.flush() {
                let broke = breaks_connection(&e);
                if broke {
                    *g = None;
                    sh.detach(&e.to_string());
                }
                return Err((self.err(Op::Flush, 0, 0, e), broke));
            }
        }
        Ok(())
    }
}

/// Send every kept write again, in the order first sent, on a new connection: the server may
/// have lost what it acknowledged but had not flushed. Writes are idempotent, and nothing else
/// is sent while the volume is detached, so the result is as if nothing had been lost. Holds
/// the state lock throughout, so no write is kept or acknowledged meanwhile.
fn replay(sh: &Shared, client: &mut Client) -> std::result::Result<(), String> {
    let mut st = sh.state.lock();
    let n = st.replay.len();
    for r in st.replay.iter_mut() {
        match &r.data {
            Some(d) => client.write(d, r.offset, false),
            None => client.write_zeroes(r.offset, r.len as u32, false, false),
        }
        .map_err(|e| format!("sending unflushed writes again failed: {e}"))?;
        r.acked = true;
    }
    if n > 0 {
        tracing::info!(
            "remote volume {}: sent {n} unflushed writes ({} bytes) again on the new connection",
            sh.name,
            st.replay_bytes
        );
    }
    Ok(())
}

/// Reconnect whenever the volume is detached, with exponential backoff, until the volume is
/// dropped.
fn reconnect_loop(weak: Weak<Shared>) {
    loop {
        let Some(sh) = weak.upgrade() else { return };
        {
            let mut st = sh.state.lock();
            if st.connected {
                // Wake up now and then to notice that the volume is gone, or that the server
                // closed a connection while nothing was sent to it.
                sh.wake.wait_for(&mut st, HANGUP_CHECK);
                let closed = st.connected && hung_up(&sh.hangup.lock());
                drop(st);
                if closed {
                    sh.detach("the server closed the connection");
                }
                continue;
            }
        }
        drop(sh);
        let started = Instant::now();
        let mut delay = BACKOFF_FIRST;
        let mut attempts = 0u32;
        loop {
            std::thread::sleep(delay);
            let Some(sh) = weak.upgrade() else { return };
            attempts += 1;
            sh.state.lock().attempts = attempts;
            let result = connect_pool(&sh.target)
                .map_err(|e| e.to_string())
                .and_then(|(mut pool, watches)| {
                    let size = pool[0].size();
                    if size != sh.size {
                        return Err(format!(
                            "the export is {size} bytes now, not {} bytes as before; not reattached",
                            sh.size
                        ));
                    }
                    replay(&sh, &mut pool[0])?;
                    Ok((pool, watches))
                });
            match result {
                Ok((pool, watches)) => {
                    // Each slot is replaced under its lock: a request holds one connection
                    // from start to end.
                    for (slot, client) in sh.conns.iter().zip(pool) {
                        *slot.lock() = Some(client);
                    }
                    *sh.hangup.lock() = watches;
                    let mut st = sh.state.lock();
                    st.connected = true;
                    st.down_since = None;
                    sh.wake.notify_all();
                    tracing::info!(
                        "remote volume {}: reconnected after {attempts} attempts ({:.1} s)",
                        sh.name,
                        started.elapsed().as_secs_f64()
                    );
                    break;
                }
                Err(e) => {
                    let mut st = sh.state.lock();
                    if st.last_error != e {
                        tracing::warn!("remote volume {}: reconnecting failed: {e}", sh.name);
                        st.last_error = e;
                    }
                }
            }
            delay = (delay * 2).min(BACKOFF_CAP);
        }
    }
}

impl Volume for NbdVolume {
    fn name(&self) -> &str {
        &self.shared.name
    }

    fn size(&self) -> u64 {
        self.shared.size
    }

    fn logical_block_size(&self) -> u32 {
        self.min
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self, Op::Read, offset, buf.len() as u64)?;
        for (off, n) in self.pieces(offset, buf.len() as u64) {
            let at = (off - offset) as usize;
            let piece = &mut buf[at..at + n as usize];
            self.with_conn(Op::Read, off, n, |c| c.read(piece, off))?;
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        check_range(self, Op::Write, offset, buf.len() as u64)?;
        for (off, n) in self.pieces(offset, buf.len() as u64) {
            let at = (off - offset) as usize;
            let piece = &buf[at..at + n as usize];
            let seq = self.keep(off, Some(piece), n);
            let sent = self.with_conn(Op::Write, off, n, |c| c.write(piece, off, false));
            self.settle(seq, sent.is_ok());
            sent?;
        }
        Ok(())
    }

    /// A flush covers the writes acknowledged before it was sent; those leave the replay list.
    /// Writes a broken connection had acknowledged were sent again on the new one before it
    /// took requests, so a flush there covers them too. Only if they could not be kept (the
    /// replay list overflowed) does the flush fail, once, rather than call them durable.
    fn flush(&self) -> Result<()> {
        let covered: Vec<u64> = {
            let st = self.shared.state.lock();
            if !st.connected && st.replay.is_empty() && !st.overflow && !st.lost {
                // Every write the server acknowledged is covered by an earlier flush: nothing
                // to make durable, so a client's flush does not fail during an outage.
                return Ok(());
            }
            st.replay
                .iter()
                .filter(|r| r.acked)
                .map(|r| r.seq)
                .collect()
        };
        self.flush_all()?;
        let mut st = self.shared.state.lock();
        if st.lost {
            st.lost = false;
            let io = std::io::Error::other(format!(
                "the connection to the server broke after it acknowledged writes that no flush covered; they may be lost ({})",
                st.last_error
            ));
            return Err(VolumeError::new(
                &self.shared.name,
                Op::Flush,
                0,
                0,
                ErrorKind::Io(io),
            ));
        }
        // Writes acknowledged before this flush are durable; keeping starts afresh (a write in
        // flight meanwhile and not kept is the one gap an overflow leaves).
        st.overflow = false;
        // Both lists are in sequence order.
        let mut i = 0;
        let mut freed = 0;
        st.replay.retain(|r| {
            while i < covered.len() && covered[i] < r.seq {
                i += 1;
            }
            let keep = !(i < covered.len() && covered[i] == r.seq);
            if !keep {
                freed += r.data.as_ref().map_or(0, Vec::len);
            }
            keep
        });
        st.replay_bytes -= freed;
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self, Op::Discard, offset, len)?;
        if !self.can_trim {
            // Discard is a hint; a server without trim keeps the data, which is allowed.
            return Ok(());
        }
        for (off, n) in self.pieces(offset, len) {
            self.with_conn(Op::Discard, off, n, |c| c.trim(off, n as u32))?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self, Op::WriteZeroes, offset, len)?;
        if !self.can_zero {
            return hybridcache_volume::write_zeroes_by_writing(self, offset, len);
        }
        for (off, n) in self.pieces(offset, len) {
            let seq = self.keep(off, None, n);
            let sent = self.with_conn(Op::WriteZeroes, off, n, |c| {
                c.write_zeroes(off, n as u32, false, false)
            });
            self.settle(seq, sent.is_ok());
            sent?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hybridcache_nbd::{Export, ExportRegistry, ExportResult, Server};

    /// A disk with a volatile write cache: a write is kept only once flushed, and a new server
    /// instance starts from what was flushed.
    struct Volatile {
        durable: Arc<Mutex<Vec<u8>>>,
        pending: Mutex<Vec<(u64, Vec<u8>)>>,
    }

    impl Export for Volatile {
        fn size(&self) -> u64 {
            self.durable.lock().len() as u64
        }
        fn read(&self, buf: &mut [u8], offset: u64) -> ExportResult<()> {
            let at = offset as usize;
            buf.copy_from_slice(&self.durable.lock()[at..at + buf.len()]);
            for (off, data) in self.pending.lock().iter() {
                for (i, b) in data.iter().enumerate() {
                    let p = *off as usize + i;
                    if p >= at && p < at + buf.len() {
                        buf[p - at] = *b;
                    }
                }
            }
            Ok(())
        }
        fn write(&self, buf: &[u8], offset: u64, _fua: bool) -> ExportResult<()> {
            self.pending.lock().push((offset, buf.to_vec()));
            Ok(())
        }
        fn flush(&self) -> ExportResult<()> {
            let mut d = self.durable.lock();
            for (off, data) in self.pending.lock().drain(..) {
                d[off as usize..off as usize + data.len()].copy_from_slice(&data);
            }
            Ok(())
        }
    }

    fn serve(sock: &std::path::Path, durable: &Arc<Mutex<Vec<u8>>>) -> Server {
        let registry = ExportRegistry::new();
        registry
            .add(
                "v",
                Arc::new(Volatile {
                    durable: durable.clone(),
                    pending: Mutex::new(Vec::new()),
                }),
            )
            .unwrap();
        let server = Server::new(registry);
        server.serve_unix(sock).unwrap();
        server
    }

    #[test]
    fn reconnects_and_sends_unflushed_writes_again() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("v.sock");
        let durable = Arc::new(Mutex::new(vec![0u8; 1 << 20]));
        let first = serve(&sock, &durable);
        let uri = format!("nbd+unix:///v?socket={}", sock.display());
        let vol = NbdVolume::open(&uri).unwrap();
        let link = vol.link();
        vol.write_at(&[1u8; 4096], 0).unwrap();
        vol.flush().unwrap();
        // Acknowledged, not flushed: the server loses it when it goes.
        vol.write_at(&[7u8; 4096], 8192).unwrap();
        first.shutdown();
        drop(first);
        let mut buf = vec![0u8; 4096];
        let e = vol.read_at(&mut buf, 0).unwrap_err().to_string();
        assert!(link.detached().is_some(), "{e}");
        // Detached: requests fail at once, without waiting for the server.
        let e = vol.read_at(&mut buf, 0).unwrap_err().to_string();
        assert!(e.contains("detached (reconnecting: "), "{e}");
        assert!(
            vol.flush().is_err(),
            "an unflushed write is not durable yet"
        );
        assert!(durable.lock()[8192..8192 + 4096].iter().all(|&b| b == 0));

        let _second = serve(&sock, &durable);
        let deadline = Instant::now() + Duration::from_secs(20);
        while link.detached().is_some() {
            assert!(Instant::now() < deadline, "never reconnected");
            std::thread::sleep(Duration::from_millis(20));
        }
        vol.flush().unwrap();
        // The write the first server lost was sent again and is now durable.
        let durable = durable.lock();
        assert!(
            durable[8192..8192 + 4096].iter().all(|&b| b == 7),
            "the unflushed write was sent again"
        );
        assert!(durable[..4096].iter().all(|&b| b == 1));
        drop(durable);
        vol.read_at(&mut buf, 8192).unwrap();
        assert_eq!(buf, vec![7u8; 4096]);
        assert!(
            vol.shared.state.lock().replay.is_empty(),
            "a flush empties the list"
        );
    }

    #[test]
    fn a_flush_with_nothing_unflushed_succeeds_while_detached() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("v.sock");
        let durable = Arc::new(Mutex::new(vec![0u8; 1 << 20]));
        let first = serve(&sock, &durable);
        let vol = NbdVolume::open(&format!("nbd+unix:///v?socket={}", sock.display())).unwrap();
        vol.write_at(&[3u8; 512], 0).unwrap();
        vol.flush().unwrap();
        first.shutdown();
        drop(first);
        let mut buf = vec![0u8; 512];
        assert!(vol.read_at(&mut buf, 0).is_err());
        assert!(vol.link().detached().is_some());
        // A write refused while detached needs no flush to cover it.
        assert!(vol.write_at(&[4u8; 512], 512).is_err());
        vol.flush().unwrap();
    }

    /// A server that answers every request with EIO and an empty message, as nbdkit's error
    /// filter does: in structured error chunks when the client asks for them, else in simple
    /// replies, which have no message at all.
    fn serve_silent_errors(sock: &std::path::Path, structured: bool) {
        use hybridcache_nbd::proto::*;
        use std::io::{Read, Write};
        let listener = std::os::unix::net::UnixListener::bind(sock).unwrap();
        std::thread::spawn(move || {
            for s in listener.incoming() {
                let Ok(mut s) = s else { return };
                std::thread::spawn(move || -> std::io::Result<()> {
                    s.write_all(&encode_greeting(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES))?;
                    s.read_exact(&mut [0u8; 4])?;
                    let mut reply_structured = false;
                    loop {
                        let mut h = [0u8; OPTION_HEADER_LEN];
                        s.read_exact(&mut h)?;
                        let h = parse_option_header(&h).unwrap();
                        s.read_exact(&mut vec![0u8; h.len as usize])?;
                        let mut out = Vec::new();
                        match h.option {
                            OPT_STRUCTURED_REPLY if structured => {
                                reply_structured = true;
                                encode_option_reply(&mut out, h.option, REP_ACK, &[]);
                            }
                            OPT_GO => {
                                let info =
                                    encode_info_export(1 << 20, FLAG_HAS_FLAGS | FLAG_SEND_FLUSH);
                                encode_option_reply(&mut out, h.option, REP_INFO, &info);
                                encode_option_reply(&mut out, h.option, REP_ACK, &[]);
                                s.write_all(&out)?;
                                break;
                            }
                            _ => encode_option_reply(&mut out, h.option, REP_ERR_UNSUP, &[]),
                        }
                        s.write_all(&out)?;
                    }
                    loop {
                        let mut r = [0u8; REQUEST_LEN];
                        s.read_exact(&mut r)?;
                        let r = parse_request(&r).unwrap();
                        match r.typ {
                            CMD_DISC => return Ok(()),
                            CMD_WRITE => s.read_exact(&mut vec![0u8; r.length as usize])?,
                            _ => {}
                        }
                        let mut out = Vec::new();
                        if reply_structured {
                            encode_structured_error(&mut out, r.handle, EIO, "");
                        } else {
                            out.resize(SIMPLE_REPLY_LEN, 0);
                            encode_simple_reply(&mut out, EIO, r.handle);
                        }
                        s.write_all(&out)?;
                    }
                });
            }
        });
    }

    /// A remote core whose server says nothing about its errors: the error line says what
    /// happened (the errno and its meaning) and has no dangling ": " where a message would be.
    #[test]
    fn an_error_without_a_message_reads_whole() {
        for structured in [true, false] {
            let dir = tempfile::tempdir().unwrap();
            let sock = dir.path().join("e.sock");
            serve_silent_errors(&sock, structured);
            let vol = NbdVolume::open(&format!("nbd+unix:///e?socket={}", sock.display())).unwrap();
            let mut buf = vec![0u8; 4096];
            let read = vol.read_at(&mut buf, 0).unwrap_err().to_string();
            let write = vol.write_at(&buf, 0).unwrap_err().to_string();
            let flush = vol.flush().unwrap_err().to_string();
            for e in [read, write, flush] {
                assert!(e.contains("server error 5 (I/O error)"), "{e}");
                assert!(e.contains("no message"), "{e}");
                assert!(!e.trim_end().ends_with(':'), "structured {structured}: {e}");
                assert!(!e.contains(": :") && !e.contains(":  "), "{e}");
            }
        }
    }

    #[test]
    fn parses_uris() {
        assert_eq!(
            parse_nbd_uri("nbd+unix:///cas1-1?socket=/run/x.sock"),
            Ok(NbdTarget::Unix {
                socket: "/run/x.sock".into(),
                export: "cas1-1".into()
            })
        );
        assert_eq!(
            parse_nbd_uri("nbd://example.org/disk"),
            Ok(NbdTarget::Tcp {
                host: "example.org".into(),
                port: 10809,
                export: "disk".into()
            })
        );
        assert_eq!(
            parse_nbd_uri("nbd://[::1]:1234"),
            Ok(NbdTarget::Tcp {
                host: "::1".into(),
                port: 1234,
                export: String::new()
            })
        );
        assert!(parse_nbd_uri("nbd+unix:///x").is_err());
        assert!(parse_nbd_uri("nbd://host:99999/x").is_err());
        assert!(parse_nbd_uri("nbd:///x").is_err());
        assert!(parse_nbd_uri("http://x").is_err());
    }
}

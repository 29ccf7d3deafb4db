//! Listeners, per-connection threads, admission limits and shutdown.

use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::handshake::{self, HandshakeCtx, Negotiated, Outcome, DEFAULT_MAX_OPTION_LEN};
use crate::memory::{Memory, PIECE};
use crate::observe;
use crate::registry::{ClientGuard, ExportEntry, ExportRegistry};
use crate::transmission::{self, End, WaitInput, KEPT_BLOCK, MAX_DEFERRED, MAX_DEFERRED_REPLY};

/// Tunables; `Default` gives the documented defaults.
///
/// Limits against clients that hold resources: `max_connections`,
/// `max_connections_per_client` and `max_connections_per_export` bound the
/// connections (each refusal is logged with the peer through `tracing`);
/// `handshake_timeout` and `stall_timeout` drop clients that stop half-way;
/// `memory_limit` bounds the memory the server itself holds for connections
/// and requests, whatever clients send (not the exports' own memory).
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Requests executed concurrently per connection: the most threads one
    /// connection runs. They are started as its requests need them, and a
    /// connection idle for 1 s gives all of them back (it waits on the
    /// server's poller until its client sends again). Default 4.
    pub workers_per_connection: usize,
    /// Connections beyond this are closed right after `accept`. Default 256.
    pub max_connections: usize,
    /// Connections one client may hold; more are closed right after
    /// `accept`. A TCP client is its IP address; a Unix-socket client is its
    /// process (user id and pid, SO_PEERCRED), so one local process holding
    /// idle connections cannot lock the other processes of its user out.
    /// Default 64.
    pub max_connections_per_client: usize,
    /// Connections all the Unix-socket processes of one user id may hold
    /// together, so one local user cannot take every slot from the others
    /// (TCP clients are not counted here). Default 192.
    pub max_connections_per_user: usize,
    /// Connections one export may have: `NBD_OPT_GO` beyond it gets
    /// `NBD_REP_ERR_POLICY` (the client may pick another export),
    /// `NBD_OPT_EXPORT_NAME` a closed connection. Default 192, so clients of
    /// one export cannot take every slot from the others.
    pub max_connections_per_export: usize,
    /// A client that has not finished the handshake (option haggling up to
    /// `NBD_OPT_GO`) this long after connecting is dropped, however it
    /// trickles its bytes. Default 10 s.
    pub handshake_timeout: Option<Duration>,
    /// In transmission, a client that stops for this long in the middle of a
    /// request (part of a header or write payload sent), or that does not
    /// take a reply for this long, is dropped and its memory released. Idle
    /// time between requests is never limited. Default 60 s.
    pub stall_timeout: Option<Duration>,
    /// Bound on the memory the server holds for its connections and
    /// requests: the budget of in-flight request bytes is what remains after
    /// each of the `max_connections` connections' fixed buffers and thread
    /// stacks (see [`ServerConfig::inflight_budget`]). Default 512 MiB.
    pub memory_limit: u64,
    /// Bytes of request data (write payloads being read or executed, read
    /// data until its reply has been written) held at once; over it, the
    /// server stops reading requests until bytes are released. None (the
    /// default) derives it from `memory_limit`.
    pub inflight_budget: Option<u64>,
    /// Option data above this is refused (see the handshake module).
    /// Default 64 KiB.
    pub max_option_len: u32,
    /// How long `shutdown` lets connections finish in-flight requests before
    /// closing their sockets. Default 5 s.
    pub shutdown_grace: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            workers_per_connection: 4,
            max_connections: 256,
            max_connections_per_client: 64,
            max_connections_per_user: 192,
            max_connections_per_export: 192,
            handshake_timeout: Some(Duration::from_secs(10)),
            stall_timeout: Some(Duration::from_secs(60)),
            memory_limit: 512 << 20,
            inflight_budget: None,
            max_option_len: DEFAULT_MAX_OPTION_LEN,
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

/// Resident memory a thread's stack may reach in this crate's code paths (measured: the
/// hostile-mix test's 131 connections of 5 threads cost about 0.3 MiB each in all).
const STACK_RESIDENT: u64 = 32 << 10;
/// The process's own memory besides connections: code, libraries, allocator.
const BASE_RESIDENT: u64 = 16 << 20;

impl ServerConfig {
    /// The most one connection holds outside the budget: its read buffer,
    /// its queue of small replies (the queue and the batch being written),
    /// the handshake's option buffer, each worker's stack and the
    /// read-modify-write block it keeps (up to 4 KiB; an export whose minimum
    /// block size is larger needs that much per worker during an unaligned
    /// request).
    pub fn connection_overhead(&self) -> u64 {
        let workers = self.workers_per_connection.max(1) as u64;
        READ_BUFFER as u64
            + 2 * (MAX_DEFERRED + MAX_DEFERRED_REPLY) as u64
            + u64::from(self.max_option_len)
            + STACK_RESIDENT
            + workers * (STACK_RESIDENT + KEPT_BLOCK as u64)
    }

    /// Free buffers the pool keeps for reuse (outside the budget).
    pub fn pool_retain(&self) -> u64 {
        (self.memory_limit / 16).min(32 << 20)
    }

    /// The budget of in-flight request bytes: `inflight_budget` if set,
    /// else `memory_limit` minus the process base, the pool and
    /// `max_connections` times [`ServerConfig::connection_overhead`], but at
    /// least 4 pieces (4 MiB), so a limit too small for the connection count
    /// still serves (slowly) rather than not at all.
    pub fn effective_budget(&self) -> u64 {
        self.inflight_budget.unwrap_or_else(|| {
            let fixed = BASE_RESIDENT
                + self.pool_retain()
                + self.max_connections as u64 * self.connection_overhead();
            self.memory_limit
                .saturating_sub(fixed)
                .max(4 * PIECE as u64)
        })
    }
}

/// Who a connection counts against for `max_connections_per_client`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum ClientKey {
    Ip(IpAddr),
    /// A local process: a pid is reused only after its process ended, and with it its
    /// connections, so (uid, pid) names one process for as long as it holds any.
    Process {
        uid: u32,
        pid: i32,
    },
    /// Peer unknown (credentials unavailable, or `serve_stream`).
    Unknown,
}

/// A connection's client, for limits and log lines.
#[derive(Debug, Clone)]
struct Peer {
    key: ClientKey,
    /// The user id of a Unix-socket peer, counted against `max_connections_per_user`.
    uid: Option<u32>,
    /// "tcp 10.0.0.5:41234", "unix uid 1000 pid 4242".
    desc: String,
}

impl std::fmt::Display for Peer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.desc)
    }
}

/// Connection counts per client and per export name. Touched only when
/// connections open and close.
#[derive(Default)]
struct Admission {
    per_client: HashMap<ClientKey, usize>,
    per_user: HashMap<u32, usize>,
    per_export: HashMap<String, usize>,
}

fn decrement<K: std::hash::Hash + Eq>(m: &mut HashMap<K, usize>, k: &K) {
    if let Some(c) = m.get_mut(k) {
        *c -= 1;
        if *c == 0 {
            m.remove(k);
        }
    }
}

/// Refusals logged per second at most; a flood of connection attempts must
/// not become a flood of log lines. The next line logged says how many
/// were left out.
const REFUSAL_LOG_PER_SEC: u32 = 20;

struct RefusalLog {
    window: Instant,
    in_window: u32,
    suppressed: u64,
}

/// An accepted connection of either family.
enum Sock {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Sock {
    fn peer(&self) -> Peer {
        match self {
            Sock::Tcp(s) => match s.peer_addr() {
                Ok(a) => Peer {
                    key: ClientKey::Ip(a.ip().to_canonical()),
                    uid: None,
                    desc: format!("tcp {a}"),
                },
                Err(_) => Peer {
                    key: ClientKey::Unknown,
                    uid: None,
                    desc: "tcp (peer unknown)".into(),
                },
            },
            Sock::Unix(s) => {
                let cred = unix_peer_credentials(s);
                if let Some(cred) = cred {
                    Peer {
                        key: ClientKey::Process {
                            uid: cred.uid,
                            pid: cred.pid,
                        },
                        uid: Some(cred.uid),
                        desc: format!("unix uid {} pid {}", cred.uid, cred.pid),
                    }
                } else {
                    Peer {
                        key: ClientKey::Unknown,
                        uid: None,
                        desc: "unix (peer unknown)".into(),
                    }
                }
            }
        }
    }

    fn try_clone(&self) -> io::Result<Sock> {
        Ok(match self {
            Sock::Unix(s) => Sock::Unix(s.try_clone()?),
            Sock::Tcp(s) => Sock::Tcp(s.try_clone()?),
        })
    }

    fn shutdown(&self, how: Shutdown) {
        // Fails only if already disconnected, which is the goal anyway.
        let _ = match self {
            Sock::Unix(s) => s.shutdown(how),
            Sock::Tcp(s) => s.shutdown(how),
        };
    }

    /// Bounds how long a read may block (None: forever).
    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Sock::Unix(s) => s.set_read_timeout(t),
            Sock::Tcp(s) => s.set_read_timeout(t),
        }
    }

    /// Bounds how long a write may block without progress (None: forever).
    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Sock::Unix(s) => s.set_write_timeout(t),
            Sock::Tcp(s) => s.set_write_timeout(t),
        }
    }
}

/// A socket whose reads and writes fail with `TimedOut` once the handshake
/// deadline has passed, until `handshaking` is cleared. A timeout per system
/// call alone would let a client trickle a byte at a time forever.
struct HandshakeSock<'a> {
    sock: &'a Sock,
    deadline: Option<Instant>,
    handshaking: &'a AtomicBool,
}

impl HandshakeSock<'_> {
    fn arm(&self, read: bool) -> io::Result<()> {
        if !self.handshaking.load(Ordering::Relaxed) {
            return Ok(());
        }
        let Some(d) = self.deadline else {
            return Ok(());
        };
        let left = d.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "handshake timeout"));
        }
        if read {
            self.sock.set_read_timeout(Some(left))
        } else {
            self.sock.set_write_timeout(Some(left))
        }
    }
}

impl Read for HandshakeSock<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.arm(true)?;
        (&mut &*self.sock).read(buf)
    }
}

impl Write for HandshakeSock<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.arm(false)?;
        (&mut &*self.sock).write(buf)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.arm(false)?;
        (&mut &*self.sock).write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for &Sock {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match *self {
            Sock::Unix(s) => (&*s).read(buf),
            Sock::Tcp(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Sock {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match *self {
            Sock::Unix(s) => (&*s).write(buf),
            Sock::Tcp(s) => (&*s).write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match *self {
            Sock::Unix(s) => (&*s).write_vectored(bufs),
            Sock::Tcp(s) => (&*s).write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

enum Listener {
    Unix(UnixListener),
    Tcp(TcpListener),
}

impl Listener {
    fn accept(&self) -> io::Result<Sock> {
        match self {
            Listener::Unix(l) => l.accept().map(|(s, _)| Sock::Unix(s)),
            Listener::Tcp(l) => {
                let (s, _) = l.accept()?;
                // Replies are small and latency-bound; Nagle would hold them.
                s.set_nodelay(true)?;
                Ok(Sock::Tcp(s))
            }
        }
    }

    fn raw_fd(&self) -> i32 {
        match self {
            Listener::Unix(l) => l.as_raw_fd(),
            Listener::Tcp(l) => l.as_raw_fd(),
        }
    }
}

impl Sock {
    fn raw_fd(&self) -> i32 {
        match self {
            Sock::Unix(s) => s.as_raw_fd(),
            Sock::Tcp(s) => s.as_raw_fd(),
        }
    }

    /// Waits up to `timeout` for input, end of stream or an error on the socket (whatever the
    /// next read would not block on); false if none came.
    fn wait_readable(&self, timeout: Duration) -> bool {
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let mut pfd = libc::pollfd {
                fd: self.raw_fd(),
                events: libc::POLLIN | libc::POLLRDHUP,
                revents: 0,
            };
            let ms = left.as_millis().min(i32::MAX as u128) as i32;
            // SAFETY: one pollfd we own, for a descriptor `self` keeps open.
            let rc = unsafe { libc::poll(&mut pfd, 1, ms) };
            if rc >= 0 {
                return rc > 0;
            }
            if io::Error::last_os_error().kind() != io::ErrorKind::Interrupted {
                // Let the read find out what is wrong.
                return true;
            }
        }
    }
}

/// What a connection in transmission keeps while no thread serves it.
struct Session {
    n: Box<Negotiated>,
    _client: ClientGuard,
    /// The export the connection counts against (`max_connections_per_export`).
    admitted: Option<String>,
    /// The connection's id for request observers, the same across parkings.
    conn_id: u64,
}

/// A connection in transmission that went quiet: it waits on the poller without a thread.
struct Parked {
    id: u64,
    peer: Peer,
    sock: Sock,
    session: Session,
}

#[derive(Default)]
struct PollerState {
    parked: HashMap<u64, Parked>,
    /// Shutdown took every parked connection; none may park any more.
    stopped: bool,
}

/// Watches the sockets of parked connections (one epoll set for the whole server, one
/// thread) and restarts a connection on a thread when its client sends, hangs up or fails.
struct Poller {
    epoll: OwnedFd,
    /// Wakes the poller's thread for shutdown.
    wake: OwnedFd,
    state: Mutex<PollerState>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

/// The epoll token of the poller's wake-up eventfd (connection ids count up from 0).
const WAKE_TOKEN: u64 = u64::MAX;

impl Poller {
    fn new() -> io::Result<Poller> {
        // SAFETY: plain system calls; each descriptor is owned as soon as it exists.
        unsafe {
            let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
            if ep < 0 {
                return Err(io::Error::last_os_error());
            }
            let epoll = OwnedFd::from_raw_fd(ep);
            let ev = libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK);
            if ev < 0 {
                return Err(io::Error::last_os_error());
            }
            let wake = OwnedFd::from_raw_fd(ev);
            let mut e = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: WAKE_TOKEN,
            };
            if libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, ev, &mut e) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(Poller {
                epoll,
                wake,
                state: Mutex::new(PollerState::default()),
                thread: Mutex::new(None),
            })
        }
    }

    /// Watches `p`'s socket; gives `p` back if the poller has stopped or cannot watch it.
    fn park(&self, p: Parked) -> Result<(), Parked> {
        let mut st = self.state.lock();
        if st.stopped {
            return Err(p);
        }
        // One-shot: the connection is restarted once, and watched again only when it parks
        // again.
        let mut e = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLRDHUP | libc::EPOLLONESHOT) as u32,
            u64: p.id,
        };
        // SAFETY: the socket stays open while it is in `parked`; removed before it is closed.
        let rc = unsafe {
            libc::epoll_ctl(
                self.epoll.as_raw_fd(),
                libc::EPOLL_CTL_ADD,
                p.sock.raw_fd(),
                &mut e,
            )
        };
        if rc != 0 {
            return Err(p);
        }
        st.parked.insert(p.id, p);
        Ok(())
    }

    fn unwatch(&self, p: &Parked) {
        // SAFETY: as in `park`; a descriptor not in the set only makes this fail.
        unsafe {
            libc::epoll_ctl(
                self.epoll.as_raw_fd(),
                libc::EPOLL_CTL_DEL,
                p.sock.raw_fd(),
                std::ptr::null_mut(),
            );
        }
    }

    /// The poller's thread: restarts each parked connection whose socket becomes readable.
    fn run(&self, inner: &Arc<Inner>) {
        let mut events = [libc::epoll_event { events: 0, u64: 0 }; 64];
        loop {
            // SAFETY: `events` is a valid array of its stated length.
            let n = unsafe {
                libc::epoll_wait(
                    self.epoll.as_raw_fd(),
                    events.as_mut_ptr(),
                    events.len() as i32,
                    -1,
                )
            };
            if n < 0 {
                if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                tracing::error!(
                    "NBD poller failed: {}; idle connections are closed",
                    io::Error::last_os_error()
                );
                for p in self.stop_watching() {
                    end_parked(inner, p);
                }
                return;
            }
            for ev in &events[..n as usize] {
                let token = ev.u64;
                if token == WAKE_TOKEN {
                    if self.state.lock().stopped {
                        return;
                    }
                    continue;
                }
                let p = self.state.lock().parked.remove(&token);
                if let Some(p) = p {
                    self.unwatch(&p);
                    restart(inner, p);
                }
            }
        }
    }

    /// No connection parks any more; returns those parked now.
    fn stop_watching(&self) -> Vec<Parked> {
        let mut st = self.state.lock();
        st.stopped = true;
        let parked: Vec<Parked> = st.parked.drain().map(|(_, p)| p).collect();
        drop(st);
        for p in &parked {
            self.unwatch(p);
        }
        parked
    }

    /// Stops the thread; returns the connections still parked.
    fn stop(&self) -> Vec<Parked> {
        let parked = self.stop_watching();
        let one = 1u64.to_ne_bytes();
        // SAFETY: writes 8 bytes from a live buffer to our eventfd.
        unsafe {
            libc::write(self.wake.as_raw_fd(), one.as_ptr().cast(), one.len());
        }
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
        parked
    }
}

struct ListenerSlot {
    listener: Arc<Listener>,
    thread: Option<JoinHandle<()>>,
    unix_path: Option<PathBuf>,
}

struct Inner {
    registry: ExportRegistry,
    config: ServerConfig,
    memory: Memory,
    admission: Mutex<Admission>,
    refusals: Mutex<RefusalLog>,
    shutting_down: AtomicBool,
    listeners: Mutex<Vec<ListenerSlot>>,
    /// Clones of live sockets, so shutdown can unblock their threads.
    conns: Mutex<HashMap<u64, Sock>>,
    conns_changed: Condvar,
    conn_threads: Mutex<Vec<JoinHandle<()>>>,
    next_id: AtomicU64,
    /// Started with the first listener (connections of `serve_stream` never park).
    poller: OnceLock<Poller>,
}

/// An NBD server: serves the exports of an [`ExportRegistry`] on any number
/// of Unix and TCP listeners. Dropping it shuts it down.
pub struct Server {
    inner: Arc<Inner>,
}

/// A cloneable handle that can shut a [`Server`] down from anywhere.
#[derive(Clone)]
pub struct ShutdownHandle {
    inner: Arc<Inner>,
}

impl ShutdownHandle {
    pub fn shutdown(&self) {
        shutdown(&self.inner);
    }
}

impl Server {
    pub fn new(registry: ExportRegistry) -> Server {
        Server::with_config(registry, ServerConfig::default())
    }

    pub fn with_config(registry: ExportRegistry, config: ServerConfig) -> Server {
        Server {
            inner: Arc::new(Inner {
                registry,
                memory: Memory::new(config.effective_budget(), config.pool_retain()),
                admission: Mutex::new(Admission::default()),
                refusals: Mutex::new(RefusalLog {
                    window: Instant::now(),
                    in_window: 0,
                    suppressed: 0,
                }),
                config,
                shutting_down: AtomicBool::new(false),
                listeners: Mutex::new(Vec::new()),
                conns: Mutex::new(HashMap::new()),
                conns_changed: Condvar::new(),
                conn_threads: Mutex::new(Vec::new()),
                next_id: AtomicU64::new(0),
                poller: OnceLock::new(),
            }),
        }
    }

    pub fn registry(&self) -> &ExportRegistry {
        &self.inner.registry
    }

    pub fn config(&self) -> &ServerConfig {
        &self.inner.config
    }

    pub fn handle(&self) -> ShutdownHandle {
        ShutdownHandle {
            inner: self.inner.clone(),
        }
    }

    /// Connections currently open (handshake or transmission).
    pub fn connection_count(&self) -> usize {
        self.inner.conns.lock().len()
    }

    /// Bytes of request data held now, and the budget for them.
    pub fn inflight_bytes(&self) -> (u64, u64) {
        let b = &self.inner.memory.budget;
        (b.used(), b.limit())
    }

    /// Listens on a Unix socket at `path` and accepts on a new thread. A
    /// stale socket file (nobody listening) is replaced; the file is removed
    /// again on shutdown.
    pub fn serve_unix(&self, path: impl AsRef<Path>) -> io::Result<()> {
        let path = path.as_ref();
        let listener = match UnixListener::bind(path) {
            Ok(l) => l,
            Err(e) if e.kind() == io::ErrorKind::AddrInUse => match UnixStream::connect(path) {
                Err(ce) if ce.kind() == io::ErrorKind::ConnectionRefused => {
                    std::fs::remove_file(path)?;
                    UnixListener::bind(path)?
                }
                _ => return Err(e),
            },
            Err(e) => return Err(e),
        };
        self.start_listener(Listener::Unix(listener), Some(path.to_path_buf()))
    }

    /// Listens on TCP `addr` (port 0 picks one) and returns the bound
    /// address.
    pub fn serve_tcp(&self, addr: SocketAddr) -> io::Result<SocketAddr> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        self.start_listener(Listener::Tcp(listener), None)?;
        Ok(local)
    }

    /// Listens on TCP on the loopback interface only.
    pub fn serve_tcp_loopback(&self, port: u16) -> io::Result<SocketAddr> {
        self.serve_tcp(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
    }

    fn start_listener(&self, listener: Listener, unix_path: Option<PathBuf>) -> io::Result<()> {
        if self.inner.shutting_down.load(Ordering::Acquire) {
            return Err(io::Error::other("server is shut down"));
        }
        let mut listeners = self.inner.listeners.lock();
        if self.inner.poller.get().is_none() {
            let poller = Poller::new()?;
            let _ = self.inner.poller.set(poller);
            let inner = self.inner.clone();
            let thread = std::thread::Builder::new()
                .name("nbd-poller".into())
                .spawn(move || {
                    if let Some(p) = inner.poller.get() {
                        p.run(&inner);
                    }
                })?;
            if let Some(p) = self.inner.poller.get() {
                *p.thread.lock() = Some(thread);
            }
        }
        let listener = Arc::new(listener);
        let inner = self.inner.clone();
        let l = listener.clone();
        let thread = std::thread::Builder::new()
            .name("nbd-accept".into())
            .spawn(move || accept_loop(&inner, &l))?;
        listeners.push(ListenerSlot {
            listener,
            thread: Some(thread),
            unix_path,
        });
        Ok(())
    }

    /// Serves one already-connected client on the calling thread until it
    /// disconnects: the way to use another transport (or an in-memory pipe
    /// in tests). Without a socket to shut down, a reply that cannot be
    /// written only ends the connection once `reader` reaches its end.
    pub fn serve_stream<R: Read + Send, W: Write + Send>(
        &self,
        reader: R,
        writer: W,
    ) -> io::Result<()> {
        let peer = Peer {
            key: ClientKey::Unknown,
            uid: None,
            desc: "stream".into(),
        };
        serve_connection(&self.inner, &peer, reader, writer, &|| {}).map(|_| ())
    }

    /// Stops accepting, lets in-flight requests finish (up to
    /// `shutdown_grace`), closes every connection and joins all threads.
    /// Idempotent.
    pub fn shutdown(&self) {
        shutdown(&self.inner);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        shutdown(&self.inner);
    }
}

fn accept_loop(inner: &Arc<Inner>, listener: &Listener) {
    loop {
        let accepted = listener.accept();
        if inner.shutting_down.load(Ordering::Acquire) {
            return;
        }
        match accepted {
            Ok(sock) => spawn_connection(inner, sock),
            Err(e) => match e.raw_os_error() {
                // Out of descriptors or memory: back off instead of spinning.
                Some(libc::EMFILE) | Some(libc::ENFILE) | Some(libc::ENOBUFS)
                | Some(libc::ENOMEM) => std::thread::sleep(Duration::from_millis(50)),
                _ if e.kind() == io::ErrorKind::Interrupted
                    || e.kind() == io::ErrorKind::ConnectionAborted =>
                {
                    continue
                }
                _ => std::thread::sleep(Duration::from_millis(10)),
            },
        }
    }
}

impl Inner {
    /// Logs a refused connection or export, at most REFUSAL_LOG_PER_SEC a
    /// second.
    fn refuse(&self, peer: &Peer, export: Option<&str>, reason: &str) {
        let suppressed = {
            let mut log = self.refusals.lock();
            if log.window.elapsed() >= Duration::from_secs(1) {
                log.window = Instant::now();
                log.in_window = 0;
            }
            if log.in_window >= REFUSAL_LOG_PER_SEC {
                log.suppressed += 1;
                return;
            }
            log.in_window += 1;
            std::mem::take(&mut log.suppressed)
        };
        tracing::warn!(
            peer = %peer,
            export = export.unwrap_or(""),
            suppressed_before = suppressed,
            "NBD connection refused: {reason}"
        );
    }

    /// Counts a connection against its export; false (and logged) if the
    /// export is at its limit.
    fn enter_export(&self, peer: &Peer, entry: &ExportEntry) -> bool {
        let limit = self.config.max_connections_per_export;
        {
            let mut adm = self.admission.lock();
            let c = adm.per_export.entry(entry.name.clone()).or_default();
            if *c < limit {
                *c += 1;
                return true;
            }
        }
        self.refuse(
            peer,
            Some(&entry.name),
            &format!("export has {limit} connections (max_connections_per_export)"),
        );
        false
    }

    fn leave_export(&self, name: &str) {
        decrement(&mut self.admission.lock().per_export, &name.to_string());
    }
}

/// Joins the connection threads that have ended.
fn reap(threads: &mut Vec<JoinHandle<()>>) {
    let (done, live): (Vec<_>, Vec<_>) = threads.drain(..).partition(|t| t.is_finished());
    *threads = live;
    for t in done {
        let _ = t.join();
    }
}

fn spawn_connection(inner: &Arc<Inner>, sock: Sock) {
    reap(&mut inner.conn_threads.lock());
    let peer = sock.peer();
    let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
    let refused = {
        let mut conns = inner.conns.lock();
        let mut adm = inner.admission.lock();
        let per_client = adm.per_client.get(&peer.key).copied().unwrap_or(0);
        let per_user = peer
            .uid
            .and_then(|uid| adm.per_user.get(&uid).copied())
            .unwrap_or(0);
        if conns.len() >= inner.config.max_connections {
            Some(format!(
                "server has {} connections (max_connections)",
                conns.len()
            ))
        } else if per_client >= inner.config.max_connections_per_client {
            Some(format!(
                "client has {per_client} connections (max_connections_per_client)"
            ))
        } else if peer.uid.is_some() && per_user >= inner.config.max_connections_per_user {
            Some(format!(
                "user has {per_user} connections (max_connections_per_user)"
            ))
        } else {
            match sock.try_clone() {
                Ok(c) => {
                    conns.insert(id, c);
                    *adm.per_client.entry(peer.key.clone()).or_default() += 1;
                    if let Some(uid) = peer.uid {
                        *adm.per_user.entry(uid).or_default() += 1;
                    }
                    None
                }
                Err(e) => Some(format!("cannot clone socket: {e}")),
            }
        }
    };
    if let Some(reason) = refused {
        inner.refuse(&peer, None, &reason);
        return;
    }
    let inner2 = inner.clone();
    let peer2 = peer.clone();
    let spawned = std::thread::Builder::new()
        .name("nbd-conn".into())
        .spawn(move || match handle_socket(&inner2, &peer2, &sock) {
            Some(session) => park(
                &inner2,
                Parked {
                    id,
                    peer: peer2,
                    sock,
                    session,
                },
            ),
            None => {
                sock.shutdown(Shutdown::Both);
                forget_connection(&inner2, id, &peer2);
            }
        });
    match spawned {
        Ok(t) => inner.conn_threads.lock().push(t),
        Err(e) => {
            forget_connection(inner, id, &peer);
            inner.refuse(&peer, None, &format!("cannot start a thread: {e}"));
        }
    }
}

/// Hands a quiet connection to the poller, or, if the server is shutting down, ends it; if the
/// poller cannot take it, serves it on this thread without parking.
fn park(inner: &Arc<Inner>, p: Parked) {
    let refused = match inner.poller.get() {
        Some(poller) => match poller.park(p) {
            Ok(()) => return,
            Err(p) => p,
        },
        None => p,
    };
    if inner.shutting_down.load(Ordering::Acquire) {
        end_parked(inner, refused);
    } else {
        serve_parked(inner, refused, false);
    }
}

/// Starts a thread for a parked connection whose client sent something (or hung up).
fn restart(inner: &Arc<Inner>, p: Parked) {
    let slot = Arc::new(Mutex::new(Some(p)));
    let (inner2, slot2) = (inner.clone(), slot.clone());
    let mut threads = inner.conn_threads.lock();
    reap(&mut threads);
    let spawned = std::thread::Builder::new()
        .name("nbd-conn".into())
        .spawn(move || {
            if let Some(p) = slot2.lock().take() {
                serve_parked(&inner2, p, true);
            }
        });
    match spawned {
        Ok(t) => threads.push(t),
        Err(e) => {
            drop(threads);
            if let Some(p) = slot.lock().take() {
                inner.refuse(
                    &p.peer,
                    Some(&p.session.n.entry.name),
                    &format!("cannot restart an idle connection: no thread: {e}"),
                );
                end_parked(inner, p);
            }
        }
    }
}

/// Serves a parked connection again until it ends or parks (if `may_park`).
fn serve_parked(inner: &Arc<Inner>, p: Parked, may_park: bool) {
    let end = {
        let sock = &p.sock;
        let wait = |t: Duration| sock.wait_readable(t);
        let on_fatal = || sock.shutdown(Shutdown::Both);
        transmit(
            inner,
            &p.peer,
            BufReader::with_capacity(READ_BUFFER, sock),
            sock,
            &p.session,
            &on_fatal,
            may_park.then_some(&wait as WaitInput),
        )
    };
    match end {
        End::Parked => park(inner, p),
        End::Closed { .. } => end_parked(inner, p),
    }
}

/// Ends a connection that had reached transmission.
fn end_parked(inner: &Inner, p: Parked) {
    if let Some(name) = &p.session.admitted {
        inner.leave_export(name);
    }
    drop(p.session);
    p.sock.shutdown(Shutdown::Both);
    forget_connection(inner, p.id, &p.peer);
}

fn forget_connection(inner: &Inner, id: u64, peer: &Peer) {
    let mut conns = inner.conns.lock();
    conns.remove(&id);
    let mut adm = inner.admission.lock();
    decrement(&mut adm.per_client, &peer.key);
    if let Some(uid) = peer.uid {
        decrement(&mut adm.per_user, &uid);
    }
    drop(adm);
    drop(conns);
    inner.conns_changed.notify_all();
}

/// Bytes a connection reads from its socket at once. Large enough that a client's pipelined
/// requests with payloads (say four 64 KiB writes, or 32 requests of 4 KiB) come in with one
/// read: the server then sees, and a trace stamps, the requests the client has sent, not one
/// per system call. Small enough that every connection may hold a full one within the memory
/// limit (a hostile client can fill it). Payloads larger than this are still read straight
/// into their own buffer.
const READ_BUFFER: usize = 256 << 10;

/// Serves a new connection's handshake and transmission; Some if it went quiet in transmission
/// (to be parked).
fn handle_socket(inner: &Inner, peer: &Peer, sock: &Sock) -> Option<Session> {
    let handshaking = AtomicBool::new(true);
    let deadline = inner.config.handshake_timeout.map(|t| Instant::now() + t);
    let io = || HandshakeSock {
        sock,
        deadline,
        handshaking: &handshaking,
    };
    let reader = BufReader::with_capacity(READ_BUFFER, io());
    let on_fatal = || sock.shutdown(Shutdown::Both);
    let stall = inner.config.stall_timeout;
    let wait = |t: Duration| sock.wait_readable(t);
    let res = run_connection(
        inner,
        peer,
        reader,
        io(),
        &on_fatal,
        || {
            handshaking.store(false, Ordering::Relaxed);
            sock.set_read_timeout(stall)?;
            sock.set_write_timeout(stall)
        },
        Some(&wait),
    );
    match res {
        Ok(parked) => parked,
        Err(e) => {
            if e.kind() == io::ErrorKind::TimedOut || e.kind() == io::ErrorKind::WouldBlock {
                tracing::info!(peer = %peer, "NBD client dropped: handshake timeout");
            }
            None
        }
    }
}

fn serve_connection<R: Read + Send, W: Write + Send>(
    inner: &Inner,
    peer: &Peer,
    reader: R,
    writer: W,
    on_fatal: &(dyn Fn() + Sync),
) -> io::Result<Option<Session>> {
    run_connection(
        inner,
        peer,
        BufReader::with_capacity(READ_BUFFER, reader),
        writer,
        on_fatal,
        || Ok(()),
        None,
    )
}

fn run_connection<R: Read + Send, W: Write + Send>(
    inner: &Inner,
    peer: &Peer,
    mut reader: BufReader<R>,
    writer: W,
    on_fatal: &(dyn Fn() + Sync),
    enter_transmission: impl FnOnce() -> io::Result<()>,
    wait_input: Option<WaitInput<'_>>,
) -> io::Result<Option<Session>> {
    // The export this connection was counted against, if any: released
    // however the connection ends, even if the handshake fails after GO was
    // admitted.
    let admitted: Mutex<Option<String>> = Mutex::new(None);
    let admit = |e: &ExportEntry| {
        let ok = inner.enter_export(peer, e);
        if ok {
            *admitted.lock() = Some(e.name.clone());
        }
        ok
    };
    let unknown = |name: &[u8]| {
        inner.refuse(peer, Some(&String::from_utf8_lossy(name)), "no such export");
    };
    let ctx = HandshakeCtx {
        registry: &inner.registry,
        max_option_len: inner.config.max_option_len,
        shutting_down: &inner.shutting_down,
        admit: &admit,
        unknown: &unknown,
    };
    let res = (|| {
        // Buffered during the handshake only: option replies come in bursts
        // (LIST, INFO), and negotiate() flushes before every read.
        let mut bw = BufWriter::new(writer);
        let outcome = handshake::negotiate(&mut reader, &mut bw, &ctx)?;
        let writer = bw.into_inner().map_err(|e| e.into_error())?;
        if let Outcome::Transmission(n) = outcome {
            enter_transmission()?;
            let mut session = Session {
                _client: ClientGuard::new(&n.entry),
                n,
                admitted: None,
                conn_id: observe::next_connection_id(),
            };
            let end = transmit(inner, peer, reader, writer, &session, on_fatal, wait_input);
            if end == End::Parked {
                session.admitted = admitted.lock().take();
                return Ok(Some(session));
            }
        }
        Ok(None)
    })();
    if let Some(name) = admitted.lock().take() {
        inner.leave_export(&name);
    }
    res
}

/// Runs a connection's transmission until it ends or parks; logs a client dropped for stalling.
fn transmit<R: Read + Send, W: Write + Send>(
    inner: &Inner,
    peer: &Peer,
    reader: BufReader<R>,
    writer: W,
    session: &Session,
    on_fatal: &(dyn Fn() + Sync),
    wait_input: Option<WaitInput<'_>>,
) -> End {
    let n = &session.n;
    let end = transmission::run(
        reader,
        writer,
        n,
        inner.config.workers_per_connection,
        &inner.memory,
        on_fatal,
        session.conn_id,
        wait_input,
    );
    if end == (End::Closed { stalled: true }) {
        tracing::info!(
            peer = %peer,
            export = n.entry.name.as_str(),
            "NBD client dropped: stalled mid-request or left a reply unread for {:?} \
             (stall_timeout)",
            inner.config.stall_timeout.unwrap_or_default()
        );
    }
    end
}

fn shutdown(inner: &Inner) {
    inner.shutting_down.store(true, Ordering::Release);
    let listeners: Vec<ListenerSlot> = std::mem::take(&mut *inner.listeners.lock());
    for mut slot in listeners {
        // shutdown(2) on a listening socket makes a blocked accept() return
        // on Linux, for both TCP and Unix sockets.
        // SAFETY: the fd belongs to a listener kept alive by `slot`.
        unsafe {
            libc::shutdown(slot.listener.raw_fd(), libc::SHUT_RDWR);
        }
        if let Some(t) = slot.thread.take() {
            let _ = t.join();
        }
        if let Some(p) = &slot.unix_path {
            let _ = std::fs::remove_file(p);
        }
    }
    // Stop reading new requests; workers finish what is in flight.
    for s in inner.conns.lock().values() {
        s.shutdown(Shutdown::Read);
    }
    // Parked connections have nothing in flight: they end now.
    if let Some(poller) = inner.poller.get() {
        for p in poller.stop() {
            end_parked(inner, p);
        }
    }
    let deadline = Instant::now() + inner.config.shutdown_grace;
    {
        let mut conns = inner.conns.lock();
        while !conns.is_empty() {
            if inner
                .conns_changed
                .wait_until(&mut conns, deadline)
                .timed_out()
            {
                break;
            }
        }
        for s in conns.values() {
            s.shutdown(Shutdown::Both);
        }
    }
    let threads: Vec<JoinHandle<()>> = std::mem::take(&mut *inner.conn_threads.lock());
    for t in threads {
        let _ = t.join();
    }
}

/// The pid, uid and gid the kernel records for the peer of a Unix socket (SO_PEERCRED); None if
/// the kernel does not say. Also what the daemon's control socket logs as "who asked".
pub fn unix_peer_credentials(s: &impl AsRawFd) -> Option<libc::ucred> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, a valid ucred we own.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cred)
}

//! Listeners, per-connection threads and shutdown.

use std::collections::HashMap;
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use crate::handshake::{self, HandshakeCtx, Outcome, DEFAULT_MAX_OPTION_LEN};
use crate::registry::{ClientGuard, ExportRegistry};
use crate::transmission;

/// Tunables; `Default` gives the documented defaults.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Requests executed concurrently per connection (threads per
    /// connection). Default 4.
    pub workers_per_connection: usize,
    /// Connections beyond this are closed right after `accept`. Default 256.
    pub max_connections: usize,
    /// A client that sends nothing for this long during the handshake is
    /// dropped. Default 30 s.
    pub handshake_timeout: Option<Duration>,
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
            handshake_timeout: Some(Duration::from_secs(30)),
            max_option_len: DEFAULT_MAX_OPTION_LEN,
            shutdown_grace: Duration::from_secs(5),
        }
    }
}

/// An accepted connection of either family.
enum Sock {
    Unix(UnixStream),
    Tcp(TcpStream),
}

impl Sock {
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

    /// Bounds how long a read or write may block (None: forever).
    fn set_timeouts(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Sock::Unix(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
            Sock::Tcp(s) => {
                s.set_read_timeout(t)?;
                s.set_write_timeout(t)
            }
        }
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

struct ListenerSlot {
    listener: Arc<Listener>,
    thread: Option<JoinHandle<()>>,
    unix_path: Option<PathBuf>,
}

struct Inner {
    registry: ExportRegistry,
    config: ServerConfig,
    shutting_down: AtomicBool,
    listeners: Mutex<Vec<ListenerSlot>>,
    /// Clones of live sockets, so shutdown can unblock their threads.
    conns: Mutex<HashMap<u64, Sock>>,
    conns_changed: Condvar,
    conn_threads: Mutex<Vec<JoinHandle<()>>>,
    next_id: AtomicU64,
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
                config,
                shutting_down: AtomicBool::new(false),
                listeners: Mutex::new(Vec::new()),
                conns: Mutex::new(HashMap::new()),
                conns_changed: Condvar::new(),
                conn_threads: Mutex::new(Vec::new()),
                next_id: AtomicU64::new(0),
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
        let listener = Arc::new(listener);
        let inner = self.inner.clone();
        let l = listener.clone();
        let thread = std::thread::Builder::new()
            .name("nbd-accept".into())
            .spawn(move || accept_loop(&inner, &l))?;
        self.inner.listeners.lock().push(ListenerSlot {
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
        serve_connection(&self.inner, reader, writer, &|| {})
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

fn spawn_connection(inner: &Arc<Inner>, sock: Sock) {
    {
        let mut threads = inner.conn_threads.lock();
        let (done, live): (Vec<_>, Vec<_>) = threads.drain(..).partition(|t| t.is_finished());
        *threads = live;
        for t in done {
            let _ = t.join();
        }
    }
    let id = inner.next_id.fetch_add(1, Ordering::Relaxed);
    {
        let mut conns = inner.conns.lock();
        if conns.len() >= inner.config.max_connections {
            return;
        }
        match sock.try_clone() {
            Ok(c) => conns.insert(id, c),
            Err(_) => return,
        };
    }
    let inner2 = inner.clone();
    let spawned = std::thread::Builder::new()
        .name("nbd-conn".into())
        .spawn(move || {
            handle_socket(&inner2, &sock);
            sock.shutdown(Shutdown::Both);
            inner2.conns.lock().remove(&id);
            inner2.conns_changed.notify_all();
        });
    match spawned {
        Ok(t) => inner.conn_threads.lock().push(t),
        Err(_) => {
            inner.conns.lock().remove(&id);
        }
    }
}

/// Bytes a connection reads from its socket at once. Large enough that a client's pipelined
/// requests with payloads (say eight 64 KiB writes) come in with one read: the server then sees,
/// and a trace stamps, every request the client has sent, not one per system call. Payloads
/// larger than this are still read straight into their own buffer.
const READ_BUFFER: usize = 1 << 20;

fn handle_socket(inner: &Inner, sock: &Sock) {
    // A client that stalls the handshake (not sending, or not reading our
    // replies) must not pin this thread forever.
    if sock.set_timeouts(inner.config.handshake_timeout).is_err() {
        return;
    }
    let reader = BufReader::with_capacity(READ_BUFFER, sock);
    let on_fatal = || sock.shutdown(Shutdown::Both);
    let _ = run_connection(inner, reader, sock, &on_fatal, || sock.set_timeouts(None));
}

fn serve_connection<R: Read + Send, W: Write + Send>(
    inner: &Inner,
    reader: R,
    writer: W,
    on_fatal: &(dyn Fn() + Sync),
) -> io::Result<()> {
    run_connection(
        inner,
        BufReader::with_capacity(READ_BUFFER, reader),
        writer,
        on_fatal,
        || Ok(()),
    )
}

fn run_connection<R: Read + Send, W: Write + Send>(
    inner: &Inner,
    mut reader: BufReader<R>,
    writer: W,
    on_fatal: &(dyn Fn() + Sync),
    enter_transmission: impl FnOnce() -> io::Result<()>,
) -> io::Result<()> {
    let ctx = HandshakeCtx {
        registry: &inner.registry,
        max_option_len: inner.config.max_option_len,
        shutting_down: &inner.shutting_down,
    };
    // Buffered during the handshake only: option replies come in bursts
    // (LIST, INFO), and negotiate() flushes before every read.
    let mut bw = BufWriter::new(writer);
    let outcome = handshake::negotiate(&mut reader, &mut bw, &ctx)?;
    let writer = bw.into_inner().map_err(|e| e.into_error())?;
    match outcome {
        Outcome::Closed => Ok(()),
        Outcome::Transmission(n) => {
            enter_transmission()?;
            let _client = ClientGuard::new(&n.entry);
            transmission::run(
                reader,
                writer,
                &n,
                inner.config.workers_per_connection,
                on_fatal,
            );
            Ok(())
        }
    }
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

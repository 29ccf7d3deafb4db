//! Resource limits against hostile clients: connection limits per client, per export and in
//! all, the handshake deadline, the stall timeout, and memory bounded whatever clients send.
//!
//! The memory tests run the server in a child process (this test binary re-executed with
//! `NBD_CHILD_SERVER` set, see `child_server`) so its resident memory can be read from
//! /proc/PID/status and its log lines from its stderr.

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::FromRawFd;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use common::*;
use hybridcache_nbd::proto::*;
use hybridcache_nbd::{Client, ClientConfig, Export, ExportRegistry, Server, ServerConfig};

const MIB: usize = 1 << 20;

// ---- log capture (in-process servers) ------------------------------------------------------

#[derive(Clone, Default)]
struct LogBuf(Arc<Mutex<Vec<u8>>>);

impl Write for LogBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Every log line of the in-process servers of this test binary (tests run in parallel, so
/// each test looks for lines naming its own peer or export).
fn log() -> &'static LogBuf {
    static LOG: OnceLock<LogBuf> = OnceLock::new();
    LOG.get_or_init(|| {
        let buf = LogBuf::default();
        let w = buf.clone();
        tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_ansi(false)
            .init();
        buf
    })
}

fn log_text() -> String {
    String::from_utf8_lossy(&log().0.lock().unwrap()).into_owned()
}

fn wait_for_log(pred: impl Fn(&str) -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if log_text().lines().any(&pred) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    false
}

// ---- raw TCP clients from chosen source addresses -------------------------------------------

/// A TCP connection to `to` from the loopback address `from` (127.0.0.0/8 is all local, so
/// tests can play several client addresses).
fn tcp_from(from: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    // SAFETY: plain socket calls on a descriptor this function owns until it is wrapped.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let s = TcpStream::from_raw_fd(fd);
        let sin = |ip: Ipv4Addr, port: u16| libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(ip).to_be(),
            },
            sin_zero: [0; 8],
        };
        let local = sin(from, 0);
        let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
        if libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let SocketAddr::V4(to) = to else {
            panic!("IPv4 only");
        };
        let remote = sin(*to.ip(), to.port());
        if libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(s)
    }
}

/// Greeting and `NBD_OPT_GO` for `export` on any stream; Ok(false) if the server closed the
/// connection (refused), Err(reply) if GO was refused with an error reply.
fn handshake<S: Read + Write>(s: &mut S, export: &str) -> Result<bool, u32> {
    let mut g = [0u8; GREETING_LEN];
    if s.read_exact(&mut g).is_err() {
        return Ok(false);
    }
    if s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
        .is_err()
    {
        return Ok(false);
    }
    let mut out = Vec::new();
    encode_option(
        &mut out,
        OPT_GO,
        &encode_info_request(export.as_bytes(), &[]),
    );
    if s.write_all(&out).is_err() {
        return Ok(false);
    }
    loop {
        let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
        if s.read_exact(&mut h).is_err() {
            return Ok(false);
        }
        let hdr = parse_option_reply_header(&h).unwrap();
        let mut p = vec![0u8; hdr.len as usize];
        if s.read_exact(&mut p).is_err() {
            return Ok(false);
        }
        match hdr.reply {
            REP_INFO => {}
            REP_ACK => return Ok(true),
            e => return Err(e),
        }
    }
}

fn request(typ: u16, handle: u64, offset: u64, len: u32) -> [u8; REQUEST_LEN] {
    encode_request(&Request {
        flags: 0,
        typ,
        handle,
        offset,
        length: len,
    })
}

// ---- the server in a child process -----------------------------------------------------------

/// Runs only as the child of `ChildServer::spawn`: serves a RAM export named "ram" on TCP
/// loopback (port printed on stdout) with the configuration given in NBD_CHILD_SERVER, and
/// logs to stderr.
#[test]
fn child_server() {
    let Ok(spec) = std::env::var("NBD_CHILD_SERVER") else {
        return;
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let mut cfg = ServerConfig::default();
    let mut size = 64 * MIB;
    for kv in spec.split(',').filter(|s| !s.is_empty()) {
        let (k, v) = kv.split_once('=').expect("key=value");
        let n: u64 = v.parse().expect("number");
        match k {
            "size_mib" => size = n as usize * MIB,
            "workers" => cfg.workers_per_connection = n as usize,
            "max_connections" => cfg.max_connections = n as usize,
            "per_client" => cfg.max_connections_per_client = n as usize,
            "per_export" => cfg.max_connections_per_export = n as usize,
            "memory_mib" => cfg.memory_limit = n << 20,
            "stall_ms" => cfg.stall_timeout = Some(Duration::from_millis(n)),
            _ => panic!("unknown key {k}"),
        }
    }
    let reg = ExportRegistry::new();
    reg.add("ram", MemExport::new(size).arc() as Arc<dyn Export>)
        .unwrap();
    let server = Server::with_config(reg, cfg);
    let addr = server.serve_tcp_loopback(0).unwrap();
    println!("LISTEN {}", addr.port());
    std::io::stdout().flush().unwrap();
    // Until the parent kills us.
    loop {
        std::thread::park();
    }
}

struct ChildServer {
    child: Child,
    addr: SocketAddr,
    stderr: Arc<Mutex<String>>,
}

impl ChildServer {
    fn spawn(spec: &str) -> ChildServer {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "child_server", "--nocapture", "--test-threads=1"])
            .env("NBD_CHILD_SERVER", spec)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let port = loop {
            let mut line = String::new();
            assert_ne!(out.read_line(&mut line).unwrap(), 0, "child exited");
            // libtest prints "test child_server ... " on the same line first.
            if let Some((_, p)) = line.trim().split_once("LISTEN ") {
                break p.parse::<u16>().unwrap();
            }
        };
        let stderr = Arc::new(Mutex::new(String::new()));
        let (err, e2) = (child.stderr.take().unwrap(), stderr.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let mut s = e2.lock().unwrap();
                s.push_str(&line);
                s.push('\n');
            }
        });
        ChildServer {
            child,
            addr: SocketAddr::from((Ipv4Addr::LOCALHOST, port)),
            stderr,
        }
    }

    /// (VmRSS, VmHWM) in bytes.
    fn rss(&self) -> (u64, u64) {
        let s = std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).unwrap();
        let field = |name: &str| {
            s.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
                .unwrap()
                * 1024
        };
        (field("VmRSS:"), field("VmHWM:"))
    }

    fn log(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The server process's threads now.
    fn threads(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/task", self.child.id()))
            .unwrap()
            .count()
    }
}

impl Drop for ChildServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Writes patterns at many sizes (up to 4 MiB) over a region of the export and reads each back.
fn verify_pattern(c: &mut Client, base: u64, round: u8) {
    let mut off = base;
    for (i, len) in [4096usize, 512, 65536, 1 << 20, 4 << 20, 12288]
        .into_iter()
        .enumerate()
    {
        let data = pattern(len, round.wrapping_mul(7).wrapping_add(i as u8));
        c.write(&data, off, false).unwrap();
        let mut back = vec![0u8; len];
        c.read(&mut back, off).unwrap();
        assert!(back == data, "read back differs at {off}+{len}");
        off += len as u64;
    }
    c.flush().unwrap();
}

const BOUND: u64 = 512 << 20;

/// fio's nbd engine (libnbd) writes 16 MiB at random with mixed block sizes, reads it all
/// back and checks crc32c; skipped with a message when fio is not installed (a failure in CI).
fn fio_verify(addr: SocketAddr) {
    if !common::need(&["fio"]) {
        // The crate's own client verifies instead.
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("fio.json");
    let res = Command::new("fio")
        .current_dir(dir.path())
        .args([
            "--name=verify",
            "--ioengine=nbd",
            "--rw=randwrite",
            "--bsrange=4k-256k",
            "--iodepth=16",
            "--offset=16M",
            "--size=16M",
            "--verify=crc32c",
            "--do_verify=1",
            "--verify_state_save=0",
            "--output-format=json",
        ])
        .arg(format!("--uri=nbd://127.0.0.1:{}/ram", addr.port()))
        .arg(format!("--output={}", out.display()))
        .output()
        .unwrap();
    let json = std::fs::read_to_string(&out).unwrap_or_default();
    assert!(
        res.status.success() && json.contains("\"error\" : 0"),
        "fio failed: {}\n{}\n{json}",
        String::from_utf8_lossy(&res.stdout),
        String::from_utf8_lossy(&res.stderr)
    );
}

/// The issue's hostile mix: 256 connections from two client addresses, a third each idle
/// after the handshake, sending a bare header announcing a 32 MiB write, and asking for a
/// 32 MiB read whose reply they never read. Meanwhile a client on another address writes and
/// verifies patterns, and a new client connects at the end. With the defaults: the verifying
/// client completes, the new client is served, the server's peak RSS stays under the 512 MiB
/// default limit, and the refused connections are logged with their peers.
#[test]
fn hostile_mix_cannot_exhaust_the_server() {
    let srv = ChildServer::spawn("");
    let (rss0, _) = srv.rss();
    let stop = Arc::new(AtomicBool::new(false));
    // The verifying client runs throughout.
    let verifier = {
        let (addr, stop) = (srv.addr, stop.clone());
        std::thread::spawn(move || {
            let mut c = Client::connect_tcp(addr, "ram").unwrap();
            let mut rounds = 0u32;
            while !stop.load(Ordering::Relaxed) || rounds < 3 {
                verify_pattern(&mut c, 0, rounds as u8);
                rounds += 1;
            }
            rounds
        })
    };
    let mut hostile = Vec::new();
    let mut refused = 0;
    for i in 0..256u32 {
        let from = Ipv4Addr::new(127, 0, 0, 2 + (i % 2) as u8);
        let mut s = tcp_from(from, srv.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        if !handshake(&mut s, "ram").expect("GO refused") {
            refused += 1;
            continue;
        }
        match i % 3 {
            0 => {}
            1 => s.write_all(&request(CMD_WRITE, 1, 0, 32 << 20)).unwrap(),
            _ => s.write_all(&request(CMD_READ, 1, 0, 32 << 20)).unwrap(),
        }
        hostile.push(s);
        if i % 16 == 15 {
            // Fail early rather than let a server without bounds eat the machine.
            let (rss, _) = srv.rss();
            assert!(
                rss < BOUND,
                "RSS {} MiB after {} hostile connections",
                rss >> 20,
                hostile.len()
            );
        }
    }
    // Let the server take in what the hostile clients sent and fill their sockets.
    std::thread::sleep(Duration::from_millis(500));
    fio_verify(srv.addr);
    let mut c = Client::connect_tcp(srv.addr, "ram").expect("a new client must get in");
    verify_pattern(&mut c, 32 << 20, 99);
    stop.store(true, Ordering::Relaxed);
    let rounds = verifier.join().unwrap();
    let (rss, hwm) = srv.rss();
    eprintln!(
        "hostile admitted {} refused {refused}; verifier rounds {rounds}; RSS start {} MiB, \
         end {} MiB, peak {} MiB",
        hostile.len(),
        rss0 >> 20,
        rss >> 20,
        hwm >> 20
    );
    assert!(hwm < BOUND, "peak RSS {} MiB", hwm >> 20);
    // 64 per client address by default: the rest were refused, and the log says so.
    assert_eq!(hostile.len(), 128);
    assert_eq!(refused, 128);
    let log = srv.log();
    for peer in ["tcp 127.0.0.2:", "tcp 127.0.0.3:"] {
        assert!(
            log.lines().any(|l| l.contains("connection refused")
                && l.contains(peer)
                && l.contains("max_connections_per_client")),
            "no refusal logged for {peer}:\n{log}"
        );
    }
}

/// A client that pipelines small reads and never reads the replies used to make the server
/// queue every reply (2,340 bytes of memory per 28-byte request): the queue is now bounded
/// and the connection simply stops being read.
#[test]
fn unread_pipelined_reads_do_not_queue_without_bound() {
    let srv = ChildServer::spawn("");
    let mut s = tcp_from(Ipv4Addr::new(127, 0, 0, 4), srv.addr).unwrap();
    assert!(handshake(&mut s, "ram").unwrap());
    // 8192 requests of 64 KiB: 512 MiB of replies the client never reads. Sent from a thread,
    // because a server that stops reading also stops the sender.
    let mut w = s.try_clone().unwrap();
    std::thread::spawn(move || {
        let mut batch = Vec::new();
        for h in 0..8192u64 {
            batch.extend_from_slice(&request(CMD_READ, h, (h % 512) * 65536, 65536));
        }
        let _ = w.write_all(&batch);
    });
    std::thread::sleep(Duration::from_millis(1500));
    let (_, hwm) = srv.rss();
    assert!(hwm < 256 << 20, "peak RSS {} MiB", hwm >> 20);
    // And everyone else is still served.
    let mut c = Client::connect_tcp(srv.addr, "ram").unwrap();
    verify_pattern(&mut c, 0, 1);
    drop(s);
}

/// Write payloads are read as they arrive: connections that send bare headers of 32 MiB
/// writes cost nothing, and a budget of a few MiB still serves 32 MiB requests one at a time
/// (never deadlocks), with data intact.
#[test]
fn small_budget_serves_requests_larger_than_itself() {
    let t = start_with(
        &[("big", MemExport::new(64 * MIB).arc() as Arc<dyn Export>)],
        ServerConfig {
            inflight_budget: Some(4 * MIB as u64),
            ..Default::default()
        },
    );
    let mut idle = Vec::new();
    for _ in 0..8 {
        let mut raw = Raw::connect(&t.sock);
        raw.go("big", &[]).unwrap();
        raw.request(CMD_WRITE, 0, 1, 0, 32 << 20);
        idle.push(raw);
    }
    let ths: Vec<_> = (0..3u8)
        .map(|k| {
            let sock = t.sock.clone();
            std::thread::spawn(move || {
                let mut c = Client::connect_unix(&sock, "big").unwrap();
                let data = pattern(20 * MIB, k);
                let off = u64::from(k) * 20 * MIB as u64;
                c.write(&data, off, false).unwrap();
                let mut back = vec![0u8; data.len()];
                c.read(&mut back, off).unwrap();
                assert!(back == data);
            })
        })
        .collect();
    for t in ths {
        t.join().unwrap();
    }
    // A worker gives its bytes back just after its reply left.
    let deadline = Instant::now() + Duration::from_secs(2);
    while t.server.inflight_bytes().0 != 0 {
        assert!(Instant::now() < deadline, "budget not given back");
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(idle);
}

// ---- connection limits --------------------------------------------------------------------

fn tcp_server(exports: &[&str], cfg: ServerConfig) -> (Server, SocketAddr) {
    log();
    let reg = ExportRegistry::new();
    for name in exports {
        reg.add(name, MemExport::new(MIB).arc() as Arc<dyn Export>)
            .unwrap();
    }
    let server = Server::with_config(reg, cfg);
    let addr = server.serve_tcp_loopback(0).unwrap();
    (server, addr)
}

#[test]
fn an_unknown_export_name_is_refused_and_logged() {
    let (server, addr) = tcp_server(&["known"], ServerConfig::default());
    let mut s = tcp_from(Ipv4Addr::new(127, 0, 0, 21), addr).unwrap();
    assert_eq!(handshake(&mut s, "no-such-export"), Err(REP_ERR_UNKNOWN));
    assert!(
        wait_for_log(|l| l.contains("connection refused: no such export")
            && l.contains("tcp 127.0.0.21:")
            && l.contains("no-such-export")),
        "{}",
        log_text()
    );
    server.shutdown();
}

#[test]
fn per_client_limit_refuses_that_client_only() {
    let (server, addr) = tcp_server(
        &["a"],
        ServerConfig {
            max_connections_per_client: 3,
            ..Default::default()
        },
    );
    let greedy = Ipv4Addr::new(127, 0, 0, 11);
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut s = tcp_from(greedy, addr).unwrap();
        assert_eq!(handshake(&mut s, "a"), Ok(true));
        held.push(s);
    }
    let mut s = tcp_from(greedy, addr).unwrap();
    assert_eq!(
        handshake(&mut s, "a"),
        Ok(false),
        "fourth connection refused"
    );
    assert!(wait_for_log(|l| l.contains("connection refused")
        && l.contains("tcp 127.0.0.11:")
        && l.contains("max_connections_per_client")));
    // Another address is not affected.
    let mut other = tcp_from(Ipv4Addr::new(127, 0, 0, 12), addr).unwrap();
    assert_eq!(handshake(&mut other, "a"), Ok(true));
    // A closed connection gives its slot back.
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut s = tcp_from(greedy, addr).unwrap();
        if handshake(&mut s, "a") == Ok(true) {
            break;
        }
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(server);
}

#[test]
fn unix_clients_count_by_process() {
    let t = start_with(
        &[("u", MemExport::new(MIB).arc() as Arc<dyn Export>)],
        ServerConfig {
            max_connections_per_client: 2,
            ..Default::default()
        },
    );
    log();
    let _a = Client::connect_unix(&t.sock, "u").unwrap();
    let _b = Client::connect_unix(&t.sock, "u").unwrap();
    assert!(Client::connect_unix(&t.sock, "u").is_err());
    // SAFETY: getuid and getpid cannot fail.
    let (uid, pid) = unsafe { (libc::getuid(), libc::getpid()) };
    assert!(wait_for_log(|l| l.contains("connection refused")
        && l.contains(&format!("unix uid {uid} pid {pid}"))
        && l.contains("max_connections_per_client")));
}

/// Runs only as the child of `local_client`: connects to the Unix socket in NBD_CHILD_CLIENT
/// (`PATH,EXPORT,CONNECTIONS`) that many times, reads the first block on each connection, and
/// prints one line per connection: `CONN i OK <first byte>` or `CONN i REFUSED <error>`.
#[test]
fn child_client() {
    let Ok(spec) = std::env::var("NBD_CHILD_CLIENT") else {
        return;
    };
    let mut parts = spec.split(',');
    let (Some(sock), Some(export), Some(n)) = (parts.next(), parts.next(), parts.next()) else {
        panic!("NBD_CHILD_CLIENT={spec}: want PATH,EXPORT,CONNECTIONS");
    };
    let n: usize = n.parse().expect("connection count");
    // Held to the end, so each one counts against the limits while the next one connects.
    let mut held = Vec::new();
    for i in 0..n {
        let result = Client::connect_unix(sock, export).and_then(|mut c| {
            let mut buf = [0u8; 4096];
            c.read(&mut buf, 0)?;
            Ok((c, buf[0]))
        });
        match result {
            Ok((c, first)) => {
                println!("CONN {i} OK {first}");
                held.push(c);
            }
            Err(e) => println!("CONN {i} REFUSED {e}"),
        }
    }
}

/// Another local process (same user) connecting `connections` times to `sock`: one line per
/// connection, as `child_client` prints them.
fn local_client(sock: &std::path::Path, export: &str, connections: usize) -> Vec<String> {
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_client", "--nocapture", "--test-threads=1"])
        .env(
            "NBD_CHILD_CLIENT",
            format!("{},{export},{connections}", sock.display()),
        )
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    // libtest prints "test child_client ... " in front of the first line.
    text.lines()
        .filter_map(|l| l.find("CONN ").map(|at| l[at..].to_string()))
        .collect()
}

#[test]
fn one_local_process_at_its_limit_does_not_lock_out_another() {
    let export = MemExport::new(MIB).arc();
    export.write(&[7u8; 4096], 0, false).unwrap();
    let t = start_with(
        &[("shared", export as Arc<dyn Export>)],
        ServerConfig {
            max_connections_per_client: 4,
            ..Default::default()
        },
    );
    // This process holds idle connections up to its limit (issue 30 case 6: 64 of them locked
    // every other local client out).
    let held: Vec<Client> = (0..4)
        .map(|_| Client::connect_unix(&t.sock, "shared").unwrap())
        .collect();
    assert!(Client::connect_unix(&t.sock, "shared").is_err());
    // Another process of the same user still connects and is served.
    assert_eq!(local_client(&t.sock, "shared", 1), ["CONN 0 OK 7"]);
    drop(held);
}

#[test]
fn one_user_cannot_take_the_whole_server() {
    let t = start_with(
        &[("u", MemExport::new(MIB).arc() as Arc<dyn Export>)],
        ServerConfig {
            max_connections_per_client: 4,
            max_connections_per_user: 5,
            ..Default::default()
        },
    );
    log();
    let _held: Vec<Client> = (0..4)
        .map(|_| Client::connect_unix(&t.sock, "u").unwrap())
        .collect();
    // Within its own limit, a second process of the user gets only what is left of the user's.
    let lines = local_client(&t.sock, "u", 2);
    assert_eq!(lines.len(), 2, "{lines:?}");
    assert_eq!(lines[0], "CONN 0 OK 0");
    assert!(lines[1].starts_with("CONN 1 REFUSED"), "{lines:?}");
    // SAFETY: getuid cannot fail.
    let uid = unsafe { libc::getuid() };
    assert!(wait_for_log(|l| l.contains("connection refused")
        && l.contains(&format!("unix uid {uid} pid"))
        && l.contains(
            "user has 5 connections (max_connections_per_user)"
        )));
}

#[test]
fn per_export_limit_refuses_go_with_policy_error() {
    let (server, addr) = tcp_server(
        &["full", "free"],
        ServerConfig {
            max_connections_per_export: 2,
            ..Default::default()
        },
    );
    let from = Ipv4Addr::new(127, 0, 0, 21);
    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = tcp_from(from, addr).unwrap();
        assert_eq!(handshake(&mut s, "full"), Ok(true));
        held.push(s);
    }
    let mut s = tcp_from(from, addr).unwrap();
    assert_eq!(handshake(&mut s, "full"), Err(REP_ERR_POLICY));
    assert!(wait_for_log(|l| l.contains("connection refused")
        && l.contains("tcp 127.0.0.21:")
        && l.contains("export=\"full\"")
        || l.contains("connection refused")
            && l.contains("tcp 127.0.0.21:")
            && l.contains("export=full")));
    // The same connection may still choose another export.
    let mut out = Vec::new();
    encode_option(&mut out, OPT_GO, &encode_info_request(b"free", &[]));
    s.write_all(&out).unwrap();
    let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
    loop {
        s.read_exact(&mut h).unwrap();
        let hdr = parse_option_reply_header(&h).unwrap();
        let mut p = vec![0u8; hdr.len as usize];
        s.read_exact(&mut p).unwrap();
        if hdr.reply == REP_ACK {
            break;
        }
        assert_eq!(hdr.reply, REP_INFO);
    }
    // A connection that leaves frees its place on the export.
    drop(held.pop());
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let mut s = tcp_from(from, addr).unwrap();
        if handshake(&mut s, "full") == Ok(true) {
            break;
        }
        assert!(Instant::now() < deadline);
        std::thread::sleep(Duration::from_millis(20));
    }
    drop(server);
}

#[test]
fn total_limit_is_logged() {
    let (server, addr) = tcp_server(
        &["t"],
        ServerConfig {
            max_connections: 2,
            ..Default::default()
        },
    );
    let from = Ipv4Addr::new(127, 0, 0, 31);
    let mut a = tcp_from(from, addr).unwrap();
    let mut b = tcp_from(Ipv4Addr::new(127, 0, 0, 32), addr).unwrap();
    assert_eq!(handshake(&mut a, "t"), Ok(true));
    assert_eq!(handshake(&mut b, "t"), Ok(true));
    let mut c = tcp_from(Ipv4Addr::new(127, 0, 0, 33), addr).unwrap();
    assert_eq!(handshake(&mut c, "t"), Ok(false));
    assert!(wait_for_log(|l| l.contains("connection refused")
        && l.contains("tcp 127.0.0.33:")
        && l.contains("(max_connections)")));
    drop(server);
}

// ---- timeouts -----------------------------------------------------------------------------

/// The handshake timeout is a deadline for the whole handshake: a client trickling one byte
/// at a time, each well within the timeout, is still dropped when it runs out.
#[test]
fn handshake_deadline_drops_a_trickling_client() {
    let (server, addr) = tcp_server(
        &["h"],
        ServerConfig {
            handshake_timeout: Some(Duration::from_millis(600)),
            ..Default::default()
        },
    );
    let started = Instant::now();
    let mut s = tcp_from(Ipv4Addr::new(127, 0, 0, 41), addr).unwrap();
    let mut g = [0u8; GREETING_LEN];
    s.read_exact(&mut g).unwrap();
    s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
        .unwrap();
    // An option header announcing data that dribbles in, one byte per 200 ms.
    let mut out = Vec::new();
    encode_option(&mut out, OPT_LIST, &[]);
    out[12..16].copy_from_slice(&100u32.to_be_bytes());
    s.write_all(&out).unwrap();
    let dropped = loop {
        std::thread::sleep(Duration::from_millis(200));
        if s.write_all(&[0]).is_err() {
            break true;
        }
        let mut probe = [0u8; 1];
        s.set_nonblocking(true).unwrap();
        let r = s.read(&mut probe);
        s.set_nonblocking(false).unwrap();
        if matches!(r, Ok(0)) || matches!(&r, Err(e) if e.kind() != std::io::ErrorKind::WouldBlock)
        {
            break true;
        }
        if started.elapsed() > Duration::from_secs(5) {
            break false;
        }
    };
    assert!(
        dropped,
        "a trickling client outlived the handshake deadline"
    );
    assert!(started.elapsed() < Duration::from_secs(3));
    // A client that completes the handshake in time is served, and may then stay idle
    // longer than the deadline.
    let mut c = Client::connect_tcp(addr, "h").unwrap();
    std::thread::sleep(Duration::from_millis(800));
    c.read(&mut [0u8; 512], 0).unwrap();
    drop(server);
}

/// A client that stops half-way through a write payload is dropped after the stall timeout,
/// and the budget its payload held is given back; an idle client is not.
#[test]
fn stalled_write_payload_is_dropped_and_releases_budget() {
    log();
    let t = start_with(
        &[(
            "stall-export",
            MemExport::new(8 * MIB).arc() as Arc<dyn Export>,
        )],
        ServerConfig {
            stall_timeout: Some(Duration::from_millis(300)),
            ..Default::default()
        },
    );
    let mut idle = Client::connect_unix(&t.sock, "stall-export").unwrap();
    let mut raw = Raw::connect(&t.sock);
    raw.go("stall-export", &[]).unwrap();
    raw.request(CMD_WRITE, 0, 1, 0, 4 << 20);
    raw.s.write_all(&vec![5u8; 3 << 20]).unwrap();
    let deadline = Instant::now() + Duration::from_secs(2);
    while t.server.inflight_bytes().0 < 2 << 20 {
        assert!(Instant::now() < deadline, "payload never charged");
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(raw.closed_by_server());
    assert!(wait_for_log(|l| l.contains("NBD client dropped: stalled")
        && l.contains("stall-export")
        && l.contains("unix uid")));
    let deadline = Instant::now() + Duration::from_secs(2);
    while t.server.inflight_bytes().0 != 0 {
        assert!(Instant::now() < deadline, "budget not released");
        std::thread::sleep(Duration::from_millis(5));
    }
    std::thread::sleep(Duration::from_millis(400));
    idle.read(&mut [0u8; 512], 0).unwrap();
}

/// Reads larger than a piece are streamed; with and without structured replies the data
/// arrives intact, at unaligned offsets too.
#[test]
fn large_reads_stream_intact() {
    let t = start(&[("r", MemExport::new(40 * MIB).arc() as Arc<dyn Export>)]);
    let data = pattern(40 * MIB, 3);
    let mut w = Client::connect_unix(&t.sock, "r").unwrap();
    for (i, part) in data.chunks(16 * MIB).enumerate() {
        w.write(part, (i * 16 * MIB) as u64, false).unwrap();
    }
    for structured in [false, true] {
        let mut cfg = ClientConfig::new("r");
        cfg.structured_replies = structured;
        cfg.request_block_size = false;
        let mut c = Client::connect_unix_with(&t.sock, &cfg).unwrap();
        for (off, len) in [(0usize, 32 * MIB), (7, (3 * MIB) + 5), (MIB - 3, MIB + 6)] {
            let mut back = vec![0u8; len];
            c.read(&mut back, off as u64).unwrap();
            assert!(
                back == data[off..off + len],
                "{off}+{len} structured={structured}"
            );
        }
    }
}

/// Threads follow the work, not the connection count: 256 connections that finished their
/// handshake and sit idle cost the server fewer than 64 threads (it used to run every
/// connection's 16 workers whatever it did: 4,000 threads here), and each of them still answers
/// when it speaks again.
#[test]
fn idle_connections_cost_no_threads() {
    const CONNECTIONS: u32 = 256;
    const MAX_THREADS: usize = 64;
    let srv = ChildServer::spawn("workers=16,max_connections=256,per_export=256");
    let mut conns = Vec::new();
    for i in 0..CONNECTIONS {
        // 64 per client address (the default per-client limit).
        let from = Ipv4Addr::new(127, 0, 0, 2 + (i / 64) as u8);
        let mut s = tcp_from(from, srv.addr).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        assert!(
            handshake(&mut s, "ram").expect("GO refused"),
            "connection {i} refused"
        );
        conns.push(s);
    }
    // Connections that just went quiet may keep their threads a moment.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut threads = srv.threads();
    while threads >= MAX_THREADS && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        threads = srv.threads();
    }
    eprintln!("{CONNECTIONS} idle connections: {threads} server threads");
    assert!(
        threads < MAX_THREADS,
        "{threads} server threads for {CONNECTIONS} idle connections (want < {MAX_THREADS})"
    );
    // Every idle connection still serves: a write, then a read of it back.
    let reply = |s: &mut TcpStream, handle: u64, i: usize| {
        let mut r = [0u8; SIMPLE_REPLY_LEN];
        s.read_exact(&mut r).unwrap();
        assert_eq!(
            parse_reply_header(&r).unwrap(),
            ReplyHeader::Simple { error: 0, handle },
            "connection {i}"
        );
    };
    for (i, s) in conns.iter_mut().enumerate() {
        let off = i as u64 * 4096;
        let data = pattern(4096, i as u8);
        let mut w = request(CMD_WRITE, 1, off, 4096).to_vec();
        w.extend_from_slice(&data);
        s.write_all(&w).unwrap();
        reply(s, 1, i);
        s.write_all(&request(CMD_READ, 2, off, 4096)).unwrap();
        reply(s, 2, i);
        let mut back = vec![0u8; 4096];
        s.read_exact(&mut back).unwrap();
        assert!(back == data, "connection {i} read back other data");
    }
    // And they give their threads back again once quiet.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut threads = srv.threads();
    while threads >= MAX_THREADS && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        threads = srv.threads();
    }
    eprintln!("quiet again after a request on each: {threads} server threads");
    assert!(
        threads < MAX_THREADS,
        "{threads} server threads after the requests"
    );
    drop(conns);
}

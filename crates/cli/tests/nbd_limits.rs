//! The daemon's NBD limits: command-line flags and `[daemon]` keys reach the server, the
//! command line wins over the file, refusals appear in the daemon's log with the peer, and a
//! limit that cannot work is refused at start; and a hostile mix of clients cannot take the
//! daemon's memory or its service from a well-behaved one.

mod common;

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::FromRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{daemon_refuses_to_start, sparse_file, workdir, Daemon};
use hybridcache_nbd::proto::*;
use hybridcache_nbd::{Client, ClientConfig};

fn wait_log(d: &Daemon, what: &[&str]) -> bool {
    let deadline = Instant::now() + Duration::from_secs(5);
    while Instant::now() < deadline {
        if d.log_text()
            .lines()
            .any(|l| what.iter().all(|w| l.contains(w)))
        {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

#[test]
fn limits_from_flags_and_file_are_enforced_and_logged() {
    let dir = workdir();
    let cfg = dir.path().join("hybridcache.toml");
    std::fs::write(
        &cfg,
        "[daemon]\nnbd_max_connections_per_export = 1\nnbd_max_connections_per_client = 7\n\
         nbd_max_connections_per_user = 9\n\
         nbd_memory_limit = \"384M\"\nnbd_stall_timeout = 0\n\n\
         [[cache]]\nid = 1\ndevice = \"ram:16M\"\n\n\
         [[core]]\ncache = 1\nid = 1\ndevice = \"ram:16M\"\n\n\
         [[core]]\ncache = 1\nid = 2\ndevice = \"ram:16M\"\n",
    )
    .unwrap();
    // The flag overrides the file's per-client limit.
    let d = Daemon::start_with(
        dir.path(),
        &[
            "--config",
            cfg.to_str().unwrap(),
            "--nbd-max-connections-per-client",
            "2",
            "--nbd-max-connections",
            "100",
        ],
    );
    assert!(
        wait_log(
            &d,
            &["NBD limits: 100 connections, 2 per client, 9 per local user, 1 per export, memory 384 MiB"]
        ),
        "{}",
        d.log_text()
    );
    let mut a = Client::connect_unix(&d.nbd, "cas1-1").unwrap();
    // cas1-1 is full: a second connection to it is refused, one to cas1-2 is not.
    assert!(Client::connect_unix(&d.nbd, "cas1-1").is_err());
    assert!(
        wait_log(
            &d,
            &[
                "connection refused",
                "unix uid",
                "cas1-1",
                "max_connections_per_export"
            ]
        ),
        "{}",
        d.log_text()
    );
    // The refused connection counts against this process until the daemon has seen it close.
    let deadline = Instant::now() + Duration::from_secs(5);
    let _b = loop {
        match Client::connect_unix(&d.nbd, "cas1-2") {
            Ok(c) => break c,
            Err(e) => assert!(Instant::now() < deadline, "{e}"),
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    // Two connections from this process: a third is refused at once.
    assert!(Client::connect_unix(&d.nbd, "cas1-2").is_err());
    assert!(
        wait_log(
            &d,
            &[
                "connection refused",
                "unix uid",
                "max_connections_per_client"
            ]
        ),
        "{}",
        d.log_text()
    );
    // The admitted clients are served.
    a.write(&[9u8; 4096], 0, false).unwrap();
    let mut back = [0u8; 4096];
    a.read(&mut back, 0).unwrap();
    assert_eq!(back, [9u8; 4096]);
}

#[test]
fn impossible_limits_stop_the_daemon_from_starting() {
    let dir = workdir();
    for (args, msg) in [
        (
            &["--nbd-memory-limit", "64M", "--nbd-max-connections", "256"][..],
            "too small for 256 connections",
        ),
        (&["--nbd-max-connections", "0"][..], "at least 1"),
        (&["--nbd-handshake-timeout", "0"][..], "at least 1 second"),
    ] {
        let err = daemon_refuses_to_start(dir.path(), args);
        assert!(err.contains(msg), "{args:?}: {err}");
    }
}

// ---- the hostile mix against the daemon --------------------------------------------------------

/// A TCP connection to `to` from the loopback address `from` (all of 127.0.0.0/8 is local), so
/// one test can play several clients, each with its own per-client count.
fn tcp_from(from: Ipv4Addr, to: SocketAddr) -> std::io::Result<TcpStream> {
    let sin = |ip: Ipv4Addr, port: u16| libc::sockaddr_in {
        sin_family: libc::AF_INET as libc::sa_family_t,
        sin_port: port.to_be(),
        sin_addr: libc::in_addr {
            s_addr: u32::from(ip).to_be(),
        },
        sin_zero: [0; 8],
    };
    let SocketAddr::V4(to) = to else {
        panic!("the daemon listens on IPv4 loopback");
    };
    let len = std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t;
    // SAFETY: plain socket calls on a descriptor that the TcpStream owns from the start.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let s = TcpStream::from_raw_fd(fd);
        let local = sin(from, 0);
        if libc::bind(fd, (&local as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        let remote = sin(*to.ip(), to.port());
        if libc::connect(fd, (&remote as *const libc::sockaddr_in).cast(), len) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(s)
    }
}

/// Greeting and `NBD_OPT_GO` for `export`, by hand (a hostile client then sends what no real
/// client would); false if the daemon closed the connection, i.e. refused it.
fn handshake(s: &mut TcpStream, export: &str) -> bool {
    let mut g = [0u8; GREETING_LEN];
    if s.read_exact(&mut g).is_err() {
        return false;
    }
    let mut out = (FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES)
        .to_be_bytes()
        .to_vec();
    encode_option(
        &mut out,
        OPT_GO,
        &encode_info_request(export.as_bytes(), &[]),
    );
    if s.write_all(&out).is_err() {
        return false;
    }
    loop {
        let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
        if s.read_exact(&mut h).is_err() {
            return false;
        }
        let hdr = parse_option_reply_header(&h).expect("an option reply");
        let mut p = vec![0u8; hdr.len as usize];
        if s.read_exact(&mut p).is_err() {
            return false;
        }
        match hdr.reply {
            REP_INFO => {}
            REP_ACK => return true,
            e => panic!("GO refused with {e:#x}, not by closing"),
        }
    }
}

fn request(typ: u16, offset: u64, len: u32) -> [u8; REQUEST_LEN] {
    encode_request(&Request {
        flags: 0,
        typ,
        handle: 1,
        offset,
        length: len,
    })
}

/// (VmRSS, VmHWM) of a process, in bytes.
fn rss(pid: u32) -> (u64, u64) {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc/PID/status");
    let field = |name: &str| {
        s.lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .expect("a memory field")
            * 1024
    };
    (field("VmRSS:"), field("VmHWM:"))
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// What the well-behaved client writes each round, at `BASE`: several sizes, up to 4 MiB.
const SIZES: [usize; 5] = [4096, 512, 65536, 1 << 20, 4 << 20];
const BASE: u64 = 128 << 20;

/// One round of the well-behaved client: write, read back, compare, flush.
fn verify_round(c: &mut Client, round: u8) {
    let mut off = BASE;
    for (i, len) in SIZES.into_iter().enumerate() {
        let data = pattern(len, round.wrapping_mul(7).wrapping_add(i as u8));
        c.write(&data, off, false).expect("write");
        let mut back = vec![0u8; len];
        c.read(&mut back, off).expect("read");
        assert!(back == data, "read back differs at {off}+{len}");
        off += len as u64;
    }
    c.flush().expect("flush");
}

/// The nbd crate's hostile mix (crates/nbd/tests/limits.rs) against the daemon, with a cache
/// and a core behind the export: from two client addresses, more connections than the
/// per-client limit, a third each idle after the handshake, sending a bare header announcing a
/// 32 MiB write, and asking for a 32 MiB read whose reply they never read. Meanwhile a client
/// on a third address writes and verifies patterns, and must be served within a bound every
/// round; the daemon's peak RSS stays within its NBD memory limit plus what it held before;
/// every refusal is in the log (logged, or counted in a later line's `suppressed_before`);
/// once the hostile clients go, their addresses get every slot back, data is intact, and the
/// cache stops (-T, flushing to the core) cleanly.
#[test]
fn hostile_mix_cannot_exhaust_the_daemon() {
    const PER_CLIENT: usize = 16;
    const TRIES: usize = 28;
    const MEMORY: u64 = 128 << 20;
    // A slow shared test machine, not a slow daemon, is what a round beyond a few ms means;
    // a daemon whose NBD workers or memory the hostile clients took would not answer at all.
    const ROUND_BOUND: Duration = Duration::from_secs(10);
    let started = Instant::now();
    let dir = workdir();
    let cache = dir.path().join("cache.img");
    let core = dir.path().join("core.img");
    sparse_file(&cache, 64 << 20);
    sparse_file(&core, 256 << 20);
    let per_client = PER_CLIENT.to_string();
    let d = Daemon::start_with(
        dir.path(),
        &[
            "--nbd-listen",
            "0",
            "--nbd-max-connections",
            "64",
            "--nbd-max-connections-per-client",
            &per_client,
            "--nbd-memory-limit",
            "128M",
        ],
    );
    d.ok(&["-S", "-d", cache.to_str().unwrap(), "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", core.to_str().unwrap()]);
    let log = d.log_text();
    let addr: SocketAddr = log
        .split(" and tcp ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no TCP address in the log: {log}"));
    let pid = d.pid().expect("the daemon runs");
    let (rss0, _) = rss(pid);

    let stop = Arc::new(AtomicBool::new(false));
    let verifier = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut c = Client::connect_tcp(addr, "cas1-1").expect("the verifier connects");
            let (mut rounds, mut slowest) = (0u32, Duration::ZERO);
            while !stop.load(Ordering::Relaxed) || rounds < 3 {
                let t = Instant::now();
                verify_round(&mut c, rounds as u8);
                slowest = slowest.max(t.elapsed());
                rounds += 1;
            }
            c.disconnect().expect("disconnect");
            (rounds, slowest)
        })
    };

    let hostile_from = [Ipv4Addr::new(127, 0, 0, 2), Ipv4Addr::new(127, 0, 0, 3)];
    let mut hostile = Vec::new();
    let mut refused = [0usize; 2];
    for i in 0..2 * TRIES {
        let who = i % 2;
        let mut s = tcp_from(hostile_from[who], addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        if !handshake(&mut s, "cas1-1") {
            refused[who] += 1;
            continue;
        }
        match (i / 2) % 3 {
            0 => {}
            1 => s.write_all(&request(CMD_WRITE, 0, 32 << 20)).unwrap(),
            _ => s.write_all(&request(CMD_READ, 0, 32 << 20)).unwrap(),
        }
        hostile.push(s);
        let (now, _) = rss(pid);
        assert!(
            now < MEMORY + rss0,
            "RSS {} MiB after {} hostile connections",
            now >> 20,
            hostile.len()
        );
    }
    assert_eq!(hostile.len(), 2 * PER_CLIENT, "admitted up to the limit");
    assert_eq!(refused, [TRIES - PER_CLIENT; 2], "refused beyond it");
    // Let the daemon take in what the hostile clients sent and fill their sockets, then
    // refuse one more after the log's one-second window, so that its line carries the count
    // of any refusals the rate limit kept out of the log.
    std::thread::sleep(Duration::from_millis(1100));
    let mut late = tcp_from(hostile_from[0], addr).expect("connect");
    late.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    assert!(!handshake(&mut late, "cas1-1"), "still at the limit");
    refused[0] += 1;

    stop.store(true, Ordering::Relaxed);
    let (rounds, slowest) = verifier.join().expect("the verifier was served throughout");
    let (rss1, hwm) = rss(pid);
    eprintln!(
        "hostile admitted {} refused {refused:?}; verifier rounds {rounds}, slowest {slowest:?}; \
         RSS before {} MiB, after {} MiB, peak {} MiB",
        hostile.len(),
        rss0 >> 20,
        rss1 >> 20,
        hwm >> 20
    );
    assert!(slowest < ROUND_BOUND, "a round took {slowest:?}");
    assert!(
        hwm < MEMORY + rss0,
        "peak RSS {} MiB: more than the 128 MiB NBD limit over the {} MiB before",
        hwm >> 20,
        rss0 >> 20
    );

    // Both addresses are named in refusal lines, and every refusal is in the log.
    let log = d.log_text();
    for from in hostile_from {
        let peer = format!("peer=tcp {from}:");
        let logged = log.lines().any(|l| {
            l.contains("NBD connection refused")
                && l.contains("max_connections_per_client")
                && l.contains(&peer)
        });
        assert!(logged, "no refusal logged for {from}:\n{log}");
    }
    // At most 20 refusal lines a second: the rest are counted in the next line's
    // suppressed_before.
    let logged = log
        .lines()
        .filter(|l| {
            l.contains("NBD connection refused") && l.contains("max_connections_per_client")
        })
        .map(|l| {
            1 + l
                .split("suppressed_before=")
                .nth(1)
                .and_then(|n| n.split_whitespace().next())
                .and_then(|n| n.parse::<usize>().ok())
                .unwrap_or_else(|| panic!("no suppressed_before count: {l}"))
        })
        .sum::<usize>();
    assert_eq!(
        logged,
        refused.iter().sum::<usize>(),
        "refusals logged (or counted) vs refused:\n{log}"
    );

    // The hostile clients go: their addresses get every slot back, and are served.
    drop(hostile);
    drop(late);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut back = Vec::new();
    while back.len() < PER_CLIENT {
        let mut s = tcp_from(hostile_from[0], addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        if handshake(&mut s, "cas1-1") {
            back.push(s);
        } else {
            assert!(
                Instant::now() < deadline,
                "slots of the hostile address not released: {} of {PER_CLIENT} back",
                back.len()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    drop(back);
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut c = loop {
        let s = tcp_from(hostile_from[1], addr).expect("connect");
        match Client::handshake(Box::new(s), &ClientConfig::new("cas1-1")) {
            Ok(c) => break c,
            Err(e) => assert!(Instant::now() < deadline, "{e}"),
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    verify_round(&mut c, 200);
    c.disconnect().expect("disconnect");

    // The cache stops cleanly, flushing what the clients wrote to the core.
    d.ok(&["-T", "-i", "1"]);
    let core_data = std::fs::read(&core).expect("read the core");
    let mut off = BASE as usize;
    for (i, len) in SIZES.into_iter().enumerate() {
        let want = pattern(len, 200u8.wrapping_mul(7).wrapping_add(i as u8));
        assert!(
            core_data[off..off + len] == want[..],
            "the core lacks the last write at {off}+{len}"
        );
        off += len;
    }
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
}

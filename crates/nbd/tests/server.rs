//! End-to-end behaviour with the crate's own client and a raw client.

mod common;

use std::io::Write;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::*;
use hybridcache_nbd::proto::*;
use hybridcache_nbd::{
    BlockSizes, Capabilities, Client, ClientConfig, ClientError, ErrorKind, Export, ExportRegistry,
    Server, ServerConfig,
};

const MIB: usize = 1 << 20;

#[test]
fn client_round_trip_structured_and_simple() {
    let mem = MemExport::new(4 * MIB).arc();
    let t = start(&[("disk", mem.clone() as Arc<dyn Export>)]);
    for structured in [true, false] {
        let cfg = ClientConfig {
            structured_replies: structured,
            ..ClientConfig::new("disk")
        };
        let mut c = Client::connect_unix_with(&t.sock, &cfg).unwrap();
        assert_eq!(c.size(), 4 * MIB as u64);
        assert_eq!(c.structured_replies(), structured);
        assert_eq!(c.block_sizes(), Some(BlockSizes::default()));
        assert!(c.can_multi_conn());
        let data = pattern(64 << 10, structured as u8);
        c.write(&data, 8192, false).unwrap();
        c.write(&data[..4096], MIB as u64, true).unwrap();
        let mut back = vec![0u8; data.len()];
        c.read(&mut back, 8192).unwrap();
        assert_eq!(back, data);
        c.flush().unwrap();
        c.write_zeroes(8192, 4096, false, false).unwrap();
        c.read(&mut back[..4096], 8192).unwrap();
        assert!(back[..4096].iter().all(|&b| b == 0));
        c.trim(0, 1 << 20).unwrap();
        c.cache(0, 4096).unwrap();
        // Errors come back as typed server errors and the connection lives on.
        let err = c.read(&mut back[..512], 4 * MIB as u64).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::Invalid);
        let err = c.write(&back[..512], 4 * MIB as u64, false).unwrap_err();
        assert_eq!(err.kind(), ErrorKind::NoSpace);
        if structured {
            // Structured errors carry a message.
            match err {
                ClientError::Server { message, .. } => assert!(!message.is_empty()),
                e => panic!("{e:?}"),
            }
        }
        c.read(&mut back[..512], 0).unwrap();
        c.disconnect().unwrap();
    }
    assert!(mem.flushes.load(Ordering::Relaxed) >= 2);
    assert!(mem.trims.load(Ordering::Relaxed) >= 2);
}

#[test]
fn several_connections_at_once() {
    let mem = MemExport::new(8 * MIB).arc();
    let t = start(&[("disk", mem.clone() as Arc<dyn Export>)]);
    let sock = t.sock.clone();
    let threads: Vec<_> = (0..6u8)
        .map(|i| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let mut c = Client::connect_unix(&sock, "disk").unwrap();
                let base = u64::from(i) * MIB as u64;
                for k in 0..50u64 {
                    let d = pattern(4096, i.wrapping_add(k as u8));
                    c.write(&d, base + k * 4096, false).unwrap();
                    let mut r = vec![0; 4096];
                    c.read(&mut r, base + k * 4096).unwrap();
                    assert_eq!(r, d);
                }
                c.flush().unwrap();
                c.disconnect().unwrap();
            })
        })
        .collect();
    for th in threads {
        th.join().unwrap();
    }
    // Everything written on one connection is visible on a fresh one.
    let mut c = Client::connect_unix(&t.sock, "disk").unwrap();
    let mut r = vec![0; 4096];
    c.read(&mut r, 3 * MIB as u64 + 49 * 4096).unwrap();
    assert_eq!(r, pattern(4096, 3u8.wrapping_add(49)));
}

/// Reads a client has pipelined reach an export that batches reads together (at most 32 at a
/// time), each gets its own correct reply, and the requests around them (a write, a read too
/// large for one buffer, an unaligned read, one out of range) are served as before.
#[test]
fn pipelined_reads_reach_a_batching_export_together() {
    let mut m = MemExport::new(MIB);
    m.batching = true;
    m.check_alignment = false;
    for (i, b) in m.data.get_mut().iter_mut().enumerate() {
        *b = (i / 512) as u8 ^ (i % 251) as u8;
    }
    let expect = m.data.read().clone();
    let m = m.arc();
    let t = start(&[("batch", m.clone() as Arc<dyn Export>)]);
    for structured in [false, true] {
        let mut raw = Raw::connect(&t.sock);
        if structured {
            raw.structured();
        }
        raw.go("batch", &[]).unwrap();
        // 40 reads in one write: they arrive buffered together.
        let mut wire = Vec::new();
        let mut lens = std::collections::HashMap::new();
        for h in 1..=40u64 {
            let (off, len) = match h {
                17 => (3 * 4096 + 100, 700), // unaligned: read-modify-write, not batched
                23 => (0, 300 << 10),        // larger than one buffer: streamed
                31 => (MIB as u64 - 4096, 8192), // out of range: an error reply
                _ => ((h * 7919 % 250) * 4096, 4096 * (1 + h as u32 % 3)),
            };
            lens.insert(h, (off, len));
            wire.extend_from_slice(&encode_request(&Request {
                flags: 0,
                typ: CMD_READ,
                handle: h,
                offset: off,
                length: len,
            }));
        }
        raw.s.write_all(&wire).unwrap();
        for _ in 1..=40 {
            let (h, e, data) = raw.reply_for(|h| if h == 31 { 0 } else { lens[&h].1 as usize });
            let (off, len) = lens[&h];
            if h == 31 {
                assert_ne!(e, 0, "out of range must fail");
                continue;
            }
            assert_eq!(e, 0, "read {h}");
            assert_eq!(
                data,
                &expect[off as usize..off as usize + len as usize],
                "read {h}"
            );
        }
    }
    let largest = m.largest_batch.load(Ordering::SeqCst);
    assert!(largest > 1 && largest <= 32, "largest batch {largest}");
}

/// Pipelined writes reach a write-batching export together, in the order they were sent (the
/// same sectors twice included: the later write wins); a FUA write is never part of a batch
/// (it keeps its FUA); a flush comes after every batch of the writes sent before it.
#[test]
fn pipelined_writes_reach_a_batching_export_together_in_order() {
    let mut m = MemExport::new(MIB);
    m.write_batching = true;
    let m = m.arc();
    let t = start(&[("wbatch", m.clone() as Arc<dyn Export>)]);
    let mut raw = Raw::connect(&t.sock);
    raw.go("wbatch", &[]).unwrap();
    // handle: (offset, FUA); 0 is the flush. Handles 3 and 7 rewrite handle 1's block.
    let writes: Vec<(u64, u64, bool)> = vec![
        (1, 0, false),
        (2, 8192, false),
        (3, 0, false),
        (4, 4096, false),
        (5, 16384, true),
        (6, 20480, false),
        (7, 0, false),
        (8, 24576, false),
    ];
    let mut wire = Vec::new();
    for &(h, off, fua) in &writes {
        wire.extend_from_slice(&encode_request(&Request {
            flags: if fua { CMD_FLAG_FUA } else { 0 },
            typ: CMD_WRITE,
            handle: h,
            offset: off,
            length: 4096,
        }));
        wire.extend_from_slice(&pattern(4096, h as u8));
    }
    wire.extend_from_slice(&encode_request(&Request {
        flags: 0,
        typ: CMD_FLUSH,
        handle: 100,
        offset: 0,
        length: 0,
    }));
    for h in 9..=12u64 {
        wire.extend_from_slice(&encode_request(&Request {
            flags: 0,
            typ: CMD_WRITE,
            handle: h,
            offset: 32768 + h * 4096,
            length: 4096,
        }));
        wire.extend_from_slice(&pattern(4096, h as u8));
    }
    raw.s.write_all(&wire).unwrap();
    for _ in 0..13 {
        let (h, e, _) = raw.reply_for(|_| 0);
        assert_eq!(e, 0, "request {h}");
    }
    let data = m.data.read().clone();
    assert_eq!(&data[..4096], &pattern(4096, 7)[..], "the last write wins");
    assert_eq!(&data[16384..20480], &pattern(4096, 5)[..]);
    let log = m.log.lock().clone();
    eprintln!("{log:?}");
    assert!(
        log.contains(&Logged::Write(16384, true)),
        "the FUA write keeps its FUA, alone: {log:?}"
    );
    let batched: Vec<u64> = log
        .iter()
        .flat_map(|l| match l {
            Logged::Batch(offs) => offs.clone(),
            _ => Vec::new(),
        })
        .collect();
    assert!(!batched.contains(&16384), "a FUA write in a batch: {log:?}");
    assert!(
        log.iter()
            .any(|l| matches!(l, Logged::Batch(offs) if offs.len() > 1)),
        "no batch: {log:?}"
    );
    let flush = log.iter().position(|l| *l == Logged::Flush).unwrap();
    for (i, l) in log.iter().enumerate() {
        if let Logged::Batch(offs) = l {
            let before_flush = offs.iter().any(|&o| o < 32768);
            let after_flush = offs.iter().any(|&o| o >= 32768);
            assert!(
                !(before_flush && after_flush),
                "a batch across the flush: {log:?}"
            );
            assert_eq!(
                before_flush,
                i < flush,
                "a batch on the wrong side of the flush: {log:?}"
            );
        }
    }
}

#[test]
fn replies_complete_out_of_order() {
    let mut m = MemExport::new(MIB);
    m.slow_read = Some((0, Duration::from_millis(400)));
    let t = start(&[("slow", m.arc() as Arc<dyn Export>)]);
    for structured in [false, true] {
        let mut raw = Raw::connect(&t.sock);
        if structured {
            raw.structured();
        }
        raw.go("slow", &[INFO_BLOCK_SIZE]).unwrap();
        let start = Instant::now();
        raw.request(CMD_READ, 0, 1, 0, 4096); // slow
        raw.request(CMD_READ, 0, 2, 8192, 4096);
        raw.write_req(3, 16384, &pattern(4096, 9));
        raw.request(CMD_FLUSH, 0, 4, 0, 0);
        let mut order = Vec::new();
        for _ in 0..4 {
            let (h, e, data) = raw.reply_for(|h| if h <= 2 { 4096 } else { 0 });
            assert_eq!(e, 0);
            if h <= 2 {
                assert_eq!(data.len(), 4096);
            }
            order.push(h);
        }
        assert_eq!(
            *order.last().unwrap(),
            1,
            "slow read must finish last: {order:?}"
        );
        assert!(start.elapsed() >= Duration::from_millis(400));
        // The connection stays usable after the reordered batch.
        raw.request(CMD_READ, 0, 5, 16384, 4096);
        let (h, e, data) = raw.reply_for(|_| 4096);
        assert_eq!((h, e), (5, 0));
        assert_eq!(data, pattern(4096, 9));
    }
}

#[test]
fn unaligned_requests_use_read_modify_write() {
    let mem = MemExport::new(MIB).arc(); // panics on unaligned access
    let t = start(&[("disk", mem.clone() as Arc<dyn Export>)]);
    let cfg = ClientConfig {
        request_block_size: false,
        ..ClientConfig::new("disk")
    };
    let mut c = Client::connect_unix_with(&t.sock, &cfg).unwrap();
    let mut model = vec![0u8; MIB];
    let base = pattern(8192, 1);
    c.write(&base, 0, false).unwrap();
    model[..8192].copy_from_slice(&base);
    let cases: &[(usize, usize)] = &[
        (7, 100),
        (500, 30),
        (510, 4),
        (1000, 3000),
        (3, 9000),
        (4096, 1),
    ];
    for (i, &(off, len)) in cases.iter().enumerate() {
        let d = pattern(len, 100 + i as u8);
        c.write(&d, off as u64, false).unwrap();
        model[off..off + len].copy_from_slice(&d);
        let mut r = vec![0u8; len];
        c.read(&mut r, off as u64).unwrap();
        assert_eq!(r, d);
    }
    c.write_zeroes(100, 1000, false, false).unwrap();
    model[100..1100].fill(0);
    let fast = c.write_zeroes(100, 1000, false, true).unwrap_err();
    assert_eq!(fast.kind(), ErrorKind::NotSupported);
    c.trim(1, 2000).unwrap(); // shrinks to [512, 1536)
    c.cache(1, 10).unwrap();
    let mut all = vec![0u8; 16384];
    c.read(&mut all, 0).unwrap();
    // Trim may discard [512,1536), whose contents are then unspecified;
    // MemExport keeps the data, so the model still applies.
    assert_eq!(all, model[..16384]);

    // A client that negotiated block sizes is held to them.
    let mut strict = Client::connect_unix(&t.sock, "disk").unwrap();
    let e = strict.write(&[1, 2, 3], 7, false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Invalid);
    let e = strict.read(&mut [0u8; 100], 0).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Invalid);
    strict.read(&mut [0u8; 512], 512).unwrap();
}

#[test]
fn concurrent_rmw_does_not_lose_writes() {
    let mem = MemExport::new(MIB).arc();
    let t = start(&[("disk", mem.clone() as Arc<dyn Export>)]);
    let sock = t.sock.clone();
    // Each thread owns distinct bytes that share 512-byte blocks with the
    // other threads' bytes; lost updates would show up as zeroes.
    let threads: Vec<_> = (0..4u64)
        .map(|i| {
            let sock = sock.clone();
            std::thread::spawn(move || {
                let cfg = ClientConfig {
                    request_block_size: false,
                    ..ClientConfig::new("disk")
                };
                let mut c = Client::connect_unix_with(&sock, &cfg).unwrap();
                for k in 0..64u64 {
                    let off = k * 512 + i * 128;
                    c.write(&[i as u8 + 1; 128], off, false).unwrap();
                }
            })
        })
        .collect();
    for th in threads {
        th.join().unwrap();
    }
    let data = mem.data.read();
    for k in 0..64usize {
        for i in 0..4usize {
            let off = k * 512 + i * 128;
            assert!(
                data[off..off + 128].iter().all(|&b| b == i as u8 + 1),
                "block {k} part {i}"
            );
        }
    }
}

/// An unaligned write (read-modify-write of its edge sector) racing with a whole-sector write
/// of the same sector on another connection, sector after sector, both sent at the same moment.
/// Each sector must end as if the two ran one after the other: the whole-sector data, with or
/// without the patch on top. A lost update (the RMW reading the sector before the whole-sector
/// write and writing it back after) leaves the patch on zeroes.
#[test]
fn rmw_races_with_aligned_writes_on_other_connections() {
    use std::sync::Barrier;
    let mut m = MemExport::new(MIB);
    // Every export call sleeps 2 ms first: the RMW's read and its write-back are then 2 ms
    // apart, and the whole-sector write lands between them unless the server keeps them apart.
    m.jitter_every = Some(1);
    let mem = m.arc();
    let t = start(&[("disk", mem.clone() as Arc<dyn Export>)]);
    const SECTORS: u64 = 64;
    let start_together = Arc::new(Barrier::new(2));
    let unaligned = {
        let (sock, b) = (t.sock.clone(), start_together.clone());
        std::thread::spawn(move || {
            let cfg = ClientConfig {
                request_block_size: false,
                ..ClientConfig::new("disk")
            };
            let mut c = Client::connect_unix_with(&sock, &cfg).unwrap();
            for k in 0..SECTORS {
                b.wait();
                c.write(&[0xA1; 50], k * 512 + 100, false).unwrap();
            }
        })
    };
    let aligned = {
        let (sock, b) = (t.sock.clone(), start_together.clone());
        std::thread::spawn(move || {
            let mut c = Client::connect_unix(&sock, "disk").unwrap();
            for k in 0..SECTORS {
                b.wait();
                c.write(&[0xB0; 512], k * 512, false).unwrap();
            }
        })
    };
    unaligned.join().unwrap();
    aligned.join().unwrap();
    let data = mem.data.read();
    for k in 0..SECTORS as usize {
        let s = &data[k * 512..(k + 1) * 512];
        let outside_ok = s[..100].iter().chain(&s[150..]).all(|&b| b == 0xB0);
        let patch = &s[100..150];
        assert!(
            outside_ok && (patch.iter().all(|&b| b == 0xB0) || patch.iter().all(|&b| b == 0xA1)),
            "sector {k} lost a write: {:?}",
            &s[95..155]
        );
    }
}

#[test]
fn registry_changes_at_run_time() {
    let reg = ExportRegistry::new();
    let server = Server::new(reg.clone());
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s");
    server.serve_unix(&sock).unwrap();
    assert!(Client::list_exports_unix(&sock).unwrap().is_empty());
    match Client::connect_unix(&sock, "late") {
        Err(ClientError::OptionRefused { reply, .. }) => assert_eq!(reply, REP_ERR_UNKNOWN),
        r => panic!("{r:?}"),
    }
    reg.add_with_description("late", "added later", MemExport::new(MIB).arc())
        .unwrap();
    reg.add("other", MemExport::new(2 * MIB).arc()).unwrap();
    let list = Client::list_exports_unix(&sock).unwrap();
    assert_eq!(
        list,
        vec![
            ("late".to_string(), "added later".to_string()),
            ("other".to_string(), String::new()),
        ]
    );
    let mut c = Client::connect_unix(&sock, "late").unwrap();
    c.write(&[5; 512], 0, false).unwrap();
    // Removal affects new connections only.
    reg.remove("late");
    assert!(Client::connect_unix(&sock, "late").is_err());
    let mut r = [0u8; 512];
    c.read(&mut r, 0).unwrap();
    assert_eq!(r, [5; 512]);
    // The default export answers the empty name.
    reg.set_default(Some("other"));
    assert_eq!(
        Client::connect_unix(&sock, "").unwrap().size(),
        2 * MIB as u64
    );
}

#[test]
fn info_reports_name_description_and_block_size() {
    let mut m = MemExport::new(MIB);
    m.bs = BlockSizes {
        min: 4096,
        preferred: 65536,
        max: 1 << 20,
    };
    m.caps = Capabilities {
        read_only: true,
        ..Capabilities::default()
    };
    let t = start(&[("ro", m.arc() as Arc<dyn Export>)]);
    let mut raw = Raw::connect(&t.sock);
    raw.option(
        OPT_INFO,
        &encode_info_request(b"ro", &[INFO_NAME, INFO_DESCRIPTION]),
    );
    let mut infos = Vec::new();
    loop {
        let (h, p) = raw.reply();
        if h.reply == REP_ACK {
            break;
        }
        assert_eq!(h.reply, REP_INFO);
        infos.push(parse_info(&p).unwrap());
    }
    assert!(infos.contains(&Info::Export {
        size: MIB as u64,
        flags: FLAG_HAS_FLAGS | FLAG_READ_ONLY | FLAG_SEND_FLUSH
    }));
    assert!(infos.contains(&Info::BlockSize {
        min: 4096,
        preferred: 65536,
        max: 1 << 20
    }));
    assert!(infos.contains(&Info::Name(b"ro".to_vec())));
    assert!(infos.contains(&Info::Description(b"test export ro".to_vec())));
    // INFO leaves negotiation open; GO then enters transmission.
    let (size, flags) = raw.go("ro", &[]).unwrap();
    assert_eq!(size, MIB as u64);
    assert_ne!(flags & FLAG_READ_ONLY, 0);
    raw.write_req(1, 0, &[0u8; 4096]);
    assert_eq!(raw.status(), (1, EPERM));
    raw.request(CMD_TRIM, 0, 2, 0, 4096);
    assert_eq!(raw.status(), (2, EPERM));
}

#[test]
fn export_name_and_no_zeroes() {
    let t = start(&[("disk", MemExport::new(MIB).arc() as Arc<dyn Export>)]);
    for no_zeroes in [true, false] {
        use std::io::{Read, Write};
        let mut s = std::os::unix::net::UnixStream::connect(&t.sock).unwrap();
        let mut g = [0u8; GREETING_LEN];
        s.read_exact(&mut g).unwrap();
        let cf = if no_zeroes { 3u32 } else { 1u32 };
        s.write_all(&cf.to_be_bytes()).unwrap();
        let mut out = Vec::new();
        encode_option(&mut out, OPT_EXPORT_NAME, b"disk");
        s.write_all(&out).unwrap();
        let n = if no_zeroes { 10 } else { 134 };
        let mut b = vec![0u8; n];
        s.read_exact(&mut b).unwrap();
        assert_eq!(parse_u64(&b).unwrap(), MIB as u64);
        // Immediately usable with simple replies.
        s.write_all(&encode_request(&Request {
            flags: 0,
            typ: CMD_READ,
            handle: 77,
            offset: 0,
            length: 512,
        }))
        .unwrap();
        let mut r = [0u8; 16 + 512];
        s.read_exact(&mut r).unwrap();
        assert_eq!(
            parse_reply_header(&r[..16]).unwrap(),
            ReplyHeader::Simple {
                error: 0,
                handle: 77
            }
        );
    }
}

#[test]
fn tcp_listener_works() {
    let reg = ExportRegistry::new();
    reg.add("disk", MemExport::new(MIB).arc()).unwrap();
    let server = Server::new(reg);
    let addr = server.serve_tcp_loopback(0).unwrap();
    assert!(addr.ip().is_loopback());
    let mut c = Client::connect_tcp(addr, "disk").unwrap();
    c.write(&pattern(4096, 3), 4096, true).unwrap();
    let mut r = vec![0; 4096];
    c.read(&mut r, 4096).unwrap();
    assert_eq!(r, pattern(4096, 3));
}

#[test]
fn shutdown_closes_everything() {
    let t = start_with(
        &[("disk", MemExport::new(MIB).arc() as Arc<dyn Export>)],
        ServerConfig {
            shutdown_grace: Duration::from_secs(2),
            ..ServerConfig::default()
        },
    );
    let mut c = Client::connect_unix(&t.sock, "disk").unwrap();
    let idle = Raw::connect(&t.sock); // stuck in the handshake
    c.read(&mut [0u8; 512], 0).unwrap();
    assert_eq!(t.server.connection_count(), 2);
    let start = Instant::now();
    t.server.handle().shutdown();
    assert!(
        start.elapsed() < Duration::from_secs(2),
        "{:?}",
        start.elapsed()
    );
    assert_eq!(t.server.connection_count(), 0);
    assert!(c.read(&mut [0u8; 512], 0).is_err());
    drop(idle);
    assert!(!t.sock.exists());
    assert!(std::os::unix::net::UnixStream::connect(&t.sock).is_err());
    t.server.shutdown(); // idempotent
}

#[test]
fn stale_socket_file_is_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s");
    drop(std::os::unix::net::UnixListener::bind(&sock).unwrap());
    assert!(sock.exists());
    let reg = ExportRegistry::new();
    reg.add("d", MemExport::new(MIB).arc()).unwrap();
    let a = Server::new(reg.clone());
    a.serve_unix(&sock).unwrap();
    // A live socket is not stolen.
    let b = Server::new(reg);
    assert!(b.serve_unix(&sock).is_err());
    Client::connect_unix(&sock, "d").unwrap();
}

#[test]
fn serve_stream_over_socketpair() {
    let reg = ExportRegistry::new();
    reg.add("d", MemExport::new(MIB).arc()).unwrap();
    let server = Arc::new(Server::new(reg));
    let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
    let srv = server.clone();
    let th = std::thread::spawn(move || srv.serve_stream(&a, &a).unwrap());
    let mut c = Client::handshake(Box::new(b), &ClientConfig::new("d")).unwrap();
    c.write(&[9; 1024], 0, false).unwrap();
    let mut r = [0; 1024];
    c.read(&mut r, 0).unwrap();
    assert_eq!(r, [9; 1024]);
    c.disconnect().unwrap();
    th.join().unwrap();
}

#[test]
fn disc_answers_in_flight_requests_then_closes() {
    let mut m = MemExport::new(MIB);
    m.slow_read = Some((0, Duration::from_millis(200)));
    let t = start(&[("d", m.arc() as Arc<dyn Export>)]);
    let mut raw = Raw::connect(&t.sock);
    raw.go("d", &[]).unwrap();
    raw.request(CMD_READ, 0, 1, 0, 512); // slow
    raw.write_req(2, 4096, &[3; 512]);
    raw.request(CMD_DISC, 0, 3, 0, 0);
    let mut seen = vec![];
    for _ in 0..2 {
        let (h, e, _) = raw.reply_for(|h| if h == 1 { 512 } else { 0 });
        assert_eq!(e, 0);
        seen.push(h);
    }
    seen.sort();
    assert_eq!(seen, vec![1, 2]);
    assert!(raw.closed_by_server());
}

#[test]
fn single_worker_still_serves_everything() {
    let t = start_with(
        &[("d", MemExport::new(MIB).arc() as Arc<dyn Export>)],
        ServerConfig {
            workers_per_connection: 1,
            ..ServerConfig::default()
        },
    );
    let mut raw = Raw::connect(&t.sock);
    raw.structured();
    raw.go("d", &[]).unwrap();
    for h in 0..100u64 {
        raw.write_req(h, h * 512, &[h as u8; 512]);
    }
    for h in 100..200u64 {
        raw.request(CMD_READ, 0, h, (h - 100) * 512, 512);
    }
    let mut n = 0;
    for _ in 0..200 {
        let (h, e, d) = raw.reply_for(|_| 0);
        assert_eq!(e, 0);
        if h >= 100 {
            assert_eq!(d, vec![(h - 100) as u8; 512]);
        }
        n += 1;
    }
    assert_eq!(n, 200);
}

#[test]
fn pipelined_mixed_latency_stress() {
    use std::io::Write;
    let mut m = MemExport::new(4 * MIB);
    m.jitter_every = Some(7);
    let t = start(&[("d", m.arc() as Arc<dyn Export>)]);
    let threads: Vec<_> = (0..3u64)
        .map(|c| {
            let sock = t.sock.clone();
            std::thread::spawn(move || {
                let mut raw = Raw::connect(&sock);
                if c % 2 == 0 {
                    raw.structured();
                }
                raw.go("d", &[INFO_BLOCK_SIZE]).unwrap();
                let base = c * MIB as u64;
                let n = 300u64;
                // Requests are written by a second thread so replies and
                // requests flow at the same time, like a real client.
                let mut w = raw.s.try_clone().unwrap();
                let writer = std::thread::spawn(move || {
                    for i in 0..n {
                        let off = base + (i % 64) * 4096;
                        let mut b = encode_request(&Request {
                            flags: 0,
                            typ: CMD_WRITE,
                            handle: 2 * i,
                            offset: off,
                            length: 4096,
                        })
                        .to_vec();
                        b.extend(vec![(i % 64) as u8 ^ c as u8; 4096]);
                        b.extend(encode_request(&Request {
                            flags: 0,
                            typ: CMD_READ,
                            handle: 2 * i + 1,
                            offset: base + ((i + 32) % 64) * 4096,
                            length: 4096,
                        }));
                        w.write_all(&b).unwrap();
                    }
                });
                let mut seen = std::collections::HashSet::new();
                for _ in 0..2 * n {
                    let (h, e, d) = raw.reply_for(|h| if h % 2 == 1 { 4096 } else { 0 });
                    assert_eq!(e, 0);
                    if h % 2 == 1 {
                        assert_eq!(d.len(), 4096);
                        // Whole-request atomicity: a read sees one write's
                        // bytes, never a mix.
                        assert!(d.iter().all(|&x| x == d[0]), "torn read");
                    }
                    assert!(seen.insert(h), "duplicate reply {h}");
                }
                writer.join().unwrap();
                assert_eq!(seen.len() as u64, 2 * n);
            })
        })
        .collect();
    for th in threads {
        th.join().unwrap();
    }
}

#[test]
fn maximum_size_requests() {
    let t = start(&[("d", MemExport::new(40 * MIB).arc() as Arc<dyn Export>)]);
    for structured in [true, false] {
        let cfg = ClientConfig {
            structured_replies: structured,
            ..ClientConfig::new("d")
        };
        let mut c = Client::connect_unix_with(&t.sock, &cfg).unwrap();
        let data = pattern(32 * MIB, 5 + structured as u8);
        c.write(&data, 4 * MIB as u64, false).unwrap();
        let mut back = vec![0u8; 32 * MIB];
        c.read(&mut back, 4 * MIB as u64).unwrap();
        assert!(back == data);
        // One byte over the maximum is refused, and the connection survives.
        let e = c.read(&mut vec![0u8; 32 * MIB + 512], 0).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Invalid);
        c.read(&mut back[..512], 0).unwrap();
    }
}

/// Polls `f` until it holds; the server notices a closed connection on its own thread.
fn eventually(what: &str, f: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !f() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn clients_are_counted_per_export() {
    let reg = ExportRegistry::new();
    let server = Server::new(reg.clone());
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("s");
    server.serve_unix(&sock).unwrap();
    reg.add("a", MemExport::new(MIB).arc()).unwrap();
    reg.add("b", MemExport::new(MIB).arc()).unwrap();
    assert_eq!(reg.clients("a"), Some(0));
    assert_eq!(reg.clients("nope"), None);
    // A listing is a handshake without transmission: no client.
    Client::list_exports_unix(&sock).unwrap();
    let a1 = Client::connect_unix(&sock, "a").unwrap();
    let mut a2 = Client::connect_unix(&sock, "a").unwrap();
    let b1 = Client::connect_unix(&sock, "b").unwrap();
    // The server counts a client once its GO reply is out, a moment after the client sees it.
    eventually("2 clients on a", || reg.clients("a") == Some(2));
    eventually("1 client on b", || reg.clients("b") == Some(1));
    a2.flush().unwrap();
    a2.disconnect().unwrap();
    eventually("1 client on a", || reg.clients("a") == Some(1));
    // A client that just goes away (no NBD_CMD_DISC) is no longer counted either.
    drop(a1);
    eventually("no client on a", || reg.clients("a") == Some(0));
    assert_eq!(reg.clients("b"), Some(1));
    b1.disconnect().unwrap();
    eventually("no client on b", || reg.clients("b") == Some(0));
}

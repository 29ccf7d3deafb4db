//! Malformed and hostile input: the offending connection gets the spec's
//! error or is closed; the server and other connections carry on.

mod common;

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::Arc;

use common::*;
use hybridcache_nbd::proto::*;
use hybridcache_nbd::{Client, Export};

const MIB: usize = 1 << 20;

fn server() -> TestServer {
    start(&[("disk", MemExport::new(MIB).arc() as Arc<dyn Export>)])
}

/// The server still serves a fresh, well-behaved client.
fn still_works(t: &TestServer) {
    let mut c = Client::connect_unix(&t.sock, "disk").unwrap();
    c.write(&[7; 4096], 0, false).unwrap();
    let mut r = [0u8; 4096];
    c.read(&mut r, 0).unwrap();
    assert_eq!(r, [7; 4096]);
}

#[test]
fn bad_option_magic_closes() {
    let t = server();
    let mut raw = Raw::connect(&t.sock);
    raw.s.write_all(&[0xAB; 16]).unwrap();
    assert!(raw.closed_by_server());
    still_works(&t);
}

#[test]
fn bad_request_magic_closes() {
    let t = server();
    let mut raw = Raw::connect(&t.sock);
    raw.go("disk", &[]).unwrap();
    raw.s.write_all(&[0x55; 28]).unwrap();
    assert!(raw.closed_by_server());
    still_works(&t);
}

#[test]
fn unknown_client_flags_close() {
    let t = server();
    let mut s = UnixStream::connect(&t.sock).unwrap();
    let mut g = [0u8; GREETING_LEN];
    s.read_exact(&mut g).unwrap();
    s.write_all(&0x8000_0001u32.to_be_bytes()).unwrap();
    let mut raw = Raw {
        s,
        structured: false,
    };
    assert!(raw.closed_by_server());
    still_works(&t);
}

#[test]
fn oversize_option_length() {
    let t = server();
    // Just above the cap: discarded and refused, negotiation continues.
    let mut raw = Raw::connect(&t.sock);
    raw.option(0x1234, &vec![0u8; (64 << 10) + 1]);
    assert_eq!(raw.reply().0.reply, REP_ERR_TOO_BIG);
    raw.go("disk", &[]).unwrap();
    // Absurd length: the server hangs up instead of reading or allocating.
    let mut raw = Raw::connect(&t.sock);
    let mut hdr = Vec::new();
    hdr.extend_from_slice(&IHAVEOPT.to_be_bytes());
    hdr.extend_from_slice(&OPT_GO.to_be_bytes());
    hdr.extend_from_slice(&u32::MAX.to_be_bytes());
    raw.s.write_all(&hdr).unwrap();
    assert!(raw.closed_by_server());
    still_works(&t);
}

#[test]
fn unknown_and_unsupported_options_then_go() {
    let t = server();
    let mut raw = Raw::connect(&t.sock);
    for opt in [
        0xdead_beef,
        OPT_STARTTLS,
        OPT_SET_META_CONTEXT,
        OPT_EXTENDED_HEADERS,
    ] {
        raw.option(opt, b"some data");
        let (h, _) = raw.reply();
        assert_eq!((h.option, h.reply), (opt, REP_ERR_UNSUP));
    }
    raw.option(OPT_LIST, b"x");
    assert_eq!(raw.reply().0.reply, REP_ERR_INVALID);
    raw.option(OPT_STRUCTURED_REPLY, b"x");
    assert_eq!(raw.reply().0.reply, REP_ERR_INVALID);
    raw.option(OPT_GO, &[0, 0, 0, 99, 0, 0]);
    assert_eq!(raw.reply().0.reply, REP_ERR_INVALID);
    assert_eq!(raw.go("nope", &[]), Err(REP_ERR_UNKNOWN));
    raw.go("disk", &[]).unwrap();
    raw.request(CMD_READ, 0, 1, 0, 512);
    let (h, e, d) = raw.reply_for(|_| 512);
    assert_eq!((h, e, d.len()), (1, 0, 512));
}

#[test]
fn abort_gets_ack_and_close() {
    let t = server();
    let mut raw = Raw::connect(&t.sock);
    raw.option(OPT_ABORT, &[]);
    assert_eq!(raw.reply().0.reply, REP_ACK);
    assert!(raw.closed_by_server());
}

#[test]
fn unknown_export_name_closes() {
    let t = server();
    let mut raw = Raw::connect(&t.sock);
    raw.option(OPT_EXPORT_NAME, b"missing");
    assert!(raw.closed_by_server());
    still_works(&t);
}

#[test]
fn bad_requests_get_errors_and_connection_survives() {
    let t = server();
    for structured in [false, true] {
        let mut raw = Raw::connect(&t.sock);
        if structured {
            raw.structured();
        }
        raw.go("disk", &[INFO_BLOCK_SIZE]).unwrap();
        raw.request(42, 0, 1, 0, 512);
        assert_eq!(raw.status(), (1, EINVAL), "unknown command");
        raw.request(CMD_BLOCK_STATUS, 0, 2, 0, 512);
        assert_eq!(raw.status(), (2, EINVAL), "block status without context");
        raw.request(CMD_READ, 0, 3, MIB as u64, 512);
        assert_eq!(raw.status(), (3, EINVAL), "read past end");
        raw.request(CMD_READ, 0, 4, u64::MAX - 10, 512);
        assert_eq!(raw.status(), (4, EINVAL), "offset overflow");
        raw.write_req(5, MIB as u64 - 512, &[1; 1024]);
        assert_eq!(raw.status(), (5, ENOSPC), "write past end");
        raw.request(CMD_READ, 0, 6, 0, 0);
        assert_eq!(raw.status(), (6, EINVAL), "zero length");
        raw.request(CMD_READ, 0, 7, 0, (32 << 20) + 512);
        assert_eq!(raw.status(), (7, EINVAL), "over max block size");
        raw.request(CMD_READ, 1 << 12, 8, 0, 512);
        assert_eq!(raw.status(), (8, EINVAL), "unknown flag");
        raw.write_req(9, 3, &[1; 512]);
        assert_eq!(raw.status(), (9, EINVAL), "unaligned after negotiation");
        raw.request(CMD_WRITE_ZEROES, 0, 10, MIB as u64, 512);
        assert_eq!(raw.status(), (10, ENOSPC), "zeroes past end");
        raw.request(CMD_TRIM, 0, 11, MIB as u64, 512);
        assert_eq!(raw.status(), (11, EINVAL), "trim past end");
        // Valid traffic still works on a new connection.
        still_works(&t);
    }
}

#[test]
fn oversized_write_payload_within_limit_is_discarded() {
    let mut m = MemExport::new(MIB);
    m.bs.max = 1 << 20;
    let t = start(&[("disk", m.arc() as Arc<dyn Export>)]);
    let mut raw = Raw::connect(&t.sock);
    raw.go("disk", &[]).unwrap();
    // 2 MiB > max block (1 MiB) but < 32 MiB: consumed and refused.
    let len = 2 << 20;
    raw.request(CMD_WRITE, 0, 1, 0, len);
    let mut w = raw.s.try_clone().unwrap();
    let th = std::thread::spawn(move || w.write_all(&vec![1u8; len as usize]).unwrap());
    assert_eq!(raw.status(), (1, EINVAL));
    th.join().unwrap();
    // Still in sync.
    raw.request(CMD_READ, 0, 2, 0, 512);
    let (h, e, d) = raw.reply_for(|_| 512);
    assert_eq!((h, e), (2, 0));
    assert_eq!(d, vec![0u8; 512]);
    // Beyond the discard limit: hard disconnect.
    raw.request(CMD_WRITE, 0, 3, 0, u32::MAX);
    assert!(raw.closed_by_server());
    still_works(&t);
}

#[test]
fn disconnect_mid_write_payload() {
    let t = server();
    for _ in 0..3 {
        let mut raw = Raw::connect(&t.sock);
        raw.go("disk", &[]).unwrap();
        raw.request(CMD_WRITE, 0, 1, 0, 65536);
        raw.s.write_all(&[1u8; 1000]).unwrap();
        drop(raw);
    }
    // Disconnect mid-header too.
    let mut raw = Raw::connect(&t.sock);
    raw.go("disk", &[]).unwrap();
    raw.s.write_all(&REQUEST_MAGIC.to_be_bytes()).unwrap();
    drop(raw);
    // And mid-option.
    let mut raw = Raw::connect(&t.sock);
    raw.s.write_all(&IHAVEOPT.to_be_bytes()).unwrap();
    drop(raw);
    still_works(&t);
    // The partial writes never reached the export.
    let mut c = Client::connect_unix(&t.sock, "disk").unwrap();
    let mut r = vec![0u8; 8192];
    c.read(&mut r, 4096).unwrap();
    assert!(r.iter().all(|&b| b == 0));
}

#[test]
fn client_vanishing_with_requests_in_flight() {
    let mut m = MemExport::new(MIB);
    m.slow_read = Some((0, std::time::Duration::from_millis(200)));
    let t = start(&[("disk", m.arc() as Arc<dyn Export>)]);
    let mut raw = Raw::connect(&t.sock);
    raw.go("disk", &[]).unwrap();
    for h in 0..8 {
        raw.request(CMD_READ, 0, h, 0, 65536);
    }
    drop(raw);
    std::thread::sleep(std::time::Duration::from_millis(500));
    still_works(&t);
}

#[test]
fn silent_client_is_dropped_after_handshake_timeout() {
    let t = start_with(
        &[("disk", MemExport::new(MIB).arc() as Arc<dyn Export>)],
        hybridcache_nbd::ServerConfig {
            handshake_timeout: Some(std::time::Duration::from_millis(200)),
            ..Default::default()
        },
    );
    let started = std::time::Instant::now();
    let mut raw = Raw::connect(&t.sock);
    assert!(raw.closed_by_server());
    assert!(started.elapsed() < std::time::Duration::from_secs(5));
    // The timeout does not apply once in transmission.
    let mut c = Client::connect_unix(&t.sock, "disk").unwrap();
    std::thread::sleep(std::time::Duration::from_millis(400));
    c.read(&mut [0u8; 512], 0).unwrap();
}

#[test]
fn connection_limit_refuses_extra_clients() {
    let t = start_with(
        &[("disk", MemExport::new(MIB).arc() as Arc<dyn Export>)],
        hybridcache_nbd::ServerConfig {
            max_connections: 2,
            ..Default::default()
        },
    );
    let _a = Client::connect_unix(&t.sock, "disk").unwrap();
    let _b = Client::connect_unix(&t.sock, "disk").unwrap();
    assert!(Client::connect_unix(&t.sock, "disk").is_err());
    drop(_a);
    // The slot frees once the server notices the close.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        if Client::connect_unix(&t.sock, "disk").is_ok() {
            break;
        }
        assert!(std::time::Instant::now() < deadline);
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

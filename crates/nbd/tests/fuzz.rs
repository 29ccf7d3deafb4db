//! Fuzzing the handshake + transmission state machine through
//! `Server::serve_stream` over in-memory streams: random bytes and mutated
//! valid sessions must never panic, hang or allocate without bound.
//! Regression cases stay below as ordinary tests.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::collections::HashSet;
use std::io::{self, Cursor, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use common::MemExport;
use hybridcache_nbd::proto::*;
use hybridcache_nbd::{ExportRegistry, Server, ServerConfig};
use proptest::prelude::*;

/// Records the largest single allocation, to prove that lengths taken from
/// the wire never size a buffer beyond the limits.
struct Tracking;
static LARGEST_ALLOC: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Tracking {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        LARGEST_ALLOC.fetch_max(l.size(), Ordering::Relaxed);
        System.alloc(l)
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        System.dealloc(p, l)
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        LARGEST_ALLOC.fetch_max(l.size(), Ordering::Relaxed);
        System.alloc_zeroed(l)
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        LARGEST_ALLOC.fetch_max(new, Ordering::Relaxed);
        System.realloc(p, l, new)
    }
}

#[global_allocator]
static ALLOC: Tracking = Tracking;

const EXPORT_SIZE: usize = 1 << 20;
/// Export data (1 MiB) + one reply buffer (<= export size + header) +
/// slack; nothing may come near the 32 MiB a wire length could ask for.
const ALLOC_BOUND: usize = 2 << 20;

fn server() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| {
        let reg = ExportRegistry::new();
        // MemExport panics if an unaligned range reaches it, so the fuzzer
        // also checks the server's read-modify-write path.
        reg.add("disk", MemExport::new(EXPORT_SIZE).arc()).unwrap();
        reg.set_default(Some("disk"));
        let mut ro = MemExport::new(64 << 10);
        ro.caps.read_only = true;
        reg.add("ro", ro.arc()).unwrap();
        Server::with_config(
            reg,
            ServerConfig {
                workers_per_connection: 2,
                ..ServerConfig::default()
            },
        )
    })
}

/// Output sink that counts and keeps what the server sent.
#[derive(Clone, Default)]
struct Out(Arc<parking_lot::Mutex<Vec<u8>>>);

impl Write for Out {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        let mut v = self.0.lock();
        // Bound what a test keeps; the server may legitimately send more.
        if v.len() < (64 << 20) {
            v.extend_from_slice(b);
        }
        Ok(b.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn run(input: Vec<u8>) -> Vec<u8> {
    let out = Out::default();
    server().serve_stream(Cursor::new(input), out.clone()).ok();
    let largest = LARGEST_ALLOC.load(Ordering::Relaxed);
    assert!(largest <= ALLOC_BOUND, "allocation of {largest} bytes");
    let v = out.0.lock().clone();
    v
}

// ---- building valid sessions ------------------------------------------------

#[derive(Debug, Clone)]
enum Opt {
    List,
    Info(bool, Vec<u16>),
    Unknown(u32, Vec<u8>),
}

#[derive(Debug, Clone)]
enum Cmd {
    Read(u64, u32, u16),
    Write(u64, u32, u16),
    Flush,
    Trim(u64, u32),
    Zeroes(u64, u32, u16),
    Cache(u64, u32),
    Other(u16, u64, u32),
}

fn opt_strategy() -> impl Strategy<Value = Opt> {
    prop_oneof![
        Just(Opt::List),
        (any::<bool>(), prop::collection::vec(0u16..6, 0..4)).prop_map(|(k, i)| Opt::Info(k, i)),
        (12u32..64, prop::collection::vec(any::<u8>(), 0..32))
            .prop_map(|(o, d)| Opt::Unknown(o, d)),
    ]
}

fn offset() -> impl Strategy<Value = u64> {
    prop_oneof![
        (0u64..2048).prop_map(|b| b * 512),
        0u64..(EXPORT_SIZE as u64 + 4096),
        Just(u64::MAX - 100),
    ]
}

fn len() -> impl Strategy<Value = u32> {
    prop_oneof![
        (1u32..64).prop_map(|b| b * 512),
        0u32..70_000,
        Just(u32::MAX),
    ]
}

fn cmd_strategy() -> impl Strategy<Value = Cmd> {
    let flags = prop_oneof![Just(0u16), Just(CMD_FLAG_FUA), 0u16..64];
    prop_oneof![
        (offset(), len(), flags.clone()).prop_map(|(o, l, f)| Cmd::Read(o, l, f)),
        (offset(), 0u32..70_000, flags.clone()).prop_map(|(o, l, f)| Cmd::Write(o, l, f)),
        Just(Cmd::Flush),
        (offset(), len()).prop_map(|(o, l)| Cmd::Trim(o, l)),
        (offset(), len(), flags).prop_map(|(o, l, f)| Cmd::Zeroes(o, l, f)),
        (offset(), len()).prop_map(|(o, l)| Cmd::Cache(o, l)),
        (7u16..40, offset(), len()).prop_map(|(t, o, l)| Cmd::Other(t, o, l)),
    ]
}

/// A well-formed client byte stream (structured replies on), and the number
/// of requests that must be answered.
fn session(opts: &[Opt], go_block_size: bool, cmds: &[Cmd], disc: bool) -> (Vec<u8>, usize) {
    let mut s = Vec::new();
    s.extend_from_slice(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes());
    encode_option(&mut s, OPT_STRUCTURED_REPLY, &[]);
    for o in opts {
        match o {
            Opt::List => encode_option(&mut s, OPT_LIST, &[]),
            Opt::Info(known, items) => {
                let name: &[u8] = if *known { b"disk" } else { b"nope" };
                encode_option(&mut s, OPT_INFO, &encode_info_request(name, items));
            }
            Opt::Unknown(o, d) => encode_option(&mut s, *o, d),
        }
    }
    let items: &[u16] = if go_block_size {
        &[INFO_BLOCK_SIZE]
    } else {
        &[]
    };
    encode_option(&mut s, OPT_GO, &encode_info_request(b"disk", items));
    let mut answered = 0;
    for (h, c) in cmds.iter().enumerate() {
        let (typ, flags, offset, length) = match *c {
            Cmd::Read(o, l, f) => (CMD_READ, f, o, l),
            Cmd::Write(o, l, f) => (CMD_WRITE, f, o, l),
            Cmd::Flush => (CMD_FLUSH, 0, 0, 0),
            Cmd::Trim(o, l) => (CMD_TRIM, 0, o, l),
            Cmd::Zeroes(o, l, f) => (CMD_WRITE_ZEROES, f, o, l),
            Cmd::Cache(o, l) => (CMD_CACHE, 0, o, l),
            Cmd::Other(t, o, l) => (t, 0, o, l),
        };
        s.extend_from_slice(&encode_request(&Request {
            flags,
            typ,
            handle: h as u64,
            offset,
            length,
        }));
        if typ == CMD_WRITE {
            s.extend((0..length).map(|i| i as u8));
        }
        answered += 1;
    }
    if disc {
        s.extend_from_slice(&encode_request(&Request {
            flags: 0,
            typ: CMD_DISC,
            handle: 0,
            offset: 0,
            length: 0,
        }));
    }
    (s, answered)
}

/// Parses the server's side of a structured session: greeting, option
/// replies up to GO's ACK, then reply chunks. Returns the handles answered
/// with a final chunk, or None if the stream is malformed.
fn parse_output(out: &[u8]) -> Option<Vec<u64>> {
    let mut at = GREETING_LEN;
    loop {
        let h: &[u8; OPTION_REPLY_HEADER_LEN] = out.get(at..at + 20)?.try_into().ok()?;
        let h = parse_option_reply_header(h).ok()?;
        at += 20 + h.len as usize;
        if h.option == OPT_GO && h.reply == REP_ACK {
            break;
        }
    }
    let mut handles = Vec::new();
    while at < out.len() {
        let magic: [u8; 4] = out.get(at..at + 4)?.try_into().ok()?;
        let n = 4 + reply_header_rest_len(&magic).ok()?;
        match parse_reply_header(out.get(at..at + n)?).ok()? {
            ReplyHeader::Simple { handle, .. } => {
                handles.push(handle);
                at += n;
            }
            ReplyHeader::Structured {
                flags,
                handle,
                length,
                ..
            } => {
                if flags & REPLY_FLAG_DONE != 0 {
                    handles.push(handle);
                }
                at += n + length as usize;
            }
        }
    }
    (at == out.len()).then_some(handles)
}

#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Truncate(usize),
    Insert(usize, Vec<u8>),
    Remove(usize, usize),
    SetU32(usize, u32),
}

fn mutate(mut s: Vec<u8>, muts: &[Mutation]) -> Vec<u8> {
    for m in muts {
        if s.is_empty() {
            break;
        }
        let n = s.len();
        match m {
            Mutation::Flip(i, x) => s[i % n] ^= x | 1,
            Mutation::Truncate(i) => s.truncate(i % n),
            Mutation::Insert(i, b) => {
                let at = i % n;
                s.splice(at..at, b.iter().copied());
            }
            Mutation::Remove(i, k) => {
                let at = i % n;
                s.drain(at..(at + k).min(n));
            }
            Mutation::SetU32(i, v) => {
                let at = i % n;
                for (j, b) in v.to_be_bytes().iter().enumerate() {
                    if at + j < n {
                        s[at + j] = *b;
                    }
                }
            }
        }
    }
    s
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(i, x)| Mutation::Flip(i, x)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..16))
            .prop_map(|(i, b)| Mutation::Insert(i, b)),
        (any::<usize>(), 1usize..32).prop_map(|(i, k)| Mutation::Remove(i, k)),
        (any::<usize>(), any::<u32>()).prop_map(|(i, v)| Mutation::SetU32(i, v)),
    ]
}

fn prefix() -> impl Strategy<Value = Vec<u8>> {
    // Random bytes rarely get past the 4-byte client flags, so also start
    // them at each later stage of a valid session.
    prop_oneof![
        Just(vec![]),
        Just(3u32.to_be_bytes().to_vec()),
        Just({
            let mut v = 3u32.to_be_bytes().to_vec();
            v.extend_from_slice(&IHAVEOPT.to_be_bytes());
            v
        }),
        any::<bool>().prop_map(|structured| {
            let mut v = 3u32.to_be_bytes().to_vec();
            if structured {
                encode_option(&mut v, OPT_STRUCTURED_REPLY, &[]);
            }
            encode_option(&mut v, OPT_GO, &encode_info_request(b"disk", &[]));
            v
        }),
        Just({
            let mut v = 3u32.to_be_bytes().to_vec();
            encode_option(&mut v, OPT_GO, &encode_info_request(b"ro", &[]));
            v.extend_from_slice(&REQUEST_MAGIC.to_be_bytes());
            v
        }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

    #[test]
    fn random_bytes_never_panic(pre in prefix(), junk in prop::collection::vec(any::<u8>(), 0..512)) {
        let mut input = pre;
        input.extend_from_slice(&junk);
        run(input);
    }

    #[test]
    fn valid_sessions_answer_every_request(
        opts in prop::collection::vec(opt_strategy(), 0..4),
        bs in any::<bool>(),
        cmds in prop::collection::vec(cmd_strategy(), 0..12),
        disc in any::<bool>(),
    ) {
        let (input, answered) = session(&opts, bs, &cmds, disc);
        let out = run(input);
        let handles = parse_output(&out).expect("server output must parse");
        let set: HashSet<u64> = handles.iter().copied().collect();
        prop_assert_eq!(handles.len(), answered);
        prop_assert_eq!(set, (0..answered as u64).collect::<HashSet<_>>());
    }

    #[test]
    fn mutated_sessions_never_panic(
        opts in prop::collection::vec(opt_strategy(), 0..3),
        bs in any::<bool>(),
        cmds in prop::collection::vec(cmd_strategy(), 0..8),
        muts in prop::collection::vec(mutation(), 1..4),
    ) {
        let (input, _) = session(&opts, bs, &cmds, true);
        run(mutate(input, &muts));
    }

    #[test]
    fn parsers_accept_any_bytes(b in prop::collection::vec(any::<u8>(), 0..64)) {
        let _ = parse_info_request(&b);
        let _ = parse_info(&b);
        let _ = parse_rep_server(&b);
        let _ = parse_error_chunk(&b);
        let _ = parse_reply_header(&b);
        if let Ok(a) = <[u8; REQUEST_LEN]>::try_from(b.get(..REQUEST_LEN).unwrap_or(&[])) {
            let _ = parse_request(&a);
        }
        if let Ok(a) = <[u8; OPTION_HEADER_LEN]>::try_from(b.get(..OPTION_HEADER_LEN).unwrap_or(&[])) {
            let _ = parse_option_header(&a);
        }
    }
}

// ---- regression cases -------------------------------------------------------

fn go_then(requests: &[u8]) -> Vec<u8> {
    let mut v = 3u32.to_be_bytes().to_vec();
    encode_option(&mut v, OPT_GO, &encode_info_request(b"disk", &[]));
    v.extend_from_slice(requests);
    v
}

fn req(typ: u16, flags: u16, offset: u64, length: u32) -> Vec<u8> {
    encode_request(&Request {
        flags,
        typ,
        handle: 1,
        offset,
        length,
    })
    .to_vec()
}

#[test]
fn regression_write_with_truncated_huge_payload() {
    run(go_then(&req(CMD_WRITE, 0, 0, u32::MAX)));
    run(go_then(&req(CMD_WRITE, 0, 0, 32 << 20)));
}

#[test]
fn regression_go_name_length_overflow() {
    let mut v = 3u32.to_be_bytes().to_vec();
    encode_option(&mut v, OPT_GO, &[0xff, 0xff, 0xff, 0xff, 0, 0]);
    let out = run(v);
    assert!(parse_output(&out).is_none()); // refused, never reached GO's ACK
}

#[test]
fn regression_unaligned_edges_at_end_of_export() {
    let last = EXPORT_SIZE as u64 - 1;
    let mut r = req(CMD_WRITE, 0, last, 1);
    r.push(0xaa);
    r.extend(req(CMD_READ, 0, last - 700, 701));
    r.extend(req(CMD_WRITE_ZEROES, 0, 3, EXPORT_SIZE as u32 - 3));
    r.extend(req(CMD_TRIM, 0, 1, 2));
    r.extend(req(CMD_CACHE, 0, last, 1));
    run(go_then(&r));
}

#[test]
fn regression_flags_on_every_command() {
    let mut r = Vec::new();
    for typ in 0..10u16 {
        if typ == CMD_DISC || typ == CMD_WRITE {
            continue;
        }
        r.extend(req(typ, 0xffff, 0, 512));
    }
    run(go_then(&r));
}

#[test]
fn regression_read_only_export_writes() {
    let mut v = 3u32.to_be_bytes().to_vec();
    encode_option(&mut v, OPT_GO, &encode_info_request(b"ro", &[]));
    v.extend(req(CMD_WRITE, 0, 0, 512));
    v.extend([0u8; 512]);
    v.extend(req(CMD_WRITE_ZEROES, 0, 0, 512));
    v.extend(req(CMD_READ, 0, 0, 512));
    let out = run(v);
    assert!(out.len() > GREETING_LEN);
}

#[test]
fn regression_options_after_transmission_bytes() {
    // Option magic where a request is expected: bad magic, connection ends.
    let mut o = Vec::new();
    encode_option(&mut o, OPT_LIST, &[]);
    run(go_then(&o));
}

//! Shared test fixtures: an in-memory export and a raw protocol client.
#![allow(dead_code)]

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use hybridcache_nbd::proto::*;
use hybridcache_nbd::{
    BlockSizes, Capabilities, Export, ExportError, ExportRegistry, ExportResult, Server,
    ServerConfig, ZeroFlags,
};
use parking_lot::RwLock;

/// A RAM disk: a Vec behind a RwLock, with counters and an optional slow
/// offset for reordering tests.
pub struct MemExport {
    pub data: RwLock<Vec<u8>>,
    pub caps: Capabilities,
    pub bs: BlockSizes,
    pub flushes: AtomicUsize,
    pub trims: AtomicUsize,
    /// Reads starting at this offset sleep first.
    pub slow_read: Option<(u64, Duration)>,
    /// Panic if an unaligned range reaches the export (the server must
    /// turn those into aligned read-modify-write).
    pub check_alignment: bool,
    /// Reads and writes of every n-th 4 KiB block sleep 2 ms.
    pub jitter_every: Option<u64>,
    /// Ask the server for read batches (`Export::batches_reads`), and the largest it sent.
    pub batching: bool,
    pub largest_batch: AtomicUsize,
    /// Ask for write batches (`Export::batches_writes`), and log what reaches the export in
    /// the order it does: `Batch(offsets)`, `Write(offset, fua)` for a single write, `Flush`.
    pub write_batching: bool,
    pub log: parking_lot::Mutex<Vec<Logged>>,
}

/// What reached a write-batching [`MemExport`], in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Logged {
    Batch(Vec<u64>),
    Write(u64, bool),
    Flush,
}

impl MemExport {
    pub fn new(size: usize) -> MemExport {
        MemExport {
            data: RwLock::new(vec![0; size]),
            caps: Capabilities {
                can_trim: true,
                can_fast_zero: true,
                can_cache: true,
                can_multi_conn: true,
                ..Capabilities::default()
            },
            bs: BlockSizes::default(),
            flushes: AtomicUsize::new(0),
            trims: AtomicUsize::new(0),
            slow_read: None,
            check_alignment: true,
            jitter_every: None,
            batching: false,
            largest_batch: AtomicUsize::new(0),
            write_batching: false,
            log: parking_lot::Mutex::new(Vec::new()),
        }
    }

    pub fn arc(self) -> Arc<MemExport> {
        Arc::new(self)
    }

    fn check(&self, offset: u64, len: u64) -> ExportResult<()> {
        let size = self.data.read().len() as u64;
        if offset + len > size {
            return Err(ExportError::invalid("out of range reached export"));
        }
        if let Some(n) = self.jitter_every {
            if (offset / 4096).is_multiple_of(n) {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        let min = u64::from(self.bs.min);
        if self.check_alignment && (!offset.is_multiple_of(min) || !len.is_multiple_of(min)) {
            panic!("unaligned request reached the export: {offset}+{len}");
        }
        Ok(())
    }
}

impl Export for MemExport {
    fn size(&self) -> u64 {
        self.data.read().len() as u64
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> ExportResult<()> {
        self.check(offset, buf.len() as u64)?;
        if let Some((slow, d)) = self.slow_read {
            if slow == offset {
                std::thread::sleep(d);
            }
        }
        let o = offset as usize;
        buf.copy_from_slice(&self.data.read()[o..o + buf.len()]);
        Ok(())
    }

    fn read_batch(&self, reqs: &mut [(&mut [u8], u64)]) -> Vec<ExportResult<()>> {
        self.largest_batch.fetch_max(reqs.len(), Ordering::SeqCst);
        reqs.iter_mut()
            .map(|(buf, offset)| self.read(buf, *offset))
            .collect()
    }

    fn batches_reads(&self) -> bool {
        self.batching
    }

    fn write_batch(&self, reqs: &[(&[u8], u64)]) -> Vec<ExportResult<()>> {
        // Logged before the writes: a concurrent flush must not seem to come between.
        let mut log = self.log.lock();
        log.push(Logged::Batch(reqs.iter().map(|r| r.1).collect()));
        reqs.iter()
            .map(|(buf, offset)| {
                self.check(offset.to_owned(), buf.len() as u64)?;
                let o = *offset as usize;
                self.data.write()[o..o + buf.len()].copy_from_slice(buf);
                Ok(())
            })
            .collect()
    }

    fn batches_writes(&self) -> bool {
        self.write_batching
    }

    fn write(&self, buf: &[u8], offset: u64, fua: bool) -> ExportResult<()> {
        if self.write_batching {
            self.log.lock().push(Logged::Write(offset, fua));
        }
        self.check(offset, buf.len() as u64)?;
        let o = offset as usize;
        self.data.write()[o..o + buf.len()].copy_from_slice(buf);
        Ok(())
    }

    fn flush(&self) -> ExportResult<()> {
        if self.write_batching {
            self.log.lock().push(Logged::Flush);
        }
        self.flushes.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64) -> ExportResult<()> {
        self.check(offset, len)?;
        self.trims.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64, flags: ZeroFlags) -> ExportResult<()> {
        self.check(offset, len)?;
        let _ = flags;
        let o = offset as usize;
        self.data.write()[o..o + len as usize].fill(0);
        Ok(())
    }

    fn block_sizes(&self) -> BlockSizes {
        self.bs
    }

    fn capabilities(&self) -> Capabilities {
        self.caps
    }
}

pub struct TestServer {
    pub server: Server,
    pub dir: tempfile::TempDir,
    pub sock: PathBuf,
}

pub fn start(exports: &[(&str, Arc<dyn Export>)]) -> TestServer {
    start_with(exports, ServerConfig::default())
}

pub fn start_with(exports: &[(&str, Arc<dyn Export>)], config: ServerConfig) -> TestServer {
    let reg = ExportRegistry::new();
    for (name, e) in exports {
        reg.add_with_description(name, &format!("test export {name}"), e.clone())
            .unwrap();
    }
    let server = Server::with_config(reg, config);
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("nbd.sock");
    server.serve_unix(&sock).unwrap();
    TestServer { server, dir, sock }
}

/// Speaks the protocol byte by byte, for pipelining and hostile input.
pub struct Raw {
    pub s: UnixStream,
    pub structured: bool,
}

pub fn opt_reply(s: &mut UnixStream) -> (OptionReplyHeader, Vec<u8>) {
    let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
    s.read_exact(&mut h).unwrap();
    let hdr = parse_option_reply_header(&h).unwrap();
    let mut p = vec![0u8; hdr.len as usize];
    s.read_exact(&mut p).unwrap();
    (hdr, p)
}

impl Raw {
    /// Connects and completes the greeting with fixed newstyle + no zeroes.
    pub fn connect(path: &Path) -> Raw {
        let mut s = UnixStream::connect(path).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut g = [0u8; GREETING_LEN];
        s.read_exact(&mut g).unwrap();
        let flags = parse_greeting(&g).unwrap();
        assert_eq!(flags, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        s.write_all(&(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES).to_be_bytes())
            .unwrap();
        Raw {
            s,
            structured: false,
        }
    }

    pub fn option(&mut self, option: u32, data: &[u8]) {
        let mut out = Vec::new();
        encode_option(&mut out, option, data);
        self.s.write_all(&out).unwrap();
    }

    pub fn reply(&mut self) -> (OptionReplyHeader, Vec<u8>) {
        opt_reply(&mut self.s)
    }

    pub fn structured(&mut self) {
        self.option(OPT_STRUCTURED_REPLY, &[]);
        assert_eq!(self.reply().0.reply, REP_ACK);
        self.structured = true;
    }

    /// NBD_OPT_GO; returns (size, transmission flags) or the error reply.
    pub fn go(&mut self, name: &str, items: &[u16]) -> Result<(u64, u16), u32> {
        self.option(OPT_GO, &encode_info_request(name.as_bytes(), items));
        let mut export = None;
        loop {
            let (h, p) = self.reply();
            match h.reply {
                REP_INFO => {
                    if let Info::Export { size, flags } = parse_info(&p).unwrap() {
                        export = Some((size, flags));
                    }
                }
                REP_ACK => return Ok(export.unwrap()),
                e => return Err(e),
            }
        }
    }

    pub fn request(&mut self, typ: u16, flags: u16, handle: u64, offset: u64, len: u32) {
        let r = encode_request(&Request {
            flags,
            typ,
            handle,
            offset,
            length: len,
        });
        self.s.write_all(&r).unwrap();
    }

    pub fn write_req(&mut self, handle: u64, offset: u64, data: &[u8]) {
        self.request(CMD_WRITE, 0, handle, offset, data.len() as u32);
        self.s.write_all(data).unwrap();
    }

    /// Reads one complete reply: (handle, error, data). `read_len` is the
    /// data length if the reply is a successful simple read reply.
    pub fn reply_for(&mut self, read_len: impl Fn(u64) -> usize) -> (u64, u32, Vec<u8>) {
        let mut hdr = [0u8; STRUCTURED_HEADER_LEN];
        self.s.read_exact(&mut hdr[..4]).unwrap();
        let rest = reply_header_rest_len(&[hdr[0], hdr[1], hdr[2], hdr[3]]).unwrap();
        self.s.read_exact(&mut hdr[4..4 + rest]).unwrap();
        match parse_reply_header(&hdr[..4 + rest]).unwrap() {
            ReplyHeader::Simple { error, handle } => {
                let mut data = vec![];
                if error == 0 {
                    data.resize(read_len(handle), 0);
                    self.s.read_exact(&mut data).unwrap();
                }
                (handle, error, data)
            }
            ReplyHeader::Structured {
                flags,
                typ,
                handle,
                length,
            } => {
                assert!(self.structured, "structured reply not negotiated");
                assert_ne!(flags & REPLY_FLAG_DONE, 0, "server sends one chunk");
                let mut p = vec![0u8; length as usize];
                self.s.read_exact(&mut p).unwrap();
                match typ {
                    REPLY_TYPE_OFFSET_DATA => (handle, 0, p[8..].to_vec()),
                    REPLY_TYPE_NONE => (handle, 0, vec![]),
                    REPLY_TYPE_ERROR => (handle, parse_error_chunk(&p).unwrap().0, vec![]),
                    t => panic!("unexpected chunk type {t}"),
                }
            }
        }
    }

    /// Reply to a request that carries no read data.
    pub fn status(&mut self) -> (u64, u32) {
        let (h, e, _) = self.reply_for(|_| 0);
        (h, e)
    }

    /// Whether the server has closed the connection (EOF within the timeout).
    pub fn closed_by_server(&mut self) -> bool {
        let mut b = [0u8; 64];
        loop {
            match self.s.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// The workspace's one skip rule (crates/testtools): fails in CI or with HC_REQUIRE_TOOLS=1
/// instead of letting a test pass without running.
#[allow(unused_imports)] // Each test binary uses a different subset.
pub use hybridcache_testtools::{have, need, skip, tools_required};

//! Serves a RAM disk over NBD, for trying clients and benchmarking.
//!
//! `cargo run --release -p hybridcache-nbd --example ram_server -- SOCKET [SIZE_MIB] [WORKERS]`
//! then e.g. `nbdinfo 'nbd+unix:///ram?socket=SOCKET'`. Runs until killed.

use std::sync::Arc;

use hybridcache_nbd::{
    Capabilities, Export, ExportRegistry, ExportResult, Server, ServerConfig, ZeroFlags,
};
use parking_lot::RwLock;

/// Memory split into independently locked shards so concurrent requests to
/// different areas do not contend.
struct Ram {
    shards: Vec<RwLock<Box<[u8]>>>,
    size: u64,
}

const SHARD: u64 = 1 << 20;

impl Ram {
    fn new(size: u64) -> Ram {
        let n = size.div_ceil(SHARD);
        Ram {
            shards: (0..n)
                .map(|_| RwLock::new(vec![0u8; SHARD as usize].into_boxed_slice()))
                .collect(),
            size,
        }
    }

    /// Calls `f(shard, offset_in_shard, range_in_request)` per shard touched.
    fn each(
        &self,
        offset: u64,
        len: u64,
        mut f: impl FnMut(&RwLock<Box<[u8]>>, usize, std::ops::Range<usize>),
    ) {
        let mut done = 0;
        while done < len {
            let off = offset + done;
            let within = off % SHARD;
            let n = (SHARD - within).min(len - done);
            f(
                &self.shards[(off / SHARD) as usize],
                within as usize,
                done as usize..(done + n) as usize,
            );
            done += n;
        }
    }
}

impl Export for Ram {
    fn size(&self) -> u64 {
        self.size
    }

    fn read(&self, buf: &mut [u8], offset: u64) -> ExportResult<()> {
        self.each(offset, buf.len() as u64, |s, at, r| {
            let n = r.len();
            buf[r].copy_from_slice(&s.read()[at..at + n]);
        });
        Ok(())
    }

    fn write(&self, buf: &[u8], offset: u64, _fua: bool) -> ExportResult<()> {
        self.each(offset, buf.len() as u64, |s, at, r| {
            let n = r.len();
            s.write()[at..at + n].copy_from_slice(&buf[r]);
        });
        Ok(())
    }

    fn trim(&self, offset: u64, len: u64) -> ExportResult<()> {
        self.write_zeroes(offset, len, ZeroFlags::default())
    }

    fn write_zeroes(&self, offset: u64, len: u64, _flags: ZeroFlags) -> ExportResult<()> {
        self.each(offset, len, |s, at, r| s.write()[at..at + r.len()].fill(0));
        Ok(())
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            can_trim: true,
            can_fast_zero: true,
            can_cache: true,
            can_multi_conn: true,
            ..Capabilities::default()
        }
    }
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(sock) = args.get(1) else {
        eprintln!("usage: ram_server SOCKET [SIZE_MIB] [WORKERS]");
        std::process::exit(2);
    };
    let mib: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(1024);
    let workers: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(4);
    // Refused connections and dropped clients are logged to stderr.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let reg = ExportRegistry::new();
    reg.add_with_description("ram", "RAM disk", Arc::new(Ram::new(mib << 20)))
        .expect("register export");
    reg.set_default(Some("ram"));
    let server = Server::with_config(
        reg,
        ServerConfig {
            workers_per_connection: workers,
            ..ServerConfig::default()
        },
    );
    server.serve_unix(sock).expect("listen");
    eprintln!("serving {mib} MiB as 'ram' on {sock}");
    loop {
        std::thread::park();
    }
}

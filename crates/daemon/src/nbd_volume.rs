//! A remote NBD export as a [`Volume`], so a network volume can be a core (or a cache) device.
//!
//! The nbd crate's client runs one request at a time, so the volume keeps a small pool of
//! connections and each request takes whichever is free; that gives the engine's threads
//! parallelism against the remote server. Requests larger than the server's maximum block size are
//! split. Flush goes to one connection when the server promises multi-conn consistency and to
//! every connection otherwise (only then are all connections' completed writes covered).

use std::sync::atomic::{AtomicUsize, Ordering};

use hybridcache_nbd::proto::{FLAG_SEND_TRIM, FLAG_SEND_WRITE_ZEROES};
use hybridcache_nbd::{Client, ClientConfig, ClientError};
use hybridcache_volume::{check_range, ErrorKind, Op, Result, Volume, VolumeError};
use parking_lot::Mutex;

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

/// A remote NBD export used as a block device.
pub struct NbdVolume {
    name: String,
    size: u64,
    max: u64,
    min: u32,
    multi_conn: bool,
    can_trim: bool,
    can_zero: bool,
    conns: Vec<Mutex<Client>>,
    next: AtomicUsize,
}

fn connect(target: &NbdTarget) -> std::result::Result<Client, ClientError> {
    match target {
        NbdTarget::Unix { socket, export } => {
            Client::connect_unix_with(socket, &ClientConfig::new(export))
        }
        NbdTarget::Tcp { host, port, export } => {
            Client::connect_tcp_with((host.as_str(), *port), &ClientConfig::new(export))
        }
    }
}

impl NbdVolume {
    /// Connect to the export a URI names.
    pub fn open(uri: &str) -> Result<NbdVolume> {
        let invalid = |msg: String| VolumeError::new(uri, Op::Open, 0, 0, ErrorKind::Invalid(msg));
        let target = parse_nbd_uri(uri).map_err(invalid)?;
        let mut conns = Vec::with_capacity(POOL);
        for _ in 0..POOL {
            let c = connect(&target)
                .map_err(|e| invalid(format!("cannot connect to NBD export '{uri}': {e}")))?;
            conns.push(c);
        }
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
        Ok(NbdVolume {
            name: uri.to_string(),
            size,
            max,
            min,
            multi_conn,
            can_trim,
            can_zero,
            conns: conns.into_iter().map(Mutex::new).collect(),
            next: AtomicUsize::new(0),
        })
    }

    /// Run `f` on a free connection, or wait for the next one in turn when all are busy.
    fn with_conn<T>(&self, f: impl FnOnce(&mut Client) -> T) -> T {
        for c in &self.conns {
            if let Some(mut g) = c.try_lock() {
                return f(&mut g);
            }
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.conns.len();
        f(&mut self.conns[i].lock())
    }

    fn err(&self, op: Op, offset: u64, len: u64, e: ClientError) -> VolumeError {
        let io = std::io::Error::other(e.to_string());
        VolumeError::new(&self.name, op, offset, len, ErrorKind::Io(io))
    }

    /// Split `[offset, offset+len)` into pieces of at most the server's maximum request.
    fn pieces(&self, offset: u64, len: u64) -> impl Iterator<Item = (u64, u64)> + '_ {
        let max = self.max;
        (0..len.div_ceil(max)).map(move |i| {
            let start = i * max;
            (offset + start, (len - start).min(max))
        })
    }
}

impl Volume for NbdVolume {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn logical_block_size(&self) -> u32 {
        self.min
    }

    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        check_range(self, Op::Read, offset, buf.len() as u64)?;
        for (off, n) in self.pieces(offset, buf.len() as u64) {
            let at = (off - offset) as usize;
            let piece = &mut buf[at..at + n as usize];
            self.with_conn(|c| c.read(piece, off))
                .map_err(|e| self.err(Op::Read, off, n, e))?;
        }
        Ok(())
    }

    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        check_range(self, Op::Write, offset, buf.len() as u64)?;
        for (off, n) in self.pieces(offset, buf.len() as u64) {
            let at = (off - offset) as usize;
            let piece = &buf[at..at + n as usize];
            self.with_conn(|c| c.write(piece, off, false))
                .map_err(|e| self.err(Op::Write, off, n, e))?;
        }
        Ok(())
    }

    fn flush(&self) -> Result<()> {
        if self.multi_conn {
            return self
                .with_conn(|c| c.flush())
                .map_err(|e| self.err(Op::Flush, 0, 0, e));
        }
        for c in &self.conns {
            c.lock().flush().map_err(|e| self.err(Op::Flush, 0, 0, e))?;
        }
        Ok(())
    }

    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self, Op::Discard, offset, len)?;
        if !self.can_trim {
            // Discard is a hint; a server without trim keeps the data, which is allowed.
            return Ok(());
        }
        for (off, n) in self.pieces(offset, len) {
            self.with_conn(|c| c.trim(off, n as u32))
                .map_err(|e| self.err(Op::Discard, off, n, e))?;
        }
        Ok(())
    }

    fn write_zeroes(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self, Op::WriteZeroes, offset, len)?;
        if !self.can_zero {
            return hybridcache_volume::write_zeroes_by_writing(self, offset, len);
        }
        for (off, n) in self.pieces(offset, len) {
            self.with_conn(|c| c.write_zeroes(off, n as u32, false, false))
                .map_err(|e| self.err(Op::WriteZeroes, off, n, e))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

//! A small synchronous NBD client: fixed-newstyle handshake with `NBD_OPT_GO`
//! (falling back to `NBD_OPT_EXPORT_NAME`), optional structured replies, and
//! one request at a time. Open several `Client`s for parallelism.

use std::io::{self, Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::Path;

use crate::export::{BlockSizes, ErrorKind};
use crate::proto::{self, *};

/// Replies whose payload the client must buffer (option replies, error
/// chunks) are refused above this size instead of allocating what a broken
/// server claims.
const MAX_REPLY_PAYLOAD: u32 = 1 << 20;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    #[error("protocol error: {0}")]
    Protocol(String),
    #[error("server refused option {option}: reply {reply:#x}{}", said(.message))]
    OptionRefused {
        option: u32,
        reply: u32,
        message: String,
    },
    #[error("server error {errno} ({kind}){}", said(.message))]
    Server {
        errno: u32,
        kind: ErrorKind,
        message: String,
    },
}

/// What the server said about an error, after what the error is: many servers (nbdkit, and
/// every simple reply) send none, and a bare ": " would look like a message lost on the way.
fn said(message: &str) -> String {
    if message.is_empty() {
        ", no message from the server".to_string()
    } else {
        format!(": {message}")
    }
}

impl ClientError {
    /// The export-level error class, for callers that re-export the remote
    /// device; transport and protocol failures count as I/O errors.
    pub fn kind(&self) -> ErrorKind {
        match self {
            ClientError::Server { kind, .. } => *kind,
            _ => ErrorKind::Io,
        }
    }
}

impl From<ProtoError> for ClientError {
    fn from(e: ProtoError) -> Self {
        ClientError::Protocol(e.to_string())
    }
}

pub type ClientResult<T> = Result<T, ClientError>;

/// Handshake choices.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    pub export_name: String,
    /// Negotiate `NBD_OPT_STRUCTURED_REPLY`. Default true.
    pub structured_replies: bool,
    /// Ask for `NBD_INFO_BLOCK_SIZE`, promising to honour the constraints.
    /// Default true.
    pub request_block_size: bool,
}

impl ClientConfig {
    pub fn new(export_name: &str) -> Self {
        ClientConfig {
            export_name: export_name.to_string(),
            structured_replies: true,
            request_block_size: true,
        }
    }
}

/// Anything a client can talk over.
pub trait Transport: Read + Write + Send {}
impl<T: Read + Write + Send> Transport for T {}

/// A connection in transmission phase.
pub struct Client {
    stream: Box<dyn Transport>,
    size: u64,
    flags: u16,
    block_sizes: Option<BlockSizes>,
    structured: bool,
    next_handle: u64,
    buf: Vec<u8>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("size", &self.size)
            .field("flags", &self.flags)
            .field("block_sizes", &self.block_sizes)
            .field("structured", &self.structured)
            .finish()
    }
}

/// Reads the greeting and answers with client flags; returns whether
/// `NO_ZEROES` was agreed.
fn read_greeting(s: &mut dyn Transport) -> ClientResult<bool> {
    let mut g = [0u8; GREETING_LEN];
    s.read_exact(&mut g)?;
    let flags = parse_greeting(&g)?;
    if flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(ClientError::Protocol(
            "server does not support fixed newstyle".into(),
        ));
    }
    let mut cf = FLAG_C_FIXED_NEWSTYLE;
    if flags & FLAG_NO_ZEROES != 0 {
        cf |= FLAG_C_NO_ZEROES;
    }
    s.write_all(&cf.to_be_bytes())?;
    Ok(cf & FLAG_C_NO_ZEROES != 0)
}

fn send_option(s: &mut dyn Transport, option: u32, data: &[u8]) -> ClientResult<()> {
    let mut out = Vec::with_capacity(OPTION_HEADER_LEN + data.len());
    encode_option(&mut out, option, data);
    s.write_all(&out)?;
    Ok(())
}

fn read_option_reply(
    s: &mut dyn Transport,
    option: u32,
) -> ClientResult<(OptionReplyHeader, Vec<u8>)> {
    let mut h = [0u8; OPTION_REPLY_HEADER_LEN];
    s.read_exact(&mut h)?;
    let hdr = parse_option_reply_header(&h)?;
    if hdr.option != option {
        return Err(ClientError::Protocol(format!(
            "reply for option {} while waiting for {option}",
            hdr.option
        )));
    }
    if hdr.len > MAX_REPLY_PAYLOAD {
        return Err(ClientError::Protocol("option reply too large".into()));
    }
    let mut payload = vec![0u8; hdr.len as usize];
    s.read_exact(&mut payload)?;
    Ok((hdr, payload))
}

fn refused(hdr: &OptionReplyHeader, payload: &[u8]) -> ClientError {
    ClientError::OptionRefused {
        option: hdr.option,
        reply: hdr.reply,
        message: String::from_utf8_lossy(payload).into_owned(),
    }
}

impl Client {
    pub fn connect_unix(path: impl AsRef<Path>, export_name: &str) -> ClientResult<Client> {
        Self::connect_unix_with(path, &ClientConfig::new(export_name))
    }

    pub fn connect_unix_with(path: impl AsRef<Path>, cfg: &ClientConfig) -> ClientResult<Client> {
        let s = UnixStream::connect(path)?;
        Self::handshake(Box::new(s), cfg)
    }

    pub fn connect_tcp(addr: impl ToSocketAddrs, export_name: &str) -> ClientResult<Client> {
        Self::connect_tcp_with(addr, &ClientConfig::new(export_name))
    }

    pub fn connect_tcp_with(addr: impl ToSocketAddrs, cfg: &ClientConfig) -> ClientResult<Client> {
        let s = TcpStream::connect(addr)?;
        s.set_nodelay(true)?;
        Self::handshake(Box::new(s), cfg)
    }

    /// Runs the handshake over an already-connected stream.
    pub fn handshake(mut s: Box<dyn Transport>, cfg: &ClientConfig) -> ClientResult<Client> {
        let no_zeroes = read_greeting(&mut *s)?;
        let mut structured = false;
        if cfg.structured_replies {
            send_option(&mut *s, OPT_STRUCTURED_REPLY, &[])?;
            let (hdr, payload) = read_option_reply(&mut *s, OPT_STRUCTURED_REPLY)?;
            match hdr.reply {
                REP_ACK => structured = true,
                r if is_rep_error(r) => {}
                _ => return Err(refused(&hdr, &payload)),
            }
        }
        let items: &[u16] = if cfg.request_block_size {
            &[INFO_BLOCK_SIZE]
        } else {
            &[]
        };
        let data = encode_info_request(cfg.export_name.as_bytes(), items);
        send_option(&mut *s, OPT_GO, &data)?;
        let mut export = None;
        let mut block_sizes = None;
        loop {
            let (hdr, payload) = read_option_reply(&mut *s, OPT_GO)?;
            match hdr.reply {
                REP_INFO => match parse_info(&payload)? {
                    Info::Export { size, flags } => export = Some((size, flags)),
                    Info::BlockSize {
                        min,
                        preferred,
                        max,
                    } => {
                        block_sizes = Some(BlockSizes {
                            min,
                            preferred,
                            max,
                        })
                    }
                    _ => {}
                },
                REP_ACK => break,
                REP_ERR_UNSUP => return Self::export_name_fallback(s, cfg, structured, no_zeroes),
                _ => return Err(refused(&hdr, &payload)),
            }
        }
        let (size, flags) = export
            .ok_or_else(|| ClientError::Protocol("GO succeeded without INFO_EXPORT".into()))?;
        Ok(Client {
            stream: s,
            size,
            flags,
            block_sizes,
            structured,
            next_handle: 1,
            buf: Vec::new(),
        })
    }

    fn export_name_fallback(
        mut s: Box<dyn Transport>,
        cfg: &ClientConfig,
        structured: bool,
        no_zeroes: bool,
    ) -> ClientResult<Client> {
        send_option(&mut *s, OPT_EXPORT_NAME, cfg.export_name.as_bytes())?;
        let mut b = [0u8; EXPORT_NAME_REPLY_LEN + EXPORT_NAME_ZEROES];
        let n = if no_zeroes {
            EXPORT_NAME_REPLY_LEN
        } else {
            b.len()
        };
        s.read_exact(&mut b[..n])?;
        let size = parse_u64(&b)?;
        let flags = u16::from_be_bytes([b[8], b[9]]);
        Ok(Client {
            stream: s,
            size,
            flags,
            block_sizes: None,
            structured,
            next_handle: 1,
            buf: Vec::new(),
        })
    }

    /// Lists a server's exports as (name, description) and aborts the
    /// session.
    pub fn list_exports(mut s: Box<dyn Transport>) -> ClientResult<Vec<(String, String)>> {
        read_greeting(&mut *s)?;
        send_option(&mut *s, OPT_LIST, &[])?;
        let mut out = Vec::new();
        loop {
            let (hdr, payload) = read_option_reply(&mut *s, OPT_LIST)?;
            match hdr.reply {
                REP_SERVER => {
                    let (n, d) = parse_rep_server(&payload)?;
                    out.push((
                        String::from_utf8_lossy(n).into_owned(),
                        String::from_utf8_lossy(d).into_owned(),
                    ));
                }
                REP_ACK => break,
                _ => return Err(refused(&hdr, &payload)),
            }
        }
        send_option(&mut *s, OPT_ABORT, &[])?;
        // The ACK to ABORT is optional per spec; ignore whether it comes.
        let _ = read_option_reply(&mut *s, OPT_ABORT);
        Ok(out)
    }

    pub fn list_exports_unix(path: impl AsRef<Path>) -> ClientResult<Vec<(String, String)>> {
        Self::list_exports(Box::new(UnixStream::connect(path)?))
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    /// Transmission flags as sent by the server.
    pub fn flags(&self) -> u16 {
        self.flags
    }

    pub fn block_sizes(&self) -> Option<BlockSizes> {
        self.block_sizes
    }

    pub fn structured_replies(&self) -> bool {
        self.structured
    }

    pub fn is_read_only(&self) -> bool {
        self.flags & FLAG_READ_ONLY != 0
    }

    pub fn can_multi_conn(&self) -> bool {
        self.flags & FLAG_CAN_MULTI_CONN != 0
    }

    pub fn read(&mut self, buf: &mut [u8], offset: u64) -> ClientResult<()> {
        let len =
            u32::try_from(buf.len()).map_err(|_| ClientError::Protocol("read too large".into()))?;
        let handle = self.send_request(CMD_READ, 0, offset, len, None)?;
        self.receive(handle, offset, Some(buf))
    }

    pub fn write(&mut self, buf: &[u8], offset: u64, fua: bool) -> ClientResult<()> {
        let len = u32::try_from(buf.len())
            .map_err(|_| ClientError::Protocol("write too large".into()))?;
        let flags = if fua { CMD_FLAG_FUA } else { 0 };
        let handle = self.send_request(CMD_WRITE, flags, offset, len, Some(buf))?;
        self.receive(handle, offset, None)
    }

    pub fn flush(&mut self) -> ClientResult<()> {
        self.simple_command(CMD_FLUSH, 0, 0, 0)
    }

    pub fn trim(&mut self, offset: u64, len: u32) -> ClientResult<()> {
        self.simple_command(CMD_TRIM, 0, offset, len)
    }

    pub fn write_zeroes(
        &mut self,
        offset: u64,
        len: u32,
        no_hole: bool,
        fast_zero: bool,
    ) -> ClientResult<()> {
        let mut flags = 0;
        if no_hole {
            flags |= CMD_FLAG_NO_HOLE;
        }
        if fast_zero {
            flags |= CMD_FLAG_FAST_ZERO;
        }
        self.simple_command(CMD_WRITE_ZEROES, flags, offset, len)
    }

    pub fn cache(&mut self, offset: u64, len: u32) -> ClientResult<()> {
        self.simple_command(CMD_CACHE, 0, offset, len)
    }

    /// Sends any command without payload and waits for its reply; for tests
    /// that need unusual flags or command types.
    pub fn simple_command(
        &mut self,
        typ: u16,
        flags: u16,
        offset: u64,
        len: u32,
    ) -> ClientResult<()> {
        let handle = self.send_request(typ, flags, offset, len, None)?;
        self.receive(handle, offset, None)
    }

    /// Soft disconnect (`NBD_CMD_DISC`).
    pub fn disconnect(mut self) -> ClientResult<()> {
        self.send_request(CMD_DISC, 0, 0, 0, None)?;
        Ok(())
    }

    fn send_request(
        &mut self,
        typ: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: Option<&[u8]>,
    ) -> ClientResult<u64> {
        let handle = self.next_handle;
        self.next_handle = self.next_handle.wrapping_add(1);
        let hdr = encode_request(&Request {
            flags,
            typ,
            handle,
            offset,
            length,
        });
        self.buf.clear();
        self.buf.extend_from_slice(&hdr);
        if let Some(p) = payload {
            self.buf.extend_from_slice(p);
        }
        self.stream.write_all(&self.buf)?;
        self.stream.flush()?;
        Ok(handle)
    }

    /// Reads the complete reply to `handle`. `out` is the read destination
    /// for `NBD_CMD_READ`, whose request started at `offset`.
    fn receive(
        &mut self,
        handle: u64,
        offset: u64,
        mut out: Option<&mut [u8]>,
    ) -> ClientResult<()> {
        let mut hdr = [0u8; STRUCTURED_HEADER_LEN];
        let mut error: Option<(u32, String)> = None;
        let mut covered: u64 = 0;
        loop {
            self.stream.read_exact(&mut hdr[..4])?;
            let magic: [u8; 4] = [hdr[0], hdr[1], hdr[2], hdr[3]];
            let rest = reply_header_rest_len(&magic)?;
            self.stream.read_exact(&mut hdr[4..4 + rest])?;
            match parse_reply_header(&hdr[..4 + rest])? {
                ReplyHeader::Simple {
                    error: e,
                    handle: h,
                } => {
                    if h != handle {
                        return Err(ClientError::Protocol("reply for unknown handle".into()));
                    }
                    if e != 0 {
                        return Err(server_error(e, String::new()));
                    }
                    if let Some(buf) = out {
                        self.stream.read_exact(buf)?;
                    }
                    return Ok(());
                }
                ReplyHeader::Structured {
                    flags,
                    typ,
                    handle: h,
                    length,
                } => {
                    if !self.structured {
                        return Err(ClientError::Protocol(
                            "unnegotiated structured reply".into(),
                        ));
                    }
                    if h != handle {
                        return Err(ClientError::Protocol("reply for unknown handle".into()));
                    }
                    self.read_chunk(typ, length, offset, &mut out, &mut error, &mut covered)?;
                    if flags & REPLY_FLAG_DONE != 0 {
                        break;
                    }
                }
            }
        }
        if let Some((errno, msg)) = error {
            return Err(server_error(errno, msg));
        }
        if let Some(buf) = out {
            if covered != buf.len() as u64 {
                return Err(ClientError::Protocol(
                    "read reply did not cover request".into(),
                ));
            }
        }
        Ok(())
    }

    fn read_chunk(
        &mut self,
        typ: u16,
        length: u32,
        offset: u64,
        out: &mut Option<&mut [u8]>,
        error: &mut Option<(u32, String)>,
        covered: &mut u64,
    ) -> ClientResult<()> {
        match typ {
            REPLY_TYPE_NONE if length == 0 => Ok(()),
            REPLY_TYPE_OFFSET_DATA | REPLY_TYPE_OFFSET_HOLE => {
                let Some(buf) = out.as_deref_mut() else {
                    return Err(ClientError::Protocol("data chunk for non-read".into()));
                };
                if length < 8 + u32::from(typ == REPLY_TYPE_OFFSET_DATA) {
                    return Err(ClientError::Protocol("short data chunk".into()));
                }
                let mut ob = [0u8; 8];
                self.stream.read_exact(&mut ob)?;
                let chunk_off = u64::from_be_bytes(ob);
                let n = if typ == REPLY_TYPE_OFFSET_DATA {
                    u64::from(length - 8)
                } else {
                    if length != 12 {
                        return Err(ClientError::Protocol("bad hole chunk".into()));
                    }
                    let mut lb = [0u8; 4];
                    self.stream.read_exact(&mut lb)?;
                    u64::from(u32::from_be_bytes(lb))
                };
                let start = chunk_off
                    .checked_sub(offset)
                    .filter(|s| s.checked_add(n).is_some_and(|e| e <= buf.len() as u64))
                    .ok_or_else(|| ClientError::Protocol("chunk outside request".into()))?
                    as usize;
                let dst = &mut buf[start..start + n as usize];
                if typ == REPLY_TYPE_OFFSET_DATA {
                    self.stream.read_exact(dst)?;
                } else {
                    dst.fill(0);
                }
                *covered += n;
                Ok(())
            }
            t if proto::is_error_chunk(t) => {
                if length > MAX_REPLY_PAYLOAD {
                    return Err(ClientError::Protocol("error chunk too large".into()));
                }
                let mut p = vec![0u8; length as usize];
                self.stream.read_exact(&mut p)?;
                let (errno, msg) = parse_error_chunk(&p)?;
                if error.is_none() {
                    *error = Some((errno, String::from_utf8_lossy(msg).into_owned()));
                }
                Ok(())
            }
            _ => Err(ClientError::Protocol(format!(
                "unexpected chunk type {typ}"
            ))),
        }
    }
}

fn server_error(errno: u32, message: String) -> ClientError {
    ClientError::Server {
        errno,
        kind: ErrorKind::from_nbd_errno(errno),
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn errors_without_a_message_say_so() {
        let e = server_error(EIO, String::new()).to_string();
        assert_eq!(e, "server error 5 (I/O error), no message from the server");
        let e = server_error(EIO, "disk on fire".into()).to_string();
        assert_eq!(e, "server error 5 (I/O error): disk on fire");
        let refused = |message: &str| {
            ClientError::OptionRefused {
                option: OPT_GO,
                reply: REP_ERR_UNKNOWN,
                message: message.into(),
            }
            .to_string()
        };
        assert_eq!(
            refused(""),
            "server refused option 7: reply 0x80000006, no message from the server"
        );
        assert_eq!(
            refused("no such export"),
            "server refused option 7: reply 0x80000006: no such export"
        );
    }
}

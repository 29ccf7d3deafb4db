//! NBD wire format: constants and pure parse/encode functions over byte
//! slices.
//!
//! Nothing here does I/O, so every parser can be fed arbitrary bytes by the
//! fuzz tests; the server and client modules only move bytes between sockets
//! and these functions. All integers on the wire are big-endian.

use std::fmt;

// ---- magics ---------------------------------------------------------------

/// `NBDMAGIC`, first 8 bytes of the server greeting.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`, in the greeting and at the start of every option request.
pub const IHAVEOPT: u64 = 0x4948_4156_454f_5054;
/// Magic of every fixed-newstyle option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

// ---- handshake flags ------------------------------------------------------

pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

// ---- transmission flags ---------------------------------------------------

pub const FLAG_HAS_FLAGS: u16 = 1 << 0;
pub const FLAG_READ_ONLY: u16 = 1 << 1;
pub const FLAG_SEND_FLUSH: u16 = 1 << 2;
pub const FLAG_SEND_FUA: u16 = 1 << 3;
pub const FLAG_ROTATIONAL: u16 = 1 << 4;
pub const FLAG_SEND_TRIM: u16 = 1 << 5;
pub const FLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const FLAG_SEND_DF: u16 = 1 << 7;
pub const FLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const FLAG_SEND_RESIZE: u16 = 1 << 9;
pub const FLAG_SEND_CACHE: u16 = 1 << 10;
pub const FLAG_SEND_FAST_ZERO: u16 = 1 << 11;

// ---- options --------------------------------------------------------------

pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_PEEK_EXPORT: u32 = 4;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;
pub const OPT_EXTENDED_HEADERS: u32 = 11;

pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
const REP_ERR: u32 = 1 << 31;
pub const REP_ERR_UNSUP: u32 = REP_ERR + 1;
pub const REP_ERR_POLICY: u32 = REP_ERR + 2;
pub const REP_ERR_INVALID: u32 = REP_ERR + 3;
pub const REP_ERR_PLATFORM: u32 = REP_ERR + 4;
pub const REP_ERR_TLS_REQD: u32 = REP_ERR + 5;
pub const REP_ERR_UNKNOWN: u32 = REP_ERR + 6;
pub const REP_ERR_SHUTDOWN: u32 = REP_ERR + 7;
pub const REP_ERR_BLOCK_SIZE_REQD: u32 = REP_ERR + 8;
pub const REP_ERR_TOO_BIG: u32 = REP_ERR + 9;

/// True for option reply types that end an option with an error.
pub fn is_rep_error(reply: u32) -> bool {
    reply & REP_ERR != 0
}

pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

// ---- transmission ---------------------------------------------------------

pub const CMD_READ: u16 = 0;
pub const CMD_WRITE: u16 = 1;
pub const CMD_DISC: u16 = 2;
pub const CMD_FLUSH: u16 = 3;
pub const CMD_TRIM: u16 = 4;
pub const CMD_CACHE: u16 = 5;
pub const CMD_WRITE_ZEROES: u16 = 6;
pub const CMD_BLOCK_STATUS: u16 = 7;

pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

pub const REPLY_FLAG_DONE: u16 = 1 << 0;

pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;
pub const REPLY_TYPE_ERROR_OFFSET: u16 = (1 << 15) + 2;

/// True for structured reply chunk types in the error category.
pub fn is_error_chunk(typ: u16) -> bool {
    typ & (1 << 15) != 0
}

// ---- error values ---------------------------------------------------------

pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

// ---- sizes ----------------------------------------------------------------

/// Server greeting: NBDMAGIC, IHAVEOPT, handshake flags.
pub const GREETING_LEN: usize = 18;
pub const OPTION_HEADER_LEN: usize = 16;
pub const OPTION_REPLY_HEADER_LEN: usize = 20;
pub const REQUEST_LEN: usize = 28;
pub const SIMPLE_REPLY_LEN: usize = 16;
pub const STRUCTURED_HEADER_LEN: usize = 20;
/// Reply to `NBD_OPT_EXPORT_NAME` without the 124 trailing zero bytes.
pub const EXPORT_NAME_REPLY_LEN: usize = 10;
pub const EXPORT_NAME_ZEROES: usize = 124;
/// Longest string (export name, description, message) the spec allows.
pub const MAX_STRING_LEN: usize = 4096;

/// Why bytes could not be parsed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProtoError {
    BadMagic,
    UnknownClientFlags(u32),
    Malformed(&'static str),
}

impl fmt::Display for ProtoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ProtoError::BadMagic => f.write_str("bad magic"),
            ProtoError::UnknownClientFlags(v) => write!(f, "unknown client flags {v:#x}"),
            ProtoError::Malformed(what) => write!(f, "malformed message: {what}"),
        }
    }
}

impl std::error::Error for ProtoError {}

// Fixed-size big-endian readers; the callers pass arrays, so no bounds can fail.
fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

// ---- handshake: server side -------------------------------------------------

/// The newstyle greeting a server sends first.
pub fn encode_greeting(handshake_flags: u16) -> [u8; GREETING_LEN] {
    let mut b = [0u8; GREETING_LEN];
    b[0..8].copy_from_slice(&NBDMAGIC.to_be_bytes());
    b[8..16].copy_from_slice(&IHAVEOPT.to_be_bytes());
    b[16..18].copy_from_slice(&handshake_flags.to_be_bytes());
    b
}

/// Parses the server greeting (client side); returns the handshake flags.
pub fn parse_greeting(b: &[u8; GREETING_LEN]) -> Result<u16, ProtoError> {
    if be64(b, 0) != NBDMAGIC || be64(b, 8) != IHAVEOPT {
        return Err(ProtoError::BadMagic);
    }
    Ok(be16(b, 16))
}

/// Client flags after the greeting; unknown bits (or bits the server did
/// not offer) are an error because the spec says the server must then drop
/// the connection.
pub fn parse_client_flags(b: &[u8; 4], offered: u16) -> Result<u32, ProtoError> {
    let flags = u32::from_be_bytes(*b);
    let mut allowed = 0;
    if offered & FLAG_FIXED_NEWSTYLE != 0 {
        allowed |= FLAG_C_FIXED_NEWSTYLE;
    }
    if offered & FLAG_NO_ZEROES != 0 {
        allowed |= FLAG_C_NO_ZEROES;
    }
    if flags & !allowed != 0 {
        return Err(ProtoError::UnknownClientFlags(flags));
    }
    Ok(flags)
}

/// An option request header; `len` bytes of data follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionHeader {
    pub option: u32,
    pub len: u32,
}

pub fn parse_option_header(b: &[u8; OPTION_HEADER_LEN]) -> Result<OptionHeader, ProtoError> {
    if be64(b, 0) != IHAVEOPT {
        return Err(ProtoError::BadMagic);
    }
    Ok(OptionHeader {
        option: be32(b, 8),
        len: be32(b, 12),
    })
}

/// Client side: appends an option request (header and data) to `out`.
pub fn encode_option(out: &mut Vec<u8>, option: u32, data: &[u8]) {
    out.extend_from_slice(&IHAVEOPT.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    out.extend_from_slice(data);
}

/// Appends one fixed-newstyle option reply to `out`.
pub fn encode_option_reply(out: &mut Vec<u8>, option: u32, reply: u32, payload: &[u8]) {
    out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&option.to_be_bytes());
    out.extend_from_slice(&reply.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
}

/// Header of an option reply (client side); `len` bytes of payload follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OptionReplyHeader {
    pub option: u32,
    pub reply: u32,
    pub len: u32,
}

pub fn parse_option_reply_header(
    b: &[u8; OPTION_REPLY_HEADER_LEN],
) -> Result<OptionReplyHeader, ProtoError> {
    if be64(b, 0) != OPT_REPLY_MAGIC {
        return Err(ProtoError::BadMagic);
    }
    Ok(OptionReplyHeader {
        option: be32(b, 8),
        reply: be32(b, 12),
        len: be32(b, 16),
    })
}

/// The data of an `NBD_OPT_INFO` / `NBD_OPT_GO` request, borrowed from the
/// option payload.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InfoRequest<'a> {
    pub name: &'a [u8],
    /// `2 * n` bytes of information request codes.
    raw_items: &'a [u8],
}

impl<'a> InfoRequest<'a> {
    /// The information types the client asked for.
    pub fn items(&self) -> impl Iterator<Item = u16> + 'a {
        self.raw_items
            .chunks_exact(2)
            .map(|c| u16::from_be_bytes([c[0], c[1]]))
    }

    pub fn wants(&self, info: u16) -> bool {
        self.items().any(|i| i == info)
    }
}

/// Parses INFO/GO data: name length, name, item count, items. The lengths
/// must add up exactly, as the spec requires.
pub fn parse_info_request(data: &[u8]) -> Result<InfoRequest<'_>, ProtoError> {
    if data.len() < 6 {
        return Err(ProtoError::Malformed("INFO/GO data too short"));
    }
    let name_len = be32(data, 0) as usize;
    if name_len > data.len() - 6 {
        return Err(ProtoError::Malformed("INFO/GO name length exceeds data"));
    }
    if name_len > MAX_STRING_LEN {
        return Err(ProtoError::Malformed("export name too long"));
    }
    let name = &data[4..4 + name_len];
    let count = be16(data, 4 + name_len) as usize;
    let items = &data[6 + name_len..];
    if items.len() != count * 2 {
        return Err(ProtoError::Malformed("INFO/GO item count mismatch"));
    }
    Ok(InfoRequest {
        name,
        raw_items: items,
    })
}

/// Client side: INFO/GO option data.
pub fn encode_info_request(name: &[u8], items: &[u16]) -> Vec<u8> {
    let mut out = Vec::with_capacity(6 + name.len() + 2 * items.len());
    out.extend_from_slice(&(name.len() as u32).to_be_bytes());
    out.extend_from_slice(name);
    out.extend_from_slice(&(items.len() as u16).to_be_bytes());
    for i in items {
        out.extend_from_slice(&i.to_be_bytes());
    }
    out
}

/// `NBD_INFO_EXPORT` payload.
pub fn encode_info_export(size: u64, flags: u16) -> [u8; 12] {
    let mut b = [0u8; 12];
    b[0..2].copy_from_slice(&INFO_EXPORT.to_be_bytes());
    b[2..10].copy_from_slice(&size.to_be_bytes());
    b[10..12].copy_from_slice(&flags.to_be_bytes());
    b
}

/// `NBD_INFO_BLOCK_SIZE` payload.
pub fn encode_info_block_size(min: u32, preferred: u32, max: u32) -> [u8; 14] {
    let mut b = [0u8; 14];
    b[0..2].copy_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    b[2..6].copy_from_slice(&min.to_be_bytes());
    b[6..10].copy_from_slice(&preferred.to_be_bytes());
    b[10..14].copy_from_slice(&max.to_be_bytes());
    b
}

/// `NBD_INFO_NAME` / `NBD_INFO_DESCRIPTION` payload.
pub fn encode_info_string(info: u16, s: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(2 + s.len());
    out.extend_from_slice(&info.to_be_bytes());
    out.extend_from_slice(s);
    out
}

/// A parsed `NBD_REP_INFO` payload (client side).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Info {
    Export { size: u64, flags: u16 },
    BlockSize { min: u32, preferred: u32, max: u32 },
    Name(Vec<u8>),
    Description(Vec<u8>),
    Unknown(u16),
}

pub fn parse_info(payload: &[u8]) -> Result<Info, ProtoError> {
    if payload.len() < 2 {
        return Err(ProtoError::Malformed("info reply too short"));
    }
    let typ = be16(payload, 0);
    let rest = &payload[2..];
    match typ {
        INFO_EXPORT => {
            if rest.len() != 10 {
                return Err(ProtoError::Malformed("NBD_INFO_EXPORT length"));
            }
            Ok(Info::Export {
                size: be64(rest, 0),
                flags: be16(rest, 8),
            })
        }
        INFO_BLOCK_SIZE => {
            if rest.len() != 12 {
                return Err(ProtoError::Malformed("NBD_INFO_BLOCK_SIZE length"));
            }
            Ok(Info::BlockSize {
                min: be32(rest, 0),
                preferred: be32(rest, 4),
                max: be32(rest, 8),
            })
        }
        INFO_NAME => Ok(Info::Name(rest.to_vec())),
        INFO_DESCRIPTION => Ok(Info::Description(rest.to_vec())),
        other => Ok(Info::Unknown(other)),
    }
}

/// `NBD_REP_SERVER` payload: name length, name, then the description.
pub fn encode_rep_server(name: &[u8], description: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + name.len() + description.len());
    out.extend_from_slice(&(name.len() as u32).to_be_bytes());
    out.extend_from_slice(name);
    out.extend_from_slice(description);
    out
}

/// Splits an `NBD_REP_SERVER` payload into name and description.
pub fn parse_rep_server(payload: &[u8]) -> Result<(&[u8], &[u8]), ProtoError> {
    if payload.len() < 4 {
        return Err(ProtoError::Malformed("NBD_REP_SERVER too short"));
    }
    let n = be32(payload, 0) as usize;
    if n > payload.len() - 4 {
        return Err(ProtoError::Malformed("NBD_REP_SERVER name length"));
    }
    Ok((&payload[4..4 + n], &payload[4 + n..]))
}

/// The reply that ends negotiation after `NBD_OPT_EXPORT_NAME`.
pub fn encode_export_name_reply(out: &mut Vec<u8>, size: u64, flags: u16, no_zeroes: bool) {
    out.extend_from_slice(&size.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    if !no_zeroes {
        out.extend_from_slice(&[0u8; EXPORT_NAME_ZEROES]);
    }
}

// ---- transmission -----------------------------------------------------------

/// A transmission-phase request header. For `NBD_CMD_WRITE`, `length` bytes
/// of payload follow it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub typ: u16,
    pub handle: u64,
    pub offset: u64,
    pub length: u32,
}

pub fn parse_request(b: &[u8; REQUEST_LEN]) -> Result<Request, ProtoError> {
    if be32(b, 0) != REQUEST_MAGIC {
        return Err(ProtoError::BadMagic);
    }
    Ok(Request {
        flags: be16(b, 4),
        typ: be16(b, 6),
        handle: be64(b, 8),
        offset: be64(b, 16),
        length: be32(b, 24),
    })
}

pub fn encode_request(r: &Request) -> [u8; REQUEST_LEN] {
    let mut b = [0u8; REQUEST_LEN];
    b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&r.flags.to_be_bytes());
    b[6..8].copy_from_slice(&r.typ.to_be_bytes());
    b[8..16].copy_from_slice(&r.handle.to_be_bytes());
    b[16..24].copy_from_slice(&r.offset.to_be_bytes());
    b[24..28].copy_from_slice(&r.length.to_be_bytes());
    b
}

/// Writes a simple reply header into the first 16 bytes of `out`.
pub fn encode_simple_reply(out: &mut [u8], error: u32, handle: u64) {
    out[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out[4..8].copy_from_slice(&error.to_be_bytes());
    out[8..16].copy_from_slice(&handle.to_be_bytes());
}

/// Writes a structured reply chunk header into the first 20 bytes of `out`.
pub fn encode_structured_header(out: &mut [u8], flags: u16, typ: u16, handle: u64, length: u32) {
    out[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out[4..6].copy_from_slice(&flags.to_be_bytes());
    out[6..8].copy_from_slice(&typ.to_be_bytes());
    out[8..16].copy_from_slice(&handle.to_be_bytes());
    out[16..20].copy_from_slice(&length.to_be_bytes());
}

/// Appends a final `NBD_REPLY_TYPE_ERROR` chunk; the message is cut to the
/// spec's string limit.
pub fn encode_structured_error(out: &mut Vec<u8>, handle: u64, error: u32, message: &str) {
    let msg = truncate_utf8(message, MAX_STRING_LEN);
    let start = out.len();
    out.resize(start + STRUCTURED_HEADER_LEN, 0);
    encode_structured_header(
        &mut out[start..],
        REPLY_FLAG_DONE,
        REPLY_TYPE_ERROR,
        handle,
        (6 + msg.len()) as u32,
    );
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    out.extend_from_slice(msg.as_bytes());
}

fn truncate_utf8(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

/// Header of a transmission reply, either kind (client side).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyHeader {
    Simple {
        error: u32,
        handle: u64,
    },
    Structured {
        flags: u16,
        typ: u16,
        handle: u64,
        length: u32,
    },
}

/// How many header bytes follow the 4-byte magic, or an error for an
/// unknown magic.
pub fn reply_header_rest_len(magic: &[u8; 4]) -> Result<usize, ProtoError> {
    match u32::from_be_bytes(*magic) {
        SIMPLE_REPLY_MAGIC => Ok(SIMPLE_REPLY_LEN - 4),
        STRUCTURED_REPLY_MAGIC => Ok(STRUCTURED_HEADER_LEN - 4),
        _ => Err(ProtoError::BadMagic),
    }
}

/// Parses a complete reply header (16 or 20 bytes, magic included).
pub fn parse_reply_header(b: &[u8]) -> Result<ReplyHeader, ProtoError> {
    if b.len() < 4 {
        return Err(ProtoError::Malformed("reply header too short"));
    }
    match be32(b, 0) {
        SIMPLE_REPLY_MAGIC if b.len() == SIMPLE_REPLY_LEN => Ok(ReplyHeader::Simple {
            error: be32(b, 4),
            handle: be64(b, 8),
        }),
        STRUCTURED_REPLY_MAGIC if b.len() == STRUCTURED_HEADER_LEN => Ok(ReplyHeader::Structured {
            flags: be16(b, 4),
            typ: be16(b, 6),
            handle: be64(b, 8),
            length: be32(b, 16),
        }),
        SIMPLE_REPLY_MAGIC | STRUCTURED_REPLY_MAGIC => {
            Err(ProtoError::Malformed("reply header length"))
        }
        _ => Err(ProtoError::BadMagic),
    }
}

/// The error fields of an error chunk payload: error value and message.
pub fn parse_error_chunk(payload: &[u8]) -> Result<(u32, &[u8]), ProtoError> {
    if payload.len() < 6 {
        return Err(ProtoError::Malformed("error chunk too short"));
    }
    let err = be32(payload, 0);
    let mlen = be16(payload, 4) as usize;
    if mlen > payload.len() - 6 {
        return Err(ProtoError::Malformed("error chunk message length"));
    }
    Ok((err, &payload[6..6 + mlen]))
}

/// Reads a big-endian u64 from the first 8 bytes (for chunk offsets).
pub fn parse_u64(b: &[u8]) -> Result<u64, ProtoError> {
    if b.len() < 8 {
        return Err(ProtoError::Malformed("short u64"));
    }
    Ok(be64(b, 0))
}

/// Reads a big-endian u32 from the first 4 bytes.
pub fn parse_u32(b: &[u8]) -> Result<u32, ProtoError> {
    if b.len() < 4 {
        return Err(ProtoError::Malformed("short u32"));
    }
    Ok(be32(b, 0))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trip() {
        let r = Request {
            flags: CMD_FLAG_FUA,
            typ: CMD_WRITE,
            handle: 0xdead_beef_0102_0304,
            offset: 1 << 40,
            length: 4096,
        };
        assert_eq!(parse_request(&encode_request(&r)), Ok(r));
        let mut bad = encode_request(&r);
        bad[0] ^= 1;
        assert_eq!(parse_request(&bad), Err(ProtoError::BadMagic));
    }

    #[test]
    fn info_request_lengths_must_match() {
        let good = encode_info_request(b"disk", &[INFO_BLOCK_SIZE, INFO_NAME]);
        let req = parse_info_request(&good).unwrap();
        assert_eq!(req.name, b"disk");
        assert!(req.wants(INFO_BLOCK_SIZE) && req.wants(INFO_NAME));
        assert!(!req.wants(INFO_DESCRIPTION));
        // Count claims more items than present.
        let mut short = good.clone();
        short.pop();
        assert!(parse_info_request(&short).is_err());
        // Name length larger than the data.
        let mut huge = good.clone();
        huge[0..4].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(parse_info_request(&huge).is_err());
        assert!(parse_info_request(&[0, 0, 0]).is_err());
    }

    #[test]
    fn client_flags_checked_against_offer() {
        let both = FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES;
        assert_eq!(parse_client_flags(&3u32.to_be_bytes(), both), Ok(3));
        assert!(parse_client_flags(&4u32.to_be_bytes(), both).is_err());
        assert!(parse_client_flags(&2u32.to_be_bytes(), FLAG_FIXED_NEWSTYLE).is_err());
    }

    #[test]
    fn structured_error_encoding() {
        let mut out = Vec::new();
        encode_structured_error(&mut out, 7, EINVAL, "bad");
        let hdr = parse_reply_header(&out[..STRUCTURED_HEADER_LEN]).unwrap();
        assert_eq!(
            hdr,
            ReplyHeader::Structured {
                flags: REPLY_FLAG_DONE,
                typ: REPLY_TYPE_ERROR,
                handle: 7,
                length: 9
            }
        );
        let (err, msg) = parse_error_chunk(&out[STRUCTURED_HEADER_LEN..]).unwrap();
        assert_eq!((err, msg), (EINVAL, &b"bad"[..]));
        // Messages are cut at a char boundary within the string limit.
        let long = "é".repeat(3000);
        let mut out = Vec::new();
        encode_structured_error(&mut out, 1, EIO, &long);
        let (_, msg) = parse_error_chunk(&out[STRUCTURED_HEADER_LEN..]).unwrap();
        assert!(msg.len() <= MAX_STRING_LEN && std::str::from_utf8(msg).is_ok());
    }

    #[test]
    fn rep_server_round_trip() {
        let p = encode_rep_server(b"a", b"desc");
        assert_eq!(parse_rep_server(&p), Ok((&b"a"[..], &b"desc"[..])));
        assert!(parse_rep_server(&[0, 0, 0, 9, b'x']).is_err());
    }
}

//! Server side of fixed-newstyle negotiation (the handshake phase).

use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use crate::export::Capabilities;
use crate::proto::*;
use crate::registry::{ExportEntry, ExportRegistry};

/// Option data longer than this is discarded unread (`NBD_REP_ERR_TOO_BIG`)
/// up to [`OPTION_DISCARD_LIMIT`], and a hard disconnect beyond that. No
/// option this server knows needs more than a few KiB.
pub const DEFAULT_MAX_OPTION_LEN: u32 = 64 << 10;
const OPTION_DISCARD_LIMIT: u32 = 1 << 20;

/// What the handshake agreed on; everything the transmission phase needs.
pub(crate) struct Negotiated {
    pub(crate) entry: Arc<ExportEntry>,
    pub(crate) size: u64,
    pub(crate) flags: u16,
    pub(crate) structured: bool,
    /// The client asked for `NBD_INFO_BLOCK_SIZE` in `NBD_OPT_GO`, so it
    /// promised to honour the advertised constraints.
    pub(crate) block_size_negotiated: bool,
}

pub(crate) enum Outcome {
    Transmission(Box<Negotiated>),
    Closed,
}

/// Transmission flags derived from the export's capabilities; features a
/// read-only export cannot perform are not advertised.
pub(crate) fn transmission_flags(caps: &Capabilities, structured: bool) -> u16 {
    let mut f = FLAG_HAS_FLAGS;
    let writable = !caps.read_only;
    if caps.read_only {
        f |= FLAG_READ_ONLY;
    }
    if caps.can_flush {
        f |= FLAG_SEND_FLUSH;
    }
    if caps.can_fua && writable {
        f |= FLAG_SEND_FUA;
    }
    if caps.can_trim && writable {
        f |= FLAG_SEND_TRIM;
    }
    if caps.can_write_zeroes && writable {
        f |= FLAG_SEND_WRITE_ZEROES;
        if caps.can_fast_zero {
            f |= FLAG_SEND_FAST_ZERO;
        }
    }
    if caps.can_cache {
        f |= FLAG_SEND_CACHE;
    }
    if caps.can_multi_conn {
        f |= FLAG_CAN_MULTI_CONN;
    }
    if caps.rotational {
        f |= FLAG_ROTATIONAL;
    }
    // Reads are always answered with one data chunk, so "don't fragment"
    // costs nothing to honour, but the spec only allows it with structured
    // replies.
    if structured {
        f |= FLAG_SEND_DF;
    }
    f
}

pub(crate) struct HandshakeCtx<'a> {
    pub(crate) registry: &'a ExportRegistry,
    pub(crate) max_option_len: u32,
    pub(crate) shutting_down: &'a AtomicBool,
    /// Counts the connection against the export it is about to enter; false
    /// if the export has no room (the refusal is already logged). Called only
    /// when the handshake is certain to enter transmission on success.
    pub(crate) admit: &'a dyn Fn(&ExportEntry) -> bool,
    /// The client named an export that does not exist (the server logs it as a refusal).
    pub(crate) unknown: &'a dyn Fn(&[u8]),
}

fn read_exact_or_eof<R: Read>(r: &mut R, buf: &mut [u8]) -> io::Result<bool> {
    match r.read_exact(buf) {
        Ok(()) => Ok(true),
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => Ok(false),
        Err(e) => Err(e),
    }
}

/// Reads and drops `len` bytes without allocating more than a small buffer.
pub(crate) fn discard<R: Read>(r: &mut R, mut len: u64) -> io::Result<bool> {
    let mut scratch = [0u8; 8192];
    while len > 0 {
        let n = len.min(scratch.len() as u64) as usize;
        if !read_exact_or_eof(r, &mut scratch[..n])? {
            return Ok(false);
        }
        len -= n as u64;
    }
    Ok(true)
}

fn reply<W: Write>(
    w: &mut W,
    out: &mut Vec<u8>,
    option: u32,
    typ: u32,
    payload: &[u8],
) -> io::Result<()> {
    out.clear();
    encode_option_reply(out, option, typ, payload);
    w.write_all(out)
}

fn error_reply<W: Write>(
    w: &mut W,
    out: &mut Vec<u8>,
    option: u32,
    typ: u32,
    msg: &str,
) -> io::Result<()> {
    reply(w, out, option, typ, msg.as_bytes())
}

/// Runs the handshake from the greeting until the client enters
/// transmission, aborts, or must be dropped. `Ok(Closed)` covers every
/// client misbehaviour that ends the connection; `Err` is a transport error.
pub(crate) fn negotiate<R: Read, W: Write>(
    r: &mut R,
    w: &mut W,
    ctx: &HandshakeCtx<'_>,
) -> io::Result<Outcome> {
    let offered = FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES;
    w.write_all(&encode_greeting(offered))?;
    w.flush()?;
    let mut cf = [0u8; 4];
    if !read_exact_or_eof(r, &mut cf)? {
        return Ok(Outcome::Closed);
    }
    let client_flags = match parse_client_flags(&cf, offered) {
        Ok(f) => f,
        Err(_) => return Ok(Outcome::Closed),
    };
    // Clients without C_FIXED_NEWSTYLE can only send EXPORT_NAME, which is
    // handled identically, so they need no separate path.
    let no_zeroes = client_flags & FLAG_C_NO_ZEROES != 0;

    let mut structured = false;
    let mut data = Vec::new();
    let mut out = Vec::with_capacity(256);
    loop {
        w.flush()?;
        let mut hdr = [0u8; OPTION_HEADER_LEN];
        if !read_exact_or_eof(r, &mut hdr)? {
            return Ok(Outcome::Closed);
        }
        let OptionHeader { option, len } = match parse_option_header(&hdr) {
            Ok(h) => h,
            Err(_) => return Ok(Outcome::Closed),
        };
        if len > ctx.max_option_len {
            if len > OPTION_DISCARD_LIMIT || !discard(r, u64::from(len))? {
                return Ok(Outcome::Closed);
            }
            if option == OPT_EXPORT_NAME {
                // No error reply exists for EXPORT_NAME.
                return Ok(Outcome::Closed);
            }
            error_reply(w, &mut out, option, REP_ERR_TOO_BIG, "option too large")?;
            continue;
        }
        data.clear();
        data.resize(len as usize, 0);
        if !read_exact_or_eof(r, &mut data)? {
            return Ok(Outcome::Closed);
        }

        if ctx.shutting_down.load(Ordering::Relaxed) && option != OPT_ABORT {
            if option == OPT_EXPORT_NAME {
                return Ok(Outcome::Closed);
            }
            error_reply(
                w,
                &mut out,
                option,
                REP_ERR_SHUTDOWN,
                "server shutting down",
            )?;
            continue;
        }

        match option {
            OPT_EXPORT_NAME => {
                let Some(entry) = ctx.registry.lookup(&data) else {
                    (ctx.unknown)(&data);
                    return Ok(Outcome::Closed);
                };
                // No error reply exists for EXPORT_NAME.
                if !(ctx.admit)(&entry) {
                    return Ok(Outcome::Closed);
                }
                let n = negotiated(entry, structured, false);
                out.clear();
                encode_export_name_reply(&mut out, n.size, n.flags, no_zeroes);
                w.write_all(&out)?;
                w.flush()?;
                return Ok(Outcome::Transmission(Box::new(n)));
            }
            OPT_ABORT => {
                // The client may already have closed; a failed ACK is fine.
                let _ = reply(w, &mut out, option, REP_ACK, &[]);
                let _ = w.flush();
                return Ok(Outcome::Closed);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    error_reply(w, &mut out, option, REP_ERR_INVALID, "LIST takes no data")?;
                    continue;
                }
                for e in ctx.registry.entries() {
                    let p = encode_rep_server(e.name.as_bytes(), e.description.as_bytes());
                    reply(w, &mut out, option, REP_SERVER, &p)?;
                }
                reply(w, &mut out, option, REP_ACK, &[])?;
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    error_reply(
                        w,
                        &mut out,
                        option,
                        REP_ERR_INVALID,
                        "STRUCTURED_REPLY takes no data",
                    )?;
                    continue;
                }
                structured = true;
                reply(w, &mut out, option, REP_ACK, &[])?;
            }
            OPT_INFO | OPT_GO => {
                let req = match parse_info_request(&data) {
                    Ok(req) => req,
                    Err(e) => {
                        error_reply(w, &mut out, option, REP_ERR_INVALID, &e.to_string())?;
                        continue;
                    }
                };
                let Some(entry) = ctx.registry.lookup(req.name) else {
                    (ctx.unknown)(req.name);
                    error_reply(w, &mut out, option, REP_ERR_UNKNOWN, "unknown export")?;
                    continue;
                };
                if option == OPT_GO && !(ctx.admit)(&entry) {
                    error_reply(
                        w,
                        &mut out,
                        option,
                        REP_ERR_POLICY,
                        "too many connections to this export",
                    )?;
                    continue;
                }
                let wants_bs = req.wants(INFO_BLOCK_SIZE);
                let n = negotiated(entry, structured, wants_bs);
                let bs = n.entry.block_sizes;
                reply(
                    w,
                    &mut out,
                    option,
                    REP_INFO,
                    &encode_info_export(n.size, n.flags),
                )?;
                // Sent even unasked: the client may ignore it, and then the
                // server still accepts unaligned requests (see transmission).
                reply(
                    w,
                    &mut out,
                    option,
                    REP_INFO,
                    &encode_info_block_size(bs.min, bs.preferred, bs.max),
                )?;
                if req.wants(INFO_NAME) {
                    let p = encode_info_string(INFO_NAME, n.entry.name.as_bytes());
                    reply(w, &mut out, option, REP_INFO, &p)?;
                }
                if req.wants(INFO_DESCRIPTION) && !n.entry.description.is_empty() {
                    let p = encode_info_string(INFO_DESCRIPTION, n.entry.description.as_bytes());
                    reply(w, &mut out, option, REP_INFO, &p)?;
                }
                reply(w, &mut out, option, REP_ACK, &[])?;
                if option == OPT_GO {
                    w.flush()?;
                    return Ok(Outcome::Transmission(Box::new(n)));
                }
            }
            _ => {
                // STARTTLS, meta contexts, extended headers and anything
                // unknown: not supported; negotiation continues.
                error_reply(w, &mut out, option, REP_ERR_UNSUP, "option not supported")?;
            }
        }
    }
}

fn negotiated(entry: Arc<ExportEntry>, structured: bool, bs: bool) -> Negotiated {
    let caps = entry.export.capabilities();
    let size = entry.export.size();
    Negotiated {
        size,
        flags: transmission_flags(&caps, structured),
        entry,
        structured,
        block_size_negotiated: bs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_follow_capabilities() {
        let caps = Capabilities::default();
        let f = transmission_flags(&caps, false);
        assert_eq!(
            f,
            FLAG_HAS_FLAGS | FLAG_SEND_FLUSH | FLAG_SEND_FUA | FLAG_SEND_WRITE_ZEROES
        );
        let ro = Capabilities {
            read_only: true,
            can_trim: true,
            can_fast_zero: true,
            can_multi_conn: true,
            ..caps
        };
        let f = transmission_flags(&ro, true);
        assert_eq!(
            f,
            FLAG_HAS_FLAGS | FLAG_READ_ONLY | FLAG_SEND_FLUSH | FLAG_CAN_MULTI_CONN | FLAG_SEND_DF
        );
        let fz = Capabilities {
            can_fast_zero: true,
            can_write_zeroes: false,
            ..caps
        };
        assert_eq!(transmission_flags(&fz, false) & FLAG_SEND_FAST_ZERO, 0);
    }
}

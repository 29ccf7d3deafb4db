//! The CLI's side of the control socket: one request line out, one reply line back, and a plain
//! word when the socket at `--control` is not a hybridcache daemon's (the NBD socket, another
//! program's socket, one that never answers) instead of a JSON decoding error or a hang.

use std::io::{ErrorKind, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use anyhow::{anyhow, Context, Result};

use crate::daemon::DEFAULT_CONTROL;

/// What an NBD server sends first, at once, to every client (the newstyle handshake).
const NBD_MAGIC: &[u8] = b"NBDMAGIC";

/// Silence this long before the CLI checks whether anything is listening at all: a daemon busy
/// with a long request (a flush, a stop) is silent on that connection for as long as it takes.
const FIRST_WAIT: Duration = Duration::from_secs(1);

/// How long a second connection's `version` may take: the daemon answers it from a thread of its
/// own without taking any lock, so only something that is not our daemon takes this long.
const PROBE_WAIT: Duration = Duration::from_secs(5);

/// The probe: a request every daemon answers at once, even while shutting down.
const PROBE: &[u8] = b"{\"cmd\":\"version\"}\n";

/// Send `line` (one JSON request ending in a newline) and return the reply line.
pub fn exchange(control: &Path, line: &str) -> Result<String> {
    let mut stream = UnixStream::connect(control).map_err(|e| {
        anyhow!(
            "cannot reach the daemon at {}: {e} (is 'hybridcache daemon' running? use --control or HYBRIDCACHE_CONTROL)",
            control.display()
        )
    })?;
    stream
        .set_read_timeout(Some(FIRST_WAIT))
        .context("setting a read timeout on the control socket")?;
    // A peer that is not ours may have hung up already; what it said first tells more than a
    // broken pipe, so the reply is read either way.
    let sent = stream.write_all(line.as_bytes());
    let mut reply = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        match stream.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => {
                reply.extend_from_slice(&buf[..n]);
                match classify(&reply) {
                    Peer::Pending => continue,
                    Peer::Ours if reply.contains(&b'\n') => break,
                    Peer::Ours => {
                        // Our daemon, part way through a long reply: no more deadline.
                        let _ = stream.set_read_timeout(None);
                    }
                    other => return Err(not_ours(control, other)),
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                match probe(control) {
                    // Our daemon, busy with this request: wait for it as long as it takes.
                    Peer::Ours | Peer::Pending => {
                        let _ = stream.set_read_timeout(None);
                    }
                    other => return Err(not_ours(control, other)),
                }
            }
            Err(e) => {
                sent.context("sending the request")?;
                return Err(e).context("reading the reply");
            }
        }
    }
    match classify(&reply) {
        Peer::Ours => {}
        Peer::Pending if reply.is_empty() => {
            sent.context("sending the request")?;
            return Err(anyhow!("the daemon closed the connection without a reply"));
        }
        Peer::Pending => return Err(not_ours(control, Peer::Foreign(reply))),
        other => return Err(not_ours(control, other)),
    }
    String::from_utf8(reply).map_err(|_| not_ours(control, Peer::Foreign(Vec::new())))
}

/// What the first bytes from the other end say it is.
#[derive(Debug, PartialEq)]
enum Peer {
    /// Nothing yet, or a prefix of NBD's greeting.
    Pending,
    /// A JSON object: the daemon's reply (whether it decodes is checked after).
    Ours,
    Nbd,
    /// It accepted the connection and said nothing.
    Silent,
    /// Something else; what it said.
    Foreign(Vec<u8>),
}

fn classify(first: &[u8]) -> Peer {
    match first.first() {
        None => Peer::Pending,
        Some(b'{') => Peer::Ours,
        Some(_) if first.starts_with(NBD_MAGIC) => Peer::Nbd,
        Some(_) if NBD_MAGIC.starts_with(first) => Peer::Pending,
        Some(_) => Peer::Foreign(first.to_vec()),
    }
}

/// A second connection asking for the version: tells a daemon busy with the first request from
/// something that is not a daemon. `Pending` when it cannot tell (the socket went away: a
/// daemon that is stopping closes it while it finishes the request).
fn probe(control: &Path) -> Peer {
    let Ok(mut s) = UnixStream::connect(control) else {
        return Peer::Pending;
    };
    if s.set_read_timeout(Some(PROBE_WAIT)).is_err() {
        return Peer::Pending;
    }
    let _ = s.write_all(PROBE);
    let mut got = Vec::new();
    let mut buf = [0u8; 512];
    loop {
        match s.read(&mut buf) {
            Ok(0) => return classify(&got),
            Ok(n) => {
                got.extend_from_slice(&buf[..n]);
                match classify(&got) {
                    Peer::Pending => {}
                    Peer::Ours if !got.contains(&b'\n') => {}
                    Peer::Ours => {
                        return match serde_json::from_slice::<crate::protocol::Response>(&got) {
                            Ok(_) => Peer::Ours,
                            Err(_) => Peer::Foreign(got),
                        }
                    }
                    other => return other,
                }
            }
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return if got.is_empty() {
                    Peer::Silent
                } else {
                    Peer::Foreign(got)
                };
            }
            Err(_) => return Peer::Pending,
        }
    }
}

fn not_ours(control: &Path, peer: Peer) -> anyhow::Error {
    let path = control.display();
    let hint = format!(
        "the control socket is {DEFAULT_CONTROL} by default; use --control or HYBRIDCACHE_CONTROL"
    );
    match peer {
        Peer::Nbd => anyhow!("{path} is an NBD socket, not the control socket ({hint})"),
        Peer::Silent => anyhow!(
            "{path} is not a hybridcache control socket: it accepted the connection but answered nothing in {} s ({hint})",
            (FIRST_WAIT + PROBE_WAIT).as_secs()
        ),
        Peer::Foreign(said) if said.is_empty() => {
            anyhow!("{path} is not a hybridcache control socket: its answer is not text ({hint})")
        }
        Peer::Foreign(said) => anyhow!(
            "{path} is not a hybridcache control socket: it answered '{}' ({hint})",
            printable(&said)
        ),
        Peer::Pending | Peer::Ours => anyhow!("{path} is not a hybridcache control socket ({hint})"),
    }
}

/// The start of what a foreign peer said, safe for one line of a terminal.
fn printable(said: &[u8]) -> String {
    let mut out: String = said
        .iter()
        .take(40)
        .map(|&b| {
            if b.is_ascii_graphic() || b == b' ' {
                b as char
            } else {
                '.'
            }
        })
        .collect();
    out = out.trim_end_matches('.').trim_end().to_string();
    if said.len() > 40 {
        out.push_str("...");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixListener;

    #[test]
    fn the_first_bytes_tell_the_peer() {
        assert_eq!(classify(b""), Peer::Pending);
        assert_eq!(classify(b"NBD"), Peer::Pending);
        assert_eq!(classify(b"NBDMAGIC\x49\x48"), Peer::Nbd);
        assert_eq!(classify(b"{\"ok\":true}"), Peer::Ours);
        assert_eq!(classify(b"NBX"), Peer::Foreign(b"NBX".to_vec()));
        assert_eq!(printable(b"220 hello\r\n"), "220 hello");
        assert_eq!(printable(&[b'a'; 50]), format!("{}...", "a".repeat(40)));
    }

    /// A server speaking NBD's greeting first, as the daemon's NBD socket does.
    #[test]
    fn an_nbd_greeting_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("nbd.sock");
        let l = UnixListener::bind(&sock).unwrap();
        let t = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            s.write_all(b"NBDMAGICIHAVEOPT\x00\x03").unwrap();
            let mut b = [0u8; 64];
            let _ = s.read(&mut b);
        });
        let e = exchange(&sock, "{\"cmd\":\"list\"}\n")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("is an NBD socket, not the control socket"),
            "{e}"
        );
        t.join().unwrap();
    }

    /// A daemon slower than FIRST_WAIT is waited for: the probe finds it answering.
    #[test]
    fn a_busy_daemon_is_waited_for() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("c.sock");
        let l = UnixListener::bind(&sock).unwrap();
        let t = std::thread::spawn(move || {
            let (mut slow, _) = l.accept().unwrap();
            let (mut quick, _) = l.accept().unwrap();
            let mut b = [0u8; 64];
            let _ = quick.read(&mut b);
            quick
                .write_all(b"{\"ok\":true,\"result\":{\"version\":\"0\"}}\n")
                .unwrap();
            std::thread::sleep(Duration::from_millis(500));
            slow.write_all(b"{\"ok\":true,\"result\":null}\n").unwrap();
        });
        let r = exchange(&sock, "{\"cmd\":\"flush\"}\n").unwrap();
        assert_eq!(r, "{\"ok\":true,\"result\":null}\n");
        t.join().unwrap();
    }
}

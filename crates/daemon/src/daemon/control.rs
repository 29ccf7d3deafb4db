//! The control socket: binding it (owner-only, a stale socket replaced), one thread per client
//! reading JSON-line requests, and one log line per management change saying who asked, what,
//! and for settings what changed from what to what.

use std::io::{BufRead, BufReader, Read as _, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;

use anyhow::{bail, Context, Result};

use super::{Daemon, Reply};
use crate::protocol::{self, Request, Response};

/// A control request line longer than this is refused (a request is a few hundred bytes).
const MAX_LINE: usize = 64 << 10;

/// Bind the control socket, readable and writable by the owner only. A socket file nobody
/// listens on is left over from a crash and is replaced; a live one means another daemon.
pub(super) fn bind_control(path: &Path) -> Result<UnixListener> {
    if path.exists() {
        match UnixStream::connect(path) {
            Ok(_) => bail!(
                "another daemon is already listening on {} (stop it first)",
                path.display()
            ),
            Err(_) => std::fs::remove_file(path)
                .with_context(|| format!("cannot remove stale socket {}", path.display()))?,
        }
    }
    // The umask makes the socket 0600 from the start; chmod afterwards would leave a window.
    // SAFETY: umask only changes this process's file creation mask.
    let old = unsafe { libc::umask(0o177) };
    let bound = UnixListener::bind(path);
    // SAFETY: as above, restoring the previous mask.
    unsafe { libc::umask(old) };
    bound.with_context(|| format!("cannot listen on {}", path.display()))
}

/// Who is on the other end of a control connection (the kernel's SO_PEERCRED), for the log.
fn peer_text(stream: &UnixStream) -> String {
    match hybridcache_nbd::unix_peer_credentials(stream) {
        Some(c) => format!("pid {} uid {}", c.pid, c.uid),
        None => "an unknown peer".into(),
    }
}

/// Requests that change the setup; the others only read it.
fn changes_something(req: &Request) -> bool {
    !matches!(
        req,
        Request::List
            | Request::Stats { .. }
            | Request::GetParam { .. }
            | Request::ListIoClasses { .. }
            | Request::Version
            | Request::TraceStatus
            | Request::CheckCacheDevice { .. }
    )
}

/// The settings a request is about to change, read before it runs, so the log can say what
/// they were ("from what to what"): the cache mode, or the parameter group's fields, by name
/// (per-core groups prefixed with the core).
fn settings(daemon: &Daemon, req: &Request) -> Option<Vec<(String, String)>> {
    let (cache, core, name) = match req {
        Request::SetCacheMode { cache, .. } => (*cache, None, "cache-mode".to_string()),
        Request::SetParam {
            cache, core, name, ..
        } => (*cache, *core, name.clone()),
        _ => return None,
    };
    let v = daemon
        .handle(Request::GetParam { cache, core, name })
        .ok()?;
    let p: protocol::ParamValue = serde_json::from_value(v).ok()?;
    let mut out: Vec<(String, String)> = p
        .fields
        .iter()
        .map(|f| (f.key.clone(), f.value.clone()))
        .collect();
    for c in &p.cores {
        out.extend(
            c.fields
                .iter()
                .map(|f| (format!("core {} {}", c.core, f.key), f.value.clone())),
        );
    }
    Some(out)
}

/// One log line per management change: who asked, what, and for settings what changed from
/// what to what.
fn log_change(
    daemon: &Daemon,
    peer: &str,
    req: &Request,
    before: Option<Vec<(String, String)>>,
    result: &Reply,
) {
    let mut what = serde_json::to_string(req).unwrap_or_default();
    if let Request::LoadIoClasses { cache, csv, .. } = req {
        what = format!(
            "load IO classes of cache {cache} ({} lines)",
            csv.lines().count()
        );
    }
    match result {
        Ok(_) => {
            let mut change = String::new();
            if let (Some(before), Some(after)) = (before, settings(daemon, req)) {
                let diffs: Vec<String> = after
                    .iter()
                    .filter_map(|(k, new)| {
                        let old = before.iter().find(|(bk, _)| bk == k).map(|(_, v)| v)?;
                        (old != new).then(|| format!("{k} {old} -> {new}"))
                    })
                    .collect();
                change = if diffs.is_empty() {
                    ": nothing changed".into()
                } else {
                    format!(": {}", diffs.join(", "))
                };
            }
            tracing::info!("control request from {peer}: {what} done{change}");
        }
        Err(e) => tracing::warn!("control request from {peer}: {what} refused: {e}"),
    }
}

/// The control socket's accept thread: one thread per client connection.
pub(super) fn spawn_accept(
    daemon: Arc<Daemon>,
    listener: UnixListener,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("control-accept".into())
        .spawn(move || {
            for stream in listener.incoming() {
                let Ok(stream) = stream else { continue };
                let daemon = daemon.clone();
                let _ = std::thread::Builder::new()
                    .name("control".into())
                    .spawn(move || serve_control_client(&daemon, stream));
            }
        })
}

fn serve_control_client(daemon: &Daemon, stream: UnixStream) {
    let peer = peer_text(&stream);
    let Ok(write_half) = stream.try_clone() else {
        return;
    };
    let mut writer = write_half;
    let mut reader = BufReader::new(stream);
    let mut line = String::new();
    loop {
        line.clear();
        match (&mut reader).take(MAX_LINE as u64).read_line(&mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if !line.ends_with('\n') && line.len() >= MAX_LINE {
            let _ = writeln!(writer, "{}", reply_text(Response::err("request too long")));
            return;
        }
        if line.trim().is_empty() {
            continue;
        }
        let mut stop_request = false;
        let response = match serde_json::from_str::<Request>(&line) {
            Ok(req) => {
                if req != Request::Version {
                    daemon.wait_started();
                }
                stop_request = req == Request::Shutdown;
                let audit = changes_something(&req).then(|| (req.clone(), settings(daemon, &req)));
                let result = daemon.handle(req);
                if let Some((req, before)) = audit {
                    log_change(daemon, &peer, &req, before, &result);
                }
                match result {
                    Ok(v) => Response::ok(v),
                    Err(e) => {
                        // Refused (the daemon was already stopping): nobody waits for it.
                        stop_request = false;
                        Response::err(e)
                    }
                }
            }
            Err(e) => Response::err(format!("bad request: {e}")),
        };
        let sent = writeln!(writer, "{}", reply_text(response));
        if stop_request {
            daemon.shutdown_waiters.fetch_sub(1, Ordering::SeqCst);
        }
        if sent.is_err() {
            return;
        }
    }
}

fn reply_text(r: Response) -> String {
    serde_json::to_string(&r)
        .unwrap_or_else(|_| r#"{"ok":false,"error":"cannot encode the reply"}"#.to_string())
}

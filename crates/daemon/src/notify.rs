//! systemd's readiness protocol (sd_notify(3)) without libsystemd: under `Type=notify`, systemd
//! sets `NOTIFY_SOCKET` to a datagram socket and waits for `READY=1` before it starts the units
//! ordered after ours (local-fs-pre.target, so file systems on our exports). A path starting
//! with '@' is in the abstract namespace.

use std::io;
use std::os::unix::net::UnixDatagram;

/// Send `state` (e.g. "READY=1") to `$NOTIFY_SOCKET`. Ok(false) when the variable is unset (not
/// started by systemd, or not as Type=notify): nothing to do.
pub fn notify(state: &str) -> io::Result<bool> {
    match std::env::var_os("NOTIFY_SOCKET") {
        Some(path) => notify_to(&path.to_string_lossy(), state).map(|()| true),
        None => Ok(false),
    }
}

/// Send `state` to the socket `path` names: a file-system path, or '@name' for the abstract
/// socket `name`.
pub fn notify_to(path: &str, state: &str) -> io::Result<()> {
    let sock = UnixDatagram::unbound()?;
    match path.strip_prefix('@') {
        Some(name) => {
            use std::os::linux::net::SocketAddrExt;
            let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes())?;
            sock.send_to_addr(state.as_bytes(), &addr)?;
        }
        None => {
            sock.send_to(state.as_bytes(), path)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_reaches_a_socket_in_a_directory() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify.sock");
        let listener = UnixDatagram::bind(&path).unwrap();
        notify_to(path.to_str().unwrap(), "READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
    }

    #[test]
    fn ready_reaches_an_abstract_socket() {
        use std::os::linux::net::SocketAddrExt;
        // The pid keeps parallel test runs on one machine apart.
        let name = format!("hybridcache-notify-test-{}", std::process::id());
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
        let listener = UnixDatagram::bind_addr(&addr).unwrap();
        notify_to(&format!("@{name}"), "READY=1").unwrap();
        let mut buf = [0u8; 64];
        let n = listener.recv(&mut buf).unwrap();
        assert_eq!(&buf[..n], b"READY=1");
    }

    #[test]
    fn a_missing_socket_is_an_error() {
        let dir = tempfile::tempdir().unwrap();
        assert!(notify_to(dir.path().join("none").to_str().unwrap(), "READY=1").is_err());
    }
}

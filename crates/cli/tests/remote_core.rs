//! A remote core (an NBD export served by nbdkit's file plugin) whose server is killed and
//! started again while the cache absorbs the writes in write-back, so that no core I/O notices
//! the outage (issue 30, case 5): `-L` tells the truth during the outage and after, and `-T`
//! then flushes every acknowledged byte to the core file instead of failing on the dead
//! connection.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use common::{nbdkit, need, sparse_file, workdir, Daemon, Kill};
use hybridcache_nbd::Client;

/// The status `-L` shows for core `core` of cache 1.
fn core_status(d: &Daemon, core: u64) -> String {
    let v: serde_json::Value = serde_json::from_str(&d.ok(&["-L", "-o", "json"])).expect("JSON");
    v["caches"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["id"].as_u64() == Some(1)))
        .and_then(|c| c["cores"].as_array())
        .and_then(|cores| cores.iter().find(|k| k["id"].as_u64() == Some(core)))
        .and_then(|k| k["status"].as_str())
        .unwrap_or("")
        .to_string()
}

/// Wait (up to 15 s) until core `core`'s status satisfies `ok`; returns it.
fn wait_core_status(d: &Daemon, core: u64, what: &str, ok: impl Fn(&str) -> bool) -> String {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let s = core_status(d, core);
        if ok(&s) {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "core {core} never became {what}; -L still says {s:?}\n{}",
            d.log_text()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn serve_file(sock: &Path, file: &Path) -> Kill {
    // A killed server leaves its socket file behind; the helper waits for a new one.
    let _ = std::fs::remove_file(sock);
    nbdkit(sock, &["file".into(), file.display().to_string()])
}

/// A write-back cache (cleaning nop: nothing reaches the core until a flush) on a cache file,
/// with core 1 a file served by nbdkit on a Unix socket, exported as cas1-1.
struct Rig {
    d: Daemon,
    server: Kill,
    sock: std::path::PathBuf,
    core_file: std::path::PathBuf,
    /// Last, so the daemon and the server stop before the directory goes.
    _dir: tempfile::TempDir,
}

fn remote_wb_cache(core_bytes: u64, cache_bytes: u64) -> Rig {
    let dir = workdir();
    let sock = dir.path().join("core.sock");
    let core_file = dir.path().join("core.img");
    let cache = dir.path().join("cache.img");
    sparse_file(&core_file, core_bytes);
    sparse_file(&cache, cache_bytes);
    let server = serve_file(&sock, &core_file);
    let d = Daemon::start(dir.path());
    let spec = format!("file:{}", cache.display());
    d.ok(&["-S", "-d", &spec, "-c", "wb"]);
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);
    let remote = format!("nbd+unix:///?socket={}", sock.display());
    d.ok(&["-A", "-i", "1", "-d", &remote]);
    Rig {
        d,
        server,
        sock,
        core_file,
        _dir: dir,
    }
}

/// `-T -i 1`, which must succeed.
fn stop_cache(d: &Daemon) {
    let out = d.cli(&["-T", "-i", "1"]);
    assert!(
        out.status.success(),
        "-T failed: {}{}",
        String::from_utf8_lossy(&out.stderr),
        d.log_text()
    );
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| seed.wrapping_mul(31).wrapping_add((i / 4096) as u8) ^ (i as u8))
        .collect()
}

#[test]
fn a_restarted_remote_core_is_flushed_completely_by_stop() {
    if !need(&["nbdkit"]) {
        return;
    }
    // Nothing reaches the core until the stop's flush: the outage goes unnoticed by the data path.
    let Rig {
        d,
        mut server,
        sock,
        core_file,
        _dir,
    } = remote_wb_cache(64 << 20, 64 << 20);
    assert_eq!(core_status(&d, 1), "Active");

    // What the core file must hold at the end, kept in step with every acknowledged write.
    let mut expect = vec![0u8; 64 << 20];
    let mut c = Client::connect_unix(&d.nbd, "cas1-1").expect("connect to cas1-1");
    let mut write = |c: &mut Client, seed: u8, offset: usize, len: usize| {
        let data = pattern(seed, len);
        c.write(&data, offset as u64, false)
            .expect("write-back write");
        expect[offset..offset + len].copy_from_slice(&data);
    };
    write(&mut c, 1, 0, 4 << 20);
    c.flush().expect("client flush");

    // The server goes while the cache holds dirty data and nothing is sent to the core.
    server.0.kill().expect("kill nbdkit");
    server.0.wait().expect("reap nbdkit");
    let during = wait_core_status(&d, 1, "listed as reconnecting", |s| {
        s.starts_with("Reconnecting (")
    });
    assert!(during.contains("attempt"), "{during}");
    // Write-back writes still land in the cache meanwhile.
    write(&mut c, 2, 8 << 20, 2 << 20);
    write(&mut c, 3, 1 << 20, 1 << 20);
    c.flush().expect("client flush during the outage");

    server = serve_file(&sock, &core_file);
    write(&mut c, 4, 32 << 20, 1 << 20);
    write(&mut c, 5, 3 << 20, 4096);
    c.disconnect().expect("disconnect");
    wait_core_status(&d, 1, "active again", |s| s == "Active");

    stop_cache(&d);
    drop(server);
    let got = std::fs::read(&core_file).expect("read the core file");
    assert_eq!(got.len(), expect.len());
    let first_diff = got.iter().zip(&expect).position(|(a, b)| a != b);
    assert_eq!(
        first_diff, None,
        "the core file differs from what was written (first at byte {first_diff:?})"
    );
}

/// The server is killed and restarted between two flushes without `-L` being asked and with the
/// daemon given no time to notice: `-T` itself meets the dead connection, and must reconnect and
/// retry instead of failing with "Broken pipe".
#[test]
fn stop_retries_a_flush_that_meets_a_dead_connection() {
    if !need(&["nbdkit"]) {
        return;
    }
    let Rig {
        d,
        mut server,
        sock,
        core_file,
        _dir,
    } = remote_wb_cache(16 << 20, 32 << 20);
    let data = pattern(9, 2 << 20);
    let mut c = Client::connect_unix(&d.nbd, "cas1-1").expect("connect to cas1-1");
    c.write(&data, 0, false).expect("write-back write");
    c.disconnect().expect("disconnect");
    server.0.kill().expect("kill nbdkit");
    server.0.wait().expect("reap nbdkit");
    let _server = serve_file(&sock, &core_file);
    stop_cache(&d);
    let got = std::fs::read(&core_file).expect("read the core file");
    assert!(
        got[..data.len()] == data[..],
        "the core file lacks the dirty data"
    );
}

//! Interoperability with real NBD clients (libnbd's nbdinfo/nbdsh, qemu-img,
//! fio's nbd engine). Each test needs its tool (`common::need`): skipped with a
//! message where it is not installed, a failure in CI or with HC_REQUIRE_TOOLS=1.

mod common;

use std::process::{Command, Output};
use std::sync::Arc;

use common::*;
use hybridcache_nbd::{Client, Export};
use rand::RngCore;

const MIB: usize = 1 << 20;

fn uri(t: &TestServer, name: &str) -> String {
    format!("nbd+unix:///{name}?socket={}", t.sock.display())
}

fn run(cmd: &mut Command) -> Output {
    let out = cmd.output().expect("spawn");
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Finds `"key": value` in nbdinfo's JSON without a JSON dependency.
fn json_number(json: &str, key: &str) -> Option<u64> {
    let at = json.find(&format!("\"{key}\""))?;
    let rest = &json[at + key.len() + 2..];
    let rest = rest.trim_start().strip_prefix(':')?.trim_start();
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

#[test]
fn nbdinfo_reports_size_and_block_sizes() {
    if !need(&["nbdinfo"]) {
        return;
    }
    let t = start(&[("disk", MemExport::new(64 * MIB).arc() as Arc<dyn Export>)]);
    let out = run(Command::new("nbdinfo").arg("--json").arg(uri(&t, "disk")));
    let json = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        json_number(&json, "export-size"),
        Some(64 * MIB as u64),
        "{json}"
    );
    assert_eq!(
        json_number(&json, "block_size_minimum"),
        Some(512),
        "{json}"
    );
    assert_eq!(
        json_number(&json, "block_size_preferred"),
        Some(4096),
        "{json}"
    );
    assert_eq!(
        json_number(&json, "block_size_maximum"),
        Some(32 << 20),
        "{json}"
    );
    assert!(json.contains("\"can_multi_conn\": true"), "{json}");
    assert!(json.contains("\"can_trim\": true"), "{json}");
}

#[test]
fn nbdinfo_lists_exports() {
    if !need(&["nbdinfo"]) {
        return;
    }
    let t = start(&[
        ("alpha", MemExport::new(MIB).arc() as Arc<dyn Export>),
        ("beta", MemExport::new(2 * MIB).arc() as Arc<dyn Export>),
    ]);
    let list_uri = format!("nbd+unix://?socket={}", t.sock.display());
    let out = run(Command::new("nbdinfo").arg("--list").arg(&list_uri));
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "export=\"alpha\"",
        "description: test export alpha",
        "export=\"beta\"",
        "description: test export beta",
        "export-size: 2097152",
    ] {
        assert!(text.contains(want), "missing {want:?} in:\n{text}");
    }
}

#[test]
fn qemu_img_convert_and_compare() {
    if !need(&["qemu-img"]) {
        return;
    }
    let size = 24 * MIB;
    let mem = MemExport::new(size).arc();
    let t = start(&[("disk", mem.clone() as Arc<dyn Export>)]);
    let mut img = vec![0u8; size];
    rand::thread_rng().fill_bytes(&mut img);
    // Leave zero runs so qemu exercises write-zeroes/trim paths too.
    img[4 * MIB..6 * MIB].fill(0);
    img[size - MIB..].fill(0);
    let src = t.dir.path().join("src.img");
    std::fs::write(&src, &img).unwrap();
    run(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&src)
        .arg(uri(&t, "disk")));
    let out = run(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&src)
        .arg(uri(&t, "disk")));
    assert!(String::from_utf8_lossy(&out.stdout).contains("identical"));
    // And byte for byte through our own client.
    let mut c = Client::connect_unix(&t.sock, "disk").unwrap();
    let mut back = vec![0u8; 4 * MIB];
    for off in (0..size).step_by(4 * MIB) {
        c.read(&mut back, off as u64).unwrap();
        assert!(
            back == img[off..off + 4 * MIB],
            "mismatch in chunk at {off}"
        );
    }
}

#[test]
fn fio_randwrite_with_verify() {
    if !need(&["fio"]) {
        return;
    }
    let t = start(&[("disk", MemExport::new(32 * MIB).arc() as Arc<dyn Export>)]);
    let out_file = t.dir.path().join("fio.json");
    // fio's nbd engine prints a line on stdout before the JSON, hence
    // --output.
    run(Command::new("fio")
        .current_dir(t.dir.path())
        .args([
            "--name=verify",
            "--ioengine=nbd",
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=32",
            "--verify=crc32c",
            "--do_verify=1",
            // Otherwise fio leaves a verify state file in its directory.
            "--verify_state_save=0",
            "--size=32M",
            "--output-format=json",
        ])
        .arg(format!("--uri={}", uri(&t, "disk")))
        .arg(format!("--output={}", out_file.display())));
    let json = std::fs::read_to_string(&out_file).unwrap();
    assert_eq!(json_number(&json, "error"), Some(0), "{json}");
    // 32 MiB of 4 KiB writes, each read back and verified.
    assert!(
        json_number(&json, "total_ios").unwrap_or(0) >= 8192,
        "{json}"
    );
}

/// An interpreter that has libnbd's Python bindings (nbdsh runs whatever
/// `python3` is first on PATH, which may lack them).
fn python_with_nbd() -> Option<&'static str> {
    let found = ["/usr/bin/python3", "python3"].into_iter().find(|py| {
        Command::new(py)
            .args(["-c", "import nbd"])
            .output()
            .is_ok_and(|o| o.status.success())
    });
    if found.is_none() {
        skip("no python3 with the libnbd bindings (python3-libnbd, make deps)");
    }
    found
}

#[test]
fn libnbd_pipelined_requests() {
    let Some(py) = python_with_nbd() else {
        return;
    };
    let t = start(&[("disk", MemExport::new(4 * MIB).arc() as Arc<dyn Export>)]);
    // Many asynchronous commands in flight on one libnbd handle, completed
    // in whatever order the server answers; then read back synchronously.
    let script = r#"
for i in range(64):
    h.aio_pwrite(bytes([i]) * 4096, i * 4096)
while h.aio_in_flight() > 0:
    h.poll(-1)
h.flush()
bufs = [nbd.Buffer(4096) for i in range(64)]
for i in range(64):
    h.aio_pread(bufs[i], i * 4096)
while h.aio_in_flight() > 0:
    h.poll(-1)
for i in range(64):
    assert bufs[i].to_bytearray() == bytes([i]) * 4096, i
    assert h.pread(4096, i * 4096) == bytes([i]) * 4096, i
print("ok")
"#;
    let out = run(Command::new(py)
        .args(["-m", "nbd", "-u"])
        .arg(uri(&t, "disk"))
        .arg("-c")
        .arg(script));
    assert!(String::from_utf8_lossy(&out.stdout).contains("ok"));
}

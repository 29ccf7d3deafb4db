//! qemu's NBD client: convert a random raw image into an export and compare it back.

mod common;

use std::io::Write;
use std::process::Command;

use common::{need, sparse_file, workdir, Daemon};

#[test]
fn qemu_img_convert_and_compare() {
    if !need(&["qemu-img"]) {
        return;
    }
    let dir = workdir();
    let core = dir.path().join("core.img");
    sparse_file(&core, 64 << 20);
    // Random data, with a hole in the middle so zero detection is exercised too.
    let src = dir.path().join("src.raw");
    {
        let mut f = std::fs::File::create(&src).unwrap();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut block = vec![0u8; 1 << 20];
        for mib in 0..48u64 {
            if (20..24).contains(&mib) {
                block.fill(0);
            } else {
                for chunk in block.chunks_mut(8) {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    chunk.copy_from_slice(&x.to_le_bytes());
                }
            }
            f.write_all(&block).unwrap();
        }
    }
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", "ram:16M", "-c", "wb", "-x", "16"]);
    d.ok(&["-A", "-i", "1", "-d", core.to_str().unwrap()]);
    let uri = d.uri("cas1-1");
    let run = |args: &[&str]| {
        let out = Command::new("qemu-img").args(args).output().unwrap();
        assert!(
            out.status.success(),
            "qemu-img {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let src_s = src.to_str().unwrap();
    run(&["convert", "-n", "-f", "raw", "-O", "raw", src_s, &uri]);
    // qemu-img compare allows the export to be larger than the image (the rest must be zero).
    let out = run(&["compare", "-f", "raw", "-F", "raw", src_s, &uri]);
    assert!(out.contains("identical"), "{out}");
    // And once more after the cache had to write everything back, on the core file itself. The
    // daemon's claim is a lock that qemu's own file locking refuses to share even with -U, so
    // the file is compared here (a plain read ignores advisory locks).
    d.ok(&["-F", "-i", "1"]);
    let want = std::fs::read(&src).unwrap();
    let got = std::fs::read(&core).unwrap();
    assert!(got.len() >= want.len());
    assert!(
        got[..want.len()] == want[..],
        "the core differs from the image"
    );
    assert!(
        got[want.len()..].iter().all(|b| *b == 0),
        "the core's tail is not zero"
    );
    let info = run(&["info", "--output=json", &uri]);
    assert!(info.contains(&format!("{}", 64u64 << 20)), "{info}");
}

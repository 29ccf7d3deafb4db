//! The emulated study RAID 60 through the real path: fio's nbd engine against `hybridcache
//! serve --core raid:preset=study60,...,nodata`, a few cells of every no-cache table of the study
//! (`bench calibration --method fio --quick`), 2 s per job. It fails when a cell is further than
//! a factor of 2 from the study, or, for the two full-stripe cells (16K qd32, 64K qd16), from
//! what the model gives with fio behind a transport like NBD's here: a functional check of the
//! model and of the server's dispatch (the full-stripe merge must survive NBD: the model that
//! lost it gave 66 MB/s for 16K qd32 where 392 were due), not a speed test, hence the generous
//! tolerance. About 45 s (12 fio jobs of 2 s after 1 s of ramp, a fresh server each); its own
//! test binary, so no other test's fio shares the machine.

mod common;

use std::process::{Command, Stdio};
use std::time::Instant;

use common::{need, workdir, BIN};

#[test]
fn study_raid_through_nbd_stays_within_twice_the_study() {
    if !need(&["fio"]) {
        return;
    }
    let dir = workdir();
    let start = Instant::now();
    let o = Command::new(BIN)
        .args([
            "bench",
            "calibration",
            "--method",
            "fio",
            "--quick",
            "--runtime",
            "2",
            "--disk-size",
            "4T",
            "--check",
            "2",
            "--out",
        ])
        .arg(dir.path())
        .stdin(Stdio::null())
        .output()
        .expect("run hybridcache bench calibration");
    let stdout = String::from_utf8_lossy(&o.stdout);
    println!("{stdout}");
    eprintln!("took {:.0} s", start.elapsed().as_secs_f64());
    assert!(
        o.status.success(),
        "a cell left 2x of the study:\n{stdout}\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(stdout.contains("fio through NBD"), "{stdout}");
    assert!(stdout.contains("Worst cell"), "{stdout}");
    for row in [
        "| randwrite 4K |",
        "| write 4K |",
        "| write 16K |",
        "| write 64K |",
        "| write 16K qd32 | MB/s |",
        "| randrw 50/50 4K read |",
        "| randrw 30/70 4K write |",
        "| randrw 70/30 4K read |",
    ] {
        assert!(stdout.contains(row), "{row} missing:\n{stdout}");
    }
}

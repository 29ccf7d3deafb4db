//! `-P` through the daemon: read-ahead, the cleaner and the clients' requests land in casadm's
//! rows (`Prefetch: readahead`, `Prefetch core reads: readahead`, `Cleaner`, `Cleaner core
//! writes`, `User requests`, `Total requests`) with the engine's real counts, in the table, CSV
//! and JSON alike, and `-Z` resets them. The row names and order themselves are compared with
//! casadm's in format.rs's unit tests.

mod common;

use common::*;

/// The value of column `name` in a one-record CSV.
fn column(csv: &str, name: &str) -> String {
    let mut lines = csv.lines();
    let head: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
    let values: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
    let i = head
        .iter()
        .position(|h| *h == name)
        .unwrap_or_else(|| panic!("no column {name}: {csv}"));
    values[i].to_string()
}

#[test]
fn readahead_cleaner_and_user_requests_are_counted_in_casadms_rows() {
    let FileCache {
        dir: _dir,
        daemon: d,
        ..
    } = file_cache(64 << 20, 256 << 20, &["-c", "wb"]);
    d.ok(&["-X", "-n", "prefetch", "-i", "1", "-p", "readahead"]);
    d.ok(&[
        "-X",
        "-n",
        "prefetch-readahead",
        "-i",
        "1",
        "-t",
        "64",
        "--distance",
        "512",
    ]);
    {
        let mut c = hybridcache_nbd::Client::connect_unix(&d.nbd, "cas1-1").expect("connect");
        // A sequential stream past the 64 KiB threshold: read-ahead follows it.
        let mut buf = vec![0u8; 65536];
        for i in 0..4u64 {
            c.read(&mut buf, i * 65536).expect("read");
        }
        c.write(&[0xcd; 8192], 128 << 20, false).expect("write");
        c.disconnect().unwrap();
    }
    // Read-ahead runs off the request path: wait for it to have counted its request.
    let mut csv = String::new();
    for _ in 0..100 {
        csv = d.ok(&["-P", "-i", "1", "-j", "1", "-o", "csv"]);
        if column(&csv, "Prefetch: readahead [Requests]") != "0" {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let readahead: u64 = column(&csv, "Prefetch: readahead [Requests]")
        .parse()
        .unwrap();
    assert!(readahead > 0, "{csv}");
    assert_eq!(column(&csv, "Prefetch: readahead [%]"), "100.0", "{csv}");
    let blocks: u64 = column(&csv, "Prefetch core reads: readahead [4KiB Blocks]")
        .parse()
        .unwrap();
    assert!(blocks > 0, "{csv}");
    assert_eq!(
        column(&csv, "Prefetch cache writes: readahead [4KiB Blocks]"),
        blocks.to_string(),
        "{csv}"
    );
    assert_eq!(column(&csv, "User requests [Requests]"), "5", "{csv}");
    assert_eq!(
        column(&csv, "Total requests [Requests]"),
        (5 + readahead).to_string(),
        "{csv}"
    );
    // One core's rows carry no "(s)", as casadm's.
    assert!(csv.contains(",Reads from core [4KiB Blocks],"), "{csv}");

    // Flushing cleans the written lines: one cleaner write of 8 KiB for the core.
    d.ok(&["-F", "-i", "1"]);
    let json = d.stats_json(1, Some(1));
    assert_eq!(json["requests"]["cleaner"]["count"], 1, "{json}");
    assert_eq!(json["blocks"]["cleaner_core_writes"]["count"], 2, "{json}");
    assert_eq!(json["blocks"]["cleaner_cache_reads"]["count"], 2, "{json}");
    assert_eq!(
        json["requests"]["total_requests"]["count"],
        5 + readahead + 1,
        "{json}"
    );
    let table = d.ok(&["-P", "-i", "1"]);
    assert!(table.contains("║ Read deferred "), "{table}");
    assert!(table.contains("║ Reads from core(s) "), "{table}");

    d.ok(&["-Z", "-i", "1"]);
    let json = d.stats_json(1, Some(1));
    for (section, row) in [
        ("requests", "prefetch_readahead"),
        ("requests", "cleaner"),
        ("requests", "user_requests"),
        ("requests", "total_requests"),
        ("requests", "read_deferred"),
        ("blocks", "prefetch_core_reads_readahead"),
        ("blocks", "cleaner_core_writes"),
    ] {
        assert_eq!(json[section][row]["count"], 0, "{section}.{row}: {json}");
    }
}

//! IO class statistics of one core through the daemon (`-P -j CORE -d [CLASS]`), in the table,
//! CSV and JSON, adding up to the cache-wide class figures and reset per core by `-Z -j`; and
//! casadm's "Inactive usage statistics" in `-P` of a cache loaded with a core missing. The row
//! names and order themselves are compared with casadm's in format.rs's unit tests.

mod common;

use common::*;
use hybridcache_nbd::Client;

/// The value of column `name` in record `record` (0 = the first after the header) of a CSV.
fn column(csv: &str, record: usize, name: &str) -> String {
    let mut lines = csv.lines();
    let head: Vec<&str> = lines.next().unwrap_or_default().split(',').collect();
    let values: Vec<&str> = lines
        .nth(record)
        .unwrap_or_else(|| panic!("no record {record}: {csv}"))
        .split(',')
        .collect();
    let i = head
        .iter()
        .position(|h| *h == name)
        .unwrap_or_else(|| panic!("no column {name}: {csv}"));
    values[i].to_string()
}

fn write(d: &Daemon, export: &str, writes: &[(usize, u64)]) {
    let mut c = Client::connect_unix(&d.nbd, export).expect("connect");
    for &(len, offset) in writes {
        c.write(&vec![0xa5; len], offset, false).expect("write");
    }
    c.flush().expect("flush");
    c.disconnect().unwrap();
}

const CLASSES: &str = "IO class id,IO class name,Eviction priority,Allocation\n\
                       0,unclassified,22,1\n1,request_size:gt:4096,1,1\n";

const OCC: &str = "Occupancy [4KiB Blocks]";
const DIRTY: &str = "Dirty [4KiB Blocks]";
const WFM: &str = "Write full misses [Requests]";

#[test]
fn a_cores_io_class_statistics_in_every_format() {
    let FileCache { dir, daemon: d, .. } = file_cache(64 << 20, 64 << 20, &["-c", "wb"]);
    let other = dir.path().join("other.img");
    sparse_file(&other, 64 << 20);
    d.ok(&["-A", "-i", "1", "-d", other.to_str().unwrap()]);
    let file = dir.path().join("classes.csv");
    std::fs::write(&file, CLASSES).unwrap();
    d.ok(&["-C", "-C", "-i", "1", "-f", file.to_str().unwrap()]);
    // Core 1: one 4 KiB write (class 0), one of 8 KiB (class 1); core 2: two of 8 KiB.
    write(&d, "cas1-1", &[(4096, 0), (8192, 1 << 20)]);
    write(&d, "cas1-2", &[(8192, 0), (8192, 1 << 20)]);

    let one =
        |core: &str, class: &str| d.ok(&["-P", "-i", "1", "-j", core, "-d", class, "-o", "csv"]);
    let c1 = one("1", "1");
    assert_eq!(column(&c1, 0, "IO class ID"), "1", "{c1}");
    assert_eq!(column(&c1, 0, "Core Id"), "1", "{c1}");
    assert_eq!(column(&c1, 0, OCC), "2", "{c1}");
    assert_eq!(column(&c1, 0, DIRTY), "2", "{c1}");
    assert_eq!(column(&c1, 0, WFM), "1", "{c1}");
    // One core's rows carry no "(s)", as casadm's.
    assert!(
        c1.contains(",Writes to exported object [4KiB Blocks],"),
        "{c1}"
    );
    assert_eq!(
        column(&c1, 0, "Writes to exported object [4KiB Blocks]"),
        "2"
    );
    let c2 = one("2", "1");
    assert_eq!(column(&c2, 0, OCC), "4", "{c2}");
    assert_eq!(column(&c2, 0, WFM), "2", "{c2}");
    assert_eq!(column(&one("1", "0"), 0, OCC), "1");
    assert_eq!(column(&one("2", "0"), 0, OCC), "0");
    // The cache-wide class is the sum over the cores.
    let all = d.ok(&["-P", "-i", "1", "-d", "1", "-o", "csv"]);
    assert_eq!(column(&all, 0, OCC), "6", "{all}");
    assert_eq!(column(&all, 0, WFM), "3", "{all}");
    assert!(!all.contains("Core Id"), "{all}");

    // -d without a class: every class of that core, one record each.
    let every = d.ok(&["-P", "-i", "1", "-j", "2", "-d", "-o", "csv"]);
    assert_eq!(every.lines().count(), 3, "{every}");
    assert_eq!(column(&every, 0, OCC), "0", "{every}");
    assert_eq!(column(&every, 1, OCC), "4", "{every}");
    assert_eq!(column(&every, 1, "Core Id"), "2", "{every}");
    let json: serde_json::Value =
        serde_json::from_str(&d.ok(&["-P", "-i", "1", "-j", "1", "-d", "-o", "json"])).unwrap();
    let classes = json.as_array().expect("one object per class");
    assert_eq!(classes.len(), 2, "{json}");
    assert_eq!(classes[1]["info"]["core_id"], 1, "{json}");
    assert_eq!(classes[1]["info"]["io_class_id"], 1, "{json}");
    assert_eq!(classes[1]["usage"]["occupancy"]["count"], 2, "{json}");
    assert_eq!(
        classes[1]["requests"]["write_full_misses"]["count"], 1,
        "{json}"
    );
    assert_eq!(classes[0]["usage"]["dirty"]["count"], 1, "{json}");
    let table = d.ok(&["-P", "-i", "1", "-j", "1", "-d", "1"]);
    assert!(
        table.contains("Core Id") && table.contains("IO class ID"),
        "{table}"
    );
    assert!(table.contains("║ Occupancy "), "{table}");
    assert!(table.contains("║ Writes to core "), "{table}");
    assert!(!table.contains("Error statistics"), "{table}");

    // -Z -j 1: core 1's share only.
    d.ok(&["-Z", "-i", "1", "-j", "1"]);
    assert_eq!(column(&one("1", "1"), 0, WFM), "0");
    assert_eq!(
        column(&one("1", "1"), 0, OCC),
        "2",
        "lines are not statistics"
    );
    assert_eq!(column(&one("2", "1"), 0, WFM), "2");
    let all = d.ok(&["-P", "-i", "1", "-d", "1", "-o", "csv"]);
    assert_eq!(column(&all, 0, WFM), "2", "{all}");

    let err = d.fails(&["-P", "-i", "1", "-j", "9", "-d", "1"]);
    assert!(err.contains("core 9 does not exist"), "{err}");
    let err = d.fails(&["-P", "-i", "1", "-j", "1", "-d", "5"]);
    assert!(err.contains("IO class 5 is not configured"), "{err}");
}

/// A cache loaded with a core's device missing: `-P` adds casadm's "Inactive usage
/// statistics" (that core's lines), until the core is attached again.
#[test]
fn inactive_usage_table_while_a_core_is_missing() {
    let FileCache {
        dir,
        cache,
        core,
        daemon: mut d,
        ..
    } = file_cache(64 << 20, 64 << 20, &["-c", "wb"]);
    let other = dir.path().join("other.img");
    sparse_file(&other, 64 << 20);
    d.ok(&["-A", "-i", "1", "-d", other.to_str().unwrap()]);
    // Core 1: 64 KiB dirty (16 blocks), core 2: 8 KiB (2 blocks).
    write(&d, "cas1-1", &[(65536, 0)]);
    write(&d, "cas1-2", &[(8192, 0)]);
    let before = d.stats_json(1, Some(1));
    assert_eq!(before["usage"]["occupancy"]["count"], 16, "{before}");
    let table = d.ok(&["-P", "-i", "1"]);
    assert!(!table.contains("Inactive usage"), "{table}");
    d.ok(&["-T", "-i", "1", "-n"]);
    assert!(d.stop(), "{}", d.log_text());
    let moved = dir.path().join("core.moved");
    std::fs::rename(&core, &moved).unwrap();

    let d = Daemon::start(dir.path());
    let out = d.ok(&["-S", "-d", cache.to_str().unwrap(), "--load"]);
    assert!(out.contains("core 1 of cache 1 is inactive"), "{out}");
    let json = d.stats_json(1, None);
    let i = &json["inactive_usage"];
    assert_eq!(i["inactive_occupancy"]["count"], 16, "{json}");
    assert_eq!(i["inactive_dirty"]["count"], 16, "{json}");
    assert_eq!(i["inactive_clean"]["count"], 0, "{json}");
    // Dirty: 16 of the 18 blocks every core holds.
    assert_eq!(i["inactive_dirty"]["percent"], 88.9, "{json}");
    let table = d.ok(&["-P", "-i", "1"]);
    assert!(table.contains("Inactive usage statistics"), "{table}");
    assert!(table.contains("║ Inactive Occupancy "), "{table}");
    let csv = d.ok(&["-P", "-i", "1", "-o", "csv"]);
    assert_eq!(
        column(&csv, 0, "Inactive Dirty [4KiB Blocks]"),
        "16",
        "{csv}"
    );
    assert_eq!(column(&csv, 0, "Inactive Core Devices"), "1", "{csv}");
    let usage = d.ok(&["-P", "-i", "1", "-f", "usage"]);
    assert!(usage.contains("Inactive usage statistics"), "{usage}");
    // Not in a core's statistics.
    let core2 = d.ok(&["-P", "-i", "1", "-j", "2"]);
    assert!(!core2.contains("Inactive usage"), "{core2}");

    std::fs::rename(&moved, &core).unwrap();
    d.ok(&["-A", "-i", "1", "-j", "1", "-d", core.to_str().unwrap()]);
    let table = d.ok(&["-P", "-i", "1"]);
    assert!(!table.contains("Inactive usage"), "{table}");
}

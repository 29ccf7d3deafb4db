//! Open CAS IO class files and the classifier (docs/io-classes.md): what loads, what is refused
//! and where, and which class each request lands in.

use hybridcache_engine::ioclass::{
    ClassId, IoClassError, IoClasses, IoRequest, LoadOptions, HEADER, MAX_NAME_LEN,
};
use proptest::prelude::*;

const STRICT: LoadOptions = LoadOptions {
    ignore_unsupported: false,
};
const LENIENT: LoadOptions = LoadOptions {
    ignore_unsupported: true,
};

/// utils/ioclass-config.csv as Open CAS ships it (open-cas-linux 94e8ca0).
const SHIPPED_EXAMPLE: &str = "IO class id,IO class name,Eviction priority,Allocation
0,unclassified,22,1
1,metadata&done,0,1
11,file_size:le:4096&done,9,1
12,file_size:le:16384&done,10,1
13,file_size:le:65536&done,11,1
14,file_size:le:262144&done,12,1
15,file_size:le:1048576&done,13,1
16,file_size:le:4194304&done,14,1
17,file_size:le:16777216&done,15,1
18,file_size:le:67108864&done,16,1
19,file_size:le:268435456&done,17,1
20,file_size:le:1073741824&done,18,1
21,file_size:gt:1073741824&done,19,1
22,direct&done,20,1
";

fn req(size: u64, lba: u64) -> IoRequest {
    IoRequest {
        core_id: 1,
        lba,
        size,
        write: false,
    }
}

/// A table of class 0 plus the given class lines.
fn table(lines: &str) -> IoClasses {
    let text = format!("{HEADER}\n0,unclassified,22,1\n{lines}\n");
    IoClasses::parse(&text, &STRICT).unwrap_or_else(|e| panic!("{lines}: {e}"))
}

/// The error for a file whose third line is `line`.
fn refused(line: &str) -> IoClassError {
    refused_with(line, &STRICT)
}

fn refused_with(line: &str, opts: &LoadOptions) -> IoClassError {
    let text = format!("{HEADER}\n0,unclassified,22,1\n{line}\n");
    match IoClasses::parse(&text, opts) {
        Ok(t) => panic!("{line:?} was accepted: {t:?}"),
        Err(e) => e,
    }
}

fn assert_at(e: &IoClassError, line: usize, column: usize, words: &str) {
    assert_eq!((e.line, e.column), (line, column), "{e}");
    assert!(e.message.contains(words), "{e:?} should mention {words:?}");
}

#[test]
fn the_shipped_example_loads_once_file_system_rules_are_ignored() {
    let e = IoClasses::parse(SHIPPED_EXAMPLE, &STRICT).unwrap_err();
    assert_at(&e, 3, 3, "\"metadata\"");

    let t = IoClasses::parse(SHIPPED_EXAMPLE, &LENIENT).unwrap();
    let ids: Vec<ClassId> = t.iter().map(|c| c.id).collect();
    assert_eq!(ids, [0, 1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]);
    let c0 = t.get(0).unwrap();
    assert_eq!(
        (c0.name.as_str(), c0.eviction_priority, c0.allocation),
        ("unclassified", Some(22), 100)
    );
    assert_eq!(t.get(11).unwrap().name, "file_size:le:4096&done");
    assert!(t.get(22).unwrap().has_unsupported_conditions());
    assert!(!t.get(0).unwrap().has_unsupported_conditions());
    // Every rule needs a file system, so on a block export everything stays unclassified.
    for r in [req(512, 0), req(1 << 20, 12345), req(4096, 1 << 30)] {
        assert_eq!(t.classify(&r), 0);
    }
}

/// hybridcache's own example, packaging/ioclass-config.csv (docs/io-classes.md, "The example
/// file"): block-level rules only, so it loads strictly, and every size lands in its class.
#[test]
fn the_packaged_example_loads_strictly_and_sorts_by_size() {
    let text = include_str!("../../../packaging/ioclass-config.csv");
    let t = IoClasses::parse(text, &STRICT).unwrap_or_else(|e| panic!("{e}"));
    let ids: Vec<ClassId> = t.iter().map(|c| c.id).collect();
    assert_eq!(ids, [0, 1, 2, 3, 4, 5]);
    assert!(t.iter().all(|c| !c.has_unsupported_conditions()));
    for (size, class) in [
        (512, 1),
        (4096, 1),
        (8192, 2),
        (16384, 2),
        (65536, 3),
        (131072, 4),
        (262144, 4),
        (262145, 5),
        (1 << 20, 5),
    ] {
        assert_eq!(t.classify(&req(size, 0)), class, "{size} bytes");
    }
    assert_eq!(t.get(5).unwrap().allocation, 50);
    assert_eq!(t.get(1).unwrap().eviction_priority, Some(1));
}

/// Open CAS master's utils/ioclass-config.csv (open-cas-linux e7ddd7b, "Add prefetch support"),
/// verbatim in tests/data: class 33 is `prefetch`. Its other rules need a file system, so it loads
/// with `ignore_unsupported`; strictly it is refused at its first file-system rule, not at id 33.
#[test]
fn open_cas_master_file_with_class_33_loads() {
    let text = include_str!("data/open-cas-master-ioclass-config.csv");
    let e = IoClasses::parse(text, &STRICT).unwrap_err();
    assert_at(&e, 3, 3, "\"metadata\"");

    let t = IoClasses::parse(text, &LENIENT).unwrap_or_else(|e| panic!("{e}"));
    let ids: Vec<ClassId> = t.iter().map(|c| c.id).collect();
    assert_eq!(
        ids,
        [0, 1, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 33]
    );
    let prefetch = t.get(33).unwrap();
    assert_eq!(
        (prefetch.name.as_str(), prefetch.eviction_priority),
        ("prefetch", Some(21))
    );
    assert!(!prefetch.has_unsupported_conditions());
    // `prefetch` is a name, not a rule: no request is classified into class 33.
    for r in [req(512, 0), req(1 << 20, 12345)] {
        assert_eq!(t.classify(&r), 0);
    }
    assert_eq!(IoClasses::parse(&t.to_csv(), &LENIENT).unwrap(), t);
    // Only class 33 may be called `prefetch`; class 33 may also hold an ordinary rule.
    let e = refused("5,prefetch,1,1");
    assert_at(&e, 3, 3, "only class 33");
    assert_eq!(
        table("33,request_size:gt:4096,1,1").classify(&req(8192, 0)),
        33
    );
}

/// Open CAS v26.03.2's utils/ioclass-config.csv (open-cas-linux 44d3418), verbatim in
/// tests/data: file-system rules only, so refused by default and loaded with
/// `ignore_unsupported` (docs/io-classes.md says why the default stays strict).
#[test]
fn open_cas_v26_03_2_file_loads_with_ignore_unsupported() {
    let text = include_str!("data/open-cas-v26.03.2-ioclass-config.csv");
    let e = IoClasses::parse(text, &STRICT).unwrap_err();
    assert_at(&e, 3, 3, "ignore_unsupported");
    let t = IoClasses::parse(text, &LENIENT).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(t.len(), 14);
    assert!(t.get(22).unwrap().has_unsupported_conditions());
}

#[test]
fn the_examples_of_domain_md_load() {
    let t = IoClasses::parse(
        &format!(
            "{HEADER}\n0,unclassified,22,0\n1,request_size:le:131072,1,1\n\
             2,request_size:ge:8192&request_size:le:16384&done,3,1\n3,lba:ge:2000&lba:le:5000,5,0.2\n"
        ),
        &STRICT,
    )
    .unwrap();
    assert_eq!(t.get(0).unwrap().allocation, 0);
    assert_eq!(t.get(3).unwrap().allocation, 20);
    assert_eq!(t.get(3).unwrap().allocation_str(), "0.20");
    assert_eq!(t.classify(&req(4096, 0)), 1);
    assert_eq!(
        t.classify(&req(8192, 3000)),
        2,
        "done on class 2 keeps class 3 out"
    );
    assert_eq!(t.classify(&req(4096, 3000)), 3, "class 3 overrides class 1");
    assert_eq!(t.classify(&req(1 << 20, 3000)), 3);
    assert_eq!(t.classify(&req(1 << 20, 0)), 0);
}

#[test]
fn default_is_open_cas_before_any_file() {
    let t = IoClasses::default();
    assert_eq!(t.len(), 1);
    let c = t.get(0).unwrap();
    assert_eq!(
        (c.name.as_str(), c.eviction_priority, c.allocation),
        ("unclassified", Some(255), 100)
    );
    assert_eq!(t.to_csv(), format!("{HEADER}\n0,unclassified,255,1.00\n"));
    assert_eq!(t.classify(&req(4096, 7)), 0);
}

#[test]
fn every_operator() {
    for (rule, size, expected) in [
        ("request_size:eq:4096", 4096, true),
        ("request_size:eq:4096", 4097, false),
        ("request_size:4096", 4096, true),
        ("request_size:4096", 512, false),
        ("request_size:ne:4096", 512, true),
        ("request_size:ne:4096", 4096, false),
        ("request_size:lt:4096", 4095, true),
        ("request_size:lt:4096", 4096, false),
        ("request_size:gt:4096", 4097, true),
        ("request_size:gt:4096", 4096, false),
        ("request_size:le:4096", 4096, true),
        ("request_size:le:4096", 4097, false),
        ("request_size:ge:4096", 4096, true),
        ("request_size:ge:4096", 4095, false),
    ] {
        let t = table(&format!("5,{rule},1,1"));
        let want = if expected { 5 } else { 0 };
        assert_eq!(t.classify(&req(size, 0)), want, "{rule} on {size} bytes");
    }
}

#[test]
fn lba_tests_the_first_sector_only() {
    let t = table("1,lba:ge:2048,1,1");
    // Starts before sector 2048 and runs far past it: still not in the class, as in Open CAS.
    assert_eq!(t.classify(&req(1 << 20, 2047)), 0);
    assert_eq!(t.classify(&req(512, 2048)), 1);
}

#[test]
fn core_id_and_io_direction() {
    let t =
        table("1,core_id:eq:2,1,1\n2,io_direction:write,1,1\n3,io_direction:read&core_id:3,1,1");
    let r = |core_id, write| IoRequest {
        core_id,
        lba: 0,
        size: 4096,
        write,
    };
    assert_eq!(t.classify(&r(2, false)), 1);
    assert_eq!(t.classify(&r(2, true)), 2);
    assert_eq!(t.classify(&r(1, true)), 2);
    assert_eq!(t.classify(&r(1, false)), 0);
    assert_eq!(t.classify(&r(3, false)), 3);
    assert_eq!(t.classify(&r(3, true)), 2);
}

#[test]
fn and_needs_every_condition_or_needs_one() {
    let t = table("1,request_size:ge:4096&request_size:le:8192,1,1");
    assert_eq!(t.classify(&req(4096, 0)), 1);
    assert_eq!(t.classify(&req(512, 0)), 0);
    assert_eq!(t.classify(&req(16384, 0)), 0);

    let t = table("1,request_size:lt:4096|request_size:gt:8192,1,1");
    assert_eq!(t.classify(&req(512, 0)), 1);
    assert_eq!(t.classify(&req(16384, 0)), 1);
    assert_eq!(t.classify(&req(4096, 0)), 0);
}

#[test]
fn a_later_match_overrides_and_done_stops() {
    let t = table("1,request_size:le:65536,1,1\n2,lba:lt:100,1,1");
    assert_eq!(t.classify(&req(4096, 10)), 2);
    assert_eq!(t.classify(&req(4096, 1000)), 1);

    let t = table("1,request_size:le:65536&done,1,1\n2,lba:lt:100,1,1");
    assert_eq!(
        t.classify(&req(4096, 10)),
        1,
        "done ends the walk at class 1"
    );
    assert_eq!(
        t.classify(&req(1 << 20, 10)),
        2,
        "done only counts when its rule matches"
    );

    // Under `|`, reaching done always matches: this class takes everything.
    let t = table("1,request_size:lt:512|done,1,1\n2,lba:lt:100,1,1");
    assert_eq!(t.classify(&req(1 << 20, 10)), 1);

    // Conditions after done are never evaluated.
    let t = table("1,done&request_size:eq:7,1,1\n2,lba:lt:100,1,1");
    assert_eq!(t.classify(&req(4096, 10)), 1);
}

#[test]
fn io_class_tests_the_class_assigned_so_far() {
    let t = table(
        "1,request_size:le:4096,1,1\n2,io_class:1&lba:lt:100,1,1\n3,io_class:ne:0&io_class:lt:2,1,1",
    );
    // Small and low: 1, then 2 (io_class is 1), then not 3 (io_class is 2).
    assert_eq!(t.classify(&req(512, 10)), 2);
    // Small and high: 1, not 2, then 3 (io_class is 1).
    assert_eq!(t.classify(&req(512, 1000)), 3);
    // Large: nothing matches; class 3 sees io_class 0.
    assert_eq!(t.classify(&req(1 << 20, 10)), 0);
}

const UNSUPPORTED: [&str; 10] = [
    "metadata",
    "direct",
    "file_size:le:4096",
    "directory:/var/lib/mysql",
    "extension:log",
    "file_name_prefix:tmp",
    "file_offset:gt:0",
    "pid:eq:1",
    "process_name:fio",
    "wlth:2",
];

#[test]
fn file_system_rules_are_refused_by_default_and_never_true_when_ignored() {
    for rule in UNSUPPORTED {
        let e = refused(&format!("1,lba:lt:10&{rule},1,1"));
        assert_at(&e, 3, 13, &format!("\"{rule}\""));
        assert!(e.message.contains("ignore_unsupported"), "{e}");

        let text = format!(
            "{HEADER}\n0,unclassified,22,1\n1,{rule}&done,1,1\n2,{rule}|request_size:lt:4096,1,1\n"
        );
        let t = IoClasses::parse(&text, &LENIENT).unwrap_or_else(|e| panic!("{rule}: {e}"));
        assert!(t.get(1).unwrap().has_unsupported_conditions());
        let after_done = format!("{HEADER}\n1,done&{rule},1,1\n");
        let t2 = IoClasses::parse(&after_done, &LENIENT).unwrap();
        assert!(t2.get(1).unwrap().has_unsupported_conditions());
        assert_eq!(t2.classify(&req(512, 0)), 1);
        assert!(IoClasses::parse(&after_done, &STRICT).is_err());
        // Under `&` the class never matches; under `|` the condition just drops out.
        assert_eq!(t.classify(&req(512, 0)), 2, "{rule}");
        assert_eq!(t.classify(&req(8192, 0)), 0, "{rule}");
    }
}

#[test]
fn ignored_file_system_rules_still_need_their_syntax() {
    for (line, column, words) in [
        ("1,metadata:1,1,1", 11, "takes no value"),
        ("1,direct:,1,1", 9, "takes no value"),
        ("1,extension:,1,1", 13, "needs a value"),
        ("1,directory,1,1", 12, "needs a value"),
        ("1,pid,1,1", 6, "needs a value"),
        ("1,file_size:lx:1,1,1", 13, "unknown operator \"lx\""),
        ("1,file_offset:gt:x,1,1", 18, "invalid number \"x\""),
    ] {
        assert_at(&refused_with(line, &LENIENT), 3, column, words);
    }
    let long = format!("1,process_name:{},1,1", "p".repeat(256));
    assert_at(&refused_with(&long, &LENIENT), 3, 16, "at most 255");
    let fine = format!("1,process_name:{},1,1", "p".repeat(255));
    assert!(IoClasses::parse(&format!("{HEADER}\n{fine}\n"), &LENIENT).is_ok());
}

#[test]
fn malformed_lines_are_refused_at_their_line_and_column() {
    for (line, column, words) in [
        ("x,request_size:lt:4096,1,1", 1, "invalid IO class id \"x\""),
        (",request_size:lt:4096,1,1", 1, "missing IO class id"),
        ("-1,lba:gt:1,1,1", 1, "invalid IO class id"),
        ("1,prefetch,1,1", 3, "only class 33 may use it"),
        ("34,lba:gt:1,1,1", 1, "34 is out of range"),
        ("0,unclassified,1,1", 1, "defined twice (first on line 2)"),
        (
            "1,lba:gt:1,256,1",
            12,
            "eviction priority 256 is out of range",
        ),
        ("1,lba:gt:1,high,1", 12, "invalid eviction priority"),
        ("1,lba:gt:1,1,1.5", 14, "above 1.00"),
        ("1,lba:gt:1,1,2", 14, "above 1.00"),
        ("1,lba:gt:1,1,0.123", 14, "more than two decimal places"),
        ("1,lba:gt:1,1,-1", 14, "invalid allocation \"-1\""),
        ("1,lba:gt:1,1,", 14, "missing allocation"),
        ("1,lba:gt:1,1", 13, "found 3"),
        ("1,lba:gt:1", 11, "found 2"),
        ("1,lba:gt:1,1,1,9", 16, "found 5"),
        ("1,,1,1", 3, "missing IO class name"),
        ("1,size:lt:4096,1,1", 3, "unknown condition \"size\""),
        ("1,Done,1,1", 3, "unknown condition \"Done\""),
        ("1,:5,1,1", 3, "unknown condition \":5\""),
        ("1,request_size:lx:4096,1,1", 16, "unknown operator \"lx\""),
        ("1,request_size:EQ:4096,1,1", 16, "unknown operator \"EQ\""),
        ("1,request_size::4096,1,1", 16, "unknown operator \"\""),
        ("1,lba:ge:abc,1,1", 10, "invalid number \"abc\""),
        ("1,lba:ge:12k,1,1", 10, "invalid number \"12k\""),
        ("1,lba:ge:1:2,1,1", 10, "invalid number \"1:2\""),
        ("1,lba:-5,1,1", 7, "invalid number \"-5\""),
        ("1,lba:ge:,1,1", 10, "needs a number"),
        ("1,lba,1,1", 6, "needs a value"),
        ("1,lba:,1,1", 7, "needs a value"),
        ("1,lba:ge:99999999999999999999,1,1", 10, "too large"),
        ("1,lba:ge:1 & done,1,1", 10, "spaces"),
        ("1,lba:ge:1&lba:le:9|done,1,1", 20, "both `&` and `|`"),
        ("1,lba:ge:1|lba:le:9&done,1,1", 20, "both `&` and `|`"),
        ("1,lba:ge:1&,1,1", 12, "expected a condition after `&`"),
        ("1,&lba:ge:1,1,1", 3, "expected a condition before `&`"),
        ("1,lba:ge:1||done,1,1", 12, "expected a condition after `|`"),
        ("1,done:1,1,1", 7, "takes no value"),
        ("1,core_id:4096,1,1", 11, "core id 4096 is out of range"),
        ("1,core_id:lt:5000,1,1", 14, "core id 5000 is out of range"),
        ("1,io_direction:Read,1,1", 16, "invalid direction \"Read\""),
        ("1,io_direction:r,1,1", 16, "invalid direction \"r\""),
        ("1,io_direction,1,1", 15, "needs a value"),
        ("1,unclassified,1,1", 3, "class 0's name"),
        ("1,\"lba:ge:1,1,1", 3, "never closed"),
        ("1,\"lba:ge:1\"x,1,1", 13, "after a closing quotation mark"),
        ("1,\"lba\"\"x\",1,1", 7, "not allowed in an IO class name"),
        ("1,\"lba,x\",1,1", 7, "not allowed in an IO class name"),
        ("1,lba:ge:1é,1,1", 11, "not allowed in an IO class name"),
    ] {
        assert_at(&refused(line), 3, column, words);
    }
}

#[test]
fn trailing_whitespace_is_trimmed_like_casadm() {
    let t = table("  1 ,  lba:ge:1\t , 3 ,\t0.5  ");
    let c = t.get(1).unwrap();
    assert_eq!(
        (c.name.as_str(), c.eviction_priority, c.allocation),
        ("lba:ge:1", Some(3), 50)
    );
}

#[test]
fn the_display_names_line_and_column() {
    let e = refused("1,lba:gt:1,256,1");
    assert!(
        e.to_string()
            .starts_with("line 3, column 12: eviction priority 256"),
        "{e}"
    );
}

#[test]
fn class_zero_is_unclassified_and_implicit_when_missing() {
    let text = format!("{HEADER}\n0,everything,22,1\n");
    assert_at(
        &IoClasses::parse(&text, &STRICT).unwrap_err(),
        2,
        3,
        "class 0 must be named `unclassified`",
    );

    let t = IoClasses::parse(&format!("{HEADER}\n5,lba:lt:8,,0.5\n"), &STRICT).unwrap();
    assert_eq!(t.len(), 2);
    let c0 = t.get(0).unwrap();
    assert_eq!((c0.eviction_priority, c0.allocation), (Some(255), 100));
    let c5 = t.get(5).unwrap();
    assert!(c5.is_pinned());
    assert_eq!(c5.allocation, 50);
    assert_eq!(t.classify(&req(512, 1)), 5);
    assert!(t.get(4).is_none());
}

#[test]
fn allocation_takes_the_forms_open_cas_takes() {
    for (text, hundredths) in [
        ("0", 0),
        ("1", 100),
        ("0.5", 50),
        (".5", 50),
        ("0.05", 5),
        ("0.50", 50),
        ("1.0", 100),
        ("1.00", 100),
    ] {
        let t = table(&format!("1,lba:ge:0,1,{text}"));
        assert_eq!(t.get(1).unwrap().allocation, hundredths, "{text}");
    }
}

#[test]
fn names_up_to_1023_characters() {
    let name = |len: usize| format!("lba:ge:{}1", "0".repeat(len - 8));
    assert_eq!(name(MAX_NAME_LEN).len(), MAX_NAME_LEN);
    let t = table(&format!("1,{},1,1", name(MAX_NAME_LEN)));
    assert_eq!(t.classify(&req(512, 1)), 1);
    assert_at(
        &refused(&format!("1,{},1,1", name(MAX_NAME_LEN + 1))),
        3,
        3,
        "at most 1023",
    );
}

#[test]
fn all_34_classes_load() {
    let mut text = format!("{HEADER}\n");
    for id in 0..=33 {
        if id == 0 {
            text.push_str("0,unclassified,,1\n");
        } else {
            text.push_str(&format!("{id},request_size:ge:{id},{id},0.{:02}\n", id * 3));
        }
    }
    let t = IoClasses::parse(&text, &STRICT).unwrap();
    assert_eq!(t.len(), 34);
    assert_eq!(t.classify(&req(33, 0)), 33);
    assert_eq!(t.classify(&req(32, 0)), 32);
    assert_eq!(t.classify(&req(7, 0)), 7);
    assert_eq!(t.to_csv(), text.replace(",1\n", ",1.00\n"));
}

#[test]
fn the_header_is_checked_and_may_be_reordered() {
    for (header, column, words) in [
        (
            "IO class id,IO class name,Eviction priority,Allocaton",
            45,
            "unknown column \"Allocaton\"",
        ),
        (
            "IO class id,IO class name,Eviction priority",
            44,
            "lacks the column \"Allocation\"",
        ),
        (
            "IO class id,IO class name,IO class id,Allocation",
            27,
            "appears twice",
        ),
        (
            "IO class id,IO class name,Eviction priority,Allocation,",
            56,
            "empty column name",
        ),
        (
            "io class id,IO class name,Eviction priority,Allocation",
            1,
            "unknown column",
        ),
        ("0,unclassified,22,1", 1, "unknown column \"0\""),
    ] {
        let e = IoClasses::parse(&format!("{header}\n1,lba:ge:1,1,1\n"), &STRICT).unwrap_err();
        assert_at(&e, 1, column, words);
    }

    let t = IoClasses::parse(
        "Allocation, IO class name ,IO class id,Eviction priority\n0.25,lba:lt:8,4,\n",
        &STRICT,
    )
    .unwrap();
    let c = t.get(4).unwrap();
    assert_eq!((c.allocation, c.eviction_priority), (25, None));
    assert_eq!(t.classify(&req(512, 1)), 4);
    assert_eq!(
        t.to_csv(),
        format!("{HEADER}\n0,unclassified,255,1.00\n4,lba:lt:8,,0.25\n")
    );
    // In a reordered file the errors still point at the right field.
    let e = IoClasses::parse(
        "Allocation,IO class name,IO class id,Eviction priority\n0.25,lba:lt:8,4,300\n",
        &STRICT,
    )
    .unwrap_err();
    assert_at(&e, 2, 17, "300 is out of range");
}

#[test]
fn empty_files_and_header_only_files_are_refused() {
    for text in ["", "\n", "  \r\n\n"] {
        assert_at(
            &IoClasses::parse(text, &STRICT).unwrap_err(),
            1,
            1,
            "the file is empty",
        );
    }
    assert_at(
        &IoClasses::parse(HEADER, &STRICT).unwrap_err(),
        2,
        1,
        "expected an IO class after the header",
    );
    assert_at(
        &IoClasses::parse(&format!("{HEADER}\n\n"), &STRICT).unwrap_err(),
        3,
        1,
        "expected an IO class after the header",
    );
}

#[test]
fn crlf_blank_lines_bom_and_quotes_are_what_a_user_expects() {
    let text = format!(
        "\u{feff}\r\n{HEADER}\r\n\r\n0,unclassified,22,1\r\n   \r\n\"1\",\"lba:lt:8\",\"\",\"0.5\"\r\n"
    );
    let t = IoClasses::parse(&text, &STRICT).unwrap();
    let c = t.get(1).unwrap();
    assert_eq!(
        (c.name.as_str(), c.eviction_priority, c.allocation),
        ("lba:lt:8", None, 50)
    );
    // Line numbers count the blank lines: line 6 is the last class line.
    let bad = text.replace("\"0.5\"", "\"1.5\"");
    assert_at(
        &IoClasses::parse(&bad, &STRICT).unwrap_err(),
        6,
        20,
        "above 1.00",
    );
}

#[test]
fn to_csv_round_trips() {
    let text = format!(
        "{HEADER}\n3,lba:ge:2000&lba:le:5000,5,0.2\n0,unclassified,,0\n\
         1,request_size:ge:+8192&request_size:le:016384&done,3,.5\n2,io_direction:write|core_id:3,,1\n"
    );
    let t = IoClasses::parse(&text, &STRICT).unwrap();
    let csv = t.to_csv();
    assert_eq!(
        csv,
        format!(
            "{HEADER}\n0,unclassified,,0.00\n1,request_size:ge:+8192&request_size:le:016384&done,3,0.50\n\
             2,io_direction:write|core_id:3,,1.00\n3,lba:ge:2000&lba:le:5000,5,0.20\n"
        )
    );
    let again = IoClasses::parse(&csv, &STRICT).unwrap();
    assert_eq!(again, t);
    assert_eq!(again.to_csv(), csv);

    let shipped = IoClasses::parse(SHIPPED_EXAMPLE, &LENIENT).unwrap();
    let csv = shipped.to_csv();
    assert_eq!(csv, SHIPPED_EXAMPLE.replace(",1\n", ",1.00\n"));
    assert_eq!(IoClasses::parse(&csv, &LENIENT).unwrap(), shipped);
}

// ---------------------------------------------------------------------------------------------
// Random tables against a model of Open CAS's classifier.

const OPS: [&str; 6] = ["eq", "ne", "lt", "gt", "le", "ge"];

#[derive(Debug, Clone)]
enum Cond {
    /// Operator index into OPS, or 6 for a bare value (eq).
    Size(usize, u64),
    Lba(usize, u64),
    Core(usize, u64),
    Class(usize, u64),
    Write(bool),
    Done,
    Fs(&'static str),
}

impl Cond {
    fn text(&self) -> String {
        let num = |token: &str, op: usize, n: u64| match OPS.get(op) {
            Some(op) => format!("{token}:{op}:{n}"),
            None => format!("{token}:{n}"),
        };
        match self {
            Cond::Size(op, n) => num("request_size", *op, *n),
            Cond::Lba(op, n) => num("lba", *op, *n),
            Cond::Core(op, n) => num("core_id", *op, *n),
            Cond::Class(op, n) => num("io_class", *op, *n),
            Cond::Write(true) => "io_direction:write".into(),
            Cond::Write(false) => "io_direction:read".into(),
            Cond::Done => "done".into(),
            Cond::Fs(s) => s.to_string(),
        }
    }

    /// (yes, stop), as Open CAS's condition tests return them.
    fn test(&self, r: &IoRequest, current: ClassId) -> (bool, bool) {
        let cmp = |op: usize, v: u64, n: u64| match op {
            1 => v != n,
            2 => v < n,
            3 => v > n,
            4 => v <= n,
            5 => v >= n,
            _ => v == n,
        };
        match self {
            Cond::Size(op, n) => (cmp(*op, r.size, *n), false),
            Cond::Lba(op, n) => (cmp(*op, r.lba, *n), false),
            Cond::Core(op, n) => (cmp(*op, u64::from(r.core_id), *n), false),
            Cond::Class(op, n) => (cmp(*op, u64::from(current), *n), false),
            Cond::Write(w) => (r.write == *w, false),
            Cond::Done => (true, true),
            Cond::Fs(_) => (false, false),
        }
    }
}

#[derive(Debug, Clone)]
struct Class {
    conds: Vec<Cond>,
    or: bool,
    priority: Option<u8>,
    allocation: u8,
    style: u8,
}

/// A transcription of `cas_cls_process_rule` and `cas_cls_classify` (classifier.c).
fn model(classes: &[(ClassId, Class)], r: &IoRequest) -> ClassId {
    let mut sorted: Vec<&(ClassId, Class)> = classes.iter().collect();
    sorted.sort_by_key(|(id, _)| *id);
    let mut part = 0;
    for (id, class) in sorted {
        let (mut yes, mut stop) = (false, false);
        for (i, c) in class.conds.iter().enumerate() {
            let and = i > 0 && !class.or;
            if !yes && and {
                break;
            }
            let (rr_yes, rr_stop) = c.test(r, part);
            yes = if and { rr_yes && yes } else { rr_yes || yes };
            stop = rr_stop;
            if stop {
                break;
            }
        }
        if yes {
            part = *id;
        }
        if stop {
            break;
        }
    }
    part
}

fn allocation_text(h: u8, style: u8) -> String {
    match (style, h) {
        (0, _) => format!("{}.{:02}", h / 100, h % 100),
        (_, 100) => "1".into(),
        (_, 0) => "0".into(),
        (1, h) if h % 10 == 0 => format!("0.{}", h / 10),
        (1, h) => format!("0.{h:02}"),
        (_, h) if h % 10 == 0 => format!(".{}", h / 10),
        (_, h) => format!(".{h:02}"),
    }
}

fn cond() -> impl Strategy<Value = Cond> {
    let sizes = prop::sample::select(vec![0u64, 512, 4096, 8192, 65536, 131072]);
    let lbas = prop::sample::select(vec![0u64, 8, 2048, 5000, 1 << 20]);
    prop_oneof![
        4 => (0..7usize, sizes).prop_map(|(o, n)| Cond::Size(o, n)),
        3 => (0..7usize, lbas).prop_map(|(o, n)| Cond::Lba(o, n)),
        2 => (0..7usize, 0u64..4).prop_map(|(o, n)| Cond::Core(o, n)),
        2 => (0..7usize, 0u64..34).prop_map(|(o, n)| Cond::Class(o, n)),
        2 => any::<bool>().prop_map(Cond::Write),
        2 => Just(Cond::Done),
        1 => prop::sample::select(vec![
            "metadata", "direct", "file_size:le:4096", "extension:log", "pid:7", "directory:/var",
        ])
        .prop_map(Cond::Fs),
    ]
}

fn class() -> impl Strategy<Value = Class> {
    (
        prop::collection::vec(cond(), 1..5),
        any::<bool>(),
        prop::option::of(any::<u8>()),
        0u8..=100,
        0u8..3,
    )
        .prop_map(|(conds, or, priority, allocation, style)| Class {
            conds,
            or,
            priority,
            allocation,
            style,
        })
}

fn request() -> impl Strategy<Value = IoRequest> {
    (
        prop::sample::select(vec![0u64, 512, 4096, 8192, 8193, 65536, 131072, 1 << 20]),
        prop_oneof![
            prop::sample::select(vec![0u64, 7, 8, 9, 2048, 5000, 1 << 20]),
            any::<u64>()
        ],
        0u16..5,
        any::<bool>(),
    )
        .prop_map(|(size, lba, core_id, write)| IoRequest {
            core_id,
            lba,
            size,
            write,
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn random_tables_round_trip_and_classify_like_open_cas(
        classes in prop::collection::btree_map(1u8..=33, class(), 0..10),
        class0 in prop::option::of((prop::option::of(any::<u8>()), 0u8..=100)),
        crlf in any::<bool>(),
        padded in any::<bool>(),
        rotate in any::<usize>(),
        requests in prop::collection::vec(request(), 32),
    ) {
        let classes: Vec<(ClassId, Class)> = classes.into_iter().collect();
        let eol = if crlf { "\r\n" } else { "\n" };
        let pad = if padded { " " } else { "" };
        let mut lines: Vec<String> = classes
            .iter()
            .map(|(id, c)| {
                let sep = if c.or { "|" } else { "&" };
                let rule: Vec<String> = c.conds.iter().map(Cond::text).collect();
                let prio = c.priority.map_or(String::new(), |p| p.to_string());
                format!(
                    "{pad}{id}{pad},{pad}{}{pad},{prio},{pad}{}",
                    rule.join(sep),
                    allocation_text(c.allocation, c.style)
                )
            })
            .collect();
        if let Some((prio, alloc)) = class0 {
            let prio = prio.map_or(String::new(), |p| p.to_string());
            lines.push(format!("0,unclassified,{prio},{}", allocation_text(alloc, 0)));
        }
        if lines.is_empty() {
            lines.push("0,unclassified,22,1".into());
        }
        let n = lines.len();
        lines.rotate_left(rotate % n);
        let text = format!("{HEADER}{eol}{}{eol}", lines.join(eol));

        let t = IoClasses::parse(&text, &LENIENT).map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        let csv = t.to_csv();
        let again = IoClasses::parse(&csv, &LENIENT).map_err(|e| TestCaseError::fail(format!("{e}\n{csv}")))?;
        prop_assert_eq!(&again, &t);
        prop_assert_eq!(again.to_csv(), csv);

        let has_fs = classes.iter().any(|(_, c)| c.conds.iter().any(|c| matches!(c, Cond::Fs(_))));
        match IoClasses::parse(&text, &STRICT) {
            Ok(strict) => { prop_assert!(!has_fs); prop_assert_eq!(&strict, &t); }
            Err(_) => prop_assert!(has_fs),
        }

        for (id, c) in &classes {
            let got = t.get(*id).expect("class loaded");
            prop_assert_eq!(got.eviction_priority, c.priority);
            prop_assert_eq!(got.allocation, c.allocation);
        }
        for r in &requests {
            let want = model(&classes, r);
            prop_assert_eq!(t.classify(r), want, "request {:?}\n{}", r, text);
            prop_assert_eq!(again.classify(r), want);
        }
    }
}

//! Parsers: blkparse (every action code and RWBS flag, several devices and CPUs, the summary
//! block), malformed lines, MSR Cambridge CSV, fio iologs v2/v3, format detection.

use hybridcache_analyze::*;

/// Every action code blkparse prints, every RWBS letter, two devices, four CPUs, then the
/// summary block.
const BLKPARSE: &str = "\
  8,0    0        1     0.000000000  4162  Q  WS 1000 + 8 [jbd2/sda1-8]
  8,0    0        2     0.000001000  4162  G  WS 1000 + 8 [jbd2/sda1-8]
  8,0    0        3     0.000002000  4162  P   N [jbd2/sda1-8]
  8,0    0        4     0.000003000  4162  Q  WS 1008 + 8 [jbd2/sda1-8]
  8,0    0        5     0.000004000  4162  M  WS 1008 + 8 [jbd2/sda1-8]
  8,0    0        6     0.000005000  4162  Q  WS 992 + 8 [jbd2/sda1-8]
  8,0    0        7     0.000006000  4162  F  WS 992 + 8 [jbd2/sda1-8]
  8,0    0        8     0.000007000  4162  I  WS 992 + 24 [jbd2/sda1-8]
  8,0    0        9     0.000008000  4162  U   N [jbd2/sda1-8] 1
  8,0    0       10     0.000009000  4162  UT  N [jbd2/sda1-8] 1
  8,0    0       11     0.000010000  4162  D  WS 992 + 24 [jbd2/sda1-8]
  8,0    1        1     0.000100000     0  C  WS 992 + 24 [0]
  8,0    1        2     0.000200000  5001  Q   R 2048 + 256 [dd]
  8,0    1        3     0.000201000  5001  X   R 2048 / 2176 [dd]
  8,0    1        4     0.000202000  5001  S   R 2048 + 128 [dd]
  8,0    1        5     0.000203000  5001  B   R 2048 + 128 [dd]
  8,0    1        6     0.000204000  5001  R   R 2048 + 128 [dd]
  8,0    1        7     0.000205000  5001  Q  RA 4096 + 8 [dd]
  8,0    1        8     0.000206000  5001  Q  RM 4104 + 8 [dd]
  8,0    1        9     0.000207000  5001  m   N cfq5001 alloced
  8,16   2        1     0.000300000  6000  A   W 8192 + 8 <- (8,17) 4096
  8,16   2        2     0.000301000  6000  Q FWFS 8192 + 8 [kworker/2:1]
  8,16   2        3     0.000302000  6000  Q FWS [kworker/2:1]
  8,16   2        4     0.000303000  6000  Q  FN [kworker/2:1]
  8,16   3        1     0.000304000  6000  Q   D 10000 + 2048 [fstrim]
  8,16   3        2     0.000305000  6000  Q  DE 12048 + 8 [fstrim]
  8,16   3        3     0.000306000  6000  Q WSM 20000 + 8 [kworker/2:1]
  8,16   3        4     0.000307000  6000  Q  WB 20008 + 8 [kworker/2:1]
  8,16   3        5     0.000400000     0  C  WS 8192 + 8 (   99000) [0]
  8,16   3        6     0.000401000  6000  D   R (12 00 00 00 24 00) [scsi_id]
CPU0 (8,0):
 Reads Queued:           0,        0KiB\t Writes Queued:           3,       12KiB
 Read Dispatches:        0,        0KiB\t Write Dispatches:        1,       12KiB
 Reads Requeued:         0\t\t Writes Requeued:         0
 Reads Completed:        0,        0KiB\t Writes Completed:        0,        0KiB
 Read Merges:            0,        0KiB\t Write Merges:            2,        8KiB
 Read depth:             0        \t Write depth:             1
 IO unplugs:             1        \t Timer unplugs:           1
CPU1 (8,0):
 Reads Queued:           3,      136KiB\t Writes Queued:           0,        0KiB
Total (8,0):
 Reads Queued:           3,      136KiB\t Writes Queued:           3,       12KiB

Throughput (R/W): 0KiB/s / 12KiB/s
Events (8,0): 20 entries
Skips: 0 forward (0 -   0.0%)
";

const EVENT_LINES: u64 = 30;

#[test]
fn blkparse_every_action_and_flag() {
    let t = parse_trace(BLKPARSE.as_bytes(), Format::Auto).unwrap();
    assert_eq!(t.format, Format::Blkparse);
    assert_eq!(t.report.bad, 0, "{}", t.report);
    assert_eq!(t.report.parsed, EVENT_LINES);
    assert_eq!(t.events.len() as u64, EVENT_LINES);
    assert!(t.report.summary >= 14, "{}", t.report);
    assert_eq!(t.devices, vec!["8,0".to_string(), "8,16".to_string()]);
    let cpus: std::collections::BTreeSet<u32> = t.events.iter().map(|e| e.cpu).collect();
    assert_eq!(cpus.into_iter().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    let actions: std::collections::HashSet<Action> = t.events.iter().map(|e| e.action).collect();
    for a in [
        Action::Queue,
        Action::GetRequest,
        Action::Insert,
        Action::Issue,
        Action::Complete,
        Action::BackMerge,
        Action::FrontMerge,
        Action::Split,
        Action::Remap,
        Action::Plug,
        Action::Unplug,
        Action::TimerUnplug,
        Action::Sleep,
        Action::Bounce,
        Action::Requeue,
        Action::Message,
    ] {
        assert!(actions.contains(&a), "{a:?} missing");
    }
    let e = |i: usize| t.events[i];
    assert_eq!((e(0).offset, e(0).len), (1000 * 512, 8 * 512));
    assert!(e(0).rwbs.has(Rwbs::SYNC) && e(0).op() == Op::Write);
    assert_eq!(e(12).len, 256 * 512);
    assert!(e(17).rwbs.has(Rwbs::AHEAD) && e(17).op() == Op::Read);
    assert!(e(18).rwbs.has(Rwbs::META));
    let fwfs = e(21).rwbs;
    assert!(fwfs.has(Rwbs::FLUSH) && fwfs.has(Rwbs::FUA) && fwfs.has(Rwbs::WRITE));
    assert_eq!(e(22).op(), Op::Write); // FWS without a range
    assert_eq!(e(23).op(), Op::Flush);
    assert_eq!(e(24).op(), Op::Discard);
    assert!(e(25).rwbs.has(Rwbs::SECURE) && e(25).op() == Op::Discard);
    assert!(e(26).rwbs.has(Rwbs::META) && e(26).rwbs.has(Rwbs::SYNC));
    assert!(e(27).rwbs.has(Rwbs::BARRIER));
    // Jobs are named by process and pid; C events' [0] is an error code, not a name.
    assert!(t.jobs.contains(&"jbd2/sda1-8 (pid 4162)".to_string()));
    assert!(t.jobs.contains(&"dd (pid 5001)".to_string()));
    assert!(t.jobs.contains(&"pid 0".to_string()));

    let sig = Signature::from_trace(&t);
    assert_eq!(sig.request_action, Action::Queue);
    let jbd = sig
        .jobs
        .iter()
        .find(|j| j.name.starts_with("jbd2"))
        .unwrap();
    assert_eq!(jbd.writes.requests, 3);
    // Q 1000, Q 1008 (sequential), Q 992 (not): merged and completed by one C.
    assert_eq!((jbd.writes.sequential, jbd.writes.random), (1, 1));
    assert_eq!(jbd.queue_depth.max_in_flight, Some(3));
    assert_eq!(jbd.queue_depth.study_run, Some(3));
    let fstrim = sig
        .jobs
        .iter()
        .find(|j| j.name.starts_with("fstrim") || j.name.contains("6000"))
        .unwrap();
    assert_eq!(fstrim.discards, 2);
    assert_eq!(fstrim.flushes, 1);
    assert_eq!(sig.overall.discards, 2);
}

#[test]
fn malformed_lines_are_counted_and_shown() {
    let text = "\
8,0 0 1 0.000000000 10 Q W 0 + 8 [a]
this is not a trace line
8,0 0 2 0.000001000 10 Z W 8 + 8 [a]
8,0 0 3 0.000002000 10 Q W 8 + 8 [a]

8,0 0 4 0.000003000 10 Q W eight + 8 [a]
8,0 0 5 0.000004000 10 Q W 16 + 8 [a]
";
    let t = parse_trace(text.as_bytes(), Format::Blkparse).unwrap();
    assert_eq!(t.report.lines, 7);
    assert_eq!(t.report.parsed, 3);
    assert_eq!(t.report.blank, 1);
    assert_eq!(t.report.bad, 3);
    let lines: Vec<u64> = t.report.first_bad.iter().map(|b| b.line).collect();
    assert_eq!(lines, vec![2, 3, 6]);
    assert!(t.report.first_bad[1].why.contains("unknown action `Z`"));
    assert!(t.report.first_bad[2].why.contains("eight"));
    let shown = t.report.to_string();
    assert!(
        shown.contains("line 2: this is not a trace line"),
        "{shown}"
    );
}

#[test]
fn only_the_first_bad_lines_are_kept() {
    let mut text = String::from("8,0 0 1 0.0 10 Q W 0 + 8 [a]\n");
    for i in 0..20 {
        text += &format!("garbage {i}\n");
    }
    let t = parse_trace(text.as_bytes(), Format::Blkparse).unwrap();
    assert_eq!(t.report.bad, 20);
    assert_eq!(t.report.first_bad.len(), 5);
    assert!(t.report.to_string().contains("and 15 more"));
}

#[test]
fn nothing_parseable_is_an_error() {
    for (text, fmt) in [
        ("hello\nworld\n", Format::Auto),
        ("", Format::Auto),
        ("\n\n", Format::Blkparse),
        ("fio version 2 iolog\n/dev/sdb add\n", Format::Auto),
        ("8,0 0 1 0.0 10 Q W 0 + 8 [a]\n", Format::Msr),
    ] {
        match parse_trace(text.as_bytes(), fmt) {
            Err(ParseError::NothingParseable { report, .. }) => {
                assert_eq!(report.parsed, 0);
            }
            other => panic!("{text:?}: {other:?}"),
        }
    }
    let err = parse_trace("junk line\n".as_bytes(), Format::Auto).unwrap_err();
    assert!(err.to_string().contains("junk line"), "{err}");
}

#[test]
fn summary_only_counts_after_a_header() {
    // A stray "Reads Queued:" line before any summary header is a bad line, not summary.
    let text = "8,0 0 1 0.0 10 Q W 0 + 8 [a]\n Reads Queued: 1, 4KiB\nCPU0 (8,0):\n Reads Queued: 1, 4KiB\n";
    let t = parse_trace(text.as_bytes(), Format::Blkparse).unwrap();
    assert_eq!((t.report.bad, t.report.summary), (1, 2));
}

const MSR: &str = "\
Timestamp,Hostname,DiskNumber,Type,Offset,Size,ResponseTime
128166372003061629,hm,1,Read,3154152448,4096,3233
128166372003061629,hm,1,Write,3154156544,4096,1000
128166372016382155,hm,1,Write,3154160640,8192,200000
128166372016382155,hm,1,Read,3154152448,4096,5000
128166372026382155,src1,0,Read,0,65536,100
128166372026392155,src1,0,Read,65536,65536,100
";

#[test]
fn msr_sample() {
    let t = parse_trace(MSR.as_bytes(), Format::Auto).unwrap();
    assert_eq!(t.format, Format::Msr);
    assert_eq!(t.report.headers, 1);
    assert_eq!(t.report.parsed, 6);
    assert_eq!(t.events.len(), 12);
    assert_eq!(t.jobs, vec!["hm/1".to_string(), "src1/0".to_string()]);
    assert!(t.events.windows(2).all(|w| w[0].time_ns <= w[1].time_ns));
    let sig = Signature::from_trace(&t);
    let hm = sig.jobs.iter().find(|j| j.name == "hm/1").unwrap();
    assert_eq!((hm.reads.requests, hm.writes.requests), (2, 2));
    assert_eq!(hm.writes.sequential, 1); // 3154156544 + 4096 = 3154160640
                                         // The second read touches the same (unaligned: two 4 KiB blocks) range again.
    assert_eq!((hm.reads.block_refs, hm.reads.reused_refs), (4, 2));
    // Two requests at the same timestamp: two in flight.
    assert_eq!(hm.queue_depth.max_in_flight, Some(2));
    let src = sig.jobs.iter().find(|j| j.name == "src1/0").unwrap();
    assert_eq!(src.reads.dominant_size(), 65536);
    assert_eq!(src.reads.sequential, 1);
}

#[test]
fn fio_iolog_v2_and_v3() {
    let v2 = "\
fio version 2 iolog
/dev/sdb add
/dev/sdb open
/dev/sdb write 0 4096
/dev/sdb write 4096 4096
/dev/sdb read 1048576 8192
/dev/sdb trim 0 65536
/dev/sdb sync 0 0
/dev/sdb wait 1000000
/dev/sdb read 1056768 8192
/dev/sdb close
";
    let t = parse_trace(v2.as_bytes(), Format::Auto).unwrap();
    assert_eq!(t.format, Format::FioV2);
    assert_eq!(t.report.bad, 0, "{}", t.report);
    assert_eq!(t.events.len(), 6);
    assert_eq!(t.jobs, vec!["/dev/sdb".to_string()]);
    assert_eq!(t.events[5].time_ns, 1_000_000_000);
    let sig = Signature::from_trace(&t);
    let j = &sig.jobs[0];
    assert_eq!(
        (j.reads.requests, j.writes.requests, j.discards, j.flushes),
        (2, 2, 1, 1)
    );
    assert_eq!(j.writes.sequential, 1);
    assert_eq!(j.reads.sequential, 1);
    assert_eq!(j.queue_depth.max_in_flight, None);
    assert!(!sig.has_completions);

    let v3 = "\
fio version 3 iolog
0 /dev/nvme0n1 add
0 /dev/nvme0n1 open
5 /dev/nvme0n1 write 0 65536
6 /dev/nvme0n1 write 65536 65536
1500 /dev/nvme0n1 read 0 4096
1501 /dev/sdc write 0 4096
2000 /dev/nvme0n1 close
";
    let t = parse_trace(v3.as_bytes(), Format::Auto).unwrap();
    assert_eq!(t.format, Format::FioV3);
    assert_eq!(t.events.len(), 4);
    assert_eq!(t.events[0].time_ns, 5_000_000);
    assert_eq!(t.events[2].time_ns, 1_500_000_000);
    assert_eq!(t.jobs.len(), 2);
    let sig = Signature::from_trace(&t);
    assert_eq!(sig.jobs.len(), 2);
    assert_eq!(sig.overall.timeline.buckets.len(), 2);
    // Bad v3 lines: missing timestamp, unknown action.
    let bad = "fio version 3 iolog\n/dev/sdb write 0 4096\n1 /dev/sdb frob 0 4096\n2 /dev/sdb write 0 4096\n";
    let t = parse_trace(bad.as_bytes(), Format::Auto).unwrap();
    assert_eq!((t.report.bad, t.report.parsed), (2, 1));
}

#[test]
fn detection_and_override() {
    assert_eq!(detect_format(&["fio version 3 iolog"]), Format::FioV3);
    assert_eq!(detect_format(&["", "fio version 2 iolog"]), Format::FioV2);
    assert_eq!(
        detect_format(&["128166372003061629,hm,1,Read,3154152448,4096,3233"]),
        Format::Msr
    );
    assert_eq!(
        detect_format(&["  8,0 0 1 0.0 10 Q W 0 + 8 [a]"]),
        Format::Blkparse
    );
    assert_eq!(detect_format(&["junk", "junk"]), Format::Blkparse);
    // The override wins: an MSR file read as fio v2 has nothing parseable.
    assert!(parse_trace(MSR.as_bytes(), Format::FioV2).is_err());
    assert_eq!(
        parse_trace(MSR.as_bytes(), Format::Msr).unwrap().format,
        Format::Msr
    );
}

#[test]
fn invalid_utf8_and_crlf() {
    let mut bytes = b"8,0 0 1 0.0 10 Q W 0 + 8 [a]\r\n".to_vec();
    bytes.extend_from_slice(&[0xff, 0xfe, b'\n']);
    bytes.extend_from_slice(b"8,0 0 2 0.1 10 Q W 8 + 8 [a]");
    let t = parse_trace(&bytes[..], Format::Auto).unwrap();
    assert_eq!((t.report.parsed, t.report.bad), (2, 1));
}

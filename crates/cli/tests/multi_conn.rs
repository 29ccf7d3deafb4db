//! Several connections to one export: fio jobs on disjoint regions (numjobs with
//! offset_increment), and our own client over Unix and TCP checking that a flush on one
//! connection covers writes completed on the others (the CAN_MULTI_CONN promise).

mod common;

use common::{fio, need, sparse_file, workdir, Daemon};
use hybridcache_nbd::Client;

#[test]
fn fio_four_connections_disjoint_regions() {
    if !need(&["fio"]) {
        return;
    }
    let dir = workdir();
    let core = dir.path().join("core.img");
    sparse_file(&core, 256 << 20);
    let d = Daemon::start(dir.path());
    d.ok(&["-S", "-d", "ram:16M", "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", core.to_str().unwrap()]);
    let args: Vec<String> = vec![
        "--ioengine=nbd".into(),
        // fio would otherwise leave verify state files in the crate directory.
        "--verify_state_save=0".into(),
        format!("--uri={}", d.uri("cas1-1")),
        "--name=multi".into(),
        "--numjobs=4".into(),
        "--offset_increment=32m".into(),
        "--size=24m".into(),
        "--rw=randwrite".into(),
        "--bsrange=4k-256k".into(),
        "--iodepth=16".into(),
        "--verify=crc32c".into(),
        "--verify_fatal=1".into(),
    ];
    let report = fio(dir.path(), "multi", &args);
    assert_eq!(report["jobs"].as_array().map(Vec::len), Some(4));
    let mut again = args.clone();
    again.push("--verify_only".into());
    fio(dir.path(), "multi-reverify", &again);
}

#[test]
fn flush_on_one_connection_covers_all_unix_and_tcp() {
    let dir = workdir();
    let core = dir.path().join("core.img");
    sparse_file(&core, 64 << 20);
    let d = Daemon::start_with(dir.path(), &["--nbd-listen", "0"]);
    d.ok(&["-S", "-d", "ram:8M", "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", core.to_str().unwrap()]);
    // The daemon logs the TCP address it bound (port 0 picks a free one).
    let log = d.log_text();
    let addr = log
        .split(" and tcp ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .expect("tcp address in the log")
        .to_string();
    assert!(addr.starts_with("127.0.0.1:"), "loopback only: {addr}");

    let region = 4 << 20;
    std::thread::scope(|s| {
        for i in 0..4u64 {
            let nbd = d.nbd.clone();
            let addr = addr.clone();
            s.spawn(move || {
                let mut c = if i % 2 == 0 {
                    Client::connect_unix(&nbd, "cas1-1").expect("unix connect")
                } else {
                    Client::connect_tcp(addr.as_str(), "cas1-1").expect("tcp connect")
                };
                assert!(c.can_multi_conn());
                let buf = vec![i as u8 + 1; 256 << 10];
                for k in 0..(region / buf.len() as u64) {
                    c.write(&buf, i * region + k * buf.len() as u64, false)
                        .expect("write");
                }
                c.disconnect().unwrap();
            });
        }
    });
    // One flush on a fresh connection makes every region durable (in wb: on the cache device,
    // where most of it is still dirty), and a fresh connection sees every write.
    let mut c = Client::connect_unix(&d.nbd, "cas1-1").unwrap();
    c.flush().unwrap();
    let mut buf = vec![0u8; region as usize];
    for i in 0..4u64 {
        c.read(&mut buf, i * region).unwrap();
        assert!(buf.iter().all(|&b| b == i as u8 + 1), "region {i} via NBD");
    }
    c.disconnect().unwrap();
    // Flushing the cache (the management verb) writes the dirty data to the core.
    d.ok(&["-F", "-i", "1"]);
    let stats: serde_json::Value =
        serde_json::from_str(&d.ok(&["-P", "-i", "1", "-o", "json"])).unwrap();
    assert_eq!(stats["usage"]["dirty"]["count"], 0, "{stats}");
    let data = std::fs::read(&core).unwrap();
    for i in 0..4usize {
        let r = &data[i * region as usize..(i + 1) * region as usize];
        assert!(
            r.iter().all(|&b| b == i as u8 + 1),
            "region {i} on the core"
        );
    }
}

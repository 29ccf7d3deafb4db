//! The metrics endpoint scraped by a real Prometheus server (Debian's `prometheus`, installed by
//! `make deps`): fio writes through an export while Prometheus scrapes every second, then
//! Prometheus's own query API must see the requests as a non-zero rate and the same dirty ratio
//! that `-P` reports.

mod common;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::*;

/// A port nobody listens on right now (bound, read, released).
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// A plain HTTP/1.1 GET; returns (status line, body).
fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(String, String)> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.lines().next().unwrap_or("").to_string();
    // Prometheus answers with chunked encoding; the JSON is one chunk between size lines.
    let body = if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = String::new();
        let mut rest = body;
        while let Some((size, after)) = rest.split_once("\r\n") {
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 || after.len() < n {
                break;
            }
            out.push_str(&after[..n]);
            rest = after[n..].trim_start_matches("\r\n");
        }
        out
    } else {
        body.to_string()
    };
    Ok((status, body))
}

fn encode(q: &str) -> String {
    q.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"-_.~".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Prometheus started on loopback with a 1 s scrape of `target`; killed when dropped.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
}

impl Prometheus {
    fn start(dir: &std::path::Path, target: SocketAddr) -> Prometheus {
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: hybridcache\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .expect("write prometheus.yml");
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let log = std::fs::File::create(dir.join("prometheus.log")).expect("log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .expect("start prometheus");
        let p = Prometheus { child, addr };
        let deadline = Instant::now() + Duration::from_secs(30);
        while !http_get(addr, "/-/ready").is_ok_and(|(s, _)| s.contains(" 200 ")) {
            assert!(
                Instant::now() < deadline,
                "prometheus not ready: {}",
                std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        p
    }

    /// The values of an instant query, one per series.
    fn query(&self, q: &str) -> Vec<f64> {
        let (status, body) =
            http_get(self.addr, &format!("/api/v1/query?query={}", encode(q))).expect("query");
        assert!(status.contains(" 200 "), "{q}: {status} {body}");
        let v: serde_json::Value = serde_json::from_str(&body).expect("query JSON");
        v["data"]["result"]
            .as_array()
            .map(|rows| {
                rows.iter()
                    .filter_map(|r| r["value"][1].as_str()?.parse().ok())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Wait until `q` returns a series satisfying `ok`.
    fn wait_for(&self, q: &str, ok: impl Fn(f64) -> bool) -> f64 {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(v) = self.query(q).into_iter().find(|v| ok(*v)) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{q} never matched: {:?}",
                self.query(q)
            );
            std::thread::sleep(Duration::from_millis(300));
        }
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn prometheus_scrapes_the_metrics_endpoint() {
    if !need(&["prometheus", "fio"]) {
        return;
    }
    let dir = workdir();
    let d = Daemon::start_with(dir.path(), &["--metrics-listen", "127.0.0.1:0"]);
    // Port 0 picks a free port; the log says which.
    let log = d.log_text();
    let addr: SocketAddr = log
        .split("metrics served on http://")
        .nth(1)
        .and_then(|rest| rest.split('/').next())
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no metrics address in the log: {log}"));
    d.ok(&["-S", "-d", "ram:64M", "-i", "1", "-c", "wb"]);
    d.ok(&["-A", "-i", "1", "-d", "ram:256M"]);
    // No background cleaning, so the dirty ratio holds still once fio is done.
    d.ok(&["-X", "-n", "cleaning", "-i", "1", "-p", "nop"]);

    let (status, body) = http_get(addr, "/metrics").expect("scrape");
    assert!(status.contains(" 200 "), "{status}");
    assert!(body.contains("hybridcache_requests_total{"), "{body}");

    let prom = Prometheus::start(dir.path(), addr);
    // Counters must be seen before and during the writes for rate() to see them grow.
    prom.wait_for(r#"up{job="hybridcache"}"#, |v| v == 1.0);
    fio(
        dir.path(),
        "write",
        &[
            "--name=w".into(),
            "--ioengine=nbd".into(),
            format!("--uri={}", d.uri("cas1-1")),
            "--rw=randwrite".into(),
            "--bs=4k".into(),
            "--size=32m".into(),
            "--iodepth=4".into(),
            "--time_based=1".into(),
            "--runtime=4".into(),
        ],
    );
    let rate = prom.wait_for(
        r#"sum(rate(hybridcache_requests_total{cache="1",core="1",direction="write"}[20s]))"#,
        |v| v > 0.0,
    );
    assert!(rate > 0.0);
    let exported = prom.wait_for(
        r#"hybridcache_written_bytes_total{cache="1",core="1",device="exported"}"#,
        |v| v > 0.0,
    );
    assert!(exported >= 4096.0);
    // Latency histograms: Prometheus computes a p99 of the writes from the buckets.
    let p99 = prom.wait_for(
        r#"histogram_quantile(0.99, sum by (le) (rate(hybridcache_request_duration_seconds_bucket{cache="1",direction="write"}[20s])))"#,
        |v| v > 0.0 && v.is_finite(),
    );
    assert!(p99 < 10.0, "p99 {p99} s");

    // The dirty ratio Prometheus stored is what -P says now (nothing changes any more).
    let stats = d.stats_json(1, None);
    let raw = &stats["raw"];
    let (dirty, total) = (
        raw["dirty_lines"].as_f64().expect("dirty_lines"),
        raw["total_lines"].as_f64().expect("total_lines"),
    );
    assert!(dirty > 0.0, "{stats}");
    // -P reports the same requests' latency percentiles, as numbers.
    let writes = &stats["latency"]["write"];
    assert!(writes["count"].as_u64().unwrap_or(0) > 0, "{stats}");
    for key in ["mean_us", "p50_us", "p99_us", "p999_us", "p9999_us"] {
        assert!(writes[key].as_f64().unwrap_or(0.0) > 0.0, "{key}: {stats}");
    }
    assert!(writes["p50_us"].as_f64() <= writes["p9999_us"].as_f64());
    let ratio = prom.wait_for(r#"hybridcache_cache_dirty_ratio{cache="1"}"#, |v| {
        (v - dirty / total).abs() < 1e-9
    });
    assert!(ratio > 0.0);
}

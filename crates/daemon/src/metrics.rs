//! Prometheus metrics: an HTTP endpoint (`GET /metrics`) in Prometheus's text format, off unless
//! the daemon is given `--metrics-listen ADDR:PORT`.
//!
//! Nothing is counted for the metrics: every figure is read at scrape time from what the engine
//! already keeps (per-thread counter slots summed on read, gauges), so a scraper costs the request
//! path nothing. Counters that only grow are Prometheus counters (`…_total`); a statistics reset
//! (`-Z`) shows up as a counter reset, which `rate()` handles. Names follow Prometheus's
//! conventions: `hybridcache_` prefix, base units (bytes, seconds) in the name, labels `cache`,
//! `core` and `io_class`. docs/observability.md lists every metric.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use hybridcache_engine::{Cache, LatencyKind, Stats};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Registry, Unit};

/// What the daemon exposes: one entry per cache.
pub struct CacheView {
    pub id: u16,
    pub device: String,
    pub status: String,
    pub cache: Cache,
    pub cores: Vec<CoreView>,
}

pub struct CoreView {
    pub id: u16,
    pub device: String,
    pub active: bool,
    /// Clients connected to the core's exported volume.
    pub clients: usize,
}

/// Called on every scrape for the daemon's current setup.
pub type Source = Arc<dyn Fn() -> Vec<CacheView> + Send + Sync>;

/// Scrapes served at once; more wait in the kernel's accept queue.
const MAX_SCRAPES: usize = 4;
/// A request line and headers larger than this are refused (a scrape sends a few hundred bytes).
const MAX_REQUEST: u64 = 16 << 10;

/// The running endpoint; dropping it does not stop it, [`MetricsServer::shutdown`] does.
pub struct MetricsServer {
    addr: SocketAddr,
    stopping: Arc<AtomicBool>,
}

impl MetricsServer {
    /// Listen on `addr` and serve scrapes from a thread of its own.
    pub fn start(addr: SocketAddr, source: Source) -> Result<MetricsServer> {
        let listener =
            TcpListener::bind(addr).with_context(|| format!("cannot serve metrics on {addr}"))?;
        let addr = listener.local_addr()?;
        let stopping = Arc::new(AtomicBool::new(false));
        let busy = Arc::new(AtomicUsize::new(0));
        let stop = stopping.clone();
        std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || {
                for stream in listener.incoming() {
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                    let Ok(stream) = stream else { continue };
                    if busy.fetch_add(1, Ordering::SeqCst) >= MAX_SCRAPES {
                        busy.fetch_sub(1, Ordering::SeqCst);
                        let _ = respond(&stream, "503 Service Unavailable", "busy\n");
                        continue;
                    }
                    let source = source.clone();
                    let busy = busy.clone();
                    let spawned = std::thread::Builder::new()
                        .name("metrics-scrape".into())
                        .spawn(move || {
                            serve(stream, &source);
                            busy.fetch_sub(1, Ordering::SeqCst);
                        });
                    if spawned.is_err() {
                        tracing::warn!("metrics: cannot start a thread for a scrape");
                    }
                }
            })
            .context("cannot start the metrics thread")?;
        tracing::info!("metrics served on http://{addr}/metrics");
        Ok(MetricsServer { addr, stopping })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn shutdown(&self) {
        self.stopping.store(true, Ordering::SeqCst);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect_timeout(&self.addr, Duration::from_millis(200));
    }
}

fn serve(stream: TcpStream, source: &Source) {
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(10)));
    let mut reader = BufReader::new(std::io::Read::take(&stream, MAX_REQUEST));
    let mut first = String::new();
    if reader.read_line(&mut first).is_err() {
        return;
    }
    // Headers are read and ignored: a scrape needs none of them.
    loop {
        let mut h = String::new();
        match reader.read_line(&mut h) {
            Ok(0) | Err(_) => break,
            Ok(_) if h.trim().is_empty() => break,
            Ok(_) => {}
        }
    }
    let mut parts = first.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let _ = match (method, path) {
        ("GET", "/metrics") => match render(source) {
            Ok(body) => respond_with(&stream, "200 OK", CONTENT_TYPE, &body),
            Err(e) => respond(&stream, "500 Internal Server Error", &format!("{e}\n")),
        },
        ("GET", "/") => respond(
            &stream,
            "200 OK",
            "hybridcache metrics: GET /metrics (Prometheus text format)\n",
        ),
        ("GET", _) => respond(&stream, "404 Not Found", "not found: try /metrics\n"),
        _ => respond(&stream, "405 Method Not Allowed", "only GET\n"),
    };
}

const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

fn respond(stream: &TcpStream, status: &str, body: &str) -> std::io::Result<()> {
    respond_with(stream, status, "text/plain; charset=utf-8", body)
}

fn respond_with(
    mut stream: &TcpStream,
    status: &str,
    content_type: &str,
    body: &str,
) -> std::io::Result<()> {
    write!(
        stream,
        "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )?;
    stream.flush()
}

/// The whole scrape body for the setup `source` returns now.
pub fn render(source: &Source) -> Result<String, std::fmt::Error> {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Collected { caches: source() }));
    let mut out = String::new();
    prometheus_client::encoding::text::encode(&mut out, &registry)?;
    Ok(out)
}

struct Collected {
    caches: Vec<CacheView>,
}

impl std::fmt::Debug for Collected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Collected")
            .field("caches", &self.caches.len())
            .finish()
    }
}

type Labels = Vec<(String, String)>;

fn labels(pairs: &[(&str, String)]) -> Labels {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.clone()))
        .collect()
}

/// One metric family: its rows are (labels, value).
struct Family {
    name: &'static str,
    help: &'static str,
    unit: Option<Unit>,
    kind: MetricType,
    rows: Vec<(Labels, f64)>,
}

impl Family {
    fn counter(name: &'static str, help: &'static str) -> Family {
        Family {
            name,
            help,
            unit: None,
            kind: MetricType::Counter,
            rows: Vec::new(),
        }
    }

    fn gauge(name: &'static str, help: &'static str) -> Family {
        Family {
            kind: MetricType::Gauge,
            ..Family::counter(name, help)
        }
    }

    fn bytes(mut self) -> Family {
        self.unit = Some(Unit::Bytes);
        self
    }

    fn push(&mut self, labels: Labels, value: f64) {
        self.rows.push((labels, value));
    }

    fn encode(&self, encoder: &mut DescriptorEncoder) -> std::fmt::Result {
        if self.rows.is_empty() {
            return Ok(());
        }
        let mut m =
            encoder.encode_descriptor(self.name, self.help, self.unit.as_ref(), self.kind)?;
        for (l, v) in &self.rows {
            let fam: MetricEncoder = m.encode_family(l)?;
            match self.kind {
                MetricType::Counter => ConstCounter::new(*v as u64).encode(fam)?,
                _ => ConstGauge::new(*v).encode(fam)?,
            }
        }
        Ok(())
    }
}

/// Request counters, by direction and by how the cache served them.
fn push_requests(f: &mut Family, base: &Labels, s: &Stats) {
    let r = &s.requests;
    for (direction, result, v) in [
        ("read", "hit", r.read_hits),
        ("read", "partial_miss", r.read_partial_misses),
        ("read", "full_miss", r.read_full_misses),
        ("read", "pass_through", r.pass_through_reads),
        ("write", "hit", r.write_hits),
        ("write", "partial_miss", r.write_partial_misses),
        ("write", "full_miss", r.write_full_misses),
        ("write", "pass_through", r.pass_through_writes),
    ] {
        let mut l = base.clone();
        l.push(("direction".into(), direction.into()));
        l.push(("result".into(), result.into()));
        f.push(l, v as f64);
    }
}

/// Bytes moved, by device (`core`, `cache`, or `exported`: the clients of the exported volume).
fn push_bytes(read: &mut Family, written: &mut Family, base: &Labels, s: &Stats) {
    let b = &s.blocks;
    for (device, r, w) in [
        ("core", b.core_read_bytes, b.core_written_bytes),
        ("cache", b.cache_read_bytes, b.cache_written_bytes),
        ("exported", b.exported_read_bytes, b.exported_written_bytes),
    ] {
        let mut l = base.clone();
        l.push(("device".into(), device.into()));
        read.push(l.clone(), r as f64);
        written.push(l, w as f64);
    }
}

fn push_errors(f: &mut Family, base: &Labels, s: &Stats) {
    let e = &s.errors;
    for (device, direction, v) in [
        ("cache", "read", e.cache_read),
        ("cache", "write", e.cache_write),
        ("core", "read", e.core_read),
        ("core", "write", e.core_write),
    ] {
        let mut l = base.clone();
        l.push(("device".into(), device.into()));
        l.push(("direction".into(), direction.into()));
        f.push(l, v as f64);
    }
}

impl Collector for Collected {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let mut info = Family::gauge(
            "hybridcache_cache_info",
            "A cache: 1, with its mode, line size, device and status as labels",
        );
        let mut lines = Family::gauge("hybridcache_cache_lines", "Cache lines in the cache");
        let mut line_size =
            Family::gauge("hybridcache_cache_line_size", "Size of one cache line").bytes();
        let mut free = Family::gauge(
            "hybridcache_cache_free_lines",
            "Cache lines mapped to no core",
        );
        let mut occupancy = Family::gauge(
            "hybridcache_cache_occupancy_lines",
            "Cache lines mapped to any core",
        );
        let mut dirty = Family::gauge(
            "hybridcache_cache_dirty_lines",
            "Cache lines holding data newer than their core",
        );
        let mut dirty_ratio = Family::gauge(
            "hybridcache_cache_dirty_ratio",
            "Dirty lines over all cache lines (0 to 1), as -P's Dirty percentage",
        );
        let mut dirty_for = Family::gauge(
            "hybridcache_cache_dirty_for_seconds",
            "How long the cache has held dirty data (0 while clean), as -P's Dirty for",
        );
        let mut mirror = Family::gauge(
            "hybridcache_cache_mirror_redundant",
            "A mirrored cache: 1 while both devices work, 0 once one is lost (the state label says which)",
        );
        let mut fallback = Family::gauge(
            "hybridcache_cache_fallback_pass_through",
            "1 while the cache serves new I/O pass-through because its device's errors reached the fallback-pt threshold",
        );
        let mut fallback_errors = Family::gauge(
            "hybridcache_cache_device_errors_in_window",
            "Cache-device errors counted in the fallback-pt window (0 while fallback-pt is off)",
        );
        let mut unreadable_dirty = Family::gauge(
            "hybridcache_cache_unreadable_dirty_lines",
            "Dirty lines with data whose read from the cache device failed (nowhere else), since the last reset",
        );
        let mut flushing = Family::gauge(
            "hybridcache_flush_in_progress",
            "1 while a flush runs (-F, a mode switch that flushes, a stop)",
        );
        let mut flush_ratio = Family::gauge(
            "hybridcache_flush_progress_ratio",
            "Share of the running flush's dirty lines written so far (0 to 1); absent when none runs",
        );
        let mut core_occupancy = Family::gauge(
            "hybridcache_core_occupancy_lines",
            "Cache lines mapped to the core",
        );
        let mut core_dirty = Family::gauge(
            "hybridcache_core_dirty_lines",
            "Cache lines holding data of the core newer than the core",
        );
        let mut core_dirty_ratio = Family::gauge(
            "hybridcache_core_dirty_ratio",
            "The core's dirty lines over all cache lines (0 to 1), as -P -j's Dirty percentage",
        );
        let mut core_info = Family::gauge(
            "hybridcache_core_info",
            "A core: 1, with its device and status as labels",
        );
        let mut core_active = Family::gauge(
            "hybridcache_core_active",
            "1 while the core is attached, 0 while it is inactive",
        );
        let mut core_size = Family::gauge("hybridcache_core_size", "Size of the core").bytes();
        let mut clients = Family::gauge(
            "hybridcache_export_clients",
            "Clients connected to the core's exported volume",
        );
        let mut requests = Family::counter(
            "hybridcache_requests",
            "Requests on the exported volume, by direction and how the cache served them",
        );
        let mut read = Family::counter(
            "hybridcache_read",
            "Bytes read, by device: core, cache, or exported (by the clients)",
        )
        .bytes();
        let mut written = Family::counter(
            "hybridcache_written",
            "Bytes written, by device: core, cache, or exported (by the clients)",
        )
        .bytes();
        let mut errors = Family::counter(
            "hybridcache_errors",
            "Failed device operations, by device and direction",
        );
        let mut lazy_writes = Family::counter(
            "hybridcache_lazy_flush_writes",
            "Write requests lazy flush sent (partly) to the core for want of a free or clean line",
        );
        let mut lazy_bytes = Family::counter(
            "hybridcache_lazy_flush_written",
            "Bytes lazy flush wrote to the core (part of the core's written bytes)",
        )
        .bytes();
        let mut prefetch_requests = Family::counter(
            "hybridcache_prefetch_requests",
            "Read-ahead requests the prefetch worker issued to the core (not client requests)",
        );
        let mut prefetch_bytes = Family::counter(
            "hybridcache_prefetch_read",
            "Bytes read-ahead read from the core (part of the core's read bytes)",
        )
        .bytes();
        let mut prefetch_written = Family::counter(
            "hybridcache_prefetch_written",
            "Bytes read-ahead wrote to the cache (part of the cache's written bytes)",
        )
        .bytes();
        let mut deferred = Family::counter(
            "hybridcache_deferred_requests",
            "Read and write hits that waited for another request's line locks, as -P's Read \
             and Write deferred (also counted as result=\"hit\" in hybridcache_requests)",
        );
        let mut cleaner_requests = Family::counter(
            "hybridcache_cleaner_requests",
            "Core writes of the cleaner for this core (cleaning, flushes, making room), as -P's \
             Cleaner; reset with the statistics",
        );
        let mut cleaner_read = Family::counter(
            "hybridcache_cleaner_read",
            "Bytes the cleaner read from the cache for this core, as -P's Cleaner cache reads",
        )
        .bytes();
        let mut cleaner_written = Family::counter(
            "hybridcache_cleaner_written",
            "Bytes the cleaner wrote to this core, as -P's Cleaner core writes",
        )
        .bytes();
        let mut prefetch_hits = Family::counter(
            "hybridcache_prefetch_hit_lines",
            "Cache lines filled by read-ahead that a client read later hit (once per line)",
        );
        let mut offload_reads = Family::counter(
            "hybridcache_offload_reads",
            "Clean read hits offload sent to the core instead (also counted as pass-through reads)",
        );
        let mut offload_writes = Family::counter(
            "hybridcache_offload_writes",
            "Write misses offload sent to the core instead (also counted as pass-through writes)",
        );
        let mut cleaned = Family::counter(
            "hybridcache_cleaned_lines",
            "Dirty cache lines written to their core and marked clean (cleaning and flushes)",
        );
        let mut cleaning_writes = Family::counter(
            "hybridcache_cleaning_core_writes",
            "Core writes issued by cleaning and flushes (neighbours merged)",
        );
        let mut cleaning_bytes = Family::counter(
            "hybridcache_cleaning_written",
            "Bytes written to the cores by cleaning and flushes",
        )
        .bytes();
        let mut class_info = Family::gauge(
            "hybridcache_io_class_info",
            "An IO class: 1, with its name, eviction priority and allocation as labels",
        );
        let mut class_occupancy = Family::gauge(
            "hybridcache_io_class_occupancy_lines",
            "Cache lines holding the IO class's data",
        );
        let mut class_dirty = Family::gauge(
            "hybridcache_io_class_dirty_lines",
            "Dirty cache lines of the IO class",
        );
        let mut class_requests = Family::counter(
            "hybridcache_io_class_requests",
            "Requests of the IO class, by direction and how the cache served them",
        );
        let mut class_bytes = Family::counter(
            "hybridcache_io_class_exported",
            "Bytes the IO class's requests moved on the exported volumes, by direction",
        )
        .bytes();

        for c in &self.caches {
            let cache = &c.cache;
            let id = c.id.to_string();
            let base = labels(&[("cache", id.clone())]);
            info.push(
                labels(&[
                    ("cache", id.clone()),
                    ("mode", cache.mode().to_string()),
                    ("line_size_kib", cache.line_size().kib().to_string()),
                    ("device", c.device.clone()),
                    ("status", c.status.clone()),
                ]),
                1.0,
            );
            let s = cache.stats();
            let total = s.usage.total_lines.max(1) as f64;
            lines.push(base.clone(), s.usage.total_lines as f64);
            line_size.push(base.clone(), f64::from(s.usage.line_size));
            free.push(base.clone(), s.usage.free_lines as f64);
            occupancy.push(base.clone(), s.usage.occupancy_lines as f64);
            dirty.push(base.clone(), s.usage.dirty_lines as f64);
            dirty_ratio.push(base.clone(), s.usage.dirty_lines as f64 / total);
            dirty_for.push(
                base.clone(),
                cache.dirty_for(None).map_or(0.0, |d| d.as_secs_f64()),
            );
            let f = cache.fallback_status();
            fallback.push(base.clone(), if f.active { 1.0 } else { 0.0 });
            fallback_errors.push(base.clone(), f.errors as f64);
            unreadable_dirty.push(base.clone(), f.unreadable_dirty_lines as f64);
            if let Some(m) = cache.mirror_status() {
                mirror.push(
                    labels(&[
                        ("cache", id.clone()),
                        ("mirror", m.device.clone()),
                        ("state", m.state.as_str().replace(' ', "_")),
                    ]),
                    if m.state == hybridcache_engine::MirrorState::Redundant {
                        1.0
                    } else {
                        0.0
                    },
                );
            }
            let flush = cache.flush_status();
            flushing.push(base.clone(), if flush.is_some() { 1.0 } else { 0.0 });
            if let Some(f) = flush {
                flush_ratio.push(base.clone(), f.percent() / 100.0);
            }
            let cs = cache.cleaning_stats();
            cleaned.push(base.clone(), cs.cleaned_lines as f64);
            cleaning_writes.push(base.clone(), cs.core_writes as f64);
            cleaning_bytes.push(base.clone(), cs.core_write_bytes as f64);

            let sizes: std::collections::BTreeMap<u16, u64> =
                cache.cores().iter().map(|i| (i.id, i.size)).collect();
            for core in &c.cores {
                let l = labels(&[("cache", id.clone()), ("core", core.id.to_string())]);
                let mut il = l.clone();
                il.push(("device".into(), core.device.clone()));
                core_info.push(il, 1.0);
                core_active.push(l.clone(), if core.active { 1.0 } else { 0.0 });
                clients.push(l.clone(), core.clients as f64);
                if let Some(size) = sizes.get(&core.id) {
                    core_size.push(l.clone(), *size as f64);
                }
                let Ok(s) = cache.core_stats(core.id) else {
                    continue;
                };
                core_occupancy.push(l.clone(), s.usage.occupancy_lines as f64);
                core_dirty.push(l.clone(), s.usage.dirty_lines as f64);
                core_dirty_ratio.push(l.clone(), s.usage.dirty_lines as f64 / total);
                push_requests(&mut requests, &l, &s);
                push_bytes(&mut read, &mut written, &l, &s);
                push_errors(&mut errors, &l, &s);
                lazy_writes.push(l.clone(), s.requests.lazy_flush_writes as f64);
                lazy_bytes.push(l.clone(), s.blocks.lazy_flush_bytes as f64);
                prefetch_requests.push(l.clone(), s.requests.prefetch_requests as f64);
                prefetch_bytes.push(l.clone(), s.blocks.prefetch_read_bytes as f64);
                prefetch_hits.push(l.clone(), s.requests.prefetch_hits as f64);
                prefetch_written.push(l.clone(), s.blocks.prefetch_written_bytes as f64);
                for (direction, v) in [
                    ("read", s.requests.read_deferred),
                    ("write", s.requests.write_deferred),
                ] {
                    let mut dl = l.clone();
                    dl.push(("direction".into(), direction.into()));
                    deferred.push(dl, v as f64);
                }
                cleaner_requests.push(l.clone(), s.requests.cleaner_requests as f64);
                cleaner_read.push(l.clone(), s.blocks.cleaner_cache_read_bytes as f64);
                cleaner_written.push(l.clone(), s.blocks.cleaner_core_written_bytes as f64);
                offload_reads.push(l.clone(), s.requests.offload_reads as f64);
                offload_writes.push(l.clone(), s.requests.offload_writes as f64);
            }

            for class in cache.io_classes().iter() {
                let l = labels(&[("cache", id.clone()), ("io_class", class.id.to_string())]);
                let mut il = l.clone();
                il.push(("name".into(), class.name.clone()));
                il.push((
                    "eviction_priority".into(),
                    class
                        .eviction_priority
                        .map_or("pinned".to_string(), |p| p.to_string()),
                ));
                il.push(("allocation".into(), class.allocation_str()));
                class_info.push(il, 1.0);
                let Ok(s) = cache.io_class_stats(class.id) else {
                    continue;
                };
                class_occupancy.push(l.clone(), s.usage.occupancy_lines as f64);
                class_dirty.push(l.clone(), s.usage.dirty_lines as f64);
                push_requests(&mut class_requests, &l, &s);
                for (direction, v) in [
                    ("read", s.blocks.exported_read_bytes),
                    ("write", s.blocks.exported_written_bytes),
                ] {
                    let mut dl = l.clone();
                    dl.push(("direction".into(), direction.into()));
                    class_bytes.push(dl, v as f64);
                }
            }
        }

        let mut durations: Vec<(Labels, hybridcache_engine::Histogram)> = Vec::new();
        for c in &self.caches {
            for core in c.cores.iter().filter(|core| core.active) {
                let Ok(l) = c.cache.core_latency(core.id) else {
                    continue;
                };
                for kind in LatencyKind::ALL {
                    let labels = labels(&[
                        ("cache", c.id.to_string()),
                        ("core", core.id.to_string()),
                        (
                            "direction",
                            if kind.is_read() { "read" } else { "write" }.into(),
                        ),
                        ("served_by", kind.served_by().into()),
                    ]);
                    durations.push((labels, l.get(kind).clone()));
                }
            }
        }

        let mut build = Family::gauge(
            "hybridcache_build_info",
            "The daemon's version as a label; always 1",
        );
        build.push(
            labels(&[("version", env!("CARGO_PKG_VERSION").into())]),
            1.0,
        );
        for f in [
            &build,
            &info,
            &lines,
            &line_size,
            &free,
            &occupancy,
            &dirty,
            &dirty_ratio,
            &dirty_for,
            &flushing,
            &mirror,
            &fallback,
            &fallback_errors,
            &unreadable_dirty,
            &flush_ratio,
            &core_info,
            &core_active,
            &core_occupancy,
            &core_dirty,
            &core_dirty_ratio,
            &core_size,
            &clients,
            &requests,
            &read,
            &written,
            &errors,
            &lazy_writes,
            &lazy_bytes,
            &prefetch_requests,
            &prefetch_bytes,
            &prefetch_hits,
            &prefetch_written,
            &deferred,
            &cleaner_requests,
            &cleaner_read,
            &cleaner_written,
            &offload_reads,
            &offload_writes,
            &cleaned,
            &cleaning_writes,
            &cleaning_bytes,
            &class_info,
            &class_occupancy,
            &class_dirty,
            &class_requests,
            &class_bytes,
        ] {
            f.encode(&mut encoder)?;
        }
        encode_durations(&mut encoder, &durations)
    }
}

/// Upper bounds (seconds) of the exported latency buckets; `+Inf` follows.
const DURATION_BOUNDS: [f64; 19] = [
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 0.1,
    0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
];

/// Request latency as a Prometheus histogram. The engine's own buckets are finer (eight per power
/// of two); each is counted in the first exported bucket whose bound is not below its upper end,
/// so a count may sit one exported bucket high by at most the engine's 12.5% resolution.
fn encode_durations(
    encoder: &mut DescriptorEncoder,
    rows: &[(Labels, hybridcache_engine::Histogram)],
) -> std::fmt::Result {
    if rows.is_empty() {
        return Ok(());
    }
    let mut m = encoder.encode_descriptor(
        "hybridcache_request_duration",
        "Time from a request's arrival at the engine to its completion, by direction and by what served it (cache alone, or waiting for the core)",
        Some(&Unit::Seconds),
        MetricType::Histogram,
    )?;
    for (l, h) in rows {
        let mut buckets: Vec<(f64, u64)> = DURATION_BOUNDS
            .iter()
            .map(|b| (*b, 0))
            // prometheus-client writes f64::MAX as le="+Inf".
            .chain([(f64::MAX, 0)])
            .collect();
        for (i, n) in h.counts.iter().enumerate().filter(|(_, n)| **n > 0) {
            let upper = hybridcache_engine::latency::bucket_upper(i) as f64 / 1e9;
            let slot = DURATION_BOUNDS
                .iter()
                .position(|b| *b >= upper)
                .unwrap_or(DURATION_BOUNDS.len());
            buckets[slot].1 += n;
        }
        let mut fam = m.encode_family(l)?;
        fam.encode_histogram::<Labels>(h.sum_ns as f64 / 1e9, h.count(), &buckets, None)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use hybridcache_engine::{CacheConfig, CacheMode, LineSize};
    use hybridcache_volume::RamVolume;

    fn cache_with_writes() -> Cache {
        let cache = Cache::new(
            Arc::new(RamVolume::new("cache", 16 << 20).unwrap()),
            CacheConfig {
                id: 3,
                line_size: LineSize::from_kib(4).unwrap(),
                mode: CacheMode::Wb,
            },
        )
        .unwrap();
        let id = cache
            .add_core(Arc::new(RamVolume::new("core", 64 << 20).unwrap()), None)
            .unwrap();
        let core = cache.core(id).unwrap();
        core.write(&[7u8; 8192], 0).unwrap();
        let mut buf = [0u8; 4096];
        core.read(&mut buf, 0).unwrap();
        cache
    }

    fn source(cache: Cache) -> Source {
        Arc::new(move || {
            vec![CacheView {
                id: 3,
                device: "ram:16M".into(),
                status: "Running".into(),
                cache: cache.clone(),
                cores: vec![CoreView {
                    id: 1,
                    device: "ram:64M".into(),
                    active: true,
                    clients: 2,
                }],
            }]
        })
    }

    fn value(text: &str, series: &str) -> f64 {
        let line = text
            .lines()
            .find(|l| l.starts_with(series) && l[series.len()..].starts_with(' '))
            .unwrap_or_else(|| panic!("no series {series} in\n{text}"));
        line.rsplit(' ').next().unwrap().parse().unwrap()
    }

    #[test]
    fn scrape_reports_what_the_engine_counted() {
        let text = render(&source(cache_with_writes())).unwrap();
        assert_eq!(
            value(
                &text,
                r#"hybridcache_requests_total{cache="3",core="1",direction="write",result="full_miss"}"#
            ),
            1.0
        );
        assert_eq!(
            value(
                &text,
                r#"hybridcache_requests_total{cache="3",core="1",direction="read",result="hit"}"#
            ),
            1.0
        );
        assert_eq!(
            value(
                &text,
                r#"hybridcache_written_bytes_total{cache="3",core="1",device="exported"}"#
            ),
            8192.0
        );
        assert_eq!(
            value(&text, r#"hybridcache_core_dirty_lines{cache="3",core="1"}"#),
            2.0
        );
        for series in [
            r#"hybridcache_lazy_flush_writes_total{cache="3",core="1"}"#,
            r#"hybridcache_lazy_flush_written_bytes_total{cache="3",core="1"}"#,
            r#"hybridcache_prefetch_requests_total{cache="3",core="1"}"#,
            r#"hybridcache_prefetch_read_bytes_total{cache="3",core="1"}"#,
            r#"hybridcache_prefetch_hit_lines_total{cache="3",core="1"}"#,
            r#"hybridcache_offload_reads_total{cache="3",core="1"}"#,
            r#"hybridcache_offload_writes_total{cache="3",core="1"}"#,
            r#"hybridcache_prefetch_written_bytes_total{cache="3",core="1"}"#,
            r#"hybridcache_deferred_requests_total{cache="3",core="1",direction="read"}"#,
            r#"hybridcache_deferred_requests_total{cache="3",core="1",direction="write"}"#,
            r#"hybridcache_cleaner_requests_total{cache="3",core="1"}"#,
            r#"hybridcache_cleaner_read_bytes_total{cache="3",core="1"}"#,
            r#"hybridcache_cleaner_written_bytes_total{cache="3",core="1"}"#,
        ] {
            assert_eq!(value(&text, series), 0.0, "{series}");
        }
        assert_eq!(
            value(&text, r#"hybridcache_export_clients{cache="3",core="1"}"#),
            2.0
        );
        let lines = value(&text, r#"hybridcache_cache_lines{cache="3"}"#);
        let ratio = value(&text, r#"hybridcache_cache_dirty_ratio{cache="3"}"#);
        assert!((ratio - 2.0 / lines).abs() < 1e-9, "{ratio} {lines}");
        assert!(
            text.contains("# TYPE hybridcache_requests counter"),
            "{text}"
        );
        assert!(text.trim_end().ends_with("# EOF"), "{text}");
        // One read hit and one write: each counted once in its latency histogram.
        assert_eq!(
            value(
                &text,
                r#"hybridcache_request_duration_seconds_count{cache="3",core="1",direction="read",served_by="cache"}"#
            ),
            1.0
        );
        assert_eq!(
            value(
                &text,
                r#"hybridcache_request_duration_seconds_bucket{le="+Inf",cache="3",core="1",direction="write",served_by="cache"}"#
            ),
            1.0
        );
    }

    #[test]
    fn http_endpoint_serves_metrics_and_refuses_the_rest() {
        let server =
            MetricsServer::start("127.0.0.1:0".parse().unwrap(), source(cache_with_writes()))
                .unwrap();
        let get = |path: &str| -> String {
            let mut s = TcpStream::connect(server.addr()).unwrap();
            write!(s, "GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
            let mut out = String::new();
            std::io::Read::read_to_string(&mut s, &mut out).unwrap();
            out
        };
        let ok = get("/metrics");
        assert!(ok.starts_with("HTTP/1.1 200 OK"), "{ok}");
        assert!(ok.contains("hybridcache_build_info"), "{ok}");
        assert!(get("/nope").starts_with("HTTP/1.1 404"));
        server.shutdown();
    }

    /// Every metric the endpoint serves has its row in docs/observability.md, so the docs
    /// cannot fall behind the code.
    #[test]
    fn every_metric_is_documented() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/observability.md");
        let docs = std::fs::read_to_string(path).expect("docs/observability.md");
        let scrape = render(&source(cache_with_writes())).unwrap();
        let mut names: Vec<&str> = scrape
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .collect();
        // Present only while a flush runs (the scrape above has none).
        names.push("hybridcache_flush_progress_ratio");
        assert!(names.len() >= 30, "{names:?}");
        for name in names {
            // The TYPE line names a counter without its `_total` and a histogram without its
            // `_bucket`/`_sum`/`_count`; the docs give the name a query uses.
            let row = |n: &str| docs.contains(&format!("| `{n}` |"));
            assert!(
                row(name) || row(&format!("{name}_total")),
                "{name} has no row in docs/observability.md"
            );
        }
    }

    /// The sample Grafana dashboard (docs/grafana/hybridcache.json) is valid JSON and asks only
    /// for series this endpoint exports.
    #[test]
    fn the_grafana_dashboard_uses_only_exported_metrics() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../docs/grafana/hybridcache.json"
        );
        let text = std::fs::read_to_string(path).expect("the dashboard file");
        let dash: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
        let scrape = render(&source(cache_with_writes())).unwrap();
        let exported: std::collections::BTreeSet<&str> = scrape
            .lines()
            .filter(|l| !l.starts_with('#') && !l.is_empty())
            .filter_map(|l| l.split(['{', ' ']).next())
            .collect();
        // Present only while a flush runs (the scrape above has none).
        let while_flushing = ["hybridcache_flush_progress_ratio"];
        let mut exprs = Vec::new();
        for panel in dash["panels"].as_array().expect("panels") {
            for t in panel["targets"].as_array().expect("targets") {
                exprs.push(t["expr"].as_str().expect("expr").to_string());
            }
        }
        assert!(exprs.len() >= 10);
        let mut used = 0;
        for e in &exprs {
            for (i, _) in e.match_indices("hybridcache_") {
                let name: String = e[i..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                used += 1;
                assert!(
                    exported.contains(name.as_str()) || while_flushing.contains(&name.as_str()),
                    "the dashboard asks for {name}, which /metrics does not export"
                );
            }
        }
        assert!(used >= exprs.len());
    }
}

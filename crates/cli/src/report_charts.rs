//! `hybridcache analyze --report-dir DIR`: the Markdown report with PNG charts.
//!
//! The analysis crate supplies the data (signature, miss-ratio curves, [`time_series`]) and
//! stays free of drawing code; the charts are drawn here with chart.rs. Files written:
//! `report.md` (the Markdown report, with a Charts section linking the images), `sizes.png`
//! (request-size histogram), `queue-depth.png` (requests in flight over time), `iops.png` and
//! `throughput.png` (over time), `mrc.png` (miss-ratio curve: hit ratio against cache size), and
//! for traces with several jobs `sizes-job<N>.png` per detailed job.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use hybridcache_analyze::units::bytes;
use hybridcache_analyze::{time_series, JobSignature, Report, Signature, Trace, MRC_BLOCK};

use crate::chart::{bar_chart, line_chart, LineChart, Series};

/// Points on the time axis; enough to see bursts, few enough to stay legible.
const TIME_POINTS: usize = 200;
/// Jobs drawn as their own line (the busiest ones) and given their own size histogram.
const MAX_JOBS: usize = 8;

/// One written chart: file name, title, and what to read from it.
struct Written {
    file: String,
    title: String,
    caption: String,
}

/// Writes the report and its charts into `dir` (created if missing); returns the report path.
pub fn write_report_dir(
    dir: &Path,
    trace: &Trace,
    sig: &Signature,
    report: &Report,
) -> Result<std::path::PathBuf> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let mut charts = Vec::new();
    let jobs: Vec<&JobSignature> = sig.jobs.iter().take(MAX_JOBS).collect();
    let several = sig.jobs.len() > 1;

    // Request sizes, all jobs, then per job when there are several.
    let size_bars = |j: &JobSignature| -> Vec<(String, f64)> {
        j.block_sizes()
            .into_iter()
            .map(|(s, (r, w))| (bytes(s), (r + w) as f64))
            .collect()
    };
    bar_chart(
        &dir.join("sizes.png"),
        "Request sizes (all jobs)",
        "request size",
        "requests",
        &size_bars(&sig.overall),
    )?;
    charts.push(Written {
        file: "sizes.png".into(),
        title: "Request sizes (all jobs)".into(),
        caption: format!(
            "Dominant size {} ({:.0}% of requests).",
            bytes(sig.overall.dominant_size()),
            100.0 * dominant_share(&sig.overall)
        ),
    });
    if several {
        for (i, j) in jobs.iter().enumerate() {
            let file = format!("sizes-job{}.png", i + 1);
            let title = format!("Request sizes: {}", j.name);
            bar_chart(
                &dir.join(&file),
                &title,
                "request size",
                "requests",
                &size_bars(j),
            )?;
            charts.push(Written {
                file,
                title,
                caption: format!("Dominant size {}.", bytes(j.dominant_size())),
            });
        }
    }

    // Over time: one line per job (and the total when there are several).
    let ts = time_series(trace, sig.request_action, TIME_POINTS);
    let times = ts.times();
    let line = |name: &str, values: &[f64]| Series {
        label: name.to_string(),
        points: times.iter().copied().zip(values.iter().copied()).collect(),
    };
    let per_job = |f: &dyn Fn(&hybridcache_analyze::JobSeries) -> Vec<f64>| -> Vec<Series> {
        let mut v: Vec<Series> = ts
            .jobs
            .iter()
            .take(MAX_JOBS)
            .map(|j| line(&j.name, &f(j)))
            .collect();
        if ts.jobs.len() > 1 {
            v.push(line("all jobs", &f(&ts.overall)));
        }
        v
    };
    let bucket = format_bucket(ts.bucket_s);
    if !ts.overall.depth_mean.is_empty() {
        let series = per_job(&|j| j.depth_mean.clone());
        let title = "Queue depth over time";
        line_chart(
            &dir.join("queue-depth.png"),
            &LineChart {
                title,
                x_label: "time since the first request (s)",
                y_label: &format!("requests in flight (mean per {bucket})"),
                series: &series,
                log_x: false,
                log_y: false,
            },
        )?;
        let qd = &sig.overall.queue_depth;
        charts.push(Written {
            file: "queue-depth.png".into(),
            title: title.into(),
            caption: format!(
                "Median depth {} on arrival, at most {} in flight.",
                qd.median_in_flight.unwrap_or(0),
                qd.max_in_flight.unwrap_or(0)
            ),
        });
    }
    let mut iops = per_job(&|j| sum(&j.read_iops, &j.write_iops));
    if !several {
        // One job: reads and writes apart say more than their sum.
        iops = vec![
            line("reads", &ts.overall.read_iops),
            line("writes", &ts.overall.write_iops),
        ];
    }
    line_chart(
        &dir.join("iops.png"),
        &LineChart {
            title: "IOPS over time",
            x_label: "time since the first request (s)",
            y_label: &format!("requests per second ({bucket} buckets)"),
            series: &iops,
            log_x: false,
            log_y: false,
        },
    )?;
    charts.push(Written {
        file: "iops.png".into(),
        title: "IOPS over time".into(),
        caption: format!(
            "Mean {:.0} IOPS, peak {:.0} (per-second buckets in the tables above).",
            sig.overall.timeline.mean_iops(),
            sig.overall.timeline.peak_iops()
        ),
    });
    let mut mbs = per_job(&|j| sum(&j.read_mb_s, &j.write_mb_s));
    if !several {
        mbs = vec![
            line("reads", &ts.overall.read_mb_s),
            line("writes", &ts.overall.write_mb_s),
        ];
    }
    line_chart(
        &dir.join("throughput.png"),
        &LineChart {
            title: "Throughput over time",
            x_label: "time since the first request (s)",
            y_label: &format!("MB/s ({bucket} buckets)"),
            series: &mbs,
            log_x: false,
            log_y: false,
        },
    )?;
    charts.push(Written {
        file: "throughput.png".into(),
        title: "Throughput over time".into(),
        caption: format!(
            "Mean {:.1} MB/s, peak {:.1} MB/s.",
            sig.overall.timeline.mean_mb_s(),
            sig.overall.timeline.peak_mb_s()
        ),
    });

    // Miss-ratio curve: cache size (log) against hit ratio.
    let curve = |j: &JobSignature, label: &str| Series {
        label: label.to_string(),
        points: j
            .mrc
            .sample_points(120)
            .into_iter()
            .map(|p| {
                (
                    (p.cache_blocks * MRC_BLOCK) as f64 / (1 << 20) as f64,
                    p.hit_ratio,
                )
            })
            .collect(),
    };
    let mut mrc = vec![curve(&sig.overall, "all jobs")];
    if several {
        mrc.extend(jobs.iter().map(|j| curve(j, &j.name)));
    }
    line_chart(
        &dir.join("mrc.png"),
        &LineChart {
            title: "Miss-ratio curve (LRU): hit ratio against cache size",
            x_label: "cache size (MiB)",
            y_label: "hit ratio (0..1)",
            series: &mrc,
            log_x: true,
            log_y: false,
        },
    )?;
    let c = &sig.overall.mrc;
    charts.push(Written {
        file: "mrc.png".into(),
        title: "Miss-ratio curve".into(),
        caption: if c.max_hit_ratio() > 0.0 {
            format!(
                "At most {:.0}% of block references hit, with {} of cache or more; 90% of that needs {}.",
                100.0 * c.max_hit_ratio(),
                bytes(c.size_for_fraction(1.0) * MRC_BLOCK),
                bytes(c.size_for_fraction(0.9) * MRC_BLOCK)
            )
        } else {
            "No block is referenced twice: no cache size gives hits (the chart is empty).".into()
        },
    });

    let mut md = report.render_markdown();
    let _ = writeln!(md, "## Charts\n");
    for w in &charts {
        let _ = writeln!(md, "![{}]({})\n\n{}\n", w.title, w.file, w.caption);
    }
    let path = dir.join("report.md");
    std::fs::write(&path, md).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

fn sum(a: &[f64], b: &[f64]) -> Vec<f64> {
    a.iter().zip(b).map(|(x, y)| x + y).collect()
}

fn dominant_share(j: &JobSignature) -> f64 {
    let d = j.dominant_size();
    let n = j.requests();
    if n == 0 {
        return 0.0;
    }
    let (r, w) = j.block_sizes().get(&d).copied().unwrap_or((0, 0));
    (r + w) as f64 / n as f64
}

/// "50 ms", "2 s": the bucket width for axis labels.
fn format_bucket(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.0} s")
    } else {
        format!("{:.0} ms", s * 1000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hybridcache_analyze::{parse_trace, recommend, DeviceProfile, Format};

    #[test]
    fn report_dir_has_markdown_and_charts() {
        let mut text = String::new();
        let mut seq = 0;
        for i in 0..400u64 {
            let t = i * 2_500_000;
            for (pid, sector, rw) in [(1, i * 8, "W"), (2, (i * 7919 % 1000) * 8, "R")] {
                seq += 1;
                let _ = writeln!(
                    text,
                    "1,1 0 {seq} {}.{:09} {pid} Q {rw} {sector} + 8 [nbd/cas1-1]",
                    t / 1_000_000_000,
                    t % 1_000_000_000
                );
                seq += 1;
                let t2 = t + 400_000;
                let _ = writeln!(
                    text,
                    "1,1 0 {seq} {}.{:09} {pid} C {rw} {sector} + 8 [0]",
                    t2 / 1_000_000_000,
                    t2 % 1_000_000_000
                );
            }
        }
        let trace = parse_trace(text.as_bytes(), Format::Blkparse).unwrap();
        let sig = Signature::from_trace(&trace);
        let rec = recommend(&sig, &DeviceProfile::raid60_study());
        let report = Report::new(&trace, &sig, &rec, 1);
        let dir = tempfile::tempdir().unwrap();
        let path = write_report_dir(dir.path(), &trace, &sig, &report).unwrap();
        let md = std::fs::read_to_string(path).unwrap();
        for f in [
            "sizes.png",
            "sizes-job1.png",
            "sizes-job2.png",
            "queue-depth.png",
            "iops.png",
            "throughput.png",
            "mrc.png",
        ] {
            assert!(md.contains(&format!("]({f})")), "{f} linked");
            let png = std::fs::read(dir.path().join(f)).unwrap();
            assert_eq!(&png[1..4], b"PNG", "{f}");
            assert!(png.len() > 4000, "{f}: {} bytes", png.len());
        }
    }
}

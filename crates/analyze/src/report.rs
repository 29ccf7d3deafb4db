//! The report: a document model (sections with paragraphs, tables, charts and code blocks)
//! rendered as plain text or Markdown.
//!
//! Charts are kept as data ([`Chart`]) next to the tables: the text and Markdown renderers show
//! them as small tables (with a bar column), and a later PNG/SVG renderer can draw the same data
//! without the report code changing.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::mrc::{MissRatioCurve, MRC_BLOCK};
use crate::recommend::Recommendation;
use crate::signature::{JobSignature, Signature};
use crate::trace::Trace;
use crate::units::{bytes, num, pct};

/// A table of strings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Table {
    pub headers: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

/// Chart data.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub enum Chart {
    /// Bars: label -> value (e.g. request size -> count).
    Histogram {
        title: String,
        x_label: String,
        y_label: String,
        bars: Vec<(String, f64)>,
    },
    /// A curve, y in 0..=1 (e.g. the miss-ratio curve: cache size -> hit ratio).
    Curve {
        title: String,
        x_label: String,
        y_label: String,
        points: Vec<(String, f64)>,
    },
}

impl Chart {
    pub fn title(&self) -> &str {
        match self {
            Chart::Histogram { title, .. } | Chart::Curve { title, .. } => title,
        }
    }

    /// The chart as a table with a bar column, for text output.
    pub fn as_table(&self) -> Table {
        const WIDTH: f64 = 30.0;
        match self {
            Chart::Histogram {
                x_label,
                y_label,
                bars,
                ..
            } => {
                let max = bars.iter().map(|b| b.1).fold(0.0, f64::max).max(1e-12);
                let total: f64 = bars.iter().map(|b| b.1).sum::<f64>().max(1e-12);
                Table {
                    headers: vec![
                        x_label.clone(),
                        y_label.clone(),
                        "share".into(),
                        String::new(),
                    ],
                    rows: bars
                        .iter()
                        .map(|(l, v)| {
                            vec![
                                l.clone(),
                                format!("{}", *v as u64),
                                pct(v / total),
                                "#".repeat(((v / max) * WIDTH).round() as usize),
                            ]
                        })
                        .collect(),
                }
            }
            Chart::Curve {
                x_label,
                y_label,
                points,
                ..
            } => Table {
                headers: vec![x_label.clone(), y_label.clone(), String::new()],
                rows: points
                    .iter()
                    .map(|(l, v)| {
                        vec![l.clone(), pct(*v), "#".repeat((v * WIDTH).round() as usize)]
                    })
                    .collect(),
            },
        }
    }
}

/// One section of the report.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Section {
    pub title: String,
    pub paragraphs: Vec<String>,
    /// Bulleted items.
    pub items: Vec<String>,
    pub tables: Vec<Table>,
    pub charts: Vec<Chart>,
    /// (language, text) code blocks.
    pub code: Vec<(String, String)>,
}

/// The whole report.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub title: String,
    pub sections: Vec<Section>,
}

/// How many jobs get their own detail section.
const DETAILED_JOBS: usize = 8;

fn size_histogram(j: &JobSignature) -> Chart {
    Chart::Histogram {
        title: format!("Request sizes: {}", j.name),
        x_label: "size".into(),
        y_label: "requests".into(),
        bars: j
            .block_sizes()
            .into_iter()
            .map(|(s, (r, w))| (format!("{} (r {r}, w {w})", bytes(s)), (r + w) as f64))
            .collect(),
    }
}

fn mrc_chart(name: &str, c: &MissRatioCurve) -> Option<Chart> {
    if c.max_hit_ratio() <= 0.0 {
        return None;
    }
    let how = if c.sampling_rate < 1.0 {
        format!("SHARDS, rate {:.4}", c.sampling_rate)
    } else {
        "exact".into()
    };
    Some(Chart::Curve {
        title: format!("Miss-ratio curve ({how}): {name}"),
        x_label: "cache size".into(),
        y_label: "hit ratio".into(),
        points: c
            .sample_points(10)
            .into_iter()
            .map(|p| (bytes(p.cache_blocks * MRC_BLOCK), p.hit_ratio))
            .collect(),
    })
}

/// The curve, or a sentence saying there is none to draw.
fn add_mrc(s: &mut Section, name: &str, c: &MissRatioCurve) {
    match mrc_chart(name, c) {
        Some(chart) => s.charts.push(chart),
        None => s.paragraphs.push(format!(
            "Miss-ratio curve of {name}: no block is referenced twice, so no cache size gives hits."
        )),
    }
}

fn qd_text(j: &JobSignature) -> String {
    let q = &j.queue_depth;
    match (q.max_in_flight, q.median_in_flight, q.study_run) {
        (Some(m), Some(med), Some(r)) => format!("{med} (max {m}, run {r})"),
        _ => "unknown".into(),
    }
}

impl Report {
    /// Builds the report; `cache_id` is used in the commands.
    pub fn new(trace: &Trace, sig: &Signature, rec: &Recommendation, cache_id: u32) -> Report {
        let mut sections = Vec::new();
        let o = &sig.overall;

        // Trace.
        let mut s = Section {
            title: "Trace".into(),
            ..Default::default()
        };
        s.paragraphs.push(format!(
            "Format {}; {} devices ({}); {} jobs with IO; {} s; requests taken from {:?} events{}.",
            trace.format,
            trace.devices.len(),
            trace
                .devices
                .iter()
                .take(6)
                .cloned()
                .collect::<Vec<_>>()
                .join(", "),
            sig.jobs.len(),
            num(o.duration_s()),
            sig.request_action,
            if sig.has_completions {
                ""
            } else {
                "; no completions, so queue depth is unknown"
            }
        ));
        s.paragraphs.push(format!(
            "{} lines: {} parsed into {} events; skipped {} blank, {} header, {} summary; {} bad.",
            trace.report.lines,
            trace.report.parsed,
            trace.report.events,
            trace.report.blank,
            trace.report.headers,
            trace.report.summary,
            trace.report.bad
        ));
        for b in &trace.report.first_bad {
            s.items
                .push(format!("line {}: `{}` ({})", b.line, b.text, b.why));
        }
        sections.push(s);

        // Recommendation.
        let c = &rec.config;
        let mut s = Section {
            title: format!("Recommended configuration (profile: {})", rec.profile),
            ..Default::default()
        };
        s.paragraphs.push(format!(
            "Mode {}, {} KiB lines, cleaning {}, lazy flush {}, seq-cutoff {} {} KiB, promotion {}, prefetch {}, {} IO classes, cache size {}.",
            c.mode.as_str(),
            c.line_size_kib,
            c.cleaning.preset().unwrap_or(c.cleaning.name()),
            if c.lazy_flush { "on" } else { "off" },
            c.seq_cutoff.policy.as_str(),
            c.seq_cutoff.threshold,
            match c.promotion {
                crate::recommend::Promotion::Always => "always".to_string(),
                crate::recommend::Promotion::Nhit { threshold, trigger } => format!("nhit {threshold}/{trigger}%"),
            },
            match c.prefetch {
                Some(ra) => format!("readahead {} KiB", ra.threshold),
                None => "none".to_string(),
            },
            c.io_classes.len(),
            bytes(c.cache_size_bytes)
        ));
        for r in &rec.reasons {
            s.items.push(format!("{}: {}", r.setting, r.text));
        }
        s.code
            .push(("sh".into(), rec.commands(cache_id).join("\n")));
        let csv = rec.io_class_csv();
        if !csv.is_empty() {
            s.code
                .push(("csv".into(), format!("# ioclass.csv\n{}", csv.trim_end())));
        }
        s.code.push((
            "toml".into(),
            rec.toml_fragment(cache_id).trim_end().to_string(),
        ));
        sections.push(s);

        // Jobs.
        let mut s = Section {
            title: "Jobs".into(),
            ..Default::default()
        };
        let mut t = Table {
            headers: [
                "job",
                "requests",
                "reads",
                "writes random",
                "reads random",
                "size",
                "queue depth",
                "IOPS mean/peak",
                "MB/s mean/peak",
                "working set",
                "verdict",
            ]
            .iter()
            .map(|h| h.to_string())
            .collect(),
            rows: Vec::new(),
        };
        let verdict = |name: &str| -> String {
            rec.jobs.iter().find(|r| r.job == name).map_or_else(
                || "-".into(),
                |r| format!("{:?} {}", r.decision, r.mode.as_str()).to_lowercase(),
            )
        };
        for j in sig.jobs.iter().chain(std::iter::once(o)) {
            t.rows.push(vec![
                j.name.clone(),
                j.requests().to_string(),
                pct(j.read_share()),
                if j.writes.requests > 0 {
                    pct(j.writes.random_share())
                } else {
                    "-".into()
                },
                if j.reads.requests > 0 {
                    pct(j.reads.random_share())
                } else {
                    "-".into()
                },
                bytes(j.dominant_size()),
                qd_text(j),
                format!(
                    "{}/{}",
                    num(j.timeline.mean_iops()),
                    num(j.timeline.peak_iops())
                ),
                format!(
                    "{}/{}",
                    num(j.timeline.mean_mb_s()),
                    num(j.timeline.peak_mb_s())
                ),
                bytes(j.working_set.bytes()),
                if std::ptr::eq(j, o) {
                    format!("(overall: {})", rec.overall_job.mode.as_str())
                } else {
                    verdict(&j.name)
                },
            ]);
        }
        s.tables.push(t);
        for r in &rec.jobs {
            s.items.push(format!("{}: {}", r.job, r.reason));
        }
        sections.push(s);

        // Whole-trace detail.
        let mut s = Section {
            title: "Whole trace".into(),
            ..Default::default()
        };
        s.paragraphs.push(format!(
            "Reads {} of requests ({} of bytes); writes {} random, reads {} random. Working set {} ({} read, {} written, {} both). Idle seconds {}. Miss-ratio curve over {} block references: at most {} hits{}.",
            pct(o.read_share()),
            pct(o.read_byte_share()),
            pct(o.writes.random_share()),
            pct(o.reads.random_share()),
            bytes(o.working_set.bytes()),
            bytes(o.working_set.read_blocks * MRC_BLOCK),
            bytes(o.working_set.write_blocks * MRC_BLOCK),
            bytes(o.working_set.read_write_blocks * MRC_BLOCK),
            pct(o.timeline.idle_share()),
            o.mrc.references,
            pct(o.mrc.max_hit_ratio()),
            rec.knee.map_or(String::new(), |(b, h)| format!(", knee at {} ({})", bytes(b * MRC_BLOCK), pct(h)))
        ));
        s.charts.push(size_histogram(o));
        add_mrc(&mut s, &o.name, &o.mrc);
        sections.push(s);

        for j in sig
            .jobs
            .iter()
            .take(DETAILED_JOBS)
            .filter(|_| sig.jobs.len() > 1)
        {
            let mut s = Section {
                title: format!("Job {}", j.name),
                ..Default::default()
            };
            s.paragraphs.push(format!(
                "{} requests on {}; reads {}; queue depth {}; working set {}.",
                j.requests(),
                j.devices.join(", "),
                pct(j.read_share()),
                qd_text(j),
                bytes(j.working_set.bytes())
            ));
            s.charts.push(size_histogram(j));
            add_mrc(&mut s, &j.name, &j.mrc);
            sections.push(s);
        }

        Report {
            title: "hybridcache workload analysis".into(),
            sections,
        }
    }

    pub fn render_text(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "{}\n{}\n", self.title, "=".repeat(self.title.len()));
        for s in &self.sections {
            let _ = writeln!(out, "{}\n{}", s.title, "-".repeat(s.title.chars().count()));
            for p in &s.paragraphs {
                let _ = writeln!(out, "{p}");
            }
            for t in &s.tables {
                out += &text_table(t);
            }
            for i in &s.items {
                let _ = writeln!(out, "  - {i}");
            }
            for c in &s.charts {
                let _ = writeln!(out, "\n{}", c.title());
                out += &text_table(&c.as_table());
            }
            for (_, code) in &s.code {
                let _ = writeln!(out);
                for l in code.lines() {
                    let _ = writeln!(out, "    {l}");
                }
            }
            let _ = writeln!(out);
        }
        out
    }

    pub fn render_markdown(&self) -> String {
        let mut out = format!("# {}\n\n", self.title);
        for s in &self.sections {
            let _ = writeln!(out, "## {}\n", s.title);
            for p in &s.paragraphs {
                let _ = writeln!(out, "{}\n", md_escape(p));
            }
            for t in &s.tables {
                out += &md_table(t);
            }
            if !s.items.is_empty() {
                for i in &s.items {
                    let _ = writeln!(out, "- {}", md_escape(i));
                }
                let _ = writeln!(out);
            }
            for c in &s.charts {
                let _ = writeln!(out, "**{}**\n", md_escape(c.title()));
                out += &md_table(&c.as_table());
            }
            for (lang, code) in &s.code {
                let _ = writeln!(out, "```{lang}\n{code}\n```\n");
            }
        }
        out
    }
}

fn text_table(t: &Table) -> String {
    let cols = t.headers.len();
    let mut w = vec![0usize; cols];
    for row in std::iter::once(&t.headers).chain(&t.rows) {
        for (i, c) in row.iter().enumerate().take(cols) {
            w[i] = w[i].max(c.chars().count());
        }
    }
    let mut out = String::new();
    for (n, row) in std::iter::once(&t.headers).chain(&t.rows).enumerate() {
        let line: Vec<String> = row
            .iter()
            .enumerate()
            .take(cols)
            .map(|(i, c)| format!("{c:<w$}", w = w[i]))
            .collect();
        let _ = writeln!(out, "  {}", line.join("  ").trim_end());
        if n == 0 {
            let _ = writeln!(
                out,
                "  {}",
                w.iter()
                    .map(|n| "-".repeat(*n))
                    .collect::<Vec<_>>()
                    .join("  ")
                    .trim_end()
            );
        }
    }
    out
}

fn md_escape(s: &str) -> String {
    s.replace('|', "\\|")
}

fn md_table(t: &Table) -> String {
    let mut out = String::new();
    let row = |r: &Vec<String>| {
        format!(
            "| {} |",
            r.iter()
                .map(|c| md_escape(c))
                .collect::<Vec<_>>()
                .join(" | ")
        )
    };
    let _ = writeln!(out, "{}", row(&t.headers));
    let _ = writeln!(out, "|{}", " --- |".repeat(t.headers.len()));
    for r in &t.rows {
        let _ = writeln!(out, "{}", row(r));
    }
    out.push('\n');
    out
}

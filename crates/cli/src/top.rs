//! `hybridcache top`: a live view of the caches, refreshed every second, for a terminal of any
//! size down to 80x24 (over ssh too).
//!
//! The top table has a row per cache and per core: IOPS, MB/s (client traffic on the exported
//! volumes), hit ratio over the last interval, occupancy and dirty % of the cache's lines, cleaning
//! MB/s, p99 latency and device errors (both since the statistics were last reset), and the NBD
//! connections open on the exports (`-L`'s count; a cache's row sums its cores'). Below it, the selected cache's detail: its latency percentiles and
//! a minute of IOPS history. Keys: q or Esc quits, Tab / left / right select the cache, s cycles
//! the sort order (id, IOPS, dirty %). Everything comes from the daemon's control socket, as `-L`
//! and `-P` would read it.

use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind};
use ratatui::layout::{Constraint, Direction, Layout};
use ratatui::style::{Modifier, Style};
use ratatui::text::Line;
use ratatui::widgets::{Block, Borders, Paragraph, Row, Sparkline, Table};
use ratatui::Frame;

use crate::protocol::{CacheInfo, CacheList, Request, StatsReport};

#[derive(Debug, Clone, Args)]
pub struct TopArgs {
    /// Refresh interval in seconds.
    #[arg(short = 'd', long = "delay", default_value_t = 1.0, value_parser = delay)]
    pub delay: f64,
    /// Start with this cache selected.
    #[arg(short = 'i', long = "cache-id", value_parser = crate::cli::cache_id)]
    pub id: Option<u16>,
}

fn delay(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (0.1..=60.0).contains(&v) => Ok(v),
        _ => Err(format!("'{s}' is not a delay of 0.1 to 60 seconds")),
    }
}

/// One sample of one cache or core.
#[derive(Clone, Copy, Default)]
struct Sample {
    requests: u64,
    hits: u64,
    cached_requests: u64,
    bytes: u64,
    cleaned_bytes: u64,
    dirty_pct: f64,
    occupancy_pct: f64,
    /// Cache and core read and write errors, as `-P`'s error statistics count them.
    errors: u64,
    p99_us: Option<f64>,
}

fn sample(r: &StatsReport) -> Sample {
    let s = &r.stats;
    let hits = s.read_hits + s.write_hits;
    let cached = hits
        + s.read_partial_misses
        + s.read_full_misses
        + s.write_partial_misses
        + s.write_full_misses;
    Sample {
        requests: cached + s.pass_through_reads + s.pass_through_writes,
        hits,
        cached_requests: cached,
        bytes: s.exported_read_bytes + s.exported_written_bytes,
        cleaned_bytes: r.cleaning.map_or(0, |c| c.core_write_bytes),
        dirty_pct: pct(s.dirty_lines, s.total_lines),
        occupancy_pct: pct(s.occupancy_lines, s.total_lines),
        errors: s.cache_read_errors
            + s.cache_write_errors
            + s.core_read_errors
            + s.core_write_errors,
        p99_us: r
            .latency
            .iter()
            .filter(|l| l.key == "read" || l.key == "write")
            .filter_map(|l| l.p99_us)
            .fold(None, |m: Option<f64>, v| Some(m.map_or(v, |m| m.max(v)))),
    }
}

fn pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        part as f64 * 100.0 / whole as f64
    }
}

/// A count in at most 4 characters: 9999, then 10k .. 999k, then 1M ...
fn count4(n: u64) -> String {
    match n {
        0..=9_999 => n.to_string(),
        10_000..=999_999 => format!("{}k", n / 1000),
        _ => format!("{}M", n / 1_000_000),
    }
}

/// Rates over one interval.
#[derive(Clone, Copy, Default)]
struct Rates {
    iops: f64,
    mb_s: f64,
    hit_pct: Option<f64>,
    clean_mb_s: f64,
}

fn rates(prev: &Sample, now: &Sample, dt: f64) -> Rates {
    let d = |a: u64, b: u64| b.saturating_sub(a) as f64;
    let cached = d(prev.cached_requests, now.cached_requests);
    Rates {
        iops: d(prev.requests, now.requests) / dt,
        mb_s: d(prev.bytes, now.bytes) / dt / 1e6,
        hit_pct: (cached > 0.0).then(|| d(prev.hits, now.hits) * 100.0 / cached),
        clean_mb_s: d(prev.cleaned_bytes, now.cleaned_bytes) / dt / 1e6,
    }
}

/// Key of a row: (cache, core or None for the cache itself).
type RowKey = (u16, Option<u16>);

struct View {
    caches: Vec<CacheInfo>,
    last: BTreeMap<RowKey, Sample>,
    rates: BTreeMap<RowKey, Rates>,
    history: BTreeMap<u16, VecDeque<u64>>,
    latency: BTreeMap<u16, StatsReport>,
    /// The selected cache, by id: it stays selected when the sort order moves it.
    selected: Option<u16>,
    sort: usize,
    last_at: Option<Instant>,
    error: Option<String>,
}

const SORTS: [&str; 3] = ["id", "IOPS", "dirty %"];
const HISTORY: usize = 120;

impl View {
    fn refresh(&mut self, control: &Path) {
        let now = Instant::now();
        let dt = self
            .last_at
            .map(|t| now.duration_since(t).as_secs_f64())
            .unwrap_or(1.0)
            .max(1e-3);
        let list: CacheList = match crate::call(control, &Request::List) {
            Ok(l) => l,
            Err(e) => {
                self.error = Some(format!("{e:#}"));
                return;
            }
        };
        self.error = None;
        let mut samples = BTreeMap::new();
        for c in &list.caches {
            if let Ok(r) = crate::call::<StatsReport>(
                control,
                &Request::Stats {
                    cache: c.id,
                    core: None,
                    io_class: None,
                },
            ) {
                samples.insert((c.id, None), sample(&r));
                self.latency.insert(c.id, r);
            }
            for core in c.cores.iter().filter(|k| k.status == "Active") {
                if let Ok(r) = crate::call::<StatsReport>(
                    control,
                    &Request::Stats {
                        cache: c.id,
                        core: Some(core.id),
                        io_class: None,
                    },
                ) {
                    samples.insert((c.id, Some(core.id)), sample(&r));
                }
            }
        }
        self.rates = samples
            .iter()
            .map(|(k, s)| {
                let r = self
                    .last
                    .get(k)
                    .map(|p| rates(p, s, dt))
                    .unwrap_or_default();
                (*k, r)
            })
            .collect();
        for c in &list.caches {
            let iops = self.rates.get(&(c.id, None)).map_or(0.0, |r| r.iops);
            let h = self.history.entry(c.id).or_default();
            h.push_back(iops.round() as u64);
            while h.len() > HISTORY {
                h.pop_front();
            }
        }
        self.last = samples;
        self.caches = list.caches;
        self.last_at = Some(now);
    }

    /// Where the selected cache is in `sorted`; the first row if it is gone.
    fn selected_index(&self, sorted: &[&CacheInfo]) -> usize {
        self.selected
            .and_then(|id| sorted.iter().position(|c| c.id == id))
            .unwrap_or(0)
    }

    /// Select the cache `by` rows further down (wrapping).
    fn step(&mut self, by: usize) {
        let sorted = self.sorted();
        if sorted.is_empty() {
            return;
        }
        let i = (self.selected_index(&sorted) + by) % sorted.len();
        self.selected = Some(sorted[i].id);
    }

    fn sorted(&self) -> Vec<&CacheInfo> {
        let mut v: Vec<&CacheInfo> = self.caches.iter().collect();
        let key = |c: &CacheInfo| -> f64 {
            match self.sort {
                1 => -self.rates.get(&(c.id, None)).map_or(0.0, |r| r.iops),
                2 => -self.last.get(&(c.id, None)).map_or(0.0, |s| s.dirty_pct),
                _ => f64::from(c.id),
            }
        };
        v.sort_by(|a, b| key(a).total_cmp(&key(b)));
        v
    }

    fn draw(&self, f: &mut Frame) {
        let area = f.area();
        let sorted = self.sorted();
        let selected = self.selected_index(&sorted);
        let table_height = (sorted.iter().map(|c| 1 + c.cores.len()).sum::<usize>() + 3)
            .min(area.height.saturating_sub(8) as usize)
            .max(4) as u16;
        let parts = Layout::default()
            .direction(Direction::Vertical)
            .constraints([
                Constraint::Length(table_height),
                Constraint::Min(5),
                Constraint::Length(1),
            ])
            .split(area);

        let fmt1 = |v: f64| format!("{v:.1}");
        let mut rows = Vec::new();
        for (i, c) in sorted.iter().enumerate() {
            let style = if i == selected {
                Style::default().add_modifier(Modifier::REVERSED)
            } else {
                Style::default()
            };
            let r = self.rates.get(&(c.id, None)).copied().unwrap_or_default();
            let s = self.last.get(&(c.id, None)).copied().unwrap_or_default();
            let connections: usize = c.cores.iter().map(|k| k.clients).sum();
            rows.push(
                Row::new(vec![
                    format!("cache {}", c.id),
                    format!("{} {}", c.mode, short_status(&c.status)),
                    format!("{:.0}", r.iops),
                    fmt1(r.mb_s),
                    r.hit_pct.map_or("-".into(), fmt1),
                    fmt1(s.occupancy_pct),
                    fmt1(s.dirty_pct),
                    fmt1(r.clean_mb_s),
                    s.p99_us.map_or("-".into(), |v| format!("{v:.0}")),
                    count4(s.errors),
                    count4(connections as u64),
                ])
                .style(style),
            );
            for core in &c.cores {
                let r = self
                    .rates
                    .get(&(c.id, Some(core.id)))
                    .copied()
                    .unwrap_or_default();
                let s = self
                    .last
                    .get(&(c.id, Some(core.id)))
                    .copied()
                    .unwrap_or_default();
                rows.push(Row::new(vec![
                    format!(" core {}", core.id),
                    core.status.chars().take(10).collect(),
                    format!("{:.0}", r.iops),
                    fmt1(r.mb_s),
                    r.hit_pct.map_or("-".into(), fmt1),
                    fmt1(s.occupancy_pct),
                    fmt1(s.dirty_pct),
                    String::new(),
                    s.p99_us.map_or("-".into(), |v| format!("{v:.0}")),
                    count4(s.errors),
                    count4(core.clients as u64),
                ]));
            }
        }
        // 80 columns: 68 of cells, 10 between them, 2 of border. "clean" is cleaning's MB/s,
        // "errs" device errors, "conns" NBD connections (nbdfuse opens several per mount).
        let header = Row::new(vec![
            "", "state", "IOPS", "MB/s", "hit%", "occ%", "dirty%", "clean", "p99us", "errs",
            "conns",
        ])
        .style(Style::default().add_modifier(Modifier::BOLD));
        let table = Table::new(
            rows,
            [
                Constraint::Length(9),
                Constraint::Length(10),
                Constraint::Length(7),
                Constraint::Length(6),
                Constraint::Length(5),
                Constraint::Length(5),
                Constraint::Length(6),
                Constraint::Length(5),
                Constraint::Length(6),
                Constraint::Length(4),
                Constraint::Length(5),
            ],
        )
        .header(header)
        .block(
            Block::default()
                .borders(Borders::ALL)
                .title(format!(" hybridcache top - sort: {} ", SORTS[self.sort])),
        );
        f.render_widget(table, parts[0]);

        let detail = parts[1];
        if let Some(c) = sorted.get(selected) {
            let halves = Layout::default()
                .direction(Direction::Horizontal)
                .constraints([Constraint::Length(40), Constraint::Min(10)])
                .split(detail);
            let mut lines = vec![Line::from(format!(
                "cache {}: {} lines of {} KiB, {}",
                c.id, c.lines, c.line_size_kib, c.cleaning
            ))];
            if let Some(r) = self.latency.get(&c.id) {
                lines.push(Line::from("latency us    p50    p99  p99.99"));
                for l in &r.latency {
                    if l.count == 0 {
                        continue;
                    }
                    let v = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.0}"));
                    let name: String = l.key.replace('_', " ");
                    lines.push(Line::from(format!(
                        "{name:<11} {:>6} {:>6} {:>7}",
                        v(l.p50_us),
                        v(l.p99_us),
                        v(l.p9999_us)
                    )));
                }
            }
            if let Some(f) = &c.flush {
                lines.push(Line::from(format!(
                    "flushing {:.1} % ({:.1} MB/s)",
                    f.percent,
                    f.bytes_per_s / 1e6
                )));
            }
            f.render_widget(
                Paragraph::new(lines)
                    .block(Block::default().borders(Borders::ALL).title(" detail ")),
                halves[0],
            );
            let history: Vec<u64> = self
                .history
                .get(&c.id)
                .map(|h| {
                    let width = halves[1].width.saturating_sub(2) as usize;
                    h.iter().rev().take(width).rev().copied().collect()
                })
                .unwrap_or_default();
            let peak = history.iter().copied().max().unwrap_or(0);
            f.render_widget(
                Sparkline::default()
                    .block(
                        Block::default()
                            .borders(Borders::ALL)
                            .title(format!(" IOPS, peak {peak} ")),
                    )
                    .data(&history),
                halves[1],
            );
        } else {
            f.render_widget(
                Paragraph::new("No caches running").block(Block::default().borders(Borders::ALL)),
                detail,
            );
        }
        let help = match &self.error {
            Some(e) => format!("error: {e}"),
            None => "q quit  tab/left/right cache  s sort".into(),
        };
        f.render_widget(Paragraph::new(help), parts[2]);
    }
}

/// The status as the state column's 10 characters leave room for after the mode: a flush as its
/// percentage ("wb->wt 42%"; the detail pane says "flushing"), others as they are, cut.
fn short_status(s: &str) -> String {
    let flushing = s
        .strip_prefix("Flushing (")
        .and_then(|r| r.strip_suffix(" %)"))
        .and_then(|p| p.parse::<f64>().ok());
    match flushing {
        Some(p) => format!("{p:.0}%"),
        None => s.to_string(),
    }
}

/// Run the live view until the user quits.
pub fn run(args: &TopArgs, control: &Path) -> Result<()> {
    // Fail before taking over the terminal when the daemon is not there, or the cache asked
    // for is not: a view of a cache that does not exist would show another one instead.
    let list: CacheList = crate::call(control, &Request::List)?;
    if let Some(id) = args.id {
        if !list.caches.iter().any(|c| c.id == id) {
            let running: Vec<String> = list.caches.iter().map(|c| c.id.to_string()).collect();
            anyhow::bail!(
                "cache {id} does not exist ({})",
                if running.is_empty() {
                    "no caches running".to_string()
                } else {
                    format!("running: {}", running.join(", "))
                }
            );
        }
    }
    let mut terminal = ratatui::try_init().context("cannot set up the terminal")?;
    let result = run_loop(&mut terminal, args, control);
    ratatui::restore();
    result
}

fn run_loop(terminal: &mut ratatui::DefaultTerminal, args: &TopArgs, control: &Path) -> Result<()> {
    let mut view = View {
        caches: Vec::new(),
        last: BTreeMap::new(),
        rates: BTreeMap::new(),
        history: BTreeMap::new(),
        latency: BTreeMap::new(),
        selected: args.id,
        sort: 0,
        last_at: None,
        error: None,
    };
    view.refresh(control);
    let interval = Duration::from_secs_f64(args.delay);
    let mut next = Instant::now() + interval;
    loop {
        terminal.draw(|f| view.draw(f))?;
        let wait = next.saturating_duration_since(Instant::now());
        if event::poll(wait)? {
            if let Event::Key(k) = event::read()? {
                if k.kind != KeyEventKind::Press {
                    continue;
                }
                let n = view.caches.len().max(1);
                match k.code {
                    KeyCode::Char('q') | KeyCode::Esc => return Ok(()),
                    KeyCode::Tab | KeyCode::Right => view.step(1),
                    KeyCode::Left | KeyCode::BackTab => view.step(n - 1),
                    KeyCode::Char('s') => view.sort = (view.sort + 1) % SORTS.len(),
                    _ => {}
                }
            }
            continue;
        }
        view.refresh(control);
        next = Instant::now() + interval;
    }
}

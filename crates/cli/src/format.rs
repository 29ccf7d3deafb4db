//! Output for people and scripts: the cache list and statistics as casadm prints them (table),
//! plus CSV and JSON.
//!
//! Statistics are rows of (section, name, count, percentage, unit) built once and rendered three
//! ways, so the formats cannot disagree. Counts are in 4 KiB blocks or requests, as casadm reports
//! them; percentages are of the cache size (usage), of all requests (requests), of the device's
//! total traffic (blocks) and of all errors (errors).

use std::fmt::Write as _;

use serde_json::{json, Map, Value};

use crate::protocol::{CacheInfo, StatsReport};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Table,
    Csv,
    Json,
}

/// [`list_with_pool`] without a core pool, as the tests call it.
#[cfg(test)]
pub fn list(caches: &[CacheInfo], format: OutputFormat) -> String {
    list_with_pool(caches, &[], format)
}

/// `list`: the core pool's devices (`--try-add` before their cache runs), then cache rows, each
/// followed by its indented core rows.
pub fn list_with_pool(caches: &[CacheInfo], core_pool: &[String], format: OutputFormat) -> String {
    let header = [
        "type",
        "id",
        "disk",
        "status",
        "write policy",
        "device",
        // NBD connections open on the export (one nbdfuse mount opens 4); a ublk device held
        // open counts 1. JSON keeps the name `clients`.
        "connections",
    ];
    let mut rows: Vec<[String; 7]> = Vec::new();
    // casadm lists the core pool first (cas_lib.c, `list_caches`): a `core pool` row, then each
    // pooled core, Detached.
    if !core_pool.is_empty() {
        rows.push([
            "core pool".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
            "-".into(),
        ]);
        for (i, device) in core_pool.iter().enumerate() {
            let branch = if i + 1 == core_pool.len() {
                "└core"
            } else {
                "├core"
            };
            rows.push([
                branch.into(),
                "-".into(),
                device.clone(),
                "Detached".into(),
                "-".into(),
                "-".into(),
                "-".into(),
            ]);
        }
    }
    for c in caches {
        rows.push([
            "cache".into(),
            c.id.to_string(),
            c.device.clone(),
            c.status.clone(),
            c.mode.clone(),
            "-".into(),
            c.cores.iter().map(|k| k.clients).sum::<usize>().to_string(),
        ]);
        if let Some(m) = &c.mirror {
            let branch = if c.cores.is_empty() {
                "└mirror"
            } else {
                "├mirror"
            };
            rows.push([
                branch.into(),
                "-".into(),
                m.device.clone(),
                format!("{} ({})", mirror_state(m), mirror_fill(m)),
                "-".into(),
                "-".into(),
                "-".into(),
            ]);
        }
        let n = c.cores.len();
        for (i, core) in c.cores.iter().enumerate() {
            let branch = if i + 1 == n { "└core" } else { "├core" };
            rows.push([
                branch.into(),
                core.id.to_string(),
                core.device.clone(),
                core.status.clone(),
                "-".into(),
                // As casadm shows /dev/casX-Y: the block device where there is one.
                core.block_device
                    .clone()
                    .unwrap_or_else(|| core.export.clone()),
                core.clients.to_string(),
            ]);
        }
    }
    match format {
        OutputFormat::Table => {
            if rows.is_empty() {
                return "No caches running\n".into();
            }
            let mut width = header.map(|h| h.chars().count());
            for r in &rows {
                for (w, cell) in width.iter_mut().zip(r) {
                    *w = (*w).max(cell.chars().count());
                }
            }
            let mut out = String::new();
            let line = |out: &mut String, cells: &[&str]| {
                let mut s = String::new();
                for (i, cell) in cells.iter().enumerate() {
                    if i + 1 == cells.len() {
                        s.push_str(cell);
                    } else {
                        let pad = width[i] - cell.chars().count();
                        s.push_str(cell);
                        s.push_str(&" ".repeat(pad + 3));
                    }
                }
                out.push_str(s.trim_end());
                out.push('\n');
            };
            line(&mut out, &header);
            for r in &rows {
                let cells: Vec<&str> = r.iter().map(String::as_str).collect();
                line(&mut out, &cells);
            }
            out
        }
        OutputFormat::Csv => {
            let mut out = header.join(",") + "\n";
            for r in &rows {
                let cells: Vec<String> = r
                    .iter()
                    .map(|c| csv_cell(c.trim_start_matches(['├', '└'])))
                    .collect();
                out.push_str(&cells.join(","));
                out.push('\n');
            }
            out
        }
        OutputFormat::Json => {
            let v = json!({ "caches": caches, "core_pool": core_pool });
            serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
        }
    }
}

/// A mirror's state as `-L` and `-P` show it: `Redundant`, `Primary lost`, `Mirror lost`.
pub fn mirror_status(state: &str) -> String {
    let mut s = state.to_string();
    if let Some(first) = s.get_mut(0..1) {
        first.make_ascii_uppercase();
    }
    s
}

/// A mirror's state with a rebuild's progress: `Rebuilding (1,024/4,096 dirty lines)`.
pub fn mirror_state(m: &crate::protocol::MirrorInfo) -> String {
    match m.rebuild {
        Some((copied, total)) => format!(
            "{} ({}/{} dirty lines)",
            mirror_status(&m.state),
            hybridcache_daemon::safety::count_text(copied),
            hybridcache_daemon::safety::count_text(total)
        ),
        None => mirror_status(&m.state),
    }
}

/// How full a mirror's lines are: `12/3,932 lines dirty` (every dirty line is among the
/// lines the mirror covers; a smaller mirror covers fewer than the cache has).
pub fn mirror_fill(m: &crate::protocol::MirrorInfo) -> String {
    format!(
        "{}/{} lines dirty",
        hybridcache_daemon::safety::count_text(m.dirty_lines),
        hybridcache_daemon::safety::count_text(m.lines)
    )
}

/// Where udev keeps the persistent names of disks.
pub const BY_ID: &str = "/dev/disk/by-id";

/// `-b`/`--by-id-path`: the `dir` (/dev/disk/by-id) name of the disk `device` is, if one names
/// it; anything else (a file, `ram:`, an NBD URI, a disk without one) as given.
pub fn by_id_path_in(dir: &std::path::Path, device: &str) -> String {
    let Ok(target) = std::fs::canonicalize(device) else {
        return device.to_string();
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return device.to_string();
    };
    let mut names: Vec<std::path::PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| std::fs::canonicalize(p).is_ok_and(|t| t == target))
        .collect();
    // The same choice every time: the shortest name, then the first in order.
    names.sort_by_key(|p| (p.as_os_str().len(), p.clone()));
    names
        .first()
        .map_or_else(|| device.to_string(), |p| p.display().to_string())
}

/// `-b`: the cache's and its cores' devices by their /dev/disk/by-id names.
pub fn by_id_paths(c: &mut CacheInfo) {
    let dir = std::path::Path::new(BY_ID);
    c.device = by_id_path_in(dir, &c.device);
    for core in &mut c.cores {
        core.device = by_id_path_in(dir, &core.device);
    }
}

/// The protocol carries parameter values as text (each group formats its own units); JSON for
/// scripts gives every string that is a plain number as a number ("1024" -> 1024, "0.99" ->
/// 0.99), and leaves words ("Pinned", "alru") and names ("cas1-1", "unclassified") as strings.
fn numbers_as_numbers(v: &mut Value) {
    match v {
        Value::String(text) => {
            let plain = !text.is_empty()
                && text.chars().all(|c| c.is_ascii_digit() || c == '.')
                && text.chars().filter(|c| *c == '.').count() <= 1
                && !text.starts_with('.')
                && !text.ends_with('.');
            if plain {
                if let Ok(n) = text.parse::<u64>() {
                    *v = Value::from(n);
                } else if let Ok(f) = text.parse::<f64>() {
                    *v = Value::from(f);
                }
            }
        }
        Value::Array(items) => items.iter_mut().for_each(numbers_as_numbers),
        Value::Object(map) => {
            for (key, item) in map.iter_mut() {
                // Names are names even when they look like numbers.
                if key != "name" && key != "label" && key != "key" {
                    numbers_as_numbers(item);
                }
            }
        }
        _ => {}
    }
}

/// `-C -L`: the IO classes in force.
pub fn io_classes(l: &crate::protocol::IoClassList, format: OutputFormat) -> String {
    match format {
        OutputFormat::Json => {
            let mut v = serde_json::to_value(l).unwrap_or(Value::Null);
            numbers_as_numbers(&mut v);
            serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
        }
        OutputFormat::Csv => {
            let mut out = String::from("IO class id,IO class name,Eviction priority,Allocation\n");
            for c in &l.classes {
                let prio = if c.eviction_priority == "Pinned" {
                    ""
                } else {
                    c.eviction_priority.as_str()
                };
                let _ = writeln!(
                    out,
                    "{},{},{},{}",
                    c.id,
                    csv_cell(&c.name),
                    prio,
                    c.allocation
                );
            }
            out
        }
        OutputFormat::Table => {
            let heads = [
                "IO class id",
                "IO class name",
                "Eviction priority",
                "Allocation",
            ];
            let rows: Vec<[String; 4]> = l
                .classes
                .iter()
                .map(|c| {
                    [
                        c.id.to_string(),
                        c.name.clone(),
                        c.eviction_priority.clone(),
                        c.allocation.clone(),
                    ]
                })
                .collect();
            let w: Vec<usize> = (0..4)
                .map(|i| {
                    rows.iter()
                        .map(|r| r[i].len())
                        .chain([heads[i].len()])
                        .max()
                        .unwrap_or(0)
                })
                .collect();
            let bar = |l: &str, m: &str, r: &str| {
                let cells: Vec<String> = w.iter().map(|w| "═".repeat(w + 2)).collect();
                format!("{l}{}{r}\n", cells.join(m))
            };
            let line = |cells: [&str; 4]| {
                format!(
                    "║ {:<w0$} │ {:<w1$} │ {:<w2$} │ {:<w3$} ║\n",
                    cells[0],
                    cells[1],
                    cells[2],
                    cells[3],
                    w0 = w[0],
                    w1 = w[1],
                    w2 = w[2],
                    w3 = w[3]
                )
            };
            let mut out = bar("╔", "╤", "╗");
            out.push_str(&line(heads));
            out.push_str(&bar("╠", "╪", "╣"));
            for r in &rows {
                out.push_str(&line([&r[0], &r[1], &r[2], &r[3]]));
            }
            out.push_str(&bar("╚", "╧", "╝"));
            out
        }
    }
}

/// `get-param`: casadm's two-column table ("Parameter name", "Value") or its CSV in every case,
/// a one-field group included (casadm/cas_lib.c, `cache_params_get` and `core_params_get`, print
/// the header and a row per parameter whatever their number), or JSON. A per-core group shown
/// for every core gets a "Core" column first.
pub fn params(p: &crate::protocol::ParamValue, format: OutputFormat) -> String {
    let per_core = !p.cores.is_empty();
    let mut rows: Vec<Vec<String>> = Vec::new();
    for f in &p.fields {
        rows.push(vec![f.label.clone(), f.value.clone()]);
    }
    for c in &p.cores {
        for f in &c.fields {
            rows.push(vec![c.core.to_string(), f.label.clone(), f.value.clone()]);
        }
    }
    let heads: &[&str] = if per_core {
        &["Core", "Parameter name", "Value"]
    } else {
        &["Parameter name", "Value"]
    };
    match format {
        OutputFormat::Json => {
            let mut v = serde_json::to_value(p).unwrap_or(Value::Null);
            numbers_as_numbers(&mut v);
            serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
        }
        OutputFormat::Csv => csv_table(heads, &rows),
        OutputFormat::Table => box_table(heads, &rows),
    }
}

/// A header line and a line per row, cells quoted where they hold a comma, as casadm's raw CSV.
fn csv_table(heads: &[&str], rows: &[Vec<String>]) -> String {
    let mut out = heads.join(",");
    out.push('\n');
    for r in rows {
        let cells: Vec<String> = r.iter().map(|c| csv_cell(c)).collect();
        out.push_str(&cells.join(","));
        out.push('\n');
    }
    out
}

/// casadm's text table (casadm/statistics_view_text.c): a double-lined box, a header row, a
/// rule, the rows, each column as wide as its widest cell.
fn box_table(heads: &[&str], rows: &[Vec<String>]) -> String {
    let widths: Vec<usize> = (0..heads.len())
        .map(|i| {
            rows.iter()
                .filter_map(|r| r.get(i))
                .map(|c| c.chars().count())
                .chain([heads[i].chars().count()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let bar = |l: &str, m: &str, r: &str| {
        let cells: Vec<String> = widths.iter().map(|w| "═".repeat(w + 2)).collect();
        format!("{l}{}{r}\n", cells.join(m))
    };
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let cells: Vec<String> = cells
            .zip(&widths)
            .map(|(c, w)| format!(" {c}{} ", " ".repeat(w - c.chars().count())))
            .collect();
        format!("║{}║\n", cells.join("│"))
    };
    let mut out = bar("╔", "╤", "╗");
    out.push_str(&line(&mut heads.iter().copied()));
    out.push_str(&bar("╠", "╪", "╣"));
    for r in rows {
        out.push_str(&line(&mut r.iter().map(String::as_str)));
    }
    out.push_str(&bar("╚", "╧", "╝"));
    out
}

fn csv_cell(s: &str) -> String {
    if s.contains([',', '"', '\n']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

struct Row {
    key: &'static str,
    name: &'static str,
    count: u64,
    percent: Option<f64>,
    unit: &'static str,
}

struct Section {
    key: &'static str,
    title: &'static str,
    rows: Vec<Row>,
}

const BLOCKS: &str = "4KiB Blocks";
const REQUESTS: &str = "Requests";

fn pct(n: u64, of: u64) -> f64 {
    if of == 0 {
        0.0
    } else {
        n as f64 * 100.0 / of as f64
    }
}

fn sections(r: &StatsReport) -> Vec<Section> {
    let s = &r.stats;
    let b4 = |bytes: u64| bytes / 4096;
    let lines4 = |lines: u64| lines * (s.line_size as u64 / 4096);
    let row = |key, name, count, percent, unit| Row {
        key,
        name,
        count,
        percent: Some(percent),
        unit,
    };

    let total = s.total_lines;
    let clean = s.occupancy_lines.saturating_sub(s.dirty_lines);
    let mut usage = vec![row(
        "occupancy",
        "Occupancy",
        lines4(s.occupancy_lines),
        pct(s.occupancy_lines, total),
        BLOCKS,
    )];
    // casadm's IO class usage has no Free row: free lines belong to no class.
    if r.io_class.is_none() {
        usage.push(row(
            "free",
            "Free",
            lines4(s.free_lines),
            pct(s.free_lines, total),
            BLOCKS,
        ));
    }
    usage.extend([
        row("clean", "Clean", lines4(clean), pct(clean, total), BLOCKS),
        row(
            "dirty",
            "Dirty",
            lines4(s.dirty_lines),
            pct(s.dirty_lines, total),
            BLOCKS,
        ),
    ]);

    // casadm's "Inactive usage statistics" (ocf_cache.c): the inactive cores' lines as a
    // share of the cache, their clean and dirty lines as a share of every core's lines.
    let inactive = r.inactive.map(|i| {
        let clean = i.occupancy_lines.saturating_sub(i.dirty_lines);
        vec![
            row(
                "inactive_occupancy",
                "Inactive Occupancy",
                lines4(i.occupancy_lines),
                pct(i.occupancy_lines, total),
                BLOCKS,
            ),
            row(
                "inactive_clean",
                "Inactive Clean",
                lines4(clean),
                pct(clean, s.occupancy_lines),
                BLOCKS,
            ),
            row(
                "inactive_dirty",
                "Inactive Dirty",
                lines4(i.dirty_lines),
                pct(i.dirty_lines, s.occupancy_lines),
                BLOCKS,
            ),
        ]
    });

    // As Open CAS: a deferred hit is shown apart from the other hits (the engine counts it in
    // both), so that hits, deferred and misses add up to the total; requests are % of the
    // users' requests, the internal ones (read-ahead, cleaner) % of their own kind.
    let reads = s.read_hits + s.read_partial_misses + s.read_full_misses;
    let writes = s.write_hits + s.write_partial_misses + s.write_full_misses;
    let serviced = reads + writes;
    let user = serviced + s.pass_through_reads + s.pass_through_writes;
    let all = user + s.prefetch_requests + s.cleaner_requests;
    let req = |key, name, n| row(key, name, n, pct(n, user), REQUESTS);
    let own = |key, name, n| row(key, name, n, pct(n, n), REQUESTS);
    let requests = vec![
        req(
            "read_hits",
            "Read hits",
            s.read_hits.saturating_sub(s.read_deferred),
        ),
        req("read_deferred", "Read deferred", s.read_deferred),
        req(
            "read_partial_misses",
            "Read partial misses",
            s.read_partial_misses,
        ),
        req("read_full_misses", "Read full misses", s.read_full_misses),
        req("read_total", "Read total", reads),
        req(
            "write_hits",
            "Write hits",
            s.write_hits.saturating_sub(s.write_deferred),
        ),
        req("write_deferred", "Write deferred", s.write_deferred),
        req(
            "write_partial_misses",
            "Write partial misses",
            s.write_partial_misses,
        ),
        req(
            "write_full_misses",
            "Write full misses",
            s.write_full_misses,
        ),
        req("write_total", "Write total", writes),
        req(
            "pass_through_reads",
            "Pass-Through reads",
            s.pass_through_reads,
        ),
        req(
            "pass_through_writes",
            "Pass-Through writes",
            s.pass_through_writes,
        ),
        req("serviced_requests", "Serviced requests", serviced),
        own(
            "prefetch_readahead",
            "Prefetch: readahead",
            s.prefetch_requests,
        ),
        own("cleaner", "Cleaner", s.cleaner_requests),
        own("user_requests", "User requests", user),
        own("total_requests", "Total requests", all),
    ];

    // casadm names the core and exported-object rows "(s)" for a cache (and its IO classes),
    // without it for one core.
    let one = r.core.is_some();
    let pick = |core: &'static str, cache: &'static str| if one { core } else { cache };
    let trio = |rk, rn, r: u64, wk, wn, w: u64, tk, tn| {
        let (r, w) = (b4(r), b4(w));
        let t = r + w;
        [
            row(rk, rn, r, pct(r, t), BLOCKS),
            row(wk, wn, w, pct(w, t), BLOCKS),
            row(tk, tn, t, pct(t, t), BLOCKS),
        ]
    };
    let mut blocks = Vec::new();
    blocks.extend(trio(
        "core_reads",
        pick("Reads from core", "Reads from core(s)"),
        s.core_read_bytes,
        "core_writes",
        pick("Writes to core", "Writes to core(s)"),
        s.core_written_bytes,
        "core_total",
        pick("Total to/from core", "Total to/from core(s)"),
    ));
    blocks.extend(trio(
        "cache_reads",
        "Reads from cache",
        s.cache_read_bytes,
        "cache_writes",
        "Writes to cache",
        s.cache_written_bytes,
        "cache_total",
        "Total to/from cache",
    ));
    blocks.extend(trio(
        "exported_reads",
        pick(
            "Reads from exported object",
            "Reads from exported object(s)",
        ),
        s.exported_read_bytes,
        "exported_writes",
        pick("Writes to exported object", "Writes to exported object(s)"),
        s.exported_written_bytes,
        "exported_total",
        pick(
            "Total to/from exported object",
            "Total to/from exported object(s)",
        ),
    ));
    // Read-ahead's and the cleaner's blocks are part of the core and cache rows above; each is
    // shown as a share of the device total it is part of.
    let core_total = b4(s.core_read_bytes) + b4(s.core_written_bytes);
    let cache_total = b4(s.cache_read_bytes) + b4(s.cache_written_bytes);
    let part =
        |key, name, bytes: u64, of: u64| row(key, name, b4(bytes), pct(b4(bytes), of), BLOCKS);
    blocks.extend([
        part(
            "prefetch_core_reads_readahead",
            "Prefetch core reads: readahead",
            s.prefetch_read_bytes,
            core_total,
        ),
        part(
            "prefetch_cache_writes_readahead",
            "Prefetch cache writes: readahead",
            s.prefetch_written_bytes,
            cache_total,
        ),
        part(
            "cleaner_cache_reads",
            "Cleaner cache reads",
            s.cleaner_cache_read_bytes,
            cache_total,
        ),
        part(
            "cleaner_core_writes",
            "Cleaner core writes",
            s.cleaner_core_written_bytes,
            core_total,
        ),
    ]);
    if let Some(cl) = r.cleaning {
        blocks.push(Row {
            key: "cleaned_lines",
            name: "Cleaned lines",
            count: cl.cleaned_lines,
            percent: None,
            unit: "Cache lines",
        });
    }

    let cache_err = s.cache_read_errors + s.cache_write_errors;
    let core_err = s.core_read_errors + s.core_write_errors;
    let all_err = cache_err + core_err;
    let err = |key, name, n| row(key, name, n, pct(n, all_err), REQUESTS);
    let errors = vec![
        err(
            "cache_read_errors",
            "Cache read errors",
            s.cache_read_errors,
        ),
        err(
            "cache_write_errors",
            "Cache write errors",
            s.cache_write_errors,
        ),
        err("cache_total_errors", "Cache total errors", cache_err),
        err("core_read_errors", "Core read errors", s.core_read_errors),
        err(
            "core_write_errors",
            "Core write errors",
            s.core_write_errors,
        ),
        err("core_total_errors", "Core total errors", core_err),
        err("total_errors", "Total errors", all_err),
    ];

    // Lazy flush's writes are also counted as write hits or misses above: their own section,
    // each as a share of what it is part of (read-ahead's requests and blocks are casadm's rows
    // above; its hits are ours).
    let (lazy_b, pre_b) = (b4(s.lazy_flush_bytes), b4(s.prefetch_read_bytes));
    // Hits are lines, prefetch's reads 4 KiB blocks: the share compares blocks.
    let line4 = (s.line_size as u64 / 4096).max(1);
    let policies = vec![
        row(
            "lazy_flush_writes",
            "Writes sent to core by lazy flush",
            s.lazy_flush_writes,
            pct(s.lazy_flush_writes, writes),
            REQUESTS,
        ),
        row(
            "lazy_flush_blocks",
            "Blocks written to core by lazy flush",
            lazy_b,
            pct(lazy_b, b4(s.core_written_bytes)),
            BLOCKS,
        ),
        row(
            "offload_reads",
            "Read hits sent to core by offload",
            s.offload_reads,
            pct(s.offload_reads, reads + s.pass_through_reads),
            REQUESTS,
        ),
        row(
            "offload_writes",
            "Write misses sent to core by offload",
            s.offload_writes,
            pct(s.offload_writes, writes + s.pass_through_writes),
            REQUESTS,
        ),
        // A pipelining client's write hits sharing one cache-device submission: how much of
        // the write-hit load the batched path carries (docs/performance.md §11).
        row(
            "write_hits_batched",
            "Write hits written to cache in batches",
            s.write_hits_batched,
            pct(s.write_hits_batched, writes),
            REQUESTS,
        ),
        row(
            "prefetch_hits",
            "Prefetched lines hit",
            s.prefetch_hits,
            pct(s.prefetch_hits * line4, pre_b),
            "Cache lines",
        ),
    ];

    // casadm's sections in casadm's order, then ours. casadm shows no errors for an IO class:
    // device errors belong to a device, not to a class (ours are not counted per class either).
    let mut out = vec![Section {
        key: "usage",
        title: "Usage statistics",
        rows: usage,
    }];
    if let Some(rows) = inactive {
        out.push(Section {
            key: "inactive_usage",
            title: "Inactive usage statistics",
            rows,
        });
    }
    out.extend([
        Section {
            key: "requests",
            title: "Request statistics",
            rows: requests,
        },
        Section {
            key: "blocks",
            title: "Block statistics",
            rows: blocks,
        },
    ]);
    if r.io_class.is_none() {
        out.push(Section {
            key: "errors",
            title: "Error statistics",
            rows: errors,
        });
    }
    out.push(Section {
        key: "policies",
        title: "Lazy flush and prefetch statistics",
        rows: policies,
    });
    out
}

/// Info keys whose values are text even when they look like numbers: names, paths and modes.
/// JSON gives every other info value that is a number as a number.
const INFO_TEXT: &[&str] = &[
    "core_device",
    "exported_object",
    "status",
    "io_class_name",
    "cache_device",
    "write_policy",
    "cleaning_policy",
    "promotion_policy",
    "lazy_flush",
    "prefetch_policy",
    "dirty_for",
    "seq_cutoff_policy",
];

/// The key/value lines casadm prints above the tables, in casadm's names and order
/// (statistics_model.c: cache_stats_conf, print_core_conf, print_stats_ioclass_conf); our own
/// fields follow casadm's.
fn info(r: &StatsReport) -> Vec<(&'static str, &'static str, String)> {
    let c = &r.cache;
    let line_kib = c.line_size_kib as u64;
    let cache_blocks = c.lines * line_kib / 4;
    let gib = |bytes: u64| format!("{:.2}", bytes as f64 / (1u64 << 30) as f64);
    let dirty_for = |v: &mut Vec<(&'static str, &'static str, String)>, d: Option<u64>| {
        v.push((
            "dirty_for_s",
            "Dirty for [s]",
            d.map_or("0".into(), |d| d.to_string()),
        ));
        v.push(("dirty_for", "Dirty for", dirty_for_text(d.unwrap_or(0))));
    };
    let mut v = vec![];
    if let Some(k) = &r.io_class {
        v.push(("io_class_id", "IO class ID", k.id.to_string()));
        v.push(("io_class_name", "IO class name", k.name.clone()));
        v.push((
            "eviction_priority",
            "Eviction priority",
            k.eviction_priority.clone(),
        ));
        // casadm: the class's allocation as a whole percentage ("Max size", "50%").
        let percent = k
            .allocation
            .parse::<f64>()
            .map_or_else(|_| k.allocation.clone(), |a| format!("{:.0}%", a * 100.0));
        v.push(("max_size", "Max size", percent));
        v.push(("cache_id", "Cache Id", c.id.to_string()));
        // One core's share of the class (`-j CORE -d`): which core, after casadm's rows.
        if let Some(core) = &r.core {
            v.push(("core_id", "Core Id", core.id.to_string()));
        }
    } else if let Some(core) = &r.core {
        v.push(("core_id", "Core Id", core.id.to_string()));
        v.push(("core_device", "Core Device", core.device.clone()));
        v.push((
            "exported_object",
            "Exported Object",
            core.block_device
                .clone()
                .unwrap_or_else(|| core.export.clone()),
        ));
        v.push((
            "core_size_blocks",
            "Core Size [4KiB Blocks]",
            (core.size / 4096).to_string(),
        ));
        v.push(("core_size_gib", "Core Size [GiB]", gib(core.size)));
        dirty_for(&mut v, core.dirty_for_s);
        v.push(("status", "Status", core.status.clone()));
        v.push((
            "seq_cutoff_threshold_kib",
            "Seq cutoff threshold [KiB]",
            core.seq_cutoff_threshold_kib
                .map_or("-".into(), |t| t.to_string()),
        ));
        v.push((
            "seq_cutoff_policy",
            "Seq cutoff policy",
            core.seq_cutoff_policy.clone().unwrap_or_else(|| "-".into()),
        ));
        v.push(("clients", "NBD connections", core.clients.to_string()));
        v.push(("cache_id", "Cache Id", c.id.to_string()));
    } else {
        v.push(("cache_id", "Cache Id", c.id.to_string()));
        v.push((
            "cache_size_blocks",
            "Cache Size [4KiB Blocks]",
            cache_blocks.to_string(),
        ));
        v.push((
            "cache_size_gib",
            "Cache Size [GiB]",
            gib(c.lines * line_kib * 1024),
        ));
        v.push(("cache_device", "Cache Device", c.device.clone()));
        if let Some(m) = &c.mirror {
            v.push(("mirror_device", "Mirror Device", m.device.clone()));
            v.push(("mirror_state", "Mirror State", mirror_state(m)));
            v.push(("mirror_size_bytes", "Mirror Size [B]", m.bytes.to_string()));
            v.push(("mirror_dirty", "Mirror Dirty", mirror_fill(m)));
            v.push(("mirror_lost", "On Mirror Lost", m.mirror_lost.clone()));
            if let Some(why) = &m.reason {
                v.push(("mirror_failure", "Mirror Failure", why.clone()));
            }
        }
        if let Some(f) = &c.fallback {
            v.push((
                "fallback_pt",
                "Fallback Pass-Through",
                if f.active { "Yes" } else { "No" }.into(),
            ));
            v.push((
                "cache_device_errors",
                "Cache Device Errors",
                format!(
                    "{} of threshold {} in {} s",
                    f.errors, f.threshold, f.window_s
                ),
            ));
            v.push((
                "unreadable_dirty_lines",
                "Unreadable Dirty Lines",
                f.unreadable_dirty_lines.to_string(),
            ));
            v.push((
                "unreadable_dirty_bytes",
                "Unreadable Dirty Data [B]",
                f.unreadable_dirty_bytes.to_string(),
            ));
        }
        // casadm shows a cache's own exported object only in standby, which we do not have.
        v.push(("exported_object", "Exported Object", "-".into()));
        v.push(("core_devices", "Core Devices", c.cores.len().to_string()));
        v.push((
            "inactive_core_devices",
            "Inactive Core Devices",
            c.inactive_cores.to_string(),
        ));
        v.push(("write_policy", "Write Policy", c.mode.clone()));
        v.push(("cleaning_policy", "Cleaning Policy", c.cleaning.clone()));
        v.push(("promotion_policy", "Promotion Policy", c.promotion.clone()));
        v.push(("prefetch_policy", "Prefetch Policy", c.prefetch.clone()));
        v.push((
            "cache_line_size_kib",
            "Cache line size [KiB]",
            line_kib.to_string(),
        ));
        v.push((
            "metadata_memory_footprint_mib",
            "Metadata Memory Footprint [MiB]",
            format!("{:.1}", c.metadata_bytes as f64 / (1u64 << 20) as f64),
        ));
        dirty_for(&mut v, c.dirty_for_s);
        v.push(("status", "Status", c.status.clone()));
        v.push(("lazy_flush", "Lazy Flush", c.lazy_flush.clone()));
        let clients: usize = c.cores.iter().map(|k| k.clients).sum();
        v.push(("clients", "NBD connections", clients.to_string()));
    }
    v
}

/// casadm's "Dirty for": "1 [h] 5 [m] 3 [s]", with days, or "Cache clean".
fn dirty_for_text(secs: u64) -> String {
    if secs == 0 {
        return "Cache clean".into();
    }
    let (d, h, m, s) = (
        secs / 86_400,
        secs % 86_400 / 3600,
        secs % 3600 / 60,
        secs % 60,
    );
    let mut parts = Vec::new();
    for (n, unit) in [(d, "d"), (h, "h"), (m, "m"), (s, "s")] {
        if n > 0 {
            parts.push(format!("{n} [{unit}]"));
        }
    }
    parts.join(" ")
}

/// `-P -f`: casadm's statistics sections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum StatsFilter {
    /// Every section (ours too: lazy flush and prefetch, latency).
    All,
    /// The configuration lines (Cache Id, Cache Size, ...).
    Conf,
    /// Usage statistics.
    Usage,
    /// Request statistics.
    Req,
    /// Block statistics.
    Blk,
    /// Error statistics.
    Err,
}

/// Whether `-f filter` shows the section `key` ("conf", "usage", "requests", "blocks",
/// "errors", or one of ours, shown only with `all` or no filter).
fn shown(filter: &[StatsFilter], key: &str) -> bool {
    if filter.is_empty() || filter.contains(&StatsFilter::All) {
        return true;
    }
    let want = match key {
        "conf" => StatsFilter::Conf,
        // casadm prints the inactive usage with -f usage.
        "usage" | "inactive_usage" => StatsFilter::Usage,
        "requests" => StatsFilter::Req,
        "blocks" => StatsFilter::Blk,
        "errors" => StatsFilter::Err,
        _ => return false,
    };
    filter.contains(&want)
}

/// casadm's `-V` row for what does the caching (its kernel module; here the daemon) when there
/// is none to ask, as casadm/cas_main.c `handle_version` says it.
pub const NOT_LOADED: &str = "Not Loaded";

/// `-V`: casadm's `Name,Version` table (casadm/cas_main.c, `handle_version`): first what does
/// the caching (casadm: the kernel module; here the daemon, "Not Loaded" when none answers), then
/// the command-line utility. Text and CSV carry the same rows; JSON gives `null` for no daemon.
pub fn version(cli: &str, daemon: Option<&str>, format: OutputFormat) -> String {
    let rows = vec![
        vec![
            "hybridcache Cache Daemon".to_string(),
            daemon.unwrap_or(NOT_LOADED).to_string(),
        ],
        vec!["hybridcache CLI Utility".to_string(), cli.to_string()],
    ];
    match format {
        OutputFormat::Table => box_table(&["Name", "Version"], &rows),
        OutputFormat::Csv => csv_table(&["Name", "Version"], &rows),
        OutputFormat::Json => {
            let v = json!({ "cli": cli, "daemon": daemon });
            serde_json::to_string_pretty(&v).unwrap_or_default() + "\n"
        }
    }
}

/// `-P` of several reports (`-d` without a value: every IO class): tables one after the other,
/// CSV one header and a value line per report, JSON an array (one report: the object alone).
pub fn stats_many(reports: &[StatsReport], filter: &[StatsFilter], format: OutputFormat) -> String {
    let each: Vec<String> = reports
        .iter()
        .map(|r| stats_with(r, filter, format))
        .collect();
    if each.len() == 1 {
        return each.into_iter().next().unwrap_or_default();
    }
    match format {
        OutputFormat::Table => each.join("\n"),
        OutputFormat::Csv => {
            let mut out = String::new();
            for (i, csv) in each.iter().enumerate() {
                let mut lines = csv.lines();
                let head = lines.next().unwrap_or_default();
                if i == 0 {
                    out.push_str(head);
                    out.push('\n');
                }
                for l in lines {
                    out.push_str(l);
                    out.push('\n');
                }
            }
            out
        }
        OutputFormat::Json => {
            let items: Vec<Value> = each
                .iter()
                .filter_map(|j| serde_json::from_str(j).ok())
                .collect();
            serde_json::to_string_pretty(&Value::Array(items)).unwrap_or_default() + "\n"
        }
    }
}

/// `stats` in the chosen format, every section.
#[cfg(test)]
pub fn stats(r: &StatsReport, format: OutputFormat) -> String {
    stats_with(r, &[], format)
}

/// `stats` in the chosen format, the sections of `-f filter` only.
pub fn stats_with(r: &StatsReport, filter: &[StatsFilter], format: OutputFormat) -> String {
    let info = if shown(filter, "conf") {
        info(r)
    } else {
        Vec::new()
    };
    let secs: Vec<Section> = sections(r)
        .into_iter()
        .filter(|s| shown(filter, s.key))
        .collect();
    let latency: &[crate::protocol::LatencyRow] = if shown(filter, "latency") {
        &r.latency
    } else {
        &[]
    };
    match format {
        OutputFormat::Table => {
            let mut out = String::new();
            let kw = info.iter().map(|(_, k, _)| k.len()).max().unwrap_or(0);
            for (_, k, v) in &info {
                let _ = writeln!(out, "{k:<kw$}  {v}");
            }
            for s in &secs {
                out.push('\n');
                table(&mut out, s);
            }
            if !latency.is_empty() {
                out.push('\n');
                latency_table(&mut out, latency);
            }
            out
        }
        OutputFormat::Csv => {
            let mut names = Vec::new();
            let mut values = Vec::new();
            for (_, k, v) in &info {
                names.push(csv_cell(k));
                values.push(csv_cell(v));
            }
            for s in &secs {
                for row in &s.rows {
                    names.push(csv_cell(&format!("{} [{}]", row.name, row.unit)));
                    values.push(row.count.to_string());
                    if let Some(p) = row.percent {
                        names.push(csv_cell(&format!("{} [%]", row.name)));
                        values.push(format!("{p:.1}"));
                    }
                }
            }
            for l in latency {
                names.push(csv_cell(&format!("{} [count]", l.name)));
                values.push(l.count.to_string());
                for (label, v) in latency_cells(l) {
                    names.push(csv_cell(&format!("{} {label} [us]", l.name)));
                    values.push(v.map(|v| format!("{v:.1}")).unwrap_or_default());
                }
            }
            format!("{}\n{}\n", names.join(","), values.join(","))
        }
        OutputFormat::Json => {
            let mut top = Map::new();
            let mut inf = Map::new();
            for (key, _, v) in &info {
                // "Max size" is a percentage: JSON gives the number (50 for "50%").
                let v = if *key == "max_size" {
                    v.trim_end_matches('%')
                } else {
                    v.as_str()
                };
                let mut val = Value::from(v);
                if !INFO_TEXT.contains(key) {
                    numbers_as_numbers(&mut val);
                }
                inf.insert((*key).into(), val);
            }
            top.insert("info".into(), Value::Object(inf));
            for s in &secs {
                let mut m = Map::new();
                for row in &s.rows {
                    m.insert(
                        row.key.into(),
                        json!({
                            "count": row.count,
                            "percent": row.percent.map(|p| (p * 10.0).round() / 10.0),
                            "unit": row.unit,
                        }),
                    );
                }
                top.insert(s.key.into(), Value::Object(m));
            }
            if !latency.is_empty() {
                let mut m = Map::new();
                for l in latency {
                    let mut row = Map::new();
                    row.insert("count".into(), Value::from(l.count));
                    for (label, v) in latency_cells(l) {
                        let key = format!("{}_us", label.replace('.', ""));
                        row.insert(key, v.map(Value::from).unwrap_or(Value::Null));
                    }
                    m.insert(l.key.clone(), Value::Object(row));
                }
                top.insert("latency".into(), Value::Object(m));
            }
            top.insert(
                "raw".into(),
                serde_json::to_value(r.stats).unwrap_or(Value::Null),
            );
            if let Some(c) = &r.cleaning {
                top.insert(
                    "cleaning".into(),
                    serde_json::to_value(c).unwrap_or(Value::Null),
                );
            }
            serde_json::to_string_pretty(&Value::Object(top)).unwrap_or_default() + "\n"
        }
    }
}

/// A latency row's figures in column order: mean and the percentiles, in microseconds.
fn latency_cells(l: &crate::protocol::LatencyRow) -> [(&'static str, Option<f64>); 5] {
    [
        ("mean", l.mean_us),
        ("p50", l.p50_us),
        ("p99", l.p99_us),
        ("p99.9", l.p999_us),
        ("p99.99", l.p9999_us),
    ]
}

/// Request latency percentiles as a box table like casadm's, in microseconds.
fn latency_table(out: &mut String, rows: &[crate::protocol::LatencyRow]) {
    let title = "Latency [us]";
    let mut cells: Vec<Vec<String>> = Vec::new();
    for l in rows {
        let mut c = vec![l.name.clone(), l.count.to_string()];
        c.extend(
            latency_cells(l)
                .iter()
                .map(|(_, v)| v.map(|v| format!("{v:.1}")).unwrap_or_else(|| "-".into())),
        );
        cells.push(c);
    }
    let head: Vec<String> = [title, "Count", "Mean", "p50", "p99", "p99.9", "p99.99"]
        .iter()
        .map(|h| h.to_string())
        .collect();
    let widths: Vec<usize> = (0..head.len())
        .map(|i| {
            cells
                .iter()
                .map(|c| c[i].chars().count())
                .chain([head[i].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let bar = |l: &str, m: &str, r: &str| {
        let parts: Vec<String> = widths.iter().map(|w| "═".repeat(w + 2)).collect();
        format!("{l}{}{r}\n", parts.join(m))
    };
    let line = |c: &[String]| {
        let parts: Vec<String> = c
            .iter()
            .enumerate()
            .map(|(i, v)| {
                if i == 0 {
                    format!(" {v:<w$} ", w = widths[i])
                } else {
                    format!(" {v:>w$} ", w = widths[i])
                }
            })
            .collect();
        format!("║{}║\n", parts.join("│"))
    };
    out.push_str(&bar("╔", "╤", "╗"));
    out.push_str(&line(&head));
    out.push_str(&bar("╠", "╪", "╣"));
    for c in &cells {
        out.push_str(&line(c));
    }
    out.push_str(&bar("╚", "╧", "╝"));
}

/// Rows that begin a group, after a thin line, as casadm's tables have them (its
/// `print_val_perc_table_section` rows), and the first of our own rows after casadm's.
const GROUP_STARTS: &[&str] = &[
    "write_hits",
    "pass_through_reads",
    "prefetch_readahead",
    "user_requests",
    "cache_reads",
    "exported_reads",
    "prefetch_core_reads_readahead",
    "cleaned_lines",
    "core_read_errors",
    "total_errors",
];

/// One casadm-style box table.
fn table(out: &mut String, s: &Section) {
    let w0 = s
        .rows
        .iter()
        .map(|r| r.name.len())
        .chain([s.title.len()])
        .max()
        .unwrap_or(0);
    let counts: Vec<String> = s.rows.iter().map(|r| r.count.to_string()).collect();
    let w1 = counts.iter().map(String::len).chain([5]).max().unwrap_or(5);
    let w2 = 5;
    // casadm brackets the units: "[Units]", "[Requests]".
    let units: Vec<String> = s.rows.iter().map(|r| format!("[{}]", r.unit)).collect();
    let w3 = units.iter().map(String::len).chain([7]).max().unwrap_or(7);
    let line = |l: &str, h: &str, m: &str, r: &str| {
        format!(
            "{l}{}{m}{}{m}{}{m}{}{r}\n",
            h.repeat(w0 + 2),
            h.repeat(w1 + 2),
            h.repeat(w2 + 2),
            h.repeat(w3 + 2)
        )
    };
    let bar = |l: &str, m: &str, r: &str| line(l, "═", m, r);
    out.push_str(&bar("╔", "╤", "╗"));
    let _ = writeln!(
        out,
        "║ {:<w0$} │ {:>w1$} │ {:>w2$} │ {:<w3$} ║",
        s.title, "Count", "%", "[Units]"
    );
    out.push_str(&bar("╠", "╪", "╣"));
    for (i, ((r, c), u)) in s.rows.iter().zip(&counts).zip(&units).enumerate() {
        if i > 0 && GROUP_STARTS.contains(&r.key) {
            out.push_str(&line("╟", "─", "┼", "╢"));
        }
        let p = r.percent.map(|p| format!("{p:.1}")).unwrap_or_default();
        let _ = writeln!(
            out,
            "║ {:<w0$} │ {:>w1$} │ {:>w2$} │ {:<w3$} ║",
            r.name, c, p, u
        );
    }
    out.push_str(&bar("╚", "╧", "╝"));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::{CoreInfo, StatsData};

    #[test]
    fn a_rebuild_shows_which_device_it_fills_and_how_far_it_is() {
        let mut m = crate::protocol::MirrorInfo {
            device: "/dev/nvme1n1".into(),
            state: "rebuilding primary".into(),
            mirror_lost: "drain".into(),
            reason: None,
            rebuild: Some((1024, 4096)),
            lines: 4096,
            dirty_lines: 12,
            bytes: 1 << 30,
        };
        assert_eq!(
            mirror_state(&m),
            "Rebuilding primary (1,024/4,096 dirty lines)"
        );
        m.state = "rebuilding".into();
        assert_eq!(mirror_state(&m), "Rebuilding (1,024/4,096 dirty lines)");
        m.state = "redundant".into();
        m.rebuild = None;
        assert_eq!(mirror_state(&m), "Redundant");
    }

    fn report() -> StatsReport {
        StatsReport {
            cache: CacheInfo {
                id: 1,
                device: "ram:16M".into(),
                status: "Running".into(),
                mode: "wb".into(),
                line_size_kib: 4,
                lines: 4096,
                cleaning: "alru".into(),
                promotion: "always".into(),
                lazy_flush: "off".into(),
                prefetch: "none".into(),
                cores: vec![CoreInfo {
                    id: 1,
                    device: "/x".into(),
                    size: 1 << 30,
                    status: "Active".into(),
                    export: "cas1-1".into(),
                    clients: 2,
                    frontend: "nbd".into(),
                    block_device: None,
                    dirty_for_s: Some(3723),
                    seq_cutoff_threshold_kib: Some(1024),
                    seq_cutoff_policy: Some("full".into()),
                }],
                flush: None,
                dirty_for_s: Some(3723),
                inactive_cores: 0,
                metadata_bytes: 3 << 20,
                mirror: None,
                fallback: None,
            },
            core: None,
            io_class: None,
            inactive: None,
            stats: StatsData {
                line_size: 4096,
                total_lines: 4096,
                occupancy_lines: 1024,
                free_lines: 3072,
                dirty_lines: 512,
                read_hits: 3,
                read_full_misses: 1,
                core_read_bytes: 8192,
                core_written_bytes: 20480,
                cache_read_bytes: 20480,
                cleaner_requests: 2,
                cleaner_cache_read_bytes: 20480,
                cleaner_core_written_bytes: 20480,
                ..StatsData::default()
            },
            latency: vec![
                crate::protocol::LatencyRow {
                    name: "Reads".into(),
                    key: "read".into(),
                    count: 4,
                    mean_us: Some(30.5),
                    p50_us: Some(20.0),
                    p99_us: Some(95.0),
                    p999_us: Some(95.0),
                    p9999_us: Some(95.0),
                },
                crate::protocol::LatencyRow {
                    name: "Writes".into(),
                    key: "write".into(),
                    count: 0,
                    mean_us: None,
                    p50_us: None,
                    p99_us: None,
                    p999_us: None,
                    p9999_us: None,
                },
            ],
            cleaning: Some(crate::protocol::CleaningData {
                cleaned_lines: 5,
                core_writes: 2,
                core_write_bytes: 20480,
            }),
        }
    }

    #[test]
    fn a_ublk_core_shows_its_block_device_in_every_format() {
        let mut cache = report().cache;
        cache.cores.push(CoreInfo {
            id: 2,
            device: "/core2".into(),
            size: 1 << 30,
            status: "Active".into(),
            export: "cas1-2".into(),
            clients: 1,
            frontend: "ublk".into(),
            block_device: Some("/dev/ublkb3".into()),
            dirty_for_s: None,
            seq_cutoff_threshold_kib: None,
            seq_cutoff_policy: None,
        });
        let caches = [cache];
        let table = list(&caches, OutputFormat::Table);
        let row = table.lines().find(|l| l.contains("/core2")).unwrap();
        assert!(
            row.contains("/dev/ublkb3") && !row.contains("cas1-2"),
            "{table}"
        );
        let nbd_row = table.lines().find(|l| l.contains("/x")).unwrap();
        assert!(nbd_row.contains("cas1-1"), "{table}");
        let csv = list(&caches, OutputFormat::Csv);
        assert!(
            csv.contains("core,2,/core2,Active,-,/dev/ublkb3,1"),
            "{csv}"
        );
        let json: Value = serde_json::from_str(&list(&caches, OutputFormat::Json)).unwrap();
        let core = &json["caches"][0]["cores"][1];
        assert_eq!(core["block_device"], "/dev/ublkb3");
        assert_eq!(core["frontend"], "ublk");
    }

    /// casadm's `-P -o csv` configuration columns, in order (open-cas-linux
    /// casadm/statistics_model.c, cache_stats_conf, print_core_conf and
    /// print_stats_ioclass_conf, as statistics_view_csv.c names them).
    const CASADM_CACHE_CONF: &[&str] = &[
        "Cache Id",
        "Cache Size [4KiB Blocks]",
        "Cache Size [GiB]",
        "Cache Device",
        "Exported Object",
        "Core Devices",
        "Inactive Core Devices",
        "Write Policy",
        "Cleaning Policy",
        "Promotion Policy",
        "Prefetch Policy",
        "Cache line size [KiB]",
        "Metadata Memory Footprint [MiB]",
        "Dirty for [s]",
        "Dirty for",
        "Status",
    ];
    const CASADM_CORE_CONF: &[&str] = &[
        "Core Id",
        "Core Device",
        "Exported Object",
        "Core Size [4KiB Blocks]",
        "Core Size [GiB]",
        "Dirty for [s]",
        "Dirty for",
        "Status",
        "Seq cutoff threshold [KiB]",
        "Seq cutoff policy",
    ];
    const CASADM_IO_CLASS_CONF: &[&str] = &[
        "IO class ID",
        "IO class name",
        "Eviction priority",
        "Max size",
    ];
    /// casadm's statistics tables and their rows, in order (open-cas-linux
    /// casadm/statistics_model.c: print_usage_stats, print_ioclass_usage_stats, print_req_stats,
    /// print_blk_stats, print_err_stats; cache_stats_counters, cache_stats_core_counters and
    /// print_stats_ioclass choose the tables), with their units as the CSV names them.
    const CASADM_USAGE: (&str, &str, &[&str]) = (
        "Usage statistics",
        "4KiB Blocks",
        &["Occupancy", "Free", "Clean", "Dirty"],
    );
    const CASADM_IO_CLASS_USAGE: (&str, &str, &[&str]) = (
        "Usage statistics",
        "4KiB Blocks",
        &["Occupancy", "Clean", "Dirty"],
    );
    const CASADM_REQUESTS: (&str, &str, &[&str]) = (
        "Request statistics",
        "Requests",
        &[
            "Read hits",
            "Read deferred",
            "Read partial misses",
            "Read full misses",
            "Read total",
            "Write hits",
            "Write deferred",
            "Write partial misses",
            "Write full misses",
            "Write total",
            "Pass-Through reads",
            "Pass-Through writes",
            "Serviced requests",
            "Prefetch: readahead",
            "Cleaner",
            "User requests",
            "Total requests",
        ],
    );
    /// A cache's (and a cache's IO class's): "(s)" after core and exported object.
    const CASADM_CACHE_BLOCKS: (&str, &str, &[&str]) = (
        "Block statistics",
        "4KiB Blocks",
        &[
            "Reads from core(s)",
            "Writes to core(s)",
            "Total to/from core(s)",
            "Reads from cache",
            "Writes to cache",
            "Total to/from cache",
            "Reads from exported object(s)",
            "Writes to exported object(s)",
            "Total to/from exported object(s)",
            "Prefetch core reads: readahead",
            "Prefetch cache writes: readahead",
            "Cleaner cache reads",
            "Cleaner core writes",
        ],
    );
    const CASADM_CORE_BLOCKS: (&str, &str, &[&str]) = (
        "Block statistics",
        "4KiB Blocks",
        &[
            "Reads from core",
            "Writes to core",
            "Total to/from core",
            "Reads from cache",
            "Writes to cache",
            "Total to/from cache",
            "Reads from exported object",
            "Writes to exported object",
            "Total to/from exported object",
            "Prefetch core reads: readahead",
            "Prefetch cache writes: readahead",
            "Cleaner cache reads",
            "Cleaner core writes",
        ],
    );
    const CASADM_ERRORS: (&str, &str, &[&str]) = (
        "Error statistics",
        "Requests",
        &[
            "Cache read errors",
            "Cache write errors",
            "Cache total errors",
            "Core read errors",
            "Core write errors",
            "Core total errors",
            "Total errors",
        ],
    );

    /// A table's rows: name and unit cells.
    type Rows = Vec<(String, String)>;

    /// Each box table of a table output: its title and its rows' names and units, in order.
    fn table_rows(t: &str) -> Vec<((String, String), Rows)> {
        let mut out: Vec<((String, String), Rows)> = Vec::new();
        let mut head = false;
        for l in t.lines() {
            let cells: Vec<String> = l
                .trim_matches(['║', ' '])
                .split('│')
                .map(|c| c.trim().to_string())
                .collect();
            let name_unit = || (cells[0].clone(), cells[cells.len() - 1].clone());
            if l.starts_with('╔') {
                head = true;
            } else if l.starts_with('║') && head {
                out.push((name_unit(), Vec::new()));
                head = false;
            } else if l.starts_with('║') {
                if let Some(last) = out.last_mut() {
                    last.1.push(name_unit());
                }
            }
        }
        out
    }

    /// casadm's tables come first, in casadm's order, each with casadm's rows first in
    /// casadm's order (ours may follow), in the table and in the CSV header.
    fn assert_casadm_rows(r: &StatsReport, want: &[(&str, &str, &[&str])]) {
        let t = stats(r, OutputFormat::Table);
        let got = table_rows(&t);
        for (i, (title, unit, rows)) in want.iter().enumerate() {
            assert_eq!(
                got[i].0,
                (title.to_string(), "[Units]".into()),
                "table {i}: {t}"
            );
            assert!(got[i].1.len() >= rows.len(), "{title}: {t}");
            for (j, name) in rows.iter().enumerate() {
                let want = (name.to_string(), format!("[{unit}]"));
                assert_eq!(got[i].1[j], want, "{title}, row {j}: {t}");
            }
        }
        let csv = stats(r, OutputFormat::Csv);
        let head = csv_header(&csv);
        let mut at = 0;
        for (title, unit, rows) in want {
            let first = format!("{} [{unit}]", rows[0]);
            let start = head[at..]
                .iter()
                .position(|h| *h == first)
                .unwrap_or_else(|| panic!("{title}: no {first} after column {at}: {head:?}"))
                + at;
            for (j, name) in rows.iter().enumerate() {
                assert_eq!(head[start + 2 * j], format!("{name} [{unit}]"), "{head:?}");
                assert_eq!(head[start + 2 * j + 1], format!("{name} [%]"), "{head:?}");
            }
            at = start + 2 * rows.len();
        }
    }

    const CASADM_INACTIVE_USAGE: (&str, &str, &[&str]) = (
        "Inactive usage statistics",
        "4KiB Blocks",
        &["Inactive Occupancy", "Inactive Clean", "Inactive Dirty"],
    );

    /// `-P -j CORE -d CLASS`: the class' rows with casadm's core names for the blocks
    /// (statistics_model.c, print_stats_ioclass with cache_stats false), the class' info and
    /// which core.
    #[test]
    fn a_cores_class_statistics_are_casadms_class_rows() {
        let cache = report();
        let r = StatsReport {
            core: Some(cache.cache.cores[0].clone()),
            io_class: Some(crate::protocol::IoClassInfo {
                id: 1,
                name: "metadata".into(),
                eviction_priority: "100".into(),
                allocation: "0.50".into(),
            }),
            latency: Vec::new(),
            cleaning: None,
            ..report()
        };
        assert_casadm_rows(
            &r,
            &[CASADM_IO_CLASS_USAGE, CASADM_REQUESTS, CASADM_CORE_BLOCKS],
        );
        let t = stats(&r, OutputFormat::Table);
        assert!(!t.contains("Error statistics"), "{t}");
        let csv = stats(&r, OutputFormat::Csv);
        let head = csv_header(&csv);
        for (i, want) in CASADM_IO_CLASS_CONF.iter().enumerate() {
            assert_eq!(head[i], *want, "IO class column {i}: {head:?}");
        }
        assert_eq!(head[4..6], ["Cache Id", "Core Id"], "{head:?}");
        assert!(
            csv.lines()
                .nth(1)
                .unwrap()
                .starts_with("1,metadata,100,50%,1,1,"),
            "{csv}"
        );
        let j: Value = serde_json::from_str(&stats(&r, OutputFormat::Json)).unwrap();
        assert_eq!(j["info"]["core_id"], 1);
        assert_eq!(j["info"]["io_class_id"], 1);
        assert_eq!(j["usage"]["occupancy"]["count"], 1024);
    }

    /// A cache with inactive cores: casadm's "Inactive usage statistics" right after the usage
    /// (shown with -f usage), occupancy as a share of the cache, clean and dirty of the lines
    /// in use.
    #[test]
    fn inactive_usage_follows_the_usage() {
        let r = StatsReport {
            inactive: Some(crate::protocol::InactiveUsage {
                occupancy_lines: 256,
                dirty_lines: 64,
            }),
            ..report()
        };
        assert_casadm_rows(
            &r,
            &[
                CASADM_USAGE,
                CASADM_INACTIVE_USAGE,
                CASADM_REQUESTS,
                CASADM_CACHE_BLOCKS,
                CASADM_ERRORS,
            ],
        );
        let j: Value = serde_json::from_str(&stats(&r, OutputFormat::Json)).unwrap();
        let i = &j["inactive_usage"];
        assert_eq!(i["inactive_occupancy"]["count"], 256);
        assert_eq!(i["inactive_occupancy"]["percent"], 6.3);
        assert_eq!(i["inactive_clean"]["count"], 192);
        assert_eq!(i["inactive_clean"]["percent"], 18.8);
        assert_eq!(i["inactive_dirty"]["count"], 64);
        assert_eq!(i["inactive_dirty"]["percent"], 6.3);
        let t = stats_with(&r, &[StatsFilter::Usage], OutputFormat::Table);
        assert!(t.contains("Inactive usage statistics"), "{t}");
        let t = stats_with(&r, &[StatsFilter::Req], OutputFormat::Table);
        assert!(!t.contains("Inactive"), "{t}");
        // Without inactive cores, no such table.
        let t = stats(&report(), OutputFormat::Table);
        assert!(!t.contains("Inactive usage"), "{t}");
    }

    #[test]
    fn statistics_rows_are_casadms_in_casadms_order() {
        let cache = report();
        assert_casadm_rows(
            &cache,
            &[
                CASADM_USAGE,
                CASADM_REQUESTS,
                CASADM_CACHE_BLOCKS,
                CASADM_ERRORS,
            ],
        );
        let core = StatsReport {
            core: Some(cache.cache.cores[0].clone()),
            cleaning: None,
            ..report()
        };
        assert_casadm_rows(
            &core,
            &[
                CASADM_USAGE,
                CASADM_REQUESTS,
                CASADM_CORE_BLOCKS,
                CASADM_ERRORS,
            ],
        );
        let class = StatsReport {
            io_class: Some(crate::protocol::IoClassInfo {
                id: 1,
                name: "metadata".into(),
                eviction_priority: "100".into(),
                allocation: "0.50".into(),
            }),
            latency: Vec::new(),
            cleaning: None,
            ..report()
        };
        assert_casadm_rows(
            &class,
            &[CASADM_IO_CLASS_USAGE, CASADM_REQUESTS, CASADM_CACHE_BLOCKS],
        );
        let t = stats(&class, OutputFormat::Table);
        assert!(!t.contains("Error statistics"), "{t}");
    }

    /// Deferred hits are shown apart from the other hits, so that the rows add up to the
    /// total, as in Open CAS; user requests are the clients', the total adds read-ahead and
    /// the cleaner.
    #[test]
    fn deferred_readahead_and_user_requests() {
        let mut r = report();
        r.stats.read_hits = 5;
        r.stats.read_deferred = 2;
        r.stats.read_full_misses = 1;
        r.stats.write_hits = 4;
        r.stats.write_deferred = 1;
        r.stats.pass_through_writes = 2;
        r.stats.prefetch_requests = 3;
        r.stats.prefetch_read_bytes = 3 * 65536;
        r.stats.prefetch_written_bytes = 3 * 65536;
        r.stats.core_read_bytes = 4 * 65536;
        r.stats.cache_written_bytes = 3 * 65536;
        let csv = stats(&r, OutputFormat::Csv);
        let head = csv_header(&csv);
        let values: Vec<&str> = csv.lines().nth(1).unwrap().split(',').collect();
        let at = |name: &str| {
            let i = head
                .iter()
                .position(|h| h == name)
                .unwrap_or_else(|| panic!("{name}: {csv}"));
            values[i].to_string()
        };
        assert_eq!(at("Read hits [Requests]"), "3");
        assert_eq!(at("Read deferred [Requests]"), "2");
        assert_eq!(at("Read total [Requests]"), "6");
        assert_eq!(at("Write hits [Requests]"), "3");
        assert_eq!(at("Write deferred [Requests]"), "1");
        assert_eq!(at("Write total [Requests]"), "4");
        assert_eq!(at("Serviced requests [Requests]"), "10");
        assert_eq!(at("Prefetch: readahead [Requests]"), "3");
        assert_eq!(at("Prefetch: readahead [%]"), "100.0");
        assert_eq!(at("Cleaner [Requests]"), "2");
        assert_eq!(at("User requests [Requests]"), "12");
        assert_eq!(at("User requests [%]"), "100.0");
        assert_eq!(at("Total requests [Requests]"), "17");
        assert_eq!(
            at("Read deferred [%]"),
            format!("{:.1}", 2.0 * 100.0 / 12.0)
        );
        assert_eq!(at("Prefetch core reads: readahead [4KiB Blocks]"), "48");
        assert_eq!(at("Prefetch cache writes: readahead [4KiB Blocks]"), "48");
        let j: Value = serde_json::from_str(&stats(&r, OutputFormat::Json)).unwrap();
        assert_eq!(j["requests"]["read_deferred"]["count"], 2);
        assert_eq!(j["requests"]["write_deferred"]["count"], 1);
        assert_eq!(j["requests"]["prefetch_readahead"]["count"], 3);
        assert_eq!(j["requests"]["user_requests"]["count"], 12);
        assert_eq!(j["requests"]["total_requests"]["count"], 17);
        assert_eq!(j["blocks"]["prefetch_core_reads_readahead"]["count"], 48);
        assert_eq!(j["blocks"]["prefetch_cache_writes_readahead"]["count"], 48);
        assert_eq!(j["raw"]["read_deferred"], 2);
    }

    /// The first rows of casadm's usage, request, block and error tables.
    const CASADM_FIRST_ROWS: &[&str] = &[
        "Occupancy [4KiB Blocks]",
        "Occupancy [%]",
        "Free [4KiB Blocks]",
        "Free [%]",
        "Clean [4KiB Blocks]",
        "Clean [%]",
        "Dirty [4KiB Blocks]",
        "Dirty [%]",
        "Read hits [Requests]",
        "Read hits [%]",
    ];

    fn csv_header(csv: &str) -> Vec<String> {
        csv.lines()
            .next()
            .unwrap_or_default()
            .split(',')
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn csv_header_starts_with_casadms_fields_in_casadms_order() {
        let r = report();
        let head = csv_header(&stats(&r, OutputFormat::Csv));
        for (i, want) in CASADM_CACHE_CONF.iter().enumerate() {
            assert_eq!(head[i], *want, "cache column {i}: {head:?}");
        }
        let usage = head
            .iter()
            .position(|h| h == "Occupancy [4KiB Blocks]")
            .unwrap();
        for (i, want) in CASADM_FIRST_ROWS.iter().enumerate() {
            assert_eq!(head[usage + i], *want, "usage column {i}: {head:?}");
        }
        let values: Vec<String> = stats(&r, OutputFormat::Csv)
            .lines()
            .nth(1)
            .unwrap()
            .split(',')
            .map(str::to_string)
            .collect();
        assert_eq!(values[12], "3.0", "{values:?}");
        assert_eq!(values[13], "3723");
        assert_eq!(values[14], "1 [h] 2 [m] 3 [s]");

        let core = StatsReport {
            core: Some(r.cache.cores[0].clone()),
            ..report()
        };
        let head = csv_header(&stats(&core, OutputFormat::Csv));
        for (i, want) in CASADM_CORE_CONF.iter().enumerate() {
            assert_eq!(head[i], *want, "core column {i}: {head:?}");
        }
        let class = StatsReport {
            io_class: Some(crate::protocol::IoClassInfo {
                id: 1,
                name: "metadata".into(),
                eviction_priority: "100".into(),
                allocation: "0.50".into(),
            }),
            ..report()
        };
        let csv = stats(&class, OutputFormat::Csv);
        let head = csv_header(&csv);
        for (i, want) in CASADM_IO_CLASS_CONF.iter().enumerate() {
            assert_eq!(head[i], *want, "IO class column {i}: {head:?}");
        }
        assert!(
            csv.lines()
                .nth(1)
                .unwrap()
                .starts_with("1,metadata,100,50%,"),
            "{csv}"
        );
        assert_eq!(dirty_for_text(0), "Cache clean");
        assert_eq!(dirty_for_text(90_061), "1 [d] 1 [h] 1 [m] 1 [s]");
    }

    #[test]
    fn filter_shows_the_chosen_sections_only() {
        let r = report();
        let csv = stats_with(
            &r,
            &[StatsFilter::Usage, StatsFilter::Err],
            OutputFormat::Csv,
        );
        let head = csv_header(&csv);
        assert_eq!(head[0], "Occupancy [4KiB Blocks]", "{csv}");
        assert!(head.iter().any(|h| h == "Total errors [Requests]"), "{csv}");
        assert!(!head
            .iter()
            .any(|h| h.starts_with("Cache Id") || h.starts_with("Read hits")));
        assert!(!csv.contains("[us]"), "{csv}");
        let t = stats_with(&r, &[StatsFilter::Conf], OutputFormat::Table);
        assert!(t.contains("Cache Id") && !t.contains("Occupancy"), "{t}");
        let all = stats_with(&r, &[StatsFilter::All], OutputFormat::Csv);
        assert_eq!(all, stats(&r, OutputFormat::Csv));
        let j: Value =
            serde_json::from_str(&stats_with(&r, &[StatsFilter::Req], OutputFormat::Json)).unwrap();
        assert!(
            j.get("requests").is_some() && j.get("usage").is_none(),
            "{j}"
        );
        // Several reports: one CSV header, a line each; a JSON array.
        let two = [report(), report()];
        let csv = stats_many(&two, &[], OutputFormat::Csv);
        assert_eq!(csv.lines().count(), 3, "{csv}");
        let j: Value = serde_json::from_str(&stats_many(&two, &[], OutputFormat::Json)).unwrap();
        assert_eq!(j.as_array().map(Vec::len), Some(2));
        assert_eq!(
            version("1.0", Some("1.1"), OutputFormat::Csv),
            "Name,Version\nhybridcache Cache Daemon,1.1\nhybridcache CLI Utility,1.0\n"
        );
        assert!(version("1.0", None, OutputFormat::Csv).contains("Daemon,Not Loaded\n"));
        let j: Value = serde_json::from_str(&version("1.0", None, OutputFormat::Json)).unwrap();
        assert!(j["daemon"].is_null() && j["cli"] == "1.0");
    }

    #[test]
    fn cleaner_statistics_in_every_format() {
        let r = report();
        let t = stats(&r, OutputFormat::Table);
        assert!(t.contains("║ Cleaner core writes"), "{t}");
        let csv = stats(&r, OutputFormat::Csv);
        let head = csv_header(&csv);
        let values: Vec<&str> = csv.lines().nth(1).unwrap().split(',').collect();
        let at = |name: &str| {
            let i = head
                .iter()
                .position(|h| h == name)
                .unwrap_or_else(|| panic!("{name}: {csv}"));
            values[i].to_string()
        };
        assert_eq!(at("Cleaner [Requests]"), "2");
        assert_eq!(at("Cleaner [%]"), "100.0");
        assert_eq!(at("Cleaner cache reads [4KiB Blocks]"), "5");
        assert_eq!(at("Cleaner core writes [4KiB Blocks]"), "5");
        assert_eq!(at("Cleaner core writes [%]"), "71.4");
        assert_eq!(at("Cleaned lines [Cache lines]"), "5");
        let j: Value = serde_json::from_str(&stats(&r, OutputFormat::Json)).unwrap();
        assert_eq!(j["requests"]["cleaner"]["count"], 2);
        assert_eq!(j["blocks"]["cleaner_cache_reads"]["count"], 5);
        assert_eq!(j["blocks"]["cleaner_core_writes"]["count"], 5);
        assert_eq!(j["blocks"]["cleaned_lines"]["count"], 5);
        // A core's statistics have casadm's cleaner rows (its own counts), not our cleaned
        // lines, which are counted for the whole cache.
        let core = StatsReport {
            core: Some(r.cache.cores[0].clone()),
            cleaning: None,
            ..report()
        };
        let csv = stats(&core, OutputFormat::Csv);
        assert!(csv.contains("Cleaner core writes [4KiB Blocks]"), "{csv}");
        assert!(!csv.contains("Cleaned lines"), "{csv}");
    }

    #[test]
    fn by_id_path_names_the_disk_by_its_link() {
        let dir = tempfile::tempdir().unwrap();
        let disk = dir.path().join("sdx");
        std::fs::write(&disk, b"").unwrap();
        let by_id = dir.path().join("by-id");
        std::fs::create_dir(&by_id).unwrap();
        std::os::unix::fs::symlink(&disk, by_id.join("wwn-0x5000c500a1b2c3d4")).unwrap();
        std::os::unix::fs::symlink(&disk, by_id.join("ata-DISK_SERIAL_1")).unwrap();
        let disk_s = disk.to_str().unwrap();
        assert_eq!(
            by_id_path_in(&by_id, disk_s),
            by_id.join("ata-DISK_SERIAL_1").display().to_string()
        );
        let other = dir.path().join("other");
        std::fs::write(&other, b"").unwrap();
        let other_s = other.to_str().unwrap();
        assert_eq!(by_id_path_in(&by_id, other_s), other_s);
        assert_eq!(by_id_path_in(&by_id, "ram:16M"), "ram:16M");
        assert_eq!(by_id_path_in(&dir.path().join("none"), disk_s), disk_s);
    }

    #[test]
    fn table_csv_json_agree() {
        let r = report();
        let t = stats(&r, OutputFormat::Table);
        assert!(t.contains("║ Occupancy"), "{t}");
        assert!(t.contains("25.0"), "{t}");
        let csv = stats(&r, OutputFormat::Csv);
        let lines: Vec<&str> = csv.lines().collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].split(',').count(), lines[1].split(',').count());
        let j: Value = serde_json::from_str(&stats(&r, OutputFormat::Json)).unwrap();
        assert_eq!(j["usage"]["occupancy"]["count"], 1024);
        assert_eq!(j["usage"]["dirty"]["percent"], 12.5);
        assert_eq!(j["requests"]["read_hits"]["percent"], 75.0);
        assert_eq!(j["blocks"]["core_reads"]["count"], 2);
        assert_eq!(j["info"]["dirty_for_s"], 3723);
        assert!(t.contains("1 [h] 2 [m] 3 [s]"), "{t}");
        // Latency: numbers in JSON, "-" in the table where nothing completed.
        assert_eq!(j["latency"]["read"]["p99_us"], 95.0);
        assert_eq!(j["latency"]["read"]["p9999_us"], 95.0);
        assert!(j["latency"]["write"]["p50_us"].is_null());
        assert!(t.contains("║ Reads "), "{t}");
        assert!(t.contains("p99.99"), "{t}");
        assert!(csv.contains("Reads p99.9 [us]"), "{csv}");
    }

    #[test]
    fn json_gives_numbers_as_numbers() {
        let p = crate::protocol::ParamValue {
            name: "cleaning-alru".into(),
            value: "20".into(),
            read_only: false,
            fields: vec![crate::protocol::ParamField {
                key: "wake_up".into(),
                label: "Wake up time [s]".into(),
                value: "20".into(),
            }],
            cores: Vec::new(),
        };
        let j: Value = serde_json::from_str(&params(&p, OutputFormat::Json)).unwrap();
        assert_eq!(j["value"], 20);
        assert_eq!(j["fields"][0]["value"], 20);
        let l = crate::protocol::IoClassList {
            classes: vec![crate::protocol::IoClassInfo {
                id: 1,
                name: "1".into(),
                eviction_priority: "Pinned".into(),
                allocation: "0.99".into(),
            }],
        };
        let j: Value = serde_json::from_str(&io_classes(&l, OutputFormat::Json)).unwrap();
        assert_eq!(j["classes"][0]["allocation"], 0.99);
        assert_eq!(j["classes"][0]["eviction_priority"], "Pinned");
        assert_eq!(j["classes"][0]["name"], "1");
    }

    /// Keys whose values are names, paths or modes: text whatever they look like.
    const TEXT_KEYS: &[&str] = &[
        "name",
        "label",
        "key",
        "unit",
        "device",
        "export",
        "block_device",
        "frontend",
        "mode",
        "mode_change",
        "status",
        "cleaning",
        "promotion",
        "lazy_flush",
        "prefetch",
    ];

    /// Every string value of `v` that reads as a number, by its path, outside [`TEXT_KEYS`] and
    /// [`INFO_TEXT`].
    fn number_strings(v: &Value, path: &str, out: &mut Vec<String>) {
        match v {
            Value::String(s) => {
                let numeric_start = s
                    .trim()
                    .starts_with(|c: char| c.is_ascii_digit() || "+-.".contains(c));
                if numeric_start && s.trim().parse::<f64>().is_ok() {
                    out.push(format!("{path} = {s:?}"));
                }
            }
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    number_strings(item, &format!("{path}[{i}]"), out);
                }
            }
            Value::Object(map) => {
                for (k, item) in map {
                    if !TEXT_KEYS.contains(&k.as_str()) && !INFO_TEXT.contains(&k.as_str()) {
                        number_strings(item, &format!("{path}.{k}"), out);
                    }
                }
            }
            _ => {}
        }
    }

    fn assert_numbers(what: &str, json: &str) {
        let v: Value = serde_json::from_str(json).unwrap_or_else(|e| panic!("{what}: {e}"));
        let mut found = Vec::new();
        number_strings(&v, what, &mut found);
        assert!(found.is_empty(), "numbers given as strings: {found:?}");
    }

    /// `-P` (cache, core and IO class), `-L` and `-G` of every parameter group: no value a script
    /// reads is a number in quotes.
    #[test]
    fn json_output_has_no_numbers_in_strings() {
        use hybridcache_engine::{Cache, CacheConfig, CacheMode, LineSize};

        let r = report();
        assert_numbers("-P", &stats(&r, OutputFormat::Json));
        let core = StatsReport {
            core: Some(r.cache.cores[0].clone()),
            ..report()
        };
        assert_numbers("-P -j", &stats(&core, OutputFormat::Json));
        let class = StatsReport {
            io_class: Some(crate::protocol::IoClassInfo {
                id: 1,
                name: "metadata".into(),
                eviction_priority: "100".into(),
                allocation: "1.00".into(),
            }),
            ..report()
        };
        let class_json = stats(&class, OutputFormat::Json);
        assert_numbers("-P -d", &class_json);
        let j: Value = serde_json::from_str(&class_json).unwrap();
        assert_eq!(j["info"]["max_size"], 100);
        assert_eq!(j["info"]["eviction_priority"], 100);
        let j: Value = serde_json::from_str(&stats(&core, OutputFormat::Json)).unwrap();
        assert_eq!(j["info"]["core_size_gib"], 1.0);

        let mut flushing = report().cache;
        flushing.status = "Flushing (42.0 %)".into();
        flushing.mode = "wb->wt".into();
        flushing.flush = Some(crate::protocol::FlushInfo {
            percent: 42.0,
            total_lines: 100,
            done_lines: 42,
            cleaned_lines: 42,
            done_bytes: 42 * 4096,
            total_bytes: 100 * 4096,
            elapsed_s: 1.5,
            bytes_per_s: 1e6,
            eta_s: Some(2.0),
            mode_change: Some("wb->wt".into()),
        });
        assert_numbers("-L", &list(&[flushing], OutputFormat::Json));

        // -G of every group, with the values a real cache gives.
        let cache = Cache::new(
            std::sync::Arc::new(hybridcache_volume::RamVolume::new("cache", 16 << 20).unwrap()),
            CacheConfig {
                id: 1,
                line_size: LineSize::from_kib(4).unwrap(),
                mode: CacheMode::Wb,
            },
        )
        .unwrap();
        let id = cache
            .add_core(
                std::sync::Arc::new(hybridcache_volume::RamVolume::new("core", 16 << 20).unwrap()),
                None,
            )
            .unwrap();
        for g in hybridcache_daemon::params::GROUPS {
            let core = g.per_core.then_some(id);
            let fields: Vec<crate::protocol::ParamField> = (g.get)(&cache, core)
                .unwrap_or_else(|e| panic!("{}: {e}", g.name))
                .into_iter()
                .zip(g.fields)
                .map(|(value, f)| crate::protocol::ParamField {
                    key: f.key.into(),
                    label: f.label.into(),
                    value,
                })
                .collect();
            let p = crate::protocol::ParamValue {
                name: g.name.into(),
                value: fields.first().map(|f| f.value.clone()).unwrap_or_default(),
                read_only: g.set.is_none(),
                fields: fields.clone(),
                cores: vec![crate::protocol::CoreParams { core: id, fields }],
            };
            assert_numbers(
                &format!("-G -n {}", g.name),
                &params(&p, OutputFormat::Json),
            );
        }
    }

    #[test]
    fn list_indents_cores() {
        let r = report();
        let t = list(std::slice::from_ref(&r.cache), OutputFormat::Table);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("type"));
        assert!(lines[1].starts_with("cache"));
        assert!(lines[2].starts_with("└core") && lines[2].ends_with("cas1-1   2"));
        assert!(lines[0].ends_with("connections"));
        let csv = list(std::slice::from_ref(&r.cache), OutputFormat::Csv);
        assert!(csv.lines().nth(2).unwrap().ends_with(",cas1-1,2"), "{csv}");
        let t = stats(&r, OutputFormat::Table);
        assert!(t.contains("NBD connections"), "{t}");
        assert_eq!(list(&[], OutputFormat::Table), "No caches running\n");
    }
}

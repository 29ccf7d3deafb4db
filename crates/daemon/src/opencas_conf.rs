//! Open CAS's `/etc/opencas/opencas.conf`, read as it is: `hybridcache config import` turns it
//! into this daemon's TOML ([`crate::config`]), and `--config` on such a file starts what it
//! names, so casctl's file works unchanged.
//!
//! The format is the one `utils/opencas.py` (`cas_config.from_file`) reads in Open CAS
//! (open-cas-linux v26.03, also `utils/opencas.conf.5`):
//!
//! ```text
//! version=19.3.0                                  <- must be the first line
//! [caches]
//! ## Cache ID   Cache device        Cache mode   Extra fields (optional)
//! 1             /dev/disk/by-id/X   WB           cache_line_size=8,ioclass_file=/etc/c.csv
//! [cores]
//! ## Cache ID   Core ID   Core device   Extra fields (optional)
//! 1             1         /dev/disk/by-id/Y   lazy_startup=true
//! ```
//!
//! `#` starts a comment anywhere on a line; columns are separated by any run of spaces or tabs;
//! extra fields are comma-separated `name=value`, names and policy values in any case (casctl
//! lowercases them). Entries casctl would refuse are refused here with their line number, and
//! nothing is started. What has no equivalent (a standby cache) is left out with a note saying
//! why; the importer writes each note as a comment, the daemon logs it at WARN.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{anyhow, bail, Result};

use crate::config::{CacheSection, ConfigFile, CoreSection};

/// Open CAS's ranges (`opencas.py`: `check_cache_id_valid`, `check_core_id_valid`).
const MAX_CACHE_ID: u32 = 16384;
const MAX_CORE_ID: u32 = 4095;
const MODES: [&str; 5] = ["wt", "wb", "wa", "pt", "wo"];
const CACHE_FIELDS: &str = "cache_line_size, lazy_startup, cleaning_policy, promotion_policy, \
                            ioclass_file, target_failover_state";

/// Whether `text` is an opencas.conf rather than TOML: its first line is the version tag, or it
/// has a `[caches]`/`[cores]` section (hybridcache's TOML has `[[cache]]` and `[[core]]`, and
/// `version=19.3.0` is not TOML at all).
pub fn looks_like_opencas(text: &str) -> bool {
    let first = text.lines().find(|l| !l.trim().is_empty()).unwrap_or("");
    first.trim_start().starts_with("version=")
        || text.lines().any(|l| {
            let l = l.split('#').next().unwrap_or("").trim();
            l == "[caches]" || l == "[cores]"
        })
}

/// One entry of the file, where it came from, and what of it could not be carried over.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry<T> {
    /// 1-based line number in opencas.conf.
    pub line: usize,
    /// The line as written, comment removed.
    pub source: String,
    pub value: T,
    /// Fields carried over differently than written, and why.
    pub notes: Vec<String>,
    /// Why the whole entry is left out, if it is.
    pub left_out: Option<String>,
}

/// A parsed and converted opencas.conf.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenCasConf {
    /// The first line's tag, e.g. `19.3.0`.
    pub version: String,
    pub caches: Vec<Entry<CacheSection>>,
    pub cores: Vec<Entry<CoreSection>>,
}

enum Section {
    None,
    Caches,
    Cores,
}

impl OpenCasConf {
    /// Parse the file's text; an error names the line (`line 7: ...`) and nothing is converted.
    pub fn parse(text: &str) -> Result<OpenCasConf> {
        let mut lines = text.lines().enumerate().map(|(i, l)| (i + 1, l));
        let version = match lines.next() {
            Some((_, first)) => match first.trim_end().strip_prefix("version=") {
                Some(v) => v.trim().to_string(),
                None => bail!(
                    "line 1: the first line must be the version tag (version=19.3.0, as Open CAS \
                     writes it), not '{}'",
                    first.trim()
                ),
            },
            None => bail!("line 1: the file is empty (it must start with the version tag)"),
        };
        let mut conf = OpenCasConf {
            version,
            caches: Vec::new(),
            cores: Vec::new(),
        };
        let mut section = Section::None;
        for (n, raw) in lines {
            let line = raw.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            match line {
                "[caches]" => section = Section::Caches,
                "[cores]" => section = Section::Cores,
                _ if line.starts_with('[') => bail!(
                    "line {n}: unknown section {line} (opencas.conf has [caches] and [cores])"
                ),
                _ => {
                    let entry = match section {
                        Section::Caches => conf.cache_line(n, line),
                        Section::Cores => conf.core_line(n, line),
                        Section::None => Err(anyhow!(
                            "'{line}' is outside a section: put it under [caches] or [cores]"
                        )),
                    };
                    entry.map_err(|e| anyhow!("line {n}: {e}"))?;
                }
            }
        }
        conf.mark_cores_of_left_out_caches();
        Ok(conf)
    }

    fn cache_line(&mut self, n: usize, line: &str) -> Result<()> {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.len() < 3 {
            bail!(
                "a cache needs 3 columns (cache id, cache device, cache mode), this line has {}",
                cols.len()
            );
        }
        if cols.len() > 4 {
            bail!(
                "a cache has at most 4 columns (cache id, cache device, cache mode, extra fields), \
                 this line has {}: extra fields are separated by commas, without spaces",
                cols.len()
            );
        }
        let id = parse_id("cache id", cols[0], 1, MAX_CACHE_ID)?;
        let device = cols[1].to_string();
        check_recursive(&device, id)?;
        let mode = cols[2].to_ascii_lowercase();
        if !MODES.contains(&mode.as_str()) {
            bail!(
                "invalid cache mode '{}' (expected wt, wb, wa, pt or wo, in any case)",
                cols[2]
            );
        }
        if let Some(first) = self.caches.iter().find(|c| c.value.id == id) {
            bail!("cache {id} is already configured on line {}", first.line);
        }
        self.check_device_unused(&device)?;
        let mut cache = CacheSection {
            id,
            device,
            line_size: None,
            mode: Some(mode),
            params: BTreeMap::new(),
            ioclass_file: None,
            ioclass_ignore_unsupported: None,
            // Open CAS's default: open-cas.service waits for every device not marked lazy.
            lazy_startup: Some(false),
            mirror: None,
            mirror_lost: None,
        };
        let mut notes = Vec::new();
        let mut left_out = None;
        for (name, value) in extra_fields(cols.get(3).copied())? {
            let lower = value.to_ascii_lowercase();
            match name.as_str() {
                "cache_line_size" => {
                    let kib = match lower.as_str() {
                        "4" | "8" | "16" | "32" | "64" => lower.parse().ok(),
                        _ => None,
                    };
                    cache.line_size = Some(kib.ok_or_else(|| {
                        anyhow!("{value} is invalid cache line size (expected 4, 8, 16, 32 or 64)")
                    })?);
                }
                "lazy_startup" => cache.lazy_startup = Some(parse_bool(&name, &lower)?),
                "cleaning_policy" => {
                    if !["acp", "alru", "nop"].contains(&lower.as_str()) {
                        bail!("{value} is invalid cleaning policy name (expected acp, alru or nop)");
                    }
                    cache.params.insert("cleaning.policy".into(), lower);
                }
                "promotion_policy" => {
                    if !["always", "nhit"].contains(&lower.as_str()) {
                        bail!("{value} is invalid promotion policy name (expected always or nhit)");
                    }
                    cache.params.insert("promotion.policy".into(), lower);
                }
                "ioclass_file" => {
                    let path = PathBuf::from(&value);
                    if let Some(note) = ioclass_note(&path) {
                        cache.ioclass_ignore_unsupported = Some(true);
                        notes.push(note);
                    }
                    cache.ioclass_file = Some(path);
                }
                "target_failover_state" => match lower.as_str() {
                    "active" => {}
                    "standby" => {
                        left_out = Some(format!(
                            "target_failover_state=standby: hybridcache has no standby (failover) \
                             caches, and starting this one as an active cache would write to a \
                             device Open CAS keeps as a passive replica; cache {id} and its cores \
                             are not started"
                        ))
                    }
                    _ => bail!(
                        "{value} is invalid target_failover_state value (expected active or standby)"
                    ),
                },
                _ => bail!("'{name}' is invalid cache parameter name (expected one of {CACHE_FIELDS})"),
            }
        }
        self.caches.push(Entry {
            line: n,
            source: line.to_string(),
            value: cache,
            notes,
            left_out,
        });
        Ok(())
    }

    fn core_line(&mut self, n: usize, line: &str) -> Result<()> {
        let cols: Vec<&str> = line.split_whitespace().collect();
        if cols.len() < 3 {
            bail!(
                "a core needs 3 columns (cache id, core id, core device), this line has {}",
                cols.len()
            );
        }
        if cols.len() > 4 {
            bail!(
                "a core has at most 4 columns (cache id, core id, core device, extra fields), \
                 this line has {}: extra fields are separated by commas, without spaces",
                cols.len()
            );
        }
        let cache = parse_id("cache id", cols[0], 1, MAX_CACHE_ID)?;
        let id = parse_id("core id", cols[1], 0, MAX_CORE_ID)?;
        let device = cols[2].to_string();
        check_recursive(&device, cache)?;
        if !self.caches.iter().any(|c| c.value.id == cache) {
            bail!("cache id {cache} doesn't exist: configure it under [caches] first");
        }
        if let Some(first) = self
            .cores
            .iter()
            .find(|k| k.value.cache == cache && k.value.id == id)
        {
            bail!(
                "core {id} of cache {cache} is already configured on line {}",
                first.line
            );
        }
        self.check_device_unused(&device)?;
        let mut core = CoreSection {
            cache,
            id,
            device,
            frontend: None,
            lazy_startup: Some(false),
        };
        for (name, value) in extra_fields(cols.get(3).copied())? {
            match name.as_str() {
                "lazy_startup" => {
                    core.lazy_startup = Some(parse_bool(&name, &value.to_ascii_lowercase())?)
                }
                _ => bail!("'{name}' is invalid core param name (a core has only lazy_startup)"),
            }
        }
        self.cores.push(Entry {
            line: n,
            source: line.to_string(),
            value: core,
            notes: Vec::new(),
            left_out: None,
        });
        Ok(())
    }

    fn check_device_unused(&self, device: &str) -> Result<()> {
        let by_cache = self.caches.iter().find(|c| c.value.device == device);
        let by_core = self.cores.iter().find(|k| k.value.device == device);
        match (by_cache, by_core) {
            (Some(c), _) => bail!(
                "{device} is already configured as cache {} on line {}",
                c.value.id,
                c.line
            ),
            (None, Some(k)) => bail!(
                "{device} is already configured as core {} of cache {} on line {}",
                k.value.id,
                k.value.cache,
                k.line
            ),
            (None, None) => Ok(()),
        }
    }

    fn mark_cores_of_left_out_caches(&mut self) {
        for core in &mut self.cores {
            let cache = self
                .caches
                .iter()
                .find(|c| c.value.id == core.value.cache && c.left_out.is_some());
            if let Some(c) = cache {
                core.left_out = Some(format!(
                    "its cache {} (line {}) is not started",
                    c.value.id, c.line
                ));
            }
        }
    }

    /// The setup hybridcache starts: every entry not left out.
    pub fn config(&self) -> ConfigFile {
        ConfigFile {
            caches: kept(&self.caches),
            cores: kept(&self.cores),
            ..ConfigFile::default()
        }
    }

    /// Every note and left-out entry, one line each, as the daemon logs them.
    pub fn notes(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (line, notes, left_out) in self
            .caches
            .iter()
            .map(|e| (e.line, &e.notes, &e.left_out))
            .chain(self.cores.iter().map(|e| (e.line, &e.notes, &e.left_out)))
        {
            for note in notes {
                out.push(format!("line {line}: {note}"));
            }
            if let Some(why) = left_out {
                out.push(format!("line {line}: not started: {why}"));
            }
        }
        out
    }

    /// The equivalent hybridcache TOML: each entry preceded by the opencas.conf line it comes
    /// from, a comment for each thing not carried over as written, left-out entries commented
    /// out. Parsing the result gives [`OpenCasConf::config`].
    pub fn to_toml(&self, source: &str) -> Result<String> {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# Converted from {source} (Open CAS opencas.conf, version={}) by `hybridcache config \
             import`.",
            self.version
        );
        out.push_str(
            "# lazy_startup = false is Open CAS's default, written out because hybridcache's is \
             true.\n",
        );
        #[derive(serde::Serialize)]
        struct OneCache<'a> {
            cache: [&'a CacheSection; 1],
        }
        #[derive(serde::Serialize)]
        struct OneCore<'a> {
            core: [&'a CoreSection; 1],
        }
        for e in &self.caches {
            let body = toml::to_string_pretty(&OneCache { cache: [&e.value] })?;
            write_entry(&mut out, e, &body);
        }
        for e in &self.cores {
            let body = toml::to_string_pretty(&OneCore { core: [&e.value] })?;
            write_entry(&mut out, e, &body);
        }
        Ok(out)
    }
}

fn write_entry<T>(out: &mut String, e: &Entry<T>, body: &str) {
    let _ = writeln!(out, "\n# opencas.conf line {}: {}", e.line, e.source);
    for note in &e.notes {
        let _ = writeln!(out, "# {note}");
    }
    match &e.left_out {
        None => out.push_str(body),
        Some(why) => {
            let _ = writeln!(out, "# Not carried over: {why}.");
            for l in body.lines() {
                let _ = writeln!(out, "# {l}");
            }
        }
    }
}

fn kept<T: Clone>(entries: &[Entry<T>]) -> Vec<T> {
    entries
        .iter()
        .filter(|e| e.left_out.is_none())
        .map(|e| e.value.clone())
        .collect()
}

fn parse_id(what: &str, s: &str, min: u32, max: u32) -> Result<u16> {
    match s.parse::<u32>() {
        Ok(v) if (min..=max).contains(&v) => Ok(v as u16),
        Ok(_) => bail!("{s} is invalid {what} (expected {min} to {max})"),
        Err(_) => bail!("{what} '{s}' is not a number"),
    }
}

fn parse_bool(name: &str, v: &str) -> Result<bool> {
    match v {
        "true" => Ok(true),
        "false" => Ok(false),
        _ => bail!("{v} is invalid {name} value (expected true or false)"),
    }
}

/// opencas.py refuses a cache or core on `/dev/casN-M` of its own cache N.
fn check_recursive(device: &str, cache: u16) -> Result<()> {
    let Some(ids) = device.strip_prefix("/dev/cas") else {
        return Ok(());
    };
    let of = ids.split('-').next().and_then(|n| n.parse::<u16>().ok());
    if of == Some(cache) {
        bail!("{device} is cache {cache}'s own export: recursive configuration");
    }
    Ok(())
}

/// The fourth column: `name=value` pairs separated by commas, names in any case.
fn extra_fields(col: Option<&str>) -> Result<Vec<(String, String)>> {
    let mut out: Vec<(String, String)> = Vec::new();
    for field in col.into_iter().flat_map(|c| c.split(',')) {
        let (name, value) = match field.split_once('=') {
            Some((n, v)) if !n.is_empty() && !v.is_empty() && !v.contains('=') => (n, v),
            _ => bail!("extra field '{field}' is not name=value"),
        };
        let name = name.to_ascii_lowercase();
        if out.iter().any(|(n, _)| *n == name) {
            bail!("extra field {name} is given twice");
        }
        out.push((name, value.to_string()));
    }
    Ok(out)
}

/// Open CAS's own IO class file (`utils/ioclass-config.csv`) classifies by file size and
/// metadata, which a block export cannot see: such a file is loaded with those rules never
/// true, and the note says so. A file that cannot be read or parsed gets no note here: the
/// daemon's check refuses it with its line and column.
fn ioclass_note(path: &std::path::Path) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let opts = hybridcache_engine::ioclass::LoadOptions {
        ignore_unsupported: true,
    };
    let classes = hybridcache_engine::ioclass::IoClasses::parse(&text, &opts).ok()?;
    let unsupported: Vec<String> = classes
        .iter()
        .filter(|c| c.has_unsupported_conditions())
        .map(|c| c.id.to_string())
        .collect();
    if unsupported.is_empty() {
        return None;
    }
    Some(format!(
        "ioclass_file {}: IO classes {} test the file system above the cache (metadata, \
         file_size, ...), which a block export cannot see: loaded with \
         ioclass_ignore_unsupported = true, so they never match and their requests fall to the \
         other classes",
        path.display(),
        unsupported.join(", ")
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(text: &str) -> String {
        format!("{:#}", OpenCasConf::parse(text).unwrap_err())
    }

    #[test]
    fn detects_opencas_and_not_toml() {
        assert!(looks_like_opencas("version=19.3.0\n[caches]\n"));
        assert!(looks_like_opencas("# no tag\n[caches]\n1 /dev/x WT\n"));
        assert!(!looks_like_opencas("[[cache]]\nid = 1\ndevice = \"x\"\n"));
        assert!(!looks_like_opencas("[daemon]\ncontrol = \"/x\"\n"));
    }

    #[test]
    fn reads_columns_extra_fields_and_comments() {
        let c = OpenCasConf::parse(
            "version=19.3.0\n# comment\n[caches]\n\
             1\t/dev/a\t\tWB\tcache_line_size=16,CLEANING_POLICY=ACP,promotion_policy=nhit # x\n\
             2 /dev/b pt lazy_startup=TRUE,target_failover_state=active\n\
             [cores]\n1 0 /dev/c\n1   7   /dev/d   lazy_startup=true\n",
        )
        .unwrap();
        assert_eq!(c.version, "19.3.0");
        let cfg = c.config();
        assert_eq!(cfg.caches[0].mode.as_deref(), Some("wb"));
        assert_eq!(cfg.caches[0].line_size, Some(16));
        assert_eq!(cfg.caches[0].params["cleaning.policy"], "acp");
        assert_eq!(cfg.caches[0].params["promotion.policy"], "nhit");
        assert_eq!(cfg.caches[0].lazy_startup, Some(false));
        assert_eq!(cfg.caches[1].lazy_startup, Some(true));
        assert_eq!(cfg.cores[0].id, 0);
        assert_eq!(cfg.cores[0].lazy_startup, Some(false));
        assert_eq!(cfg.cores[1].lazy_startup, Some(true));
        assert!(c.notes().is_empty());
        let toml = c.to_toml("x.conf").unwrap();
        assert_eq!(ConfigFile::parse(&toml).unwrap(), cfg, "{toml}");
    }

    #[test]
    fn standby_cache_and_its_cores_are_left_out_with_a_reason() {
        let c = OpenCasConf::parse(
            "version=1\n[caches]\n1 /dev/a wt\n2 /dev/b wt target_failover_state=standby\n\
             [cores]\n1 1 /dev/c\n2 1 /dev/d\n",
        )
        .unwrap();
        let cfg = c.config();
        assert_eq!(cfg.caches.len(), 1);
        assert_eq!(cfg.cores.len(), 1);
        let notes = c.notes().join("\n");
        assert!(
            notes.contains("line 4: not started: target_failover_state=standby"),
            "{notes}"
        );
        assert!(
            notes.contains("line 7: not started: its cache 2 (line 4)"),
            "{notes}"
        );
        let toml = c.to_toml("x").unwrap();
        assert!(toml.contains("# [[cache]]\n# id = 2\n"), "{toml}");
        assert_eq!(ConfigFile::parse(&toml).unwrap(), cfg);
    }

    #[test]
    fn bad_input_names_its_line() {
        assert!(err("[caches]\n").starts_with("line 1: the first line must be the version tag"));
        assert!(err("").starts_with("line 1: the file is empty"));
        let e = err("version=1\n[caches]\n1 /dev/a xx\n");
        assert!(e.starts_with("line 3: invalid cache mode 'xx'"), "{e}");
        let e = err("version=1\n[caches]\n1 /dev/a wt cache_line_size=3\n");
        assert!(e.starts_with("line 3: 3 is invalid cache line size"), "{e}");
        let e = err("version=1\n[caches]\n1 /dev/a wt foo=1\n");
        assert!(
            e.starts_with("line 3: 'foo' is invalid cache parameter name"),
            "{e}"
        );
        let e = err("version=1\n[caches]\n1 /dev/a wt lazy_startup=maybe\n");
        assert!(
            e.starts_with("line 3: maybe is invalid lazy_startup value"),
            "{e}"
        );
        let e = err("version=1\n[caches]\n1 /dev/a wt a=1,a=2\n");
        assert!(e.contains("given twice"), "{e}");
        let e = err("version=1\n[caches]\n1 /dev/a wt x y\n");
        assert!(
            e.starts_with("line 3: a cache has at most 4 columns"),
            "{e}"
        );
        let e = err("version=1\n[caches]\n0 /dev/a wt\n");
        assert!(e.starts_with("line 3: 0 is invalid cache id"), "{e}");
        let e = err("version=1\n[caches]\n1 /dev/a wt\n1 /dev/b wt\n");
        assert!(
            e.starts_with("line 4: cache 1 is already configured on line 3"),
            "{e}"
        );
        let e = err("version=1\n[caches]\n1 /dev/a wt\n[cores]\n2 1 /dev/b\n");
        assert!(e.starts_with("line 5: cache id 2 doesn't exist"), "{e}");
        let e = err("version=1\n[caches]\n1 /dev/a wt\n[cores]\n1 4096 /dev/b\n");
        assert!(e.starts_with("line 5: 4096 is invalid core id"), "{e}");
        let e = err("version=1\n[caches]\n1 /dev/a wt\n[cores]\n1 1 /dev/a\n");
        assert!(
            e.starts_with("line 5: /dev/a is already configured as cache 1"),
            "{e}"
        );
        let e = err("version=1\n[caches]\n1 /dev/a wt\n[cores]\n1 1 /dev/b cleaning_policy=acp\n");
        assert!(
            e.starts_with("line 5: 'cleaning_policy' is invalid core param name"),
            "{e}"
        );
        let e = err("version=1\n1 /dev/a wt\n");
        assert!(
            e.starts_with("line 2: '1 /dev/a wt' is outside a section"),
            "{e}"
        );
        let e = err("version=1\n[caches]\n1 /dev/cas1-1 wt\n");
        assert!(e.contains("recursive"), "{e}");
    }
}

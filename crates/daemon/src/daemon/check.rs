//! Checking a whole configuration file before any of it is applied, so a refused file has no
//! side effect: no device is formatted or loaded, no cache started, the file not rewritten.
//!
//! What is checked: ids (range, duplicates, cores of caches the file does not name), modes and
//! line sizes, every parameter (by the very setter `set-param` uses, run on a scratch cache in
//! RAM, so the rules cannot drift apart), devices named twice or by two spellings of one
//! device (by identity, [`DeviceKey`]), devices the running setup already uses, and what each
//! present cache device holds (a damaged cache or another cache id is refused here rather than
//! after the caches before it have started). A device that is missing is not an error: its
//! cache or core waits for it.

use std::collections::{BTreeMap, BTreeSet};

use hybridcache_engine::{Cache, CacheConfig, CacheMode, EngineError, LineSize, MAX_CORE_ID};
use hybridcache_volume::open_volume;

use super::{engine_err, State, MAX_CACHE_ID};
use crate::config::ConfigFile;
use crate::devices::{device_key, is_missing, DeviceKey};
use crate::nbd_volume::is_nbd_uri;
use crate::params;

/// How two spellings are compared: by identity when the device exists, by the spelling
/// (without `file:`) when it is missing.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
enum Ident {
    Key(String),
    Missing(String),
}

fn ident(spec: &str) -> Option<Ident> {
    if spec.starts_with("ram:") || spec.starts_with("null:") {
        // Each opens a private volume: never shared.
        return None;
    }
    match device_key(spec) {
        Some(k) => Some(Ident::Key(key_text(&k))),
        None => Some(Ident::Missing(
            spec.strip_prefix("file:").unwrap_or(spec).to_string(),
        )),
    }
}

/// Any spelling of the identity will do for comparing; Debug keeps it independent of which
/// kinds of device identity exist.
fn key_text(k: &DeviceKey) -> String {
    format!("{k:?}")
}

/// Every problem of `cfg` against the running setup `st`, joined; Ok if there is none.
pub(super) fn check_config(cfg: &ConfigFile, st: &State) -> Result<(), String> {
    let mut problems = Vec::new();
    let mut cache_ids = BTreeSet::new();
    // Which entry uses each device, to name both when one is used twice.
    let mut users: BTreeMap<Ident, String> = BTreeMap::new();
    let mut claim = |spec: &str, who: String, problems: &mut Vec<String>| {
        if let Some(k) = device_key(spec) {
            if let Some(user) = st.user_of(&k) {
                problems.push(format!("{who}: device {spec} is already in use as {user}"));
                return;
            }
        }
        if let Some(id) = ident(spec) {
            match users.get(&id) {
                Some(first) => problems.push(format!(
                    "{who}: device {spec} is the same device as that of {first}"
                )),
                None => {
                    users.insert(id, who);
                }
            }
        }
    };
    for c in &cfg.caches {
        let who = format!("cache {}", c.id);
        if c.id == 0 || c.id > MAX_CACHE_ID {
            problems.push(format!("{who}: id out of range (1..{MAX_CACHE_ID})"));
        }
        if !cache_ids.insert(c.id) {
            problems.push(format!("{who}: named twice"));
        }
        if st.id_taken(c.id) {
            problems.push(format!("{who}: already exists"));
        }
        let mode = match c.mode.as_deref().unwrap_or("wt").parse::<CacheMode>() {
            Ok(m) => Some(m),
            Err(e) => {
                problems.push(format!("{who}: mode: {e}"));
                None
            }
        };
        let line = match LineSize::from_kib(c.line_size.unwrap_or(4)) {
            Ok(l) => Some(l),
            Err(e) => {
                problems.push(format!("{who}: line_size: {e}"));
                None
            }
        };
        claim(&c.device, who.clone(), &mut problems);
        if let (Some(mode), Some(line)) = (mode, line) {
            if let Err(e) = check_params(c.id, mode, line, &c.params) {
                problems.push(format!("{who}: {e}"));
            }
        }
        if let Err(e) = check_cache_device(c.id, &c.device) {
            problems.push(format!("{who}: {e}"));
        }
        if let Some(Err(e)) = crate::config::load_ioclass_file(c) {
            problems.push(format!("{who}: {e}"));
        }
    }
    let mut core_ids = BTreeSet::new();
    for core in &cfg.cores {
        let who = format!("core {} of cache {}", core.id, core.cache);
        if !cache_ids.contains(&core.cache) {
            problems.push(format!("{who}: the file has no cache {}", core.cache));
        }
        if core.id as u32 > MAX_CORE_ID {
            problems.push(format!("{who}: id out of range (0..{MAX_CORE_ID})"));
        }
        if !core_ids.insert((core.cache, core.id)) {
            problems.push(format!("{who}: named twice"));
        }
        claim(&core.device, who, &mut problems);
    }
    if problems.is_empty() {
        Ok(())
    } else {
        Err(problems.join("; "))
    }
}

/// Run each parameter group through its `set-param` setter on a scratch cache in RAM with the
/// same mode and line size: what would be refused there is refused here.
fn check_params(
    id: u16,
    mode: CacheMode,
    line_size: LineSize,
    values: &BTreeMap<String, String>,
) -> Result<(), String> {
    if values.is_empty() {
        return Ok(());
    }
    let mut groups: BTreeMap<&str, BTreeMap<String, String>> = BTreeMap::new();
    for (key, value) in values {
        let (g, field) = params::split_key(key).map_err(|e| format!("parameter {key}: {e}"))?;
        if g.set.is_none() {
            return Err(format!("parameter {key} is read-only"));
        }
        if g.per_core {
            // Applied when the cache starts, before its cores exist, it would set nothing.
            return Err(format!(
                "parameter {key}: {} is set per core, and [cache.params] holds cache-wide \
                 parameters only; set it with `hybridcache --set-param --name {} --cache-id ID \
                 --core-id ID` (it is kept in the cache's superblock)",
                g.name, g.name
            ));
        }
        groups
            .entry(g.name)
            .or_default()
            .insert(field, value.clone());
    }
    let lines = 64u64;
    let volume = open_volume(&format!("ram:{}", lines * line_size.bytes() as u64))
        .map_err(|e| format!("checking parameters: {e}"))?;
    let scratch = Cache::new(
        volume,
        CacheConfig {
            id,
            line_size,
            mode,
        },
    )
    .map_err(|e| format!("checking parameters: {}", engine_err(e)))?;
    let mut result = Ok(());
    for (name, fields) in groups {
        let Ok(g) = params::find(name) else { continue };
        if let Some(set) = g.set {
            if let Err(e) = set(&scratch, None, &fields) {
                result = Err(format!("parameter {name}: {e}"));
                break;
            }
        }
    }
    // A volatile cache: nothing to keep.
    let _ = scratch.stop(false);
    result
}

/// What a present cache device holds must fit the file: nothing (a cache is created), or a
/// cache with this id (it is loaded). Missing devices wait; RAM, null and remote devices are
/// not looked into (the remote one would cost a connection pool).
fn check_cache_device(id: u16, spec: &str) -> Result<(), String> {
    if spec.starts_with("ram:") || spec.starts_with("null:") || is_nbd_uri(spec) || is_missing(spec)
    {
        return Ok(());
    }
    let volume = open_volume(spec).map_err(|e| crate::devices::volume_error_text(&e))?;
    match Cache::peek(&*volume) {
        Ok(sb) if sb.cache_id != id => Err(format!(
            "{spec} holds cache {}, not cache {id}",
            sb.cache_id
        )),
        Ok(_) | Err(EngineError::NoCache(_)) => Ok(()),
        Err(e) => Err(format!("{spec}: {}", engine_err(e))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> ConfigFile {
        ConfigFile::parse(text).unwrap()
    }

    fn problems(text: &str) -> String {
        check_config(&parse(text), &State::default()).unwrap_err()
    }

    #[test]
    fn core_ids_run_from_0_to_4095() {
        let text = "[[cache]]\nid = 1\ndevice = \"ram:8M\"\n\n\
                    [[core]]\ncache = 1\nid = 0\ndevice = \"ram:1M\"\n\n\
                    [[core]]\ncache = 1\nid = 4095\ndevice = \"ram:1M\"\n";
        assert_eq!(check_config(&parse(text), &State::default()), Ok(()));
    }

    #[test]
    fn every_problem_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a.img");
        std::fs::write(&file, vec![0u8; 1 << 20]).unwrap();
        let link = dir.path().join("b.img");
        std::os::unix::fs::symlink(&file, &link).unwrap();
        let text = format!(
            "[[cache]]\nid = 1\ndevice = \"{}\"\nmode = \"xx\"\n\n\
             [[cache]]\nid = 1\ndevice = \"ram:8M\"\nline_size = 3\n\n\
             [[cache]]\nid = 2\ndevice = \"ram:8M\"\n[cache.params]\n\"promotion-nhit.threshold\" = \"1\"\n\n\
             [[core]]\ncache = 9\nid = 1\ndevice = \"file:{}\"\n\n\
             [[core]]\ncache = 2\nid = 4096\ndevice = \"/no/such/dev\"\n\n\
             [[core]]\ncache = 2\nid = 5\ndevice = \"/no/such/dev\"\n",
            file.display(),
            link.display()
        );
        let e = problems(&text);
        for want in [
            "cache 1: mode",
            "cache 1: named twice",
            "cache 1: line_size",
            "cache 2: parameter promotion-nhit",
            "core 1 of cache 9: the file has no cache 9",
            "core 1 of cache 9: device file:",
            "is the same device as that of cache 1",
            "core 4096 of cache 2: id out of range (0..4095)",
            "core 5 of cache 2: device /no/such/dev is the same device as that of core 4096 of cache 2",
        ] {
            assert!(e.contains(want), "missing '{want}' in: {e}");
        }
    }

    #[test]
    fn ioclass_files_are_checked_with_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("good.csv");
        std::fs::write(
            &good,
            include_str!("../../../../packaging/ioclass-config.csv"),
        )
        .unwrap();
        let fs_rules = dir.path().join("fs.csv");
        std::fs::write(
            &fs_rules,
            "IO class id,IO class name,Eviction priority,Allocation\n0,unclassified,22,1\n1,metadata&done,0,1\n",
        )
        .unwrap();
        let cache = |file: &std::path::Path, extra: &str| {
            format!(
                "[[cache]]\nid = 1\ndevice = \"ram:8M\"\nioclass_file = \"{}\"\n{extra}",
                file.display()
            )
        };
        check_config(&parse(&cache(&good, "")), &State::default()).unwrap();
        let e = problems(&cache(&fs_rules, ""));
        assert!(
            e.contains("cache 1: ioclass_file") && e.contains("line 3, column 3"),
            "{e}"
        );
        check_config(
            &parse(&cache(&fs_rules, "ioclass_ignore_unsupported = true\n")),
            &State::default(),
        )
        .unwrap();
        let e = problems(&cache(&dir.path().join("none.csv"), ""));
        assert!(e.contains("none.csv"), "{e}");
    }

    #[test]
    fn per_core_parameters_in_cache_params_are_refused() {
        let e = problems(
            "[[cache]]\nid = 1\ndevice = \"ram:8M\"\n[cache.params]\n\"seq-cutoff.policy\" = \"never\"\n",
        );
        assert!(
            e.contains("cache 1: parameter seq-cutoff.policy: seq-cutoff is set per core"),
            "{e}"
        );
    }

    #[test]
    fn a_good_file_passes_and_missing_devices_are_no_error() {
        let text = "[[cache]]\nid = 1\ndevice = \"/no/such/cache\"\nmode = \"wb\"\n\
                    [cache.params]\n\"cleaning-alru.wake-up\" = \"5\"\n\"cleaning.policy\" = \"acp\"\n\n\
                    [[core]]\ncache = 1\nid = 1\ndevice = \"/no/such/core\"\n";
        check_config(&parse(text), &State::default()).unwrap();
    }

    #[test]
    fn a_cache_device_holding_another_cache_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.img");
        std::fs::write(&file, vec![0u8; 16 << 20]).unwrap();
        let spec = file.to_str().unwrap();
        let vol = open_volume(spec).unwrap();
        let cache = Cache::create(
            vol,
            CacheConfig {
                id: 4,
                line_size: LineSize::from_kib(4).unwrap(),
                mode: CacheMode::Wt,
            },
            false,
        )
        .unwrap();
        cache.stop(true).unwrap();
        drop(cache);
        let e = problems(&format!("[[cache]]\nid = 1\ndevice = \"{spec}\"\n"));
        assert!(e.contains("holds cache 4, not cache 1"), "{e}");
        check_config(
            &parse(&format!("[[cache]]\nid = 4\ndevice = \"{spec}\"\n")),
            &State::default(),
        )
        .unwrap();
    }
}

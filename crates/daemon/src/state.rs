//! The daemon's own state directory (default `/var/lib/hybridcache`): what must survive a
//! restart of the daemon that the operator's configuration file does not say.
//!
//! The configuration file is the operator's and is never written. The state directory holds:
//! - `setup.json`: the run-time setup ([`Setup`]): every running cache as it runs now (device,
//!   id, mode, line size, parameters, cores with their devices and front-ends), caches stopped
//!   with `-T -n` that kept dirty data on their device, and cores removed with `-R`/`--remove-inactive`.
//!   It outlives a reboot: the caches it names are on persistent devices.
//! - `frontends.json` (frontend.rs): which front-end served each export. Outlives a reboot.
//! - `ublk-devices.json` (ublk_export.rs): which /dev/ublkbN served each export, so a
//!   restarted daemon resumes the devices under their users. ublk devices do not outlive a
//!   reboot: the file is dropped when the boot id differs from the one it was written under.
//!
//! At start the file and the run-time setup are merged ([`merge`]); the rules are written in
//! docs/cli.md ("State directory").

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::config::{CacheSection, ConfigFile, CoreSection};

pub const DEFAULT_STATE_DIR: &str = "/var/lib/hybridcache";
const SETUP_FILE: &str = "setup.json";
const BOOT_FILE: &str = "boot_id";
const UBLK_FILE: &str = "ublk-devices.json";

/// The run-time setup as recorded in `setup.json`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Setup {
    /// Caches running at the last change, with their cores.
    #[serde(default)]
    pub caches: Vec<CacheSection>,
    #[serde(default)]
    pub cores: Vec<CoreSection>,
    /// Caches stopped with `-T -n` while they held dirty data: their dirty data is on the
    /// device only, so they are loaded again at the next start.
    #[serde(default)]
    pub stopped_dirty: Vec<StoppedCache>,
    /// Cores removed at run time. A cache's metadata no longer records them, but the
    /// configuration file may still name them: they are not added back.
    #[serde(default)]
    pub removed_cores: Vec<RemovedCore>,
    /// The configuration file as the daemon that wrote this read it: what the run-time
    /// changes were made against. A value the operator changed in the file since wins over
    /// the run-time one (the operator's edit is the newer).
    #[serde(default)]
    pub file: Option<ConfigFile>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoppedCache {
    pub cache: CacheSection,
    #[serde(default)]
    pub cores: Vec<CoreSection>,
    pub dirty_lines: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub struct RemovedCore {
    pub cache: u16,
    pub core: u16,
    pub device: String,
}

/// Where the state lives and how it is written.
pub struct StateDir {
    dir: PathBuf,
}

impl StateDir {
    pub fn new(dir: &Path) -> StateDir {
        StateDir {
            dir: dir.to_path_buf(),
        }
    }

    pub fn path(&self) -> &Path {
        &self.dir
    }

    pub fn setup_path(&self) -> PathBuf {
        self.dir.join(SETUP_FILE)
    }

    /// The recorded run-time setup; None if there is none. An unreadable file is reported and
    /// set aside (renamed `.bad`), so the next save does not overwrite what may be recovered.
    pub fn load_setup(&self) -> Option<Setup> {
        let path = self.setup_path();
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
            Err(e) => {
                tracing::error!(
                    "cannot read {}: {e}; starting from the file alone",
                    path.display()
                );
                return None;
            }
        };
        match serde_json::from_str(&text) {
            Ok(s) => Some(s),
            Err(e) => {
                let bad = path.with_extension("json.bad");
                let _ = std::fs::rename(&path, &bad);
                tracing::error!(
                    "{} is unreadable ({e}); set aside as {}; starting from the file alone",
                    path.display(),
                    bad.display()
                );
                None
            }
        }
    }

    pub fn save_setup(&self, setup: &Setup) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(setup).map_err(std::io::Error::other)?;
        write_atomic(&self.setup_path(), text.as_bytes())
    }

    /// ublk devices do not outlive a reboot: records written under another boot are dropped
    /// (a device number may by now belong to another server). Returns whether it dropped them.
    pub fn forget_other_boots(&self) -> bool {
        let Some(now) = boot_id() else {
            return false;
        };
        let boot_file = self.dir.join(BOOT_FILE);
        let recorded = std::fs::read_to_string(&boot_file).ok();
        let mut dropped = false;
        if recorded.as_deref().map(str::trim) != Some(now.as_str()) {
            let ublk = self.dir.join(UBLK_FILE);
            if recorded.is_some() && ublk.exists() {
                match std::fs::remove_file(&ublk) {
                    Ok(()) => {
                        dropped = true;
                        tracing::info!(
                            "{}: written before the last reboot; its ublk devices are gone, records dropped",
                            ublk.display()
                        );
                    }
                    Err(e) => tracing::warn!("cannot remove {}: {e}", ublk.display()),
                }
            }
            if let Err(e) = write_atomic(&boot_file, format!("{now}\n").as_bytes()) {
                tracing::warn!("cannot write {}: {e}", boot_file.display());
            }
        }
        dropped
    }
}

/// The directory systemd made for the service (`StateDirectory=`), from `$STATE_DIRECTORY`
/// (the first, if the unit names several).
pub fn systemd_state_directory() -> Option<PathBuf> {
    let v = std::env::var_os("STATE_DIRECTORY")?;
    let first = v.to_str()?.split(':').next()?.to_string();
    (!first.is_empty()).then(|| PathBuf::from(first))
}

fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// Replace `path` with `bytes` so that a crash at any moment leaves the old or the new file:
/// a temporary file in the same directory, fsync, rename over, fsync of the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir)?;
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".tmp");
    let tmp = dir.join(name);
    {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
    }
    std::fs::rename(&tmp, path)?;
    std::fs::File::open(dir)?.sync_all()
}

/// The setup to apply at start, and what the log says of each cache.
#[derive(Debug, Default)]
pub struct Merged {
    pub config: ConfigFile,
    /// Caches whose device must hold the cache to load (stopped with dirty data): never
    /// created anew, which would lose that data.
    pub load_only: BTreeSet<u16>,
    /// Per cache, where its entry came from.
    pub notes: BTreeMap<u16, String>,
}

/// Merge the operator's file with the run-time setup (docs/cli.md, "State directory"):
/// - a cache of the file is started as the file says; if the state has the same cache (id and
///   device) its run-time mode, line size and parameters win, cores added at run time are
///   added, cores removed at run time stay removed;
/// - a cache of the state that the file names on another device: the file wins;
/// - a cache of the state only (created at run time) is started from the state;
/// - a cache stopped with dirty data by `-T -n` is loaded (never created anew);
/// - a cache the file does not name and the state does not either is not started: a cache
///   stopped cleanly at run time is dropped from the state.
///
/// `defaults` gives the parameter values a new cache of that section would have: only values
/// that differ from them are named in the log (all recorded values are applied).
pub fn merge(
    file: &ConfigFile,
    file_name: &str,
    state: &Setup,
    defaults: &dyn Fn(&CacheSection) -> BTreeMap<String, String>,
) -> Merged {
    let mut out = Merged {
        config: ConfigFile {
            daemon: file.daemon.clone(),
            ..ConfigFile::default()
        },
        ..Merged::default()
    };
    let removed = |cache: u16, core: &CoreSection| {
        state
            .removed_cores
            .iter()
            .any(|r| r.cache == cache && r.core == core.id && r.device == core.device)
    };
    let state_cores = |id: u16| state.cores.iter().filter(move |k| k.cache == id);
    for c in &file.caches {
        let mut taken = Vec::new();
        let mut section = c.clone();
        let from_state = state.caches.iter().find(|s| s.id == c.id).or_else(|| {
            state
                .stopped_dirty
                .iter()
                .map(|s| &s.cache)
                .find(|s| s.id == c.id)
        });
        // The file as the run-time changes found it; None (an older record): as now.
        let base = state.file.as_ref().map(|f| {
            f.caches
                .iter()
                .find(|b| b.id == c.id && b.device == c.device)
        });
        // Whether the operator changed a value in the file since: then the file's wins.
        let edited = |now: Option<&str>, then: Option<&str>| match base {
            Some(_) => now != then,
            None => false,
        };
        match from_state {
            Some(s) if s.device == c.device => {
                let b = base.flatten();
                let (mode_now, mode_then) = (c.mode.as_deref(), b.and_then(|b| b.mode.as_deref()));
                if s.mode.as_deref().unwrap_or("wt") != c.mode.as_deref().unwrap_or("wt")
                    && !edited(mode_now, mode_then)
                {
                    taken.push(format!("mode {}", s.mode.as_deref().unwrap_or("wt")));
                    section.mode = s.mode.clone();
                }
                let line_then = b.and_then(|b| b.line_size);
                if s.line_size.unwrap_or(4) != c.line_size.unwrap_or(4)
                    && (base.is_none() || c.line_size == line_then)
                {
                    taken.push(format!("line size {} KiB", s.line_size.unwrap_or(4)));
                    section.line_size = s.line_size;
                }
                let mut changed = Vec::new();
                let default = defaults(s);
                for (k, v) in &s.params {
                    let now = c.params.get(k).map(String::as_str);
                    let then = b.and_then(|b| b.params.get(k)).map(String::as_str);
                    if now != Some(v.as_str()) && !edited(now, then) {
                        if now.is_some() || default.get(k) != Some(v) {
                            changed.push(k.as_str());
                        }
                        section.params.insert(k.clone(), v.clone());
                    }
                }
                if !changed.is_empty() {
                    taken.push(format!("parameters {}", changed.join(", ")));
                }
                if state.stopped_dirty.iter().any(|d| d.cache.id == c.id) {
                    out.load_only.insert(c.id);
                }
            }
            Some(s) => tracing::warn!(
                "cache {}: the state directory has it on {}, the file on {}: the file wins",
                c.id,
                s.device,
                c.device
            ),
            None => {}
        }
        let same_cache = from_state.is_some_and(|s| s.device == c.device);
        let mut cores: Vec<CoreSection> = Vec::new();
        let base_core =
            |k: &CoreSection| state.file.as_ref().map(|f| f.cores.iter().any(|b| b == k));
        for k in file.cores.iter().filter(|k| k.cache == c.id) {
            // Removed at run time, unless the operator wrote the entry in the file since.
            if same_cache && removed(c.id, k) && base_core(k) != Some(false) {
                taken.push(format!("core {} removed", k.id));
                continue;
            }
            cores.push(k.clone());
        }
        if same_cache {
            let stopped = state.stopped_dirty.iter().find(|d| d.cache.id == c.id);
            let run_time: Vec<&CoreSection> = match stopped {
                Some(d) => d.cores.iter().collect(),
                None => state_cores(c.id).collect(),
            };
            let in_base = |k: &CoreSection| {
                state.file.as_ref().is_some_and(|f| {
                    f.cores
                        .iter()
                        .any(|b| b.cache == k.cache && b.id == k.id && b.device == k.device)
                })
            };
            for k in run_time {
                // A core of the file that the operator has taken out of it since stays out.
                if !cores.iter().any(|f| f.id == k.id) && !in_base(k) {
                    taken.push(format!("core {} added", k.id));
                    cores.push(k.clone());
                }
            }
        }
        let note = if taken.is_empty() {
            format!("from {file_name}")
        } else {
            format!(
                "from {file_name}; {} from the state directory (set at run time)",
                taken.join("; ")
            )
        };
        let note = if out.load_only.contains(&c.id) {
            format!("{note}; stopped with dirty data by -T -n: loaded")
        } else {
            note
        };
        out.notes.insert(c.id, note);
        out.config.caches.push(section);
        out.config.cores.extend(cores);
    }
    let in_file =
        |id: u16, device: &str| file.caches.iter().any(|c| c.id == id || c.device == device);
    for s in &state.caches {
        if in_file(s.id, &s.device) {
            continue;
        }
        out.notes.insert(
            s.id,
            "from the state directory (created at run time)".to_string(),
        );
        out.config.caches.push(s.clone());
        out.config
            .cores
            .extend(state_cores(s.id).filter(|k| !removed(s.id, k)).cloned());
    }
    for d in &state.stopped_dirty {
        if in_file(d.cache.id, &d.cache.device)
            || out.config.caches.iter().any(|c| c.id == d.cache.id)
        {
            continue;
        }
        out.notes.insert(
            d.cache.id,
            format!(
                "from the state directory (stopped with {} dirty lines by -T -n; loaded)",
                d.dirty_lines
            ),
        );
        out.load_only.insert(d.cache.id);
        out.config.caches.push(d.cache.clone());
        out.config.cores.extend(d.cores.iter().cloned());
    }
    out
}

/// The run-time setup's record: where it is written, what was written last, and the caches
/// stopped with dirty data since.
pub struct SetupStore {
    pub dir: StateDir,
    last: parking_lot::Mutex<Setup>,
    stopped: parking_lot::Mutex<Vec<StoppedCache>>,
}

impl SetupStore {
    pub fn new(dir: StateDir, last: Setup) -> SetupStore {
        SetupStore {
            dir,
            last: parking_lot::Mutex::new(last),
            stopped: parking_lot::Mutex::new(Vec::new()),
        }
    }

    /// A cache stopped keeping dirty data on its device: recorded with the next change.
    pub fn stopped_dirty(&self, cache: StoppedCache) {
        self.stopped.lock().push(cache);
    }

    /// Record the setup as it runs now; written only when it changed.
    pub fn record(&self, running: ConfigFile, file: &ConfigFile, default_frontend: &str) {
        let mut last = self.last.lock();
        let mut stopped = self.stopped.lock();
        let next = next_setup(&last, running, stopped.clone(), file, default_frontend);
        if next == *last {
            stopped.clear();
            return;
        }
        match self.dir.save_setup(&next) {
            Ok(()) => {
                *last = next;
                stopped.clear();
            }
            Err(e) => tracing::error!(
                "cannot write {}: {e}; a restart would not know of the changes made since",
                self.dir.setup_path().display()
            ),
        }
    }

    pub fn last(&self) -> Setup {
        self.last.lock().clone()
    }
}

/// The setup to record after a change: `running` is the setup as it runs now (running,
/// waiting and disconnected caches with their cores), `stopped` the caches stopped with dirty
/// data, `prev` what was recorded before, `file` the operator's file.
pub fn next_setup(
    prev: &Setup,
    mut running: ConfigFile,
    stopped: Vec<StoppedCache>,
    file: &ConfigFile,
    default_frontend: &str,
) -> Setup {
    // The front-end is recorded, not left to a default that may change before the restart.
    for k in &mut running.cores {
        if k.frontend.is_none() {
            k.frontend = Some(default_frontend.to_string());
        }
    }
    let has_core = |cache: u16, core: u16| {
        running
            .cores
            .iter()
            .any(|k| k.cache == cache && k.id == core)
    };
    let same_cache = |c: &CacheSection| {
        running
            .caches
            .iter()
            .any(|n| n.id == c.id && n.device == c.device)
    };
    let mut removed: BTreeSet<RemovedCore> = prev
        .removed_cores
        .iter()
        .filter(|r| !has_core(r.cache, r.core))
        // Only while some setup still names the cache: the file, or the running setup.
        .filter(|r| {
            file.caches.iter().any(|c| c.id == r.cache)
                || running.caches.iter().any(|c| c.id == r.cache)
        })
        .cloned()
        .collect();
    for c in prev.caches.iter().filter(|c| same_cache(c)) {
        for k in prev.cores.iter().filter(|k| k.cache == c.id) {
            if !has_core(c.id, k.id) {
                removed.insert(RemovedCore {
                    cache: c.id,
                    core: k.id,
                    device: k.device.clone(),
                });
            }
        }
    }
    // A stopped cache's record ends when its id or its device is in use again (loaded,
    // or the device given to another cache).
    let in_use = |c: &CacheSection| {
        running
            .caches
            .iter()
            .any(|n| n.id == c.id || n.device == c.device)
    };
    let mut stopped_dirty: Vec<StoppedCache> = Vec::new();
    for d in prev.stopped_dirty.iter().cloned().chain(stopped) {
        if in_use(&d.cache) {
            continue;
        }
        stopped_dirty.retain(|o| o.cache.id != d.cache.id && o.cache.device != d.cache.device);
        stopped_dirty.push(d);
    }
    stopped_dirty.sort_by_key(|d| d.cache.id);
    Setup {
        caches: running.caches,
        cores: running.cores,
        stopped_dirty,
        removed_cores: removed.into_iter().collect(),
        file: Some(file.clone()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(id: u16, device: &str, mode: Option<&str>) -> CacheSection {
        CacheSection {
            id,
            device: device.into(),
            line_size: None,
            mode: mode.map(Into::into),
            params: BTreeMap::new(),
            ioclass_file: None,
            ioclass_ignore_unsupported: None,
            lazy_startup: None,
            mirror: None,
            mirror_lost: None,
        }
    }

    fn core(cache: u16, id: u16, device: &str) -> CoreSection {
        CoreSection {
            cache,
            id,
            device: device.into(),
            frontend: None,
            lazy_startup: None,
        }
    }

    #[test]
    fn run_time_changes_win_over_the_file_and_stopped_dirty_caches_are_loaded() {
        let file = ConfigFile {
            caches: vec![cache(1, "/dev/a", None), cache(3, "/dev/c", None)],
            cores: vec![core(1, 1, "/dev/x"), core(1, 2, "/dev/y")],
            ..ConfigFile::default()
        };
        let state = Setup {
            caches: vec![cache(1, "/dev/a", Some("wb")), cache(2, "/dev/b", None)],
            cores: vec![
                core(1, 1, "/dev/x"),
                core(1, 3, "/dev/z"),
                core(2, 1, "/dev/w"),
            ],
            stopped_dirty: vec![StoppedCache {
                cache: cache(4, "/dev/d", Some("wb")),
                cores: vec![core(4, 1, "/dev/v")],
                dirty_lines: 7,
            }],
            removed_cores: vec![RemovedCore {
                cache: 1,
                core: 2,
                device: "/dev/y".into(),
            }],
            file: None,
        };
        let m = merge(&file, "/etc/hc.toml", &state, &|_| BTreeMap::new());
        let ids: Vec<u16> = m.config.caches.iter().map(|c| c.id).collect();
        assert_eq!(ids, vec![1, 3, 2, 4]);
        assert_eq!(m.config.caches[0].mode.as_deref(), Some("wb"));
        let cores_of_1: Vec<u16> = m
            .config
            .cores
            .iter()
            .filter(|k| k.cache == 1)
            .map(|k| k.id)
            .collect();
        assert_eq!(cores_of_1, vec![1, 3], "core 2 removed, core 3 added");
        assert_eq!(m.load_only, BTreeSet::from([4]));
        assert_eq!(
            m.notes[&1],
            "from /etc/hc.toml; mode wb; core 2 removed; core 3 added from the state directory \
             (set at run time)"
        );
        assert_eq!(m.notes[&3], "from /etc/hc.toml");
        assert!(m.notes[&2].contains("created at run time"));
        assert!(m.notes[&4].contains("7 dirty lines"), "{}", m.notes[&4]);
    }

    #[test]
    fn an_edit_of_the_file_made_since_wins_over_the_run_time_value() {
        let mut then = cache(1, "/dev/a", Some("wt"));
        then.params.insert("cleaning.policy".into(), "alru".into());
        let base = ConfigFile {
            caches: vec![then.clone()],
            cores: vec![core(1, 1, "/dev/x"), core(1, 2, "/dev/y")],
            ..ConfigFile::default()
        };
        // At run time: -Q wb, -X cleaning acp and promotion nhit, -R core 2, -A core 3.
        let mut ran = cache(1, "/dev/a", Some("wb"));
        ran.params.insert("cleaning.policy".into(), "acp".into());
        ran.params.insert("promotion.policy".into(), "nhit".into());
        let state = Setup {
            caches: vec![ran],
            cores: vec![core(1, 1, "/dev/x"), core(1, 3, "/dev/z")],
            removed_cores: vec![RemovedCore {
                cache: 1,
                core: 2,
                device: "/dev/y".into(),
            }],
            file: Some(base),
            ..Setup::default()
        };
        // Meanwhile the operator set the mode to wa and cleaning to nop in the file, and took
        // core 1 out of it.
        let mut now = then;
        now.mode = Some("wa".into());
        now.params.insert("cleaning.policy".into(), "nop".into());
        let file = ConfigFile {
            caches: vec![now],
            cores: vec![core(1, 2, "/dev/y")],
            ..ConfigFile::default()
        };
        let m = merge(&file, "f", &state, &|_| BTreeMap::new());
        let c = &m.config.caches[0];
        assert_eq!(c.mode.as_deref(), Some("wa"), "the file's edit wins");
        assert_eq!(c.params["cleaning.policy"], "nop", "the file's edit wins");
        assert_eq!(
            c.params["promotion.policy"], "nhit",
            "the run-time change stays"
        );
        let cores: Vec<u16> = m.config.cores.iter().map(|k| k.id).collect();
        assert_eq!(
            cores,
            vec![3],
            "1 taken out of the file, 2 removed at run time"
        );
    }

    #[test]
    fn the_file_wins_when_it_names_another_device() {
        let file = ConfigFile {
            caches: vec![cache(1, "/dev/new", None)],
            cores: vec![core(1, 2, "/dev/y")],
            ..ConfigFile::default()
        };
        let state = Setup {
            caches: vec![cache(1, "/dev/old", Some("wb"))],
            cores: vec![core(1, 1, "/dev/x")],
            removed_cores: vec![RemovedCore {
                cache: 1,
                core: 2,
                device: "/dev/y".into(),
            }],
            ..Setup::default()
        };
        let m = merge(&file, "f", &state, &|_| BTreeMap::new());
        assert_eq!(m.config.caches, vec![cache(1, "/dev/new", None)]);
        assert_eq!(m.config.cores, vec![core(1, 2, "/dev/y")]);
    }

    #[test]
    fn saves_are_atomic_and_read_back() {
        let dir = tempfile::tempdir().unwrap();
        let s = StateDir::new(&dir.path().join("sub"));
        assert_eq!(s.load_setup(), None);
        let setup = Setup {
            caches: vec![cache(1, "/dev/a", Some("wb"))],
            ..Setup::default()
        };
        s.save_setup(&setup).unwrap();
        assert_eq!(s.load_setup(), Some(setup));
        assert!(!dir.path().join("sub/setup.json.tmp").exists());
        std::fs::write(s.setup_path(), "{").unwrap();
        assert_eq!(s.load_setup(), None);
        assert!(dir.path().join("sub/setup.json.bad").exists());
    }

    #[test]
    fn ublk_records_of_another_boot_are_dropped() {
        if boot_id().is_none() {
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let s = StateDir::new(dir.path());
        let ublk = dir.path().join(UBLK_FILE);
        std::fs::write(&ublk, "{}").unwrap();
        assert!(!s.forget_other_boots(), "first start: no boot recorded yet");
        assert!(ublk.exists());
        assert!(!s.forget_other_boots(), "same boot");
        assert!(ublk.exists());
        std::fs::write(dir.path().join(BOOT_FILE), "another-boot\n").unwrap();
        assert!(s.forget_other_boots());
        assert!(!ublk.exists());
    }
}

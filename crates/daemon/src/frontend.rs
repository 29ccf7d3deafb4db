//! Front-ends: how an exported volume reaches its clients. The daemon owns caches and cores and
//! hands each active core to one front-end by name (`nbd`, `ublk`); it asks the front-end to
//! start and stop serving the export, whether anyone holds it open, and which device path
//! clients use. Adding a front-end means one more implementation of [`Frontend`] registered in
//! [`Frontends`]: neither the engine nor the other front-ends change.

use std::collections::BTreeMap;
use std::sync::Arc;

use hybridcache_nbd::ExportRegistry;

use crate::export::CoreExport;
use crate::target::Target;

/// Everything a front-end needs to serve one core's exported volume.
pub struct ExportSpec {
    /// `cas<cache>-<core>`.
    pub name: String,
    /// For people (NBD's export description, log lines).
    pub description: String,
    /// Where its requests go: the cache's core, swappable while the export stays
    /// (`--script --disconnect-cache`).
    pub core: Target,
    /// The cache line size in bytes: the preferred (physical) block size clients see.
    pub line_size: u32,
    /// The cache device as the daemon names it: a front-end that remembers exports across a
    /// daemon restart ties them to the cache they came from.
    pub cache_device: String,
}

pub type FrontendResult<T> = std::result::Result<T, String>;

pub trait Frontend: Send + Sync {
    /// The name users give with `--frontend`.
    fn kind(&self) -> &'static str;
    /// Serve the export; it is reachable when this returns.
    fn start(&self, spec: ExportSpec) -> FrontendResult<()>;
    /// Stop serving it; clients still holding it get errors. False if it was not served.
    fn stop(&self, name: &str) -> bool;
    /// How many clients hold the export open (None: not served here), as `-L` and the
    /// metrics show it: a look that disturbs no client.
    fn clients(&self, name: &str) -> Option<usize>;
    /// The same for the in-use guard of `-T`/`-R`, which refuses while this is above zero:
    /// it may probe harder than [`Frontend::clients`].
    fn busy(&self, name: &str) -> Option<usize> {
        self.clients(name)
    }
    /// The path clients open (`/dev/ublkbN`), if the front-end makes one.
    fn device(&self, name: &str) -> Option<String>;
    /// Whether this front-end served `name` for the cache on `cache_device` before the daemon
    /// restarted, and wants it back (recovery).
    fn remembers(&self, _name: &str, _cache_device: &str) -> bool {
        false
    }
    /// The cache on `cache_device` could not be loaded: give up whatever is kept for its
    /// exports, saying `why`.
    fn abandon(&self, _cache_device: &str, _why: &str) {}
    /// The daemon is stopping: stop every export.
    fn stop_all(&self) {}
}

/// The NBD front-end: the exports live in the NBD server's registry (the server itself, its
/// sockets and limits are set up by the daemon).
pub struct NbdFrontend {
    registry: ExportRegistry,
}

impl NbdFrontend {
    pub fn new(registry: ExportRegistry) -> NbdFrontend {
        NbdFrontend { registry }
    }
}

impl Frontend for NbdFrontend {
    fn kind(&self) -> &'static str {
        "nbd"
    }

    fn start(&self, spec: ExportSpec) -> FrontendResult<()> {
        let export = Arc::new(CoreExport::new(spec.core, spec.line_size));
        self.registry
            .add_with_description(&spec.name, &spec.description, export)
            .map_err(|e| e.to_string())
    }

    fn stop(&self, name: &str) -> bool {
        self.registry.remove(name).is_some()
    }

    fn clients(&self, name: &str) -> Option<usize> {
        self.registry.clients(name)
    }

    fn device(&self, _name: &str) -> Option<String> {
        None
    }
}

/// The front-ends a daemon has, by kind, and the one a core gets when none is named.
pub struct Frontends {
    by_kind: BTreeMap<&'static str, Arc<dyn Frontend>>,
    default: &'static str,
}

impl Frontends {
    pub fn new(list: Vec<Arc<dyn Frontend>>, default: &str) -> FrontendResult<Frontends> {
        let by_kind: BTreeMap<&'static str, Arc<dyn Frontend>> =
            list.into_iter().map(|f| (f.kind(), f)).collect();
        let default = by_kind
            .keys()
            .find(|k| **k == default)
            .copied()
            .ok_or_else(|| unknown(default, &by_kind))?;
        Ok(Frontends { by_kind, default })
    }

    pub fn default_kind(&self) -> &'static str {
        self.default
    }

    /// The front-end `kind` names (the default for None).
    pub fn get(&self, kind: Option<&str>) -> FrontendResult<&Arc<dyn Frontend>> {
        let kind = kind.unwrap_or(self.default);
        self.by_kind
            .get(kind)
            .ok_or_else(|| unknown(kind, &self.by_kind))
    }

    pub fn all(&self) -> impl Iterator<Item = &Arc<dyn Frontend>> {
        self.by_kind.values()
    }
}

fn unknown(kind: &str, by_kind: &BTreeMap<&'static str, Arc<dyn Frontend>>) -> String {
    format!(
        "unknown front-end '{kind}' (one of: {})",
        by_kind.keys().copied().collect::<Vec<_>>().join(", ")
    )
}

/// Which front-end served each export, kept in the state directory (`frontends.json`), so a
/// cache loaded again (`-S --load` after a restart or a stop) serves every core as before
/// without a configuration file. It lives in the state directory (state.rs) and outlives a
/// reboot: the caches it speaks of are on persistent devices.
pub struct KindMemory {
    path: std::path::PathBuf,
    /// Export name -> (cache device, front-end).
    kinds: parking_lot::Mutex<BTreeMap<String, (String, String)>>,
}

impl KindMemory {
    pub fn new(state_dir: &std::path::Path) -> KindMemory {
        let path = state_dir.join("frontends.json");
        let kinds = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        KindMemory {
            path,
            kinds: parking_lot::Mutex::new(kinds),
        }
    }

    /// The front-end `name` of the cache on `cache_device` had.
    pub fn get(&self, name: &str, cache_device: &str) -> Option<String> {
        self.kinds
            .lock()
            .get(name)
            .filter(|(d, _)| d == cache_device)
            .map(|(_, k)| k.clone())
    }

    pub fn set(&self, name: &str, cache_device: &str, kind: &str) {
        let mut kinds = self.kinds.lock();
        let new = (cache_device.to_string(), kind.to_string());
        if kinds.get(name) != Some(&new) {
            kinds.insert(name.to_string(), new);
            self.save(&kinds);
        }
    }

    pub fn forget(&self, name: &str) {
        let mut kinds = self.kinds.lock();
        if kinds.remove(name).is_some() {
            self.save(&kinds);
        }
    }

    fn save(&self, kinds: &BTreeMap<String, (String, String)>) {
        let write = || -> std::io::Result<()> {
            let text = serde_json::to_string_pretty(kinds)?;
            crate::state::write_atomic(&self.path, text.as_bytes())
        };
        if let Err(e) = write() {
            tracing::warn!("cannot write {}: {e}", self.path.display());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn front_ends_are_remembered_per_export_and_cache_device() {
        let dir = tempfile::tempdir().unwrap();
        let m = KindMemory::new(dir.path());
        m.set("cas1-1", "/dev/nvme0n1", "ublk");
        m.set("cas1-2", "/dev/nvme0n1", "nbd");
        let again = KindMemory::new(dir.path());
        assert_eq!(again.get("cas1-1", "/dev/nvme0n1").as_deref(), Some("ublk"));
        assert_eq!(again.get("cas1-2", "/dev/nvme0n1").as_deref(), Some("nbd"));
        assert_eq!(again.get("cas1-1", "/dev/sdz"), None);
        again.forget("cas1-1");
        assert_eq!(
            KindMemory::new(dir.path()).get("cas1-1", "/dev/nvme0n1"),
            None
        );
    }
}

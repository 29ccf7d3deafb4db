//! Front-ends: how an exported volume reaches its clients. The daemon owns caches and cores and
//! hands each active core to one front-end by name (`nbd`, `ublk`); it asks the front-end to
//! start and stop serving the export, whether anyone holds it open, and which device path
//! clients use. Adding a front-end means one more implementation of [`Frontend`] registered in
//! [`Frontends`]: neither the engine nor the other front-ends change.

use std::collections::BTreeMap;
use std::sync::Arc;

use hybridcache_engine::Core;
use hybridcache_nbd::ExportRegistry;

use crate::export::CoreExport;

/// Everything a front-end needs to serve one core's exported volume.
pub struct ExportSpec {
    /// `cas<cache>-<core>`.
    pub name: String,
    /// For people (NBD's export description, log lines).
    pub description: String,
    pub core: Core,
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
    /// How many clients hold the export open (None: not served here). The in-use guard of
    /// `-T`/`-R` refuses while this is above zero.
    fn clients(&self, name: &str) -> Option<usize>;
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

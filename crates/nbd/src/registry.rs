//! Run-time changeable map of export names to exports.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use parking_lot::RwLock;

use crate::export::{BlockSizes, Export};
use crate::observe::{ObserverSlot, RequestObserver};
use crate::proto::MAX_STRING_LEN;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum RegistryError {
    #[error("export {0:?} already exists")]
    Exists(String),
    #[error("invalid export name: {0}")]
    InvalidName(&'static str),
    #[error("invalid description: {0}")]
    InvalidDescription(&'static str),
    #[error("invalid block sizes: {0}")]
    InvalidBlockSizes(&'static str),
}

/// One registered export as the server sees it.
pub(crate) struct ExportEntry {
    pub(crate) name: String,
    pub(crate) description: String,
    pub(crate) export: Arc<dyn Export>,
    pub(crate) block_sizes: BlockSizes,
    /// Aligned writes take this shared, read-modify-write cycles take it
    /// exclusively: an RMW must not interleave with any other write to the
    /// blocks it rewrites, on any connection. Unaligned writes are rare, so
    /// one lock (a shared acquire on the fast path) beats per-range locking.
    pub(crate) write_gate: RwLock<()>,
    /// Optional request observer (tracing); see observe.rs.
    pub(crate) observer: ObserverSlot,
    /// Connections in transmission on this export; the owner refuses to take away an export
    /// that still has clients (see [`ExportRegistry::clients`]).
    pub(crate) clients: AtomicUsize,
}

/// Counts one connection as a client of an export for as long as it lives.
pub(crate) struct ClientGuard(Arc<ExportEntry>);

impl ClientGuard {
    pub(crate) fn new(entry: &Arc<ExportEntry>) -> ClientGuard {
        entry.clients.fetch_add(1, Ordering::SeqCst);
        ClientGuard(entry.clone())
    }
}

impl Drop for ClientGuard {
    fn drop(&mut self) {
        self.0.clients.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Default)]
struct Inner {
    exports: BTreeMap<String, Arc<ExportEntry>>,
    default: Option<String>,
}

/// Export name -> export. Cloning gives another handle to the same map, so
/// the server and its owner can share one; changes apply to connections
/// negotiated afterwards (established connections keep their export).
#[derive(Clone, Default)]
pub struct ExportRegistry {
    inner: Arc<RwLock<Inner>>,
}

fn check_string(s: &str) -> Result<(), &'static str> {
    if s.len() > MAX_STRING_LEN {
        return Err("longer than 4096 bytes");
    }
    if s.contains('\0') {
        return Err("contains NUL");
    }
    Ok(())
}

impl ExportRegistry {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers `export` under `name` with an empty description.
    pub fn add(&self, name: &str, export: Arc<dyn Export>) -> Result<(), RegistryError> {
        self.add_with_description(name, "", export)
    }

    /// Registers `export`; the description is shown by `NBD_OPT_LIST` and
    /// `NBD_INFO_DESCRIPTION`.
    pub fn add_with_description(
        &self,
        name: &str,
        description: &str,
        export: Arc<dyn Export>,
    ) -> Result<(), RegistryError> {
        let entry = Self::make_entry(name, description, export)?;
        let mut inner = self.inner.write();
        if inner.exports.contains_key(name) {
            return Err(RegistryError::Exists(name.to_string()));
        }
        inner.exports.insert(name.to_string(), entry);
        Ok(())
    }

    /// Registers or replaces; returns the export previously under `name`.
    pub fn replace(
        &self,
        name: &str,
        description: &str,
        export: Arc<dyn Export>,
    ) -> Result<Option<Arc<dyn Export>>, RegistryError> {
        let entry = Self::make_entry(name, description, export)?;
        let old = self.inner.write().exports.insert(name.to_string(), entry);
        Ok(old.map(|e| e.export.clone()))
    }

    fn make_entry(
        name: &str,
        description: &str,
        export: Arc<dyn Export>,
    ) -> Result<Arc<ExportEntry>, RegistryError> {
        check_string(name).map_err(RegistryError::InvalidName)?;
        check_string(description).map_err(RegistryError::InvalidDescription)?;
        let block_sizes = export.block_sizes();
        block_sizes
            .validate()
            .map_err(RegistryError::InvalidBlockSizes)?;
        Ok(Arc::new(ExportEntry {
            name: name.to_string(),
            description: description.to_string(),
            export,
            block_sizes,
            write_gate: RwLock::new(()),
            observer: ObserverSlot::default(),
            clients: AtomicUsize::new(0),
        }))
    }

    /// Attaches `observer` to the export `name` (None detaches); connections already open see
    /// the change. False if there is no such export. An export replaced under the same name
    /// starts without an observer.
    pub fn set_observer(&self, name: &str, observer: Option<Arc<dyn RequestObserver>>) -> bool {
        match self.inner.read().exports.get(name) {
            Some(e) => {
                e.observer.set(observer);
                true
            }
            None => false,
        }
    }

    /// Unregisters `name`; connections already using it keep working.
    pub fn remove(&self, name: &str) -> Option<Arc<dyn Export>> {
        self.inner
            .write()
            .exports
            .remove(name)
            .map(|e| e.export.clone())
    }

    /// How many connections are in transmission on the export registered as `name` (None if
    /// there is no such export). Connections to an export replaced under the same name count
    /// for the old one, not the new one.
    pub fn clients(&self, name: &str) -> Option<usize> {
        self.inner
            .read()
            .exports
            .get(name)
            .map(|e| e.clients.load(Ordering::SeqCst))
    }

    pub fn get(&self, name: &str) -> Option<Arc<dyn Export>> {
        self.inner
            .read()
            .exports
            .get(name)
            .map(|e| e.export.clone())
    }

    /// Names in sorted order.
    pub fn names(&self) -> Vec<String> {
        self.inner.read().exports.keys().cloned().collect()
    }

    pub fn len(&self) -> usize {
        self.inner.read().exports.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Which export a client asking for the empty name ("default export")
    /// gets, when no export is registered under "" itself.
    pub fn set_default(&self, name: Option<&str>) {
        self.inner.write().default = name.map(str::to_string);
    }

    pub(crate) fn lookup(&self, name: &[u8]) -> Option<Arc<ExportEntry>> {
        let name = std::str::from_utf8(name).ok()?;
        let inner = self.inner.read();
        if let Some(e) = inner.exports.get(name) {
            return Some(e.clone());
        }
        if name.is_empty() {
            if let Some(d) = &inner.default {
                return inner.exports.get(d).cloned();
            }
        }
        None
    }

    pub(crate) fn entries(&self) -> Vec<Arc<ExportEntry>> {
        self.inner.read().exports.values().cloned().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::ExportResult;

    struct Null;
    impl Export for Null {
        fn size(&self) -> u64 {
            0
        }
        fn read(&self, _: &mut [u8], _: u64) -> ExportResult<()> {
            Ok(())
        }
        fn write(&self, _: &[u8], _: u64, _: bool) -> ExportResult<()> {
            Ok(())
        }
    }

    struct BadSizes;
    impl Export for BadSizes {
        fn size(&self) -> u64 {
            0
        }
        fn read(&self, _: &mut [u8], _: u64) -> ExportResult<()> {
            Ok(())
        }
        fn write(&self, _: &[u8], _: u64, _: bool) -> ExportResult<()> {
            Ok(())
        }
        fn block_sizes(&self) -> BlockSizes {
            BlockSizes {
                min: 1000,
                preferred: 4096,
                max: 8192,
            }
        }
    }

    #[test]
    fn add_remove_default() {
        let r = ExportRegistry::new();
        r.add("a", Arc::new(Null)).unwrap();
        assert_eq!(
            r.add("a", Arc::new(Null)),
            Err(RegistryError::Exists("a".into()))
        );
        assert!(r.add("bad\0", Arc::new(Null)).is_err());
        assert!(matches!(
            r.add("b", Arc::new(BadSizes)),
            Err(RegistryError::InvalidBlockSizes(_))
        ));
        assert!(r.lookup(b"").is_none());
        r.set_default(Some("a"));
        assert_eq!(r.lookup(b"").map(|e| e.name.clone()), Some("a".into()));
        assert!(r.lookup(&[0xff, 0xfe]).is_none());
        assert!(r.remove("a").is_some());
        assert!(r.is_empty());
        assert!(r.lookup(b"").is_none());
    }
}

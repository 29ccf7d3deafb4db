//! Core lifecycle: `-A` (add a core, or attach an inactive one again), `-R` and
//! `--remove-inactive` (remove a core, flushing it first unless its dirty data is given up), and
//! `--zero-metadata` (wipe what a device holds, so no cache loads from it).
//!
//! These are methods of [`Daemon`]: they open devices under claims, count a core's clients on its
//! front-end, start and stop its export, record the setup and, for a removal, end its traces.
//! `-R` takes the state lock twice: a core's flush runs outside it (it takes as long as the dirty
//! data), so the core is looked up again afterwards.

use hybridcache_engine::CoreRecord;
use serde_json::json;

use super::{cores_text, engine_err, export_name, CacheEntry, CoreEntry, Daemon, Ordering, Reply};
use crate::frontend::ExportSpec;
use crate::protocol;
use crate::safety::{self, Consent, Consents, Loss};
use crate::target::Target;

/// What `--zero-metadata` writes over: the two config slots (engine's format.rs META_OFFSET).
const ZEROED_BYTES: u64 = 2 << 20;

/// Why the device at `spec` is not the one `rec` was added as, if it is not: its identity
/// differs from the recorded one, or it has none where one was recorded. Nothing to compare
/// (a record without identity) accepts it, as path and size always did.
pub(super) fn not_the_recorded_device(rec: &CoreRecord, spec: &str) -> Option<String> {
    let want = rec.identity.as_deref()?;
    match crate::devices::identity(spec) {
        Some(found) if found == want => None,
        found => Some(format!(
            "{spec} is not the device it was added as (recorded: {want}; found: {})",
            found.as_deref().unwrap_or("no identity")
        )),
    }
}

/// Where the block device `spec` names is mounted; None for anything else or when unmounted.
fn mounted_block(spec: &str) -> Option<Vec<String>> {
    use std::os::unix::fs::{FileTypeExt, MetadataExt};
    let meta = std::fs::metadata(crate::claims::spec_path(spec)?).ok()?;
    if !meta.file_type().is_block_device() {
        return None;
    }
    let mounts = crate::claims::mounts_of_block(meta.rdev());
    (!mounts.is_empty()).then_some(mounts)
}

impl Daemon {
    pub(super) fn add_core(
        &self,
        cache_id: u16,
        device: &str,
        core: Option<u16>,
        force: bool,
        frontend: Option<&str>,
    ) -> Reply {
        let mut st = self.state.lock();
        if self.stopping.load(Ordering::SeqCst) {
            return Err("the daemon is shutting down".into());
        }
        if let Some(w) = st.waiting.get(&cache_id) {
            return Err(format!(
                "cache {cache_id} is not running ({}: {})",
                w.status, w.section.device
            ));
        }
        let c = st.cache(cache_id)?;
        // An inactive core comes back by its id, or by the device it was recorded with. A
        // pending core (never added: its device was missing at start) is added with its id.
        let inactive = |e: &CoreEntry| !e.active && !e.pending;
        let reattach = match core {
            Some(j) => match c.cores.get(&j) {
                Some(e) if inactive(e) => Some(j),
                Some(e) if e.pending => None,
                Some(_) => return Err(format!("core {j} already exists in cache {cache_id}")),
                None => None,
            },
            None => c
                .cores
                .iter()
                .find(|(_, e)| inactive(e) && e.device == device)
                .map(|(j, _)| *j),
        };
        // A core attached again (or one waiting for its device) keeps the front-end it had
        // unless one is named.
        let known = reattach.or(core).and_then(|j| c.cores.get(&j));
        let frontend = match (frontend, known) {
            (None, Some(e)) => self.frontends.get(Some(e.frontend))?,
            (kind, _) => self.frontends.get(kind)?,
        };
        let key = st.check_free(device)?;
        let volume = self.open_claimed(device, force)?;
        // A mounted block device taken with --force (claims.rs): the operator's call, said as
        // the loss it risks.
        let accepted: Vec<Loss> = if force {
            mounted_block(device)
                .map(|mounts| Loss::Mounted {
                    device: device.to_string(),
                    mounts,
                })
                .into_iter()
                .collect()
        } else {
            Vec::new()
        };
        let c = st.cache(cache_id)?;
        let line = c.cache.line_size().bytes();
        let identity = crate::devices::identity(device);
        let core_id = match reattach {
            Some(j) => {
                if let Some(why) = c
                    .cache
                    .core_record(j)
                    .and_then(|rec| not_the_recorded_device(&rec, device))
                {
                    if !force {
                        return Err(format!(
                            "cache {cache_id}: core {j}: {why}; attach it with --force if it is that core's device"
                        ));
                    }
                    tracing::warn!("cache {cache_id}: core {j}: {why}; attached as forced");
                }
                c.cache
                    .attach_identified_core(j, volume, identity)
                    .map_err(|e| format!("cache {cache_id}: {}", engine_err(e)))?;
                j
            }
            None => c
                .cache
                .add_identified_core(volume, core, identity)
                .map_err(engine_err)?,
        };
        let name = export_name(cache_id, core_id);
        let description = format!("core {core_id} ({device}) of cache {cache_id}");
        let mut target = None;
        let exported = c.cache.core(core_id).map_err(engine_err).and_then(|core| {
            let t = Target::new(core);
            target = Some(t.clone());
            frontend
                .start(ExportSpec {
                    name: name.clone(),
                    description,
                    core: t,
                    line_size: line,
                    cache_device: c.device.clone(),
                })
                .map_err(|e| format!("cannot export {name}: {e}"))
        });
        if let Err(e) = &exported {
            if reattach.is_none() {
                // Undo, so a failure changes nothing.
                let _ = c.cache.remove_core(core_id, true);
                return Err(e.clone());
            }
            // An attached core cannot be detached again without losing its dirty data: keep
            // it attached (flush or remove it to get rid of it) and say what failed.
            tracing::warn!("cache {cache_id}: core {core_id} attached but {e}");
        }
        if let Some(c) = st.caches.get_mut(&cache_id) {
            // An inactive core attached again keeps what the file said of it.
            let lazy_startup = c.cores.get(&core_id).and_then(|e| e.lazy_startup);
            c.cores.insert(
                core_id,
                CoreEntry {
                    device: device.to_string(),
                    key,
                    active: true,
                    pending: false,
                    frontend: frontend.kind(),
                    target,
                    lazy_startup,
                },
            );
        }
        self.save_locked(&st);
        exported?;
        if let Some(c) = st.caches.get(&cache_id) {
            self.kinds.set(&name, &c.device, frontend.kind());
        }
        tracing::info!(
            "cache {cache_id}: {} core {core_id} ({device}) as {name}{}",
            if reattach.is_some() {
                "attached again"
            } else {
                "added"
            },
            frontend
                .device(&name)
                .map(|d| format!(" on {d}"))
                .unwrap_or_default()
        );
        let mut added = serde_json::to_value(protocol::CoreAdded {
            cache: cache_id,
            core: core_id,
            block_device: frontend.device(&name),
            export: name,
            reattached: reattach.is_some(),
        })
        .map_err(|e| e.to_string())?;
        added["losses"] = safety::record(
            &format!("adding core {core_id} to cache {cache_id}"),
            &accepted,
        );
        Ok(added)
    }

    /// `--zero-metadata`: under the state lock, so no cache can start on the device meanwhile.
    /// As casadm, a cache with dirty data is refused unless forced; so is a device without
    /// hybridcache metadata (its content is unknown) and one whose metadata cannot be read.
    pub(super) fn zero_metadata(&self, device: &str, force: bool) -> Reply {
        let st = self.state.lock();
        if let Some((id, _)) = st.caches.iter().find(|(_, c)| c.device == device) {
            return Err(format!(
                "{device} is the device of running cache {id}; stop it first"
            ));
        }
        // The exclusive claim refuses a device another cache, a mount or a program holds.
        let volume = self.open_claimed(device, false)?;
        let given = Consents::none().with(Consent::Overwrite, force);
        let what = format!("zeroing the metadata of {device}");
        let losses = match hybridcache_engine::read_summary(&*volume) {
            Ok(Some(summary)) if summary.total_dirty_lines() > 0 => vec![Loss::CacheMetadata {
                device: device.to_string(),
                cache: summary.superblock.cache_id,
                cores: cores_text(&summary.superblock),
                dirty_lines: summary.total_dirty_lines(),
                dirty_bytes: summary.dirty_bytes(),
            }],
            // A clean cache's data is all on its cores: only the cache goes.
            Ok(Some(_)) => Vec::new(),
            Ok(None) if hybridcache_engine::holds_metadata(&*volume).map_err(engine_err)? => {
                Vec::new()
            }
            Ok(None) => vec![Loss::DeviceContent {
                device: device.to_string(),
                bytes: ZEROED_BYTES.min(volume.size()),
            }],
            Err(e) if !force => {
                return Err(format!(
                    "zeroing the metadata of {device} refused, nothing was changed: its metadata cannot be read ({}), so whether it holds dirty data is unknown: load it with start-cache --load to see, or give --force to zero it anyway",
                    engine_err(e)
                ))
            }
            Err(e) => {
                tracing::warn!(
                    "{device}: metadata unreadable ({}); zeroed as forced",
                    engine_err(e)
                );
                Vec::new()
            }
        };
        let accepted = safety::decide(&what, losses, &given)?;
        hybridcache_engine::zero_metadata(&*volume).map_err(engine_err)?;
        drop(st);
        tracing::info!("{device}: hybridcache metadata zeroed");
        Ok(json!({ "losses": safety::record(&what, &accepted) }))
    }

    /// `-R` / `--remove-inactive`. An active core's dirty data goes to it first unless
    /// `--force` (casadm's "without flush") discards it; an inactive core's cannot be flushed,
    /// so removing it with dirty data needs `--force` too. Connected clients need
    /// `--disconnect-clients`, whatever else is given.
    pub(super) fn remove_core(
        &self,
        cache_id: u16,
        core: u16,
        given: &Consents,
        inactive_only: bool,
    ) -> Reply {
        let what = format!("removing core {core} of cache {cache_id}");
        let name = export_name(cache_id, core);
        let discard = given.gives(Consent::DiscardDirty);
        let found = {
            let st = self.state.lock();
            let c = st.cache(cache_id)?;
            match c.cores.get(&core) {
                None => return Err(format!("core {core} does not exist in cache {cache_id}")),
                Some(e) if inactive_only && e.active => {
                    return Err(format!(
                    "core {core} of cache {cache_id} is active; remove it with --remove-core (-R)"
                ))
                }
                Some(e) => (
                    c.cache.clone(),
                    e.frontend,
                    e.active && !e.pending,
                    e.pending,
                ),
            }
        };
        let (handle, kind, active, pending) = found;
        let mut losses = Vec::new();
        if active {
            losses.extend(self.clients_of(
                &[(name.clone(), kind)],
                !given.gives(Consent::DisconnectClients),
            ));
        }
        let line = handle.line_size().bytes() as u64;
        let dirty = if pending {
            0
        } else {
            handle.core_dirty_lines(core)
        };
        if dirty > 0 && (discard || !active) {
            losses.push(Loss::DirtyData {
                cache: cache_id,
                core,
                lines: dirty,
                bytes: dirty * line,
            });
        }
        let mut accepted = safety::decide(&what, losses, given)?;
        if active && !discard {
            // As casadm: the dirty data goes to the core first, outside the state lock (a
            // flush takes as long as the data), while the clients are still served.
            handle.flush_core(core).map_err(|e| {
                format!("cache {cache_id}: flushing core {core}: {}", engine_err(e))
            })?;
        }
        let mut st = self.state.lock();
        let c = st.cache(cache_id)?;
        match c.cores.get(&core) {
            None => return Err(format!("core {core} does not exist in cache {cache_id}")),
            Some(e) if e.pending => {
                // The engine never had it: only the setup names it.
                if let Some(c) = st.caches.get_mut(&cache_id) {
                    c.cores.remove(&core);
                }
                self.save_locked(&st);
                tracing::info!(
                    "cache {cache_id}: dropped core {core}, whose device never appeared"
                );
                return Ok(json!({}));
            }
            Some(_) => {}
        }
        if active && !given.gives(Consent::DisconnectClients) {
            // A client may have connected since the check: it still needs the consent.
            let late = self.clients_of(&[(name.clone(), kind)], false);
            safety::decide(&what, late, given)?;
        }
        // Consented clients lose the export now, so no write of theirs lands between the last
        // flush and the removal.
        let frontend = self.frontends.get(Some(kind)).ok();
        let unexported = active && frontend.as_ref().is_some_and(|f| f.stop(&name));
        if active && !discard {
            if let Err(e) = c.cache.flush_core(core) {
                if unexported {
                    self.serve_again(c, cache_id, core, kind);
                }
                return Err(format!(
                    "cache {cache_id}: flushing core {core}: {}",
                    engine_err(e)
                ));
            }
        }
        let discarded = match c.cache.remove_core_counted(core, discard) {
            Ok(n) => n,
            Err(e) => {
                if unexported {
                    self.serve_again(c, cache_id, core, kind);
                }
                return Err(format!("cache {cache_id}: {}", engine_err(e)));
            }
        };
        // What was discarded is what the engine dropped once the core was quiet, which may
        // differ from the count the decision saw.
        accepted.retain(|l| !matches!(l, Loss::DirtyData { .. }));
        if discarded > 0 {
            accepted.push(Loss::DirtyData {
                cache: cache_id,
                core,
                lines: discarded,
                bytes: discarded * line,
            });
        }
        self.traces.core_removed(&self.registry, cache_id, core);
        self.kinds.forget(&name);
        if let Some(c) = st.caches.get_mut(&cache_id) {
            c.cores.remove(&core);
        }
        self.save_locked(&st);
        tracing::info!("cache {cache_id}: removed core {core}");
        Ok(json!({ "losses": safety::record(&what, &accepted) }))
    }

    /// `--script --remove-core --detach` (casadm's detach; the kernel's
    /// `cache_mngt_remove_core_from_cache` with `detach`, OCF's `ocf_mngt_cache_detach_core`):
    /// the core's export goes, its dirty data is flushed first unless `--no-flush`, and the core
    /// becomes inactive, kept in the cache's metadata with its lines until `-A -j` or
    /// `--try-add` attaches its device again. `--no-flush` loses nothing: the dirty data stays
    /// on the cache device. Its clients need the consent `-R` asks for.
    pub(super) fn detach_core(&self, cache_id: u16, core: u16, given: &Consents) -> Reply {
        let what = format!("detaching core {core} of cache {cache_id}");
        let name = export_name(cache_id, core);
        let flush = !given.gives(Consent::DiscardDirty);
        let still_active = |c: &CacheEntry| {
            match c.cores.get(&core) {
            None => Err(format!("core {core} does not exist in cache {cache_id}")),
            Some(e) if !e.active => Err(format!(
                "core {core} of cache {cache_id} is inactive ({} is not attached): it is detached already; attach it with -A -i {cache_id} -j {core} -d DEVICE, or remove it with --remove-inactive -i {cache_id} -j {core}",
                e.device
            )),
            Some(e) => Ok(e.frontend),
        }
        };
        let (handle, kind) = {
            let st = self.state.lock();
            let c = st.cache(cache_id)?;
            (c.cache.clone(), still_active(c)?)
        };
        let losses = self.clients_of(
            &[(name.clone(), kind)],
            !given.gives(Consent::DisconnectClients),
        );
        let accepted = safety::decide(&what, losses, given)?;
        if flush {
            // As -R: the bulk of the flush outside the state lock, the clients still served.
            handle.flush_core(core).map_err(|e| {
                format!("cache {cache_id}: flushing core {core}: {}", engine_err(e))
            })?;
        }
        let mut st = self.state.lock();
        let c = st.cache(cache_id)?;
        still_active(c)?;
        if !given.gives(Consent::DisconnectClients) {
            let late = self.clients_of(&[(name.clone(), kind)], false);
            safety::decide(&what, late, given)?;
        }
        let unexported = self
            .frontends
            .get(Some(kind))
            .ok()
            .is_some_and(|f| f.stop(&name));
        let detached = (|| {
            if flush {
                c.cache.flush_core(core)?;
            }
            c.cache.detach_core(core)
        })();
        let kept = match detached {
            Ok(n) => n,
            Err(e) => {
                if unexported {
                    self.serve_again(c, cache_id, core, kind);
                }
                return Err(format!("cache {cache_id}: {}", engine_err(e)));
            }
        };
        let line = c.cache.line_size().bytes() as u64;
        self.traces.core_removed(&self.registry, cache_id, core);
        if let Some(e) = st
            .caches
            .get_mut(&cache_id)
            .and_then(|c| c.cores.get_mut(&core))
        {
            e.active = false;
            e.key = None;
            e.target = None;
        }
        self.save_locked(&st);
        tracing::info!(
            "cache {cache_id}: core {core} detached, kept inactive with {kept} dirty lines"
        );
        Ok(json!({
            "dirty_lines": kept,
            "dirty_bytes": kept * line,
            "losses": safety::record(&what, &accepted),
        }))
    }

    /// `--script --add-core --update-path` (the kernel's `cache_mngt_update_core_uuid`): record
    /// `device` as the path of active core `core`, which must be the device the core is on
    /// (a renamed node, another link to it); the next load opens it there.
    pub(super) fn update_core_path(&self, cache_id: u16, core: u16, device: &str) -> Reply {
        let mut st = self.state.lock();
        let c = st.cache(cache_id)?;
        let e = st.active_core(cache_id, core)?;
        if crate::devices::is_missing(device) {
            return Err(format!("device {device} not found"));
        }
        let same = matches!(
            (&e.key, crate::devices::device_key(device)),
            (Some(a), Some(b)) if *a == b
        );
        if !same {
            return Err(format!(
                "{device} is not the device of core {core} of cache {cache_id} ({}): --update-path records another path of the same device; to put the core on another device, remove it and add that one",
                e.device
            ));
        }
        c.cache
            .set_core_path(core, device, crate::devices::identity(device))
            .map_err(|e| format!("cache {cache_id}: {}", engine_err(e)))?;
        let old = e.device.clone();
        if let Some(e) = st
            .caches
            .get_mut(&cache_id)
            .and_then(|c| c.cores.get_mut(&core))
        {
            e.device = device.to_string();
        }
        self.save_locked(&st);
        tracing::info!("cache {cache_id}: core {core}'s path is now {device} (was {old})");
        Ok(json!({ "device": device, "was": old }))
    }

    /// Export core `core` of cache `cache_id` (entry `c`) again after a removal that failed
    /// once its export was stopped, so its clients can reconnect.
    pub(super) fn serve_again(&self, c: &CacheEntry, cache_id: u16, core: u16, kind: &'static str) {
        let name = export_name(cache_id, core);
        let back = (|| -> std::result::Result<(), String> {
            let e = c
                .cores
                .get(&core)
                .ok_or_else(|| format!("core {core} is gone"))?;
            let target = match &e.target {
                Some(t) => t.clone(),
                None => Target::new(c.cache.core(core).map_err(engine_err)?),
            };
            self.frontends.get(Some(kind))?.start(ExportSpec {
                name: name.clone(),
                description: format!("core {core} ({}) of cache {cache_id}", e.device),
                core: target,
                line_size: c.cache.line_size().bytes(),
                cache_device: c.device.clone(),
            })
        })();
        if let Err(e) = back {
            tracing::error!("cache {cache_id}: {name} cannot be served again: {e}");
        }
    }
}

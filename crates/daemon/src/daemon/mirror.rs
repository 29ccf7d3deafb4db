//! `--attach-mirror`: a new mirror for a mirrored cache whose mirror is lost, or a first one for
//! a running cache that has none (docs/cli.md, "Mirrored caches"; the engine's rebuild is
//! `Cache::attach_mirror`, docs/format.md).
//!
//! The device is claimed and checked as `-S --mirror` checks it (a file system, another cache's
//! metadata: each a loss that needs `--force`) and recorded as the cache's mirror before the copy
//! starts, so no other command can take it meanwhile. The copy runs without the state lock:
//! clients are served, and `-L`/`-P` show its progress. A rebuild that fails puts the old record
//! back (the cache is then `mirror lost` again, as it was, or without a mirror: its record
//! has none again). A first mirror is recorded like one given at `-S --mirror` (with the
//! default `mirror_lost`, drain), and the daemon's saved state names it once it is filled, so
//! that the next start loads the pair; the operator's configuration file is never rewritten.
//!
//! `--attach-cache` on a mirrored cache whose primary is lost does the same for a new primary
//! (`Cache::attach_primary`): the device is recorded as the cache's device.

use std::time::Instant;

use hybridcache_engine::{MirrorLostPolicy, MirrorState};

use super::caches::device_losses;
use super::{engine_err, Daemon, MirrorEntry, Reply};
use crate::protocol::{MirrorAttached, PrimaryAttached};
use crate::safety::{self, Consent, Consents};

impl Daemon {
    pub(super) fn attach_mirror(&self, id: u16, device: &str, force: bool) -> Reply {
        let what = format!("attaching {device} as the mirror of cache {id}");
        let (cache, volume, old, accepted, primary) = {
            let mut st = self.state.lock();
            if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
                return Err("the daemon is shutting down".into());
            }
            let c = st.cache(id)?;
            if c.device == device {
                return Err(format!(
                    "{device} is cache {id}'s own device; it cannot be its mirror"
                ));
            }
            let key = st.check_free(device)?;
            let volume = self.open_claimed(device, false)?;
            let given = Consents::none().with(Consent::Overwrite, force);
            let accepted = safety::decide(&what, device_losses(device, &*volume)?, &given)?;
            let Some(c) = st.caches.get_mut(&id) else {
                return Err(format!("cache {id} does not exist"));
            };
            // Recorded before the copy, so that no other command takes the device meanwhile.
            let old = match c.mirror.as_mut() {
                Some(m) => Some((
                    std::mem::replace(&mut m.device, device.to_string()),
                    std::mem::replace(&mut m.key, key),
                )),
                None => {
                    c.mirror = Some(MirrorEntry {
                        device: device.to_string(),
                        key,
                        policy: MirrorLostPolicy::default(),
                        // Its start is logged below, with what there is to copy.
                        logged: MirrorState::Rebuilding,
                    });
                    None
                }
            };
            (c.cache.clone(), volume, old, accepted, c.device.clone())
        };
        let first = old.is_none();
        if first {
            let usage = cache.stats().usage;
            tracing::info!(
                "cache {id}: giving it the mirror {device} (it had none): {} dirty lines ({}) to copy from {primary}",
                safety::count_text(usage.dirty_lines),
                safety::size_text(usage.dirty_lines * cache.line_size().bytes() as u64)
            );
        }
        let started = Instant::now();
        // The losses were decided above: the engine's own check of a used device is passed.
        let rebuilt = cache.attach_mirror(volume, true);
        let mut st = self.state.lock();
        match rebuilt {
            Ok((lines, bytes)) => {
                let seconds = started.elapsed().as_secs_f64();
                self.save_locked(&st);
                if first {
                    tracing::info!(
                        "cache {id}: mirror {device} attached: {} dirty lines ({}) copied from {primary} in {seconds:.1} s; the cache is redundant",
                        safety::count_text(lines),
                        safety::size_text(bytes)
                    );
                } else {
                    tracing::info!(
                        "cache {id}: mirror rebuilt on {device}: {} dirty lines ({}) copied in {seconds:.1} s; the cache is redundant again",
                        safety::count_text(lines),
                        safety::size_text(bytes)
                    );
                }
                let mut v = serde_json::to_value(MirrorAttached {
                    cache: id,
                    device: device.to_string(),
                    dirty_lines: lines,
                    dirty_bytes: bytes,
                    seconds,
                    first,
                })
                .map_err(|e| e.to_string())?;
                v["losses"] = safety::record(&what, &accepted);
                Ok(v)
            }
            Err(e) => {
                // The cache may have been stopped meanwhile; only a record still naming this
                // device is put back.
                if let Some(c) = st
                    .caches
                    .get_mut(&id)
                    .filter(|c| c.mirror.as_ref().is_some_and(|m| m.device == device))
                {
                    match (old, c.mirror.as_mut()) {
                        (Some(old), Some(m)) => (m.device, m.key) = old,
                        _ => c.mirror = None,
                    }
                }
                Err(format!(
                    "cache {id}: {device} was not attached as its mirror: {}",
                    engine_err(e)
                ))
            }
        }
    }
}

impl Daemon {
    /// `--attach-cache -i ID -d DEVICE` on a mirrored cache whose primary is lost: DEVICE becomes
    /// its new primary (the engine's `Cache::attach_primary`). The device is checked and claimed
    /// as `--attach-mirror` checks and claims a new mirror, and recorded as the cache's device
    /// before the copy; the copy runs without the state lock; a failure puts the old record back
    /// (the cache is then `primary lost` again, as it was).
    pub(super) fn attach_primary(&self, id: u16, device: &str, force: bool) -> Reply {
        let what = format!("attaching {device} as the new primary of cache {id}");
        let (cache, volume, old, mirror, accepted) = {
            let mut st = self.state.lock();
            if self.stopping.load(std::sync::atomic::Ordering::SeqCst) {
                return Err("the daemon is shutting down".into());
            }
            let c = st.cache(id)?;
            let Some(m) = c.mirror.as_ref() else {
                return Err(format!(
                    "cache {id} is running and has no mirror, so no lost primary to replace: --attach-cache attaches a device to a detached cache or gives a mirrored cache whose primary is lost a new one"
                ));
            };
            if c.device == device {
                return Err(format!(
                    "{device} is cache {id}'s lost primary: it missed the writes since it failed and is stale; attach another device"
                ));
            }
            let mirror = m.device.clone();
            let key = st.check_free(device)?;
            let volume = self.open_claimed(device, false)?;
            let given = Consents::none().with(Consent::Overwrite, force);
            let accepted = safety::decide(&what, device_losses(device, &*volume)?, &given)?;
            let Some(c) = st.caches.get_mut(&id) else {
                return Err(format!("cache {id} does not exist"));
            };
            let old = (
                std::mem::replace(&mut c.device, device.to_string()),
                std::mem::replace(&mut c.key, key),
            );
            (c.cache.clone(), volume, old, mirror, accepted)
        };
        // Said only when the copy is about to start; the engine refuses any other state.
        if cache
            .mirror_status()
            .is_some_and(|m| m.state == MirrorState::PrimaryLost)
        {
            let usage = cache.stats().usage;
            tracing::info!(
                "cache {id}: attaching {device} as its new primary: {} dirty lines ({}) to copy from its mirror {mirror}",
                safety::count_text(usage.dirty_lines),
                safety::size_text(usage.dirty_lines * cache.line_size().bytes() as u64)
            );
        }
        let started = Instant::now();
        // The losses were decided above: the engine's own check of a used device is passed.
        let attached = cache.attach_primary(volume, true);
        let mut st = self.state.lock();
        match attached {
            Ok((lines, bytes)) => {
                let seconds = started.elapsed().as_secs_f64();
                self.save_locked(&st);
                tracing::info!(
                    "cache {id}: new primary {device} attached: {} dirty lines ({}) copied from the mirror {mirror} in {seconds:.1} s; the cache is redundant again, in mode {}",
                    safety::count_text(lines),
                    safety::size_text(bytes),
                    cache.mode().as_str()
                );
                let mut v = serde_json::to_value(PrimaryAttached {
                    cache: id,
                    device: device.to_string(),
                    mirror,
                    dirty_lines: lines,
                    dirty_bytes: bytes,
                    seconds,
                })
                .map_err(|e| e.to_string())?;
                v["losses"] = safety::record(&what, &accepted);
                Ok(v)
            }
            Err(e) => {
                // The cache may have been stopped meanwhile; only a record still naming this
                // device is put back.
                if let Some(c) = st.caches.get_mut(&id).filter(|c| c.device == device) {
                    (c.device, c.key) = old;
                }
                Err(format!(
                    "cache {id}: {device} was not attached as its new primary: {}",
                    engine_err(e)
                ))
            }
        }
    }
}

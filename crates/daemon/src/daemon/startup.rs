//! opencas.conf's `lazy_startup = false`. At boot Open CAS's service waits, up to a timeout, for
//! every device not marked lazy and fails (the boot drops to the emergency shell) when one never
//! comes; lazy devices are added whenever they appear. Here the daemon's readiness (its "ready"
//! log line and READY=1 to systemd) waits the same way, in two steps:
//!
//! 1. Before the file is applied: until every such device is present. Giving up here leaves
//!    every device and the file as they were, since nothing has been started yet.
//! 2. After: until the cache on each such device runs and each such core is active (the device
//!    watcher attaches what appeared late). Giving up here stops what started, as a stop would.
//!
//! Lazy is the default, unlike Open CAS's: a file without the key keeps the behaviour it always
//! had (the daemon is ready at once and missing devices are waited for in the background).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use super::{Daemon, WAITING_FOR_DEVICE};
use crate::config::ConfigFile;
use crate::devices::{is_missing, settle_mark};

/// As systemd's default device timeout (`DefaultDeviceTimeoutSec`).
pub(super) const DEFAULT_DEVICE_TIMEOUT_S: u64 = 90;
/// As the device watcher's: a device is taken once two looks this far apart agree.
const POLL: Duration = Duration::from_secs(1);
/// How often the second step looks at the caches: attaching is the watcher's, this only waits.
const RUNNING_POLL: Duration = Duration::from_millis(200);

/// A device readiness waits for: a cache's (`core` None) or a core's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Needed {
    pub(super) device: String,
    pub(super) cache: u16,
    pub(super) core: Option<u16>,
    /// What the file marks non-lazy: this entry, or a core of this cache.
    pub(super) why: String,
}

/// How a wait ended.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Wait {
    Done,
    /// SIGTERM or SIGINT: stop as asked.
    Signal(i32),
    /// Giving up; the message names every device still missing or not running.
    Failed(String),
}

/// The devices the file marks `lazy_startup = false`. A core needs its cache too, so the cache's
/// device is waited for whatever the cache's own key says.
pub(super) fn needed(cfg: &ConfigFile) -> Vec<Needed> {
    let mut out: Vec<Needed> = Vec::new();
    let mut add = |n: Needed| {
        if !out.iter().any(|o| o.cache == n.cache && o.core == n.core) {
            out.push(n);
        }
    };
    for c in cfg.caches.iter().filter(|c| c.lazy_startup == Some(false)) {
        add(Needed {
            device: c.device.clone(),
            cache: c.id,
            core: None,
            why: format!("cache {}", c.id),
        });
    }
    for k in cfg.cores.iter().filter(|k| k.lazy_startup == Some(false)) {
        let who = format!("core {} of cache {}", k.id, k.cache);
        if let Some(c) = cfg.caches.iter().find(|c| c.id == k.cache) {
            add(Needed {
                device: c.device.clone(),
                cache: c.id,
                core: None,
                why: format!("cache {}, which {who} needs", c.id),
            });
        }
        add(Needed {
            device: k.device.clone(),
            cache: k.cache,
            core: Some(k.id),
            why: who,
        });
    }
    out
}

fn describe(n: &Needed) -> String {
    format!("{} ({}, lazy_startup = false)", n.device, n.why)
}

/// Sleep for `d`, or less when SIGTERM or SIGINT comes (they are blocked in every thread and
/// taken here, as the main thread takes them later with sigwait).
fn sleep_or_signal(set: &libc::sigset_t, d: Duration) -> Option<i32> {
    let ts = libc::timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `set` is an initialised signal set and `ts` a valid timespec; no siginfo wanted.
    let sig = unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &ts) };
    (sig > 0).then_some(sig)
}

/// Step 1: wait until every needed device is present, up to `deadline`. A device present at
/// the first look is taken at once (as without the key); one that appears later is taken once
/// two looks a poll apart agree on its size and modification time, as the watcher does, so a
/// file still being written is not formatted half-written.
pub(super) fn wait_present(
    needed: &[Needed],
    deadline: Instant,
    timeout: Duration,
    signals: &libc::sigset_t,
) -> Wait {
    let mut missing: Vec<&Needed> = needed.iter().filter(|n| is_missing(&n.device)).collect();
    if missing.is_empty() {
        return Wait::Done;
    }
    let list = |m: &[&Needed]| m.iter().map(|n| describe(n)).collect::<Vec<_>>().join(", ");
    tracing::info!(
        "waiting up to {} s for devices that are not lazy: {}",
        timeout.as_secs(),
        list(&missing)
    );
    let mut marks: HashMap<String, (u64, i64, i64)> = HashMap::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Wait::Failed(format!(
                "{} did not appear within {} s; nothing was started and no device was changed",
                list(&missing),
                timeout.as_secs()
            ));
        }
        if let Some(sig) = sleep_or_signal(signals, left.min(POLL)) {
            return Wait::Signal(sig);
        }
        missing.retain(|n| match settle_mark(&n.device) {
            None => {
                marks.remove(&n.device);
                true
            }
            Some(m) => {
                let settled = marks.insert(n.device.clone(), m) == Some(m);
                if settled {
                    tracing::info!("{} appeared", describe(n));
                }
                !settled
            }
        });
        if missing.is_empty() {
            return Wait::Done;
        }
    }
}

impl Daemon {
    /// What of `needed` is not running yet, and whether waiting longer cannot help (a cache
    /// that failed to start is not tried again).
    fn not_running(&self, needed: &[Needed]) -> (Vec<String>, bool) {
        let st = self.state.lock();
        let mut out = Vec::new();
        let mut hopeless = false;
        for n in needed {
            let Some(cache) = st.caches.get(&n.cache) else {
                let status = st
                    .waiting
                    .get(&n.cache)
                    .map_or("not started", |w| w.status.as_str());
                hopeless |= !status.starts_with(WAITING_FOR_DEVICE);
                out.push(format!("{}: cache {}: {status}", describe(n), n.cache));
                continue;
            };
            if let Some(core) = n.core {
                if !cache.cores.get(&core).is_some_and(|e| e.active) {
                    out.push(format!("{}: not attached", describe(n)));
                }
            }
        }
        (out, hopeless)
    }

    /// Step 2: wait until the cache on each needed device runs and each needed core is active.
    pub(super) fn wait_running(
        &self,
        needed: &[Needed],
        deadline: Instant,
        timeout: Duration,
        signals: &libc::sigset_t,
    ) -> Wait {
        loop {
            let (missing, hopeless) = self.not_running(needed);
            if missing.is_empty() {
                return Wait::Done;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if hopeless || left.is_zero() {
                return Wait::Failed(format!(
                    "devices that are not lazy are not running after {} s: {}",
                    timeout.as_secs(),
                    missing.join("; ")
                ));
            }
            if let Some(sig) = sleep_or_signal(signals, left.min(RUNNING_POLL)) {
                return Wait::Signal(sig);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_core_that_is_not_lazy_needs_its_cache_too() {
        let cfg = ConfigFile::parse(
            "[[cache]]\nid = 1\ndevice = \"/a\"\n\n[[cache]]\nid = 2\ndevice = \"/b\"\nlazy_startup = false\n\n\
             [[cache]]\nid = 3\ndevice = \"/c\"\nlazy_startup = true\n\n\
             [[core]]\ncache = 1\nid = 0\ndevice = \"/k\"\nlazy_startup = false\n\n\
             [[core]]\ncache = 2\nid = 1\ndevice = \"/l\"\n\n\
             [[core]]\ncache = 3\nid = 1\ndevice = \"/m\"\nlazy_startup = true\n",
        )
        .unwrap();
        let got: Vec<(String, u16, Option<u16>)> = needed(&cfg)
            .into_iter()
            .map(|n| (n.device, n.cache, n.core))
            .collect();
        assert_eq!(
            got,
            [
                ("/b".to_string(), 2, None),
                ("/a".to_string(), 1, None),
                ("/k".to_string(), 1, Some(0)),
            ]
        );
    }

    #[test]
    fn a_missing_device_times_out_naming_it_and_a_present_one_does_not_wait() {
        let dir = tempfile::tempdir().unwrap();
        let present = dir.path().join("present.img");
        std::fs::write(&present, [1u8; 4096]).unwrap();
        let absent = dir.path().join("absent.img");
        let n = |p: &std::path::Path, core| Needed {
            device: p.display().to_string(),
            cache: 1,
            core,
            why: "core 1 of cache 1".into(),
        };
        let set = super::super::block_signals();
        let t = Instant::now();
        assert_eq!(
            wait_present(
                &[n(&present, Some(1))],
                t + Duration::from_secs(5),
                Duration::from_secs(5),
                &set
            ),
            Wait::Done
        );
        assert!(t.elapsed() < Duration::from_secs(1));
        let got = wait_present(
            &[n(&present, None), n(&absent, Some(1))],
            Instant::now() + Duration::from_millis(300),
            Duration::from_millis(300),
            &set,
        );
        match got {
            Wait::Failed(m) => {
                assert!(m.contains(&absent.display().to_string()), "{m}");
                assert!(!m.contains(&present.display().to_string()), "{m}");
                assert!(m.contains("core 1 of cache 1"), "{m}");
            }
            other => panic!("{other:?}"),
        }
    }
}

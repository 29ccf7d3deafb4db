//! What an exported volume serves its requests from, swappable under live exports.
//!
//! Normally a core's export goes through the cache (the engine's [`Core`]). `--script
//! --disconnect-cache` takes the cache away while the exports stay: the front-ends keep the same
//! [`Target`], which then either holds every request until a cache is connected again (frozen,
//! as Open CAS freezes its exported objects' queues) or sends it to the core device itself
//! (pass-through). The front-ends never learn of the switch.
//!
//! A switch waits for the requests in flight on the old route to complete and lets none start
//! meanwhile, so no request is lost or overtakes one acknowledged before the switch.

use std::sync::Arc;

use hybridcache_engine::{Core, EngineError};
use hybridcache_volume::VolumeRef;
use parking_lot::{Condvar, Mutex, RwLock};

/// Where requests go.
pub enum Route {
    /// Through the cache.
    Cache(Core),
    /// Nowhere yet: requests wait until the route changes.
    Frozen,
    /// Straight to the core device, bypassing a cache that is not there.
    PassThrough(VolumeRef),
    /// The export is being taken down: waiting and new requests fail.
    Gone,
}

impl Route {
    pub fn name(&self) -> &'static str {
        match self {
            Route::Cache(_) => "cache",
            Route::Frozen => "frozen",
            Route::PassThrough(_) => "pass-through",
            Route::Gone => "gone",
        }
    }
}

struct Inner {
    name: String,
    size: u64,
    /// The core is a disk: fixed for the export's life, whatever the route (a disconnected
    /// cache's pass-through reaches the same disk).
    rotational: bool,
    // Each request holds the read side for its whole run; a switch takes the write side, which
    // parking_lot grants only once the readers in flight are done, and new readers queue behind
    // a waiting writer: that is the drain.
    route: RwLock<Route>,
    // Frozen requests sleep here (not holding `route`, so a switch can proceed).
    wake: Mutex<()>,
    woken: Condvar,
}

/// An exported volume's request target; clones share it.
#[derive(Clone)]
pub struct Target {
    inner: Arc<Inner>,
}

/// The route a request runs on, borrowed for the request's duration.
enum Via<'a> {
    Cache(&'a Core),
    Core(&'a VolumeRef),
}

impl From<Core> for Target {
    fn from(core: Core) -> Target {
        Target::new(core)
    }
}

impl Target {
    pub fn new(core: Core) -> Target {
        Target {
            inner: Arc::new(Inner {
                name: core.export_name(),
                size: core.size(),
                rotational: core.rotational(),
                route: RwLock::new(Route::Cache(core)),
                wake: Mutex::new(()),
                woken: Condvar::new(),
            }),
        }
    }

    /// The exported volume's size: the core's, whatever the route.
    pub fn size(&self) -> u64 {
        self.inner.size
    }

    /// Whether the core behind the export is a disk (the front-ends advertise it).
    pub fn rotational(&self) -> bool {
        self.inner.rotational
    }

    pub fn export_name(&self) -> String {
        self.inner.name.clone()
    }

    /// The current route's name (for `-L` and logs).
    pub fn route_name(&self) -> &'static str {
        self.inner.route.read().name()
    }

    /// Switch to `route` once the requests in flight are done; requests waiting on a frozen
    /// route go on along the new one. Returns the old route (dropping it releases its core
    /// handle or device).
    pub fn switch(&self, route: Route) -> Route {
        let old = std::mem::replace(&mut *self.inner.route.write(), route);
        // Taking `wake` orders this notify after a frozen request has started waiting (it
        // holds `wake` from before it let go of `route` until it sleeps).
        let _w = self.inner.wake.lock();
        self.inner.woken.notify_all();
        old
    }

    /// Run `f` on the current route, waiting while it is frozen.
    fn with<R>(&self, f: impl FnOnce(Via<'_>) -> Result<R, EngineError>) -> Result<R, EngineError> {
        loop {
            let route = self.inner.route.read();
            match &*route {
                Route::Cache(core) => return f(Via::Cache(core)),
                Route::PassThrough(volume) => return f(Via::Core(volume)),
                Route::Gone => return Err(EngineError::Stopped),
                Route::Frozen => {
                    let mut wake = self.inner.wake.lock();
                    drop(route);
                    self.inner.woken.wait(&mut wake);
                }
            }
        }
    }

    /// The checks the engine makes before it serves a request, made for pass-through too, so
    /// a client sees the same refusals on either route.
    fn check(&self, offset: u64, len: u64) -> Result<(), EngineError> {
        hybridcache_engine::check_request(self.inner.size, offset, len, None)
    }

    pub fn read(&self, buf: &mut [u8], offset: u64) -> Result<(), EngineError> {
        self.with(|via| match via {
            Via::Cache(c) => c.read(buf, offset),
            Via::Core(v) => {
                self.check(offset, buf.len() as u64)?;
                Ok(v.read_at(buf, offset)?)
            }
        })
    }

    pub fn read_batch(&self, reqs: &mut [(&mut [u8], u64)]) -> Vec<Result<(), EngineError>> {
        let n = reqs.len();
        let out = self.with(|via| {
            Ok(match via {
                Via::Cache(c) => c.read_batch(reqs),
                Via::Core(v) => reqs
                    .iter_mut()
                    .map(|(buf, offset)| {
                        self.check(*offset, buf.len() as u64)?;
                        Ok(v.read_at(buf, *offset)?)
                    })
                    .collect(),
            })
        });
        // Only a route that is gone fails the batch as a whole: each request fails as it would
        // alone.
        out.unwrap_or_else(|_| (0..n).map(|_| Err(EngineError::Stopped)).collect())
    }

    pub fn write(&self, buf: &[u8], offset: u64) -> Result<(), EngineError> {
        self.with(|via| match via {
            Via::Cache(c) => c.write(buf, offset),
            Via::Core(v) => {
                self.check(offset, buf.len() as u64)?;
                Ok(v.write_at(buf, offset)?)
            }
        })
    }

    pub fn write_batch(&self, reqs: &[(&[u8], u64)]) -> Vec<Result<(), EngineError>> {
        let n = reqs.len();
        let out = self.with(|via| {
            Ok(match via {
                Via::Cache(c) => c.write_batch(reqs),
                Via::Core(v) => reqs
                    .iter()
                    .map(|(buf, offset)| {
                        self.check(*offset, buf.len() as u64)?;
                        Ok(v.write_at(buf, *offset)?)
                    })
                    .collect(),
            })
        });
        // As for read batches: only a route that is gone fails the batch as a whole.
        out.unwrap_or_else(|_| (0..n).map(|_| Err(EngineError::Stopped)).collect())
    }

    pub fn write_fua(&self, buf: &[u8], offset: u64) -> Result<(), EngineError> {
        self.with(|via| match via {
            Via::Cache(c) => c.write_fua(buf, offset),
            Via::Core(v) => {
                self.check(offset, buf.len() as u64)?;
                v.write_at(buf, offset)?;
                Ok(v.flush()?)
            }
        })
    }

    pub fn flush(&self) -> Result<(), EngineError> {
        self.with(|via| match via {
            Via::Cache(c) => c.flush(),
            Via::Core(v) => Ok(v.flush()?),
        })
    }

    pub fn discard(&self, offset: u64, len: u64) -> Result<(), EngineError> {
        self.with(|via| match via {
            Via::Cache(c) => c.discard(offset, len),
            Via::Core(v) => {
                self.check(offset, len)?;
                Ok(v.discard(offset, len)?)
            }
        })
    }

    pub fn write_zeroes(&self, offset: u64, len: u64) -> Result<(), EngineError> {
        self.with(|via| match via {
            Via::Cache(c) => c.write_zeroes(offset, len),
            Via::Core(v) => {
                self.check(offset, len)?;
                Ok(v.write_zeroes(offset, len)?)
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hybridcache_engine::{Cache, CacheConfig, CacheMode, LineSize};
    use hybridcache_volume::{RamVolume, Volume};
    use std::time::Duration;

    fn cache_and_core() -> (Cache, VolumeRef, Target) {
        let cache_vol: VolumeRef = Arc::new(RamVolume::new("cache", 8 << 20).unwrap());
        let core_vol: VolumeRef = Arc::new(RamVolume::new("core", 4 << 20).unwrap());
        let cache = Cache::new(
            cache_vol,
            CacheConfig {
                id: 1,
                line_size: LineSize::from_kib(4).unwrap(),
                mode: CacheMode::Wb,
            },
        )
        .unwrap();
        let id = cache.add_core(core_vol.clone(), None).unwrap();
        let target = Target::new(cache.core(id).unwrap());
        (cache, core_vol, target)
    }

    #[test]
    fn a_frozen_request_runs_on_the_route_switched_to() {
        let (_cache, core_vol, target) = cache_and_core();
        target.switch(Route::Frozen);
        let t = target.clone();
        let writer = std::thread::spawn(move || t.write(&[7u8; 4096], 8192));
        std::thread::sleep(Duration::from_millis(100));
        assert!(!writer.is_finished(), "a frozen write must wait");
        target.switch(Route::PassThrough(core_vol.clone()));
        writer.join().unwrap().unwrap();
        let mut back = [0u8; 4096];
        core_vol.read_at(&mut back, 8192).unwrap();
        assert_eq!(back, [7u8; 4096]);
    }

    #[test]
    fn a_switch_hands_back_the_old_route_and_later_requests_take_the_new_one() {
        let (cache, core_vol, target) = cache_and_core();
        target.write(&[1u8; 4096], 0).unwrap();
        let old = target.switch(Route::PassThrough(core_vol.clone()));
        assert_eq!(old.name(), "cache");
        drop(old);
        cache.flush().unwrap();
        target.write(&[2u8; 4096], 4096).unwrap();
        let mut back = [0u8; 4096];
        core_vol.read_at(&mut back, 4096).unwrap();
        assert_eq!(back, [2u8; 4096]);
        assert!(matches!(
            target.read(&mut back, 4 << 20),
            Err(EngineError::OutOfRange { .. })
        ));
    }

    #[test]
    fn a_write_batch_follows_the_route() {
        let (cache, core_vol, target) = cache_and_core();
        let (a, b) = ([5u8; 4096], [6u8; 4096]);
        let res = target.write_batch(&[(&a[..], 0), (&b[..], 0), (&a[..], 4 << 20)]);
        assert!(res[0].is_ok() && res[1].is_ok(), "{res:?}");
        assert!(matches!(res[2], Err(EngineError::OutOfRange { .. })));
        let mut back = [0u8; 4096];
        target.read(&mut back, 0).unwrap();
        assert_eq!(back, b, "the later write of a batch wins");
        cache.flush().unwrap();
        target.switch(Route::PassThrough(core_vol.clone()));
        let res = target.write_batch(&[(&a[..], 8192), (&b[..], 8192), (&a[..], 4 << 20)]);
        assert!(res[0].is_ok() && res[1].is_ok(), "{res:?}");
        assert!(matches!(res[2], Err(EngineError::OutOfRange { .. })));
        core_vol.read_at(&mut back, 8192).unwrap();
        assert_eq!(back, b);
        target.switch(Route::Gone);
        let res = target.write_batch(&[(&a[..], 0), (&b[..], 4096)]);
        assert!(res.iter().all(|r| matches!(r, Err(EngineError::Stopped))));
    }

    /// A core whose writes take a while: a request stays in flight long enough to switch
    /// under it. Counts the writes that have begun.
    struct Slow(VolumeRef, Arc<std::sync::atomic::AtomicUsize>);

    impl Volume for Slow {
        fn name(&self) -> &str {
            self.0.name()
        }
        fn size(&self) -> u64 {
            self.0.size()
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> hybridcache_volume::Result<()> {
            self.0.read_at(buf, offset)
        }
        fn write_at(&self, buf: &[u8], offset: u64) -> hybridcache_volume::Result<()> {
            self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            std::thread::sleep(Duration::from_millis(300));
            self.0.write_at(buf, offset)
        }
        fn flush(&self) -> hybridcache_volume::Result<()> {
            self.0.flush()
        }
        fn discard(&self, offset: u64, len: u64) -> hybridcache_volume::Result<()> {
            self.0.discard(offset, len)
        }
    }

    #[test]
    fn a_switch_waits_for_the_request_in_flight_and_holds_those_after_it() {
        let (_cache, core_vol, target) = cache_and_core();
        let begun = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let slow: VolumeRef = Arc::new(Slow(core_vol.clone(), begun.clone()));
        target.switch(Route::PassThrough(slow));
        let t = target.clone();
        let first = std::thread::spawn(move || t.write(&[3u8; 4096], 0));
        // In flight once it has reached the core (a fixed sleep here lost the race on a loaded
        // 2-core machine: the switch came first and had nothing to wait for).
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while begun.load(std::sync::atomic::Ordering::SeqCst) == 0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the write never began"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        let began = std::time::Instant::now();
        let old = target.switch(Route::Frozen);
        // The switch returned only once the slow write was done: its data is on the core,
        // through the old route. (Whether the writer's thread has ended by then is a race.)
        let mut back = [0u8; 4096];
        core_vol.read_at(&mut back, 0).unwrap();
        assert_eq!(
            back, [3u8; 4096],
            "the switch must wait for the write in flight"
        );
        assert!(began.elapsed() >= Duration::from_millis(50));
        first.join().unwrap().unwrap();
        drop(old);
        // A request after the switch waits for the next route.
        let t = target.clone();
        let second = std::thread::spawn(move || t.write(&[4u8; 4096], 0));
        std::thread::sleep(Duration::from_millis(100));
        assert!(!second.is_finished());
        target.switch(Route::PassThrough(core_vol.clone()));
        second.join().unwrap().unwrap();
        core_vol.read_at(&mut back, 0).unwrap();
        assert_eq!(back, [4u8; 4096]);
    }

    #[test]
    fn a_gone_route_fails_waiting_requests() {
        let (_cache, _core_vol, target) = cache_and_core();
        target.switch(Route::Frozen);
        let t = target.clone();
        let reader = std::thread::spawn(move || {
            let mut buf = [0u8; 512];
            t.read(&mut buf, 0)
        });
        std::thread::sleep(Duration::from_millis(50));
        target.switch(Route::Gone);
        assert!(matches!(reader.join().unwrap(), Err(EngineError::Stopped)));
    }
}

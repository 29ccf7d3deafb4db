//! [`EmulatedVolume`]: a volume whose requests take as long as an emulated disk or RAID array
//! says, with the data kept in a backing volume (or dropped, for capacity-only benchmarks).
//!
//! A request copies its data to or from the backing volume at once, then the calling thread
//! sleeps until the model's completion time. Many threads may have requests in flight: the model
//! (one mutex) queues them on the disks' actuators, so the device behaves like the real one under
//! fio or the cache. Flushes and discards take no modelled time (the model has no volatile cache
//! to drain and no trim cost); write-zeroes is timed as the writes it replaces.

use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::{Condvar, Mutex};

use super::clock::{ClockRef, RealClock};
use super::hdd::HddConfig;
use super::raid::{Array, IoKind, Poll, RaidConfig};
use crate::{
    check_range, ErrorKind, FileVolume, NullVolume, Op, RamVolume, Result, Volume, VolumeError,
    VolumeRef,
};

/// What to emulate.
#[derive(Debug, Clone, PartialEq)]
pub enum EmulConfig {
    Hdd(HddConfig),
    Raid(RaidConfig),
}

impl EmulConfig {
    /// Usable bytes.
    pub fn capacity(&self) -> u64 {
        match self {
            EmulConfig::Hdd(c) => c.size,
            EmulConfig::Raid(c) => c.capacity(),
        }
    }

    pub fn validate(&self) -> std::result::Result<(), String> {
        match self {
            EmulConfig::Hdd(c) => c.validate(),
            EmulConfig::Raid(c) => c.validate(),
        }
    }

    pub(crate) fn model(&self) -> Array {
        match self {
            EmulConfig::Hdd(c) => Array::single(c),
            EmulConfig::Raid(c) => Array::raid(c),
        }
    }

    fn describe(&self) -> String {
        match self {
            EmulConfig::Hdd(c) => format!("emulated {} rpm disk", c.rpm),
            EmulConfig::Raid(c) => format!(
                "emulated RAID {} ({} x {} disks, {} rpm, strip {} KiB)",
                c.level.number(),
                c.groups,
                c.disks,
                c.disk.rpm,
                c.strip >> 10
            ),
        }
    }
}

/// Where an emulated device keeps its data.
#[derive(Clone)]
pub enum Backing {
    /// A lazily allocated RAM volume of the device's size.
    Ram,
    /// A sparse file of the device's size (created if missing).
    File(PathBuf),
    /// A volume of at least the device's size.
    Volume(VolumeRef),
    /// Nowhere: writes are dropped and reads return zeroes (capacity-only benchmarks).
    NoData,
}

impl Backing {
    /// Open the backing volume of a device `name` of `size` bytes, and return it with the
    /// device's name and `description`, both marked when the device keeps no data.
    pub(crate) fn open(
        self,
        name: &str,
        size: u64,
        mut description: String,
    ) -> Result<(VolumeRef, String, String)> {
        let keeps_data = !matches!(self, Backing::NoData);
        let backing: VolumeRef = match self {
            Backing::Ram => Arc::new(RamVolume::new(name, size)?),
            Backing::File(path) => Arc::new(FileVolume::create(&path, size)?),
            Backing::NoData => Arc::new(NullVolume::new(name, size)?),
            Backing::Volume(v) if v.size() < size => {
                let msg = format!(
                    "backing volume {} has {} bytes, the device needs {size}",
                    v.name(),
                    v.size()
                );
                return Err(VolumeError::new(
                    name,
                    Op::Open,
                    0,
                    0,
                    ErrorKind::Invalid(msg),
                ));
            }
            Backing::Volume(v) => v,
        };
        let mut name = name.to_string();
        if !keeps_data {
            if !name.contains("nodata") {
                name.push_str(",nodata");
            }
            description.push_str("; nodata: writes are dropped and reads return zeroes");
        }
        Ok((backing, name, description))
    }
}

/// An emulated disk or RAID array; see the module documentation.
pub struct EmulatedVolume {
    name: String,
    description: String,
    size: u64,
    model: Mutex<Model>,
    /// Where the driver waits: signalled when requests were settled (its own among them,
    /// perhaps) and when a new request may have brought the model's next event forward.
    drive: Condvar,
    clock: ClockRef,
    backing: VolumeRef,
    keeps_data: bool,
    /// `HYBRIDCACHE_EMUL_TRACE=PATH`: every request as the model sees it, for diagnosing the
    /// model through a transport (see [`Trace`]).
    trace: Option<Trace>,
}

/// The model and who drives it on the real clock.
struct Model {
    array: Array,
    /// A thread waits with a timeout for the model's next event to make its decisions; the
    /// others wait until requests are settled. Without one driver, every waiting thread woke at
    /// every event of the array (each disk's dispatch, each window) to find its own request
    /// still pending: with 32 requests waiting that kept a small machine's CPUs busy and
    /// delayed the replies and the next requests by milliseconds.
    driver: bool,
    /// When the driver, waiting on the condition, wakes by itself (0 while it is not waiting):
    /// a new request wakes it earlier only if it brings the model's next event before that.
    driver_until: u64,
    /// The other waiting threads, by request: each is unparked when its request is settled
    /// (with its completion time in its slot), or to take over as the driver.
    waiters: HashMap<u64, Arc<Waiter>>,
}

/// A thread waiting for its request, and where it finds the request's completion time once
/// settled (0 until then), so that a stripe's 32 writes, settled together, do not all take the
/// model's lock again to learn it.
struct Waiter {
    thread: std::thread::Thread,
    done: std::sync::atomic::AtomicU64,
}

impl Model {
    /// Hand the requests settled since the last call to their waiting threads (forgotten by the
    /// model, their completion times in the threads' slots) and wake them. Requests whose
    /// threads do not wait yet stay in the model for their own poll.
    fn wake_settled(&mut self) {
        for op in self.array.take_settled() {
            if let Some(w) = self.waiters.remove(&op) {
                match self.array.take_done(op) {
                    Some(t) => w.done.store(t.max(1), std::sync::atomic::Ordering::Release),
                    None => {
                        self.waiters.insert(op, w);
                        continue;
                    }
                }
                w.thread.unpark();
            }
        }
    }

    /// Whether the waiting driver must wake before its time: the model's next event (a new
    /// request's, or a settled stripe's disk writes) is due earlier.
    fn driver_late(&self) -> bool {
        self.driver_until != 0 && self.array.next_wake() < self.driver_until
    }
}

impl std::ops::Deref for Model {
    type Target = Array;
    fn deref(&self) -> &Array {
        &self.array
    }
}

impl std::ops::DerefMut for Model {
    fn deref_mut(&mut self) -> &mut Array {
        &mut self.array
    }
}

/// A request log of an emulated device, one line per request: `start_ns kind offset len
/// done_ns` (times on the device's clock, kind `R` or `W`), then on every flush and at the end a
/// `# merges full N expired M polls P` line (the array's merge windows so far, and how often
/// waiting threads polled it). Written through a
/// buffer, so it perturbs timing by little; enabled only by the environment variable.
struct Trace {
    out: Mutex<std::io::BufWriter<std::fs::File>>,
}

/// How long before a model event a waiting request stops waiting for other requests and waits
/// for the clock alone (which spins this last stretch).
const WAKE_MARGIN: u64 = super::clock::SPIN_BELOW;

/// The environment variable that turns on an emulated device's [`Trace`].
pub const TRACE_ENV: &str = "HYBRIDCACHE_EMUL_TRACE";

impl Trace {
    fn from_env() -> Option<Trace> {
        let path = std::env::var_os(TRACE_ENV)?;
        let file = std::fs::File::create(path).ok()?;
        Some(Trace {
            out: Mutex::new(std::io::BufWriter::with_capacity(1 << 20, file)),
        })
    }

    fn request(&self, start: u64, kind: IoKind, offset: u64, len: u64, done: u64) {
        use std::io::Write as _;
        let k = if kind == IoKind::Read { 'R' } else { 'W' };
        let _ = writeln!(self.out.lock(), "{start} {k} {offset} {len} {done}");
    }

    fn merges(&self, m: &Array) {
        use std::io::Write as _;
        let (full, expired) = m.merge_counts();
        let mut out = self.out.lock();
        let _ = writeln!(
            out,
            "# merges full {full} expired {expired} polls {}",
            m.polls()
        );
        let _ = out.flush();
    }
}

impl Drop for EmulatedVolume {
    fn drop(&mut self) {
        if let Some(t) = &self.trace {
            t.merges(&self.model.lock());
        }
    }
}

impl EmulatedVolume {
    /// Emulate `config` on the real clock.
    pub fn new(name: &str, config: &EmulConfig, backing: Backing) -> Result<EmulatedVolume> {
        Self::with_clock(name, config, backing, RealClock::shared())
    }

    /// Emulate `config` on `clock`. A device that drops its data says `nodata` in its name.
    pub fn with_clock(
        name: &str,
        config: &EmulConfig,
        backing: Backing,
        clock: ClockRef,
    ) -> Result<EmulatedVolume> {
        let invalid = |msg: String| VolumeError::new(name, Op::Open, 0, 0, ErrorKind::Invalid(msg));
        config.validate().map_err(invalid)?;
        let size = config.capacity();
        let keeps_data = !matches!(backing, Backing::NoData);
        let (backing, name, description) = backing.open(name, size, config.describe())?;
        Ok(EmulatedVolume {
            name,
            description,
            size,
            model: Mutex::new(Model {
                array: config.model(),
                driver: false,
                driver_until: 0,
                waiters: HashMap::new(),
            }),
            drive: Condvar::new(),
            clock,
            backing,
            keeps_data,
            trace: Trace::from_env(),
        })
    }

    /// What is emulated, and whether data is kept.
    pub fn description(&self) -> &str {
        &self.description
    }

    /// Whether data written can be read back.
    pub fn keeps_data(&self) -> bool {
        self.keeps_data
    }

    /// Time each member disk's actuator has been busy so far.
    pub fn disk_busy(&self) -> Vec<std::time::Duration> {
        self.model.lock().disk_busy()
    }

    /// Start the request in the model, run `f` (the data copy), then wait for the completion.
    /// A request waiting in a merge window waits for its window's end or for another request to
    /// fill its stripe, whichever comes first: the one that fills it wakes the waiters, so a
    /// merged write completes when the stripe is written, not when the window would have ended.
    fn timed<T>(&self, kind: IoKind, offset: u64, len: u64, f: impl FnOnce() -> T) -> T {
        use std::sync::atomic::Ordering;
        thread_local! {
            static WAITER: Arc<Waiter> = Arc::new(Waiter {
                thread: std::thread::current(),
                done: std::sync::atomic::AtomicU64::new(0),
            });
        }
        let waiter = WAITER.with(Arc::clone);
        waiter.done.store(0, Ordering::Relaxed);
        let start = self.clock.now();
        let op = {
            let mut m = self.model.lock();
            let op = m.start(start, kind, offset, len);
            m.wake_settled();
            if m.driver_late() {
                self.drive.notify_one();
            }
            op
        };
        let r = f();
        let mut driving = false;
        let finish = |t: u64| {
            if let Some(trace) = &self.trace {
                trace.request(start, kind, offset, len, t);
            }
            self.clock.sleep_until(t);
        };
        loop {
            let mut m = self.model.lock();
            if driving {
                m.driver_until = 0;
            }
            // Settled while this thread waited (or woke spuriously): the model has forgotten it.
            let settled = waiter.done.load(Ordering::Acquire);
            if settled != 0 {
                // Only a listed waiter's request is settled into its slot, and the driver is
                // not listed (below): leaving here never takes the role away.
                debug_assert!(!driving, "the driver's request settled into its slot");
                drop(m);
                finish(settled);
                return r;
            }
            let p = m.poll(self.clock.now(), op);
            m.wake_settled();
            if m.driver_late() {
                self.drive.notify_one();
            }
            match p {
                Poll::Done(t) => {
                    m.waiters.remove(&op);
                    if driving {
                        m.driver = false;
                        m.driver_until = 0;
                    }
                    if !m.driver {
                        // Another waiting thread drives the model now. Also when this thread
                        // was only handed the role and found its own request done: else, with
                        // no new request coming (a client at the end of its run), the rest
                        // would wait for a driver forever.
                        let next = m.waiters.keys().next().copied();
                        if let Some(w) = next.and_then(|o| m.waiters.remove(&o)) {
                            w.thread.unpark();
                        }
                    }
                    drop(m);
                    finish(t);
                    return r;
                }
                Poll::Pending(t) if self.clock.is_virtual() => {
                    drop(m);
                    self.clock.sleep_until(t);
                }
                Poll::Pending(_) if m.driver && !driving => {
                    // The driver makes the decisions due; wait until this request is settled
                    // (its completion time then in the slot) or the driver leaves. An unpark
                    // before the park is not lost.
                    m.waiters.insert(op, waiter.clone());
                    drop(m);
                    std::thread::park();
                    let settled = waiter.done.load(Ordering::Acquire);
                    if settled != 0 {
                        finish(settled);
                        return r;
                    }
                }
                Poll::Pending(t) => {
                    // Woken with nobody having asked (a scope's end wakes its owner thread),
                    // this thread may still be listed as waiting: it must not be, or another
                    // thread could settle its request into its slot while it drives, and it
                    // would leave with the role (every later request then waits forever).
                    m.waiters.remove(&op);
                    m.driver = true;
                    driving = true;
                    // Wait on the condition until shortly before `t`, then on the clock, which
                    // spins the last stretch (a timed wait overshoots).
                    let now = self.clock.now();
                    if t > now + WAKE_MARGIN {
                        super::clock::precise_timers();
                        m.driver_until = t - WAKE_MARGIN;
                        let d = std::time::Duration::from_nanos(t - now - WAKE_MARGIN);
                        let _ = self.drive.wait_for(&mut m, d);
                    } else {
                        m.driver_until = t;
                        drop(m);
                        self.clock.sleep_until(t);
                    }
                }
            }
        }
    }
}

impl Volume for EmulatedVolume {
    fn name(&self) -> &str {
        &self.name
    }
    fn size(&self) -> u64 {
        self.size
    }
    /// Every emulated array is of disks (SSDs are [`SsdVolume`](super::ssd::SsdVolume)).
    fn rotational(&self) -> bool {
        true
    }
    fn read_at(&self, buf: &mut [u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        check_range(self, Op::Read, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.timed(IoKind::Read, offset, len, || {
            self.backing.read_at(buf, offset)
        })
    }
    fn write_at(&self, buf: &[u8], offset: u64) -> Result<()> {
        let len = buf.len() as u64;
        check_range(self, Op::Write, offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.timed(IoKind::Write, offset, len, || {
            self.backing.write_at(buf, offset)
        })
    }
    fn flush(&self) -> Result<()> {
        if let Some(t) = &self.trace {
            t.merges(&self.model.lock());
        }
        self.backing.flush()
    }
    fn discard(&self, offset: u64, len: u64) -> Result<()> {
        check_range(self, Op::Discard, offset, len)?;
        self.backing.discard(offset, len)
    }
    fn discard_zeroes(&self) -> bool {
        self.backing.discard_zeroes()
    }
}

impl fmt::Debug for EmulatedVolume {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("EmulatedVolume")
            .field("name", &self.name)
            .field("description", &self.description)
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emul::clock::{Clock, VirtualClock};
    use crate::emul::raid::RaidLevel;

    fn configs() -> Vec<EmulConfig> {
        let disk = HddConfig::new(64 << 20, 7200);
        let mut out = vec![EmulConfig::Hdd(disk.clone())];
        for (level, groups, disks) in [
            (RaidLevel::Raid0, 1, 4),
            (RaidLevel::Raid1, 1, 2),
            (RaidLevel::Raid10, 2, 2),
            (RaidLevel::Raid5, 1, 4),
            (RaidLevel::Raid6, 1, 5),
            (RaidLevel::Raid50, 2, 3),
            (RaidLevel::Raid60, 2, 4),
        ] {
            let mut c = RaidConfig::new(level, groups, disks, 64 << 10, disk.clone());
            c.merge_window = Some(std::time::Duration::from_micros(500));
            c.stripe_cache = 4;
            out.push(EmulConfig::Raid(c));
        }
        out
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn data_round_trips_through_every_device() {
        for cfg in configs() {
            let clock = Arc::new(VirtualClock::new());
            let v = EmulatedVolume::with_clock("dev", &cfg, Backing::Ram, clock.clone()).unwrap();
            assert_eq!(v.size(), cfg.capacity());
            // Small, strip-crossing and stripe-crossing writes.
            for (i, (off, len)) in [(0, 4096), (60 << 10, 8192), (1 << 20, 600 << 10)]
                .into_iter()
                .enumerate()
            {
                let data = pattern(len, i as u8);
                v.write_at(&data, off).unwrap();
                let mut back = vec![0; len];
                v.read_at(&mut back, off).unwrap();
                assert_eq!(back, data, "{cfg:?} at {off}");
            }
            assert!(clock.now() > 0, "time passed on {cfg:?}");
        }
    }

    #[test]
    fn nodata_drops_data_and_says_so() {
        let cfg = &configs()[0];
        let clock = Arc::new(VirtualClock::new());
        let v = EmulatedVolume::with_clock("hdd", cfg, Backing::NoData, clock).unwrap();
        assert!(v.name().contains("nodata"));
        assert!(v.description().contains("reads return zeroes"));
        assert!(!v.keeps_data());
        v.write_at(&[9; 4096], 0).unwrap();
        let mut b = [1; 4096];
        v.read_at(&mut b, 0).unwrap();
        assert_eq!(b, [0; 4096]);
    }

    #[test]
    fn bad_config_is_rejected_with_the_parameter_named() {
        let mut c = RaidConfig::new(
            RaidLevel::Raid6,
            1,
            3,
            64 << 10,
            HddConfig::new(1 << 30, 7200),
        );
        let e =
            EmulatedVolume::new("r", &EmulConfig::Raid(c.clone()), Backing::NoData).unwrap_err();
        assert!(e.to_string().contains("disks 3 out of range 4..=64"), "{e}");
        c.disks = 6;
        c.groups = 2;
        let e = EmulatedVolume::new("r", &EmulConfig::Raid(c), Backing::NoData).unwrap_err();
        assert!(e.to_string().contains("groups 2 must be 1"), "{e}");
    }

    #[test]
    fn the_last_requests_complete_when_no_new_ones_come() {
        // Rounds of many threads, each with one write, and nothing after it: what fio does at
        // the end of a job. The driver's role must pass to a thread that still waits, even when
        // the thread it is handed to finds its own request done and leaves.
        let cfg = EmulConfig::Raid(RaidConfig::study_raid60(1 << 40));
        let v = Arc::new(EmulatedVolume::new("raid", &cfg, Backing::NoData).unwrap());
        let (tx, rx) = std::sync::mpsc::channel();
        let worker = {
            let v = v.clone();
            std::thread::spawn(move || {
                for round in 0..40u64 {
                    let threads: Vec<_> = (0..48u64)
                        .map(|t| {
                            let v = v.clone();
                            std::thread::spawn(move || {
                                let x = (round * 48 + t).wrapping_mul(0x9e37_79b9_7f4a_7c15);
                                v.write_at(&[0; 4096], (x % (v.size() / 4096)) * 4096)
                                    .unwrap();
                            })
                        })
                        .collect();
                    for t in threads {
                        t.join().unwrap();
                    }
                }
                let _ = tx.send(());
            })
        };
        assert!(
            rx.recv_timeout(std::time::Duration::from_secs(60)).is_ok(),
            "requests still waiting after 60 s: nobody drives the model"
        );
        worker.join().unwrap();
    }

    #[test]
    fn a_woken_waiter_that_drives_does_not_leave_with_the_role() {
        // A waiting thread can wake with nobody having asked: `std::thread::scope` wakes its
        // owner as each scoped thread ends, and cleaning's owner thread also writes. Woken so
        // while no thread drove, it took the driver's role still listed among the waiters; a
        // new request then settled its write into its slot, and it left with the role: every
        // later request waited for a driver forever (a full cache cleaning through 44 threads
        // hung this way, issue 20). The steps, in order: a driver is said to exist; a write
        // waits, queued behind another; the driver is gone and the waiter wakes; it drives; a
        // new request arrives after its write is done, before it looks.
        let cfg = &configs()[0];
        let v = Arc::new(EmulatedVolume::new("hdd", cfg, Backing::NoData).unwrap());
        {
            // A long write ahead (about 0.3 s on this disk; nobody waits for it), so that the
            // next one is still queued when it wakes, even on a loaded machine.
            let mut m = v.model.lock();
            m.driver = true;
            let now = v.clock.now();
            m.start(now, IoKind::Write, 0, 60 << 20);
        }
        let writer = {
            let v = v.clone();
            std::thread::spawn(move || v.write_at(&[0; 4096], 62 << 20).unwrap())
        };
        let until = |what: &str, f: &dyn Fn(&Model) -> bool| {
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
            while !f(&v.model.lock()) {
                assert!(std::time::Instant::now() < deadline, "{what}");
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
        };
        until("the write waits", &|m| m.waiters.len() == 1);
        {
            let mut m = v.model.lock();
            m.driver = false;
            writer.thread().unpark();
        }
        until("the woken waiter drives", &|m| m.driver);
        {
            let mut m = v.model.lock();
            // Long enough for both writes to be done.
            std::thread::sleep(std::time::Duration::from_secs(1));
            let now = v.clock.now();
            m.start(now, IoKind::Read, 0, 4096);
            m.wake_settled();
        }
        writer.join().unwrap();
        assert!(
            !v.model.lock().driver,
            "the write left with the driver's role: nobody drives the next requests"
        );
    }

    #[test]
    fn waiting_threads_do_not_all_wake_at_every_event() {
        // 32 threads of random 4 KiB writes on the study's array, in real time: each request
        // waits tens of milliseconds through many events of the 40 disks (dispatches, windows).
        // One thread drives those events; each other one polls when its own request is settled,
        // so polls stay a few per request (4 to 6 here): 57 when every waiter woke at every
        // event, 22 when every waiter woke at every settled request.
        let cfg = EmulConfig::Raid(RaidConfig::study_raid60(1 << 40));
        let v = Arc::new(EmulatedVolume::new("raid", &cfg, Backing::NoData).unwrap());
        let per_thread = 4u64;
        let threads: Vec<_> = (0..32u64)
            .map(|t| {
                let v = v.clone();
                std::thread::spawn(move || {
                    let mut x = t.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
                    for _ in 0..per_thread {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        v.write_at(&[0; 4096], (x % (v.size() / 4096)) * 4096)
                            .unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let polls = v.model.lock().polls();
        let per_request = polls as f64 / (32 * per_thread) as f64;
        assert!(per_request < 15.0, "{per_request:.1} polls per request");
    }

    #[test]
    fn real_threads_share_one_disk() {
        // Four threads, one 15000 rpm disk, random 4 KiB reads: each takes milliseconds, and the
        // actuator serialises them, so 4 x 3 requests take at least 12 service times' worth.
        let disk = HddConfig::new(1 << 30, 15000);
        let v =
            Arc::new(EmulatedVolume::new("hdd", &EmulConfig::Hdd(disk), Backing::NoData).unwrap());
        let start = std::time::Instant::now();
        let threads: Vec<_> = (0..4u64)
            .map(|t| {
                let v = v.clone();
                std::thread::spawn(move || {
                    let mut b = [0; 4096];
                    for i in 0..3u64 {
                        v.read_at(&mut b, ((t * 7919 + i * 104729) % 200_000) * 4096)
                            .unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let busy: std::time::Duration = v.disk_busy().into_iter().sum();
        assert!(busy > std::time::Duration::from_millis(12), "{busy:?}");
        assert!(start.elapsed() >= busy, "{:?} < {busy:?}", start.elapsed());
    }
}

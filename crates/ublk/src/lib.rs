//! A ublk server: serves any [`BlockBackend`] as a Linux block device, `/dev/ublkbN`, through the
//! kernel's ublk driver (`ublk_drv`, Linux 6.0 and later), built on `libublk`.
//!
//! Front-end only: nothing here knows about caching. The daemon wraps an exported volume in a
//! [`BlockBackend`] and calls [`serve`].
//!
//! How a queue works. The driver hands requests to one io_uring per queue, on a thread of its
//! own (libublk's queue thread). The backend is blocking (a cache may wait for a slow core), so
//! the queue thread never calls it: it passes each request to a pool of worker threads and goes
//! back to the ring at once, so a queue keeps up to `workers_per_queue` requests in the backend
//! at the same time instead of serialising behind the slowest one. A worker that finishes puts
//! `(tag, result)` on the queue's completion list and writes an eventfd; the queue thread keeps
//! a read of that eventfd posted on its ring, so the same `io_uring_enter` that waits for new
//! requests also wakes up for completions, and commits them to the driver (which fetches the
//! tag's next request in the same command).
//!
//! Each tag owns one data buffer of `max_io_bytes`: the driver copies a write's data into it
//! before handing the request over and copies a read's data out of it on commit, so a buffer is
//! touched by exactly one party at a time: the driver, the queue thread, or the one worker
//! serving that tag.

use libublk::ctrl::{UblkCtrl, UblkCtrlBuilder};
use libublk::io::{BufDescList, UblkDev, UblkIOCtx, UblkQueue};
use libublk::{sys, BufDesc, UblkFlags, UblkIORes};
use parking_lot::Mutex;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::mpsc;
use std::sync::Arc;

/// What a device serves: a byte-addressed volume with blocking calls. Offsets and lengths are
/// multiples of the logical block (512 bytes) and inside [`BlockBackend::size`]; the server
/// checks that before calling.
pub trait BlockBackend: Send + Sync + 'static {
    /// Size in bytes (a multiple of 512).
    fn size(&self) -> u64;
    /// Fill `buf` from `offset`.
    fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Write `buf` at `offset`; with `fua` the data must be durable when this returns.
    fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()>;
    /// Make every completed write durable.
    fn flush(&self) -> io::Result<()>;
    /// The range's contents are no longer needed; reads may return anything until rewritten.
    fn discard(&self, offset: u64, len: u64) -> io::Result<()>;
    /// The range reads back as zeroes afterwards.
    fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()>;
}

/// Shape of one device. [`DeviceConfig::default`] gives what the issue asks for: one queue per
/// CPU, depth 128, 4 KiB physical blocks.
#[derive(Debug, Clone)]
pub struct DeviceConfig {
    /// Number of hardware queues; `None`: one per CPU.
    pub queues: Option<u16>,
    /// Requests in flight per queue (the ublk tags), at most 4096 (the driver's limit).
    pub depth: u16,
    /// Physical block size in bytes (a power of two, 512..=65536); the daemon uses the cache
    /// line size. The logical block size is always 512.
    pub physical_block: u32,
    /// Largest request in bytes (a multiple of 4096); bigger IO is split by the kernel.
    pub max_io_bytes: u32,
    /// Worker threads per queue calling the backend: the requests a queue can have inside the
    /// backend at once.
    pub workers_per_queue: usize,
    /// Device id to ask for (`/dev/ublkbN`); `None`: the driver picks one.
    pub id: Option<u32>,
    /// `UBLK_F_USER_RECOVERY` with `_REISSUE`: when the serving process dies, the kernel keeps
    /// the block device and holds its requests (re-issuing those that were in flight) until a
    /// new process takes the device over with [`recover`].
    pub user_recovery: bool,
    /// Tell the kernel the device is rotational (`queue/rotational` 1), as a disk behind the
    /// server would be.
    pub rotational: bool,
}

impl Default for DeviceConfig {
    fn default() -> Self {
        DeviceConfig {
            queues: None,
            depth: 128,
            physical_block: 4096,
            max_io_bytes: 512 * 1024,
            workers_per_queue: 32,
            id: None,
            user_recovery: false,
            rotational: false,
        }
    }
}

/// Errors of [`serve`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("invalid device configuration: {0}")]
    Config(String),
    #[error("ublk: {0}")]
    Ublk(String),
    #[error("{0}")]
    Io(#[from] io::Error),
}

impl From<libublk::UblkError> for Error {
    fn from(e: libublk::UblkError) -> Self {
        Error::Ublk(e.to_string())
    }
}

/// What a caller learns once the device is live.
#[derive(Debug, Clone)]
pub struct Started {
    pub dev_id: u32,
    /// `/dev/ublkbN`
    pub block_device: String,
    pub queues: u16,
    pub depth: u16,
}

impl DeviceConfig {
    fn check(&self, size: u64) -> Result<(), Error> {
        let bad = |m: String| Err(Error::Config(m));
        if size == 0 || !size.is_multiple_of(512) {
            return bad(format!("size {size} is not a positive multiple of 512"));
        }
        if self.depth == 0 || self.depth > 4096 {
            return bad(format!("depth {} is outside 1..=4096", self.depth));
        }
        if !self.physical_block.is_power_of_two() || !(512..=65536).contains(&self.physical_block) {
            return bad(format!(
                "physical block {} is not a power of two in 512..=65536",
                self.physical_block
            ));
        }
        if self.max_io_bytes < 4096 || !self.max_io_bytes.is_multiple_of(4096) {
            return bad(format!(
                "max IO size {} is not a multiple of 4096",
                self.max_io_bytes
            ));
        }
        if self.workers_per_queue == 0 {
            return bad("workers per queue must be at least 1".into());
        }
        if self.queues == Some(0) {
            return bad("queues must be at least 1".into());
        }
        Ok(())
    }

    fn nr_queues(&self) -> u16 {
        self.queues.unwrap_or_else(|| {
            std::thread::available_parallelism()
                .map(|n| n.get().min(u16::MAX as usize) as u16)
                .unwrap_or(1)
        })
    }
}

/// Creates the device, serves it until it is stopped (see [`stop`]), then deletes it.
/// `started` is called once `/dev/ublkbN` exists and takes IO.
pub fn serve<B, F>(backend: Arc<B>, config: DeviceConfig, started: F) -> Result<(), Error>
where
    B: BlockBackend,
    F: FnOnce(&Started) + Send + Sync + 'static,
{
    config.check(backend.size())?;
    let flags = if config.user_recovery {
        (sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE) as u64
    } else {
        0
    };
    let ctrl = UblkCtrlBuilder::default()
        .name("hybridcache")
        .id(config.id.map(|i| i as i32).unwrap_or(-1))
        .nr_queues(config.nr_queues())
        .depth(config.depth)
        .io_buf_bytes(config.max_io_bytes)
        .ctrl_flags(flags)
        .dev_flags(UblkFlags::UBLK_DEV_F_ADD_DEV)
        .build()?;
    run(ctrl, backend, config, started)
}

/// Takes over device `dev_id`, created by [`serve`] with `user_recovery` by a process that has
/// died: the kernel kept `/dev/ublkbN` and its pending requests, which this process now serves
/// (queues, depth and limits are the device's own; `config` gives the workers per queue).
/// Serves until the device is stopped, then deletes it.
pub fn recover<B, F>(
    dev_id: u32,
    backend: Arc<B>,
    config: DeviceConfig,
    started: F,
) -> Result<(), Error>
where
    B: BlockBackend,
    F: FnOnce(&Started) + Send + Sync + 'static,
{
    config.check(backend.size())?;
    // START_USER_RECOVERY; libublk retries while the dead server's descriptors are still
    // being released (EBUSY).
    let old = UblkCtrl::new_simple(dev_id as i32)?;
    old.start_user_recover()?;
    let info = old.dev_info();
    old.disown();
    drop(old);
    // The builder sizes its per-queue tables from these, not from the device.
    let ctrl = UblkCtrlBuilder::default()
        .name("hybridcache")
        .id(dev_id as i32)
        .nr_queues(info.nr_hw_queues)
        .depth(info.queue_depth)
        .io_buf_bytes(info.max_io_buf_bytes)
        .ctrl_flags(info.flags)
        .dev_flags(UblkFlags::UBLK_DEV_F_RECOVER_DEV)
        .build()?;
    let result = run(ctrl, backend, config, started);
    // A recovering handle does not delete the device when dropped, as one that added it does.
    if let Ok(ctrl) = UblkCtrl::new_simple(dev_id as i32) {
        let _ = ctrl.del_dev();
    }
    result
}

fn run<B, F>(ctrl: UblkCtrl, backend: Arc<B>, config: DeviceConfig, started: F) -> Result<(), Error>
where
    B: BlockBackend,
    F: FnOnce(&Started) + Send + Sync + 'static,
{
    let size = backend.size();

    let physical_shift = config.physical_block.trailing_zeros() as u8;
    let max_sectors = config.max_io_bytes >> 9;
    let rotational = config.rotational;
    let tgt_init = move |dev: &mut UblkDev| {
        dev.tgt.dev_size = size;
        dev.tgt.params = sys::ublk_params {
            types: sys::UBLK_PARAM_TYPE_BASIC | sys::UBLK_PARAM_TYPE_DISCARD,
            basic: sys::ublk_param_basic {
                // A volatile cache makes the kernel send flushes; FUA lets a journal commit
                // ask for one durable write instead of a write and a flush.
                attrs: sys::UBLK_ATTR_VOLATILE_CACHE
                    | sys::UBLK_ATTR_FUA
                    | if rotational {
                        sys::UBLK_ATTR_ROTATIONAL
                    } else {
                        0
                    },
                logical_bs_shift: 9,
                physical_bs_shift: physical_shift,
                io_opt_shift: physical_shift,
                io_min_shift: physical_shift,
                max_sectors,
                dev_sectors: size >> 9,
                ..Default::default()
            },
            discard: sys::ublk_param_discard {
                discard_granularity: 1 << physical_shift,
                max_discard_sectors: max_sectors,
                max_write_zeroes_sectors: max_sectors,
                max_discard_segments: 1,
                ..Default::default()
            },
            ..Default::default()
        };
        Ok(())
    };

    let workers = config.workers_per_queue;
    let q_fn = move |qid: u16, dev: &UblkDev| {
        if let Err(e) = run_queue(qid, dev, backend.clone(), workers) {
            eprintln!("ublk: queue {qid} stopped: {e}");
        }
    };
    let on_started = move |ctrl: &UblkCtrl| {
        let info = ctrl.dev_info();
        started(&Started {
            dev_id: info.dev_id,
            block_device: ctrl.get_bdev_path(),
            queues: info.nr_hw_queues,
            depth: info.queue_depth,
        });
    };
    ctrl.run_target(tgt_init, q_fn, on_started)?;
    Ok(())
}

/// Stops device `dev_id` from any thread or process: its queues end, and the [`serve`] serving
/// it deletes the device and returns.
pub fn stop(dev_id: u32) -> Result<(), Error> {
    let ctrl = UblkCtrl::new_simple(dev_id as i32)?;
    ctrl.kill_dev()?;
    // The handle was opened, not created, here: dropping it must not delete the device
    // under the serving process, which does that itself once its queues are down.
    ctrl.disown();
    Ok(())
}

/// Deletes device `dev_id` that no process serves any more (a server died and nobody will
/// recover it): the driver fails its held requests, and `/dev/ublkbN` goes away.
pub fn delete(dev_id: u32) -> Result<(), Error> {
    let ctrl = UblkCtrl::new_simple(dev_id as i32)?;
    // A quiesced device must be stopped before it can be deleted; one already stopped says so.
    let _ = ctrl.kill_dev();
    ctrl.del_dev()?;
    Ok(())
}

/// Whether device `dev_id` exists (its control node is there).
pub fn exists(dev_id: u32) -> bool {
    std::path::Path::new(&format!("/dev/ublkc{dev_id}")).exists()
        || std::path::Path::new(&format!("/sys/class/ublk-char/ublkc{dev_id}")).exists()
}

/// Whether device `dev_id` is one a dead server left behind for [`recover`]: it exists, was
/// created with `user_recovery`, and the process that served it is gone (or the kernel has
/// already quiesced it). A device that a live process serves is never one: whoever remembers
/// an id must not take over or delete a device that another program got under the same id.
pub fn orphaned(dev_id: u32) -> bool {
    if !exists(dev_id) {
        return false;
    }
    let Ok(ctrl) = UblkCtrl::new_simple(dev_id as i32) else {
        return false;
    };
    let info = ctrl.dev_info();
    // Opened, not created, here: dropping it must leave the device alone.
    ctrl.disown();
    let recoverable = info.flags & sys::UBLK_F_USER_RECOVERY as u64 != 0;
    let quiesced = info.state == sys::UBLK_S_DEV_QUIESCED as u16;
    // The kernel quiesces a device some time after its server dies (a monitor runs every few
    // seconds), so a LIVE device whose server no longer exists counts as well.
    // SAFETY: kill with signal 0 only checks whether the process exists.
    let gone = info.ublksrv_pid <= 0
        || (unsafe { libc::kill(info.ublksrv_pid, 0) } != 0
            && io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH));
    recoverable && (quiesced || gone)
}

/// One request as a worker sees it.
struct Job {
    tag: u16,
    op: u32,
    fua: bool,
    offset: u64,
    len: usize,
    buf: BufPtr,
}

/// The tag's data buffer, lent to the worker serving that tag.
struct BufPtr(*mut u8);
// SAFETY: the buffer is owned by the queue (alive until the workers are joined), and while a job
// is out only the one worker serving that tag touches it (see the module comment).
unsafe impl Send for BufPtr {}

/// A request's result for the driver: bytes done for reads and writes, 0 for the rest, or a
/// negative errno.
fn execute<B: BlockBackend>(backend: &B, job: &Job) -> i32 {
    // A flush has no range: the driver leaves its start sector undefined (all ones, in 6.12).
    if job.op != sys::UBLK_IO_OP_FLUSH {
        let end = job.offset.checked_add(job.len as u64);
        if end.is_none_or(|e| e > backend.size()) {
            return -libc::EINVAL;
        }
    }
    let res = match job.op {
        sys::UBLK_IO_OP_READ => {
            // SAFETY: see BufPtr; len <= max_io_bytes, the buffer's size (checked by the caller).
            let buf = unsafe { std::slice::from_raw_parts_mut(job.buf.0, job.len) };
            backend.read_at(buf, job.offset)
        }
        sys::UBLK_IO_OP_WRITE => {
            // SAFETY: as above.
            let buf = unsafe { std::slice::from_raw_parts(job.buf.0, job.len) };
            backend.write_at(buf, job.offset, job.fua)
        }
        sys::UBLK_IO_OP_FLUSH => backend.flush(),
        sys::UBLK_IO_OP_DISCARD => backend.discard(job.offset, job.len as u64),
        sys::UBLK_IO_OP_WRITE_ZEROES => backend.write_zeroes(job.offset, job.len as u64),
        _ => return -libc::EOPNOTSUPP,
    };
    match res {
        Ok(()) if matches!(job.op, sys::UBLK_IO_OP_READ | sys::UBLK_IO_OP_WRITE) => job.len as i32,
        Ok(()) => 0,
        Err(e) => -e.raw_os_error().filter(|&n| n > 0).unwrap_or(libc::EIO),
    }
}

/// The tag-less user data of the eventfd read: marked as target IO, so libublk hands its CQE
/// to our handler instead of treating it as a driver command.
const WAKE_OP: u32 = 0xfe;

fn run_queue<B: BlockBackend>(
    qid: u16,
    dev: &UblkDev,
    backend: Arc<B>,
    workers: usize,
) -> Result<(), Error> {
    // SAFETY: eventfd returns a new descriptor or -1.
    let raw = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if raw < 0 {
        return Err(io::Error::last_os_error().into());
    }
    // SAFETY: raw is a descriptor we own from here on.
    let efd = Arc::new(unsafe { OwnedFd::from_raw_fd(raw) });
    let done: Arc<Mutex<Vec<(u16, i32)>>> = Arc::new(Mutex::new(Vec::new()));
    let (tx, rx) = mpsc::channel::<Job>();
    let rx = Arc::new(Mutex::new(rx));
    let mut pool = Vec::with_capacity(workers);
    for w in 0..workers {
        let (rx, done, efd, backend) = (rx.clone(), done.clone(), efd.clone(), backend.clone());
        pool.push(
            std::thread::Builder::new()
                .name(format!("ublk-q{qid}-w{w}"))
                .spawn(move || loop {
                    // The lock is held only while waiting for the next job, not while serving it.
                    let Ok(job) = rx.lock().recv() else { return };
                    let res = execute(&*backend, &job);
                    done.lock().push((job.tag, res));
                    let one = 1u64.to_ne_bytes();
                    // SAFETY: writing 8 bytes from a live buffer to our eventfd.
                    unsafe { libc::write(efd.as_raw_fd(), one.as_ptr().cast(), 8) };
                })?,
        );
    }

    let bufs = dev.alloc_queue_io_bufs();
    let max_io = dev.dev_info.max_io_buf_bytes as usize;
    let queue = UblkQueue::new(qid, dev)?
        .submit_fetch_commands_unified(BufDescList::Slices(Some(&bufs)))?;
    // The eventfd read's target. Leaked on purpose: the ring is the thread's and outlives this
    // function, and a read still posted there when the queue goes down may complete later.
    let counter: &'static mut [u8; 8] = Box::leak(Box::new([0u8; 8]));
    let post_wake_read = |q: &UblkQueue, counter: &mut [u8; 8]| {
        let sqe = io_uring::opcode::Read::new(
            io_uring::types::Fd(efd.as_raw_fd()),
            counter.as_mut_ptr(),
            8,
        )
        .build()
        .user_data(UblkIOCtx::build_user_data(0, WAKE_OP, 0, true));
        q.ublk_submit_sqe_sync(sqe)
    };
    post_wake_read(&queue, counter)?;

    let handler = |q: &UblkQueue, tag: u16, io: &UblkIOCtx| {
        if io.is_tgt_io() {
            // Workers finished: commit their results, each of which also fetches the tag's next
            // request. The list is taken whole so workers are not held up while we commit.
            let finished = std::mem::take(&mut *done.lock());
            for (tag, res) in finished {
                let buf = BufDesc::Slice(bufs[tag as usize].as_slice());
                if let Err(e) = q.complete_io_cmd_unified(tag, buf, Ok(UblkIORes::Result(res))) {
                    eprintln!("ublk: queue {qid} tag {tag}: commit failed: {e}");
                }
            }
            if let Err(e) = post_wake_read(q, counter) {
                eprintln!("ublk: queue {qid}: cannot wait for completions: {e}");
            }
            return;
        }
        let iod = q.get_iod(tag);
        let op = iod.op_flags & 0xff;
        let len = (iod.nr_sectors as usize) << 9;
        let res = if len > max_io {
            Some(-libc::EINVAL)
        } else {
            let job = Job {
                tag,
                op,
                fua: iod.op_flags & sys::UBLK_IO_F_FUA != 0,
                offset: iod.start_sector << 9,
                len,
                buf: BufPtr(bufs[tag as usize].as_mut_ptr()),
            };
            tx.send(job).err().map(|_| -libc::EIO)
        };
        if let Some(res) = res {
            let buf = BufDesc::Slice(bufs[tag as usize].as_slice());
            if let Err(e) = q.complete_io_cmd_unified(tag, buf, Ok(UblkIORes::Result(res))) {
                eprintln!("ublk: queue {qid} tag {tag}: commit failed: {e}");
            }
        }
    };
    queue.wait_and_handle_io(handler);
    drop(tx);
    for w in pool {
        let _ = w.join();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the calls it gets; data is a plain vector.
    struct Mem {
        data: Mutex<Vec<u8>>,
        calls: Mutex<Vec<String>>,
        fail: Option<i32>,
    }

    impl Mem {
        fn new(size: usize) -> Mem {
            Mem {
                data: Mutex::new((0..size).map(|i| i as u8).collect()),
                calls: Mutex::new(Vec::new()),
                fail: None,
            }
        }
        fn result(&self, call: String) -> io::Result<()> {
            self.calls.lock().push(call);
            match self.fail {
                Some(errno) => Err(io::Error::from_raw_os_error(errno)),
                None => Ok(()),
            }
        }
    }

    impl BlockBackend for Mem {
        fn size(&self) -> u64 {
            self.data.lock().len() as u64
        }
        fn read_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
            let o = offset as usize;
            buf.copy_from_slice(&self.data.lock()[o..o + buf.len()]);
            self.result(format!("read {offset} {}", buf.len()))
        }
        fn write_at(&self, buf: &[u8], offset: u64, fua: bool) -> io::Result<()> {
            let o = offset as usize;
            self.data.lock()[o..o + buf.len()].copy_from_slice(buf);
            self.result(format!("write {offset} {} fua={fua}", buf.len()))
        }
        fn flush(&self) -> io::Result<()> {
            self.result("flush".into())
        }
        fn discard(&self, offset: u64, len: u64) -> io::Result<()> {
            self.result(format!("discard {offset} {len}"))
        }
        fn write_zeroes(&self, offset: u64, len: u64) -> io::Result<()> {
            self.result(format!("zeroes {offset} {len}"))
        }
    }

    fn job(op: u32, offset: u64, buf: &mut [u8]) -> Job {
        Job {
            tag: 3,
            op,
            fua: false,
            offset,
            len: buf.len(),
            buf: BufPtr(buf.as_mut_ptr()),
        }
    }

    #[test]
    fn reads_and_writes_return_their_length_and_move_the_data() {
        let mem = Mem::new(8192);
        let mut buf = vec![0u8; 1024];
        assert_eq!(
            execute(&mem, &job(sys::UBLK_IO_OP_READ, 512, &mut buf)),
            1024
        );
        assert_eq!(buf[0], (512 % 256) as u8);
        assert_eq!(buf[1023], ((512 + 1023) % 256) as u8);
        let mut data = vec![0xab; 512];
        let mut w = job(sys::UBLK_IO_OP_WRITE, 4096, &mut data);
        w.fua = true;
        assert_eq!(execute(&mem, &w), 512);
        assert!(mem.data.lock()[4096..4608].iter().all(|&b| b == 0xab));
        assert_eq!(
            *mem.calls.lock(),
            ["read 512 1024", "write 4096 512 fua=true"]
        );
    }

    #[test]
    fn a_flush_carries_no_range_and_is_not_checked_against_the_size() {
        // The driver leaves a flush's start sector undefined (seen in the guest: all ones).
        let mem = Mem::new(8192);
        let mut none = [];
        let flush = job(sys::UBLK_IO_OP_FLUSH, u64::MAX << 9, &mut none);
        assert_eq!(execute(&mem, &flush), 0);
        assert_eq!(*mem.calls.lock(), ["flush"]);
    }

    #[test]
    fn discard_and_write_zeroes_pass_their_range_and_return_zero() {
        let mem = Mem::new(1 << 20);
        let mut none = [];
        let mut d = job(sys::UBLK_IO_OP_DISCARD, 4096, &mut none);
        d.len = 65536;
        assert_eq!(execute(&mem, &d), 0);
        let mut z = job(sys::UBLK_IO_OP_WRITE_ZEROES, 0, &mut none);
        z.len = 1 << 20;
        assert_eq!(execute(&mem, &z), 0);
        assert_eq!(
            *mem.calls.lock(),
            ["discard 4096 65536", "zeroes 0 1048576"]
        );
    }

    #[test]
    fn ranges_past_the_end_are_refused_without_calling_the_backend() {
        let mem = Mem::new(8192);
        let mut buf = vec![0u8; 1024];
        assert_eq!(
            execute(&mem, &job(sys::UBLK_IO_OP_READ, 7680, &mut buf)),
            -libc::EINVAL
        );
        let mut none = [];
        let mut d = job(sys::UBLK_IO_OP_DISCARD, u64::MAX - 100, &mut none);
        d.len = 4096;
        assert_eq!(execute(&mem, &d), -libc::EINVAL);
        assert!(mem.calls.lock().is_empty());
    }

    #[test]
    fn backend_errors_reach_the_driver_as_negative_errnos() {
        let mut mem = Mem::new(8192);
        mem.fail = Some(libc::ENOSPC);
        let mut buf = vec![0u8; 512];
        assert_eq!(
            execute(&mem, &job(sys::UBLK_IO_OP_WRITE, 0, &mut buf)),
            -libc::ENOSPC
        );
        let mut none = [];
        assert_eq!(execute(&mem, &job(99, 0, &mut none)), -libc::EOPNOTSUPP);
    }

    #[test]
    fn configurations_out_of_range_are_refused() {
        let ok = DeviceConfig::default();
        assert!(ok.check(1 << 30).is_ok());
        assert!(ok.check(1000).is_err());
        assert!(ok.check(0).is_err());
        for bad in [
            DeviceConfig {
                depth: 0,
                ..ok.clone()
            },
            DeviceConfig {
                depth: 4097,
                ..ok.clone()
            },
            DeviceConfig {
                physical_block: 3000,
                ..ok.clone()
            },
            DeviceConfig {
                physical_block: 256,
                ..ok.clone()
            },
            DeviceConfig {
                max_io_bytes: 1000,
                ..ok.clone()
            },
            DeviceConfig {
                workers_per_queue: 0,
                ..ok.clone()
            },
            DeviceConfig {
                queues: Some(0),
                ..ok.clone()
            },
        ] {
            assert!(bad.check(1 << 30).is_err(), "{bad:?}");
        }
    }
}

//! Request memory: a server-wide budget of in-flight bytes and the buffers it pays for.
//!
//! Every byte a request holds on the server is charged to one [`Budget`] while it is held: a
//! write payload as it arrives (nothing for a header whose payload has not come), the data of
//! a read from the moment its buffer is taken until the reply has been written. When the budget
//! is spent, readers wait before taking more (the connection stops reading new requests), which
//! is the backpressure; bytes come back when requests finish or their replies leave.
//!
//! Buffers of up to [`PIECE`] bytes come from a [`Pool`] of power-of-two size classes, so the
//! steady state allocates nothing. Larger write payloads go into an anonymous mapping of their
//! own ([`LargeBuf`]): the kernel backs its pages only as the payload fills them, and unmapping
//! returns them at once, so a 32 MiB write announced by a bare header costs no memory and a
//! finished one leaves nothing resident (a reused 32 MiB pool buffer would stay resident, and
//! glibc's malloc keeps freed large blocks in its heap after the first few). Reads larger than
//! a piece are never held whole: they are streamed a piece at a time (see transmission.rs).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::{Condvar, Mutex};

/// The largest buffer taken from the pool, and the unit in which larger payloads are charged
/// and larger reads are streamed.
pub(crate) const PIECE: usize = 1 << 20;
/// The smallest pool class.
const MIN_CLASS: usize = 4 << 10;
const CLASSES: usize = (PIECE / MIN_CLASS).trailing_zeros() as usize + 1;

/// Bytes of in-flight request data the server may hold at once.
pub(crate) struct Budget {
    limit: u64,
    used: AtomicU64,
    /// Threads in the slow path of `acquire`.
    waiters: AtomicUsize,
    /// Bytes already held by the threads waiting in `acquire` (their requests' earlier pieces).
    /// Guarded by `lock`.
    lock: Mutex<u64>,
    cv: Condvar,
}

impl Budget {
    pub(crate) fn new(limit: u64) -> Budget {
        Budget {
            limit: limit.max(1),
            used: AtomicU64::new(0),
            waiters: AtomicUsize::new(0),
            lock: Mutex::new(0),
            cv: Condvar::new(),
        }
    }

    pub(crate) fn limit(&self) -> u64 {
        self.limit
    }

    pub(crate) fn used(&self) -> u64 {
        self.used.load(Ordering::SeqCst)
    }

    /// Takes `n` bytes if they fit; `force` takes them anyway.
    fn take(&self, n: u64, force: impl Fn(u64) -> bool) -> bool {
        let mut cur = self.used.load(Ordering::SeqCst);
        loop {
            if cur + n > self.limit && !force(cur) {
                return false;
            }
            match self
                .used
                .compare_exchange_weak(cur, cur + n, Ordering::SeqCst, Ordering::SeqCst)
            {
                Ok(_) => return true,
                Err(c) => cur = c,
            }
        }
    }

    /// Takes `n` bytes for a request that already holds `held`, waiting while the budget is
    /// spent. `before_wait` runs once if it has to wait (to flush replies the client may be
    /// waiting for). Never deadlocks: when every byte in use belongs to requests waiting here
    /// (a lone request larger than the budget, or several large writes each holding part of
    /// their payload), one of them is let through, so the budget can be exceeded by at most one
    /// request in that case.
    pub(crate) fn acquire(&self, n: u64, held: u64, before_wait: impl FnOnce()) {
        if self.take(n, |_| false) {
            return;
        }
        before_wait();
        let mut parked = self.lock.lock();
        self.waiters.fetch_add(1, Ordering::SeqCst);
        *parked += held;
        loop {
            let stuck = *parked;
            if self.take(n, |cur| cur <= stuck) {
                break;
            }
            self.cv.wait(&mut parked);
        }
        *parked -= held;
        self.waiters.fetch_sub(1, Ordering::SeqCst);
    }

    pub(crate) fn release(&self, n: u64) {
        if n == 0 {
            return;
        }
        self.used.fetch_sub(n, Ordering::SeqCst);
        // SeqCst on both sides: either a new waiter sees the bytes released, or this sees it.
        if self.waiters.load(Ordering::SeqCst) > 0 {
            let _g = self.lock.lock();
            self.cv.notify_all();
        }
    }
}

/// Free buffers by size class. Free buffers are not charged to the budget; the pool keeps at
/// most `retain` bytes of them and frees the rest.
pub(crate) struct Pool {
    classes: [Mutex<Vec<Box<[u8]>>>; CLASSES],
    retained: AtomicU64,
    retain: u64,
}

fn class_of(len: usize) -> usize {
    len.max(MIN_CLASS).next_power_of_two().trailing_zeros() as usize
        - MIN_CLASS.trailing_zeros() as usize
}

impl Pool {
    pub(crate) fn new(retain: u64) -> Pool {
        Pool {
            classes: std::array::from_fn(|_| Mutex::new(Vec::new())),
            retained: AtomicU64::new(0),
            retain,
        }
    }

    /// The bytes a buffer for `len` costs (its class size).
    pub(crate) fn cost(len: usize) -> u64 {
        (MIN_CLASS << class_of(len)) as u64
    }

    /// A buffer of at least `len` (<= PIECE) bytes; contents unspecified.
    pub(crate) fn get(&self, len: usize) -> Box<[u8]> {
        debug_assert!(len <= PIECE);
        let c = class_of(len);
        if let Some(b) = self.classes[c].lock().pop() {
            self.retained.fetch_sub(b.len() as u64, Ordering::Relaxed);
            return b;
        }
        vec![0u8; MIN_CLASS << c].into_boxed_slice()
    }

    pub(crate) fn put(&self, b: Box<[u8]>) {
        let n = b.len() as u64;
        if self.retained.fetch_add(n, Ordering::Relaxed) + n > self.retain {
            self.retained.fetch_sub(n, Ordering::Relaxed);
            return;
        }
        self.classes[class_of(b.len())].lock().push(b);
    }
}

/// A zero-initialised anonymous mapping; its pages become resident only when written.
pub(crate) struct LargeBuf {
    ptr: *mut u8,
    len: usize,
}

// SAFETY: LargeBuf owns its mapping exclusively, like a Box<[u8]>.
unsafe impl Send for LargeBuf {}
unsafe impl Sync for LargeBuf {}

impl LargeBuf {
    pub(crate) fn new(len: usize) -> std::io::Result<LargeBuf> {
        // SAFETY: a fresh private anonymous mapping; no existing memory is touched.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len.max(1),
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
                -1,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        Ok(LargeBuf {
            ptr: ptr.cast(),
            len,
        })
    }
}

impl std::ops::Deref for LargeBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the mapping is `len` bytes, readable, zero-filled by the kernel, and lives
        // as long as self.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl std::ops::DerefMut for LargeBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self gives exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for LargeBuf {
    fn drop(&mut self) {
        // SAFETY: ptr/len are exactly the mapping created in `new`.
        unsafe {
            libc::munmap(self.ptr.cast(), self.len.max(1));
        }
    }
}

/// The budget and the pool, shared by every connection of a server.
pub(crate) struct Memory {
    pub(crate) budget: Budget,
    pub(crate) pool: Pool,
}

impl Memory {
    pub(crate) fn new(budget: u64, retain: u64) -> Memory {
        Memory {
            budget: Budget::new(budget),
            pool: Pool::new(retain),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn classes() {
        assert_eq!(Pool::cost(1), 4096);
        assert_eq!(Pool::cost(4096), 4096);
        assert_eq!(Pool::cost(4097), 8192);
        assert_eq!(Pool::cost(PIECE), PIECE as u64);
        let p = Pool::new(1 << 20);
        let b = p.get(5000);
        assert_eq!(b.len(), 8192);
        p.put(b);
        assert_eq!(p.get(6000).len(), 8192);
    }

    #[test]
    fn pool_retains_at_most_its_limit() {
        let p = Pool::new(PIECE as u64);
        let a = p.get(PIECE);
        let b = p.get(PIECE);
        p.put(a);
        p.put(b);
        assert_eq!(p.retained.load(Ordering::Relaxed), PIECE as u64);
    }

    #[test]
    fn budget_blocks_until_release() {
        let b = Arc::new(Budget::new(100));
        b.acquire(60, 0, || {});
        let b2 = b.clone();
        let t = std::thread::spawn(move || {
            let mut waited = false;
            b2.acquire(60, 0, || waited = true);
            waited
        });
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(b.used(), 60, "the second request must wait");
        b.release(60);
        assert!(t.join().unwrap());
        assert_eq!(b.used(), 60);
    }

    #[test]
    fn lone_request_larger_than_budget_proceeds() {
        let b = Budget::new(100);
        b.acquire(500, 0, || {});
        // A request already holding everything in use gets its next piece too.
        b.acquire(500, 500, || {});
        assert_eq!(b.used(), 1000);
    }

    #[test]
    fn two_partial_holders_do_not_deadlock() {
        let b = Arc::new(Budget::new(100));
        b.acquire(50, 0, || {});
        b.acquire(50, 0, || {});
        let ts: Vec<_> = (0..2)
            .map(|_| {
                let b = b.clone();
                std::thread::spawn(move || {
                    b.acquire(50, 50, || {});
                    std::thread::sleep(Duration::from_millis(10));
                    b.release(100);
                })
            })
            .collect();
        for t in ts {
            t.join().unwrap();
        }
        assert_eq!(b.used(), 0);
    }

    #[test]
    fn large_buf_is_zeroed_and_writable() {
        let mut l = LargeBuf::new(3 << 20).unwrap();
        assert!(l.iter().all(|&x| x == 0));
        l[(3 << 20) - 1] = 7;
        assert_eq!(l[(3 << 20) - 1], 7);
    }
}

//! A read hit allocates nothing on the heap (docs/performance.md §12): on the 4 KiB hit path of
//! main, the segment list, the stripes (twice) and the device runs were four allocations and
//! frees per request, more instructions than the copy of the data itself. A write hit on a
//! dirty line neither (it made three: segments, home lines, device runs).
//!
//! The allocations are counted per thread by this test binary's global allocator, so the
//! cache's background threads do not count.

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

use common::*;
use hybridcache_engine::{CacheMode, Core};

struct Counting;

thread_local! {
    static ALLOCATIONS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // `try_with`: the allocator also runs while a thread's locals are torn down.
    let _ = ALLOCATIONS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: every call is passed on unchanged to the system allocator; counting touches only a
// thread-local `Cell` of a const initialiser, which never allocates.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        unsafe { System.realloc(ptr, layout, new_size) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Heap allocations this thread made while reading `len` bytes at `offset` 100 times.
fn allocations_of_reads(core: &Core, offset: u64, len: usize) -> u64 {
    let mut buf = vec![0u8; len];
    let before = ALLOCATIONS.with(|c| c.get());
    for _ in 0..100 {
        core.read(&mut buf, offset).expect("read hit");
    }
    ALLOCATIONS.with(|c| c.get()) - before
}

#[test]
fn read_hits_allocate_nothing() {
    let (cache, _vol) = new_cache(4, 256, CacheMode::Wb);
    let c = add_core(&cache, 4 << 20);
    // Lines 0-15 dirty, lines 16-31 clean (written, then flushed).
    c.core.write(&vec![7u8; 128 << 10], 0).unwrap();
    cache.flush_core(c.id).unwrap();
    c.core.write(&vec![9u8; 64 << 10], 0).unwrap();
    // A first read of every kind, so that what a thread sets up once (its counter slot) is done.
    allocations_of_reads(&c.core, 0, 4096);
    let hits_before = cache.core_stats(c.id).unwrap().requests.read_hits;

    let cases: [(&str, u64, usize); 5] = [
        ("4 KiB of a dirty line", 4096, 4096),
        ("4 KiB of a clean line", 80 << 10, 4096),
        ("one sector", 512 * 3, 512),
        ("8 KiB across two lines, dirty and clean", 60 << 10, 8192),
        ("4 KiB across two dirty lines", 4096 + 1024, 4096),
    ];
    let mut found = Vec::new();
    for (what, offset, len) in cases {
        let n = allocations_of_reads(&c.core, offset, len);
        if n != 0 {
            found.push(format!("{what}: {n} allocations in 100 reads"));
        }
    }
    // Over two lines the request's segments go to the heap: one allocation, no more.
    let n = allocations_of_reads(&c.core, 0, 64 << 10);
    if n > 100 {
        found.push(format!("64 KiB of 16 lines: {n} allocations in 100 reads"));
    }
    let hits = cache.core_stats(c.id).unwrap().requests.read_hits - hits_before;
    assert_eq!(hits, 600, "every read above is a hit");
    assert!(found.is_empty(), "read hits allocated: {found:?}");
}

/// Heap allocations this thread made while writing `len` bytes at `offset` 100 times.
fn allocations_of_writes(core: &Core, offset: u64, len: usize) -> u64 {
    let buf = vec![5u8; len];
    let before = ALLOCATIONS.with(|c| c.get());
    for _ in 0..100 {
        core.write(&buf, offset).expect("write hit");
    }
    ALLOCATIONS.with(|c| c.get()) - before
}

/// A write-back write hit on a dirty line allocates nothing either: its segments, stripes,
/// home lines and device runs stay on the stack for requests of up to two lines.
#[test]
fn write_hits_on_dirty_lines_allocate_nothing() {
    let (cache, _vol) = new_cache(4, 256, CacheMode::Wb);
    let c = add_core(&cache, 4 << 20);
    c.core.write(&vec![7u8; 64 << 10], 0).unwrap();
    // A first write, so that what a thread sets up once is done.
    allocations_of_writes(&c.core, 0, 4096);
    let hits_before = cache.core_stats(c.id).unwrap().requests.write_hits;

    let cases: [(&str, u64, usize); 3] = [
        ("4 KiB of a dirty line", 4096, 4096),
        ("one sector", 512 * 3, 512),
        ("4 KiB across two dirty lines", 8192 + 1024, 4096),
    ];
    let mut found = Vec::new();
    for (what, offset, len) in cases {
        let n = allocations_of_writes(&c.core, offset, len);
        if n != 0 {
            found.push(format!("{what}: {n} allocations in 100 writes"));
        }
    }
    let hits = cache.core_stats(c.id).unwrap().requests.write_hits - hits_before;
    assert_eq!(hits, 300, "every write above is a hit");
    assert!(found.is_empty(), "write hits allocated: {found:?}");
}

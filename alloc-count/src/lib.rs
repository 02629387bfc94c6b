//! Test support: a global allocator that counts each thread's allocations, so that a test can
//! check that a path allocates nothing per request (the GET paths of the device's front door:
//! `dpukv-gateway`'s RESP parsing and framing, `dpukv-node`'s reads). A test binary installs it
//! with `#[global_allocator] static A: dpukv_alloc_count::Counting = dpukv_alloc_count::Counting;`
//! and reads [`allocations`] before and after the path. Counts are per thread, so tests running
//! in parallel do not see each other's.
//!
//! Where it sits: a dev-dependency only; nothing a server runs uses it. Invariant: every call is
//! passed to the system allocator unchanged.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

thread_local! {
    static COUNT: Cell<u64> = const { Cell::new(0) };
}

/// The system allocator, counting each thread's allocations and reallocations.
#[derive(Debug, Clone, Copy, Default)]
pub struct Counting;

fn count() {
    COUNT.with(|c| c.set(c.get() + 1));
}

#[allow(unsafe_code)]
// SAFETY: every call is passed to the system allocator unchanged; counting touches only a
// thread-local `Cell` (const-initialised, no destructor: usable at any point of a thread's life,
// and it never allocates).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract, passed on.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Allocations (and reallocations) this thread made so far (0 unless [`Counting`] is the
/// global allocator).
pub fn allocations() -> u64 {
    COUNT.with(Cell::get)
}

//! An allocator that records the largest allocation: the tests that a forged size (a record's
//! length, a slot's field count) reserves nothing near what it claims install it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, recording the largest single allocation asked for since the last
/// [`LargestAlloc::reset`]. A test binary installs it as its global allocator:
///
/// ```ignore
/// #[global_allocator]
/// static ALLOCATOR: LargestAlloc = LargestAlloc::new();
/// ```
///
/// then resets it, reads the forged input and checks [`LargestAlloc::largest`]. It counts every
/// thread's allocations: the tests that use it allocate little beside the read they measure.
pub struct LargestAlloc {
    largest: AtomicUsize,
}

impl LargestAlloc {
    /// An allocator that has recorded nothing yet.
    pub const fn new() -> Self {
        LargestAlloc {
            largest: AtomicUsize::new(0),
        }
    }

    /// Forgets what was recorded: the next [`LargestAlloc::largest`] counts from here.
    pub fn reset(&self) {
        self.largest.store(0, Ordering::Relaxed);
    }

    /// The largest single allocation, in bytes, since the last reset.
    pub fn largest(&self) -> usize {
        self.largest.load(Ordering::Relaxed)
    }

    fn record(&self, size: usize) {
        self.largest.fetch_max(size, Ordering::Relaxed);
    }
}

impl Default for LargestAlloc {
    fn default() -> Self {
        Self::new()
    }
}

// SAFETY: forwards every call to the system allocator unchanged; only records the size asked for.
unsafe impl GlobalAlloc for LargestAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        self.record(layout.size());
        // SAFETY: the caller upholds GlobalAlloc's contract, which System needs.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        self.record(layout.size());
        // SAFETY: the caller upholds GlobalAlloc's contract, which System needs.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller upholds GlobalAlloc's contract, which System needs.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        self.record(new_size);
        // SAFETY: the caller upholds GlobalAlloc's contract, which System needs.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

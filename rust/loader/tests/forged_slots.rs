//! Slot bytes forged by another process: what a consumer decodes from them never reserves more
//! memory than the bytes could hold (found by the fuzz target `ring_attach`).

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use dataset_rt_loader::batch::decode_metadata;

/// The largest single allocation this test binary has asked for.
struct Largest;

static LARGEST: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator; only records the size asked for.
unsafe impl GlobalAlloc for Largest {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller upholds GlobalAlloc's contract, which System needs.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller upholds GlobalAlloc's contract, which System needs.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Largest = Largest;

#[test]
fn a_forged_metadata_count_reserves_nothing() {
    // u32::MAX fields announced, one bool field present.
    let mut bytes = u32::MAX.to_le_bytes().to_vec();
    bytes.extend_from_slice(&1u16.to_le_bytes());
    bytes.extend_from_slice(b"k\x00\x01");
    LARGEST.store(0, Ordering::Relaxed);
    let decoded = decode_metadata(&bytes);
    let largest = LARGEST.load(Ordering::Relaxed);
    assert!(decoded.is_err(), "{decoded:?}");
    assert!(
        largest < 1 << 16,
        "{largest} bytes reserved for {} bytes",
        bytes.len()
    );
}

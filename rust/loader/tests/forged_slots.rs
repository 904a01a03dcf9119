//! Slot bytes forged by another process: what a consumer decodes from them never reserves more
//! memory than the bytes could hold (found by the fuzz target `ring_attach`).

use dataset_rt_loader::batch::decode_metadata;
use dataset_rt_testkit::LargestAlloc;

/// Records the largest single allocation this test binary asks for.
#[global_allocator]
static ALLOCATOR: LargestAlloc = LargestAlloc::new();

#[test]
fn a_forged_metadata_count_reserves_nothing() {
    // u32::MAX fields announced, one bool field present.
    let mut bytes = u32::MAX.to_le_bytes().to_vec();
    bytes.extend_from_slice(&1u16.to_le_bytes());
    bytes.extend_from_slice(b"k\x00\x01");
    ALLOCATOR.reset();
    let decoded = decode_metadata(&bytes);
    let largest = ALLOCATOR.largest();
    assert!(decoded.is_err(), "{decoded:?}");
    assert!(
        largest < 1 << 16,
        "{largest} bytes reserved for {} bytes",
        bytes.len()
    );
}

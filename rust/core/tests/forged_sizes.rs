//! Record sizes forged in a copy of the golden cache and re-signed (record checksum in the header
//! and the index, file checksums, fingerprint), so that only the size checks can catch them:
//! cases the fuzz target `cache_resigned` looks for (docs/fuzzing.md).

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::Error;
use dataset_rt_testkit::{forge_record, golden_copy, LargestAlloc};

/// Records the largest single allocation this test binary asks for.
#[global_allocator]
static ALLOCATOR: LargestAlloc = LargestAlloc::new();

/// Opens the golden cache with `sample`'s `raw_len` forged (in its record header and its index
/// entry, everything re-signed): it must open, only the record is wrong. Reads `sample`.
fn read_forged(sample: u64, raw_len: u32) -> (String, usize) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy(tmp.path());
    forge_record(&dir, sample, |h| h.raw_len = raw_len);
    let cache = Cache::open(&dir, Validation::Full).expect("only the record is forged");
    ALLOCATOR.reset();
    let err = cache.payload(sample).map(|p| p.len());
    let largest = ALLOCATOR.largest();
    match err {
        Err(Error::CorruptRecord {
            sample: s, reason, ..
        }) => {
            assert_eq!(s, sample);
            (reason, largest)
        }
        other => panic!("a forged raw_len read as {other:?}"),
    }
}

#[test]
fn a_raw_record_whose_lengths_differ_is_corrupt() {
    // Sample 0 is stored raw, 20 bytes; its forged raw_len says 21 and 19.
    for forged in [21, 19] {
        let (reason, _) = read_forged(0, forged);
        assert!(
            reason.contains("stored raw") && reason.contains("raw_len"),
            "{reason}"
        );
    }
}

#[test]
fn an_lz4_raw_len_past_the_lz4_bound_is_refused_before_any_allocation() {
    // Sample 2 is LZ4: 44 stored bytes, 496 raw. No LZ4 block of 44 bytes decodes to more than
    // 255 × 44 bytes, so 4 GiB - 1 is refused without reserving it.
    let (reason, largest) = read_forged(2, u32::MAX);
    assert!(reason.contains("LZ4"), "{reason}");
    assert!(
        largest < 1 << 20,
        "{largest} bytes allocated for a 44-byte record"
    );
    // Within the bound, the decoder itself says the length is wrong.
    let (reason, _) = read_forged(2, 44 * 255);
    assert!(reason.contains("LZ4"), "{reason}");
}

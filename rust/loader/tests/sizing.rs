//! The ring is sized from verified data only. Caches are forged the way an attacker would:
//! after the damage every checksum the structure check reads is recomputed ("re-signed"), so
//! that the forged size reaches the loader instead of stopping at a checksum.

use std::path::Path;
use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::Dataset;
use dataset_rt_core::format::*;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::writer::WriterOptions;
use dataset_rt_core::Error as CoreError;
use dataset_rt_loader::batch::max_sample_bytes;
use dataset_rt_loader::Error;
use dataset_rt_testkit::{forge_entry, forge_record, numbered, writer_options};

const FORGED_RAW_LEN: u32 = 64 << 20;

/// Sample `i`: `100 + 10 i` bytes; compressible (LZ4 keeps it compressed) or not.
fn payload(i: u64, compressible: bool) -> Vec<u8> {
    let mut state = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..100 + 10 * i)
        .map(|j| {
            if compressible {
                (j % 5) as u8
            } else {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                state as u8
            }
        })
        .collect()
}

fn write_cache(base: &Path, name: &str, algo: &str, n: u64) -> std::path::PathBuf {
    write_cache_with(base, name, algo, n, |_| algo == "lz4")
}

/// As `write_cache`, sample `i` compressible when `compressible(i)` (LZ4 stores the others raw).
fn write_cache_with(
    base: &Path,
    name: &str,
    algo: &str,
    n: u64,
    compressible: impl Fn(u64) -> bool,
) -> std::path::PathBuf {
    let opts = WriterOptions {
        compression: Compression::new(algo, 1.0).unwrap(),
        ..writer_options()
    };
    let samples = (0..n).map(|i| numbered(i, payload(i, compressible(i))));
    dataset_rt_testkit::write_cache(&Pool::new(1).unwrap(), base, name, opts, samples)
}

fn open(dir: &Path) -> Dataset {
    Dataset::new(vec![Arc::new(
        Cache::open(dir, Validation::Structure).unwrap(),
    )])
}

fn corrupt_reason(result: dataset_rt_loader::Result<u64>, sample: u64) -> String {
    match result {
        Err(Error::Core(CoreError::CorruptRecord {
            sample: s, reason, ..
        })) if s == sample => reason,
        other => panic!("expected a corrupt record {sample}, got {other:?}"),
    }
}

/// Why reading sample `sample` (as the producer does) fails.
fn read_refusal(ds: &Dataset, sample: u64) -> String {
    match ds.fetch(sample).map(|_| ()) {
        Err(CoreError::CorruptRecord {
            sample: s, reason, ..
        }) if s == sample => reason,
        other => panic!("expected a corrupt record {sample} when read, got {other:?}"),
    }
}

/// Bytes of a sample in a slot beyond its payload: the offsets entry and the metadata
/// ({"i": int}: 4 + 4 + 1 + 1 + 8).
const ENTRY_AND_METADATA: u64 = 56 + 18;

#[test]
fn slots_are_sized_from_what_travels_in_them() {
    let dir = tempfile::tempdir().unwrap();
    // Records stored uncompressed travel as references: no payload bytes in the slot.
    let ds = open(&write_cache(dir.path(), "none", "none", 8));
    assert_eq!(max_sample_bytes(&ds).unwrap(), ENTRY_AND_METADATA);
    // LZ4 records travel decompressed in the slot, aligned: the largest one is read.
    let ds = open(&write_cache(dir.path(), "lz4", "lz4", 8));
    let largest = payload(7, true).len() as u64;
    assert_eq!(
        max_sample_bytes(&ds).unwrap(),
        ENTRY_AND_METADATA + 63 + largest
    );
    // Mixed: the largest sample (7) did not compress, so it is stored raw and referenced; the
    // largest LZ4 record (6) decides.
    let ds = open(&write_cache_with(dir.path(), "mixed", "lz4", 8, |i| {
        i % 2 == 0
    }));
    let (_, header, _) = ds.caches[0].verify_record(7).unwrap();
    assert_eq!(header.flags & FLAG_LZ4, 0, "sample 7 stored raw");
    let largest_lz4 = payload(6, true).len() as u64;
    assert_eq!(
        max_sample_bytes(&ds).unwrap(),
        ENTRY_AND_METADATA + 63 + largest_lz4
    );
}

#[test]
fn a_forged_index_size_is_refused_before_a_ring_is_sized_from_it() {
    let dir = tempfile::tempdir().unwrap();
    let cache = write_cache(dir.path(), "c", "lz4", 8);
    forge_entry(&cache, 0, |e| e.raw_len = FORGED_RAW_LEN);
    let reason = corrupt_reason(max_sample_bytes(&open(&cache)), 0);
    assert!(reason.contains("disagrees with index entry"), "{reason}");
}

#[test]
fn a_forged_index_size_of_a_raw_record_sizes_nothing_and_is_refused_when_read() {
    let dir = tempfile::tempdir().unwrap();
    let cache = write_cache(dir.path(), "c", "none", 8);
    forge_entry(&cache, 0, |e| e.raw_len = FORGED_RAW_LEN);
    let ds = open(&cache);
    assert_eq!(max_sample_bytes(&ds).unwrap(), ENTRY_AND_METADATA);
    let reason = read_refusal(&ds, 0);
    assert!(reason.contains("disagrees with index entry"), "{reason}");
}

#[test]
fn a_forged_size_in_a_re_signed_raw_record_sizes_nothing_and_is_refused_when_read() {
    let dir = tempfile::tempdir().unwrap();
    let cache = write_cache(dir.path(), "c", "none", 8);
    forge_record(&cache, 3, |h| h.raw_len = FORGED_RAW_LEN);
    let ds = open(&cache);
    assert_eq!(max_sample_bytes(&ds).unwrap(), ENTRY_AND_METADATA);
    let reason = read_refusal(&ds, 3);
    assert!(
        reason.contains(&format!("raw_len {FORGED_RAW_LEN} differ")),
        "{reason}"
    );
}

#[test]
fn a_raw_record_forged_to_claim_lz4_is_refused_before_a_ring_is_sized_from_it() {
    let dir = tempfile::tempdir().unwrap();
    let cache = write_cache(dir.path(), "c", "none", 8);
    forge_record(&cache, 2, |h| {
        h.raw_len = FORGED_RAW_LEN;
        h.flags = FLAG_LZ4;
    });
    let reason = corrupt_reason(max_sample_bytes(&open(&cache)), 2);
    // The cache was written without compression, so no record of it may claim LZ4 at all
    // (checked before the claimed length is).
    assert!(
        reason.contains("the manifest says the cache was written without compression"),
        "{reason}"
    );
}

#[test]
fn a_forged_size_in_a_re_signed_lz4_record_is_refused_without_decoding_it() {
    let dir = tempfile::tempdir().unwrap();
    let cache = write_cache(dir.path(), "c", "lz4", 8);
    let ds = open(&cache);
    let (_, header, _) = ds.caches[0].verify_record(5).unwrap();
    assert_eq!(header.flags & FLAG_LZ4, FLAG_LZ4, "stored compressed");
    // Beyond what the stored bytes can decode to: refused before any decoding.
    forge_record(&cache, 5, |h| h.raw_len = FORGED_RAW_LEN);
    let reason = corrupt_reason(max_sample_bytes(&open(&cache)), 5);
    assert!(
        reason.contains(&format!(
            "raw length {FORGED_RAW_LEN} is more than LZ4 can expand"
        )),
        "{reason}"
    );
    // Within LZ4's bound but false (forged in a fresh copy): the decoded length gives it away.
    let dir = tempfile::tempdir().unwrap();
    let cache = write_cache(dir.path(), "c", "lz4", 8);
    forge_record(&cache, 5, |h| h.raw_len = header.stored_len * 200);
    let reason = corrupt_reason(max_sample_bytes(&open(&cache)), 5);
    assert!(
        reason.contains("does not decode") || reason.contains("decodes to"),
        "{reason}"
    );
}

//! The ring is sized from verified data only. Caches are forged the way an attacker would:
//! after the damage every checksum the structure check reads is recomputed ("re-signed"), so
//! that the forged size reaches the loader instead of stopping at a checksum.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::Dataset;
use dataset_rt_core::format::*;
use dataset_rt_core::metadata::MetaValue;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::writer::{CacheLock, CacheWriter, SampleInput, WriterOptions};
use dataset_rt_core::Error as CoreError;
use dataset_rt_loader::batch::max_sample_bytes;
use dataset_rt_loader::Error;

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
    let lock = CacheLock::acquire(base, name).unwrap();
    let opts = WriterOptions {
        prefetch_size: 4,
        compression: Compression::new(algo, 1.0).unwrap(),
        validate: true,
        shard_size: 1 << 20,
    };
    let mut writer = CacheWriter::create(Pool::new(1).unwrap(), lock, opts).unwrap();
    for i in 0..n {
        writer
            .push(SampleInput {
                data: payload(i, compressible(i)),
                metadata: vec![("i".into(), MetaValue::Int(i as i64))],
            })
            .unwrap();
    }
    writer.finish().unwrap().dir
}

fn open(dir: &Path) -> Dataset {
    Dataset::new(vec![Arc::new(
        Cache::open(dir, Validation::Structure).unwrap(),
    )])
}

fn rewrite(path: &Path, at: u64, bytes: &[u8]) {
    // Published files may be read-only: the forger does not care.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut all = std::fs::read(path).unwrap();
    all[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
    std::fs::write(path, all).unwrap();
}

/// Sets sample `sample`'s `raw_len` to `raw_len` in the index and, with `record`, in its
/// record header too (with the record checksum recomputed); then re-signs the index, shard and
/// manifest checksums and the fingerprint.
fn forge_raw_len(dir: &Path, sample: u64, raw_len: u32, record: bool) {
    forge(dir, sample, raw_len, None, record)
}

/// As `forge_raw_len`, and sets the flags to `flags` too when given.
fn forge(dir: &Path, sample: u64, raw_len: u32, flags: Option<u32>, record: bool) {
    let cache = Cache::open(dir, Validation::Structure).unwrap();
    let (mut entry, mut header, payload_start) = cache.verify_record(sample).unwrap();
    let shard_path = cache.shard_path(entry.shard);
    let mut manifest = cache.manifest.clone();
    drop(cache);
    if record {
        let shard = std::fs::read(&shard_path).unwrap();
        let meta_start = (entry.offset + RECORD_HEADER_LEN) as usize;
        let meta = &shard[meta_start..meta_start + header.meta_len as usize];
        let stored = &shard[payload_start as usize..][..header.stored_len as usize];
        header.raw_len = raw_len;
        header.flags = flags.unwrap_or(header.flags);
        header.checksum = header.compute_checksum(meta, stored);
        entry.checksum = header.checksum;
        rewrite(&shard_path, entry.offset, &header.encode());
        let shard = std::fs::read(&shard_path).unwrap();
        manifest.shards[entry.shard as usize].checksum = checksum_hex(hash_bytes(&shard));
    }
    entry.raw_len = raw_len;
    entry.flags = flags.unwrap_or(entry.flags);
    let index_path = dir.join(INDEX_FILE);
    rewrite(
        &index_path,
        INDEX_HEADER_LEN + sample * INDEX_ENTRY_LEN,
        &entry.encode(),
    );
    manifest.index.checksum = checksum_hex(hash_bytes(&std::fs::read(&index_path).unwrap()));
    manifest.fingerprint = manifest.compute_fingerprint();
    let manifest_path = dir.join(MANIFEST_FILE);
    std::fs::set_permissions(&manifest_path, std::fs::Permissions::from_mode(0o644)).unwrap();
    std::fs::write(&manifest_path, serde_json::to_vec(&manifest).unwrap()).unwrap();
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
    forge_raw_len(&cache, 0, FORGED_RAW_LEN, false);
    let reason = corrupt_reason(max_sample_bytes(&open(&cache)), 0);
    assert!(reason.contains("disagrees with index entry"), "{reason}");
}

#[test]
fn a_forged_index_size_of_a_raw_record_sizes_nothing_and_is_refused_when_read() {
    let dir = tempfile::tempdir().unwrap();
    let cache = write_cache(dir.path(), "c", "none", 8);
    forge_raw_len(&cache, 0, FORGED_RAW_LEN, false);
    let ds = open(&cache);
    assert_eq!(max_sample_bytes(&ds).unwrap(), ENTRY_AND_METADATA);
    let reason = read_refusal(&ds, 0);
    assert!(reason.contains("disagrees with index entry"), "{reason}");
}

#[test]
fn a_forged_size_in_a_re_signed_raw_record_sizes_nothing_and_is_refused_when_read() {
    let dir = tempfile::tempdir().unwrap();
    let cache = write_cache(dir.path(), "c", "none", 8);
    forge_raw_len(&cache, 3, FORGED_RAW_LEN, true);
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
    forge(&cache, 2, FORGED_RAW_LEN, Some(FLAG_LZ4), true);
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
    forge_raw_len(&cache, 5, FORGED_RAW_LEN, true);
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
    forge_raw_len(&cache, 5, header.stored_len * 200, true);
    let reason = corrupt_reason(max_sample_bytes(&open(&cache)), 5);
    assert!(
        reason.contains("does not decode") || reason.contains("decodes to"),
        "{reason}"
    );
}

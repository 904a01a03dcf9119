//! Record sizes forged in a copy of the golden cache and re-signed (record checksum in the header
//! and the index, file checksums, fingerprint), so that only the size checks can catch them:
//! cases the fuzz target `cache_resigned` looks for (docs/fuzzing.md).

use std::alloc::{GlobalAlloc, Layout, System};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::format::{
    checksum_hex, hash_bytes, index_entry_len, Manifest, RecordHeader, INDEX_HEADER_LEN,
    RECORD_HEADER_LEN,
};
use dataset_rt_core::Error;

mod common;
use common::golden_copy;

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
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        LARGEST.fetch_max(layout.size(), Ordering::Relaxed);
        // SAFETY: the caller upholds GlobalAlloc's contract, which System needs.
        unsafe { System.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller upholds GlobalAlloc's contract, which System needs.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LARGEST.fetch_max(new_size, Ordering::Relaxed);
        // SAFETY: the caller upholds GlobalAlloc's contract, which System needs.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOCATOR: Largest = Largest;

/// Sets `raw_len` of `sample`'s record header and index entry, then re-signs everything.
fn forge_raw_len(dir: &Path, sample: u64, raw_len: u32) {
    let index_path = dir.join("index.bin");
    let mut index = std::fs::read(&index_path).unwrap();
    // The golden cache is format v1.
    let e = (INDEX_HEADER_LEN + index_entry_len(1) * sample) as usize;
    let offset = u64::from_le_bytes(index[e..e + 8].try_into().unwrap()) as usize;
    let shard = u32::from_le_bytes(index[e + 8..e + 12].try_into().unwrap());
    let shard_path = dir.join(format!("shards/{shard:06}.bin"));
    let mut bytes = std::fs::read(&shard_path).unwrap();
    let mut h = RecordHeader::decode_as(1, &bytes[offset..]).unwrap();
    h.raw_len = raw_len;
    let meta_start = offset + RECORD_HEADER_LEN as usize;
    let meta = &bytes[meta_start..meta_start + h.meta_len as usize];
    let payload_start = offset + h.payload_offset() as usize;
    let payload = &bytes[payload_start..payload_start + h.stored_len as usize];
    h.checksum = h.checksum_as(1, meta, payload);
    bytes[offset..offset + RECORD_HEADER_LEN as usize].copy_from_slice(&h.encode_as(1));
    index[e + 20..e + 24].copy_from_slice(&raw_len.to_le_bytes());
    index[e + 24..e + 32].copy_from_slice(&h.checksum.to_le_bytes());
    std::fs::write(&shard_path, &bytes).unwrap();
    std::fs::write(&index_path, &index).unwrap();

    let manifest_path = dir.join("manifest.json");
    let mut m: Manifest = serde_json::from_slice(&std::fs::read(&manifest_path).unwrap()).unwrap();
    m.index.checksum = checksum_hex(hash_bytes(&index));
    m.shards[shard as usize].checksum = checksum_hex(hash_bytes(&bytes));
    m.fingerprint = m.compute_fingerprint();
    std::fs::write(&manifest_path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
}

/// Opens the forged cache (it must open: only the record is wrong) and reads `sample`.
fn read_forged(sample: u64, raw_len: u32) -> (String, usize) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy(tmp.path());
    forge_raw_len(&dir, sample, raw_len);
    let cache = Cache::open(&dir, Validation::Full).expect("only the record is forged");
    LARGEST.store(0, Ordering::Relaxed);
    let err = cache.payload(sample).map(|p| p.len());
    let largest = LARGEST.load(Ordering::Relaxed);
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

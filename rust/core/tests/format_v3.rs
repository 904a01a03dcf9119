//! Format v3 as written: version 3 in every header, 40-byte index entries that carry the record's
//! metadata length, the record checksum (as in v2) one xxh3-64 over the record from its fields to
//! the payload's end (zero padding included), and damage anywhere in that range, or an entry that
//! disagrees with its record, caught when the record is read.

use std::path::Path;
use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::format::{
    hash_bytes, RecordHeader, FORMAT_VERSION, INDEX_ENTRY_LEN, INDEX_HEADER_LEN, RECORD_HEADER_LEN,
    RECORD_V2_HASHED_FROM,
};
use dataset_rt_core::pool::Pool;
use dataset_rt_core::Error;
use dataset_rt_testkit::{numbered, write_cache, writer_options};

fn write(pool: &Arc<Pool>, base: &Path, name: &str, n: u64) {
    // Odd lengths and metadata sizes: padding on both sides of the payload.
    let samples = (0..n).map(|i| numbered(i, vec![i as u8; 37 + i as usize]));
    write_cache(pool, base, name, writer_options(), samples);
}

/// A v3 cache of `n` samples in a fresh directory (kept as long as the returned guard).
fn written(n: u64) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    write(&pool, dir.path(), "v3", n);
    let path = dir.path().join("v3");
    (dir, path)
}

#[test]
fn a_new_cache_is_v3_and_each_checksum_covers_one_contiguous_range() {
    let (_dir, path) = written(5);
    let cache = Cache::open(&path, Validation::Full).unwrap();
    assert_eq!(FORMAT_VERSION, 3);
    assert_eq!(cache.manifest.format_version, 3);
    let index = std::fs::read(path.join("index.bin")).unwrap();
    assert_eq!(index[8..12], 3u32.to_le_bytes());
    assert_eq!(index[12..16], 40u32.to_le_bytes());
    assert_eq!(index.len() as u64, INDEX_HEADER_LEN + 5 * INDEX_ENTRY_LEN);
    for sample in 0..cache.len() {
        let e = cache.entry(sample);
        let shard = std::fs::read(cache.shard_path(e.shard)).unwrap();
        assert_eq!(shard[8..12], 3u32.to_le_bytes());
        let start = e.offset as usize;
        let h = RecordHeader::decode_as(3, &shard[start..]).unwrap();
        assert_eq!(h.sample, sample);
        assert_eq!(e.meta_len, Some(h.meta_len));
        let end = start + (h.payload_offset() + u64::from(h.stored_len)) as usize;
        let padding = &shard[start + RECORD_HEADER_LEN as usize + h.meta_len as usize
            ..start + h.payload_offset() as usize];
        assert!(padding.iter().all(|&b| b == 0));
        assert_eq!(
            hash_bytes(&shard[start + RECORD_V2_HASHED_FROM as usize..end]),
            h.checksum
        );
        assert_eq!(e.checksum, h.checksum);
        cache.verify_record(sample).unwrap();
    }
}

#[test]
fn damage_anywhere_the_checksum_covers_is_caught_on_read() {
    let (_dir, path) = written(3);
    let (shard_path, start, payload_offset, meta_len) = {
        let cache = Cache::open(&path, Validation::Full).unwrap();
        let (e, h, _) = cache.verify_record(1).unwrap();
        (
            cache.shard_path(e.shard),
            e.offset as usize,
            h.payload_offset() as usize,
            h.meta_len as usize,
        )
    };
    assert!(
        payload_offset > RECORD_HEADER_LEN as usize + meta_len,
        "the test needs padding before the payload"
    );
    let pristine = std::fs::read(&shard_path).unwrap();
    let cases = [
        ("metadata", start + RECORD_HEADER_LEN as usize),
        ("padding before the payload", start + payload_offset - 1),
        ("payload", start + payload_offset + 3),
    ];
    for (what, at) in cases {
        let mut bytes = pristine.clone();
        bytes[at] ^= 0x5a;
        std::fs::write(&shard_path, &bytes).unwrap();
        let cache = Cache::open(&path, Validation::Structure).unwrap();
        cache.verify_record(0).unwrap();
        match cache.verify_record(1) {
            Err(Error::CorruptRecord { sample, reason, .. }) => {
                assert_eq!(sample, 1, "{what}");
                assert!(reason.starts_with("checksum mismatch"), "{what}: {reason}");
            }
            other => panic!("{what}: expected a corrupt record, got {:?}", other.err()),
        }
    }
    std::fs::write(&shard_path, &pristine).unwrap();
    Cache::open(&path, Validation::Full)
        .unwrap()
        .verify_record(1)
        .unwrap();
}

/// An index entry whose metadata length disagrees with its record's header is a corrupt record,
/// on a full read; a read from the entry alone then finds the payload somewhere else, which is
/// why only a record verified against its entry is ever read that way.
#[test]
fn an_entry_whose_metadata_length_disagrees_with_its_record_is_corrupt() {
    let (_dir, path) = written(3);
    let (_, _, real) = Cache::open(&path, Validation::Full)
        .unwrap()
        .verify_record(1)
        .unwrap();
    let index_path = path.join("index.bin");
    let mut index = std::fs::read(&index_path).unwrap();
    let meta_len_at = (INDEX_HEADER_LEN + INDEX_ENTRY_LEN + 24) as usize;
    let meta_len = u32::from_le_bytes(index[meta_len_at..meta_len_at + 4].try_into().unwrap());
    index[meta_len_at..meta_len_at + 4].copy_from_slice(&(meta_len + 16).to_le_bytes());
    std::fs::write(&index_path, &index).unwrap();
    // Structure: the index's checksum is not read at open, every read checks its entry.
    let cache = Cache::open(&path, Validation::Structure).unwrap();
    cache.verify_record(0).unwrap();
    match cache.check_record(1, false) {
        Err(Error::CorruptRecord { sample, reason, .. }) => {
            assert_eq!(sample, 1);
            assert!(reason.contains("disagrees with index entry"), "{reason}");
        }
        other => panic!("expected a corrupt record, got {other:?}"),
    }
    let (_, _, from_entry) = cache.trusted_record(1).unwrap().unwrap();
    assert_eq!(from_entry, real + 16);
    // A full validation at open refuses the whole index.
    assert!(matches!(
        Cache::open(&path, Validation::Full),
        Err(Error::Malformed { .. })
    ));
}

/// A read from the index entry alone still bounds the entry: an offset past its shard is a
/// corrupt record naming the sample, not a read out of bounds.
#[test]
fn a_read_from_the_entry_alone_still_bounds_it_by_its_shard() {
    let (_dir, path) = written(3);
    let index_path = path.join("index.bin");
    let mut index = std::fs::read(&index_path).unwrap();
    let offset_at = (INDEX_HEADER_LEN + 2 * INDEX_ENTRY_LEN) as usize;
    for forged in [1u64 << 40, u64::MAX - 8] {
        index[offset_at..offset_at + 8].copy_from_slice(&forged.to_le_bytes());
        std::fs::write(&index_path, &index).unwrap();
        let cache = Cache::open(&path, Validation::Structure).unwrap();
        match cache.trusted_record(2).unwrap() {
            Err(Error::CorruptRecord { sample, reason, .. }) => {
                assert_eq!(sample, 2);
                assert!(reason.contains("past the end of its shard"), "{reason}");
            }
            other => panic!("expected a corrupt record, got {other:?}"),
        }
    }
}

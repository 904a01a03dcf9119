//! Format v2 as written: version 2 in every header, the record checksum one xxh3-64 over the
//! record from its fields to the payload's end (zero padding included), and damage anywhere in
//! that range caught when the record is read.

use std::path::Path;
use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::format::{
    hash_bytes, Compression, RecordHeader, FORMAT_VERSION, RECORD_HEADER_LEN, RECORD_V2_HASHED_FROM,
};
use dataset_rt_core::metadata::MetaValue;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::writer::{CacheLock, CacheWriter, SampleInput, WriterOptions};
use dataset_rt_core::Error;

fn write(pool: &Arc<Pool>, base: &Path, name: &str, n: u64) {
    let lock = CacheLock::acquire(base, name).unwrap();
    let opts = WriterOptions {
        prefetch_size: 4,
        compression: Compression::NONE,
        validate: true,
        shard_size: 1 << 20,
    };
    let mut writer = CacheWriter::create(pool.clone(), lock, opts).unwrap();
    for i in 0..n {
        writer
            .push(SampleInput {
                // Odd lengths and metadata sizes: padding on both sides of the payload.
                data: vec![i as u8; 37 + i as usize],
                metadata: vec![("i".to_owned(), MetaValue::Int(i as i64))],
            })
            .unwrap();
    }
    writer.finish().unwrap();
}

#[test]
fn a_new_cache_is_v2_and_each_checksum_covers_one_contiguous_range() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    write(&pool, dir.path(), "v2", 5);
    let cache = Cache::open(&dir.path().join("v2"), Validation::Full).unwrap();
    assert_eq!(FORMAT_VERSION, 2);
    assert_eq!(cache.manifest.format_version, 2);
    let index = std::fs::read(dir.path().join("v2/index.bin")).unwrap();
    assert_eq!(index[8..12], 2u32.to_le_bytes());
    for sample in 0..cache.len() {
        let e = cache.entry(sample);
        let shard = std::fs::read(cache.shard_path(e.shard)).unwrap();
        assert_eq!(shard[8..12], 2u32.to_le_bytes());
        let start = e.offset as usize;
        let h = RecordHeader::decode_as(2, &shard[start..]).unwrap();
        assert_eq!(h.sample, sample);
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
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    write(&pool, dir.path(), "v2", 3);
    let path = dir.path().join("v2");
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

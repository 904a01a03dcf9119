//! The kit's own checks: its independent record checksum agrees with the core's, re-signing a
//! sound cache changes nothing, and a forged record is signed so that a full validation opens it.

use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::format::{RecordHeader, READABLE_VERSIONS};
use dataset_rt_core::pool::Pool;
use dataset_rt_core::writer::WriterOptions;
use dataset_rt_testkit::resign::record_checksum;
use dataset_rt_testkit::{
    forge_record, golden_copy_of, lz4, manifest_of, numbered, resign, write_cache, writer_options,
    CacheFiles,
};

/// A cache of 6 samples in shards of 256 bytes, compressible ones stored LZ4.
fn written(pool: &Arc<Pool>, base: &std::path::Path) -> std::path::PathBuf {
    let opts = WriterOptions {
        compression: lz4(0.9),
        shard_size: 256,
        ..writer_options()
    };
    let samples = (0..6).map(|i| numbered(i, vec![i as u8; 40 + 20 * i as usize]));
    let dir = write_cache(pool, base, "w", opts, samples);
    assert_eq!(dir, base.join("w"));
    dir
}

/// Every sound cache the tests start from: each golden version and one written cache.
fn sound_caches(tmp: &tempfile::TempDir) -> Vec<std::path::PathBuf> {
    let pool = Pool::new(1).unwrap();
    let mut dirs: Vec<_> = READABLE_VERSIONS
        .iter()
        .map(|&v| golden_copy_of(&tmp.path().join(format!("v{v}")), v))
        .collect();
    dirs.push(written(&pool, tmp.path()));
    dirs
}

#[test]
fn the_record_checksum_is_the_one_the_core_checks() {
    let tmp = tempfile::tempdir().unwrap();
    for dir in sound_caches(&tmp) {
        let cache = Cache::open(&dir, Validation::Full).unwrap();
        for sample in 0..cache.len() {
            let (entry, header, _) = cache.verify_record(sample).unwrap();
            let shard = std::fs::read(cache.shard_path(entry.shard)).unwrap();
            let version = cache.manifest.format_version;
            assert_eq!(
                record_checksum(version, &shard, entry.offset as usize),
                Some(header.checksum),
                "{} sample {sample}",
                dir.display()
            );
        }
    }
}

#[test]
fn resigning_a_sound_cache_changes_no_byte_that_is_checked() {
    let tmp = tempfile::tempdir().unwrap();
    for dir in sound_caches(&tmp) {
        let before = CacheFiles::read(&dir);
        let manifest = manifest_of(&dir);
        resign(&dir, |_| {});
        let after = CacheFiles::read(&dir);
        assert_eq!(manifest_of(&dir), manifest, "{}", dir.display());
        assert_eq!(after.index, before.index);
        assert_eq!(after.metadata, before.metadata);
        assert_eq!(after.shards, before.shards);
    }
}

#[test]
fn a_forged_record_is_signed_everywhere_its_checksum_is_kept() {
    let tmp = tempfile::tempdir().unwrap();
    for dir in sound_caches(&tmp) {
        forge_record(&dir, 1, |h| h.raw_len += 1);
        // Every file checksum and the fingerprint agree: a full validation opens it ...
        let cache = Cache::open(&dir, Validation::Full).unwrap();
        // ... and the entry and the record carry the forged length and the same checksum, the
        // one of the record's bytes.
        let entry = cache.entry(1);
        let version = cache.manifest.format_version;
        let shard = std::fs::read(cache.shard_path(entry.shard)).unwrap();
        let header = RecordHeader::decode_as(version, &shard[entry.offset as usize..]).unwrap();
        assert_eq!(entry.raw_len, header.raw_len, "{}", dir.display());
        assert_eq!(entry.checksum, header.checksum);
        assert_eq!(
            record_checksum(version, &shard, entry.offset as usize),
            Some(header.checksum)
        );
    }
}

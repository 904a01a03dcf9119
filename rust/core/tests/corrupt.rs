//! Damaged caches, each with its own exact error (the Rust side of the corpus in
//! `tests/test_corrupt_corpus.py`): every case starts from a private copy of the golden cache.

use std::path::{Path, PathBuf};

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::Error;

fn golden_copy(tmp: &Path) -> PathBuf {
    let from = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/data/golden_v1/golden");
    let dest = tmp.join("golden");
    std::fs::create_dir_all(dest.join("shards")).unwrap();
    for rel in [
        "manifest.json",
        "index.bin",
        "metadata.arrow",
        "shards/000000.bin",
        "shards/000001.bin",
    ] {
        std::fs::copy(from.join(rel), dest.join(rel)).unwrap();
    }
    dest
}

fn flip_byte(path: &Path, offset: usize) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[offset] ^= 0xff;
    std::fs::write(path, bytes).unwrap();
}

/// Damages a fresh copy, opens it, and returns the malformation as (file, reason).
fn malformed(damage: impl FnOnce(&Path), validation: Validation) -> (PathBuf, String) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy(tmp.path());
    damage(&dir);
    match Cache::open(&dir, validation) {
        Err(Error::Malformed {
            cache,
            file,
            reason,
        }) => {
            assert_eq!(cache, "golden");
            let rel = file.strip_prefix(&dir).unwrap().to_owned();
            (rel, reason)
        }
        Err(other) => panic!("expected Malformed, got {other:?}"),
        Ok(_) => panic!("the damaged cache opened"),
    }
}

#[test]
fn the_undamaged_copy_opens() {
    let tmp = tempfile::tempdir().unwrap();
    Cache::open(&golden_copy(tmp.path()), Validation::Full)
        .unwrap()
        .verify_all()
        .unwrap();
}

#[test]
fn flipped_byte_in_the_index_names_index_bin() {
    let (file, reason) = malformed(
        |d| flip_byte(&d.join("index.bin"), 207),
        Validation::Structure,
    );
    assert_eq!(file, Path::new("index.bin"));
    assert!(reason.starts_with("checksum mismatch"), "{reason}");
    assert!(
        reason.contains("the manifest says 4c797fb2f9dab943"),
        "{reason}"
    );
}

#[test]
fn flipped_byte_in_the_metadata_names_metadata_arrow() {
    let (file, reason) = malformed(
        |d| flip_byte(&d.join("metadata.arrow"), 200),
        Validation::Structure,
    );
    assert_eq!(file, Path::new("metadata.arrow"));
    assert!(reason.starts_with("checksum mismatch"), "{reason}");
}

#[test]
fn truncated_shard_states_both_sizes() {
    let (file, reason) = malformed(
        |d| {
            let shard = std::fs::OpenOptions::new()
                .write(true)
                .open(d.join("shards/000001.bin"))
                .unwrap();
            shard.set_len(248).unwrap();
        },
        Validation::Structure,
    );
    assert_eq!(file, Path::new("shards/000001.bin"));
    assert_eq!(reason, "size is 248 bytes, the manifest says 496");
}

#[test]
fn missing_manifest_is_named() {
    let (file, reason) = malformed(
        |d| std::fs::remove_file(d.join("manifest.json")).unwrap(),
        Validation::Structure,
    );
    assert_eq!(file, Path::new("manifest.json"));
    assert_eq!(reason, "file is missing");
}

#[test]
fn unknown_format_version_is_refused_with_both_versions() {
    let (file, reason) = malformed(
        |d| {
            let path = d.join("manifest.json");
            let text = std::fs::read_to_string(&path).unwrap();
            let edited = text.replace("\"format_version\": 1,", "\"format_version\": 99,");
            assert_ne!(edited, text);
            std::fs::write(&path, edited).unwrap();
        },
        Validation::Structure,
    );
    assert_eq!(file, Path::new("manifest.json"));
    assert!(
        reason.starts_with("unsupported format version 99: this DatasetRT reads version 1"),
        "{reason}"
    );
}

#[test]
fn flipped_shard_byte_is_malformed_under_full_validation() {
    let (file, reason) = malformed(
        |d| flip_byte(&d.join("shards/000000.bin"), 100),
        Validation::Full,
    );
    assert_eq!(file, Path::new("shards/000000.bin"));
    assert!(reason.starts_with("checksum mismatch"), "{reason}");
}

#[test]
fn flipped_payload_byte_without_full_validation_fails_that_record_only() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy(tmp.path());
    let cache = Cache::open(&dir, Validation::Structure).unwrap();
    let entry = cache.entry(4);
    let (_, _, payload_start) = cache.verify_record(4).unwrap();
    drop(cache);
    flip_byte(&dir.join("shards/000001.bin"), payload_start as usize + 1);

    let cache = Cache::open(&dir, Validation::Structure).unwrap();
    for good in [0, 1, 2, 3, 5] {
        cache.payload(good).unwrap();
    }
    match cache.payload(4).unwrap_err() {
        Error::CorruptRecord {
            cache,
            shard,
            offset,
            sample,
            reason,
        } => {
            assert_eq!(cache, "golden");
            assert_eq!(shard, dir.join("shards/000001.bin"));
            assert_eq!((offset, sample), (entry.offset, 4));
            assert!(reason.starts_with("checksum mismatch"), "{reason}");
        }
        other => panic!("expected CorruptRecord, got {other:?}"),
    }
}

//! Damaged caches, each with its own exact error (the Rust side of the corpus in
//! `tests/test_corrupt_corpus.py`): every case starts from a private copy of the golden cache.

use std::path::{Path, PathBuf};

use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::Dataset;
use dataset_rt_core::verify::VerifyPolicy;
use dataset_rt_core::Error;
use dataset_rt_testkit::{
    edit_manifest, flip_byte, forge_record, golden_copy, resign, set_len, write_at,
};

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

/// The (file, reason) of a `Malformed` error of the golden copy at `dir`.
fn as_malformed(dir: &Path, err: Error) -> (PathBuf, String) {
    match err {
        Error::Malformed {
            cache,
            file,
            reason,
        } => {
            assert_eq!(cache, "golden");
            (file.strip_prefix(dir).unwrap().to_owned(), reason)
        }
        other => panic!("expected Malformed, got {other:?}"),
    }
}

/// Damages a fresh copy's `metadata.arrow` (and whatever else `damage` does), and returns the
/// malformation as (file, reason) after checking where it is reported: opening under
/// `Structure` reads none of the file and succeeds, the first use of the table refuses it (and
/// every later use, with the same error), and `Full` refuses it at open with that error.
fn malformed_metadata(damage: impl FnOnce(&Path)) -> (PathBuf, String) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy(tmp.path());
    damage(&dir);
    let cache = Cache::open(&dir, Validation::Structure).expect("opening reads no metadata");
    let Err(first) = cache.metadata() else {
        panic!("the first use of the damaged table succeeded")
    };
    let first = as_malformed(&dir, first);
    let Err(again) = cache.metadata() else {
        panic!("a later use of the damaged table succeeded")
    };
    assert_eq!(as_malformed(&dir, again), first);
    let Err(full) = Cache::open(&dir, Validation::Full) else {
        panic!("full validation opened the damaged cache")
    };
    assert_eq!(as_malformed(&dir, full), first);
    first
}

#[test]
fn the_undamaged_copy_opens() {
    let tmp = tempfile::tempdir().unwrap();
    Cache::open(&golden_copy(tmp.path()), Validation::Full)
        .unwrap()
        .verify_all()
        .unwrap();
}

/// Full validation hashes the index at open; every load reads none of it, and the read of the
/// damaged entry's record refuses it under every verify policy (the entry is checked against
/// its record header on every read).
#[test]
fn flipped_byte_in_the_index_names_index_bin() {
    // Byte 207 is the last byte of sample 5's entry: its record checksum.
    let (file, reason) = malformed(|d| flip_byte(&d.join("index.bin"), 207), Validation::Full);
    assert_eq!(file, Path::new("index.bin"));
    assert!(reason.starts_with("checksum mismatch"), "{reason}");
    assert!(
        reason.contains("the manifest says 4c797fb2f9dab943"),
        "{reason}"
    );

    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy(tmp.path());
    let offset = Cache::open(&dir, Validation::Full).unwrap().entry(5).offset;
    flip_byte(&dir.join("index.bin"), 207);
    let cache = Arc::new(Cache::open(&dir, Validation::Structure).unwrap());
    for policy in [
        VerifyPolicy::Always,
        VerifyPolicy::Once,
        VerifyPolicy::Never,
    ] {
        let ds = Dataset::new(vec![cache.clone()]).with_verify(policy);
        for good in 0..5 {
            ds.fetch(good).unwrap();
        }
        match ds.fetch(5).err().expect("the damaged entry is refused") {
            Error::CorruptRecord {
                cache,
                shard,
                offset: o,
                sample,
                reason,
            } => {
                assert_eq!(cache, "golden");
                assert_eq!(shard, dir.join("shards/000001.bin"));
                assert_eq!((o, sample), (offset, 5), "{policy:?}");
                assert!(
                    reason.contains("disagrees with index entry")
                        && reason.contains("(index.bin or the shard is damaged)"),
                    "{reason}"
                );
            }
            other => panic!("expected CorruptRecord under {policy:?}, got {other:?}"),
        }
    }
}

#[test]
fn flipped_byte_in_the_metadata_names_metadata_arrow() {
    let (file, reason) = malformed_metadata(|d| flip_byte(&d.join("metadata.arrow"), 200));
    assert_eq!(file, Path::new("metadata.arrow"));
    assert!(reason.starts_with("checksum mismatch"), "{reason}");
}

#[test]
fn truncated_shard_states_both_sizes() {
    let (file, reason) = malformed(
        |d| set_len(&d.join("shards/000001.bin"), 248),
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
fn a_directory_or_a_fifo_in_place_of_a_cache_file_is_malformed_not_a_failed_read() {
    // Neither is a read error to abort the call with (the other sources go on), and a FIFO is
    // never opened: that would wait for a writer.
    for file in ["manifest.json", "index.bin", "shards/000000.bin"] {
        for fifo in [false, true] {
            let (named, reason) = malformed(
                |d| {
                    let path = d.join(file);
                    std::fs::remove_file(&path).unwrap();
                    if fifo {
                        let c =
                            std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap();
                        // SAFETY: a valid NUL-terminated path.
                        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0);
                    } else {
                        std::fs::create_dir(&path).unwrap();
                    }
                },
                Validation::Structure,
            );
            assert_eq!(named, Path::new(file));
            assert!(reason.contains("not a regular file"), "{file}: {reason}");
        }
    }
}

#[test]
fn unknown_format_version_is_refused_naming_the_versions_read_and_written() {
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
        reason.starts_with(
            "unsupported format version 99: this DatasetRT reads versions 1, 2 and 3 (and writes 3)"
        ),
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
    flip_byte(&dir.join("shards/000001.bin"), payload_start + 1);

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

// ---------------------------------------------------------------------------------------------
// Re-signed forgeries: after the damage every checksum and the fingerprint are recomputed, the way
// an attacker would (`resign`), so that the structural checks and parsers behind the checksums
// are reached.

/// The position in `metadata.arrow` of the footer's first record batch Block
/// (offset: i64, metaDataLength: i32, padding, bodyLength: i64).
fn first_block_position(bytes: &[u8]) -> usize {
    let n = bytes.len();
    let footer_len = i32::from_le_bytes(bytes[n - 10..n - 6].try_into().unwrap()) as usize;
    let footer_start = n - 10 - footer_len;
    let footer = arrow_ipc::root_as_footer(&bytes[footer_start..n - 10]).unwrap();
    let block = footer.recordBatches().unwrap().get(0);
    let mut needle = block.offset().to_le_bytes().to_vec();
    needle.extend(block.metaDataLength().to_le_bytes());
    let at = bytes[footer_start..]
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("the block is in the footer");
    footer_start + at
}

/// Rewrites the footer's first Block, re-signs, and returns the malformation.
fn forged_block(meta_len: Option<i32>, body_len: i64) -> (PathBuf, String) {
    malformed_metadata(|d| {
        let path = d.join("metadata.arrow");
        let at = first_block_position(&std::fs::read(&path).unwrap()) as u64;
        if let Some(m) = meta_len {
            write_at(&path, at + 8, &m.to_le_bytes());
        }
        write_at(&path, at + 16, &body_len.to_le_bytes());
        resign(d, |_| {});
    })
}

#[test]
fn resigned_block_of_zero_lengths_is_malformed_metadata() {
    let (file, reason) = forged_block(Some(0), 0);
    assert_eq!(file, Path::new("metadata.arrow"));
    assert_eq!(
        reason,
        "record batch block 0 has a metadata length of 0 (at least 8 expected)"
    );
}

#[test]
fn resigned_block_of_negative_body_length_is_malformed_metadata() {
    let (file, reason) = forged_block(None, -1);
    assert_eq!(file, Path::new("metadata.arrow"));
    assert_eq!(reason, "record batch block 0 has a body length of -1");
}

#[test]
fn resigned_block_of_1_gib_body_is_refused_against_the_file_size() {
    let tmp = tempfile::tempdir().unwrap();
    let bytes = std::fs::read(golden_copy(tmp.path()).join("metadata.arrow")).unwrap();
    let at = first_block_position(&bytes);
    let offset = i64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
    let meta_len = i32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap());
    let n = bytes.len();
    let footer_start =
        n - 10 - i32::from_le_bytes(bytes[n - 10..n - 6].try_into().unwrap()) as usize;

    let (file, reason) = forged_block(None, 1 << 30);
    assert_eq!(file, Path::new("metadata.arrow"));
    assert_eq!(
        reason,
        format!(
            "record batch block 0 at offset {offset} with length {} lies past the end of its \
             region ({footer_start} bytes)",
            (1i64 << 30) + i64::from(meta_len)
        )
    );
}

#[test]
fn resigned_footer_length_past_the_file_is_malformed_metadata() {
    let (file, reason) = malformed_metadata(|d| {
        let path = d.join("metadata.arrow");
        let n = std::fs::metadata(&path).unwrap().len();
        write_at(&path, n - 10, &(i32::MAX).to_le_bytes());
        resign(d, |_| {});
    });
    assert_eq!(file, Path::new("metadata.arrow"));
    assert_eq!(
        reason,
        format!(
            "not an Arrow IPC file: its footer length {} exceeds the file",
            i32::MAX
        )
    );
}

#[test]
fn resigned_buffer_past_its_body_is_malformed_metadata() {
    let (file, reason) = malformed_metadata(|d| {
        let path = d.join("metadata.arrow");
        let bytes = std::fs::read(&path).unwrap();
        let at = first_block_position(&bytes);
        let offset = i64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
        let meta_len = i32::from_le_bytes(bytes[at + 8..at + 12].try_into().unwrap()) as usize;
        let meta = &bytes[offset + 8..offset + meta_len];
        let message = arrow_ipc::root_as_message(meta).unwrap();
        let buffers = message.header_as_record_batch().unwrap().buffers().unwrap();
        // Buffer 1 (the offsets of the str column `sample_id`): offset i64, length i64.
        let pos = buffers.bytes().as_ptr() as usize - bytes.as_ptr() as usize + 16;
        write_at(&path, pos as u64, &(1i64 << 40).to_le_bytes());
        resign(d, |_| {});
    });
    assert_eq!(file, Path::new("metadata.arrow"));
    assert!(
        reason.starts_with(&format!(
            "record batch block 0, buffer 1, at offset {} with length ",
            1i64 << 40
        )) && reason.contains("lies past the end of its region"),
        "{reason}"
    );
}

#[test]
fn resigned_sample_count_whose_index_size_wraps_is_malformed() {
    let (file, reason) = malformed(
        |d| {
            resign(d, |m| {
                m.num_samples += 1 << 59;
                m.shards[0].records += 1 << 59;
            })
        },
        Validation::Structure,
    );
    assert_eq!(file, Path::new("index.bin"));
    assert_eq!(
        reason,
        format!(
            "the manifest says 208 bytes, {} samples need more than 2**64",
            (1u64 << 59) + 6
        )
    );
}

#[test]
fn resigned_record_counts_whose_sum_wraps_are_malformed() {
    let (file, reason) = malformed(
        |d| {
            resign(d, |m| {
                // 3 + (2**64 - 3) + 6 wraps to 6, the true number of samples.
                m.shards[0].records = 3u64.wrapping_neg();
                m.shards[1].records = 9;
            })
        },
        Validation::Structure,
    );
    assert_eq!(file, Path::new("manifest.json"));
    assert_eq!(
        reason,
        "shards hold more than 2**64 records, num_samples is 6"
    );
}

/// A forged sample count with a matching sparse `index.bin` of 64 MiB: the shards cannot hold
/// that many records, which is refused from the sizes alone, before the index is hashed (the
/// index's checksum is left stale on purpose: hashing it first would report that instead).
#[test]
fn forged_sample_count_is_refused_by_sizes_before_the_index_is_hashed() {
    let n: u64 = 1 << 21;
    let (file, reason) = malformed(
        |d| {
            set_len(&d.join("index.bin"), 16 + 32 * n);
            edit_manifest(d, |m| {
                m.num_samples = n;
                m.index.bytes = 16 + 32 * n;
                m.shards[0].records = n - 3;
            });
        },
        Validation::Structure,
    );
    assert_eq!(file, Path::new("shards/000000.bin"));
    assert_eq!(
        reason,
        format!(
            "the manifest says 528 bytes for {} records, which need at least 16 + 40 per record",
            n - 3
        )
    );
}

/// Every file's size is checked before any file is hashed: a stale index checksum is not what
/// is reported when a later file has the wrong size.
#[test]
fn file_sizes_are_checked_before_any_checksum() {
    let (file, reason) = malformed(
        |d| {
            flip_byte(&d.join("index.bin"), 100);
            set_len(&d.join("shards/000001.bin"), 480);
        },
        Validation::Structure,
    );
    assert_eq!(file, Path::new("shards/000001.bin"));
    assert_eq!(reason, "size is 480 bytes, the manifest says 496");
}

/// The first record of the golden cache stored LZ4-compressed.
fn first_compressed(cache: &Cache) -> u64 {
    (0..cache.len())
        .find(|&s| cache.entry(s).flags & dataset_rt_core::format::FLAG_LZ4 != 0)
        .expect("the golden cache has a compressed record")
}

/// A compressed record whose raw length (header and index, re-signed) is more than LZ4 can
/// produce from its stored bytes is refused before anything is allocated for it.
#[test]
fn resigned_lz4_raw_length_beyond_what_lz4_can_expand_is_a_corrupt_record() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy(tmp.path());
    let cache = Cache::open(&dir, Validation::Structure).unwrap();
    let sample = first_compressed(&cache);
    let e = cache.entry(sample);
    let (_, h, _) = cache.verify_record(sample).unwrap();
    drop(cache);

    // The raw length in the record header and its index entry, both re-signed.
    let raw_len: u32 = 1 << 31;
    forge_record(&dir, sample, |h| h.raw_len = raw_len);

    let cache = Arc::new(Cache::open(&dir, Validation::Full).unwrap());
    // The bound is a structural check, not the checksum: it holds under every verify policy.
    let never = Dataset::new(vec![cache.clone()]).with_verify(VerifyPolicy::Never);
    assert_refused_by_payload_and_fetch(
        &cache,
        &never,
        sample,
        e.offset,
        &format!(
            "raw length {raw_len} is more than LZ4 can expand {} stored bytes to",
            h.stored_len
        ),
    );
}

/// `Cache::payload` and `Dataset::fetch` (under `never`'s policy) both refuse `sample` as a
/// corrupt record at `offset`, for `reason`.
fn assert_refused_by_payload_and_fetch(
    cache: &Cache,
    never: &Dataset,
    sample: u64,
    offset: u64,
    reason: &str,
) {
    let errors = [
        cache.payload(sample).unwrap_err(),
        never
            .fetch(sample)
            .err()
            .expect("refused under verify=\"never\""),
    ];
    for err in errors {
        match err {
            Error::CorruptRecord {
                sample: s,
                offset: o,
                reason: r,
                ..
            } => {
                assert_eq!((s, o), (sample, offset));
                assert_eq!(r, reason);
            }
            other => panic!("expected CorruptRecord, got {other:?}"),
        }
    }
}

/// A record flagged LZ4 in a cache whose manifest says it was written without compression is
/// refused under every verify policy: readers size their read-ahead on that manifest setting
/// (nothing to decompress), so such a record must not be decompressed.
#[test]
fn resigned_manifest_without_compression_refuses_a_compressed_record() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy(tmp.path());
    let cache = Cache::open(&dir, Validation::Structure).unwrap();
    let sample = first_compressed(&cache);
    let offset = cache.entry(sample).offset;
    drop(cache);
    resign(&dir, |m| {
        m.compression = dataset_rt_core::format::Compression::NONE;
    });

    let cache = Arc::new(Cache::open(&dir, Validation::Full).unwrap());
    assert!(!cache.may_hold_compressed());
    let never = Dataset::new(vec![cache.clone()]).with_verify(VerifyPolicy::Never);
    assert_eq!(never.decoded_bytes(sample), 0);
    assert_refused_by_payload_and_fetch(
        &cache,
        &never,
        sample,
        offset,
        "the record is stored LZ4-compressed, but the manifest says the cache was written \
         without compression",
    );
}

//! `ReaderConfig.verify`: what each policy catches, on private copies of the golden cache.

use std::os::fd::IntoRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::{Dataset, Fetched};
use dataset_rt_core::verify::{VerifiedSet, VerifyPolicy};
use dataset_rt_core::Error;
// `flip_byte` flips one byte in place, as another writer would: an open map sees the change.
use dataset_rt_testkit::{flip_byte, golden_copy, golden_copy_of};

/// A golden copy and where the stored payload of `sample` starts (shard file, offset).
fn copy_with_payload_of(tmp: &Path, sample: u64) -> (PathBuf, PathBuf, u64) {
    let dir = golden_copy(tmp);
    let cache = Cache::open(&dir, Validation::Structure).unwrap();
    let (e, _, start) = cache.verify_record(sample).unwrap();
    let shard = cache.shard_path(e.shard);
    (dir, shard, start)
}

fn open(dir: &Path, policy: VerifyPolicy) -> Dataset {
    let cache = Cache::open(dir, Validation::Structure).unwrap();
    Dataset::new(vec![Arc::new(cache)]).with_verify(policy)
}

fn bytes(ds: &Dataset, fetched: Fetched) -> Vec<u8> {
    ds.fetched_data(fetched).into_owned()
}

/// The error of a corrupt record: it names the shard file and the sample.
fn assert_corrupt(err: Error, shard: &Path, sample: u64, reason_starts: &str) {
    match err {
        Error::CorruptRecord {
            cache,
            shard: file,
            sample: s,
            reason,
            ..
        } => {
            assert_eq!(cache, "golden");
            assert_eq!(file, shard);
            assert_eq!(s, sample);
            assert!(reason.starts_with(reason_starts), "{reason}");
        }
        other => panic!("expected CorruptRecord, got {other:?}"),
    }
}

/// A record stored raw: a flipped payload byte changes the bytes read, nothing else.
const SAMPLE: u64 = 4;

#[test]
fn the_default_policy_is_always() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = open(&golden_copy(tmp.path()), VerifyPolicy::Always);
    assert_eq!(ds.verify_policy(), VerifyPolicy::Always);
    let plain = Dataset::new(ds.caches.clone());
    assert_eq!(plain.verify_policy(), VerifyPolicy::Always);
    assert_eq!(plain.verified_count(), None);
}

#[test]
fn every_policy_reads_the_same_bytes_from_a_sound_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy(tmp.path());
    let reference = open(&dir, VerifyPolicy::Always);
    for policy in [VerifyPolicy::Once, VerifyPolicy::Never] {
        let ds = open(&dir, policy);
        for _ in 0..2 {
            for g in 0..ds.len() {
                let want = bytes(&reference, reference.fetch(g).unwrap());
                assert_eq!(
                    bytes(&ds, ds.fetch(g).unwrap()),
                    want,
                    "{policy:?} sample {g}"
                );
            }
        }
    }
}

#[test]
fn always_catches_corruption_on_every_read() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, shard, start) = copy_with_payload_of(tmp.path(), SAMPLE);
    let ds = open(&dir, VerifyPolicy::Always);
    ds.fetch(SAMPLE).unwrap();
    flip_byte(&shard, start + 1);
    for _ in 0..2 {
        assert_corrupt(
            ds.fetch(SAMPLE).err().expect("a corrupt record"),
            &shard,
            SAMPLE,
            "checksum mismatch",
        );
    }
}

#[test]
fn once_catches_a_record_corrupted_before_its_first_read_and_never_marks_it() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, shard, start) = copy_with_payload_of(tmp.path(), SAMPLE);
    flip_byte(&shard, start + 1);
    let ds = open(&dir, VerifyPolicy::Once);
    assert_eq!(ds.verified_count(), Some(0));
    for _ in 0..2 {
        assert_corrupt(
            ds.fetch(SAMPLE).err().expect("a corrupt record"),
            &shard,
            SAMPLE,
            "checksum mismatch",
        );
    }
    for good in (0..ds.len()).filter(|&g| g != SAMPLE) {
        ds.fetch(good).unwrap();
    }
    assert_eq!(ds.verified_count(), Some(ds.len() - 1));
}

#[test]
fn once_skips_the_hash_after_a_verified_read_and_always_does_not() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, shard, start) = copy_with_payload_of(tmp.path(), SAMPLE);
    let once = open(&dir, VerifyPolicy::Once);
    let sound = bytes(&once, once.fetch(SAMPLE).unwrap());
    assert_eq!(once.verified_count(), Some(1));
    flip_byte(&shard, start + 1);
    // The documented limit of "once": a change after the first verified read goes unseen...
    let changed = bytes(&once, once.fetch(SAMPLE).unwrap());
    assert_ne!(changed, sound);
    // ...while "always" over the same cache catches it, and the bitmap is the dataset's own.
    let always = Dataset::new(once.caches.clone());
    assert_corrupt(
        always.fetch(SAMPLE).err().expect("a corrupt record"),
        &shard,
        SAMPLE,
        "checksum mismatch",
    );
    let fresh_once = Dataset::new(once.caches.clone()).with_verify(VerifyPolicy::Once);
    assert_corrupt(
        fresh_once.fetch(SAMPLE).err().expect("a corrupt record"),
        &shard,
        SAMPLE,
        "checksum mismatch",
    );
}

/// Before format v3 an index entry lacks the metadata length, so every read under "once" reads
/// the record's header again and checks it against the entry.
#[test]
fn once_still_runs_the_structural_checks_on_every_read_before_v3() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy(tmp.path());
    let ds = open(&dir, VerifyPolicy::Once);
    ds.fetch(SAMPLE).unwrap();
    let e = ds.caches[0].entry(SAMPLE);
    let shard = ds.caches[0].shard_path(e.shard);
    // The record header's sample number no longer matches the index.
    flip_byte(&shard, e.offset + 24);
    assert_corrupt(
        ds.fetch(SAMPLE).err().expect("a corrupt record"),
        &shard,
        SAMPLE,
        "record header",
    );
}

/// From format v3 on, "once" serves a verified record from its index entry, which matched the
/// record's header when the record was verified: damage to the header after that goes unseen,
/// as damage to the payload does. "always" still catches it, and the entry is still bounded.
#[test]
fn once_serves_a_verified_v3_record_from_its_index_entry() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy_of(tmp.path(), 3);
    for sample in [SAMPLE, 2] {
        // Sample 2 is stored LZ4-compressed: it is decoded from the entry's lengths.
        let ds = open(&dir, VerifyPolicy::Once);
        let sound = bytes(&ds, ds.fetch(sample).unwrap());
        let e = ds.caches[0].entry(sample);
        let shard = ds.caches[0].shard_path(e.shard);
        // The record header's sample number no longer matches the index.
        flip_byte(&shard, e.offset + 32);
        assert_eq!(
            bytes(&ds, ds.fetch(sample).unwrap()),
            sound,
            "sample {sample}"
        );
        let always = Dataset::new(ds.caches.clone());
        assert_corrupt(
            always.fetch(sample).err().expect("a corrupt record"),
            &shard,
            sample,
            "record header",
        );
        flip_byte(&shard, e.offset + 32);
    }

    // An entry moved past the end of its shard is refused, not read out of bounds.
    let ds = open(&dir, VerifyPolicy::Once);
    ds.fetch(SAMPLE).unwrap();
    let index = dir.join("index.bin");
    let at = 16 + 40 * SAMPLE + 7; // the offset's most significant byte
    flip_byte(&index, at);
    let shard = ds.caches[0].shard_path(ds.caches[0].entry(SAMPLE).shard);
    assert_corrupt(
        ds.fetch(SAMPLE).err().expect("a corrupt record"),
        &shard,
        SAMPLE,
        "record lies past the end of its shard",
    );
}

#[test]
fn never_skips_the_hash_but_keeps_the_structural_checks() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, shard, start) = copy_with_payload_of(tmp.path(), SAMPLE);
    let ds = open(&dir, VerifyPolicy::Never);
    let sound = bytes(&ds, ds.fetch(SAMPLE).unwrap());
    flip_byte(&shard, start + 1);
    assert_ne!(bytes(&ds, ds.fetch(SAMPLE).unwrap()), sound);
    assert_eq!(ds.verified_count(), None);

    let e = ds.caches[0].entry(SAMPLE);
    flip_byte(&shard, e.offset + 24);
    assert_corrupt(
        ds.fetch(SAMPLE).err().expect("a corrupt record"),
        &shard,
        SAMPLE,
        "record header",
    );
}

/// The producer's side: a dataset over the same caches, attached to a copy of `owner`'s memfd.
fn attached_to(owner: &Dataset, dir: &Path) -> Dataset {
    let fd = owner
        .shared_verified_fd()
        .expect("a dataset under Once shares its set")
        .try_clone_to_owned()
        .unwrap()
        .into_raw_fd();
    let set = VerifiedSet::attach(fd, owner.len()).unwrap();
    let cache = Cache::open(dir, Validation::Structure).unwrap();
    Dataset::new(vec![Arc::new(cache)])
        .with_verified_set(set)
        .unwrap()
}

#[test]
fn datasets_sharing_a_set_skip_what_either_verified() {
    let tmp = tempfile::tempdir().unwrap();
    let (dir, shard, start) = copy_with_payload_of(tmp.path(), SAMPLE);
    let owner = open(&dir, VerifyPolicy::Once);
    let producer = attached_to(&owner, &dir);
    assert_eq!(producer.verify_policy(), VerifyPolicy::Once);
    assert!(
        producer.shared_verified_fd().is_none(),
        "only the creator hands it on"
    );
    let len = owner.len();
    for g in (0..len).filter(|&g| g != SAMPLE) {
        producer.fetch(g).unwrap();
    }
    assert_eq!(owner.verified_count(), Some(len - 1));
    let sound = bytes(&owner, owner.fetch(SAMPLE).unwrap());
    assert_eq!(producer.verified_count(), Some(len));
    flip_byte(&shard, start + 1);
    // Verified by the owner: the producer does not hash it again, and reads the change...
    assert_ne!(bytes(&producer, producer.fetch(SAMPLE).unwrap()), sound);
    // ...which a dataset with a set of its own catches.
    assert_corrupt(
        open(&dir, VerifyPolicy::Once)
            .fetch(SAMPLE)
            .err()
            .expect("a corrupt record"),
        &shard,
        SAMPLE,
        "checksum mismatch",
    );
}

#[test]
fn a_set_of_another_length_is_refused_by_the_dataset() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy(tmp.path());
    let ds = open(&dir, VerifyPolicy::Never);
    let len = ds.len();
    let err = Dataset::new(ds.caches.clone())
        .with_verified_set(VerifiedSet::new(len + 1))
        .err()
        .expect("another length")
        .to_string();
    assert!(
        err.contains(&format!(
            "covers {} samples, this dataset has {len}",
            len + 1
        )),
        "{err}"
    );
}

//! Cache sets: publication by one rename once every part is published, reuse of published parts,
//! the set's fingerprint, and a corpus of damaged set manifests, each with its exact error.

use std::path::Path;
use std::sync::Arc;

use dataset_rt_core::cache::Validation;
use dataset_rt_core::cache_set::{
    check_part_names, combined_fingerprint, is_set_dir, part_name, staging_dir, CacheSet, Opened,
    PartResult, PartState, SetBuild, SetLedger, SetStart, SET_MANIFEST_FILE,
};
use dataset_rt_core::dataset::Dataset;
use dataset_rt_core::metadata::MetaValue;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::writer::{validate_names, CacheLock, SampleInput, WriterOptions};
use dataset_rt_core::Error;
use dataset_rt_testkit::{dir_entries, sample, write_cache, writer_options};

fn opts() -> WriterOptions {
    WriterOptions {
        prefetch_size: 8,
        validate: false,
        shard_size: 4096,
        ..writer_options()
    }
}

fn samples(part: usize, n: usize) -> Vec<SampleInput> {
    (0..n)
        .map(|i| {
            let label = MetaValue::Int((part * 1000 + i) as i64);
            sample(vec![part as u8; 10 + i], &[("label", label)])
        })
        .collect()
}

fn building(base: &Path, name: &str, parts: usize) -> SetBuild {
    match SetBuild::begin(base, name, parts, &|| Ok(())).unwrap() {
        SetStart::Building(b) => b,
        SetStart::Published(dir) => panic!("{} is published already", dir.display()),
    }
}

fn write_part(pool: &Arc<Pool>, build: &SetBuild, index: usize) {
    write_cache(
        pool,
        build.staging(),
        &build.part_name(index),
        opts(),
        samples(index, 5 + index),
    );
}

/// Builds set `name` of `parts` parts under `base`, every part written, and publishes it.
fn build_set(pool: &Arc<Pool>, base: &Path, name: &str, parts: usize) -> CacheSet {
    let build = building(base, name, parts);
    for i in 0..parts {
        write_part(pool, &build, i);
    }
    build.publish(Validation::Structure).unwrap()
}

/// The error of publishing `build`, which must be refused (`what` says what would be wrong).
fn refused(build: SetBuild, what: &str) -> String {
    match build.publish(Validation::Structure) {
        Ok(_) => panic!("{what}"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn parts_whose_metadata_columns_disagree_on_a_type_are_not_published_as_a_set() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    let build = building(tmp.path(), "s", 2);
    write_part(&pool, &build, 0); // "label" is an int
    let cat = (0..3).map(|i| sample(vec![i; 4], &[("label", MetaValue::Str("cat".into()))]));
    write_cache(&pool, build.staging(), &build.part_name(1), opts(), cat);
    let staging = build.staging().to_owned();
    let text = refused(
        build,
        "a set whose parts disagree on a column's type was published",
    );
    assert!(
        text.contains("cache set \"s\" cannot be published")
            && text.contains("metadata column \"label\" is str in cache \"s.part-000001\"")
            && text.contains("but int in an earlier cache")
            && text.contains(&staging.display().to_string()),
        "{text}"
    );
    // Nothing was published; the parts stay staged.
    assert!(!tmp.path().join("s").exists());
    assert!(staging.join("s.part-000001").exists());
}

fn malformed_reason(err: Error) -> (String, String) {
    match err {
        Error::Malformed { file, reason, .. } => (
            file.file_name().unwrap().to_string_lossy().into_owned(),
            reason,
        ),
        other => panic!("expected a malformed set, got {other}"),
    }
}

#[test]
fn a_set_is_published_only_once_every_part_is() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let build = building(tmp.path(), "s", 3);
    assert_eq!(build.staging(), staging_dir(tmp.path(), "s"));
    write_part(&pool, &build, 0);
    write_part(&pool, &build, 2);
    assert!(!tmp.path().join("s").exists());
    let err = refused(build, "published with a part missing");
    assert!(
        err.contains("part 1") && err.contains("s.part-000001") && err.contains("not published"),
        "{err}"
    );
    // Nothing appeared, and the published parts are kept for the next build.
    assert!(!tmp.path().join("s").exists());
    let build = building(tmp.path(), "s", 3);
    let states = build.part_states(Validation::Structure).unwrap();
    assert!(matches!(states[0], PartState::Published(ref c) if c.len() == 5));
    assert!(matches!(states[1], PartState::Missing));
    assert!(matches!(states[2], PartState::Published(ref c) if c.len() == 7));
    write_part(&pool, &build, 1);
    let set = build.publish(Validation::Structure).unwrap();
    assert_eq!(set.len(), 18);
    assert!(!staging_dir(tmp.path(), "s").exists());
    assert!(is_set_dir(&tmp.path().join("s")));
    // No part lock or leftover travels into the published set.
    assert_eq!(
        dir_entries(&tmp.path().join("s")),
        [
            "s.part-000000",
            "s.part-000001",
            "s.part-000002",
            "set.json"
        ]
    );
    // A later build finds it published.
    assert!(matches!(
        SetBuild::begin(tmp.path(), "s", 3, &|| Ok(())).unwrap(),
        SetStart::Published(_)
    ));
}

#[test]
fn the_set_fingerprint_is_the_fingerprint_of_a_dataset_of_its_parts() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let set = build_set(&pool, tmp.path(), "s", 3);
    let part_fps: Vec<String> = set
        .parts
        .iter()
        .map(|c| c.manifest.fingerprint.clone())
        .collect();
    assert_eq!(
        set.fingerprint(),
        combined_fingerprint(part_fps.iter().map(String::as_str))
    );
    let opened = Opened::open(&tmp.path().join("s"), Validation::Full).unwrap();
    assert_eq!(opened.len(), set.len());
    let caches: Vec<_> = opened.into_caches().into_iter().map(Arc::new).collect();
    let names: Vec<&str> = caches.iter().map(|c| c.name()).collect();
    assert_eq!(
        names,
        [part_name("s", 0), part_name("s", 1), part_name("s", 2)]
    );
    assert_eq!(Dataset::new(caches).fingerprint(), set.fingerprint());
    set.verify_all().unwrap();

    // The same parts written again give the same set; another partitioning another one.
    let again = tempfile::tempdir().unwrap();
    assert_eq!(
        build_set(&pool, again.path(), "s", 3).fingerprint(),
        set.fingerprint()
    );
    let other = tempfile::tempdir().unwrap();
    assert_ne!(
        build_set(&pool, other.path(), "s", 2).fingerprint(),
        set.fingerprint()
    );
}

#[test]
fn a_published_set_wins_over_a_staging_directory_and_a_cache_opens_as_a_cache() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    write_cache(&pool, tmp.path(), "plain", opts(), samples(0, 3));
    assert!(!is_set_dir(&tmp.path().join("plain")));
    match Opened::open(&tmp.path().join("plain"), Validation::Structure).unwrap() {
        Opened::Cache(c) => assert_eq!(c.len(), 3),
        Opened::Set(_) => panic!("a cache opened as a set"),
    }
    // A set of that name finds the cache published and builds nothing.
    assert!(matches!(
        SetBuild::begin(tmp.path(), "plain", 2, &|| Ok(())).unwrap(),
        SetStart::Published(_)
    ));
    assert!(!staging_dir(tmp.path(), "plain").exists());
}

#[test]
fn bad_names_and_part_counts_are_refused_before_anything_is_created() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, parts, expected) in [
        ("", 1, "invalid cache set name"),
        (".hidden", 1, "invalid cache set name"),
        ("a/b", 1, "invalid cache set name"),
        ("ok", 0, "has 0 parts"),
    ] {
        let err = match SetBuild::begin(tmp.path(), name, parts, &|| Ok(())) {
            Ok(_) => panic!("{name:?} with {parts} parts was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(expected), "{name:?}: {err}");
    }
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 0);
}

#[test]
fn the_caches_of_one_call_have_unique_valid_names_and_no_source_takes_a_parts_name() {
    let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    validate_names(&names(&["a", "b", "s.part-000000"]), "source name", "why").unwrap();
    for (given, what, expected) in [
        (
            names(&["a", "b", "a"]),
            "source name",
            "invalid source name: two sources are named \"a\": why",
        ),
        (
            names(&["ok", "../up"]),
            "cache name",
            "invalid cache name: \"../up\" is not a plain directory name",
        ),
        (names(&[".hidden"]), "cache name", "invalid cache name"),
    ] {
        let err = validate_names(&given, what, "why").unwrap_err().to_string();
        assert!(err.starts_with(expected), "{given:?}: {err}");
    }
    // A plain source named like a part of a set in the same call.
    check_part_names(&["a", "s.part-000002"], &[("s", 2)]).unwrap();
    let err = check_part_names(&["a", "s.part-000001"], &[("t", 3), ("s", 2)])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("source \"s.part-000001\" has the name of part 1 of cache set \"s\""),
        "{err}"
    );
}

/// Builds a published set and rewrites its `set.json` with `edit` applied to the JSON value.
fn damaged(edit: impl FnOnce(&mut serde_json::Value)) -> (tempfile::TempDir, Error) {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    build_set(&pool, tmp.path(), "s", 2);
    let path = tmp.path().join("s").join(SET_MANIFEST_FILE);
    let mut value: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    edit(&mut value);
    std::fs::write(&path, serde_json::to_vec(&value).unwrap()).unwrap();
    let err = match CacheSet::open(&tmp.path().join("s"), Validation::Structure) {
        Ok(_) => panic!("a damaged set manifest was accepted"),
        Err(e) => e,
    };
    (tmp, err)
}

/// A change made to a set manifest's JSON.
type Edit = Box<dyn FnOnce(&mut serde_json::Value)>;

#[test]
fn each_damaged_set_manifest_gives_its_own_error() {
    let cases: Vec<(&str, Edit)> = vec![
        (
            "not a DatasetRT set manifest",
            Box::new(|v| v["format"] = "dataset-rt-cache".into()),
        ),
        (
            "unsupported set format version 9",
            Box::new(|v| v["format_version"] = 9.into()),
        ),
        ("unknown field `extra`", Box::new(|v| v["extra"] = 1.into())),
        (
            "the set manifest names set \"t\"",
            Box::new(|v| v["name"] = "t".into()),
        ),
        (
            "part 1 is named \"s.part-000007\"",
            Box::new(|v| v["parts"][1]["name"] = "s.part-000007".into()),
        ),
        (
            "the parts hold 11 samples, num_samples is 12",
            Box::new(|v| v["num_samples"] = 12.into()),
        ),
        (
            "fingerprint mismatch",
            Box::new(|v| v["fingerprint"] = "0".repeat(32).into()),
        ),
        (
            "has 0 parts",
            Box::new(|v| {
                v["parts"] = serde_json::Value::Array(vec![]);
                v["num_samples"] = 0.into();
            }),
        ),
    ];
    for (expected, edit) in cases {
        let (_tmp, err) = damaged(edit);
        let (file, reason) = malformed_reason(err);
        assert_eq!(file, SET_MANIFEST_FILE);
        assert!(reason.contains(expected), "{expected:?} not in {reason:?}");
    }
}

#[test]
fn a_part_replaced_or_missing_after_publication_is_refused() {
    // A part's fingerprint in set.json (and the set's recomputed) no longer match the part.
    let (_tmp, err) = damaged(|v| {
        let fp = "1".repeat(32);
        v["parts"][0]["fingerprint"] = fp.clone().into();
        let other = v["parts"][1]["fingerprint"].as_str().unwrap().to_owned();
        v["fingerprint"] = combined_fingerprint([fp.as_str(), other.as_str()]).into();
    });
    let (file, reason) = malformed_reason(err);
    assert_eq!(file, SET_MANIFEST_FILE);
    assert!(
        reason.contains("part 0 (s.part-000000) has fingerprint") && reason.contains("replaced"),
        "{reason}"
    );

    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    build_set(&pool, tmp.path(), "s", 2);
    std::fs::remove_dir_all(tmp.path().join("s").join("s.part-000001")).unwrap();
    let err = match CacheSet::open(&tmp.path().join("s"), Validation::Structure) {
        Ok(_) => panic!("a set with a part missing opened"),
        Err(e) => e,
    };
    let (file, reason) = malformed_reason(err);
    assert_eq!(file, "s.part-000001");
    assert!(reason.contains("part 1 is missing"), "{reason}");
}

#[test]
fn a_malformed_part_in_staging_is_reported_and_blocks_publication() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    let build = building(tmp.path(), "s", 2);
    write_part(&pool, &build, 0);
    write_part(&pool, &build, 1);
    let manifest = build.staging().join("s.part-000001").join("manifest.json");
    std::fs::remove_file(&manifest).unwrap();
    let states = build.part_states(Validation::Structure).unwrap();
    match &states[1] {
        PartState::Malformed(reason) => assert!(reason.contains("manifest.json"), "{reason}"),
        _ => panic!("a part without its manifest is not malformed"),
    }
    let err = refused(build, "published with a malformed part");
    assert!(
        err.contains("part 1 is malformed") && err.contains("remove"),
        "{err}"
    );
    assert!(!tmp.path().join("s").exists());
}

#[test]
fn the_parts_of_an_earlier_build_with_more_parts_are_not_published_with_the_set() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    // A build of 4 parts published parts 1 to 3 and stopped (part 0 failed).
    let build = building(tmp.path(), "s", 4);
    for i in 1..4 {
        write_part(&pool, &build, i);
    }
    assert!(dir_entries(build.staging()).contains(&".s.part-000003.lock".to_owned()));
    drop(build);
    // The user repartitioned into 2 parts.
    let build = building(tmp.path(), "s", 2);
    write_part(&pool, &build, 0);
    let set = build.publish(Validation::Structure).unwrap();
    assert_eq!(set.len(), 5 + 6);
    assert_eq!(
        dir_entries(&tmp.path().join("s")),
        ["s.part-000000", "s.part-000001", "set.json"]
    );
    CacheSet::open(&tmp.path().join("s"), Validation::Full).unwrap();
}

#[test]
fn a_stranger_in_staging_or_a_live_writer_of_an_earlier_part_refuses_publication() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    let build = building(tmp.path(), "s", 3);
    for i in 0..3 {
        write_part(&pool, &build, i);
    }
    drop(build);
    let build = building(tmp.path(), "s", 1);
    let stranger = build.staging().join("notes");
    std::fs::create_dir(&stranger).unwrap();
    std::fs::write(stranger.join("keep.txt"), b"mine").unwrap();
    let err = refused(build, "published a set with a stranger in it");
    assert!(
        err.contains("no part of it") && err.contains(&stranger.display().to_string()),
        "{err}"
    );
    assert!(!tmp.path().join("s").exists());
    assert_eq!(std::fs::read(stranger.join("keep.txt")).unwrap(), b"mine");
    std::fs::remove_dir_all(&stranger).unwrap();
    // A writer of part 2 of the earlier build that is still alive holds its lock.
    let build = building(tmp.path(), "s", 1);
    let writer = CacheLock::acquire(build.staging(), "s.part-000002").unwrap();
    let err = refused(
        build,
        "published while a writer of an earlier part is alive",
    );
    assert!(
        err.contains("s.part-000002") && err.contains("still being written"),
        "{err}"
    );
    assert!(!tmp.path().join("s").exists());
    drop(writer);
    let build = building(tmp.path(), "s", 1);
    let set = build.publish(Validation::Structure).unwrap();
    assert_eq!(set.len(), 5);
    assert_eq!(
        dir_entries(&tmp.path().join("s")),
        ["s.part-000000", "set.json"]
    );
}

#[test]
fn a_dead_builds_manifest_in_staging_is_rewritten_at_publication() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    let build = building(tmp.path(), "s", 1);
    write_part(&pool, &build, 0);
    // A build that died between writing set.json and its rename left half a manifest.
    std::fs::write(build.staging().join(SET_MANIFEST_FILE), b"{\"format\": ").unwrap();
    drop(build);
    let build = building(tmp.path(), "s", 1);
    let set = build.publish(Validation::Structure).unwrap();
    assert_eq!(set.len(), 5);
    CacheSet::open(&tmp.path().join("s"), Validation::Full).unwrap();
}

#[test]
fn the_ledger_keeps_published_parts_and_publishes_once_every_part_is_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    let build = building(tmp.path(), "s", 3);
    write_part(&pool, &build, 1);
    let mut ledger = SetLedger::new(&build, Validation::Structure).unwrap();
    assert_eq!((ledger.len(), ledger.published()), (3, 1));
    assert_eq!(ledger.missing(), vec![0, 2], "the published part 1 is kept");
    for i in [0, 2] {
        write_part(&pool, &build, i);
        ledger.record(i, PartResult::from_report("written", None, 5 + i as u64));
    }
    ledger.record(7, PartResult::Failed("beyond the set".into()));
    assert!(ledger.missing().is_empty());
    assert_eq!(ledger.published(), 3);
    let end = ledger.conclude(build, Validation::Structure);
    let set = match end.set {
        Ok(set) => set,
        Err(msg) => panic!("not published: {msg}"),
    };
    assert_eq!(set.len(), 5 + 6 + 7);
    let results: Vec<_> = end.parts.iter().map(|p| p.result.clone()).collect();
    assert_eq!(
        results,
        vec![
            PartResult::Written(5),
            PartResult::Loaded(6),
            PartResult::Written(7)
        ]
    );
    for (i, part) in end.parts.iter().enumerate() {
        assert_eq!(part.name, part_name("s", i));
        assert_eq!(part.path, tmp.path().join("s").join(&part.name));
        assert!(part.path.is_dir(), "{}", part.path.display());
    }
}

#[test]
fn a_failed_or_unreported_part_keeps_the_set_unpublished_and_the_others_staged() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    let build = building(tmp.path(), "s", 3);
    let staging = build.staging().to_owned();
    write_part(&pool, &build, 0);
    let mut ledger = SetLedger::new(&build, Validation::Structure).unwrap();
    ledger.record(
        1,
        PartResult::from_report("write_error", Some("disk full".into()), 0),
    );
    ledger.record(2, PartResult::from_report("write_error", None, 0));
    let end = ledger.conclude(build, Validation::Structure);
    let msg = match end.set {
        Ok(_) => panic!("published with failed parts"),
        Err(msg) => msg,
    };
    assert!(
        msg.contains("2 of its 3 parts failed (parts 1, 2)")
            && msg.contains("the 1 published part is kept")
            && msg.contains("the next build writes only the missing ones"),
        "{msg}"
    );
    assert_eq!(end.parts[0].result, PartResult::Loaded(5));
    assert_eq!(end.parts[1].result, PartResult::Failed("disk full".into()));
    assert_eq!(
        end.parts[2].result,
        PartResult::Failed("the part failed".into())
    );
    assert_eq!(end.parts[0].path, staging.join(part_name("s", 0)));
    assert!(end.parts[0].path.is_dir() && !tmp.path().join("s").exists());
    // The lock is released: the next build begins at once and finds part 0 kept.
    let again = building(tmp.path(), "s", 3);
    let ledger = SetLedger::new(&again, Validation::Structure).unwrap();
    assert_eq!(ledger.missing(), vec![1, 2]);
    // A part nobody reported is a failure too.
    let end = ledger.conclude(again, Validation::Structure);
    assert_eq!(
        end.parts[1].result,
        PartResult::Failed("the part was not written".into())
    );
}

#[test]
fn a_malformed_part_is_an_outcome_that_says_how_to_rewrite_it() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    let build = building(tmp.path(), "s", 2);
    write_part(&pool, &build, 0);
    write_part(&pool, &build, 1);
    let part = build.staging().join(part_name("s", 1));
    std::fs::remove_file(part.join("manifest.json")).unwrap();
    let ledger = SetLedger::new(&build, Validation::Structure).unwrap();
    assert!(
        ledger.missing().is_empty(),
        "a malformed part is not written over"
    );
    assert_eq!(ledger.published(), 1);
    let end = ledger.conclude(build, Validation::Structure);
    let set = end.set.as_ref().err().expect("not published");
    assert!(
        set.contains("1 of its 2 parts failed (part 1)")
            && set.contains("remove the malformed parts"),
        "{set}"
    );
    match &end.parts[1].result {
        PartResult::Malformed(msg) => assert!(
            msg.contains("manifest.json") && msg.contains(&format!("remove {}", part.display())),
            "{msg}"
        ),
        other => panic!("expected a malformed part, got {other:?}"),
    }
}

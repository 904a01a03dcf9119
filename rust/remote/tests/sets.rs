//! Cache sets on object storage (over an in-memory store): a pushed set opens as its parts and
//! reads exactly as the local set; the set appears only with its manifest; a part replaced after
//! publication is refused; a set manifest is published over parts that tasks pushed one by one;
//! a URL holds a cache or a set, never both; and a set is pulled and listed.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use common::write_cache;
use dataset_rt_core::cache::Validation;
use dataset_rt_core::cache_set::{part_name, CacheSet, SetBuild, SetStart};
use dataset_rt_core::dataset::{Dataset, EpochReader, ReadOptions, WeightTable};
use dataset_rt_core::pool::Pool;
use dataset_rt_remote::{
    ls, open_published, publish_set_manifest, published_parts, pull, push, push_set, Error,
    FetchPolicy, Published, PushOptions, Remote, RemoteOptions,
};
use object_store::memory::InMemory;
use object_store::ObjectStore;

const URL: &str = "s3://bucket/data/s";
const PARTS: usize = 3;

/// The set `s` of [`PARTS`] parts under `base` (part `i` seeded by `seed + i`).
fn write_set(base: &Path, seed: u8) -> PathBuf {
    let SetStart::Building(build) = SetBuild::begin(base, "s", PARTS, &|| Ok(())).unwrap() else {
        panic!("a new base holds no set");
    };
    for i in 0..PARTS {
        write_cache(
            build.staging(),
            &part_name("s", i),
            40 + i * 7,
            900,
            8 * 1024,
            seed + i as u8,
        );
    }
    build.publish(Validation::Structure).unwrap().dir
}

fn remote(store: &Arc<dyn ObjectStore>, url: &str) -> Remote {
    Remote::with_store(url, store.clone(), &RemoteOptions::default()).unwrap()
}

fn options(node: &Path) -> RemoteOptions {
    RemoteOptions {
        local_dir: Some(node.to_owned()),
        ..RemoteOptions::default()
    }
}

/// Every sample of a shuffled epoch, in pass order.
fn epoch(ds: Dataset, epoch: u64) -> Vec<Vec<u8>> {
    let ds = Arc::new(ds);
    let opts = ReadOptions::new(9, true);
    let order = ds.try_order(&opts, &WeightTable::uniform(), epoch).unwrap();
    let mut reader = EpochReader::new(
        Pool::new(2).unwrap(),
        ds.clone(),
        Arc::new(order),
        &opts,
        epoch,
        0,
    );
    let mut out = Vec::new();
    while let Some(chunk) = reader.next_chunk() {
        for fetched in chunk.unwrap() {
            out.push(ds.fetched_data(fetched).into_owned());
        }
    }
    out
}

fn local_dataset(dir: &Path) -> Dataset {
    let set = CacheSet::open(dir, Validation::Structure).unwrap();
    Dataset::new(set.parts.into_iter().map(Arc::new).collect())
}

fn remote_dataset(store: &Arc<dyn ObjectStore>, node: &Path) -> dataset_rt_remote::Result<Dataset> {
    let published = Published::open(&remote(store, URL))?;
    let opened = open_published(published, &options(node), 0)?;
    Ok(Dataset::new(opened.into_iter().map(|o| o.cache).collect()))
}

#[test]
fn a_pushed_set_reads_as_the_local_set_and_appears_only_with_its_manifest() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_set(&tmp.path().join("local"), 1);
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let node = tmp.path().join("node");

    // The parts alone (an interrupted push): nothing is published under the set's name.
    for i in 0..PARTS {
        let part = part_name("s", i);
        push(
            &dir.join(&part),
            &remote(&store, &format!("{URL}/{part}")),
            &PushOptions::default(),
        )
        .unwrap();
    }
    let Err(err) = remote_dataset(&store, &node) else {
        panic!("the parts alone are no set");
    };
    assert_eq!(
        err.failure(),
        Some(dataset_rt_remote::RequestFailure::NotFound),
        "{err}"
    );

    let report = push_set(&dir, &remote(&store, URL), &PushOptions::default()).unwrap();
    assert_eq!(report.uploaded, vec!["set.json".to_owned()]);
    let again = push_set(&dir, &remote(&store, URL), &PushOptions::default()).unwrap();
    assert!(again.already_published);

    let local = local_dataset(&dir);
    let remote_ds = remote_dataset(&store, &node).unwrap();
    assert_eq!(remote_ds.fingerprint(), local.fingerprint());
    for e in 0..2 {
        assert_eq!(
            epoch(remote_dataset(&store, &node).unwrap(), e),
            epoch(local_dataset(&dir), e)
        );
    }
}

#[test]
fn a_part_replaced_after_publication_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_set(&tmp.path().join("local"), 1);
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    push_set(&dir, &remote(&store, URL), &PushOptions::default()).unwrap();
    // Another cache of part 1's name, pushed over it.
    let other = write_cache(
        &tmp.path().join("other"),
        &part_name("s", 1),
        47,
        900,
        8 * 1024,
        99,
    );
    let replace = PushOptions {
        replace: true,
        ..PushOptions::default()
    };
    push(
        &other,
        &remote(&store, &format!("{URL}/{}", part_name("s", 1))),
        &replace,
    )
    .unwrap();
    let Err(err) = remote_dataset(&store, &tmp.path().join("node")) else {
        panic!("a replaced part is refused");
    };
    let text = err.to_string();
    assert!(
        text.contains("part 1") && text.contains("replaced"),
        "{text}"
    );
    // `ls` reads every part's manifest: it lists the set as broken, for the same reason.
    let listed = ls(&remote(&store, "s3://bucket/data")).unwrap();
    let Err(why) = &listed[0].summary else {
        panic!("a set with a replaced part is listed as whole");
    };
    assert!(why.contains("part 1") && why.contains("replaced"), "{why}");
}

#[test]
fn a_set_manifest_is_published_over_parts_pushed_one_by_one() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_set(&tmp.path().join("local"), 3);
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let set = remote(&store, URL);
    // Part 2 is not there yet: refused, and nothing is published.
    for i in 0..2 {
        let part = part_name("s", i);
        push(
            &dir.join(&part),
            &remote(&store, &format!("{URL}/{part}")),
            &PushOptions::default(),
        )
        .unwrap();
    }
    let found = published_parts(&set, PARTS).unwrap();
    assert_eq!(
        found.iter().map(|(_, n)| n.is_some()).collect::<Vec<_>>(),
        [true, true, false]
    );
    let err = publish_set_manifest(&set, PARTS).unwrap_err();
    assert!(err.to_string().contains("part 2 is not published"), "{err}");
    assert!(Published::open(&set).is_err());

    let part = part_name("s", 2);
    push(
        &dir.join(&part),
        &remote(&store, &format!("{URL}/{part}")),
        &PushOptions::default(),
    )
    .unwrap();
    let report = publish_set_manifest(&set, PARTS).unwrap();
    let local = CacheSet::open(&dir, Validation::Structure).unwrap();
    assert_eq!(report.fingerprint, local.fingerprint());
    // The same parts again: a success that writes nothing; other parts: refused.
    assert!(publish_set_manifest(&set, PARTS).unwrap().already_published);
    assert!(matches!(
        publish_set_manifest(&set, PARTS - 1),
        Err(Error::AlreadyPublished { .. })
    ));
    let Published::Set(opened) = Published::open(&set).unwrap() else {
        panic!("a set is published");
    };
    assert_eq!(opened.manifest.parts, local.manifest.parts);
}

#[test]
fn a_url_holds_a_cache_or_a_set_never_both() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_set(&tmp.path().join("local"), 1);
    let cache = write_cache(&tmp.path().join("single"), "s", 20, 900, 8 * 1024, 5);
    let replace = PushOptions {
        replace: true,
        ..PushOptions::default()
    };

    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    push_set(&dir, &remote(&store, URL), &PushOptions::default()).unwrap();
    let err = push(&cache, &remote(&store, URL), &replace).unwrap_err();
    assert!(err.to_string().contains("holds a cache set"), "{err}");

    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    push(&cache, &remote(&store, URL), &PushOptions::default()).unwrap();
    let err = push_set(&dir, &remote(&store, URL), &replace).unwrap_err();
    assert!(err.to_string().contains("holds a cache ("), "{err}");
    let err = publish_set_manifest(&remote(&store, URL), PARTS).unwrap_err();
    assert!(err.to_string().contains("holds a cache ("), "{err}");
}

#[test]
fn downloads_are_blocks_only_when_the_budget_holds_every_cache_that_shares_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_set(&tmp.path().join("local"), 1);
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    push_set(&dir, &remote(&store, URL), &PushOptions::default()).unwrap();
    let budget = 64 << 20;
    let options = RemoteOptions {
        max_local_bytes: Some(budget),
        ..options(&tmp.path().join("node"))
    };
    let blocks = |shared: u64| -> Vec<bool> {
        let published = Published::open(&remote(&store, URL)).unwrap();
        let opened = open_published(published, &options, shared).unwrap();
        opened.iter().map(|o| o.records.fetches_blocks()).collect()
    };
    // The set alone fits: every part downloads blocks.
    assert_eq!(blocks(0), [true; PARTS]);
    // Other caches of the dataset take the budget: every part downloads records.
    assert_eq!(blocks(budget), [false; PARTS]);
}

#[test]
fn a_set_pulls_part_by_part_with_its_manifest_last_and_is_listed() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_set(&tmp.path().join("local"), 20);
    let store: Arc<dyn ObjectStore> = Arc::new(InMemory::new());
    let at = remote(&store, URL);
    push_set(&dir, &at, &PushOptions::default()).unwrap();
    push(
        &write_cache(&tmp.path().join("one"), "c", 10, 900, 8 * 1024, 1),
        &remote(&store, "s3://bucket/data/c"),
        &PushOptions::default(),
    )
    .unwrap();

    let listed = ls(&remote(&store, "s3://bucket/data")).unwrap();
    let names: Vec<(&str, usize)> = listed
        .iter()
        .map(|l| (l.name.as_str(), l.summary.as_ref().unwrap().parts))
        .collect();
    assert_eq!(names, [("c", 0), ("s", PARTS)]);
    let set = CacheSet::open(&dir, Validation::Structure).unwrap();
    let summary = listed[1].summary.as_ref().unwrap();
    assert_eq!(summary.num_samples, set.manifest.num_samples);
    assert_eq!(summary.fingerprint, set.manifest.fingerprint);

    let dest = tmp.path().join("pulled").join("s");
    let report = pull(&at, &dest, &FetchPolicy::default()).unwrap();
    assert_eq!(report.parts, PARTS);
    assert!(!report.already_present && report.bytes > 0);
    assert_eq!(
        std::fs::read(dest.join("set.json")).unwrap(),
        std::fs::read(dir.join("set.json")).unwrap()
    );
    assert_eq!(
        epoch(local_dataset(&dest), 1),
        epoch(local_dataset(&dir), 1)
    );
    assert!(
        pull(&at, &dest, &FetchPolicy::default())
            .unwrap()
            .already_present
    );

    // A pull that stopped before the set manifest: not a set yet; the rerun completes it and
    // downloads only what is missing.
    std::fs::remove_file(dest.join("set.json")).unwrap();
    assert!(CacheSet::open(&dest, Validation::Structure).is_err());
    let again = pull(&at, &dest, &FetchPolicy::default()).unwrap();
    assert_eq!(again.bytes, 0);
    assert_eq!(
        epoch(local_dataset(&dest), 0),
        epoch(local_dataset(&dir), 0)
    );

    // Pulled under another name, or over a cache: refused.
    let err = pull(&at, &tmp.path().join("t"), &FetchPolicy::default()).unwrap_err();
    assert!(err.to_string().contains("cache set's name"), "{err}");
    let over = tmp.path().join("over");
    let cache = write_cache(&over, "s", 10, 900, 8 * 1024, 1);
    let err = pull(&at, &cache, &FetchPolicy::default()).unwrap_err();
    assert!(err.to_string().contains("holds a cache"), "{err}");
}

//! Publication: push, pull and ls over in-memory stores (with injected faults) and `file://`.

mod common;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::{write_cache, FaultStore};
use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_remote::publish::{build_id, PublishedCache, BUILDS_DIR};
use dataset_rt_remote::{
    ls, pull, push, Error, FetchPolicy, PushOptions, Remote, RemoteOptions, RequestFailure,
};
use dataset_rt_testkit::write_at;
use futures::TryStreamExt;
use object_store::memory::InMemory;
use object_store::path::Path as Key;
use object_store::{ObjectStore, ObjectStoreExt};

const URL: &str = "s3://bucket/data/train";

fn remote_over(store: Arc<dyn ObjectStore>, url: &str) -> Remote {
    Remote::with_store(url, store, &RemoteOptions::default()).unwrap()
}

fn keys(store: &dyn ObjectStore) -> Vec<String> {
    let listed: Vec<object_store::ObjectMeta> =
        dataset_rt_remote::runtime::block_on(store.list(None).try_collect())
            .unwrap()
            .unwrap();
    let mut keys: Vec<String> = listed.into_iter().map(|m| m.location.to_string()).collect();
    keys.sort();
    keys
}

fn sequential() -> PushOptions {
    PushOptions {
        concurrency: 1,
        ..PushOptions::default()
    }
}

/// Every file of the cache at `a` equals the one at `b`.
fn same_files(a: &Path, b: &Path) {
    let cache = Cache::open(a, Validation::Full).unwrap();
    let mut files = vec![
        "manifest.json".to_owned(),
        "index.bin".into(),
        "metadata.arrow".into(),
    ];
    files.extend(cache.manifest.shards.iter().map(|s| s.file.clone()));
    for f in files {
        assert_eq!(
            std::fs::read(a.join(&f)).unwrap(),
            std::fs::read(b.join(&f)).unwrap(),
            "{f}"
        );
    }
}

#[test]
fn push_then_pull_round_trips_under_a_build_prefix() {
    let tmp = tempfile::tempdir().unwrap();
    let local = write_cache(&tmp.path().join("src"), "train", 40, 300, 4096, 0);
    let store = Arc::new(InMemory::new());
    let remote = remote_over(store.clone(), URL);
    let report = push(&local, &remote, &PushOptions::default()).unwrap();
    let manifest_bytes = std::fs::read(local.join("manifest.json")).unwrap();
    let id = build_id(&manifest_bytes);
    assert_eq!(report.build_id, id);
    assert!(report.resumed.is_empty() && !report.already_published);
    let listed = keys(store.as_ref());
    assert_eq!(listed.last().unwrap(), "data/train/manifest.json");
    let cache = Cache::open(&local, Validation::Structure).unwrap();
    let shards = cache.manifest.shards.len();
    assert!(shards >= 3, "{shards} shards");
    assert_eq!(listed.len(), 3 + shards);
    for key in &listed[..listed.len() - 1] {
        assert!(
            key.starts_with(&format!("data/train/{BUILDS_DIR}/{id}/")),
            "{key}"
        );
    }
    // The same push again writes nothing.
    let again = push(&local, &remote, &PushOptions::default()).unwrap();
    assert!(again.already_published);

    let listing = ls(&remote_over(store.clone(), "s3://bucket/data")).unwrap();
    assert_eq!(listing.len(), 1);
    assert_eq!(listing[0].url, URL);
    assert_eq!(listing[0].name, "train");
    let summary = listing[0].summary.as_ref().unwrap();
    assert_eq!(summary.num_samples, 40);
    assert_eq!(summary.fingerprint, cache.manifest.fingerprint);
    assert_eq!(summary.build_id, id);

    let dest = tmp.path().join("dst").join("train");
    let pulled = pull(&remote, &dest, &FetchPolicy::default()).unwrap();
    assert!(!pulled.already_present);
    same_files(&local, &dest);
    Cache::open(&dest, Validation::Full)
        .unwrap()
        .verify_all()
        .unwrap();
    assert!(
        pull(&remote, &dest, &FetchPolicy::default())
            .unwrap()
            .already_present
    );
    // Nothing else was left in the destination's base.
    let names: Vec<String> = std::fs::read_dir(tmp.path().join("dst"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        names.iter().all(|n| n == "train" || n == ".train.lock"),
        "{names:?}"
    );
}

#[test]
fn a_cache_already_there_is_replaced_only_when_asked() {
    let tmp = tempfile::tempdir().unwrap();
    let first = write_cache(&tmp.path().join("a"), "train", 10, 100, 1 << 20, 0);
    let second = write_cache(&tmp.path().join("b"), "train", 10, 100, 1 << 20, 9);
    let store = Arc::new(InMemory::new());
    let remote = remote_over(store.clone(), URL);
    push(&first, &remote, &PushOptions::default()).unwrap();
    let first_fp = Cache::open(&first, Validation::Structure)
        .unwrap()
        .manifest
        .fingerprint;
    let err = push(&second, &remote, &PushOptions::default()).unwrap_err();
    let Error::AlreadyPublished { url, fingerprint } = &err else {
        panic!("{err}")
    };
    assert_eq!(url, URL);
    assert_eq!(fingerprint, &first_fp);
    assert!(err.to_string().contains("replace"), "{err}");
    assert_eq!(
        PublishedCache::open(&remote).unwrap().manifest.fingerprint,
        first_fp
    );
    // As the core's error: an I/O error of kind "already exists" (Python: FileExistsError).
    let core: dataset_rt_core::Error = err.into();
    let dataset_rt_core::Error::Io { source, .. } = &core else {
        panic!("{core}")
    };
    assert_eq!(source.kind(), std::io::ErrorKind::AlreadyExists);

    let replace = PushOptions {
        replace: true,
        ..PushOptions::default()
    };
    let report = push(&second, &remote, &replace).unwrap();
    assert_eq!(report.replaced.as_deref(), Some(first_fp.as_str()));
    let now = PublishedCache::open(&remote).unwrap();
    assert_eq!(now.manifest.fingerprint, report.fingerprint);
    // The replaced build stays for readers that opened it before.
    let old_id = build_id(&std::fs::read(first.join("manifest.json")).unwrap());
    assert!(keys(store.as_ref())
        .iter()
        .any(|k| k.contains(&format!("{BUILDS_DIR}/{old_id}/"))));
}

#[test]
fn an_interrupted_push_is_never_visible_and_resumes() {
    let tmp = tempfile::tempdir().unwrap();
    let local = write_cache(&tmp.path().join("src"), "train", 30, 300, 4096, 0);
    let files = 2 + Cache::open(&local, Validation::Structure)
        .unwrap()
        .manifest
        .shards
        .len();
    // Interrupted at every write: each file's upload, then the manifest's.
    for allowed in 0..=files as u64 {
        let inner = Arc::new(InMemory::new());
        let faults = FaultStore::new(inner.clone());
        faults.puts_allowed.store(allowed, Ordering::SeqCst);
        let remote = remote_over(faults.clone(), URL);
        let err = push(&local, &remote, &sequential()).unwrap_err();
        assert!(err.to_string().contains("injected write failure"), "{err}");
        // Nothing a reader opens: no manifest at the URL.
        let open = PublishedCache::open(&remote).unwrap_err();
        assert_eq!(open.failure(), Some(RequestFailure::NotFound), "{open}");
        assert!(open.to_string().contains("no cache is published"), "{open}");
        assert!(ls(&remote_over(inner.clone(), "s3://bucket/data"))
            .unwrap()
            .is_empty());
        // Pushing again uploads only what is missing, then commits.
        let report = push(&local, &remote_over(inner.clone(), URL), &sequential()).unwrap();
        assert_eq!(
            report.resumed.len() as u64,
            allowed.min(files as u64),
            "allowed {allowed}"
        );
        assert_eq!(report.resumed.len() + report.uploaded.len(), files);
        PublishedCache::open(&remote_over(inner, URL)).unwrap();
    }
}

#[test]
fn large_files_go_up_in_parts_and_a_changed_local_file_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let local = write_cache(&tmp.path().join("src"), "train", 20, 5000, 1 << 20, 0);
    let store = Arc::new(InMemory::new());
    let faults = FaultStore::new(store.clone());
    let parts = PushOptions {
        multipart_threshold: 16 << 10,
        part_size: 16 << 10,
        ..PushOptions::default()
    };
    push(&local, &remote_over(faults.clone(), URL), &parts).unwrap();
    let dest = tmp.path().join("dst").join("train");
    pull(&remote_over(store, URL), &dest, &FetchPolicy::default()).unwrap();
    same_files(&local, &dest);

    // A byte changed in place (same size): the upload's checksum refuses it.
    let copy = tmp.path().join("changed").join("train");
    std::fs::create_dir_all(copy.join("shards")).unwrap();
    for entry in walk(&local) {
        let rel = entry.strip_prefix(&local).unwrap();
        std::fs::copy(&entry, copy.join(rel)).unwrap();
    }
    let shard = copy.join("shards/000000.bin");
    let byte = std::fs::read(&shard).unwrap()[5000];
    write_at(&shard, 5000, &[byte ^ 1]);
    let fresh = Arc::new(InMemory::new());
    let err = push(&copy, &remote_over(fresh.clone(), URL), &parts).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("changed since it was written"), "{text}");
    assert!(text.contains("shards/000000.bin"), "{text}");
    assert!(!keys(fresh.as_ref())
        .iter()
        .any(|k| k.ends_with("manifest.json")));
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.extend(walk(&path));
        } else {
            out.push(path);
        }
    }
    out
}

#[test]
fn pull_names_an_object_damaged_on_the_server_and_leaves_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let local = write_cache(&tmp.path().join("src"), "train", 30, 300, 4096, 0);
    let store = Arc::new(InMemory::new());
    let remote = remote_over(store.clone(), URL);
    let report = push(&local, &remote, &PushOptions::default()).unwrap();
    let key = Key::from(format!(
        "data/train/{BUILDS_DIR}/{}/shards/000001.bin",
        report.build_id
    ));
    let mut bytes = std::fs::read(local.join("shards/000001.bin")).unwrap();
    bytes[100] ^= 0xff;
    dataset_rt_remote::runtime::block_on(store.put(&key, bytes.into()))
        .unwrap()
        .unwrap();
    let dest = tmp.path().join("dst").join("train");
    let err = pull(&remote, &dest, &FetchPolicy::default()).unwrap_err();
    let text = err.to_string();
    assert!(
        text.contains(&format!(
            "s3://bucket/data/train/{BUILDS_DIR}/{}/shards/000001.bin",
            report.build_id
        )),
        "{text}"
    );
    assert!(text.contains("checksum mismatch"), "{text}");
    assert!(!dest.exists());
    let left: Vec<_> = std::fs::read_dir(tmp.path().join("dst"))
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, vec![std::ffi::OsString::from(".train.lock")]);
}

#[test]
fn stale_builds_of_abandoned_pushes_are_removed() {
    let tmp = tempfile::tempdir().unwrap();
    let abandoned = write_cache(&tmp.path().join("a"), "train", 10, 100, 1 << 20, 0);
    let kept = write_cache(&tmp.path().join("b"), "train", 10, 100, 1 << 20, 5);
    let inner = Arc::new(InMemory::new());
    let faults = FaultStore::new(inner.clone());
    faults.puts_allowed.store(1, Ordering::SeqCst);
    push(&abandoned, &remote_over(faults, URL), &sequential()).unwrap_err();
    let abandoned_id = build_id(&std::fs::read(abandoned.join("manifest.json")).unwrap());
    // A push under the default age keeps it (it might be a push in progress elsewhere).
    let report = push(
        &kept,
        &remote_over(inner.clone(), URL),
        &PushOptions::default(),
    )
    .unwrap();
    assert!(report.removed_builds.is_empty());
    let replace_now = PushOptions {
        replace: true,
        stale_after: Duration::ZERO,
        ..PushOptions::default()
    };
    let third = write_cache(&tmp.path().join("c"), "train", 10, 100, 1 << 20, 7);
    let report = push(&third, &remote_over(inner.clone(), URL), &replace_now).unwrap();
    // The abandoned build goes; the replaced one stays for its readers.
    assert_eq!(report.removed_builds, vec![abandoned_id.clone()]);
    assert!(!keys(inner.as_ref())
        .iter()
        .any(|k| k.contains(&abandoned_id)));
}

#[test]
fn file_urls_take_the_same_path() {
    let tmp = tempfile::tempdir().unwrap();
    let local = write_cache(&tmp.path().join("src"), "train", 20, 300, 4096, 0);
    let bucket = tmp.path().join("bucket");
    std::fs::create_dir_all(&bucket).unwrap();
    let url = format!("file://{}/train", bucket.display());
    let remote = Remote::open(&url, &RemoteOptions::default()).unwrap();
    push(&local, &remote, &PushOptions::default()).unwrap();
    assert!(bucket.join("train/manifest.json").exists());
    let err = push(
        &write_cache(&tmp.path().join("other"), "train", 5, 10, 4096, 3),
        &remote,
        &PushOptions::default(),
    )
    .unwrap_err();
    assert!(matches!(err, Error::AlreadyPublished { .. }), "{err}");
    let base = Remote::open(
        &format!("file://{}", bucket.display()),
        &RemoteOptions::default(),
    )
    .unwrap();
    assert_eq!(ls(&base).unwrap().len(), 1);
    let dest = tmp.path().join("dst").join("train");
    pull(&remote, &dest, &FetchPolicy::default()).unwrap();
    same_files(&local, &dest);
    // A cache pushed to a URL of another name is refused.
    let wrong = Remote::open(
        &format!("file://{}/valid", bucket.display()),
        &RemoteOptions::default(),
    )
    .unwrap();
    let err = push(&local, &wrong, &PushOptions::default()).unwrap_err();
    assert!(err.to_string().contains("holds cache \"train\""), "{err}");
}

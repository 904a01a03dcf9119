//! Cache sets on object storage: a set published at `<url>` is its parts, each a cache published
//! at `<url>/<part>` (the layout of `publish`), and the set manifest `<url>/set.json`, the
//! local `set.json` byte for byte:
//!
//! ```text
//! <url>/set.json                               the commit point of the set
//! <url>/NAME.part-000000/manifest.json         part 0, a published cache
//! <url>/NAME.part-000000/.builds/<build-id>/   its files
//! ```
//!
//! The parts are published first, each atomically; the set manifest is written last, by one
//! conditional PUT, so a reader sees the whole set or none. A reader opens the parts the manifest
//! lists and checks each one's fingerprint and sample count against it, so a part replaced after
//! the set was published is refused, never read as part of the set. A URL holds a cache or a set,
//! never both: publishing one where the other is published is refused. `pull` downloads a set
//! in the same order (parts, then the set manifest) and `ls` lists sets beside caches.

use std::fs::File;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use dataset_rt_core::cache::Validation;
use dataset_rt_core::cache_set::{
    check_part, parse_set_manifest, part_name, validate_part_count, validate_set_name, CacheSet,
    PartEntry, SetManifest, SET_MANIFEST_FILE,
};
use dataset_rt_core::format::MANIFEST_FILE;
use object_store::ObjectStore;

use crate::error::{Error, RequestFailure, Result};
use crate::fetch::FetchPolicy;
use crate::publish::{
    build_id, cache_name, cache_summary, check_destination, commit, get_small, pull_published,
    push_async, sync_dir, CacheSummary, PublishedCache, PullReport, PushOptions, PushReport,
};
use crate::store::Remote;

/// What is published at a URL: one cache, or a cache set with its parts in order.
#[derive(Debug)]
pub enum Published {
    Cache(Box<PublishedCache>),
    Set(Box<PublishedSet>),
}

/// A cache set published at a URL: its manifest, and each part's published cache, checked
/// against it.
#[derive(Debug)]
pub struct PublishedSet {
    pub url: String,
    pub manifest: SetManifest,
    pub manifest_bytes: Bytes,
    pub parts: Vec<PublishedCache>,
}

impl Published {
    /// Opens what `remote` holds: its cache manifest, else its set manifest and then every
    /// part's (blocking). Neither is a `NotFound` request error that names both.
    pub fn open(remote: &Remote) -> Result<Published> {
        crate::runtime::block_on(Self::open_async(remote))?
    }

    pub async fn open_async(remote: &Remote) -> Result<Published> {
        let missing = match PublishedCache::open_async(remote).await {
            Ok(cache) => return Ok(Published::Cache(Box::new(cache))),
            Err(e) if e.failure() == Some(RequestFailure::NotFound) => e,
            Err(e) => return Err(e),
        };
        match open_set_async(remote).await? {
            Some(set) => Ok(Published::Set(Box::new(set))),
            None => Err(missing),
        }
    }

    /// The published caches a dataset reads, in order: the cache, or the set's parts.
    pub fn caches(&self) -> Vec<&PublishedCache> {
        match self {
            Published::Cache(c) => vec![&**c],
            Published::Set(s) => s.parts.iter().collect(),
        }
    }

    pub fn into_caches(self) -> Vec<PublishedCache> {
        match self {
            Published::Cache(c) => vec![*c],
            Published::Set(s) => s.parts,
        }
    }

    /// Samples of the cache or of every part.
    pub fn num_samples(&self) -> u64 {
        self.caches().iter().map(|c| c.manifest.num_samples).sum()
    }

    /// The manifest text `dataset-rt inspect` shows: the cache's, or the set's.
    pub fn manifest_bytes(&self) -> &Bytes {
        match self {
            Published::Cache(c) => &c.manifest_bytes,
            Published::Set(s) => &s.manifest_bytes,
        }
    }
}

/// The set published at `remote`, its parts opened and checked; `None` when no set manifest is
/// there. A part that is missing or is not the one the manifest lists makes the set malformed.
async fn open_set_async(remote: &Remote) -> Result<Option<PublishedSet>> {
    let name = cache_name(remote)?;
    let store = remote.store()?;
    let key = remote.key(SET_MANIFEST_FILE);
    let shown = remote.show(&key);
    let Some((bytes, _)) = get_small(remote, &store, &key).await? else {
        return Ok(None);
    };
    let manifest = parse_set_manifest(&bytes, &name, Path::new(&shown))?;
    let mut parts = Vec::with_capacity(manifest.parts.len());
    for (i, entry) in manifest.parts.iter().enumerate() {
        let part = remote.join(&entry.name)?;
        let cache = match PublishedCache::open_async(&part).await {
            Ok(c) => c,
            Err(e) if e.failure() == Some(RequestFailure::NotFound) => {
                return Err(dataset_rt_core::Error::malformed(
                    &name,
                    &shown,
                    format!(
                        "part {i} ({}) is missing: no cache is published at {}",
                        entry.name,
                        part.url()
                    ),
                )
                .into())
            }
            Err(e) => return Err(e),
        };
        check_part(
            &name,
            Path::new(&shown),
            i,
            entry,
            &cache.manifest.fingerprint,
            cache.manifest.num_samples,
        )?;
        parts.push(cache);
    }
    Ok(Some(PublishedSet {
        url: remote.url().to_string(),
        manifest,
        manifest_bytes: bytes,
        parts,
    }))
}

/// [`crate::pull`] of a published set: each part is pulled into `dir/<part>` (each one whole or
/// not at all, a part already there with the same manifest kept), then the set manifest is
/// written by a rename, last, so `dir` is a set only once every part is there. A rerun after an
/// interruption pulls only the missing parts.
pub(crate) fn pull_set(set: &PublishedSet, dir: &Path, policy: &FetchPolicy) -> Result<PullReport> {
    let name = &set.manifest.name;
    check_destination(dir, name, "cache set")?;
    let mut report = PullReport {
        url: set.url.clone(),
        dir: dir.to_owned(),
        build_id: build_id(&set.manifest_bytes),
        fingerprint: set.manifest.fingerprint.clone(),
        bytes: 0,
        already_present: false,
        parts: set.parts.len(),
    };
    let io = |op, path: &Path, e| Error::Core(dataset_rt_core::Error::io(op, path, e));
    let another = |what: &str| {
        io(
            "pull into",
            dir,
            std::io::Error::new(
                std::io::ErrorKind::AlreadyExists,
                format!("the directory exists and holds {what}; remove it or pull elsewhere"),
            ),
        )
    };
    let set_path = dir.join(SET_MANIFEST_FILE);
    if dir.join(MANIFEST_FILE).exists() {
        return Err(another("a cache"));
    }
    match std::fs::read(&set_path) {
        Ok(bytes) if bytes == set.manifest_bytes.as_ref() => {
            report.already_present = true;
            return Ok(report);
        }
        Ok(_) => return Err(another("another cache set")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("read", &set_path, e)),
    }
    std::fs::create_dir_all(dir).map_err(|e| io("create directory", dir, e))?;
    for (entry, part) in set.manifest.parts.iter().zip(&set.parts) {
        report.bytes += pull_published(part, &dir.join(&entry.name), policy)?.bytes;
    }
    let tmp = dir.join(format!(".{SET_MANIFEST_FILE}.tmp-{}", std::process::id()));
    std::fs::write(&tmp, &set.manifest_bytes)
        .and_then(|()| File::open(&tmp)?.sync_all())
        .and_then(|()| std::fs::rename(&tmp, &set_path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&tmp);
            io("write", &set_path, e)
        })?;
    sync_dir(dir)?;
    Ok(report)
}

/// What the set manifest at `remote` says, for `ls`; `None` when there is none. Its bytes are
/// those of every part, read from their manifests.
pub(crate) async fn set_summary(
    remote: &Remote,
    store: &Arc<dyn ObjectStore>,
    name: &str,
) -> Result<Option<std::result::Result<CacheSummary, dataset_rt_core::Error>>> {
    let key = remote.key(SET_MANIFEST_FILE);
    let Some((bytes, _)) = get_small(remote, store, &key).await? else {
        return Ok(None);
    };
    let manifest = match parse_set_manifest(&bytes, name, Path::new(&remote.show(&key))) {
        Ok(m) => m,
        Err(e) => return Ok(Some(Err(e))),
    };
    let mut total = bytes.len() as u64;
    for (index, entry) in manifest.parts.iter().enumerate() {
        let part = remote.join(&entry.name)?;
        match cache_summary(&part, store, &entry.name).await? {
            Some(Ok(summary)) => {
                // A part replaced after the set was published: the set does not open.
                let manifest_path = remote.show(&key);
                if let Err(e) = dataset_rt_core::cache_set::check_part(
                    name,
                    Path::new(&manifest_path),
                    index,
                    entry,
                    &summary.fingerprint,
                    summary.num_samples,
                ) {
                    return Ok(Some(Err(e)));
                }
                total += summary.bytes;
            }
            Some(Err(e)) => return Ok(Some(Err(e))),
            None => {
                return Ok(Some(Err(dataset_rt_core::Error::malformed(
                    name,
                    remote.show(&key),
                    format!(
                        "part {} is missing: no cache is published at {}",
                        entry.name,
                        part.url()
                    ),
                ))))
            }
        }
    }
    Ok(Some(Ok(CacheSummary {
        num_samples: manifest.num_samples,
        bytes: total,
        fingerprint: manifest.fingerprint.clone(),
        format_version: manifest.format_version,
        build_id: build_id(&bytes),
        parts: manifest.parts.len(),
    })))
}

/// Refuses to publish at `remote` when it holds the other kind of thing (`other` is the file
/// that would say so: a cache's manifest when a set is pushed, a set's manifest when a cache is).
pub(crate) async fn refuse_other_kind(
    remote: &Remote,
    store: &Arc<dyn ObjectStore>,
    other: &str,
) -> Result<()> {
    let key = remote.key(other);
    if get_small(remote, store, &key).await?.is_none() {
        return Ok(());
    }
    let (held, pushed) = if other == SET_MANIFEST_FILE {
        ("a cache set", "a cache")
    } else {
        ("a cache", "a cache set")
    };
    Err(Error::Request {
        op: "publish",
        url: remote.url().to_string(),
        failure: RequestFailure::Conflict,
        reason: format!(
            "it holds {held} ({} exists), and {pushed} cannot be published over it, even with \
             replace: publish under another name, or remove what is there first",
            remote.show(&key)
        ),
    })
}

/// Publishes the local cache set `dir` at `remote` (blocking): every part at `<url>/<part>` (as
/// `push` does, resuming what an interrupted push uploaded), then `set.json`.
///
/// With `options.replace`, a set already published there is replaced: its parts first, then its
/// manifest by a compare-and-swap, so a reader that opens the set meanwhile is refused (a part no
/// longer matches the manifest), never served a mix.
pub fn push_set(dir: &Path, remote: &Remote, options: &PushOptions) -> Result<PushReport> {
    crate::runtime::block_on(push_set_async(dir, remote, options))?
}

pub async fn push_set_async(
    dir: &Path,
    remote: &Remote,
    options: &PushOptions,
) -> Result<PushReport> {
    let name = cache_name(remote)?;
    // The manifest and every part's structure; the parts' files are checked as they upload.
    let set = CacheSet::open(dir, Validation::Structure)?;
    if set.name() != name {
        return Err(Error::url(
            &remote.url().to_string(),
            format!(
                "names cache set {name:?}, but {} holds set {:?}: push it to a URL ending in /{}",
                dir.display(),
                set.name(),
                set.name()
            ),
        ));
    }
    let path = dir.join(SET_MANIFEST_FILE);
    let manifest_bytes =
        std::fs::read(&path).map_err(|e| dataset_rt_core::Error::io("read", &path, e))?;
    let store = remote.store()?;
    refuse_other_kind(remote, &store, MANIFEST_FILE).await?;
    let mut report = PushReport {
        url: remote.url().to_string(),
        build_id: build_id(&manifest_bytes),
        fingerprint: set.fingerprint().to_owned(),
        ..PushReport::default()
    };
    let key = remote.key(SET_MANIFEST_FILE);
    let replacing = match get_small(remote, &store, &key).await? {
        Some((bytes, _)) if bytes.as_ref() == manifest_bytes.as_slice() => {
            report.already_published = true;
            return Ok(report);
        }
        Some((bytes, version)) => {
            let fingerprint = fingerprint_of(&bytes);
            if !options.replace {
                return Err(Error::AlreadyPublished {
                    url: report.url,
                    fingerprint,
                });
            }
            report.replaced = Some(fingerprint);
            Some(version)
        }
        None => None,
    };
    let parts: Vec<String> = set.manifest.parts.iter().map(|p| p.name.clone()).collect();
    drop(set);
    for part in &parts {
        let pushed = Box::pin(push_async(&dir.join(part), &remote.join(part)?, options)).await?;
        let prefixed = |files: Vec<String>| files.into_iter().map(move |f| format!("{part}/{f}"));
        report.uploaded.extend(prefixed(pushed.uploaded));
        report.resumed.extend(prefixed(pushed.resumed));
        report.removed_builds.extend(pushed.removed_builds);
    }
    commit(
        remote,
        &store,
        &key,
        &manifest_bytes,
        replacing.as_ref(),
        &report,
    )
    .await?;
    report.uploaded.push(SET_MANIFEST_FILE.to_owned());
    Ok(report)
}

/// The `parts` parts of set `<url>` (named by the set, `NAME.part-000000`...), each with its
/// sample count when it is published at `<url>/<part>` (blocking).
pub fn published_parts(remote: &Remote, parts: usize) -> Result<Vec<(String, Option<u64>)>> {
    crate::runtime::block_on(async {
        let name = cache_name(remote)?;
        validate_set_name(&name)
            .map_err(|e| Error::url(&remote.url().to_string(), e.to_string()))?;
        validate_part_count(&name, parts)?;
        let mut found = Vec::with_capacity(parts);
        for i in 0..parts {
            let part = part_name(&name, i);
            let samples = match PublishedCache::open_async(&remote.join(&part)?).await {
                Ok(c) => Some(c.manifest.num_samples),
                Err(e) if e.failure() == Some(RequestFailure::NotFound) => None,
                Err(e) => return Err(e),
            };
            found.push((part, samples));
        }
        Ok(found)
    })?
}

/// Publishes the set manifest of set `<url>` over the `parts` parts published under it (each
/// written and pushed by anyone: the tasks of a cluster), by one conditional PUT (blocking).
/// Refused while a part is not published; a set already published with these parts is a success
/// (`already_published`), one with other parts is refused.
pub fn publish_set_manifest(remote: &Remote, parts: usize) -> Result<PushReport> {
    crate::runtime::block_on(async {
        let name = cache_name(remote)?;
        validate_set_name(&name)
            .map_err(|e| Error::url(&remote.url().to_string(), e.to_string()))?;
        validate_part_count(&name, parts)?;
        let store = remote.store()?;
        refuse_other_kind(remote, &store, MANIFEST_FILE).await?;
        let mut entries = Vec::with_capacity(parts);
        for i in 0..parts {
            let part = remote.join(&part_name(&name, i))?;
            let cache = PublishedCache::open_async(&part).await.map_err(|e| {
                if e.failure() == Some(RequestFailure::NotFound) {
                    Error::Core(dataset_rt_core::Error::Runtime(format!(
                        "cache set {name:?} cannot be published at {}: part {i} is not \
                         published at {}; write the missing parts first",
                        remote.url(),
                        part.url()
                    )))
                } else {
                    e
                }
            })?;
            entries.push(PartEntry {
                name: part_name(&name, i),
                num_samples: cache.manifest.num_samples,
                fingerprint: cache.manifest.fingerprint,
            });
        }
        let manifest = SetManifest::of_parts(&name, entries);
        let key = remote.key(SET_MANIFEST_FILE);
        let mut report = PushReport {
            url: remote.url().to_string(),
            fingerprint: manifest.fingerprint.clone(),
            ..PushReport::default()
        };
        if let Some((bytes, _)) = get_small(remote, &store, &key).await? {
            let same = parse_set_manifest(&bytes, &name, Path::new(&remote.show(&key)))
                .is_ok_and(|m| m.parts == manifest.parts);
            if !same {
                return Err(Error::AlreadyPublished {
                    url: report.url,
                    fingerprint: fingerprint_of(&bytes),
                });
            }
            report.build_id = build_id(&bytes);
            report.already_published = true;
            return Ok(report);
        }
        let bytes = manifest.to_bytes();
        report.build_id = build_id(&bytes);
        commit(remote, &store, &key, &bytes, None, &report).await?;
        report.uploaded.push(SET_MANIFEST_FILE.to_owned());
        Ok(report)
    })?
}

fn fingerprint_of(manifest: &[u8]) -> String {
    serde_json::from_slice::<serde_json::Value>(manifest)
        .ok()
        .and_then(|v| v.get("fingerprint")?.as_str().map(str::to_owned))
        .unwrap_or_else(|| "unreadable".to_owned())
}

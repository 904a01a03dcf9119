//! Publication on object storage: the remote layout, `push`, `pull` and `ls`.
//!
//! Layout of a cache published at URL `<url>` (whose last segment is the cache's name):
//!
//! ```text
//! <url>/manifest.json                          the commit point: the local manifest, byte for byte
//! <url>/.builds/<build-id>/index.bin           the build's files, under a prefix named by the
//! <url>/.builds/<build-id>/metadata.arrow      build: <build-id> is the xxh3-128 of the
//! <url>/.builds/<build-id>/shards/000000.bin   manifest's bytes (32 hex digits)
//! ```
//!
//! The manifest is unchanged (its key set is fixed by the format), so a reader finds the build
//! from the manifest alone, and a manifest names exactly one set of files: its checksums are in
//! it, and its hash names their prefix. A push uploads the files first and then writes the
//! manifest with one conditional PUT (`PutMode::Create`, or `PutMode::Update` with the replaced
//! manifest's ETag when replacing), so a reader sees the old cache or the whole new one, never
//! part of one. An interrupted push leaves objects under `.builds/` only, which no reader opens;
//! pushing the same cache again finds them and uploads only what is missing.

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::os::unix::fs::{FileExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use dataset_rt_core::cache::{parse_manifest, Cache, Validation};
use dataset_rt_core::format::{checksum_hex, Manifest, MANIFEST_FILE};
use dataset_rt_core::writer::CacheLock;
use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::path::Path as Key;
use object_store::{
    GetOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, UpdateVersion,
    WriteMultipart,
};
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

use crate::error::{Error, RequestFailure, Result};
use crate::fetch::{advice, failure_of, retrying, FetchPolicy, RangeFetcher, RangeRequest};
use crate::store::Remote;

/// The folder of build prefixes under a cache's URL.
pub const BUILDS_DIR: &str = ".builds";

/// A missing bucket reads like a missing object to a GET: where a manifest was not found, one
/// LIST of the URL's prefix tells them apart (S3 only), so that the error says to check the
/// bucket rather than to publish a cache into a bucket that does not exist.
pub(crate) async fn check_bucket(remote: &Remote, store: &Arc<dyn ObjectStore>) -> Result<()> {
    if remote.url().scheme() != crate::location::Scheme::S3 {
        return Ok(());
    }
    let root = remote.url().root().clone();
    match store.list_with_delimiter(Some(&root)).await {
        Err(e) => missing_bucket(remote, "open", &e).map_or(Ok(()), Err),
        // Anything else is said by the request that follows, with its retries.
        Ok(_) => Ok(()),
    }
}

/// The error of `op` on `remote` when `err`, the failure of a LIST of it, says that its bucket
/// does not exist (S3 only); `None` otherwise.
fn missing_bucket(remote: &Remote, op: &'static str, err: &object_store::Error) -> Option<Error> {
    let s3 = remote.url().scheme() == crate::location::Scheme::S3;
    (s3 && crate::fetch::classify(err) == RequestFailure::NotFound).then(|| Error::Request {
        op,
        url: remote.url().to_string(),
        failure: RequestFailure::NotFound,
        reason: format!(
            "the bucket {:?} does not exist (or the endpoint serves no such bucket): check the \
             URL's bucket and the endpoint (RemoteConfig.endpoint or AWS_ENDPOINT_URL)",
            remote.url().bucket()
        ),
    })
}

/// A published cache's identity: the xxh3-128 of its manifest's bytes, as 32 hex digits. The
/// local cache directory and the remote build prefix are both named by it.
pub fn build_id(manifest_bytes: &[u8]) -> String {
    format!("{:032x}", xxh3_128(manifest_bytes))
}

/// Every file of a cache but its manifest: (relative path, size, checksum).
pub fn data_files(manifest: &Manifest) -> Vec<(String, u64, String)> {
    let mut files = vec![
        (
            manifest.index.file.clone(),
            manifest.index.bytes,
            manifest.index.checksum.clone(),
        ),
        (
            manifest.metadata.file.clone(),
            manifest.metadata.bytes,
            manifest.metadata.checksum.clone(),
        ),
    ];
    files.extend(
        manifest
            .shards
            .iter()
            .map(|s| (s.file.clone(), s.bytes, s.checksum.clone())),
    );
    files
}

fn request_error(op: &'static str, url: String, err: object_store::Error) -> Error {
    let (failure, reason) = failure_of(err);
    Error::Request {
        op,
        url,
        failure,
        reason: format!("{reason}{}", advice(failure)),
    }
}

/// The name of the cache a URL names (its last segment), checked like a local cache's name.
pub(crate) fn cache_name(remote: &Remote) -> Result<String> {
    let url = remote.url().to_string();
    let name = remote.url().name().ok_or_else(|| {
        Error::url(
            &url,
            "names no cache: give the cache's own URL, e.g. s3://bucket/prefix/NAME",
        )
    })?;
    dataset_rt_core::writer::validate_name(name).map_err(|e| Error::url(&url, e.to_string()))?;
    Ok(name.to_owned())
}

/// Reads a whole small object (a manifest), with the fetcher's retry rules; `None` when it
/// does not exist.
pub(crate) async fn get_small(
    remote: &Remote,
    store: &Arc<dyn ObjectStore>,
    key: &Key,
) -> Result<Option<(Bytes, UpdateVersion)>> {
    let policy = FetchPolicy::default();
    let retries = AtomicU64::new(0);
    let got = retrying(
        remote,
        &policy,
        &retries,
        "GET",
        &remote.show(key),
        || async {
            let result = store.get_opts(key, GetOptions::default()).await;
            match result {
                Err(object_store::Error::NotFound { .. }) => Ok(None),
                Err(e) => Err(failure_of(e)),
                Ok(result) => {
                    let version = UpdateVersion {
                        e_tag: result.meta.e_tag.clone(),
                        version: result.meta.version.clone(),
                    };
                    let bytes = result.bytes().await.map_err(failure_of)?;
                    Ok(Some((bytes, version)))
                }
            }
        },
    )
    .await?;
    Ok(got)
}

/// A cache published at a URL: its manifest, and the remote of its build's files.
pub struct PublishedCache {
    pub manifest: Manifest,
    pub manifest_bytes: Bytes,
    pub build_id: String,
    /// The URL of the cache (where its manifest is).
    pub url: String,
    /// The build's files: keys `index.bin`, `metadata.arrow`, `shards/NNNNNN.bin` under it.
    pub data: Arc<Remote>,
}

impl std::fmt::Debug for PublishedCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PublishedCache")
            .field("url", &self.url)
            .field("build_id", &self.build_id)
            .field("fingerprint", &self.manifest.fingerprint)
            .finish_non_exhaustive()
    }
}

impl PublishedCache {
    /// Reads and checks the manifest of the cache at `remote` (blocking).
    pub fn open(remote: &Remote) -> Result<PublishedCache> {
        crate::runtime::block_on(Self::open_async(remote))?
    }

    pub async fn open_async(remote: &Remote) -> Result<PublishedCache> {
        let name = cache_name(remote)?;
        let store = remote.store()?;
        let key = remote.key(MANIFEST_FILE);
        let url = remote.show(&key);
        let Some((bytes, _)) = get_small(remote, &store, &key).await? else {
            check_bucket(remote, &store).await?;
            return Err(Error::Request {
                op: "open",
                url: remote.url().to_string(),
                failure: RequestFailure::NotFound,
                reason: format!(
                    "no cache is published there ({url} does not exist); publish one with \
                     `dataset-rt push CACHE_DIR {}`",
                    remote.url()
                ),
            });
        };
        let manifest = parse_manifest(&bytes, &name, Path::new(&url))?;
        let id = build_id(&bytes);
        let data = Arc::new(remote.join(&format!("{BUILDS_DIR}/{id}"))?);
        Ok(PublishedCache {
            manifest,
            manifest_bytes: bytes,
            build_id: id,
            url: remote.url().to_string(),
            data,
        })
    }
}

/// How to push.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PushOptions {
    /// Replace a cache already published at the URL (otherwise that is refused).
    pub replace: bool,
    /// Files larger than this go up in parts (multipart upload). Default 32 MiB.
    pub multipart_threshold: u64,
    /// The size of each part. Default 16 MiB (S3 wants at least 5 MiB for all but the last).
    pub part_size: usize,
    /// Parts or files in flight at once. Default 8.
    pub concurrency: usize,
    /// Builds under `.builds/` that are neither the new one nor the replaced one are removed
    /// once their newest object is older than this (an abandoned push of other content, or a
    /// cache replaced twice). Default 24 hours, so a push in progress elsewhere is never hit.
    pub stale_after: Duration,
}

impl Default for PushOptions {
    fn default() -> Self {
        PushOptions {
            replace: false,
            multipart_threshold: 32 << 20,
            part_size: 16 << 20,
            concurrency: 8,
            stale_after: Duration::from_secs(24 * 3600),
        }
    }
}

/// What a push did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PushReport {
    pub url: String,
    pub build_id: String,
    pub fingerprint: String,
    /// Files uploaded now.
    pub uploaded: Vec<String>,
    /// Files an earlier, interrupted push had uploaded already.
    pub resumed: Vec<String>,
    /// The URL held this very cache already: nothing was written.
    pub already_published: bool,
    /// The fingerprint of the cache this push replaced.
    pub replaced: Option<String>,
    /// Stale builds removed (see [`PushOptions::stale_after`]).
    pub removed_builds: Vec<String>,
}

/// Publishes the local cache `dir` at `remote` (blocking). See the module's comment.
pub fn push(dir: &Path, remote: &Remote, options: &PushOptions) -> Result<PushReport> {
    crate::runtime::block_on(push_async(dir, remote, options))?
}

pub async fn push_async(dir: &Path, remote: &Remote, options: &PushOptions) -> Result<PushReport> {
    if options.part_size < (5 << 20) && remote.is_s3_client() {
        return Err(Error::config(
            "part_size",
            format!(
                "{} is below S3's minimum part size of 5 MiB",
                options.part_size
            ),
        ));
    }
    let name = cache_name(remote)?;
    // Validates the local cache: manifest, fingerprint, every file's size, the headers.
    let cache = Cache::open(dir, Validation::Structure)?;
    if cache.manifest.name != name {
        return Err(Error::url(
            &remote.url().to_string(),
            format!(
                "names cache {name:?}, but {} holds cache {:?}: push it to a URL ending in \
                 /{}",
                dir.display(),
                cache.manifest.name,
                cache.manifest.name
            ),
        ));
    }
    let manifest_path = dir.join(MANIFEST_FILE);
    let manifest_bytes = std::fs::read(&manifest_path)
        .map_err(|e| dataset_rt_core::Error::io("read", &manifest_path, e))?;
    let id = build_id(&manifest_bytes);
    let store = remote.store()?;
    crate::sets::refuse_other_kind(
        remote,
        &store,
        dataset_rt_core::cache_set::SET_MANIFEST_FILE,
    )
    .await?;
    let manifest_key = remote.key(MANIFEST_FILE);
    let mut report = PushReport {
        url: remote.url().to_string(),
        build_id: id.clone(),
        fingerprint: cache.manifest.fingerprint.clone(),
        ..PushReport::default()
    };

    let existing = get_small(remote, &store, &manifest_key).await?;
    if existing.is_none() {
        check_bucket(remote, &store).await?;
    }
    let mut replacing: Option<(UpdateVersion, String)> = None;
    if let Some((bytes, version)) = existing {
        if bytes.as_ref() == manifest_bytes.as_slice() {
            report.already_published = true;
            return Ok(report);
        }
        let fingerprint = serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()
            .and_then(|v| v.get("fingerprint")?.as_str().map(str::to_owned))
            .unwrap_or_else(|| "unreadable".to_owned());
        if !options.replace {
            return Err(Error::AlreadyPublished {
                url: report.url,
                fingerprint,
            });
        }
        report.replaced = Some(fingerprint);
        replacing = Some((version, build_id(&bytes)));
    }

    // Upload what an earlier push has not: an object exists only once its upload completed
    // (a single PUT or a completed multipart upload), and its key names this manifest's hash,
    // so an object of the right size there holds these bytes.
    let build = remote.join(&format!("{BUILDS_DIR}/{id}"))?;
    let present = list_sizes(&build, &store).await?;
    let files = data_files(&cache.manifest);
    drop(cache);
    let uploads = files.iter().filter_map(|(file, bytes, checksum)| {
        if present.get(file.as_str()) == Some(bytes) {
            report.resumed.push(file.clone());
            return None;
        }
        Some((file.clone(), *bytes, checksum.clone()))
    });
    let uploads: Vec<(String, u64, String)> = uploads.collect();
    // Collected first: a stream over a mapping closure would make this future not `Send`.
    let mut running = Vec::with_capacity(uploads.len());
    for (file, bytes, checksum) in &uploads {
        running.push(upload_file(
            &build, &store, dir, file, *bytes, checksum, options,
        ));
    }
    stream::iter(running)
        .buffer_unordered(options.concurrency.max(1))
        .try_collect::<Vec<()>>()
        .await?;
    report.uploaded = uploads.into_iter().map(|(file, _, _)| file).collect();

    // Every file is there (checked again: a cleanup elsewhere must not leave a manifest whose
    // files are gone); then the one write that makes the cache visible.
    let present = list_sizes(&build, &store).await?;
    for (file, bytes, _) in &files {
        if present.get(file.as_str()) != Some(bytes) {
            return Err(Error::Request {
                op: "PUT",
                url: build.show(&build.key(file)),
                failure: RequestFailure::Conflict,
                reason: "the uploaded object is missing or has another size before the commit \
                         (removed by another process?); run push again"
                    .into(),
            });
        }
    }
    commit(
        remote,
        &store,
        &manifest_key,
        &manifest_bytes,
        replacing.as_ref().map(|r| &r.0),
        &report,
    )
    .await?;

    let keep = [Some(id.as_str()), replacing.as_ref().map(|r| r.1.as_str())];
    report.removed_builds = remove_stale_builds(remote, &store, &keep, options.stale_after).await;
    Ok(report)
}

/// Writes the manifest: `Create` for a new cache, `Update` (compare-and-swap on the replaced
/// manifest's version) when replacing. A `Create` that finds our own bytes (a retry whose first
/// response was lost) is a success.
pub(crate) async fn commit(
    remote: &Remote,
    store: &Arc<dyn ObjectStore>,
    key: &Key,
    bytes: &[u8],
    replacing: Option<&UpdateVersion>,
    report: &PushReport,
) -> Result<()> {
    let url = remote.show(key);
    let payload = || PutPayload::from(Bytes::copy_from_slice(bytes));
    let mode = match replacing {
        None => PutMode::Create,
        Some(version) => PutMode::Update(version.clone()),
    };
    let put = store
        .put_opts(key, payload(), PutOptions::from(mode.clone()))
        .await;
    match put {
        Ok(_) => Ok(()),
        // A store without compare-and-swap (a local directory): overwrite, by its atomic rename.
        Err(object_store::Error::NotImplemented { .. }) if replacing.is_some() => store
            .put_opts(key, payload(), PutOptions::from(PutMode::Overwrite))
            .await
            .map(|_| ())
            .map_err(|e| request_error("PUT", url, e)),
        Err(object_store::Error::AlreadyExists { .. }) if replacing.is_none() => {
            match get_small(remote, store, key).await? {
                Some((now, _)) if now.as_ref() == bytes => Ok(()),
                now => {
                    let fingerprint = now
                        .and_then(|(b, _)| serde_json::from_slice::<serde_json::Value>(&b).ok())
                        .and_then(|v| v.get("fingerprint")?.as_str().map(str::to_owned))
                        .unwrap_or_else(|| "unreadable".to_owned());
                    Err(Error::AlreadyPublished {
                        url: report.url.clone(),
                        fingerprint,
                    })
                }
            }
        }
        Err(e @ object_store::Error::Precondition { .. }) => Err(Error::Request {
            op: "PUT",
            url,
            failure: RequestFailure::Conflict,
            reason: format!(
                "the cache there changed while this push replaced it ({e}); nothing was \
                 replaced: run push again"
            ),
        }),
        Err(e) => Err(request_error("PUT", url, e)),
    }
}

/// The sizes of the objects under `remote`, by key relative to it.
async fn list_sizes(remote: &Remote, store: &Arc<dyn ObjectStore>) -> Result<HashMap<String, u64>> {
    let root = remote.key("");
    let prefix_len = root.as_ref().len() + 1;
    let listed: Vec<object_store::ObjectMeta> = store
        .list(Some(&root))
        .try_collect()
        .await
        .map_err(|e| request_error("LIST", remote.url().to_string(), e))?;
    Ok(listed
        .into_iter()
        .filter_map(|m| {
            let key = m.location.as_ref().get(prefix_len..)?.to_owned();
            Some((key, m.size))
        })
        .collect())
}

/// Uploads one file, checking its bytes against the manifest on the way: a local file that
/// changed since it was written is refused before anything names it.
async fn upload_file(
    build: &Remote,
    store: &Arc<dyn ObjectStore>,
    dir: &Path,
    file: &str,
    bytes: u64,
    checksum: &str,
    options: &PushOptions,
) -> Result<()> {
    let path = dir.join(file);
    let key = build.key(file);
    let url = build.show(&key);
    let io = |op, e| Error::Core(dataset_rt_core::Error::io(op, &path, e));
    let mismatch = |got_bytes: u64, got: &str| {
        Error::Core(dataset_rt_core::Error::malformed(
            &dataset_rt_core::cache::dir_cache_name(dir),
            &path,
            format!(
                "changed since it was written: {got_bytes} bytes with checksum {got}, the \
                 manifest says {bytes} bytes with checksum {checksum}; nothing was published"
            ),
        ))
    };
    let mut reader = File::open(&path).map_err(|e| io("open", e))?;
    if bytes <= options.multipart_threshold {
        let mut data = Vec::with_capacity(bytes as usize);
        reader.read_to_end(&mut data).map_err(|e| io("read", e))?;
        let got = checksum_hex(xxhash_rust::xxh3::xxh3_64(&data));
        if data.len() as u64 != bytes || got != checksum {
            return Err(mismatch(data.len() as u64, &got));
        }
        let payload = Bytes::from(data);
        let policy = FetchPolicy::default();
        let retries = AtomicU64::new(0);
        // An overwrite of this key with these bytes is idempotent, so it is safe to retry.
        retrying(build, &policy, &retries, "PUT", &url, || {
            let payload = PutPayload::from(payload.clone());
            async {
                store
                    .put(&key, payload)
                    .await
                    .map(|_| ())
                    .map_err(failure_of)
            }
        })
        .await?;
        return Ok(());
    }
    let upload = store
        .put_multipart(&key)
        .await
        .map_err(|e| request_error("PUT (multipart start)", url.clone(), e))?;
    let mut writer = WriteMultipart::new_with_chunk_size(upload, options.part_size);
    let mut hasher = Xxh3::new();
    let mut sent = 0u64;
    let mut buf = vec![0u8; options.part_size];
    let failed: Result<()> = async {
        loop {
            let n = read_full(&mut reader, &mut buf).map_err(|e| io("read", e))?;
            if n == 0 {
                return Ok(());
            }
            hasher.update(&buf[..n]);
            sent += n as u64;
            writer
                .wait_for_capacity(options.concurrency.max(1))
                .await
                .map_err(|e| request_error("PUT (part)", url.clone(), e))?;
            writer.write(&buf[..n]);
        }
    }
    .await;
    let got = checksum_hex(hasher.digest());
    let failed = failed.and_then(|()| {
        if sent != bytes || got != checksum {
            Err(mismatch(sent, &got))
        } else {
            Ok(())
        }
    });
    if let Err(e) = failed {
        // Best effort: an upload left incomplete is invisible, and a bucket lifecycle rule
        // (AbortIncompleteMultipartUpload) removes it.
        let _ = writer.abort().await;
        return Err(e);
    }
    writer
        .finish()
        .await
        .map_err(|e| request_error("PUT (multipart complete)", url, e))?;
    Ok(())
}

fn read_full(reader: &mut File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// Removes builds under `<url>/.builds/` other than `keep` whose newest object is older than
/// `stale_after`; returns their ids. Best effort: a failure leaves garbage, never fails a push.
async fn remove_stale_builds(
    remote: &Remote,
    store: &Arc<dyn ObjectStore>,
    keep: &[Option<&str>],
    stale_after: Duration,
) -> Vec<String> {
    let builds_root = remote.key(BUILDS_DIR);
    let Ok(listed) = store.list_with_delimiter(Some(&builds_root)).await else {
        return Vec::new();
    };
    let now = chrono_now();
    let mut removed = Vec::new();
    for prefix in listed.common_prefixes {
        let Some(id) = prefix.filename().map(str::to_owned) else {
            continue;
        };
        if keep.contains(&Some(id.as_str())) {
            continue;
        }
        let Ok(objects) = store
            .list(Some(&prefix))
            .try_collect::<Vec<object_store::ObjectMeta>>()
            .await
        else {
            continue;
        };
        let newest = objects.iter().map(|m| m.last_modified.timestamp()).max();
        let age = newest.map_or(i64::MAX, |t| now - t);
        if age < 0 || (age as u64) < stale_after.as_secs() {
            continue;
        }
        let locations = stream::iter(objects.into_iter().map(|m| Ok(m.location))).boxed();
        let deleted: std::result::Result<Vec<Key>, _> =
            store.delete_stream(locations).try_collect().await;
        if deleted.is_ok() {
            removed.push(id);
        }
    }
    removed
}

fn chrono_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// What a pull did.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PullReport {
    pub url: String,
    pub dir: PathBuf,
    pub build_id: String,
    pub fingerprint: String,
    /// Bytes downloaded (0 when the directory held this cache already).
    pub bytes: u64,
    pub already_present: bool,
    /// The parts of a cache set (0 for a cache).
    pub parts: usize,
}

/// Downloads the cache or cache set at `remote` into the directory `dir` (whose last component
/// must be its name), verifying every file against its manifest's size and checksum. A cache's
/// files are written into a temporary sibling (`.NAME.tmp-PID-NANOS`, under the lock
/// `.NAME.lock`, as the core's writer does) that is renamed into place when complete: `dir`
/// holds the whole cache or nothing. A set's parts are pulled so, one by one, and its set
/// manifest is written last (see [`crate::sets`]).
pub fn pull(remote: &Remote, dir: &Path, policy: &FetchPolicy) -> Result<PullReport> {
    match crate::sets::Published::open(remote)? {
        crate::sets::Published::Cache(published) => pull_published(&published, dir, policy),
        crate::sets::Published::Set(set) => crate::sets::pull_set(&set, dir, policy),
    }
}

/// `dir` must be named after what is pulled into it.
pub(crate) fn check_destination(dir: &Path, name: &str, what: &str) -> Result<()> {
    let dir_name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
    if dir_name.as_deref() == Some(name) {
        return Ok(());
    }
    Err(Error::Core(dataset_rt_core::Error::config(
        "pull destination",
        format!(
            "{} must end in the {what}'s name {name:?} (a {what} directory is named after its \
             {what})",
            dir.display()
        ),
    )))
}

/// [`pull`] of one published cache.
pub(crate) fn pull_published(
    published: &PublishedCache,
    dir: &Path,
    policy: &FetchPolicy,
) -> Result<PullReport> {
    let name = &published.manifest.name;
    check_destination(dir, name, "cache")?;
    let base = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from("."),
    };
    let mut report = PullReport {
        url: published.url.clone(),
        dir: dir.to_owned(),
        build_id: published.build_id.clone(),
        fingerprint: published.manifest.fingerprint.clone(),
        bytes: 0,
        already_present: false,
        parts: 0,
    };
    let lock = CacheLock::acquire(&base, name)?;
    lock.remove_leftovers();
    // An empty directory is taken: the rename below replaces it in one step (and fails, with
    // nothing lost, if something appears in it meanwhile).
    let empty = std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_none());
    if dir.exists() && !empty {
        let manifest_path = dir.join(MANIFEST_FILE);
        return match std::fs::read(&manifest_path) {
            Ok(bytes) if bytes == published.manifest_bytes.as_ref() => {
                report.already_present = true;
                Ok(report)
            }
            _ => Err(Error::Core(dataset_rt_core::Error::io(
                "pull into",
                dir,
                std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "the directory exists and holds another cache (or something else); remove \
                     it or pull elsewhere",
                ),
            ))),
        };
    }
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let tmp = base.join(format!(".{name}.tmp-{}-{nanos}", std::process::id()));
    let result = download_into(published, &tmp, policy).and_then(|bytes| {
        std::fs::rename(&tmp, dir).map_err(|e| dataset_rt_core::Error::io("rename", &tmp, e))?;
        sync_dir(&base)?;
        Ok(bytes)
    });
    drop(lock);
    match result {
        Ok(bytes) => {
            report.bytes = bytes;
            Ok(report)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(e)
        }
    }
}

pub(crate) fn sync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|d| d.sync_all())
        .map_err(|e| Error::Core(dataset_rt_core::Error::io("sync", path, e)))
}

/// The most bytes a pull holds in memory at once.
const PULL_WINDOW_BYTES: u64 = 128 << 20;

/// Downloads every file into `tmp` and checks it; returns the bytes downloaded.
fn download_into(published: &PublishedCache, tmp: &Path, policy: &FetchPolicy) -> Result<u64> {
    let core_io = |op, path: &Path, e| Error::Core(dataset_rt_core::Error::io(op, path, e));
    std::fs::create_dir_all(tmp.join(dataset_rt_core::format::SHARDS_DIR))
        .map_err(|e| core_io("create directory", tmp, e))?;
    let fetcher = RangeFetcher::new(Arc::clone(&published.data), policy.clone())?;
    let files = data_files(&published.manifest);
    let mut pending: Vec<(String, u64, String)> = files.clone();
    let mut total = 0u64;
    for fetch in 1..=policy.verify_attempts {
        let mut handles = HashMap::new();
        for (file, bytes, _) in &pending {
            let path = tmp.join(file);
            let f = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(&path)
                .map_err(|e| core_io("create", &path, e))?;
            f.set_len(*bytes)
                .map_err(|e| core_io("allocate", &path, e))?;
            handles.insert(file.clone(), (f, path));
        }
        // Pieces of every pending file, fetched a window at a time, written where they belong.
        let step = policy.max_request_bytes;
        let pieces: Vec<RangeRequest> = pending
            .iter()
            .flat_map(|(file, bytes, _)| {
                (0..*bytes).step_by(step as usize).map(move |start| {
                    RangeRequest::new(file.clone(), start..(start + step).min(*bytes))
                })
            })
            .collect();
        let mut window: Vec<RangeRequest> = Vec::new();
        let mut window_bytes = 0;
        let flush = |window: &mut Vec<RangeRequest>| -> Result<u64> {
            let got = fetcher.fetch_blocking(window, None)?;
            let mut n = 0;
            for (request, bytes) in window.iter().zip(got) {
                let (f, path) = &handles[&request.file];
                f.write_all_at(&bytes, request.range.start)
                    .map_err(|e| core_io("write", path, e))?;
                n += bytes.len() as u64;
            }
            window.clear();
            Ok(n)
        };
        for piece in pieces {
            window_bytes += piece.len();
            window.push(piece);
            if window_bytes >= PULL_WINDOW_BYTES || window.len() >= policy.max_requests {
                total += flush(&mut window)?;
                window_bytes = 0;
            }
        }
        total += flush(&mut window)?;
        // Check each file against the manifest; a mismatch is downloaded again.
        let mut bad = Vec::new();
        for (file, bytes, checksum) in pending {
            let (f, path) = &handles[&file];
            let got = hash_file(f, bytes).map_err(|e| core_io("read", path, e))?;
            if got != checksum {
                bad.push((file, bytes, checksum, got));
                continue;
            }
            f.set_permissions(std::fs::Permissions::from_mode(0o444))
                .map_err(|e| core_io("make read-only", path, e))?;
            f.sync_all().map_err(|e| core_io("sync", path, e))?;
        }
        if bad.is_empty() {
            pending = Vec::new();
            break;
        }
        if fetch == policy.verify_attempts {
            let (file, bytes, checksum, got) = bad.swap_remove(0);
            return Err(Error::Verify {
                url: published.data.show(&published.data.key(&file)),
                range: 0..bytes,
                attempts: fetch,
                reason: format!(
                    "checksum mismatch: computed xxh3-64 {got}, the manifest says {checksum}"
                ),
            });
        }
        pending = bad.into_iter().map(|(f, b, c, _)| (f, b, c)).collect();
    }
    debug_assert!(pending.is_empty());
    let manifest_path = tmp.join(MANIFEST_FILE);
    std::fs::write(&manifest_path, &published.manifest_bytes)
        .and_then(|()| {
            let f = File::open(&manifest_path)?;
            f.set_permissions(std::fs::Permissions::from_mode(0o444))?;
            f.sync_all()
        })
        .map_err(|e| core_io("write", &manifest_path, e))?;
    sync_dir(&tmp.join(dataset_rt_core::format::SHARDS_DIR))?;
    sync_dir(tmp)?;
    // The headers and sizes, as the core checks any cache it opens.
    Cache::open_as(tmp, &published.manifest.name, Validation::Structure)?;
    Ok(total)
}

fn hash_file(f: &File, len: u64) -> std::io::Result<String> {
    let mut hasher = Xxh3::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut at = 0u64;
    while at < len {
        let n = ((len - at) as usize).min(buf.len());
        f.read_exact_at(&mut buf[..n], at)?;
        hasher.update(&buf[..n]);
        at += n as u64;
    }
    Ok(checksum_hex(hasher.digest()))
}

/// One cache found by [`ls`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheListing {
    pub url: String,
    pub name: String,
    /// What its manifest says, or why it could not be read.
    pub summary: std::result::Result<CacheSummary, String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheSummary {
    pub num_samples: u64,
    /// Bytes of every file, the manifest included (of every part, for a set).
    pub bytes: u64,
    pub fingerprint: String,
    pub format_version: u32,
    pub build_id: String,
    /// The parts of a cache set (0 for a cache).
    pub parts: usize,
}

/// The caches published at `remote` and directly under it (blocking).
pub fn ls(remote: &Remote) -> Result<Vec<CacheListing>> {
    crate::runtime::block_on(ls_async(remote))?
}

pub async fn ls_async(remote: &Remote) -> Result<Vec<CacheListing>> {
    let store = remote.store()?;
    let mut candidates: Vec<Remote> = Vec::new();
    if remote.url().name().is_some() {
        candidates.push(remote.duplicate());
    }
    let root = remote.key("");
    let listed = store
        .list_with_delimiter(if root.as_ref().is_empty() {
            None
        } else {
            Some(&root)
        })
        .await
        .map_err(|e| {
            missing_bucket(remote, "LIST", &e)
                .unwrap_or_else(|| request_error("LIST", remote.url().to_string(), e))
        })?;
    for prefix in &listed.common_prefixes {
        match prefix.filename() {
            Some(name) if !name.starts_with('.') => candidates.push(remote.join(name)?),
            _ => {}
        }
    }
    let mut out = Vec::new();
    for candidate in candidates {
        let name = candidate.url().name().unwrap_or_default().to_owned();
        let summary = match cache_summary(&candidate, &store, &name).await? {
            Some(summary) => summary,
            None => match crate::sets::set_summary(&candidate, &store, &name).await? {
                Some(summary) => summary,
                None => continue,
            },
        };
        out.push(CacheListing {
            url: candidate.url().to_string(),
            name,
            summary: summary.map_err(|e| e.to_string()),
        });
    }
    Ok(out)
}

/// What the cache manifest at `remote` says; `None` when there is none.
pub(crate) async fn cache_summary(
    remote: &Remote,
    store: &Arc<dyn ObjectStore>,
    name: &str,
) -> Result<Option<std::result::Result<CacheSummary, dataset_rt_core::Error>>> {
    let key = remote.key(MANIFEST_FILE);
    let Some((bytes, _)) = get_small(remote, store, &key).await? else {
        return Ok(None);
    };
    Ok(Some(
        parse_manifest(&bytes, name, Path::new(&remote.show(&key))).map(|m| CacheSummary {
            num_samples: m.num_samples,
            bytes: data_files(&m).iter().map(|f| f.1).sum::<u64>() + bytes.len() as u64,
            fingerprint: m.fingerprint.clone(),
            format_version: m.format_version,
            build_id: build_id(&bytes),
            parts: 0,
        }),
    ))
}

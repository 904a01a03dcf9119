//! Reading a published cache in place: [`open_cache`] downloads its manifest, `index.bin` and
//! `metadata.arrow` into the node's local directory (validated, checksums included) and opens a
//! core [`Cache`] whose records come from [`RemoteRecords`]. The core's read planner asks that
//! source to fetch the records of the coming positions ahead (`start`), through the node's
//! bounded local cache ([`CachedFetcher`]); each record is verified against its own checksum as
//! it arrives, and again against its index entry when it is read.
//!
//! Local files of one published build (beside the ranges of [`NodeCache`]):
//!
//! ```text
//! <local_dir>/<build-id>/cache/manifest.json    the published manifest, byte for byte
//! <local_dir>/<build-id>/cache/index.bin        downloaded whole, checked against the manifest
//! <local_dir>/<build-id>/cache/metadata.arrow   idem
//! ```
//!
//! They appear by rename, so a crash leaves a temporary file at most, which the next open
//! replaces; a file that fails validation is downloaded again once.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dataset_rt_core::cache::Cache;
use dataset_rt_core::dataset::{Dataset, Range, RangeSource, RecordBytes, RecordSource};
use dataset_rt_core::format::{
    check_record_bytes, shard_file_name, INDEX_FILE, MANIFEST_FILE, METADATA_FILE,
};

use crate::error::{Error, Result};
use crate::fetch::{FetchPolicy, RangeFetcher, RangeRequest, Verify};
use crate::local::{CachedFetcher, NodeCache, RangeKey};
use crate::options::RemoteOptions;
use crate::publish::PublishedCache;
use crate::store::Remote;

/// The largest gap between two records that one request spans (see `open_remote_cache`).
pub const RECORD_GAP: u64 = 4 << 10;

/// The records of one published cache, fetched through the node's local cache.
pub struct RemoteRecords {
    fetcher: Arc<CachedFetcher>,
    verify: Arc<Verify>,
    /// The cache's name (for errors).
    name: String,
    /// The URL of the cache and the options it was opened with (its [`RecordSource::locator`]).
    url: String,
    options: RemoteOptions,
    /// The key of each shard under the build's remote (`shards/000000.bin`), and its URL.
    keys: Vec<String>,
    urls: Vec<String>,
}

impl RemoteRecords {
    fn key(&self, range: &Range) -> RangeKey {
        let file = self
            .keys
            .get(range.shard as usize)
            .cloned()
            .unwrap_or_default();
        RangeRequest::new(file, range.offset..range.end())
    }

    /// The node's local cache this source fetches through.
    pub fn node_cache(&self) -> &Arc<NodeCache> {
        &self.fetcher.cache
    }

    /// The requests and bytes fetched from the store so far by this source.
    pub fn fetch_stats(&self) -> crate::fetch::FetchStats {
        self.fetcher.fetcher.stats()
    }
}

impl RangeSource for RemoteRecords {
    fn name(&self) -> &'static str {
        "object-store"
    }

    fn begin_pass(&self, _shuffled: bool) {}

    fn resident(&self, range: &Range) -> bool {
        self.fetcher.cache.contains(&self.key(range))
    }

    /// Pins the ranges (no process evicts them before they are released) and downloads them
    /// on the runtime's blocking pool, coalesced into requests, without waiting. A failure here
    /// is not reported: the read of the record fetches it again and reports it.
    fn start(&self, ranges: &[Range]) {
        let keys: Vec<RangeKey> = ranges.iter().map(|r| self.key(r)).collect();
        if let Err(e) = self.fetcher.cache.pin(&keys) {
            log::debug!("cannot pin ranges of {}: {e}", self.name);
        }
        let Ok(runtime) = crate::runtime::runtime() else {
            return; // the read reports why the runtime could not start
        };
        let fetcher = Arc::clone(&self.fetcher);
        let verify = Arc::clone(&self.verify);
        let name = self.name.clone();
        runtime.spawn_blocking(move || {
            if let Err(e) = fetcher.fetch_blocking(&keys, Some(verify.as_ref())) {
                log::debug!("prefetch of {} ranges of {name} failed: {e}", keys.len());
            }
        });
    }

    fn release(&self, ranges: &[Range]) {
        let keys: Vec<RangeKey> = ranges.iter().map(|r| self.key(r)).collect();
        if let Err(e) = self.fetcher.cache.unpin(&keys) {
            log::debug!("cannot unpin ranges of {}: {e}", self.name);
        }
    }
}

impl RecordSource for RemoteRecords {
    fn read(&self, range: &Range, sample: u64) -> dataset_rt_core::Result<RecordBytes> {
        let key = self.key(range);
        match self
            .fetcher
            .fetch_blocking(std::slice::from_ref(&key), Some(self.verify.as_ref()))
        {
            Ok(mut got) => Ok(Box::new(got.pop().unwrap_or_default())),
            Err(Error::Verify {
                url,
                attempts,
                reason,
                ..
            }) => Err(dataset_rt_core::Error::CorruptRecord {
                cache: self.name.clone(),
                shard: PathBuf::from(url),
                offset: range.offset,
                sample,
                reason: format!("{reason} (fetched {attempts} times)"),
            }),
            Err(e) => Err(e.into()),
        }
    }

    fn discard(&self, range: &Range) {
        if let Err(e) = self.fetcher.cache.remove(&self.key(range)) {
            log::debug!("cannot discard a range of {}: {e}", self.name);
        }
    }

    /// The URL and the options, as JSON: [`open_located`] opens the same cache from it.
    fn locator(&self) -> String {
        let o = &self.options;
        serde_json::json!({
            "url": self.url,
            "local_dir": o.local_dir.as_ref().map(|d| d.to_string_lossy().into_owned()),
            "max_local_bytes": o.max_local_bytes,
            "max_requests": o.max_requests,
            "endpoint": o.endpoint,
            "region": o.region,
            "allow_http": o.allow_http,
        })
        .to_string()
    }

    fn shard_location(&self, shard: u32) -> String {
        self.urls
            .get(shard as usize)
            .cloned()
            .unwrap_or_else(|| format!("shard {shard} (the cache has {})", self.urls.len()))
    }
}

/// A published cache opened for reading, with its record source (for measurements and tests).
pub struct OpenedCache {
    pub cache: Arc<Cache>,
    pub records: Arc<RemoteRecords>,
    pub build_id: String,
}

/// Opens the cache published at `url` for reading in place (see the module's documentation).
pub fn open_cache(url: &str, options: &RemoteOptions) -> Result<OpenedCache> {
    options.validate()?;
    let remote = Remote::open(url, options)?;
    open_remote_cache(&remote, options)
}

/// Opens the cache that a [`RecordSource::locator`] of another process names (the loader's
/// producer, on the same node: the same local directory, so the same downloaded files).
pub fn open_located(locator: &str) -> Result<OpenedCache> {
    let bad = |reason: String| Error::config("locator", reason);
    let v: serde_json::Value =
        serde_json::from_str(locator).map_err(|e| bad(format!("not JSON: {e}")))?;
    let text = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_owned);
    let number = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
    let url = text("url").ok_or_else(|| bad("no url".into()))?;
    let options = RemoteOptions {
        local_dir: text("local_dir").map(PathBuf::from),
        max_local_bytes: number("max_local_bytes"),
        max_requests: number("max_requests").map(|n| n as usize),
        endpoint: text("endpoint"),
        region: text("region"),
        allow_http: v.get("allow_http").and_then(serde_json::Value::as_bool),
    };
    open_cache(&url, &options)
}

/// [`open_cache`] on an opened [`Remote`] (tests give one over a store of their own).
pub fn open_remote_cache(remote: &Remote, options: &RemoteOptions) -> Result<OpenedCache> {
    let published = PublishedCache::open(remote)?;
    let root = options.resolved_local_dir()?;
    let node = Arc::new(NodeCache::open(
        &root,
        &published.build_id,
        options.resolved_max_local_bytes(),
    )?);
    let policy = FetchPolicy {
        max_requests: options.resolved_max_requests(),
        // Records of a shuffled pass are scattered: neighbours are merged into one request only
        // across a gap of at most a page (the padding between records), so that no request
        // fetches bytes that no record needs.
        max_gap: RECORD_GAP,
        ..FetchPolicy::default()
    };
    let fetcher = RangeFetcher::new(Arc::clone(&published.data), policy)?;
    let version = published.manifest.format_version;
    let verify: Arc<Verify> = Arc::new(move |_: &RangeRequest, bytes: &[u8]| {
        check_record_bytes(version, bytes).map(|_| ())
    });
    let keys: Vec<String> = (0..published.manifest.shards.len() as u32)
        .map(shard_file_name)
        .collect();
    let urls = keys
        .iter()
        .map(|k| published.data.show(&published.data.key(k)))
        .collect();
    let name = published.manifest.name.clone();
    let records = Arc::new(RemoteRecords {
        fetcher: Arc::new(CachedFetcher::new(fetcher, Arc::clone(&node))),
        verify,
        name: name.clone(),
        url: published.url.clone(),
        options: options.clone(),
        keys,
        urls,
    });
    let dir = node.dir().join("cache");
    let source: Arc<dyn RecordSource> = records.clone();
    let cache = match local_copy(&published, &dir, false)
        .and_then(|()| Ok(Cache::open_fetched(&dir, &name, Arc::clone(&source))?))
    {
        Ok(cache) => cache,
        // A local copy that does not validate (damaged on disk): download it again, once.
        Err(Error::Core(dataset_rt_core::Error::Malformed { .. })) => {
            local_copy(&published, &dir, true)?;
            Cache::open_fetched(&dir, &name, source)?
        }
        Err(e) => return Err(e),
    };
    Ok(OpenedCache {
        cache: Arc::new(cache),
        records,
        build_id: published.build_id,
    })
}

/// Verifies every record of a cache opened in place, in storage order (what `dataset-rt verify`
/// runs on a URL): its `index.bin` and `metadata.arrow` were checked against the manifest when
/// it was opened, and here each record's header against the index, its checksum and its LZ4
/// decoding, fetched ahead [`VERIFY_BATCH`] records at a time. The shards' whole-file checksums
/// are not computed (the bytes between records are not fetched).
pub fn verify_records(opened: &OpenedCache) -> Result<()> {
    let cache = &opened.cache;
    let ds = Dataset::new(vec![Arc::clone(cache)]);
    let mut start = 0;
    while start < cache.len() {
        let end = (start + VERIFY_BATCH).min(cache.len());
        let ranges: Vec<Range> = (start..end).filter_map(|s| ds.record_range(s)).collect();
        opened.records.start(&ranges);
        let checked = (start..end).try_for_each(|s| cache.payload(s).map(drop));
        opened.records.release(&ranges);
        checked?;
        start = end;
    }
    Ok(())
}

/// Records fetched ahead at once by [`verify_records`].
pub const VERIFY_BATCH: u64 = 256;

/// Makes `dir` hold the published manifest, `index.bin` and `metadata.arrow`: downloads the
/// files that are missing (all of them when `again`), each into a temporary file renamed into
/// place. Their contents are checked by the cache's open.
fn local_copy(published: &PublishedCache, dir: &Path, again: bool) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| io_err("create directory", dir, e))?;
    let files = [
        (INDEX_FILE, published.manifest.index.bytes),
        (METADATA_FILE, published.manifest.metadata.bytes),
    ];
    let missing: Vec<(&str, u64)> = files
        .into_iter()
        .filter(|(f, len)| again || fs::metadata(dir.join(f)).ok().map(|m| m.len()) != Some(*len))
        .collect();
    if !missing.is_empty() {
        let requests: Vec<RangeRequest> = missing
            .iter()
            .map(|(f, len)| RangeRequest::new(*f, 0..*len))
            .collect();
        let fetcher = RangeFetcher::new(Arc::clone(&published.data), FetchPolicy::default())?;
        let got = fetcher.fetch_blocking(&requests, None)?;
        for ((file, _), bytes) in missing.iter().zip(got) {
            write_renamed(&dir.join(file), &bytes)?;
        }
    }
    let manifest = dir.join(MANIFEST_FILE);
    if again || fs::read(&manifest).ok().as_deref() != Some(&published.manifest_bytes[..]) {
        write_renamed(&manifest, &published.manifest_bytes)?;
    }
    Ok(())
}

fn write_renamed(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    fs::write(&tmp, bytes)
        .and_then(|()| fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = fs::remove_file(&tmp);
            io_err("write", path, e)
        })
}

fn io_err(op: &'static str, path: &Path, e: std::io::Error) -> Error {
    Error::Core(dataset_rt_core::Error::io(op, path, e))
}

//! Caches on object storage, for the command line: the check of a `RemoteConfig`, and
//! `push_cache`, `pull_cache` and `list_caches` over `dataset-rt-remote`. Every decision is
//! that crate's; this file converts values, waits with the GIL released (answering Ctrl-C), and
//! maps its errors onto the Python exception tree.

use std::path::PathBuf;
use std::sync::mpsc;
use std::time::Duration;

use dataset_rt_remote::options::{MAX_MAX_REQUESTS, MIN_LOCAL_BYTES};
use dataset_rt_remote::{
    ls, open_published, open_urls, publish_set_manifest, published_parts, pull, push, push_set,
    verify_records, CacheListing, FetchPolicy, OpenedCache, Published, PullReport, PushOptions,
    PushReport, Remote, RemoteOptions,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::config::{boolean, int_field};
use crate::errors::{remote_to_py, ConfigError};
use crate::runtime::type_name;

/// A `RemoteConfig`, read field by field from the dataclass's attributes: the one place the
/// bindings list its fields.
#[derive(FromPyObject)]
pub struct RemoteFields<'py> {
    #[pyo3(attribute)]
    local_dir: Option<Bound<'py, PyAny>>,
    #[pyo3(attribute)]
    max_local_bytes: Option<Bound<'py, PyAny>>,
    #[pyo3(attribute)]
    max_requests: Bound<'py, PyAny>,
    #[pyo3(attribute)]
    endpoint: Option<Bound<'py, PyAny>>,
    #[pyo3(attribute)]
    region: Option<Bound<'py, PyAny>>,
    #[pyo3(attribute)]
    allow_http: Option<Bound<'py, PyAny>>,
}

/// A `str` field. A value of another type is named by its type only: a value given in place of
/// an endpoint could hold anything, a secret included.
fn text(field: &str, value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<String>> {
    value
        .map(|v| {
            v.extract::<String>().map_err(|_| {
                ConfigError::new_err(format!(
                    "invalid {field}: expected a str or None, got {}",
                    type_name(v)
                ))
            })
        })
        .transpose()
}

impl RemoteFields<'_> {
    /// The checked options: the types here, the domains by `RemoteOptions::validate`.
    pub fn options(&self) -> PyResult<RemoteOptions> {
        let local_dir = self
            .local_dir
            .as_ref()
            .map(|v| {
                v.extract::<PathBuf>().map_err(|_| {
                    ConfigError::new_err(format!(
                        "invalid RemoteConfig.local_dir: expected a str, an os.PathLike or None, \
                         got {}",
                        type_name(v)
                    ))
                })
            })
            .transpose()?;
        let max_local_bytes = self
            .max_local_bytes
            .as_ref()
            .map(|v| {
                int_field(
                    "RemoteConfig.max_local_bytes",
                    v,
                    &format!("an int of at least {MIN_LOCAL_BYTES} (64 MiB) or None"),
                )
            })
            .transpose()?;
        let max_requests = int_field(
            "RemoteConfig.max_requests",
            &self.max_requests,
            &format!("an int from 1 to {MAX_MAX_REQUESTS}"),
        )?;
        let allow_http = self
            .allow_http
            .as_ref()
            .map(|v| boolean("RemoteConfig.allow_http", v))
            .transpose()?;
        let options = RemoteOptions {
            local_dir,
            max_local_bytes,
            max_requests: Some(usize::try_from(max_requests).unwrap_or(usize::MAX)),
            endpoint: text("RemoteConfig.endpoint", self.endpoint.as_ref())?,
            region: text("RemoteConfig.region", self.region.as_ref())?,
            allow_http,
        };
        options.validate().map_err(remote_to_py)?;
        Ok(options)
    }
}

/// Checks a `RemoteConfig` as it is made.
#[pyfunction]
pub fn check_remote_config(config: RemoteFields<'_>) -> PyResult<()> {
    config.options().map(drop)
}

/// How often a wait looks at Python's signal handlers.
const SIGNAL_POLL: Duration = Duration::from_millis(100);

/// Runs `work` on a thread of its own while this one waits with the GIL released, running
/// Python's signal handlers every [`SIGNAL_POLL`]. Every request has a timeout, so `work` ends;
/// but a transfer of many gigabytes takes long, and Ctrl-C must stop the command at once. When a
/// handler raises (KeyboardInterrupt), its exception is returned and `work` is left to end with
/// the process, which is what the command line does next: an interrupted push stays invisible
/// and is resumed by the next one, and an interrupted pull leaves only a temporary directory,
/// removed by the next pull.
pub(crate) fn wait_interruptibly<T: Send + 'static>(
    py: Python<'_>,
    work: impl FnOnce() -> dataset_rt_remote::Result<T> + Send + 'static,
) -> PyResult<T> {
    let (done, mut outcome) = mpsc::channel();
    std::thread::Builder::new()
        .name("dataset-rt-publish".into())
        .spawn(move || {
            // The receiver is gone only when the caller stopped waiting: nothing to tell.
            let _ = done.send(work());
        })
        .map_err(|e| {
            crate::errors::to_py(dataset_rt_core::Error::Runtime(format!(
                "cannot start a thread for the transfer: {e}"
            )))
        })?;
    loop {
        // The receiver travels into the wait and back: it may be used by one thread at a time.
        let (received, receiver) = py.detach(move || (outcome.recv_timeout(SIGNAL_POLL), outcome));
        outcome = receiver;
        match received {
            Ok(result) => return result.map_err(remote_to_py),
            Err(mpsc::RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                return Err(crate::errors::to_py(dataset_rt_core::Error::Runtime(
                    "the transfer thread panicked".into(),
                )))
            }
        }
    }
}

fn push_report<'py>(py: Python<'py>, report: PushReport) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("url", report.url)?;
    dict.set_item("build_id", report.build_id)?;
    dict.set_item("fingerprint", report.fingerprint)?;
    dict.set_item("uploaded", report.uploaded)?;
    dict.set_item("resumed", report.resumed)?;
    dict.set_item("already_published", report.already_published)?;
    dict.set_item("replaced", report.replaced)?;
    dict.set_item("removed_builds", report.removed_builds)?;
    Ok(dict)
}

fn pull_report<'py>(py: Python<'py>, report: PullReport) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("url", report.url)?;
    dict.set_item("dir", report.dir)?;
    dict.set_item("build_id", report.build_id)?;
    dict.set_item("fingerprint", report.fingerprint)?;
    dict.set_item("bytes", report.bytes)?;
    dict.set_item("already_present", report.already_present)?;
    dict.set_item("parts", report.parts)?;
    Ok(dict)
}

fn listing<'py>(py: Python<'py>, cache: CacheListing) -> PyResult<Bound<'py, PyDict>> {
    let dict = PyDict::new(py);
    dict.set_item("url", cache.url)?;
    dict.set_item("name", cache.name)?;
    let (summary, error) = match cache.summary {
        Ok(summary) => (Some(summary), None),
        Err(reason) => (None, Some(crate::errors::scrub_credentials(reason))),
    };
    dict.set_item("num_samples", summary.as_ref().map(|s| s.num_samples))?;
    dict.set_item("bytes", summary.as_ref().map(|s| s.bytes))?;
    dict.set_item(
        "fingerprint",
        summary.as_ref().map(|s| s.fingerprint.clone()),
    )?;
    dict.set_item("format_version", summary.as_ref().map(|s| s.format_version))?;
    dict.set_item("parts", summary.as_ref().map(|s| s.parts))?;
    dict.set_item("build_id", summary.as_ref().map(|s| s.build_id.clone()))?;
    dict.set_item("error", error)?;
    Ok(dict)
}

/// Publishes the cache (or cache set) directory `cache_dir` at `url` (whose last segment must be
/// its name); returns what was done as a dict (`_PushReport` in the stub).
#[pyfunction]
#[pyo3(signature = (cache_dir, url, remote_config, replace = false))]
pub fn push_cache<'py>(
    py: Python<'py>,
    cache_dir: PathBuf,
    url: String,
    remote_config: RemoteFields<'_>,
    replace: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let options = remote_config.options()?;
    let dir = crate::inspect::cache_or_set_dir(&cache_dir)?;
    let push_options = PushOptions {
        replace,
        ..PushOptions::default()
    };
    let report = wait_interruptibly(py, move || {
        let remote = Remote::open(&url, &options)?;
        if dataset_rt_core::cache_set::is_set_dir(&dir) {
            push_set(&dir, &remote, &push_options)
        } else {
            push(&dir, &remote, &push_options)
        }
    })?;
    push_report(py, report)
}

/// Downloads the cache or cache set published at `url` into the directory `dir` (whose last
/// component must be its name), verified file by file; `dir` ends up holding the whole cache
/// (or set) or nothing. Returns what was done as a dict (`_PullReport` in the stub).
#[pyfunction]
pub fn pull_cache<'py>(
    py: Python<'py>,
    url: String,
    dir: PathBuf,
    remote_config: RemoteFields<'_>,
) -> PyResult<Bound<'py, PyDict>> {
    let options = remote_config.options()?;
    let policy = FetchPolicy {
        max_requests: options.resolved_max_requests(),
        ..FetchPolicy::default()
    };
    let report = wait_interruptibly(py, move || {
        let remote = Remote::open(&url, &options)?;
        pull(&remote, &dir, &policy)
    })?;
    pull_report(py, report)
}

/// The node's local cache directory that `remote_config` names (the field, else the
/// environment, else the user's cache directory).
#[pyfunction]
pub fn remote_local_dir(remote_config: RemoteFields<'_>) -> PyResult<PathBuf> {
    remote_config
        .options()?
        .resolved_local_dir()
        .map_err(crate::errors::remote_to_py)
}

/// Opens what is published at `url` in place: the cache, or every part of the set, in order.
fn open_one(url: String, options: RemoteOptions) -> dataset_rt_remote::Result<Vec<OpenedCache>> {
    open_urls(&[url], &options)?
        .pop()
        .expect("one result per URL")
}

/// The manifest of the cache (or the set manifest of the set) published at `url` as JSON text,
/// after the checks of opening it in place (each cache's index and metadata table downloaded
/// into the node's local cache and checked against its manifest).
#[pyfunction]
pub fn inspect_remote_cache(
    py: Python<'_>,
    url: String,
    remote_config: RemoteFields<'_>,
) -> PyResult<String> {
    let options = remote_config.options()?;
    let text = wait_interruptibly(py, move || {
        let published = Published::open(&Remote::open(&url, &options)?)?;
        let text = String::from_utf8_lossy(published.manifest_bytes()).into_owned();
        open_published(published, &options, 0)?;
        Ok(text)
    })?;
    Ok(text)
}

/// Verifies the cache (or every part of the set) published at `url` in place: each index and
/// metadata table against its manifest, then every record (header, checksum, decoding), fetched
/// ahead through the node's local cache. Returns `(samples, shards)`.
#[pyfunction]
pub fn verify_remote_cache(
    py: Python<'_>,
    url: String,
    remote_config: RemoteFields<'_>,
) -> PyResult<(u64, usize)> {
    let options = remote_config.options()?;
    wait_interruptibly(py, move || {
        let mut totals = (0, 0);
        for opened in open_one(url, options)? {
            verify_records(&opened)?;
            totals.0 += opened.cache.len();
            totals.1 += opened.cache.num_shards();
        }
        Ok(totals)
    })
}

/// The parts of the set `url` (`NAME.part-000000`... under it), each with its sample count when
/// it is published, else `None`.
#[pyfunction]
pub fn published_set_parts(
    py: Python<'_>,
    url: String,
    parts: usize,
    remote_config: RemoteFields<'_>,
) -> PyResult<Vec<(String, Option<u64>)>> {
    let options = remote_config.options()?;
    wait_interruptibly(py, move || {
        published_parts(&Remote::open(&url, &options)?, parts)
    })
}

/// Publishes the set `url` over its `parts` parts, each already published under it, by one
/// conditional write of its set manifest; returns what was done (`_PushReport` in the stub).
#[pyfunction]
pub fn publish_set<'py>(
    py: Python<'py>,
    url: String,
    parts: usize,
    remote_config: RemoteFields<'_>,
) -> PyResult<Bound<'py, PyDict>> {
    let options = remote_config.options()?;
    let report = wait_interruptibly(py, move || {
        publish_set_manifest(&Remote::open(&url, &options)?, parts)
    })?;
    push_report(py, report)
}

/// The caches published at `url` and directly under it, each a dict (`_CacheListing` in the
/// stub; its summary fields are `None` and `error` says why when its manifest is unreadable).
#[pyfunction]
pub fn list_caches<'py>(
    py: Python<'py>,
    url: String,
    remote_config: RemoteFields<'_>,
) -> PyResult<Bound<'py, PyList>> {
    let options = remote_config.options()?;
    let caches = wait_interruptibly(py, move || {
        let remote = Remote::open(&url, &options)?;
        ls(&remote)
    })?;
    let out = PyList::empty(py);
    for cache in caches {
        out.append(listing(py, cache)?)?;
    }
    Ok(out)
}

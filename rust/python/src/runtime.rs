//! `Runtime`: the worker pool; `from_cache_sources`, which decides per source whether to load,
//! write, report missing or malformed, and builds the dataset; and `open_caches`, which only
//! loads, sharing that load and that dataset. A source that is a cache set is built by
//! `cache_set.rs`; a published set loads here as its parts.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::cache_set::{check_part_names, Opened};
use dataset_rt_core::dataset::ReadOptions;
use dataset_rt_core::metadata::MetaValue;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::progress::WriteProgress;
use dataset_rt_core::verify::VerifyPolicy;
use dataset_rt_core::writer::{
    check_base_dir, reap_dead_leftovers, validate_names, CacheLock, CacheWriter, Claim,
    InterruptCheck, MetaKey, Payload, SharedBytes, Staged, WriterOptions,
};
use dataset_rt_core::Error;
use dataset_rt_remote::location::RemoteUrl;
use pyo3::prelude::*;
use pyo3::types::{
    PyBool, PyByteArray, PyBytes, PyDict, PyFloat, PyInt, PyList, PyMapping, PyMemoryView,
    PyString, PyTuple,
};

use crate::cache_set::SetSource;
use crate::config::{ReaderFields, WriterFields};
use crate::dataset::Dataset;
use crate::errors::{to_py, ConfigError, IntoPyResult};
use crate::progress::PyStderr;
use crate::remote::RemoteFields;
use dataset_rt_remote::open_urls;

#[pyclass(module = "dataset_rt._native", frozen)]
pub struct Runtime {
    pub pool: Arc<Pool>,
}

/// One source's outcome: (kind, name, cache path, message, samples).
pub(crate) type Outcome = (&'static str, String, PathBuf, Option<String>, Option<u64>);

#[pymethods]
impl Runtime {
    #[new]
    fn new(num_workers: i64) -> PyResult<Self> {
        if num_workers < 1 {
            return Err(ConfigError::new_err(format!(
                "invalid DatasetRuntime.num_workers: must be at least 1, got {num_workers}"
            )));
        }
        Ok(Runtime {
            pool: Pool::new(num_workers as usize).py_err()?,
        })
    }

    #[getter]
    fn num_workers(&self) -> usize {
        self.pool.num_workers()
    }

    #[getter]
    fn closed(&self) -> bool {
        self.pool.is_closed()
    }

    /// Stops the workers after the work already queued.
    fn close(&self, py: Python<'_>) {
        py.detach(|| self.pool.close());
    }

    /// Loads or writes every source, then opens the loaded caches as one dataset. `split` is
    /// the (rank, world size) resolved from the config or the environment.
    #[pyo3(signature = (sources, base_cache_dir, reader, split, writer))]
    #[allow(clippy::wrong_self_convention)]
    fn from_cache_sources(
        &self,
        py: Python<'_>,
        sources: &Bound<'_, PyAny>,
        base_cache_dir: PathBuf,
        reader: ReaderFields<'_>,
        split: (u64, u64),
        writer: &Bound<'_, PyAny>,
    ) -> PyResult<(Option<Dataset>, Vec<Outcome>)> {
        // A closed runtime, or one inherited by a forked child, can do nothing: say so before
        // anything is created or any source is judged.
        self.pool.check_usable().py_err()?;
        let reading = reader.reading(Some(split))?;
        let fields: WriterFields<'_> = writer.extract()?;
        let (write, show_progress) = fields.options()?;
        let processes = fields.processes()?;

        let sources: Vec<Bound<'_, PyAny>> =
            if sources.is_instance_of::<PyList>() || sources.is_instance_of::<PyTuple>() {
                sources.try_iter()?.collect::<PyResult<_>>()?
            } else {
                vec![sources.clone()]
            };
        if sources.is_empty() {
            return Err(ConfigError::new_err(
                "from_cache_sources needs at least one source",
            ));
        }
        // Every name is checked before anything is written.
        let names = sources
            .iter()
            .enumerate()
            .map(|(i, s)| source_name(i, s))
            .collect::<PyResult<Vec<_>>>()?;
        validate_names(
            &names,
            "source name",
            "each source writes base_cache_dir/name, so names must be unique; nothing was written",
        )
        .py_err()?;

        // A set's name and parts are checked with the names, before anything is written.
        let sets = SetSource::find(&sources, &names)?;
        let plain: Vec<&str> = (names.iter().zip(&sets))
            .filter_map(|(name, set)| set.is_none().then_some(name.as_str()))
            .collect();
        let set_parts: Vec<(&str, usize)> = (sets.iter().flatten())
            .map(|set| (set.name.as_str(), set.parts.len()))
            .collect();
        check_part_names(&plain, &set_parts).py_err()?;

        check_base_dir(&base_cache_dir).py_err()?;

        let mut progress = show_progress.then(|| WriteProgress::new(sources.len()));
        let mut outcomes = Vec::with_capacity(sources.len());
        let mut caches = Vec::new();
        for (i, (source, name)) in sources.iter().zip(&names).enumerate() {
            let path = base_cache_dir.join(name);
            if let Some(set) = &sets[i] {
                let settings = crate::cache_set::SetSettings {
                    write: &write,
                    writer,
                    processes,
                    validation: reading.validation,
                };
                let (parts, outcome, loaded) =
                    self.one_set(py, set, i, &base_cache_dir, &settings, progress.as_mut())?;
                outcomes.extend(parts);
                outcomes.push((outcome.0, name.clone(), path, outcome.1, outcome.2));
                caches.extend(loaded.into_iter().map(Arc::new));
                continue;
            }
            let (outcome, cache) = self.one_source(
                py,
                source,
                i,
                name,
                &base_cache_dir,
                &write,
                reading.validation,
                progress.as_mut(),
            )?;
            outcomes.push((outcome.0, name.clone(), path, outcome.1, outcome.2));
            caches.extend(cache.into_iter().map(Arc::new));
        }
        self.dataset(py, caches, outcomes, reading.read, reading.verify)
    }

    /// Loads existing caches by name, as `from_cache_sources` loads them, and nothing else:
    /// no source is iterated, and nothing under `base_cache_dir` is created, locked or removed
    /// (no lock file, no reaping of dead writers' leftovers), so it works on read-only storage
    /// and beside running writers.
    #[pyo3(signature = (names, base_cache_dir, reader, split))]
    fn open_caches(
        &self,
        py: Python<'_>,
        names: &Bound<'_, PyAny>,
        base_cache_dir: PathBuf,
        reader: ReaderFields<'_>,
        split: (u64, u64),
    ) -> PyResult<(Option<Dataset>, Vec<Outcome>)> {
        self.pool.check_usable().py_err()?;
        let reading = reader.reading(Some(split))?;
        let names = cache_names(names)?;
        validate_names(
            &names,
            "cache name",
            "a dataset holds each cache once; nothing was opened",
        )
        .py_err()?;
        check_base_dir(&base_cache_dir).py_err()?;

        let mut outcomes = Vec::with_capacity(names.len());
        let mut caches = Vec::new();
        for name in &names {
            let path = base_cache_dir.join(name);
            let (outcome, cache) = match std::fs::metadata(&path) {
                Ok(_) => self.load_existing(py, &path, reading.validation, Leftovers::Keep)?,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => (
                    (
                        "missing",
                        Some(format!(
                            "no cache at {}; open_caches only loads existing caches \
                             (from_cache_sources writes missing ones from their sources)",
                            path.display()
                        )),
                        None,
                    ),
                    Vec::new(),
                ),
                Err(e) => return Err(to_py(Error::io("open", &path, e))),
            };
            outcomes.push((outcome.0, name.clone(), path, outcome.1, outcome.2));
            caches.extend(cache.into_iter().map(Arc::new));
        }
        self.dataset(py, caches, outcomes, reading.read, reading.verify)
    }

    /// `open_caches` on a URL (`s3://bucket/prefix`, `file:///dir`): each name's cache is the
    /// one published at `base_url/name`, read in place through the node's local cache that
    /// `remote` configures. Its index and metadata table are downloaded (and validated) here;
    /// its records are fetched as the read planner asks for them. Nothing is written remotely.
    #[pyo3(signature = (names, base_url, reader, split, remote))]
    fn open_remote_caches(
        &self,
        py: Python<'_>,
        names: &Bound<'_, PyAny>,
        base_url: String,
        reader: ReaderFields<'_>,
        split: (u64, u64),
        remote: RemoteFields<'_>,
    ) -> PyResult<(Option<Dataset>, Vec<Outcome>)> {
        self.pool.check_usable().py_err()?;
        let reading = reader.reading(Some(split))?;
        let names = cache_names(names)?;
        validate_names(
            &names,
            "cache name",
            "a dataset holds each cache once; nothing was opened",
        )
        .py_err()?;
        let options = remote.options()?;
        // The base is checked as given: "file://" joined first would be reported as the URL it
        // folds into ("file:/name").
        RemoteUrl::parse(&base_url).map_err(crate::errors::remote_to_py)?;
        let base = base_url.trim_end_matches('/');
        let urls: Vec<String> = names.iter().map(|name| format!("{base}/{name}")).collect();
        // One local budget for all of them: each is told the bytes of the others.
        let opened = {
            let urls = urls.clone();
            crate::remote::wait_interruptibly(py, move || open_urls(&urls, &options))?
        };
        let mut outcomes = Vec::with_capacity(names.len());
        let mut caches = Vec::new();
        for ((name, url), opened) in names.iter().zip(urls).zip(opened) {
            let (kind, message, len) = match opened.map_err(crate::errors::remote_to_py) {
                Ok(opened) => {
                    let n = opened.iter().map(|o| o.cache.len()).sum();
                    caches.extend(opened.into_iter().map(|o| o.cache));
                    ("loaded", None, Some(n))
                }
                Err(e)
                    if e.value(py)
                        .is_instance_of::<pyo3::exceptions::PyFileNotFoundError>() =>
                {
                    (
                        "missing",
                        Some(format!(
                            "{}; open_caches only opens published caches",
                            e.value(py)
                        )),
                        None,
                    )
                }
                Err(e)
                    if e.value(py)
                        .is_instance_of::<crate::errors::CacheMalformedError>() =>
                {
                    ("malformed", Some(e.value(py).to_string()), None)
                }
                Err(e) => return Err(e),
            };
            outcomes.push((kind, name.clone(), PathBuf::from(url), message, len));
        }
        self.dataset(py, caches, outcomes, reading.read, reading.verify)
    }
}

/// `open_caches`' names: one `str`, or a non-empty list or tuple of them.
fn cache_names(names: &Bound<'_, PyAny>) -> PyResult<Vec<String>> {
    let utf8 = |i: usize, name: &Bound<'_, PyString>| {
        name.to_str().map(str::to_owned).map_err(|_| {
            ConfigError::new_err(format!(
                "open_caches: name {i} ({}) is not valid UTF-8; a cache name is a directory \
                 name",
                name.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
        })
    };
    if let Ok(name) = names.cast::<PyString>() {
        return Ok(vec![utf8(0, name)?]);
    }
    if !(names.is_instance_of::<PyList>() || names.is_instance_of::<PyTuple>()) {
        return Err(ConfigError::new_err(format!(
            "open_caches: names must be a str or a list or tuple of str, got {}",
            type_name(names)
        )));
    }
    let names: Vec<Bound<'_, PyAny>> = names.try_iter()?.collect::<PyResult<_>>()?;
    if names.is_empty() {
        return Err(ConfigError::new_err("open_caches needs at least one name"));
    }
    names
        .iter()
        .enumerate()
        .map(|(i, name)| {
            let name = name.cast::<PyString>().map_err(|_| {
                ConfigError::new_err(format!(
                    "open_caches: name {i} must be a str, got {} {}",
                    type_name(name),
                    name.repr().map(|r| r.to_string()).unwrap_or_default()
                ))
            })?;
            utf8(i, name)
        })
        .collect()
}

/// Whether loading a cache first removes the temporary directories its dead writers left.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Leftovers {
    Reap,
    Keep,
}

/// A source's outcome (kind, message, samples) and the caches it loaded: none, one, or the
/// parts of a set.
pub(crate) type SourceResult = ((&'static str, Option<String>, Option<u64>), Vec<Cache>);

/// A source's `name`: a str that is valid UTF-8 (it names a directory on disk).
fn source_name(i: usize, source: &Bound<'_, PyAny>) -> PyResult<String> {
    let refuse = |what: String| {
        ConfigError::new_err(format!(
            "source {i} ({}) {what}; every source needs one",
            type_name(source)
        ))
    };
    let name = source
        .getattr("name")
        .map_err(|_| refuse("has no str attribute `name`".into()))?;
    let name = name.cast::<PyString>().map_err(|_| {
        refuse(format!(
            "has no str attribute `name` (it is {})",
            type_name(&name)
        ))
    })?;
    match name.to_str() {
        Ok(s) => Ok(s.to_owned()),
        Err(_) => Err(ConfigError::new_err(format!(
            "source {i} ({}): the name {} is not valid UTF-8 (it holds lone surrogates, as \
             os.fsdecode gives for a file name that is not UTF-8); a cache name becomes a \
             directory name, so give the source a UTF-8 name",
            type_name(source),
            name.repr().map(|r| r.to_string()).unwrap_or_default()
        ))),
    }
}

/// Runs Python's signal handlers from inside a wait that released the GIL, and keeps the
/// exception a handler raised (KeyboardInterrupt for Ctrl-C) for the caller to re-raise.
#[derive(Clone, Default)]
pub(crate) struct Signals(Arc<Mutex<Option<PyErr>>>);

impl Signals {
    pub(crate) fn check(&self) -> dataset_rt_core::Result<()> {
        Python::attach(|py| py.check_signals()).map_err(|err| {
            *self.0.lock().unwrap() = Some(err);
            Error::Interrupted("stopped by a signal handler's exception".into())
        })
    }

    fn interrupt_check(&self) -> InterruptCheck {
        let signals = self.clone();
        Arc::new(move || signals.check())
    }

    /// The exception a signal handler raised, if the failure came from one.
    pub(crate) fn take(&self) -> Option<PyErr> {
        self.0.lock().unwrap().take()
    }

    /// A failed write's outcome; the signal handler's exception, when there is one, propagates.
    fn failure(&self, err: Error) -> WriteFailure {
        match self.take() {
            Some(raised) => WriteFailure::Raise(raised),
            None => WriteFailure::from(err),
        }
    }
}

pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

impl Runtime {
    #[allow(clippy::too_many_arguments)]
    fn one_source(
        &self,
        py: Python<'_>,
        source: &Bound<'_, PyAny>,
        index: usize,
        name: &str,
        base: &Path,
        write: &WriterOptions,
        validation: Validation,
        progress: Option<&mut WriteProgress>,
    ) -> PyResult<SourceResult> {
        let signals = Signals::default();
        // A base directory that may not be searched raises, as it does for `open_caches`: the
        // cache may well be there.
        let claimed = py.detach(|| CacheLock::claim(base, name, &|| signals.check()));
        let lock = match claimed.map_err(to_py)? {
            Claim::Write(lock) => lock,
            Claim::Published(dir) => {
                return self.load_existing(py, &dir, validation, Leftovers::Reap)
            }
            Claim::Refused(e) => match signals.take() {
                Some(raised) => return Err(raised),
                None => return Ok((("write_error", Some(e.to_string()), None), Vec::new())),
            },
        };
        let dir = lock.final_dir();
        let iterable = source.get_type().hasattr("__iter__").unwrap_or(false);
        if !iterable {
            return Ok((
                (
                    "missing",
                    Some(format!(
                        "no cache at {} and the source ({}) is not iterable, so it cannot be written",
                        dir.display(),
                        type_name(source)
                    )),
                    None,
                ),
                Vec::new(),
            ));
        }
        let started = Instant::now();
        let mut progress = progress;
        let mut line = progress
            .as_mut()
            .map(|p| p.source(Arc::new(PyStderr::new(py)), index, name));
        let result = self.write_source(py, source, name, lock, write, &mut |s, b| {
            if let Some(l) = line.as_mut() {
                l.update(s, b);
            }
            Ok(())
        });
        if let Some(l) = line {
            let (samples, bytes) = result.as_ref().map(|r| (r.1, r.2)).unwrap_or((0, 0));
            l.finish(
                samples,
                bytes,
                if result.is_ok() { "written" } else { "failed" },
            );
        }
        if let (Some(p), Ok(_)) = (progress, &result) {
            p.source_written(started.elapsed());
        }
        Ok(match result {
            Ok((dir, n, _)) => match self.open_cache(py, &dir, validation) {
                Ok(c) => (("written", None, Some(n)), vec![c]),
                Err(e) if is_malformed(&e) => (
                    (
                        "write_error",
                        Some(format!("written but not loadable: {e}")),
                        None,
                    ),
                    Vec::new(),
                ),
                Err(e) => return Err(to_py(e)),
            },
            Err(WriteFailure::Outcome(msg)) => (("write_error", Some(msg), None), Vec::new()),
            Err(WriteFailure::Raise(err)) => return Err(err),
        })
    }

    /// Loads a published cache or cache set, first removing the temporary directories its dead
    /// writers left when `leftovers` says so.
    ///
    /// Only a cache that fails validation is "malformed". Anything else is not a property of
    /// the cache and raises: a runtime error (`RuntimeStateError`), and an I/O error with its
    /// OSError kind and errno (`PermissionError`, `OSError` for EIO ...), since reporting a cache
    /// that could not be read as malformed would tell the user to delete a good cache.
    pub(crate) fn load_existing(
        &self,
        py: Python<'_>,
        dir: &Path,
        validation: Validation,
        leftovers: Leftovers,
    ) -> PyResult<SourceResult> {
        let owned = dir.to_owned();
        let opened = py.detach(|| {
            self.pool.run(move || {
                if let (Leftovers::Reap, Some(base), Some(name)) =
                    (leftovers, owned.parent(), owned.file_name())
                {
                    reap_dead_leftovers(base, &name.to_string_lossy());
                }
                Opened::open(&owned, validation)
            })
        });
        match opened {
            Ok(c) => {
                let n = c.len();
                Ok((("loaded", None, Some(n)), c.into_caches()))
            }
            Err(e) if is_malformed(&e) => {
                Ok((("malformed", Some(e.to_string()), None), Vec::new()))
            }
            Err(e) => Err(to_py(e)),
        }
    }

    /// The dataset over the caches that loaded, in order; `None` when none did.
    fn dataset(
        &self,
        py: Python<'_>,
        caches: Vec<Arc<Cache>>,
        outcomes: Vec<Outcome>,
        read: ReadOptions,
        verify: VerifyPolicy,
    ) -> PyResult<(Option<Dataset>, Vec<Outcome>)> {
        if caches.is_empty() {
            return Ok((None, outcomes));
        }
        dataset_rt_core::dataset::Dataset::check_caches(&caches, &read).py_err()?;
        let dataset = Dataset::new(py, self.pool.clone(), caches, read, verify)?;
        Ok((Some(dataset), outcomes))
    }

    /// Opens and validates a cache on the pool.
    pub(crate) fn open_cache(
        &self,
        py: Python<'_>,
        dir: &Path,
        validation: Validation,
    ) -> dataset_rt_core::Result<Cache> {
        let dir = dir.to_owned();
        py.detach(|| self.pool.run(move || Cache::open(&dir, validation)))
    }

    /// Writes `source` as the cache `lock` names; `report` gets the samples and raw bytes
    /// committed so far after each batch (an exception it returns stops the write and
    /// propagates).
    pub(crate) fn write_source(
        &self,
        py: Python<'_>,
        source: &Bound<'_, PyAny>,
        name: &str,
        lock: CacheLock,
        write: &WriterOptions,
        report: &mut dyn FnMut(u64, u64) -> PyResult<()>,
    ) -> Result<(PathBuf, u64, u64), WriteFailure> {
        let mut writer = py
            .detach(|| CacheWriter::create(self.pool.clone(), lock, *write))
            .map_err(WriteFailure::from)?;
        // Every wait of the writer runs the signal handlers: Ctrl-C stops the write, and the
        // writer's drop then removes its temporary directory and releases the lock.
        let signals = Signals::default();
        writer.set_interrupt(signals.interrupt_check());
        let iter = source.try_iter().map_err(|e| {
            WriteFailure::from_py(py, e, |d| format!("source {name:?}: iter() failed: {d}"))
        })?;
        let mut pushed = 0u64;
        let mut converter = Converter::default();
        for (index, item) in iter.enumerate() {
            // A source in C (a list, say) runs no bytecode, which is where signals are handled.
            py.check_signals().map_err(WriteFailure::Raise)?;
            let item = item.map_err(|e| {
                WriteFailure::from_py(py, e, |d| {
                    format!("source {name:?}, sample {index}: the source raised {d}")
                })
            })?;
            // Converting and queueing holds the GIL; only handing a full batch over (which may
            // wait for the disk) releases it.
            let staged = converter.push(&item, &mut writer).map_err(|e| match e {
                PushError::Convert(reason) => WriteFailure::from(Error::InvalidSample {
                    source_name: name.to_owned(),
                    sample_index: index as u64,
                    reason,
                }),
                PushError::Writer(e) => signals.failure(e),
            })?;
            pushed += 1;
            if staged.batch_full {
                py.detach(|| writer.hand_off())
                    .map_err(|e| signals.failure(e))?;
                let (s, b) = writer.progress();
                report(s, b).map_err(WriteFailure::Raise)?;
            }
        }
        let published = py
            .detach(|| writer.finish())
            .map_err(|e| signals.failure(e))?;
        debug_assert_eq!(published.samples, pushed);
        Ok((published.dir, published.samples, published.raw_bytes))
    }
}

/// Whether opening a cache failed because the cache itself is bad (its files fail validation).
pub(crate) fn is_malformed(err: &Error) -> bool {
    matches!(err, Error::Malformed { .. } | Error::CorruptRecord { .. })
}

/// Why a source was not written: an outcome to report, or an exception that must propagate
/// (KeyboardInterrupt, SystemExit: the user stops the whole call, not one source).
pub(crate) enum WriteFailure {
    Outcome(String),
    Raise(PyErr),
}

impl From<String> for WriteFailure {
    fn from(msg: String) -> Self {
        WriteFailure::Outcome(msg)
    }
}

impl From<dataset_rt_core::Error> for WriteFailure {
    fn from(err: dataset_rt_core::Error) -> Self {
        WriteFailure::Outcome(err.to_string())
    }
}

impl WriteFailure {
    fn from_py(py: Python<'_>, err: PyErr, describe: impl FnOnce(String) -> String) -> Self {
        if !err.is_instance_of::<pyo3::exceptions::PyException>(py) {
            return WriteFailure::Raise(err);
        }
        WriteFailure::Outcome(describe(describe_py_err(py, &err)))
    }
}

fn describe_py_err(py: Python<'_>, err: &PyErr) -> String {
    let ty = err.get_type(py);
    let ty = ty
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "Exception".into());
    format!("{ty}: {}", err.value(py))
}

/// One metadata value of a primitive Python type; `None` for any other type.
fn meta_value(key: &str, v: &Bound<'_, PyAny>) -> Result<Option<MetaValue>, String> {
    Ok(Some(if let Ok(b) = v.cast::<PyBool>() {
        MetaValue::Bool(b.is_true())
    } else if v.is_instance_of::<PyInt>() {
        MetaValue::Int(
            v.extract::<i64>().map_err(|_| {
                format!("metadata {key:?} = {v} does not fit a 64-bit signed integer")
            })?,
        )
    } else if v.is_instance_of::<PyFloat>() {
        MetaValue::Float(v.extract::<f64>().map_err(|e| e.to_string())?)
    } else if let Ok(s) = v.cast::<PyString>() {
        MetaValue::Str(
            s.to_str()
                .map_err(|e| format!("metadata {key:?}: {e}"))?
                .to_owned(),
        )
    } else {
        return Ok(None);
    }))
}

/// The Python value of a NumPy scalar (`numpy.bool_`, `numpy.int64`, `numpy.float32` ...);
/// `None` for anything else. NumPy is only looked up when the value's type comes from it, so a
/// source without NumPy never imports it.
fn numpy_item<'py>(v: &Bound<'py, PyAny>) -> Option<Bound<'py, PyAny>> {
    let ty = v.get_type();
    if ty.module().ok()?.to_str().ok()? != "numpy" {
        return None;
    }
    let generic = v.py().import("numpy").ok()?.getattr("generic").ok()?;
    if !v.is_instance(&generic).ok()? {
        return None;
    }
    v.call_method0("item").ok()
}

/// One metadata entry as Python gave it: (key, value).
type PyPair<'py> = (Bound<'py, PyAny>, Bound<'py, PyAny>);

/// Fills `items` with the (key, value) pairs of a metadata mapping, in its order: a `dict`
/// directly, any other `collections.abc.Mapping` (a `MappingProxyType`, a custom mapping)
/// through `items()`.
fn metadata_items<'py>(
    metadata: &Bound<'py, PyAny>,
    items: &mut Vec<PyPair<'py>>,
) -> Result<(), String> {
    items.clear();
    if let Ok(dict) = metadata.cast::<PyDict>() {
        items.extend(dict.iter());
        return Ok(());
    }
    let mapping = metadata.cast::<PyMapping>().map_err(|_| {
        format!(
            "metadata must be a mapping (a dict, or any collections.abc.Mapping), got {}",
            type_name(metadata)
        )
    })?;
    let failed = |e: PyErr| format!("metadata ({}).items() failed: {e}", type_name(metadata));
    for pair in mapping.items().map_err(failed)?.iter() {
        items.push(pair.extract::<PyPair<'py>>().map_err(failed)?);
    }
    Ok(())
}

/// Why a `CacheInput` was not queued: it is not a valid sample (the reason), or the writer
/// refused it or has failed.
enum PushError {
    Convert(String),
    Writer(Error),
}

/// Converts one source's `CacheInput`s and queues them on its writer, on the GIL thread.
#[derive(Default)]
struct Converter<'py> {
    /// The key objects of the sample whose key identities the writer remembers: held so that
    /// no other key object can take one of their addresses.
    pinned: Vec<Bound<'py, PyAny>>,
    /// The current sample's metadata entries (reused).
    items: Vec<PyPair<'py>>,
}

impl<'py> Converter<'py> {
    /// Converts `item` (bytes-like data, see [`payload`], and a mapping of primitive metadata)
    /// and queues it; keys go to the writer as identities with borrowed text, never as new
    /// strings.
    fn push(
        &mut self,
        item: &Bound<'py, PyAny>,
        writer: &mut CacheWriter,
    ) -> Result<Staged, PushError> {
        let py = item.py();
        let (data, metadata) = match (
            item.getattr(pyo3::intern!(py, "data")),
            item.getattr(pyo3::intern!(py, "metadata")),
        ) {
            (Ok(d), Ok(m)) => (d, m),
            _ => {
                return Err(PushError::Convert(format!(
                    "expected a CacheInput(data=..., metadata=...), got {}",
                    type_name(item)
                )))
            }
        };
        let data = payload(&data).map_err(PushError::Convert)?;
        metadata_items(&metadata, &mut self.items).map_err(PushError::Convert)?;
        let items = &self.items;
        let mut keys = Vec::with_capacity(items.len());
        let mut values = Vec::with_capacity(items.len());
        for (k, v) in items {
            let (key, value) = meta_entry(k, v).map_err(PushError::Convert)?;
            keys.push(MetaKey {
                id: k.as_ptr() as usize,
                name: key,
            });
            values.push(value);
        }
        let staged = writer
            .push_keyed(data, &keys, values)
            .map_err(PushError::Writer)?;
        if staged.keys_remembered {
            self.pinned = items.iter().map(|(k, _)| k.clone()).collect();
        }
        Ok(staged)
    }
}

/// A `bytes` object's contents, which the writer reads in place, without the GIL, until the
/// record is written: `bytes` never change, and the reference held here keeps them alive. When
/// it is dropped on a pool worker, PyO3 defers the decref to the next time the writer's thread
/// takes the GIL back (after each batch hand-off).
struct HeldBytes {
    _owner: Py<PyBytes>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the pointer is into the immutable buffer of the `bytes` object that `_owner` keeps
// alive; reading it needs no GIL, and `Py` may be dropped on any thread.
unsafe impl Send for HeldBytes {}

impl SharedBytes for HeldBytes {
    fn bytes(&self) -> &[u8] {
        // SAFETY: see `Send` above: `len` bytes at `ptr`, alive and unchanged while `self` is.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

impl HeldBytes {
    fn payload(b: Bound<'_, PyBytes>) -> Payload {
        let bytes = b.as_bytes();
        let (ptr, len) = (bytes.as_ptr(), bytes.len());
        Payload::Shared(Box::new(HeldBytes {
            _owner: b.unbind(),
            ptr,
            len,
        }))
    }
}

/// The payload of a `CacheInput`. `bytes` is not copied here: the writer reads it in place and
/// copies it once, into the shard. `bytearray` (mutable) is copied once now. A `memoryview` is
/// read through `tobytes()`, one copy (the buffer protocol is outside the 3.10 stable ABI).
fn payload(data: &Bound<'_, PyAny>) -> Result<Payload, String> {
    if let Ok(b) = data.cast::<PyBytes>() {
        Ok(HeldBytes::payload(b.clone()))
    } else if let Ok(b) = data.cast::<PyByteArray>() {
        Ok(Payload::Owned(b.to_vec()))
    } else if data.is_instance_of::<PyMemoryView>() {
        data.call_method0("tobytes")
            .and_then(|b| b.cast_into::<PyBytes>().map_err(Into::into))
            .map(HeldBytes::payload)
            .map_err(|e| format!("data memoryview cannot be read: {e}"))
    } else {
        Err(format!(
            "data must be bytes, bytearray or memoryview, got {} (convert arrays with .tobytes())",
            type_name(data)
        ))
    }
}

/// One metadata entry: its key's text, borrowed from the key object, and its value.
fn meta_entry<'a>(
    k: &'a Bound<'_, PyAny>,
    v: &Bound<'_, PyAny>,
) -> Result<(&'a str, MetaValue), String> {
    let key = k
        .cast::<PyString>()
        .map_err(|_| format!("metadata keys must be str, got {} key {k}", type_name(k)))?
        .to_str()
        .map_err(|e| format!("metadata key {k:?} is not valid UTF-8: {e}"))?;
    let value = match meta_value(key, v)? {
        Some(value) => value,
        // A NumPy scalar stands for its Python value, which `item()` gives.
        None => match numpy_item(v) {
            Some(item) => meta_value(key, &item)?.ok_or_else(|| {
                format!(
                    "metadata {key:?} is a numpy.{} whose value is a {}; supported: bool, int, \
                     float, str (and NumPy scalars of those)",
                    type_name(v),
                    type_name(&item)
                )
            })?,
            None => {
                return Err(format!(
                    "metadata {key:?} has type {}; supported: bool, int, float, str (and NumPy \
                     scalars of those)",
                    type_name(v)
                ))
            }
        },
    };
    Ok((key, value))
}

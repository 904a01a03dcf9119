//! Cache sets in the bindings: `from_cache_sources` for a source that is a
//! `dataset_rt.CacheSet` (load the published set, or build it: the parts missing from its staging
//! directory are written here or by worker processes, then the set is published), the one
//! progress line of a set, and what worker processes and Ray tasks call: `write_part` and
//! `SetBuilder`. The rules (names, the staging directory, which parts are published, the set
//! manifest and its publication) are the core's `cache_set`.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::cache_set::{
    validate_part_count, validate_set_name, PartOutcome, PartResult, SetBuild, SetConclusion,
    SetLedger, SetStart,
};
use dataset_rt_core::os;
use dataset_rt_core::progress::{SourceProgress, WriteProgress};
use dataset_rt_core::writer::{CacheLock, Claim, WriterOptions};
use dataset_rt_core::Error;
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::config::WriterFields;
use crate::errors::{to_py, ConfigError, IntoPyResult};
use crate::progress::PyStderr;
use crate::runtime::{
    is_malformed, type_name, Leftovers, Outcome, Runtime, Signals, SourceResult, WriteFailure,
};

/// The Python module that defines `CacheSet` and runs the worker processes.
const SETS_MODULE: &str = "dataset_rt._sets";

/// How often a part's writer reports its counts to whoever draws the set's line.
const REPORT_EVERY: Duration = Duration::from_millis(100);

/// A source of `from_cache_sources` that is a `CacheSet`: its name and its parts, in order.
pub struct SetSource<'py> {
    pub name: String,
    pub parts: Vec<Bound<'py, PyAny>>,
}

impl<'py> SetSource<'py> {
    /// For each source, its set when it is a `CacheSet` (`names` are the sources' names,
    /// already checked as cache names); a set's name and part count are checked here.
    pub fn find(
        sources: &[Bound<'py, PyAny>],
        names: &[String],
    ) -> PyResult<Vec<Option<SetSource<'py>>>> {
        let Some(first) = sources.first() else {
            return Ok(Vec::new());
        };
        let set_type = first.py().import(SETS_MODULE)?.getattr("CacheSet")?;
        sources
            .iter()
            .zip(names)
            .map(|(source, name)| {
                if !source.is_instance(&set_type)? {
                    return Ok(None);
                }
                let parts: Vec<Bound<'py, PyAny>> = source
                    .getattr("parts")?
                    .try_iter()?
                    .collect::<PyResult<_>>()?;
                validate_set_name(name)
                    .and_then(|_| validate_part_count(name, parts.len()))
                    .map_err(|e| ConfigError::new_err(e.to_string()))?;
                Ok(Some(SetSource {
                    name: name.clone(),
                    parts,
                }))
            })
            .collect()
    }
}

/// The settings a set is built with.
pub struct SetSettings<'a, 'py> {
    pub write: &'a WriterOptions,
    /// The `WriterConfig` itself, handed to worker processes.
    pub writer: &'a Bound<'py, PyAny>,
    pub processes: usize,
    pub validation: Validation,
}

/// A set's outcome: the parts' outcomes (only when the set was built by this call), the set's
/// own (kind, message, samples), and the caches loaded (its parts, once published).
type SetResult = (
    Vec<Outcome>,
    (&'static str, Option<String>, Option<u64>),
    Vec<Cache>,
);

/// The bindings' form of a build's end: each part's outcome, the set's own (kind, message,
/// samples), and the caches loaded (its parts, once published).
fn outcomes_of(conclusion: SetConclusion) -> SetResult {
    let parts = conclusion
        .parts
        .into_iter()
        .map(|PartOutcome { name, path, result }| match result {
            PartResult::Loaded(n) => ("loaded", name, path, None, Some(n)),
            PartResult::Written(n) => ("written", name, path, None, Some(n)),
            PartResult::Failed(msg) => ("write_error", name, path, Some(msg), None),
            PartResult::Malformed(msg) => ("malformed", name, path, Some(msg), None),
        })
        .collect();
    match conclusion.set {
        Ok(set) => (parts, ("written", None, Some(set.len())), set.parts),
        Err(msg) => (parts, ("write_error", Some(msg), None), Vec::new()),
    }
}

/// Reads the staging directory of a build, with the GIL released.
fn ledger_of(py: Python<'_>, build: &SetBuild, validation: Validation) -> PyResult<SetLedger> {
    py.detach(|| SetLedger::new(build, validation))
        .map_err(to_py)
}

/// Ends a build (publishing the set when every part is), with the GIL released.
fn conclude(
    py: Python<'_>,
    ledger: SetLedger,
    build: SetBuild,
    validation: Validation,
) -> SetResult {
    outcomes_of(py.detach(|| ledger.conclude(build, validation)))
}

impl Runtime {
    /// Loads the published set `set.name` under `base`, or builds it: takes the set's lock,
    /// writes the parts missing from its staging directory (in this process, or in worker
    /// processes when `processes` > 1), and publishes the set once every part is published.
    /// A failed part is reported in its own outcome, the others go on; the set is then not
    /// published and the published parts stay for the next call.
    pub(crate) fn one_set(
        &self,
        py: Python<'_>,
        set: &SetSource<'_>,
        index: usize,
        base: &Path,
        settings: &SetSettings<'_, '_>,
        progress: Option<&mut WriteProgress>,
    ) -> PyResult<SetResult> {
        let loaded = |result: SourceResult| (Vec::new(), result.0, result.1);
        let published = base.join(&set.name);
        if published.exists() {
            let result =
                self.load_existing(py, &published, settings.validation, Leftovers::Reap)?;
            return Ok(loaded(result));
        }
        if settings.processes > 1 {
            // In a worker that spawn started, running a script without the `__main__` guard,
            // the build below would wait forever for the lock its parent holds.
            py.import(SETS_MODULE)?
                .call_method0("refuse_in_bootstrap")?;
        }
        let signals = Signals::default();
        let (name, count) = (set.name.as_str(), set.parts.len());
        let begun = py.detach(|| SetBuild::begin(base, name, count, &|| signals.check()));
        let build = match begun {
            Ok(SetStart::Building(build)) => build,
            Ok(SetStart::Published(dir)) => {
                let result = self.load_existing(py, &dir, settings.validation, Leftovers::Reap)?;
                return Ok(loaded(result));
            }
            Err(e) => {
                return match signals.take() {
                    Some(raised) => Err(raised),
                    None => Ok((
                        Vec::new(),
                        ("write_error", Some(e.to_string()), None),
                        vec![],
                    )),
                }
            }
        };
        let validation = settings.validation;
        let mut ledger = ledger_of(py, &build, validation)?;
        let missing = ledger.missing();
        let line = match progress {
            Some(p) => Some(Py::new(
                py,
                SetProgress::new_line(p.set(
                    Arc::new(PyStderr::new(py)),
                    index,
                    &set.name,
                    ledger.len(),
                    ledger.published(),
                )),
            )?),
            None => None,
        };
        let line = line.as_ref().map(|l| l.get());
        if !missing.is_empty() {
            let workers = settings.processes.min(missing.len());
            let written = if workers <= 1 {
                self.write_parts_here(py, set, &build, &missing, settings.write, line)
            } else {
                self.write_parts_in_processes(py, set, &build, &missing, settings, workers, line)
            };
            match written {
                Ok(written) => written
                    .into_iter()
                    .for_each(|(i, part)| ledger.record(i, part)),
                Err(raised) => {
                    if let Some(l) = line {
                        l.finish_line("interrupted");
                    }
                    return Err(raised);
                }
            }
        }
        let (outcomes, set_outcome, caches) = conclude(py, ledger, build, validation);
        if let Some(l) = line {
            let published = set_outcome.0 == "written";
            l.finish_line(if published { "written" } else { "failed" });
        }
        Ok((outcomes, set_outcome, caches))
    }

    /// Writes the `missing` parts one after the other in this process, on this runtime's
    /// workers. A signal handler's exception (Ctrl-C) stops at once and propagates.
    fn write_parts_here(
        &self,
        py: Python<'_>,
        set: &SetSource<'_>,
        build: &SetBuild,
        missing: &[usize],
        write: &WriterOptions,
        line: Option<&SetProgress>,
    ) -> PyResult<Vec<(usize, PartResult)>> {
        let mut done = Vec::with_capacity(missing.len());
        let mut totals = (0u64, 0u64);
        for &i in missing {
            let name = build.part_name(i);
            let before = totals;
            let parts_done = done.len();
            let mut report = |s: u64, b: u64| {
                if let Some(l) = line {
                    l.update_line(before.0 + s, before.1 + b, parts_done);
                }
                Ok(())
            };
            let (kind, message, samples, bytes) = self.write_one_part(
                py,
                &set.parts[i],
                build.staging(),
                &name,
                write,
                &mut report,
            )?;
            totals = (totals.0 + samples, totals.1 + bytes);
            done.push((i, PartResult::from_report(kind, message, samples)));
            if let Some(l) = line {
                l.update_line(totals.0, totals.1, done.len());
            }
        }
        Ok(done)
    }

    /// Writes the `missing` parts in `workers` worker processes (`dataset_rt._sets`), which
    /// report their counts to this process's line and return each part's result.
    #[allow(clippy::too_many_arguments)]
    fn write_parts_in_processes(
        &self,
        py: Python<'_>,
        set: &SetSource<'_>,
        build: &SetBuild,
        missing: &[usize],
        settings: &SetSettings<'_, '_>,
        workers: usize,
        line: Option<&SetProgress>,
    ) -> PyResult<Vec<(usize, PartResult)>> {
        let names: Vec<String> = missing.iter().map(|&i| build.part_name(i)).collect();
        let threads = (self.pool.num_workers() / workers).max(1);
        let report = match line {
            Some(l) => {
                let progress = Py::new(py, l.share())?;
                progress.into_any().into_bound(py)
            }
            None => py.None().into_bound(py),
        };
        let results = py.import(SETS_MODULE)?.call_method1(
            "write_parts",
            (
                PyList::new(py, &set.parts)?,
                missing.to_vec(),
                names,
                build.staging().to_owned(),
                settings.writer,
                workers,
                threads,
                report,
            ),
        )?;
        let results: Vec<(usize, String, Option<String>, u64, u64)> = results.extract()?;
        Ok(results
            .into_iter()
            .map(|(i, kind, message, samples, _)| {
                (i, PartResult::from_report(&kind, message, samples))
            })
            .collect())
    }

    /// Writes one part `name` of a set into `staging` from `source`, unless it is published
    /// already: (kind, message, samples, raw bytes), kind one of "written", "loaded" or
    /// "write_error". Exceptions that are not about the part (Ctrl-C) propagate.
    fn write_one_part(
        &self,
        py: Python<'_>,
        source: &Bound<'_, PyAny>,
        staging: &Path,
        name: &str,
        write: &WriterOptions,
        report: &mut dyn FnMut(u64, u64) -> PyResult<()>,
    ) -> PyResult<(&'static str, Option<String>, u64, u64)> {
        let signals = Signals::default();
        let claimed = py.detach(|| CacheLock::claim(staging, name, &|| signals.check()));
        let lock = match claimed {
            Ok(Claim::Write(lock)) => lock,
            // Another writer published it meanwhile.
            Ok(Claim::Published(dir)) => {
                return Ok(match self.open_cache(py, &dir, Validation::Structure) {
                    Ok(c) => ("loaded", None, c.len(), c.manifest.raw_payload_bytes),
                    Err(e) if is_malformed(&e) => ("write_error", Some(e.to_string()), 0, 0),
                    Err(e) => return Err(to_py(e)),
                })
            }
            Ok(Claim::Refused(e)) | Err(e) => {
                return match signals.take() {
                    Some(raised) => Err(raised),
                    None => Ok(("write_error", Some(e.to_string()), 0, 0)),
                }
            }
        };
        if !source.get_type().hasattr("__iter__").unwrap_or(false) {
            return Ok((
                "write_error",
                Some(format!(
                    "part {name:?} ({}) is not iterable, so it cannot be written",
                    type_name(source)
                )),
                0,
                0,
            ));
        }
        match self.write_source(py, source, name, lock, write, report) {
            Ok((_, samples, bytes)) => Ok(("written", None, samples, bytes)),
            Err(WriteFailure::Outcome(msg)) => Ok(("write_error", Some(msg), 0, 0)),
            Err(WriteFailure::Raise(err)) => Err(err),
        }
    }
}

/// The one progress line of a cache set, shared by whoever reports its counts (this process's
/// writer, or the loop that reads the worker processes' and Ray tasks' reports).
#[pyclass(module = "dataset_rt._native", frozen)]
pub struct SetProgress {
    line: Arc<Mutex<Option<SourceProgress>>>,
}

impl SetProgress {
    fn new_line(line: SourceProgress) -> Self {
        SetProgress {
            line: Arc::new(Mutex::new(Some(line))),
        }
    }

    fn share(&self) -> SetProgress {
        SetProgress {
            line: Arc::clone(&self.line),
        }
    }

    fn update_line(&self, samples: u64, bytes: u64, parts_done: usize) {
        if let Some(line) = self.line.lock().unwrap().as_mut() {
            line.update_parts(samples, bytes, parts_done);
        }
    }

    fn finish_line(&self, outcome: &str) {
        if let Some(line) = self.line.lock().unwrap().take() {
            let (samples, bytes) = line.last_counts();
            line.finish(samples, bytes, outcome);
        }
    }
}

#[pymethods]
impl SetProgress {
    /// A line of its own for set `name` of `parts` parts, `published` of them before this call
    /// (for a build that does not run inside `from_cache_sources`: Ray's).
    #[new]
    fn new(py: Python<'_>, name: &str, parts: usize, published: usize) -> Self {
        let mut progress = WriteProgress::new(1);
        SetProgress::new_line(progress.set(Arc::new(PyStderr::new(py)), 0, name, parts, published))
    }

    /// Samples and raw bytes written so far by all the set's writers in this call, and the
    /// parts they finished (the line adds those published before the call).
    fn update(&self, samples: u64, bytes: u64, parts_done: usize) {
        self.update_line(samples, bytes, parts_done);
    }

    /// Draws the finished line with `outcome` ("written", "failed", ...).
    fn finish(&self, outcome: &str) {
        self.finish_line(outcome);
    }
}

/// Writes part `name` of a set from `source` into `staging` (the set's staging directory) on
/// `runtime`: what a worker process or a Ray task runs. Returns (kind, message, samples, raw
/// bytes); `report(samples, raw_bytes)` is called at most every 100 ms while it writes.
#[pyfunction]
#[pyo3(signature = (runtime, source, staging, name, writer, report=None))]
pub fn write_part(
    py: Python<'_>,
    runtime: &Bound<'_, Runtime>,
    source: &Bound<'_, PyAny>,
    staging: PathBuf,
    name: String,
    writer: WriterFields<'_>,
    report: Option<Bound<'_, PyAny>>,
) -> PyResult<(&'static str, Option<String>, u64, u64)> {
    let runtime = runtime.get();
    runtime.pool.check_usable().py_err()?;
    let (write, _) = writer.options()?;
    dataset_rt_core::writer::validate_name(&name)
        .map_err(|e| ConfigError::new_err(e.to_string()))?;
    let mut last: Option<Instant> = None;
    let mut send = |samples: u64, bytes: u64| -> PyResult<()> {
        let Some(report) = &report else {
            return Ok(());
        };
        if last.is_some_and(|t| t.elapsed() < REPORT_EVERY) {
            return Ok(());
        }
        last = Some(Instant::now());
        report.call1((samples, bytes)).map(drop)
    };
    runtime.write_one_part(py, source, &staging, &name, &write, &mut send)
}

/// Makes the kernel SIGKILL this worker process when its parent exits; returns whether the
/// parent is still `owner_pid` (it may have died before the call).
#[pyfunction]
pub fn bind_to_parent(owner_pid: u64) -> PyResult<bool> {
    os::kill_me_when_parent_dies()
        .map_err(|e| to_py(Error::io("prctl(PR_SET_PDEATHSIG)", PathBuf::new(), e)))?;
    Ok(os::parent_pid() == owner_pid)
}

/// A build of one cache set driven from Python (Ray's `write_cache_set`): holds the set's lock
/// from creation until `finish` or `close`. Its parts are written by anyone with `write_part`
/// into `staging` under `part_names`; `finish` takes their reports and publishes the set when
/// every part is published, exactly as `from_cache_sources` does.
#[pyclass(module = "dataset_rt._native", frozen)]
pub struct SetBuilder {
    build: Mutex<Option<(SetBuild, Option<SetLedger>)>>,
    /// `base/NAME` when the set was found published: nothing is held then.
    published: Option<PathBuf>,
    final_dir: PathBuf,
    staging: PathBuf,
    part_names: Vec<String>,
}

fn build_over() -> PyErr {
    ConfigError::new_err(
        "this cache set build is over (finished, closed, or the set was found published)",
    )
}

#[pymethods]
impl SetBuilder {
    /// Takes the lock of set `name` under `base` for a set of `parts` parts (waiting while
    /// another build holds it; Ctrl-C stops the wait) and creates the staging directory,
    /// unless the set is published already.
    #[new]
    fn new(py: Python<'_>, base: PathBuf, name: String, parts: usize) -> PyResult<Self> {
        validate_set_name(&name)
            .and_then(|_| validate_part_count(&name, parts))
            .map_err(|e| ConfigError::new_err(e.to_string()))?;
        dataset_rt_core::writer::check_base_dir(&base).py_err()?;
        let signals = Signals::default();
        let begun = py.detach(|| SetBuild::begin(&base, &name, parts, &|| signals.check()));
        let begun = match begun {
            Ok(b) => b,
            Err(e) => return Err(signals.take().unwrap_or_else(|| to_py(e))),
        };
        let (build, published) = match begun {
            SetStart::Published(dir) => (None, Some(dir)),
            SetStart::Building(build) => (Some((build, None)), None),
        };
        Ok(SetBuilder {
            build: Mutex::new(build),
            published,
            final_dir: base.join(&name),
            staging: dataset_rt_core::cache_set::staging_dir(&base, &name),
            part_names: (0..parts)
                .map(|i| dataset_rt_core::cache_set::part_name(&name, i))
                .collect(),
        })
    }

    /// `base/NAME` when the set was published before this build began (it holds nothing then).
    #[getter]
    fn published(&self) -> Option<String> {
        self.published
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned())
    }

    #[getter]
    fn staging(&self) -> String {
        self.staging.to_string_lossy().into_owned()
    }

    #[getter]
    fn part_names(&self) -> Vec<String> {
        self.part_names.clone()
    }

    /// Looks at the staging directory: the parts still to be written, in order (the published
    /// ones are kept, malformed ones are reported by `finish`).
    fn missing_parts(&self, py: Python<'_>) -> PyResult<Vec<usize>> {
        let mut guard = self.build.lock().unwrap();
        let (build, ledger) = guard.as_mut().ok_or_else(build_over)?;
        let found = ledger_of(py, build, Validation::Structure)?;
        let missing = found.missing();
        *ledger = Some(found);
        Ok(missing)
    }

    /// The parts published so far (after `missing_parts`).
    fn published_parts(&self) -> PyResult<usize> {
        let guard = self.build.lock().unwrap();
        let (_, ledger) = guard.as_ref().ok_or_else(build_over)?;
        Ok(ledger.as_ref().map_or(0, SetLedger::published))
    }

    /// Takes the reports `(index, kind, message, samples)` of the parts written (kind as
    /// `write_part` returns it), publishes the set when every part is published, and releases
    /// the lock. Returns the outcomes `(kind, name, path, message, samples)`: one per part, then
    /// the set's.
    fn finish(
        &self,
        py: Python<'_>,
        reports: Vec<(usize, String, Option<String>, u64)>,
    ) -> PyResult<Vec<Outcome>> {
        let (build, ledger) = self.build.lock().unwrap().take().ok_or_else(build_over)?;
        let mut ledger = match ledger {
            Some(l) => l,
            None => ledger_of(py, &build, Validation::Structure)?,
        };
        for (index, kind, message, samples) in reports {
            ledger.record(index, PartResult::from_report(&kind, message, samples));
        }
        let set_name = build.name().to_owned();
        let (mut outcomes, set_outcome, _) = conclude(py, ledger, build, Validation::Structure);
        outcomes.push((
            set_outcome.0,
            set_name,
            self.final_dir.clone(),
            set_outcome.1,
            set_outcome.2,
        ));
        Ok(outcomes)
    }

    /// Releases the lock without publishing; the published parts stay for the next build.
    fn close(&self) {
        self.build.lock().unwrap().take();
    }

    fn __repr__(&self) -> String {
        let state = match (&self.published, self.build.lock().unwrap().is_some()) {
            (Some(_), _) => "published",
            (None, true) => "building",
            (None, false) => "over",
        };
        format!(
            "SetBuilder({}, {} parts, {state})",
            self.final_dir.display(),
            self.part_names.len()
        )
    }
}

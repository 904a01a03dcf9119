//! `Dataset`, its iterator and `CachedSample`. Uncompressed payloads reach Python as slices of a
//! Python-owned `mmap` of the shard: zero-copy under the abi3 limited API, and the slice keeps
//! the map alive for as long as the user holds it.

use std::collections::VecDeque;
use std::sync::{Arc, OnceLock};

use arrow_array::ffi_stream::FFI_ArrowArrayStream;
use arrow_array::RecordBatchIterator;
use dataset_rt_core::cache::Cache;
use dataset_rt_core::dataset::{
    self as core, BatchLayout, EpochReader, Fetched, Payload, ReadOptions, State, WeightTable,
};
use dataset_rt_core::metadata::MetaRef;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::sampler::{self, EpochParams};
use dataset_rt_core::samples;
use dataset_rt_core::session::{PassProgress, Session, StartedPass};
use dataset_rt_core::verify::VerifyPolicy;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyCapsule, PyDict, PyList, PyString, PyTuple};

use crate::errors::IntoPyResult;

/// Python objects made once per cache: shard views (opened on first use) and metadata keys.
struct PyCache {
    shards: Vec<OnceLock<Py<PyAny>>>,
    keys: Vec<Py<PyString>>,
}

/// The Python side of a dataset, with the core dataset it belongs to: what a sample needs to
/// build its metadata later, behind one reference count.
struct PySide {
    caches: Vec<PyCache>,
    dataset: Arc<core::Dataset>,
}

impl PySide {
    /// The zero-copy view of shard `shard`: the core's own map of the file it validated and
    /// verifies records against (a path opened again could name another file by now), made on
    /// first use, after a check that the file was not truncated since (`sample`, when a record
    /// is being read, is named in that error).
    fn shard_view<'py>(
        &self,
        py: Python<'py>,
        cache: &Arc<Cache>,
        c: usize,
        shard: u32,
        sample: Option<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let cell = &self.caches[c].shards[shard as usize];
        if let Some(v) = cell.get() {
            return Ok(v.bind(py).clone());
        }
        let record = sample.map(|s| (s, cache.entry(s).offset));
        cache.check_shard_size(shard, record).py_err()?;
        let view = crate::shard_map::cache_view(py, cache, shard)?;
        let _ = cell.set(view.clone().unbind());
        Ok(cell.get().expect("set above").bind(py).clone())
    }
}

/// `view[start:end]`, through `PySequence_GetSlice`, which releases the slice and the bounds it
/// makes. Not pyo3's `PySlice::new`: it hands `PySlice_New` (which takes references of its own)
/// new integers that it never releases, which leaked two objects per sample, 4 MiB per pass of
/// 65,536 samples.
pub(crate) fn subview<'py>(
    view: &Bound<'py, PyAny>,
    start: u64,
    end: u64,
) -> PyResult<Bound<'py, PyAny>> {
    let (Ok(start), Ok(end)) = (isize::try_from(start), isize::try_from(end)) else {
        return Err(pyo3::exceptions::PyOverflowError::new_err(format!(
            "a view of bytes {start}..{end} does not fit in an index"
        )));
    };
    // SAFETY: `view` is a live object and the GIL is held; the call returns a new reference,
    // or NULL with an exception set, which `from_owned_ptr_or_err` turns into the error.
    unsafe {
        Bound::from_owned_ptr_or_err(
            view.py(),
            pyo3::ffi::PySequence_GetSlice(view.as_ptr(), start, end),
        )
    }
}

impl PySide {
    /// A fetched sample's payload: a zero-copy slice of its shard's view, or bytes when it was
    /// decompressed.
    fn payload<'py>(
        &self,
        py: Python<'py>,
        dataset: &core::Dataset,
        fetched: &Fetched,
    ) -> PyResult<Bound<'py, PyAny>> {
        Ok(match fetched.payload {
            Payload::Mapped { shard, offset, len } => {
                let c = fetched.cache as usize;
                let end =
                    (dataset.caches[c].payload_end(shard, offset, len, fetched.row)).py_err()?;
                let view = self.shard_view(py, &dataset.caches[c], c, shard, Some(fetched.row))?;
                subview(&view, offset, end)?
            }
            Payload::Owned(ref bytes) => PyBytes::new(py, bytes).into_any(),
        })
    }
}

#[pyclass(module = "dataset_rt._native", frozen)]
pub struct Dataset {
    session: Session,
    py_side: Arc<PySide>,
}

impl Dataset {
    pub fn new(
        py: Python<'_>,
        pool: Arc<Pool>,
        caches: Vec<Arc<Cache>>,
        opts: ReadOptions,
        verify: VerifyPolicy,
    ) -> PyResult<Self> {
        let inner = Arc::new(core::Dataset::new(caches).with_verify(verify));
        let py_side = PySide {
            caches: inner
                .caches
                .iter()
                .map(|c| PyCache {
                    shards: (0..c.num_shards()).map(|_| OnceLock::new()).collect(),
                    // The manifest's schema: the table itself is read at its first use.
                    keys: c
                        .manifest
                        .metadata_schema
                        .iter()
                        .map(|f| PyString::intern(py, &f.name).unbind())
                        .collect(),
                })
                .collect(),
            dataset: inner.clone(),
        };
        Ok(Dataset {
            session: Session::new(pool, inner, opts),
            py_side: Arc::new(py_side),
        })
    }

    fn inner(&self) -> &Arc<core::Dataset> {
        self.session.dataset()
    }

    /// Starts the next pass (see `Session::start_pass`), waiting for its order without the GIL.
    fn start_pass(&self, py: Python<'_>, whole_batches_of: u64) -> PyResult<StartedPass> {
        py.detach(|| self.session.start_pass(whole_batches_of))
            .py_err()
    }
}

#[pymethods]
impl Dataset {
    /// This rank's samples per epoch.
    fn __len__(&self) -> usize {
        self.inner().rank_len(self.session.options()) as usize
    }

    /// Samples in all loaded caches.
    #[getter]
    fn num_samples(&self) -> u64 {
        self.inner().len()
    }

    #[getter]
    fn cache_names(&self) -> Vec<String> {
        self.inner()
            .caches
            .iter()
            .map(|c| c.name().to_owned())
            .collect()
    }

    #[getter]
    fn cache_dirs(&self) -> Vec<std::path::PathBuf> {
        self.inner().caches.iter().map(|c| c.dir.clone()).collect()
    }

    #[getter]
    fn rank(&self) -> u64 {
        self.session.options().rank
    }

    #[getter]
    fn world_size(&self) -> u64 {
        self.session.options().world_size
    }

    #[getter]
    fn fingerprint(&self) -> String {
        self.inner().fingerprint().to_owned()
    }

    /// Samples whose records passed their checksum under `verify="once"`, read here or by a
    /// loader's producer; `None` under the other policies.
    #[getter]
    fn verified_samples(&self) -> Option<u64> {
        self.inner().verified_count()
    }

    /// Starts the next pass, sample by sample.
    fn __iter__(&self, py: Python<'_>) -> PyResult<DatasetIterator> {
        let pass = self.start_pass(py, 1)?;
        Ok(DatasetIterator {
            // The iterator waits for a chunk without the GIL: reading its samples beside the
            // workers then costs less than sleeping until they are done.
            reader: pass.reader.read_ahead_when_mapped().consumer_helps(),
            dataset: self.inner().clone(),
            py_side: self.py_side.clone(),
            progress: pass.progress,
            built: VecDeque::new(),
            build_error: None,
            failed: false,
        })
    }

    /// Starts the next pass, `batch_size` samples at a time; with `drop_last` the pass ends at
    /// its last whole batch.
    #[pyo3(signature = (batch_size, *, drop_last=false))]
    fn iter_batches(
        &self,
        py: Python<'_>,
        batch_size: i64,
        drop_last: bool,
    ) -> PyResult<BatchIterator> {
        let batch_size = usize::try_from(batch_size)
            .ok()
            .filter(|&b| b >= 1)
            .ok_or_else(|| {
                crate::errors::ConfigError::new_err(format!(
                    "iter_batches: invalid batch_size {batch_size}: must be at least 1"
                ))
            })?;
        let pass = self.start_pass(py, if drop_last { batch_size as u64 } else { 1 })?;
        Ok(BatchIterator {
            reader: pass
                .reader
                .read_ahead_at_least(2u64.saturating_mul(batch_size as u64))
                .consumer_helps(),
            dataset: self.inner().clone(),
            py_side: self.py_side.clone(),
            progress: pass.progress,
            pool: self.session.pool().clone(),
            weights: pass.weights,
            batch_size,
            failed: false,
        })
    }

    /// Fixes the epoch of the next pass (and drops a loaded state's position).
    /// Epochs are 0 to `LAST_EPOCH` (2**64 - 2): a u64, so that 2**63 and above are epochs.
    fn set_epoch(&self, epoch: u64) -> PyResult<()> {
        self.session.set_epoch(epoch).py_err()
    }

    /// The iterator state as JSON text.
    fn state_json(&self) -> PyResult<String> {
        Ok(self.session.state().py_err()?.to_json())
    }

    /// The samples-metadata table as an Arrow C stream capsule (`arrow_array_stream`): Polars
    /// imports the record batches without a copy of the caches' metadata columns.
    fn samples_metadata_stream<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        let (inner, _, weights) = self.session.reading();
        let (schema, batches) = py
            .detach(|| {
                self.session
                    .pool()
                    .run(move || samples::table(&inner, &weights))
            })
            .py_err()?;
        let reader = RecordBatchIterator::new(batches.into_iter().map(Ok), schema);
        let stream = FFI_ArrowArrayStream::new(Box::new(reader));
        // The consumer moves the stream out and marks it released; a capsule never consumed
        // releases it when dropped (FFI_ArrowArrayStream's Drop).
        PyCapsule::new(py, stream, Some(c"arrow_array_stream".to_owned()))
    }

    /// Validates an edited table (Arrow IPC stream) and applies its weights, or changes nothing.
    fn set_samples_metadata_ipc(&self, py: Python<'_>, ipc: Vec<u8>) -> PyResult<()> {
        let inner = self.inner().clone();
        let table = py
            .detach(|| {
                self.session
                    .pool()
                    .run(move || samples::import(&inner, &ipc))
            })
            .py_err()?;
        self.session.set_weights(table);
        Ok(())
    }

    /// Makes the next pass resume exactly where the state was taken.
    fn load_state_json(&self, text: &str) -> PyResult<()> {
        let state = State::from_json(text).py_err()?;
        self.session.load_state(&state).py_err()
    }
}

/// A sample built and not handed out yet, with the (cache, row) of its record when it is a view
/// of its shard.
type Built = (Py<CachedSample>, Option<(u32, u64)>);

/// A pass read sample by sample. The samples of a chunk the pool has read are made into Python
/// objects in one go, with the GIL taken once; `__next__` then hands them out one at a time,
/// and only a sample handed out counts in `state_dict()`.
#[pyclass(module = "dataset_rt._native")]
pub struct DatasetIterator {
    reader: EpochReader,
    dataset: Arc<core::Dataset>,
    py_side: Arc<PySide>,
    progress: Arc<PassProgress>,
    /// The samples built and not handed out yet, in order, with the (cache, row) of those that
    /// are views of their shard (checked again as they are handed out).
    built: VecDeque<Built>,
    /// The error that stopped building the current chunk: raised after the samples before it.
    build_error: Option<PyErr>,
    /// Set once an error was raised: the pass ends there, as a reader error ends it.
    failed: bool,
}

impl DatasetIterator {
    /// Takes the next chunk of read samples from the reader (waiting for the pool without the
    /// GIL when none is read yet) and builds their objects; builds nothing once the pass is over.
    fn build_chunk(&mut self, py: Python<'_>) -> PyResult<()> {
        let reader = &mut self.reader;
        let next = if reader.must_wait() {
            py.detach(|| reader.next_chunk())
        } else {
            reader.next_chunk()
        };
        let Some(fetched) = next else {
            return Ok(());
        };
        for f in fetched.py_err()? {
            let mapped = matches!(f.payload, Payload::Mapped { .. }).then_some((f.cache, f.row));
            let made = self
                .py_side
                .payload(py, &self.dataset, &f)
                .and_then(|data| {
                    Py::new(
                        py,
                        CachedSample {
                            data: data.unbind(),
                            metadata: OnceLock::new(),
                            origin: Some(Origin {
                                py_side: self.py_side.clone(),
                                cache: f.cache as usize,
                                row: f.row,
                            }),
                        },
                    )
                });
            match made {
                Ok(sample) => self.built.push_back((sample, mapped)),
                Err(e) => {
                    self.build_error = Some(e);
                    break;
                }
            }
        }
        Ok(())
    }
}

#[pymethods]
impl DatasetIterator {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __len__(&self) -> usize {
        self.reader.remaining() as usize
    }

    #[getter]
    fn epoch(&self) -> u64 {
        self.reader.epoch
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<Py<CachedSample>>> {
        // A chunk's error waits until the samples built before it are handed out.
        if self.built.is_empty() && self.build_error.is_none() && !self.failed {
            self.build_chunk(py).inspect_err(|_| self.failed = true)?;
        }
        if self.built.is_empty() {
            if let Some(e) = self.build_error.take() {
                self.failed = true;
                return Err(e);
            }
            self.progress.finish();
            return Ok(None);
        }
        let mapped = self.built.front().expect("checked above").1;
        if let Some((cache, row)) = mapped {
            if let Err(e) = self.reader.check_mapped(cache, row) {
                // Its shard was truncated since it was read: the pass ends at this sample.
                self.failed = true;
                self.built.clear();
                return Err(e).py_err();
            }
        }
        if let Err(e) = self.reader.hand_out(1) {
            // A forked child: nothing is handed out, the parent's pass is left as it was.
            self.failed = true;
            return Err(e).py_err();
        }
        let (sample, _) = self.built.pop_front().expect("checked above");
        self.progress.handed_out(&self.reader);
        Ok(Some(sample))
    }
}

/// A pass read a batch at a time: each batch is gathered in one call, waiting for the pool
/// without the GIL, then made into Python objects with the GIL taken once.
#[pyclass(module = "dataset_rt._native")]
pub struct BatchIterator {
    reader: EpochReader,
    dataset: Arc<core::Dataset>,
    py_side: Arc<PySide>,
    progress: Arc<PassProgress>,
    pool: Arc<Pool>,
    /// The weights of this pass: its batches' rows report them.
    weights: WeightTable,
    batch_size: usize,
    /// Set by an error: the pass ends there, so `state_dict()` stays at the failed batch's start.
    failed: bool,
}

#[pymethods]
impl BatchIterator {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    /// Samples this pass has still to yield.
    fn __len__(&self) -> usize {
        self.reader.remaining() as usize
    }

    #[getter]
    fn epoch(&self) -> u64 {
        self.reader.epoch
    }

    fn __next__(&mut self, py: Python<'_>) -> PyResult<Option<Batch>> {
        if self.failed {
            return Ok(None);
        }
        let reader = &mut self.reader;
        let batch_size = self.batch_size;
        let Some(fetched) = py.detach(|| reader.next_batch(batch_size)) else {
            self.progress.finish();
            return Ok(None);
        };
        let made = fetched
            .py_err()
            .and_then(|fetched| BatchParts::gather(py, &self.py_side, &self.dataset, &fetched));
        let parts = match made {
            Ok(parts) => parts,
            Err(e) => {
                self.failed = true;
                return Err(e);
            }
        };
        self.progress.handed_out(&self.reader);
        Ok(Some(Batch {
            parts,
            data: OnceLock::new(),
            dataset: self.dataset.clone(),
            pool: self.pool.clone(),
            weights: self.weights.clone(),
        }))
    }
}

/// A batch's payloads as buffers and spans: sample `i` is `buffers[b][start..end]` for
/// `spans[i] = [b, start, end]`. The buffers are the zero-copy views of the shards the batch
/// reads, in order of first use, then (if any record was stored compressed) one `bytes` of the
/// decompressed payloads end to end.
struct BatchParts {
    spans: Vec<[u64; 3]>,
    /// Made once, so that every access hands out the same tuple.
    buffers: Py<PyTuple>,
    /// The index in `buffers` of the decompressed payloads, if there are any.
    owned: Option<usize>,
    globals: Vec<u64>,
}

impl BatchParts {
    fn gather(
        py: Python<'_>,
        py_side: &PySide,
        dataset: &core::Dataset,
        fetched: &[Fetched],
    ) -> PyResult<Self> {
        let layout = BatchLayout::of(dataset, fetched).py_err()?;
        let mut buffers = Vec::with_capacity(layout.shards.len() + 1);
        for &(c, shard, row) in &layout.shards {
            let cache = &dataset.caches[c as usize];
            let view = py_side.shard_view(py, cache, c as usize, shard, Some(row))?;
            buffers.push(view.unbind());
        }
        if let Some(len) = layout.owned_len {
            let arena = PyBytes::new_with(py, len as usize, |out| {
                BatchLayout::copy_owned(fetched, out);
                Ok(())
            })?;
            buffers.push(arena.into_any().unbind());
        }
        Ok(Self {
            owned: layout.owned_buffer(),
            spans: layout.spans,
            buffers: PyTuple::new(py, buffers)?.unbind(),
            globals: layout.globals,
        })
    }

    /// One object per payload, as `CachedSample.data`: a zero-copy `memoryview` of the shard, or
    /// `bytes` for a decompressed record.
    fn data<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let buffers = self.buffers.bind(py);
        let mut data = Vec::with_capacity(self.spans.len());
        for &[b, start, end] in &self.spans {
            let buffer = buffers.get_item(b as usize)?;
            if Some(b as usize) == self.owned {
                let arena = buffer.cast::<PyBytes>()?.as_bytes();
                data.push(PyBytes::new(py, &arena[start as usize..end as usize]).into_any());
            } else {
                data.push(subview(&buffer, start, end)?);
            }
        }
        PyList::new(py, data)
    }
}

/// Consecutive samples of a pass: their payloads, and what builds their rows of the
/// samples-metadata table on demand.
#[pyclass(module = "dataset_rt._native", frozen)]
pub struct Batch {
    parts: BatchParts,
    /// One object per payload, made on first access.
    data: OnceLock<Py<PyList>>,
    dataset: Arc<core::Dataset>,
    pool: Arc<Pool>,
    weights: WeightTable,
}

#[pymethods]
impl Batch {
    fn __len__(&self) -> usize {
        self.parts.globals.len()
    }

    /// The payloads in order: zero-copy memoryviews, or bytes where they were decompressed.
    #[getter]
    fn data<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        if let Some(data) = self.data.get() {
            return Ok(data.bind(py).clone());
        }
        let data = self.parts.data(py)?;
        // Another thread may have made it meanwhile: every caller gets the one that was kept.
        let _ = self.data.set(data.unbind());
        Ok(self.data.get().expect("set above").bind(py).clone())
    }

    /// The buffers the spans point into, as a tuple.
    #[getter]
    fn buffers<'py>(&self, py: Python<'py>) -> Bound<'py, PyTuple> {
        self.parts.buffers.bind(py).clone()
    }

    /// The spans, `[buffer, start, end]` per sample, as little-endian int64 bytes.
    fn spans_bytes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        PyBytes::new_with(py, self.parts.spans.len() * 24, |out| {
            for (chunk, span) in out.chunks_exact_mut(24).zip(&self.parts.spans) {
                for (to, &v) in chunk.chunks_exact_mut(8).zip(span) {
                    to.copy_from_slice(&(v as i64).to_le_bytes());
                }
            }
            Ok(())
        })
    }

    /// The samples' global indices (rows of `samples_metadata()`) as little-endian int64 bytes.
    fn indices_bytes<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        let mut out = Vec::with_capacity(self.parts.globals.len() * 8);
        for &g in &self.parts.globals {
            out.extend_from_slice(&(g as i64).to_le_bytes());
        }
        PyBytes::new(py, &out)
    }

    /// The samples' rows of the samples-metadata table as an Arrow C stream capsule
    /// (`arrow_array_stream`) of one record batch, gathered without the GIL.
    fn rows_stream<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyCapsule>> {
        let inner = self.dataset.clone();
        let weights = self.weights.clone();
        let globals = self.parts.globals.clone();
        // A batch stays whole after its runtime is closed: its rows are then gathered on this
        // thread, the runtime's having stopped.
        let batch = py
            .detach(|| {
                if self.pool.is_closed() {
                    samples::rows(&inner, &weights, &globals)
                } else {
                    self.pool
                        .run(move || samples::rows(&inner, &weights, &globals))
                }
            })
            .py_err()?;
        let schema = batch.schema();
        let reader = RecordBatchIterator::new(std::iter::once(Ok(batch)), schema);
        let stream = FFI_ArrowArrayStream::new(Box::new(reader));
        PyCapsule::new(py, stream, Some(c"arrow_array_stream".to_owned()))
    }
}

/// Where a sample's metadata lives, so its dict is built only when first asked for.
struct Origin {
    py_side: Arc<PySide>,
    cache: usize,
    row: u64,
}

/// Makes the samples of the shared-memory loader's slots in the training process: a slot entry
/// names its sample's cache and row, so its metadata dict is built from this dataset's own row
/// on first access (the producer encoded that same row; the caches' fingerprints were compared).
#[derive(Clone)]
pub(crate) struct SampleMaker {
    dataset: Arc<core::Dataset>,
    py_side: Arc<PySide>,
}

impl SampleMaker {
    /// Bytes `offset .. offset + len` of shard `shard` of cache `cache` (record `row`'s
    /// payload): a zero-copy slice of this dataset's own map of the shard, the one in-process
    /// iteration serves, or `None` when the dataset has no such row or shard.
    pub(crate) fn shard_data<'py>(
        &self,
        py: Python<'py>,
        cache: u32,
        row: u64,
        (shard, offset, len): (u32, u64, u64),
    ) -> Option<PyResult<Bound<'py, PyAny>>> {
        let c = self.dataset.caches.get(cache as usize)?;
        if c.is_fetched() {
            return None; // its records are copied into the slots, never referenced
        }
        if c.len() <= row
            || shard as usize >= c.num_shards()
            || offset.checked_add(len)? > c.shard_len(shard)
        {
            return None;
        }
        let fetched = Fetched {
            cache,
            row,
            payload: Payload::Mapped { shard, offset, len },
        };
        Some(self.py_side.payload(py, &self.dataset, &fetched))
    }

    /// Bytes `offset .. offset + len` of shard `shard` of cache `cache`, any part of a record
    /// (a loader worker's result that viewed it): a zero-copy, read-only slice of this
    /// dataset's own map of the shard, or `None` when the dataset has no such bytes.
    pub(crate) fn shard_slice<'py>(
        &self,
        py: Python<'py>,
        cache: u32,
        (shard, offset, len): (u32, u64, u64),
    ) -> Option<PyResult<Bound<'py, PyAny>>> {
        let c = self.dataset.caches.get(cache as usize)?;
        if c.is_fetched() {
            return None; // its records are copied into the slots, never referenced
        }
        if shard as usize >= c.num_shards() || offset.checked_add(len)? > c.shard_len(shard) {
            return None;
        }
        Some(
            self.py_side
                .shard_view(py, c, cache as usize, shard, None)
                .and_then(|view| subview(&view, offset, offset + len)),
        )
    }

    /// See [`core::Dataset::check_shards_of`].
    pub(crate) fn check_shards_of(&self, globals: &[u64]) -> dataset_rt_core::Result<()> {
        self.dataset.check_shards_of(globals)
    }

    /// The same check for records whose shards are known, (cache, shard, row) in order: one
    /// `fstat` per shard, and no index lookup.
    pub(crate) fn check_shards(&self, records: &[(u32, u32, u64)]) -> dataset_rt_core::Result<()> {
        self.dataset.check_record_shards(records.iter().copied())
    }

    /// The validated size of every shard of every cache (the bound of slot references).
    pub(crate) fn shard_lens(&self) -> Vec<Vec<u64>> {
        self.dataset
            .caches
            .iter()
            .map(|c| (0..c.num_shards() as u32).map(|s| c.shard_len(s)).collect())
            .collect()
    }

    /// The sample at (`cache`, `row`) with payload `data`, or `None` when the dataset has no such
    /// sample.
    pub(crate) fn sample(&self, data: Py<PyAny>, cache: u32, row: u64) -> Option<CachedSample> {
        let c = cache as usize;
        if self.dataset.caches.get(c)?.len() <= row {
            return None;
        }
        Some(CachedSample {
            data,
            metadata: OnceLock::new(),
            origin: Some(Origin {
                py_side: self.py_side.clone(),
                cache: c,
                row,
            }),
        })
    }
}

/// What `CachedSample.__reduce__` gives: the class and its arguments (data, metadata).
type Reduced<'py> = (Bound<'py, PyAny>, (Bound<'py, PyAny>, Bound<'py, PyDict>));

/// One sample: its payload bytes (a memoryview, or bytes when it was decompressed) and metadata.
#[pyclass(module = "dataset_rt._native", frozen)]
pub struct CachedSample {
    #[pyo3(get)]
    data: Py<PyAny>,
    metadata: OnceLock<Py<PyDict>>,
    origin: Option<Origin>,
}

#[pymethods]
impl CachedSample {
    #[new]
    fn new(data: Py<PyAny>, metadata: Py<PyDict>) -> Self {
        CachedSample {
            data,
            metadata: OnceLock::from(metadata),
            origin: None,
        }
    }

    /// The sample's metadata (built on first access, then the same dict every time).
    #[getter]
    fn metadata(&self, py: Python<'_>) -> PyResult<Py<PyDict>> {
        if let Some(m) = self.metadata.get() {
            return Ok(m.clone_ref(py));
        }
        let origin = self
            .origin
            .as_ref()
            .expect("a sample without a dict has an origin");
        let dict = PyDict::new(py);
        let cache = &origin.py_side.dataset.caches[origin.cache];
        // The first use of the cache's table reads and checks all of `metadata.arrow`.
        let table = if cache.metadata_loaded() {
            cache.metadata()
        } else {
            py.detach(|| cache.metadata())
        }
        .py_err()?;
        let keys = &origin.py_side.caches[origin.cache].keys;
        for (key, (_, value)) in keys.iter().zip(table.row(origin.row)) {
            match value {
                MetaRef::Bool(b) => dict.set_item(key, b)?,
                MetaRef::Int(i) => dict.set_item(key, i)?,
                MetaRef::Float(f) => dict.set_item(key, f)?,
                MetaRef::Str(s) => dict.set_item(key, s)?,
            }
        }
        let _ = self.metadata.set(dict.unbind());
        Ok(self.metadata.get().expect("set above").clone_ref(py))
    }

    #[classattr]
    fn __match_args__() -> (&'static str, &'static str) {
        ("data", "metadata")
    }

    /// Pickled, copied and sent to another process as its values: the payload as `bytes` (a
    /// view of a map cannot travel) and a copy of the metadata dict.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Reduced<'py>> {
        let py = slf.py();
        let this = slf.get();
        let data = this.data.bind(py);
        let data = if data.is_instance_of::<PyBytes>() {
            data.clone()
        } else {
            py.get_type::<PyBytes>().call1((data,))?
        };
        let metadata = this.metadata(py)?.bind(py).copy()?;
        Ok((slf.get_type().into_any(), (data, metadata)))
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let data = self.data.bind(py);
        let len = data.len().unwrap_or(0);
        Ok(format!(
            "CachedSample(data=<{} of {len} bytes>, metadata={})",
            data.get_type().name()?,
            self.metadata(py)?.bind(py).repr()?
        ))
    }
}

/// The epoch order as specified in docs/determinism.md (for tests and audits): the whole
/// order, or only the samples at `positions`, each computed on its own.
#[pyfunction]
#[pyo3(signature = (seed, epoch, num_samples, epoch_len=None, shuffle=true, weights=None, *, positions=None))]
#[allow(clippy::too_many_arguments)]
pub fn epoch_order(
    py: Python<'_>,
    seed: u64,
    epoch: u64,
    num_samples: u64,
    epoch_len: Option<u64>,
    shuffle: bool,
    weights: Option<Vec<f64>>,
    positions: Option<Vec<u64>>,
) -> PyResult<Vec<u64>> {
    let params = EpochParams {
        seed,
        epoch,
        epoch_len: epoch_len.unwrap_or(num_samples),
        shuffle,
    };
    // Not on a pool (this function has none): a local catch_unwind keeps a panic from
    // crossing into Python as PanicException.
    py.detach(|| {
        std::panic::catch_unwind(|| {
            sampler::checked_order(
                params,
                num_samples,
                weights.as_deref(),
                positions.as_deref(),
            )
        })
        .unwrap_or_else(|panic| {
            Err(dataset_rt_core::Error::Runtime(
                dataset_rt_core::pool::panic_message(&panic),
            ))
        })
    })
    .py_err()
}

impl Dataset {
    pub(crate) fn sample_maker(&self) -> SampleMaker {
        SampleMaker {
            dataset: self.inner().clone(),
            py_side: self.py_side.clone(),
        }
    }

    /// The core dataset, reading options and weights in force: the shared-memory loader
    /// (`loader.rs`) reads the same order in its producer process.
    pub(crate) fn reading(&self) -> (Arc<core::Dataset>, ReadOptions, WeightTable) {
        self.session.reading()
    }
}

//! The shared-memory loader's bindings: `LoaderPlan` (epochs, state and the start of each pass,
//! owned by the training process), `RingHandle` (one party's view of a pass's segments), and the
//! entry points of the producer and consumer processes. They convert and delegate: the rules
//! live in `dataset-rt-loader` (plan, producer, slot codec, lifecycle) and the protocol in
//! `dataset-rt-shm`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use dataset_rt_core::dataset::State;
use dataset_rt_core::error::io_errno;
use dataset_rt_core::metadata::MetaRef;
use dataset_rt_core::os::{self, own_pid};
use dataset_rt_core::ErrorKind;
use dataset_rt_loader::batch::{
    any_in_slot, decode_metadata, read_batch, slot_used, Entry, Payload,
};
use dataset_rt_loader::lifecycle;
use dataset_rt_loader::plan::{self, PassPlan, Plan};
use dataset_rt_loader::producer;
use dataset_rt_loader::shards::{MapIndex, ShardTable};
use dataset_rt_shm::private_copy::replace_with_private_copy;
use dataset_rt_shm::results;
use dataset_rt_shm::ring::{Heartbeat, Party, Ring, Role, Ticket};
use dataset_rt_shm::ShmError;
use pyo3::create_exception;
use pyo3::exceptions::{PyMemoryError, PyOSError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::dataset::{Dataset, SampleMaker};
use crate::errors::{self, ConfigError, IntoPyResult, LoaderError, RingClosed};

create_exception!(
    dataset_rt._native,
    WorkerError,
    LoaderError,
    "worker_init_fn, transform or collate_fn raised in a loader worker; the message carries the worker's traceback."
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("WorkerError", py.get_type::<WorkerError>())?;
    m.add_class::<LoaderPlan>()?;
    m.add_class::<RingHandle>()?;
    m.add_class::<OwnerRing>()?;
    m.add_class::<WorkerRing>()?;
    m.add_class::<ResultArena>()?;
    m.add_function(wrap_pyfunction!(run_producer, m)?)?;
    m.add_function(wrap_pyfunction!(set_parent_death_signal, m)?)?;
    m.add_function(wrap_pyfunction!(retain_worker_heap, m)?)?;
    m.add_function(wrap_pyfunction!(close_inherited_fds, m)?)?;
    m.add_function(wrap_pyfunction!(reap_shm_leftovers, m)?)?;
    Ok(())
}

/// Seconds from Python as a `Duration`: negative and NaN are zero, and anything above 2**32 s
/// (136 years; infinity, 1e300) is 2**32 s, so that neither the conversion nor a deadline
/// `Instant::now() + d` can overflow and panic.
// Not `clamp`: it keeps NaN, which `from_secs_f64` turns into a panic.
#[allow(clippy::manual_clamp)]
fn seconds(value: f64) -> Duration {
    const LONGEST: f64 = 4_294_967_296.0;
    Duration::from_secs_f64(value.max(0.0).min(LONGEST)) // max first: NaN.max(0.0) is 0.0
}

/// The exception of the error the producer recorded (its kind code and errno), as if raised here.
fn producer_error(kind: u32, errno: Option<i32>, batch: u64, text: &str) -> PyErr {
    let msg = format!("the loader's producer failed at batch {batch}: {text}");
    match ErrorKind::from_code(kind) {
        Ok(kind) => errors::from_kind(kind, errno, msg),
        Err(unknown) => LoaderError::new_err(format!(
            "{msg} ({unknown}: is the producer another build of DatasetRT?)"
        )),
    }
}

/// Maps a loader error through the one error-kind table (`producer::error_kind`), as the
/// producer does when it records one.
fn shm_err(err: ShmError) -> PyErr {
    match err {
        ShmError::ProducerFailed {
            kind,
            errno,
            batch,
            text,
        } => producer_error(kind, errno, batch, &text),
        other => {
            let (kind, errno) = producer::shm_error_kind(&other);
            errors::from_kind(kind, errno, other.to_string())
        }
    }
}

fn loader_err(err: dataset_rt_loader::Error) -> PyErr {
    match err {
        dataset_rt_loader::Error::Shm(e) => shm_err(e),
        dataset_rt_loader::Error::Core(e) => errors::to_py(e),
    }
}

trait ShmResult<T> {
    fn py_shm(self) -> PyResult<T>;
}

impl<T> ShmResult<T> for dataset_rt_shm::Result<T> {
    fn py_shm(self) -> PyResult<T> {
        self.map_err(shm_err)
    }
}

impl<T> ShmResult<T> for dataset_rt_loader::Result<T> {
    fn py_shm(self) -> PyResult<T> {
        self.map_err(loader_err)
    }
}

/// Epochs, iterator state and pass creation of one `DataLoader` (training process only); the
/// rules are `dataset_rt_loader::plan::Plan`'s.
#[pyclass(module = "dataset_rt._native", frozen)]
pub struct LoaderPlan {
    dataset: Py<Dataset>,
    plan: Plan,
}

#[pymethods]
impl LoaderPlan {
    #[new]
    #[pyo3(signature = (dataset, batch_size, drop_last, producer_threads=None))]
    fn new(
        dataset: Py<Dataset>,
        batch_size: u64,
        drop_last: bool,
        producer_threads: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Self> {
        if batch_size == 0 {
            return Err(ConfigError::new_err(
                "invalid DataLoader.batch_size: must be at least 1",
            ));
        }
        let field = "DataLoader.producer_threads";
        let producer_threads = match crate::config::optional(field, producer_threads, 1)? {
            None => plan::default_producer_threads(),
            Some(n @ 1..=plan::MAX_PRODUCER_THREADS) => n as usize,
            Some(n) => {
                return Err(ConfigError::new_err(format!(
                    "invalid {field}: {n} threads is above the limit of {}; None uses \
                     min(4, available cores)",
                    plan::MAX_PRODUCER_THREADS
                )))
            }
        };
        Ok(LoaderPlan {
            dataset,
            plan: Plan::new(batch_size, drop_last, producer_threads),
        })
    }

    /// Threads of the producer's read-ahead pool.
    #[getter]
    fn producer_threads(&self) -> usize {
        self.plan.producer_threads()
    }

    /// Batches in a full epoch of this rank.
    fn __len__(&self) -> usize {
        let (inner, opts, _) = self.dataset.get().reading();
        self.plan.len(&inner, &opts) as usize
    }

    /// Fixes the epoch of the next pass; the state now describes that epoch's start (a loaded
    /// state's position and the last pass's progress are dropped), as `Dataset.set_epoch`.
    /// Epochs are 0 to `LAST_EPOCH` (2**64 - 2): a u64, so that 2**63 and above are epochs.
    fn set_epoch(&self, epoch: u64) -> PyResult<()> {
        self.plan.set_epoch(epoch).py_err()
    }

    /// The epoch the next pass reads: a loaded state's, else the one after the last pass.
    fn next_pass_epoch(&self) -> PyResult<u64> {
        self.plan.next_pass_epoch().py_err()
    }

    /// The dataset's state format at what the training loop received: read from the live
    /// pass's control segment, with the weight table that pass reads.
    fn state_json(&self) -> PyResult<String> {
        let snapshot = self.plan.snapshot().py_shm()?;
        let (inner, opts, weights) = self.dataset.get().reading();
        let fingerprint = snapshot
            .weights_fingerprint
            .as_deref()
            .unwrap_or(&weights.fingerprint);
        Ok(inner
            .state_under(&opts, fingerprint, snapshot.epoch, snapshot.position)
            .to_json())
    }

    /// Makes the next pass resume at the exact next sample of the state (any batch size,
    /// worker count or world size).
    fn load_state_json(&self, text: &str) -> PyResult<()> {
        let state = State::from_json(text).py_err()?;
        let (inner, opts, weights) = self.dataset.get().reading();
        let (epoch, position) = inner.check_state(&state, &opts, &weights).py_err()?;
        self.plan.load(epoch, position, weights.fingerprint.clone());
        Ok(())
    }

    /// Creates the segments and the private directory of the next pass (`prefetch_factor`
    /// ring slots per consumer) and writes the producer's spec into that directory; returns
    /// the owner's handle. `slot_size=None` sizes slots from the data: a batch of the largest
    /// samples fits. Nothing of the plan changes until `commit_pass`.
    #[pyo3(signature = (prefetch_factor, slot_size, num_consumers, persistent=false))]
    fn start_pass(
        &self,
        py: Python<'_>,
        prefetch_factor: u32,
        slot_size: Option<u64>,
        num_consumers: u32,
        persistent: bool,
    ) -> PyResult<Py<OwnerRing>> {
        let (inner, opts, weights) = self.dataset.get().reading();
        let slot_size = py
            .detach(|| self.plan.slot_size(&inner, &opts, slot_size))
            .py_shm()?;
        let mut pass = self
            .plan
            .plan_pass(
                &inner,
                &opts,
                &weights,
                num_consumers,
                prefetch_factor,
                slot_size,
                persistent,
            )
            .py_shm()?;
        let ring = py
            .detach(|| self.plan.create_pass(&mut pass, own_pid(), &weights))
            .py_shm()?;
        OwnerRing::create(py, ring, pass, self.dataset.get().sample_maker())
    }

    /// Starts the next pass on the segments of `ring`, a persistent pipeline whose previous pass
    /// was fully delivered and ended (`end_pass`): the producer and the consumers waiting on
    /// them take it up. Returns the owner's handle of the new pass (commit it as `start_pass`'s),
    /// or `None` when the pipeline cannot read it (the weight table or the reading options
    /// changed since it started): the caller then starts a fresh pipeline. Raises `LoaderError`
    /// when the segments refuse a next pass (an error, a stop, a pass not over).
    fn restart_pass(&self, py: Python<'_>, ring: &OwnerRing) -> PyResult<Option<Py<OwnerRing>>> {
        let (inner, opts, weights) = self.dataset.get().reading();
        let next = py
            .detach(|| {
                self.plan
                    .restart_pass(&ring.ring, &ring.plan, &inner, &opts, &weights)
            })
            .py_shm()?;
        next.map(|plan| {
            OwnerRing::create(
                py,
                ring.ring.clone(),
                plan,
                self.dataset.get().sample_maker(),
            )
        })
        .transpose()
    }

    /// Makes a started pass the live one, once all its processes are running: the state reads
    /// from its control segment, a loaded state is used up and the next pass reads the next
    /// epoch. A `set_epoch` or `load_state_json` since `start_pass` wins over it.
    fn commit_pass(&self, ring: &OwnerRing) {
        self.plan.commit(&ring.plan, ring.ring.clone());
    }

    /// Ends the pass of `ring` if it is the live one: keeps its progress for `state_json` and
    /// drops its mappings.
    fn end_pass(&self, ring: &OwnerRing) {
        self.plan.end(&ring.ring);
    }
}

/// A consumer process's maps of the shard files that slot references point into: each file
/// is opened by its path, checked against the training process's [`ShardTable`] (the same
/// file, not cut short) and mapped read-only on first use, then kept for the life of the
/// handle (every pass of a persistent worker). Views of a record are slices of the map's
/// `memoryview`, so they keep it alive however long they are kept. The maps' addresses are
/// indexed: a buffer of a worker's result that lies inside one leaves as a reference.
struct ShardViews {
    table: ShardTable,
    views: Vec<Vec<OnceLock<Py<PyAny>>>>,
    index: Mutex<MapIndex>,
}

impl ShardViews {
    fn new(table: ShardTable) -> Self {
        let views = table
            .caches
            .iter()
            .map(|c| c.shards.iter().map(|_| OnceLock::new()).collect())
            .collect();
        ShardViews {
            table,
            views,
            index: Mutex::new(MapIndex::default()),
        }
    }

    /// The view of record bytes `offset .. offset + len` of shard `shard` of cache `cache`
    /// (checked against the table by `read_batch`).
    fn record<'py>(
        &self,
        py: Python<'py>,
        cache: u32,
        (shard, offset, len): (u32, u64, u64),
    ) -> PyResult<Bound<'py, PyAny>> {
        let cell = &self.views[cache as usize][shard as usize];
        let view = match cell.get() {
            Some(view) => view.bind(py).clone(),
            None => {
                // Checked against the table (the same file, not cut short), mapped with exactly
                // its validated size, and closed: the map needs no descriptor.
                let size = self.table.caches[cache as usize].shards[shard as usize].len;
                let map = py.detach(|| self.table.map(cache, shard)).py_shm()?;
                let (view, start) = crate::shard_map::own_view(py, map)?;
                // Indexed only when this map is the one kept (another thread may have mapped
                // the shard while this one opened it): a dropped map's range must not be.
                if cell.set(view.unbind()).is_ok() {
                    self.index.lock().unwrap().insert(start, size, cache, shard);
                }
                cell.get().expect("set above").bind(py).clone()
            }
        };
        crate::dataset::subview(&view, offset, offset + len)
    }
}

/// What every party's handle of a pass's segments shares: the ring, which party holds it, and
/// the pass generation its `take_ticket` last found over. The training process holds an
/// [`OwnerRing`], each loader worker a [`WorkerRing`]: what only one of them may do is a method
/// of its type alone.
#[pyclass(module = "dataset_rt._native", frozen, subclass)]
pub struct RingHandle {
    ring: Arc<Ring>,
    /// The worker's index; `None` for the training process.
    consumer: Option<usize>,
    /// The generation of the last pass `take_ticket` found over (`wait_next_pass` waits past it).
    last_generation: AtomicU32,
}

#[pymethods]
impl RingHandle {
    /// The parties silent for more than `bound` seconds, producer first: `(worker index, or
    /// None for the producer, seconds silent)`. Finished parties are not listed.
    fn stalls(&self, bound: f64) -> Vec<(Option<usize>, f64)> {
        self.ring
            .stalls(seconds(bound))
            .into_iter()
            .map(|s| {
                let index = match s.party {
                    Party::Producer => None,
                    Party::Consumer(i) => Some(i),
                };
                (index, s.silent.as_secs_f64())
            })
            .collect()
    }

    /// Bytes of one slot (a multiple of 4096).
    #[getter]
    fn slot_size(&self) -> u64 {
        self.ring.geometry().slot_size
    }

    #[getter]
    fn num_slots(&self) -> u32 {
        self.ring.geometry().num_slots
    }

    #[getter]
    fn ctl_name(&self) -> String {
        self.ring.ctl_name().to_owned()
    }

    #[getter]
    fn ring_name(&self) -> String {
        self.ring.ring_name().to_owned()
    }

    #[getter]
    fn ring_len(&self) -> u64 {
        self.ring.ring_len()
    }

    #[getter]
    fn total_batches(&self) -> u64 {
        self.ring.total_batches()
    }

    #[getter]
    fn produced(&self) -> u64 {
        self.ring.produced()
    }

    #[getter]
    fn delivered(&self) -> u64 {
        self.ring.delivered()
    }

    #[getter]
    fn producer_pid(&self) -> u64 {
        self.ring.producer_pid()
    }

    fn mark_attached(&self) {
        self.ring.mark_attached();
    }

    fn all_attached(&self) -> bool {
        self.ring.all_attached()
    }

    /// Sleeps (without the GIL) until a party attaches, at most `timeout` seconds (capped at
    /// 0.1); says whether every party has attached.
    fn wait_attached(&self, py: Python<'_>, timeout: f64) -> bool {
        let timeout = seconds(timeout);
        py.detach(|| self.ring.wait_attached(timeout))
    }

    /// Removes both names from /dev/shm; every mapping stays valid.
    fn unlink(&self) {
        self.ring.unlink();
    }

    /// Tells every party to exit and wakes them.
    fn stop(&self) {
        self.ring.stop();
    }

    /// The next batch of the current pass to process, or `None` when the pass has no more.
    fn take_ticket(&self) -> Option<u64> {
        match self.ring.take_ticket() {
            Ticket::Batch(t) => Some(t),
            Ticket::PassOver(generation) => {
                self.last_generation.store(generation, Ordering::Relaxed);
                None
            }
        }
    }

    /// A persistent party whose `take_ticket` found the pass over: waits until the owner starts
    /// the next pass. Raises `RingClosed` when stopped or when the owner is gone.
    fn wait_next_pass(&self, py: Python<'_>) -> PyResult<()> {
        let after = self.last_generation.load(Ordering::Relaxed);
        py.detach(|| self.ring.wait_next_pass(after)).py_shm()?;
        Ok(())
    }

    /// Gives batch `ticket`'s slot back to the producer (after every view of it was released).
    fn release(&self, ticket: u64) -> PyResult<()> {
        self.ring.release(ticket, self.consumer).py_shm()
    }

    /// Records that the training loop received batch `seq`; the state moves past it.
    fn mark_delivered(&self, seq: u64) -> PyResult<()> {
        plan::mark_delivered(&self.ring, seq).py_shm()
    }

    /// Raises the producer's error if it affects batch `seq` or an earlier one.
    fn check_error(&self, seq: u64) -> PyResult<()> {
        match self.ring.error() {
            Some(e) if e.batch <= seq => Err(producer_error(e.kind, e.errno, e.batch, &e.text)),
            _ => Ok(()),
        }
    }

    /// The producer's recorded error text, if any (whatever batch it affects).
    fn error_text(&self) -> Option<String> {
        self.ring
            .error()
            .map(|e| format!("batch {}: {}", e.batch, e.text))
    }
}

/// The training process's handle of a pass it started: what its plan decided, and the maps of
/// its own dataset, from which it serves the batches it takes itself.
#[pyclass(module = "dataset_rt._native", frozen, extends = RingHandle)]
pub struct OwnerRing {
    ring: Arc<Ring>,
    /// The pass's parameters: a persistent pipeline reads a next pass only with the same
    /// producer parameters.
    plan: PassPlan,
    /// Makes the samples of the batches the training process takes itself (`num_workers=0`).
    samples: SampleMaker,
    /// The validated size of every shard, per cache: the bound of every slot reference.
    shard_lens: Vec<Vec<u64>>,
}

impl OwnerRing {
    /// The handle of a pass the plan started on `ring`, as a Python object.
    fn create(
        py: Python<'_>,
        ring: Arc<Ring>,
        plan: PassPlan,
        samples: SampleMaker,
    ) -> PyResult<Py<Self>> {
        let base = RingHandle {
            ring: ring.clone(),
            consumer: None,
            last_generation: AtomicU32::new(0),
        };
        let owner = OwnerRing {
            ring,
            plan,
            shard_lens: samples.shard_lens(),
            samples,
        };
        Py::new(py, PyClassInitializer::from(base).add_subclass(owner))
    }

    /// A read-only `mmap.mmap` of the used bytes of batch `ticket`'s slot in the ring file `fd`.
    fn map_slot<'py>(&self, py: Python<'py>, ticket: u64, fd: i32) -> PyResult<Bound<'py, PyAny>> {
        let slot = self.ring.slot(ticket);
        let used = slot_used(slot);
        let mmap = py.import("mmap")?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("offset", self.ring.slot_offset(ticket))?;
        kwargs.set_item("access", mmap.getattr("ACCESS_READ")?)?;
        match mmap.getattr("mmap")?.call((fd, used), Some(&kwargs)) {
            Ok(map) => Ok(map),
            Err(e) if is_enomem(py, &e) => Err(PyMemoryError::new_err(format!(
                "mapping the ring slot of batch {ticket} failed: {e}. The process is out \
                 of memory or of mappings: each batch the training loop keeps holds its \
                 bytes and is one mapping, and Linux allows a process vm.max_map_count of \
                 them (65,530 by default): keep fewer batches, or copy what must be kept \
                 (bytes(sample.data))"
            ))),
            Err(e) => Err(e),
        }
    }
}

#[pymethods]
impl OwnerRing {
    /// The shard files of the owner's dataset (JSON, for `attach`): the consumers map the
    /// slots' references from these very files.
    #[getter]
    fn shard_table(&self) -> String {
        serde_json::to_string(&self.plan.spec.shards).expect("plain data")
    }

    /// The descriptor of the dataset's verified-samples memfd that the producer inherits
    /// (`pass_fds`) and attaches to, as its spec says; `None` when the set is not shared.
    #[getter]
    fn verified_fd(&self) -> Option<i32> {
        self.plan.spec.verified.map(|v| v.fd)
    }

    /// The producer's spec file in the owner's private directory.
    #[getter]
    fn spec_path(&self) -> String {
        let path = lifecycle::private_dir(&self.ring).join("spec.json");
        path.to_string_lossy().into_owned() // an ASCII name under /dev/shm
    }

    /// The training process's own take of batch `ticket` (`num_workers=0`, owner only): waits up
    /// to `timeout` seconds for it and takes it, and returns `(map, samples, indices)`: one
    /// `CachedSample` per sample, its metadata built on first access, and the samples' global
    /// indices as the producer wrote them. A sample whose record the slot references has as
    /// `data` a slice of the dataset's own map of the shard file, as in-process iteration
    /// serves it; one whose payload is in the slot (decompressed) a slice of `memoryview(map)`,
    /// `map` being the `mmap.mmap` of the slot's used bytes of the ring file `fd` (`ACCESS_READ`,
    /// no copy). When no payload is in the slot, nothing can reference it: `map` is `None` and
    /// the slot is given back at once. `None` when the batch is not ready yet; raises as
    /// `wait_batch` does.
    #[allow(clippy::type_complexity)]
    fn take_batch<'py>(
        &self,
        py: Python<'py>,
        ticket: u64,
        timeout: f64,
        fd: i32,
    ) -> PyResult<Option<(Option<Bound<'py, PyAny>>, Bound<'py, PyList>, Vec<u64>)>> {
        let timeout = seconds(timeout);
        let ring = &self.ring;
        if !py
            .detach(|| ring.wait_ready(ticket, timeout, Role::Owner, None))
            .py_shm()?
        {
            return Ok(None);
        }
        let slot = ring.slot(ticket);
        let entries = read_batch(slot, ticket, &self.shard_lens).py_shm()?;
        // The shards its payloads are views of: truncated since the producer read them ahead,
        // their bytes would be zeros, or SIGBUS (payloads in the slot are copies, not views).
        let views: Vec<(u32, u32, u64)> = entries
            .iter()
            .filter_map(|e| match e.payload {
                Payload::Shard(r) => Some((e.cache, r.shard, e.row)),
                Payload::Slot { .. } => None,
            })
            .collect();
        self.samples.check_shards(&views).py_err()?;
        let map = if any_in_slot(&entries) {
            Some(self.map_slot(py, ticket, fd)?)
        } else {
            None
        };
        let whole = map
            .as_ref()
            .map(|map| py.import("builtins")?.getattr("memoryview")?.call1((map,)))
            .transpose()?;
        let unknown = |i: usize, e: &Entry| {
            shm_err(ShmError::Protocol(format!(
                "slot of batch {ticket}: sample {i} names row {} of cache {}, which this \
                 dataset does not have",
                e.row, e.cache
            )))
        };
        let samples = PyList::empty(py);
        for (i, e) in entries.iter().enumerate() {
            let data = match (e.payload, &whole) {
                // read_batch checked that every payload lies within the used bytes.
                (Payload::Slot { off, len }, Some(whole)) => {
                    crate::dataset::subview(whole, off, off + len)?
                }
                (Payload::Slot { .. }, None) => unreachable!("mapped when any payload is in it"),
                (Payload::Shard(r), _) => self
                    .samples
                    .shard_data(py, e.cache, e.row, (r.shard, r.offset, r.len))
                    .ok_or_else(|| unknown(i, e))??,
            };
            let sample = self
                .samples
                .sample(data.unbind(), e.cache, e.row)
                .ok_or_else(|| unknown(i, e))?;
            samples.append(sample)?;
        }
        let indices = entries.iter().map(|e| e.global).collect();
        if map.is_none() {
            // Every payload is a view of a shard map: nothing refers to the slot any more.
            self.ring.release(ticket, None).py_shm()?;
        }
        Ok(Some((map, samples, indices)))
    }

    /// Checks that the shards holding the records of a batch about to be handed out (its
    /// samples' global indices) still have their validated sizes: raises `CorruptRecordError`
    /// naming the shard and the batch's first sample in it when one was truncated since the
    /// producer read it ahead (the bytes of its maps would be zeros, or `SIGBUS`).
    fn check_delivered(&self, py: Python<'_>, indices: Vec<u64>) -> PyResult<()> {
        let samples = &self.samples;
        py.detach(|| samples.check_shards_of(&indices)).py_err()
    }

    /// The training process's views of bytes a worker's result referenced (`shard_spans`'
    /// flat `(cache, shard, offset, length)` quadruples, owner only): read-only slices of the
    /// dataset's own maps of the shard files, the ones in-process iteration serves. Raises
    /// `LoaderError` for bytes the dataset's shards do not have.
    fn shard_slices<'py>(
        &self,
        py: Python<'py>,
        spans: Vec<u64>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        if spans.len() % 4 != 0 {
            return Err(LoaderError::new_err(format!(
                "a worker's shard references hold {} numbers, not four per buffer",
                spans.len()
            )));
        }
        spans
            .chunks_exact(4)
            .map(|q| {
                let (cache, shard) = (u32::try_from(q[0]), u32::try_from(q[1]));
                let got = match (cache, shard) {
                    (Ok(cache), Ok(shard)) => {
                        self.samples.shard_slice(py, cache, (shard, q[2], q[3]))
                    }
                    _ => None,
                };
                got.unwrap_or_else(|| {
                    Err(LoaderError::new_err(format!(
                        "a worker's result refers to bytes {} .. {} of shard {} of cache {}, \
                         which this dataset does not have",
                        q[2],
                        q[2].saturating_add(q[3]),
                        q[1],
                        q[0]
                    )))
                })
            })
            .collect()
    }

    /// Gives batch `ticket`'s slot back although the training process still references `map`,
    /// the `mmap` of it that `take_batch` returned: first replaces the map's pages by a private
    /// copy in place (same address, same bytes; see `replace_with_private_copy`), so the views
    /// stay valid and never show the slot's next batch. Raises `MemoryError` when the copy
    /// cannot be allocated; the slot is then not given back.
    fn release_kept(&self, py: Python<'_>, ticket: u64, map: &Bound<'_, PyAny>) -> PyResult<()> {
        if !map.is_instance(&py.import("mmap")?.getattr("mmap")?)? {
            return Err(LoaderError::new_err(
                "release_kept needs the slot's mmap.mmap",
            ));
        }
        // A numpy view is the limited API's way to the map's address; while it lives the map
        // cannot be closed (it is exported), so the address stays valid during the copy.
        let array = py
            .import("numpy")?
            .call_method1("frombuffer", (map, py.import("numpy")?.getattr("uint8")?))?;
        let (address, readonly): (usize, bool) = array
            .getattr("__array_interface__")?
            .get_item("data")?
            .extract()?;
        let len = array.len()?;
        let slot_size = self.ring.geometry().slot_size as usize;
        if len > slot_size {
            return Err(LoaderError::new_err(format!(
                "release_kept: a map of {len} bytes is not one of this ring's {slot_size}-byte slots"
            )));
        }
        let prot = if readonly {
            libc::PROT_READ
        } else {
            libc::PROT_READ | libc::PROT_WRITE
        };
        // SAFETY: `address .. address + len` is the buffer of `map`, one whole mapping (Python
        // maps it at a page-aligned offset, so its buffer starts the mapping) that stays mapped
        // while `array` exports it, and read-only for this process. The producer does not write
        // a slot that is taken, and Python's mmap ends it with munmap.
        let copied =
            py.detach(|| unsafe { replace_with_private_copy(address as *mut u8, len, prot) });
        drop(array);
        copied.map_err(|e| match e {
            ShmError::Memory { ref source, .. } if source.raw_os_error() == Some(libc::ENOMEM) => {
                PyMemoryError::new_err(format!(
                    "the training loop still references batch {ticket} when its ring slot must \
                     be reused, and the private copy of its {len} bytes that would keep it valid \
                     could not be made ({e}): each batch kept costs one copy of it (as with \
                     torch); keep fewer batches"
                ))
            }
            other => shm_err(other),
        })?;
        self.ring.release(ticket, None).py_shm()
    }
}

/// A loader worker's handle: attached by the control segment's name, with the heartbeat thread
/// that proves the process alive and its own maps of the shards that slot references point into.
#[pyclass(module = "dataset_rt._native", frozen, extends = RingHandle)]
pub struct WorkerRing {
    ring: Arc<Ring>,
    consumer: usize,
    /// The validated size of every shard, per cache: the bound of every slot reference.
    shard_lens: Vec<Vec<u64>>,
    views: ShardViews,
    /// The heartbeat thread, from attach until `retire`.
    heartbeat: Mutex<Option<Heartbeat>>,
}

#[pymethods]
impl WorkerRing {
    /// Attaches a consumer process by the control segment's name (checks magic, version and
    /// geometry) and starts its heartbeat thread, which proves the process alive while user
    /// code runs. `shard_table` is the owner handle's: the shard files that slot references
    /// point into. Call `mark_attached` once the ring is mapped on the Python side too.
    #[staticmethod]
    fn attach(
        py: Python<'_>,
        ctl_name: &str,
        consumer: usize,
        shard_table: &str,
    ) -> PyResult<Py<WorkerRing>> {
        let table: ShardTable = serde_json::from_str(shard_table).map_err(|e| {
            LoaderError::new_err(format!("a loader worker's shard table is not valid: {e}"))
        })?;
        let ring = Arc::new(py.detach(|| lifecycle::attach(ctl_name)).py_shm()?);
        ring.register_consumer(consumer, own_pid()).py_shm()?;
        let heartbeat = ring.keep_alive(Party::Consumer(consumer)).py_shm()?;
        let base = RingHandle {
            ring: ring.clone(),
            consumer: Some(consumer),
            last_generation: AtomicU32::new(0),
        };
        let worker = WorkerRing {
            ring,
            consumer,
            shard_lens: table.lens(),
            views: ShardViews::new(table),
            heartbeat: Mutex::new(Some(heartbeat)),
        };
        Py::new(py, PyClassInitializer::from(base).add_subclass(worker))
    }

    /// A consumer is done with the pass: stops its heartbeat thread and tells the owner not to
    /// watch it any more.
    fn retire(&self, py: Python<'_>) {
        let heartbeat = self.heartbeat.lock().unwrap().take();
        py.detach(|| drop(heartbeat)); // joins the thread
        self.ring.finished(Party::Consumer(self.consumer));
    }

    /// Waits up to `timeout` seconds for batch `ticket` and takes it: (slot offset in the ring
    /// segment, bytes used, [(offset in the slot, length, metadata dict, view) per sample], the
    /// samples' global indices as the producer wrote them), or `None` when it is not ready yet.
    /// A sample's `view` is its payload when the slot carries a reference to its record (a
    /// read-only slice of this process's map of the shard file), else `None` and the payload is
    /// the slot's bytes at the offset and length. Raises `RingClosed` when this party must exit,
    /// or the producer's error (owner).
    #[allow(clippy::type_complexity)]
    fn wait_batch<'py>(
        &self,
        py: Python<'py>,
        ticket: u64,
        timeout: f64,
    ) -> PyResult<
        Option<(
            u64,
            u64,
            Vec<(u64, u64, Bound<'py, PyDict>, Option<Bound<'py, PyAny>>)>,
            Vec<u64>,
        )>,
    > {
        let timeout = seconds(timeout);
        let ring = &self.ring;
        let taken =
            py.detach(|| ring.wait_ready(ticket, timeout, Role::Child, Some(self.consumer)));
        let taken = match taken {
            Err(ShmError::ProducerFailed { .. }) => {
                return Err(RingClosed::new_err("the producer failed"))
            }
            other => other.py_shm()?,
        };
        if !taken {
            return Ok(None);
        }
        let slot = ring.slot(ticket);
        let base = ring.slot_offset(ticket);
        let entries = read_batch(slot, ticket, &self.shard_lens).py_shm()?;
        let mut out = Vec::with_capacity(entries.len());
        let indices = entries.iter().map(|e| e.global).collect();
        for e in entries {
            let dict = metadata_dict(py, slot, &e)?;
            match e.payload {
                Payload::Slot { off, len } => out.push((off, len, dict, None)),
                Payload::Shard(r) => {
                    let view = self.views.record(py, e.cache, (r.shard, r.offset, r.len))?;
                    out.push((0, r.len, dict, Some(view)));
                }
            }
        }
        let used = slot_used(slot);
        Ok(Some((base, used, out, indices)))
    }

    /// Where buffers of a worker's result lie in this consumer's shard maps: for each
    /// `(address, length)`, `(cache, shard, offset in the shard file, length)` (flat, four
    /// numbers per buffer), or `None` unless every buffer lies wholly inside one map. Such a
    /// buffer views a verified, read-only shard file the training process maps too, so it
    /// may leave the worker as a reference instead of being copied (consumer only).
    fn shard_spans(&self, buffers: Vec<(usize, u64)>) -> Option<Vec<u64>> {
        let index = self.views.index.lock().unwrap();
        let mut out = Vec::with_capacity(4 * buffers.len());
        for (address, len) in buffers {
            let span = index.find(address, len)?;
            out.extend([span.cache.into(), span.shard.into(), span.offset, len]);
        }
        Some(out)
    }
}

/// The metadata dict of slot entry `e`, decoded from the slot.
fn metadata_dict<'py>(py: Python<'py>, slot: &[u8], e: &Entry) -> PyResult<Bound<'py, PyDict>> {
    let meta = &slot[e.meta_off as usize..e.meta_off as usize + e.meta_len as usize];
    let dict = PyDict::new(py);
    for (key, value) in decode_metadata(meta).py_shm()? {
        match value {
            MetaRef::Bool(b) => dict.set_item(key, b)?,
            MetaRef::Int(i) => dict.set_item(key, i)?,
            MetaRef::Float(f) => dict.set_item(key, f)?,
            MetaRef::Str(s) => dict.set_item(key, s)?,
        }
    }
    Ok(dict)
}

fn is_enomem(py: Python<'_>, err: &PyErr) -> bool {
    err.is_instance_of::<PyOSError>(py)
        && err
            .value(py)
            .getattr("errno")
            .and_then(|n| n.extract::<i32>())
            .is_ok_and(|n| n == libc::ENOMEM)
}

/// A loader worker's result arena: which bytes of its shared result memory each batch's buffers
/// take, and when they are free again (`dataset_rt_shm::results` has the rules). The worker
/// moves the bytes; this only decides where.
#[pyclass(module = "dataset_rt._native")]
pub struct ResultArena(results::ResultArena);

// `ResultArena(capacity)`'s default, spelled out in its signature (and the stub) as a number.
const _: () = assert!(results::WARM_BATCHES == 2);

#[pymethods]
impl ResultArena {
    /// An arena of `capacity` bytes that keeps `warm_batches` batches' worth of free written
    /// pages for the next batches and names the rest for giving back (see `free`).
    #[new]
    #[pyo3(signature = (capacity, warm_batches = 2))]
    fn new(capacity: u64, warm_batches: u64) -> PyResult<Self> {
        results::ResultArena::new(capacity)
            .map(|a| Self(a.with_warm_batches(warm_batches)))
            .py_shm()
    }

    #[getter]
    fn capacity(&self) -> u64 {
        self.0.capacity()
    }

    #[getter]
    fn in_use(&self) -> u64 {
        self.0.in_use()
    }

    /// `(range index, arena offset)` of `n` bytes for the batch being written, or `None` when
    /// nothing free can hold them.
    fn alloc(&mut self, n: u64) -> Option<(usize, u64)> {
        self.0.alloc(n).map(|a| (a.range, a.offset))
    }

    /// `(range index, offset)` when `[offset, offset + n)` was allocated by the batch being
    /// written, else `None`.
    fn owned(&self, offset: u64, n: u64) -> Option<(usize, u64)> {
        self.0.owned(offset, n).map(|a| (a.range, a.offset))
    }

    /// The batch is sent: its ranges `(offset, length)`, busy until freed.
    fn finish(&mut self) -> Vec<(u64, u64)> {
        self.0.finish()
    }

    /// The batch being written is dropped: its ranges are free.
    fn abort(&mut self) {
        self.0.abort()
    }

    /// The training process released the busy range at `offset` (`LoaderError` if none is);
    /// returns the free extents `(offset, length)` whose pages to give back to the system now.
    fn free(&mut self, offset: u64) -> PyResult<Vec<(u64, u64)>> {
        self.0.free(offset).py_shm()
    }

    /// Bytes of the region that hold written pages (busy, or free and kept warm).
    #[getter]
    fn resident(&self) -> u64 {
        self.0.resident()
    }
}

/// The producer process's body: runs the Rust loop of the pass in `spec_path`, without the GIL.
/// Whenever it finds its parent is no longer `owner_pid`, it removes the pass's names and the
/// owner's private directory, and raises `RingClosed`.
#[pyfunction]
pub fn run_producer(py: Python<'_>, spec_path: PathBuf, owner_pid: u64) -> PyResult<()> {
    py.detach(|| producer::run_file(&spec_path, owner_pid))
        .py_shm()
}

/// Makes the kernel SIGKILL this process when its parent exits, then checks that the parent is
/// still `owner_pid` (it may have died before the call).
#[pyfunction]
pub fn set_parent_death_signal(owner_pid: u64) -> PyResult<()> {
    os::kill_me_when_parent_dies().map_err(|e| {
        errors::os_error(
            io_errno(&e),
            format!("prctl(PR_SET_PDEATHSIG) for a loader worker: {e}"),
        )
    })?;
    let parent = os::parent_pid();
    if parent != owner_pid {
        return Err(RingClosed::new_err(format!(
            "this worker's parent (pid {parent}) is not the training process (pid {owner_pid}): \
             the training process is gone, or did not start the worker itself (a forkserver)"
        )));
    }
    Ok(())
}

/// Closes, in a forked loader worker, the descriptors of the training process's verified-sample
/// sets that the fork copied, before any user code runs; returns how many it closed.
#[pyfunction]
pub fn close_inherited_fds() -> usize {
    dataset_rt_core::verify::close_inherited()
}

/// Gives a loader worker process the C allocator settings that keep its freed heap for reuse
/// (unless the environment sets glibc's own); says whether they were applied.
#[pyfunction]
pub fn retain_worker_heap() -> bool {
    lifecycle::retain_worker_heap(|name| std::env::var(name).ok())
}

/// Removes /dev/shm segments left by dead loader owners (never a live one's); returns their names.
#[pyfunction]
pub fn reap_shm_leftovers() -> Vec<String> {
    lifecycle::reap_leftovers()
}

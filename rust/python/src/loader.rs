//! The shared-memory loader's bindings: `LoaderPlan` (epochs, state and the start of each pass,
//! owned by the training process), `RingHandle` (one party's view of a pass's segments), and the
//! entry points of the producer and consumer processes. The protocol lives in `dataset-rt-shm`.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use dataset_rt_core::dataset::{next_epoch, resume_point, State};
use dataset_rt_core::metadata::MetaRef;
use dataset_rt_loader::batch::{decode_metadata, max_sample_bytes, read_batch, slot_size_for};
use dataset_rt_loader::producer::{self, ProducerSpec};
use dataset_rt_loader::{lifecycle, plan};
use dataset_rt_shm::layout::*;
use dataset_rt_shm::private_copy::replace_with_private_copy;
use dataset_rt_shm::results;
use dataset_rt_shm::ring::{Geometry, Heartbeat, Party, Pass, Ring, Role, Ticket};
use dataset_rt_shm::ShmError;
use pyo3::create_exception;
use pyo3::exceptions::{PyFileNotFoundError, PyMemoryError, PyOSError, PyPermissionError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PySlice};

use crate::dataset::{Dataset, SampleMaker};
use crate::errors::{
    self, CacheMalformedError, ConfigError, CorruptRecordError, DatasetRTError, IntoPyResult,
    StateError,
};

create_exception!(
    dataset_rt._native,
    LoaderError,
    DatasetRTError,
    "The shared-memory loader failed: a process died, the producer failed, or a batch does not fit."
);
create_exception!(
    dataset_rt._native,
    WorkerError,
    LoaderError,
    "worker_init_fn, transform or collate_fn raised in a loader worker; the message carries the worker's traceback."
);
create_exception!(
    dataset_rt._native,
    RingClosed,
    LoaderError,
    "The ring was closed (stopped, owner gone, or the producer failed earlier): the party exits."
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("LoaderError", py.get_type::<LoaderError>())?;
    m.add("WorkerError", py.get_type::<WorkerError>())?;
    m.add("RingClosed", py.get_type::<RingClosed>())?;
    m.add_class::<LoaderPlan>()?;
    m.add_class::<RingHandle>()?;
    m.add_class::<ResultArena>()?;
    m.add_function(wrap_pyfunction!(run_producer, m)?)?;
    m.add_function(wrap_pyfunction!(set_parent_death_signal, m)?)?;
    m.add_function(wrap_pyfunction!(reap_shm_leftovers, m)?)?;
    Ok(())
}

fn producer_error(kind: u32, batch: u64, text: &str) -> PyErr {
    let msg = format!("the loader's producer failed at batch {batch}: {text}");
    match kind {
        ERR_IO => PyOSError::new_err(msg),
        ERR_MALFORMED => CacheMalformedError::new_err(msg),
        ERR_CORRUPT_RECORD => CorruptRecordError::new_err(msg),
        ERR_STATE => StateError::new_err(msg),
        _ => LoaderError::new_err(msg),
    }
}

fn shm_err(err: ShmError) -> PyErr {
    let msg = err.to_string();
    match err {
        ShmError::Io { source, .. } => match (source.raw_os_error(), source.kind()) {
            // `OSError(errno, message)` becomes the matching subclass (FileNotFoundError,
            // PermissionError ...) and keeps `errno` (ENOSPC for a full /dev/shm).
            (Some(errno), _) => PyOSError::new_err((errno, msg)),
            (None, std::io::ErrorKind::NotFound) => PyFileNotFoundError::new_err(msg),
            (None, std::io::ErrorKind::PermissionDenied) => PyPermissionError::new_err(msg),
            (None, _) => PyOSError::new_err(msg),
        },
        ShmError::Stopped | ShmError::OwnerGone(_) => RingClosed::new_err(msg),
        ShmError::ProducerFailed { kind, batch, text } => producer_error(kind, batch, &text),
        ShmError::Memory { source, .. } => match source.raw_os_error() {
            Some(errno) => PyOSError::new_err((errno, msg)),
            None => PyOSError::new_err(msg),
        },
        _ => LoaderError::new_err(msg),
    }
}

fn loader_err(err: dataset_rt_loader::Error) -> PyErr {
    match err {
        dataset_rt_loader::Error::Shm(e) => shm_err(e),
        dataset_rt_loader::Error::Core(e) => errors::to_py(e),
        e => LoaderError::new_err(e.to_string()),
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

fn own_pid() -> u64 {
    std::process::id() as u64
}

/// Where the state comes from when no pass is live, and the weight table it was read with.
#[derive(Clone)]
struct Resume {
    epoch: u64,
    position: u64,
    weights_fingerprint: String,
}

/// A pass this plan started: its control segment holds the state.
struct LivePass {
    epoch: u64,
    ring: Arc<Ring>,
    weights_fingerprint: String,
}

/// The progress of the last pass once it ended.
struct EndedPass {
    epoch: u64,
    position: u64,
    finished: bool,
    weights_fingerprint: String,
}

struct PlanControl {
    /// The epoch of the next pass while no pass was committed since `set_epoch` (or creation);
    /// after a pass, the next one reads the epoch after it.
    next_epoch: u64,
    resume: Option<Resume>,
    current: Option<LivePass>,
    last: Option<EndedPass>,
    /// Bumped by `set_epoch` and `load_state_json`: a pass whose start began before such a call
    /// does not overwrite it when it commits.
    generation: u64,
}

impl PlanControl {
    /// (epoch, global start position) of the next pass.
    fn next_pass(&self) -> dataset_rt_core::Result<(u64, u64)> {
        if let Some(r) = &self.resume {
            return Ok((r.epoch, r.position));
        }
        match (&self.current, &self.last) {
            (Some(live), _) => Ok((next_epoch(live.epoch)?, 0)),
            (None, Some(ended)) => Ok((next_epoch(ended.epoch)?, 0)),
            (None, None) => Ok((self.next_epoch, 0)),
        }
    }

    /// (epoch, position, weights fingerprint) the state reports; `None` for the fingerprint:
    /// the dataset's current weight table.
    fn state(&self) -> dataset_rt_core::Result<(u64, u64, Option<String>)> {
        if let Some(r) = &self.resume {
            return Ok((r.epoch, r.position, Some(r.weights_fingerprint.clone())));
        }
        let (epoch, position, finished, fingerprint) = match (&self.current, &self.last) {
            (Some(live), _) => {
                let (e, p, f) = live.ring.progress();
                (e, p, f, &live.weights_fingerprint)
            }
            (None, Some(ended)) => (
                ended.epoch,
                ended.position,
                ended.finished,
                &ended.weights_fingerprint,
            ),
            (None, None) => return Ok((self.next_epoch, 0, None)),
        };
        let (epoch, position) = resume_point(epoch, position, finished)?;
        Ok((epoch, position, Some(fingerprint.clone())))
    }
}

/// Epochs, iterator state and pass creation of one `DataLoader` (training process only).
///
/// `control` is a std mutex taken by GIL-holding code: it is never held across `py.detach`
/// (nor anything that waits), so a thread blocked on it cannot deadlock one that needs the GIL.
#[pyclass(module = "dataset_rt._native", frozen)]
pub struct LoaderPlan {
    dataset: Py<Dataset>,
    batch_size: u64,
    drop_last: bool,
    /// Threads of the producer's read-ahead pool.
    producer_threads: usize,
    control: Mutex<PlanControl>,
    /// The most bytes one sample takes in a slot (the largest record of each cache, verified),
    /// computed on the first pass that sizes its slots from the data.
    max_sample_bytes: OnceLock<u64>,
}

impl LoaderPlan {
    fn batches(&self, samples: u64) -> u64 {
        if self.drop_last {
            samples / self.batch_size
        } else {
            samples.div_ceil(self.batch_size)
        }
    }

    /// The pass that reads `epoch` from global position `start` with `consumers` workers.
    fn pass_at(
        &self,
        inner: &dataset_rt_core::dataset::Dataset,
        opts: &dataset_rt_core::dataset::ReadOptions,
        epoch: u64,
        start: u64,
        consumers: u32,
    ) -> Pass {
        let epoch_len = inner.epoch_len(opts);
        let rank_samples = opts.split().rank_len(epoch_len, start);
        Pass {
            total_batches: self.batches(rank_samples),
            batch_size: self.batch_size,
            rank_samples,
            epoch,
            start,
            epoch_len,
            rank: opts.rank,
            world_size: opts.world_size,
            policy: plan::policy_word(opts.policy),
            expected_attach: 1 + consumers,
        }
    }

    /// The producer's parameters for the dataset as it reads now (no segment name, no weights
    /// file yet).
    fn spec(
        &self,
        inner: &dataset_rt_core::dataset::Dataset,
        opts: &dataset_rt_core::dataset::ReadOptions,
        weights: &dataset_rt_core::dataset::WeightTable,
        persistent: bool,
    ) -> ProducerSpec {
        ProducerSpec {
            ctl_name: String::new(),
            cache_dirs: inner.caches.iter().map(|c| c.dir.clone()).collect(),
            fingerprint: inner.fingerprint().to_owned(),
            weights_fingerprint: weights.fingerprint.clone(),
            weights_file: None,
            seed: opts.seed,
            shuffle: opts.shuffle,
            epoch_len: opts.epoch_len,
            prefetch_size: opts.prefetch_size,
            verify: inner.verify_policy(),
            threads: self.producer_threads,
            persistent,
        }
    }
}

/// The most producer threads a loader takes: beyond it threads only contend for the disk.
const MAX_PRODUCER_THREADS: u64 = 256;

/// The producer threads of a loader that names none: `min(4, available cores)`.
fn default_producer_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(4))
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
            None => default_producer_threads(),
            Some(n @ 1..=MAX_PRODUCER_THREADS) => n as usize,
            Some(n) => {
                return Err(ConfigError::new_err(format!(
                    "invalid {field}: {n} threads is above the limit of {MAX_PRODUCER_THREADS}; \
                     None uses min(4, available cores)"
                )))
            }
        };
        Ok(LoaderPlan {
            dataset,
            batch_size,
            drop_last,
            producer_threads,
            control: Mutex::new(PlanControl {
                next_epoch: 0,
                resume: None,
                current: None,
                last: None,
                generation: 0,
            }),
            max_sample_bytes: OnceLock::new(),
        })
    }

    /// Threads of the producer's read-ahead pool.
    #[getter]
    fn producer_threads(&self) -> usize {
        self.producer_threads
    }

    /// Batches in a full epoch of this rank.
    fn __len__(&self) -> usize {
        let (inner, opts, _) = self.dataset.get().reading();
        self.batches(inner.rank_len(&opts)) as usize
    }

    /// Fixes the epoch of the next pass; the state now describes that epoch's start (a loaded
    /// state's position and the last pass's progress are dropped), as `Dataset.set_epoch`.
    fn set_epoch(&self, epoch: i64) -> PyResult<()> {
        let epoch = u64::try_from(epoch)
            .map_err(|_| ConfigError::new_err(format!("invalid epoch {epoch}: must be >= 0")))?;
        let mut control = self.control.lock().unwrap();
        control.next_epoch = epoch;
        control.resume = None;
        control.current = None;
        control.last = None;
        control.generation += 1;
        Ok(())
    }

    /// The dataset's state format at what the training loop received: read from the live
    /// pass's control segment, with the weight table that pass reads.
    fn state_json(&self) -> PyResult<String> {
        let (epoch, position, fingerprint) = self.control.lock().unwrap().state().py_err()?;
        let (inner, opts, weights) = self.dataset.get().reading();
        let mut state = inner.state(&opts, &weights, epoch, position);
        if let Some(fingerprint) = fingerprint {
            state.weights_fingerprint = fingerprint;
        }
        Ok(state.to_json())
    }

    /// Makes the next pass resume at the exact next sample of the state (any batch size,
    /// worker count or world size).
    fn load_state_json(&self, text: &str) -> PyResult<()> {
        let state = State::from_json(text).py_err()?;
        let (inner, opts, weights) = self.dataset.get().reading();
        let (epoch, position) = inner.check_state(&state, &opts, &weights).py_err()?;
        let mut control = self.control.lock().unwrap();
        control.resume = Some(Resume {
            epoch,
            position,
            weights_fingerprint: weights.fingerprint.clone(),
        });
        control.next_epoch = epoch;
        control.generation += 1;
        Ok(())
    }

    /// Creates the segments and the private directory of the next pass (each locked by this
    /// process, see `dataset_rt_core::liveness`) and writes the producer's spec (and weights)
    /// into that directory; returns the owner's handle. `slot_size=None` sizes slots from the data:
    /// a batch of the largest samples fits. Nothing of the plan changes until `commit_pass`:
    /// a start that fails on the way consumes no loaded state and advances no epoch.
    #[pyo3(signature = (num_slots, slot_size, num_consumers, persistent=false))]
    fn start_pass(
        &self,
        py: Python<'_>,
        num_slots: u32,
        slot_size: Option<u64>,
        num_consumers: u32,
        persistent: bool,
    ) -> PyResult<RingHandle> {
        let (inner, opts, weights) = self.dataset.get().reading();
        let (epoch, start, generation) = {
            let control = self.control.lock().unwrap();
            let (epoch, start) = control.next_pass().py_err()?;
            (epoch, start, control.generation)
        };
        let slot_size = match slot_size {
            Some(bytes) => align(bytes.max(1), PAGE),
            None => {
                let max_sample = match self.max_sample_bytes.get() {
                    Some(&bytes) => bytes,
                    None => {
                        // A corrupt largest record raises here, before any ring is sized.
                        let bytes = py.detach(|| max_sample_bytes(&inner)).py_shm()?;
                        *self.max_sample_bytes.get_or_init(|| bytes)
                    }
                };
                slot_size_for(max_sample, self.batch_size)
            }
        };
        let geometry = Geometry {
            num_slots,
            slot_size,
            max_consumers: num_consumers.max(1),
        };
        let pass = self.pass_at(&inner, &opts, epoch, start, num_consumers);
        let ring = Arc::new(
            py.detach(|| lifecycle::create_ring(own_pid(), geometry, pass))
                .py_shm()?,
        );
        let private_dir = lifecycle::private_dir(&ring);
        let mut spec = self.spec(&inner, &opts, &weights, persistent);
        spec.ctl_name = ring.ctl_name().to_owned();
        let written = py.detach(|| -> dataset_rt_loader::Result<()> {
            if let Some(w) = &weights.weights {
                let path = private_dir.join("weights.f64");
                producer::write_weights(&path, w)?;
                spec.weights_file = Some(path);
            }
            let path = private_dir.join("spec.json");
            std::fs::write(&path, serde_json::to_vec(&spec).expect("plain data")).map_err(
                |source| {
                    ShmError::Io {
                        op: "write",
                        path,
                        source,
                    }
                    .into()
                },
            )
        });
        if let Err(e) = written {
            ring.unlink();
            return Err(loader_err(e));
        }
        Ok(RingHandle::owner(
            ring,
            OwnerPass {
                generation,
                epoch,
                weights_fingerprint: weights.fingerprint,
                samples: self.dataset.get().sample_maker(),
                spec,
            },
        ))
    }

    /// Starts the next pass on the segments of `ring`, a persistent pipeline whose previous pass
    /// was fully delivered and ended (`end_pass`): the producer and the consumers waiting on
    /// them take it up. Returns the owner's handle of the new pass (commit it as `start_pass`'s),
    /// or `None` when the pipeline cannot read it (the weight table or the reading options
    /// changed since it started): the caller then starts a fresh pipeline. Raises `LoaderError`
    /// when the segments refuse a next pass (an error, a stop, a pass not over).
    fn restart_pass(&self, py: Python<'_>, ring: &RingHandle) -> PyResult<Option<RingHandle>> {
        let Some(previous) = &ring.owner else {
            return Err(LoaderError::new_err(
                "restart_pass needs the owner's handle",
            ));
        };
        let (inner, opts, weights) = self.dataset.get().reading();
        let mut spec = self.spec(&inner, &opts, &weights, true);
        spec.ctl_name = previous.spec.ctl_name.clone();
        spec.weights_file = previous.spec.weights_file.clone();
        if spec != previous.spec {
            return Ok(None);
        }
        let (epoch, start, generation) = {
            let control = self.control.lock().unwrap();
            let (epoch, start) = control.next_pass().py_err()?;
            (epoch, start, control.generation)
        };
        let consumers = ring.ring.pass().expected_attach.saturating_sub(1);
        let pass = self.pass_at(&inner, &opts, epoch, start, consumers);
        py.detach(|| ring.ring.begin_next_pass(pass)).py_shm()?;
        Ok(Some(RingHandle::owner(
            ring.ring.clone(),
            OwnerPass {
                generation,
                epoch,
                weights_fingerprint: weights.fingerprint,
                samples: self.dataset.get().sample_maker(),
                spec,
            },
        )))
    }

    /// Makes a started pass the live one, once all its processes are running: the state reads
    /// from its control segment, a loaded state is used up and the next pass reads the next
    /// epoch. A `set_epoch` or `load_state_json` since `start_pass` wins over it.
    fn commit_pass(&self, ring: &RingHandle) -> PyResult<()> {
        let Some(owner) = &ring.owner else {
            return Err(LoaderError::new_err("commit_pass needs the owner's handle"));
        };
        let mut control = self.control.lock().unwrap();
        if control.generation != owner.generation {
            return Ok(());
        }
        control.resume = None;
        control.current = Some(LivePass {
            epoch: owner.epoch,
            ring: ring.ring.clone(),
            weights_fingerprint: owner.weights_fingerprint.clone(),
        });
        control.last = None;
        Ok(())
    }

    /// Ends the pass of `ring` if it is the live one: keeps its progress for `state_json` and
    /// drops its mappings.
    fn end_pass(&self, ring: &RingHandle) {
        let mut control = self.control.lock().unwrap();
        if control
            .current
            .as_ref()
            .is_some_and(|live| Arc::ptr_eq(&live.ring, &ring.ring))
        {
            let live = control.current.take().expect("checked above");
            let (epoch, position, finished) = live.ring.progress();
            control.last = Some(EndedPass {
                epoch,
                position,
                finished,
                weights_fingerprint: live.weights_fingerprint,
            });
        }
    }
}

/// What the owner's handle remembers of the plan it was started from.
struct OwnerPass {
    generation: u64,
    epoch: u64,
    weights_fingerprint: String,
    /// Makes the samples of the batches the training process takes itself (`num_workers=0`).
    samples: SampleMaker,
    /// The producer's parameters: a persistent pipeline reads a next pass only with the same.
    spec: ProducerSpec,
}

/// One party's view of a pass's segments.
#[pyclass(module = "dataset_rt._native", frozen)]
pub struct RingHandle {
    ring: Arc<Ring>,
    role: Role,
    consumer: Option<usize>,
    /// A consumer's heartbeat thread, from attach until `retire`.
    heartbeat: Mutex<Option<Heartbeat>>,
    /// The generation of the last pass `take_ticket` found over (`wait_next_pass` waits past it).
    last_generation: AtomicU32,
    /// The owner's handle: what `commit_pass` needs.
    owner: Option<OwnerPass>,
}

impl RingHandle {
    /// The training process's handle of a pass it started on `ring`.
    fn owner(ring: Arc<Ring>, owner: OwnerPass) -> Self {
        RingHandle {
            ring,
            role: Role::Owner,
            consumer: None,
            heartbeat: Mutex::new(None),
            last_generation: AtomicU32::new(0),
            owner: Some(owner),
        }
    }
}

#[pymethods]
impl RingHandle {
    /// Attaches a consumer process by the control segment's name (checks magic, version and
    /// geometry) and starts its heartbeat thread, which proves the process alive while user
    /// code runs. Call `mark_attached` once the ring is mapped on the Python side too.
    #[staticmethod]
    fn attach(py: Python<'_>, ctl_name: &str, consumer: usize) -> PyResult<RingHandle> {
        let ring = Arc::new(py.detach(|| lifecycle::attach(ctl_name)).py_shm()?);
        ring.register_consumer(consumer, own_pid()).py_shm()?;
        let heartbeat = ring.keep_alive(Party::Consumer(consumer)).py_shm()?;
        Ok(RingHandle {
            ring,
            role: Role::Child,
            consumer: Some(consumer),
            heartbeat: Mutex::new(Some(heartbeat)),
            last_generation: AtomicU32::new(0),
            owner: None,
        })
    }

    /// A consumer is done with the pass: stops its heartbeat thread and tells the owner not to
    /// watch it any more.
    fn retire(&self, py: Python<'_>) {
        let heartbeat = self.heartbeat.lock().unwrap().take();
        py.detach(|| drop(heartbeat)); // joins the thread
        if let Some(i) = self.consumer {
            self.ring.finished(Party::Consumer(i));
        }
    }

    /// The parties silent for more than `bound` seconds, producer first: `(worker index, or
    /// None for the producer, seconds silent)`. Finished parties are not listed.
    fn stalls(&self, bound: f64) -> Vec<(Option<usize>, f64)> {
        self.ring
            .stalls(Duration::from_secs_f64(bound.max(0.0)))
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

    /// The producer's spec file in the owner's private directory.
    #[getter]
    fn spec_path(&self) -> String {
        let path = lifecycle::private_dir(&self.ring).join("spec.json");
        path.to_string_lossy().into_owned() // an ASCII name under /dev/shm
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
        let timeout = Duration::from_secs_f64(timeout.max(0.0));
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

    /// Waits up to `timeout` seconds for batch `ticket` and takes it: (slot offset in the ring
    /// segment, bytes used, [(offset in the slot, length, metadata dict) per sample]), or `None`
    /// when it is not ready yet.
    /// Raises `RingClosed` when this party must exit, or the producer's error (owner).
    #[allow(clippy::type_complexity)]
    fn wait_batch<'py>(
        &self,
        py: Python<'py>,
        ticket: u64,
        timeout: f64,
    ) -> PyResult<Option<(u64, u64, Vec<(u64, u64, Bound<'py, PyDict>)>)>> {
        let timeout = Duration::from_secs_f64(timeout.max(0.0));
        let ring = &self.ring;
        let taken = py.detach(|| ring.wait_ready(ticket, timeout, self.role, self.consumer));
        let taken = match (taken, self.role) {
            (Err(ShmError::ProducerFailed { .. }), Role::Child) => {
                return Err(RingClosed::new_err("the producer failed"))
            }
            (other, _) => other.py_shm()?,
        };
        if !taken {
            return Ok(None);
        }
        let slot = ring.slot(ticket);
        let base = ring.slot_offset(ticket);
        let entries = read_batch(slot, ticket).py_shm()?;
        let mut out = Vec::with_capacity(entries.len());
        for e in entries {
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
            out.push((e.data_off, e.data_len, dict));
        }
        let used = u64::from_le_bytes(slot[B_USED..B_USED + 8].try_into().expect("8 bytes"));
        Ok(Some((base, used, out)))
    }

    /// The training process's own take of batch `ticket` (`num_workers=0`, owner only): waits up
    /// to `timeout` seconds for it and takes it, maps its slot (`mmap.mmap` of the used bytes of
    /// the ring file `fd`, `ACCESS_READ`) and returns `(map, samples)`: one `CachedSample` per
    /// sample, its `data` a slice of `memoryview(map)` (no copy), its metadata built on first
    /// access. `None` when the batch is not ready yet; raises as `wait_batch` does.
    #[allow(clippy::type_complexity)]
    fn take_batch<'py>(
        &self,
        py: Python<'py>,
        ticket: u64,
        timeout: f64,
        fd: i32,
    ) -> PyResult<Option<(Bound<'py, PyAny>, Bound<'py, PyList>)>> {
        let Some(owner) = &self.owner else {
            return Err(LoaderError::new_err("take_batch needs the owner's handle"));
        };
        let timeout = Duration::from_secs_f64(timeout.max(0.0));
        let ring = &self.ring;
        if !py
            .detach(|| ring.wait_ready(ticket, timeout, self.role, self.consumer))
            .py_shm()?
        {
            return Ok(None);
        }
        let slot = ring.slot(ticket);
        let entries = read_batch(slot, ticket).py_shm()?;
        let used = u64::from_le_bytes(slot[B_USED..B_USED + 8].try_into().expect("8 bytes"));
        let mmap = py.import("mmap")?;
        let kwargs = PyDict::new(py);
        kwargs.set_item("offset", ring.slot_offset(ticket))?;
        kwargs.set_item("access", mmap.getattr("ACCESS_READ")?)?;
        let map = match mmap.getattr("mmap")?.call((fd, used), Some(&kwargs)) {
            Ok(map) => map,
            Err(e) if is_enomem(py, &e) => {
                return Err(PyMemoryError::new_err(format!(
                    "mapping the ring slot of batch {ticket} failed: {e}. The process is out \
                     of memory or of mappings: each batch the training loop keeps holds its \
                     bytes and is one mapping, and Linux allows a process vm.max_map_count of \
                     them (65,530 by default): keep fewer batches, or copy what must be kept \
                     (bytes(sample.data))"
                )))
            }
            Err(e) => return Err(e),
        };
        let whole = py
            .import("builtins")?
            .getattr("memoryview")?
            .call1((&map,))?;
        let samples = PyList::empty(py);
        for (i, e) in entries.iter().enumerate() {
            // read_batch checked that every payload lies within the used bytes.
            let slice = PySlice::new(
                py,
                e.data_off as isize,
                (e.data_off + e.data_len) as isize,
                1,
            );
            let data = whole.get_item(slice)?.unbind();
            let sample = owner.samples.sample(data, e.cache, e.row).ok_or_else(|| {
                shm_err(ShmError::Protocol(format!(
                    "slot of batch {ticket}: sample {i} names row {} of cache {}, which this \
                     dataset does not have",
                    e.row, e.cache
                )))
            })?;
            samples.append(sample)?;
        }
        Ok(Some((map, samples)))
    }

    /// Gives batch `ticket`'s slot back to the producer (after every view of it was released).
    fn release(&self, ticket: u64) -> PyResult<()> {
        self.ring.release(ticket, self.consumer).py_shm()
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
        self.ring.release(ticket, self.consumer).py_shm()
    }

    /// Records that the training loop received batch `seq`; the state moves past it.
    fn mark_delivered(&self, seq: u64) -> PyResult<()> {
        plan::mark_delivered(&self.ring, seq).py_shm()
    }

    /// Raises the producer's error if it affects batch `seq` or an earlier one.
    fn check_error(&self, seq: u64) -> PyResult<()> {
        match self.ring.error() {
            Some((kind, batch, text)) if batch <= seq => Err(producer_error(kind, batch, &text)),
            _ => Ok(()),
        }
    }

    /// The producer's recorded error text, if any (whatever batch it affects).
    fn error_text(&self) -> Option<String> {
        self.ring
            .error()
            .map(|(_, batch, text)| format!("batch {batch}: {text}"))
    }
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

#[pymethods]
impl ResultArena {
    #[new]
    fn new(capacity: u64) -> PyResult<Self> {
        results::ResultArena::new(capacity).map(Self).py_shm()
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

    /// The training process released the busy range at `offset` (`LoaderError` if none is).
    fn free(&mut self, offset: u64) -> PyResult<()> {
        self.0.free(offset).py_shm()
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
    #[cfg(target_os = "linux")]
    // SAFETY: plain prctl with integer arguments.
    unsafe {
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            libc::SIGKILL as libc::c_ulong,
            0,
            0,
            0,
        );
    }
    // SAFETY: getppid cannot fail.
    let parent = unsafe { libc::getppid() } as u64;
    if parent != owner_pid {
        return Err(RingClosed::new_err(format!(
            "this worker's parent (pid {parent}) is not the training process (pid {owner_pid}): \
             the training process is gone, or did not start the worker itself (a forkserver)"
        )));
    }
    Ok(())
}

/// Removes /dev/shm segments left by dead loader owners (never a live one's); returns their names.
#[pyfunction]
pub fn reap_shm_leftovers() -> Vec<String> {
    lifecycle::reap_leftovers()
}

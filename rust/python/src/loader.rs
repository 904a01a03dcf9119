//! The shared-memory loader's bindings: `LoaderPlan` (epochs, state and the start of each pass,
//! owned by the training process), `RingHandle` (one party's view of a pass's segments), and the
//! entry points of the producer and consumer processes. The protocol lives in `dataset-rt-shm`.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use dataset_rt_core::dataset::State;
use dataset_rt_core::metadata::MetaRef;
use dataset_rt_shm::batch::{decode_metadata, read_batch};
use dataset_rt_shm::layout::*;
use dataset_rt_shm::producer::{self, ProducerSpec};
use dataset_rt_shm::ring::{Geometry, Pass, Ring, Role};
use dataset_rt_shm::{segment, ShmError};
use pyo3::create_exception;
use pyo3::exceptions::{PyFileNotFoundError, PyOSError, PyPermissionError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::dataset::Dataset;
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
    "transform or collate_fn raised in a loader worker; the message carries the worker's traceback."
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
        ShmError::Io { source, .. } => match source.kind() {
            std::io::ErrorKind::NotFound => PyFileNotFoundError::new_err(msg),
            std::io::ErrorKind::PermissionDenied => PyPermissionError::new_err(msg),
            _ => PyOSError::new_err(msg),
        },
        ShmError::Core(e) => errors::to_py(e),
        ShmError::Stopped | ShmError::OwnerGone(_) => RingClosed::new_err(msg),
        ShmError::ProducerFailed { kind, batch, text } => producer_error(kind, batch, &text),
        _ => LoaderError::new_err(msg),
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

fn own_pid() -> u64 {
    std::process::id() as u64
}

struct PlanControl {
    next_epoch: u64,
    resume: Option<(u64, u64)>,
    /// The live pass: its control segment holds the state.
    current: Option<Arc<Ring>>,
    /// (epoch, position, finished) of the last pass, once it ended.
    last: Option<(u64, u64, bool)>,
}

/// Epochs, iterator state and pass creation of one `DataLoader` (training process only).
#[pyclass(module = "dataset_rt._native", frozen)]
pub struct LoaderPlan {
    dataset: Py<Dataset>,
    batch_size: u64,
    drop_last: bool,
    control: Mutex<PlanControl>,
}

impl LoaderPlan {
    fn batches(&self, samples: u64) -> u64 {
        if self.drop_last {
            samples / self.batch_size
        } else {
            samples.div_ceil(self.batch_size)
        }
    }

    fn position(control: &PlanControl) -> (u64, u64) {
        if let Some(resume) = control.resume {
            return resume;
        }
        let progress = control
            .current
            .as_ref()
            .map(|r| r.progress())
            .or(control.last);
        match progress {
            Some((epoch, _, true)) => (epoch + 1, 0),
            Some((epoch, position, false)) => (epoch, position),
            None => (control.next_epoch, 0),
        }
    }
}

#[pymethods]
impl LoaderPlan {
    #[new]
    fn new(dataset: Py<Dataset>, batch_size: u64, drop_last: bool) -> PyResult<Self> {
        if batch_size == 0 {
            return Err(ConfigError::new_err(
                "invalid DataLoader.batch_size: must be at least 1",
            ));
        }
        Ok(LoaderPlan {
            dataset,
            batch_size,
            drop_last,
            control: Mutex::new(PlanControl {
                next_epoch: 0,
                resume: None,
                current: None,
                last: None,
            }),
        })
    }

    /// Batches in a full epoch of this rank.
    fn __len__(&self) -> usize {
        let (inner, opts, _) = self.dataset.get().reading();
        self.batches(inner.rank_len(&opts)) as usize
    }

    /// Fixes the epoch of the next pass (and drops a loaded state's position).
    fn set_epoch(&self, epoch: u64) {
        let mut control = self.control.lock().unwrap();
        control.next_epoch = epoch;
        control.resume = None;
    }

    /// The dataset's state format at what the training loop received: read from the live
    /// pass's control segment.
    fn state_json(&self) -> String {
        let (inner, opts, weights) = self.dataset.get().reading();
        let (epoch, position) = Self::position(&self.control.lock().unwrap());
        inner.state(&opts, &weights, epoch, position).to_json()
    }

    /// Makes the next pass resume at the exact next sample of the state (any batch size,
    /// worker count or world size).
    fn load_state_json(&self, text: &str) -> PyResult<()> {
        let state = State::from_json(text).py_err()?;
        let (inner, opts, weights) = self.dataset.get().reading();
        let (epoch, position) = inner.check_state(&state, &opts, &weights).py_err()?;
        let mut control = self.control.lock().unwrap();
        control.resume = Some((epoch, position));
        control.next_epoch = epoch;
        Ok(())
    }

    /// Creates the segments of the next pass and writes the producer's spec (and weights) into
    /// `private_dir`; returns the owner's handle.
    fn start_pass(
        &self,
        py: Python<'_>,
        private_dir: PathBuf,
        num_slots: u32,
        slot_size: u64,
        num_consumers: u32,
    ) -> PyResult<RingHandle> {
        let (inner, opts, weights) = self.dataset.get().reading();
        let mut control = self.control.lock().unwrap();
        let (epoch, start) = control.resume.take().unwrap_or((control.next_epoch, 0));
        control.next_epoch = epoch + 1;
        let epoch_len = inner.epoch_len(&opts);
        let rank_samples = opts.split().rank_len(epoch_len, start);
        let geometry = Geometry {
            num_slots,
            slot_size: align(slot_size.max(1), PAGE),
            max_consumers: num_consumers.max(1),
        };
        let pass = Pass {
            total_batches: self.batches(rank_samples),
            batch_size: self.batch_size,
            rank_samples,
            epoch,
            start,
            epoch_len,
            rank: opts.rank,
            world_size: opts.world_size,
            policy: opts.policy,
            expected_attach: 1 + num_consumers,
        };
        let ring = Arc::new(
            py.detach(|| Ring::create(own_pid(), geometry, pass))
                .py_shm()?,
        );
        let written = py.detach(|| -> dataset_rt_shm::Result<()> {
            let weights_file = match &weights.weights {
                Some(w) => {
                    let path = private_dir.join("weights.f64");
                    producer::write_weights(&path, w)?;
                    Some(path)
                }
                None => None,
            };
            let spec = ProducerSpec {
                ctl_name: ring.ctl_name().to_owned(),
                cache_dirs: inner.caches.iter().map(|c| c.dir.clone()).collect(),
                fingerprint: inner.fingerprint().to_owned(),
                weights_fingerprint: weights.fingerprint.clone(),
                weights_file,
                seed: opts.seed,
                shuffle: opts.shuffle,
                epoch_len: opts.epoch_len,
            };
            let path = private_dir.join("spec.json");
            std::fs::write(&path, serde_json::to_vec(&spec).expect("plain data")).map_err(
                |source| ShmError::Io {
                    op: "write",
                    path,
                    source,
                },
            )
        });
        if let Err(e) = written {
            ring.unlink();
            return Err(shm_err(e));
        }
        control.current = Some(ring.clone());
        control.last = None;
        Ok(RingHandle {
            ring,
            role: Role::Owner,
            consumer: None,
        })
    }

    /// Ends the live pass: keeps its progress for `state_json` and drops its mappings.
    fn end_pass(&self) {
        let mut control = self.control.lock().unwrap();
        if let Some(ring) = control.current.take() {
            control.last = Some(ring.progress());
        }
    }
}

/// One party's view of a pass's segments.
#[pyclass(module = "dataset_rt._native", frozen)]
pub struct RingHandle {
    ring: Arc<Ring>,
    role: Role,
    consumer: Option<usize>,
}

#[pymethods]
impl RingHandle {
    /// Attaches a consumer process by the control segment's name (checks magic, version and
    /// geometry). Call `mark_attached` once the ring is mapped on the Python side too.
    #[staticmethod]
    fn attach(py: Python<'_>, ctl_name: &str, consumer: usize) -> PyResult<RingHandle> {
        let ring = py.detach(|| Ring::attach(ctl_name)).py_shm()?;
        ring.register_consumer(consumer, own_pid()).py_shm()?;
        Ok(RingHandle {
            ring: Arc::new(ring),
            role: Role::Child,
            consumer: Some(consumer),
        })
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

    /// Removes both names from /dev/shm; every mapping stays valid.
    fn unlink(&self) {
        self.ring.unlink();
    }

    /// Tells every party to exit and wakes them.
    fn stop(&self) {
        self.ring.stop();
    }

    fn take_ticket(&self) -> Option<u64> {
        self.ring.take_ticket()
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

    /// Gives batch `ticket`'s slot back to the producer (after every view of it was released).
    fn release(&self, ticket: u64) -> PyResult<()> {
        self.ring.release(ticket, self.consumer).py_shm()
    }

    /// Records that the training loop received batch `seq`; the state moves past it.
    fn mark_delivered(&self, seq: u64) -> PyResult<()> {
        self.ring.mark_delivered(seq).py_shm()
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

/// The producer process's body: runs the Rust loop of the pass in `spec_path`, without the GIL.
#[pyfunction]
pub fn run_producer(py: Python<'_>, spec_path: PathBuf) -> PyResult<()> {
    let text = std::fs::read(&spec_path)
        .map_err(|e| PyOSError::new_err(format!("read {}: {e}", spec_path.display())))?;
    let spec: ProducerSpec = serde_json::from_slice(&text).map_err(|e| {
        LoaderError::new_err(format!("{}: not a producer spec: {e}", spec_path.display()))
    })?;
    py.detach(|| producer::run(&spec)).py_shm()
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
            "the training process (pid {owner_pid}) is gone"
        )));
    }
    Ok(())
}

/// Removes /dev/shm segments left by dead loader owners (never a live one's); returns their names.
#[pyfunction]
pub fn reap_shm_leftovers() -> Vec<String> {
    segment::reap_leftovers()
}

//! The pass plan of one `DataLoader` (training process only): its epochs and iterator state
//! (the core's [`Passes`] state machine over the passes it started), and for each pass what
//! it reads (epoch, start, rank split, batches), the ring's slot count and slot size, and the
//! producer's parameters, carried together by one [`PassPlan`].

use std::sync::{Arc, Mutex, OnceLock};

use dataset_rt_core::dataset::{Dataset, ReadOptions, WeightTable};
use dataset_rt_core::passes::{self, LiveProgress, PassStart, Passes};
use dataset_rt_core::session::check_epoch;
use dataset_rt_shm::layout::{align, PAGE};
use dataset_rt_shm::ring::{Geometry, Pass, Ring};
use dataset_rt_shm::ShmError;

use crate::batch::{max_sample_bytes, slot_size_for};
use crate::lifecycle;
pub use crate::pass::{check_split, mark_delivered, policy_word, position_after, split_of};
use crate::producer::{self, ProducerSpec, SharedVerified};
use crate::shards::ShardTable;
use crate::{protocol, Result};

/// The most producer threads a loader takes: beyond it threads only contend for the disk.
pub const MAX_PRODUCER_THREADS: u64 = 256;

/// The producer threads of a loader that names none: `min(4, available cores)`.
pub fn default_producer_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get().min(4))
}

/// The ring slots of a pass with `workers` consumers: `prefetch_factor` per worker, at least 2;
/// with no worker, one more for the batch the training loop still holds while it asks for the
/// next.
pub fn num_slots(workers: u32, prefetch_factor: u32) -> Result<u32> {
    let slots =
        (u64::from(workers.max(1)) * u64::from(prefetch_factor)).max(2) + u64::from(workers == 0);
    u32::try_from(slots).map_err(|_| {
        protocol(format!(
            "{slots} ring slots is more than a ring holds: lower prefetch_factor or num_workers"
        ))
    })
}

/// Everything one pass is made of, decided in one place ([`Plan::plan_pass`]): where it
/// starts in the state machine, what the transport carries, the ring's shape, and what the
/// producer reads.
#[derive(Clone, Debug, PartialEq)]
pub struct PassPlan {
    pub start: PassStart,
    pub pass: Pass,
    pub geometry: Geometry,
    /// The producer's parameters (its `ctl_name` and `weights_file` are set when the
    /// segments exist).
    pub spec: ProducerSpec,
    pub weights_fingerprint: String,
}

/// A pass this plan started: its control segment holds its progress.
pub struct LivePass(pub Arc<Ring>);

impl LiveProgress for LivePass {
    fn progress(&self) -> passes::Progress {
        let (epoch, position, finished) = self.0.progress();
        passes::Progress {
            epoch,
            position,
            finished,
        }
    }
}

/// The rules of one loader: batches per pass, ring shape, and its epoch/pass state.
///
/// `passes` is a std mutex never held across anything that waits.
pub struct Plan {
    batch_size: u64,
    drop_last: bool,
    producer_threads: usize,
    passes: Mutex<Passes<LivePass>>,
    /// The most bytes one sample takes in a slot (the largest record of each cache, verified),
    /// computed on the first pass that sizes its slots from the data.
    max_sample_bytes: OnceLock<u64>,
}

impl Plan {
    /// `batch_size` is at least 1 and `producer_threads` within 1..=[`MAX_PRODUCER_THREADS`]
    /// (the bindings say which option is wrong).
    pub fn new(batch_size: u64, drop_last: bool, producer_threads: usize) -> Plan {
        assert!(batch_size >= 1 && producer_threads >= 1);
        Plan {
            batch_size,
            drop_last,
            producer_threads,
            passes: Mutex::new(Passes::new()),
            max_sample_bytes: OnceLock::new(),
        }
    }

    pub fn producer_threads(&self) -> usize {
        self.producer_threads
    }

    /// Batches in a pass of `samples` of this rank's samples.
    pub fn batches(&self, samples: u64) -> u64 {
        if self.drop_last {
            samples / self.batch_size
        } else {
            samples.div_ceil(self.batch_size)
        }
    }

    /// Batches in a full epoch of this rank.
    pub fn len(&self, ds: &Dataset, opts: &ReadOptions) -> u64 {
        self.batches(ds.rank_len(opts))
    }

    /// The slot size of a pass: `requested` rounded up to a page, or, when `None`, one that
    /// holds a batch of the largest samples (reads and verifies the largest record of each
    /// cache once, so a corrupt one raises here, before any ring is sized). A batch holds at
    /// most the samples one rank reads in an epoch under `opts`, whatever `batch_size` says.
    pub fn slot_size(
        &self,
        ds: &Dataset,
        opts: &ReadOptions,
        requested: Option<u64>,
    ) -> Result<u64> {
        // The first step of a pass's start: an index cut short since the open is refused
        // before an entry of it is read (here, or by the producer).
        ds.check_index_sizes()?;
        if let Some(bytes) = requested {
            return Ok(align(bytes.max(1), PAGE));
        }
        let max_sample = match self.max_sample_bytes.get() {
            Some(&bytes) => bytes,
            None => {
                let bytes = max_sample_bytes(ds)?;
                *self.max_sample_bytes.get_or_init(|| bytes)
            }
        };
        let rank_samples = opts.split().rank_len(ds.epoch_len(opts), 0);
        Ok(slot_size_for(
            max_sample,
            self.batch_size.min(rank_samples.max(1)),
        ))
    }

    /// The pass that reads `epoch` from global position `start` with `consumers` workers.
    pub fn pass_at(
        &self,
        ds: &Dataset,
        opts: &ReadOptions,
        epoch: u64,
        start: u64,
        consumers: u32,
    ) -> Pass {
        let epoch_len = ds.epoch_len(opts);
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
            policy: policy_word(opts.policy),
            expected_attach: 1 + consumers,
        }
    }

    /// The producer's parameters for the dataset as it reads now (no segment name, no weights
    /// file yet).
    pub fn spec(
        &self,
        ds: &Dataset,
        opts: &ReadOptions,
        weights: &WeightTable,
        persistent: bool,
    ) -> Result<ProducerSpec> {
        Ok(ProducerSpec {
            ctl_name: String::new(),
            cache_dirs: ds.caches.iter().map(|c| c.dir.clone()).collect(),
            remote: ds
                .caches
                .iter()
                .map(|c| c.records().map(|r| r.locator()))
                .collect(),
            shards: ShardTable::of(ds)?,
            fingerprint: ds.fingerprint().to_owned(),
            cache_fingerprints: ds
                .caches
                .iter()
                .map(|c| c.manifest.fingerprint.clone())
                .collect(),
            weights_fingerprint: weights.fingerprint.clone(),
            weights_file: None,
            seed: opts.seed,
            shuffle: opts.shuffle,
            epoch_len: opts.epoch_len,
            prefetch_size: opts.prefetch_size,
            io_depth: opts.io_depth,
            read_ahead_bytes: opts.read_ahead_bytes,
            verify: ds.verify_policy(),
            verified: SharedVerified::of(ds),
            threads: self.producer_threads,
            persistent,
        })
    }

    /// Plans the next pass over `ds` as it reads now, with `consumers` workers,
    /// `prefetch_factor` slots per worker and slots of `slot_size` bytes (see
    /// [`Plan::slot_size`]). Changes nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_pass(
        &self,
        ds: &Dataset,
        opts: &ReadOptions,
        weights: &WeightTable,
        consumers: u32,
        prefetch_factor: u32,
        slot_size: u64,
        persistent: bool,
    ) -> Result<PassPlan> {
        let start = self
            .passes
            .lock()
            .unwrap()
            .next_pass(&weights.fingerprint)?;
        Ok(PassPlan {
            start,
            pass: self.pass_at(ds, opts, start.epoch, start.start, consumers),
            geometry: Geometry {
                num_slots: num_slots(consumers, prefetch_factor)?,
                slot_size,
                max_consumers: consumers.max(1),
            },
            spec: self.spec(ds, opts, weights, persistent)?,
            weights_fingerprint: weights.fingerprint.clone(),
        })
    }

    /// Creates the segments and the private directory of `plan`'s pass (each locked by this
    /// process, see `lifecycle`) and writes the producer's spec (and `weights`) into that
    /// directory; fills in the plan's `ctl_name` and `weights_file`. Nothing of the state
    /// changes until [`Plan::commit`]: a start that fails on the way consumes no loaded state
    /// and advances no epoch.
    pub fn create_pass(
        &self,
        plan: &mut PassPlan,
        owner_pid: u64,
        weights: &WeightTable,
    ) -> Result<Arc<Ring>> {
        let ring = Arc::new(lifecycle::create_ring(owner_pid, plan.geometry, plan.pass)?);
        let private_dir = lifecycle::private_dir(&ring);
        let spec = &mut plan.spec;
        spec.ctl_name = ring.ctl_name().to_owned();
        let written = (|| -> Result<()> {
            if let Some(w) = &weights.weights {
                let path = private_dir.join("weights.f64");
                producer::write_weights(&path, w)?;
                spec.weights_file = Some(path);
            }
            let path = private_dir.join("spec.json");
            // JSON holds text: a cache path that is not UTF-8 cannot travel in it.
            let text = serde_json::to_vec(&spec).map_err(|e| {
                dataset_rt_core::Error::config(
                    "cache path for the DataLoader",
                    format!(
                        "{e}: the loader hands the paths of the dataset's files to its producer \
                         process as UTF-8 text; move or rename the cache (or \
                         RemoteConfig.local_dir) to a path that is UTF-8, or read it in process"
                    ),
                )
            })?;
            std::fs::write(&path, text).map_err(|source| ShmError::Io {
                op: "write",
                path,
                source,
            })?;
            Ok(())
        })();
        if let Err(e) = written {
            ring.unlink();
            return Err(e);
        }
        Ok(ring)
    }

    /// Plans the next pass on `ring`, a persistent pipeline started by `previous` whose last
    /// pass was fully delivered and ended, and starts it: the producer and the consumers
    /// waiting on the segments take it up. `None` when the pipeline cannot read it (the weight
    /// table or the reading options changed since it started): the caller starts a fresh one.
    /// Errors when the segments refuse a next pass (an error, a stop, a pass not over).
    pub fn restart_pass(
        &self,
        ring: &Ring,
        previous: &PassPlan,
        ds: &Dataset,
        opts: &ReadOptions,
        weights: &WeightTable,
    ) -> Result<Option<PassPlan>> {
        let mut spec = self.spec(ds, opts, weights, true)?;
        spec.ctl_name = previous.spec.ctl_name.clone();
        spec.weights_file = previous.spec.weights_file.clone();
        if spec != previous.spec {
            return Ok(None);
        }
        let start = self
            .passes
            .lock()
            .unwrap()
            .next_pass(&weights.fingerprint)?;
        let consumers = ring.pass().expected_attach.saturating_sub(1);
        let pass = self.pass_at(ds, opts, start.epoch, start.start, consumers);
        check_split(&pass).map_err(|why| protocol(format!("the next pass: {why}")))?;
        ring.begin_next_pass(pass)?;
        Ok(Some(PassPlan {
            start,
            pass,
            geometry: ring.geometry(),
            spec,
            weights_fingerprint: weights.fingerprint.clone(),
        }))
    }

    /// Makes a started pass the live one, once all its processes are running: the state reads
    /// from its control segment, a loaded state is used up and the next pass reads the next
    /// epoch. A `set_epoch` or `load_state` since it was planned wins over it.
    pub fn commit(&self, plan: &PassPlan, ring: Arc<Ring>) -> bool {
        self.passes.lock().unwrap().commit(
            plan.start,
            LivePass(ring),
            plan.weights_fingerprint.clone(),
        )
    }

    /// Ends the pass of `ring` if it is the live one: keeps its progress for the state and
    /// drops its mapping.
    pub fn end(&self, ring: &Arc<Ring>) -> bool {
        self.passes
            .lock()
            .unwrap()
            .end_if(|live| Arc::ptr_eq(&live.0, ring))
    }

    /// Fixes the epoch of the next pass; the state now describes that epoch's start.
    /// Refuses an epoch past the last ([`check_epoch`]).
    pub fn set_epoch(&self, epoch: u64) -> dataset_rt_core::Result<()> {
        let epoch = check_epoch(epoch)?;
        self.passes.lock().unwrap().set_epoch(epoch);
        Ok(())
    }

    /// Makes the next pass resume at global `position` of `epoch` (a state checked against
    /// the dataset), taken under the weight table `weights_fingerprint`.
    pub fn load(&self, epoch: u64, position: u64, weights_fingerprint: String) {
        self.passes
            .lock()
            .unwrap()
            .load(epoch, position, weights_fingerprint);
    }

    /// The epoch the next pass reads ([`passes::Passes::next_pass_epoch`]).
    pub fn next_pass_epoch(&self) -> dataset_rt_core::Result<u64> {
        self.passes.lock().unwrap().next_pass_epoch()
    }

    /// The state the training loop reached, read from the live pass's control segment.
    pub fn snapshot(&self) -> Result<passes::Snapshot> {
        Ok(self.passes.lock().unwrap().snapshot()?)
    }
}

//! A dataset as one process reads it: its reading options, its weight table, its epochs and
//! passes, and the epoch order of the last pass. `Dataset` iteration in the bindings is a thin
//! wrapper over a [`Session`]; the shared-memory loader's plan reads the same options and
//! weights through [`Session::reading`].
//!
//! A pass starts in three steps: the state machine ([`Passes`]) says where it starts, the
//! epoch's order is computed (or reused), and only once its reader exists is the pass committed.
//! A start that fails on the way (a closed or inherited pool, an order that cannot be had)
//! therefore leaves the state and the epoch counter as they were.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use crate::dataset::{Dataset, EpochReader, ReadOptions, State, WeightTable, LAST_EPOCH};
use crate::passes::{self, LiveProgress, Passes};
use crate::pool::Pool;
use crate::sampler::EpochOrder;
use crate::{Error, Result};

/// Where an in-process pass stands, shared by the session and the pass's iterator: the
/// iterator stores each position it hands out, and the session reads it for the state.
#[derive(Debug)]
pub struct PassProgress {
    epoch: u64,
    position: AtomicU64,
    finished: AtomicBool,
}

impl PassProgress {
    fn new(epoch: u64, start: u64) -> Self {
        PassProgress {
            epoch,
            position: AtomicU64::new(start),
            finished: AtomicBool::new(false),
        }
    }

    /// Records what the pass's reader has handed out: its global position, and whether that
    /// was the last sample of this rank's pass.
    pub fn handed_out(&self, reader: &EpochReader) {
        self.position.store(reader.position(), Ordering::Release);
        if reader.remaining() == 0 {
            self.finish();
        }
    }

    /// Marks the pass over: every sample of this rank was received.
    pub fn finish(&self) {
        self.finished.store(true, Ordering::Release);
    }
}

impl LiveProgress for PassProgress {
    fn progress(&self) -> passes::Progress {
        passes::Progress {
            epoch: self.epoch,
            position: self.position.load(Ordering::Acquire),
            finished: self.finished.load(Ordering::Acquire),
        }
    }
}

/// A pass just started: its reader, its progress (shared with the session) and the weight
/// table it reads (a table set during the pass applies from the next one).
pub struct StartedPass {
    pub reader: EpochReader,
    pub progress: Arc<PassProgress>,
    pub weights: WeightTable,
}

/// The state machine and the last order computed, under one lock that is never held across a
/// wait.
struct Control {
    passes: Passes<Arc<PassProgress>>,
    /// The last epoch order computed, with its epoch and weight table: reused when the same
    /// epoch is read again under the same table.
    order: Option<(u64, String, Arc<EpochOrder>)>,
}

/// One process's reading of a dataset (see the module documentation).
pub struct Session {
    pool: Arc<Pool>,
    dataset: Arc<Dataset>,
    opts: ReadOptions,
    weights: Mutex<WeightTable>,
    control: Mutex<Control>,
}

/// Refuses an epoch past [`LAST_EPOCH`] (`u64::MAX` is never an epoch).
pub fn check_epoch(epoch: u64) -> Result<u64> {
    if epoch > LAST_EPOCH {
        return Err(Error::config(
            "epoch",
            format!("{epoch} is past the last epoch, 2**64 - 2"),
        ));
    }
    Ok(epoch)
}

impl Session {
    pub fn new(pool: Arc<Pool>, dataset: Arc<Dataset>, opts: ReadOptions) -> Self {
        Session {
            pool,
            dataset,
            opts,
            weights: Mutex::new(WeightTable::uniform()),
            control: Mutex::new(Control {
                passes: Passes::new(),
                order: None,
            }),
        }
    }

    pub fn pool(&self) -> &Arc<Pool> {
        &self.pool
    }

    pub fn dataset(&self) -> &Arc<Dataset> {
        &self.dataset
    }

    pub fn options(&self) -> &ReadOptions {
        &self.opts
    }

    /// The weight table in force: the next pass reads it.
    pub fn weights(&self) -> WeightTable {
        self.weights.lock().unwrap().clone()
    }

    /// Makes `table` the weight table of the passes that start from now on.
    pub fn set_weights(&self, table: WeightTable) {
        *self.weights.lock().unwrap() = table;
    }

    /// The dataset, options and weights in force: what a loader's producer must read to read
    /// the same order in another process.
    pub fn reading(&self) -> (Arc<Dataset>, ReadOptions, WeightTable) {
        (self.dataset.clone(), self.opts, self.weights())
    }

    /// Starts the next pass: the next epoch, or the one a loaded state resumes, ending after
    /// its last whole batch of `whole_batches_of` samples (1: every sample). Blocks while the
    /// pool computes a new epoch's order; call it without any interpreter lock held.
    pub fn start_pass(&self, whole_batches_of: u64) -> Result<StartedPass> {
        let weights = self.weights();
        let (planned, cached) = {
            let control = self.control.lock().unwrap();
            let planned = control.passes.next_pass(&weights.fingerprint)?;
            let cached = control
                .order
                .as_ref()
                .filter(|(e, fp, _)| *e == planned.epoch && *fp == weights.fingerprint)
                .map(|(_, _, order)| order.clone());
            (planned, cached)
        };
        // A forked child must not start a pass: a cached order would hide that the pool's
        // threads are gone until the first sample.
        self.pool.check_usable()?;
        let order = match cached {
            Some(order) => order,
            None => {
                let (dataset, opts, w) = (self.dataset.clone(), self.opts, weights.clone());
                let epoch = planned.epoch;
                Arc::new(self.pool.run(move || dataset.try_order(&opts, &w, epoch))?)
            }
        };
        let progress = Arc::new(PassProgress::new(planned.epoch, planned.start));
        let reader = EpochReader::new(
            self.pool.clone(),
            self.dataset.clone(),
            order.clone(),
            &self.opts,
            planned.epoch,
            planned.start,
        )
        .whole_batches_of(whole_batches_of);
        if reader.is_empty() {
            progress.finish();
        }
        let mut control = self.control.lock().unwrap();
        control.order = Some((planned.epoch, weights.fingerprint.clone(), order));
        control
            .passes
            .commit(planned, progress.clone(), weights.fingerprint.clone());
        Ok(StartedPass {
            reader,
            progress,
            weights,
        })
    }

    /// Fixes the epoch of the next pass; the state now describes that epoch's start (a loaded
    /// state's position and the last pass's progress are dropped).
    pub fn set_epoch(&self, epoch: u64) -> Result<()> {
        let epoch = check_epoch(epoch)?;
        self.control.lock().unwrap().passes.set_epoch(epoch);
        Ok(())
    }

    /// Where the training loop got to: the live or last pass's progress, else the loaded state,
    /// else the start of the next epoch.
    pub fn state(&self) -> Result<State> {
        let snapshot = self.control.lock().unwrap().passes.snapshot()?;
        let in_force = self.weights();
        let weights_fingerprint = snapshot
            .weights_fingerprint
            .as_deref()
            .unwrap_or(&in_force.fingerprint);
        Ok(self.dataset.state_under(
            &self.opts,
            weights_fingerprint,
            snapshot.epoch,
            snapshot.position,
        ))
    }

    /// Makes the next pass resume exactly where `state` was taken. Resuming under another
    /// world size re-splits the rest of the epoch from the same global position, so rank and
    /// world size are not compared.
    pub fn load_state(&self, state: &State) -> Result<()> {
        let weights = self.weights();
        let (epoch, position) = self.dataset.check_state(state, &self.opts, &weights)?;
        self.control
            .lock()
            .unwrap()
            .passes
            .load(epoch, position, weights.fingerprint);
        Ok(())
    }
}

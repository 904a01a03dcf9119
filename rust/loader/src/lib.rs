//! DatasetRT's shared-memory loader, between the bindings and the core + transport crates: the
//! pass plan, the producer loop that fills the ring, the slot codec (what one batch looks like
//! in a slot, with references into the caches' shard files and the table of those files), and
//! the lifecycle of the segments' names.
//! No Python here: `rust/python/src/loader.rs` binds it; `dataset-rt-shm` moves the bytes.
//!
//! Layers (a module imports only modules of the layers below it; no import circles):
//! 1. leaves: `batch` (the slot codec), `shards` (the table of shard files), `pass` (what a
//!    pass's description means: its rank split, its counts, the position after a batch);
//! 2. `lifecycle` (pass);
//! 3. `producer` (batch, shards, pass, lifecycle);
//! 4. `plan` (all of the above).

pub mod batch;
pub mod lifecycle;
pub mod pass;
pub mod plan;
pub mod producer;
pub mod shards;

use dataset_rt_shm::ShmError;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A loader error: the transport's, or the core's (reading the caches, the state). Exhaustive on
/// purpose: the bindings match every variant, so a new one cannot fall into another class.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Shm(#[from] ShmError),

    #[error(transparent)]
    Core(#[from] dataset_rt_core::Error),
}

/// The transport's `Protocol` error: the segments or the slots are not what a party wrote.
pub(crate) fn protocol(text: String) -> Error {
    Error::Shm(ShmError::Protocol(text))
}

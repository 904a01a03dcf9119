//! DatasetRT's shared-memory transport: named segments, the control segment and ring of slots
//! (`shm/LAYOUT.md` specifies every byte), cross-process waiting, and private copies of a
//! mapping. Pure transport: what the slots hold, the pass plan and which names exist when are
//! `dataset-rt-loader`'s.
//!
//! Layers (a module imports only modules of the layers below it; no import circles):
//! 1. leaves: `layout` (every offset and constant of `shm/LAYOUT.md`), `futex`, `private_copy`,
//!    `results`;
//! 2. `segment` (layout);
//! 3. `ring` (layout, segment, futex), with its parts `ring::geometry`, `ring::parties` and
//!    `ring::slots` over the `Ring` that `ring.rs` maps.

mod futex;
pub mod layout;
pub mod private_copy;
pub mod results;
pub mod ring;
pub mod segment;

use std::path::PathBuf;

pub type Result<T, E = ShmError> = std::result::Result<T, E>;

/// Not `#[non_exhaustive]`: the crates above match it exhaustively (no catch-all), so a new
/// variant fails to compile until each of them decides what it means.
#[derive(Debug, thiserror::Error)]
pub enum ShmError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// The segments are not what this build expects, or a party broke the protocol.
    #[error("shared-memory loader: {0}")]
    Protocol(String),

    /// The owner asked every party to stop.
    #[error("the loader was closed")]
    Stopped,

    /// The training process that owns the segments is gone.
    #[error("the training process (pid {0}) is gone")]
    OwnerGone(u64),

    /// The producer recorded an error affecting this batch or an earlier one: `kind` is a code
    /// of the producer's error-kind table, `errno` the OS error number when it has one.
    #[error("the producer failed at batch {batch}: {text}")]
    ProducerFailed {
        kind: u32,
        errno: Option<i32>,
        batch: u64,
        text: String,
    },

    /// A batch does not fit a slot: it is refused, never truncated.
    #[error(
        "batch {batch} ({samples} samples) needs {needed} bytes but a ring slot holds {slot_size}: \
         raise slot_size_bytes or lower batch_size"
    )]
    BatchTooLarge {
        batch: u64,
        samples: u64,
        needed: u64,
        slot_size: u64,
    },

    /// Memory for a private copy of a mapping could not be had (`ENOMEM`), or the kernel refused
    /// to move it into place.
    #[error("{op} of {len} bytes for a private copy of a ring slot: {source}")]
    Memory {
        op: &'static str,
        len: usize,
        #[source]
        source: std::io::Error,
    },
}

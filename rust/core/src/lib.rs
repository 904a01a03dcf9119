//! DatasetRT core: the immutable cache format, its writer and reader, deterministic sampling and
//! the worker pool. No Python here: the `dataset-rt-python` crate binds it.

pub mod cache;
pub mod dataset;
pub mod error;
pub mod format;
mod hashed_file;
pub mod liveness;
pub mod metadata;
pub mod os;
pub mod passes;
pub mod pool;
pub mod progress;
pub mod sampler;
pub mod samples;
pub mod verify;
pub mod writer;

pub use error::{Error, ErrorKind, Result};

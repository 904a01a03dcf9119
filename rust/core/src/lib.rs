//! DatasetRT core: the immutable cache format, its writer and reader, deterministic sampling and
//! the worker pool. No Python here: the `dataset-rt-python` crate binds it.
//!
//! Layers (a module imports only modules of the layers below it; no import circles):
//! 1. leaves: `error`, `os`, `liveness`, `progress`, `checksum` (xxh3-64 and its hex form);
//! 2. `pool` (error), `sampler` and `verify` (error, os), `hashed_file` (error, checksum);
//! 3. `metadata` (error, pool, hashed_file);
//! 4. `format`: byte layouts and the manifest (checksum, metadata's field types);
//! 5. `cache`: opening and validating a cache (format, metadata, pool);
//! 6. `dataset`: reading it (cache, sampler, verify, pool), in five files: `dataset::state`
//!    (the read options and the iterator state), `dataset` (the `Dataset` and its `fetch`),
//!    `dataset::planner` (the read planner and its backend trait, `RangeSource`),
//!    `dataset::local_files` (the planner's backend for local files: kernel advice) and
//!    `dataset::reader` (the `EpochReader`'s read-ahead, over `Dataset`, consulting the
//!    planner); and `writer`: writing
//!    one (cache, format, hashed_file, liveness, pool), in four files: `writer::lock` (names,
//!    the lock, leftovers), `writer::records` (encoding, the ordered commit into shards),
//!    `writer::validate` (each sample against the schema) and `writer` (a write from the first
//!    push to the publication);
//! 7. `samples` and `passes`, over `dataset`; `cache_set`: sets of caches written as parts, their
//!    manifest and publication (cache, writer);
//! 8. `session`: one process's reading of a dataset (dataset, passes, pool).

pub mod cache;
pub mod cache_set;
pub mod checksum;
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
pub mod session;
pub mod verify;
pub mod writer;

pub use error::{Error, ErrorKind, Result};

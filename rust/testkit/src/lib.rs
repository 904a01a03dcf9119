//! What the Rust tests and the fuzz targets share, kept in one place so that each lives once:
//!
//! - [`write`]: caches written by the real writer, from a list of samples;
//! - [`golden`]: private copies of the committed golden caches;
//! - [`edit`]: byte edits of a cache's files (published files are read-only);
//! - [`files`]: every file of a cache in memory, the form forgeries are made in;
//! - [`layout`]: where the fields of index entries and record headers lie, for each format
//!   version, read without trusting them;
//! - [`resign`]: re-signing after damage, the way a forger would: record checksums, file sizes
//!   and checksums, the fingerprint, so that the damage reaches the checks behind the checksums;
//! - [`alloc`]: an allocator that records the largest allocation, for tests that a forged size
//!   reserves nothing;
//! - [`process`]: a pid that belongs to no running process, and a directory removed when the
//!   test process exits (for fixtures kept in a `static`).
//!
//! Every function panics on a failure of its own (an I/O error, a cache that is not what it
//! expects): it is only ever called by a test or a fuzz target, where that is the right report.
//! It depends on `dataset-rt-core` only; the crates whose integration tests use it take it as a
//! dev-dependency (for `dataset-rt-core` itself, a dev-dependency cycle, which its `tests/` can
//! use: they link the same library as the kit).

pub mod alloc;
pub mod edit;
pub mod files;
pub mod golden;
pub mod layout;
pub mod process;
pub mod resign;
pub mod write;

pub use alloc::LargestAlloc;
pub use edit::{flip_byte, make_writable, set_len, write_at};
pub use files::{dir_entries, CacheFiles};
pub use golden::{golden_copy, golden_copy_of, golden_dir};
pub use process::{dead_pid, process_dir};
pub use resign::{edit_manifest, forge_entry, forge_record, manifest_of, resign};
pub use write::{
    cache_writer, lz4, numbered, sample, try_write_cache, write_cache, writer_options,
};

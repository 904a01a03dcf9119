//! Read-only access to one published cache for the `dataset-rt` command line: its validated
//! manifest, a full verification, and raw records decoded with their embedded metadata. A cache
//! set is inspected and verified as a whole (its set manifest and every part). Every check is
//! the core's; this file only locates the cache and converts the results.

use std::path::{Path, PathBuf};

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::cache_set::{part_name, CacheSet, SET_MANIFEST_FILE};
use dataset_rt_core::format::{checksum_hex, FLAG_LZ4, MANIFEST_FILE};
use dataset_rt_core::Error;
use pyo3::exceptions::{PyFileNotFoundError, PyNotADirectoryError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::errors::IntoPyResult;

/// Resolves `path` to a cache directory. A path that is not a directory holding `manifest.json`
/// is not a cache at all: that is a `FileNotFoundError` / `NotADirectoryError`, kept apart from
/// a cache that exists and fails validation (`CacheMalformedError`). A cache set is refused
/// with a message naming one of its parts.
pub(crate) fn cache_dir(path: &Path) -> PyResult<PathBuf> {
    let dir = cache_or_set_dir(path)?;
    if dir.join(MANIFEST_FILE).exists() {
        return Ok(dir);
    }
    let set = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    Err(PyFileNotFoundError::new_err(format!(
        "{} is a cache set, not one cache: give one of its parts, such as {}",
        path.display(),
        path.join(part_name(&set, 0)).display()
    )))
}

/// The resolved directory of a cache or of a cache set (one holding `set.json`).
pub(crate) fn cache_or_set_dir(path: &Path) -> PyResult<PathBuf> {
    if !path.exists() {
        return Err(PyFileNotFoundError::new_err(format!(
            "no DatasetRT cache at {}: the path does not exist",
            path.display()
        )));
    }
    if !path.is_dir() {
        return Err(PyNotADirectoryError::new_err(format!(
            "no DatasetRT cache at {}: it is not a directory (a cache is a directory holding {MANIFEST_FILE})",
            path.display()
        )));
    }
    if !path.join(MANIFEST_FILE).exists() && !path.join(SET_MANIFEST_FILE).exists() {
        return Err(PyFileNotFoundError::new_err(format!(
            "no DatasetRT cache at {}: it has no {MANIFEST_FILE} (nor the {SET_MANIFEST_FILE} \
             of a cache set)",
            path.display()
        )));
    }
    // The manifest must name the directory it lives in, so `.` or `cache/` need the real name.
    std::fs::canonicalize(path)
        .map_err(|e| Error::io("resolve", path, e))
        .py_err()
}

fn open(py: Python<'_>, path: &Path, validation: Validation) -> PyResult<Cache> {
    let dir = cache_dir(path)?;
    py.detach(|| Cache::open(&dir, validation)).py_err()
}

/// Opens the cache at `path` with the checks every load runs (manifest, sizes, index and shard
/// headers) and those of the first use of its metadata table (`metadata.arrow`'s checksum and
/// decoding), so that a command shows nothing of a cache a reader would refuse.
fn open_checked(py: Python<'_>, path: &Path) -> PyResult<Cache> {
    let cache = open(py, path, Validation::Structure)?;
    py.detach(|| cache.metadata().map(|_| ())).py_err()?;
    Ok(cache)
}

/// The manifest of the cache at `path` as JSON text, after the checks of [`open_checked`]; for
/// a cache set, its set manifest, after those checks of every part.
#[pyfunction]
pub fn inspect_cache(py: Python<'_>, path: PathBuf) -> PyResult<String> {
    let dir = cache_or_set_dir(&path)?;
    if !dir.join(MANIFEST_FILE).exists() {
        let manifest = dir.join(SET_MANIFEST_FILE);
        return py
            .detach(|| {
                let set = CacheSet::open(&dir, Validation::Structure)?;
                for part in &set.parts {
                    part.metadata()?;
                }
                std::fs::read_to_string(&manifest).map_err(|e| Error::io("read", &manifest, e))
            })
            .py_err();
    }
    let cache = open_checked(py, &path)?;
    // A published cache is never modified, so the file on disk is the manifest just validated.
    let manifest = cache.dir.join(MANIFEST_FILE);
    py.detach(|| std::fs::read_to_string(&manifest).map_err(|e| Error::io("read", &manifest, e)))
        .py_err()
}

/// Verifies everything in the cache at `path`: structure, the index's checksum and the metadata
/// table, then every record's header and checksum (and LZ4 decoding), then every shard's
/// whole-file checksum. Records go first so that
/// damage inside a record is reported with its shard, offset and sample; the shard checksums
/// then catch damage between records. Returns `(samples, shards)`; raises
/// `CacheMalformedError` or `CorruptRecordError` naming the file and record. A cache set is
/// verified part by part, after its set manifest, and counts the shards of all its parts.
#[pyfunction]
pub fn verify_cache(py: Python<'_>, path: PathBuf) -> PyResult<(u64, usize)> {
    let dir = cache_or_set_dir(&path)?;
    py.detach(|| {
        if !dir.join(MANIFEST_FILE).exists() {
            let set = CacheSet::open(&dir, Validation::Structure)?;
            set.verify_all()?;
            return Ok((set.len(), set.parts.iter().map(Cache::num_shards).sum()));
        }
        let cache = Cache::open(&dir, Validation::Structure)?;
        cache.verify_all()?;
        Ok((cache.len(), cache.num_shards()))
    })
    .py_err()
}

/// One raw record as `head` shows it.
type RecordInfo<'py> = (
    u64,                 // sample
    String,              // metadata embedded in the record, JSON text
    u32,                 // shard number
    String,              // shard file, relative to the cache directory
    u64,                 // record offset in the shard
    u32,                 // flags
    &'static str,        // payload encoding: "lz4" or "raw"
    u32,                 // stored payload length
    u32,                 // raw (decoded) payload length
    String,              // record checksum, hex
    Bound<'py, PyBytes>, // first `preview_bytes` of the decoded payload
);

/// The first `n` records of the cache at `path`, each read from its shard and verified against
/// its own checksum: location, sizes, the metadata embedded in the record (not `metadata.arrow`)
/// and a preview of the decoded payload.
#[pyfunction]
#[pyo3(signature = (path, n, preview_bytes = 32))]
pub fn head_records(
    py: Python<'_>,
    path: PathBuf,
    n: u64,
    preview_bytes: usize,
) -> PyResult<Vec<RecordInfo<'_>>> {
    let cache = open_checked(py, &path)?;
    let records = py
        .detach(|| {
            (0..n.min(cache.len()))
                .map(|sample| {
                    let metadata = cache.embedded_metadata(sample)?.to_string();
                    let payload = cache.payload(sample)?;
                    let preview = payload[..preview_bytes.min(payload.len())].to_vec();
                    let e = cache.entry(sample);
                    let shard_file = cache.manifest.shards[e.shard as usize].file.clone();
                    let encoding = if e.flags & FLAG_LZ4 != 0 {
                        "lz4"
                    } else {
                        "raw"
                    };
                    Ok((sample, metadata, e, shard_file, encoding, preview))
                })
                .collect::<dataset_rt_core::Result<Vec<_>>>()
        })
        .py_err()?;
    Ok(records
        .into_iter()
        .map(|(sample, metadata, e, shard_file, encoding, preview)| {
            (
                sample,
                metadata,
                e.shard,
                shard_file,
                e.offset,
                e.flags,
                encoding,
                e.stored_len,
                e.raw_len,
                checksum_hex(e.checksum),
                PyBytes::new(py, &preview),
            )
        })
        .collect())
}

/// Where every record's stored payload lies in the cache at `path`, by the core's own reading of
/// its index and record headers (each record checked as a read checks it: its header against its
/// entry, its bounds; not its checksum): the little-endian `int64` rows
/// `(shard, start, stored_len, raw_len)` as bytes, one row per sample in storage order, with
/// `raw_len` -1 for a record stored uncompressed. For tools that read a cache's files with
/// other readers (the benchmarks' torch baselines).
#[pyfunction]
pub fn payload_spans<'py>(py: Python<'py>, path: PathBuf) -> PyResult<Bound<'py, PyBytes>> {
    let dir = cache_dir(&path)?;
    let rows = py
        .detach(|| -> dataset_rt_core::Result<Vec<u8>> {
            let cache = Cache::open(&dir, Validation::Structure)?;
            let mut rows = Vec::with_capacity(cache.len() as usize * 32);
            for sample in 0..cache.len() {
                let (entry, header, start) = cache.check_record(sample, false)?;
                let raw = if header.flags & FLAG_LZ4 != 0 {
                    i64::from(header.raw_len)
                } else {
                    -1
                };
                for value in [
                    i64::from(entry.shard),
                    start as i64,
                    i64::from(header.stored_len),
                    raw,
                ] {
                    rows.extend_from_slice(&value.to_le_bytes());
                }
            }
            Ok(rows)
        })
        .py_err()?;
    Ok(PyBytes::new(py, &rows))
}

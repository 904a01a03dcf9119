//! Checks of config values at construction, so a bad value fails where it is written.

use dataset_rt_core::dataset::ReadOptions;
use dataset_rt_core::format::Compression;
use dataset_rt_core::sampler::RankPolicy;
use dataset_rt_core::verify::VerifyPolicy;
use dataset_rt_core::writer::WriterOptions;
use pyo3::prelude::*;

use crate::errors::{ConfigError, IntoPyResult};

fn unsigned(field: &str, value: &Bound<'_, PyAny>, min: u64) -> PyResult<u64> {
    let bad = || {
        ConfigError::new_err(format!(
            "invalid {field}: expected an int >= {min}, got {}",
            value.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    };
    if value.is_instance_of::<pyo3::types::PyBool>() {
        return Err(bad());
    }
    match value.extract::<u64>() {
        Ok(v) if v >= min => Ok(v),
        _ => Err(bad()),
    }
}

/// A `bool` field: `True` or `False` (a `numpy.bool_` too, which every native call reads as a
/// bool); an int such as `1`, `None` or a string is refused rather than read as truthy.
fn boolean(field: &str, value: &Bound<'_, PyAny>) -> PyResult<bool> {
    value.extract::<bool>().map_err(|_| {
        ConfigError::new_err(format!(
            "invalid {field}: expected a bool, got {}",
            value.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    })
}

pub(crate) fn optional(
    field: &str,
    value: Option<&Bound<'_, PyAny>>,
    min: u64,
) -> PyResult<Option<u64>> {
    value
        .filter(|v| !v.is_none())
        .map(|v| unsigned(field, v, min))
        .transpose()
}

#[pyfunction]
pub fn check_compression(algo: &Bound<'_, PyAny>, ratio: &Bound<'_, PyAny>) -> PyResult<()> {
    let algo: String = algo.extract().map_err(|_| {
        ConfigError::new_err(format!(
            "invalid ShardCompression.algo: expected \"none\" or \"lz4\", got {algo}"
        ))
    })?;
    let ratio: f64 = ratio.extract().map_err(|_| {
        ConfigError::new_err(format!(
            "invalid ShardCompression.ratio: expected a float, got {ratio}"
        ))
    })?;
    Compression::new(&algo, ratio).py_err().map(|_| ())
}

#[pyfunction]
#[pyo3(signature = (*, seed, prefetch_size, shuffle, validate_cache, verify, rank, world_size,
    drop_last, samples_per_epoch))]
#[allow(clippy::too_many_arguments)]
pub fn check_reader_config(
    seed: &Bound<'_, PyAny>,
    prefetch_size: &Bound<'_, PyAny>,
    shuffle: &Bound<'_, PyAny>,
    validate_cache: &Bound<'_, PyAny>,
    verify: &Bound<'_, PyAny>,
    rank: Option<&Bound<'_, PyAny>>,
    world_size: Option<&Bound<'_, PyAny>>,
    drop_last: &Bound<'_, PyAny>,
    samples_per_epoch: Option<&Bound<'_, PyAny>>,
) -> PyResult<()> {
    let seed = unsigned("ReaderConfig.seed", seed, 0)?;
    let prefetch = unsigned("ReaderConfig.prefetch_size", prefetch_size, 1)?;
    let shuffle = boolean("ReaderConfig.shuffle", shuffle)?;
    boolean("ReaderConfig.validate_cache", validate_cache)?;
    let verify_name: String = verify.extract().map_err(|_| {
        ConfigError::new_err(format!(
            "invalid ReaderConfig.verify: expected \"always\", \"once\" or \"never\", got {}",
            verify.repr().map(|r| r.to_string()).unwrap_or_default()
        ))
    })?;
    VerifyPolicy::parse(&verify_name).py_err()?;
    let drop_last = boolean("ReaderConfig.drop_last", drop_last)?;
    let world_size = optional("ReaderConfig.world_size", world_size, 1)?;
    let rank = optional("ReaderConfig.rank", rank, 0)?;
    let epoch_len = optional("ReaderConfig.samples_per_epoch", samples_per_epoch, 0)?;
    if rank.is_some() != world_size.is_some() {
        return Err(ConfigError::new_err(
            "invalid ReaderConfig: give rank and world_size together, or neither",
        ));
    }
    ReadOptions {
        seed,
        shuffle,
        prefetch_size: prefetch as usize,
        epoch_len,
        rank: rank.unwrap_or(0),
        world_size: world_size.unwrap_or(1),
        policy: if drop_last {
            RankPolicy::Drop
        } else {
            RankPolicy::Pad
        },
        io_depth: dataset_rt_core::dataset::DEFAULT_IO_DEPTH,
        read_ahead_bytes: dataset_rt_core::dataset::DEFAULT_READ_AHEAD_BYTES,
    }
    .validate()
    .py_err()
}

#[pyfunction]
#[pyo3(signature = (*, prefetch_size, show_progress, validate_cache, shard_size_bytes))]
pub fn check_writer_config(
    prefetch_size: &Bound<'_, PyAny>,
    show_progress: &Bound<'_, PyAny>,
    validate_cache: &Bound<'_, PyAny>,
    shard_size_bytes: &Bound<'_, PyAny>,
) -> PyResult<()> {
    let prefetch_size = unsigned("WriterConfig.prefetch_size", prefetch_size, 1)? as usize;
    boolean("WriterConfig.show_progress", show_progress)?;
    WriterOptions {
        prefetch_size,
        compression: Compression::NONE,
        validate: boolean("WriterConfig.validate_cache", validate_cache)?,
        shard_size: unsigned("WriterConfig.shard_size_bytes", shard_size_bytes, 1)?,
    }
    .validate()
    .py_err()
}

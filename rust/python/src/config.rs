//! Checks of config values at construction, so a bad value fails where it is written.

use dataset_rt_core::cache::Validation;
use dataset_rt_core::dataset::ReadOptions;
use dataset_rt_core::format::Compression;
use dataset_rt_core::sampler::RankPolicy;
use dataset_rt_core::verify::VerifyPolicy;
use dataset_rt_core::writer::WriterOptions;
use pyo3::prelude::*;

use crate::errors::{ConfigError, IntoPyResult};

/// An int field of at least `min` (numpy's ints too, never a bool).
fn unsigned(field: &str, value: &Bound<'_, PyAny>, min: u64) -> PyResult<u64> {
    match int_field(field, value, &format!("an int >= {min}"))? {
        v if v >= min => Ok(v),
        _ => Err(expected(field, value, &format!("an int >= {min}"))),
    }
}

fn expected(field: &str, value: &Bound<'_, PyAny>, what: &str) -> PyErr {
    ConfigError::new_err(format!(
        "invalid {field}: expected {what}, got {}",
        value.repr().map(|r| r.to_string()).unwrap_or_default()
    ))
}

/// An int field that fits 64 bits (numpy's ints too, never a bool); `what` says the field's
/// domain, which its caller checks.
pub(crate) fn int_field(field: &str, value: &Bound<'_, PyAny>, what: &str) -> PyResult<u64> {
    if value.is_instance_of::<pyo3::types::PyBool>() {
        return Err(expected(field, value, what));
    }
    match value.extract::<u64>() {
        Ok(v) => Ok(v),
        // An int past 64 bits: too large for any field, whatever its own bound.
        Err(_)
            if value.is_instance_of::<pyo3::types::PyInt>()
                && value.gt(u64::MAX).unwrap_or(false) =>
        {
            Err(ConfigError::new_err(format!(
                "invalid {field}: {} is too large (at most {})",
                value.repr().map(|r| r.to_string()).unwrap_or_default(),
                u64::MAX
            )))
        }
        Err(_) => Err(expected(field, value, what)),
    }
}

/// A `bool` field: `True` or `False` (a `numpy.bool_` too, which every native call reads as a
/// bool); an int such as `1`, `None` or a string is refused rather than read as truthy.
pub(crate) fn boolean(field: &str, value: &Bound<'_, PyAny>) -> PyResult<bool> {
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

/// A `ReaderConfig`, read field by field from the dataclass's attributes: the one place the
/// bindings list its fields.
#[derive(FromPyObject)]
pub struct ReaderFields<'py> {
    #[pyo3(attribute)]
    seed: Bound<'py, PyAny>,
    #[pyo3(attribute)]
    prefetch_size: Bound<'py, PyAny>,
    #[pyo3(attribute)]
    shuffle: Bound<'py, PyAny>,
    #[pyo3(attribute)]
    validate_cache: Bound<'py, PyAny>,
    #[pyo3(attribute)]
    verify: Bound<'py, PyAny>,
    #[pyo3(attribute)]
    rank: Option<Bound<'py, PyAny>>,
    #[pyo3(attribute)]
    world_size: Option<Bound<'py, PyAny>>,
    #[pyo3(attribute)]
    drop_last: Bound<'py, PyAny>,
    #[pyo3(attribute)]
    samples_per_epoch: Option<Bound<'py, PyAny>>,
    #[pyo3(attribute)]
    io_depth: Bound<'py, PyAny>,
    #[pyo3(attribute)]
    read_ahead_bytes: Bound<'py, PyAny>,
}

/// The reader settings of a call, checked.
pub struct Reading {
    pub read: ReadOptions,
    pub validation: Validation,
    pub verify: VerifyPolicy,
}

impl ReaderFields<'_> {
    /// The checked settings; `split` is the (rank, world size) resolved by the caller, in place
    /// of the config's own (which may be `None`: from the environment).
    pub fn reading(&self, split: Option<(u64, u64)>) -> PyResult<Reading> {
        let seed = unsigned("ReaderConfig.seed", &self.seed, 0)?;
        let prefetch = unsigned("ReaderConfig.prefetch_size", &self.prefetch_size, 1)?;
        let shuffle = boolean("ReaderConfig.shuffle", &self.shuffle)?;
        let validate = boolean("ReaderConfig.validate_cache", &self.validate_cache)?;
        let verify_name: String =
            self.verify.extract().map_err(|_| {
                ConfigError::new_err(format!(
                "invalid ReaderConfig.verify: expected \"always\", \"once\" or \"never\", got {}",
                self.verify.repr().map(|r| r.to_string()).unwrap_or_default()
            ))
            })?;
        let verify = VerifyPolicy::parse(&verify_name).py_err()?;
        let drop_last = boolean("ReaderConfig.drop_last", &self.drop_last)?;
        let io_depth = unsigned("ReaderConfig.io_depth", &self.io_depth, 1)?;
        let read_ahead_bytes =
            unsigned("ReaderConfig.read_ahead_bytes", &self.read_ahead_bytes, 1)?;
        let world_size = optional("ReaderConfig.world_size", self.world_size.as_ref(), 1)?;
        let rank = optional("ReaderConfig.rank", self.rank.as_ref(), 0)?;
        let epoch_len = optional(
            "ReaderConfig.samples_per_epoch",
            self.samples_per_epoch.as_ref(),
            0,
        )?;
        if rank.is_some() != world_size.is_some() {
            return Err(ConfigError::new_err(
                "invalid ReaderConfig: give rank and world_size together, or neither",
            ));
        }
        let (rank, world_size) = split.unwrap_or((rank.unwrap_or(0), world_size.unwrap_or(1)));
        let read = ReadOptions {
            seed,
            shuffle,
            prefetch_size: prefetch as usize,
            epoch_len,
            rank,
            world_size,
            policy: if drop_last {
                RankPolicy::Drop
            } else {
                RankPolicy::Pad
            },
            io_depth: usize::try_from(io_depth).unwrap_or(usize::MAX),
            read_ahead_bytes,
        };
        read.validate().py_err()?;
        Ok(Reading {
            read,
            validation: if validate {
                Validation::Full
            } else {
                Validation::Structure
            },
            verify,
        })
    }
}

/// A `ShardCompression`'s fields.
#[derive(FromPyObject)]
struct CompressionFields {
    #[pyo3(attribute)]
    algo: String,
    #[pyo3(attribute)]
    ratio: f64,
}

/// A `WriterConfig`, read from the dataclass's attributes.
#[derive(FromPyObject)]
pub struct WriterFields<'py> {
    #[pyo3(attribute)]
    prefetch_size: Bound<'py, PyAny>,
    #[pyo3(attribute)]
    shard_compression: Bound<'py, PyAny>,
    #[pyo3(attribute)]
    show_progress: Bound<'py, PyAny>,
    #[pyo3(attribute)]
    validate_cache: Bound<'py, PyAny>,
    #[pyo3(attribute)]
    shard_size_bytes: Bound<'py, PyAny>,
    #[pyo3(attribute)]
    processes: Bound<'py, PyAny>,
}

/// The most worker processes that write a cache set's parts at once.
pub const MAX_WRITER_PROCESSES: u64 = 1024;

impl WriterFields<'_> {
    /// The checked writer options, and whether to show the progress line.
    pub fn options(&self) -> PyResult<(WriterOptions, bool)> {
        let compression: CompressionFields = self.shard_compression.extract().map_err(|_| {
            ConfigError::new_err(format!(
                "invalid WriterConfig.shard_compression: expected ShardCompression, got {}",
                self.shard_compression
                    .repr()
                    .map(|r| r.to_string())
                    .unwrap_or_default()
            ))
        })?;
        let options = WriterOptions {
            prefetch_size: unsigned("WriterConfig.prefetch_size", &self.prefetch_size, 1)? as usize,
            compression: Compression::new(&compression.algo, compression.ratio).py_err()?,
            validate: boolean("WriterConfig.validate_cache", &self.validate_cache)?,
            shard_size: unsigned("WriterConfig.shard_size_bytes", &self.shard_size_bytes, 1)?,
        };
        let show_progress = boolean("WriterConfig.show_progress", &self.show_progress)?;
        options.validate().py_err()?;
        Ok((options, show_progress))
    }

    /// How many processes write a cache set's parts (1 to [`MAX_WRITER_PROCESSES`]).
    pub fn processes(&self) -> PyResult<usize> {
        // One message for every bad value, 2**64 and above included.
        match unsigned("WriterConfig.processes", &self.processes, 1) {
            Ok(n) if n <= MAX_WRITER_PROCESSES => Ok(n as usize),
            _ => Err(ConfigError::new_err(format!(
                "invalid WriterConfig.processes: expected an int from 1 to \
                 {MAX_WRITER_PROCESSES}, got {}",
                self.processes
                    .repr()
                    .map(|r| r.to_string())
                    .unwrap_or_default()
            ))),
        }
    }
}

/// Checks a `ReaderConfig` as it is made.
#[pyfunction]
pub fn check_reader_config(config: ReaderFields<'_>) -> PyResult<()> {
    config.reading(None).map(drop)
}

/// Checks a `WriterConfig` as it is made.
#[pyfunction]
pub fn check_writer_config(config: WriterFields<'_>) -> PyResult<()> {
    config.options()?;
    config.processes().map(drop)
}

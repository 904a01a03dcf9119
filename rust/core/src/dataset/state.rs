//! The options a pass reads under and the iterator state it saves and resumes from: what
//! decides the order and the split, and where an epoch's pass stands.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::sampler::{RankPolicy, RankSplit, MAX_EPOCH_LEN};

pub const STATE_VERSION: u32 = 1;

/// The default of [`ReadOptions::io_depth`]: as many reads in flight as the 64 threads of
/// `pread` that measure a disk's random-read ceiling (bench/bench_cold.py).
pub const DEFAULT_IO_DEPTH: usize = 64;

/// The default of [`ReadOptions::read_ahead_bytes`].
pub const DEFAULT_READ_AHEAD_BYTES: u64 = 64 << 20;

/// The largest [`ReadOptions::io_depth`]: more reads than a device queue takes only pin memory.
pub const MAX_IO_DEPTH: usize = 1 << 16;

/// The largest [`ReadOptions::prefetch_size`]: every sample read ahead holds memory (its entry,
/// and its payload when decompressed), so the bound is one that a node has the memory for.
pub const MAX_PREFETCH_SIZE: usize = 1 << 20;

/// The largest [`ReadOptions::read_ahead_bytes`]: 1 TiB.
pub const MAX_READ_AHEAD_BYTES: u64 = 1 << 40;

/// Reading options: what decides the order and the split, and how deep the reads go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadOptions {
    pub seed: u64,
    pub shuffle: bool,
    pub prefetch_size: usize,
    /// Samples per epoch (before the rank split); `None` = the number of samples.
    pub epoch_len: Option<u64>,
    pub rank: u64,
    pub world_size: u64,
    pub policy: RankPolicy,
    /// Records the read planner keeps in flight ahead of the reading threads while reads miss
    /// the page cache ([`DEFAULT_IO_DEPTH`]); it decides nothing about the order.
    pub io_depth: usize,
    /// Bound on the stored bytes of those records ([`DEFAULT_READ_AHEAD_BYTES`]); one record is
    /// always let through, however large.
    pub read_ahead_bytes: u64,
}

impl ReadOptions {
    /// Options with these order-deciding fields and the defaults for the rest: a prefetch of
    /// 64 samples, the whole dataset per epoch, one rank, [`DEFAULT_IO_DEPTH`] and
    /// [`DEFAULT_READ_AHEAD_BYTES`].
    pub fn new(seed: u64, shuffle: bool) -> Self {
        ReadOptions {
            seed,
            shuffle,
            prefetch_size: 64,
            epoch_len: None,
            rank: 0,
            world_size: 1,
            policy: RankPolicy::Pad,
            io_depth: DEFAULT_IO_DEPTH,
            read_ahead_bytes: DEFAULT_READ_AHEAD_BYTES,
        }
    }

    pub fn validate(&self) -> Result<()> {
        if self.io_depth == 0 || self.io_depth > MAX_IO_DEPTH {
            return Err(Error::config(
                "ReaderConfig.io_depth",
                format!(
                    "{} is not between 1 and {MAX_IO_DEPTH} (reads in flight)",
                    self.io_depth
                ),
            ));
        }
        if self.read_ahead_bytes == 0 || self.read_ahead_bytes > MAX_READ_AHEAD_BYTES {
            return Err(Error::config(
                "ReaderConfig.read_ahead_bytes",
                format!(
                    "{} is not between 1 and 2**40 = {MAX_READ_AHEAD_BYTES} (bytes)",
                    self.read_ahead_bytes
                ),
            ));
        }
        if self.prefetch_size == 0 || self.prefetch_size > MAX_PREFETCH_SIZE {
            return Err(Error::config(
                "ReaderConfig.prefetch_size",
                format!(
                    "{} is not between 1 and 2**20 = {MAX_PREFETCH_SIZE} (samples read ahead)",
                    self.prefetch_size
                ),
            ));
        }
        if self.world_size == 0 {
            return Err(Error::config(
                "ReaderConfig.world_size",
                "must be at least 1",
            ));
        }
        if let Some(len) = self.epoch_len.filter(|&l| l > MAX_EPOCH_LEN) {
            return Err(Error::config(
                "ReaderConfig.samples_per_epoch",
                format!("{len} is above the limit of 2**40 = {MAX_EPOCH_LEN}"),
            ));
        }
        if self.rank >= self.world_size {
            return Err(Error::config(
                "ReaderConfig.rank",
                format!(
                    "rank {} is not below world_size {}",
                    self.rank, self.world_size
                ),
            ));
        }
        Ok(())
    }

    pub fn split(&self) -> RankSplit {
        RankSplit {
            rank: self.rank,
            world_size: self.world_size,
            policy: self.policy,
        }
    }
}

/// The iterator state: plain data, serialised as JSON by the bindings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct State {
    pub format_version: u32,
    /// The [`SAMPLER_VERSION`] whose order `position` points into. `None`: the state predates
    /// this field (it was taken under version 2), and is refused with that explanation.
    ///
    /// [`SAMPLER_VERSION`]: crate::sampler::SAMPLER_VERSION
    #[serde(default)]
    pub sampler_version: Option<u32>,
    /// Identifies the caches (their content fingerprints, in order).
    pub fingerprint: String,
    /// Identifies the weight table ("uniform" when every weight is equal to every other).
    pub weights_fingerprint: String,
    pub seed: u64,
    pub shuffle: bool,
    pub epoch_len: u64,
    pub epoch: u64,
    /// Global position in the epoch's order reached by all ranks together.
    pub position: u64,
    pub rank: u64,
    pub world_size: u64,
}

impl State {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain data serialises")
    }

    /// Parses a state. Only a JSON object is a state: serde would also take the values as
    /// an array, in field order, which no `state_dict()` produces.
    pub fn from_json(text: &str) -> Result<State> {
        let not_a_state = |e: serde_json::Error| {
            Error::State(format!(
                "not a DatasetRT iterator state: {e}; pass the dict that state_dict() returned"
            ))
        };
        let kind = match serde_json::from_str(text).map_err(not_a_state)? {
            value @ serde_json::Value::Object(_) => {
                return serde_json::from_value(value).map_err(not_a_state)
            }
            serde_json::Value::Null => "null",
            serde_json::Value::Bool(_) => "a boolean",
            serde_json::Value::Number(_) => "a number",
            serde_json::Value::String(_) => "a string",
            serde_json::Value::Array(_) => "a list",
        };
        Err(Error::State(format!(
            "not a DatasetRT iterator state: a state is a JSON object (a dict), this is {kind}; \
             pass the dict that state_dict() returned"
        )))
    }
}

/// The last epoch. `u64::MAX` is never an epoch: a state naming it is refused, and the epoch
/// after `LAST_EPOCH` is an error rather than a wrap to epoch 0 (which would replay epoch 0's
/// order under the name of a new epoch).
pub const LAST_EPOCH: u64 = u64::MAX - 1;

/// The epoch after `epoch`: the one place where an epoch advances.
pub fn next_epoch(epoch: u64) -> Result<u64> {
    if epoch >= LAST_EPOCH {
        return Err(Error::State(format!(
            "epoch {epoch} is the last epoch there is (2**64 - 2), no epoch follows it: call \
             set_epoch to choose the epoch of the next pass"
        )));
    }
    Ok(epoch + 1)
}

/// Where a pass of `epoch` leaves the iterator, as (epoch, global position): the position it
/// reached, or the start of the next epoch once it `finished` (every sample of this rank was
/// received).
pub fn resume_point(epoch: u64, position: u64, finished: bool) -> Result<(u64, u64)> {
    if finished {
        Ok((next_epoch(epoch)?, 0))
    } else {
        Ok((epoch, position))
    }
}

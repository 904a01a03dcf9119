//! What the owner fixes when it creates a pass's segments: the ring's geometry, the names of
//! the segments, and the pass they carry (with the checks every party makes of it).

use std::any::Any;

use crate::layout::*;
use crate::segment::Segment;
use crate::{Result, ShmError};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Geometry {
    pub num_slots: u32,
    pub slot_size: u64,
    pub max_consumers: u32,
}

impl Geometry {
    /// The ring segment's length, or why no ring has this geometry.
    pub fn ring_bytes(&self) -> Result<u64> {
        if self.num_slots == 0 || self.slot_size == 0 || self.slot_size % PAGE != 0 {
            return Err(ShmError::Protocol(format!(
                "invalid ring geometry {self:?}: slots and a page-multiple slot size are required"
            )));
        }
        self.slot_size
            .checked_mul(u64::from(self.num_slots))
            .filter(|&b| i64::try_from(b).is_ok())
            .ok_or_else(|| {
                ShmError::Protocol(format!(
                    "a ring of {} slots of {} bytes is too large: lower slot_size_bytes or \
                     prefetch_factor",
                    self.num_slots, self.slot_size
                ))
            })
    }

    /// The control segment's length.
    pub fn ctl_bytes(&self) -> u64 {
        ctl_len(self.num_slots, self.max_consumers)
    }
}

/// The names of a pass's entries in /dev/shm, and its owner (the loader chooses them).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Names {
    pub ctl: String,
    pub ring: String,
    /// Further entries removed together with the segments' names (the owner's private
    /// directory).
    pub also_unlink: Vec<String>,
    pub owner_pid: u64,
}

/// A pass's two segments as their creator made them (see [`Segment::create`]).
pub struct Created {
    pub ctl: Segment,
    pub ring: Segment,
    /// Further entries removed together with the segments' names.
    pub also_unlink: Vec<String>,
    /// Kept for as long as the owner's ring lives: the creator's claims on its names.
    pub keep: Box<dyn Any + Send + Sync>,
}

/// What one pass (one `iter(loader)`) reads: fixed when the segments are created.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pass {
    pub total_batches: u64,
    pub batch_size: u64,
    pub rank_samples: u64,
    pub epoch: u64,
    pub start: u64,
    pub epoch_len: u64,
    pub rank: u64,
    pub world_size: u64,
    /// How the epoch is split over ranks: [`POLICY_PAD`] or [`POLICY_DROP`].
    pub policy: u32,
    /// Parties other than the owner that must attach before the names are removed.
    pub expected_attach: u32,
}

impl Pass {
    /// Why this pass, read from a control segment, is not one an owner writes: the producer
    /// indexes the epoch order and the rank's samples with these numbers. Whether
    /// `rank_samples` is this rank's share of the epoch is the loader's to check (it owns the
    /// rank split).
    pub fn check(&self) -> std::result::Result<(), String> {
        if self.world_size == 0 || self.rank >= self.world_size {
            return Err(format!(
                "rank {} is not below world size {}",
                self.rank, self.world_size
            ));
        }
        if self.start > self.epoch_len {
            return Err(format!(
                "pass start {} is past the epoch length {}",
                self.start, self.epoch_len
            ));
        }
        if self.policy != POLICY_PAD && self.policy != POLICY_DROP {
            return Err(format!(
                "rank policy {} is neither pad nor drop",
                self.policy
            ));
        }
        if self.rank_samples > self.epoch_len - self.start {
            return Err(format!(
                "{} rank samples, more than the {} the pass has left",
                self.rank_samples,
                self.epoch_len - self.start
            ));
        }
        if self.batch_size == 0 || self.rank_samples.checked_add(self.batch_size).is_none() {
            return Err(format!("batch size {} is out of range", self.batch_size));
        }
        let (full, all) = (
            self.rank_samples / self.batch_size,
            self.rank_samples.div_ceil(self.batch_size),
        );
        if self.total_batches != full && self.total_batches != all {
            return Err(format!(
                "{} batches of {} for {} samples",
                self.total_batches, self.batch_size, self.rank_samples
            ));
        }
        // Tickets share a word with the pass generation (see `Ring::take_ticket`).
        if self.total_batches > u64::from(u32::MAX) {
            return Err(format!(
                "{} batches in one pass is more than the ring counts ({}): raise batch_size",
                self.total_batches,
                u32::MAX
            ));
        }
        Ok(())
    }
}

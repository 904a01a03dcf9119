//! What a pass's description means: the rank split it reads under, whether its counts agree
//! with that split, and the epoch position once some of its batches were delivered. A leaf
//! module (it imports nothing of this crate): the plan, the producer and the segments'
//! lifecycle all interpret a pass through it.

use dataset_rt_core::sampler::{RankPolicy, RankSplit};
use dataset_rt_shm::layout::{POLICY_DROP, POLICY_PAD};
use dataset_rt_shm::ring::{Pass, Ring};
use dataset_rt_shm::ShmError;

/// The control segment's word for a rank policy.
pub fn policy_word(policy: RankPolicy) -> u32 {
    match policy {
        RankPolicy::Pad => POLICY_PAD,
        RankPolicy::Drop => POLICY_DROP,
    }
}

/// The rank split a pass reads under (its policy word checked by [`Pass::check`]).
pub fn split_of(pass: &Pass) -> RankSplit {
    RankSplit {
        rank: pass.rank,
        world_size: pass.world_size,
        policy: if pass.policy == POLICY_DROP {
            RankPolicy::Drop
        } else {
            RankPolicy::Pad
        },
    }
}

/// Why a pass's rank samples are not this rank's share of the rest of the epoch (the
/// transport checks the rest of the pass).
pub fn check_split(pass: &Pass) -> Result<(), String> {
    pass.check()?;
    let rank_samples = split_of(pass).rank_len(pass.epoch_len, pass.start);
    if pass.rank_samples != rank_samples {
        return Err(format!(
            "{} rank samples, the split gives {rank_samples}",
            pass.rank_samples
        ));
    }
    Ok(())
}

/// The global position in the epoch's order once the training loop received batches
/// `0..=seq` of `pass`: every rank together has read that far.
pub fn position_after(pass: &Pass, seq: u64) -> u64 {
    let samples = ((seq + 1).saturating_mul(pass.batch_size)).min(pass.rank_samples);
    split_of(pass).global_progress(pass.epoch_len, pass.start, samples)
}

/// Records on `ring` that the training loop received batch `seq` (the next one), and moves
/// the iterator state to the position after it.
pub fn mark_delivered(ring: &Ring, seq: u64) -> std::result::Result<(), ShmError> {
    ring.mark_delivered(seq, position_after(&ring.pass(), seq))
}

//! An iterator state as JSON, loaded into a dataset of the golden cache the way the bindings
//! load one, then resumed: the epoch order and this rank's share of what is left. In the text,
//! `@FP@` and `@WFP@` stand for the dataset's and the weight table's fingerprints, so that the
//! checks after them are reached. The first byte picks the reader's options (shuffle, epoch
//! length, rank policy, weights), the second the rank and world size.
#![no_main]

use std::sync::{Arc, OnceLock};

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::{Dataset, ReadOptions, State, WeightTable};
use dataset_rt_core::sampler::RankPolicy;
use dataset_rt_fuzz::{forge, guarded, scratch};
use libfuzzer_sys::fuzz_target;

fn dataset() -> &'static Dataset {
    static DS: OnceLock<Dataset> = OnceLock::new();
    DS.get_or_init(|| {
        let dir = forge::golden().write(&scratch().join("state"));
        let cache = Cache::open(&dir, Validation::Full).expect("the golden cache opens");
        Dataset::new(vec![Arc::new(cache)])
    })
}

fuzz_target!(|data: &[u8]| {
    guarded(|| {
        let [flags, ranks, text @ ..] = data else {
            return;
        };
        let Ok(text) = std::str::from_utf8(text) else {
            return;
        };
        let ds = dataset();
        let world_size = u64::from(ranks % 4) + 1;
        let opts = ReadOptions {
            seed: 7,
            shuffle: flags & 1 != 0,
            prefetch_size: 4,
            epoch_len: [None, Some(1), Some(4), Some(13)][usize::from((flags >> 1) & 3)],
            rank: u64::from(ranks >> 4) % world_size,
            world_size,
            policy: if flags & 8 != 0 {
                RankPolicy::Drop
            } else {
                RankPolicy::Pad
            },
            io_depth: dataset_rt_core::dataset::DEFAULT_IO_DEPTH,
            read_ahead_bytes: dataset_rt_core::dataset::DEFAULT_READ_AHEAD_BYTES,
        };
        opts.validate().expect("the harness's options are valid");
        let weights = if flags & 16 != 0 {
            WeightTable::from_weights(vec![1.0, 2.0, 0.5, 1.0, 3.0, 1.0])
        } else {
            WeightTable::uniform()
        };
        let text = text
            .replace("@FP@", ds.fingerprint())
            .replace("@WFP@", &weights.fingerprint);
        let Ok(state) = State::from_json(&text) else {
            return;
        };
        let Ok((epoch, position)) = ds.check_state(&state, &opts, &weights) else {
            return;
        };
        // Resuming: the order of the state's epoch and this rank's share from its position.
        let epoch_len = ds.epoch_len(&opts);
        assert!(
            position <= epoch_len,
            "position {position} past {epoch_len}"
        );
        let Ok(order) = ds.try_order(&opts, &weights, epoch) else {
            return;
        };
        assert_eq!(order.len(), epoch_len);
        let split = opts.split();
        let len = split.rank_len(epoch_len, position);
        for k in 0..len {
            let g = split.global_position(epoch_len, position, k);
            assert!(g < epoch_len, "global position {g} of {epoch_len}");
            assert!(order.at(g) < ds.len());
            assert!(split.global_progress(epoch_len, position, k + 1) <= epoch_len);
        }
        // What a checkpoint taken now would say, and that it loads again.
        let again = ds.state(&opts, &weights, epoch, position).to_json();
        let again = State::from_json(&again).expect("a state it wrote parses");
        assert_eq!(
            ds.check_state(&again, &opts, &weights).ok(),
            Some((epoch, position))
        );
    });
});

//! Iterator states as the core checks them, and resume on the rank split: a pass checkpointed
//! and resumed on the same world size gives every rank what the uninterrupted pass gives it,
//! padding included.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::{
    next_epoch, resume_point, Dataset, EpochReader, ReadOptions, State, WeightTable, LAST_EPOCH,
};
use dataset_rt_core::pool::Pool;
use dataset_rt_core::sampler::{RankPolicy, SAMPLER_VERSION};
use dataset_rt_core::Error;
use dataset_rt_testkit::{numbered, process_dir, write_cache, writer_options};
use proptest::prelude::*;

const N: u64 = 23;

struct Fixture {
    pool: Arc<Pool>,
    dataset: Arc<Dataset>,
}

/// One cache of `N` samples (payload = the sample's index), written once for every test.
fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let dir = process_dir();
        let pool = Pool::new(2).unwrap();
        write(&pool, dir, "c");
        let cache = Cache::open(&dir.join("c"), Validation::Full).unwrap();
        Fixture {
            dataset: Arc::new(Dataset::new(vec![Arc::new(cache)])),
            pool,
        }
    })
}

fn write(pool: &Arc<Pool>, base: &Path, name: &str) {
    let samples = (0..N).map(|i| numbered(i, i.to_le_bytes().to_vec()));
    write_cache(pool, base, name, writer_options(), samples);
}

fn options(epoch_len: u64, rank: u64, world_size: u64, policy: RankPolicy) -> ReadOptions {
    ReadOptions {
        seed: 11,
        shuffle: true,
        prefetch_size: 3,
        epoch_len: Some(epoch_len),
        rank,
        world_size,
        policy,
        io_depth: dataset_rt_core::dataset::DEFAULT_IO_DEPTH,
        read_ahead_bytes: dataset_rt_core::dataset::DEFAULT_READ_AHEAD_BYTES,
    }
}

/// A pass of one rank from `start`: reads `limit` samples (all when `None`); returns the global
/// sample indices read and the position a checkpoint then stores.
fn read(opts: &ReadOptions, epoch: u64, start: u64, limit: Option<u64>) -> (Vec<u64>, u64) {
    let f = fixture();
    let order = f
        .dataset
        .try_order(opts, &WeightTable::uniform(), epoch)
        .unwrap();
    let mut reader = EpochReader::new(
        f.pool.clone(),
        f.dataset.clone(),
        Arc::new(order),
        opts,
        epoch,
        start,
    );
    let mut got = Vec::new();
    while limit.is_none_or(|l| (got.len() as u64) < l) {
        let Some(fetched) = reader.next_sample() else {
            break;
        };
        let fetched = fetched.unwrap();
        got.push(f.dataset.cache_start(fetched.cache as usize) + fetched.row);
    }
    (got, reader.position())
}

fn state(opts: &ReadOptions, epoch: u64, position: u64) -> State {
    fixture()
        .dataset
        .state(opts, &WeightTable::uniform(), epoch, position)
}

fn refusal(state: &State) -> String {
    let f = fixture();
    let opts = options(state.epoch_len, 0, 1, RankPolicy::Pad);
    let text = state.to_json();
    let err = State::from_json(&text)
        .and_then(|s| f.dataset.check_state(&s, &opts, &WeightTable::uniform()))
        .unwrap_err();
    assert!(matches!(err, Error::State(_)), "{err:?}");
    err.to_string()
}

#[test]
fn padded_resume_on_the_same_world_size_delivers_the_same_pad() {
    // 11 positions on 2 ranks: rank 1's 6th sample is a pad. Checkpoint after 2 samples per
    // rank and resume on 2 ranks: rank 1 still ends with the pad of the uninterrupted pass.
    let opts = options(11, 1, 2, RankPolicy::Pad);
    let (full, _) = read(&opts, 0, 0, None);
    assert_eq!(full.len(), 6);
    let order = fixture()
        .dataset
        .try_order(&opts, &WeightTable::uniform(), 0)
        .unwrap();
    assert_eq!(
        full[5],
        order.at(0),
        "the pad repeats the epoch's first position"
    );
    let (head, position) = read(&opts, 0, 0, Some(2));
    assert_eq!(position, 4);
    let (tail, _) = read(&opts, 0, position, None);
    assert_eq!([head, tail].concat(), full);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, ..ProptestConfig::default() })]

    /// For every rank: what it read before a checkpoint, then what it reads after resuming the
    /// checkpoint's state (through JSON and `check_state`) on the same world size, equals the
    /// uninterrupted pass, padding included; and the state after the resumed pass is the next
    /// epoch's start.
    #[test]
    fn resume_on_the_same_world_size_matches_the_uninterrupted_pass(
        epoch_len in 0u64..60,
        world_size in 1u64..6,
        pad: bool,
        cut in 0.0f64..=1.0,
        epoch in 0u64..3,
    ) {
        let policy = if pad { RankPolicy::Pad } else { RankPolicy::Drop };
        let rank_len = options(epoch_len, 0, world_size, policy).split().rank_len(epoch_len, 0);
        let k = ((rank_len as f64) * cut) as u64;
        let mut positions = Vec::new();
        for rank in 0..world_size {
            let opts = options(epoch_len, rank, world_size, policy);
            let (full, end) = read(&opts, epoch, 0, None);
            prop_assert_eq!(full.len() as u64, rank_len);
            let (head, position) = read(&opts, epoch, 0, Some(k));
            positions.push(position);
            let text = state(&opts, epoch, position).to_json();
            let loaded = State::from_json(&text).unwrap();
            let (e, start) = fixture()
                .dataset
                .check_state(&loaded, &opts, &WeightTable::uniform())
                .unwrap();
            prop_assert_eq!((e, start), (epoch, position));
            let (tail, resumed_end) = read(&opts, e, start, None);
            prop_assert_eq!([head, tail].concat(), full, "rank {}", rank);
            prop_assert_eq!(resumed_end, end);
        }
        // Every rank's checkpoint names the same global position.
        prop_assert!(positions.windows(2).all(|p| p[0] == p[1]));
    }
}

#[test]
fn a_list_is_not_a_state() {
    let opts = options(N, 0, 1, RankPolicy::Pad);
    let good = state(&opts, 0, 3);
    // The values in field order: serde alone would take them as the struct.
    let serde_json::Value::Object(fields) = serde_json::to_value(&good).unwrap() else {
        panic!("a state serialises as an object");
    };
    let list = serde_json::Value::Array(fields.into_iter().map(|(_, v)| v).collect());
    let err = State::from_json(&list.to_string()).unwrap_err();
    assert!(matches!(err, Error::State(_)), "{err:?}");
    let msg = err.to_string();
    assert!(
        msg.contains("a state is a JSON object (a dict), this is a list"),
        "{msg}"
    );
    assert!(msg.contains("state_dict()"), "{msg}");
    for (text, kind) in [
        ("null", "null"),
        ("3", "a number"),
        ("\"{}\"", "a string"),
        ("true", "a boolean"),
    ] {
        let msg = State::from_json(text).unwrap_err().to_string();
        assert!(msg.contains(&format!("this is {kind}")), "{text}: {msg}");
    }
    // The object itself still loads.
    assert_eq!(State::from_json(&good.to_json()).unwrap(), good);
}

#[test]
fn a_state_of_another_sampler_version_is_refused() {
    let opts = options(N, 0, 1, RankPolicy::Pad);
    let good = state(&opts, 0, 3);
    assert_eq!(good.sampler_version, Some(SAMPLER_VERSION));
    let computes = format!(
        "and this DatasetRT computes epoch orders with sampler_version {SAMPLER_VERSION}: its \
         position points into an order this version does not produce"
    );
    // A checkpoint from before states named their sampler: taken under version 2.
    let serde_json::Value::Object(mut fields) = serde_json::to_value(&good).unwrap() else {
        panic!("a state serialises as an object");
    };
    fields.remove("sampler_version").unwrap();
    let old = State::from_json(&serde_json::Value::Object(fields).to_string()).unwrap();
    assert_eq!(old.sampler_version, None);
    let msg = refusal(&old);
    assert!(
        msg.contains("the state names no sampler_version: an earlier DatasetRT took it, under sampler_version 2"),
        "{msg}"
    );
    assert!(msg.contains(&computes), "{msg}");
    assert!(msg.contains("Call set_epoch"), "{msg}");
    for v in [2, SAMPLER_VERSION + 1] {
        let msg = refusal(&State {
            sampler_version: Some(v),
            ..good.clone()
        });
        assert!(
            msg.contains(&format!(
                "the state was taken under sampler_version {v}, {computes}"
            )),
            "{msg}"
        );
    }
}

#[test]
fn world_size_0_is_refused() {
    let mut s = state(&options(N, 0, 1, RankPolicy::Pad), 0, 3);
    s.world_size = 0;
    let msg = refusal(&s);
    assert!(msg.contains("world_size 0 is not a world size"), "{msg}");
    assert!(
        msg.contains("load the dict that state_dict() returned"),
        "{msg}"
    );
}

#[test]
fn rank_not_below_world_size_is_refused() {
    for (rank, world_size) in [(1, 1), (99, 1), (4, 4), (u64::MAX, 3)] {
        let mut s = state(&options(N, 0, 1, RankPolicy::Pad), 0, 3);
        (s.rank, s.world_size) = (rank, world_size);
        let msg = refusal(&s);
        assert!(
            msg.contains(&format!("rank {rank} is not below world_size {world_size}")),
            "{msg}"
        );
    }
}

#[test]
fn the_largest_u64_is_not_an_epoch() {
    let opts = options(N, 0, 1, RankPolicy::Pad);
    let msg = refusal(&state(&opts, u64::MAX, 3));
    assert!(
        msg.contains("epoch 18446744073709551615 is not an epoch"),
        "{msg}"
    );
    assert!(msg.contains("set_epoch"), "{msg}");
    // The last epoch is one.
    let f = fixture();
    let loaded = f
        .dataset
        .check_state(&state(&opts, LAST_EPOCH, 3), &opts, &WeightTable::uniform())
        .unwrap();
    assert_eq!(loaded, (LAST_EPOCH, 3));
}

#[test]
fn epochs_advance_without_wrapping() {
    assert_eq!(next_epoch(0).unwrap(), 1);
    assert_eq!(next_epoch(LAST_EPOCH - 1).unwrap(), LAST_EPOCH);
    for epoch in [LAST_EPOCH, u64::MAX] {
        let err = next_epoch(epoch).unwrap_err();
        assert!(matches!(err, Error::State(_)), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("epoch {epoch} is the last epoch")),
            "{msg}"
        );
        assert!(msg.contains("call set_epoch"), "{msg}");
    }
    // A pass that did not finish stays where it is; a finished one moves to the next epoch.
    assert_eq!(resume_point(LAST_EPOCH, 7, false).unwrap(), (LAST_EPOCH, 7));
    assert_eq!(resume_point(5, 7, true).unwrap(), (6, 0));
    assert!(resume_point(LAST_EPOCH, 7, true).is_err());
}

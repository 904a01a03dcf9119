//! The pass plan: slot count and slot size, batches per pass under drop_last and the rank
//! split, and the loader's epochs and state through the core state machine over real rings.

use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::{Dataset, ReadOptions, WeightTable};
use dataset_rt_core::pool::Pool;
use dataset_rt_core::sampler::RankPolicy;
use dataset_rt_loader::batch::{max_sample_bytes, slot_size_for};
use dataset_rt_loader::lifecycle;
use dataset_rt_loader::plan::{self, check_split, num_slots, Plan};
use dataset_rt_shm::layout::{C_RANK_SAMPLES, MIN_SLOT_SIZE, PAGE};
use dataset_rt_shm::segment::path_of;
use dataset_rt_testkit::{numbered, write_cache, writer_options};
use proptest::prelude::*;

const SAMPLES: u64 = 10;

struct Setup {
    _dir: tempfile::TempDir,
    ds: Dataset,
}

/// One raw cache of `SAMPLES` samples, sample `i` of `100 + 10 i` bytes.
fn setup() -> Setup {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    let samples = (0..SAMPLES).map(|i| numbered(i, vec![i as u8; 100 + 10 * i as usize]));
    let path = write_cache(&pool, dir.path(), "c", writer_options(), samples);
    let cache = Cache::open(&path, Validation::Full).unwrap();
    Setup {
        _dir: dir,
        ds: Dataset::new(vec![Arc::new(cache)]),
    }
}

fn opts(rank: u64, world_size: u64, policy: RankPolicy) -> ReadOptions {
    ReadOptions {
        seed: 3,
        shuffle: true,
        prefetch_size: 4,
        epoch_len: None,
        rank,
        world_size,
        policy,
        io_depth: dataset_rt_core::dataset::DEFAULT_IO_DEPTH,
        read_ahead_bytes: dataset_rt_core::dataset::DEFAULT_READ_AHEAD_BYTES,
    }
}

#[test]
fn the_slot_count_is_prefetch_factor_per_worker_with_one_more_without_workers() {
    assert_eq!(num_slots(0, 2).unwrap(), 3);
    assert_eq!(num_slots(0, 1).unwrap(), 3, "at least 2, plus the one held");
    assert_eq!(num_slots(1, 1).unwrap(), 2, "at least 2");
    assert_eq!(num_slots(1, 2).unwrap(), 2);
    assert_eq!(num_slots(4, 2).unwrap(), 8);
    assert_eq!(num_slots(3, 5).unwrap(), 15);
    let err = num_slots(u32::MAX, 2).unwrap_err().to_string();
    assert!(err.contains("prefetch_factor"), "{err}");
}

#[test]
fn the_slot_size_is_a_page_multiple_that_holds_a_batch_of_the_largest_slot_entries() {
    let s = setup();
    let plan = Plan::new(4, false, 1);
    let one = opts(0, 1, RankPolicy::Pad);
    assert_eq!(plan.slot_size(&s.ds, &one, Some(1)).unwrap(), PAGE);
    assert_eq!(
        plan.slot_size(&s.ds, &one, Some(PAGE + 1)).unwrap(),
        2 * PAGE
    );
    let sized = plan.slot_size(&s.ds, &one, None).unwrap();
    let largest = max_sample_bytes(&s.ds).unwrap();
    // Raw records travel as references: a sample is its offsets entry and its metadata
    // ({"i": int}), not its payload (190 bytes at most).
    assert_eq!(largest, 56 + 18);
    assert_eq!(sized, slot_size_for(largest, 4));
    assert!(sized >= MIN_SLOT_SIZE && sized % PAGE == 0);
    // Large batches of the largest sample still fit.
    let plan = Plan::new(1000, false, 1);
    let sized = plan
        .slot_size(&s.ds, &opts(0, 1, RankPolicy::Pad), None)
        .unwrap();
    assert!(sized >= SAMPLES * largest && sized % PAGE == 0, "{sized}");
}

#[test]
fn a_batch_size_beyond_the_epoch_sizes_slots_for_the_samples_one_rank_reads() {
    let s = setup();
    let largest = max_sample_bytes(&s.ds).unwrap();
    let plan = Plan::new(1 << 24, false, 1);
    // The whole epoch, on one rank: 10 samples; on rank 1 of 3 with padding: 4.
    for (world, rank_samples) in [(1, SAMPLES), (3, 4)] {
        let o = opts(1 % world, world, RankPolicy::Pad);
        let sized = plan.slot_size(&s.ds, &o, None).unwrap();
        assert_eq!(
            sized,
            slot_size_for(largest, rank_samples),
            "world size {world}"
        );
    }
    assert!(slot_size_for(largest, SAMPLES) < slot_size_for(largest, 1 << 24));
    // More samples per epoch than the caches hold: slots for the epoch's batches.
    let o = ReadOptions {
        epoch_len: Some(1 << 20),
        ..opts(0, 1, RankPolicy::Pad)
    };
    let sized = Plan::new(5000, false, 1)
        .slot_size(&s.ds, &o, None)
        .unwrap();
    assert_eq!(sized, slot_size_for(largest, 5000));
}

#[test]
fn batches_per_pass_follow_drop_last_and_the_rank_split() {
    let s = setup();
    // (batch size, drop_last, rank, world size, policy, start) → (rank samples, batches)
    let cases = [
        (3, false, 0, 1, RankPolicy::Pad, 0, (10, 4)),
        (3, true, 0, 1, RankPolicy::Pad, 0, (10, 3)),
        (5, true, 0, 1, RankPolicy::Pad, 0, (10, 2)),
        (3, false, 0, 3, RankPolicy::Pad, 0, (4, 2)),
        (3, true, 2, 3, RankPolicy::Pad, 0, (4, 1)),
        (3, false, 1, 3, RankPolicy::Drop, 0, (3, 1)),
        (2, false, 0, 3, RankPolicy::Pad, 5, (2, 1)),
        (2, false, 0, 1, RankPolicy::Pad, 10, (0, 0)),
        (4, true, 0, 4, RankPolicy::Drop, 1, (2, 0)),
    ];
    for (batch, drop_last, rank, world, policy, start, expected) in cases {
        let plan = Plan::new(batch, drop_last, 1);
        let o = opts(rank, world, policy);
        let pass = plan.pass_at(&s.ds, &o, 7, start, 2);
        let what = format!(
            "batch {batch} drop_last {drop_last} rank {rank}/{world} {policy:?} from {start}"
        );
        assert_eq!((pass.rank_samples, pass.total_batches), expected, "{what}");
        assert_eq!(
            (pass.epoch, pass.start, pass.epoch_len),
            (7, start, SAMPLES)
        );
        assert_eq!(pass.expected_attach, 3);
        check_split(&pass).unwrap_or_else(|e| panic!("{what}: {e}"));
        if start == 0 {
            assert_eq!(plan.len(&s.ds, &o), pass.total_batches, "{what}");
        }
    }
}

proptest! {
    /// Every pass a plan makes is one the transport and the split accept; its batches cover
    /// the rank's samples (all of them, or the whole batches under drop_last); and the
    /// position after its last batch is the end of the epoch.
    #[test]
    fn every_planned_pass_is_consistent(
        batch in 1u64..12,
        drop_last: bool,
        world in 1u64..5,
        rank_frac in 0.0..1.0f64,
        drop: bool,
        start in 0u64..=SAMPLES,
    ) {
        let s = SETUP.with(|s| s.ds.clone());
        let rank = ((world as f64) * rank_frac) as u64;
        let policy = if drop { RankPolicy::Drop } else { RankPolicy::Pad };
        let plan = Plan::new(batch, drop_last, 1);
        let pass = plan.pass_at(&s, &opts(rank, world, policy), 0, start, 1);
        prop_assert!(check_split(&pass).is_ok());
        let covered = pass.total_batches * batch;
        if drop_last {
            prop_assert!(covered <= pass.rank_samples && pass.rank_samples - covered < batch);
        } else {
            prop_assert!(covered >= pass.rank_samples && covered - pass.rank_samples < batch);
        }
        if pass.total_batches > 0 {
            let end = plan::position_after(&pass, pass.total_batches - 1);
            prop_assert!(end <= SAMPLES && end >= start);
            if !drop_last && !drop {
                prop_assert_eq!(end, SAMPLES);
            }
        }
    }
}

thread_local! {
    static SETUP: SetupDs = {
        let s = setup();
        SetupDs { ds: Arc::new(s.ds), _dir: s._dir }
    };
}

struct SetupDs {
    ds: Arc<Dataset>,
    _dir: tempfile::TempDir,
}

#[test]
fn the_state_follows_the_live_ring_and_the_next_pass_the_next_epoch() {
    let s = setup();
    let o = opts(0, 1, RankPolicy::Pad);
    let weights = WeightTable::uniform();
    let plan = Plan::new(3, false, 1);
    plan.set_epoch(4).unwrap();
    let mut pass = plan
        .plan_pass(&s.ds, &o, &weights, 0, 2, PAGE, false)
        .unwrap();
    assert_eq!((pass.start.epoch, pass.start.start), (4, 0));
    assert_eq!(pass.geometry.num_slots, 3);
    assert_eq!(pass.pass.total_batches, 4);
    let ring = plan
        .create_pass(&mut pass, u64::from(std::process::id()), &weights)
        .unwrap();
    let spec_file = lifecycle::private_dir(&ring).join("spec.json");
    let written: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&spec_file).unwrap()).unwrap();
    assert_eq!(written["ctl_name"], ring.ctl_name());
    ring.unlink();
    // Not committed yet: the state is still the chosen epoch's start.
    assert_eq!(plan.snapshot().unwrap().epoch, 4);
    assert!(plan.commit(&pass, ring.clone()));
    plan::mark_delivered(&ring, 0).unwrap();
    plan::mark_delivered(&ring, 1).unwrap();
    let snap = plan.snapshot().unwrap();
    assert_eq!((snap.epoch, snap.position), (4, 6));
    assert_eq!(snap.weights_fingerprint.as_deref(), Some("uniform"));
    assert!(plan.end(&ring));
    plan::mark_delivered(&ring, 2).unwrap();
    assert_eq!(
        plan.snapshot().unwrap().position,
        6,
        "an ended pass no longer moves"
    );
    let next = plan
        .plan_pass(&s.ds, &o, &weights, 0, 2, PAGE, false)
        .unwrap();
    assert_eq!((next.start.epoch, next.start.start), (5, 0));
    // A state loaded after planning wins over the planned pass.
    plan.load(9, 4, "uniform".into());
    assert!(!plan.commit(&next, ring));
    let snap = plan.snapshot().unwrap();
    assert_eq!((snap.epoch, snap.position), (9, 4));
}

#[test]
fn attach_refuses_a_pass_whose_rank_samples_are_not_the_split() {
    let s = setup();
    let o = opts(0, 1, RankPolicy::Pad);
    let plan = Plan::new(4, false, 1);
    let mut pass = plan
        .plan_pass(&s.ds, &o, &WeightTable::uniform(), 1, 2, PAGE, false)
        .unwrap();
    let ring = plan
        .create_pass(
            &mut pass,
            u64::from(std::process::id()),
            &WeightTable::uniform(),
        )
        .unwrap();
    let ctl = ring.ctl_name().to_owned();
    let attached = lifecycle::attach(&ctl).map(|r| r.pass());
    assert_eq!(attached.unwrap(), pass.pass);
    // 9 of the 10 samples: a count the transport accepts, the split does not.
    let mut bytes = std::fs::read(path_of(&ctl)).unwrap();
    bytes[C_RANK_SAMPLES..C_RANK_SAMPLES + 8].copy_from_slice(&9u64.to_le_bytes());
    std::fs::write(path_of(&ctl), &bytes).unwrap();
    let refused = lifecycle::attach(&ctl).err().map(|e| e.to_string());
    ring.unlink();
    let refused = refused.expect("attached");
    assert!(
        refused.contains("9 rank samples, the split gives 10"),
        "{refused}"
    );
}

#[test]
fn the_producer_spec_carries_the_readers_io_depth_and_read_ahead_bytes() {
    let s = setup();
    let plan = Plan::new(4, false, 1);
    let read = ReadOptions {
        io_depth: 3,
        read_ahead_bytes: 5000,
        ..opts(0, 1, RankPolicy::Pad)
    };
    let spec = plan
        .spec(&s.ds, &read, &WeightTable::uniform(), false)
        .unwrap();
    assert_eq!((spec.io_depth, spec.read_ahead_bytes), (3, 5000));
    // A spec written without them (an older training process) reads with the defaults.
    let mut json: serde_json::Value = serde_json::to_value(&spec).unwrap();
    let fields = json.as_object_mut().unwrap();
    fields.remove("io_depth").unwrap();
    fields.remove("read_ahead_bytes").unwrap();
    let back: dataset_rt_loader::producer::ProducerSpec = serde_json::from_value(json).unwrap();
    assert_eq!(
        (back.io_depth, back.read_ahead_bytes),
        (
            dataset_rt_core::dataset::DEFAULT_IO_DEPTH,
            dataset_rt_core::dataset::DEFAULT_READ_AHEAD_BYTES
        )
    );
}

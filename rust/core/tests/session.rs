//! One process's reading of a dataset ([`Session`]): consecutive passes read consecutive
//! epochs, the state is what was handed out, a loaded state resumes at the next sample,
//! `set_epoch` wins over a loaded state, and a pass that cannot start changes nothing.

use std::path::Path;
use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::{Dataset, ReadOptions, LAST_EPOCH};
use dataset_rt_core::pool::Pool;
use dataset_rt_core::sampler::RankPolicy;
use dataset_rt_core::session::{Session, StartedPass};
use dataset_rt_core::writer::WriterOptions;
use dataset_rt_core::ErrorKind;
use dataset_rt_testkit::{numbered, write_cache, writer_options};

const N: u64 = 29;

/// A session over one cache of `N` samples whose payload is the sample's index.
fn session(dir: &Path) -> Session {
    let pool = Pool::new(2).unwrap();
    let opts = WriterOptions {
        shard_size: 256,
        ..writer_options()
    };
    let samples = (0..N).map(|i| numbered(i, i.to_le_bytes().to_vec()));
    let path = write_cache(&pool, dir, "c", opts, samples);
    let cache = Cache::open(&path, Validation::Full).unwrap();
    let read = ReadOptions {
        seed: 5,
        shuffle: true,
        prefetch_size: 4,
        epoch_len: None,
        rank: 0,
        world_size: 1,
        policy: RankPolicy::Pad,
        io_depth: dataset_rt_core::dataset::DEFAULT_IO_DEPTH,
        read_ahead_bytes: dataset_rt_core::dataset::DEFAULT_READ_AHEAD_BYTES,
    };
    Session::new(pool, Arc::new(Dataset::new(vec![Arc::new(cache)])), read)
}

/// Takes up to `n` samples of `pass` one at a time, as an iterator hands them out (the rest of
/// the last chunk read is dropped: a pass is read on by `take` only after a whole chunk).
fn take(session: &Session, pass: &mut StartedPass, n: usize) -> Vec<u64> {
    let mut out = Vec::new();
    while out.len() < n {
        let Some(chunk) = pass.reader.next_chunk() else {
            break;
        };
        for fetched in chunk.unwrap() {
            if out.len() == n {
                break;
            }
            let bytes = session.dataset().fetched_data(fetched);
            out.push(u64::from_le_bytes(bytes[..8].try_into().unwrap()));
            pass.reader.hand_out(1).unwrap();
            pass.progress.handed_out(&pass.reader);
        }
    }
    out
}

fn whole_pass(session: &Session) -> (u64, Vec<u64>) {
    let mut pass = session.start_pass(1).unwrap();
    let samples = take(session, &mut pass, usize::MAX);
    (pass.reader.epoch, samples)
}

#[test]
fn consecutive_passes_read_consecutive_epochs_each_a_permutation() {
    let dir = tempfile::tempdir().unwrap();
    let s = session(dir.path());
    let (e0, first) = whole_pass(&s);
    let (e1, second) = whole_pass(&s);
    assert_eq!((e0, e1), (0, 1));
    assert_ne!(first, second, "two epochs in the same order");
    for samples in [&first, &second] {
        let mut sorted = samples.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..N).collect::<Vec<_>>());
    }
    // A finished pass leaves the state at the start of the next epoch.
    let state = s.state().unwrap();
    assert_eq!((state.epoch, state.position), (2, 0));
}

#[test]
fn the_state_is_what_was_handed_out_and_a_loaded_state_resumes_at_the_next_sample() {
    let dir = tempfile::tempdir().unwrap();
    let s = session(dir.path());
    let mut pass = s.start_pass(1).unwrap();
    let head = take(&s, &mut pass, 11);
    let state = s.state().unwrap();
    assert_eq!((state.epoch, state.position), (0, 11));
    drop(pass);
    s.set_epoch(0).unwrap();
    let (_, full) = whole_pass(&s);
    assert_eq!(head, full[..11]);

    let other_dir = tempfile::tempdir().unwrap();
    let other = session(other_dir.path());
    other.load_state(&state).unwrap();
    let mut resumed = other.start_pass(1).unwrap();
    assert_eq!(resumed.reader.epoch, 0);
    assert_eq!(take(&other, &mut resumed, usize::MAX), full[11..]);
}

#[test]
fn set_epoch_chooses_the_next_pass_and_drops_a_loaded_position() {
    let dir = tempfile::tempdir().unwrap();
    let s = session(dir.path());
    let mut pass = s.start_pass(1).unwrap();
    take(&s, &mut pass, 5);
    let state = s.state().unwrap();
    drop(pass);

    s.load_state(&state).unwrap();
    s.set_epoch(7).unwrap();
    let state = s.state().unwrap();
    assert_eq!((state.epoch, state.position), (7, 0));
    let (epoch, samples) = whole_pass(&s);
    assert_eq!((epoch, samples.len()), (7, N as usize));
    // The same epoch read again (from the reused order) gives the same samples.
    s.set_epoch(7).unwrap();
    assert_eq!(whole_pass(&s), (7, samples));
}

#[test]
fn an_epoch_past_the_last_is_refused_and_changes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let s = session(dir.path());
    s.set_epoch(3).unwrap();
    let err = s.set_epoch(LAST_EPOCH + 1).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidConfig);
    assert!(err.to_string().contains("epoch"), "{err}");
    assert_eq!(s.state().unwrap().epoch, 3);
    s.set_epoch(LAST_EPOCH).unwrap();
    assert_eq!(s.state().unwrap().epoch, LAST_EPOCH);
}

#[test]
fn a_pass_that_cannot_start_leaves_the_state_and_the_epoch_as_they_were() {
    let dir = tempfile::tempdir().unwrap();
    let s = session(dir.path());
    let mut pass = s.start_pass(1).unwrap();
    take(&s, &mut pass, 4);
    drop(pass);
    let before = s.state().unwrap();
    s.pool().close();
    let err = s.start_pass(1).err().expect("a closed pool starts no pass");
    assert_eq!(err.kind(), ErrorKind::Runtime, "{err}");
    let after = s.state().unwrap();
    assert_eq!(
        (after.epoch, after.position),
        (before.epoch, before.position)
    );
}

#[test]
fn a_pass_of_whole_batches_ends_at_its_last_whole_batch() {
    let dir = tempfile::tempdir().unwrap();
    let s = session(dir.path());
    let mut pass = s.start_pass(8).unwrap();
    assert_eq!(take(&s, &mut pass, usize::MAX).len(), 24);
    let state = s.state().unwrap();
    assert_eq!(
        (state.epoch, state.position),
        (1, 0),
        "the pass counts as finished"
    );
}

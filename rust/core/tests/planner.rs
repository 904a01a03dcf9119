//! The read planner under the `EpochReader`: records come out in pass order, the planner keeps
//! no more than `io_depth` records and `read_ahead_bytes` in flight, a read error is its
//! sample's error at its position, nothing stays in flight after a pass (ended, failed or left),
//! corruption is still caught under every verify policy, warm data puts the planner to rest,
//! and the plain path plans nothing. A recording backend stands in for the disk: it reports
//! every range missing (or every range resident), so every record is planned.

use std::collections::HashMap;
use std::io::{Seek, SeekFrom, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::{
    Dataset, EpochReader, Fetched, Payload, Range, RangeSource, ReadOptions, WeightTable,
    REST_AFTER,
};
use dataset_rt_core::format::Compression;
use dataset_rt_core::metadata::MetaValue;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::verify::VerifyPolicy;
use dataset_rt_core::writer::{SampleInput, WriterOptions};
use dataset_rt_core::Error;

use dataset_rt_testkit::write_cache;

const SAMPLES: u64 = 300;
const SAMPLE_BYTES: usize = 3 * 1024;

fn payload(i: u64) -> Vec<u8> {
    (0..SAMPLE_BYTES)
        .map(|k| {
            if k < 64 {
                (i as usize * 7 + k) as u8 | 1
            } else {
                0
            }
        })
        .collect()
}

/// 300 samples of 3 KiB in shards of 64 KiB (about 21 records each), raw or LZ4-compressed.
fn write(pool: &Arc<Pool>, base: &Path, compression: Compression) {
    let opts = WriterOptions {
        prefetch_size: 4,
        compression,
        validate: true,
        shard_size: 64 * 1024,
    };
    let samples = (0..SAMPLES).map(|i| SampleInput {
        data: payload(i),
        metadata: vec![("i".to_owned(), MetaValue::Int(i as i64))],
    });
    write_cache(pool, base, "c", opts, samples);
}

fn open(base: &Path, policy: VerifyPolicy) -> Arc<Dataset> {
    let cache = Cache::open(&base.join("c"), Validation::Structure).unwrap();
    Arc::new(Dataset::new(vec![Arc::new(cache)]).with_verify(policy))
}

fn options(shuffle: bool, prefetch_size: usize, io_depth: usize, bytes: u64) -> ReadOptions {
    ReadOptions {
        prefetch_size,
        io_depth,
        read_ahead_bytes: bytes,
        ..ReadOptions::new(7, shuffle)
    }
}

fn reader(pool: &Arc<Pool>, ds: &Arc<Dataset>, opts: &ReadOptions) -> EpochReader {
    let order = ds.try_order(opts, &WeightTable::uniform(), 0).unwrap();
    EpochReader::new(pool.clone(), ds.clone(), Arc::new(order), opts, 0, 0)
}

/// A backend that records what it is asked, and keeps what is in flight (started, not
/// released): it fails the test on a range released that was not in flight.
#[derive(Default)]
struct Recording {
    resident: AtomicBool,
    /// What it answers to `foresight` (0: it wants no foresight).
    foresight: AtomicU64,
    state: Mutex<Flight>,
}

#[derive(Default)]
struct Flight {
    in_flight: HashMap<Range, usize>,
    records: usize,
    bytes: u64,
    most_records: usize,
    most_bytes: u64,
    started: Vec<Range>,
    released: usize,
    passes: Vec<bool>,
    foreseen: Vec<Vec<(u64, Range)>>,
}

impl Recording {
    fn missing() -> Arc<Self> {
        Arc::new(Recording::default())
    }

    fn resident() -> Arc<Self> {
        let r = Recording::default();
        r.resident.store(true, Ordering::Relaxed);
        Arc::new(r)
    }

    fn in_flight(&self) -> (usize, u64) {
        let s = self.state.lock().unwrap();
        (s.records, s.bytes)
    }
}

impl RangeSource for Recording {
    fn name(&self) -> &'static str {
        "recording"
    }

    fn begin_pass(&self, shuffled: bool) {
        self.state.lock().unwrap().passes.push(shuffled);
    }

    fn resident(&self, _: &Range) -> bool {
        self.resident.load(Ordering::Relaxed)
    }

    fn start(&self, ranges: &[Range]) {
        let mut s = self.state.lock().unwrap();
        for r in ranges {
            *s.in_flight.entry(*r).or_default() += 1;
            s.records += 1;
            s.bytes += r.len;
            s.most_records = s.most_records.max(s.records);
            s.most_bytes = s.most_bytes.max(s.bytes);
            s.started.push(*r);
        }
    }

    fn foresight(&self) -> u64 {
        self.foresight.load(Ordering::Relaxed)
    }

    fn foresee(&self, upcoming: &[(u64, Range)]) {
        self.state.lock().unwrap().foreseen.push(upcoming.to_vec());
    }

    fn release(&self, ranges: &[Range]) {
        let mut s = self.state.lock().unwrap();
        for r in ranges {
            let n = s
                .in_flight
                .get_mut(r)
                .expect("released a range not in flight");
            *n -= 1;
            if *n == 0 {
                s.in_flight.remove(r);
            }
            s.records -= 1;
            s.bytes -= r.len;
            s.released += 1;
        }
    }
}

fn global(ds: &Dataset, f: &Fetched) -> u64 {
    ds.cache_start(f.cache as usize) + f.row
}

fn check_bytes(ds: &Dataset, f: Fetched) -> u64 {
    let row = f.row;
    if !ds.caches[0].may_hold_compressed() {
        assert!(
            matches!(f.payload, Payload::Mapped { .. }),
            "raw records stay views"
        );
    }
    assert_eq!(
        ds.fetched_data(f).into_owned(),
        payload(row),
        "sample {row}"
    );
    row
}

/// The globals of a whole pass, read sample by sample.
fn read_samples(ds: &Dataset, mut r: EpochReader) -> Vec<u64> {
    let mut got = Vec::new();
    while let Some(s) = r.next_sample() {
        let s = s.unwrap();
        let g = global(ds, &s);
        check_bytes(ds, s);
        got.push(g);
    }
    got
}

/// The globals of a whole pass, read in batches of 7.
fn read_batches(ds: &Dataset, mut r: EpochReader) -> Vec<u64> {
    let mut got = Vec::new();
    while let Some(b) = r.next_batch(7) {
        for s in b.unwrap() {
            got.push(global(ds, &s));
            check_bytes(ds, s);
        }
    }
    got
}

/// The globals of a whole pass, read a chunk at a time and handed out one by one.
fn read_chunks(ds: &Dataset, mut r: EpochReader) -> Vec<u64> {
    let mut got = Vec::new();
    while let Some(c) = r.next_chunk() {
        for s in c.unwrap() {
            got.push(global(ds, &s));
            check_bytes(ds, s);
            r.hand_out(1).unwrap();
        }
    }
    got
}

#[test]
fn records_come_out_in_pass_order_through_the_planner() {
    let pool = Pool::new(3).unwrap();
    for compression in [Compression::NONE, Compression::new("lz4", 1.0).unwrap()] {
        let tmp = tempfile::tempdir().unwrap();
        write(&pool, tmp.path(), compression);
        let ds = open(tmp.path(), VerifyPolicy::Always);
        for shuffle in [false, true] {
            let opts = options(shuffle, 16, 8, u64::MAX);
            let want = read_samples(&ds, reader(&pool, &ds, &opts).with_plain_io());
            assert_eq!(want.len() as u64, SAMPLES);
            type Read = fn(&Dataset, EpochReader) -> Vec<u64>;
            for read in [read_samples as Read, read_batches, read_chunks] {
                let source = Recording::missing();
                let r = reader(&pool, &ds, &opts).with_range_source(source.clone());
                assert_eq!(read(&ds, r), want, "shuffle={shuffle}");
                // Every record was started once, in pass order, with the range of its entry.
                let s = source.state.lock().unwrap();
                let ranges: Vec<Range> =
                    want.iter().map(|&g| ds.record_range(g).unwrap()).collect();
                assert_eq!(s.started, ranges);
                assert_eq!(s.passes, [shuffle]);
            }
        }
    }
}

#[test]
fn a_backend_that_asks_is_told_the_coming_records_as_the_pass_moves_on() {
    let pool = Pool::new(3).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write(&pool, tmp.path(), Compression::NONE);
    let ds = open(tmp.path(), VerifyPolicy::Once);
    let opts = options(true, 8, 8, u64::MAX);
    let want = read_samples(&ds, reader(&pool, &ds, &opts).with_plain_io());
    const HORIZON: u64 = 40;
    // Missing records (the planner advises) and resident ones (it rests): told either way.
    for source in [Recording::missing(), Recording::resident()] {
        source.foresight.store(HORIZON, Ordering::Relaxed);
        let r = reader(&pool, &ds, &opts).with_range_source(source.clone());
        assert_eq!(read_samples(&ds, r), want);
        let s = source.state.lock().unwrap();
        assert!(s.foreseen.len() >= 2, "told {} times", s.foreseen.len());
        let mut last_from = None;
        for (i, told) in s.foreseen.iter().enumerate() {
            if told.is_empty() {
                // At the end of the pass: nothing more is needed.
                assert_eq!(i + 1, s.foreseen.len(), "told nothing before the end");
                continue;
            }
            // From the consumer's position on, every position up to the horizon (or the end of
            // the pass), each with the range of the record the pass reads there.
            let from = told[0].0;
            let end = (from + HORIZON).min(SAMPLES);
            let positions: Vec<u64> = told.iter().map(|(k, _)| *k).collect();
            assert_eq!(positions, (from..end).collect::<Vec<_>>());
            for (k, range) in told {
                assert_eq!(*range, ds.record_range(want[*k as usize]).unwrap());
            }
            // Told again once the consumer moved a quarter of the horizon, with no gap.
            match last_from {
                None => assert_eq!(from, 0),
                Some(last) => {
                    assert!(from >= last + HORIZON / 4, "{last} then {from}");
                    assert!(from < last + HORIZON, "{last} then {from}: a gap");
                }
            }
            last_from = Some(from);
        }
        assert!(
            last_from.unwrap() + HORIZON >= SAMPLES,
            "told up to the end"
        );
    }
    // A backend that asks nothing (as local files) is told nothing.
    let source = Recording::missing();
    let r = reader(&pool, &ds, &opts).with_range_source(source.clone());
    assert_eq!(read_samples(&ds, r), want);
    assert!(source.state.lock().unwrap().foreseen.is_empty());
}

#[test]
fn a_backend_is_told_the_coming_records_of_every_rank_of_its_node_at_their_step() {
    assert!(
        std::env::var_os("LOCAL_WORLD_SIZE").is_none(),
        "run without LOCAL_WORLD_SIZE: this test takes a world of 3 as one node"
    );
    let pool = Pool::new(3).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write(&pool, tmp.path(), Compression::NONE);
    let ds = open(tmp.path(), VerifyPolicy::Once);
    const HORIZON: u64 = 40;
    const WORLD: u64 = 3;
    let of_rank = |rank| ReadOptions {
        rank,
        world_size: WORLD,
        ..options(true, 8, 8, u64::MAX)
    };
    let wants: Vec<Vec<u64>> = (0..WORLD)
        .map(|r| read_samples(&ds, reader(&pool, &ds, &of_rank(r)).with_plain_io()))
        .collect();
    let source = Recording::missing();
    source.foresight.store(HORIZON, Ordering::Relaxed);
    let r = reader(&pool, &ds, &of_rank(1)).with_range_source(source.clone());
    assert_eq!(read_samples(&ds, r), wants[1]);
    let s = source.state.lock().unwrap();
    let told: Vec<&Vec<(u64, Range)>> = s.foreseen.iter().filter(|t| !t.is_empty()).collect();
    assert!(told.len() >= 2, "told {} times", told.len());
    let mut last_end = 0;
    for t in told {
        // The foresight is shared by the three ranks: a third of its positions, and at each
        // step this rank's record first, then the other ranks' in order.
        let from = t[0].0;
        let end = (from + HORIZON / WORLD).min(wants[1].len() as u64);
        let mut expected: Vec<(u64, Range)> = Vec::new();
        for k in from..end {
            for r in [1usize, 0, 2] {
                if let Some(&g) = wants[r].get(k as usize) {
                    expected.push((k, ds.record_range(g).unwrap()));
                }
            }
        }
        assert_eq!(*t, expected, "told from step {from}");
        assert!(from <= last_end, "a gap before step {from}");
        last_end = end;
    }
    assert_eq!(last_end, wants[1].len() as u64, "told up to the end");
}

#[test]
fn no_more_than_io_depth_records_nor_read_ahead_bytes_are_in_flight() {
    let pool = Pool::new(3).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write(&pool, tmp.path(), Compression::NONE);
    let ds = open(tmp.path(), VerifyPolicy::Once);
    let record = ds.record_range(0).unwrap().len;
    let largest = (0..SAMPLES)
        .map(|g| ds.record_range(g).unwrap().len)
        .max()
        .unwrap();
    assert!(largest - record <= 16, "records of about one size");
    for (prefetch, depth, bytes) in [
        (64, 1, u64::MAX),
        (64, 5, u64::MAX),
        (512, 64, u64::MAX),
        (8, 64, u64::MAX),
        (64, 64, 3 * record + record / 2),
        (64, 8, 1),
    ] {
        let source = Recording::missing();
        let opts = options(true, prefetch, depth, bytes);
        let mut r = reader(&pool, &ds, &opts)
            .read_ahead_when_mapped()
            .with_range_source(source.clone());
        let mut n = 0;
        while let Some(s) = r.next_sample() {
            check_bytes(&ds, s.unwrap());
            n += 1;
            let (records, in_bytes) = source.in_flight();
            assert!(
                records <= depth,
                "{records} records in flight, io_depth {depth}"
            );
            assert!(r.planned_in_flight() <= depth);
            assert!(
                records <= 1 || in_bytes <= bytes,
                "{in_bytes} bytes in flight, read_ahead_bytes {bytes}"
            );
        }
        assert_eq!(n, SAMPLES);
        let s = source.state.lock().unwrap();
        let expect = if bytes == u64::MAX {
            depth
        } else {
            (bytes / record).max(1) as usize
        };
        // The depth is used, not only bounded.
        assert_eq!(s.most_records, expect, "prefetch {prefetch} depth {depth}");
        assert!(s.most_bytes <= bytes.max(largest));
        assert_eq!(s.started.len() as u64, SAMPLES);
    }
}

#[test]
fn the_planner_reads_ahead_of_a_small_prefetch_window_without_holding_more_samples() {
    let pool = Pool::new(2).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write(&pool, tmp.path(), Compression::new("lz4", 1.0).unwrap());
    let ds = open(tmp.path(), VerifyPolicy::Always);
    let source = Recording::missing();
    let opts = options(true, 8, 64, u64::MAX);
    let mut r = reader(&pool, &ds, &opts).with_range_source(source.clone());
    let mut most_samples = 0;
    while let Some(s) = r.next_sample() {
        check_bytes(&ds, s.unwrap());
        most_samples = most_samples.max(r.samples_in_flight());
    }
    // Decompressed samples ahead of the consumer: bounded by prefetch_size as before; the
    // records planned (advice, no memory of the process): up to io_depth.
    assert!(most_samples <= 8, "{most_samples}");
    assert_eq!(source.state.lock().unwrap().most_records, 64);
}

fn flip_in_place(path: &Path, offset: u64) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut byte = [0u8];
    file.seek(SeekFrom::Start(offset)).unwrap();
    std::io::Read::read_exact(&mut file, &mut byte).unwrap();
    file.seek(SeekFrom::Start(offset)).unwrap();
    file.write_all(&[byte[0] ^ 0xff]).unwrap();
}

fn truncate(path: &Path, len: u64) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644)).unwrap();
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.set_len(len).unwrap();
}

/// Reads a pass sample by sample up to its first error: (globals read, the error).
fn read_to_error(ds: &Dataset, r: &mut EpochReader) -> (Vec<u64>, Option<Error>) {
    let mut got = Vec::new();
    while let Some(s) = r.next_sample() {
        match s {
            Ok(f) => got.push(global(ds, &f)),
            Err(e) => return (got, Some(e)),
        }
    }
    (got, None)
}

fn corrupt_sample(e: Option<Error>) -> (u64, String) {
    match e {
        Some(Error::CorruptRecord { sample, reason, .. }) => (sample, reason),
        other => panic!("expected CorruptRecord, got {other:?}"),
    }
}

/// The pass order of `opts` over `ds`, read on the plain path by a dataset of its own (so that
/// what it verifies is not trusted by `ds` under "once").
fn order_of(pool: &Arc<Pool>, ds: &Arc<Dataset>, opts: &ReadOptions) -> Vec<u64> {
    let own = Arc::new(Dataset::new(ds.caches.clone()));
    let ds = &own;
    let mut r = reader(pool, ds, opts).with_plain_io();
    let mut got = Vec::new();
    while let Some(s) = r.next_sample() {
        // Only the order matters here: a damaged record's slot is kept by its entry.
        got.push(match s {
            Ok(f) => global(ds, &f),
            Err(Error::CorruptRecord { sample, .. }) => sample,
            Err(e) => panic!("{e}"),
        });
        if got.len() as u64 == SAMPLES {
            break;
        }
    }
    got
}

/// Where sample `g`'s record lies: (shard file, record offset, payload offset).
fn record_of(ds: &Dataset, g: u64) -> (std::path::PathBuf, u64, u64) {
    let (e, _, payload) = ds.caches[0].verify_record(g).unwrap();
    (ds.caches[0].shard_path(e.shard), e.offset, payload)
}

#[test]
fn a_read_error_is_that_samples_error_at_its_position() {
    let pool = Pool::new(2).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write(&pool, tmp.path(), Compression::NONE);
    let ds = open(tmp.path(), VerifyPolicy::Always);
    let opts = options(true, 64, 16, u64::MAX);
    let order = order_of(&pool, &ds, &opts);
    // A damaged payload, at position 100 of the shuffled pass.
    let bad = order[100];
    let (shard, _, payload_at) = record_of(&ds, bad);
    flip_in_place(&shard, payload_at + 5);
    for read in 0..2 {
        let source = Recording::missing();
        let mut r = reader(&pool, &ds, &opts).with_range_source(source.clone());
        let (got, err) = if read == 0 {
            read_to_error(&ds, &mut r)
        } else {
            // In batches of 10: the batch holding it fails whole.
            let mut got = Vec::new();
            let mut err = None;
            while let Some(b) = r.next_batch(10) {
                match b {
                    Ok(b) => got.extend(b.iter().map(|f| global(&ds, f))),
                    Err(e) => {
                        err = Some(e);
                        break;
                    }
                }
            }
            (got, err)
        };
        let (sample, reason) = corrupt_sample(err);
        assert_eq!(sample, bad);
        assert!(reason.starts_with("checksum mismatch"), "{reason}");
        assert_eq!(got, order[..100], "read {read}");
        assert!(r.next_sample().is_none(), "an error ends the pass");
        drop(r);
        assert_eq!(
            source.in_flight(),
            (0, 0),
            "a failed pass leaves nothing in flight"
        );
    }
}

#[test]
fn a_truncated_shard_is_the_error_of_its_first_sample_in_pass_order() {
    let pool = Pool::new(2).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write(&pool, tmp.path(), Compression::NONE);
    for policy in [
        VerifyPolicy::Always,
        VerifyPolicy::Once,
        VerifyPolicy::Never,
    ] {
        let ds = open(tmp.path(), policy);
        let opts = options(true, 64, 16, u64::MAX);
        let order = order_of(&pool, &ds, &opts);
        let shard = ds.caches[0].num_shards() as u32 - 2;
        let first = order
            .iter()
            .position(|&g| ds.caches[0].entry(g).shard == shard)
            .unwrap();
        let path = ds.caches[0].shard_path(shard);
        let len = std::fs::metadata(&path).unwrap().len();
        truncate(&path, 16);
        let source = Recording::missing();
        let mut r = reader(&pool, &ds, &opts).with_range_source(source.clone());
        let (got, err) = read_to_error(&ds, &mut r);
        let (sample, reason) = corrupt_sample(err);
        assert!(reason.contains("truncated"), "{reason}");
        assert_eq!(sample, order[first], "{policy:?}");
        assert_eq!(got, order[..first], "{policy:?}");
        drop(r);
        assert_eq!(source.in_flight(), (0, 0));
        // Restored for the next policy (the same bytes: the file was only cut).
        drop(ds);
        std::fs::remove_dir_all(tmp.path().join("c")).unwrap();
        write(&pool, tmp.path(), Compression::NONE);
        assert_eq!(std::fs::metadata(&path).unwrap().len(), len);
    }
}

#[test]
fn the_end_of_a_pass_and_a_pass_left_early_leave_nothing_in_flight() {
    let pool = Pool::new(2).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write(&pool, tmp.path(), Compression::NONE);
    let ds = open(tmp.path(), VerifyPolicy::Once);
    let opts = options(true, 64, 32, u64::MAX);
    // To its end: released as the last chunk is taken, before the reader is dropped.
    let source = Recording::missing();
    let mut r = reader(&pool, &ds, &opts).with_range_source(source.clone());
    let mut n = 0;
    while let Some(s) = r.next_sample() {
        s.unwrap();
        n += 1;
    }
    assert_eq!(n, SAMPLES);
    assert_eq!(source.in_flight(), (0, 0));
    assert_eq!(source.state.lock().unwrap().released as u64, SAMPLES);
    drop(r);
    // Left after 50 samples, and left before its first: what was started is released.
    for stop in [50, 0] {
        let source = Recording::missing();
        let mut r = reader(&pool, &ds, &opts).with_range_source(source.clone());
        for _ in 0..stop {
            r.next_sample().unwrap().unwrap();
        }
        if stop > 0 {
            assert!(source.in_flight().0 > 0, "records were in flight");
        }
        drop(r);
        assert_eq!(source.in_flight(), (0, 0), "left after {stop}");
        let s = source.state.lock().unwrap();
        assert_eq!(s.released, s.started.len());
    }
}

#[test]
fn corruption_is_caught_under_every_verify_policy_through_the_planner() {
    let pool = Pool::new(2).unwrap();
    for policy in [
        VerifyPolicy::Always,
        VerifyPolicy::Once,
        VerifyPolicy::Never,
    ] {
        for damage in ["payload", "header"] {
            let tmp = tempfile::tempdir().unwrap();
            write(&pool, tmp.path(), Compression::NONE);
            let ds = open(tmp.path(), policy);
            let opts = options(true, 64, 16, u64::MAX);
            let order = order_of(&pool, &ds, &opts);
            let bad = order[40];
            let (shard, record_at, payload_at) = record_of(&ds, bad);
            match damage {
                // The record header's sample number (format v3) no longer matches the index.
                "header" => flip_in_place(&shard, record_at + 32),
                _ => flip_in_place(&shard, payload_at + 5),
            }
            let source = Recording::missing();
            let mut r = reader(&pool, &ds, &opts).with_range_source(source.clone());
            let (got, err) = read_to_error(&ds, &mut r);
            if damage == "payload" && policy == VerifyPolicy::Never {
                // The documented limit of "never": a payload is not hashed.
                assert!(err.is_none(), "{err:?}");
                assert_eq!(got, order);
                continue;
            }
            let (sample, reason) = corrupt_sample(err);
            assert_eq!(sample, bad, "{policy:?} {damage}");
            let expected = if damage == "header" {
                "record header"
            } else {
                "checksum mismatch"
            };
            assert!(
                reason.starts_with(expected),
                "{policy:?} {damage}: {reason}"
            );
            assert_eq!(got, order[..40], "{policy:?} {damage}");
        }
    }
}

#[test]
fn warm_records_put_the_planner_to_rest_and_a_miss_wakes_it() {
    let pool = Pool::new(2).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write(&pool, tmp.path(), Compression::NONE);
    let ds = open(tmp.path(), VerifyPolicy::Once);
    // A window of 16 samples: the probes after the data turns cold come before the pass ends.
    let opts = options(true, 16, 16, u64::MAX);
    let want = order_of(&pool, &ds, &opts);
    let source = Recording::resident();
    let mut r = reader(&pool, &ds, &opts).with_range_source(source.clone());
    let mut got = Vec::new();
    let mut woke_at = None;
    while let Some(s) = r.next_sample() {
        let s = s.unwrap();
        got.push(global(&ds, &s));
        if got.len() == 100 {
            // The data turns cold: the next probe misses and the planner plans again.
            source.resident.store(false, Ordering::Relaxed);
        }
        if woke_at.is_none() && r.planner_stats().unwrap().planned > 0 {
            woke_at = Some(got.len());
        }
    }
    assert_eq!(got, want);
    let stats = r.planner_stats().unwrap();
    // Warm from the first sample: it never planned until a probe missed after sample 100 (the
    // probes come at positions 0, 64, 192: the window is 16 samples ahead of the consumer).
    assert!(woke_at.is_some_and(|n| n >= 100), "{woke_at:?}");
    assert_eq!(stats.rests, 0);
    assert!(stats.probes >= 3 && stats.probes_missed == 1, "{stats:?}");
    // Nothing was started while warm; after the miss, the rest of the pass was.
    let s = source.state.lock().unwrap();
    assert!(!s.started.is_empty() && (s.started.len() as u64) < SAMPLES - 100);
    assert_eq!(stats.started, s.started.len() as u64);
    assert_eq!(stats.planned, stats.started);
    drop(s);
    drop(r);
    assert_eq!(source.in_flight(), (0, 0));
}

#[test]
fn the_local_file_backend_reads_every_record_and_rests_on_warm_data() {
    let pool = Pool::new(2).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write(&pool, tmp.path(), Compression::NONE);
    let ds = open(tmp.path(), VerifyPolicy::Once);
    let opts = options(true, 64, 16, u64::MAX);
    let want = order_of(&pool, &ds, &opts);
    // Whatever DATASET_RT_IO says, the local-file backend with each kind of advice.
    for how in [
        dataset_rt_core::dataset::WillNeed::Fadvise,
        dataset_rt_core::dataset::WillNeed::Madvise,
    ] {
        let local = dataset_rt_core::dataset::LocalFiles::new(ds.caches.clone(), how, true);
        let r = reader(&pool, &ds, &opts).with_range_source(Arc::new(local));
        assert_eq!(read_samples(&ds, r), want);
    }
    // The records were just read: resident, so the planner never wakes.
    let local = dataset_rt_core::dataset::LocalFiles::new(
        ds.caches.clone(),
        dataset_rt_core::dataset::WillNeed::Fadvise,
        true,
    );
    let mut r = reader(&pool, &ds, &opts).with_range_source(Arc::new(local));
    while let Some(s) = r.next_sample() {
        s.unwrap();
    }
    let stats = r.planner_stats().unwrap();
    assert_eq!(stats.started, 0, "{stats:?}");
    assert_eq!(stats.planned, 0, "{stats:?}");
    assert!(stats.probes >= 1 && stats.probes_missed == 0, "{stats:?}");
}

#[test]
fn a_planner_that_finds_records_resident_goes_back_to_rest() {
    let pool = Pool::new(2).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write(&pool, tmp.path(), Compression::NONE);
    let ds = open(tmp.path(), VerifyPolicy::Once);
    let opts = options(true, 16, 16, u64::MAX);
    let source = Recording::missing();
    let mut r = reader(&pool, &ds, &opts).with_range_source(source.clone());
    let mut n = 0;
    while let Some(s) = r.next_sample() {
        s.unwrap();
        n += 1;
        if n == 20 {
            // The data turns warm: after REST_AFTER resident records in a row it rests.
            source.resident.store(true, Ordering::Relaxed);
        }
    }
    let stats = r.planner_stats().unwrap();
    assert_eq!(stats.rests, 1, "{stats:?}");
    assert!(stats.planned < SAMPLES - 64, "{stats:?}");
    assert!(stats.resident >= u64::from(REST_AFTER), "{stats:?}");
}

#[test]
fn the_plain_path_plans_nothing_and_reads_the_same_samples() {
    let pool = Pool::new(2).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write(&pool, tmp.path(), Compression::NONE);
    let ds = open(tmp.path(), VerifyPolicy::Always);
    let opts = options(true, 64, 16, u64::MAX);
    let planned = read_samples(
        &ds,
        reader(&pool, &ds, &opts).with_range_source(Recording::missing()),
    );
    let r = reader(&pool, &ds, &opts).with_plain_io();
    assert!(r.planner_stats().is_none());
    assert_eq!(r.planned_in_flight(), 0);
    assert_eq!(read_samples(&ds, r), planned);
}

#[test]
fn bad_io_options_are_config_errors_naming_the_field() {
    for (opts, field) in [
        (options(true, 64, 0, 1), "ReaderConfig.io_depth"),
        (options(true, 64, 1 << 20, 1), "ReaderConfig.io_depth"),
        (options(true, 64, 4, 0), "ReaderConfig.read_ahead_bytes"),
        (
            options(true, 64, 4, (1 << 40) + 1),
            "ReaderConfig.read_ahead_bytes",
        ),
        (options(true, 0, 4, 1), "ReaderConfig.prefetch_size"),
        (
            options(true, (1 << 20) + 1, 4, 1),
            "ReaderConfig.prefetch_size",
        ),
    ] {
        match opts.validate() {
            Err(Error::InvalidConfig { what, .. }) => assert_eq!(what, field),
            other => panic!("expected InvalidConfig, got {other:?}"),
        }
    }
    assert!(options(true, 64, 64, 64 << 20).validate().is_ok());
    assert!(options(true, 64, 1 << 16, 1 << 40).validate().is_ok());
    assert!(options(true, 1 << 20, 64, 1).validate().is_ok());
    let defaults = ReadOptions::new(0, true);
    assert_eq!(
        defaults.io_depth,
        dataset_rt_core::dataset::DEFAULT_IO_DEPTH
    );
    assert_eq!(
        defaults.read_ahead_bytes,
        dataset_rt_core::dataset::DEFAULT_READ_AHEAD_BYTES
    );
    defaults.validate().unwrap();
}

#[test]
fn index_entries_are_asked_for_ahead_of_the_records_the_planner_plans_and_not_when_warm() {
    let pool = Pool::new(2).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write(&pool, tmp.path(), Compression::NONE);
    let ds = open(tmp.path(), VerifyPolicy::Once);
    const DEPTH: u64 = 8;
    for shuffle in [true, false] {
        let opts = options(shuffle, 16, DEPTH as usize, u64::MAX);
        let want = order_of(&pool, &ds, &opts);
        let source = Recording::missing();
        let mut r = reader(&pool, &ds, &opts).with_range_source(source.clone());
        let mut got = Vec::new();
        while let Some(s) = r.next_sample() {
            got.push(global(&ds, &s.unwrap()));
            let planned = source.state.lock().unwrap().started.len() as u64;
            let (advised, _) = r.entries_advised();
            // Every record planned had its entry asked for first, and the entries asked for
            // reach at most twice the depth past the records planned.
            assert!(planned <= advised, "{planned} planned, {advised} advised");
            assert!(
                advised <= (planned + 2 * DEPTH).min(SAMPLES),
                "{planned}, {advised}"
            );
        }
        assert_eq!(got, want);
        let (advised, requests) = r.entries_advised();
        assert_eq!(advised, SAMPLES);
        // One request per index page in a row: a pass in order asks for each page once.
        let index_pages = (std::fs::metadata(tmp.path().join("c/index.bin"))
            .unwrap()
            .len())
        .div_ceil(4096);
        if shuffle {
            assert!((index_pages..=SAMPLES).contains(&requests), "{requests}");
        } else {
            assert!(
                requests <= index_pages + 1,
                "{requests} of {index_pages} pages"
            );
        }
    }
    // Warm data pays nothing: a resting planner asks for no entry; nor does the plain path.
    let opts = options(true, 16, DEPTH as usize, u64::MAX);
    let mut r = reader(&pool, &ds, &opts).with_range_source(Recording::resident());
    while r.next_sample().is_some() {}
    assert_eq!(r.entries_advised(), (0, 0));
    let mut r = reader(&pool, &ds, &opts).with_plain_io();
    while r.next_sample().is_some() {}
    assert_eq!(r.entries_advised(), (0, 0));
}

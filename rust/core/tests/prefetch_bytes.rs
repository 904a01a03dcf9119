//! The read-ahead of an `EpochReader` is bounded in decompressed bytes as well as in samples:
//! records that compress well (LZ4) cannot make it hold `prefetch_size` times their raw size.
//! Over records that are all served from the maps it may read further ahead than
//! `prefetch_size`: they take no memory while they wait.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::{
    Dataset, EpochReader, Payload, ReadOptions, WeightTable, MAPPED_READ_AHEAD,
};
use dataset_rt_core::format::FLAG_LZ4;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::sampler::RankPolicy;
use dataset_rt_core::writer::WriterOptions;
use dataset_rt_testkit::{lz4, numbered, sample, write_cache, writer_options};

const RECORD: usize = 1 << 20;
const RECORDS: u64 = 24;

/// `RECORDS` records of `RECORD` zero bytes each (plus the sample number), stored as LZ4.
fn zeros_cache(pool: &Arc<Pool>, base: &Path) -> Arc<Cache> {
    let opts = WriterOptions {
        compression: lz4(1.0),
        validate: false,
        ..writer_options()
    };
    let samples = (0..RECORDS).map(|i| {
        let mut data = vec![0u8; RECORD];
        data[0] = i as u8;
        numbered(i, data)
    });
    write_cache(pool, base, "zeros", opts, samples);
    let cache = Cache::open(&base.join("zeros"), Validation::Full).unwrap();
    assert!((0..RECORDS).all(|s| cache.entry(s).flags & FLAG_LZ4 != 0));
    assert!(
        cache.manifest.shards.iter().map(|s| s.bytes).sum::<u64>() < RECORDS * RECORD as u64 / 50
    );
    Arc::new(cache)
}

fn options(prefetch_size: usize) -> ReadOptions {
    ReadOptions {
        seed: 0,
        shuffle: false,
        prefetch_size,
        epoch_len: None,
        rank: 0,
        world_size: 1,
        policy: RankPolicy::Pad,
        io_depth: dataset_rt_core::dataset::DEFAULT_IO_DEPTH,
        read_ahead_bytes: dataset_rt_core::dataset::DEFAULT_READ_AHEAD_BYTES,
    }
}

/// Reads a whole pass; after every sample checks what the reader holds ahead of the consumer,
/// counted two ways: its own byte count, and the samples in flight times their decoded size.
/// Returns the most samples that were ever in flight.
fn read_pass(reader: &mut EpochReader, budget: u64) -> u64 {
    let mut most = 0;
    let mut seen = 0u64;
    while let Some(sample) = reader.next_sample() {
        let sample = sample.unwrap();
        match sample.payload {
            Payload::Owned(bytes) => {
                assert_eq!(bytes.len(), RECORD);
                assert_eq!(bytes[0], seen as u8);
            }
            Payload::Mapped { .. } => panic!("an LZ4 record is served decompressed"),
        }
        seen += 1;
        let ahead = reader.samples_in_flight();
        assert_eq!(reader.bytes_in_flight(), ahead * RECORD as u64);
        // One record is always allowed, however small the budget.
        assert!(
            ahead <= 1 || ahead * RECORD as u64 <= budget,
            "{ahead} records of {RECORD} bytes in flight, budget {budget}"
        );
        most = most.max(ahead);
    }
    assert_eq!(seen, RECORDS);
    most
}

#[test]
fn decompressed_bytes_ahead_of_the_consumer_stay_within_the_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let dataset = Arc::new(Dataset::new(vec![zeros_cache(&pool, tmp.path())]));
    let opts = options(64);
    let order = Arc::new(
        dataset
            .try_order(&opts, &WeightTable::uniform(), 0)
            .unwrap(),
    );

    let budget = 3 * RECORD as u64 + RECORD as u64 / 2;
    let mut reader = EpochReader::new(pool.clone(), dataset.clone(), order.clone(), &opts, 0, 0)
        .with_prefetch_bytes(budget);
    let most = read_pass(&mut reader, budget);
    // The budget, not prefetch_size = 64, is what bounded the read-ahead.
    assert_eq!(most, 3);
}

#[test]
fn a_record_larger_than_the_budget_still_makes_progress() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let dataset = Arc::new(Dataset::new(vec![zeros_cache(&pool, tmp.path())]));
    let opts = options(64);
    let order = Arc::new(
        dataset
            .try_order(&opts, &WeightTable::uniform(), 0)
            .unwrap(),
    );
    let mut reader = EpochReader::new(pool, dataset, order, &opts, 0, 0).with_prefetch_bytes(1);
    assert_eq!(read_pass(&mut reader, 1), 1);
}

#[test]
fn small_chunks_on_several_workers_keep_the_order_and_both_bounds() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(4).unwrap();
    let dataset = Arc::new(Dataset::new(vec![zeros_cache(&pool, tmp.path())]));
    let opts = options(8);
    let order = Arc::new(
        dataset
            .try_order(&opts, &WeightTable::uniform(), 0)
            .unwrap(),
    );
    let fetched = Arc::new(AtomicU64::new(0));
    let counter = fetched.clone();
    let budget = 6 * RECORD as u64;
    let mut reader = EpochReader::new(pool, dataset, order, &opts, 0, 0)
        .with_prefetch_bytes(budget)
        .with_chunk(1)
        .on_fetched(Arc::new(move || {
            counter.fetch_add(1, Ordering::Relaxed);
        }));
    // read_pass checks the order (each record carries its number) and the byte budget.
    let most = read_pass(&mut reader, budget);
    // One-sample jobs fill the window of prefetch_size = 8 up to the budget of 6 records.
    assert_eq!(most, 6);
    assert_eq!(fetched.load(Ordering::Relaxed), RECORDS);
}

/// `n` small raw records, each its sample number.
fn raw_cache(pool: &Arc<Pool>, base: &Path, n: u64) -> Arc<Cache> {
    let opts = WriterOptions {
        prefetch_size: 64,
        validate: false,
        ..writer_options()
    };
    let samples = (0..n).map(|i| sample(i.to_le_bytes().to_vec(), &[]));
    write_cache(pool, base, "raw", opts, samples);
    Arc::new(Cache::open(&base.join("raw"), Validation::Full).unwrap())
}

/// The most samples a reader ever held ahead of its consumer over a whole pass, checking that
/// the pass yields every sample in order (unshuffled; a record holds its sample number).
fn most_ahead(reader: &mut EpochReader, dataset: &Dataset) -> u64 {
    let (mut most, mut seen) = (0, 0u64);
    while let Some(sample) = reader.next_sample() {
        let data = dataset.fetched_data(sample.unwrap()).into_owned();
        assert_eq!(data, seen.to_le_bytes());
        seen += 1;
        most = most.max(reader.samples_in_flight());
    }
    assert_eq!(seen, dataset.len());
    most
}

#[test]
fn mapped_records_are_read_further_ahead_than_prefetch_size_and_others_are_not() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let opts = options(4);

    let raw = Arc::new(Dataset::new(vec![raw_cache(&pool, tmp.path(), 2000)]));
    let order = Arc::new(raw.try_order(&opts, &WeightTable::uniform(), 0).unwrap());
    let mut reader = EpochReader::new(pool.clone(), raw.clone(), order.clone(), &opts, 0, 0);
    assert!(most_ahead(&mut reader, &raw) <= 4 + 2);
    let mut reader =
        EpochReader::new(pool.clone(), raw.clone(), order, &opts, 0, 0).read_ahead_when_mapped();
    let most = most_ahead(&mut reader, &raw);
    // The window, plus the chunk of 256 being handed out.
    assert!(most > 4 && most <= MAPPED_READ_AHEAD + 256, "{most}");

    let zeros = Arc::new(Dataset::new(vec![zeros_cache(&pool, tmp.path())]));
    let order = Arc::new(zeros.try_order(&opts, &WeightTable::uniform(), 0).unwrap());
    let mut reader = EpochReader::new(pool, zeros, order, &opts, 0, 0).read_ahead_when_mapped();
    // Compressed records keep prefetch_size = 4 (plus the chunk of 2 being handed out).
    assert!(read_pass(&mut reader, u64::MAX) <= 4 + 2);
}

/// A reader dropped in the middle of its pass stops its read-ahead: the pool's threads finish the
/// blocks they hold and read nothing more of it.
#[test]
fn a_dropped_reader_stops_reading_ahead() {
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let raw = Arc::new(Dataset::new(vec![raw_cache(&pool, tmp.path(), 2000)]));
    let opts = options(4);
    let order = Arc::new(raw.try_order(&opts, &WeightTable::uniform(), 0).unwrap());
    let fetched = Arc::new(AtomicU64::new(0));
    let counter = fetched.clone();
    let mut reader = EpochReader::new(pool.clone(), raw.clone(), order, &opts, 0, 0)
        .read_ahead_when_mapped()
        .on_fetched(Arc::new(move || {
            counter.fetch_add(1, Ordering::Relaxed);
            std::thread::sleep(std::time::Duration::from_millis(2));
        }));
    reader.next_sample().unwrap().unwrap();
    // The first chunk (16) was read, and taking a sample submitted the rest of the window.
    assert!(
        reader.samples_in_flight() > 256,
        "{}",
        reader.samples_in_flight()
    );
    drop(reader);
    // Long enough for the two threads to read the whole window (2 ms a sample) had it not
    // stopped.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let read = fetched.load(Ordering::Relaxed);
    // The first chunk, plus at most one block of 16 per pool thread.
    assert!(read <= 16 + 2 * 16, "{read} samples read");
}

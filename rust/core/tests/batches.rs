//! Batch reads: `EpochReader::next_batch` yields the order of `next_sample` in whole batches,
//! with or without the consumer helping, on every rank and from any start; `whole_batches_of`
//! drops the short tail; `samples::rows` gives the table's rows for any global indices.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use arrow_array::cast::AsArray;
use arrow_array::types::{Float64Type, Int64Type};
use arrow_array::Array;
use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::{Dataset, EpochReader, ReadOptions, WeightTable};
use dataset_rt_core::metadata::MetaValue;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::sampler::RankPolicy;
use dataset_rt_core::samples;
use dataset_rt_testkit::{flip_byte, numbered, process_dir, write_cache, writer_options};

const N: u64 = 29;

struct Fixture {
    pool: Arc<Pool>,
    dataset: Arc<Dataset>,
}

/// Two caches: "a" with `N` samples (metadata `i` and `tag`), "b" with 5 (metadata `i` only).
fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let dir = process_dir();
        let pool = Pool::new(2).unwrap();
        write(&pool, dir, "a", N, true);
        write(&pool, dir, "b", 5, false);
        let open = |name: &str| Arc::new(Cache::open(&dir.join(name), Validation::Full).unwrap());
        Fixture {
            dataset: Arc::new(Dataset::new(vec![open("a"), open("b")])),
            pool,
        }
    })
}

fn write(pool: &Arc<Pool>, base: &Path, name: &str, n: u64, tag: bool) {
    let samples = (0..n).map(|i| {
        let mut sample = numbered(i, i.to_le_bytes().to_vec());
        if tag {
            let tag = MetaValue::Str(format!("t{}", i % 4));
            sample.metadata.push(("tag".to_owned(), tag));
        }
        sample
    });
    write_cache(pool, base, name, writer_options(), samples);
}

fn options(rank: u64, world_size: u64) -> ReadOptions {
    ReadOptions {
        seed: 5,
        shuffle: true,
        prefetch_size: 4,
        epoch_len: None,
        rank,
        world_size,
        policy: RankPolicy::Pad,
        io_depth: dataset_rt_core::dataset::DEFAULT_IO_DEPTH,
        read_ahead_bytes: dataset_rt_core::dataset::DEFAULT_READ_AHEAD_BYTES,
    }
}

fn reader(opts: &ReadOptions, start: u64) -> EpochReader {
    let f = fixture();
    let order = f
        .dataset
        .try_order(opts, &WeightTable::uniform(), 0)
        .unwrap();
    EpochReader::new(
        f.pool.clone(),
        f.dataset.clone(),
        Arc::new(order),
        opts,
        0,
        start,
    )
}

fn global(fetched: &dataset_rt_core::dataset::Fetched) -> u64 {
    fixture().dataset.cache_start(fetched.cache as usize) + fetched.row
}

fn per_sample(mut reader: EpochReader) -> Vec<u64> {
    std::iter::from_fn(|| reader.next_sample())
        .map(|f| global(&f.unwrap()))
        .collect()
}

/// The globals of each batch, and the reader's position after each.
fn batches(mut reader: EpochReader, size: usize) -> (Vec<Vec<u64>>, Vec<u64>) {
    let mut out = Vec::new();
    let mut positions = Vec::new();
    while let Some(batch) = reader.next_batch(size) {
        out.push(batch.unwrap().iter().map(global).collect());
        positions.push(reader.position());
    }
    (out, positions)
}

#[test]
fn batches_concatenate_to_the_per_sample_order_on_every_rank_and_start() {
    for world_size in [1, 3] {
        for rank in 0..world_size {
            let opts = options(rank, world_size);
            for start in [0, 1, 7, 20] {
                let expected = per_sample(reader(&opts, start));
                for size in [1, 4, 64] {
                    for helping in [false, true] {
                        let r = reader(&opts, start);
                        let r = if helping { r.consumer_helps() } else { r };
                        let (got, _) = batches(r, size);
                        let sizes: Vec<usize> = got.iter().map(Vec::len).collect();
                        assert!(sizes[..sizes.len() - 1].iter().all(|&s| s == size));
                        assert_eq!(
                            got.concat(),
                            expected,
                            "rank {rank}/{world_size} start {start} size {size}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn positions_after_batches_are_those_of_per_sample_reads() {
    let opts = options(0, 1);
    let (_, positions) = batches(reader(&opts, 3), 5);
    let mut r = reader(&opts, 3);
    let mut expected = Vec::new();
    let mut k = 0;
    while r.next_sample().is_some() {
        k += 1;
        if k % 5 == 0 || r.remaining() == 0 {
            expected.push(r.position());
        }
    }
    assert_eq!(positions, expected);
}

#[test]
fn whole_batches_of_drops_the_short_tail_only() {
    let total = fixture().dataset.len();
    let opts = options(0, 1);
    let expected = per_sample(reader(&opts, 2));
    let r = reader(&opts, 2).whole_batches_of(8);
    assert_eq!(r.len(), (total - 2) / 8 * 8);
    let (got, _) = batches(r, 8);
    assert!(got.iter().all(|b| b.len() == 8));
    assert_eq!(got.concat(), expected[..((total - 2) / 8 * 8) as usize]);
    assert!(reader(&opts, 0).whole_batches_of(total + 1).is_empty());
}

#[test]
fn rows_gather_the_table_rows_of_any_indices() {
    let f = fixture();
    let weights = WeightTable::from_weights((0..f.dataset.len()).map(|g| 1.0 + g as f64).collect());
    let (schema, table) = samples::table(&f.dataset, &weights).unwrap();
    let whole = arrow_select::concat::concat_batches(&schema, &table).unwrap();
    let globals = [N + 4, 0, 17, N, 17, 3];
    let rows = samples::rows(&f.dataset, &weights, &globals).unwrap();
    assert_eq!(rows.schema(), schema);
    assert_eq!(rows.num_rows(), globals.len());
    for (k, &g) in globals.iter().enumerate() {
        for c in 0..schema.fields().len() {
            let (got, want) = (
                rows.column(c).slice(k, 1),
                whole.column(c).slice(g as usize, 1),
            );
            assert_eq!(got.to_data(), want.to_data(), "column {c}, global {g}");
        }
    }
    // Cache b has no `tag`: null there; the weights are those given.
    let tag = rows.column(schema.index_of("tag").unwrap());
    assert!(tag.is_null(0) && tag.is_null(3) && !tag.is_null(1));
    let w = rows
        .column(schema.index_of("weight").unwrap())
        .as_primitive::<Float64Type>();
    assert_eq!(
        w.values().to_vec(),
        globals.map(|g| 1.0 + g as f64).to_vec()
    );
    let i = rows
        .column(schema.index_of("i").unwrap())
        .as_primitive::<Int64Type>();
    assert_eq!(i.values().to_vec(), vec![4, 0, 17, 0, 17, 3]);
    assert_eq!(
        samples::rows(&f.dataset, &weights, &[]).unwrap().num_rows(),
        0
    );
}

/// Reads a pass through `next_chunk`, handing the samples out one at a time: the globals, and
/// the position after each hand-out.
fn chunked(mut reader: EpochReader) -> (Vec<u64>, Vec<u64>) {
    let mut got = Vec::new();
    let mut positions = Vec::new();
    while let Some(chunk) = reader.next_chunk() {
        let chunk = chunk.unwrap();
        assert!(!chunk.is_empty(), "a chunk is never empty");
        // Taking a chunk hands nothing out: the position is still the last hand-out's.
        let before = reader.position();
        assert_eq!(Some(&before), positions.last().or(Some(&before)));
        for f in &chunk {
            reader.hand_out(1).unwrap();
            got.push(global(f));
            positions.push(reader.position());
        }
    }
    assert_eq!(reader.remaining(), 0);
    (got, positions)
}

#[test]
fn chunks_handed_out_one_by_one_give_the_per_sample_order_and_positions() {
    for world_size in [1, 3] {
        for rank in 0..world_size {
            let opts = options(rank, world_size);
            for start in [0, 1, 7, 20] {
                let mut r = reader(&opts, start);
                let mut expected = Vec::new();
                let mut expected_positions = Vec::new();
                while let Some(f) = r.next_sample() {
                    expected.push(global(&f.unwrap()));
                    expected_positions.push(r.position());
                }
                let (got, positions) = chunked(reader(&opts, start));
                assert_eq!(got, expected, "rank {rank}/{world_size} start {start}");
                assert_eq!(positions, expected_positions);
            }
        }
    }
}

#[test]
fn a_chunk_taken_but_not_handed_out_does_not_move_the_position() {
    let opts = options(0, 1);
    let mut r = reader(&opts, 3);
    let start = r.position();
    let chunk = r.next_chunk().unwrap().unwrap();
    assert!(chunk.len() > 1);
    assert_eq!(r.position(), start);
    assert_eq!(r.remaining(), r.len());
    r.hand_out(1).unwrap();
    assert_eq!(r.remaining(), r.len() - 1);
    // A state taken now resumes at the second sample of the chunk.
    let mut resumed = reader(&opts, r.position());
    let next = resumed.next_sample().unwrap().unwrap();
    assert_eq!(global(&next), global(&chunk[1]));
}

#[test]
#[should_panic(expected = "handing out 2 samples with only 1 taken")]
fn handing_out_more_than_was_taken_is_a_bug_caught_at_once() {
    let mut r = reader(&options(0, 1), 0);
    let chunk = r.next_chunk().unwrap().unwrap();
    r.hand_out(chunk.len() as u64 - 1).unwrap();
    let _ = r.hand_out(2);
}

#[test]
fn a_corrupt_record_in_a_chunk_comes_after_the_samples_before_it() {
    // A chunk of 4 samples, and chunks of 60 claimed by the pool's threads in blocks of 16
    // (the bad record in the third block, read while other blocks are).
    corrupt_record_ends_the_pass_after_the_samples_before_it(12, 5, 8);
    corrupt_record_ends_the_pass_after_the_samples_before_it(90, 37, 120);
}

fn corrupt_record_ends_the_pass_after_the_samples_before_it(n: u64, bad: u64, prefetch: usize) {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    write(&pool, dir.path(), "c", n, false);
    let path = dir.path().join("c");
    {
        let cache = Cache::open(&path, Validation::Full).unwrap();
        let (entry, _, payload_start) = cache.check_record(bad, true).unwrap();
        flip_byte(&cache.shard_path(entry.shard), payload_start);
    }
    let cache = Arc::new(Cache::open(&path, Validation::Structure).unwrap());
    let dataset = Arc::new(Dataset::new(vec![cache]));
    let opts = ReadOptions {
        shuffle: false,
        prefetch_size: prefetch,
        ..options(0, 1)
    };
    let order = dataset
        .try_order(&opts, &WeightTable::uniform(), 0)
        .unwrap();
    let mut r = EpochReader::new(pool, dataset, Arc::new(order), &opts, 0, 0);
    let mut got = Vec::new();
    let err = loop {
        match r.next_chunk().expect("the pass fails before it ends") {
            Ok(chunk) => {
                for f in chunk {
                    r.hand_out(1).unwrap();
                    got.push(f.row);
                }
            }
            Err(e) => break e.to_string(),
        }
    };
    assert_eq!(got, (0..bad).collect::<Vec<_>>());
    assert_eq!(r.position(), bad);
    assert!(err.contains("checksum mismatch"), "{err}");
    assert!(err.contains(&format!("sample {bad}")), "{err}");
    assert!(r.next_chunk().is_none(), "an error ends the pass");
}

//! A shard truncated while its cache is open: reading it is a `CorruptRecord` error naming the
//! shard and the sample, under every verification policy, never SIGBUS (pages past the new end)
//! nor the zeros of the rest of its last page.

use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::{Dataset, EpochReader, Fetched, ReadOptions, WeightTable};
use dataset_rt_core::pool::Pool;
use dataset_rt_core::sampler::RankPolicy;
use dataset_rt_core::verify::VerifyPolicy;
use dataset_rt_core::writer::WriterOptions;
use dataset_rt_testkit::{numbered, set_len, write_cache, writer_options};

const SAMPLES: u64 = 200;
const SAMPLE_BYTES: usize = 3 * 1024;

fn payload(i: u64) -> Vec<u8> {
    (0..SAMPLE_BYTES)
        .map(|k| (i as usize * 7 + k) as u8 | 1)
        .collect()
}

const POLICIES: [VerifyPolicy; 3] = [
    VerifyPolicy::Always,
    VerifyPolicy::Once,
    VerifyPolicy::Never,
];

/// One case's cache, its own since the case truncates one of its shards, read under one policy.
struct Fixture {
    ds: Arc<Dataset>,
    pool: Arc<Pool>,
    /// Dropped last: the directory outlives the maps of the cache in it.
    _dir: tempfile::TempDir,
}

/// A fresh cache of 200 samples of 3 KiB in shards of 64 KiB (about 21 records each), opened
/// under `policy`.
fn fixture(policy: VerifyPolicy) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let opts = WriterOptions {
        shard_size: 64 * 1024,
        ..writer_options()
    };
    let samples = (0..SAMPLES).map(|i| numbered(i, payload(i)));
    let path = write_cache(&pool, dir.path(), "c", opts, samples);
    let cache = Cache::open(&path, Validation::Structure).unwrap();
    Fixture {
        ds: Arc::new(Dataset::new(vec![Arc::new(cache)]).with_verify(policy)),
        pool,
        _dir: dir,
    }
}

fn reader(pool: &Arc<Pool>, ds: &Arc<Dataset>, prefetch_size: usize) -> EpochReader {
    let opts = ReadOptions {
        seed: 1,
        shuffle: false,
        prefetch_size,
        epoch_len: None,
        rank: 0,
        world_size: 1,
        policy: RankPolicy::Pad,
        io_depth: dataset_rt_core::dataset::DEFAULT_IO_DEPTH,
        read_ahead_bytes: dataset_rt_core::dataset::DEFAULT_READ_AHEAD_BYTES,
    };
    let order = ds.try_order(&opts, &WeightTable::uniform(), 0).unwrap();
    EpochReader::new(pool.clone(), ds.clone(), Arc::new(order), &opts, 0, 0)
}

/// Reads the pass to its end or its first error; every sample read must have its own bytes.
fn read_to_error(ds: &Dataset, mut r: EpochReader, got: &mut Vec<u64>) -> Option<String> {
    while let Some(sample) = r.next_sample() {
        match sample {
            Ok(fetched) => {
                let row = fetched.row;
                let bytes = ds.fetched_data(fetched).into_owned();
                assert_eq!(bytes, payload(row), "sample {row} has other bytes");
                got.push(row);
            }
            Err(e) => return Some(e.to_string()),
        }
    }
    None
}

fn first_of_shard(ds: &Dataset, shard: u32) -> u64 {
    (0..SAMPLES)
        .find(|&i| ds.caches[0].entry(i).shard == shard)
        .unwrap()
}

fn assert_names_shard_and_sample(text: &str, ds: &Dataset, shard: u32, sample: u64) {
    let path = ds.caches[0].shard_path(shard).display().to_string();
    assert!(
        text.contains("corrupt record")
            && text.contains(&path)
            && text.contains(&format!("sample {sample}"))
            && text.contains("truncated"),
        "{text}"
    );
}

#[test]
fn a_shard_truncated_before_the_pass_is_an_error_naming_it() {
    for policy in POLICIES {
        let fixture = fixture(policy);
        let (ds, pool) = (&fixture.ds, &fixture.pool);
        assert!(ds.caches[0].num_shards() > 2);
        // Verified once already: under "once" the second pass trusts the records.
        let mut got = Vec::new();
        assert_eq!(read_to_error(ds, reader(pool, ds, 8), &mut got), None);
        set_len(&ds.caches[0].shard_path(1), 16);
        let first = first_of_shard(ds, 1);
        let mut got = Vec::new();
        let text = read_to_error(ds, reader(pool, ds, 8), &mut got).expect("an error");
        assert_eq!(got, (0..first).collect::<Vec<_>>(), "{policy:?}");
        assert_names_shard_and_sample(&text, ds, 1, first);
    }
}

#[test]
fn an_index_truncated_before_the_pass_is_an_error_naming_it() {
    for len in [0, 17] {
        let fixture = fixture(VerifyPolicy::Once);
        let (ds, pool) = (&fixture.ds, &fixture.pool);
        let index = ds.caches[0].dir.join("index.bin");
        set_len(&index, len);
        // Every read starts at its entry in the index's map: no sample is read, no SIGBUS.
        let mut got = Vec::new();
        let text = read_to_error(ds, reader(pool, ds, 8), &mut got).expect("an error");
        assert!(got.is_empty(), "{got:?}");
        assert!(
            text.contains(&index.display().to_string()) && text.contains("truncated while in use"),
            "{text}"
        );
        // Batches too.
        let mut r = reader(pool, ds, 8);
        match r.next_chunk() {
            Some(Err(err)) => {
                assert_eq!(err.kind(), dataset_rt_core::ErrorKind::Malformed, "{err}")
            }
            _ => panic!("a chunk of a truncated index was read"),
        }
    }
}

#[test]
fn a_shard_truncated_after_its_records_were_read_ahead_is_an_error_naming_it() {
    for policy in POLICIES {
        let fixture = fixture(policy);
        let (ds, pool) = (&fixture.ds, &fixture.pool);
        let first = first_of_shard(ds, 1);
        assert!(first > 17);
        let mut r = reader(pool, ds, 256);
        // Up to sample 17: past the first chunk, so the rest of the pass is read ahead (and,
        // under "always" and "once", verified), shard 1 included.
        let mut got = Vec::new();
        for _ in 0..18 {
            let fetched: Fetched = r.next_sample().unwrap().unwrap();
            got.push(fetched.row);
        }
        // Time for the pool to read ahead; the test holds whether it did or not (a shard found
        // truncated before its records are read is the same error).
        std::thread::sleep(std::time::Duration::from_millis(200));
        set_len(&ds.caches[0].shard_path(1), 16);
        let text = read_to_error(ds, r, &mut got).expect("an error");
        assert_eq!(got, (0..first).collect::<Vec<_>>(), "{policy:?}");
        assert_names_shard_and_sample(&text, ds, 1, first);
    }
}

#[test]
fn samples_about_to_be_handed_out_are_checked_against_their_shards_sizes() {
    let fixture = fixture(VerifyPolicy::Once);
    let ds = &fixture.ds;
    let (in_0, in_1, in_2) = (
        first_of_shard(ds, 0),
        first_of_shard(ds, 1),
        first_of_shard(ds, 2),
    );
    // A loader's batch, by global index: whole shards pass, an index out of range is ignored.
    ds.check_shards_of(&[in_2, in_0, in_1, SAMPLES + 5])
        .unwrap();
    set_len(&ds.caches[0].shard_path(1), 16);
    // Samples of other shards are still fine; the first of the batch in shard 1 is named.
    ds.check_shards_of(&[in_0, in_2]).unwrap();
    let text = ds
        .check_shards_of(&[in_2, in_1 + 1, in_0, in_1])
        .unwrap_err()
        .to_string();
    assert_names_shard_and_sample(&text, ds, 1, in_1 + 1);
    // The same check by (cache, shard, row), as a loader's slot entries give them: records of
    // no cache or shard of the dataset are left to the caller.
    let record = |global: u64| {
        let (c, row) = ds.locate(global);
        (c as u32, ds.caches[c].entry(row).shard, row)
    };
    ds.check_record_shards([record(in_0), record(in_2), (7, 0, 0), (0, 999, 0)])
        .unwrap();
    let text = ds
        .check_record_shards([record(in_2), record(in_1 + 1), record(in_1)])
        .unwrap_err()
        .to_string();
    assert_names_shard_and_sample(&text, ds, 1, in_1 + 1);
}

#[test]
fn a_metadata_file_truncated_after_the_open_is_refused_at_its_first_use() {
    let fixture = fixture(VerifyPolicy::Once);
    let cache = &fixture.ds.caches[0];
    let path = cache.dir.join("metadata.arrow");
    set_len(&path, 16);
    // Never SIGBUS: the table is refused, naming the file, at this use and every later one.
    for _ in 0..2 {
        let Err(err) = cache.metadata() else {
            panic!("the table of a truncated file was served")
        };
        let text = err.to_string();
        assert!(
            text.contains(&path.display().to_string())
                && text.contains("is 16 bytes now")
                && text.contains("truncated while in use"),
            "{text}"
        );
    }
}

#[test]
fn a_payload_past_its_shards_validated_size_is_refused_where_a_view_is_cut() {
    let fixture = fixture(VerifyPolicy::Once);
    let cache = &fixture.ds.caches[0];
    let size = cache.shard_len(1);
    assert_eq!(cache.payload_end(1, size - 10, 10, 3).unwrap(), size);
    for (offset, len) in [(size - 10, 11), (u64::MAX, 2)] {
        let text = cache
            .payload_end(1, offset, len, 3)
            .unwrap_err()
            .to_string();
        assert!(
            text.contains(&cache.shard_path(1).display().to_string())
                && text.contains("sample 3")
                && text.contains(&format!("past the end of the shard's {size} bytes")),
            "{text}"
        );
    }
}

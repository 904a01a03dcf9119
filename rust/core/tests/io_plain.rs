//! `DATASET_RT_IO=plain` turns the read planner off: readers then read as they did before it.
//! Its own test binary, with one test, because the choice is read once per process.

use std::sync::Arc;

use dataset_rt_core::dataset::{io_path, Dataset, EpochReader, IoPath, ReadOptions, WeightTable};
use dataset_rt_core::format::Compression;
use dataset_rt_core::metadata::MetaValue;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::writer::{SampleInput, WriterOptions};

use dataset_rt_testkit::write_cache;

#[test]
fn the_environment_forces_the_plain_path() {
    // The only test of this process sets it before any reader reads it.
    std::env::set_var("DATASET_RT_IO", "plain");
    assert_eq!(io_path(), IoPath::Plain);
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let opts = WriterOptions {
        prefetch_size: 4,
        compression: Compression::NONE,
        validate: true,
        shard_size: 16 * 1024,
    };
    let samples = (0..100u64).map(|i| SampleInput {
        data: vec![i as u8; 1000],
        metadata: vec![("i".to_owned(), MetaValue::Int(i as i64))],
    });
    write_cache(&pool, tmp.path(), "c", opts, samples);
    let cache = dataset_rt_core::cache::Cache::open(
        &tmp.path().join("c"),
        dataset_rt_core::cache::Validation::Structure,
    )
    .unwrap();
    let ds = Arc::new(Dataset::new(vec![Arc::new(cache)]));
    let read = ReadOptions::new(3, true);
    let order = ds.try_order(&read, &WeightTable::uniform(), 0).unwrap();
    let mut r = EpochReader::new(pool, ds.clone(), Arc::new(order), &read, 0, 0);
    assert!(r.planner_stats().is_none(), "no planner on the plain path");
    let mut seen = [false; 100];
    while let Some(s) = r.next_sample() {
        let s = s.unwrap();
        let row = s.row;
        assert_eq!(&*ds.fetched_data(s), &vec![row as u8; 1000][..]);
        seen[row as usize] = true;
    }
    assert!(seen.iter().all(|&s| s));
}

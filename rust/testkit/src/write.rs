//! Caches written by the real writer (`CacheLock`, `CacheWriter`), from a list of samples: the
//! fixture almost every test starts from.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dataset_rt_core::format::Compression;
use dataset_rt_core::metadata::MetaValue;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::writer::{CacheLock, CacheWriter, SampleInput, WriterOptions};

/// The writer options most tests use: batches of 4 samples, no compression, the written cache
/// validated, shards of 1 MiB. A test that needs other values changes them with struct update
/// syntax, `WriterOptions { validate: false, ..writer_options() }`, so that they stay visible.
pub fn writer_options() -> WriterOptions {
    WriterOptions {
        prefetch_size: 4,
        compression: Compression::NONE,
        validate: true,
        shard_size: 1 << 20,
    }
}

/// LZ4 compression that keeps a record compressed when it shrinks to at most `ratio` of its size.
pub fn lz4(ratio: f64) -> Compression {
    Compression::new("lz4", ratio).expect("a valid LZ4 ratio")
}

/// A sample of `data` with `metadata`, its keys in the order given.
pub fn sample(data: Vec<u8>, metadata: &[(&str, MetaValue)]) -> SampleInput {
    SampleInput {
        data,
        metadata: metadata
            .iter()
            .map(|(k, v)| (k.to_string(), v.clone()))
            .collect(),
    }
}

/// Sample number `i` with payload `data` and one metadata field, `"i"`, holding `i`: the shape
/// of most test caches, whose tests find a sample's number in its metadata.
pub fn numbered(i: u64, data: Vec<u8>) -> SampleInput {
    sample(data, &[("i", MetaValue::Int(i as i64))])
}

/// A writer of cache `name` under `base`, holding its lock: for the tests of the writer itself,
/// which push, hand off and fail on their own terms.
pub fn cache_writer(pool: &Arc<Pool>, base: &Path, name: &str, opts: WriterOptions) -> CacheWriter {
    let lock = CacheLock::acquire(base, name).expect("lock the cache's name");
    CacheWriter::create(pool.clone(), lock, opts).expect("start the cache's writer")
}

/// Writes `samples` as cache `name` under `base` with `opts`, the way a user's write goes (lock,
/// writer, every push, finish), and returns the published cache's directory.
pub fn write_cache(
    pool: &Arc<Pool>,
    base: &Path,
    name: &str,
    opts: WriterOptions,
    samples: impl IntoIterator<Item = SampleInput>,
) -> PathBuf {
    try_write_cache(pool, base, name, opts, samples)
        .unwrap_or_else(|e| panic!("writing cache {name:?} failed: {e}"))
}

/// As [`write_cache`], returning the writer's first error instead of panicking: for tests of the
/// samples a write refuses.
pub fn try_write_cache(
    pool: &Arc<Pool>,
    base: &Path,
    name: &str,
    opts: WriterOptions,
    samples: impl IntoIterator<Item = SampleInput>,
) -> dataset_rt_core::Result<PathBuf> {
    let lock = CacheLock::acquire(base, name)?;
    let mut writer = CacheWriter::create(pool.clone(), lock, opts)?;
    for sample in samples {
        writer.push(sample)?;
    }
    Ok(writer.finish()?.dir)
}

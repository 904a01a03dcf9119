//! Helpers shared by the integration tests: caches written by the real writer, and private
//! copies of the committed golden caches for tests that damage them.

// Each test file that includes this module uses some of its helpers, not all.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dataset_rt_core::pool::Pool;
use dataset_rt_core::writer::{CacheLock, CacheWriter, SampleInput, WriterOptions};

/// Writes `samples` as cache `name` under `base` with `opts`, through the real writer.
pub fn write_cache(
    pool: &Arc<Pool>,
    base: &Path,
    name: &str,
    opts: WriterOptions,
    samples: impl IntoIterator<Item = SampleInput>,
) {
    let lock = CacheLock::acquire(base, name).unwrap();
    let mut writer = CacheWriter::create(pool.clone(), lock, opts).unwrap();
    for sample in samples {
        writer.push(sample).unwrap();
    }
    writer.finish().unwrap();
}

/// A private copy of the committed golden v1 cache under `tmp`, for a test to damage.
pub fn golden_copy(tmp: &Path) -> PathBuf {
    golden_copy_of(tmp, 1)
}

/// A private copy of the committed golden cache of format `version` under `tmp`.
pub fn golden_copy_of(tmp: &Path, version: u32) -> PathBuf {
    let from = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join(format!("../../tests/data/golden_v{version}/golden"));
    let dest = tmp.join("golden");
    std::fs::create_dir_all(dest.join("shards")).unwrap();
    for rel in [
        "manifest.json",
        "index.bin",
        "metadata.arrow",
        "shards/000000.bin",
        "shards/000001.bin",
    ] {
        std::fs::copy(from.join(rel), dest.join(rel)).unwrap();
    }
    dest
}

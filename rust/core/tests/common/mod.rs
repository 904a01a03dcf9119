//! Helpers shared by the integration tests that damage caches.

use std::path::{Path, PathBuf};

/// A private copy of the committed golden v1 cache under `tmp`, for a test to damage.
pub fn golden_copy(tmp: &Path) -> PathBuf {
    golden_copy_of(tmp, 1)
}

/// A private copy of the committed golden cache of format `version` under `tmp`.
#[allow(dead_code)] // not every test file that includes this module uses it
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

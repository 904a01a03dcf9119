//! The committed golden caches (`tests/data/golden_vN/golden`, one per format version) and
//! private copies of them: nothing is ever opened for writing, or damaged, next to the committed
//! bytes.

use std::path::{Path, PathBuf};

/// The committed golden cache of format `version`. Read it, never write it: a test that damages
/// a golden cache works on a [`golden_copy_of`] it.
pub fn golden_dir(version: u32) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../tests/data/golden_v{version}/golden"))
}

/// A private copy of the golden cache of format 1 under `tmp`, for a test to damage.
pub fn golden_copy(tmp: &Path) -> PathBuf {
    golden_copy_of(tmp, 1)
}

/// A private copy of the golden cache of format `version` under `tmp`: `tmp/golden`, so that
/// the cache keeps its name, "golden".
pub fn golden_copy_of(tmp: &Path, version: u32) -> PathBuf {
    let dest = tmp.join("golden");
    copy_tree(&golden_dir(version), &dest);
    dest
}

/// Copies the directory `from` and everything under it to `to`.
fn copy_tree(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create the copy's directory");
    for entry in std::fs::read_dir(from).expect("list the golden cache") {
        let entry = entry.expect("list the golden cache");
        let target = to.join(entry.file_name());
        if entry.file_type().expect("a file's type").is_dir() {
            copy_tree(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), target).expect("copy a file of the golden cache");
        }
    }
}

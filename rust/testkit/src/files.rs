//! Every file of a cache in memory: read from a directory, changed as bytes, written back.

use std::path::{Path, PathBuf};

use dataset_rt_core::format::{
    shard_file_name, INDEX_FILE, MANIFEST_FILE, METADATA_FILE, SHARDS_DIR,
};

/// Every file of a cache directory, in memory. Nothing here is checked: a forgery may make any
/// of them anything, and the shard files need not match the manifest's list.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CacheFiles {
    /// The directory's name (the cache's name, when the manifest agrees).
    pub name: String,
    pub manifest: Vec<u8>,
    pub index: Vec<u8>,
    pub metadata: Vec<u8>,
    /// `shards/000000.bin` on, as many as exist in a row.
    pub shards: Vec<Vec<u8>>,
}

impl CacheFiles {
    /// Reads the cache directory `dir`.
    pub fn read(dir: &Path) -> CacheFiles {
        let read = |rel: &str| {
            std::fs::read(dir.join(rel))
                .unwrap_or_else(|e| panic!("read {rel} of {}: {e}", dir.display()))
        };
        let mut shards = Vec::new();
        while dir.join(shard_file_name(shards.len() as u32)).exists() {
            shards.push(read(&shard_file_name(shards.len() as u32)));
        }
        CacheFiles {
            name: dir
                .file_name()
                .expect("a cache directory has a name")
                .to_string_lossy()
                .into_owned(),
            manifest: read(MANIFEST_FILE),
            index: read(INDEX_FILE),
            metadata: read(METADATA_FILE),
            shards,
        }
    }

    /// Writes the cache into `parent/<name>`, replacing whatever was there, and returns that
    /// path.
    pub fn write(&self, parent: &Path) -> PathBuf {
        let dir = parent.join(&self.name);
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join(SHARDS_DIR)).expect("create the cache directory");
        let put = |rel: &str, bytes: &[u8]| std::fs::write(dir.join(rel), bytes).expect("write");
        self.put_each(put);
        dir
    }

    /// Overwrites the files of the cache at `dir` with these bytes, in place (each made writable
    /// first: the writer publishes them read-only). The shard files must be the ones `dir` has.
    pub fn store(&self, dir: &Path) {
        self.put_each(|rel, bytes| crate::edit::write(&dir.join(rel), bytes));
    }

    /// Calls `put` with the path, relative to the cache directory, and the bytes of every file.
    fn put_each(&self, mut put: impl FnMut(&str, &[u8])) {
        put(MANIFEST_FILE, &self.manifest);
        put(INDEX_FILE, &self.index);
        put(METADATA_FILE, &self.metadata);
        for (i, shard) in self.shards.iter().enumerate() {
            put(&shard_file_name(i as u32), shard);
        }
    }
}

/// The names of the entries of `dir`, sorted.
pub fn dir_entries(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("list {}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

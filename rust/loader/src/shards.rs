//! The shard files that slot references point into (see "Slot content" in `shm/LAYOUT.md`).
//!
//! The training process opened and validated the dataset's caches; the producer verifies the
//! records it references and the consumers map the bytes. All three must read the very same
//! files, so the training process records each shard's identity (device, inode and validated
//! size) in a [`ShardTable`], hands it to the producer (in its spec) and to the consumers, and
//! each refuses a shard file that is not that one: a cache replaced or truncated under the
//! loader is an error naming the file, never another file's bytes or a SIGBUS.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use dataset_rt_core::cache::{Cache, FileIdentity};
use dataset_rt_core::dataset::Dataset;
use dataset_rt_core::format::{shard_file_name, INDEX_FILE, METADATA_FILE};
use dataset_rt_core::Error as CoreError;
use serde::{Deserialize, Serialize};

use crate::Result;

/// One shard file as the training process validated it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardFile {
    /// Validated size in bytes: what is mapped, and the bound of every reference into it.
    pub len: u64,
    pub dev: u64,
    pub ino: u64,
}

/// The shard files of one cache.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheShards {
    pub name: String,
    pub dir: PathBuf,
    pub shards: Vec<ShardFile>,
    /// `index.bin` and `metadata.arrow` as the training process mapped them: the producer opens
    /// the cache by its path and must find these very files, or its index entries (and the
    /// verified bits set against the training process's index) could name other records.
    pub index: FileId,
    pub metadata: FileId,
}

/// A file by device and inode (see [`FileIdentity`]), as the spec carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

impl From<FileIdentity> for FileId {
    fn from(id: FileIdentity) -> Self {
        FileId {
            dev: id.dev,
            ino: id.ino,
        }
    }
}

/// The shard files of every cache of a dataset, in the dataset's cache order.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardTable {
    pub caches: Vec<CacheShards>,
}

/// The identity of an open file: (device, inode, current size).
fn identity(file: &File, path: &std::path::Path) -> Result<(u64, u64, u64)> {
    let meta = file
        .metadata()
        .map_err(|e| CoreError::io("stat", path, e))?;
    Ok((meta.dev(), meta.ino(), meta.len()))
}

impl ShardTable {
    /// The table of `ds`'s caches: the files the core validated and keeps open.
    pub fn of(ds: &Dataset) -> Result<ShardTable> {
        let caches = ds
            .caches
            .iter()
            .map(|cache| {
                let shards = (0..cache.num_shards() as u32)
                    .map(|s| {
                        if cache.is_fetched() {
                            // No file: its records travel as bytes, and a reference into it
                            // (a length of 0 here) is refused.
                            return Ok(ShardFile {
                                len: 0,
                                dev: 0,
                                ino: 0,
                            });
                        }
                        let (dev, ino, _) = identity(cache.shard_file(s), &cache.shard_path(s))?;
                        Ok(ShardFile {
                            len: cache.shard_len(s),
                            dev,
                            ino,
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                Ok(CacheShards {
                    name: cache.name().to_owned(),
                    dir: cache.dir.clone(),
                    shards,
                    index: cache.index_identity().into(),
                    metadata: cache.metadata_identity().into(),
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(ShardTable { caches })
    }

    /// The validated size of every shard, per cache: what `read_batch` checks references
    /// against.
    pub fn lens(&self) -> Vec<Vec<u64>> {
        self.caches
            .iter()
            .map(|c| c.shards.iter().map(|s| s.len).collect())
            .collect()
    }

    /// The path of shard `shard` of cache `cache` (the storage format's name for it), or `None`
    /// when the table has no such shard.
    pub fn path(&self, cache: u32, shard: u32) -> Option<PathBuf> {
        let c = self.caches.get(cache as usize)?;
        c.shards.get(shard as usize)?;
        Some(c.dir.join(shard_file_name(shard)))
    }

    /// Why `file`, opened as shard `shard` of cache `cache`, is not the file in the table (with
    /// `whole`, also when it is shorter than its validated size).
    fn check_file(&self, cache: u32, shard: u32, file: &File, whole: bool) -> Result<()> {
        let c = &self.caches[cache as usize];
        let want = c.shards[shard as usize];
        let path = c.dir.join(shard_file_name(shard));
        let (dev, ino, len) = identity(file, &path)?;
        let reason = if (dev, ino) != (want.dev, want.ino) {
            "the file was replaced since the dataset was opened"
        } else if whole && len < want.len {
            "the file was truncated since the dataset was opened"
        } else {
            return Ok(());
        };
        Err(CoreError::malformed(
            &c.name,
            &path,
            format!(
                "{reason} (device {dev}, inode {ino}, {len} bytes; the loader reads device {}, \
                 inode {}, {} bytes): a published cache must not be modified while it is read; \
                 open the dataset again",
                want.dev, want.ino, want.len
            ),
        )
        .into())
    }

    /// Opens shard `shard` of cache `cache` by its path and checks that it is the file in the
    /// table (same device and inode, not shorter than its validated size). The caller maps
    /// exactly the table's `len` bytes of it.
    pub fn open(&self, cache: u32, shard: u32) -> Result<File> {
        let path = self.path(cache, shard).ok_or_else(|| {
            crate::protocol(format!(
                "shard {shard} of cache {cache} is not in the loader's shard table"
            ))
        })?;
        let file = File::open(&path).map_err(|e| CoreError::io("open", &path, e))?;
        self.check_file(cache, shard, &file, true)?;
        Ok(file)
    }

    /// Maps shard `shard` of cache `cache` read-only, with exactly its validated size, after
    /// [`ShardTable::open`] checked it is the table's file and not cut short. The descriptor is
    /// closed on return: the map needs none.
    pub fn map(&self, cache: u32, shard: u32) -> Result<memmap2::Mmap> {
        let file = self.open(cache, shard)?;
        let path = self.path(cache, shard).unwrap_or_default();
        let want = &self.caches[cache as usize];
        let size = want.shards[shard as usize].len;
        let len = usize::try_from(size).map_err(|_| {
            CoreError::malformed(
                &want.name,
                &path,
                format!("{size} bytes cannot be mapped here"),
            )
        })?;
        // SAFETY: a read-only map of a published (read-only) shard; what a file changed under
        // it does is documented in docs/security.md.
        let map = unsafe { memmap2::MmapOptions::new().len(len).map(&file) }
            .map_err(|e| CoreError::io("mmap", &path, e))?;
        Ok(map)
    }

    /// Checks that `ds` (the producer's own opening of the caches) reads the table's files.
    pub fn check(&self, ds: &Dataset) -> Result<()> {
        let counts = |caches: &[std::sync::Arc<Cache>]| -> Vec<usize> {
            caches.iter().map(|c| c.num_shards()).collect()
        };
        let table_counts: Vec<usize> = self.caches.iter().map(|c| c.shards.len()).collect();
        if counts(&ds.caches) != table_counts {
            return Err(crate::protocol(format!(
                "the shard table has {table_counts:?} shards per cache, the caches {:?}",
                counts(&ds.caches)
            )));
        }
        for (c, cache) in ds.caches.iter().enumerate() {
            let want = &self.caches[c];
            for (file, have, expected) in [
                (INDEX_FILE, cache.index_identity(), want.index),
                (METADATA_FILE, cache.metadata_identity(), want.metadata),
            ] {
                if FileId::from(have) != expected {
                    return Err(CoreError::malformed(
                        &want.name,
                        want.dir.join(file),
                        format!(
                            "the file was replaced since the dataset was opened (device {}, \
                             inode {}; the dataset reads device {}, inode {}): a published \
                             cache must not be modified while it is read; open the dataset again",
                            have.dev, have.ino, expected.dev, expected.ino
                        ),
                    )
                    .into());
                }
            }
            for s in (0..cache.num_shards() as u32).filter(|_| !cache.is_fetched()) {
                // A shard truncated since is still the same file: its records are refused as
                // they are read, naming each sample (`Cache::check_shard_size`).
                self.check_file(c as u32, s, cache.shard_file(s), false)?;
            }
        }
        Ok(())
    }
}

/// Where a buffer lies in a shard file: what a consumer sends instead of the bytes when a
/// result's buffer is a view of one of its shard maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardSpan {
    pub cache: u32,
    pub shard: u32,
    /// Offset of the buffer's first byte in the shard file.
    pub offset: u64,
}

/// A consumer's shard maps by address: which buffers of a worker's result may leave it as
/// references (they lie wholly inside one read-only map of a verified shard file, which the
/// training process maps too) instead of being copied.
#[derive(Debug, Default)]
pub struct MapIndex {
    /// (start address, length, cache, shard), sorted by start; maps never overlap.
    maps: Vec<(usize, u64, u32, u32)>,
}

impl MapIndex {
    /// Records that shard `shard` of cache `cache` is mapped at `start .. start + len`.
    pub fn insert(&mut self, start: usize, len: u64, cache: u32, shard: u32) {
        let at = self.maps.partition_point(|m| m.0 < start);
        self.maps.insert(at, (start, len, cache, shard));
    }

    /// The shard bytes that `address .. address + len` views, or `None` when that range is not
    /// wholly inside one map (or is empty).
    pub fn find(&self, address: usize, len: u64) -> Option<ShardSpan> {
        if len == 0 {
            return None;
        }
        let at = self
            .maps
            .partition_point(|m| m.0 <= address)
            .checked_sub(1)?;
        let (start, map_len, cache, shard) = self.maps[at];
        let offset = (address - start) as u64;
        (offset.checked_add(len)? <= map_len).then_some(ShardSpan {
            cache,
            shard,
            offset,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn index() -> MapIndex {
        let mut index = MapIndex::default();
        index.insert(10_000, 500, 1, 3);
        index.insert(1_000, 100, 0, 0);
        index.insert(2_000, 100, 0, 1);
        index
    }

    #[test]
    fn a_range_inside_a_map_is_found_with_its_offset() {
        let index = index();
        let span = |cache, shard, offset| {
            Some(ShardSpan {
                cache,
                shard,
                offset,
            })
        };
        assert_eq!(index.find(1_000, 100), span(0, 0, 0));
        assert_eq!(index.find(1_040, 60), span(0, 0, 40));
        assert_eq!(index.find(2_099, 1), span(0, 1, 99));
        assert_eq!(index.find(10_250, 250), span(1, 3, 250));
    }

    #[test]
    fn a_range_outside_or_across_maps_is_not() {
        let index = index();
        assert_eq!(index.find(999, 1), None); // before the first map
        assert_eq!(index.find(999, 2), None); // starts before it
        assert_eq!(index.find(1_050, 51), None); // runs past its end
        assert_eq!(index.find(1_100, 1), None); // just after it
        assert_eq!(index.find(1_500, 10), None); // between maps
        assert_eq!(index.find(1_050, 1_000), None); // across two maps
        assert_eq!(index.find(10_499, 2), None);
        assert_eq!(index.find(usize::MAX, 1), None);
        assert_eq!(index.find(1_000, u64::MAX), None); // no overflow
        assert_eq!(index.find(1_000, 0), None); // empty: nothing to reference
        assert_eq!(MapIndex::default().find(1_000, 1), None);
    }
}

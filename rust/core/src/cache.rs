//! Opening and validating a published cache, and reading its records.

use std::borrow::Cow;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::panic::AssertUnwindSafe;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use memmap2::Mmap;

use crate::dataset::{Range, RecordSource};
use crate::error::{Error, IoContext, Result};
use crate::format::*;
use crate::metadata::{FieldType, MetadataTable};

/// The most an LZ4 block can expand: a match of length `4 + 15 + 255 * k` costs at least
/// `3 + k` bytes, and literals are stored as they are, so no valid block decodes to more than
/// 255 times its size. A record that claims more is refused before anything is allocated.
pub const LZ4_MAX_RATIO: u64 = 255;

/// Why `file`, `validated` bytes long when its cache was opened and mapped at that length, may
/// no longer be read through its map (one `fstat`): `None` while it is no shorter. The map
/// keeps its length whatever the file becomes, and a page of it past a truncated file's end
/// raises SIGBUS. `what` names the file in the reason ("the shard", ...).
fn truncated_since_open(
    file: &File,
    validated: u64,
    what: &str,
) -> std::io::Result<Option<String>> {
    let now = file.metadata()?.len();
    Ok((now < validated).then(|| {
        format!(
            "the {what} is {now} bytes now but was {validated} bytes when the cache was opened: \
             it was truncated while in use (a published cache must not be modified while it is \
             read)"
        )
    }))
}

/// A published cache, opened and validated.
pub struct Cache {
    pub dir: PathBuf,
    pub manifest: Manifest,
    index: Mmap,
    /// Bytes of one entry of `index`, by the cache's format version.
    entry_len: u64,
    /// The shard maps; empty when the records come from `records` instead.
    shards: Vec<Mmap>,
    /// Where the records come from when the shards are not local files (a cache on object
    /// storage): every read asks it for the record's bytes. `None` for a local cache.
    records: Option<Arc<dyn RecordSource>>,
    /// The files `shards` map, kept open: whoever maps a shard again (the bindings' zero-copy
    /// views) must map this file, whose bytes were validated, not whatever the path names now.
    shard_files: Vec<File>,
    /// `metadata.arrow`, mapped at open; checksummed and decoded by the first use of the table.
    metadata_map: Arc<Mmap>,
    /// The file `metadata_map` maps, kept open: its size is checked before the first use reads
    /// the map (a truncated file would kill the process with `SIGBUS`).
    metadata_file: File,
    /// The file `index` maps, kept open: its size is checked as a pass begins
    /// ([`Cache::check_index_size`]).
    index_file: File,
    /// The identities of the `index.bin` and `metadata.arrow` files that `index` and
    /// `metadata_map` map: another process that opens the cache by its path (the loader's
    /// producer) must read these very files, not ones renamed over them since.
    index_identity: FileIdentity,
    metadata_identity: FileIdentity,
    /// The decoded table, or why `metadata.arrow` was refused (reported at every use).
    metadata: OnceLock<std::result::Result<MetadataTable, String>>,
}

/// Which file an open descriptor is: its device and inode. Two openings of one path read the
/// same bytes only when their identities are equal (a file renamed over the path has another).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileIdentity {
    pub dev: u64,
    pub ino: u64,
}

impl FileIdentity {
    /// The identity of `file`, opened from `path` (named in the error).
    pub fn of(file: &File, path: &Path) -> Result<FileIdentity> {
        use std::os::unix::fs::MetadataExt;
        let meta = file.metadata().ctx("stat", path)?;
        Ok(FileIdentity {
            dev: meta.dev(),
            ino: meta.ino(),
        })
    }
}

/// How much to check when opening. `Structure` reads no byte per sample, so a load takes the
/// same time at any size; "What is checked when" in docs/storage-format.md has the whole list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Validation {
    /// Manifest, version, every file's size, the index and shard headers (every load). The
    /// index entries are checked against their records as they are read ([`Cache::check_record`]),
    /// and `metadata.arrow` by its checksum and decoding at the first use of the table
    /// ([`Cache::metadata`]).
    Structure,
    /// Also, at open, the index's and `metadata.arrow`'s checksums, the metadata table's
    /// decoding, and every shard's checksum.
    Full,
}

/// Why a cache file that is a directory (or a FIFO, a device) is refused.
const NOT_A_FILE: &str = "it is not a regular file (a cache's files are plain files)";

/// Opens a cache file and checks its real size against the manifest's, before anything reads it.
/// With `short_ok`, a file shorter than expected is accepted too (see [`Cache::open_in_use`]).
fn open_sized(
    cache: &str,
    dir: &Path,
    rel: &str,
    expected_len: u64,
    short_ok: bool,
) -> Result<(File, u64)> {
    let path = dir.join(rel);
    // Checked before the open too: opening a FIFO would wait for a writer.
    if std::fs::metadata(&path).is_ok_and(|m| !m.is_file()) {
        return Err(Error::malformed(cache, &path, NOT_A_FILE));
    }
    let file = match File::open(&path) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::malformed(cache, &path, "file is missing"))
        }
        Err(e) => return Err(Error::io("open", &path, e)),
    };
    let meta = file.metadata().ctx("stat", &path)?;
    if !meta.is_file() {
        // A directory opens on Linux (its size is that of its entries).
        return Err(Error::malformed(cache, &path, NOT_A_FILE));
    }
    let len = meta.len();
    if len != expected_len && !(short_ok && len < expected_len) {
        return Err(Error::malformed(
            cache,
            &path,
            format!("size is {len} bytes, the manifest says {expected_len}"),
        ));
    }
    Ok((file, len))
}

/// Maps a file opened by `open_sized`, with exactly the size just validated: the map never
/// covers more than the bytes the manifest accounts for, whatever the file grows to later.
fn map_sized(cache: &str, dir: &Path, rel: &str, file: &File, len: u64) -> Result<Mmap> {
    let path = dir.join(rel);
    let len = usize::try_from(len).map_err(|_| {
        Error::malformed(cache, &path, format!("{len} bytes cannot be mapped here"))
    })?;
    // SAFETY: `Mmap` hands out `&[u8]` over the file, which Rust assumes nobody changes while
    // it is borrowed. DatasetRT never modifies a published file (they are read-only, 0444), but
    // another process with write access can, and nothing here can stop it:
    // - bytes changed in place are seen by every later read; under `VerifyPolicy::Always` a
    //   record is verified against its checksum each time it is fetched, so a change made before
    //   that fetch is an error, but a change made after it (for example under a zero-copy view
    //   already handed out, or after the first fetch under `VerifyPolicy::Once`, the default of
    //   `ReaderConfig`) is not detected;
    // - a file truncated while mapped makes any access to the lost pages raise SIGBUS, which
    //   kills the process.
    // Both are documented in docs/storage-format.md ("Reading while files change"). Replacing
    // the directory or the files (rename, delete, rewrite into a new file) is harmless: the map
    // and `Cache::shard_file` keep the inode that was validated.
    let map = unsafe { memmap2::MmapOptions::new().len(len).map(file) }.ctx("mmap", &path)?;
    if map.len() != len {
        return Err(Error::malformed(
            cache,
            &path,
            format!("mapped {} bytes, expected {len}", map.len()),
        ));
    }
    Ok(map)
}

/// Why `bytes` do not have the checksum `expected`, if they do not.
fn checksum_mismatch(bytes: &[u8], expected: &str) -> Option<String> {
    let actual = checksum_hex(hash_bytes(bytes));
    (actual != expected).then(|| {
        format!(
            "checksum mismatch: computed {CHECKSUM_ALGO} {actual}, the manifest says {expected}"
        )
    })
}

fn check_sum(cache: &str, path: &Path, bytes: &[u8], expected: &str) -> Result<()> {
    match checksum_mismatch(bytes, expected) {
        Some(reason) => Err(Error::malformed(cache, path, reason)),
        None => Ok(()),
    }
}

/// The cache name a directory implies: its last component.
pub fn dir_cache_name(dir: &Path) -> String {
    dir.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// Reads and checks `manifest.json` alone; the manifest must name the cache `cache`.
pub fn read_manifest(dir: &Path, cache: &str) -> Result<Manifest> {
    let path = dir.join(MANIFEST_FILE);
    // A bad cache, not a failed read (the other sources of the call go on), and checked before
    // the read, which would wait for a writer on a FIFO.
    if std::fs::metadata(&path).is_ok_and(|m| !m.is_file()) {
        return Err(Error::malformed(cache, &path, NOT_A_FILE));
    }
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::malformed(cache, &path, "file is missing"))
        }
        Err(e) => return Err(Error::io("read", &path, e)),
    };
    parse_manifest(&bytes, cache, &path)
}

/// The versions this DatasetRT reads, in words: "1, 2 and 3".
fn readable_versions() -> String {
    let names: Vec<String> = READABLE_VERSIONS.iter().map(u32::to_string).collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.join(""),
    }
}

/// Parses and checks the bytes of a `manifest.json` (every check `read_manifest` runs), naming
/// `path` in its errors. Takes bytes so that fuzzers and tests can call it without files.
pub fn parse_manifest(bytes: &[u8], cache: &str, path: &Path) -> Result<Manifest> {
    let cache = cache.to_owned();
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| Error::malformed(&cache, path, format!("invalid JSON: {e}")))?;
    match value.get("format").and_then(|v| v.as_str()) {
        Some(FORMAT_NAME) => {}
        other => {
            return Err(Error::malformed(
                &cache,
                path,
                format!("not a DatasetRT manifest: format is {other:?}, expected {FORMAT_NAME:?}"),
            ))
        }
    }
    match value.get("format_version").and_then(|v| v.as_u64()) {
        Some(v) if READABLE_VERSIONS.iter().any(|&r| u64::from(r) == v) => {}
        Some(v) => {
            return Err(Error::malformed(
                &cache,
                path,
                format!(
                    "unsupported format version {v}: this DatasetRT reads versions {} (and \
                     writes {FORMAT_VERSION}); upgrade dataset-rt or rebuild the cache",
                    readable_versions()
                ),
            ))
        }
        None => {
            return Err(Error::malformed(
                &cache,
                path,
                "format_version is missing or not an integer",
            ))
        }
    }
    let manifest: Manifest = serde_json::from_value(value)
        .map_err(|e| Error::malformed(&cache, path, format!("invalid manifest: {e}")))?;
    if manifest.name != cache {
        return Err(Error::malformed(
            &cache,
            path,
            format!(
                "manifest names cache {:?}, but it lives in directory {cache:?}",
                manifest.name
            ),
        ));
    }
    manifest
        .compression
        .validate()
        .map_err(|e| Error::malformed(&cache, path, e.to_string()))?;
    if manifest.checksum_algo != CHECKSUM_ALGO || manifest.alignment != ALIGN {
        return Err(Error::malformed(
            &cache,
            path,
            format!(
                "checksum_algo {:?} / alignment {} are not {CHECKSUM_ALGO:?} / {ALIGN}",
                manifest.checksum_algo, manifest.alignment
            ),
        ));
    }
    let fingerprint = manifest.compute_fingerprint();
    if fingerprint != manifest.fingerprint {
        return Err(Error::malformed(
            &cache,
            path,
            format!(
                "fingerprint mismatch: computed {fingerprint}, the manifest says {}",
                manifest.fingerprint
            ),
        ));
    }
    let shard_records = manifest
        .shards
        .iter()
        .try_fold(0u64, |sum, s| sum.checked_add(s.records));
    if shard_records != Some(manifest.num_samples) {
        let held = shard_records.map_or("more than 2**64".to_owned(), |n| n.to_string());
        return Err(Error::malformed(
            &cache,
            path,
            format!(
                "shards hold {held} records, num_samples is {}",
                manifest.num_samples
            ),
        ));
    }
    for (i, s) in manifest.shards.iter().enumerate() {
        if s.file != shard_file_name(i as u32) {
            return Err(Error::malformed(
                &cache,
                path,
                format!(
                    "shard {i} is named {:?}, expected {:?}",
                    s.file,
                    shard_file_name(i as u32)
                ),
            ));
        }
    }
    if manifest.index.file != INDEX_FILE || manifest.metadata.file != METADATA_FILE {
        return Err(Error::malformed(
            &cache,
            path,
            "index or metadata file name is not standard",
        ));
    }
    Ok(manifest)
}

impl Cache {
    /// Opens `dir` (a cache directory, `base/name`) and validates it.
    pub fn open(dir: &Path, validation: Validation) -> Result<Cache> {
        Self::open_as(dir, &dir_cache_name(dir), validation)
    }

    /// Opens a cache whose directory name is not (yet) its name: the writer's temporary one.
    ///
    /// The checks run cheapest first (see "Size checks" in docs/storage-format.md): the
    /// manifest, then every size it implies against the files' real sizes, and only then the
    /// hashing and parsing, so a forged size costs nothing before it is refused. It never
    /// panics: a panic in a parser is caught as a last line of defence and reported as a
    /// malformed cache.
    pub fn open_as(dir: &Path, name: &str, validation: Validation) -> Result<Cache> {
        Self::open_catching(dir, name, validation, false, None)
    }

    /// Opens a cache that another process of this dataset opened and validated, and that may
    /// have been damaged since (the loader's producer): a shard shorter than the manifest says
    /// is opened anyway, so that the samples before its records are still served and each of
    /// its records is refused as it comes, naming the shard and the sample
    /// ([`Cache::check_shard_size`]), as in the process that opened it first.
    pub fn open_in_use(dir: &Path) -> Result<Cache> {
        Self::open_catching(dir, &dir_cache_name(dir), Validation::Structure, true, None)
    }

    /// Opens a cache whose shards are not local files: `dir` holds its manifest, `index.bin` and
    /// `metadata.arrow` (a downloaded copy, fully validated here, checksums included), and every
    /// record is read through `records` (object storage), then checked as a mapped record is.
    /// Only format v3 and later: a record's extent must be known from its index entry alone.
    pub fn open_fetched(dir: &Path, name: &str, records: Arc<dyn RecordSource>) -> Result<Cache> {
        Self::open_catching(dir, name, Validation::Full, false, Some(records))
    }

    fn open_catching(
        dir: &Path,
        name: &str,
        validation: Validation,
        short_shards_ok: bool,
        records: Option<Arc<dyn RecordSource>>,
    ) -> Result<Cache> {
        // Unwind safety: a panic while opening leaves only values dropped with the unwind (the
        // record source is not used before the cache is returned).
        let open = AssertUnwindSafe(|| {
            Self::open_checked(dir, name, validation, short_shards_ok, records.clone())
        });
        std::panic::catch_unwind(open).unwrap_or_else(|panic| {
            Err(Error::malformed(
                name,
                dir,
                format!(
                    "the cache could not be parsed: {}",
                    crate::pool::panic_payload(&panic)
                ),
            ))
        })
    }

    fn open_checked(
        dir: &Path,
        name: &str,
        validation: Validation,
        short_shards_ok: bool,
        records: Option<Arc<dyn RecordSource>>,
    ) -> Result<Cache> {
        // The cache stays where it was when opened, whatever the process's working directory
        // becomes (Hydra changes it after the data is set up): the loader's producer and its
        // workers reopen its files by this path. Its files are opened here by the path as given,
        // which needs no search permission above the working directory.
        let absolute = std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned());
        // A file where a cache directory should be is a bad cache, not a failed read.
        if std::fs::metadata(dir).is_ok_and(|m| !m.is_dir()) {
            return Err(Error::malformed(name, dir, "it is not a directory"));
        }
        let manifest = read_manifest(dir, name)?;
        let name = manifest.name.clone();
        if records.is_some() && manifest.format_version < 3 {
            return Err(Error::malformed(
                &name,
                dir.join(MANIFEST_FILE),
                format!(
                    "format v{} cannot be read from object storage (its index entries lack \
                     the records' extents): write the cache again with this version, then push it",
                    manifest.format_version
                ),
            ));
        }

        // 1. Sizes the manifest implies, with checked arithmetic.
        let index_path = dir.join(INDEX_FILE);
        let entry_len = index_entry_len(manifest.format_version);
        let index_len = manifest
            .num_samples
            .checked_mul(entry_len)
            .and_then(|n| n.checked_add(INDEX_HEADER_LEN));
        if index_len != Some(manifest.index.bytes) {
            let need = index_len.map_or("more than 2**64".to_owned(), |n| n.to_string());
            return Err(Error::malformed(
                &name,
                &index_path,
                format!(
                    "the manifest says {} bytes, {} samples need {need}",
                    manifest.index.bytes, manifest.num_samples
                ),
            ));
        }
        let index_len = manifest.index.bytes;
        for s in &manifest.shards {
            // Every record takes at least its header: a shard cannot hold more records than that.
            let min = s
                .records
                .checked_mul(RECORD_HEADER_LEN)
                .and_then(|n| n.checked_add(SHARD_HEADER_LEN));
            if min.is_none_or(|min| s.bytes < min) {
                return Err(Error::malformed(
                    &name,
                    dir.join(&s.file),
                    format!(
                        "the manifest says {} bytes for {} records, which need at least \
                         {SHARD_HEADER_LEN} + {RECORD_HEADER_LEN} per record",
                        s.bytes, s.records
                    ),
                ));
            }
        }

        // 2. Every file's real size against the manifest, before any of them is read.
        let (index_file, _) = open_sized(&name, dir, INDEX_FILE, index_len, false)?;
        let (meta_file, _) = open_sized(&name, dir, METADATA_FILE, manifest.metadata.bytes, false)?;
        let mut shard_files = Vec::with_capacity(manifest.shards.len());
        for s in manifest.shards.iter().filter(|_| records.is_none()) {
            shard_files.push(open_sized(&name, dir, &s.file, s.bytes, short_shards_ok)?);
        }

        // 3. Contents: headers, and under `Full` the checksums and the metadata table. Under
        // `Structure` nothing here grows with the number of samples: every read checks its index
        // entry against its record, and the first use of the metadata table checks the file.
        let index = map_sized(&name, dir, INDEX_FILE, &index_file, index_len)?;
        if validation == Validation::Full {
            check_sum(&name, &index_path, &index, &manifest.index.checksum)?;
        }
        let version = manifest.format_version;
        if index[..INDEX_HEADER_LEN as usize] != index_header_of(version) {
            return Err(Error::malformed(&name, &index_path, "bad index header"));
        }

        let index_identity = FileIdentity::of(&index_file, &index_path)?;
        let metadata_identity = FileIdentity::of(&meta_file, &dir.join(METADATA_FILE))?;
        let metadata_map = Arc::new(map_sized(
            &name,
            dir,
            METADATA_FILE,
            &meta_file,
            manifest.metadata.bytes,
        )?);

        let mut shards = Vec::with_capacity(manifest.shards.len());
        for (i, (s, (file, len))) in manifest.shards.iter().zip(&shard_files).enumerate() {
            let path = dir.join(&s.file);
            let map = map_sized(&name, dir, &s.file, file, s.bytes)?;
            // A shard cut short (`open_in_use`) is not read here: its header may lie past its
            // end, and every read of its records refuses it first. The header is read with
            // `pread`, not through the map: a fault on a fresh map reads around it (as much as
            // the device's `read_ahead_kb`, 8 MiB on some machines, for every shard of a
            // dataset that does not fit in memory), where a 16-byte read reads a few pages.
            if *len >= s.bytes {
                let mut header = [0u8; SHARD_HEADER_LEN as usize];
                match file.read_exact_at(&mut header, 0) {
                    Ok(()) => {}
                    // Cut short since its size was checked above.
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                        return Err(Error::malformed(&name, &path, "shorter than its header"));
                    }
                    Err(e) => return Err(Error::io("read", &path, e)),
                }
                if header != shard_header_of(version, i as u32) {
                    return Err(Error::malformed(&name, &path, "bad shard header"));
                }
            }
            if validation == Validation::Full {
                check_sum(&name, &path, &map, &s.checksum)?;
            }
            shards.push(map);
        }
        let shard_files = shard_files.into_iter().map(|(file, _)| file).collect();
        let cache = Cache {
            dir: absolute,
            manifest,
            index,
            entry_len,
            shards,
            records,
            shard_files,
            metadata_map,
            metadata_file: meta_file,
            index_file,
            index_identity,
            metadata_identity,
            metadata: OnceLock::new(),
        };
        if validation == Validation::Full {
            cache.metadata()?;
        }
        Ok(cache)
    }

    /// The metadata table of `metadata.arrow`. The first call checks the file's checksum and
    /// decodes it (every later call returns that table, or the same error): a damaged file is a
    /// [`Error::Malformed`] naming it, at the first use of the table rather than at open.
    pub fn metadata(&self) -> Result<&MetadataTable> {
        self.metadata
            .get_or_init(|| self.load_metadata())
            .as_ref()
            .map_err(|reason| Error::malformed(self.name(), self.dir.join(METADATA_FILE), reason))
    }

    /// Whether the metadata table was loaded (or refused) already: callers that hold a lock (the
    /// GIL) release it around the first [`Cache::metadata`], which reads the whole file.
    pub fn metadata_loaded(&self) -> bool {
        self.metadata.get().is_some()
    }

    fn load_metadata(&self) -> std::result::Result<MetadataTable, String> {
        let map = &self.metadata_map;
        // Truncated since the open, reading the map past the new end would be SIGBUS.
        if let Some(reason) = truncated_since_open(&self.metadata_file, map.len() as u64, "file")
            .map_err(|e| format!("stat failed: {e}"))?
        {
            return Err(reason);
        }
        if let Some(reason) = checksum_mismatch(map, &self.manifest.metadata.checksum) {
            return Err(reason);
        }
        // Fixed-width columns are served from the map itself. A string column is copied: its
        // offsets are trusted once checked, so they must not be bytes that can change later.
        let has_strings = self.manifest.sample_id_type == FieldType::Str
            || self
                .manifest
                .metadata_schema
                .iter()
                .any(|f| f.dtype == FieldType::Str);
        let bytes = if has_strings || map.is_empty() {
            arrow_buffer::Buffer::from_slice_ref(&map[..])
        } else {
            let ptr = std::ptr::NonNull::new(map.as_ptr().cast_mut()).expect("a map is not null");
            // SAFETY: the map holds `map.len()` readable bytes for as long as the buffer keeps
            // its `Arc`; what another process may change in them is discussed in `map_sized`,
            // and no value of a fixed-width column is invalid.
            unsafe { arrow_buffer::Buffer::from_custom_allocation(ptr, map.len(), map.clone()) }
        };
        MetadataTable::decode_buffer(
            bytes,
            &self.manifest.metadata_schema,
            self.manifest.sample_id_type,
            self.manifest.num_samples,
        )
    }

    pub fn name(&self) -> &str {
        &self.manifest.name
    }

    pub fn len(&self) -> u64 {
        self.manifest.num_samples
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether any record may be stored compressed: not in a cache written without compression
    /// (`check_record` refuses a record that claims otherwise).
    pub fn may_hold_compressed(&self) -> bool {
        self.manifest.compression.algo != CompressionAlgo::None
    }

    /// Where index entry `sample` lies in `index.bin`.
    fn entry_range(&self, sample: u64) -> std::ops::Range<usize> {
        let start = (INDEX_HEADER_LEN + sample * self.entry_len) as usize;
        start..start + self.entry_len as usize
    }

    pub fn entry(&self, sample: u64) -> IndexEntry {
        IndexEntry::decode_as(
            self.manifest.format_version,
            &self.index[self.entry_range(sample)],
        )
    }

    /// Whether a record this process verified can be served from its index entry alone
    /// ([`Cache::trusted_record`]): from format v3 on, where the entry holds the metadata length.
    pub fn serves_from_index(&self) -> bool {
        self.manifest.format_version >= 3
    }

    /// Asks the CPU to bring in the index entry of `sample` (a hint, like
    /// [`Cache::prefetch_record`]): what a read served from the index touches.
    pub fn prefetch_entry(&self, sample: u64) {
        let Some(entry) = self.index.get(self.entry_range(sample)) else {
            return;
        };
        prefetch(entry);
        // An entry may straddle two cache lines; the fields a read needs end at byte 28.
        prefetch(&entry[27..]);
    }

    /// Asks the kernel to start reading the page of `index.bin` that holds the entry of
    /// `sample` (`madvise(MADV_WILLNEED)`, a hint: it waits for nothing and takes no fault), so
    /// that working out where the record lies does not wait for the device. `last` is the page
    /// (its offset in the file) asked for just before, which is not asked for again. Returns the
    /// entry's page and whether it was asked for; `None` for a sample the index does not have.
    pub fn advise_entry(&self, sample: u64, last: Option<u64>) -> Option<(u64, bool)> {
        let range = self.entry_range(sample);
        if range.end > self.index.len() {
            return None;
        }
        let page = crate::os::page() as usize;
        let start = range.start - range.start % page;
        if last == Some(start as u64) && range.end <= start + page {
            return Some((start as u64, false));
        }
        // SAFETY: `start` is page-aligned and `start .. range.end` lies inside the live map of
        // the index; MADV_WILLNEED only starts reading the file's pages into the page cache, it
        // changes no byte of the map. A failure is harmless (a hint).
        unsafe {
            libc::madvise(
                self.index.as_ptr().add(start) as *mut libc::c_void,
                range.end - start,
                libc::MADV_WILLNEED,
            );
        }
        Some((start as u64, true))
    }

    /// Asks the CPU to bring in the header of record `sample` (a hint: nothing is read, no
    /// fault is taken, a bad index entry is ignored here and reported by the read).
    pub fn prefetch_record(&self, sample: u64) {
        let e = self.entry(sample);
        let Some(shard) = self.shards.get(e.shard as usize) else {
            return;
        };
        let Some(header) = usize::try_from(e.offset).ok().and_then(|o| shard.get(o..)) else {
            return;
        };
        prefetch(header);
    }

    /// Where shard `shard` is: its file, or its URL when the records come from object storage.
    pub fn shard_path(&self, shard: u32) -> PathBuf {
        match &self.records {
            Some(records) => PathBuf::from(records.shard_location(shard)),
            None => self.dir.join(shard_file_name(shard)),
        }
    }

    /// Where the cache is, for errors and logs: its directory, or its URL when the records come
    /// from object storage.
    pub fn location(&self) -> String {
        match &self.records {
            Some(records) => records.location(),
            None => self.dir.display().to_string(),
        }
    }

    /// Whether the records are read through a [`RecordSource`] (object storage), not from maps
    /// of local shard files: such a cache has no shard files, maps or views, and every read
    /// copies its record ([`crate::dataset::Payload::Owned`]).
    pub fn is_fetched(&self) -> bool {
        self.records.is_some()
    }

    /// The source of the records of a cache that [`Cache::is_fetched`].
    pub fn records(&self) -> Option<&Arc<dyn RecordSource>> {
        self.records.as_ref()
    }

    /// The open file of shard `shard`: the one validated and read here, even if the cache's
    /// directory has been replaced since it was opened. A fetched cache has none (panics).
    pub fn shard_file(&self, shard: u32) -> &File {
        &self.shard_files[shard as usize]
    }

    /// The identity of the `index.bin` this cache mapped when it was opened.
    pub fn index_identity(&self) -> FileIdentity {
        self.index_identity
    }

    /// The identity of the `metadata.arrow` this cache mapped when it was opened.
    pub fn metadata_identity(&self) -> FileIdentity {
        self.metadata_identity
    }

    /// The validated size of shard `shard` in bytes: the manifest's, which is the length of its
    /// map. Whoever maps the shard again maps exactly this many bytes.
    pub fn shard_len(&self, shard: u32) -> u64 {
        self.manifest.shards[shard as usize].bytes
    }

    pub fn num_shards(&self) -> usize {
        self.manifest.shards.len()
    }

    /// The end of the payload at `offset..offset + len` of shard `shard` (sample `row`'s), within
    /// the shard's validated size. A reader checked the record against that size, so this holds;
    /// it is checked where a view of the map is cut, because a short view would be silently
    /// wrong.
    pub fn payload_end(&self, shard: u32, offset: u64, len: u64, row: u64) -> Result<u64> {
        let size = self.shard_len(shard);
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(end),
            _ => Err(Error::CorruptRecord {
                cache: self.name().to_owned(),
                shard: self.shard_path(shard),
                offset: self.entry(row).offset,
                sample: row,
                reason: format!(
                    "the payload at {offset}..{offset} + {len} lies past the end of the shard's \
                     {size} bytes"
                ),
            }),
        }
    }

    /// Checks with one `fstat` that shard `shard`'s file is not shorter than its validated size,
    /// before records of it are read or handed out. The map keeps the validated length whatever
    /// the file becomes: reading a page past a truncated file's end raises SIGBUS, and the rest
    /// of its last page reads as zeros, so a truncated shard must be refused before its bytes
    /// are touched. The error is a [`Error::CorruptRecord`] naming `record` (sample and offset)
    /// when a record is being read, else a [`Error::Malformed`] naming the shard.
    pub fn check_shard_size(&self, shard: u32, record: Option<(u64, u64)>) -> Result<()> {
        if self.records.is_some() {
            return Ok(()); // nothing is mapped: every read checks the bytes it got
        }
        let file = &self.shard_files[shard as usize];
        let Some(reason) = truncated_since_open(file, self.shard_len(shard), "shard")
            .map_err(|e| Error::io("stat", self.shard_path(shard), e))?
        else {
            return Ok(());
        };
        Err(match record {
            Some((sample, offset)) => self.corrupt(shard, offset, sample, reason),
            None => Error::malformed(self.name(), self.shard_path(shard), reason),
        })
    }

    /// Checks with one `fstat` that `index.bin` is not shorter than when the cache was opened,
    /// as a pass begins: every sample's read starts at its index entry, in the map, and a page
    /// of the map past a truncated file's end raises SIGBUS. A [`Error::Malformed`] naming the
    /// file. (A truncation during the pass is not caught: see the storage format's "Reading
    /// while files change".)
    pub fn check_index_size(&self) -> Result<()> {
        let path = self.dir.join(INDEX_FILE);
        match truncated_since_open(&self.index_file, self.index.len() as u64, "index") {
            Ok(None) => Ok(()),
            Ok(Some(reason)) => Err(Error::malformed(self.name(), path, reason)),
            Err(e) => Err(Error::io("stat", path, e)),
        }
    }

    fn corrupt(&self, shard: u32, offset: u64, sample: u64, reason: impl Into<String>) -> Error {
        Error::CorruptRecord {
            cache: self.name().to_owned(),
            shard: self.shard_path(shard),
            offset,
            sample,
            reason: reason.into(),
        }
    }

    /// Locates and verifies record `sample`: its header must agree with the index and its
    /// checksum with its bytes. Returns the header and the payload's offset in its shard.
    ///
    /// Never panics on a damaged record: a panic in the checks below (a case they did not
    /// foresee) is caught and reported as that record's corruption.
    pub fn verify_record(&self, sample: u64) -> Result<(IndexEntry, RecordHeader, u64)> {
        self.check_record(sample, true)
    }

    /// Locates record `sample` and runs `verify_record`'s structural checks (header against the
    /// index, flags, lengths within the shard, the bound on an LZ4 payload's decoded size),
    /// which keep reading and decoding it safe; its checksum only when `checksum` is true.
    pub fn check_record(
        &self,
        sample: u64,
        checksum: bool,
    ) -> Result<(IndexEntry, RecordHeader, u64)> {
        debug_assert!(sample < self.len());
        let e = self.entry(sample);
        let Some(shard) = self.shards.get(e.shard as usize) else {
            return Err(self.missing_shard(sample, &e));
        };
        self.check_catching(sample, e, shard, 0, checksum)
    }

    /// [`Cache::check_record`] on bytes read from elsewhere (a fetched cache's record source):
    /// `bytes` are bytes `base .. base + bytes.len()` of the record's shard, which must hold
    /// the whole record. The payload's offset returned is in the shard, as for a mapped record.
    pub fn check_fetched(
        &self,
        sample: u64,
        bytes: &[u8],
        base: u64,
        checksum: bool,
    ) -> Result<(IndexEntry, RecordHeader, u64)> {
        debug_assert!(sample < self.len());
        let e = self.entry(sample);
        if e.shard as usize >= self.num_shards() {
            return Err(self.missing_shard(sample, &e));
        }
        self.check_catching(sample, e, bytes, base, checksum)
    }

    fn check_catching(
        &self,
        sample: u64,
        e: IndexEntry,
        bytes: &[u8],
        base: u64,
        checksum: bool,
    ) -> Result<(IndexEntry, RecordHeader, u64)> {
        // Unwind safety: the checks only read the cache, so a panic leaves nothing half-changed.
        let checked =
            AssertUnwindSafe(|| self.check_record_unwinding(sample, e, bytes, base, checksum));
        std::panic::catch_unwind(checked).unwrap_or_else(|panic| {
            Err(self.corrupt(
                e.shard,
                e.offset,
                sample,
                format!(
                    "the record could not be parsed: {}",
                    crate::pool::panic_payload(&panic)
                ),
            ))
        })
    }

    /// The checks of [`Cache::check_record`] on `shard`, bytes `base ..` of the record's shard
    /// (the whole map, or the bytes fetched for the record).
    fn check_record_unwinding(
        &self,
        sample: u64,
        e: IndexEntry,
        shard: &[u8],
        base: u64,
        checksum: bool,
    ) -> Result<(IndexEntry, RecordHeader, u64)> {
        // The index entry is unchecked until here: every field of it is bounded before use.
        let shard_len = self.shard_len(e.shard);
        let header_end = e.offset.saturating_add(RECORD_HEADER_LEN);
        if header_end > shard_len {
            return Err(self.corrupt(
                e.shard,
                e.offset,
                sample,
                format!(
                    "record lies past the end of its shard ({shard_len} bytes) at the offset \
                     {INDEX_FILE} gives"
                ),
            ));
        }
        // Where the record starts in `shard`: what was fetched must hold it from its header on.
        let fetched_short = |what: &str| {
            self.corrupt(
                e.shard,
                e.offset,
                sample,
                format!(
                    "{what} lies outside the {} bytes read from offset {base}",
                    shard.len()
                ),
            )
        };
        let start = match e.offset.checked_sub(base) {
            Some(start) if start + RECORD_HEADER_LEN <= shard.len() as u64 => start as usize,
            _ => return Err(fetched_short("the record header")),
        };
        let header_end = start + RECORD_HEADER_LEN as usize;
        let version = self.manifest.format_version;
        let h = RecordHeader::decode_as(version, &shard[start..header_end])
            .map_err(|r| self.corrupt(e.shard, e.offset, sample, r))?;
        if h.sample != sample
            || h.flags != e.flags
            || h.stored_len != e.stored_len
            || h.raw_len != e.raw_len
            || h.checksum != e.checksum
            || e.meta_len.is_some_and(|m| m != h.meta_len)
        {
            return Err(self.corrupt(
                e.shard,
                e.offset,
                sample,
                format!(
                    "record header {h:?} disagrees with index entry {e:?} ({INDEX_FILE} or the \
                     shard is damaged)"
                ),
            ));
        }
        // The header and the entry agree: the rules below read the entry.
        let payload_start = self.check_layout(sample, &e, h.meta_len, shard_len)?;
        let payload_end = payload_start + u64::from(h.stored_len);
        if payload_end - base > shard.len() as u64 {
            return Err(fetched_short("the payload"));
        }
        if !checksum {
            return Ok((e, h, payload_start));
        }
        let (payload_start_here, payload_end_here) = (
            (payload_start - base) as usize,
            (payload_end - base) as usize,
        );
        let actual = if version == 1 {
            let meta = &shard[header_end..header_end + h.meta_len as usize];
            let payload = &shard[payload_start_here..payload_end_here];
            h.checksum_as(1, meta, payload)
        } else {
            // One shot over one contiguous range: the fields, metadata, padding and payload.
            hash_bytes(&shard[start + RECORD_V2_HASHED_FROM as usize..payload_end_here])
        };
        if actual != h.checksum {
            return Err(self.corrupt(
                e.shard,
                e.offset,
                sample,
                format!(
                    "checksum mismatch: computed {}, stored {}",
                    checksum_hex(actual),
                    checksum_hex(h.checksum)
                ),
            ));
        }
        Ok((e, h, payload_start))
    }

    fn missing_shard(&self, sample: u64, e: &IndexEntry) -> Error {
        self.corrupt(
            e.shard,
            e.offset,
            sample,
            format!(
                "{INDEX_FILE} names shard {}, which does not exist (the cache has {})",
                e.shard,
                self.num_shards()
            ),
        )
    }

    /// Where the payload of record `sample` lies, from its index entry alone, without reading
    /// the record: for a record whose header this process already checked against this entry
    /// (and whose checksum matched), under `VerifyPolicy::Once`. `None` before format v3, whose
    /// entries lack the metadata length. The entry's bounds are checked again, as on every
    /// read: the shard exists, the payload lies inside it, the lengths are possible.
    pub fn trusted_record(&self, sample: u64) -> Option<Result<(IndexEntry, RecordHeader, u64)>> {
        let e = self.entry(sample);
        let meta_len = e.meta_len?;
        if self.records.is_some() {
            return None; // served from the bytes of each read, never from the entry alone
        }
        if e.shard as usize >= self.num_shards() {
            return Some(Err(self.missing_shard(sample, &e)));
        }
        let shard_len = self.shard_len(e.shard);
        Some(
            self.check_layout(sample, &e, meta_len, shard_len)
                .map(|start| {
                    let h = RecordHeader {
                        flags: e.flags,
                        meta_len,
                        stored_len: e.stored_len,
                        raw_len: e.raw_len,
                        sample,
                        checksum: e.checksum,
                    };
                    (e, h, start)
                }),
        )
    }

    /// The rules of a record's layout that keep reading and decoding in bounds, checked on
    /// index entry `e` (which a full read has found equal to the record's header): known flags,
    /// possible lengths, and a payload inside a shard of `shard_len` bytes. Returns where the
    /// payload starts.
    fn check_layout(
        &self,
        sample: u64,
        e: &IndexEntry,
        meta_len: u32,
        shard_len: u64,
    ) -> Result<u64> {
        if e.flags & !KNOWN_FLAGS != 0 {
            return Err(self.corrupt(
                e.shard,
                e.offset,
                sample,
                format!("unknown flags {:#x}", e.flags),
            ));
        }
        // Before any byte is hashed or any buffer allocated: a raw payload is `raw_len` bytes
        // as stored, and an LZ4 one decodes to at most LZ4_MAX_RATIO bytes per stored byte.
        let lz4 = e.flags & FLAG_LZ4 != 0;
        if !lz4 && e.raw_len != e.stored_len {
            return Err(self.corrupt(
                e.shard,
                e.offset,
                sample,
                format!(
                    "payload stored raw, but stored_len {} and raw_len {} differ",
                    e.stored_len, e.raw_len
                ),
            ));
        }
        if lz4 && self.manifest.compression.algo == CompressionAlgo::None {
            // Readers size their read-ahead on this: a cache written without compression has
            // nothing to decompress.
            return Err(self.corrupt(
                e.shard,
                e.offset,
                sample,
                "the record is stored LZ4-compressed, but the manifest says the cache was \
                 written without compression",
            ));
        }
        if lz4 && u64::from(e.raw_len) > LZ4_MAX_RATIO * u64::from(e.stored_len) {
            return Err(self.corrupt(
                e.shard,
                e.offset,
                sample,
                format!(
                    "raw length {} is more than LZ4 can expand {} stored bytes to",
                    e.raw_len, e.stored_len
                ),
            ));
        }
        // Checked arithmetic: an entry that no read has checked yet may hold any offset.
        let payload_start = e.offset.checked_add(payload_offset(meta_len));
        let payload_end = payload_start.and_then(|p| p.checked_add(u64::from(e.stored_len)));
        match (payload_start, payload_end) {
            (Some(start), Some(end)) if end <= shard_len => Ok(start),
            _ => Err(self.corrupt(
                e.shard,
                e.offset,
                sample,
                "record lies past the end of its shard",
            )),
        }
    }

    /// The verified, decompressed payload of `sample`: borrowed from the map when stored raw.
    pub fn payload(&self, sample: u64) -> Result<Cow<'_, [u8]>> {
        if let Some((bytes, base)) = self.fetch_record(sample)? {
            let (e, h, start) = self.check_fetched(sample, (*bytes).as_ref(), base, true)?;
            let from = (start - base) as usize;
            let stored = &(*bytes).as_ref()[from..from + h.stored_len as usize];
            return Ok(Cow::Owned(
                self.decode_stored(sample, &e, &h, stored)?.into_owned(),
            ));
        }
        let (e, h, start) = self.verify_record(sample)?;
        self.decode_payload(sample, &e, &h, start)
    }

    /// The bytes of record `sample` from the record source of a fetched cache, with the offset
    /// in its shard where they start; `None` for a local cache. The extent comes from the index
    /// entry (unchecked): a bad one is refused by the checks of the bytes.
    pub fn fetch_record(&self, sample: u64) -> Result<Option<(crate::dataset::RecordBytes, u64)>> {
        let Some(records) = &self.records else {
            return Ok(None);
        };
        let e = self.entry(sample);
        if e.shard as usize >= self.num_shards() {
            return Err(self.missing_shard(sample, &e));
        }
        let shard_len = self.shard_len(e.shard);
        let extent = self.record_extent(sample);
        let Some((_, offset, len)) = extent.filter(|&(_, _, len)| len >= RECORD_HEADER_LEN) else {
            return Err(self.corrupt(
                e.shard,
                e.offset,
                sample,
                format!(
                    "record lies past the end of its shard ({shard_len} bytes) at the offset \
                     {INDEX_FILE} gives"
                ),
            ));
        };
        let range = Range {
            cache: 0,
            shard: e.shard,
            offset,
            len,
        };
        Ok(Some((records.read(&range, sample)?, offset)))
    }

    /// Where record `sample` lies, from its index entry: its shard, its offset and its length
    /// (header, metadata and stored payload), cut at the shard's validated end. `None` when the
    /// entry names no shard of the cache or an offset past its end. The extent is not checked:
    /// the bytes read there are checked against the entry. A format v2 entry does not give the
    /// metadata's length: 4 KiB of it are assumed, which covers what a read-ahead needs.
    pub fn record_extent(&self, sample: u64) -> Option<(u32, u64, u64)> {
        let e = self.entry(sample);
        if e.shard as usize >= self.num_shards() {
            return None;
        }
        let shard_len = self.shard_len(e.shard);
        if e.offset >= shard_len {
            return None;
        }
        let len =
            payload_offset(e.meta_len.unwrap_or(4096)).saturating_add(u64::from(e.stored_len));
        Some((e.shard, e.offset, len.min(shard_len - e.offset)))
    }

    /// The whole map of shard `shard` (its validated size), for whoever serves views of it;
    /// empty for a fetched cache, which maps nothing.
    pub fn shard_bytes(&self, shard: u32) -> &[u8] {
        self.shards.get(shard as usize).map_or(&[], |m| &m[..])
    }

    /// The stored bytes `offset..offset + len` of shard `shard`: a payload that `verify_record`
    /// checked (a [`crate::dataset::Payload::Mapped`]), served from the map without a copy.
    pub(crate) fn mapped(&self, shard: u32, offset: u64, len: u64) -> &[u8] {
        &self.shards[shard as usize][offset as usize..(offset + len) as usize]
    }

    /// The payload of a record already verified by `verify_record`.
    pub fn decode_payload(
        &self,
        sample: u64,
        e: &IndexEntry,
        h: &RecordHeader,
        start: u64,
    ) -> Result<Cow<'_, [u8]>> {
        let stored = &self.shards[e.shard as usize]
            [start as usize..(start + u64::from(h.stored_len)) as usize];
        self.decode_stored(sample, e, h, stored)
    }

    /// A record's stored payload `stored`, decompressed when it is compressed.
    pub fn decode_stored<'a>(
        &self,
        sample: u64,
        e: &IndexEntry,
        h: &RecordHeader,
        stored: &'a [u8],
    ) -> Result<Cow<'a, [u8]>> {
        if h.flags & FLAG_LZ4 == 0 {
            return Ok(Cow::Borrowed(stored));
        }
        let raw = lz4_flex::block::decompress(stored, h.raw_len as usize).map_err(|err| {
            self.corrupt(
                e.shard,
                e.offset,
                sample,
                format!("LZ4 payload does not decode: {err}"),
            )
        })?;
        if raw.len() != h.raw_len as usize {
            return Err(self.corrupt(
                e.shard,
                e.offset,
                sample,
                "LZ4 payload decodes to the wrong length",
            ));
        }
        Ok(Cow::Owned(raw))
    }

    /// The metadata JSON embedded in record `sample` (verified).
    pub fn embedded_metadata(&self, sample: u64) -> Result<serde_json::Value> {
        let fetched = self.fetch_record(sample)?;
        let (e, h, start, shard) = match &fetched {
            Some((bytes, base)) => {
                let (e, h, _) = self.check_fetched(sample, (**bytes).as_ref(), *base, true)?;
                (
                    e,
                    h,
                    (e.offset - base + RECORD_HEADER_LEN) as usize,
                    (**bytes).as_ref(),
                )
            }
            None => {
                let (e, h, _) = self.verify_record(sample)?;
                let start = (e.offset + RECORD_HEADER_LEN) as usize;
                (e, h, start, &self.shards[e.shard as usize][..])
            }
        };
        let bytes = &shard[start..start + h.meta_len as usize];
        serde_json::from_slice(bytes).map_err(|err| {
            self.corrupt(
                e.shard,
                e.offset,
                sample,
                format!("embedded metadata is not JSON: {err}"),
            )
        })
    }

    /// Checks the index's checksum and the metadata table, then every record, then every shard
    /// checksum (what `dataset-rt verify` runs, whatever the cache was opened with). Records
    /// before shards, so damage inside a record is reported with its sample; the shard pass then
    /// catches damage in the padding between records.
    pub fn verify_all(&self) -> Result<()> {
        check_sum(
            self.name(),
            &self.dir.join(INDEX_FILE),
            &self.index,
            &self.manifest.index.checksum,
        )?;
        self.metadata()?;
        for sample in 0..self.len() {
            self.payload(sample)?;
        }
        // A fetched cache's shards are not here: each record was verified as it was fetched.
        for (i, s) in self
            .manifest
            .shards
            .iter()
            .enumerate()
            .take(self.shards.len())
        {
            check_sum(
                self.name(),
                &self.shard_path(i as u32),
                &self.shards[i],
                &s.checksum,
            )?;
        }
        Ok(())
    }
}

/// Asks the CPU to bring the cache line at the start of `bytes` closer (a hint: it reads no data
/// and cannot fault).
fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        // SAFETY: a prefetch is a hint: it reads no data and cannot fault, and the address lies
        // in a live map anyway.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(bytes.as_ptr().cast()) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

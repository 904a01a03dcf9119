//! Cache sets: one dataset written as parts. A set is a directory holding its part caches and a
//! set manifest (`set.json`) that lists the parts in order with their fingerprints.
//!
//! The parts are written, each by the ordinary cache writer, into a staging directory beside the
//! set (`base/.NAME.set-parts`), under names that the set decides (`NAME.part-000000`, ...). A
//! part is published there as any cache is, by one rename, so a crashed build keeps the parts it
//! finished and a rerun writes only the missing ones. Once every part is published, the set
//! manifest is written into the staging directory and the whole directory is renamed to
//! `base/NAME`: the set appears by that one rename, complete, or not at all.
//!
//! The set's fingerprint is the one a dataset of its parts, in order, has ([`combined_fingerprint`]),
//! so a dataset over the set alone carries the set's fingerprint, and a checkpoint of another set
//! (other parts, or the same parts in another order) is refused by it.

use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

mod ledger;
pub use ledger::{PartOutcome, PartResult, SetConclusion, SetLedger};

use crate::cache::{dir_cache_name, Cache, Validation};
use crate::error::{Error, IoContext, Result};
pub use crate::format::combined_fingerprint;
use crate::format::{MANIFEST_FILE, WRITER_VERSION};
use crate::liveness;
use crate::writer::{reap_dead_leftovers, validate_name, CacheLock, Claim, MAX_NAME_BYTES};

/// The set manifest's file name inside a set directory.
pub const SET_MANIFEST_FILE: &str = "set.json";
/// `format` of every set manifest.
pub const SET_FORMAT_NAME: &str = "dataset-rt-cache-set";
/// The set manifest version this DatasetRT writes and reads.
pub const SET_FORMAT_VERSION: u32 = 1;
/// The most parts a set may have: a part's number has six digits.
pub const MAX_PARTS: usize = 1_000_000;
/// What a part's name adds to the set's name: `.part-` and six digits.
const PART_SUFFIX_BYTES: usize = ".part-".len() + 6;
/// The longest set name, in bytes: its parts' names must still be valid cache names.
pub const MAX_SET_NAME_BYTES: usize = MAX_NAME_BYTES - PART_SUFFIX_BYTES;

/// One part as the set manifest lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PartEntry {
    pub name: String,
    pub num_samples: u64,
    pub fingerprint: String,
}

/// `set.json`: the parts in order, with their fingerprints, and the set's fingerprint.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SetManifest {
    pub format: String,
    pub format_version: u32,
    pub writer_version: String,
    pub name: String,
    pub num_samples: u64,
    pub parts: Vec<PartEntry>,
    pub fingerprint: String,
}

impl SetManifest {
    /// The manifest of set `name` whose parts are `parts`, in order: its sample count and
    /// fingerprint are computed from theirs.
    pub fn of_parts(name: &str, parts: Vec<PartEntry>) -> SetManifest {
        SetManifest {
            format: SET_FORMAT_NAME.into(),
            format_version: SET_FORMAT_VERSION,
            writer_version: WRITER_VERSION.into(),
            name: name.to_owned(),
            num_samples: parts.iter().map(|e| e.num_samples).sum(),
            fingerprint: combined_fingerprint(parts.iter().map(|e| e.fingerprint.as_str())),
            parts,
        }
    }

    /// The bytes of `set.json`: pretty JSON and a final newline.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut json = serde_json::to_vec_pretty(self).expect("set manifest serialises");
        json.push(b'\n');
        json
    }
}

/// The name of part `index` (0-based) of set `set`: a cache name unique to the set, so that the
/// parts of two sets never share a `cache_id` in one dataset.
pub fn part_name(set: &str, index: usize) -> String {
    format!("{set}.part-{index:06}")
}

/// The caches of one dataset are its plain sources and its sets' parts (`SET.part-NNNNNN`):
/// a plain source named like a part would be written, then refused as a second cache of that
/// name. `plain` are the plain sources' names, `sets` each set's name and part count.
pub fn check_part_names(plain: &[&str], sets: &[(&str, usize)]) -> Result<()> {
    for &(set, parts) in sets {
        for index in 0..parts {
            let part = part_name(set, index);
            if plain.contains(&part.as_str()) {
                return Err(Error::config(
                    "source name",
                    format!(
                        "source {part:?} has the name of part {index} of cache set {set:?}: the \
                         dataset's caches must have unique names; nothing was written"
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// Where the parts of set `set` are written until the set is published.
pub fn staging_dir(base: &Path, set: &str) -> PathBuf {
    base.join(format!(".{set}.set-parts"))
}

/// A set name is a cache name short enough for its parts' names to be cache names too.
pub fn validate_set_name(name: &str) -> Result<()> {
    validate_name(name).map_err(|e| match e {
        Error::InvalidConfig { reason, .. } => Error::config("cache set name", reason),
        other => other,
    })?;
    if name.len() > MAX_SET_NAME_BYTES {
        return Err(Error::config(
            "cache set name",
            format!(
                "{:?}... is {} bytes long; a cache set's name may have at most \
                 {MAX_SET_NAME_BYTES} bytes (its parts are named NAME.part-NNNNNN): use a \
                 shorter name",
                name.chars().take(32).collect::<String>(),
                name.len()
            ),
        ));
    }
    Ok(())
}

/// A set's part count: at least one, at most [`MAX_PARTS`].
pub fn validate_part_count(set: &str, parts: usize) -> Result<()> {
    if parts == 0 || parts > MAX_PARTS {
        return Err(Error::config(
            "cache set parts",
            format!("cache set {set:?} has {parts} parts; a set has from 1 to {MAX_PARTS} parts"),
        ));
    }
    Ok(())
}

/// Whether `dir` is a set directory (it holds `set.json` and no `manifest.json`).
pub fn is_set_dir(dir: &Path) -> bool {
    fs::symlink_metadata(dir.join(SET_MANIFEST_FILE)).is_ok()
        && fs::symlink_metadata(dir.join(MANIFEST_FILE)).is_err()
}

/// Parses and checks the bytes of a `set.json` naming set `set`; errors name `path`.
pub fn parse_set_manifest(bytes: &[u8], set: &str, path: &Path) -> Result<SetManifest> {
    let bad = |reason: String| Error::malformed(set, path, reason);
    let value: serde_json::Value =
        serde_json::from_slice(bytes).map_err(|e| bad(format!("invalid JSON: {e}")))?;
    match value.get("format").and_then(|v| v.as_str()) {
        Some(SET_FORMAT_NAME) => {}
        other => {
            return Err(bad(format!(
                "not a DatasetRT set manifest: format is {other:?}, expected {SET_FORMAT_NAME:?}"
            )))
        }
    }
    match value.get("format_version").and_then(|v| v.as_u64()) {
        Some(v) if v == u64::from(SET_FORMAT_VERSION) => {}
        Some(v) => {
            return Err(bad(format!(
                "unsupported set format version {v}: this DatasetRT reads version \
                 {SET_FORMAT_VERSION}; upgrade dataset-rt or rebuild the set"
            )))
        }
        None => return Err(bad("format_version is missing or not an integer".into())),
    }
    let manifest: SetManifest =
        serde_json::from_value(value).map_err(|e| bad(format!("invalid set manifest: {e}")))?;
    if manifest.name != set {
        return Err(bad(format!(
            "the set manifest names set {:?}, but it lives in directory {set:?}",
            manifest.name
        )));
    }
    validate_part_count(set, manifest.parts.len()).map_err(|e| bad(e.to_string()))?;
    let mut total = 0u64;
    for (i, part) in manifest.parts.iter().enumerate() {
        let expected = part_name(set, i);
        if part.name != expected {
            return Err(bad(format!(
                "part {i} is named {:?}, expected {expected:?}",
                part.name
            )));
        }
        total = total
            .checked_add(part.num_samples)
            .ok_or_else(|| bad("the parts hold more than 2**64 samples".into()))?;
    }
    if total != manifest.num_samples {
        return Err(bad(format!(
            "the parts hold {total} samples, num_samples is {}",
            manifest.num_samples
        )));
    }
    let fingerprint = combined_fingerprint(manifest.parts.iter().map(|p| p.fingerprint.as_str()));
    if fingerprint != manifest.fingerprint {
        return Err(bad(format!(
            "fingerprint mismatch: computed {fingerprint} from the parts' fingerprints, the set \
             manifest says {}",
            manifest.fingerprint
        )));
    }
    Ok(manifest)
}

/// Reads and checks `dir/set.json`, which must name the set `set`.
pub fn read_set_manifest(dir: &Path, set: &str) -> Result<SetManifest> {
    let path = dir.join(SET_MANIFEST_FILE);
    let bytes = match fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(Error::malformed(set, &path, "file is missing"))
        }
        Err(e) => return Err(Error::io("read", &path, e)),
    };
    parse_set_manifest(&bytes, set, &path)
}

/// A published set, opened and validated: its manifest and its parts, in order.
pub struct CacheSet {
    pub dir: PathBuf,
    pub manifest: SetManifest,
    pub parts: Vec<Cache>,
}

impl CacheSet {
    /// Opens the set directory `dir` (`base/NAME`): its manifest, then every part with the
    /// checks of `validation`, each part's fingerprint and sample count against the manifest.
    pub fn open(dir: &Path, validation: Validation) -> Result<CacheSet> {
        let name = dir_cache_name(dir);
        let manifest = read_set_manifest(dir, &name)?;
        let parts = manifest
            .parts
            .iter()
            .enumerate()
            .map(|(i, entry)| open_part(dir, &name, i, entry, validation))
            .collect::<Result<Vec<_>>>()?;
        Ok(CacheSet {
            dir: dir.to_owned(),
            manifest,
            parts,
        })
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

    pub fn fingerprint(&self) -> &str {
        &self.manifest.fingerprint
    }

    /// Verifies every part as [`Cache::verify_all`] does, in order.
    pub fn verify_all(&self) -> Result<()> {
        self.parts.iter().try_for_each(Cache::verify_all)
    }
}

fn open_part(
    dir: &Path,
    set: &str,
    index: usize,
    entry: &PartEntry,
    validation: Validation,
) -> Result<Cache> {
    let part_dir = dir.join(&entry.name);
    if fs::symlink_metadata(&part_dir).is_err() {
        return Err(Error::malformed(
            set,
            &part_dir,
            format!("part {index} is missing (listed in {SET_MANIFEST_FILE})"),
        ));
    }
    let cache = Cache::open(&part_dir, validation)?;
    check_part(
        set,
        &dir.join(SET_MANIFEST_FILE),
        index,
        entry,
        &cache.manifest.fingerprint,
        cache.len(),
    )?;
    Ok(cache)
}

/// A part as opened (its `fingerprint` and `num_samples`) is the one the set manifest at
/// `manifest` lists as part `index`: a part replaced after the set was published is refused.
pub fn check_part(
    set: &str,
    manifest: &Path,
    index: usize,
    entry: &PartEntry,
    fingerprint: &str,
    num_samples: u64,
) -> Result<()> {
    if fingerprint == entry.fingerprint && num_samples == entry.num_samples {
        return Ok(());
    }
    Err(Error::malformed(
        set,
        manifest,
        format!(
            "part {index} ({}) has fingerprint {fingerprint} and {num_samples} samples, the set \
             manifest says {} and {}: the part was replaced after the set was published",
            entry.name, entry.fingerprint, entry.num_samples
        ),
    ))
}

/// What is under a published cache name: one cache, or a set of them.
pub enum Opened {
    Cache(Box<Cache>),
    Set(CacheSet),
}

impl Opened {
    /// Opens `dir` as a set when it holds a set manifest, else as a cache.
    pub fn open(dir: &Path, validation: Validation) -> Result<Opened> {
        if is_set_dir(dir) {
            CacheSet::open(dir, validation).map(Opened::Set)
        } else {
            Cache::open(dir, validation).map(|c| Opened::Cache(Box::new(c)))
        }
    }

    pub fn len(&self) -> u64 {
        match self {
            Opened::Cache(c) => c.len(),
            Opened::Set(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The caches a dataset reads, in order: the cache, or the set's parts.
    pub fn into_caches(self) -> Vec<Cache> {
        match self {
            Opened::Cache(c) => vec![*c],
            Opened::Set(s) => s.parts,
        }
    }
}

/// A part of a set being built, as the staging directory holds it.
pub enum PartState {
    /// Published and valid: it is kept, never written again.
    Published(Box<Cache>),
    /// Not published yet: it is to be written.
    Missing,
    /// Published but failing validation: never overwritten; the set cannot be published until
    /// it is removed (the reason names the file).
    Malformed(String),
}

/// How [`SetBuild::begin`] found the set.
pub enum SetStart {
    /// `base/NAME` exists already: load it.
    Published(PathBuf),
    /// The set is not published: this build holds its lock.
    Building(SetBuild),
}

/// A build of one set: holds the set's lock (the lock a cache of that name takes, so a set and a
/// cache never write one name at once) until it publishes or is dropped. The parts are written
/// by anyone (this process, worker processes, Ray tasks) into [`SetBuild::staging`] with the
/// ordinary cache writer under the names [`SetBuild::part_name`] gives.
pub struct SetBuild {
    lock: CacheLock,
    staging: PathBuf,
    parts: usize,
}

impl SetBuild {
    /// Takes the lock of set `name` under `base` (creating `base`), asking `interrupt` while
    /// another build holds it; then finds the set published, or creates its staging directory.
    pub fn begin(
        base: &Path,
        name: &str,
        parts: usize,
        interrupt: &dyn Fn() -> Result<()>,
    ) -> Result<SetStart> {
        validate_set_name(name)?;
        validate_part_count(name, parts)?;
        let lock = match CacheLock::claim(base, name, interrupt)? {
            Claim::Published(dir) => return Ok(SetStart::Published(dir)),
            Claim::Write(lock) => lock,
            Claim::Refused(e) => return Err(e),
        };
        let staging = staging_dir(base, name);
        fs::create_dir_all(&staging).ctx("create directory", &staging)?;
        Ok(SetStart::Building(SetBuild {
            lock,
            staging,
            parts,
        }))
    }

    pub fn name(&self) -> &str {
        &self.lock.name
    }

    pub fn parts(&self) -> usize {
        self.parts
    }

    /// The directory the parts are written into (the base directory of their caches).
    pub fn staging(&self) -> &Path {
        &self.staging
    }

    pub fn part_name(&self, index: usize) -> String {
        part_name(&self.lock.name, index)
    }

    /// Where the set will be published.
    pub fn final_dir(&self) -> PathBuf {
        self.lock.final_dir()
    }

    /// Each part's state in the staging directory, in order. An error reading a part that is
    /// not about the part itself (permission denied, EIO) is returned as it is.
    pub fn part_states(&self, validation: Validation) -> Result<Vec<PartState>> {
        (0..self.parts)
            .map(|i| {
                let dir = self.staging.join(self.part_name(i));
                if fs::symlink_metadata(&dir).is_err() {
                    return Ok(PartState::Missing);
                }
                match Cache::open(&dir, validation) {
                    Ok(c) => Ok(PartState::Published(Box::new(c))),
                    Err(e @ (Error::Malformed { .. } | Error::CorruptRecord { .. })) => {
                        Ok(PartState::Malformed(e.to_string()))
                    }
                    Err(e) => Err(e),
                }
            })
            .collect()
    }

    /// Publishes the set once every part is: writes `set.json` into the staging directory and
    /// renames the directory to `base/NAME` in one step, then opens the published set. Refused,
    /// with nothing changed, while a part is missing or malformed.
    pub fn publish(self, validation: Validation) -> Result<CacheSet> {
        let name = self.name().to_owned();
        let mut entries = Vec::with_capacity(self.parts);
        let mut caches = Vec::with_capacity(self.parts);
        for (i, state) in self.part_states(validation)?.into_iter().enumerate() {
            let part = self.part_name(i);
            match state {
                PartState::Published(cache) => {
                    entries.push(PartEntry {
                        name: part,
                        num_samples: cache.len(),
                        fingerprint: cache.manifest.fingerprint.clone(),
                    });
                    caches.push(cache);
                }
                PartState::Missing => {
                    return Err(Error::Runtime(format!(
                        "cache set {name:?} cannot be published: part {i} ({}) is not \
                         published; write the missing parts first",
                        self.staging.join(&part).display()
                    )))
                }
                PartState::Malformed(reason) => {
                    return Err(Error::Runtime(format!(
                        "cache set {name:?} cannot be published: part {i} is malformed: \
                         {reason}; remove {} and build the set again",
                        self.staging.join(&part).display()
                    )))
                }
            }
        }
        // A set is one dataset: a column of two types would make its metadata table, its
        // weights and `view` fail for good, and a published set is never rewritten.
        if let Some(why) = crate::samples::column_type_conflict(caches.iter().map(|c| c.as_ref())) {
            return Err(Error::Runtime(format!(
                "cache set {name:?} cannot be published: {why}; the parts of a set share one \
                 metadata table, so a column has one type in every part: remove the parts of \
                 one type from {} and build them again with the other",
                self.staging.display()
            )));
        }
        self.tidy_staging(&entries)?;
        let json = SetManifest::of_parts(&name, entries).to_bytes();
        let path = self.staging.join(SET_MANIFEST_FILE);
        // A manifest left by a build that died before its rename is rewritten whole.
        let mut file = File::create(&path).ctx("create", &path)?;
        file.write_all(&json).ctx("write", &path)?;
        file.sync_all().ctx("sync", &path)?;
        drop(file);
        sync_dir(&self.staging)?;
        let final_dir = self.final_dir();
        fs::rename(&self.staging, &final_dir).ctx("publish (rename)", &final_dir)?;
        // Published by the rename; the sync only makes it survive a power loss (see the writer).
        let _ = sync_dir(&self.lock.base);
        CacheSet::open(&final_dir, validation)
    }

    /// Leaves nothing in the staging directory but the parts of `entries` (and a `set.json`
    /// that is rewritten), so that the published set holds nothing else. Every part is
    /// published, so no writer of one is left: their leftovers and lock files go. The parts
    /// of an earlier build of the set with more parts (by name, `NAME.part-N` with N past the
    /// count) go too, with their locks and leftovers, once no writer of them is alive. Anything
    /// else, or such a writer still running, refuses the publication with nothing removed
    /// that is not the set's.
    fn tidy_staging(&self, entries: &[PartEntry]) -> Result<()> {
        let name = self.name();
        for entry in entries {
            reap_dead_leftovers(&self.staging, &entry.name);
            let lock_file = self.staging.join(format!(".{}.lock", entry.name));
            let _ = fs::remove_file(lock_file);
        }
        let refuse = |what: String| {
            Err(Error::Runtime(format!(
                "cache set {name:?} cannot be published: {what}"
            )))
        };
        let listing = fs::read_dir(&self.staging).ctx("list", &self.staging)?;
        for found in listing {
            let found = found.ctx("list", &self.staging)?;
            let file_name = found.file_name();
            let file_name = file_name.to_string_lossy();
            let path = found.path();
            // An NFS client's `.nfsXXXX` stands for a removed file still open somewhere, and
            // goes when it is closed.
            if file_name == SET_MANIFEST_FILE
                || file_name.starts_with(".nfs")
                || entries.iter().any(|e| e.name == file_name)
            {
                continue;
            }
            let Some(part) = stale_part_of(name, &file_name).filter(|&i| i >= self.parts) else {
                return refuse(format!(
                    "its staging directory holds {}, which is no part of it; move it away \
                     and build the set again",
                    path.display()
                ));
            };
            let part = part_name(name, part);
            let lock_path = self.staging.join(format!(".{part}.lock"));
            let _held = match liveness::probe(&lock_path) {
                liveness::Owner::Gone(held) => Some(held),
                liveness::Owner::Unknown(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                liveness::Owner::Alive => {
                    return refuse(format!(
                        "part {part} of an earlier build of the set with more parts is still \
                         being written ({} is held); stop that writer and build the set again",
                        lock_path.display()
                    ))
                }
                liveness::Owner::Unknown(e) => return Err(Error::io("lock", &lock_path, e)),
            };
            let removed = if found.file_type().is_ok_and(|t| t.is_dir()) {
                fs::remove_dir_all(&path)
            } else {
                fs::remove_file(&path)
            };
            match removed {
                Ok(()) => {}
                // Removed meanwhile with its part (a leftover under the part's directory).
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(Error::io("remove", &path, e)),
            }
        }
        Ok(())
    }
}

/// The index of the part of set `set` that a staging directory's entry belongs to: the part
/// itself (`SET.part-N`), its lock file (`.SET.part-N.lock`) or a temporary directory of its
/// writer (`.SET.part-N.tmp-PID-NANOS`).
fn stale_part_of(set: &str, file_name: &str) -> Option<usize> {
    let prefix = format!("{set}.part-");
    let rest = match file_name.strip_prefix('.') {
        Some(hidden) => hidden.strip_prefix(&prefix)?,
        None => file_name.strip_prefix(&prefix)?,
    };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    let (index, tail) = rest.split_at(digits);
    let hidden = file_name.starts_with('.');
    let ok = match tail {
        "" => !hidden,
        ".lock" => hidden,
        t => hidden && t.starts_with(".tmp-"),
    };
    if digits != 6 || !ok {
        return None;
    }
    index.parse().ok()
}

fn sync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .ctx("open", path)?
        .sync_all()
        .ctx("sync", path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_names_are_cache_names_for_the_longest_set_name() {
        let longest = "s".repeat(MAX_SET_NAME_BYTES);
        validate_set_name(&longest).unwrap();
        validate_name(&part_name(&longest, MAX_PARTS - 1)).unwrap();
        let err = validate_set_name(&format!("{longest}s")).unwrap_err();
        assert!(err.to_string().contains("at most"), "{err}");
        assert!(validate_set_name(".hidden").is_err());
        assert!(validate_set_name("a/b").is_err());
    }

    #[test]
    fn the_combined_fingerprint_depends_on_order() {
        let ab = combined_fingerprint(["a", "b"]);
        assert_eq!(ab.len(), 32);
        assert_ne!(ab, combined_fingerprint(["b", "a"]));
        assert_ne!(ab, combined_fingerprint(["ab"]));
    }

    #[test]
    fn part_counts_are_bounded() {
        assert!(validate_part_count("s", 0).is_err());
        validate_part_count("s", 1).unwrap();
        validate_part_count("s", MAX_PARTS).unwrap();
        assert!(validate_part_count("s", MAX_PARTS + 1).is_err());
    }
}

//! The node's local cache directory: downloaded ranges of remote caches, within a byte budget,
//! shared by the processes of one node.
//!
//! Layout (`docs/remote.md` will repeat it):
//!
//! ```text
//! <local_dir>/
//!     .lock                              flock, held while the budget is changed
//!     usage                              bytes in use and reserved (ASCII); rebuilt by a scan
//!     <build-id>/                        one published cache (its manifest's hash), never reused
//!         ranges/<file>/<start>-<end>    a downloaded range: "DRTRANGE", its xxh3-64, its bytes
//!         locks/<file>/<start>-<end>     flock, held by the process downloading that range
//!         procs/<pid>-<nanos>.alive      a process's proof of life (a shared flock)
//!         procs/<pid>-<nanos>.pins       the ranges it has pinned, one per line
//!         tmp/<pid>-<nanos>-<seq>-<len>  a range being written (`len` bytes reserved)
//!         cache/                         the local copy of manifest, index and metadata table
//!         cache.lock                     flock, held by the process downloading that copy
//! ```
//!
//! Why range files: the planner asks for records (and coalesces them into requests only on the
//! wire), so a record's range is the same key in every process of the node, and a file per
//! range needs no index that a crash could leave inconsistent. Each file carries its own
//! checksum and is verified whenever it is read, so neither a crash nor a torn write is ever
//! served (no fsync needed: anything damaged is a miss, fetched again). Files appear by rename.
//!
//! Keyed by the build: a remote cache that changed has another manifest, so another build id,
//! so another directory; a stale copy is never read. Ranges of builds that no cache of the
//! process reads are evicted first.
//!
//! Budget: every write reserves its bytes in `usage` under `.lock` before it writes, evicting
//! first if needed, so the directory never holds more than the budget (plus the temporary file
//! of a write that has reserved its bytes). Eviction takes ranges of builds this process does
//! not read, then ranges it will not need in the part of the pass it foresees, then the ones
//! needed furthest in it (the reader tells each cache the records of the coming positions;
//! caches opened together are ranked together), and never a range any live process has pinned
//! (prefetched, not yet consumed). Each process ranks by its own future: the ranks of one node
//! do not see each other's, only each other's pins.
//! Everything a dead process left is found by its `.alive` lock, which the kernel releases.
//!
//! One download per node: a process downloads a missing range only while it holds that range's
//! lock; the others wait for the lock, then read the file. Locks are `flock`s, released when
//! their holder dies, so a killed downloader never blocks the others; a waiter gives up waiting
//! after a bound and downloads the range itself.

use std::collections::{HashMap, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{Read, Write};
use std::os::unix::fs::{FileExt, MetadataExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use dataset_rt_core::liveness::{self, OwnerLock};

use crate::error::{Error, Result};
use crate::fetch::{RangeFetcher, RangeRequest, Verify};

/// A range of a file of one build: the unit the local cache stores.
pub type RangeKey = RangeRequest;

const RANGE_MAGIC: &[u8; 8] = b"DRTRANGE";
/// The bytes a stored range takes beyond its own: a magic and its checksum.
pub const RANGE_HEADER_LEN: u64 = 16;

fn io_err(op: &'static str, path: &Path, e: std::io::Error) -> Error {
    Error::Core(dataset_rt_core::Error::io(op, path, e))
}

/// Counters of what a cache did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CacheStats {
    pub hits: u64,
    pub misses: u64,
    pub stored: u64,
    /// Ranges not stored: the budget was taken by pinned ranges.
    pub not_stored: u64,
    pub evicted: u64,
    /// Range files that failed their checksum when read (and were removed).
    pub damaged: u64,
    /// Measurements of the whole directory (to make room, or to fit the budget).
    pub scans: u64,
}

#[derive(Default)]
struct Counters {
    hits: AtomicU64,
    misses: AtomicU64,
    stored: AtomicU64,
    not_stored: AtomicU64,
    evicted: AtomicU64,
    damaged: AtomicU64,
    scans: AtomicU64,
}

/// One process's view of the node's local cache, for one build.
pub struct NodeCache {
    root: PathBuf,
    dir: PathBuf,
    build_id: String,
    budget: u64,
    /// `<pid>-<nanos>`: this process's name in `procs/` and `tmp/`.
    me: String,
    pid: u32,
    _alive: OwnerLock,
    pins: Mutex<HashMap<RangeKey, u32>>,
    future: Future,
    seq: AtomicU64,
    counters: Counters,
}

impl std::fmt::Debug for NodeCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeCache")
            .field("dir", &self.dir)
            .field("budget", &self.budget)
            .finish_non_exhaustive()
    }
}

/// Opens (creating it when missing, never truncating it) a file that exists only to be locked.
pub(crate) fn open_lock_file(path: &Path) -> Result<File> {
    OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| io_err("open lock file", path, e))
}

/// The exclusive lock on `<local_dir>/.lock`, held while the budget changes.
struct DirLock(File);

impl DirLock {
    fn take(root: &Path) -> Result<DirLock> {
        let path = root.join(".lock");
        let file = open_lock_file(&path)?;
        flock(&file, libc::LOCK_EX).map_err(|e| io_err("lock", &path, e))?;
        Ok(DirLock(file))
    }
}

impl Drop for DirLock {
    fn drop(&mut self) {
        let _ = flock(&self.0, libc::LOCK_UN);
    }
}

pub(crate) fn flock(file: &File, op: libc::c_int) -> std::io::Result<()> {
    loop {
        // SAFETY: flock on a descriptor this process owns.
        if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.kind() != std::io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// The lock on one range while this process downloads it. Dropping it removes the lock file
/// (still holding the lock), so lock files do not pile up; a waiter that then locks the removed
/// file notices and opens the path again.
pub struct RangeLock {
    file: File,
    path: PathBuf,
}

impl Drop for RangeLock {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
        let _ = flock(&self.file, libc::LOCK_UN);
    }
}

/// What a process foresees of one build: the positions of the pass at which each range is
/// needed (ascending), and the consumer's position (what lies before it was needed already).
#[derive(Default)]
struct Foreseen {
    at: HashMap<RangeKey, Vec<u64>>,
    now: u64,
}

impl Foreseen {
    /// The next position at which `key` is needed, if it is foreseen.
    fn next_use(&self, key: &RangeKey) -> Option<u64> {
        let at = self.at.get(key)?;
        at.get(at.partition_point(|&p| p < self.now)).copied()
    }
}

type Future = Arc<Mutex<Foreseen>>;

/// The futures of this process's node caches, by local directory and build: the caches that
/// one dataset opened together share a budget, so eviction by any of them ranks the others'
/// ranges by their future too (positions of one pass), instead of taking them first as it
/// takes ranges of builds nobody here reads.
#[allow(clippy::type_complexity)]
static FUTURES: Mutex<Vec<(PathBuf, String, std::sync::Weak<Mutex<Foreseen>>)>> =
    Mutex::new(Vec::new());

fn register_future(root: &Path, build_id: &str) -> Future {
    let future = Future::default();
    let mut all = FUTURES.lock().unwrap_or_else(|e| e.into_inner());
    all.retain(|(_, _, f)| f.strong_count() > 0);
    all.push((
        root.to_owned(),
        build_id.to_owned(),
        Arc::downgrade(&future),
    ));
    future
}

/// The live futures of this process under `root`, by build.
fn futures_under(root: &Path) -> Vec<(String, Future)> {
    let all = FUTURES.lock().unwrap_or_else(|e| e.into_inner());
    all.iter()
        .filter(|(r, _, _)| r == root)
        .filter_map(|(_, build, f)| Some((build.clone(), f.upgrade()?)))
        .collect()
}

/// The file under the root that holds the bytes in use.
const USAGE_FILE: &str = "usage";

/// Whether a live process reads the build whose `procs` directory this is (one of its
/// `.alive` locks is held).
fn is_read(procs: &Path) -> bool {
    let Ok(entries) = fs::read_dir(procs) else {
        return false;
    };
    entries.flatten().any(|entry| {
        entry.file_name().to_string_lossy().ends_with(".alive")
            && !matches!(liveness::probe(&entry.path()), liveness::Owner::Gone(_))
    })
}

/// A file as it is found on disk.
struct Found {
    path: PathBuf,
    size: u64,
    /// The build it belongs to, and its key there (`None`: a file of its local copy).
    build: String,
    key: Option<RangeKey>,
}

fn now_nanos() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// `<start>-<end>` for a file name.
fn range_name(key: &RangeKey) -> String {
    format!("{}-{}", key.range.start, key.range.end)
}

fn parse_range_name(name: &str) -> Option<std::ops::Range<u64>> {
    let (a, b) = name.split_once('-')?;
    Some(a.parse().ok()?..b.parse().ok()?)
}

impl NodeCache {
    /// Opens (creating if needed) the local cache of build `build_id` under `root`, with a
    /// budget of `budget` bytes for everything under `root`.
    pub fn open(root: &Path, build_id: &str, budget: u64) -> Result<NodeCache> {
        let valid_id = build_id.len() == 32 && build_id.bytes().all(|b| b.is_ascii_hexdigit());
        if !valid_id {
            return Err(Error::config(
                "build_id",
                format!("{build_id:?} is not a build id (32 hex digits)"),
            ));
        }
        let dir = root.join(build_id);
        for sub in ["ranges", "locks", "procs", "tmp"] {
            let path = dir.join(sub);
            fs::create_dir_all(&path).map_err(|e| io_err("create directory", &path, e))?;
        }
        let pid = std::process::id();
        // Another process reaping the directory may find the fresh proof of life before it is
        // locked and remove it (`OwnerLock::hold` then says `NotFound`): that costs a new name,
        // as it does a loader's segments, not the open.
        let mut lost = 0;
        let (me, alive) = loop {
            let me = format!("{pid}-{}", now_nanos());
            let alive_path = dir.join("procs").join(format!("{me}.alive"));
            match File::create(&alive_path).and_then(|f| OwnerLock::hold(f, &alive_path)) {
                Ok(alive) => break (me, alive),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && lost < 2 => lost += 1,
                Err(e) => return Err(io_err("create", &alive_path, e)),
            }
        };
        let cache = NodeCache {
            root: root.to_owned(),
            dir,
            build_id: build_id.to_owned(),
            budget,
            me,
            pid,
            _alive: alive,
            pins: Mutex::default(),
            future: register_future(root, build_id),
            seq: AtomicU64::new(0),
            counters: Counters::default(),
        };
        {
            let _lock = DirLock::take(root)?;
            cache.reap_dead()?;
            let (found, reserved) = cache.scan()?;
            cache.write_usage(found.iter().map(|f| f.size).sum::<u64>() + reserved)?;
        }
        Ok(cache)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    pub fn budget(&self) -> u64 {
        self.budget
    }

    pub fn stats(&self) -> CacheStats {
        let c = &self.counters;
        CacheStats {
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
            stored: c.stored.load(Ordering::Relaxed),
            not_stored: c.not_stored.load(Ordering::Relaxed),
            evicted: c.evicted.load(Ordering::Relaxed),
            damaged: c.damaged.load(Ordering::Relaxed),
            scans: c.scans.load(Ordering::Relaxed),
        }
    }

    fn check_process(&self) -> Result<()> {
        if std::process::id() != self.pid {
            return Err(Error::Core(dataset_rt_core::Error::Runtime(
                "a NodeCache was used in a forked child: open it again in the child".into(),
            )));
        }
        Ok(())
    }

    fn range_path(&self, key: &RangeKey) -> PathBuf {
        self.dir
            .join("ranges")
            .join(&key.file)
            .join(range_name(key))
    }

    fn lock_path(&self, key: &RangeKey) -> PathBuf {
        self.dir.join("locks").join(&key.file).join(range_name(key))
    }

    fn check_key(key: &RangeKey) -> Result<()> {
        let ok = !key.file.is_empty()
            && key
                .file
                .split('/')
                .all(|p| !p.is_empty() && p != "." && p != "..")
            && key.range.start <= key.range.end;
        if ok {
            Ok(())
        } else {
            Err(Error::config(
                "range",
                format!(
                    "{:?} {:?} is not a range of a cache file",
                    key.file, key.range
                ),
            ))
        }
    }

    /// Whether range `key` is stored (a probe: its bytes are checked when they are read).
    pub fn contains(&self, key: &RangeKey) -> bool {
        Self::check_key(key).is_ok() && self.range_path(key).is_file()
    }

    /// The stored bytes of `key`, verified; `None` when absent (or damaged: then removed).
    pub fn get(&self, key: &RangeKey) -> Result<Option<Bytes>> {
        self.check_process()?;
        Self::check_key(key)?;
        let path = self.range_path(key);
        let mut data = Vec::new();
        match File::open(&path).and_then(|mut f| f.read_to_end(&mut data)) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
            Err(e) => return Err(io_err("read", &path, e)),
        }
        let valid = data.len() as u64 == RANGE_HEADER_LEN + key.len()
            && &data[..8] == RANGE_MAGIC
            && data[8..16] == xxhash_rust::xxh3::xxh3_64(&data[16..]).to_le_bytes();
        if !valid {
            self.counters.damaged.fetch_add(1, Ordering::Relaxed);
            self.counters.misses.fetch_add(1, Ordering::Relaxed);
            self.remove(key)?;
            return Ok(None);
        }
        self.counters.hits.fetch_add(1, Ordering::Relaxed);
        let mut bytes = Bytes::from(data);
        Ok(Some(bytes.split_off(RANGE_HEADER_LEN as usize)))
    }

    /// `len` bytes at `from` within the stored range `key`, read in place (one `pread`, not the
    /// whole range); `None` when the range is not stored. The range's own checksum covers all of
    /// it and is not checked here: the caller checks what it reads (a record, against its own
    /// checksum) and [`NodeCache::remove`]s the range when that fails.
    pub fn get_slice(&self, key: &RangeKey, from: u64, len: u64) -> Result<Option<Bytes>> {
        self.check_process()?;
        Self::check_key(key)?;
        if from.checked_add(len).is_none_or(|end| end > key.len()) {
            return Err(Error::config(
                "range",
                format!(
                    "{len} bytes at {from} lie outside {:?} {:?}",
                    key.file, key.range
                ),
            ));
        }
        let path = self.range_path(key);
        let file = match File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                return Ok(None);
            }
            Err(e) => return Err(io_err("open", &path, e)),
        };
        let mut magic = [0u8; 8];
        let mut data = vec![0u8; len as usize];
        let read = file
            .metadata()
            .and_then(|m| {
                if m.len() != RANGE_HEADER_LEN + key.len() {
                    return Err(std::io::ErrorKind::UnexpectedEof.into());
                }
                file.read_exact_at(&mut magic, 0)?;
                file.read_exact_at(&mut data, RANGE_HEADER_LEN + from)
            })
            .map_err(|e| (e.kind(), e));
        match read {
            Ok(()) if &magic == RANGE_MAGIC => {}
            Ok(()) | Err((std::io::ErrorKind::UnexpectedEof, _)) => {
                // Cut short or not a range file: a crash or damage. Drop it, fetch again.
                self.counters.damaged.fetch_add(1, Ordering::Relaxed);
                self.counters.misses.fetch_add(1, Ordering::Relaxed);
                self.remove(key)?;
                return Ok(None);
            }
            Err((_, e)) => return Err(io_err("read", &path, e)),
        }
        self.counters.hits.fetch_add(1, Ordering::Relaxed);
        Ok(Some(Bytes::from(data)))
    }

    /// Removes the stored range `key` (bytes that did not verify), returning its bytes to the
    /// budget.
    pub fn remove(&self, key: &RangeKey) -> Result<()> {
        let path = self.range_path(key);
        let _lock = DirLock::take(&self.root)?;
        if let Ok(meta) = fs::symlink_metadata(&path) {
            if fs::remove_file(&path).is_ok() {
                let usage = self.read_usage()?;
                self.write_usage(usage.saturating_sub(meta.len()))?;
            }
        }
        Ok(())
    }

    /// Stores `bytes` as range `key`, evicting others if needed; `false` when it cannot fit
    /// (larger than the budget, or the budget is held by pinned ranges): then nothing changed.
    pub fn put(&self, key: &RangeKey, bytes: &[u8]) -> Result<bool> {
        self.check_process()?;
        Self::check_key(key)?;
        if bytes.len() as u64 != key.len() {
            return Err(Error::config(
                "range",
                format!(
                    "{} bytes given for {:?} {:?}",
                    bytes.len(),
                    key.file,
                    key.range
                ),
            ));
        }
        let size = RANGE_HEADER_LEN + key.len();
        let path = self.range_path(key);
        let tmp = self.dir.join("tmp").join(format!(
            "{}-{}-{size}",
            self.me,
            self.seq.fetch_add(1, Ordering::Relaxed)
        ));
        {
            let _lock = DirLock::take(&self.root)?;
            if path.exists() {
                return Ok(true);
            }
            if !self.make_room(size)? {
                self.counters.not_stored.fetch_add(1, Ordering::Relaxed);
                return Ok(false);
            }
            // The reservation is the temporary file's name: a scan counts it while this
            // process lives.
            File::create(&tmp).map_err(|e| io_err("create", &tmp, e))?;
        }
        let written = (|| {
            let mut f = OpenOptions::new()
                .write(true)
                .open(&tmp)
                .map_err(|e| io_err("open", &tmp, e))?;
            let mut header = [0u8; RANGE_HEADER_LEN as usize];
            header[..8].copy_from_slice(RANGE_MAGIC);
            header[8..].copy_from_slice(&xxhash_rust::xxh3::xxh3_64(bytes).to_le_bytes());
            f.write_all(&header)
                .and_then(|()| f.write_all(bytes))
                .map_err(|e| io_err("write", &tmp, e))?;
            if let Some(parent) = path.parent() {
                fs::create_dir_all(parent).map_err(|e| io_err("create directory", parent, e))?;
            }
            fs::rename(&tmp, &path).map_err(|e| io_err("rename", &tmp, e))
        })();
        if let Err(e) = written {
            // A full disk or any other failure: give the reservation back, leave nothing.
            let _ = fs::remove_file(&tmp);
            let _lock = DirLock::take(&self.root)?;
            let usage = self.read_usage()?;
            self.write_usage(usage.saturating_sub(size))?;
            return Err(e);
        }
        self.counters.stored.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// Reserves `size` bytes in `usage`, evicting if needed (call under the dir lock).
    fn make_room(&self, size: u64) -> Result<bool> {
        if size > self.budget {
            return Ok(false);
        }
        let usage = self.read_usage()?;
        if usage + size <= self.budget {
            self.write_usage(usage + size)?;
            return Ok(true);
        }
        self.evict_for(size)
    }

    /// Measures what the directory holds (this also corrects any drift of `usage`), evicts
    /// until `size` more bytes fit in the budget, and reserves them; `false` when the files that
    /// may go are not enough (call under the dir lock).
    ///
    /// A scan reads every file's size, so it frees [`NodeCache::headroom`] more than asked (the
    /// downloads needed furthest ahead): the writes that follow fit without one.
    fn evict_for(&self, size: u64) -> Result<bool> {
        self.counters.scans.fetch_add(1, Ordering::Relaxed);
        let (found, reserved) = self.scan()?;
        let mut used = found.iter().map(|f| f.size).sum::<u64>() + reserved;
        let mut victims = self.victims(found)?;
        let wanted = size.saturating_add(self.headroom()).min(self.budget);
        while used + wanted > self.budget {
            let Some(victim) = victims.pop() else {
                break;
            };
            if fs::remove_file(&victim.path).is_ok() {
                used -= victim.size;
                self.counters.evicted.fetch_add(1, Ordering::Relaxed);
            }
        }
        if used + size > self.budget {
            self.write_usage(used)?;
            return Ok(false);
        }
        self.write_usage(used + size)?;
        Ok(true)
    }

    /// What eviction frees beyond what a write needs: a 32nd of the budget (at most 256 MiB),
    /// none below 1 MiB (a budget under 32 MiB is evicted exactly).
    fn headroom(&self) -> u64 {
        let headroom = (self.budget / 32).min(256 << 20);
        if headroom < 1 << 20 {
            0
        } else {
            headroom
        }
    }

    /// Brings what the directory holds within the budget, once files were added beside the
    /// ranges (the local copy of a cache opened): evicts as a write would. `false` when what
    /// may not go exceeds the budget.
    pub fn fit(&self) -> Result<bool> {
        let _lock = DirLock::take(&self.root)?;
        self.evict_for(0)
    }

    /// Range files that may be evicted, the first to go last: ranges of builds that no cache of
    /// this process reads, then ranges by their next use as this process foresees it (not
    /// needed in the known future counts as furthest), over every build it reads. Pinned
    /// ranges (by any live process) are left out.
    fn victims(&self, found: Vec<Found>) -> Result<Vec<Found>> {
        let mut pinned: HashSet<(String, RangeKey)> = HashSet::new();
        for (build, key) in self.live_pins()? {
            pinned.insert((build, key));
        }
        for key in self.pins.lock().unwrap_or_else(|e| e.into_inner()).keys() {
            pinned.insert((self.build_id.clone(), key.clone()));
        }
        // Own future first: this cache is registered under its root.
        let futures = futures_under(&self.root);
        let held: Vec<(&str, std::sync::MutexGuard<'_, Foreseen>)> = futures
            .iter()
            .map(|(build, f)| (build.as_str(), f.lock().unwrap_or_else(|e| e.into_inner())))
            .collect();
        let rank_of = |f: &Found| -> (u64, u64) {
            let mut known = false;
            let mut next = None::<u64>;
            for (build, future) in &held {
                if *build != f.build {
                    continue;
                }
                known = true;
                if let Some(at) = f.key.as_ref().and_then(|k| future.next_use(k)) {
                    next = Some(next.map_or(at, |n| n.min(at)));
                }
            }
            match (known, next) {
                (false, _) => (u64::MAX, u64::MAX),
                (true, Some(next)) => (0, next),
                (true, None) => (1, 0),
            }
        };
        let mut ranked: Vec<(u64, u64, Found)> = found
            .into_iter()
            .filter(|f| match &f.key {
                Some(key) => !pinned.contains(&(f.build.clone(), key.clone())),
                None => true,
            })
            .map(|f| {
                let rank = rank_of(&f);
                (rank.0, rank.1, f)
            })
            .collect();
        drop(held);
        // Ascending: the range needed soonest first, so `pop` takes the one needed last.
        ranked.sort_by_key(|r| (r.0, r.1));
        Ok(ranked.into_iter().map(|(_, _, f)| f).collect())
    }

    /// Every build directory under the root.
    fn builds(&self) -> Result<Vec<String>> {
        let entries = fs::read_dir(&self.root).map_err(|e| io_err("list", &self.root, e))?;
        Ok(entries
            .flatten()
            .filter_map(|e| {
                let name = e.file_name().to_string_lossy().into_owned();
                (name.len() == 32 && name.bytes().all(|b| b.is_ascii_hexdigit())).then_some(name)
            })
            .collect())
    }

    /// Every file that may be evicted (all builds), and the bytes of those that may not: what
    /// live writers reserved for their temporary files, and the local copies (manifest, index,
    /// metadata table) of builds a live process reads. Bookkeeping (`usage`, locks, proofs of
    /// life, lists of pins: a few bytes a process and a pinned range) is not counted.
    fn scan(&self) -> Result<(Vec<Found>, u64)> {
        let mut found = Vec::new();
        let mut reserved = 0;
        for build in self.builds()? {
            let dir = self.root.join(&build);
            // Reservations first, then the range files: a write renames its temporary file into
            // `ranges/` without the lock, so a scan in the other order could miss a range that
            // moved in between (and admit more than the budget); in this order a move in between
            // is counted twice, which only evicts a little early.
            if let Ok(entries) = fs::read_dir(dir.join("tmp")) {
                for entry in entries.flatten() {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    if let Some(len) = name.rsplit('-').next().and_then(|n| n.parse::<u64>().ok()) {
                        reserved += len;
                    }
                }
            }
            // A build that no live process reads keeps nothing: its local copy may go too.
            let read = build == self.build_id || is_read(&dir.join("procs"));
            walk(&dir.join("cache"), &mut |path, size| {
                if read {
                    reserved += size;
                } else {
                    found.push(Found {
                        path: path.to_owned(),
                        size,
                        build: build.clone(),
                        key: None,
                    });
                }
                Some(())
            });
            let ranges = dir.join("ranges");
            walk(&ranges, &mut |path, size| {
                let rel = path.strip_prefix(&ranges).ok()?;
                let range = parse_range_name(rel.file_name()?.to_str()?)?;
                let file = rel.parent()?.to_str()?.to_owned();
                found.push(Found {
                    path: path.to_owned(),
                    size,
                    build: build.clone(),
                    key: Some(RangeKey { file, range }),
                });
                Some(())
            });
        }
        Ok((found, reserved))
    }

    /// The pins of every live process (of every build), as (build, key).
    fn live_pins(&self) -> Result<Vec<(String, RangeKey)>> {
        let mut out = Vec::new();
        for build in self.builds()? {
            let procs = self.root.join(&build).join("procs");
            let Ok(entries) = fs::read_dir(&procs) else {
                continue;
            };
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let Some(owner) = name.strip_suffix(".pins") else {
                    continue;
                };
                if build == self.build_id && owner == self.me {
                    continue;
                }
                let Ok(text) = fs::read_to_string(entry.path()) else {
                    continue;
                };
                for line in text.lines() {
                    let mut parts = line.rsplitn(2, '\t');
                    let (Some(range), Some(file)) = (parts.next(), parts.next()) else {
                        continue;
                    };
                    if let Some(range) = parse_range_name(range) {
                        out.push((
                            build.clone(),
                            RangeKey {
                                file: file.to_owned(),
                                range,
                            },
                        ));
                    }
                }
            }
        }
        Ok(out)
    }

    /// Removes what dead processes left: their proofs of life, pins and temporary files (call
    /// under the dir lock).
    fn reap_dead(&self) -> Result<()> {
        for build in self.builds()? {
            let procs = self.root.join(&build).join("procs");
            let Ok(entries) = fs::read_dir(&procs) else {
                continue;
            };
            let mut alive = HashSet::new();
            let mut seen = HashSet::new();
            for entry in entries.flatten() {
                let name = entry.file_name().to_string_lossy().into_owned();
                let Some(owner) = name
                    .strip_suffix(".alive")
                    .or_else(|| name.strip_suffix(".pins"))
                else {
                    continue;
                };
                seen.insert(owner.to_owned());
                if name.ends_with(".alive") {
                    match liveness::probe(&entry.path()) {
                        liveness::Owner::Gone(_held) => {
                            let _ = fs::remove_file(entry.path());
                        }
                        _ => {
                            alive.insert(owner.to_owned());
                        }
                    }
                }
            }
            for owner in seen.difference(&alive) {
                let _ = fs::remove_file(procs.join(format!("{owner}.pins")));
            }
            let tmp = self.root.join(&build).join("tmp");
            if let Ok(entries) = fs::read_dir(&tmp) {
                for entry in entries.flatten() {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    let owner: Vec<&str> = name.splitn(3, '-').take(2).collect();
                    if !alive.contains(&owner.join("-")) {
                        let _ = fs::remove_file(entry.path());
                    }
                }
            }
        }
        Ok(())
    }

    fn read_usage(&self) -> Result<u64> {
        let path = self.root.join(USAGE_FILE);
        match fs::read_to_string(&path) {
            Ok(text) => match text.trim().parse() {
                Ok(n) => Ok(n),
                Err(_) => self.rescan_usage(),
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => self.rescan_usage(),
            Err(e) => Err(io_err("read", &path, e)),
        }
    }

    fn rescan_usage(&self) -> Result<u64> {
        let (found, reserved) = self.scan()?;
        Ok(found.iter().map(|f| f.size).sum::<u64>() + reserved)
    }

    fn write_usage(&self, usage: u64) -> Result<()> {
        let path = self.root.join(USAGE_FILE);
        let tmp = self.root.join(format!(".usage.{}", self.me));
        fs::write(&tmp, format!("{usage}\n"))
            .and_then(|()| fs::rename(&tmp, &path))
            .map_err(|e| io_err("write", &path, e))
    }

    /// The bytes under the root, measured now (range files and live reservations).
    pub fn usage(&self) -> Result<u64> {
        let _lock = DirLock::take(&self.root)?;
        self.rescan_usage()
    }

    /// Tells eviction at which positions of the pass each range will be needed (smaller is
    /// sooner), replacing what it was told before: ranges not listed are not needed in the
    /// known future, and a range listed several times is needed at each of its positions. The
    /// consumer's position ([`NodeCache::set_now`]) starts over at 0.
    pub fn set_future(&self, order: impl IntoIterator<Item = (RangeKey, u64)>) {
        let mut at: HashMap<RangeKey, Vec<u64>> = HashMap::new();
        for (key, position) in order {
            at.entry(key).or_default().push(position);
        }
        for positions in at.values_mut() {
            positions.sort_unstable();
        }
        *self.future.lock().unwrap_or_else(|e| e.into_inner()) = Foreseen { at, now: 0 };
    }

    /// The consumer is at `position`: what was foreseen before it is needed no more.
    pub fn set_now(&self, position: u64) {
        self.future.lock().unwrap_or_else(|e| e.into_inner()).now = position;
    }

    /// Pins ranges (prefetched, not yet consumed): no process evicts them until they are
    /// unpinned as often as they were pinned.
    pub fn pin<'a>(&self, keys: impl IntoIterator<Item = &'a RangeKey>) -> Result<()> {
        {
            let mut pins = self.pins.lock().unwrap_or_else(|e| e.into_inner());
            for key in keys {
                *pins.entry(key.clone()).or_insert(0) += 1;
            }
        }
        self.publish_pins()
    }

    pub fn unpin<'a>(&self, keys: impl IntoIterator<Item = &'a RangeKey>) -> Result<()> {
        {
            let mut pins = self.pins.lock().unwrap_or_else(|e| e.into_inner());
            for key in keys {
                if let Some(n) = pins.get_mut(key) {
                    *n -= 1;
                    if *n == 0 {
                        pins.remove(key);
                    }
                }
            }
        }
        self.publish_pins()
    }

    /// Writes this process's pins where the other processes' evictions read them.
    fn publish_pins(&self) -> Result<()> {
        self.check_process()?;
        let text: String = {
            let pins = self.pins.lock().unwrap_or_else(|e| e.into_inner());
            pins.keys()
                .map(|k| format!("{}\t{}\n", k.file, range_name(k)))
                .collect()
        };
        let procs = self.dir.join("procs");
        let path = procs.join(format!("{}.pins", self.me));
        let tmp = procs.join(format!("{}.pins.tmp", self.me));
        fs::write(&tmp, text)
            .and_then(|()| fs::rename(&tmp, &path))
            .map_err(|e| io_err("write", &path, e))
    }

    /// Takes the download lock of `key` if nobody holds it.
    pub fn try_lock_range(&self, key: &RangeKey) -> Result<Option<RangeLock>> {
        self.lock_range_within(key, Duration::ZERO)
    }

    /// Takes the download lock of `key`, waiting at most `patience` for its holder; `None` when
    /// it is still held then.
    pub fn lock_range_within(
        &self,
        key: &RangeKey,
        patience: Duration,
    ) -> Result<Option<RangeLock>> {
        self.check_process()?;
        Self::check_key(key)?;
        let path = self.lock_path(key);
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|e| io_err("create directory", parent, e))?;
        }
        let deadline = Instant::now() + patience;
        let mut pause = Duration::from_millis(1);
        loop {
            let file = open_lock_file(&path)?;
            match flock(&file, libc::LOCK_EX | libc::LOCK_NB) {
                Ok(()) => {
                    // The holder before us may have removed the file after we opened it.
                    let ours = file.metadata().map_err(|e| io_err("stat", &path, e))?;
                    match fs::metadata(&path) {
                        Ok(now) if now.ino() == ours.ino() && now.dev() == ours.dev() => {
                            return Ok(Some(RangeLock { file, path }));
                        }
                        _ => continue,
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(50));
                }
                Err(e) => return Err(io_err("lock", &path, e)),
            }
        }
    }
}

/// Calls `each(path, size)` for every regular file under `dir`.
fn walk(dir: &Path, each: &mut dyn FnMut(&Path, u64) -> Option<()>) {
    let Ok(entries) = fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        let path = entry.path();
        if kind.is_dir() {
            walk(&path, each);
        } else if kind.is_file() {
            if let Ok(meta) = entry.metadata() {
                each(&path, meta.len());
            }
        }
    }
}

/// Range fetching through the node's local cache: each range is read from the cache when it is
/// there, else downloaded once per node (under its lock), verified, stored and returned.
pub struct CachedFetcher {
    pub fetcher: RangeFetcher,
    pub cache: Arc<NodeCache>,
}

impl CachedFetcher {
    pub fn new(fetcher: RangeFetcher, cache: Arc<NodeCache>) -> Self {
        CachedFetcher { fetcher, cache }
    }

    /// How long to wait for another process's download before downloading the range here: as
    /// long as that download may take with every attempt and backoff.
    pub fn patience(&self) -> Duration {
        let p = self.fetcher.policy();
        (p.timeout + p.max_backoff) * p.attempts * p.verify_attempts
    }

    /// The bytes of every range, in the order of `requests`, each verified by `verify` (stored
    /// ranges too, as they are read). Blocks the calling thread.
    pub fn fetch_blocking(
        &self,
        requests: &[RangeRequest],
        verify: Option<&Verify>,
    ) -> Result<Vec<Bytes>> {
        let mut out: Vec<Option<Bytes>> = vec![None; requests.len()];
        let mut by_key: HashMap<&RangeRequest, Vec<usize>> = HashMap::new();
        for (i, r) in requests.iter().enumerate() {
            by_key.entry(r).or_default().push(i);
        }
        let fill = |out: &mut Vec<Option<Bytes>>, key: &RangeRequest, bytes: &Bytes| {
            for &i in &by_key[key] {
                out[i] = Some(bytes.clone());
            }
        };
        let stored = |key: &RangeRequest| -> Result<Option<Bytes>> {
            let Some(bytes) = self.cache.get(key)? else {
                return Ok(None);
            };
            if let Some(verify) = verify {
                if verify(key, &bytes).is_err() {
                    self.cache.remove(key)?;
                    return Ok(None);
                }
            }
            Ok(Some(bytes))
        };
        let mut ours: Vec<(RangeRequest, RangeLock)> = Vec::new();
        let mut theirs: Vec<&RangeRequest> = Vec::new();
        for key in by_key.keys().copied() {
            if let Some(bytes) = stored(key)? {
                fill(&mut out, key, &bytes);
                continue;
            }
            match self.cache.try_lock_range(key)? {
                Some(lock) => match stored(key)? {
                    Some(bytes) => fill(&mut out, key, &bytes),
                    None => ours.push((key.clone(), lock)),
                },
                None => theirs.push(key),
            }
        }
        let keys: Vec<RangeRequest> = ours.iter().map(|(k, _)| k.clone()).collect();
        let got = self.fetcher.fetch_blocking(&keys, verify)?;
        for ((key, lock), bytes) in ours.into_iter().zip(got) {
            self.cache.put(&key, &bytes)?;
            drop(lock);
            fill(&mut out, &key, &bytes);
        }
        // Ranges another process was downloading: wait for it (holding no lock of ours, so no
        // two processes wait for each other), then read them; download what is still missing.
        for key in theirs {
            let lock = self.cache.lock_range_within(key, self.patience())?;
            let bytes = match stored(key)? {
                Some(bytes) => bytes,
                None => {
                    let bytes = self
                        .fetcher
                        .fetch_blocking(std::slice::from_ref(key), verify)?
                        .pop()
                        .unwrap_or_default();
                    self.cache.put(key, &bytes)?;
                    bytes
                }
            };
            drop(lock);
            fill(&mut out, key, &bytes);
        }
        Ok(out.into_iter().map(Option::unwrap_or_default).collect())
    }
}

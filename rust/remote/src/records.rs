//! Reading a published cache in place: [`open_cache`] downloads its manifest, `index.bin` and
//! `metadata.arrow` into the node's local directory (validated, checksums included) and opens a
//! core [`Cache`] whose records come from [`RemoteRecords`]. The core's read planner asks that
//! source to fetch the records of the coming positions ahead (`start`), through the node's
//! bounded local cache ([`CachedFetcher`]); each record is verified against its own checksum as
//! it arrives, and again against its index entry when it is read.
//!
//! Local files of one published build (beside the ranges of [`NodeCache`]):
//!
//! ```text
//! <local_dir>/<build-id>/cache/manifest.json    the published manifest, byte for byte
//! <local_dir>/<build-id>/cache/index.bin        downloaded whole, checked against the manifest
//! <local_dir>/<build-id>/cache/metadata.arrow   idem
//! ```
//!
//! They appear by rename, so a crash leaves a temporary file at most, which the next open
//! replaces; a file that fails validation is downloaded again once.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;

use dataset_rt_core::cache::Cache;
use dataset_rt_core::dataset::{Dataset, Range, RangeSource, RecordBytes, RecordSource};
use dataset_rt_core::format::{
    check_record_bytes, checksum_hex, shard_file_name, FileEntry, Manifest, MANIFEST_FILE,
};
use xxhash_rust::xxh3::xxh3_64;

use crate::error::{Error, Result};
use crate::fetch::{FetchPolicy, RangeFetcher, RangeRequest, Verify};
use crate::local::{CachedFetcher, NodeCache, RangeKey, RANGE_HEADER_LEN};
use crate::options::RemoteOptions;
use crate::publish::PublishedCache;
use crate::sets::Published;
use crate::store::Remote;

/// The largest gap between two records that one request spans (see `open_remote_cache`).
pub const RECORD_GAP: u64 = 4 << 10;

/// Positions of a pass, from the consumer's, whose records the node's cache is told to rank
/// its eviction by (kept needed soonest, not LRU): about 64 k records, a few megabytes of keys,
/// worked out again each time the consumer has moved a quarter of them.
pub const FORESIGHT: u64 = 1 << 16;

/// How far ahead a request for a record also takes its neighbours in storage: the positions
/// whose records of this cache weigh this many times its share of the local budget (see
/// [`Ahead`]).
pub const JOIN_HORIZON: f64 = 1.5;

/// The stretch of a shard that one download covers when the local budget holds the whole
/// dataset (see [`Blocks`]).
pub const BLOCK_BYTES: u64 = 8 << 20;

/// The records of one published cache, fetched through the node's local cache.
///
/// What one download holds depends on the budget:
/// - When the local budget holds every shard, a download is a **block**: the records of a
///   shard whose offsets lie in one [`BLOCK_BYTES`]-aligned stretch of it, fetched with one
///   request, checked record by record on arrival and kept as one range. Every block is needed
///   in the pass and none is evicted, so a first epoch costs about one request per 8 MiB,
///   whatever the order. Records are read from the stored block in place.
/// - Otherwise a download is a **record**: a global shuffle scatters a pass over every shard,
///   and a block would be fetched again for each of its records that the budget cannot keep
///   until it is read. A request for a record also takes its neighbours in storage (within
///   [`RECORD_GAP`]) that the pass needs within a horizon the budget can keep ([`Ahead`]), so
///   that no byte is fetched that the pass does not read, and fewer requests fetch them.
pub struct RemoteRecords {
    fetcher: Arc<CachedFetcher>,
    verify: Arc<Verify>,
    /// `Some` when downloads are blocks.
    blocks: Option<Arc<Blocks>>,
    /// Set when a block had to be downloaded again in this process (evicted: the budget, shared
    /// with other caches or nodes' processes, does not hold the dataset after all). Downloads are
    /// records from then on, so that no block is fetched again for each of its records.
    records_only: AtomicBool,
    /// The blocks this process started to download.
    started_blocks: Mutex<HashSet<RangeKey>>,
    /// Blocks (shard, first byte) that stayed wrong on the server: their records are downloaded
    /// one by one, so that the intact ones are served and the damaged one is named at its own
    /// sample.
    damaged_blocks: Mutex<HashSet<(u32, u64)>>,
    version: u32,
    /// Downloads started by this process and not finished (so that a read waits for them rather
    /// than downloading the same range again).
    in_flight: Arc<(Mutex<HashSet<RangeKey>>, Condvar)>,
    /// Downloads started ahead that failed for good, with when. A read of their records within
    /// [`FetchPolicy::timeout`] of the failure reports it instead of spending every attempt
    /// again: against a store that stopped answering, the pass ends after one download's
    /// attempts, not after one per record. A later read tries again.
    failed: Arc<Mutex<HashMap<RangeKey, Failed>>>,
    /// The cache's name (for errors).
    name: String,
    /// The URL of the cache and the options it was opened with (its [`RecordSource::locator`]).
    url: String,
    options: RemoteOptions,
    /// The bytes of the other caches sharing the local budget (see [`open_published`]).
    shared: u64,
    /// The key of each shard under the build's remote (`shards/000000.bin`), and its URL.
    keys: Vec<String>,
    urls: Vec<String>,
    /// The coming records by shard, whose neighbours join a record's request.
    ahead: Mutex<Ahead>,
    /// This cache's share of the local budget (in proportion to its stored bytes).
    budget_share: u64,
}

/// A download started ahead that failed for good: its request error (an [`Error::Request`],
/// shared by every range of the download), and when.
struct Failed {
    at: Instant,
    error: Arc<Error>,
}

/// The records the pass needs soon, by where they lie, so that a request for a record also
/// fetches its neighbours in storage that the pass needs soon: a shuffled window of the planner
/// rarely holds two neighbours, but the order of the pass is known well beyond it.
///
/// Joining a record ahead pays only where it takes room that holds nothing the pass needs:
/// where it would evict a record needed later, that record is downloaded again, and the request
/// saved is spent on it. So records are joined within three quarters of this cache's share of
/// the budget (divided among the ranks of the node whose records the pass foresees) less what
/// the pass needs and is held: the records the planner holds, the records joined and not read
/// yet, and the records stored when they were foreseen and not read yet (in a second pass, the
/// records the first one left). And only within a horizon: the positions, from the consumer's,
/// whose records weigh [`JOIN_HORIZON`] times that share, so that room goes to records needed
/// soon rather than to the first ones met. With a global shuffle and a quarter of the dataset as
/// budget, a request then serves about two records of a first pass instead of one.
#[derive(Default)]
struct Ahead {
    /// By shard: offset → (length, first coming position) of each foreseen record.
    by_shard: HashMap<u32, BTreeMap<u64, (u64, u64)>>,
    /// How many positions from the consumer's the horizon spans.
    span: u64,
    /// The consumer's position.
    now: u64,
    /// The bytes that joins may hold ahead at most.
    room: u64,
    /// Records joined and not read yet: bytes by their coming position.
    joined: BTreeMap<u64, u64>,
    /// Records found stored when first foreseen, not read yet: bytes by their coming position.
    stored: BTreeMap<u64, u64>,
    /// The bytes of `joined` and of `stored`.
    joined_bytes: u64,
    stored_bytes: u64,
    /// Positions up to which this pass's records were asked whether they are stored.
    asked_to: u64,
    /// Bytes of the records the planner started and did not release.
    planned: u64,
    /// A pass began and was not foreseen yet.
    new_pass: bool,
}

/// What a record takes in the node's cache once stored.
fn kept_len(range: &Range) -> u64 {
    range.len.saturating_add(RANGE_HEADER_LEN)
}

impl Ahead {
    /// Learns the coming records (`(position, range)` in pass order), for a share of the
    /// budget of `share` bytes; `stored` says whether a record is stored already (asked once
    /// per pass of each position's record).
    fn foresee(&mut self, upcoming: &[(u64, Range)], share: u64, stored: impl Fn(&Range) -> bool) {
        self.by_shard.clear();
        if self.new_pass {
            self.new_pass = false;
            self.joined.clear();
            self.stored.clear();
            self.joined_bytes = 0;
            self.stored_bytes = 0;
            self.asked_to = 0;
        }
        let first = upcoming.first().map_or(0, |(p, _)| *p);
        self.advance(first);
        // The ranks of the node whose records each position holds share the budget.
        let ranks = upcoming
            .iter()
            .take_while(|(p, _)| *p == first)
            .count()
            .max(1);
        let share = share / ranks as u64;
        self.room = share / 4 * 3;
        let limit = (share as f64 * JOIN_HORIZON) as u64;
        self.span = u64::MAX;
        let mut bytes = 0u64;
        let asked_to = self.asked_to.max(first);
        for (position, range) in upcoming {
            bytes = bytes.saturating_add(range.len);
            if bytes > limit && self.span == u64::MAX {
                self.span = position - first;
            }
            let entry = self.by_shard.entry(range.shard).or_default();
            if let std::collections::btree_map::Entry::Vacant(e) = entry.entry(range.offset) {
                e.insert((range.len, *position));
                // Asked once: a record joined since is counted in `joined` already.
                if *position >= asked_to && stored(range) {
                    *self.stored.entry(*position).or_default() += kept_len(range);
                    self.stored_bytes += kept_len(range);
                }
            }
        }
        if let Some((last, _)) = upcoming.last() {
            self.asked_to = self.asked_to.max(last + 1);
        }
    }

    /// The consumer is at `position`: what was needed before it is read.
    fn advance(&mut self, position: u64) {
        self.now = position;
        let read = |m: &mut BTreeMap<u64, u64>| {
            let later = m.split_off(&position);
            std::mem::replace(m, later).values().sum::<u64>()
        };
        self.joined_bytes -= read(&mut self.joined);
        self.stored_bytes -= read(&mut self.stored);
    }

    /// Records joined ahead, at their positions.
    fn join(&mut self, joined: &[(u64, Range)]) {
        for (position, range) in joined {
            *self.joined.entry(*position).or_default() += kept_len(range);
            self.joined_bytes += kept_len(range);
        }
    }

    /// The bytes needed and held: planned, joined ahead, stored before.
    fn held(&self) -> u64 {
        self.planned + self.joined_bytes + self.stored_bytes
    }

    /// The neighbours of `range` in its shard, each within `gap` of the one before, that the
    /// pass needs within the horizon, that the room takes and that `wanted` accepts, until the
    /// joined records would exceed `max_bytes`: their positions and ranges, right of it then
    /// left of it.
    fn neighbours(
        &self,
        range: &Range,
        gap: u64,
        max_bytes: u64,
        mut wanted: impl FnMut(&Range) -> bool,
    ) -> Vec<(u64, Range)> {
        let Some(shard) = self.by_shard.get(&range.shard) else {
            return Vec::new();
        };
        let soon = |position: u64| position >= self.now && position - self.now < self.span;
        let mut joined = Vec::new();
        let mut bytes = range.len;
        let mut room = self.room.saturating_sub(self.held());
        // Joins the record at `offset` if the request, the horizon, the room and `wanted` take it.
        let mut join = |offset: u64, len: u64, position: u64| {
            let r = Range {
                offset,
                len,
                ..*range
            };
            let mut fits = || {
                let stored = kept_len(&r);
                let ok = stored <= room;
                room = room.saturating_sub(stored);
                ok
            };
            let ok =
                bytes.saturating_add(len) <= max_bytes && soon(position) && fits() && wanted(&r);
            if ok {
                bytes += len;
                joined.push((position, r));
            }
            ok
        };
        let mut end = range.end();
        for (&offset, &(len, position)) in shard.range(end..) {
            if offset > end.saturating_add(gap) || !join(offset, len, position) {
                break;
            }
            end = offset.saturating_add(len);
        }
        let mut start = range.offset;
        for (&offset, &(len, position)) in shard.range(..range.offset).rev() {
            let next = offset.saturating_add(len);
            if next > start || next.saturating_add(gap) < start || !join(offset, len, position) {
                break;
            }
            start = offset;
        }
        joined
    }
}

/// The blocks of a cache: block `k` of a shard holds the records whose offsets lie in
/// `[k * BLOCK_BYTES, (k + 1) * BLOCK_BYTES)`, found in the index (the rows of a shard are its
/// records in storage order), and spans from the first one's start to the last one's end. Every
/// process computes the same blocks, so the processes of a node share their downloads.
struct Blocks {
    size: u64,
    version: u32,
    /// The first row of each shard, then the number of rows.
    first_row: Vec<u64>,
    /// The shard of each shard key.
    shard_of: HashMap<String, u32>,
    /// The cache these records belong to (set once it is opened; it owns this source).
    cache: OnceLock<Weak<Cache>>,
    /// Blocks found so far, by shard and number; `None` where the index does not give one.
    found: Mutex<HashMap<(u32, u64), Option<Block>>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Block {
    /// Its rows, `first..end`.
    first: u64,
    end_row: u64,
    /// Its extent in the shard.
    start: u64,
    end: u64,
}

impl Block {
    fn holds(&self, range: &Range) -> bool {
        range.offset >= self.start && range.end() <= self.end
    }
}

impl Blocks {
    fn cache(&self) -> Option<Arc<Cache>> {
        self.cache.get().and_then(Weak::upgrade)
    }

    /// The block that holds `range` (a record's extent), if the index gives one.
    fn of(&self, range: &Range) -> Option<Block> {
        let at = (range.shard, range.offset / self.size);
        let known = self.lock().get(&at).copied();
        let block = match known {
            Some(block) => block,
            None => {
                let block = self.cache().and_then(|c| self.find(&c, at.0, at.1));
                self.lock().insert(at, block);
                block
            }
        };
        block.filter(|b| b.holds(range))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<(u32, u64), Option<Block>>> {
        self.found.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Block `k` of `shard` from the index: two binary searches over the shard's rows. An index
    /// whose rows do not lie in order gives none (its records are then downloaded one by one,
    /// and checked as ever).
    fn find(&self, cache: &Cache, shard: u32, k: u64) -> Option<Block> {
        let rows = *self.first_row.get(shard as usize)?..*self.first_row.get(shard as usize + 1)?;
        let offset = |row: u64| {
            cache
                .record_extent(row)
                .filter(|&(s, _, _)| s == shard)
                .map(|(_, offset, _)| offset)
        };
        // The first row of the shard whose record starts at `bound` or later.
        let first_at = |bound: u64| -> Option<u64> {
            let (mut lo, mut hi) = (rows.start, rows.end);
            while lo < hi {
                let mid = lo + (hi - lo) / 2;
                if offset(mid)? < bound {
                    lo = mid + 1;
                } else {
                    hi = mid;
                }
            }
            Some(lo)
        };
        let first = first_at(k.checked_mul(self.size)?)?;
        let end_row = first_at(k.checked_add(1)?.checked_mul(self.size)?)?;
        if first >= end_row {
            return None;
        }
        let (_, start, _) = cache.record_extent(first)?;
        let (_, last, len) = cache.record_extent(end_row - 1)?;
        let block = Block {
            first,
            end_row,
            start,
            end: last + len,
        };
        (block.end > block.start).then_some(block)
    }

    /// The block `key` names, if it is one.
    fn named(&self, key: &RangeKey) -> Option<Block> {
        let shard = *self.shard_of.get(&key.file)?;
        let block = self
            .lock()
            .get(&(shard, key.range.start / self.size))
            .copied()??;
        (block.start == key.range.start && block.end == key.range.end).then_some(block)
    }

    /// Checks every record of `block` in its downloaded bytes, each against its own checksum
    /// and the extent its index entry gives.
    fn check(&self, block: &Block, bytes: &[u8]) -> std::result::Result<(), String> {
        let cache = self.cache().ok_or("the cache was closed")?;
        for row in block.first..block.end_row {
            let (_, offset, len) = cache
                .record_extent(row)
                .ok_or_else(|| format!("row {row} has no record"))?;
            let at = (offset - block.start) as usize;
            let record = bytes
                .get(at..at + len as usize)
                .ok_or_else(|| format!("the record of row {row} lies outside its block"))?;
            check_record_bytes(self.version, record)
                .map_err(|e| format!("the record at offset {offset}: {e}"))?;
        }
        Ok(())
    }
}

impl RemoteRecords {
    /// The download that holds `range`: its block, or the record itself.
    fn key(&self, range: &Range) -> (RangeKey, Option<Block>) {
        let file = self.shard_key(range.shard);
        let blocks = self
            .blocks
            .as_ref()
            .filter(|_| !self.records_only.load(Ordering::Relaxed));
        let damaged = |b: &Block| {
            let damaged = self
                .damaged_blocks
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            damaged.contains(&(range.shard, b.start))
        };
        match blocks.and_then(|b| b.of(range)).filter(|b| !damaged(b)) {
            Some(block) => (RangeRequest::new(file, block.start..block.end), Some(block)),
            None => (RangeRequest::new(file, range.offset..range.end()), None),
        }
    }

    /// The key of shard `shard` under the build's remote (empty for a shard the cache lacks:
    /// ranges come from the index's extents, which never name one).
    fn shard_key(&self, shard: u32) -> String {
        self.keys.get(shard as usize).cloned().unwrap_or_default()
    }

    /// The node's local cache this source fetches through.
    pub fn node_cache(&self) -> &Arc<NodeCache> {
        &self.fetcher.cache
    }

    /// The requests and bytes fetched from the store so far by this source.
    pub fn fetch_stats(&self) -> crate::fetch::FetchStats {
        self.fetcher.fetcher.stats()
    }

    /// Whether this source downloads blocks (the budget holds every shard) rather than records.
    pub fn fetches_blocks(&self) -> bool {
        self.blocks.is_some() && !self.records_only.load(Ordering::Relaxed)
    }

    /// Downloads `key` through the node's cache (once per node), verified.
    fn download(
        &self,
        key: &RangeKey,
        range: &Range,
        sample: u64,
    ) -> dataset_rt_core::Result<Bytes> {
        match self
            .fetcher
            .fetch_blocking(std::slice::from_ref(key), Some(self.verify.as_ref()))
        {
            Ok(mut got) => Ok(got.pop().unwrap_or_default()),
            Err(Error::Verify {
                url,
                attempts,
                reason,
                ..
            }) => Err(dataset_rt_core::Error::CorruptRecord {
                cache: self.name.clone(),
                shard: PathBuf::from(url),
                offset: range.offset,
                sample,
                reason: format!("{reason} (fetched {attempts} times)"),
            }),
            Err(e) => Err(e.into()),
        }
    }

    /// The failure of this process's download of `key` started ahead, when it is recent (see
    /// [`RemoteRecords::failed`]).
    fn recent_failure(&self, key: &RangeKey) -> Option<Error> {
        let failed = self.failed.lock().unwrap_or_else(|e| e.into_inner());
        let f = failed.get(key)?;
        let Error::Request {
            op,
            url,
            failure,
            reason,
        } = f.error.as_ref()
        else {
            return None;
        };
        (f.at.elapsed() < self.fetcher.fetcher.policy().timeout).then(|| Error::Request {
            op,
            url: url.clone(),
            failure: *failure,
            reason: format!("{reason} (the download that held it, started ahead)"),
        })
    }

    /// Waits while this process downloads `key`, at most as long as a download may take.
    fn wait_for_download(&self, key: &RangeKey) {
        let (set, done) = &*self.in_flight;
        let deadline = Instant::now() + self.fetcher.patience();
        let mut set = set.lock().unwrap_or_else(|e| e.into_inner());
        while set.contains(key) {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return;
            }
            set = done
                .wait_timeout(set, left.min(Duration::from_secs(1)))
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }
}

impl RangeSource for RemoteRecords {
    fn name(&self) -> &'static str {
        "object-store"
    }

    fn begin_pass(&self, _shuffled: bool) {
        self.failed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clear();
        self.ahead
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .new_pass = true;
    }

    fn resident(&self, range: &Range) -> bool {
        self.fetcher.cache.contains(&self.key(range).0)
    }

    /// Pins the downloads that hold the ranges (no process evicts them before they are
    /// released) and starts those not stored yet on the runtime's blocking pool, coalesced into
    /// requests, without waiting. A failure here is not reported: the read of the record
    /// downloads it again and reports it.
    fn start(&self, ranges: &[Range]) {
        let keys: Vec<RangeKey> = ranges.iter().map(|r| self.key(r).0).collect();
        if let Err(e) = self.fetcher.cache.pin(&keys) {
            log::debug!("cannot pin ranges of {}: {e}", self.name);
        }
        let joins = !self.fetches_blocks();
        let missing: Vec<RangeKey> = {
            let mut in_flight = self.in_flight.0.lock().unwrap_or_else(|e| e.into_inner());
            let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            ahead.planned += ranges.iter().map(kept_len).sum::<u64>();
            let max_bytes = self.fetcher.fetcher.policy().max_request_bytes;
            let mut missing = Vec::new();
            for (key, range) in keys.into_iter().zip(ranges) {
                if in_flight.contains(&key) || self.fetcher.cache.contains(&key) {
                    continue;
                }
                in_flight.insert(key.clone());
                missing.push(key);
                if !joins {
                    continue;
                }
                // Its neighbours that the pass needs soon, not pinned: eviction ranks them by
                // their positions, and the planner pins them when their turn comes.
                let mut wanted = |r: &Range| {
                    let key = self.key(r).0;
                    let new = !in_flight.contains(&key) && !self.fetcher.cache.contains(&key);
                    if new {
                        in_flight.insert(key.clone());
                        missing.push(key);
                    }
                    new
                };
                let joined = ahead.neighbours(range, RECORD_GAP, max_bytes, &mut wanted);
                ahead.join(&joined);
            }
            missing
        };
        if self.fetches_blocks() {
            let mut started = self
                .started_blocks
                .lock()
                .unwrap_or_else(|e| e.into_inner());
            let again = missing
                .iter()
                .filter(|k| self.blocks.as_ref().is_some_and(|b| b.named(k).is_some()))
                .any(|k| !started.insert(k.clone()));
            if again {
                log::debug!("a block of {} was evicted: downloading records", self.name);
                self.records_only.store(true, Ordering::Relaxed);
            }
        }
        if missing.is_empty() {
            return;
        }
        let done = Arc::clone(&self.in_flight);
        let finish = move |keys: &[RangeKey]| {
            let mut set = done.0.lock().unwrap_or_else(|e| e.into_inner());
            for key in keys {
                set.remove(key);
            }
            done.1.notify_all();
        };
        let Ok(runtime) = crate::runtime::runtime() else {
            finish(&missing);
            return; // the read reports why the runtime could not start
        };
        let fetcher = Arc::clone(&self.fetcher);
        let verify = Arc::clone(&self.verify);
        let failed = Arc::clone(&self.failed);
        let name = self.name.clone();
        runtime.spawn_blocking(move || {
            if let Err(e) = fetcher.fetch_blocking(&missing, Some(verify.as_ref())) {
                log::debug!("prefetch of {} ranges of {name} failed: {e}", missing.len());
                if matches!(e, Error::Request { .. }) {
                    // Every range of the call that is not stored failed with it (the call
                    // stops at its first failed request).
                    let error = Arc::new(e);
                    let mut failed = failed.lock().unwrap_or_else(|e| e.into_inner());
                    let at = Instant::now();
                    for key in missing.iter().filter(|k| !fetcher.cache.contains(k)) {
                        let error = Arc::clone(&error);
                        failed.insert(key.clone(), Failed { at, error });
                    }
                }
            }
            finish(&missing);
        });
    }

    /// Eviction keeps what the pass needs soonest: the reader tells the coming records.
    fn foresight(&self) -> u64 {
        FORESIGHT
    }

    /// A download is needed at the coming positions of the records it holds.
    fn foresee(&self, upcoming: &[(u64, Range)]) {
        if !self.fetches_blocks() {
            let stored = |r: &Range| self.fetcher.cache.contains(&self.key(r).0);
            self.ahead
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .foresee(upcoming, self.budget_share, stored);
        }
        let next = upcoming
            .iter()
            .map(|(position, range)| (self.key(range).0, *position));
        self.fetcher.cache.set_future(next);
    }

    fn reached(&self, position: u64) {
        self.ahead
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .advance(position);
        self.fetcher.cache.set_now(position);
    }

    fn release(&self, ranges: &[Range]) {
        {
            let mut ahead = self.ahead.lock().unwrap_or_else(|e| e.into_inner());
            let bytes = ranges.iter().map(kept_len).sum::<u64>();
            ahead.planned = ahead.planned.saturating_sub(bytes);
        }
        let mut keys: Vec<RangeKey> = ranges.iter().map(|r| self.key(r).0).collect();
        if self.records_only.load(Ordering::Relaxed) {
            // Ranges started before downloads turned to records pinned their blocks.
            for (blocks, range) in self
                .blocks
                .iter()
                .flat_map(|b| ranges.iter().map(move |r| (b, r)))
            {
                if let Some(block) = blocks.of(range) {
                    let file = self.shard_key(range.shard);
                    keys.push(RangeRequest::new(file, block.start..block.end));
                }
            }
        }
        if let Err(e) = self.fetcher.cache.unpin(&keys) {
            log::debug!("cannot unpin ranges of {}: {e}", self.name);
        }
    }
}

impl RecordSource for RemoteRecords {
    fn read(&self, range: &Range, sample: u64) -> dataset_rt_core::Result<RecordBytes> {
        let (key, block) = self.key(range);
        self.wait_for_download(&key);
        if !self.fetcher.cache.contains(&key) {
            if let Some(e) = self.recent_failure(&key) {
                return Err(e.into());
            }
        }
        let Some(block) = block else {
            return Ok(Box::new(self.download(&key, range, sample)?));
        };
        // A record of a block: read in place from the stored block.
        let from = range.offset - block.start;
        if let Some(bytes) = self.node_cache().get_slice(&key, from, range.len)? {
            if check_record_bytes(self.version, &bytes).is_ok() {
                return Ok(Box::new(bytes));
            }
            // Damaged on the local disk: the block is downloaded again.
            self.node_cache().remove(&key)?;
        }
        match self.download(&key, range, sample) {
            Ok(bytes) => Ok(Box::new(
                bytes.slice(from as usize..(from + range.len) as usize),
            )),
            // A record of the block stayed wrong: this one may be intact. From now on the
            // block's records come one by one, each checked and named on its own.
            Err(dataset_rt_core::Error::CorruptRecord { .. }) => {
                self.damaged_blocks
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .insert((range.shard, block.start));
                let record = RangeRequest::new(key.file.clone(), range.offset..range.end());
                Ok(Box::new(self.download(&record, range, sample)?))
            }
            Err(e) => Err(e),
        }
    }

    fn discard(&self, range: &Range) {
        if let Err(e) = self.fetcher.cache.remove(&self.key(range).0) {
            log::debug!("cannot discard a range of {}: {e}", self.name);
        }
    }

    /// The URL and the options, as JSON: [`open_located`] opens the same cache from it.
    fn locator(&self) -> String {
        let o = &self.options;
        serde_json::json!({
            "url": self.url,
            "local_dir": o.local_dir.as_ref().map(|d| d.to_string_lossy().into_owned()),
            "max_local_bytes": o.max_local_bytes,
            "max_requests": o.max_requests,
            "endpoint": o.endpoint,
            "region": o.region,
            "allow_http": o.allow_http,
            "shared": self.shared,
        })
        .to_string()
    }

    fn location(&self) -> String {
        self.url.clone()
    }

    fn shard_location(&self, shard: u32) -> String {
        self.urls
            .get(shard as usize)
            .cloned()
            .unwrap_or_else(|| format!("shard {shard} (the cache has {})", self.urls.len()))
    }
}

/// A published cache opened for reading, with its record source (for measurements and tests).
pub struct OpenedCache {
    pub cache: Arc<Cache>,
    pub records: Arc<RemoteRecords>,
    pub build_id: String,
}

/// Opens the cache published at `url` for reading in place (see the module's documentation).
pub fn open_cache(url: &str, options: &RemoteOptions) -> Result<OpenedCache> {
    options.validate()?;
    let remote = Remote::open(url, options)?;
    open_remote_cache(&remote, options)
}

/// Opens what is published at `url` for reading in place: the cache, or every part of the set,
/// in order. `shared` is the bytes of the other caches read from the same local budget (the
/// other caches of one dataset): downloads are blocks only when the budget holds them all.
pub fn open_published(
    published: Published,
    options: &RemoteOptions,
    shared: u64,
) -> Result<Vec<OpenedCache>> {
    options.validate()?;
    let caches = published.into_caches();
    let total: u64 = caches.iter().map(|c| stored_bytes(&c.manifest)).sum();
    caches
        .into_iter()
        .map(|cache| {
            let others = total - stored_bytes(&cache.manifest);
            open_in_place(cache, options, shared.saturating_add(others))
        })
        .collect()
}

/// Opens what is published at each of `urls` in place (see [`open_published`]), all of them
/// reading from one local budget: each URL's caches, or why it could not be opened. Bad
/// options fail the whole call.
pub fn open_urls(
    urls: &[String],
    options: &RemoteOptions,
) -> Result<Vec<Result<Vec<OpenedCache>>>> {
    options.validate()?;
    let found: Vec<Result<Published>> = urls
        .iter()
        .map(|url| Published::open(&Remote::open(url, options)?))
        .collect();
    let size =
        |p: &Published| -> u64 { p.caches().iter().map(|c| stored_bytes(&c.manifest)).sum() };
    let total: u64 = found.iter().flatten().map(size).sum();
    Ok(found
        .into_iter()
        .map(|p| {
            let p = p?;
            let shared = total - size(&p);
            open_published(p, options, shared)
        })
        .collect())
}

/// The part of `budget` of a cache that takes `own` bytes beside `shared` bytes of others.
fn share_of(budget: u64, own: u64, shared: u64) -> u64 {
    let total = own.saturating_add(shared).max(1) as u128;
    (budget as u128 * own as u128 / total) as u64
}

/// What a cache takes in the local cache directory with its shards stored as blocks (each
/// block with a range header), its index and its metadata table: what the budget must hold
/// for downloads to be blocks.
pub fn stored_bytes(manifest: &Manifest) -> u64 {
    let copy = manifest.index.bytes.saturating_add(manifest.metadata.bytes);
    manifest.shards.iter().fold(copy, |sum, s| {
        let blocks = s.bytes / BLOCK_BYTES + 1;
        sum.saturating_add(s.bytes)
            .saturating_add(blocks.saturating_mul(RANGE_HEADER_LEN))
    })
}

/// Opens the cache that a [`RecordSource::locator`] of another process names (the loader's
/// producer, on the same node: the same local directory, so the same downloaded files).
pub fn open_located(locator: &str) -> Result<OpenedCache> {
    let bad = |reason: String| Error::config("locator", reason);
    let v: serde_json::Value =
        serde_json::from_str(locator).map_err(|e| bad(format!("not JSON: {e}")))?;
    let text = |k: &str| v.get(k).and_then(|x| x.as_str()).map(str::to_owned);
    let number = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
    let url = text("url").ok_or_else(|| bad("no url".into()))?;
    let options = RemoteOptions {
        local_dir: text("local_dir").map(PathBuf::from),
        max_local_bytes: number("max_local_bytes"),
        max_requests: number("max_requests").map(|n| n as usize),
        endpoint: text("endpoint"),
        region: text("region"),
        allow_http: v.get("allow_http").and_then(serde_json::Value::as_bool),
    };
    options.validate()?;
    let remote = Remote::open(&url, &options)?;
    let published = PublishedCache::open(&remote)?;
    open_in_place(published, &options, number("shared").unwrap_or(0))
}

/// [`open_cache`] on an opened [`Remote`] (tests give one over a store of their own).
pub fn open_remote_cache(remote: &Remote, options: &RemoteOptions) -> Result<OpenedCache> {
    open_in_place(PublishedCache::open(remote)?, options, 0)
}

/// Opens `published` in place; `shared` as for [`open_published`].
fn open_in_place(
    published: PublishedCache,
    options: &RemoteOptions,
    shared: u64,
) -> Result<OpenedCache> {
    let root = options.resolved_local_dir()?;
    let node = NodeCache::open(
        &root,
        &published.build_id,
        options.resolved_max_local_bytes(),
    )
    .map_err(|e| match e {
        // A directory that cannot be made or written is a setting to change, not a missing
        // cache (which a NotFound would read as).
        Error::Core(dataset_rt_core::Error::Io { op, path, source })
            if matches!(
                source.kind(),
                std::io::ErrorKind::NotFound
                    | std::io::ErrorKind::PermissionDenied
                    | std::io::ErrorKind::NotADirectory
                    | std::io::ErrorKind::ReadOnlyFilesystem
            ) =>
        {
            Error::config(
                "local_dir",
                format!(
                    "cannot {op} {}: {source} (the local directory is {})",
                    path.display(),
                    root.display()
                ),
            )
        }
        other => other,
    })?;
    let node = Arc::new(node);
    let policy = FetchPolicy {
        max_requests: options.resolved_max_requests(),
        // Records of a shuffled pass are scattered: neighbours are merged into one request only
        // across a gap of at most a page (the padding between records), so that no request
        // fetches bytes that no record needs.
        max_gap: RECORD_GAP,
        ..FetchPolicy::default()
    };
    let fetcher = RangeFetcher::new(Arc::clone(&published.data), policy)?;
    let version = published.manifest.format_version;
    let keys: Vec<String> = (0..published.manifest.shards.len() as u32)
        .map(shard_file_name)
        .collect();
    let urls = keys
        .iter()
        .map(|k| published.data.show(&published.data.key(k)))
        .collect();
    // Blocks when the budget holds every shard of every cache that shares it.
    let stored = stored_bytes(&published.manifest).saturating_add(shared);
    let blocks = (stored <= node.budget()).then(|| {
        let mut first_row = vec![0u64];
        for s in &published.manifest.shards {
            first_row.push(first_row[first_row.len() - 1].saturating_add(s.records));
        }
        Arc::new(Blocks {
            size: BLOCK_BYTES,
            version,
            first_row,
            shard_of: keys.iter().cloned().zip(0u32..).collect(),
            cache: OnceLock::new(),
            found: Mutex::default(),
        })
    });
    let verify: Arc<Verify> = {
        let blocks = blocks.clone();
        Arc::new(move |key: &RangeRequest, bytes: &[u8]| {
            match blocks.as_ref().and_then(|b| Some((b, b.named(key)?))) {
                Some((blocks, block)) => blocks.check(&block, bytes),
                None => check_record_bytes(version, bytes).map(|_| ()),
            }
        })
    };
    let name = published.manifest.name.clone();
    // The local copy counts in the budget with the downloads.
    let copy = (published.manifest_bytes.len() as u64)
        .saturating_add(published.manifest.index.bytes)
        .saturating_add(published.manifest.metadata.bytes);
    let records = Arc::new(RemoteRecords {
        fetcher: Arc::new(CachedFetcher::new(fetcher, Arc::clone(&node))),
        verify,
        blocks: blocks.clone(),
        records_only: AtomicBool::new(false),
        started_blocks: Mutex::default(),
        damaged_blocks: Mutex::default(),
        version,
        in_flight: Arc::default(),
        failed: Arc::default(),
        name: name.clone(),
        url: published.url.clone(),
        options: options.clone(),
        shared,
        keys,
        urls,
        ahead: Mutex::default(),
        budget_share: share_of(
            node.budget().saturating_sub(copy),
            stored_bytes(&published.manifest),
            shared,
        ),
    });
    if copy > node.budget() {
        return Err(Error::config(
            "max_local_bytes",
            format!(
                "{} bytes cannot hold the local copy of {} ({copy} bytes: its manifest, index \
                 and metadata table, kept in the local directory while it is read)",
                node.budget(),
                published.url
            ),
        ));
    }
    let dir = node.dir().join("cache");
    let source: Arc<dyn RecordSource> = records.clone();
    let cache = match local_copy(&published, &dir, false)
        .and_then(|()| Ok(Cache::open_fetched(&dir, &name, Arc::clone(&source))?))
    {
        Ok(cache) => cache,
        // A local copy that does not validate (damaged on disk): download it again, once.
        Err(Error::Core(dataset_rt_core::Error::Malformed { .. })) => {
            local_copy(&published, &dir, true)?;
            Cache::open_fetched(&dir, &name, source)?
        }
        Err(e) => return Err(e),
    };
    // Room for the copy just written, taken from downloads as a write would take it.
    if !node.fit()? {
        log::debug!("the local directory of {name} is over its budget until pinned ranges go");
    }
    let cache = Arc::new(cache);
    if let Some(blocks) = &blocks {
        let _ = blocks.cache.set(Arc::downgrade(&cache));
    }
    Ok(OpenedCache {
        cache,
        records,
        build_id: published.build_id,
    })
}

/// Verifies every record of a cache opened in place, in storage order (what `dataset-rt verify`
/// runs on a URL): its `index.bin` and `metadata.arrow` were checked against the manifest when
/// it was opened, and here each record's header against the index, its checksum and its LZ4
/// decoding, fetched ahead [`VERIFY_BATCH`] records at a time. The shards' whole-file checksums
/// are not computed (the bytes between records are not fetched).
pub fn verify_records(opened: &OpenedCache) -> Result<()> {
    let cache = &opened.cache;
    let ds = Dataset::new(vec![Arc::clone(cache)]);
    let mut start = 0;
    while start < cache.len() {
        let end = (start + VERIFY_BATCH).min(cache.len());
        let ranges: Vec<Range> = (start..end).filter_map(|s| ds.record_range(s)).collect();
        opened.records.start(&ranges);
        let checked = (start..end).try_for_each(|s| cache.payload(s).map(drop));
        opened.records.release(&ranges);
        checked?;
        start = end;
    }
    Ok(())
}

/// Records fetched ahead at once by [`verify_records`].
pub const VERIFY_BATCH: u64 = 256;

/// Makes `dir` hold the published manifest, `index.bin` and `metadata.arrow`: downloads the
/// files that are missing (all of them when `again`), each into a temporary file renamed into
/// place. Their contents are checked by the cache's open.
fn local_copy(published: &PublishedCache, dir: &Path, again: bool) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| io_err("create directory", dir, e))?;
    // One process of the node downloads the copy while the others sharing the directory wait
    // (a download is bounded by the fetcher's timeouts), then find it there. The lock goes
    // with the descriptor, when this returns or the process dies.
    let lock_path = dir.with_extension("lock");
    let _copying = crate::local::open_lock_file(&lock_path)?;
    crate::local::flock(&_copying, libc::LOCK_EX).map_err(|e| io_err("lock", &lock_path, e))?;
    let entries = [&published.manifest.index, &published.manifest.metadata];
    let mut missing: Vec<&FileEntry> = entries
        .into_iter()
        .filter(|f| {
            let len = fs::metadata(dir.join(&f.file)).ok().map(|m| m.len());
            again || len != Some(f.bytes)
        })
        .collect();
    // Each file is checked against the manifest (size and checksum) before it is written, and
    // a mismatch is downloaded again, a bounded number of times: a damaged object on the server
    // is named by its URL and never kept.
    let policy = FetchPolicy::default();
    let fetcher = RangeFetcher::new(Arc::clone(&published.data), policy.clone())?;
    for attempt in 1..=policy.verify_attempts {
        if missing.is_empty() {
            break;
        }
        let requests: Vec<RangeRequest> = missing
            .iter()
            .map(|f| RangeRequest::new(f.file.as_str(), 0..f.bytes))
            .collect();
        let got = fetcher.fetch_blocking(&requests, None)?;
        let mut bad = Vec::new();
        for (entry, bytes) in missing.into_iter().zip(got) {
            let checksum = checksum_hex(xxh3_64(&bytes));
            if bytes.len() as u64 == entry.bytes && checksum == entry.checksum {
                write_renamed(&dir.join(&entry.file), &bytes)?;
                continue;
            }
            if attempt == policy.verify_attempts {
                return Err(Error::Verify {
                    url: published.data.show(&published.data.key(&entry.file)),
                    range: 0..entry.bytes,
                    attempts: attempt,
                    reason: format!(
                        "{} bytes with checksum xxh3-64 {checksum} arrived, the manifest says \
                         {} bytes with {}",
                        bytes.len(),
                        entry.bytes,
                        entry.checksum
                    ),
                });
            }
            bad.push(entry);
        }
        missing = bad;
    }
    let manifest = dir.join(MANIFEST_FILE);
    if again || fs::read(&manifest).ok().as_deref() != Some(&published.manifest_bytes[..]) {
        write_renamed(&manifest, &published.manifest_bytes)?;
    }
    Ok(())
}

fn write_renamed(path: &Path, bytes: &[u8]) -> Result<()> {
    let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
    fs::write(&tmp, bytes)
        .and_then(|()| fs::rename(&tmp, path))
        .map_err(|e| {
            let _ = fs::remove_file(&tmp);
            io_err("write", path, e)
        })
}

fn io_err(op: &'static str, path: &Path, e: std::io::Error) -> Error {
    Error::Core(dataset_rt_core::Error::io(op, path, e))
}

//! The read planner: the order of a pass is known in advance, position by position, so the
//! records its reading threads are about to read are known too. The planner looks ahead along
//! that order, works out where each upcoming record lies ([`Range`]: cache, shard, offset,
//! length), and has a backend ([`RangeSource`]) start fetching it before a thread reads it:
//! reads in flight come from the order, not from more threads.
//!
//! The [`EpochReader`](super::EpochReader) consults it as it submits records to the pool and as
//! its consumer takes them, so records are still read and handed out in pass order: at most
//! `io_depth` records (and `read_ahead_bytes` of them, one record always let through) are
//! planned and not yet taken. It adds no thread: a backend starts fetches without waiting for
//! them (kernel advice for local files; requests on an asynchronous runtime for object storage).
//!
//! Warm data pays nothing: a planner starts at rest, and probes the pass's first record
//! ([`RangeSource::resident`]) before anything is read. While it rests the reader reads as it
//! would without it, and one record every so many positions is probed (the interval doubles
//! after each resident probe, from [`FIRST_PROBE_INTERVAL`] up to [`MAX_PROBE_INTERVAL`]); the
//! first probe that misses wakes it. Awake, it probes each record it plans: a resident one is
//! not fetched, and once [`REST_AFTER`] records in a row were resident it rests again.

use std::collections::VecDeque;
use std::sync::Arc;

/// Where one record lies: bytes `offset .. offset + len` of shard `shard` of cache `cache` (the
/// cache's place in its dataset). Worked out from the index entry, which nothing has checked
/// yet: a backend treats it as a hint, clamped to the shard, and a bad one costs a useless
/// fetch at most (the read reports the record's error at its position).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Range {
    pub cache: u32,
    pub shard: u32,
    pub offset: u64,
    pub len: u64,
}

impl Range {
    /// The first byte past the range.
    pub fn end(&self) -> u64 {
        self.offset.saturating_add(self.len)
    }
}

/// A backend of the read planner: it fetches the ranges the planner plans.
///
/// The planner calls it from the consumer's thread only, in pass order: `begin_pass` once,
/// then, record by record, `resident` (a probe) and `start` (for a chunk of records about to be
/// submitted to the reading threads), and `release` as the consumer takes them (or when the
/// pass ends or is dropped): every started range is released exactly once. The backend decides
/// how a started range is fetched:
/// - local files (`LocalFiles`): kernel advice (`WILLNEED`) on the shard's pages, which the
///   reading threads then find in the page cache; records stay zero-copy views of the maps;
/// - `io_uring` (a later backend): buffered reads submitted in `start`, their completions
///   reaped and their buffers recycled in `release`; the same page cache is filled;
/// - object storage (a later backend): range requests into a local cache directory, whose
///   space is released in `release`; `resident` is whether a range is there already.
pub trait RangeSource: Send + Sync {
    /// A short name of the backend (for the debug log and tests).
    fn name(&self) -> &'static str;

    /// A pass starts; `shuffled` says whether its order is random (a backend may then stop the
    /// kernel from reading around what is asked for).
    fn begin_pass(&self, shuffled: bool);

    /// Whether every byte of `range` can be read now without waiting for the device. A probe:
    /// cheap, and without side effects; `false` when it cannot tell.
    fn resident(&self, range: &Range) -> bool;

    /// Starts fetching `ranges` (one per record, in pass order) without waiting for them; the
    /// backend may coalesce neighbours into one request.
    fn start(&self, ranges: &[Range]);

    /// The records of `ranges` (each one `start`ed before) left the window: read and taken by
    /// the consumer, or abandoned with their pass.
    fn release(&self, ranges: &[Range]);

    /// How many positions of the pass, from the consumer's, the backend wants to know ahead of
    /// the window ([`RangeSource::foresee`]): a backend that keeps records within a budget
    /// evicts by them. 0 (the default): none, and nothing is worked out for it.
    fn foresight(&self) -> u64 {
        0
    }

    /// The records of the coming positions, `(position, range)` in pass order from the
    /// consumer's position on, up to [`RangeSource::foresight`] of them (fewer at the end of
    /// the pass): what the pass will need, and when. It replaces what was foreseen before; a
    /// record not in it is not needed in the known future. Ranges of records whose index
    /// entry names none are left out.
    fn foresee(&self, _upcoming: &[(u64, Range)]) {}

    /// The consumer has taken every record before `position`: what was foreseen there is
    /// needed no more (unless it comes again later).
    fn reached(&self, _position: u64) {}
}

/// The bytes of one record from a [`RecordSource`].
pub type RecordBytes = Box<dyn AsRef<[u8]> + Send + Sync>;

/// A backend that holds the records themselves, for a cache whose shards are not local files
/// (object storage): the cache reads every record through it ([`crate::cache::Cache::open_fetched`]),
/// and the planner fetches ahead through it. One source serves one cache: the `cache` field of
/// the ranges it gets is the cache's place in a dataset, which it ignores.
pub trait RecordSource: RangeSource {
    /// The bytes of `range` (the whole record of sample `sample`, from its index entry),
    /// waiting for them if they are not here yet. The caller checks them against the index and
    /// the record's checksum before it serves anything.
    fn read(&self, range: &Range, sample: u64) -> crate::error::Result<RecordBytes>;

    /// The record of `range` failed the caller's checks: whatever copy of it the source keeps
    /// is dropped, so that the next `read` fetches it again.
    fn discard(&self, range: &Range);

    /// Where shard `shard` lives (a URL), for errors and logs.
    fn shard_location(&self, shard: u32) -> String;

    /// Where the cache lives (its URL), for errors and logs.
    fn location(&self) -> String;

    /// What another process of this node gives the backend to open this same source again
    /// (the loader's producer): opaque to the core.
    fn locator(&self) -> String;
}

/// Planned records in a row found resident before the planner rests.
pub const REST_AFTER: u32 = 64;

/// The first probe interval (positions) of a resting planner.
pub const FIRST_PROBE_INTERVAL: u64 = 64;

/// The longest probe interval of a resting planner: one probe per this many positions at most.
pub const MAX_PROBE_INTERVAL: u64 = 256;

/// A record planned and not yet released.
#[derive(Clone, Copy, Debug)]
struct Planned {
    /// Its position in the pass.
    position: u64,
    /// `None`: no range could be worked out (a bad index entry), nothing fetched.
    range: Option<Range>,
    /// Whether it was started (not found resident).
    started: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Every record submitted is planned: probed, and started when it misses.
    Advising { resident_in_a_row: u32 },
    /// Reads hit: one record in `interval` positions is probed, from position `next`.
    Resting { next: u64, interval: u64 },
}

/// What a planner did, for tests and measurements.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PlannerStats {
    /// Records planned (each counted once).
    pub planned: u64,
    /// Planned records found resident, so not fetched.
    pub resident: u64,
    /// Planned records started (not found resident).
    pub started: u64,
    /// Calls to [`RangeSource::start`] (one per chunk with a record to start).
    pub start_calls: u64,
    /// Probes of a resting planner, and how many of them missed (and woke it).
    pub probes: u64,
    pub probes_missed: u64,
    /// Times the planner went to rest.
    pub rests: u64,
    /// The most records, and the most bytes, planned and not yet released at once.
    pub max_in_flight: usize,
    pub max_bytes_in_flight: u64,
}

/// Plans the reads of one pass ahead of its reading threads (see the module's documentation).
pub struct ReadPlanner {
    source: Arc<dyn RangeSource>,
    depth: usize,
    max_bytes: u64,
    /// Records planned and not yet released, in pass order.
    window: VecDeque<Planned>,
    /// Bytes of the ranges in `window`.
    bytes: u64,
    /// Ranges planned since the last `flush`, to start.
    pending: Vec<Range>,
    /// Scratch for `release` (no allocation per chunk).
    released: Vec<Range>,
    mode: Mode,
    stats: PlannerStats,
}

impl ReadPlanner {
    /// A planner over `source` that keeps at most `depth` records (at least 1) and `max_bytes`
    /// bytes of them planned and not yet released, except that one record is always let
    /// through.
    pub fn new(source: Arc<dyn RangeSource>, depth: usize, max_bytes: u64) -> Self {
        ReadPlanner {
            source,
            depth: depth.max(1),
            max_bytes,
            window: VecDeque::new(),
            bytes: 0,
            pending: Vec::new(),
            released: Vec::new(),
            // At rest, with a probe due at the first position: a warm pass never wakes it.
            mode: Mode::Resting {
                next: 0,
                interval: FIRST_PROBE_INTERVAL / 2,
            },
            stats: PlannerStats::default(),
        }
    }

    /// Tells the backend that a pass starts (see [`RangeSource::begin_pass`]).
    pub fn begin_pass(&self, shuffled: bool) {
        self.source.begin_pass(shuffled);
    }

    /// Positions the backend wants to know ahead ([`RangeSource::foresight`]).
    pub fn foresight(&self) -> u64 {
        self.source.foresight()
    }

    /// Tells the backend the records of the coming positions ([`RangeSource::foresee`]).
    pub fn foresee(&self, upcoming: &[(u64, Range)]) {
        self.source.foresee(upcoming);
    }

    pub fn source_name(&self) -> &'static str {
        self.source.name()
    }

    /// Records planned and not yet released at most.
    pub fn depth(&self) -> usize {
        self.depth
    }

    /// Whether records submitted now are to be planned ([`ReadPlanner::plan`]); else the planner
    /// rests and only probes ([`ReadPlanner::probe_due`]).
    pub fn advising(&self) -> bool {
        matches!(self.mode, Mode::Advising { .. })
    }

    /// Records planned and not yet released.
    pub fn in_flight(&self) -> usize {
        self.window.len()
    }

    /// Bytes of the records planned and not yet released.
    pub fn bytes_in_flight(&self) -> u64 {
        self.bytes
    }

    pub fn stats(&self) -> PlannerStats {
        self.stats
    }

    /// Records that may be planned now, whatever their sizes.
    pub fn room(&self) -> usize {
        self.depth.saturating_sub(self.window.len())
    }

    /// Whether the record at `range` may be planned now: within the depth and the byte bound,
    /// or alone (a record larger than the byte bound still goes through, on its own).
    pub fn admits(&self, range: Option<&Range>) -> bool {
        if self.window.is_empty() {
            return true;
        }
        let len = range.map_or(0, |r| r.len);
        self.window.len() < self.depth && self.bytes.saturating_add(len) <= self.max_bytes
    }

    /// Plans the next record of the pass, at position `position`, lying at `range` (`None` when
    /// its index entry names no range: nothing is fetched, the read reports it): probes it and,
    /// when it misses, queues it to start at the next [`ReadPlanner::flush`]. The caller checked
    /// [`ReadPlanner::admits`].
    pub fn plan(&mut self, position: u64, range: Option<Range>) {
        let resident = range.as_ref().is_none_or(|r| self.source.resident(r));
        self.stats.planned += 1;
        if let Some(r) = range {
            self.bytes = self.bytes.saturating_add(r.len);
            if !resident {
                self.pending.push(r);
                self.stats.started += 1;
            }
        }
        if resident && range.is_some() {
            self.stats.resident += 1;
        }
        debug_assert!(self.window.back().is_none_or(|p| p.position < position));
        self.window.push_back(Planned {
            position,
            range,
            started: !resident,
        });
        self.stats.max_in_flight = self.stats.max_in_flight.max(self.window.len());
        self.stats.max_bytes_in_flight = self.stats.max_bytes_in_flight.max(self.bytes);
        if let Mode::Advising { resident_in_a_row } = &mut self.mode {
            if !resident {
                *resident_in_a_row = 0;
            } else if range.is_some() {
                *resident_in_a_row += 1;
                if *resident_in_a_row >= REST_AFTER {
                    self.rest(position + 1);
                }
            }
        }
    }

    /// Starts the records planned since the last flush that missed: one call to the backend
    /// for a chunk of records.
    pub fn flush(&mut self) {
        if self.pending.is_empty() {
            return;
        }
        self.stats.start_calls += 1;
        self.source.start(&self.pending);
        self.pending.clear();
    }

    /// The planned records at positions before `end` left the window (the consumer took them).
    pub fn release_through(&mut self, end: u64) {
        let n = self.window.partition_point(|p| p.position < end);
        self.release(n);
        self.source.reached(end);
    }

    /// The oldest `n` planned records left the window.
    fn release(&mut self, n: usize) {
        debug_assert!(self.pending.is_empty(), "flushed before it is released");
        self.released.clear();
        for planned in self.window.drain(..n.min(self.window.len())) {
            if let Some(r) = planned.range {
                self.bytes -= r.len;
                if planned.started {
                    self.released.push(r);
                }
            }
        }
        if !self.released.is_empty() {
            self.source.release(&self.released);
        }
    }

    /// Releases every record planned: the pass ended or was left.
    pub fn release_all(&mut self) {
        self.flush();
        self.release(self.window.len());
    }

    fn rest(&mut self, next_position: u64) {
        self.stats.rests += 1;
        self.mode = Mode::Resting {
            next: next_position + FIRST_PROBE_INTERVAL,
            interval: FIRST_PROBE_INTERVAL,
        };
    }

    /// While resting: the position in `k0 .. k1` (records about to be submitted without being
    /// planned) to probe, if one is due.
    pub fn probe_due(&self, k0: u64, k1: u64) -> Option<u64> {
        match self.mode {
            Mode::Resting { next, .. } if next < k1 => Some(next.max(k0)),
            _ => None,
        }
    }

    /// Probes the record at `position`, lying at `range`, for a resting planner: resident, it
    /// probes again later (twice as far, up to [`MAX_PROBE_INTERVAL`]); missing, it plans the
    /// records submitted from now on.
    pub fn probe(&mut self, position: u64, range: Option<Range>) {
        let Mode::Resting { interval, .. } = self.mode else {
            return;
        };
        self.stats.probes += 1;
        let resident = range.as_ref().is_none_or(|r| self.source.resident(r));
        if resident {
            let interval = (interval * 2).min(MAX_PROBE_INTERVAL);
            self.mode = Mode::Resting {
                next: position + interval,
                interval,
            };
        } else {
            self.stats.probes_missed += 1;
            self.mode = Mode::Advising {
                resident_in_a_row: 0,
            };
        }
    }
}

impl Drop for ReadPlanner {
    /// Nothing stays in flight with the backend once its planner is gone.
    fn drop(&mut self) {
        self.release_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    /// A backend that records every call; ranges of shard 1 are resident.
    #[derive(Default)]
    struct Recording {
        started: Mutex<Vec<Range>>,
        released: Mutex<Vec<Range>>,
    }

    impl RangeSource for Recording {
        fn name(&self) -> &'static str {
            "recording"
        }
        fn begin_pass(&self, _: bool) {}
        fn resident(&self, r: &Range) -> bool {
            r.shard == 1
        }
        fn start(&self, ranges: &[Range]) {
            self.started.lock().unwrap().extend_from_slice(ranges);
        }
        fn release(&self, ranges: &[Range]) {
            self.released.lock().unwrap().extend_from_slice(ranges);
        }
    }

    fn at(shard: u32, offset: u64, len: u64) -> Range {
        Range {
            cache: 0,
            shard,
            offset,
            len,
        }
    }

    /// A planner woken by a probe that misses (shard 0 is not resident).
    fn awake(source: Arc<Recording>, depth: usize, max_bytes: u64) -> ReadPlanner {
        let mut p = ReadPlanner::new(source, depth, max_bytes);
        assert!(!p.advising(), "a planner starts at rest");
        assert_eq!(p.probe_due(0, 1), Some(0), "and probes the first record");
        p.probe(0, Some(at(0, 0, 1)));
        assert!(p.advising());
        p
    }

    #[test]
    fn a_planner_whose_first_probe_hits_stays_at_rest() {
        let source = Arc::new(Recording::default());
        let mut p = ReadPlanner::new(source, 8, 1 << 20);
        p.probe(0, Some(at(1, 0, 1)));
        assert!(!p.advising());
        assert_eq!(p.probe_due(1, FIRST_PROBE_INTERVAL), None);
        assert_eq!(
            p.probe_due(1, FIRST_PROBE_INTERVAL + 1),
            Some(FIRST_PROBE_INTERVAL)
        );
    }

    #[test]
    fn missing_records_are_started_and_released_record_by_record_in_order() {
        let source = Arc::new(Recording::default());
        let mut p = awake(source.clone(), 8, 1 << 20);
        let ranges = [
            at(0, 0, 100),
            at(1, 112, 100),
            at(2, 0, 100),
            at(0, 1 << 20, 100),
        ];
        for (k, r) in ranges.iter().enumerate() {
            p.plan(k as u64, Some(*r));
        }
        p.flush();
        // Shard 1 is resident: not started, and not released either.
        let missed = [ranges[0], ranges[2], ranges[3]];
        assert_eq!(*source.started.lock().unwrap(), missed);
        assert_eq!(p.in_flight(), 4);
        assert_eq!(p.bytes_in_flight(), 400);
        p.release_through(2);
        assert_eq!(*source.released.lock().unwrap(), missed[..1]);
        p.release_through(4);
        assert_eq!(*source.released.lock().unwrap(), missed);
        assert_eq!(p.bytes_in_flight(), 0);
        assert_eq!(p.stats().start_calls, 1);
        assert_eq!(p.stats().resident, 1);
    }

    #[test]
    fn resident_records_are_not_started_and_the_planner_rests_then_wakes_on_a_miss() {
        let source = Arc::new(Recording::default());
        let mut p = awake(source.clone(), 1 << 10, u64::MAX);
        for k in 0..u64::from(REST_AFTER) {
            assert!(p.advising());
            p.plan(k, Some(at(1, k * 100, 100)));
        }
        p.flush();
        assert!(source.started.lock().unwrap().is_empty());
        assert!(!p.advising());
        let k = u64::from(REST_AFTER);
        assert_eq!(p.probe_due(k, k + 10), None);
        let due = p.probe_due(k, k + 1000).unwrap();
        assert_eq!(due, k + FIRST_PROBE_INTERVAL);
        p.probe(due, Some(at(1, 0, 1)));
        assert_eq!(p.probe_due(due, due + 2 * FIRST_PROBE_INTERVAL), None);
        let due = p.probe_due(due, due + 10_000).unwrap();
        p.probe(due, Some(at(0, 0, 1)));
        assert!(p.advising());
        assert_eq!(p.stats().probes, 3);
        assert_eq!(p.stats().probes_missed, 2);
        p.release_all();
        assert_eq!(p.in_flight(), 0);
    }

    #[test]
    fn the_probe_interval_grows_to_its_bound() {
        let source = Arc::new(Recording::default());
        let mut p = awake(source, 4, u64::MAX);
        for k in 0..u64::from(REST_AFTER) {
            p.plan(k, Some(at(1, 0, 1)));
            p.release_through(k + 1);
        }
        let mut k = 0;
        let mut last_gap = 0;
        for _ in 0..20 {
            let due = p.probe_due(k, u64::MAX).unwrap();
            last_gap = due - k;
            p.probe(due, Some(at(1, 0, 1)));
            k = due;
        }
        assert_eq!(last_gap, MAX_PROBE_INTERVAL);
    }

    #[test]
    fn one_record_larger_than_the_byte_bound_goes_through_alone() {
        let source = Arc::new(Recording::default());
        let mut p = awake(source, 8, 1000);
        let big = at(0, 0, 5000);
        assert!(p.admits(Some(&big)));
        p.plan(0, Some(big));
        assert!(!p.admits(Some(&at(0, 8000, 1))));
        p.flush();
        p.release_through(1);
        assert!(p.admits(Some(&at(0, 8000, 1000))));
    }
}

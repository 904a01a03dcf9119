//! Reading an epoch ahead of its consumer on the pool: chunks of the epoch's order, claimed by
//! the pool's threads in blocks, their shards checked against their validated sizes, handed
//! out in order by an [`EpochReader`]. While reads miss the page cache, the reader's
//! [`ReadPlanner`] has the records of the chunks it submits fetched ahead of the threads.

use std::collections::VecDeque;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

use crate::error::{Error, Result};
use crate::pool::{panic_message, Pool};
use crate::sampler::{EpochOrder, RankSplit};

use super::planner::{PlannerStats, Range, RangeSource, ReadPlanner};
use super::{Dataset, Fetched, Payload, ReadOptions};

/// The default bound on decompressed bytes an [`EpochReader`] holds ahead of its consumer.
pub const DEFAULT_PREFETCH_BYTES: u64 = 64 << 20;

/// The shards whose files were checked against their validated sizes
/// ([`Cache::check_shard_size`]) for one block or chunk of samples: one `fstat` per shard it
/// reads, not one per sample. Up to `N` shards are remembered (a fixed array: the reading threads
/// allocate nothing); a shard beyond them is checked at each of its samples.
///
/// [`Cache::check_shard_size`]: crate::cache::Cache::check_shard_size
pub struct CheckedShards<const N: usize> {
    /// (cache, shard, whether the file still has its validated size)
    seen: [(u32, u32, bool); N],
    len: usize,
}

impl<const N: usize> Default for CheckedShards<N> {
    fn default() -> Self {
        CheckedShards {
            seen: [(0, 0, false); N],
            len: 0,
        }
    }
}

impl<const N: usize> CheckedShards<N> {
    /// Checks the shard that the record of sample `row` of cache `c` lies in (an index entry
    /// naming no shard is left to [`Cache::check_record`], which refuses it).
    ///
    /// [`Cache::check_record`]: crate::cache::Cache::check_record
    pub(crate) fn check(&mut self, dataset: &Dataset, c: usize, row: u64) -> Result<()> {
        let cache = &dataset.caches[c];
        let shard = cache.entry(row).shard;
        if shard as usize >= cache.num_shards() {
            return Ok(());
        }
        self.check_shard(dataset, c, shard, row)
    }

    /// Checks shard `shard` of cache `c`, where sample `row`'s record lies.
    pub(crate) fn check_shard(
        &mut self,
        dataset: &Dataset,
        c: usize,
        shard: u32,
        row: u64,
    ) -> Result<()> {
        let key = (c as u32, shard);
        let seen = self.seen[..self.len]
            .iter()
            .find(|&&(sc, ss, _)| (sc, ss) == key);
        if let Some(&(_, _, whole)) = seen {
            if whole {
                return Ok(());
            }
        }
        let cache = &dataset.caches[c];
        let checked = cache.check_shard_size(shard, None);
        if seen.is_none() && self.len < N {
            self.seen[self.len] = (key.0, key.1, checked.is_ok());
            self.len += 1;
        }
        // The error names the record (its entry is read only now, on this rare path).
        checked.map_err(|first| {
            let offset = cache.entry(row).offset;
            match cache.check_shard_size(shard, Some((row, offset))) {
                Err(named) => named,
                Ok(()) => first, // grown back meanwhile: still refused, by the first finding
            }
        })
    }
}

/// Samples a thread claims at a time from a chunk: one atomic claim, one result lock and one
/// completion count per block rather than per sample. Per sample, those shared counters bounced
/// between the cores of the threads reading the chunk and cost more than reading a mapped record.
const CLAIM_BLOCK: usize = 16;

/// Samples read ahead at least by [`EpochReader::read_ahead_when_mapped`].
pub const MAPPED_READ_AHEAD: u64 = 512;

/// Spent chunks an [`EpochReader`] keeps at most while a reading thread still holds them.
const MAX_SPENT: usize = 64;

/// Which samples a chunk reads.
enum ChunkSamples {
    /// Worked out by the consumer (it needs each one's decompressed size for the byte budget).
    Globals(Vec<u64>),
    /// Positions `first ..` of the pass: the threads that read a block work out its samples, so
    /// the epoch order (eight keyed hashes a position) is computed in parallel, not by the
    /// consumer alone.
    Positions { pass: PassOrder, first: u64 },
}

/// What maps a position of a rank's pass to its global sample.
#[derive(Clone)]
struct PassOrder {
    order: Arc<EpochOrder>,
    split: RankSplit,
    epoch_len: u64,
    start: u64,
}

impl PassOrder {
    fn global(&self, k: u64) -> u64 {
        self.global_of(&self.split, k)
    }

    /// The global sample at position `k` of the pass of another rank of the same order.
    fn global_of(&self, split: &RankSplit, k: u64) -> u64 {
        self.order
            .at(split.global_position(self.epoch_len, self.start, k))
    }
}

/// The samples of one pool job. Workers and, when it helps, the consumer claim them a block at a
/// time, so a consumer that needs the chunk never sleeps until a worker is scheduled for it.
struct Chunk {
    samples: ChunkSamples,
    len: usize,
    /// The position after this chunk's last sample: when the consumer takes the chunk, the
    /// planner's records before it leave its window.
    end: u64,
    /// Blocks of [`CLAIM_BLOCK`] samples claimed so far.
    claimed: AtomicUsize,
    /// Samples read so far.
    done: AtomicUsize,
    /// One result per sample, in blocks: a corrupt record fails only when its turn comes. The
    /// consumer allocates (or reuses) the blocks and frees them ([`EpochReader::spent`]); the
    /// reading threads allocate nothing. A block allocated by one thread and freed by another
    /// takes a lock of glibc's allocator, and the consumer used to wait on that lock about
    /// once per batch.
    results: Vec<Mutex<Block>>,
    completion: Mutex<Completion>,
    completed: Condvar,
}

/// Whether a chunk is complete, and whether its consumer sleeps until it is: the thread that
/// completes it signals only a consumer that sleeps (a signal is a system call).
#[derive(Default)]
struct Completion {
    complete: bool,
    waiting: bool,
}

/// The results of one claimed block, in order.
struct Block([Option<Result<Fetched>>; CLAIM_BLOCK]);

impl Default for Block {
    fn default() -> Self {
        Block(std::array::from_fn(|_| None))
    }
}

impl Chunk {
    /// A chunk of `len` samples whose results go into `blocks` (empty ones, resized here).
    fn new(samples: ChunkSamples, len: usize, mut blocks: Vec<Mutex<Block>>) -> Self {
        let n = len.div_ceil(CLAIM_BLOCK);
        blocks.truncate(n);
        blocks.resize_with(n, Default::default);
        Chunk {
            samples,
            len,
            end: 0,
            claimed: AtomicUsize::new(0),
            done: AtomicUsize::new(0),
            results: blocks,
            completion: Mutex::new(Completion::default()),
            completed: Condvar::new(),
        }
    }

    /// Reads samples of this chunk until none is left to claim.
    fn work(&self, dataset: &Dataset, hook: Option<&FetchHook>) {
        loop {
            let block = self.claimed.fetch_add(1, Ordering::AcqRel);
            let lo = block.saturating_mul(CLAIM_BLOCK);
            if lo >= self.len {
                return;
            }
            let hi = (lo + CLAIM_BLOCK).min(self.len);
            let n = hi - lo;
            let mut globals = [0u64; CLAIM_BLOCK];
            let mut results = self.results[block].lock().unwrap();
            let slots = &mut results.0[..n];
            // A panic (here or in a read) is the error of the samples it concerns: the chunk
            // still completes, so nobody waits forever.
            match catch_unwind(AssertUnwindSafe(|| {
                self.block_samples(lo, &mut globals[..n])
            })) {
                Ok(()) => self.read_block(dataset, hook, &globals[..n], slots),
                Err(panic) => {
                    for slot in slots {
                        *slot = Some(Err(Error::Runtime(panic_message(&panic))));
                    }
                }
            }
            drop(results);
            if self.done.fetch_add(n, Ordering::AcqRel) + n == self.len {
                let mut completion = self.completion.lock().unwrap();
                completion.complete = true;
                if completion.waiting {
                    self.completed.notify_all();
                }
            }
        }
    }

    /// The global samples of positions `lo .. lo + out.len()` of the chunk.
    fn block_samples(&self, lo: usize, out: &mut [u64]) {
        match &self.samples {
            ChunkSamples::Globals(all) => out.copy_from_slice(&all[lo..lo + out.len()]),
            ChunkSamples::Positions { pass, first } => {
                for (i, g) in out.iter_mut().enumerate() {
                    *g = pass.global(first + (lo + i) as u64);
                }
            }
        }
    }

    /// Stops the reading threads from claiming more of this chunk, whose reader is gone: the
    /// blocks already claimed finish, the others are never read (nobody waits for them).
    fn abandon(&self) {
        self.claimed.store(usize::MAX / 2, Ordering::Release);
    }

    /// Reads one block's samples into `slots`, each with its own result.
    fn read_block(
        &self,
        dataset: &Dataset,
        hook: Option<&FetchHook>,
        globals: &[u64],
        slots: &mut [Option<Result<Fetched>>],
    ) {
        // Shuffled records are scattered over the shards: asking for the block's headers at
        // once overlaps the memory misses that reading them one by one would wait for in turn.
        for &g in globals {
            dataset.prefetch_record(g);
        }
        // Before any byte of a record is touched, its shard file is checked against its
        // validated size, once per shard of the block: a page past a truncated file's end
        // would raise SIGBUS.
        let mut checked = CheckedShards::<CLAIM_BLOCK>::default();
        for (slot, &g) in slots.iter_mut().zip(globals) {
            let fetched = catch_unwind(AssertUnwindSafe(|| {
                let (c, row) = dataset.locate(g);
                checked.check(dataset, c, row)?;
                dataset.fetch(g)
            }))
            .unwrap_or_else(|panic| Err(Error::Runtime(panic_message(&panic))));
            if let Some(hook) = hook {
                hook();
            }
            *slot = Some(fetched);
        }
    }

    fn is_complete(&self) -> bool {
        self.done.load(Ordering::Acquire) == self.len
    }

    /// Waits until every sample was read, then takes the results in order. The samples still
    /// being read take about a microsecond each: it spins (then yields) a little before it
    /// sleeps, since a sleep and its wake-up cost more than that.
    fn take_into(&self, ready: &mut VecDeque<Result<Fetched>>) {
        let backoff = crossbeam_utils::Backoff::new();
        while !self.is_complete() && !backoff.is_completed() {
            backoff.snooze();
        }
        if !self.is_complete() {
            let mut completion = self.completion.lock().unwrap();
            while !completion.complete {
                completion.waiting = true;
                completion = self.completed.wait(completion).unwrap();
            }
        }
        let before = ready.len();
        for block in &self.results {
            let mut block = block.lock().unwrap();
            ready.extend(block.0.iter_mut().map_while(Option::take));
        }
        assert_eq!(
            ready.len() - before,
            self.len,
            "a complete chunk has every result"
        );
    }
}

/// Checks again, before they are handed out, the shard files of the read-ahead samples that are
/// views of a shard: a file truncated since a record was read would serve zeros for the rest of
/// its last page (or SIGBUS past it). A sample of a truncated shard becomes its error, at its
/// position. One `fstat` per shard of the chunk.
fn recheck_mapped(dataset: &Dataset, ready: &mut VecDeque<Result<Fetched>>) {
    let mut checked = CheckedShards::<64>::default();
    for sample in ready.iter_mut() {
        let Ok(Fetched {
            cache,
            row,
            payload: Payload::Mapped { shard, .. },
        }) = sample
        else {
            continue;
        };
        if let Err(e) = checked.check_shard(dataset, *cache as usize, *shard, *row) {
            *sample = Err(e);
        }
    }
}

/// How long the samples of a chunk whose shards were checked may wait to be handed out before
/// each one's shard is checked again ([`EpochReader::check_mapped`]).
/// Read on the coarse monotonic clock (a few nanoseconds, no system call; it advances by the
/// kernel's tick, 1 to 4 ms): a sample handed out within the tick of its chunk's check costs
/// nothing more.
const RECHECK_AFTER_NS: u64 = 1_000_000;

/// The coarse monotonic clock, in nanoseconds (see [`RECHECK_AFTER_NS`]).
fn coarse_now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `clock_gettime` writes one `timespec` into the struct it is given.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut ts) };
    (ts.tv_sec as u64).saturating_mul(1_000_000_000) + ts.tv_nsec as u64
}

/// Reads one rank's share of one epoch, ahead of the consumer on the pool.
pub struct EpochReader {
    pool: Arc<Pool>,
    dataset: Arc<Dataset>,
    /// The epoch's order, this rank's split and the global position this pass started from (0,
    /// or a loaded state's position).
    pass: PassOrder,
    pub epoch: u64,
    len: u64,
    submitted: u64,
    /// Samples given to the consumer (by `next_sample`, `next_batch` or `next_chunk`).
    taken: u64,
    /// Samples handed to the user: what `position` reports. Equal to `taken` except while a
    /// consumer of `next_chunk` still holds samples it has not handed out.
    yielded: u64,
    in_flight: VecDeque<Arc<Chunk>>,
    /// Chunks taken, until the reading threads have dropped them too: the consumer drops them
    /// (or reuses their result blocks), so their memory is freed by the thread that allocated
    /// it.
    spent: VecDeque<Arc<Chunk>>,
    /// When the shards of the samples in `ready` were last checked against their validated
    /// sizes ([`recheck_mapped`]); see [`EpochReader::check_mapped`].
    checked_at: u64,
    /// Whether the consumer reads the samples of the chunk it waits for itself.
    helping: bool,
    ready: VecDeque<Result<Fetched>>,
    chunk: u64,
    prefetch: u64,
    /// Bound on `bytes_in_flight`, except that one sample is always let through.
    prefetch_bytes: u64,
    /// Decompressed bytes of the samples submitted and not yet yielded.
    bytes_in_flight: u64,
    /// The decompressed bytes of each sample submitted and not yet yielded, in order.
    costs: VecDeque<u64>,
    /// Called on a pool thread after each sample is read (see [`EpochReader::on_fetched`]).
    on_fetched: Option<FetchHook>,
    failed: bool,
    /// An error met while refilling the window on a hand-out, reported by the next take.
    deferred: Option<Error>,
    /// Plans the reads ahead of the reading threads while they miss the page cache (`None` on
    /// the plain path, `DATASET_RT_IO=plain`).
    planner: Option<ReadPlanner>,
    /// The global samples of the positions planned and not yet submitted (`submitted ..`).
    ahead: VecDeque<u64>,
    /// Samples of one pool job while the planner plans (at most): a quarter of its depth, so
    /// that the records it keeps in flight are read by several jobs at once, and each job
    /// taken lets the planner start the next records.
    plan_chunk: u64,
    /// What a planner set later ([`EpochReader::with_range_source`]) is given.
    io_depth: usize,
    read_ahead_bytes: u64,
    shuffled: bool,
    /// The consumer's position when the backend was last told the coming records
    /// ([`EpochReader::foresee`]); `None`: not yet in this pass.
    foreseen_at: Option<u64>,
    /// The positions before this one had their index entries asked for
    /// ([`Dataset::advise_entries`]) while the planner advised, and how many requests that took.
    entries_advised: u64,
    entry_requests: u64,
    /// The (cache, index page) asked for last.
    last_entry_page: Option<(usize, u64)>,
}

impl Drop for EpochReader {
    /// A pass left before its end (a `break` out of the loop, a new `iter()`) stops its
    /// read-ahead: the pool's threads would otherwise read up to a window of samples nobody
    /// takes, beside the reads of whatever comes next.
    fn drop(&mut self) {
        for chunk in &self.in_flight {
            chunk.abandon();
        }
    }
}

/// Samples of one pool job while the planner plans: a quarter of `io_depth` (1 to 256).
fn plan_chunk(io_depth: usize) -> u64 {
    (io_depth as u64 / 4).clamp(1, 256)
}

/// The ranks that share this process's node, as the launcher says (`LOCAL_WORLD_SIZE`, set by
/// torchrun, Ray Train and the other launchers); `None` when it says nothing readable.
fn local_world_size() -> Option<u64> {
    std::env::var("LOCAL_WORLD_SIZE").ok()?.trim().parse().ok()
}

/// What a reader calls on a pool thread after reading each sample.
pub type FetchHook = Arc<dyn Fn() + Send + Sync>;

impl EpochReader {
    pub fn new(
        pool: Arc<Pool>,
        dataset: Arc<Dataset>,
        order: Arc<EpochOrder>,
        opts: &ReadOptions,
        epoch: u64,
        start: u64,
    ) -> Self {
        let split = opts.split();
        let epoch_len = order.len();
        let len = split.rank_len(epoch_len, start);
        let prefetch = opts.prefetch_size as u64;
        let planner = dataset.planner(opts);
        if let Some(planner) = &planner {
            planner.begin_pass(opts.shuffle);
        }
        // An index cut short since the open is refused before any entry of it is read.
        let deferred = dataset.check_index_sizes().err();
        EpochReader {
            pool,
            dataset,
            pass: PassOrder {
                order,
                split,
                epoch_len,
                start,
            },
            epoch,
            len,
            submitted: 0,
            taken: 0,
            yielded: 0,
            in_flight: VecDeque::new(),
            spent: VecDeque::new(),
            checked_at: coarse_now_ns(),
            helping: false,
            ready: VecDeque::new(),
            // Two chunks per prefetch window: one being read while the other is consumed, and
            // one pool hand-off per chunk rather than per sample.
            chunk: (prefetch / 2).clamp(1, 256),
            prefetch,
            prefetch_bytes: DEFAULT_PREFETCH_BYTES,
            bytes_in_flight: 0,
            costs: VecDeque::new(),
            on_fetched: None,
            failed: false,
            deferred,
            planner,
            ahead: VecDeque::new(),
            plan_chunk: plan_chunk(opts.io_depth),
            io_depth: opts.io_depth,
            read_ahead_bytes: opts.read_ahead_bytes,
            shuffled: opts.shuffle,
            foreseen_at: None,
            entries_advised: 0,
            entry_requests: 0,
            last_entry_page: None,
        }
    }

    /// Plans this pass's reads with `source` as the backend (a test seam, and the way in for
    /// other backends), under the pass's `io_depth` and `read_ahead_bytes`.
    pub fn with_range_source(mut self, source: Arc<dyn RangeSource>) -> Self {
        let planner = ReadPlanner::new(source, self.io_depth, self.read_ahead_bytes);
        planner.begin_pass(self.shuffled);
        self.planner = Some(planner);
        self
    }

    /// Reads without a planner, whatever `DATASET_RT_IO` says: the plain path.
    pub fn with_plain_io(mut self) -> Self {
        self.planner = None;
        self.ahead.clear();
        self
    }

    /// What the planner did so far (`None` on the plain path).
    pub fn planner_stats(&self) -> Option<PlannerStats> {
        self.planner.as_ref().map(ReadPlanner::stats)
    }

    /// The positions whose index entries were asked for ahead of the planner (all those before
    /// the one returned), and the requests to the kernel that took.
    pub fn entries_advised(&self) -> (u64, u64) {
        (self.entries_advised, self.entry_requests)
    }

    /// Records the planner planned and the consumer has not taken yet (0 on the plain path).
    pub fn planned_in_flight(&self) -> usize {
        self.planner.as_ref().map_or(0, ReadPlanner::in_flight)
    }

    /// Ends the pass after its last whole batch of `batch` samples: the short tail is neither
    /// read nor yielded (`drop_last`). The pass then counts as finished once that batch is out.
    pub fn whole_batches_of(mut self, batch: u64) -> Self {
        self.len -= self.len % batch.max(1);
        self
    }

    /// Reads at least `samples` ahead of the consumer (a batch reader wants two batches: one
    /// being read while the other is handed over), in chunks sized for that window.
    pub fn read_ahead_at_least(mut self, samples: u64) -> Self {
        if samples > self.prefetch {
            self.prefetch = samples;
            self.chunk = (samples / 2).clamp(1, 256);
        }
        self
    }

    /// For a dataset whose records are all served from the maps (none is compressed), reads at
    /// least [`MAPPED_READ_AHEAD`] samples ahead, in chunks of 256, whatever `prefetch_size`
    /// says: such samples take no memory while they wait. With a window of a few dozen samples
    /// the workers read each chunk faster than the consumer takes it and sleep in between, and
    /// every chunk then costs the consumer a system call to wake one of them.
    pub fn read_ahead_when_mapped(self) -> Self {
        if self.dataset.may_decompress {
            self
        } else {
            self.read_ahead_at_least(MAPPED_READ_AHEAD)
        }
    }

    /// Makes the consumer read the samples of a chunk it would otherwise wait for, beside the
    /// workers: no wait for a worker to be scheduled, one more thread reading. For a consumer
    /// that releases the GIL for a whole batch.
    pub fn consumer_helps(mut self) -> Self {
        self.helping = true;
        self
    }

    /// Bounds the decompressed bytes read ahead of the consumer (default
    /// [`DEFAULT_PREFETCH_BYTES`]). Samples served from the map cost nothing; one sample is always
    /// read even when it alone is larger, so a huge record still makes progress.
    pub fn with_prefetch_bytes(mut self, bytes: u64) -> Self {
        self.prefetch_bytes = bytes;
        self
    }

    /// Sets the samples of one pool job (default `clamp(prefetch_size / 2, 1, 256)`: two jobs
    /// per window). Smaller chunks keep more workers busy within the same window: a window of
    /// `P` samples over `T` workers wants chunks of about `P / (2 T)`.
    pub fn with_chunk(mut self, samples: u64) -> Self {
        self.chunk = samples.max(1);
        self
    }

    /// Calls `hook` on the pool thread after each sample is read, successfully or not: a sign
    /// of progress while the consumer waits on a chunk (the shared-memory producer's
    /// heartbeat), which stops when a read hangs.
    pub fn on_fetched(mut self, hook: FetchHook) -> Self {
        self.on_fetched = Some(hook);
        self
    }

    /// Decompressed bytes read (or being read) ahead of the consumer and not yet yielded.
    pub fn bytes_in_flight(&self) -> u64 {
        self.bytes_in_flight
    }

    /// Samples submitted to the pool and not yet yielded.
    pub fn samples_in_flight(&self) -> u64 {
        self.submitted - self.yielded
    }

    /// Samples this pass yields in all.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn remaining(&self) -> u64 {
        self.len - self.yielded
    }

    /// Global position reached by what was yielded so far.
    pub fn position(&self) -> u64 {
        let pass = &self.pass;
        pass.split
            .global_progress(pass.epoch_len, pass.start, self.yielded)
    }

    /// Tells a backend that wants it ([`RangeSource::foresight`]) the records of the coming
    /// positions, from the consumer's on: first when the pass starts, then each time the
    /// consumer has moved a quarter of the foresight, so that what was taken drops out of it.
    /// Nothing is worked out for a backend that wants none (local files).
    ///
    /// The records of the other ranks of this node ([`RankSplit::node_peers`], told by
    /// `LOCAL_WORLD_SIZE`) come too, each at its step: the ranks of one node share its cache
    /// of downloads, and at step k each takes its k-th sample. The foresight is then shared
    /// between them (its positions divided by the ranks).
    fn foresee(&mut self) {
        let Some(planner) = self.planner.as_ref() else {
            return;
        };
        let horizon = planner.foresight();
        if horizon == 0 {
            return;
        }
        let from = self.taken;
        if self
            .foreseen_at
            .is_some_and(|at| from < at.saturating_add((horizon / 4).max(1)))
        {
            return;
        }
        let pass = &self.pass;
        let peers = pass.split.node_peers(local_world_size());
        let steps = (horizon / peers.len() as u64).max(1);
        let end = from.saturating_add(steps).min(self.len);
        let mut upcoming: Vec<(u64, Range)> = Vec::new();
        for k in from..end {
            for peer in &peers {
                if k >= peer.rank_len(pass.epoch_len, pass.start) {
                    continue;
                }
                if let Some(range) = self.dataset.record_range(pass.global_of(peer, k)) {
                    upcoming.push((k, range));
                }
            }
        }
        planner.foresee(&upcoming);
        self.foreseen_at = Some(from);
    }

    /// Plans the records ahead, while the planner advises (reads miss): from the first
    /// position not planned yet, as many as it admits (its depth and byte bound, counted from
    /// the consumer's position), whatever `prefetch` says: advice costs the process no memory.
    /// The globals are kept for the chunks that will read them.
    fn plan_ahead(&mut self) {
        let Some(planner) = self.planner.as_mut().filter(|p| p.advising()) else {
            return;
        };
        let mut k = self.submitted + self.ahead.len() as u64;
        // Working out where a record lies reads its index entry, and a cold entry would make
        // the planner wait for the device one entry at a time: the entries of twice the depth
        // of positions from here on are asked for first, so that they arrive together.
        let horizon = k.saturating_add(2 * planner.depth() as u64).min(self.len);
        if self.entries_advised < horizon {
            let pass = &self.pass;
            let from = self.entries_advised.max(k);
            let globals = (from..horizon).map(|p| pass.global(p));
            let last = &mut self.last_entry_page;
            self.entry_requests += self.dataset.advise_entries(globals, last);
            self.entries_advised = horizon;
        }
        while k < self.len && planner.advising() {
            let g = self.pass.global(k);
            let range = self.dataset.record_range(g);
            if !planner.admits(range.as_ref()) {
                break;
            }
            planner.plan(k, range);
            self.ahead.push_back(g);
            k += 1;
        }
        // One call to the backend for what was planned, before any of it is submitted.
        planner.flush();
    }

    /// Submits chunks until `prefetch` samples or `prefetch_bytes` decompressed bytes are ahead
    /// of the consumer, whichever comes first (and always at least one sample). While the
    /// planner advises, the chunks read only planned samples and hold at most `plan_chunk`
    /// of them, so that several are read at once and each one taken frees room for the
    /// planner.
    fn fill(&mut self) -> Result<()> {
        self.foresee();
        self.plan_ahead();
        let mut over_budget = false;
        while !over_budget && self.submitted < self.len {
            let k0 = self.submitted;
            let advising = self.planner.as_ref().is_some_and(ReadPlanner::advising);
            let mut size = if advising {
                self.chunk.min(self.plan_chunk)
            } else {
                self.chunk
            };
            // The pass's first chunk is one block, alone in the window: the first sample waits
            // for these 16 reads only.
            if k0 == 0 {
                size = size.min(CLAIM_BLOCK as u64);
            }
            if self.submitted - self.taken + size > self.prefetch.max(self.chunk) {
                break;
            }
            let mut k1 = (k0 + size).min(self.len);
            if advising {
                // Nothing is read before it is planned: a read past the plan would wait for
                // the device alone.
                k1 = k1.min(k0 + self.ahead.len() as u64);
                if k1 == k0 {
                    break;
                }
            } else if self.ahead.is_empty() {
                // A resting planner probes one sample now and then (the pass's first one before
                // anything is read): a miss wakes it, and this chunk is then planned.
                if let Some(planner) = self.planner.as_mut() {
                    if let Some(k) = planner.probe_due(k0, k1) {
                        planner.probe(k, self.dataset.record_range(self.pass.global(k)));
                        if planner.advising() {
                            self.plan_ahead();
                            continue;
                        }
                    }
                }
            }
            let planned = !self.ahead.is_empty();
            let mut chunk = if planned || self.dataset.may_decompress {
                let mut globals = Vec::with_capacity((k1 - k0) as usize);
                for k in k0..k1 {
                    let g = if planned {
                        match self.ahead.front() {
                            Some(&g) => g,
                            None => break, // the rest of the chunk was not planned
                        }
                    } else {
                        self.pass.global(k)
                    };
                    let cost = self.dataset.decoded_bytes(g);
                    let nothing_ahead = self.submitted == self.taken && globals.is_empty();
                    if !nothing_ahead
                        && self.bytes_in_flight.saturating_add(cost) > self.prefetch_bytes
                    {
                        over_budget = true;
                        break;
                    }
                    if planned {
                        self.ahead.pop_front();
                    }
                    if self.dataset.may_decompress {
                        self.bytes_in_flight += cost;
                        self.costs.push_back(cost);
                    }
                    globals.push(g);
                }
                if globals.is_empty() {
                    break;
                }
                let len = globals.len();
                Chunk::new(ChunkSamples::Globals(globals), len, self.result_blocks())
            } else {
                // Every sample is served from the map and costs no read-ahead bytes.
                let samples = ChunkSamples::Positions {
                    pass: self.pass.clone(),
                    first: k0,
                };
                Chunk::new(samples, (k1 - k0) as usize, self.result_blocks())
            };
            let k1 = k0 + chunk.len as u64;
            chunk.end = k1;
            let chunk = Arc::new(chunk);
            let job = chunk.clone();
            let dataset = self.dataset.clone();
            let hook = self.on_fetched.clone();
            // No result slot: the chunk itself tells when it is complete.
            self.pool.spawn(move || job.work(&dataset, hook.as_ref()))?;
            self.in_flight.push_back(chunk);
            self.submitted = k1;
            if k0 == 0 {
                // Nothing else yet: the rest of the window is submitted once the consumer takes
                // this chunk, so that no other read competes with the first sample's.
                break;
            }
        }
        Ok(())
    }

    /// Empty result blocks for the next chunk: those of a spent chunk that no reading thread
    /// holds any more (a chunk's blocks are all empty once taken), else none. The other spent
    /// chunks that no thread holds are freed here.
    fn result_blocks(&mut self) -> Vec<Mutex<Block>> {
        let mut reused = None;
        while let Some(oldest) = self.spent.pop_front() {
            match Arc::try_unwrap(oldest) {
                Ok(chunk) => {
                    reused.get_or_insert(chunk.results);
                }
                // A thread still holds it (a pool job not run yet, say). Past a bound it is let
                // go: that thread frees it, which costs time, not memory.
                Err(held) if self.spent.len() >= MAX_SPENT => drop(held),
                Err(held) => {
                    self.spent.push_front(held);
                    break;
                }
            }
        }
        reused.unwrap_or_default()
    }

    /// Whether taking the next sample would wait for the pool (the caller then releases the
    /// GIL; a sample already read is handed over without that cost).
    pub fn must_wait(&self) -> bool {
        self.ready.is_empty() && !self.failed && self.taken < self.len
    }

    /// The next sample, waiting for the pool if it is not read yet (call without the GIL when
    /// [`EpochReader::must_wait`]). It counts as handed to the user at once.
    pub fn next_sample(&mut self) -> Option<Result<Fetched>> {
        if self.failed || self.taken >= self.len {
            return None;
        }
        // A forked child shares this pass with its parent and lacks the pool's workers.
        if let Err(e) = self.pool.check_process() {
            self.failed = true;
            return Some(Err(e));
        }
        self.next_in_process()
    }

    /// [`EpochReader::next_sample`] once the process was checked.
    fn next_in_process(&mut self) -> Option<Result<Fetched>> {
        let sample = self.take_one()?;
        Some(sample.and_then(|s| self.hand_out(1).map(|()| s)))
    }

    /// Makes sure a read sample (or its error) is ready, taking the next chunk when none is.
    fn ensure_ready(&mut self) -> Result<()> {
        if !self.ready.is_empty() {
            return Ok(());
        }
        if let Some(e) = self.deferred.take() {
            return Err(e);
        }
        self.fill()?;
        let chunk = self
            .in_flight
            .pop_front()
            .expect("fill submitted the next chunk");
        if self.helping {
            chunk.work(&self.dataset, self.on_fetched.as_ref());
        }
        chunk.take_into(&mut self.ready);
        if let Some(planner) = self.planner.as_mut() {
            planner.release_through(chunk.end);
        }
        self.spent.push_back(chunk);
        recheck_mapped(&self.dataset, &mut self.ready);
        self.checked_at = coarse_now_ns();
        Ok(())
    }

    /// Checks, as a read-ahead sample that is a view of its shard (`cache`, `row`) is handed
    /// out, that its shard was not truncated since its chunk was checked ([`recheck_mapped`]):
    /// one `fstat` when that was more than [`RECHECK_AFTER_NS`] ago, so a loop that takes a chunk
    /// quickly pays nothing and a slow one pays one `fstat` per sample.
    pub fn check_mapped(&self, cache: u32, row: u64) -> Result<()> {
        if coarse_now_ns().saturating_sub(self.checked_at) < RECHECK_AFTER_NS {
            return Ok(());
        }
        let c = &self.dataset.caches[cache as usize];
        let e = c.entry(row);
        c.check_shard_size(e.shard, Some((row, e.offset)))
    }

    /// Takes the next sample without handing it out; an error ends the pass.
    fn take_one(&mut self) -> Option<Result<Fetched>> {
        if self.failed || self.taken >= self.len {
            return None;
        }
        let sample = self
            .ensure_ready()
            .and_then(|()| self.ready.pop_front().expect("a chunk is never empty"));
        let sample = sample.and_then(|s| match s.payload {
            Payload::Mapped { .. } => self.check_mapped(s.cache, s.row).map(|()| s),
            Payload::Owned(_) => Ok(s),
        });
        match sample {
            Ok(s) => {
                self.taken += 1;
                Some(Ok(s))
            }
            Err(e) => {
                self.failed = true;
                Some(Err(e))
            }
        }
    }

    /// The samples of the next chunk that are read, all at once (waiting for the pool if none
    /// is; call without the GIL when [`EpochReader::must_wait`]), for a consumer that builds
    /// their objects in bulk and gives them to its user one at a time. They count as handed to
    /// the user only as the consumer reports each with [`EpochReader::hand_out`], so
    /// [`EpochReader::position`] stays exact. A corrupt sample ends the chunk before it and
    /// is the error of the next call, so the samples before it are handed out first. One fork
    /// check per chunk, not per sample.
    pub fn next_chunk(&mut self) -> Option<Result<Vec<Fetched>>> {
        if self.failed || self.taken >= self.len {
            return None;
        }
        if let Err(e) = self.pool.check_process() {
            self.failed = true;
            return Some(Err(e));
        }
        if let Err(e) = self.ensure_ready() {
            self.failed = true;
            return Some(Err(e));
        }
        let mut samples = Vec::with_capacity(self.ready.len());
        while let Some(sample) = self.ready.pop_front() {
            match sample {
                Ok(s) => samples.push(s),
                Err(e) if samples.is_empty() => {
                    self.failed = true;
                    return Some(Err(e));
                }
                Err(e) => {
                    self.ready.push_front(Err(e));
                    break;
                }
            }
        }
        self.taken += samples.len() as u64;
        // The window moved: the workers read on while the consumer builds these samples.
        self.refill();
        Some(Ok(samples))
    }

    /// Reports `n` more samples taken by [`EpochReader::next_chunk`] as handed to the user:
    /// they count in [`EpochReader::position`] from now on. In a forked child it hands out
    /// nothing and errors (and the pass ends there): the pass belongs to the parent. Until the
    /// process forks, that check is one atomic load, no system call.
    ///
    /// # Panics
    /// When more samples are handed out than were taken (a bug in the consumer).
    pub fn hand_out(&mut self, n: u64) -> Result<()> {
        if let Err(e) = self.pool.check_process() {
            self.failed = true;
            return Err(e);
        }
        assert!(
            self.yielded + n <= self.taken,
            "handing out {n} samples with only {} taken and not handed out",
            self.taken - self.yielded
        );
        self.yielded += n;
        if self.dataset.may_decompress {
            for _ in 0..n {
                self.bytes_in_flight -= self
                    .costs
                    .pop_front()
                    .expect("one cost per submitted sample");
            }
        }
        // Bytes handed out may make room under the byte budget.
        self.refill();
        Ok(())
    }

    /// Tops up the window; an error (a closed runtime, a forked child) is reported when the
    /// consumer next needs a chunk, after the samples already read.
    fn refill(&mut self) {
        if self.deferred.is_none() && !self.failed {
            if let Err(e) = self.fill() {
                self.deferred = Some(e);
            }
        }
    }

    /// The next `max` samples (fewer at the end of the pass), waiting for the pool as needed;
    /// `None` once the pass is over. Call without the GIL. An error ends the pass: the samples
    /// read before it in this batch are not returned, so a state taken at the batch's start
    /// resumes at its first sample.
    pub fn next_batch(&mut self, max: usize) -> Option<Result<Vec<Fetched>>> {
        if self.failed || self.taken >= self.len {
            return None;
        }
        // One fork check per batch rather than per sample (it is a system call).
        if let Err(e) = self.pool.check_process() {
            self.failed = true;
            return Some(Err(e));
        }
        let n = (self.len - self.taken).min(max.max(1) as u64) as usize;
        let mut batch = Vec::with_capacity(n);
        while batch.len() < n {
            if let Err(e) = self.ensure_ready() {
                self.failed = true;
                return Some(Err(e));
            }
            // What is ready, up to the batch's end: a chunk's samples move over in one run.
            let run = self.ready.len().min(n - batch.len());
            for sample in self.ready.drain(..run) {
                match sample {
                    Ok(sample) => batch.push(sample),
                    Err(e) => {
                        self.failed = true;
                        return Some(Err(e));
                    }
                }
            }
            self.taken += run as u64;
        }
        Some(self.hand_out(n as u64).map(|()| batch))
    }
}

//! A dataset: the loaded caches in source order, their weights, epoch orders and iterator state.

use std::borrow::Cow;
use std::collections::{HashMap, VecDeque};
use std::os::fd::BorrowedFd;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, OnceLock};

use serde::{Deserialize, Serialize};

use crate::cache::Cache;
use crate::error::{Error, Result};
use crate::format::{SampleIdSource, FLAG_LZ4};
use crate::metadata::MetaRef;
use crate::pool::{panic_message, Pool};
use crate::sampler::{
    EpochOrder, EpochParams, RankPolicy, RankSplit, Weights, MAX_EPOCH_LEN, SAMPLER_VERSION,
};
use crate::verify::{VerifiedSet, VerifyPolicy};

pub const STATE_VERSION: u32 = 1;

/// The default bound on decompressed bytes an [`EpochReader`] holds ahead of its consumer.
pub const DEFAULT_PREFETCH_BYTES: u64 = 64 << 20;

/// Reading options that decide the order and the split.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReadOptions {
    pub seed: u64,
    pub shuffle: bool,
    pub prefetch_size: usize,
    /// Samples per epoch (before the rank split); `None` = the number of samples.
    pub epoch_len: Option<u64>,
    pub rank: u64,
    pub world_size: u64,
    pub policy: RankPolicy,
}

impl ReadOptions {
    pub fn validate(&self) -> Result<()> {
        if self.prefetch_size == 0 {
            return Err(Error::config(
                "ReaderConfig.prefetch_size",
                "must be at least 1",
            ));
        }
        if self.world_size == 0 {
            return Err(Error::config(
                "ReaderConfig.world_size",
                "must be at least 1",
            ));
        }
        if let Some(len) = self.epoch_len.filter(|&l| l > MAX_EPOCH_LEN) {
            return Err(Error::config(
                "ReaderConfig.samples_per_epoch",
                format!("{len} is above the limit of 2**40 = {MAX_EPOCH_LEN}"),
            ));
        }
        if self.rank >= self.world_size {
            return Err(Error::config(
                "ReaderConfig.rank",
                format!(
                    "rank {} is not below world_size {}",
                    self.rank, self.world_size
                ),
            ));
        }
        Ok(())
    }

    pub fn split(&self) -> RankSplit {
        RankSplit {
            rank: self.rank,
            world_size: self.world_size,
            policy: self.policy,
        }
    }
}

/// The iterator state: plain data, serialised as JSON by the bindings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct State {
    pub format_version: u32,
    /// The [`SAMPLER_VERSION`] whose order `position` points into. `None`: the state predates
    /// this field (it was taken under version 2), and is refused with that explanation.
    #[serde(default)]
    pub sampler_version: Option<u32>,
    /// Identifies the caches (their content fingerprints, in order).
    pub fingerprint: String,
    /// Identifies the weight table ("uniform" when every weight is equal to every other).
    pub weights_fingerprint: String,
    pub seed: u64,
    pub shuffle: bool,
    pub epoch_len: u64,
    pub epoch: u64,
    /// Global position in the epoch's order reached by all ranks together.
    pub position: u64,
    pub rank: u64,
    pub world_size: u64,
}

impl State {
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).expect("plain data serialises")
    }

    /// Parses a state. Only a JSON object is a state: serde would also take the values as
    /// an array, in field order, which no `state_dict()` produces.
    pub fn from_json(text: &str) -> Result<State> {
        let not_a_state = |e: serde_json::Error| {
            Error::State(format!(
                "not a DatasetRT iterator state: {e}; pass the dict that state_dict() returned"
            ))
        };
        let kind = match serde_json::from_str(text).map_err(not_a_state)? {
            value @ serde_json::Value::Object(_) => {
                return serde_json::from_value(value).map_err(not_a_state)
            }
            serde_json::Value::Null => "null",
            serde_json::Value::Bool(_) => "a boolean",
            serde_json::Value::Number(_) => "a number",
            serde_json::Value::String(_) => "a string",
            serde_json::Value::Array(_) => "a list",
        };
        Err(Error::State(format!(
            "not a DatasetRT iterator state: a state is a JSON object (a dict), this is {kind}; \
             pass the dict that state_dict() returned"
        )))
    }
}

/// The last epoch. `u64::MAX` is never an epoch: a state naming it is refused, and the epoch
/// after `LAST_EPOCH` is an error rather than a wrap to epoch 0 (which would replay epoch 0's
/// order under the name of a new epoch).
pub const LAST_EPOCH: u64 = u64::MAX - 1;

/// The epoch after `epoch`: the one place where an epoch advances.
pub fn next_epoch(epoch: u64) -> Result<u64> {
    if epoch >= LAST_EPOCH {
        return Err(Error::State(format!(
            "epoch {epoch} is the last epoch there is (2**64 - 2), no epoch follows it: call \
             set_epoch to choose the epoch of the next pass"
        )));
    }
    Ok(epoch + 1)
}

/// Where a pass of `epoch` leaves the iterator, as (epoch, global position): the position it
/// reached, or the start of the next epoch once it `finished` (every sample of this rank was
/// received).
pub fn resume_point(epoch: u64, position: u64, finished: bool) -> Result<(u64, u64)> {
    if finished {
        Ok((next_epoch(epoch)?, 0))
    } else {
        Ok((epoch, position))
    }
}

/// A sample's payload: a range of a shard (served without a copy) or decompressed bytes.
pub enum Payload {
    Mapped { shard: u32, offset: u64, len: u64 },
    Owned(Vec<u8>),
}

pub struct Fetched {
    pub cache: u32,
    pub row: u64,
    pub payload: Payload,
}

type IdIndex = HashMap<u128, u64>;

pub struct Dataset {
    pub caches: Vec<Arc<Cache>>,
    /// Global index of each cache's first sample, plus the total at the end.
    starts: Vec<u64>,
    fingerprint: String,
    id_indexes: Vec<OnceLock<IdIndex>>,
    verify: Verifier,
    /// Whether any cache may hold compressed records; if none does, every sample is served from
    /// the map and costs no read-ahead bytes.
    may_decompress: bool,
}

/// A [`VerifyPolicy`] with what it needs: under `Once`, the samples already verified.
enum Verifier {
    Always,
    Once(VerifiedSet),
    Never,
}

/// The weights in force: shared by readers that started under them.
#[derive(Clone)]
pub struct WeightTable {
    pub weights: Option<Arc<Vec<f64>>>,
    pub fingerprint: String,
}

impl WeightTable {
    pub fn uniform() -> Self {
        WeightTable {
            weights: None,
            fingerprint: "uniform".into(),
        }
    }

    /// Weights all equal to each other are the uniform table (the exact integer scheme).
    pub fn from_weights(w: Vec<f64>) -> Self {
        if w.windows(2).all(|p| p[0] == p[1]) {
            return Self::uniform();
        }
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for x in &w {
            h.update(&x.to_le_bytes());
        }
        WeightTable {
            weights: Some(Arc::new(w)),
            fingerprint: format!("{:032x}", h.digest128()),
        }
    }

    pub fn weight(&self, i: u64) -> f64 {
        self.weights.as_ref().map_or(1.0, |w| w[i as usize])
    }
}

fn hash_id(id: MetaRef<'_>) -> u128 {
    match id {
        MetaRef::Int(v) => u128::from(v as u64) | (1u128 << 64),
        MetaRef::Str(s) => xxhash_rust::xxh3::xxh3_128(s.as_bytes()),
        _ => unreachable!("sample ids are int or str"),
    }
}

impl Dataset {
    pub fn new(caches: Vec<Arc<Cache>>) -> Self {
        let mut starts = Vec::with_capacity(caches.len() + 1);
        let mut total = 0u64;
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        for c in &caches {
            starts.push(total);
            total += c.len();
            h.update(c.manifest.fingerprint.as_bytes());
            h.update(b"\n");
        }
        starts.push(total);
        let id_indexes = caches.iter().map(|_| OnceLock::new()).collect();
        let may_decompress = caches.iter().any(|c| c.may_hold_compressed());
        Dataset {
            caches,
            starts,
            fingerprint: format!("{:032x}", h.digest128()),
            may_decompress,
            id_indexes,
            verify: Verifier::Always,
        }
    }

    /// Reads under `policy` ([`Dataset::new`] reads under [`VerifyPolicy::Always`]; the default
    /// of `ReaderConfig` is `Once`). Under `Once` the dataset keeps one bit per sample, shared by
    /// all its readers: a sample whose record passed its checksum is not hashed again by this
    /// dataset. The bits live in a memfd ([`VerifiedSet::shared`]) that the loader hands to its
    /// producers, so what they verify counts here too and the other way round; where no memfd
    /// can be had they live in the heap, and producers keep their own.
    pub fn with_verify(mut self, policy: VerifyPolicy) -> Self {
        self.verify = match policy {
            VerifyPolicy::Always => Verifier::Always,
            VerifyPolicy::Once => Verifier::Once(
                VerifiedSet::shared(self.len()).unwrap_or_else(|_| VerifiedSet::new(self.len())),
            ),
            VerifyPolicy::Never => Verifier::Never,
        };
        self
    }

    /// Reads under `Once` with `set`, the training process's set that a producer attached to
    /// ([`VerifiedSet::attach`]). A bit is a global sample number, the position of the sample
    /// in the caches taken in order: the set must be the one of a dataset of the same caches
    /// in the same order (the caller checks the fingerprint), so its length must be this one's.
    pub fn with_verified_set(mut self, set: VerifiedSet) -> Result<Self> {
        if set.len() != self.len() {
            return Err(Error::State(format!(
                "the verified-samples set covers {} samples, this dataset has {}: it belongs \
                 to another dataset",
                set.len(),
                self.len()
            )));
        }
        self.verify = Verifier::Once(set);
        Ok(self)
    }

    /// Under `Once`, the memfd of the verified set that a producer may attach to (`None` under
    /// other policies, when the set is not shared, and outside the process that created it).
    pub fn shared_verified_fd(&self) -> Option<BorrowedFd<'_>> {
        match &self.verify {
            Verifier::Once(set) => set.shared_fd(),
            _ => None,
        }
    }

    pub fn verify_policy(&self) -> VerifyPolicy {
        match self.verify {
            Verifier::Always => VerifyPolicy::Always,
            Verifier::Once(_) => VerifyPolicy::Once,
            Verifier::Never => VerifyPolicy::Never,
        }
    }

    /// Samples whose records this dataset verified under `Once`, here or in a producer sharing
    /// its set (`None` under other policies).
    pub fn verified_count(&self) -> Option<u64> {
        match &self.verify {
            Verifier::Once(set) => Some(set.count()),
            _ => None,
        }
    }

    pub fn len(&self) -> u64 {
        *self.starts.last().unwrap()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn fingerprint(&self) -> &str {
        &self.fingerprint
    }

    pub fn cache_start(&self, cache: usize) -> u64 {
        self.starts[cache]
    }

    /// (cache, row) of a global sample index.
    pub fn locate(&self, global: u64) -> (usize, u64) {
        let c = self.starts.partition_point(|&s| s <= global) - 1;
        (c, global - self.starts[c])
    }

    /// The row of the sample with this id in cache `c`, if any; an error when the cache's
    /// metadata table, which holds the ids the user gave, is damaged.
    pub fn find_sample(&self, c: usize, id: MetaRef<'_>) -> Result<Option<u64>> {
        let cache = &self.caches[c];
        if cache.manifest.sample_id == SampleIdSource::Position {
            return Ok(match id {
                MetaRef::Int(v) if v >= 0 && (v as u64) < cache.len() => Some(v as u64),
                _ => None,
            });
        }
        if !matches!(id, MetaRef::Int(_) | MetaRef::Str(_)) {
            return Ok(None);
        }
        let table = cache.metadata()?;
        let index = self.id_indexes[c].get_or_init(|| {
            (0..cache.len())
                .map(|row| (hash_id(table.sample_id(row)), row))
                .collect()
        });
        // A hash hit is confirmed against the stored id, so a collision cannot misattribute.
        Ok(index
            .get(&hash_id(id))
            .copied()
            .filter(|&row| table.sample_id(row) == id))
    }

    pub fn epoch_len(&self, opts: &ReadOptions) -> u64 {
        opts.epoch_len.unwrap_or_else(|| self.len())
    }

    /// This rank's samples in a full epoch.
    pub fn rank_len(&self, opts: &ReadOptions) -> u64 {
        opts.split().rank_len(self.epoch_len(opts), 0)
    }

    /// The epoch's order, computed position by position. Uniform weights: constant memory and
    /// no set-up; weights: 8 bytes per sample, or [`Error::OutOfMemory`] when those cannot be had.
    pub fn try_order(
        &self,
        opts: &ReadOptions,
        weights: &WeightTable,
        epoch: u64,
    ) -> Result<EpochOrder> {
        let params = EpochParams {
            seed: opts.seed,
            epoch,
            epoch_len: self.epoch_len(opts),
            shuffle: opts.shuffle,
        };
        match &weights.weights {
            None => EpochOrder::new(params, Weights::Uniform(self.len())),
            Some(w) => EpochOrder::new(params, Weights::Weighted(w)),
        }
    }

    /// Checks a state against this dataset and these options; returns (epoch, global position).
    pub fn check_state(
        &self,
        state: &State,
        opts: &ReadOptions,
        weights: &WeightTable,
    ) -> Result<(u64, u64)> {
        if state.format_version != STATE_VERSION {
            return Err(Error::State(format!(
                "state format version {} is not {STATE_VERSION}",
                state.format_version
            )));
        }
        let taken_under = match state.sampler_version {
            Some(v) if v == SAMPLER_VERSION => None,
            Some(v) => Some(format!("was taken under sampler_version {v}")),
            None => Some(
                "names no sampler_version: an earlier DatasetRT took it, under sampler_version 2"
                    .to_owned(),
            ),
        };
        if let Some(taken_under) = taken_under {
            return Err(Error::State(format!(
                "the state {taken_under}, and this DatasetRT computes epoch orders with \
                 sampler_version {SAMPLER_VERSION}: its position points into an order this \
                 version does not produce, so it cannot be resumed exactly. Call set_epoch to \
                 start an epoch afresh, or resume it with the DatasetRT release that took it"
            )));
        }
        if state.world_size == 0 {
            return Err(Error::State(
                "world_size 0 is not a world size (a state is taken by one of at least 1 \
                 ranks): the state is damaged or was not made by state_dict(); load the dict \
                 that state_dict() returned"
                    .into(),
            ));
        }
        if state.rank >= state.world_size {
            return Err(Error::State(format!(
                "rank {} is not below world_size {}: no rank of that world took this state; it \
                 is damaged or was not made by state_dict(); load the dict that state_dict() \
                 returned",
                state.rank, state.world_size
            )));
        }
        if state.epoch > LAST_EPOCH {
            return Err(Error::State(format!(
                "epoch {} is not an epoch (the last one is 2**64 - 2 = {LAST_EPOCH}): the state \
                 is damaged or was not made by state_dict(); load the dict that state_dict() \
                 returned, or call set_epoch instead",
                state.epoch
            )));
        }
        if state.fingerprint != self.fingerprint {
            return Err(Error::State(format!(
                "the state belongs to another dataset (fingerprint {}, this dataset is {}): \
                 load it into a dataset built from the same caches in the same order",
                state.fingerprint, self.fingerprint
            )));
        }
        if state.weights_fingerprint != weights.fingerprint {
            return Err(Error::State(format!(
                "the state was taken under another weight table ({}, now {}): apply the same \
                 samples metadata with set_samples_metadata before loading it",
                state.weights_fingerprint, weights.fingerprint
            )));
        }
        let epoch_len = self.epoch_len(opts);
        if state.seed != opts.seed || state.shuffle != opts.shuffle || state.epoch_len != epoch_len
        {
            return Err(Error::State(format!(
                "the state was taken with seed={} shuffle={} epoch_len={}, this reader has \
                 seed={} shuffle={} epoch_len={}",
                state.seed, state.shuffle, state.epoch_len, opts.seed, opts.shuffle, epoch_len
            )));
        }
        if state.position > epoch_len {
            return Err(Error::State(format!(
                "position {} is past the epoch length {epoch_len}",
                state.position
            )));
        }
        Ok((state.epoch, state.position))
    }

    pub fn state(
        &self,
        opts: &ReadOptions,
        weights: &WeightTable,
        epoch: u64,
        position: u64,
    ) -> State {
        self.state_under(opts, &weights.fingerprint, epoch, position)
    }

    /// The state of a pass read under the weight table `weights_fingerprint`, which need not
    /// be the table in force now: a pass keeps the weights it started with.
    pub fn state_under(
        &self,
        opts: &ReadOptions,
        weights_fingerprint: &str,
        epoch: u64,
        position: u64,
    ) -> State {
        State {
            format_version: STATE_VERSION,
            sampler_version: Some(SAMPLER_VERSION),
            fingerprint: self.fingerprint.clone(),
            weights_fingerprint: weights_fingerprint.to_owned(),
            seed: opts.seed,
            shuffle: opts.shuffle,
            epoch_len: self.epoch_len(opts),
            epoch,
            position,
            rank: opts.rank,
            world_size: opts.world_size,
        }
    }

    /// The bytes `fetch` allocates for sample `global`: its decompressed size when it is stored
    /// compressed, 0 when it is served from the map. Read from the index entry, which nothing
    /// has checked yet: it only budgets the read-ahead (which always admits one sample, so a
    /// forged size cannot stall it), and `fetch` refuses a record whose header disagrees with
    /// its entry, and decompresses into at most this many bytes.
    pub fn decoded_bytes(&self, global: u64) -> u64 {
        if !self.may_decompress {
            return 0; // without a look at the index: a shuffled read's entry is a memory miss
        }
        let (c, row) = self.locate(global);
        let e = self.caches[c].entry(row);
        if e.flags & FLAG_LZ4 != 0 {
            u64::from(e.raw_len)
        } else {
            0
        }
    }

    /// The bytes of a fetched sample: borrowed from its shard's map when it is stored raw,
    /// the decompressed bytes otherwise.
    pub fn fetched_data(&self, fetched: Fetched) -> Cow<'_, [u8]> {
        match fetched.payload {
            Payload::Mapped { shard, offset, len } => {
                Cow::Borrowed(self.caches[fetched.cache as usize].mapped(shard, offset, len))
            }
            Payload::Owned(bytes) => Cow::Owned(bytes),
        }
    }

    /// Asks the CPU to bring in what reading sample `global` touches first, without waiting for
    /// it: its index entry when [`Dataset::fetch`] will serve it from there, else its record's
    /// header.
    pub fn prefetch_record(&self, global: u64) {
        let (c, row) = self.locate(global);
        let cache = &self.caches[c];
        if self.is_trusted(global) && cache.serves_from_index() {
            cache.prefetch_entry(row);
        } else {
            cache.prefetch_record(row);
        }
    }

    /// Under `Once`, whether sample `global`'s record was verified already (by this dataset or a
    /// producer sharing its set).
    fn is_trusted(&self, global: u64) -> bool {
        matches!(&self.verify, Verifier::Once(verified) if verified.contains(global))
    }

    /// Checks (under the verification policy) and, when compressed, decompresses one sample.
    /// Under `Once`, a record verified before is served from its index entry when the cache's
    /// format allows it ([`Cache::trusted_record`]): its header was checked against that entry
    /// when it was verified, so the record itself is not read again until its payload is.
    pub fn fetch(&self, global: u64) -> Result<Fetched> {
        let (c, row) = self.locate(global);
        let cache = &self.caches[c];
        let trusted = self.is_trusted(global);
        let checksum = match &self.verify {
            Verifier::Always => true,
            Verifier::Once(_) => !trusted,
            Verifier::Never => false,
        };
        let from_index = if trusted {
            cache.trusted_record(row)
        } else {
            None
        };
        let (entry, header, payload_start) = match from_index {
            Some(checked) => checked?,
            None => cache.check_record(row, checksum)?,
        };
        if let (true, Verifier::Once(verified)) = (checksum, &self.verify) {
            // Only now: a record is never marked before its checksum matched.
            verified.mark(global);
        }
        let payload = if header.flags & FLAG_LZ4 != 0 {
            Payload::Owned(
                cache
                    .decode_payload(row, &entry, &header, payload_start)?
                    .into_owned(),
            )
        } else {
            Payload::Mapped {
                shard: entry.shard,
                offset: payload_start,
                len: u64::from(header.stored_len),
            }
        };
        Ok(Fetched {
            cache: c as u32,
            row,
            payload,
        })
    }
}

/// The shards whose files were checked against their validated sizes
/// ([`Cache::check_shard_size`]) for one block or chunk of samples: one `fstat` per shard it
/// reads, not one per sample. Up to `N` shards are remembered (a fixed array: the reading threads
/// allocate nothing); a shard beyond them is checked at each of its samples.
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
    fn check(&mut self, dataset: &Dataset, c: usize, row: u64) -> Result<()> {
        let cache = &dataset.caches[c];
        let shard = cache.entry(row).shard;
        if shard as usize >= cache.num_shards() {
            return Ok(());
        }
        self.check_shard(dataset, c, shard, row)
    }

    /// Checks shard `shard` of cache `c`, where sample `row`'s record lies.
    fn check_shard(&mut self, dataset: &Dataset, c: usize, shard: u32, row: u64) -> Result<()> {
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
        self.order
            .at(self.split.global_position(self.epoch_len, self.start, k))
    }
}

/// The samples of one pool job. Workers and, when it helps, the consumer claim them a block at a
/// time, so a consumer that needs the chunk never sleeps until a worker is scheduled for it.
struct Chunk {
    samples: ChunkSamples,
    len: usize,
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
            deferred: None,
        }
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

    /// Submits chunks until `prefetch` samples or `prefetch_bytes` decompressed bytes are ahead
    /// of the consumer, whichever comes first (and always at least one sample).
    fn fill(&mut self) -> Result<()> {
        let mut over_budget = false;
        while !over_budget
            && self.submitted < self.len
            && self.submitted - self.taken + self.chunk <= self.prefetch.max(self.chunk)
        {
            let k0 = self.submitted;
            // The pass's first chunk is one block, alone in the window: the first sample waits
            // for these 16 reads only.
            let size = if k0 == 0 {
                self.chunk.min(CLAIM_BLOCK as u64)
            } else {
                self.chunk
            };
            let k1 = (k0 + size).min(self.len);
            let chunk = if self.dataset.may_decompress {
                let mut globals = Vec::with_capacity((k1 - k0) as usize);
                for k in k0..k1 {
                    let g = self.pass.global(k);
                    let cost = self.dataset.decoded_bytes(g);
                    let nothing_ahead = self.submitted == self.taken && globals.is_empty();
                    if !nothing_ahead
                        && self.bytes_in_flight.saturating_add(cost) > self.prefetch_bytes
                    {
                        over_budget = true;
                        break;
                    }
                    self.bytes_in_flight += cost;
                    self.costs.push_back(cost);
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

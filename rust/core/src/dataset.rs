//! A dataset: the loaded caches in source order, their weights, epoch orders and iterator state.
//!
//! `state` holds the options and the iterator state, `reader` the read-ahead of an epoch,
//! `planner` the read planner it consults (with its backend trait) and `local_files` the
//! planner's backend for local files; their items are re-exported here.

use std::borrow::Cow;
use std::collections::HashMap;
use std::os::fd::BorrowedFd;
use std::sync::{Arc, OnceLock};

use crate::cache::Cache;
use crate::error::{Error, Result};
use crate::format::{combined_fingerprint, SampleIdSource, FLAG_LZ4};
use crate::metadata::MetaRef;
use crate::sampler::{EpochOrder, EpochParams, Weights, SAMPLER_VERSION};
use crate::verify::{VerifiedSet, VerifyPolicy};
use per_cache::PerCache;

mod layout;
mod local_files;
mod per_cache;
mod planner;
mod reader;
mod state;

pub use layout::BatchLayout;
pub use local_files::{io_path, IoPath, LocalFiles, WillNeed, DEFAULT_IO_PATH, IO_ENV};
pub use planner::{
    PlannerStats, Range, RangeSource, ReadPlanner, RecordBytes, RecordSource, FIRST_PROBE_INTERVAL,
    MAX_PROBE_INTERVAL, REST_AFTER,
};
pub use reader::{
    CheckedShards, EpochReader, FetchHook, DEFAULT_PREFETCH_BYTES, MAPPED_READ_AHEAD,
};
pub use state::{
    next_epoch, resume_point, ReadOptions, State, DEFAULT_IO_DEPTH, DEFAULT_READ_AHEAD_BYTES,
    LAST_EPOCH, MAX_IO_DEPTH, MAX_PREFETCH_SIZE, MAX_READ_AHEAD_BYTES, STATE_VERSION,
};

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
    /// Checks, as a pass begins, that no cache's `index.bin` is shorter than when it was
    /// opened ([`Cache::check_index_size`]): one `fstat` per cache.
    pub fn check_index_sizes(&self) -> Result<()> {
        self.caches.iter().try_for_each(|c| c.check_index_size())
    }

    /// Checks that `caches` make one dataset read with `opts`: their names are unique (a
    /// sample is identified by its cache's name; a set's parts are named after it, but a cache
    /// may still carry a part's name), and a fixed number of samples per epoch has samples to
    /// draw from.
    pub fn check_caches(caches: &[Arc<Cache>], opts: &ReadOptions) -> Result<()> {
        let total: u64 = caches.iter().map(|c| c.len()).sum();
        if let Some(per_epoch) = opts.epoch_len.filter(|&l| l > 0 && total == 0) {
            return Err(Error::config(
                "ReaderConfig.samples_per_epoch",
                format!("{per_epoch} samples per epoch, but the loaded caches hold no samples"),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        if let Some(c) = caches.iter().find(|c| !seen.insert(c.name())) {
            return Err(Error::config(
                "dataset",
                format!(
                    "two caches of this dataset are named {:?} ({} and another): a sample is \
                     identified by its cache's name, so names must be unique; nothing was opened",
                    c.name(),
                    c.dir.display()
                ),
            ));
        }
        Ok(())
    }

    pub fn new(caches: Vec<Arc<Cache>>) -> Self {
        let mut starts = Vec::with_capacity(caches.len() + 1);
        let mut total = 0u64;
        for c in &caches {
            starts.push(total);
            total += c.len();
        }
        starts.push(total);
        let fingerprint =
            combined_fingerprint(caches.iter().map(|c| c.manifest.fingerprint.as_str()));
        let id_indexes = caches.iter().map(|_| OnceLock::new()).collect();
        // A fetched cache's payloads are copies too: they count like decompressed ones.
        let may_decompress = caches
            .iter()
            .any(|c| c.may_hold_compressed() || c.is_fetched());
        Dataset {
            caches,
            starts,
            fingerprint,
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

    /// Checks, for samples read ahead and about to be handed out (a loader's batch, by global
    /// index, in order), that the shards their records lie in still have their validated sizes:
    /// one `fstat` per shard, however many of the samples it holds. A shard found shorter is
    /// `CorruptRecord` naming it and the first of `globals` whose record lies in it, so that
    /// the bytes of a truncated shard (zeros in its last page, `SIGBUS` past it) are never
    /// handed out. An index out of range is left to the caller, which refuses it.
    pub fn check_shards_of(&self, globals: &[u64]) -> Result<()> {
        self.check_record_shards(globals.iter().filter(|&&g| g < self.len()).map(|&g| {
            let (c, row) = self.locate(g);
            (c as u32, self.caches[c].entry(row).shard, row)
        }))
    }

    /// [`Dataset::check_shards_of`] for records whose shards are known, as (cache, shard, row)
    /// in order (a loader's slot entries): no index lookup. A record that names no cache or
    /// shard of the dataset is left to the caller, which refuses it.
    pub fn check_record_shards(
        &self,
        records: impl IntoIterator<Item = (u32, u32, u64)>,
    ) -> Result<()> {
        let mut checked = CheckedShards::<64>::default();
        for (c, shard, row) in records {
            let c = c as usize;
            let known = self
                .caches
                .get(c)
                .is_some_and(|cache| (shard as usize) < cache.num_shards());
            if known {
                checked.check_shard(self, c, shard, row)?;
            }
        }
        Ok(())
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
        if self.caches[c].is_fetched() {
            return u64::from(e.raw_len); // copied out of the fetched record, compressed or not
        }
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

    /// Where the record of sample `global` lies, from its index entry (unchecked: a hint for
    /// the read planner, clamped to its shard's map): `None` when the entry names no shard, or
    /// an offset past its end. Before format v3 the entry lacks the metadata's length, and a
    /// page is assumed for it.
    pub fn record_range(&self, global: u64) -> Option<Range> {
        let (c, row) = self.locate(global);
        let (shard, offset, len) = self.caches[c].record_extent(row)?;
        Some(Range {
            cache: c as u32,
            shard,
            offset,
            len,
        })
    }

    /// Asks the kernel to start reading the index pages that hold the entries of `globals`
    /// ([`Cache::advise_entry`]), one request per page in a row: what the read planner does
    /// ahead of the records it is about to plan, whose ranges it works out from those entries.
    /// `last` is the (cache, page) asked for last, kept from call to call. Returns the requests
    /// made.
    pub fn advise_entries(
        &self,
        globals: impl IntoIterator<Item = u64>,
        last: &mut Option<(usize, u64)>,
    ) -> u64 {
        let mut asked = 0;
        for g in globals {
            let (c, row) = self.locate(g);
            let same = last.filter(|(lc, _)| *lc == c).map(|(_, page)| page);
            if let Some((page, advised)) = self.caches[c].advise_entry(row, same) {
                asked += u64::from(advised);
                *last = Some((c, page));
            }
        }
        asked
    }

    /// The read planner for a pass over this dataset under `opts`, on the path [`io_path`]
    /// chose: `None` on the plain path.
    /// A dataset with a fetched cache (object storage) always has one: its records are fetched
    /// ahead whatever the local path is.
    pub fn planner(&self, opts: &ReadOptions) -> Option<ReadPlanner> {
        let local = match io_path() {
            IoPath::Advise { how, random } => {
                Some(LocalFiles::new(self.caches.clone(), how, random))
            }
            IoPath::Plain => None,
        };
        let source: Arc<dyn RangeSource> = if self.caches.iter().any(|c| c.is_fetched()) {
            Arc::new(PerCache::new(&self.caches, local))
        } else {
            Arc::new(local?)
        };
        Some(ReadPlanner::new(
            source,
            opts.io_depth,
            opts.read_ahead_bytes,
        ))
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

    /// [`Dataset::fetch`] of a sample of a fetched cache (object storage): its record's bytes
    /// come from the cache's record source (which verified their checksum as they arrived),
    /// are checked against the index entry (and the checksum again under the policy), and its
    /// payload is copied out. Bytes that fail are discarded from the source.
    fn fetch_copied(&self, global: u64, c: usize, row: u64, checksum: bool) -> Result<Fetched> {
        let cache = &self.caches[c];
        let Some((bytes, base)) = cache.fetch_record(row)? else {
            unreachable!("a fetched cache has a record source");
        };
        let bytes = (*bytes).as_ref();
        let checked = cache.check_fetched(row, bytes, base, checksum);
        let (entry, header, start) = match checked {
            Ok(checked) => checked,
            Err(e) => {
                if let (Some(records), Some(range)) = (cache.records(), self.record_range(global)) {
                    records.discard(&range);
                }
                return Err(e);
            }
        };
        if let (true, Verifier::Once(verified)) = (checksum, &self.verify) {
            verified.mark(global);
        }
        let from = (start - base) as usize;
        let stored = &bytes[from..from + header.stored_len as usize];
        let payload = cache
            .decode_stored(row, &entry, &header, stored)?
            .into_owned();
        Ok(Fetched {
            cache: c as u32,
            row,
            payload: Payload::Owned(payload),
        })
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
        if cache.is_fetched() {
            return self.fetch_copied(global, c, row, checksum);
        }
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

//! Writing a cache: validation of every sample, encoding on the pool, ordered commit into shards,
//! and atomic publication of the finished directory.
//!
//! The caller (the Python source's thread) pushes samples; they are grouped into small batches
//! that pool workers encode (LZ4 under the ratio rule, record checksum) in parallel. Encoded
//! batches are committed in order by whichever worker finishes the next one ("combining": no
//! worker ever waits for another). At most `prefetch_size` samples are between push and commit,
//! so memory stays flat for a source of any length.
//!
//! `writer::lock` holds the name rules, the lock and the leftovers, `writer::records` the
//! encoding and the ordered commit into shards, `writer::validate` the checks of each sample
//! against the schema; this file drives a write from the first push to the publication.

use std::collections::BTreeMap;
use std::fs::{self, File};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use ahash::AHashSet;

use crate::cache::{Cache, Validation};
use crate::error::{Error, IoContext, Result};
use crate::format::*;
use crate::hashed_file::{create_file, finish_file, make_read_only};
use crate::metadata::{Field, FieldType, MetaValue, MetadataWriter, RecordMetadataJson};
use crate::pool::Pool;

mod lock;
mod records;
mod validate;

use lock::{sync_dir, tmp_dir_name};
use records::{encode, CommitState, Shared, Sink};
use validate::{place, KeySlots};

pub use lock::{
    check_base_dir, reap_dead_leftovers, validate_name, validate_names, CacheLock, Claim,
    MAX_NAME_BYTES,
};

/// Default target size of one shard file.
pub const DEFAULT_SHARD_SIZE: u64 = 256 << 20;
/// A batch handed to one worker closes at this many payload bytes or samples.
const BATCH_BYTES: usize = 1 << 20;
const BATCH_SAMPLES: usize = 256;
/// ... or once its first sample has waited this long for more: a slow source's samples are
/// committed (and its progress shown) within a second, not after `prefetch_size` of them. What
/// is written does not depend on where batches end.
const BATCH_LINGER: Duration = Duration::from_millis(500);

#[derive(Clone, Copy, Debug)]
pub struct WriterOptions {
    pub prefetch_size: usize,
    pub compression: Compression,
    pub validate: bool,
    pub shard_size: u64,
}

impl WriterOptions {
    pub fn validate(&self) -> Result<()> {
        if self.prefetch_size == 0 {
            return Err(Error::config(
                "WriterConfig.prefetch_size",
                "must be at least 1",
            ));
        }
        if self.shard_size == 0 {
            return Err(Error::config(
                "WriterConfig.shard_size",
                "must be at least 1 byte",
            ));
        }
        self.compression.validate()
    }
}

/// Asked about every [`INTERRUPT_POLL`] while a write waits (for the lock, for commits, for the
/// finishing work): an error stops the write, which then publishes nothing. The Python bindings
/// run pending signal handlers here, so Ctrl-C stops a write that is waiting without the GIL.
pub type InterruptCheck = Arc<dyn Fn() -> Result<()> + Send + Sync>;

/// How often a waiting write asks its [`InterruptCheck`].
pub const INTERRUPT_POLL: Duration = Duration::from_millis(100);

/// One sample as the source gave it; metadata keys in the source's order.
pub struct SampleInput {
    pub data: Vec<u8>,
    pub metadata: Vec<(String, MetaValue)>,
}

/// A sample's payload as the writer holds it from push until its record is written: owned bytes,
/// or bytes that the caller's object keeps alive and unchanged (a Python `bytes`), read in place.
pub enum Payload {
    Owned(Vec<u8>),
    Shared(Box<dyn SharedBytes>),
}

/// Bytes owned elsewhere that stay alive and unchanged until this value is dropped, on any thread.
pub trait SharedBytes: Send {
    fn bytes(&self) -> &[u8];
}

impl Payload {
    pub fn as_slice(&self) -> &[u8] {
        match self {
            Payload::Owned(v) => v,
            Payload::Shared(s) => s.bytes(),
        }
    }
}

impl From<Vec<u8>> for Payload {
    fn from(v: Vec<u8>) -> Self {
        Payload::Owned(v)
    }
}

/// One metadata key of a sample as a converting caller gives it to
/// [`CacheWriter::push_keyed`]: the identity of the caller's key object (for Python, the address
/// of the `str`) and its text.
#[derive(Clone, Copy, Debug)]
pub struct MetaKey<'a> {
    pub id: usize,
    pub name: &'a str,
}

/// What [`CacheWriter::push_keyed`] did with a sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Staged {
    /// The writer now remembers this sample's key identities: the caller keeps its key objects
    /// alive (so that no other key can take one of their identities) until this is true again.
    pub keys_remembered: bool,
    /// The batch is full: call [`CacheWriter::hand_off`] (it may wait) before the next push.
    pub batch_full: bool,
}

/// What `finish` published.
pub struct Published {
    pub dir: PathBuf,
    pub samples: u64,
    pub raw_bytes: u64,
}

/// A queued sample: its position, payload, sample id and values in schema order.
type Pending = (u64, Payload, MetaValue, Vec<MetaValue>);

/// Writes one cache into a temporary sibling directory and publishes it with one rename.
pub struct CacheWriter {
    pool: Arc<Pool>,
    lock: CacheLock,
    opts: WriterOptions,
    tmp_dir: PathBuf,
    shared: Arc<Shared>,
    fields: Option<Arc<Vec<Field>>>,
    id_source: SampleIdSource,
    id_type: FieldType,
    /// The position of `sample_id` in the schema, when the samples carry it.
    id_slot: Option<usize>,
    key_slots: KeySlots,
    /// The sample ids seen so far (a `str` id by its 128-bit hash), to refuse a duplicate.
    int_ids: AHashSet<i64>,
    str_ids: AHashSet<u128>,
    pushed: u64,
    batch: Vec<Pending>,
    batch_bytes: usize,
    /// When the batch being gathered got its first sample.
    batch_started: Instant,
    batches_submitted: u64,
    published: bool,
    interrupt: Option<InterruptCheck>,
}

impl CacheWriter {
    /// Starts writing `lock.name` under `lock.base`; the caller holds the lock and has checked
    /// that no published cache exists.
    pub fn create(pool: Arc<Pool>, lock: CacheLock, opts: WriterOptions) -> Result<CacheWriter> {
        opts.validate()?;
        // Before anything is created: a closed pool or a forked child could never finish.
        pool.check_usable()?;
        lock.remove_leftovers();
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let tmp_dir = lock
            .base
            .join(tmp_dir_name(&lock.name, std::process::id(), nonce));
        fs::create_dir(&tmp_dir).ctx("create directory", &tmp_dir)?;
        let shards_dir = tmp_dir.join(SHARDS_DIR);
        fs::create_dir(&shards_dir).ctx("create directory", &shards_dir)?;
        let index_path = tmp_dir.join(INDEX_FILE);
        let mut index = create_file(&index_path)?;
        index.write_all(&index_header()).ctx("write", &index_path)?;
        let name = lock.name.clone();
        let sink = Sink {
            dir: tmp_dir.clone(),
            shard_size: opts.shard_size,
            shard: None,
            shard_no: 0,
            shard_records: 0,
            shards: Vec::new(),
            index: Some(index),
            metadata: None,
            raw_bytes: 0,
            stored_bytes: 0,
        };
        Ok(CacheWriter {
            pool,
            lock,
            opts,
            tmp_dir,
            shared: Arc::new(Shared {
                name,
                state: Mutex::new(CommitState {
                    next_batch: 0,
                    pending: BTreeMap::new(),
                    committing: false,
                    error: None,
                    first_error: None,
                }),
                changed: Condvar::new(),
                sink: Mutex::new(sink),
                committed_samples: AtomicU64::new(0),
                committed_bytes: AtomicU64::new(0),
                next_sample: AtomicU64::new(0),
            }),
            fields: None,
            id_source: SampleIdSource::Position,
            id_type: FieldType::Int,
            id_slot: None,
            key_slots: KeySlots::default(),
            int_ids: AHashSet::new(),
            str_ids: AHashSet::new(),
            pushed: 0,
            batch: Vec::new(),
            batch_bytes: 0,
            batch_started: Instant::now(),
            batches_submitted: 0,
            published: false,
            interrupt: None,
        })
    }

    /// Makes every wait of this writer ask `check` about every [`INTERRUPT_POLL`].
    pub fn set_interrupt(&mut self, check: InterruptCheck) {
        self.interrupt = Some(check);
    }

    /// Runs the interrupt check; on an error, fails the write so that no further batch commits.
    fn check_interrupt(&self) -> Result<()> {
        let Some(check) = &self.interrupt else {
            return Ok(());
        };
        check().inspect_err(|_| {
            self.shared.fail(Error::Interrupted(format!(
                "writing cache {:?} was interrupted",
                self.lock.name
            )))
        })
    }

    /// Waits until `done` holds for the commit state, asking the interrupt check while it waits.
    fn wait_until(
        &self,
        done: impl Fn(&CommitState) -> bool,
    ) -> Result<MutexGuard<'_, CommitState>> {
        let mut st = self.shared.state.lock().unwrap();
        while !done(&st) {
            st = self
                .shared
                .changed
                .wait_timeout(st, INTERRUPT_POLL)
                .unwrap()
                .0;
            if !done(&st) {
                drop(st);
                self.check_interrupt()?;
                st = self.shared.state.lock().unwrap();
            }
        }
        Ok(st)
    }

    pub fn name(&self) -> &str {
        &self.lock.name
    }

    /// Samples and raw payload bytes committed to disk so far.
    pub fn progress(&self) -> (u64, u64) {
        (
            self.shared.committed_samples.load(Ordering::Acquire),
            self.shared.committed_bytes.load(Ordering::Relaxed),
        )
    }

    /// Checks one sample against the schema set by the first and queues it for writing.
    pub fn push(&mut self, input: SampleInput) -> Result<()> {
        self.check_payload(&input.data)?;
        if self.fields.is_none() {
            self.init_schema(input.metadata.iter().map(|(k, v)| (k.as_str(), v.dtype())))?;
        }
        let (names, given): (Vec<String>, Vec<MetaValue>) = input.metadata.into_iter().unzip();
        let (values, _) = self.ordered_values(names.iter().map(String::as_str), given)?;
        if self.stage(input.data.into(), values)? {
            self.submit_batch()?;
        }
        self.check_error()
    }

    /// Checks and queues one sample like [`push`](Self::push), with the same errors, for a
    /// caller that converts many samples on a thread it must not block: `values` come in the
    /// order of `keys`, and nothing is handed to the pool (see [`Staged`]).
    ///
    /// A sample whose key identities are the remembered ones, in the same order, has its values
    /// placed by the remembered positions without comparing names; any other sample is matched
    /// by name and, when it fits the schema, its identities are remembered instead.
    pub fn push_keyed(
        &mut self,
        data: Payload,
        keys: &[MetaKey<'_>],
        values: Vec<MetaValue>,
    ) -> Result<Staged> {
        debug_assert_eq!(keys.len(), values.len());
        self.check_payload(data.as_slice())?;
        if self.fields.is_none() {
            self.init_schema(keys.iter().zip(&values).map(|(k, v)| (k.name, v.dtype())))?;
        }
        let fields = self.fields.as_deref().expect("schema set above");
        let known = self.key_slots.lookup(keys).filter(|slots| {
            values
                .iter()
                .zip(*slots)
                .all(|(v, &slot)| v.dtype() == fields[slot].dtype)
        });
        let mut keys_remembered = false;
        let values = match known {
            Some(slots) => place(values, slots),
            // A new key order, a changed key set or a changed type: matched by name, which gives
            // the same errors as `push`.
            None => {
                let (values, slots) = self.ordered_values(keys.iter().map(|k| k.name), values)?;
                // One key per field, each found: the slots are a permutation of the schema.
                // (A mapping that repeats a key is never remembered.)
                if slots.len() == values.len() {
                    self.key_slots.remember(keys, slots);
                    keys_remembered = true;
                }
                values
            }
        };
        let batch_full = self.stage(data, values)?;
        Ok(Staged {
            keys_remembered,
            batch_full,
        })
    }

    /// Hands the queued samples to the pool, first waiting while more than `prefetch_size`
    /// samples are between push and commit; errors when the write has failed.
    pub fn hand_off(&mut self) -> Result<()> {
        self.submit_batch()?;
        self.check_error()
    }

    /// Queues a sample whose values are in schema order; whether the batch is full.
    fn stage(&mut self, data: Payload, values: Vec<MetaValue>) -> Result<bool> {
        let sample_id = match self.id_slot {
            None => MetaValue::Int(self.pushed as i64),
            Some(i) => {
                let id = values[i].clone();
                let fresh = match &id {
                    MetaValue::Int(v) => self.int_ids.insert(*v),
                    MetaValue::Str(s) => self
                        .str_ids
                        .insert(xxhash_rust::xxh3::xxh3_128(s.as_bytes())),
                    _ => unreachable!("sample_id type checked by the schema"),
                };
                if !fresh {
                    let shown = match &id {
                        MetaValue::Int(v) => v.to_string(),
                        MetaValue::Str(s) => format!("{s:?}"),
                        _ => unreachable!("checked above"),
                    };
                    return Err(self.invalid(format!(
                        "duplicate sample_id {shown}: sample ids must be unique within a cache"
                    )));
                }
                id
            }
        };
        if self.batch.is_empty() {
            self.batch_started = Instant::now();
        }
        self.batch_bytes += data.as_slice().len();
        self.batch.push((self.pushed, data, sample_id, values));
        self.pushed += 1;
        Ok(
            self.batch.len() >= BATCH_SAMPLES.min(self.opts.prefetch_size)
                || self.batch_bytes >= BATCH_BYTES
                || self.batch_started.elapsed() >= BATCH_LINGER,
        )
    }

    fn check_error(&self) -> Result<()> {
        let st = self.shared.state.lock().unwrap();
        match &st.error {
            Some(msg) => Err(Error::Runtime(format!(
                "writing cache {:?} failed: {msg}",
                self.lock.name
            ))),
            None => Ok(()),
        }
    }

    fn submit_batch(&mut self) -> Result<()> {
        if self.batch.is_empty() {
            return Ok(());
        }
        // Backpressure: wait until this batch fits within prefetch_size uncommitted samples.
        let in_batch = self.batch.len() as u64;
        let limit = (self.opts.prefetch_size as u64).max(in_batch);
        drop(self.wait_until(|st| {
            st.error.is_some()
                || self.pushed - self.shared.committed_samples.load(Ordering::Acquire) <= limit
        })?);
        let batch = std::mem::take(&mut self.batch);
        self.batch_bytes = 0;
        let seq = self.batches_submitted;
        let shared = self.shared.clone();
        let fields = self.fields.clone().expect("schema set before any batch");
        let compression = self.opts.compression;
        let submitted = self.pool.submit(move || {
            // A panic must reach `deliver` as an error, or the writer would wait forever.
            let encoded = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let json = RecordMetadataJson::new(&fields);
                batch
                    .into_iter()
                    .map(|(i, data, id, values)| {
                        encode(i, data, (&fields, &json), compression, id, values)
                    })
                    .collect()
            }))
            .map_err(|panic| Error::Runtime(crate::pool::panic_message(&panic)));
            shared.deliver(seq, encoded);
            Ok(())
        });
        match submitted {
            // Counted only once a worker will deliver it: `finish` and `drop` wait for every
            // counted batch.
            Ok(_) => {
                self.batches_submitted += 1;
                Ok(())
            }
            Err(e) => {
                // The batch is lost, so this cache can never be finished.
                self.shared.fail(Error::Runtime(e.to_string()));
                Err(e)
            }
        }
    }

    /// Whether every counted batch is committed (or the write failed: then no further batch
    /// commits) and no commit is still writing into the temporary directory. `error`, not
    /// `first_error`, decides: `finish` takes the first error out to return it.
    fn commits_done(&self, st: &CommitState) -> bool {
        !st.committing && (st.error.is_some() || st.next_batch >= self.batches_submitted)
    }

    /// Waits for `job` on the pool, asking the interrupt check while it waits. `abandon`: on an
    /// interrupt, return at once (the job only reads); otherwise wait for the job to stop at
    /// its next step, so that nothing writes into the temporary directory once it is removed.
    fn wait_for_job(&self, job: &crate::pool::Slot<()>, abandon: bool) -> Result<()> {
        loop {
            if let Some(result) = job.wait_timeout(INTERRUPT_POLL) {
                return result;
            }
            if let Err(e) = self.check_interrupt() {
                if !abandon {
                    let _ = job.wait();
                }
                return Err(e);
            }
        }
    }

    /// Waits for every queued sample, writes the manifest and publishes the cache.
    pub fn finish(mut self) -> Result<Published> {
        self.submit_batch()?;
        // `next_batch` counts a batch when its commit starts, so the last one may still be
        // appending: the shards are closed only once no commit is in progress.
        let failed = self
            .wait_until(|st| self.commits_done(st))?
            .first_error
            .take();
        if let Some(e) = failed {
            return Err(e);
        }
        if self.fields.is_none() {
            // An empty source: an empty schema and positional ids.
            let meta_path = self.tmp_dir.join(METADATA_FILE);
            let writer = MetadataWriter::create(&meta_path, &[], FieldType::Int)?;
            self.shared.sink.lock().unwrap().metadata = Some(writer);
            self.fields = Some(Arc::new(Vec::new()));
        }
        let tmp = self.tmp_dir.clone();
        let name = self.lock.name.clone();
        let opts = self.opts;
        let fields = self.fields.clone().unwrap();
        let id_source = self.id_source;
        let id_type = self.id_type;
        let shared = self.shared.clone();
        let num_samples = self.pushed;
        // File finishing, syncing and validation are I/O: they run on the pool too. Each step
        // first checks that the write was not stopped meanwhile.
        let tmp_dir = tmp.clone();
        let validator = shared.clone();
        let validated_name = name.clone();
        let written = self.pool.submit(move || {
            let mut sink = shared.sink.lock().unwrap();
            shared.check_live()?;
            sink.close_shard()?;
            shared.check_live()?;
            let (bytes, checksum) = sink.metadata.take().expect("opened").finish()?;
            let metadata = FileEntry {
                file: METADATA_FILE.into(),
                bytes,
                checksum,
            };
            let index_path = tmp.join(INDEX_FILE);
            let index_writer = sink.index.take().expect("open until finish");
            let (bytes, checksum) = finish_file(index_writer, &index_path)?;
            shared.check_live()?;
            let mut manifest = Manifest {
                format: FORMAT_NAME.into(),
                format_version: FORMAT_VERSION,
                writer_version: WRITER_VERSION.into(),
                name: name.clone(),
                num_samples,
                metadata_schema: (*fields).clone(),
                sample_id: id_source,
                sample_id_type: id_type,
                compression: opts.compression,
                checksum_algo: CHECKSUM_ALGO.into(),
                alignment: ALIGN,
                raw_payload_bytes: sink.raw_bytes,
                stored_payload_bytes: sink.stored_bytes,
                index: FileEntry {
                    file: INDEX_FILE.into(),
                    bytes,
                    checksum,
                },
                metadata,
                shards: std::mem::take(&mut sink.shards),
                fingerprint: String::new(),
            };
            manifest.fingerprint = manifest.compute_fingerprint();
            let manifest_path = tmp.join(MANIFEST_FILE);
            let mut json = serde_json::to_vec_pretty(&manifest).expect("manifest serialises");
            json.push(b'\n');
            let mut f = File::create(&manifest_path).ctx("create", &manifest_path)?;
            f.write_all(&json).ctx("write", &manifest_path)?;
            make_read_only(&f, &manifest_path)?;
            f.sync_all().ctx("sync", &manifest_path)?;
            sync_dir(&tmp.join(SHARDS_DIR))?;
            sync_dir(&tmp)
        })?;
        self.wait_for_job(&written, false)?;
        if opts.validate {
            // Validation only reads: an interrupt abandons it at once. `verify_all` hashes the
            // index, the metadata table, every record and every shard: opening with
            // `Validation::Full` as well would hash the index and the shards twice.
            let validated = self.pool.submit(move || {
                validator.check_live()?;
                Cache::open_as(&tmp_dir, &validated_name, Validation::Structure)?.verify_all()
            })?;
            self.wait_for_job(&validated, true)?;
        }
        self.shared.check_live()?;
        let final_dir = self.lock.final_dir();
        fs::rename(&self.tmp_dir, &final_dir).ctx("publish (rename)", &final_dir)?;
        self.published = true;
        // The cache is published (complete, verified, visible) once the rename is done. Syncing
        // the parent only makes the rename survive a power loss; if that fails (a base directory
        // that cannot be opened for reading, say), reporting the published cache as a failed
        // write would be false, and a lost rename leaves no cache, which the next run rewrites.
        let _ = sync_dir(&self.lock.base);
        let (samples, raw_bytes) = self.progress();
        Ok(Published {
            dir: final_dir,
            samples,
            raw_bytes,
        })
    }
}

impl Drop for CacheWriter {
    fn drop(&mut self) {
        if !self.published {
            // An unpublished writer is abandoned: with its error recorded no further batch
            // commits (batches still being encoded deliver into nothing), so the wait lasts at
            // most the one commit in progress. Then nothing writes into the directory.
            self.shared.fail(Error::Runtime(format!(
                "the writer of cache {:?} was dropped before it published",
                self.lock.name
            )));
            let mut st = self.shared.state.lock().unwrap();
            while st.committing {
                st = self.shared.changed.wait(st).unwrap();
            }
            drop(st);
            let _ = fs::remove_dir_all(&self.tmp_dir);
        }
    }
}

//! Writing a cache: validation of every sample, encoding on the pool, ordered commit into shards,
//! and atomic publication of the finished directory.
//!
//! The caller (the Python source's thread) pushes samples; they are grouped into small batches
//! that pool workers encode (LZ4 under the ratio rule, record checksum) in parallel. Encoded
//! batches are committed in order by whichever worker finishes the next one ("combining": no
//! worker ever waits for another). At most `prefetch_size` samples are between push and commit,
//! so memory stays flat for a source of any length.

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::io::{BufWriter, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

use ahash::AHashSet;

use crate::cache::{Cache, Validation};
use crate::error::{Error, IoContext, Result};
use crate::format::*;
use crate::hashed_file::{create_file, finish_file, make_read_only, HashingWriter};
use crate::liveness;
use crate::metadata::{Field, FieldType, MetaValue, MetadataWriter, RecordMetadataJson, SAMPLE_ID};
use crate::pool::Pool;

/// Default target size of one shard file.
pub const DEFAULT_SHARD_SIZE: u64 = 256 << 20;
/// A batch handed to one worker closes at this many payload bytes or samples.
const BATCH_BYTES: usize = 1 << 20;
const BATCH_SAMPLES: usize = 256;

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

/// The bytes that the temporary directory's name `.NAME.tmp-PID-NANOS` adds to a cache name, at
/// most: a pid has at most 10 digits (an i32), the nanoseconds since 1970 at most 20 (until the
/// year 2286 they have 19). The lock file `.NAME.lock` adds less.
const TMP_NAME_EXTRA_BYTES: usize = ".".len() + ".tmp-".len() + 10 + "-".len() + 20;

/// The longest cache name, in bytes: its temporary directory's name must still fit the 255-byte
/// limit that Linux file systems put on one file name.
pub const MAX_NAME_BYTES: usize = 255 - TMP_NAME_EXTRA_BYTES;

fn tmp_dir_name(name: &str, pid: u32, nanos: u128) -> String {
    format!(".{name}.tmp-{pid}-{nanos}")
}

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

/// The schema positions of the keys of the last sample that was matched by name, remembered by
/// the keys' identities in that sample's order.
#[derive(Default)]
struct KeySlots {
    ids: Vec<usize>,
    slots: Vec<usize>,
}

impl KeySlots {
    /// The schema positions of `keys` when they are the remembered identities, in order.
    fn lookup(&self, keys: &[MetaKey<'_>]) -> Option<&[usize]> {
        let same =
            keys.len() == self.ids.len() && keys.iter().zip(&self.ids).all(|(k, id)| k.id == *id);
        same.then_some(self.slots.as_slice())
    }

    fn remember(&mut self, keys: &[MetaKey<'_>], slots: Vec<usize>) {
        self.ids.clear();
        self.ids.extend(keys.iter().map(|k| k.id));
        self.slots = slots;
    }
}

/// A cache name must be one plain directory name.
pub fn validate_name(name: &str) -> Result<()> {
    let bad = name.is_empty()
        || name == "."
        || name == ".."
        || name.starts_with('.')
        || name.contains(['/', '\\', '\0']);
    if bad {
        return Err(Error::config(
            "source name",
            format!(
                "{name:?} is not a plain directory name (non-empty, no '/', not starting with '.')"
            ),
        ));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(Error::config(
            "source name",
            format!(
                "{:?}... is {} bytes long; a cache name may have at most {MAX_NAME_BYTES} bytes \
                 (its temporary directory's name adds up to {TMP_NAME_EXTRA_BYTES} bytes, and a \
                 file name may have 255): use a shorter name",
                name.chars().take(32).collect::<String>(),
                name.len()
            ),
        ));
    }
    Ok(())
}

/// Errors clearly when `base` cannot be a base cache directory because it, or the nearest part
/// of it that exists, is not a directory (a regular file, say). Creates nothing.
pub fn check_base_dir(base: &Path) -> Result<()> {
    let Some(existing) = base.ancestors().find(|p| fs::metadata(p).is_ok()) else {
        return Ok(());
    };
    if fs::metadata(existing).is_ok_and(|m| !m.is_dir()) {
        let what = if existing == base {
            format!("{} is not a directory", base.display())
        } else {
            format!(
                "{} lies below {}, which is not a directory",
                base.display(),
                existing.display()
            )
        };
        return Err(Error::config(
            "base_cache_dir",
            format!("{what}; pass a directory (a missing one is created when a cache is written)"),
        ));
    }
    Ok(())
}

/// Opens (creating it if needed) the lock file without following a symbolic link and without
/// blocking on a FIFO: a file planted at the lock's path never makes the writer create or open
/// anything outside the base directory.
fn open_lock_file(path: &Path) -> Result<File> {
    let flags = libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
    let refused = |what: &str| {
        Error::io(
            "open lock file",
            path,
            std::io::Error::other(format!(
                "{what}, not a regular file; the lock is never opened through a link or on a \
                 special file, so nothing was written: remove it and retry"
            )),
        )
    };
    let opened = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .custom_flags(flags)
        .open(path)
        .or_else(|e| match e.kind() {
            // Another user's lock file in a shared base directory: flock needs no write access.
            std::io::ErrorKind::PermissionDenied => {
                OpenOptions::new().read(true).custom_flags(flags).open(path)
            }
            _ => Err(e),
        });
    let file = match opened {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(refused("it is a symbolic link"))
        }
        // A FIFO without a reader (write-only, non-blocking open) or a socket.
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
            return Err(refused("it is a FIFO or a socket"))
        }
        Err(e) => return Err(Error::io("open lock file", path, e)),
    };
    let meta = file.metadata().ctx("stat lock file", path)?;
    if !meta.is_file() {
        return Err(refused("it is a special file"));
    }
    Ok(file)
}

/// An exclusive lock on one cache name under a base directory, held while deciding whether to
/// write and while writing. `flock` is released by the kernel when the holder dies, so a
/// crashed writer never blocks the next run.
pub struct CacheLock {
    file: File,
    pub base: PathBuf,
    pub name: String,
}

impl CacheLock {
    /// Blocks until the lock is held; creates `base` if needed.
    pub fn acquire(base: &Path, name: &str) -> Result<CacheLock> {
        Self::acquire_interruptible(base, name, &|| Ok(()))
    }

    /// Like [`CacheLock::acquire`], but asks `interrupt` about every [`INTERRUPT_POLL`] while
    /// another writer holds the lock, and gives up with its error.
    pub fn acquire_interruptible(
        base: &Path,
        name: &str,
        interrupt: &dyn Fn() -> Result<()>,
    ) -> Result<CacheLock> {
        validate_name(name)?;
        check_base_dir(base)?;
        fs::create_dir_all(base).ctx("create directory", base)?;
        let path = base.join(format!(".{name}.lock"));
        let file = open_lock_file(&path)?;
        // Polled, not a blocking flock: a blocked flock would ignore Ctrl-C for as long as
        // another writer (perhaps a hung one) holds the lock.
        let mut pause = Duration::from_millis(1);
        loop {
            // SAFETY: flock on a valid, owned descriptor.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                break;
            }
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EWOULDBLOCK) => {
                    interrupt()?;
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(INTERRUPT_POLL);
                }
                Some(libc::EINTR) => {}
                _ => return Err(Error::io("lock", &path, err)),
            }
        }
        Ok(CacheLock {
            file,
            base: base.to_owned(),
            name: name.to_owned(),
        })
    }

    pub fn final_dir(&self) -> PathBuf {
        self.base.join(&self.name)
    }

    /// Removes temporary directories of earlier writers of this name. Holding the lock proves
    /// that none of them is alive. Best effort, like [`reap_dead_leftovers`]: garbage that
    /// cannot be listed or removed never fails a write.
    pub fn remove_leftovers(&self) -> usize {
        remove_leftovers_where(&self.base, &self.name)
    }
}

/// The writer's pid in `file_name` when it is exactly `.NAME.tmp-PID-NANOS`: never the
/// temporary directory of another name that happens to start the same way.
fn leftover_pid(file_name: &str, name: &str) -> Option<i32> {
    let rest = file_name
        .strip_prefix('.')?
        .strip_prefix(name)?
        .strip_prefix(".tmp-")?;
    let (pid, nanos) = rest.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(pid) || !digits(nanos) {
        return None;
    }
    pid.parse().ok()
}

/// Removes the leftovers of `name` in `base` (the caller proved their writers gone); returns how
/// many went. Errors (unreadable base, read-only storage, another process removing the same
/// directory first) are ignored: removing garbage is never worth failing the caller.
fn remove_leftovers_where(base: &Path, name: &str) -> usize {
    let Ok(entries) = fs::read_dir(base) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        if leftover_pid(&file_name.to_string_lossy(), name).is_none() {
            continue;
        }
        if fs::remove_dir_all(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Removes the temporary directories of writers of `name` under `base` once no writer of it is
/// alive, without taking the lock the blocking way and without creating the lock file (loading
/// works on read-only storage). Every writer holds `.NAME.lock` from before it creates its
/// directory until after it is gone, so a lock that can be taken at once proves every such
/// directory a leftover, whatever its pid says (reused, or from another PID namespace); a held,
/// missing or unopenable lock file removes nothing.
pub fn reap_dead_leftovers(base: &Path, name: &str) -> usize {
    match liveness::probe(&base.join(format!(".{name}.lock"))) {
        // Held until the removal is done: no writer starts meanwhile.
        liveness::Owner::Gone(_held) => remove_leftovers_where(base, name),
        liveness::Owner::Alive | liveness::Owner::Unknown(_) => 0,
    }
}

impl Drop for CacheLock {
    fn drop(&mut self) {
        // SAFETY: unlocking our own descriptor; closing it would release the lock anyway.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

fn sync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .ctx("open", path)?
        .sync_all()
        .ctx("sync", path)
}

struct Encoded {
    header: RecordHeader,
    meta: Vec<u8>,
    payload: Payload,
    sample_id: MetaValue,
    values: Vec<MetaValue>,
}

/// The files being written, touched by one committer at a time.
struct Sink {
    dir: PathBuf,
    shard_size: u64,
    shard: Option<HashingWriter<BufWriter<File>>>,
    shard_no: u32,
    shard_records: u64,
    shards: Vec<ShardEntry>,
    index: Option<HashingWriter<BufWriter<File>>>,
    metadata: Option<MetadataWriter>,
    raw_bytes: u64,
    stored_bytes: u64,
}

const ZEROS: [u8; ALIGN as usize] = [0; ALIGN as usize];

impl Sink {
    fn close_shard(&mut self) -> Result<()> {
        if let Some(w) = self.shard.take() {
            let rel = shard_file_name(self.shard_no);
            let (bytes, checksum) = finish_file(w, &self.dir.join(&rel))?;
            self.shards.push(ShardEntry {
                file: rel,
                bytes,
                records: self.shard_records,
                checksum,
            });
            self.shard_no += 1;
            self.shard_records = 0;
        }
        Ok(())
    }

    fn append(&mut self, rec: Encoded, sample: u64) -> Result<()> {
        let len = rec.header.padded_len();
        if let Some(w) = &self.shard {
            if self.shard_records > 0 && w.written + len > self.shard_size {
                self.close_shard()?;
            }
        }
        if self.shard.is_none() {
            let path = self.dir.join(shard_file_name(self.shard_no));
            let mut w = create_file(&path)?;
            w.write_all(&shard_header(self.shard_no))
                .ctx("write", &path)?;
            self.shard = Some(w);
        }
        let path = self.dir.join(shard_file_name(self.shard_no));
        let w = self.shard.as_mut().expect("opened above");
        let offset = w.written;
        debug_assert_eq!(offset % ALIGN, 0);
        let header_and_meta = RECORD_HEADER_LEN + rec.meta.len() as u64;
        let pad1 = (rec.header.payload_offset() - header_and_meta) as usize;
        let payload = rec.payload.as_slice();
        let pad2 = (len - rec.header.payload_offset() - payload.len() as u64) as usize;
        (|| {
            w.write_all(&rec.header.encode())?;
            w.write_all(&rec.meta)?;
            w.write_all(&ZEROS[..pad1])?;
            w.write_all(payload)?;
            w.write_all(&ZEROS[..pad2])
        })()
        .ctx("write", &path)?;
        w.start_writeback();
        self.shard_records += 1;
        let entry = IndexEntry {
            offset,
            shard: self.shard_no,
            flags: rec.header.flags,
            stored_len: rec.header.stored_len,
            raw_len: rec.header.raw_len,
            meta_len: Some(rec.header.meta_len),
            checksum: rec.header.checksum,
        };
        self.index
            .as_mut()
            .expect("open until finish")
            .write_all(&entry.encode())
            .ctx("write", &self.dir.join(INDEX_FILE))?;
        self.raw_bytes += u64::from(rec.header.raw_len);
        self.stored_bytes += u64::from(rec.header.stored_len);
        debug_assert_eq!(rec.header.sample, sample);
        self.metadata
            .as_mut()
            .expect("metadata writer opens with the first sample")
            .push(&rec.sample_id, &rec.values)
    }
}

struct CommitState {
    next_batch: u64,
    pending: BTreeMap<u64, Vec<Encoded>>,
    committing: bool,
    error: Option<String>,
    first_error: Option<Error>,
}

fn record_error(st: &mut CommitState, e: Error) {
    if st.error.is_none() {
        st.error = Some(e.to_string());
        st.first_error = Some(e);
    }
}

struct Shared {
    name: String,
    state: Mutex<CommitState>,
    changed: Condvar,
    sink: Mutex<Sink>,
    committed_samples: AtomicU64,
    committed_bytes: AtomicU64,
    next_sample: AtomicU64,
}

impl Shared {
    /// Records the write's first error; later ones add nothing. No batch commits after it.
    fn fail(&self, e: Error) {
        let mut st = self.state.lock().unwrap();
        record_error(&mut st, e);
        self.changed.notify_all();
    }

    /// Errors once the write has failed (or was interrupted or abandoned): the finishing work
    /// asks between its steps, so a stopped write stops writing soon.
    fn check_live(&self) -> Result<()> {
        match &self.state.lock().unwrap().error {
            Some(msg) => Err(Error::Runtime(format!(
                "writing cache {:?} stopped: {msg}",
                self.name
            ))),
            None => Ok(()),
        }
    }

    /// Hands an encoded batch over; commits every batch that is now next in line.
    fn deliver(&self, seq: u64, batch: Result<Vec<Encoded>>) {
        let mut st = self.state.lock().unwrap();
        match batch {
            Ok(b) => {
                st.pending.insert(seq, b);
            }
            Err(e) => {
                record_error(&mut st, e);
                self.changed.notify_all();
                return;
            }
        }
        if st.committing {
            return; // the active committer will pick this batch up
        }
        st.committing = true;
        loop {
            // `error`, not `first_error`: `finish` may have taken the first error out already.
            if st.error.is_some() {
                break;
            }
            let next = st.next_batch;
            let Some(batch) = st.pending.remove(&next) else {
                break;
            };
            st.next_batch += 1;
            drop(st);
            // A panic must not leave `committing` set: `finish` and `drop` wait on it.
            let result =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.commit(batch)))
                    .unwrap_or_else(|panic| {
                        Err(Error::Runtime(crate::pool::panic_message(&panic)))
                    });
            st = self.state.lock().unwrap();
            if let Err(e) = result {
                record_error(&mut st, e);
            }
            self.changed.notify_all();
        }
        st.committing = false;
        self.changed.notify_all();
    }

    fn commit(&self, batch: Vec<Encoded>) -> Result<()> {
        let mut sink = self.sink.lock().unwrap();
        for rec in batch {
            let bytes = u64::from(rec.header.raw_len);
            let sample = self.next_sample.fetch_add(1, Ordering::Relaxed);
            sink.append(rec, sample)?;
            self.committed_samples.fetch_add(1, Ordering::Release);
            self.committed_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        Ok(())
    }
}

fn encode(
    sample: u64,
    data: Payload,
    (fields, json): (&[Field], &RecordMetadataJson),
    compression: Compression,
    sample_id: MetaValue,
    values: Vec<MetaValue>,
) -> Encoded {
    let meta = json.encode(fields, &values);
    let raw = data.as_slice();
    let raw_len = raw.len() as u32;
    let (flags, payload) = match compression.algo {
        CompressionAlgo::Lz4 if !raw.is_empty() => {
            let compressed = lz4_flex::block::compress(raw);
            if (compressed.len() as f64) <= compression.ratio * raw.len() as f64 {
                (FLAG_LZ4, Payload::Owned(compressed))
            } else {
                (0, data)
            }
        }
        _ => (0, data),
    };
    let mut header = RecordHeader {
        flags,
        meta_len: meta.len() as u32,
        stored_len: payload.as_slice().len() as u32,
        raw_len,
        sample,
        checksum: 0,
    };
    header.checksum = header.compute_checksum(&meta, payload.as_slice());
    Encoded {
        header,
        meta,
        payload,
        sample_id,
        values,
    }
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

    fn invalid(&self, reason: impl Into<String>) -> Error {
        Error::InvalidSample {
            source_name: self.lock.name.clone(),
            sample_index: self.pushed,
            reason: reason.into(),
        }
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

    fn check_payload(&self, data: &[u8]) -> Result<()> {
        if data.len() > u32::MAX as usize {
            return Err(self.invalid(format!(
                "payload of {} bytes exceeds the format's 4 GiB record limit",
                data.len()
            )));
        }
        Ok(())
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
        self.batch_bytes += data.as_slice().len();
        self.batch.push((self.pushed, data, sample_id, values));
        self.pushed += 1;
        Ok(
            self.batch.len() >= BATCH_SAMPLES.min(self.opts.prefetch_size)
                || self.batch_bytes >= BATCH_BYTES,
        )
    }

    fn init_schema<'a>(&mut self, first: impl Iterator<Item = (&'a str, FieldType)>) -> Result<()> {
        let fields: Vec<Field> = first
            .map(|(name, dtype)| Field {
                name: name.to_owned(),
                dtype,
            })
            .collect();
        if let Some(f) = fields.iter().find(|f| f.name == SAMPLE_ID) {
            if !matches!(f.dtype, FieldType::Int | FieldType::Str) {
                return Err(self.invalid(format!(
                    "metadata \"sample_id\" must be an int or a str, got {}",
                    f.dtype.as_str()
                )));
            }
            self.id_source = SampleIdSource::Metadata;
            self.id_type = f.dtype;
        }
        let meta_path = self.tmp_dir.join(METADATA_FILE);
        let writer = MetadataWriter::create(&meta_path, &fields, self.id_type)?;
        self.shared.sink.lock().unwrap().metadata = Some(writer);
        self.id_slot = fields.iter().position(|f| f.name == SAMPLE_ID);
        self.fields = Some(Arc::new(fields));
        Ok(())
    }

    /// The values in schema order, and the schema position of each given key; the first key
    /// that is not in the schema, has another type or is missing is the error.
    fn ordered_values<'a>(
        &self,
        names: impl Iterator<Item = &'a str>,
        given: Vec<MetaValue>,
    ) -> Result<(Vec<MetaValue>, Vec<usize>)> {
        let fields = self
            .fields
            .as_deref()
            .expect("schema set before any sample");
        let mut values: Vec<Option<MetaValue>> = vec![None; fields.len()];
        let mut slots = Vec::with_capacity(given.len());
        for (name, value) in names.zip(given) {
            let Some(i) = fields.iter().position(|f| f.name == name) else {
                return Err(self.invalid(format!(
                    "metadata key {name:?} is not in the schema set by sample 0 ({})",
                    describe_schema(fields)
                )));
            };
            if value.dtype() != fields[i].dtype {
                return Err(self.invalid(format!(
                    "metadata {name:?} is {}, but sample 0 made it {}",
                    value.dtype().as_str(),
                    fields[i].dtype.as_str()
                )));
            }
            values[i] = Some(value);
            slots.push(i);
        }
        let values = values
            .into_iter()
            .zip(fields)
            .map(|(v, f)| {
                v.ok_or_else(|| {
                    self.invalid(format!(
                        "metadata key {:?} is missing; the schema set by sample 0 is {}",
                        f.name,
                        describe_schema(fields)
                    ))
                })
            })
            .collect::<Result<_>>()?;
        Ok((values, slots))
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

/// `values[i]` moved to position `slots[i]`; `slots` is a permutation of the positions.
fn place(values: Vec<MetaValue>, slots: &[usize]) -> Vec<MetaValue> {
    if slots.iter().enumerate().all(|(i, &slot)| i == slot) {
        return values;
    }
    let mut placed: Vec<Option<MetaValue>> = vec![None; values.len()];
    for (value, &slot) in values.into_iter().zip(slots) {
        placed[slot] = Some(value);
    }
    placed
        .into_iter()
        .map(|v| v.expect("the slots are a permutation"))
        .collect()
}

fn describe_schema(fields: &[Field]) -> String {
    let parts: Vec<String> = fields
        .iter()
        .map(|f| format!("{}: {}", f.name, f.dtype.as_str()))
        .collect();
    format!("{{{}}}", parts.join(", "))
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

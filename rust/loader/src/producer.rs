//! The producer: reads this rank's epoch order (the read path's sampling and per-record
//! checksums) ahead on a pool of `threads` workers, and fills slots in global batch order,
//! never more than the ring's slot count ahead of what the training loop received. The
//! read-ahead is the in-process reader's ([`EpochReader`]): at most `prefetch_size` samples and
//! 64 MiB of decompressed LZ4 payloads ahead of the slot being filled. Runs in its own process,
//! without a GIL.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use dataset_rt_core::cache::Cache;
use dataset_rt_core::dataset::{Dataset, EpochReader, ReadOptions, WeightTable};
use dataset_rt_core::error::io_errno;
use dataset_rt_core::os::{own_pid, parent_pid};
use dataset_rt_core::pool::Pool;
use dataset_rt_core::sampler::EpochOrder;
use dataset_rt_core::verify::{VerifiedSet, VerifyPolicy};
use dataset_rt_core::{Error as CoreError, ErrorKind};
use serde::{Deserialize, Serialize};

use dataset_rt_shm::ring::{Party, Ring};
use dataset_rt_shm::ShmError;

use std::borrow::Cow;

use dataset_rt_core::dataset::Payload;

use crate::batch::{batch_bytes, encode_metadata, write_batch, PayloadOut, SampleOut, ShardRef};
use crate::lifecycle;
use crate::shards::ShardTable;
use crate::{protocol, Error, Result};

/// What the producer needs beyond the control segment: written by the training process into a
/// private directory, read once at start.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProducerSpec {
    pub ctl_name: String,
    pub cache_dirs: Vec<PathBuf>,
    /// By cache: for one read from object storage, what opens its record source again here
    /// (`RecordSource::locator`); `None` for a local cache.
    #[serde(default)]
    pub remote: Vec<Option<String>>,
    /// The shard files the training process validated: the producer reads exactly these
    /// (references in the slots point into them), else refuses to start.
    pub shards: ShardTable,
    /// The dataset's fingerprint: the producer refuses caches that changed under the loader.
    pub fingerprint: String,
    /// Each cache's fingerprint, so that a refusal names the cache that changed.
    #[serde(default)]
    pub cache_fingerprints: Vec<String>,
    pub weights_fingerprint: String,
    /// The weight table as little-endian f64, one per sample; `None` = uniform.
    pub weights_file: Option<PathBuf>,
    pub seed: u64,
    pub shuffle: bool,
    pub epoch_len: Option<u64>,
    /// Samples read ahead of the slot being filled (`ReaderConfig.prefetch_size`).
    pub prefetch_size: usize,
    /// Records the read planner keeps in flight (`ReaderConfig.io_depth`).
    #[serde(default = "default_io_depth")]
    pub io_depth: usize,
    /// Bound on the stored bytes of those records (`ReaderConfig.read_ahead_bytes`).
    #[serde(default = "default_read_ahead_bytes")]
    pub read_ahead_bytes: u64,
    /// When records are hashed (`ReaderConfig.verify`). Under `Once` the producer uses the
    /// training process's set of verified samples (`verified`) when it is shared, else keeps
    /// its own, which lives as long as this process.
    pub verify: VerifyPolicy,
    /// Under `Once`, the training process's verified set, inherited as a descriptor.
    #[serde(default)]
    pub verified: Option<SharedVerified>,
    /// Threads that read, verify and decompress (`DataLoader(producer_threads=)`).
    pub threads: usize,
    /// After a pass, wait for the owner's next one on the same segments instead of exiting
    /// (`DataLoader(persistent_workers=True)`).
    #[serde(default)]
    pub persistent: bool,
}

fn default_io_depth() -> usize {
    dataset_rt_core::dataset::DEFAULT_IO_DEPTH
}

fn default_read_ahead_bytes() -> u64 {
    dataset_rt_core::dataset::DEFAULT_READ_AHEAD_BYTES
}

/// The training process's set of verified samples, passed down to the producer: descriptor
/// `fd` (a sealed memfd the producer inherits across `exec`) holds one bit per sample of the
/// dataset, `samples` of them, numbered as the dataset numbers them (the caches in order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SharedVerified {
    pub fd: i32,
    pub samples: u64,
}

impl SharedVerified {
    /// What the spec says of `ds`'s set: `None` when it is not shared from this process.
    pub fn of(ds: &Dataset) -> Option<SharedVerified> {
        ds.shared_verified_fd().map(|fd| SharedVerified {
            fd: fd.as_raw_fd(),
            samples: ds.len(),
        })
    }
}

/// Samples per pool job: about two jobs per thread within the read-ahead window, so that every
/// thread has work while the fill loop takes samples in order.
fn chunk_samples(prefetch_size: usize, threads: usize) -> u64 {
    (prefetch_size / (2 * threads.max(1))).clamp(1, 256) as u64
}

pub fn write_weights(path: &Path, weights: &[f64]) -> Result<()> {
    let bytes: Vec<u8> = weights.iter().flat_map(|w| w.to_le_bytes()).collect();
    std::fs::write(path, bytes).map_err(|source| {
        ShmError::Io {
            op: "write",
            path: path.to_owned(),
            source,
        }
        .into()
    })
}

fn read_weights(path: &Path) -> Result<Vec<f64>> {
    let bytes = std::fs::read(path).map_err(|source| ShmError::Io {
        op: "read",
        path: path.to_owned(),
        source,
    })?;
    if bytes.len() % 8 != 0 {
        return Err(protocol(format!(
            "{}: {} bytes is not a whole number of f64",
            path.display(),
            bytes.len()
        )));
    }
    Ok(bytes
        .chunks_exact(8)
        .map(|c| f64::from_le_bytes(c.try_into().unwrap()))
        .collect())
}

/// The kind of a loader error in the one error-kind table, and its errno when it has one: the
/// producer records both in the control segment, and the bindings choose the Python class from
/// them, so a failure raises the same class wherever it happens.
pub fn error_kind(err: &Error) -> (ErrorKind, Option<i32>) {
    match err {
        Error::Core(e) => (e.kind(), e.errno()),
        Error::Shm(e) => shm_error_kind(e),
    }
}

/// `error_kind` of a transport error.
pub fn shm_error_kind(err: &ShmError) -> (ErrorKind, Option<i32>) {
    match err {
        ShmError::Io { source, .. } | ShmError::Memory { source, .. } => {
            (ErrorKind::Io, io_errno(source))
        }
        ShmError::BatchTooLarge { .. } => (ErrorKind::BatchTooLarge, None),
        ShmError::Protocol(_) => (ErrorKind::Loader, None),
        ShmError::Stopped | ShmError::OwnerGone(_) => (ErrorKind::Closed, None),
        // Another party's record: its code is decoded by whoever reports it (an unknown one is
        // a loader failure of its own).
        ShmError::ProducerFailed { kind, errno, .. } => match ErrorKind::from_code(*kind) {
            Ok(kind) => (kind, *errno),
            Err(_) => (ErrorKind::Loader, None),
        },
    }
}

/// The producer process's body: reads the spec (and weights) the owner wrote into its private
/// directory at `spec_path`, removes that directory, and runs [`run`]. Whenever the owner turns
/// out to be gone, at any stage, it removes the pass's names: the owner died before it could.
pub fn run_file(spec_path: &Path, owner_pid: u64) -> Result<()> {
    let text = std::fs::read(spec_path).map_err(|source| ShmError::Io {
        op: "read",
        path: spec_path.to_owned(),
        source,
    })?;
    let spec: ProducerSpec = serde_json::from_slice(&text)
        .map_err(|e| protocol(format!("{}: not a producer spec: {e}", spec_path.display())))?;
    let weights = spec.weights_file.as_deref().map(read_weights).transpose();
    // The producer is the directory's only reader: nothing of it need outlive this point.
    if let Some(dir) = spec_path.parent() {
        let _ = std::fs::remove_dir_all(dir);
    }
    let result = match weights {
        Ok(weights) if parent_pid() == owner_pid => run(&spec, weights),
        Ok(_) => Err(Error::Shm(ShmError::OwnerGone(owner_pid))),
        Err(e) => Err(e),
    };
    if parent_pid() != owner_pid {
        // Gone before every party attached (the last to attach removes the names): do it here.
        lifecycle::unlink_pass(&spec.ctl_name);
        return Err(Error::Shm(ShmError::OwnerGone(owner_pid)));
    }
    result
}

/// Runs the producer of the pass `spec` names, with the weight table (little-endian f64 per
/// sample; `None`: uniform), until it has written every batch and every party has attached,
/// was stopped, or its owner is gone. With `spec.persistent` it then waits for the owner's next
/// pass on the same segments and fills it, until stopped or the owner is gone; the caches and
/// the weight table are opened once. Errors are also written into the control segment for the
/// training loop, and end the producer.
pub fn run(spec: &ProducerSpec, weights: Option<Vec<f64>>) -> Result<()> {
    let ring = Arc::new(lifecycle::attach(&spec.ctl_name)?);
    ring.set_producer(own_pid());
    ring.mark_attached();
    let mut source = None;
    let mut weights = Some(weights);
    let mut first = true;
    loop {
        let generation = ring.generation();
        let filled = fill(&ring, spec, &mut source, &mut weights);
        if let Err(e) = &filled {
            if !matches!(
                e,
                Error::Shm(ShmError::Stopped) | Error::Shm(ShmError::OwnerGone(_))
            ) {
                let (kind, errno) = error_kind(e);
                ring.set_error(kind.code(), errno, ring.produced(), &e.to_string());
            }
        }
        // Nothing more to write: the owner stops watching this process's heartbeat.
        ring.finished(Party::Producer);
        // Staying until every party attached lets `run_file` remove the names should the owner
        // die before the last party attached (which removes them).
        let waited = match &filled {
            Err(Error::Shm(ShmError::Stopped) | Error::Shm(ShmError::OwnerGone(_))) => Ok(()),
            _ if first => ring.wait_all_attached().map_err(Error::from),
            _ => Ok(()),
        };
        first = false;
        match (filled, waited) {
            (Err(Error::Shm(ShmError::Stopped)), _)
            | (Ok(()), Err(Error::Shm(ShmError::Stopped))) => return Ok(()),
            (Err(e), _) | (Ok(()), Err(e)) => return Err(e),
            (Ok(()), Ok(())) if !spec.persistent => return Ok(()),
            (Ok(()), Ok(())) => match ring.wait_next_pass(generation) {
                Ok(_) => {}
                Err(ShmError::Stopped) => return Ok(()),
                Err(e) => return Err(e.into()),
            },
        }
    }
}

/// What the producer opens once for all its passes: the caches and the weight table.
struct Source {
    ds: Arc<Dataset>,
    weights: WeightTable,
}

/// Fills the current pass; opens the caches on the first (`source`, then kept for the next).
fn fill(
    ring: &Arc<Ring>,
    spec: &ProducerSpec,
    source: &mut Option<Source>,
    weights: &mut Option<Option<Vec<f64>>>,
) -> Result<()> {
    let (opts, order) = prepare(ring, spec, source, weights)?;
    let ds = source.as_ref().expect("opened by prepare").ds.clone();
    // A read from object storage waits at most the fetch policy's attempts (about 30 s when
    // the store stops answering, as long as the default `heartbeat_timeout`), then fails with
    // the store's error: a thread keeps the heartbeat going so that this error, not a "hung"
    // producer, reaches the training loop. A stopped process still stops its heartbeat.
    let _alive = if ds.caches.iter().any(|c| c.is_fetched()) {
        Some(ring.keep_alive(Party::Producer)?)
    } else {
        None
    };
    let pass = ring.pass();
    let slot_size = ring.geometry().slot_size;
    let beat = ring.clone();
    let mut reader = EpochReader::new(
        Pool::new(spec.threads)?,
        ds.clone(),
        Arc::new(order),
        &opts,
        pass.epoch,
        pass.start,
    )
    .with_chunk(chunk_samples(spec.prefetch_size, spec.threads))
    // A long read (large samples, slow storage) still shows progress; a hung one does not.
    .on_fetched(Arc::new(move || beat.heartbeat(Party::Producer)));
    if reader.len() != pass.rank_samples {
        return Err(protocol(format!(
            "the reader has {} samples for this rank, the pass {}",
            reader.len(),
            pass.rank_samples
        )));
    }
    for b in 0..pass.total_batches {
        let k0 = b * pass.batch_size;
        let k1 = (k0 + pass.batch_size).min(pass.rank_samples);
        let samples = (k0..k1)
            .map(|k| {
                ring.heartbeat(Party::Producer);
                let fetched = reader.next_sample().ok_or_else(|| {
                    protocol(format!("the reader ended before sample {k} of the pass"))
                })??;
                let (c, row) = (fetched.cache as usize, fetched.row);
                // A record stored uncompressed, verified under the policy by the reader, travels
                // as a reference: the consumers map its shard, the producer copies nothing.
                let data = match fetched.payload {
                    Payload::Mapped { shard, offset, len } => {
                        PayloadOut::Shard(ShardRef { shard, offset, len })
                    }
                    Payload::Owned(bytes) => PayloadOut::Bytes(Cow::Owned(bytes)),
                };
                Ok(SampleOut {
                    global: ds.cache_start(c) + row,
                    cache: fetched.cache,
                    row,
                    meta: encode_metadata(ds.caches[c].metadata()?.row(row))?,
                    data,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let needed = batch_bytes(&samples);
        if needed > slot_size {
            return Err(ShmError::BatchTooLarge {
                batch: b,
                samples: samples.len() as u64,
                needed,
                slot_size,
            }
            .into());
        }
        ring.wait_fillable(b)?;
        // SAFETY: the producer alone fills, after wait_fillable, and publishes after writing.
        let slot = unsafe { ring.begin_fill(b) };
        let used = write_batch(slot, b, &samples);
        ring.publish(b, used);
    }
    Ok(())
}

/// Opens the caches (first pass only) and computes the pass's epoch order: seconds for large
/// datasets, during which a thread keeps the heartbeat going (the fill loop beats by itself).
fn prepare(
    ring: &Arc<Ring>,
    spec: &ProducerSpec,
    source: &mut Option<Source>,
    weights: &mut Option<Option<Vec<f64>>>,
) -> Result<(ReadOptions, EpochOrder)> {
    let _alive = ring.keep_alive(Party::Producer)?;
    if source.is_none() {
        *source = Some(open(spec, weights.take().flatten())?);
    }
    let Source { ds, weights } = source.as_ref().expect("opened above");
    let pass = ring.pass();
    let opts = ReadOptions {
        seed: spec.seed,
        shuffle: spec.shuffle,
        prefetch_size: spec.prefetch_size,
        epoch_len: spec.epoch_len,
        rank: pass.rank,
        world_size: pass.world_size,
        policy: crate::pass::split_of(&pass).policy,
        io_depth: spec.io_depth,
        read_ahead_bytes: spec.read_ahead_bytes,
    };
    opts.validate()?;
    if spec.threads == 0 {
        return Err(protocol(
            "the producer spec asks for 0 threads; DataLoader.producer_threads is at least 1"
                .into(),
        ));
    }
    if ds.epoch_len(&opts) != pass.epoch_len {
        return Err(protocol(format!(
            "epoch length {} is not the pass's {}",
            ds.epoch_len(&opts),
            pass.epoch_len
        )));
    }
    let order = ds.try_order(&opts, weights, pass.epoch)?;
    Ok((opts, order))
}

/// Why the caches that `spec` names are refused. A cache republished or written again since the
/// training process opened it is `Malformed`, naming its manifest, as a replaced shard or index
/// is (the first such cache; the others are listed in the reason). Caches that each match but
/// not as a whole are a refused state.
fn changed_caches(spec: &ProducerSpec, ds: &Dataset) -> CoreError {
    let changed: Vec<(&Arc<Cache>, &str)> = ds
        .caches
        .iter()
        .enumerate()
        .filter(|(c, cache)| spec.cache_fingerprints.get(*c) != Some(&cache.manifest.fingerprint))
        .map(|(c, cache)| {
            let was = spec.cache_fingerprints.get(c).map_or("?", String::as_str);
            (cache, was)
        })
        .collect();
    let Some(&(first, was)) = changed.first() else {
        return CoreError::State(format!(
            "the caches changed under the loader (fingerprint {} is not the dataset's {}): open \
             the dataset again to read what they hold now",
            ds.fingerprint(),
            spec.fingerprint
        ));
    };
    let others: Vec<String> = changed[1..]
        .iter()
        .map(|(cache, _)| format!("{:?} at {}", cache.name(), cache.location()))
        .collect();
    CoreError::Malformed {
        cache: first.name().to_owned(),
        file: PathBuf::from(first.location()).join(dataset_rt_core::format::MANIFEST_FILE),
        reason: format!(
            "the cache was replaced since the dataset was opened (fingerprint {} now, {was} \
             then{}): a published cache must not be modified while it is read; open the dataset \
             again to read what it holds now",
            first.manifest.fingerprint,
            if others.is_empty() {
                String::new()
            } else {
                format!("; also replaced: {}", others.join(", "))
            }
        ),
    }
}

/// Opens the caches and checks them and the weight table against the spec.
fn open(spec: &ProducerSpec, weights: Option<Vec<f64>>) -> Result<Source> {
    let caches = spec
        .cache_dirs
        .iter()
        .enumerate()
        .map(|(c, dir)| match spec.remote.get(c) {
            Some(Some(locator)) => dataset_rt_remote::open_located(locator)
                .map(|opened| opened.cache)
                .map_err(CoreError::from),
            _ => Cache::open_in_use(dir).map(Arc::new),
        })
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let ds = Dataset::new(caches);
    if ds.fingerprint() != spec.fingerprint {
        return Err(changed_caches(spec, &ds).into());
    }
    // The same caches in the same order (the fingerprint): a bit of the training process's
    // set names the same sample here.
    let ds = match (spec.verify, spec.verified) {
        (VerifyPolicy::Once, Some(shared)) => {
            let refused = |e: CoreError| {
                protocol(format!(
                    "cannot use the training process's set of verified samples (fd {}, {} \
                     samples): {e}",
                    shared.fd, shared.samples
                ))
            };
            let set = VerifiedSet::attach(shared.fd, shared.samples).map_err(refused)?;
            ds.with_verified_set(set).map_err(refused)?
        }
        (_, Some(shared)) => {
            return Err(protocol(format!(
                "the spec passes a set of verified samples (fd {}) under verify={:?}, which \
                 keeps none",
                shared.fd,
                spec.verify.name()
            )))
        }
        (policy, None) => ds.with_verify(policy),
    };
    spec.shards.check(&ds)?;
    let weights = match weights {
        Some(w) => {
            if w.len() as u64 != ds.len() {
                return Err(protocol(format!(
                    "{} weights for {} samples",
                    w.len(),
                    ds.len()
                )));
            }
            WeightTable::from_weights(w)
        }
        None => WeightTable::uniform(),
    };
    if weights.fingerprint != spec.weights_fingerprint {
        return Err(protocol(format!(
            "weight table {} is not the dataset's {}",
            weights.fingerprint, spec.weights_fingerprint
        )));
    }
    Ok(Source {
        ds: Arc::new(ds),
        weights,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dataset_rt_shm::layout::{ERR_NONE, ERR_WRITING};

    #[test]
    fn layout_md_lists_the_error_kind_table() {
        let spec = include_str!("../../../shm/LAYOUT.md");
        let start = spec
            .find("## Error kinds")
            .expect("the section in LAYOUT.md");
        let rows: Vec<String> = spec[start..]
            .lines()
            .skip_while(|l| !l.starts_with("| code"))
            .skip(2)
            .take_while(|l| l.starts_with('|'))
            .map(str::to_owned)
            .collect();
        let want: Vec<String> = ErrorKind::ALL
            .iter()
            .map(|k| format!("| {} | {} |", k.code(), k.describe()))
            .collect();
        assert_eq!(rows, want);
        for kind in ErrorKind::ALL {
            assert!(![ERR_NONE, ERR_WRITING].contains(&kind.code()), "{kind:?}");
        }
    }

    #[test]
    fn loader_errors_map_onto_the_table_with_their_errno() {
        let io = |errno| std::io::Error::from_raw_os_error(errno);
        let cases = [
            (
                ShmError::Io {
                    op: "open",
                    path: "/x".into(),
                    source: io(libc::EACCES),
                },
                (ErrorKind::Io, Some(libc::EACCES)),
            ),
            (
                ShmError::Memory {
                    op: "mmap",
                    len: 1,
                    source: io(libc::ENOMEM),
                },
                (ErrorKind::Io, Some(libc::ENOMEM)),
            ),
            (
                ShmError::BatchTooLarge {
                    batch: 0,
                    samples: 1,
                    needed: 2,
                    slot_size: 1,
                },
                (ErrorKind::BatchTooLarge, None),
            ),
            (ShmError::Protocol("x".into()), (ErrorKind::Loader, None)),
            (ShmError::Stopped, (ErrorKind::Closed, None)),
            (ShmError::OwnerGone(1), (ErrorKind::Closed, None)),
            (
                ShmError::ProducerFailed {
                    kind: ErrorKind::Io.code(),
                    errno: Some(libc::ENOSPC),
                    batch: 0,
                    text: "x".into(),
                },
                (ErrorKind::Io, Some(libc::ENOSPC)),
            ),
            (
                ShmError::ProducerFailed {
                    kind: 254,
                    errno: Some(libc::ENOSPC),
                    batch: 0,
                    text: "x".into(),
                },
                (ErrorKind::Loader, None),
            ),
        ];
        for (err, want) in cases {
            assert_eq!(shm_error_kind(&err), want, "{err:?}");
            assert_eq!(error_kind(&Error::Shm(err)), want);
        }
        let core = [
            (
                CoreError::io("open", "/x", io(libc::ENOTDIR)),
                (ErrorKind::Io, Some(libc::ENOTDIR)),
            ),
            (CoreError::State("changed".into()), (ErrorKind::State, None)),
        ];
        for (err, want) in core {
            assert_eq!(error_kind(&Error::Core(err)), want);
        }
    }
}

//! One whole pass in one process: a ring in a fresh /dev/shm name, the producer loop on a
//! thread, a consumer on another, over two small caches written with the core writer (one raw,
//! one LZ4). Checks the order against the core's epoch order, and every byte and metadata
//! value against the caches.

use std::os::fd::{AsRawFd, IntoRawFd};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::{Dataset, ReadOptions, WeightTable};
use dataset_rt_core::format::Compression;
use dataset_rt_core::metadata::MetaValue;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::verify::VerifyPolicy;
use dataset_rt_core::writer::WriterOptions;
use dataset_rt_loader::batch::{
    encode_metadata, max_sample_bytes, read_batch, slot_size_for, Payload,
};
use dataset_rt_loader::producer::{self, ProducerSpec, SharedVerified};
use dataset_rt_loader::shards::ShardTable;
use dataset_rt_loader::{lifecycle, plan};
use dataset_rt_shm::layout::{B_USED, POLICY_PAD};
use dataset_rt_shm::ring::{Geometry, Pass, Ring, Role, Ticket, POLL};
use dataset_rt_shm::{segment, ShmError};
use dataset_rt_testkit::{flip_byte, numbered, set_len, write_at, write_cache, writer_options};

const BATCH: u64 = 3;
const SEED: u64 = 11;
const EPOCH: u64 = 2;

fn payload(cache: usize, i: u64) -> Vec<u8> {
    // Repetitive enough for LZ4 to keep the compressed form.
    (0..(40 + i * 13) as usize)
        .map(|j| (j as u64 % 7 + i + cache as u64) as u8)
        .collect()
}

/// Cache `name` (the `index`-th) of `n` samples: metadata `i` and a `tag` naming the cache.
fn write(base: &Path, name: &str, index: usize, n: u64, compression: Compression) {
    let pool = Pool::new(1).unwrap();
    let opts = WriterOptions {
        compression,
        ..writer_options()
    };
    let samples = (0..n).map(|i| {
        let mut sample = numbered(i, payload(index, i));
        let tag = MetaValue::Str(format!("{name}-{i}"));
        sample.metadata.push(("tag".into(), tag));
        sample
    });
    write_cache(&pool, base, name, opts, samples);
}

struct Setup {
    _dir: tempfile::TempDir,
    ds: Dataset,
    opts: ReadOptions,
    spec: ProducerSpec,
}

fn setup() -> Setup {
    setup_sized(10, 7)
}

/// A raw cache of `raw` samples and an LZ4 cache of `lz4`, read by one thread, one sample ahead.
fn setup_sized(raw: u64, lz4: u64) -> Setup {
    let dir = tempfile::tempdir().unwrap();
    write(
        dir.path(),
        "raw",
        0,
        raw,
        Compression::new("none", 1.0).unwrap(),
    );
    write(
        dir.path(),
        "lz4",
        1,
        lz4,
        Compression::new("lz4", 1.0).unwrap(),
    );
    let dirs = vec![dir.path().join("raw"), dir.path().join("lz4")];
    let caches = dirs
        .iter()
        .map(|d| Arc::new(Cache::open(d, Validation::Full).unwrap()))
        .collect();
    let ds = Dataset::new(caches);
    let opts = ReadOptions {
        seed: SEED,
        shuffle: true,
        prefetch_size: 1,
        epoch_len: None,
        rank: 0,
        world_size: 1,
        policy: dataset_rt_core::sampler::RankPolicy::Pad,
        io_depth: dataset_rt_core::dataset::DEFAULT_IO_DEPTH,
        read_ahead_bytes: dataset_rt_core::dataset::DEFAULT_READ_AHEAD_BYTES,
    };
    let spec = ProducerSpec {
        ctl_name: String::new(),
        cache_dirs: dirs,
        remote: Vec::new(),
        shards: ShardTable::of(&ds).unwrap(),
        fingerprint: ds.fingerprint().to_owned(),
        cache_fingerprints: ds
            .caches
            .iter()
            .map(|c| c.manifest.fingerprint.clone())
            .collect(),
        weights_fingerprint: WeightTable::uniform().fingerprint,
        weights_file: None,
        seed: SEED,
        shuffle: true,
        epoch_len: None,
        prefetch_size: 1,
        io_depth: 4,
        read_ahead_bytes: 1 << 20,
        verify: VerifyPolicy::Once,
        verified: None,
        threads: 1,
        persistent: false,
    };
    Setup {
        _dir: dir,
        ds,
        opts,
        spec,
    }
}

/// Creates the pass's segments. The owner pid is this process's parent: the producer and the
/// consumer check, in every wait, that their parent is the owner, as in real child processes.
fn create_ring(s: &Setup, slot_size: u64) -> Ring {
    let epoch_len = s.ds.epoch_len(&s.opts);
    let rank_samples = s.opts.split().rank_len(epoch_len, 0);
    let pass = Pass {
        total_batches: rank_samples.div_ceil(BATCH),
        batch_size: BATCH,
        rank_samples,
        epoch: EPOCH,
        start: 0,
        epoch_len,
        rank: 0,
        world_size: 1,
        policy: POLICY_PAD,
        expected_attach: 2,
    };
    let geometry = Geometry {
        num_slots: 2,
        slot_size,
        max_consumers: 1,
    };
    // SAFETY: getppid cannot fail.
    let owner = unsafe { libc::getppid() } as u64;
    lifecycle::create_ring(owner, geometry, pass).unwrap()
}

/// (global index, cache, row, metadata bytes, payload, whether it came as a shard reference)
/// of every sample the consumer received, in order.
type Received = Vec<(u64, u32, u64, Vec<u8>, Vec<u8>, bool)>;

/// What the consumer received, the bytes each batch used in its slot (in batch order), and the
/// error that ended the pass.
fn consume(ctl_name: &str, shards: &ShardTable) -> (Received, Vec<Vec<u8>>, Option<ShmError>) {
    let lens = shards.lens();
    let ring = lifecycle::attach(ctl_name).unwrap();
    ring.register_consumer(0, u64::from(std::process::id()))
        .unwrap();
    ring.mark_attached();
    let mut got = Vec::new();
    let mut slots = Vec::new();
    while let Ticket::Batch(t) = ring.take_ticket() {
        loop {
            match ring.wait_ready(t, POLL, Role::Child, Some(0)) {
                Ok(true) => break,
                Ok(false) => continue,
                Err(e) => return (got, slots, Some(e)),
            }
        }
        let slot = ring.slot(t);
        let used = u64::from_le_bytes(slot[B_USED..B_USED + 8].try_into().unwrap());
        slots.push(slot[..used as usize].to_vec());
        for e in read_batch(slot, t, &lens).unwrap() {
            let meta = slot[e.meta_off as usize..][..e.meta_len as usize].to_vec();
            let (data, is_ref) = match e.payload {
                Payload::Slot { off, len } => {
                    (slot[off as usize..][..len as usize].to_vec(), false)
                }
                Payload::Shard(r) => {
                    let mut data = vec![0u8; r.len as usize];
                    let file = shards.open(e.cache, r.shard).unwrap();
                    file.read_exact_at(&mut data, r.offset).unwrap();
                    (data, true)
                }
            };
            got.push((e.global, e.cache, e.row, meta, data, is_ref));
        }
        ring.release(t, Some(0)).unwrap();
        // The single consumer plays the training loop too: batches arrive in order.
        plan::mark_delivered(&ring, t).unwrap();
    }
    (got, slots, None)
}

/// Runs the producer and the consumer threads to the end: (the producer's result, what the
/// consumer received, the error that ended its loop).
fn run_pass(s: &Setup, ring: &Ring) -> (dataset_rt_loader::Result<()>, Received, Option<ShmError>) {
    let (produced, got, _, error) = run_pass_with(&s.spec, ring);
    (produced, got, error)
}

/// As `run_pass` with the producer spec `spec`, also returning the bytes of every slot.
fn run_pass_with(
    spec: &ProducerSpec,
    ring: &Ring,
) -> (
    dataset_rt_loader::Result<()>,
    Received,
    Vec<Vec<u8>>,
    Option<ShmError>,
) {
    let mut spec = spec.clone();
    spec.ctl_name = ring.ctl_name().to_owned();
    std::thread::scope(|scope| {
        let producer = scope.spawn(|| producer::run(&spec, None));
        let consumer = scope.spawn(|| consume(ring.ctl_name(), &spec.shards));
        let (got, slots, error) = consumer.join().unwrap();
        (producer.join().unwrap(), got, slots, error)
    })
}

#[test]
fn a_pass_delivers_the_epoch_order_with_every_byte() {
    let s = setup();
    let slot_size = slot_size_for(max_sample_bytes(&s.ds).unwrap(), BATCH);
    let ring = create_ring(&s, slot_size);
    let names = [ring.ctl_name().to_owned(), ring.ring_name().to_owned()];
    let (produced, got, error) = run_pass(&s, &ring);
    produced.unwrap();
    assert!(error.is_none(), "{error:?}");
    // The last party to attach removed both names.
    assert!(names.iter().all(|n| !segment::path_of(n).exists()));

    let order =
        s.ds.try_order(&s.opts, &WeightTable::uniform(), EPOCH)
            .unwrap();
    assert_eq!(order.len(), 17);
    assert_eq!(
        got.iter().map(|g| g.0).collect::<Vec<_>>(),
        order.iter().collect::<Vec<_>>()
    );
    for (global, cache, row, meta, data, is_ref) in &got {
        let (c, r) = s.ds.locate(*global);
        assert_eq!((*cache as usize, *row), (c, r));
        let source = &s.ds.caches[c];
        assert_eq!(data, &payload(c, r), "payload of sample {global}");
        // The raw cache's records travel as references, the LZ4 cache's decompressed.
        let compressed = source.entry(r).stored_len < source.entry(r).raw_len;
        assert_eq!(*is_ref, !compressed, "sample {global}");
        assert_eq!(*is_ref, c == 0 || !compressed, "sample {global}");
        assert_eq!(data[..], source.payload(r).unwrap()[..]);
        assert_eq!(
            meta,
            &encode_metadata(source.metadata().unwrap().row(r)).unwrap()
        );
    }
    assert!(s.ds.caches[1].entry(6).stored_len < s.ds.caches[1].entry(6).raw_len);
    assert_eq!(ring.progress(), (EPOCH, 17, true));
}

#[test]
fn a_corrupt_record_stops_the_pass_at_its_batch() {
    corrupt_record_stops_the_pass_at_its_batch(1, 1);
}

#[test]
fn a_corrupt_record_read_ahead_by_several_threads_stops_the_pass_at_its_batch() {
    // The damaged sample is read long before its batch is filled; its error still waits for
    // its turn, after every good sample before it was delivered.
    corrupt_record_stops_the_pass_at_its_batch(4, 16);
}

fn corrupt_record_stops_the_pass_at_its_batch(threads: usize, prefetch_size: usize) {
    let mut s = setup();
    s.spec.threads = threads;
    s.spec.prefetch_size = prefetch_size;
    let order =
        s.ds.try_order(&s.opts, &WeightTable::uniform(), EPOCH)
            .unwrap();
    // Damage the payload of the pass's 8th sample (batch 2) in its shard file.
    let (c, row) = s.ds.locate(order.at(7));
    let cache = &s.ds.caches[c];
    let (entry, _, start) = cache.verify_record(row).unwrap();
    flip_byte(&cache.shard_path(entry.shard), start);

    let ring = create_ring(&s, 64 * 1024);
    let (produced, got, error) = run_pass(&s, &ring);
    assert!(
        matches!(produced, Err(dataset_rt_loader::Error::Core(_))),
        "{produced:?}"
    );
    assert_eq!(got.len(), 6, "batches 0 and 1 arrived");
    match error {
        Some(ShmError::ProducerFailed { batch: 2, text, .. }) => {
            assert!(
                text.contains("checksum") || text.contains("corrupt"),
                "{text}"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn several_threads_fill_the_same_slots_as_one_thread() {
    // Enough samples for many pool jobs ahead of the fill, raw and LZ4 mixed by the shuffle.
    let mut s = setup_sized(150, 130);
    let slot_size = slot_size_for(max_sample_bytes(&s.ds).unwrap(), BATCH);
    let ring = create_ring(&s, slot_size);
    let (produced, one_thread, one_thread_slots, error) = run_pass_with(&s.spec, &ring);
    produced.unwrap();
    assert!(error.is_none(), "{error:?}");
    let order =
        s.ds.try_order(&s.opts, &WeightTable::uniform(), EPOCH)
            .unwrap();
    assert_eq!(
        one_thread.iter().map(|g| g.0).collect::<Vec<_>>(),
        order.iter().collect::<Vec<_>>()
    );
    assert_eq!(one_thread_slots.len() as u64, 280u64.div_ceil(BATCH));

    // (threads, prefetch_size): one sample per job, a few per job, the chunk limit of 256, and
    // a window smaller than the thread count.
    for (threads, prefetch_size) in [(4, 8), (3, 64), (2, 1024), (8, 2)] {
        s.spec.threads = threads;
        s.spec.prefetch_size = prefetch_size;
        let ring = create_ring(&s, slot_size);
        let (produced, got, slots, error) = run_pass_with(&s.spec, &ring);
        produced.unwrap();
        assert!(error.is_none(), "{threads} threads: {error:?}");
        assert_eq!(
            got, one_thread,
            "{threads} threads, prefetch {prefetch_size}"
        );
        assert_eq!(
            slots, one_thread_slots,
            "{threads} threads, prefetch {prefetch_size}: the slots differ"
        );
        assert_eq!(ring.progress(), (EPOCH, 280, true));
    }
}

#[test]
fn a_spec_without_threads_is_refused() {
    let mut s = setup();
    s.spec.threads = 0;
    let ring = create_ring(&s, 64 * 1024);
    let (produced, got, error) = run_pass(&s, &ring);
    assert!(got.is_empty());
    let text = produced.unwrap_err().to_string();
    assert!(text.contains("0 threads"), "{text}");
    match error {
        Some(ShmError::ProducerFailed { text, .. }) => {
            assert!(text.contains("0 threads"), "{text}")
        }
        other => panic!("{other:?}"),
    }
}

/// `owner`'s verified set as the training process passes it down: a copy of its memfd.
fn passed_down(owner: &Dataset) -> SharedVerified {
    let fd = owner
        .shared_verified_fd()
        .expect("a dataset under Once shares its set")
        .try_clone_to_owned()
        .unwrap()
        .into_raw_fd();
    SharedVerified {
        fd,
        samples: owner.len(),
    }
}

#[test]
fn the_producer_marks_and_skips_in_the_training_process_set() {
    let mut s = setup();
    let owner = Dataset::new(s.ds.caches.clone()).with_verify(VerifyPolicy::Once);
    let len = owner.len();
    // The training process verified sample 3 itself; the producer reads the rest.
    owner.fetch(3).unwrap();
    let slot_size = slot_size_for(max_sample_bytes(&s.ds).unwrap(), BATCH);
    // Sample 3 of the raw cache is corrupted after the owner verified it: the producer, sharing
    // the owner's set, does not hash it again (the documented limit of "once")...
    let cache = &s.ds.caches[0];
    let (entry, _, start) = cache.verify_record(3).unwrap();
    write_at(&cache.shard_path(entry.shard), start, &[0xee]);
    s.spec.verified = Some(passed_down(&owner));
    let ring = create_ring(&s, slot_size);
    let (produced, got, error) = run_pass(&s, &ring);
    produced.unwrap();
    assert!(error.is_none(), "{error:?}");
    assert_eq!(got.len() as u64, len);
    // ...and everything it verified is marked in the owner's set.
    assert_eq!(owner.verified_count(), Some(len));
    // A producer with a set of its own hashes it and stops there.
    s.spec.verified = None;
    let ring = create_ring(&s, slot_size);
    let (produced, _, _) = run_pass(&s, &ring);
    let text = produced.unwrap_err().to_string();
    assert!(text.contains("sample 3: checksum mismatch"), "{text}");
}

/// Spoils the set a spec passes down.
type Spoil<'a> = dyn Fn(&mut SharedVerified) + 'a;

#[test]
fn a_producer_refuses_a_set_it_cannot_use() {
    let mut s = setup();
    let owner = Dataset::new(s.ds.caches.clone()).with_verify(VerifyPolicy::Once);
    let tmp = tempfile::tempfile().unwrap();
    let wrong_len = |shared: &mut SharedVerified| shared.samples += 64;
    let not_memfd = |shared: &mut SharedVerified| {
        // SAFETY: closes the test's own copy; the number then names the temporary file.
        unsafe { libc::close(shared.fd) };
        shared.fd = tmp.as_raw_fd();
    };
    let cases: [(&Spoil<'_>, &str); 2] = [
        (&wrong_len, "holds 8 bytes; the set of 81 samples takes 16"),
        (&not_memfd, "not a memfd"),
    ];
    for (spoil, why) in cases {
        let mut shared = passed_down(&owner);
        spoil(&mut shared);
        s.spec.verified = Some(shared);
        let ring = create_ring(&s, 64 * 1024);
        let (produced, got, error) = run_pass(&s, &ring);
        assert!(got.is_empty());
        let text = produced.unwrap_err().to_string();
        let what = format!(
            "the training process's set of verified samples (fd {}, {} samples)",
            shared.fd, shared.samples
        );
        assert!(text.contains(&what) && text.contains(why), "{text}");
        match error {
            Some(ShmError::ProducerFailed { text, .. }) => assert!(text.contains(why), "{text}"),
            other => panic!("{other:?}"),
        }
    }
    // A set under a policy that keeps none.
    s.spec.verified = Some(passed_down(&owner));
    s.spec.verify = VerifyPolicy::Always;
    let ring = create_ring(&s, 64 * 1024);
    let text = run_pass(&s, &ring).0.unwrap_err().to_string();
    assert!(text.contains("under verify=\"always\""), "{text}");
}

/// Takes, receives and delivers every batch of the current pass on `ring`: the global indices
/// in the order received.
fn receive_pass(ring: &Ring, shard_lens: &[Vec<u64>]) -> Vec<u64> {
    let mut got = Vec::new();
    while let Ticket::Batch(t) = ring.take_ticket() {
        while !ring.wait_ready(t, POLL, Role::Child, Some(0)).unwrap() {}
        got.extend(
            read_batch(ring.slot(t), t, shard_lens)
                .unwrap()
                .iter()
                .map(|e| e.global),
        );
        ring.release(t, Some(0)).unwrap();
        plan::mark_delivered(ring, t).unwrap();
    }
    got
}

#[test]
fn a_persistent_producer_fills_pass_after_pass_until_stopped() {
    let mut s = setup();
    s.spec.persistent = true;
    let slot_size = slot_size_for(max_sample_bytes(&s.ds).unwrap(), BATCH);
    let ring = create_ring(&s, slot_size);
    s.spec.ctl_name = ring.ctl_name().to_owned();
    let first = ring.pass();
    let order = |epoch| {
        s.ds.try_order(&s.opts, &WeightTable::uniform(), epoch)
            .unwrap()
            .iter()
            .collect::<Vec<_>>()
    };
    std::thread::scope(|scope| {
        let producer = scope.spawn(|| producer::run(&s.spec, None));
        let consumer = lifecycle::attach(ring.ctl_name()).unwrap();
        consumer
            .register_consumer(0, u64::from(std::process::id()))
            .unwrap();
        consumer.mark_attached();
        assert_eq!(receive_pass(&consumer, &s.spec.shards.lens()), order(EPOCH));
        // The next epoch, then a resume in the middle of a later one, on the same segments.
        let full = order(EPOCH + 1);
        ring.begin_next_pass(Pass {
            epoch: EPOCH + 1,
            ..first
        })
        .unwrap();
        assert_eq!(receive_pass(&consumer, &s.spec.shards.lens()), full);
        let start = 7;
        let rank_samples = first.epoch_len - start;
        ring.begin_next_pass(Pass {
            epoch: EPOCH + 5,
            start,
            rank_samples,
            total_batches: rank_samples.div_ceil(BATCH),
            ..first
        })
        .unwrap();
        assert_eq!(
            receive_pass(&consumer, &s.spec.shards.lens()),
            order(EPOCH + 5)[start as usize..]
        );
        assert_eq!(ring.progress(), (EPOCH + 5, first.epoch_len, true));
        // Idle between passes, the producer leaves at once when stopped.
        std::thread::sleep(std::time::Duration::from_millis(50));
        assert!(
            !producer.is_finished(),
            "the producer waits for the next pass"
        );
        ring.stop();
        producer.join().unwrap().unwrap();
    });
}

#[test]
fn the_shard_table_names_the_files_the_core_reads() {
    let s = setup();
    let table = &s.spec.shards;
    assert_eq!(table.caches.len(), 2);
    for (c, cache) in s.ds.caches.iter().enumerate() {
        assert_eq!(table.caches[c].shards.len(), cache.num_shards());
        for shard in 0..cache.num_shards() as u32 {
            assert_eq!(
                table.path(c as u32, shard).unwrap(),
                cache.shard_path(shard)
            );
            assert_eq!(table.lens()[c][shard as usize], cache.shard_len(shard));
            table.open(c as u32, shard).unwrap();
            // The consumers' map: the validated bytes of the very file, nothing past them.
            let map = table.map(c as u32, shard).unwrap();
            assert_eq!(map.len() as u64, cache.shard_len(shard));
            assert_eq!(
                &map[..],
                &std::fs::read(cache.shard_path(shard)).unwrap()[..]
            );
        }
    }
    assert!(table.path(0, cache_shards(&s, 0)).is_none());
    assert!(table.path(2, 0).is_none());
    let text = table.open(2, 0).unwrap_err().to_string();
    assert!(text.contains("not in the loader's shard table"), "{text}");
    // The spec carries it to the producer as JSON.
    let json = serde_json::to_string(&s.spec).unwrap();
    let back: ProducerSpec = serde_json::from_str(&json).unwrap();
    assert_eq!(&back.shards, table);
}

fn cache_shards(s: &Setup, c: usize) -> u32 {
    s.ds.caches[c].num_shards() as u32
}

#[test]
fn a_replaced_shard_file_is_refused_by_the_consumers_and_the_producer() {
    let s = setup();
    let path = s.ds.caches[0].shard_path(0);
    // The same bytes in a new file renamed over the old one: the caches still open and match
    // the fingerprint, but the file is not the one the training process validated.
    let copy = path.with_extension("new");
    std::fs::copy(&path, &copy).unwrap();
    std::fs::rename(&copy, &path).unwrap();
    let text = s.spec.shards.open(0, 0).unwrap_err().to_string();
    assert!(
        text.contains("is malformed")
            && text.contains(&path.display().to_string())
            && text.contains("replaced since the dataset was opened"),
        "{text}"
    );
    // The other cache's shards are untouched.
    s.spec.shards.open(1, 0).unwrap();

    let ring = create_ring(&s, 64 * 1024);
    let (produced, got, error) = run_pass(&s, &ring);
    assert!(got.is_empty());
    let text = produced.unwrap_err().to_string();
    assert!(
        text.contains("replaced since the dataset was opened"),
        "{text}"
    );
    match error {
        Some(ShmError::ProducerFailed { kind, text, .. }) => {
            assert_eq!(kind, dataset_rt_core::ErrorKind::Malformed.code());
            assert!(text.contains("replaced"), "{text}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_truncated_shard_file_is_refused_by_the_consumers() {
    let s = setup();
    let path = s.ds.caches[0].shard_path(0);
    let len = s.ds.caches[0].shard_len(0);
    set_len(&path, len - 1);
    let text = s.spec.shards.open(0, 0).unwrap_err().to_string();
    assert!(
        text.contains("truncated since the dataset was opened")
            && text.contains(&format!("{} bytes", len - 1)),
        "{text}"
    );
    let mapped = s.spec.shards.map(0, 0).unwrap_err().to_string();
    assert_eq!(mapped, text, "the map is refused as the open is");
    // Grown is fine: references are bounded by the validated size, and that much is there.
    set_len(&path, len + 10);
    s.spec.shards.open(0, 0).unwrap();
    assert_eq!(s.spec.shards.map(0, 0).unwrap().len() as u64, len);
}

#[test]
fn a_replaced_index_or_metadata_file_is_refused_by_the_producer() {
    for file in ["index.bin", "metadata.arrow"] {
        let s = setup();
        let path = s.ds.caches[0].dir.join(file);
        // The same bytes in a new file renamed over the old one: the manifest (and so the
        // fingerprint) is unchanged, but the producer would read entries the training process
        // never validated, against verified bits it set on its own index.
        let copy = path.with_extension("new");
        std::fs::copy(&path, &copy).unwrap();
        std::fs::rename(&copy, &path).unwrap();
        let ring = create_ring(&s, 64 * 1024);
        let (produced, got, error) = run_pass(&s, &ring);
        assert!(got.is_empty(), "{file}");
        let text = produced.unwrap_err().to_string();
        assert!(
            text.contains(&path.display().to_string())
                && text.contains("replaced since the dataset was opened"),
            "{text}"
        );
        match error {
            Some(ShmError::ProducerFailed { kind, .. }) => {
                assert_eq!(kind, dataset_rt_core::ErrorKind::Malformed.code());
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_cache_written_again_under_the_loader_is_named_by_the_producer() {
    let s = setup();
    // The second cache is written again with other samples where it was.
    let dir = s.ds.caches[1].dir.clone();
    std::fs::remove_dir_all(&dir).unwrap();
    write(
        dir.parent().unwrap(),
        "lz4",
        1,
        9,
        Compression::new("lz4", 1.0).unwrap(),
    );
    let ring = create_ring(&s, 64 * 1024);
    let (produced, got, error) = run_pass(&s, &ring);
    assert!(got.is_empty());
    let text = produced.unwrap_err().to_string();
    let now = Cache::open(&dir, Validation::Structure).unwrap();
    // A malformed cache naming its manifest, as a replaced index or shard is.
    for part in [
        format!(
            "cache \"lz4\" is malformed: {}",
            dir.join("manifest.json").display()
        ),
        "replaced since the dataset was opened".to_owned(),
        format!("fingerprint {} now", now.manifest.fingerprint),
        format!("{} then", s.ds.caches[1].manifest.fingerprint),
        "open the dataset again".to_owned(),
    ] {
        assert!(text.contains(&part), "{part:?} missing from: {text}");
    }
    match error {
        Some(ShmError::ProducerFailed { kind, .. }) => {
            assert_eq!(kind, dataset_rt_core::ErrorKind::Malformed.code());
        }
        other => panic!("{other:?}"),
    }
    // The cache that did not change is not named.
    assert!(!text.contains("\"raw\""), "{text}");
}

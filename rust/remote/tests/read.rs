//! Reading a published cache in place: byte-identical epochs against the local copy, many
//! requests in flight, a second epoch served by the node's cache, the budget held, and damage on
//! the server named (over an in-memory store with injected faults and delays).

mod common;

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::{write_cache, Fault, FaultStore};
use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::{Dataset, EpochReader, ReadOptions, WeightTable, DEFAULT_IO_DEPTH};
use dataset_rt_core::pool::Pool;
use dataset_rt_core::verify::VerifyPolicy;
use dataset_rt_core::Error as CoreError;
use dataset_rt_remote::{
    open_remote_cache, push, OpenedCache, PushOptions, Remote, RemoteOptions, RANGE_HEADER_LEN,
};
use object_store::memory::InMemory;

const URL: &str = "s3://bucket/data/train";
const SAMPLES: usize = 300;
const PAYLOAD: usize = 3000;

struct Setup {
    _tmp: tempfile::TempDir,
    local: Arc<Dataset>,
    store: Arc<FaultStore>,
    remote: Remote,
    node: std::path::PathBuf,
}

fn setup() -> Setup {
    let tmp = tempfile::tempdir().unwrap();
    let dir = write_cache(
        &tmp.path().join("src"),
        "train",
        SAMPLES,
        PAYLOAD,
        64 * 1024,
        3,
    );
    let store = FaultStore::new(Arc::new(InMemory::new()));
    let remote = Remote::with_store(URL, store.clone(), &RemoteOptions::default()).unwrap();
    push(&dir, &remote, &PushOptions::default()).unwrap();
    let local = Cache::open(&dir, Validation::Structure).unwrap();
    Setup {
        local: Arc::new(Dataset::new(vec![Arc::new(local)])),
        node: tmp.path().join("node"),
        _tmp: tmp,
        store,
        remote,
    }
}

fn open(s: &Setup, budget: Option<u64>) -> (OpenedCache, Arc<Dataset>) {
    let options = RemoteOptions {
        local_dir: Some(s.node.clone()),
        max_local_bytes: budget,
        ..RemoteOptions::default()
    };
    let opened = open_remote_cache(&s.remote, &options).unwrap();
    let ds = Dataset::new(vec![opened.cache.clone()]).with_verify(VerifyPolicy::Once);
    (opened, Arc::new(ds))
}

/// The bytes of every sample of epoch `epoch`, in pass order, or the first error.
fn epoch(ds: &Arc<Dataset>, epoch: u64) -> Result<Vec<Vec<u8>>, CoreError> {
    epoch_at_depth(ds, epoch, DEFAULT_IO_DEPTH)
}

/// [`epoch`] with `io_depth` records planned ahead at most.
fn epoch_at_depth(
    ds: &Arc<Dataset>,
    epoch: u64,
    io_depth: usize,
) -> Result<Vec<Vec<u8>>, CoreError> {
    epoch_within(ds, epoch, io_depth, ReadOptions::new(5, true).prefetch_size)
}

/// [`epoch_at_depth`] with `prefetch_size` samples read ahead of the consumer at most.
fn epoch_within(
    ds: &Arc<Dataset>,
    epoch: u64,
    io_depth: usize,
    prefetch_size: usize,
) -> Result<Vec<Vec<u8>>, CoreError> {
    let pool = Pool::new(2).unwrap();
    let opts = ReadOptions {
        io_depth,
        prefetch_size,
        ..ReadOptions::new(5, true)
    };
    let order = ds.try_order(&opts, &WeightTable::uniform(), epoch).unwrap();
    let mut reader = EpochReader::new(pool, ds.clone(), Arc::new(order), &opts, epoch, 0);
    let mut out = Vec::new();
    while let Some(chunk) = reader.next_chunk() {
        for fetched in chunk? {
            out.push(ds.fetched_data(fetched).into_owned());
        }
    }
    Ok(out)
}

#[test]
fn epochs_are_byte_identical_with_requests_in_flight_and_the_second_is_served_locally() {
    let s = setup();
    *s.store.every_get.lock().unwrap() = Some(Fault::Delay(Duration::from_millis(15)));
    let (opened, remote) = open(&s, None);
    assert_eq!(remote.fingerprint(), s.local.fingerprint());
    // Errors name a remote cache by its URL, a local one by its directory.
    assert_eq!(opened.cache.location(), URL);
    assert_eq!(
        s.local.caches[0].location(),
        s.local.caches[0].dir.display().to_string()
    );
    let gets_at_open = s.store.gets.load(Ordering::Relaxed);
    let first = epoch(&remote, 0).unwrap();
    assert_eq!(first, epoch(&s.local, 0).unwrap());
    assert_eq!(first.len(), SAMPLES);
    // The planner kept many requests in flight against a slow store.
    let most = s.store.max_in_flight.load(Ordering::Relaxed);
    assert!(most >= 4, "at most {most} requests in flight");
    let after_first = s.store.gets.load(Ordering::Relaxed);
    assert!(after_first > gets_at_open);
    // Another epoch (another order) of the same records: every one is in the node's cache.
    assert_eq!(epoch(&remote, 1).unwrap(), epoch(&s.local, 1).unwrap());
    assert_eq!(s.store.gets.load(Ordering::Relaxed), after_first);
    let stats = opened.records.fetch_stats();
    assert!(stats.bytes as usize >= SAMPLES * PAYLOAD, "{stats:?}");
}

/// The bytes of every file under `dir` but bookkeeping (the `usage` file, and the proofs of
/// life and lists of pins under `procs/`), which the budget leaves out.
fn bytes_under(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    entries
        .flatten()
        .filter(|e| e.file_name() != "usage" && e.file_name() != "procs")
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => bytes_under(&e.path()),
            Ok(_) => e.metadata().map_or(0, |m| m.len()),
            Err(_) => 0,
        })
        .sum()
}

#[test]
fn the_local_budget_holds_and_the_epochs_stay_exact() {
    let s = setup();
    let budget = (SAMPLES * PAYLOAD / 4) as u64; // a quarter of the dataset
    let (_opened, remote) = open(&s, Some(budget));
    for e in 0..2 {
        assert_eq!(epoch(&remote, e).unwrap(), epoch(&s.local, e).unwrap());
        // The bytes on disk under the local directory (stored ranges, writes in flight whose
        // prefetches may still run, the local copy of index and metadata, bookkeeping), not
        // the cache's own count.
        let used = bytes_under(&s.node);
        assert!(used <= budget, "{used} bytes in a budget of {budget}");
    }
}

#[test]
fn transient_faults_recover_and_damage_on_the_server_is_named() {
    let s = setup();
    let (_, remote) = open(&s, None);
    s.store
        .get_faults
        .lock()
        .unwrap()
        .extend([Fault::Transient, Fault::Truncate, Fault::Corrupt]);
    assert_eq!(epoch(&remote, 0).unwrap(), epoch(&s.local, 0).unwrap());

    // A cache opened in another node directory, against a store that damages every body.
    let s2 = setup();
    let (_, remote) = open(&s2, None);
    *s2.store.every_get.lock().unwrap() = Some(Fault::Corrupt);
    match epoch(&remote, 0) {
        Err(CoreError::CorruptRecord { shard, reason, .. }) => {
            let shard = shard.display().to_string();
            assert!(
                shard.starts_with(URL) && shard.contains("shards/"),
                "{shard}"
            );
            assert!(reason.contains("fetched"), "{reason}");
        }
        other => panic!(
            "expected a corrupt record, got {:?}",
            other.map(|e| e.len())
        ),
    }
}

/// Flips one byte of row `row`'s payload in its shard object on the server, for good.
fn damage_on_the_server(s: &Setup, cache: &Cache, row: u64) {
    let (shard, offset, len) = cache.record_extent(row).unwrap();
    flip_on_the_server(s, &format!("shards/{shard:06}.bin"), offset + len - 1);
}

/// Flips byte `at` of the object whose key ends with `name` on the server.
fn flip_on_the_server(s: &Setup, name: &str, at: u64) {
    edit_on_the_server(s, name, |bytes| {
        let bytes = bytes.as_mut().unwrap();
        bytes[at as usize] ^= 0x5a;
    });
}

/// Changes the bytes of the object whose key ends with `name` on the server; `None` deletes it.
fn edit_on_the_server(s: &Setup, name: &str, edit: impl FnOnce(&mut Option<Vec<u8>>)) {
    use dataset_rt_remote::runtime::block_on;
    use futures::TryStreamExt;
    use object_store::{ObjectStore, ObjectStoreExt};
    let listed = block_on(s.store.inner.list(None).try_collect::<Vec<_>>())
        .unwrap()
        .unwrap();
    let key = listed
        .into_iter()
        .map(|m| m.location)
        .find(|k| k.as_ref().ends_with(name))
        .unwrap();
    let got = block_on(s.store.inner.get(&key)).unwrap().unwrap();
    let mut bytes = Some(block_on(got.bytes()).unwrap().unwrap().to_vec());
    edit(&mut bytes);
    match bytes {
        Some(bytes) => block_on(s.store.inner.put(&key, bytes.into()))
            .unwrap()
            .map(drop),
        None => block_on(s.store.inner.delete(&key)).unwrap(),
    }
    .unwrap();
}

#[test]
fn a_shard_object_missing_or_cut_short_on_the_server_is_a_corrupt_record_at_its_sample() {
    let records = Some((SAMPLES * PAYLOAD / 2) as u64);
    for (budget, cut) in [
        (None, None),
        (None, Some(1000)),
        (records, Some(20_000)),
        (records, None),
    ] {
        let s = setup();
        let (opened, remote) = open(&s, budget);
        assert_eq!(opened.records.fetches_blocks(), budget.is_none());
        edit_on_the_server(&s, "shards/000001.bin", |bytes| match cut {
            Some(cut) => bytes.as_mut().unwrap().truncate(cut),
            None => *bytes = None,
        });
        // The first record of shard 1 that is not whole on the server.
        let first_bad = (0..SAMPLES as u64)
            .find(|&row| {
                let (shard, offset, len) = opened.cache.record_extent(row).unwrap();
                shard == 1 && cut.is_none_or(|cut| offset + len > cut as u64)
            })
            .unwrap();
        let (local, _) = in_order_from(&s.local, 0);
        let (served, err) = in_order_from(&remote, 0);
        assert_eq!(served[..], local[..served.len()], "{cut:?}");
        match err {
            Some(CoreError::CorruptRecord {
                sample,
                shard,
                reason,
                ..
            }) => {
                assert_eq!(sample, first_bad, "{cut:?}: {reason}");
                assert!(shard.display().to_string().ends_with("shards/000001.bin"));
                let why = match cut {
                    Some(_) => "shorter than the manifest says",
                    None => "does not exist, though the manifest lists it",
                };
                assert!(reason.contains(why), "{cut:?}: {reason}");
            }
            other => panic!("{cut:?}: expected a corrupt record, got {other:?}"),
        }
    }
}

/// The pass of epoch 0 in storage order from position `start`: the records served before the
/// first error, and that error.
fn in_order_from(ds: &Arc<Dataset>, start: u64) -> (Vec<Vec<u8>>, Option<CoreError>) {
    let opts = ReadOptions::new(5, false);
    let order = ds.try_order(&opts, &WeightTable::uniform(), 0).unwrap();
    let pool = Pool::new(2).unwrap();
    let mut reader = EpochReader::new(pool, ds.clone(), Arc::new(order), &opts, 0, start);
    let mut served = Vec::new();
    while let Some(chunk) = reader.next_chunk() {
        match chunk {
            Ok(fetched) => {
                served.extend(fetched.into_iter().map(|f| ds.fetched_data(f).into_owned()))
            }
            Err(e) => return (served, Some(e)),
        }
    }
    (served, None)
}

#[test]
fn a_record_damaged_on_the_server_is_named_at_its_sample_and_its_block_is_served_around_it() {
    let s = setup();
    let (opened, remote) = open(&s, None);
    assert!(opened.records.fetches_blocks());
    let damaged = 7;
    damage_on_the_server(&s, &opened.cache, damaged);
    let (local, none) = in_order_from(&s.local, 0);
    assert!(none.is_none());
    let (served, err) = in_order_from(&remote, 0);
    // The records before it in the pass (of the same block) were served, intact.
    assert_eq!(served[..], local[..served.len()]);
    match err {
        Some(CoreError::CorruptRecord {
            sample,
            offset,
            shard,
            reason,
            ..
        }) => {
            let (_, at, _) = opened.cache.record_extent(damaged).unwrap();
            assert_eq!((sample, offset), (damaged, at), "{reason}");
            let shard = shard.display().to_string();
            assert!(shard.starts_with(URL), "{shard}");
            assert!(reason.contains("fetched"), "{reason}");
        }
        other => panic!("expected a corrupt record, got {other:?}"),
    }
    // The records after it, of its block and the others, are served intact.
    let (after, none) = in_order_from(&remote, damaged + 1);
    assert!(none.is_none(), "{none:?}");
    assert_eq!(after[..], local[damaged as usize + 1..]);
}

#[test]
fn an_index_damaged_on_the_server_is_named_by_its_url_and_never_kept() {
    let s = setup();
    flip_on_the_server(&s, "index.bin", 40);
    let options = RemoteOptions {
        local_dir: Some(s.node.clone()),
        ..RemoteOptions::default()
    };
    let err = match open_remote_cache(&s.remote, &options) {
        Ok(_) => panic!("opened a cache whose index is damaged on the server"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.starts_with(URL) && err.contains("index.bin") && err.contains("fetched 3 times"),
        "{err}"
    );
    let mut kept = Vec::new();
    collect_files(&s.node, &mut kept);
    assert!(!kept.iter().any(|p| p.ends_with("index.bin")), "{kept:?}");
    // Repaired on the server: it opens, and reads as the local copy.
    flip_on_the_server(&s, "index.bin", 40);
    let (_, remote) = open(&s, None);
    assert_eq!(epoch(&remote, 0).unwrap(), epoch(&s.local, 0).unwrap());
}

#[test]
fn processes_opening_one_cache_together_download_its_local_copy_once() {
    let s = setup();
    let options = RemoteOptions {
        local_dir: Some(s.node.clone()),
        ..RemoteOptions::default()
    };
    // Threads open their own file descriptions of the lock, as processes do.
    let start = std::sync::Barrier::new(4);
    std::thread::scope(|scope| {
        for _ in 0..4 {
            scope.spawn(|| {
                start.wait();
                open_remote_cache(&s.remote, &options).unwrap();
            });
        }
    });
    let ranges = s.store.get_ranges.lock().unwrap();
    for file in ["index.bin", "metadata.arrow"] {
        let gets = ranges.iter().filter(|(f, _)| f.ends_with(file)).count();
        assert_eq!(gets, 1, "{file} downloaded {gets} times: {ranges:?}");
    }
}

#[test]
fn a_budget_that_holds_the_dataset_downloads_blocks_with_one_request_each() {
    let s = setup();
    let (opened, remote) = open(&s, None);
    assert!(opened.records.fetches_blocks());
    let shards = opened.cache.num_shards() as u64;
    assert!(shards >= 10, "{shards} shards");
    let before = s.store.gets.load(Ordering::Relaxed);
    assert_eq!(epoch(&remote, 0).unwrap(), epoch(&s.local, 0).unwrap());
    // Every shard (64 KiB) is one block: one request each, not one per record.
    let requests = s.store.gets.load(Ordering::Relaxed) - before;
    assert_eq!(requests, shards, "{requests} requests for {shards} blocks");
    let stats = opened.records.node_cache().stats();
    assert_eq!(stats.stored, shards, "{stats:?}");

    // A stored block damaged on the local disk: the records read from it fail their checks,
    // the block is downloaded again, and the epoch is still exact.
    let ranges = opened.records.node_cache().dir().join("ranges");
    let mut files = Vec::new();
    collect_files(&ranges, &mut files);
    assert_eq!(files.len() as u64, shards);
    for file in &files {
        let mut bytes = std::fs::read(file).unwrap();
        let n = bytes.len();
        bytes[n / 2..].fill(0xA5);
        std::fs::write(file, bytes).unwrap();
    }
    let before = s.store.gets.load(Ordering::Relaxed);
    assert_eq!(epoch(&remote, 1).unwrap(), epoch(&s.local, 1).unwrap());
    let again = s.store.gets.load(Ordering::Relaxed) - before;
    assert!(again >= 1 && again <= shards, "{again} requests");
}

#[test]
fn a_budget_below_the_dataset_downloads_records() {
    let s = setup();
    let budget = (SAMPLES * PAYLOAD / 2) as u64;
    let (opened, remote) = open(&s, Some(budget));
    assert!(!opened.records.fetches_blocks());
    let before = s.store.gets.load(Ordering::Relaxed);
    assert_eq!(epoch(&remote, 0).unwrap(), epoch(&s.local, 0).unwrap());
    // Records are joined only when they are neighbours in storage and in the pass's windows:
    // far more requests than shards.
    let requests = s.store.gets.load(Ordering::Relaxed) - before;
    assert!(
        requests > opened.cache.num_shards() as u64 * 2,
        "{requests}"
    );
}

fn collect_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.file_type().unwrap().is_dir() {
            collect_files(&e.path(), out);
        } else {
            out.push(e.path());
        }
    }
}

#[test]
fn a_block_evicted_and_needed_again_turns_downloads_to_records() {
    let s = setup();
    let (opened, remote) = open(&s, None);
    assert_eq!(epoch(&remote, 0).unwrap(), epoch(&s.local, 0).unwrap());
    assert!(opened.records.fetches_blocks());
    // Every stored block goes (as eviction for another cache sharing the directory would
    // take them): the next pass needs them again, and downloads records instead.
    let mut files = Vec::new();
    collect_files(
        &opened.records.node_cache().dir().join("ranges"),
        &mut files,
    );
    for file in files {
        std::fs::remove_file(file).unwrap();
    }
    assert_eq!(epoch(&remote, 1).unwrap(), epoch(&s.local, 1).unwrap());
    assert!(!opened.records.fetches_blocks());
}

#[test]
fn eviction_keeps_the_records_the_pass_needs_soonest() {
    let s = setup();
    let record = s.local.record_range(0).unwrap().len + RANGE_HEADER_LEN;
    let budget = record * SAMPLES as u64 / 2; // about half the records
    let (opened, remote) = open(&s, Some(budget));
    assert!(!opened.records.fetches_blocks());
    assert_eq!(epoch(&remote, 0).unwrap(), epoch(&s.local, 0).unwrap());
    let node = opened.records.node_cache();
    let mut files = Vec::new();
    collect_files(&node.dir().join("ranges"), &mut files);
    let kept = files.len() as u64;
    assert!(kept >= SAMPLES as u64 / 3, "{kept} records kept");
    let stored = node.stats().stored;
    // Another order: every kept record is needed in it. Eviction takes records already taken
    // (needed no more in this pass) before any kept one, so only the records that were not
    // kept are downloaded again; but for the kept ones evicted to make room for the first
    // window, before any record was taken (the planner's depth at most), and for those evicted
    // while taken records were still held by the chunk that read them (the reading threads'
    // window: no further ahead than the depth), which a loaded machine makes happen.
    const DEPTH: usize = 8;
    assert_eq!(
        epoch_within(&remote, 1, DEPTH, DEPTH).unwrap(),
        epoch(&s.local, 1).unwrap()
    );
    let downloaded = node.stats().stored - stored;
    let window = 2 * DEPTH as u64;
    assert!(
        downloaded <= SAMPLES as u64 - kept + window,
        "{downloaded} records downloaded in the second epoch, {kept} of {SAMPLES} were kept"
    );
}

#[test]
fn the_local_copy_counts_in_the_budget_and_goes_when_nothing_reads_it() {
    let s = setup();
    let (opened, _) = open(&s, None);
    let copy_dir = opened.records.node_cache().dir().join("cache");
    let copy = bytes_under(&copy_dir);
    assert!(copy > 0);
    // A budget that cannot hold the local copy is refused, naming the setting.
    drop(opened);
    let options = RemoteOptions {
        local_dir: Some(s.node.join("tiny")),
        max_local_bytes: Some(copy / 2),
        ..RemoteOptions::default()
    };
    let Err(err) = open_remote_cache(&s.remote, &options) else {
        panic!("a budget of {} bytes opened", copy / 2);
    };
    let err = err.to_string();
    assert!(err.contains("max_local_bytes"), "{err}");
    assert!(err.contains(URL), "{err}");
    // The copy of a build that nothing reads any more is evicted like its downloads, once
    // another build needs the room.
    let other = tempfile::tempdir().unwrap();
    let dir = write_cache(other.path(), "train", SAMPLES, PAYLOAD / 2, 64 * 1024, 4);
    let store = FaultStore::new(Arc::new(InMemory::new()));
    let remote = Remote::with_store(URL, store, &RemoteOptions::default()).unwrap();
    push(&dir, &remote, &PushOptions::default()).unwrap();
    let budget = (SAMPLES * PAYLOAD / 2) as u64;
    let options = RemoteOptions {
        local_dir: Some(s.node.clone()),
        max_local_bytes: Some(budget),
        ..RemoteOptions::default()
    };
    let opened = open_remote_cache(&remote, &options).unwrap();
    let ds = Arc::new(Dataset::new(vec![opened.cache.clone()]).with_verify(VerifyPolicy::Once));
    assert_eq!(epoch(&ds, 0).unwrap().len(), SAMPLES);
    assert!(bytes_under(&copy_dir) < copy, "the idle copy was kept");
    assert!(bytes_under(&s.node) <= budget);
}

#[test]
fn a_record_request_takes_the_neighbours_the_pass_needs_soon_into_room_nothing_needed_holds() {
    let s = setup();
    let dataset = (SAMPLES * PAYLOAD) as u64;
    let budget = dataset / 4;
    let (opened, remote) = open(&s, Some(budget));
    assert!(!opened.records.fetches_blocks());
    let before = s.store.gets.load(Ordering::Relaxed);
    let bytes_before = opened.records.fetch_stats().bytes;
    // A first pass: nothing stored. The planner's window an eighth of the budget, as 64 records of 128 KiB are of 64 MiB.
    assert_eq!(
        epoch_at_depth(&remote, 0, 8).unwrap(),
        epoch(&s.local, 0).unwrap()
    );
    let requests = s.store.gets.load(Ordering::Relaxed) - before;
    // A quarter of the dataset as budget: a request serves about two records (one each
    // without the joins, since a shuffled window of the planner rarely holds neighbours).
    assert!(
        requests * 4 <= SAMPLES as u64 * 3,
        "{requests} requests for {SAMPLES} records"
    );
    // Only records the pass reads are fetched (a few twice, as without the joins).
    let stats = opened.records.fetch_stats();
    let record_bytes: u64 = (0..SAMPLES as u64)
        .map(|i| s.local.record_range(i).unwrap().len)
        .sum();
    let fetched = stats.bytes - bytes_before;
    assert!(
        fetched * 100 <= record_bytes * 105,
        "{fetched} bytes fetched, records {record_bytes}"
    );
    let used = bytes_under(&s.node);
    assert!(used <= budget, "{used} bytes in a budget of {budget}");
    let kept = {
        let mut files = Vec::new();
        collect_files(
            &opened.records.node_cache().dir().join("ranges"),
            &mut files,
        );
        files.len() as u64
    };
    let before = s.store.gets.load(Ordering::Relaxed);
    let bytes_before = opened.records.fetch_stats().bytes;
    let stored = opened.records.node_cache().stats().stored;
    assert_eq!(
        epoch_within(&remote, 1, 8, 8).unwrap(),
        epoch(&s.local, 1).unwrap()
    );
    let requests = s.store.gets.load(Ordering::Relaxed) - before;
    let fetched = opened.records.fetch_stats().bytes - bytes_before;
    let downloaded = opened.records.node_cache().stats().stored - stored;
    // A second pass begins with the records the first one left, needed again, and joins only
    // into the room that the records it reads free: none of those is evicted but for the first
    // windows (the consumer's position moves a chunk at a time, see the eviction test), no
    // record is fetched twice beyond them, and some requests serve two records or more.
    let needed = SAMPLES as u64 - kept;
    assert!(
        downloaded <= needed + 16,
        "{downloaded} records downloaded, {needed} not kept"
    );
    assert!(
        requests * 10 <= downloaded * 9,
        "{requests} requests for {downloaded} records"
    );
    assert!(fetched * 100 <= record_bytes * 105);
    let used = bytes_under(&s.node);
    assert!(used <= budget, "{used} bytes in a budget of {budget}");
}

#[test]
fn a_download_ahead_that_failed_is_reported_by_its_reads_not_tried_again() {
    // A store that fails every request once the cache is open (as one that stopped answering
    // would, after every attempt): each download is tried with its attempts once, by the
    // planner's read-ahead, and the reads waiting for it report its failure. Before, each read
    // tried the download again, and a pass against a silent store lasted one download's
    // attempts per record.
    let s = setup();
    let (_, remote) = open(&s, None);
    *s.store.every_get.lock().unwrap() = Some(Fault::Transient);
    s.store.asked.lock().unwrap().clear();
    let err = epoch(&remote, 0).unwrap_err();
    let mut asked: HashMap<String, usize> = HashMap::new();
    for got in s.store.asked.lock().unwrap().iter() {
        *asked.entry(got.clone()).or_default() += 1;
    }
    assert!(!asked.is_empty());
    for (range, times) in &asked {
        assert!(*times <= 3, "{range:?} was asked for {times} times");
    }
    // The error names the request once, with its attempts.
    let text = err.to_string();
    assert_eq!(text.matches("GET s3://").count(), 1, "{text}");
    assert!(text.contains("3 of at most 3 attempts"), "{text}");
    assert!(matches!(err, CoreError::Io { .. }), "{err:?}");
}

//! The node's local cache: budget, eviction by the known future, pins, damaged files, dead
//! processes' leftovers, and one download per range when two processes share the directory.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use common::FaultStore;
use dataset_rt_remote::{
    CachedFetcher, FetchPolicy, NodeCache, RangeFetcher, RangeKey, RangeRequest, Remote,
    RemoteOptions,
};
use object_store::memory::InMemory;
use object_store::path::Path as Key;
use object_store::throttle::{ThrottleConfig, ThrottledStore};
use object_store::ObjectStoreExt;

const BUILD: &str = "0123456789abcdef0123456789abcdef";
const OTHER_BUILD: &str = "fedcba9876543210fedcba9876543210";

fn key(i: u64) -> RangeKey {
    RangeRequest::new("shards/000000.bin", i * 1000..i * 1000 + 1000)
}

fn bytes_of(i: u64) -> Vec<u8> {
    (0..1000).map(|j| (i * 7 + j) as u8).collect()
}

/// A range file takes its bytes plus a 16-byte header.
const STORED: u64 = 1016;

#[test]
fn the_budget_holds_and_eviction_follows_the_future_order() {
    let dir = tempfile::tempdir().unwrap();
    let cache = NodeCache::open(dir.path(), BUILD, 10 * STORED).unwrap();
    // Ranges 0..20 will be needed in order 19, 18, ..., 0 except 5, which is never needed.
    cache.set_future((0..20).filter(|&i| i != 5).map(|i| (key(i), 19 - i)));
    // Range 0 is needed last but pinned (prefetched, not consumed).
    cache.pin([&key(0)]).unwrap();
    for i in 0..10 {
        assert!(cache.put(&key(i), &bytes_of(i)).unwrap());
    }
    assert_eq!(cache.usage().unwrap(), 10 * STORED);
    for i in 10..13 {
        assert!(cache.put(&key(i), &bytes_of(i)).unwrap());
        assert!(cache.usage().unwrap() <= 10 * STORED);
    }
    // Evicted: 5 (not needed), then 1 and 2 (needed latest); 0 survives, pinned.
    let present: Vec<u64> = (0..13)
        .filter(|&i| cache.get(&key(i)).unwrap().is_some())
        .collect();
    assert_eq!(present, vec![0, 3, 4, 6, 7, 8, 9, 10, 11, 12]);
    assert_eq!(cache.stats().evicted, 3);
    assert_eq!(
        cache.get(&key(3)).unwrap().unwrap().as_ref(),
        &bytes_of(3)[..]
    );
    // Everything pinned: a new range is not stored, and nothing is evicted.
    let all: Vec<RangeKey> = present.iter().map(|&i| key(i)).collect();
    cache.pin(all.iter()).unwrap();
    assert!(!cache.put(&key(13), &bytes_of(13)).unwrap());
    assert_eq!(cache.stats().not_stored, 1);
    // A range larger than the budget is never stored.
    let huge = RangeRequest::new("shards/000001.bin", 0..20_000);
    assert!(!cache.put(&huge, &vec![0; 20_000]).unwrap());
    assert!(cache.usage().unwrap() <= 10 * STORED);
}

#[test]
fn another_process_pins_are_respected_and_other_builds_go_first() {
    let dir = tempfile::tempdir().unwrap();
    let old = NodeCache::open(dir.path(), OTHER_BUILD, 4 * STORED).unwrap();
    for i in 0..2 {
        old.put(&key(i), &bytes_of(i)).unwrap();
    }
    drop(old);
    let a = NodeCache::open(dir.path(), BUILD, 4 * STORED).unwrap();
    let b = NodeCache::open(dir.path(), BUILD, 4 * STORED).unwrap();
    a.put(&key(0), &bytes_of(0)).unwrap();
    a.put(&key(1), &bytes_of(1)).unwrap();
    // `b` pinned range 0; `a` knows nothing of the future, so for `a` any range may go.
    b.pin([&key(0)]).unwrap();
    a.put(&key(2), &bytes_of(2)).unwrap();
    a.put(&key(3), &bytes_of(3)).unwrap();
    // The old build's two ranges made the room.
    let old_left = std::fs::read_dir(
        dir.path()
            .join(OTHER_BUILD)
            .join("ranges/shards/000000.bin"),
    )
    .map(|d| d.count())
    .unwrap_or(0);
    assert_eq!(old_left, 0);
    a.put(&key(4), &bytes_of(4)).unwrap();
    assert!(a.get(&key(0)).unwrap().is_some(), "pinned by b");
    assert!(a.usage().unwrap() <= 4 * STORED);
}

fn present(cache: &NodeCache, keys: std::ops::Range<u64>) -> Vec<u64> {
    keys.filter(|&i| cache.contains(&key(i))).collect()
}

fn ranges_left(root: &std::path::Path, build: &str) -> usize {
    std::fs::read_dir(root.join(build).join("ranges/shards/000000.bin"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn what_was_taken_is_needed_no_more_unless_it_comes_again() {
    let dir = tempfile::tempdir().unwrap();
    let cache = NodeCache::open(dir.path(), BUILD, 4 * STORED).unwrap();
    // Range 0 is needed at positions 0 and 10; ranges 1 to 6 at their own number.
    cache.set_future((0..7).map(|i| (key(i), i)).chain([(key(0), 10)]));
    for i in 0..4 {
        assert!(cache.put(&key(i), &bytes_of(i)).unwrap());
    }
    // The consumer took positions 0 to 2: ranges 1 and 2 are needed no more, range 0 at 10.
    cache.set_now(3);
    assert!(cache.put(&key(4), &bytes_of(4)).unwrap());
    assert!(cache.put(&key(5), &bytes_of(5)).unwrap());
    assert_eq!(present(&cache, 0..7), [0, 3, 4, 5]);
    // Then the furthest: range 0 (position 10), not range 3 (position 3, the next one).
    assert!(cache.put(&key(6), &bytes_of(6)).unwrap());
    assert_eq!(present(&cache, 0..7), [3, 4, 5, 6]);
    // A new future starts over from position 0.
    cache.set_future([(key(3), 1), (key(4), 0), (key(5), 3), (key(6), 2)]);
    assert!(cache.put(&key(7), &bytes_of(7)).unwrap());
    assert_eq!(present(&cache, 0..8), [3, 4, 6, 7]);
}

#[test]
fn caches_of_one_process_rank_each_other_by_their_future() {
    let dir = tempfile::tempdir().unwrap();
    let a = NodeCache::open(dir.path(), BUILD, 4 * STORED).unwrap();
    let b = NodeCache::open(dir.path(), OTHER_BUILD, 4 * STORED).unwrap();
    // Positions of one pass over both caches.
    a.set_future([(key(0), 0), (key(1), 5), (key(2), 3)]);
    b.set_future([(key(0), 1), (key(1), 2), (key(2), 4)]);
    for i in 0..2 {
        assert!(a.put(&key(i), &bytes_of(i)).unwrap());
        assert!(b.put(&key(i), &bytes_of(i)).unwrap());
    }
    // `a` makes room by the future of both: its own range 1 (position 5) goes, not b's.
    assert!(a.put(&key(2), &bytes_of(2)).unwrap());
    assert_eq!(present(&a, 0..3), [0, 2]);
    assert_eq!(present(&b, 0..3), [0, 1]);
    // And `b` takes a's range 2 (position 3), the furthest of what is stored.
    assert!(b.put(&key(2), &bytes_of(2)).unwrap());
    assert_eq!(present(&a, 0..3), [0]);
    assert_eq!(present(&b, 0..3), [0, 1, 2]);
    // Once nothing in the process reads `b`'s build, its ranges go first.
    drop(b);
    assert!(a.put(&key(3), &bytes_of(3)).unwrap());
    assert_eq!(present(&a, 0..4), [0, 3]);
    assert_eq!(ranges_left(dir.path(), OTHER_BUILD), 2);
}

#[test]
fn a_full_directory_is_not_measured_again_for_every_write() {
    let dir = tempfile::tempdir().unwrap();
    let budget = 32 << 20;
    let cache = NodeCache::open(dir.path(), BUILD, budget).unwrap();
    let len = (16 << 10) - 16; // a stored range of 16 KiB
    let range = |i: u64| RangeRequest::new("shards/000000.bin", i * len..(i + 1) * len);
    cache.set_future((0..4096).map(|i| (range(i), i)));
    let bytes = vec![7u8; len as usize];
    for i in 0..4096 {
        assert!(cache.put(&range(i), &bytes).unwrap());
        if i % 256 == 255 {
            assert!(cache.usage().unwrap() <= budget);
        }
    }
    // 2,048 ranges fill the budget; each scan frees a 32nd of it (64 ranges) beyond the write,
    // so the other 2,048 writes scan about 32 times, not 2,048 times.
    let stats = cache.stats();
    assert!(stats.evicted >= 2048, "{stats:?}");
    assert!((30..=40).contains(&stats.scans), "{stats:?}");
    // What was evicted is what is needed furthest ahead: the ranges needed soonest all stayed.
    assert!((0..1900).all(|i| cache.contains(&range(i))));
}

#[test]
fn damaged_files_are_misses_and_dead_processes_leftovers_go() {
    let dir = tempfile::tempdir().unwrap();
    let cache = NodeCache::open(dir.path(), BUILD, 1 << 20).unwrap();
    cache.put(&key(1), &bytes_of(1)).unwrap();
    cache.put(&key(2), &bytes_of(2)).unwrap();
    let ranges = dir.path().join(BUILD).join("ranges/shards/000000.bin");
    // One byte changed, and a file cut short (a crash mid-write can leave either).
    let one = ranges.join("1000-2000");
    let mut b = std::fs::read(&one).unwrap();
    b[500] ^= 1;
    std::fs::write(&one, b).unwrap();
    let two = ranges.join("2000-3000");
    let b = std::fs::read(&two).unwrap();
    std::fs::write(&two, &b[..700]).unwrap();
    assert!(cache.get(&key(1)).unwrap().is_none());
    assert!(cache.get(&key(2)).unwrap().is_none());
    assert_eq!(cache.stats().damaged, 2);
    assert!(!one.exists() && !two.exists());
    assert_eq!(cache.usage().unwrap(), 0);
    // A dead process's proof of life, pins and half-written file.
    let procs = dir.path().join(BUILD).join("procs");
    std::fs::write(procs.join("999999-1.alive"), b"").unwrap();
    std::fs::write(procs.join("999999-1.pins"), "shards/000000.bin\t0-1000\n").unwrap();
    let tmp = dir.path().join(BUILD).join("tmp").join("999999-1-0-1016");
    std::fs::write(&tmp, b"partial").unwrap();
    let again = NodeCache::open(dir.path(), BUILD, 1 << 20).unwrap();
    assert!(!tmp.exists() && !procs.join("999999-1.pins").exists());
    assert_eq!(again.usage().unwrap(), 0);
}

/// A store of one 1 MiB object whose GETs take 30 ms, counting requests.
fn slow_store() -> Arc<FaultStore> {
    let throttled = ThrottledStore::new(
        InMemory::new(),
        ThrottleConfig {
            wait_get_per_call: Duration::from_millis(30),
            ..ThrottleConfig::default()
        },
    );
    let object: Vec<u8> = (0..1u32 << 20).map(|i| (i % 251) as u8).collect();
    dataset_rt_remote::runtime::block_on(
        throttled.put(&Key::from("data/train/shards/000000.bin"), object.into()),
    )
    .unwrap()
    .unwrap();
    FaultStore::new(Arc::new(throttled))
}

#[test]
fn two_processes_sharing_a_directory_download_each_range_once() {
    let dir = tempfile::tempdir().unwrap();
    let store = slow_store();
    // Ranges 4 KiB apart: with no coalescing, each is its own request.
    let requests: Vec<RangeRequest> = (0..40)
        .map(|i| RangeRequest::new("shards/000000.bin", i * 4096..i * 4096 + 1000))
        .collect();
    let policy = FetchPolicy {
        max_gap: 0,
        max_requests: 4,
        ..FetchPolicy::default()
    };
    // Two NodeCaches opened separately are two processes to each other: separate lock file
    // descriptions, separate proofs of life.
    let results: Vec<Vec<bytes::Bytes>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|n| {
                let (store, requests, policy, dir) =
                    (store.clone(), &requests, &policy, dir.path());
                s.spawn(move || {
                    let remote = Remote::with_store(
                        "s3://bucket/data/train",
                        store,
                        &RemoteOptions::default(),
                    )
                    .unwrap();
                    let fetcher = RangeFetcher::new(Arc::new(remote), policy.clone()).unwrap();
                    let cache = Arc::new(NodeCache::open(dir, BUILD, 64 << 20).unwrap());
                    let cached = CachedFetcher::new(fetcher, cache);
                    // The second starts from the other end, so they meet in the middle.
                    let mut order: Vec<RangeRequest> = requests.clone();
                    if n == 1 {
                        order.reverse();
                    }
                    let mut got = Vec::new();
                    for chunk in order.chunks(8) {
                        got.extend(cached.fetch_blocking(chunk, None).unwrap());
                    }
                    if n == 1 {
                        got.reverse();
                    }
                    got
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for got in &results {
        for (r, bytes) in requests.iter().zip(got) {
            let expected: Vec<u8> = (r.range.start..r.range.end)
                .map(|i| (i % 251) as u8)
                .collect();
            assert_eq!(bytes.as_ref(), &expected[..]);
        }
    }
    let mut fetched = store.get_ranges.lock().unwrap().clone();
    fetched.sort_by_key(|(_, r)| r.start);
    assert_eq!(fetched.len(), 40, "each range once: {fetched:?}");
    assert_eq!(store.gets.load(Ordering::SeqCst), 40);
}

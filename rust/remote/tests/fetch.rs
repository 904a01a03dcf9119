//! Range fetching over in-memory stores: coalescing, the in-flight bound, retry rules and
//! verification on arrival.

mod common;

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::{Fault, FaultStore};
use dataset_rt_remote::{
    Error, FetchPolicy, RangeFetcher, RangeRequest, Remote, RemoteOptions, RequestFailure,
};
use object_store::limit::LimitStore;
use object_store::memory::InMemory;
use object_store::path::Path as Key;
use object_store::throttle::{ThrottleConfig, ThrottledStore};
use object_store::{ObjectStore, ObjectStoreExt};

const URL: &str = "s3://bucket/data/train";

fn object(len: usize) -> Vec<u8> {
    (0..len).map(|i| (i * 13 % 251) as u8).collect()
}

/// An in-memory store holding `shards/000000.bin` of `len` bytes under the test URL.
fn memory_with_object(len: usize) -> Arc<InMemory> {
    let store = Arc::new(InMemory::new());
    let key = Key::from("data/train/shards/000000.bin");
    dataset_rt_remote::runtime::block_on(store.put(&key, object(len).into()))
        .unwrap()
        .unwrap();
    store
}

fn fetcher(store: Arc<dyn ObjectStore>, policy: FetchPolicy) -> RangeFetcher {
    let remote = Remote::with_store(URL, store, &RemoteOptions::default()).unwrap();
    RangeFetcher::new(Arc::new(remote), policy).unwrap()
}

fn quick() -> FetchPolicy {
    FetchPolicy {
        backoff: Duration::from_millis(1),
        max_backoff: Duration::from_millis(5),
        ..FetchPolicy::default()
    }
}

/// A fetcher whose attempts time out after 200 ms.
fn impatient(store: Arc<dyn ObjectStore>) -> RangeFetcher {
    let policy = FetchPolicy {
        timeout: Duration::from_millis(200),
        ..quick()
    };
    fetcher(store, policy)
}

fn req(start: u64, end: u64) -> RangeRequest {
    RangeRequest::new("shards/000000.bin", start..end)
}

#[test]
fn neighbours_are_one_request_and_bytes_are_exact() {
    let faults = FaultStore::new(memory_with_object(1 << 20));
    let f = fetcher(faults.clone(), FetchPolicy::default());
    // 100 records of 1000 bytes with 24-byte gaps: one request (within 8 MiB and the gap).
    let requests: Vec<RangeRequest> = (0..100).map(|i| req(i * 1024, i * 1024 + 1000)).collect();
    let got = f.fetch_blocking(&requests, None).unwrap();
    let whole = object(1 << 20);
    for (r, bytes) in requests.iter().zip(&got) {
        assert_eq!(
            bytes.as_ref(),
            &whole[r.range.start as usize..r.range.end as usize]
        );
    }
    assert_eq!(faults.gets.load(Ordering::SeqCst), 1);
    // A bound on request size splits them: 100 KiB of span in 16 KiB requests.
    let small = fetcher(
        faults.clone(),
        FetchPolicy {
            max_request_bytes: 16 << 10,
            ..FetchPolicy::default()
        },
    );
    small.fetch_blocking(&requests, None).unwrap();
    assert_eq!(small.stats().requests, 7, "{:?}", small.stats());
}

#[test]
fn requests_in_flight_stay_within_max_requests() {
    let throttled = ThrottledStore::new(
        InMemory::new(),
        ThrottleConfig {
            wait_get_per_call: Duration::from_millis(20),
            ..ThrottleConfig::default()
        },
    );
    let key = Key::from("data/train/shards/000000.bin");
    dataset_rt_remote::runtime::block_on(throttled.put(&key, object(1 << 20).into()))
        .unwrap()
        .unwrap();
    // The limit store would hide an excess; the counter below the fetcher would show it.
    let faults = FaultStore::new(Arc::new(LimitStore::new(throttled, 64)));
    let f = fetcher(
        faults.clone(),
        FetchPolicy {
            max_requests: 4,
            max_gap: 0,
            ..FetchPolicy::default()
        },
    );
    // 64 ranges far apart: 64 requests, at most 4 at once.
    let requests: Vec<RangeRequest> = (0..64).map(|i| req(i * 16384, i * 16384 + 100)).collect();
    let started = std::time::Instant::now();
    f.fetch_blocking(&requests, None).unwrap();
    assert_eq!(faults.gets.load(Ordering::SeqCst), 64);
    let max = faults.max_in_flight.load(Ordering::SeqCst);
    assert!((2..=4).contains(&max), "max in flight {max}");
    assert_eq!(f.stats().max_in_flight, max);
    // 16 rounds of 20 ms at depth 4, not 64 sequential waits.
    assert!(
        started.elapsed() < Duration::from_millis(64 * 20),
        "{:?}",
        started.elapsed()
    );
}

#[test]
fn transient_faults_are_retried_and_recover() {
    let faults = FaultStore::new(memory_with_object(4096));
    faults.script([Fault::Transient, Fault::Truncate]);
    let f = fetcher(faults.clone(), quick());
    let got = f.fetch_blocking(&[req(100, 600)], None).unwrap();
    assert_eq!(got[0].as_ref(), &object(4096)[100..600]);
    assert_eq!(f.stats().retries, 2);
    assert_eq!(faults.gets.load(Ordering::SeqCst), 3);
}

#[test]
fn a_timed_out_request_is_tried_again_once_the_endpoint_has_answered() {
    let faults = FaultStore::new(memory_with_object(4096));
    let f = impatient(faults.clone());
    // The endpoint answers a first request, then leaves one unanswered.
    f.fetch_blocking(&[req(0, 10)], None).unwrap();
    faults.script([Fault::Delay(Duration::from_secs(5))]);
    let started = std::time::Instant::now();
    let got = f.fetch_blocking(&[req(10, 20)], None).unwrap();
    assert_eq!(got[0].as_ref(), &object(4096)[10..20]);
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(f.stats().retries, 1);
}

#[test]
fn an_endpoint_that_never_answered_is_an_error_after_one_attempt() {
    let faults = FaultStore::new(memory_with_object(4096));
    *faults.every_get.lock().unwrap() = Some(Fault::Delay(Duration::from_secs(5)));
    let f = impatient(faults.clone());
    let started = std::time::Instant::now();
    let err = f.fetch_blocking(&[req(0, 10)], None).unwrap_err();
    assert!(started.elapsed() < Duration::from_secs(2));
    assert_eq!(faults.gets.load(Ordering::SeqCst), 1);
    assert_eq!(err.failure(), Some(RequestFailure::NoAnswer));
    let text = err.to_string();
    for part in [
        "GET s3://bucket/data/train/shards/000000.bin bytes 0..10",
        "attempt 1: timed out",
        "has not answered any request yet",
        "check the endpoint",
    ] {
        assert!(text.contains(part), "{part:?} missing from: {text}");
    }
    assert_eq!(f.stats().retries, 0);
}

#[test]
fn persistent_faults_end_after_the_bounded_attempts_naming_url_and_attempts() {
    let faults = FaultStore::new(memory_with_object(4096));
    *faults.every_get.lock().unwrap() = Some(Fault::Transient);
    let f = fetcher(faults.clone(), quick());
    let err = f.fetch_blocking(&[req(0, 10)], None).unwrap_err();
    assert_eq!(faults.gets.load(Ordering::SeqCst), 3);
    assert_eq!(err.failure(), Some(RequestFailure::Transient));
    let text = err.to_string();
    for part in [
        "GET s3://bucket/data/train/shards/000000.bin bytes 0..10",
        "attempt 1: ",
        "attempt 3: ",
        "3 of at most 3 attempts",
        "503 Slow Down",
    ] {
        assert!(text.contains(part), "{part:?} missing from: {text}");
    }
    // Truncated bodies too.
    *faults.every_get.lock().unwrap() = Some(Fault::Truncate);
    let text = f
        .fetch_blocking(&[req(0, 10)], None)
        .unwrap_err()
        .to_string();
    assert!(text.contains("truncated body: 5 of 10 bytes"), "{text}");
}

#[test]
fn permanent_failures_are_not_retried_and_say_what_to_check() {
    let faults = FaultStore::new(memory_with_object(4096));
    let f = fetcher(faults.clone(), quick());
    let missing = RangeRequest::new("shards/000009.bin", 0..10);
    let err = f.fetch_blocking(&[missing], None).unwrap_err();
    assert_eq!(faults.gets.load(Ordering::SeqCst), 1);
    // Every file fetched is one a manifest lists: a missing one is damage on the server.
    assert!(matches!(err, Error::Verify { .. }), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("s3://bucket/data/train/shards/000009.bin"),
        "{text}"
    );
    assert!(
        text.contains("does not exist, though the manifest lists it"),
        "{text}"
    );
    let core: dataset_rt_core::Error = err.into();
    assert_eq!(core.kind(), dataset_rt_core::ErrorKind::Malformed);
    // Refused credentials.
    faults.script([Fault::Denied]);
    let err = f.fetch_blocking(&[req(0, 10)], None).unwrap_err();
    assert_eq!(err.failure(), Some(RequestFailure::Denied));
    assert!(err.to_string().contains("AWS_ACCESS_KEY_ID"), "{err}");
    // Mapped onto the core's error: an I/O error on the URL, with its kind.
    let core: dataset_rt_core::Error = err.into();
    assert_eq!(core.errno(), Some(libc::EACCES));
}

#[test]
fn bytes_that_do_not_verify_are_fetched_again_then_named() {
    let faults = FaultStore::new(memory_with_object(4096));
    faults.script([Fault::Corrupt]);
    let f = fetcher(faults.clone(), quick());
    let whole = Bytes::from(object(4096));
    let truth = whole.clone();
    let verify = move |r: &RangeRequest, bytes: &[u8]| {
        if bytes == &truth[r.range.start as usize..r.range.end as usize] {
            Ok(())
        } else {
            Err("record checksum mismatch".to_owned())
        }
    };
    let got = f
        .fetch_blocking(&[req(0, 100), req(100, 300)], Some(&verify))
        .unwrap();
    assert_eq!(got[1].as_ref(), &whole[100..300]);
    assert_eq!(f.stats().refetches, 1);
    *faults.every_get.lock().unwrap() = Some(Fault::Corrupt);
    let err = f.fetch_blocking(&[req(0, 100)], Some(&verify)).unwrap_err();
    let Error::Verify { attempts, .. } = &err else {
        panic!("{err}")
    };
    assert_eq!(*attempts, 3);
    let text = err.to_string();
    assert!(
        text.contains("s3://bucket/data/train/shards/000000.bin bytes 0..100"),
        "{text}"
    );
    assert!(text.contains("record checksum mismatch"), "{text}");
}

#[test]
fn an_object_shorter_than_the_range_is_damage_named_at_once_not_a_timeout() {
    // A file:// store serves what there is of a range that runs past the end of the file.
    let tmp = tempfile::tempdir().unwrap();
    let shards = tmp.path().join("train/shards");
    std::fs::create_dir_all(&shards).unwrap();
    std::fs::write(shards.join("000000.bin"), object(1000)).unwrap();
    let url = format!("file://{}/train", tmp.path().display());
    let remote = Remote::open(&url, &RemoteOptions::default()).unwrap();
    let f = RangeFetcher::new(Arc::new(remote), quick()).unwrap();
    let got = f.fetch_blocking(&[req(100, 600)], None).unwrap();
    assert_eq!(got[0][..], object(1000)[100..600]);
    let err = f.fetch_blocking(&[req(0, 2000)], None).unwrap_err();
    match &err {
        Error::Verify { attempts, .. } => assert_eq!(*attempts, 1, "{err}"),
        other => panic!("expected damage, got {other}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("shards/000000.bin bytes 0..2000")
            && text.contains("holds 1000 bytes, shorter than the manifest says"),
        "{text}"
    );
    // Tried once: the server said how long the object is.
    assert_eq!(f.stats().requests, 2);
}

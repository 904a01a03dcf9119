//! Against a real S3 server, when `DATASET_RT_TEST_S3_ENDPOINT` names one (for example moto:
//! `python -c "from moto.server import ThreadedMotoServer as S; S(ip_address='127.0.0.1',
//! port=5555).start(); input()"`) and `DATASET_RT_TEST_S3_BUCKET` an existing bucket. Skipped
//! otherwise (this crate's tests need no server); the Python tests start moto themselves.

mod common;

use std::sync::Arc;

use common::write_cache;
use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_remote::publish::PublishedCache;
use dataset_rt_remote::{
    ls, pull, push, Error, FetchPolicy, PushOptions, RangeFetcher, RangeRequest, Remote,
    RemoteOptions, RequestFailure,
};

#[test]
fn push_pull_ls_and_ranges_against_a_real_server() {
    let (Ok(endpoint), Ok(bucket)) = (
        std::env::var("DATASET_RT_TEST_S3_ENDPOINT"),
        std::env::var("DATASET_RT_TEST_S3_BUCKET"),
    ) else {
        eprintln!("skipped: DATASET_RT_TEST_S3_ENDPOINT / DATASET_RT_TEST_S3_BUCKET not set");
        return;
    };
    let options = RemoteOptions {
        endpoint: Some(endpoint),
        allow_http: Some(true),
        region: Some("us-east-1".into()),
        ..RemoteOptions::default()
    };
    let tmp = tempfile::tempdir().unwrap();
    // One shard of about 11 MiB goes up in two 5 MiB parts and a tail.
    let local = write_cache(&tmp.path().join("src"), "train", 110, 100_000, 64 << 20, 0);
    let prefix = format!("s3://{bucket}/run-{}", std::process::id());
    let remote = Remote::open(&format!("{prefix}/train"), &options).unwrap();
    let parts = PushOptions {
        multipart_threshold: 5 << 20,
        part_size: 5 << 20,
        ..PushOptions::default()
    };
    let report = push(&local, &remote, &parts).unwrap();
    assert!(report.uploaded.len() >= 3);
    // The conditional write refuses a second, different cache.
    let other = write_cache(&tmp.path().join("other"), "train", 3, 10, 4096, 1);
    let err = push(&other, &remote, &PushOptions::default()).unwrap_err();
    assert!(matches!(err, Error::AlreadyPublished { .. }), "{err}");
    // Replacing is a compare-and-swap on the manifest's ETag.
    let replace = PushOptions {
        replace: true,
        ..PushOptions::default()
    };
    push(&other, &remote, &replace).unwrap();
    push(
        &local,
        &remote,
        &PushOptions {
            replace: true,
            ..parts
        },
    )
    .unwrap();

    let base = Remote::open(&prefix, &options).unwrap();
    let listing = ls(&base).unwrap();
    assert_eq!(listing.len(), 1, "{listing:?}");
    assert_eq!(listing[0].summary.as_ref().unwrap().num_samples, 110);

    let published = PublishedCache::open(&remote).unwrap();
    let fetcher = RangeFetcher::new(published.data.clone(), FetchPolicy::default()).unwrap();
    let shard = std::fs::read(local.join("shards/000000.bin")).unwrap();
    let got = fetcher
        .fetch_blocking(
            &[
                RangeRequest::new("shards/000000.bin", 16..1000),
                RangeRequest::new("shards/000000.bin", 6_000_000..6_100_000),
            ],
            None,
        )
        .unwrap();
    assert_eq!(got[0].as_ref(), &shard[16..1000]);
    assert_eq!(got[1].as_ref(), &shard[6_000_000..6_100_000]);

    let dest = tmp.path().join("dst").join("train");
    pull(&remote, &dest, &FetchPolicy::default()).unwrap();
    Cache::open(&dest, Validation::Full)
        .unwrap()
        .verify_all()
        .unwrap();

    // A bucket that does not exist is a clear error, at once.
    let missing =
        Arc::new(Remote::open("s3://no-such-bucket-dataset-rt/x/train", &options).unwrap());
    let err = PublishedCache::open(&missing).unwrap_err();
    assert!(
        matches!(err.failure(), Some(RequestFailure::NotFound)),
        "{err}"
    );
}

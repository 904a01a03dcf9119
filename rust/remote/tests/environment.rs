//! Settings from the environment, in a test binary of its own (it sets environment variables,
//! which no other test of this binary reads concurrently): credentials never appear in an error
//! or a `Debug` output, and an unreachable endpoint is a clear error within seconds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use dataset_rt_remote::publish::PublishedCache;
use dataset_rt_remote::{
    FetchPolicy, RangeFetcher, RangeRequest, Remote, RemoteOptions, RequestFailure,
};

const KEY_ID: &str = "AKIDSENTINEL0KEYID";
const SECRET: &str = "sentinel-secret-access-key-0123";
const TOKEN: &str = "sentinel-session-token-4567";

#[test]
fn secrets_stay_hidden_and_an_unreachable_endpoint_fails_fast() {
    std::env::set_var("AWS_ACCESS_KEY_ID", KEY_ID);
    std::env::set_var("AWS_SECRET_ACCESS_KEY", SECRET);
    std::env::set_var("AWS_SESSION_TOKEN", TOKEN);
    std::env::set_var("AWS_REGION", "eu-west-3");
    // Nothing listens on port 1.
    std::env::set_var("AWS_ENDPOINT_URL", "http://127.0.0.1:1");
    std::env::set_var("AWS_ALLOW_HTTP", "true");
    let options = RemoteOptions::default();
    let remote = Arc::new(Remote::open("s3://bucket/data/train", &options).unwrap());
    let fetcher = RangeFetcher::new(remote.clone(), FetchPolicy::default()).unwrap();
    let started = Instant::now();
    let err = fetcher
        .fetch_blocking(&[RangeRequest::new("shards/000000.bin", 0..100)], None)
        .unwrap_err();
    let took = started.elapsed();
    assert!(took < Duration::from_secs(15), "took {took:?}");
    assert_eq!(err.failure(), Some(RequestFailure::Unreachable), "{err}");
    let text = err.to_string();
    assert!(
        text.contains("s3://bucket/data/train/shards/000000.bin bytes 0..100"),
        "{text}"
    );
    assert!(text.contains("check the endpoint"), "{text}");
    let opened = PublishedCache::open(&remote).unwrap_err();
    let core: dataset_rt_core::Error = PublishedCache::open(&remote).unwrap_err().into();
    for shown in [
        text,
        format!("{err:?}"),
        opened.to_string(),
        format!("{opened:?}"),
        core.to_string(),
        format!("{remote:?}"),
        format!("{fetcher:?}"),
    ] {
        for secret in [KEY_ID, SECRET, TOKEN] {
            assert!(!shown.contains(secret), "{secret} shown in: {shown}");
        }
    }
    // The options override the environment: another region, and plain HTTP refused.
    let strict = RemoteOptions {
        allow_http: Some(false),
        ..RemoteOptions::default()
    };
    // Refused when the store is made, saying how to allow it, not at the first request.
    let err = Remote::open("s3://bucket/data/train", &strict).unwrap_err();
    let text = err.to_string();
    assert!(!text.contains(SECRET), "{text}");
    assert!(text.contains("RemoteConfig.allow_http"), "{text}");
    assert!(
        text.contains("http://127.0.0.1:1 is plain http://"),
        "{text}"
    );
    assert!(text.contains("AWS_ALLOW_HTTP=true"), "{text}");
    // The environment's permission is read when the options leave it out.
    std::env::set_var("AWS_ALLOW_HTTP", "no");
    let err = Remote::open("s3://bucket/data/train", &options).unwrap_err();
    assert!(err.to_string().contains("RemoteConfig.allow_http"), "{err}");
    // A word that is neither yes nor no is refused, not read as no.
    std::env::set_var("AWS_ALLOW_HTTP", "maybe");
    let err = Remote::open("s3://bucket/data/train", &options).unwrap_err();
    assert!(
        err.to_string()
            .contains("AWS_ALLOW_HTTP=\"maybe\" is neither true nor false"),
        "{err}"
    );
    std::env::set_var("AWS_ALLOW_HTTP", "1");
    Remote::open("s3://bucket/data/train", &options).unwrap();
    // A malformed endpoint from the environment is refused when the store is made (the client
    // panicked on it at the first request), saying where it came from.
    for bad in ["not a url", "ftp://x", "http://127.0.0.1:1/?x=1"] {
        std::env::set_var("AWS_ENDPOINT_URL", bad);
        let err = Remote::open("s3://bucket/data/train", &options).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains("RemoteConfig.endpoint") && text.contains("from AWS_ENDPOINT_URL"),
            "{bad}: {text}"
        );
        // RemoteConfig.endpoint wins over it.
        let given = RemoteOptions {
            endpoint: Some("http://127.0.0.1:1".into()),
            ..RemoteOptions::default()
        };
        Remote::open("s3://bucket/data/train", &given).unwrap();
    }
}

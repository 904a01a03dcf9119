//! Range fetching: (file, offset, length) ranges of one remote cache's objects, many requests in
//! flight, neighbours coalesced into requests of bounded size, every request timed out and tried
//! again with backoff a bounded number of times, and the bytes of each range verified on arrival
//! (a range that does not verify is fetched again, a bounded number of times).
//!
//! Two layers of retries, both bounded: the S3 client's own (throttling, 5xx, connection errors;
//! see `store::client_retry`) and the attempts here, which also cover what the client does not
//! see: a body shorter than the range, a whole request that times out, stores other than S3.

use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::{GetOptions, GetRange, ObjectStore};
use tokio::sync::Semaphore;

use crate::error::{Error, RequestFailure, Result};
use crate::store::Remote;

/// One range of one object. `file` is a key relative to the fetcher's remote
/// (`shards/000001.bin`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct RangeRequest {
    pub file: String,
    pub range: Range<u64>,
}

impl RangeRequest {
    pub fn new(file: impl Into<String>, range: Range<u64>) -> Self {
        RangeRequest {
            file: file.into(),
            range,
        }
    }

    pub fn len(&self) -> u64 {
        self.range.end.saturating_sub(self.range.start)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Checks the bytes of a range as they arrive: `Err(reason)` when they are wrong (the planner
/// checks each record's checksum here).
pub type Verify = dyn Fn(&RangeRequest, &[u8]) -> std::result::Result<(), String> + Send + Sync;

/// The limits of fetching. [`FetchPolicy::default`] documents the defaults.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FetchPolicy {
    /// Requests in flight at most (all calls of one fetcher together). Default 64.
    pub max_requests: usize,
    /// The most bytes one request asks for (coalesced ranges, or a piece of a larger range).
    /// Default 8 MiB: large enough to amortise a request, small enough that the request
    /// timeout means something.
    pub max_request_bytes: u64,
    /// Neighbouring ranges of one object separated by at most this many bytes are fetched with
    /// one request (the gap is downloaded and dropped). Default 64 KiB.
    pub max_gap: u64,
    /// Attempts per request for transient failures (timeouts, throttling, 5xx, resets,
    /// truncated bodies). Default 3.
    pub attempts: u32,
    /// Fetches of a range whose bytes do not verify before it is an error. Default 3.
    pub verify_attempts: u32,
    /// The time one attempt may take. Default 30 s.
    pub timeout: Duration,
    /// The pause after the first failed attempt, doubled after each, at most `max_backoff`.
    /// Defaults 100 ms and 2 s.
    pub backoff: Duration,
    pub max_backoff: Duration,
}

impl Default for FetchPolicy {
    fn default() -> Self {
        FetchPolicy {
            max_requests: crate::options::DEFAULT_MAX_REQUESTS,
            max_request_bytes: 8 << 20,
            max_gap: 64 << 10,
            attempts: 3,
            verify_attempts: 3,
            timeout: crate::store::REQUEST_TIMEOUT,
            backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
        }
    }
}

impl FetchPolicy {
    fn validate(&self) -> Result<()> {
        let bad = |field, reason: &str| Err(Error::config(field, reason.to_owned()));
        if self.max_requests == 0 {
            return bad("max_requests", "must be at least 1");
        }
        if self.max_request_bytes == 0 {
            return bad("max_request_bytes", "must be at least 1");
        }
        if self.attempts == 0 || self.verify_attempts == 0 {
            return bad("attempts", "must be at least 1");
        }
        Ok(())
    }
}

/// Counters of what a fetcher did, for tests and benchmarks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FetchStats {
    /// Requests sent (attempts included).
    pub requests: u64,
    /// Bytes received in full responses.
    pub bytes: u64,
    /// Attempts after a transient failure.
    pub retries: u64,
    /// Ranges fetched again because their bytes did not verify.
    pub refetches: u64,
    /// The most requests that were in flight at once.
    pub max_in_flight: u64,
}

#[derive(Default)]
struct Counters {
    requests: AtomicU64,
    bytes: AtomicU64,
    retries: AtomicU64,
    refetches: AtomicU64,
    in_flight: AtomicU64,
    max_in_flight: AtomicU64,
}

/// Requests that one GET serves: `range` covers every member's range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Span {
    pub file: String,
    pub range: Range<u64>,
    /// Indices into the requests, in offset order.
    pub members: Vec<usize>,
}

/// Groups requests into spans: the ranges of one object, by offset, joined while the gap
/// between neighbours is at most `max_gap` and the span stays within `max_bytes` (a single range
/// longer than that is a span of its own, fetched in pieces). Empty ranges join no span.
pub fn coalesce(requests: &[RangeRequest], max_gap: u64, max_bytes: u64) -> Vec<Span> {
    let mut order: Vec<usize> = (0..requests.len())
        .filter(|&i| !requests[i].is_empty())
        .collect();
    order.sort_by(|&a, &b| {
        let (x, y) = (&requests[a], &requests[b]);
        (&x.file, x.range.start, x.range.end).cmp(&(&y.file, y.range.start, y.range.end))
    });
    let mut spans: Vec<Span> = Vec::new();
    for i in order {
        let r = &requests[i];
        if let Some(span) = spans.last_mut() {
            let joins = span.file == r.file
                && r.range.start <= span.range.end.saturating_add(max_gap)
                && r.range.end.max(span.range.end) - span.range.start <= max_bytes;
            if joins {
                span.range.end = span.range.end.max(r.range.end);
                span.members.push(i);
                continue;
            }
        }
        spans.push(Span {
            file: r.file.clone(),
            range: r.range.clone(),
            members: vec![i],
        });
    }
    spans
}

/// Fetches ranges of the objects under one remote.
pub struct RangeFetcher {
    remote: Arc<Remote>,
    policy: FetchPolicy,
    permits: Arc<Semaphore>,
    counters: Arc<Counters>,
}

impl std::fmt::Debug for RangeFetcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RangeFetcher")
            .field("remote", &self.remote)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// Holds one of the fetcher's request permits and counts it in flight.
struct InFlight<'a> {
    counters: &'a Counters,
    _permit: tokio::sync::SemaphorePermit<'a>,
}

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.counters.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

impl RangeFetcher {
    pub fn new(remote: Arc<Remote>, policy: FetchPolicy) -> Result<RangeFetcher> {
        policy.validate()?;
        Ok(RangeFetcher {
            permits: Arc::new(Semaphore::new(policy.max_requests)),
            remote,
            policy,
            counters: Arc::default(),
        })
    }

    pub fn remote(&self) -> &Arc<Remote> {
        &self.remote
    }

    pub fn policy(&self) -> &FetchPolicy {
        &self.policy
    }

    pub fn stats(&self) -> FetchStats {
        let c = &self.counters;
        FetchStats {
            requests: c.requests.load(Ordering::Relaxed),
            bytes: c.bytes.load(Ordering::Relaxed),
            retries: c.retries.load(Ordering::Relaxed),
            refetches: c.refetches.load(Ordering::Relaxed),
            max_in_flight: c.max_in_flight.load(Ordering::Relaxed),
        }
    }

    /// Fetches every range and returns their bytes in the order of `requests`, each verified
    /// by `verify` when given. Blocks the calling thread (see [`crate::runtime::block_on`]).
    pub fn fetch_blocking(
        &self,
        requests: &[RangeRequest],
        verify: Option<&Verify>,
    ) -> Result<Vec<Bytes>> {
        crate::runtime::block_on(self.fetch(requests, verify))?
    }

    /// Fetches every range (see [`RangeFetcher::fetch_blocking`]).
    pub async fn fetch(
        &self,
        requests: &[RangeRequest],
        verify: Option<&Verify>,
    ) -> Result<Vec<Bytes>> {
        let store = self.remote.store()?;
        let spans = coalesce(requests, self.policy.max_gap, self.policy.max_request_bytes);
        let mut out = vec![Bytes::new(); requests.len()];
        // Spans beyond the permits wait in the semaphore; `buffer_unordered` only bounds how
        // many futures exist at once.
        let mut done = stream::iter(spans)
            .map(|span| {
                let store = Arc::clone(&store);
                async move {
                    let bytes = self.fetch_span(&store, &span, requests, verify).await?;
                    Ok::<_, Error>((span, bytes))
                }
            })
            .buffer_unordered(self.policy.max_requests);
        while let Some((span, pieces)) = done.try_next().await? {
            for (i, bytes) in span.members.into_iter().zip(pieces) {
                out[i] = bytes;
            }
        }
        Ok(out)
    }

    /// The bytes of each member of `span`, verified.
    async fn fetch_span(
        &self,
        store: &Arc<dyn ObjectStore>,
        span: &Span,
        requests: &[RangeRequest],
        verify: Option<&Verify>,
    ) -> Result<Vec<Bytes>> {
        let whole = self
            .get_pieces(store, &span.file, span.range.clone())
            .await?;
        let mut out = Vec::with_capacity(span.members.len());
        for &i in &span.members {
            let request = &requests[i];
            let from = (request.range.start - span.range.start) as usize;
            let mut bytes = whole.slice(from..from + request.len() as usize);
            let mut fetches = 1;
            if let Some(verify) = verify {
                while let Err(reason) = verify(request, &bytes) {
                    if fetches >= self.policy.verify_attempts {
                        return Err(Error::Verify {
                            url: self.remote.show(&self.remote.key(&request.file)),
                            range: request.range.clone(),
                            attempts: fetches,
                            reason,
                        });
                    }
                    self.counters.refetches.fetch_add(1, Ordering::Relaxed);
                    fetches += 1;
                    bytes = self
                        .get_pieces(store, &request.file, request.range.clone())
                        .await?;
                }
            }
            out.push(bytes);
        }
        Ok(out)
    }

    /// One range, in requests of at most `max_request_bytes` (in flight together), joined.
    async fn get_pieces(
        &self,
        store: &Arc<dyn ObjectStore>,
        file: &str,
        range: Range<u64>,
    ) -> Result<Bytes> {
        let step = self.policy.max_request_bytes;
        if range.end - range.start <= step {
            return self.get(store, file, range).await;
        }
        let pieces: Vec<Range<u64>> = (range.start..range.end)
            .step_by(step as usize)
            .map(|start| start..(start + step).min(range.end))
            .collect();
        let got: Vec<Bytes> = stream::iter(pieces)
            .map(|piece| self.get(store, file, piece))
            .buffered(self.policy.max_requests)
            .try_collect()
            .await?;
        let mut joined = BytesMut::with_capacity((range.end - range.start) as usize);
        for piece in got {
            joined.extend_from_slice(&piece);
        }
        Ok(joined.freeze())
    }

    async fn enter(&self) -> InFlight<'_> {
        // The semaphore is never closed.
        let permit = self
            .permits
            .acquire()
            .await
            .expect("the fetcher's semaphore is never closed");
        let c = &self.counters;
        let now = c.in_flight.fetch_add(1, Ordering::Relaxed) + 1;
        c.max_in_flight.fetch_max(now, Ordering::Relaxed);
        c.requests.fetch_add(1, Ordering::Relaxed);
        InFlight {
            counters: c,
            _permit: permit,
        }
    }

    /// One GET of `range`, tried up to `attempts` times while it fails transiently. Every file
    /// fetched is one a manifest lists with its size: an object that is missing or shorter than
    /// the range is damage on the server ([`Error::Verify`]), which no other attempt mends.
    async fn get(
        &self,
        store: &Arc<dyn ObjectStore>,
        file: &str,
        range: Range<u64>,
    ) -> Result<Bytes> {
        let key = self.remote.key(file);
        let expected = range.end - range.start;
        let url = format!(
            "{} bytes {}..{}",
            self.remote.show(&key),
            range.start,
            range.end
        );
        let bytes = retrying(
            &self.remote,
            &self.policy,
            &self.counters.retries,
            "GET",
            &url,
            || async {
                let _in_flight = self.enter().await;
                let options = GetOptions {
                    range: Some(GetRange::Bounded(range.clone())),
                    ..GetOptions::default()
                };
                // Every file fetched is one a manifest lists with its size: missing, or shorter
                // than the range, it is damage on the server.
                let got = store
                    .get_opts(&key, options)
                    .await
                    .map_err(|e| match failure_of(e) {
                        (RequestFailure::NotFound, why) => (
                            RequestFailure::NotFound,
                            format!(
                                "the object does not exist, though the manifest lists it ({why})"
                            ),
                        ),
                        (RequestFailure::Short, why) => (
                            RequestFailure::Short,
                            format!("the object is {SHORTER} ({why})"),
                        ),
                        other => other,
                    })?;
                // The server's own size for the object: shorter than the range is damage, which
                // no other attempt mends (a body cut short in transit is retried below).
                if got.meta.size < range.end {
                    return Err((
                        RequestFailure::Short,
                        format!("the object holds {} bytes, {SHORTER}", got.meta.size),
                    ));
                }
                let bytes = got.bytes().await.map_err(failure_of)?;
                if bytes.len() as u64 != expected {
                    return Err((
                        RequestFailure::Transient,
                        format!(
                            "truncated body: {} of {expected} bytes arrived",
                            bytes.len()
                        ),
                    ));
                }
                Ok(bytes)
            },
        )
        .await
        .map_err(|e| match e {
            Error::Request {
                failure: RequestFailure::Short | RequestFailure::NotFound,
                reason,
                ..
            } => Error::Verify {
                url: self.remote.show(&key),
                range: range.clone(),
                attempts: 1,
                reason,
            },
            other => other,
        })?;
        self.counters
            .bytes
            .fetch_add(bytes.len() as u64, Ordering::Relaxed);
        Ok(bytes)
    }
}

/// How an error says that an object is shorter than its manifest says.
const SHORTER: &str = "shorter than the manifest says";

/// A failed attempt: its kind and what happened, in words.
pub(crate) type AttemptError = (RequestFailure, String);

pub(crate) fn failure_of(err: object_store::Error) -> AttemptError {
    (classify(&err), crate::location::redact(&err.to_string()))
}

/// Runs `attempt` (timed out after `policy.timeout`) until it succeeds, fails for good, or has
/// been tried `policy.attempts` times, pausing with backoff between attempts. The error names
/// `op` and `url` and lists every attempt's failure.
///
/// A request that got no answer is tried again only once `remote`'s endpoint has answered a
/// request: an endpoint that takes connections and never answers (a wrong port, a firewall
/// that swallows the traffic) is then an error after one attempt (the client's own retries
/// within it included, about 10 s), not after every attempt's timeout.
pub(crate) async fn retrying<T, F, Fut>(
    remote: &Remote,
    policy: &FetchPolicy,
    retries: &AtomicU64,
    op: &'static str,
    url: &str,
    mut attempt: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = std::result::Result<T, AttemptError>>,
{
    let mut tried: Vec<String> = Vec::new();
    let mut pause = policy.backoff;
    loop {
        let outcome = match tokio::time::timeout(policy.timeout, attempt()).await {
            Err(_) => Err((
                RequestFailure::NoAnswer,
                format!("timed out after {:?}", policy.timeout),
            )),
            Ok(outcome) => outcome,
        };
        let (failure, reason) = match outcome {
            Ok(value) => {
                remote.heard();
                return Ok(value);
            }
            Err(e) => e,
        };
        if !matches!(
            failure,
            RequestFailure::NoAnswer | RequestFailure::Unreachable
        ) {
            remote.heard();
        }
        tried.push(format!("attempt {}: {reason}", tried.len() + 1));
        let silent = failure == RequestFailure::NoAnswer && !remote.ever_heard();
        if silent || !failure.is_transient() || tried.len() as u32 >= policy.attempts {
            let advice = if silent {
                "; the endpoint has not answered any request yet, so this one was not tried \
                 again: check the endpoint (RemoteConfig.endpoint or AWS_ENDPOINT_URL), its \
                 port and the network"
            } else {
                advice(failure)
            };
            return Err(Error::Request {
                op,
                url: url.to_owned(),
                failure,
                // The client's own text may count its retries within one attempt.
                reason: format!(
                    "{} ({} of at most {} attempts, each with the client's own retries){advice}",
                    tried.join("; "),
                    tried.len(),
                    policy.attempts
                ),
            });
        }
        retries.fetch_add(1, Ordering::Relaxed);
        tokio::time::sleep(jitter(pause)).await;
        pause = (pause * 2).min(policy.max_backoff);
    }
}

/// `pause` plus up to half of it again, so that processes throttled together do not retry
/// together.
fn jitter(pause: Duration) -> Duration {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let spread = pause.as_nanos() as u64 / 2;
    pause
        + Duration::from_nanos(if spread == 0 {
            0
        } else {
            u64::from(nanos) % spread
        })
}

/// What kind of failure an object-store error is. Statuses the S3 client has already retried
/// (5xx, throttling) stay transient; other 4xx statuses and unreachable endpoints are final.
/// What to check after a request failed for good this way ("" when there is nothing to say).
pub(crate) fn advice(failure: RequestFailure) -> &'static str {
    match failure {
        RequestFailure::NotFound => "; the object (or the bucket) does not exist",
        RequestFailure::Denied => {
            "; check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket's permissions"
        }
        RequestFailure::Unreachable => {
            "; check the endpoint (RemoteConfig.endpoint or AWS_ENDPOINT_URL) and the network"
        }
        _ => "",
    }
}

pub(crate) fn classify(err: &object_store::Error) -> RequestFailure {
    use object_store::Error as E;
    match err {
        E::NotFound { .. } => RequestFailure::NotFound,
        E::PermissionDenied { .. } | E::Unauthenticated { .. } => RequestFailure::Denied,
        E::AlreadyExists { .. } | E::Precondition { .. } | E::NotModified { .. } => {
            RequestFailure::Conflict
        }
        E::Generic { source, .. } => classify_source(source.as_ref()),
        _ => RequestFailure::Refused,
    }
}

fn classify_source(source: &(dyn std::error::Error + 'static)) -> RequestFailure {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(source);
    while let Some(err) = cause {
        if let Some(http) = err.downcast_ref::<object_store::client::HttpError>() {
            return match http.kind() {
                object_store::client::HttpErrorKind::Connect => RequestFailure::Unreachable,
                object_store::client::HttpErrorKind::Timeout => RequestFailure::NoAnswer,
                _ => RequestFailure::Transient,
            };
        }
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return match io.kind() {
                std::io::ErrorKind::ConnectionRefused => RequestFailure::Unreachable,
                std::io::ErrorKind::TimedOut => RequestFailure::NoAnswer,
                _ => RequestFailure::Transient,
            };
        }
        // The client's status errors are not public types; their message carries the status.
        let text = err.to_string();
        // A range that starts past the object's end, from the in-memory and file stores (their
        // `InvalidGetRange` is not public either).
        if text.starts_with("Wanted range starting at") && text.contains("but object was only") {
            return RequestFailure::Short;
        }
        if let Some(status) = status_in(&text) {
            // S3's list and head requests (and some stores' gets) report a missing bucket or
            // refused credentials this way, not as object_store's NotFound or PermissionDenied.
            return match status {
                404 => RequestFailure::NotFound,
                401 | 403 => RequestFailure::Denied,
                // Range Not Satisfiable: the range starts past the object's end.
                416 => RequestFailure::Short,
                408 | 429 => RequestFailure::Transient,
                400..=499 => RequestFailure::Refused,
                _ => RequestFailure::Transient,
            };
        }
        cause = err.source();
    }
    RequestFailure::Transient
}

/// The HTTP status in an object_store status message ("... status code: 400 Bad Request ...").
fn status_in(text: &str) -> Option<u16> {
    let (_, rest) = text.split_once("status code: ")?;
    rest.get(..3)?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(file: &str, start: u64, end: u64) -> RangeRequest {
        RangeRequest::new(file, start..end)
    }

    #[test]
    fn neighbours_join_within_the_gap_and_the_size_bound() {
        let requests = vec![
            r("a", 100, 200),
            r("a", 0, 50),
            r("b", 0, 10),
            r("a", 250, 300),
            r("a", 1000, 1100),
            r("a", 120, 180),
            r("a", 5, 5),
        ];
        let spans = coalesce(&requests, 50, 10_000);
        let got: Vec<(&str, Range<u64>, Vec<usize>)> = spans
            .iter()
            .map(|s| (s.file.as_str(), s.range.clone(), s.members.clone()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("a", 0..300, vec![1, 0, 5, 3]),
                ("a", 1000..1100, vec![4]),
                ("b", 0..10, vec![2]),
            ]
        );
        // The size bound splits what the gap would join; a larger range stays whole.
        let spans = coalesce(&[r("a", 0, 60), r("a", 60, 120), r("a", 120, 500)], 0, 100);
        let ranges: Vec<Range<u64>> = spans.iter().map(|s| s.range.clone()).collect();
        assert_eq!(ranges, vec![0..60, 60..120, 120..500]);
    }

    #[test]
    fn statuses_in_messages_are_read() {
        assert_eq!(
            status_in("Server returned non-2xx status code: 400 Bad Request: x"),
            Some(400)
        );
        assert_eq!(status_in("connection reset"), None);
    }

    #[test]
    fn statuses_in_generic_errors_are_classified() {
        let generic = |text: &str| object_store::Error::Generic {
            store: "S3",
            source: text.to_owned().into(),
        };
        for (status, failure) in [
            ("404 Not Found: NoSuchBucket", RequestFailure::NotFound),
            ("403 Forbidden: InvalidAccessKeyId", RequestFailure::Denied),
            ("401 Unauthorized", RequestFailure::Denied),
            ("429 Too Many Requests", RequestFailure::Transient),
            ("400 Bad Request", RequestFailure::Refused),
            ("503 Slow Down", RequestFailure::Transient),
            (
                "416 Range Not Satisfiable: InvalidRange",
                RequestFailure::Short,
            ),
        ] {
            let err = generic(&format!("Server returned non-2xx status code: {status}"));
            assert_eq!(classify(&err), failure, "{status}");
        }
        let past_the_end =
            generic("Wanted range starting at 90, but object was only 40 bytes long");
        assert_eq!(classify(&past_the_end), RequestFailure::Short);
    }
}

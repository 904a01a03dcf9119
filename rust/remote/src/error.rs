//! The errors of remote caches. Each names the URL (and the byte range) it is about and what was
//! tried; none carries a credential: every message is built here from the URL the user gave (its
//! user-info removed), never from a request's headers or the store's configuration.

use std::ops::Range;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What kind of failure a request met: it decides whether a request is tried again, and which
/// operating-system error kind (and so which Python exception) it becomes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RequestFailure {
    /// The object (or the bucket) does not exist.
    NotFound,
    /// The credentials were refused, or they may not do this.
    Denied,
    /// A condition of the request did not hold (the object exists, or it changed).
    Conflict,
    /// The endpoint could not be reached (refused, unresolvable), after the client's own retries.
    Unreachable,
    /// Throttling, 5xx, reset connections, truncated bodies, after every attempt.
    Transient,
    /// The request got no answer in time (the connection was taken, no response came), after
    /// every attempt; or at once when the endpoint has never answered.
    NoAnswer,
    /// Anything else the store refused: a bad request, an unsupported operation.
    Refused,
    /// The object is shorter than the range asked for: it does not match the manifest.
    Short,
}

impl RequestFailure {
    /// Whether another attempt may succeed.
    pub fn is_transient(self) -> bool {
        matches!(self, RequestFailure::Transient | RequestFailure::NoAnswer)
    }

    fn io_kind(self) -> std::io::ErrorKind {
        use std::io::ErrorKind as K;
        match self {
            RequestFailure::NotFound => K::NotFound,
            RequestFailure::Denied => K::PermissionDenied,
            RequestFailure::Conflict => K::AlreadyExists,
            RequestFailure::Unreachable => K::ConnectionRefused,
            RequestFailure::Transient | RequestFailure::NoAnswer => K::TimedOut,
            RequestFailure::Refused => K::InvalidInput,
            RequestFailure::Short => K::InvalidData,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// A URL this crate cannot use.
    #[error("invalid URL {url:?}: {reason}")]
    Url { url: String, reason: String },

    /// A `RemoteOptions` field out of its domain.
    #[error("invalid RemoteConfig.{field}: {reason}")]
    Config { field: &'static str, reason: String },

    /// A request failed for good: permanently, or after every attempt.
    #[error("{op} {url}: {reason}")]
    Request {
        op: &'static str,
        url: String,
        failure: RequestFailure,
        /// Every attempt's failure, in order ("attempt 1: ...; attempt 2: ...").
        reason: String,
    },

    /// Bytes that arrived did not verify, every time they were fetched.
    #[error(
        "{url} bytes {}..{}: {reason} (fetched {attempts} times); the object on the server is \
         damaged: publish the cache again",
        range.start, range.end
    )]
    Verify {
        url: String,
        range: Range<u64>,
        attempts: u32,
        reason: String,
    },

    /// A publication refused because the URL already holds another cache.
    #[error(
        "{url} already holds a cache (fingerprint {fingerprint}); pass replace=True \
         (`dataset-rt push --replace`) to replace it"
    )]
    AlreadyPublished { url: String, fingerprint: String },

    /// An error of the core: the local cache directory, a malformed manifest, the runtime.
    #[error(transparent)]
    Core(#[from] dataset_rt_core::Error),
}

impl Error {
    pub(crate) fn config(field: &'static str, reason: impl Into<String>) -> Self {
        Error::Config {
            field,
            reason: reason.into(),
        }
    }

    pub(crate) fn url(url: &str, reason: impl Into<String>) -> Self {
        Error::Url {
            url: crate::location::redact(url),
            reason: reason.into(),
        }
    }

    /// The request failure, for a request error.
    pub fn failure(&self) -> Option<RequestFailure> {
        match self {
            Error::Request { failure, .. } => Some(*failure),
            _ => None,
        }
    }
}

/// The core's error for this one, so that a reader in the core (which cannot name this crate's
/// type) reports remote failures through its own error kinds: requests as I/O errors on the URL
/// (Python: `FileNotFoundError`, `PermissionError`, `TimeoutError`...), bad bytes as a malformed
/// cache, bad settings as invalid configuration.
impl From<Error> for dataset_rt_core::Error {
    fn from(err: Error) -> Self {
        use dataset_rt_core::Error as Core;
        let message = err.to_string();
        match err {
            Error::Core(e) => e,
            Error::Config { field, reason } => Core::config(field, reason),
            Error::Url { .. } => Core::config("URL", message),
            // The core's error names the operation and the URL itself.
            Error::Request {
                op,
                url,
                failure,
                reason,
            } => Core::io(op, url, std::io::Error::new(failure.io_kind(), reason)),
            Error::AlreadyPublished { url, .. } => Core::io(
                "publish",
                url,
                std::io::Error::new(std::io::ErrorKind::AlreadyExists, message),
            ),
            Error::Verify { url, .. } => Core::malformed(&url, url.clone(), message),
        }
    }
}

//! A remote location and its object store: which store a URL names, built from the
//! environment's credentials plus the options, and built again in a forked child.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::local::LocalFileSystem;
use object_store::path::Path;
use object_store::{ClientConfigKey, ObjectStore, RetryConfig};

use crate::error::{Error, Result};
use crate::location::{RemoteUrl, Scheme};
use crate::options::{check_endpoint, RemoteOptions};
use crate::runtime::ProcessLocal;

/// How long a connection may take: an unreachable endpoint is an error in seconds.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a response may stall between two reads (its first byte included): a server that
/// takes connections and never answers is an error in seconds, where a request's whole time
/// (below) would let it hang for [`REQUEST_TIMEOUT`] an attempt.
pub const READ_TIMEOUT: Duration = Duration::from_secs(5);
/// How long one request may take in all. Requests are at most `FetchPolicy::max_request_bytes`
/// (8 MiB), so this is a generous bound that still ends a hang.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// The HTTP client's own retries (throttling, 5xx, connection errors) under ours: few and
/// short, so that its retries and the fetcher's bounded attempts together stay within seconds.
fn client_retry() -> RetryConfig {
    RetryConfig {
        backoff: object_store::BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(2),
            base: 2.0,
        },
        max_retries: 2,
        retry_timeout: Duration::from_secs(10),
    }
}

/// A plain `http://` endpoint without permission fails at the first request, with the client's
/// "builder error": say what to do instead, when the store is made.
fn check_plain_http(builder: &AmazonS3Builder) -> Result<()> {
    // The client reads any word but its five of yes as no: a typo would pass for a refusal.
    let allowed = match builder
        .get_config_value(&AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp))
        .map(|v| v.to_ascii_lowercase())
        .as_deref()
    {
        None => false,
        Some("1" | "true" | "on" | "yes" | "y") => true,
        Some("0" | "false" | "off" | "no" | "n" | "") => false,
        Some(other) => {
            return Err(Error::config(
                "allow_http",
                format!(
                    "AWS_ALLOW_HTTP={other:?} is neither true nor false (1, true, on, yes, y; \
                     0, false, off, no, n)"
                ),
            ))
        }
    };
    let Some(endpoint) = builder.get_config_value(&AmazonS3ConfigKey::Endpoint) else {
        return Ok(());
    };
    if !endpoint.to_ascii_lowercase().starts_with("http://") {
        return Ok(());
    }
    if allowed {
        return Ok(());
    }
    Err(Error::config(
        "allow_http",
        format!(
            "the endpoint {} is plain http://, which is refused unless allowed: set \
             RemoteConfig(allow_http=True) (`--allow-http`) or AWS_ALLOW_HTTP=true, or use https://",
            crate::location::redact(&endpoint)
        ),
    ))
}

enum Source {
    /// Built from the environment and the options, per process.
    S3(RemoteOptions),
    File,
    /// Given by the caller (tests: in-memory, throttled, fault-injecting stores).
    Given(Arc<dyn ObjectStore>),
}

/// A URL and the store it names. Cheap to share (`Arc<Remote>`); the store itself (and its
/// connection pool) is made in the process that uses it.
pub struct Remote {
    url: RemoteUrl,
    options: RemoteOptions,
    source: Source,
    store: ProcessLocal<Arc<dyn ObjectStore>>,
    /// Whether the endpoint has answered a request of this remote (or of one joined to it).
    answered: Arc<AtomicBool>,
}

/// Shows the URL and the options only: never the store, whose configuration holds credentials.
impl std::fmt::Debug for Remote {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Remote")
            .field("url", &self.url.to_string())
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl Remote {
    /// The store `url` names, with credentials and endpoint from the environment
    /// (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`,
    /// `AWS_ENDPOINT_URL`, `AWS_ALLOW_HTTP`) overridden by `options`. Checks the options and
    /// builds the store once, so a bad setting is an error here, not at the first request.
    pub fn open(url: &str, options: &RemoteOptions) -> Result<Remote> {
        options.validate()?;
        let url = RemoteUrl::parse(url)?;
        let source = match url.scheme() {
            Scheme::S3 => Source::S3(options.clone()),
            Scheme::File => Source::File,
        };
        let remote = Remote {
            url,
            options: options.clone(),
            source,
            store: ProcessLocal::new(),
            answered: Arc::default(),
        };
        remote.store()?;
        Ok(remote)
    }

    /// A remote over a store the caller built (tests, or stores this crate does not build).
    /// Keys under `url` are looked up in `store` by the URL's path (its bucket is not used).
    pub fn with_store(
        url: &str,
        store: Arc<dyn ObjectStore>,
        options: &RemoteOptions,
    ) -> Result<Remote> {
        options.validate()?;
        Ok(Remote {
            url: RemoteUrl::parse(url)?,
            options: options.clone(),
            source: Source::Given(store),
            store: ProcessLocal::new(),
            answered: Arc::default(),
        })
    }

    /// The remote at `rel` under this one (same store, same options).
    pub fn join(&self, rel: &str) -> Result<Remote> {
        Ok(self.at(self.url.join(rel)?))
    }

    /// Another handle on this remote (same URL, store and options).
    pub fn duplicate(&self) -> Remote {
        self.at(self.url.clone())
    }

    fn at(&self, url: RemoteUrl) -> Remote {
        let source = match &self.source {
            Source::S3(o) => Source::S3(o.clone()),
            Source::File => Source::File,
            Source::Given(s) => Source::Given(Arc::clone(s)),
        };
        Remote {
            url,
            options: self.options.clone(),
            source,
            store: ProcessLocal::new(),
            answered: Arc::clone(&self.answered),
        }
    }

    /// Notes that the endpoint answered a request (a response, an error status included).
    pub(crate) fn heard(&self) {
        self.answered.store(true, Ordering::Relaxed);
    }

    /// Whether the endpoint has answered any request of this remote, or of the remotes joined to
    /// it, in this process. Until it has, a request it never answers is not tried again (see
    /// [`crate::fetch::retrying`]).
    pub(crate) fn ever_heard(&self) -> bool {
        self.answered.load(Ordering::Relaxed)
    }

    /// Whether requests go to an S3 service (not a local directory or a store the caller gave).
    pub fn is_s3_client(&self) -> bool {
        matches!(self.source, Source::S3(_))
    }

    pub fn url(&self) -> &RemoteUrl {
        &self.url
    }

    pub fn options(&self) -> &RemoteOptions {
        &self.options
    }

    /// This process's store (built on first use here, and again after a fork).
    pub fn store(&self) -> Result<Arc<dyn ObjectStore>> {
        self.store.get_or_try_init(|| self.build()).map(Arc::clone)
    }

    /// The key of `rel` under this URL.
    pub fn key(&self, rel: &str) -> Path {
        self.url.key(rel)
    }

    /// The URL of a key of this store, for messages.
    pub fn show(&self, key: &Path) -> String {
        self.url.display_key(key)
    }

    fn build(&self) -> Result<Arc<dyn ObjectStore>> {
        match &self.source {
            Source::Given(store) => Ok(Arc::clone(store)),
            Source::File => Ok(Arc::new(LocalFileSystem::new())),
            Source::S3(options) => {
                // from_env() reads every AWS_* variable object_store knows; the client's limits
                // are set key by key so that AWS_ALLOW_HTTP and the other client settings from
                // the environment are kept.
                let mut builder = AmazonS3Builder::from_env()
                    .with_bucket_name(self.url.bucket())
                    .with_retry(client_retry())
                    .with_config(
                        AmazonS3ConfigKey::Client(ClientConfigKey::ConnectTimeout),
                        format!("{}s", CONNECT_TIMEOUT.as_secs()),
                    )
                    .with_config(
                        AmazonS3ConfigKey::Client(ClientConfigKey::ReadTimeout),
                        format!("{}s", READ_TIMEOUT.as_secs()),
                    )
                    .with_config(
                        AmazonS3ConfigKey::Client(ClientConfigKey::Timeout),
                        format!("{}s", REQUEST_TIMEOUT.as_secs()),
                    );
                if let Some(endpoint) = &options.endpoint {
                    builder = builder.with_endpoint(endpoint);
                }
                if let Some(region) = &options.region {
                    builder = builder.with_region(region);
                }
                if let Some(allow) = options.allow_http {
                    builder = builder.with_allow_http(allow);
                }
                // The endpoint from AWS_ENDPOINT_URL gets the checks RemoteConfig.endpoint has:
                // the client would panic on a malformed one at the first request.
                if let Some(endpoint) = builder.get_config_value(&AmazonS3ConfigKey::Endpoint) {
                    check_endpoint(&endpoint).map_err(|e| match e {
                        Error::Config { field, reason } if options.endpoint.is_none() => {
                            Error::Config {
                                field,
                                reason: format!(
                                    "{reason} (from AWS_ENDPOINT_URL, which is used while \
                                     RemoteConfig.endpoint is None)"
                                ),
                            }
                        }
                        other => other,
                    })?;
                }
                check_plain_http(&builder)?;
                let store = builder.build().map_err(|e| {
                    // The builder's errors name keys and values it could not parse (an
                    // endpoint, a region), never a secret; still, say it in our words.
                    Error::config(
                        "endpoint",
                        format!(
                            "cannot configure the S3 client for {}: {}",
                            self.url,
                            crate::location::redact(&e.to_string())
                        ),
                    )
                })?;
                Ok(Arc::new(store))
            }
        }
    }
}

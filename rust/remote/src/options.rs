//! `RemoteOptions`: where the node's local cache lives and how large it may grow, how many
//! requests may be in flight, and the store's endpoint, region and plain-HTTP permission. Each is
//! optional; `None` means "from the environment" (the AWS variables) or a documented default.

use std::path::PathBuf;

use crate::error::{Error, Result};

/// The settings of a remote cache, as the user gives them (`RemoteConfig` in Python).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RemoteOptions {
    /// The node's local cache directory. `None`: `$DATASET_RT_REMOTE_DIR`, else
    /// `$XDG_CACHE_HOME/dataset-rt/remote`, else `~/.cache/dataset-rt/remote`.
    pub local_dir: Option<PathBuf>,
    /// The local cache's budget in bytes. `None`: [`DEFAULT_MAX_LOCAL_BYTES`].
    pub max_local_bytes: Option<u64>,
    /// Requests in flight at most, per process. `None`: [`DEFAULT_MAX_REQUESTS`].
    pub max_requests: Option<usize>,
    /// The store's endpoint, e.g. `http://127.0.0.1:9000`. `None`: `AWS_ENDPOINT_URL` (or AWS).
    pub endpoint: Option<String>,
    /// The region. `None`: `AWS_REGION` (or `us-east-1`).
    pub region: Option<String>,
    /// Whether a plain `http://` endpoint is allowed. `None`: `AWS_ALLOW_HTTP` (or no).
    pub allow_http: Option<bool>,
}

pub const DEFAULT_MAX_LOCAL_BYTES: u64 = 64 << 30;
/// Object storage answers in tens of milliseconds, so depth, not threads, gives throughput.
pub const DEFAULT_MAX_REQUESTS: usize = 64;
pub const MAX_MAX_REQUESTS: usize = 4096;
/// The smallest budget: room for a few requests of the largest size the fetcher makes.
pub const MIN_LOCAL_BYTES: u64 = 64 << 20;

impl RemoteOptions {
    /// Checks every field; an error names the field and says what it may be.
    pub fn validate(&self) -> Result<()> {
        if let Some(dir) = &self.local_dir {
            if dir.as_os_str().is_empty() {
                return Err(Error::config(
                    "local_dir",
                    "is empty; give a directory path",
                ));
            }
            if dir.as_os_str().as_encoded_bytes().contains(&0) {
                return Err(Error::config(
                    "local_dir",
                    format!("{} holds a NUL byte, which no path may", dir.display()),
                ));
            }
        }
        if let Some(bytes) = self.max_local_bytes {
            if bytes < MIN_LOCAL_BYTES {
                return Err(Error::config(
                    "max_local_bytes",
                    format!("{bytes} is below the minimum of {MIN_LOCAL_BYTES} bytes (64 MiB)"),
                ));
            }
        }
        if let Some(n) = self.max_requests {
            if !(1..=MAX_MAX_REQUESTS).contains(&n) {
                return Err(Error::config(
                    "max_requests",
                    format!("{n} is outside 1..={MAX_MAX_REQUESTS}"),
                ));
            }
        }
        if let Some(endpoint) = &self.endpoint {
            check_endpoint(endpoint)?;
        }
        if let Some(region) = &self.region {
            let ok = !region.is_empty()
                && region
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
            if !ok {
                return Err(Error::config(
                    "region",
                    format!("{region:?} is not a region name (letters, digits, '-', '_')"),
                ));
            }
        }
        Ok(())
    }

    /// The local directory: the option, else the environment, else the user's cache directory.
    pub fn resolved_local_dir(&self) -> Result<PathBuf> {
        if let Some(dir) = &self.local_dir {
            return Ok(dir.clone());
        }
        let env = |name: &str| std::env::var_os(name).filter(|v| !v.is_empty());
        if let Some(dir) = env("DATASET_RT_REMOTE_DIR") {
            return Ok(PathBuf::from(dir));
        }
        if let Some(cache) = env("XDG_CACHE_HOME") {
            return Ok(PathBuf::from(cache).join("dataset-rt").join("remote"));
        }
        match env("HOME") {
            Some(home) => Ok(PathBuf::from(home)
                .join(".cache")
                .join("dataset-rt")
                .join("remote")),
            None => Err(Error::config(
                "local_dir",
                "is not set and neither DATASET_RT_REMOTE_DIR, XDG_CACHE_HOME nor HOME is; \
                 give RemoteConfig(local_dir=...)",
            )),
        }
    }

    pub fn resolved_max_local_bytes(&self) -> u64 {
        self.max_local_bytes.unwrap_or(DEFAULT_MAX_LOCAL_BYTES)
    }

    pub fn resolved_max_requests(&self) -> usize {
        self.max_requests.unwrap_or(DEFAULT_MAX_REQUESTS)
    }
}

/// An endpoint is an `http(s)://host[:port][/path]` URL without credentials. It is echoed in
/// errors with any user-info removed.
pub(crate) fn check_endpoint(endpoint: &str) -> Result<()> {
    let shown = crate::location::redact(endpoint);
    let parsed = url::Url::parse(endpoint)
        .map_err(|e| Error::config("endpoint", format!("{shown:?} is not a URL: {e}")))?;
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(Error::config(
            "endpoint",
            format!(
                "{shown:?} carries credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY \
                 in the environment instead"
            ),
        ));
    }
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host_str().is_none() {
        return Err(Error::config(
            "endpoint",
            format!("{shown:?} is not an http:// or https:// URL with a host"),
        ));
    }
    if parsed.query().is_some() || parsed.fragment().is_some() {
        return Err(Error::config(
            "endpoint",
            format!("{shown:?} has a query (?...) or fragment (#...), which no endpoint has"),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_bad_value_names_its_field() {
        let cases: Vec<(RemoteOptions, &str)> = vec![
            (
                RemoteOptions {
                    local_dir: Some(PathBuf::new()),
                    ..Default::default()
                },
                "RemoteConfig.local_dir",
            ),
            (
                RemoteOptions {
                    max_local_bytes: Some(1000),
                    ..Default::default()
                },
                "RemoteConfig.max_local_bytes",
            ),
            (
                RemoteOptions {
                    max_requests: Some(0),
                    ..Default::default()
                },
                "RemoteConfig.max_requests",
            ),
            (
                RemoteOptions {
                    endpoint: Some("ftp://host".into()),
                    ..Default::default()
                },
                "RemoteConfig.endpoint",
            ),
            (
                RemoteOptions {
                    region: Some("us east".into()),
                    ..Default::default()
                },
                "RemoteConfig.region",
            ),
        ];
        for (options, field) in cases {
            let err = options.validate().unwrap_err().to_string();
            assert!(err.contains(field), "{err}");
        }
        assert!(RemoteOptions::default().validate().is_ok());
    }

    #[test]
    fn an_endpoint_with_credentials_is_refused_without_echoing_them() {
        let options = RemoteOptions {
            endpoint: Some("http://AKID:s3cr3t@127.0.0.1:9000".into()),
            ..Default::default()
        };
        let err = options.validate().unwrap_err().to_string();
        assert!(err.contains("RemoteConfig.endpoint"), "{err}");
        assert!(!err.contains("s3cr3t") && !err.contains("AKID"), "{err}");
    }
}

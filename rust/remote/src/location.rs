//! Remote URLs: `s3://bucket/prefix` and `file:///absolute/path`. A URL names a cache (its last
//! segment is the cache's name) or a base under which caches are named; `join` goes from one to
//! the other. Anything else is refused with a message that says what is accepted.

use object_store::path::Path;

use crate::error::{Error, Result};

/// The object stores a URL can name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheme {
    /// Amazon S3 or any S3-compatible store (MinIO, R2, Ceph; the endpoint from the options or
    /// `AWS_ENDPOINT_URL`).
    S3,
    /// A local (or mounted) directory, through the same code as S3: for tests and shared disks.
    File,
}

/// A parsed remote URL: which store, and the key prefix (`root`) inside it.
#[derive(Clone, PartialEq, Eq)]
pub struct RemoteUrl {
    scheme: Scheme,
    /// The bucket (S3); empty for `file://`.
    bucket: String,
    /// The keys under this URL start with `root/` (`root` may be empty: a bucket's top).
    root: Path,
}

impl std::fmt::Debug for RemoteUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "RemoteUrl({self})")
    }
}

impl std::fmt::Display for RemoteUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.display_key(&self.root))
    }
}

/// `url` with any user-info (`user:password@`) replaced by `***@`, for messages: a URL is echoed
/// in errors, and a secret typed into one must not be.
pub fn redact(url: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return url.to_owned();
    };
    let authority_end = rest.find('/').unwrap_or(rest.len());
    match rest[..authority_end].rfind('@') {
        Some(at) => format!("{scheme}://***{}", &rest[at..]),
        None => url.to_owned(),
    }
}

impl RemoteUrl {
    pub fn parse(text: &str) -> Result<RemoteUrl> {
        let Some((scheme, _)) = text.split_once("://") else {
            return Err(Error::url(
                text,
                "not a URL: give s3://bucket/prefix, or file:///absolute/path for a local directory",
            ));
        };
        let scheme = match scheme.to_ascii_lowercase().as_str() {
            "s3" => Scheme::S3,
            "file" => Scheme::File,
            "gs" | "gcs" | "az" | "azure" | "abfs" | "abfss" => {
                return Err(Error::url(
                    text,
                    format!(
                        "{scheme}:// is not supported yet (untested); use s3:// (any \
                         S3-compatible store, its endpoint from AWS_ENDPOINT_URL) or file://"
                    ),
                ))
            }
            other => {
                return Err(Error::url(
                    text,
                    format!("scheme {other:?} is not supported: use s3:// or file://"),
                ))
            }
        };
        let parsed = url::Url::parse(text).map_err(|e| Error::url(text, e.to_string()))?;
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(Error::url(
                text,
                "credentials do not belong in the URL: set AWS_ACCESS_KEY_ID and \
                 AWS_SECRET_ACCESS_KEY in the environment",
            ));
        }
        if parsed.query().is_some() || parsed.fragment().is_some() {
            return Err(Error::url(
                text,
                "a query (?...) or fragment (#...) is not allowed",
            ));
        }
        if parsed.port().is_some() {
            return Err(Error::url(
                text,
                "a port is not part of a bucket name: set the endpoint (RemoteConfig.endpoint or \
                 AWS_ENDPOINT_URL) instead",
            ));
        }
        let host = parsed.host_str().unwrap_or("");
        let bucket = match scheme {
            Scheme::S3 => {
                let valid = (3..=63).contains(&host.len())
                    && host.bytes().all(|b| {
                        b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'.' || b == b'-'
                    });
                if !valid {
                    return Err(Error::url(
                        text,
                        format!(
                            "{host:?} is not a bucket name (3 to 63 characters: lowercase letters, \
                             digits, '.' and '-')"
                        ),
                    ));
                }
                host.to_owned()
            }
            Scheme::File => {
                if !host.is_empty() && host != "localhost" {
                    return Err(Error::url(
                        text,
                        format!(
                            "file:// URLs name a local path (file:///absolute/path), not host {host:?}"
                        ),
                    ));
                }
                String::new()
            }
        };
        // Checked on the text as given: the URL parser resolves '..' and '.' away.
        let (_, after_scheme) = text.split_once("://").unwrap_or_default();
        let given_path = after_scheme
            .find('/')
            .map_or("", |at| &after_scheme[at..])
            .split(['?', '#'])
            .next()
            .unwrap_or("")
            .trim_end_matches('/');
        for segment in given_path.split('/').skip(1) {
            // Decoded first: the URL parser also reads "%2e%2e" as "..", and a decoded "%2f"
            // would split a segment in two.
            let decoded = percent_encoding::percent_decode_str(segment).decode_utf8_lossy();
            if decoded.is_empty() || decoded == "." || decoded == ".." {
                return Err(Error::url(
                    text,
                    "the path has an empty, '.' or '..' segment (percent-encoded or not)",
                ));
            }
            if decoded.contains(['/', '\\', '\0']) {
                return Err(Error::url(
                    text,
                    "a path segment holds an encoded '/', '\\' or NUL (%2F, %5C, %00)",
                ));
            }
        }
        let raw_path = parsed.path().trim_end_matches('/');
        let root = Path::from_url_path(raw_path).map_err(|e| Error::url(text, e.to_string()))?;
        if scheme == Scheme::File && root.as_ref().is_empty() {
            return Err(Error::url(
                text,
                "file:/// names the root directory; give a directory under it",
            ));
        }
        Ok(RemoteUrl {
            scheme,
            bucket,
            root,
        })
    }

    pub fn scheme(&self) -> Scheme {
        self.scheme
    }

    /// The bucket of an `s3://` URL; empty for `file://`.
    pub fn bucket(&self) -> &str {
        &self.bucket
    }

    /// The key prefix inside the store.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// The last segment: the name of the cache this URL names, if it names one.
    pub fn name(&self) -> Option<&str> {
        self.root.filename()
    }

    /// The URL of `rel` (a relative key, `/`-separated) under this one.
    pub fn join(&self, rel: &str) -> Result<RemoteUrl> {
        let mut root = self.root.clone();
        for part in rel.split('/') {
            if part.is_empty() || part == "." || part == ".." {
                return Err(Error::url(
                    &format!("{self}/{rel}"),
                    "the path has an empty, '.' or '..' segment",
                ));
            }
            root = root.join(part);
        }
        Ok(RemoteUrl {
            scheme: self.scheme,
            bucket: self.bucket.clone(),
            root,
        })
    }

    /// The key of `rel` under this URL (`rel` comes from this crate, never from a server).
    pub(crate) fn key(&self, rel: &str) -> Path {
        rel.split('/')
            .filter(|p| !p.is_empty())
            .fold(self.root.clone(), |path, part| path.join(part))
    }

    /// A key of this URL's store as a URL, for messages.
    pub fn display_key(&self, key: &Path) -> String {
        match self.scheme {
            Scheme::S3 if key.as_ref().is_empty() => format!("s3://{}", self.bucket),
            Scheme::S3 => format!("s3://{}/{key}", self.bucket),
            Scheme::File => format!("file:///{key}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn s3_and_file_urls_parse() {
        let u = RemoteUrl::parse("s3://my-bucket/data/train/").unwrap();
        assert_eq!(u.scheme(), Scheme::S3);
        assert_eq!(u.bucket(), "my-bucket");
        assert_eq!(u.root().as_ref(), "data/train");
        assert_eq!(u.name(), Some("train"));
        assert_eq!(u.to_string(), "s3://my-bucket/data/train");
        assert_eq!(
            u.key("shards/000001.bin").as_ref(),
            "data/train/shards/000001.bin"
        );
        let top = RemoteUrl::parse("s3://bucket").unwrap();
        assert_eq!(top.root().as_ref(), "");
        assert_eq!(top.name(), None);
        assert_eq!(top.join("train").unwrap().to_string(), "s3://bucket/train");
        let f = RemoteUrl::parse("file:///tmp/x%20y/train").unwrap();
        assert_eq!(f.scheme(), Scheme::File);
        assert_eq!(f.root().as_ref(), "tmp/x y/train");
        assert_eq!(f.to_string(), "file:///tmp/x y/train");
    }

    #[test]
    fn bad_urls_say_what_is_accepted() {
        for (url, says) in [
            ("/data/train", "not a URL"),
            ("gs://b/x", "not supported yet"),
            ("az://b/x", "not supported yet"),
            ("http://host/x", "not supported"),
            ("s3://B/x", "not a bucket name"),
            ("s3://ab/x", "not a bucket name"),
            ("s3://bucket:9000/x", "endpoint"),
            ("s3://bucket/a//b", "empty"),
            ("s3://bucket/a/../b", "'..'"),
            ("s3://bucket/a/%2e%2e/b", "'..'"),
            ("s3://bucket/a/%2E./b", "'..'"),
            ("file:///tmp/a/%2e/b", "'.'"),
            ("s3://bucket/a%2Fb/c", "encoded '/'"),
            ("s3://bucket/a/%00", "NUL"),
            ("s3://bucket/x?versionId=3", "query"),
            ("file://host/x", "local path"),
            ("file:///", "root directory"),
        ] {
            let err = RemoteUrl::parse(url).unwrap_err().to_string();
            assert!(err.contains(says), "{url}: {err}");
        }
    }

    #[test]
    fn credentials_in_a_url_are_refused_and_never_echoed() {
        let err = RemoteUrl::parse("s3://AKIDSECRET:hunter2@bucket/x")
            .unwrap_err()
            .to_string();
        assert!(err.contains("environment"), "{err}");
        assert!(
            !err.contains("hunter2") && !err.contains("AKIDSECRET"),
            "{err}"
        );
        assert_eq!(redact("s3://a:b@bucket/x@y"), "s3://***@bucket/x@y");
        assert_eq!(redact("s3://bucket/x@y"), "s3://bucket/x@y");
    }
}

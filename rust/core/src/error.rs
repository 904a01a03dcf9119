//! The one error type of the core. The bindings map each variant onto the Python exception tree
//! rooted at `DatasetRTError`; I/O errors keep their kind so Python sees `FileNotFoundError` etc.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system error on a file or directory.
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    /// A published cache failed validation: the cache is malformed and is never overwritten.
    #[error("cache {cache:?} is malformed: {file}: {reason}")]
    Malformed {
        cache: String,
        file: PathBuf,
        reason: String,
    },

    /// A record failed its own checksum or header check while being read.
    #[error(
        "corrupt record in cache {cache:?}: shard {shard} at offset {offset}, sample {sample}: {reason}; \
         the cache is damaged: delete it and rebuild it from its source"
    )]
    CorruptRecord {
        cache: String,
        shard: PathBuf,
        offset: u64,
        sample: u64,
        reason: String,
    },

    /// A sample given to the writer is not acceptable.
    #[error("source {source_name:?}, sample {sample_index}: {reason}")]
    InvalidSample {
        source_name: String,
        sample_index: u64,
        reason: String,
    },

    /// A configuration value is out of its domain.
    #[error("invalid {what}: {reason}")]
    InvalidConfig { what: &'static str, reason: String },

    /// A samples-metadata table was refused; nothing was changed.
    #[error("samples metadata refused: {0}")]
    SamplesMetadata(String),

    /// An iterator state was refused.
    #[error("state refused: {0}")]
    State(String),

    /// Memory for a structure the work needs cannot be had; nothing was changed.
    #[error("cannot allocate {bytes} bytes for {what}: {advice}")]
    OutOfMemory {
        what: String,
        bytes: u64,
        advice: &'static str,
    },

    /// The worker pool cannot run the work (closed, used from a forked child, a worker panicked).
    #[error("{0}")]
    Runtime(String),

    /// The caller's interrupt check asked to stop (Ctrl-C in Python); nothing was published.
    #[error("{0}")]
    Interrupted(String),
}

impl Error {
    pub fn io(op: &'static str, path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            op,
            path: path.into(),
            source,
        }
    }

    pub fn malformed(cache: &str, file: impl Into<PathBuf>, reason: impl Into<String>) -> Self {
        Error::Malformed {
            cache: cache.to_owned(),
            file: file.into(),
            reason: reason.into(),
        }
    }

    pub fn config(what: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidConfig {
            what,
            reason: reason.into(),
        }
    }
}

/// Adds the operation and path to an `io::Result`.
pub trait IoContext<T> {
    fn ctx(self, op: &'static str, path: &std::path::Path) -> Result<T>;
}

impl<T> IoContext<T> for std::io::Result<T> {
    fn ctx(self, op: &'static str, path: &std::path::Path) -> Result<T> {
        self.map_err(|e| Error::io(op, path, e))
    }
}

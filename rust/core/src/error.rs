//! The one error type of the core, and the one table of error kinds. Every error the product
//! reports, the core's and the loader's, has an [`ErrorKind`]: the bindings choose the Python
//! class from it (the tree rooted at `DatasetRTError`), and the loader's producer writes its code
//! into the control segment, so the training process raises the class the producer meant. I/O
//! errors keep their errno, so Python sees `FileNotFoundError`, `PermissionError`, etc.

use std::path::PathBuf;

pub type Result<T, E = Error> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An operating-system error on a file or directory. A process limit that caused it is
    /// named with its value ([`limit_note`]).
    #[error("{op} {path}: {source}{}", limit_note(.source))]
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
         the cache is damaged: delete it (for a part of a cache set, the whole set) and rebuild \
         it from its source"
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

/// Declares [`ErrorKind`] from one list, so that the variants, their codes, [`ErrorKind::ALL`]
/// and [`ErrorKind::from_code`] cannot disagree.
macro_rules! error_kinds {
    ($($(#[doc = $doc:literal])* $kind:ident = $code:literal, $name:literal;)*) => {
        /// What kind of failure an error is. Not `#[non_exhaustive]`: code outside the core
        /// matches it exhaustively, so a new kind fails to compile until every user decides
        /// what it means.
        ///
        /// The codes are stable: the loader's producer writes them into the control segment
        /// (`shm/LAYOUT.md`, "Error kinds"). Never renumber or reuse one; 0 and 255 are taken
        /// by the control segment ("no error", "being written").
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u32)]
        pub enum ErrorKind {
            $($(#[doc = $doc])* $kind = $code,)*
        }

        impl ErrorKind {
            /// Every kind, in code order.
            pub const ALL: &'static [ErrorKind] = &[$(ErrorKind::$kind),*];

            /// The kind's stable code.
            pub fn code(self) -> u32 {
                self as u32
            }

            /// The kind a code names; a code this build does not know is an error, never
            /// another kind.
            pub fn from_code(code: u32) -> Result<ErrorKind, UnknownErrorKind> {
                match code {
                    $($code => Ok(ErrorKind::$kind),)*
                    _ => Err(UnknownErrorKind(code)),
                }
            }

            /// A few words naming the kind, as `shm/LAYOUT.md` lists it.
            pub fn describe(self) -> &'static str {
                match self {
                    $(ErrorKind::$kind => $name,)*
                }
            }
        }
    };
}

error_kinds! {
    /// An operating-system error; [`Error::errno`] says which.
    Io = 1, "I/O";
    /// A published cache failed validation.
    Malformed = 2, "malformed cache";
    /// A record failed its checks while read.
    CorruptRecord = 3, "corrupt record";
    /// A loader batch does not fit a ring slot.
    BatchTooLarge = 4, "batch larger than a slot";
    /// An iterator state was refused, or the caches changed under the loader.
    State = 5, "state";
    /// The shared-memory loader itself failed: a party broke the protocol or is gone.
    Loader = 6, "loader";
    /// A sample given to the writer is not acceptable.
    InvalidSample = 7, "invalid sample";
    /// A configuration value is out of its domain.
    InvalidConfig = 8, "invalid configuration";
    /// A samples-metadata table was refused.
    SamplesMetadata = 9, "samples metadata";
    /// Memory for a structure the work needs cannot be had.
    OutOfMemory = 10, "out of memory";
    /// The worker pool cannot run the work.
    Runtime = 11, "runtime";
    /// The caller's interrupt check asked to stop.
    Interrupted = 12, "interrupted";
    /// The loader was closed, or its owner is gone: a loader party exits on it.
    Closed = 13, "closed";
}

/// A code that names no [`ErrorKind`] of this build (written by another build, or garbage).
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
#[error("error kind code {0} is not one this build knows")]
pub struct UnknownErrorKind(pub u32);

/// What to add to an I/O error that a process limit caused: the limit and its value, so that
/// "Too many open files" says how many may be open.
pub fn limit_note(err: &std::io::Error) -> String {
    let (resource, name, what) = match err.raw_os_error() {
        Some(libc::EMFILE) => (
            libc::RLIMIT_NOFILE,
            "RLIMIT_NOFILE",
            "open files (an open cache holds one descriptor per shard file)",
        ),
        Some(libc::EFBIG) => (libc::RLIMIT_FSIZE, "RLIMIT_FSIZE", "bytes in one file"),
        _ => return String::new(),
    };
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `getrlimit` writes one `rlimit` into the struct it is given.
    if unsafe { libc::getrlimit(resource, &mut limit) } != 0 {
        return String::new();
    }
    let value = if limit.rlim_cur == libc::RLIM_INFINITY {
        "unlimited".to_owned()
    } else {
        limit.rlim_cur.to_string()
    };
    format!(
        " (the process limit {name} allows {value} {what}; raise it, for example with `ulimit`)"
    )
}

/// The errno of an I/O error: the operating system's, else the one its kind stands for when an
/// error was made without one (`NotFound` is ENOENT, `PermissionDenied` EACCES; the others are
/// those of remote requests, so that Python raises `FileExistsError`, `ConnectionRefusedError`
/// and `TimeoutError` for them).
pub fn io_errno(err: &std::io::Error) -> Option<i32> {
    use std::io::ErrorKind as K;
    err.raw_os_error().or(match err.kind() {
        K::NotFound => Some(libc::ENOENT),
        K::PermissionDenied => Some(libc::EACCES),
        K::AlreadyExists => Some(libc::EEXIST),
        K::ConnectionRefused => Some(libc::ECONNREFUSED),
        K::TimedOut => Some(libc::ETIMEDOUT),
        _ => None,
    })
}

impl Error {
    /// The error's kind (every variant has exactly one).
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Io { .. } => ErrorKind::Io,
            Error::Malformed { .. } => ErrorKind::Malformed,
            Error::CorruptRecord { .. } => ErrorKind::CorruptRecord,
            Error::InvalidSample { .. } => ErrorKind::InvalidSample,
            Error::InvalidConfig { .. } => ErrorKind::InvalidConfig,
            Error::SamplesMetadata(_) => ErrorKind::SamplesMetadata,
            Error::State(_) => ErrorKind::State,
            Error::OutOfMemory { .. } => ErrorKind::OutOfMemory,
            Error::Runtime(_) => ErrorKind::Runtime,
            Error::Interrupted(_) => ErrorKind::Interrupted,
        }
    }

    /// The errno of an operating-system error ([`io_errno`]); `None` for every other error.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Io { source, .. } => io_errno(source),
            Error::Malformed { .. }
            | Error::CorruptRecord { .. }
            | Error::InvalidSample { .. }
            | Error::InvalidConfig { .. }
            | Error::SamplesMetadata(_)
            | Error::State(_)
            | Error::OutOfMemory { .. }
            | Error::Runtime(_)
            | Error::Interrupted(_) => None,
        }
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    /// One error of every variant (an exhaustive match below keeps the list complete).
    fn one_of_each() -> Vec<Error> {
        let io = std::io::Error::from_raw_os_error(libc::ENOSPC);
        let all = vec![
            Error::io("write", "/x", io),
            Error::malformed("c", "/x", "bad"),
            Error::CorruptRecord {
                cache: "c".into(),
                shard: "/x".into(),
                offset: 0,
                sample: 0,
                reason: "bad".into(),
            },
            Error::InvalidSample {
                source_name: "s".into(),
                sample_index: 0,
                reason: "bad".into(),
            },
            Error::config("x", "bad"),
            Error::SamplesMetadata("bad".into()),
            Error::State("bad".into()),
            Error::OutOfMemory {
                what: "x".into(),
                bytes: 1,
                advice: "less",
            },
            Error::Runtime("bad".into()),
            Error::Interrupted("bad".into()),
        ];
        for e in &all {
            // Fails to compile when a variant is added: add it to the list above too.
            match e {
                Error::Io { .. }
                | Error::Malformed { .. }
                | Error::CorruptRecord { .. }
                | Error::InvalidSample { .. }
                | Error::InvalidConfig { .. }
                | Error::SamplesMetadata(_)
                | Error::State(_)
                | Error::OutOfMemory { .. }
                | Error::Runtime(_)
                | Error::Interrupted(_) => {}
            }
        }
        all
    }

    #[test]
    fn every_variant_maps_to_its_kind() {
        let kinds: Vec<ErrorKind> = one_of_each().iter().map(Error::kind).collect();
        assert_eq!(
            kinds,
            [
                ErrorKind::Io,
                ErrorKind::Malformed,
                ErrorKind::CorruptRecord,
                ErrorKind::InvalidSample,
                ErrorKind::InvalidConfig,
                ErrorKind::SamplesMetadata,
                ErrorKind::State,
                ErrorKind::OutOfMemory,
                ErrorKind::Runtime,
                ErrorKind::Interrupted,
            ]
        );
    }

    #[test]
    fn only_os_errors_carry_an_errno() {
        let errnos: Vec<Option<i32>> = one_of_each().iter().map(Error::errno).collect();
        assert_eq!(errnos[0], Some(libc::ENOSPC));
        assert!(errnos[1..].iter().all(Option::is_none), "{errnos:?}");
        // An I/O error made without an OS code keeps the errno its kind stands for.
        let made = |kind| Error::io("open", "/x", std::io::Error::new(kind, "made here"));
        assert_eq!(
            made(std::io::ErrorKind::NotFound).errno(),
            Some(libc::ENOENT)
        );
        assert_eq!(
            made(std::io::ErrorKind::PermissionDenied).errno(),
            Some(libc::EACCES)
        );
        assert_eq!(made(std::io::ErrorKind::Other).errno(), None);
    }

    #[test]
    fn codes_round_trip_and_unknown_codes_are_refused() {
        for &kind in ErrorKind::ALL {
            assert_eq!(ErrorKind::from_code(kind.code()), Ok(kind));
        }
        let known: Vec<u32> = (0..=1024)
            .filter(|&c| ErrorKind::from_code(c).is_ok())
            .collect();
        let listed: Vec<u32> = ErrorKind::ALL.iter().map(|k| k.code()).collect();
        assert_eq!(known, listed, "ALL lists every code, in order");
        // 0 and 255 mean "no error" and "being written" in the control segment.
        let next = ErrorKind::ALL.last().unwrap().code() + 1;
        for code in [0, 255, next, u32::MAX] {
            let err = ErrorKind::from_code(code).unwrap_err();
            assert_eq!(err, UnknownErrorKind(code));
            assert!(err.to_string().contains(&code.to_string()));
        }
    }

    #[test]
    fn kinds_have_distinct_descriptions() {
        let mut names: Vec<&str> = ErrorKind::ALL.iter().map(|k| k.describe()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), ErrorKind::ALL.len());
    }

    #[test]
    fn io_errors_without_an_os_code_take_their_kinds_errno() {
        use std::io::{Error as IoError, ErrorKind as K};
        for (kind, errno) in [
            (K::NotFound, Some(libc::ENOENT)),
            (K::PermissionDenied, Some(libc::EACCES)),
            (K::AlreadyExists, Some(libc::EEXIST)),
            (K::ConnectionRefused, Some(libc::ECONNREFUSED)),
            (K::TimedOut, Some(libc::ETIMEDOUT)),
            (K::InvalidInput, None),
        ] {
            assert_eq!(io_errno(&IoError::new(kind, "x")), errno, "{kind:?}");
        }
        // The operating system's own code wins.
        let os = IoError::from_raw_os_error(libc::ENOSPC);
        assert_eq!(io_errno(&os), Some(libc::ENOSPC));
    }
}

//! Where a cache is written and how it is published: the cache name's rules, the lock on a
//! name, the temporary directory's name and the leftovers of writers that died, and the
//! directory syncs that make a publication durable.

use std::fs::{self, File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::error::{Error, IoContext, Result};
use crate::liveness;

use super::INTERRUPT_POLL;

/// The bytes that the temporary directory's name `.NAME.tmp-PID-NANOS` adds to a cache name, at
/// most: a pid has at most 10 digits (an i32), the nanoseconds since 1970 at most 20 (until the
/// year 2286 they have 19). The lock file `.NAME.lock` adds less.
const TMP_NAME_EXTRA_BYTES: usize = ".".len() + ".tmp-".len() + 10 + "-".len() + 20;

/// The longest cache name, in bytes: its temporary directory's name must still fit the 255-byte
/// limit that Linux file systems put on one file name.
pub const MAX_NAME_BYTES: usize = 255 - TMP_NAME_EXTRA_BYTES;

pub(super) fn tmp_dir_name(name: &str, pid: u32, nanos: u128) -> String {
    format!(".{name}.tmp-{pid}-{nanos}")
}

/// The names of the caches one call writes or opens: each a valid cache name
/// ([`validate_name`]), none twice. `what` is "source name" or "cache name"; `why` says why the
/// names must be unique and what was not done.
pub fn validate_names(names: &[String], what: &'static str, why: &str) -> Result<()> {
    let mut seen = std::collections::HashSet::new();
    for name in names {
        validate_name(name).map_err(|e| match e {
            Error::InvalidConfig { reason, .. } => Error::config(what, reason),
            other => other,
        })?;
        if !seen.insert(name) {
            let items = what.trim_end_matches(" name");
            return Err(Error::config(
                what,
                format!("two {items}s are named {name:?}: {why}"),
            ));
        }
    }
    Ok(())
}

/// A cache name must be one plain directory name.
pub fn validate_name(name: &str) -> Result<()> {
    let why = if name.is_empty() {
        Some("it is empty")
    } else if name.starts_with('.') {
        Some("it starts with '.'")
    } else if name.contains('/') {
        Some("it contains '/'")
    } else if name.contains('\\') {
        Some("it contains a backslash")
    } else if name.contains('\0') {
        Some("it contains a NUL byte")
    } else {
        None
    };
    if let Some(why) = why {
        return Err(Error::config(
            "source name",
            format!(
                "{name:?} is not a plain directory name: {why} (a name is non-empty, does not \
                 start with '.', and has no '/', backslash or NUL byte)"
            ),
        ));
    }
    if name.len() > MAX_NAME_BYTES {
        return Err(Error::config(
            "source name",
            format!(
                "{:?}... is {} bytes long; a cache name may have at most {MAX_NAME_BYTES} bytes \
                 (its temporary directory's name adds up to {TMP_NAME_EXTRA_BYTES} bytes, and a \
                 file name may have 255): use a shorter name",
                name.chars().take(32).collect::<String>(),
                name.len()
            ),
        ));
    }
    Ok(())
}

/// Errors clearly when `base` cannot be a base cache directory because it, or the nearest part
/// of it that exists, is not a directory (a regular file, say). Creates nothing.
pub fn check_base_dir(base: &Path) -> Result<()> {
    let Some(existing) = base.ancestors().find(|p| fs::metadata(p).is_ok()) else {
        return Ok(());
    };
    if fs::metadata(existing).is_ok_and(|m| !m.is_dir()) {
        let what = if existing == base {
            format!("{} is not a directory", base.display())
        } else {
            format!(
                "{} lies below {}, which is not a directory",
                base.display(),
                existing.display()
            )
        };
        return Err(Error::config(
            "base_cache_dir",
            format!("{what}; pass a directory (a missing one is created when a cache is written)"),
        ));
    }
    Ok(())
}

/// Opens (creating it if needed) the lock file without following a symbolic link and without
/// blocking on a FIFO: a file planted at the lock's path never makes the writer create or open
/// anything outside the base directory.
fn open_lock_file(path: &Path) -> Result<File> {
    let flags = libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_CLOEXEC;
    let refused = |what: &str| {
        Error::io(
            "open lock file",
            path,
            std::io::Error::other(format!(
                "{what}, not a regular file; the lock is never opened through a link or on a \
                 special file, so nothing was written: remove it and retry"
            )),
        )
    };
    let opened = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o644)
        .custom_flags(flags)
        .open(path)
        .or_else(|e| match e.kind() {
            // Another user's lock file in a shared base directory: flock needs no write access.
            // Without one, the base directory refused to create it: that is the error to tell.
            std::io::ErrorKind::PermissionDenied => OpenOptions::new()
                .read(true)
                .custom_flags(flags)
                .open(path)
                .map_err(|other| match other.kind() {
                    std::io::ErrorKind::NotFound => e,
                    _ => other,
                }),
            _ => Err(e),
        });
    let file = match opened {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err(refused("it is a symbolic link"))
        }
        // A FIFO without a reader (write-only, non-blocking open) or a socket.
        Err(e) if e.raw_os_error() == Some(libc::ENXIO) => {
            return Err(refused("it is a FIFO or a socket"))
        }
        Err(e) => return Err(Error::io("open lock file", path, e)),
    };
    let meta = file.metadata().ctx("stat lock file", path)?;
    if !meta.is_file() {
        return Err(refused("it is a special file"));
    }
    Ok(file)
}

/// What [`CacheLock::claim`] found for a name: published already, or this caller's to write.
pub enum Claim {
    /// `base/NAME` exists: load it.
    Published(PathBuf),
    /// Nothing is published under the name, and the caller holds its lock.
    Write(CacheLock),
    /// Nothing is published under the name, and its lock could not be taken (storage that may
    /// not be written, or `interrupt` said stop): a write fails with this error.
    Refused(Error),
}

/// Whether `path` exists, without following a last symbolic link. An error other than "not
/// found" (a base directory that may not be searched) is an error: the cache may well be there.
fn published(path: &Path) -> Result<bool> {
    match fs::symlink_metadata(path) {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(Error::io("open", path, e)),
    }
}

/// An exclusive lock on one cache name under a base directory, held while deciding whether to
/// write and while writing. `flock` is released by the kernel when the holder dies, so a
/// crashed writer never blocks the next run.
pub struct CacheLock {
    file: File,
    pub base: PathBuf,
    pub name: String,
}

impl CacheLock {
    /// Blocks until the lock is held; creates `base` if needed.
    pub fn acquire(base: &Path, name: &str) -> Result<CacheLock> {
        Self::acquire_interruptible(base, name, &|| Ok(()))
    }

    /// Like [`CacheLock::acquire`], but asks `interrupt` about every [`INTERRUPT_POLL`] while
    /// another writer holds the lock, and gives up with its error.
    pub fn acquire_interruptible(
        base: &Path,
        name: &str,
        interrupt: &dyn Fn() -> Result<()>,
    ) -> Result<CacheLock> {
        validate_name(name)?;
        check_base_dir(base)?;
        fs::create_dir_all(base).ctx("create directory", base)?;
        let path = base.join(format!(".{name}.lock"));
        let file = open_lock_file(&path)?;
        // Polled, not a blocking flock: a blocked flock would ignore Ctrl-C for as long as
        // another writer (perhaps a hung one) holds the lock.
        let mut pause = Duration::from_millis(1);
        loop {
            // SAFETY: flock on a valid, owned descriptor.
            if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
                break;
            }
            let err = std::io::Error::last_os_error();
            match err.raw_os_error() {
                Some(libc::EWOULDBLOCK) => {
                    interrupt()?;
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(INTERRUPT_POLL);
                }
                Some(libc::EINTR) => {}
                _ => return Err(Error::io("lock", &path, err)),
            }
        }
        Ok(CacheLock {
            file,
            base: base.to_owned(),
            name: name.to_owned(),
        })
    }

    /// The one way to decide between loading and writing `base/NAME`. A published cache or set
    /// appears by one atomic rename, so one that exists is loaded without the lock (read-only
    /// storage works); otherwise the lock is taken (asking `interrupt` while another writer
    /// holds it), and the name is looked at again, since that writer may have published it.
    /// An error means that whether the name is published could not be told (a base directory
    /// that may not be searched, an invalid name).
    pub fn claim(base: &Path, name: &str, interrupt: &dyn Fn() -> Result<()>) -> Result<Claim> {
        validate_name(name)?;
        let dir = base.join(name);
        if published(&dir)? {
            return Ok(Claim::Published(dir));
        }
        let lock = match Self::acquire_interruptible(base, name, interrupt) {
            Ok(lock) => lock,
            Err(e) => return Ok(Claim::Refused(e)),
        };
        if published(&dir)? {
            return Ok(Claim::Published(dir));
        }
        Ok(Claim::Write(lock))
    }

    pub fn final_dir(&self) -> PathBuf {
        self.base.join(&self.name)
    }

    /// Removes temporary directories of earlier writers of this name. Holding the lock proves
    /// that none of them is alive. Best effort, like [`reap_dead_leftovers`]: garbage that
    /// cannot be listed or removed never fails a write.
    pub fn remove_leftovers(&self) -> usize {
        remove_leftovers_where(&self.base, &self.name)
    }
}

/// The writer's pid in `file_name` when it is exactly `.NAME.tmp-PID-NANOS`: never the
/// temporary directory of another name that happens to start the same way.
fn leftover_pid(file_name: &str, name: &str) -> Option<i32> {
    let rest = file_name
        .strip_prefix('.')?
        .strip_prefix(name)?
        .strip_prefix(".tmp-")?;
    let (pid, nanos) = rest.split_once('-')?;
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    if !digits(pid) || !digits(nanos) {
        return None;
    }
    pid.parse().ok()
}

/// Removes the leftovers of `name` in `base` (the caller proved their writers gone); returns how
/// many went. Errors (unreadable base, read-only storage, another process removing the same
/// directory first) are ignored: removing garbage is never worth failing the caller.
fn remove_leftovers_where(base: &Path, name: &str) -> usize {
    let Ok(entries) = fs::read_dir(base) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let file_name = entry.file_name();
        if leftover_pid(&file_name.to_string_lossy(), name).is_none() {
            continue;
        }
        if fs::remove_dir_all(entry.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}

/// Removes the temporary directories of writers of `name` under `base` once no writer of it is
/// alive, without taking the lock the blocking way and without creating the lock file (loading
/// works on read-only storage). Every writer holds `.NAME.lock` from before it creates its
/// directory until after it is gone, so a lock that can be taken at once proves every such
/// directory a leftover, whatever its pid says (reused, or from another PID namespace); a held,
/// missing or unopenable lock file removes nothing.
pub fn reap_dead_leftovers(base: &Path, name: &str) -> usize {
    match liveness::probe(&base.join(format!(".{name}.lock"))) {
        // Held until the removal is done: no writer starts meanwhile.
        liveness::Owner::Gone(_held) => remove_leftovers_where(base, name),
        liveness::Owner::Alive | liveness::Owner::Unknown(_) => 0,
    }
}

impl Drop for CacheLock {
    fn drop(&mut self) {
        // SAFETY: unlocking our own descriptor; closing it would release the lock anyway.
        unsafe { libc::flock(self.file.as_raw_fd(), libc::LOCK_UN) };
    }
}

pub(super) fn sync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .ctx("open", path)?
        .sync_all()
        .ctx("sync", path)
}

//! Named shared-memory segments: files in /dev/shm, created by the owner (the training process)
//! and opened by name by every other party.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::{Path, PathBuf};

use dataset_rt_core::liveness::{self, Owner, OwnerLock};
use dataset_rt_core::os;
use memmap2::MmapRaw;

use crate::layout::{NAME_PREFIX, SHM_DIR};
use crate::{Result, ShmError};

pub struct Segment {
    pub name: String,
    map: MmapRaw,
    /// The creator's lock on the segment: while it is held, no reaper removes the name.
    _owner: Option<OwnerLock>,
}

/// The `op` of the error a creation reports when a reaper removed the fresh entry before its
/// creator could lock it: the creator retries under another name.
pub const LOST_TO_REAPER: &str = "lock (a concurrent reaper removed it first)";

pub fn path_of(name: &str) -> PathBuf {
    PathBuf::from(SHM_DIR).join(name)
}

fn io(op: &'static str, name: &str, source: std::io::Error) -> ShmError {
    ShmError::Io {
        op,
        path: path_of(name),
        source,
    }
}

impl Segment {
    /// Creates `name` (never an existing one), locked by this process for as long as the
    /// segment lives, sized and backed now: `posix_fallocate` makes a full /dev/shm fail here
    /// with ENOSPC instead of killing a writer with SIGBUS later.
    pub fn create(name: &str, len: u64) -> Result<Segment> {
        let path = path_of(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| io("create", name, e))?;
        let owner = hold(file, &path, name).inspect_err(|_| {
            let _ = std::fs::remove_file(&path);
        })?;
        let file = owner.file();
        // SAFETY: a valid fd we own; offsets are in range.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
        if rc != 0 {
            let _ = std::fs::remove_file(&path);
            let err = std::io::Error::from_raw_os_error(rc);
            return Err(ShmError::Io {
                op: "allocate (is /dev/shm large enough? lower slot_size_bytes or prefetch_factor)",
                path,
                source: err,
            });
        }
        let map = Self::map(name, file, len)?;
        Ok(Segment {
            _owner: Some(owner),
            ..map
        })
    }

    /// Opens an existing segment by name and maps all of it.
    pub fn open(name: &str) -> Result<Segment> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path_of(name))
            .map_err(|e| io("open", name, e))?;
        let len = file.metadata().map_err(|e| io("stat", name, e))?.len();
        Self::map(name, &file, len)
    }

    fn map(name: &str, file: &File, len: u64) -> Result<Segment> {
        let map = MmapRaw::map_raw(file).map_err(|e| io("mmap", name, e))?;
        if map.len() as u64 != len {
            return Err(ShmError::Protocol(format!(
                "segment {name} maps {} bytes, expected {len}",
                map.len()
            )));
        }
        Ok(Segment {
            name: name.to_owned(),
            map,
            _owner: None,
        })
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.len() == 0
    }

    pub fn ptr(&self) -> *mut u8 {
        self.map.as_mut_ptr()
    }
}

/// Locks an entry just created at `path` for its creator (see [`OwnerLock::hold`]).
fn hold(file: File, path: &Path, name: &str) -> Result<OwnerLock> {
    OwnerLock::hold(file, path).map_err(|source| ShmError::Io {
        op: if source.kind() == std::io::ErrorKind::NotFound {
            LOST_TO_REAPER
        } else {
            "lock"
        },
        path: path_of(name),
        source,
    })
}

/// Creates the owner's private directory `name` (mode 0700, never an existing one), locked by
/// this process like a segment.
pub fn create_private_dir(name: &str) -> Result<OwnerLock> {
    let path = path_of(name);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&path)
        .map_err(|e| io("create directory", name, e))?;
    let dir = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|e| io("open directory", name, e))?;
    hold(dir, &path, name).inspect_err(|_| {
        let _ = std::fs::remove_dir(&path);
    })
}

/// Removes a segment's name; its memory lives on until every mapping is gone.
pub fn unlink(name: &str) {
    let path = path_of(name);
    // The owner's private directory shares the naming scheme, so it is removed alike.
    if path.is_dir() {
        let _ = std::fs::remove_dir_all(path);
    } else {
        let _ = std::fs::remove_file(path);
    }
}

/// The owner pid a DatasetRT segment name carries.
pub fn owner_of(name: &str) -> Option<u64> {
    name.strip_prefix(NAME_PREFIX)?
        .split('-')
        .next()?
        .parse()
        .ok()
}

/// Removes leftover entries of dead owners from /dev/shm: DatasetRT names
/// (`dataset-rt-<pid>-…`) whose owner's lock nobody holds. Every owner holds a lock on each of
/// its entries for as long as it lives, so a live owner's entries are never removed, even when
/// its pid looks dead from here (reused, or an owner in another PID namespace sharing
/// /dev/shm). The pid only ever keeps an entry: one whose pid runs here is left too, since an
/// older DatasetRT (layout version 2 or earlier) holds no lock. Entries that cannot be opened
/// (another user's, symbolic links) are left alone. Returns the names removed.
pub fn reap_leftovers() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        match owner_of(&name) {
            Some(pid) if !os::pid_alive(pid) => {}
            _ => continue,
        }
        let path = path_of(&name);
        // Held while removing: nobody can lock the entry meanwhile.
        let Owner::Gone(held) = liveness::probe(&path) else {
            continue;
        };
        let gone = match held.metadata() {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&path).is_ok(),
            Ok(m) if m.is_file() => std::fs::remove_file(&path).is_ok(),
            _ => false,
        };
        if gone {
            removed.push(name);
        }
    }
    removed
}

/// A fresh name stem `dataset-rt-<pid>-<nonce>`: the nonce mixes the clock and a counter, and
/// `create_new` makes a collision an error rather than a shared segment.
pub fn new_stem(owner_pid: u64) -> String {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    let nonce = (t ^ n.wrapping_mul(0x9E37_79B9_7F4A_7C15)) & 0xFFFF_FFFF_FFFF;
    format!("{NAME_PREFIX}{owner_pid}-{nonce:012x}{n:x}")
}

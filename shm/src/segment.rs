//! Named shared-memory segments: files in /dev/shm, created by the owner (the training process)
//! and opened by name by every other party.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;

use memmap2::MmapRaw;

use crate::layout::{NAME_PREFIX, SHM_DIR};
use crate::{Result, ShmError};

pub struct Segment {
    pub name: String,
    map: MmapRaw,
}

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
    /// Creates `name` (never an existing one), sized and backed now: `posix_fallocate` makes a
    /// full /dev/shm fail here with ENOSPC instead of killing a writer with SIGBUS later.
    pub fn create(name: &str, len: u64) -> Result<Segment> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path_of(name))
            .map_err(|e| io("create", name, e))?;
        // SAFETY: a valid fd we own; offsets are in range.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
        if rc != 0 {
            let _ = std::fs::remove_file(path_of(name));
            let err = std::io::Error::from_raw_os_error(rc);
            return Err(ShmError::Io {
                op: "allocate (is /dev/shm large enough? lower slot_size_bytes or prefetch_factor)",
                path: path_of(name),
                source: err,
            });
        }
        Self::map(name, &file, len)
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

/// Removes a segment's name; its memory lives on until every mapping is gone.
pub fn unlink(name: &str) {
    let path = path_of(name);
    // The loader's private spec directory shares the naming scheme, so it is reaped alike.
    if path.is_dir() {
        let _ = std::fs::remove_dir_all(path);
    } else {
        let _ = std::fs::remove_file(path);
    }
}

/// Whether a process with this pid exists (zombies count as gone: they run nothing).
pub fn pid_alive(pid: u64) -> bool {
    if pid == 0 || pid > i32::MAX as u64 {
        return false;
    }
    // SAFETY: signal 0 only checks existence and permission.
    let rc = unsafe { libc::kill(pid as libc::pid_t, 0) };
    if rc != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH) {
        return false;
    }
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        // The state follows the parenthesised command name, which may itself contain ") ".
        Ok(stat) => stat
            .rsplit_once(')')
            .is_none_or(|(_, rest)| !rest.trim_start().starts_with(['Z', 'X'])),
        Err(_) => rc == 0,
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

/// Removes leftover segments whose owner process is gone (never a live owner's). Returns the
/// names removed.
pub fn reap_leftovers() -> Vec<String> {
    let Ok(dir) = std::fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if let Some(pid) = owner_of(&name) {
            if !pid_alive(pid) {
                unlink(&name);
                removed.push(name);
            }
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

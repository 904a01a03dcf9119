//! Named shared-memory segments: files in /dev/shm, created by the owner (the training process)
//! and opened by name by every other party. Which names, and who removes them when, is the
//! loader's business (`dataset-rt-loader`'s `lifecycle`).

use std::fs::{File, OpenOptions};
use std::os::unix::fs::OpenOptionsExt;
use std::os::unix::io::AsRawFd;
use std::path::PathBuf;

use memmap2::MmapRaw;

use crate::layout::SHM_DIR;
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
    /// Creates `name` (never an existing one, mode 0600), sized and backed now:
    /// `posix_fallocate` makes a full /dev/shm fail here with ENOSPC instead of killing a
    /// writer with SIGBUS later. `lock` runs on the fresh file before it is sized (the creator's
    /// claim on the name); what it returns comes back with the segment. On failure the name is
    /// removed.
    pub fn create<L>(
        name: &str,
        len: u64,
        lock: impl FnOnce(&File, &std::path::Path) -> Result<L>,
    ) -> Result<(Segment, L)> {
        let path = path_of(name);
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(|e| io("create", name, e))?;
        let lock = lock(&file, &path).inspect_err(|_| {
            let _ = std::fs::remove_file(&path);
        })?;
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
        let map = Self::map(name, &file, len).inspect_err(|_| {
            let _ = std::fs::remove_file(&path);
        })?;
        Ok((map, lock))
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

/// Removes a segment's name; its memory lives on until every mapping is gone. A directory of
/// that name (the loader's private one) is removed with its content.
pub fn unlink(name: &str) {
    let path = path_of(name);
    if path.is_dir() {
        let _ = std::fs::remove_dir_all(path);
    } else {
        let _ = std::fs::remove_file(path);
    }
}

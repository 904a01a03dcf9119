//! Whether the owner of leftover files is alive, judged by a lock the kernel releases when the
//! owner dies, never by its pid.
//!
//! An owner holds a `flock` for as long as its files matter: the cache writer an exclusive one
//! on `.NAME.lock` (its temporary directories' names say which lock), the loader's training
//! process a shared one on each of its `/dev/shm` entries. A reaper removes leftovers only
//! after taking that lock itself. A pid proves nothing once it is reused, nor across PID
//! namespaces that share `/dev/shm` or a base directory; a lock does, because every process on
//! one kernel sees the same locks. (Hosts sharing a network filesystem do not: there, `flock`
//! may be local to each host.)

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::io::AsRawFd;
use std::path::Path;

fn flock(file: &File, operation: libc::c_int) -> io::Result<()> {
    loop {
        // SAFETY: flock on a descriptor this process owns.
        if unsafe { libc::flock(file.as_raw_fd(), operation) } == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// An owner's proof of life on one of its files or directories: a shared lock, held until this
/// is dropped (and, as with any `flock`, by a child that inherited the descriptor across fork).
pub struct OwnerLock {
    file: File,
}

impl OwnerLock {
    /// Locks `file`, which the caller has just created at `path`, and checks that `path` still
    /// names it. Until the lock is taken a reaper may find the entry unlocked and remove it; the
    /// check turns that (rare) race into an error of kind `NotFound`, never a lost lock.
    pub fn hold(file: File, path: &Path) -> io::Result<OwnerLock> {
        flock(&file, libc::LOCK_SH)?;
        let ours = file.metadata()?;
        match std::fs::symlink_metadata(path) {
            Ok(now) if now.dev() == ours.dev() && now.ino() == ours.ino() => Ok(OwnerLock { file }),
            Ok(_) => Err(io::Error::new(
                io::ErrorKind::NotFound,
                "removed by a concurrent reaper before it was locked",
            )),
            Err(e) => Err(e),
        }
    }

    /// The locked file.
    pub fn file(&self) -> &File {
        &self.file
    }
}

/// What [`probe`] found out about the owner of a lock.
pub enum Owner {
    /// Someone holds the lock: its owner (or a process it handed the descriptor to) is alive.
    Alive,
    /// Nobody held the lock, so its owner is gone. The probe now holds it exclusively until this
    /// file is dropped: no new owner can take it while the leftovers are being removed.
    Gone(File),
    /// The entry could not be opened or locked (missing, a symbolic link, another user's
    /// file): nothing is known, so nothing may be removed.
    Unknown(io::Error),
}

/// Tries to take the lock on `path` exclusively, without waiting and without creating or
/// following anything (read-only storage is fine: `flock` needs no write access).
pub fn probe(path: &Path) -> Owner {
    let opened = OpenOptions::new()
        .read(true)
        // A FIFO planted under a leftover's name must not block the open.
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path);
    let file = match opened {
        Ok(f) => f,
        Err(e) => return Owner::Unknown(e),
    };
    match flock(&file, libc::LOCK_EX | libc::LOCK_NB) {
        Ok(()) => Owner::Gone(file),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Owner::Alive,
        Err(e) => Owner::Unknown(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_held_lock_means_alive_and_a_free_one_gone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("owned");
        let created = File::create(&path).unwrap();
        let held = OwnerLock::hold(created, &path).unwrap();
        // Another open file description, even in this process, conflicts with the owner's.
        assert!(matches!(probe(&path), Owner::Alive));
        drop(held);
        let Owner::Gone(exclusive) = probe(&path) else {
            panic!("a free lock is a gone owner")
        };
        // While the prober holds it, a second prober sees a live holder.
        assert!(matches!(probe(&path), Owner::Alive));
        drop(exclusive);
        assert!(matches!(probe(&path), Owner::Gone(_)));
    }

    #[test]
    fn directories_lock_like_files_and_unknowns_are_not_gone() {
        let dir = tempfile::tempdir().unwrap();
        let sub = dir.path().join("sub");
        std::fs::create_dir(&sub).unwrap();
        let held = OwnerLock::hold(File::open(&sub).unwrap(), &sub).unwrap();
        assert!(matches!(probe(&sub), Owner::Alive));
        drop(held);
        assert!(matches!(probe(&sub), Owner::Gone(_)));
        assert!(matches!(
            probe(&dir.path().join("absent")),
            Owner::Unknown(_)
        ));
        let link = dir.path().join("link");
        std::os::unix::fs::symlink(&sub, &link).unwrap();
        assert!(matches!(probe(&link), Owner::Unknown(_)));
    }

    #[test]
    fn a_lock_on_an_entry_replaced_before_locking_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("raced");
        let created = File::create(&path).unwrap();
        // A reaper removed it (and something else took the name) before the owner locked it.
        std::fs::remove_file(&path).unwrap();
        std::fs::write(&path, b"another").unwrap();
        let err = OwnerLock::hold(created, &path).err().expect("refused");
        assert_eq!(err.kind(), io::ErrorKind::NotFound);
    }
}

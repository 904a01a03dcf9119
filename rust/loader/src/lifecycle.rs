//! The lifecycle of a pass's entries in /dev/shm (`shm/LAYOUT.md`, first section): their names,
//! who creates and locks them, who removes them and when, and the removal of leftovers of dead
//! owners. The owner holds a lock on each of its entries for as long as its ring lives (see
//! `dataset_rt_core::liveness`); the last party to attach removes the names (the ring does it,
//! from the names given here); a producer whose owner died removes them itself.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use dataset_rt_core::liveness::{self, Owner, OwnerLock};
use dataset_rt_core::os;
use dataset_rt_shm::layout::SHM_DIR;
use dataset_rt_shm::ring::{Created, Geometry, Names, Pass, Ring};
use dataset_rt_shm::segment::{self, path_of, Segment};
use dataset_rt_shm::ShmError;

use crate::pass::check_split;
use crate::{protocol, Result};

/// Prefix of every entry name in /dev/shm: `dataset-rt-<owner pid>-<nonce>-{ctl,ring,spec}`.
pub const NAME_PREFIX: &str = "dataset-rt-";

/// The `op` of the error a creation reports when a reaper removed the fresh entry before its
/// creator could lock it: the creator retries under another name.
pub const LOST_TO_REAPER: &str = "lock (a concurrent reaper removed it first)";

/// The entries of the pass whose control segment is `ctl_name` (`<stem>-ctl`): the ring
/// `<stem>-ring`, the owner's private directory `<stem>-spec`, and the owner pid the stem
/// carries.
pub fn names_of(ctl_name: &str) -> Result<Names> {
    let Some(stem) = ctl_name.strip_suffix("-ctl") else {
        return Err(protocol(format!(
            "{ctl_name:?} is not a control segment name"
        )));
    };
    let owner_pid =
        owner_of(ctl_name).ok_or_else(|| protocol(format!("{ctl_name:?} carries no owner pid")))?;
    Ok(Names {
        ctl: ctl_name.to_owned(),
        ring: format!("{stem}-ring"),
        also_unlink: vec![format!("{stem}-spec")],
        owner_pid,
    })
}

/// The owner's private directory for the producer's parameters, `<stem>-spec`.
pub fn private_dir(ring: &Ring) -> PathBuf {
    match ring.names().also_unlink.first() {
        Some(dir) => path_of(dir),
        None => path_of(&format!("{}-spec", ring.ctl_name())),
    }
}

/// Removes every entry of the pass whose control segment is `ctl_name` (a party that outlived
/// its owner before every party attached).
pub fn unlink_pass(ctl_name: &str) {
    if let Ok(names) = names_of(ctl_name) {
        segment::unlink(&names.ctl);
        segment::unlink(&names.ring);
        for name in &names.also_unlink {
            segment::unlink(name);
        }
    }
}

/// Attaches to the pass whose control segment is `ctl_name` (a consumer or the producer):
/// the transport checks the segments, this the rank split of the pass they carry.
pub fn attach(ctl_name: &str) -> Result<Ring> {
    let ring = Ring::attach(&names_of(ctl_name)?)?;
    check_split(&ring.pass())
        .map_err(|why| protocol(format!("control segment {ctl_name}: {why}")))?;
    Ok(ring)
}

/// Creates a pass's two segments and the owner's private directory under a fresh stem, each
/// locked by this process for as long as the ring lives, and initialises the ring. A reaper
/// that removes a fresh entry before it is locked costs a new name, not the pass.
pub fn create_ring(owner_pid: u64, geometry: Geometry, pass: Pass) -> Result<Ring> {
    geometry.ring_bytes()?;
    check_split(&pass).map_err(|why| protocol(format!("the pass to create: {why}")))?;
    let mut lost = 0;
    let (created, names) = loop {
        match create_names(owner_pid, geometry) {
            Err(ShmError::Io {
                op: LOST_TO_REAPER, ..
            }) if lost < 2 => lost += 1,
            created => break created?,
        }
    };
    Ring::create(owner_pid, geometry, pass, created).map_err(|e| {
        for name in [&names.ctl, &names.ring]
            .into_iter()
            .chain(&names.also_unlink)
        {
            segment::unlink(name);
        }
        e.into()
    })
}

/// The three entries of a pass, created and locked; on failure nothing of them is left.
fn create_names(
    owner_pid: u64,
    geometry: Geometry,
) -> std::result::Result<(Created, Names), ShmError> {
    let names = names_of(&format!("{}-ctl", new_stem(owner_pid)))
        .expect("a fresh stem names a control segment");
    let ring_bytes = geometry.ring_bytes()?;
    let (ctl, ctl_lock) = Segment::create(&names.ctl, geometry.ctl_bytes(), |f, p| {
        hold(f, p, &names.ctl)
    })?;
    let (ring, ring_lock) =
        Segment::create(&names.ring, ring_bytes, |f, p| hold(f, p, &names.ring))
            .inspect_err(|_| segment::unlink(&names.ctl))?;
    let dir = create_private_dir(&names.also_unlink[0]).inspect_err(|_| {
        segment::unlink(&names.ctl);
        segment::unlink(&names.ring);
    })?;
    let created = Created {
        ctl,
        ring,
        also_unlink: names.also_unlink.clone(),
        keep: Box::new([ctl_lock, ring_lock, dir]),
    };
    Ok((created, names))
}

/// Locks an entry just created at `path` for its creator (see [`OwnerLock::hold`]); the lock
/// is on the entry's open file description, so it lasts as long as the returned lock.
fn hold(file: &File, path: &Path, name: &str) -> std::result::Result<OwnerLock, ShmError> {
    let lock_error = |source: std::io::Error| ShmError::Io {
        op: if source.kind() == std::io::ErrorKind::NotFound {
            LOST_TO_REAPER
        } else {
            "lock"
        },
        path: path_of(name),
        source,
    };
    OwnerLock::hold(file.try_clone().map_err(lock_error)?, path).map_err(lock_error)
}

/// Creates the owner's private directory `name` (mode 0700, never an existing one), locked by
/// this process like a segment.
pub fn create_private_dir(name: &str) -> std::result::Result<OwnerLock, ShmError> {
    let path = path_of(name);
    let io = |op: &'static str, source: std::io::Error| ShmError::Io {
        op,
        path: path.clone(),
        source,
    };
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&path)
        .map_err(|e| io("create directory", e))?;
    let dir = OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECTORY | libc::O_NOFOLLOW)
        .open(&path)
        .map_err(|e| io("open directory", e))?;
    hold(&dir, &path, name).inspect_err(|_| {
        let _ = std::fs::remove_dir(&path);
    })
}

/// The owner pid a DatasetRT entry name carries.
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

/// Freed heap a loader worker keeps for reuse: a transform that makes new arrays per sample
/// frees a batch's worth at a time, which glibc would otherwise hand back to the kernel and
/// fault in again (zeroed) for the next batch.
pub const WORKER_RETAINED_HEAP: usize = 64 << 20;
/// Allocations below this size come from that heap rather than a mapping of their own (glibc's
/// own cap on 64-bit).
pub const WORKER_DIRECT_ALLOC: usize = 32 << 20;

/// The C allocator's settings for a loader worker process (see [`WORKER_RETAINED_HEAP`]),
/// unless the user chose their own through glibc's environment (`env` reads a variable). Says
/// whether they were applied.
pub fn retain_worker_heap(env: impl Fn(&str) -> Option<String>) -> bool {
    let user_set = [
        "MALLOC_TRIM_THRESHOLD_",
        "MALLOC_MMAP_THRESHOLD_",
        "MALLOC_TOP_PAD_",
    ]
    .iter()
    .any(|name| env(name).is_some())
        || env("GLIBC_TUNABLES").is_some_and(|t| {
            ["trim_threshold", "mmap_threshold", "top_pad"]
                .iter()
                .any(|k| t.contains(k))
        });
    !user_set && os::retain_freed_heap(WORKER_RETAINED_HEAP, WORKER_DIRECT_ALLOC)
}

#[cfg(test)]
mod worker_heap_tests {
    use super::*;

    fn env_of(vars: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |name| {
            vars.iter()
                .find(|(k, _)| *k == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn the_users_own_allocator_settings_win() {
        assert!(!retain_worker_heap(env_of(&[(
            "MALLOC_TRIM_THRESHOLD_",
            "0"
        )])));
        assert!(!retain_worker_heap(env_of(&[(
            "MALLOC_MMAP_THRESHOLD_",
            "1"
        )])));
        assert!(!retain_worker_heap(env_of(&[(
            "GLIBC_TUNABLES",
            "glibc.malloc.trim_threshold=0"
        )])));
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn a_worker_keeps_its_freed_heap_on_glibc() {
        assert!(retain_worker_heap(env_of(&[(
            "GLIBC_TUNABLES",
            "glibc.pthread.rseq=0"
        )])));
        assert!(retain_worker_heap(env_of(&[])));
    }
}

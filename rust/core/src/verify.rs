//! The verification policy of reads, and the record of the records already verified: per
//! dataset of the training process, shared with the loader's producers through a memfd.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::os::own_pid;

/// When a record's checksum is computed as it is read (`ReaderConfig.verify`). The structural
/// checks (the record header against the index, lengths within the shard, the bound on what an
/// LZ4 payload may decode to) run on every read under every policy: they are what keeps reading
/// and decoding a damaged record safe, and they cost no hashing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VerifyPolicy {
    /// Every read hashes the record.
    Always,
    /// A record is hashed the first time the dataset reads it (in the training process or in
    /// any of its loaders' producers, which share its [`VerifiedSet`]); later reads skip the
    /// hash. `ReaderConfig`'s default: from the second epoch on it reads as fast as `Never`.
    #[default]
    Once,
    /// No read hashes a record.
    Never,
}

impl VerifyPolicy {
    pub const NAMES: [&'static str; 3] = ["always", "once", "never"];

    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "always" => Ok(VerifyPolicy::Always),
            "once" => Ok(VerifyPolicy::Once),
            "never" => Ok(VerifyPolicy::Never),
            other => Err(Error::config(
                "ReaderConfig.verify",
                format!("expected \"always\", \"once\" or \"never\", got {other:?}"),
            )),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            VerifyPolicy::Always => "always",
            VerifyPolicy::Once => "once",
            VerifyPolicy::Never => "never",
        }
    }
}

/// One bit per sample: set once the sample's record has passed its checksum. Shared by every
/// reader of a dataset (and by their pool threads) without a lock, and, when it lives in a
/// memfd ([`VerifiedSet::shared`]), by the loader's producer processes that attach to it: a
/// record verified by any of them is not hashed again by the others.
pub struct VerifiedSet {
    bits: Bits,
    len: u64,
}

enum Bits {
    Heap(Box<[AtomicU64]>),
    Shared(SharedBits),
}

/// The words of a set in a shared map of a sealed memfd.
struct SharedBits {
    map: memmap2::MmapRaw,
    /// The memfd, kept by the process that created it so that it can hand it to producers;
    /// `None` in a process that attached (it closed its copy once mapped).
    fd: Option<OwnedFd>,
    /// The pid of the process that holds `fd`: a forked child has a copy of the descriptor
    /// that is not its own (see [`close_inherited`]).
    holder: u64,
}

/// The memfds this process created for shared sets, with the pid that created them: a forked
/// child finds its inherited copies here.
static CREATED: Mutex<Vec<(RawFd, u64)>> = Mutex::new(Vec::new());

/// The bytes of the set of `len` samples: one 64-bit word per 64 samples.
pub fn set_bytes(len: u64) -> u64 {
    len.div_ceil(64) * 8
}

/// The error of a set that cannot be shared or attached, naming the descriptor.
fn fd_error(op: &'static str, fd: RawFd, source: std::io::Error) -> Error {
    Error::io(op, format!("verified-samples memfd (fd {fd})"), source)
}

fn invalid(fd: RawFd, reason: String) -> Error {
    fd_error(
        "attach",
        fd,
        std::io::Error::new(std::io::ErrorKind::InvalidInput, reason),
    )
}

/// The seals a shared set's memfd carries: its size cannot change, so no party's map of it can
/// ever reach past the end of the file (a SIGBUS).
#[cfg(target_os = "linux")]
const SIZE_SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW;

impl VerifiedSet {
    /// An empty set for samples `0..len` in this process's heap: `len / 8` bytes, rounded up to
    /// whole words.
    pub fn new(len: u64) -> Self {
        let words = len.div_ceil(64) as usize;
        VerifiedSet {
            bits: Bits::Heap((0..words).map(|_| AtomicU64::new(0)).collect()),
            len,
        }
    }

    /// An empty set for samples `0..len` in a new memfd of [`set_bytes`] bytes (zero-filled,
    /// its size sealed, closed on exec), which [`VerifiedSet::shared_fd`] hands to the
    /// processes that [`VerifiedSet::attach`] to it. An empty dataset has nothing to share:
    /// its set is a heap one.
    pub fn shared(len: u64) -> Result<Self> {
        if len == 0 {
            return Ok(Self::new(0));
        }
        Self::create_memfd(len)
    }

    #[cfg(target_os = "linux")]
    fn create_memfd(len: u64) -> Result<Self> {
        let bytes = set_bytes(len);
        // SAFETY: a NUL-terminated name and flags; the result is checked.
        let raw = unsafe {
            libc::memfd_create(
                c"dataset-rt-verified".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if raw < 0 {
            return Err(fd_error(
                "memfd_create",
                raw,
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: memfd_create returned a descriptor that nothing else owns.
        let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(raw) });
        file.set_len(bytes)
            .map_err(|e| fd_error("ftruncate", raw, e))?;
        // SAFETY: fcntl on a descriptor this function owns.
        if unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, SIZE_SEALS | libc::F_SEAL_SEAL) } != 0 {
            return Err(fd_error("seal", raw, std::io::Error::last_os_error()));
        }
        let map = memmap2::MmapOptions::new()
            .len(bytes as usize)
            .map_raw(&file)
            .map_err(|e| fd_error("mmap", raw, e))?;
        let holder = own_pid();
        CREATED.lock().unwrap().push((raw, holder));
        Ok(VerifiedSet {
            bits: Bits::Shared(SharedBits {
                map,
                fd: Some(file.into()),
                holder,
            }),
            len,
        })
    }

    #[cfg(not(target_os = "linux"))]
    fn create_memfd(_len: u64) -> Result<Self> {
        Err(fd_error(
            "memfd_create",
            -1,
            std::io::Error::from(std::io::ErrorKind::Unsupported),
        ))
    }

    /// Attaches to the set of samples `0..len` that another process created with
    /// [`VerifiedSet::shared`] and passed down as descriptor `fd` (inherited across `exec`).
    /// Refuses a descriptor that is not open, not a memfd with its size sealed, or not
    /// [`set_bytes`]`(len)` bytes long, naming it. Once mapped the descriptor is closed: the map
    /// alone keeps the memory. On an error it is left as it was.
    pub fn attach(fd: RawFd, len: u64) -> Result<Self> {
        // SAFETY: F_GETFD only asks whether the descriptor is open.
        if fd < 0 || unsafe { libc::fcntl(fd, libc::F_GETFD) } < 0 {
            return Err(invalid(
                fd,
                "no such open descriptor in this process: it was not passed down".into(),
            ));
        }
        Self::check_memfd(fd)?;
        let mut stat = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstat writes a `stat` into the buffer on success.
        if unsafe { libc::fstat(fd, stat.as_mut_ptr()) } != 0 {
            return Err(fd_error("fstat", fd, std::io::Error::last_os_error()));
        }
        // SAFETY: fstat succeeded.
        let size = unsafe { stat.assume_init() }.st_size as u64;
        let bytes = set_bytes(len);
        if size != bytes {
            return Err(invalid(
                fd,
                format!(
                    "it holds {size} bytes; the set of {len} samples takes {bytes}: it belongs \
                     to another dataset"
                ),
            ));
        }
        let set = if len == 0 {
            Self::new(0)
        } else {
            let map = memmap2::MmapOptions::new()
                .len(bytes as usize)
                .map_raw(fd)
                .map_err(|e| fd_error("mmap", fd, e))?;
            VerifiedSet {
                bits: Bits::Shared(SharedBits {
                    map,
                    fd: None,
                    holder: own_pid(),
                }),
                len,
            }
        };
        // SAFETY: the descriptor is open (checked above) and a sealed memfd handed to this
        // process for this set alone: closing it here is its only close.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
        Ok(set)
    }

    /// A memfd whose size is sealed, else the error saying what `fd` is instead.
    #[cfg(target_os = "linux")]
    fn check_memfd(fd: RawFd) -> Result<()> {
        // SAFETY: F_GET_SEALS only reads the descriptor's seals.
        let seals = unsafe { libc::fcntl(fd, libc::F_GET_SEALS) };
        if seals < 0 {
            return Err(invalid(
                fd,
                format!(
                    "not a memfd ({}): the verified set is shared only as a sealed memfd",
                    std::io::Error::last_os_error()
                ),
            ));
        }
        if seals & SIZE_SEALS != SIZE_SEALS {
            return Err(invalid(
                fd,
                "a memory file whose size is not sealed: the verified set is shared only as a \
                 memfd sealed against shrinking and growing"
                    .into(),
            ));
        }
        Ok(())
    }

    #[cfg(not(target_os = "linux"))]
    fn check_memfd(fd: RawFd) -> Result<()> {
        Err(invalid(fd, "memfds exist only on Linux".into()))
    }

    /// The memfd of a shared set, in the process that created it (`None` for a heap set, in
    /// a process that attached, and in a forked child, which must not hand on its copy).
    pub fn shared_fd(&self) -> Option<BorrowedFd<'_>> {
        match &self.bits {
            Bits::Shared(SharedBits {
                fd: Some(fd),
                holder,
                ..
            }) if *holder == own_pid() => Some(fd.as_fd()),
            _ => None,
        }
    }

    /// Whether the bits live in a shared map (created or attached).
    pub fn is_shared(&self) -> bool {
        matches!(self.bits, Bits::Shared(_))
    }

    fn words(&self) -> &[AtomicU64] {
        match &self.bits {
            Bits::Heap(words) => words,
            // SAFETY: the map is page-aligned, `set_bytes(len)` long (the memfd's size is sealed
            // at that) and lives as long as `self`; every process touches it only through
            // atomics, which work on memory shared between processes.
            Bits::Shared(shared) => unsafe {
                std::slice::from_raw_parts(
                    shared.map.as_ptr().cast::<AtomicU64>(),
                    self.len.div_ceil(64) as usize,
                )
            },
        }
    }

    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether `sample` was marked. Acquire pairs with `mark`'s release: a thread that sees the
    /// bit also sees everything the verifying thread did before marking it.
    pub fn contains(&self, sample: u64) -> bool {
        debug_assert!(sample < self.len);
        let bit = 1u64 << (sample % 64);
        self.words()[(sample / 64) as usize].load(Ordering::Acquire) & bit != 0
    }

    /// Marks `sample` as verified. Call only after its checksum matched.
    pub fn mark(&self, sample: u64) {
        debug_assert!(sample < self.len);
        let bit = 1u64 << (sample % 64);
        self.words()[(sample / 64) as usize].fetch_or(bit, Ordering::Release);
    }

    /// Samples marked so far (by any process sharing the set).
    pub fn count(&self) -> u64 {
        self.words()
            .iter()
            .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
            .sum()
    }
}

impl Drop for SharedBits {
    fn drop(&mut self) {
        let Some(fd) = self.fd.take() else { return };
        if self.holder != own_pid() {
            // A forked child's copy: `close_inherited` closed it, or the exit will. Its number
            // may name another file by now: never close it here.
            std::mem::forget(fd);
            return;
        }
        let raw = fd.as_raw_fd();
        let holder = self.holder;
        CREATED
            .lock()
            .unwrap()
            .retain(|&entry| entry != (raw, holder));
        drop(fd);
    }
}

/// Closes, in a forked child, the memfds of the shared sets its parent created: a loader
/// worker calls it before it runs any user code, so that user code never holds a descriptor
/// of the training process's set. Returns how many it closed. In the process that created them
/// (or one that was started afresh) it closes nothing.
pub fn close_inherited() -> usize {
    // try_lock: a fork while another thread held the lock leaves it held for good in the
    // child; leaving the descriptors open then beats waiting forever.
    let Ok(mut created) = CREATED.try_lock() else {
        return 0;
    };
    let me = own_pid();
    let before = created.len();
    created.retain(|&(fd, holder)| {
        if holder == me {
            return true;
        }
        // SAFETY: the parent's memfd, inherited by fork; nothing in this process owns it
        // (the set's `Drop` never closes a copy it does not hold).
        unsafe { libc::close(fd) };
        false
    });
    before - created.len()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::sync::Arc;

    #[test]
    fn parse_names_and_refuse_others() {
        for name in VerifyPolicy::NAMES {
            assert_eq!(VerifyPolicy::parse(name).unwrap().name(), name);
        }
        assert_eq!(VerifyPolicy::default(), VerifyPolicy::Once);
        let err = VerifyPolicy::parse("Always").unwrap_err().to_string();
        assert!(err.contains("ReaderConfig.verify"), "{err}");
        assert!(err.contains("\"Always\""), "{err}");
    }

    #[test]
    fn serde_uses_the_config_names() {
        assert_eq!(
            serde_json::to_string(&VerifyPolicy::Once).unwrap(),
            "\"once\""
        );
        let p: VerifyPolicy = serde_json::from_str("\"never\"").unwrap();
        assert_eq!(p, VerifyPolicy::Never);
        assert!(serde_json::from_str::<VerifyPolicy>("\"sometimes\"").is_err());
    }

    #[test]
    fn one_bit_per_sample_at_word_edges() {
        for len in [0u64, 1, 63, 64, 65, 130] {
            let set = VerifiedSet::new(len);
            assert_eq!(set.words().len() as u64, len.div_ceil(64));
            assert_eq!(set.count(), 0);
            let mut probes: Vec<u64> = [0, 62, 63, 64, 65, len.saturating_sub(1)]
                .into_iter()
                .filter(|&s| s < len)
                .collect();
            probes.sort_unstable();
            probes.dedup();
            for &s in &probes {
                assert!(!set.contains(s), "sample {s} of {len} marked early");
                set.mark(s);
                assert!(set.contains(s));
                set.mark(s);
            }
            assert_eq!(set.count(), probes.len() as u64, "len {len}");
            for s in 0..len {
                assert_eq!(set.contains(s), probes.contains(&s), "sample {s} of {len}");
            }
        }
    }

    /// A copy of `set`'s memfd, as a producer receives it: `attach` takes it over.
    fn passed_down(set: &VerifiedSet) -> RawFd {
        let fd = set
            .shared_fd()
            .expect("a shared set in its creator")
            .as_raw_fd();
        // SAFETY: dup of an open descriptor.
        let copy = unsafe { libc::dup(fd) };
        assert!(copy >= 0);
        copy
    }

    fn is_open(fd: RawFd) -> bool {
        // SAFETY: F_GETFD only asks.
        unsafe { libc::fcntl(fd, libc::F_GETFD) >= 0 }
    }

    fn attach_error(fd: RawFd, len: u64) -> String {
        match VerifiedSet::attach(fd, len) {
            Ok(_) => panic!("fd {fd} attached as a set of {len} samples"),
            Err(e) => e.to_string(),
        }
    }

    /// A memfd of `bytes` bytes, sealed against size changes or not.
    fn memfd(bytes: u64, seal: bool) -> std::fs::File {
        // SAFETY: a NUL-terminated name and flags; checked below.
        let raw = unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_ALLOW_SEALING) };
        assert!(raw >= 0);
        // SAFETY: a new descriptor nothing else owns.
        let file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(raw) });
        file.set_len(bytes).unwrap();
        if seal {
            // SAFETY: fcntl on an open descriptor.
            let rc = unsafe { libc::fcntl(raw, libc::F_ADD_SEALS, SIZE_SEALS) };
            assert_eq!(rc, 0);
        }
        file
    }

    #[test]
    fn two_maps_of_one_memfd_see_each_others_marks() {
        let len = 130;
        let creator = VerifiedSet::shared(len).unwrap();
        assert!(creator.is_shared());
        let fd = passed_down(&creator);
        let attached = VerifiedSet::attach(fd, len).unwrap();
        assert!(
            !is_open(fd),
            "attach closes the descriptor it was given once mapped"
        );
        assert!(attached.is_shared());
        assert!(
            attached.shared_fd().is_none(),
            "an attacher hands on nothing"
        );
        assert_eq!((creator.len(), attached.len()), (len, len));
        creator.mark(0);
        creator.mark(64);
        attached.mark(63);
        attached.mark(129);
        for set in [&creator, &attached] {
            assert_eq!(set.count(), 4);
            for s in 0..len {
                assert_eq!(set.contains(s), [0, 63, 64, 129].contains(&s), "sample {s}");
            }
        }
        // The attacher's map outlives the creator's.
        drop(creator);
        attached.mark(1);
        assert_eq!(attached.count(), 5);
    }

    #[test]
    fn a_shared_set_starts_empty_and_an_empty_one_is_not_shared() {
        let set = VerifiedSet::shared(1000).unwrap();
        assert_eq!(set.count(), 0);
        let file_len = std::fs::File::from(set.shared_fd().unwrap().try_clone_to_owned().unwrap())
            .metadata()
            .unwrap()
            .len();
        assert_eq!(file_len, set_bytes(1000));
        assert_eq!(set_bytes(1000), 16 * 8);
        let empty = VerifiedSet::shared(0).unwrap();
        assert!(!empty.is_shared() && empty.shared_fd().is_none());
    }

    #[test]
    fn attach_refuses_a_set_of_another_length() {
        let set = VerifiedSet::shared(130).unwrap();
        for wrong in [1, 64, 193, 1000] {
            let fd = passed_down(&set);
            let err = attach_error(fd, wrong);
            assert!(err.contains(&format!("fd {fd}")), "{err}");
            assert!(err.contains("holds 24 bytes"), "{err}");
            assert!(
                err.contains(&format!("{wrong} samples takes {}", set_bytes(wrong))),
                "{err}"
            );
            assert!(is_open(fd), "a refused descriptor is left as it was");
            // SAFETY: the test's own copy.
            unsafe { libc::close(fd) };
        }
        // 129..=192 samples take the same 3 words: the length in samples is checked by the
        // dataset (`with_verified_set`), the bytes here.
        let fd = passed_down(&set);
        assert_eq!(VerifiedSet::attach(fd, 190).unwrap().len(), 190);
    }

    #[test]
    fn attach_refuses_what_is_not_a_sealed_memfd_of_the_size() {
        let tmp = tempfile::tempfile().unwrap();
        tmp.set_len(24).unwrap();
        let err = attach_error(tmp.as_raw_fd(), 130);
        assert!(
            err.contains(&format!("fd {}", tmp.as_raw_fd())) && err.contains("not a memfd"),
            "{err}"
        );
        let unsealed = memfd(24, false);
        let err = attach_error(unsealed.as_raw_fd(), 130);
        assert!(err.contains("size is not sealed"), "{err}");
        let short = memfd(16, true);
        let err = attach_error(short.as_raw_fd(), 130);
        assert!(
            err.contains("holds 16 bytes; the set of 130 samples takes 24"),
            "{err}"
        );
        // A descriptor that is not open: the number the spec named was not passed down.
        let closed = passed_down(&VerifiedSet::shared(130).unwrap());
        // SAFETY: the test's own copy.
        unsafe { libc::close(closed) };
        let err = attach_error(closed, 130);
        assert!(
            err.contains(&format!("fd {closed}")) && err.contains("no such open descriptor"),
            "{err}"
        );
        assert!(attach_error(-1, 130).contains("fd -1"));
    }

    #[test]
    fn the_creator_closes_nothing_of_its_own_as_inherited() {
        let set = VerifiedSet::shared(10).unwrap();
        let fd = set.shared_fd().unwrap().as_raw_fd();
        close_inherited();
        assert!(is_open(fd));
        assert!(set.shared_fd().is_some());
        drop(set);
        assert!(!is_open(fd) || CREATED.lock().unwrap().iter().all(|&(f, _)| f != fd));
    }

    #[test]
    fn concurrent_marks_are_all_kept() {
        // Threads marking interleaved samples of the same words must not lose each other's bits.
        let set = Arc::new(VerifiedSet::new(1000));
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let set = set.clone();
                std::thread::spawn(move || {
                    for s in (t..1000).step_by(4) {
                        set.mark(s);
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(set.count(), 1000);
    }
}

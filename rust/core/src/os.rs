//! The operating-system queries DatasetRT makes, in one place: processes (own and parent pid,
//! whether a pid lives, the parent-death signal) and memory (page size, physical memory, the C
//! allocator's retention of freed memory).

/// This process's pid.
pub fn own_pid() -> u64 {
    u64::from(std::process::id())
}

/// The parent's pid: 1 (or a subreaper's) once the parent that started this process is gone.
pub fn parent_pid() -> u64 {
    // SAFETY: getppid cannot fail.
    unsafe { libc::getppid() as u64 }
}

/// Whether a process with this pid exists here (zombies count as gone: they run nothing).
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

/// Makes the kernel send SIGKILL to this process when the thread that started it exits
/// (Linux; elsewhere nothing). The parent may be gone already: check [`parent_pid`] after.
pub fn kill_me_when_parent_dies() -> std::io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: plain prctl with integer arguments.
        let rc = unsafe {
            libc::prctl(
                libc::PR_SET_PDEATHSIG,
                libc::SIGKILL as libc::c_ulong,
                0,
                0,
                0,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}

/// The size of a memory page, when the OS says.
pub fn page_size() -> Option<u64> {
    // SAFETY: sysconf only reads system configuration.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    (size > 0).then_some(size as u64)
}

/// The page size for aligning kernel advice and residency probes, asked once per process
/// (4096 when the OS does not say).
pub fn page() -> u64 {
    static PAGE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| page_size().unwrap_or(4096))
}

/// The machine's physical memory in bytes, when the OS says.
pub fn physical_memory() -> Option<u64> {
    // SAFETY: sysconf only reads system configuration.
    let pages = unsafe { libc::sysconf(libc::_SC_PHYS_PAGES) };
    let pages = u64::try_from(pages).ok().filter(|&p| p > 0)?;
    Some(pages.saturating_mul(page_size()?))
}

/// Makes the C allocator keep up to `keep` bytes of freed heap for reuse instead of returning
/// them to the kernel, and serve allocations below `direct` bytes from that heap instead of a
/// mapping of their own. A process that allocates and frees the same large buffers over and
/// over (a transform that makes a new array per sample) then reuses warm pages instead of
/// faulting in and zeroing fresh ones each time. glibc only (`mallopt`); says whether it was
/// applied. glibc caps `direct` at 32 MiB on 64-bit.
pub fn retain_freed_heap(keep: usize, direct: usize) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let (Ok(keep), Ok(direct)) = (libc::c_int::try_from(keep), libc::c_int::try_from(direct))
        else {
            return false;
        };
        // SAFETY: mallopt only changes the allocator's parameters; it returns 1 on success.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, direct) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, keep) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = (keep, direct);
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn this_process_and_its_parent_are_alive() {
        assert_eq!(own_pid(), u64::from(std::process::id()));
        assert!(pid_alive(own_pid()));
        assert!(pid_alive(parent_pid()));
        assert!(!pid_alive(0));
        assert!(!pid_alive(u64::from(u32::MAX)));
    }

    #[test]
    fn a_reaped_child_is_gone_and_a_zombie_counts_as_gone() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = u64::from(child.id());
        // Not yet waited for: a zombie once it exits, which runs nothing.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while pid_alive(pid) {
            assert!(
                std::time::Instant::now() < deadline,
                "the child never exited"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        child.wait().unwrap();
        assert!(!pid_alive(pid));
    }

    #[test]
    fn memory_sizes_are_plausible() {
        let page = page_size().unwrap();
        assert!(page.is_power_of_two() && page >= 4096, "{page}");
        let memory = physical_memory().unwrap();
        assert!(memory >= 64 << 20 && memory % page == 0, "{memory}");
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn retained_heap_is_reused_without_faulting_pages_in_again() {
        fn minor_faults() -> i64 {
            // SAFETY: getrusage fills the struct it is given.
            let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
            // SAFETY: `usage` is a valid rusage to fill.
            let rc = unsafe { libc::getrusage(libc::RUSAGE_THREAD, &mut usage) };
            assert_eq!(rc, 0);
            usage.ru_minflt
        }
        // A batch of a transform's outputs: 64 buffers of 150,528 bytes, written, then freed.
        fn batch() -> i64 {
            let before = minor_faults();
            let buffers: Vec<Vec<u8>> = (0..64).map(|_| vec![7u8; 150_528]).collect();
            std::hint::black_box(&buffers);
            drop(buffers);
            minor_faults() - before
        }
        assert!(retain_freed_heap(64 << 20, 32 << 20));
        let first = batch();
        let again = (0..3).map(|_| batch()).max().unwrap();
        // The first batch faults its 2,368 pages in; later ones reuse them (glibc's defaults
        // return them to the kernel after every batch, so each batch faults them in again).
        assert!(first > 1000, "first batch faulted {first} pages");
        assert!(again < 100, "a later batch faulted {again} pages in again");
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn the_parent_death_signal_is_set() {
        // Harmless in the test process: its parent (the test runner) waits for it.
        kill_me_when_parent_dies().unwrap();
        let mut signal: libc::c_int = 0;
        // SAFETY: PR_GET_PDEATHSIG writes one int through the pointer.
        let rc = unsafe { libc::prctl(libc::PR_GET_PDEATHSIG, &mut signal as *mut libc::c_int) };
        assert_eq!((rc, signal), (0, libc::SIGKILL));
    }
}

//! Cross-process waiting on a 32-bit word of shared memory: Linux futexes (shared, not
//! `_PRIVATE`, because waiter and waker are different processes), always with a timeout so every
//! waiter re-checks liveness at least every [`crate::ring::POLL`].

use std::sync::atomic::AtomicU32;
use std::time::Duration;

/// Sleeps while `*word == expected`, at most `timeout`. Spurious returns are fine: callers loop.
#[cfg(target_os = "linux")]
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned u32 in memory shared with the wakers; the kernel only
    // reads it. EAGAIN (value changed), ETIMEDOUT and EINTR all mean "re-check", as callers do.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

/// Wakes every process sleeping on `word`.
#[cfg(target_os = "linux")]
pub fn wake_all(word: &AtomicU32) {
    // SAFETY: as in `wait`; FUTEX_WAKE does not access memory beyond hashing the address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0u32,
        );
    }
}

#[cfg(not(target_os = "linux"))]
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    // No futex: a short sleep keeps waits bounded (the loader supports Linux; this keeps the
    // crate building elsewhere for its tests).
    if word.load(std::sync::atomic::Ordering::Acquire) == expected {
        std::thread::sleep(timeout.min(Duration::from_millis(1)));
    }
}

#[cfg(not(target_os = "linux"))]
pub fn wake_all(_word: &AtomicU32) {}

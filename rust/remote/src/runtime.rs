//! The private async runtime, and values that must not cross a `fork`.
//!
//! A tokio runtime's worker threads do not survive `fork`: a child that used its parent's
//! runtime (or an HTTP connection pool tied to it) would wait forever on threads that do not
//! exist (LitData hit this with PyTorch's forked DataLoader workers). So the runtime, and every
//! store built on it, is kept per process: [`ProcessLocal`] remembers the pid that made its value
//! and makes a new one when `getpid()` differs. The parent's value is never dropped in the child
//! (dropping a runtime joins threads that are not there): it is leaked, once per fork.
//!
//! No mutex guards these: a mutex held by another thread at the moment of a fork stays locked in
//! the child forever. The value is published with one compare-and-swap instead.

use std::future::Future;
use std::sync::atomic::{AtomicPtr, Ordering};

use crate::error::{Error, Result};

struct Entry<T> {
    pid: u32,
    value: T,
}

/// A value made lazily in the process that uses it, and made again after a fork.
pub struct ProcessLocal<T> {
    slot: AtomicPtr<Entry<T>>,
}

impl<T> Default for ProcessLocal<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T> ProcessLocal<T> {
    pub const fn new() -> Self {
        ProcessLocal {
            slot: AtomicPtr::new(std::ptr::null_mut()),
        }
    }
}

// `T: Send + Sync`: the value is shared by every thread of the process.
impl<T: Send + Sync> ProcessLocal<T> {
    /// This process's value, made by `make` on first use in this process. Two threads that race
    /// to make it both run `make`; one value wins and the other is dropped.
    pub fn get_or_try_init(&self, make: impl Fn() -> Result<T>) -> Result<&T> {
        let pid = std::process::id();
        loop {
            let current = self.slot.load(Ordering::Acquire);
            if !current.is_null() {
                // SAFETY: a published entry is freed only by `Drop` (which has `&mut self`, so
                // no reference from `get_or_try_init` is alive) or never (when replaced below).
                let entry = unsafe { &*current };
                if entry.pid == pid {
                    return Ok(&entry.value);
                }
            }
            let fresh = Box::into_raw(Box::new(Entry {
                pid,
                value: make()?,
            }));
            match self
                .slot
                .compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire)
            {
                // `current` (another process's entry, or null) is leaked on purpose: see the
                // module's comment.
                // SAFETY: `fresh` was just published and is never freed while `self` lives.
                Ok(_) => return Ok(unsafe { &(*fresh).value }),
                Err(_) => {
                    // Another thread published first: drop ours and take theirs.
                    // SAFETY: `fresh` was never published, so this thread owns it alone.
                    drop(unsafe { Box::from_raw(fresh) });
                }
            }
        }
    }
}

impl<T> Drop for ProcessLocal<T> {
    fn drop(&mut self) {
        let current = *self.slot.get_mut();
        if current.is_null() {
            return;
        }
        // SAFETY: published entries stay valid until here; `&mut self` excludes every reader.
        let owned_here = unsafe { (*current).pid } == std::process::id();
        if owned_here {
            // SAFETY: as above; the pointer came from `Box::into_raw` and is freed once.
            drop(unsafe { Box::from_raw(current) });
        }
        // Another process's value (inherited through fork) is leaked, never dropped.
    }
}

static RUNTIME: ProcessLocal<tokio::runtime::Runtime> = ProcessLocal::new();

/// Worker threads of the runtime: the work is waiting on the network, and the planner's
/// decoding runs on the core's pool, so a few threads drive hundreds of requests.
fn worker_threads() -> usize {
    std::thread::available_parallelism().map_or(2, |n| n.get().clamp(2, 4))
}

/// This process's runtime, made on first use (and again in a forked child).
pub fn runtime() -> Result<&'static tokio::runtime::Runtime> {
    RUNTIME.get_or_try_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(worker_threads())
            .thread_name("dataset-rt-remote")
            .enable_all()
            .build()
            .map_err(|e| {
                Error::Core(dataset_rt_core::Error::Runtime(format!(
                    "cannot start the remote I/O runtime: {e}"
                )))
            })
    })
}

/// Runs `future` to completion on this process's runtime, blocking the calling thread (the
/// Python bindings release the GIL around this). From inside another tokio runtime (a user's
/// async code) it runs on a scoped thread, since a runtime cannot block inside another.
pub fn block_on<F>(future: F) -> Result<F::Output>
where
    F: Future + Send,
    F::Output: Send,
{
    let rt = runtime()?;
    if tokio::runtime::Handle::try_current().is_ok() {
        return std::thread::scope(|s| {
            s.spawn(|| rt.block_on(future)).join().map_err(|_| {
                Error::Core(dataset_rt_core::Error::Runtime(
                    "the remote I/O thread panicked".into(),
                ))
            })
        });
    }
    Ok(rt.block_on(future))
}

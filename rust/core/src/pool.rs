//! The one worker pool of a `DatasetRuntime`: exactly `num_workers` threads, created once.
//!
//! Every job runs under `catch_unwind`, so a panic becomes an `Error::Runtime` for the caller
//! instead of a dead thread. A pool records the pid that created it: threads do not survive
//! `fork`, so a forked child gets a clear error instead of a job queue nobody serves.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Once};
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Sender};

use crate::error::{Error, Result};

type Job = Box<dyn FnOnce() + Send + 'static>;

pub struct Pool {
    sender: Mutex<Option<Sender<Job>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    num_workers: usize,
    pid: u32,
}

impl Pool {
    pub fn new(num_workers: usize) -> Result<Arc<Pool>> {
        if num_workers == 0 {
            return Err(Error::config("num_workers", "must be at least 1"));
        }
        watch_forks();
        let (tx, rx) = unbounded::<Job>();
        let mut threads = Vec::with_capacity(num_workers);
        for i in 0..num_workers {
            let rx = rx.clone();
            let handle = std::thread::Builder::new()
                .name(format!("dataset-rt-{i}"))
                .spawn(move || {
                    for job in rx.iter() {
                        job();
                    }
                })
                .map_err(|e| Error::Runtime(format!("cannot start worker thread {i}: {e}")))?;
            threads.push(handle);
        }
        Ok(Arc::new(Pool {
            sender: Mutex::new(Some(tx)),
            threads: Mutex::new(threads),
            num_workers,
            pid: std::process::id(),
        }))
    }

    pub fn num_workers(&self) -> usize {
        self.num_workers
    }

    /// Errors in a forked child, where the pool's threads do not exist. Cheap enough for every
    /// sample: until this process forks, it is one atomic load and no system call.
    pub fn check_process(&self) -> Result<()> {
        if !FORKED.load(Ordering::Relaxed) {
            return Ok(());
        }
        let now = std::process::id();
        if now != self.pid {
            return Err(Error::Runtime(format!(
                "this DatasetRuntime was created in process {} and its threads do not exist in \
                 forked process {now}; create a new DatasetRuntime in the child",
                self.pid
            )));
        }
        Ok(())
    }

    /// Errors when no job can run: the pool is closed, or this is a forked child.
    pub fn check_usable(&self) -> Result<()> {
        self.sender().map(|_| ())
    }

    fn sender(&self) -> Result<Sender<Job>> {
        self.check_process()?;
        self.sender
            .lock()
            .unwrap()
            .clone()
            .ok_or_else(|| Error::Runtime("the DatasetRuntime is closed".into()))
    }

    /// Runs `f` on a worker; its result (or its panic, as an error) arrives in the returned slot.
    pub fn submit<T, F>(&self, f: F) -> Result<Arc<Slot<T>>>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T> + Send + 'static,
    {
        let sender = self.sender()?;
        let slot = Arc::new(Slot::new());
        let out = slot.clone();
        let job: Job = Box::new(move || {
            let result = catch_unwind(AssertUnwindSafe(f))
                .unwrap_or_else(|panic| Err(Error::Runtime(panic_message(&panic))));
            out.put(result);
        });
        sender
            .send(job)
            .map_err(|_| Error::Runtime("the DatasetRuntime is closed".into()))?;
        Ok(slot)
    }

    /// Runs `f` on a worker and tells nobody when it is done: for a job that reports through
    /// what it shares with its submitter. No result slot is made or signalled, so a hand-off
    /// costs a queue push (and a wake-up only when every worker sleeps). A panic in `f` is
    /// caught and dropped: `f` must leave what it shares complete even when it panics.
    pub fn spawn<F>(&self, f: F) -> Result<()>
    where
        F: FnOnce() + Send + 'static,
    {
        let sender = self.sender()?;
        let job: Job = Box::new(move || {
            let _ = catch_unwind(AssertUnwindSafe(f));
        });
        sender
            .send(job)
            .map_err(|_| Error::Runtime("the DatasetRuntime is closed".into()))
    }

    /// Runs `f` on a worker and waits for it.
    pub fn run<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> Result<T> + Send + 'static,
    {
        self.submit(f)?.wait()
    }

    /// Stops accepting work and joins the threads once queued jobs are done.
    pub fn close(&self) {
        if std::process::id() != self.pid {
            return; // the threads belong to the parent
        }
        self.sender.lock().unwrap().take();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap());
        for t in threads {
            let _ = t.join();
        }
    }

    pub fn is_closed(&self) -> bool {
        self.sender.lock().unwrap().is_none()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.close();
    }
}

/// Set in every child process a `fork` creates (after a pool existed in its parent).
static FORKED: AtomicBool = AtomicBool::new(false);

extern "C" fn mark_forked() {
    FORKED.store(true, Ordering::Relaxed);
}

fn watch_forks() {
    static REGISTER: Once = Once::new();
    // SAFETY: the child handler only stores to an atomic, which is async-signal-safe.
    REGISTER.call_once(|| unsafe {
        libc::pthread_atfork(None, None, Some(mark_forked));
    });
}

/// The message a panic carried (its `&str` or `String` payload).
pub fn panic_payload(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

pub fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    let what = panic_payload(panic);
    format!("a DatasetRT worker panicked: {what} (this is a bug; please report it)")
}

/// A one-shot result cell that a caller can wait on.
pub struct Slot<T> {
    value: Mutex<Option<Result<T>>>,
    ready: Condvar,
}

impl<T> Slot<T> {
    fn new() -> Self {
        Slot {
            value: Mutex::new(None),
            ready: Condvar::new(),
        }
    }

    fn put(&self, v: Result<T>) {
        *self.value.lock().unwrap() = Some(v);
        self.ready.notify_all();
    }

    pub fn wait(&self) -> Result<T> {
        let mut guard = self.value.lock().unwrap();
        loop {
            if let Some(v) = guard.take() {
                return v;
            }
            guard = self.ready.wait(guard).unwrap();
        }
    }

    /// Waits at most `timeout`; `None` when the result is not there yet.
    pub fn wait_timeout(&self, timeout: std::time::Duration) -> Option<Result<T>> {
        let guard = self.value.lock().unwrap();
        let (mut guard, _) = self
            .ready
            .wait_timeout_while(guard, timeout, |v| v.is_none())
            .unwrap();
        guard.take()
    }

    pub fn is_ready(&self) -> bool {
        self.value.lock().unwrap().is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_jobs_and_turns_panics_into_errors() {
        let pool = Pool::new(2).unwrap();
        assert_eq!(pool.run(|| Ok(21 * 2)).unwrap(), 42);
        let err = pool.run::<(), _>(|| panic!("boom")).unwrap_err();
        assert!(err.to_string().contains("boom"), "{err}");
        // The pool still works after a panic.
        assert_eq!(pool.run(|| Ok(1)).unwrap(), 1);
        pool.close();
        assert!(pool.run(|| Ok(1)).is_err());
    }

    #[test]
    fn spawned_jobs_run_and_a_panic_leaves_the_pool_working() {
        let pool = Pool::new(1).unwrap();
        pool.spawn(|| panic!("boom")).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        pool.spawn(move || tx.send(7).unwrap()).unwrap();
        let got = rx.recv_timeout(std::time::Duration::from_secs(10));
        assert_eq!(
            got,
            Ok(7),
            "the job after a panicking one ran on the same worker"
        );
        pool.close();
        assert!(pool.spawn(|| ()).is_err());
    }

    #[test]
    fn zero_workers_is_refused() {
        assert!(Pool::new(0).is_err());
    }
}

//! The parties of a pass and how they wait: who attached, the stop flag, the recorded error,
//! heartbeats and stalls. Every wait sleeps on a futex word for at most [`POLL`] (the ring's
//! poll interval, which tests may change with [`Ring::with_poll`]) before it re-checks the
//! stop flag, the owner and errors.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::Duration;

use crate::futex;
use crate::layout::*;
use crate::segment;
use crate::{Result, ShmError};

use super::Ring;

/// Longest sleep of any wait before it re-checks the stop flag, the owner and errors.
pub const POLL: Duration = Duration::from_millis(100);

/// An error a party recorded in the control segment for the others.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordedError {
    /// A code of the recorder's error-kind table (the transport does not read it).
    pub kind: u32,
    /// The operating system's error number, when the error has one.
    pub errno: Option<i32>,
    /// The first batch the error affects.
    pub batch: u64,
    pub text: String,
}

/// Who is waiting: a child exits when its owner is gone; the owner checks its children itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    Owner,
    Child,
}

/// A party that writes heartbeats: the producer, or consumer `i`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Party {
    Producer,
    Consumer(usize),
}

/// A party whose heartbeat is older than the owner's bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stall {
    pub party: Party,
    /// 0 when the party never registered.
    pub pid: u64,
    pub silent: Duration,
}

/// Writes a party's heartbeat every [`POLL`] from a thread of its own until dropped (or the
/// ring is stopped): the party is alive and scheduled while its main thread is busy elsewhere.
pub struct Heartbeat {
    stop: Option<mpsc::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for Heartbeat {
    fn drop(&mut self) {
        drop(self.stop.take()); // wakes the thread at once
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid out-pointer.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

pub(super) fn parent_pid() -> u64 {
    // SAFETY: getppid cannot fail.
    unsafe { libc::getppid() as u64 }
}

impl Ring {
    /// Counts this party as holding both segments. The party that completes the count removes
    /// both names at once: from then on the kernel frees the memory with the last mapping,
    /// whatever happens to the owner (which may not look before its first `next()`).
    pub fn mark_attached(&self) {
        let attached = self.a32(C_ATTACHED);
        let now = attached.fetch_add(1, Ordering::AcqRel) + 1;
        if now == self.a32(C_EXPECTED_ATTACH).load(Ordering::Relaxed) {
            self.unlink();
        }
        futex::wake_all(attached);
    }

    /// Whether every expected party has attached, so the names may go.
    pub fn all_attached(&self) -> bool {
        self.a32(C_ATTACHED).load(Ordering::Acquire)
            >= self.a32(C_EXPECTED_ATTACH).load(Ordering::Relaxed)
    }

    /// Waits until every party has attached, so that the owner removes the names (a child:
    /// errors when stopped or when the owner is gone, which leaves the names to this party).
    pub fn wait_all_attached(&self) -> Result<()> {
        let attached = self.a32(C_ATTACHED);
        let expected = self.a32(C_EXPECTED_ATTACH).load(Ordering::Relaxed);
        loop {
            let seen = attached.load(Ordering::Acquire);
            if seen >= expected {
                return Ok(());
            }
            self.check_live(Role::Child)?;
            futex::wait(attached, seen, self.poll);
        }
    }

    /// Sleeps until the attach count changes (or `timeout`, at most [`POLL`], passes, or the
    /// ring is stopped); says whether every party has attached. The owner's wait: it checks its
    /// children itself between two calls.
    pub fn wait_attached(&self, timeout: Duration) -> bool {
        let attached = self.a32(C_ATTACHED);
        let seen = attached.load(Ordering::Acquire);
        if !self.all_attached() && !self.stopped() {
            futex::wait(attached, seen, timeout.min(self.poll));
        }
        self.all_attached()
    }

    /// Wakes every futex a party may sleep on, so that each re-checks the stop flag and errors
    /// now rather than at its next [`POLL`].
    fn wake_everyone(&self) {
        futex::wake_all(self.a32(C_PRODUCER_WAKE));
        futex::wake_all(self.a32(C_ATTACHED));
        futex::wake_all(self.a32(C_GENERATION));
        for s in 0..self.geometry.num_slots as usize {
            futex::wake_all(self.a32(self.slot_base(s) + S_WORD));
        }
    }

    /// Tells every party to exit, and wakes them.
    pub fn stop(&self) {
        self.a32(C_STOP).store(1, Ordering::Release);
        self.wake_everyone();
    }

    pub fn stopped(&self) -> bool {
        self.a32(C_STOP).load(Ordering::Acquire) != 0
    }

    /// Records an error that affects `batch` and later ones; the first error wins. `kind` is
    /// a code of the recorder's error-kind table (neither `ERR_NONE` nor `ERR_WRITING`), `errno`
    /// the operating system's error number when it has one.
    pub fn set_error(&self, kind: u32, errno: Option<i32>, batch: u64, text: &str) -> bool {
        debug_assert!(
            kind != ERR_NONE && kind != ERR_WRITING,
            "kind {kind} is reserved"
        );
        if self
            .a32(C_ERROR_KIND)
            .compare_exchange(ERR_NONE, ERR_WRITING, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false;
        }
        let mut len = text.len().min(ERROR_TEXT_MAX);
        while !text.is_char_boundary(len) {
            len -= 1;
        }
        // SAFETY: in range; only the CAS winner writes the text, readers wait for the kind.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), self.ctl.ptr().add(C_ERROR_TEXT), len)
        };
        self.a32(C_ERROR_LEN).store(len as u32, Ordering::Relaxed);
        // errno values are positive; anything else is stored as "none".
        let errno = errno.and_then(|e| u32::try_from(e).ok()).unwrap_or(0);
        self.a32(C_ERROR_ERRNO).store(errno, Ordering::Relaxed);
        self.a64(C_ERROR_BATCH).store(batch, Ordering::Relaxed);
        self.a32(C_ERROR_KIND).store(kind, Ordering::Release);
        self.wake_everyone();
        true
    }

    /// The recorded error, if any.
    pub fn error(&self) -> Option<RecordedError> {
        let kind = self.a32(C_ERROR_KIND).load(Ordering::Acquire);
        if kind == ERR_NONE || kind == ERR_WRITING {
            return None;
        }
        let len = (self.a32(C_ERROR_LEN).load(Ordering::Relaxed) as usize).min(ERROR_TEXT_MAX);
        // SAFETY: in range; written before the Release store of the kind observed above.
        let bytes = unsafe { std::slice::from_raw_parts(self.ctl.ptr().add(C_ERROR_TEXT), len) };
        let errno = self.a32(C_ERROR_ERRNO).load(Ordering::Relaxed);
        Some(RecordedError {
            kind,
            errno: i32::try_from(errno).ok().filter(|&e| e != 0),
            batch: self.a64(C_ERROR_BATCH).load(Ordering::Relaxed),
            text: String::from_utf8_lossy(bytes).into_owned(),
        })
    }

    pub fn set_producer(&self, pid: u64) {
        self.a64(C_PRODUCER_PID).store(pid, Ordering::Release);
        self.heartbeat(Party::Producer);
    }

    pub fn producer_pid(&self) -> u64 {
        self.a64(C_PRODUCER_PID).load(Ordering::Acquire)
    }

    fn heartbeat_word(&self, party: Party) -> &AtomicU64 {
        match party {
            Party::Producer => self.a64(C_PRODUCER_HEARTBEAT),
            Party::Consumer(i) => self.a64(self.consumer_base(i) + P_HEARTBEAT),
        }
    }

    /// Records that a party is alive and making progress.
    pub fn heartbeat(&self, party: Party) {
        self.heartbeat_word(party)
            .store(monotonic_ns(), Ordering::Relaxed);
    }

    /// Records that a party finished its work: the owner stops watching its heartbeat.
    pub fn finished(&self, party: Party) {
        self.heartbeat_word(party)
            .store(HEARTBEAT_DONE, Ordering::Relaxed);
    }

    /// Starts a thread that writes `party`'s heartbeat every [`POLL`] until the returned guard
    /// is dropped or the ring is stopped.
    pub fn keep_alive(self: &Arc<Self>, party: Party) -> Result<Heartbeat> {
        let (stop, stopped) = mpsc::channel::<()>();
        let ring = self.clone();
        let thread = std::thread::Builder::new()
            .name("dataset-rt-heartbeat".into())
            .spawn(move || {
                while !ring.stopped() {
                    ring.heartbeat(party);
                    if stopped.recv_timeout(ring.poll) != Err(mpsc::RecvTimeoutError::Timeout) {
                        return; // the guard was dropped
                    }
                }
            })
            .map_err(|source| ShmError::Io {
                op: "start the heartbeat thread of",
                path: segment::path_of(self.ctl_name()),
                source,
            })?;
        self.heartbeat(party);
        Ok(Heartbeat {
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The parties (producer first, then consumers in order) whose last heartbeat, or this
    /// mapping's creation when they never wrote one, is more than `bound` ago. Finished parties
    /// are not watched. The owner decides what a stall means for a party that already exited.
    pub fn stalls(&self, bound: Duration) -> Vec<Stall> {
        let now = monotonic_ns();
        let consumers = self
            .a32(C_EXPECTED_ATTACH)
            .load(Ordering::Relaxed)
            .saturating_sub(1);
        let consumers = (consumers.min(self.geometry.max_consumers)) as usize;
        std::iter::once(Party::Producer)
            .chain((0..consumers).map(Party::Consumer))
            .filter_map(|party| {
                let beat = self.heartbeat_word(party).load(Ordering::Relaxed);
                if beat == HEARTBEAT_DONE {
                    return None;
                }
                let silent = Duration::from_nanos(now.saturating_sub(beat.max(self.mapped_ns)));
                let pid = match party {
                    Party::Producer => self.producer_pid(),
                    Party::Consumer(i) => self
                        .a64(self.consumer_base(i) + P_PID)
                        .load(Ordering::Acquire),
                };
                (silent > bound).then_some(Stall { party, pid, silent })
            })
            .collect()
    }

    pub fn register_consumer(&self, i: usize, pid: u64) -> Result<()> {
        if i >= self.geometry.max_consumers as usize {
            return Err(ShmError::Protocol(format!(
                "consumer {i} is past the {} the ring was made for",
                self.geometry.max_consumers
            )));
        }
        self.a64(self.consumer_base(i) + P_PID)
            .store(pid, Ordering::Release);
        self.heartbeat(Party::Consumer(i));
        Ok(())
    }

    pub(super) fn check_live(&self, role: Role) -> Result<()> {
        if self.stopped() {
            return Err(ShmError::Stopped);
        }
        if role == Role::Child && parent_pid() != self.owner_pid {
            return Err(ShmError::OwnerGone(self.owner_pid));
        }
        Ok(())
    }
}

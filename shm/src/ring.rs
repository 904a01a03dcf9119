//! The ring protocol over the two segments. Every shared field is accessed through atomics;
//! slot contents are handed over by the slot word's Release/Acquire transitions.
//!
//! This file maps the segments (`Ring::create`, `Ring::attach`) and addresses their fields;
//! `ring::geometry` holds what a pass's segments are made for (geometry, names, the pass),
//! `ring::parties` who takes part and how they wait (attach count, stop, errors, heartbeats),
//! and `ring::slots` the tickets and slots protocol (generations, producer, consumers, the
//! training loop). Their items are re-exported here.

use std::any::Any;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use crate::layout::*;
use crate::segment::{self, Segment};
use crate::{Result, ShmError};

mod geometry;
mod parties;
mod slots;

pub use geometry::{Created, Geometry, Names, Pass};
pub use parties::{monotonic_ns, Heartbeat, Party, RecordedError, Role, Stall, POLL};
pub use slots::Ticket;

/// One party's mapping of a pass's two segments. `Send` and `Sync` come from `MmapRaw` (no
/// `unsafe impl` here): every shared field is accessed through atomics, and slot bytes only by
/// the party the slot word hands them to.
pub struct Ring {
    ctl: Segment,
    ring: Segment,
    geometry: Geometry,
    owner_pid: u64,
    /// When this party mapped the segments (CLOCK_MONOTONIC ns): the owner counts a party that
    /// never wrote a heartbeat as silent since then.
    mapped_ns: u64,
    /// Further entries whose names go with the segments' (the owner's private directory).
    also_unlink: Vec<String>,
    /// The creator's claims on the names (the owner's ring only).
    _keep: Option<Box<dyn Any + Send + Sync>>,
    /// The longest sleep of this party's waits, and its heartbeat thread's period: [`POLL`],
    /// unless a test chose another with [`Ring::with_poll`].
    poll: Duration,
}

impl Ring {
    /// Initialises a pass's fresh segments (the owner, i.e. the training process, which
    /// created them with [`Geometry::ctl_bytes`] and [`Geometry::ring_bytes`] bytes).
    pub fn create(
        owner_pid: u64,
        geometry: Geometry,
        pass: Pass,
        created: Created,
    ) -> Result<Ring> {
        let ring_bytes = geometry.ring_bytes()?;
        let Created {
            ctl,
            ring,
            also_unlink,
            keep,
        } = created;
        if ctl.len() as u64 != geometry.ctl_bytes() || ring.len() as u64 != ring_bytes {
            return Err(ShmError::Protocol(format!(
                "segments of {} and {} bytes for geometry {geometry:?}",
                ctl.len(),
                ring.len()
            )));
        }
        if let Err(why) = pass.check() {
            return Err(ShmError::Protocol(format!("the pass to create: {why}")));
        }
        let r = Ring {
            ctl,
            ring,
            geometry,
            owner_pid,
            mapped_ns: monotonic_ns(),
            also_unlink,
            _keep: Some(keep),
            poll: POLL,
        };
        // The segment is fresh (all zero, every slot FREE for batch 0); nobody else has it yet.
        r.a32(C_VERSION).store(LAYOUT_VERSION, Ordering::Relaxed);
        r.a32(C_NUM_SLOTS)
            .store(geometry.num_slots, Ordering::Relaxed);
        r.a64(C_SLOT_SIZE)
            .store(geometry.slot_size, Ordering::Relaxed);
        r.a64(C_RING_BYTES).store(ring_bytes, Ordering::Relaxed);
        r.a32(C_MAX_CONSUMERS)
            .store(geometry.max_consumers, Ordering::Relaxed);
        r.a32(C_EXPECTED_ATTACH)
            .store(pass.expected_attach, Ordering::Relaxed);
        r.a64(C_OWNER_PID).store(owner_pid, Ordering::Relaxed);
        r.a64(C_TOTAL_BATCHES)
            .store(pass.total_batches, Ordering::Relaxed);
        r.a64(C_BATCH_SIZE)
            .store(pass.batch_size, Ordering::Relaxed);
        r.a64(C_RANK_SAMPLES)
            .store(pass.rank_samples, Ordering::Relaxed);
        r.a64(C_EPOCH).store(pass.epoch, Ordering::Relaxed);
        r.a64(C_START).store(pass.start, Ordering::Relaxed);
        r.a64(C_EPOCH_LEN).store(pass.epoch_len, Ordering::Relaxed);
        r.a64(C_RANK).store(pass.rank, Ordering::Relaxed);
        r.a64(C_WORLD_SIZE)
            .store(pass.world_size, Ordering::Relaxed);
        r.a32(C_POLICY).store(pass.policy, Ordering::Relaxed);
        r.a64(C_POSITION).store(pass.start, Ordering::Relaxed);
        // Generation 0; `check` below bounds the total to 32 bits.
        r.a64(C_PASS_TICKETS)
            .store(pass.total_batches, Ordering::Relaxed);
        for i in 0..geometry.max_consumers as usize {
            r.a64(r.consumer_base(i) + P_TICKET)
                .store(u64::MAX, Ordering::Relaxed);
        }
        // The magic goes last: a segment with a magic is fully initialised.
        // SAFETY: within the mapping; nobody else maps it before `create` returns.
        unsafe { std::ptr::copy_nonoverlapping(CTL_MAGIC.as_ptr(), r.ctl.ptr().add(C_MAGIC), 8) };
        std::sync::atomic::fence(Ordering::SeqCst);
        Ok(r)
    }

    /// Opens a pass's segments by name and checks magic, version, geometry, the owner and the
    /// pass (a consumer or the producer).
    pub fn attach(names: &Names) -> Result<Ring> {
        let (ctl_name, owner_pid) = (names.ctl.as_str(), names.owner_pid);
        let ctl = Segment::open(ctl_name)?;
        let bad =
            |reason: String| ShmError::Protocol(format!("control segment {ctl_name}: {reason}"));
        if ctl.len() < C_SLOTS {
            return Err(bad(format!("{} bytes is too short", ctl.len())));
        }
        // SAFETY: in range (checked above).
        let magic = unsafe { std::slice::from_raw_parts(ctl.ptr(), 8) };
        if magic != CTL_MAGIC {
            return Err(bad("bad magic".into()));
        }
        let probe = Ring {
            ring: Segment::open(&names.ring)?,
            ctl,
            geometry: Geometry {
                num_slots: 0,
                slot_size: 0,
                max_consumers: 0,
            },
            owner_pid,
            mapped_ns: monotonic_ns(),
            also_unlink: names.also_unlink.clone(),
            _keep: None,
            poll: POLL,
        };
        let version = probe.a32(C_VERSION).load(Ordering::Relaxed);
        if version != LAYOUT_VERSION {
            return Err(bad(format!(
                "layout version {version}, this build speaks {LAYOUT_VERSION}"
            )));
        }
        let geometry = Geometry {
            num_slots: probe.a32(C_NUM_SLOTS).load(Ordering::Relaxed),
            slot_size: probe.a64(C_SLOT_SIZE).load(Ordering::Relaxed),
            max_consumers: probe.a32(C_MAX_CONSUMERS).load(Ordering::Relaxed),
        };
        let ring_bytes = geometry
            .slot_size
            .checked_mul(u64::from(geometry.num_slots));
        if geometry.num_slots == 0
            || geometry.slot_size == 0
            || geometry.slot_size % PAGE != 0
            || (probe.ctl.len() as u64) < ctl_len(geometry.num_slots, geometry.max_consumers)
            || ring_bytes != Some(probe.ring.len() as u64)
            || probe.a64(C_OWNER_PID).load(Ordering::Relaxed) != owner_pid
        {
            return Err(bad(format!(
                "geometry {geometry:?} does not match the segment sizes or name"
            )));
        }
        probe.pass().check().map_err(bad)?;
        let tickets = probe.a64(C_PASS_TICKETS).load(Ordering::Acquire);
        if tickets & u64::from(u32::MAX) != probe.total_batches() {
            return Err(bad(format!(
                "pass tickets {tickets:#x} do not match the pass's {} batches",
                probe.total_batches()
            )));
        }
        Ok(Ring { geometry, ..probe })
    }

    /// This mapping with another longest sleep for its waits and period for its heartbeat
    /// thread than [`POLL`]. For tests: a long one shows that a wait ends because it was woken,
    /// not because its sleep ran out; a short one makes heartbeats frequent. The other parties'
    /// mappings keep theirs.
    pub fn with_poll(mut self, poll: Duration) -> Ring {
        self.poll = poll;
        self
    }

    fn a32(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off % 4 == 0 && off + 4 <= self.ctl.len());
        // SAFETY: aligned, in range, and only ever accessed atomically by every party.
        unsafe { &*(self.ctl.ptr().add(off) as *const AtomicU32) }
    }

    fn a64(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off % 8 == 0 && off + 8 <= self.ctl.len());
        // SAFETY: as in `a32`.
        unsafe { &*(self.ctl.ptr().add(off) as *const AtomicU64) }
    }

    fn slot_base(&self, slot: usize) -> usize {
        C_SLOTS + slot * SLOT_ENTRY
    }

    fn consumer_base(&self, i: usize) -> usize {
        C_SLOTS + self.geometry.num_slots as usize * SLOT_ENTRY + i * CONSUMER_ENTRY
    }

    fn slot_of(&self, batch: u64) -> usize {
        (batch % u64::from(self.geometry.num_slots)) as usize
    }

    fn word(&self, batch: u64) -> &AtomicU32 {
        self.a32(self.slot_base(self.slot_of(batch)) + S_WORD)
    }

    pub fn ctl_name(&self) -> &str {
        &self.ctl.name
    }

    pub fn ring_name(&self) -> &str {
        &self.ring.name
    }

    pub fn ring_len(&self) -> u64 {
        self.ring.len() as u64
    }

    pub fn geometry(&self) -> Geometry {
        self.geometry
    }

    pub fn owner_pid(&self) -> u64 {
        self.owner_pid
    }

    pub fn total_batches(&self) -> u64 {
        self.a64(C_TOTAL_BATCHES).load(Ordering::Relaxed)
    }

    pub fn batch_size(&self) -> u64 {
        self.a64(C_BATCH_SIZE).load(Ordering::Relaxed)
    }

    pub fn rank_samples(&self) -> u64 {
        self.a64(C_RANK_SAMPLES).load(Ordering::Relaxed)
    }

    /// The pass as the owner wrote it.
    pub fn pass(&self) -> Pass {
        Pass {
            total_batches: self.total_batches(),
            batch_size: self.batch_size(),
            rank_samples: self.rank_samples(),
            epoch: self.a64(C_EPOCH).load(Ordering::Relaxed),
            start: self.a64(C_START).load(Ordering::Relaxed),
            epoch_len: self.a64(C_EPOCH_LEN).load(Ordering::Relaxed),
            rank: self.a64(C_RANK).load(Ordering::Relaxed),
            world_size: self.a64(C_WORLD_SIZE).load(Ordering::Relaxed),
            policy: self.a32(C_POLICY).load(Ordering::Relaxed),
            expected_attach: self.a32(C_EXPECTED_ATTACH).load(Ordering::Relaxed),
        }
    }

    /// The names this party mapped (and removes with [`Ring::unlink`]), and the owner.
    pub fn names(&self) -> Names {
        Names {
            ctl: self.ctl.name.clone(),
            ring: self.ring.name.clone(),
            also_unlink: self.also_unlink.clone(),
            owner_pid: self.owner_pid,
        }
    }

    /// Removes both names and the further entries from /dev/shm (the mappings stay valid).
    pub fn unlink(&self) {
        segment::unlink(&self.ctl.name);
        segment::unlink(&self.ring.name);
        for name in &self.also_unlink {
            segment::unlink(name);
        }
    }
}
#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use super::parties::parent_pid;
    use super::*;

    const _: () = {
        // Shared between threads (the heartbeat thread, the bindings' Arc) without unsafe impls.
        const fn send_and_sync<T: Send + Sync>() {}
        send_and_sync::<Ring>();
    };

    fn pass(total_batches: u64, consumers: u32) -> Pass {
        Pass {
            total_batches,
            batch_size: 2,
            rank_samples: 2 * total_batches,
            epoch: 3,
            start: 0,
            epoch_len: 2 * total_batches,
            rank: 0,
            world_size: 1,
            policy: POLICY_PAD,
            expected_attach: 1 + consumers,
        }
    }

    /// Creates a pass's two segments under fresh names of this test process (which no reaper
    /// takes for a DatasetRT owner's).
    pub(crate) fn created(geometry: Geometry) -> Created {
        use std::sync::atomic::AtomicUsize;
        static NEXT: AtomicUsize = AtomicUsize::new(0);
        let stem = format!(
            "shm-test-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let no_lock = |_: &std::fs::File, _: &std::path::Path| Ok(());
        let (ctl, ()) =
            Segment::create(&format!("{stem}-ctl"), geometry.ctl_bytes(), no_lock).unwrap();
        let (ring, ()) = Segment::create(
            &format!("{stem}-ring"),
            geometry.ring_bytes().unwrap(),
            no_lock,
        )
        .unwrap();
        Created {
            ctl,
            ring,
            also_unlink: Vec::new(),
            keep: Box::new(()),
        }
    }

    fn attach(r: &Ring) -> Result<Ring> {
        Ring::attach(&r.names())
    }

    /// A ring whose owner is this process's parent, as for the producer and consumers: their
    /// waits check that their parent is the owner. Its names are removed at once (the mapping
    /// stays) unless `keep_names`.
    fn ring(num_slots: u32, total_batches: u64, consumers: u32, keep_names: bool) -> Ring {
        let geometry = Geometry {
            num_slots,
            slot_size: PAGE,
            max_consumers: consumers.max(1),
        };
        let r = Ring::create(
            parent_pid(),
            geometry,
            pass(total_batches, consumers),
            created(geometry),
        )
        .unwrap();
        if !keep_names {
            r.unlink();
        }
        r
    }

    fn fill(r: &Ring, b: u64, byte: u8) {
        r.wait_fillable(b).unwrap();
        // SAFETY: this test is the only producer; the slice is dropped before publishing.
        let slot = unsafe { r.begin_fill(b) };
        assert_eq!(r.word(b).load(Ordering::Acquire), slot_word(b, FILLING));
        slot[..8].fill(byte);
        r.publish(b, 8);
    }

    /// The poll interval of the rings of the tests that show a wait is woken: a waiter that is
    /// not woken sleeps this long, far past [`WOKEN`] on any machine.
    const LONG_POLL: Duration = Duration::from_secs(30);

    /// How soon a woken waiter must have returned: generous for a loaded machine, and still far
    /// below [`LONG_POLL`].
    const WOKEN: Duration = Duration::from_secs(10);

    /// Whether thread `tid` of this process sleeps in a futex wait on `word`. The kernel's
    /// `/proc/self/task/TID/syscall` names the system call a blocked thread is in, then its
    /// arguments, the first of which is the futex's address. Where that file cannot be read,
    /// any sleep of the thread counts.
    fn asleep_on(tid: libc::pid_t, word: &AtomicU32) -> bool {
        match std::fs::read_to_string(format!("/proc/self/task/{tid}/syscall")) {
            Ok(text) => {
                let mut fields = text.split_whitespace();
                let call = fields.next().and_then(|f| f.parse::<libc::c_long>().ok());
                let addr = fields
                    .next()
                    .and_then(|f| u64::from_str_radix(f.trim_start_matches("0x"), 16).ok());
                call == Some(libc::SYS_futex) && addr == Some(word.as_ptr() as u64)
            }
            Err(_) => {
                std::fs::read_to_string(format!("/proc/self/task/{tid}/stat")).is_ok_and(|stat| {
                    stat.rsplit(')')
                        .next()
                        .unwrap_or("")
                        .trim_start()
                        .starts_with('S')
                })
            }
        }
    }

    /// Runs `wait` on a thread of its own and returns once that thread sleeps on `word` (or
    /// has returned already): the test then acts on a waiter that is really waiting, not after
    /// a sleep that assumes it got there.
    fn spawn_waiter<'scope, T: Send + 'scope>(
        s: &'scope std::thread::Scope<'scope, '_>,
        word: &AtomicU32,
        wait: impl FnOnce() -> T + Send + 'scope,
    ) -> std::thread::ScopedJoinHandle<'scope, T> {
        let (tid_tx, tid_rx) = std::sync::mpsc::channel();
        let waiter = s.spawn(move || {
            // SAFETY: gettid cannot fail.
            tid_tx.send(unsafe { libc::gettid() }).unwrap();
            wait()
        });
        let tid = tid_rx.recv().unwrap();
        let deadline = Instant::now() + WOKEN;
        while !waiter.is_finished() && !asleep_on(tid, word) {
            assert!(Instant::now() < deadline, "the waiter never went to sleep");
            std::thread::sleep(Duration::from_millis(1));
        }
        waiter
    }

    #[test]
    fn slot_words_go_free_filling_ready_taken_free() {
        let r = ring(2, 4, 1, false).with_poll(LONG_POLL);
        assert_eq!(r.word(0).load(Ordering::Acquire), slot_word(0, FREE));
        fill(&r, 0, 0xA0);
        assert_eq!(r.word(0).load(Ordering::Acquire), slot_word(0, READY));
        assert_eq!(r.produced(), 1);

        assert_eq!(r.take_ticket(), Ticket::Batch(0));
        assert!(r.wait_ready(0, POLL, Role::Owner, Some(0)).unwrap());
        assert_eq!(r.word(0).load(Ordering::Acquire), slot_word(0, TAKEN));
        assert_eq!(&r.slot(0)[..8], &[0xA0; 8]);
        // Taken once: a second wait sees no READY word and times out.
        assert!(!r
            .wait_ready(0, Duration::from_millis(20), Role::Owner, Some(0))
            .unwrap());
        // Batch 1 is not written yet.
        assert!(!r
            .wait_ready(1, Duration::from_millis(20), Role::Owner, None)
            .unwrap());
        r.release(0, Some(0)).unwrap();
        assert_eq!(r.word(0).load(Ordering::Acquire), slot_word(0, FREE));
        assert!(r
            .release(0, Some(0))
            .unwrap_err()
            .to_string()
            .contains("not TAKEN"));

        fill(&r, 1, 0xA1);
        // Batch 2 reuses slot 0, which is FREE, but is 2 slots ahead of what was delivered.
        let (blocked, woken_in) = std::thread::scope(|s| {
            let waiter = spawn_waiter(s, r.a32(C_PRODUCER_WAKE), || {
                (r.wait_fillable(2), Instant::now())
            });
            let blocked = !waiter.is_finished();
            let delivered_at = Instant::now();
            r.mark_delivered(0, 2).unwrap();
            let (fillable, woke) = waiter.join().unwrap();
            fillable.unwrap();
            (blocked, woke.saturating_duration_since(delivered_at))
        });
        assert!(blocked, "the prefetch bound let the producer run ahead");
        assert!(
            woken_in < WOKEN,
            "the delivery woke the producer after {woken_in:?}"
        );
        fill(&r, 2, 0xA2);
        // Every fill of a slot is a new word: batch 2's READY is not batch 0's.
        assert_eq!(r.word(2).load(Ordering::Acquire), slot_word(2, READY));
        assert_ne!(slot_word(2, READY), slot_word(0, READY));
        assert!(r
            .mark_delivered(2, 6)
            .unwrap_err()
            .to_string()
            .contains("out of order"));
        assert_eq!(r.progress(), (3, 2, false));
    }

    /// Takes, fills and delivers every batch of the current pass as producer, consumer and owner
    /// at once; returns the consumer's `PassOver` generation.
    fn run_whole_pass(r: &Ring) -> u32 {
        let pass = r.pass();
        for b in 0..pass.total_batches {
            fill(r, b, b as u8);
            assert_eq!(r.take_ticket(), Ticket::Batch(b));
            assert!(r.wait_ready(b, POLL, Role::Owner, Some(0)).unwrap());
            r.release(b, Some(0)).unwrap();
            r.mark_delivered(b, 2 * (b + 1)).unwrap();
        }
        match r.take_ticket() {
            Ticket::PassOver(generation) => generation,
            other => panic!("a ticket past the pass: {other:?}"),
        }
    }

    #[test]
    fn a_pass_after_a_pass_reuses_the_segments() {
        let r = ring(2, 3, 1, true);
        assert_eq!((r.generation(), run_whole_pass(&r)), (0, 0));
        assert_eq!(r.progress(), (3, 6, true));
        let mut next = pass(5, 1);
        next.epoch = 4;
        assert_eq!(r.begin_next_pass(next).unwrap(), 1);
        assert_eq!(r.pass(), next);
        assert_eq!((r.produced(), r.delivered()), (0, 0));
        assert_eq!(r.progress(), (4, 0, false));
        // A waiter done with generation 0 goes on at once; one done with 1 waits.
        assert_eq!(r.wait_next_pass(0).unwrap(), 1);
        assert_eq!(run_whole_pass(&r), 1);
        assert_eq!(r.progress(), (4, 10, true));
        // Another party attaching now sees the current pass and accepts it.
        let attached = attach(&r).map(|other| other.pass());
        r.unlink();
        assert_eq!(attached.unwrap(), next);
    }

    #[test]
    fn a_stale_ticket_of_an_ended_pass_is_never_a_batch_of_the_next() {
        let r = ring(2, 1, 1, false);
        run_whole_pass(&r);
        r.begin_next_pass(pass(4, 1)).unwrap();
        // A consumer whose increment of the old pass lands after the restart takes a real
        // ticket of the new pass (it counted), and every ticket goes to exactly one taker.
        let taken: Vec<Ticket> = (0..6).map(|_| r.take_ticket()).collect();
        assert_eq!(
            taken,
            [0, 1, 2, 3]
                .map(Ticket::Batch)
                .into_iter()
                .chain([Ticket::PassOver(1), Ticket::PassOver(1)])
                .collect::<Vec<_>>()
        );
        // Emulate a fetch_add of generation 0 that a slow consumer made before the restart and
        // read after it: its word carries generation 0, so it is over, whatever the new total.
        let tickets = r.a64(C_PASS_TICKETS).load(Ordering::Acquire);
        assert_eq!(tickets, (1 << 32) | 4);
        r.a64(C_NEXT_TICKET).store(1, Ordering::Release);
        assert_eq!(r.take_ticket(), Ticket::PassOver(0));
    }

    #[test]
    fn a_next_pass_waits_for_the_current_one_to_be_over() {
        let r = ring(2, 2, 1, false);
        let refused = |r: &Ring, p: Pass| r.begin_next_pass(p).unwrap_err().to_string();
        assert!(refused(&r, pass(2, 1)).contains("not over (0 of 2 batches produced"));
        fill(&r, 0, 1);
        fill(&r, 1, 2);
        assert_eq!(r.take_ticket(), Ticket::Batch(0));
        assert!(r.wait_ready(0, POLL, Role::Owner, Some(0)).unwrap());
        r.release(0, Some(0)).unwrap();
        r.mark_delivered(0, 2).unwrap();
        assert_eq!(r.take_ticket(), Ticket::Batch(1));
        assert!(r.wait_ready(1, POLL, Role::Owner, Some(0)).unwrap());
        r.mark_delivered(1, 4).unwrap();
        // Everything delivered, but batch 1's slot is still held.
        assert!(refused(&r, pass(2, 1)).contains("slot 1 is still in use"));
        r.release(1, Some(0)).unwrap();
        assert!(refused(&r, pass(2, 2)).contains("3 parties expected"));
        let mut forged = pass(2, 1);
        forged.rank = 1;
        assert!(refused(&r, forged).contains("rank 1 is not below world size 1"));
        assert_eq!(r.generation(), 0, "a refused pass changes nothing");
        r.begin_next_pass(pass(2, 1)).unwrap();

        let r = ring(2, 1, 1, false);
        run_whole_pass(&r);
        r.set_error(1, None, 1, "disk gone");
        assert!(refused(&r, pass(1, 1)).contains("the producer failed at batch 1: disk gone"));
        r.stop();
        assert!(matches!(
            r.begin_next_pass(pass(1, 1)),
            Err(ShmError::Stopped)
        ));
    }

    #[test]
    fn a_party_waiting_for_the_next_pass_wakes_at_once_for_it_and_for_a_stop() {
        let r = ring(2, 1, 1, false).with_poll(LONG_POLL);
        run_whole_pass(&r);
        let generation_word = r.a32(C_GENERATION);
        std::thread::scope(|s| {
            let waiter = spawn_waiter(s, generation_word, || {
                let generation = r.wait_next_pass(0);
                (Instant::now(), generation.map_err(|e| e.to_string()))
            });
            let started = Instant::now();
            r.begin_next_pass(pass(1, 1)).unwrap();
            let (woke, generation) = waiter.join().unwrap();
            assert_eq!(generation, Ok(1));
            assert!(woke.saturating_duration_since(started) < WOKEN);
        });
        run_whole_pass(&r);
        std::thread::scope(|s| {
            let waiter = spawn_waiter(s, generation_word, || {
                let waited = r.wait_next_pass(1);
                (Instant::now(), waited)
            });
            let stopped_at = Instant::now();
            r.stop();
            let (woke, waited) = waiter.join().unwrap();
            assert!(matches!(waited, Err(ShmError::Stopped)), "{waited:?}");
            assert!(woke.saturating_duration_since(stopped_at) < WOKEN);
        });
    }

    #[test]
    fn a_party_waiting_for_the_next_pass_leaves_when_its_owner_is_gone() {
        let mut r = ring(2, 1, 1, false).with_poll(LONG_POLL);
        run_whole_pass(&r);
        // This process's parent is no longer the owner: as for a child whose owner died.
        r.owner_pid = 1;
        let started = Instant::now();
        assert!(matches!(r.wait_next_pass(0), Err(ShmError::OwnerGone(_))));
        // At once, not after a sleep of the poll interval.
        assert!(started.elapsed() < WOKEN);
    }

    #[test]
    fn a_stop_ends_every_wait() {
        let r = ring(2, 4, 1, false);
        r.stop();
        assert!(matches!(r.wait_fillable(0), Err(ShmError::Stopped)));
        assert!(matches!(
            r.wait_ready(0, POLL, Role::Child, None),
            Err(ShmError::Stopped)
        ));
        assert!(matches!(r.wait_all_attached(), Err(ShmError::Stopped)));
    }

    #[test]
    fn a_stop_wakes_every_waiter_at_once() {
        // Each waiter sleeps on a different futex word; a stop must wake all of them without
        // leaving any to notice at its next poll. The stop comes once each one sleeps on its
        // word, and the poll interval is long: a waiter that is not woken returns only
        // LONG_POLL after it began.
        let r = ring(1, 4, 1, false).with_poll(LONG_POLL);
        fill(&r, 0, 0xB0); // the one slot is full: the producer waits for batch 1
        std::thread::scope(|s| {
            let attached = spawn_waiter(s, r.a32(C_ATTACHED), || {
                let e = r.wait_all_attached();
                (Instant::now(), matches!(e, Err(ShmError::Stopped)))
            });
            let fillable = spawn_waiter(s, r.a32(C_PRODUCER_WAKE), || {
                let e = r.wait_fillable(1);
                (Instant::now(), matches!(e, Err(ShmError::Stopped)))
            });
            let ready = spawn_waiter(s, r.word(1), || {
                let e = r.wait_ready(1, LONG_POLL * 2, Role::Child, None);
                (Instant::now(), matches!(e, Err(ShmError::Stopped)))
            });
            let stopped_at = Instant::now();
            r.stop();
            for (name, waiter) in [("attach", attached), ("fill", fillable), ("ready", ready)] {
                let (woke, stopped) = waiter.join().unwrap();
                assert!(stopped, "the {name} wait did not end with Stopped");
                let after = woke.saturating_duration_since(stopped_at);
                assert!(
                    after < WOKEN,
                    "the {name} wait ended {after:?} after the stop"
                );
            }
        });
    }

    #[test]
    fn a_producer_error_reaches_consumers_at_its_batch() {
        let r = ring(2, 4, 1, false);
        assert!(r.set_error(3, None, 1, "bad record"));
        assert!(
            !r.set_error(1, Some(5), 0, "later error"),
            "the first error wins"
        );
        assert!(!r
            .wait_ready(0, Duration::from_millis(20), Role::Owner, None)
            .unwrap());
        match r.wait_ready(1, POLL, Role::Owner, None) {
            Err(ShmError::ProducerFailed {
                kind,
                errno,
                batch,
                text,
            }) => {
                assert_eq!(
                    (kind, errno, batch, text.as_str()),
                    (3, None, 1, "bad record")
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn error_text_is_truncated_at_a_character_boundary() {
        let r = ring(2, 1, 0, false);
        let text = "é".repeat(ERROR_TEXT_MAX); // 2 bytes each: twice what fits
        assert!(r.set_error(6, None, 0, &text));
        let error = r.error().unwrap();
        assert_eq!((error.kind, error.batch), (6, 0));
        assert_eq!(error.text, "é".repeat(ERROR_TEXT_MAX / 2));
        // After one ASCII byte, 1020 bytes end inside a 3-byte character: 1 + 3 × 339 kept.
        let r = ring(2, 1, 0, false);
        assert!(r.set_error(6, None, 0, &format!("a{}", "€".repeat(400))));
        assert_eq!(r.error().unwrap().text, format!("a{}", "€".repeat(339)));
    }

    #[test]
    fn a_recorded_errno_reaches_the_reader() {
        let r = ring(2, 1, 0, false);
        assert!(r.set_error(1, Some(libc::ENOSPC), 0, "disk full"));
        let error = r.error().unwrap();
        assert_eq!((error.kind, error.errno), (1, Some(libc::ENOSPC)));
        // No errno, or a value no errno can be, reads back as none.
        for errno in [None, Some(0), Some(-1)] {
            let r = ring(2, 1, 0, false);
            assert!(r.set_error(2, errno, 0, "x"));
            assert_eq!(r.error().unwrap().errno, None);
        }
    }

    #[test]
    fn the_last_party_to_attach_removes_the_names() {
        let r = ring(2, 1, 1, true);
        let names = [r.ctl_name().to_owned(), r.ring_name().to_owned()];
        let exists = || names.iter().all(|n| segment::path_of(n).exists());
        let other = attach(&r).unwrap();
        assert_eq!(other.geometry(), r.geometry());
        assert_eq!(other.pass(), r.pass());
        other.mark_attached();
        assert!(exists() && !r.all_attached());
        r.mark_attached();
        assert!(r.all_attached());
        assert!(names.iter().all(|n| !segment::path_of(n).exists()));
        r.wait_all_attached().unwrap();
        assert!(r.wait_attached(Duration::from_secs(5)));
    }

    #[test]
    fn the_owner_sleeps_until_a_party_attaches() {
        // the producer is the one party to attach
        let r = ring(2, 1, 0, false).with_poll(LONG_POLL);
        let started = Instant::now();
        assert!(!r.wait_attached(Duration::from_millis(30)));
        assert!(started.elapsed() >= Duration::from_millis(25));
        std::thread::scope(|s| {
            let owner = spawn_waiter(s, r.a32(C_ATTACHED), || {
                let attached = r.wait_attached(LONG_POLL * 2);
                (Instant::now(), attached)
            });
            let at = Instant::now();
            r.mark_attached(); // the one expected party: wakes the owner at once
            let (woke, attached) = owner.join().unwrap();
            assert!(attached);
            assert!(woke.saturating_duration_since(at) < WOKEN);
        });
    }

    #[test]
    fn attach_refuses_what_it_does_not_speak() {
        let r = ring(2, 1, 1, true);
        r.a32(C_VERSION)
            .store(LAYOUT_VERSION + 1, Ordering::Relaxed);
        let refused = attach(&r).err().unwrap().to_string();
        r.unlink();
        assert!(refused.contains("layout version"), "{refused}");
    }

    /// Attach reads the geometry and the pass from a segment another process wrote: values no
    /// owner writes are refused, before any access relies on them.
    #[test]
    fn attach_refuses_forged_geometry_and_passes() {
        type Edit = fn(&Ring);
        let cases: [(&str, Edit, &str); 7] = [
            (
                // 2 × (2^63 + 4096) wraps to 8192 bytes, the real ring's length.
                "slot size overflows",
                |r| {
                    r.a64(C_SLOT_SIZE)
                        .store((1 << 63) + PAGE, Ordering::Relaxed)
                },
                "geometry",
            ),
            (
                "slot size not a page multiple",
                |r| {
                    // 4 × 2048 bytes: the ring's length, in slots no owner makes.
                    r.a32(C_NUM_SLOTS).store(4, Ordering::Relaxed);
                    r.a64(C_SLOT_SIZE).store(PAGE / 2, Ordering::Relaxed);
                },
                "geometry",
            ),
            (
                "world size 0",
                |r| r.a64(C_WORLD_SIZE).store(0, Ordering::Relaxed),
                "world size 0",
            ),
            (
                "rank past the world",
                |r| r.a64(C_RANK).store(1, Ordering::Relaxed),
                "rank 1 is not below world size 1",
            ),
            (
                "more rank samples than the split gives",
                |r| r.a64(C_RANK_SAMPLES).store(3, Ordering::Relaxed),
                "3 rank samples, more than the 2 the pass has left",
            ),
            (
                "batch size 0",
                |r| r.a64(C_BATCH_SIZE).store(0, Ordering::Relaxed),
                "batch size 0",
            ),
            (
                "more batches than samples",
                |r| r.a64(C_TOTAL_BATCHES).store(5, Ordering::Relaxed),
                "5 batches of 2 for 2 samples",
            ),
        ];
        for (what, edit, expected) in cases {
            let r = ring(2, 1, 1, true);
            attach(&r).expect("the unedited segments attach");
            edit(&r);
            let refused = attach(&r).err().map(|e| e.to_string());
            r.unlink();
            let refused = refused.unwrap_or_else(|| panic!("{what}: attached"));
            assert!(refused.contains(expected), "{what}: {refused}");
        }
    }

    #[test]
    fn stalls_list_silent_parties_until_they_finish() {
        // Heartbeats every 10 ms, against a bound of 1 s.
        let r = Arc::new(ring(2, 1, 2, false).with_poll(Duration::from_millis(10)));
        assert!(r.stalls(Duration::from_secs(5)).is_empty());
        std::thread::sleep(Duration::from_millis(5));
        let parties = |bound| -> Vec<Party> { r.stalls(bound).iter().map(|s| s.party).collect() };
        // Nobody wrote a heartbeat yet: silent since the ring was created.
        assert_eq!(
            parties(Duration::ZERO),
            [Party::Producer, Party::Consumer(0), Party::Consumer(1)]
        );
        r.set_producer(1234);
        r.finished(Party::Consumer(1));
        let stall = r.stalls(Duration::ZERO)[0];
        assert_eq!((stall.party, stall.pid), (Party::Producer, 1234));
        r.finished(Party::Producer);
        assert_eq!(parties(Duration::ZERO), [Party::Consumer(0)]);
        let bound = Duration::from_secs(1);
        {
            let _alive = r.keep_alive(Party::Consumer(0)).unwrap();
            std::thread::sleep(bound + bound / 2);
            assert!(
                parties(bound).is_empty(),
                "the heartbeat thread keeps it fresh"
            );
        }
        // Silent once the thread stopped: waits for the stall itself, not for a time assumed
        // long enough; a thread that kept beating never lets it come.
        let stopped = Instant::now();
        while parties(bound).is_empty() {
            assert!(
                stopped.elapsed() < bound + WOKEN,
                "still fresh {:?} after the heartbeat thread stopped",
                stopped.elapsed()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        assert_eq!(
            parties(bound),
            [Party::Consumer(0)],
            "silent once the thread stopped"
        );
        r.finished(Party::Consumer(0));
        assert!(parties(Duration::ZERO).is_empty());
    }
}

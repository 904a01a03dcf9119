//! The tickets and slots protocol: passes over the same segments (generations), the producer
//! filling slots, consumers taking tickets and slots and giving them back, and the training
//! loop recording what it received.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::futex;
use crate::layout::*;
use crate::{Result, ShmError};

use super::{Party, Pass, RecordedError, Ring, Role};

/// What `take_ticket` gives a consumer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ticket {
    /// Batch `t` of the current pass is this consumer's to process.
    Batch(u64),
    /// The pass of this generation has no batch left: wait for the next with
    /// [`Ring::wait_next_pass`].
    PassOver(u32),
}

impl Ring {
    /// Starts the next pass on segments whose previous pass is complete (the owner of a
    /// persistent pipeline): writes the pass's parameters, resets the per-pass counters (the
    /// slots are all FREE and keep their bytes), and wakes the producer and consumers that wait
    /// in [`Ring::wait_next_pass`]. Refused, changing nothing, while the previous pass is not
    /// fully delivered, after an error or a stop, or for a pass no attach would accept.
    pub fn begin_next_pass(&self, pass: Pass) -> Result<u32> {
        let refuse = |why: String| {
            Err(ShmError::Protocol(format!(
                "cannot start the next pass on {}: {why}",
                self.ctl.name
            )))
        };
        if self.stopped() {
            return Err(ShmError::Stopped);
        }
        if let Some(RecordedError { batch, text, .. }) = self.error() {
            return refuse(format!("the producer failed at batch {batch}: {text}"));
        }
        if let Err(why) = pass.check() {
            return refuse(why);
        }
        let expected = self.a32(C_EXPECTED_ATTACH).load(Ordering::Relaxed);
        if pass.expected_attach != expected {
            return refuse(format!(
                "{} parties expected, the segments were made for {expected}",
                pass.expected_attach
            ));
        }
        let (total, produced, delivered) =
            (self.total_batches(), self.produced(), self.delivered());
        if delivered != total || produced != total {
            return refuse(format!(
                "the current pass is not over ({produced} of {total} batches produced, \
                 {delivered} delivered)"
            ));
        }
        if let Some(s) = (0..self.geometry.num_slots as usize).find(|&s| {
            word_state(self.a32(self.slot_base(s) + S_WORD).load(Ordering::Acquire)) != FREE
        }) {
            return refuse(format!("slot {s} is still in use"));
        }
        let generation = self.generation().wrapping_add(1);
        self.a64(C_TOTAL_BATCHES)
            .store(pass.total_batches, Ordering::Relaxed);
        self.a64(C_BATCH_SIZE)
            .store(pass.batch_size, Ordering::Relaxed);
        self.a64(C_RANK_SAMPLES)
            .store(pass.rank_samples, Ordering::Relaxed);
        self.a64(C_EPOCH).store(pass.epoch, Ordering::Relaxed);
        self.a64(C_START).store(pass.start, Ordering::Relaxed);
        self.a64(C_EPOCH_LEN)
            .store(pass.epoch_len, Ordering::Relaxed);
        self.a64(C_RANK).store(pass.rank, Ordering::Relaxed);
        self.a64(C_WORLD_SIZE)
            .store(pass.world_size, Ordering::Relaxed);
        self.a32(C_POLICY).store(pass.policy, Ordering::Relaxed);
        self.a64(C_PRODUCED).store(0, Ordering::Relaxed);
        self.a64(C_POSITION).store(pass.start, Ordering::Relaxed);
        self.a64(C_DELIVERED).store(0, Ordering::Release);
        // The producer is watched again from now on (it wrote `finished` after the last pass).
        self.heartbeat(Party::Producer);
        let tagged = u64::from(generation) << 32;
        // The pass's tickets before the counter: a ticket of this generation always finds them.
        self.a64(C_PASS_TICKETS)
            .store(tagged | pass.total_batches, Ordering::Release);
        self.a64(C_NEXT_TICKET).store(tagged, Ordering::Release);
        let word = self.a32(C_GENERATION);
        word.store(generation, Ordering::Release);
        futex::wake_all(word);
        Ok(generation)
    }

    /// The current pass's generation: 0 for the segments' first pass, one more for each next.
    pub fn generation(&self) -> u32 {
        self.a32(C_GENERATION).load(Ordering::Acquire)
    }

    /// Waits (a producer or consumer done with the pass of generation `after`) until the owner
    /// starts another pass, and returns its generation. Errors: stopped or the owner gone.
    pub fn wait_next_pass(&self, after: u32) -> Result<u32> {
        let word = self.a32(C_GENERATION);
        loop {
            let seen = word.load(Ordering::Acquire);
            if seen != after {
                return Ok(seen);
            }
            self.check_live(Role::Child)?;
            futex::wait(word, seen, self.poll);
        }
    }

    pub fn produced(&self) -> u64 {
        self.a64(C_PRODUCED).load(Ordering::Acquire)
    }

    pub fn delivered(&self) -> u64 {
        self.a64(C_DELIVERED).load(Ordering::Acquire)
    }

    /// (epoch, global position) reached by what the training loop received, and whether the
    /// whole pass was received.
    pub fn progress(&self) -> (u64, u64, bool) {
        let delivered = self.delivered();
        (
            self.a64(C_EPOCH).load(Ordering::Relaxed),
            self.a64(C_POSITION).load(Ordering::Acquire),
            delivered >= self.total_batches(),
        )
    }

    // ---- producer ----

    /// Waits until batch `b` may be written: its slot is FREE and `b` is fewer than `num_slots`
    /// batches ahead of what the training loop received (the prefetch bound).
    pub fn wait_fillable(&self, b: u64) -> Result<()> {
        let wake = self.a32(C_PRODUCER_WAKE);
        let slots = u64::from(self.geometry.num_slots);
        loop {
            let seen = wake.load(Ordering::Acquire);
            self.check_live(Role::Child)?;
            self.heartbeat(Party::Producer);
            let free = word_state(self.word(b).load(Ordering::Acquire)) == FREE;
            if free && b < self.delivered() + slots {
                return Ok(());
            }
            futex::wait(wake, seen, self.poll);
        }
    }

    /// Marks batch `b`'s slot FILLING and returns it for writing.
    ///
    /// # Safety
    /// Only the producer calls this, after `wait_fillable(b)`, and drops the slice before
    /// `publish(b)`.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn begin_fill(&self, b: u64) -> &mut [u8] {
        let s = self.slot_of(b);
        self.a64(self.slot_base(s) + S_SEQ)
            .store(b, Ordering::Relaxed);
        self.a32(self.slot_base(s) + S_WORD)
            .store(slot_word(b, FILLING), Ordering::Release);
        let size = self.geometry.slot_size as usize;
        // SAFETY: slot `s` lies within the ring's mapping, and the caller holds it alone until
        // `publish(b)` (see above).
        unsafe { std::slice::from_raw_parts_mut(self.ring.ptr().add(s * size), size) }
    }

    /// Publishes batch `b` (its slot READY) and wakes the consumers waiting for it.
    pub fn publish(&self, b: u64, used: u64) {
        let base = self.slot_base(self.slot_of(b));
        self.a64(base + S_USED).store(used, Ordering::Relaxed);
        self.a32(base + S_WORD)
            .store(slot_word(b, READY), Ordering::Release);
        self.a64(C_PRODUCED).store(b + 1, Ordering::Release);
        futex::wake_all(self.a32(base + S_WORD));
    }

    // ---- consumers ----

    /// The next batch to process, or that the pass is over. The counter carries the pass's
    /// generation in its high half, and the pass's batch count is read with the generation in
    /// one word: a consumer still taking tickets of an ended pass (after the owner started the
    /// next) gets `PassOver` for it, never a batch of the new pass that another also takes.
    pub fn take_ticket(&self) -> Ticket {
        let word = self.a64(C_NEXT_TICKET).fetch_add(1, Ordering::AcqRel);
        let (generation, t) = ((word >> 32) as u32, word & u64::from(u32::MAX));
        let tickets = self.a64(C_PASS_TICKETS).load(Ordering::Acquire);
        if (tickets >> 32) as u32 == generation && t < tickets & u64::from(u32::MAX) {
            Ticket::Batch(t)
        } else {
            Ticket::PassOver(generation)
        }
    }

    /// Waits up to `timeout` for batch `t` to be READY and takes it (TAKEN). `Ok(false)`: not yet.
    /// Errors: stopped, the owner gone (children), or a producer error at or before `t`.
    pub fn wait_ready(
        &self,
        t: u64,
        timeout: Duration,
        role: Role,
        consumer: Option<usize>,
    ) -> Result<bool> {
        let word = self.word(t);
        let ready = slot_word(t, READY);
        let deadline = Instant::now() + timeout;
        loop {
            let seen = word.load(Ordering::Acquire);
            if seen == ready {
                if word
                    .compare_exchange(
                        ready,
                        slot_word(t, TAKEN),
                        Ordering::AcqRel,
                        Ordering::Acquire,
                    )
                    .is_ok()
                {
                    let base = self.slot_base(self.slot_of(t));
                    // SAFETY: getpid cannot fail.
                    self.a64(base + S_HOLDER)
                        .store(unsafe { libc::getpid() } as u64, Ordering::Relaxed);
                    if let Some(i) = consumer {
                        self.a64(self.consumer_base(i) + P_TICKET)
                            .store(t, Ordering::Relaxed);
                    }
                    return Ok(true);
                }
                return Err(ShmError::Protocol(format!(
                    "batch {t} was taken by another consumer"
                )));
            }
            self.check_live(role)?;
            if let Some(RecordedError {
                kind,
                errno,
                batch,
                text,
            }) = self.error()
            {
                if batch <= t {
                    return Err(ShmError::ProducerFailed {
                        kind,
                        errno,
                        batch,
                        text,
                    });
                }
            }
            if let Some(i) = consumer {
                self.heartbeat(Party::Consumer(i));
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            futex::wait(word, seen, (deadline - now).min(self.poll));
        }
    }

    /// The bytes of batch `t`'s slot (valid while the caller holds it TAKEN).
    pub fn slot(&self, t: u64) -> &[u8] {
        let size = self.geometry.slot_size as usize;
        // SAFETY: in range; the producer does not write a TAKEN slot.
        unsafe { std::slice::from_raw_parts(self.ring.ptr().add(self.slot_of(t) * size), size) }
    }

    /// Offset of batch `t`'s slot in the ring segment.
    pub fn slot_offset(&self, t: u64) -> u64 {
        self.slot_of(t) as u64 * self.geometry.slot_size
    }

    /// Gives batch `t`'s slot back to the producer.
    pub fn release(&self, t: u64, consumer: Option<usize>) -> Result<()> {
        let word = self.word(t);
        word.compare_exchange(
            slot_word(t, TAKEN),
            slot_word(t, FREE),
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .map_err(|w| {
            ShmError::Protocol(format!(
                "release of batch {t}: its slot word is {w:#x}, not TAKEN"
            ))
        })?;
        if let Some(i) = consumer {
            self.a64(self.consumer_base(i) + P_TICKET)
                .store(u64::MAX, Ordering::Relaxed);
        }
        let wake = self.a32(C_PRODUCER_WAKE);
        wake.fetch_add(1, Ordering::AcqRel);
        futex::wake_all(wake);
        futex::wake_all(word);
        Ok(())
    }

    // ---- the training loop ----

    /// Records that the training loop received batch `seq` (which must be the next one) and moves
    /// the iterator state to `position`, the global position after it (the loader computes it).
    pub fn mark_delivered(&self, seq: u64, position: u64) -> Result<()> {
        let delivered = self.delivered();
        if seq != delivered {
            return Err(ShmError::Protocol(format!(
                "batch {seq} delivered out of order: expected {delivered}"
            )));
        }
        self.a64(C_POSITION).store(position, Ordering::Release);
        self.a64(C_DELIVERED).store(seq + 1, Ordering::Release);
        let wake = self.a32(C_PRODUCER_WAKE);
        wake.fetch_add(1, Ordering::AcqRel);
        futex::wake_all(wake);
        Ok(())
    }
}

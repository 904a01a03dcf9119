//! The iterator's epochs and passes: the one state machine behind `Dataset` iteration and the
//! shared-memory loader's plan. A pass reads one epoch from a global position; the state is
//! where the training loop got to: the loaded state until a pass starts, then the live pass's
//! progress, then the ended pass's. `set_epoch` and loading a state win over a pass planned
//! before them.
//!
//! ```text
//!   set_epoch(e) ──► next pass: (e, 0)
//!   load(e, p)   ──► next pass: (e, p)             state: (e, p)
//!   commit(pass) ──► state: the pass's progress    next pass: (epoch + 1, 0)
//!   end(pass)    ──► state: its last progress      next pass: (epoch + 1, 0)
//! ```
//! A finished pass (every sample of this rank received) leaves the state at the start of the
//! next epoch.

use crate::dataset::{next_epoch, resume_point};
use crate::{Error, Result};

/// Where a pass stands: its epoch, the global position reached in it, and whether every
/// sample of this rank was received.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    pub epoch: u64,
    pub position: u64,
    pub finished: bool,
}

impl Progress {
    /// Where this leaves the iterator, as (epoch, global position).
    pub fn resume_point(&self) -> Result<(u64, u64)> {
        resume_point(self.epoch, self.position, self.finished)
    }
}

/// A live pass that reports its progress: an in-process reader, or a loader's control segment.
pub trait LiveProgress {
    fn progress(&self) -> Progress;
}

impl<T: LiveProgress + ?Sized> LiveProgress for std::sync::Arc<T> {
    fn progress(&self) -> Progress {
        (**self).progress()
    }
}

/// Where the next pass starts, and the generation of the state machine it was planned under
/// (see [`Passes::commit`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PassStart {
    pub epoch: u64,
    pub start: u64,
    pub generation: u64,
}

/// The state to report: (epoch, global position), and the weight table the position belongs
/// to (`None`: the table in force, for a position at the start of an epoch not begun).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub epoch: u64,
    pub position: u64,
    pub weights_fingerprint: Option<String>,
}

#[derive(Clone, Debug)]
struct Resume {
    epoch: u64,
    position: u64,
    weights_fingerprint: String,
}

struct Live<P> {
    pass: P,
    epoch: u64,
    weights_fingerprint: String,
}

struct Ended {
    progress: Progress,
    weights_fingerprint: String,
}

/// The epoch/pass/resume state machine, over live passes of type `P`.
pub struct Passes<P> {
    /// The epoch of the next pass while no pass was committed since `set_epoch` (or creation).
    next_epoch: u64,
    resume: Option<Resume>,
    live: Option<Live<P>>,
    ended: Option<Ended>,
    /// Bumped by `set_epoch` and `load`: a pass planned before either does not commit.
    generation: u64,
}

impl<P> Default for Passes<P> {
    fn default() -> Self {
        Passes {
            next_epoch: 0,
            resume: None,
            live: None,
            ended: None,
            generation: 0,
        }
    }
}

impl<P: LiveProgress> Passes<P> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Fixes the epoch of the next pass; the state now describes that epoch's start (a loaded
    /// state's position and the last pass's progress are dropped).
    pub fn set_epoch(&mut self, epoch: u64) {
        self.next_epoch = epoch;
        self.resume = None;
        self.live = None;
        self.ended = None;
        self.generation += 1;
    }

    /// Makes the next pass resume at global `position` of `epoch`, a state checked against the
    /// dataset and taken under the weight table `weights_fingerprint`.
    pub fn load(&mut self, epoch: u64, position: u64, weights_fingerprint: String) {
        self.resume = Some(Resume {
            epoch,
            position,
            weights_fingerprint,
        });
        self.next_epoch = epoch;
        self.generation += 1;
    }

    /// Where the next pass starts, read under the weight table in force: a loaded state's
    /// position (refused when the weights changed since it was loaded: its position points
    /// into another order), else the epoch after the last pass, else the chosen epoch's start.
    pub fn next_pass(&self, weights_in_force: &str) -> Result<PassStart> {
        if let Some(r) = self
            .resume
            .as_ref()
            .filter(|r| r.weights_fingerprint != weights_in_force)
        {
            return Err(Error::State(format!(
                "the loaded state (epoch {}, position {}) was taken under weight table {}, but \
                 set_samples_metadata has since put {weights_in_force} in force: apply the \
                 state's weights again to resume it, or call set_epoch to start a new epoch \
                 instead",
                r.epoch, r.position, r.weights_fingerprint
            )));
        }
        let (epoch, start) = self.next_start()?;
        Ok(PassStart {
            epoch,
            start,
            generation: self.generation,
        })
    }

    /// The epoch the next pass reads: a loaded state's, else the one after the last pass,
    /// else the chosen one. A pass left early does not read its epoch again: `set_epoch` does.
    pub fn next_pass_epoch(&self) -> Result<u64> {
        Ok(self.next_start()?.0)
    }

    /// Where the next pass starts, as (epoch, global position).
    fn next_start(&self) -> Result<(u64, u64)> {
        Ok(match (&self.resume, &self.live, &self.ended) {
            (Some(r), _, _) => (r.epoch, r.position),
            (None, Some(live), _) => (next_epoch(live.epoch)?, 0),
            (None, None, Some(ended)) => (next_epoch(ended.progress.epoch)?, 0),
            (None, None, None) => (self.next_epoch, 0),
        })
    }

    /// Makes `pass`, started at `start` under the weight table `weights_fingerprint`, the live
    /// one: the state reads its progress, a loaded state is used up and the next pass reads
    /// the next epoch. A `set_epoch` or `load` since `start` was planned wins: nothing changes
    /// and `false` is returned.
    pub fn commit(&mut self, start: PassStart, pass: P, weights_fingerprint: String) -> bool {
        if start.generation != self.generation {
            return false;
        }
        self.resume = None;
        self.live = Some(Live {
            pass,
            epoch: start.epoch,
            weights_fingerprint,
        });
        self.ended = None;
        true
    }

    /// The live pass.
    pub fn live(&self) -> Option<&P> {
        self.live.as_ref().map(|l| &l.pass)
    }

    /// Ends the live pass if `is_it` says it is the one meant: its last progress is kept for
    /// the state, and the pass is dropped. Returns whether it ended.
    pub fn end_if(&mut self, is_it: impl FnOnce(&P) -> bool) -> bool {
        if !self.live.as_ref().is_some_and(|l| is_it(&l.pass)) {
            return false;
        }
        let live = self.live.take().expect("checked above");
        self.ended = Some(Ended {
            progress: live.pass.progress(),
            weights_fingerprint: live.weights_fingerprint,
        });
        true
    }

    /// The state the training loop reached. A position inside a pass belongs to that pass's
    /// order, and so to its weights; the start of a pass not begun reads under the weights in
    /// force.
    pub fn snapshot(&self) -> Result<Snapshot> {
        if let Some(r) = &self.resume {
            return Ok(Snapshot {
                epoch: r.epoch,
                position: r.position,
                weights_fingerprint: Some(r.weights_fingerprint.clone()),
            });
        }
        let (progress, fingerprint) = match (&self.live, &self.ended) {
            (Some(live), _) => (live.pass.progress(), &live.weights_fingerprint),
            (None, Some(ended)) => (ended.progress, &ended.weights_fingerprint),
            (None, None) => {
                return Ok(Snapshot {
                    epoch: self.next_epoch,
                    position: 0,
                    weights_fingerprint: None,
                })
            }
        };
        let (epoch, position) = progress.resume_point()?;
        Ok(Snapshot {
            epoch,
            position,
            weights_fingerprint: (!progress.finished).then(|| fingerprint.clone()),
        })
    }
}

#[cfg(test)]
mod tests {
    use std::cell::Cell;
    use std::rc::Rc;

    use proptest::prelude::*;

    use super::*;
    use crate::dataset::LAST_EPOCH;

    /// A pass whose progress the test moves.
    type Fake = Rc<Cell<Progress>>;

    impl LiveProgress for Fake {
        fn progress(&self) -> Progress {
            self.get()
        }
    }

    fn at(epoch: u64, position: u64, finished: bool) -> Fake {
        Rc::new(Cell::new(Progress {
            epoch,
            position,
            finished,
        }))
    }

    /// Plans and commits the next pass; returns it at its start.
    fn start(passes: &mut Passes<Fake>, weights: &str) -> (PassStart, Fake) {
        let s = passes.next_pass(weights).unwrap();
        let pass = at(s.epoch, s.start, false);
        assert!(passes.commit(s, pass.clone(), weights.into()));
        (s, pass)
    }

    fn snapshot(passes: &Passes<Fake>) -> (u64, u64, Option<String>) {
        let s = passes.snapshot().unwrap();
        (s.epoch, s.position, s.weights_fingerprint)
    }

    #[test]
    fn a_fresh_machine_starts_epoch_0() {
        let passes = Passes::<Fake>::new();
        let s = passes.next_pass("uniform").unwrap();
        assert_eq!((s.epoch, s.start), (0, 0));
        assert_eq!(snapshot(&passes), (0, 0, None));
    }

    #[test]
    fn passes_follow_epochs_and_the_state_follows_the_live_pass() {
        let mut passes = Passes::new();
        passes.set_epoch(5);
        let (s, pass) = start(&mut passes, "w");
        assert_eq!((s.epoch, s.start), (5, 0));
        pass.set(Progress {
            epoch: 5,
            position: 7,
            finished: false,
        });
        assert_eq!(snapshot(&passes), (5, 7, Some("w".into())));
        // The next pass reads the next epoch, whether or not this one finished.
        assert_eq!(passes.next_pass("w").unwrap().epoch, 6);
        pass.set(Progress {
            epoch: 5,
            position: 10,
            finished: true,
        });
        // A finished pass leaves the state at the next epoch's start, under the weights in force.
        assert_eq!(snapshot(&passes), (6, 0, None));
    }

    #[test]
    fn the_next_pass_epoch_is_a_loaded_states_else_the_one_after_the_last_pass() {
        let mut passes = Passes::new();
        assert_eq!(passes.next_pass_epoch().unwrap(), 0);
        // A pass of epoch 0 left early: the state is inside epoch 0, the next pass reads 1.
        let (_, pass) = start(&mut passes, "w");
        pass.set(Progress {
            epoch: 0,
            position: 4,
            finished: false,
        });
        assert!(passes.end_if(|p| Rc::ptr_eq(p, &pass)));
        assert_eq!(snapshot(&passes).0, 0);
        assert_eq!(passes.next_pass_epoch().unwrap(), 1);
        // A state loaded in epoch 3 is where the next pass starts.
        passes.load(3, 9, "w".into());
        assert_eq!(passes.next_pass_epoch().unwrap(), 3);
        assert_eq!(passes.next_pass("w").unwrap().start, 9);
        passes.set_epoch(7);
        assert_eq!(passes.next_pass_epoch().unwrap(), 7);
    }

    #[test]
    fn an_ended_pass_keeps_its_last_progress() {
        let mut passes = Passes::new();
        let (_, pass) = start(&mut passes, "w");
        pass.set(Progress {
            epoch: 0,
            position: 3,
            finished: false,
        });
        let other = at(0, 0, false);
        assert!(
            !passes.end_if(|p| Rc::ptr_eq(p, &other)),
            "not the live pass"
        );
        assert!(passes.end_if(|p| Rc::ptr_eq(p, &pass)));
        assert!(passes.live().is_none());
        pass.set(Progress {
            epoch: 0,
            position: 9,
            finished: true,
        });
        assert_eq!(snapshot(&passes), (0, 3, Some("w".into())));
        assert_eq!(passes.next_pass("w").unwrap().epoch, 1);
    }

    #[test]
    fn a_loaded_state_is_the_next_pass_until_one_commits() {
        let mut passes = Passes::new();
        let (_, pass) = start(&mut passes, "w");
        pass.set(Progress {
            epoch: 0,
            position: 4,
            finished: false,
        });
        passes.load(8, 2, "w".into());
        assert_eq!(snapshot(&passes), (8, 2, Some("w".into())));
        let (s, _) = start(&mut passes, "w");
        assert_eq!((s.epoch, s.start), (8, 2));
        assert_eq!(
            passes.next_pass("w").unwrap().epoch,
            9,
            "the state was used up"
        );
    }

    #[test]
    fn a_loaded_state_is_refused_under_other_weights() {
        let mut passes = Passes::<Fake>::new();
        passes.load(1, 2, "uniform".into());
        let err = passes.next_pass("weighted").unwrap_err().to_string();
        assert!(err.contains("set_samples_metadata"), "{err}");
        passes.set_epoch(1);
        assert_eq!(passes.next_pass("weighted").unwrap().start, 0);
    }

    #[test]
    fn set_epoch_and_load_win_over_a_pass_planned_before_them() {
        for change in [
            |p: &mut Passes<Fake>| p.set_epoch(4),
            |p: &mut Passes<Fake>| p.load(4, 0, "w".into()),
        ] {
            let mut passes = Passes::new();
            let planned = passes.next_pass("w").unwrap();
            change(&mut passes);
            assert!(!passes.commit(planned, at(0, 0, false), "w".into()));
            assert!(passes.live().is_none());
            assert_eq!(snapshot(&passes).0, 4);
        }
    }

    #[test]
    fn no_epoch_follows_the_last() {
        let mut passes = Passes::new();
        passes.set_epoch(LAST_EPOCH);
        let (_, pass) = start(&mut passes, "w");
        assert!(passes.next_pass("w").is_err());
        pass.set(Progress {
            epoch: LAST_EPOCH,
            position: 1,
            finished: true,
        });
        assert!(passes.snapshot().is_err());
    }

    proptest! {
        /// A pass from any start, stopped at any position, resumes (through a state loaded
        /// into a fresh machine) at the exact rest of its epoch, or at the next epoch's start
        /// once finished: no position is read twice or skipped.
        #[test]
        fn resume_at_any_position_gives_the_rest_of_the_epoch(
            epoch in 0..LAST_EPOCH,
            len in 0u64..1000,
            start_frac in 0.0..=1.0f64,
            stop_frac in 0.0..=1.0f64,
        ) {
            let start_at = (len as f64 * start_frac) as u64;
            let stop_at = start_at + ((len - start_at) as f64 * stop_frac) as u64;
            let mut passes = Passes::new();
            passes.load(epoch, start_at, "w".into());
            let (s, pass) = start(&mut passes, "w");
            prop_assert_eq!((s.epoch, s.start), (epoch, start_at));
            let mut read: Vec<(u64, u64)> = (start_at..stop_at).map(|p| (epoch, p)).collect();
            pass.set(Progress { epoch, position: stop_at, finished: stop_at == len });

            let snap = passes.snapshot().unwrap();
            let mut resumed = Passes::<Fake>::new();
            resumed.load(snap.epoch, snap.position, snap.weights_fingerprint.unwrap_or("w".into()));
            let next = resumed.next_pass("w").unwrap();
            if next.epoch == epoch {
                read.extend((next.start..len).map(|p| (epoch, p)));
            } else {
                prop_assert_eq!((next.epoch, next.start), (epoch + 1, 0));
                prop_assert_eq!(stop_at, len);
            }
            let whole: Vec<(u64, u64)> = (start_at..len).map(|p| (epoch, p)).collect();
            prop_assert_eq!(read, whole);
        }
    }
}

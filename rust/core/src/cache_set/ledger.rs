//! What became of each part of a set being built, whoever wrote it (this process, worker
//! processes, Ray tasks), and the one decision it leads to: publish the set when every part is
//! published, else keep the published parts for the next build and say which failed.

use std::path::PathBuf;

use super::{CacheSet, PartState, SetBuild};
use crate::cache::Validation;
use crate::error::Result;

/// What became of one part in a build.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PartResult {
    /// Published before this build (kept), or by another writer meanwhile: its samples.
    Loaded(u64),
    /// Written by this build: its samples.
    Written(u64),
    /// Its writer failed: why.
    Failed(String),
    /// Published but failing validation: why (it is never overwritten).
    Malformed(String),
}

impl PartResult {
    /// A part's result as its writer reports it (`write_part`'s kind, message and samples):
    /// `"written"`, `"loaded"`, and anything else is a failure.
    pub fn from_report(kind: &str, message: Option<String>, samples: u64) -> PartResult {
        match kind {
            "written" => PartResult::Written(samples),
            "loaded" => PartResult::Loaded(samples),
            _ => PartResult::Failed(message.unwrap_or_else(|| "the part failed".into())),
        }
    }

    /// Whether the part is published (kept or written).
    pub fn is_published(&self) -> bool {
        matches!(self, PartResult::Loaded(_) | PartResult::Written(_))
    }
}

/// One part's outcome once the build is over: where the part now is (in the published set, or
/// in the staging directory when the set was not published) and what became of it. A malformed
/// part's message says how to have it written again.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartOutcome {
    pub name: String,
    pub path: PathBuf,
    pub result: PartResult,
}

/// How a build ended: each part's outcome, in order, and the set, published or not (and why).
pub struct SetConclusion {
    pub parts: Vec<PartOutcome>,
    pub set: std::result::Result<CacheSet, String>,
}

/// The parts of a set being built, as found in its staging directory and as their writers
/// report them.
#[derive(Debug)]
pub struct SetLedger {
    parts: Vec<Option<PartResult>>,
}

impl SetLedger {
    /// The parts as the staging directory holds them now: published ones are kept, malformed
    /// ones recorded, missing ones are still to be written.
    pub fn new(build: &SetBuild, validation: Validation) -> Result<SetLedger> {
        let parts = build
            .part_states(validation)?
            .into_iter()
            .map(|state| match state {
                PartState::Published(cache) => Some(PartResult::Loaded(cache.len())),
                PartState::Missing => None,
                PartState::Malformed(reason) => Some(PartResult::Malformed(reason)),
            })
            .collect();
        Ok(SetLedger { parts })
    }

    pub fn len(&self) -> usize {
        self.parts.len()
    }

    pub fn is_empty(&self) -> bool {
        self.parts.is_empty()
    }

    /// The parts still to be written, in order.
    pub fn missing(&self) -> Vec<usize> {
        (0..self.parts.len())
            .filter(|&i| self.parts[i].is_none())
            .collect()
    }

    /// The parts published so far.
    pub fn published(&self) -> usize {
        self.parts
            .iter()
            .filter(|p| p.as_ref().is_some_and(PartResult::is_published))
            .count()
    }

    /// Records what became of part `index`; an index beyond the set is ignored.
    pub fn record(&mut self, index: usize, result: PartResult) {
        if let Some(slot) = self.parts.get_mut(index) {
            *slot = Some(result);
        }
    }

    /// Ends the build: publishes the set when every part is published (the publication
    /// re-validates them), else releases the set's lock, keeping the published parts in the
    /// staging directory for the next build. A part nobody reported is a failure.
    pub fn conclude(self, build: SetBuild, validation: Validation) -> SetConclusion {
        let results: Vec<PartResult> = self
            .parts
            .into_iter()
            .map(|p| p.unwrap_or_else(|| PartResult::Failed("the part was not written".into())))
            .collect();
        let staging = build.staging().to_owned();
        let final_dir = build.final_dir();
        let set_name = build.name().to_owned();
        let names: Vec<String> = (0..results.len()).map(|i| build.part_name(i)).collect();
        let set = if results.iter().all(PartResult::is_published) {
            build.publish(validation).map_err(|e| e.to_string())
        } else {
            drop(build);
            let failed: Vec<String> = results
                .iter()
                .enumerate()
                .filter(|(_, p)| !p.is_published())
                .map(|(i, _)| i.to_string())
                .collect();
            let kept = results.len() - failed.len();
            let malformed = results
                .iter()
                .any(|p| matches!(p, PartResult::Malformed(_)));
            let which = match failed.len() {
                1 => format!(
                    "1 of its {} parts failed (part {})",
                    results.len(),
                    failed[0]
                ),
                n => format!(
                    "{n} of its {} parts failed (parts {})",
                    results.len(),
                    failed.join(", ")
                ),
            };
            let kept = match kept {
                0 => "no part is published yet".to_owned(),
                1 => format!("the 1 published part is kept in {}", staging.display()),
                n => format!("the {n} published parts are kept in {}", staging.display()),
            };
            let next = if malformed {
                "remove the malformed parts (see their results): the next build writes them \
                 and the missing ones"
            } else {
                "the next build writes only the missing ones"
            };
            Err(format!(
                "cache set {set_name:?} was not published: {which}; {kept}, and {next}"
            ))
        };
        let home = if set.is_ok() { &final_dir } else { &staging };
        let parts = results
            .into_iter()
            .zip(names)
            .map(|(result, name)| {
                let path = home.join(&name);
                let result = match result {
                    PartResult::Malformed(msg) => PartResult::Malformed(format!(
                        "{msg}; a published part is never overwritten: remove {} and build the \
                         set again to write it",
                        path.display()
                    )),
                    other => other,
                };
                PartOutcome { name, path, result }
            })
            .collect();
        SetConclusion { parts, set }
    }
}

//! The verification policy of reads, and the per-process record of the records already verified.

use std::sync::atomic::{AtomicU64, Ordering};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// When a record's checksum is computed as it is read (`ReaderConfig.verify`). The structural
/// checks (the record header against the index, lengths within the shard, the bound on what an
/// LZ4 payload may decode to) run on every read under every policy: they are what keeps reading
/// and decoding a damaged record safe, and they cost no hashing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum VerifyPolicy {
    /// Every read hashes the record.
    Always,
    /// A record is hashed the first time this process reads it; later reads skip the hash.
    /// `ReaderConfig`'s default: from the second epoch on it reads as fast as `Never`.
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

/// One bit per sample: set once the sample's record has passed its checksum in this process.
/// Shared by every reader of a dataset (and by their pool threads) without a lock.
pub struct VerifiedSet {
    words: Box<[AtomicU64]>,
    len: u64,
}

impl VerifiedSet {
    /// An empty set for samples `0..len`: `len / 8` bytes, rounded up to whole words.
    pub fn new(len: u64) -> Self {
        let words = len.div_ceil(64) as usize;
        VerifiedSet {
            words: (0..words).map(|_| AtomicU64::new(0)).collect(),
            len,
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
        self.words[(sample / 64) as usize].load(Ordering::Acquire) & bit != 0
    }

    /// Marks `sample` as verified. Call only after its checksum matched.
    pub fn mark(&self, sample: u64) {
        debug_assert!(sample < self.len);
        let bit = 1u64 << (sample % 64);
        self.words[(sample / 64) as usize].fetch_or(bit, Ordering::Release);
    }

    /// Samples marked so far.
    pub fn count(&self) -> u64 {
        self.words
            .iter()
            .map(|w| u64::from(w.load(Ordering::Relaxed).count_ones()))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
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
            assert_eq!(set.words.len() as u64, len.div_ceil(64));
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

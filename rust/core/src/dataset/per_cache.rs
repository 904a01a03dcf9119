//! The planner's backend for a dataset with a fetched cache (object storage): each range goes
//! to its cache's own record source, or to the local-file backend for a local cache (none on
//! the plain path, where local records are not planned for).

use std::sync::Arc;

use super::local_files::LocalFiles;
use super::planner::{Range, RangeSource, RecordSource};
use crate::cache::Cache;

pub(super) struct PerCache {
    local: Option<LocalFiles>,
    /// By cache: its record source when it is fetched.
    fetched: Vec<Option<Arc<dyn RecordSource>>>,
}

impl PerCache {
    pub(super) fn new(caches: &[Arc<Cache>], local: Option<LocalFiles>) -> Self {
        PerCache {
            local,
            fetched: caches.iter().map(|c| c.records().cloned()).collect(),
        }
    }

    fn source(&self, cache: u32) -> Option<&dyn RangeSource> {
        match self.fetched.get(cache as usize) {
            Some(Some(fetched)) => Some(fetched.as_ref() as &dyn RangeSource),
            _ => self.local.as_ref().map(|l| l as &dyn RangeSource),
        }
    }

    /// Calls `each` with every run of `ranges` of one cache, and that cache's backend.
    fn split(&self, ranges: &[Range], each: impl Fn(&dyn RangeSource, &[Range])) {
        let mut at = 0;
        while at < ranges.len() {
            let cache = ranges[at].cache;
            let run = ranges[at..].iter().take_while(|r| r.cache == cache).count();
            if let Some(source) = self.source(cache) {
                each(source, &ranges[at..at + run]);
            }
            at += run;
        }
    }
}

impl RangeSource for PerCache {
    fn name(&self) -> &'static str {
        "per-cache"
    }

    fn begin_pass(&self, shuffled: bool) {
        if let Some(local) = &self.local {
            local.begin_pass(shuffled);
        }
        for fetched in self.fetched.iter().flatten() {
            fetched.begin_pass(shuffled);
        }
    }

    fn resident(&self, range: &Range) -> bool {
        // A local cache on the plain path is read as it comes: resident as far as planning goes.
        self.source(range.cache).is_none_or(|s| s.resident(range))
    }

    fn start(&self, ranges: &[Range]) {
        self.split(ranges, |source, run| source.start(run));
    }

    fn release(&self, ranges: &[Range]) {
        self.split(ranges, |source, run| source.release(run));
    }

    fn foresight(&self) -> u64 {
        let local = self.local.as_ref().map_or(0, RangeSource::foresight);
        self.fetched
            .iter()
            .flatten()
            .map(|f| f.foresight())
            .fold(local, u64::max)
    }

    /// Each fetched cache is told its own records (none: nothing of it is needed soon).
    fn foresee(&self, upcoming: &[(u64, Range)]) {
        let mut of_cache = Vec::new();
        for (c, fetched) in self.fetched.iter().enumerate() {
            let Some(fetched) = fetched.as_ref().filter(|f| f.foresight() > 0) else {
                continue;
            };
            of_cache.clear();
            of_cache.extend(upcoming.iter().filter(|(_, r)| r.cache as usize == c));
            fetched.foresee(&of_cache);
        }
    }

    fn reached(&self, position: u64) {
        for fetched in self.fetched.iter().flatten() {
            fetched.reached(position);
        }
    }
}

//! The read planner's backend for caches on a local file system: kernel advice on the shards'
//! pages. The reading threads still read the records from the shards' maps (zero-copy views
//! where they are views today); the advice only has the kernel read the upcoming records into
//! the page cache before the threads fault on them, many at once.
//!
//! - `posix_fadvise(POSIX_FADV_WILLNEED)` on each upcoming record's byte range (or
//!   `madvise(MADV_WILLNEED)` on its pages of the map: the same read in the kernel, under the
//!   map's lock), `io_depth` records ahead;
//! - `madvise(MADV_RANDOM)` on the shard maps of a shuffled pass: a fault then reads its page,
//!   not the device's whole `read_ahead_kb` around it (8 MiB on some virtual disks), most of
//!   which a shuffled pass never reads; a pass in order gets `MADV_NORMAL` back;
//! - `mincore` as the residency probe, so warm data is neither advised nor slowed.
//!
//! `DATASET_RT_IO` chooses the path once per process ([`io_path`]), with one `log::debug!`
//! line saying which: `plain` turns the planner off (the threads fault the maps in, as before
//! it); `fadvise` (the default) and `madvise` choose the advice; `fadvise-readaround` and
//! `madvise-readaround` leave the maps' read-around alone (for measurements).

use std::os::fd::AsRawFd;
use std::sync::{Arc, OnceLock};

use crate::cache::Cache;

use super::planner::{Range, RangeSource};

/// How reads of local files get their depth.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IoPath {
    /// No planner: each read is a fault on a map, taken by a reading thread.
    Plain,
    /// Kernel advice on the upcoming records; `random`: `MADV_RANDOM` on shuffled passes' maps.
    Advise { how: WillNeed, random: bool },
}

/// Which call asks the kernel to read a record ahead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WillNeed {
    /// `posix_fadvise(fd, offset, len, POSIX_FADV_WILLNEED)` on the shard's file.
    Fadvise,
    /// `madvise(addr, len, MADV_WILLNEED)` on the record's pages of the shard's map.
    Madvise,
}

/// The environment variable that chooses the [`IoPath`].
pub const IO_ENV: &str = "DATASET_RT_IO";

/// The default path (chosen by `bench/bench_cold.py`: see docs/runtime-model.md).
pub const DEFAULT_IO_PATH: IoPath = IoPath::Advise {
    how: WillNeed::Fadvise,
    random: true,
};

impl IoPath {
    /// The path a value of [`IO_ENV`] names (`None` or empty: the default); an unknown value is
    /// an error that lists the known ones.
    pub fn parse(value: Option<&str>) -> Result<IoPath, String> {
        let advise = |how, random| IoPath::Advise { how, random };
        match value.map(str::trim) {
            None | Some("") | Some("auto") => Ok(DEFAULT_IO_PATH),
            Some("plain") => Ok(IoPath::Plain),
            Some("fadvise") => Ok(advise(WillNeed::Fadvise, true)),
            Some("madvise") => Ok(advise(WillNeed::Madvise, true)),
            Some("fadvise-readaround") => Ok(advise(WillNeed::Fadvise, false)),
            Some("madvise-readaround") => Ok(advise(WillNeed::Madvise, false)),
            Some(other) => Err(format!(
                "{IO_ENV}={other:?} is not one of plain, fadvise, madvise, fadvise-readaround, \
                 madvise-readaround, auto"
            )),
        }
    }

    /// What the debug log says of this path.
    pub fn describe(&self) -> &'static str {
        match self {
            IoPath::Plain => "plain: no read planner, each read faults the map in",
            IoPath::Advise {
                how: WillNeed::Fadvise,
                random: true,
            } => "read planner with posix_fadvise(WILLNEED) ahead, MADV_RANDOM on shuffled maps",
            IoPath::Advise {
                how: WillNeed::Madvise,
                random: true,
            } => "read planner with madvise(WILLNEED) ahead, MADV_RANDOM on shuffled maps",
            IoPath::Advise {
                how: WillNeed::Fadvise,
                random: false,
            } => "read planner with posix_fadvise(WILLNEED) ahead, the maps' read-around kept",
            IoPath::Advise {
                how: WillNeed::Madvise,
                random: false,
            } => "read planner with madvise(WILLNEED) ahead, the maps' read-around kept",
        }
    }
}

/// The path [`IO_ENV`] chooses, read once per process; the choice is logged once
/// (`log::debug!`), and an unknown value falls back to the default with its reason.
pub fn io_path() -> IoPath {
    static PATH: OnceLock<IoPath> = OnceLock::new();
    *PATH.get_or_init(|| {
        let value = std::env::var(IO_ENV).ok();
        let path = IoPath::parse(value.as_deref());
        match &path {
            Ok(p) => log::debug!("dataset_rt reads: {} ({IO_ENV}={value:?})", p.describe()),
            Err(why) => log::debug!("dataset_rt reads: {} ({why})", DEFAULT_IO_PATH.describe()),
        }
        path.unwrap_or(DEFAULT_IO_PATH)
    })
}

/// Kernel advice on the shards of a dataset's caches (in the dataset's order).
pub struct LocalFiles {
    caches: Vec<Arc<Cache>>,
    how: WillNeed,
    random: bool,
}

/// Pages `mincore` reports on at a time.
const PROBE_PAGES: usize = 64;

/// Records of one shard this close are advised as one range (the gap is read too): a pass in
/// order then costs one call per chunk, not one per record.
const COALESCE_GAP: u64 = 4096;

/// Calls `f` with `ranges` in order, each run of ranges of one shard that follow each other
/// within [`COALESCE_GAP`] merged into one.
fn for_each_coalesced(ranges: &[Range], mut f: impl FnMut(&Range)) {
    let mut run: Option<Range> = None;
    for next in ranges {
        match &mut run {
            Some(last)
                if next.cache == last.cache
                    && next.shard == last.shard
                    && next.offset >= last.offset
                    && next.offset <= last.end().saturating_add(COALESCE_GAP) =>
            {
                last.len = next.end().max(last.end()) - last.offset;
            }
            _ => {
                if let Some(last) = run.replace(*next) {
                    f(&last);
                }
            }
        }
    }
    if let Some(last) = run {
        f(&last);
    }
}

impl LocalFiles {
    pub fn new(caches: Vec<Arc<Cache>>, how: WillNeed, random: bool) -> Self {
        LocalFiles {
            caches,
            how,
            random,
        }
    }

    /// The map of the range's shard and the range clamped to it, page-aligned at its start:
    /// (map, first byte, bytes). `None` when it names no shard or nothing of it.
    fn span<'a>(&'a self, r: &Range) -> Option<(&'a [u8], usize, usize)> {
        let cache = self.caches.get(r.cache as usize)?;
        if r.shard as usize >= cache.num_shards() {
            return None;
        }
        let map = cache.shard_bytes(r.shard);
        let end = r.end().min(map.len() as u64);
        let start = r.offset - r.offset % crate::os::page();
        if start >= end {
            return None;
        }
        Some((map, start as usize, (end - start) as usize))
    }

    /// Sets the read-around advice of every shard map.
    fn advise_maps(&self, advice: libc::c_int) {
        for cache in &self.caches {
            for shard in 0..cache.num_shards() as u32 {
                let map = cache.shard_bytes(shard);
                if map.is_empty() {
                    continue;
                }
                // SAFETY: the range is the whole of a live map (page-aligned at its start, as
                // every map is); MADV_RANDOM and MADV_NORMAL change only how much the kernel
                // reads around a fault, never the map's contents. A failure is harmless: reads
                // stay correct, only their read-around is not changed.
                unsafe {
                    libc::madvise(map.as_ptr() as *mut libc::c_void, map.len(), advice);
                }
            }
        }
    }
}

impl RangeSource for LocalFiles {
    fn name(&self) -> &'static str {
        match self.how {
            WillNeed::Fadvise => "local files (posix_fadvise)",
            WillNeed::Madvise => "local files (madvise)",
        }
    }

    fn begin_pass(&self, shuffled: bool) {
        if self.random {
            self.advise_maps(if shuffled {
                libc::MADV_RANDOM
            } else {
                libc::MADV_NORMAL
            });
        }
    }

    fn resident(&self, r: &Range) -> bool {
        let Some((map, start, len)) = self.span(r) else {
            return true; // nothing to fetch
        };
        let page = crate::os::page() as usize;
        let mut pages = len.div_ceil(page);
        let mut at = start;
        let mut vec = [0u8; PROBE_PAGES];
        while pages > 0 {
            let n = pages.min(PROBE_PAGES);
            let bytes = (n * page).min(map.len() - at);
            // SAFETY: `at` is page-aligned and `at .. at + bytes` lies inside a live map;
            // mincore writes one byte per page of that range (at most `n`) into `vec`, which has
            // room for PROBE_PAGES. It reads no byte of the file and takes no fault.
            let rc = unsafe {
                libc::mincore(
                    map.as_ptr().add(at) as *mut libc::c_void,
                    bytes,
                    vec.as_mut_ptr(),
                )
            };
            if rc != 0 || vec[..bytes.div_ceil(page)].iter().any(|v| v & 1 == 0) {
                return false;
            }
            pages -= n;
            at += n * page;
        }
        true
    }

    fn start(&self, ranges: &[Range]) {
        for_each_coalesced(ranges, |r| {
            let Some((map, start, len)) = self.span(r) else {
                return;
            };
            match self.how {
                WillNeed::Fadvise => {
                    let file = self.caches[r.cache as usize].shard_file(r.shard);
                    // SAFETY: posix_fadvise only reads its arguments; the descriptor is the
                    // shard's, open for as long as its cache. A failure is harmless (a hint).
                    unsafe {
                        libc::posix_fadvise(
                            file.as_raw_fd(),
                            start as libc::off_t,
                            len as libc::off_t,
                            libc::POSIX_FADV_WILLNEED,
                        );
                    }
                }
                WillNeed::Madvise => {
                    // SAFETY: `start` is page-aligned and `start .. start + len` lies inside a
                    // live map; MADV_WILLNEED only starts reading the file's pages into the page
                    // cache, it changes no byte of the map. A failure is harmless (a hint).
                    unsafe {
                        libc::madvise(
                            map.as_ptr().add(start) as *mut libc::c_void,
                            len,
                            libc::MADV_WILLNEED,
                        );
                    }
                }
            }
        });
    }

    fn release(&self, _: &[Range]) {
        // The page cache owns what was read; nothing is held here.
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(shard: u32, offset: u64, len: u64) -> Range {
        Range {
            cache: 0,
            shard,
            offset,
            len,
        }
    }

    #[test]
    fn neighbours_of_a_shard_are_advised_as_one_range() {
        let mut got = Vec::new();
        let ranges = [
            at(0, 0, 100),
            at(0, 112, 100),
            at(0, 4000, 100),
            at(2, 0, 100),
            at(0, 1 << 20, 100),
            at(0, 0, 100),
        ];
        for_each_coalesced(&ranges, |r| got.push(*r));
        assert_eq!(
            got,
            [
                at(0, 0, 4100),
                at(2, 0, 100),
                at(0, 1 << 20, 100),
                at(0, 0, 100)
            ]
        );
    }

    #[test]
    fn the_environment_names_the_path() {
        assert_eq!(IoPath::parse(None), Ok(DEFAULT_IO_PATH));
        assert_eq!(IoPath::parse(Some("")), Ok(DEFAULT_IO_PATH));
        assert_eq!(IoPath::parse(Some("plain")), Ok(IoPath::Plain));
        assert_eq!(
            IoPath::parse(Some("madvise")),
            Ok(IoPath::Advise {
                how: WillNeed::Madvise,
                random: true
            })
        );
        assert_eq!(
            IoPath::parse(Some("fadvise-readaround")),
            Ok(IoPath::Advise {
                how: WillNeed::Fadvise,
                random: false
            })
        );
        let err = IoPath::parse(Some("uring")).unwrap_err();
        assert!(
            err.contains("DATASET_RT_IO") && err.contains("plain"),
            "{err}"
        );
    }
}

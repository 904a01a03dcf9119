//! The result arena of one loader worker: which bytes of its shared result memory a batch may
//! use, and when they may be used again.
//!
//! A worker writes the buffers of each result (arrays, tensors, bytes) into an arena, one
//! anonymous shared file (memfd) of a fixed capacity that the training process maps too. A
//! batch takes one or more page-aligned *ranges* of it and bump-allocates its buffers in them
//! (64-byte aligned). When the batch is sent, its ranges are trimmed to what it used and become
//! *busy*; a busy range is free again only when the training process says that nothing there
//! references it any more (`free`). So memory is never reused under a reader, and the worker
//! never waits for one: when no free range is big enough, `alloc` says so and the caller falls
//! back to sending that buffer in the message itself.
//!
//! Pages a batch wrote stay in the file when its range is freed, so that the next batch reuses
//! them without the kernel zeroing fresh ones. That is worth it for the few batches in flight,
//! not after a burst (a training loop that held many batches, then let them go): `free` says
//! which free pages to give back to the system (the caller removes them from the file) once
//! more written pages are free than the arena's warm batches (the batches a worker has in
//! flight: its loader's `prefetch_factor`, plus the one the loop holds) of the last batch's size.

use std::collections::BTreeMap;

use crate::{Result, ShmError};

/// Ranges start on page boundaries: the training process maps each one on its own.
pub const PAGE: u64 = 4096;
/// Alignment of every buffer inside a range (a cache line; enough for any dtype and SIMD).
pub const ALIGN: u64 = 64;
/// The smallest range a batch reserves.
pub const MIN_RANGE: u64 = 64 * 1024;
/// Free pages kept written (warm) for the next batches, in batches of the last one's size, unless
/// set with [`ResultArena::with_warm_batches`]: one for the batch a worker writes while its
/// previous one is still out, one more for jitter.
pub const WARM_BATCHES: u64 = 2;

fn round_up(n: u64, to: u64) -> u64 {
    n.div_ceil(to) * to
}

/// Where one allocation landed: the index of the batch's range, and the byte offset in the arena.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Alloc {
    pub range: usize,
    pub offset: u64,
}

#[derive(Debug)]
struct Reserved {
    offset: u64,
    len: u64,
    used: u64,
}

#[derive(Debug)]
pub struct ResultArena {
    capacity: u64,
    /// Free ranges, offset -> length, coalesced: no two touch.
    free: BTreeMap<u64, u64>,
    /// Ranges sent to the training process and not yet freed, offset -> length.
    busy: BTreeMap<u64, u64>,
    /// The ranges of the batch being written, in order.
    batch: Vec<Reserved>,
    /// Bytes the last finished batch used: the size of the next batch's first range.
    hint: u64,
    /// Page extents some batch may have written and that were not given back since, offset ->
    /// length, coalesced: the file's pages that hold memory (busy or free).
    resident: BTreeMap<u64, u64>,
    /// Free written pages kept, in batches of the last one's size (see `free`).
    warm_batches: u64,
}

impl ResultArena {
    /// An arena of `capacity` bytes (rounded down to whole pages; at least one page).
    pub fn new(capacity: u64) -> Result<Self> {
        let capacity = capacity / PAGE * PAGE;
        if capacity == 0 {
            return Err(ShmError::Protocol(format!(
                "a result arena needs at least {PAGE} bytes"
            )));
        }
        Ok(ResultArena {
            capacity,
            free: BTreeMap::from([(0, capacity)]),
            busy: BTreeMap::new(),
            batch: Vec::new(),
            hint: 0,
            resident: BTreeMap::new(),
            warm_batches: WARM_BATCHES,
        })
    }

    /// Keeps up to `batches` batches' worth (of the last batch's size) of free written pages
    /// for the next batches, instead of [`WARM_BATCHES`].
    pub fn with_warm_batches(mut self, batches: u64) -> Self {
        self.warm_batches = batches;
        self
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes held by sent batches and by the batch being written.
    pub fn in_use(&self) -> u64 {
        self.busy.values().sum::<u64>() + self.batch.iter().map(|r| r.len).sum::<u64>()
    }

    /// Bytes of the file that hold written pages (busy, or free and kept warm).
    pub fn resident(&self) -> u64 {
        self.resident.values().sum()
    }

    /// `n` (> 0) bytes for the batch being written, 64-byte aligned, in the batch's last range
    /// or in a new one; `None` when no free range can hold them.
    pub fn alloc(&mut self, n: u64) -> Option<Alloc> {
        if n == 0 {
            return None;
        }
        let ranges = self.batch.len();
        if let Some(last) = self.batch.last_mut() {
            let start = round_up(last.used, ALIGN);
            if start + n <= last.len {
                last.used = start + n;
                return Some(Alloc {
                    range: ranges - 1,
                    offset: last.offset + start,
                });
            }
        }
        // Generous first: the last batch's size (a batch like it then fits one range, and the
        // ranges of freed batches like it fit again, so their pages stay warm), or double this
        // batch's so far, so that a batch of many buffers needs few ranges; then just enough.
        let so_far: u64 = self.batch.iter().map(|r| r.used).sum();
        let generous = round_up(n.max(self.hint).max(2 * so_far).max(MIN_RANGE), PAGE);
        let offset = self
            .take(generous)
            .map(|o| (o, generous))
            .or_else(|| self.take(round_up(n, PAGE)).map(|o| (o, round_up(n, PAGE))));
        let (offset, len) = offset?;
        self.batch.push(Reserved {
            offset,
            len,
            used: n,
        });
        Some(Alloc {
            range: self.batch.len() - 1,
            offset,
        })
    }

    /// The allocation of the batch being written that holds `[offset, offset + n)`, if any: a
    /// buffer already written there (a collate that stacked into it) needs no copy.
    pub fn owned(&self, offset: u64, n: u64) -> Option<Alloc> {
        self.batch.iter().enumerate().find_map(|(range, r)| {
            let end = offset.checked_add(n)?;
            (offset >= r.offset && end <= r.offset + r.used).then_some(Alloc { range, offset })
        })
    }

    /// The batch is sent: its ranges, trimmed to whole pages of what they hold, become busy and
    /// are returned as `(offset, length)`, in allocation order (what `Alloc::range` indexes).
    pub fn finish(&mut self) -> Vec<(u64, u64)> {
        let ranges: Vec<(u64, u64)> = std::mem::take(&mut self.batch)
            .into_iter()
            .map(|r| {
                let kept = round_up(r.used, PAGE);
                insert_coalesced(&mut self.resident, r.offset, kept);
                if kept < r.len {
                    self.give_back(r.offset + kept, r.len - kept);
                }
                (r.offset, kept)
            })
            .collect();
        self.hint = ranges.iter().map(|(_, len)| len).sum();
        for &(offset, len) in &ranges {
            self.busy.insert(offset, len);
        }
        ranges
    }

    /// The batch being written is dropped (its function raised): its ranges are free at once.
    pub fn abort(&mut self) {
        for r in std::mem::take(&mut self.batch) {
            insert_coalesced(&mut self.resident, r.offset, round_up(r.used, PAGE));
            self.give_back(r.offset, r.len);
        }
    }

    /// The training process holds nothing of the busy range at `offset` any more. Returns the
    /// page extents `(offset, length)` of free memory to give back to the system now: free
    /// written pages beyond the warm batches times the last batch's size (at least
    /// [`MIN_RANGE`]), highest offsets first (the low ones stay warm, and `alloc` takes the start of
    /// a free range). Nothing busy or reserved is ever among them.
    pub fn free(&mut self, offset: u64) -> Result<Vec<(u64, u64)>> {
        let len = self.busy.remove(&offset).ok_or_else(|| {
            ShmError::Protocol(format!(
                "the training process freed result memory at offset {offset}, which is not in \
                 use"
            ))
        })?;
        self.give_back(offset, len);
        Ok(self.cool())
    }

    /// The free extents that are resident, in offset order.
    fn warm_free(&self) -> Vec<(u64, u64)> {
        let mut out = Vec::new();
        for (&f, &flen) in &self.free {
            let fend = f + flen;
            // Resident extents that overlap [f, fend): the one starting before f, then the rest.
            let before = self.resident.range(..f).next_back();
            for (&r, &rlen) in before.into_iter().chain(self.resident.range(f..fend)) {
                let (start, end) = (r.max(f), (r + rlen).min(fend));
                if start < end {
                    out.push((start, end - start));
                }
            }
        }
        out
    }

    fn cool(&mut self) -> Vec<(u64, u64)> {
        let keep = self.warm_batches.saturating_mul(self.hint).max(MIN_RANGE);
        let warm = self.warm_free();
        let mut excess = warm
            .iter()
            .map(|&(_, l)| l)
            .sum::<u64>()
            .saturating_sub(keep);
        let mut out = Vec::new();
        for &(offset, len) in warm.iter().rev() {
            if excess == 0 {
                break;
            }
            // Whole pages from the extent's end: what stays warm is its low part.
            let cut = round_up(excess.min(len), PAGE).min(len);
            out.push((offset + len - cut, cut));
            excess = excess.saturating_sub(cut);
        }
        for &(offset, len) in &out {
            remove_extent(&mut self.resident, offset, len);
        }
        out
    }

    /// Best fit: the smallest free range of at least `len` bytes, split.
    fn take(&mut self, len: u64) -> Option<u64> {
        let (&offset, &have) = self
            .free
            .iter()
            .filter(|(_, &have)| have >= len)
            .min_by_key(|(&offset, &have)| (have, offset))?;
        self.free.remove(&offset);
        if have > len {
            self.free.insert(offset + len, have - len);
        }
        Some(offset)
    }

    fn give_back(&mut self, mut offset: u64, mut len: u64) {
        if let Some((&before, &before_len)) = self.free.range(..offset).next_back() {
            if before + before_len == offset {
                self.free.remove(&before);
                offset = before;
                len += before_len;
            }
        }
        if let Some(after_len) = self.free.remove(&(offset + len)) {
            len += after_len;
        }
        self.free.insert(offset, len);
    }
}

/// Adds `[offset, offset + len)` to a set of coalesced extents.
fn insert_coalesced(set: &mut BTreeMap<u64, u64>, offset: u64, len: u64) {
    if len == 0 {
        return;
    }
    let (mut start, mut end) = (offset, offset + len);
    if let Some((&b, &blen)) = set.range(..=start).next_back() {
        if b + blen >= start {
            start = b;
            end = end.max(b + blen);
        }
    }
    let inside: Vec<u64> = set.range(start..=end).map(|(&o, _)| o).collect();
    for o in inside {
        let olen = set.remove(&o).unwrap_or(0);
        end = end.max(o + olen);
    }
    set.insert(start, end - start);
}

/// Removes `[offset, offset + len)` from a set of coalesced extents.
fn remove_extent(set: &mut BTreeMap<u64, u64>, offset: u64, len: u64) {
    let end = offset + len;
    let before = set.range(..offset).next_back().map(|(&o, &l)| (o, l));
    let touched: Vec<(u64, u64)> = before
        .into_iter()
        .chain(set.range(offset..end).map(|(&o, &l)| (o, l)))
        .filter(|&(o, l)| o < end && o + l > offset)
        .collect();
    for (o, l) in touched {
        set.remove(&o);
        if o < offset {
            set.insert(o, offset - o);
        }
        if o + l > end {
            set.insert(end, o + l - end);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    #[test]
    fn a_batch_bump_allocates_aligned_buffers_in_one_range() {
        let mut a = ResultArena::new(16 * MIB).unwrap();
        let x = a.alloc(100).unwrap();
        let y = a.alloc(10).unwrap();
        let z = a.alloc(1).unwrap();
        assert_eq!((x.range, y.range, z.range), (0, 0, 0));
        assert_eq!((x.offset, y.offset, z.offset), (0, 128, 192));
        assert_eq!(a.finish(), vec![(0, PAGE)]);
        assert_eq!(a.in_use(), PAGE);
    }

    #[test]
    fn busy_ranges_are_never_handed_out_until_freed() {
        let mut a = ResultArena::new(4 * MIB).unwrap();
        let mut sent = Vec::new();
        while let Some(x) = a.alloc(MIB) {
            assert_eq!(x.range, 0);
            sent.extend(a.finish());
        }
        assert_eq!(sent.len(), 4);
        for (i, &(o, l)) in sent.iter().enumerate() {
            for &(p, m) in &sent[i + 1..] {
                assert!(o + l <= p || p + m <= o, "{sent:?} overlap");
            }
        }
        // Full: no wait, no reuse; a refusal.
        assert_eq!(a.alloc(1), None);
        a.free(sent[2].0).unwrap();
        assert_eq!(a.alloc(MIB).unwrap().offset, sent[2].0);
    }

    #[test]
    fn a_batch_grows_into_more_ranges_and_the_next_one_is_sized_by_it() {
        let mut a = ResultArena::new(64 * MIB).unwrap();
        let allocs: Vec<Alloc> = (0..64).map(|_| a.alloc(150_528).unwrap()).collect();
        let ranges = a.finish();
        assert!(ranges.len() <= 5, "{ranges:?}");
        assert_eq!(allocs.last().unwrap().range, ranges.len() - 1);
        // The next batch of the same size fits its first range.
        for _ in 0..64 {
            assert_eq!(a.alloc(150_528).unwrap().range, 0);
        }
        assert_eq!(a.finish().len(), 1);
    }

    #[test]
    fn batches_of_one_size_cycle_through_the_same_memory() {
        let mut a = ResultArena::new(256 * MIB).unwrap();
        let size = 64 * 150_528;
        let mut held = std::collections::VecDeque::new();
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..100 {
            let x = a.alloc(size).unwrap();
            seen.insert(x.offset);
            held.push_back(a.finish()[0].0);
            if held.len() > 5 {
                a.free(held.pop_front().unwrap()).unwrap();
            }
        }
        // Six batches in flight at most: six places, not a walk through the whole arena.
        assert_eq!(seen.len(), 6, "{seen:?}");
    }

    #[test]
    fn finish_trims_to_pages_and_returns_the_tail() {
        let mut a = ResultArena::new(MIB).unwrap();
        a.alloc(5000).unwrap();
        assert_eq!(a.finish(), vec![(0, 2 * PAGE)]);
        // The next range starts right after the busy one; the tail went back to the free list.
        assert_eq!(a.alloc(1).unwrap().offset, 2 * PAGE);
        a.abort();
        assert_eq!(a.in_use(), 2 * PAGE);
        a.free(0).unwrap();
        assert_eq!(a.in_use(), 0);
        assert_eq!(a.free, BTreeMap::from([(0, MIB)]));
    }

    #[test]
    fn owned_finds_only_written_bytes_of_the_current_batch() {
        let mut a = ResultArena::new(MIB).unwrap();
        let x = a.alloc(1000).unwrap();
        assert_eq!(a.owned(x.offset, 1000), Some(x));
        assert_eq!(a.owned(x.offset + 10, 10).unwrap().range, 0);
        assert_eq!(a.owned(x.offset, 1001), None);
        assert_eq!(a.owned(u64::MAX, 2), None);
        a.finish();
        assert_eq!(a.owned(x.offset, 1000), None);
    }

    #[test]
    fn when_big_ranges_are_gone_a_batch_takes_just_enough() {
        let mut a = ResultArena::new(MIN_RANGE + PAGE).unwrap();
        a.alloc(MIN_RANGE).unwrap();
        a.finish();
        // The hint asks for 64 KiB, one page is left: enough for a small buffer.
        assert_eq!(a.alloc(100).unwrap().offset, MIN_RANGE);
        assert_eq!(a.alloc(PAGE), None);
    }

    /// Every pair of extents in `a` and `b` is disjoint.
    fn disjoint(a: &[(u64, u64)], b: &[(u64, u64)]) -> bool {
        a.iter()
            .all(|&(o, l)| b.iter().all(|&(p, m)| o + l <= p || p + m <= o))
    }

    #[test]
    fn batches_in_flight_keep_their_pages_warm() {
        let mut a = ResultArena::new(256 * MIB).unwrap();
        let size = 64 * 150_528;
        let mut held = std::collections::VecDeque::new();
        for _ in 0..100 {
            a.alloc(size).unwrap();
            held.push_back(a.finish()[0].0);
            if held.len() > 3 {
                // A steady pipeline: the freed range is the next batch's, nothing goes back.
                assert_eq!(a.free(held.pop_front().unwrap()).unwrap(), vec![]);
            }
        }
        assert_eq!(a.resident(), 4 * round_up(size, PAGE));
    }

    #[test]
    fn after_a_burst_free_pages_beyond_two_batches_are_given_back() {
        let mut a = ResultArena::new(256 * MIB).unwrap();
        let batch = round_up(64 * 150_528, PAGE);
        // The loop holds 20 batches, then lets them all go.
        let held: Vec<(u64, u64)> = (0..20)
            .map(|_| {
                a.alloc(batch).unwrap();
                a.finish()[0]
            })
            .collect();
        assert_eq!(a.resident(), 20 * batch);
        let mut given: Vec<(u64, u64)> = Vec::new();
        for (i, &(offset, _)) in held.iter().enumerate() {
            let back = a.free(offset).unwrap();
            // Never a page of a batch still held, always whole pages.
            assert!(disjoint(&back, &held[i + 1..]), "{back:?}");
            assert!(back
                .iter()
                .all(|&(o, l)| o % PAGE == 0 && l % PAGE == 0 && l > 0));
            assert!(disjoint(&back, &given), "given back twice: {back:?}");
            given.extend(back);
        }
        // Two batches' worth stay warm, at the lowest offsets; the rest went back.
        assert_eq!(a.resident(), WARM_BATCHES * batch);
        assert_eq!(a.resident, BTreeMap::from([(0, WARM_BATCHES * batch)]));
        assert_eq!(given.iter().map(|&(_, l)| l).sum::<u64>(), 18 * batch);
        // The next batch takes warm memory first.
        assert_eq!(a.alloc(batch).unwrap().offset, 0);
        a.finish();
        assert_eq!(a.resident(), WARM_BATCHES * batch);
    }

    #[test]
    fn the_warm_batches_are_the_arenas_own() {
        let mut a = ResultArena::new(16 * MIB).unwrap().with_warm_batches(3);
        let held: Vec<u64> = (0..8)
            .map(|_| {
                a.alloc(MIB).unwrap();
                a.finish()[0].0
            })
            .collect();
        let back: u64 = held
            .iter()
            .map(|&o| a.free(o).unwrap().iter().map(|&(_, l)| l).sum::<u64>())
            .sum();
        assert_eq!((back, a.resident()), (5 * MIB, 3 * MIB));
    }

    #[test]
    fn given_back_pages_are_resident_again_once_a_batch_writes_them() {
        let mut a = ResultArena::new(4 * MIB).unwrap();
        let held: Vec<u64> = (0..4)
            .map(|_| {
                a.alloc(MIB).unwrap();
                a.finish()[0].0
            })
            .collect();
        let mut back = Vec::new();
        for &o in &held {
            back.extend(a.free(o).unwrap());
        }
        assert_eq!(back, vec![(2 * MIB, MIB), (3 * MIB, MIB)]);
        assert_eq!(a.resident(), 2 * MIB);
        // A bigger batch spreads over warm and given-back pages; all of it is resident after.
        a.alloc(3 * MIB).unwrap();
        a.finish();
        assert_eq!(a.resident(), 3 * MIB);
        // An aborted batch may have written its pages too.
        a.alloc(PAGE).unwrap();
        a.abort();
        assert_eq!(a.resident(), 3 * MIB + PAGE);
    }

    #[test]
    fn extents_coalesce_and_split() {
        let mut set = BTreeMap::new();
        insert_coalesced(&mut set, 10, 5);
        insert_coalesced(&mut set, 20, 5);
        insert_coalesced(&mut set, 15, 5);
        assert_eq!(set, BTreeMap::from([(10, 15)]));
        insert_coalesced(&mut set, 5, 30);
        assert_eq!(set, BTreeMap::from([(5, 30)]));
        remove_extent(&mut set, 10, 10);
        assert_eq!(set, BTreeMap::from([(5, 5), (20, 15)]));
        remove_extent(&mut set, 0, 100);
        assert!(set.is_empty());
    }

    #[test]
    fn bad_frees_and_sizes_are_errors() {
        assert!(ResultArena::new(PAGE - 1).is_err());
        let mut a = ResultArena::new(MIB).unwrap();
        assert_eq!(a.alloc(0), None);
        let x = a.alloc(10).unwrap();
        a.finish();
        a.free(x.offset).unwrap();
        let err = a.free(x.offset).unwrap_err().to_string();
        assert!(err.contains("offset 0, which is not in use"), "{err}");
    }
}

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

use std::collections::BTreeMap;

use crate::{Result, ShmError};

/// Ranges start on page boundaries: the training process maps each one on its own.
pub const PAGE: u64 = 4096;
/// Alignment of every buffer inside a range (a cache line; enough for any dtype and SIMD).
pub const ALIGN: u64 = 64;
/// The smallest range a batch reserves.
pub const MIN_RANGE: u64 = 64 * 1024;

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
        })
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Bytes held by sent batches and by the batch being written.
    pub fn in_use(&self) -> u64 {
        self.busy.values().sum::<u64>() + self.batch.iter().map(|r| r.len).sum::<u64>()
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
            self.give_back(r.offset, r.len);
        }
    }

    /// The training process holds nothing of the busy range at `offset` any more.
    pub fn free(&mut self, offset: u64) -> Result<()> {
        let len = self.busy.remove(&offset).ok_or_else(|| {
            ShmError::Protocol(format!(
                "the training process freed result memory at offset {offset}, which is not in \
                 use"
            ))
        })?;
        self.give_back(offset, len);
        Ok(())
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

//! Where a batch's payloads lie once handed over as a few buffers: the zero-copy views of the
//! shards the batch reads, in order of first use, then (when any record was stored compressed)
//! one buffer of the decompressed payloads end to end. The bindings make the buffers; the
//! layout, and every span's bound, is worked out here.

use std::collections::HashMap;

use crate::error::Result;

use super::{Dataset, Fetched, Payload};

/// A batch's buffers and spans: sample `i` is `buffers[b][start..end]` for
/// `spans[i] = [b, start, end]`.
pub struct BatchLayout {
    pub spans: Vec<[u64; 3]>,
    /// Buffer `b < shards.len()` is a view of the whole shard `shards[b]`: (cache, shard, the
    /// first row of the batch read from it, which a failure to view the shard names).
    pub shards: Vec<(u32, u32, u64)>,
    /// The length of the buffer of decompressed payloads, which comes after the shards' views;
    /// `None` when every record is a view.
    pub owned_len: Option<u64>,
    /// Each sample's global index in the dataset.
    pub globals: Vec<u64>,
}

impl BatchLayout {
    /// The layout of `fetched`, read from `dataset`. A mapped record that would end past its
    /// shard's validated size is an error naming the sample.
    pub fn of(dataset: &Dataset, fetched: &[Fetched]) -> Result<Self> {
        let mut spans = Vec::with_capacity(fetched.len());
        let mut globals = Vec::with_capacity(fetched.len());
        let mut shards = Vec::new();
        // (cache, shard) -> buffer; consecutive samples of one shard skip the lookup.
        let mut seen: HashMap<(u32, u32), u64> = HashMap::new();
        let mut last: Option<((u32, u32), u64)> = None;
        let mut owned_len = None::<u64>;
        for f in fetched {
            globals.push(dataset.cache_start(f.cache as usize) + f.row);
            match f.payload {
                Payload::Mapped { shard, offset, len } => {
                    let cache = &dataset.caches[f.cache as usize];
                    let end = cache.payload_end(shard, offset, len, f.row)?;
                    let key = (f.cache, shard);
                    let b = match last {
                        Some((k, b)) if k == key => b,
                        _ => *seen.entry(key).or_insert_with(|| {
                            shards.push((f.cache, shard, f.row));
                            shards.len() as u64 - 1
                        }),
                    };
                    last = Some((key, b));
                    spans.push([b, offset, end]);
                }
                Payload::Owned(ref bytes) => {
                    let start = owned_len.unwrap_or(0);
                    let end = start + bytes.len() as u64;
                    // The buffer is numbered once every shard is known.
                    spans.push([u64::MAX, start, end]);
                    owned_len = Some(end);
                }
            }
        }
        let owned = shards.len() as u64;
        for span in spans.iter_mut().filter(|s| s[0] == u64::MAX) {
            span[0] = owned;
        }
        Ok(Self {
            spans,
            shards,
            owned_len,
            globals,
        })
    }

    /// The index of the buffer of decompressed payloads, if there is one.
    pub fn owned_buffer(&self) -> Option<usize> {
        self.owned_len.map(|_| self.shards.len())
    }

    /// Copies the decompressed payloads of `fetched` (the batch this layout was made of) end to
    /// end into `out`, which holds `owned_len` bytes.
    pub fn copy_owned(fetched: &[Fetched], out: &mut [u8]) {
        let mut at = 0;
        for f in fetched {
            if let Payload::Owned(ref bytes) = f.payload {
                out[at..at + bytes.len()].copy_from_slice(bytes);
                at += bytes.len();
            }
        }
        debug_assert_eq!(
            at,
            out.len(),
            "the buffer holds the batch's decompressed payloads"
        );
    }
}

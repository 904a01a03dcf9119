//! The content of one slot: a header, the offsets table, the samples' metadata and the payloads
//! carried in the slot (decompressed, each aligned to [`PAYLOAD_ALIGN`]); a payload stored
//! uncompressed in a shard file travels as a reference to its bytes there instead (no copy).
//! See `shm/LAYOUT.md`.

use std::borrow::Cow;

use dataset_rt_core::cache::Cache;
use dataset_rt_core::dataset::Dataset;
use dataset_rt_core::format::FLAG_LZ4;
use dataset_rt_core::metadata::{FieldType, MetaRef};

use dataset_rt_shm::layout::*;

use crate::{protocol, Result};

/// Bytes `offset .. offset + len` of shard file `shard` of the entry's cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ShardRef {
    pub shard: u32,
    pub offset: u64,
    pub len: u64,
}

/// A sample's payload as the producer writes it: bytes copied into the slot (a decompressed
/// record), or a reference to a verified record's bytes in its shard file.
pub enum PayloadOut<'a> {
    Bytes(Cow<'a, [u8]>),
    Shard(ShardRef),
}

/// One sample as the producer writes it.
pub struct SampleOut<'a> {
    pub global: u64,
    pub cache: u32,
    pub row: u64,
    pub meta: Vec<u8>,
    pub data: PayloadOut<'a>,
}

/// Where an entry's payload is, as read from a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Payload {
    /// Bytes `off .. off + len` of the slot.
    Slot { off: u64, len: u64 },
    /// A reference into a shard file of the entry's cache, checked against its size.
    Shard(ShardRef),
}

impl Payload {
    pub fn len(&self) -> u64 {
        match *self {
            Payload::Slot { len, .. } | Payload::Shard(ShardRef { len, .. }) => len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One entry of a slot's offsets table; offsets are from the slot's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub global: u64,
    pub cache: u32,
    pub row: u64,
    pub meta_off: u64,
    pub meta_len: u32,
    pub payload: Payload,
}

/// Bytes the slot holds of a payload (a reference takes none beyond its entry).
fn slot_len(data: &PayloadOut<'_>) -> Option<u64> {
    match data {
        PayloadOut::Bytes(bytes) => Some(bytes.len() as u64),
        PayloadOut::Shard(_) => None,
    }
}

/// Bytes a slot needs for these samples.
pub fn batch_bytes(samples: &[SampleOut<'_>]) -> u64 {
    let mut end = B_HEADER_LEN + B_ENTRY_LEN * samples.len() as u64;
    end += samples.iter().map(|s| s.meta.len() as u64).sum::<u64>();
    for len in samples.iter().filter_map(|s| slot_len(&s.data)) {
        end = align(end, PAYLOAD_ALIGN) + len;
    }
    end
}

fn put(slot: &mut [u8], at: u64, bytes: &[u8]) {
    slot[at as usize..at as usize + bytes.len()].copy_from_slice(bytes);
}

/// Writes a batch into a slot (which must hold `batch_bytes(samples)`); returns the bytes used.
pub fn write_batch(slot: &mut [u8], seq: u64, samples: &[SampleOut<'_>]) -> u64 {
    let needed = batch_bytes(samples);
    assert!(needed <= slot.len() as u64, "caller checks the slot size");
    let mut meta_at = B_HEADER_LEN + B_ENTRY_LEN * samples.len() as u64;
    let mut data_at = meta_at + samples.iter().map(|s| s.meta.len() as u64).sum::<u64>();
    for (i, s) in samples.iter().enumerate() {
        let e = B_HEADER_LEN + B_ENTRY_LEN * i as u64;
        put(slot, e, &s.global.to_le_bytes());
        put(slot, e + 8, &s.cache.to_le_bytes());
        let meta_len = u32::try_from(s.meta.len()).expect("encode_metadata bounds it");
        put(slot, e + 12, &meta_len.to_le_bytes());
        put(slot, e + 16, &s.row.to_le_bytes());
        put(slot, e + 24, &meta_at.to_le_bytes());
        let (kind, shard, off, len) = match &s.data {
            PayloadOut::Bytes(bytes) => {
                data_at = align(data_at, PAYLOAD_ALIGN);
                put(slot, data_at, bytes);
                let off = data_at;
                data_at += bytes.len() as u64;
                (PAYLOAD_IN_SLOT, 0, off, bytes.len() as u64)
            }
            PayloadOut::Shard(r) => (PAYLOAD_SHARD_REF, r.shard, r.offset, r.len),
        };
        put(slot, e + 32, &off.to_le_bytes());
        put(slot, e + 40, &len.to_le_bytes());
        put(slot, e + 48, &kind.to_le_bytes());
        put(slot, e + 52, &shard.to_le_bytes());
        put(slot, meta_at, &s.meta);
        meta_at += s.meta.len() as u64;
    }
    put(slot, B_MAGIC as u64, SLOT_MAGIC);
    put(slot, B_SEQ as u64, &seq.to_le_bytes());
    put(
        slot,
        B_NUM_SAMPLES as u64,
        &(samples.len() as u32).to_le_bytes(),
    );
    put(slot, B_VERSION as u64, &LAYOUT_VERSION.to_le_bytes());
    put(slot, B_USED as u64, &needed.to_le_bytes());
    needed
}

fn u32_at(b: &[u8], at: u64) -> u32 {
    u32::from_le_bytes(b[at as usize..at as usize + 4].try_into().unwrap())
}

fn u64_at(b: &[u8], at: u64) -> u64 {
    u64::from_le_bytes(b[at as usize..at as usize + 8].try_into().unwrap())
}

/// The bytes of a slot that its batch uses, from its header (checked against the slot by
/// [`read_batch`], which a taker calls first).
pub fn slot_used(slot: &[u8]) -> u64 {
    u64_at(slot, B_USED as u64)
}

/// Reads and checks a slot's header and offsets table. `shard_lens[cache][shard]` is the
/// validated size of each shard file (`ShardTable::lens`): a reference must name a shard that
/// exists and lie within it.
pub fn read_batch(slot: &[u8], seq: u64, shard_lens: &[Vec<u64>]) -> Result<Vec<Entry>> {
    let bad = |reason: String| protocol(format!("slot of batch {seq}: {reason}"));
    if slot.len() < B_HEADER_LEN as usize || &slot[..8] != SLOT_MAGIC {
        return Err(bad("bad magic".into()));
    }
    let found = u64_at(slot, B_SEQ as u64);
    if found != seq {
        return Err(bad(format!("holds batch {found}")));
    }
    let n = u64::from(u32_at(slot, B_NUM_SAMPLES as u64));
    let used = u64_at(slot, B_USED as u64);
    if used > slot.len() as u64 || B_HEADER_LEN + n * B_ENTRY_LEN > used {
        return Err(bad(format!(
            "{n} samples in {used} bytes do not fit the slot"
        )));
    }
    (0..n)
        .map(|i| {
            let e = B_HEADER_LEN + B_ENTRY_LEN * i;
            let cache = u32_at(slot, e + 8);
            let (off, len) = (u64_at(slot, e + 32), u64_at(slot, e + 40));
            let payload = match (u32_at(slot, e + 48), u32_at(slot, e + 52)) {
                (PAYLOAD_IN_SLOT, _) => match off.checked_add(len) {
                    Some(end) if end <= used => Payload::Slot { off, len },
                    _ => return Err(bad(format!("sample {i} lies past the used bytes"))),
                },
                (PAYLOAD_SHARD_REF, shard) => {
                    let Some(size) = shard_lens
                        .get(cache as usize)
                        .and_then(|c| c.get(shard as usize))
                    else {
                        return Err(bad(format!(
                            "sample {i} references shard {shard} of cache {cache}, which the \
                             dataset does not have"
                        )));
                    };
                    match off.checked_add(len) {
                        Some(end) if end <= *size => Payload::Shard(ShardRef {
                            shard,
                            offset: off,
                            len,
                        }),
                        _ => {
                            return Err(bad(format!(
                                "sample {i} references bytes {off} + {len} of shard {shard} of \
                                 cache {cache}, which holds {size} bytes"
                            )))
                        }
                    }
                }
                (kind, _) => return Err(bad(format!("sample {i} has payload kind {kind}"))),
            };
            let entry = Entry {
                global: u64_at(slot, e),
                cache,
                meta_len: u32_at(slot, e + 12),
                row: u64_at(slot, e + 16),
                meta_off: u64_at(slot, e + 24),
                payload,
            };
            match entry.meta_off.checked_add(u64::from(entry.meta_len)) {
                Some(m) if m <= used => Ok(entry),
                _ => Err(bad(format!("sample {i} lies past the used bytes"))),
            }
        })
        .collect()
}

/// Whether any of `entries` has its payload in the slot (else the slot's bytes are needed for
/// nothing once the entries and metadata are read).
pub fn any_in_slot(entries: &[Entry]) -> bool {
    entries
        .iter()
        .any(|e| matches!(e.payload, Payload::Slot { .. }))
}

/// A length that the slot encoding stores as u32, or the error naming what is too long.
fn len_u32(len: usize, what: impl FnOnce() -> String) -> Result<u32> {
    u32::try_from(len).map_err(|_| {
        protocol(format!(
            "{} is {len} bytes: the loader carries at most {} bytes",
            what(),
            u32::MAX
        ))
    })
}

/// Encodes one row of metadata: u32 count, then per field u32 key length, key, u8 tag, value.
/// Every length is checked, never truncated: what does not fit is an error.
pub fn encode_metadata<'a>(row: impl Iterator<Item = (&'a str, MetaRef<'a>)>) -> Result<Vec<u8>> {
    let mut out = vec![0u8; 4];
    let mut count = 0u32;
    for (key, value) in row {
        count = count
            .checked_add(1)
            .ok_or_else(|| protocol("more than 2^32 metadata fields".into()))?;
        let key_len = len_u32(key.len(), || "a metadata key".into())?;
        out.extend_from_slice(&key_len.to_le_bytes());
        out.extend_from_slice(key.as_bytes());
        match value {
            MetaRef::Bool(b) => out.extend_from_slice(&[META_BOOL, u8::from(b)]),
            MetaRef::Int(i) => {
                out.push(META_INT);
                out.extend_from_slice(&i.to_le_bytes());
            }
            MetaRef::Float(f) => {
                out.push(META_FLOAT);
                out.extend_from_slice(&f.to_le_bytes());
            }
            MetaRef::Str(s) => {
                out.push(META_STR);
                let len = len_u32(s.len(), || format!("the value of metadata field {key:?}"))?;
                out.extend_from_slice(&len.to_le_bytes());
                out.extend_from_slice(s.as_bytes());
            }
        }
    }
    out[..4].copy_from_slice(&count.to_le_bytes());
    len_u32(out.len(), || "one sample's metadata".into())?;
    Ok(out)
}

/// Bytes [`encode_metadata`] writes for this row, without writing them.
pub fn metadata_len<'a>(row: impl Iterator<Item = (&'a str, MetaRef<'a>)>) -> u64 {
    4 + row
        .map(|(key, value)| {
            let value_len = match value {
                MetaRef::Bool(_) => 1,
                MetaRef::Int(_) | MetaRef::Float(_) => 8,
                MetaRef::Str(s) => 4 + s.len() as u64,
            };
            4 + key.len() as u64 + 1 + value_len
        })
        .sum::<u64>()
}

/// The largest payload of `cache` that travels in a slot, proved by reading it, or `None` when
/// none does. Records stored LZ4 are carried in the slot (decompressed), and so is every record
/// of a cache read in place from a URL (copied out of the fetched bytes: it has no shard file);
/// a local record stored uncompressed travels as a reference to its shard file, which takes no
/// payload bytes there.
/// Every index entry's `flags` and `raw_len` are unverified until its record is read; the
/// largest one carried in a slot decides its size, so that record is verified (checksum, header
/// against the index) and decoded before anything is allocated from it, and its decoded length
/// must be its `raw_len`. Every other sample's `raw_len` is no larger, so slots sized from this
/// one hold any batch of verified samples, and a sample whose forged index entry claims less
/// than it holds (a smaller `raw_len`, or no LZ4 flag) is caught when the producer reads it,
/// which checks its header against the index. Reading it (`Cache::payload`: from the shard's
/// map, or through the record source of a cache read in place from a URL) refuses an LZ4 record
/// that claims more than its stored bytes can decode to, so a forged size cannot make this
/// allocate more than the record's real bytes decode to.
fn verified_max_slot_payload(cache: &Cache) -> Result<Option<u64>> {
    let in_slot = |row: u64| cache.is_fetched() || cache.entry(row).flags & FLAG_LZ4 != 0;
    let Some(row) = (0..cache.len())
        .filter(|&row| in_slot(row))
        .max_by_key(|&row| cache.entry(row).raw_len)
    else {
        return Ok(None);
    };
    // Verified and decoded from the shard's map, or fetched through the record source of a
    // cache read in place from a URL (which has no map).
    let payload = cache.payload(row)?;
    let e = cache.entry(row);
    let raw_len = u64::from(e.raw_len);
    if payload.len() as u64 != raw_len {
        return Err(dataset_rt_core::Error::CorruptRecord {
            cache: cache.name().to_owned(),
            shard: cache.shard_path(e.shard),
            offset: e.offset,
            sample: row,
            reason: format!(
                "the payload decodes to {} bytes, the index says {raw_len}",
                payload.len()
            ),
        }
        .into());
    }
    Ok(Some(raw_len))
}

/// The most bytes one sample of `cache` takes in a slot beyond the header: its offsets entry,
/// its metadata and, when the cache has records stored LZ4, the payload's alignment padding and
/// the largest decompressed payload (verified: see [`verified_max_slot_payload`]). The metadata
/// rows are walked only when a field is a string.
fn max_sample_bytes_of(cache: &Cache) -> Result<u64> {
    let table = cache.metadata()?;
    let fixed_metadata = table.fields.iter().all(|f| f.dtype != FieldType::Str);
    let max_metadata = match (fixed_metadata, cache.len()) {
        (_, 0) => 0,
        (true, _) => metadata_len(table.row(0)),
        (false, n) => (0..n)
            .map(|row| metadata_len(table.row(row)))
            .max()
            .unwrap_or(0),
    };
    let max_payload = verified_max_slot_payload(cache)?.map_or(0, |len| (PAYLOAD_ALIGN - 1) + len);
    Ok(B_ENTRY_LEN + max_metadata + max_payload)
}

/// The most bytes any one sample of `ds` takes in a slot beyond the header (see
/// [`slot_size_for`]); reads and verifies the largest record of each cache (a corrupt one is
/// reported here, before a ring is sized from it).
pub fn max_sample_bytes(ds: &Dataset) -> Result<u64> {
    ds.caches
        .iter()
        .map(|c| max_sample_bytes_of(c))
        .try_fold(0, |max, bytes| Ok(max.max(bytes?)))
}

/// A slot size that holds every batch of `batch_size` samples that take at most `max_sample`
/// bytes each (a sample may repeat in a weighted order, so the bound is the largest one times
/// the batch size): rounded up to a page, and at least [`MIN_SLOT_SIZE`].
pub fn slot_size_for(max_sample: u64, batch_size: u64) -> u64 {
    let needed = B_HEADER_LEN.saturating_add(batch_size.saturating_mul(max_sample));
    // Absurd sizes stay page multiples: creating the ring then fails with a clear error.
    align(needed.clamp(MIN_SLOT_SIZE, u64::MAX / PAGE * PAGE), PAGE)
}

/// Decodes what [`encode_metadata`] wrote.
pub fn decode_metadata(bytes: &[u8]) -> Result<Vec<(&str, MetaRef<'_>)>> {
    let bad = || protocol("slot metadata is truncated or not UTF-8".into());
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8]> {
        let s = bytes.get(at..at + n).ok_or_else(bad)?;
        at += n;
        Ok(s)
    };
    let count = u32::from_le_bytes(take(4)?.try_into().unwrap());
    // The count is read from the slot: every field takes at least 4 more bytes, so no more can
    // be there (a forged count must not reserve memory).
    let mut out = Vec::with_capacity((count as usize).min(bytes.len() / 4));
    for _ in 0..count {
        let klen = u32::from_le_bytes(take(4)?.try_into().unwrap()) as usize;
        let key = std::str::from_utf8(take(klen)?).map_err(|_| bad())?;
        let value = match take(1)?[0] {
            META_BOOL => MetaRef::Bool(take(1)?[0] != 0),
            META_INT => MetaRef::Int(i64::from_le_bytes(take(8)?.try_into().unwrap())),
            META_FLOAT => MetaRef::Float(f64::from_le_bytes(take(8)?.try_into().unwrap())),
            META_STR => {
                let n = u32::from_le_bytes(take(4)?.try_into().unwrap()) as usize;
                MetaRef::Str(std::str::from_utf8(take(n)?).map_err(|_| bad())?)
            }
            _ => return Err(bad()),
        };
        out.push((key, value));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(global: u64, meta: &[(&str, MetaRef<'_>)], data: &[u8]) -> SampleOut<'static> {
        SampleOut {
            global,
            cache: (global % 3) as u32,
            row: global / 3,
            meta: encode_metadata(meta.iter().copied()).unwrap(),
            data: PayloadOut::Bytes(Cow::Owned(data.to_vec())),
        }
    }

    fn reference(global: u64, cache: u32, r: ShardRef) -> SampleOut<'static> {
        SampleOut {
            global,
            cache,
            row: global,
            meta: encode_metadata([("i", MetaRef::Int(global as i64))].into_iter()).unwrap(),
            data: PayloadOut::Shard(r),
        }
    }

    impl SampleOut<'_> {
        fn clone_ref(&self) -> SampleOut<'static> {
            let PayloadOut::Shard(r) = self.data else {
                panic!("not a reference")
            };
            SampleOut {
                global: self.global,
                cache: self.cache,
                row: self.row,
                meta: self.meta.clone(),
                data: PayloadOut::Shard(r),
            }
        }
    }

    /// The payload bytes a slot entry holds in the slot.
    fn in_slot<'s>(slot: &'s [u8], e: &Entry) -> &'s [u8] {
        match e.payload {
            Payload::Slot { off, len } => &slot[off as usize..(off + len) as usize],
            other => panic!("a shard reference: {other:?}"),
        }
    }

    #[test]
    fn a_batch_round_trips_through_a_slot() {
        let samples = vec![
            sample(
                7,
                &[("i", MetaRef::Int(-7)), ("tag", MetaRef::Str("séven"))],
                b"abc",
            ),
            sample(2, &[("flag", MetaRef::Bool(true))], &[]),
            sample(
                11,
                &[("x", MetaRef::Float(f64::NAN)), ("y", MetaRef::Float(-0.0))],
                &[0xAB; 100],
            ),
        ];
        let needed = batch_bytes(&samples);
        let mut slot = vec![0xEEu8; 4096];
        assert_eq!(write_batch(&mut slot, 42, &samples), needed);
        let entries = read_batch(&slot, 42, &[]).unwrap();
        assert_eq!(entries.len(), 3);
        for (e, s) in entries.iter().zip(&samples) {
            assert_eq!((e.global, e.cache, e.row), (s.global, s.cache, s.row));
            let Payload::Slot { off, len } = e.payload else {
                panic!("{e:?}")
            };
            assert_eq!(off % PAYLOAD_ALIGN, 0, "payloads are 64-byte aligned");
            let PayloadOut::Bytes(bytes) = &s.data else {
                unreachable!()
            };
            assert_eq!(in_slot(&slot, e), &bytes[..]);
            let meta = &slot[e.meta_off as usize..e.meta_off as usize + e.meta_len as usize];
            assert_eq!(meta, &s.meta[..]);
            assert!(off + len <= needed);
        }
        let meta = &slot[entries[0].meta_off as usize..][..entries[0].meta_len as usize];
        assert_eq!(
            decode_metadata(meta).unwrap(),
            vec![("i", MetaRef::Int(-7)), ("tag", MetaRef::Str("séven"))]
        );
        let meta = &slot[entries[2].meta_off as usize..][..entries[2].meta_len as usize];
        match decode_metadata(meta).unwrap()[..] {
            [("x", MetaRef::Float(x)), ("y", MetaRef::Float(y))] => {
                assert!(x.is_nan());
                assert_eq!(y.to_bits(), (-0.0f64).to_bits());
            }
            ref other => panic!("decoded {other:?}"),
        }
        // The header as LAYOUT.md has it.
        assert_eq!(&slot[..8], SLOT_MAGIC);
        assert_eq!(slot[B_NUM_SAMPLES], 3);
        assert_eq!(slot[B_VERSION], LAYOUT_VERSION as u8);
    }

    #[test]
    fn a_slot_is_checked_before_it_is_read() {
        let samples = vec![sample(1, &[("i", MetaRef::Int(1))], b"payload")];
        let mut slot = vec![0u8; 512];
        write_batch(&mut slot, 5, &samples);
        assert!(read_batch(&slot, 6, &[])
            .unwrap_err()
            .to_string()
            .contains("holds batch 5"));
        let mut bad = slot.clone();
        bad[0] = b'X';
        assert!(read_batch(&bad, 5, &[])
            .unwrap_err()
            .to_string()
            .contains("bad magic"));
        let mut bad = slot.clone();
        bad[B_USED..B_USED + 8].copy_from_slice(&10_000u64.to_le_bytes());
        assert!(read_batch(&bad, 5, &[])
            .unwrap_err()
            .to_string()
            .contains("do not fit"));
        let mut bad = slot.clone();
        let len_at = (B_HEADER_LEN + 40) as usize;
        bad[len_at..len_at + 8].copy_from_slice(&1000u64.to_le_bytes());
        assert!(read_batch(&bad, 5, &[])
            .unwrap_err()
            .to_string()
            .contains("past the used bytes"));
    }

    #[test]
    fn shard_references_round_trip_beside_payloads_in_the_slot() {
        let shard_lens = vec![vec![1000, 5000], vec![300]];
        let samples = vec![
            reference(
                0,
                0,
                ShardRef {
                    shard: 1,
                    offset: 4000,
                    len: 1000,
                },
            ),
            sample(3, &[("i", MetaRef::Int(3))], b"decompressed"),
            reference(
                4,
                1,
                ShardRef {
                    shard: 0,
                    offset: 17,
                    len: 0,
                },
            ),
        ];
        let needed = batch_bytes(&samples);
        // A reference takes its entry and metadata only: nothing of its payload.
        let refs_only = batch_bytes(&[samples[0].clone_ref(), samples[2].clone_ref()]);
        let metas: u64 = [&samples[0], &samples[2]]
            .iter()
            .map(|s| s.meta.len() as u64)
            .sum();
        assert_eq!(refs_only, B_HEADER_LEN + 2 * B_ENTRY_LEN + metas);
        let mut slot = vec![0u8; 4096];
        assert_eq!(write_batch(&mut slot, 9, &samples), needed);
        let entries = read_batch(&slot, 9, &shard_lens).unwrap();
        assert_eq!(
            entries[0].payload,
            Payload::Shard(ShardRef {
                shard: 1,
                offset: 4000,
                len: 1000
            })
        );
        assert_eq!(in_slot(&slot, &entries[1]), b"decompressed");
        assert_eq!(
            entries[2].payload,
            Payload::Shard(ShardRef {
                shard: 0,
                offset: 17,
                len: 0
            })
        );
        assert_eq!((entries[2].cache, entries[2].global), (1, 4));
        assert!(any_in_slot(&entries));
        assert!(!any_in_slot(&[entries[0], entries[2]]));
        for e in &entries {
            let meta = &slot[e.meta_off as usize..][..e.meta_len as usize];
            assert_eq!(
                decode_metadata(meta).unwrap(),
                vec![("i", MetaRef::Int(e.global as i64))]
            );
        }
    }

    #[test]
    fn bad_shard_references_are_refused() {
        let shard_lens = vec![vec![1000, 5000]];
        let write = |r: ShardRef, cache: u32| {
            let mut slot = vec![0u8; 1024];
            write_batch(&mut slot, 1, &[reference(0, cache, r)]);
            slot
        };
        let at = |shard, offset, len| ShardRef { shard, offset, len };
        let refused = |slot: &[u8]| read_batch(slot, 1, &shard_lens).unwrap_err().to_string();
        // Ends exactly at the shard's end: fine; one byte more is not.
        assert!(read_batch(&write(at(1, 4000, 1000), 0), 1, &shard_lens).is_ok());
        let text = refused(&write(at(1, 4000, 1001), 0));
        assert!(
            text.contains("bytes 4000 + 1001 of shard 1 of cache 0, which holds 5000 bytes"),
            "{text}"
        );
        let text = refused(&write(at(0, u64::MAX, 2), 0));
        assert!(text.contains("which holds 1000 bytes"), "{text}");
        let text = refused(&write(at(2, 0, 1), 0));
        assert!(
            text.contains("shard 2 of cache 0, which the dataset does not have"),
            "{text}"
        );
        let text = refused(&write(at(0, 0, 1), 1));
        assert!(
            text.contains("shard 0 of cache 1, which the dataset does not have"),
            "{text}"
        );
        // No shard table at all (a consumer that knows no caches) refuses every reference.
        assert!(read_batch(&write(at(0, 0, 1), 0), 1, &[]).is_err());
        // An unknown payload kind.
        let mut slot = write(at(0, 0, 1), 0);
        let kind_at = (B_HEADER_LEN + 48) as usize;
        slot[kind_at..kind_at + 4].copy_from_slice(&7u32.to_le_bytes());
        assert!(refused(&slot).contains("sample 0 has payload kind 7"));
    }

    #[test]
    fn truncated_metadata_is_refused() {
        let meta =
            encode_metadata([("tag", MetaRef::Str("hello")), ("n", MetaRef::Int(3))].into_iter())
                .unwrap();
        for cut in 0..meta.len() {
            assert!(decode_metadata(&meta[..cut]).is_err(), "cut at {cut}");
        }
        assert!(decode_metadata(&meta).is_ok());
    }

    #[test]
    fn metadata_keys_longer_than_64_kib_round_trip() {
        // 65,541 bytes: with a u16 length its low bits read as 5 ("abcde") and the rest of the
        // key as the value; 70,000 bytes: garbage. Both must come back whole.
        let keys = [
            format!("abcde\u{1}{}", "A".repeat(65_535)),
            "k".repeat(70_000),
        ];
        for key in &keys {
            let row = [(key.as_str(), MetaRef::Int(7)), ("s", MetaRef::Str("v"))];
            let meta = encode_metadata(row.iter().copied()).unwrap();
            assert_eq!(meta.len() as u64, metadata_len(row.iter().copied()));
            assert_eq!(decode_metadata(&meta).unwrap(), row.to_vec());
        }
    }

    #[test]
    fn metadata_len_is_what_encode_writes() {
        let rows: [&[(&str, MetaRef<'_>)]; 3] = [
            &[],
            &[("b", MetaRef::Bool(false)), ("f", MetaRef::Float(1.5))],
            &[
                ("name", MetaRef::Str("ünïcode")),
                ("i", MetaRef::Int(i64::MIN)),
            ],
        ];
        for row in rows {
            assert_eq!(
                metadata_len(row.iter().copied()),
                encode_metadata(row.iter().copied()).unwrap().len() as u64
            );
        }
    }

    #[test]
    fn slots_sized_from_the_largest_sample_hold_any_batch_of_them() {
        assert_eq!(slot_size_for(100, 4), MIN_SLOT_SIZE);
        let big = B_ENTRY_LEN + 20 + (PAYLOAD_ALIGN - 1) + 100_000;
        let size = slot_size_for(big, 4);
        assert_eq!(size % PAGE, 0);
        assert!(size >= B_HEADER_LEN + 4 * big && size < B_HEADER_LEN + 4 * big + PAGE);
        // Four copies of the largest sample, at the worst alignment, fit.
        let samples: Vec<_> = (0..4)
            .map(|g| {
                sample(
                    g,
                    &[("tag", MetaRef::Str("0123456789"))],
                    &vec![1; 100_000 - 1],
                )
            })
            .collect();
        assert!(batch_bytes(&samples) <= size);
        assert_eq!(slot_size_for(u64::MAX, 2), u64::MAX / PAGE * PAGE);
    }
}

//! The content of one slot: a header, the offsets table, the samples' metadata and their
//! payloads (decompressed, each aligned to [`PAYLOAD_ALIGN`]). See `shm/LAYOUT.md`.

use std::borrow::Cow;

use dataset_rt_core::metadata::MetaRef;

use crate::layout::*;
use crate::{Result, ShmError};

/// One sample as the producer writes it.
pub struct SampleOut<'a> {
    pub global: u64,
    pub cache: u32,
    pub row: u64,
    pub meta: Vec<u8>,
    pub data: Cow<'a, [u8]>,
}

/// One entry of a slot's offsets table; offsets are from the slot's start.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Entry {
    pub global: u64,
    pub cache: u32,
    pub row: u64,
    pub meta_off: u64,
    pub meta_len: u32,
    pub data_off: u64,
    pub data_len: u64,
}

/// Bytes a slot needs for these samples.
pub fn batch_bytes(samples: &[SampleOut<'_>]) -> u64 {
    let mut end = B_HEADER_LEN + B_ENTRY_LEN * samples.len() as u64;
    end += samples.iter().map(|s| s.meta.len() as u64).sum::<u64>();
    for s in samples {
        end = align(end, PAYLOAD_ALIGN) + s.data.len() as u64;
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
        data_at = align(data_at, PAYLOAD_ALIGN);
        let e = B_HEADER_LEN + B_ENTRY_LEN * i as u64;
        put(slot, e, &s.global.to_le_bytes());
        put(slot, e + 8, &s.cache.to_le_bytes());
        put(slot, e + 12, &(s.meta.len() as u32).to_le_bytes());
        put(slot, e + 16, &s.row.to_le_bytes());
        put(slot, e + 24, &meta_at.to_le_bytes());
        put(slot, e + 32, &data_at.to_le_bytes());
        put(slot, e + 40, &(s.data.len() as u64).to_le_bytes());
        put(slot, meta_at, &s.meta);
        put(slot, data_at, &s.data);
        meta_at += s.meta.len() as u64;
        data_at += s.data.len() as u64;
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

/// Reads and checks a slot's header and offsets table.
pub fn read_batch(slot: &[u8], seq: u64) -> Result<Vec<Entry>> {
    let bad = |reason: String| ShmError::Protocol(format!("slot of batch {seq}: {reason}"));
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
            let entry = Entry {
                global: u64_at(slot, e),
                cache: u32_at(slot, e + 8),
                meta_len: u32_at(slot, e + 12),
                row: u64_at(slot, e + 16),
                meta_off: u64_at(slot, e + 24),
                data_off: u64_at(slot, e + 32),
                data_len: u64_at(slot, e + 40),
            };
            let meta_end = entry.meta_off.checked_add(u64::from(entry.meta_len));
            let data_end = entry.data_off.checked_add(entry.data_len);
            match (meta_end, data_end) {
                (Some(m), Some(d)) if m <= used && d <= used => Ok(entry),
                _ => Err(bad(format!("sample {i} lies past the used bytes"))),
            }
        })
        .collect()
}

/// Encodes one row of metadata: u32 count, then per field u16 key length, key, u8 tag, value.
pub fn encode_metadata<'a>(row: impl Iterator<Item = (&'a str, MetaRef<'a>)>) -> Vec<u8> {
    let mut out = vec![0u8; 4];
    let mut count = 0u32;
    for (key, value) in row {
        count += 1;
        out.extend_from_slice(&(key.len() as u16).to_le_bytes());
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
                out.extend_from_slice(&(s.len() as u32).to_le_bytes());
                out.extend_from_slice(s.as_bytes());
            }
        }
    }
    out[..4].copy_from_slice(&count.to_le_bytes());
    out
}

/// Decodes what [`encode_metadata`] wrote.
pub fn decode_metadata(bytes: &[u8]) -> Result<Vec<(&str, MetaRef<'_>)>> {
    let bad = || ShmError::Protocol("slot metadata is truncated or not UTF-8".into());
    let mut at = 0usize;
    let mut take = |n: usize| -> Result<&[u8]> {
        let s = bytes.get(at..at + n).ok_or_else(bad)?;
        at += n;
        Ok(s)
    };
    let count = u32::from_le_bytes(take(4)?.try_into().unwrap());
    let mut out = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let klen = u16::from_le_bytes(take(2)?.try_into().unwrap()) as usize;
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

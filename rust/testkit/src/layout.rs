//! Where the fields of `index.bin` entries and record headers lie in each format version, and
//! readers of them that trust nothing: every function here takes damaged bytes (a version the
//! reader does not know, an entry past the end, a record past its shard) without panicking, so
//! that a fuzz target can damage a cache and still re-sign it.

use dataset_rt_core::format::{
    index_entry_len, FORMAT_VERSION, INDEX_HEADER_LEN, READABLE_VERSIONS,
};

use crate::files::CacheFiles;

/// Where one field lies: (offset from the start of its entry or record, width in bytes).
pub type Field = (usize, usize);

/// The fields of an `index.bin` entry in one format version.
#[derive(Clone, Copy, Debug)]
pub struct EntryLayout {
    pub offset: Field,
    pub shard: Field,
    pub flags: Field,
    pub stored_len: Field,
    pub raw_len: Field,
    /// From v3 on; an older entry has none.
    pub meta_len: Option<Field>,
    /// The entry's copy of its record's checksum.
    pub checksum: Field,
}

/// The fields of a record header in one format version.
#[derive(Clone, Copy, Debug)]
pub struct RecordLayout {
    pub magic: Field,
    pub reserved: Field,
    pub checksum: Field,
    pub flags: Field,
    pub meta_len: Field,
    pub stored_len: Field,
    pub raw_len: Field,
    pub sample: Field,
}

/// The layout of an index entry in format `version`.
pub fn entry_layout(version: u32) -> EntryLayout {
    let v3 = version >= 3;
    EntryLayout {
        offset: (0, 8),
        shard: (8, 4),
        flags: (12, 4),
        stored_len: (16, 4),
        raw_len: (20, 4),
        meta_len: v3.then_some((24, 4)),
        checksum: if v3 { (32, 8) } else { (24, 8) },
    }
}

/// The layout of a record header in format `version`: v1 puts the checksum after the fields it
/// covers, v2 and later put it first, before the range it covers.
pub fn record_layout(version: u32) -> RecordLayout {
    if version == 1 {
        RecordLayout {
            magic: (0, 4),
            flags: (4, 4),
            meta_len: (8, 4),
            stored_len: (12, 4),
            raw_len: (16, 4),
            reserved: (20, 4),
            sample: (24, 8),
            checksum: (32, 8),
        }
    } else {
        RecordLayout {
            magic: (0, 4),
            reserved: (4, 4),
            checksum: (8, 8),
            flags: (16, 4),
            meta_len: (20, 4),
            stored_len: (24, 4),
            raw_len: (28, 4),
            sample: (32, 8),
        }
    }
}

/// The little-endian u32 at `at`, when `bytes` holds it.
pub fn get_u32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}

/// The little-endian u64 at `at`, when `bytes` holds it.
pub fn get_u64(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}

/// Writes `value` at `at` when `bytes` holds all of it; otherwise writes nothing.
pub fn put(bytes: &mut [u8], at: usize, value: &[u8]) {
    if let Some(dst) = bytes.get_mut(at..at + value.len()) {
        dst.copy_from_slice(value);
    }
}

/// The format version the header of `index` names. Damage may have changed it: a version this
/// DatasetRT does not read is taken as the one it writes, whose layout is then used.
pub fn version_of(index: &[u8]) -> u32 {
    get_u32(index, 8)
        .filter(|v| READABLE_VERSIONS.contains(v))
        .unwrap_or(FORMAT_VERSION)
}

/// Where entry `entry` starts in an index of format `version`.
pub fn entry_at(version: u32, entry: usize) -> usize {
    (INDEX_HEADER_LEN + index_entry_len(version) * entry as u64) as usize
}

/// How many whole entries of format `version` `index` holds after its header.
pub fn entries(version: u32, index: &[u8]) -> usize {
    (index.len().saturating_sub(INDEX_HEADER_LEN as usize)) / index_entry_len(version) as usize
}

/// (shard, offset) of the record that index entry `k` points at, when the entry is there and
/// names a shard file that exists.
pub fn record_of(files: &CacheFiles, k: usize) -> Option<(usize, usize)> {
    let version = version_of(&files.index);
    let fields = entry_layout(version);
    let e = entry_at(version, k);
    let offset = usize::try_from(get_u64(&files.index, e + fields.offset.0)?).ok()?;
    let shard = get_u32(&files.index, e + fields.shard.0)? as usize;
    (shard < files.shards.len()).then_some((shard, offset))
}

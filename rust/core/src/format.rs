//! Storage format v3 (and v1 and v2, still read): byte layouts of shards, records and the index,
//! and the manifest. `docs/storage-format.md` specifies the same thing for readers in other
//! languages.
//!
//! v2 puts the record checksum in front of the fields it covers, so a record's checksum is one
//! xxh3-64 over one contiguous range of the shard (fields, metadata, padding, payload) instead of
//! three pieces around it. v3 keeps v2's records and adds the record's metadata length to its
//! index entry (40 bytes instead of 32): a reader that verified a record once can then find its
//! payload from the index entry alone, without touching the record again.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

pub use crate::checksum::{checksum_hex, hash_bytes, CHECKSUM_ALGO};
use crate::metadata::{Field, FieldType};

pub const FORMAT_NAME: &str = "dataset-rt-cache";
/// The version this DatasetRT writes.
pub const FORMAT_VERSION: u32 = 3;
/// The versions this DatasetRT reads.
pub const READABLE_VERSIONS: [u32; 3] = [1, 2, 3];
pub const WRITER_VERSION: &str = concat!("dataset-rt ", env!("CARGO_PKG_VERSION"));

pub const MANIFEST_FILE: &str = "manifest.json";
pub const METADATA_FILE: &str = "metadata.arrow";
pub const INDEX_FILE: &str = "index.bin";
pub const SHARDS_DIR: &str = "shards";

/// Records and payloads start on this boundary (relative to the shard start), so a payload view
/// can be reinterpreted as any numeric dtype without a copy.
pub const ALIGN: u64 = 16;

pub const SHARD_MAGIC: &[u8; 8] = b"DRTSHARD";
pub const SHARD_HEADER_LEN: u64 = 16;
pub const INDEX_MAGIC: &[u8; 8] = b"DRTINDEX";
pub const INDEX_HEADER_LEN: u64 = 16;
/// Bytes of one index entry in the version this DatasetRT writes ([`index_entry_len`]).
pub const INDEX_ENTRY_LEN: u64 = index_entry_len(FORMAT_VERSION);
pub const RECORD_MAGIC: &[u8; 4] = b"DRTR";
pub const RECORD_HEADER_LEN: u64 = 40;
/// v1: bytes of the record header covered by the record checksum (all but the checksum itself).
pub const RECORD_HASHED_HEADER_LEN: usize = 32;
/// v2: where the range a record's checksum covers starts, relative to the record (after the
/// magic, 4 reserved bytes and the checksum); it ends with the payload.
pub const RECORD_V2_HASHED_FROM: u64 = 16;

pub const FLAG_LZ4: u32 = 1;
pub const KNOWN_FLAGS: u32 = FLAG_LZ4;

/// Bytes of one index entry in format `version`: 32 in v1 and v2, 40 from v3 on (the record's
/// metadata length and 4 bytes of zero padding).
pub const fn index_entry_len(version: u32) -> u64 {
    if version >= 3 {
        40
    } else {
        32
    }
}

pub fn align_up(x: u64) -> u64 {
    x.div_ceil(ALIGN) * ALIGN
}

pub fn shard_file_name(shard: u32) -> String {
    format!("{SHARDS_DIR}/{shard:06}.bin")
}

/// The header of shard `shard` as this version writes it.
pub fn shard_header(shard: u32) -> [u8; SHARD_HEADER_LEN as usize] {
    shard_header_of(FORMAT_VERSION, shard)
}

/// The header of shard `shard` in a cache of format `version`.
pub fn shard_header_of(version: u32, shard: u32) -> [u8; SHARD_HEADER_LEN as usize] {
    let mut h = [0u8; SHARD_HEADER_LEN as usize];
    h[..8].copy_from_slice(SHARD_MAGIC);
    h[8..12].copy_from_slice(&version.to_le_bytes());
    h[12..16].copy_from_slice(&shard.to_le_bytes());
    h
}

/// The header of `index.bin` as this version writes it.
pub fn index_header() -> [u8; INDEX_HEADER_LEN as usize] {
    index_header_of(FORMAT_VERSION)
}

/// The header of `index.bin` in a cache of format `version`.
pub fn index_header_of(version: u32) -> [u8; INDEX_HEADER_LEN as usize] {
    let mut h = [0u8; INDEX_HEADER_LEN as usize];
    h[..8].copy_from_slice(INDEX_MAGIC);
    h[8..12].copy_from_slice(&version.to_le_bytes());
    h[12..16].copy_from_slice(&(index_entry_len(version) as u32).to_le_bytes());
    h
}

/// Offset of the payload relative to the start of a record with `meta_len` bytes of metadata:
/// after the header and the metadata, on the next [`ALIGN`] boundary.
/// Checks a record on its own bytes, with no index at hand (a record arriving from object
/// storage): `bytes` start at the record's header and hold at least the whole record, whose
/// checksum must match (format v2 and later, where it covers one contiguous range). The index
/// entry is checked against the header later, by the read that serves it.
pub fn check_record_bytes(version: u32, bytes: &[u8]) -> Result<RecordHeader, String> {
    if version < 2 {
        return Err(format!(
            "format v{version} records cannot be checked on their own"
        ));
    }
    let h = RecordHeader::decode_as(version, bytes)?;
    let end = h.payload_offset() + u64::from(h.stored_len);
    if (bytes.len() as u64) < end {
        return Err(format!(
            "the record needs {end} bytes, {} arrived",
            bytes.len()
        ));
    }
    let actual = hash_bytes(&bytes[RECORD_V2_HASHED_FROM as usize..end as usize]);
    if actual != h.checksum {
        return Err(format!(
            "checksum mismatch: computed {}, stored {}",
            checksum_hex(actual),
            checksum_hex(h.checksum)
        ));
    }
    Ok(h)
}

pub fn payload_offset(meta_len: u32) -> u64 {
    align_up(RECORD_HEADER_LEN + u64::from(meta_len))
}

/// The fixed-width header in front of every record.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RecordHeader {
    pub flags: u32,
    pub meta_len: u32,
    pub stored_len: u32,
    pub raw_len: u32,
    pub sample: u64,
    pub checksum: u64,
}

impl RecordHeader {
    /// v1: the header bytes the checksum covers (all but the checksum, which follows them).
    fn v1_hashed_prefix(&self) -> [u8; RECORD_HASHED_HEADER_LEN] {
        let mut h = [0u8; RECORD_HASHED_HEADER_LEN];
        h[..4].copy_from_slice(RECORD_MAGIC);
        h[4..8].copy_from_slice(&self.flags.to_le_bytes());
        h[8..12].copy_from_slice(&self.meta_len.to_le_bytes());
        h[12..16].copy_from_slice(&self.stored_len.to_le_bytes());
        h[16..20].copy_from_slice(&self.raw_len.to_le_bytes());
        // 20..24 reserved, zero
        h[24..32].copy_from_slice(&self.sample.to_le_bytes());
        h
    }

    /// v2: the header's fields after the checksum, where the range the checksum covers starts.
    fn v2_fields(&self) -> [u8; (RECORD_HEADER_LEN - RECORD_V2_HASHED_FROM) as usize] {
        let mut h = [0u8; (RECORD_HEADER_LEN - RECORD_V2_HASHED_FROM) as usize];
        h[..4].copy_from_slice(&self.flags.to_le_bytes());
        h[4..8].copy_from_slice(&self.meta_len.to_le_bytes());
        h[8..12].copy_from_slice(&self.stored_len.to_le_bytes());
        h[12..16].copy_from_slice(&self.raw_len.to_le_bytes());
        h[16..24].copy_from_slice(&self.sample.to_le_bytes());
        h
    }

    /// The record checksum as this version writes it (see [`RecordHeader::checksum_as`]).
    pub fn compute_checksum(&self, metadata: &[u8], payload: &[u8]) -> u64 {
        self.checksum_as(FORMAT_VERSION, metadata, payload)
    }

    /// The record checksum in format `version`, from the record's pieces. v1: xxh3-64 over
    /// the header without its checksum, the metadata and the stored payload. v2: xxh3-64 over
    /// the record from [`RECORD_V2_HASHED_FROM`] to the payload's end (the header's fields, the
    /// metadata, its zero padding and the stored payload), which a reader hashes in one shot
    /// from the shard; the writer, holding the pieces apart, feeds the same bytes in order.
    pub fn checksum_as(&self, version: u32, metadata: &[u8], payload: &[u8]) -> u64 {
        let mut hasher = Xxh3::new();
        if version == 1 {
            hasher.update(&self.v1_hashed_prefix());
            hasher.update(metadata);
        } else {
            hasher.update(&self.v2_fields());
            hasher.update(metadata);
            // The zeros from the end of the metadata (`meta_len` bytes) up to the payload.
            let padding = self.payload_offset() - RECORD_HEADER_LEN - u64::from(self.meta_len);
            hasher.update(&[0u8; ALIGN as usize][..padding as usize]);
        }
        hasher.update(payload);
        hasher.digest()
    }

    /// The header as this version writes it.
    pub fn encode(&self) -> [u8; RECORD_HEADER_LEN as usize] {
        self.encode_as(FORMAT_VERSION)
    }

    /// The header in format `version`.
    pub fn encode_as(&self, version: u32) -> [u8; RECORD_HEADER_LEN as usize] {
        let mut h = [0u8; RECORD_HEADER_LEN as usize];
        if version == 1 {
            h[..RECORD_HASHED_HEADER_LEN].copy_from_slice(&self.v1_hashed_prefix());
            h[32..40].copy_from_slice(&self.checksum.to_le_bytes());
        } else {
            h[..4].copy_from_slice(RECORD_MAGIC);
            // 4..8 reserved, zero
            h[8..16].copy_from_slice(&self.checksum.to_le_bytes());
            h[RECORD_V2_HASHED_FROM as usize..].copy_from_slice(&self.v2_fields());
        }
        h
    }

    /// Parses a header written by this version; `Err` says what is wrong with it.
    pub fn decode(bytes: &[u8]) -> Result<Self, String> {
        Self::decode_as(FORMAT_VERSION, bytes)
    }

    /// Parses a header in format `version`; `Err` says what is wrong with it.
    pub fn decode_as(version: u32, bytes: &[u8]) -> Result<Self, String> {
        if bytes.len() < RECORD_HEADER_LEN as usize {
            return Err(format!(
                "record header truncated: {} of {RECORD_HEADER_LEN} bytes",
                bytes.len()
            ));
        }
        if &bytes[..4] != RECORD_MAGIC {
            return Err(format!("bad record magic {:02x?}", &bytes[..4]));
        }
        let reserved = if version == 1 { 20..24 } else { 4..8 };
        if bytes[reserved] != [0, 0, 0, 0] {
            return Err("reserved record header bytes are not zero".into());
        }
        let u32_at = |o: usize| u32::from_le_bytes(bytes[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap());
        Ok(if version == 1 {
            RecordHeader {
                flags: u32_at(4),
                meta_len: u32_at(8),
                stored_len: u32_at(12),
                raw_len: u32_at(16),
                sample: u64_at(24),
                checksum: u64_at(32),
            }
        } else {
            RecordHeader {
                checksum: u64_at(8),
                flags: u32_at(16),
                meta_len: u32_at(20),
                stored_len: u32_at(24),
                raw_len: u32_at(28),
                sample: u64_at(32),
            }
        })
    }

    /// Offset of the payload relative to the record start.
    pub fn payload_offset(&self) -> u64 {
        payload_offset(self.meta_len)
    }

    /// Length of the whole record including the trailing alignment padding.
    pub fn padded_len(&self) -> u64 {
        align_up(self.payload_offset() + u64::from(self.stored_len))
    }
}

/// One entry of `index.bin`. Every field repeats one of the record's header, which a read checks
/// it against; `meta_len` is there from v3 on (`None` in an entry of v1 or v2).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexEntry {
    pub offset: u64,
    pub shard: u32,
    pub flags: u32,
    pub stored_len: u32,
    pub raw_len: u32,
    pub meta_len: Option<u32>,
    pub checksum: u64,
}

impl IndexEntry {
    /// The entry as this version writes it (`meta_len` must be set).
    pub fn encode(&self) -> [u8; INDEX_ENTRY_LEN as usize] {
        let mut e = [0u8; INDEX_ENTRY_LEN as usize];
        self.encode_into(FORMAT_VERSION, &mut e);
        e
    }

    /// The entry in format `version`, [`index_entry_len`] bytes (for tests that forge caches of
    /// an older version).
    pub fn encode_as(&self, version: u32) -> Vec<u8> {
        let mut e = vec![0u8; index_entry_len(version) as usize];
        self.encode_into(version, &mut e);
        e
    }

    fn encode_into(&self, version: u32, e: &mut [u8]) {
        e[..8].copy_from_slice(&self.offset.to_le_bytes());
        e[8..12].copy_from_slice(&self.shard.to_le_bytes());
        e[12..16].copy_from_slice(&self.flags.to_le_bytes());
        e[16..20].copy_from_slice(&self.stored_len.to_le_bytes());
        e[20..24].copy_from_slice(&self.raw_len.to_le_bytes());
        if version >= 3 {
            let meta_len = self.meta_len.expect("a v3 index entry has meta_len");
            e[24..28].copy_from_slice(&meta_len.to_le_bytes());
            // 28..32: zero padding, so the checksum stays 8-byte aligned.
            e[32..40].copy_from_slice(&self.checksum.to_le_bytes());
        } else {
            e[24..32].copy_from_slice(&self.checksum.to_le_bytes());
        }
    }

    /// The entry of this version at the start of `e`.
    pub fn decode(e: &[u8]) -> Self {
        Self::decode_as(FORMAT_VERSION, e)
    }

    /// The entry of format `version` at the start of `e` (at least [`index_entry_len`] bytes).
    pub fn decode_as(version: u32, e: &[u8]) -> Self {
        let u32_at = |o: usize| u32::from_le_bytes(e[o..o + 4].try_into().unwrap());
        let u64_at = |o: usize| u64::from_le_bytes(e[o..o + 8].try_into().unwrap());
        let (meta_len, checksum) = if version >= 3 {
            (Some(u32_at(24)), u64_at(32))
        } else {
            (None, u64_at(24))
        };
        IndexEntry {
            offset: u64_at(0),
            shard: u32_at(8),
            flags: u32_at(12),
            stored_len: u32_at(16),
            raw_len: u32_at(20),
            meta_len,
            checksum,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CompressionAlgo {
    None,
    Lz4,
}

/// Shard compression: `algo="lz4"` keeps a record compressed only when the compressed payload is
/// at most `ratio` of the raw size; `algo="none"` requires `ratio=1.0`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Compression {
    pub algo: CompressionAlgo,
    pub ratio: f64,
}

impl Compression {
    pub const NONE: Compression = Compression {
        algo: CompressionAlgo::None,
        ratio: 1.0,
    };

    pub fn new(algo: &str, ratio: f64) -> crate::Result<Self> {
        let algo = match algo {
            "none" => CompressionAlgo::None,
            "lz4" => CompressionAlgo::Lz4,
            other => {
                return Err(crate::Error::config(
                    "shard_compression",
                    format!(
                        "unknown algo {other:?}; supported: \"none\", \"lz4\" (zstd is not in v0.1)"
                    ),
                ))
            }
        };
        let c = Compression { algo, ratio };
        c.validate()?;
        Ok(c)
    }

    pub fn validate(&self) -> crate::Result<()> {
        match self.algo {
            CompressionAlgo::None if self.ratio != 1.0 => Err(crate::Error::config(
                "shard_compression",
                format!("algo=\"none\" requires ratio=1.0, got {}", self.ratio),
            )),
            CompressionAlgo::Lz4 if !(self.ratio > 0.0 && self.ratio <= 1.0) => {
                Err(crate::Error::config(
                    "shard_compression",
                    format!(
                        "algo=\"lz4\" needs 0 < ratio <= 1 (keep a record compressed when it \
                         shrinks to at most ratio of its size), got {}",
                        self.ratio
                    ),
                ))
            }
            _ => Ok(()),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileEntry {
    pub file: String,
    pub bytes: u64,
    pub checksum: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShardEntry {
    pub file: String,
    pub bytes: u64,
    pub records: u64,
    pub checksum: String,
}

/// Where `sample_id` comes from: the user's `sample_id` metadata key, or the record position.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SampleIdSource {
    Metadata,
    Position,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    pub format: String,
    pub format_version: u32,
    pub writer_version: String,
    pub name: String,
    pub num_samples: u64,
    /// Every metadata key in first-sample order, `sample_id` included when the user gave it.
    pub metadata_schema: Vec<Field>,
    pub sample_id: SampleIdSource,
    pub sample_id_type: FieldType,
    pub compression: Compression,
    pub checksum_algo: String,
    pub alignment: u64,
    pub raw_payload_bytes: u64,
    pub stored_payload_bytes: u64,
    pub index: FileEntry,
    pub metadata: FileEntry,
    pub shards: Vec<ShardEntry>,
    /// Hash of everything above that identifies the content; a checkpoint carries it.
    pub fingerprint: String,
}

impl Manifest {
    /// The content fingerprint: xxh3-128 over the name, counts, schema and every file checksum.
    pub fn compute_fingerprint(&self) -> String {
        let mut h = xxhash_rust::xxh3::Xxh3::new();
        let mut put = |s: &str| {
            h.update(&(s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        };
        put(FORMAT_NAME);
        put(&self.format_version.to_string());
        put(&self.name);
        put(&self.num_samples.to_string());
        for f in &self.metadata_schema {
            put(&f.name);
            put(f.dtype.as_str());
        }
        put(&self.index.checksum);
        put(&self.metadata.checksum);
        for s in &self.shards {
            put(&s.checksum);
        }
        format!("{:032x}", h.digest128())
    }
}

/// The fingerprint of caches taken in order: xxh3-128 over each cache's fingerprint followed by
/// a newline, as 32 hex digits. It is a dataset's fingerprint, and a cache set's.
pub fn combined_fingerprint<'a>(fingerprints: impl IntoIterator<Item = &'a str>) -> String {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    for fp in fingerprints {
        h.update(fp.as_bytes());
        h.update(b"\n");
    }
    format!("{:032x}", h.digest128())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_header_round_trip_and_checksum_covers_every_field() {
        let mut h = RecordHeader {
            flags: FLAG_LZ4,
            meta_len: 17,
            stored_len: 100,
            raw_len: 300,
            sample: 9,
            checksum: 0,
        };
        for version in READABLE_VERSIONS {
            h.checksum = h.checksum_as(version, b"m", b"p");
            assert_eq!(
                RecordHeader::decode_as(version, &h.encode_as(version)).unwrap(),
                h
            );
            for field in 0..5 {
                let mut other = h;
                match field {
                    0 => other.flags = 0,
                    1 => other.meta_len = 18,
                    2 => other.stored_len = 101,
                    3 => other.raw_len = 301,
                    _ => other.sample = 10,
                }
                assert_ne!(
                    other.checksum_as(version, b"m", b"p"),
                    h.checksum,
                    "v{version} field {field}"
                );
            }
            assert_ne!(h.checksum_as(version, b"m", b"q"), h.checksum);
            assert_ne!(h.checksum_as(version, b"n", b"p"), h.checksum);
        }
        assert_ne!(h.checksum_as(1, b"m", b"p"), h.checksum_as(2, b"m", b"p"));
        assert_eq!(h.payload_offset(), 64);
        assert_eq!(h.padded_len(), 176);
    }

    #[test]
    fn v2_checksum_is_one_xxh3_over_the_record_from_its_fields_to_the_payload_end() {
        let meta = br#"{"label":3}"#;
        let payload: Vec<u8> = (0..1000u32).map(|i| (i * 7) as u8).collect();
        let mut h = RecordHeader {
            flags: 0,
            meta_len: meta.len() as u32,
            stored_len: payload.len() as u32,
            raw_len: payload.len() as u32,
            sample: 42,
            checksum: 0,
        };
        h.checksum = h.checksum_as(2, meta, &payload);
        // The record as the writer lays it out: header, metadata, zero padding, payload.
        let mut record = h.encode_as(2).to_vec();
        record.extend_from_slice(meta);
        record.resize(h.payload_offset() as usize, 0);
        record.extend_from_slice(&payload);
        assert_eq!(
            hash_bytes(&record[RECORD_V2_HASHED_FROM as usize..]),
            h.checksum
        );
        assert_eq!(&record[..4], RECORD_MAGIC);
        assert_eq!(record[8..16], h.checksum.to_le_bytes());
        // Read as v1, a v2 header has its meta_len where v1 keeps reserved zero bytes.
        assert!(RecordHeader::decode_as(1, &h.encode_as(2)).is_err());
    }

    #[test]
    fn headers_carry_the_version() {
        assert_eq!(shard_header_of(1, 3)[8..12], 1u32.to_le_bytes());
        assert_eq!(shard_header(3), shard_header_of(FORMAT_VERSION, 3));
        assert_eq!(index_header_of(1)[8..12], 1u32.to_le_bytes());
        assert_eq!(index_header(), index_header_of(FORMAT_VERSION));
        assert_eq!(FORMAT_VERSION, 3);
        // The header also says how long an entry is.
        assert_eq!(index_header_of(2)[12..16], 32u32.to_le_bytes());
        assert_eq!(index_header_of(3)[12..16], 40u32.to_le_bytes());
    }

    #[test]
    fn index_entry_round_trip() {
        let mut e = IndexEntry {
            offset: 1 << 40,
            shard: 3,
            flags: 1,
            stored_len: 5,
            raw_len: 6,
            meta_len: Some(70_000),
            checksum: u64::MAX - 1,
        };
        let bytes = e.encode();
        assert_eq!(bytes.len(), 40);
        assert_eq!(IndexEntry::decode(&bytes), e);
        assert_eq!(bytes[24..28], 70_000u32.to_le_bytes());
        assert_eq!(bytes[28..32], [0; 4]);
        assert_eq!(bytes[32..40], (u64::MAX - 1).to_le_bytes());
        assert_eq!(e.encode_as(3), bytes);
        // v1 and v2 entries have no metadata length: the checksum follows the lengths.
        e.meta_len = None;
        for version in [1, 2] {
            let old = e.encode_as(version);
            assert_eq!(old.len(), 32);
            assert_eq!(old[24..32], (u64::MAX - 1).to_le_bytes());
            assert_eq!(IndexEntry::decode_as(version, &old), e);
        }
    }

    #[test]
    fn compression_rules() {
        assert!(Compression::new("none", 1.0).is_ok());
        assert!(Compression::new("none", 0.5).is_err());
        assert!(Compression::new("lz4", 0.9).is_ok());
        assert!(Compression::new("lz4", 0.0).is_err());
        assert!(Compression::new("lz4", f64::NAN).is_err());
        assert!(Compression::new("zstd", 1.0).is_err());
    }
}

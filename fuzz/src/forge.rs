//! Caches as bytes: small valid caches written by the real writer, damage described by the fuzz
//! input, and re-signing (record checksums, file sizes and checksums, the fingerprint: the
//! steps of `dataset_rt_testkit::resign`) so that the damage reaches the structural checks and
//! parsers instead of stopping at a checksum.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use arbitrary::Arbitrary;
use dataset_rt_core::format::{hash_bytes, index_entry_len, Compression};
use dataset_rt_core::metadata::MetaValue;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::writer::{SampleInput, WriterOptions};
use dataset_rt_testkit::layout::{
    entries, entry_at, entry_layout, put, record_layout, record_of, version_of, Field,
};
use dataset_rt_testkit::resign::{resign_files, resign_fingerprint, resign_records};
use dataset_rt_testkit::{golden_dir, write_cache, writer_options, CacheFiles};
use serde_json::Value;

/// The file of `files` that `which` names (a shard chosen modulo their number; the index when
/// there is none).
pub fn file_mut(files: &mut CacheFiles, which: FileSel) -> &mut Vec<u8> {
    match which {
        FileSel::Manifest => &mut files.manifest,
        FileSel::Index => &mut files.index,
        FileSel::Metadata => &mut files.metadata,
        FileSel::Shard(i) => {
            if files.shards.is_empty() {
                &mut files.index
            } else {
                let n = files.shards.len();
                &mut files.shards[i as usize % n]
            }
        }
    }
}

/// The committed golden cache (`tests/data/golden_v1/golden`): every metadata type, NaN and
/// infinities, unicode, one LZ4 record, two shards. Read once per process.
pub fn golden() -> CacheFiles {
    static GOLDEN: OnceLock<CacheFiles> = OnceLock::new();
    GOLDEN
        .get_or_init(|| CacheFiles::read(&golden_dir(1)))
        .clone()
}

/// Payload bytes that compress well (`compressible`) or not at all.
fn payload(len: usize, seed: u64, compressible: bool) -> Vec<u8> {
    if compressible {
        return (0..len).map(|i| b"dataset-rt "[i % 11]).collect();
    }
    (0..len as u64)
        .map(|i| hash_bytes(&[seed.to_le_bytes(), i.to_le_bytes()].concat()) as u8)
        .collect()
}

fn samples(config: u8) -> Vec<SampleInput> {
    let n = usize::from(config & 7);
    let compressible = config & 0x80 == 0;
    (0..n)
        .map(|i| {
            let len = (i * 37 + usize::from(config)) % 150;
            let metadata = match (config >> 4) & 3 {
                0 => vec![],
                1 => vec![
                    ("sample_id".into(), MetaValue::Int(1000 - i as i64)),
                    ("flag".into(), MetaValue::Bool(i % 2 == 0)),
                    ("w".into(), MetaValue::Float(i as f64 / 3.0)),
                ],
                2 => vec![
                    ("sample_id".into(), MetaValue::Str(format!("s{i}é"))),
                    ("text".into(), MetaValue::Str("x".repeat(i))),
                    ("label".into(), MetaValue::Int(-(i as i64))),
                ],
                _ => vec![("label".into(), MetaValue::Int(i as i64 * 7))],
            };
            SampleInput {
                data: payload(len, i as u64, compressible),
                metadata,
            }
        })
        .collect()
}

/// A small valid cache written by the real writer: `config` decides the number of samples
/// (bits 0-2), LZ4 (bit 3), the metadata schema (bits 4-5), one record per shard (bit 6) and
/// incompressible payloads (bit 7). Each is written once per process.
pub fn base(config: u8) -> CacheFiles {
    static BASES: OnceLock<Mutex<HashMap<u8, CacheFiles>>> = OnceLock::new();
    static POOL: OnceLock<Arc<Pool>> = OnceLock::new();
    let bases = BASES.get_or_init(Default::default);
    if let Some(files) = bases.lock().unwrap().get(&config) {
        return files.clone();
    }
    let pool = POOL.get_or_init(|| Pool::new(1).expect("a pool of one worker"));
    let parent = crate::scratch().join(format!("base-{config}"));
    let _ = std::fs::remove_dir_all(&parent);
    let compression = if config & 8 != 0 {
        Compression::new("lz4", 1.0).unwrap()
    } else {
        Compression::NONE
    };
    let opts = WriterOptions {
        compression,
        validate: false,
        shard_size: if config & 0x40 != 0 { 64 } else { 1 << 20 },
        ..writer_options()
    };
    let dir = write_cache(pool, &parent, "c", opts, samples(config));
    let files = CacheFiles::read(&dir);
    let _ = std::fs::remove_dir_all(&parent);
    bases.lock().unwrap().insert(config, files.clone());
    files
}

/// The cache to start from: the golden cache, or a base cache.
pub fn start(selector: u16) -> CacheFiles {
    if selector % 257 == 256 {
        golden()
    } else {
        base((selector % 257) as u8)
    }
}

// ---- damage ----

#[derive(Arbitrary, Clone, Copy, Debug)]
pub enum FileSel {
    Manifest,
    Index,
    Metadata,
    Shard(u8),
}

#[derive(Arbitrary, Clone, Copy, Debug)]
pub enum IndexField {
    Offset,
    Shard,
    Flags,
    StoredLen,
    RawLen,
    /// From v3 on; nothing in older entries.
    MetaLen,
}

#[derive(Arbitrary, Clone, Copy, Debug)]
pub enum RecordField {
    Magic,
    Flags,
    MetaLen,
    StoredLen,
    RawLen,
    Reserved,
    Sample,
}

#[derive(Arbitrary, Clone, Copy, Debug)]
pub enum ManifestField {
    NumSamples,
    IndexBytes,
    MetadataBytes,
    ShardBytes(u8),
    ShardRecords(u8),
    RawPayloadBytes,
    StoredPayloadBytes,
    Alignment,
    FormatVersion,
}

/// Where a byte-level edit lands: from the start of the file or back from its end (the Arrow
/// footer and the last record are at the end).
#[derive(Arbitrary, Clone, Copy, Debug)]
pub struct At {
    pub offset: u16,
    pub from_end: bool,
}

impl At {
    fn resolve(self, len: usize) -> usize {
        let o = usize::from(self.offset);
        if self.from_end {
            len.saturating_sub(o)
        } else {
            o.min(len)
        }
    }
}

#[derive(Arbitrary, Clone, Debug)]
pub enum Damage {
    Flip {
        file: FileSel,
        at: At,
        mask: u8,
    },
    PutU32 {
        file: FileSel,
        at: At,
        value: u32,
    },
    PutU64 {
        file: FileSel,
        at: At,
        value: u64,
    },
    Truncate {
        file: FileSel,
        len: u16,
    },
    Insert {
        file: FileSel,
        at: At,
        bytes: Vec<u8>,
    },
    Overwrite {
        file: FileSel,
        at: At,
        bytes: Vec<u8>,
    },
    Replace {
        file: FileSel,
        bytes: Vec<u8>,
    },
    /// A field of index entry `entry`.
    Index {
        entry: u8,
        field: IndexField,
        value: u64,
    },
    /// A field of the record that index entry `sample` points at; `also_index` writes the same
    /// value into the entry, so that the two still agree.
    Record {
        sample: u8,
        field: RecordField,
        value: u64,
        also_index: bool,
    },
    /// Sets `num_samples`, resizes the index to match (copying entry 0 into new entries) and
    /// moves the difference onto the last shard's `records`.
    Samples {
        n: u8,
    },
    RemoveShardFile(u8),
    AddShardFile(Vec<u8>),
    /// Manifest edits (JSON, before the fingerprint is recomputed).
    Number {
        field: ManifestField,
        value: u64,
    },
    DropShardEntry(u8),
    DuplicateShardEntry(u8),
    SwapShardEntries(u8, u8),
    SchemaType {
        field: u8,
        to: u8,
    },
    SchemaRename {
        field: u8,
        to: String,
    },
    SchemaDrop(u8),
    IdSource(bool),
    IdType(bool),
    Compression {
        lz4: bool,
        ratio: f64,
    },
    Name(String),
}

/// Which re-signing steps to skip: a set bit keeps that checksum as the damage left it.
#[derive(Arbitrary, Clone, Copy, Debug)]
pub struct Keep(u8);

impl Keep {
    fn records(self) -> bool {
        self.0 & 1 != 0
    }
    fn files(self) -> bool {
        self.0 & 2 != 0
    }
    fn fingerprint(self) -> bool {
        self.0 & 4 != 0
    }
}

/// One fuzz case of the re-signing target.
#[derive(Arbitrary, Debug)]
pub struct Case {
    pub start: u16,
    pub keep: Keep,
    pub damage: Vec<Damage>,
    /// Byte edits of the manifest text, after it was re-signed.
    pub text: Vec<Damage>,
    pub full_validation: bool,
}

/// Where an index entry's field lies in format `version` (`None`: not in entries of it).
fn index_field(version: u32, field: IndexField) -> Option<Field> {
    let entry = entry_layout(version);
    match field {
        IndexField::Offset => Some(entry.offset),
        IndexField::Shard => Some(entry.shard),
        IndexField::Flags => Some(entry.flags),
        IndexField::StoredLen => Some(entry.stored_len),
        IndexField::RawLen => Some(entry.raw_len),
        IndexField::MetaLen => entry.meta_len,
    }
}

/// Where a record header's field lies in format `version`.
fn record_field(version: u32, field: RecordField) -> Field {
    let record = record_layout(version);
    match field {
        RecordField::Magic => record.magic,
        RecordField::Flags => record.flags,
        RecordField::MetaLen => record.meta_len,
        RecordField::StoredLen => record.stored_len,
        RecordField::RawLen => record.raw_len,
        RecordField::Reserved => record.reserved,
        RecordField::Sample => record.sample,
    }
}

fn le(value: u64, width: usize) -> Vec<u8> {
    value.to_le_bytes()[..width].to_vec()
}

fn manifest_number(m: &mut Value, field: ManifestField, value: u64) {
    let slot = match field {
        ManifestField::NumSamples => m.get_mut("num_samples"),
        ManifestField::IndexBytes => m.pointer_mut("/index/bytes"),
        ManifestField::MetadataBytes => m.pointer_mut("/metadata/bytes"),
        ManifestField::ShardBytes(i) => m.pointer_mut(&format!("/shards/{i}/bytes")),
        ManifestField::ShardRecords(i) => m.pointer_mut(&format!("/shards/{i}/records")),
        ManifestField::RawPayloadBytes => m.get_mut("raw_payload_bytes"),
        ManifestField::StoredPayloadBytes => m.get_mut("stored_payload_bytes"),
        ManifestField::Alignment => m.get_mut("alignment"),
        ManifestField::FormatVersion => m.get_mut("format_version"),
    };
    if let Some(slot) = slot {
        *slot = value.into();
    }
}

fn shards_mut(m: &mut Value) -> Option<&mut Vec<Value>> {
    m.get_mut("shards")?.as_array_mut()
}

fn schema_mut(m: &mut Value) -> Option<&mut Vec<Value>> {
    m.get_mut("metadata_schema")?.as_array_mut()
}

/// Applies one damage to the binary files (`manifest` is the parsed manifest).
fn damage_files(files: &mut CacheFiles, m: &mut Value, d: &Damage) {
    match d {
        Damage::Flip { file, at, mask } => {
            let f = file_mut(files, *file);
            let i = at.resolve(f.len());
            if let Some(b) = f.get_mut(i) {
                *b ^= *mask;
            }
        }
        Damage::PutU32 { file, at, value } => {
            let f = file_mut(files, *file);
            let i = at.resolve(f.len());
            put(f, i, &value.to_le_bytes());
        }
        Damage::PutU64 { file, at, value } => {
            let f = file_mut(files, *file);
            let i = at.resolve(f.len());
            put(f, i, &value.to_le_bytes());
        }
        Damage::Truncate { file, len } => file_mut(files, *file).truncate(usize::from(*len)),
        Damage::Insert { file, at, bytes } => {
            let f = file_mut(files, *file);
            let i = at.resolve(f.len());
            f.splice(i..i, bytes.iter().copied().take(4096));
        }
        Damage::Overwrite { file, at, bytes } => {
            let f = file_mut(files, *file);
            let i = at.resolve(f.len());
            let end = (i + bytes.len()).min(f.len());
            f[i..end].copy_from_slice(&bytes[..end - i]);
        }
        Damage::Replace { file, bytes } => {
            *file_mut(files, *file) = bytes.iter().copied().take(1 << 16).collect()
        }
        Damage::Index {
            entry,
            field,
            value,
        } => {
            let version = version_of(&files.index);
            let n = entries(version, &files.index);
            if let (true, Some((off, width))) = (n > 0, index_field(version, *field)) {
                let at = entry_at(version, usize::from(*entry) % n) + off;
                put(&mut files.index, at, &le(*value, width));
            }
        }
        Damage::Record {
            sample,
            field,
            value,
            also_index,
        } => {
            let version = version_of(&files.index);
            let n = entries(version, &files.index);
            if n == 0 {
                return;
            }
            let k = usize::from(*sample) % n;
            let Some((shard, offset)) = record_of(files, k) else {
                return;
            };
            let (off, width) = record_field(version, *field);
            if let Some(at) = offset.checked_add(off) {
                put(&mut files.shards[shard], at, &le(*value, width));
            }
            let in_index = match field {
                RecordField::Flags => index_field(version, IndexField::Flags),
                RecordField::StoredLen => index_field(version, IndexField::StoredLen),
                RecordField::RawLen => index_field(version, IndexField::RawLen),
                RecordField::MetaLen => index_field(version, IndexField::MetaLen),
                _ => None,
            };
            if let (true, Some((off, width))) = (*also_index, in_index) {
                put(
                    &mut files.index,
                    entry_at(version, k) + off,
                    &le(*value, width),
                );
            }
        }
        Damage::Samples { n } => {
            let n = usize::from(*n) % 16;
            let version = version_of(&files.index);
            let old = entries(version, &files.index);
            let entry0 = files
                .index
                .get(entry_at(version, 0)..entry_at(version, 1))
                .map(<[u8]>::to_vec)
                .unwrap_or_else(|| vec![0; index_entry_len(version) as usize]);
            files.index.resize(entry_at(version, old.min(n)), 0);
            for _ in old..n {
                files.index.extend_from_slice(&entry0);
            }
            m["num_samples"] = (n as u64).into();
            if let Some(last) = shards_mut(m).and_then(|s| s.last_mut()) {
                let records = last["records"].as_u64().unwrap_or(0);
                last["records"] = (records + n as u64).saturating_sub(old as u64).into();
            }
        }
        Damage::RemoveShardFile(i) => {
            if !files.shards.is_empty() {
                let n = files.shards.len();
                files.shards.remove(usize::from(*i) % n);
            }
        }
        Damage::AddShardFile(bytes) => files
            .shards
            .push(bytes.iter().copied().take(1 << 16).collect()),
        _ => {}
    }
}

/// Applies one manifest edit.
fn damage_manifest(m: &mut Value, d: &Damage) {
    match d {
        Damage::Number { field, value } => manifest_number(m, *field, *value),
        Damage::DropShardEntry(i) => {
            if let Some(s) = shards_mut(m).filter(|s| !s.is_empty()) {
                let n = s.len();
                s.remove(usize::from(*i) % n);
            }
        }
        Damage::DuplicateShardEntry(i) => {
            if let Some(s) = shards_mut(m).filter(|s| !s.is_empty()) {
                let n = s.len();
                let copy = s[usize::from(*i) % n].clone();
                s.push(copy);
            }
        }
        Damage::SwapShardEntries(a, b) => {
            if let Some(s) = shards_mut(m).filter(|s| !s.is_empty()) {
                let n = s.len();
                s.swap(usize::from(*a) % n, usize::from(*b) % n);
            }
        }
        Damage::SchemaType { field, to } => {
            if let Some(s) = schema_mut(m).filter(|s| !s.is_empty()) {
                let n = s.len();
                s[usize::from(*field) % n]["type"] =
                    ["bool", "int", "float", "str"][usize::from(*to) % 4].into();
            }
        }
        Damage::SchemaRename { field, to } => {
            if let Some(s) = schema_mut(m).filter(|s| !s.is_empty()) {
                let n = s.len();
                s[usize::from(*field) % n]["name"] = to.as_str().into();
            }
        }
        Damage::SchemaDrop(i) => {
            if let Some(s) = schema_mut(m).filter(|s| !s.is_empty()) {
                let n = s.len();
                s.remove(usize::from(*i) % n);
            }
        }
        Damage::IdSource(metadata) => {
            m["sample_id"] = if *metadata { "metadata" } else { "position" }.into()
        }
        Damage::IdType(int) => m["sample_id_type"] = if *int { "int" } else { "str" }.into(),
        Damage::Compression { lz4, ratio } => {
            m["compression"] =
                serde_json::json!({"algo": if *lz4 { "lz4" } else { "none" }, "ratio": ratio})
        }
        Damage::Name(name) => m["name"] = name.as_str().into(),
        _ => {}
    }
}

/// Builds the damaged, re-signed cache that `case` describes.
pub fn forge(case: &Case) -> CacheFiles {
    let mut files = start(case.start);
    let Ok(mut m) = serde_json::from_slice::<Value>(&files.manifest) else {
        unreachable!("the starting caches have valid manifests");
    };
    for d in case.damage.iter().take(16) {
        damage_files(&mut files, &mut m, d);
    }
    if !case.keep.records() {
        resign_records(&mut files);
    }
    if !case.keep.files() {
        resign_files(&files, &mut m);
    }
    for d in case.damage.iter().take(16) {
        damage_manifest(&mut m, d);
    }
    if !case.keep.fingerprint() {
        resign_fingerprint(&mut m);
    }
    // The directory must carry the name the manifest gives, when it is a usable one.
    if let Some(name) = m["name"].as_str() {
        if dataset_rt_core::writer::validate_name(name).is_ok() && name.len() < 100 {
            files.name = name.to_owned();
        }
    }
    let mut text = serde_json::to_vec_pretty(&m).expect("JSON values serialise");
    text.push(b'\n');
    files.manifest = text;
    for d in case.text.iter().take(8) {
        let d = match d.clone() {
            Damage::Flip { at, mask, .. } => Damage::Flip {
                file: FileSel::Manifest,
                at,
                mask,
            },
            Damage::Insert { at, bytes, .. } => Damage::Insert {
                file: FileSel::Manifest,
                at,
                bytes,
            },
            Damage::Overwrite { at, bytes, .. } => Damage::Overwrite {
                file: FileSel::Manifest,
                at,
                bytes,
            },
            Damage::Truncate { len, .. } => Damage::Truncate {
                file: FileSel::Manifest,
                len,
            },
            _ => continue,
        };
        damage_files(&mut files, &mut m, &d);
    }
    files
}

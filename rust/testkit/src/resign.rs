//! Re-signing a damaged cache the way a forger would, so that the damage gets past the checksums
//! to the structural checks and parsers behind them: each record's checksum (in its header and
//! its index entry), each file's size and checksum in the manifest, the manifest's fingerprint.
//!
//! Two levels. The steps, on a cache in memory ([`resign_records`], [`resign_files`],
//! [`resign_fingerprint`]), take any damage without panicking: the fuzz target `cache_resigned`
//! runs them, or skips some, on whatever its input made of the cache. The directory-level
//! helpers ([`resign`], [`edit_manifest`], [`forge_record`], [`forge_entry`]) are for tests that
//! forge one thing in a sound cache and check the one error it must cause.

use std::path::Path;

use dataset_rt_core::format::{
    align_up, checksum_hex, hash_bytes, shard_file_name, IndexEntry, Manifest, RecordHeader,
    INDEX_FILE, MANIFEST_FILE, RECORD_HASHED_HEADER_LEN, RECORD_HEADER_LEN, RECORD_V2_HASHED_FROM,
};
use serde_json::Value;
use xxhash_rust::xxh3::Xxh3;

use crate::edit::{write, write_at};
use crate::files::CacheFiles;
use crate::layout::{
    entries, entry_at, entry_layout, get_u32, put, record_layout, record_of, version_of,
};

/// The checksum the record at `start` of `shard` has in format `version`, computed from its
/// bytes as they are (its header's lengths included, whatever they say); `None` when its header
/// or its payload does not lie inside the shard.
pub fn record_checksum(version: u32, shard: &[u8], start: usize) -> Option<u64> {
    let header = start
        .checked_add(RECORD_HEADER_LEN as usize)
        .and_then(|end| shard.get(start..end))?;
    let fields = record_layout(version);
    let meta_len = u64::from(get_u32(header, fields.meta_len.0)?);
    let stored_len = u64::from(get_u32(header, fields.stored_len.0)?);
    let meta_start = start as u64 + RECORD_HEADER_LEN;
    let payload_start = start as u64 + align_up(RECORD_HEADER_LEN + meta_len);
    let payload_end = payload_start + stored_len;
    if payload_end > shard.len() as u64 {
        return None;
    }
    Some(if version == 1 {
        // v1: the header without its checksum, the metadata, the payload.
        let mut h = Xxh3::new();
        h.update(&header[..RECORD_HASHED_HEADER_LEN]);
        h.update(&shard[meta_start as usize..(meta_start + meta_len) as usize]);
        h.update(&shard[payload_start as usize..payload_end as usize]);
        h.digest()
    } else {
        // v2 and later: one range, from the header's fields to the payload's end.
        hash_bytes(&shard[start + RECORD_V2_HASHED_FROM as usize..payload_end as usize])
    })
}

/// Gives every record that lies inside its shard the checksum of its bytes, in its header and
/// in its index entry. Entries that point nowhere, and records past their shard, are skipped.
pub fn resign_records(files: &mut CacheFiles) {
    let version = version_of(&files.index);
    let in_record = record_layout(version).checksum.0;
    let in_entry = entry_layout(version).checksum.0;
    for k in 0..entries(version, &files.index) {
        let Some((shard, start)) = record_of(files, k) else {
            continue;
        };
        let Some(sum) = record_checksum(version, &files.shards[shard], start) else {
            continue;
        };
        let sum = sum.to_le_bytes();
        put(&mut files.shards[shard], start + in_record, &sum);
        put(&mut files.index, entry_at(version, k) + in_entry, &sum);
    }
}

/// Sets the size and checksum the manifest `m` gives for every file that exists: the index, the
/// metadata table, and the shards, the manifest's entries taken in order with the shard files.
/// Entries that are not objects, and entries or files beyond the shorter list, are left alone.
pub fn resign_files(files: &CacheFiles, m: &mut Value) {
    let sign = |entry: Option<&mut Value>, bytes: &[u8]| {
        if let Some(e) = entry.filter(|e| e.is_object()) {
            e["bytes"] = (bytes.len() as u64).into();
            e["checksum"] = checksum_hex(hash_bytes(bytes)).into();
        }
    };
    sign(m.get_mut("index"), &files.index);
    sign(m.get_mut("metadata"), &files.metadata);
    if let Some(shards) = m.get_mut("shards").and_then(Value::as_array_mut) {
        for (entry, bytes) in shards.iter_mut().zip(&files.shards) {
            sign(Some(entry), bytes);
        }
    }
}

/// Recomputes the fingerprint of the manifest `m`, when it still parses as a manifest.
pub fn resign_fingerprint(m: &mut Value) {
    if let Ok(manifest) = serde_json::from_value::<Manifest>(m.clone()) {
        m["fingerprint"] = manifest.compute_fingerprint().into();
    }
}

/// The manifest of the cache at `dir`.
pub fn manifest_of(dir: &Path) -> Manifest {
    let bytes = std::fs::read(dir.join(MANIFEST_FILE)).expect("read manifest.json");
    serde_json::from_slice(&bytes).expect("manifest.json parses")
}

/// Re-signs the cache at `dir` after damage: every record that lies inside its shard gets the
/// checksum of its bytes (in its header and its index entry), the manifest gets the size and
/// checksum of every file, then `edit` changes the manifest (a count, a setting) and its
/// fingerprint is recomputed over the result. The manifest must still parse.
pub fn resign(dir: &Path, edit: impl FnOnce(&mut Manifest)) {
    let mut files = CacheFiles::read(dir);
    resign_records(&mut files);
    let mut value: Value = serde_json::from_slice(&files.manifest).expect("manifest.json is JSON");
    resign_files(&files, &mut value);
    let mut manifest: Manifest =
        serde_json::from_value(value).expect("the re-signed manifest parses");
    sign_manifest(&mut manifest, edit);
    files.manifest = manifest_bytes(&manifest);
    files.store(dir);
}

/// Changes the manifest of the cache at `dir` with `edit` and recomputes its fingerprint, and
/// nothing else: the file sizes and checksums stay as they are, for tests of what is refused
/// before any file is hashed.
pub fn edit_manifest(dir: &Path, edit: impl FnOnce(&mut Manifest)) {
    let mut manifest = manifest_of(dir);
    sign_manifest(&mut manifest, edit);
    write(&dir.join(MANIFEST_FILE), &manifest_bytes(&manifest));
}

/// Forges the record header of `sample` in the cache at `dir`: `edit` changes its fields, its
/// index entry is made to agree with it (flags and lengths), and the cache is [`resign`]ed, the
/// record's checksum included. Only the checks of the forged values themselves can then catch
/// the forgery. The record must stay inside its shard, or it is left with its old checksum.
pub fn forge_record(dir: &Path, sample: u64, edit: impl FnOnce(&mut RecordHeader)) {
    let (version, entry) = read_entry(dir, sample);
    let shard = dir.join(shard_file_name(entry.shard));
    let bytes = std::fs::read(&shard).expect("read the record's shard");
    let mut header = RecordHeader::decode_as(version, &bytes[entry.offset as usize..])
        .expect("the record to forge has a sound header");
    edit(&mut header);
    write_at(&shard, entry.offset, &header.encode_as(version));
    let agreeing = IndexEntry {
        flags: header.flags,
        stored_len: header.stored_len,
        raw_len: header.raw_len,
        meta_len: entry.meta_len.map(|_| header.meta_len),
        ..entry
    };
    write_entry(dir, version, sample, &agreeing);
    resign(dir, |_| {});
}

/// Forges the index entry of `sample` in the cache at `dir` alone: `edit` changes its fields,
/// the record stays as it is, and the cache is [`resign`]ed (the entry's checksum is then the
/// record's again). What the entry now claims disagrees with the record's header.
pub fn forge_entry(dir: &Path, sample: u64, edit: impl FnOnce(&mut IndexEntry)) {
    let (version, mut entry) = read_entry(dir, sample);
    edit(&mut entry);
    write_entry(dir, version, sample, &entry);
    resign(dir, |_| {});
}

/// The format version of the cache at `dir` (from its index's header) and `sample`'s entry.
fn read_entry(dir: &Path, sample: u64) -> (u32, IndexEntry) {
    let index = std::fs::read(dir.join(INDEX_FILE)).expect("read index.bin");
    let version = version_of(&index);
    let at = entry_at(version, sample as usize);
    (version, IndexEntry::decode_as(version, &index[at..]))
}

fn write_entry(dir: &Path, version: u32, sample: u64, entry: &IndexEntry) {
    let at = entry_at(version, sample as usize) as u64;
    write_at(&dir.join(INDEX_FILE), at, &entry.encode_as(version));
}

/// Applies `edit`, then recomputes the fingerprint over the result.
fn sign_manifest(manifest: &mut Manifest, edit: impl FnOnce(&mut Manifest)) {
    edit(manifest);
    manifest.fingerprint = manifest.compute_fingerprint();
}

/// The manifest as the writer writes it: pretty JSON and a newline.
fn manifest_bytes(manifest: &Manifest) -> Vec<u8> {
    let mut json = serde_json::to_vec_pretty(manifest).expect("a manifest serialises");
    json.push(b'\n');
    json
}

//! Byte edits of a cache's files, as damage or as a forger's changes. The writer publishes every
//! file read-only: each edit makes its file writable first, as someone damaging it would. Edits
//! are made in place, on the file itself, as another writer's would be: a cache that has the file
//! open and mapped sees them.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

/// Makes `path` writable by its owner (mode 0644).
pub fn make_writable(path: &Path) {
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))
        .unwrap_or_else(|e| panic!("make {} writable: {e}", path.display()));
}

/// Overwrites the bytes of `path` from `offset` on with `bytes`. They must lie inside the file:
/// its size stays.
pub fn write_at(path: &Path, offset: u64, bytes: &[u8]) {
    let mut file = open_at(path, offset, bytes.len());
    file.write_all(bytes)
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// Flips every bit of the byte of `path` at `offset`.
pub fn flip_byte(path: &Path, offset: u64) {
    let mut byte = [0u8];
    open_at(path, offset, 1)
        .read_exact(&mut byte)
        .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
    write_at(path, offset, &[!byte[0]]);
}

/// Cuts `path` to `len` bytes, or extends it with zeros (a sparse file) to that length.
pub fn set_len(path: &Path, len: u64) {
    make_writable(path);
    open(path)
        .set_len(len)
        .unwrap_or_else(|e| panic!("set the length of {}: {e}", path.display()));
}

/// Replaces the whole contents of `path` (the same file, cut and written again).
pub(crate) fn write(path: &Path, bytes: &[u8]) {
    make_writable(path);
    std::fs::write(path, bytes).unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}

/// `path` made writable and opened for reading and writing at `offset`, where `len` bytes must
/// lie inside it.
fn open_at(path: &Path, offset: u64, len: usize) -> File {
    make_writable(path);
    let mut file = open(path);
    let size = file.metadata().expect("the file's size").len();
    assert!(
        offset + len as u64 <= size,
        "{len} bytes at {offset} lie past the end of {} ({size} bytes)",
        path.display()
    );
    file.seek(SeekFrom::Start(offset))
        .unwrap_or_else(|e| panic!("seek in {}: {e}", path.display()));
    file
}

fn open(path: &Path) -> File {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap_or_else(|e| panic!("open {}: {e}", path.display()))
}

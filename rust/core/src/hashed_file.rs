//! Files written once and checksummed on the way: every byte is hashed as it is written, so a
//! file's checksum costs no second read.

use std::fs::{File, Permissions};
use std::io::{BufWriter, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use xxhash_rust::xxh3::Xxh3;

use crate::error::{Error, IoContext, Result};
use crate::format::checksum_hex;

/// Hashes every byte it passes on, so file checksums cost no second read.
pub(crate) struct HashingWriter<W: Write> {
    inner: W,
    hasher: Xxh3,
    pub(crate) written: u64,
}

impl<W: Write> HashingWriter<W> {
    pub(crate) fn new(inner: W) -> Self {
        HashingWriter {
            inner,
            hasher: Xxh3::new(),
            written: 0,
        }
    }
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.written += n as u64;
        Ok(n)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// The mode of every published file: read-only for everyone, so that an accidental in-place
/// write fails instead of changing bytes a reader has already verified or mapped.
pub(crate) const PUBLISHED_FILE_MODE: u32 = 0o444;

/// Makes a finished file read-only (before it is synced and published).
pub(crate) fn make_read_only(file: &File, path: &Path) -> Result<()> {
    file.set_permissions(Permissions::from_mode(PUBLISHED_FILE_MODE))
        .ctx("make read-only", path)
}

/// Flushes, makes read-only and syncs the file; returns its length and checksum.
pub(crate) fn finish_file(w: HashingWriter<BufWriter<File>>, path: &Path) -> Result<(u64, String)> {
    let checksum = checksum_hex(w.hasher.digest());
    let file = w
        .inner
        .into_inner()
        .map_err(|e| Error::io("write", path, e.into_error()))?;
    make_read_only(&file, path)?;
    file.sync_all().ctx("sync", path)?;
    Ok((w.written, checksum))
}

pub(crate) fn create_file(path: &Path) -> Result<HashingWriter<BufWriter<File>>> {
    let f = File::create(path).ctx("create", path)?;
    Ok(HashingWriter::new(BufWriter::with_capacity(1 << 20, f)))
}

//! Files written once and checksummed on the way: every byte is hashed as it is written, so a
//! file's checksum costs no second read.

use std::fs::{File, Permissions};
use std::io::{BufWriter, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use xxhash_rust::xxh3::Xxh3;

use crate::checksum::checksum_hex;
use crate::error::{Error, IoContext, Result};

/// Hashes every byte it passes on, so file checksums cost no second read.
pub(crate) struct HashingWriter<W: Write> {
    inner: W,
    hasher: Xxh3,
    pub(crate) written: u64,
    /// Bytes up to here were handed to the kernel's writeback (`start_writeback`).
    writeback_from: u64,
}

/// How many written bytes `start_writeback` lets accumulate before it starts their writeback.
const WRITEBACK_STEP: u64 = 8 << 20;

impl<W: Write> HashingWriter<W> {
    pub(crate) fn new(inner: W) -> Self {
        HashingWriter {
            inner,
            hasher: Xxh3::new(),
            written: 0,
            writeback_from: 0,
        }
    }
}

impl HashingWriter<BufWriter<File>> {
    /// Starts the disk writes of what has reached the page cache, every `WRITEBACK_STEP`
    /// bytes, without waiting for them (`sync_file_range(SYNC_FILE_RANGE_WRITE)`), so that the
    /// disk works while the file is still being written and the `fsync` that publishes it has
    /// only the tail left. A hint: the `fsync` in `finish_file` still decides durability and
    /// reports any write error, so a failed hint is ignored.
    pub(crate) fn start_writeback(&mut self) {
        let in_kernel = self.written - self.inner.buffer().len() as u64;
        if in_kernel - self.writeback_from < WRITEBACK_STEP {
            return;
        }
        #[cfg(target_os = "linux")]
        {
            use std::os::fd::AsRawFd;
            let (Ok(from), Ok(len)) = (
                libc::off64_t::try_from(self.writeback_from),
                libc::off64_t::try_from(in_kernel - self.writeback_from),
            ) else {
                return;
            };
            // SAFETY: a plain system call on a descriptor this writer owns; it reads no memory.
            unsafe {
                libc::sync_file_range(
                    self.inner.get_ref().as_raw_fd(),
                    from,
                    len,
                    libc::SYNC_FILE_RANGE_WRITE,
                )
            };
        }
        self.writeback_from = in_kernel;
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checksum::hash_bytes;

    #[test]
    fn writeback_starts_every_step_and_changes_no_byte() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let mut w = create_file(&path).unwrap();
        let data: Vec<u8> = (0..20u32 << 20).map(|i| (i * 31 % 251) as u8).collect();
        let mut marks = Vec::new();
        for piece in data.chunks(4096 + 40) {
            w.write_all(piece).unwrap();
            w.start_writeback();
            if marks.last() != Some(&w.writeback_from) {
                marks.push(w.writeback_from);
            }
        }
        // Started in steps of at least WRITEBACK_STEP, only over bytes already in the kernel.
        assert!(marks.len() >= 3, "{marks:?}");
        for pair in marks.windows(2) {
            assert!(pair[1] - pair[0] >= WRITEBACK_STEP, "{marks:?}");
        }
        assert!(*marks.last().unwrap() <= w.written);
        let (len, checksum) = finish_file(w, &path).unwrap();
        assert_eq!(len, data.len() as u64);
        assert_eq!(checksum, checksum_hex(hash_bytes(&data)));
        assert_eq!(std::fs::read(&path).unwrap(), data);
    }
}

//! Turning a mapping of a ring slot into private memory in place, so that a batch the training
//! loop still holds outlives its slot: the views keep their address and content while the slot
//! goes back to the producer.

use std::io;

use crate::{Result, ShmError};

fn page_size() -> usize {
    // SAFETY: sysconf with a valid name has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(size).unwrap_or(4096)
}

fn os_error(op: &'static str, len: usize) -> ShmError {
    ShmError::Memory {
        op,
        len,
        source: io::Error::last_os_error(),
    }
}

/// Replaces the pages of the mapping at `addr` (page aligned, `len` bytes, rounded up to whole
/// pages) by a private anonymous copy of its first `len` bytes, with protection `prot`
/// (`libc::PROT_READ`, say). The address, the length and the content stay the same; later
/// changes of the file that was mapped no longer show through, and the pages are freed by the
/// `munmap` that would have ended the old mapping.
///
/// The copy is built aside and moved over the old mapping by one `mremap(MREMAP_FIXED)`, which
/// unmaps the old pages and maps the new ones in a single step: a thread reading the range
/// meanwhile sees the same bytes, and no other mapping of the process can take the address in
/// between. On error the old mapping is left as it was.
///
/// # Safety
/// `addr .. addr + len` must be one mapping that stays mapped during the call, readable, and that
/// nothing writes meanwhile; its owner must end it with `munmap` (of at most the rounded length).
pub unsafe fn replace_with_private_copy(
    addr: *mut u8,
    len: usize,
    prot: libc::c_int,
) -> Result<()> {
    let page = page_size();
    if len == 0 || (addr as usize) % page != 0 {
        return Err(ShmError::Protocol(format!(
            "cannot make {len} bytes at {addr:p} private: a non-empty, page-aligned mapping is \
             required"
        )));
    }
    let rounded = len.div_ceil(page) * page;
    // SAFETY: a fresh anonymous mapping, placed by the kernel.
    let copy = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            rounded,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if copy == libc::MAP_FAILED {
        return Err(os_error("mmap", rounded));
    }
    let discard = |err: ShmError| {
        // SAFETY: `copy` is the mapping made above, not yet moved.
        unsafe { libc::munmap(copy, rounded) };
        err
    };
    // SAFETY: both ranges are mapped for `len` bytes (the caller's contract, and `rounded >=
    // len`), and distinct mappings cannot overlap.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, copy as *mut u8, len) };
    // SAFETY: the range is the mapping made above.
    if unsafe { libc::mprotect(copy, rounded, prot) } != 0 {
        return Err(discard(os_error("mprotect", rounded)));
    }
    // SAFETY: moves our own mapping over the caller's, which the caller allows to be replaced.
    let moved = unsafe {
        libc::mremap(
            copy,
            rounded,
            rounded,
            libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED,
            addr as *mut libc::c_void,
        )
    };
    if moved == libc::MAP_FAILED {
        return Err(discard(os_error("mremap", rounded)));
    }
    debug_assert_eq!(moved as usize, addr as usize);
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::fs::File;
    use std::os::unix::fs::FileExt;

    use memmap2::{Mmap, MmapOptions};

    use super::*;

    /// A file of `len` bytes with content `fill(i)` at offset `i`, and a read-only shared
    /// mapping of `map_len` bytes of it from `offset`.
    fn mapped(len: usize, offset: u64, map_len: usize) -> (File, Mmap) {
        let file = tempfile::tempfile().unwrap();
        let bytes: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8).collect();
        file.write_all_at(&bytes, 0).unwrap();
        // SAFETY: a private temporary file; the test changes it only to check what shows.
        let map = unsafe { MmapOptions::new().offset(offset).len(map_len).map(&file) }.unwrap();
        (file, map)
    }

    fn mapping_line(addr: usize) -> String {
        let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
        maps.lines()
            .find(|line| {
                let (range, _) = line.split_once(' ').unwrap();
                let (lo, hi) = range.split_once('-').unwrap();
                let lo = usize::from_str_radix(lo, 16).unwrap();
                let hi = usize::from_str_radix(hi, 16).unwrap();
                (lo..hi).contains(&addr)
            })
            .unwrap_or_else(|| panic!("{addr:#x} is not mapped"))
            .to_owned()
    }

    #[test]
    fn the_copy_keeps_address_and_content_and_no_longer_shows_the_file() {
        let page = page_size();
        // A mapping that starts two pages in and ends inside its third page.
        let (file, map) = mapped(8 * page, 2 * page as u64, 2 * page + 100);
        let before = map.to_vec();
        let addr = map.as_ptr() as usize;
        file.write_all_at(b"shared", 2 * page as u64).unwrap();
        assert_eq!(
            &map[..6],
            b"shared",
            "a shared mapping shows the file's changes"
        );
        let before_line = mapping_line(addr);

        // SAFETY: `map` is one read-only mapping of this length, written by nobody meanwhile.
        unsafe { replace_with_private_copy(map.as_ptr() as *mut u8, map.len(), libc::PROT_READ) }
            .unwrap();

        assert_eq!(map.as_ptr() as usize, addr);
        assert_eq!(&map[..6], b"shared");
        assert_eq!(&map[6..], &before[6..]);
        file.write_all_at(&[0xEE; 4096], 2 * page as u64).unwrap();
        file.write_all_at(&[0xEE; 200], 4 * page as u64).unwrap();
        assert_eq!(
            &map[..6],
            b"shared",
            "the file's later changes must not show through"
        );
        assert_eq!(&map[6..], &before[6..]);
        let after_line = mapping_line(addr);
        assert_ne!(before_line, after_line);
        // An anonymous mapping has inode 0 and no path; its protection stayed read-only.
        let fields: Vec<&str> = after_line.split_whitespace().collect();
        assert_eq!((fields[1], fields[4], fields.get(5)), ("r--p", "0", None));
        drop(map); // munmaps the private pages
    }

    #[test]
    fn an_unaligned_or_empty_range_is_refused_and_left_alone() {
        let (_file, map) = mapped(4 * page_size(), 0, 3 * page_size());
        let addr = map.as_ptr() as *mut u8;
        // SAFETY: refused before anything is touched.
        let err = unsafe { replace_with_private_copy(addr.add(1), 10, libc::PROT_READ) };
        assert!(err.unwrap_err().to_string().contains("page-aligned"));
        // SAFETY: as above.
        let err = unsafe { replace_with_private_copy(addr, 0, libc::PROT_READ) };
        assert!(err.unwrap_err().to_string().contains("non-empty"));
        assert!(mapping_line(map.as_ptr() as usize).contains("r--s"));
    }
}

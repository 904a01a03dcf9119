//! A small valid cache (written by the real writer, or the golden one), damaged as the input
//! says, re-signed (record checksums, file sizes and checksums, fingerprint: each step can be
//! skipped), written to disk, then opened and read every way the reader can.
#![no_main]

use dataset_rt_fuzz::{exercise, forge, guarded, scratch};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|case: forge::Case| {
    guarded(|| {
        let files = forge::forge(&case);
        let dir = files.write(scratch());
        exercise::open_and_read(&dir, case.full_validation);
    });
});

//! `manifest.json` as the input gives it, beside the golden cache's other files. The first byte
//! picks the variant: bit 0 set recomputes the fingerprint of a manifest that still parses, so
//! the checks after the fingerprint are reached.
#![no_main]

use dataset_rt_fuzz::{exercise, forge, guarded, scratch};
use dataset_rt_testkit::resign::resign_fingerprint;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    guarded(|| {
        let Some((&flags, text)) = data.split_first() else {
            return;
        };
        let mut files = forge::golden();
        files.manifest = text.to_vec();
        if flags & 1 != 0 {
            if let Ok(mut m) = serde_json::from_slice::<serde_json::Value>(text) {
                resign_fingerprint(&mut m);
                files.manifest = serde_json::to_vec(&m).unwrap();
            }
        }
        let dir = files.write(scratch());
        // The manifest parser alone, then everything after it.
        let _ = dataset_rt_core::cache::read_manifest(&dir, "golden");
        exercise::open_and_read(&dir, flags & 2 != 0);
    });
});

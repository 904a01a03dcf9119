//! Everything a reader does with a cache: open it, read every record and every metadata value,
//! verify it, look samples up by id. Errors must be the documented kinds; a panic, an abort or
//! an allocation past libFuzzer's limits is a finding.

use std::path::Path;
use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::{Dataset, Payload};
use dataset_rt_core::format::FLAG_LZ4;
use dataset_rt_core::metadata::MetaRef;
use dataset_rt_core::Error;

/// At most this many samples are read from one forged cache (forged caches are small anyway).
const MAX_SAMPLES: u64 = 4096;

/// A load error must say the cache is malformed and name a file inside it (or be an OS error).
fn check_open_error(dir: &Path, e: &Error) {
    match e {
        Error::Malformed { file, .. } => {
            assert!(
                file.starts_with(dir),
                "malformed names {file:?} outside {dir:?}"
            )
        }
        Error::Io { .. } => {}
        other => panic!("opening a damaged cache gave {other:?}, not a malformed cache"),
    }
}

/// A read error must name the record (or, for a whole-shard check, the malformed file).
fn check_read_error(cache: &Cache, sample: Option<u64>, e: &Error) {
    match e {
        Error::CorruptRecord {
            sample: s, shard, ..
        } => {
            if let Some(want) = sample {
                assert_eq!(*s, want, "corrupt record names another sample");
            }
            assert!(
                shard.starts_with(&cache.dir),
                "record error names {shard:?}"
            );
        }
        Error::Malformed { file, .. } if sample.is_none() => {
            assert!(file.starts_with(&cache.dir), "malformed names {file:?}")
        }
        Error::Io { .. } => {}
        other => panic!("reading sample {sample:?} gave {other:?}"),
    }
}

fn touch(v: MetaRef<'_>) -> usize {
    match v {
        MetaRef::Bool(b) => usize::from(b),
        MetaRef::Int(i) => i as usize,
        MetaRef::Float(f) => f.to_bits() as usize,
        MetaRef::Str(s) => s.len(),
    }
}

/// Reads every sample of an opened cache every way the reader can.
pub fn read_everything(cache: Cache) {
    let n = cache.len().min(MAX_SAMPLES);
    // `metadata.arrow` is checked at the first use of the table: a damaged one is malformed.
    match cache.metadata() {
        Ok(table) => assert_eq!(table.rows(), cache.len(), "metadata rows"),
        Err(e) => check_open_error(&cache.dir, &e),
    }
    let mut sum = 0usize;
    for k in 0..n {
        match cache.payload(k) {
            Ok(p) => {
                let e = cache.entry(k);
                assert_eq!(p.len() as u64, u64::from(e.raw_len), "payload length");
                if e.flags & FLAG_LZ4 == 0 {
                    assert_eq!(e.stored_len, e.raw_len, "a raw record's lengths differ");
                }
                sum = sum.wrapping_add(p.len());
            }
            Err(e) => check_read_error(&cache, Some(k), &e),
        }
        match cache.embedded_metadata(k) {
            Ok(v) => sum = sum.wrapping_add(usize::from(v.is_object())),
            Err(e) => check_read_error(&cache, Some(k), &e),
        }
        if let Ok(table) = cache.metadata() {
            for (name, v) in table.row(k) {
                sum = sum.wrapping_add(name.len()).wrapping_add(touch(v));
            }
            sum = sum.wrapping_add(touch(table.sample_id(k)));
        }
    }
    if let Err(e) = cache.verify_all() {
        check_read_error(&cache, None, &e);
    }
    let ds = Dataset::new(vec![Arc::new(cache)]);
    let cache = &ds.caches[0];
    for k in 0..n {
        match ds.fetch(k) {
            Ok(f) => {
                if let Payload::Mapped { shard, offset, len } = f.payload {
                    assert!((shard as usize) < cache.num_shards());
                    let shard_len = cache.shard_file(shard).metadata().unwrap().len();
                    assert!(offset + len <= shard_len, "a mapped payload past its shard");
                }
            }
            Err(e) => check_read_error(cache, Some(k), &e),
        }
        let Ok(table) = cache.metadata() else {
            continue;
        };
        let id = table.sample_id(k);
        match ds.find_sample(0, id) {
            Ok(Some(row)) => assert_eq!(table.sample_id(row), id, "find_sample found another id"),
            Ok(None) => {}
            Err(e) => panic!("find_sample on a table that loaded gave {e:?}"),
        }
    }
    std::hint::black_box(sum);
}

/// Opens the cache directory `dir` and reads everything it offers.
pub fn open_and_read(dir: &Path, full: bool) {
    let validation = if full {
        Validation::Full
    } else {
        Validation::Structure
    };
    match Cache::open(dir, validation) {
        Ok(cache) => read_everything(cache),
        Err(e) => check_open_error(dir, &e),
    }
}

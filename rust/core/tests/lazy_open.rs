//! Opening reads no byte per sample: `index.bin` entries are checked against their records as
//! they are read, and `metadata.arrow` by its checksum and decoding at the first use of the
//! table. Full validation still checks both at open.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::{Dataset, WeightTable};
use dataset_rt_core::format::SampleIdSource;
use dataset_rt_core::metadata::{MetaRef, MetaValue};
use dataset_rt_core::pool::Pool;
use dataset_rt_core::samples;
use dataset_rt_core::verify::VerifyPolicy;
use dataset_rt_core::writer::WriterOptions;
use dataset_rt_core::Error;
use dataset_rt_testkit::{golden_copy, sample, write_cache, writer_options};

const POLICIES: [VerifyPolicy; 3] = [
    VerifyPolicy::Always,
    VerifyPolicy::Once,
    VerifyPolicy::Never,
];

/// Overwrites `path` from byte `from` to its end with `byte`, keeping its size.
fn fill_from(path: &Path, from: usize, byte: u8) {
    let mut bytes = std::fs::read(path).unwrap();
    bytes[from..].fill(byte);
    std::fs::write(path, bytes).unwrap();
}

fn malformed(err: Error) -> (PathBuf, String) {
    match err {
        Error::Malformed { file, reason, .. } => (file, reason),
        other => panic!("expected Malformed, got {other:?}"),
    }
}

/// `sample` is refused as a corrupt record whose reason contains `reason`.
fn assert_corrupt(err: Error, sample: u64, reason: &str) {
    match err {
        Error::CorruptRecord {
            cache,
            sample: s,
            reason: r,
            ..
        } => {
            assert_eq!((cache.as_str(), s), ("golden", sample));
            assert!(r.contains(reason), "sample {sample}: {r}");
        }
        other => panic!("sample {sample}: expected CorruptRecord, got {other:?}"),
    }
}

/// Every read of every sample, by each way a reader has, under each policy.
fn assert_every_read_refused(cache: &Arc<Cache>, reason: &str) {
    for sample in 0..cache.len() {
        for checksum in [false, true] {
            assert_corrupt(
                cache.check_record(sample, checksum).unwrap_err(),
                sample,
                reason,
            );
        }
        assert_corrupt(cache.payload(sample).unwrap_err(), sample, reason);
        assert_corrupt(cache.embedded_metadata(sample).unwrap_err(), sample, reason);
        for policy in POLICIES {
            let ds = Dataset::new(vec![cache.clone()]).with_verify(policy);
            // The read-ahead's hints and budget read the entry too: no panic, no allocation.
            ds.prefetch_record(sample);
            ds.decoded_bytes(sample);
            let Err(err) = ds.fetch(sample) else {
                panic!("sample {sample} was read under {policy:?}")
            };
            assert_corrupt(err, sample, reason);
        }
    }
}

#[test]
fn an_index_of_garbage_after_its_header_opens_and_every_read_refuses_it() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy(tmp.path());
    fill_from(&dir.join("index.bin"), 16, 0xa5);

    let cache = Arc::new(Cache::open(&dir, Validation::Structure).expect("opening reads no entry"));
    assert_eq!(cache.len(), 6);
    assert_every_read_refused(
        &cache,
        "index.bin names shard 2779096485, which does not exist (the cache has 2)",
    );
    assert!(cache.verify_all().is_err());

    let (file, reason) = malformed(Cache::open(&dir, Validation::Full).err().unwrap());
    assert_eq!(file, dir.join("index.bin"));
    assert!(reason.starts_with("checksum mismatch"), "{reason}");
}

#[test]
fn index_entries_past_their_shard_or_of_another_record_are_refused_at_read() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy(tmp.path());
    let index = dir.join("index.bin");
    let original = std::fs::read(&index).unwrap();

    // Every entry's offset (its first 8 bytes) far past the end of its shard.
    let mut past = original.clone();
    for entry in past[16..].chunks_mut(32) {
        entry[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    }
    std::fs::write(&index, &past).unwrap();
    let cache = Arc::new(Cache::open(&dir, Validation::Structure).unwrap());
    assert_every_read_refused(&cache, "record lies past the end of its shard");
    drop(cache);

    // Entries 0 and 1 swapped: each names the other's record.
    let mut swapped = original.clone();
    swapped[16..48].copy_from_slice(&original[48..80]);
    swapped[48..80].copy_from_slice(&original[16..48]);
    std::fs::write(&index, &swapped).unwrap();
    let cache = Arc::new(Cache::open(&dir, Validation::Structure).unwrap());
    for policy in POLICIES {
        let ds = Dataset::new(vec![cache.clone()]).with_verify(policy);
        for sample in [0, 1] {
            assert_corrupt(
                ds.fetch(sample).err().unwrap(),
                sample,
                "(index.bin or the shard is damaged)",
            );
        }
        for sample in 2..cache.len() {
            ds.fetch(sample).unwrap();
        }
    }
    assert!(Cache::open(&dir, Validation::Full).is_err());
}

#[test]
fn a_damaged_metadata_file_is_refused_at_the_first_use_of_the_table() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = golden_copy(tmp.path());
    fill_from(&dir.join("metadata.arrow"), 8, 0);

    let cache = Arc::new(Cache::open(&dir, Validation::Structure).expect("opening reads none"));
    assert!(!cache.metadata_loaded());
    // Records and their embedded metadata need no table.
    for sample in 0..cache.len() {
        cache.payload(sample).unwrap();
        cache.embedded_metadata(sample).unwrap();
    }
    let (file, reason) = malformed(cache.metadata().err().unwrap());
    assert_eq!(file, dir.join("metadata.arrow"));
    assert!(reason.starts_with("checksum mismatch"), "{reason}");
    assert!(cache.metadata_loaded());

    // Every use of the table reports it: the samples-metadata table, its rows, and the lookup
    // of the ids the user gave (this cache's ids are strings kept in the table).
    assert_eq!(cache.manifest.sample_id, SampleIdSource::Metadata);
    let ds = Dataset::new(vec![cache.clone()]);
    let uniform = WeightTable::uniform();
    for err in [
        samples::table(&ds, &uniform).err().unwrap(),
        samples::rows(&ds, &uniform, &[0]).err().unwrap(),
        ds.find_sample(0, MetaRef::Str("a")).err().unwrap(),
    ] {
        assert_eq!(malformed(err), (file.clone(), reason.clone()));
    }

    let (full_file, full_reason) = malformed(Cache::open(&dir, Validation::Full).err().unwrap());
    assert_eq!((full_file, full_reason), (file, reason));
}

/// A table of fixed-width columns only is served from the map of `metadata.arrow`; its values,
/// over several record batches, are the ones written.
#[test]
fn a_fixed_width_table_decodes_from_the_map_to_the_values_written() {
    const N: u64 = 70_000; // more than one record batch
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let opts = WriterOptions {
        validate: false,
        ..writer_options()
    };
    let samples = (0..N).map(|i| {
        let metadata = [
            ("label", MetaValue::Int(i as i64 % 1000)),
            ("x", MetaValue::Float(i as f64 / 2.0)),
            ("odd", MetaValue::Bool(i % 2 == 1)),
        ];
        sample(i.to_le_bytes().to_vec(), &metadata)
    });
    let dir = write_cache(&pool, tmp.path(), "ints", opts, samples);
    let cache = Cache::open(&dir, Validation::Structure).unwrap();
    assert!(!cache.metadata_loaded());
    let table = cache.metadata().unwrap();
    assert_eq!(table.rows(), N);
    assert!(table.batches.len() > 1);
    #[cfg(target_os = "linux")]
    {
        // The columns point into the file's map, not into a copy.
        let map = mapped_range(&dir.join("metadata.arrow").canonicalize().unwrap());
        for batch in &table.batches {
            for column in batch.columns() {
                let at = column.to_data().buffers()[0].as_ptr() as usize;
                assert!(map.contains(&at), "{at:#x} outside the map {map:x?}");
            }
        }
    }
    for i in [0, 1, 65_535, 65_536, N - 1] {
        let row: Vec<_> = table.row(i).collect();
        assert_eq!(
            row,
            [
                ("label", MetaRef::Int(i as i64 % 1000)),
                ("x", MetaRef::Float(i as f64 / 2.0)),
                ("odd", MetaRef::Bool(i % 2 == 1)),
            ],
            "row {i}"
        );
        assert_eq!(table.sample_id(i), MetaRef::Int(i as i64));
    }
}

/// The address range of this process's map of `path` (the only one: the test maps it once).
#[cfg(target_os = "linux")]
fn mapped_range(path: &Path) -> std::ops::Range<usize> {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    let line = maps
        .lines()
        .find(|l| l.ends_with(path.to_str().unwrap()))
        .unwrap_or_else(|| panic!("{} is not mapped", path.display()));
    let (start, end) = line
        .split_whitespace()
        .next()
        .unwrap()
        .split_once('-')
        .unwrap();
    usize::from_str_radix(start, 16).unwrap()..usize::from_str_radix(end, 16).unwrap()
}

/// Pages of `file` in the page cache, by `mincore` over a map of its own (which faults none).
#[cfg(target_os = "linux")]
fn resident_pages(file: &std::fs::File) -> usize {
    use std::os::unix::io::AsRawFd;
    let len = file.metadata().unwrap().len() as usize;
    let page = 4096;
    let mut vec = vec![0u8; len.div_ceil(page)];
    // SAFETY: a read-only shared map of the whole open file, unmapped below; mincore writes one
    // byte per page of it into `vec`, which has one per page, and reads no byte of the file.
    unsafe {
        let map = libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        );
        assert_ne!(map, libc::MAP_FAILED);
        assert_eq!(libc::mincore(map, len, vec.as_mut_ptr()), 0);
        libc::munmap(map, len);
    }
    vec.iter().filter(|v| **v & 1 == 1).count()
}

/// Opening reads a shard's header and no more: a fault on the shard's fresh map would read
/// around it, up to the device's `read_ahead_kb` for every shard (8 MiB on some machines), which
/// for a dataset larger than memory is disk time spent on bytes no pass asked for.
#[cfg(target_os = "linux")]
#[test]
fn opening_reads_a_few_pages_of_each_shard_not_the_read_around_of_a_fault() {
    use std::os::unix::io::AsRawFd;
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let samples = (0..64u64).map(|i| sample(vec![i as u8; 48 << 10], &[]));
    let dir = write_cache(&pool, tmp.path(), "big", writer_options(), samples);
    let shards: Vec<std::fs::File> = std::fs::read_dir(dir.join("shards"))
        .unwrap()
        .map(|e| std::fs::File::open(e.unwrap().path()).unwrap())
        .collect();
    assert!(shards.len() >= 2, "the test needs shards of 1 MiB or more");
    for f in &shards {
        // Only clean pages can be dropped.
        f.sync_all().unwrap();
        // SAFETY: fadvise reads only its arguments; the descriptor is open.
        unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    }
    if shards.iter().any(|f| resident_pages(f) > 0) {
        eprintln!("skipped: this filesystem keeps the shards in memory (tmpfs?)");
        return;
    }
    let cache = Cache::open(&dir, Validation::Structure).unwrap();
    for f in &shards {
        // The 16-byte header's read: the page it lies in and the kernel's first read-ahead of
        // a small read (4 pages), where a fault's read-around is at least 32 (128 KiB).
        let pages = resident_pages(f);
        assert!(
            (1..=8).contains(&pages),
            "opening read {pages} pages of a shard"
        );
    }
    drop(cache);
}

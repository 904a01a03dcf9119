//! Write a cache with `CacheWriter`, reopen it with `Cache::open`, and check every byte and value:
//! every metadata type, both compressions and the LZ4 ratio rule, shard rollover, publication.

use std::path::Path;
use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::format::{
    Compression, CompressionAlgo, SampleIdSource, FLAG_LZ4, FORMAT_VERSION,
};
use dataset_rt_core::metadata::{FieldType, MetaRef, MetaValue};
use dataset_rt_core::pool::Pool;
use dataset_rt_core::writer::{SampleInput, WriterOptions};
use dataset_rt_core::Error;
use dataset_rt_testkit::{flip_byte, lz4, sample, try_write_cache, writer_options};
use proptest::prelude::*;
use xxhash_rust::xxh3::xxh3_64;

/// One sample as the tests describe it: the payload and the metadata in source order.
type Row = (Vec<u8>, Vec<(&'static str, MetaValue)>);

fn options(compression: Compression, shard_size: u64) -> WriterOptions {
    WriterOptions {
        compression,
        shard_size,
        ..dataset_rt_testkit::writer_options()
    }
}

/// Bytes that no compressor can shrink (hash output), reproducible from `seed`.
fn noise(len: usize, seed: u64) -> Vec<u8> {
    (0..len.div_ceil(8) as u64)
        .flat_map(|i| xxh3_64(&[seed.to_le_bytes(), i.to_le_bytes()].concat()).to_le_bytes())
        .take(len)
        .collect()
}

fn write(base: &Path, name: &str, opts: WriterOptions, samples: Vec<SampleInput>) -> Cache {
    let pool = Pool::new(2).unwrap();
    write_with(&pool, base, name, opts, samples).unwrap();
    let cache = Cache::open(&base.join(name), Validation::Full).unwrap();
    cache.verify_all().unwrap();
    cache
}

fn write_with(
    pool: &Arc<Pool>,
    base: &Path,
    name: &str,
    opts: WriterOptions,
    samples: Vec<SampleInput>,
) -> dataset_rt_core::Result<()> {
    let published = try_write_cache(pool, base, name, opts, samples)?;
    assert_eq!(published, base.join(name));
    Ok(())
}

fn owned(v: MetaRef<'_>) -> MetaValue {
    match v {
        MetaRef::Bool(b) => MetaValue::Bool(b),
        MetaRef::Int(i) => MetaValue::Int(i),
        MetaRef::Float(f) => MetaValue::Float(f),
        MetaRef::Str(s) => MetaValue::Str(s.to_owned()),
    }
}

/// Equal by type and bits, so NaN equals NaN and -0.0 differs from 0.0.
fn same(a: &MetaValue, b: &MetaValue) -> bool {
    match (a, b) {
        (MetaValue::Float(x), MetaValue::Float(y)) => x.to_bits() == y.to_bits(),
        _ => a == b,
    }
}

fn json_of(v: &MetaValue) -> serde_json::Value {
    match v {
        MetaValue::Bool(b) => (*b).into(),
        MetaValue::Int(i) => (*i).into(),
        MetaValue::Float(f) if f.is_nan() => "NaN".into(),
        MetaValue::Float(f) if f.is_infinite() => {
            (if *f > 0.0 { "Infinity" } else { "-Infinity" }).into()
        }
        MetaValue::Float(f) => (*f).into(),
        MetaValue::Str(s) => s.as_str().into(),
    }
}

/// Checks payloads, table metadata and embedded metadata of every record against the input.
fn assert_round_trip(cache: &Cache, expected: &[Row]) {
    assert_eq!(cache.len(), expected.len() as u64);
    assert_eq!(cache.metadata().unwrap().rows(), expected.len() as u64);
    for (i, (data, meta)) in expected.iter().enumerate() {
        let i64_ = i as u64;
        assert_eq!(&cache.payload(i64_).unwrap()[..], &data[..], "payload {i}");
        let row: Vec<(&str, MetaValue)> = cache
            .metadata()
            .unwrap()
            .row(i64_)
            .map(|(k, v)| (k, owned(v)))
            .collect();
        assert_eq!(row.len(), meta.len(), "row {i}: {row:?}");
        for ((k, v), (ek, ev)) in row.iter().zip(meta) {
            assert_eq!(k, ek, "row {i}");
            assert!(same(v, ev), "row {i}, {k}: {v:?} != {ev:?}");
        }
        let embedded = cache.embedded_metadata(i64_).unwrap();
        let object = embedded
            .as_object()
            .expect("embedded metadata is a JSON object");
        assert_eq!(object.len(), meta.len());
        for (k, v) in meta {
            let want = json_of(v);
            let got = &object[*k];
            match (got.as_f64(), want.as_f64()) {
                (Some(g), Some(w)) => assert_eq!(g.to_bits(), w.to_bits(), "embedded {k} of {i}"),
                _ => assert_eq!(got, &want, "embedded {k} of {i}"),
            }
        }
    }
}

fn every_type() -> Vec<Row> {
    let rows = [
        (true, 0, 0.0, ""),
        (false, -1, f64::NAN, "café 日本語 🙂"),
        (true, i64::MAX, f64::INFINITY, "nul \0 inside"),
        (false, i64::MIN, f64::NEG_INFINITY, "quote \" \\ \n"),
        (true, 42, -0.0, "x"),
        (false, 7, 5e-324, "\u{200b}"),
    ];
    rows.iter()
        .enumerate()
        .map(|(i, &(b, n, f, s))| {
            let data = match i {
                1 => vec![b'a'; 4096],
                2 => Vec::new(),
                4 => b"ab".repeat(999),
                _ => noise(40 + i, i as u64),
            };
            let meta = vec![
                ("flag", MetaValue::Bool(b)),
                ("count", MetaValue::Int(n)),
                ("score", MetaValue::Float(f)),
                ("text", MetaValue::Str(s.to_owned())),
            ];
            (data, meta)
        })
        .collect()
}

fn inputs(rows: &[Row]) -> Vec<SampleInput> {
    rows.iter().map(|(d, m)| sample(d.clone(), m)).collect()
}

#[test]
fn every_metadata_type_round_trips_uncompressed() {
    let dir = tempfile::tempdir().unwrap();
    let rows = every_type();
    let cache = write(
        dir.path(),
        "plain",
        options(Compression::NONE, 1 << 20),
        inputs(&rows),
    );
    assert_round_trip(&cache, &rows);
    let m = &cache.manifest;
    assert_eq!(m.format_version, FORMAT_VERSION);
    assert_eq!(m.compression.algo, CompressionAlgo::None);
    assert_eq!(m.sample_id, SampleIdSource::Position);
    let schema: Vec<(&str, FieldType)> = m
        .metadata_schema
        .iter()
        .map(|f| (f.name.as_str(), f.dtype))
        .collect();
    assert_eq!(
        schema,
        [
            ("flag", FieldType::Bool),
            ("count", FieldType::Int),
            ("score", FieldType::Float),
            ("text", FieldType::Str)
        ]
    );
    for i in 0..cache.len() {
        assert_eq!(
            cache.entry(i).flags,
            0,
            "algo none never compresses (record {i})"
        );
        assert_eq!(
            cache.metadata().unwrap().sample_id(i),
            MetaRef::Int(i as i64),
            "positional ids"
        );
    }
    assert_eq!(m.raw_payload_bytes, m.stored_payload_bytes);
}

#[test]
fn every_metadata_type_round_trips_lz4() {
    let dir = tempfile::tempdir().unwrap();
    let rows = every_type();
    let cache = write(
        dir.path(),
        "packed",
        options(lz4(0.9), 1 << 20),
        inputs(&rows),
    );
    assert_round_trip(&cache, &rows);
    let flags: Vec<u32> = (0..cache.len()).map(|i| cache.entry(i).flags).collect();
    // Noise and the empty payload stay raw; the repetitive ones are compressed.
    assert_eq!(flags, [0, FLAG_LZ4, 0, 0, FLAG_LZ4, 0]);
    assert!(cache.manifest.stored_payload_bytes < cache.manifest.raw_payload_bytes / 4);
}

#[test]
fn lz4_ratio_rule_keeps_incompressible_payloads_raw() {
    let dir = tempfile::tempdir().unwrap();
    // Three quarters noise, one quarter zeros: LZ4 gets it to roughly 0.75-0.8 of its size.
    let partly = [noise(3072, 9), vec![0; 1024]].concat();
    let rows = [noise(4096, 1), vec![7; 4096], partly];
    let samples = |rows: &[Vec<u8>]| {
        rows.iter()
            .map(|d| sample(d.clone(), &[]))
            .collect::<Vec<_>>()
    };

    let loose = write(
        dir.path(),
        "loose",
        options(lz4(0.9), 1 << 20),
        samples(&rows),
    );
    let strict = write(
        dir.path(),
        "strict",
        options(lz4(0.5), 1 << 20),
        samples(&rows),
    );

    let flags = |c: &Cache| (0..c.len()).map(|i| c.entry(i).flags).collect::<Vec<_>>();
    assert_eq!(flags(&loose), [0, FLAG_LZ4, FLAG_LZ4]);
    assert_eq!(flags(&strict), [0, FLAG_LZ4, 0]);
    for (c, limit) in [(&loose, 0.9), (&strict, 0.5)] {
        for (i, data) in rows.iter().enumerate() {
            let e = c.entry(i as u64);
            assert_eq!(e.raw_len as usize, data.len());
            if e.flags & FLAG_LZ4 == 0 {
                assert_eq!(e.stored_len, e.raw_len, "a raw record is stored as it is");
            } else {
                assert!(f64::from(e.stored_len) <= limit * f64::from(e.raw_len));
            }
            assert_eq!(&c.payload(i as u64).unwrap()[..], &data[..]);
        }
    }
    // A raw record's payload is borrowed from the map; a compressed one is decoded.
    assert!(matches!(
        loose.payload(0).unwrap(),
        std::borrow::Cow::Borrowed(_)
    ));
    assert!(matches!(
        loose.payload(1).unwrap(),
        std::borrow::Cow::Owned(_)
    ));
}

#[test]
fn lz4_records_decode_with_an_independent_block_decoder() {
    let dir = tempfile::tempdir().unwrap();
    let text = b"independent decoder ".repeat(50);
    let cache = write(
        dir.path(),
        "indep",
        options(lz4(1.0), 1 << 20),
        vec![sample(text.clone(), &[])],
    );
    let e = cache.entry(0);
    assert_eq!(e.flags, FLAG_LZ4);
    let (_, header, start) = cache.verify_record(0).unwrap();
    let shard = std::fs::read(cache.shard_path(e.shard)).unwrap();
    let stored = &shard[start as usize..(start + u64::from(header.stored_len)) as usize];
    assert_eq!(
        lz4_flex::block::decompress(stored, text.len()).unwrap(),
        text
    );
}

#[test]
fn shards_roll_over_at_the_target_size() {
    let dir = tempfile::tempdir().unwrap();
    let rows: Vec<Row> = (0..200)
        .map(|i| {
            (
                noise(i % 97, i as u64),
                vec![
                    ("sample_id", MetaValue::Str(format!("id-{i}"))),
                    ("i", MetaValue::Int(i as i64)),
                ],
            )
        })
        .collect();
    let shard_size = 2048;
    let cache = write(
        dir.path(),
        "rolled",
        options(Compression::NONE, shard_size),
        inputs(&rows),
    );

    assert_round_trip(&cache, &rows);
    let m = &cache.manifest;
    assert!(cache.num_shards() > 5, "{} shards", cache.num_shards());
    assert_eq!(m.shards.len(), cache.num_shards());
    assert_eq!(m.shards.iter().map(|s| s.records).sum::<u64>(), 200);
    assert!(m
        .shards
        .iter()
        .all(|s| s.bytes <= shard_size && s.records > 0));
    assert_eq!(m.sample_id, SampleIdSource::Metadata);
    assert_eq!(m.sample_id_type, FieldType::Str);
    // Records fill shards in storage order: shard numbers never decrease, offsets grow inside one.
    let mut previous: (u32, u64) = (0, 0);
    for i in 0..cache.len() {
        let e = cache.entry(i);
        assert!(
            (e.shard, e.offset) > previous || i == 0,
            "record {i}: {e:?}"
        );
        assert_eq!(e.offset % 16, 0);
        previous = (e.shard, e.offset);
        assert_eq!(
            cache.metadata().unwrap().sample_id(i),
            MetaRef::Str(&format!("id-{i}"))
        );
    }
    for (k, s) in m.shards.iter().enumerate() {
        let len = std::fs::metadata(cache.shard_path(k as u32)).unwrap().len();
        assert_eq!(len, s.bytes);
    }
}

#[test]
fn a_record_larger_than_the_shard_size_gets_a_shard_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let rows = [noise(10, 1), noise(5000, 2), noise(10, 3)];
    let cache = write(
        dir.path(),
        "big",
        options(Compression::NONE, 1024),
        rows.iter().map(|d| sample(d.clone(), &[])).collect(),
    );
    assert_eq!(cache.num_shards(), 3);
    assert_eq!(
        (0..3).map(|i| cache.entry(i).shard).collect::<Vec<_>>(),
        [0, 1, 2]
    );
    assert_eq!(&cache.payload(1).unwrap()[..], &rows[1][..]);
}

#[test]
fn every_published_file_is_read_only() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let rows: Vec<Vec<u8>> = (0..6).map(|i| noise(100, i)).collect();
    write(
        dir.path(),
        "ro",
        options(Compression::NONE, 512),
        rows.iter().map(|d| sample(d.clone(), &[])).collect(),
    );
    let cache = dir.path().join("ro");
    let mut files = vec![
        cache.join("manifest.json"),
        cache.join("index.bin"),
        cache.join("metadata.arrow"),
    ];
    for shard in std::fs::read_dir(cache.join("shards")).unwrap() {
        files.push(shard.unwrap().path());
    }
    assert!(files.len() > 4, "{files:?}");
    for file in files {
        let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode, 0o444, "{} has mode {mode:o}", file.display());
    }
    // Directories stay writable by their owner, so a cache can still be deleted.
    let mode = std::fs::metadata(&cache).unwrap().permissions().mode();
    assert_ne!(mode & 0o200, 0, "{mode:o}");
}

#[test]
fn empty_source_publishes_an_empty_cache() {
    let dir = tempfile::tempdir().unwrap();
    let cache = write(dir.path(), "empty", options(lz4(0.5), 1024), Vec::new());
    assert_eq!(cache.len(), 0);
    assert_eq!(cache.num_shards(), 0);
    assert!(cache.manifest.metadata_schema.is_empty());
}

#[test]
fn a_bad_sample_fails_the_write_and_publishes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let samples = vec![
        sample(b"a".to_vec(), &[("k", MetaValue::Int(1))]),
        sample(b"b".to_vec(), &[("k", MetaValue::Int(2))]),
        sample(b"c".to_vec(), &[("k", MetaValue::Str("three".into()))]),
    ];
    let err = write_with(
        &pool,
        dir.path(),
        "bad",
        options(Compression::NONE, 1024),
        samples,
    )
    .unwrap_err();
    match &err {
        Error::InvalidSample {
            source_name,
            sample_index,
            reason,
        } => {
            assert_eq!(source_name, "bad");
            assert_eq!(*sample_index, 2);
            assert!(
                reason.contains("\"k\" is str, but sample 0 made it int"),
                "{reason}"
            );
        }
        other => panic!("expected InvalidSample, got {other:?}"),
    }
    let left: Vec<String> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".lock"))
        .collect();
    assert!(left.is_empty(), "nothing published or left over: {left:?}");
}

#[test]
fn duplicate_sample_ids_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    let ids = [5, 6, 5];
    let samples = ids
        .iter()
        .map(|&i| sample(vec![], &[("sample_id", MetaValue::Int(i))]))
        .collect();
    let err = write_with(
        &pool,
        dir.path(),
        "dup",
        options(Compression::NONE, 1024),
        samples,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::InvalidSample { sample_index: 2, reason, .. } if reason.contains("duplicate sample_id")),
        "{err}"
    );
    assert!(!dir.path().join("dup").exists());
}

#[test]
fn keys_that_could_never_be_table_columns_are_refused_at_the_first_sample() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    for (key, why) in [
        ("weight", "is a column of the samples-metadata table"),
        ("cache_id", "is a column of the samples-metadata table"),
        ("a\0b", "holds a NUL byte"),
        ("", "is empty: a column needs a name"),
    ] {
        let samples = vec![
            sample(
                b"a".to_vec(),
                &[("k", MetaValue::Int(1)), (key, MetaValue::Int(1))],
            ),
            sample(
                b"b".to_vec(),
                &[("k", MetaValue::Int(2)), (key, MetaValue::Int(2))],
            ),
        ];
        let err = write_with(
            &pool,
            dir.path(),
            "keys",
            options(Compression::NONE, 1024),
            samples,
        )
        .unwrap_err();
        assert!(
            matches!(&err, Error::InvalidSample { sample_index: 0, reason, .. }
                if reason.contains(&format!("{key:?}")) && reason.contains(why)),
            "{err}"
        );
        assert!(!dir.path().join("keys").exists());
    }
}

#[test]
fn leftovers_of_dead_writers_are_removed_and_others_kept() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join(".c.tmp-1-2/shards")).unwrap();
    std::fs::create_dir(dir.path().join(".cc.tmp-1-2")).unwrap();
    let cache = write(
        dir.path(),
        "c",
        options(Compression::NONE, 1024),
        vec![sample(b"x".to_vec(), &[])],
    );
    assert_eq!(&cache.payload(0).unwrap()[..], b"x");
    assert!(!dir.path().join(".c.tmp-1-2").exists());
    assert!(dir.path().join(".cc.tmp-1-2").exists());
}

#[test]
fn a_flipped_payload_byte_names_cache_shard_offset_and_sample() {
    let dir = tempfile::tempdir().unwrap();
    let rows: Vec<Vec<u8>> = (0..6).map(|i| noise(100, i)).collect();
    let cache = write(
        dir.path(),
        "flip",
        options(Compression::NONE, 512),
        rows.iter().map(|d| sample(d.clone(), &[])).collect(),
    );
    let (entry, _, start) = cache.verify_record(4).unwrap();
    let path = cache.shard_path(entry.shard);
    drop(cache);
    flip_byte(&path, start + 10); // made writable first: published read-only

    let full = Cache::open(&dir.path().join("flip"), Validation::Full)
        .err()
        .expect("full validation fails");
    assert!(
        matches!(&full, Error::Malformed { file, reason, .. } if file == &path && reason.contains("checksum mismatch")),
        "{full}"
    );

    let cache = Cache::open(&dir.path().join("flip"), Validation::Structure).unwrap();
    for i in 0..4 {
        assert_eq!(&cache.payload(i).unwrap()[..], &rows[i as usize][..]);
    }
    match cache.payload(4).unwrap_err() {
        Error::CorruptRecord {
            cache: name,
            shard,
            offset,
            sample,
            reason,
        } => {
            assert_eq!(
                (name.as_str(), shard, offset, sample),
                ("flip", path, entry.offset, 4)
            );
            assert!(reason.contains("checksum mismatch"), "{reason}");
        }
        other => panic!("expected CorruptRecord, got {other}"),
    }
    assert_eq!(&cache.payload(5).unwrap()[..], &rows[5][..]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn any_payloads_round_trip(
        payloads in prop::collection::vec(
            prop_oneof![
                prop::collection::vec(any::<u8>(), 0..600),
                (any::<u8>(), 0usize..2000).prop_map(|(b, n)| vec![b; n]),
            ],
            0..40,
        ),
        use_lz4 in any::<bool>(),
        ratio in 0.05f64..=1.0,
        shard_size in 64u64..4096,
        prefetch_size in 1usize..20,
    ) {
        let dir = tempfile::tempdir().unwrap();
        let compression = if use_lz4 { lz4(ratio) } else { Compression::NONE };
        let opts = WriterOptions { prefetch_size, compression, validate: false, shard_size };
        let rows: Vec<Row> = payloads
            .iter()
            .enumerate()
            .map(|(i, p)| (p.clone(), vec![("len", MetaValue::Int(p.len() as i64)), ("odd", MetaValue::Bool(i % 2 == 1))]))
            .collect();
        let cache = write(dir.path(), "prop", opts, inputs(&rows));
        assert_round_trip(&cache, &rows);
        for i in 0..cache.len() {
            let e = cache.entry(i);
            if e.flags & FLAG_LZ4 != 0 {
                prop_assert!(use_lz4);
                prop_assert!(f64::from(e.stored_len) <= ratio * f64::from(e.raw_len));
            } else {
                prop_assert_eq!(e.stored_len, e.raw_len);
            }
        }
    }
}

#[test]
fn caches_make_one_dataset_only_with_unique_names_and_samples_for_a_fixed_epoch() {
    use dataset_rt_core::dataset::{Dataset, ReadOptions};
    let tmp = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    let open = |base: &Path, n: u64| {
        let samples = (0..n).map(|i| sample(vec![i as u8; 8], &[]));
        let dir = try_write_cache(&pool, base, "c", writer_options(), samples).unwrap();
        Arc::new(Cache::open(&dir, Validation::Full).unwrap())
    };
    let (a, b) = (
        open(&tmp.path().join("a"), 3),
        open(&tmp.path().join("b"), 0),
    );
    let opts = ReadOptions::new(1, true);
    Dataset::check_caches(std::slice::from_ref(&a), &opts).unwrap();
    let text = Dataset::check_caches(&[a.clone(), b.clone()], &opts)
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("two caches of this dataset are named \"c\"")
            && text.contains(&b.dir.display().to_string()),
        "{text}"
    );
    // No samples: an epoch of a fixed length has nothing to draw from; an epoch of all of
    // them (none) is fine.
    Dataset::check_caches(std::slice::from_ref(&b), &opts).unwrap();
    let fixed = ReadOptions {
        epoch_len: Some(5),
        ..ReadOptions::new(1, true)
    };
    let text = Dataset::check_caches(std::slice::from_ref(&b), &fixed)
        .unwrap_err()
        .to_string();
    assert!(
        text.contains("ReaderConfig.samples_per_epoch: 5 samples per epoch"),
        "{text}"
    );
    Dataset::check_caches(std::slice::from_ref(&a), &fixed).unwrap();
}

//! `CacheWriter::push_keyed`, the converting caller's push: its remembered key identities must
//! never change what is written or refused. Every sample sequence gives the same cache, or the
//! same `InvalidSample` error naming the same source and sample, as `push` with names.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use dataset_rt_core::format::Compression;
use dataset_rt_core::metadata::MetaValue;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::writer::{MetaKey, Payload, SampleInput, SharedBytes, WriterOptions};
use dataset_rt_core::Error;
use dataset_rt_testkit::{cache_writer, try_write_cache, write_cache};
use proptest::prelude::*;

fn options() -> WriterOptions {
    WriterOptions {
        prefetch_size: 3,
        validate: false,
        ..dataset_rt_testkit::writer_options()
    }
}

/// One sample as a caller converts it: (key identity, key name, value) in the source's order.
type Keyed = (Vec<u8>, Vec<(usize, String, MetaValue)>);

/// `sample` as `push` takes it: its metadata by name.
fn named(sample: &Keyed) -> SampleInput {
    let (data, meta) = sample;
    let metadata = meta
        .iter()
        .map(|(_, k, v)| (k.clone(), v.clone()))
        .collect();
    SampleInput {
        data: data.clone(),
        metadata,
    }
}

/// Writes `samples` with `push`, by name.
fn by_name(pool: &Arc<Pool>, base: &Path, name: &str, samples: &[Keyed]) -> Result<(), Error> {
    try_write_cache(pool, base, name, options(), samples.iter().map(named)).map(drop)
}

/// Writes `samples` with `push_keyed`, handing batches off as a converting caller does; the
/// whether each sample's keys were remembered.
fn by_identity(
    pool: &Arc<Pool>,
    base: &Path,
    name: &str,
    samples: &[Keyed],
) -> (Result<(), Error>, Vec<bool>) {
    let mut w = cache_writer(pool, base, name, options());
    let mut remembered = Vec::new();
    for (data, meta) in samples {
        let keys: Vec<MetaKey<'_>> = meta
            .iter()
            .map(|(id, k, _)| MetaKey { id: *id, name: k })
            .collect();
        let values = meta.iter().map(|(_, _, v)| v.clone()).collect();
        let staged = match w.push_keyed(data.clone().into(), &keys, values) {
            Ok(s) => s,
            Err(e) => return (Err(e), remembered),
        };
        remembered.push(staged.keys_remembered);
        if staged.batch_full {
            if let Err(e) = w.hand_off() {
                return (Err(e), remembered);
            }
        }
    }
    (w.finish().map(drop), remembered)
}

/// The bytes of every data file of a published cache (the manifest names the cache, so it
/// differs between two names; everything it describes is compared here).
fn data_files(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files = vec![
        (
            "index.bin".to_string(),
            std::fs::read(dir.join("index.bin")).unwrap(),
        ),
        (
            "metadata.arrow".to_string(),
            std::fs::read(dir.join("metadata.arrow")).unwrap(),
        ),
    ];
    let mut shards: Vec<_> = std::fs::read_dir(dir.join("shards"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    shards.sort();
    for s in shards {
        let name = s.file_name().unwrap().to_string_lossy().into_owned();
        files.push((name, std::fs::read(&s).unwrap()));
    }
    files
}

fn entry(id: usize, name: &str, value: MetaValue) -> (usize, String, MetaValue) {
    (id, name.to_string(), value)
}

/// The parts of an `InvalidSample` error: (source, sample index, reason).
fn invalid_sample(err: &Error) -> (&str, u64, &str) {
    match err {
        Error::InvalidSample {
            source_name,
            sample_index,
            reason,
        } => (source_name, *sample_index, reason),
        other => panic!("expected InvalidSample, got {other:?}"),
    }
}

#[test]
fn same_identities_are_remembered_and_new_ones_replace_them() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let sample = |id_a: usize, id_b: usize, i: i64| -> Keyed {
        (
            vec![i as u8],
            vec![
                entry(id_a, "a", MetaValue::Int(i)),
                entry(id_b, "b", MetaValue::Str(format!("s{i}"))),
            ],
        )
    };
    let samples = vec![
        sample(1, 2, 0),
        sample(1, 2, 1),
        // Other key objects with the same text (a source that builds its key strings).
        sample(3, 4, 2),
        sample(3, 4, 3),
        sample(1, 2, 4),
    ];
    let (result, remembered) = by_identity(&pool, dir.path(), "keyed", &samples);
    result.unwrap();
    assert_eq!(remembered, [true, false, true, false, true]);
    by_name(&pool, dir.path(), "named", &samples).unwrap();
    assert_eq!(
        data_files(&dir.path().join("keyed")),
        data_files(&dir.path().join("named"))
    );
}

#[test]
fn a_changed_type_under_remembered_keys_is_the_same_error() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let samples: Vec<Keyed> = vec![
        (vec![0], vec![entry(1, "k", MetaValue::Int(0))]),
        (vec![1], vec![entry(1, "k", MetaValue::Int(1))]),
        (vec![2], vec![entry(1, "k", MetaValue::Str("two".into()))]),
    ];
    let (keyed, remembered) = by_identity(&pool, dir.path(), "src", &samples);
    assert_eq!(remembered, [true, false]);
    let keyed = keyed.unwrap_err();
    let named = by_name(&pool, dir.path(), "src", &samples).unwrap_err();
    assert_eq!(invalid_sample(&keyed), invalid_sample(&named));
    let (source, index, reason) = invalid_sample(&keyed);
    assert_eq!((source, index), ("src", 2));
    assert!(
        reason.contains("\"k\" is str, but sample 0 made it int"),
        "{reason}"
    );
    assert!(!dir.path().join("src").exists());
}

#[test]
fn a_changed_key_set_under_remembered_identities_is_the_same_error() {
    // Each case: the third sample reuses remembered identities but its keys differ.
    let first = || -> Keyed {
        (
            vec![0],
            vec![
                entry(1, "a", MetaValue::Int(0)),
                entry(2, "b", MetaValue::Bool(true)),
            ],
        )
    };
    let cases: Vec<(&str, Keyed, &str)> = vec![
        (
            "a key is missing",
            (vec![2], vec![entry(1, "a", MetaValue::Int(2))]),
            "metadata key \"b\" is missing; the schema set by sample 0 is {a: int, b: bool}",
        ),
        (
            "a key is added",
            (
                vec![2],
                vec![
                    entry(1, "a", MetaValue::Int(2)),
                    entry(2, "b", MetaValue::Bool(false)),
                    entry(9, "c", MetaValue::Float(1.5)),
                ],
            ),
            "metadata key \"c\" is not in the schema set by sample 0 ({a: int, b: bool})",
        ),
        (
            "a key is replaced",
            (
                vec![2],
                vec![
                    entry(1, "a", MetaValue::Int(2)),
                    entry(9, "c", MetaValue::Bool(false)),
                ],
            ),
            "metadata key \"c\" is not in the schema set by sample 0 ({a: int, b: bool})",
        ),
        (
            "the keys swap types",
            (
                vec![2],
                vec![
                    entry(1, "a", MetaValue::Bool(false)),
                    entry(2, "b", MetaValue::Int(2)),
                ],
            ),
            "metadata \"a\" is bool, but sample 0 made it int",
        ),
    ];
    for (what, third, expected) in cases {
        let dir = tempfile::tempdir().unwrap();
        let pool = Pool::new(2).unwrap();
        let samples = vec![first(), first(), third];
        let (keyed, _) = by_identity(&pool, dir.path(), "src", &samples);
        let keyed = keyed.unwrap_err();
        let named = by_name(&pool, dir.path(), "src", &samples).unwrap_err();
        assert_eq!(invalid_sample(&keyed), invalid_sample(&named), "{what}");
        let (source, index, reason) = invalid_sample(&keyed);
        assert_eq!((source, index), ("src", 2), "{what}");
        assert_eq!(reason, expected, "{what}");
    }
}

#[test]
fn reordered_keys_land_in_their_columns() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let samples: Vec<Keyed> = vec![
        (
            vec![0],
            vec![
                entry(1, "a", MetaValue::Int(0)),
                entry(2, "b", MetaValue::Int(100)),
            ],
        ),
        // The same key objects in the other order: remembered again, values by name.
        (
            vec![1],
            vec![
                entry(2, "b", MetaValue::Int(101)),
                entry(1, "a", MetaValue::Int(1)),
            ],
        ),
        (
            vec![2],
            vec![
                entry(2, "b", MetaValue::Int(102)),
                entry(1, "a", MetaValue::Int(2)),
            ],
        ),
    ];
    let (result, remembered) = by_identity(&pool, dir.path(), "keyed", &samples);
    result.unwrap();
    assert_eq!(remembered, [true, true, false]);
    by_name(&pool, dir.path(), "named", &samples).unwrap();
    assert_eq!(
        data_files(&dir.path().join("keyed")),
        data_files(&dir.path().join("named"))
    );
}

/// Keys from a small alphabet, each with one of two types, in any order and subset, under
/// identities that are either the name's own (as interned Python strings are) or fresh.
fn samples() -> impl Strategy<Value = Vec<Keyed>> {
    let key = (0usize..3, any::<bool>(), any::<bool>(), any::<i64>());
    let sample = proptest::collection::vec(key, 0..4).prop_map(|keys| {
        let mut seen = [false; 3];
        let mut meta = Vec::new();
        for (k, as_str, fresh_id, v) in keys {
            if std::mem::replace(&mut seen[k], true) {
                continue; // a mapping has each key once
            }
            let name = ["a", "b", "sample_id"][k];
            let value = if as_str {
                MetaValue::Str(format!("v{v}"))
            } else {
                MetaValue::Int(v % 4)
            };
            let id = if fresh_id {
                1000 + v.unsigned_abs() as usize % 7 * 3 + k
            } else {
                k
            };
            meta.push((id, name.to_string(), value));
        }
        (vec![meta.len() as u8], meta)
    });
    proptest::collection::vec(sample, 1..8)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn keyed_pushes_write_or_refuse_exactly_as_named_pushes(samples in samples()) {
        let dir = tempfile::tempdir().unwrap();
        let pool = Pool::new(2).unwrap();
        let (keyed, _) = by_identity(&pool, dir.path(), "keyed", &samples);
        let named = by_name(&pool, dir.path(), "named", &samples);
        match (&keyed, &named) {
            (Ok(()), Ok(())) => prop_assert_eq!(
                data_files(&dir.path().join("keyed")),
                data_files(&dir.path().join("named"))
            ),
            (Err(k), Err(n)) => {
                let (k_source, k_index, k_reason) = invalid_sample(k);
                let (n_source, n_index, n_reason) = invalid_sample(n);
                prop_assert_eq!((k_source, n_source), ("keyed", "named"));
                prop_assert_eq!((k_index, k_reason), (n_index, n_reason));
            }
            _ => prop_assert!(false, "keyed {keyed:?}, named {named:?}"),
        }
    }
}

/// Bytes owned elsewhere, counting how many are still held.
struct Counted(Vec<u8>, Arc<AtomicUsize>);

impl SharedBytes for Counted {
    fn bytes(&self) -> &[u8] {
        &self.0
    }
}

impl Drop for Counted {
    fn drop(&mut self) {
        self.1.fetch_sub(1, Ordering::SeqCst);
    }
}

#[test]
fn shared_payloads_are_written_in_place_and_released() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let held = Arc::new(AtomicUsize::new(0));
    let samples: Vec<Keyed> = (0..50u8)
        .map(|i| {
            (
                vec![i; usize::from(i) * 7],
                vec![entry(1, "n", MetaValue::Int(i.into()))],
            )
        })
        .collect();
    for compression in [Compression::NONE, Compression::new("lz4", 0.9).unwrap()] {
        let name = format!("shared_{:?}", compression.algo);
        let mut opts = options();
        opts.compression = compression;
        let mut w = cache_writer(&pool, dir.path(), &name, opts);
        for (data, meta) in &samples {
            held.fetch_add(1, Ordering::SeqCst);
            let payload = Payload::Shared(Box::new(Counted(data.clone(), held.clone())));
            let keys: Vec<MetaKey<'_>> = meta
                .iter()
                .map(|(id, k, _)| MetaKey { id: *id, name: k })
                .collect();
            let values = meta.iter().map(|(_, _, v)| v.clone()).collect();
            if w.push_keyed(payload, &keys, values).unwrap().batch_full {
                w.hand_off().unwrap();
            }
        }
        w.finish().unwrap();
        assert_eq!(
            held.load(Ordering::SeqCst),
            0,
            "every shared payload released"
        );
        let owned = format!("owned_{:?}", compression.algo);
        write_cache(&pool, dir.path(), &owned, opts, samples.iter().map(named));
        assert_eq!(
            data_files(&dir.path().join(&name)),
            data_files(&dir.path().join(&owned))
        );
    }
}

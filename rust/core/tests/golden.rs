//! The committed golden caches, one per format version (`tests/data/golden_vN/golden`), read by
//! the core alone: every later version must decode these exact bytes to these exact values. The
//! values are the ones `tests/test_golden_cache.py` expects, written out again on purpose.

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::format::{
    CompressionAlgo, SampleIdSource, FLAG_LZ4, FORMAT_VERSION, READABLE_VERSIONS,
};
use dataset_rt_core::metadata::{FieldType, MetaRef};
// Private copies (`golden_copy_of`): nothing is ever opened next to the committed bytes.
use dataset_rt_testkit::{golden_copy_of, golden_dir};

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn payloads() -> Vec<Vec<u8>> {
    vec![
        hex("77abc86d5c37fe261ce84966b29ddcc90a2ced0d"),
        hex("2442ffeede6ab0781f47fb14845f2683237ccb5e6c"),
        b"golden v1 compressible payload ".repeat(16),
        hex("336e4be6f30cfa46f61ef5b3323991e17906cfee427513"),
        hex("899495bbab1c65f7145b3cd960010db25dda42adcb41885e"),
        hex("d7837a735e63d4506ca548bc37308f3702329c20cdba0312a7"),
    ]
}

/// (label, score, flag, caption) of sample i; its sample_id is "g{i}".
const METADATA: [(i64, f64, bool, &str); 6] = [
    (0, 0.5, true, ""),
    (i64::MIN, f64::NAN, false, "café"),
    (i64::MAX, f64::INFINITY, true, "日本語 ✓"),
    (3, f64::NEG_INFINITY, false, "a\0b"),
    (-4, -0.0, true, "🙂 emoji"),
    (5, 1e-308, false, "line\nbreak"),
];
const COMPRESSED: [u64; 1] = [2];

/// Floats equal bit for bit in meaning: NaN is NaN, and -0.0 is not 0.0.
fn same_float(a: f64, b: f64) -> bool {
    (a.is_nan() && b.is_nan()) || (a == b && a.is_sign_negative() == b.is_sign_negative())
}

#[test]
fn every_readable_version_has_a_golden_cache() {
    assert_eq!(READABLE_VERSIONS.last(), Some(&FORMAT_VERSION));
    for version in READABLE_VERSIONS {
        assert!(
            golden_dir(version).join("manifest.json").is_file(),
            "v{version}"
        );
    }
}

#[test]
fn golden_caches_open_fully_validated_with_their_manifests() {
    for version in READABLE_VERSIONS {
        golden_opens_fully_validated_with_its_manifest(version);
    }
}

fn golden_opens_fully_validated_with_its_manifest(version: u32) {
    let tmp = tempfile::tempdir().unwrap();
    let cache = Cache::open(&golden_copy_of(tmp.path(), version), Validation::Full).unwrap();
    cache.verify_all().unwrap();
    let m = &cache.manifest;
    assert_eq!(m.format_version, version);
    assert_eq!(m.name, "golden");
    assert_eq!(cache.len(), 6);
    assert_eq!(m.sample_id, SampleIdSource::Metadata);
    assert_eq!(m.sample_id_type, FieldType::Str);
    assert_eq!(m.compression.algo, CompressionAlgo::Lz4);
    assert_eq!(m.compression.ratio, 0.5);
    assert_eq!(
        m.metadata_schema
            .iter()
            .map(|f| (f.name.as_str(), f.dtype))
            .collect::<Vec<_>>(),
        [
            ("sample_id", FieldType::Str),
            ("label", FieldType::Int),
            ("score", FieldType::Float),
            ("flag", FieldType::Bool),
            ("caption", FieldType::Str),
        ]
    );
    assert_eq!(
        m.shards.iter().map(|s| s.records).collect::<Vec<_>>(),
        [3, 3]
    );
    let raw: usize = payloads().iter().map(Vec::len).sum();
    assert_eq!(m.raw_payload_bytes, raw as u64);
}

#[test]
fn golden_payloads_and_metadata_are_exact() {
    for version in READABLE_VERSIONS {
        golden_payloads_and_metadata_are_exact_in(version);
    }
}

/// From v3 on, where the index entry holds the metadata length, a record is found from its entry
/// alone exactly where a full read of its header finds it; before v3 it never is.
#[test]
fn only_v3_entries_locate_a_record_without_its_header() {
    for version in READABLE_VERSIONS {
        let tmp = tempfile::tempdir().unwrap();
        let cache = Cache::open(&golden_copy_of(tmp.path(), version), Validation::Full).unwrap();
        assert_eq!(cache.serves_from_index(), version >= 3, "v{version}");
        for i in 0..cache.len() {
            let full = cache.verify_record(i).unwrap();
            match cache.trusted_record(i) {
                Some(from_index) => {
                    assert!(version >= 3);
                    assert_eq!(from_index.unwrap(), full, "v{version} sample {i}");
                }
                None => assert!(version < 3, "v{version} sample {i}"),
            }
        }
    }
}

fn golden_payloads_and_metadata_are_exact_in(version: u32) {
    let tmp = tempfile::tempdir().unwrap();
    let cache = Cache::open(&golden_copy_of(tmp.path(), version), Validation::Structure).unwrap();
    for (i, want) in payloads().iter().enumerate() {
        let i = i as u64;
        assert_eq!(
            &cache.payload(i).unwrap()[..],
            &want[..],
            "v{version} payload {i}"
        );
        let lz4 = cache.entry(i).flags & FLAG_LZ4 != 0;
        assert_eq!(lz4, COMPRESSED.contains(&i), "compression of {i}");
        assert_eq!(cache.entry(i).shard, (i / 3) as u32);

        let (label, score, flag, caption) = METADATA[i as usize];
        let id = format!("g{i}");
        let row: Vec<(&str, MetaRef<'_>)> = cache.metadata().unwrap().row(i).collect();
        assert_eq!(cache.metadata().unwrap().sample_id(i), MetaRef::Str(&id));
        assert_eq!(row.len(), 5, "{row:?}");
        assert_eq!(row[0], ("sample_id", MetaRef::Str(&id)));
        assert_eq!(row[1], ("label", MetaRef::Int(label)));
        match row[2] {
            ("score", MetaRef::Float(x)) => assert!(same_float(x, score), "{i}: {x} != {score}"),
            other => panic!("{i}: {other:?}"),
        }
        assert_eq!(row[3], ("flag", MetaRef::Bool(flag)));
        assert_eq!(row[4], ("caption", MetaRef::Str(caption)));

        // The record's own copy of its metadata (JSON: NaN and the infinities as strings).
        let embedded = cache.embedded_metadata(i).unwrap();
        assert_eq!(embedded["sample_id"], id.as_str());
        assert_eq!(embedded["label"], label);
        assert_eq!(embedded["flag"], flag);
        assert_eq!(embedded["caption"], caption);
        let stored_score = &embedded["score"];
        if score.is_nan() {
            assert_eq!(stored_score, "NaN");
        } else if score.is_infinite() {
            assert_eq!(
                stored_score,
                if score > 0.0 { "Infinity" } else { "-Infinity" }
            );
        } else {
            assert!(same_float(stored_score.as_f64().unwrap(), score), "{i}");
        }
    }
}

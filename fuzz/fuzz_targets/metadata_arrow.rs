//! `metadata.arrow` decoded in memory against one of the schemas the caches use: the first byte
//! picks the schema, the second the row count the manifest would give; the rest is the file.
//! Every value of every row is read back.
#![no_main]

use dataset_rt_core::metadata::{Field, FieldType, MetaRef, MetadataTable};
use dataset_rt_fuzz::guarded;
use libfuzzer_sys::fuzz_target;

fn field(name: &str, dtype: FieldType) -> Field {
    Field {
        name: name.into(),
        dtype,
    }
}

/// (user fields, sample_id type): the golden cache's schema and the fuzz base caches' ones.
fn schema(pick: u8) -> (Vec<Field>, FieldType) {
    use FieldType::*;
    match pick % 5 {
        0 => (
            vec![
                field("sample_id", Str),
                field("label", Int),
                field("score", Float),
                field("flag", Bool),
                field("caption", Str),
            ],
            Str,
        ),
        1 => (vec![], Int),
        2 => (
            vec![
                field("sample_id", Int),
                field("flag", Bool),
                field("w", Float),
            ],
            Int,
        ),
        3 => (
            vec![
                field("sample_id", Str),
                field("text", Str),
                field("label", Int),
            ],
            Str,
        ),
        _ => (vec![field("label", Int)], Int),
    }
}

fuzz_target!(|data: &[u8]| {
    guarded(|| {
        let [pick, rows, file @ ..] = data else {
            return;
        };
        let (fields, id_type) = schema(*pick);
        let Ok(table) = MetadataTable::decode(file, &fields, id_type, u64::from(*rows)) else {
            return;
        };
        assert_eq!(table.rows(), u64::from(*rows));
        let mut sum = 0usize;
        for row in 0..table.rows() {
            for (name, v) in table.row(row) {
                sum = sum.wrapping_add(name.len());
                sum = sum.wrapping_add(match v {
                    MetaRef::Str(s) => s.len(),
                    MetaRef::Bool(b) => usize::from(b),
                    MetaRef::Int(i) => i as usize,
                    MetaRef::Float(f) => f.to_bits() as usize,
                });
            }
            std::hint::black_box(table.sample_id(row));
        }
        std::hint::black_box(sum);
    });
});

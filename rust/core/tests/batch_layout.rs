//! `BatchLayout`: a batch's payloads as views of the shards it reads (each shard once, in order
//! of first use) and one buffer of decompressed payloads, rebuilt here byte for byte against
//! what was written; a record past its shard's end is an error naming the sample.

use std::collections::HashSet;
use std::sync::Arc;

use dataset_rt_core::cache::{Cache, Validation};
use dataset_rt_core::dataset::{
    BatchLayout, Dataset, EpochReader, Fetched, Payload, ReadOptions, WeightTable,
};
use dataset_rt_core::pool::Pool;
use dataset_rt_core::writer::WriterOptions;
use dataset_rt_core::Error;
use dataset_rt_testkit::{lz4, numbered, write_cache, writer_options};

/// Sample `i`'s payload: every third one repeats one byte (LZ4 keeps it compressed), the others
/// are noise that stays stored as it is.
fn payload(cache: u64, i: u64) -> Vec<u8> {
    let len = 700 + (i as usize * 37) % 900;
    if i % 3 == 0 {
        vec![(cache * 100 + i) as u8; len]
    } else {
        let mut x = (cache << 32) ^ (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        (0..len)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }
}

const SIZES: [u64; 2] = [61, 23];

/// "plain", stored as written in 8 KiB shards, and "packed", with LZ4.
fn dataset(dir: &std::path::Path, pool: &Arc<Pool>) -> Arc<Dataset> {
    let opts = |compressed: bool| WriterOptions {
        shard_size: 8 << 10,
        compression: if compressed {
            lz4(0.9)
        } else {
            writer_options().compression
        },
        ..writer_options()
    };
    for (c, (name, n)) in ["plain", "packed"].into_iter().zip(SIZES).enumerate() {
        let samples = (0..n).map(|i| numbered(i, payload(c as u64, i)));
        write_cache(pool, dir, name, opts(c == 1), samples);
    }
    let open = |name: &str| Arc::new(Cache::open(&dir.join(name), Validation::Full).unwrap());
    Arc::new(Dataset::new(vec![open("plain"), open("packed")]))
}

fn options() -> ReadOptions {
    ReadOptions {
        prefetch_size: 4,
        ..ReadOptions::new(11, true)
    }
}

#[test]
fn every_payload_of_a_batch_is_rebuilt_from_its_span_and_each_shard_is_viewed_once() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(2).unwrap();
    let dataset = dataset(dir.path(), &pool);
    assert!(
        dataset.caches[0].num_shards() > 2,
        "the plain cache spans several shards"
    );
    let order = dataset
        .try_order(&options(), &WeightTable::uniform(), 0)
        .unwrap();
    let mut reader = EpochReader::new(pool, dataset.clone(), Arc::new(order), &options(), 0, 0);
    let (mut seen, mut owned_batches) = (Vec::new(), 0);
    while let Some(batch) = reader.next_batch(16) {
        let fetched = batch.unwrap();
        let layout = BatchLayout::of(&dataset, &fetched).unwrap();
        assert_eq!(layout.spans.len(), fetched.len());
        let unique: HashSet<_> = layout.shards.iter().map(|&(c, s, _)| (c, s)).collect();
        assert_eq!(unique.len(), layout.shards.len(), "a shard is viewed once");
        let mut owned = vec![0u8; layout.owned_len.unwrap_or(0) as usize];
        BatchLayout::copy_owned(&fetched, &mut owned);
        owned_batches += usize::from(layout.owned_len.is_some());
        let mut first_use = Vec::new();
        for ((f, &[b, start, end]), &global) in
            fetched.iter().zip(&layout.spans).zip(&layout.globals)
        {
            let (cache, row) = dataset.locate(global);
            assert_eq!((cache as u32, row), (f.cache, f.row));
            let bytes = match (layout.owned_buffer(), &f.payload) {
                (Some(o), Payload::Owned(_)) if b as usize == o => &owned[..],
                (_, Payload::Mapped { shard, .. }) => {
                    let (c, s, _) = layout.shards[b as usize];
                    assert_eq!((c, s), (f.cache, *shard));
                    if !first_use.contains(&b) {
                        assert_eq!(b as usize, first_use.len(), "buffers in order of first use");
                        first_use.push(b);
                    }
                    dataset.caches[c as usize].shard_bytes(s)
                }
                _ => panic!("sample {global}: span {b} does not match its payload's kind"),
            };
            assert_eq!(
                &bytes[start as usize..end as usize],
                &payload(f.cache as u64, f.row)[..],
                "sample {global}"
            );
            seen.push(global);
        }
    }
    seen.sort_unstable();
    assert_eq!(seen, (0..SIZES.iter().sum::<u64>()).collect::<Vec<_>>());
    assert!(owned_batches > 0, "some batches hold decompressed records");
}

#[test]
fn a_record_past_the_end_of_its_shard_is_an_error_naming_the_sample() {
    let dir = tempfile::tempdir().unwrap();
    let pool = Pool::new(1).unwrap();
    let dataset = dataset(dir.path(), &pool);
    let size = dataset.caches[0].shard_len(0);
    let past = Fetched {
        cache: 0,
        row: 5,
        payload: Payload::Mapped {
            shard: 0,
            offset: size - 10,
            len: 11,
        },
    };
    let err = BatchLayout::of(&dataset, &[past])
        .err()
        .expect("past the end");
    match err {
        Error::CorruptRecord { sample, .. } => assert_eq!(sample, 5),
        other => panic!("not a corrupt record: {other}"),
    }
}

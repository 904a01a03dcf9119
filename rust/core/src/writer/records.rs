//! Writing the records: samples encoded on the pool (LZ4 under the ratio rule, the record
//! checksum), and the ordered commit of encoded batches into shards, the index and the metadata
//! by whichever worker finishes the next batch.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};

use crate::error::{Error, IoContext, Result};
use crate::format::*;
use crate::hashed_file::{create_file, finish_file, HashingWriter};
use crate::metadata::{Field, MetaValue, MetadataWriter, RecordMetadataJson};

use super::Payload;

pub(super) struct Encoded {
    pub(super) header: RecordHeader,
    pub(super) meta: Vec<u8>,
    pub(super) payload: Payload,
    pub(super) sample_id: MetaValue,
    pub(super) values: Vec<MetaValue>,
}

/// The files being written, touched by one committer at a time.
pub(super) struct Sink {
    pub(super) dir: PathBuf,
    pub(super) shard_size: u64,
    pub(super) shard: Option<HashingWriter<BufWriter<File>>>,
    pub(super) shard_no: u32,
    pub(super) shard_records: u64,
    pub(super) shards: Vec<ShardEntry>,
    pub(super) index: Option<HashingWriter<BufWriter<File>>>,
    pub(super) metadata: Option<MetadataWriter>,
    pub(super) raw_bytes: u64,
    pub(super) stored_bytes: u64,
}

const ZEROS: [u8; ALIGN as usize] = [0; ALIGN as usize];

impl Sink {
    pub(super) fn close_shard(&mut self) -> Result<()> {
        if let Some(w) = self.shard.take() {
            let rel = shard_file_name(self.shard_no);
            let (bytes, checksum) = finish_file(w, &self.dir.join(&rel))?;
            self.shards.push(ShardEntry {
                file: rel,
                bytes,
                records: self.shard_records,
                checksum,
            });
            self.shard_no += 1;
            self.shard_records = 0;
        }
        Ok(())
    }

    pub(super) fn append(&mut self, rec: Encoded, sample: u64) -> Result<()> {
        let len = rec.header.padded_len();
        if let Some(w) = &self.shard {
            if self.shard_records > 0 && w.written + len > self.shard_size {
                self.close_shard()?;
            }
        }
        if self.shard.is_none() {
            let path = self.dir.join(shard_file_name(self.shard_no));
            let mut w = create_file(&path)?;
            w.write_all(&shard_header(self.shard_no))
                .ctx("write", &path)?;
            self.shard = Some(w);
        }
        let path = self.dir.join(shard_file_name(self.shard_no));
        let w = self.shard.as_mut().expect("opened above");
        let offset = w.written;
        debug_assert_eq!(offset % ALIGN, 0);
        let header_and_meta = RECORD_HEADER_LEN + rec.meta.len() as u64;
        let pad1 = (rec.header.payload_offset() - header_and_meta) as usize;
        let payload = rec.payload.as_slice();
        let pad2 = (len - rec.header.payload_offset() - payload.len() as u64) as usize;
        (|| {
            w.write_all(&rec.header.encode())?;
            w.write_all(&rec.meta)?;
            w.write_all(&ZEROS[..pad1])?;
            w.write_all(payload)?;
            w.write_all(&ZEROS[..pad2])
        })()
        .ctx("write", &path)?;
        w.start_writeback();
        self.shard_records += 1;
        let entry = IndexEntry {
            offset,
            shard: self.shard_no,
            flags: rec.header.flags,
            stored_len: rec.header.stored_len,
            raw_len: rec.header.raw_len,
            meta_len: Some(rec.header.meta_len),
            checksum: rec.header.checksum,
        };
        self.index
            .as_mut()
            .expect("open until finish")
            .write_all(&entry.encode())
            .ctx("write", &self.dir.join(INDEX_FILE))?;
        self.raw_bytes += u64::from(rec.header.raw_len);
        self.stored_bytes += u64::from(rec.header.stored_len);
        debug_assert_eq!(rec.header.sample, sample);
        self.metadata
            .as_mut()
            .expect("metadata writer opens with the first sample")
            .push(&rec.sample_id, &rec.values)
    }
}

pub(super) struct CommitState {
    pub(super) next_batch: u64,
    pub(super) pending: BTreeMap<u64, Vec<Encoded>>,
    pub(super) committing: bool,
    pub(super) error: Option<String>,
    pub(super) first_error: Option<Error>,
}

fn record_error(st: &mut CommitState, e: Error) {
    if st.error.is_none() {
        st.error = Some(e.to_string());
        st.first_error = Some(e);
    }
}

pub(super) struct Shared {
    pub(super) name: String,
    pub(super) state: Mutex<CommitState>,
    pub(super) changed: Condvar,
    pub(super) sink: Mutex<Sink>,
    pub(super) committed_samples: AtomicU64,
    pub(super) committed_bytes: AtomicU64,
    pub(super) next_sample: AtomicU64,
}

impl Shared {
    /// Records the write's first error; later ones add nothing. No batch commits after it.
    pub(super) fn fail(&self, e: Error) {
        let mut st = self.state.lock().unwrap();
        record_error(&mut st, e);
        self.changed.notify_all();
    }

    /// Errors once the write has failed (or was interrupted or abandoned): the finishing work
    /// asks between its steps, so a stopped write stops writing soon.
    pub(super) fn check_live(&self) -> Result<()> {
        match &self.state.lock().unwrap().error {
            Some(msg) => Err(Error::Runtime(format!(
                "writing cache {:?} stopped: {msg}",
                self.name
            ))),
            None => Ok(()),
        }
    }

    /// Hands an encoded batch over; commits every batch that is now next in line.
    pub(super) fn deliver(&self, seq: u64, batch: Result<Vec<Encoded>>) {
        let mut st = self.state.lock().unwrap();
        match batch {
            Ok(b) => {
                st.pending.insert(seq, b);
            }
            Err(e) => {
                record_error(&mut st, e);
                self.changed.notify_all();
                return;
            }
        }
        if st.committing {
            return; // the active committer will pick this batch up
        }
        st.committing = true;
        loop {
            // `error`, not `first_error`: `finish` may have taken the first error out already.
            if st.error.is_some() {
                break;
            }
            let next = st.next_batch;
            let Some(batch) = st.pending.remove(&next) else {
                break;
            };
            st.next_batch += 1;
            drop(st);
            // A panic must not leave `committing` set: `finish` and `drop` wait on it.
            let result =
                std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.commit(batch)))
                    .unwrap_or_else(|panic| {
                        Err(Error::Runtime(crate::pool::panic_message(&panic)))
                    });
            st = self.state.lock().unwrap();
            if let Err(e) = result {
                record_error(&mut st, e);
            }
            self.changed.notify_all();
        }
        st.committing = false;
        self.changed.notify_all();
    }

    pub(super) fn commit(&self, batch: Vec<Encoded>) -> Result<()> {
        let mut sink = self.sink.lock().unwrap();
        for rec in batch {
            let bytes = u64::from(rec.header.raw_len);
            let sample = self.next_sample.fetch_add(1, Ordering::Relaxed);
            sink.append(rec, sample)?;
            self.committed_samples.fetch_add(1, Ordering::Release);
            self.committed_bytes.fetch_add(bytes, Ordering::Relaxed);
        }
        Ok(())
    }
}

pub(super) fn encode(
    sample: u64,
    data: Payload,
    (fields, json): (&[Field], &RecordMetadataJson),
    compression: Compression,
    sample_id: MetaValue,
    values: Vec<MetaValue>,
) -> Encoded {
    let meta = json.encode(fields, &values);
    let raw = data.as_slice();
    let raw_len = raw.len() as u32;
    let (flags, payload) = match compression.algo {
        CompressionAlgo::Lz4 if !raw.is_empty() => {
            let compressed = lz4_flex::block::compress(raw);
            if (compressed.len() as f64) <= compression.ratio * raw.len() as f64 {
                (FLAG_LZ4, Payload::Owned(compressed))
            } else {
                (0, data)
            }
        }
        _ => (0, data),
    };
    let mut header = RecordHeader {
        flags,
        meta_len: meta.len() as u32,
        stored_len: payload.as_slice().len() as u32,
        raw_len,
        sample,
        checksum: 0,
    };
    header.checksum = header.compute_checksum(&meta, payload.as_slice());
    Encoded {
        header,
        meta,
        payload,
        sample_id,
        values,
    }
}

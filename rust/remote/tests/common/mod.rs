//! Helpers of the integration tests: small caches written by the core's writer, and a store
//! that injects faults (errors, truncated or damaged bodies, delays, failed writes) and counts
//! what it is asked.

// Each test file uses some of the helpers, not all.
#![allow(dead_code)]

use std::collections::VecDeque;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use bytes::Bytes;
use dataset_rt_core::pool::Pool;
use dataset_rt_core::writer::WriterOptions;
use dataset_rt_testkit::{sample, writer_options};
use futures::stream::BoxStream;
use futures::StreamExt;
use object_store::path::Path as Key;
use object_store::{
    CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    ObjectStore, PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

/// Writes cache `name` under `base`: `samples` records of `payload` bytes each (their bytes
/// depend on `seed`), in shards of about `shard_size` bytes.
pub fn write_cache(
    base: &Path,
    name: &str,
    samples: usize,
    payload: usize,
    shard_size: u64,
    seed: u8,
) -> PathBuf {
    let pool = Pool::new(1).unwrap();
    let opts = WriterOptions {
        validate: false,
        shard_size,
        ..writer_options()
    };
    let records = (0..samples).map(|i| {
        let data = (0..payload)
            .map(|j| (i * 31 + j * 7) as u8 ^ seed)
            .collect();
        sample(data, &[])
    });
    dataset_rt_testkit::write_cache(&pool, base, name, opts, records)
}

/// What the next GET meets.
#[derive(Clone, Debug)]
pub enum Fault {
    /// A transient error (as a 503 after the client's retries would be).
    Transient,
    /// The object is not there.
    NotFound,
    /// Access refused.
    Denied,
    /// The body ends early (half of it arrives).
    Truncate,
    /// One byte of the body is flipped.
    Corrupt,
    /// The answer comes after this long.
    Delay(Duration),
}

/// A store over another that applies scripted faults and counts requests.
#[derive(Debug)]
pub struct FaultStore {
    pub inner: Arc<dyn ObjectStore>,
    /// Faults for the next GETs, in order; every GET after them is served normally.
    pub get_faults: Mutex<VecDeque<Fault>>,
    /// A fault applied to every GET (after the scripted ones), if any.
    pub every_get: Mutex<Option<Fault>>,
    /// Writes (PUT, multipart start) allowed before every further one fails.
    pub puts_allowed: AtomicU64,
    pub puts: AtomicU64,
    pub gets: AtomicU64,
    pub get_ranges: Mutex<Vec<(String, Range<u64>)>>,
    /// Every GET asked for, failed ones too: the key and the range, in words.
    pub asked: Mutex<Vec<String>>,
    pub in_flight: AtomicU64,
    pub max_in_flight: AtomicU64,
}

impl std::fmt::Display for FaultStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "FaultStore({})", self.inner)
    }
}

impl FaultStore {
    pub fn new(inner: Arc<dyn ObjectStore>) -> Arc<FaultStore> {
        Arc::new(FaultStore {
            inner,
            get_faults: Mutex::default(),
            every_get: Mutex::default(),
            puts_allowed: AtomicU64::new(u64::MAX),
            puts: AtomicU64::new(0),
            gets: AtomicU64::new(0),
            get_ranges: Mutex::default(),
            asked: Mutex::default(),
            in_flight: AtomicU64::new(0),
            max_in_flight: AtomicU64::new(0),
        })
    }

    pub fn script(&self, faults: impl IntoIterator<Item = Fault>) {
        self.get_faults.lock().unwrap().extend(faults);
    }

    fn generic(message: &str) -> object_store::Error {
        object_store::Error::Generic {
            store: "FaultStore",
            source: message.to_owned().into(),
        }
    }

    fn check_put(&self, key: &Key) -> object_store::Result<()> {
        let n = self.puts.fetch_add(1, Ordering::SeqCst);
        if n >= self.puts_allowed.load(Ordering::SeqCst) {
            return Err(Self::generic(&format!("injected write failure on {key}")));
        }
        Ok(())
    }
}

struct Leave<'a>(&'a AtomicU64);

impl Drop for Leave<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[async_trait]
impl ObjectStore for FaultStore {
    async fn put_opts(
        &self,
        location: &Key,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.check_put(location)?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Key,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.check_put(location)?;
        self.inner.put_multipart_opts(location, opts).await
    }

    async fn get_opts(
        &self,
        location: &Key,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        let now = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
        self.max_in_flight.fetch_max(now, Ordering::SeqCst);
        let _leave = Leave(&self.in_flight);
        self.gets.fetch_add(1, Ordering::SeqCst);
        self.asked
            .lock()
            .unwrap()
            .push(format!("{location} {:?}", options.range));
        let fault = self
            .get_faults
            .lock()
            .unwrap()
            .pop_front()
            .or_else(|| self.every_get.lock().unwrap().clone());
        if let Some(Fault::Delay(d)) = &fault {
            tokio::time::sleep(*d).await;
        }
        match fault {
            Some(Fault::Transient) => return Err(Self::generic("injected: 503 Slow Down")),
            Some(Fault::NotFound) => {
                return Err(object_store::Error::NotFound {
                    path: location.to_string(),
                    source: "injected".into(),
                })
            }
            Some(Fault::Denied) => {
                return Err(object_store::Error::PermissionDenied {
                    path: location.to_string(),
                    source: "injected".into(),
                })
            }
            _ => {}
        }
        let result = self.inner.get_opts(location, options).await?;
        self.get_ranges
            .lock()
            .unwrap()
            .push((location.to_string(), result.range.clone()));
        let (meta, range, attributes, extensions) = (
            result.meta.clone(),
            result.range.clone(),
            result.attributes.clone(),
            result.extensions.clone(),
        );
        let mut body = result.bytes().await?.to_vec();
        match fault {
            Some(Fault::Truncate) => body.truncate(body.len() / 2),
            Some(Fault::Corrupt) if !body.is_empty() => {
                let at = body.len() / 2;
                body[at] ^= 0x55;
            }
            _ => {}
        }
        let stream = futures::stream::once(async move { Ok(Bytes::from(body)) }).boxed();
        Ok(GetResult {
            payload: GetResultPayload::Stream(stream),
            meta,
            range,
            attributes,
            extensions,
        })
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Key>>,
    ) -> BoxStream<'static, object_store::Result<Key>> {
        self.inner.delete_stream(locations)
    }

    fn list(&self, prefix: Option<&Key>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Key>) -> object_store::Result<ListResult> {
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Key,
        to: &Key,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.inner.copy_opts(from, to, options).await
    }
}

//! DatasetRT caches on object storage (S3 and S3-compatible stores, and `file://` through the
//! same code): URLs and settings, the private async runtime, publication (`push`, `pull`, `ls`),
//! range fetching for the read planner, and the node's bounded local cache.
//!
//! Modules (each imports only those above it):
//! - `error`: this crate's error, and its mapping onto the core's;
//! - `location`: URLs; `options`: `RemoteOptions`; `runtime`: the per-process runtime;
//! - `store`: a URL's object store, built from the environment, per process;
//! - `fetch`: `RangeFetcher` (coalescing, depth, retries, verification);
//! - `publish`: the remote layout, `push`, `pull`, `ls`, opening a published cache's manifest;
//! - `sets`: cache sets published at a URL (`push_set`, `publish_set_manifest`, `Published`);
//! - `local`: the node's local cache directory (`NodeCache`) and `CachedFetcher` over it;
//! - `records`: reading a published cache in place (`open_cache`, `RemoteRecords`).

pub mod error;
pub mod fetch;
pub mod local;
pub mod location;
pub mod options;
pub mod publish;
pub mod records;
pub mod runtime;
pub mod sets;
pub mod store;

pub use error::{Error, RequestFailure, Result};
pub use fetch::{coalesce, FetchPolicy, FetchStats, RangeFetcher, RangeRequest, Span, Verify};
pub use local::{CachedFetcher, NodeCache, RangeKey, RANGE_HEADER_LEN};
pub use location::{RemoteUrl, Scheme};
pub use options::RemoteOptions;
pub use publish::{
    ls, pull, push, CacheListing, PublishedCache, PullReport, PushOptions, PushReport,
};
pub use records::{
    open_cache, open_located, open_published, open_remote_cache, open_urls, stored_bytes,
    verify_records, OpenedCache, RemoteRecords,
};
pub use sets::{publish_set_manifest, published_parts, push_set, Published, PublishedSet};
pub use store::Remote;

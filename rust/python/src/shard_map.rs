//! Python views of shard files that take no file descriptor: a read-only map owned by Rust (the
//! core's own map of the shard, or one a loader process made and closed its file after), seen
//! through numpy's array interface as a read-only `uint8` array, then as a `memoryview`.
//!
//! A Python `mmap` would be simpler, but before Python 3.13 it keeps a duplicate of the file's
//! descriptor for as long as it lives: a process that had read every shard of a cache held two
//! descriptors per shard (the core's and the map's), and ran into `RLIMIT_NOFILE` on large
//! caches. The stable ABI of Python 3.10 has no buffer protocol for Rust classes, so numpy's
//! array interface stands in for it.
//!
//! Lifetime: slices of the view keep the array, the array keeps its `ShardMap` (its base), and the
//! `ShardMap` keeps the map, however long anyone holds a view.

use std::sync::Arc;

use dataset_rt_core::cache::Cache;
use memmap2::Mmap;
use pyo3::prelude::*;
use pyo3::types::PyDict;

enum Mapped {
    /// Shard `.1` of the core's cache: the map it validated and verifies records against.
    Cache(Arc<Cache>, u32),
    /// A map of its own (a loader process's), whose file is already closed.
    Own(Mmap),
}

/// A read-only map of one shard file, kept alive by the views of it.
#[pyclass(module = "dataset_rt._native", frozen)]
pub struct ShardMap {
    mapped: Mapped,
}

impl ShardMap {
    fn bytes(&self) -> &[u8] {
        match &self.mapped {
            Mapped::Cache(cache, shard) => cache.shard_bytes(*shard),
            Mapped::Own(map) => map,
        }
    }

    /// The address of the map's first byte.
    pub(crate) fn address(&self) -> usize {
        self.bytes().as_ptr() as usize
    }
}

#[pymethods]
impl ShardMap {
    /// numpy's array interface: the map as a read-only one-dimensional `uint8` array.
    #[getter]
    fn __array_interface__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let bytes = self.bytes();
        let interface = PyDict::new(py);
        interface.set_item("shape", (bytes.len(),))?;
        interface.set_item("typestr", "|u1")?;
        interface.set_item("data", (bytes.as_ptr() as usize, true))?;
        interface.set_item("version", 3)?;
        Ok(interface)
    }

    fn __len__(&self) -> usize {
        self.bytes().len()
    }
}

/// A read-only `memoryview` of the whole map (format `B`), without a descriptor.
fn view<'py>(py: Python<'py>, map: ShardMap) -> PyResult<(Bound<'py, PyAny>, usize)> {
    let map = Bound::new(py, map)?;
    let address = map.get().address();
    let array = py.import("numpy")?.getattr("asarray")?.call1((map,))?;
    let view = py
        .import("builtins")?
        .getattr("memoryview")?
        .call1((array,))?;
    Ok((view, address))
}

/// A view of shard `shard` of `cache`: the core's own map of it.
pub(crate) fn cache_view<'py>(
    py: Python<'py>,
    cache: &Arc<Cache>,
    shard: u32,
) -> PyResult<Bound<'py, PyAny>> {
    let map = ShardMap {
        mapped: Mapped::Cache(cache.clone(), shard),
    };
    view(py, map).map(|(view, _)| view)
}

/// A view of a map of its own, and the map's address.
pub(crate) fn own_view<'py>(py: Python<'py>, map: Mmap) -> PyResult<(Bound<'py, PyAny>, usize)> {
    view(
        py,
        ShardMap {
            mapped: Mapped::Own(map),
        },
    )
}

//! `dataset_rt._native`: thin PyO3 bindings over `dataset-rt-core`. Every decision about
//! correctness is made in the core; this crate converts values, releases the GIL around all I/O,
//! compute and waiting, and maps core errors onto the Python exception tree.

mod cache_set;
mod config;
mod dataset;
mod errors;
mod inspect;
mod loader;
mod progress;
mod remote;
mod runtime;
mod shard_map;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("FORMAT_VERSION", dataset_rt_core::format::FORMAT_VERSION)?;
    errors::register(m)?;
    m.add_class::<runtime::Runtime>()?;
    m.add_class::<dataset::Dataset>()?;
    m.add_class::<dataset::DatasetIterator>()?;
    m.add_class::<dataset::BatchIterator>()?;
    m.add_class::<dataset::Batch>()?;
    m.add_class::<dataset::CachedSample>()?;
    m.add_class::<shard_map::ShardMap>()?;
    m.add_class::<cache_set::SetProgress>()?;
    m.add_class::<cache_set::SetBuilder>()?;
    m.add_function(wrap_pyfunction!(cache_set::write_part, m)?)?;
    m.add_function(wrap_pyfunction!(cache_set::bind_to_parent, m)?)?;
    m.add_function(wrap_pyfunction!(dataset::epoch_order, m)?)?;
    m.add_function(wrap_pyfunction!(config::check_compression, m)?)?;
    m.add_function(wrap_pyfunction!(config::check_reader_config, m)?)?;
    m.add_function(wrap_pyfunction!(config::check_writer_config, m)?)?;
    m.add_function(wrap_pyfunction!(inspect::inspect_cache, m)?)?;
    m.add_function(wrap_pyfunction!(inspect::verify_cache, m)?)?;
    m.add_function(wrap_pyfunction!(inspect::head_records, m)?)?;
    m.add_function(wrap_pyfunction!(inspect::payload_spans, m)?)?;
    m.add_function(wrap_pyfunction!(remote::check_remote_config, m)?)?;
    m.add_function(wrap_pyfunction!(remote::push_cache, m)?)?;
    m.add_function(wrap_pyfunction!(remote::pull_cache, m)?)?;
    m.add_function(wrap_pyfunction!(remote::list_caches, m)?)?;
    m.add_function(wrap_pyfunction!(remote::inspect_remote_cache, m)?)?;
    m.add_function(wrap_pyfunction!(remote::remote_local_dir, m)?)?;
    m.add_function(wrap_pyfunction!(remote::verify_remote_cache, m)?)?;
    m.add_function(wrap_pyfunction!(remote::published_set_parts, m)?)?;
    m.add_function(wrap_pyfunction!(remote::publish_set, m)?)?;
    loader::register(m)?;
    Ok(())
}

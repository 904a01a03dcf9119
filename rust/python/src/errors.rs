//! The Python exception tree, rooted at `DatasetRTError`, and the mapping from core errors.

use dataset_rt_core::Error;
use pyo3::create_exception;
use pyo3::exceptions::{
    PyException, PyFileNotFoundError, PyMemoryError, PyOSError, PyPermissionError,
};
use pyo3::prelude::*;

create_exception!(
    dataset_rt._native,
    DatasetRTError,
    PyException,
    "Root of every DatasetRT error."
);
create_exception!(
    dataset_rt._native,
    ConfigError,
    DatasetRTError,
    "A configuration value is invalid."
);
create_exception!(
    dataset_rt._native,
    CacheMalformedError,
    DatasetRTError,
    "A published cache failed validation."
);
create_exception!(
    dataset_rt._native,
    CorruptRecordError,
    DatasetRTError,
    "A record failed its checksum while being read."
);
create_exception!(
    dataset_rt._native,
    InvalidSampleError,
    DatasetRTError,
    "A sample given to the writer is not acceptable."
);
create_exception!(
    dataset_rt._native,
    SamplesMetadataError,
    DatasetRTError,
    "A samples-metadata table was refused."
);
create_exception!(
    dataset_rt._native,
    StateError,
    DatasetRTError,
    "An iterator state was refused."
);
create_exception!(
    dataset_rt._native,
    RuntimeStateError,
    DatasetRTError,
    "The runtime cannot run the work (closed, forked, internal failure)."
);

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("DatasetRTError", py.get_type::<DatasetRTError>())?;
    m.add("ConfigError", py.get_type::<ConfigError>())?;
    m.add("CacheMalformedError", py.get_type::<CacheMalformedError>())?;
    m.add("CorruptRecordError", py.get_type::<CorruptRecordError>())?;
    m.add("InvalidSampleError", py.get_type::<InvalidSampleError>())?;
    m.add(
        "SamplesMetadataError",
        py.get_type::<SamplesMetadataError>(),
    )?;
    m.add("StateError", py.get_type::<StateError>())?;
    m.add("RuntimeStateError", py.get_type::<RuntimeStateError>())?;
    Ok(())
}

/// Maps a core error; I/O errors keep their Python kinds.
pub fn to_py(err: Error) -> PyErr {
    let msg = err.to_string();
    match err {
        Error::Io { source, .. } => match (source.raw_os_error(), source.kind()) {
            // `OSError(errno, message)` becomes the matching subclass (PermissionError for
            // EACCES, FileNotFoundError for ENOENT ...) and keeps `errno`.
            (Some(errno), _) => PyOSError::new_err((errno, msg)),
            (None, std::io::ErrorKind::NotFound) => PyFileNotFoundError::new_err(msg),
            (None, std::io::ErrorKind::PermissionDenied) => PyPermissionError::new_err(msg),
            (None, _) => PyOSError::new_err(msg),
        },
        Error::OutOfMemory { .. } => PyMemoryError::new_err(msg),
        Error::Malformed { .. } => CacheMalformedError::new_err(msg),
        Error::CorruptRecord { .. } => CorruptRecordError::new_err(msg),
        Error::InvalidSample { .. } => InvalidSampleError::new_err(msg),
        Error::InvalidConfig { .. } => ConfigError::new_err(msg),
        Error::SamplesMetadata(_) => SamplesMetadataError::new_err(msg),
        Error::State(_) => StateError::new_err(msg),
        _ => RuntimeStateError::new_err(msg),
    }
}

pub trait IntoPyResult<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for dataset_rt_core::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

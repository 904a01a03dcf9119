//! The Python exception tree, rooted at `DatasetRTError`, and the one mapping from the core's
//! error-kind table onto it.

use dataset_rt_core::{Error, ErrorKind};
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyMemoryError, PyOSError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

create_exception!(
    dataset_rt._native,
    DatasetRTError,
    PyException,
    "Root of every DatasetRT error."
);
/// A configuration value is invalid: a `DatasetRTError` and also a `ValueError`, so code that
/// validates arguments the usual Python way catches it. `create_exception!` takes one base, so
/// the type is made like it but with both bases.
#[repr(transparent)]
pub struct ConfigError(PyAny);

pyo3::impl_exception_boilerplate!(ConfigError);
pyo3::pyobject_native_type_core!(
    ConfigError,
    ConfigError::type_object_raw,
    #module = Some("dataset_rt._native")
);

impl ConfigError {
    fn type_object_raw(py: Python<'_>) -> *mut pyo3::ffi::PyTypeObject {
        static TYPE_OBJECT: PyOnceLock<Py<PyType>> = PyOnceLock::new();
        TYPE_OBJECT
            .get_or_init(py, || {
                let bases = PyTuple::new(
                    py,
                    [
                        py.get_type::<DatasetRTError>(),
                        py.get_type::<PyValueError>(),
                    ],
                )
                .expect("a tuple of two types");
                let namespace = PyDict::new(py);
                namespace
                    .set_item("__module__", "dataset_rt._native")
                    .and_then(|()| {
                        namespace.set_item("__doc__", "A configuration value is invalid.")
                    })
                    .expect("str keys and values");
                py.get_type::<PyType>()
                    .call1(("ConfigError", bases, namespace))
                    .and_then(|t| Ok(t.cast_into::<PyType>()?.unbind()))
                    .expect("Failed to initialize the ConfigError type.")
            })
            .as_ptr() as *mut pyo3::ffi::PyTypeObject
    }
}
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
create_exception!(
    dataset_rt._native,
    LoaderError,
    DatasetRTError,
    "The shared-memory loader failed: a process died, the producer failed, or a batch does not fit."
);
create_exception!(
    dataset_rt._native,
    RingClosed,
    LoaderError,
    "The ring was closed (stopped, owner gone, or the producer failed earlier): the party exits."
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
    m.add("LoaderError", py.get_type::<LoaderError>())?;
    m.add("RingClosed", py.get_type::<RingClosed>())?;
    Ok(())
}

/// The Python exception of an error of `kind`, with the operating system's `errno` when it has
/// one. The match is exhaustive: a new kind fails to compile here until it has a class.
pub fn from_kind(kind: ErrorKind, errno: Option<i32>, msg: String) -> PyErr {
    match kind {
        ErrorKind::Io => os_error(errno, msg),
        ErrorKind::Malformed => CacheMalformedError::new_err(msg),
        ErrorKind::CorruptRecord => CorruptRecordError::new_err(msg),
        ErrorKind::InvalidSample => InvalidSampleError::new_err(msg),
        ErrorKind::InvalidConfig => ConfigError::new_err(msg),
        ErrorKind::SamplesMetadata => SamplesMetadataError::new_err(msg),
        ErrorKind::State => StateError::new_err(msg),
        ErrorKind::OutOfMemory => PyMemoryError::new_err(msg),
        ErrorKind::Runtime | ErrorKind::Interrupted => RuntimeStateError::new_err(msg),
        ErrorKind::Loader | ErrorKind::BatchTooLarge => LoaderError::new_err(msg),
        ErrorKind::Closed => RingClosed::new_err(msg),
    }
}

/// `OSError(errno, message)`, which Python turns into the matching subclass
/// (`FileNotFoundError` for ENOENT, `PermissionError` for EACCES ...) keeping `errno`.
pub fn os_error(errno: Option<i32>, msg: String) -> PyErr {
    match errno {
        Some(errno) => PyOSError::new_err((errno, msg)),
        None => PyOSError::new_err(msg),
    }
}

/// Maps a core error by its kind; I/O errors keep their errno and so their Python kinds.
pub fn to_py(err: Error) -> PyErr {
    from_kind(err.kind(), err.errno(), err.to_string())
}

pub trait IntoPyResult<T> {
    fn py_err(self) -> PyResult<T>;
}

impl<T> IntoPyResult<T> for dataset_rt_core::Result<T> {
    fn py_err(self) -> PyResult<T> {
        self.map_err(to_py)
    }
}

/// The credentials of the environment, whose values must never reach a message. A store's
/// error can quote what the server sent back, and a server may echo a signed request (its
/// session-token header included); the access key id is not a secret, but it is hidden too.
const CREDENTIAL_VARIABLES: [&str; 3] = [
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_ACCESS_KEY_ID",
];

/// `message` with the value of every credential variable of the environment replaced by
/// `***`. Values shorter than 8 characters are left alone: no real key is that short, and
/// replacing a short word would garble the message for nothing.
pub fn scrub_credentials(message: String) -> String {
    let mut message = message;
    for name in CREDENTIAL_VARIABLES {
        if let Some(value) = std::env::var_os(name) {
            let value = value.to_string_lossy();
            if value.len() >= 8 && message.contains(value.as_ref()) {
                message = message.replace(value.as_ref(), "***");
            }
        }
    }
    message
}

/// The Python exception of a remote error: a bad setting or URL is a `ConfigError`; a failed
/// request an `OSError` whose errno says what kind (`FileNotFoundError` for a missing object or
/// bucket, `PermissionError` for refused credentials, `ConnectionRefusedError` for an
/// unreachable endpoint, `TimeoutError` after every attempt failed in time, `FileExistsError`
/// for a cache already published or changed meanwhile); bytes that never verified are a
/// `CacheMalformedError`. Every message names the URL, and none holds a credential.
pub fn remote_to_py(err: dataset_rt_remote::Error) -> PyErr {
    use dataset_rt_remote::{Error as Remote, RequestFailure as Failure};
    let msg = scrub_credentials(err.to_string());
    match err {
        Remote::Config { .. } | Remote::Url { .. } => ConfigError::new_err(msg),
        // An object shorter than the manifest says: damage on the server, as a checksum is.
        Remote::Request {
            failure: Failure::Short,
            ..
        } => CacheMalformedError::new_err(msg),
        Remote::Request { failure, .. } => {
            let errno = match failure {
                Failure::NotFound => libc::ENOENT,
                Failure::Denied => libc::EACCES,
                Failure::Conflict => libc::EEXIST,
                Failure::Unreachable => libc::ECONNREFUSED,
                Failure::Transient | Failure::NoAnswer => libc::ETIMEDOUT,
                Failure::Refused => libc::EINVAL,
                Failure::Short => unreachable!("matched above"),
            };
            os_error(Some(errno), msg)
        }
        Remote::AlreadyPublished { .. } => os_error(Some(libc::EEXIST), msg),
        Remote::Verify { .. } => CacheMalformedError::new_err(msg),
        Remote::Core(e) => from_kind(e.kind(), e.errno(), msg),
        other => {
            let core = dataset_rt_core::Error::from(other);
            from_kind(core.kind(), core.errno(), msg)
        }
    }
}

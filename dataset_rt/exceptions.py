"""DatasetRT's exception tree, rooted at :class:`DatasetRTError` (the classes are defined once,
in the native module, and re-exported here and from ``dataset_rt``)::

    DatasetRTError
    ├── ConfigError (also a ValueError)   an invalid configuration value or argument
    ├── CacheMalformedError               a published cache failed validation
    ├── CorruptRecordError                a record failed its checksum while being read
    ├── InvalidSampleError                the writer refused a sample
    ├── SamplesMetadataError              a samples-metadata table was refused
    ├── StateError                        an iterator state was refused
    ├── RuntimeStateError                 the runtime cannot run the work (closed, forked)
    └── LoaderError                       the shared-memory loader failed
        └── WorkerError                   worker_init_fn, transform or collate_fn raised

I/O errors keep Python's own kinds (``FileNotFoundError``, ``PermissionError``, ``OSError``) and
running out of memory is ``MemoryError``. The loader's internal stop signal between its own
processes is not part of the public tree and never reaches the training loop.
"""

from dataset_rt._native import (
    CacheMalformedError,
    ConfigError,
    CorruptRecordError,
    DatasetRTError,
    InvalidSampleError,
    LoaderError,
    RuntimeStateError,
    SamplesMetadataError,
    StateError,
    WorkerError,
)

__all__ = [
    "CacheMalformedError",
    "ConfigError",
    "CorruptRecordError",
    "DatasetRTError",
    "InvalidSampleError",
    "LoaderError",
    "RuntimeStateError",
    "SamplesMetadataError",
    "StateError",
    "WorkerError",
]

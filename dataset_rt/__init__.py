"""DatasetRT: a correctness-first dataset cache and data loader for ML training."""

from dataset_rt._config import ReaderConfig, RemoteConfig, ShardCompression, WriterConfig
from dataset_rt._dataset import Batch, CachedSample, Dataset
from dataset_rt._loader import DataLoader
from dataset_rt._native import __version__
from dataset_rt._results import (
    CacheInput,
    CacheLoaded,
    CacheMalformed,
    CacheMissing,
    CacheSourceResult,
    CacheSourcesDatasetError,
    CacheSourcesDatasetSuccess,
    CacheWriteError,
    CacheWritten,
)
from dataset_rt._runtime import DatasetRuntime
from dataset_rt._sets import CacheSet
from dataset_rt.exceptions import (
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
    "Batch",
    "CacheInput",
    "CacheLoaded",
    "CacheMalformed",
    "CacheMalformedError",
    "CacheMissing",
    "CacheSet",
    "CacheSourceResult",
    "CacheSourcesDatasetError",
    "CacheSourcesDatasetSuccess",
    "CacheWriteError",
    "CacheWritten",
    "CachedSample",
    "ConfigError",
    "CorruptRecordError",
    "DataLoader",
    "Dataset",
    "DatasetRTError",
    "DatasetRuntime",
    "InvalidSampleError",
    "LoaderError",
    "ReaderConfig",
    "RemoteConfig",
    "RuntimeStateError",
    "SamplesMetadataError",
    "ShardCompression",
    "StateError",
    "WorkerError",
    "WriterConfig",
    "__version__",
]

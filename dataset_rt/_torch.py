"""The PyTorch adapter. Imported only when ``Dataset.to_torch_iterable_dataset()`` is called, so
``dataset_rt`` itself never imports torch."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch.utils.data

from dataset_rt._native import CachedSample, ConfigError

if TYPE_CHECKING:
    from dataset_rt._dataset import Dataset

__all__ = ["TorchIterableDataset"]

_WORKERS_REFUSED = (
    "DatasetRT's torch IterableDataset runs in the training process only: use "
    "torch.utils.data.DataLoader(..., num_workers=0) and parallelise reads with "
    "DatasetRuntime(num_workers=N). Torch worker processes would each replay the whole epoch; "
    "for parallel Python transforms use the shared-memory loader (dataset_rt.DataLoader)."
)


class TorchIterableDataset(torch.utils.data.IterableDataset[CachedSample]):
    """A sized ``IterableDataset`` over a DatasetRT dataset, yielding :class:`CachedSample`.

    It neither decodes payloads nor changes the order: one pass is one epoch of the dataset.
    """

    def __init__(self, dataset: Dataset) -> None:
        super().__init__()
        self.dataset = dataset

    def __iter__(self) -> Iterator[CachedSample]:
        if torch.utils.data.get_worker_info() is not None:
            raise ConfigError(_WORKERS_REFUSED)
        return iter(self.dataset)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getstate__(self) -> Any:
        raise ConfigError(_WORKERS_REFUSED)

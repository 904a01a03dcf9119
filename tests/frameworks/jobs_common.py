"""What the framework jobs (tests/frameworks/*_job.py) share: a tiny regression cache, its
examples, the model, and the record each rank writes for the tests to compare.

Every job trains the same linear model on the same 39 points, 2 processes, batches of 4 per rank
(so each rank reads 20 samples an epoch: one of them is the rank split's padding), for 2 epochs.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dataset_rt import CachedSample, Dataset, DatasetRuntime, ReaderConfig, WriterConfig
from dataset_rt.testing import make_source

CACHE = "points"
SAMPLES = 39
BATCH_SIZE = 4
EPOCHS = 2
SEED = 7
# Steps a run that is stopped mid-epoch takes before it stops (epoch 1 has 5 steps per rank).
STOP_AFTER = 7
LEARNING_RATE = 0.05


def point(i: int) -> tuple[list[float], float]:
    x = [math.sin(i * (k + 1) * 0.37) for k in range(4)]
    return x, 0.5 * x[0] - 1.5 * x[1] + 0.25 * x[2] + 2.0 * x[3] + 0.1


def write_cache(base: Path) -> None:
    samples = []
    for i in range(SAMPLES):
        x, y = point(i)
        samples.append((struct.pack("<5f", *x, y), {"sample_id": i}))
    with DatasetRuntime(num_workers=1) as runtime:
        result = runtime.from_cache_sources(
            make_source(CACHE, samples), base, writer_config=WriterConfig(show_progress=False)
        )
        assert result.dataset is not None, result


def open_points(runtime: DatasetRuntime, base: str | Path) -> Dataset:
    """The cache, with this process's rank and world size from torch.distributed."""
    result = runtime.open_caches(CACHE, base, reader_config=ReaderConfig(seed=SEED))
    assert result.dataset is not None, result
    return result.dataset


def to_example(sample: CachedSample) -> tuple[torch.Tensor, torch.Tensor, int]:
    values = torch.tensor(struct.unpack("<5f", sample.data))
    return values[:4], values[4:], int(sample.metadata["sample_id"])


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 1)


def record(out: Path, name: str, **fields: Any) -> None:
    """Writes one rank's record (`pid`: the training process, owner of the loader's
    segments)."""
    out.mkdir(parents=True, exist_ok=True)
    fields.setdefault("pid", os.getpid())
    (out / f"{name}.json").write_text(json.dumps(fields))


def weights(model: nn.Module) -> dict[str, list[float]]:
    return {k: v.detach().flatten().tolist() for k, v in model.state_dict().items()}


def loader_workers(workers: int) -> dict[str, Any]:
    """The loader's worker arguments for `workers` processes, as docs/frameworks.md recommends
    under a framework's process group: spawned (forking beside gloo's threads can deadlock a
    worker) and persistent (started once, not at every epoch)."""
    if workers == 0:
        return {}
    return {
        "num_workers": workers,
        "multiprocessing_context": "spawn",
        "persistent_workers": True,
        # A spawned worker imports torch (and the job's framework) before its first heartbeat:
        # on a loaded test machine, beyond the default 30 s.
        "heartbeat_timeout": 120.0,
    }

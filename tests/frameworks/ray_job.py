"""Trains the points model with Ray Train's `TorchTrainer` (2 CPU workers on a local Ray
cluster) over `dataset_rt.torch.DataLoader`, each worker reading the same cache on disk
(tests/frameworks/test_ray.py).

Two fits: one uninterrupted (`--out/whole`), and one whose workers fail after `STOP_AFTER` steps
of their first attempt (`--out/failed`): Ray restarts them (`FailureConfig(max_failures=1)`) and
they resume from the last Ray checkpoint, which holds the model, the optimizer and the loader's
state. Workers checkpoint every `CHECKPOINT_EVERY` steps; each attempt writes
`<out>/attempt<A>/rank<R>.json`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import jobs_common as common
import ray
import ray.train
import torch
from ray.train import Checkpoint, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

import dataset_rt.torch
from dataset_rt import DatasetRuntime

CHECKPOINT_EVERY = 3


def train_loop(config: dict[str, Any]) -> None:
    context = ray.train.get_context()
    rank = context.get_world_rank()
    out = Path(config["out"])
    checkpoint = ray.train.get_checkpoint()
    attempt = 0 if checkpoint is None else 1
    with DatasetRuntime(num_workers=1) as runtime:
        # Ray set up torch.distributed before calling this: the dataset takes its rank from it.
        dataset = common.open_points(runtime, config["cache"])
        assert (dataset.rank, dataset.world_size) == (rank, 2)
        model = ray.train.torch.prepare_model(common.make_model())
        optimizer = torch.optim.SGD(model.parameters(), lr=common.LEARNING_RATE)
        loader = dataset_rt.torch.DataLoader(
            dataset, batch_size=common.BATCH_SIZE, transform=common.to_example
        )
        done = 0
        if checkpoint is not None:
            with checkpoint.as_directory() as saved:
                state = torch.load(Path(saved) / "state.pt")
                model.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
                loader.load_state_dict(json.loads((Path(saved) / "loader.json").read_text()))
                done = state["steps"]
        steps: list[list[int]] = []
        with loader:
            while loader.state_dict()["epoch"] < common.EPOCHS:
                for x, y, ids in loader:
                    optimizer.zero_grad()
                    torch.nn.functional.mse_loss(model(x), y).backward()
                    optimizer.step()
                    steps.append(ids.tolist())
                    done += 1
                    if done % CHECKPOINT_EVERY == 0:
                        report(rank, done, model, optimizer, loader)
                    if config["fail"] and attempt == 0 and done == common.STOP_AFTER:
                        common.record(out / f"attempt{attempt}", f"rank{rank}", steps=steps)
                        raise RuntimeError("a worker fails mid-epoch (on purpose)")
    weights = common.weights(model.module if hasattr(model, "module") else model)
    common.record(out / f"attempt{attempt}", f"rank{rank}", steps=steps, weights=weights)


def report(rank: int, done: int, model: Any, optimizer: Any, loader: Any) -> None:
    """A Ray checkpoint from rank 0 (every rank's loader state resumes every rank)."""
    with tempfile.TemporaryDirectory() as directory:
        checkpoint = None
        if rank == 0:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save({**state, "steps": done}, Path(directory) / "state.pt")
            (Path(directory) / "loader.json").write_text(json.dumps(loader.state_dict()))
            checkpoint = Checkpoint.from_directory(directory)
        ray.train.report({"steps": done}, checkpoint=checkpoint)


def fit(name: str, cache: Path, out: Path, storage: Path, fail: bool) -> None:
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"cache": str(cache), "out": str(out / name), "fail": fail},
        scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
        run_config=RunConfig(
            name=name,
            storage_path=str(storage),
            failure_config=FailureConfig(max_failures=1 if fail else 0),
        ),
    )
    trainer.fit()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    # Short: Ray's socket paths live under it, and a Unix socket path has at most 107 bytes.
    parser.add_argument("--ray-dir", type=Path, required=True)
    args = parser.parse_args()
    work = args.out.resolve()
    ray.init(num_cpus=2, include_dashboard=False, _temp_dir=str(args.ray_dir.resolve()))
    try:
        fit("whole", args.cache.resolve(), work, work / "results", fail=False)
        fit("failed", args.cache.resolve(), work, work / "results", fail=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

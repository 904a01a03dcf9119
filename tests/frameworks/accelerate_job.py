"""Trains the points model with Hugging Face Accelerate on 2 CPU processes over
`dataset_rt.torch.DataLoader` (run by `accelerate launch`; tests/frameworks/test_accelerate.py).

`--checkpoint DIR`: `accelerator.save_state(DIR)` after `STOP_AFTER` steps (mid-epoch);
`--resume DIR`: `accelerator.load_state(DIR)` first. Each rank writes `--out/rank<R>.json`: the
sample ids of each step and its final weights.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jobs_common as common
import torch
from accelerate import Accelerator

import dataset_rt.torch
from dataset_rt import DatasetRuntime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoint", type=Path)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True)  # sets up the process group
    assert accelerator.num_processes == 2, accelerator.state
    with DatasetRuntime(num_workers=1) as runtime:
        dataset = common.open_points(runtime, args.cache)
        assert (dataset.rank, dataset.world_size) == (accelerator.process_index, 2)
        model = common.make_model()
        optimizer = torch.optim.SGD(model.parameters(), lr=common.LEARNING_RATE)
        loader = dataset_rt.torch.DataLoader(
            dataset,
            batch_size=common.BATCH_SIZE,
            transform=common.to_example,
            **common.loader_workers(args.workers),
        )
        model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
        # No second rank split and no dispatcher: prepare() hands our loader back.
        assert prepared is loader
        accelerator.register_for_checkpointing(loader)
        if args.resume is not None:
            accelerator.load_state(args.resume)
        steps: list[list[int]] = []
        with loader:
            while loader.state_dict()["epoch"] < common.EPOCHS:
                for x, y, ids in loader:
                    optimizer.zero_grad()
                    loss = torch.nn.functional.mse_loss(model(x), y)
                    accelerator.backward(loss)
                    optimizer.step()
                    steps.append(ids.tolist())
                    if args.checkpoint is not None and len(steps) == common.STOP_AFTER:
                        accelerator.save_state(args.checkpoint)
    common.record(
        args.out,
        f"rank{accelerator.process_index}",
        steps=steps,
        weights=common.weights(accelerator.unwrap_model(model)),
    )
    accelerator.end_training()


if __name__ == "__main__":
    main()

"""Fits the points model with Lightning's `Trainer(strategy="ddp", devices=2)` on CPU over
`dataset_rt.torch.DataLoader` (tests/frameworks/test_lightning.py runs it).

Lightning's checkpoint of step `STOP_AFTER` (mid-epoch) goes to `--checkpoints`; `--resume CKPT`
resumes from one with `Trainer.fit(ckpt_path=)`. Each rank writes
`--out/rank<R>.json`: the sample ids of each step, its final weights and what Lightning did to the
loader.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import jobs_common as common
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import dataset_rt.torch
from dataset_rt import DatasetRuntime


class Points(L.LightningModule):
    def __init__(self, cache: Path, out: Path, workers: int) -> None:
        super().__init__()
        self.cache, self.out, self.workers = cache, out, workers
        self.net = common.make_model()
        self.steps: list[list[int]] = []
        self.runtime: DatasetRuntime | None = None
        self.loader: dataset_rt.torch.DataLoader | None = None

    def train_dataloader(self) -> Any:
        # Called once the process group is up: the dataset takes its rank from it.
        self.runtime = DatasetRuntime(num_workers=1)
        dataset = common.open_points(self.runtime, self.cache)
        assert (dataset.rank, dataset.world_size) == (self.global_rank, 2)
        self.loader = dataset_rt.torch.DataLoader(
            dataset,
            batch_size=common.BATCH_SIZE,
            transform=common.to_example,
            **common.loader_workers(self.workers),
        )
        return self.loader

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y, ids = batch
        self.steps.append(ids.tolist())
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=common.LEARNING_RATE)

    def on_train_end(self) -> None:
        used = self.trainer.train_dataloader
        common.record(
            self.out,
            f"rank{self.global_rank}",
            steps=self.steps,
            weights=common.weights(self.net),
            same_loader=used is self.loader,
            sampler=type(getattr(used, "sampler", None)).__name__,
        )
        assert self.loader is not None and self.runtime is not None
        self.loader.close()
        self.runtime.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--checkpoints", type=Path, required=True)
    parser.add_argument("--resume", type=Path)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=common.EPOCHS,
        callbacks=[
            ModelCheckpoint(
                dirpath=args.checkpoints,
                every_n_train_steps=common.STOP_AFTER,
                save_top_k=-1,
            )
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Points(args.cache, args.out, args.workers), ckpt_path=args.resume)


if __name__ == "__main__":
    main()

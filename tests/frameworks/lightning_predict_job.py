"""Predicts with Lightning's `Trainer(strategy="ddp", devices=2).predict` on CPU over
`dataset_rt.torch.DataLoader` (tests/frameworks/test_lightning.py runs it).

Lightning re-creates the loader for prediction around a batch sampler that records each batch's
indices; a `BasePredictionWriter` receives them. Each rank writes `--out/rank<R>.json`: per batch
the indices the writer got and the sample ids of the batch, the indices and predictions of the
epoch, and what Lightning did to the loader.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import jobs_common as common
import lightning as L
from lightning.pytorch.callbacks import BasePredictionWriter

import dataset_rt.torch
from dataset_rt import DatasetRuntime


class Points(L.LightningModule):
    def __init__(self, cache: Path, workers: int) -> None:
        super().__init__()
        self.cache, self.workers = cache, workers
        self.net = common.make_model()
        self.runtime: DatasetRuntime | None = None
        self.loader: dataset_rt.torch.DataLoader | None = None

    def predict_dataloader(self) -> Any:
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

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, list[Any]]:
        x, _, ids = batch
        return {"ids": ids.tolist(), "out": self.net(x).squeeze(1).tolist()}


class Writer(BasePredictionWriter):
    def __init__(self, out: Path) -> None:
        super().__init__(write_interval="batch_and_epoch")
        self.out = out
        self.batches: list[dict[str, list[int]]] = []

    def write_on_batch_end(
        self, trainer, pl_module, prediction, batch_indices, batch, batch_idx, dataloader_idx
    ) -> None:
        self.batches.append({"indices": list(batch_indices), "ids": batch[2].tolist()})

    def write_on_epoch_end(self, trainer, pl_module, predictions, batch_indices) -> None:
        used = trainer.predict_dataloaders
        common.record(
            self.out,
            f"rank{trainer.global_rank}",
            batches=self.batches,
            epoch_indices=batch_indices[0],
            predictions=predictions,  # one loader: its list itself
            recreated=used is not pl_module.loader,
            batch_sampler=type(used.batch_sampler).__name__,
        )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=0)
    args = parser.parse_args()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        callbacks=[Writer(args.out)],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Points(args.cache, args.workers)
    trainer.predict(model, return_predictions=False)
    for loader in (trainer.predict_dataloaders, model.loader):
        loader.close()
    assert model.runtime is not None
    model.runtime.close()
    # Rank 0's exit ends the job: the other rank has written its record by then.
    trainer.strategy.barrier()


if __name__ == "__main__":
    main()

"""Train a small CNN on the digits, stop mid-epoch, resume in a new process: same weights.

The digits that ship with scikit-learn are packed into a DatasetRT cache (labels as metadata)
and fed to a small CNN by ``dataset_rt.torch.DataLoader`` with two worker processes. The script
then trains three times, each in a process of its own:

1. ``full``: every epoch without a break, then saves the weights (``full.pt``);
2. ``interrupted``: stops in the middle of an epoch and saves a checkpoint (``checkpoint.pt``)
   with the model, the optimizer, the loader's ``state_dict()`` and torch's random state;
3. ``resumed``: a new process loads that checkpoint, finishes the run and saves ``resumed.pt``.

It exits 0 when every tensor of ``resumed.pt`` equals the one in ``full.pt`` bit for bit. That
holds because the loader's state counts exactly the batches the loop received (not what the
workers prefetched), the order of an epoch is a pure function of the seed and the epoch, and the
training process runs torch single-threaded with deterministic algorithms.

    python examples/torch_resume.py                     # all digits, 4 epochs
    python examples/torch_resume.py --small             # a 512-digit subset, 2 epochs
    python examples/torch_resume.py --workdir /tmp/run  # keep the cache and the weights there
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from digits_cache import NUM_CLASSES, DigitsSource, open_digits, pixels
from torch import nn

import dataset_rt.torch
from dataset_rt import CachedSample, DatasetRuntime, ReaderConfig

BATCH_SIZE = 32


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Linear(32 * 4 * 4, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def to_example(sample: CachedSample) -> tuple[torch.Tensor, int]:
    """Runs in the loader's workers: the payload view becomes a tensor, the label an int."""
    return torch.from_numpy(pixels(sample.data)), int(sample.metadata["label"])


def deterministic_torch() -> None:
    torch.manual_seed(0)
    # One intra-op thread: reductions then add in one order, so runs agree bit for bit.
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)


def train(args: argparse.Namespace) -> None:
    """One training process: ``--phase full``, ``interrupted`` or ``resumed``."""
    deterministic_torch()
    workdir = Path(args.workdir)
    model = SmallCNN()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    with DatasetRuntime(num_workers=2) as runtime:
        dataset = open_digits(
            runtime,
            workdir / "caches",
            DigitsSource("digits", range(args.samples)),
            ReaderConfig(seed=1234, shuffle=True),
        )
        with dataset_rt.torch.DataLoader(
            dataset, batch_size=BATCH_SIZE, num_workers=args.num_workers, transform=to_example
        ) as loader:
            step = 0
            if args.phase == "resumed":
                checkpoint = torch.load(workdir / "checkpoint.pt")
                model.load_state_dict(checkpoint["model"])
                optimizer.load_state_dict(checkpoint["optimizer"])
                loader.load_state_dict(checkpoint["loader"])
                torch.set_rng_state(checkpoint["torch_rng"])
                step = checkpoint["step"]
                print(f"resumed at step {step}: {checkpoint['loader']}")
            stop_at = len(loader) * args.epochs // 2 + len(loader) // 3
            # The loader's state says which epoch comes next, in every phase alike.
            while loader.state_dict()["epoch"] < args.epochs:
                for images, labels in loader:
                    optimizer.zero_grad()
                    loss = nn.functional.cross_entropy(model(images), labels)
                    loss.backward()
                    optimizer.step()
                    step += 1
                    if args.phase == "interrupted" and step == stop_at:
                        save_checkpoint(workdir / "checkpoint.pt", model, optimizer, loader, step)
                        print(f"checkpoint at step {step}: {loader.state_dict()}")
                        return
                print(f"epoch done at step {step}, loss {loss.item():.4f}")
    torch.save(model.state_dict(), workdir / f"{args.phase}.pt")


def save_checkpoint(path: Path, model: nn.Module, optimizer: Any, loader: Any, step: int) -> None:
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "loader": loader.state_dict(),  # plain JSON-able data
            "torch_rng": torch.get_rng_state(),
            "step": step,
        },
        path,
    )


def run_all(args: argparse.Namespace) -> int:
    """Runs the three phases, each in a new process, and compares the final weights."""
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    common = [
        f"--workdir={workdir}",
        f"--samples={args.samples}",
        f"--epochs={args.epochs}",
        f"--num-workers={args.num_workers}",
    ]
    for phase in ("full", "interrupted", "resumed"):
        print(f"--- {phase}", flush=True)
        subprocess.run([sys.executable, __file__, f"--phase={phase}", *common], check=True)
    full = torch.load(workdir / "full.pt")
    resumed = torch.load(workdir / "resumed.pt")
    different = [name for name in full if not torch.equal(full[name], resumed[name])]
    if different or full.keys() != resumed.keys():
        print(f"FAILED: resumed weights differ from the uninterrupted run in {different}")
        return 1
    print(f"OK: all {len(full)} tensors of the resumed run equal the uninterrupted run's")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="512 digits, 2 epochs")
    parser.add_argument("--samples", type=int, help="digits to use (default 1797, all)")
    parser.add_argument("--epochs", type=int, help="epochs (default 4)")
    parser.add_argument("--num-workers", type=int, default=2, help="loader workers (2)")
    parser.add_argument("--workdir", help="cache and weights go here (default: a temp dir)")
    parser.add_argument("--phase", choices=["full", "interrupted", "resumed"], help="internal")
    args = parser.parse_args()
    args.samples = args.samples or (512 if args.small else 1797)
    args.epochs = args.epochs or (2 if args.small else 4)
    if args.phase is not None:
        train(args)
        return 0
    if args.workdir is not None:
        return run_all(args)
    with tempfile.TemporaryDirectory() as tmp:
        args.workdir = tmp
        return run_all(args)


if __name__ == "__main__":
    sys.exit(main())

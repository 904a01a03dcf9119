"""Data-parallel training of the digits CNN under torchrun: each rank reads its own share.

Every rank opens the same digits cache (the first to take the cache's lock writes it, the others
load it), and DatasetRT takes the rank and world size from the initialised ``torch.distributed``:
each epoch's global order is split so that every rank reads as many samples as the others and
no sample goes to two ranks (except as padding when the epoch does not divide evenly). The model
is wrapped in ``DistributedDataParallel`` on the gloo backend (CPU), so all ranks end with the
same weights.

Each rank writes ``rank<R>.pt`` (its final weights) and ``rank<R>.json`` (the ``sample_id`` of
every sample it trained on, per epoch) to ``--workdir``; rank 0 checks that the weights agree and
that the shares are disjoint and cover each epoch, and exits 1 if not.

Two nodes of two processes each, on one machine (run both commands, in two shells):

    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=0 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=digits examples/torch_ddp.py --workdir=run
    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=1 --rdzv-backend=c10d \\
        --rdzv-endpoint=127.0.0.1:29400 --rdzv-id=digits examples/torch_ddp.py --workdir=run

Add ``--small`` for a 512-digit subset and 2 epochs. On a real cluster, ``--workdir`` is on
storage every node sees and the endpoint is the first node's address.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from digits_cache import DigitsSource, open_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch_resume import SmallCNN, deterministic_torch, to_example

import dataset_rt.torch
from dataset_rt import CachedSample, DatasetRuntime, ReaderConfig

BATCH_SIZE = 16


def to_example_with_id(sample: CachedSample) -> tuple[torch.Tensor, int, int]:
    image, label = to_example(sample)
    return image, label, int(sample.metadata["sample_id"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="512 digits, 2 epochs")
    parser.add_argument("--samples", type=int, help="digits to use (default 1797, all)")
    parser.add_argument("--epochs", type=int, help="epochs (default 4)")
    parser.add_argument("--num-workers", type=int, default=1, help="loader workers per rank (1)")
    parser.add_argument("--workdir", required=True, help="shared by all ranks: cache and results")
    args = parser.parse_args()
    samples = args.samples or (512 if args.small else 1797)
    epochs = args.epochs or (2 if args.small else 4)
    workdir = Path(args.workdir)

    deterministic_torch()  # every rank builds the same initial model; DDP broadcasts rank 0's
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(SmallCNN())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    seen: list[list[int]] = []
    with DatasetRuntime(num_workers=1) as runtime:
        # No rank or world size here: they come from torch.distributed.
        dataset = open_digits(
            runtime,
            workdir / "caches",
            DigitsSource("digits", range(samples)),
            ReaderConfig(seed=7, shuffle=True),
        )
        assert (dataset.rank, dataset.world_size) == (rank, world_size)
        with dataset_rt.torch.DataLoader(
            dataset,
            batch_size=BATCH_SIZE,
            num_workers=args.num_workers,
            transform=to_example_with_id,
            # The process group runs gloo's threads: forking then can copy a lock one of them
            # holds into a worker, so the workers are spawned, once, and kept for every epoch.
            multiprocessing_context="spawn",
            persistent_workers=True,
        ) as loader:
            for epoch in range(epochs):
                loader.set_epoch(epoch)
                ids: list[int] = []
                for images, labels, sample_ids in loader:
                    optimizer.zero_grad()
                    loss = nn.functional.cross_entropy(model(images), labels)
                    loss.backward()  # DDP averages the gradients over the ranks here
                    optimizer.step()
                    ids.extend(sample_ids.tolist())
                seen.append(ids)
                if rank == 0:
                    print(f"epoch {epoch}: loss {loss.item():.4f}", flush=True)

    weights = model.module.state_dict()
    torch.save(weights, workdir / f"rank{rank}.pt")
    (workdir / f"rank{rank}.json").write_text(
        json.dumps({"rank": rank, "world_size": world_size, "samples": samples, "epochs": seen})
    )
    # Rank 0 checks what every rank did.
    all_weights: list[dict[str, torch.Tensor] | None] = [None] * world_size
    all_seen: list[list[list[int]] | None] = [None] * world_size
    dist.all_gather_object(all_weights, weights)
    dist.all_gather_object(all_seen, seen)
    dist.destroy_process_group()
    if rank != 0:
        return 0
    return report(all_weights, all_seen, samples)


def report(
    all_weights: list[dict[str, torch.Tensor] | None],
    all_seen: list[list[list[int]] | None],
    samples: int,
) -> int:
    ok = True
    first = all_weights[0]
    assert first is not None
    for r, weights in enumerate(all_weights):
        assert weights is not None
        if any(not torch.equal(first[name], weights[name]) for name in first):
            print(f"FAILED: rank {r}'s weights differ from rank 0's")
            ok = False
    per_rank = [s for s in all_seen if s is not None]
    for epoch, shares in enumerate(zip(*per_rank, strict=True)):
        read = [i for share in shares for i in share]
        padding = len(read) - samples
        if set(read) != set(range(samples)) or not 0 <= padding < len(shares):
            print(f"FAILED: epoch {epoch}: the ranks' shares do not cover the epoch once")
            ok = False
        print(f"epoch {epoch}: shares of {[len(s) for s in shares]} samples, {padding} padding")
    if ok:
        print(f"OK: all {len(all_weights)} ranks ended with equal weights")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

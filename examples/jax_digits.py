"""A JAX training loop (CPU) fed by ``dataset_rt.DataLoader`` with a NumPy collate.

The digits that ship with scikit-learn are packed into two caches, ``digits_train`` (the first
80%) and ``digits_test`` (the rest). ``dataset_rt.DataLoader`` needs no torch: its worker
processes turn each payload into a NumPy array (``transform``) and stack a batch
(``collate_fn``); the arrays reach the training loop through shared memory without a copy and go
straight into a jitted JAX step of a small MLP trained with plain SGD.

The workers are started with ``multiprocessing_context="spawn"``: JAX runs threads of its own,
and forking a process that has them can deadlock the child. The transform and collate are module
level functions, so spawned workers can import them; JAX is imported only in the training
process.

    python examples/jax_digits.py             # 20 epochs over all digits
    python examples/jax_digits.py --small     # 5 epochs
    python examples/jax_digits.py --metrics m.json  # also write the losses and accuracy as JSON

It prints the mean loss of every epoch and the accuracy on the held-out digits (chance: 10%).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from digits_cache import IMAGE_SIZE, NUM_CLASSES, DigitsSource, load_digits, open_digits, pixels

from dataset_rt import CachedSample, DataLoader, DatasetRuntime, ReaderConfig

BATCH_SIZE = 64
HIDDEN = 64


def to_arrays(sample: CachedSample) -> tuple[np.ndarray, int]:
    """Runs in a worker: the payload view becomes a flat float32 image, the label an int."""
    return pixels(sample.data).reshape(-1), int(sample.metadata["label"])


def stack(batch: list[tuple[np.ndarray, int]]) -> tuple[np.ndarray, np.ndarray]:
    """Runs in a worker: the NumPy collate, one ``[batch, 64]`` array and one of labels."""
    images = np.stack([image for image, _ in batch])
    labels = np.array([label for _, label in batch], dtype=np.int32)
    return images, labels


def train(workdir: Path, epochs: int, num_workers: int) -> dict[str, Any]:
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import jax.numpy as jnp

    def init(key: jax.Array) -> dict[str, jax.Array]:
        k1, k2 = jax.random.split(key)
        inputs = IMAGE_SIZE * IMAGE_SIZE
        return {
            "w1": jax.random.normal(k1, (inputs, HIDDEN)) * jnp.sqrt(2.0 / inputs),
            "b1": jnp.zeros(HIDDEN),
            "w2": jax.random.normal(k2, (HIDDEN, NUM_CLASSES)) * jnp.sqrt(1.0 / HIDDEN),
            "b2": jnp.zeros(NUM_CLASSES),
        }

    def logits(params: dict[str, jax.Array], x: jax.Array) -> jax.Array:
        hidden = jax.nn.relu(x @ params["w1"] + params["b1"])
        return hidden @ params["w2"] + params["b2"]

    def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
        log_probs = jax.nn.log_softmax(logits(params, x))
        return -jnp.mean(jnp.take_along_axis(log_probs, y[:, None], axis=1))

    @jax.jit
    def step(
        params: dict[str, jax.Array], x: jax.Array, y: jax.Array
    ) -> tuple[dict[str, jax.Array], jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    _, labels = load_digits()
    split = len(labels) * 4 // 5
    with DatasetRuntime(num_workers=2) as runtime:
        train_set = open_digits(
            runtime,
            workdir,
            DigitsSource("digits_train", range(split)),
            ReaderConfig(seed=0, shuffle=True),
        )
        test_set = open_digits(
            runtime,
            workdir,
            DigitsSource("digits_test", range(split, len(labels))),
            ReaderConfig(shuffle=False),
        )
        params = init(jax.random.key(0))
        epoch_losses = []
        with DataLoader(
            train_set,
            BATCH_SIZE,
            num_workers=num_workers,
            transform=to_arrays,
            collate_fn=stack,
            multiprocessing_context="spawn",
        ) as loader:
            for epoch in range(epochs):
                losses = []
                for x, y in loader:
                    params, loss = step(params, x, y)
                    losses.append(float(loss))
                epoch_losses.append(sum(losses) / len(losses))
                print(f"epoch {epoch}: mean loss {epoch_losses[-1]:.4f}", flush=True)
        correct = 0
        with DataLoader(test_set, BATCH_SIZE, transform=to_arrays, collate_fn=stack) as loader:
            for x, y in loader:
                correct += int(jnp.sum(jnp.argmax(logits(params, x), axis=1) == y))
        accuracy = correct / len(test_set)
        print(f"held-out accuracy {accuracy:.3f} on {len(test_set)} digits (chance 0.100)")
    return {"epoch_losses": epoch_losses, "test_accuracy": accuracy}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="5 epochs")
    parser.add_argument("--epochs", type=int, help="epochs (default 20)")
    parser.add_argument("--num-workers", type=int, default=2, help="loader workers (2)")
    parser.add_argument("--workdir", help="the caches go here (default: a temp dir)")
    parser.add_argument("--metrics", help="write the losses and the accuracy to this JSON file")
    args = parser.parse_args()
    epochs = args.epochs or (5 if args.small else 20)
    if args.workdir is not None:
        metrics = train(Path(args.workdir), epochs, args.num_workers)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            metrics = train(Path(tmp), epochs, args.num_workers)
    if args.metrics is not None:
        Path(args.metrics).write_text(json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())

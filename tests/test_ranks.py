"""Per-rank readers: equal, disjoint and covering shares under pad and drop, resume under another
world size, where rank and world size come from, and a real torch.distributed gloo group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import dataset_rt
from dataset_rt import ConfigError, Dataset, DatasetRuntime, ReaderConfig, WriterConfig, _native
from dataset_rt.testing import make_source

QUIET = WriterConfig(show_progress=False)
REPO_ROOT = Path(dataset_rt.__file__).resolve().parent.parent


def positional_source(name: str, n: int):  # type: ignore[no-untyped-def]
    return make_source(name, [(f"{name}:{i}".encode(), {"sample_id": i}) for i in range(n)])


def ids(samples: Any) -> list[int]:
    return [sample.metadata["sample_id"] for sample in samples]


def take(iterator: Any, k: int) -> list[int]:
    return [next(iterator).metadata["sample_id"] for _ in range(k)]


def split_positions(epoch_len: int, start: int, world: int, rank: int, pad: bool) -> list[int]:
    """docs/determinism.md, "Rank split", from the page."""
    remainder = epoch_len - start
    length = -(-remainder // world) if pad else remainder // world
    positions = []
    for k in range(length):
        q = rank + k * world
        # Padding wraps around the epoch: slot start + q is position (start + q) mod L.
        positions.append(start + q if q < remainder else (start + q) % epoch_len)
    return positions


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ranks")


class Ranks:
    """``world`` readers of one cache on one runtime, one per rank."""

    def __init__(self, base: Path, n: int, world: int, workers: int = 2, **reader: Any) -> None:
        self.runtime = DatasetRuntime(num_workers=workers)
        source = positional_source(f"r{n}", n)
        self.datasets: list[Dataset] = [
            self.runtime.from_cache_sources(
                source,
                base,
                reader_config=ReaderConfig(rank=rank, world_size=world, **reader),
                writer_config=QUIET,
            ).dataset
            for rank in range(world)
        ]

    def __enter__(self) -> list[Dataset]:
        return self.datasets

    def __exit__(self, *exc: object) -> None:
        self.runtime.close()


def test_golden_rank_split_through_datasets(base_dir: Path) -> None:
    # docs/determinism.md's worked example: L = 10, W = 4, Pad and Drop.
    order = _native.epoch_order(42, 0, 10)
    with Ranks(base_dir, 10, 4, seed=42) as datasets:
        shares = [ids(d) for d in datasets]
    assert shares == [[order[p] for p in ps] for ps in ([0, 4, 8], [1, 5, 9], [2, 6, 0], [3, 7, 1])]
    with Ranks(base_dir, 10, 4, seed=42, drop_last=True) as datasets:
        shares = [ids(d) for d in datasets]
    assert shares == [[order[p] for p in ps] for ps in ([0, 4], [1, 5], [2, 6], [3, 7])]


def check_partition(shares: list[list[int]], everything: list[int], world: int, pad: bool) -> None:
    lengths = {len(share) for share in shares}
    assert len(lengths) == 1, f"unequal shares {lengths}"
    (length,) = lengths
    total = len(everything)
    union = Counter(i for share in shares for i in share)
    if pad:
        assert length == -(-total // world)
        assert set(union) == set(everything)  # covering
        padding = world * length - total
        assert 0 <= padding < world
        # Disjoint except padding: only `padding` extra copies in all.
        assert sum(union.values()) - len(everything) == padding
        assert sum(c - 1 for c in union.values()) == padding
    else:
        assert length == total // world
        assert all(c == 1 for c in union.values())  # disjoint
        assert len(everything) - len(union) == total % world


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=33),
    world=st.integers(min_value=1, max_value=5),
    drop_last=st.booleans(),
    seed=st.integers(min_value=0, max_value=2**64 - 1),
    shuffle=st.booleans(),
    epoch=st.integers(min_value=0, max_value=3),
)
def test_rank_shares_equal_disjoint_covering(
    base_dir: Path, n: int, world: int, drop_last: bool, seed: int, shuffle: bool, epoch: int
) -> None:
    order = _native.epoch_order(seed, epoch, n, shuffle=shuffle)
    with Ranks(base_dir, n, world, seed=seed, shuffle=shuffle, drop_last=drop_last) as datasets:
        for dataset in datasets:
            dataset.set_epoch(epoch)
        shares = [ids(d) for d in datasets]
        assert all(len(d) == len(share) for d, share in zip(datasets, shares, strict=True))
        assert all((d.rank, d.world_size) == (r, world) for r, d in enumerate(datasets))
    check_partition(shares, list(range(n)), world, pad=not drop_last)
    for rank, share in enumerate(shares):
        assert share == [order[p] for p in split_positions(n, 0, world, rank, not drop_last)]


@pytest.mark.parametrize("world", range(1, 6))
@pytest.mark.parametrize("drop_last", [False, True])
def test_every_world_size_and_policy(base_dir: Path, world: int, drop_last: bool) -> None:
    for n in (1, 2, 7, 10, 23):
        with Ranks(base_dir, n, world, seed=7, drop_last=drop_last) as datasets:
            shares = [ids(d) for d in datasets]
            lengths = [len(d) for d in datasets]
        assert lengths == [len(s) for s in shares]
        check_partition(shares, list(range(n)), world, pad=not drop_last)


def test_oversampled_epoch_split_by_positions(base_dir: Path) -> None:
    # samples_per_epoch > n: ranks split positions of the epoch, not sample ids.
    order = _native.epoch_order(3, 0, 6, 17)
    with Ranks(base_dir, 6, 3, seed=3, samples_per_epoch=17) as datasets:
        shares = [ids(d) for d in datasets]
        assert [len(d) for d in datasets] == [6, 6, 6]
    real = Counter()
    for rank, share in enumerate(shares):
        positions = split_positions(17, 0, 3, rank, True)
        assert share == [order[p] for p in positions]
        real.update(order[p] for k, p in enumerate(positions) if rank + 3 * k < 17)
    assert real == Counter(order)


def resume_other_world(
    base: Path, n: int, first_world: int, k: int, second_world: int, drop_last: bool, seed: int
) -> None:
    """Every rank of ``first_world`` reads k samples; the state goes to ``second_world`` ranks."""
    with Ranks(base, n, first_world, seed=seed, drop_last=drop_last) as datasets:
        iterators = [iter(d) for d in datasets]
        consumed = [take(it, k) for it in iterators]
        states = [json.loads(json.dumps(d.state_dict())) for d in datasets]
        rank_len = len(datasets[0])
    # All ranks agree on the global position; only the rank differs.
    if k == rank_len:  # this rank's whole share was received: the state is the next epoch
        assert {(s["epoch"], s["position"]) for s in states} == {(1, 0)}
    else:
        assert {(s["epoch"], s["position"]) for s in states} == {(0, min(k * first_world, n))}
    assert [s["rank"] for s in states] == list(range(first_world))
    assert all(s["world_size"] == first_world for s in states)
    strip = [{key: v for key, v in s.items() if key != "rank"} for s in states]
    assert all(s == strip[0] for s in strip)

    with Ranks(base, n, second_world, workers=3, seed=seed, drop_last=drop_last) as datasets:
        for d in datasets:
            d.load_state_dict(states[0])
        rest = [ids(d) for d in datasets]
    if k == rank_len:  # resumed at the start of epoch 1
        next_order = _native.epoch_order(seed, 1, n)
        assert rest == [
            [next_order[p] for p in split_positions(n, 0, second_world, r, not drop_last)]
            for r in range(second_world)
        ]
        return
    position = states[0]["position"]
    remainder = n - position
    lengths = {len(r) for r in rest}
    assert lengths == {
        -(-remainder // second_world) if not drop_last else remainder // second_world
    }

    order = _native.epoch_order(seed, 0, n)
    # What was consumed is exactly the order's prefix (no padding happened before position).
    consumed_real = Counter(i for share in consumed for i in share)
    assert consumed_real == Counter(order[:position])
    after = Counter(i for share in rest for i in share)
    union = consumed_real + after
    if drop_last:
        assert all(c == 1 for c in union.values())
        assert len(union) == position + (remainder // second_world) * second_world
    else:
        assert set(union) == set(range(n))
        padding = sum(union.values()) - n
        assert 0 <= padding < second_world
        # The only repeats are the padding slots, which wrap around to the epoch's start.
        length = -(-remainder // second_world)
        pads = [(position + q) % n for q in range(remainder, second_world * length)]
        assert union - Counter(order) == Counter(order[p] for p in pads)
    for rank, share in enumerate(rest):
        positions = split_positions(n, position, second_world, rank, not drop_last)
        assert share == [order[p] for p in positions]


def test_resume_world_size_2_into_3(base_dir: Path) -> None:
    for k in range(0, 6):
        resume_other_world(base_dir, 11, 2, k, 3, drop_last=False, seed=42)


def test_resume_world_size_2_into_3_drop(base_dir: Path) -> None:
    for k in range(0, 6):
        resume_other_world(base_dir, 11, 2, k, 3, drop_last=True, seed=42)


@settings(max_examples=25, deadline=None)
@given(
    data=st.data(),
    n=st.integers(min_value=1, max_value=30),
    first_world=st.integers(min_value=1, max_value=5),
    second_world=st.integers(min_value=1, max_value=5),
    drop_last=st.booleans(),
    seed=st.integers(min_value=0, max_value=2**64 - 1),
)
def test_resume_under_another_world_size_property(
    base_dir: Path,
    data: st.DataObject,
    n: int,
    first_world: int,
    second_world: int,
    drop_last: bool,
    seed: int,
) -> None:
    rank_len = n // first_world if drop_last else -(-n // first_world)
    k = data.draw(st.integers(min_value=0, max_value=rank_len), label="k")
    resume_other_world(base_dir, n, first_world, k, second_world, drop_last, seed)


def test_resume_chain_across_three_world_sizes(base_dir: Path) -> None:
    # 4 ranks read 2 each, 3 ranks read 3 each, then 1 rank reads the rest: one epoch, once.
    n, seed = 29, 5
    order = _native.epoch_order(seed, 0, n)
    received: list[int] = []
    state = None
    for world, k in ((4, 2), (3, 3), (1, None)):
        with Ranks(base_dir, n, world, seed=seed) as datasets:
            for d in datasets:
                if state is not None:
                    d.load_state_dict(state)
            iterators = [iter(d) for d in datasets]
            shares = [take(it, k) if k is not None else ids(it) for it in iterators]
            states = [json.loads(json.dumps(d.state_dict())) for d in datasets]
        assert len({s["position"] for s in states}) == 1
        state = states[0]
        received += [i for round_ in zip(*shares, strict=True) for i in round_]
    assert received == order
    assert state is not None
    assert (state["epoch"], state["position"]) == (1, 0)


def resume_same_world(
    base: Path,
    n: int,
    world: int,
    cuts: list[float],
    drop_last: bool,
    seed: int,
    samples_per_epoch: int | None = None,
) -> None:
    """Every rank reads its uninterrupted share; then the same pass is checkpointed after a
    fraction `cut` of what is left, and resumed from that state on the same world size, once per
    cut. Each rank's pieces, concatenated, must be its uninterrupted share, padding included."""
    reader: dict[str, Any] = {
        "seed": seed,
        "drop_last": drop_last,
        "samples_per_epoch": samples_per_epoch,
    }
    with Ranks(base, n, world, **reader) as datasets:
        full = [ids(d) for d in datasets]
    got: list[list[int]] = [[] for _ in range(world)]
    state: dict[str, Any] | None = None
    for cut in [*cuts, None]:
        with Ranks(base, n, world, workers=1 + len(got[0]) % 3, **reader) as datasets:
            iterators = []
            for d in datasets:
                if state is not None:
                    d.load_state_dict(state)
                iterators.append(iter(d))
            left = len(iterators[0])
            k = left if cut is None else int(left * cut)
            for rank, it in enumerate(iterators):
                got[rank] += take(it, k)
            states = [json.loads(json.dumps(d.state_dict())) for d in datasets]
        assert len({(s["epoch"], s["position"]) for s in states}) == 1
        state = states[0]
        if state["epoch"] != 0:  # every rank received its whole share
            break
    assert got == full
    assert state is not None
    assert (state["epoch"], state["position"]) == (1, 0)


def test_padded_resume_on_the_same_world_size_keeps_the_pads(base_dir: Path) -> None:
    # 11 samples on 2 ranks: rank 1's last sample is a pad (the epoch's first position). A
    # checkpoint after 2 samples per rank, resumed on 2 ranks, must end rank 1 with that pad.
    order = _native.epoch_order(42, 0, 11)
    with Ranks(base_dir, 11, 2, seed=42) as datasets:
        assert ids(datasets[1])[-1] == order[0]
    resume_same_world(base_dir, 11, 2, [0.4], drop_last=False, seed=42)


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=30),
    world=st.integers(min_value=1, max_value=5),
    cuts=st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=1, max_size=3),
    drop_last=st.booleans(),
    seed=st.integers(min_value=0, max_value=2**64 - 1),
    samples_per_epoch=st.none() | st.integers(min_value=0, max_value=45),
)
def test_resume_on_the_same_world_size_property(
    base_dir: Path,
    n: int,
    world: int,
    cuts: list[float],
    drop_last: bool,
    seed: int,
    samples_per_epoch: int | None,
) -> None:
    resume_same_world(base_dir, n, world, cuts, drop_last, seed, samples_per_epoch)


# ---- where rank and world size come from


@pytest.fixture
def no_rank_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return monkeypatch


def load(base: Path, n: int, reader: ReaderConfig) -> tuple[DatasetRuntime, Dataset]:
    runtime = DatasetRuntime(num_workers=1)
    result = runtime.from_cache_sources(
        positional_source(f"r{n}", n), base, reader_config=reader, writer_config=QUIET
    )
    return runtime, result.dataset


def test_default_is_rank_0_of_1(base_dir: Path, no_rank_env: pytest.MonkeyPatch) -> None:
    runtime, dataset = load(base_dir, 10, ReaderConfig(seed=1))
    with runtime:
        assert (dataset.rank, dataset.world_size) == (0, 1)
        assert len(dataset) == 10
        assert ids(dataset) == _native.epoch_order(1, 0, 10)


def test_rank_from_environment(base_dir: Path, no_rank_env: pytest.MonkeyPatch) -> None:
    no_rank_env.setenv("RANK", "1")
    no_rank_env.setenv("WORLD_SIZE", "3")
    order = _native.epoch_order(1, 0, 10)
    runtime, dataset = load(base_dir, 10, ReaderConfig(seed=1))
    with runtime:
        assert (dataset.rank, dataset.world_size) == (1, 3)
        assert len(dataset) == 4
        assert ids(dataset) == [order[p] for p in (1, 4, 7, 0)]
        state = dataset.state_dict()
        assert (state["rank"], state["world_size"]) == (1, 3)


def test_explicit_config_overrides_environment(
    base_dir: Path, no_rank_env: pytest.MonkeyPatch
) -> None:
    no_rank_env.setenv("RANK", "1")
    no_rank_env.setenv("WORLD_SIZE", "3")
    order = _native.epoch_order(1, 0, 10)
    runtime, dataset = load(base_dir, 10, ReaderConfig(seed=1, rank=0, world_size=2))
    with runtime:
        assert (dataset.rank, dataset.world_size) == (0, 2)
        assert ids(dataset) == [order[p] for p in (0, 2, 4, 6, 8)]
    runtime, dataset = load(base_dir, 10, ReaderConfig(seed=1, rank=0, world_size=1))
    with runtime:
        assert (dataset.rank, dataset.world_size) == (0, 1)
        assert len(dataset) == 10


@pytest.mark.parametrize(
    ("rank", "world"), [("x", "2"), ("1", "two"), ("3", "3"), ("0", "0"), ("-1", "2")]
)
def test_bad_environment_refused(
    base_dir: Path, no_rank_env: pytest.MonkeyPatch, rank: str, world: str
) -> None:
    no_rank_env.setenv("RANK", rank)
    no_rank_env.setenv("WORLD_SIZE", world)
    runtime = DatasetRuntime(num_workers=1)
    with runtime, pytest.raises(ConfigError):
        runtime.from_cache_sources(
            positional_source("r10", 10),
            base_dir,
            reader_config=ReaderConfig(),
            writer_config=QUIET,
        )


@pytest.mark.parametrize(("rank", "world"), [(3, 3), (0, 0), (-1, 2)])
def test_bad_config_refused(rank: int, world: int) -> None:
    with pytest.raises(ConfigError):
        ReaderConfig(rank=rank, world_size=world)


def test_rank_without_world_size_refused() -> None:
    with pytest.raises(ConfigError, match="together"):
        ReaderConfig(rank=1)
    with pytest.raises(ConfigError, match="together"):
        ReaderConfig(world_size=2)


# ---- a real torch.distributed group

RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path

    import torch.distributed as dist

    from dataset_rt import DatasetRuntime, ReaderConfig, WriterConfig

    rank, world = int(sys.argv[1]), int(sys.argv[2])
    init, base, out = sys.argv[3:6]
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        class Source:
            name = "group"  # already written by the parent: loaded, never iterated here

            def __iter__(self):
                raise AssertionError("the cache should have been loaded")

        with DatasetRuntime(num_workers=2) as runtime:
            result = runtime.from_cache_sources(
                Source(), Path(base), reader_config=ReaderConfig(seed=42),
                writer_config=WriterConfig(show_progress=False),
            )
            dataset = result.dataset
            share = [s.metadata["sample_id"] for s in dataset]
            report = {
                "rank": dataset.rank,
                "world_size": dataset.world_size,
                "len": len(dataset),
                "share": share,
                "state": dataset.state_dict(),
            }
            # An explicit config still wins over the initialised group.
            alone = runtime.from_cache_sources(
                Source(), Path(base), reader_config=ReaderConfig(seed=42, rank=0, world_size=1),
                writer_config=WriterConfig(show_progress=False),
            ).dataset
            report["explicit"] = [alone.rank, alone.world_size, len(alone)]
        # Everyone finished reading before anyone leaves the group.
        dist.barrier()
        Path(out).write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()
    """
)


@pytest.mark.torch
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_torch_distributed_gloo_group(tmp_path: Path) -> None:
    pytest.importorskip("torch.distributed")
    world, n = 3, 10
    with DatasetRuntime(num_workers=1) as runtime:
        runtime.from_cache_sources(positional_source("group", n), tmp_path, writer_config=QUIET)
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    init = f"file://{tmp_path / 'rendezvous'}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
        # Deliberately wrong: an initialised torch.distributed comes before the environment.
        "RANK": "0",
        "WORLD_SIZE": "1",
        "OMP_NUM_THREADS": "1",
    }
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    outputs = [tmp_path / f"rank{r}.json" for r in range(world)]
    logs = [tmp_path / f"rank{r}.log" for r in range(world)]
    processes = []
    try:
        for r in range(world):
            with logs[r].open("wb") as log:  # a file, so a chatty rank never blocks on a pipe
                processes.append(
                    subprocess.Popen(
                        [
                            sys.executable,
                            str(script),
                            str(r),
                            str(world),
                            init,
                            str(tmp_path),
                            str(outputs[r]),
                        ],
                        env=env,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
        # One deadline for the whole group; a rank that fails ends the wait for the others.
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            codes = [p.poll() for p in processes]
            if all(c is not None for c in codes) or any(c not in (None, 0) for c in codes):
                break
            time.sleep(0.05)
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
            process.wait()
    for r, process in enumerate(processes):
        assert process.returncode == 0, f"rank {r} exited {process.returncode}:\n" + logs[
            r
        ].read_text(errors="replace")
    reports = [json.loads(out.read_text()) for out in outputs]
    assert [(rep["rank"], rep["world_size"]) for rep in reports] == [(r, world) for r in range(3)]
    shares = [rep["share"] for rep in reports]
    assert [rep["len"] for rep in reports] == [4, 4, 4]
    check_partition(shares, list(range(n)), world, pad=True)
    order = _native.epoch_order(42, 0, n)
    for rank, share in enumerate(shares):
        assert share == [order[p] for p in split_positions(n, 0, world, rank, True)]
    assert all((rep["state"]["epoch"], rep["state"]["position"]) == (1, 0) for rep in reports)
    assert all(rep["explicit"] == [0, 1, n] for rep in reports)

"""A training process that forks while a loader pass is open: the child can use nothing of the
parent's loaders (``RuntimeStateError``, and ``close()`` does nothing), and a child that exits
normally leaves the parent's workers running, so the parent's pass delivers every batch."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable

import pytest
from loader_helpers import load, no_leaks  # noqa: F401

from dataset_rt import DataLoader, RuntimeStateError

N = 48
BATCH = 4

# (num_workers, persistent_workers, multiprocessing_context)
SETUPS = [
    pytest.param(0, False, None, id="inline"),
    pytest.param(2, False, "fork", id="workers-fork"),
    pytest.param(2, False, "spawn", id="workers-spawn"),
    pytest.param(2, True, "fork", id="persistent-fork"),
    pytest.param(2, True, "spawn", id="persistent-spawn"),
]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return load(tmp_path_factory.mktemp("fork"), N)


def indices(batch) -> list[int]:
    return [sample.metadata["i"] for sample in batch]


def expected(dataset) -> list[list[int]]:
    with DataLoader(dataset, BATCH) as loader:
        return [indices(b) for b in loader]


def in_child(work: Callable[[], object]) -> object:
    """Runs ``work`` in an ``os.fork()``ed child and returns what it returned (JSON), or the
    exception it raised as ``"raised <type>: <message>"``. The child always ends with
    ``os._exit`` (never returns into pytest) and dies by SIGALRM if it hangs."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(read_end)
            signal.alarm(60)
            try:
                outcome: object = work()
            except BaseException as error:
                outcome = f"raised {type(error).__name__}: {error}"
            os.write(write_end, json.dumps(outcome, default=repr).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    chunks = []
    while chunk := os.read(read_end, 65536):
        chunks.append(chunk)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"the child ended with status {status}"
    return json.loads(b"".join(chunks)) if chunks else None


def make_loader(dataset, num_workers, persistent, context) -> DataLoader:
    return DataLoader(
        dataset,
        BATCH,
        num_workers=num_workers,
        persistent_workers=persistent,
        multiprocessing_context=context,
        timeout=60,
    )


@pytest.mark.parametrize(("num_workers", "persistent", "context"), SETUPS)
def test_a_forked_child_can_use_nothing_of_the_parents_loader(
    dataset, num_workers, persistent, context
):
    want = expected(dataset)
    with make_loader(dataset, num_workers, persistent, context) as loader:
        it = iter(loader)
        got = [indices(next(it))]
        state = loader.state_dict()

        def child() -> dict[str, str]:
            calls: dict[str, Callable[[], object]] = {
                "next(iterator)": lambda: next(it),
                "iter(iterator)": lambda: iter(it),
                "len(iterator)": lambda: len(it),
                "iter(loader)": lambda: iter(loader),
                "len(loader)": lambda: len(loader),
                "state_dict": loader.state_dict,
                "load_state_dict": lambda: loader.load_state_dict(state),
                "set_epoch": lambda: loader.set_epoch(3),
                "with loader": lambda: loader.__enter__(),
            }
            seen = {}
            for name, call in calls.items():
                try:
                    call()
                    seen[name] = "returned"
                except BaseException as error:
                    seen[name] = f"{type(error).__name__}: {error}"
            # Closing does nothing, and raises nothing, in the child.
            for name, call in {
                "iterator.close": it.close,
                "loader.close": loader.close,
                "iterator.__del__": it.__del__,
            }.items():
                try:
                    call()
                    seen[name] = "returned"
                except BaseException as error:
                    seen[name] = f"{type(error).__name__}: {error}"
            return seen

        seen = in_child(child)
        assert isinstance(seen, dict), seen
        for name in (
            "next(iterator)",
            "iter(iterator)",
            "len(iterator)",
            "iter(loader)",
            "len(loader)",
            "state_dict",
            "load_state_dict",
            "set_epoch",
            "with loader",
        ):
            assert seen[name].startswith(f"{RuntimeStateError.__name__}: "), (name, seen[name])
            assert f"created in process {os.getpid()}" in seen[name], seen[name]
            assert "forked process" in seen[name], seen[name]
        for name in ("iterator.close", "loader.close", "iterator.__del__"):
            assert seen[name] == "returned", (name, seen[name])
        # The parent's pass is untouched: every batch, in order, and its state goes on.
        got += [indices(b) for b in it]
        assert got == want
        assert loader.state_dict() != state
        if persistent:
            assert [indices(b) for b in loader] == expected_epoch(dataset, 1)


def expected_epoch(dataset, epoch: int) -> list[list[int]]:
    with DataLoader(dataset, BATCH) as loader:
        loader.set_epoch(epoch)
        return [indices(b) for b in loader]


@pytest.mark.parametrize(("num_workers", "persistent", "context"), SETUPS)
def test_a_forked_child_that_exits_normally_leaves_the_parents_workers_running(
    dataset, num_workers, persistent, context
):
    want = expected(dataset)
    with make_loader(dataset, num_workers, persistent, context) as loader:
        it = iter(loader)
        got = [indices(next(it))]
        workers = it.pids["workers"]

        def child() -> str:
            # What the end of a script runs: multiprocessing's exit hook and the loader's.
            atexit._run_exitfuncs()
            return "exited"

        assert in_child(child) == "exited"
        for pid in workers:
            os.kill(pid, 0)  # still running
        got += [indices(b) for b in it]
        assert got == want
        if persistent:
            assert it.pids["workers"] == workers
            assert [indices(b) for b in loader] == expected_epoch(dataset, 1)


SCRIPT = textwrap.dedent(
    """
    import os, sys
    from dataset_rt import DataLoader, DatasetRuntime, WriterConfig
    from dataset_rt.testing import make_source

    runtime = DatasetRuntime(num_workers=1)
    source = make_source("c", [(bytes([i]) * 32, {"i": i}) for i in range(40)])
    result = runtime.from_cache_sources(
        source, sys.argv[1], writer_config=WriterConfig(show_progress=False)
    )
    for workers, persistent, context in [(0, False, None), (2, False, "fork"), (2, True, "spawn")]:
        loader = DataLoader(
            result.dataset, 4, num_workers=workers, persistent_workers=persistent,
            multiprocessing_context=context, timeout=60,
        )
        it = iter(loader)
        first = next(it)
        pid = os.fork()
        if pid == 0:
            sys.exit(0)  # a real interpreter exit: exit hooks, then the objects' finalization
        os.waitpid(pid, 0)
        print(workers, persistent, 1 + sum(1 for _ in it), flush=True)
        loader.close()
    """
)


def test_a_forked_child_that_calls_sys_exit_leaves_the_parents_loaders_alone(tmp_path):
    """The whole of a normal exit in the child (``sys.exit``: exit hooks, then the parent's loader
    and iterator finalized there) stops nothing of the parent's and prints nothing."""
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stderr == ""
    assert run.stdout.splitlines() == ["0 False 10", "2 False 10", "2 True 10"]


def test_a_forked_child_can_run_its_own_loader(dataset, tmp_path):
    """What the child should do instead: its own runtime, dataset and loader, whose workers
    are its own (the parent's pass goes on meanwhile)."""
    with make_loader(dataset, 2, False, "fork") as loader:
        it = iter(loader)
        first = indices(next(it))

        def child() -> list[list[int]]:
            import loader_helpers

            loader_helpers._runtime.clear()  # the parent's runtime has no threads here
            own = load(tmp_path, N)
            with DataLoader(own, BATCH, num_workers=2, timeout=60) as mine:
                return [indices(b) for b in mine]

        theirs = in_child(child)
        want = expected(dataset)
        assert theirs == want
        assert [first, *(indices(b) for b in it)] == want

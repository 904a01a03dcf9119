"""How a training script that holds an open loader pass ends: at its last line, by sys.exit()
inside the loop, or by SIGTERM, with and without a SIGTERM handler of its own (as Lightning,
Accelerate and cluster launchers install). Each script runs in its own process group under a
hard timeout, so a hang fails the test instead of blocking it; each must exit promptly and leave
no process and nothing in /dev/shm."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator

import pytest
from loader_helpers import gone, load, no_leaks, own_segments, wait_until  # noqa: F401

N = 400
# From the script's last line until the loader's exit hook and multiprocessing's are done: the
# part of the exit that is the loader's (typically well under 0.2 s).
CLOSE_BOUND_S = 1.0
# Until the process is gone: the interpreter's own teardown comes on top (about 1 s of it is
# torch's on a busy machine). A hang or a multi-second exit fails. `-s` prints the figures.
EXIT_BOUND_S = 3.0
# Whatever happens, a script is killed (with its process group) after this long.
HARD_TIMEOUT_S = 60.0

SCRIPT = textwrap.dedent(
    """
    import atexit, time
    # Registered before anything imports multiprocessing or dataset_rt: runs after their hooks.
    atexit.register(lambda: print("CLOSED", time.monotonic(), flush=True))
    import json, os, pathlib, signal, sys, time
    sys.path.insert(0, {tests!r})
    from loader_helpers import load
    dataset = load(pathlib.Path({base!r}), {n})
    stop = []
    if {handler}:
        # Installed before the loader forks its workers: they inherit it.
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    if {torch}:
        from dataset_rt.torch import DataLoader
        loader = DataLoader(dataset, batch_size=2, num_workers={workers}, collate_fn=len)
        shm_loader = loader._shm
    else:
        from dataset_rt import DataLoader
        loader = shm_loader = DataLoader(dataset, batch_size=2, num_workers={workers})
    seen = 0
    for epoch in range(100):
        for batch in loader:
            seen += 1
            if seen == 1:
                it = shm_loader._iterator
                print(json.dumps({{**it.pids, "segments": it.segment_names}}), flush=True)
            {body}
        else:
            continue
        break
    print("END", time.monotonic(), flush=True)
    """
)

# The loop's body (indented 8 spaces in SCRIPT).
BODIES = {
    # Breaks out of the epoch on its own after a few batches.
    "break": "if seen == 3:\n    break",
    # Runs until the test's SIGTERM: a handler's flag breaks out, no handler ends the process.
    "sigterm": "time.sleep(0.005)\nif stop:\n    break",
    "sys_exit": "if seen == 3:\n    print('END', time.monotonic(), flush=True)\n    sys.exit(3)",
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    path = tmp_path_factory.mktemp("exit-cache")
    load(path, N)
    return path


class Script:
    """A training script in its own process group, read line by line with a deadline."""

    def __init__(self, source: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", source],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.deadline = time.monotonic() + HARD_TIMEOUT_S
        self._buffer = b""

    def line(self) -> str:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = self.deadline - time.monotonic()
            if left <= 0:
                pytest.fail(f"no line from the script within {HARD_TIMEOUT_S} s: it hangs")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    pytest.fail(f"the script ended early: {self.stderr()}")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def wait(self) -> int:
        """The exit code; fails (the finally of `running` kills the group) on a hang."""
        try:
            return self.proc.wait(max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the script did not exit within {HARD_TIMEOUT_S} s: it hangs")

    def stderr(self) -> str:
        assert self.proc.stderr is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(max(0.0, self.deadline - time.monotonic()))
        if self.proc.poll() is None:
            return "(still running)"
        return self.proc.stderr.read().decode(errors="replace")


@contextlib.contextmanager
def running(source: str) -> Iterator[Script]:
    script = Script(source)
    try:
        yield script
    finally:
        # The script's group holds its producer and workers too: nothing outlives a failure.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(script.proc.pid, signal.SIGKILL)
        script.proc.wait()
        for stream in (script.proc.stdout, script.proc.stderr):
            if stream is not None:
                stream.close()


def source(base, *, torch: bool, workers: int, handler: bool, body: str) -> str:
    return SCRIPT.format(
        tests=os.path.dirname(__file__),
        base=str(base),
        n=N,
        torch=torch,
        workers=workers,
        handler=handler,
        body=BODIES[body].replace("\n", "\n" + " " * 8),
    )


def check_nothing_left(trainer: int, children: list[int], since: float) -> None:
    """Every child of the script is gone and nothing of it is in /dev/shm within the bound."""
    assert wait_until(lambda: all(gone(p) for p in children), EXIT_BOUND_S), (
        f"children {[p for p in children if not gone(p)]} outlived the script by "
        f"{time.monotonic() - since:.2f} s"
    )
    assert wait_until(lambda: own_segments(trainer) == [], EXIT_BOUND_S), own_segments(trainer)


def loader_kinds() -> list:
    return [
        pytest.param(False, id="dataset_rt"),
        pytest.param(True, id="torch", marks=pytest.mark.torch),
    ]


def start(base, use_torch: bool, **kwargs) -> str:
    if use_torch:
        pytest.importorskip("torch")
    return source(base, torch=use_torch, **kwargs)


@pytest.mark.parametrize("use_torch", loader_kinds())
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("handler", [True, False], ids=["handler", "no_handler"])
@pytest.mark.parametrize("body,code", [("break", 0), ("sys_exit", 3)], ids=["break", "sys_exit"])
def test_a_script_that_leaves_its_epoch_exits_promptly(
    base, use_torch, workers, handler, body, code
):
    with running(start(base, use_torch, workers=workers, handler=handler, body=body)) as script:
        pids = json.loads(script.line())
        children = [pids["producer"], *pids["workers"]]
        assert len(pids["workers"]) == workers and pids["producer"] is not None
        tag, ended = script.line().split()
        assert tag == "END"
        tag, closed = script.line().split()
        assert tag == "CLOSED"
        assert script.wait() == code, script.stderr()
        took = time.monotonic() - float(ended)
        closing = float(closed) - float(ended)
        print(f"exit hooks done {closing:.3f} s, process gone {took:.3f} s after the last line")
        assert closing < CLOSE_BOUND_S, f"the exit hooks took {closing:.2f} s"
        assert took < EXIT_BOUND_S, f"the script took {took:.2f} s to exit after its last line"
        # Closed before the interpreter went: the children were reaped, not orphaned.
        assert [p for p in children if not gone(p)] == []
        check_nothing_left(script.proc.pid, children, float(ended))
        stderr = script.stderr()
        assert "Traceback" not in stderr and "producer" not in stderr, stderr


@pytest.mark.parametrize("use_torch", loader_kinds())
@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("handler", [True, False], ids=["handler", "no_handler"])
def test_sigterm_mid_epoch_ends_the_script_and_its_children(base, use_torch, workers, handler):
    trainer = start(base, use_torch, workers=workers, handler=handler, body="sigterm")
    with running(trainer) as script:
        pids = json.loads(script.line())
        children = [pids["producer"], *pids["workers"]]
        assert not any(gone(p) for p in children)
        sent = time.monotonic()
        os.kill(script.proc.pid, signal.SIGTERM)
        if handler:
            # The handler's flag breaks out of the epoch and the script ends normally.
            assert script.line().split()[0] == "END"
            assert script.line().split()[0] == "CLOSED"
            assert script.wait() == 0, script.stderr()
        else:
            assert script.wait() == -signal.SIGTERM, script.stderr()
        took = time.monotonic() - sent
        assert took < EXIT_BOUND_S + 1.0, f"the script took {took:.2f} s to end after SIGTERM"
        check_nothing_left(script.proc.pid, children, sent)
        print(f"process gone {took:.3f} s, children {time.monotonic() - sent:.3f} s after SIGTERM")
        if handler:
            stderr = script.stderr()
            assert "Traceback" not in stderr and "producer" not in stderr, stderr


def signal_bits(pid: int) -> dict[str, int]:
    """The SigBlk, SigIgn and SigCgt masks of /proc/PID/status (bit n-1 is signal n)."""
    with open(f"/proc/{pid}/status") as f:
        fields = dict(line.split(":", 1) for line in f if line.startswith("Sig"))
    return {k: int(fields[k].strip(), 16) for k in ("SigBlk", "SigIgn", "SigCgt")}


def bit(sig: int) -> int:
    return 1 << (sig - 1)


@contextlib.contextmanager
def parent_sigterm(setting: str) -> Iterator[None]:
    """This process's SIGTERM as a training script may set it before the loader starts."""
    previous = signal.getsignal(signal.SIGTERM)
    if setting == "handler":
        signal.signal(signal.SIGTERM, lambda *_: None)
    elif setting == "ignored":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        signal.signal(signal.SIGTERM, previous)


def busy(sample):
    """Keeps each worker in its transform most of the time, holding the batch it took: a
    worker killed between two batches holds none, and the other would deliver them all."""
    time.sleep(0.002)
    return sample.metadata["i"]


@pytest.mark.parametrize("setting", ["handler", "ignored", "blocked"])
def test_children_do_not_inherit_the_training_scripts_sigterm_setting(base, setting):
    from dataset_rt import DataLoader
    from dataset_rt._native import LoaderError

    dataset = load(base, N)
    loader = DataLoader(dataset, batch_size=2, num_workers=2, transform=busy)
    with parent_sigterm(setting), loader:
        it = iter(loader)
        next(it)
        children = [it.pids["producer"], *it.pids["workers"]]
        for pid in children:
            bits = signal_bits(pid)
            assert not bits["SigCgt"] & bit(signal.SIGTERM), (pid, bits)
            assert not bits["SigIgn"] & bit(signal.SIGTERM), (pid, bits)
            assert not bits["SigBlk"] & bit(signal.SIGTERM), (pid, bits)
            # Ctrl-C is the training process's to handle.
            assert bits["SigIgn"] & bit(signal.SIGINT), (pid, bits)
        # A SIGTERM sent to a child itself ends it, and the loop says so.
        os.kill(it.pids["workers"][0], signal.SIGTERM)
        with pytest.raises(LoaderError, match=f"killed by signal {int(signal.SIGTERM)}"):
            for _ in it:
                pass
        assert wait_until(lambda: all(gone(p) for p in children), EXIT_BOUND_S)

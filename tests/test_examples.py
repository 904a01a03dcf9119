"""The scripts in examples/ run at small size and do what their docstrings claim.

Each runs in a subprocess of its own (a new process group, killed whole if it overruns its
timeout), writes its results to a temporary directory, and the test checks them itself.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("sklearn", reason="the examples need scikit-learn (the `examples` extra)")

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _env() -> dict[str, str]:
    # The examples import `dataset_rt` as the tests do (an editable install or PYTHONPATH).
    root = str(EXAMPLES.parent)
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}"}


def _start(command: list[str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=_env(),
            start_new_session=True,
        )


def _wait_all(processes: list[subprocess.Popen[bytes]], timeout: float) -> list[int]:
    """Their exit codes; on a timeout or an error every process group is killed."""
    try:
        return [p.wait(timeout=timeout) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()


def _run_example(script: str, args: list[str], tmp_path: Path, timeout: float) -> str:
    log = tmp_path / f"{script}.log"
    process = _start([sys.executable, str(EXAMPLES / script), *args], log)
    (code,) = _wait_all([process], timeout)
    output = log.read_text()
    assert code == 0, f"{script} exited {code}:\n{output}"
    return output


@pytest.mark.slow
@pytest.mark.torch
def test_torch_resume_ends_with_the_uninterrupted_weights(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    _run_example("torch_resume.py", ["--small", f"--workdir={tmp_path}"], tmp_path, 150)

    full = torch.load(tmp_path / "full.pt")
    resumed = torch.load(tmp_path / "resumed.pt")
    assert full.keys() == resumed.keys()
    for name in full:
        assert torch.equal(full[name], resumed[name]), name
    checkpoint = torch.load(tmp_path / "checkpoint.pt")
    state = checkpoint["loader"]
    # Interrupted in the middle of an epoch, and trained on afterwards.
    assert 0 < state["position"] < state["epoch_len"]
    assert any(not torch.equal(checkpoint["model"][n], full[n]) for n in full)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.slow
@pytest.mark.torch
def test_torch_ddp_two_nodes_read_disjoint_shares_and_agree(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    port = _free_port()
    nodes = [
        _start(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=2",
                f"--node-rank={node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint=127.0.0.1:{port}",
                "--rdzv-id=test-examples",
                str(EXAMPLES / "torch_ddp.py"),
                "--small",
                f"--workdir={tmp_path}",
            ],
            tmp_path / f"node{node}.log",
        )
        for node in (0, 1)
    ]
    codes = _wait_all(nodes, 150)
    logs = "\n".join((tmp_path / f"node{n}.log").read_text() for n in (0, 1))
    assert codes == [0, 0], logs

    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert {(r["rank"], r["world_size"]) for r in reports} == {(r, 4) for r in range(4)}
    samples = reports[0]["samples"]
    assert samples % 4 == 0  # no padding: the shares are strictly disjoint
    epochs = len(reports[0]["epochs"])
    assert epochs >= 2
    for epoch in range(epochs):
        shares = [r["epochs"][epoch] for r in reports]
        assert [len(s) for s in shares] == [samples // 4] * 4
        read = [i for share in shares for i in share]
        assert sorted(read) == list(range(samples)), f"epoch {epoch}"
    assert reports[0]["epochs"][0] != reports[0]["epochs"][1]  # each epoch reshuffled

    weights = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for r in range(1, 4):
        assert weights[r].keys() == weights[0].keys()
        for name in weights[0]:
            assert torch.equal(weights[r][name], weights[0][name]), (r, name)


@pytest.mark.slow
def test_jax_loop_learns(tmp_path: Path) -> None:
    pytest.importorskip("jax", reason="the JAX example needs jax (the `examples` extra)")
    metrics_path = tmp_path / "metrics.json"
    _run_example(
        "jax_digits.py",
        ["--small", f"--workdir={tmp_path}", f"--metrics={metrics_path}"],
        tmp_path,
        150,
    )
    metrics = json.loads(metrics_path.read_text())
    losses = metrics["epoch_losses"]
    assert len(losses) >= 3
    assert losses[-1] < 0.6 * losses[0], losses
    assert metrics["test_accuracy"] > 0.5  # chance is 0.1


def test_rebalanced_class_counts_match_the_weights(tmp_path: Path) -> None:
    report_path = tmp_path / "report.json"
    output = _run_example(
        "rebalance_classes.py",
        ["--small", f"--workdir={tmp_path}", f"--report={report_path}"],
        tmp_path,
        120,
    )
    report = json.loads(report_path.read_text())
    stored = {int(k): v for k, v in report["stored"].items()}
    epoch_len = report["epoch_len"]
    assert epoch_len == sum(stored.values())
    assert len(stored) == 10 and max(stored.values()) >= 5 * min(stored.values())
    for epoch in report["before"]:
        assert {int(k): v for k, v in epoch.items()} == stored  # uniform: each sample once
    # Every class weighs the same in all: each epoch delivers L / 10 of each, within one.
    assert len(report["after"]) >= 2
    for epoch in report["after"]:
        counts = {int(k): v for k, v in epoch.items()}
        assert sum(counts.values()) == epoch_len
        for label in range(10):
            assert abs(counts.get(label, 0) - epoch_len / 10) < 1, (label, counts, output)

"""Loader soak: SIGKILL a training process at random points, resume it from its last checkpoint,
and check that nothing is lost, repeated or left behind.

Each cycle starts a training run from scratch (2 loader workers, a checkpoint of
``DataLoader.state_dict()`` written atomically every few batches), SIGKILLs it at a random point
(a random batch, or during start-up), and resumes it from its last checkpoint until it is done.
Then it checks that:

- the concatenated sample ids the training loop received (per rank) equal an uninterrupted
  run's, every epoch of it;
- no process of the killed run is left (producer, workers, ranks), and nothing of it is left in
  ``/dev/shm``.

Part of the cycles run under ``torchrun --nproc_per_node 2`` (world size 2, gloo on CPU; the
dataset takes its rank from ``torch.distributed``): there one rank is killed and torchrun tears
the other down, as in a real job. Usage::

    python soak/loader_kill.py [--cycles 100] [--seed 0] [--torchrun-every 4]

It prints a summary and exits non-zero on the first mismatch, leftover or orphan.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

SAMPLES = 90
BATCH_SIZE = 4
EPOCHS = 2
CHECKPOINT_EVERY = 3  # batches
SHM = Path("/dev/shm")

# The training process. argv: BASE CHECKPOINT TOKEN. It prints "batch RANK PID N" after each
# batch it received (N counts from 1 across resumes), so the driver can kill it at a batch.
TRAINING = textwrap.dedent(
    """
    import json, os, sys
    import dataset_rt
    from dataset_rt import DataLoader, DatasetRuntime, ReaderConfig, WriterConfig
    from dataset_rt.testing import make_source

    base, checkpoint, token = sys.argv[1], sys.argv[2], sys.argv[3]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dist = None
    if world > 1:
        import torch.distributed as dist
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist else 0

    def gather(value):
        if dist is None:
            return [value]
        out = [None] * world
        dist.all_gather_object(out, value)
        return out

    runtime = DatasetRuntime(num_workers=1)
    source = make_source("soak", [(bytes([i % 251]) * (1 + i), {{"i": i}}) for i in range({n})])
    result = runtime.from_cache_sources(
        source, base, reader_config=ReaderConfig(seed=3),
        writer_config=WriterConfig(show_progress=False),
    )
    dataset = result.dataset
    # The rank comes from torch.distributed (or the environment), never from this script.
    assert (dataset.rank, dataset.world_size) == (rank, world), (dataset.rank, rank)
    loader = DataLoader(dataset, batch_size={batch}, num_workers=2)
    ids, received = [], 0
    if os.path.exists(checkpoint):
        with open(checkpoint) as f:
            saved = json.load(f)
        loader.load_state_dict(saved["states"][rank])
        ids, received = saved["ids"][rank], saved["received"]

    def save():
        states = gather(loader.state_dict())
        # Every rank has reached the same global position of the same epoch.
        assert len({{(s["epoch"], s["position"]) for s in states}}) == 1, states
        every = gather(ids)
        if rank == 0:
            tmp = checkpoint + ".tmp"
            with open(tmp, "w") as f:
                json.dump({{"states": states, "ids": every, "received": received}}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, checkpoint)
        gather(None)  # nobody runs ahead of the checkpoint

    while loader.state_dict()["epoch"] < {epochs}:
        for batch in loader:
            ids.extend(s.metadata["i"] for s in batch)
            received += 1
            print(f"batch {{rank}} {{os.getpid()}} {{received}}", flush=True)
            if received % {every} == 0:
                save()
    save()
    print(f"done {{rank}} {{os.getpid()}} {{received}}", flush=True)
    if dist is not None:
        # Left to interpreter teardown, gloo's threads sometimes abort the process
        # ("terminate called without an active exception").
        dist.destroy_process_group()
    """
).format(n=SAMPLES, batch=BATCH_SIZE, epochs=EPOCHS, every=CHECKPOINT_EVERY)


@dataclass
class Figures:
    cycles: int = 0
    torchrun_cycles: int = 0
    kills: int = 0
    kills_at_startup: int = 0
    finished_before_kill: int = 0
    samples_compared: int = 0
    leftovers: int = 0
    orphans: int = 0
    seconds: float = 0.0
    failures: list[str] = field(default_factory=list)


def command(script: Path, base: Path, checkpoint: Path, token: str, torchrun: bool) -> list[str]:
    args = [str(script), str(base), str(checkpoint), token]
    if not torchrun:
        return [sys.executable, "-u", *args]
    # torchrun itself, run by this interpreter (the `torchrun` on PATH may be another's).
    runner = [sys.executable, "-m", "torch.distributed.run"]
    return [*runner, "--standalone", "--nproc_per_node", "2", "--max-restarts", "0", *args]


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def running(pid: int) -> bool:
    """A process runs under `pid` (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def processes_of(token: str, owners: set[int]) -> list[int]:
    """Running processes of a cycle: its training processes and their forked workers (their
    command line carries the token) and producers of its owners (argv: ... OWNER SPEC)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        args = cmdline(int(entry))
        ours = token in args or (
            any("dataset_rt._loader.producer" in a for a in args)
            and len(args) >= 2
            and args[-2].isdigit()
            and int(args[-2]) in owners
        )
        if ours and running(int(entry)):
            found.append(int(entry))
    return found


def shm_of(owners: set[int]) -> list[str]:
    prefixes = tuple(f"dataset-rt-{pid}-" for pid in owners)
    return sorted(n for n in os.listdir(SHM) if n.startswith(prefixes)) if prefixes else []


def wait_for(condition, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def run_to_end(cmd: list[str], owners: set[int], timeout: float) -> None:
    """Runs a training to its end; records the pids of its training processes."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    for line in done.stdout.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] in ("batch", "done"):
            owners.add(int(parts[2]))
    if done.returncode != 0:
        raise RuntimeError(f"training failed ({done.returncode}):\n{done.stderr[-3000:]}")


def drain(stream, seconds: float) -> None:
    """Reads `stream` until its end (every process holding the pipe is gone) or `seconds`."""
    deadline = time.monotonic() + seconds
    fd = stream.fileno()
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.1)
        if ready and not os.read(fd, 65536):
            return


def run_and_kill(
    cmd: list[str], token: str, torchrun: bool, rng: random.Random, total: int, owners: set[int]
) -> str:
    """Starts a training and SIGKILLs it (one rank of it under torchrun) at a random batch, or
    during start-up. Returns "startup", "batch" or "finished" (it ended before the kill)."""
    at_startup = rng.random() < 0.1
    target = rng.randrange(1, total + 1)
    process = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True
    )
    assert process.stdout is not None
    ranks: dict[int, int] = {}
    outcome = "finished"
    try:
        if at_startup:
            time.sleep(rng.uniform(0.0, 0.6))  # a run takes a few seconds
            if process.poll() is None:
                outcome = "startup"
            owners.update(processes_of(token, set()))
            if torchrun:  # the whole job: torchrun, its ranks and their children
                os.killpg(process.pid, signal.SIGKILL)
            else:
                process.kill()
        else:
            for line in process.stdout:
                parts = line.decode().split()
                if len(parts) == 4 and parts[0] == "batch":
                    rank, pid, n = int(parts[1]), int(parts[2]), int(parts[3])
                    ranks[rank] = pid
                    owners.add(pid)
                    if n >= target:
                        time.sleep(rng.uniform(0.0, 0.02))  # anywhere in the next step
                        # One rank dies: torchrun tears the other down, as in a real job.
                        os.kill(rng.choice(list(ranks.values())), signal.SIGKILL)
                        outcome = "batch"
                        break
        if not torchrun:
            owners.add(process.pid)
        # The survivors' last words; the pipe ends when every holder is gone (a lingering
        # orphan is reported by the caller, not waited for here).
        drain(process.stdout, 30)
        code = process.wait(timeout=120)
        if outcome == "finished" and code != 0:
            raise RuntimeError(f"the training ended with code {code} before its kill")
    finally:
        process.stdout.close()
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return outcome


def reference(script: Path, work: Path, torchrun: bool) -> dict:
    checkpoint = work / f"reference-{torchrun}.json"
    base = work / "base"
    run_to_end(command(script, base, checkpoint, "reference", torchrun), set(), 600)
    with open(checkpoint) as f:
        return json.load(f)


def soak(cycles: int, seed: int, torchrun_every: int, work: Path) -> Figures:
    figures = Figures()
    script = work / "train.py"
    script.write_text(TRAINING)
    started = time.monotonic()
    refs = {False: reference(script, work, False)}
    if torchrun_every:
        refs[True] = reference(script, work, True)
    rng = random.Random(seed)
    for cycle in range(cycles):
        torchrun = bool(torchrun_every) and cycle % torchrun_every == torchrun_every - 1
        ref = refs[torchrun]
        token = f"soak-{uuid.uuid4().hex}"
        checkpoint = work / f"cycle-{cycle}.json"
        cmd = command(script, work / "base", checkpoint, token, torchrun)
        owners: set[int] = set()
        outcome = run_and_kill(cmd, token, torchrun, rng, ref["received"], owners)
        figures.cycles += 1
        figures.torchrun_cycles += torchrun
        figures.kills += outcome != "finished"
        figures.kills_at_startup += outcome == "startup"
        figures.finished_before_kill += outcome == "finished"
        # The killed run's children end by themselves: workers by their parent-death signal,
        # the producer within about 100 ms of seeing its owner gone.
        wait_for(lambda token=token, owners=owners: not processes_of(token, owners), 10)
        orphans = processes_of(token, owners)
        run_to_end(cmd, owners, 600)  # resume from the last checkpoint (or from scratch)
        with open(checkpoint) as f:
            got = json.load(f)
        # After the cycle: nothing of any run of it is left (the resumed loader's start removes
        # what a run killed before its producer started could not).
        orphans += [p for p in processes_of(token, owners) if p not in orphans]
        left = shm_of(owners)
        figures.orphans += len(orphans)
        figures.leftovers += len(left)
        figures.samples_compared += sum(len(ids) for ids in ref["ids"])
        problems = []
        if got["ids"] != ref["ids"]:
            problems.append("the delivered ids differ from the uninterrupted run's")
        if orphans:
            problems.append(f"orphan processes {orphans}")
        if left:
            problems.append(f"/dev/shm leftovers {left}")
        kind = "torchrun" if torchrun else "single"
        print(f"cycle {cycle + 1}/{cycles} ({kind}, killed: {outcome}): ", end="")
        print("; ".join(problems) if problems else "ok", flush=True)
        if problems:
            figures.failures.append(f"cycle {cycle + 1}: " + "; ".join(problems))
            break
        checkpoint.unlink()
    figures.seconds = time.monotonic() - started
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--torchrun-every",
        type=int,
        default=4,
        help="every Nth cycle runs under torchrun with 2 ranks (0: never)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="dataset-rt-soak-") as work:
        figures = soak(args.cycles, args.seed, args.torchrun_every, Path(work))
    print(
        f"loader soak: {figures.cycles} cycles ({figures.torchrun_cycles} under torchrun with 2 "
        f"ranks), {figures.kills} kills ({figures.kills_at_startup} during start-up, "
        f"{figures.finished_before_kill} runs ended before their kill), "
        f"{figures.samples_compared} samples compared, leftovers {figures.leftovers}, "
        f"orphans {figures.orphans}, {figures.seconds:.0f} s (seed {args.seed})"
    )
    for failure in figures.failures:
        print(f"FAILED {failure}")
    return 1 if figures.failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""A benchmark's contenders in fresh interpreters, with their process tree's memory sampled.

The child prints one line ``RESULT <json>``; ``run_child`` adds the tree's peak RSS and PSS, the
most processes seen at once, and the ``/dev/shm`` segments DatasetRT's processes left behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import common

SAMPLE_PERIOD_S = 0.05
PAGE = os.sysconf("SC_PAGE_SIZE")


def tree(root: int, all_threads: bool) -> list[int]:
    """``root`` and its descendants. Processes are started by their parent's main thread (torch,
    multiprocessing, subprocess); every thread's children are read when ``all_threads``."""
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        try:
            tasks = os.listdir(f"/proc/{pid}/task") if all_threads else [str(pid)]
            for task in tasks:
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return pids


def rss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


def pss_of(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


PSS_PARTS = ("Pss", "Pss_Anon", "Pss_File", "Pss_Shmem")


def pss_parts_of(pid: int) -> dict[str, int]:
    """``pid``'s PSS in bytes and its anonymous, file-backed and shared-memory parts
    (``smaps_rollup``'s ``Pss_*`` lines); zeros for a process that is gone."""
    parts = dict.fromkeys(PSS_PARTS, 0)
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in parts:
                    parts[key] = int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return dict.fromkeys(PSS_PARTS, 0)
    return parts


class TreeSampler(threading.Thread):
    """Every 50 ms: the tree's summed RSS (cheap: ``statm``). Every 20th time (1 s) also its
    summed PSS: ``smaps_rollup`` makes the kernel walk every mapping, ~13 ms for a process that
    imported torch, so reading it more often would take a visible share of a core."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.stop = threading.Event()
        self.peak_rss = self.peak_pss = 0
        self.max_procs = 0
        self.samples = 0
        self.cpu_s = 0.0
        self.seen: set[int] = set()

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_PERIOD_S):
            pss = self.samples % 20 == 10
            pids = tree(self.root, all_threads=self.samples % 10 == 0)
            self.seen.update(pids)
            rss = [rss_of(p) for p in pids]
            self.peak_rss = max(self.peak_rss, sum(rss))
            self.max_procs = max(self.max_procs, sum(1 for m in rss if m))
            if pss:
                self.peak_pss = max(self.peak_pss, sum(pss_of(p) for p in pids))
            self.samples += 1
        self.cpu_s = time.thread_time()


def shm_names() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def run_child(script: Path, argv: list[str], timeout: float) -> dict[str, Any]:
    """Runs ``script`` in a fresh interpreter, sampling its process tree's memory."""
    cmd = [sys.executable, str(script), *argv]
    before = shm_names()
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = TreeSampler(proc.pid)
    sampler.start()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        err = f"timed out after {timeout:.0f} s\n{err}"
    sampler.stop.set()
    sampler.join()
    wall = time.perf_counter() - started
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = " | ".join(err.strip().splitlines()[-4:])[-600:]
        return {"error": f"exit {proc.returncode}: {tail}"}
    res: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    res["peak_tree_rss_mib"] = sampler.peak_rss / common.MIB
    res["peak_tree_pss_mib"] = sampler.peak_pss / common.MIB
    res["max_processes"] = sampler.max_procs
    res["memory_samples"] = sampler.samples
    res["sampler_cpu_s"] = sampler.cpu_s
    res["child_wall_s"] = wall
    # /dev/shm names this contender's processes left (DatasetRT's carry the owner's pid);
    # other jobs on the machine may create and leave their own meanwhile.
    owners = {f"dataset-rt-{p}-" for p in sampler.seen | {proc.pid}}
    res["shm_left"] = sorted(
        n for n in shm_names() - before if any(n.startswith(o) for o in owners)
    )
    return res

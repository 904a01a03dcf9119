"""Bounded runs of the soaks in ``soak/``; the full writer soak is
``python soak/writer_kill.py`` (50 cycles)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SOAK = Path(__file__).resolve().parents[1] / "soak"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"soak_{name}", SOAK / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_writer_kill_soak(tmp_path):
    """SIGKILL a multi-source write at 8 random points: nothing partial is ever published, no
    lock stays held, and the next write succeeds, verifies and leaves no temporary directory."""
    soak = load("writer_kill")
    figures = soak.run_soak(cycles=8, seed=7, workdir=tmp_path)
    assert figures.failures == []
    assert figures.cycles == 8
    assert figures.kills + figures.finished_before_kill == 8
    assert figures.kills >= 4  # the delays are drawn within one write's duration
    assert figures.caches_verified == 8 * len(soak.NAMES)
    assert figures.leftovers == 0

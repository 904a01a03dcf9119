"""A bounded run of the loader soak (`soak/loader_kill.py`): training processes SIGKILLed at
random points and resumed from their last checkpoint, two of the cycles under torchrun with two
ranks. The full run is `python soak/loader_kill.py` (100 cycles)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[1] / "soak" / "loader_kill.py"


@pytest.mark.slow
@pytest.mark.torch
def test_killed_and_resumed_training_delivers_the_uninterrupted_sequence():
    pytest.importorskip("torch.distributed")
    run = subprocess.run(
        [sys.executable, str(SOAK), "--cycles", "6", "--torchrun-every", "3", "--seed", "7"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    summary = run.stdout.strip().splitlines()[-1]
    figures = re.search(
        r"(\d+) cycles \((\d+) under torchrun.*?(\d+) kills.*?(\d+) samples compared, "
        r"leftovers (\d+), orphans (\d+)",
        summary,
    )
    assert figures is not None, summary
    cycles, torchrun, kills, samples, leftovers, orphans = map(int, figures.groups())
    assert (cycles, torchrun, leftovers, orphans) == (6, 2, 0, 0)
    assert kills >= 4 and samples >= 6 * 90

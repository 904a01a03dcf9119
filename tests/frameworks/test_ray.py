"""dataset_rt.torch.DataLoader under Ray Train: a `TorchTrainer` with 2 CPU workers on a local
Ray cluster, each reading the shared cache, and a worker failure resumed from a Ray checkpoint
(ray_job.py)."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from framework_helpers import (
    assert_each_sample_once,
    assert_no_segments,
    job,  # noqa: F401 (the fixture)
    records,
    require,
)

require("ray.train")
import jobs_common as common  # noqa: E402 (after the skip: it imports torch)

# Not marked `torch`: without the framework these skip, also where torch is required; they
# are required under DATASET_RT_REQUIRE_FRAMEWORKS=1 instead.
pytestmark = [pytest.mark.timeout(300)]

CHECKPOINT_EVERY = 3  # ray_job.py's


def test_workers_cover_each_sample_once_and_resume_exactly(job, tmp_path):  # noqa: F811
    cache = tmp_path / "caches"
    common.write_cache(cache)
    ray_dir = Path(tempfile.mkdtemp(prefix="rt-ray-"))
    try:
        job.python(
            "ray_job.py",
            f"--cache={cache}",
            f"--out={tmp_path}",
            f"--ray-dir={ray_dir}",
            timeout=240,
        )
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)

    uninterrupted = records(tmp_path / "whole" / "attempt0")
    assert_each_sample_once([r["steps"] for r in uninterrupted], common.SAMPLES, common.EPOCHS)
    failed = records(tmp_path / "failed" / "attempt0")
    resumed = records(tmp_path / "failed" / "attempt1")
    # The workers failed after STOP_AFTER steps; the last checkpoint before that is the restart
    # point, and the steps after it are read again, exactly as the first time.
    kept = common.STOP_AFTER // CHECKPOINT_EVERY * CHECKPOINT_EVERY
    for rank in range(2):
        assert len(failed[rank]["steps"]) == common.STOP_AFTER
        expected = uninterrupted[rank]["steps"]
        assert failed[rank]["steps"] + resumed[rank]["steps"] != expected  # the replay is real
        assert failed[rank]["steps"][:kept] + resumed[rank]["steps"] == expected
        assert resumed[rank]["weights"] == uninterrupted[rank]["weights"]
    pids = [r["pid"] for r in (*uninterrupted, *failed, *resumed)]
    assert len(set(pids)) == 6, "Ray restarts the workers in new processes"
    assert_no_segments(pids)

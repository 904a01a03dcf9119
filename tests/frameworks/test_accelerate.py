"""dataset_rt.torch.DataLoader under Hugging Face Accelerate: `accelerate launch` with 2 CPU
processes, `Accelerator.prepare`, `save_state` and `load_state` (accelerate_job.py)."""

from __future__ import annotations

import shutil
import sys

import pytest
from framework_helpers import (
    HERE,
    assert_each_sample_once,
    assert_no_segments,
    job,  # noqa: F401 (the fixture)
    records,
    require,
)

require("accelerate")
import jobs_common as common  # noqa: E402 (after the skip: it imports torch)

# Not marked `torch`: without the framework these skip, also where torch is required; they
# are required under DATASET_RT_REQUIRE_FRAMEWORKS=1 instead.
pytestmark = [pytest.mark.timeout(180)]


def launch(job, *args: str) -> None:  # noqa: F811
    accelerate = shutil.which("accelerate", path=str(sys.executable).rsplit("/", 1)[0])
    command = [accelerate or "accelerate", "launch", "--multi_gpu", "--num_processes=2"]
    command += ["--num_machines=1", "--mixed_precision=no", "--dynamo_backend=no"]
    job.run([*command, str(HERE / "accelerate_job.py"), *args], timeout=120)


@pytest.mark.parametrize("workers", [0, 2])
def test_two_processes_cover_each_sample_once_and_resume_exactly(job, tmp_path, workers):  # noqa: F811
    """The uninterrupted run also saves Accelerate's state in the middle of its second epoch;
    a second launch, in fresh processes as after a kill, resumes from that state alone."""
    cache = tmp_path / "caches"
    common.write_cache(cache)
    state = tmp_path / "state"
    whole, resumed_out = tmp_path / "whole", tmp_path / "resumed"
    workers_arg = f"--workers={workers}"
    launch(job, f"--cache={cache}", f"--out={whole}", f"--checkpoint={state}", workers_arg)
    launch(job, f"--cache={cache}", f"--out={resumed_out}", f"--resume={state}", workers_arg)

    uninterrupted = records(whole)
    assert_each_sample_once([r["steps"] for r in uninterrupted], common.SAMPLES, common.EPOCHS)
    resumed = records(resumed_out)
    for rank in range(2):
        assert resumed[rank]["steps"] == uninterrupted[rank]["steps"][common.STOP_AFTER :]
        assert resumed[rank]["weights"] == uninterrupted[rank]["weights"]
    assert resumed[0]["weights"] == resumed[1]["weights"]
    assert_no_segments([r["pid"] for r in (*uninterrupted, *resumed)])

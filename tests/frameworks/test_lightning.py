"""dataset_rt.torch.DataLoader under PyTorch Lightning: `Trainer(strategy="ddp", devices=2)` on
CPU, Lightning's own checkpoint and resume (lightning_job.py)."""

from __future__ import annotations

import pytest
from framework_helpers import (
    assert_each_sample_once,
    assert_no_segments,
    job,  # noqa: F401 (the fixture)
    records,
    require,
)

require("lightning")
import jobs_common as common  # noqa: E402 (after the skip: it imports torch)

# Not marked `torch`: without the framework these skip, also where torch is required; they
# are required under DATASET_RT_REQUIRE_FRAMEWORKS=1 instead.
pytestmark = [pytest.mark.timeout(180)]


def test_ddp_covers_each_sample_once_and_resumes_exactly(job, tmp_path):  # noqa: F811
    """The uninterrupted run also writes Lightning's checkpoint of a step in the middle of its
    second epoch; a second job, in fresh processes as after a kill, resumes from it alone."""
    cache = tmp_path / "caches"
    common.write_cache(cache)
    ckpts = tmp_path / "checkpoints"
    whole, resumed_out = tmp_path / "whole", tmp_path / "resumed"
    job.python("lightning_job.py", f"--cache={cache}", f"--out={whole}", f"--checkpoints={ckpts}")
    [checkpoint] = ckpts.glob(f"*step={common.STOP_AFTER}.ckpt")
    job.python(
        "lightning_job.py",
        f"--cache={cache}",
        f"--out={resumed_out}",
        f"--checkpoints={tmp_path / 'unused'}",
        f"--resume={checkpoint}",
    )

    uninterrupted = records(whole)
    # Lightning kept our loader (no re-instantiation) and saw its rank split as a
    # DistributedSampler, so it injected none.
    assert [(r["same_loader"], r["sampler"]) for r in uninterrupted] == [(True, "_RankSplit")] * 2
    assert_each_sample_once([r["steps"] for r in uninterrupted], common.SAMPLES, common.EPOCHS)

    resumed = records(resumed_out)
    for rank in range(2):
        steps = uninterrupted[rank]["steps"]
        # Exactly the rest of the interrupted epoch, then the last epoch.
        assert resumed[rank]["steps"] == steps[common.STOP_AFTER :]
        assert resumed[rank]["weights"] == uninterrupted[rank]["weights"]
    assert resumed[0]["weights"] == resumed[1]["weights"]
    assert_no_segments([r["pid"] for r in (*uninterrupted, *resumed)])

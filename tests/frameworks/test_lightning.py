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
import torch  # noqa: E402

# Not marked `torch`: without the framework these skip, also where torch is required; they
# are required under DATASET_RT_REQUIRE_FRAMEWORKS=1 instead.
pytestmark = [pytest.mark.timeout(180)]


@pytest.mark.parametrize("workers", [0, 2])
def test_ddp_covers_each_sample_once_and_resumes_exactly(job, tmp_path, workers):  # noqa: F811
    """The uninterrupted run also writes Lightning's checkpoint of a step in the middle of its
    second epoch; a second job, in fresh processes as after a kill, resumes from it alone."""
    cache = tmp_path / "caches"
    common.write_cache(cache)
    ckpts = tmp_path / "checkpoints"
    whole, resumed_out = tmp_path / "whole", tmp_path / "resumed"
    job.python(
        "lightning_job.py",
        f"--cache={cache}",
        f"--out={whole}",
        f"--checkpoints={ckpts}",
        f"--workers={workers}",
    )
    [checkpoint] = ckpts.glob(f"*step={common.STOP_AFTER}.ckpt")
    job.python(
        "lightning_job.py",
        f"--cache={cache}",
        f"--out={resumed_out}",
        f"--checkpoints={tmp_path / 'unused'}",
        f"--resume={checkpoint}",
        f"--workers={workers}",
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


@pytest.mark.parametrize("workers", [0, 2])
def test_predict_returns_each_sample_once_with_its_indices(job, tmp_path, workers):  # noqa: F811
    """Trainer.predict re-creates the loader around Lightning's index-recording batch sampler:
    the loader takes it, and the prediction writer gets each batch's true indices."""
    cache = tmp_path / "caches"
    common.write_cache(cache)
    out = tmp_path / "predicted"
    job.python(
        "lightning_predict_job.py", f"--cache={cache}", f"--out={out}", f"--workers={workers}"
    )

    ranks = records(out)
    assert [(r["recreated"], r["batch_sampler"]) for r in ranks] == [
        (True, "_IndexBatchSamplerWrapper")
    ] * 2
    model = common.make_model()
    predicted: dict[int, float] = {}
    for r in ranks:
        # The indices of each batch are its samples' (their sample_id is their row number).
        assert [b["indices"] for b in r["batches"]] == [b["ids"] for b in r["batches"]]
        assert r["epoch_indices"] == [b["ids"] for b in r["batches"]]
        for indices, prediction in zip(r["epoch_indices"], r["predictions"], strict=True):
            assert prediction["ids"] == indices
            for i, value in zip(indices, prediction["out"], strict=True):
                x, _ = common.point(i)
                expected = model(torch.tensor(x)).item()
                assert value == pytest.approx(expected, rel=1e-5)
                predicted.setdefault(i, value)
    # Every sample once, plus the rank split's padding (one repeat for 39 samples on 2 ranks).
    assert_each_sample_once(
        [[b["ids"] for b in r["batches"]] for r in ranks], common.SAMPLES, epochs=1
    )
    assert sorted(predicted) == list(range(common.SAMPLES))
    assert_no_segments([r["pid"] for r in ranks])

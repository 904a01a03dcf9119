"""The scripts of docs/frameworks.md run as the page says, each under its framework's launcher,
on the page's `points` cache (the `<!-- docs-test: launched -->` blocks)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import test_docs_blocks  # tests/, for its reading of the page's blocks
from framework_helpers import ROOT, job, require  # noqa: F401 (job: the fixture)

PAGE = ROOT / "docs" / "frameworks.md"
# Not marked `torch`: without the framework these skip, also where torch is required; they
# are required under DATASET_RT_REQUIRE_FRAMEWORKS=1 instead.
pytestmark = [pytest.mark.timeout(300)]


def script(heading: str) -> str:
    """The launched block of the page's section `heading`."""
    text = PAGE.read_text()
    start = text.index(f"\n## {heading}\n")
    line = text.count("\n", 0, start) + 1
    end = text.find("\n## ", start + 1)
    end_line = text.count("\n", 0, end) + 1 if end != -1 else len(text.splitlines()) + 1
    [block] = [
        b
        for b in test_docs_blocks.blocks(PAGE)
        if b.kind == "launched" and line < b.line < end_line
    ]
    return block.source


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    require("torch")
    import jobs_common

    jobs_common.write_cache(tmp_path / "caches")
    return tmp_path


def test_lightning_script(job, workdir):  # noqa: F811
    require("lightning")
    (workdir / "train.py").write_text(script("PyTorch Lightning"))
    job.run([sys.executable, "train.py"], timeout=120)
    checkpoints = sorted((workdir / "checkpoints").glob("*.ckpt"))
    assert checkpoints, "no checkpoint written"
    # The first checkpoint is mid-epoch (step 3 of 5).
    job.run([sys.executable, "train.py", str(checkpoints[0])], timeout=120)


def test_accelerate_script(job, workdir):  # noqa: F811
    require("accelerate")
    (workdir / "train.py").write_text(script("Hugging Face Accelerate"))
    launch = [shutil.which("accelerate") or "accelerate", "launch", "--multi_gpu"]
    launch += ["--num_processes=2", "--num_machines=1", "--mixed_precision=no"]
    launch += ["--dynamo_backend=no", "train.py"]
    job.run(launch, timeout=120)
    assert (workdir / "state" / "custom_checkpoint_0.pkl").exists()
    job.run([*launch, "state"], timeout=120)


def test_ray_script(job, workdir):  # noqa: F811
    require("ray.train")
    (workdir / "train.py").write_text(script("Ray Train"))
    # Ray's sockets live under its temporary directory: a short one keeps their paths legal.
    ray_dir = Path(tempfile.mkdtemp(prefix="rt-ray-"))
    job.env["RAY_TMPDIR"] = str(ray_dir)
    try:
        job.run([sys.executable, "train.py"], timeout=240)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert list((workdir / "ray-results").rglob("state.pt"))

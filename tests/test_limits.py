"""Process limits: a cache holds one descriptor per shard in the training process (views of a
shard take none), and a limit that stops an open or the loader's result memory is named in the
error with the file or the memory it stopped. Each case runs in a child interpreter, so the
limits never touch the test process."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dataset_rt import DatasetRuntime, ReaderConfig, WriterConfig
from dataset_rt.testing import make_source

SHARDS = 200

CHILD = textwrap.dedent(
    """
    import os, resource, sys
    from pathlib import Path
    from dataset_rt import DataLoader, DatasetRuntime, ReaderConfig

    kind, value, action, base = sys.argv[1], int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
    limit = {"NOFILE": resource.RLIMIT_NOFILE, "FSIZE": resource.RLIMIT_FSIZE}[kind]

    def fds():
        return len(os.listdir("/proc/self/fd"))

    runtime = DatasetRuntime(num_workers=2)
    before = fds()
    resource.setrlimit(limit, (value, resource.getrlimit(limit)[1]))
    try:
        result = runtime.open_caches("c", base, reader_config=ReaderConfig(shuffle=False))
        dataset = result.dataset
        assert dataset is not None, result
        opened = fds()
        if action == "iterate":
            kept = [s.data for s in dataset]  # every shard viewed, every view kept
            assert [bytes(v)[:4] for v in kept] == [i.to_bytes(4, "little") for i in range(200)]
            print("fds", opened - before, fds() - before)
        elif action == "loader":
            with DataLoader(dataset, 8, num_workers=1, transform=lambda s: bytes(s.data)) as dl:
                print("batches", sum(1 for _ in dl))
    except OSError as error:
        print("OSError", error.errno, error)
    """
)


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A cache of 200 samples, one per shard."""
    base = tmp_path_factory.mktemp("limits")
    runtime = DatasetRuntime(num_workers=2)
    samples = [(i.to_bytes(4, "little") * 64, {"i": i}) for i in range(SHARDS)]
    result = runtime.from_cache_sources(
        make_source("c", samples),
        base,
        reader_config=ReaderConfig(),
        writer_config=WriterConfig(show_progress=False, shard_size_bytes=1),
    )
    assert result.dataset is not None
    assert len(list((base / "c" / "shards").iterdir())) == SHARDS
    runtime.close()
    return base


def child(base: Path, kind: str, value: int, action: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", CHILD, kind, str(value), action, str(base)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_dataset_holds_one_descriptor_per_shard_and_its_views_none(base):
    out = child(base, "NOFILE", 1024, "iterate")
    opened, after = (int(n) for n in out.split()[1:])
    assert SHARDS <= opened <= SHARDS + 8, out
    assert after == opened, out  # 200 shards viewed: not one more descriptor


def test_too_few_descriptors_name_the_file_and_the_limit(base):
    out = child(base, "NOFILE", 64, "iterate")
    assert out.startswith("OSError 24 "), out
    assert str(base / "c" / "shards") in out, out
    assert "RLIMIT_NOFILE allows 64 open files" in out, out


def test_a_file_size_limit_names_the_result_memory_and_its_size(base):
    out = child(base, "FSIZE", 1 << 20, "loader")
    assert out.startswith("OSError 27 "), out
    assert "result memory" in out and "bytes" in out and "RLIMIT_FSIZE" in out, out

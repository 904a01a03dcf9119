"""bench/bench_cold.py checks every sample it measures: its records must carry what the check
expects, the check must catch a wrong or damaged record, and a tiny run must check every sample
of every contender (eviction is reported but not required: the test's filesystem may be tmpfs)."""

import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"


@pytest.fixture(scope="module")
def bench_cold():
    sys.path.insert(0, str(BENCH))
    try:
        import bench_cold

        yield bench_cold
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("size", [4096, 131072])
def test_records_pass_the_check_and_damage_fails_it(bench_cold, size):
    records = bench_cold.make_records(10, 3, size, seed=size)
    for j, row in enumerate(records):
        assert bench_cold.check(row.tobytes(), size, 10 + j) == 10 + j
        assert bench_cold.check(memoryview(row), size) == 10 + j
    with pytest.raises(bench_cold.CheckError, match="asked for"):
        bench_cold.check(records[0].tobytes(), size, 11)
    with pytest.raises(bench_cold.CheckError, match="bytes"):
        bench_cold.check(records[0].tobytes()[:-8], size)
    for where in (bench_cold.HEADER.size, size // 2, size - 1):
        damaged = bytearray(records[1].tobytes())
        damaged[where] ^= 0x40
        with pytest.raises(bench_cold.CheckError, match="digest"):
            bench_cold.check(bytes(damaged), size)
    # Deterministic: a rewrite writes the same bytes.
    assert bench_cold.make_records(10, 3, size, seed=size).tobytes() == records.tobytes()


@pytest.mark.parametrize(("n", "k"), [(1000, 20), (1000, 250), (7, 7), (5, 1)])
def test_share_is_k_distinct_samples_spread_evenly(bench_cold, n, k):
    idx = bench_cold.share(n, k, seed=3)
    assert len(idx) == len(set(idx)) == k
    gaps = np.diff(sorted(idx))
    assert all(0 <= i < n for i in idx)
    assert set(gaps.tolist()) <= {n // k, -(-n // k)}
    assert bench_cold.share(n, k, seed=3) == idx


def test_tiny_run_checks_every_sample(bench_cold, tmp_path, monkeypatch):
    import common

    # The contenders run in fresh interpreters: they must import this checkout's dataset_rt.
    path = os.environ.get("PYTHONPATH")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), path])))
    monkeypatch.setattr(common, "RESULTS_DIR", tmp_path / "results")
    only = ["ceiling", "ceiling_layout", "drt_iter", "drt_batches", "drt_loader_w0"]
    res = bench_cold.main(
        [
            "--gib",
            "0.002",
            "--rounds",
            "1",
            "--data-dir",
            str(tmp_path / "data"),
            "--samples",
            "4KiB=64",
            "128KiB=3",
            "--only",
            *only,
            "--batch-size",
            "16",
            "--threads",
            "8",
            "--allow-resident",
        ]
    )
    assert (tmp_path / "results" / "cold.json").exists()
    assert [t["size"] for t in res["tables"]] == ["4KiB", "128KiB"]
    for table, k in zip(res["tables"], [64, 3], strict=True):
        assert table["read_per_contender"] == k
        assert [r["contender"] for r in table["rows"]] == only
        for row in table["rows"]:
            assert "error" not in row, row
            assert row["checked"] == [k]
            assert row["samples_per_s"] > 0
            assert row["resident_before_pages"][0] is not None
        assert table["rows"][0]["x_ceiling"] == 1
    # A second run reuses the data: the stamps match.
    lay = bench_cold.Layout(tmp_path / "data", "4KiB", 0.002)
    assert lay.ready("flat") and lay.ready("drt")
    # The pread ceiling checks what it reads: a damaged flat file fails it.
    with open(lay.flat, "r+b") as f:
        data = bytearray(f.read())
        for i in range(lay.count):
            data[i * lay.size + lay.size - 1] ^= 1
        f.seek(0)
        f.write(data)
    # In one process and split over two, and from Rust.
    for procs in (1, 2):
        with pytest.raises(bench_cold.CheckError, match="digest"):
            bench_cold.run_ceiling(lay, bench_cold.share(lay.count, 8, 0), 4, procs)
    probe, why = bench_cold.build_probe()
    assert probe is not None, why
    with pytest.raises(bench_cold.CheckError, match="digest mismatch"):
        bench_cold.run_ceiling_rust(lay, bench_cold.share(lay.count, 8, 0), 4, probe)
    # So does the ceiling over the cache's own payloads, where one was damaged.
    spans = np.load(lay.spans)
    shard, start, length = (int(v) for v in spans[5, :3])
    path = bench_cold.shard_files(lay)[shard]
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(start + length - 1)
        last = f.read(1)
        f.seek(start + length - 1)
        f.write(bytes([last[0] ^ 1]))
    with pytest.raises(bench_cold.CheckError, match="record 5: digest mismatch"):
        bench_cold.run_ceiling_rust(lay, [3, 5, 7], 2, probe, layout=True)


@pytest.mark.parametrize("label", ["4KiB", "128KiB"])
def test_the_rust_ceiling_reads_and_checks_what_the_python_one_does(bench_cold, tmp_path, label):
    probe, why = bench_cold.build_probe()
    assert probe is not None, why
    lay = bench_cold.Layout(tmp_path, label, 0.002)
    bench_cold.prepare(lay, "flat")
    idx = bench_cold.share(lay.count, 6, 1)
    out = bench_cold.run_ceiling_rust(lay, idx, 3, probe)
    assert out["checked"] == out["distinct"] == 6
    assert out["pass_s"] >= out["first_s"] > 0
    assert bench_cold.run_ceiling_rust(lay, idx, 1, probe)["checked"] == 6
    # A record found where another was asked for fails the check.
    offs = np.load(lay.offsets)
    moved = np.array(offs)
    moved[[idx[0], idx[0] + 1]] = offs[[idx[1], idx[1] + 1]]
    np.save(lay.offsets, moved)
    wrong = f"record {idx[0]}: header says .* index {idx[1]},"
    with pytest.raises(bench_cold.CheckError, match=wrong):
        bench_cold.run_ceiling_rust(lay, idx, 3, probe)


def test_residency_counts_agree(bench_cold, tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(os.urandom(64 * 4096))
    with open(path, "rb") as f:
        f.read()  # resident now, unless the filesystem keeps nothing
    by_mincore = bench_cold.resident_mincore([path])
    pages, tool = bench_cold.resident([path])
    assert tool == ("fincore" if shutil.which("fincore") else "mincore")
    assert pages == by_mincore
    assert 0 <= pages[str(path)] <= 64

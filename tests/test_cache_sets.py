"""Cache sets: written by 1, 2 or 3 processes with the same content, published only whole (also
when the parent or a worker is killed, or Ctrl-C stops the build), failing parts reported and the
others kept, and a published set read like a cache (order, state, ranks, the loader, the CLI)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from loader_helpers import children, gone, own_segments, wait_until
from set_helpers import PoolPart, parts

from dataset_rt import (
    CacheInput,
    CacheLoaded,
    CacheMalformed,
    CacheSet,
    CacheSourcesDatasetError,
    CacheSourcesDatasetSuccess,
    CacheWriteError,
    CacheWritten,
    ConfigError,
    DataLoader,
    DatasetRuntime,
    ReaderConfig,
    StateError,
    WriterConfig,
)
from dataset_rt.cli import EXIT_OK, EXIT_USAGE, main
from dataset_rt.testing import ListSource

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def no_processes_left():
    """Every test leaves no worker process and nothing of this process in /dev/shm."""
    yield
    assert wait_until(lambda: not children(), 10), f"child processes left: {children()}"
    assert own_segments() == [], f"segments left in /dev/shm: {own_segments()}"


_runtimes: list[DatasetRuntime] = []


@pytest.fixture(scope="module", autouse=True)
def shared_runtime():
    """One runtime for the module's builds; the datasets they return live as long as it."""
    with DatasetRuntime(num_workers=2) as runtime:
        _runtimes.append(runtime)
        yield
        _runtimes.clear()


def build(base: Path, sources, processes: int = 1, **writer):
    writer.setdefault("show_progress", False)
    return _runtimes[0].from_cache_sources(
        sources,
        base,
        reader_config=ReaderConfig(seed=7),
        writer_config=WriterConfig(processes=processes, **writer),
    )


def files(directory: Path) -> dict[str, bytes]:
    """Every file under ``directory`` by relative path, with its bytes."""
    return {
        str(p.relative_to(directory)): p.read_bytes()
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def epoch(dataset, epoch: int = 0) -> list[tuple[str, int, bytes]]:
    dataset.set_epoch(epoch)
    return [(s.metadata["part"], s.metadata["sample_id"], bytes(s.data)) for s in dataset]


def kinds(results) -> list[str]:
    return [type(r).__name__ for r in results]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The set of ``parts()`` written by one process: (base, set.json text)."""
    base = tmp_path_factory.mktemp("reference")
    result = build(base, CacheSet("s", parts()))
    assert isinstance(result, CacheSourcesDatasetSuccess), result
    return base, json.loads((base / "s" / "set.json").read_text())


def test_the_number_of_processes_does_not_change_a_single_byte(tmp_path, reference):
    ref_base, ref_manifest = reference
    expected_files = files(ref_base / "s")
    runs = {}
    for processes in (1, 2, 3):
        base = tmp_path / str(processes)
        result = build(base, CacheSet("s", parts()), processes=processes)
        assert isinstance(result, CacheSourcesDatasetSuccess), result
        # One result per part, then the set's.
        assert kinds(result.results) == ["CacheWritten"] * 4 + ["CacheWritten"]
        assert [r.name for r in result.results] == [
            "s.part-000000",
            "s.part-000001",
            "s.part-000002",
            "s.part-000003",
            "s",
        ]
        assert result.results[-1] == CacheWritten("s", base / "s", 160)
        assert result.dataset.fingerprint == ref_manifest["fingerprint"]
        assert files(base / "s") == expected_files
        runs[processes] = (epoch(result.dataset, 0), epoch(result.dataset, 1))
        # Nothing but the published set and its lock is left beside it.
        assert sorted(p.name for p in base.iterdir()) == [".s.lock", "s"]
    assert runs[1] == runs[2] == runs[3]
    first = runs[1][0]
    assert sorted(first) == sorted(
        (p.part, i, bytes(s.data)) for p in parts() for i, s in enumerate(p)
    )
    assert first != sorted(first)  # shuffled across parts


def test_a_set_opens_resumes_and_splits_like_a_cache(tmp_path, reference):
    ref_base, manifest = reference
    with DatasetRuntime(num_workers=2) as runtime:
        result = runtime.open_caches("s", ref_base, reader_config=ReaderConfig(seed=7))
        assert isinstance(result, CacheSourcesDatasetSuccess)
        assert result.results == [CacheLoaded("s", ref_base / "s", 160)]
        dataset = result.dataset
        assert dataset.fingerprint == manifest["fingerprint"]
        assert dataset.cache_names == [p["name"] for p in manifest["parts"]]
        table = dataset.samples_metadata()
        assert table["cache_id"].unique().sort().to_list() == dataset.cache_names
        whole = epoch(dataset, 3)

        # Resume: a state taken after 50 samples continues with the 51st, in a new dataset.
        dataset.set_epoch(3)
        it = iter(dataset)
        head = [next(it) for _ in range(50)]
        state = dataset.state_dict()
        again = runtime.open_caches("s", ref_base, reader_config=ReaderConfig(seed=7)).dataset
        again.load_state_dict(state)
        rest = [(s.metadata["part"], s.metadata["sample_id"], bytes(s.data)) for s in again]
        assert [(s.metadata["part"], s.metadata["sample_id"]) for s in head] + [
            r[:2] for r in rest
        ] == [w[:2] for w in whole]

        # Ranks: two shares of equal length that cover every sample once.
        shares = []
        for rank in (0, 1):
            split = ReaderConfig(seed=7, rank=rank, world_size=2)
            share = runtime.open_caches("s", ref_base, reader_config=split).dataset
            shares.append([r[:2] for r in epoch(share, 3)])
        assert len(shares[0]) == len(shares[1]) == 80
        assert sorted(shares[0] + shares[1]) == sorted(w[:2] for w in whole)

        # Another set (one part differs) has another fingerprint and refuses this state.
        other = build(tmp_path, CacheSet("s", parts(3, 40)))
        assert isinstance(other, CacheSourcesDatasetSuccess)
        assert other.dataset.fingerprint != manifest["fingerprint"]
        with pytest.raises(StateError, match="another dataset"):
            other.dataset.load_state_dict(state)


def test_failing_parts_are_reported_and_a_rerun_writes_only_them(tmp_path, reference):
    _, manifest = reference
    result = build(tmp_path, CacheSet("s", parts(p1={"fail_at": 3})), processes=2)
    assert isinstance(result, CacheSourcesDatasetError)
    assert kinds(result.results) == [
        "CacheWritten",
        "CacheWriteError",
        "CacheWritten",
        "CacheWritten",
        "CacheWriteError",
    ]
    failed = result.results[1]
    assert failed.name == "s.part-000001"
    assert "sample 3" in failed.message and "part 1 cannot read sample 3" in failed.message
    set_error = result.results[-1]
    assert set_error.name == "s"
    assert "was not published: 1 of its 4 parts failed (part 1)" in set_error.message
    assert "the next build writes only the missing ones" in set_error.message
    assert not (tmp_path / "s").exists()
    staging = tmp_path / ".s.set-parts"
    assert sorted(p.name for p in staging.iterdir() if not p.name.startswith(".")) == [
        "s.part-000000",
        "s.part-000002",
        "s.part-000003",
    ]

    # The rerun, in this process: only part 1 is iterated.
    sources = [ListSource(f"p{p.part}", list(p)) for p in parts()]
    result = build(tmp_path, CacheSet("s", sources))
    assert isinstance(result, CacheSourcesDatasetSuccess)
    assert kinds(result.results) == [
        "CacheLoaded",
        "CacheWritten",
        "CacheLoaded",
        "CacheLoaded",
        "CacheWritten",
    ]
    assert [s.iterations for s in sources] == [0, 1, 0, 0]
    assert result.dataset.fingerprint == manifest["fingerprint"]
    assert not staging.exists()


def test_a_killed_worker_fails_its_part_only(tmp_path, reference):
    _, manifest = reference
    result = build(tmp_path, CacheSet("s", parts(p2={"kill_at": 5})), processes=2)
    assert kinds(result.results)[2] == "CacheWriteError"
    assert "was killed by SIGKILL" in result.results[2].message
    assert kinds(result.results)[:2] + kinds(result.results)[3:4] == ["CacheWritten"] * 3
    assert not (tmp_path / "s").exists()
    result = build(tmp_path, CacheSet("s", parts()), processes=2)
    assert isinstance(result, CacheSourcesDatasetSuccess)
    # Parts 0, 1 and 3 were kept, part 2 written; then the set's own result.
    assert kinds(result.results) == [
        "CacheLoaded",
        "CacheLoaded",
        "CacheWritten",
        "CacheLoaded",
        "CacheWritten",
    ]
    assert result.dataset.fingerprint == manifest["fingerprint"]
    # The killed writer's temporary directory was removed by the part's next writer.
    assert sorted(p.name for p in tmp_path.iterdir()) == [".s.lock", "s"]


def test_a_part_that_exits_fails_alone_with_its_cause(tmp_path):
    """``SystemExit`` from a part's source would end this process's build; in a worker it fails
    that part, saying what the source raised, and the worker writes the next part."""
    result = build(tmp_path, CacheSet("s", parts(3, 8, p0={"exit_at": 2})), processes=2)
    assert kinds(result.results) == [
        "CacheWriteError",
        "CacheWritten",
        "CacheWritten",
        "CacheWriteError",
    ]
    assert "the source raised SystemExit(3)" in result.results[0].message
    with pytest.raises(SystemExit):
        build(tmp_path / "here", CacheSet("s", parts(3, 8, p0={"exit_at": 2})))


def test_a_part_may_start_processes_of_its_own(tmp_path):
    result = build(tmp_path, CacheSet("s", [PoolPart(p, 6) for p in range(3)]), processes=2)
    assert kinds(result.results) == ["CacheWritten"] * 4, result.results
    got = sorted((s.metadata["part"], bytes(s.data)) for s in result.dataset)
    assert got == sorted((p, (i * i).to_bytes(4, "little")) for p in range(3) for i in range(6))


NO_GUARD = """
import sys
from dataset_rt import CacheSet, DatasetRuntime, WriterConfig
from set_helpers import parts

with DatasetRuntime(num_workers=1) as runtime:
    result = runtime.from_cache_sources(
        CacheSet("s", parts(2, 5)), sys.argv[1],
        writer_config=WriterConfig(processes=2, show_progress=False),
    )
    for r in result.results:
        print(type(r).__name__, getattr(r, "message", ""))
"""


def test_a_script_without_the_main_guard_fails_its_parts_instead_of_hanging(tmp_path):
    script = tmp_path / "no_guard.py"
    script.write_text(NO_GUARD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "base")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines] == ["CacheWriteError"] * 3, done
    assert all("before it started" in line and "__main__" in line for line in lines[:2]), lines
    assert "needs the `if __name__" in done.stderr
    assert not (tmp_path / "base" / "s").exists()


def run_build(base: Path, processes: int, delay: float) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import set_helpers, sys; "
            "set_helpers.build(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))",
            str(base),
            str(processes),
            str(delay),
        ],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def descendants(pid: int) -> list[int]:
    return children(pid) + [g for c in children(pid) for g in children(c)]


def assert_no_set_or_a_whole_one(base: Path, fingerprint: str | None) -> None:
    with DatasetRuntime(num_workers=1) as runtime:
        result = runtime.open_caches("s", base)
    if not (base / "s").exists():
        assert kinds(result.results) == ["CacheMissing"]
        return
    assert isinstance(result, CacheSourcesDatasetSuccess), result
    assert result.results == [CacheLoaded("s", base / "s", 180)]
    if fingerprint is not None:
        assert result.dataset.fingerprint == fingerprint


def test_killing_the_parent_at_random_points_leaves_no_set_or_a_whole_one(tmp_path):
    expected = build(tmp_path / "whole", CacheSet("s", parts(6, 30)))
    fingerprint = expected.dataset.fingerprint
    rng = random.Random(26)
    for attempt in range(3):
        base = tmp_path / str(attempt)
        process = run_build(base, 2, 0.02)
        assert process.stdout is not None and process.stdout.readline() == "building\n"
        # Somewhere in the build: while workers start, write parts, or publish.
        wait_until(lambda: False, rng.uniform(0.1, 1.8))
        family = descendants(process.pid)
        assert process.poll() is None, "the build ended before the kill"
        process.kill()
        process.wait()
        process.stdout.close()
        # The workers die with their parent.
        assert wait_until(lambda: all(gone(p) for p in family), 10), family  # noqa: B023
        assert_no_set_or_a_whole_one(base, fingerprint)
        result = build(base, CacheSet("s", parts(6, 30)), processes=2)
        assert isinstance(result, CacheSourcesDatasetSuccess), result
        assert result.dataset.fingerprint == fingerprint


def test_ctrl_c_stops_every_worker_and_publishes_nothing(tmp_path):
    base = tmp_path / "b"
    process = run_build(base, 2, 0.05)
    assert process.stdout is not None and process.stdout.readline() == "building\n"
    staging = base / ".s.set-parts"
    # Once the workers are writing their first parts.
    assert wait_until(
        lambda: staging.exists() and any(".tmp-" in p.name for p in staging.iterdir()), 30
    )
    family = descendants(process.pid)
    os.kill(process.pid, signal.SIGINT)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 3 and out == "interrupted\n", (process.returncode, out)
    assert all(gone(p) for p in family), family
    assert not (base / "s").exists()
    # The workers unwound their writes: no temporary directory is left.
    assert [p.name for p in staging.iterdir() if ".tmp-" in p.name] == []
    result = build(base, CacheSet("s", parts(6, 30)), processes=2)
    assert isinstance(result, CacheSourcesDatasetSuccess)


def test_the_loader_with_two_workers_reads_a_set_in_its_order(reference):
    ref_base, _ = reference
    with DatasetRuntime(num_workers=2) as runtime:
        dataset = runtime.open_caches("s", ref_base, reader_config=ReaderConfig(seed=7)).dataset
        expected = epoch(dataset, 0)
        dataset.set_epoch(0)
        got = []
        with DataLoader(dataset, batch_size=16, num_workers=2) as loader:
            for batch in loader:
                got.extend(
                    (s.metadata["part"], s.metadata["sample_id"], bytes(s.data)) for s in batch
                )
        assert got == expected


def test_one_progress_line_for_the_whole_set(tmp_path, capsys):
    build(tmp_path, CacheSet("s", parts()), processes=2, show_progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) >= 1 and all(line.startswith("s: parts ") for line in lines), lines
    assert lines[-1].startswith("s: parts 4/4 | 160 samples") and "written in" in lines[-1]


@pytest.mark.parametrize("processes", [1, 2])
def test_the_progress_line_of_a_rerun_counts_the_parts_kept(tmp_path, capsys, processes):
    build(tmp_path, CacheSet("s", parts(p1={"fail_at": 3})), processes=processes)
    capsys.readouterr()
    # The rerun keeps parts 0, 2 and 3 and writes part 1: every part is done at the end.
    build(tmp_path, CacheSet("s", parts()), processes=processes, show_progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert lines[-1].startswith("s: parts 4/4 | 40 samples") and "written in" in lines[-1], lines


def test_parts_whose_metadata_columns_disagree_on_a_type_are_not_published(tmp_path):
    mixed = [
        ListSource("p0", [CacheInput(b"a", {"sample_id": 0, "label": 1})]),
        ListSource("p1", [CacheInput(b"b", {"sample_id": 0, "label": "cat"})]),
    ]
    result = build(tmp_path, CacheSet("s", mixed))
    written, set_result = result.results[:2], result.results[-1]
    assert all(isinstance(r, CacheWritten) for r in written), result.results
    assert isinstance(set_result, CacheWriteError), set_result
    assert 'metadata column "label" is str in cache "s.part-000001"' in set_result.message
    assert not (tmp_path / "s").exists()


def test_bad_settings_are_refused_naming_what_is_wrong(tmp_path):
    for bad in (0, -1, True, 1.5, "2", 1025, 2**64):
        with pytest.raises(ConfigError, match=r"invalid WriterConfig\.processes: .* 1 to 1024"):
            WriterConfig(processes=bad)
    with pytest.raises(ConfigError, match="needs at least one part"):
        CacheSet("s", [])
    for not_a_sequence in ("abc", {1: 2}, set(parts(2, 1)), (p for p in parts(2, 1))):
        with pytest.raises(ConfigError, match="parts must be a sequence"):
            CacheSet("s", not_a_sequence)  # type: ignore[arg-type]
    assert len(CacheSet("s", tuple(parts(2, 1)))) == 2
    with pytest.raises(ConfigError, match="cache set's name may have at most"):
        build(tmp_path, CacheSet("s" * 215, parts(1, 1)))
    with pytest.raises(ConfigError, match="two sources are named"):
        build(tmp_path, [CacheSet("s", parts(1, 1)), ListSource("s", [])])
    # A source named like a set's part: refused before either is written.
    with pytest.raises(ConfigError, match='has the name of part 1 of cache set "s"'):
        build(tmp_path, [CacheSet("s", parts(2, 1)), ListSource("s.part-000001", [])])
    assert list(tmp_path.iterdir()) == []

    # A part that cannot be pickled for a worker fails alone.
    unpicklable = ListSource("p", [])
    unpicklable.samples.append(lambda: None)  # type: ignore[arg-type]
    result = build(tmp_path, CacheSet("s", [*parts(2, 3), unpicklable]), processes=2)
    assert kinds(result.results) == [
        "CacheWritten",
        "CacheWritten",
        "CacheWriteError",
        "CacheWriteError",
    ]
    assert "cannot be pickled for a worker process" in result.results[2].message


def test_a_malformed_part_is_reported_and_never_overwritten(tmp_path):
    build(tmp_path, CacheSet("s", parts(3, 5, p1={"fail_at": 2})))
    staging = tmp_path / ".s.set-parts"
    manifest = staging / "s.part-000002" / "manifest.json"
    manifest.chmod(0o644)
    manifest.write_text("{}")
    result = build(tmp_path, CacheSet("s", parts(3, 5)))
    assert kinds(result.results) == [
        "CacheLoaded",
        "CacheWritten",
        "CacheMalformed",
        "CacheWriteError",
    ]
    malformed = result.results[2]
    assert isinstance(malformed, CacheMalformed)
    assert "never overwritten" in malformed.message and "s.part-000002" in malformed.message
    assert manifest.read_text() == "{}"
    assert isinstance(result.results[-1], CacheWriteError)


def test_the_command_line_inspects_verifies_and_views_a_set(reference, tmp_path, capsys):
    ref_base, manifest = reference
    path = str(ref_base / "s")
    assert main(["inspect", path]) == EXIT_OK
    out = capsys.readouterr().out
    assert "cache set:" in out and "parts:       4" in out
    assert manifest["fingerprint"] in out and "s.part-000003" in out
    assert main(["inspect", "--json", path]) == EXIT_OK
    assert json.loads(capsys.readouterr().out) == manifest
    assert main(["verify", path]) == EXIT_OK
    assert capsys.readouterr().out == "OK: 160 samples, 4 shards verified\n"
    page = tmp_path / "view.html"
    assert main(["view", path, "--out", str(page), "--limit", "50"]) == EXIT_OK
    assert "s.part-000001" in page.read_text()
    assert main(["head", path]) == EXIT_USAGE
    assert "is a cache set, not one cache" in capsys.readouterr().err

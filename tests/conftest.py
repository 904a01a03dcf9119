"""Suite-wide pytest hooks.

CI sets ``DATASET_RT_REQUIRE_TORCH=1``. There a skipped test marked ``torch`` means PyTorch is
missing or broken on the CI machine, so the run fails instead of passing with the skip hidden.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_TORCH = os.environ.get("DATASET_RT_REQUIRE_TORCH") == "1"

_torch_tests: set[str] = set()
_skipped_torch_tests: list[str] = []


def pytest_configure(config: pytest.Config) -> None:
    # A module that calls `pytest.importorskip("torch")` at import time is skipped while it is
    # collected, before its markers are known: catch that cause here, up front.
    if REQUIRE_TORCH:
        try:
            import torch  # noqa: F401
        except ImportError as error:
            raise pytest.UsageError(
                f"DATASET_RT_REQUIRE_TORCH=1 but PyTorch cannot be imported ({error}); "
                "install it with `make install`"
            ) from error


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    _torch_tests.update(item.nodeid for item in items if item.get_closest_marker("torch"))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    # An expected failure (xfail) is also reported as skipped: it is not a skip.
    if (
        REQUIRE_TORCH
        and report.skipped
        and not hasattr(report, "wasxfail")
        and report.nodeid in _torch_tests
    ):
        _skipped_torch_tests.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _skipped_torch_tests and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _skipped_torch_tests:
        terminalreporter.section("DATASET_RT_REQUIRE_TORCH=1", sep="=", red=True, bold=True)
        terminalreporter.line(
            f"{len(_skipped_torch_tests)} test(s) marked `torch` were skipped; "
            "CI requires every one of them to run:"
        )
        for nodeid in _skipped_torch_tests:
            terminalreporter.line(f"  {nodeid}")


@pytest.fixture
def runtime():
    """A two-worker `DatasetRuntime`, closed after the test."""
    from dataset_rt import DatasetRuntime

    with DatasetRuntime(num_workers=2) as rt:
        yield rt

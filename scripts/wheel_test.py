"""Installs a dataset-rt wheel into one virtualenv per Python version and runs the smoke suite
(scripts/wheel_smoke.py) with each, from a temporary directory outside the source tree.

Usage: python scripts/wheel_test.py WHEEL [--pythons 3.10 3.11 ...]

Interpreters are looked up in pyenv (`pyenv root`, else ~/.pyenv: the newest versions/X.Y.*),
then as `pythonX.Y` on PATH. A missing one is named; it fails the run when CI=true or
DATASET_RT_REQUIRE_PYTHONS=1 (.ci/run sets it) and is skipped otherwise. The virtualenvs live
under ~/.cache/dataset-rt/wheel-venvs/X.Y (XDG_CACHE_HOME is honoured) and are reused, so a
second run installs the wheel's dependencies from pip's cache or not at all. Exits 1 when any
Python fails, or when none was found.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SMOKE = Path(__file__).with_name("wheel_smoke.py")
# Generous bounds: pip may download the dependencies on the first run.
PIP_TIMEOUT_S = 900
SMOKE_TIMEOUT_S = 300


def pyenv_root() -> Path:
    if shutil.which("pyenv"):
        out = subprocess.run(["pyenv", "root"], capture_output=True, text=True, check=False)
        if out.returncode == 0 and out.stdout.strip():
            return Path(out.stdout.strip())
    return Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))


def find_python(version: str) -> tuple[Path | None, list[str]]:
    """The interpreter for `version` (X.Y), and where it was looked for."""
    versions = pyenv_root() / "versions"
    pattern = re.compile(rf"{re.escape(version)}\.(\d+)")
    candidates = []
    if versions.is_dir():
        for entry in versions.iterdir():
            if (m := pattern.fullmatch(entry.name)) and (entry / "bin" / "python").exists():
                candidates.append((int(m.group(1)), entry / "bin" / "python"))
    if candidates:
        return max(candidates)[1], []
    on_path = shutil.which(f"python{version}")
    looked = [f"{versions}/{version}.*", f"python{version} on PATH"]
    return (Path(on_path) if on_path else None), looked


def venv_dir(version: str) -> Path:
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "dataset-rt" / "wheel-venvs" / version


def run(cmd: list[str | Path], *, timeout: float, **kwargs: object) -> None:
    print("+", " ".join(map(str, cmd)), flush=True)
    subprocess.run(list(map(str, cmd)), check=True, timeout=timeout, **kwargs)  # type: ignore[call-overload]


def clean_env() -> dict[str, str]:
    """This environment without what could import the source tree instead of the wheel."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}


def ensure_venv(python: Path, version: str) -> Path:
    """The reused virtualenv of `version`, (re)created when missing or not of `version`."""
    venv = venv_dir(version)
    vpython = venv / "bin" / "python"
    probe = (
        subprocess.run(
            [str(vpython), "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            check=False,
        )
        if vpython.exists()
        else None
    )
    if probe is None or probe.returncode != 0 or probe.stdout.strip() != version:
        run([python, "-m", "venv", "--clear", venv], timeout=PIP_TIMEOUT_S)
    return vpython


def test_python(wheel: Path, python: Path, version: str) -> None:
    vpython = ensure_venv(python, version)
    env = clean_env()
    # Reinstall the wheel itself every time (its version does not change between builds); its
    # dependencies only when missing.
    run(
        [vpython, "-m", "pip", "uninstall", "--yes", "--quiet", "dataset-rt"],
        timeout=PIP_TIMEOUT_S,
        env=env,
    )
    run([vpython, "-m", "pip", "install", "--quiet", wheel], timeout=PIP_TIMEOUT_S, env=env)
    with tempfile.TemporaryDirectory(prefix="dataset-rt-wheel-test-") as tmp:
        smoke = Path(tmp) / SMOKE.name
        shutil.copyfile(SMOKE, smoke)
        run([vpython, smoke, Path(tmp) / "caches"], timeout=SMOKE_TIMEOUT_S, env=env, cwd=tmp)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--pythons", nargs="+", default=["3.10", "3.11", "3.12", "3.13"])
    args = parser.parse_args()
    wheel = args.wheel.resolve()
    if not wheel.is_file():
        print(f"error: no wheel at {args.wheel}", file=sys.stderr)
        return 1
    in_ci = (
        os.environ.get("CI", "").lower() == "true"
        or os.environ.get("DATASET_RT_REQUIRE_PYTHONS") == "1"
    )

    failed, skipped, passed = [], [], []
    for version in args.pythons:
        print(f"== wheel-test: Python {version}: {wheel.name}", flush=True)
        python, looked = find_python(version)
        if python is None:
            where = ", ".join(looked)
            if in_ci:
                print(f"error: Python {version} not found (looked in {where})", file=sys.stderr)
                failed.append(version)
            else:
                print(
                    f"!! SKIPPED: Python {version} not found (looked in {where}); in CI this fails",
                    file=sys.stderr,
                )
                skipped.append(version)
            continue
        started = time.monotonic()
        try:
            test_python(wheel, python, version)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
            print(f"error: Python {version} ({python}): {e}", file=sys.stderr)
            failed.append(version)
            continue
        passed.append(version)
        print(f"== wheel-test: Python {version} passed in {time.monotonic() - started:.1f} s")

    print(
        f"== wheel-test: passed {passed or 'none'}, failed {failed or 'none'}, "
        f"skipped {skipped or 'none'}"
    )
    return 1 if failed or not passed else 0


if __name__ == "__main__":
    sys.exit(main())

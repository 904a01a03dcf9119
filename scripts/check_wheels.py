"""Checks the release artifacts that `make build-all` writes: one abi3 manylinux wheel per Linux
target and one sdist.

Usage: python scripts/check_wheels.py DIST TARGET...  (TARGET: a Rust target triple such as
x86_64-unknown-linux-gnu). Needs auditwheel (its `show --json`, its manylinux policy table, and
pyelftools and packaging, which it depends on). Exits 1 naming every problem found.
"""

from __future__ import annotations

import argparse
import io
import json
import subprocess
import sys
import tarfile
import zipfile
from importlib import resources
from pathlib import Path

from elftools.elf.dynamic import DynamicSection
from elftools.elf.elffile import ELFFile
from packaging.tags import Tag
from packaging.utils import parse_wheel_filename

# The wheels' tag level, and the ABI every wheel is built for (PyO3's abi3-py310 feature).
MANYLINUX = "manylinux_2_17"  # alias manylinux2014
ABI_TAG = "cp310-abi3"
# ELF machine names (pyelftools' e_machine) of each target's CPU.
ELF_MACHINE = {"x86_64": "EM_X86_64", "aarch64": "EM_AARCH64"}
# glibc's dynamic loader of each CPU: part of every glibc system, so not on the policy's list
# (auditwheel always allows it too).
DYNAMIC_LOADER = {"x86_64": "ld-linux-x86-64.so.2", "aarch64": "ld-linux-aarch64.so.1"}
# Files an sdist must carry to build the extension from source.
SDIST_FILES = ["pyproject.toml", "Cargo.toml", "Cargo.lock", "rust/python/Cargo.toml"]


def allowed_libraries() -> set[str]:
    """The shared libraries a manylinux2014 wheel may need, from auditwheel's policy table."""
    table = json.loads(
        resources.files("auditwheel.policy").joinpath("manylinux-policy.json").read_text()
    )
    (policy,) = [p for p in table if p["name"] == MANYLINUX]
    return set(policy["lib_whitelist"])


def needed_libraries(so: bytes) -> tuple[str, list[str]]:
    """The ELF machine and the DT_NEEDED entries of a shared object."""
    elf = ELFFile(io.BytesIO(so))
    needed = [
        tag.needed  # type: ignore[attr-defined]  # set for DT_NEEDED entries only
        for section in elf.iter_sections()
        if isinstance(section, DynamicSection)
        for tag in section.iter_tags()
        if tag.entry.d_tag == "DT_NEEDED"
    ]
    return elf["e_machine"], needed


def check_wheel(wheel: Path, arch: str, allowed: set[str]) -> list[str]:
    problems = []
    where = wheel.name
    expected = {
        Tag("cp310", "abi3", f"{MANYLINUX}_{arch}"),
        Tag("cp310", "abi3", f"manylinux2014_{arch}"),
    }
    _, _, _, tags = parse_wheel_filename(wheel.name)
    if set(tags) != expected:
        problems.append(
            f"{where}: tags {sorted(map(str, tags))}, expected {sorted(map(str, expected))}"
        )
    with zipfile.ZipFile(wheel) as zf:
        (wheel_meta,) = [n for n in zf.namelist() if n.endswith(".dist-info/WHEEL")]
        meta_tags = {
            line.split(":", 1)[1].strip()
            for line in zf.read(wheel_meta).decode().splitlines()
            if line.startswith("Tag:")
        }
        if meta_tags != set(map(str, expected)):
            problems.append(f"{where}: {wheel_meta} says Tag {sorted(meta_tags)}")
        modules = [n for n in zf.namelist() if n.endswith(".so")]
        if modules != ["dataset_rt/_native.abi3.so"]:
            problems.append(
                f"{where}: shared objects {modules}, expected dataset_rt/_native.abi3.so"
            )
        for name in modules:
            machine, needed = needed_libraries(zf.read(name))
            print(f"{where}: {name}: {machine}, needs {', '.join(needed)}")
            if machine != ELF_MACHINE[arch]:
                problems.append(f"{where}: {name} is built for {machine}, not {ELF_MACHINE[arch]}")
            if outside := sorted(set(needed) - allowed - {DYNAMIC_LOADER[arch]}):
                problems.append(f"{where}: {name} needs {outside}, outside {MANYLINUX}'s libraries")

    show = subprocess.run(
        [sys.executable, "-m", "auditwheel", "show", "--json", str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if show.returncode != 0:
        return [
            *problems,
            f"{where}: auditwheel show failed ({show.returncode}): {show.stderr.strip()}",
        ]
    report = json.loads(show.stdout)
    tag, external = report["overall_tag"], report["external_libs"]
    print(f"{where}: auditwheel: {tag}, external libraries {external}")
    if tag != f"{MANYLINUX}_{arch}":
        problems.append(f"{where}: auditwheel finds it {tag}, not {MANYLINUX}_{arch}")
    if external:
        problems.append(f"{where}: auditwheel finds external libraries {external}")
    return problems


def check_sdist(sdist: Path) -> list[str]:
    with tarfile.open(sdist) as tf:
        names = {n.split("/", 1)[1] for n in tf.getnames() if "/" in n}
    print(f"{sdist.name}: {len(names)} files")
    missing = [f for f in SDIST_FILES if f not in names]
    return [f"{sdist.name}: lacks {missing}"] if missing else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dist", type=Path)
    parser.add_argument("targets", nargs="+", metavar="TARGET")
    args = parser.parse_args()

    allowed = allowed_libraries()
    wheels = sorted(args.dist.glob("*.whl"))
    sdists = sorted(args.dist.glob("*.tar.gz"))
    problems = []
    for target in args.targets:
        arch = target.split("-", 1)[0]
        if arch not in ELF_MACHINE:
            problems.append(f"target {target}: no check known for {arch}")
            continue
        found = [w for w in wheels if w.name.endswith(f"_{arch}.whl")]
        if len(found) != 1:
            problems.append(f"{args.dist}: {len(found)} wheels for {arch}, expected 1: {found}")
            continue
        problems += check_wheel(found[0], arch, allowed)
    if len(wheels) != len(args.targets):
        problems.append(f"{args.dist}: {len(wheels)} wheels for {len(args.targets)} targets")
    if len(sdists) == 1:
        problems += check_sdist(sdists[0])
    else:
        problems.append(f"{args.dist}: {len(sdists)} sdists, expected 1")

    for path in [*wheels, *sdists]:
        print(f"{path.name}: {path.stat().st_size} bytes")
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())

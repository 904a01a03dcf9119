"""Writes a golden cache in the format this DatasetRT writes, for `tests/test_golden_cache.py`.

The committed bytes under `tests/data/golden_vN/golden/` are the test's input: later DatasetRT
versions must keep reading them. Never rerun this to "fix" a failing golden test; run it only to
add the golden set of a new format version next to the others:

    python tests/data/make_golden.py tests/data/golden_vN

Layout of the cache: 6 samples in 2 shards (3 records each), LZ4 with ratio 0.5 so the one
compressible payload (sample 2) is stored compressed and the others raw, and one metadata column
of every type, with NaN, infinities, -0.0, extreme ints, unicode and empty strings.
"""

from __future__ import annotations

import hashlib
import math
import sys
from pathlib import Path

from dataset_rt import (
    CacheInput,
    CacheWritten,
    DatasetRuntime,
    ReaderConfig,
    ShardCompression,
    WriterConfig,
)

NAME = "golden"
# Three of these records fit under the target size, the fourth opens the second shard.
SHARD_SIZE_BYTES = 528


def payload(i: int) -> bytes:
    if i == 2:
        return b"golden v1 compressible payload " * 16  # 496 bytes, LZ4 shrinks it well
    # Hash output does not compress: stored raw. Odd lengths exercise the alignment padding.
    return hashlib.sha256(f"golden-{i}".encode()).digest()[: 20 + i]


METADATA = [
    {"sample_id": "g0", "label": 0, "score": 0.5, "flag": True, "caption": ""},
    {"sample_id": "g1", "label": -(2**63), "score": math.nan, "flag": False, "caption": "café"},
    {"sample_id": "g2", "label": 2**63 - 1, "score": math.inf, "flag": True, "caption": "日本語 ✓"},
    {"sample_id": "g3", "label": 3, "score": -math.inf, "flag": False, "caption": "a\x00b"},
    {"sample_id": "g4", "label": -4, "score": -0.0, "flag": True, "caption": "🙂 emoji"},
    {"sample_id": "g5", "label": 5, "score": 1e-308, "flag": False, "caption": "line\nbreak"},
]


class Golden:
    name = NAME

    def __iter__(self):  # type: ignore[no-untyped-def]
        for i, meta in enumerate(METADATA):
            yield CacheInput(payload(i), meta)


def main(base: Path) -> None:
    if (base / NAME).exists():
        sys.exit(f"{base / NAME} exists; golden caches are never rewritten")
    with DatasetRuntime(num_workers=1) as runtime:
        result = runtime.from_cache_sources(
            Golden(),
            base,
            reader_config=ReaderConfig(shuffle=False, validate_cache=True),
            writer_config=WriterConfig(
                shard_compression=ShardCompression(algo="lz4", ratio=0.5),
                shard_size_bytes=SHARD_SIZE_BYTES,
                show_progress=False,
                validate_cache=True,
            ),
        )
    assert isinstance(result.results[0], CacheWritten), result
    (base / f".{NAME}.lock").unlink()  # the writer's lock file is not part of the cache
    for path in sorted((base / NAME).rglob("*")):
        if path.is_file():
            print(f"{path.relative_to(base)}: {path.stat().st_size} bytes")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent / "golden_v1")

"""The peers' stores: the same payloads written as MosaicML Streaming (MDS) and LitData.

Both writers are imported only when called, so the benchmarks run (and skip these contenders)
where ``pip install '.[bench]'`` has not installed the peers.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import common


def litdata_sample(item: tuple[str, int, int]) -> dict[str, bytes]:
    """LitData's ``optimize`` worker function: one payload read from the flat file."""
    path, start, size = item
    with open(path, "rb") as f:
        f.seek(start)
        return {"data": f.read(size)}


def write_mds(out: Path, payloads: Iterable[bytes | memoryview]) -> None:
    """An uncompressed MDS store in ``out`` (emptied first), one ``bytes`` column ``data``."""
    from streaming import MDSWriter

    common.reset_dir(out)
    with MDSWriter(out=str(out), columns={"data": "bytes"}, compression=None) as w:
        for p in payloads:
            w.write({"data": bytes(p)})


def write_litdata(out: Path, flat: Path, spans: Iterable[tuple[int, int]]) -> None:
    """A LitData store in ``out`` (emptied first) of the ``(start, size)`` spans of ``flat``,
    in order, by two ``optimize`` workers in 64 MB chunks."""
    from litdata import optimize

    common.reset_dir(out)
    optimize(
        fn=litdata_sample,
        inputs=[(str(flat), start, size) for start, size in spans],
        output_dir=str(out),
        chunk_bytes="64MB",
        num_workers=2,
        reorder_files=False,
        verbose=False,
    )

"""The slot side of the ring, as Python sees it (the Rust slot codec writes the slots): maps
of one batch's slot, for a worker (:class:`BatchViews`) and for the training process at
``num_workers=0`` (:class:`SlotMap`). When a slot may be unmapped and reused: :mod:`.lifetimes`."""

from __future__ import annotations

import mmap
import os
from typing import Any

from dataset_rt._loader import lifetimes
from dataset_rt._native import LoaderError

SHM_DIR = "/dev/shm"


def open_ring(name: str) -> int:
    """A descriptor of the ring segment ``name``, whose slots are mapped one batch at a time."""
    return os.open(os.path.join(SHM_DIR, name), os.O_RDWR)


class BatchViews:
    """One batch's zero-copy views. A record the slot references is a slice of this process's
    map of its shard file (the Rust handle's, kept for the process's life); a payload carried in
    the slot (decompressed) is a slice of a Python-owned ``mmap`` of just the slot (abi3 has no
    buffer protocol for Rust), mapped only when the batch has one. Releasing unmaps the slot (a
    worker's case of :mod:`.lifetimes`), so a kept view of it raises ValueError."""

    __slots__ = ("map", "seq", "slot_views", "views", "whole")

    def __init__(self, fd: int, seq: int, slot_offset: int, used: int, entries: list[Any]) -> None:
        self.seq = seq
        self.map: mmap.mmap | None = None
        self.whole: memoryview | None = None
        if any(view is None for *_, view in entries):
            self.map = mmap.mmap(fd, used, offset=slot_offset, access=mmap.ACCESS_READ)
            self.whole = memoryview(self.map)
        self.views: list[memoryview] = []
        # The views of the slot, which releasing unmaps (the others are of shard maps).
        self.slot_views: list[memoryview] = []
        for offset, length, _, view in entries:
            if view is None:
                assert self.whole is not None
                view = self.whole[offset : offset + length]
                self.slot_views.append(view)
            self.views.append(view)

    def release(self) -> None:
        """Raises LoaderError when something still exports the slot (numpy.frombuffer of a
        view, say): the slot is then not handed back."""
        if self.map is None:
            return  # nothing refers to the slot: the shard maps live on with their views
        if lifetimes.unmap_after_collect(self._unmap):
            return
        raise LoaderError(
            f"a view of batch {self.seq} is still exported (for example numpy.frombuffer of "
            "sample.data is alive) when its ring slot must be reused: copy the bytes "
            "(bytes(sample.data), numpy.array(...)) if they must outlive the batch"
        )

    def _unmap(self) -> None:
        assert self.map is not None and self.whole is not None
        # A view released by an earlier attempt may be released again; an exported one raises
        # BufferError, which the caller retries after a collection.
        for view in self.slot_views:
            view.release()
        self.whole.release()
        self.map.close()


class SlotMap:
    """The training process's map of one delivered batch's slot (``num_workers=0``): the batch's
    ``sample.data`` views are slices of it, and it is Python's, so they keep it alive. Released
    or kept by :func:`.lifetimes.hand_back_slots`."""

    __slots__ = ("map", "seq")

    def __init__(self, seq: int, slot_map: mmap.mmap) -> None:
        self.seq = seq
        self.map = slot_map

    def release(self) -> bool:
        """Unmaps the slot unless something still references the map; says whether it did."""
        return lifetimes.unmap_unless_referenced(self.map)

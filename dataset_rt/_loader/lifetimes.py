"""When the loader may reuse memory that Python code can read: the rule, stated once, and the
mechanisms every use calls.

**The rule.** A ring slot, or a range of a worker's result memory, is reused only once no Python
object references its memory. Nothing is ever overwritten under a view, an array or a tensor
that the training loop (or a worker) still holds; nothing waits for the loop to let go either.

How each kind of memory follows it:

- **Result ranges** (``num_workers > 0``, :mod:`.results`): the training process rebuilds a
  result as views of one root array per range. The root lives exactly as long as something of
  the batch does; its death (a ``weakref`` finalizer, :func:`release_on_death`) queues the
  range's offset, which the loop sends back to the worker, whose Rust ``ResultArena`` reuses only
  ranges so returned.
- **Slot maps in the training process** (``num_workers = 0``, :mod:`.slots`, :mod:`.passes`): a
  delivered batch's views are slices of one ``mmap`` of its slot. The map is unmapped only when
  nothing exports it (:func:`unmap_unless_referenced`: the ``mmap``'s own export count). The
  batch delivered last usually is still bound to the loop's variable when the next is asked
  for, so a referenced map waits one more call; a map still referenced then is kept by the user:
  the ring turns its pages into a private copy in place (same address, same bytes) before the
  slot goes back (:func:`hand_back_slots`, which decides release or keep).
- **Slot views in a worker** (:class:`.slots.BatchViews`): valid inside ``transform`` /
  ``collate_fn`` only. The worker unmaps the slot before it is handed back; a view still
  exported then (after one garbage collection, :func:`unmap_after_collect`) is an error,
  never a reuse under it.

The Rust side of the same rule: the ring's release and private copy of a kept map, and the
result arena's free list (``shm``'s ``private_copy.rs`` and ``results.rs``).
"""

from __future__ import annotations

import gc
import importlib
import mmap
import sys
import weakref
from collections.abc import Callable
from typing import Any, Protocol, TypeVar


def release_on_death(root: object, release: Callable[[int], Any], key: int) -> None:
    """Calls ``release(key)`` once ``root`` is gone: ``root`` is the one object every view of a
    range is made from, so its death means nothing references the range any more. The call may
    come at any time (whenever the last reference goes), on the thread that dropped it."""
    weakref.finalize(root, release, key)


def unmap_unless_referenced(mapping: mmap.mmap) -> bool:
    """Unmaps ``mapping`` unless something still exports it (a view, a buffer made from one
    such as ``numpy.frombuffer``); says whether it did."""
    try:
        mapping.close()
    except BufferError:
        return False
    return True


def unmap_after_collect(unmap: Callable[[], None]) -> bool:
    """Runs ``unmap`` (which raises ``BufferError`` while something exports the memory); when it
    raises, collects garbage once (a reference cycle may hold the last view) and tries again.
    Says whether it unmapped."""
    for attempt in range(2):
        try:
            unmap()
            return True
        except BufferError:
            if attempt == 0:
                gc.collect()
    return False


class HeldSlot(Protocol):
    """A delivered batch's slot map in the training process (:class:`.slots.SlotMap`)."""

    @property
    def seq(self) -> int: ...

    @property
    def map(self) -> mmap.mmap: ...

    def release(self) -> bool:
        """:func:`unmap_unless_referenced` of the map."""
        ...


class SlotRing(Protocol):
    """What :func:`hand_back_slots` needs of the ring: hand a slot back, or hand it back after
    making a kept map's pages a private copy."""

    def release(self, ticket: int) -> None: ...

    def release_kept(self, ticket: int, map: mmap.mmap) -> None: ...


Slot = TypeVar("Slot", bound=HeldSlot)


def hand_back_slots(ring: SlotRing, held: Slot | None, kept: Slot | None) -> Slot | None:
    """The release-or-keep decision for the slot maps of ``num_workers = 0``, at each next batch.

    ``kept`` (the batch before last, still referenced at the previous call) goes back now: with
    no copy when nothing references it any more, else after its map became a private copy.
    ``held`` (the batch delivered last) goes back with no copy when nothing references it, else
    it waits one more call: it is returned, the ``kept`` of the next call."""
    if kept is not None:
        if kept.release():
            ring.release(kept.seq)
        else:
            ring.release_kept(kept.seq, kept.map)
    if held is None:
        return None
    if held.release():
        ring.release(held.seq)
        return None
    # release_kept reads the map's address through numpy: have it imported now, before memory
    # may run short, rather than by the first copy.
    if "numpy" not in sys.modules:
        importlib.import_module("numpy")
    return held

"""The shared-memory loader: a Rust producer process fills a ring of batch slots in /dev/shm,
``num_workers`` Python processes run ``transform`` / ``collate_fn`` on zero-copy views of them,
and batches reach the training loop in global order. The ring protocol, the order, the batch
layout, the pass plan and the iterator state are Rust's (reached through ``_native``); this
package starts and watches processes and moves results. Its modules follow the Rust loader's
parts, plus what only Python does:

- :mod:`.plan`: :class:`DataLoader`, its options, and the Rust pass plan it holds (epochs,
  ``set_epoch``, ``state_dict``).
- :mod:`.passes`: one pass in the training process (start, restart with persistent workers,
  waiting with liveness checks, reordering worker results, shutdown).
- :mod:`.producer`: the producer process's isolated launcher and entry (its loop is Rust).
- :mod:`.slots`: maps of one batch's ring slot (the slot codec's Python side).
- :mod:`.lifetimes`: when a slot or a range of result memory may be reused (once nothing
  references it), stated once, and the mechanisms :mod:`.slots`, :mod:`.passes` and
  :mod:`.results` call.
- :mod:`.workers`: the worker processes.
- :mod:`.results`: worker results through shared memory (result regions, skeletons).
- :mod:`.signals`: the children's signal dispositions.
- :mod:`.lifecycle`: bounded stops, SIGKILL and reaping, the interpreter's exit hook, and the
  fork hook after which a forked child can use nothing of its parent's loaders.

Lifetimes of the zero-copy views (``CachedSample.data``, a ``memoryview`` into a slot):

- ``num_workers=0``: valid for as long as anything references them, as with torch, also after
  the loader is closed. Each batch is one ``mmap`` of its slot, and its slot goes back to the
  producer only once the training process no longer references that map (no copy), or, for a
  batch the loop keeps past the next one, after the map's pages became a private copy in place
  (same address and bytes: one copy of each kept batch, so memory grows with what is kept, as
  with torch). A slot is never reused while anything can read it. See :mod:`.lifetimes`.
- ``num_workers>0``: slot views are valid inside ``transform`` / ``collate_fn``. The result's
  own buffers (bytes, bytearray, memoryview, numpy arrays, CPU tensors, ``CachedSample.data``:
  the result itself, or what lies in it through lists, tuples, plain named tuples and dict
  values) are written once by the worker into its result memory before the slot is released
  (:mod:`.results`). The training loop receives views of that memory: numpy arrays and tensors
  (writable), read-only ``memoryview`` for bytes-like leaves (a memoryview keeps its format and
  shape), ``CachedSample`` whose ``data`` is such a view. Everything else (dict keys, and what
  lies in another object's pickled state: a numpy scalar, an object or masked array, a
  dataclass's fields) arrives as pickled, as pickle made it. They stay valid as long as you
  hold them, also after the pass ends: the memory is reused only once nothing references it
  (:mod:`.lifetimes`).
  When held batches fill ``result_bytes``, buffers that do not fit are pickled (one more copy)
  with a ``RuntimeWarning`` once per pass; nothing waits, nothing is overwritten.

Stopping: a pass still open when the interpreter exits is closed by an ``atexit`` hook that runs
before multiprocessing's own (which would SIGTERM the workers and join them without a bound);
see :mod:`.lifecycle`.

The producer's launcher imports :mod:`.producer` without running this ``__init__`` (see there):
keep this file to re-exports.
"""

from dataset_rt._loader.plan import DEFAULT_HEARTBEAT_TIMEOUT, DataLoader

__all__ = ["DEFAULT_HEARTBEAT_TIMEOUT", "DataLoader"]

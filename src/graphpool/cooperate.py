"""Pools that cooperate: before graphpool raises out of memory, the other caches of the
process give their free memory back, and graphpool's own release is a hook others can call
(docs/behaviour.rst, "Pools that cooperate").

Several libraries' caching allocators often share one GPU in one process (PyTorch's, CuPy's,
RMM's), and memory one caches is free to nobody else (pytorch#43144, rmm#501,
dask-cuda#826). When the device refuses graphpool a segment and graphpool's own cache is
already released (its usual retry), each allocator asks ``release_other_caches`` (with its
lock released: the releasers are other libraries' code) and, if they gave any memory back,
tries once more. What is asked, in order:

* CuPy's default memory pool (``cupy.get_default_memory_pool().free_all_blocks()``), when
  the program imported CuPy: its free blocks only. When graphpool is CuPy's allocator
  (``graphpool.cupy.install()``) that pool holds at most what CuPy cached before.
* PyTorch's caching allocator (``torch.cuda.empty_cache()``), when the program imported
  PyTorch, PyTorch has initialized CUDA, and graphpool is not PyTorch's allocator
  (``graphpool.torch.install()`` registers that here: graphpool's own cache was just
  released).
* Every releaser registered with ``register_cache_releaser``: ``fn(device) -> bytes``.

RMM is not asked: its pool resource has no call that gives free memory back to the device
(the pool only grows; rmm#501), so graphpool cannot release it. A program whose RMM
resource can (a resource of its own, or one it can rebuild smaller) registers a releaser.

On by default: it runs only where graphpool would otherwise raise OutOfMemoryError, and
gives back only memory the other caches hold free; their next allocations pay a driver
call again, and ``torch.cuda.empty_cache()`` waits for PyTorch's streams. Off with
``GRAPHPOOL_ALLOC_CONF=release_other_caches:False`` or ``set_release_other_caches(False)``.
Never during a capture (freeing memory then would invalidate it), and never for a
request a limit refused (``set_memory_limit``: other caches cannot raise graphpool's cap).
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable
from typing import Any

from graphpool import _warnings, runtime
from graphpool.errors import CaptureError

Releaser = Callable[[int], "int | None"]
"""A cache's release: ``fn(device) -> bytes given back to the device`` (None: unknown)."""

_log = logging.getLogger("graphpool")
_lock = threading.Lock()
_releasers: list[Releaser] = []
_served: set[str] = set()
"""Frameworks whose allocator graphpool is (their caches are graphpool's: not asked)."""


def serve(framework: str) -> None:
    """An integration made graphpool ``framework``'s allocator ("torch"): its cache is not asked."""
    _served.add(framework)


def register_cache_releaser(fn: Releaser) -> None:
    """Ask ``fn(device)`` to give back cached device memory before graphpool raises out of
    memory on ``device``; it returns the bytes it gave back (None or 0: nothing known). It
    runs with graphpool's locks released, on the allocating thread, and may call graphpool.
    Registered twice, it is asked once."""
    if not callable(fn):
        raise TypeError(f"a cache releaser is a callable fn(device) -> int, not {fn!r}")
    with _lock:
        if fn not in _releasers:
            _releasers.append(fn)


def unregister_cache_releaser(fn: Releaser) -> None:
    """Stop asking ``fn``; ValueError if it was not registered."""
    with _lock:
        try:
            _releasers.remove(fn)
        except ValueError:
            raise ValueError(f"{fn!r} is not a registered cache releaser") from None


def _cupy(device: int) -> int:
    """CuPy's default pool's free blocks, on ``device``; 0 without CuPy."""
    cp: Any = sys.modules.get("cupy")
    get_pool = getattr(cp, "get_default_memory_pool", None)
    if get_pool is None:
        return 0
    pool = get_pool()
    before = int(pool.total_bytes())
    if before == int(pool.used_bytes()):
        return 0
    with cp.cuda.Device(device):
        pool.free_all_blocks()
    return before - int(pool.total_bytes())


def _torch(device: int) -> int:
    """PyTorch's cache (``torch.cuda.empty_cache``); 0 when PyTorch's CUDA is not in use or its
    allocator is graphpool's."""
    if "torch" in _served:
        return 0
    torch: Any = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is None or not cuda.is_initialized():
        return 0
    before = int(cuda.memory_reserved(device))
    if before == int(cuda.memory_allocated(device)):
        return 0
    cuda.empty_cache()
    return before - int(cuda.memory_reserved(device))


def _exports(device: int) -> int:
    """graphpool's own exported blocks that no process holds any more (graphpool.ipc keeps a
    freed export until then, and otherwise looks again only at its own calls)."""
    from graphpool import ipc

    return ipc.reclaim_on(device)


BUILTIN: tuple[tuple[str, Releaser], ...] = (
    ("graphpool's released IPC exports", _exports),
    ("CuPy's default memory pool", _cupy),
    ("PyTorch", _torch),
)
"""The caches asked first, by name."""


def release_other_caches(device: int, nbytes: int = 0) -> int:
    """Ask every other cache to give memory back on ``device`` (the built-in ones, then the
    registered releasers); the bytes they say they gave. A releaser that raises is reported
    (a warning) and the others are asked all the same. ``nbytes``: what graphpool needs (for
    the log). What allocators call before an out-of-memory error (``runtime.releaser``)."""
    with _lock:
        asked: list[tuple[str, Releaser]] = [*BUILTIN, *((repr(fn), fn) for fn in _releasers)]
    total = 0
    for name, fn in asked:
        try:
            got = fn(device)
        except Exception as exc:
            try:
                _warnings.warn(
                    f"graphpool: {name} raised {exc!r} when asked to release cached memory",
                    RuntimeWarning,
                )
            except Exception:  # warnings turned into errors: the next cache is asked all the same
                pass
            continue
        if got:
            total += max(0, int(got))
            _log.info("device %d: %s gave back %d bytes (graphpool needs %d)", device, name, got, nbytes)
    return total


def release_cached_memory(device: object = None) -> int:
    """graphpool's own release, for other libraries to call when they run out of memory
    (``gp.empty_cache()`` on ``device``, or every device with an allocator when None): the
    bytes of reserved memory given back to the device. Never raises for a capture underway
    (it then releases nothing and returns 0)."""
    rt = runtime.get()
    if device is None:
        allocs = [a for a in rt.allocators if a is not None]
    else:
        from graphpool.streams import _index

        allocs = [rt.allocator(_index(device))]
    freed = 0
    for a in allocs:
        before = a.memory_stats()["reserved_bytes.all.current"]
        try:
            a.empty_cache()
        except CaptureError:
            continue
        freed += before - a.memory_stats()["reserved_bytes.all.current"]
    return freed


def set_release_other_caches(on: bool) -> None:
    """Turn cooperation on (the default) or off for every device, now and for allocators made
    later (over ``GRAPHPOOL_ALLOC_CONF``'s ``release_other_caches``)."""
    runtime.set_release_other_caches(on)


runtime.releaser = release_other_caches

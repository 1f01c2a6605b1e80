"""Memory calls of the public API: allocation, statistics, cache control, snapshots, limits
and out-of-memory observers."""

from __future__ import annotations

import operator
import threading
from typing import Any, Final, SupportsFloat, SupportsIndex

from graphpool import ipc, routing, runtime
from graphpool.buffer import _KEY, DeviceBuffer
from graphpool.policy import interrupts, observers
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.limits import check_fraction, check_limit_bytes
from graphpool.policy.private_pools import PoolId, mempools
from graphpool.routing import Entry, Route, keep_current, keep_home, thread_entry
from graphpool.streams import Stream, StreamLike, _index, as_stream, current_stream

_get_ident: Final = threading.get_ident


_Stream: Final = Stream
"""The Stream class, bound once: compiled, the explicit-stream test reads no module global."""

_routes: Final = routing.routes
"""gp.alloc's kept routes (one object for the process's life), bound once: compiled, the fast
path then reads no attribute of the routing module."""


def alloc(nbytes: SupportsIndex, stream: StreamLike | None = None) -> DeviceBuffer:
    """Allocate ``nbytes`` on ``stream``'s device for use on ``stream`` (default: current).

    ``stream`` may be another library's stream (a CuPy stream, or any ``__cuda_stream__``
    object: cuda.core, PyTorch) of the current device. ``nbytes`` 0 gives a null buffer (``ptr`` 0) that holds
    no memory, as CuPy and PyTorch do. ``nbytes`` is typed SupportsIndex so that, compiled,
    the call still reaches the allocator's own size check (a bool is refused, a numpy
    integer accepted).
    """
    # The size as an int, for the buffer and the zero test. An int goes to malloc as it is;
    # any other size object is read once, here, and its int goes to malloc: a second read
    # could answer differently (the buffer would then claim memory its block does not have).
    # malloc validates the value. ``size`` is declared apart from ``nbytes``: compiled, a
    # variable narrowed to int would be unboxed here and boxed again (a new int) for malloc.
    size: SupportsIndex = nbytes
    if type(nbytes) is int:
        n = nbytes
    else:
        n = _size(nbytes)
        size = n
    if stream is None:  # the thread's current stream, and its route kept by an earlier call
        ident = _get_ident()
        cur = _routes.cur
        if cur is None or cur.ident != ident:
            cur = thread_entry()
            if cur is not None:
                _routes.cur = cur
        if cur is None or cur.route.generation != _routes.generation:
            cur = _find_current(ident)
        s = cur.stream
        route = cur.route
    elif isinstance(stream, _Stream):
        s = stream
        seen = _routes.seen
        if seen is not None and seen.stream is s:
            home: Route | None = seen.route
        else:
            home = s._home  # kept by an earlier call with this stream
            if home is not None:
                _routes.seen = Entry(s, home, 0)
        if home is None or home.generation != _routes.generation:
            home = _find_home(s)
        route = home
    else:  # another library's stream (or a wrong object: TypeError), wrapped anew each call
        s = as_stream(stream, "gp.alloc")
        route = Route(s.handle, _stream_allocator(s), -1)  # for this call only: nothing keeps it
    a = route.alloc
    if n == 0:
        return DeviceBuffer(None, 0, s, a, _KEY)
    block = a.malloc_owned(size, stream=route.handle)  # validates the size
    return DeviceBuffer(block, n, s, a, _KEY)


def current_entry() -> Entry:
    """The calling thread's current stream (of its current device) with its route: the lookup
    ``gp.alloc`` writes out inline, for ``CUDAGraph.replay`` (kept routes, routing.py)."""
    ident = _get_ident()
    cur = _routes.cur
    if cur is None or cur.ident != ident:
        cur = thread_entry()
        if cur is not None:
            _routes.cur = cur
    if cur is None or cur.route.generation != _routes.generation:
        cur = _find_current(ident)
    return cur


interrupts.handoff(alloc)  # plain: a guarded handler waits until the block has its buffer (interrupts.py)


def _find_current(ident: int) -> Entry:
    """The calling thread's current stream with its route, found anew and kept."""
    runtime.get()  # made on first use, before the generation is read
    generation = _routes.generation  # read first: a change from now on makes the route stale
    s = current_stream()
    return keep_current(ident, s, Route(s.handle, runtime.allocator(s.device), generation))


def _find_home(s: Stream) -> Route:
    """Where allocations on graphpool Stream ``s`` go, found anew and kept with ``s``;
    BackendReplacedError for a stream of a replaced backend."""
    generation = _routes.generation  # read first, as in _find_current
    return keep_home(s, Route(s.handle, _stream_allocator(s), generation))


def _size(nbytes: Any) -> int:
    """``nbytes`` as an int; TypeError for a bool or a non-integer (as the allocator says)."""
    if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
        raise TypeError(f"size must be an int number of bytes, not {type(nbytes).__name__}")
    return operator.index(nbytes)


def _stream_allocator(s: Stream) -> CachingAllocator:
    """The allocator of ``s``'s device; BackendReplacedError for a stream of a replaced backend."""
    s._check_backend()
    return runtime.allocator(s.device)


def _alloc_of(device: Any) -> CachingAllocator:
    return runtime.allocator(_index(device))


def memory_stats(device: object = None, pool: object = None) -> dict[str, int]:
    """Flattened allocator statistics of ``device``, or of private pool ``pool`` alone."""
    pid = None if pool is None else PoolId.coerce(pool)
    a = _alloc_of(device)
    if pid is not None and pid in mempools:  # a live MemPool's pool: made here if not yet
        a.ensure_pool(pid)
    return a.memory_stats(pid)


def memory_allocated(device: object = None) -> int:
    """Bytes currently handed out (including private pools)."""
    return memory_stats(device)["allocated_bytes.all.current"]


def max_memory_allocated(device: object = None) -> int:
    """Peak of ``memory_allocated`` since start or the last peak reset."""
    return memory_stats(device)["allocated_bytes.all.peak"]


def memory_reserved(device: object = None) -> int:
    """Bytes held from the driver (including private pools)."""
    return memory_stats(device)["reserved_bytes.all.current"]


def max_memory_reserved(device: object = None) -> int:
    """Peak of ``memory_reserved`` since start or the last peak reset."""
    return memory_stats(device)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: object = None) -> None:
    """Set every peak to its current level."""
    _alloc_of(device).reset_peak()


def reset_accumulated_memory_stats(device: object = None) -> None:
    """Zero the accumulated (allocated/freed) counters and the scalar counters."""
    _alloc_of(device).reset_accumulated()


def empty_cache(device: object = None) -> None:
    """Return cached unsplit free segments (ordinary and freeable private pools) to the driver.

    Refused with CaptureError while a capture is underway on the device. Exported buffers
    their owners freed go back to the allocator first if no process holds them any more.
    """
    ipc.reclaim()
    _alloc_of(device).empty_cache()


def memory_snapshot(device: object = None) -> list[dict[str, Any]]:
    """Every segment with its blocks, stream, owning pool and owning graph."""
    return _alloc_of(device).snapshot()


def memory_summary(device: object = None) -> str:
    """A readable table of the main statistics."""
    from graphpool.snapshot import summary

    return summary(_index(device), memory_stats(device))


def check_invariants(device: object = None) -> None:
    """Verify every allocator invariant of ``device``; raises AssertionError if one is broken."""
    _alloc_of(device).check_invariants()


# ------------------------------------------------------------ limits and observers
_limits_lock = runtime.limits_lock  # one setter at a time swaps an allocator's MemoryLimits


def set_per_process_memory_fraction(fraction: SupportsFloat, device: object = None) -> None:
    """Cap the memory graphpool reserves on ``device`` at ``fraction`` of its total memory.

    PyTorch's call and meaning: ``fraction`` is a float in [0, 1] (1.0, the default, leaves
    only the device's own limit; typed SupportsFloat so that, compiled, a wrong type still
    gets graphpool's own TypeError). Checked at every segment allocation, captures included:
    one that would take reserved memory past the cap is refused as the driver refuses one
    on a full device (the cache is released and the allocation retried, then
    OutOfMemoryError names the limit). Memory already reserved stays reserved. Also
    ``GRAPHPOOL_ALLOC_CONF=per_process_memory_fraction:0.5``, for every device.
    """
    value = check_fraction(fraction)
    a = _alloc_of(device)
    with _limits_lock:
        a.limits = a.limits.with_fraction(None if value == 1.0 else value)


def get_per_process_memory_fraction(device: object = None) -> float:
    """The fraction set by ``set_per_process_memory_fraction`` for ``device`` (1.0 if none)."""
    fraction = _alloc_of(device).limits.fraction
    return 1.0 if fraction is None else fraction


def set_memory_limit(nbytes: SupportsIndex | None, device: object = None) -> None:
    """Cap the memory graphpool reserves on ``device`` at ``nbytes`` bytes (None: no cap).

    Enforced as ``set_per_process_memory_fraction`` (the smaller cap binds). Also
    ``GRAPHPOOL_ALLOC_CONF=memory_limit:8GiB``, for every device.
    """
    value = check_limit_bytes(nbytes)
    a = _alloc_of(device)
    with _limits_lock:
        a.limits = a.limits.with_bytes(value)


def get_memory_limit(device: object = None) -> int | None:
    """The byte cap set by ``set_memory_limit`` for ``device``, or None."""
    return _alloc_of(device).limits.nbytes


def attach_out_of_memory_observer(
    observer: observers.Observer,
) -> observers.Observer:
    """Call ``observer(device, requested, stats)`` before every OutOfMemoryError is raised.

    ``device``: the device index; ``requested``: the bytes asked for; ``stats``: that
    device's ``memory_stats()`` at the failure. Called with the allocator's lock released,
    so it may call graphpool (``memory_snapshot()``, freeing, even allocating); an
    out-of-memory error inside an observer calls no observer again. If it raises, the
    exception is reported (a RuntimeWarning, and chained to the OutOfMemoryError, which is
    raised all the same). For every device; returns ``observer`` (usable as a decorator).
    """
    observers.attach(observer)
    return observer


def detach_out_of_memory_observer(observer: observers.Observer) -> None:
    """Stop calling ``observer``; ValueError if it is not attached."""
    observers.detach(observer)

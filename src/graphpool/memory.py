"""Memory calls of the public API: allocation, statistics, cache control, snapshots, limits
and out-of-memory observers."""

from __future__ import annotations

import operator
import os
import threading
from typing import Any, Final, SupportsFloat, SupportsIndex

from graphpool import runtime
from graphpool.buffer import _KEY, DeviceBuffer
from graphpool.policy import observers
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.limits import check_fraction, check_limit_bytes
from graphpool.policy.private_pools import CaptureWorld, PoolId
from graphpool.streams import Stream, StreamLike, _index, as_stream, current_stream


class _Hot:
    """gp.alloc's per-thread fast path (``runtime._tls.hot``): the thread's current stream, its
    handle, its device's allocator, and the capture world of the runtime they belong to.

    A native class when compiled, so the fast path reads typed fields and calls ``malloc``
    directly (benchmarks/NOTES.md, entry 27). Valid while ``world.replaced`` is False:
    ``set_backend`` sets it on the replaced runtime's world before it publishes the new one.
    Every change of device or stream drops the thread's entry.
    """

    __slots__ = ("stream", "handle", "alloc", "world")

    def __init__(self, stream: Stream, handle: int, alloc: CachingAllocator, world: CaptureWorld) -> None:
        self.stream = stream
        self.handle = handle
        self.alloc = alloc
        self.world = world


class _Home:
    """Where ``gp.alloc(n, s)`` allocates for a graphpool Stream ``s`` (``Stream._home``): its
    handle, its device's allocator and the capture world of its runtime, kept by the first
    such call. Valid, as ``_Hot``, while ``world.replaced`` is False (entry 27)."""

    __slots__ = ("handle", "alloc", "world")

    def __init__(self, handle: int, alloc: CachingAllocator, world: CaptureWorld) -> None:
        self.handle = handle
        self.alloc = alloc
        self.world = world


class _Seen:
    """A stream ``gp.alloc`` was given and its ``_Home``, as one object: ``_last.seen`` is
    replaced by a single write, so no reader sees one stream with another's home.

    Compiled, testing it reads native fields, where ``Stream._home`` is an attribute lookup
    on a Python class (benchmarks/NOTES.md, entry 36). The Stream does not point back at it,
    so no reference cycle keeps streams alive (graphpool.cupy drops its streams by refcount);
    only the one stream in ``_last.seen`` is kept, until another stream takes its place or
    ``set_backend`` runs.
    """

    __slots__ = ("stream", "home")

    def __init__(self, stream: Stream, home: _Home) -> None:
        self.stream = stream
        self.home = home


class _Cur:
    """A thread (its ident) and its ``_Hot`` entry, as one object (``_last.cur``)."""

    __slots__ = ("ident", "hot")

    def __init__(self, ident: int, hot: _Hot) -> None:
        self.ident = ident
        self.hot = hot


class _Last:
    """What ``gp.alloc`` used last, any thread's: ``seen``, the stream it was given and its
    home; ``cur``, the thread that asked for its current stream and that thread's ``_Hot``.

    ``cur`` saves reading the thread's ``threading.local`` state (about 300 instructions per
    call, benchmarks/NOTES.md entry 37): a thread ident costs a C call. It always equals the
    thread's own entry: set with it, and dropped whenever any thread's entry is dropped
    (``runtime.drop_hot``), when its thread ends (``_Reaper``), and in a forked child (whose
    new threads may get a dead thread's ident).
    """

    __slots__ = ("seen", "cur")

    def __init__(self) -> None:
        self.seen: _Seen | None = None
        self.cur: _Cur | None = None


_last: Final = _Last()


def _drop_cur() -> None:
    _last.cur = None


class _Reaper:
    """Kept in a thread's state (``runtime._ThreadState.reaper``): collected when the thread
    ends, before its ident can be reused, it drops ``_last.cur`` if that names the thread."""

    __slots__ = ("ident",)

    def __init__(self, ident: int) -> None:
        self.ident = ident

    def __del__(self) -> None:
        try:
            cur = _last.cur
            if cur is not None and cur.ident == self.ident:
                _last.cur = None
        except Exception:  # at interpreter exit the module may be gone: nothing to drop
            pass


def _forget() -> None:
    """Drop both entries (``set_backend`` ran: they may name the old runtime's allocators)."""
    _last.seen = None
    _last.cur = None


runtime.hot_listeners.append(_drop_cur)
runtime.replaced_listeners.append(_forget)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_drop_cur)

_get_ident: Final = threading.get_ident


_Stream: Final = Stream
"""The Stream class, bound once: compiled, the explicit-stream test reads no module global."""

_tls: Final = runtime._tls
"""The runtime's thread state (one object for the process's life), bound once: compiled, the
fast path then reads no attribute of the runtime module."""


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
    if stream is None:
        ident = _get_ident()
        cur = _last.cur
        if cur is not None and cur.ident == ident:
            hot: _Hot | None = cur.hot
        else:
            hot = _tls.hot  # the thread's current stream, handle and allocator, if known
            if hot is not None:
                _last.cur = _Cur(ident, hot)
        if hot is not None and not hot.world.replaced:  # else set_backend ran since
            if n == 0:
                return DeviceBuffer(None, 0, hot.stream, hot.alloc, _KEY)
            a = hot.alloc
            block = a.malloc_owned(size, stream=hot.handle)  # validates the size
            return DeviceBuffer(block, n, hot.stream, a, _KEY)
        world = runtime.get().world  # read first: a set_backend from now on makes the entry stale
        s = current_stream()
        a = runtime.allocator(s.device)
        tls = _tls
        if tls.reaper is None:
            tls.reaper = _Reaper(ident)
        hot = tls.hot = _Hot(s, s.handle, a, world)
        _last.cur = _Cur(ident, hot)
    elif isinstance(stream, _Stream):
        s = stream
        seen = _last.seen
        if seen is not None and seen.stream is s:
            home: _Home | None = seen.home
        else:
            home = s._home  # kept by an earlier call with this stream
            if home is not None:
                _last.seen = _Seen(s, home)
        if home is not None and not home.world.replaced:  # else set_backend ran since
            if n == 0:
                return DeviceBuffer(None, 0, s, home.alloc, _KEY)
            a = home.alloc
            block = a.malloc_owned(size, stream=home.handle)  # validates the size
            return DeviceBuffer(block, n, s, a, _KEY)
        rt = runtime._runtime
        index = s.device
        found = rt.allocators[index] if rt is not None and s._space is rt.space and index < rt.count else None
        if found is not None and rt is not None:
            a = found
            home = s._home = _Home(s.handle, a, rt.world)  # the runtime the allocator belongs to
            _last.seen = _Seen(s, home)  # else a stale entry of s would keep winning
        else:
            a = _stream_allocator(s)
    else:  # another library's stream (or a wrong object: TypeError)
        s = as_stream(stream, "gp.alloc")
        a = _stream_allocator(s)
    if n == 0:
        return DeviceBuffer(None, 0, s, a, _KEY)
    block = a.malloc_owned(size, stream=s.handle)  # validates the size
    return DeviceBuffer(block, n, s, a, _KEY)


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
    return _alloc_of(device).memory_stats(pid)


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

    Refused with CaptureError while a capture is underway on the device.
    """
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

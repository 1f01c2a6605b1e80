"""Memory calls of the public API: allocation, statistics, cache control, snapshots."""

from __future__ import annotations

import operator
from typing import Any, SupportsIndex

from graphpool import runtime
from graphpool.buffer import _KEY, DeviceBuffer
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.private_pools import PoolId
from graphpool.streams import Stream, _index, current_stream


def alloc(nbytes: SupportsIndex, stream: Stream | None = None) -> DeviceBuffer:
    """Allocate ``nbytes`` on ``stream``'s device for use on ``stream`` (default: current).

    ``nbytes`` 0 gives a null buffer (``ptr`` 0) that holds no memory, as CuPy and
    PyTorch do. ``nbytes`` is typed SupportsIndex so that, compiled, the call still reaches
    the allocator's own size check (a bool is refused, a numpy integer accepted).
    """
    # The size as an int, for the buffer and the zero test; ``nbytes`` itself goes to malloc,
    # which validates it (and needs no boxing of a fresh int when compiled).
    n = nbytes if type(nbytes) is int else _size(nbytes)
    if stream is None:
        tls = runtime._tls
        hot = tls.hot  # the thread's current stream, handle and allocator, if known
        if hot is not None:
            s, handle, a, generation = hot
            if generation == runtime._generation:  # else set_backend ran since
                if n == 0:
                    return DeviceBuffer(0, 0, s, a, _KEY)
                ptr = a.malloc(nbytes, stream=handle)  # validates nbytes
                return DeviceBuffer(ptr, n, s, a, _KEY)
        generation = runtime._generation  # read first: a set_backend from now on makes it stale
        s = current_stream()
        a = runtime.allocator(s.device)
        tls.hot = (s, s.handle, a, generation)
    elif isinstance(stream, Stream):
        s = stream
        rt = runtime._runtime
        index = s.device
        found = rt.allocators[index] if rt is not None and s._space is rt.space and index < rt.count else None
        a = found if found is not None else _stream_allocator(s)
    else:
        raise TypeError(f"stream must be a graphpool Stream, not {type(stream).__name__}")
    if n == 0:
        return DeviceBuffer(0, 0, s, a, _KEY)
    ptr = a.malloc(nbytes, stream=s.handle)  # validates nbytes
    return DeviceBuffer(ptr, n, s, a, _KEY)


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

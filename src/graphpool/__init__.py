"""graphpool: a stream-aware caching device allocator with private pools for CUDA graphs.

The public API of SPEC section 1, re-exported explicitly. See README.md for a tour.
"""

from __future__ import annotations

from graphpool import build as _build
from graphpool.buffer import DeviceBuffer
from graphpool.build import compiled
from graphpool.errors import (
    BackendReplacedError,
    BackendUnavailableError,
    CaptureError,
    CUDAError,
    DoubleFreeError,
    ForeignPointerError,
    GraphpoolError,
    OutOfMemoryError,
    ReplayHazardError,
)
from graphpool.graphs import (
    CUDAGraph,
    graph,
    graph_pool_handle,
    replay_checks,
    set_replay_checks,
)
from graphpool.memory import (
    alloc,
    check_invariants,
    empty_cache,
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    memory_summary,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
)
from graphpool.policy.private_pools import PoolId
from graphpool.runtime import set_backend as _set_backend
from graphpool.streams import (
    Event,
    Stream,
    current_device,
    current_stream,
    default_stream,
    device,
    device_count,
    is_current_stream_capturing,
    set_device,
    stream,
    synchronize,
)

__version__ = "0.1.0"


def set_backend(name: str) -> None:
    """Use the "cuda" or the "sim" backend from now on (SPEC section 1)."""
    _set_backend(name)


def backend() -> str:
    """The name of the backend in use: "cuda" or "sim"."""
    from graphpool import runtime

    return runtime.get().name


def make_graphed_callable(fn: object, sample_args: tuple[object, ...]) -> object:
    """Capture ``fn`` once on static copies of ``sample_args``; see graphpool.graphed."""
    from graphpool.graphed import make_graphed_callable as _make

    return _make(fn, sample_args)  # type: ignore[arg-type]


def _warn_if_stale() -> None:
    names = _build.stale()
    if names:
        from graphpool._warnings import warn

        # at the importer's line, not this file's
        warn(
            f"graphpool: {', '.join(names)} changed after they were compiled, and the compiled "
            "modules run instead. Reinstall (pip install -e .), or go pure Python with "
            "GRAPHPOOL_COMPILE=0 pip install -e ."
        )


_warn_if_stale()

__all__ = [
    "BackendReplacedError",
    "BackendUnavailableError",
    "CUDAError",
    "CUDAGraph",
    "CaptureError",
    "DeviceBuffer",
    "DoubleFreeError",
    "Event",
    "ForeignPointerError",
    "GraphpoolError",
    "OutOfMemoryError",
    "PoolId",
    "ReplayHazardError",
    "Stream",
    "alloc",
    "backend",
    "check_invariants",
    "compiled",
    "current_device",
    "current_stream",
    "default_stream",
    "device",
    "device_count",
    "empty_cache",
    "graph",
    "graph_pool_handle",
    "is_current_stream_capturing",
    "make_graphed_callable",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "memory_summary",
    "replay_checks",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_backend",
    "set_device",
    "set_replay_checks",
    "stream",
    "synchronize",
]

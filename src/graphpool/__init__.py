"""graphpool: a stream-aware caching device allocator with private pools for CUDA graphs.

The public API, re-exported explicitly (docs/api.rst). README.md has a tour; docs/behaviour.rst
says exactly how the allocator, the private pools and the replay checker behave.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any, overload

from graphpool import build as _build
from graphpool.buffer import DeviceBuffer
from graphpool.build import compiled
from graphpool.cooperate import (
    register_cache_releaser,
    release_cached_memory,
    set_release_other_caches,
    unregister_cache_releaser,
)
from graphpool.errors import (
    BackendReplacedError,
    BackendUnavailableError,
    CaptureError,
    CaptureRefusedError,
    CUDAError,
    DoubleFreeError,
    ForeignPointerError,
    GraphpoolError,
    IpcError,
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
from graphpool.ipc import IpcBuffer, IpcHandle, open_ipc
from graphpool.memory import (
    alloc,
    attach_out_of_memory_observer,
    check_invariants,
    detach_out_of_memory_observer,
    empty_cache,
    get_memory_limit,
    get_per_process_memory_fraction,
    max_memory_allocated,
    max_memory_reserved,
    memory_allocated,
    memory_reserved,
    memory_snapshot,
    memory_stats,
    memory_summary,
    reset_accumulated_memory_stats,
    reset_peak_memory_stats,
    set_memory_limit,
    set_per_process_memory_fraction,
)
from graphpool.mempool import MemPool, use_mem_pool
from graphpool.pinned import (
    PinnedBuffer,
    alloc_pinned,
    empty_pinned_cache,
    pinned_memory_snapshot,
    pinned_memory_stats,
)
from graphpool.policy import interrupts as _interrupts
from graphpool.policy.private_pools import PoolId
from graphpool.runtime import capture_detection, set_allocator_config, set_capture_detection
from graphpool.runtime import set_backend as _set_backend
from graphpool.snapshot import dump_snapshot, record_memory_history, torch_snapshot
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

if TYPE_CHECKING:
    from graphpool.graphed import GraphedCallable

if PoolId.__doc__ == "mypyc filler docstring":
    # Compiled, mypyc gives a NamedTuple class this filler instead of its docstring (setup.py
    # restores the others at build time); a test keeps this text equal to the source's.
    PoolId.__doc__ = "Identifies a private pool. Exactly one part is non-zero."

__version__ = "0.1.0"


def set_backend(name: str) -> None:
    """Use the "cuda" (a GPU) or the "sim" (simulated device) backend from now on.

    Buffers made before keep their own allocator. Without a call, graphpool picks "cuda"
    when a GPU is usable and "sim" otherwise (environment variable GRAPHPOOL_BACKEND).
    """
    _set_backend(name)


def backend() -> str:
    """The name of the backend in use: "cuda" or "sim"."""
    from graphpool import runtime

    return runtime.get().name


# warmup=3 is graphpool.graphed.WARMUP_ITERATIONS, written out because graphed (and NumPy)
# load only on first use; tests/test_integrations_graphed.py keeps the two equal.
def make_graphed_callable(
    fn: Callable[..., Any],
    sample_args: Sequence[Any],
    *,
    pool: PoolId | tuple[int, int] | None = None,
    warmup: int = 3,
) -> GraphedCallable:
    """Capture ``fn(*sample_args)`` once and return a callable that replays it.

    ``fn`` runs ``warmup`` times (3, as PyTorch) eagerly on a side stream (so lazy initialisation
    happens outside the capture), then is captured on copies of the array arguments
    into a private pool, or into ``pool`` to share one (``graph_pool_handle()``). The
    callable takes arrays of the same shapes and dtypes, copies them into the static
    inputs, replays the graph on the current stream and returns the static outputs:
    the same arrays on every call, overwritten by the next one. Cost of a call: one
    device copy per changed array argument plus one graph launch.
    """
    from graphpool import graphed

    return graphed.GraphedCallable(fn, sample_args, pool=pool, warmup=warmup)


@overload
def make_graphed_callables(
    callables: Callable[..., Any],
    sample_args: Sequence[Any],
    *,
    pool: PoolId | tuple[int, int] | None = None,
    warmup: int = 3,
    num_warmup_iters: int | None = None,
) -> GraphedCallable: ...


@overload
def make_graphed_callables(
    callables: tuple[Callable[..., Any], ...],
    sample_args: tuple[Sequence[Any], ...],
    *,
    pool: PoolId | tuple[int, int] | None = None,
    warmup: int = 3,
    num_warmup_iters: int | None = None,
) -> tuple[GraphedCallable, ...]: ...


def make_graphed_callables(
    callables: Callable[..., Any] | tuple[Callable[..., Any], ...],
    sample_args: Sequence[Any] | tuple[Sequence[Any], ...],
    *,
    pool: PoolId | tuple[int, int] | None = None,
    warmup: int = 3,
    num_warmup_iters: int | None = None,
) -> GraphedCallable | tuple[GraphedCallable, ...]:
    """PyTorch's ``torch.cuda.make_graphed_callables`` forms (forward only).

    ``make_graphed_callables(fn, args)`` is ``make_graphed_callable(fn, args)``.
    ``make_graphed_callables((f, g), ((x,), (y, z)))`` returns ``(graphed_f, graphed_g)``,
    captured in that order into one shared private pool (``pool``, or a new one), which
    costs less memory than a pool each; call them in capture order, as in PyTorch
    (``set_replay_checks("warn")`` reports a replay that breaks it).
    ``num_warmup_iters`` is PyTorch's name for ``warmup``.
    """
    from graphpool.graphed import graph_callables

    return graph_callables(
        callables, sample_args, pool=pool, warmup=warmup, num_warmup_iters=num_warmup_iters
    )


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


def guard_signal_handler(
    handler: Callable[[int, FrameType | None], Any],
) -> Callable[[int, FrameType | None], Any]:
    """``handler`` wrapped so that it never runs in the middle of an allocator call: a signal
    that lands inside one runs the handler right after the call's update is complete.

    Install your own handlers through it, ``signal.signal(signal.SIGALRM,
    gp.guard_signal_handler(on_alarm))``, if they may raise (KeyboardInterrupt, a timeout) or
    call graphpool. Needed in both builds: Python may run a handler between any two bytecodes
    of Python code, which in the plain-Python build is the whole allocator and compiled is the
    code it calls in the middle of an update (the device's, the history's). graphpool installs
    ``guard_signal_handler(signal.default_int_handler)`` for SIGINT itself
    (docs/behaviour.rst, "Interrupts"). Idempotent; ``signal.SIG_DFL``, ``SIG_IGN`` and None
    come back unchanged, anything else not callable is refused (TypeError). The wrapper's
    ``handler`` attribute is the handler it wraps.
    """
    guarded: Callable[[int, FrameType | None], Any] = _interrupts.guard(handler)
    return guarded


def _guard_interrupts() -> None:
    """Guard Python's default SIGINT handler (Ctrl-C, a Jupyter interrupt), now and before each
    IPython cell, so a KeyboardInterrupt never lands mid-update (both builds: compiled, the
    allocator still calls Python code in the middle of its updates, the device's and the
    history's)."""
    _interrupts.guard_default_sigint()
    _interrupts.guard_ipython_cells()


_guard_interrupts()


def _register_ipc_reducer() -> None:
    """Send DeviceBuffers through multiprocessing queues and pipes as IPC handles: they arrive
    as IpcBuffers (as torch.multiprocessing does for CUDA tensors). Plain pickle still refuses."""
    from multiprocessing.reduction import ForkingPickler

    from graphpool.ipc import reduce_buffer

    ForkingPickler.register(DeviceBuffer, reduce_buffer)


_register_ipc_reducer()

__all__ = [
    "BackendReplacedError",
    "BackendUnavailableError",
    "CUDAError",
    "CUDAGraph",
    "CaptureError",
    "CaptureRefusedError",
    "DeviceBuffer",
    "DoubleFreeError",
    "Event",
    "ForeignPointerError",
    "GraphpoolError",
    "IpcBuffer",
    "IpcError",
    "IpcHandle",
    "MemPool",
    "OutOfMemoryError",
    "PinnedBuffer",
    "PoolId",
    "ReplayHazardError",
    "Stream",
    "alloc",
    "alloc_pinned",
    "attach_out_of_memory_observer",
    "backend",
    "capture_detection",
    "check_invariants",
    "compiled",
    "current_device",
    "current_stream",
    "default_stream",
    "detach_out_of_memory_observer",
    "device",
    "device_count",
    "dump_snapshot",
    "empty_cache",
    "empty_pinned_cache",
    "get_memory_limit",
    "get_per_process_memory_fraction",
    "graph",
    "graph_pool_handle",
    "guard_signal_handler",
    "is_current_stream_capturing",
    "make_graphed_callable",
    "make_graphed_callables",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "memory_summary",
    "open_ipc",
    "pinned_memory_snapshot",
    "pinned_memory_stats",
    "record_memory_history",
    "register_cache_releaser",
    "release_cached_memory",
    "replay_checks",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_allocator_config",
    "set_backend",
    "set_capture_detection",
    "set_device",
    "set_memory_limit",
    "set_per_process_memory_fraction",
    "set_release_other_caches",
    "set_replay_checks",
    "stream",
    "synchronize",
    "torch_snapshot",
    "unregister_cache_releaser",
    "use_mem_pool",
]

"""``make_graphed_callable(s)``: capture a function once, then replay it on new inputs.

The function is warmed up on a side stream (so lazy initialisation, kernel loading and
caches happen outside the capture), then captured once on static copies of the sample
arguments into a private pool. The returned callable copies each new argument into its
static input (one device-to-device copy on the current stream), replays the graph on
the current stream, and returns the static outputs: the same array objects on every
call, overwritten by the next call (as with PyTorch's ``make_graphed_callables``).

Arguments are arrays with ``__cuda_array_interface__`` or with ``.data.ptr`` and
``.nbytes`` (CuPy arrays, ``graphpool.sim.xp`` arrays), C-contiguous. Other arguments
(numbers, flags) are captured as constants and must be passed unchanged.

``make_graphed_callables`` takes PyTorch's forms too: one callable with its sample
arguments, or a tuple of callables with a tuple of sample-argument tuples, captured in
order into one shared private pool.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from graphpool import routing, runtime
from graphpool.graphs import CUDAGraph, graph, graph_pool_handle
from graphpool.policy.private_pools import PoolId
from graphpool.streams import Stream, current_stream, stream

WARMUP_ITERATIONS = 3
"""Eager runs before the capture (PyTorch's make_graphed_callables does 3 too)."""

MAX_WARMUP_ITERATIONS = 1000
"""The most eager runs ``warmup`` asks for. PyTorch's ``num_warmup_iters`` is 3 by default,
and its documentation asks for 11 under DistributedDataParallel: a warm-up needs a few runs,
and a count past this one is a mistake (10**18 would run forever), refused up front."""


def _check_warmup(value: object, name: str) -> int:
    """``value`` as a warm-up count: TypeError for a non-int, ValueError outside
    0..MAX_WARMUP_ITERATIONS, each naming the argument ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} is a count of eager runs (an int), not {type(value).__name__}")
    if not 0 <= value <= MAX_WARMUP_ITERATIONS:
        raise ValueError(
            f"{name} is a count of eager runs from 0 to {MAX_WARMUP_ITERATIONS} (PyTorch's default is "
            f"{WARMUP_ITERATIONS}), not {value}"
        )
    return value


def _is_array(x: Any) -> bool:
    data = getattr(x, "data", None)
    return hasattr(x, "__cuda_array_interface__") or (
        hasattr(data, "ptr") and hasattr(x, "nbytes") and hasattr(x, "copy")
    )


def _describe(x: Any) -> tuple[int, int, tuple[int, ...], np.dtype[Any]]:
    """(address, nbytes, shape, dtype) of a C-contiguous device array."""
    data: Any = getattr(x, "data", None)
    if hasattr(data, "ptr") and hasattr(x, "nbytes") and hasattr(x, "shape") and hasattr(x, "dtype"):
        flags = getattr(x, "flags", None)
        if flags is not None and not getattr(flags, "c_contiguous", True):
            raise ValueError("graphed callables take C-contiguous arrays; pass a contiguous copy")
        return int(data.ptr), int(x.nbytes), tuple(x.shape), np.dtype(x.dtype)
    cai = x.__cuda_array_interface__
    shape = tuple(int(n) for n in cai["shape"])
    dtype = np.dtype(cai["typestr"])
    strides = cai.get("strides")
    if strides is not None:
        expected, step = [], dtype.itemsize
        for n in reversed(shape):
            expected.append(step)
            step *= n
        if tuple(strides) != tuple(reversed(expected)) and math.prod(shape) > 1:
            raise ValueError("graphed callables take C-contiguous arrays; pass a contiguous copy")
    return int(cai["data"][0]), math.prod(shape) * dtype.itemsize, shape, dtype


_side_streams: dict[tuple[int, int], Stream] = {}


def _side_stream(device: int) -> Stream:
    """One warm-up stream per device (streams are never destroyed, so reuse it)."""
    key = (runtime.get().generation, device)
    s = _side_streams.get(key)
    if s is None:
        s = _side_streams.setdefault(key, Stream(device))
    return s


class GraphedCallable:
    """What ``make_graphed_callable`` returns: call it like ``fn``; it replays one graph."""

    def __init__(
        self,
        fn: Callable[..., Any],
        sample_args: Sequence[Any],
        *,
        pool: PoolId | tuple[int, int] | None = None,
        warmup: int = WARMUP_ITERATIONS,
    ) -> None:
        _check_warmup(warmup, "warmup")
        if not callable(fn):
            raise TypeError(f"make_graphed_callable needs a callable, not {type(fn).__name__}")
        args = tuple(sample_args)
        arrays = [i for i, a in enumerate(args) if _is_array(a)]
        if not arrays:
            raise TypeError("make_graphed_callable needs at least one device array among sample_args")
        for i in arrays:
            if not callable(getattr(args[i], "copy", None)):
                raise TypeError(
                    f"sample argument {i} ({type(args[i]).__name__}) has no .copy() to make its static copy"
                )
        if any(type(args[i]).__module__.split(".")[0] == "cupy" for i in arrays):
            # graphpool.cupy registers CuPy's stream follower while it is installed (the
            # public API never imports an integration, nor looks one up).
            if not routing.following("cupy"):
                raise RuntimeError(
                    "CuPy arrays need graphpool's CuPy integration for capture (CuPy must launch on "
                    "the capturing stream and allocate from its pool): call graphpool.cupy.install() first"
                )
        device = runtime.current_device_index()

        # Warm up on a side stream that follows the current one, as PyTorch does.
        ambient = current_stream(device)
        side = _side_stream(device)
        side.wait_stream(ambient)
        with stream(side):
            for _ in range(warmup):
                fn(*args)
        ambient.wait_stream(side)

        statics = list(args)
        for i in arrays:
            statics[i] = args[i].copy()
        self._fn = fn
        self._device = device
        self._static_inputs = tuple(statics)
        self._arrays = tuple(arrays)
        self._specs = {i: _describe(statics[i])[1:] for i in arrays}
        self._ptrs = {i: _describe(statics[i])[0] for i in arrays}
        self.graph = CUDAGraph()
        with graph(self.graph, pool=pool):
            out = fn(*self._static_inputs)
        self._outputs = out

    @property
    def static_inputs(self) -> tuple[Any, ...]:
        """The arrays the graph reads; ``__call__`` copies new arguments into them."""
        return self._static_inputs

    @property
    def static_outputs(self) -> Any:
        """What the graph writes: ``fn``'s result at capture, refreshed by every call."""
        return self._outputs

    def __call__(self, *args: Any) -> Any:
        """Copy ``args`` into the static inputs, replay on the current stream, return the outputs."""
        statics = self._static_inputs
        if len(args) != len(statics):
            raise TypeError(f"graphed callable takes {len(statics)} argument(s), got {len(args)}")
        s = current_stream(self._device)
        dev = runtime.get().device(self._device)
        copies: list[tuple[int, int, int]] = []
        for i, (new, static) in enumerate(zip(args, statics, strict=True)):
            if i not in self._specs:
                if new is not static and not _same_constant(new, static):
                    raise ValueError(
                        f"argument {i} was captured as the constant {static!r}; it cannot change to "
                        f"{new!r} (pass arrays for values that change)"
                    )
                continue
            if new is static:
                continue
            if not _is_array(new):
                raise TypeError(f"argument {i} must be a device array, not {type(new).__name__}")
            ptr, nbytes, shape, dtype = _describe(new)
            want_nbytes, want_shape, want_dtype = self._specs[i]
            if shape != want_shape or dtype != want_dtype:
                raise ValueError(
                    f"argument {i} has shape {shape} and dtype {dtype}, but the graph was captured for "
                    f"shape {want_shape} and dtype {want_dtype}; make another graphed callable for it"
                )
            copies.append((self._ptrs[i], ptr, want_nbytes))
        for dst, src, nbytes in copies:
            if nbytes and dst != src:
                dev.memcpy(dst, src, nbytes, s.handle)
        self.graph.replay()
        return self._outputs

    def __repr__(self) -> str:
        name = getattr(self._fn, "__qualname__", repr(self._fn))
        return f"<graphpool graphed {name} ({self.graph.label})>"


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # arrays and odd types compare ambiguously
        return False


def graph_callables(
    callables: Callable[..., Any] | tuple[Callable[..., Any], ...],
    sample_args: Sequence[Any] | tuple[Sequence[Any], ...],
    *,
    pool: PoolId | tuple[int, int] | None = None,
    warmup: int = WARMUP_ITERATIONS,
    num_warmup_iters: int | None = None,
) -> GraphedCallable | tuple[GraphedCallable, ...]:
    """``graphpool.make_graphed_callables``: one callable with its sample arguments gives one
    graphed callable; a tuple of callables and a tuple of their sample-argument tuples gives a
    tuple of graphed callables captured in that order into one shared private pool (``pool``,
    or a new ``graph_pool_handle()``). ``num_warmup_iters`` is PyTorch's name for ``warmup``
    (given, it wins). graphpool/__init__.py gives it its typed overloads and loads this module
    (and NumPy) on the first call only."""
    runs = (
        _check_warmup(warmup, "warmup")
        if num_warmup_iters is None
        else _check_warmup(num_warmup_iters, "num_warmup_iters")
    )
    if not isinstance(callables, tuple):
        return GraphedCallable(callables, sample_args, warmup=runs, pool=pool)
    if not isinstance(sample_args, tuple) or len(sample_args) != len(callables):
        raise TypeError(
            f"make_graphed_callables got {len(callables)} callable(s): pass sample_args as a tuple "
            "with one tuple of sample arguments per callable"
        )
    for i, args in enumerate(sample_args):
        if not isinstance(args, tuple | list):
            raise TypeError(
                f"sample_args[{i}] must be a tuple of callable {i}'s arguments, not {type(args).__name__}"
            )
    shared = graph_pool_handle() if pool is None else PoolId.coerce(pool)
    return tuple(
        GraphedCallable(fn, args, warmup=runs, pool=shared)
        for fn, args in zip(callables, sample_args, strict=True)
    )


make_graphed_callable = GraphedCallable
"""The older name, here, of what ``graphpool.make_graphed_callable`` makes."""
make_graphed_callables = graph_callables
"""The older name, here, of ``graph_callables`` (``graphpool.make_graphed_callables``)."""

__all__ = [
    "MAX_WARMUP_ITERATIONS",
    "WARMUP_ITERATIONS",
    "GraphedCallable",
    "make_graphed_callable",
    "make_graphed_callables",
]

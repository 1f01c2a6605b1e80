"""PyTorch integration: PyTorch's CUDA tensors allocated by graphpool.

``install()`` makes graphpool PyTorch's CUDA allocator, through
``torch.cuda.memory.CUDAPluggableAllocator`` and ``change_current_allocator`` (the way
``rmm.allocators.torch`` plugs RMM in). Every CUDA tensor PyTorch makes is then a graphpool
block on PyTorch's current stream, so a process that mixes PyTorch with CuPy
(``graphpool.cupy.install()``) or Numba keeps one cache, one set of statistics and one
history, and PyTorch's captures get graphpool's capture rules through detection.

PyTorch calls two C functions of a shared library; graphpool's (``graphpool._torch_shim``,
C++, built by the compiled install) take the GIL and call the compiled hooks of
``graphpool.hooks.TorchHooks`` (``hooks()`` below), which keep the route of the stream they
served last, so a run of tensors on one stream goes straight to the allocator's ``malloc``.
A tensor's free parks its block (policy/heap.py, Note [Parking]), and the shim's *lane*
hands a parked block to the next tensor of the same size and stream, and parks it again when
that tensor dies, without Python or the GIL (graphpool.lanes; ``GRAPHPOOL_LANE=0`` turns the
lanes off).
A failed allocation reaches PyTorch as a C++ exception, which PyTorch raises as a
``RuntimeError`` carrying graphpool's message (out of memory included: not
``torch.OutOfMemoryError``).

A pluggable allocator gets neither PyTorch's statistics calls, nor ``empty_cache``, nor
``Tensor.record_stream``; ``install()`` replaces those Python entry points so that they
answer for graphpool (``forward_calls``). What PyTorch still gives up (README, "PyTorch"):
its snapshots (use ``gp.memory_snapshot()``), its graph pools (a ``torch.cuda.graph``
capture is served from a private pool of graphpool's, made by detection, so keep
``gp.set_capture_detection(True)``, the default; PyTorch's ``pool=`` sharing does not reach
graphpool), and the ``recordStream`` calls PyTorch makes inside its C++ (a process group's,
for example). ``install()`` must run before PyTorch's first CUDA allocation and cannot be
undone in the process.
"""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from graphpool import cooperate, lanes, routing, runtime
from graphpool import memory as gp_memory
from graphpool.hooks import Finder, TorchHooks
from graphpool.policy.reports import zero_device_stats
from graphpool.routing import Route
from graphpool.streams import resolve_handle

if TYPE_CHECKING:
    from graphpool.policy.allocator import CachingAllocator

MallocHook = Callable[[int, int, int], int]
"""``malloc(size, device, stream handle) -> address``, as the shim calls it."""
FreeHook = Callable[[int, int, int, int], int]
"""``free(address, size, device, stream handle) -> requested size if parked, else 0``, as the
shim calls it."""

_lock = threading.Lock()
_installed = False
_MALLOC = "graphpool_torch_malloc"
_FREE = "graphpool_torch_free"


def _shim() -> Any:
    """The compiled shim module; RuntimeError naming the fix when the install has none."""
    return lanes.shim("graphpool.torch")


def library_path() -> str:
    """The shared library PyTorch loads (the compiled shim's file)."""
    path = _shim().__file__
    assert path is not None
    return str(path)


def hooks(rt: runtime.Runtime | None = None) -> tuple[MallocHook, FreeHook]:
    """The ``(malloc, free)`` the shim calls, bound to runtime ``rt`` (default: the current one).

    ``malloc(size, device, stream)`` allocates ``size`` bytes for stream handle ``stream`` from
    that runtime's allocator of ``device`` (0 bytes: a null pointer that holds nothing, as
    PyTorch's own allocator gives). After ``set_backend`` replaced that runtime it refuses
    (RuntimeError): PyTorch keeps this allocator for the process, and a replaced backend's
    addresses are not the new one's. ``free(ptr, size, device, stream)`` gives the block back
    to the allocator that made it, whatever runtime is current, queued for its next call
    (``drop``: PyTorch frees from destructors, possibly inside a graphpool call, and a tensor
    dropped during a capture not yet detected is kept for that graph).
    """
    bound = _runtime_of(rt, "hooks")
    h = TorchHooks(_finder(bound), bound.allocator, lanes.binder("graphpool.torch"))
    return h.malloc, h.free


def _runtime_of(rt: object, what: str) -> runtime.Runtime:
    """``rt``, checked to be a graphpool runtime, or the current one for None."""
    if rt is not None and not isinstance(rt, runtime.Runtime):
        raise TypeError(f"{what}(rt): rt must be a graphpool runtime (graphpool.runtime.get()), not {rt!r}")
    return rt if rt is not None else runtime.get()


def _finder(bound: runtime.Runtime) -> Finder:
    """``find(device, PyTorch's stream handle) -> Route`` for runtime ``bound``: refused
    (RuntimeError) once ``set_backend`` replaced it, and for streams graphpool refuses."""

    def find(device: int, stream: int) -> Route:
        generation = routing.routes.generation  # read first: a set_backend from now on makes it stale
        if runtime.get() is not bound:
            raise RuntimeError(
                "graphpool.torch: graphpool's backend was replaced (set_backend) after "
                "graphpool.torch.install(); PyTorch keeps graphpool's allocator for the process, "
                "so keep the backend it was installed under"
            )
        handle = resolve_handle(stream, "graphpool.torch", "PyTorch's current stream")
        return Route(handle, bound.allocator(device), generation)

    return find


def _device_index(torch: Any, device: object) -> int:
    """The CUDA device index PyTorch's memory calls mean by ``device`` (None: the current one)."""
    if device is None:
        return int(torch.cuda.current_device())
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"Expected a cuda device, but got: {d}")
    return int(torch.cuda.current_device()) if d.index is None else int(d.index)


def forward_calls(torch: Any, rt: runtime.Runtime | None = None) -> None:
    """Make PyTorch's own memory calls answer for graphpool (``install()`` does this).

    A pluggable allocator leaves them to PyTorch, which refuses the statistics
    ("CUDAPluggableAllocator does not yet support getDeviceStats"), and drops
    ``Tensor.record_stream`` and ``empty_cache`` without a word. Replaced, in ``torch.cuda``
    and ``torch.cuda.memory``:

    * ``memory_stats`` (and so ``memory_allocated``, ``max_memory_allocated``,
      ``memory_reserved``, ``max_memory_reserved``, ``memory_summary``): graphpool's statistics
      of the device, under PyTorch's key names, which graphpool's are;
    * ``reset_peak_memory_stats``, ``reset_accumulated_memory_stats``: graphpool's;
    * ``empty_cache``: PyTorch's, then graphpool's of every device it allocated on;
    * ``torch.Tensor.record_stream``: PyTorch's, then graphpool's ``record_stream`` on the
      block under the tensor's storage (a storage graphpool did not allocate is left alone,
      as PyTorch's own allocator leaves one it did not make).

    Calls made inside PyTorch's C++ (a process group's ``recordStream``) still reach the
    pluggable allocator and do nothing there.
    """
    bound = _runtime_of(rt, "forward_calls")
    if not hasattr(torch, "Tensor") or not hasattr(getattr(torch, "cuda", None), "memory"):
        raise TypeError(f"forward_calls(torch): torch must be the torch module, not {torch!r}")
    find = _finder(bound)
    cuda, mem = torch.cuda, torch.cuda.memory
    their_empty = mem.empty_cache
    their_record = torch.Tensor.record_stream

    def made(device: object) -> CachingAllocator | None:
        """graphpool's allocator of the device PyTorch means, if it made one (asking makes
        none: a poll of every device would otherwise open a context on each)."""
        index = _device_index(torch, device)
        bound.check_index(index)
        return bound.allocators[index]

    def memory_stats(device: object = None) -> dict[str, int]:
        """PyTorch's ``memory_stats``: graphpool's statistics of the device (all 0 where it
        never allocated), with PyTorch's ``max_split_size`` (-1: none)."""
        a = made(device)
        if a is None:
            stats = zero_device_stats()
            split = runtime.configured_sizes(bound.sizes, runtime.alloc_conf()).max_split_size
        else:
            stats = a.memory_stats()
            split = a.sizes.max_split_size
        stats["max_split_size"] = -1 if split is None else split
        return dict(sorted(stats.items()))

    def reset_peak_memory_stats(device: object = None) -> None:
        """PyTorch's ``reset_peak_memory_stats``, for graphpool's allocator of the device."""
        a = made(device)
        if a is not None:
            a.reset_peak()

    def reset_accumulated_memory_stats(device: object = None) -> None:
        """PyTorch's ``reset_accumulated_memory_stats``, for graphpool's allocator."""
        a = made(device)
        if a is not None:
            a.reset_accumulated()

    def empty_cache() -> None:
        """PyTorch's ``empty_cache``, then graphpool's on every device it allocated on."""
        their_empty()
        if runtime.get() is bound:
            for index, a in enumerate(bound.allocators):
                if a is not None:
                    gp_memory.empty_cache(index)

    def record_stream(self: Any, stream: Any) -> None:
        """PyTorch's ``Tensor.record_stream``, and graphpool's on the storage's block."""
        their_record(self, stream)
        if not self.is_cuda:
            return
        ptr = int(self.untyped_storage().data_ptr())
        device = int(self.device.index)
        a = bound.allocators[device]
        if ptr == 0 or a is None or a.lookup(ptr) is None:
            return  # memory graphpool did not allocate (another library's, by DLPack)
        handle = getattr(stream, "cuda_stream", None)
        if handle is None:  # a torch.Stream (torch.accelerator's), not a torch.cuda.Stream
            handle = torch.cuda.Stream(
                stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type
            ).cuda_stream
        on = getattr(stream, "device_index", device)
        if on != device:
            raise ValueError(
                f"graphpool.torch: record_stream of a tensor of device {device} with a stream of "
                f"device {on}: graphpool's blocks record streams of their own device only"
            )
        a.record_stream(ptr, find(device, int(handle)).handle)

    for owner in (cuda, mem):
        for fn in (memory_stats, reset_peak_memory_stats, reset_accumulated_memory_stats, empty_cache):
            setattr(owner, fn.__name__, fn)
    torch.Tensor.record_stream = record_stream


def install() -> None:
    """Make graphpool PyTorch's CUDA allocator for the rest of the process (idempotent).

    Needs the "cuda" backend and PyTorch with CUDA, and must run before PyTorch allocates
    on the GPU: PyTorch refuses to swap an allocator it has used (RuntimeError, with
    PyTorch's reason).
    """
    global _installed
    with _lock:
        if _installed:
            return
        shim = _shim()
        name = runtime.get().name
        if name != "cuda":
            raise RuntimeError(
                f"graphpool.torch needs the 'cuda' backend, but the {name!r} backend is in use: "
                "call graphpool.set_backend('cuda') first"
            )
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("graphpool.torch.install(): PyTorch sees no CUDA device")
        shim.set_hooks(*hooks(runtime.get()))
        try:
            plugged = torch.cuda.memory.CUDAPluggableAllocator(shim.__file__, _MALLOC, _FREE)
            torch.cuda.memory.change_current_allocator(plugged)
        except Exception as e:
            shim.close("torch")  # (CuPy's hooks in the same shim stay)
            raise RuntimeError(
                f"graphpool.torch.install(): PyTorch refused graphpool's allocator ({e}); "
                "install() must run before PyTorch's first CUDA allocation"
            ) from e
        atexit.register(shim.close)  # tensors PyTorch drops after Python is gone are left alone
        forward_calls(torch, runtime.get())
        cooperate.serve("torch")  # PyTorch's cache is graphpool's: not asked before an OOM
        _installed = True


def is_installed() -> bool:
    """Whether ``install()`` made graphpool PyTorch's allocator in this process."""
    return _installed


installed = is_installed
"""The older name of ``is_installed`` (a question, returning a bool; graphpool.cupy's
``installed`` is a context manager, whence the clearer names)."""

"""The per-allocation entry points graphpool's framework integrations hand to the frameworks.

CuPy (``graphpool.cupy``, through CuPy's ``PythonFunctionAllocator``) and PyTorch
(``graphpool.torch``, through the C++ shim) call ``malloc`` and ``free`` here once per array
or tensor. They name a stream by its raw handle and a block by its address, so these call the
allocator's raw ``malloc`` and ``drop`` directly: no DeviceBuffer, no graphpool Stream
object. A free comes when the framework's array or tensor dies, so it is queued for the next
allocator call (``drop``), as a dropped DeviceBuffer's: that call asks about captures first,
and a block dropped during a capture graphpool has not detected yet is kept for its graph.

Each hook object keeps the route it used last: the framework's (device, raw handle), the
allocator and graphpool's handle for it, and the routing generation read before the route
was found (``routing.routes.generation``, the one rule of graphpool.routing): a run of calls
on one stream costs two int comparisons and a generation test before the allocator's own
malloc. A miss asks ``find(device, raw handle)``, which the integration supplies (its backend
check and ``streams.resolve_handle``, written once, in the integration).

Compiled by mypyc (setup.py), so that the framework's call lands in native code; the plain
Python build runs the same source.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from graphpool import routing
from graphpool.device.protocol import LEGACY_STREAM
from graphpool.policy import interrupts
from graphpool.routing import Route
from graphpool.streams import (
    CU_STREAM_LEGACY,
    CU_STREAM_PER_THREAD,
    Stream,
    cuda_stream_handle,
    current_stream,
)

if TYPE_CHECKING:
    from graphpool.policy.allocator import CachingAllocator

_routes: Final = routing.routes


class Kept:
    """The route a hook used last, for the framework's stream ``raw`` of ``device``."""

    __slots__ = ("device", "raw", "route")

    def __init__(self, device: int, raw: int, route: Route) -> None:
        self.device = device
        self.raw = raw
        self.route = route


Finder = Callable[[int, int], Route]
"""``find(device, raw handle) -> Route``: the integration's slow path (checks included)."""


def give_back(a: CachingAllocator, ptr: int, recent: int, last: Kept | None) -> int:
    """The hooks' one free rule: the block at ``ptr`` goes back to ``a``, parked or queued for
    its next call. Offered for parking (heap.py, Note [Parking]) only if it is the block the
    hooks' malloc handed out last (``recent``: a temporary dropped before the next request,
    which may be the same) and the route they used last is current (no ``set_backend`` or
    other change since: a lane then answers without asking ``find``). Returns what ``park``
    does (the requested size when parked), or 0 when queued (``drop``, without the lock)."""
    if ptr == recent:
        if last is not None and last.route.alloc is a and last.route.generation == _routes.generation:
            return a.park(ptr)
    if a.parking():
        return a.park(ptr, False)  # queued behind the parked block (it is queued first)
    a.drop(ptr)  # queued, as a dropped DeviceBuffer's free (capture rules: CachingAllocator.drop)
    return 0


class CupyHooks:
    """``malloc(size, device)`` and ``free(ptr, device)`` for CuPy's allocator hooks.

    CuPy's ``PythonFunctionAllocator`` calls ``malloc`` and ``free``; the shim's
    ``graphpool_cupy_malloc`` (for CuPy's ``CFunctionAllocator``) reads CuPy's current stream
    in C and calls ``malloc_on``. The stream is CuPy's current stream of the device,
    ``current(device).ptr`` (CuPy's ``get_current_stream``): the allocator CuPy calls is per
    process, its stream per thread and device. ``free`` gives a block back to the allocator
    that made it: the one that serves the device now (``give_back``: parked or queued), or,
    after a ``set_backend``, a replaced one that still holds the block (``retired``).
    ``bind(device, allocator)``, if given, is called once per allocator these hooks use (the
    integration connects the allocator to the shim's lane there).
    """

    __slots__ = ("_current", "_find", "_last", "_allocs", "_retired", "_bind", "_recent")

    def __init__(
        self,
        current: Callable[[int], Any],
        find: Finder,
        bind: Callable[[int, CachingAllocator], object] | None = None,
    ) -> None:
        self._current = current
        self._find = find
        self._last: Kept | None = None
        self._allocs: dict[int, CachingAllocator] = {}
        self._retired: list[CachingAllocator] = []
        self._bind = bind
        self._recent = 0  # the address malloc handed out last

    def malloc(self, size: int, device: int) -> int:
        """``size`` bytes for CuPy's current stream of ``device``: the address."""
        raw: int = self._current(device).ptr
        return self.malloc_on(size, device, raw)

    def malloc_on(self, size: int, device: int, raw: int) -> int:
        """``size`` bytes for CuPy's stream ``raw`` (its handle) of ``device``: the address."""
        last = self._last
        if last is not None and last.raw == raw and last.device == device and size != 0:
            route = last.route
            if route.generation == _routes.generation:
                ptr = route.alloc.malloc(size, stream=route.handle)
                self._recent = ptr
                return ptr
        return self._miss(size, device, raw)

    def _miss(self, size: int, device: int, raw: int) -> int:
        route = self._find(device, raw)  # raises for a refused stream or backend: nothing kept
        a = route.alloc
        old = self._allocs.get(device)
        if old is not a:
            if old is not None and old not in self._retired:
                self._retired.append(old)  # a set_backend replaced it: it may still hold blocks
            self._allocs[device] = a
            if self._bind is not None:
                self._bind(device, a)
        self._last = Kept(device, raw, route)
        if size == 0:
            return 0
        ptr = a.malloc(size, stream=route.handle)
        self._recent = ptr
        return ptr

    def free(self, ptr: int, device: int) -> int:
        """Give back the block at ``ptr`` (CuPy's memory object is being collected): the
        requested size if it was parked, else 0."""
        if self._retired:
            for old in self._retired:
                block = old.lookup(ptr)
                if block is not None and block.allocated:
                    old.free_owned(ptr)
                    return 0
        a = self._allocs.get(device)
        if a is None:
            raise ValueError(f"graphpool.cupy: 0x{ptr:x} on device {device} was not allocated by graphpool")
        return give_back(a, ptr, self._recent, self._last)


class TorchHooks:
    """``malloc(size, device, stream)`` and ``free(ptr, size, device, stream)`` for the PyTorch
    shim, bound to one runtime for the process (PyTorch keeps its allocator): after
    ``set_backend`` ``find`` refuses new allocations, and frees still reach the bound runtime's
    allocators.

    ``free`` offers the allocator to park the block (heap.py, Note [Parking]) when it is the
    one ``malloc`` handed out last (a temporary dropped before the next request: where the
    next request may be the same), and returns its requested size when the allocator parks
    it, so the shim's native lane may hand it out again; 0 otherwise. Other frees are
    queued without the lock (``drop``), behind a parked block if there is one.
    ``bind(device, allocator)``, if given, is called once per allocator these hooks use (the
    integration connects the allocator to the shim's lane there).
    """

    __slots__ = ("_find", "_allocator", "_last", "_allocs", "_bind", "_recent")

    def __init__(
        self,
        find: Finder,
        allocator: Callable[[int], CachingAllocator],
        bind: Callable[[int, CachingAllocator], object] | None = None,
    ) -> None:
        self._find = find
        self._allocator = allocator
        self._last: Kept | None = None
        self._allocs: dict[int, CachingAllocator] = {}
        self._bind = bind
        self._recent = 0  # the address malloc handed out last

    def malloc(self, size: int, device: int, stream: int) -> int:
        """``size`` bytes for PyTorch's stream handle ``stream`` of ``device``: the address."""
        last = self._last
        if last is not None and last.raw == stream and last.device == device and size != 0:
            route = last.route
            if route.generation == _routes.generation:
                ptr = route.alloc.malloc(size, stream=route.handle)
                self._recent = ptr
                return ptr
        route = self._find(device, stream)  # raises for a refused stream or a replaced backend
        self._last = Kept(device, stream, route)
        if self._allocs.get(device) is not route.alloc:
            self._use(device, route.alloc)
        if size == 0:
            return 0
        ptr = route.alloc.malloc(size, stream=route.handle)
        self._recent = ptr
        return ptr

    def _use(self, device: int, a: CachingAllocator) -> None:
        """From now on ``a`` is the allocator of ``device`` these hooks free into."""
        self._allocs[device] = a
        if self._bind is not None:
            self._bind(device, a)

    def free(self, ptr: int, size: int, device: int, stream: int) -> int:
        """Give back the block at ``ptr`` (PyTorch dropped its tensor): parked or queued for the
        next call. Offered for parking only if it is the block malloc handed out last and the
        route last used is current (no ``set_backend`` or other change since: the lane answers
        without asking ``find``). Returns what ``park`` does, or 0."""
        a = self._allocs.get(device)
        if a is None:
            a = self._allocator(device)
            self._use(device, a)
        return give_back(a, ptr, self._recent, self._last)


def protocol_handle(obj: object) -> int:
    """The handle ``obj.__cuda_stream__()`` gives when it answers as cuda.core's protocol
    (version 0) does, ``(0, handle)`` with a non-negative int handle; -1 for anything else,
    when the caller asks ``streams.cuda_stream_handle``, which names what is wrong. The common
    case, compiled: a stream object's handle read on every allocation and free."""
    method = getattr(obj, "__cuda_stream__", None)
    if method is None or not callable(method):
        return -1
    got = method()
    if type(got) is tuple and len(got) == 2:
        version: object = got[0]
        handle: object = got[1]
        if type(version) is int and version == 0 and type(handle) is int and handle >= 0:
            return handle
    return -1


def raw_handle(stream: Any) -> int:
    """The raw ``cudaStream_t`` of a cuda.core Stream or GraphBuilder, any object with the
    ``__cuda_stream__`` protocol, an object with an int-like ``handle``, a graphpool Stream (its
    handle) or a non-negative int. ValueError for a negative int or ``handle``, or a bool,
    TypeError for an object none of these."""
    if isinstance(stream, bool):  # (as cuda_stream_handle refuses it) before the int test:
        # compiled, an int-typed bool is a tagged int, printed as 1 or 0
        raise ValueError(f"a CUDA stream handle is a non-negative int, not {stream!r}")
    if isinstance(stream, int):
        if stream < 0:
            raise ValueError(f"a CUDA stream handle is a non-negative int, not {stream!r}")
        return int(stream)
    if isinstance(stream, Stream):
        return stream.handle
    handle = protocol_handle(stream)  # the common answer
    if handle >= 0:
        return handle
    if getattr(stream, "__cuda_stream__", None) is not None:
        return cuda_stream_handle(stream)  # the error, named as everywhere in graphpool (streams.py)
    attr = getattr(stream, "handle", None)
    if attr is not None:
        value = int(attr)
        if value < 0:  # never a stream; and -1 is ``ResourceHooks.free``'s "none named"
            raise ValueError(
                f"{type(stream).__name__}.handle is {value}: a CUDA stream handle is a non-negative int"
            )
        return value
    raise TypeError(f"cannot tell the CUDA stream of {type(stream).__name__}")


class ResourceHooks:
    """The raw path of cuda.core's ``GraphpoolMemoryResource`` (graphpool.cuda_core) for one
    device: ``allocate(size, stream)`` and ``deallocate(ptr, stream)``, by the stream's handle,
    with the table of the blocks out (address -> the route each was allocated on) and the
    route used last kept (``Kept``), as the CuPy and PyTorch hooks keep theirs. ``find(device,
    raw, name)`` is the integration's slow path (its checks, ``streams.resolve_handle``).
    """

    __slots__ = ("_device", "_find", "blocks", "_last", "_recent")

    def __init__(self, device: int, find: Callable[[int, int, str], Route]) -> None:
        self._device = device
        self._find = find
        self.blocks: dict[int, Route] = {}
        """Address -> the route of each block out."""
        self._last: Kept | None = None
        self._recent = 0  # the address malloc handed out last

    def allocate(self, size: int, stream: object) -> int:
        """``size`` bytes (an int, checked by the caller) for ``stream``: None for graphpool's
        current stream of the device, a graphpool Stream (its backend and device checked at
        every call, as the kept route is keyed by the handle alone, and 0, the legacy stream's,
        is every device's), or anything ``raw_handle`` reads. The address, filed in ``blocks``;
        0 for a size of 0 (nothing filed), after the route's checks."""
        if stream is None:
            raw = current_stream(self._device).handle
        elif isinstance(stream, Stream):
            stream._check_backend()
            if stream.device != self._device:
                raise ValueError(
                    f"GraphpoolMemoryResource of device {self._device}: {stream!r} "
                    f"belongs to device {stream.device}"
                )
            raw = stream.handle
        else:
            raw = raw_handle(stream)
        last = self._last
        if last is not None and last.raw == raw and last.route.generation == _routes.generation:
            route = last.route
        else:  # raises: a refused stream or backend
            route = self._find(self._device, raw, type(stream).__name__)
            self._last = Kept(self._device, raw, route)
        if size == 0:
            return 0
        ptr = route.alloc.malloc(size, stream=route.handle)
        self._recent = ptr
        self.blocks[ptr] = route
        return ptr

    def forget(self, ptr: int) -> None:
        """Give back ``ptr`` at once, handed out but never given to a buffer (its creation failed)."""
        route = self.blocks.pop(ptr, None)
        if route is not None:
            route.alloc.drop(ptr)

    def deallocate(self, ptr: object, stream: object) -> None:
        """Give back the block at address ``int(ptr)``, freed on ``stream`` (None: none named).
        The stream is read (``raw_handle``) before the block leaves the table: a stream that
        cannot be read raises with the block still its buffer's (a later close gives it back)."""
        address = int(ptr)  # type: ignore[call-overload]
        if address == 0:  # a null buffer holds nothing
            return
        self.free(address, -1 if stream is None else raw_handle(stream))

    def free(self, ptr: int, handle: int) -> None:
        """Give back the block at ``ptr``, freed on the stream handle ``handle`` (-1: none named).
        An address not out is ignored (freed already, or a null buffer's). On another stream than
        its own, its reuse waits for that stream's work so far (``defer_free``: no wait_stream,
        which would join a capturing stream to the block's); else ``give_back``. CUDA's legacy
        and per-thread default streams count as the legacy stream (graphpool.cuda_core says why)."""
        route = self.blocks.pop(ptr, None)
        if route is None:
            return
        if handle != -1:
            if handle == CU_STREAM_LEGACY or handle == CU_STREAM_PER_THREAD:
                handle = LEGACY_STREAM
            if handle != route.handle:
                route.alloc.defer_free(ptr, handle)
                return
        give_back(route.alloc, ptr, self._recent, self._last)


# Plain-Python build: a framework's free hands its block to the allocator's queue, and its
# malloc hands the allocator's block to the framework; a guarded signal handler waits until
# the block is there (policy/interrupts.py, "Handoffs").
interrupts.handoff(
    CupyHooks.free,
    TorchHooks.free,
    give_back,
    CupyHooks.malloc,
    CupyHooks.malloc_on,
    CupyHooks._miss,
    TorchHooks.malloc,
    ResourceHooks.allocate,
    ResourceHooks.free,
    ResourceHooks.forget,
)

__all__ = [
    "CupyHooks",
    "Finder",
    "Kept",
    "ResourceHooks",
    "TorchHooks",
    "give_back",
    "protocol_handle",
    "raw_handle",
]

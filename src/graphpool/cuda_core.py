"""cuda.core integration: a ``MemoryResource`` backed by graphpool.

    from graphpool.cuda_core import GraphpoolMemoryResource
    mr = GraphpoolMemoryResource(device_id=0)
    buf = mr.allocate(1 << 20, stream=stream)   # a cuda.core Buffer
    buf.close(stream)                           # back to graphpool's cache

Works with cuda.core 0.x (``cuda.core.experimental``) and 1.x (``cuda.core``), imported
on first use. Allocations are made for the given stream (a cuda.core ``Stream`` or
``GraphBuilder``, anything with ``__cuda_stream__``, or a raw handle), or for
graphpool's current stream when none is given. A buffer deallocated on another stream
than it was allocated for is reused only after that stream's work queued so far.
"""

from __future__ import annotations

import operator
import threading
from typing import TYPE_CHECKING, Any

from graphpool import runtime
from graphpool.framework_captures import CaptureHooks
from graphpool.hooks import ResourceHooks, raw_handle
from graphpool.policy import interrupts
from graphpool.routing import Route, routes
from graphpool.streams import resolve_handle

if TYPE_CHECKING:
    from cuda.core import MemoryResource

_routes = routes
_lock = threading.Lock()
_cls: type[MemoryResource] | None = None

GraphpoolMemoryResource: type[MemoryResource]
"""The resource class, made on first access (it subclasses cuda.core's, so it needs cuda.core)."""


def _cuda_core() -> tuple[Any, Any]:
    """(MemoryResource, Buffer) from cuda.core 1.x, or cuda.core.experimental for 0.x."""
    try:
        from cuda.core import Buffer, MemoryResource
    except ImportError:
        from cuda.core.experimental import Buffer, MemoryResource
    return MemoryResource, Buffer


stream_handle = raw_handle
"""The raw ``cudaStream_t`` of a cuda.core Stream/GraphBuilder, a protocol object or an int
(``hooks.raw_handle``, compiled where graphpool is)."""


def _find(device: int, raw: int, name: str) -> Route:
    """The route for stream handle ``raw`` of ``device``, of the object of type ``name`` (for
    messages): the resource's slow path. The backend checked to be "cuda" and the handle
    resolved as every entry point resolves one (``streams.resolve_handle``: the per-thread
    default stream refused)."""
    generation = _routes.generation  # read first: a set_backend from now on makes it stale
    if runtime.get().name != "cuda":
        raise RuntimeError("GraphpoolMemoryResource needs graphpool's 'cuda' backend")
    handle = resolve_handle(raw, "GraphpoolMemoryResource.allocate", name)
    return Route(handle, runtime.allocator(device), generation)


def _make_class() -> type[MemoryResource]:
    MemoryResource, Buffer = _cuda_core()
    from_handle = getattr(Buffer, "from_handle", None)  # absent in cuda.core 0.1

    class GraphpoolMemoryResource(MemoryResource):  # type: ignore[misc, valid-type]
        """A cuda.core MemoryResource drawing device memory from graphpool's caching allocator.

        Calls the allocator's raw ``malloc`` and ``drop`` with the stream's handle through
        ``hooks.ResourceHooks`` (compiled where graphpool is), as the CuPy and PyTorch hooks
        do: no DeviceBuffer or graphpool Stream per buffer. The route used last is kept, so a
        run of buffers on one stream costs a handle read and two comparisons before the
        allocator's malloc.
        """

        def __init__(self, device_id: int | None = None) -> None:
            super().__init__()
            index = runtime.current_device_index() if device_id is None else int(device_id)
            runtime.get().check_index(index)
            self._device_id = index
            self._hooks = ResourceHooks(index, _find)

        @property
        def _blocks(self) -> dict[int, Route]:
            """The blocks out: address -> the route each was allocated on."""
            return self._hooks.blocks

        def allocate(self, size: int, stream: Any = None) -> Any:
            """A cuda.core ``Buffer`` of ``size`` bytes for ``stream`` (default: graphpool's current)."""
            if type(size) is not int:  # read once, refused as gp.alloc refuses it (a bool, a float)
                if isinstance(size, bool) or not hasattr(size, "__index__"):
                    raise TypeError(f"size must be an int number of bytes, not {type(size).__name__}")
                size = operator.index(size)
            hooks = self._hooks
            ptr = hooks.allocate(size, stream)  # raises: a refused stream, device or backend
            if size == 0:  # a null buffer; nothing to track (all share the address 0)
                if from_handle is not None:
                    return from_handle(0, 0, mr=self)
                return Buffer(0, 0, self)
            try:
                if from_handle is None:
                    return Buffer(ptr, size, self)  # cuda.core 0.1
                if stream is not None and hasattr(stream, "__cuda_stream__"):
                    try:
                        return from_handle(ptr, size, mr=self, stream=stream)
                    except TypeError:  # 0.x: no stream keyword
                        pass
                return from_handle(ptr, size, mr=self)
            except BaseException:
                hooks.forget(ptr)
                raise

        def deallocate(self, ptr: Any, size: int, stream: Any = None) -> None:
            """Return a buffer to graphpool; ``stream``'s work so far finishes before reuse.

            Never waits for the allocator's lock (it may run from a finalizer): the free is
            queued, or parked if it is the block handed out last and the lock is free
            (``hooks.ResourceHooks.free``, ``CachingAllocator.park``). CUDA's
            per-thread default stream (2) is not refused, unlike everywhere else: a
            deallocation cannot fail cleanly (cuda.core deallocates from its buffers'
            finalizers, with the default stream, which is the per-thread one under per-thread
            default streams, and a refusal there leaks the memory). Its handle names the
            calling thread's stream only in this call, and the free is carried out later,
            maybe on another thread; so reuse waits for the legacy default stream instead,
            which CUDA orders after the work queued so far on every blocking stream, every
            thread's per-thread default stream included.
            """
            self._hooks.deallocate(ptr, stream)

        @property
        def is_device_accessible(self) -> bool:
            return True

        @property
        def is_host_accessible(self) -> bool:
            return False

        @property
        def is_managed(self) -> bool:
            return False

        @property
        def device_id(self) -> int:
            return self._device_id

        def __repr__(self) -> str:
            return f"<graphpool.cuda_core.GraphpoolMemoryResource device={self._device_id}>"

    # Both builds (this module is never compiled): between the allocator's answer and the
    # resource's table, a guarded signal handler waits (policy/interrupts.py, "Handoffs"), so a
    # Ctrl-C loses no block.
    interrupts.handoff(GraphpoolMemoryResource.allocate, GraphpoolMemoryResource.deallocate)
    GraphpoolMemoryResource.__module__ = __name__
    GraphpoolMemoryResource.__qualname__ = "GraphpoolMemoryResource"
    return GraphpoolMemoryResource


def resource_class() -> type[MemoryResource]:
    """The ``GraphpoolMemoryResource`` class (defined on first call, importing cuda.core).

    Also hooks cuda.core's ``GraphBuilder`` (``install_hooks``): allocations from the
    resource are then protected inside its captures as graphpool's own are."""
    global _cls
    if _cls is None:
        with _lock:
            if _cls is None:
                _cls = _make_class()
        install_hooks()
    return _cls


def _builder_key(builder: Any) -> tuple[int, int]:
    stream = builder.stream
    device = getattr(getattr(stream, "device", None), "device_id", None)
    index = runtime.current_device_index() if device is None else int(device)
    return index, stream_handle(stream)


_HOOKS = CaptureHooks(
    "begin_building",
    "end_building",
    "cuda.core GraphBuilder capture",
    key=_builder_key,
    active=lambda: runtime.get().name == "cuda",
)
"""cuda.core's ``GraphBuilder.begin_building``/``end_building``, wrapped by ``install_hooks``."""


def install_hooks() -> bool:
    """Register captures begun with cuda.core's ``GraphBuilder`` (idempotent). False when its
    class cannot be patched (an extension type): detection covers such captures."""
    with _lock:
        if _HOOKS.hooked:
            return True
        try:
            from cuda.core import GraphBuilder
        except ImportError:
            try:
                from cuda.core.experimental import GraphBuilder
            except ImportError:
                return False
        return _HOOKS.install(GraphBuilder)


def hooked() -> bool:
    """Whether cuda.core's ``GraphBuilder.begin_building``/``end_building`` are graphpool's
    wrappers now."""
    return _HOOKS.hooked


def uninstall_hooks() -> None:
    """Give cuda.core's GraphBuilder its own methods back."""
    with _lock:
        _HOOKS.uninstall()


def __getattr__(name: str) -> type[MemoryResource]:
    if name == "GraphpoolMemoryResource":
        return resource_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GraphpoolMemoryResource",
    "hooked",
    "install_hooks",
    "resource_class",
    "stream_handle",
    "uninstall_hooks",
]

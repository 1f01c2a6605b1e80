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

import threading
from typing import TYPE_CHECKING, Any

from graphpool import runtime
from graphpool.device.protocol import LEGACY_STREAM
from graphpool.framework_captures import CaptureHooks
from graphpool.memory import alloc
from graphpool.streams import (
    CU_STREAM_LEGACY,
    CU_STREAM_PER_THREAD,
    Stream,
    cuda_stream_handle,
    current_stream,
    resolve_handle,
)

if TYPE_CHECKING:
    from cuda.core import MemoryResource

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


def stream_handle(stream: Any) -> int:
    """The raw ``cudaStream_t`` of a cuda.core Stream/GraphBuilder, a protocol object or an int."""
    if isinstance(stream, int):
        return stream
    if isinstance(stream, Stream):
        return stream.handle
    if getattr(stream, "__cuda_stream__", None) is not None:
        return cuda_stream_handle(stream)  # checked as everywhere in graphpool (streams.py)
    handle = getattr(stream, "handle", None)
    if handle is not None:
        return int(handle)
    raise TypeError(f"cannot tell the CUDA stream of {type(stream).__name__}")


def _make_class() -> type[MemoryResource]:
    MemoryResource, Buffer = _cuda_core()

    class GraphpoolMemoryResource(MemoryResource):  # type: ignore[misc, valid-type]
        """A cuda.core MemoryResource drawing device memory from graphpool's caching allocator."""

        def __init__(self, device_id: int | None = None) -> None:
            super().__init__()
            index = runtime.current_device_index() if device_id is None else int(device_id)
            runtime.get().check_index(index)
            self._device_id = index
            self._buffers: dict[int, Any] = {}

        def _stream(self, stream: Any) -> Stream:
            if stream is None:
                return current_stream(self._device_id)
            if isinstance(stream, Stream):
                return stream
            what = "GraphpoolMemoryResource.allocate"
            handle = resolve_handle(stream_handle(stream), what, type(stream).__name__)
            return Stream._wrap(self._device_id, handle)

        def allocate(self, size: int, stream: Any = None) -> Any:
            """A cuda.core ``Buffer`` of ``size`` bytes for ``stream`` (default: graphpool's current)."""
            if runtime.get().name != "cuda":
                raise RuntimeError("GraphpoolMemoryResource needs graphpool's 'cuda' backend")
            if size == 0:  # a null buffer; nothing to track (all share the address 0)
                if hasattr(Buffer, "from_handle"):
                    return Buffer.from_handle(0, 0, mr=self)
                return Buffer(0, 0, self)
            buf = alloc(size, stream=self._stream(stream))
            ptr = buf.ptr
            self._buffers[ptr] = buf
            try:
                with_stream = stream is not None and hasattr(stream, "__cuda_stream__")
                if with_stream and hasattr(Buffer, "from_handle"):
                    try:
                        return Buffer.from_handle(ptr, size, mr=self, stream=stream)
                    except TypeError:  # 0.x: no stream keyword
                        pass
                if hasattr(Buffer, "from_handle"):
                    return Buffer.from_handle(ptr, size, mr=self)
                return Buffer(ptr, size, self)  # cuda.core 0.1
            except BaseException:
                self._buffers.pop(ptr, None)
                raise

        def deallocate(self, ptr: Any, size: int, stream: Any = None) -> None:
            """Return a buffer to graphpool; ``stream``'s work so far finishes before reuse.

            Never takes the allocator's lock (it may run from a finalizer): the DeviceBuffer
            is dropped and its free is queued. CUDA's per-thread default stream (2) is not
            refused, unlike everywhere else: a deallocation cannot fail cleanly (cuda.core
            deallocates from its buffers' finalizers, with the default stream, which is the
            per-thread one under per-thread default streams, and a refusal there leaks the
            memory). Its handle names the calling thread's stream only in this call, and the
            free is carried out later, maybe on another thread; so reuse waits for the legacy
            default stream instead, which CUDA orders after the work queued so far on every
            blocking stream, every thread's per-thread default stream included.
            """
            if int(ptr) == 0:  # a null buffer holds nothing
                return
            buf = self._buffers.pop(int(ptr), None)
            if buf is None:
                return
            if stream is not None:
                handle = stream_handle(stream)
                if handle in (CU_STREAM_LEGACY, CU_STREAM_PER_THREAD):
                    handle = LEGACY_STREAM  # (graphpool's name of the legacy stream)
                if handle != buf.stream.handle:
                    # Reuse waits for the freeing stream's work, as after record_stream. No
                    # wait_stream: were ``stream`` capturing, the buffer's stream would join it.
                    buf._free_after(handle)
            del buf

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

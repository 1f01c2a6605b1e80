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
from typing import Any

from graphpool import runtime
from graphpool.memory import alloc
from graphpool.streams import Stream, current_stream

_lock = threading.Lock()
_cls: Any = None

GraphpoolMemoryResource: Any
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
    proto = getattr(stream, "__cuda_stream__", None)
    if proto is not None:
        return int(proto()[1])
    if isinstance(stream, Stream):
        return stream.handle
    handle = getattr(stream, "handle", None)
    if handle is not None:
        return int(handle)
    raise TypeError(f"cannot tell the CUDA stream of {type(stream).__name__}")


def _make_class() -> Any:
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
            return Stream._wrap(self._device_id, stream_handle(stream))

        def allocate(self, size: int, stream: Any = None) -> Any:
            """A cuda.core ``Buffer`` of ``size`` bytes for ``stream`` (default: graphpool's current)."""
            if runtime.get().name != "cuda":
                raise RuntimeError("GraphpoolMemoryResource needs graphpool's 'cuda' backend")
            buf = alloc(size, stream=self._stream(stream))
            ptr = buf.ptr
            self._buffers[ptr] = buf
            try:
                if stream is not None and hasattr(stream, "__cuda_stream__"):
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
            is dropped and its free is queued.
            """
            buf = self._buffers.pop(int(ptr), None)
            if buf is None:
                return
            if stream is not None:
                handle = stream_handle(stream)
                if handle != buf.stream.handle:
                    # Later reuse on the buffer's own stream waits for the freeing stream.
                    buf.stream.wait_stream(Stream._wrap(self._device_id, handle))
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


def resource_class() -> Any:
    """The ``GraphpoolMemoryResource`` class (defined on first call, importing cuda.core)."""
    global _cls
    if _cls is None:
        with _lock:
            if _cls is None:
                _cls = _make_class()
    return _cls


def __getattr__(name: str) -> Any:
    if name == "GraphpoolMemoryResource":
        return resource_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GraphpoolMemoryResource", "resource_class", "stream_handle"]

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

from graphpool import _warnings, pinned, runtime
from graphpool.memory import alloc
from graphpool.streams import Stream, cuda_stream_handle, current_stream, resolve_handle

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
            is dropped and its free is queued.
            """
            if int(ptr) == 0:  # a null buffer holds nothing
                return
            buf = self._buffers.pop(int(ptr), None)
            if buf is None:
                return
            if stream is not None:
                handle = stream_handle(stream)
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


_hooked: dict[str, Any] = {}
_adopted: dict[tuple[int, int], Any] = {}


def _builder_key(builder: Any) -> tuple[int, int]:
    stream = builder.stream
    device = getattr(getattr(stream, "device", None), "device_id", None)
    index = runtime.current_device_index() if device is None else int(device)
    return index, stream_handle(stream)


def _begin_building(self: Any, *args: Any, **kwargs: Any) -> Any:
    """cuda.core's ``GraphBuilder.begin_building``, then graphpool registers the capture."""
    out = _hooked["begin_building"](self, *args, **kwargs)
    if runtime.get().name == "cuda":
        key = _builder_key(self)
        try:
            _adopted[key] = runtime.allocator(key[0]).adopt_capture(
                key[1], label=f"cuda.core GraphBuilder on stream 0x{key[1]:x}"
            )
        except Exception as exc:  # never break the user's capture; detection still covers it
            _warnings.warn(f"graphpool could not register the GraphBuilder's capture: {exc}", RuntimeWarning)
        pinned.capture_begun(*key)
    return out


def _end_building(self: Any, *args: Any, **kwargs: Any) -> Any:
    """cuda.core's ``GraphBuilder.end_building``; graphpool stops routing to its pool, which the
    graph keeps until it and every executable made from it are destroyed."""
    try:
        return _hooked["end_building"](self, *args, **kwargs)
    finally:
        key = _builder_key(self)
        rec = _adopted.pop(key, None)
        if rec is not None:
            runtime.allocator(key[0]).end_adopted(rec)
        pinned.capture_ended(*key)


def install_hooks() -> bool:
    """Register captures begun with cuda.core's ``GraphBuilder`` (idempotent). False when its
    class cannot be patched (an extension type): detection covers such captures."""
    with _lock:
        if _hooked:
            return True
        try:
            from cuda.core import GraphBuilder
        except ImportError:
            try:
                from cuda.core.experimental import GraphBuilder
            except ImportError:
                return False
        try:
            begin, end = GraphBuilder.begin_building, GraphBuilder.end_building
            GraphBuilder.begin_building = _begin_building
            GraphBuilder.end_building = _end_building
        except (AttributeError, TypeError):
            return False
        _hooked.update(begin_building=begin, end_building=end, owner=GraphBuilder)
        return True


def uninstall_hooks() -> None:
    """Give cuda.core's GraphBuilder its own methods back."""
    with _lock:
        owner = _hooked.get("owner")
        if owner is not None:
            owner.begin_building = _hooked["begin_building"]
            owner.end_building = _hooked["end_building"]
        _hooked.clear()


def __getattr__(name: str) -> type[MemoryResource]:
    if name == "GraphpoolMemoryResource":
        return resource_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GraphpoolMemoryResource", "install_hooks", "resource_class", "stream_handle", "uninstall_hooks"]

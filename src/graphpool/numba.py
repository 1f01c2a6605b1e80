"""Numba integration: an External Memory Management (EMM) plugin backed by graphpool.

``install()`` calls ``numba.cuda.set_memory_manager(GraphpoolEMMPlugin)``; it must run
before Numba creates its CUDA context (before the first ``cuda.to_device``, kernel
launch, ``cuda.current_context()``...). Alternatively set the environment variable
``NUMBA_CUDA_MEMORY_MANAGER=graphpool.numba`` before Numba starts.

Device allocations then come from graphpool on graphpool's current stream of the
context's device; pinned and mapped host memory stays with Numba (the plugin derives
from ``HostOnlyCUDAMemoryManager``). ``get_ipc_handle`` exports graphpool's segment with
the array's offset in it, so Numba's IPC (``array.get_ipc_handle()``) works as with Numba's
own manager. Numba is imported on first use of the plugin class.
"""

from __future__ import annotations

import ctypes
import threading
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

from graphpool import runtime

if TYPE_CHECKING:
    from numba.cuda import HostOnlyCUDAMemoryManager, MemoryInfo, MemoryPointer
    from numba.cuda.cudadrv.driver import IpcHandle

    from graphpool.buffer import DeviceBuffer

_lock = threading.Lock()
_plugin: type[HostOnlyCUDAMemoryManager] | None = None

GraphpoolEMMPlugin: type[HostOnlyCUDAMemoryManager]
"""The plugin class, made on first access (it subclasses Numba's, so it needs numba)."""


def _make_plugin() -> type[HostOnlyCUDAMemoryManager]:
    """Define the plugin class (needs numba.cuda, hence not at module import)."""
    from numba import cuda

    from graphpool.memory import alloc
    from graphpool.streams import current_stream

    class GraphpoolEMMPlugin(cuda.HostOnlyCUDAMemoryManager):  # type: ignore[misc]
        """Numba EMM plugin: device memory from graphpool's caching allocator."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._buffers: dict[int, DeviceBuffer] = {}

        def _device_index(self) -> int:
            ctx = self.context
            return int(ctx.device.id) if ctx is not None else runtime.current_device_index()

        def memalloc(self, size: int) -> MemoryPointer:
            """``size`` bytes from graphpool on its current stream of the context's device."""
            if runtime.get().name != "cuda":
                raise RuntimeError("graphpool's Numba plugin needs graphpool's 'cuda' backend")
            if size == 0:  # a NULL pointer that owns nothing, as Numba makes for empty arrays
                return cuda.MemoryPointer(self.context, _device_pointer(0), 0)
            buf = alloc(size, stream=current_stream(self._device_index()))
            ptr = buf.ptr
            buffers = self._buffers
            buffers[ptr] = buf

            def finalizer() -> None:
                # Dropping the last reference lets the DeviceBuffer's finalizer queue the free.
                buffers.pop(ptr, None)

            pointer: MemoryPointer = cuda.MemoryPointer(
                self.context, _device_pointer(ptr), size, finalizer=finalizer
            )
            return pointer

        def get_memory_info(self) -> MemoryInfo:
            """The device's (free, total) bytes; graphpool's cache counts as used."""
            free, total = runtime.get().device(self._device_index()).mem_info()
            info: MemoryInfo = cuda.MemoryInfo(free=free, total=total)
            return info

        def get_ipc_handle(self, memory: MemoryPointer) -> IpcHandle:
            """A ``numba.cuda.IpcHandle`` of ``memory``, as Numba's own manager makes one: the
            graphpool segment holding it, exported through graphpool's device (CUDA exports
            whole allocations), and ``memory``'s offset in it. graphpool.IpcError for memory
            graphpool does not share (a captured graph's, an expandable segment's). Numba's
            importers map the memory themselves: keep ``memory`` alive while they use it."""
            from graphpool import ipc

            ptr = int(memory.device_ctypes_pointer.value or 0)
            raw, offset = ipc.export_pointer(runtime.allocator(self._device_index()), ptr)
            return _numba_ipc_handle(memory, raw, offset, self.context)

        def initialize(self) -> None:
            """Make sure graphpool's runtime is up (nothing else to prepare)."""
            runtime.get()

        def reset(self) -> None:
            """Drop every allocation made through this plugin (Numba resets the context)."""
            super().reset()
            self._buffers.clear()

        def defer_cleanup(self) -> AbstractContextManager[None]:
            """Numba's own deferral for host allocations; graphpool's frees are already deferred."""
            cm: AbstractContextManager[None] = super().defer_cleanup()
            return cm

        @property
        def interface_version(self) -> int:
            return 1

    GraphpoolEMMPlugin.__module__ = __name__
    GraphpoolEMMPlugin.__qualname__ = "GraphpoolEMMPlugin"
    return GraphpoolEMMPlugin


def _numba_ipc_handle(memory: MemoryPointer, raw: bytes, offset: int, context: Any) -> IpcHandle:
    """Numba's IpcHandle over CUDA IPC handle bytes ``raw``, in the handle type Numba's driver
    opens (cuda.bindings' CUipcMemHandle; a ctypes array under Numba's old ctypes binding)."""
    import numba.cuda.cudadrv.driver as numba_driver

    from graphpool.errors import IpcError

    if len(raw) != 64:  # the size of CUDA's handle, which the types below hold
        raise IpcError(f"the device's IPC handle has {len(raw)} bytes, not CUDA's 64: Numba cannot take it")
    binding = getattr(numba_driver, "binding", None)
    if getattr(numba_driver, "USE_NV_BINDING", True) and binding is not None:
        handle: Any = binding.CUipcMemHandle()
        ctypes.memmove(int(handle.getPtr()), raw, len(raw))
    else:
        from numba.cuda.cudadrv import drvapi

        handle = drvapi.cu_ipc_mem_handle.from_buffer_copy(raw)
    identity = context.device.get_device_identity() if context is not None else None
    made: IpcHandle = numba_driver.IpcHandle(memory, handle, memory.size, identity, offset=offset)
    return made


def _device_pointer(ptr: int) -> Any:
    """A pointer Numba's MemoryPointer accepts (it converts c_void_p to its binding's type,
    but a c_void_p of 0 has the value None: the null pointer is made in the binding's type)."""
    if ptr == 0:
        from numba.cuda.cudadrv import driver as numba_driver

        binding = getattr(numba_driver, "binding", None)
        if binding is not None and hasattr(binding, "CUdeviceptr"):
            return binding.CUdeviceptr(0)
    return ctypes.c_void_p(ptr)


def plugin_class() -> type[HostOnlyCUDAMemoryManager]:
    """The ``GraphpoolEMMPlugin`` class (defined on first call)."""
    global _plugin
    if _plugin is None:
        with _lock:
            if _plugin is None:
                _plugin = _make_plugin()
    return _plugin


def install() -> None:
    """Make graphpool Numba's device memory manager. Call before Numba makes its context."""
    from numba import cuda

    cuda.set_memory_manager(plugin_class())


def __getattr__(name: str) -> type[HostOnlyCUDAMemoryManager]:
    """``GraphpoolEMMPlugin`` and Numba's ``_numba_memory_manager`` hook, resolved lazily."""
    if name in ("GraphpoolEMMPlugin", "_numba_memory_manager"):
        return plugin_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GraphpoolEMMPlugin", "install", "plugin_class"]

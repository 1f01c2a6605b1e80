"""Simulator twins of CuPy, Numba and cuda.core: small fakes of exactly the framework API
graphpool's integrations touch (src/graphpool/cupy.py, numba.py, cuda_core.py), so CI
runs the integration code itself on the simulator.

The integrations refuse any backend but "cuda" (they drive a real GPU through the
framework). The twins therefore run graphpool on ``SimAsCuda``: the simulator under the
name "cuda". Framework objects live on the same simulated devices: a fake CuPy kernel is
queued on the simulated stream CuPy's current stream names, fake Numba copies go through
the simulated device, fake cuda.core streams are simulated streams.

What each fake reproduces (and the integration relies on):

* CuPy: ``cuda.runtime.getDevice``, ``cuda.Device`` (context manager), per-thread current
  stream per device (``get_current_stream``, ``Stream.use``, ``Stream.null``, ``Stream.ptds``,
  ``ExternalStream``, ``is_capturing``), ``set_allocator``/``get_allocator`` with a default
  pool of CuPy's own (caching, not graphpool's), ``UnownedMemory`` holding its owner,
  ``MemoryPointer``; 1-D arrays allocating through the current allocator and launching
  their kernels on CuPy's current stream (closing over addresses only, as GPU kernels do).
  Pinned memory: ``PinnedMemoryPointer``, ``PinnedMemoryPool`` (CuPy's: a freed buffer goes back
  at once, whatever stream or capture used it), ``set_pinned_memory_allocator``,
  ``alloc_pinned_memory``, ``get_default_pinned_memory_pool``, ``empty_pinned`` (cupyx's),
  ``runtime.memcpyAsync`` and ``CUDARuntimeError``; ``get_default_memory_pool`` with
  ``total_bytes``/``used_bytes``/``free_all_blocks``.
* Numba: ``HostOnlyCUDAMemoryManager`` (the context keyword, ``reset``,
  ``defer_cleanup``), ``set_memory_manager`` instantiating a dummy with ``context=None``
  to read ``interface_version`` as Numba does, ``MemoryPointer`` calling its finalizer
  when collected, ``MemoryInfo``, ``current_context``, ``to_device``,
  ``device_array_like``, ``copy_to_host``/``copy_to_device``.
* cuda.core: an abstract ``MemoryResource``, ``Buffer`` (``from_handle`` with or without a
  ``stream`` keyword, or the 0.1 constructor; ``close(stream)``; deallocation through the
  resource when collected), ``Device(i).set_current/create_stream``, streams with
  ``__cuda_stream__``.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import ctypes
import sys
import threading
import types
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

from graphpool import runtime
from graphpool.device.protocol import CAPTURE_STATUS_NONE
from graphpool.sim import SimBackend


class SimAsCuda(SimBackend):
    """The simulator under the name "cuda", so the integrations accept it."""

    name = "cuda"


def torch_shim_or_skip() -> Any:
    """graphpool's compiled PyTorch shim module; the test is skipped on the plain-Python
    install (which has none), and fails on the compiled one if the shim is missing."""
    import graphpool as gp
    import graphpool.torch as gtorch

    try:
        return gtorch._shim()
    except RuntimeError as e:
        if gp.compiled():  # the compiled install builds the shim with the policy
            raise
        pytest.skip(f"plain-Python install: no PyTorch shim ({e})")


CaptureQuery = Callable[[Any, Any], int]
"""A capture query as the shim's lane calls it: ``query(stream, out) -> 0`` with ``out[0]``
the capture's id (0: none)."""


@contextlib.contextmanager
def lane_query_from(shim: Any, query: CaptureQuery, device: int = 0) -> Iterator[None]:
    """Inside the block the shim's lane of ``device`` asks ``query`` (Python, through ctypes)
    whether a stream captures; after it, the device's own query again."""
    fn = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.POINTER(ctypes.c_ulonglong))(query)
    shim.lane_query(device, ctypes.cast(fn, ctypes.c_void_p).value)
    try:
        yield
    finally:
        shim.lane_query(device, runtime.get().device(device).capture_query_address())


def counting_query(asked: list[int]) -> CaptureQuery:
    """A capture query that notes each stream it is asked about and says none captures."""

    def query(stream: int | None, out: Any) -> int:
        asked.append(stream or 0)
        out[0] = 0
        return 0

    return query


def use_sim_as_cuda() -> None:
    runtime.set_backend("cuda", backend=SimAsCuda())


def _sim(device: int) -> Any:
    return runtime.get().device(device)


# =============================================================================== CuPy
CUPY_C_MALLOC = ctypes.PYFUNCTYPE(ctypes.c_ssize_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
"""CuPy's ``CFunctionAllocator`` malloc, called as CuPy's Cython calls it: the GIL held, and
an exception the function sets raised."""
CUPY_C_FREE = ctypes.PYFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int)
"""CuPy's ``CFunctionAllocator`` free, called the same way."""


def make_capsule(address: int, name: bytes) -> Any:
    """A ``PyCapsule`` of the C function at ``address`` named ``name`` (as Cython exports one in
    a module's ``__pyx_capi__``). ``name`` must outlive the capsule: the caller keeps it."""
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    return new_capsule(address, name, None)


def make_cupy(python_function_allocator: bool = True, c_function_allocator: bool = True) -> types.ModuleType:
    """A fresh fake ``cupy`` module (its own per-thread state and default pool).

    ``python_function_allocator``: whether it has ``cuda.memory.PythonFunctionAllocator``, as
    CuPy 9 and later do; graphpool.cupy uses it where present, and its own ``malloc``
    elsewhere. ``c_function_allocator`` (with it): whether it also has CuPy's
    ``CFunctionAllocator`` and exports ``get_current_stream_ptr`` in
    ``cuda.stream.__pyx_capi__``, which graphpool.cupy uses where its compiled shim is
    installed (by default: ``use_c_allocator``; ``GRAPHPOOL_CUPY_C=0`` opts out). The
    twin calls the C functions with the GIL held, as CuPy's Cython does, and raises the
    exception a failed malloc sets."""
    cp = types.ModuleType("cupy")
    cuda = types.ModuleType("cupy.cuda")
    cp.cuda = cuda  # type: ignore[attr-defined]
    cp.__version__ = "0-twin"  # type: ignore[attr-defined]
    tls = threading.local()

    def _device() -> int:
        return getattr(tls, "device", 0)

    class CUDARuntimeError(RuntimeError):
        def __init__(self, status: int) -> None:
            super().__init__(f"CUDA runtime error {status}")
            self.status = status

    class _Runtime:
        errorMemoryAllocation = 2
        memcpyDefault = 4

        @staticmethod
        def getDevice() -> int:
            return _device()

        @staticmethod
        def memcpyAsync(dst: int, src: int, size: int, kind: int, stream: int) -> None:
            """cudaMemcpyAsync (a pinned host side included: the simulator's ``memcpy_host``)."""
            _sim(_device()).memcpy_host(dst, src, size, stream)

    _Runtime.CUDARuntimeError = CUDARuntimeError  # type: ignore[attr-defined]

    class Device:
        def __init__(self, device: int = 0) -> None:
            self.id = int(device)
            self._prev: list[int] = []

        def use(self) -> None:
            tls.device = self.id

        def __enter__(self) -> Device:
            self._prev.append(_device())
            tls.device = self.id
            return self

        def __exit__(self, *exc: object) -> None:
            tls.device = self._prev.pop()

    class Stream:
        null: Stream
        ptds: Stream

        def __init__(self, null: bool = False, non_blocking: bool = False, ptr: int | None = None) -> None:
            if ptr is not None:
                self.ptr = int(ptr)
                self.device_id = _device()
            elif null:
                self.ptr = 0
                self.device_id = -1
            else:
                self.device_id = _device()
                self.ptr = _sim(self.device_id).create_stream()
                self._made = True  # CuPy destroys the streams it made when they are collected
            self._prev: list[Stream] = []

        def __del__(self) -> None:
            if getattr(self, "_made", False):
                try:
                    _sim(self.device_id).destroy_stream(self.ptr)
                except Exception:  # (CuPy ignores a failed destroy in its deallocator too)
                    pass

        def use(self) -> Stream:
            streams = getattr(tls, "streams", None)
            if streams is None:
                streams = tls.streams = {}
            streams[_device()] = self
            return self

        def __enter__(self) -> Stream:
            self._prev.append(get_current_stream())
            return self.use()

        def __exit__(self, *exc: object) -> None:
            self._prev.pop().use()

        def _dev(self) -> Any:
            return _sim(_device() if self.device_id < 0 else self.device_id)

        def is_capturing(self) -> bool:
            return bool(self._dev().capture_info(self.ptr)[0] != CAPTURE_STATUS_NONE)

        def begin_capture(self, mode: Any = None) -> None:
            """CuPy's: relaxed mode by default; the legacy stream is refused."""
            if self.ptr == 0:
                raise RuntimeError("cannot capture on the default (legacy) stream")
            self._dev().begin_capture(self.ptr, 2 if mode is None else mode)

        def end_capture(self) -> Graph:
            dev = self._dev()
            return Graph(dev, dev.end_capture(self.ptr))

        def synchronize(self) -> None:
            self._dev().stream_synchronize(self.ptr)

        def __eq__(self, other: object) -> bool:
            return isinstance(other, Stream) and other.ptr == self.ptr

        def __hash__(self) -> int:
            return hash(self.ptr)

    Stream.null = Stream(null=True)
    Stream.ptds = Stream(ptr=2)  # CUDA's per-thread default stream (cudaStreamPerThread)
    Stream.ptds.device_id = -1

    class Graph:
        """CuPy's Graph: owns the graph and its executable, destroys both when collected."""

        def __init__(self, dev: Any, graph: int) -> None:
            self._dev, self.graph = dev, graph
            self.exec = dev.instantiate(graph)

        def launch(self, stream: Stream | None = None) -> None:
            s = get_current_stream() if stream is None else stream
            self._dev.launch(self.exec, s.ptr)

        def __del__(self) -> None:
            self._dev.destroy_graph_exec(self.exec)
            self._dev.destroy_graph(self.graph)

    class Memory:
        """CuPy's Memory; only the null one (size 0) is made here."""

        def __init__(self, size: int) -> None:
            if size:
                raise NotImplementedError("the twin makes only null Memory")
            self.ptr, self.size, self.device_id = 0, 0, _device()

    def ExternalStream(ptr: int, device_id: int = -1) -> Stream:
        s = Stream(ptr=ptr)
        if device_id >= 0:
            s.device_id = device_id
        return s

    def get_current_stream(device_id: int | None = None) -> Stream:
        device = _device() if device_id is None else device_id
        return getattr(tls, "streams", {}).get(device, Stream.null)

    class UnownedMemory:
        def __init__(self, ptr: int, size: int, owner: Any, device_id: int | None = None) -> None:
            self.ptr = int(ptr)
            self.size = int(size)
            self._owner = owner
            self.device_id = _device() if device_id is None else device_id

    class MemoryPointer:
        def __init__(self, mem: Any, offset: int) -> None:
            self.mem = mem
            self.ptr = mem.ptr + offset
            self.device_id = mem.device_id

    class _PooledMemory:
        """CuPy's own pool's block: back to its pool (not the driver) when dropped."""

        def __init__(self, pool: MemoryPool, ptr: int, size: int, device_id: int) -> None:
            self.pool, self.ptr, self.size, self.device_id = pool, ptr, size, device_id

        def __del__(self) -> None:
            self.pool._free.setdefault((self.device_id, self.size), []).append(self.ptr)

    class MemoryPool:
        """CuPy's caching pool, simplified: a block freed goes back to the pool and is handed
        to the next request of its size, whatever stream or capture it was used in."""

        def __init__(self) -> None:
            self._free: dict[tuple[int, int], list[int]] = {}
            self.n_device_malloc = 0
            self._total = 0

        def total_bytes(self) -> int:
            return self._total

        def used_bytes(self) -> int:
            return self._total - sum(size * len(v) for (_, size), v in self._free.items())

        def free_all_blocks(self) -> None:
            """Give every free block back to the device (of every device, as CuPy's does)."""
            for (device, size), ptrs in self._free.items():
                for ptr in ptrs:
                    _sim(device).free(ptr)
                    self._total -= size
            self._free.clear()

        def malloc(self, nbytes: int) -> MemoryPointer:
            device = _device()
            size = max(512, -(-int(nbytes) // 512) * 512)
            free = self._free.get((device, size))
            if free:
                ptr = free.pop()
            else:
                ptr = _sim(device).malloc(size)
                if ptr is None:
                    raise MemoryError(f"fake CuPy pool: out of memory allocating {size} bytes")
                self.n_device_malloc += 1
                self._total += size
            return MemoryPointer(_PooledMemory(self, ptr, size, device), 0)

    class PythonFunctionAllocatorMemory:
        """CuPy's: ``malloc_func(size, device)`` made the memory (not for size 0);
        ``free_func(ptr, device)`` when it is collected (CuPy's ``__dealloc__``: an exception
        there is reported as unraisable)."""

        def __init__(self, size: int, malloc_func: Any, free_func: Any, device_id: int) -> None:
            self._free_func, self.device_id, self.size, self.ptr = free_func, device_id, size, 0
            if size > 0:
                self.ptr = int(malloc_func(size, device_id))

        def __del__(self) -> None:
            if self.ptr:
                self._free_func(self.ptr, self.device_id)

    class PythonFunctionAllocator:
        """CuPy's allocator over two Python functions, on CuPy's current device."""

        def __init__(self, malloc_func: Any, free_func: Any) -> None:
            self._malloc_func, self._free_func = malloc_func, free_func

        def malloc(self, size: int) -> MemoryPointer:
            mem = PythonFunctionAllocatorMemory(int(size), self._malloc_func, self._free_func, _device())
            return MemoryPointer(mem, 0)

    class CFunctionAllocatorMemory:
        """CuPy's: ``malloc(param, size, device)`` made the memory (not for size 0; an
        exception it sets is raised, the address kept 0); ``free(param, ptr, device)`` when
        it is collected."""

        def __init__(self, size: int, param: int, malloc_func: int, free_func: int, device_id: int) -> None:
            self._param, self._free_func, self.device_id, self.size, self.ptr = (
                param,
                free_func,
                device_id,
                size,
                0,
            )
            if size > 0:
                self.ptr = int(CUPY_C_MALLOC(malloc_func)(param, size, device_id))

        def __del__(self) -> None:
            if self.ptr:
                CUPY_C_FREE(self._free_func)(self._param, self.ptr, self.device_id)

    class CFunctionAllocator:
        """CuPy's allocator over two C functions (addresses), on CuPy's current device."""

        def __init__(self, param: int, malloc_func: int, free_func: int, owner: object) -> None:
            self._param, self._malloc_func, self._free_func, self._owner = (
                param,
                malloc_func,
                free_func,
                owner,
            )

        def malloc(self, size: int) -> MemoryPointer:
            mem = CFunctionAllocatorMemory(
                int(size), self._param, self._malloc_func, self._free_func, _device()
            )
            return MemoryPointer(mem, 0)

    if python_function_allocator:
        memory = types.ModuleType("cupy.cuda.memory")
        memory.PythonFunctionAllocator = PythonFunctionAllocator  # type: ignore[attr-defined]
        memory.PythonFunctionAllocatorMemory = PythonFunctionAllocatorMemory  # type: ignore[attr-defined]
        cuda.memory = memory  # type: ignore[attr-defined]
        if c_function_allocator:
            memory.CFunctionAllocator = CFunctionAllocator  # type: ignore[attr-defined]
            stream_module = types.ModuleType("cupy.cuda.stream")
            current_ptr = ctypes.CFUNCTYPE(ctypes.c_ssize_t)(lambda: int(get_current_stream().ptr))
            name = b"intptr_t (void)"  # the signature CuPy's Cython names its exported function by
            capsule = make_capsule(ctypes.cast(current_ptr, ctypes.c_void_p).value or 0, name)
            stream_module._keep = (current_ptr, name)  # type: ignore[attr-defined]  # the capsule's
            stream_module.__pyx_capi__ = {"get_current_stream_ptr": capsule}  # type: ignore[attr-defined]
            cuda.stream = stream_module  # type: ignore[attr-defined]

    class PinnedMemoryPointer:
        """CuPy's: ``mem`` (``ptr``, ``size``) kept alive, ``ptr`` into it, ``size()``."""

        def __init__(self, mem: Any, offset: int) -> None:
            self.mem = mem
            self.ptr = mem.ptr + offset

        def size(self) -> int:
            return int(self.mem.size) - (self.ptr - int(self.mem.ptr))

    class _PooledPinned:
        def __init__(self, pool: PinnedMemoryPool, ptr: int, size: int) -> None:
            self.pool, self.ptr, self.size = pool, ptr, size

        def __del__(self) -> None:
            self.pool._free.setdefault(self.size, []).append(self.ptr)

    class PinnedMemoryPool:
        """CuPy's pinned pool: a freed buffer goes back at once and is handed to the next request
        of its size (rounded to a power of two), whatever stream or capture used it."""

        def __init__(self) -> None:
            self._free: dict[int, list[int]] = {}

        def malloc(self, nbytes: int) -> PinnedMemoryPointer:
            size = 1 << max(9, (max(1, int(nbytes)) - 1).bit_length())
            free = self._free.get(size)
            if free:
                ptr = free.pop()
            else:
                got = _sim(_device()).host_malloc(size)
                if got is None:
                    raise CUDARuntimeError(2)
                ptr = got
            return PinnedMemoryPointer(_PooledPinned(self, ptr, size), 0)

        def n_free_blocks(self) -> int:
            return sum(len(v) for v in self._free.values())

    default_pinned_pool = PinnedMemoryPool()
    pinned_state: dict[str, Any] = {"allocator": default_pinned_pool.malloc}

    def set_pinned_memory_allocator(allocator: Callable[[int], Any] | None = None) -> None:
        pinned_state["allocator"] = default_pinned_pool.malloc if allocator is None else allocator

    def alloc_pinned_memory(nbytes: int) -> Any:
        return pinned_state["allocator"](nbytes)

    def empty_pinned(shape: int, dtype: Any = np.float32) -> np.ndarray:
        """cupyx.empty_pinned: a NumPy array over ``alloc_pinned_memory`` (the simulator's host
        bytes stand in for the host address; the pointer keeps the memory alive)."""
        count = int(shape)
        mem = alloc_pinned_memory(count * np.dtype(dtype).itemsize)
        view = _sim(_device()).host_view(mem.ptr, count * np.dtype(dtype).itemsize)
        arr = np.frombuffer(view, dtype=dtype)
        keep[id(arr)] = mem
        weakref.finalize(arr, keep.pop, id(arr), None)
        return arr

    keep: dict[int, Any] = {}

    def pinned_ptr(arr: np.ndarray) -> int:
        """The pinned pointer of an ``empty_pinned`` array (``arr.ctypes.data`` on a GPU)."""
        return int(keep[id(arr)].ptr)

    default_pool = MemoryPool()
    state: dict[str, Any] = {"allocator": default_pool.malloc}

    def set_allocator(allocator: Callable[[int], Any] | None = None) -> None:
        state["allocator"] = default_pool.malloc if allocator is None else allocator

    def get_allocator() -> Callable[[int], Any]:
        return state["allocator"]

    def alloc(nbytes: int) -> Any:
        return state["allocator"](nbytes)

    for name, value in {
        "runtime": _Runtime,
        "Device": Device,
        "Stream": Stream,
        "ExternalStream": ExternalStream,
        "get_current_stream": get_current_stream,
        "UnownedMemory": UnownedMemory,
        "Memory": Memory,
        "MemoryPointer": MemoryPointer,
        "MemoryPool": MemoryPool,
        "set_allocator": set_allocator,
        "get_allocator": get_allocator,
        "alloc": alloc,
        "default_pool": default_pool,
        "PinnedMemoryPointer": PinnedMemoryPointer,
        "PinnedMemoryPool": PinnedMemoryPool,
        "set_pinned_memory_allocator": set_pinned_memory_allocator,
        "alloc_pinned_memory": alloc_pinned_memory,
        "empty_pinned": empty_pinned,
        "pinned_ptr": pinned_ptr,
    }.items():
        setattr(cuda, name, value)
    cp.get_default_memory_pool = lambda: default_pool  # type: ignore[attr-defined]
    cp.get_default_pinned_memory_pool = lambda: default_pinned_pool  # type: ignore[attr-defined]

    class ndarray:
        """A 1-D (or 0-d) array; every operation is a kernel on CuPy's current stream."""

        def __init__(self, shape: int | tuple[int, ...], dtype: Any = np.float64, memptr: Any = None) -> None:
            self.shape = (int(shape),) if isinstance(shape, int | np.integer) else tuple(shape)
            self.dtype = np.dtype(dtype)
            self.size = int(np.prod(self.shape)) if self.shape else 1
            self.nbytes = self.size * self.dtype.itemsize
            self.data = memptr if memptr is not None else alloc(max(self.nbytes, 1))

        def _launch(self, kernel: Callable[[], None]) -> None:
            s = get_current_stream()
            _sim(_device()).launch_kernel(s.ptr, kernel, "cupy-twin")

        def _view_args(self) -> tuple[int, int, np.dtype[Any]]:
            return self.data.ptr, self.nbytes, self.dtype

        def _binary(self, other: Any, op: Callable[[Any, Any], Any]) -> ndarray:
            out = ndarray(self.shape, self.dtype)
            dev = _sim(_device())
            a = self._view_args()
            b = other._view_args() if isinstance(other, ndarray) else other
            o = out._view_args()

            def kernel() -> None:
                x = dev.view(a[0], a[1]).view(a[2])
                y = dev.view(b[0], b[1]).view(b[2]) if isinstance(b, tuple) else b
                dev.view(o[0], o[1]).view(o[2])[...] = op(x, y)

            self._launch(kernel)
            return out

        def __add__(self, other: Any) -> ndarray:
            return self._binary(other, lambda x, y: x + y)

        def __sub__(self, other: Any) -> ndarray:
            return self._binary(other, lambda x, y: x - y)

        def __mul__(self, other: Any) -> ndarray:
            return self._binary(other, lambda x, y: x * y)

        __radd__ = __add__
        __rmul__ = __mul__

        def copy(self) -> ndarray:
            return self._binary(0, lambda x, y: x)

        def fill(self, value: Any) -> None:
            dev = _sim(_device())
            p, n, dt = self._view_args()

            def kernel() -> None:
                dev.view(p, n).view(dt)[...] = value

            self._launch(kernel)

        def sum(self) -> ndarray:
            out = ndarray((), self.dtype)
            dev = _sim(_device())
            a = self._view_args()
            o = out._view_args()

            def kernel() -> None:
                dev.view(o[0], o[1]).view(o[2])[...] = dev.view(a[0], a[1]).view(a[2]).sum()

            self._launch(kernel)
            return out

        def get(self) -> np.ndarray:
            get_current_stream().synchronize()
            p, n, dt = self._view_args()
            return np.array(_sim(_device()).view(p, n).view(dt)).reshape(self.shape)

        def item(self) -> Any:
            return self.get().reshape(-1)[0].item()

        def __float__(self) -> float:
            return float(self.item())

    def empty(shape: Any, dtype: Any = np.float64) -> ndarray:
        return ndarray(shape, dtype)

    def full(shape: Any, value: Any, dtype: Any = np.float64) -> ndarray:
        a = ndarray(shape, dtype)
        a.fill(value)
        return a

    def ones(shape: Any, dtype: Any = np.float64) -> ndarray:
        return full(shape, 1, dtype)

    def zeros(shape: Any, dtype: Any = np.float64) -> ndarray:
        return full(shape, 0, dtype)

    def arange(n: int, dtype: Any = np.int64) -> ndarray:
        a = ndarray(n, dtype)
        dev = _sim(_device())
        p, nb, dt = a._view_args()

        def kernel() -> None:
            dev.view(p, nb).view(dt)[...] = np.arange(n)

        a._launch(kernel)
        return a

    def asnumpy(a: ndarray) -> np.ndarray:
        return a.get()

    for name, value in {
        "ndarray": ndarray,
        "empty": empty,
        "full": full,
        "ones": ones,
        "zeros": zeros,
        "arange": arange,
        "asnumpy": asnumpy,
        "float32": np.float32,
        "float64": np.float64,
        "int32": np.int32,
        "int64": np.int64,
    }.items():
        setattr(cp, name, value)
    return cp


# ============================================================================== Numba
_SUPPORTED_EMM_INTERFACE_VERSION = 1


def make_numba() -> tuple[types.ModuleType, types.ModuleType]:
    """Fresh fake ``numba`` and ``numba.cuda`` modules (no context made yet); ``numba.cuda``
    has ``cudadrv.driver`` (IPC handles) as an attribute: put it in ``sys.modules`` too."""
    numba = types.ModuleType("numba")
    cuda = types.ModuleType("numba.cuda")
    numba.cuda = cuda  # type: ignore[attr-defined]
    state: dict[str, Any] = {"manager": None, "context": None}

    MemoryInfo = collections.namedtuple("MemoryInfo", "free total")

    class _PendingDeallocs:
        def __init__(self) -> None:
            self.disabled = 0

        @contextlib.contextmanager
        def disable(self) -> Iterator[None]:
            self.disabled += 1
            try:
                yield
            finally:
                self.disabled -= 1

        def clear(self) -> None:
            pass

    class BaseCUDAMemoryManager(abc.ABC):  # noqa: B024 - Numba's base has no abstract method here
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            if "context" not in kwargs:
                raise RuntimeError("Memory manager requires a context")
            self.context = kwargs.pop("context")

    class HostOnlyCUDAMemoryManager(BaseCUDAMemoryManager):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.allocations: dict[int, Any] = {}
            self.deallocations = _PendingDeallocs()

        def reset(self) -> None:
            self.allocations.clear()
            self.deallocations.clear()

        @contextlib.contextmanager
        def defer_cleanup(self) -> Iterator[None]:
            with self.deallocations.disable():
                yield

    class MemoryPointer:
        def __init__(
            self, context: Any, pointer: Any, size: int, owner: Any = None, finalizer: Any = None
        ) -> None:
            self.context = context
            self.device_pointer = pointer
            self.size = size
            self._owner = owner
            self._finalizer = weakref.finalize(self, finalizer) if finalizer is not None else None

        @property
        def device_ctypes_pointer(self) -> ctypes.c_void_p:
            value = self.device_pointer.value if isinstance(self.device_pointer, ctypes.c_void_p) else None
            return ctypes.c_void_p(value if value is not None else int(self.device_pointer))

        def free(self) -> None:
            if self._finalizer is not None:
                self._finalizer()

    class _Device:
        def __init__(self, id: int) -> None:
            self.id = id

        def get_device_identity(self) -> dict[str, int]:
            return {"pci_domain_id": 0, "pci_bus_id": self.id, "pci_device_id": 0}

    # numba.cuda.cudadrv.driver: the IPC handle kinds Numba's EMM plugins return
    class CUipcMemHandle:  # cuda.bindings.driver's: 64 bytes at getPtr()
        def __init__(self) -> None:
            self._raw = (ctypes.c_byte * 64)()

        def getPtr(self) -> int:
            return ctypes.addressof(self._raw)

        @property
        def reserved(self) -> bytes:
            return bytes(self._raw)

    class IpcHandle:
        def __init__(
            self, base: Any, handle: Any, size: int, source_info: Any = None, offset: int = 0
        ) -> None:
            self.base = base
            self.handle = handle
            self.size = size
            self.source_info = source_info
            self.offset = offset

    class CUdeviceptr:  # cuda.bindings.driver's device pointer (an int inside)
        def __init__(self, value: int = 0) -> None:
            self._value = int(value)

        def __int__(self) -> int:
            return self._value

    driver = types.ModuleType("numba.cuda.cudadrv.driver")
    driver.binding = types.SimpleNamespace(CUipcMemHandle=CUipcMemHandle, CUdeviceptr=CUdeviceptr)  # type: ignore[attr-defined]
    driver.IpcHandle = IpcHandle  # type: ignore[attr-defined]
    cudadrv = types.ModuleType("numba.cuda.cudadrv")
    cudadrv.driver = driver  # type: ignore[attr-defined]
    cuda.cudadrv = cudadrv  # type: ignore[attr-defined]

    class Context:
        def __init__(self, device: int) -> None:
            self.device = _Device(device)
            self.memory_manager = state["manager"](context=self)
            self.memory_manager.initialize()

        def memalloc(self, size: int) -> Any:
            return self.memory_manager.memalloc(size)

        def get_memory_info(self) -> Any:
            return self.memory_manager.get_memory_info()

        def get_ipc_handle(self, memory: Any) -> Any:
            return self.memory_manager.get_ipc_handle(memory)

        def reset(self) -> None:
            self.memory_manager.reset()

    def set_memory_manager(mm_plugin: Any) -> None:
        dummy = mm_plugin(context=None)  # as Numba: read the interface version off an instance
        if dummy.interface_version != _SUPPORTED_EMM_INTERFACE_VERSION:
            raise RuntimeError(f"EMM plugin interface version {dummy.interface_version} is not supported")
        if state["context"] is not None:
            raise RuntimeError("the memory manager is chosen before the context is made")
        state["manager"] = mm_plugin

    def current_context() -> Context:
        if state["context"] is None:
            if state["manager"] is None:
                raise RuntimeError("twin: only the graphpool plugin is modelled; install it first")
            state["context"] = Context(0)
        return state["context"]

    class DeviceNDArray:
        def __init__(self, shape: tuple[int, ...], dtype: Any, gpu_data: Any = None) -> None:
            self.shape = shape
            self.dtype = np.dtype(dtype)
            self.size = int(np.prod(shape))
            self.nbytes = self.size * self.dtype.itemsize
            self.gpu_data = gpu_data if gpu_data is not None else current_context().memalloc(self.nbytes)

        @property
        def device_ctypes_pointer(self) -> ctypes.c_void_p:
            return self.gpu_data.device_ctypes_pointer

        def _ptr(self) -> int:
            return int(self.device_ctypes_pointer.value or 0)

        def copy_to_host(self) -> np.ndarray:
            dev = _sim(current_context().device.id)
            raw = dev.read(self._ptr(), self.nbytes, 0)  # the legacy stream, synchronizing
            return np.frombuffer(raw, dtype=self.dtype).reshape(self.shape).copy()

        def copy_to_device(self, other: Any) -> None:
            dev = _sim(current_context().device.id)
            if isinstance(other, DeviceNDArray):
                dev.memcpy(self._ptr(), other._ptr(), self.nbytes, 0)
            else:
                dev.write(self._ptr(), np.ascontiguousarray(other).tobytes(), 0)
            dev.stream_synchronize(0)

    def to_device(host: np.ndarray, stream: int = 0) -> DeviceNDArray:
        d = DeviceNDArray(host.shape, host.dtype)
        d.copy_to_device(host)
        return d

    def device_array_like(a: Any) -> DeviceNDArray:
        return DeviceNDArray(a.shape, a.dtype)

    def synchronize() -> None:
        _sim(current_context().device.id).device_synchronize()

    for name, value in {
        "HostOnlyCUDAMemoryManager": HostOnlyCUDAMemoryManager,
        "BaseCUDAMemoryManager": BaseCUDAMemoryManager,
        "MemoryPointer": MemoryPointer,
        "MemoryInfo": MemoryInfo,
        "set_memory_manager": set_memory_manager,
        "current_context": current_context,
        "to_device": to_device,
        "device_array_like": device_array_like,
        "synchronize": synchronize,
        "_state": state,
    }.items():
        setattr(cuda, name, value)
    return numba, cuda


# ========================================================================== cuda.core
def make_cuda_core(api: str) -> types.ModuleType:
    """A fake ``cuda.core`` module. ``api``: "1.x" (``Buffer.from_handle`` takes a stream),
    "0.x" (``from_handle`` without one, as cuda.core.experimental) or "0.1" (no ``from_handle``:
    the ``Buffer(ptr, size, mr)`` constructor)."""
    core = types.ModuleType("cuda.core" if api == "1.x" else "cuda.core.experimental")
    core._twin_api = api  # type: ignore[attr-defined]
    tls = threading.local()

    class MemoryResource(abc.ABC):
        def __init__(self) -> None:
            self._twin_initialized = True  # cuda.core's __init__ takes no argument

        @abc.abstractmethod
        def allocate(self, size: int, stream: Any = None) -> Any: ...

        @abc.abstractmethod
        def deallocate(self, ptr: Any, size: int, stream: Any = None) -> None: ...

        @property
        @abc.abstractmethod
        def is_device_accessible(self) -> bool: ...

        @property
        @abc.abstractmethod
        def is_host_accessible(self) -> bool: ...

        @property
        @abc.abstractmethod
        def device_id(self) -> int: ...

    class Buffer:
        def __init__(self, ptr: int, size: int, mr: Any = None) -> None:
            self._ptr = int(ptr)
            self._size = int(size)
            self._mr = mr
            self.alloc_stream: Any = None

        @property
        def handle(self) -> int:
            return self._ptr

        @property
        def size(self) -> int:
            return self._size

        @property
        def memory_resource(self) -> Any:
            return self._mr

        def close(self, stream: Any = None) -> None:
            if self._ptr and self._mr is not None:
                self._mr.deallocate(self._ptr, self._size, stream)
            self._ptr = 0
            self._mr = None

        def __del__(self) -> None:
            self.close()

    if api == "1.x":

        def from_handle(cls: type, ptr: int, size: int, mr: Any = None, stream: Any = None) -> Any:
            b = cls(ptr, size, mr)
            b.alloc_stream = stream
            return b

        Buffer.from_handle = classmethod(from_handle)  # type: ignore[attr-defined]
    elif api == "0.x":

        def from_handle_0x(cls: type, ptr: int, size: int, mr: Any = None) -> Any:
            return cls(ptr, size, mr)

        Buffer.from_handle = classmethod(from_handle_0x)  # type: ignore[attr-defined]

    class Stream:
        def __init__(self, device: int, handle: int) -> None:
            self.device = device
            self.handle = handle

        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, self.handle)

        def sync(self) -> None:
            _sim(self.device).stream_synchronize(self.handle)

    class Device:
        def __init__(self, device_id: int = 0) -> None:
            self.device_id = device_id

        def set_current(self) -> None:
            tls.device = self.device_id

        def create_stream(self) -> Stream:
            return Stream(self.device_id, _sim(self.device_id).create_stream())

    for name, value in {
        "MemoryResource": MemoryResource,
        "Buffer": Buffer,
        "Device": Device,
        "Stream": Stream,
    }.items():
        setattr(core, name, value)
    return core


# ============================================================================ fixtures
@contextlib.contextmanager
def injected(monkeypatch: pytest.MonkeyPatch, modules: dict[str, Any]) -> Iterator[None]:
    """Put fake modules in sys.modules (and take them out after), the rest of sys.modules kept."""
    for name, mod in modules.items():
        monkeypatch.setitem(sys.modules, name, mod)
    yield

"""The real device: ``protocol.Device`` over NVIDIA's cuda-python runtime bindings.

This is the only module that imports ``cuda.bindings``, and it does so lazily, on the
first ``CudaBackend``/``CudaDevice`` construction or ``is_available()`` call, so
importing graphpool on a machine without the package, a driver or a GPU costs nothing.
The calls made on every allocation (``capture_id``) and the graph user objects
(``attach_release``) go through the small C module ``graphpool.device._capture``
instead, when it was built: a Python-level binding call would cost more than the
whole cached allocation.

Conventions:

* Every CUDA result passes through ``_check``, which raises ``CUDAError`` with the
  error's name and description. cuda.bindings calls return ``(err, *results)``.
* Handles cross the protocol as plain ints. cuda.bindings accepts ints for every
  stream, event, graph and pointer argument, so no handle objects are kept.
* Stream handle ``0`` is mapped to ``cudaStreamLegacy`` so it means the legacy default
  stream even if the bindings were switched to per-thread default streams.
* Each device first makes itself the thread's current device (checked, not forced)
  before calls that depend on it. The runtime API uses the primary context, which
  CuPy, PyTorch and Numba share.
"""

from __future__ import annotations

import ctypes
import functools
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from graphpool.device.protocol import CAPTURE_MODE_RELAXED, LEGACY_STREAM
from graphpool.errors import CUDAError

_R = TypeVar("_R")

_rt: Any = None
"""The ``cuda.bindings.runtime`` module once loaded."""

# Enum members and constants cached at load time (see ``_load``).
_SUCCESS: Any = None
_OOM: Any = None
_NOT_READY: Any = None
_MODES: tuple[Any, ...] = ()
_H2D: Any = None
_D2H: Any = None
_D2D: Any = None
_DEFAULT_KIND: Any = None  # cudaMemcpyDefault (memcpy_host)
_HOST_PORTABLE = 1  # cudaHostAllocPortable (host_malloc)
_ATTACH_GLOBAL = 1  # cudaMemAttachGlobal (malloc_managed)
_NON_BLOCKING = 0
_DISABLE_TIMING = 0
_LEGACY = 0
_load_lock = threading.Lock()
_native: Any = None
"""``graphpool.device._capture`` once loaded (None: not built, or no driver for it)."""
native_missing = "not loaded yet"
"""Why the C module is not in use ("" when it is)."""
_released: set[int] = set()  # tokens the C module reported, not yet taken by their device
_released_lock = threading.Lock()


def _load() -> Any:
    """Import cuda.bindings' runtime module once and cache what the hot calls use.

    Raises ImportError when cuda-python is not installed.
    """
    global _rt, _SUCCESS, _OOM, _NOT_READY, _MODES, _H2D, _D2H, _D2D
    global _NON_BLOCKING, _DISABLE_TIMING, _LEGACY, _DEFAULT_KIND, _HOST_PORTABLE, _ATTACH_GLOBAL
    if _rt is not None:
        return _rt
    with _load_lock:
        if _rt is not None:
            return _rt
        from cuda.bindings import runtime as rt

        err_t = rt.cudaError_t
        _SUCCESS = err_t.cudaSuccess
        _OOM = err_t.cudaErrorMemoryAllocation
        _NOT_READY = err_t.cudaErrorNotReady
        mode_t = rt.cudaStreamCaptureMode
        # Indexed by protocol.CAPTURE_MODE_* (0 global, 1 thread-local, 2 relaxed).
        _MODES = (
            mode_t.cudaStreamCaptureModeGlobal,
            mode_t.cudaStreamCaptureModeThreadLocal,
            mode_t.cudaStreamCaptureModeRelaxed,
        )
        kind = rt.cudaMemcpyKind
        _H2D = kind.cudaMemcpyHostToDevice
        _D2H = kind.cudaMemcpyDeviceToHost
        _D2D = kind.cudaMemcpyDeviceToDevice
        _DEFAULT_KIND = kind.cudaMemcpyDefault
        _HOST_PORTABLE = int(getattr(rt, "cudaHostAllocPortable", 1))
        _ATTACH_GLOBAL = int(getattr(rt, "cudaMemAttachGlobal", 1))
        _NON_BLOCKING = int(rt.cudaStreamNonBlocking)
        _DISABLE_TIMING = int(rt.cudaEventDisableTiming)
        _LEGACY = int(rt.cudaStreamLegacy)
        _rt = rt
        _load_native()
    return rt


def _cuda_error(call: str, code: int) -> CUDAError:
    """The CUDAError for a driver result ``code`` (CUresult), for the C module: named as the
    runtime names that code (the runtime's error codes are the driver's), so an error reads the
    same whichever path raised it (cudaErrorStreamCaptureUnsupported, not
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED); the driver's name where the runtime has none."""
    name, meaning = f"CUresult {code}", ""
    try:
        err, text = _rt.cudaGetErrorName(_rt.cudaError_t(code))
        if not err and text:
            name = text.decode()
            err, text = _rt.cudaGetErrorString(_rt.cudaError_t(code))
            return CUDAError(call, code, name, text.decode() if not err and text else "")
    except Exception:
        pass
    try:
        from cuda.bindings import driver

        res = driver.CUresult(code)
        err, text = driver.cuGetErrorName(res)
        if not err and text:
            name = text.decode()
        err, text = driver.cuGetErrorString(res)
        if not err and text:
            meaning = text.decode()
    except Exception:
        pass
    return CUDAError(call, code, name, meaning)


def _load_native() -> None:
    """Load the C module if it was built and the driver has what it needs."""
    global _native, native_missing
    try:
        from graphpool.device import _capture  # type: ignore[attr-defined]
    except ImportError:
        native_missing = "graphpool.device._capture was not built (pure-Python install)"
        return
    why = _capture.load(_cuda_error)
    if why is None:
        _native, native_missing = _capture, ""
    else:
        native_missing = str(why)


def _dcheck(call: str, err: Any) -> None:
    """Raise ``CUDAError`` unless the driver result ``err`` is CUDA_SUCCESS."""
    if int(err):
        raise _cuda_error(call, int(err))


def _check(call: str, err: Any) -> None:
    """The one checker: raise ``CUDAError`` unless ``err`` is cudaSuccess.

    The runtime's last-error slot is cleared so the next call starts clean.
    """
    if not err:  # cudaError_t is an int enum; cudaSuccess == 0
        return
    code = int(err)
    try:
        e1, name_b = _rt.cudaGetErrorName(err)
        e2, text_b = _rt.cudaGetErrorString(err)
        name = name_b.decode() if not e1 and name_b else getattr(err, "name", str(code))
        meaning = text_b.decode() if not e2 and text_b else ""
        _rt.cudaGetLastError()
    except Exception:
        name, meaning = getattr(err, "name", str(code)), ""
    raise CUDAError(call, code, name, meaning)


IPC_HANDLE_SIZE = 64
"""Bytes in a cudaIpcMemHandle_t (read and written through its address: getPtr)."""


def _stream(handle: int) -> int:
    """The bindings' value for protocol stream ``handle`` (0 is the legacy stream)."""
    return handle if handle != LEGACY_STREAM else _LEGACY


# Why ``is_available()`` said no: ``unavailable_reason()`` starts with one of these.
NO_BINDINGS = "no CUDA bindings"  # cuda-python's cuda.bindings is not installed
NO_DRIVER = "no CUDA driver"  # the runtime found no (or too old a) driver
NO_GPU = "no CUDA GPU"  # the driver works and reports no device
BROKEN = "CUDA layer broken"  # anything else: an import or a call failed unexpectedly
_NO_DRIVER_ERRORS = (
    "cudaErrorInsufficientDriver",
    "cudaErrorStubLibrary",
    "cudaErrorCallRequiresNewerDriver",
)
_NO_GPU_ERRORS = ("cudaErrorNoDevice", "cudaErrorDevicesUnavailable")


@functools.lru_cache(maxsize=1)
def unavailable_reason() -> str | None:
    """None when the CUDA backend is usable; else why not, starting with NO_BINDINGS,
    NO_DRIVER, NO_GPU or BROKEN and a colon.

    NO_BINDINGS, NO_DRIVER and NO_GPU describe a machine without CUDA; BROKEN means the
    CUDA layer is there but failed (a bindings import error from inside the package, an
    unexpected error code or exception), which on a GPU host is a fault to report, not a
    reason to fall back quietly. Never raises; cached (it cannot change within a process).
    """
    try:
        rt = _load()
    except ModuleNotFoundError as exc:
        if exc.name in ("cuda", "cuda.bindings", "cuda.bindings.runtime"):
            return f"{NO_BINDINGS}: {exc}"
        return f"{BROKEN}: importing cuda.bindings failed: {exc!r}"
    except Exception as exc:
        return f"{BROKEN}: importing cuda.bindings failed: {exc!r}"
    try:
        err, count = rt.cudaGetDeviceCount()
    except Exception as exc:
        return f"{BROKEN}: cudaGetDeviceCount raised {exc!r}"
    if err:
        name = getattr(err, "name", str(int(err)))
        if name in _NO_DRIVER_ERRORS:
            return f"{NO_DRIVER}: cudaGetDeviceCount returned {name}"
        if name in _NO_GPU_ERRORS:
            return f"{NO_GPU}: cudaGetDeviceCount returned {name}"
        return f"{BROKEN}: cudaGetDeviceCount returned {name}"
    try:
        n = int(count)
    except Exception as exc:
        return f"{BROKEN}: cudaGetDeviceCount gave {count!r} ({exc!r})"
    if n < 1:
        return f"{NO_GPU}: cudaGetDeviceCount reports {n} devices"
    return None


def is_available() -> bool:
    """True when cuda.bindings imports, the driver initialises and a device exists.

    Never raises; cached after the first call. ``unavailable_reason()`` says why not.
    """
    return unavailable_reason() is None


def versions() -> dict[str, str]:
    """cuda-bindings, driver and runtime versions (driver/runtime as "major.minor")."""
    rt = _load()
    import cuda.bindings

    def fmt(v: int) -> str:
        return f"{v // 1000}.{(v % 1000) // 10}"

    err, drv = rt.cudaDriverGetVersion()
    _check("cudaDriverGetVersion", err)
    err, run = rt.cudaRuntimeGetVersion()
    _check("cudaRuntimeGetVersion", err)
    return {
        "cuda_bindings": str(getattr(cuda.bindings, "__version__", "?")),
        "driver": fmt(int(drv)),
        "runtime": fmt(int(run)),
    }


def _on_device(method: Callable[..., _R]) -> Callable[..., _R]:
    """Run a CudaDevice method with its device current, then restore the caller's device.

    The runtime API acts on the thread's current device; restoring it keeps CuPy, PyTorch
    and ``gp.current_device()`` in step when graphpool works on another device.
    """

    @functools.wraps(method)
    def wrapper(self: CudaDevice, *args: Any, **kwargs: Any) -> _R:
        err, cur = _rt.cudaGetDevice()
        _check("cudaGetDevice", err)
        if cur == self.index:
            return method(self, *args, **kwargs)
        _check("cudaSetDevice", _rt.cudaSetDevice(self.index)[0])
        try:
            return method(self, *args, **kwargs)
        finally:
            _rt.cudaSetDevice(cur)

    return wrapper


class CudaDevice:
    """One CUDA device through the runtime API (primary context).

    Every method acts on device ``index`` whatever device is current on the calling
    thread: calls that depend on the current device switch to it first (one
    cudaGetDevice, plus cudaSetDevice only when it differs).
    """

    index: int
    name: str

    def __init__(self, index: int) -> None:
        rt = _load()
        err, prop = rt.cudaGetDeviceProperties(index)
        _check("cudaGetDeviceProperties", err)
        raw = prop.name
        if isinstance(raw, (bytes, bytearray)):
            raw = bytes(raw).split(b"\0", 1)[0].decode(errors="replace")
        self.index = index
        self.name = str(raw)
        self._attached: set[int] = set()  # release tokens of this device not yet reported
        self._host_attached: set[int] = set()  # the pinned pool's (attach_host_release)
        self._made: set[int] = set()  # streams create_stream made and nobody destroyed
        # Held across "made and not destroyed?" and the query (or vmm_unmap's wait) that
        # follows, and across a destroy: no thread asks CUDA about, or waits for, a handle
        # another thread is destroying (a destroy waits out an unmap's wait). Reentrant:
        # a finalizer run on the asking thread may destroy a stream.
        self._made_lock = threading.RLock()
        self._primary: int | None = None  # the primary context's handle, once owns_stream asked
        # The context current while this device was made current (a launch's fast path: a
        # graph launches at once when it is still current; 0: not known yet)
        self._ctx = 0
        self._prop: Any = None  # virtual memory: allocation properties and access descriptor
        self._access: Any = None
        if _native is not None:
            # the allocator binds ``capture_id`` once and calls it on every allocation: the C
            # function itself, with no Python frame in between
            self.capture_id = _native.capture_id  # type: ignore[method-assign]

    def __repr__(self) -> str:
        return f"CudaDevice({self.index}, {self.name!r})"

    # -- memory ---------------------------------------------------------------
    @_on_device
    def malloc(self, nbytes: int) -> int | None:
        """cudaMalloc; ``None`` on cudaErrorMemoryAllocation (the allocator retries)."""
        err, ptr = _rt.cudaMalloc(nbytes)
        if err:
            if err == _OOM:
                _rt.cudaGetLastError()  # leave no pending error behind
                return None
            _check("cudaMalloc", err)
        return int(ptr)

    @_on_device
    def malloc_managed(self, nbytes: int) -> int | None:
        """cudaMallocManaged(cudaMemAttachGlobal); ``None`` on cudaErrorMemoryAllocation."""
        err, ptr = _rt.cudaMallocManaged(nbytes, _ATTACH_GLOBAL)
        if err:
            if err == _OOM:
                _rt.cudaGetLastError()
                return None
            _check("cudaMallocManaged", err)
        return int(ptr)

    @_on_device
    def free(self, ptr: int) -> None:
        """cudaFree (synchronizes the device; unsafe during capture)."""
        _check("cudaFree", _rt.cudaFree(ptr)[0])

    @_on_device
    def mem_info(self) -> tuple[int, int]:
        """(free, total) bytes from cudaMemGetInfo."""
        err, free, total = _rt.cudaMemGetInfo()
        _check("cudaMemGetInfo", err)
        return int(free), int(total)

    # -- IPC: memory shared with other processes of the machine (legacy CUDA IPC)
    @_on_device
    def ipc_export(self, ptr: int) -> bytes:
        """cudaIpcGetMemHandle of the cudaMalloc allocation starting at ``ptr``: its 64 bytes."""
        err, handle = _rt.cudaIpcGetMemHandle(ptr)
        _check("cudaIpcGetMemHandle", err)
        return ctypes.string_at(int(handle.getPtr()), IPC_HANDLE_SIZE)

    @_on_device
    def ipc_open(self, handle: bytes) -> int:
        """cudaIpcOpenMemHandle on this device, peer access enabled lazily (another device's
        memory opens where the two devices are peers)."""
        raw = bytes(handle)
        if len(raw) != IPC_HANDLE_SIZE:
            raise CUDAError(
                "cudaIpcOpenMemHandle", 1, "cudaErrorInvalidValue", f"a handle of {len(raw)} bytes"
            )
        h = _rt.cudaIpcMemHandle_t()
        ctypes.memmove(int(h.getPtr()), raw, IPC_HANDLE_SIZE)
        err, ptr = _rt.cudaIpcOpenMemHandle(h, _rt.cudaIpcMemLazyEnablePeerAccess)
        _check("cudaIpcOpenMemHandle", err)
        return int(ptr)

    @_on_device
    def ipc_close(self, ptr: int) -> None:
        """cudaIpcCloseMemHandle."""
        _check("cudaIpcCloseMemHandle", _rt.cudaIpcCloseMemHandle(ptr)[0])

    # -- virtual memory (expandable segments), through the driver API
    def _vmm(self) -> tuple[Any, Any]:
        """The driver module and this device's allocation properties (made once)."""
        if self._prop is None:
            from cuda.bindings import driver

            prop = driver.CUmemAllocationProp()
            prop.type = driver.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = self.index
            desc = driver.CUmemAccessDesc()
            desc.location.type = driver.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = self.index
            desc.flags = driver.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            self._access = desc
            self._prop = prop
        from cuda.bindings import driver

        return driver, self._prop

    def vmm_granularity(self) -> int:
        """cuMemGetAllocationGranularity (minimum) for pinned device memory."""
        driver, prop = self._vmm()
        flag = driver.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
        err, gran = driver.cuMemGetAllocationGranularity(prop, flag)
        _dcheck("cuMemGetAllocationGranularity", err)
        return int(gran)

    @_on_device
    def vmm_reserve(self, nbytes: int) -> int:
        """cuMemAddressReserve."""
        driver, _ = self._vmm()
        err, va = driver.cuMemAddressReserve(nbytes, 0, 0, 0)
        _dcheck("cuMemAddressReserve", err)
        return int(va)

    @_on_device
    def vmm_map(self, va: int, nbytes: int) -> bool:
        """cuMemCreate and cuMemMap granule by granule, then cuMemSetAccess; each handle is
        released at once (its mapping keeps the memory until it is unmapped). Each granule
        is its own mapping because cuMemUnmap only takes whole mappings, and the protocol
        lets any mapped granules be unmapped (a segment's tail). False on
        CUDA_ERROR_OUT_OF_MEMORY, with nothing left mapped."""
        driver, prop = self._vmm()
        gran = self.vmm_granularity()
        done = va
        try:
            while done < va + nbytes:
                err, handle = driver.cuMemCreate(gran, prop, 0)
                if err == driver.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                    self._unmap_granules(driver, va, done - va)
                    return False
                _dcheck("cuMemCreate", err)
                try:
                    (err,) = driver.cuMemMap(done, gran, 0, handle, 0)
                    _dcheck("cuMemMap", err)
                finally:
                    driver.cuMemRelease(handle)
                done += gran
            (err,) = driver.cuMemSetAccess(va, nbytes, [self._access], 1)
            _dcheck("cuMemSetAccess", err)
        except BaseException:  # a driver error or an interrupt: nothing stays mapped
            self._unmap_granules(driver, va, done - va)
            raise
        return True

    @_on_device
    def vmm_unmap(self, va: int, nbytes: int, stream: int | None = None) -> None:
        """cudaStreamSynchronize of ``stream`` where this device made it and it is not
        capturing, else cudaDeviceSynchronize (unlike cudaFree, cuMemUnmap does not wait for
        queued work), under the relaxed capture mode; then cuMemUnmap of each granule (each is
        its own mapping: ``vmm_map``)."""
        driver, _ = self._vmm()
        prev = self.exchange_capture_mode(CAPTURE_MODE_RELAXED)
        try:
            if stream is None or not self.stream_synchronize_made(stream):
                _check("cudaDeviceSynchronize", _rt.cudaDeviceSynchronize()[0])
        finally:
            self.exchange_capture_mode(prev)
        _dcheck("cuMemUnmap", self._unmap_granules(driver, va, nbytes))

    def stream_synchronize_made(self, stream: int) -> bool:
        """The protocol's: cudaStreamSynchronize of ``stream`` where ``create_stream`` made it
        (so the handle is live: never a handle another library may have destroyed) and it is
        not capturing now; whether it did. The lock is held across the check, the query and
        the wait, as ``stream_idle`` holds it: no other thread destroys the handle in between."""
        with self._made_lock:
            if stream not in self._made or self.capture_id(stream):
                return False
            _check("cudaStreamSynchronize", _rt.cudaStreamSynchronize(stream)[0])
            return True

    def _unmap_granules(self, driver: Any, va: int, nbytes: int) -> Any:
        """cuMemUnmap each granule of ``[va, va + nbytes)``, going on past a refusal so that a
        partly mapped range ends unmapped; the first error (0 if none)."""
        gran = self.vmm_granularity()
        first: Any = 0
        for at in range(va, va + nbytes, gran):
            (err,) = driver.cuMemUnmap(at, gran)
            if int(err) and not int(first):
                first = err
        return first

    @_on_device
    def vmm_release(self, va: int, nbytes: int) -> None:
        """cuMemAddressFree."""
        driver, _ = self._vmm()
        (err,) = driver.cuMemAddressFree(va, nbytes)
        _dcheck("cuMemAddressFree", err)

    @_on_device
    def memset(self, ptr: int, value: int, nbytes: int, stream: int) -> None:
        """cudaMemsetAsync of the low byte of ``value``."""
        _check(
            "cudaMemsetAsync",
            _rt.cudaMemsetAsync(ptr, value & 0xFF, nbytes, _stream(stream))[0],
        )

    @_on_device
    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """cudaMemcpyAsync device to device."""
        _check(
            "cudaMemcpyAsync",
            _rt.cudaMemcpyAsync(dst, src, nbytes, _D2D, _stream(stream))[0],
        )

    @_on_device
    def write(self, ptr: int, data: bytes, stream: int) -> None:
        """Host-to-device copy in ``stream`` order; returns once ``stream`` has done it."""
        if not len(data):
            return
        s = _stream(stream)
        _check("cudaMemcpyAsync", _rt.cudaMemcpyAsync(ptr, data, len(data), _H2D, s)[0])
        _check("cudaStreamSynchronize", _rt.cudaStreamSynchronize(s)[0])

    @_on_device
    def read(self, ptr: int, nbytes: int, stream: int) -> bytes:
        """Device-to-host copy queued after ``stream``'s work, then wait for it."""
        if nbytes <= 0:
            return b""
        s = _stream(stream)
        buf = bytearray(nbytes)
        _check("cudaMemcpyAsync", _rt.cudaMemcpyAsync(buf, ptr, nbytes, _D2H, s)[0])
        _check("cudaStreamSynchronize", _rt.cudaStreamSynchronize(s)[0])
        return bytes(buf)

    # -- pinned host memory (graphpool.pinned) ---------------------------------
    @_on_device
    def host_malloc(self, nbytes: int) -> int | None:
        """cudaHostAlloc (portable: every device's copies may use it); ``None`` on
        cudaErrorMemoryAllocation."""
        err, ptr = _rt.cudaHostAlloc(nbytes, _HOST_PORTABLE)
        if err:
            if err == _OOM:
                _rt.cudaGetLastError()
                return None
            _check("cudaHostAlloc", err)
        return int(ptr)

    @_on_device
    def host_free(self, ptr: int) -> None:
        """cudaFreeHost (waits for queued work; unsafe during capture)."""
        _check("cudaFreeHost", _rt.cudaFreeHost(ptr)[0])

    def host_mem_info(self) -> tuple[int, int]:
        """(available, total) physical host memory, from the OS (no CUDA call)."""
        return _host_mem_info()

    def host_view(self, ptr: int, nbytes: int) -> memoryview:
        """The bytes at host address ``ptr`` (page-locked memory of this process)."""
        return memoryview((ctypes.c_ubyte * nbytes).from_address(ptr)).cast("B")

    @_on_device
    def memcpy_host(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """cudaMemcpyAsync with cudaMemcpyDefault: either side pinned host memory."""
        _check(
            "cudaMemcpyAsync",
            _rt.cudaMemcpyAsync(dst, src, nbytes, _DEFAULT_KIND, _stream(stream))[0],
        )

    # -- streams --------------------------------------------------------------
    @_on_device
    def create_stream(self) -> int:
        """cudaStreamCreateWithFlags(cudaStreamNonBlocking) on this device."""
        err, s = _rt.cudaStreamCreateWithFlags(_NON_BLOCKING)
        _check("cudaStreamCreateWithFlags", err)
        handle = int(s)
        self._made.add(handle)
        return handle

    def destroy_stream(self, stream: int) -> None:
        """cudaStreamDestroy (the legacy stream is never destroyed)."""
        if stream == LEGACY_STREAM:
            return
        with self._made_lock:
            self._made.discard(stream)  # first: from here on it is never queried
            _check("cudaStreamDestroy", _rt.cudaStreamDestroy(stream)[0])

    def stream_idle(self, stream: int) -> bool:
        """A stream of ``create_stream``'s, not capturing (asked first), and its query done
        under the relaxed capture mode (in C when the module is built); False for any other
        handle, which is never passed to CUDA (see the protocol)."""
        with self._made_lock:
            if stream not in self._made:
                return False
            if _native is not None:
                return bool(_native.stream_idle(stream))
            if self.capture_id(stream):
                return False
            prev = self.exchange_capture_mode(CAPTURE_MODE_RELAXED)
            try:
                err = _rt.cudaStreamQuery(stream)[0]
            finally:
                self.exchange_capture_mode(prev)
        if err == _SUCCESS:
            return True
        if err == _NOT_READY:
            return False
        _check("cudaStreamQuery", err)
        return False

    def made_streams_capturing(self) -> bool:
        """The protocol's: the capture query of each stream ``create_stream`` made, the lock
        held (none is destroyed meanwhile)."""
        with self._made_lock:
            return any(self.capture_id(s) for s in self._made)

    def stream_capturing(self, stream: int) -> bool | None:
        """The protocol's: the capture query of a stream ``create_stream`` made, the lock held
        (no other thread destroys the handle meanwhile); None for any other handle."""
        with self._made_lock:
            if stream not in self._made:
                return None
            return bool(self.capture_id(stream))

    def owns_stream(self, stream: int) -> bool:
        """Whether ``cuStreamGetCtx(stream)`` is this device's primary context (retained once,
        for the life of the process, as the runtime API keeps it). An invalid handle is
        undefined behaviour in CUDA: the caller passes a stream its owner says is live."""
        if stream == LEGACY_STREAM:
            return True
        from cuda.bindings import driver

        primary = self._primary
        if primary is None:
            err, dev = driver.cuDeviceGet(self.index)
            if err:
                raise _cuda_error("cuDeviceGet", int(err))
            err, ctx = driver.cuDevicePrimaryCtxRetain(dev)
            if err:
                raise _cuda_error("cuDevicePrimaryCtxRetain", int(err))
            primary = self._primary = int(ctx)
        err, ctx = driver.cuStreamGetCtx(stream)
        if err:
            raise _cuda_error("cuStreamGetCtx", int(err))
        return int(ctx) == primary

    @_on_device
    def stream_wait_event(self, stream: int, event: int) -> None:
        """cudaStreamWaitEvent(stream, event, 0); joins ``stream`` to a capture."""
        _check("cudaStreamWaitEvent", _rt.cudaStreamWaitEvent(_stream(stream), event, 0)[0])

    @_on_device
    def stream_synchronize(self, stream: int) -> None:
        """cudaStreamSynchronize."""
        _check("cudaStreamSynchronize", _rt.cudaStreamSynchronize(_stream(stream))[0])

    @_on_device
    def device_synchronize(self) -> None:
        """cudaDeviceSynchronize on this device."""
        _check("cudaDeviceSynchronize", _rt.cudaDeviceSynchronize()[0])

    # -- events ---------------------------------------------------------------
    @_on_device
    def create_event(self) -> int:
        """cudaEventCreateWithFlags(cudaEventDisableTiming) on this device."""
        err, e = _rt.cudaEventCreateWithFlags(_DISABLE_TIMING)
        _check("cudaEventCreateWithFlags", err)
        return int(e)

    def destroy_event(self, event: int) -> None:
        """cudaEventDestroy."""
        _check("cudaEventDestroy", _rt.cudaEventDestroy(event)[0])

    @_on_device
    def record_event(self, event: int, stream: int) -> None:
        """cudaEventRecord (a capture node when ``stream`` is capturing)."""
        _check("cudaEventRecord", _rt.cudaEventRecord(event, _stream(stream))[0])

    def query_event(self, event: int) -> bool:
        """cudaEventQuery: True when done, False on cudaErrorNotReady."""
        err = _rt.cudaEventQuery(event)[0]
        if not err:
            return True
        if err == _NOT_READY:
            return False
        _check("cudaEventQuery", err)
        return False  # unreachable: _check raised

    def event_synchronize(self, event: int) -> None:
        """cudaEventSynchronize."""
        _check("cudaEventSynchronize", _rt.cudaEventSynchronize(event)[0])

    # -- capture and graphs ---------------------------------------------------
    def capture_info(self, stream: int) -> tuple[int, int]:
        """(status, id): cudaStreamIsCapturing, then cudaStreamGetCaptureInfo when capturing."""
        if stream == LEGACY_STREAM:
            return self._legacy_capture_info()
        return self._capture_info(stream)

    @_on_device
    def _legacy_capture_info(self) -> tuple[int, int]:
        """The legacy stream is per device: ask with this device current."""
        return self._capture_info(_LEGACY)

    def _capture_info(self, stream: int) -> tuple[int, int]:
        # cudaStreamIsCapturing builds no output arrays: the cheap answer when not capturing.
        err, status = _rt.cudaStreamIsCapturing(stream)
        _check("cudaStreamIsCapturing", err)
        if not int(status):
            return 0, 0
        # CUDA 13 bindings: (err, status, id, graph, deps, edgeData, numDeps)
        res = _rt.cudaStreamGetCaptureInfo(stream)
        _check("cudaStreamGetCaptureInfo", res[0])
        status = int(res[1])
        return status, (int(res[2]) if status else 0)

    def capture_id(self, stream: int) -> int:
        """The id of the capture ``stream`` takes part in, 0 if none (replaced by the C module's
        function when it is built; this fallback costs a Python binding call or two)."""
        return self.capture_info(stream)[1]

    def capture_query_address(self) -> int:
        """The C module's capture query for C callers without the GIL (the protocol's), 0
        without the C module."""
        return 0 if _native is None else int(_native.query_address())

    def attach_release(self, stream: int, token: int) -> None:
        """A CUDA user object moved into the graph being captured on ``stream`` (C module)."""
        if _native is None:
            raise CUDAError(
                "cuUserObjectCreate", 801, "cudaErrorNotSupported", f"needs the C module: {native_missing}"
            )
        _native.attach_release(_stream(stream) if stream == LEGACY_STREAM else stream, token)
        with _released_lock:
            self._attached.add(token)

    def attach_host_release(self, stream: int, token: int) -> None:
        """``attach_release`` for the pinned pool: reported by ``take_host_released`` only."""
        if _native is None:
            raise CUDAError(
                "cuUserObjectCreate", 801, "cudaErrorNotSupported", f"needs the C module: {native_missing}"
            )
        _native.attach_release(_stream(stream) if stream == LEGACY_STREAM else stream, token)
        with _released_lock:
            self._host_attached.add(token)

    def take_host_released(self) -> list[int]:
        """The pinned pool's tokens whose graphs were destroyed since the last call."""
        if _native is None or not self._host_attached:
            return []
        fresh = _native.take_released()
        with _released_lock:
            _released.update(fresh)
            mine = self._host_attached & _released
            _released.difference_update(mine)
            self._host_attached -= mine
        return sorted(mine)

    def take_released(self) -> list[int]:
        """This device's tokens whose graphs were destroyed since the last call.

        With two devices' allocators asking at once, one may drain the other's token from the C
        queue just as the other finds both queues empty: the other gets it at its next call.
        """
        if _native is None or not self._attached:
            return []
        fresh = _native.take_released()  # C, [] when no graph was destroyed since the last call
        if not fresh and not _released:  # the usual case: no lock, no set made (the allocator
            return []  # asks at every sweep while a capture begun outside is underway)
        with _released_lock:
            _released.update(fresh)
            mine = self._attached & _released
            _released.difference_update(mine)
            self._attached -= mine
        return sorted(mine)

    def exchange_capture_mode(self, mode: int) -> int:
        """cudaThreadExchangeStreamCaptureMode on the calling thread; old mode."""
        err, prev = _rt.cudaThreadExchangeStreamCaptureMode(_mode(mode))
        _check("cudaThreadExchangeStreamCaptureMode", err)
        return int(prev)

    @_on_device
    def begin_capture(self, stream: int, mode: int) -> None:
        """cudaStreamBeginCapture; fails on the legacy stream."""
        _check(
            "cudaStreamBeginCapture",
            _rt.cudaStreamBeginCapture(_stream(stream), _mode(mode))[0],
        )

    def end_capture(self, stream: int) -> int:
        """cudaStreamEndCapture; raises if invalidated (the stream still leaves capture)."""
        err, graph = _rt.cudaStreamEndCapture(_stream(stream))
        _check("cudaStreamEndCapture", err)
        return int(graph)

    def graph_node_count(self, graph: int) -> int:
        """Number of nodes via cudaGraphGetNodes with a NULL node array."""
        err, _nodes, count = _rt.cudaGraphGetNodes(graph)
        _check("cudaGraphGetNodes", err)
        return int(count)

    @_on_device
    def instantiate(self, graph: int) -> int:
        """cudaGraphInstantiate(graph, 0)."""
        err, graph_exec = _rt.cudaGraphInstantiate(graph, 0)
        _check("cudaGraphInstantiate", err)
        return int(graph_exec)

    def launch(self, graph_exec: int, stream: int) -> None:
        """Launch ``graph_exec`` on ``stream``: cuGraphLaunch through the C module when this
        device's context is the thread's current one (one C call, no device switch), else
        cudaGraphLaunch with this device made current."""
        native = _native
        if native is not None and native.graph_launch(graph_exec, _stream(stream), self._ctx):
            return
        self._launch(graph_exec, stream)

    @_on_device
    def _launch(self, graph_exec: int, stream: int) -> None:
        """cudaGraphLaunch (this device current), and note the context for the fast path."""
        _check("cudaGraphLaunch", _rt.cudaGraphLaunch(graph_exec, _stream(stream))[0])
        if _native is not None:
            self._ctx = int(_native.current_context())

    def destroy_graph(self, graph: int) -> None:
        """cudaGraphDestroy."""
        _check("cudaGraphDestroy", _rt.cudaGraphDestroy(graph)[0])

    def destroy_graph_exec(self, graph_exec: int) -> None:
        """cudaGraphExecDestroy."""
        _check("cudaGraphExecDestroy", _rt.cudaGraphExecDestroy(graph_exec)[0])


def _host_mem_info() -> tuple[int, int]:
    """(available, total) physical memory of the host; where the OS cannot tell, a total too
    large to refuse any request (the driver's cudaHostAlloc still refuses what it cannot pin)."""
    try:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page
    except (AttributeError, ValueError, OSError):
        return 1 << 50, 1 << 50


def _mode(mode: int) -> Any:
    """The cudaStreamCaptureMode member for protocol mode ``mode``."""
    if 0 <= mode < len(_MODES):
        return _MODES[mode]
    raise ValueError(f"unknown capture mode {mode!r}; expected 0 (global), 1 (thread_local) or 2 (relaxed)")


class CudaBackend:
    """All CUDA devices of the process; construction fails without cuda-python or driver."""

    name = "cuda"

    def __init__(self) -> None:
        rt = _load()
        err, count = rt.cudaGetDeviceCount()
        _check("cudaGetDeviceCount", err)
        self._count = int(count)
        self._devices: dict[int, CudaDevice] = {}
        self._lock = threading.Lock()

    def device_count(self) -> int:
        """Number of visible devices (fixed for the life of the process)."""
        return self._count

    def get_device(self, index: int) -> CudaDevice:
        """The one ``CudaDevice`` for ``index``; cudaErrorInvalidDevice if out of range."""
        dev = self._devices.get(index)
        if dev is not None:
            return dev
        if not 0 <= index < self._count:
            code = int(_rt.cudaError_t.cudaErrorInvalidDevice)
            raise CUDAError(
                "get_device",
                code,
                "cudaErrorInvalidDevice",
                f"device {index} does not exist ({self._count} visible)",
            )
        with self._lock:
            dev = self._devices.get(index)
            if dev is None:
                dev = self._devices[index] = CudaDevice(index)
        return dev

    def set_current_device(self, index: int) -> None:
        """cudaSetDevice: make ``index`` current on the calling thread."""
        _check("cudaSetDevice", _rt.cudaSetDevice(index)[0])


__all__ = ["CudaBackend", "CudaDevice", "is_available", "unavailable_reason", "versions"]

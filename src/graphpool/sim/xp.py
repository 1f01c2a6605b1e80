"""A minimal CuPy-like array namespace on the simulated device (docs/behaviour.rst).

Arrays are 1-D (or 0-d, from ``sum``) and allocate from graphpool on the current device
and stream (``graphpool.alloc``); an array holds its DeviceBuffer, so its memory is
freed when the array is collected. Every operation queues a kernel on the current
stream; kernels close over integer addresses, sizes and dtypes only, never arrays, and
dereference them when they run, exactly as GPU kernels do: an array dropped during a
capture frees memory that a replay still touches. ``.item()``, ``.get()`` and ``repr``
synchronize the current stream.

This is an array client of graphpool, like CuPy, not part of the simulated device (the
device never needs arrays): it lives beside the simulator but sits above the public API in
the import graph, and importing ``graphpool.sim`` does not import it. ``graphpool.xp`` is
the same namespace under its older name.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from typing import Any, TypeAlias

import numpy as np

from graphpool import memory as _memory
from graphpool import runtime as _runtime
from graphpool import streams as _streams
from graphpool.device.protocol import CAPTURE_STATUS_NONE
from graphpool.sim.device import SimDevice

float32 = np.float32
float64 = np.float64
int32 = np.int32
int64 = np.int64

_DTYPES = {np.dtype(t) for t in (np.float32, np.float64, np.int32, np.int64)}
Scalar: TypeAlias = "int | float | bool | np.number[Any]"
_Arg: TypeAlias = "tuple[int, int, np.dtype[Any]] | Scalar"
"""A kernel argument: (address, nbytes, dtype) of an array, or a scalar."""


def _context() -> tuple[SimDevice, int]:
    """The current device (which must be simulated) and the current stream's handle."""
    dev = _runtime.current_device_object()
    if not isinstance(dev, SimDevice):
        raise TypeError(
            "graphpool.sim.xp arrays live on the simulated device, but the current device is "
            f"{dev!r}; call graphpool.set_backend('sim') first, or use CuPy on a GPU"
        )
    return dev, int(_streams.current_stream().handle)


def _dtype(dtype: Any) -> np.dtype[Any]:
    dt: np.dtype[Any] = np.dtype(dtype)
    if dt not in _DTYPES:
        raise TypeError(f"xp supports float32, float64, int32 and int64, not {dt}")
    return dt


def _shape(shape: int | tuple[int, ...]) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (int(shape),)
    shape = tuple(int(n) for n in shape)
    if len(shape) > 1:
        raise ValueError(f"xp supports 1-D arrays only, got shape {shape}")
    if shape and shape[0] < 0:
        raise ValueError(f"negative dimensions are not allowed: {shape}")
    return shape


class MemoryPointer:
    """What ``ndarray.data`` returns, like CuPy's: the buffer and its address ``ptr``."""

    __slots__ = ("mem", "ptr")

    def __init__(self, mem: Any, ptr: int) -> None:
        self.mem = mem
        self.ptr = ptr

    def __repr__(self) -> str:
        return f"MemoryPointer(ptr={self.ptr:#x})"

    def __deepcopy__(self, memo: dict[int, Any]) -> MemoryPointer:
        """A pointer into a real copy of the memory, at the same offset (never a second owner)."""
        import copy

        mem = copy.deepcopy(self.mem, memo)
        return MemoryPointer(mem, int(mem.ptr) + (self.ptr - int(self.mem.ptr)))


# -- kernels: module-level factories, so closures see only ints, dtypes and the device --
def _load(dev: SimDevice, arg: _Arg) -> Any:
    if isinstance(arg, tuple):
        ptr, nbytes, dt = arg
        return dev.view(ptr, nbytes).view(dt)
    return arg


def _k_fill(dev: SimDevice, ptr: int, nbytes: int, dt: np.dtype[Any], value: Scalar) -> Callable[[], None]:
    def fill() -> None:
        dev.view(ptr, nbytes).view(dt)[...] = value

    return fill


def _k_arange(
    dev: SimDevice,
    ptr: int,
    nbytes: int,
    dt: np.dtype[Any],
    start: Scalar,
    step: Scalar,
) -> Callable[[], None]:
    def arange() -> None:
        out = dev.view(ptr, nbytes).view(dt)
        ramp: Any = np.arange(out.size, dtype=np.float64 if dt.kind == "f" else np.int64)
        out[...] = ramp * step + start

    return arange


def _k_binary(
    dev: SimDevice,
    fn: Callable[[Any, Any], Any],
    ptr: int,
    nbytes: int,
    dt: np.dtype[Any],
    a: _Arg,
    b: _Arg,
) -> Callable[[], None]:
    def binary() -> None:
        dev.view(ptr, nbytes).view(dt)[...] = fn(_load(dev, a), _load(dev, b))

    return binary


def _k_sum(dev: SimDevice, ptr: int, dt: np.dtype[Any], src: _Arg) -> Callable[[], None]:
    acc = np.float64 if dt.kind == "f" else np.int64

    def total() -> None:
        dev.view(ptr, dt.itemsize).view(dt)[0] = _load(dev, src).sum(dtype=acc)

    return total


def _k_cast(dev: SimDevice, ptr: int, nbytes: int, dt: np.dtype[Any], src: _Arg) -> Callable[[], None]:
    def cast() -> None:
        dev.view(ptr, nbytes).view(dt)[...] = _load(dev, src)

    return cast


class ndarray:
    """A 1-D (or 0-d) array in simulated device memory, owned through a graphpool DeviceBuffer."""

    __slots__ = ("__weakref__", "_buf", "_dev", "_dtype", "_shape")
    __array_ufunc__ = None  # NumPy defers to our operators instead of iterating elements

    def __init__(self, shape: int | tuple[int, ...], dtype: Any = np.float32) -> None:
        self._shape = _shape(shape)
        self._dtype = _dtype(dtype)
        self._dev, _ = _context()
        self._buf = _memory.alloc(self.nbytes)

    # -- attributes -------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> np.dtype[Any]:
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    @property
    def size(self) -> int:
        return math.prod(self._shape)

    @property
    def itemsize(self) -> int:
        return int(self._dtype.itemsize)

    @property
    def nbytes(self) -> int:
        return self.size * int(self._dtype.itemsize)

    @property
    def data(self) -> MemoryPointer:
        return MemoryPointer(self._buf, int(self._buf.ptr))

    @property
    def _ptr(self) -> int:
        return int(self._buf.ptr)

    def _arg(self) -> _Arg:
        return (self._ptr, self.nbytes, self._dtype)

    def _check_backend(self) -> None:
        """Raise BackendReplacedError if ``set_backend`` replaced the backend this array lives on.

        Its address would name other memory on the new backend's devices (a silently wrong
        result). One identity test of the array's stream's handle space.
        """
        self._buf._check_backend()

    def __len__(self) -> int:
        if not self._shape:
            raise TypeError("len() of unsized object")
        return self._shape[0]

    # -- kernels ----------------------------------------------------------------
    def _launch(self, fn: Callable[[], None], name: str) -> None:
        self._check_backend()
        dev, stream = _context()
        if dev is not self._dev:
            raise ValueError(f"array on device {self._dev.index} used while device {dev.index} is current")
        if self.nbytes:
            dev.launch_kernel(stream, fn, name)

    def fill(self, value: Scalar) -> None:
        """Set every element to ``value`` (a kernel on the current stream)."""
        self._launch(_k_fill(self._dev, self._ptr, self.nbytes, self._dtype, value), "fill")

    def copy(self) -> ndarray:
        """A new array with the same contents (a device-to-device copy on the current stream)."""
        self._check_backend()
        out = ndarray(self._shape, self._dtype)
        dev, stream = _context()
        if self.nbytes:
            dev.memcpy(out._ptr, self._ptr, self.nbytes, stream)
        return out

    def astype(self, dtype: Any) -> ndarray:
        """A new array of ``dtype`` holding this one's values."""
        self._check_backend()
        out = ndarray(self._shape, dtype)
        out._launch(_k_cast(self._dev, out._ptr, out.nbytes, out._dtype, self._arg()), "astype")
        return out

    def _binary(
        self,
        other: Any,
        fn: Callable[[Any, Any], Any],
        name: str,
        reflected: bool = False,
    ) -> ndarray:
        self._check_backend()
        if isinstance(other, ndarray):
            other._check_backend()
            if other._dev is not self._dev:
                raise ValueError("operands live on different devices")
            if self._shape and other._shape and self._shape != other._shape:
                raise ValueError(f"operands could not be broadcast together: {self._shape} {other._shape}")
            shape = self._shape or other._shape
            sample: Any = np.ones(1, other._dtype)
            arg: _Arg = other._arg()
        elif isinstance(other, (int, float, bool, np.number)):
            shape, sample, arg = self._shape, other, other
        else:
            raise TypeError(f"unsupported operand for xp.ndarray {name}: {type(other).__name__}")
        mine = np.ones(1, self._dtype)
        dt = (fn(sample, mine) if reflected else fn(mine, sample)).dtype
        out = ndarray(shape, dt)
        a, b = (arg, self._arg()) if reflected else (self._arg(), arg)
        out._launch(_k_binary(self._dev, fn, out._ptr, out.nbytes, out._dtype, a, b), name)
        return out

    def __add__(self, other: Any) -> ndarray:
        return self._binary(other, operator.add, "add")

    def __radd__(self, other: Any) -> ndarray:
        return self._binary(other, operator.add, "add", reflected=True)

    def __sub__(self, other: Any) -> ndarray:
        return self._binary(other, operator.sub, "subtract")

    def __rsub__(self, other: Any) -> ndarray:
        return self._binary(other, operator.sub, "subtract", reflected=True)

    def __mul__(self, other: Any) -> ndarray:
        return self._binary(other, operator.mul, "multiply")

    def __rmul__(self, other: Any) -> ndarray:
        return self._binary(other, operator.mul, "multiply", reflected=True)

    def __neg__(self) -> ndarray:
        return self._binary(-1, operator.mul, "negative")

    def sum(self) -> ndarray:
        """The sum as a 0-d array (accumulated in 64 bits: integer-valued sums are exact)."""
        self._check_backend()
        out = ndarray((), np.ones(1, self._dtype).sum().dtype)
        if not self.nbytes:
            out.fill(0)
            return out
        out._launch(_k_sum(self._dev, out._ptr, out._dtype, self._arg()), "sum")
        return out

    # -- to the host (synchronizing) ------------------------------------------
    def get(self) -> np.ndarray:
        """The contents as a NumPy array; waits for the work of the current stream of the array's
        device (which need not be the current device: CuPy reads across devices too)."""
        self._check_backend()
        if not self.nbytes:
            return np.empty(self._shape, self._dtype)
        dev = self._dev
        stream = int(_streams.current_stream(dev.index).handle)
        raw = dev.read(self._ptr, self.nbytes, stream)
        return np.frombuffer(raw, dtype=self._dtype).copy().reshape(self._shape)

    def item(self) -> Any:
        """The single element as a Python scalar; waits for the current stream's work."""
        if self.size != 1:
            raise ValueError("can only convert an array of size 1 to a Python scalar")
        return self.get().reshape(()).item()

    def __repr__(self) -> str:
        self._check_backend()
        dev = self._dev
        stream = int(_streams.current_stream(dev.index).handle)
        if dev.capture_info(stream)[0] != CAPTURE_STATUS_NONE:  # reading would break the capture
            return f"<xp.ndarray {self._shape} {self._dtype} at {self._ptr:#x} (capturing)>"
        return repr(self.get()).replace("array(", "xp.array(", 1)

    # -- copying and pickling: real copies, as CuPy makes ------------------------
    def __copy__(self) -> ndarray:
        """``copy.copy``: a new array with the same contents, as CuPy's ``__copy__`` gives."""
        return self.copy()

    def __deepcopy__(self, memo: dict[int, Any]) -> ndarray:
        """``copy.deepcopy``: a new array with the same contents (never a second owner)."""
        out = self.copy()
        memo[id(self)] = out
        return out

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickle the contents (read to the host), as CuPy does; unpickling makes a new array."""
        return (asarray, (self.get(), self._dtype.name))


def empty(shape: int | tuple[int, ...], dtype: Any = np.float32) -> ndarray:
    """An uninitialized array (fresh segments hold zeros; reused blocks hold old data)."""
    return ndarray(shape, dtype)


def full(shape: int | tuple[int, ...], fill_value: Scalar, dtype: Any = np.float32) -> ndarray:
    out = ndarray(shape, dtype)
    out.fill(fill_value)
    return out


def zeros(shape: int | tuple[int, ...], dtype: Any = np.float32) -> ndarray:
    return full(shape, 0, dtype)


def ones(shape: int | tuple[int, ...], dtype: Any = np.float32) -> ndarray:
    return full(shape, 1, dtype)


def arange(start: Scalar, stop: Scalar | None = None, step: Scalar = 1, dtype: Any = np.float32) -> ndarray:
    """``start, start + step, ...`` below ``stop`` (``arange(n)`` is 0..n-1); float32 by default."""
    if stop is None:
        start, stop = 0, start
    n = max(0, math.ceil((stop - start) / step))
    out = ndarray(n, dtype)
    out._launch(_k_arange(out._dev, out._ptr, out.nbytes, out._dtype, start, step), "arange")
    return out


def asarray(obj: Any, dtype: Any = None) -> ndarray:
    """A device copy of a host sequence or NumPy array (a write on the current stream)."""
    if isinstance(obj, ndarray) and (dtype is None or np.dtype(dtype) == obj.dtype):
        return obj
    host = np.asarray(obj.get() if isinstance(obj, ndarray) else obj)
    dt = _dtype(dtype if dtype is not None else (host.dtype if host.dtype in _DTYPES else np.float32))
    host = np.ascontiguousarray(host, dtype=dt)
    out = ndarray(host.shape, dt)
    if out.nbytes:
        dev, stream = _context()
        dev.write(out._ptr, host.tobytes(), stream)
    return out


array = asarray

__all__ = [
    "MemoryPointer",
    "arange",
    "array",
    "asarray",
    "empty",
    "float32",
    "float64",
    "full",
    "int32",
    "int64",
    "ndarray",
    "ones",
    "zeros",
]

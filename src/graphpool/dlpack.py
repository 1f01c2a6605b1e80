"""DLPack export of graphpool buffers: zero-copy views for PyTorch, JAX, CuPy and others.

``DeviceBuffer.__dlpack__`` calls ``export``, which builds the DLPack structs with ctypes
and wraps them in a PyCapsule: a legacy ``DLManagedTensor`` ("dltensor"), or, when the
consumer asks for ``max_version >= (1, 0)``, a ``DLManagedTensorVersioned``
("dltensor_versioned"). The exported tensor holds a reference to the DeviceBuffer until
the consumer calls the tensor's deleter, so the memory stays allocated for as long as
the consumer's view lives, whatever happens to the Python buffer object. A capsule that
is never consumed calls the deleter itself when it is collected.

``as_tensor(buf, dtype, shape)`` gives an object whose ``__dlpack__`` exports a typed,
shaped view of the buffer instead of raw bytes::

    t = torch.from_dlpack(graphpool.dlpack.as_tensor(buf, "float32", (n,)))

Nothing here imports a framework; ctypes and NumPy (for dtype parsing) only.
"""

from __future__ import annotations

import ctypes
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from graphpool.device.protocol import LEGACY_STREAM
from graphpool.errors import DoubleFreeError

if TYPE_CHECKING:
    from graphpool.buffer import DeviceBuffer

KDL_CUDA = 2
"""DLPack's device type for CUDA device memory."""

DLPACK_VERSION = (1, 0)
"""The DLPack ABI version of the versioned capsules made here."""

# DLDataTypeCode
_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_COMPLEX, _KDL_BOOL = 0, 1, 2, 5, 6
_CODES = {"i": _KDL_INT, "u": _KDL_UINT, "f": _KDL_FLOAT, "c": _KDL_COMPLEX, "b": _KDL_BOOL}


# -- the DLPack ABI (dlpack.h, v1.x) ------------------------------------------------
class DLDevice(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class DLDataType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class DLTensor(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


_Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
"""``void (*deleter)(DLManagedTensor*)``; the argument is taken as an address."""


class DLManagedTensor(ctypes.Structure):
    _fields_ = (("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter))


class DLPackVersion(ctypes.Structure):
    _fields_ = (("major", ctypes.c_uint32), ("minor", ctypes.c_uint32))


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = (
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", _Deleter),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    )


# -- the Python C API, through private prototypes (never touching ctypes.pythonapi's
#    shared function objects, whose argtypes other code may rely on) -------------------
_api = ctypes.pythonapi
_PyCapsule_Destructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", _api)
)
_PyCapsule_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api)
)
_PyCapsule_GetPointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", _api)
)

_NAME = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"

_live: dict[int, tuple[Any, ...]] = {}
"""Exported tensors not yet deleted: address -> (struct, shape array, buffer).

No lock guards it: a single dict insertion or pop is atomic under the GIL, and a lock
could deadlock when a capsule destructor runs from a garbage collection triggered
while it is held.
"""


def _delete(address: int | None) -> None:
    """The DLPack deleter (for both struct kinds): drop what the export kept alive.

    Dropping the last reference to the DeviceBuffer frees it through its finalizer,
    which only queues the free: no lock is taken here, whichever thread calls.
    """
    if address is None:
        return
    try:
        kept = _live.pop(address, None)
    except Exception:  # interpreter shutdown: module globals already gone
        return
    del kept


_deleter = _Deleter(_delete)


def _capsule_destructor(capsule: int | None) -> None:
    """Called when a capsule is collected: delete the tensor if no consumer took it."""
    if capsule is None:
        return
    try:
        for name in (_NAME, _NAME_VERSIONED):
            if _PyCapsule_IsValid(capsule, name):
                _delete(_PyCapsule_GetPointer(capsule, name))
                return
    except Exception:  # a destructor never raises
        pass


_destructor = _PyCapsule_Destructor(_capsule_destructor)


# -- export ---------------------------------------------------------------------------
def _dl_dtype(dtype: Any) -> DLDataType:
    dt = np.dtype(dtype)
    code = _CODES.get(dt.kind)
    if code is None or dt.fields is not None or dt.subdtype is not None:
        raise TypeError(f"no DLPack type code for dtype {dt}")
    return DLDataType(code, dt.itemsize * 8, 1)


def _consumer_stream(stream: Any) -> int | None:
    """The graphpool stream handle named by a DLPack ``stream`` argument (None: no sync)."""
    if stream is None or stream == 1:
        return LEGACY_STREAM  # absent or 1: the legacy default stream
    if not isinstance(stream, int):
        raise TypeError(f"DLPack stream must be an int or None, not {type(stream).__name__}")
    if stream == -1:
        return None  # the consumer asks for no synchronization
    if stream == 0:
        raise ValueError("DLPack stream 0 is ambiguous for CUDA: pass 1 for the legacy default stream")
    if not 0 < stream < 1 << 64:
        raise ValueError(f"DLPack stream must be -1, None or a CUDA stream handle, not {stream}")
    return int(stream)


def _synchronize(buf: DeviceBuffer, consumer: int | None) -> None:
    """Make ``consumer`` wait for the work queued so far on the buffer's stream."""
    if consumer is None or consumer == buf.stream.handle:
        return
    from graphpool.streams import Event, Stream

    event = Event(device=buf.device)
    event.record(buf.stream)
    Stream._wrap(buf.device, consumer).wait_event(event)


def export(
    buf: DeviceBuffer,
    *,
    stream: Any = None,
    max_version: tuple[int, int] | None = None,
    dl_device: tuple[int, int] | None = None,
    copy: bool | None = None,
    dtype: Any = np.uint8,
    shape: tuple[int, ...] | None = None,
    byte_offset: int = 0,
) -> Any:
    """A DLPack capsule viewing ``buf`` (default: ``nbytes`` uint8 values), zero-copy.

    ``stream``, ``max_version``, ``dl_device`` and ``copy`` follow the Python array API's
    ``__dlpack__``. ``dtype``, ``shape`` and ``byte_offset`` select a typed C-contiguous
    view inside the buffer. The capsule keeps ``buf`` allocated until the consumer's
    deleter call (or the capsule's collection, if it was never consumed).
    """
    if copy:
        raise BufferError("graphpool exports device memory zero-copy only (copy=True asked for a copy)")
    if buf.freed:
        raise DoubleFreeError(f"buffer at 0x{buf.ptr:x} was freed")
    if dl_device is not None and tuple(dl_device) != (KDL_CUDA, buf.device):
        raise BufferError(
            f"graphpool buffers live on (kDLCUDA=2, {buf.device}); cannot export to device {dl_device}"
        )
    dl_type = _dl_dtype(dtype)
    itemsize = dl_type.bits // 8
    if shape is None:
        if (buf.nbytes - byte_offset) % itemsize:
            raise ValueError(f"{buf.nbytes - byte_offset} bytes do not hold a whole number of {dtype}")
        shape = ((buf.nbytes - byte_offset) // itemsize,)
    shape = tuple(int(n) for n in shape)
    if any(n < 0 for n in shape):
        raise ValueError(f"negative dimension in shape {shape}")
    if byte_offset < 0 or byte_offset + math.prod(shape) * itemsize > buf.nbytes:
        raise ValueError(
            f"a view of shape {shape} of {np.dtype(dtype)} at offset {byte_offset} does not fit "
            f"in a buffer of {buf.nbytes} bytes"
        )
    consumer = _consumer_stream(stream)
    _synchronize(buf, consumer)

    versioned = max_version is not None and int(max_version[0]) >= 1
    managed: DLManagedTensor | DLManagedTensorVersioned
    if versioned:
        managed = DLManagedTensorVersioned()
        managed.version = DLPackVersion(*DLPACK_VERSION)
        managed.flags = 0
        name = _NAME_VERSIONED
    else:
        managed = DLManagedTensor()
        name = _NAME
    dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    t = managed.dl_tensor
    t.data = buf.ptr
    t.device = DLDevice(KDL_CUDA, buf.device)
    t.ndim = len(shape)
    t.dtype = dl_type
    t.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    t.strides = None  # compact row-major
    t.byte_offset = byte_offset
    managed.manager_ctx = None
    managed.deleter = _deleter
    address = ctypes.addressof(managed)
    kept = (managed, dims, buf)
    _live[address] = kept
    try:
        return _PyCapsule_New(address, name, ctypes.cast(_destructor, ctypes.c_void_p))
    except BaseException:
        _delete(address)
        raise


def live_exports() -> int:
    """Number of exported tensors whose deleter has not run yet (for tests and leak hunts)."""
    return len(_live)


class TensorView:
    """A typed, shaped view of a DeviceBuffer that frameworks import through DLPack.

    Holds the buffer; ``__dlpack__`` exports ``shape`` values of ``dtype`` starting at
    ``byte_offset``, C-contiguous. Make it with ``as_tensor``.
    """

    __slots__ = ("buffer", "byte_offset", "dtype", "shape")

    def __init__(self, buf: DeviceBuffer, dtype: Any, shape: tuple[int, ...], byte_offset: int = 0) -> None:
        self.buffer = buf
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(n) for n in shape)
        self.byte_offset = int(byte_offset)
        _dl_dtype(self.dtype)
        end = self.byte_offset + math.prod(self.shape) * self.dtype.itemsize
        if self.byte_offset < 0 or end > buf.nbytes:
            raise ValueError(
                f"a view of shape {self.shape} of {self.dtype} at offset {self.byte_offset} does not fit "
                f"in a buffer of {buf.nbytes} bytes"
            )

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """A capsule of this view (see ``export``)."""
        return export(
            self.buffer,
            stream=stream,
            max_version=max_version,
            dl_device=dl_device,
            copy=copy,
            dtype=self.dtype,
            shape=self.shape,
            byte_offset=self.byte_offset,
        )

    def __dlpack_device__(self) -> tuple[int, int]:
        """(kDLCUDA, device index)."""
        return (KDL_CUDA, self.buffer.device)

    def __repr__(self) -> str:
        return f"<graphpool.dlpack.TensorView {self.shape} {self.dtype} of {self.buffer!r}>"


def as_tensor(
    buf: DeviceBuffer, dtype: Any, shape: int | tuple[int, ...] | None = None, byte_offset: int = 0
) -> TensorView:
    """View ``buf`` as a C-contiguous array of ``dtype`` (default shape: as many as fit)."""
    dt = np.dtype(dtype)
    if shape is None:
        shape = ((buf.nbytes - byte_offset) // dt.itemsize,)
    elif isinstance(shape, int):
        shape = (shape,)
    return TensorView(buf, dt, shape, byte_offset)


__all__ = [
    "DLPACK_VERSION",
    "KDL_CUDA",
    "DLDataType",
    "DLDevice",
    "DLManagedTensor",
    "DLManagedTensorVersioned",
    "DLPackVersion",
    "DLTensor",
    "TensorView",
    "as_tensor",
    "export",
    "live_exports",
]

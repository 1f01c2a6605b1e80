"""DLPack export of graphpool buffers: zero-copy views for PyTorch, JAX, CuPy and others.

``DeviceBuffer.__dlpack__`` calls ``export``, which builds the DLPack structs with ctypes
and wraps them in a PyCapsule: a legacy ``DLManagedTensor`` ("dltensor"), or, when the
consumer asks for ``max_version >= (1, 0)``, a ``DLManagedTensorVersioned``
("dltensor_versioned"). The exported tensor holds a reference to the DeviceBuffer until
the consumer calls the tensor's deleter, so the memory stays allocated for as long as
the consumer's view lives, whatever happens to the Python buffer object.

A capsule nobody consumed (a consumer that refused it, as ``np.from_dlpack`` refuses
device memory, or one simply dropped) releases its export too, but not from a capsule
destructor: a consumer that refuses usually sets its error and then drops the capsule, so
a destructor runs with that error pending, where Python code can neither call the C API
reliably nor hand the error back (a ctypes callback always clears it, and the consumer
then fails with a SystemError). Instead graphpool keeps a reference to every capsule it
hands out and lets go of those that nobody else holds any more at safe points: the next
export, ``live_exports()`` and every garbage collection (``gc.callbacks``). A consumed
capsule (renamed "used_dltensor") is let go of as it is; an unconsumed one releases its
export then. The capsule has no destructor, so no graphpool code runs inside a consumer's
error path, and the consumer's own error reaches the caller.

``as_tensor(buf, dtype, shape)`` gives an object whose ``__dlpack__`` exports a typed,
shaped view of the buffer instead of raw bytes::

    t = torch.from_dlpack(graphpool.dlpack.as_tensor(buf, "float32", (n,)))

Nothing here imports a framework; ctypes and NumPy (for dtype parsing) only.
"""

from __future__ import annotations

import ctypes
import gc
import math
import operator
import sys
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
_PyCapsule_New = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", _api)
)
_PyCapsule_IsValid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_IsValid", _api)
)
_PyErr_Occurred = ctypes.PYFUNCTYPE(ctypes.c_void_p)(("PyErr_Occurred", _api))
"""Called through ctypes' Python-API convention, which raises a pending error into the
caller: the deleter's way to take an error its C caller left pending (see ``_delete``)."""

_NAME = b"dltensor"
_NAME_VERSIONED = b"dltensor_versioned"

_live: dict[int, tuple[Any, ...]] = {}
"""Exported tensors not yet deleted: address -> (struct, shape array, buffer).

No lock guards it (nor ``_held``): a single dict insertion or pop is atomic under the GIL,
and a lock could deadlock when a deleter or a sweep runs from a garbage collection
triggered while it is held.
"""

_held: dict[int, Any] = {}
"""The capsules handed out that someone else may still hold: address -> capsule (module
docstring). ``_sweep`` lets go of those that only this dict holds."""


def _refs(holder: dict[int, Any], key: int) -> int:
    return sys.getrefcount(holder[key])


_ONLY_HELD = _refs({0: object()}, 0)
"""What ``_refs`` counts for an object that only the dict holds (measured, not assumed: the
count includes the interpreter's own temporary references, which vary between versions)."""


def _delete(address: int | None) -> None:
    """The DLPack deleter (for both struct kinds): drop what the export kept alive.

    Consumers call it from C, possibly with an error of theirs pending (a consumer that
    fails after it took the tensor). Python code cannot run reliably then, so the error is
    taken first (ctypes raises it here), the export released, and the error raised again
    at the end: ctypes then reports it as unraisable (it cannot be handed back to the
    consumer). Dropping the last reference to the DeviceBuffer frees it through its
    finalizer, which only queues the free: no lock is taken here, whichever thread calls.
    """
    pending: BaseException | None = None
    try:
        _PyErr_Occurred()
    except BaseException as exc:
        pending = exc
    if address is None:
        return
    try:
        _held.pop(address, None)
        kept = _live.pop(address, None)
    except Exception:  # interpreter shutdown: module globals already gone
        return
    del kept
    if pending is not None:
        raise pending


_deleter = _Deleter(_delete)


def _sweep() -> None:
    """Let go of the capsules that nobody else holds; release the exports of the unconsumed
    ones (a consumer renames a capsule it takes). Runs at safe points only (module docstring)."""
    for address in list(_held):
        try:
            if _refs(_held, address) > _ONLY_HELD:
                continue  # still held by a consumer or the caller
            capsule = _held.pop(address)
        except KeyError:  # another thread let go of it meanwhile
            continue
        if _PyCapsule_IsValid(capsule, _NAME) or _PyCapsule_IsValid(capsule, _NAME_VERSIONED):
            _delete(address)  # never consumed: nobody will call the deleter
        del capsule


def _after_collection(phase: str, info: dict[str, int]) -> None:
    """``gc.callbacks`` entry: a collection is a safe point to let go of dropped capsules."""
    if phase == "stop" and _held:
        try:
            _sweep()
        except Exception:  # a gc callback never raises (interpreter shutdown, say)
            pass


gc.callbacks.append(_after_collection)


# -- export ---------------------------------------------------------------------------
def _buffer(buf: Any, what: str) -> DeviceBuffer:
    """``buf`` if it is a live DeviceBuffer: TypeError for another object, DoubleFreeError if freed."""
    # Told by its class, not imported: graphpool.buffer calls into this module (__dlpack__),
    # and the import graph has no cycles. Nothing subclasses DeviceBuffer.
    cls = type(buf)
    if (cls.__name__, cls.__module__) not in (
        ("DeviceBuffer", "graphpool.buffer"),
        ("IpcBuffer", "graphpool.ipc"),
    ):
        raise TypeError(f"{what} needs a graphpool DeviceBuffer (from gp.alloc), not {type(buf).__name__}")
    if buf.freed:
        raise DoubleFreeError(f"buffer at 0x{buf.ptr:x} was freed")
    checked: DeviceBuffer = buf
    return checked


def _view_dtype(dtype: Any) -> tuple[np.dtype[Any], DLDataType]:
    """``dtype`` as a NumPy dtype and its DLPack type; TypeError if it has none."""
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"dtype {dtype!r} is not a NumPy dtype ({exc})") from None
    code = _CODES.get(dt.kind)
    # DLDataType.bits is a uint8: a wider dtype (complex256) would wrap around silently
    if code is None or dt.fields is not None or dt.subdtype is not None or not 0 < dt.itemsize * 8 < 256:
        raise TypeError(f"dtype {dt} has no DLPack type: use a bool, int, uint, float or complex dtype")
    return dt, DLDataType(code, dt.itemsize * 8, 1)


def _count(value: Any, what: str) -> int:
    """An int argument (``operator.index``; a bool is refused): TypeError naming ``what``."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{what} must be an int, not {type(value).__name__}")
    return operator.index(value)


def _view(
    buf: DeviceBuffer, dtype: Any, shape: Any, byte_offset: Any, whole: bool
) -> tuple[np.dtype[Any], DLDataType, tuple[int, ...], int]:
    """Check a typed view of ``buf``: (dtype, its DLPack type, shape, byte offset).

    ``shape`` None: as many values as fit after the offset (``whole``: the bytes must hold a
    whole number of them). TypeError for wrong types, ValueError for a view that does not
    fit in the buffer, naming the argument.
    """
    dt, dl_type = _view_dtype(dtype)
    offset = _count(byte_offset, "byte_offset")
    if not 0 <= offset <= buf.nbytes:
        raise ValueError(f"byte_offset {offset} is outside the buffer's {buf.nbytes} bytes")
    if shape is None:
        room = buf.nbytes - offset
        if whole and room % dt.itemsize:
            raise ValueError(f"{room} bytes do not hold a whole number of {dt}")
        dims: tuple[int, ...] = (room // dt.itemsize,)
    elif isinstance(shape, tuple | list):
        dims = tuple(_count(n, "each dimension of shape") for n in shape)
    elif hasattr(shape, "__index__") and not isinstance(shape, bool):
        dims = (operator.index(shape),)
    else:
        raise TypeError(f"shape must be an int or a tuple of ints, not {type(shape).__name__}")
    if any(n < 0 for n in dims):
        raise ValueError(f"negative dimension in shape {dims}")
    if offset + math.prod(dims) * dt.itemsize > buf.nbytes:
        raise ValueError(
            f"a view of shape {dims} of {dt} at offset {offset} does not fit in a buffer of "
            f"{buf.nbytes} bytes"
        )
    return dt, dl_type, dims, offset


def _pair(value: Any, what: str) -> tuple[int, int]:
    """A DLPack ``(a, b)`` argument (``max_version``, ``dl_device``): TypeError otherwise."""
    if not isinstance(value, tuple | list) or len(value) != 2:
        raise TypeError(f"{what} must be a tuple of two ints, not {value!r}")
    return _count(value[0], what), _count(value[1], what)


def _consumer_stream(stream: Any) -> int | None:
    """The graphpool stream handle named by a DLPack ``stream`` argument (None: no sync)."""
    if stream is None:
        return LEGACY_STREAM  # absent: the legacy default stream
    if isinstance(stream, bool) or not isinstance(stream, int):
        raise TypeError(f"DLPack stream must be an int or None, not {type(stream).__name__}")
    if stream == 1:
        return LEGACY_STREAM  # 1 names the legacy default stream
    if stream == -1:
        return None  # the consumer asks for no synchronization
    if stream == 0:
        raise ValueError("DLPack stream 0 is ambiguous for CUDA: pass 1 for the legacy default stream")
    if not 0 < stream < 1 << 64:
        raise ValueError(f"DLPack stream must be -1, None or a CUDA stream handle, not {stream}")
    return int(stream)


def _synchronize(buf: DeviceBuffer, consumer: int | None) -> None:
    """Make ``consumer`` wait for the work queued so far on the buffer's stream."""
    if consumer is None or getattr(buf, "stream", None) is None or consumer == buf.stream.handle:
        return  # an IpcBuffer has no stream here: the exporter's work is the sender's to finish
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
    deleter call (or, if nobody consumed it, until nobody holds it: module docstring).
    Every argument is checked before anything is made: TypeError, ValueError or
    BufferError naming it.
    """
    _sweep()
    buf = _buffer(buf, "graphpool.dlpack.export")
    if copy is not None and not isinstance(copy, bool):
        raise TypeError(f"copy must be True, False or None, not {copy!r}")
    if copy:
        raise BufferError("graphpool exports device memory zero-copy only (copy=True asked for a copy)")
    version = None if max_version is None else _pair(max_version, "max_version")
    if dl_device is not None and _pair(dl_device, "dl_device") != (KDL_CUDA, buf.device):
        raise BufferError(
            f"graphpool buffers live on (kDLCUDA=2, {buf.device}); cannot export to device {dl_device}"
        )
    _, dl_type, dims, offset = _view(buf, dtype, shape, byte_offset, whole=True)
    consumer = _consumer_stream(stream)
    _synchronize(buf, consumer)

    versioned = version is not None and version[0] >= 1
    managed: DLManagedTensor | DLManagedTensorVersioned
    if versioned:
        managed = DLManagedTensorVersioned()
        managed.version = DLPackVersion(*DLPACK_VERSION)
        managed.flags = 0
        name = _NAME_VERSIONED
    else:
        managed = DLManagedTensor()
        name = _NAME
    shape_array = (ctypes.c_int64 * max(len(dims), 1))(*dims)
    t = managed.dl_tensor
    t.data = buf.ptr
    t.device = DLDevice(KDL_CUDA, buf.device)
    t.ndim = len(dims)
    t.dtype = dl_type
    t.shape = ctypes.cast(shape_array, ctypes.POINTER(ctypes.c_int64))
    t.strides = None  # compact row-major
    t.byte_offset = offset
    managed.manager_ctx = None
    managed.deleter = _deleter
    address = ctypes.addressof(managed)
    kept = (managed, shape_array, buf)
    _live[address] = kept
    try:
        capsule = _PyCapsule_New(address, name, None)  # no destructor (module docstring)
        _held[address] = capsule
    except BaseException:
        _delete(address)
        raise
    return capsule


def live_exports() -> int:
    """Number of exported tensors whose deleter has not run yet (for tests and leak hunts).

    Lets go of the capsules nobody holds first, so an export nobody took is not counted.
    """
    _sweep()
    return len(_live)


class TensorView:
    """A typed, shaped view of a DeviceBuffer that frameworks import through DLPack.

    Holds the buffer; ``__dlpack__`` exports ``shape`` values of ``dtype`` starting at
    ``byte_offset``, C-contiguous. Make it with ``as_tensor``.
    """

    __slots__ = ("buffer", "byte_offset", "dtype", "shape")

    def __init__(
        self, buf: DeviceBuffer, dtype: Any, shape: int | tuple[int, ...] | None, byte_offset: int = 0
    ) -> None:
        self.buffer = _buffer(buf, "graphpool.dlpack.TensorView")
        self.dtype, _, self.shape, self.byte_offset = _view(buf, dtype, shape, byte_offset, whole=False)

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
    """View ``buf`` as a C-contiguous array of ``dtype`` (default shape: as many as fit).

    TypeError for a wrong type of argument (not a DeviceBuffer, a dtype without a DLPack
    type, a shape that is not an int or a tuple of ints), ValueError for a view that does
    not fit in the buffer (a negative dimension or offset, too many values), each naming
    the argument; DoubleFreeError for a freed buffer.
    """
    return TensorView(_buffer(buf, "graphpool.dlpack.as_tensor"), dtype, shape, byte_offset)


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

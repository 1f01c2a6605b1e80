"""DLPack export of DeviceBuffers (graphpool.dlpack).

On the simulator the capsule is parsed with ctypes against dlpack.h's layout, written out
again here so that a layout slip in graphpool.dlpack shows up. On a GPU, PyTorch and JAX
import buffers zero-copy.
"""

from __future__ import annotations

import ctypes
import gc
import os
import sys
import weakref
from typing import Any

import pytest

import graphpool as gp
from gpu_guard import cuda_unusable
from graphpool import dlpack, runtime

# -- dlpack.h, independently -----------------------------------------------------------


class _Device(ctypes.Structure):
    _fields_ = (("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32))


class _DType(ctypes.Structure):
    _fields_ = (("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16))


class _Tensor(ctypes.Structure):
    _fields_ = (
        ("data", ctypes.c_void_p),
        ("device", _Device),
        ("ndim", ctypes.c_int32),
        ("dtype", _DType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    )


_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class _Managed(ctypes.Structure):
    _fields_ = (("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p))


class _Version(ctypes.Structure):
    _fields_ = (("major", ctypes.c_uint32), ("minor", ctypes.c_uint32))


class _ManagedVersioned(ctypes.Structure):
    _fields_ = (
        ("version", _Version),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", _Tensor),
    )


_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi)
)
_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", ctypes.pythonapi)
)
_get_name = ctypes.PYFUNCTYPE(ctypes.c_char_p, ctypes.py_object)(("PyCapsule_GetName", ctypes.pythonapi))
_USED = b"used_dltensor"
_USED_VERSIONED = b"used_dltensor_versioned"


def _consume(capsule: Any, versioned: bool = False) -> tuple[int, Any]:
    """Do what a consumer does: take the pointer and rename the capsule. Returns (address, struct)."""
    name = b"dltensor_versioned" if versioned else b"dltensor"
    assert _get_name(capsule) == name
    address = _get_pointer(capsule, name)
    assert address
    _set_name(capsule, _USED_VERSIONED if versioned else _USED)
    kind = _ManagedVersioned if versioned else _Managed
    return address, kind.from_address(address)


def _call_deleter(managed: Any, address: int) -> None:
    _DELETER(managed.deleter)(address)


@pytest.fixture
def sim_backend() -> Any:
    gp.set_backend("sim")
    yield runtime.get()
    gc.collect()
    gp.synchronize()
    gp.empty_cache()
    gp.check_invariants()


# -- simulator -------------------------------------------------------------------------


def test_legacy_capsule_describes_the_buffer(sim_backend: Any) -> None:
    buf = gp.alloc(1000)
    assert buf.__dlpack_device__() == (2, 0)
    cap = buf.__dlpack__()
    address, m = _consume(cap)
    t = m.dl_tensor
    assert t.data == buf.ptr
    assert (t.device.device_type, t.device.device_id) == (2, buf.device)
    assert t.ndim == 1
    assert t.shape[0] == 1000
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (1, 8, 1)  # kDLUInt, 8 bits
    assert not t.strides  # NULL: compact row-major
    assert t.byte_offset == 0
    assert m.deleter
    _call_deleter(m, address)


def test_versioned_capsule_when_asked(sim_backend: Any) -> None:
    buf = gp.alloc(4096)
    cap = buf.__dlpack__(max_version=(1, 1))
    address, m = _consume(cap, versioned=True)
    assert (m.version.major, m.version.minor) == dlpack.DLPACK_VERSION
    assert m.version.major == 1
    assert m.flags == 0
    t = m.dl_tensor
    assert t.data == buf.ptr and t.ndim == 1 and t.shape[0] == 4096
    assert (t.device.device_type, t.device.device_id) == (2, 0)
    _call_deleter(m, address)
    # a consumer that only knows DLPack 0.x gets the legacy struct
    old = buf.__dlpack__(max_version=(0, 8))
    assert _get_name(old) == b"dltensor"


@pytest.mark.parametrize("versioned", [False, True])
def test_consumer_keeps_buffer_alive_until_deleter(sim_backend: Any, versioned: bool) -> None:
    gc.collect()
    base = gp.memory_allocated()
    live = dlpack.live_exports()
    buf = gp.alloc(8192)
    ptr = buf.ptr
    cap = buf.__dlpack__(max_version=(1, 0) if versioned else None)
    address, m = _consume(cap, versioned)
    del buf, cap
    gc.collect()
    assert gp.memory_allocated() == base + 8192  # the consumer's view holds it
    assert dlpack.live_exports() == live + 1
    assert m.dl_tensor.data == ptr
    _call_deleter(m, address)
    gc.collect()
    assert gp.memory_allocated() == base
    assert dlpack.live_exports() == live


@pytest.mark.parametrize("versioned", [False, True])
def test_unconsumed_capsule_frees_on_collection(sim_backend: Any, versioned: bool) -> None:
    gc.collect()
    base = gp.memory_allocated()
    buf = gp.alloc(8192)
    cap = buf.__dlpack__(max_version=(1, 0) if versioned else None)
    del buf
    gc.collect()
    assert gp.memory_allocated() == base + 8192  # the capsule holds it
    del cap
    gc.collect()
    assert gp.memory_allocated() == base


def test_consumed_capsule_collection_does_not_delete(sim_backend: Any) -> None:
    gc.collect()
    base = gp.memory_allocated()
    buf = gp.alloc(512)
    cap = buf.__dlpack__()
    address, m = _consume(cap)
    del cap, buf
    gc.collect()
    assert gp.memory_allocated() == base + 512  # renamed: the consumer owns it now
    _call_deleter(m, address)
    assert gp.memory_allocated() == base


def test_refusals(sim_backend: Any) -> None:
    buf = gp.alloc(64)
    with pytest.raises(BufferError):
        buf.__dlpack__(copy=True)
    with pytest.raises(BufferError):
        buf.__dlpack__(dl_device=(1, 0))  # kDLCPU
    with pytest.raises(BufferError):
        buf.__dlpack__(dl_device=(2, 5))
    with pytest.raises(ValueError):
        buf.__dlpack__(stream=0)
    cap = buf.__dlpack__(dl_device=(2, 0), copy=False)
    assert _get_name(cap) == b"dltensor"
    del cap
    buf.free()
    with pytest.raises(gp.DoubleFreeError):
        buf.__dlpack__()


def test_consumer_stream_waits_for_the_buffer_stream(sim_backend: Any) -> None:
    dev = runtime.get().device(0)
    s = gp.Stream()
    buf = gp.alloc(1024, stream=s)
    dev.launch_sleep(s.handle, rounds=5)  # type: ignore[attr-defined]
    dev.memset(buf.ptr, 7, 1024, s.handle)
    cap = buf.__dlpack__(stream=1)  # the consumer works on the legacy default stream
    # reading on the legacy stream runs what it waits for: s's memset
    assert set(dev.read(buf.ptr, 1024, 0)) == {7}
    del cap
    other = gp.Stream()
    dev.memset(buf.ptr, 9, 1024, s.handle)
    cap = buf.__dlpack__(stream=other.handle)
    assert set(dev.read(buf.ptr, 1024, other.handle)) == {9}
    del cap
    gp.synchronize()


def test_typed_view(sim_backend: Any) -> None:
    buf = gp.alloc(4096)
    view = dlpack.as_tensor(buf, "float32", (10, 4), byte_offset=512)
    assert view.__dlpack_device__() == (2, 0)
    address, m = _consume(view.__dlpack__())
    t = m.dl_tensor
    assert t.data == buf.ptr and t.byte_offset == 512
    assert t.ndim == 2 and (t.shape[0], t.shape[1]) == (10, 4)
    assert (t.dtype.code, t.dtype.bits, t.dtype.lanes) == (2, 32, 1)  # kDLFloat
    _call_deleter(m, address)
    assert dlpack.as_tensor(buf, "int64").shape == (512,)
    with pytest.raises(ValueError):
        dlpack.as_tensor(buf, "float64", (1000,))


# -- consumers that refuse -------------------------------------------------------------


def _settled() -> tuple[int, int]:
    gc.collect()
    return gp.memory_allocated(), dlpack.live_exports()


@pytest.mark.parametrize("view", ["buffer", "versioned", "typed", "too many dimensions"])
def test_numpy_refusing_a_device_buffer_leaves_nothing_behind(sim_backend: Any, view: str) -> None:
    """NumPy refuses device memory: it sets its error and then drops the capsule. Its own
    error must reach the caller (not a SystemError), and the export must be released."""
    np = pytest.importorskip("numpy")
    base = _settled()
    buf = gp.alloc(1 << 20)
    source: Any = {
        "buffer": buf,
        "versioned": buf,
        "typed": dlpack.as_tensor(buf, "float32", (16, 4)),
        "too many dimensions": dlpack.as_tensor(buf, "uint8", (1,) * 70),  # refused before the device
    }[view]
    with pytest.raises((RuntimeError, BufferError, ValueError, TypeError)) as info:
        np.from_dlpack(source)
    assert not isinstance(info.value, SystemError), info.value
    assert str(info.value)
    del buf, source
    assert dlpack.live_exports() == base[1]  # nothing left behind, even before a collection
    assert _settled() == base


def test_an_unconsumed_capsule_is_released_once_nobody_holds_it(sim_backend: Any) -> None:
    base = _settled()
    gc.disable()  # released without a collection too: at the next export
    try:
        buf = gp.alloc(4096)
        cap = buf.__dlpack__()
        kept = [buf.__dlpack__()]  # still held: must not be released
        del cap
        other = buf.__dlpack__()
        assert dlpack.live_exports() == base[1] + 2  # kept and other
        address, m = _consume(kept[0])  # a consumer takes it later: the struct is still valid
        assert m.dl_tensor.data == buf.ptr
        del kept, other
        assert dlpack.live_exports() == base[1] + 1  # the consumed one waits for its deleter
        _call_deleter(m, address)
        assert dlpack.live_exports() == base[1]
        del buf
    finally:
        gc.enable()
    assert _settled() == base


def test_the_deleter_releases_when_its_caller_has_an_error_pending(
    sim_backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A consumer may call the deleter from C with its own error pending. Made here by giving
    NumPy a capsule whose destructor is graphpool's deleter: NumPy refuses the device, sets
    its error, drops the capsule. The deleter must still release what it keeps, and report
    the consumer's error (ctypes cannot hand it back; NumPy then raises a SystemError)."""
    np = pytest.importorskip("numpy")

    class Kept:
        pass

    managed = _Managed()
    dims = (ctypes.c_int64 * 1)(16)
    managed.dl_tensor.device = _Device(2, 0)
    managed.dl_tensor.ndim = 1
    managed.dl_tensor.dtype = _DType(1, 8, 1)
    managed.dl_tensor.shape = ctypes.cast(dims, ctypes.POINTER(ctypes.c_int64))
    capsule = dlpack._PyCapsule_New(
        ctypes.addressof(managed), b"dltensor", ctypes.cast(dlpack._deleter, ctypes.c_void_p)
    )
    key = id(capsule)  # what the destructor (the deleter here) is given
    kept = Kept()
    gone = weakref.ref(kept)
    dlpack._live[key] = (kept,)
    del kept
    handed = [capsule]
    del capsule

    class Producer:
        def __dlpack__(self, **kwargs: Any) -> Any:
            return handed.pop()

        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)

    seen: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    with pytest.raises(SystemError):
        np.from_dlpack(Producer())
    assert key not in dlpack._live and gone() is None  # released
    assert [type(u.exc_value) for u in seen] == [RuntimeError], seen
    assert "Unsupported device" in str(seen[0].exc_value)  # NumPy's own error, reported


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda b: dlpack.as_tensor("buf", "float32"), TypeError, "DeviceBuffer"),
        (lambda b: dlpack.as_tensor(None, "float32", 4), TypeError, "DeviceBuffer"),
        (lambda b: dlpack.export(b"x"), TypeError, "DeviceBuffer"),
        (lambda b: dlpack.TensorView(3, "uint8", (1,)), TypeError, "DeviceBuffer"),
        (lambda b: dlpack.as_tensor(b, []), TypeError, "no DLPack type"),
        (lambda b: dlpack.as_tensor(b, "nonsense"), TypeError, "not a NumPy dtype"),
        (lambda b: dlpack.as_tensor(b, object), TypeError, "no DLPack type"),
        (lambda b: dlpack.as_tensor(b, "complex256"), TypeError, "DLPack type|NumPy dtype"),  # 256 bits
        (lambda b: dlpack.as_tensor(b, "float32", "x"), TypeError, "shape"),
        (lambda b: dlpack.as_tensor(b, "float32", 2.0), TypeError, "shape"),
        (lambda b: dlpack.as_tensor(b, "float32", (2, "3")), TypeError, "dimension"),
        (lambda b: dlpack.as_tensor(b, "float32", (True,)), TypeError, "dimension"),
        (lambda b: dlpack.as_tensor(b, "float32", (-1,)), ValueError, "negative"),
        (lambda b: dlpack.as_tensor(b, "float32", (-4, -4)), ValueError, "negative"),
        (lambda b: dlpack.as_tensor(b, "uint8", None, 2**64), ValueError, "byte_offset"),
        (lambda b: dlpack.as_tensor(b, "uint8", (0,), 2**64), ValueError, "byte_offset"),
        (lambda b: dlpack.as_tensor(b, "uint8", None, -1), ValueError, "byte_offset"),
        (lambda b: dlpack.as_tensor(b, "uint8", None, "0"), TypeError, "byte_offset"),
        (lambda b: dlpack.as_tensor(b, "float64", (1000,)), ValueError, "does not fit"),
        (lambda b: b.__dlpack__(max_version="a"), TypeError, "max_version"),
        (lambda b: b.__dlpack__(max_version=5), TypeError, "max_version"),
        (lambda b: b.__dlpack__(max_version=(1, "0")), TypeError, "max_version"),
        (lambda b: b.__dlpack__(dl_device="cuda"), TypeError, "dl_device"),
        (lambda b: b.__dlpack__(dl_device=7), TypeError, "dl_device"),
        (lambda b: b.__dlpack__(copy="no"), TypeError, "copy"),
        (lambda b: b.__dlpack__(stream=True), TypeError, "stream"),
        (lambda b: b.__dlpack__(stream=2**64), ValueError, "stream"),
        (lambda b: dlpack.export(b, dtype="float32", shape=(-2,)), ValueError, "negative"),
        (lambda b: dlpack.export(b, byte_offset=2**64), ValueError, "byte_offset"),
    ],
    ids=[
        "as_tensor-str",
        "as_tensor-None",
        "export-bytes",
        "TensorView-int",
        "dtype-list",
        "dtype-unknown",
        "dtype-object",
        "dtype-256-bits",
        "shape-str",
        "shape-float",
        "shape-str-dim",
        "shape-bool-dim",
        "shape-negative",
        "shape-negatives",
        "offset-2**64",
        "offset-2**64-empty",
        "offset-negative",
        "offset-str",
        "too-big",
        "max_version-str",
        "max_version-int",
        "max_version-str-minor",
        "dl_device-str",
        "dl_device-int",
        "copy-str",
        "stream-bool",
        "stream-2**64",
        "export-negative",
        "export-offset-2**64",
    ],
)
def test_wrong_arguments_are_typed_errors_that_name_them(
    sim_backend: Any, call: Any, error: type[Exception], match: str
) -> None:
    buf = gp.alloc(4096)
    live = dlpack.live_exports()
    with pytest.raises(error, match=match):
        call(buf)
    assert dlpack.live_exports() == live  # nothing made


def test_a_freed_buffer_cannot_be_viewed(sim_backend: Any) -> None:
    buf = gp.alloc(64)
    buf.free()
    with pytest.raises(gp.DoubleFreeError):
        dlpack.as_tensor(buf, "uint8")
    with pytest.raises(gp.DoubleFreeError):
        dlpack.export(buf)


def test_jax_without_a_gpu_refuses_and_leaves_nothing_behind(sim_backend: Any) -> None:
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("jax has a GPU here: see test_jax_views_the_buffer")
    base = _settled()
    buf = gp.alloc(4096)
    for source in (buf, dlpack.as_tensor(buf, "int32", (1024,))):
        with pytest.raises(Exception) as info:  # JAX's own error, whichever it is
            jnp.from_dlpack(source)
        assert not isinstance(info.value, SystemError | AttributeError), info.value
    del buf, source, info  # (its traceback holds JAX's frames, which hold the buffer)
    assert _settled() == base


# -- GPU -------------------------------------------------------------------------------


@pytest.fixture
def cuda_backend() -> Any:
    reason = cuda_unusable()
    if reason is not None:
        pytest.skip(reason)
    if runtime.get().name != "cuda":
        gp.set_backend("cuda")
    gc.collect()
    gp.synchronize()
    yield runtime.get()
    gc.collect()
    gp.synchronize()
    gp.empty_cache()
    gp.check_invariants()


@pytest.mark.gpu
def test_torch_views_the_buffer(cuda_backend: Any) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("optional framework missing: torch (built without CUDA)")
    gc.collect()
    base = gp.memory_allocated()
    buf = gp.alloc(1 << 20)
    ptr, n = buf.ptr, buf.nbytes
    t = torch.from_dlpack(buf)
    assert t.device.type == "cuda" and t.device.index == buf.device
    assert t.dtype == torch.uint8 and tuple(t.shape) == (n,)
    assert t.data_ptr() == ptr
    t.fill_(7)
    torch.cuda.synchronize()
    dev = runtime.get().device(buf.device)
    assert set(dev.read(ptr, n, 0)) == {7}
    try:
        import cupy
    except ImportError:
        pass
    else:
        assert int(cupy.asarray(buf).get().min()) == 7
    # typed view
    f = torch.from_dlpack(dlpack.as_tensor(buf, "float32", (n // 4,)))
    assert f.dtype == torch.float32 and f.data_ptr() == ptr
    # the torch tensor keeps the memory alive
    del buf, f
    gc.collect()
    assert gp.memory_allocated() == base + n
    assert int(t[123].item()) == 7
    del t
    gc.collect()
    torch.cuda.synchronize()
    assert gp.memory_allocated() == base


@pytest.mark.gpu
def test_torch_on_a_side_stream(cuda_backend: Any) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("optional framework missing: torch (built without CUDA)")
    s = gp.Stream()
    buf = gp.alloc(1 << 16, stream=s)
    dev = runtime.get().device(buf.device)
    dev.memset(buf.ptr, 3, buf.nbytes, s.handle)
    ts = torch.cuda.Stream()
    with torch.cuda.stream(ts):
        t = torch.from_dlpack(buf)  # ts is made to wait for s
        total = int(t.to(torch.int64).sum().item())
    assert total == 3 * buf.nbytes
    del t
    gc.collect()


@pytest.mark.gpu
def test_jax_views_the_buffer(cuda_backend: Any) -> None:
    # JAX would otherwise take 75% of the GPU on first use, starving the tests after this one
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    if not gpus:
        pytest.skip("optional framework missing: jax (no GPU backend)")
    buf = gp.alloc(4096)
    dev = runtime.get().device(buf.device)
    dev.memset(buf.ptr, 5, buf.nbytes, 0)
    dev.stream_synchronize(0)
    x = jnp.from_dlpack(buf)
    assert x.shape == (4096,) and x.dtype == jnp.uint8
    assert int(x.astype(jnp.int32).sum()) == 5 * 4096
    y = jnp.from_dlpack(dlpack.as_tensor(buf, "int32", (1024,)))
    assert y.shape == (1024,) and int(y[0]) == 0x05050505
    del x, y, buf
    gc.collect()


def _consumer(name: str) -> tuple[Any, Any]:
    """(from_dlpack, data pointer of what it made or None) of a framework with a GPU, or skip."""
    if name == "numpy":
        import numpy

        return numpy.from_dlpack, None
    if name == "torch":
        torch = pytest.importorskip("torch")
        if not torch.cuda.is_available():
            pytest.skip("optional framework missing: torch (built without CUDA)")
        return torch.from_dlpack, lambda t: t.data_ptr()
    if name == "cupy":
        cupy = pytest.importorskip("cupy")
        return cupy.from_dlpack, lambda a: a.data.ptr
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    try:
        if not jax.devices("gpu"):
            raise RuntimeError
    except RuntimeError:
        pytest.skip("optional framework missing: jax (no GPU backend)")
    return jnp.from_dlpack, None


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["numpy", "torch", "cupy", "jax"])
def test_consumers_accepting_and_refusing_leave_nothing_behind(cuda_backend: Any, name: str) -> None:
    """Each consumer, on the GPU: what it accepts views the buffer (and keeps it alive until
    its own object goes); what it refuses (NumPy: device memory; the others: a float128 view)
    raises the consumer's own error, never a SystemError, and leaves no export behind."""
    from_dlpack, data_ptr = _consumer(name)
    base = _settled()
    buf = gp.alloc(1 << 16)
    ptr = buf.ptr
    if name != "numpy":
        for source in (buf, dlpack.as_tensor(buf, "float32", (1 << 14,))):
            got = from_dlpack(source)
            if data_ptr is not None:
                assert data_ptr(got) == ptr
            del source
            assert dlpack.live_exports() == base[1] + 1  # the consumer's view holds it
            if name == "jax":
                got.delete()  # JAX frees its buffers when told, or at its own pace
            del got
            gc.collect()
            gp.synchronize()
            assert dlpack.live_exports() == base[1]
    refused = buf if name == "numpy" else dlpack.as_tensor(buf, "float128", (16,))
    with pytest.raises(Exception) as info:  # the consumer's own error, whichever it is
        from_dlpack(refused)
    assert not isinstance(info.value, SystemError | AttributeError), repr(info.value)
    del buf, refused, info
    assert _settled() == base

"""Streams of other libraries, by cuda.core's ``__cuda_stream__`` protocol, wherever graphpool
takes a stream; and ``gp.Stream.__cuda_stream__`` for the other direction.

The foreign stream is a small class wrapping the handle of a stream made on the simulated
device, as a CuPy, PyTorch or cuda.core stream wraps a ``cudaStream_t``.
"""

from __future__ import annotations

import collections
import enum
import gc
import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

import graphpool as gp
from graphpool import runtime
from graphpool.cuda_core import stream_handle
from graphpool.device.protocol import LEGACY_STREAM
from graphpool.streams import cuda_stream_handle

_PROPER = object()


class ForeignStream:
    """Another library's stream: ``__cuda_stream__`` returns ``answer`` (default ``(0, handle)``)."""

    def __init__(self, handle: int, answer: Any = _PROPER) -> None:
        self.handle = handle
        self.answer = (0, handle) if answer is _PROPER else answer

    def __cuda_stream__(self) -> Any:
        return self.answer


@pytest.fixture
def sim() -> Iterator[Any]:
    gp.set_backend("sim")
    try:
        yield runtime.get()
    finally:
        gc.collect()
        gp.synchronize()
        gp.empty_cache()
        gp.check_invariants()


def foreign() -> ForeignStream:
    """A live stream of device 0 that graphpool did not make (as another library would)."""
    return ForeignStream(runtime.get().device(0).create_stream())


def test_gp_stream_speaks_the_protocol(sim: Any) -> None:
    s = gp.Stream()
    assert s.__cuda_stream__() == (0, s.handle)
    assert gp.default_stream().__cuda_stream__() == (0, 0)


def test_alloc_on_a_foreign_stream(sim: Any) -> None:
    f = foreign()
    buf = gp.alloc(1000, stream=f)
    assert isinstance(buf.stream, gp.Stream)
    assert buf.stream.handle == f.handle and buf.stream.device == 0
    assert buf.stream._source is f  # the buffer keeps the foreign stream alive
    [seg] = [s for s in gp.memory_snapshot() if s["address"] <= buf.ptr < s["address"] + s["total_size"]]
    assert seg["stream"] == f.handle
    buf.free()
    again = gp.alloc(1000, stream=gp.Stream._wrap(0, f.handle))  # the same stream: the cached block
    assert again.ptr == buf.ptr
    again.free()


def test_a_gp_stream_passed_through_the_protocol_is_the_same_stream(sim: Any) -> None:
    s = gp.Stream()
    f = ForeignStream(0, answer=s.__cuda_stream__())
    buf = gp.alloc(512, stream=f)
    assert buf.stream == s
    buf.free()


def test_stream_context_takes_a_foreign_stream(sim: Any) -> None:
    f = foreign()
    with gp.stream(f) as s:
        assert isinstance(s, gp.Stream) and s.handle == f.handle
        assert gp.current_stream().handle == f.handle
        buf = gp.alloc(1000)
        assert buf.stream.handle == f.handle
        buf.free()
    assert gp.current_stream().handle == LEGACY_STREAM


def test_record_stream_takes_a_foreign_stream(sim: Any) -> None:
    f = foreign()
    buf = gp.alloc(1000)
    buf.record_stream(f)
    block = runtime.allocator().lookup(buf.ptr)
    assert block is not None and block.stream_uses == {f.handle}
    buf.free()


def test_wait_stream_and_event_record_take_a_foreign_stream(sim: Any) -> None:
    f = foreign()
    dev = runtime.get().device(0)
    dev.launch_sleep(f.handle, rounds=5)  # type: ignore[attr-defined]
    e = gp.Event()
    e.record(f)
    s = gp.Stream()
    s.wait_stream(f)
    s.synchronize()  # waited for the foreign stream's work
    assert dev.pending_ops(f.handle) == 0  # type: ignore[attr-defined]
    assert e.query()


def test_capture_on_a_foreign_stream(sim: Any) -> None:
    xp = pytest.importorskip("graphpool.sim.xp")
    f = foreign()
    x = xp.ones(100)
    g = gp.CUDAGraph()
    with gp.graph(g, stream=f):
        assert gp.current_stream().handle == f.handle
        y = x * 2
    g.replay()
    assert y.sum().item() == 200
    g2 = gp.CUDAGraph()
    with gp.stream(f):  # capture_begin captures the current stream: a foreign one too
        g2.capture_begin()
        z = x + 1
        g2.capture_end()
    g2.replay()
    assert z.sum().item() == 200
    del y, z
    g.reset()
    g2.reset()


def test_cuda_legacy_handle_means_the_legacy_stream(sim: Any) -> None:
    buf = gp.alloc(512, stream=ForeignStream(1))  # CU_STREAM_LEGACY, as cuda.core's default stream
    assert buf.stream.handle == LEGACY_STREAM
    buf.free()


def test_per_thread_default_stream_is_refused(sim: Any) -> None:
    with pytest.raises(ValueError, match="per-thread default stream") as info:
        gp.alloc(512, stream=ForeignStream(2))
    assert str(info.value).endswith(
        "use a stream of your own (e.g. gp.Stream()) or the legacy default stream"
    )


def test_stream_of_another_device_is_refused(sim: Any) -> None:
    other = ForeignStream(runtime.get().device(1).create_stream())
    with pytest.raises(ValueError, match="not a live stream of device 0"):
        gp.alloc(512, stream=other)
    with gp.device(1):  # on its own device it is fine
        gp.alloc(512, stream=other).free()
    with pytest.raises(ValueError, match="device 0"):
        gp.alloc(512).record_stream(other)


def test_unknown_or_destroyed_handle_is_refused(sim: Any) -> None:
    dev = runtime.get().device(0)
    f = foreign()
    dev.destroy_stream(f.handle)
    with pytest.raises(ValueError, match="not a live stream"):
        gp.alloc(512, stream=f)
    with pytest.raises(ValueError, match="not a live stream"):
        gp.alloc(512, stream=ForeignStream(0xDEAD0))


BAD_ANSWERS = [
    ([0, 0x1000], "tuple"),  # a list, not a tuple
    ((0, 0x1000, 1), "tuple"),
    ((0,), "tuple"),
    (None, "tuple"),
    ((1, 0x1000), "version 0"),
    (("0", 0x1000), "version 0"),
    ((False, 0x1000), "version 0"),
    ((0, "0x1000"), "as an int"),
    ((0, 4096.0), "as an int"),
    ((0, True), "as an int"),
    ((0, -1), "as an int"),
]


@pytest.mark.parametrize(("answer", "match"), BAD_ANSWERS)
def test_a_wrong_protocol_answer_is_a_type_error(sim: Any, answer: Any, match: str) -> None:
    bad = ForeignStream(0, answer=answer)
    buf = gp.alloc(512)
    for call in (
        lambda: gp.alloc(512, stream=bad),
        lambda: gp.stream(bad).__enter__(),
        lambda: buf.record_stream(bad),
        lambda: gp.graph(gp.CUDAGraph(), stream=bad),
        lambda: gp.Stream().wait_stream(bad),
        lambda: gp.Event().record(bad),
        lambda: stream_handle(bad),
    ):
        with pytest.raises(TypeError, match=match):
            call()
    assert gp.current_stream().handle == LEGACY_STREAM
    buf.free()


class _Version(enum.IntEnum):
    ZERO = 0


class _Handle(int):
    """An int subclass, as a binding's handle type may be."""


_Answer = collections.namedtuple("_Answer", "version handle")


@pytest.mark.parametrize(
    "answer",
    [(_Version.ZERO, 0x1000), (0, _Handle(0x1000)), _Answer(0, 0x1000), (True - 1, 0x1000)],
    ids=["int-enum-version", "int-subclass-handle", "namedtuple", "computed-zero"],
)
def test_int_and_tuple_subclasses_in_a_protocol_answer_are_read_as_ints(sim: Any, answer: Any) -> None:
    """Answers the check for the common ``(0, handle)`` lets by (not exactly a tuple of
    ints) take the full check, which accepts them and gives the handle as a plain int."""
    got = cuda_stream_handle(ForeignStream(0, answer=answer))
    assert got == 0x1000 and type(got) is int


@pytest.mark.parametrize("bad", [0, 0x1000, "stream", 1.5, object(), gp.Event])
def test_objects_without_the_protocol_name_what_is_accepted(sim: Any, bad: Any) -> None:
    obj = bad() if bad is gp.Event else bad
    buf = gp.alloc(512)
    for call in (
        lambda: gp.alloc(512, stream=obj),
        lambda: gp.stream(obj).__enter__(),
        lambda: buf.record_stream(obj),
        lambda: gp.graph(gp.CUDAGraph(), stream=obj),
    ):
        with pytest.raises(
            TypeError, match="graphpool Stream, a CuPy stream or a stream object with the __cuda_stream__"
        ):
            call()
    buf.free()


def test_a_protocol_attribute_that_is_not_callable_is_a_type_error(sim: Any) -> None:
    class NotCallable:
        __cuda_stream__ = (0, 0)

    with pytest.raises(TypeError, match="__cuda_stream__"):
        gp.alloc(512, stream=NotCallable())


def test_a_cupy_stream_without_the_protocol_is_taken_by_its_ptr(
    sim: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CuPy streams may lack ``__cuda_stream__``: graphpool reads their ``ptr`` (CuPy imported
    by the program; here a stand-in module with CuPy's two stream classes)."""

    class BaseStream:
        def __init__(self, ptr: int) -> None:
            self.ptr = ptr

    class Stream(BaseStream):
        pass

    class ExternalStream(BaseStream):  # as in CuPy: a sibling of Stream, not a subclass
        pass

    fake = types.ModuleType("cupy")
    fake.cuda = types.SimpleNamespace(Stream=Stream, ExternalStream=ExternalStream)  # type: ignore[attr-defined]
    handle = runtime.get().device(0).create_stream()
    with pytest.raises(TypeError, match="CuPy stream"):  # without CuPy loaded: not a stream
        gp.alloc(512, stream=ExternalStream(handle))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    for cs in (Stream(handle), ExternalStream(handle)):
        buf = gp.alloc(512, stream=cs)
        assert buf.stream.handle == handle and buf.stream._source is cs
        buf.free()
    with gp.stream(Stream(0)) as s:  # CuPy's Stream.null: the legacy stream
        assert s is not None and s.handle == LEGACY_STREAM


def test_a_foreign_stream_on_each_backend(backend: Any) -> None:
    """On the GPU the device asks the driver which context the stream belongs to."""
    dev = runtime.get().device(gp.current_device())
    f = ForeignStream(dev.create_stream())  # a stream graphpool did not make (the primary context)
    assert dev.owns_stream(f.handle) and dev.owns_stream(LEGACY_STREAM)
    with gp.stream(f) as s:
        assert s is not None and s.handle == f.handle
        x = backend.xp.ones(1000)
        assert x.sum().item() == 1000
    buf = gp.alloc(4096, stream=f)
    buf.record_stream(gp.Stream())
    buf.free()
    gp.synchronize()

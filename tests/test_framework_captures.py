"""graphpool.framework_captures: the one rule by which graphpool.cupy and graphpool.cuda_core
register captures begun through their framework's API, tested on a made-up framework over
the simulator (the CuPy twin's tests cover the CuPy side end to end)."""

from __future__ import annotations

import gc
import types
from collections.abc import Iterator
from typing import Any

import pytest

import graphpool as gp
from graphpool import framework_captures, pinned, runtime
from graphpool.framework_captures import CaptureHooks

RELAXED = 2


class Builder:
    """A framework's capture object: begin/end a capture on its own stream."""

    def __init__(self, stream: gp.Stream) -> None:
        self.stream = stream

    def begin(self, mode: int = RELAXED) -> str:
        runtime.get().device(self.stream.device).begin_capture(self.stream.handle, mode)
        return "begun"

    def end(self) -> int:
        return int(runtime.get().device(self.stream.device).end_capture(self.stream.handle))


def _key(b: Builder) -> tuple[int, int]:
    return b.stream.device, b.stream.handle


def _pool_of(ptr: int) -> Any:
    for seg in gp.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg["segment_pool_id"]
    raise AssertionError(f"0x{ptr:x} is not in any graphpool segment")


def _in_use() -> list[Any]:
    return [p for p in runtime.allocator().private_pools() if p.use_count]


class Spy:
    """The allocator, noting which captures the hooks registered and ended."""

    def __init__(self, real: Any) -> None:
        self.real = real
        self.adopted: list[Any] = []
        self.ended: list[Any] = []

    def adopt_capture(self, stream: int, **kwargs: Any) -> Any:
        rec = self.real.adopt_capture(stream, **kwargs)
        self.adopted.append(rec)
        return rec

    def end_adopted(self, rec: Any) -> None:
        self.ended.append(rec)
        self.real.end_adopted(rec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Spy:
    gp.set_backend("sim")
    found = Spy(runtime.allocator())
    real = runtime.allocator
    # only the hooks see the spy (the compiled allocation path wants the allocator itself)
    seen = types.SimpleNamespace(allocator=lambda device=None: found if not device else real(device))
    monkeypatch.setattr(framework_captures, "runtime", seen)
    return found


@pytest.fixture
def hooks(spy: Spy) -> Iterator[CaptureHooks]:
    gp.set_capture_detection(False)  # only a registered capture gets a private pool
    h = CaptureHooks("begin", "end", "made-up capture", key=_key, active=lambda: True)
    assert h.install(Builder)
    try:
        yield h
    finally:
        h.uninstall()
        gp.set_capture_detection(True)
        gc.collect()
        gp.synchronize()
        gp.empty_cache()
        gp.check_invariants()


def test_a_capture_begun_through_the_framework_gets_a_private_pool_at_once(
    hooks: CaptureHooks, spy: Spy
) -> None:
    s = gp.Stream()
    b = Builder(s)
    assert b.begin() == "begun"  # the framework's own result comes back
    try:
        assert len(_in_use()) == 1, "begin registered nothing"
        buf = gp.alloc(1 << 20, stream=s)
        assert _pool_of(buf.ptr) is not None, "an allocation of the framework's capture got eager memory"
        buf.free()
    finally:
        graph = b.end()
    assert len(spy.adopted) == 1 and spy.ended == spy.adopted  # routing stopped
    assert spy.adopted[0].label == f"made-up capture on stream 0x{s.handle:x}"
    assert len(_in_use()) == 1  # the graph keeps the pool
    after = gp.alloc(1 << 20, stream=s)
    assert _pool_of(after.ptr) is None, "the stream still allocates from the ended capture's pool"
    after.free()
    runtime.get().device(s.device).destroy_graph(graph)
    gc.collect()
    gp.synchronize()
    gp.empty_cache()
    assert _in_use() == []


def test_the_end_call_stops_routing_even_when_it_raises(hooks: CaptureHooks, spy: Spy) -> None:
    class Failing:
        def __init__(self, stream: gp.Stream) -> None:
            self.stream = stream

        def begin(self) -> None:
            runtime.get().device(self.stream.device).begin_capture(self.stream.handle, RELAXED)

        def end(self) -> None:
            self.graph = runtime.get().device(self.stream.device).end_capture(self.stream.handle)
            raise RuntimeError("the framework failed after the capture ended")

    h = CaptureHooks("begin", "end", "made-up capture", key=_key, active=lambda: True)
    assert h.install(Failing)
    try:
        s = gp.Stream()
        b = Failing(s)
        b.begin()
        assert len(_in_use()) == 1
        with pytest.raises(RuntimeError, match="failed after the capture ended"):
            b.end()
        assert len(spy.adopted) == 1 and spy.ended == spy.adopted
        eager = gp.alloc(1 << 20, stream=s)
        assert _pool_of(eager.ptr) is None, "the stream still allocates from the ended capture's pool"
        eager.free()
        runtime.get().device(s.device).destroy_graph(b.graph)
    finally:
        h.uninstall()


def test_a_capture_that_cannot_be_registered_only_warns(hooks: CaptureHooks) -> None:
    s = gp.Stream()
    b = Builder(s)
    real = hooks._key
    idle = gp.Stream()
    hooks._key = lambda obj: (obj.stream.device, idle.handle)  # a stream not capturing
    try:
        with pytest.warns(RuntimeWarning, match="could not register the made-up capture"):
            b.begin()
        assert _in_use() == []
    finally:
        graph = b.end()  # with the same key: the pinned pool hears this capture end too
        hooks._key = real
    runtime.get().device(s.device).destroy_graph(graph)


def test_the_pinned_pool_hears_of_each_capture_and_register_can_leave_the_device_pool_out(
    spy: Spy,
) -> None:
    """Pinned buffers freed during a framework's capture are kept for its graph only if the
    pinned pool hears of it (begin and end); ``register`` False (graphpool.cupy with only
    ``install_pinned()``) leaves the device pool out of it."""
    gp.set_capture_detection(False)
    try:
        for register, adopted in ((None, 1), (lambda: False, 0)):
            h = CaptureHooks(
                "begin", "end", "made-up capture", key=_key, active=lambda: True, register=register
            )
            assert h.install(Builder)
            s = gp.Stream()
            b = Builder(s)
            try:
                b.begin()
                assert (s.device, s.handle) in pinned._announced, "the pinned pool never heard of it"
                assert len(spy.adopted) == adopted
                assert len(_in_use()) == adopted
            finally:
                graph = b.end()
                h.uninstall()
            assert (s.device, s.handle) not in pinned._announced, "the pinned pool never heard it end"
            runtime.get().device(s.device).destroy_graph(graph)
            spy.adopted.clear()
    finally:
        gp.set_capture_detection(True)
        gc.collect()
        gp.synchronize()
        gp.empty_cache()
        gp.check_invariants()


def test_inactive_hooks_register_nothing() -> None:
    gp.set_backend("sim")
    h = CaptureHooks("begin", "end", "made-up capture", key=_key, active=lambda: False)
    assert h.install(Builder)
    try:
        s = gp.Stream()
        b = Builder(s)
        b.begin()
        assert _in_use() == []
        runtime.get().device(s.device).destroy_graph(b.end())
    finally:
        h.uninstall()


def test_install_is_idempotent_and_uninstall_gives_the_methods_back() -> None:
    class Sub(Builder):  # inherits both methods: uninstall must leave nothing in its dict
        pass

    begin, end = Builder.begin, Builder.end
    h = CaptureHooks("begin", "end", "made-up capture", key=_key, active=lambda: False)
    assert not h.hooked and h.owner is None
    assert h.install(Sub) and h.install(Sub) and h.hooked and h.owner is Sub
    assert Sub.begin is not begin and Sub.begin.__name__ == "begin"
    h.uninstall()
    h.uninstall()
    assert not h.hooked and "begin" not in vars(Sub) and "end" not in vars(Sub)
    assert Sub.begin is begin and Sub.end is end
    assert h.install(Builder)
    h.uninstall()
    assert vars(Builder)["begin"] is begin and vars(Builder)["end"] is end


class _RefusesEnd(type):
    def __setattr__(cls, name: str, value: Any) -> None:
        if name == "end":
            raise TypeError("read-only attribute")
        super().__setattr__(name, value)


def test_a_class_that_cannot_be_patched_is_left_as_it_was() -> None:
    class Half(Builder, metaclass=_RefusesEnd):  # takes a new begin, refuses a new end
        def begin(self, mode: int = RELAXED) -> str:
            return "own"

    own = vars(Half)["begin"]
    h = CaptureHooks("begin", "end", "made-up capture", key=_key, active=lambda: True)
    assert not h.install(Half) and not h.hooked
    assert vars(Half)["begin"] is own and "end" not in vars(Half)

    h = CaptureHooks("__add__", "__sub__", "made-up capture", key=_key, active=lambda: True)
    assert not h.install(int) and not h.hooked  # a built-in type refuses new attributes
    assert (2).__add__(3) == 5
    missing = CaptureHooks("begin", "no_such_method", "made-up capture", key=_key, active=lambda: True)
    assert not missing.install(Builder) and vars(Builder)["begin"].__name__ == "begin"
    assert vars(Builder)["begin"] is Builder.begin and not missing.hooked

"""Every way a public call can fail: the right typed error, nothing lost, memory recoverable.

Runs on the `backend` fixture (the simulator always, the GPU when present). After each
error, ``gp.check_invariants()`` passes and ``empty_cache()`` brings reserved memory back
to where it started.
"""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest

import graphpool as gp
from graphpool import runtime
from graphpool.device.protocol import CAPTURE_MODE_GLOBAL
from graphpool.sim import capture as sim_capture
from simenv import fresh_sim

MiB = 1024 * 1024


def settle() -> int:
    """Collect, synchronize, empty the cache; return reserved bytes."""
    gc.collect()
    gp.synchronize()
    gp.empty_cache()
    gp.check_invariants()
    return gp.memory_reserved()


def stats_without_time() -> dict[str, int]:
    return gp.memory_stats()


# --------------------------------------------------------------------------- sizes
def test_negative_size_is_a_value_error(backend: Any) -> None:
    before = gp.memory_stats()
    with pytest.raises(ValueError):
        gp.alloc(-1)
    assert gp.memory_stats() == before
    gp.check_invariants()


@pytest.mark.parametrize("bad", [1.0, "8", None, True, [8], 2.5])
def test_non_int_size_is_a_type_error(backend: Any, bad: Any) -> None:
    before = gp.memory_stats()
    with pytest.raises(TypeError):
        gp.alloc(bad)
    assert gp.memory_stats() == before
    gp.check_invariants()


@pytest.mark.parametrize("huge", [1 << 50, (1 << 62) - 1])
def test_huge_size_is_out_of_memory_and_changes_nothing(backend: Any, huge: int) -> None:
    settle()
    before = gp.memory_stats()
    with pytest.raises(gp.OutOfMemoryError) as info:
        gp.alloc(huge)
    assert isinstance(info.value, MemoryError)
    assert isinstance(info.value, gp.GraphpoolError)
    after = gp.memory_stats()
    assert after["num_ooms"] == before["num_ooms"] + 1  # counted in num_ooms, nothing else moves
    after["num_ooms"] -= 1
    assert after == before
    gp.check_invariants()
    with gp.alloc(1000) as buf:  # still usable
        assert buf.nbytes == 1000


# --------------------------------------------------------------------------- frees
def test_double_free_through_the_buffer(backend: Any) -> None:
    base = settle()
    buf = gp.alloc(4096)
    buf.free()
    assert buf.freed
    before = gp.memory_stats()
    with pytest.raises(gp.DoubleFreeError):
        buf.free()
    assert gp.memory_stats() == before
    with pytest.raises(gp.DoubleFreeError):
        buf.record_stream(gp.Stream())
    with pytest.raises(gp.DoubleFreeError):
        _ = buf.__cuda_array_interface__
    gp.check_invariants()
    del buf
    assert settle() == base


def test_double_free_through_the_allocator(backend: Any) -> None:
    base = settle()
    alloc = runtime.allocator()
    keep = gp.alloc(4096)  # keeps the segment alive so the pointer stays inside graphpool memory
    buf = gp.alloc(4096)
    ptr = buf.ptr
    buf.free()
    before = gp.memory_stats()
    with pytest.raises(gp.DoubleFreeError):
        alloc.free(ptr)
    assert gp.memory_stats() == before
    gp.check_invariants()
    keep.free()
    del buf, keep
    assert settle() == base


def test_foreign_and_interior_pointers(backend: Any) -> None:
    base = settle()
    alloc = runtime.allocator()
    buf = gp.alloc(8192)
    before = gp.memory_stats()
    with pytest.raises(gp.ForeignPointerError):
        alloc.free(0x1000)  # never graphpool's
    with pytest.raises(gp.ForeignPointerError):
        alloc.free(buf.ptr + 512)  # inside a live allocation, not its start
    with pytest.raises(gp.ForeignPointerError):
        alloc.free(buf.ptr + 1)
    with pytest.raises((gp.ForeignPointerError, gp.DoubleFreeError)):
        alloc.free(buf.ptr + 16384)  # in the free rest of the segment
    assert gp.memory_stats() == before
    assert isinstance(gp.ForeignPointerError("x"), ValueError)
    assert isinstance(gp.DoubleFreeError("x"), ValueError)
    gp.check_invariants()
    buf.free()  # the buffer is still intact and frees normally
    del buf
    assert settle() == base


def test_record_stream_needs_a_stream(backend: Any) -> None:
    buf = gp.alloc(512)
    s = gp.Stream()
    for bad in (None, 0, s.handle, "stream", gp.Event()):
        with pytest.raises(TypeError):
            buf.record_stream(bad)
    buf.record_stream(s)  # a real one is fine
    buf.free()
    gp.check_invariants()


def test_alloc_stream_must_be_a_stream(backend: Any) -> None:
    with pytest.raises(TypeError):
        gp.alloc(512, stream=7)  # type: ignore[arg-type]
    gp.check_invariants()


# --------------------------------------------------------------------------- capture misuse
def test_capture_on_the_legacy_default_stream_is_refused(backend: Any) -> None:
    base = settle()
    g = gp.CUDAGraph()
    with gp.stream(gp.default_stream()):
        with pytest.raises(gp.CaptureError, match="CUDA graphs must be captured on a non-default stream"):
            g.capture_begin()
        assert not gp.is_current_stream_capturing()
    assert runtime.allocator().private_pools() == []
    with pytest.raises(gp.CaptureError):
        g.replay()
    assert settle() == base


def test_replay_and_pool_before_capture(backend: Any) -> None:
    g = gp.CUDAGraph()
    with pytest.raises(gp.CaptureError) as info:
        g.replay()
    assert str(info.value) == (
        f"{g.label}: replay() needs a successful capture first "
        "(capture_begin()/capture_end() or `with gp.graph(g):`)"
    )
    with pytest.raises(gp.CaptureError):
        g.pool()
    g.reset()  # resetting an empty graph is harmless
    with pytest.raises(gp.CaptureError):
        g.capture_end()
    gp.check_invariants()


def test_capturing_twice_is_refused(backend: Any) -> None:
    xp = backend.xp
    base = settle()
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.stream(s):
        g.capture_begin()
        a = xp.ones(100)
        with pytest.raises(gp.CaptureError):
            g.capture_begin()  # already capturing
        assert gp.is_current_stream_capturing()
        g.capture_end()
        assert not gp.is_current_stream_capturing()
        with pytest.raises(gp.CaptureError, match="reset"):
            g.capture_begin()  # holds a capture: reset first
        pool = g.pool()
        g.replay()
        g.reset()
        g.capture_begin()  # the same object captures again after reset
        b = xp.ones(100)
        g.capture_end()
        assert g.pool() != pool
        g.replay()
    s.synchronize()
    g.reset()
    del a, b
    gp.check_invariants()
    assert settle() == base


def test_capture_end_on_another_stream_is_refused(backend: Any) -> None:
    xp = backend.xp
    base = settle()
    s1, s2 = gp.Stream(), gp.Stream()
    g = gp.CUDAGraph()
    with gp.stream(s1):
        g.capture_begin()
        a = xp.ones(100)
    with gp.stream(s2):
        with pytest.raises(gp.CaptureError, match="stream"):
            g.capture_end()
    with gp.stream(s1):
        assert gp.is_current_stream_capturing()  # still underway: end it where it began
        g.capture_end()
        g.replay()
    s1.synchronize()
    g.reset()
    del a
    assert settle() == base


def test_capture_end_from_another_thread_ends_the_capture_without_a_graph(backend: Any) -> None:
    """CUDA ends a global-mode capture whose cudaStreamEndCapture comes from another thread,
    with cudaErrorStreamCaptureWrongThread and no graph (seen on the H200; the simulator
    does the same): graphpool discards the capture, says so, and gives its memory back."""
    xp = backend.xp
    base = settle()
    g = gp.CUDAGraph()
    s = gp.Stream()
    a = xp.ones(1000, dtype=xp.float32)
    seen: list[BaseException] = []

    def other() -> None:
        with gp.stream(s):
            try:
                g.capture_end()
            except gp.CaptureError as exc:
                seen.append(exc)

    s.wait_stream(gp.current_stream())
    with gp.stream(s):
        g.capture_begin()
        b = a + 1
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert len(seen) == 1 and not gp.is_current_stream_capturing()
        message = str(seen[0])
        assert message.startswith(f"{g.label}: the capture failed and was discarded (")
        assert "cudaErrorStreamCaptureWrongThread" in message
        with pytest.raises(gp.CaptureError, match="without a capture_begin"):
            g.capture_end()
    with pytest.raises(gp.CaptureError, match="needs a successful capture first"):
        g.replay()
    del b
    g.reset()
    del a
    assert settle() == base


def test_empty_cache_during_capture_is_refused(backend: Any) -> None:
    xp = backend.xp
    base = settle()
    cached = gp.alloc(4096)
    cached.free()  # something the refused empty_cache would have released
    reserved = gp.memory_reserved()
    frees = gp.memory_stats()["num_device_free"]
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.stream(s):
        g.capture_begin()
        a = xp.ones(100)  # one new small segment (2 MiB) in the graph's private pool
        with pytest.raises(gp.CaptureError, match="capture"):
            gp.empty_cache()
        assert gp.memory_reserved() == reserved + 2 * 1024 * 1024  # the cached segment kept
        assert gp.memory_stats()["num_device_free"] == frees
        g.capture_end()
    g.reset()
    del a
    assert settle() == base


class Boom(Exception):
    pass


def _fail_capture(g: Any, xp: Any, holder: list[Any], pool: Any = None) -> None:
    """Run a capture whose body raises; the arrays it made stay referenced by ``holder``."""

    def body() -> None:
        with gp.graph(g, pool=pool):
            holder.append(xp.ones(300_000))  # large: a 20 MiB segment
            holder.append(xp.ones(1000))  # small: a 2 MiB segment
            raise Boom("body failed")

    raised = False
    try:
        body()
    except Boom:
        raised = True
    assert raised


def _check_capture_gone(g: Any, backend: Any) -> None:
    assert not gp.is_current_stream_capturing()
    assert gp.current_stream() == gp.default_stream()  # the stream switch was undone
    with pytest.raises(gp.CaptureError):
        g.pool()
    with pytest.raises(gp.CaptureError):
        g.replay()
    if backend.name == "sim":
        assert sim_capture.ongoing() == []
        assert sim_capture.thread_mode() == CAPTURE_MODE_GLOBAL
    gp.check_invariants()


def test_exception_inside_graph_context_ends_the_capture_and_leaks_nothing(backend: Any) -> None:
    xp = backend.xp
    base = settle()
    g = gp.CUDAGraph()
    holder: list[Any] = []
    _fail_capture(g, xp, holder)
    _check_capture_gone(g, backend)
    assert len(runtime.allocator().private_pools()) == 1  # freeable: the arrays still hold it
    assert all(p.use_count == 0 for p in runtime.allocator().private_pools())
    holder.clear()
    assert settle() == base
    assert runtime.allocator().private_pools() == []
    with gp.graph(g):  # the graph object is usable again
        out = xp.ones(10)
    g.replay()
    g.reset()
    del out
    assert settle() == base


def test_exception_inside_graph_context_restores_a_shared_pool_use_count(backend: Any) -> None:
    xp = backend.xp
    handle = gp.graph_pool_handle()
    g0 = gp.CUDAGraph()
    with gp.graph(g0, pool=handle):
        out0 = xp.ones(100)
    assert gp.memory_stats(pool=handle)["use_count"] == 1
    g = gp.CUDAGraph()
    holder: list[Any] = []
    _fail_capture(g, xp, holder, pool=handle)
    _check_capture_gone(g, backend)
    assert gp.memory_stats(pool=handle)["use_count"] == 1  # restored
    holder.clear()
    settle()
    g0.replay()
    assert float(out0.sum().item()) == 100.0
    g0.reset()
    del out0
    settle()
    assert runtime.allocator().private_pools() == []


def test_failed_capture_into_a_live_shared_pool_gives_its_memory_back(backend: Any) -> None:
    xp = backend.xp
    handle = gp.graph_pool_handle()
    g0 = gp.CUDAGraph()
    with gp.graph(g0, pool=handle):
        out0 = xp.ones(100)
    reserved_with_g0 = settle()
    g = gp.CUDAGraph()
    holder: list[Any] = []
    try:
        _fail_capture(g, xp, holder, pool=handle)
        holder.clear()
        assert settle() == reserved_with_g0  # fails: +22 MiB stay in the pool
    finally:
        holder.clear()
        g0.reset()
        del out0
        settle()


def test_prohibited_call_invalidates_a_global_capture_and_nothing_leaks(backend: Any) -> None:
    xp = backend.xp
    base = settle()
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.stream(s):
        g.capture_begin()  # global mode
        a = xp.ones(1000)
        with pytest.raises(gp.CUDAError):
            gp.synchronize()
        with pytest.raises(gp.CaptureError):
            g.capture_end()
        assert not gp.is_current_stream_capturing()
        with pytest.raises(gp.CaptureError):
            g.replay()
        with pytest.raises(gp.CaptureError):
            g.pool()
    if backend.name == "sim":
        assert sim_capture.ongoing() == []
        assert sim_capture.thread_mode() == CAPTURE_MODE_GLOBAL
    gp.check_invariants()
    del a
    assert settle() == base
    with gp.stream(s):  # the graph can capture again
        g.capture_begin()
        b = xp.ones(1000)
        g.capture_end()
        g.replay()
    s.synchronize()
    g.reset()
    del b
    assert settle() == base


def test_invalid_capture_error_mode(backend: Any) -> None:
    g = gp.CUDAGraph()
    with gp.stream(gp.Stream()):
        with pytest.raises(ValueError):
            g.capture_begin(capture_error_mode="loose")
        assert not gp.is_current_stream_capturing()
    gp.check_invariants()


@pytest.mark.parametrize("bad", ["loose", 1, None, ["global"]])
def test_invalid_capture_error_mode_is_a_value_error_in_gp_graph_too(backend: Any, bad: Any) -> None:
    """Any bad mode, of any type (an unhashable one too), is refused the same way, by
    capture_begin and by the gp.graph context (which passes its mode on)."""
    message = f"capture_error_mode must be one of global, thread_local, relaxed, not {bad!r}"
    with gp.stream(gp.Stream()):
        with pytest.raises(ValueError) as info:
            gp.CUDAGraph().capture_begin(capture_error_mode=bad)
        assert str(info.value) == message
    with pytest.raises(ValueError) as info:
        with gp.graph(gp.CUDAGraph(), capture_error_mode=bad):
            pass
    assert str(info.value) == message
    assert not gp.is_current_stream_capturing()
    gp.check_invariants()


def test_replay_checks_mode_is_checked() -> None:
    with pytest.raises(ValueError) as info:
        gp.set_replay_checks("on")
    assert str(info.value) == "replay checks are 'off', 'warn' or 'raise', not 'on'"
    assert gp.replay_checks() == "off"


@pytest.mark.parametrize("bad", [(0, 0), (1, 1), (-1, 0)])
def test_invalid_pool_ids_are_refused(backend: Any, bad: tuple[int, int]) -> None:
    g = gp.CUDAGraph()
    with gp.stream(gp.Stream()):
        with pytest.raises(ValueError):
            g.capture_begin(pool=bad)
        assert not gp.is_current_stream_capturing()
    with pytest.raises(ValueError):
        gp.memory_stats(pool=bad)
    with pytest.raises(TypeError):
        gp.memory_stats(pool="pool")
    gp.check_invariants()


def test_memory_stats_of_an_unknown_pool(backend: Any) -> None:
    with pytest.raises(ValueError):
        gp.memory_stats(pool=gp.graph_pool_handle())


def test_graph_context_needs_a_graph_and_a_stream(backend: Any) -> None:
    with pytest.raises(TypeError, match=r"^gp\.graph needs a CUDAGraph, not str$"):
        gp.graph("not a graph")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        gp.graph(gp.CUDAGraph(), stream=3)  # type: ignore[arg-type]


def test_graph_reset_mid_capture_abandons_it(backend: Any) -> None:
    xp = backend.xp
    base = settle()
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.stream(s):
        g.capture_begin()
        a = xp.ones(1000)
        g.reset()
        assert not gp.is_current_stream_capturing()
    gp.check_invariants()
    del a
    assert settle() == base


def test_graph_collected_mid_capture_ends_it_and_leaks_nothing(backend: Any) -> None:
    xp = backend.xp
    base = settle()
    handle = gp.graph_pool_handle()
    g0 = gp.CUDAGraph()
    with gp.graph(g0, pool=handle):
        out0 = xp.ones(10)
    s = gp.Stream()
    with gp.stream(s):
        g = gp.CUDAGraph()
        g.capture_begin(pool=handle)
        a = xp.ones(1000)
        assert gp.memory_stats(pool=handle)["use_count"] == 2
        del g
        gc.collect()
        st = gp.memory_stats(pool=handle)  # the next allocator call carries out the queued release
        assert st["use_count"] == 1
        assert not gp.is_current_stream_capturing()
    if backend.name == "sim":
        assert sim_capture.ongoing() == []
        assert sim_capture.thread_mode() == CAPTURE_MODE_GLOBAL
    gp.check_invariants()
    del a
    g0.reset()
    del out0
    assert settle() == base


def test_empty_capture_warns(backend: Any) -> None:
    base = settle()
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.stream(s):
        g.capture_begin()
        with pytest.warns(UserWarning):
            g.capture_end()
        g.replay()  # an empty graph still replays
    g.reset()
    assert settle() == base


# --------------------------------------------------------------------------- OOM during capture (sim)
@pytest.fixture
def small_sim() -> Any:
    with fresh_sim(1, 64 * MiB) as rt:
        yield rt


def test_out_of_memory_during_capture(small_sim: Any) -> None:
    assert gp.memory_reserved() == 0
    a = gp.alloc(30 * MiB)  # its own 30 MiB segment
    c = gp.alloc(20 * MiB)
    c.free()  # a cached free 20 MiB segment: releasing it would make room, but not during capture
    assert gp.memory_reserved() == 50 * MiB
    before = gp.memory_stats()
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.stream(s):
        g.capture_begin()
        x = gp.alloc(1000)  # a 2 MiB private segment
        with pytest.raises(gp.OutOfMemoryError) as info:
            gp.alloc(14 * MiB)  # a 14 MiB segment: 66 MiB > 64 MiB
        assert gp.is_current_stream_capturing()  # the OOM did not break the capture
        after = gp.memory_stats()
        assert after["num_ooms"] == before["num_ooms"] + 1
        assert after["num_device_free"] == before["num_device_free"]  # nothing released
        assert after["num_alloc_retries"] == before["num_alloc_retries"]
        assert gp.memory_reserved() == 52 * MiB
        msg = str(info.value)
        assert "capture" in msg
        assert ("14.00 MiB" in msg) or (str(14 * MiB) in msg)
        assert sim_capture.thread_mode() == CAPTURE_MODE_GLOBAL
        g.reset()  # abandon it
        assert not gp.is_current_stream_capturing()
    assert sim_capture.ongoing() == []
    assert sim_capture.thread_mode() == CAPTURE_MODE_GLOBAL
    gp.check_invariants()
    y = gp.alloc(14 * MiB, stream=gp.Stream())  # another stream: c's block does not serve it;
    # a new segment is refused, and now the retry may release the cache
    assert gp.memory_stats()["num_alloc_retries"] == before["num_alloc_retries"] + 1
    for b in (a, x, y):
        b.free()
    gp.empty_cache()
    assert gp.memory_reserved() == 0
    assert runtime.allocator(0).private_pools() == []


def test_out_of_memory_inside_graph_context(small_sim: Any) -> None:
    from graphpool.sim import xp

    g = gp.CUDAGraph()
    keep: list[Any] = []

    def body() -> None:
        with gp.graph(g):
            keep.append(xp.ones(1000))
            keep.append(xp.ones(20 * MiB))  # 80 MiB: more than the device has

    oom = False
    try:
        body()
    except gp.OutOfMemoryError:
        oom = True
    assert oom
    assert not gp.is_current_stream_capturing()
    assert sim_capture.ongoing() == []
    assert sim_capture.thread_mode() == CAPTURE_MODE_GLOBAL
    gp.check_invariants()
    keep.clear()
    assert settle() == 0
    assert runtime.allocator(0).private_pools() == []


def test_resetting_one_devices_statistics_leaves_the_others() -> None:
    with fresh_sim(2):
        for device in (0, 1):
            gp.alloc(4096, stream=gp.default_stream(device)).free()
        gp.reset_peak_memory_stats(1)
        gp.reset_accumulated_memory_stats(1)
        one, zero = gp.memory_stats(1), gp.memory_stats(0)
        assert one["allocated_bytes.all.peak"] == 0 and one["allocation.all.allocated"] == 0
        assert zero["allocated_bytes.all.peak"] == 4096 and zero["allocation.all.allocated"] == 1


def test_the_summary_of_a_device_reads_that_devices_statistics() -> None:
    """memory_summary(1) tabulates device 1's counters, not the current device's."""
    with fresh_sim(2):
        keep = gp.alloc(3 * 1024 * 1024, stream=gp.default_stream(1))
        text = gp.memory_summary(1)
        assert "device 1" in text and "3.00 MiB" in text
        assert "3.00 MiB" not in gp.memory_summary(0)
        keep.free()

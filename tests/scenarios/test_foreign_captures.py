"""Captures begun outside graphpool (docs/behaviour.rst, "Private pools for graph capture"),
on both backends, through the Device protocol's own capture calls: what a raw
``cudaStreamBeginCapture`` or a library capturing internally does. Detection (on by
default) gives each such capture a private pool, released when the device reports its
graph and every executable graph made from it destroyed (a CUDA user object); with
detection off the cupy#9655 hazard is back, which shows the tests can fail."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any

import pytest
from scenario_common import ptr, settle, total

import graphpool as gp
from graphpool import runtime
from graphpool.device.protocol import CAPTURE_MODES
from graphpool.errors import GraphpoolError
from graphpool.policy.captures import SWEEP_EVERY

N = 1 << 18  # 1 MiB of float32


def owner(arr: Any) -> Any:
    block = runtime.allocator().lookup(ptr(arr))
    assert block is not None
    return block.free_list.private_pool


def wait_released(pool: Any) -> bool:
    """Whether ``pool`` was released within a second: CUDA runs a user object's destructor
    asynchronously (on a driver thread) once the graph and its execs are gone."""
    for _ in range(200):
        gp.synchronize()
        if pool.use_count == 0 or pool not in runtime.allocator().private_pools():
            return True
        time.sleep(0.005)
    return False


@pytest.fixture
def detection() -> Iterator[None]:
    yield
    gp.set_capture_detection(True)


@pytest.mark.parametrize("mode", ["relaxed", "global", "thread_local"])
def test_foreign_capture_is_served_from_a_private_pool_and_released_with_its_graph(
    backend: Any, mode: str
) -> None:
    xp = backend.xp
    base = settle()
    dev = runtime.get().device(gp.current_device())
    s = gp.Stream()
    with gp.stream(s):
        x = xp.ones(N, dtype=xp.float32)
        s.synchronize()
        dev.begin_capture(s.handle, CAPTURE_MODES[mode])
        t = x * 3.0
        out = t + 1.0
        pool = owner(out)
        assert pool is not None and owner(t) is pool  # a private pool of its own
        del t  # freed inside the capture: back to the capture's pool, never to eager code
        graph = dev.end_capture(s.handle)
        exe = dev.instantiate(graph)
        y = xp.full(N, 7.0, dtype=xp.float32)  # eager, same stream, after the capture
        assert owner(y) is None
        s.synchronize()
        dev.launch(exe, s.handle)
        s.synchronize()
        assert total(y) == 7.0 * N  # nothing overwritten by the replay
        assert total(out) == 4.0 * N
        stats = gp.memory_stats(pool=pool.id)
        assert stats["use_count"] == 1
        dev.destroy_graph(graph)  # the exec still holds the pool
        assert gp.memory_stats(pool=pool.id)["use_count"] == 1
        dev.destroy_graph_exec(exe)  # the last holder: the pool is released
        assert wait_released(pool)
        assert total(out) == 4.0 * N  # outputs outlive their graph
    del x, y, out
    assert settle() == base
    gp.check_invariants()


def test_without_detection_the_hazard_is_back(backend: Any, detection: None) -> None:
    """The same program with detection off: the eager array gets the block the graph writes."""
    xp = backend.xp
    settle()
    gp.set_capture_detection(False)
    dev = runtime.get().device(gp.current_device())
    s = gp.Stream()
    with gp.stream(s):
        x = xp.ones(N, dtype=xp.float32)
        s.synchronize()
        dev.begin_capture(s.handle, CAPTURE_MODES["relaxed"])
        t = x * 3.0
        t_ptr = ptr(t)
        out = t + 1.0
        del t
        graph = dev.end_capture(s.handle)
        exe = dev.instantiate(graph)
        y = xp.full(N, 7.0, dtype=xp.float32)
        assert ptr(y) == t_ptr  # handed the capture's temporary
        s.synchronize()
        dev.launch(exe, s.handle)
        s.synchronize()
        assert total(y) == 3.0 * N  # every element overwritten
        dev.destroy_graph_exec(exe)
        dev.destroy_graph(graph)
    del x, y, out
    settle()


def test_stream_joined_through_an_event_shares_the_capture_pool(backend: Any) -> None:
    xp = backend.xp
    base = settle()
    dev = runtime.get().device(gp.current_device())
    s, j = gp.Stream(), gp.Stream()
    with gp.stream(s):
        x = xp.ones(N, dtype=xp.float32)
        gp.synchronize()
        dev.begin_capture(s.handle, CAPTURE_MODES["relaxed"])
        a = x + 1.0
        j.wait_stream(s)  # j joins the capture
        with gp.stream(j):
            b = x + 2.0
        s.wait_stream(j)  # and is joined back
        assert owner(a) is not None and owner(b) is owner(a)
        graph = dev.end_capture(s.handle)
    with gp.stream(j):
        c = xp.ones(N, dtype=xp.float32)  # j is eager again
        assert owner(c) is None
    exe = dev.instantiate(graph)
    dev.launch(exe, s.handle)
    s.synchronize()
    assert (total(a), total(b)) == (2.0 * N, 3.0 * N)
    dev.destroy_graph_exec(exe)
    dev.destroy_graph(graph)
    del x, a, b, c
    assert settle() == base


def test_outside_block_freed_in_a_foreign_capture_is_kept_for_its_graph(backend: Any) -> None:
    """The capture's kernels write an eager array, which is then dropped inside the capture:
    kept for the graph. Detection happens at allocations (a free never asks the driver: its
    stream may be destroyed by then), so the capture here allocates first; a framework's
    hook (graphpool.cupy) registers its captures at their beginning instead."""
    xp = backend.xp
    settle()
    dev = runtime.get().device(gp.current_device())
    s = gp.Stream()
    with gp.stream(s):
        w = xp.zeros(N, dtype=xp.float32)
        w_ptr = ptr(w)
        s.synchronize()
        dev.begin_capture(s.handle, CAPTURE_MODES["relaxed"])
        w.fill(5.0)  # the graph writes w
        tmp = w + 1.0  # the capture's first allocation: detected
        del w, tmp
        graph = dev.end_capture(s.handle)
        exe = dev.instantiate(graph)
        y = xp.full(N, 7.0, dtype=xp.float32)
        assert ptr(y) != w_ptr  # kept for the graph
        dev.launch(exe, s.handle)
        s.synchronize()
        assert total(y) == 7.0 * N
        recs = runtime.allocator()._records.values()
        pool = [r for r in recs if r.foreign and r.stream == s.handle][-1].pool
        dev.destroy_graph_exec(exe)
        dev.destroy_graph(graph)
        assert wait_released(pool)  # the allocator notices the release
        z = xp.full(N, 1.0, dtype=xp.float32)
        assert ptr(z) == w_ptr  # back in the ordinary pool once the graph is gone
    del y, z
    settle()


def test_invalidated_foreign_capture_leaks_nothing(backend: Any) -> None:
    xp = backend.xp
    base = settle()
    dev = runtime.get().device(gp.current_device())
    s = gp.Stream()
    with gp.stream(s):
        x = xp.ones(N, dtype=xp.float32)
        s.synchronize()
        dev.begin_capture(s.handle, CAPTURE_MODES["global"])
        t = x * 2.0 + 1.0
        assert owner(t) is not None
        with pytest.raises(GraphpoolError):
            s.synchronize()  # illegal while capturing: the capture is invalidated
        with pytest.raises(GraphpoolError):
            dev.end_capture(s.handle)  # its graph is discarded (and its user objects released)
        del t
        assert not s.query_capturing()
    del x
    for p in runtime.allocator().private_pools():
        assert wait_released(p)
    assert settle() == base
    assert all(p.use_count == 0 for p in runtime.allocator().private_pools())
    gp.check_invariants()


def test_graphpool_capture_is_not_adopted_twice(backend: Any) -> None:
    """gp.graph registers its capture itself: detection finds it registered, adds nothing."""
    xp = backend.xp
    settle()
    g = gp.CUDAGraph()
    with gp.graph(g):
        out = xp.ones(16, dtype=xp.float32) + 1.0
    assert owner(out).id == g.pool()
    assert len([p for p in runtime.allocator().private_pools() if p.use_count]) == 1
    del out, g
    settle()


def test_freeing_memory_of_a_destroyed_stream_asks_the_driver_nothing(backend: Any) -> None:
    """Arrays outlive their streams (CuPy's test_stream.py check_del does this): a free must
    not query the block's stream, which the driver may have forgotten (a query of a
    destroyed stream crashed the process on the H200)."""
    settle()
    dev = runtime.get().device(gp.current_device())
    handle = dev.create_stream()
    s = gp.Stream._wrap(gp.current_device(), handle)  # a framework's stream
    a = runtime.allocator()
    buf = gp.alloc(4096, s)
    asked: list[int] = []
    query = a._query
    a._query = lambda stream: asked.append(stream) or query(stream)  # type: ignore[assignment]
    try:
        dev.destroy_stream(handle)
        buf.free()
        assert asked == []  # (a new stream may get the destroyed one's handle: ask nothing after)
    finally:
        a._query = query  # type: ignore[assignment]
    gp.check_invariants()


def _used_on_a_second_stream() -> tuple[Any, gp.Stream, gp.Stream, gp.DeviceBuffer]:
    """A settled device, streams s and u, and a buffer allocated on s and used on u
    (``record_stream``), its work on s done."""
    settle()
    dev = runtime.get().device(gp.current_device())
    s, u = gp.Stream(), gp.Stream()
    buf = gp.alloc(N * 4, s)
    buf.record_stream(u)
    s.synchronize()
    return dev, s, u, buf


@pytest.mark.parametrize("mode", ["global", "relaxed"])
def test_a_record_streamed_free_while_its_user_stream_captures_unseen(backend: Any, mode: str) -> None:
    """A block used on stream u (record_stream) is freed while u captures, in a capture begun
    outside graphpool that has made no allocation yet. Its event cannot go into that capture
    (an event recorded in a capture cannot be queried after, and every later allocation would
    fail): the free adopts the capture, keeps the block for its graph, and records the event
    once no capture is underway. Nothing fails after, and the memory comes back."""
    dev, s, u, buf = _used_on_a_second_stream()
    p = buf.ptr
    dev.begin_capture(u.handle, CAPTURE_MODES[mode])
    buf.free()  # u is capturing: the capture is adopted here
    a = runtime.allocator()
    assert any(r.foreign and r.stream == u.handle for r in a._captures.values())
    graph = dev.end_capture(u.handle)
    other = gp.alloc(N * 4, s)  # works (no captured event is queried)
    assert other.ptr != p  # p is kept for the graph, which may touch it on every replay
    gp.check_invariants()
    recs = a._records.values()
    pool = [r for r in recs if r.foreign and r.stream == u.handle][-1].pool
    dev.destroy_graph(graph)
    assert wait_released(pool)
    other.free()
    again = gp.alloc(N * 4, s)
    assert again.ptr == p  # back in the ordinary pool
    again.free()
    gp.check_invariants()
    settle()


def test_a_record_streamed_free_during_a_graphpool_capture_while_its_user_stream_captures_unseen(
    backend: Any,
) -> None:
    """As above, with a gp.graph capture underway at the free: the block's event must not go
    into u's capture when that gp.graph capture ends (it would wedge every later allocation)."""
    xp = backend.xp
    dev, s, u, buf = _used_on_a_second_stream()
    p = buf.ptr
    g = gp.CUDAGraph()
    with gp.graph(g):
        out = xp.ones(16, dtype=xp.float32) + 1.0
        dev.begin_capture(u.handle, CAPTURE_MODES["relaxed"])
        buf.free()  # u captures unseen: its capture is adopted, not recorded into
    graph = dev.end_capture(u.handle)
    other = gp.alloc(N * 4, s)  # works (no captured event is queried)
    assert other.ptr != p
    gp.check_invariants()
    dev.destroy_graph(graph)
    other.free()
    del out, g
    gp.check_invariants()
    settle()


@pytest.mark.parametrize("destroy_graph_first", [False, True])
def test_kept_block_of_a_foreign_graph_waits_for_its_in_flight_launch(
    backend: Any, destroy_graph_first: bool
) -> None:
    """The graph and its exec are destroyed while a launch is still queued behind a long
    kernel. CUDA releases the graph's user object only when that launch completes, so the
    block the graph writes (an eager array dropped inside the capture, kept for the graph)
    must not reach eager code before: an eager array made on its stream in the meantime keeps
    its bytes, and the block comes back once the launch is done."""
    xp = backend.xp
    settle()
    dev = runtime.get().device(0)
    a, s = gp.Stream(), gp.Stream()
    with gp.stream(a):
        w = xp.zeros(N, dtype=xp.float32)  # eager on a, made before the capture
        w_ptr = ptr(w)
    a.synchronize()
    with gp.stream(s):
        dev.begin_capture(s.handle, CAPTURE_MODES["relaxed"])
        tmp = xp.ones(N, dtype=xp.float32)  # the capture's first allocation: detected
        w.fill(5.0)  # the graph writes w on every launch
        out = w + tmp
        del w, tmp  # freed inside the capture: w is kept for the graph
        graph = dev.end_capture(s.handle)
    exe = dev.instantiate(graph)
    recs = runtime.allocator()._records.values()
    pool = [r for r in recs if r.foreign and r.stream == s.handle][-1].pool
    backend.spin(s)
    dev.launch(exe, s.handle)  # in flight behind the spin
    if destroy_graph_first:
        dev.destroy_graph(graph)
        dev.destroy_graph_exec(exe)
    else:
        dev.destroy_graph_exec(exe)
        dev.destroy_graph(graph)
    gp.memory_stats()  # the allocator asks the device for released graphs
    with gp.stream(a):
        y = xp.full(N, 7.0, dtype=xp.float32)  # eager on w's stream while the launch is queued
    gp.synchronize()
    assert total(y) == 7.0 * N  # the in-flight launch wrote none of y
    assert total(out) == 6.0 * N
    assert wait_released(pool)  # released once the launch completed
    with gp.stream(a):
        z = xp.full(N, 1.0, dtype=xp.float32)
        assert ptr(z) == w_ptr  # and w's block is back in the ordinary pool
    del out, y, z
    settle()
    gp.check_invariants()


# issue 24 -------------------------------------------------------------------------------
def test_a_buffer_made_on_another_stream_and_freed_during_a_detected_capture_is_kept(backend: Any) -> None:
    """During a capture begun outside graphpool, a buffer made on stream W (not capturing),
    written by a captured memset and freed before the capture ends, is kept for the graph:
    the eager allocation on W after the capture gets other memory, which a replay leaves
    intact, and the buffer's block is W's again once the graph is destroyed."""
    settle()
    dev = runtime.get().device(gp.current_device())
    s, w = gp.Stream(), gp.Stream()
    n = 1 << 20
    dev.begin_capture(s.handle, CAPTURE_MODES["relaxed"])
    out = gp.alloc(n, stream=s)  # detected
    tmp = gp.alloc(n, stream=w)
    dev.memset(tmp.ptr, 0x55, n, s.handle)
    dev.memcpy(out.ptr, tmp.ptr, n, s.handle)
    tmp_ptr = tmp.ptr
    tmp.free()
    graph = dev.end_capture(s.handle)
    exe = dev.instantiate(graph)
    y = gp.alloc(n, stream=w)
    assert y.ptr != tmp_ptr
    dev.memset(y.ptr, 7, n, w.handle)
    w.synchronize()
    dev.launch(exe, s.handle)
    s.synchronize()
    assert dev.read(y.ptr, n, w.handle) == bytes([7]) * n
    pool = [r for r in runtime.allocator()._records.values() if r.foreign][-1].pool
    dev.destroy_graph_exec(exe)
    dev.destroy_graph(graph)
    assert wait_released(pool)
    again = gp.alloc(n, stream=w)
    assert again.ptr == tmp_ptr
    del y, again, out
    settle()


def _replayed_on(r: gp.Stream) -> tuple[gp.CUDAGraph, Any]:
    """A graph that kept an eager block (freed during its capture) and was replayed on ``r``:
    its release waits for an event on ``r``."""
    dev = runtime.get().device(gp.current_device())
    x = gp.alloc(1 << 20)
    g = gp.CUDAGraph()
    with gp.graph(g):
        out = gp.alloc(1 << 20)
        dev.memcpy(out.ptr, x.ptr, 1 << 20, gp.current_stream().handle)
        x.free()  # kept for g
    with gp.stream(r):
        g.replay()
    r.synchronize()
    return g, out


@pytest.mark.parametrize("how", ["reset", "collect"])
def test_a_graph_released_while_its_replay_stream_captures_unseen_wedges_nothing(
    backend: Any, how: str
) -> None:
    """Issue 24's wedge: a graph replayed on stream R is released (reset, or collected and its
    queued release carried out by the first allocation inside the capture) while R captures
    in a capture begun outside graphpool that has made no allocation yet. The release's
    event on R went into that capture, and from its end every allocation and empty_cache
    raised cudaErrorCapturedEvent. The release asks R first: the capture is adopted and the
    event recorded after it ends."""
    settle()
    dev = runtime.get().device(gp.current_device())
    r = gp.Stream()
    g, out = _replayed_on(r)
    dev.begin_capture(r.handle, CAPTURE_MODES["relaxed"])  # a library's own capture on R
    if how == "reset":
        g.reset()
    else:
        del g
        gc.collect()  # its release is queued
        t = gp.alloc(4096, stream=r)  # the capture's first allocation carries it out
        dev.memset(t.ptr, 1, 4096, r.handle)
        t.free()
    graph = dev.end_capture(r.handle)  # not invalidated
    exe = dev.instantiate(graph)
    for _ in range(SWEEP_EVERY + 1):  # the end is noticed, the event recorded and queried
        gp.alloc(4096).free()
    gp.synchronize()
    gp.empty_cache()
    gp.check_invariants()
    dev.destroy_graph_exec(exe)
    dev.destroy_graph(graph)
    del out
    settle()


def test_a_buffer_dropped_in_a_detected_capture_before_its_first_allocation_is_kept(backend: Any) -> None:
    """The captured kernels write an eager array, which is dropped (its free queued) before
    the capture allocates anything. The first allocation detects the capture before it
    carries the queued free out, so the array's block is kept for the graph (it was carried
    out first, as a free with no capture underway, and handed to the next eager array)."""
    xp = backend.xp
    settle()
    dev = runtime.get().device(gp.current_device())
    s = gp.Stream()
    with gp.stream(s):
        w = xp.zeros(N, dtype=xp.float32)
        z = xp.ones(N, dtype=xp.float32)
        w_ptr = ptr(w)
        s.synchronize()
        dev.begin_capture(s.handle, CAPTURE_MODES["relaxed"])
        w.fill(5.0)  # the graph writes w
        del w  # queued: no allocator call since
        t = z + 1.0  # the capture's first allocation
        graph = dev.end_capture(s.handle)
        exe = dev.instantiate(graph)
        y = xp.full(N, 7.0, dtype=xp.float32)
        assert ptr(y) != w_ptr
        dev.launch(exe, s.handle)
        s.synchronize()
        assert total(y) == 7.0 * N
        dev.destroy_graph_exec(exe)
        dev.destroy_graph(graph)
    del y, z, t
    settle()


def test_eager_frees_after_a_detected_capture_ended_are_not_kept_for_its_graph(backend: Any) -> None:
    """Issue 24's window: a capture begun outside graphpool ended, and graphpool notices only
    at the SWEEP_EVERY-th allocation or a statistics call. Buffers freed in between, made
    before the capture and never touched by it, were kept for its graph while it lived. A
    free that would keep a block asks the device whether such captures are still underway."""
    settle()
    dev = runtime.get().device(gp.current_device())
    n = 8 << 20
    eager = [gp.alloc(n) for _ in range(4)]
    r = gp.Stream()
    dev.begin_capture(r.handle, CAPTURE_MODES["relaxed"])
    t = gp.alloc(4096, stream=r)  # detected
    dev.memset(t.ptr, 1, 4096, r.handle)
    graph = dev.end_capture(r.handle)
    exe = dev.instantiate(graph)  # the library keeps its graph to replay
    a = runtime.allocator()
    assert a._capturing == 1  # not noticed yet
    for b in eager:
        b.free()
    assert a._capturing == 0
    st = gp.memory_stats()
    assert st["active_bytes.all.current"] == st["allocated_bytes.all.current"]  # nothing kept
    gp.empty_cache()
    assert gp.memory_stats()["reserved_bytes.large_pool.current"] == 0  # all given back
    dev.destroy_graph_exec(exe)
    dev.destroy_graph(graph)
    del t
    settle()

"""Capture rules under threads, abandonment, other devices and long runs (docs/behaviour.rst,
"Private pools for graph capture").

One test per way these rules were found broken; each failed on the code before its fix.
The `backend` fixture runs them on the simulator and, marked gpu, on a real GPU with CuPy.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

import pytest
from scenario_common import ptr, settle, total

import graphpool as gp
from graphpool import runtime
from graphpool.sim import SimBackend

MiB = 1 << 20
N = 1024


def in_thread(fn: Any) -> None:
    """Run ``fn`` on another thread and re-raise what it raised here."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if errors:
        raise errors[0]


# 1 --------------------------------------------------------------------------------------
def test_other_thread_drops_a_default_stream_buffer_the_capture_writes(backend: Any) -> None:
    xp = backend.xp
    settle()
    holder = {"B": xp.zeros(N, dtype=xp.float32)}
    b_ptr = ptr(holder["B"])
    gp.synchronize()
    g = gp.CUDAGraph()
    with gp.graph(g):
        holder["B"].fill(3.0)  # the graph writes B
        in_thread(lambda: holder.pop("B"))  # another thread drops it mid-capture
    y = xp.full(N, 7.0, dtype=xp.float32)
    assert ptr(y) != b_ptr  # kept for the graph
    g.replay()
    gp.synchronize()
    assert total(y) == 7.0 * N
    del g, y
    settle()


def test_other_thread_drops_a_buffer_of_a_joined_stream(backend: Any) -> None:
    xp = backend.xp
    settle()
    s, j = gp.Stream(), gp.Stream()
    with gp.stream(j):
        holder = {"B": xp.zeros(N, dtype=xp.float32)}
        j.synchronize()
    b_ptr = ptr(holder["B"])
    g = gp.CUDAGraph()
    with gp.graph(g, stream=s, capture_error_mode="thread_local"):
        j.wait_stream(s)  # j joins the capture
        with gp.stream(j):
            holder["B"].fill(3.0)
        s.wait_stream(j)
        in_thread(lambda: holder.pop("B"))
        gp.memory_stats()  # the queued free is carried out during the capture
    with gp.stream(j):
        y = xp.full(N, 7.0, dtype=xp.float32)
        assert ptr(y) != b_ptr
        g.replay()
    gp.synchronize()
    assert total(y) == 7.0 * N
    del g, y
    settle()


def test_eager_thread_memory_made_during_a_capture_is_kept_for_the_graph(backend: Any) -> None:
    """A block allocated after the capture began, on a stream outside it, by another thread
    or by the capturing thread, and freed during the capture: graphpool cannot see whether a
    captured kernel uses it, so it is kept for the graph (none is handed out twice) and comes
    back when the graph is reset. (It went back at once before issue 24.)"""
    settle()
    s = gp.Stream()
    seen: list[int] = []

    def eager() -> None:
        other = gp.Stream()
        for _ in range(3):
            buf = gp.alloc(4096, other)
            seen.append(buf.ptr)
            buf.free()

    g = gp.CUDAGraph()
    with gp.graph(g, stream=s, capture_error_mode="relaxed"):
        backend.xp.ones(8, dtype=backend.xp.float32)
        in_thread(eager)
        eager()  # the capturing thread's own work on a stream outside the capture: the same
    assert len(set(seen)) == 6
    st = gp.memory_stats()
    assert st["active_bytes.all.current"] - st["allocated_bytes.all.current"] == 6 * 4096
    g.reset()
    st = gp.memory_stats()
    assert st["active_bytes.all.current"] == st["allocated_bytes.all.current"]
    del g
    settle()


@pytest.mark.parametrize(
    ("api", "mode", "how"),
    [
        ("graph", "global", "free"),
        ("graph", "thread_local", "drop"),
        ("graph", "relaxed", "free"),
        ("capture_begin", "global", "drop"),
        ("capture_begin", "relaxed", "free"),
    ],
)
def test_a_buffer_made_on_another_stream_and_freed_during_the_capture_is_kept(
    backend: Any, api: str, mode: str, how: str
) -> None:
    """Issue 24's corruption: inside the capture, a buffer made on stream W (which is not
    capturing), written by a captured memset, read by a captured copy, and freed (or dropped:
    a queued free) before the capture ends. The next eager allocation on W took its block,
    and one replay overwrote all of it. Kept for the graph now."""
    settle()
    dev = runtime.get().device(gp.current_device())
    w = gp.Stream()
    g = gp.CUDAGraph()
    holder: dict[str, Any] = {}

    def body() -> None:
        c = gp.current_stream()
        tmp = gp.alloc(MiB, stream=w)
        holder["out"] = out = gp.alloc(MiB)
        dev.memset(tmp.ptr, 0x55, MiB, c.handle)  # captured: writes tmp on every replay
        dev.memcpy(out.ptr, tmp.ptr, MiB, c.handle)
        holder["tmp"] = tmp.ptr
        if how == "free":
            tmp.free()
        else:
            del tmp  # its finalizer queues the free

    if api == "graph":
        with gp.graph(g, capture_error_mode=mode):
            body()
    else:
        with gp.stream(gp.Stream()):
            g.capture_begin(capture_error_mode=mode)
            body()
            g.capture_end()
    y = gp.alloc(MiB, stream=w)  # eager, on W, after the capture
    assert y.ptr != holder["tmp"]
    dev.memset(y.ptr, 7, MiB, w.handle)
    w.synchronize()
    g.replay()
    gp.synchronize()
    assert dev.read(y.ptr, MiB, w.handle) == bytes([7]) * MiB
    assert dev.read(holder["out"].ptr, MiB, w.handle) == bytes([0x55]) * MiB
    g.reset()
    again = gp.alloc(MiB, stream=w)
    assert again.ptr == holder["tmp"]  # back in W's cache with the graph gone
    holder.clear()
    del y, again, g
    settle()


# 2 --------------------------------------------------------------------------------------
def test_capture_on_one_device_protects_the_other() -> None:
    runtime.set_backend("sim", backend=SimBackend(device_count=2))
    try:
        from graphpool.sim import xp

        with gp.device(1):
            gp.alloc(4096).free()  # device 1 caches a free segment
        before = gp.memory_reserved(1)
        s = gp.Stream(0)
        g = gp.CUDAGraph()
        with gp.stream(s):
            g.capture_begin()
            y = xp.ones(8) + 1
            with pytest.raises(gp.CaptureError, match="another device"):
                gp.empty_cache(1)  # refused cleanly: CUDA's capture rules are process-wide
            gp.check_invariants(1)
            assert gp.memory_reserved(1) == before
            with gp.device(1):
                big = gp.alloc(8 * MiB)  # a new segment on device 1: relaxed, legal
            g.capture_end()  # device 0's capture survived both
        g.replay()
        del big, y, g
        settle()
        gp.empty_cache(1)
        assert gp.memory_reserved(1) == 0
    finally:
        gp.set_backend("sim")


# 3 --------------------------------------------------------------------------------------
def test_abandoned_capture_in_a_shared_pool_leaks_nothing(backend: Any) -> None:
    xp = backend.xp
    settle()
    s = gp.Stream()
    h = gp.graph_pool_handle()
    g0 = gp.CUDAGraph()
    with gp.graph(g0, pool=h, stream=s):
        out0 = xp.ones(16, dtype=xp.float32) + 1  # g0 keeps pool h alive
    base = settle()

    def abandon() -> None:
        g1 = gp.CUDAGraph()
        with gp.stream(s):
            g1.capture_begin(pool=h)
            xp.ones(3 * MiB, dtype=xp.float32)  # a new 20 MiB segment in pool h
        # g1 dropped mid-capture

    abandon()
    gc.collect()
    assert not s.query_capturing()  # ended at once: the stream is usable right away
    gp.synchronize()
    assert settle() == base
    assert gp.memory_stats(pool=h)["use_count"] == 1
    g0.reset()
    del out0
    settle()


# 4 --------------------------------------------------------------------------------------
def test_free_after_record_stream_on_a_destroyed_stream() -> None:
    gp.set_backend("sim")
    dev = runtime.get().device(0)
    base = settle()
    h = dev.create_stream()
    ext = gp.Stream._wrap(0, h)  # a framework's stream, as graphpool.cupy wraps them
    buf = gp.alloc(4096)
    buf.record_stream(ext)
    dev.destroy_stream(h)
    buf.free()  # no error: the device is synchronized instead of an event on a dead stream
    gp.check_invariants()
    assert gp.memory_stats()["active_bytes.all.current"] == 0
    assert settle() == base


# 5 --------------------------------------------------------------------------------------
def test_checker_sees_the_wrap_around_overwrite(backend: Any) -> None:
    xp = backend.xp
    settle()
    gp.set_replay_checks("raise")
    s = gp.Stream()
    h = gp.graph_pool_handle()
    g0, g1 = gp.CUDAGraph(), gp.CUDAGraph()
    with gp.graph(g0, pool=h, stream=s):
        t = xp.full(1000, 5.0, dtype=xp.float32)
        out0 = t + 0
        del t
    with gp.graph(g1, pool=h, stream=s):
        out1 = xp.full(1000, 7.0, dtype=xp.float32)  # takes t's block
    with gp.stream(s):
        g0.replay()
        g1.replay()
        with pytest.raises(gp.ReplayHazardError, match="still referenced"):
            g0.replay()  # would overwrite out1
    gp.synchronize()
    assert total(out1) == 7.0 * 1000
    del out0, out1, g0, g1
    settle()


# 6 --------------------------------------------------------------------------------------
def test_thread_that_dies_mid_capture_does_not_wedge_the_allocator() -> None:
    gp.set_backend("sim")
    from graphpool.sim import xp

    def worker() -> None:
        g = gp.CUDAGraph()
        with gp.stream(gp.Stream()):
            g.capture_begin(capture_error_mode="thread_local")
            xp.ones(8) + 1
            raise RuntimeError("worker failed mid-capture")

    with pytest.raises(RuntimeError, match="mid-capture"):
        in_thread(worker)
    gc.collect()
    gp.empty_cache()  # not refused
    a = runtime.allocator(0)
    assert a._capturing == 0 and a._world.active == 0
    side = gp.Stream()
    b = gp.alloc(MiB)
    b.record_stream(side)
    p = b.ptr
    b.free()
    side.synchronize()
    assert gp.alloc(MiB).ptr == p  # record_stream'd frees are processed again
    gp.check_invariants()
    from graphpool.sim import capture as sim_capture

    for cap in sim_capture.ongoing():  # the dead thread's capture can never end: forget it
        sim_capture.finish(cap)


# 7 --------------------------------------------------------------------------------------
def test_capture_cost_does_not_grow_with_history() -> None:
    gp.set_backend("sim")
    from graphpool.sim import xp

    s = gp.Stream()
    h = gp.graph_pool_handle()
    a = runtime.allocator(0)
    for _ in range(300):  # the checks below are of what is kept: 300 captures show it as 3000 did
        g = gp.CUDAGraph()
        with gp.graph(g, pool=h, stream=s):
            y = xp.ones(4) + 1
        g.reset()
        del y
    assert len(a._records) == 0  # released records are forgotten
    heads = [a._segments[b] for b in a._seg_bases]
    assert all(head.returns_with is None for head in heads)


def test_capture_malloc_costs_what_an_eager_one_does_with_many_live_blocks() -> None:
    gp.set_backend("sim")

    def run(n: int, capture: bool) -> float:
        s = gp.Stream()
        bufs = []
        g = gp.CUDAGraph()
        with gp.stream(s):
            if capture:
                g.capture_begin()
            t0 = time.perf_counter()
            for _ in range(n):
                bufs.append(gp.alloc(512))
            dt = time.perf_counter() - t0
            if capture:
                g._abandon()
        return dt

    eager, during = float("inf"), float("inf")
    for _ in range(5):  # interleaved, so a load that comes and goes weighs on both alike
        eager = min(eager, run(4000, False))
        during = min(during, run(4000, True))
    assert during < 2.5 * eager, (during, eager)  # was 5x and growing with n (O(blocks) each)


# 8 --------------------------------------------------------------------------------------
def test_reset_after_set_backend_releases_the_graph() -> None:
    gp.set_backend("sim")
    from graphpool.sim import xp

    g = gp.CUDAGraph()
    with gp.graph(g, stream=gp.Stream()):
        y = xp.ones(100) + 1
    old = g._alloc
    assert old is not None
    gp.set_backend("sim")
    g.reset()
    assert g._rec is None
    assert [p.use_count for p in old.private_pools()] == [0]
    del y


# 9 --------------------------------------------------------------------------------------
def test_free_after_a_capturing_stream_used_it_joins_nothing(backend: Any) -> None:
    """What cuda.core's deallocate(ptr, size, stream) now does (DeviceBuffer._free_after)."""
    xp = backend.xp
    settle()
    for eager in (gp.Stream(), gp.default_stream()):
        buf = gp.alloc(4096, stream=eager)
        cap, g = gp.Stream(), gp.CUDAGraph()
        with gp.stream(cap):
            g.capture_begin()
            y = xp.ones(4, dtype=xp.float32) + 1
            buf._free_after(cap.handle)
            gp.memory_stats()  # drained during the capture
            assert not eager.query_capturing()
            g.capture_end()  # not invalidated
        g.replay()
        gp.synchronize()
        del buf, y, g
    settle()


# 10 -------------------------------------------------------------------------------------
def test_oom_retry_finds_the_block_its_synchronization_freed() -> None:
    runtime.set_backend("sim", backend=SimBackend(device_count=1, memory_bytes=20 * MiB))
    try:
        s, t = gp.Stream(), gp.Stream()
        a = gp.alloc(8 * MiB, stream=s)
        b = gp.alloc(12 * MiB - 512, stream=s)
        runtime.get().device(0).launch_sleep(t.handle, 100)  # type: ignore[attr-defined]
        a.record_stream(t)
        a_ptr = a.ptr
        a.free()  # waits on an event on t
        c = gp.alloc(8 * MiB, stream=s)  # OOM, sync, and a's block fits: no failure
        assert c.ptr == a_ptr
        st = gp.memory_stats()
        assert (st["num_ooms"], st["reserved_bytes.all.current"]) == (0, 20 * MiB)
        gp.check_invariants()
        del b, c
    finally:
        gp.set_backend("sim")


# 11 -------------------------------------------------------------------------------------
def _run_threads(*fns: Any) -> None:
    errors: list[BaseException] = []

    def guard(fn: Any) -> Any:
        def run() -> None:
            try:
                fn()
            except BaseException as exc:
                errors.append(exc)

        return run

    threads = [threading.Thread(target=guard(fn)) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("first_mode", ["thread_local", "relaxed", "global"])
def test_two_threads_each_in_gp_graph(backend: Any, first_mode: str) -> None:
    xp = backend.xp
    settle()
    started, release = threading.Event(), threading.Event()
    made: dict[str, Any] = {}

    def a() -> None:
        g = gp.CUDAGraph()
        try:
            with gp.graph(g, capture_error_mode=first_mode):
                made["x"] = xp.ones(10, dtype=xp.float32) + 1
                started.set()
                release.wait(10)
            made["ga"] = g
        finally:
            started.set()

    def b() -> None:
        started.wait(10)
        g = gp.CUDAGraph()
        try:  # its entry neither synchronizes nor empties the cache: A's capture survives
            with gp.graph(g, capture_error_mode="thread_local"):
                made["y"] = xp.ones(10, dtype=xp.float32) + 2
            made["gb"] = g
        finally:
            release.set()

    _run_threads(a, b)
    made["ga"].replay()
    made["gb"].replay()
    gp.synchronize()
    assert (total(made["x"]), total(made["y"])) == (20.0, 30.0)
    made.clear()
    settle()


def test_global_mode_refuses_another_threads_synchronize_clearly(backend: Any) -> None:
    xp = backend.xp
    settle()
    started, release = threading.Event(), threading.Event()
    seen: dict[str, BaseException] = {}

    def a() -> None:
        g = gp.CUDAGraph()
        try:
            with gp.graph(g):  # global mode
                xp.ones(10, dtype=xp.float32) + 1
                started.set()
                release.wait(10)
        except gp.CaptureError as exc:  # invalidated by the other thread's call, as in CUDA
            seen["a"] = exc
        finally:
            started.set()

    def b() -> None:
        started.wait(10)
        try:
            gp.Stream().synchronize()
        except gp.CaptureError as exc:
            seen["b"] = exc
        finally:
            release.set()

    _run_threads(a, b)
    assert "global" in str(seen["b"]) and "capture_error_mode" in str(seen["b"])
    assert "failed and was discarded" in str(seen["a"])
    assert str(seen["a"]).endswith(
        "A call that is not allowed during capture (synchronize, event query, device allocation) "
        "invalidates it; capture_error_mode='thread_local' or 'relaxed' allows some of them."
    )
    settle()


def test_nested_gp_graph_on_one_thread(backend: Any) -> None:
    xp = backend.xp
    settle()
    outer, inner = gp.CUDAGraph(), gp.CUDAGraph()
    with gp.graph(outer, capture_error_mode="thread_local"):
        a = xp.ones(10, dtype=xp.float32) + 1
        with gp.graph(inner, capture_error_mode="thread_local"):
            b = xp.ones(10, dtype=xp.float32) + 2
    outer.replay()
    inner.replay()
    gp.synchronize()
    assert (total(a), total(b)) == (20.0, 30.0)
    del a, b, outer, inner
    settle()


def test_successive_gp_graphs_of_a_thread_capture_on_its_side_stream(backend: Any) -> None:
    """Without ``stream=``, gp.graph captures on one side stream per thread and device,
    made once (a nested one, while it captures, gets a stream of its own)."""
    xp = backend.xp
    settle()
    a = xp.ones(10, dtype=xp.float32)
    seen, kept = [], []
    for _ in range(2):
        g = gp.CUDAGraph()
        with gp.graph(g):
            seen.append(gp.current_stream())
            kept.append(a + 1)
        kept.append(g)
    assert seen[0] == seen[1] and seen[0] != gp.current_stream()
    del kept, g
    settle()


# 12 -------------------------------------------------------------------------------------
def test_memory_kept_for_a_graph_is_visible(backend: Any) -> None:
    settle()

    class Holder:
        pass

    h = Holder()
    h.me = h  # type: ignore[attr-defined]
    h.buf = gp.alloc(64 * MiB)  # type: ignore[attr-defined]
    g = gp.CUDAGraph()
    with gp.graph(g):
        del h
        gc.collect()  # its last reference goes during the capture
    seg = next(x for x in gp.memory_snapshot() if x["total_size"] == 64 * MiB)
    block = seg["blocks"][0]
    assert (block["state"], block["owner_graph"], block["kept_for"]) == (
        "active_pending_free",
        g.label,
        [g.label],
    )
    a = runtime.allocator()
    assert "64.00 MiB of ordinary blocks kept for captured graphs" in a._oom_message(1, 2 * MiB)
    g.reset()
    settle()


# 14 -------------------------------------------------------------------------------------
def test_launches_of_one_graph_run_in_order_on_any_streams(backend: Any) -> None:
    xp = backend.xp
    settle()
    s0, s1, s2 = gp.Stream(), gp.Stream(), gp.Stream()
    with gp.stream(s0):
        x = xp.zeros(N, dtype=xp.float32)
        s0.synchronize()
    g = gp.CUDAGraph()
    dev = runtime.get().device(gp.current_device())
    with gp.graph(g, stream=s0):  # x += 1 as two nodes through a temporary
        t = x + 1
        dev.memcpy(ptr(x), ptr(t), N * 4, gp.current_stream().handle)
        del t
    with gp.stream(s1):
        g.replay()
    with gp.stream(s2):
        g.replay()
    gp.synchronize()
    assert total(x) == 2.0 * N
    del g, x
    settle()


def test_buffer_free_never_waits_for_another_threads_lock() -> None:
    """A free from code that runs while holding a lock the allocator's holder needs (a
    finalizer inside a simulated kernel) must not deadlock: it is queued instead."""
    gp.set_backend("sim")
    buf = gp.alloc(4096)
    a = runtime.allocator(0)
    held, done = threading.Event(), threading.Event()

    def hold() -> None:
        with a._lock:
            held.set()
            done.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    try:
        buf.free()  # returns at once: queued
        assert buf.freed and a.lookup(buf.ptr) is not None
    finally:
        done.set()
        t.join()
    gp.memory_stats()  # drained
    assert a.lookup(buf.ptr) is None
    gp.check_invariants()

"""Capture lifetimes beyond the scenarios (docs/behaviour.rst: private pools, CUDA graphs), on both backends:
blocks freed during capture, record_stream during capture, joined streams, repeated
capture/replay/reset cycles, abandoned and revived pools, eager threads during capture."""

from __future__ import annotations

import gc
import threading
from typing import Any

import graphpool as gp
from graphpool import runtime

N = 1 << 18  # 1 MiB of float32: the small pool


def settle() -> None:
    gc.collect()
    gp.synchronize()
    gp.empty_cache()


def total(arr: Any) -> float:
    return float(arr.sum().item())


def ptr(arr: Any) -> int:
    return int(arr.data.ptr)


def test_outside_block_freed_during_capture_is_kept_until_reset(backend: Any) -> None:
    xp = backend.xp
    settle()
    s = gp.Stream()
    with gp.stream(s):
        x = xp.ones(N, dtype=xp.float32)
        x_ptr = ptr(x)
        g = gp.CUDAGraph()
        g.capture_begin()
        z = x + 1  # the graph reads x on every replay
        del x  # dropped inside the capture body
        g.capture_end()
        active = gp.memory_stats()["active_bytes.all.current"]
        y = xp.full(N, 7, dtype=xp.float32)  # same size, same stream: must not get x's block
        assert ptr(y) != x_ptr
        g.replay()
        assert total(y) == 7 * N
        assert total(z) == 2 * N
        assert gp.memory_stats()["active_bytes.all.current"] == active + N * 4
        gp.check_invariants()
        g.reset()
        # Once the graph is gone the block is back in the ordinary pool.
        again = xp.empty(N, dtype=xp.float32)
        assert ptr(again) == x_ptr
    del y, z, again, g
    settle()


def test_record_stream_during_capture_is_deferred(backend: Any) -> None:
    xp = backend.xp
    settle()
    s, other = gp.Stream(), gp.Stream()
    with gp.stream(s):
        buf = gp.alloc(4096)
        buf.record_stream(other)
        a = xp.ones(N, dtype=xp.float32)
        g = gp.CUDAGraph()
        g.capture_begin()  # global mode: an event query here would invalidate the capture
        b = a * 3
        buf.record_stream(other)
        buf.free()  # deferred: no event recorded or queried until the capture ends
        g.capture_end()
        g.replay()
        assert total(b) == 3 * N
    gp.check_invariants()
    del a, b, g
    settle()
    assert gp.memory_stats()["active.all.current"] == 0


def test_joined_stream_allocates_from_the_capture_pool(backend: Any) -> None:
    xp = backend.xp
    settle()
    s, side = gp.Stream(), gp.Stream()
    with gp.stream(s):
        a = xp.ones(N, dtype=xp.float32)
        g = gp.CUDAGraph()
        g.capture_begin()
        side.wait_stream(s)  # side joins the capture
        with gp.stream(side):
            c = a + 4
        s.wait_stream(side)  # and rejoins before the end
        g.capture_end()
    pool = g.pool()
    assert gp.memory_stats(pool=pool)["allocation.all.current"] == 1
    alloc = runtime.allocator()
    block = alloc.lookup(ptr(c))
    assert block is not None and block.free_list.private_pool is not None
    with gp.stream(s):
        g.replay()
        assert total(c) == 5 * N
    del a, c, g
    settle()


def test_capture_cycles_keep_reserved_memory_stable(backend: Any) -> None:
    xp = backend.xp
    settle()
    s = gp.Stream()
    with gp.stream(s):
        a = xp.ones(N, dtype=xp.float32)
    reserved = []
    for i in range(8):
        g = gp.CUDAGraph()
        with gp.graph(g, stream=s):
            b = (a + i) * 2
            c = b - 1
        with gp.stream(s):
            g.replay()
            assert total(c) == (2 * (1 + i) - 1) * N
        g.reset()
        del b, c, g
        settle()
        reserved.append(gp.memory_reserved())
    assert len(set(reserved)) == 1, reserved
    del a
    settle()


def test_reused_graph_object_and_revived_pool(backend: Any) -> None:
    xp = backend.xp
    settle()
    s = gp.Stream()
    handle = gp.graph_pool_handle()
    with gp.stream(s):
        a = xp.ones(N, dtype=xp.float32)
    g = gp.CUDAGraph()
    with gp.graph(g, pool=handle, stream=s):
        out = a + 1
    assert g.pool() == handle
    assert gp.memory_stats(pool=handle)["use_count"] == 1
    with gp.stream(s):
        g.replay()  # out = 2
    g.reset()  # the pool becomes freeable; `out` keeps it alive
    assert gp.memory_stats(pool=handle)["use_count"] == 0
    with gp.graph(g, pool=handle, stream=s):  # captured into again: revived
        out2 = out * 3
    assert gp.memory_stats(pool=handle)["use_count"] == 1
    with gp.stream(s):
        g.replay()
        assert total(out2) == 6 * N
    del out, out2, g
    settle()
    assert all(p.id != handle for p in runtime.allocator().private_pools())
    del a
    settle()


def test_graph_collected_mid_capture_leaks_nothing(backend: Any) -> None:
    xp = backend.xp
    settle()
    before = gp.memory_reserved()
    s = gp.Stream()
    with gp.stream(s):
        a = xp.ones(N, dtype=xp.float32)
        g = gp.CUDAGraph()
        g.capture_begin()
        b = a + 1
        del g  # abandoned mid-capture: its finalizer queues the release
        gc.collect()
    gp.empty_cache()  # drains the queue: the capture is ended and discarded
    assert not gp.is_current_stream_capturing()
    with gp.stream(s):
        assert not gp.is_current_stream_capturing()
    del a, b
    settle()
    assert gp.memory_reserved() == before
    gp.check_invariants()


def test_eager_thread_during_capture_gets_ordinary_memory(backend: Any) -> None:
    xp = backend.xp
    settle()
    s = gp.Stream()
    seen: list[tuple[bool, int]] = []

    def eager() -> None:
        other = gp.Stream()
        for _ in range(5):
            buf = gp.alloc(4096, other)
            block = runtime.allocator().lookup(buf.ptr)
            assert block is not None
            seen.append((block.free_list.private_pool is None, buf.ptr))
            buf.free()

    with gp.stream(s):
        a = xp.ones(N, dtype=xp.float32)
        g = gp.CUDAGraph()
        g.capture_begin(capture_error_mode="relaxed")
        b = a + 2
        t = threading.Thread(target=eager)
        t.start()
        t.join()
        g.capture_end()
        g.replay()
        assert total(b) == 3 * N
    assert all(ordinary for ordinary, _ in seen)
    # freed while the capture was underway: kept for its graph (a captured kernel may use it,
    # whoever made it), so none is handed out again until the graph goes
    assert len({p for _, p in seen}) == 5
    del a, b, g
    settle()

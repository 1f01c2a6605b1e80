"""One allocator per device (docs/behaviour.rst, "The caching allocator"): statistics, caches
and captures stay per device.

Runs on the simulator (two devices) and on GPU machines with two or more GPUs."""

from __future__ import annotations

import gc
from typing import Any

import pytest

import graphpool as gp
from graphpool import runtime

N = 1 << 16


def _need_two() -> None:
    if gp.device_count() < 2:
        pytest.skip("host has too few GPUs: needs two devices")


def test_allocations_and_stats_are_per_device(backend: Any) -> None:
    _need_two()
    xp = backend.xp
    gc.collect()
    gp.empty_cache(0)
    with gp.device(1):
        gp.empty_cache()
        assert gp.current_device() == 1
        base1 = gp.memory_allocated()
        base0 = gp.memory_allocated(0)
        a = xp.ones(N, dtype=xp.float32)
        buf = gp.alloc(1000)
        assert buf.device == 1 and buf.stream.device == 1
        assert gp.memory_allocated() == base1 + N * 4 + 1024
        assert gp.memory_allocated(0) == base0
        assert gp.current_stream().device == 1
    assert gp.current_device() == 0
    assert gp.memory_allocated(1) == base1 + N * 4 + 1024
    assert runtime.allocator(1).lookup(buf.ptr) is not None
    assert runtime.allocator(0).lookup(buf.ptr) is None
    del a
    buf.free()
    gc.collect()
    gp.synchronize(1)
    gp.empty_cache(1)
    assert gp.memory_allocated(1) == base1
    gp.check_invariants(1)


def test_capture_on_second_device(backend: Any) -> None:
    _need_two()
    xp = backend.xp
    with gp.device(1):
        s = gp.Stream()
        assert s.device == 1
        with gp.stream(s):
            a = xp.ones(N, dtype=xp.float32)
        g = gp.CUDAGraph()
        with gp.graph(g, stream=s):
            b = a * 5
        assert gp.memory_stats(pool=g.pool())["allocation.all.current"] == 1
        with pytest.raises(ValueError):
            gp.memory_stats(0, pool=g.pool())
        with gp.stream(s):
            g.replay()
            assert float(b.sum().item()) == 5 * N
        del a, b, g
        gc.collect()
        gp.synchronize()
        gp.empty_cache()
        gp.check_invariants()


def test_bad_device_index(backend: Any) -> None:
    with pytest.raises(ValueError, match="invalid device"):
        gp.alloc(16, gp.Stream(gp.device_count()))
    with pytest.raises(ValueError, match="invalid device"):
        gp.memory_stats(-1)


def test_alloc_follows_every_change_of_current_stream_and_device(backend: Any) -> None:
    """gp.alloc caches the thread's current stream and allocator; every switch must reset it."""
    import threading

    s, t = gp.Stream(), gp.Stream()
    seen: list[tuple[int, int]] = []

    def where() -> tuple[int, int]:
        with gp.alloc(512) as b:
            return (b.device, b.stream.handle)

    seen.append(where())  # fills the cache with the default stream
    with gp.stream(s):
        seen.append(where())
        with gp.stream(t):
            seen.append(where())
        seen.append(where())
    seen.append(where())
    assert seen == [(0, 0), (0, s.handle), (0, t.handle), (0, s.handle), (0, 0)]

    other: list[tuple[int, int]] = []
    with gp.stream(s):  # another thread keeps its own current stream
        th = threading.Thread(target=lambda: other.append(where()))
        th.start()
        th.join()
        assert where() == (0, s.handle)
    assert other == [(0, 0)]

    if gp.device_count() >= 2:
        with gp.device(1):
            d1 = gp.Stream()
            assert where() == (1, 0)
            with gp.stream(d1):
                assert where() == (1, d1.handle)
            assert where() == (1, 0)
        assert where() == (0, 0)
        with gp.stream(d1):  # a stream of device 1 makes device 1 current inside the block
            assert where() == (1, d1.handle)
        assert where() == (0, 0)
        gp.synchronize(1)
        gp.empty_cache(1)


def test_set_backend_keeps_the_device_and_drops_the_cached_stream(sim: Any) -> None:
    from graphpool.sim import SimBackend

    runtime.set_backend("sim", backend=SimBackend(device_count=2))
    with gp.device(1):
        s = gp.Stream()
        with gp.stream(s):
            old = gp.alloc(512)  # caches (s, allocator of the first backend)
            runtime.set_backend("sim", backend=SimBackend(device_count=2))
            assert gp.current_device() == 1  # kept, as CUDA keeps a thread's device
            assert gp.current_stream() == gp.default_stream()  # streams start over
            new = gp.alloc(512)
            assert new.device == 1 and new.stream.handle == 0
            assert runtime.allocator(1).lookup(new.ptr) is not None
            assert runtime.allocator(1) is not old._alloc
        new.free()
    old.free()

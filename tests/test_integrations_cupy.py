"""graphpool.cupy: graphpool as CuPy's allocator, CuPy's stream following graphpool's (GPU only)."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

import graphpool as gp
from gpu_guard import cuda_unusable
from graphpool import routing, runtime

pytestmark = pytest.mark.gpu


@pytest.fixture
def cp() -> Any:
    reason = cuda_unusable()
    if reason is not None:
        pytest.skip(reason)
    cupy = pytest.importorskip("cupy")
    import graphpool.cupy as gcupy

    if runtime.get().name != "cuda":
        gp.set_backend("cuda")
    gc.collect()
    gp.synchronize()
    gp.empty_cache()
    gcupy.install()
    try:
        yield cupy
    finally:
        gc.collect()
        gp.synchronize()
        gp.empty_cache()
        gp.check_invariants()
        gcupy.uninstall()


def _segment_of(ptr: int) -> dict[str, Any]:
    for seg in gp.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    raise AssertionError(f"0x{ptr:x} is not in any graphpool segment")


def test_arrays_allocate_through_graphpool(cp: Any) -> None:
    gc.collect()
    base = gp.memory_allocated()
    a = cp.ones(1 << 20, dtype=cp.float32)
    assert gp.memory_allocated() == base + 4 * (1 << 20)
    assert isinstance(a.data.mem, cp.cuda.UnownedMemory)
    assert _segment_of(a.data.ptr)["segment_pool_id"] is None  # an ordinary pool
    assert float(a.sum()) == float(1 << 20)
    del a
    gc.collect()
    assert gp.memory_allocated() == base


def test_gp_stream_sets_cupy_stream(cp: Any) -> None:
    s = gp.Stream()
    assert cp.cuda.get_current_stream().ptr == 0
    with gp.stream(s):
        assert cp.cuda.get_current_stream().ptr == s.handle
        x = cp.arange(1000, dtype=cp.float32)
        y = x * 2
        assert _segment_of(y.data.ptr)["stream"] == s.handle  # allocated for s
        total = float(y.sum())
    assert cp.cuda.get_current_stream().ptr == 0
    assert total == 2 * sum(range(1000))
    s.synchronize()
    del x, y
    gc.collect()


def test_graph_with_cupy_kernels_replays(cp: Any) -> None:
    n = 100_000
    a = cp.ones(n, dtype=cp.float32)
    warm = a * 2 + 1  # load the kernels before capturing
    del warm
    gp.synchronize()
    g = gp.CUDAGraph()
    with gp.graph(g):
        cs = cp.cuda.get_current_stream()
        assert cs.ptr == gp.current_stream().handle != 0
        assert cs.is_capturing()
        t = a * 2  # freed during the capture
        b = t + 1
        del t
    assert cp.cuda.get_current_stream().ptr == 0
    assert _segment_of(b.data.ptr)["segment_pool_id"] == tuple(g.pool())
    g.replay()
    np.testing.assert_array_equal(cp.asnumpy(b), np.full(n, 3, np.float32))
    a.fill(5)
    g.replay()
    np.testing.assert_array_equal(cp.asnumpy(b), np.full(n, 11, np.float32))
    # eager allocations right after do not take the graph's memory (CuPy issue #9655)
    y = cp.full(n, 7, dtype=cp.float32)
    g.replay()
    np.testing.assert_array_equal(cp.asnumpy(y), np.full(n, 7, np.float32))
    del b, y
    g.reset()
    gc.collect()


def test_capture_begin_with_cupy(cp: Any) -> None:
    a = cp.arange(256, dtype=cp.float32)
    (a + 1).sum()
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.stream(s):
        s.wait_stream(gp.default_stream())
        g.capture_begin()
        b = a + 1
        g.capture_end()
    gp.current_stream().wait_stream(s)
    g.replay()
    np.testing.assert_array_equal(cp.asnumpy(b), np.arange(256, dtype=np.float32) + 1)
    del b
    g.reset()


def test_cupy_stream_block_survives_a_graph_block(cp: Any) -> None:
    """``with cupy.cuda.Stream(): with gp.graph(g): ...`` leaves CuPy on the user's stream.

    Finding (issue 10, by reading ``streams.stream`` and ``cupy._follow``): graphpool does
    not follow CuPy's own ``with stream:`` blocks, so inside one graphpool's current stream
    is still the legacy default. ``gp.graph`` (through ``gp.stream``) makes CuPy follow the
    capturing stream on entry, and on exit restored graphpool's previous stream, the legacy
    default, which ``_follow`` maps to ``cupy.cuda.Stream.null``: for the rest of the user's
    block CuPy queued its work on the legacy stream instead of the user's (with a
    non-blocking user stream, unordered with the work queued before). ``gp.stream`` now
    saves CuPy's current stream on entry and gives it back on exit (streams.py); the
    simulator checks the same with a stand-in CuPy (test_misuse.py).
    """
    n = 4096
    a = cp.arange(n, dtype=cp.float32)
    (a + 1).sum()  # load the kernels before capturing
    gp.synchronize()
    for non_blocking in (False, True):
        with cp.cuda.Stream(non_blocking=non_blocking) as users:
            assert cp.cuda.get_current_stream().ptr == users.ptr
            g = gp.CUDAGraph()
            with gp.graph(g):
                assert cp.cuda.get_current_stream().ptr == gp.current_stream().handle != 0
                b = a + 1
            assert cp.cuda.get_current_stream().ptr == users.ptr != 0  # was Stream.null
            c = a * 2  # queued on the user's stream
            assert cp.cuda.get_current_stream().ptr == users.ptr
        assert cp.cuda.get_current_stream().ptr == 0  # CuPy's own block restored the null stream
        users.synchronize()
        g.replay()
        np.testing.assert_array_equal(cp.asnumpy(b), np.arange(n, dtype=np.float32) + 1)
        np.testing.assert_array_equal(cp.asnumpy(c), np.arange(n, dtype=np.float32) * 2)
        del b, c
        g.reset()
        gc.collect()


def test_uninstall_restores_and_is_idempotent(cp: Any) -> None:
    import graphpool.cupy as gcupy

    gcupy.install()  # already installed by the fixture: no-op
    assert gcupy.is_installed()
    assert cp.cuda.get_allocator() is gcupy.malloc
    assert routing.followers().count(gcupy._FOLLOWER) == 1
    gcupy.uninstall()
    gcupy.uninstall()
    assert not gcupy.is_installed()
    prev = cp.cuda.get_allocator()
    assert prev is not gcupy.malloc
    assert gcupy._FOLLOWER not in routing.followers()
    gc.collect()
    base = gp.memory_allocated()
    a = cp.ones(1 << 16, dtype=cp.float32)  # CuPy's own pool now
    assert gp.memory_allocated() == base
    s = gp.Stream()
    with gp.stream(s):
        assert cp.cuda.get_current_stream().ptr == 0  # no longer followed
    del a
    with gcupy.installed():
        assert cp.cuda.get_allocator() is gcupy.malloc
        b = cp.ones(1 << 16, dtype=cp.float32)
        assert gp.memory_allocated() == base + 4 * (1 << 16)
    assert cp.cuda.get_allocator() is prev
    del b
    gc.collect()
    assert gp.memory_allocated() == base
    gcupy.install()  # the fixture's teardown uninstalls


def test_refused_on_the_simulator(cp: Any) -> None:
    import graphpool.cupy as gcupy

    gcupy.uninstall()
    gc.collect()
    gp.synchronize()
    gp.empty_cache()
    gp.set_backend("sim")
    try:
        with pytest.raises(RuntimeError, match="cuda"):
            gcupy.install()
        assert not gcupy.is_installed()
    finally:
        gp.set_backend("cuda")
        gcupy.install()

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


@pytest.fixture(params=["hooks", "c"])
def cp(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """CuPy with graphpool installed: the default C path (``use_c_allocator``: CuPy's
    ``CFunctionAllocator`` over the shim), which an install without the compiled shim replaces
    by the hooks path, and the hooks path (``PythonFunctionAllocator`` over the compiled hooks)."""
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
    monkeypatch.setattr(gcupy, "use_c_allocator", request.param == "c")
    gcupy.install()
    has_c = hasattr(cupy.cuda.memory, "CFunctionAllocator")
    if request.param == "c" and gp.compiled() and has_c:  # (the compiled install has the shim)
        assert gcupy._hooks is not None and gcupy._hooks is gcupy._c_hooks
    elif request.param == "hooks":
        assert gcupy._hooks is None or gcupy._hooks is not gcupy._c_hooks
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
    import graphpool.cupy as gcupy

    if gcupy._hooks is not None and gcupy._hooks is gcupy._c_hooks:  # the shim's C functions
        assert type(a.data.mem).__name__ == "CFunctionAllocatorMemory"
    elif gcupy._hooks is not None:  # CuPy's PythonFunctionAllocator over graphpool's hooks
        assert type(a.data.mem).__name__ == "PythonFunctionAllocatorMemory"
    else:
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
    assert cp.cuda.get_allocator() is gcupy._allocator is not None
    assert routing.followers().count(gcupy._FOLLOWER) == 1
    gcupy.uninstall()
    gcupy.uninstall()
    assert not gcupy.is_installed()
    prev = cp.cuda.get_allocator()
    assert prev is not gcupy.malloc and gcupy._allocator is None
    assert gcupy._FOLLOWER not in routing.followers()
    gc.collect()
    base = gp.memory_allocated()
    a = cp.ones(1 << 16, dtype=cp.float32)  # CuPy's own pool now
    assert gp.memory_allocated() == base
    s = gp.Stream()
    with gp.stream(s):
        assert cp.cuda.get_current_stream().ptr == 0  # no longer followed
    del a
    assert gcupy.installed is gcupy.using is gcupy.using_allocator  # the older names
    with gcupy.using_allocator():
        assert cp.cuda.get_allocator() is gcupy._allocator
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


def test_per_thread_default_stream_is_refused(cp: Any) -> None:
    """CuPy's ``Stream.ptds`` (handle 2) names a different stream on each thread: refused, as by
    every entry point, rather than filing every thread's blocks under one handle."""
    import graphpool.cupy as gcupy

    if not hasattr(cp.cuda.Stream, "ptds"):
        pytest.skip("this CuPy has no Stream.ptds")
    gc.collect()
    base = gp.memory_allocated()
    with cp.cuda.Stream.ptds:
        assert cp.cuda.get_current_stream().ptr == 2
        with pytest.raises(ValueError, match="per-thread default stream"):
            gcupy.malloc(4096)
        with pytest.raises(ValueError, match="per-thread default stream"):
            gcupy._allocator(4096)
        with pytest.raises(ValueError, match="per-thread default stream"):
            cp.ones(1 << 10, dtype=cp.float32)
    assert gp.memory_allocated() == base
    a = cp.ones(16, dtype=cp.float32)  # the null stream again: served
    assert float(a.sum()) == 16.0
    del a


def test_an_array_made_on_another_stream_during_a_hooked_capture_is_kept(cp: Any) -> None:
    """Issue 24 through CuPy's own capture API (registered by graphpool's hook): an array made
    on another stream while the capture is underway, written by the captured kernels and
    dropped before the capture ends, is kept for the graph; the eager array made on that
    stream after the capture gets other memory, which a launch leaves intact."""
    n = 1 << 16
    x = cp.ones(n, dtype=np.float32)
    (x * 3.0).sum()  # the kernels loaded before the capture
    other = cp.cuda.Stream(non_blocking=True)
    s = cp.cuda.Stream(non_blocking=True)
    gp.synchronize()
    with s:
        s.begin_capture()
        with other:
            w = cp.zeros(n, dtype=np.float32)  # ordinary memory, on a stream outside the capture
        other.synchronize()
        w_ptr = int(w.data.ptr)
        w.fill(5.0)  # captured on s: the graph writes w
        out = w + 1.0
        del w
        g = s.end_capture()
    with other:
        y = cp.full(n, 7.0, dtype=np.float32)
        other.synchronize()
    assert int(y.data.ptr) != w_ptr
    g.launch(s)
    s.synchronize()
    assert float(y.sum().item()) == 7.0 * n
    assert float(out.sum().item()) == 6.0 * n
    del g, y, out, x
    gc.collect()


def test_a_graph_released_while_a_blocking_stream_captures_unseen_records_nothing_on_the_legacy_stream(
    cp: Any,
) -> None:
    """A graph replayed on the legacy stream keeps a block (freed during its capture on another
    stream); it is released while a blocking CuPy stream captures in a capture graphpool has
    not seen. CUDA refuses the legacy stream then (cudaErrorStreamCaptureImplicit): recording
    the release's event there failed, and the device synchronize that stood in for it broke
    the capture. The release asks the legacy stream's status first and records the event
    after the capture ends."""
    from graphpool.device.protocol import CAPTURE_MODE_RELAXED

    dev = runtime.get().device(0)
    n = 1 << 20
    s = gp.Stream()
    x = gp.alloc(n, stream=s)
    s.synchronize()
    g = gp.CUDAGraph()
    with gp.graph(g):
        out = gp.alloc(n)
        dev.memcpy(out.ptr, x.ptr, n, gp.current_stream().handle)
        x.free()  # kept for g
    g.replay()  # on the legacy stream
    gp.synchronize()
    blocking = cp.cuda.Stream()  # CuPy's default: a blocking stream
    dev.begin_capture(blocking.ptr, CAPTURE_MODE_RELAXED)
    g.reset()  # the kept block's event is due on the legacy stream
    graph = dev.end_capture(blocking.ptr)  # not invalidated
    dev.destroy_graph(graph)
    for _ in range(3):
        gp.alloc(4096).free()  # the event is recorded now
    gp.synchronize()
    gp.empty_cache()
    gp.check_invariants()
    assert gp.memory_stats()["active_bytes.all.current"] == gp.memory_stats()["allocated_bytes.all.current"]
    del out, g

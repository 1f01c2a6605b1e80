"""graphpool.cupy on the simulator, through the CuPy twin (tests/twins.py).

The same checks as tests/test_integrations_cupy.py (GPU only), run in CI: the integration
module itself (install, malloc, stream following, uninstall) on the simulated devices.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import graphpool as gp
import graphpool.cupy as gcupy
import twins
from graphpool import routing, runtime
from graphpool.device.protocol import CAPTURE_MODE_RELAXED
from graphpool.errors import DoubleFreeError
from graphpool.tools import scenarios

_C_ALLOCATOR_DEFAULT = gcupy.use_c_allocator
"""The module's own value, read at collection, before any fixture sets it."""


def _settle() -> None:
    gc.collect()
    gp.synchronize()
    gp.empty_cache()


@pytest.fixture(params=["c", "native", "function"])
def cp(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The CuPy twin with graphpool installed: through CuPy's ``CFunctionAllocator`` and the
    compiled shim's C entry points ("c", where the shim is built), through CuPy's
    ``PythonFunctionAllocator`` and the compiled hooks ("native", CuPy 9 and later), or
    through ``graphpool.cupy.malloc`` ("function": a CuPy without either class)."""
    if request.param == "c":
        twins.torch_shim_or_skip()  # (the compiled install has it; the plain one skips)
    fake = twins.make_cupy(
        python_function_allocator=request.param != "function", c_function_allocator=request.param == "c"
    )
    monkeypatch.setitem(__import__("sys").modules, "cupy", fake)
    for name, value in (("_cp", None), ("_installed", False), ("_previous", None), ("_allocator", None)):
        monkeypatch.setattr(gcupy, name, value)
    monkeypatch.setattr(gcupy, "_hooks", None)
    monkeypatch.setattr(gcupy, "_c_hooks", None)  # (the shim's hooks: made again for this twin)
    monkeypatch.setattr(gcupy, "use_c_allocator", request.param == "c")  # (on by default)
    monkeypatch.setattr(gcupy, "_gp_streams", {})
    monkeypatch.setattr(gcupy, "_cp_streams", {})
    twins.use_sim_as_cuda()
    _settle()
    gcupy.install()
    if request.param == "c":  # (a shim refusing the twin's stream capsule would fall back unseen)
        assert gcupy._hooks is not None and gcupy._hooks is gcupy._c_hooks
    try:
        yield fake
    finally:
        gcupy.uninstall()
        _settle()
        gp.check_invariants()
        gp.set_backend("sim")


def native(cp: Any) -> bool:
    """Whether graphpool serves this CuPy through the compiled hooks (``CFunctionAllocator``
    or ``PythonFunctionAllocator``)."""
    return gcupy._hooks is not None


def c_path(cp: Any) -> bool:
    """Whether graphpool serves this CuPy through its ``CFunctionAllocator`` (the shim)."""
    return gcupy._hooks is not None and gcupy._hooks is gcupy._c_hooks and hasattr(cp.cuda, "stream")


def _segment_of(ptr: int) -> dict[str, Any]:
    for seg in gp.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    raise AssertionError(f"0x{ptr:x} is not in any graphpool segment")


def test_install_needs_the_cuda_backend(cp: Any) -> None:
    gcupy.uninstall()
    gp.set_backend("sim")
    with pytest.raises(RuntimeError, match="needs the 'cuda' backend"):
        gcupy.install()
    assert gcupy.is_installed() is False
    twins.use_sim_as_cuda()
    gcupy.install()


def test_arrays_allocate_through_graphpool(cp: Any) -> None:
    base = gp.memory_allocated()
    a = cp.ones(1 << 20, dtype=cp.float32)
    assert gp.memory_allocated() == base + 4 * (1 << 20)
    if native(cp):  # CuPy's memory object frees the address through the hooks
        kind = "CFunctionAllocatorMemory" if c_path(cp) else "PythonFunctionAllocatorMemory"
        assert type(a.data.mem).__name__ == kind
        assert cp.cuda.get_allocator() is gcupy._allocator is not gcupy.malloc
    else:
        assert isinstance(a.data.mem, cp.cuda.UnownedMemory)
        assert isinstance(a.data.mem._owner, gp.DeviceBuffer)  # the owner keeps the block
    assert _segment_of(a.data.ptr)["segment_pool_id"] is None
    assert float(a.sum()) == float(1 << 20)
    assert cp.cuda.default_pool.n_device_malloc == 0  # CuPy's own pool untouched
    del a
    gc.collect()
    assert gp.memory_allocated() == base


def test_cupy_follows_graphpool_streams(cp: Any) -> None:
    s = gp.Stream()
    assert cp.cuda.get_current_stream().ptr == 0
    with gp.stream(s):
        assert cp.cuda.get_current_stream().ptr == s.handle
        x = cp.arange(1000, dtype=cp.float32)
        y = x * 2
        assert _segment_of(y.data.ptr)["stream"] == s.handle  # allocated for s
        dev = runtime.get().device(0)
        assert dev.pending_ops(s.handle) == 2  # the kernels went to s, not the default stream
        total = float(y.sum())
    assert cp.cuda.get_current_stream().ptr == 0
    assert total == 2 * sum(range(1000))
    del x, y


def test_stream_followed_on_another_cupy_device(cp: Any) -> None:
    """gp.stream on device 1 while CuPy's current device is 0: CuPy's stream of device 1 follows."""
    with gp.device(1):
        s = gp.Stream()
    with gp.stream(s):
        assert cp.cuda.get_current_stream(1).ptr == s.handle
        assert cp.cuda.get_current_stream(0).ptr == 0
        assert cp.cuda.runtime.getDevice() == 0  # CuPy's current device put back


def test_install_inside_a_stream_context_follows_at_once(cp: Any) -> None:
    gcupy.uninstall()
    s = gp.Stream()
    with gp.stream(s):
        gcupy.install()
        assert cp.cuda.get_current_stream().ptr == s.handle


def test_graph_with_cupy_kernels_replays(cp: Any) -> None:
    n = 100_000
    a = cp.ones(n, dtype=cp.float32)
    gp.synchronize()
    g = gp.CUDAGraph()
    with gp.graph(g):
        cs = cp.cuda.get_current_stream()
        assert cs.ptr == gp.current_stream().handle != 0
        assert cs.is_capturing() is True
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


def test_the_hazard_closed_with_graphpool_open_with_cupys_pool(cp: Any) -> None:
    n = 1 << 16
    wrong, y_total, out_total = scenarios.hazard(cp, n)
    assert (wrong, y_total, out_total) == (0, 7.0 * n, 3.0 * n)
    # The twin's own pool reproduces the hazard graphpool closes: a block freed during the
    # capture goes to the next eager array, which the replay then overwrites. (Streams are
    # still followed; only the allocator is CuPy's own.)
    cp.cuda.set_allocator(None)
    warm = [cp.empty(n, dtype=cp.float32) for _ in range(3)]  # cached: no cudaMalloc in capture
    del warm
    wrong, y_total, _ = scenarios.hazard(cp, n)
    assert (wrong, y_total) == (n, 2.0 * n)  # y took t's block: the replay wrote a * 2 there
    cp.cuda.set_allocator(gcupy._allocator)


def test_uninstall_restores_and_is_idempotent(cp: Any) -> None:
    gcupy.install()  # already installed by the fixture: no-op
    assert gcupy.is_installed() is True
    assert cp.cuda.get_allocator() is gcupy._allocator
    assert routing.followers().count(gcupy._FOLLOWER) == 1
    gcupy.uninstall()
    gcupy.uninstall()
    assert gcupy.is_installed() is False
    prev = cp.cuda.get_allocator()
    assert prev == cp.cuda.default_pool.malloc
    assert gcupy._FOLLOWER not in routing.followers()
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
    assert cp.cuda.get_allocator() == prev
    del b
    gc.collect()
    assert gp.memory_allocated() == base
    gcupy.install()  # the fixture's teardown uninstalls


def test_uninstall_keeps_an_allocator_set_since(cp: Any) -> None:
    """If the user set another allocator after install(), uninstall() leaves it."""

    def mine(n: int) -> Any:
        return cp.cuda.default_pool.malloc(n)

    cp.cuda.set_allocator(mine)
    gcupy.uninstall()
    assert cp.cuda.get_allocator() is mine


def test_cupy_stream_cache_and_null(cp: Any) -> None:
    s = gp.Stream()
    assert gcupy.cupy_stream(s) is gcupy.cupy_stream(s)
    assert gcupy.cupy_stream(s).ptr == s.handle
    assert gcupy.cupy_stream(gp.default_stream()) is cp.cuda.Stream.null


def test_cupys_own_begin_capture_is_registered_and_closes_the_hazard(cp: Any) -> None:
    """The issue's program through CuPy's own capture API: the hook registers the capture at
    begin_capture, so even a free that comes before any allocation in it is covered."""
    assert gcupy.hooked()
    n = 1 << 16
    x = cp.ones(n, dtype=np.float32)
    w = cp.zeros(n, dtype=np.float32)
    w_ptr = int(w.data.ptr)
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        w.fill(5.0)  # the graph writes w, then drops it: the capture's first allocator event
        del w
        t = x * 3.0
        out = t + 1.0
        del t
        g = s.end_capture()
        y = cp.full(n, 7.0, dtype=np.float32)
        assert int(y.data.ptr) != w_ptr
        s.synchronize()
        g.launch(s)
        s.synchronize()
    assert float(y.sum().item()) == 7.0 * n
    assert float(out.sum().item()) == 4.0 * n
    a = runtime.allocator()
    assert a._capturing == 0  # end_capture stopped the routing
    pools = [p for p in a.private_pools() if p.use_count]
    assert len(pools) == 1
    del g  # CuPy's Graph destroys its graph and executable: the pool is released
    gp.memory_stats()
    assert pools[0].use_count == 0
    del y, out, x
    _settle()


def test_cupy_stream_wrappers_are_forgotten_with_their_buffers(
    cp: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """graphpool's wrappers of CuPy's streams live only as long as a buffer of that stream
    (``malloc``); the native path makes none at all."""
    import weakref

    monkeypatch.setattr(gcupy, "_gp_streams", weakref.WeakValueDictionary())
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        arr = cp.ones(16, dtype=np.float32)
    assert _segment_of(arr.data.ptr)["stream"] == s.ptr
    if native(cp):
        assert len(gcupy._gp_streams) == 0
        return
    assert len(gcupy._gp_streams) == 1
    del arr
    # graphpool.cupy keeps the CuPy stream it served last (gcupy._last), gp.alloc the stream it
    # was given last (routing.routes.seen): an allocation on another stream frees each of them
    other = cp.ones(16, dtype=np.float32)  # on CuPy's null stream
    gp.alloc(16, gp.Stream()).free()
    gc.collect()
    gp.memory_stats()
    assert [key[1] for key in gcupy._gp_streams] == [0]  # the null stream's wrapper alone
    del other


def test_zero_bytes_are_a_null_pointer(cp: Any) -> None:
    base = gp.memory_allocated()
    for m in (gcupy.malloc(0), gcupy._allocator(0)):
        assert m.ptr == 0
    if native(cp):  # the hooks themselves, on their kept route too (CuPy never asks for 0)
        kept = cp.ones(4, dtype=np.float32)
        assert [gcupy._hooks.malloc(0, 0) for _ in range(3)] == [0, 0, 0]
        del kept
    assert gp.memory_allocated() == base


def test_a_replaced_backend_is_checked_again_and_its_wrappers_remade(cp: Any) -> None:
    """malloc keeps the CuPy stream it served last; set_backend makes it stale, so the next
    allocation checks the backend again and wraps the stream in the new runtime."""
    a = cp.ones(4, dtype=np.float32)  # served: the null stream is kept (gcupy._last)
    kept = gcupy._hooks._last if native(cp) else gcupy._last
    assert kept is not None
    del a
    gp.set_backend("sim")
    if native(cp):
        assert gcupy._hooks._last.route.generation != routing.routes.generation  # stale
    else:
        assert gcupy._last is not None and gcupy._last[3] != routing.routes.generation  # stale
    with pytest.raises(RuntimeError, match="needs the 'cuda' backend"):
        gcupy._allocator(16)
    twins.use_sim_as_cuda()  # a new "cuda" runtime: CuPy allocates from it at once
    b = cp.ones(4, dtype=np.float32)
    if not native(cp):
        assert gcupy._last is not None and gcupy._last[2]._space is runtime.space()
    assert gp.memory_allocated() > 0
    del b


def test_an_array_kept_across_set_backend_goes_back_to_its_allocator(cp: Any) -> None:
    """An array made before ``set_backend`` is freed to the allocator that made it, not to the
    new runtime's (the native path finds it among the replaced allocators)."""
    old = runtime.allocator(0)
    a = cp.ones(1 << 12, dtype=np.float32)
    twins.use_sim_as_cuda()
    b = cp.ones(1 << 12, dtype=np.float32)
    assert old.memory_stats()["allocated_bytes.all.current"] == 4 << 12
    assert gp.memory_allocated() == 4 << 12
    del a
    gc.collect()
    old.memory_stats()
    assert old.memory_stats()["allocated_bytes.all.current"] == 0
    old.check_invariants()
    assert gp.memory_allocated() == 4 << 12
    del b
    gc.collect()
    assert gp.memory_allocated() == 0
    old.empty_cache()


def test_a_set_backend_during_the_first_call_on_a_stream_is_not_cached_over(
    cp: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A set_backend that lands between malloc's backend check and its caching of the stream:
    the stream kept then must not let later calls skip the check."""
    checked = gcupy._require_cuda

    def check_then_replace() -> None:
        checked()
        gp.set_backend("sim")  # another thread, just after this thread's check

    monkeypatch.setattr(gcupy, "_last", None)
    if native(cp):
        monkeypatch.setattr(gcupy._hooks, "_last", None)
    monkeypatch.setattr(gcupy, "_require_cuda", check_then_replace)
    raced = gcupy._allocator(16)  # on CuPy's null stream: served (by the new runtime), stream kept
    assert (gcupy._hooks._last if native(cp) else gcupy._last) is not None
    monkeypatch.setattr(gcupy, "_require_cuda", checked)
    with pytest.raises(RuntimeError, match="needs the 'cuda' backend"):
        gcupy._allocator(16)  # the kept stream's generation is stale: checked again
    del raced
    gc.collect()


def test_per_thread_default_stream_is_refused(cp: Any) -> None:
    """CuPy's per-thread default stream (handle 2: ``Stream.ptds``, or the default stream under
    CUPY_CUDA_PER_THREAD_DEFAULT_STREAM=1) names a different stream on each thread: refused
    with gp.alloc's error, never filed under one shared handle."""
    base = gp.memory_allocated()
    with cp.cuda.Stream.ptds:
        refused = r"graphpool\.cupy(\.malloc)?: CuPy's current stream is CUDA's per-thread"
        with pytest.raises(ValueError, match=refused):
            gcupy._allocator(4096)
        with pytest.raises(ValueError, match=refused):
            gcupy.malloc(4096)
        with pytest.raises(ValueError, match="per-thread default stream"):
            cp.ones(16, dtype=np.float32)  # the same through CuPy's own array creation
        with pytest.raises(ValueError, match="per-thread default stream"):
            gcupy._allocator(4096)  # refused every time: the refusal is never cached as a stream
    assert gp.memory_allocated() == base
    assert all(key[1] != 2 for key in gcupy._gp_streams)
    if native(cp):
        assert gcupy._hooks._last is None or gcupy._hooks._last.raw != 2
    a = cp.ones(16, dtype=np.float32)  # the null stream again: served
    assert _segment_of(a.data.ptr)["stream"] == 0
    del a


def test_cuda_legacy_handle_is_the_legacy_stream(cp: Any) -> None:
    with cp.cuda.ExternalStream(1):  # cudaStreamLegacy
        m = gcupy._allocator(4096)
        f = gcupy.malloc(4096)
    assert _segment_of(m.ptr)["stream"] == 0  # filed with the null stream's blocks
    assert f.mem._owner.stream.handle == 0
    del m, f


def test_a_bad_free_is_reported_never_raised(cp: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native free runs in CuPy's deallocator: a wrong address is refused there with
    graphpool's error, which CuPy reports as unraisable; nothing else changes."""
    if not native(cp):
        pytest.skip("the function path frees through a DeviceBuffer")
    with pytest.raises(ValueError, match="not allocated by graphpool"):
        gcupy._hooks.free(0x3039, 5)  # a device graphpool never served
    m = gcupy._allocator(512)
    ptr = m.ptr
    del m
    gc.collect()  # its free is queued (CachingAllocator.drop) ...
    gp.memory_stats()  # ... and carried out at this call
    with pytest.raises(DoubleFreeError, match="freed already"):
        gcupy._hooks.free(ptr, 0)
    m = gcupy._allocator(512)
    ptr = m.ptr
    del m
    gc.collect()  # the block handed out last: parked (heap.py, Note [Parking]), so ...
    with pytest.raises(DoubleFreeError, match="parked"):
        gcupy._hooks.free(ptr, 0)  # ... a second free is found at once
    gp.check_invariants()
    first, last = gcupy._allocator(512), gcupy._allocator(512)
    ptr = first.ptr
    del first
    gc.collect()  # not the block handed out last: queued ...
    gcupy._hooks.free(ptr, 0)  # ... and the second free is found when the queue is carried out
    with pytest.warns(RuntimeWarning, match="DoubleFreeError"):
        gp.memory_stats()
    del last
    gp.check_invariants()


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


def test_arrays_inside_use_mem_pool_come_from_the_pool(cp: Any) -> None:
    pool = gp.MemPool()
    with gp.use_mem_pool(pool):
        a = cp.ones(1 << 16, dtype=cp.float32)
    b = cp.ones(1 << 16, dtype=cp.float32)
    assert _segment_of(a.data.ptr)["segment_pool_id"] == tuple(pool.id)
    assert _segment_of(b.data.ptr)["segment_pool_id"] is None
    assert pool.memory_stats()["allocated_bytes.all.current"] == 4 << 16
    del a, b
    gc.collect()
    assert pool.memory_stats()["allocated_bytes.all.current"] == 0


def test_buffer_of_finds_the_buffer_behind_an_array_or_says_why_not(cp: Any) -> None:
    a = cp.ones(16)
    if native(cp):  # CuPy's PythonFunctionAllocator keeps no DeviceBuffer
        with pytest.raises(TypeError) as info:
            gcupy.buffer_of(a)
        assert str(info.value) == (
            f"{type(a).__name__} has no DeviceBuffer behind it: graphpool serves CuPy through "
            "CuPy's CFunctionAllocator or PythonFunctionAllocator, which keep none; set "
            "graphpool.cupy.use_function_allocator = True before install() to share CuPy arrays"
        )
    else:
        buf = gcupy.buffer_of(a)
        assert isinstance(buf, gp.DeviceBuffer) and buf.ptr == a.data.ptr
        assert gcupy.buffer_of(a.data) is buf
        with pytest.raises(TypeError, match=r"^int was not allocated by graphpool"):
            gcupy.buffer_of(3)
    del a


def test_the_calls_before_install_say_what_to_call_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """As in a process that never called install(): malloc and pinned_malloc say so."""
    monkeypatch.setattr(gcupy, "_calls", (gcupy._not_installed,) * 4)
    monkeypatch.setattr(gcupy, "_cp", None)
    with pytest.raises(RuntimeError) as info:
        gcupy.malloc(8)
    assert str(info.value) == (
        "graphpool.cupy.malloc serves CuPy only after graphpool.cupy.install() (which binds it "
        "to CuPy and makes it CuPy's allocator): call install() first"
    )
    with pytest.raises(RuntimeError) as info:
        gcupy.pinned_malloc(8)
    assert str(info.value) == (
        "graphpool.cupy.pinned_malloc serves CuPy only after graphpool.cupy.install_pinned()"
    )


def test_a_cupy_streams_wrapper_is_kept_and_keyed_by_the_streams_own_device(cp: Any) -> None:
    """``_wrapper`` keeps one graphpool Stream per (device, handle); ``_stream_key`` reads the
    stream's own device, the current one only when the stream says none (-1)."""
    s = gp.Stream()
    assert gcupy._wrapper(0, s.handle) is gcupy._wrapper(0, s.handle)

    class Cs:
        def __init__(self, device_id: int, ptr: int) -> None:
            self.device_id, self.ptr = device_id, ptr

    with cp.cuda.Device(1):
        assert gcupy._stream_key(Cs(0, 5)) == (0, 5)  # device 0's stream, while 1 is current
        assert gcupy._stream_key(Cs(-1, 5)) == (1, 5)


def test_the_c_path_hands_a_dropped_array_back_from_the_lane(cp: Any) -> None:
    """Through CuPy's ``CFunctionAllocator``: the array dropped last is parked, and the next
    array of its size on its stream gets that block from the shim's lane (no Python call),
    again and again; graphpool's counters take the lane's hand-outs in at its next call, and
    an array of another size or a capture on that stream is served by graphpool itself."""
    if not c_path(cp):
        pytest.skip("the lane serves CuPy's CFunctionAllocator path only")
    shim = twins.torch_shim_or_skip()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        base = gp.memory_stats()
        a = cp.empty(4096, dtype=np.uint8)
        ptr = a.data.ptr
        del a
        lane = shim.lane_state(0)
        assert (lane["state"], lane["kind"], lane["ptr"], lane["stream"]) == ("parked", "cupy", ptr, s.ptr)
        for _ in range(5):
            b = cp.empty(4096, dtype=np.uint8)
            assert b.data.ptr == ptr
            del b
        assert shim.lane_state(0)["hits"] == 5
        stats = gp.memory_stats()  # settles with the lane first
        assert shim.lane_state(0)["hits"] == 0
        assert stats["allocation.all.allocated"] == base["allocation.all.allocated"] + 6
        assert stats["allocated_bytes.all.current"] == base["allocated_bytes.all.current"]
        other = cp.empty(8192, dtype=np.uint8)  # another size: graphpool's malloc, which ...
        assert shim.lane_state(0)["state"] == "empty"  # ... took the parked block back first
        del other
        keep = cp.empty(4096, dtype=np.uint8)  # the parked block, from graphpool or the lane
        keep_ptr = keep.data.ptr
        del keep  # parked again, in the lane
        assert shim.lane_state(0)["state"] == "parked"
        dev = runtime.get().device(0)
        dev.begin_capture(s.ptr, CAPTURE_MODE_RELAXED)  # begun outside graphpool: unseen so far
        try:
            inside = cp.empty(4096, dtype=np.uint8)  # the lane asks the device, and declines
            assert inside.data.ptr != keep_ptr
            assert _segment_of(inside.data.ptr)["segment_pool_id"] is not None  # detected
        finally:
            dev.destroy_graph(dev.end_capture(s.ptr))
        del inside
    _settle()
    gp.check_invariants()


def test_the_c_path_reports_a_failed_allocation_and_loses_nothing(cp: Any) -> None:
    """A request graphpool refuses raises graphpool's error through CuPy's C call (the shim
    returns -1 with the exception set); nothing is lost and the next array is served."""
    if not native(cp):
        pytest.skip("the function path raises from Python (tests/test_integrations_cupy.py)")
    base = gp.memory_allocated()
    with pytest.raises(gp.OutOfMemoryError):
        cp.empty(1 << 50, dtype=np.uint8)
    gp.check_invariants()
    assert gp.memory_allocated() == base
    a = cp.ones(1024, dtype=np.float32)
    assert float(a.sum()) == 1024.0
    del a


def test_an_array_outliving_uninstall_goes_back_to_graphpool(cp: Any) -> None:
    """CuPy frees through the hooks that made the array, also after ``uninstall()`` (the
    shim keeps one set of hooks for the process) and after a later ``install()``."""
    base = gp.memory_allocated()
    a = cp.ones(1 << 16, dtype=np.float32)
    b = cp.ones(1 << 12, dtype=np.float32)
    gcupy.uninstall()
    del a
    gc.collect()
    gp.memory_stats()
    assert gp.memory_allocated() == base + 4 * (1 << 12)
    gcupy.install()
    c = cp.ones(1 << 10, dtype=np.float32)
    del b, c
    gc.collect()
    gp.memory_stats()
    assert gp.memory_allocated() == base
    gp.check_invariants()


def test_a_block_cupy_parked_is_not_handed_to_pytorch(cp: Any) -> None:
    """The lanes are shared by the shim's entry points, but a block parked by CuPy's free is
    handed out only to CuPy: PyTorch's malloc of that size and stream goes to its hooks (a
    block out is freed through the hooks of the framework holding it)."""
    if not c_path(cp):
        pytest.skip("the lane serves CuPy's CFunctionAllocator path only")
    import graphpool.torch as gtorch
    from graphpool.tools.benchkit import torch_entry_points

    shim = twins.torch_shim_or_skip()
    shim.set_hooks(*gtorch.hooks())
    lib = torch_entry_points()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        a = cp.empty(4096, dtype=np.uint8)
        ptr = a.data.ptr
        del a
        assert shim.lane_state(0)["state"] == "parked"
        asked: list[int] = []
        with twins.lane_query_from(shim, twins.counting_query(asked)):
            p = lib.graphpool_torch_malloc(4096, 0, s.ptr)  # PyTorch's request: its hooks serve it
            assert asked == []  # (the lane does not even ask whether s is capturing)
        assert shim.lane_state(0)["hits"] == 0
        assert p != ptr or shim.lane_state(0)["state"] == "empty"  # taken back by graphpool first
        lib.graphpool_torch_free(p, 4096, 0, s.ptr)
        lane = shim.lane_state(0)
        assert lane["state"] == "parked" and (lane["ptr"], lane["kind"]) == (p, "torch")  # PyTorch's now
    _settle()


def test_a_block_freed_on_another_stream_than_cupys_last_is_not_parked_for_that_stream(cp: Any) -> None:
    """The shim parks a block CuPy frees only when it is the one its hooks handed out last
    (the lane then serves that block's stream): a block from an earlier malloc on another
    stream is never handed to the stream of the last one."""
    if not c_path(cp):
        pytest.skip("the lane serves CuPy's CFunctionAllocator path only")
    shim = twins.torch_shim_or_skip()
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    with s1:
        a = cp.empty(4096, dtype=np.uint8)
    with s2:
        b = cp.empty(8192, dtype=np.uint8)  # CuPy's last hand-out, on s2
    a_ptr = a.data.ptr
    del a  # not the last hand-out: the lane does not take it
    lane = shim.lane_state(0)
    assert not (lane["state"] == "parked" and lane["ptr"] == a_ptr)
    with s2:
        c = cp.empty(4096, dtype=np.uint8)  # s1's block, unsynchronized: never for s2
        assert c.data.ptr != a_ptr
    del b, c
    _settle()


@pytest.fixture
def entry(cp: Any) -> Iterator[tuple[Any, Any, Any, Any]]:
    """The shim, its CuPy entry points (called as CuPy's Cython calls them: GIL held, a set
    exception raised) and CuPy's stream capsule; graphpool's own hooks are set again after."""
    if not c_path(cp):
        pytest.skip("the shim's CuPy entry points")
    shim = twins.torch_shim_or_skip()
    m, f = shim.cupy_entry_points()
    malloc, free = twins.CUPY_C_MALLOC(m), twins.CUPY_C_FREE(f)
    capsule = cp.cuda.stream.__pyx_capi__["get_current_stream_ptr"]
    hooks = gcupy._c_hooks
    assert hooks is not None
    try:
        yield shim, malloc, free, capsule
    finally:
        shim.set_cupy_hooks(hooks.malloc_on, hooks.free, capsule)


def test_set_cupy_hooks_checks_its_arguments_and_keeps_the_hooks_it_had(entry: Any) -> None:
    shim, malloc, free, capsule = entry
    for args in ((1, print, capsule), (print, 1, capsule), (print, print, object())):
        with pytest.raises(TypeError):
            shim.set_cupy_hooks(*args)
    name = b"int (void)"
    other = twins.make_capsule(1, name)  # another signature: never called
    with pytest.raises(TypeError, match="intptr_t"):
        shim.set_cupy_hooks(print, print, other)
    p = malloc(None, 4096, 0)  # graphpool's hooks still serve
    assert p > 0
    free(None, p, 0)


def test_the_cupy_entry_points_check_what_the_hooks_answer(entry: Any) -> None:
    """A malloc hook answering no address (0, -1) or no integer fails with an exception set
    (CuPy raises it); a free of 0 or -1 (CuPy's failed malloc) calls no hook; a free hook's
    negative answer parks nothing and leaves no exception behind."""
    shim, malloc, free, capsule = entry
    assert malloc(None, 0, 0) == 0  # no bytes: a null pointer, no hook asked (CuPy never asks)
    answer: list[Any] = [0]
    freed: list[int] = []

    def free_hook(ptr: int, device: int) -> Any:
        freed.append(ptr)
        return answer[0]

    for bad, err in ((0, RuntimeError), (-1, RuntimeError), ("x", TypeError)):
        shim.set_cupy_hooks(lambda size, device, stream, bad=bad: bad, free_hook, capsule)
        with pytest.raises(err):
            malloc(None, 64, 0)
    free(None, 0, 0)
    free(None, ctypes_minus_one(), 0)
    assert freed == []
    answer[0] = -5
    free(None, 0x1000, 0)  # (PYFUNCTYPE raises an exception left set)
    assert freed == [0x1000]


def ctypes_minus_one() -> int:
    """(void *)-1 as ctypes passes a c_void_p argument."""
    return (1 << 64) - 1


def test_cupy_hooks_set_after_close_are_called_again(entry: Any) -> None:
    """``close()`` (at exit) drops every hook, after which a free does nothing, also once the
    PyTorch hooks are set again; hooks set again afterwards serve again."""
    import graphpool.torch as gtorch

    shim, _malloc, free, capsule = entry
    freed: list[int] = []
    shim.close()
    try:
        shim.set_hooks(*gtorch.hooks())  # the PyTorch hooks only: CuPy's free has no hook
        free(None, 0x1000, 0)
        shim.close()
        shim.set_cupy_hooks(lambda size, device, stream: 0x2000, lambda p, d: freed.append(p), capsule)
        free(None, 0x1000, 0)
        assert freed == [0x1000]
    finally:
        shim.set_hooks(*gtorch.hooks())


def test_a_hand_out_noted_out_of_order_is_never_parked_for_the_wrong_stream(cp: Any, entry: Any) -> None:
    """Another thread's CuPy malloc may run between a malloc hook's answer and the shim's
    note of it (the hook may drop the GIL): the hooks' last hand-out is then not the one the
    shim noted last, with its stream. The lane parks a freed block only when both agree, so
    a block freed on one stream is never handed to the other stream's next request."""
    shim, malloc, free, capsule = entry
    hooks = gcupy._c_hooks
    assert hooks is not None
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    inner: list[int] = []
    outer = [True]

    def malloc_on(size: int, device: int, stream: int) -> int:
        ptr = hooks.malloc_on(size, device, stream)
        if outer[0]:  # "another thread", on s2, before this answer is noted
            outer[0] = False
            with s2:
                inner.append(malloc(None, 8192, 0))
        return ptr

    shim.set_cupy_hooks(malloc_on, hooks.free, capsule)
    with s1:
        a = malloc(None, 4096, 0)  # noted last, with s1; the hooks handed out inner[0] last
    shim.set_cupy_hooks(hooks.malloc_on, hooks.free, capsule)
    free(None, inner[0], 0)  # the hooks' last hand-out, freed on s2
    lane = shim.lane_state(0)
    assert not (lane["state"] == "parked" and lane["ptr"] == inner[0])
    with s1:
        b = malloc(None, 8192, 0)  # s2's block, unsynchronized: never for s1
        assert b != inner[0]
    free(None, a, 0)
    free(None, b, 0)
    _settle()


def test_a_block_cupy_parks_during_pytorchs_capture_query_is_not_handed_to_pytorch(
    cp: Any, entry: Any
) -> None:
    """The lane checks its block again after the capture query (no lock held while asking):
    a block CuPy parked meanwhile, of the same size and stream, is not PyTorch's to take."""
    import graphpool.torch as gtorch
    from graphpool.tools.benchkit import torch_entry_points

    shim, malloc, free, _capsule = entry
    shim.set_hooks(*gtorch.hooks())
    lib = torch_entry_points()
    s = cp.cuda.Stream(non_blocking=True)
    p = lib.graphpool_torch_malloc(4096, 0, s.ptr)
    lib.graphpool_torch_free(p, 4096, 0, s.ptr)
    assert (shim.lane_state(0)["state"], shim.lane_state(0)["kind"]) == ("parked", "torch")
    parked: list[int] = []

    def query(stream: int | None, out: Any) -> int:
        if not parked:  # CuPy, meanwhile: the same size on the same stream, dropped
            parked.append(0)
            with s:
                q = malloc(None, 4096, 0)
                free(None, q, 0)
            parked[0] = q
        out[0] = 0
        return 0

    with twins.lane_query_from(shim, query):
        r = lib.graphpool_torch_malloc(4096, 0, s.ptr)
    assert parked[0] != 0
    assert shim.lane_state(0)["hits"] == 0  # served by the hooks, not by the lane
    lib.graphpool_torch_free(r, 4096, 0, s.ptr)
    _settle()


@pytest.mark.parametrize(
    "missing", ["CFunctionAllocator", "capsule signature", "shim hook", "stream attribute"]
)
def test_the_c_path_is_used_exactly_where_cupy_and_the_shim_have_all_it_needs(
    cp: Any, missing: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``install()`` hands CuPy a ``CFunctionAllocator`` over the shim only where CuPy has the
    class and exports ``get_current_stream_ptr`` with the signature the shim calls, and the
    shim has the CuPy entry points; else ``PythonFunctionAllocator`` serves. A CuPy whose
    ``cuda.stream`` is not yet an attribute has it imported."""
    if not c_path(cp):
        pytest.skip("a CuPy and a shim with the C path")
    import sys
    import types

    from graphpool import lanes

    gcupy.uninstall()
    stream_module = cp.cuda.stream
    if missing == "CFunctionAllocator":
        monkeypatch.delattr(cp.cuda.memory, "CFunctionAllocator")
    elif missing == "capsule signature":
        name = b"int (void)"
        other = twins.make_capsule(1, name)  # never called
        monkeypatch.setattr(stream_module, "__pyx_capi__", {"get_current_stream_ptr": other})
    elif missing == "shim hook":
        monkeypatch.setattr(lanes, "shim", lambda who="": types.SimpleNamespace())
    else:
        monkeypatch.delattr(cp.cuda, "stream")
        monkeypatch.setitem(sys.modules, "cupy.cuda.stream", stream_module)
    gcupy.install()
    assert native(cp)
    assert (gcupy._hooks is gcupy._c_hooks) == (missing == "stream attribute")
    a = cp.ones(1024, dtype=np.float32)
    assert float(a.sum()) == 1024.0
    del a


def test_an_array_outliving_uninstall_goes_back_also_when_freed_first_after_install(cp: Any) -> None:
    """The C path's hooks are the process's: an array made before ``uninstall()`` and freed
    after ``install()``, before any new allocation, goes back to graphpool."""
    base = gp.memory_allocated()
    a = cp.ones(1 << 12, dtype=np.float32)
    gcupy.uninstall()
    gcupy.install()
    del a
    gc.collect()
    gp.memory_stats()
    assert gp.memory_allocated() == base
    gp.check_invariants()


def test_a_block_freed_after_a_routing_change_is_not_parked(cp: Any) -> None:
    """The hooks park a freed block only while the route they used last is current: after
    any routing change the next request must ask graphpool where it goes, so no lane may
    answer it."""
    if not c_path(cp):
        pytest.skip("the lane serves CuPy's CFunctionAllocator path only")
    shim = twins.torch_shim_or_skip()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        a = cp.empty(4096, dtype=np.uint8)
        ptr = a.data.ptr
        routing.invalidate()
        del a
        lane = shim.lane_state(0)
        assert not (lane["state"] == "parked" and lane["ptr"] == ptr)
    _settle()


def test_the_lane_binder_with_lanes_turned_off_or_a_shim_without_lanes(
    cp: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Binding the allocator a lane already serves keeps its parked block; ``GRAPHPOOL_LANE=0``
    at a later binder turns the lanes already bound off (every call then goes to the hooks);
    a shim without lanes gives no binder."""
    if not c_path(cp):
        pytest.skip("the lane serves CuPy's CFunctionAllocator path only")
    import types

    from graphpool import lanes

    shim = twins.torch_shim_or_skip()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        a = cp.empty(4096, dtype=np.uint8)
        ptr = a.data.ptr
        del a
        assert shim.lane_state(0)["state"] == "parked"
        bind = lanes.binder("test")
        assert bind is not None
        bind(0, lanes._owners[0])  # the allocator it serves: nothing to settle
        assert (shim.lane_state(0)["state"], shim.lane_state(0)["ptr"]) == ("parked", ptr)
        monkeypatch.setenv("GRAPHPOOL_LANE", "0")
        try:
            assert lanes.binder("test") is None
            b = cp.empty(4096, dtype=np.uint8)  # graphpool's hooks, not the lane
            assert shim.lane_state(0)["hits"] == 0
            del b
        finally:
            shim.set_lanes_enabled(True)
    monkeypatch.setattr(lanes, "shim", lambda who="": types.SimpleNamespace())
    assert lanes.binder("test") is None
    _settle()


def test_a_block_the_lane_handed_out_freed_after_a_routing_change_goes_back(cp: Any) -> None:
    """A routing change turns the lane off: the free of the array the lane handed out then
    reaches the hooks while graphpool still counts that block as parked; it is queued behind
    the parked block's settling, not refused, and nothing is lost."""
    if not c_path(cp):
        pytest.skip("the lane serves CuPy's CFunctionAllocator path only")
    shim = twins.torch_shim_or_skip()
    base = gp.memory_allocated()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        a = cp.empty(4096, dtype=np.uint8)
        ptr = a.data.ptr
        del a
        b = cp.empty(4096, dtype=np.uint8)
        assert b.data.ptr == ptr and shim.lane_state(0)["hits"] == 1  # the lane's
        routing.invalidate()
        del b
    gc.collect()
    gp.memory_stats()
    assert gp.memory_allocated() == base
    gp.check_invariants()


def test_a_free_while_a_block_is_parked_is_queued_behind_it(cp: Any) -> None:
    """Parking changes no address: with the last array's block parked, the free of its
    neighbour is queued behind that block's, and the next request of that size gets what it
    would get were nothing parked (the two merged, served from the lower address)."""
    if not native(cp):
        pytest.skip("parking serves the compiled hooks")
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        x = cp.empty(4096, dtype=np.uint8)
        y = cp.empty(4096, dtype=np.uint8)
        x_ptr, y_ptr = x.data.ptr, y.data.ptr
        assert y_ptr == x_ptr + 4096  # (neighbours in one segment)
        del y  # the last hand-out: parked
        del x  # queued behind it
        z = cp.empty(4096, dtype=np.uint8)
        assert z.data.ptr == x_ptr
        del z
    _settle()


def test_the_c_path_is_the_default_the_environment_decides(cp: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """By default install() hands CuPy the C path (``CFunctionAllocator``) where it is
    available; ``use_c_allocator = False`` gives the PythonFunctionAllocator path, and
    ``GRAPHPOOL_CUPY_C``, where set, decides over either ("0": hooks, "1": C)."""
    if not c_path(cp):
        pytest.skip("the C path is not available with this twin")
    gcupy.uninstall()
    assert _C_ALLOCATOR_DEFAULT is True
    monkeypatch.delenv("GRAPHPOOL_CUPY_C", raising=False)
    for flag, env, kind in (
        (_C_ALLOCATOR_DEFAULT, None, "CFunctionAllocatorMemory"),
        (False, None, "PythonFunctionAllocatorMemory"),
        (True, "0", "PythonFunctionAllocatorMemory"),
        (False, "1", "CFunctionAllocatorMemory"),
    ):
        monkeypatch.setattr(gcupy, "use_c_allocator", flag)
        if env is None:
            monkeypatch.delenv("GRAPHPOOL_CUPY_C", raising=False)
        else:
            monkeypatch.setenv("GRAPHPOOL_CUPY_C", env)
        gcupy.install()
        a = cp.ones(16, dtype=np.float32)
        assert type(a.data.mem).__name__ == kind, (flag, env)
        del a
        gcupy.uninstall()


def test_closing_pytorchs_entry_points_leaves_cupys_served(cp: Any) -> None:
    """A refused ``graphpool.torch.install()`` closes the shim's PyTorch entry points alone
    (``close("torch")``): CuPy's arrays are still freed and served through the C path."""
    if not c_path(cp):
        pytest.skip("CuPy's C path only")
    shim = twins.torch_shim_or_skip()
    base = gp.memory_allocated()
    a = cp.ones(1 << 12, dtype=np.float32)
    shim.close("torch")
    del a
    gc.collect()
    gp.memory_stats()
    assert gp.memory_allocated() == base  # freed, not dropped by a closed shim
    b = cp.ones(1 << 10, dtype=np.float32)
    assert float(b.sum()) == 1024.0
    del b
    with pytest.raises(ValueError, match="'torch', 'cupy' or nothing"):
        shim.close("numba")


def test_the_hooks_are_registered_handoffs() -> None:
    """The hooks hand blocks between the allocator and a framework (``give_back``, the frees
    and the mallocs): in the plain build a guarded signal handler waits while one runs, so a
    Ctrl-C never loses the block between the two."""
    from graphpool import hooks
    from graphpool.policy import interrupts

    fns = (
        hooks.give_back,
        hooks.CupyHooks.free,
        hooks.CupyHooks.malloc,
        hooks.CupyHooks.malloc_on,
        hooks.CupyHooks._miss,
        hooks.TorchHooks.free,
        hooks.TorchHooks.malloc,
    )
    codes = [getattr(fn, "__code__", None) for fn in fns]
    if codes[0] is None:
        pytest.skip("compiled: a handoff has no bytecode a handler could run in")
    assert all(code in interrupts._handoffs for code in codes)

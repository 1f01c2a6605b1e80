"""graphpool.numba and graphpool.cuda_core on the simulator, through the twins (tests/twins.py).

The same checks as tests/test_integrations_numba.py and test_integrations_cuda_core.py
(GPU only), run in CI on the integration modules themselves.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import sys
import types
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import graphpool as gp
import graphpool.cuda_core as gcore
import graphpool.numba as gnumba
import twins
from graphpool import runtime


def _settle() -> None:
    gc.collect()
    gp.synchronize()
    gp.empty_cache()


def _segment_of(ptr: int) -> dict[str, Any]:
    for seg in gp.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    raise AssertionError(f"0x{ptr:x} is not in any graphpool segment")


@pytest.fixture
def sim_as_cuda() -> Iterator[None]:
    twins.use_sim_as_cuda()
    _settle()
    try:
        yield
    finally:
        _settle()
        gp.check_invariants()
        gp.set_backend("sim")


# ============================================================================== Numba
@pytest.fixture
def numba_cuda(monkeypatch: pytest.MonkeyPatch, sim_as_cuda: None) -> Any:
    numba, cuda = twins.make_numba()
    monkeypatch.setitem(sys.modules, "numba", numba)
    monkeypatch.setitem(sys.modules, "numba.cuda", cuda)
    monkeypatch.setitem(sys.modules, "numba.cuda.cudadrv", cuda.cudadrv)
    monkeypatch.setitem(sys.modules, "numba.cuda.cudadrv.driver", cuda.cudadrv.driver)
    monkeypatch.setattr(gnumba, "_plugin", None)
    return cuda


def test_numbas_old_ctypes_binding_gets_a_ctypes_ipc_handle(
    numba_cuda: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Numba's driver with ``USE_NV_BINDING = False`` (its ctypes binding) opens a ctypes
    ``cu_ipc_mem_handle`` (drvapi), not cuda.bindings' CUipcMemHandle."""
    drvapi = types.ModuleType("numba.cuda.cudadrv.drvapi")
    drvapi.cu_ipc_mem_handle = ctypes.c_byte * 64  # type: ignore[attr-defined]
    monkeypatch.setattr(numba_cuda.cudadrv, "drvapi", drvapi, raising=False)
    monkeypatch.setitem(sys.modules, "numba.cuda.cudadrv.drvapi", drvapi)
    monkeypatch.setattr(numba_cuda.cudadrv.driver, "USE_NV_BINDING", False, raising=False)
    gnumba.install()
    ctx = numba_cuda.current_context()
    d = numba_cuda.to_device(np.arange(1000, dtype=np.float32))
    ipch = ctx.get_ipc_handle(d.gpu_data)
    seg = _segment_of(d.device_ctypes_pointer.value)
    assert isinstance(ipch.handle, drvapi.cu_ipc_mem_handle)
    assert bytes(ipch.handle) == runtime.get().device(0).ipc_export(seg["address"])
    del d, ipch
    gc.collect()


def test_numbas_null_pointer_is_made_in_its_bindings_type(numba_cuda: Any) -> None:
    """A zero-byte allocation is the null pointer, as Numba's binding's CUdeviceptr (a c_void_p
    of 0 has the value None, which Numba's MemoryPointer cannot convert)."""
    gnumba.install()
    mem = numba_cuda.current_context().memalloc(0)
    ptr = mem.device_pointer
    assert type(ptr) is _binding_pointer_type(numba_cuda) and int(ptr) == 0
    mem.free()


def _binding_pointer_type(cuda: Any) -> type:
    return cuda.cudadrv.driver.binding.CUdeviceptr  # type: ignore[no-any-return]


def test_numba_emm_plugin(numba_cuda: Any) -> None:
    cuda = numba_cuda
    gnumba.install()
    ctx = cuda.current_context()
    assert isinstance(ctx.memory_manager, gnumba.GraphpoolEMMPlugin), type(ctx.memory_manager)
    assert gnumba.GraphpoolEMMPlugin.__qualname__ == "GraphpoolEMMPlugin"
    free, total = ctx.get_memory_info()
    assert (free, total) == runtime.get().device(0).mem_info()

    base = gp.memory_allocated()
    host = np.arange(100_000, dtype=np.float32)
    d = cuda.to_device(host)
    assert gp.memory_allocated() == base + -(-host.nbytes // 512) * 512
    ptr = d.device_ctypes_pointer.value
    assert _segment_of(ptr)["stream"] == 0  # graphpool's current stream
    np.testing.assert_array_equal(d.copy_to_host(), host)
    e = cuda.device_array_like(d)
    e.copy_to_device(d)
    np.testing.assert_array_equal(e.copy_to_host(), host)
    ipch = ctx.get_ipc_handle(d.gpu_data)  # Numba's IpcHandle: the segment, and the offset in it
    seg = _segment_of(ptr)
    assert ipch.base is d.gpu_data and ipch.size == d.nbytes and ipch.offset == ptr - seg["address"]
    assert ipch.handle.reserved == runtime.get().device(0).ipc_export(seg["address"])
    assert ipch.source_info == {"pci_domain_id": 0, "pci_bus_id": 0, "pci_device_id": 0}
    del d, e, ipch  # the handle kept the array's memory alive (its base), as Numba's does
    gc.collect()
    cuda.synchronize()
    assert gp.memory_allocated() == base


def test_numba_ipc_handle_refuses_a_captured_graphs_memory(numba_cuda: Any) -> None:
    gnumba.install()
    ctx = numba_cuda.current_context()
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.graph(g, stream=s):
        mp = ctx.memalloc(4096)
        runtime.get().device(0).memset(int(mp.device_ctypes_pointer.value), 0, 4096, s.handle)
    with pytest.raises(gp.IpcError, match="private pool"):
        ctx.get_ipc_handle(mp)
    del mp
    g.reset()


def test_numba_allocates_on_graphpools_current_stream(numba_cuda: Any) -> None:
    gnumba.install()
    cuda = numba_cuda
    s = gp.Stream()
    with gp.stream(s):
        d = cuda.device_array_like(np.zeros(1000, np.float32))
    assert _segment_of(d.device_ctypes_pointer.value)["stream"] == s.handle
    del d


def test_numba_plugin_reset_and_dummy_instance(numba_cuda: Any) -> None:
    gnumba.install()
    cls = gnumba.plugin_class()
    dummy = cls(context=None)  # what set_memory_manager made: no context
    assert dummy.interface_version == 1
    assert dummy._device_index() == runtime.current_device_index()
    ctx = numba_cuda.current_context()
    base = gp.memory_allocated()
    mp = ctx.memalloc(4096)
    assert gp.memory_allocated() == base + 4096
    with ctx.memory_manager.defer_cleanup():
        pass
    ctx.reset()  # Numba resets the context: every buffer dropped
    gc.collect()
    assert gp.memory_allocated() == base
    del mp


def test_numba_refused_on_the_real_simulator(numba_cuda: Any) -> None:
    gnumba.install()
    ctx = numba_cuda.current_context()
    gp.set_backend("sim")
    with pytest.raises(RuntimeError, match="'cuda' backend"):
        ctx.memalloc(512)
    twins.use_sim_as_cuda()


def test_numba_module_attribute_hooks(numba_cuda: Any) -> None:
    assert gnumba._numba_memory_manager is gnumba.plugin_class()
    with pytest.raises(AttributeError):
        _ = gnumba.nothing_here


def test_numba_context_pointer_type(numba_cuda: Any) -> None:
    gnumba.install()
    ctx = numba_cuda.current_context()
    mp = ctx.memalloc(512)
    assert isinstance(mp.device_pointer, ctypes.c_void_p)
    del mp


# ========================================================================== cuda.core
@pytest.fixture(params=["1.x", "0.x", "0.1"])
def core(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, sim_as_cuda: None) -> Any:
    api = request.param
    fake = twins.make_cuda_core(api)
    try:
        importlib.import_module("cuda")
    except ImportError:  # no cuda-python here: a bare namespace package
        monkeypatch.setitem(sys.modules, "cuda", types.ModuleType("cuda"))
    if api == "1.x":
        monkeypatch.setitem(sys.modules, "cuda.core", fake)
    else:  # cuda.core without the names: the integration falls back to .experimental
        monkeypatch.setitem(sys.modules, "cuda.core", types.ModuleType("cuda.core"))
        monkeypatch.setitem(sys.modules, "cuda.core.experimental", fake)
    monkeypatch.setattr(gcore, "_cls", None)
    return fake


def test_memory_resource_allocates_from_graphpool(core: Any, request: pytest.FixtureRequest) -> None:
    from graphpool.cuda_core import GraphpoolMemoryResource, stream_handle

    dev = core.Device(0)
    dev.set_current()
    s = dev.create_stream()
    mr = GraphpoolMemoryResource(0)
    assert isinstance(mr, core.MemoryResource)
    assert (mr.device_id, mr.is_device_accessible, mr.is_host_accessible, mr.is_managed) == (
        0,
        True,
        False,
        False,
    )
    base = gp.memory_allocated()
    n = 1 << 20
    buf = mr.allocate(n, stream=s)
    assert buf.size == n
    assert buf.memory_resource is mr
    ptr = int(buf.handle)
    assert gp.memory_allocated() == base + n
    assert _segment_of(ptr)["stream"] == stream_handle(s) == s.handle
    d = runtime.get().device(0)
    d.memset(ptr, 7, n, stream_handle(s))
    assert set(d.read(ptr, 4096, stream_handle(s))) == {7}
    buf.close(s)
    gc.collect()
    assert gp.memory_allocated() == base
    s.sync()


def test_zero_bytes_are_a_null_buffer_of_this_resource(core: Any) -> None:
    mr = gcore.GraphpoolMemoryResource(0)
    base = gp.memory_allocated()
    buf = mr.allocate(0, stream=core.Device(0).create_stream())
    assert (int(buf.handle), buf.size, buf.memory_resource) == (0, 0, mr)
    assert gp.memory_allocated() == base
    buf.close()
    mr.deallocate(0, 0, object())  # a null buffer holds nothing: not even its stream is read


def test_a_graph_builders_capture_is_registered_by_the_hook(
    core: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuda.core's GraphBuilder (a stand-in that captures on its stream): with detection off
    only the hook registers the capture, under the stream's device and handle."""
    from graphpool.device.protocol import CAPTURE_MODE_RELAXED

    class GraphBuilder:
        def __init__(self, stream: Any) -> None:
            self.stream = stream

        def begin_building(self) -> GraphBuilder:
            runtime.get().device(0).begin_capture(self.stream.handle, CAPTURE_MODE_RELAXED)
            return self

        def end_building(self) -> GraphBuilder:
            self.graph = runtime.get().device(0).end_capture(self.stream.handle)
            return self

    monkeypatch.setattr(core, "GraphBuilder", GraphBuilder, raising=False)
    detecting = gp.capture_detection()
    gp.set_capture_detection(False)
    a = runtime.allocator(0)
    try:
        assert gcore.install_hooks() and gcore.hooked()
        s = core.Device(0).create_stream()
        b = GraphBuilder(s).begin_building()
        assert [p for p in a.private_pools() if p.use_count], "begin_building registered nothing"
        buf = gcore.GraphpoolMemoryResource(0).allocate(512, stream=s)
        assert _segment_of(int(buf.handle))["segment_pool_id"] is not None  # the capture's pool
        b.end_building()
        buf.close(s)
        runtime.get().device(0).destroy_graph(b.graph)
    finally:
        gcore.uninstall_hooks()
        gp.set_capture_detection(detecting)


def test_install_hooks_is_false_without_cuda_core(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.core", None)  # an import of it raises ImportError
    monkeypatch.setitem(sys.modules, "cuda.core.experimental", None)
    assert gcore.install_hooks() is False and not gcore.hooked()


def test_buffer_gets_the_stream_when_the_api_takes_it(core: Any, request: pytest.FixtureRequest) -> None:
    mr = gcore.GraphpoolMemoryResource(0)
    s = core.Device(0).create_stream()
    buf = mr.allocate(512, stream=s)
    assert buf.alloc_stream is (s if core._twin_api == "1.x" else None)
    buf.close()


def test_allocate_with_a_raw_handle_on_cuda_core_0_1(core: Any) -> None:
    """A raw stream handle (no __cuda_stream__) reaches the 0.1 constructor fallback."""
    mr = gcore.GraphpoolMemoryResource(0)
    s = core.Device(0).create_stream()
    buf = mr.allocate(512, stream=s.handle)
    assert _segment_of(int(buf.handle))["stream"] == s.handle
    buf.close(s.handle)


def test_default_stream_and_collection(core: Any) -> None:
    core.Device(0).set_current()
    mr = gcore.GraphpoolMemoryResource()
    base = gp.memory_allocated()
    buf = mr.allocate(4096)  # graphpool's current stream (the legacy default stream)
    assert _segment_of(int(buf.handle))["stream"] == 0
    del buf  # collected: deallocated through the resource
    gc.collect()
    assert gp.memory_allocated() == base


def test_deallocate_on_another_stream_orders_reuse(core: Any, request: pytest.FixtureRequest) -> None:
    """Closed on stream t, a buffer of stream s is reused on s only after t's work so far."""
    mr = gcore.GraphpoolMemoryResource(0)
    dev = core.Device(0)
    s, t = dev.create_stream(), dev.create_stream()
    sim = runtime.get().device(0)
    buf = mr.allocate(4096, stream=s)
    ptr = int(buf.handle)
    sim.launch_sleep(t.handle, rounds=50)  # t is busy...
    sim.memset(ptr, 0xAA, 4096, t.handle)  # ...then writes the buffer
    buf.close(t)
    gc.collect()
    other = mr.allocate(4096, stream=s)
    assert int(other.handle) != ptr  # not while t's work may still touch it (record_stream)
    sim.stream_synchronize(t.handle)
    again = mr.allocate(4096, stream=s)
    assert int(again.handle) == ptr  # reused once t's work is done
    assert sim.read(ptr, 4096, s.handle) == b"\xaa" * 4096  # t's write came first
    other.close(s)
    again.close(s)


@pytest.mark.parametrize("given", ["int", "stream"])
def test_deallocate_on_the_per_thread_default_stream_waits_for_the_legacy_stream(
    core: Any, given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuda.core deallocates with its default stream, the per-thread one (handle 2) under
    per-thread default streams, from finalizers too: not refused (that would leak), but that
    handle names another stream on the thread that carries the free out later. Reuse waits for
    the legacy stream instead (CUDA orders it after every thread's per-thread stream); no event
    is ever recorded on handle 2."""
    mr = gcore.GraphpoolMemoryResource(0)
    s = core.Device(0).create_stream()
    sim = runtime.get().device(0)
    recorded: list[int] = []
    real_record = sim.record_event

    def record_event(event: int, stream: int) -> None:
        recorded.append(stream)
        real_record(event, stream)

    monkeypatch.setattr(sim, "record_event", record_event)
    buf = mr.allocate(4096, stream=s)
    ptr = int(buf.handle)
    sim.launch_sleep(0, rounds=50)  # the legacy stream is busy
    ptds = 2 if given == "int" else types.SimpleNamespace(__cuda_stream__=lambda: (0, 2))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about: the free is ordered
        buf.close(ptds)  # MemoryResource.deallocate(ptr, size, stream)
    other = mr.allocate(4096, stream=s)
    assert int(other.handle) != ptr  # not while the legacy stream's work so far may run
    assert recorded and 2 not in recorded and set(recorded) == {0}
    sim.stream_synchronize(0)
    again = mr.allocate(4096, stream=s)
    assert int(again.handle) == ptr
    other.close(s)
    again.close(s)
    # the legacy stream's handle (1) is graphpool's legacy stream: the same wait, by the same name
    buf = mr.allocate(4096, stream=s)
    recorded.clear()
    buf.close(1)
    mr.allocate(512, stream=s).close(s)  # carries the queued free out
    assert recorded == [0]


def test_stream_handle_forms(core: Any) -> None:
    s = core.Device(0).create_stream()
    assert gcore.stream_handle(s) == s.handle
    assert gcore.stream_handle(1234) == 1234
    g = gp.Stream()
    assert gcore.stream_handle(g) == g.handle
    assert gcore.stream_handle(types.SimpleNamespace(handle=77)) == 77
    with pytest.raises(TypeError, match="cannot tell the CUDA stream"):
        gcore.stream_handle(object())
    for bad in (-5, True, False):  # never a stream: refused before any device call is made with it
        with pytest.raises(ValueError, match=f"non-negative int, not {bad!r}$"):  # (compiled: not 1)
            gcore.stream_handle(bad)
    mr = gcore.GraphpoolMemoryResource(0)
    base = gp.memory_allocated()
    with pytest.raises(ValueError, match="non-negative int"):
        mr.allocate(512, stream=-5)
    assert gp.memory_allocated() == base


def test_a_negative_handle_attribute_is_refused_before_the_block_leaves_the_table(core: Any) -> None:
    """An object whose ``handle`` is negative names no stream: ValueError, as for a negative
    int, and at ``deallocate`` the block stays its buffer's. (-1 in particular is the table's
    "no stream named": taken for it, the block went back at once, ordered after nothing.)"""
    for bad in (-1, -7):
        with pytest.raises(ValueError, match=f"handle is {bad}: a CUDA stream handle is a non-negative int"):
            gcore.stream_handle(types.SimpleNamespace(handle=bad))
    mr = gcore.GraphpoolMemoryResource(0)
    s = core.Device(0).create_stream()
    gc.collect()
    base = gp.memory_allocated()
    buf = mr.allocate(4096, stream=s)
    ptr = int(buf.handle)
    with pytest.raises(ValueError, match="non-negative int"):
        mr.deallocate(ptr, 4096, types.SimpleNamespace(handle=-1))
    assert ptr in mr._blocks
    assert gp.memory_allocated() == base + 4096
    buf.close(s)
    gc.collect()
    assert gp.memory_allocated() == base
    gp.check_invariants()


def test_refused_on_the_real_simulator(core: Any) -> None:
    mr = gcore.GraphpoolMemoryResource(0)
    gp.set_backend("sim")
    with pytest.raises(RuntimeError, match="'cuda' backend"):
        mr.allocate(512)
    twins.use_sim_as_cuda()


def test_invalid_device_refused(core: Any) -> None:
    with pytest.raises(ValueError, match="invalid device 5"):
        gcore.GraphpoolMemoryResource(5)
    assert repr(gcore.GraphpoolMemoryResource(1)) == "<graphpool.cuda_core.GraphpoolMemoryResource device=1>"


def test_per_thread_default_stream_is_refused(core: Any) -> None:
    mr = gcore.GraphpoolMemoryResource(0)
    with pytest.raises(ValueError, match=r"GraphpoolMemoryResource\.allocate: int is CUDA's per-thread"):
        mr.allocate(512, stream=2)
    buf = mr.allocate(512, stream=1)  # cudaStreamLegacy: the legacy stream
    assert _segment_of(int(buf.handle))["stream"] == 0
    buf.close()


def test_numba_arrays_inside_use_mem_pool_come_from_the_pool(numba_cuda: Any) -> None:
    gnumba.install()
    pool = gp.MemPool()
    with gp.use_mem_pool(pool):
        d = numba_cuda.device_array_like(np.zeros(1000, np.float32))
    e = numba_cuda.device_array_like(np.zeros(1000, np.float32))
    assert _segment_of(d.device_ctypes_pointer.value)["segment_pool_id"] == tuple(pool.id)
    assert _segment_of(e.device_ctypes_pointer.value)["segment_pool_id"] is None
    del d, e


def test_cuda_core_buffers_inside_use_mem_pool_come_from_the_pool(core: Any) -> None:
    dev = core.Device(0)
    dev.set_current()
    s = dev.create_stream()
    mr = gcore.GraphpoolMemoryResource(0)
    pool = gp.MemPool()
    with gp.use_mem_pool(pool):
        buf = mr.allocate(4096, stream=s)
    other = mr.allocate(4096, stream=s)
    assert _segment_of(int(buf.handle))["segment_pool_id"] == tuple(pool.id)
    assert _segment_of(int(other.handle))["segment_pool_id"] is None
    buf.close(s)
    other.close(s)
    s.sync()


def test_a_closed_buffer_is_reused_on_its_stream_and_the_route_follows_the_stream(core: Any) -> None:
    """The raw path: a buffer closed on its own stream comes back at the next allocate of the
    same size there (the allocator's cache, as for the CuPy and PyTorch hooks); a buffer of
    another stream does not take it; a set_backend between calls finds the route anew."""
    mr = gcore.GraphpoolMemoryResource(0)
    dev = core.Device(0)
    s, t = dev.create_stream(), dev.create_stream()
    buf = mr.allocate(4096, stream=s)
    ptr = int(buf.handle)
    buf.close(s)
    assert runtime.allocator(0).parking()  # the block handed out last: parked (hooks.give_back)
    on_t = mr.allocate(4096, stream=t)
    assert int(on_t.handle) != ptr and _segment_of(int(on_t.handle))["stream"] == t.handle
    again = mr.allocate(4096, stream=s)
    assert int(again.handle) == ptr
    again.close(s)
    on_t.close(t)
    legacy = mr.allocate(4096)  # graphpool's current stream: the legacy stream (0)
    legacy.close()
    twins.use_sim_as_cuda()  # a new runtime: the kept route (same handle 0) is stale
    fresh = mr.allocate(4096)
    assert _segment_of(int(fresh.handle))["stream"] == 0  # a segment of the new runtime
    fresh.close()
    gp.check_invariants()


def test_a_graphpool_stream_of_another_device_is_refused(core: Any) -> None:
    mr = gcore.GraphpoolMemoryResource(0)
    base = gp.memory_allocated(0)
    with pytest.raises(ValueError, match="belongs to device 1"):
        mr.allocate(512, stream=gp.Stream(device=1))
    buf = mr.allocate(512, stream=gp.Stream(device=0))
    assert gp.memory_allocated(0) == base + 512
    buf.close()
    gc.collect()
    assert gp.memory_allocated(0) == base


def test_a_failing_buffer_constructor_gives_the_block_back(
    core: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuda.core raising while it wraps the address: the block goes back and nothing is kept
    for the address (a later deallocate of it does nothing)."""
    mr = gcore.GraphpoolMemoryResource(0)
    s = core.Device(0).create_stream()
    gc.collect()
    base = gp.memory_allocated()

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no buffer today")

    if not hasattr(core.Buffer, "from_handle"):
        pytest.skip("cuda.core 0.1 builds Buffer with its constructor; from_handle is the call tested")
    monkeypatch.setattr(core.Buffer, "from_handle", staticmethod(broken))
    monkeypatch.setattr(gcore, "_cls", None)  # the class reads cuda.core's Buffer when made
    mr = gcore.GraphpoolMemoryResource(0)
    with pytest.raises(RuntimeError, match="no buffer today"):
        mr.allocate(4096, stream=s)
    assert gp.memory_allocated() == base
    assert not mr._blocks
    gp.check_invariants()


@pytest.mark.parametrize(
    "bad",
    [object(), types.SimpleNamespace(__cuda_stream__=lambda: (1, 5))],
    ids=["no-stream", "protocol-version-1"],
)
def test_a_close_on_a_stream_that_cannot_be_read_loses_nothing(core: Any, bad: Any) -> None:
    """``deallocate`` with a stream it cannot read raises TypeError and keeps the block with
    its buffer, which a later close gives back."""
    mr = gcore.GraphpoolMemoryResource(0)
    s = core.Device(0).create_stream()
    gc.collect()
    base = gp.memory_allocated()
    buf = mr.allocate(4096, stream=s)
    with pytest.raises(TypeError):
        buf.close(bad)
    assert gp.memory_allocated() == base + 4096
    buf.close(s)
    gc.collect()
    assert gp.memory_allocated() == base
    gp.check_invariants()


def test_a_graphpool_stream_of_another_device_is_refused_after_a_kept_route(core: Any) -> None:
    """The route kept for the legacy stream's handle (0) of the resource's device does not let
    device 1's legacy stream (the same handle) through."""
    mr = gcore.GraphpoolMemoryResource(0)
    mr.allocate(512).close()  # kept: handle 0 of device 0
    base = (gp.memory_allocated(0), gp.memory_allocated(1))
    with pytest.raises(ValueError, match="belongs to device 1"):
        mr.allocate(512, stream=gp.default_stream(1))
    assert (gp.memory_allocated(0), gp.memory_allocated(1)) == base


@pytest.mark.parametrize("size", [False, True, 0.0, 512.0, "512", None])
def test_a_size_that_is_not_an_integer_is_a_type_error(core: Any, size: Any) -> None:
    """As ``gp.alloc``: a bool or a non-integer size is refused, also where it equals 0."""
    mr = gcore.GraphpoolMemoryResource(0)
    s = core.Device(0).create_stream()
    base = gp.memory_allocated()
    with pytest.raises(TypeError, match="size must be an int number of bytes"):
        mr.allocate(size, stream=s)
    assert gp.memory_allocated() == base and not mr._blocks


def test_a_numpy_integer_size_is_read_once_as_an_int(core: Any) -> None:
    mr = gcore.GraphpoolMemoryResource(0)
    s = core.Device(0).create_stream()
    base = gp.memory_allocated()
    buf = mr.allocate(np.int64(4096), stream=s)
    assert gp.memory_allocated() == base + 4096 and buf.size == 4096
    null = mr.allocate(np.int32(0), stream=s)
    assert int(null.handle) == 0
    buf.close(s)
    null.close(s)


def test_a_buffer_that_cannot_be_made_gives_its_block_back(
    core: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuda.core's Buffer raising as it is made (here: an interrupt or any error in
    ``from_handle``) leaves no block out: the one just handed out goes back to graphpool."""
    if getattr(core.Buffer, "from_handle", None) is None:
        pytest.skip("cuda.core 0.1 builds Buffer with its constructor; from_handle is the call tested")

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(core.Buffer, "from_handle", staticmethod(refuse))
    mr = gcore.GraphpoolMemoryResource(0)  # the class, made now, takes this from_handle
    s = core.Device(0).create_stream()
    gc.collect()
    base = gp.memory_allocated()
    with pytest.raises(KeyboardInterrupt):
        mr.allocate(4096, stream=s)
    assert not mr._blocks
    runtime.allocator(0).empty_cache()  # carries out the queued give-back
    assert gp.memory_allocated() == base
    gp.check_invariants()


def test_the_resources_allocate_and_deallocate_are_handoffs(core: Any) -> None:
    """Both builds (cuda_core.py is never compiled): a guarded signal landing in ``allocate``
    between the allocator's answer and the resource's table, or in ``deallocate`` between the
    table and the allocator's queue, waits until the block has its owner."""
    from graphpool.policy import interrupts

    cls = gcore.resource_class()
    for fn in (cls.allocate, cls.deallocate):
        assert fn.__code__ in interrupts._handoffs, fn


def test_the_resource_hooks_that_move_a_block_are_handoffs() -> None:
    """Plain build: ``ResourceHooks.allocate`` (the allocator's answer to the table), ``free``
    (the table to the allocator's queue) and ``forget`` (a block whose Buffer could not be made:
    the table back to the allocator) each hold a block that has no other owner between two
    calls; a guarded signal landing there waits until the block has one."""
    from graphpool.hooks import ResourceHooks
    from graphpool.policy import interrupts

    fns = (ResourceHooks.allocate, ResourceHooks.free, ResourceHooks.forget)
    codes = [getattr(fn, "__code__", None) for fn in fns]
    if codes[0] is None:
        pytest.skip("compiled: a handoff has no bytecode a handler could run in")
    for fn, code in zip(fns, codes, strict=True):
        assert code in interrupts._handoffs, fn

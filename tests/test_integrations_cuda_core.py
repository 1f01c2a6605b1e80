"""graphpool.cuda_core: a cuda.core MemoryResource backed by graphpool (GPU only)."""

from __future__ import annotations

import gc
from typing import Any

import pytest

import graphpool as gp
from gpu_guard import cuda_unusable
from graphpool import runtime

pytestmark = pytest.mark.gpu


def _core() -> Any:
    try:
        import cuda.core as core

        if not hasattr(core, "Device"):
            raise ImportError
        return core
    except ImportError:
        return pytest.importorskip("cuda.core.experimental")


@pytest.fixture
def core() -> Any:
    reason = cuda_unusable()
    if reason is not None:
        pytest.skip(reason)
    pytest.importorskip("cuda.core")
    mod = _core()
    if runtime.get().name != "cuda":
        gp.set_backend("cuda")
    gc.collect()
    gp.synchronize()
    yield mod
    gc.collect()
    gp.synchronize()
    gp.empty_cache()
    gp.check_invariants()


def _segment_of(ptr: int) -> dict[str, Any]:
    for seg in gp.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg
    raise AssertionError(f"0x{ptr:x} is not in any graphpool segment")


def test_memory_resource_allocates_from_graphpool(core: Any) -> None:
    from graphpool.cuda_core import GraphpoolMemoryResource, stream_handle

    dev = core.Device(0)
    dev.set_current()
    s = dev.create_stream()
    mr = GraphpoolMemoryResource(0)
    assert isinstance(mr, core.MemoryResource)
    assert mr.device_id == 0 and mr.is_device_accessible and not mr.is_host_accessible
    gc.collect()
    base = gp.memory_allocated()
    n = 1 << 20
    buf = mr.allocate(n, stream=s)
    assert buf.size == n
    assert buf.memory_resource is mr
    ptr = int(buf.handle)
    assert gp.memory_allocated() == base + n
    assert _segment_of(ptr)["stream"] == stream_handle(s)
    # the memory is usable
    d = runtime.get().device(0)
    d.memset(ptr, 7, n, stream_handle(s))
    assert set(d.read(ptr, 4096, stream_handle(s))) == {7}
    buf.close(s)
    gc.collect()
    assert gp.memory_allocated() == base
    s.sync()


def test_default_stream_and_collection(core: Any) -> None:
    from graphpool.cuda_core import GraphpoolMemoryResource

    core.Device(0).set_current()
    mr = GraphpoolMemoryResource()
    gc.collect()
    base = gp.memory_allocated()
    buf = mr.allocate(4096)  # graphpool's current stream (the legacy default stream)
    assert _segment_of(int(buf.handle))["stream"] == 0
    del buf  # collected: deallocated through the resource
    gc.collect()
    assert gp.memory_allocated() == base

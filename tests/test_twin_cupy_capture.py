"""graphpool.cupy where detection cannot cover for it: CuPy's own ``Stream.begin_capture``
registers the capture itself (so it is protected with detection off), and the stream
wrapper ``malloc`` keeps from its last call is never reused on another device (CuPy's null
stream has the handle 0 on every device).

Each test runs on the CuPy twin (tests/twins.py) over the simulator, as
tests/test_twin_cupy.py does, and, marked gpu, with CuPy on a GPU.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import graphpool as gp
import graphpool.cupy as gcupy
import twins
from gpu_guard import TOO_FEW_GPUS, cuda_unusable
from graphpool import runtime


def _settle() -> None:
    gc.collect()
    gp.synchronize()
    gp.empty_cache()


@pytest.fixture(params=["twin", pytest.param("gpu", marks=pytest.mark.gpu)])
def cp(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """CuPy with graphpool installed as its allocator: the twin on the simulator, or CuPy."""
    if request.param == "gpu":
        reason = cuda_unusable()
        if reason is not None:
            pytest.skip(reason)
        module = pytest.importorskip("cupy")
        if runtime.get().name != "cuda":
            gp.set_backend("cuda")
    else:
        module = twins.make_cupy()
        monkeypatch.setitem(sys.modules, "cupy", module)
        for name, value in (
            ("_cp", None),
            ("_installed", False),
            ("_previous", None),
            ("_last", None),
            ("_c_hooks", None),
        ):
            monkeypatch.setattr(gcupy, name, value)
        monkeypatch.setattr(gcupy, "_gp_streams", {})
        monkeypatch.setattr(gcupy, "_cp_streams", {})
        twins.use_sim_as_cuda()
    _settle()
    gcupy.install()
    try:
        yield module
    finally:
        gcupy.uninstall()
        gp.set_capture_detection(True)
        _settle()
        gp.check_invariants()
        if request.param == "twin":
            gp.set_backend("sim")


def _pool_of(ptr: int) -> Any:
    for seg in gp.memory_snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return seg["segment_pool_id"]
    raise AssertionError(f"0x{ptr:x} is not in any graphpool segment")


def _in_use(a: Any) -> list[Any]:
    return [p for p in a.private_pools() if p.use_count]


def test_cupys_begin_capture_registers_the_capture_with_detection_off(cp: Any) -> None:
    """With detection off only a registered capture is served from a private pool: the hook
    registers CuPy's capture at begin_capture, before its first allocation."""
    if not gcupy.hooked():
        pytest.skip("this CuPy's Stream.begin_capture cannot be hooked (an extension type)")
    gp.set_capture_detection(False)
    n = 1 << 14
    a = runtime.allocator()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        try:
            assert len(_in_use(a)) == 1, "begin_capture registered nothing"
            t = cp.ones(n, dtype=np.float32)
            out = t + 1.0
            pool = _pool_of(int(t.data.ptr))
            assert pool is not None, "an allocation of CuPy's capture got eager memory"
            assert _pool_of(int(out.data.ptr)) == pool
            del t
        finally:
            g = s.end_capture()
        g.launch(s)
        s.synchronize()
    assert float(out.sum().item()) == 2.0 * n
    assert len(_in_use(a)) == 1  # the graph keeps its pool
    del out, g
    _settle()
    assert _in_use(a) == []


def test_the_stream_kept_from_the_last_call_is_not_reused_on_another_device(cp: Any) -> None:
    """CuPy's null stream is handle 0 on every device: an allocation on device 1 after one on
    device 0 comes from device 1's allocator, not through device 0's kept wrapper."""
    if gp.device_count() < 2:
        pytest.skip(f"{TOO_FEW_GPUS} needs two devices")
    _allocate_across_devices(cp)


def test_the_function_allocators_kept_stream_is_not_reused_on_another_device(
    cp: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through ``graphpool.cupy.malloc`` (``use_function_allocator``; CuPy without
    ``PythonFunctionAllocator``), whose kept wrapper (``_last``) is its own."""
    if gp.device_count() < 2:
        pytest.skip(f"{TOO_FEW_GPUS} needs two devices")
    gcupy.uninstall()
    monkeypatch.setattr(gcupy, "use_function_allocator", True)
    gcupy.install()
    assert cp.cuda.get_allocator() is gcupy.malloc
    _allocate_across_devices(cp)


def _allocate_across_devices(cp: Any) -> None:
    x = cp.ones(1024, dtype=np.float32)  # device 0, null stream: kept by graphpool.cupy
    with cp.cuda.Device(1):
        y = cp.ones(1024, dtype=np.float32)
        assert float(y.sum().item()) == 1024.0
    assert runtime.allocator(1).lookup(int(y.data.ptr)) is not None, "allocated on the wrong device"
    assert runtime.allocator(0).lookup(int(y.data.ptr)) is None
    z = cp.ones(1024, dtype=np.float32)  # back on device 0
    assert runtime.allocator(0).lookup(int(z.data.ptr)) is not None
    del x, y, z
    gc.collect()
    gp.synchronize(1)
    gp.empty_cache(1)
    gp.check_invariants(1)

"""graphpool.cupy.install_pinned(): graphpool's pinned pool as CuPy's pinned memory allocator,
and the pinned-memory hazard of CuPy's own pool under a CuPy capture.

Each test runs on the CuPy twin (tests/twins.py) over the simulator and, marked gpu, with CuPy
on a GPU (benchmarks/pinned_hazard_gpu.py prints the same figures at full size).
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
from gpu_guard import cuda_unusable
from graphpool import runtime

N = 1 << 14


@pytest.fixture(params=["twin", pytest.param("gpu", marks=pytest.mark.gpu)])
def cp(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """CuPy (the twin on the simulator, or CuPy on a GPU), graphpool not installed yet."""
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
            ("_pinned_installed", False),
            ("_previous", None),
            ("_last", None),
            ("_c_hooks", None),
        ):
            monkeypatch.setattr(gcupy, name, value)
        monkeypatch.setattr(gcupy, "_gp_streams", {})
        monkeypatch.setattr(gcupy, "_cp_streams", {})
        assert not gcupy.hooked()  # the last test gave CuPy's methods back
        twins.use_sim_as_cuda()
    try:
        yield module
    finally:
        gcupy.uninstall_pinned()
        gc.collect()
        gp.synchronize()
        gp.empty_pinned_cache()
        gp.check_invariants()
        if request.param == "twin":
            gp.set_backend("sim")


def _empty_pinned(cp: Any, n: int) -> tuple[np.ndarray, int]:
    """A float32 array in pinned memory from CuPy's current pinned allocator, and its pointer."""
    if hasattr(cp.cuda, "pinned_ptr"):  # the twin
        arr = cp.cuda.empty_pinned(n, np.float32)
        return arr, cp.cuda.pinned_ptr(arr)
    import cupyx

    arr = cupyx.empty_pinned(n, np.float32)
    return arr, int(arr.ctypes.data)


def hazard(cp: Any) -> int:
    """Capture a host-to-device copy from a pinned buffer on a CuPy stream, drop the buffer
    during the capture, then fill an eager pinned buffer with 7 and replay: how many elements
    of the copy's destination are not the 1 the captured buffer held."""
    d = cp.zeros(N, dtype=cp.float32)
    s = cp.cuda.Stream(non_blocking=True)
    kind = getattr(cp.cuda.runtime, "memcpyDefault", 4)
    with s:
        h, hp = _empty_pinned(cp, N)
        h[:] = 1.0
        s.begin_capture()
        cp.cuda.runtime.memcpyAsync(d.data.ptr, hp, 4 * N, kind, s.ptr)
        del h  # freed during the capture
        gc.collect()
        graph = s.end_capture()
        eager, _ = _empty_pinned(cp, N)  # an eager buffer on the same stream
        eager[:] = 7.0
        graph.launch(s)
        s.synchronize()
        wrong = int((cp.asnumpy(d) != 1.0).sum())
    del graph, eager
    gc.collect()
    # Let graphpool notice the capture's end while its stream exists (README, "Limits of
    # detection"): a stream destroyed first may still be asked about, which crashes the driver.
    gp.pinned_memory_stats()
    gp.memory_stats()
    return wrong


def test_cupy_pinned_pool_hazard_and_graphpools(cp: Any) -> None:
    cp.cuda.set_pinned_memory_allocator(cp.get_default_pinned_memory_pool().malloc)
    assert hazard(cp) == N  # CuPy's pool: every element read from the eager buffer
    gcupy.install_pinned()
    assert gcupy.is_pinned_installed()
    assert hazard(cp) == 0  # graphpool's: the buffer was kept for the graph


def test_install_pinned_serves_cupy_from_graphpools_pool(cp: Any) -> None:
    gcupy.install_pinned()
    gcupy.install_pinned()  # idempotent
    base = gp.pinned_memory_stats()["allocated_bytes.all.current"]
    mem = cp.cuda.alloc_pinned_memory(1000)
    assert isinstance(mem, cp.cuda.PinnedMemoryPointer)
    assert isinstance(mem.mem.buffer, gp.PinnedBuffer)
    assert mem.size() == 1000 and mem.ptr == mem.mem.buffer.ptr
    assert gp.pinned_memory_stats()["allocated_bytes.all.current"] == base + 1024
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        other = cp.cuda.alloc_pinned_memory(512)
    assert other.mem.buffer.stream.handle == int(s.ptr)  # CuPy's current stream
    del mem, other
    gc.collect()
    gp.pinned_memory_stats()
    assert gp.pinned_memory_stats()["allocated_bytes.all.current"] == base
    gcupy.uninstall_pinned()
    gcupy.uninstall_pinned()
    assert not gcupy.is_pinned_installed()
    assert not isinstance(getattr(cp.cuda.alloc_pinned_memory(512).mem, "buffer", None), gp.PinnedBuffer)


def test_out_of_pinned_memory_is_cupys_error(cp: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy falls back to a synchronous copy on its own CUDARuntimeError(memory allocation)."""
    gcupy.install_pinned()

    def refuse(nbytes: int, stream: Any = None) -> Any:
        raise gp.OutOfMemoryError("no pinned memory")

    monkeypatch.setattr(gcupy, "alloc_pinned", refuse)
    with pytest.raises(cp.cuda.runtime.CUDARuntimeError) as info:
        cp.cuda.alloc_pinned_memory(1000)
    # (CuPy 14 has no runtime.errorMemoryAllocation: cudaErrorMemoryAllocation is 2)
    assert info.value.status == getattr(cp.cuda.runtime, "errorMemoryAllocation", 2)

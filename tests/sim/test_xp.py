"""graphpool.sim.xp on the real allocator: values, dtypes, streams, capture and replay.

Needs graphpool's public API (``alloc``, ``current_stream``, ``set_backend``, ``graph``);
skipped while that is missing.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import graphpool as gp
from graphpool.errors import CUDAError
from graphpool.sim import SimBackend, SimDevice, xp

_NEEDED = ("alloc", "current_stream", "set_backend", "graph", "Stream", "stream", "CUDAGraph")


def test_the_public_api_these_tests_use_is_there() -> None:
    """Each name missing fails here (and in the tests using it), never skips the file."""
    assert [n for n in _NEEDED if not hasattr(gp, n)] == []


MiB = 1024 * 1024


@pytest.fixture(autouse=True)
def sim() -> Iterator[SimDevice]:
    """A fresh simulated backend for each test; the previous backend is put back after."""
    from graphpool import runtime

    before = gp.backend() if hasattr(gp, "backend") else None
    b = SimBackend(device_count=2, memory_bytes=1024 * MiB)
    try:
        runtime.set_backend("sim", backend=b)
    except TypeError:  # no backend= keyword: the default simulator will do
        gp.set_backend("sim")
    dev = runtime.current_device_object()
    assert isinstance(dev, SimDevice)
    yield dev
    gc.collect()
    if before is not None and before != "sim":
        gp.set_backend(before)


def test_constructors_and_attributes() -> None:
    a = xp.ones(10)
    assert a.shape == (10,) and a.size == 10 and len(a) == 10 and a.dtype == np.float32
    assert a.nbytes == 40 and isinstance(a.data.ptr, int) and a.data.ptr != 0
    assert a.get().tolist() == [1.0] * 10
    assert xp.zeros((4,)).get().tolist() == [0.0] * 4
    assert xp.full(3, 2.5, dtype=np.float64).get().tolist() == [2.5] * 3
    assert xp.arange(5).get().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert xp.arange(5, dtype=np.int32).get().dtype == np.int32
    assert xp.empty(7, dtype=np.int64).shape == (7,)
    assert xp.asarray([1, 2, 3]).get().tolist() == [1, 2, 3]
    assert "xp.array(" in repr(xp.ones(2))
    with pytest.raises(TypeError):
        xp.ones(3, dtype=np.complex64)
    with pytest.raises(ValueError):
        xp.ones((2, 2))


def test_arithmetic_and_reductions() -> None:
    a = xp.arange(4)
    assert (a + 1).get().tolist() == [1, 2, 3, 4]
    assert (1 + a).get().tolist() == [1, 2, 3, 4]
    assert (a - 1).get().tolist() == [-1, 0, 1, 2]
    assert (10 - a).get().tolist() == [10, 9, 8, 7]
    assert (a * a).get().tolist() == [0, 1, 4, 9]
    assert (3 * a + a).get().tolist() == [0, 4, 8, 12]
    assert (-a).get().tolist() == [0, -1, -2, -3]
    s = a.sum()
    assert s.shape == () and s.item() == 6.0 and isinstance(s.item(), float)
    assert (a.sum() + a).get().tolist() == [6, 7, 8, 9]
    assert xp.ones(3, dtype=np.int32).sum().item() == 3
    b = a.copy()
    b.fill(5)
    assert a.get().tolist() == [0, 1, 2, 3] and b.get().tolist() == [5] * 4
    with pytest.raises(ValueError):
        a + xp.ones(5)
    with pytest.raises(ValueError):
        a.item()


def test_big_float32_sums_are_exact() -> None:
    assert xp.full(1_000_000, 156.0).sum().item() == 156_000_000


def test_memory_comes_from_graphpool_and_returns_on_collection() -> None:
    base = gp.memory_allocated()
    a = xp.ones(1000)
    assert gp.memory_allocated() == base + -(-a.nbytes // 512) * 512  # rounded up to 512 B
    del a
    gc.collect()
    assert gp.memory_allocated() == base


def test_work_follows_the_current_stream(sim: SimDevice) -> None:
    s = gp.Stream()
    with gp.stream(s):
        a = xp.ones(100)
        b = a + 1
        assert sim.pending_ops(s.handle) == 2  # the fill, then the add
        assert b.sum().item() == 200
        assert sim.pending_ops(s.handle) == 0


def test_graph_replay_reruns_kernels_on_the_same_memory() -> None:
    a = xp.ones(1000)
    g = gp.CUDAGraph()
    with gp.graph(g):
        b = a * 2
        c = b + 1
    a.fill(10)
    g.replay()
    assert c.sum().item() == 21 * 1000
    a.fill(0)
    g.replay()
    assert c.get().tolist() == [1.0] * 1000


def test_capture_then_eager_reuse_is_safe() -> None:
    """CuPy issue #9655, closed: a temporary dropped during capture is not given to eager code."""
    n = 1000
    a = xp.ones(n)
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.stream(s):
        with gp.graph(g, stream=s):
            t = a * 2
            out = t + 1
            del t
        y = xp.full(n, 7)
        g.replay()
        assert y.get().tolist() == [7.0] * n
        assert out.sum().item() == 3 * n


def test_repr_during_capture_does_not_sync() -> None:
    a = xp.ones(3)
    g = gp.CUDAGraph()
    with gp.graph(g):
        b = a + 1
        assert "capturing" in repr(b)
    g.replay()
    assert b.get().tolist() == [2.0] * 3


def test_reading_during_capture_fails() -> None:
    a = xp.ones(3)
    g = gp.CUDAGraph()
    with pytest.raises((CUDAError, gp.GraphpoolError)), gp.graph(g):
        (a + 1).sum().item()


def test_refuses_a_cuda_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    from graphpool import runtime

    fake: Any = object()
    monkeypatch.setattr(runtime, "current_device_object", lambda *args: fake)
    with pytest.raises(TypeError, match="simulated"):
        xp.ones(3)


def test_conversions_keep_the_asked_dtype_and_errors_read_as_numpys() -> None:
    a = xp.asarray([1, 2, 3], dtype=np.int32)
    assert a.dtype == np.int32 and xp.asarray(a) is a and xp.asarray(a, dtype=np.int32) is a
    b = xp.asarray(a, dtype=np.float32)  # another dtype: a converted copy
    assert b is not a and b.dtype == np.float32 and b.get().tolist() == [1.0, 2.0, 3.0]
    assert xp.asarray(np.arange(3, dtype=np.int64), dtype=np.int32).dtype == np.int32
    assert xp.empty(4, np.int32).dtype == np.int32
    c = a.astype(np.float64)
    assert c.dtype == np.float64 and c.get().tolist() == [1.0, 2.0, 3.0]
    assert a.sum().dtype == np.ones(1, np.int32).sum().dtype  # NumPy's accumulator type
    with pytest.raises(TypeError, match=r"^len\(\) of unsized object$"):
        len(a.sum())
    with pytest.raises(ValueError, match=r"^can only convert an array of size 1 to a Python scalar$"):
        a.item()
    with pytest.raises(TypeError, match=r"^unsupported operand for xp\.ndarray subtract: str$"):
        "x" - a  # type: ignore[operator]


def test_deepcopy_of_an_array_and_of_its_pointer_are_real_copies_at_the_same_offset() -> None:
    import copy

    a = xp.arange(8, dtype=np.int32)
    pair = copy.deepcopy([a, a])
    assert pair[0] is pair[1] and pair[0] is not a  # one copy, as the memo says
    assert pair[0].get().tolist() == list(range(8))
    p = a.data
    assert p.mem is a._buf and p.ptr == a._buf.ptr
    q = copy.deepcopy(p)
    assert q.mem is not p.mem and q.ptr == int(q.mem.ptr)


def test_an_operand_of_another_kind_is_refused_naming_the_operation() -> None:
    a = xp.ones(3)
    with pytest.raises(TypeError, match=r"^unsupported operand for xp\.ndarray add: str$"):
        a + "x"  # type: ignore[operator]

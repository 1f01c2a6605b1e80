"""The scenarios of docs/behaviour.rst ("Scenarios") as functions over an array namespace.

Each function runs one scenario with any CuPy-like ``xp`` (CuPy with graphpool installed
on the GPU, ``graphpool.sim.xp`` on the simulated device) and returns what it measured.
``python -m graphpool demo`` prints these figures; tests/scenarios asserts them exactly.
Captures run on a side stream that first waits for the current stream; afterwards the
current stream waits for it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import graphpool as gp

SHARING = ("none", "via pool()", "via graph_pool_handle()")
STATS = ("segment", "reserved_bytes", "active", "active_bytes")


def f(t: Any, v: float) -> Any:
    """The scenarios' workload: two temporaries per call, one output."""
    x = t.copy() + v
    y = t.copy() + v
    return x + y


def f5(t: Any, v: float) -> Any:
    """``f`` applied five times, as every capture of the scenarios does."""
    for _ in range(5):
        t = f(t, v)
    return t


def settle() -> None:
    """Collect, synchronize and empty the cache, so figures start from the same place."""
    gc.collect()
    gp.synchronize()
    gp.empty_cache()


def per_elem(arr: Any, n: int) -> float:
    """The sum of ``arr`` divided by ``n`` (waits for the work that makes it)."""
    return float(arr.sum().item()) / n


def first_pool(share: str) -> tuple[Any, ...]:
    """``capture_begin`` arguments of the first graph of a sharing mode."""
    return (gp.graph_pool_handle(),) if share == "via graph_pool_handle()" else ()


def next_pool(share: str, g0: gp.CUDAGraph, first: tuple[Any, ...]) -> tuple[Any, ...]:
    """``capture_begin`` arguments of the later graphs of a sharing mode."""
    return (g0.pool(),) if share == "via pool()" else first


@dataclass
class TwoSuccessive:
    b_per_elem: float  # 3070
    c_per_elem: float  # 442
    reserved: int  # reserved bytes with everything alive


def _capture_two(
    share: str, first: Callable[[], Any], second: Callable[[Any], Any]
) -> tuple[gp.CUDAGraph, gp.CUDAGraph, Any, Any]:
    """Capture g0 running ``first()`` and then g1 running ``second`` on g0's output, on a side
    stream that first waits for the current stream (which then waits for it), their pools
    shared as ``share`` says. Returns (g0, g1, g0's output, g1's output)."""
    s = gp.Stream()
    g0, g1 = gp.CUDAGraph(), gp.CUDAGraph()
    s.wait_stream(gp.current_stream())
    with gp.stream(s):
        pool = first_pool(share)
        g0.capture_begin(*pool)
        out0 = first()
        g0.capture_end()
        g1.capture_begin(*next_pool(share, g0, pool))
        out1 = second(out0)
        g1.capture_end()
    gp.current_stream().wait_stream(s)
    return g0, g1, out0, out1


def two_successive(xp: Any, share: str, n: int = 1000) -> TwoSuccessive:
    """g1 continues g0's work; eager work with replays in between."""
    settle()
    a = xp.ones(n, dtype=xp.float32)
    g0, g1, _, b = _capture_two(share, lambda: f5(a.copy(), 1), lambda b: f5(b, 1))
    c = a.copy()
    for _ in range(2):
        c = f(c, 3)
    g0.replay()
    for _ in range(2):
        c = f(c, 3)
    g1.replay()
    for _ in range(2):
        c = f(c, 3)
    out = TwoSuccessive(per_elem(b, n), per_elem(c, n), gp.memory_reserved())
    gp.check_invariants()
    return out


def concurrent_replay(
    xp: Any, spin: Callable[[gp.Stream], None], share: str, n: int = 1_000_000
) -> tuple[float, float]:
    """Replays of g0 (94 per element) and g1 (156) overlap on two streams; (b, c) per element."""
    settle()
    s0, s1 = gp.Stream(), gp.Stream()
    a = xp.ones(n, dtype=xp.float32)
    g0, g1, b, c = _capture_two(share, lambda: f5(a.copy(), 1), lambda b: f5(a.copy(), 2))
    # Line the replays up behind a long kernel so that they run at the same time.
    gp.synchronize()
    with gp.stream(s0):
        spin(s0)
        s1.wait_stream(s0)
        g0.replay()
    with gp.stream(s1):
        g1.replay()
    gp.current_stream().wait_stream(s0)
    gp.current_stream().wait_stream(s1)
    out = (per_elem(b, n), per_elem(c, n))
    gp.check_invariants()
    return out


def three_graphs(xp: Any, share: str, n: int = 1000) -> dict[str, Any]:
    """g0: b = a.copy(); c = b + 1; d = b + 2. g1: e = c + 3, dropping c. g2: f = d + 4.

    Returns the arrays and graphs by name, for the caller to replay in any order.
    """
    settle()
    s = gp.Stream()
    a = xp.ones(n, dtype=xp.float32)
    g0, g1, g2 = gp.CUDAGraph(), gp.CUDAGraph(), gp.CUDAGraph()
    s.wait_stream(gp.current_stream())
    with gp.stream(s):
        first = first_pool(share)
        g0.capture_begin(*first)
        b = a.copy()
        c = b + 1
        d = b + 2
        g0.capture_end()
        later = next_pool(share, g0, first)
        g1.capture_begin(*later)
        e = c + 3
        del c
        g1.capture_end()
        g2.capture_begin(*later)
        f_ = d + 4
        g2.capture_end()
    gp.current_stream().wait_stream(s)
    return {"a": a, "b": b, "d": d, "e": e, "f": f_, "g0": g0, "g1": g1, "g2": g2, "n": n}


MEMORY_CASES = (
    # numel, pool, segments, reserved MiB after capture, reserved MiB once the graph is gone
    (128, "small_pool", 1, 2, 2),
    (262144, "small_pool", 2, 4, 2),
    (262272, "large_pool", 1, 20, 20),
    (2621312, "large_pool", 2, 40, 20),
    (2621568, "large_pool", 3, 36, 12),
)


@dataclass
class MemoryCase:
    after_capture: list[dict[str, int]]  # STATS deltas, before and after an empty_cache
    b_after_replay: list[float]  # per element, 6
    after_delete: dict[str, int]  # STATS deltas once the graph is deleted
    b_after_delete: float  # per element, 6
    back_to_start: bool  # every level back where it started once a and b are dropped
    start_levels: dict[str, int] | None = None  # the levels compared for back_to_start, before
    end_levels: dict[str, int] | None = None  # and after (a test asserts these, not the flag)


def memory_case(xp: Any, numel: int, pool: str) -> MemoryCase:
    """Capture b = a.copy(), then 5 times b = b.copy() + 1; stats through replay and deletion."""
    settle()
    start = gp.memory_stats()
    s = gp.Stream()
    g = gp.CUDAGraph()
    s.wait_stream(gp.current_stream())
    with gp.stream(s):
        a = xp.ones(numel, dtype=xp.float32)
        pre = gp.memory_stats()
        g.capture_begin()
        b = a.copy()
        for _ in range(5):
            b = b.copy() + 1
        g.capture_end()
    gp.current_stream().wait_stream(s)
    gc.collect()

    def deltas() -> dict[str, int]:
        now = gp.memory_stats()
        return {st: now[f"{st}.{pool}.current"] - pre[f"{st}.{pool}.current"] for st in STATS}

    after_capture, replayed = [], []
    for i in range(2):
        after_capture.append(deltas())
        g.replay()
        replayed.append(per_elem(b, numel))
        if i == 0:
            gp.empty_cache()
    del g
    gc.collect()
    gp.empty_cache()
    after_delete = deltas()
    b_after_delete = per_elem(b, numel)
    gp.check_invariants()
    del a, b
    settle()
    end = gp.memory_stats()
    keys = [
        f"{st}.{p}.current"
        for st in (*STATS, "allocation", "allocated_bytes")
        for p in ("all", "small_pool", "large_pool")
    ]
    start_levels = {k: start[k] for k in keys}
    end_levels = {k: end[k] for k in keys}
    back = end_levels == start_levels
    return MemoryCase(after_capture, replayed, after_delete, b_after_delete, back, start_levels, end_levels)


def hazard(xp: Any, n: int = 1 << 20) -> tuple[int, float, float]:
    """CuPy's #9655: capture t = a * 2; out = t + 1; drop t; then y = full(n, 7) eagerly on the
    same stream and replay. Returns (elements of y overwritten, y's sum, out's sum)."""
    settle()
    s = gp.Stream()
    with gp.stream(s):
        a = xp.ones(n, dtype=xp.float32)
        g = gp.CUDAGraph()
        g.capture_begin()
        t = a * 2
        out = t + 1
        del t
        g.capture_end()
        y = xp.full(n, 7, dtype=xp.float32)
        g.replay()
        s.synchronize()
        wrong = int((y.get() != 7).sum())
        return wrong, float(y.sum().item()), float(out.sum().item())

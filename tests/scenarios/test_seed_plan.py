"""The seed's test plan (SPEC section 7), on the simulator and on the GPU with the same
assertions: CuPy arrays on the GPU, graphpool.sim.xp on the simulator."""

from __future__ import annotations

import gc
from typing import Any

import pytest

import graphpool as gp

MiB = 1 << 20
SHARING = ("none", "via pool()", "via graph_pool_handle()")


def f(t: Any, v: float) -> Any:
    x = t.copy() + v
    y = t.copy() + v
    return x + y


def first_args(share: str) -> tuple[Any, ...]:
    return (gp.graph_pool_handle(),) if share == "via graph_pool_handle()" else ()


def next_args(share: str, g0: gp.CUDAGraph, g0_args: tuple[Any, ...]) -> tuple[Any, ...]:
    return (g0.pool(),) if share == "via pool()" else g0_args


def total(arr: Any) -> float:
    return float(arr.sum().item())


def settle() -> None:
    gc.collect()
    gp.synchronize()
    gp.empty_cache()


def test_two_successive(backend: Any) -> None:
    xp = backend.xp
    size = 1000
    s = gp.Stream()
    settle()
    reserved_no_sharing = None
    for share in SHARING:
        a = xp.ones(size, dtype=xp.float32)
        g0, g1 = gp.CUDAGraph(), gp.CUDAGraph()
        s.wait_stream(gp.current_stream())
        with gp.stream(s):
            g0_args = first_args(share)
            g0.capture_begin(*g0_args)
            b = a.copy()
            for _ in range(5):
                b = f(b, 1)
            g0.capture_end()
            g1.capture_begin(*next_args(share, g0, g0_args))
            for _ in range(5):
                b = f(b, 1)
            g1.capture_end()
        gp.current_stream().wait_stream(s)

        c = a.copy()
        for _ in range(2):
            c = f(c, 3)
        g0.replay()
        for _ in range(2):
            c = f(c, 3)
        g1.replay()
        for _ in range(2):
            c = f(c, 3)

        assert total(b) == size * 3070
        assert total(c) == size * 442
        reserved = gp.memory_stats()["reserved_bytes.all.current"]
        if share == "none":
            reserved_no_sharing = reserved
        else:
            assert reserved_no_sharing is not None
            assert reserved_no_sharing - reserved == 2_097_152
        gp.check_invariants()
        del a, b, c, g0, g1
        settle()


def test_concurrent_replay(backend: Any) -> None:
    xp = backend.xp
    size = 1_000_000
    s = gp.Stream()
    settle()
    for share in SHARING:
        g0, g1 = gp.CUDAGraph(), gp.CUDAGraph()
        s0, s1 = gp.Stream(), gp.Stream()
        a = xp.ones(size, dtype=xp.float32)
        s.wait_stream(gp.current_stream())
        with gp.stream(s):
            g0_args = first_args(share)
            g0.capture_begin(*g0_args)
            b = a.copy()
            for _ in range(5):
                b = f(b, 1)
            g0.capture_end()
            g1.capture_begin(*next_args(share, g0, g0_args))
            c = a.copy()
            for _ in range(5):
                c = f(c, 2)
            g1.capture_end()

        # Line the replays up behind a long kernel so that they run at the same time.
        gp.synchronize()
        with gp.stream(s0):
            backend.spin(s0)
            s1.wait_stream(s0)
            g0.replay()
        with gp.stream(s1):
            g1.replay()
        gp.current_stream().wait_stream(s0)
        gp.current_stream().wait_stream(s1)

        if share == "none":
            assert total(b) == pytest.approx(size * 94, rel=1e-6)
            assert total(c) == pytest.approx(size * 156, rel=1e-6)
        else:
            assert total(b) != pytest.approx(size * 94, rel=1e-3)
            assert total(c) != pytest.approx(size * 156, rel=1e-3)
        gp.check_invariants()
        del a, b, c, g0, g1
        settle()


def _three_graphs(xp: Any, share: str, s: gp.Stream, size: int) -> dict[str, Any]:
    a = xp.ones(size, dtype=xp.float32)
    g0, g1, g2 = gp.CUDAGraph(), gp.CUDAGraph(), gp.CUDAGraph()
    s.wait_stream(gp.current_stream())
    with gp.stream(s):
        g0_args = first_args(share)
        g0.capture_begin(*g0_args)
        b = a.copy()
        c = b + 1
        d = b + 2
        g0.capture_end()
        args = next_args(share, g0, g0_args)
        g1.capture_begin(*args)
        e = c + 3
        del c
        g1.capture_end()
        g2.capture_begin(*args)
        f_ = d + 4
        g2.capture_end()
    gp.current_stream().wait_stream(s)
    return {"a": a, "b": b, "d": d, "e": e, "f": f_, "g0": g0, "g1": g1, "g2": g2}


def test_three_successive(backend: Any) -> None:
    xp = backend.xp
    size = 1000
    s = gp.Stream()
    settle()
    for share in SHARING:
        r = _three_graphs(xp, share, s, size)
        g0, g1, g2 = r["g0"], r["g1"], r["g2"]
        # Capture order is safe.
        g0.replay()
        g1.replay()
        g2.replay()
        assert total(r["e"]) == size * 5
        assert total(r["f"]) == size * 7
        # g0, g2, g1 is safe only without sharing: shared, f took c's memory.
        g0.replay()
        g2.replay()
        g1.replay()
        assert total(r["e"]) == size * (10 if share != "none" else 5)
        assert total(r["f"]) == size * 7
        gp.check_invariants()
        del r, g0, g1, g2
        settle()


@pytest.mark.parametrize("mode", ["raise", "warn"])
def test_three_successive_checker_reports_out_of_order(backend: Any, mode: str) -> None:
    xp = backend.xp
    s = gp.Stream()
    settle()
    gp.set_replay_checks(mode)
    for share in SHARING:
        r = _three_graphs(xp, share, s, 1000)
        g0, g1, g2 = r["g0"], r["g1"], r["g2"]
        for g in (g0, g1, g2, g0, g2):  # capture order, then g0 and g2: nothing to report yet
            g.replay()
        if share == "none":
            g1.replay()
        elif mode == "raise":
            with pytest.raises(gp.ReplayHazardError, match=r"reads .* made by .* overwrote"):
                g1.replay()
        else:
            with pytest.warns(RuntimeWarning, match=r"capture order"):
                g1.replay()
        gp.synchronize()
        del r, g0, g1, g2
        settle()


def test_concurrent_replay_checker_reports_overlap(backend: Any) -> None:
    xp = backend.xp
    size = 100_000
    s = gp.Stream()
    settle()
    gp.set_replay_checks("raise")
    for share in SHARING:
        g0, g1 = gp.CUDAGraph(), gp.CUDAGraph()
        s0, s1 = gp.Stream(), gp.Stream()
        a = xp.ones(size, dtype=xp.float32)
        s.wait_stream(gp.current_stream())
        with gp.stream(s):
            g0_args = first_args(share)
            g0.capture_begin(*g0_args)
            b = f(a.copy(), 1)
            g0.capture_end()
            g1.capture_begin(*next_args(share, g0, g0_args))
            c = f(a.copy(), 2)
            g1.capture_end()
        gp.synchronize()
        with gp.stream(s0):
            backend.spin(s0)
            s1.wait_stream(s0)
            g0.replay()
        with gp.stream(s1):
            if share == "none":
                g1.replay()
            else:
                with pytest.raises(gp.ReplayHazardError, match="may still run"):
                    g1.replay()
            # Ordered after g0, the same replay is fine.
            s1.wait_stream(s0)
            g1.replay()
        gp.synchronize()
        del a, b, c, g0, g1
        settle()


CASES = (
    # numel, segments, reserved MiB after capture, reserved MiB after the graph is gone, pool
    (128, 1, 2, 2, "small_pool"),
    (262144, 2, 4, 2, "small_pool"),
    (262272, 1, 20, 20, "large_pool"),
    (2621312, 2, 40, 20, "large_pool"),
    (2621568, 3, 36, 12, "large_pool"),
)


@pytest.mark.parametrize("numel,segments,reserved,reserved_after,pool", CASES)
def test_memory_stats_and_use_result_after_destroy_graph(
    backend: Any, numel: int, segments: int, reserved: int, reserved_after: int, pool: str
) -> None:
    xp = backend.xp
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
    post = gp.memory_stats()

    def delta(after: dict[str, int], stat: str) -> int:
        key = f"{stat}.{pool}.current"
        return after[key] - pre[key]

    for i in range(2):
        assert delta(post, "segment") == segments
        assert delta(post, "reserved_bytes") == reserved * MiB
        assert delta(post, "active") == 1
        assert delta(post, "active_bytes") == numel * 4
        g.replay()
        assert total(b) == 6 * numel
        if i == 0:
            gp.empty_cache()

    del g
    gc.collect()
    gp.empty_cache()
    postdel = gp.memory_stats()
    assert total(b) == 6 * numel
    assert delta(postdel, "segment") == 1
    assert delta(postdel, "reserved_bytes") == reserved_after * MiB
    assert delta(postdel, "active") == 1
    assert delta(postdel, "active_bytes") == numel * 4
    gp.check_invariants()

    del a, b
    settle()
    end = gp.memory_stats()
    for stat in ("segment", "reserved_bytes", "active", "active_bytes", "allocation", "allocated_bytes"):
        for p in ("all", "small_pool", "large_pool"):
            key = f"{stat}.{p}.current"
            assert end[key] == start[key], key


def test_cupy_hazard_closed(backend: Any) -> None:
    """CuPy's own pool handed a block freed during capture to the next eager array."""
    xp = backend.xp
    n = 1 << 20
    s = gp.Stream()
    settle()
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
        assert total(y) == 7 * n
        assert total(out) == 3 * n
        g.replay()
        assert total(y) == 7 * n
    del a, out, y, g
    settle()

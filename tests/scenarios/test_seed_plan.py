"""The scenarios' test plan (docs/behaviour.rst, "Scenarios"), on the simulator and on the GPU with the same
assertions: CuPy arrays on the GPU, graphpool.sim.xp on the simulator."""

from __future__ import annotations

from typing import Any

import pytest

import graphpool as gp
from graphpool.tools import scenarios
from graphpool.tools.scenarios import MEMORY_CASES, SHARING, f, first_pool, next_pool, settle

MiB = 1 << 20


def total(arr: Any) -> float:
    return float(arr.sum().item())


def test_two_successive(backend: Any) -> None:
    r = {share: scenarios.two_successive(backend.xp, share) for share in SHARING}
    for share in SHARING:
        assert r[share].b_per_elem == 3070
        assert r[share].c_per_elem == 442
    for share in SHARING[1:]:  # sharing a pool saves g1's own small segment
        assert r["none"].reserved - r[share].reserved == 2_097_152
    settle()


def test_concurrent_replay(backend: Any) -> None:
    for share in SHARING:
        b, c = scenarios.concurrent_replay(backend.xp, backend.spin, share)
        if share == "none":
            assert b == pytest.approx(94, rel=1e-6)
            assert c == pytest.approx(156, rel=1e-6)
        else:  # the overlapping replays' temporaries alias: both results are wrong
            assert b != pytest.approx(94, rel=1e-3)
            assert c != pytest.approx(156, rel=1e-3)
        settle()


def test_three_successive(backend: Any) -> None:
    for share in SHARING:
        r = scenarios.three_graphs(backend.xp, share)
        g0, g1, g2, n = r["g0"], r["g1"], r["g2"], r["n"]
        # Capture order is safe.
        g0.replay()
        g1.replay()
        g2.replay()
        assert total(r["e"]) == n * 5
        assert total(r["f"]) == n * 7
        # g0, g2, g1 is safe only without sharing: shared, f took c's memory.
        g0.replay()
        g2.replay()
        g1.replay()
        assert total(r["e"]) == n * (10 if share != "none" else 5)
        assert total(r["f"]) == n * 7
        gp.check_invariants()
        del r, g0, g1, g2
        settle()


@pytest.mark.parametrize("mode", ["raise", "warn"])
def test_three_successive_checker_reports_out_of_order(backend: Any, mode: str) -> None:
    gp.set_replay_checks(mode)
    for share in SHARING:
        r = scenarios.three_graphs(backend.xp, share)
        g0, g1, g2 = r["g0"], r["g1"], r["g2"]
        for g in (g0, g1, g2):  # capture order: nothing to report
            g.replay()
        if share == "none":
            for g in (g0, g2, g1):  # separate pools: any order is safe
                g.replay()
        elif mode == "raise":
            # around the cycle: g0 again overwrites f (g2's output, in c's old block), still referenced
            with pytest.raises(gp.ReplayHazardError, match=r"overwrites .* an output of .* still referenced"):
                g0.replay()
            g2.replay()
            with pytest.raises(gp.ReplayHazardError, match=r"reads .* made by .* overwrote"):
                g1.replay()
        else:
            with pytest.warns(RuntimeWarning, match=r"an output of .* still referenced"):
                g0.replay()
            g2.replay()
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
            g0_args = first_pool(share)
            g0.capture_begin(*g0_args)
            b = f(a.copy(), 1)
            g0.capture_end()
            g1.capture_begin(*next_pool(share, g0, g0_args))
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


@pytest.mark.parametrize("numel,pool,segments,reserved,reserved_after", MEMORY_CASES)
def test_memory_stats_and_use_result_after_destroy_graph(
    backend: Any, numel: int, pool: str, segments: int, reserved: int, reserved_after: int
) -> None:
    r = scenarios.memory_case(backend.xp, numel, pool)
    # before and after an empty_cache: the private pool keeps exactly what the graph needs,
    # and b is its only live block (graphpool allocates nothing of its own at capture)
    for deltas in r.after_capture:
        assert deltas == {
            "segment": segments,
            "reserved_bytes": reserved * MiB,
            "active": 1,
            "active_bytes": numel * 4,
        }
    assert r.b_after_replay == [6, 6]
    # the graph deleted and the cache emptied: b still holds its segment and its value
    assert r.after_delete == {
        "segment": 1,
        "reserved_bytes": reserved_after * MiB,
        "active": 1,
        "active_bytes": numel * 4,
    }
    assert r.b_after_delete == 6
    # every level back where it started: the figures themselves, not scenarios.py's verdict
    assert r.start_levels is not None and r.end_levels is not None
    assert len(r.end_levels) == 6 * 3  # 6 statistics x (all, small_pool, large_pool)
    assert r.end_levels == r.start_levels
    assert r.back_to_start is True


def test_cupy_hazard_closed(backend: Any) -> None:
    """CuPy's own pool handed a block freed during capture to the next eager array."""
    wrong, y_total, out_total = scenarios.hazard(backend.xp)
    n = 1 << 20
    assert (wrong, y_total, out_total) == (0, 7 * n, 3 * n)
    settle()

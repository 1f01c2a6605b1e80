"""The replay checker's plans follow the pool's graphs: a graph works out once what its
replays compare with its pool mates (graphs.py, Note [Replay plans]), and works it out again
when a mate is captured into the pool, reset, captured again, or collected.

Each test makes g's plan first (g replays while its mates are some set), then changes the
mates and checks that g's next replay reports what a checker without plans would. The
`backend` fixture runs each test on the simulator and, marked gpu, on a real GPU.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
from scenario_common import settle

import graphpool as gp
from graphpool import runtime

N = 1 << 16  # bytes


def _capture(g: gp.CUDAGraph, pool: Any, s: gp.Stream, keep: bool) -> gp.DeviceBuffer | None:
    """Capture into ``g`` one allocation of N bytes on ``s``, freed during the capture (a
    temporary: the pool's next capture is handed its memory) unless ``keep``, then one memset."""
    dev = runtime.get().device(s.device)
    with gp.stream(s):
        g.capture_begin(pool)
        buf = gp.alloc(N, s)
        dev.memset(buf.ptr, 0, N, s.handle)
        if not keep:
            buf.free()
        g.capture_end()
    return buf if keep else None


def _empty(g: gp.CUDAGraph, pool: Any, s: gp.Stream, target: gp.DeviceBuffer) -> None:
    """Capture into ``g`` one memset of ``target`` and no allocation: a mate that meets no one."""
    dev = runtime.get().device(s.device)
    with gp.stream(s):
        g.capture_begin(pool)
        dev.memset(target.ptr, 1, target.nbytes, s.handle)
        g.capture_end()


def test_a_mate_captured_after_the_plan_is_checked(backend: Any) -> None:
    """g's plan is made while its only mate meets nothing; h, captured after, is handed g's
    temporary for its output: g replaying after h is reported."""
    settle()
    gp.set_replay_checks("raise")
    pool, s = gp.graph_pool_handle(), gp.Stream()
    target = gp.alloc(N, s)
    g, quiet, h = gp.CUDAGraph(), gp.CUDAGraph(), gp.CUDAGraph()
    _capture(g, pool, s, keep=False)
    _empty(quiet, pool, s, target)
    with gp.stream(s):
        g.replay()
        quiet.replay()
        g.replay()  # the plan: quiet only
    out = _capture(h, pool, s, keep=True)
    with gp.stream(s):
        h.replay()
        with pytest.raises(gp.ReplayHazardError, match=f"replays after {h.label} and overwrites"):
            g.replay()
    gp.synchronize()
    del out, target, g, quiet, h
    settle()


def test_a_mate_reset_after_the_plan_is_not_checked_and_captured_again_is(backend: Any) -> None:
    """h's output lives in g's temporary. Once h is reset it is no mate of g's: g replaying
    after it reports nothing, though h is alive and its output still referenced. h captured
    again into the pool (the same object) is a mate again, with its new output."""
    settle()
    gp.set_replay_checks("raise")
    pool, s = gp.graph_pool_handle(), gp.Stream()
    target = gp.alloc(N, s)
    g, h, quiet = gp.CUDAGraph(), gp.CUDAGraph(), gp.CUDAGraph()
    _capture(g, pool, s, keep=False)
    out = _capture(h, pool, s, keep=True)
    _empty(quiet, pool, s, target)  # g keeps a mate when h is reset: its replays stay checked
    with gp.stream(s):
        g.replay()  # the plan: h's output is in g's footprint
        h.replay()
        with pytest.raises(gp.ReplayHazardError, match=f"replays after {h.label} and overwrites"):
            g.replay()
        h.replay()
    h.reset()
    with gp.stream(s):
        g.replay()  # h is no mate any more: nothing to report
    assert out is not None
    out.free()
    again = _capture(h, pool, s, keep=True)  # handed g's temporary again
    with gp.stream(s):
        h.replay()
        with pytest.raises(gp.ReplayHazardError, match=f"replays after {h.label} and overwrites"):
            g.replay()
    gp.synchronize()
    del again, target, g, h, quiet
    settle()


def test_a_collected_mate_is_freed_and_no_longer_checked(backend: Any) -> None:
    """g's plan names h, whose output lives in g's temporary. Dropping h collects it at once
    (the plan holds no reference to it); g's next replay reports nothing and plans without h."""
    settle()
    gp.set_replay_checks("raise")
    pool, s = gp.graph_pool_handle(), gp.Stream()
    target = gp.alloc(N, s)
    g, h, quiet = gp.CUDAGraph(), gp.CUDAGraph(), gp.CUDAGraph()
    _capture(g, pool, s, keep=False)
    out = _capture(h, pool, s, keep=True)
    _empty(quiet, pool, s, target)
    with gp.stream(s):
        g.replay()
        h.replay()
        with pytest.raises(gp.ReplayHazardError, match=f"replays after {h.label} and overwrites"):
            g.replay()
        h.replay()
    assert g._plan is not None and len(g._plan.others) == 2
    gone = weakref.ref(h)
    del h
    assert gone() is None  # collected by its reference count: nothing else holds it
    with gp.stream(s):
        g.replay()  # its output is still referenced, but h is gone
    assert len(g._plan.others) == 1  # made again without h
    gp.synchronize()
    del out, target, g, quiet
    gc.collect()
    settle()

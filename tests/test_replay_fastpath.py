"""CUDAGraph.replay's fast path (checker off): the thread's current stream as gp.alloc keeps
it, and the backend check skipped only while no set_backend ran since the last replay."""

from __future__ import annotations

from typing import Any

import pytest

import graphpool as gp
from graphpool import runtime


def _graph(s: gp.Stream) -> tuple[gp.CUDAGraph, gp.DeviceBuffer]:
    dev = runtime.get().device(s.device)
    buf = gp.alloc(4096, s)
    g = gp.CUDAGraph()
    with gp.stream(s):
        g.capture_begin()
        dev.memset(buf.ptr, 1, buf.nbytes, s.handle)
        g.capture_end()
    return g, buf


def test_replay_launches_on_the_current_stream_each_time(sim: Any) -> None:
    s, s2 = gp.Stream(), gp.Stream()
    g, buf = _graph(s)
    dev = runtime.get().device(0)
    launched: list[int] = []
    real = dev.launch

    def launch(exe: int, stream: int) -> None:
        launched.append(stream)
        real(exe, stream)

    dev.launch = launch  # type: ignore[method-assign]
    try:
        g.replay()  # the slow path first (the backend checked), then the fast one
        g.replay()
        with gp.stream(s2):
            g.replay()
            g.replay()
        g.replay()
    finally:
        del dev.launch
    legacy = gp.default_stream().handle
    assert launched == [legacy, legacy, s2.handle, s2.handle, legacy]
    assert {legacy, s2.handle} <= g._rec.replay_streams  # type: ignore[union-attr]
    gp.synchronize()
    buf.free()
    g.reset()


def test_replay_after_set_backend_is_refused_even_after_fast_replays(sim: Any) -> None:
    g, _buf = _graph(gp.Stream())
    g.replay()
    g.replay()  # fast: the backend was checked by the first replay, under this runtime
    gp.set_backend("sim")
    with pytest.raises(gp.BackendReplacedError, match="set_backend"):
        g.replay()


def test_replay_on_another_current_device_uses_the_graphs_device(sim: Any) -> None:
    """The fast path serves the thread's current device only; a graph of device 0 replayed
    while device 1 is current goes to device 0's current stream."""
    g, buf = _graph(gp.Stream())
    with gp.device(1):
        s1 = gp.Stream()
        with gp.stream(s1):
            g.replay()
            g.replay()
    assert g._rec.replay_streams == {gp.default_stream(0).handle}  # type: ignore[union-attr]
    gp.synchronize()
    buf.free()
    g.reset()


def test_the_checker_leaves_the_fast_path_to_a_graph_alone_in_its_pool(sim: Any, monkeypatch: Any) -> None:
    """With the checker on, a graph with no pool mate replays on the fast path after its first
    (checked) replay, and runs no check; once a mate captures into its pool, each replay of
    either runs the checks (the first of g1 on the slow path, which checks the backend).
    With the checker off, graphs sharing a pool take the fast path, unchecked."""
    from graphpool import graphs

    slow: list[gp.CUDAGraph] = []
    checked: list[gp.CUDAGraph] = []
    real = gp.CUDAGraph._replay_slow
    real_check = graphs._check_replay

    def counted(self: gp.CUDAGraph) -> None:
        slow.append(self)
        real(self)

    def counted_check(g: gp.CUDAGraph, s: gp.Stream) -> None:
        checked.append(g)
        real_check(g, s)

    monkeypatch.setattr(gp.CUDAGraph, "_replay_slow", counted)
    monkeypatch.setattr(graphs, "_check_replay", counted_check)
    s = gp.Stream()
    dev = runtime.get().device(s.device)
    g0, buf = _graph(s)
    g1 = gp.CUDAGraph()
    try:
        gp.set_replay_checks("raise")
        with gp.stream(s):
            for _ in range(3):
                g0.replay()
            assert slow == [g0]  # the first replay checks the backend; then the fast path
            assert checked == [g0]  # (alone: the checks find no mate)
            g1.capture_begin(g0.pool())
            dev.memset(buf.ptr, 2, buf.nbytes, s.handle)
            g1.capture_end()
            slow.clear()
            checked.clear()
            for _ in range(2):
                g0.replay()
                g1.replay()
            assert slow == [g1]  # g1's first replay
            assert checked == [g0, g1, g0, g1]  # mates: every replay is checked
            gp.set_replay_checks("off")
            slow.clear()
            checked.clear()
            for _ in range(2):
                g0.replay()
                g1.replay()
            assert slow == [] and checked == []  # the checker off: the fast path, unchecked
    finally:
        gp.set_replay_checks("off")
    gp.synchronize()
    buf.free()
    g0.reset()
    g1.reset()


def test_the_c_launch_checks_its_arguments() -> None:
    """The compiled build's C launch (device/_capture.c) refuses bad arguments with TypeError."""
    try:
        from graphpool.device import _capture  # type: ignore[attr-defined]
    except ImportError:
        pytest.skip("plain-Python install: no C module")
    with pytest.raises(TypeError, match="takes 3 arguments"):
        _capture.graph_launch(1, 2)
    with pytest.raises(TypeError, match="exec must be an int handle"):
        _capture.graph_launch("x", 0, 0)
    with pytest.raises(OverflowError):
        _capture.graph_launch(-1, 0, 0)

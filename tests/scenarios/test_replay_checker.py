"""The replay checker at its edges: pool mates that never replayed, inputs whose producer
is gone, and the checker turned off again.

The `backend` fixture runs each test on the simulator and, marked gpu, on a real GPU.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
from scenario_common import settle

import graphpool as gp
from graphpool.errors import CUDAError
from graphpool.tools import scenarios

N = 1000


def test_no_report_while_the_pool_mates_never_replayed(backend: Any) -> None:
    """g1 reads c (made by g0) and drops it; g2 is then handed c's memory. Replaying g1
    before g0 or g2 ever ran reports nothing: no replay has overwritten c."""
    xp = backend.xp
    settle()
    gp.set_replay_checks("raise")
    pool = gp.graph_pool_handle()
    s = gp.Stream()
    a = xp.ones(N, dtype=xp.float32)
    g0, g1, g2 = gp.CUDAGraph(), gp.CUDAGraph(), gp.CUDAGraph()
    s.wait_stream(gp.current_stream())
    with gp.stream(s):
        g0.capture_begin(pool)
        c = a + 1
        g0.capture_end()
        g1.capture_begin(pool)
        e = c + 3
        del c
        g1.capture_end()
        g2.capture_begin(pool)
        f = a + 4
        g2.capture_end()
    gp.current_stream().wait_stream(s)
    g1.replay()  # nothing replayed before it
    g0.replay()
    g2.replay()  # overwrites c after g0 made it ...
    with pytest.raises(gp.ReplayHazardError, match=r"reads .* made by .* overwrote"):
        g1.replay()  # ... which g1 reads: reported now
    gp.synchronize()
    del e, f, g0, g1, g2
    settle()


@pytest.mark.parametrize("gone", ["first producer", "second producer"])
def test_an_overwritten_input_is_reported_when_another_inputs_producer_is_gone(
    backend: Any, gone: str
) -> None:
    """gc reads x (made by ga) and y (made by gb); both are dropped after, and gd is handed
    their memory. One producer is reset: the other input, overwritten by gd's replay after
    its producer's, is still reported, whichever input the checker looks at first."""
    xp = backend.xp
    settle()
    gp.set_replay_checks("raise")
    pool = gp.graph_pool_handle()
    s = gp.Stream()
    a = xp.ones(N, dtype=xp.float32)
    ga, gb, gc, gd = (gp.CUDAGraph() for _ in range(4))
    s.wait_stream(gp.current_stream())
    with gp.stream(s):
        ga.capture_begin(pool)
        x = a + 1
        ga.capture_end()
        gb.capture_begin(pool)
        y = a + 2
        gb.capture_end()
        gc.capture_begin(pool)
        z = x + y
        gc.capture_end()
        del x, y
        gd.capture_begin(pool)
        w = [a + 3, a + 4]
        gd.capture_end()
    gp.current_stream().wait_stream(s)
    ga.replay()
    gb.replay()
    gd.replay()  # overwrites x and y after both producers ran
    (ga if gone == "first producer" else gb).reset()
    with pytest.raises(gp.ReplayHazardError, match=r"reads .* made by .* overwrote"):
        gc.replay()
    gp.synchronize()
    del z, w, ga, gb, gc, gd
    settle()


def test_turning_the_checker_off_silences_it(backend: Any) -> None:
    """A hazard the checker reports ("raise") goes unreported once it is "off" again."""
    xp = backend.xp
    settle()
    r = scenarios.three_graphs(xp, "via graph_pool_handle()")
    g0, g1, g2 = r["g0"], r["g1"], r["g2"]
    gp.set_replay_checks("raise")
    for g in (g0, g1, g2):  # capture order: nothing to report
        g.replay()
    with pytest.raises(gp.ReplayHazardError):
        g0.replay()  # around the cycle: overwrites g2's output, still referenced
    gp.set_replay_checks("off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        g0.replay()  # the same hazard: no error, no warning
        g2.replay()
        g1.replay()
    gp.synchronize()
    del r, g0, g1, g2
    settle()


def test_every_pool_mate_that_replayed_after_is_checked(backend: Any) -> None:
    """g drops two temporaries that P and Q are then handed for their outputs. Replaying g
    after one of them is reported whatever the other did: a mate that last replayed before
    g does not end the search (both roles are played by each, whatever order the checker
    visits them in)."""
    xp = backend.xp
    settle()
    gp.set_replay_checks("warn")
    pool = gp.graph_pool_handle()
    s = gp.Stream()
    a = xp.ones(N, dtype=xp.float32)
    g, p_graph, q_graph = gp.CUDAGraph(), gp.CUDAGraph(), gp.CUDAGraph()
    s.wait_stream(gp.current_stream())
    with gp.stream(s):
        g.capture_begin(pool)
        t1 = a + 1
        t2 = a + 2
        out = t1 + t2
        del t1, t2  # back to the pool: P and Q are handed this memory
        g.capture_end()
        p_graph.capture_begin(pool)
        p = a + 3
        p_graph.capture_end()
        q_graph.capture_begin(pool)
        q = a + 4
        q_graph.capture_end()
    gp.current_stream().wait_stream(s)

    def replay(graph: gp.CUDAGraph) -> list[str]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            graph.replay()
        return [str(w.message) for w in seen]

    assert replay(g) == []
    for later in (q_graph, p_graph, q_graph):  # the other one last replayed before g did
        assert replay(later) == []
        said = replay(g)
        assert len(said) == 1 and f"replays after {later.label} and overwrites" in said[0], said
    gp.synchronize()
    del out, p, q, g, p_graph, q_graph
    settle()


def test_a_replay_into_another_capture_leaves_the_checker_working(sim: Any) -> None:
    """With the checker on, a replay records an event on its stream to tell when it is done.
    A replay launched into another capture put that event into the capture: CUDA cannot
    query it after, so the next replay of a pool mate on another stream raised
    cudaErrorCapturedEvent. No event goes on a capturing stream. (CUDA 13, and the simulator,
    refuse the launch itself; the checker must keep working after that refusal too.)"""
    from graphpool.sim import xp

    settle()
    gp.set_replay_checks("raise")
    pool = gp.graph_pool_handle()
    s = gp.Stream()
    g0, g1 = gp.CUDAGraph(), gp.CUDAGraph()
    with gp.graph(g0, pool=pool, stream=s):
        a = xp.ones(N, dtype=xp.float32) + 1
    with gp.graph(g1, pool=pool, stream=s):
        b = xp.ones(N, dtype=xp.float32) + 2
    outer = gp.CUDAGraph()
    with pytest.raises(CUDAError, match="cudaErrorStreamCaptureUnsupported"):
        with gp.graph(outer):
            g0.replay()  # into outer's capture: refused
    with gp.stream(gp.Stream()):
        g1.replay()  # asks whether g0's last replay is done
    gp.synchronize()
    assert float(b.sum().item()) == 3.0 * N
    del a, b, g0, g1, outer
    settle()


def _lone_graph_with_a_temporary(xp: Any) -> tuple[Any, ...]:
    """(pool, s, s0, s1, a, g0, g1): g0 captured on s into a new shared pool, where it drops
    a temporary (its memory is the next graph's to reuse); g1 made, not captured yet."""
    pool = gp.graph_pool_handle()
    s, s0, s1 = gp.Stream(), gp.Stream(), gp.Stream()
    a = xp.ones(N, dtype=xp.float32)
    g0, g1 = gp.CUDAGraph(), gp.CUDAGraph()
    s.wait_stream(gp.current_stream())
    with gp.stream(s):
        g0.capture_begin(pool)
        b = a + 1
        del b
        g0.capture_end()
    return pool, s, s0, s1, a, g0, g1


def _g1_joins_and_waits_for_g0(pool: Any, s: Any, s0: Any, s1: Any, a: Any, g1: Any) -> None:
    """g1 captures ``a + 2`` on s into g0's pool and replays on s1: reported while g0 may still
    run on s0, accepted once s1 waits for s0; the result is right."""
    with gp.stream(s):
        g1.capture_begin(pool)
        c = a + 2
        g1.capture_end()
    s1.wait_stream(s)
    with gp.stream(s1):
        with pytest.raises(gp.ReplayHazardError, match="may still run"):
            g1.replay()
        s1.wait_stream(s0)
        g1.replay()
    gp.synchronize()
    assert float(c.sum().item()) == 3.0 * N


def test_a_graph_that_replayed_alone_is_waited_for_once_a_mate_joins(backend: Any) -> None:
    """A graph alone in its pool replays with the checker on without recording when it is
    done (no mate can ask). g0 replays on a busy stream while alone; g1 then captures into its
    pool and replays on another stream: g0 may still run there, so that is reported, and the
    same replay ordered after g0's stream is not."""
    xp = backend.xp
    settle()
    gp.set_replay_checks("raise")
    pool, s, s0, s1, a, g0, g1 = _lone_graph_with_a_temporary(xp)
    s0.wait_stream(s)
    with gp.stream(s0):
        backend.spin(s0)
        g0.replay()  # alone: nothing asks when it is done
    _g1_joins_and_waits_for_g0(pool, s, s0, s1, a, g1)
    del a, g0, g1
    settle()


@pytest.mark.parametrize("wait", ["stream", "event", "device", "none"])
def test_a_mate_the_host_waited_for_is_finished_however_late_its_event(backend: Any, wait: str) -> None:
    """g0 replays alone on s0 (no done event); the host waits for it (``s0.synchronize()``, an
    event recorded after it, or ``gp.synchronize()``); slow work is queued on s0 after; g1
    joins the pool and replays on s1. g0's late event stands behind the slow work, but the
    host saw g0 finish: nothing is reported. Without the wait, g0 may still run: reported."""
    xp = backend.xp
    settle()
    gp.set_replay_checks("raise")
    pool, s, s0, s1, a, g0, g1 = _lone_graph_with_a_temporary(xp)
    s0.wait_stream(s)
    with gp.stream(s0):
        g0.replay()  # alone: nothing asks when it is done
        done = s0.record_event()
    if wait == "stream":
        s0.synchronize()
    elif wait == "event":
        done.synchronize()
    elif wait == "device":
        gp.synchronize()
    backend.spin(s0)  # later work on s0, still running when g1 asks about g0
    with gp.stream(s):
        g1.capture_begin(pool)
        c = a + 2
        g1.capture_end()
    s1.wait_stream(s)
    with gp.stream(s1):
        if wait == "none":
            with pytest.raises(gp.ReplayHazardError, match="may still run"):
                g1.replay()
            s1.wait_stream(s0)
        g1.replay()
    gp.synchronize()
    assert float(c.sum().item()) == 3.0 * N
    del a, c, g0, g1
    settle()


def _count_calls(monkeypatch: Any, dev: Any, name: str, calls: list[str]) -> None:
    """Append ``name`` to ``calls`` at each call of ``dev.<name>`` (which still runs)."""
    real = getattr(dev, name)

    def counted(*args: Any) -> Any:
        calls.append(name)
        return real(*args)

    monkeypatch.setattr(dev, name, counted)


def test_replays_on_one_stream_record_no_event(sim: Any, monkeypatch: Any) -> None:
    """The checker's cost for a graph alone in its pool, or for a pool whose graphs all
    replay on one stream, is its bookkeeping, not a device call: no event is recorded and no
    capture is asked about on replay (stream order answers every question). The pool's first
    replay on a second stream records the mates' events then, and each replay one from then on."""
    from graphpool import runtime
    from graphpool.sim import xp

    settle()
    gp.set_replay_checks("raise")
    s, other = gp.Stream(), gp.Stream()
    g0, g1 = gp.CUDAGraph(), gp.CUDAGraph()
    with gp.graph(g0, stream=s):
        a = xp.ones(N, dtype=xp.float32) + 1
    dev = runtime.get().device(s.device)
    calls: list[str] = []
    for name in ("record_event", "capture_id"):
        _count_calls(monkeypatch, dev, name, calls)
    with gp.stream(s):
        for _ in range(3):
            g0.replay()  # alone in its pool
    with gp.graph(g1, pool=g0.pool(), stream=s):
        b = xp.ones(N, dtype=xp.float32) + 2
    with gp.stream(s):
        for _ in range(3):
            g0.replay()  # a shared pool, one stream
            g1.replay()
    assert calls == []
    other.wait_stream(s)  # (records an event of its own)
    calls.clear()
    with gp.stream(other):
        g1.replay()  # the pool's first replay on a second stream
    assert calls.count("record_event") == 2  # g0's last replay, late; then g1's own
    gp.synchronize()  # (records nothing)
    calls.clear()
    with gp.stream(s):
        g0.replay()
    assert calls.count("record_event") == 1
    gp.synchronize()
    del a, b, g0, g1
    settle()


def test_a_collected_or_reset_mate_leaves_the_pool(sim: Any, monkeypatch: Any) -> None:
    """A pool mate that is reset or collected no longer counts: the graph left alone replays
    with no event again, and the checker keeps nothing of pools whose graphs are all gone."""
    import gc

    from graphpool import graphs, runtime
    from graphpool.sim import xp

    settle()
    gp.set_replay_checks("raise")
    pools_before, multi_before = len(graphs._by_pool), len(graphs._streams_of)
    s, other = gp.Stream(), gp.Stream()
    g0, g1, g2 = gp.CUDAGraph(), gp.CUDAGraph(), gp.CUDAGraph()
    with gp.graph(g0, stream=s):
        a = xp.ones(N, dtype=xp.float32) + 1
    for g in (g1, g2):
        with gp.graph(g, pool=g0.pool(), stream=s):
            a += 1
    with gp.stream(s):
        g0.replay()
    with gp.stream(other):
        other.wait_stream(s)
        g1.replay()  # the pool's second stream: its replays record events from now on
    gp.synchronize()
    dev = runtime.get().device(s.device)
    calls: list[str] = []
    _count_calls(monkeypatch, dev, "record_event", calls)
    with gp.stream(s):
        g0.replay()
    assert calls == ["record_event"]
    g1.reset()
    del g2, g
    gc.collect()
    calls.clear()
    with gp.stream(other):
        other.wait_stream(s)
        calls.clear()
        g0.replay()  # alone again
    assert calls == []
    key = g0._pool_key
    assert key in graphs._by_pool and key in graphs._streams_of
    g0.reset()
    assert key not in graphs._by_pool and key not in graphs._streams_of
    # (no more than before: a registration in between may have swept earlier tests' empty pools)
    assert len(graphs._by_pool) <= pools_before and len(graphs._streams_of) <= multi_before
    gp.synchronize()
    del a, g0, g1
    settle()


def test_new_graphs_of_a_pool_whose_first_graphs_are_gone_are_still_waited_for(backend: Any) -> None:
    """A pool whose first graphs replayed on two streams and were collected: the next graphs
    captured into it start alone again. One replays alone on a busy stream (no event); its
    mate replaying on another stream is still told it may run."""
    import gc

    xp = backend.xp
    settle()
    gp.set_replay_checks("raise")
    pool = gp.graph_pool_handle()
    s, s0, s1 = gp.Stream(), gp.Stream(), gp.Stream()
    a = xp.ones(N, dtype=xp.float32)
    s.wait_stream(gp.current_stream())
    old = [gp.CUDAGraph(), gp.CUDAGraph()]
    with gp.stream(s):
        for g in old:
            g.capture_begin(pool)
            y = a + 7
            g.capture_end()
            del y
    s0.wait_stream(s)
    with gp.stream(s0):
        old[0].replay()
    s1.wait_stream(s0)
    with gp.stream(s1):
        old[1].replay()  # the pool's graphs on two streams, in order
    gp.synchronize()
    del old, g
    gc.collect()
    g0, g1 = gp.CUDAGraph(), gp.CUDAGraph()
    with gp.stream(s):
        g0.capture_begin(pool)
        b = a + 1
        del b
        g0.capture_end()
    s0.wait_stream(s)
    with gp.stream(s0):
        g0.replay()
        s0.synchronize()
        backend.spin(s0)
        g0.replay()  # alone: no event; the one of its first replay is complete
    with gp.stream(s):
        g1.capture_begin(pool)
        c = a + 2
        g1.capture_end()
    s1.wait_stream(s)
    with gp.stream(s1), pytest.raises(gp.ReplayHazardError, match="may still run"):
        g1.replay()
    gp.synchronize()
    del a, c, g0, g1
    settle()


def test_a_mate_whose_stream_captures_when_marked_late_is_taken_to_run(sim: Any) -> None:
    """The pool's first replay on a second stream marks the mates' last replays; a mate whose
    stream is capturing another graph then cannot get an event (it would join that capture),
    so it is taken to be still running: reported, not passed over."""
    from graphpool import runtime
    from graphpool.sim import xp

    settle()
    gp.set_replay_checks("raise")
    pool = gp.graph_pool_handle()
    s, s0, s1 = gp.Stream(), gp.Stream(), gp.Stream()
    a = xp.ones(N, dtype=xp.float32)
    g0, g1, gz = gp.CUDAGraph(), gp.CUDAGraph(), gp.CUDAGraph()
    s.wait_stream(gp.current_stream())
    with gp.stream(s):
        g0.capture_begin(pool)
        b = a + 1
        del b
        g0.capture_end()
        g1.capture_begin(pool)
        c = a + 2
        g1.capture_end()
    s0.wait_stream(s)
    with gp.stream(s0):
        runtime.get().device(s0.device).launch_sleep(s0.handle, rounds=50)  # type: ignore[attr-defined]
        g0.replay()  # a one-stream pool so far: no event
        gz.capture_begin(capture_error_mode="relaxed")  # s0 captures another graph now
    s1.wait_stream(s)
    with gp.stream(s1), pytest.raises(gp.ReplayHazardError, match="may still run"):
        g1.replay()
    with gp.stream(s0):
        d = a + 3
        gz.capture_end()
    gp.synchronize()
    del a, c, d, g0, g1, gz
    settle()


def test_mates_collected_on_one_thread_while_another_replays(sim: Any) -> None:
    """Pool mates dropped on one thread (their weak references' callbacks edit the pool's
    mates) while another thread replays a graph of that pool with the checker on: every
    replay runs its checks, none fails."""
    import sys
    import threading

    settle()
    gp.set_replay_checks("warn")
    pool = gp.graph_pool_handle()
    s, sr = gp.Stream(), gp.Stream()

    def make(n: int) -> list[gp.CUDAGraph]:
        out = []
        with gp.stream(s):
            for _ in range(n):
                g = gp.CUDAGraph()
                g.capture_begin(pool)
                g.capture_end()
                out.append(g)
        return out

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the graphs capture no work
        g0 = make(1)[0]
        errors: list[str] = []
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)

        def replayer(graph: gp.CUDAGraph, stop: threading.Event) -> None:
            try:
                with gp.stream(sr):
                    while not stop.is_set():
                        graph.replay()
            except Exception as e:  # recorded: the assertion below names it
                errors.append(repr(e))

        try:
            for _ in range(3):
                graphs = make(300)
                stop = threading.Event()
                t = threading.Thread(target=replayer, args=(g0, stop))
                t.start()
                while graphs:
                    graphs.pop()  # the last reference: the callback runs on this thread
                stop.set()
                t.join()
        finally:
            sys.setswitchinterval(interval)
    assert errors == []
    gp.synchronize()
    del g0
    settle()


def test_the_checker_keeps_no_pool_whose_graphs_were_collected(sim: Any) -> None:
    """Graphs collected without a reset leave their pool's entry empty; registering later
    graphs drops such entries, so the checker's records stay bounded by the live pools."""
    import gc

    from graphpool import graphs

    settle()
    s = gp.Stream()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the graphs capture no work
        for _ in range(300):
            g = gp.CUDAGraph()
            with gp.stream(s):
                g.capture_begin()
                g.capture_end()
            del g
            gc.collect(0)
    assert sum(1 for v in graphs._by_pool.values() if not v) < 130
    assert len(graphs._by_pool) < 200
    settle()


def test_a_replay_on_another_librarys_stream_records_its_event_at_once(sim: Any, monkeypatch: Any) -> None:
    """A graph alone in its pool replaying on another library's stream (``__cuda_stream__``)
    records its event at once, as every replay did before: that library may destroy its
    stream (cuda.core's ``close()``) before a mate asks, and no event may go on a destroyed
    handle later. On graphpool's own streams, which it never destroys, none is recorded."""
    from graphpool import runtime
    from graphpool.sim import xp

    class Foreign:
        def __init__(self, handle: int) -> None:
            self.handle = handle

        def __cuda_stream__(self) -> tuple[int, int]:
            return (0, self.handle)

    settle()
    gp.set_replay_checks("raise")
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.graph(g, stream=s):
        a = xp.ones(N, dtype=xp.float32) + 1
    calls: list[str] = []
    _count_calls(monkeypatch, runtime.get().device(s.device), "record_event", calls)
    with gp.stream(s):
        g.replay()
        g.replay()
    assert calls == []
    with gp.stream(Foreign(gp.Stream().handle)):
        g.replay()
        g.replay()
    assert calls == ["record_event", "record_event"]
    gp.synchronize()
    del a, g
    settle()


def test_a_mates_second_replay_on_a_busy_stream_is_not_covered_by_a_wait_for_its_first(
    backend: Any,
) -> None:
    """The checker's order counts each replay on a stream: s1 waited for g0's first replay on
    s0, not for its second one, queued behind work still running; g1 replaying on s1 then
    may meet g0 (g1 is handed g0's temporary) and is reported."""
    xp = backend.xp
    settle()
    gp.set_replay_checks("raise")
    pool, s, s0, s1, a, g0, g1 = _lone_graph_with_a_temporary(xp)
    with gp.stream(s):
        g1.capture_begin(pool)
        c = a + 2
        g1.capture_end()
    s0.wait_stream(s)
    s1.wait_stream(s)
    with gp.stream(s0):
        g0.replay()
    s1.wait_stream(s0)  # ordered after g0's first replay ...
    with gp.stream(s0):
        backend.spin(s0)
        g0.replay()  # ... not after this one
    with gp.stream(s1):
        with pytest.raises(gp.ReplayHazardError, match="may still run"):
            g1.replay()
        s1.wait_stream(s0)
        g1.replay()
    gp.synchronize()
    assert float(c.sum().item()) == 3.0 * N
    del a, c, g0, g1
    settle()


def test_a_lone_graphs_fast_replays_count_in_the_checkers_order(backend: Any) -> None:
    """g0, alone in its pool, replays twice on s0: the first replay is the checked one, the
    second takes the fast path, behind work still running. s1 waited for the first only, so
    when g1 joins the pool (handed g0's temporary) and replays on s1, that is reported."""
    xp = backend.xp
    settle()
    gp.set_replay_checks("raise")
    pool, s, s0, s1, a, g0, g1 = _lone_graph_with_a_temporary(xp)
    s0.wait_stream(s)
    with gp.stream(s0):
        g0.replay()
    s1.wait_stream(s0)  # ordered after g0's first replay ...
    with gp.stream(s0):
        backend.spin(s0)
        g0.replay()  # ... not after this one (the fast path: g0 is alone)
    _g1_joins_and_waits_for_g0(pool, s, s0, s1, a, g1)
    del a, g0, g1
    settle()


def test_replays_with_the_checker_off_leave_it_nothing_to_mark(sim: Any, monkeypatch: Any) -> None:
    """With the checker off a replay is a launch and nothing else: when a mate joins the pool
    later, no done event is recorded for the earlier replays."""
    from graphpool import runtime
    from graphpool.sim import xp

    settle()
    s = gp.Stream()
    g0, g1 = gp.CUDAGraph(), gp.CUDAGraph()
    with gp.graph(g0, stream=s):
        a = xp.ones(N, dtype=xp.float32) + 1
    with gp.stream(s):
        for _ in range(3):
            g0.replay()
    dev = runtime.get().device(s.device)
    calls: list[int] = []
    real = dev.record_event
    monkeypatch.setattr(dev, "record_event", lambda *args: (calls.append(1), real(*args))[1])
    with gp.graph(g1, pool=g0.pool(), stream=s):
        b = xp.ones(N, dtype=xp.float32) + 2
    assert calls == []
    gp.synchronize()
    del a, b, g0, g1
    settle()


def test_a_mate_joining_while_the_lone_graphs_stream_captures_leaves_the_checker_working(
    sim: Any,
) -> None:
    """g0 replayed alone on s0, so its done event is recorded only when g1 joins its pool.
    g1's capture ends while s0 is capturing another graph: the event cannot go on s0 then (it
    would become part of that capture, and CUDA refuses to query it after), so a later replay
    of g1 on another stream must still be able to ask about g0."""
    from graphpool.sim import xp

    settle()
    gp.set_replay_checks("raise")
    pool = gp.graph_pool_handle()
    s, s0, s1 = gp.Stream(), gp.Stream(), gp.Stream()
    g0, g1, outer = gp.CUDAGraph(), gp.CUDAGraph(), gp.CUDAGraph()
    with gp.graph(g0, pool=pool, stream=s):
        a = xp.ones(N, dtype=xp.float32) + 1
    s0.wait_stream(s)
    with gp.stream(s0):
        g0.replay()  # alone: no event yet
    with gp.graph(outer, stream=s0, capture_error_mode="relaxed"):
        c = xp.ones(N, dtype=xp.float32)
        with gp.graph(g1, pool=pool, stream=s1, capture_error_mode="relaxed"):
            b = xp.ones(N, dtype=xp.float32) + 2  # g1 joins g0's pool while s0 captures
    gp.synchronize()
    with gp.stream(gp.Stream()):
        g1.replay()  # asks whether g0's last replay is done
    gp.synchronize()
    assert float(b.sum().item()) == 3.0 * N
    del a, b, c, g0, g1, outer
    settle()


def test_the_checker_on_another_device_than_the_current_one(sim: Any) -> None:
    """The done events belong to the graphs' device, not to the device current at replay:
    two graphs of device 1 sharing a pool replay with device 0 current, checked."""
    from graphpool import runtime

    settle()
    gp.set_replay_checks("raise")
    dev = runtime.get().device(1)
    with gp.device(1):
        s = gp.Stream()
        buf = gp.alloc(4096, s)
        pool = gp.graph_pool_handle()
        g0, g1 = gp.CUDAGraph(), gp.CUDAGraph()
        for g, value in ((g0, 1), (g1, 2)):
            with gp.graph(g, pool=pool, stream=s):
                dev.memset(buf.ptr, value, buf.nbytes, s.handle)
    # device 0 current: a replay goes to device 1's current stream, or to s; two streams, so
    # the pool's replays record done events (g0's first one late, at g1's replay with device 0
    # current and device 1's current stream)
    for g, on in ((g0, s), (g1, None), (g0, None), (g1, s)):
        if on is None:
            g.replay()
        else:
            with gp.stream(on):
                g.replay()
        gp.synchronize()
    assert {g0._done_event.device, g1._done_event.device} == {1}  # type: ignore[union-attr]
    buf.free()
    del g0, g1
    settle()


def test_a_first_replay_is_checked_against_the_processs_first_noted_replay(
    sim: Any, monkeypatch: Any
) -> None:
    """g never replayed; h, captured after g and handed g's temporary for its output, made
    the first replay the checker noted (its order starts at 1). g's first replay overwrites
    that output: reported, as after any other replay of h."""
    import itertools

    from graphpool import graphs
    from graphpool.sim import xp

    settle()
    gp.set_replay_checks("raise")
    monkeypatch.setattr(graphs, "_tick", itertools.count(1))  # as in a fresh process
    pool = gp.graph_pool_handle()
    s = gp.Stream()
    a = xp.ones(N, dtype=xp.float32)
    g, h = gp.CUDAGraph(), gp.CUDAGraph()
    s.wait_stream(gp.current_stream())
    with gp.graph(g, pool=pool, stream=s):
        t = a + 1
        del t  # g's temporary ...
    with gp.graph(h, pool=pool, stream=s):
        out = a + 2  # ... is h's output
    with gp.stream(s):
        h.replay()
        with pytest.raises(gp.ReplayHazardError, match=r"replays after .* and overwrites"):
            g.replay()
    gp.synchronize()
    del a, out, g, h
    settle()


@pytest.mark.parametrize(("live", "after"), [(40, 80), (10, 64)])
def test_register_drops_empty_pools_when_the_entries_reach_the_threshold_then_doubles_it(
    sim: Any, monkeypatch: Any, live: int, after: int
) -> None:
    """Registering a graph when the checker's pool entries reach the threshold drops every
    pool whose graphs are all gone (and its two-stream mark), keeps the live ones, and sets
    the next threshold to twice the entries kept, at least 64."""
    from graphpool import graphs
    from graphpool.sim import xp

    settle()
    dead = [("gone", i) for i in range(70 - live)]
    kept = [("live", i) for i in range(live)]
    by_pool: dict[Any, Any] = {k: {} for k in dead}
    by_pool.update({k: {0: None} for k in kept})
    streams_of: set[Any] = {dead[0], kept[0]}
    monkeypatch.setattr(graphs, "_by_pool", by_pool)
    monkeypatch.setattr(graphs, "_streams_of", streams_of)
    monkeypatch.setattr(graphs, "_sweep_at", 70)  # reached exactly
    g = gp.CUDAGraph()
    with gp.graph(g, stream=gp.Stream()):
        a = xp.ones(N, dtype=xp.float32) + 1
    assert set(by_pool) == set(kept) | {graphs._key(g)}
    assert streams_of == {kept[0]}
    assert graphs._sweep_at == after
    g.reset()
    del a, g
    settle()


def test_every_fast_replay_names_its_stream_for_the_pools_release(sim: Any) -> None:
    """Each replay, on the fast path too (checker off, a graph alone in its pool, a pool
    with mates), adds its stream to the capture's replay streams, which the pool's kept
    blocks wait for when it is released."""
    from graphpool.sim import xp

    settle()
    gp.set_replay_checks("raise")
    s0, s1, s2, s3 = gp.Stream(), gp.Stream(), gp.Stream(), gp.Stream()
    g, h = gp.CUDAGraph(), gp.CUDAGraph()
    with gp.graph(g, stream=s0):
        a = xp.ones(N, dtype=xp.float32) + 1
    with gp.stream(s0):
        g.replay()  # the slow path (first replay)
    assert g._rec is not None
    streams = g._rec.replay_streams
    with gp.stream(s1):
        g.replay()  # alone in its pool
    assert s1.handle in streams
    gp.set_replay_checks("off")
    with gp.stream(s2):
        g.replay()  # checker off
    assert s2.handle in streams
    gp.set_replay_checks("raise")
    with gp.graph(h, pool=g.pool(), stream=s0):
        b = xp.ones(N, dtype=xp.float32) + 2
    gp.synchronize()
    with gp.stream(s3):
        g.replay()  # with a mate
    assert streams == {s0.handle, s1.handle, s2.handle, s3.handle}
    gp.synchronize()
    del a, b, g, h
    settle()

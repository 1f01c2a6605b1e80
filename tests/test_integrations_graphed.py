"""gp.make_graphed_callable on every backend (sim with xp, GPU with CuPy)."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pytest

import graphpool as gp
from graphpool.graphed import GraphedCallable

N = 1000


def _inputs(xp: Any, k: int) -> tuple[Any, Any]:
    a = xp.arange(N, dtype=xp.float32) + k
    b = xp.full(N, float(3 * k + 1), dtype=xp.float32)
    return a, b


def f_single(a: Any, b: Any) -> Any:
    t = a * 2  # a temporary, freed during the capture
    return t + b


def f_pair(a: Any, b: Any) -> tuple[Any, Any]:
    return a + b, (a - b) * 3


def test_single_output_matches_eager(backend: Any) -> None:
    xp = backend.xp
    graphed = gp.make_graphed_callable(f_single, _inputs(xp, 0))
    assert isinstance(graphed, GraphedCallable)
    cases = [_inputs(xp, k) for k in range(1, 5)]
    expected = [f_single(a, b).get() for a, b in cases]
    g = graphed.graph
    gc.collect()
    before = gp.memory_allocated()
    for (a, b), want in zip(cases, expected, strict=True):
        out = graphed(a, b)
        np.testing.assert_array_equal(out.get(), want)
    assert graphed.graph is g  # one graph, replayed
    gc.collect()
    assert gp.memory_allocated() == before  # a call allocates nothing


def test_tuple_output_matches_eager(backend: Any) -> None:
    xp = backend.xp
    graphed = gp.make_graphed_callable(f_pair, _inputs(xp, 0))
    outs = []
    for k in (2, 7, 0):
        a, b = _inputs(xp, k)
        got = graphed(a, b)
        assert isinstance(got, tuple) and len(got) == 2
        s, d = f_pair(a, b)
        np.testing.assert_array_equal(got[0].get(), s.get())
        np.testing.assert_array_equal(got[1].get(), d.get())
        outs.append(got)
    # the same static outputs every call
    assert all(o[0] is outs[0][0] and o[1] is outs[0][1] for o in outs)


def test_inputs_are_copied_not_aliased(backend: Any) -> None:
    xp = backend.xp
    a0, b0 = _inputs(xp, 0)
    graphed = gp.make_graphed_callable(f_single, (a0, b0))
    # the sample arrays themselves are not the static inputs
    assert graphed.static_inputs[0] is not a0
    a, b = _inputs(xp, 3)
    res = graphed(a, b)
    a.fill(100)  # changing the argument after the call changes neither the result...
    expected = f_single(*_inputs(xp, 3)).get()
    np.testing.assert_array_equal(res.get(), expected)  # (read after the write)
    # ...nor the static input the call copied it into
    np.testing.assert_array_equal(graphed.static_inputs[0].get(), _inputs(xp, 3)[0].get())
    out = res.get()
    # the static inputs themselves can be passed back (no copy)
    np.testing.assert_array_equal(graphed(*graphed.static_inputs).get(), out)


def test_constant_arguments(backend: Any) -> None:
    xp = backend.xp

    def scale(a: Any, k: float) -> Any:
        return a * k

    a = xp.arange(N, dtype=xp.float32)
    graphed = gp.make_graphed_callable(scale, (a, 2.5))
    np.testing.assert_array_equal(graphed(a + 1, 2.5).get(), ((a + 1) * 2.5).get())
    with pytest.raises(ValueError, match="constant"):
        graphed(a, 3.0)


def test_wrong_inputs_are_refused(backend: Any) -> None:
    xp = backend.xp
    graphed = gp.make_graphed_callable(f_single, _inputs(xp, 0))
    a, b = _inputs(xp, 1)
    with pytest.raises(ValueError, match="shape"):
        graphed(xp.ones(N + 1, dtype=xp.float32), b)
    with pytest.raises(ValueError, match="dtype"):
        graphed(a, xp.ones(N, dtype=xp.float64))
    with pytest.raises(TypeError):
        graphed(a)
    with pytest.raises(TypeError):
        gp.make_graphed_callable(f_single, (1.0, 2.0))
    # still usable after the refusals
    np.testing.assert_array_equal(graphed(a, b).get(), f_single(a, b).get())


def test_warmup_runs_before_capture(backend: Any) -> None:
    xp = backend.xp
    calls: list[bool] = []

    def fn(a: Any) -> Any:
        calls.append(gp.is_current_stream_capturing())
        return a + 1

    graphed = gp.make_graphed_callable(fn, (xp.ones(N, dtype=xp.float32),))
    assert calls == [False, False, False, True]
    np.testing.assert_array_equal(graphed(xp.zeros(N, dtype=xp.float32)).get(), np.ones(N, np.float32))
    assert len(calls) == 4  # replays do not call fn


def test_top_level_takes_warmup_and_pool(backend: Any) -> None:
    xp = backend.xp
    calls: list[bool] = []

    def fn(a: Any) -> Any:
        calls.append(gp.is_current_stream_capturing())
        return a * 2

    pool = gp.graph_pool_handle()
    graphed = gp.make_graphed_callable(fn, (xp.ones(N, dtype=xp.float32),), warmup=1, pool=pool)
    assert calls == [False, True]
    assert graphed.graph.pool() == pool
    np.testing.assert_array_equal(graphed(xp.full(N, 4.0, dtype=xp.float32)).get(), np.full(N, 8.0))
    assert gp.make_graphed_callable(fn, (xp.ones(N, dtype=xp.float32),), warmup=0) is not None
    assert calls[2:] == [True]  # warmup=0: captured straight away
    with pytest.raises(ValueError, match="warmup"):
        gp.make_graphed_callable(fn, (xp.ones(N, dtype=xp.float32),), warmup=-1)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"warmup": 10**18}, ValueError, "warmup is a count of eager runs from 0 to 1000"),
        ({"warmup": 1001}, ValueError, "warmup"),
        ({"warmup": "3"}, TypeError, "warmup .*not str"),
        ({"warmup": 3.0}, TypeError, "warmup"),
        ({"warmup": True}, TypeError, "warmup"),
        ({"num_warmup_iters": 10**6}, ValueError, "num_warmup_iters"),
        ({"num_warmup_iters": None, "warmup": -1}, ValueError, "warmup"),
    ],
)
def test_warmup_counts_are_bounded_and_checked_first(
    backend: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    """warmup=10**18 ran (for ever) before anything was checked; PyTorch's own count is 3."""
    xp = backend.xp
    calls: list[int] = []

    def fn(a: Any) -> Any:
        calls.append(1)
        return a + 1

    with pytest.raises(error, match=match):
        gp.make_graphed_callables(fn, (xp.ones(N, dtype=xp.float32),), **kwargs)
    if "num_warmup_iters" not in kwargs:
        with pytest.raises(error, match=match):
            gp.make_graphed_callable(fn, (xp.ones(N, dtype=xp.float32),), **kwargs)
    assert calls == []  # refused before any run
    graphed = gp.make_graphed_callable(fn, (xp.ones(N, dtype=xp.float32),), warmup=1000)
    assert len(calls) == 1001  # the largest count is taken: 1000 runs and the capture
    del graphed


def test_top_level_signature_matches_graphed() -> None:
    import inspect

    from graphpool import graphed

    default = inspect.signature(gp.make_graphed_callable).parameters["warmup"].default
    assert default == graphed.WARMUP_ITERATIONS
    # each public form and what it calls (written once, in graphed.py)
    for top_fn, inner_fn in (
        (gp.make_graphed_callable, graphed.GraphedCallable),
        (gp.make_graphed_callables, graphed.graph_callables),
    ):
        top = inspect.signature(top_fn).parameters
        inner = inspect.signature(inner_fn).parameters
        assert [(p.name, p.kind, p.default) for p in top.values()] == [
            (p.name, p.kind, p.default) for p in inner.values()
        ]


def test_graphed_callables_single_form(backend: Any) -> None:
    xp = backend.xp
    graphed = gp.make_graphed_callables(f_single, _inputs(xp, 0))
    assert isinstance(graphed, GraphedCallable)
    a, b = _inputs(xp, 2)
    np.testing.assert_array_equal(graphed(a, b).get(), f_single(a, b).get())


def test_graphed_callables_tuple_form_shares_one_pool(backend: Any) -> None:
    """PyTorch's form: a tuple of callables and a tuple of sample-argument tuples."""
    xp = backend.xp
    calls: list[str] = []

    def first(a: Any, b: Any) -> Any:
        calls.append("first")
        return f_single(a, b)

    def second(c: Any) -> Any:
        calls.append("second")
        return c * 3 - 1

    a0, b0 = _inputs(xp, 0)
    c0 = xp.arange(N, dtype=xp.float32)
    g1, g2 = gp.make_graphed_callables((first, second), ((a0, b0), (c0,)), num_warmup_iters=2)
    assert calls == ["first"] * 3 + ["second"] * 3  # 2 warm-up runs and the capture, in order
    assert g1.graph.pool() == g2.graph.pool()  # one shared private pool
    for k in (1, 4):
        a, b = _inputs(xp, k)
        c = xp.full(N, float(k), dtype=xp.float32)
        np.testing.assert_array_equal(g1(a, b).get(), f_single(a, b).get())
        np.testing.assert_array_equal(g2(c).get(), (c * 3 - 1).get())
    assert len(calls) == 6  # replays do not call the functions


def test_graphed_callables_tuple_form_takes_a_pool(backend: Any) -> None:
    xp = backend.xp
    pool = gp.graph_pool_handle()
    (g,) = gp.make_graphed_callables((f_pair,), (_inputs(xp, 0),), pool=pool, warmup=1)
    assert g.graph.pool() == pool


def test_graphed_callables_tuple_form_checks_its_arguments(backend: Any) -> None:
    xp = backend.xp
    a, b = _inputs(xp, 0)
    with pytest.raises(TypeError, match="one tuple of sample arguments per callable"):
        gp.make_graphed_callables((f_single, f_pair), ((a, b),))
    with pytest.raises(TypeError, match="one tuple of sample arguments per callable"):
        gp.make_graphed_callables((f_single,), [(a, b)])  # type: ignore[call-overload]
    with pytest.raises(TypeError, match=r"sample_args\[0\]"):
        gp.make_graphed_callables((f_single,), (a,))  # type: ignore[arg-type]

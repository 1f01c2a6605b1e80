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

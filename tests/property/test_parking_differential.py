"""Differential test: the PyTorch shim's native lane against graphpool's parking rule in Python.

The lane (graphpool/_torch_shim.cpp) hands a parked block out again and parks it again
without Python; the rule it replays is written once, in the allocator (policy/heap.py, Note
[Parking]). This test runs one random program of PyTorch's allocator calls twice, on two
simulated devices: once through the shim's C entry points with the lane bound (``lane``),
once through graphpool's Python hooks alone with no lane (``reference``). Programs free and
ask again for the same size on the same stream often (where the lane answers), on several
streams, the legacy one included; they record stream uses, ask for statistics, empty the
cache, change routing (the lane turns off), and begin and end captures outside graphpool
(found by the next allocation, and by the lane's capture query). After every step both must
give the same address or error; at every statistics step and at the end, the same
statistics, the same snapshot of segments and blocks, and sound invariants.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import graphpool as gp
from graphpool import routing, runtime
from graphpool.device.protocol import CAPTURE_MODE_GLOBAL
from graphpool.hooks import TorchHooks
from graphpool.routing import Route
from graphpool.streams import resolve_handle
from graphpool.tools.benchkit import torch_entry_points
from twins import torch_shim_or_skip

SIZES = (512, 1000, 1024, 4096, 70_000, 3 << 20)


class Side:
    """One run: a simulated runtime, its streams (index 0: the legacy stream), its live blocks."""

    def __init__(self, rt: runtime.Runtime, malloc: Any, free: Any) -> None:
        self.rt = rt
        dev = rt.device(0)
        self.streams = [0] + [dev.create_stream() for _ in range(3)]
        self.malloc, self.free = malloc, free
        self.live: list[tuple[int, int, int]] = []  # (address, size, stream index)
        self.last: tuple[int, int] | None = None  # (size, stream index) of the last free
        self.graphs: dict[int, int] = {}  # stream index -> capture begun (0) or graph

    def step(self, op: tuple[Any, ...]) -> Any:
        try:
            return ("ok", self._do(op))
        except Exception as e:  # the same failure on both sides is part of the outcome
            return ("error", type(e).__name__, re.sub(r"\d+", "#", str(e)))  # (ids and handles differ)

    def _do(self, op: tuple[Any, ...]) -> Any:
        kind = op[0]
        a = self.rt.allocator(0)
        dev = self.rt.device(0)
        if kind in ("malloc", "again"):
            if kind == "again":
                if self.last is None:
                    return None
                size, si = self.last
            else:
                size, si = SIZES[op[1]], op[2]
            p = self.malloc(size, 0, self.streams[si])
            self.live.append((p, size, si))
            return p
        if kind == "free":
            if not self.live:
                return None
            p, size, si = self.live.pop(op[1] % len(self.live))
            self.free(p, size, 0, self.streams[si])
            self.last = (size, si)
            return p
        if kind == "cycle":  # the last block freed and asked for again, ``op[1]`` times (a loop)
            out = []
            for _ in range(op[1]):
                if not self.live:
                    break
                out.append(self._do(("free", len(self.live) - 1)))
                out.append(self._do(("again",)))
            return out
        if kind == "record":
            if not self.live:
                return None
            p = self.live[op[1] % len(self.live)][0]
            return a.record_stream(p, self.streams[op[2]])
        if kind == "stats":
            return None  # compared by observe()
        if kind == "empty_cache":
            return a.empty_cache()
        if kind == "invalidate":
            routing.invalidate()
            return None
        if kind == "begin":
            si = op[1]
            if si == 0 or si in self.graphs:
                return None
            dev.begin_capture(self.streams[si], CAPTURE_MODE_GLOBAL)
            self.graphs[si] = 0
            return None
        if kind == "end":
            if not self.graphs:
                return None
            si = sorted(self.graphs)[op[1] % len(self.graphs)]
            del self.graphs[si]
            dev.destroy_graph(dev.end_capture(self.streams[si]))  # (raises if invalidated)
            return None
        raise AssertionError(kind)

    def observe(self) -> tuple[Any, ...]:
        a = self.rt.allocator(0)
        a.check_invariants()
        stats = a.memory_stats()
        snap = [
            (
                seg["address"],
                seg["total_size"],
                [(b["address"], b["size"], b["state"]) for b in seg["blocks"]],
            )
            for seg in a.snapshot()
        ]
        return stats, snap

    def close(self) -> None:
        """End the captures still underway."""
        dev = self.rt.device(0)
        for si in list(self.graphs):
            try:
                dev.destroy_graph(dev.end_capture(self.streams[si]))
            except gp.GraphpoolError:  # invalidated (the legacy stream used meanwhile): ended all the same
                pass
        self.graphs.clear()


def _reference_hooks(rt: runtime.Runtime, park: bool = True) -> tuple[Any, Any]:
    """graphpool's Python hooks for ``rt``, with no lane (and no backend check: ``rt`` need not
    be the current runtime); ``park=False``: every free queued (``drop``), no parking at all."""

    def find(device: int, stream: int) -> Route:
        generation = routing.routes.generation
        return Route(resolve_handle(stream, "test", "stream"), rt.allocator(device), generation)

    h = TorchHooks(find, rt.allocator, None)
    if park:
        return h.malloc, h.free

    def drop(ptr: int, size: int, device: int, stream: int) -> int:
        rt.allocator(device).drop(ptr)
        return 0

    return h.malloc, drop


@pytest.fixture
def shim() -> Iterator[Any]:

    mod = torch_shim_or_skip()
    yield mod
    mod.close()


def _lane_side(shim: Any) -> Side:
    """A fresh simulated runtime (current), served through the shim's C entry points."""
    import graphpool.torch as gtorch

    gp.set_backend("sim")
    rt = runtime.get()
    shim.set_hooks(*gtorch.hooks(rt))
    dll = torch_entry_points()

    def malloc(size: int, device: int, stream: int) -> int:
        # A failed allocation throws through C (PyTorch then raises RuntimeError); through
        # ctypes that would abort, so a request the lane will not take is made where it
        # raises instead (try_malloc: the same hooks, the exported function's slow path).
        state = shim.lane_state(device)
        if state["state"] == "parked" and state["on"] and state["requested"] == size:
            return int(dll.graphpool_torch_malloc(size, device, stream) or 0)
        return int(shim.try_malloc(size, device, stream))

    def free(ptr: int, size: int, device: int, stream: int) -> None:
        dll.graphpool_torch_free(ptr, size, device, stream)

    return Side(rt, malloc, free)


OPS = st.one_of(
    st.tuples(st.just("malloc"), st.integers(0, len(SIZES) - 1), st.integers(0, 3)),
    st.tuples(st.just("malloc"), st.integers(0, 2), st.integers(0, 1)),
    st.tuples(st.just("free"), st.integers(0, 20)),
    st.tuples(st.just("free"), st.integers(0, 20)),
    st.tuples(st.just("again")),
    st.tuples(st.just("again")),
    st.tuples(st.just("cycle"), st.integers(1, 6)),
    st.tuples(st.just("cycle"), st.integers(1, 6)),
    st.tuples(st.just("record"), st.integers(0, 20), st.integers(0, 3)),
    st.tuples(st.just("stats")),
    st.tuples(st.just("empty_cache")),
    st.tuples(st.just("invalidate")),
    st.tuples(st.just("begin"), st.integers(1, 3)),
    st.tuples(st.just("end"), st.integers(0, 3)),
)


def _run(side: Side, program: list[Any], shim: Any | None) -> tuple[list[Any], list[Any], int]:
    """Every step's outcome, the state at each statistics step and at the end, and how many
    requests the lane served. One side at a time: the simulator's capture rules are the
    process's, as CUDA's are, so two sides interleaved would see each other's captures."""
    outcomes: list[Any] = []
    states: list[Any] = []
    served = 0
    try:
        for op in program:
            hits = shim.lane_state(0)["hits"] if shim is not None else 0
            outcomes.append(side.step(op))
            if shim is not None and shim.lane_state(0)["hits"] > hits:
                served += 1
            if op[0] == "stats":
                states.append(side.observe())
    finally:
        side.close()
    states.append(side.observe())
    return outcomes, states, served


@pytest.mark.filterwarnings("ignore:graphpool. deferred work failed:RuntimeWarning")  # both sides alike
@settings(
    max_examples=int(os.environ.get("GRAPHPOOL_PARKING_EXAMPLES", "120")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(program=st.lists(OPS, min_size=10, max_size=80))
def test_the_lane_replays_the_rule(shim: Any, program: list[Any]) -> None:
    before = runtime._runtime
    runtime._runtime = None  # (a program may leave a capture registered: no set_backend refusal)
    try:
        lane = _run(_lane_side(shim), program, shim)
        runtime._runtime = None
        gp.set_backend("sim")
        reference = _run(Side(runtime.get(), *_reference_hooks(runtime.get())), program, None)
        runtime._runtime = None
        gp.set_backend("sim")
        dropping = _run(Side(runtime.get(), *_reference_hooks(runtime.get(), park=False)), program, None)
    finally:
        runtime._runtime = before
        routing.invalidate()
    if lane[2]:
        event("the lane served a request")
    for n, (op, got, want) in enumerate(zip(program, lane[0], reference[0], strict=True)):
        assert got == want, f"step {n} {op}: lane {got} != reference {want}"
    for n, (got, want) in enumerate(zip(lane[1], reference[1], strict=True)):
        assert got == want, f"state {n} (a statistics step, or the end) differs"
    # parking changes no address (heap.py, Note [Parking]): as if every free were queued
    for n, (op, got, want) in enumerate(zip(program, dropping[0], reference[0], strict=True)):
        assert got == want, f"step {n} {op}: parking moved an address ({want} instead of {got})"

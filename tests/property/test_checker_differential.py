"""Differential test: the replay checker's plans against a checker that recomputes everything.

graphs.py works out once, per graph and per set of pool mates, which footprints, inputs and
outputs meet (Note [Replay plans]), and each replay runs only what can change between
replays. ``reference`` below is the checker as it was before the plans: every replay walks
the pool's mates and compares their footprints pair by pair. Random programs capture into
shared pools on two streams (temporaries freed during the capture, outputs kept), replay
in random orders on either stream (now and then through another Stream object for it),
make one stream wait for the other, free outputs, reset graphs (and capture into them
again), drop graphs, and synchronize. Every
checked replay runs the product's checker, then the reference on the same state; they must
report the same messages in the same order, and the product must have recorded the done
events of the mates the reference finds late. The run must reach each of the three checks
and the late events, or it proves nothing.
"""

from __future__ import annotations

import os
import random
import weakref
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

import pytest

import graphpool as gp
from graphpool import graphs, runtime
from graphpool.graphs import CUDAGraph
from graphpool.streams import Stream

SIZES = (512, 1536, 4096, 70_000, 1 << 20, 3 << 20)
SEEDS = 1000 if os.environ.get("GRAPHPOOL_NIGHTLY") else 100
STEPS = 60


# ------------------------------------------------------------- the reference checker
def _overlaps(a: Iterable[tuple[int, int]] | None, b_ptr: int, b_size: int) -> tuple[int, int] | None:
    for ptr, size in a or ():
        if ptr < b_ptr + b_size and b_ptr < ptr + size:
            return ptr, size
    return None


def _footprints_meet(g: CUDAGraph, h: CUDAGraph) -> tuple[int, int] | None:
    assert g._rec is not None and h._rec is not None
    for ptr, size in h._rec.written or ():
        hit = _overlaps(g._rec.written, ptr, size)
        if hit is not None:
            return hit
    return None


def _mates(g: CUDAGraph) -> list[CUDAGraph]:
    return [
        h
        for r in tuple(graphs._by_pool.get(graphs._key(g), {}).values())
        if (h := r()) is not None and h is not g and h._rec is not None
    ]


def _late(mates: list[CUDAGraph], s: Stream) -> list[CUDAGraph]:
    return [
        h
        for h in mates
        if h._event_stale and h._last_stream not in (None, s) and h._last_stream._source is None  # type: ignore[union-attr]
    ]


def reference(g: CUDAGraph, s: Stream, report: Callable[[str], None]) -> None:
    """The checker before replay plans: everything recomputed at every replay."""
    rec = g._rec
    assert rec is not None
    key = graphs._key(g)
    with graphs._checks_lock:
        mates = _mates(g)
        late = _late(mates, s)
        if late:
            graphs._streams_of.add(key)
    for h in late:
        graphs._mark_done(h)
    pool = tuple(rec.pool.id)
    for h in mates:
        if not graphs._finished(h, s):
            hit = _footprints_meet(g, h)
            if hit is not None:
                report(
                    f"{g.label} replays on {s!r} while {h.label} (same pool {pool}) may still run on "
                    f"{h._last_stream!r}; both use 0x{hit[0]:x} ({hit[1]} bytes) for temporaries. "
                    f"Make {s!r} wait for {h._last_stream!r} first (stream.wait_stream), "
                    "or capture them into separate pools."
                )
    for ptr, size, producer, block, serial in rec.inputs:
        if block.allocated and block.serial == serial:
            continue
        prod = next((h for h in mates if h._rec is producer), None)
        if prod is None:
            continue
        for h in mates:
            if h is prod or h._last_tick <= prod._last_tick:
                continue
            assert h._rec is not None
            if _overlaps(h._rec.written, ptr, size) is not None:
                report(
                    f"{g.label} reads 0x{ptr:x} ({size} bytes), made by {prod.label}, but {h.label} "
                    f"(same pool {pool}) overwrote it when it replayed after {prod.label}. "
                    f"Replay the graphs of pool {pool} in capture order, or give them separate pools."
                )
                break
    for h in mates:
        assert h._rec is not None
        if h._last_tick <= g._last_tick:
            continue
        for block, serial in h._rec.outputs:
            if block.allocated and block.serial == serial:
                hit = _overlaps(rec.written, block.ptr, block.size)
                if hit is not None:
                    report(
                        f"{g.label} replays after {h.label} and overwrites 0x{block.ptr:x} "
                        f"({block.size} bytes), an output of {h.label} that is still referenced "
                        f"(pool {pool}: {h.label} was handed memory {g.label} uses). Copy or "
                        f"drop that output before replaying {g.label}, or capture into separate pools."
                    )
                    return


# ------------------------------------------------------------------- the programs
class Program:
    """One random program's state: two streams, the graphs, the pools, the kept outputs."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.streams = [gp.Stream(), gp.Stream()]
        self.dev = runtime.get().device(self.streams[0].device)
        self.scratch = gp.alloc(4096, self.streams[0])  # what each capture's one kernel writes
        self.pools: list[Any] = []
        self.graphs: list[CUDAGraph] = []
        self.outputs: list[Any] = []
        self.dropped: list[weakref.ref[CUDAGraph]] = []

    def live(self) -> list[CUDAGraph]:
        return [g for g in self.graphs if g._exec is not None]

    def capture(self) -> None:
        rng = self.rng
        idle = [g for g in self.graphs if g._exec is None]
        g = rng.choice(idle) if idle and rng.random() < 0.5 else gp.CUDAGraph()
        pool = rng.choice(self.pools) if self.pools and rng.random() < 0.8 else None
        s = rng.choice(self.streams)
        with gp.stream(s):
            g.capture_begin(pool)
            for _ in range(rng.randrange(1, 7)):
                b = gp.alloc(rng.choice(SIZES), s)
                if rng.random() < 0.4:
                    self.outputs.append(b)
                else:
                    b.free()  # a temporary: a later allocation of this capture or the next may reuse it
            self.dev.memset(self.scratch.ptr, 1, 64, s.handle)
            g.capture_end()
        if pool is None:
            self.pools.append(g.pool())
        if g not in self.graphs:
            self.graphs.append(g)

    def step(self) -> None:
        rng = self.rng
        live = self.live()
        op = rng.choices(
            ["capture", "replay", "wait", "free", "reset", "drop", "sync"], [4, 12, 3, 4, 1, 1, 1]
        )[0]
        if op == "capture" or (not live and op in ("replay", "reset", "drop")):
            self.capture()
        elif op == "replay":
            s = rng.choice(self.streams)
            if rng.random() < 0.2:  # another object for the same stream (equal, not identical)
                s = Stream._wrap(s.device, s.handle)
            with gp.stream(s):
                rng.choice(live).replay()
        elif op == "wait":
            a, b = rng.sample(self.streams, 2)
            a.wait_stream(b)
        elif op == "free" and self.outputs:
            self.outputs.pop(rng.randrange(len(self.outputs))).free()
        elif op == "reset":
            rng.choice(live).reset()
        elif op == "drop":
            g = live.pop(rng.randrange(len(live)))
            live.clear()
            self.graphs.remove(g)
            self.dropped.append(weakref.ref(g))
            del g
            assert self.dropped[-1]() is None  # no plan keeps a dropped graph alive
        elif op == "sync":
            gp.synchronize()


def _kinds(messages: list[str]) -> Iterable[str]:
    for m in messages:
        yield "1 concurrent" if " may still run on " in m else ("2 input" if " reads " in m else "3 output")


def test_the_plans_report_what_recomputing_every_replay_reports(sim: Any, monkeypatch: Any) -> None:
    """Every checked replay of the random programs: the same messages, in the same order, as
    the reference; the same done events recorded. (GRAPHPOOL_NIGHTLY=1: ten times the programs.)"""
    gp.set_replay_checks("warn")
    product = graphs._check_replay
    sink: list[str] = []
    monkeypatch.setattr(graphs, "_report", sink.append)
    seen: Counter[str] = Counter()

    def both(g: CUDAGraph, s: Stream) -> None:
        mates = _mates(g)
        late = _late(mates, s)
        stale = [h for h in mates if h._event_stale and h not in late]
        spread = graphs._key(g) in graphs._streams_of
        sink.clear()
        product(g, s)
        mine = list(sink)
        # the product recorded the done events of the late mates, and only theirs (the
        # reference's side effects, checked: run after, it finds none late)
        assert (graphs._key(g) in graphs._streams_of) == (spread or bool(late))
        assert not any(h._event_stale for h in late)
        assert all(h._event_stale for h in stale)
        seen["late"] += bool(late)
        ref: list[str] = []
        reference(g, s, ref.append)
        assert mine == ref
        seen.update(_kinds(mine))
        seen["checked"] += 1

    monkeypatch.setattr(graphs, "_check_replay", both)
    for seed in range(SEEDS):
        p = Program(random.Random(seed))
        try:
            for _ in range(STEPS):
                p.step()
        except AssertionError as exc:
            raise AssertionError(f"seed {seed}: {exc}") from exc
        gp.synchronize()
        for g in p.graphs:
            g.reset()
        for b in p.outputs:
            b.free()
        del p
        gp.empty_cache()  # each program's pools go back to the device
    # every check was reached, and reported by both (or the test compared nothing)
    assert min(seen[k] for k in ("1 concurrent", "2 input", "3 output", "late")) > 0, seen


@pytest.mark.parametrize("size", [0, 1, 512])
def test_extent_meets_exactly_where_an_allocation_meets(size: int) -> None:
    """``_meets`` on the merged footprint answers as the allocation-by-allocation scan does,
    footprints with overlapping, touching, nested and empty ranges included."""
    rng = random.Random(size)
    g = CUDAGraph()
    for _ in range(300):
        n = rng.randrange(0, 8)
        spans = [(rng.randrange(0, 40) * 8, rng.choice([0, 8, 16, 24, 64])) for _ in range(n)]

        class Rec:
            written = spans

        g._rec = Rec()  # type: ignore[assignment]
        g._extent = None
        ext = graphs._extent(g)
        for ptr in range(-8, 400, 4):
            expected = _overlaps(spans, ptr, size) is not None
            assert graphs._meets(ext, ptr, size) == expected, (spans, ptr, size)
    g._rec = None

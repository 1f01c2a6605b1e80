"""Stateful property tests: random programs against the allocator, checked after every step.

``AllocatorMachine`` drives ``CachingAllocator(FakeDevice)`` with shrunken size tunables
and a small device budget, so splitting, merging, growth and out-of-memory happen in
almost every run. A shadow model keeps every live allocation's range (they must never
overlap), the ranges that must not be handed out yet (kept for a graph, waiting on
events), the routing each request must get, the use count of every pool, and the
highest level of every statistic (peaks must match).

``PublicApiMachine`` drives the public API on the simulated device: buffers filled with
a pattern that is verified at free, graphs captured, replayed and reset, and
``gp.check_invariants()`` after every step.
"""

from __future__ import annotations

import gc
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from graphpool.device.protocol import CAPTURE_MODE_GLOBAL
from graphpool.errors import CaptureError, OutOfMemoryError
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.pools import SizeConfig
from graphpool.policy.private_pools import CaptureRecord, PoolId

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "policy"))
from fakedevice import FakeDevice  # noqa: E402

SIZES = SizeConfig(
    min_block=512,
    small_size=4096,
    small_segment=8192,
    large_segment=40960,
    min_large_alloc=20480,
    round_large=8192,
)
BUDGET = 200_000
STREAMS = (1, 2, 3)
UNSAFE = {"record", "query", "sync", "free"}
EXACT_PEAKS = ("allocation", "allocated_bytes", "requested_bytes", "segment", "reserved_bytes", "active", "active_bytes")
OTHER_PEAKS = ("inactive_split", "inactive_split_bytes")
KINDS = ("all", "small_pool", "large_pool")

SETTINGS = settings(
    max_examples=600,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def rounded(n: int) -> int:
    return SIZES.round_size(n)


def overlaps(lo: int, hi: int, ranges: Any) -> bool:
    return any(lo < h and l < hi for l, h in ranges)


@dataclass
class Live:
    nbytes: int
    size: int
    stream: int
    pool: PoolId | None
    uses: set[int] = field(default_factory=set)


@dataclass
class Cap:
    rec: CaptureRecord
    pid: PoolId
    stream: int
    released: bool = False


@dataclass
class Blocked:
    """A range that must not be handed out while ``active()``."""

    lo: int
    hi: int
    recs: list[Cap] | None = None  # kept: until one of these graphs is released
    events: str | None = None  # "deferred" (not recorded yet) or "waiting" (recorded, incomplete)


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dev = FakeDevice(BUDGET)
        self.a = CachingAllocator(self.dev, sizes=SIZES)
        self.live: dict[int, Live] = {}
        self.active: dict[int, Cap] = {}  # capture id -> active capture
        self.graphs: list[Cap] = []  # captured, not released
        self.blocked: list[Blocked] = []
        self.graph_ids = itertools.count(1)
        self.capture_calls_from: int | None = None  # dev.calls index when captures began
        self.maxima: dict[tuple[Any, str], int] = {}

    # ------------------------------------------------------------- helpers
    def route(self, stream: int) -> Cap | None:
        cid = self.dev.capturing.get(stream)
        return None if cid is None else self.active.get(cid)

    def still_blocked(self, b: Blocked) -> bool:
        if b.recs is not None and not any(c.released for c in b.recs):
            return True
        return b.events is not None

    def blocked_ranges(self) -> list[tuple[int, int]]:
        return [(b.lo, b.hi) for b in self.blocked if self.still_blocked(b)]

    def prune(self) -> None:
        self.blocked = [b for b in self.blocked if self.still_blocked(b)]

    def captures_ended(self) -> None:
        """No capture left: deferred frees record their events now."""
        for b in self.blocked:
            if b.events == "deferred":
                b.events = "waiting"
        self.capture_calls_from = None

    def expected_use_counts(self) -> dict[PoolId, int]:
        out: dict[PoolId, int] = {}
        for c in list(self.active.values()) + self.graphs:
            out[c.pid] = out.get(c.pid, 0) + 1
        return out

    # ------------------------------------------------------------- rules
    @rule(nbytes=st.one_of(st.integers(0, 4096), st.integers(0, 60000)), stream=st.sampled_from(STREAMS))
    def malloc(self, nbytes: int, stream: int) -> None:
        cap = self.route(stream)
        before = self.a.memory_stats()
        try:
            ptr = self.a.malloc(nbytes, stream=stream)
        except OutOfMemoryError:
            after = self.a.memory_stats()
            assert after["num_ooms"] == before["num_ooms"] + 1
            assert after["allocation.all.current"] == before["allocation.all.current"]
            if self.active:
                assert after["num_device_free"] == before["num_device_free"]
                assert after["num_alloc_retries"] == before["num_alloc_retries"]
            return
        blk = self.a.lookup(ptr)
        assert blk is not None and blk.ptr == ptr and blk.stream == stream
        want = rounded(nbytes)
        if SIZES.is_small(want):
            assert blk.size == want
        else:
            assert want <= blk.size <= want + SIZES.small_size  # an unsplit rest stays attached
        got = None if blk.pool.owner is None else blk.pool.owner.id
        if cap is None:
            assert got is None, "eager request served from a private pool"
        else:
            assert got == cap.pid, f"capture into {cap.pid} served from {got}"
        lo, hi = ptr, ptr + blk.size
        assert ptr not in self.live
        assert not overlaps(lo, hi, [(p, p + v.size) for p, v in self.live.items()]), "overlapping allocations"
        assert not overlaps(lo, hi, self.blocked_ranges()), "memory handed out while kept or awaiting events"
        self.live[ptr] = Live(nbytes, blk.size, stream, got)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        v = self.live.pop(ptr)
        lo, hi = ptr, ptr + v.size
        events = None
        if v.uses:
            events = "deferred" if self.active else "waiting"
        recs = None
        if self.active:
            mine = self.route(v.stream)
            if mine is not None:
                candidates = [mine]
            else:
                candidates = list(self.active.values())
            if all(c.pid != v.pool for c in candidates):
                recs = candidates
        self.a.free(ptr)
        if recs is not None or events is not None:
            self.blocked.append(Blocked(lo, hi, recs, events))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), stream=st.sampled_from(STREAMS))
    def record_stream(self, data: st.DataObject, stream: int) -> None:
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        self.a.record_stream(ptr, stream)
        v = self.live[ptr]
        if stream != v.stream:
            v.uses.add(stream)

    @rule()
    def complete_events(self) -> None:
        self.dev.complete_all()
        for b in self.blocked:
            if b.events == "waiting":
                b.events = None
        self.prune()

    @rule()
    def empty_cache(self) -> None:
        if self.active:
            before = self.a.memory_stats()
            with pytest.raises(CaptureError):
                self.a.empty_cache()
            assert self.a.memory_stats() == before
            return
        self.a.empty_cache()
        for b in self.blocked:
            if b.events == "waiting":
                b.events = None
        self.prune()
        freeable = {p.id for p in self.a.private_pools() if p.use_count == 0}
        for seg in self.a.snapshot():
            pool = seg["segment_pool_id"]
            if pool is None or PoolId(*pool) in freeable:
                whole_free = len(seg["blocks"]) == 1 and seg["blocks"][0]["state"] == "inactive"
                assert not whole_free, f"empty_cache left an unsplit free segment of pool {pool}"

    @rule()
    def reset_peak(self) -> None:
        self.a.reset_peak()
        self.maxima.clear()

    @rule(stream=st.sampled_from(STREAMS), which=st.sampled_from(["new", "h1", "h2", "existing"]))
    def begin_capture(self, stream: int, which: str) -> None:
        if stream in self.dev.capturing:
            return
        if which == "new":
            pid = PoolId(next(self.graph_ids), 0)
        elif which == "existing":
            pools = [p.id for p in self.a.private_pools()]
            if not pools:
                return
            pid = pools[len(pools) // 2]
        else:
            pid = PoolId(0, int(which[1]))
        if any(c.pid == pid for c in self.active.values()):
            return  # one capture per pool at a time
        if not self.active:
            self.capture_calls_from = len(self.dev.calls)
        rec = self.a.begin_capture(pid, lambda: self.dev.begin(stream), stream=stream)
        self.active[rec.capture_id] = Cap(rec, pid, stream)

    @precondition(lambda self: self.active)
    @rule(data=st.data(), stream=st.sampled_from(STREAMS))
    def join_capture(self, data: st.DataObject, stream: int) -> None:
        if stream in self.dev.capturing:
            return
        cid = data.draw(st.sampled_from(sorted(self.active)))
        self.dev.capturing[stream] = cid

    def _stop(self, data: st.DataObject) -> Cap:
        cid = data.draw(st.sampled_from(sorted(self.active)))
        cap = self.active.pop(cid)
        for s, c in list(self.dev.capturing.items()):
            if c == cid:
                self.dev.end(s)
        return cap

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def end_capture(self, data: st.DataObject) -> None:
        cap = self._stop(data)
        self.a.end_capture(cap.rec)
        self.graphs.append(cap)
        if not self.active:
            self.captures_ended()

    @precondition(lambda self: self.active)
    @rule(data=st.data())
    def abort_capture(self, data: st.DataObject) -> None:
        cap = self._stop(data)
        self.a.abort_capture(cap.rec)
        cap.released = True
        if not self.active:
            self.captures_ended()
        self.prune()

    @precondition(lambda self: self.graphs)
    @rule(data=st.data())
    def release_capture(self, data: st.DataObject) -> None:
        cap = data.draw(st.sampled_from(self.graphs))
        self.graphs.remove(cap)
        self.a.release_capture(cap.rec)
        cap.released = True
        self.prune()

    # ------------------------------------------------------------- invariants
    @invariant()
    def allocator_invariants(self) -> None:
        self.a.check_invariants()

    @invariant()
    def capture_rules(self) -> None:
        assert self.dev.mode == CAPTURE_MODE_GLOBAL, "capture mode not restored"
        if self.capture_calls_from is not None:
            made = set(self.dev.calls[self.capture_calls_from :])
            assert not made & UNSAFE, f"device calls during capture: {made & UNSAFE}"

    @invariant()
    def live_allocations_tracked(self) -> None:
        st_ = self.a.memory_stats()
        assert st_["allocation.all.current"] == len(self.live)
        assert st_["allocated_bytes.all.current"] == sum(v.size for v in self.live.values())
        for ptr, v in self.live.items():
            blk = self.a.lookup(ptr)
            assert blk is not None and blk.size == v.size
            assert (None if blk.pool.owner is None else blk.pool.owner.id) == v.pool
        assert self.dev.used == st_["reserved_bytes.all.current"]

    @invariant()
    def use_counts(self) -> None:
        expected = self.expected_use_counts()
        pools = {p.id: p for p in self.a.private_pools()}
        for pid, n in expected.items():
            assert pid in pools, f"pool {pid} with {n} users vanished"
            assert self.a.memory_stats(pool=pid)["use_count"] == n
        for pid, p in pools.items():
            if pid not in expected:
                assert p.use_count == 0 and p.segment_count > 0

    @invariant()
    def peaks(self) -> None:
        scopes: list[tuple[Any, dict[str, int]]] = [(None, self.a.memory_stats())]
        pools = {p.id for p in self.a.private_pools()}
        for key in [k for k in self.maxima if k[0] is not None and k[0] not in pools]:
            del self.maxima[key]  # a pool that disappeared starts from zero if made again
        for pid in pools:
            scopes.append((pid, self.a.memory_stats(pool=pid)))
        for scope, sts in scopes:
            for name in EXACT_PEAKS + OTHER_PEAKS:
                for kind in KINDS:
                    k = f"{name}.{kind}."
                    m = max(self.maxima.get((scope, k), 0), sts[k + "current"])
                    self.maxima[(scope, k)] = m
                    if name in EXACT_PEAKS:
                        assert sts[k + "peak"] == m, f"{scope} {k}peak is {sts[k + 'peak']}, highest level seen {m}"
                    else:
                        assert sts[k + "peak"] >= m, f"{scope} {k}peak below a level seen"
                all_peak = sts[f"{name}.all.peak"]
                assert all_peak >= max(sts[f"{name}.small_pool.peak"], sts[f"{name}.large_pool.peak"])
                assert all_peak <= sts[f"{name}.small_pool.peak"] + sts[f"{name}.large_pool.peak"]

    def teardown(self) -> None:
        # end everything, free everything: the device must get every byte back
        for cid in list(self.active):
            cap = self.active.pop(cid)
            for s, c in list(self.dev.capturing.items()):
                if c == cid:
                    self.dev.end(s)
            self.a.abort_capture(cap.rec)
        for cap in self.graphs:
            self.a.release_capture(cap.rec)
        for ptr in list(self.live):
            self.a.free(ptr)
        self.a.empty_cache()
        self.a.check_invariants()
        st_ = self.a.memory_stats()
        assert st_["reserved_bytes.all.current"] == 0 and self.dev.used == 0
        assert st_["active.all.current"] == 0
        assert self.a.private_pools() == []


TestAllocatorMachine = AllocatorMachine.TestCase
TestAllocatorMachine.settings = SETTINGS

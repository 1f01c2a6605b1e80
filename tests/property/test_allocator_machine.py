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
import sys
from dataclasses import dataclass, field
from pathlib import Path
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

import graphpool as gp
from graphpool import runtime
from graphpool.device.protocol import CAPTURE_MODE_GLOBAL
from graphpool.errors import CaptureError, OutOfMemoryError
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.private_pools import CaptureRecord, PoolId
from graphpool.sim import SimBackend, xp
from graphpool.sim import capture as sim_capture

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "policy"))
from fakedevice import SHRUNK, FakeDevice

BUDGET = 200_000
STREAMS = (1, 2, 3)
UNSAFE = {"record", "query", "sync", "free"}
EXACT_PEAKS = (
    "allocation",
    "allocated_bytes",
    "requested_bytes",
    "segment",
    "reserved_bytes",
    "active",
    "active_bytes",
)
OTHER_PEAKS = ("inactive_split", "inactive_split_bytes")
KINDS = ("all", "small_pool", "large_pool")

SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)


def rounded(n: int) -> int:
    return SHRUNK.round_size(n)


def overlaps(lo: int, hi: int, ranges: Any) -> bool:
    return any(lo < end and start < hi for start, end in ranges)


@dataclass
class Live:
    nbytes: int
    size: int
    stream: int
    pool: PoolId | None
    uses: set[int] = field(default_factory=set)
    born: int = 0  # the model's clock when it was allocated


@dataclass
class Cap:
    rec: CaptureRecord
    pid: PoolId
    stream: int
    released: bool = False
    begun: int = 0  # the model's clock when the capture began


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
        self.a = CachingAllocator(self.dev, sizes=SHRUNK)
        self.live: dict[int, Live] = {}
        self.active: dict[int, Cap] = {}  # capture id -> active capture
        self.graphs: list[Cap] = []  # captured, not released
        self.blocked: list[Blocked] = []
        self.graph_ids = itertools.count(1)
        self.capture_calls_from: int | None = None  # dev.calls index when captures began
        self.maxima: dict[tuple[Any, str], int] = {}
        self.clock = 0  # counts mallocs and capture begins, in order

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
        self._malloc(nbytes, stream)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self._free(data.draw(st.sampled_from(sorted(self.live))))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free_and_malloc_again(self, data: st.DataObject) -> None:
        """The commonest pattern: a request of the same size on the same stream right after a free."""
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        v = self.live[ptr]
        self._free(ptr)
        self._malloc(v.nbytes, v.stream)

    def _malloc(self, nbytes: int, stream: int) -> None:
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
        if self.a.memory_stats()["num_alloc_retries"] > before["num_alloc_retries"]:
            # the retry released the cache: every pending event was synchronized first
            for b in self.blocked:
                if b.events == "waiting":
                    b.events = None
            self.prune()
        blk = self.a.lookup(ptr)
        assert blk is not None and blk.ptr == ptr and blk.stream == stream
        want = rounded(nbytes)
        if SHRUNK.is_small(want):
            assert blk.size == want
        else:
            assert want <= blk.size <= want + SHRUNK.small_size  # an unsplit rest stays attached
        got = None if blk.pool.owner is None else blk.pool.owner.id
        if cap is None:
            assert got is None, "eager request served from a private pool"
        else:
            assert got == cap.pid, f"capture into {cap.pid} served from {got}"
        lo, hi = ptr, ptr + blk.size
        assert ptr not in self.live
        others = [(p, p + v.size) for p, v in self.live.items()]
        assert not overlaps(lo, hi, others), "overlapping allocations"
        assert not overlaps(lo, hi, self.blocked_ranges()), "memory handed out while kept or awaiting events"
        self.clock += 1
        self.live[ptr] = Live(nbytes, blk.size, stream, got, born=self.clock)

    def _free(self, ptr: int, queue: bool = False) -> None:
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
            eager = mine is None and all(v.born > c.begun for c in self.active.values())
            # SPEC 3: eager memory made after every capture began, on a stream in none of
            # them, is eager code's; anything else outside the captures' pools is kept
            if all(c.pid != v.pool for c in candidates) and not (eager and v.pool is None):
                recs = candidates
        if queue:
            self.a.defer_free(ptr)  # what a finalizer does: no lock, carried out later
        else:
            self.a.free(ptr)
        if recs is not None or events is not None:
            self.blocked.append(Blocked(lo, hi, recs, events))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def finalizer_free(self, data: st.DataObject) -> None:
        """A finalizer queues the free (no lock); the next allocator call carries it out."""
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        self._free(ptr, queue=True)  # the model's bookkeeping, with the free only queued
        assert self.a.lookup(ptr) is not None  # not freed yet
        self.a.memory_stats()  # any call drains the queue
        assert self.a.lookup(ptr) is None

    @rule()
    def reset_accumulated(self) -> None:
        self.a.reset_accumulated()
        st_ = self.a.memory_stats()
        assert all(st_[k] == 0 for k in st_ if k.endswith((".allocated", ".freed")) or k.startswith("num_"))

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
        if not self.active:
            self.capture_calls_from = len(self.dev.calls)
        rec = self.a.begin_capture(pid, lambda: self.dev.begin(stream), stream=stream)
        self.clock += 1
        self.active[rec.capture_id] = Cap(rec, pid, stream, begun=self.clock)

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
                        peak = sts[k + "peak"]
                        assert peak == m, f"{scope} {k}peak is {peak}, highest level seen {m}"
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


# =========================================================================== public API, sim
SIM_MEMORY = 600_000


@dataclass
class Buf:
    buf: Any
    stream: Any
    pattern: int


@dataclass
class Graph:
    g: Any
    out: Any  # the output array, or None once dropped
    value: float
    n: int


class PublicApiMachine(RuleBasedStateMachine):
    """The public API on a small simulated device, patterns verified at every free."""

    @initialize()
    def setup(self) -> None:
        runtime.set_backend("sim", backend=SimBackend(device_count=1, memory_bytes=SIM_MEMORY), sizes=SHRUNK)
        self.dev = runtime.get().device(0)
        self.streams = [gp.default_stream(), gp.Stream(), gp.Stream()]
        self.handles = [gp.graph_pool_handle()]
        self.bufs: list[Buf] = []
        self.graphs: list[Graph] = []
        self.patterns = itertools.count(1)
        self.ooms = 0

    # ------------------------------------------------------------- buffers
    @rule(nbytes=st.integers(0, 60000), si=st.integers(0, 2))
    def alloc(self, nbytes: int, si: int) -> None:
        s = self.streams[si]
        try:
            buf = gp.alloc(nbytes, stream=s)
        except gp.OutOfMemoryError:
            self.ooms += 1
            return
        assert buf.nbytes == nbytes and buf.stream == s
        if nbytes == 0:
            assert buf.ptr == 0 and runtime.allocator(0).lookup(0) is None  # a null buffer (SPEC 2)
        else:
            assert runtime.allocator(0).lookup(buf.ptr).pool.owner is None  # eager: never private memory
        pat = next(self.patterns) % 250 + 1
        if nbytes:
            self.dev.write(buf.ptr, bytes([pat]) * nbytes, s.handle)
        self.bufs.append(Buf(buf, s, pat))

    @precondition(lambda self: self.bufs)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        b = self.bufs.pop(data.draw(st.integers(0, len(self.bufs) - 1)))
        self._verify(b)
        b.buf.free()

    def _verify(self, b: Buf) -> None:
        n = b.buf.nbytes
        if n:
            gp.synchronize()
            got = self.dev.read(b.buf.ptr, n, b.stream.handle)
            assert got == bytes([b.pattern]) * n, "a buffer's contents changed: its memory was shared"

    @precondition(lambda self: self.bufs)
    @rule(data=st.data(), si=st.integers(0, 2))
    def record_stream(self, data: st.DataObject, si: int) -> None:
        b = self.bufs[data.draw(st.integers(0, len(self.bufs) - 1))]
        s = self.streams[si]
        b.buf.record_stream(s)
        if s.handle and b.buf.nbytes:  # s really uses the buffer: it writes the same pattern
            self.dev.write(b.buf.ptr, bytes([b.pattern]) * b.buf.nbytes, s.handle)

    @precondition(lambda self: self.bufs)
    @rule(data=st.data())
    def drop_buffer(self, data: st.DataObject) -> None:
        """Let the finalizer free it (the free is queued and drained by the next call)."""
        b = self.bufs.pop(data.draw(st.integers(0, len(self.bufs) - 1)))
        self._verify(b)
        del b
        gc.collect()

    @rule()
    def empty_cache(self) -> None:
        gp.synchronize()
        gp.empty_cache()

    # ------------------------------------------------------------- graphs
    @rule(
        n=st.integers(1, 4000),
        value=st.integers(-5, 5),
        pool=st.sampled_from(["own", "handle", "mate"]),
        si=st.sampled_from([None, 1, 2]),
        victim=st.booleans(),
        data=st.data(),
    )
    def capture(
        self, n: int, value: int, pool: str, si: int | None, victim: bool, data: st.DataObject
    ) -> None:
        pid: Any = None
        if pool == "handle":
            pid = self.handles[0]
        elif pool == "mate":
            mates = [gr.g for gr in self.graphs]
            if mates:
                pid = data.draw(st.sampled_from(mates)).pool()
        kill = None
        if victim and self.bufs:
            kill = self.bufs.pop(data.draw(st.integers(0, len(self.bufs) - 1)))
            self._verify(kill)
        g = gp.CUDAGraph()
        stream = None if si is None else self.streams[si]
        try:
            with gp.graph(g, pool=pid, stream=stream):
                x = xp.full(n, value)
                y = x + 1
                if kill is not None:
                    # the graph writes into a buffer freed during its capture: kept for the graph
                    if kill.buf.nbytes:
                        self.dev.memset(kill.buf.ptr, 0xEE, kill.buf.nbytes, gp.current_stream().handle)
                    kill.buf.free()
                del x
        except gp.OutOfMemoryError:
            self.ooms += 1
            if kill is not None and not kill.buf.freed:
                kill.buf.free()
            assert not gp.is_current_stream_capturing()
            return
        if pid is not None:
            assert g.pool() == pid
        else:
            assert g.pool().handle == 0 and g.pool().graph > 0
        self.graphs.append(Graph(g, y, float(value + 1), n))

    @precondition(lambda self: self.graphs)
    @rule(data=st.data(), si=st.integers(0, 2))
    def replay(self, data: st.DataObject, si: int) -> None:
        gr = data.draw(st.sampled_from(self.graphs))
        with gp.stream(self.streams[si]):
            gr.g.replay()
            if gr.out is not None:
                got = gr.out.get()
                assert got.shape == (gr.n,)
                assert np.all(got == gr.value), "a replay computed a wrong result"
            else:
                gp.current_stream().synchronize()

    @precondition(lambda self: self.graphs)
    @rule(data=st.data())
    def drop_output(self, data: st.DataObject) -> None:
        gr = data.draw(st.sampled_from(self.graphs))
        gr.out = None
        gc.collect()

    @precondition(lambda self: self.graphs)
    @rule(data=st.data(), collect=st.booleans())
    def reset_graph(self, data: st.DataObject, collect: bool) -> None:
        gr = data.draw(st.sampled_from(self.graphs))
        self.graphs.remove(gr)
        if collect:  # dropped without reset(): the finalizer releases it
            del gr
            gc.collect()
        else:
            gr.g.reset()
            with pytest.raises(gp.CaptureError):
                gr.g.replay()

    @rule(n=st.integers(1, 3000))
    def failed_capture(self, n: int) -> None:
        g = gp.CUDAGraph()
        try:
            with gp.graph(g, pool=self.handles[0]):
                xp.full(n, 3)
                raise KeyError("body failed")
        except KeyError:
            pass
        except gp.OutOfMemoryError:
            self.ooms += 1
        assert not gp.is_current_stream_capturing()
        with pytest.raises(gp.CaptureError):
            g.pool()

    # ------------------------------------------------------------- invariants
    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "dev"):
            return
        gp.check_invariants()
        assert not gp.is_current_stream_capturing()
        assert sim_capture.ongoing() == []
        assert sim_capture.thread_mode() == CAPTURE_MODE_GLOBAL
        st_ = gp.memory_stats()
        assert st_["allocation.all.current"] >= sum(1 for b in self.bufs if b.buf.nbytes)  # null: none

    def teardown(self) -> None:
        if not hasattr(self, "dev"):
            return
        try:
            for b in self.bufs:
                self._verify(b)
                b.buf.free()
            self.bufs.clear()
            for gr in self.graphs:
                gr.out = None
                gr.g.reset()
            self.graphs.clear()
            gc.collect()
            gp.synchronize()
            gp.empty_cache()
            gp.check_invariants()
            assert gp.memory_reserved() == 0, "memory not given back after everything was released"
            assert gp.memory_allocated() == 0
            assert self.dev.allocations() == []
            assert runtime.allocator(0).private_pools() == []
        finally:
            gp.set_backend("sim")


TestPublicApiMachine = PublicApiMachine.TestCase
TestPublicApiMachine.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)

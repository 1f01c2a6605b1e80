"""Private pools for graph capture, on a scripted FakeDevice (docs/behaviour.rst, "Private
pools for graph capture").

A capture here is ``allocator.begin_capture(pid, begin=lambda: dev.begin(s), stream=s)``,
then ``dev.end(s)`` and ``allocator.end_capture(rec)`` (or ``abort_capture``); the graph's
reset is ``release_capture(rec)``.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time

import pytest
from fakedevice import FakeDevice

from graphpool.device.protocol import (
    CAPTURE_MODE_GLOBAL,
    CAPTURE_MODE_RELAXED,
    CAPTURE_MODE_THREAD_LOCAL,
)
from graphpool.errors import CaptureError, DoubleFreeError, OutOfMemoryError
from graphpool.policy import private_pools
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.captures import SWEEP_EVERY
from graphpool.policy.pools import DEFAULT, SizeConfig
from graphpool.policy.private_pools import (
    CaptureRecord,
    PoolId,
    new_graph_pool_id,
    new_shared_pool_id,
)

KiB = 1024
MiB = 1024 * KiB
S1, S2, S3, S4 = 1, 2, 3, 4
P = PoolId(7, 0)
Q = PoolId(8, 0)
H = PoolId(0, 5)
UNSAFE = {"record", "query", "sync", "free"}


def make(total: int = 1 << 34, sizes: SizeConfig = DEFAULT) -> tuple[FakeDevice, CachingAllocator]:
    dev = FakeDevice(total)
    return dev, CachingAllocator(dev, sizes=sizes)


def begin(a: CachingAllocator, dev: FakeDevice, pid: PoolId, stream: int) -> CaptureRecord:
    rec = a.begin_capture(pid, lambda: dev.begin(stream), stream=stream)
    a.check_invariants()
    return rec


def end(a: CachingAllocator, dev: FakeDevice, rec: CaptureRecord) -> None:
    for s, cid in list(dev.capturing.items()):
        if cid == rec.capture_id:
            dev.end(s)
    a.end_capture(rec)
    a.check_invariants()


def abort(a: CachingAllocator, dev: FakeDevice, rec: CaptureRecord) -> None:
    for s, cid in list(dev.capturing.items()):
        if cid == rec.capture_id:
            dev.end(s)
    a.abort_capture(rec)
    a.check_invariants()


def owner(a: CachingAllocator, ptr: int) -> PoolId | None:
    blk = a.lookup(ptr)
    assert blk is not None
    return None if blk.free_list.private_pool is None else blk.free_list.private_pool.id


def pstats(a: CachingAllocator, pid: PoolId) -> dict[str, int]:
    return a.memory_stats(pool=pid)


def ok(a: CachingAllocator) -> None:
    a.check_invariants()


# --------------------------------------------------------------------------- pool ids
def test_pool_id_is_an_immutable_pair() -> None:
    pid = PoolId(3, 0)
    assert tuple(pid) == (3, 0) and pid == (3, 0) and pid.graph == 3 and pid.handle == 0
    with pytest.raises(AttributeError):
        pid.graph = 4  # type: ignore[misc]
    assert hash(pid) == hash((3, 0))
    assert {pid: 1}[PoolId(3, 0)] == 1


@pytest.mark.parametrize("good", [(1, 0), (0, 1), (123, 0), (0, 99), PoolId(2, 0)])
def test_pool_id_coerce_accepts(good: object) -> None:
    pid = PoolId.coerce(good)
    assert isinstance(pid, PoolId) and tuple(pid) == tuple(good)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [(0, 0), (1, 1), (-1, 0), (0, -2), (5, 7)])
def test_pool_id_coerce_rejects_values(bad: tuple[int, int]) -> None:
    expected = f"invalid pool id {tuple(bad)}: exactly one part must be a positive int"
    with pytest.raises(ValueError) as info:
        PoolId.coerce(bad)
    assert str(info.value) == expected


@pytest.mark.parametrize("bad", [None, 3, "1,0", (1,), (1, 0, 0), (1.0, 0), [1, 0], (True, 0)])
def test_pool_id_coerce_rejects_types(bad: object) -> None:
    with pytest.raises(TypeError) as info:
        PoolId.coerce(bad)
    assert str(info.value) == f"a pool id is a pair of ints such as g.pool() returns, not {bad!r}"


def test_private_pool_repr_names_its_id_users_and_segments() -> None:
    dev, a = make()
    rec = begin(a, dev, P, S1)
    a.malloc(4096, stream=S1)
    assert repr(rec.pool) == "PrivatePool((7, 0), use_count=1, segments=1)"
    end(a, dev, rec)
    a.release_capture(rec)


def test_pool_id_counters_increase() -> None:
    g1, g2 = new_graph_pool_id(), new_graph_pool_id()
    h1, h2 = new_shared_pool_id(), new_shared_pool_id()
    assert g1.handle == 0 and g2.handle == 0 and 0 < g1.graph < g2.graph
    assert h1.graph == 0 and h2.graph == 0 and 0 < h1.handle < h2.handle


# --------------------------------------------------------------------------- routing
class CountingDevice(FakeDevice):
    def __init__(self, total: int = 1 << 34) -> None:
        super().__init__(total)
        self.info_calls = 0

    def capture_info(self, stream: int) -> tuple[int, int]:
        self.info_calls += 1
        return super().capture_info(stream)


def test_detection_costs_one_id_query_per_call() -> None:
    dev = CountingDevice()
    a = CachingAllocator(dev)
    ptrs = [a.malloc(n, stream=S1 + n % 3) for n in (10, 5000, 3 * MiB, 12 * MiB)]
    for p in ptrs:
        a.free(p)
    # one capture_id per malloc; none per free (the block's stream may be destroyed by then)
    assert (dev.id_calls, dev.info_calls) == (4, 0)


def test_no_capture_query_while_nothing_captures() -> None:
    dev = CountingDevice()
    a = CachingAllocator(dev, detect=False)
    ptrs = [a.malloc(n, stream=S1 + n % 3) for n in (10, 5000, 3 * MiB, 12 * MiB)]
    for p in ptrs:
        a.free(p)
    a.empty_cache()
    assert dev.info_calls == 0
    assert dev.id_calls == 0
    rec = a.begin_capture(P, lambda: dev.begin(S1), stream=S1)
    a.malloc(10, stream=S1)
    assert dev.id_calls == 1
    dev.end(S1)
    a.end_capture(rec)
    a.malloc(10, stream=S2)
    assert dev.id_calls == 1
    ok(a)


def test_capturing_stream_gets_private_memory_others_do_not() -> None:
    dev, a = make()
    rec = begin(a, dev, P, S1)
    p = a.malloc(1000, stream=S1)
    q = a.malloc(1000, stream=S2)  # eager, while S1 captures
    assert owner(a, p) == P
    assert owner(a, q) is None
    assert a.lookup(p).allocated_in is rec and a.lookup(q).allocated_in is None
    ps = pstats(a, P)
    assert ps["allocation.all.current"] == 1
    assert ps["allocated_bytes.all.current"] == 1024
    assert ps["requested_bytes.all.current"] == 1000
    assert ps["segment.all.current"] == 1 and ps["reserved_bytes.all.current"] == 2 * MiB
    assert ps["num_device_alloc"] == 1
    assert ps["use_count"] == 1
    st = a.memory_stats()  # private pools count into the device totals
    assert st["allocation.all.current"] == 2
    assert st["segment.all.current"] == 2 and st["reserved_bytes.all.current"] == 4 * MiB
    assert st["num_device_alloc"] == 2
    ok(a)
    end(a, dev, rec)
    r = a.malloc(1000, stream=S1)  # eager again on the stream that captured
    assert owner(a, r) is None
    assert a.memory_stats()["num_device_alloc"] == 3
    ok(a)


def test_pool_memory_never_goes_to_eager_code() -> None:
    dev, a = make()
    rec = begin(a, dev, P, S1)
    p = a.malloc(4096, stream=S1)
    a.free(p)  # back to P's free list
    end(a, dev, rec)
    q = a.malloc(4096, stream=S1)  # eager, same stream and size: must not get P's block
    assert q != p and owner(a, q) is None
    ps = pstats(a, P)
    assert ps["allocation.all.current"] == 0 and ps["segment.all.current"] == 1
    ok(a)


def test_joined_stream_allocates_from_the_capture_pool() -> None:
    dev, a = make()
    rec = begin(a, dev, P, S1)
    dev.capturing[S4] = rec.capture_id  # S4 joined the capture through an event
    p = a.malloc(4096, stream=S4)
    q = a.malloc(4096, stream=S2)
    assert owner(a, p) == P and owner(a, q) is None
    end(a, dev, rec)
    assert S4 not in dev.capturing


def test_two_concurrent_captures_route_to_their_own_pools() -> None:
    dev, a = make()
    r1 = begin(a, dev, P, S1)
    r2 = begin(a, dev, Q, S2)
    p = a.malloc(512, stream=S1)
    q = a.malloc(512, stream=S2)
    r = a.malloc(512, stream=S3)
    assert (owner(a, p), owner(a, q), owner(a, r)) == (P, Q, None)
    end(a, dev, r1)
    p2 = a.malloc(512, stream=S1)  # S1 no longer captures
    q2 = a.malloc(512, stream=S2)  # S2 still does
    assert owner(a, p2) is None and owner(a, q2) == Q
    end(a, dev, r2)
    ok(a)


def test_begin_that_raises_changes_nothing() -> None:
    _, a = make()

    def failing() -> int:
        raise RuntimeError("driver refused")

    with pytest.raises(RuntimeError):
        a.begin_capture(P, failing, stream=S1)
    assert a.private_pools() == []
    p = a.malloc(512, stream=S1)
    assert owner(a, p) is None
    a.empty_cache()  # not refused: no capture registered
    ok(a)


# --------------------------------------------------------------------------- frees in capture
def test_block_freed_during_capture_is_reused_in_that_capture() -> None:
    dev, a = make()
    rec = begin(a, dev, P, S1)
    p = a.malloc(4096, stream=S1)
    a.free(p)
    q = a.malloc(4096, stream=S1)
    assert q == p
    ps = pstats(a, P)
    assert ps["num_device_alloc"] == 1 and ps["allocation.all.current"] == 1
    assert ps["allocation.all.allocated"] == 2 and ps["allocation.all.freed"] == 1
    end(a, dev, rec)


def test_shared_pool_block_reused_by_a_later_capture() -> None:
    dev, a = make()
    r1 = begin(a, dev, H, S1)
    t = a.malloc(4096, stream=S1)
    a.free(t)  # a temporary of the first graph
    end(a, dev, r1)
    r2 = begin(a, dev, H, S1)
    u = a.malloc(4096, stream=S1)
    assert u == t and owner(a, u) == H
    assert pstats(a, H)["num_device_alloc"] == 1
    assert pstats(a, H)["use_count"] == 2
    end(a, dev, r2)


def test_own_pool_output_freed_in_a_later_capture_returns_to_the_pool() -> None:
    dev, a = make()
    r1 = begin(a, dev, H, S1)
    out = a.malloc(4096, stream=S1)  # the first graph's output
    end(a, dev, r1)
    r2 = begin(a, dev, H, S1)
    a.free(out)  # consumed by the second graph: goes back to H, not kept
    st = pstats(a, H)
    assert st["active.all.current"] == 0
    assert a.malloc(4096, stream=S1) == out
    end(a, dev, r2)
    ok(a)


def test_ordinary_block_freed_during_capture_is_kept_until_release() -> None:
    dev, a = make()
    e = a.malloc(4096, stream=S2)  # eager, before the capture
    rec = begin(a, dev, P, S1)
    a.free(e)  # freed during the capture (by any stream): kept for the graph
    st = a.memory_stats()
    assert st["allocation.all.current"] == 0
    assert st["allocated_bytes.all.current"] == 0
    assert st["active.all.current"] == 1 and st["active_bytes.all.current"] == 4096
    assert st["requested_bytes.all.current"] == 4096
    assert [b.ptr for b in rec.kept] == [e]
    ok(a)
    x = a.malloc(4096, stream=S2)  # eager code during the capture
    assert x != e
    with pytest.raises(DoubleFreeError):
        a.free(e)
    end(a, dev, rec)
    y = a.malloc(4096, stream=S2)  # eager code after the capture: still kept
    assert y not in (e, x)
    assert a.memory_stats()["active.all.current"] == 3
    ok(a)
    a.release_capture(rec)  # the graph is reset: e returns to the ordinary pool
    st = a.memory_stats()
    assert st["active.all.current"] == 2 and st["active_bytes.all.current"] == 8192
    assert st["requested_bytes.all.current"] == 8192
    ok(a)
    assert a.malloc(4096, stream=S2) == e
    assert a.private_pools() == []  # P never got a segment: gone with its last user
    ok(a)


def test_oom_message_counts_each_kept_block_once() -> None:
    """Blocks kept for captured graphs are summed in the out-of-memory message, each once
    even when two graphs keep it."""
    dev, a = make(total=1 << 30)
    x = a.malloc(4096, stream=S2)
    y = a.malloc(8192, stream=S2)
    g1 = begin(a, dev, P, S1)
    g2 = begin(a, dev, Q, S3)
    g2.thread = -1  # begun by another thread: it may touch x and y as well
    a.free(x)
    a.free(y)  # kept by both graphs
    assert {b.ptr for b in g1.kept} == {b.ptr for b in g2.kept} == {x, y}
    end(a, dev, g1)
    end(a, dev, g2)
    with pytest.raises(OutOfMemoryError, match=r"12\.00 KiB of ordinary blocks kept for captured graphs"):
        a.malloc((1 << 30) + 1, stream=S2)
    a.release_capture(g1)
    a.release_capture(g2)
    ok(a)


def test_pool_block_with_another_stream_user_freed_during_its_pools_capture_is_not_kept() -> None:
    """A block of P that another stream used, freed while a capture into P and one into Q are
    underway, goes back to P once that stream's work is done: neither graph keeps it."""
    dev, a = make()
    g1 = begin(a, dev, P, S1)
    x = a.malloc(4096, stream=S1)  # P's, an output of g1
    end(a, dev, g1)
    a.record_stream(x, S3)
    g2 = begin(a, dev, P, S1)
    g3 = begin(a, dev, Q, S2)
    blk = a.lookup(x)
    a.free(x)
    assert blk not in g2.kept and blk not in g3.kept
    assert a._deferred == [blk]  # its event is recorded once no capture is underway
    end(a, dev, g2)
    end(a, dev, g3)
    a.release_capture(g3)
    dev.complete_all()
    a.malloc(512, stream=S2)  # eager: polls the event
    g4 = begin(a, dev, P, S1)
    assert a.malloc(4096, stream=S1) == x  # back in P
    end(a, dev, g4)
    ok(a)


def test_a_failed_captures_segment_stays_while_the_user_holds_a_block_of_it() -> None:
    dev, a = make()
    keep = begin(a, dev, H, S1)
    a.malloc(KiB, stream=S1)
    end(a, dev, keep)  # H lives
    failed = begin(a, dev, H, S1)
    x = a.malloc(8 * MiB, stream=S1)  # a new 20 MiB segment of the failing capture
    abort(a, dev, failed)
    a.empty_cache()  # the user still holds x: its segment stays
    assert pstats(a, H)["reserved_bytes.all.current"] == 22 * MiB
    assert a.lookup(x).allocated  # type: ignore[union-attr]
    a.free(x)
    a.empty_cache()  # now whole and free: it goes back with the failed capture
    assert pstats(a, H)["reserved_bytes.all.current"] == 2 * MiB
    ok(a)


def test_a_repeated_capture_id_is_refused_and_changes_nothing() -> None:
    """A device that hands out a capture id twice: the second capture is refused, and no
    capture is counted underway once the first ends."""
    dev, a = make()
    rec = begin(a, dev, P, S1)
    with pytest.raises(CaptureError, match=f"^capture id {rec.capture_id} is already registered$"):
        a.begin_capture(Q, lambda: rec.capture_id, stream=S2)
    end(a, dev, rec)
    a.release_capture(rec)
    a.empty_cache()  # allowed: no capture is underway
    assert a.memory_stats()["reserved_bytes.all.current"] == 0 and dev.used == 0
    ok(a)


class _AttachInterrupted(FakeDevice):
    def attach_release(self, stream: int, token: int) -> None:
        raise KeyboardInterrupt


def test_an_adoption_interrupted_while_tying_its_pool_to_the_graph_leaves_no_pool() -> None:
    dev = _AttachInterrupted()
    a = CachingAllocator(dev)
    dev.begin(S1)
    with pytest.raises(KeyboardInterrupt):
        a.adopt_capture(S1, pool=P)
    dev.end(S1)
    assert a.private_pools() == [] and a._captures == {}
    ok(a)


def test_a_capture_collected_mid_capture_on_its_own_thread_is_ended_by_the_next_call() -> None:
    dev, a = make()
    rec = begin(a, dev, P, S1)
    a.malloc(4096, stream=S1)
    a.defer_release(rec)  # its graph was collected mid-capture, on this thread
    a.malloc(512, stream=S2)  # ends the device capture and releases the record
    assert rec.released and dev.capturing == {} and dev.graphs == set()
    ok(a)


def test_a_capture_of_a_live_thread_queued_for_release_waits_for_that_thread() -> None:
    """Only the capturing thread can end its capture: while it runs, the release stays
    queued; once it is gone, the next call releases the record."""
    dev, a = make()
    began: list[CaptureRecord] = []
    done = threading.Event()

    def capturing_thread() -> None:
        began.append(begin(a, dev, P, S1))
        done.wait(10)

    t = threading.Thread(target=capturing_thread)
    t.start()
    try:
        while not began:
            time.sleep(0.001)
        (rec,) = began
        a.defer_release(rec)  # its graph was collected on this thread while that one captures
        a.malloc(512, stream=S2)
        assert not rec.released and dev.capturing == {S1: rec.capture_id}
        assert list(a._pending) == [rec]
    finally:
        done.set()
        t.join()
    a.malloc(512, stream=S2)
    assert rec.released and dev.capturing == {}
    ok(a)


def test_ordinary_block_of_the_capturing_stream_freed_during_capture_is_kept() -> None:
    dev, a = make()
    e = a.malloc(4096, stream=S1)
    a.malloc(4096, stream=S1)
    rec = begin(a, dev, P, S1)
    a.free(e)
    q = a.malloc(4096, stream=S1)  # in the capture: from P, not e
    assert q != e and owner(a, q) == P
    end(a, dev, rec)
    assert a.malloc(4096, stream=S1) != e
    a.release_capture(rec)
    assert a.malloc(4096, stream=S1) == e
    ok(a)


def test_other_private_pool_block_freed_during_capture_is_kept_until_release() -> None:
    dev, a = make()
    r1 = begin(a, dev, P, S1)
    o = a.malloc(4096, stream=S1)  # output of graph 1, pool P
    a.malloc(4096, stream=S1)
    end(a, dev, r1)
    r2 = begin(a, dev, Q, S1)
    a.free(o)  # a P block freed while Q's graph captures: kept for graph 2
    assert a.malloc(4096, stream=S1) != o
    end(a, dev, r2)
    assert pstats(a, P)["active.all.current"] == 2  # o still held
    r3 = begin(a, dev, P, S1)
    assert a.malloc(4096, stream=S1) != o  # not even P's own later captures get it
    end(a, dev, r3)
    a.release_capture(r2)
    ps = pstats(a, P)
    assert ps["active.all.current"] == 2  # the other block of graph 1 and graph 3's block
    assert ps["allocation.all.current"] == 2
    r4 = begin(a, dev, P, S1)
    assert a.malloc(4096, stream=S1) == o
    end(a, dev, r4)
    ok(a)


def test_kept_block_does_not_merge_while_held() -> None:
    dev, a = make()
    e = a.malloc(4096, stream=S2)  # first block of a segment, followed by the free tail
    rec = begin(a, dev, P, S1)
    a.free(e)
    (seg,) = [s for s in a.snapshot() if s["address"] == e]
    assert [(b["size"], b["state"]) for b in seg["blocks"]] == [
        (4096, "active_pending_free"),
        (2 * MiB - 4096, "inactive"),
    ]
    end(a, dev, rec)
    a.empty_cache()  # the segment is not unsplit-free: kept
    assert any(s["address"] == e for s in a.snapshot())
    a.release_capture(rec)
    a.empty_cache()
    assert a.snapshot() == []
    assert a.memory_stats()["reserved_bytes.all.current"] == 0
    ok(a)


def test_abort_capture_gives_kept_blocks_back_and_restores_use_count() -> None:
    dev, a = make()
    r1 = begin(a, dev, H, S1)
    end(a, dev, r1)
    e = a.malloc(4096, stream=S2)
    r2 = begin(a, dev, H, S1)
    a.free(e)
    p = a.malloc(4096, stream=S1)  # the failed graph's block, still referenced by the user
    assert a.memory_stats(pool=H)["use_count"] == 2
    abort(a, dev, r2)
    assert a.memory_stats(pool=H)["use_count"] == 1
    assert a.malloc(4096, stream=S2) == e  # given back at once
    a.free(p)
    a.release_capture(r1)
    a.empty_cache()
    assert a.private_pools() == []
    ok(a)


# --------------------------------------------------------------------------- stream uses in capture
def test_record_stream_block_freed_during_capture_is_deferred_without_device_calls() -> None:
    dev, a = make()
    e = a.malloc(4096, stream=S2)  # ordinary block with an extra user
    a.malloc(4096, stream=S2)
    a.record_stream(e, S3)
    rec = begin(a, dev, P, S1)
    p = a.malloc(4096, stream=S1)  # pool block with an extra user
    a.malloc(4096, stream=S1)
    a.record_stream(p, S3)
    dev.calls.clear()
    a.free(e)
    a.free(p)
    a.malloc(3 * MiB, stream=S1)  # a new segment during capture (relaxed malloc)
    a.malloc(3 * MiB, stream=S2)  # eager malloc during capture: no event polling either
    assert not UNSAFE & set(dev.calls), dev.calls
    assert a.malloc(4096, stream=S1) != p  # p waits for its deferred event
    ps = pstats(a, P)
    assert ps["active.all.current"] == 4  # p (deferred) + 3 live blocks
    ok(a)
    dev.calls.clear()
    end(a, dev, rec)  # the deferred frees now record their events
    assert dev.calls.count("record") == 2
    assert "query" not in dev.calls and "free" not in dev.calls
    ok(a)
    dev.complete_all()
    a.malloc(512, stream=S4)  # polls: p's event done -> back to P
    ps = pstats(a, P)
    assert ps["active.all.current"] == 3
    a.release_capture(rec)  # e: no longer kept, and its event is done -> polled at next malloc
    a.malloc(512, stream=S4)
    st = a.memory_stats()
    assert st["active_bytes.all.current"] == sum(
        b["size"] for s in a.snapshot() for b in s["blocks"] if b["state"] != "inactive"
    )
    assert not any(b["address"] == e and b["state"] != "inactive" for s in a.snapshot() for b in s["blocks"])
    ok(a)


def test_deferred_free_waits_for_every_capture_to_end() -> None:
    dev, a = make()
    r1 = begin(a, dev, P, S1)
    r2 = begin(a, dev, Q, S2)
    p = a.malloc(4096, stream=S1)
    a.record_stream(p, S3)
    dev.calls.clear()
    a.free(p)
    end(a, dev, r1)  # Q still captures: still no event recorded
    assert not UNSAFE & set(dev.calls)
    end(a, dev, r2)
    assert dev.calls.count("record") == 1
    ok(a)


# --------------------------------------------------------------------------- relaxed mode
def test_segment_malloc_always_runs_relaxed_and_restores_mode() -> None:
    dev, a = make()
    a.malloc(512, stream=S1)
    # even with no capture registered: one graphpool has not seen may be underway
    assert dev.mode_log == [CAPTURE_MODE_RELAXED, CAPTURE_MODE_GLOBAL]
    dev.mode_log.clear()
    rec = begin(a, dev, P, S1)
    a.malloc(512, stream=S1)  # new private segment
    assert dev.mode_log == [CAPTURE_MODE_RELAXED, CAPTURE_MODE_GLOBAL]
    assert dev.mode == CAPTURE_MODE_GLOBAL
    a.malloc(512, stream=S1)  # cached: no driver call, no mode change
    assert len(dev.mode_log) == 2
    a.malloc(5 * MiB, stream=S2)  # eager segment while a capture is underway: relaxed too
    assert dev.mode_log[2:] == [CAPTURE_MODE_RELAXED, CAPTURE_MODE_GLOBAL]
    dev.mode = CAPTURE_MODE_THREAD_LOCAL
    a.malloc(5 * MiB, stream=S1)
    assert dev.mode_log[-2:] == [CAPTURE_MODE_RELAXED, CAPTURE_MODE_THREAD_LOCAL]
    assert dev.mode == CAPTURE_MODE_THREAD_LOCAL
    dev.mode = CAPTURE_MODE_GLOBAL
    end(a, dev, rec)
    n = len(dev.mode_log)
    a.malloc(7 * MiB, stream=S1)  # eager segment after the capture: relaxed as well
    assert dev.mode_log[n:] == [CAPTURE_MODE_RELAXED, CAPTURE_MODE_GLOBAL]
    ok(a)


def test_failed_segment_malloc_during_capture_still_restores_mode() -> None:
    dev, a = make(total=5 * MiB)
    rec = begin(a, dev, P, S1)
    with pytest.raises(OutOfMemoryError):
        a.malloc(4 * MiB + 1, stream=S1)  # a 20 MiB segment, then the least one (6 MiB): neither fits
    assert dev.mode == CAPTURE_MODE_GLOBAL
    assert dev.mode_log == [CAPTURE_MODE_RELAXED, CAPTURE_MODE_GLOBAL] * 2
    abort(a, dev, rec)


def test_oom_falls_back_to_the_least_segment_that_fits() -> None:
    dev, a = make(total=16 * MiB)
    p = a.malloc(2 * MiB + 1, stream=S1)  # large: a 20 MiB segment does not fit, 4 MiB does
    assert dev.live == {p: 4 * MiB}
    st = a.memory_stats()
    assert (st["num_ooms"], st["num_alloc_retries"], st["reserved_bytes.all.current"]) == (0, 1, 4 * MiB)
    a.free(p)
    ok(a)


class ExplodingDevice(FakeDevice):
    def malloc(self, nbytes: int) -> int | None:
        raise RuntimeError("driver exploded")


def test_mode_restored_when_the_driver_raises_during_capture() -> None:
    dev = ExplodingDevice()
    a = CachingAllocator(dev)
    rec = a.begin_capture(P, lambda: dev.begin(S1), stream=S1)
    with pytest.raises(RuntimeError):
        a.malloc(512, stream=S1)
    assert dev.mode == CAPTURE_MODE_GLOBAL
    dev.end(S1)
    a.abort_capture(rec)
    ok(a)


# --------------------------------------------------------------------------- OOM / empty_cache in capture
def test_oom_during_capture_releases_nothing() -> None:
    dev, a = make(total=4 * MiB)
    c = a.malloc(512, stream=S2)
    a.free(c)  # a cached, unsplit free ordinary segment (2 MiB)
    rec = begin(a, dev, P, S1)
    p = a.malloc(512, stream=S1)  # private segment: the device is full now
    before = a.memory_stats()
    dev.calls.clear()
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc(MiB + 512, stream=S1)  # needs a 20 MiB segment
    assert "free" not in dev.calls and "sync" not in dev.calls
    assert dev.calls == ["malloc", "malloc"]  # the usual segment, then the least one; no retry
    after = a.memory_stats()
    assert after["num_ooms"] == before["num_ooms"] + 1
    assert after["num_alloc_retries"] == 0
    assert {k for k in after if after[k] != before[k]} == {"num_ooms"}
    assert pstats(a, P)["num_ooms"] == 1
    msg = str(info.value)
    assert "capture" in msg
    assert "2.00 MiB" in msg or "2097152" in msg  # held in the private pool
    assert "4.00 MiB" in msg or "4194304" in msg  # reserved
    ok(a)
    abort(a, dev, rec)
    assert pstats(a, P)["use_count"] == 0  # freeable, p still alive
    a.free(p)
    a.empty_cache()
    st = a.memory_stats()
    assert st["reserved_bytes.all.current"] == 0 and dev.live == {}
    assert a.private_pools() == []
    ok(a)


def test_eager_oom_during_someone_elses_capture_releases_nothing() -> None:
    dev, a = make(total=2 * MiB)
    c = a.malloc(512, stream=S2)
    a.free(c)
    rec = begin(a, dev, P, S1)
    with pytest.raises(OutOfMemoryError):
        a.malloc(512, stream=S3)  # eager, other stream: cache is not released during capture
    assert "free" not in dev.calls
    end(a, dev, rec)
    q = a.malloc(512, stream=S3)  # now the retry may release the cache
    assert a.memory_stats()["num_alloc_retries"] == 1 and a.lookup(q) is not None
    ok(a)


def test_empty_cache_refused_during_capture() -> None:
    dev, a = make()
    p = a.malloc(512, stream=S2)
    a.free(p)
    rec = begin(a, dev, P, S1)
    before = a.memory_stats()
    with pytest.raises(CaptureError, match="capture"):
        a.empty_cache()
    assert a.memory_stats() == before and "free" not in dev.calls
    end(a, dev, rec)
    a.empty_cache()
    assert a.memory_stats()["num_device_free"] == 1
    ok(a)


# --------------------------------------------------------------------------- use counts, release
def test_use_counts_freeable_pools_and_disappearance() -> None:
    dev, a = make()
    r1 = begin(a, dev, H, S1)
    out = a.malloc(4096, stream=S1)  # output of graph 1, kept referenced
    end(a, dev, r1)
    r2 = begin(a, dev, H, S1)
    t = a.malloc(MiB + 512, stream=S1)  # a temporary of graph 2 in a large private segment
    a.free(t)
    end(a, dev, r2)
    assert pstats(a, H)["use_count"] == 2
    assert pstats(a, H)["segment.all.current"] == 2

    a.release_capture(r1)
    assert pstats(a, H)["use_count"] == 1
    a.empty_cache()  # a live graph's pool: untouched
    assert a.memory_stats()["num_device_free"] == 0
    a.release_capture(r1)  # releasing twice is harmless
    assert pstats(a, H)["use_count"] == 1

    a.release_capture(r2)  # freeable now
    assert pstats(a, H)["use_count"] == 0
    a.empty_cache()  # returns the unsplit free large segment, not the one holding `out`
    ps = pstats(a, H)
    assert ps["segment.all.current"] == 1 and ps["num_device_free"] == 1
    assert ps["reserved_bytes.large_pool.current"] == 0
    assert a.lookup(out) is not None  # outputs still referenced stay valid
    assert owner(a, out) == H
    ok(a)

    a.free(out)  # back to H's free list
    assert pstats(a, H)["segment.all.current"] == 1
    a.empty_cache()  # the pool's last segment goes, and the pool with it
    with pytest.raises(ValueError):
        a.memory_stats(pool=H)
    assert a.private_pools() == []
    st = a.memory_stats()
    assert st["reserved_bytes.all.current"] == 0 and st["num_device_free"] == 2
    ok(a)


def test_pool_without_segments_disappears_with_its_last_user() -> None:
    dev, a = make()
    rec = begin(a, dev, P, S1)
    end(a, dev, rec)
    assert [p.id for p in a.private_pools()] == [P]
    a.release_capture(rec)
    assert a.private_pools() == []
    ok(a)


def test_freeable_pool_is_revived_by_a_new_capture() -> None:
    dev, a = make()
    r1 = begin(a, dev, P, S1)
    p = a.malloc(4096, stream=S1)
    a.free(p)
    end(a, dev, r1)
    a.release_capture(r1)
    assert pstats(a, P)["use_count"] == 0  # freeable, its segment still cached
    r2 = begin(a, dev, P, S1)  # PyTorch asserts here; graphpool revives the pool
    assert pstats(a, P)["use_count"] == 1
    q = a.malloc(4096, stream=S1)
    assert q == p and pstats(a, P)["num_device_alloc"] == 1
    a.free(q)
    end(a, dev, r2)
    a.empty_cache()  # revived: no longer freeable, nothing released
    assert pstats(a, P)["segment.all.current"] == 1
    assert a.memory_stats()["num_device_free"] == 0
    a.release_capture(r2)
    a.empty_cache()
    assert a.private_pools() == []
    assert a.memory_stats()["num_device_free"] == 1
    ok(a)


def test_oom_retry_releases_freeable_private_pools() -> None:
    dev, a = make(total=4 * MiB)
    rec = begin(a, dev, P, S1)
    p = a.malloc(4096, stream=S1)
    a.free(p)
    end(a, dev, rec)
    a.release_capture(rec)  # freeable, one free 2 MiB segment
    a.malloc(512, stream=S2)  # the second 2 MiB: device full
    q = a.malloc(512, stream=S3)  # refused -> freeable pool released -> retry
    st = a.memory_stats()
    assert st["num_alloc_retries"] == 1 and st["num_ooms"] == 0 and st["num_device_free"] == 1
    assert owner(a, q) is None
    assert a.private_pools() == []
    ok(a)


def test_oom_retry_does_not_release_live_graph_pools() -> None:
    dev, a = make(total=4 * MiB)
    rec = begin(a, dev, P, S1)
    p = a.malloc(4096, stream=S1)
    a.free(p)
    end(a, dev, rec)  # graph alive: its pool's free segment must stay
    a.malloc(512, stream=S2)
    with pytest.raises(OutOfMemoryError):
        a.malloc(512, stream=S3)
    assert pstats(a, P)["segment.all.current"] == 1
    assert a.memory_stats()["num_device_free"] == 0
    ok(a)


def test_memory_stats_per_pool_exact_figures() -> None:
    dev, a = make()
    a.malloc(3000, stream=S2)  # eager: device totals only
    rec = begin(a, dev, P, S1)
    a.malloc(1000, stream=S1)
    a.malloc(MiB + 1, stream=S1)
    ps = pstats(a, P)
    exp = {
        "allocation.all.current": 2,
        "allocation.small_pool.current": 1,
        "allocation.large_pool.current": 1,
        "allocated_bytes.small_pool.current": 1024,
        "allocated_bytes.large_pool.current": MiB + 512,
        "requested_bytes.all.current": 1000 + MiB + 1,
        "segment.small_pool.current": 1,
        "segment.large_pool.current": 1,
        "reserved_bytes.small_pool.current": 2 * MiB,
        "reserved_bytes.large_pool.current": 20 * MiB,
        "reserved_bytes.all.current": 22 * MiB,
        "active.all.current": 2,
        "active_bytes.all.current": 1024 + MiB + 512,
        "inactive_split.all.current": 2,
        "inactive_split_bytes.small_pool.current": 2 * MiB - 1024,
        "inactive_split_bytes.large_pool.current": 19 * MiB - 512,
        "num_device_alloc": 2,
        "num_device_free": 0,
        "num_ooms": 0,
        "use_count": 1,
    }
    assert {k: ps[k] for k in exp} == exp
    st = a.memory_stats()
    assert st["allocation.all.current"] == 3
    assert st["allocated_bytes.small_pool.current"] == 1024 + 3072
    assert st["reserved_bytes.all.current"] == 24 * MiB
    assert st["num_device_alloc"] == 3
    end(a, dev, rec)
    a.reset_peak()
    a.reset_accumulated()
    ps = pstats(a, P)
    assert ps["allocation.all.allocated"] == 0 and ps["num_device_alloc"] == 0
    assert ps["allocation.all.peak"] == 2
    with pytest.raises(ValueError):
        a.memory_stats(pool=Q)
    ok(a)


def test_snapshot_names_pool_and_owner_graph() -> None:
    dev, a = make()
    rec = a.begin_capture(P, lambda: dev.begin(S1), stream=S1, label="graph#x")
    p = a.malloc(512, stream=S1)
    (seg,) = a.snapshot()
    assert seg["segment_pool_id"] == (7, 0)
    assert seg["blocks"][0]["owner_graph"] == "graph#x" and seg["blocks"][0]["address"] == p
    end(a, dev, rec)
    ok(a)


def test_failed_capture_segments_return_although_the_shared_pool_lives() -> None:
    dev, a = make()
    g = begin(a, dev, H, S1)
    out = a.malloc(4 * KiB, stream=S1)  # the live graph's output: H keeps its segment
    end(a, dev, g)
    failed = begin(a, dev, H, S1)
    big = a.malloc(3 * MiB, stream=S1)  # a 20 MiB segment made by the failing capture alone
    abort(a, dev, failed)
    a.free(big)
    a.empty_cache()
    a.check_invariants()
    st = a.memory_stats(pool=H)
    assert st["segment.all.current"] == 1 and st["reserved_bytes.all.current"] == 2 * MiB
    assert st["use_count"] == 1
    a.free(out)
    a.release_capture(g)
    a.empty_cache()
    assert a.memory_stats()["reserved_bytes.all.current"] == 0


def test_failed_capture_segment_used_by_a_live_capture_stays() -> None:
    dev, a = make()
    failed = begin(a, dev, H, S1)
    big = a.malloc(3 * MiB, stream=S1)
    abort(a, dev, failed)
    a.free(big)
    g = begin(a, dev, H, S1)  # revives H and takes memory of the failed capture's segment
    tmp = a.malloc(3 * MiB, stream=S1)
    assert tmp == big
    a.free(tmp)  # a temporary the graph's kernels touch on every replay
    end(a, dev, g)
    a.empty_cache()
    a.check_invariants()
    assert a.memory_stats(pool=H)["reserved_bytes.all.current"] == 20 * MiB
    a.release_capture(g)
    a.empty_cache()
    assert a.memory_stats()["reserved_bytes.all.current"] == 0


def test_kept_deferred_block_waits_for_its_users_and_the_replay_streams() -> None:
    dev, a = make()
    x = a.malloc(4 * MiB, stream=S1)
    a.record_stream(x, S3)
    g1 = begin(a, dev, P, S2)
    g2 = begin(a, dev, Q, S4)
    g2.thread = -1  # begun by another thread: it may touch x all the same
    blk = a.lookup(x)
    a.free(x)  # kept by g1 and g2 (any underway capture may use it), deferred (S3 uses it)
    assert blk in g1.kept and blk in g2.kept
    end(a, dev, g1)
    g1.replay_streams.add(S4)  # g1 was replayed on S4
    a.release_capture(g1)  # while g2 still captures: the events wait
    end(a, dev, g2)
    a.release_capture(g2)
    assert sorted(a._waiting) == [S3, S4]  # both the extra user and the replay stream
    assert a.malloc(4 * MiB, stream=S1) != x
    dev.complete_all()
    assert a.malloc(4 * MiB, stream=S1) == x
    ok(a)


def test_failed_capture_segment_touched_by_a_live_capture_stays() -> None:
    dev, a = make()
    keep = begin(a, dev, H, S1)
    a.malloc(KiB, stream=S1)
    end(a, dev, keep)  # H lives
    failed = begin(a, dev, H, S1)
    x = a.malloc(8 * MiB, stream=S1)  # a 20 MiB segment of the failing capture; the user keeps x
    abort(a, dev, failed)
    g = begin(a, dev, H, S1)
    a.free(x)  # g's body reads x and drops it: g's kernels touch that memory on every replay
    end(a, dev, g)
    before = pstats(a, H)["segment.all.current"]
    a.empty_cache()
    assert pstats(a, H)["segment.all.current"] == before
    ok(a)


def test_two_failed_captures_in_a_row_leak_nothing() -> None:
    dev, a = make()
    keep = begin(a, dev, H, S1)
    a.malloc(KiB, stream=S1)
    end(a, dev, keep)
    reserved = a.memory_stats()["reserved_bytes.all.current"]
    for _ in range(2):
        f = begin(a, dev, H, S1)
        y = a.malloc(8 * MiB, stream=S1)
        abort(a, dev, f)
        a.free(y)
    a.empty_cache()
    assert a.memory_stats()["reserved_bytes.all.current"] == reserved
    ok(a)


def test_nested_captures_of_one_thread_each_keep_an_eager_block() -> None:
    dev, a = make()
    x = a.malloc(4 * MiB, stream=S3)
    g1 = begin(a, dev, P, S1)
    g2 = begin(a, dev, Q, S2)
    a.free(x)  # either graph may read it
    end(a, dev, g2)
    a.release_capture(g2)
    assert a.malloc(4 * MiB, stream=S3) != x  # g1 still holds it
    end(a, dev, g1)
    a.release_capture(g1)
    assert a.malloc(4 * MiB, stream=S3) == x
    ok(a)


# --------------------------------------------------------------------------- found by the machine
class StreamsDie(FakeDevice):
    """A fake device whose streams can be destroyed: recording an event there fails."""

    def __init__(self) -> None:
        super().__init__()
        self.destroyed: set[int] = set()

    def record_event(self, event: int, stream: int) -> None:
        if stream in self.destroyed:
            from graphpool.errors import CUDAError

            raise CUDAError("cudaEventRecord", 400, "cudaErrorInvalidResourceHandle")
        super().record_event(event, stream)


def test_free_after_record_stream_on_a_dead_stream_while_another_device_captures() -> None:
    from graphpool.policy.private_pools import CaptureWorld

    world = CaptureWorld()
    dev0, dev1 = FakeDevice(), StreamsDie()
    a0, a1 = CachingAllocator(dev0, world=world), CachingAllocator(dev1, world=world)
    p = a1.malloc(1000, stream=S1)
    a1.record_stream(p, S2)
    dev1.destroyed.add(S2)
    rec = begin(a0, dev0, P, S3)
    a1.free(p)  # no device synchronize now (a capture is underway): kept until it ends
    assert a1.lookup(p) is None and a1.memory_stats()["active_bytes.all.current"] == 1024
    ok(a1)
    end(a0, dev0, rec)
    q = a1.malloc(1000, stream=S1)  # the device is synchronized once, then the block is free
    assert q == p and "device_sync" in dev1.calls
    ok(a1)
    ok(a0)


def test_record_streamed_free_inside_a_detected_capture_is_kept() -> None:
    dev, a = make()
    a.free(a.malloc(1000, stream=S3))  # cached: the allocations below take no slow path (it sweeps)
    x = a.malloc(1000, stream=S1)
    a.record_stream(x, S2)
    dev.begin(S1)  # a capture begun outside graphpool
    t = a.malloc(2000, stream=S1)  # detected at its first allocation
    a.free(x)  # kept for its graph, and its event deferred until no capture is underway
    assert a._capturing == 1 and x not in [b.ptr for b in a._small]
    a.free(t)
    dev.end(S1)
    held = [a.malloc(1000, stream=S3) for _ in range(SWEEP_EVERY - 1)]
    assert a._capturing == 1  # allocations elsewhere ask only every SWEEP_EVERY-th time
    a.free(held.pop())  # a free that would keep its block asks first (one query per such capture)
    assert a._capturing == 0
    for p in held:
        a.free(p)
    assert a.malloc(1000, stream=S1) != x  # still kept: its graph is alive
    (token,) = dev.attached
    dev.release(token)  # the graph and its execs are destroyed
    a.memory_stats()
    dev.complete_all()
    a.empty_cache()
    ok(a)


def test_releasing_a_graph_leaves_another_graphs_release_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """A graphpool capture has no release token: releasing it forgets no token of a capture
    begun outside graphpool (here the process's first token, 1)."""
    monkeypatch.setattr(private_pools, "_tokens", itertools.count(1))
    dev, a = make()
    dev.begin(S2)
    foreign = a.adopt_capture(S2, pool=Q)
    assert foreign.token == 1 and dev.attached == {1: S2}
    out = a.malloc(KiB, stream=S2)
    dev.end(S2)
    a.end_adopted(foreign)
    native = begin(a, dev, P, S1)
    end(a, dev, native)
    a.release_capture(native)
    dev.release(1)  # the foreign graph is destroyed: its pool goes once empty
    a.memory_stats()
    assert foreign.released
    a.free(out)
    a.empty_cache()
    assert a.private_pools() == []
    ok(a)


def test_a_free_during_a_detected_capture_is_kept_and_statistics_notice_its_end() -> None:
    """An eager block made before a detected capture and freed during it is kept for its
    graph; a statistics call notices the capture's end at once (no SWEEP_EVERY wait)."""
    dev, a = make()
    x = a.malloc(1000, stream=S2)
    dev.begin(S1)
    a.free(a.malloc(2000, stream=S1))  # detected
    a.free(x)
    assert a._capturing == 1 and x not in [b.ptr for b in a._small]
    dev.end(S1)
    a.memory_stats()  # statistics notice the end at once
    assert a._capturing == 0 and a.malloc(1000, stream=S2) != x  # kept: its graph is alive
    (token,) = dev.attached
    dev.release(token)
    a.memory_stats()
    assert a.malloc(1000, stream=S2) == x
    ok(a)


def test_detection_never_queries_the_legacy_stream() -> None:
    """The legacy stream cannot capture, so an allocation on it asks nothing (CuPy's default
    stream); any other stream is asked once per allocation."""
    from graphpool.device.protocol import LEGACY_STREAM
    from graphpool.policy import allocator

    assert allocator._LEGACY == LEGACY_STREAM  # the compiled-in copy of the constant
    dev, a = make()
    a.free(a.malloc(1000, stream=LEGACY_STREAM))
    assert dev.id_calls == 0
    a.free(a.malloc(1000, stream=S1))
    assert dev.id_calls == 1
    ok(a)


def test_a_destroyed_graphs_capture_stops_without_a_query_of_its_stream() -> None:
    """A library captures on a stream of its own, ends, destroys the graph, then the stream:
    graphpool's next sweep takes the graph's release first and never asks about the stream."""
    dev, a = make()
    dev.begin(S1)
    a.free(a.malloc(1000, stream=S1))  # detected and adopted
    a.free(a.malloc(1000, stream=S2))  # S2's cache is warm: its allocations take no slow path
    (token,) = dev.attached
    dev.end(S1)
    dev.release(token)  # the graph and its execs are destroyed
    dev.destroyed.add(S1)  # then the stream (a query of it may crash CUDA)
    dev.queried.clear()
    for _ in range(SWEEP_EVERY + 1):
        a.free(a.malloc(1000, stream=S2))
    assert a._capturing == 0 and not a._foreign
    assert S1 not in dev.queried
    a.memory_stats()
    ok(a)


def test_out_of_memory_after_a_detected_capture_ended_releases_the_cache() -> None:
    """A capture begun outside graphpool ended, and the allocations since have not yet swept
    (SWEEP_EVERY): an allocation the driver refuses must notice the end before it decides
    that a capture is underway, and release the cache and retry as with no capture."""
    dev, a = make(total=23 * MiB)
    a.free(a.malloc(20 * MiB, stream=S2))  # a cached segment of stream S2
    dev.begin(S1)
    a.free(a.malloc(1000, stream=S1))  # detected: a private pool of 2 MiB
    dev.end(S1)
    assert a._capturing == 1  # not noticed yet
    p = a.malloc(20 * MiB, stream=S3)  # the driver refuses: the end is noticed, the cache released
    assert a._capturing == 0 and a.memory_stats()["num_alloc_retries"] == 1
    a.free(p)
    ok(a)


def test_adopting_at_a_record_streamed_free_does_not_merge_the_block_being_freed() -> None:
    """The free of a record_stream'd block whose user stream captures unseen adopts that
    capture first; adopting polls destroyed graphs, and a released graph's kept neighbour
    goes back to the free list. It must not merge the block being freed (not yet in any free
    list, about to be kept for the adopted capture): that block's memory would be handed out
    while the new graph may use it."""
    dev, a = make()
    k = a.malloc(1000, stream=S1)
    x = a.malloc(1000, stream=S1)  # right after k, in k's segment
    a.record_stream(x, S2)
    dev.begin(S3)
    a.free(a.malloc(1000, stream=S3))  # a capture begun outside graphpool, detected
    a.free(k)  # kept for its graph
    dev.end(S3)
    a.memory_stats()  # its end noticed
    (token,) = dev.attached
    dev.release(token)  # its graph destroyed; not polled yet
    dev.begin(S2)  # x's user stream captures unseen
    a.free(x)  # adopts S2's capture (polling the release: k goes back), keeps x for it
    ok(a)
    assert a._capturing == 1
    y = a.malloc(2000, stream=S1)  # k's memory, not x's
    assert not (y <= x < y + 2048)
    a.free(y)
    ok(a)


def test_a_queued_record_streamed_free_adopting_a_capture_still_counts_as_made_during_an_ended_one() -> None:
    """A record_stream'd block's free queued during a capture begun outside graphpool, carried
    out after that capture ended (not yet noticed) while the user stream captures anew: the
    new capture is adopted, and the block is kept for the ended one's graph too."""
    dev, a = make()
    x = a.malloc(1000, stream=S1)
    a.record_stream(x, S2)
    dev.begin(S3)
    a.free(a.malloc(1000, stream=S3))  # detected
    (first,) = a._captures.values()
    a.defer_free(x)  # queued during it
    dev.end(S3)
    dev.begin(S2)  # x's user stream captures, unseen
    a.record_stream(a.malloc(1000, stream=S1), S4)  # carries out the queued free
    assert x in [b.ptr for b in first.kept] and any(
        x in [b.ptr for b in r.kept] for r in a._captures.values()
    )
    ok(a)


# ---------------------------------------------------------------- frees during a capture
# Three rules, each once broken: an ordinary block allocated during a capture on a stream
# outside it is kept for the graph, not returned at once; a released graph records no
# replay-stream event into a capture not seen yet; a free after a detected capture ended is
# not kept for it.


def _capture(a: CachingAllocator, dev: FakeDevice, kind: str) -> CaptureRecord:
    """A capture on S1 underway, begun the way ``kind`` says."""
    if kind == "graphpool":
        return begin(a, dev, P, S1)
    dev.begin(S1)
    if kind == "adopted":  # a framework's hook registers it at its beginning
        return a.adopt_capture(S1)
    a.free(a.malloc(1000, stream=S1))  # detected at its first allocation
    (rec,) = a._captures.values()
    return rec


def _release(a: CachingAllocator, dev: FakeDevice, rec: CaptureRecord) -> None:
    """The capture ended and its graph is gone."""
    if rec.foreign:
        dev.end(S1)
        dev.release(rec.token)
        a.memory_stats()  # notices the release
    else:
        end(a, dev, rec)
        a.release_capture(rec)
    assert rec.released


@pytest.mark.parametrize("kind", ["graphpool", "adopted", "detected"])
@pytest.mark.parametrize("nbytes", [1000, 3 * MiB])
@pytest.mark.parametrize("expandable", [False, True])
@pytest.mark.parametrize("queued", [False, True])
def test_an_ordinary_block_made_during_a_capture_and_freed_in_it_is_kept(
    kind: str, nbytes: int, expandable: bool, queued: bool
) -> None:
    """Made during the capture on another stream (S2, which it never allocates on: the old
    rule's "eager memory of eager code"), freed before it ends: graphpool cannot see whether
    a captured kernel uses it, so it is kept for the graph until the graph goes. Small and
    large pools, fixed and expandable segments, every kind of capture, a free made at once
    or queued by a finalizer."""
    dev, a = make(sizes=dataclasses.replace(DEFAULT, expandable_segments=expandable))
    rec = _capture(a, dev, kind)
    x = a.malloc(nbytes, stream=S2)  # ordinary memory, allocated during the capture
    assert owner(a, x) is None
    if queued:
        a.defer_free(x)
        a.memory_stats()
    else:
        a.free(x)
    assert [b.ptr for b in rec.kept] == [x]
    y = a.malloc(nbytes, stream=S2)
    assert y != x  # not handed out while the graph may write it
    ok(a)
    _release(a, dev, rec)
    z = a.malloc(nbytes, stream=S2)
    assert z == x  # back in S2's free list with the graph gone
    a.free(y)
    a.free(z)
    ok(a)


def test_only_a_block_of_an_underway_captures_own_pool_goes_back_at_once() -> None:
    """Two captures underway: a block of one's pool goes back to that pool (pool sharing); a
    block of a pool no underway capture allocates from is kept for both."""
    dev, a = make()
    old = begin(a, dev, Q, S3)
    out = a.malloc(1000, stream=S3)  # an earlier graph's output, in pool Q
    end(a, dev, old)
    r1, r2 = begin(a, dev, P, S1), begin(a, dev, H, S2)
    t = a.malloc(1000, stream=S1)
    a.free(t)
    assert a.malloc(1000, stream=S1) == t  # reused by its own capture at once
    a.free(out)  # consumed by the captures: kept for both
    assert [b.ptr for b in r1.kept] == [out] and [b.ptr for b in r2.kept] == [out]
    ok(a)
    for r in (r1, r2):
        end(a, dev, r)
        a.release_capture(r)
    a.release_capture(old)
    ok(a)


def test_a_graph_released_while_its_replay_stream_captures_unseen_records_no_event_into_it() -> None:
    """A graph's kept block waits for an event on each stream the graph replayed on. When it
    is released while one of them captures, in a capture begun outside graphpool and not seen
    yet, the event would go into that capture (every later query of it fails: allocations
    and empty_cache raise cudaErrorCapturedEvent for good). The release asks first: it
    adopts that capture and records the event once the capture has ended."""
    dev, a = make()
    x = a.malloc(1000, stream=S1)
    g = begin(a, dev, P, S3)
    a.free(x)  # kept for g
    end(a, dev, g)
    g.replay_streams.add(S2)  # g replayed on S2
    dev.begin(S2)  # a library's capture on S2, no allocation in it yet
    a.release_capture(g)
    assert not dev.captured and a._capturing == 1  # adopted, nothing recorded into it
    ok(a)
    dev.end(S2)
    a.memory_stats()  # its end noticed: the event is recorded now, on a stream that is not capturing
    assert [s for _, s in dev.recorded] == [S2] and not dev.captured
    dev.complete_all()
    assert a.malloc(1000, stream=S1) == x  # back once the event completed
    a.empty_cache()  # nothing raises
    ok(a)


def test_a_deferred_free_flushed_while_its_stream_captures_unseen_adopts_it_without_a_leak() -> None:
    """A record_stream'd block freed during a capture waits (deferred) until no capture is
    underway. When the last one ends, its user stream captures in a capture begun outside
    graphpool after the free and not seen yet: the flush asks the stream before recording,
    adopts that capture (no event goes into it), and the block waits on until it ends. The
    adopted pool is released once the framework destroys that graph: nothing leaks or wedges."""
    dev, a = make()
    g = begin(a, dev, P, S1)
    x = a.malloc(1000, stream=S1)
    a.record_stream(x, S2)
    a.free(x)  # its pool's own block: not kept for g, its event deferred
    dev.begin(S2)  # a library's capture on x's user stream, no allocation in it
    end(a, dev, g)  # the flush: S2 is asked first, its capture adopted
    assert not dev.recorded and a._capturing == 1
    (adopted,) = [p for p in a.private_pools() if p.id != P]
    assert adopted.use_count == 1 and adopted.segment_count == 0
    assert a.memory_stats()["active_bytes.all.current"] == 1024  # x waits
    ok(a)
    dev.end(S2)
    a.memory_stats()  # its end noticed: the event is recorded now, on a stream not capturing
    assert [s for _, s in dev.recorded] == [S2] and not dev.captured and a._capturing == 0
    assert adopted.use_count == 1  # its graph lives (the framework holds it)
    (token,) = dev.attached
    dev.release(token)  # the framework destroys that graph and its execs
    a.memory_stats()
    assert [p.id for p in a.private_pools()] == [P]
    a.release_capture(g)
    dev.complete_all()
    a.empty_cache()
    assert a.private_pools() == [] and a.memory_stats()["reserved_bytes.all.current"] == 0
    ok(a)


def test_a_queued_release_carried_out_by_an_unseen_captures_first_allocation_records_nothing_in_it() -> None:
    """The graph is collected (its release queued) and the first allocation inside a capture
    on its replay stream carries the release out: it asks the device about its stream
    first, so the capture is adopted before the release's event is due."""
    dev, a = make()
    x = a.malloc(1000, stream=S1)
    g = begin(a, dev, P, S3)
    a.free(x)
    end(a, dev, g)
    g.replay_streams.add(S2)
    dev.begin(S2)
    a.defer_release(g)
    t = a.malloc(1000, stream=S2)  # detected, then the queue drained
    assert owner(a, t) is not None and g.released and not dev.recorded
    a.free(t)
    dev.end(S2)
    (token,) = dev.attached
    dev.release(token)
    a.memory_stats()
    assert not dev.captured and [s for _, s in dev.recorded] == [S2]
    dev.complete_all()
    a.empty_cache()
    ok(a)


def test_a_queued_free_drained_by_the_first_allocation_of_an_unseen_capture_is_kept_for_it() -> None:
    """An eager block dropped (queued) during a capture begun outside graphpool, before the
    capture's first allocation: the allocation detects the capture before it carries the
    free out, so the block is kept for the graph (its kernels may have used it)."""
    dev, a = make()
    a.free(a.malloc(1000, stream=S2))  # S2's cache warm
    x = a.malloc(1000, stream=S2)
    dev.begin(S1)
    a.defer_free(x)
    a.malloc(1000, stream=S1)  # detected, then the queued free
    (rec,) = a._captures.values()
    assert [b.ptr for b in rec.kept] == [x]
    ok(a)


@pytest.mark.parametrize("why", ["dead", "legacy"])
def test_an_event_waits_while_its_stream_captures_in_a_capture_that_cannot_be_adopted(why: str) -> None:
    """A stream in a capture graphpool cannot register (one whose thread died, so it never
    ends), or the legacy stream while CUDA refuses to say (a blocking stream captures):
    the block waits with its streams and no event is recorded; an allocation with no
    capture underway asks again, and records once the stream is free."""
    dev, a = make()
    x = a.malloc(1000, stream=S1)
    g = begin(a, dev, P, S3)
    a.free(x)
    end(a, dev, g)
    user = 0 if why == "legacy" else S2
    g.replay_streams.add(user)
    if why == "legacy":
        dev.implicit = True
    else:
        a._dead.add(dev.begin(S2))
    a.release_capture(g)
    assert not dev.recorded and a._capturing == 0
    assert a.memory_stats()["active_bytes.all.current"] == 1024  # x waits
    a.free(a.malloc(1000, stream=S4))  # asks again: still capturing
    assert not dev.recorded
    ok(a)
    dev.implicit = False
    dev.end(S2)
    a.free(a.malloc(1000, stream=S4))  # asks again: the event is recorded now
    assert [s for _, s in dev.recorded] == [user] and not dev.captured
    dev.complete_all()
    a.free(a.malloc(1000, stream=S4))
    assert a.memory_stats()["active_bytes.all.current"] == 0
    ok(a)


@pytest.mark.parametrize("how", ["malloc", "empty_cache"])
def test_an_orphan_asked_again_adopts_a_capture_begun_on_its_stream_and_touches_no_event(how: str) -> None:
    """A block waits without an event (an orphan) while its user stream is in a capture that
    cannot be adopted. That capture is torn down and a library begins a new one on the
    stream, unseen. The next eager allocation (or empty_cache) asks the orphan's stream
    again and adopts that capture: a capture is underway from then on, so the same call must
    not go on to query or synchronize the other waiting events (the allocation raised
    CaptureError; empty_cache synchronized inside the capture) nor free device memory."""
    dev, a = make()
    x = a.malloc(1000, stream=S1)
    a.record_stream(x, S2)
    y = a.malloc(1000, stream=S1)
    a.record_stream(y, S3)
    g = begin(a, dev, P, S4)
    a._dead.add(dev.begin(S2))  # S2 in a capture that can never end (its thread died)
    a.free(x)  # kept for g, its event deferred
    end(a, dev, g)  # S2 still in the dead capture: x waits without an event
    a.free(y)  # an event on S3, pending
    assert a._orphans and a._capturing == 0
    dev.end(S2)  # the dead capture is torn down...
    dev.begin(S2)  # ...and a library begins a capture on S2, not seen yet
    n = len(dev.calls)
    if how == "malloc":
        a.malloc(1000, stream=S1)  # eager: asks x's stream again first
    else:
        with pytest.raises(CaptureError, match="underway"):
            a.empty_cache()
    assert a._capturing == 1 and not dev.captured  # adopted, nothing recorded into it
    assert not set(dev.calls[n:]) & UNSAFE
    ok(a)
    dev.end(S2)
    a.memory_stats()  # its end noticed: x's event is recorded now
    assert [s for _, s in dev.recorded] == [S3, S2] and not dev.captured
    (token,) = dev.attached
    dev.release(token)
    a.release_capture(g)
    dev.complete_all()
    a.empty_cache()
    assert a.private_pools() == []
    assert a.memory_stats()["active_bytes.all.current"] == (1024 if how == "malloc" else 0)
    ok(a)


def test_an_eager_free_after_a_detected_capture_ended_is_not_kept_for_its_graph() -> None:
    """A capture begun outside graphpool ended; no allocation has swept since (SWEEP_EVERY).
    A free made now of a block the capture could have used, had it been freed during it,
    asks the device first: the capture is over, so the block goes back at once. A free
    queued by a finalizer is kept all the same: it may have been queued during the capture."""
    dev, a = make()
    x, y = a.malloc(1000, stream=S2), a.malloc(1000, stream=S2)
    dev.begin(S1)
    a.free(a.malloc(1000, stream=S1))  # detected
    (rec,) = a._captures.values()
    dev.end(S1)  # not noticed yet
    a.defer_free(y)  # a finalizer's free, of unknown moment
    a.free(x)  # drains y first (kept), then asks: ended, so x goes back
    assert a._capturing == 0 and [b.ptr for b in rec.kept] == [y]
    assert a.malloc(1000, stream=S2) == x
    ok(a)


def test_a_capture_found_by_an_allocation_is_labelled_by_its_id_and_stream() -> None:
    """A capture begun outside graphpool and found by an allocation on its stream has no label
    of its own: it is named by its capture id and stream (history, messages)."""
    dev, a = make()
    cid = dev.begin(S3)
    a.free(a.malloc(1000, stream=S3))  # detected and adopted
    (rec,) = a._captures.values()
    assert rec.foreign and rec.label == f"capture {cid} on stream 0x{S3:x}"
    dev.end(S3)
    ok(a)


def test_a_record_streamed_free_keeps_the_block_for_the_capture_its_user_stream_is_in() -> None:
    """The free of a block used on S2 (record_stream) while S2 captures unseen: the capture is
    adopted before the free decides, so the block is kept for that graph (its kernels may use
    it on every replay), not only deferred until the capture ends."""
    dev, a = make()
    x = a.malloc(1000, stream=S1)
    a.record_stream(x, S2)
    dev.begin(S2)
    a.free(x)
    (rec,) = a._captures.values()
    assert rec.foreign and [b.ptr for b in rec.kept] == [x]
    dev.end(S2)
    ok(a)


def test_use_on_oom_never_hands_a_block_of_exactly_max_split_size_to_a_smaller_request() -> None:
    """The use_on_oom fallback keeps the oversize rule: a MemPool's free block of exactly
    max_split_size is oversize, and a request under max_split_size may not take it. (A
    capture underway elsewhere skips the retry's cache release, which would give the
    MemPool's free segment back first.)"""
    from fakedevice import SHRUNK

    from graphpool.policy.private_pools import PoolSpec, mempools

    m = 6 * 8192  # max_split_size; SHRUNK's segments round to 8 KiB
    dev, a = make(total=m + 8192, sizes=dataclasses.replace(SHRUNK, max_split_size=m))
    pid = PoolId(0, 996)
    mempools[pid] = PoolSpec(None, True)  # a MemPool made with use_on_oom
    try:
        a.ensure_pool(pid)
        a.enter_pool(pid)
        x = a.malloc(m - 512, stream=S1)  # a segment of m, not split (512 B would remain)
        a.exit_pool(pid)
        assert a.lookup(x).size == m  # type: ignore[union-attr]
        a.free(x)
        g = begin(a, dev, P, S2)
        with pytest.raises(OutOfMemoryError):
            a.malloc(3 * 8192, stream=S1)  # the device is full; m is oversize for it
        ok(a)
        end(a, dev, g)
        a.release_capture(g)
    finally:
        mempools.pop(pid, None)

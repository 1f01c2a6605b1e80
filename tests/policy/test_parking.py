"""Parking (policy/heap.py, Note [Parking]) on the plain policy, with a stand-in for the
PyTorch shim's lane: the cases the random programs of tests/property (the allocator machine,
the lane differential) reach rarely or never. Each pins one decision of ``park``,
``_takes_back``, ``drop`` or the settling with a lane.
"""

from __future__ import annotations

import dataclasses
import random
import threading

import pytest
from fakedevice import FakeDevice

from graphpool.errors import DoubleFreeError, GraphpoolError
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.pools import SizeConfig
from graphpool.policy.private_pools import PoolId, PoolSpec, mempools

S1, S2 = 1, 2  # stream handles (any ints but 0 work for the policy)


def make() -> CachingAllocator:
    return CachingAllocator(FakeDevice(1 << 34))


def test_a_park_where_best_fit_would_hand_out_another_block_queues_instead() -> None:
    """A free 512-byte block lies below: the next 512-byte request gets it, not the block
    given back (which merges with the segment's free tail), so that block is not parked."""
    a = make()
    low = a.malloc(512, stream=S1)
    mid = a.malloc(512, stream=S1)
    top = a.malloc(512, stream=S1)  # the segment's free tail follows
    a.free(low)
    assert a.park(top) == 0  # queued: best fit would differ
    assert a._parked is None
    assert a.malloc(512, stream=S1) == low
    a.free(mid)
    a.check_invariants()


def test_a_block_the_lane_handed_out_again_is_dropped_as_a_live_one() -> None:
    """While a lane holds the parked block it may hand it out again, and its new owner's free
    may come as a ``drop``: queued like any live allocation's, carried out once settled."""
    a = make()
    p = a.malloc(512, stream=S1)
    calls: list[int] = []

    def lane(ptr: int, requested: int) -> tuple[int, bool]:
        if ptr:  # armed for the block just parked (the answer is not read)
            return 0, False
        calls.append(1)
        return 3, True  # handed out three times, out now

    a.set_lane(lane)
    assert a.park(p) == 512
    a.drop(p)  # not refused: the lane's tensor owns it
    assert list(a._pending) == [p] and calls == []  # queued, as drop queues: no lock taken
    before = a.memory_stats()  # settles: the block is live again, then the queued free runs
    assert calls == [1]
    assert before["allocated_bytes.all.current"] == 0
    assert before["allocation.all.allocated"] == 1 + 3
    a.check_invariants()


def test_while_a_block_is_parked_a_stranger_is_still_refused_at_once() -> None:
    a = make()
    p = a.malloc(512, stream=S1)
    q = a.malloc(512, stream=S1)
    assert a.park(p) == 512
    with pytest.raises(GraphpoolError):
        a.drop(q + 512)  # no live allocation there
    with pytest.raises(GraphpoolError):
        a.park(q + 512)
    assert a.lookup(q) is not None
    a.free(q)
    assert a.malloc(512, stream=S1) == p  # both freed and merged: the segment's start
    a.check_invariants()


TINY = SizeConfig(  # a small layout's rules: 8 KiB small segments, 32 KiB large ones
    min_block=512,
    small_size=2048,
    small_segment=8192,
    large_segment=32768,
    min_large_alloc=16384,
    round_large=8192,
)
CONFIGS = {
    "plain": TINY,
    "max_split_size": dataclasses.replace(TINY, max_split_size=32768),
    "divisions": dataclasses.replace(TINY, roundup_power2_divisions=(4,) * 16),
    "expandable": dataclasses.replace(TINY, expandable_segments=True),
}
SIZES = (1, 100, 512, 1000, 1536, 2048, 2560, 5000, 8192, 12000, 16384, 20000, 32768, 40000)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_park_parks_exactly_when_a_queued_free_would_hand_the_block_back_whole(name: str) -> None:
    """``_takes_back`` against its definition, on random layouts of two streams' blocks: run
    each layout twice, once parking a live block, once freeing it; the next request of its
    size and stream gets the same address both ways, and a block of its request's rounded
    size was parked exactly when the freed side hands out that very block at that size."""
    rng = random.Random(name)
    parked = 0
    for _ in range(120):
        mallocs = [(rng.choice(SIZES), rng.choice((S1, S2))) for _ in range(rng.randint(1, 9))]
        frees = [rng.random() < 0.5 for _ in mallocs]
        pick = rng.random()
        sides = []
        for way in ("park", "free"):
            a = CachingAllocator(FakeDevice(1 << 34), sizes=CONFIGS[name])
            ptrs = [a.malloc(n, stream=s) for n, s in mallocs]
            live = [i for i, f in enumerate(frees) if not f] or [0]
            for i, f in enumerate(frees):
                if f and i not in live:
                    a.free(ptrs[i])
            k = live[int(pick * len(live))]
            p, (n, s) = ptrs[k], mallocs[k]
            size = a.lookup(p).size
            out = 0
            if way == "park":
                out = a.park(p)
            else:
                a.free(p)
            a.check_invariants()  # (a parked block among them)
            q = a.malloc(n, stream=s)
            sides.append((out, q, a.lookup(q).size, p, size))
            a.check_invariants()
        (out, q, _, p, size), (_, q2, size2, _, _) = sides
        assert q == q2  # parking changes no address
        cfg = CONFIGS[name]
        rounded = cfg.round_divisions(n) if cfg.roundup_power2_divisions else cfg.round_size(n)
        oversize = cfg.max_split_size is not None and size >= cfg.max_split_size  # (not parked)
        whole = q2 == p and size2 == size == rounded and not oversize  # (nor a larger block)
        whole = whole and not cfg.expandable_segments  # (nor a block of a growing segment)
        assert out == (n if whole else 0), (mallocs, frees, k)
        parked += out != 0
    assert parked >= (0 if CONFIGS[name].expandable_segments else 20)  # (both answers reached)


def test_only_the_same_request_on_the_same_stream_takes_the_parked_block_back() -> None:
    """Another stream, another requested size of the same block size, or an owned block: the
    parked block's free is carried out first, and the request is served as it would be then."""
    a = make()
    p = a.malloc(1000, stream=S1)
    assert a.park(p) == 1000
    q = a.malloc(1000, stream=S2)  # another stream: never this block
    assert q != p and a._parked is None and a.lookup(p) is None
    a.free(q)
    p = a.malloc(1000, stream=S1)
    assert a.park(p) == 1000
    assert a.malloc(1024, stream=S1) == p  # best fit gives it back, for the new request
    assert a.lookup(p).requested == 1024
    assert a.memory_stats()["requested_bytes.all.current"] == 1024
    assert a.park(p) == 1024
    blk = a.malloc_owned(1024, stream=S1)  # a DeviceBuffer's: never the parked raw allocation
    assert blk.ptr == p and blk.owned and a._parked is None
    a.check_invariants()
    a.free_owned(blk)
    a.check_invariants()
    assert a.memory_stats()["allocated_bytes.all.current"] == 0


def test_taking_the_parked_block_back_counts_a_free_and_an_allocation() -> None:
    a = make()
    for n in (1000, 3 << 20):  # (counters that do not start at 0)
        a.free(a.malloc(n, stream=S2))
    small = a.malloc(1000, stream=S1)
    large = a.malloc(3 << 20, stream=S1)
    for p, n, pool in ((small, 1000, "small_pool"), (large, 3 << 20, "large_pool")):
        st0 = a.memory_stats()
        serial = a.lookup(p).serial
        assert a.park(p) == n
        assert a.malloc(n, stream=S1) == p
        st = a.memory_stats()
        size = a.lookup(p).size
        assert a.lookup(p).serial > serial  # a new allocation, in the allocation order
        for key, d in (
            ("allocation", 1),
            ("allocated_bytes", size),
            ("requested_bytes", n),
        ):
            for counter in ("allocated", "freed"):
                assert st[f"{key}.{pool}.{counter}"] - st0[f"{key}.{pool}.{counter}"] == d
                assert st[f"{key}.all.{counter}"] - st0[f"{key}.all.{counter}"] == d
            assert st[f"{key}.{pool}.current"] == st0[f"{key}.{pool}.current"]
            assert st[f"{key}.{pool}.peak"] == st0[f"{key}.{pool}.peak"]
        assert st["inactive_split.all.allocated"] == st0["inactive_split.all.allocated"]  # no churn
    a.check_invariants()


def test_a_lane_that_handed_the_block_out_and_back_is_counted_then_the_park_is_a_free() -> None:
    a = make()
    p = a.malloc(1000, stream=S1)
    q = a.malloc(1000, stream=S1)
    answers = [(2, False)]
    a.set_lane(lambda ptr, requested: (0, False) if ptr else answers.pop())  # twice out and back
    assert a.park(p) == 1000
    st = a.memory_stats()  # settles: 2 hand-outs counted; any other call frees a parked block
    assert a._parked is None and a.lookup(p) is None and answers == []
    assert st["allocation.all.allocated"] == 2 + 2 and st["allocation.all.freed"] == 2 + 1
    assert st["requested_bytes.all.freed"] == 3 * 1000
    assert st["allocated_bytes.small_pool.freed"] == 3 * 1024
    assert a.malloc(1000, stream=S1) == p  # best fit
    a.set_lane(None)
    a.free(p)
    a.free(q)
    a.check_invariants()
    assert a.memory_stats()["allocated_bytes.all.current"] == 0


def test_set_lane_refuses_what_cannot_be_called_and_changes_nothing() -> None:
    a = make()
    p = a.malloc(1000, stream=S1)
    with pytest.raises(TypeError, match="set_lane: a lane is a callable"):
        a.set_lane(5)  # type: ignore[arg-type]
    assert a.park(p) == 1000 and a.memory_stats()["allocated_bytes.all.current"] == 0
    a.check_invariants()


def test_a_lane_that_fails_to_arm_leaves_the_free_queued_and_the_allocator_usable() -> None:
    a = make()
    p = a.malloc(1000, stream=S1)
    a.set_lane(lambda: (0, False))  # type: ignore[arg-type,misc]  # cannot take (ptr, requested)
    with pytest.raises(TypeError):
        a.park(p)
    assert a._parked is None and list(a._pending) == [p]
    a.set_lane(None)
    assert a.memory_stats()["allocated_bytes.all.current"] == 0  # the free was carried out
    a.check_invariants()


def test_set_lane_settles_with_the_lane_it_replaces() -> None:
    a = make()
    p = a.malloc(1000, stream=S1)
    a.set_lane(lambda ptr, requested: (1, True))  # the lane handed it out: live now
    assert a.park(p) == 1000
    a.set_lane(None)
    assert a._parked is None and a.lookup(p) is not None  # filed by address again
    assert a.memory_stats()["allocation.all.allocated"] == 2
    a.free(p)
    a.check_invariants()


def test_park_refuses_what_is_no_live_raw_allocation() -> None:
    a = make()
    p = a.malloc(1000, stream=S1)
    with pytest.raises(GraphpoolError):
        a.park(p + 512)
    with pytest.raises(TypeError, match="expected an int device address"):
        a.park(str(p))
    assert a.park(p) == 1000
    with pytest.raises(GraphpoolError, match="freed already"):
        a.park(p)  # the first free stands: queued
    a.check_invariants()
    assert a.memory_stats()["allocated_bytes.all.current"] == 0


def test_drop_queues_a_live_allocations_free_for_the_next_call() -> None:
    a = make()
    p = a.malloc(512, stream=S1)
    a.drop(p)
    assert list(a._pending) == [p] and a.lookup(p) is not None  # not carried out yet
    assert a.memory_stats()["allocated_bytes.all.current"] == 0
    assert a.lookup(p) is None


def test_park_never_waits_while_the_lock_is_held_or_a_call_is_under_way() -> None:
    """Another thread holds the lock, or a call of this thread is under way (a finalizer
    run inside it): the free is queued, as drop's, and 0 says nothing was parked."""
    a = make()
    p = a.malloc(512, stream=S1)
    q = a.malloc(512, stream=S1)
    held, done = threading.Event(), threading.Event()

    def holder() -> None:
        with a._held:
            held.set()
            done.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    try:
        assert a.park(p) == 0
    finally:
        done.set()
        t.join()
    a._busy = True
    try:
        assert a.park(q) == 0
    finally:
        a._busy = False
    assert list(a._pending) == [p, q] and a._parked is None
    assert a.memory_stats()["allocated_bytes.all.current"] == 0


def test_no_park_while_a_use_mem_pool_entry_is_open_nor_of_an_owned_block() -> None:
    a = make()
    pid = PoolId(0, 918)
    mempools[pid] = PoolSpec(None, False)
    try:
        a.ensure_pool(pid)
        p = a.malloc(512, stream=S1)  # the ordinary pool's (before the entry)
        a.enter_pool(pid)
        try:
            assert a.park(p) == 0  # queued: an entry is open (no capture)
        finally:
            a.exit_pool(pid)
        a.enter_pool(pid)
        try:
            q = a.malloc(512, stream=S1)  # the MemPool's
        finally:
            a.exit_pool(pid)
        assert a.park(q) == 0  # a private pool's block: queued, even with the entry closed
        blk = a.malloc_owned(512, stream=S1)
        assert a.park(blk) == 0  # a DeviceBuffer's block: freed, never parked
        assert a._parked is None
        a.check_invariants()
        assert a.memory_stats()["allocated_bytes.all.current"] == 0
    finally:
        mempools.pop(pid, None)


def test_a_lane_that_calls_back_into_the_allocator_is_refused_by_name() -> None:
    a = make()
    p = a.malloc(512, stream=S1)

    def lane(ptr: int, requested: int) -> tuple[int, bool]:
        a.set_lane(None)  # re-enters: the lock is held for the arming and the settling
        return 0, False

    a.set_lane(lane)
    with pytest.raises(GraphpoolError, match=r"^graphpool: set_lane re-entered the allocator"):
        a.park(p)  # parked, then the lane armed: refused by name


def test_best_fit_past_the_merged_neighbour_is_what_decides() -> None:
    """The block given back would merge with its free neighbour (the smallest fit, skipped as
    part of it); the next fit, a 512-byte block above, is smaller than the merged block: best
    fit would hand that out, so the block is not parked."""
    a = make()
    p, n, m, o, z = (a.malloc(512, stream=S1) for _ in range(5))
    a.free(n)
    a.free(o)
    assert a.park(p) == 0
    assert a.malloc(512, stream=S1) == o
    for x in (m, z):
        a.free(x)
    a.check_invariants()


def test_no_park_while_the_history_records() -> None:
    """The history records every free as it happens: a recorded free is never parked."""
    a = make()
    p = a.malloc(512, stream=S1)
    a.record_history(100, stacks=False)
    assert a.park(p) == 0
    a.record_history(None)
    assert a.memory_stats()["allocated_bytes.all.current"] == 0


def test_a_block_gone_before_park_took_the_lock_is_refused_as_a_free() -> None:
    """park looks the address up before it takes the lock; were the block freed meanwhile (by
    another thread), its body refuses it as ``free`` would."""
    a = make()
    p = a.malloc(512, stream=S1)
    a.free(p)
    with pytest.raises(DoubleFreeError, match=r"^free: 0x[0-9a-f]+ is not allocated on device 0"):
        a._park(p)


def test_no_park_for_a_stale_route_nor_while_a_free_is_queued() -> None:
    """``parkable=False`` (the PyTorch hooks' route went stale) queues; so does a free queued
    before (the next malloc carries it out first: a better fit may appear)."""
    a = make()
    p = a.malloc(512, stream=S1)
    q = a.malloc(512, stream=S1)
    assert a.park(p, False) == 0
    assert list(a._pending) == [p]
    assert a.park(q) == 0  # p's free is still queued
    assert a.memory_stats()["allocated_bytes.all.current"] == 0

"""Self-tests of the invariant checker (policy/check.py): one corruption per check.

``build()`` makes one allocator state that has a bit of everything (split segments,
several free blocks of one stream, a block waiting on an event, spare Block objects, a
live private pool with small and large segments, a freeable pool, a graph keeping a
block, and optionally a capture still underway with a deferred free). Each case below
corrupts exactly one thing a check guards and asserts ``check_invariants`` names it.

To add a check: write a ``corrupt_*`` helper (it receives the ``State`` and may use its
named blocks) and add a ``Case`` to ``CASES`` with the message fragment the check raises.
A check that cannot fire without an earlier check firing first is listed with the
earlier check's message and says so in ``note``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
from fakedevice import SHRUNK, FakeDevice

from graphpool.policy import check
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.block import Block, ExpandableSegment, iter_segment
from graphpool.policy.check import check_invariants
from graphpool.policy.freelist import Bins, FreeList
from graphpool.policy.private_pools import CaptureRecord, PoolId, PoolSpec, PrivatePool, mempools
from graphpool.policy.stats import PoolStats

S1, S2, S3, S4, S5 = 1, 2, 3, 4, 5
P = PoolId(7, 0)  # the live pool (its graph is alive, or its capture underway)
Q = PoolId(8, 0)  # a freeable pool (its graph was reset; segments remain)
R = PoolId(10, 0)  # a pool whose one segment its live outputs fill


@dataclass
class State:
    dev: FakeDevice
    a: CachingAllocator
    rec: CaptureRecord  # the capture into P (active when built with capturing=True)
    free_first: Block  # free, at the front of an S1 small segment (neighbour allocated)
    free_tail: Block  # free, at the end of the same segment
    allocated: Block  # allocated, between them
    large_alloc: Block  # allocated, front of a large S1 segment
    large_tail: Block  # its free remainder
    waiting: Block  # freed after record_stream: held by a pending event
    kept: Block  # an ordinary block freed during the capture: kept by the graph
    private_small: Block  # allocated in P's small pool
    extra: dict[str, Block] = field(default_factory=dict)
    restore: list[Callable[[], None]] = field(default_factory=list)  # undo module patches

    def segment_of(self, block: Block) -> list[Block]:
        head = block
        while head.prev is not None:
            head = head.prev
        return iter_segment(head)


def build(capturing: bool = False, keep: bool = True) -> State:
    """The rich state. ``capturing``: P's capture still underway. ``keep``: the capture
    frees an ordinary block, which its graph keeps (a hold no event or deferral explains)."""
    dev = FakeDevice()
    a = CachingAllocator(dev, sizes=SHRUNK)
    # S3: a small segment carved in 16 blocks then freed: 15 spare Block objects, enough
    # for every split below to leave some over.
    for ptr in [a.malloc(512, stream=S3) for _ in range(16)]:
        a.free(ptr)
    # S1 small segment (8192): x1..x4 of 1024 each and a 4096 remainder.
    x1, x2, x3, x4 = (a.malloc(1024, stream=S1) for _ in range(4))
    a.free(x3)
    a.free(x4)  # merges x3, x4 and the remainder
    a.free(x1)  # [free 1024][x2][free 6144]
    # S1 large segment: [8192 allocated][32768 free]
    y = a.malloc(8192, stream=S1)
    # A block on S2 used on S3, freed: held by a pending event on S3.
    z = a.malloc(1024, stream=S2)
    a.malloc(1024, stream=S2)  # keeps z from merging with the remainder
    a.record_stream(z, S3)
    a.free(z)
    # Pool Q: captured, reset: freeable, its segment kept.
    rq = a.begin_capture(Q, lambda: dev.begin(S5), stream=S5)
    q1 = a.malloc(2048, stream=S5)
    dev.end(S5)
    a.end_capture(rq)
    a.free(q1)
    a.release_capture(rq)
    # Pool R: one small segment filled by four live outputs of a graph still alive.
    rr = a.begin_capture(R, lambda: dev.begin(S5), stream=S5)
    for _ in range(4):
        a.malloc(2048, stream=S5)
    dev.end(S5)
    a.end_capture(rr)
    # Pool P: a capture on S4 with small and large private segments.
    k = a.malloc(512, stream=S2) if keep else 0  # an ordinary block the capture frees: kept
    rec = a.begin_capture(P, lambda: dev.begin(S4), stream=S4)
    p_small = a.malloc(1024, stream=S4)
    d = a.malloc(1024, stream=S4)  # freed after record_stream: deferred until the capture ends
    a.malloc(30000, stream=S4)
    a.record_stream(d, S3)
    if keep:
        a.free(k)
    a.free(d)
    if not capturing:
        dev.end(S4)
        a.end_capture(rec)
    check_invariants(a)  # the state itself is sound
    blk = a._active
    first = _find(a, x1)
    st = State(
        dev=dev,
        a=a,
        rec=rec,
        free_first=first,
        free_tail=first.next.next,  # type: ignore[union-attr]
        allocated=blk[x2],
        large_alloc=blk[y],
        large_tail=blk[y].next,  # type: ignore[arg-type]
        waiting=_find(a, z),
        kept=_find(a, k) if keep else blk[x2],
        private_small=blk[p_small],
    )
    assert st.free_first.ptr == x1 and not st.free_first.allocated
    assert st.free_tail.next is None and st.free_tail.size == 6144
    assert st.waiting.holds == 1
    assert not keep or st.kept.holds == 1
    assert len(a._spare) > 0  # spare Block objects to corrupt the list of
    assert Q in a._freeable and P in a._pools and R in a._pools and R not in a._freeable
    return st


def _find(a: CachingAllocator, ptr: int) -> Block:
    for base in a._seg_bases:
        for b in iter_segment(a._segments[base]):
            if b.ptr == ptr:
                return b
    raise LookupError(hex(ptr))


def _fl(st: State, block: Block) -> tuple[FreeList, int]:
    """The free list filing ``block`` and its index in its stream's bins."""
    fl = block.free_list
    bins = fl.bins[block.stream]
    return fl, next(i for i, b in enumerate(bins.blocks) if b is block)


def _detached(st: State, pool: FreeList, stream: int = S1) -> Block:
    """A Block object in no segment (as a spare is)."""
    return Block(1 << 50, 512, stream, pool)


def _swap_stats(st: State, edit: Callable[[dict[str, int]], None]) -> None:
    """Make the checker read the device's statistics through ``edit`` (for the checks of
    as_dict's own output; PoolStats may be compiled, so no subclass)."""
    target = st.a.stats
    original = check._flat

    def doctored(stats: PoolStats) -> dict[str, int]:
        out = original(stats)
        if stats is target:
            edit(out)
        return out

    check._flat = doctored
    st.restore.append(lambda: setattr(check, "_flat", original))


# --------------------------------------------------------------------- corruptions
def corrupt_seg_bases(st: State) -> None:
    st.a._seg_bases.reverse()


def corrupt_head_prev(st: State) -> None:
    st.free_first.prev = _detached(st, st.free_first.free_list)


def corrupt_alignment(st: State) -> None:
    st.free_tail.size += 1


def corrupt_empty(st: State) -> None:
    st.free_tail.size = 0


def corrupt_pool_mix(st: State) -> None:
    st.allocated.free_list = st.a._large


def corrupt_gap(st: State) -> None:
    st.free_tail.ptr += 512
    st.free_tail.size -= 512


def corrupt_back_link(st: State) -> None:
    st.allocated.next.prev = None  # type: ignore[union-attr]


def corrupt_unmerged(st: State) -> None:
    """Split the free tail into two free blocks, both filed: the checker must want them merged."""
    b = st.free_tail
    fl, _ = _fl(st, b)
    fl.remove(b)
    half = Block(b.ptr + 512, b.size - 512, b.stream, fl)
    b.size = 512
    b.next, half.prev = half, b
    fl.insert(b)
    fl.insert(half)


def corrupt_bins_length(st: State) -> None:
    st.free_first.free_list.bins[S1].sizes.append(1 << 20)


def corrupt_bins_order(st: State) -> None:
    bins = st.free_first.free_list.bins[S1]
    bins.sizes.reverse()
    bins.blocks.reverse()


def corrupt_filed_twice(st: State) -> None:
    fl, i = _fl(st, st.free_first)
    bins = fl.bins[S1]
    bins.sizes.insert(i, bins.sizes[i])
    bins.blocks.insert(i, bins.blocks[i])


def corrupt_wrong_stream(st: State) -> None:
    fl = st.free_first.free_list
    fl.bins[99] = fl.bins.pop(S1)


def corrupt_size_mismatch(st: State) -> None:
    fl, i = _fl(st, st.free_tail)
    fl.bins[S1].sizes[i] += 512


def corrupt_find_cache(st: State) -> None:
    """FreeList.find's kept answer names bins that are not its stream's."""
    fl = st.free_first.free_list
    fl._last_stream = S1
    fl._last_bins = Bins()


def corrupt_allocated_filed(st: State) -> None:
    st.free_first.allocated = True


def corrupt_held_filed(st: State) -> None:
    st.free_first.holds = 1


def corrupt_wrong_freelist(st: State) -> None:
    """File S1's small free blocks in the large free list (in place of its own S1 bins)."""
    st.a._large.bins[S1] = st.a._small.bins.pop(S1)


def corrupt_two_freelists(st: State) -> None:
    """A private pool sharing the ordinary small free list: its blocks are filed twice.

    The only way to file a block in two free lists without first filing it in one that
    is not its pool (caught earlier) is one FreeList object listed twice."""
    st.a._pools[P].small = st.a._small


def corrupt_unfiled(st: State) -> None:
    st.free_first.free_list.remove(st.free_first)


def corrupt_untracked(st: State) -> None:
    del st.a._active[st.allocated.ptr]


def corrupt_owned_free(st: State) -> None:
    """A free block still marked as a DeviceBuffer's: its stale owner could free it again."""
    st.free_tail.owned = True


def corrupt_negative_holds(st: State) -> None:
    st.allocated.holds = -1


def corrupt_spare_in_use(st: State) -> None:
    st.a._spare.append(st.allocated)


def corrupt_spare_whole_segment_in_use(st: State) -> None:
    p = st.a.malloc(24576, stream=S2)  # a large segment of one block: no neighbours
    st.a._spare.append(st.a._active[p])


def corrupt_spare_filed(st: State) -> None:
    spare = _detached(st, st.a._small)
    st.a._small.insert(spare)
    st.a._spare.append(spare)


def corrupt_spare_twice(st: State) -> None:
    spare = _detached(st, st.a._small)
    st.a._spare += [spare, spare]


def corrupt_tracked_count(st: State) -> None:
    st.a._active[1 << 51] = st.allocated


def corrupt_stat_current(st: State) -> None:
    st.a.stats.small.allocation_cur += 1


def corrupt_stat_peak(st: State) -> None:
    """as_dict() reports peak = max(peak, current): only a wrong as_dict can break it."""
    _swap_stats(st, lambda d: d.__setitem__("allocation.small_pool.peak", 0))


def corrupt_stat_negative(st: State) -> None:
    """A negative current level differs from the blocks' tally (never negative) first."""
    st.a.stats.small.inactive_split_cur = -1


def corrupt_stat_all_sum(st: State) -> None:
    """as_dict() computes ``all`` as the sum of the kinds: only a wrong as_dict can break it."""
    _swap_stats(st, lambda d: d.__setitem__("allocation.all.freed", d["allocation.all.freed"] + 1))


def corrupt_stat_all_peak(st: State) -> None:
    st.a.stats.all_peak.allocation += 100


def corrupt_private_stat(st: State) -> None:
    st.a._pools[P].stats.large.reserved_bytes_cur += 512


def corrupt_segment_count(st: State) -> None:
    st.a._pools[P].segment_count += 1


def corrupt_use_count(st: State) -> None:
    st.a._pools[P].use_count = -1


def corrupt_freeable_sync(st: State) -> None:
    st.a._freeable[P] = st.a._pools[P]


def corrupt_empty_freeable(st: State) -> None:
    pid = PoolId(9, 0)
    empty = PrivatePool(pid)
    st.a._pools[pid] = empty
    st.a._freeable[pid] = empty


def corrupt_freeable_unregistered(st: State) -> None:
    st.a._freeable[PoolId(9, 0)] = PrivatePool(PoolId(9, 0))


def corrupt_orphan_segment(st: State) -> None:
    del st.a._pools[R]


def corrupt_capture_count(st: State) -> None:
    st.a._capturing += 1


def corrupt_capture_inactive(st: State) -> None:
    st.rec.active = False


def corrupt_capture_released(st: State) -> None:
    st.rec.released = True


def corrupt_extra_waiting(st: State) -> None:
    st.a._waiting[S3].append(st.a._waiting[S3][0])


def corrupt_extra_deferred_during_capture(st: State) -> None:
    st.a._deferred.append(st.allocated)


def corrupt_deferred_left(st: State) -> None:
    """A deferral left after the captures ended, with a hold that accounts for it."""
    st.a._deferred.append(st.kept)
    st.kept.holds += 1


def _record(st: State, pool: PrivatePool, seq: int) -> CaptureRecord:
    rec = CaptureRecord(pool, "fake", 0, seq)
    rec.stream, rec.capture_id = 77, 12345
    return rec


def corrupt_world_below(st: State) -> None:
    st.a._world.active = 0


def corrupt_capture_id(st: State) -> None:
    st.rec.capture_id += 1


def corrupt_capture_not_recorded(st: State) -> None:
    del st.a._records[st.rec.sequence]


def corrupt_foreign_stream(st: State) -> None:
    st.a._foreign[99] = st.rec


def corrupt_foreign_unregistered(st: State) -> None:
    fake = _record(st, st.a._pools[P], 999)
    fake.foreign = True
    st.a._foreign[77] = fake


def corrupt_record_released(st: State) -> None:
    st.rec.released = True


def corrupt_record_pool(st: State) -> None:
    st.a._records[999] = _record(st, PrivatePool(PoolId(9, 0)), 999)


def corrupt_record_token(st: State) -> None:
    st.rec.foreign, st.rec.token = True, 5


def corrupt_orphan_token(st: State) -> None:
    st.a._tokens[999] = st.rec


def corrupt_use_count_records(st: State) -> None:
    st.a._pools[P].use_count += 1


def corrupt_fresh_without_creator(st: State) -> None:
    st.a._pools[P].returnable.add(st.segment_of(st.private_small)[0])


def corrupt_record_fresh(st: State) -> None:
    st.rec.returnable_count += 1


def corrupt_creator_not_fresh(st: State) -> None:
    st.a._pools[P].returnable.clear()


def corrupt_hold_elsewhere(st: State) -> None:
    st.a._deferred.append(_detached(st, st.allocated.free_list))


def corrupt_allocated_held(st: State) -> None:
    st.allocated.holds += 1
    st.a._deferred.append(st.allocated)


def _expandable(st: State) -> ExpandableSegment:
    """Give the state an allocator with expandable segments instead: on S1 one segment of
    [allocated 20480 of 24576][allocated 9216][free 7168], and one on S2 (the checks of
    expandable segments run only where some exist)."""
    a = CachingAllocator(FakeDevice(), sizes=dataclasses.replace(SHRUNK, expandable_segments=True))
    a.malloc(20000, stream=S1)
    last = a.malloc(9000, stream=S1)
    a.malloc(30000, stream=S2)
    check_invariants(a)
    st.a = a
    st.extra["last"] = a._active[last]
    return a._exp_of[(False, S1)]


def corrupt_exp_index(st: State) -> None:
    seg = _expandable(st)
    del st.a._exp_of[(seg.is_small, seg.stream)]


def corrupt_exp_misfiled(st: State) -> None:
    _expandable(st).stream = S3


def corrupt_exp_no_segment(st: State) -> None:
    _expandable(st)
    ghost = ExpandableSegment(1 << 47, 1 << 20, 8192, S4, False)
    st.a._exp[ghost.base] = ghost
    st.a._exp_of[(False, S4)] = ghost


def corrupt_exp_pool(st: State) -> None:
    """The large segment filed as the small kind's: its blocks are in the other free list."""
    seg = _expandable(st)
    del st.a._exp_of[(False, S1)]
    seg.is_small = True
    st.a._exp_of[(True, S1)] = seg


def corrupt_ordinary_stream(st: State) -> None:
    """An allocated block of an ordinary segment moved to another stream (only expandable
    segments lend blocks across streams)."""
    st.allocated.stream = S4


def corrupt_exp_tiling(st: State) -> None:
    _expandable(st).mapped += st.a._gran


def corrupt_exp_reservation(st: State) -> None:
    seg = _expandable(st)
    seg.reserved = seg.mapped - st.a._gran


def corrupt_exp_granules(st: State) -> None:
    seg = _expandable(st)
    last = st.extra["last"]  # make it the last block, allocated, 512 bytes longer
    rest = last.next
    assert rest is not None and not rest.allocated
    rest.free_list.remove(rest)
    last.next = None
    last.size += rest.size + 512
    seg.mapped += 512
    st.a.stats.kind(False).add("inactive_split", -1)
    st.a.stats.kind(False).add("inactive_split_bytes", -rest.size)


@dataclass(frozen=True)
class Case:
    corrupt: Callable[[State], None]
    message: str  # a fragment of the AssertionError's text
    capturing: bool = False  # build the state with the capture still underway
    keep: bool = True  # build the state with a block kept by the graph
    note: str = ""  # the check this case targets, when an earlier one must fire instead


def corrupt_half_eager(st: State) -> None:
    pool = st.a._pools[P]
    pool.eager_small = FreeList(True, pool, True)


def corrupt_list_owner(st: State) -> None:
    st.a._pools[P].large.private_pool = st.a._pools[R]


def corrupt_eager_flag(st: State) -> None:
    st.a._pools[P].small.eager = True


def corrupt_private_grows(st: State) -> None:
    st.a._pools[P].small.grows = True


def corrupt_empty_entry_stack(st: State) -> None:
    st.a._thread_pools[12345] = []


def corrupt_entered_gone(st: State) -> None:
    st.a._thread_pools[12345] = [PrivatePool(PoolId(0, 999), PoolSpec(None, False))]


def corrupt_entered_graph_pool(st: State) -> None:
    st.a._thread_pools[12345] = [st.a._pools[P]]


def corrupt_entry_count(st: State) -> None:
    st.a._entered = 1


def corrupt_graph_pool_held(st: State) -> None:
    pool = st.a._pools[P]
    pool.held = True
    pool.use_count += 1


def corrupt_eager_in_capture(st: State) -> None:
    """A MemPool's eager block marked as handed to a capture."""
    pid = PoolId(0, 998)
    mempools[pid] = PoolSpec(None, False)
    st.restore.append(lambda: mempools.pop(pid, None))
    a = st.a
    a.ensure_pool(pid)
    a.enter_pool(pid)
    ptr = a.malloc(512, stream=S1)
    a.exit_pool(pid)
    check_invariants(a)  # sound so far
    a._active[ptr].allocated_in = st.rec


def corrupt_oversize_threshold(st: State) -> None:
    st.a.stats.oversize_at = 1 << 20  # not max_split_size (none is set)


def corrupt_pool_oversize_threshold(st: State) -> None:
    st.a._pools[P].stats.oversize_at = 1 << 20


def corrupt_oversize_current(st: State) -> None:
    st.a.stats.oversize["oversize_allocations"][0] += 1  # no block is oversize


def corrupt_oversize_peak(st: State) -> None:
    """as_dict() copies the peak as kept: a peak below current needs a wrong counter."""
    st.a.stats.oversize["oversize_segments"][1] = -1


def corrupt_oversize_accumulated(st: State) -> None:
    st.a.stats.oversize["oversize_allocations"][2] += 1  # one handed out, never freed, not current


def _park(st: State, block: Block) -> None:
    """Park ``block`` as ``park`` would (heap.py, Note [Parking])."""
    del st.a._active[block.ptr]
    st.a._parked = block


def corrupt_parked_filed(st: State) -> None:
    st.a._parked = st.allocated  # parked, and still filed by address


def corrupt_parked_private(st: State) -> None:
    _park(st, st.private_small)


def corrupt_parked_with_uses(st: State) -> None:
    _park(st, st.allocated)
    st.allocated.stream_uses = {S4}  # its free would wait for S4's work


def corrupt_parked_while_capturing(st: State) -> None:
    _park(st, st.allocated)


def corrupt_parked_unrequested(st: State) -> None:
    _park(st, st.allocated)
    st.allocated.requested = 0  # (every parked block answers a request of at least a byte)


CASES: dict[str, Case] = {
    "parked filed": Case(corrupt_parked_filed, "parked block also filed, or gone"),
    "parked private": Case(corrupt_parked_private, "a private pool's block parked"),
    "parked with uses": Case(corrupt_parked_with_uses, "parked wrongly"),
    "parked unrequested": Case(corrupt_parked_unrequested, "parked wrongly"),
    "parked while capturing": Case(
        corrupt_parked_while_capturing,
        "a block parked while a capture, a use_mem_pool entry or the history is on",
        capturing=True,
    ),
    "half eager side": Case(corrupt_half_eager, "pool (7, 0) has half an eager side"),
    "list owner": Case(corrupt_list_owner, "a free list of pool (7, 0) names another pool"),
    "eager flag": Case(corrupt_eager_flag, "eager flag on the wrong list"),
    "private grows": Case(
        corrupt_private_grows, "a private pool's list grows (expandable segments are the ordinary pool's)"
    ),
    "empty entry stack": Case(corrupt_empty_entry_stack, "a thread with an empty use_mem_pool stack"),
    "entered gone": Case(corrupt_entered_gone, "use_mem_pool entered a pool that no longer exists"),
    "entered graph pool": Case(corrupt_entered_graph_pool, "use_mem_pool entered a graph pool"),
    "entry count": Case(corrupt_entry_count, "use_mem_pool entry count != entered pools"),
    "graph pool held": Case(corrupt_graph_pool_held, "a graph pool held by a MemPool"),
    "eager block in a capture": Case(
        corrupt_eager_in_capture, "of a MemPool's eager side was handed to a capture"
    ),
    "segment bases": Case(corrupt_seg_bases, "segment bases out of sync"),
    "head predecessor": Case(corrupt_head_prev, "segment head has a predecessor"),
    "alignment": Case(corrupt_alignment, "block not aligned"),
    "empty block": Case(corrupt_empty, "empty block"),
    "pools within a segment": Case(corrupt_pool_mix, "blocks of one segment in different pools"),
    "gap": Case(corrupt_gap, "gap or overlap between neighbours"),
    "back link": Case(corrupt_back_link, "broken back link"),
    "unmerged neighbours": Case(corrupt_unmerged, "two adjacent free blocks were not merged"),
    "bins length": Case(corrupt_bins_length, "free-list sizes and blocks differ in length"),
    "bins order": Case(corrupt_bins_order, "free-list blocks out of (size, address) order"),
    "filed twice": Case(corrupt_filed_twice, "a block filed twice in a free list"),
    "wrong stream": Case(corrupt_wrong_stream, "free block filed under another stream"),
    "size mismatch": Case(corrupt_size_mismatch, "free-list size does not match its block"),
    "allocated filed": Case(corrupt_allocated_filed, "allocated or held block in a free list"),
    "held filed": Case(corrupt_held_filed, "allocated or held block in a free list"),
    "stale find cache": Case(corrupt_find_cache, "free-list lookup cache is stale"),
    "wrong free list": Case(corrupt_wrong_freelist, "block filed in a free list that is not its pool"),
    "two free lists": Case(corrupt_two_freelists, "a block filed in two free lists"),
    "free not filed": Case(corrupt_unfiled, "free but not filed, or filed but not free"),
    "untracked allocation": Case(corrupt_untracked, "allocated but not tracked"),
    "owned but free": Case(corrupt_owned_free, "free but still marked owned"),
    "negative holds": Case(corrupt_negative_holds, "negative hold count"),
    "spare in use": Case(corrupt_spare_in_use, "still in use"),
    "spare whole segment in use": Case(corrupt_spare_whole_segment_in_use, "still in use"),
    "spare filed": Case(corrupt_spare_filed, "still filed as free"),
    "spare twice": Case(corrupt_spare_twice, "a spare block listed twice"),
    "tracked count": Case(corrupt_tracked_count, "tracked allocations != allocated blocks"),
    "stat current": Case(corrupt_stat_current, "device allocation.all.current is"),
    "stat peak": Case(corrupt_stat_peak, "device allocation.small_pool.peak below current"),
    "stat negative": Case(
        corrupt_stat_negative,
        "device inactive_split.all.current is",
        note="'current negative' cannot fire: the blocks' tally is never negative, so a "
        "negative level trips 'current is X, blocks say Y' first",
    ),
    "stat all = sum": Case(corrupt_stat_all_sum, "device allocation.all.freed != small + large"),
    "stat all peak": Case(corrupt_stat_all_peak, "allocation.all.peak above the sum of the kinds' peaks"),
    "private pool stat": Case(corrupt_private_stat, "pool (7, 0) reserved_bytes.all.current is"),
    "pool segment count": Case(corrupt_segment_count, "pool (7, 0) segment count wrong"),
    "negative use count": Case(corrupt_use_count, "negative use count"),
    "freeable in sync": Case(corrupt_freeable_sync, "freeable set out of sync with use counts"),
    "empty freeable pool": Case(corrupt_empty_freeable, "an empty freeable pool was kept"),
    "freeable registered": Case(corrupt_freeable_unregistered, "freeable pool not registered"),
    "orphan segment": Case(corrupt_orphan_segment, "segment of a pool that no longer exists"),
    "capture count": Case(corrupt_capture_count, "captures-underway count != registered captures"),
    "capture not active": Case(corrupt_capture_inactive, "registered capture is not active", True),
    "capture released": Case(corrupt_capture_released, "registered capture is not active", True),
    "holds vs waiting": Case(corrupt_extra_waiting, "captures, events and deferrals", keep=False),
    "holds vs deferred": Case(
        corrupt_extra_deferred_during_capture, "captures, events and deferrals", capturing=True, keep=False
    ),
    "deferred left": Case(corrupt_deferred_left, "deferred frees left after every capture ended"),
    "world below device": Case(
        corrupt_world_below, "the runtime's capture count is below this device's", True
    ),
    "capture id": Case(corrupt_capture_id, "capture registered under another id", True),
    "capture not recorded": Case(
        corrupt_capture_not_recorded, "underway capture missing from the records", True
    ),
    "foreign stream": Case(corrupt_foreign_stream, "foreign capture filed under another stream", True),
    "foreign unregistered": Case(corrupt_foreign_unregistered, "foreign capture not registered", True),
    "record released": Case(corrupt_record_released, "released capture still in the records"),
    "record pool": Case(corrupt_record_pool, "record of a dropped pool"),
    "record token": Case(corrupt_record_token, "foreign capture without its release token"),
    "orphan token": Case(corrupt_orphan_token, "release token of no record"),
    "use count vs records": Case(corrupt_use_count_records, "records, entries and its MemPool"),
    "fresh without creator": Case(corrupt_fresh_without_creator, "returnable segment that names no capture"),
    "record fresh count": Case(corrupt_record_fresh, "segments it may take back, not", True),
    "creator not fresh": Case(
        corrupt_creator_not_fresh, "segment that goes back with a capture not listed as returnable", True
    ),
    "hold elsewhere": Case(
        corrupt_hold_elsewhere, "a hold on a block that is no longer in any segment", True
    ),
    "allocated and held": Case(corrupt_allocated_held, "is allocated and held", True),
    "expandable index": Case(corrupt_exp_index, "expandable segments indexed twice or not at all"),
    "expandable misfiled": Case(corrupt_exp_misfiled, "misfiled"),
    "expandable no segment": Case(corrupt_exp_no_segment, "is no segment"),
    "expandable pool": Case(corrupt_exp_pool, "in the wrong pool"),
    "ordinary segment stream": Case(
        corrupt_ordinary_stream, "a block of an ordinary segment on another stream"
    ),
    "expandable tiling": Case(corrupt_exp_tiling, ": blocks do not tile it"),
    "expandable reservation": Case(corrupt_exp_reservation, ": mapped outside its reservation"),
    "expandable granules": Case(corrupt_exp_granules, ": not whole granules"),
    "oversize threshold": Case(corrupt_oversize_threshold, "oversize threshold is not max_split_size"),
    "pool oversize threshold": Case(corrupt_pool_oversize_threshold, "pool (7, 0) oversize threshold"),
    "oversize current": Case(corrupt_oversize_current, "device oversize_allocations.current is 1"),
    "oversize peak": Case(corrupt_oversize_peak, "device oversize_segments.peak below current"),
    "oversize accumulated": Case(
        corrupt_oversize_accumulated, "device oversize_allocations: more allocated than freed and current"
    ),
}


@pytest.mark.parametrize("keep", [True, False])
@pytest.mark.parametrize("capturing", [False, True])
def test_the_built_state_is_sound_and_rich(capturing: bool, keep: bool) -> None:
    st = build(capturing, keep)
    a = st.a
    assert a._capturing == int(capturing)
    # S3, S1 small and large, S2 small, Q small, R small, P small and large
    assert len(a._seg_bases) == 8
    assert sum(len(q) for q in a._waiting.values()) == (1 if capturing else 2)
    assert len(a._deferred) == (1 if capturing else 0)
    holds = sum(b.holds for base in a._seg_bases for b in iter_segment(a._segments[base]))
    assert holds == 1 + 1 + keep  # z's event, d's event or deferral, the graph's hold on k


@pytest.mark.parametrize("name", list(CASES))
def test_checker_catches(name: str) -> None:
    case = CASES[name]
    st = build(case.capturing, case.keep)
    case.corrupt(st)
    try:
        with pytest.raises(AssertionError, match="allocator invariant broken") as info:
            check_invariants(st.a)
    finally:
        for undo in st.restore:
            undo()
    text = str(info.value)
    assert case.message in text, (case.note, text)
    # the report says the check's own words, not run into others
    assert re.search(rf"(?<!\w){re.escape(case.message)}(?!\w)", text), (case.note, text)


def _check_messages() -> list[str]:
    """The constant text of every ``_expect(cond, message)`` in check.py, longest literal part."""
    import ast
    import inspect

    from graphpool.policy import check

    out = []
    for node in ast.walk(ast.parse(inspect.getsource(check))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "_expect":
            msg = node.args[1]
            parts = [msg] if isinstance(msg, ast.Constant) else getattr(msg, "values", [])
            texts = [p.value for p in parts if isinstance(p, ast.Constant) and isinstance(p.value, str)]
            out.append(max(texts, key=len).strip())
    return out


def test_every_check_has_a_case() -> None:
    """A new ``_expect`` in check.py without a case here fails this test."""
    messages = _check_messages()
    assert len(messages) == 82  # the checks today; update with a case for each new one
    covered = " | ".join(f"{c.message} | {c.note}" for c in CASES.values())
    assert [m for m in messages if m not in covered] == []

"""check_invariants(allocator): every invariant of the policy, as equations.

Run after every step of the property tests and under GRAPHPOOL_DEBUG=1. The caller
holds the allocator's lock. Cost: O(blocks + free-list entries).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from graphpool.policy.block import Block, iter_segment
from graphpool.policy.freelist import FreeList
from graphpool.policy.stats import NEVER, POOL_NAMES, STAT_NAMES, PoolStats

if TYPE_CHECKING:
    from graphpool.policy.reports import Reports


def _expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(f"allocator invariant broken: {what}")


ALL, SMALL, LARGE = 0, 1, 2


def _tally(blocks: list[Block], segments: list[Block]) -> dict[str, list[int]]:
    """Recompute the current level of every statistic from the blocks themselves."""
    t = {name: [0, 0, 0] for name in STAT_NAMES}

    def add(name: str, kind: int, n: int) -> None:
        t[name][ALL] += n
        t[name][kind] += n

    for head in segments:
        kind = SMALL if head.free_list.is_small else LARGE
        add("segment", kind, 1)
        add("reserved_bytes", kind, sum(b.size for b in iter_segment(head)))
    for b in blocks:
        kind = SMALL if b.free_list.is_small else LARGE
        if b.allocated:
            add("allocation", kind, 1)
            add("allocated_bytes", kind, b.size)
        if b.allocated or b.holds:
            add("active", kind, 1)
            add("active_bytes", kind, b.size)
            add("requested_bytes", kind, b.requested)
        elif b.prev is not None or b.next is not None:
            add("inactive_split", kind, 1)
            add("inactive_split_bytes", kind, b.size)
    return t


def _flat(st: PoolStats) -> dict[str, int]:
    """The flattened statistics the checks read (one place, so a self-test can doctor them)."""
    return st.as_dict()


def _check_stats(
    st: PoolStats, blocks: list[Block], segments: list[Block], scope: str, expandable: set[int]
) -> None:
    expected = _tally(blocks, segments)
    flat = _flat(st)
    at = st.oversize_at
    over = {
        "oversize_allocations": sum(1 for b in blocks if b.allocated and b.size >= at),
        "oversize_segments": sum(
            1 for h in segments if h.ptr not in expandable and sum(b.size for b in iter_segment(h)) >= at
        ),
    }
    for name, want in over.items():
        cur = flat[name + ".current"]
        _expect(cur == want, f"{scope} {name}.current is {cur}, blocks say {want}")
        _expect(cur <= flat[name + ".peak"], f"{scope} {name}.peak below current")
        _expect(
            flat[name + ".allocated"] - flat[name + ".freed"] <= cur,
            f"{scope} {name}: more allocated than freed and current",
        )
    for name in STAT_NAMES:
        for i, pool in enumerate(POOL_NAMES):
            key = f"{name}.{pool}."
            cur = flat[key + "current"]
            want = expected[name][i]
            _expect(cur == want, f"{scope} {key}current is {cur}, blocks say {want}")
            _expect(cur <= flat[key + "peak"], f"{scope} {key}peak below current")
            _expect(cur >= 0, f"{scope} {key}current negative")
        for counter in ("current", "allocated", "freed"):
            parts = flat[f"{name}.small_pool.{counter}"] + flat[f"{name}.large_pool.{counter}"]
            _expect(flat[f"{name}.all.{counter}"] == parts, f"{scope} {name}.all.{counter} != small + large")
        _expect(
            flat[f"{name}.all.peak"] <= flat[f"{name}.small_pool.peak"] + flat[f"{name}.large_pool.peak"],
            f"{scope} {name}.all.peak above the sum of the kinds' peaks",
        )


def _check_freelist(fl: FreeList, blocks_in_fl: set[int]) -> None:
    for stream, bins in fl.bins.items():
        _expect(len(bins.sizes) == len(bins.blocks), "free-list sizes and blocks differ in length")
        keys = [(b.size, b.ptr) for b in bins.blocks]
        _expect(keys == sorted(keys), "free-list blocks out of (size, address) order")
        _expect(len(set(keys)) == len(keys), "a block filed twice in a free list")
        for size, b in zip(bins.sizes, bins.blocks, strict=True):
            _expect(b.stream == stream, "free block filed under another stream")
            _expect(size == b.size, "free-list size does not match its block")
            _expect(not b.allocated and b.holds == 0, "allocated or held block in a free list")
            _expect(b.free_list is fl, "block filed in a free list that is not its pool")
            _expect(id(b) not in blocks_in_fl, "a block filed in two free lists")
            blocks_in_fl.add(id(b))


def _check_expandable(a: Reports) -> None:
    """Each expandable segment is one segment of the ordinary pool whose blocks tile exactly
    its mapped prefix, a whole number of granules within its reservation; one per stream
    and kind."""
    _expect(len(a._exp_of) == len(a._exp), "expandable segments indexed twice or not at all")
    for base, seg in a._exp.items():
        _expect(seg.base == base and a._exp_of.get((seg.is_small, seg.stream)) is seg, f"{seg} misfiled")
        head = a._segments.get(base)
        _expect(head is not None, f"{seg} is no segment")
        assert head is not None
        fl = a._small if seg.is_small else a._large
        _expect(head.free_list is fl, f"{seg} in the wrong pool")
        _expect(sum(b.size for b in iter_segment(head)) == seg.mapped, f"{seg}: blocks do not tile it")
        _expect(0 < seg.mapped <= seg.reserved, f"{seg}: mapped outside its reservation")
        _expect(a._gran > 0 and seg.mapped % a._gran == 0, f"{seg}: not whole granules")


def check_invariants(a: Reports) -> None:
    """Raise AssertionError if any invariant of ``a`` does not hold."""
    sizes = a.sizes
    _expect(a._seg_bases == sorted(a._segments), "segment bases out of sync")
    all_blocks: list[Block] = []
    heads = [a._segments[base] for base in a._seg_bases]
    for head in heads:
        _expect(head.prev is None, "segment head has a predecessor")
        chain = iter_segment(head)
        for b in chain:
            _expect(b.ptr % sizes.min_block == 0 and b.size % sizes.min_block == 0, "block not aligned")
            _expect(b.size > 0, "empty block")
            _expect(b.free_list is head.free_list, "blocks of one segment in different pools")
            if b.next is not None:
                _expect(b.next.ptr == b.ptr + b.size, "gap or overlap between neighbours")
                _expect(b.next.prev is b, "broken back link")
                both_free = not (b.allocated or b.holds or b.next.allocated or b.next.holds)
                _expect(
                    not both_free or b.stream != b.next.stream, "two adjacent free blocks were not merged"
                )
            if head.ptr not in a._exp:  # only expandable segments lend blocks to other streams
                _expect(b.stream == head.stream, "a block of an ordinary segment on another stream")
        all_blocks.extend(chain)

    in_fl: set[int] = set()
    fls: list[FreeList] = [a._small, a._large]
    for pool in a._pools.values():
        fls += pool.free_lists()
    for fl in fls:
        _check_freelist(fl, in_fl)
    for pool in a._pools.values():  # a MemPool's two sides (private_pools.py)
        _expect(
            (pool.eager_small is None) == (pool.eager_large is None),
            f"pool {tuple(pool.id)} has half an eager side",
        )
        for side in pool.free_lists():
            _expect(side.private_pool is pool, f"a free list of pool {tuple(pool.id)} names another pool")
            _expect(
                side.eager == (side in (pool.eager_small, pool.eager_large)), "eager flag on the wrong list"
            )
            _expect(
                not side.grows, "a private pool's list grows (expandable segments are the ordinary pool's)"
            )
    for fl in fls:  # FreeList.find's kept answer
        last = fl._last_bins
        _expect(last is None or fl.bins.get(fl._last_stream) is last, "free-list lookup cache is stale")
    for b in all_blocks:
        is_free = not b.allocated and b.holds == 0
        _expect(is_free == (id(b) in in_fl), f"{b} free but not filed, or filed but not free")
        if b.allocated:  # filed by address, parked, or owned (a DeviceBuffer's): one of them
            tracked = a._active.get(b.ptr) is b or a._parked is b
            _expect(tracked != b.owned, f"{b} allocated but not tracked")
        else:
            _expect(not b.owned, f"{b} free but still marked owned")
        _expect(b.holds >= 0, "negative hold count")
    live = {id(b) for b in all_blocks}
    spares = a._spare + ([a._spare1] if a._spare1 is not None else [])
    for b in spares:
        _expect(
            b.prev is None and b.next is None and id(b) not in live and not b.owned, f"spare {b} still in use"
        )
        _expect(id(b) not in in_fl, f"spare {b} still filed as free")
    _expect(len({id(b) for b in spares}) == len(spares), "a spare block listed twice")
    parked = a._parked
    if parked is not None:  # heap.py, Note [Parking]: a free that waits for no one
        _expect(parked.ptr not in a._active and id(parked) in live, "parked block also filed, or gone")
        fl = parked.free_list
        _expect(fl is a._small or fl is a._large, "a private pool's block parked")
        ok = parked.allocated and not parked.stream_uses and parked.requested > 0
        _expect(ok, f"{parked} parked wrongly")
        _expect(
            not a._capturing and not a._entered and a._history is None,
            "a block parked while a capture, a use_mem_pool entry or the history is on",
        )
    n_allocated = sum(1 for b in all_blocks if b.allocated and not b.owned)
    _expect(len(a._active) + (parked is not None) == n_allocated, "tracked allocations != allocated blocks")

    _check_expandable(a)
    exp = set(a._exp)
    threshold = NEVER if a.sizes.max_split_size is None else a._max_split
    _expect(a.stats.oversize_at == threshold, "oversize threshold is not max_split_size")
    _check_stats(a.stats, all_blocks, heads, "device", exp)
    for pool in a._pools.values():
        mine = [b for b in all_blocks if b.free_list.private_pool is pool]
        my_heads = [h for h in heads if h.free_list.private_pool is pool]
        _expect(pool.stats.oversize_at == a.stats.oversize_at, f"pool {tuple(pool.id)} oversize threshold")
        _check_stats(pool.stats, mine, my_heads, f"pool {tuple(pool.id)}", exp)
        _expect(pool.segment_count == len(my_heads), f"pool {tuple(pool.id)} segment count wrong")
        _expect(pool.use_count >= 0, "negative use count")
        _expect((pool.use_count == 0) == (pool.id in a._freeable), "freeable set out of sync with use counts")
        _expect(pool.use_count > 0 or pool.segment_count > 0, "an empty freeable pool was kept")
    for pid in a._freeable:
        _expect(pid in a._pools, "freeable pool not registered")
    owners = {id(p) for p in a._pools.values()}
    for head in heads:
        owner = head.free_list.private_pool
        _expect(owner is None or id(owner) in owners, "segment of a pool that no longer exists")

    _check_captures(a, all_blocks, heads)


def _check_captures(a: Reports, all_blocks: list[Block], heads: list[Block]) -> None:
    """Captures and holds: every hold is accounted for, exactly (held blocks can be audited)."""
    _expect(a._capturing == len(a._captures), "captures-underway count != registered captures")
    _expect(a._world.active >= a._capturing, "the runtime's capture count is below this device's")
    for cid, rec in a._captures.items():
        _expect(rec.active and not rec.released, "registered capture is not active")
        _expect(rec.capture_id == cid, "capture registered under another id")
        _expect(a._records.get(rec.sequence) is rec, "underway capture missing from the records")
    for stream, rec in a._foreign.items():
        _expect(rec.foreign and rec.stream == stream, "foreign capture filed under another stream")
        _expect(a._captures.get(rec.capture_id) is rec, "foreign capture not registered")
    for seq, rec in a._records.items():
        _expect(rec.sequence == seq and not rec.released, "released capture still in the records")
        _expect(rec.pool.id in a._pools and a._pools[rec.pool.id] is rec.pool, "record of a dropped pool")
        if rec.foreign and rec.token:
            _expect(a._tokens.get(rec.token) is rec, "foreign capture without its release token")
    for token, rec in a._tokens.items():
        _expect(rec.token == token and a._records.get(rec.sequence) is rec, "release token of no record")
    uses: dict[int, int] = {}
    entered: dict[int, int] = {}
    for stack in a._thread_pools.values():
        _expect(bool(stack), "a thread with an empty use_mem_pool stack")
        for p in stack:
            _expect(a._pools.get(p.id) is p, "use_mem_pool entered a pool that no longer exists")
            _expect(p.eager_small is not None, "use_mem_pool entered a graph pool")
            entered[id(p)] = entered.get(id(p), 0) + 1
    _expect(a._entered == sum(entered.values()), "use_mem_pool entry count != entered pools")
    for pool in a._pools.values():
        n = sum(1 for r in a._records.values() if r.pool is pool) + entered.get(id(pool), 0) + pool.held
        _expect(
            pool.use_count == n,
            f"pool {tuple(pool.id)} use count {pool.use_count} != {n} records, entries and its MemPool",
        )
        _expect(not pool.held or pool.eager_small is not None, "a graph pool held by a MemPool")
        for head in pool.returnable:
            _expect(
                head.returns_with is not None and head.free_list.private_pool is pool,
                "returnable segment that names no capture",
            )
    for rec in a._records.values():
        n = sum(1 for h in heads if h.returns_with is rec)
        _expect(
            rec.returnable_count == n,
            f"{rec} counts {rec.returnable_count} segments it may take back, not {n}",
        )
    for head in heads:
        if head.returns_with is not None:
            owner = head.free_list.private_pool
            _expect(
                owner is not None and head in owner.returnable,
                "segment that goes back with a capture not listed as returnable",
            )
    # holds: each is a capture keeping the block, a pending event, a deferral, or an orphan
    # (its user stream vanished during a capture: it waits for a device synchronize)
    for rec in a._records.values():
        for b in rec.kept:
            uses[id(b)] = uses.get(id(b), 0) + 1
    for q in a._waiting.values():
        for _, b in q:
            uses[id(b)] = uses.get(id(b), 0) + 1
    for b in a._deferred + a._orphans:
        uses[id(b)] = uses.get(id(b), 0) + 1
    live = {id(b) for b in all_blocks}
    for key in uses:
        _expect(key in live, "a hold on a block that is no longer in any segment")
    for b in all_blocks:
        want = uses.get(id(b), 0)
        _expect(b.holds == want, f"{b} has {b.holds} holds, but {want} captures, events and deferrals")
        _expect(not (b.allocated and b.holds), f"{b} is allocated and held")
        _expect(
            b.allocated_in is None or not b.free_list.eager,
            f"{b} of a MemPool's eager side was handed to a capture",
        )
    if a._capturing == 0:
        _expect(not a._deferred, "deferred frees left after every capture ended")

"""The heap: blocks, their split and merge, the segment registry, pointer lookups and errors.

The lowest layer of the allocator (policy/allocator.py lists the layers). A *segment* is
one device allocation (or one expandable range, expandable.py); it is cut into *blocks*,
a doubly linked list in address order (block.py). A free block sits in the free list of
its pool and kind (freelist.py: ``Block.free_list`` is that list; the list's
``private_pool`` is the private pool it belongs to, None for the ordinary pool). Freeing
merges a block with its free neighbours of the same stream, so a segment whose blocks are
all free is one block again, which segments.py can give back.

Ownership: an allocation is its Block, in one of two forms. ``malloc_owned`` hands the Block
itself to an owner that keeps it (``DeviceBuffer``), with ``Block.owned`` set; ``malloc``
hands out the address and files the Block under it in ``_active``, a layer over the same
Block for callers that keep only an address (PyTorch's allocator hooks, CuPy). Both forms
resolve through one lookup, ``_live_block`` (the Block, or None), and every refusal through
one error path, ``_bad_pointer`` (which error, and why): ``record_stream``, queued frees and
``_check_pointer`` (a re-entered free) use both; the cached free writes the lookup out
(Note [The hand-written hot path] in allocator.py) and refuses through ``_bad_pointer``.

Note [Parking]
~~~~~~~~~~~~~~
A framework that frees and allocates tensors of one size in turn on one stream (PyTorch's
loops) gives a block back and asks for the same block again. ``park`` (the PyTorch
integration's free of the block it handed out last) may keep such a block whole instead of
queuing its free: the *parked*
block, at most one per allocator, stays counted as allocated, as a queued free is, and is
filed in ``_parked`` instead of ``_active``. The one rule, written in ``_malloc``:

    the next malloc takes the parked block back whole if it is for the block's stream and
    the same requested size, no capture is registered or found on that stream, no
    use_mem_pool entry is open and no free was queued since (``drop``, lock-free); any other
    call first turns the parked block into an ordinary queued free (``_unpark``: first in
    ``_pending``, as ``drop`` would have queued it).

``_park`` (stream_uses.py) parks only a free that waits for no one (no capture registered,
no history, no use_mem_pool entry, no stream uses, no frees queued or waiting for events, a
block of the ordinary pool) and only where the next request of its size and stream would
get this very block back anyway, were it freed and queued (``_takes_back``: the merge rule,
best fit, the split rule). So parking changes no address: it skips a merge and a split that
would undo each other. Taking the block back counts as one free and one allocation of it
(``_recycled``: the accumulated allocation counters, the allocation order and the free
blocks' clock move; no level, so no peak; the skipped merge and split are not counted as
inactive-split churn). A free during a capture graphpool has not found yet is parked like
any other: the next malloc on that stream finds the capture and does not take the block
back, which then becomes a queued free carried out under that capture's rules, as
``drop``'s would be; a free of another block queues the parked one without carrying it out
(no capture query is made at a free).

A *lane* (``set_lane``) may serve the parked block meanwhile without this allocator: the
PyTorch shim's (graphpool/_torch_shim.cpp) hands it to the next matching request without
the GIL, after the device's capture query (``Device.capture_query_address``; the legacy
stream never captures), and parks it again when that tensor dies, any number of times. It
decides nothing else. Every locked call first settles with it (``_settle_park``: ``lane(0,
0)`` returns how often it handed the block out, counted as so many recycles, and whether the
block is out now, filed by address again then), so no call sees a state the rule would not
have made. The lane keeps a block only while graphpool has it *armed* for that block:
``_park`` arms it (``lane(ptr, requested)``), under the lock, and every settle disarms it. The
shim's park comes after the free hook returned, with the lock released: code that ran
meanwhile (another thread, a signal handler) may have settled and handed the block out
again, and the lane then refuses it rather than hand it out a second time. One thing the
lane cannot see: frees queued lock-free meanwhile (``drop``, ``defer_free``: another
library's); the rule carries them out before a take-back, the lane may serve the block
before them (the same memory safety, maybe another address than the rule's).
tests/property/test_parking_differential.py runs random programs through the lane, through
this rule alone and with every free queued, and compares them.
"""

from __future__ import annotations

from bisect import bisect_right, insort
from collections import deque
from collections.abc import Callable
from typing import Any, Final, NoReturn, cast

from graphpool.device.protocol import (
    Device,
)
from graphpool.errors import (
    DoubleFreeError,
    ForeignPointerError,
)
from graphpool.policy import interrupts
from graphpool.policy.block import Block, ExpandableSegment, iter_segment, merges
from graphpool.policy.freelist import FreeList
from graphpool.policy.history import History
from graphpool.policy.pools import SizeConfig
from graphpool.policy.private_pools import (
    PoolId,
    PrivatePool,
)
from graphpool.policy.stats import NEVER, PoolStats

LEGACY: Final = 0
"""The legacy stream's handle (device/protocol.py's LEGACY_STREAM), a constant compiled in."""


class Heap:
    """Blocks and segments of one device, and the lookups over them (see the module doc).

    Also the state every layer above shares: the private pools' registry, the queue of
    finalizer work (``_pending``, which ``_drain`` carries out) and the event history.
    """

    def __init__(self, device: Device, sizes: SizeConfig) -> None:
        self.device = device
        self.sizes = sizes
        self._small = FreeList(True)
        self._large = FreeList(False)
        self._small_limit = sizes.small_size
        self._total = device.mem_info()[1]
        self.stats = PoolStats()
        # The private pools that exist, by id (their free lists are this allocator's too).
        self._pools: dict[PoolId, PrivatePool] = {}
        self._apply_sizes(sizes)
        # Live raw allocations (``malloc``): address -> Block. ``malloc_owned``'s are not filed.
        self._active: dict[int, Block] = {}
        self._serial = 0  # allocations so far: each block's ``serial`` tells allocations apart
        # Block objects absorbed by merges, reused by splits. The last one waits apart in
        # ``_spare1``: the steady cycle (split, merge) then never resizes the list.
        self._spare: list[Block] = []
        self._spare1: Block | None = None
        # The segment registry: base address -> first block, the sorted bases, and the
        # expandable segments (sizes.expandable_segments) by base and by (is_small, stream)
        # of the ordinary pool.
        self._segments: dict[int, Block] = {}
        self._seg_bases: list[int] = []
        self._exp: dict[int, ExpandableSegment] = {}
        self._exp_of: dict[tuple[bool, int], ExpandableSegment] = {}
        # Finalizer work, carried out by the next call (``_drain``): frees (an int or a Block),
        # frees after a stream use ((ptr, stream)), releases (capture records).
        self._pending: deque[Any] = deque()
        # The event history (policy/history.py), None while not recording: malloc and free
        # test it once each.
        self._history: History | None = None
        # The parked block (Note [Parking]): a raw allocation its owner gave back, kept whole
        # for the next malloc of its stream and requested size; still counted as allocated.
        self._parked: Block | None = None
        # The native lane that may serve the parked block meanwhile (``set_lane``), or None.
        self._lane: Callable[[int, int], tuple[int, bool]] | None = None

    def _drain(self) -> None:  # pragma: no cover - CachingAllocator defines it
        """Carry out the frees and releases finalizers queued (``_pending``). Every layer drains
        before it acts; the allocator, which owns the free path, defines it."""
        raise NotImplementedError

    def _apply_sizes(self, sizes: SizeConfig) -> None:
        """Take ``sizes`` and the figures malloc reads from it. With no ``max_split_size``,
        ``_max_split`` is past any block (no block is oversize: one int test in malloc)."""
        self.sizes = sizes
        self._small_limit = sizes.small_size
        self._max_split = self._total + 1 if sizes.max_split_size is None else sizes.max_split_size
        self.stats.oversize_at = NEVER if sizes.max_split_size is None else sizes.max_split_size
        for pool in self._pools.values():  # pools made before the first allocation (a MemPool's)
            pool.stats.oversize_at = self.stats.oversize_at
        self._non_split = sizes.non_split_rounding()
        self._divisions = bool(sizes.roundup_power2_divisions)
        self._gc_threshold = sizes.garbage_collection_threshold
        self._expandable = sizes.expandable_segments
        self._small.grows = self._large.grows = sizes.expandable_segments

    def _refuses(self, bsize: int, size: int) -> bool:
        """Whether a request of ``size`` may not take an oversize free block of ``bsize`` bytes
        (PyTorch's ``get_free_block``): a request under ``max_split_size`` never takes one; a
        larger one only when the block wastes less than ``max_non_split_rounding``."""
        return size < self._max_split or bsize >= size + self._non_split

    def _free_block(self, block: Block, freed: bool, counted: bool = False) -> Block:
        """Return a block with no holds to its free list, merged with its free neighbours; return
        the merged block, by the one merge rule (block.py's ``merges``): a neighbour merges
        when it is free, nothing holds it, and it is of the block's stream (blocks are cached
        per stream; expandable.py's stream takeover gives blocks a new stream, and they merge
        with that stream's only).

        ``freed``: the user is freeing it now (not a hold ending), for the statistics.
        ``counted``: the block is free already and counted as an inactive split block if it
        has neighbours (``_merge_free``); else it is counted as active until now.
        """
        fl = block.free_list
        size = block.size
        requested = block.requested
        block.requested = 0
        block.allocated_in = None
        block.stream_uses = None
        d_cnt = d_bytes = 0
        if counted and (block.prev is not None or block.next is not None):
            d_cnt = -1
            d_bytes = -size
        # A merged block takes the free-list entry of a neighbour it absorbed when the
        # order allows (FreeList.replace): no list resize in the usual cycle.
        old: Block | None = None
        old_size = 0
        nxt = block.next
        if nxt is not None and merges(nxt, block.stream):
            # absorb the free block after this one; keep its object for a later split
            old = nxt
            old_size = nxt.size
            d_cnt -= 1
            d_bytes -= nxt.size
            block.size = size + nxt.size
            after = block.next = nxt.next
            if after is not None:
                after.prev = block
            nxt.prev = nxt.next = None
            self._keep_spare(nxt)
        prev = block.prev
        if prev is not None and merges(prev, block.stream):
            # the free block before absorbs this one
            if old is not None:
                fl.remove(old)
            old = prev
            old_size = prev.size
            d_cnt -= 1
            d_bytes -= prev.size
            prev.size += block.size
            after = prev.next = block.next
            if after is not None:
                after.prev = prev
            block.prev = block.next = None
            self._keep_spare(block)
            block = prev
        if old is None:
            fl.insert(block)
        else:
            fl.replace(old, old_size, block)
        if block.prev is not None or block.next is not None:
            d_cnt += 1
            d_bytes += block.size
        self.stats.on_release(fl.is_small, size, requested, d_cnt, d_bytes, freed)
        if fl.private_pool is not None:
            fl.private_pool.stats.on_release(fl.is_small, size, requested, d_cnt, d_bytes, freed)
        return block

    def _merge_free(self, block: Block) -> Block:
        """File a free block that is in no free list, merged with its free neighbours by
        ``_free_block``'s rule (stream takeover, and ``empty_cache``'s rehoming); no statistics
        change but the inactive splits'. Returns the merged block."""
        return self._free_block(block, False, True)

    def _add_segment(self, ptr: int, nbytes: int, stream: int, fl: FreeList, grows: bool = False) -> Block:
        """File a new segment of ``nbytes`` at ``ptr`` (one block, in no free list: the caller
        hands it out) and count it in the device's and its private pool's statistics. An
        expandable one (``grows``) is never oversize."""
        head = Block(ptr, nbytes, stream, fl)
        self._segments[ptr] = head
        insort(self._seg_bases, ptr)
        for st in self._scopes(fl):
            st.num_device_alloc += 1
            k = st.kind(fl.is_small)
            k.add("segment", 1)
            k.add("reserved_bytes", nbytes)
            if not grows and nbytes >= st.oversize_at:
                st.move_oversize("oversize_segments", 1)
        if fl.private_pool is not None:
            fl.private_pool.segment_count += 1
        return head

    def _forget_segment(self, head: Block) -> ExpandableSegment | None:
        """Unfile the whole free segment ``head`` (out of its free list already) and uncount it:
        ``_add_segment`` undone. Returns its expandable segment, if it is one; the device's
        memory is the caller's to give back."""
        seg = self._exp.pop(head.ptr, None) if self._exp else None
        if seg is not None:
            del self._exp_of[(seg.is_small, seg.stream)]
        del self._segments[head.ptr]
        self._seg_bases.remove(head.ptr)
        fl = head.free_list
        for st in self._scopes(fl):
            st.num_device_free += 1
            k = st.kind(fl.is_small)
            k.add("segment", -1)
            k.add("reserved_bytes", -head.size)
            if seg is None and head.size >= st.oversize_at:
                st.move_oversize("oversize_segments", -1)
        if fl.private_pool is not None:
            fl.private_pool.segment_count -= 1
        return seg

    def _keep_spare(self, block: Block) -> None:
        """Keep a Block object a merge absorbed, for a later split (``_spare1`` first)."""
        if self._spare1 is None:
            self._spare1 = block
        else:
            self._spare.append(block)

    def _hold(self, block: Block) -> None:
        """Keep a freed block out of its free list (an event, a graph, a deferral)."""
        if block.holds == 0:
            for st in self._scopes(block.free_list):
                st.hold(block.free_list.is_small, block.size, 1)
        block.holds += 1

    def _unhold(self, block: Block) -> None:
        """Drop one hold; the last one returns the block to its free list."""
        block.holds -= 1
        if block.holds == 0:
            for st in self._scopes(block.free_list):
                st.hold(block.free_list.is_small, block.size, -1)
            h = self._history
            if h is None:
                self._free_block(block, False)
                return
            # the block is back in its list before the history (a call out) hears of it
            ptr, requested, stream, owner = (
                block.ptr,
                block.requested,
                block.stream,
                block.free_list.private_pool,
            )
            self._free_block(block, False)
            h.free_completed(ptr, requested, stream, owner)

    def _scopes(self, fl: FreeList) -> tuple[PoolStats, ...]:
        """The statistics a block of ``fl`` counts in: the device's, and its private pool's."""
        return (self.stats,) if fl.private_pool is None else (self.stats, fl.private_pool.stats)

    def lookup(self, ptr: int) -> Block | None:
        """The live allocation that starts at ``ptr``, if any (a DeviceBuffer's too; the parked
        block, which the lane may have handed out again: Note [Parking])."""
        block = self._active.get(ptr)
        if block is not None:
            return block
        parked = self._parked
        if parked is not None and parked.ptr == ptr:
            return parked
        return self._owned_at(ptr)

    def drop(self, ptr: object) -> None:
        """Queue the free of the raw allocation at ``ptr`` whose owner was collected (a CuPy
        memory object, a PyTorch tensor), as a DeviceBuffer's finalizer queues its own: it is
        carried out at the next allocator call, after that call's capture query, so a block
        dropped during a capture graphpool has not seen yet is kept for that graph instead of
        going back to the cache at once. Lock-free and no device call; an address that is no
        live allocation is refused at once, with ``free``'s error. (``ptr`` is taken as an
        object: compiled, an int parameter is unboxed, and each use boxes it again.)"""
        parked = self._parked  # (a parked block may be out again, through the lane: Note [Parking])
        if type(ptr) is int and (ptr in self._active or (parked is not None and parked.ptr == ptr)):
            self._pending.append(ptr)
        else:
            self.free_owned(ptr)  # raises: not a live allocation (or frees an owned block)

    def parking(self) -> bool:
        """Whether a block is parked (Note [Parking]): a free then goes through ``park`` (with
        ``parkable=False``), so that it is queued behind it. Lock-free: a hint, checked again."""
        return self._parked is not None

    def _set_lane(self, lane: Callable[[int, int], tuple[int, bool]] | None) -> None:
        """``set_lane``'s body, the lock held and the park settled with the lane it had."""
        self._lane = lane

    def _settle_park(self) -> Block | None:
        """What became of the parked block while the lane held it: the times it was handed out
        are counted (``_recycled``); None if it is live now (filed again by address), else the
        block, parked still and now held here alone. The lock is held."""
        block = self._parked
        assert block is not None
        lane = self._lane
        if lane is not None:
            hits, live = lane(0, 0)
            if hits:
                self._recycled(block, hits)
            if live:
                self._parked = None
                self._active[block.ptr] = block
                return None
        return block

    def _unpark(self) -> None:
        """Settle the park; a block still parked becomes an ordinary queued free (``drop``'s),
        first in the queue. The lock is held."""
        block = self._settle_park()
        if block is not None:
            self._queue_parked(block)

    def _queue_parked(self, block: Block) -> None:
        """The parked ``block`` (settled) becomes an ordinary queued free, first in the queue."""
        self._parked = None
        key: object = block.ptr
        cast("dict[object, Block]", self._active)[key] = block
        self._pending.appendleft(key)

    def _take_parked(self, block: Block) -> object:
        """Hand the parked ``block`` (settled) out again for its request: its address, filed."""
        self._parked = None
        key: object = block.ptr
        cast("dict[object, Block]", self._active)[key] = block
        self._recycled(block, 1)
        return key

    def _recycled(self, block: Block, n: int) -> None:
        """The parked ``block`` was handed out ``n`` more times for its request: the
        allocation order, the free blocks' clock (``FreeList.calls``: the ages that
        garbage_collection_threshold compares) and the statistics move as ``n`` frees and
        mallocs of it would."""
        block.free_list.calls += n
        self._serial += n
        block.serial = self._serial
        self.stats.on_recycled(block.free_list is self._small, block.size, block.requested, n)

    def free_owned(self, ptr: object) -> None:  # pragma: no cover - CachingAllocator defines it
        """Free a live allocation now, under the lock (allocator.py defines it)."""
        raise NotImplementedError

    def _live_block(self, ptr: object) -> Block | None:
        """The live allocation ``ptr`` names: a Block of ``malloc_owned`` still owned, or the
        raw allocation filed at address ``ptr``."""
        if type(ptr) is Block:
            return ptr if ptr.owned and self._mine(ptr.free_list) else None
        return self._active.get(ptr) if type(ptr) is int else None

    def _mine(self, fl: FreeList) -> bool:
        """Whether ``fl`` is one of this allocator's free lists (ordinary or a private pool's)."""
        if fl is self._small or fl is self._large:
            return True
        owner = fl.private_pool
        return owner is not None and self._pools.get(owner.id) is owner

    def _segment_at(self, ptr: int) -> tuple[int, int, bool, PoolId | None] | None:
        """(base, size, expandable, private pool id or None) of the segment holding ``ptr``.
        O(log segments + blocks of the segment)."""
        head = self._containing(ptr)
        if head is None:
            return None
        while head.prev is not None:
            head = head.prev
        owner = head.free_list.private_pool
        size = sum(b.size for b in iter_segment(head))
        return head.ptr, size, head.ptr in self._exp, None if owner is None else owner.id

    def _containing(self, ptr: int) -> Block | None:
        """The block of a segment that holds address ``ptr``, if any. O(log segments + blocks)."""
        i = bisect_right(self._seg_bases, ptr) - 1
        if i < 0:
            return None
        b: Block | None = self._segments[self._seg_bases[i]]
        while b is not None and b.ptr + b.size <= ptr:
            b = b.next
        return b if b is not None and b.ptr <= ptr else None

    def _owned_at(self, ptr: int) -> Block | None:
        """The allocation of ``malloc_owned`` that starts at ``ptr``, if any (such blocks are
        not filed by address)."""
        b = self._containing(ptr)
        return b if b is not None and b.ptr == ptr and b.owned else None

    def _check_pointer(self, ptr: Any, what: str) -> None:
        """Raise the right error unless ``ptr`` is a live allocation not yet queued for a free.

        Changes nothing. O(queued frees): only a re-entered ``free`` asks.
        """
        if self._live_block(ptr) is None:
            self._bad_pointer(ptr, what)
        for item in self._pending:  # (a Block compares by identity)
            if item == ptr or (type(item) is tuple and item[0] == ptr):
                name = "this allocation" if type(ptr) is Block else f"0x{ptr:x}"
                raise DoubleFreeError(f"{what}: {name} is already queued to be freed")

    def _bad_pointer(self, ptr: Any, what: str) -> NoReturn:
        """Raise the right error for a pointer that is not a live allocation."""
        if type(ptr) is Block:  # (its address may have changed since: a freed Block is reused)
            if not self._mine(ptr.free_list):
                raise ForeignPointerError(
                    f"{what}: this Block belongs to another allocator than device {self.device.index}'s"
                )
            raise DoubleFreeError(
                f"{what}: this Block is no live allocation of malloc_owned: freed already, or a "
                "raw allocation's block (free those by their address)"
            )
        if type(ptr) is not int:
            raise TypeError(f"{what}: expected an int device address, got {type(ptr).__name__}")
        b = self._containing(ptr)
        if b is not None:
            if b.owned and b.ptr == ptr:
                raise ForeignPointerError(
                    f"{what}: 0x{ptr:x} is owned by a graphpool DeviceBuffer: free it with the "
                    "buffer's free() (or drop the buffer), not by its address"
                )
            if b.allocated:
                raise ForeignPointerError(
                    f"{what}: 0x{ptr:x} points inside the allocation at 0x{b.ptr:x}, not to its start"
                )
            raise DoubleFreeError(
                f"{what}: 0x{ptr:x} is not allocated on device {self.device.index} (was it freed already?)"
            )
        raise ForeignPointerError(
            f"{what}: 0x{ptr:x} was not allocated by graphpool on device {self.device.index}"
        )


# Plain-Python build: a dropped block is on its way to the queue; a guarded signal handler
# waits until it is there (policy/interrupts.py, "Handoffs"), as for defer_free.
interrupts.handoff(Heap.drop)

"""Stream uses: frees that must wait, for another stream's work (``record_stream``) or for
captured graphs, and the events that end the wait.

A block freed after ``record_stream`` goes back to its pool only once the work queued on
each extra user stream up to the free has completed: an event is recorded on each such
stream and the block is *held* until every event has completed (``_insert_events``; queried
at the next allocations, ``_process_events``). ``_free_held`` decides for every free that
may wait: during a capture (captures.py keeps blocks for graphs) or with extra user streams.
``_park`` decides, for a PyTorch tensor's free, whether it is a free that can wait for no
one, and so may be parked (heap.py, Note [Parking]).

No event ever goes into a capture: ``_insert_events`` is the one place the allocator records
events, and it asks the device first (``_streams_capturing``). While a capture is
registered on this device a block waits in ``_deferred`` until none is underway; when its
user streams take part in a capture that cannot be registered, it waits in ``_orphans``
until an allocation with no capture underway asks again. Events are queried and
synchronized only while no capture is underway anywhere in the process (``_query_event``,
``_synchronize_events``, ``_synchronize_device``: the one place each).
"""

from __future__ import annotations

from collections import deque
from typing import Final

from graphpool.device.protocol import (
    CAPTURE_MODE_RELAXED,
    Device,
)
from graphpool.errors import (
    CaptureError,
    DoubleFreeError,
    GraphpoolError,
)
from graphpool.policy.block import Block, merges
from graphpool.policy.captures import Captures
from graphpool.policy.freelist import FreeList, bisect_sizes
from graphpool.policy.pools import SizeConfig
from graphpool.policy.private_pools import (
    CaptureRecord,
    CaptureWorld,
)

_NO_CAPTURES: Final[tuple[CaptureRecord, ...]] = ()


class StreamUses(Captures):
    """Frees that wait for stream uses or captures, and their events (see the module doc)."""

    def __init__(self, device: Device, sizes: SizeConfig, world: CaptureWorld | None, detect: bool) -> None:
        super().__init__(device, sizes, world, detect)
        self._waiting: dict[int, deque[tuple[int, Block]]] = {}  # stream -> (event, block)
        self._event_pool: list[int] = []
        self._deferred: list[Block] = []  # record_stream frees waiting for all captures to end
        # frees whose user stream vanished (a device sync, later), or whose user streams take part
        # in a capture that is not registered (their events wait until it ends; _insert_events)
        self._orphans: list[Block] = []
        self._queued = False  # the free being carried out was queued by a finalizer (_drain)

    def _park(self, ptr: int, parkable: bool = True) -> int:
        """``park``'s body, the lock held: park the raw allocation at ``ptr`` if nothing makes its
        free more than a return to its own stream's cache (a capture registered, the history,
        a use_mem_pool entry, stream uses, frees waiting for events, a private pool's block)
        and the next request of its size and stream would get it back anyway
        (``_takes_back``), returning its requested size; else queue its free as ``drop``
        does and return 0."""
        if self._parked is not None:
            prev = self._settle_park()
            if prev is not None:
                self._queue_parked(prev)
                if prev.ptr == ptr:  # the first free stands (queued); this one is refused
                    raise DoubleFreeError(f"free: 0x{ptr:x} was freed already (its block is parked)")
        # Nothing queued is carried out here: a free queued before a capture graphpool has not
        # found yet is carried out after the next malloc's capture query, as drop's are.
        block = self._active.get(ptr)
        if block is None:
            self._bad_pointer(ptr, "free")
        fl = block.free_list
        if (
            not parkable
            or self._pending  # (the next malloc carries them out first: a better fit may appear)
            or self._history is not None
            or self._capturing
            or self._entered
            or block.stream_uses
            or self._waiting  # (the next malloc would ask its events first: a better fit may appear)
            or self._orphans
            or not (fl is self._small or fl is self._large)
            or not self._takes_back(block, fl)
        ):
            self._pending.append(ptr)
            return 0
        del self._active[ptr]
        self._parked = block
        lane = self._lane
        if lane is not None:  # the shim may keep this block, and only this one (Note [Parking])
            try:
                lane(ptr, block.requested)
            except BaseException:  # not armed, so not parked: its free is queued, as drop's
                self._parked = None
                self._active[ptr] = block
                self._pending.append(ptr)
                raise
        return block.requested

    def _takes_back(self, block: Block, fl: FreeList) -> bool:
        """Whether, were ``block`` freed now, the next request of its size on its stream would be
        handed this very block at this size (the merge rule, then best fit over the merged
        block and the stream's other free blocks, then the split rule): parking it then
        changes no address (heap.py, Note [Parking])."""
        if fl.grows:  # an expandable segment: its growable tail answers to the wilderness rule
            return False
        requested = block.requested
        sizes = self.sizes
        size = sizes.round_divisions(requested) if self._divisions else sizes.round_size(requested)
        stream = block.stream
        if block.size != size or merges(block.prev, stream):
            return False
        nxt = block.next
        merged = size + nxt.size if nxt is not None and merges(nxt, stream) else size
        if merged >= self._max_split:  # oversize blocks follow max_split_size's rules
            return False
        rest = merged - size
        if rest and not sizes.splits(size, rest, False):
            return False  # the merged block would be handed out whole
        bins = fl.find(stream)
        if bins is not None:
            i = bisect_sizes(bins.sizes, size)
            n = len(bins.blocks)
            if i < n and bins.blocks[i] is nxt:  # absorbed by the merge
                i += 1
            if i < n:
                other = bins.blocks[i]
                if other.size < merged or (other.size == merged and other.ptr < block.ptr):
                    return False  # best fit would hand out another block
        return True

    def _record_stream(self, ptr: object, stream: int) -> None:
        if self._pending:
            self._drain()
        block = self._live_block(ptr)
        if block is None:
            self._bad_pointer(ptr, "record_stream")
        if stream == block.stream:
            return
        if block.stream_uses is None:
            block.stream_uses = {stream}
        else:
            block.stream_uses.add(stream)

    def _insert_events(self, block: Block) -> None:
        """Record an event on each extra user stream of ``block``; each holds the block until it
        completes. The one place the allocator records events: a free after ``record_stream``,
        the frees deferred during a capture, and the blocks a released graph kept (which wait
        for the streams it replayed on) all come here.

        No event goes into a capture: none is recorded while a capture is registered on this
        device, nor on a stream that the device says takes part in one (``_streams_capturing``,
        which adopts a capture begun outside graphpool and not seen yet). The block then waits
        with its user streams: in ``_deferred`` until no capture is underway (``_stop_routing``
        calls this again), or, when the capture cannot be registered, in ``_orphans`` until an
        allocation with no capture underway asks again (``_release_orphans``).

        The caller holds the block across this call and drops its own hold after. A stream
        that no longer exists (destroyed since record_stream) takes no event: its queued
        work may still run, so the device is synchronized once instead.
        """
        uses = block.stream_uses or set()
        if self._capturing or self._streams_capturing(uses):
            self._hold(block)  # the wait's own hold
            if self._capturing:
                self._deferred.append(block)
            else:
                self._orphans.append(block)
            return
        block.stream_uses = None
        try:
            for s in sorted(uses):
                ev = self._event_pool.pop() if self._event_pool else self.device.create_event()
                try:
                    self._record_event(ev, s)
                except GraphpoolError:  # the stream is gone: wait for the whole device instead
                    self._event_pool.append(ev)
                    if self._world.active:  # not now: after the captures (see _process_events)
                        self._orphans.append(block)
                        self._hold(block)
                    else:
                        self._synchronize_device()
                    continue
                except BaseException:  # a signal handler: recorded or not, the event stays pooled
                    self._event_pool.append(ev)
                    raise
                self._waiting.setdefault(s, deque()).append((ev, block))
                self._hold(block)
        except BaseException:
            # Interrupted (a signal handler inside a device call): the streams not yet covered
            # by an event are covered by a device synchronize before the block is reused
            # (_release_orphans, at the next call with no capture underway).
            self._orphans.append(block)
            self._hold(block)
            raise

    def _record_event(self, event: int, stream: int) -> None:
        assert not self._capturing, "no event is recorded during capture"
        self.device.record_event(event, stream)

    def _query_event(self, event: int) -> bool:
        if self._world.active:
            raise CaptureError("graphpool: no event is queried while a capture is underway")
        return self.device.query_event(event)

    def _synchronize_device(self) -> None:
        """Wait for all work on the device: the one place the allocator synchronizes it."""
        if self._world.active:
            raise CaptureError("graphpool: the device is not synchronized while a capture is underway")
        self.device.device_synchronize()

    def _process_events(self) -> None:
        """Free blocks whose stream users are done; stop at each stream's first pending event.

        Under the relaxed capture mode: a query must not invalidate a capture graphpool has
        not seen (begun outside it on another thread).
        """
        prev = self.device.exchange_capture_mode(CAPTURE_MODE_RELAXED)
        try:
            if not self._ask_orphans():
                return  # a capture found on an orphan's stream is underway now: no query
            for stream in list(self._waiting):
                q = self._waiting[stream]
                while q:
                    ev, block = q[0]
                    if not self._query_event(ev):
                        break
                    q.popleft()
                    self._event_pool.append(ev)
                    self._unhold(block)
                if not q:
                    del self._waiting[stream]
        finally:
            self.device.exchange_capture_mode(prev)

    def _ask_orphans(self) -> bool:
        """Ask again about the orphans while no capture is underway (``_release_orphans``);
        whether none is underway after. Asking may find a capture begun since on an orphan's
        user stream and adopt it (``_streams_capturing``): from then on a capture is underway,
        so the caller must not query or synchronize events nor free device memory. Every
        path that needs a quiet world and may find orphans asks here first, before it
        decides that the world is quiet."""
        if self._orphans and not self._world.active:
            self._release_orphans()
        return not self._world.active

    def _release_orphans(self) -> None:
        """Blocks whose events could not be recorded yet. Those whose user stream vanished
        while a capture was underway: one device synchronize covers whatever work that stream
        still had. Those whose user streams took part in a capture that is not registered
        (their ``stream_uses`` are kept): ``_insert_events`` asks again, and they wait on while
        one still captures. One block at a time, each the orphan hold's own: an exception out
        of a call (a signal handler in the device or the history) loses none."""
        orphans, self._orphans = self._orphans, []
        try:
            if any(not b.stream_uses for b in orphans):
                self._synchronize_device()
            while orphans:
                block = orphans.pop()
                try:
                    if block.stream_uses:
                        self._insert_events(block)  # or it waits on, with a hold of its own
                finally:
                    self._unhold(block)
        finally:
            self._orphans.extend(orphans)

    def _synchronize_events(self) -> None:
        """Wait for every pending event and free its block (empty_cache and OOM only); counted
        as PyTorch counts its ``synchronize_and_free_events`` (``num_sync_all_streams``)."""
        if self._world.active or not self._ask_orphans():
            raise CaptureError("graphpool: no event is synchronized while a capture is underway")
        self.stats.num_sync_all_streams += 1
        # In place, one event at a time: an exception out of a device call (a signal handler's)
        # leaves every event not yet synchronized waiting, and its block held.
        waiting = self._waiting
        for stream in list(waiting):
            q = waiting[stream]
            while q:
                ev, block = q[0]
                self.device.event_synchronize(ev)
                q.popleft()
                self._event_pool.append(ev)
                self._unhold(block)
            del waiting[stream]

    def _flush_deferred(self) -> None:
        """Once no capture is underway: record the events of frees deferred during capture."""
        # Taken off first: a block whose user streams capture again goes back on the list with a
        # hold of its own (_insert_events). One at a time: an exception out of a call (a signal
        # handler in the device or the history) loses none, the rest wait on.
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        try:
            while deferred:
                block = deferred.pop(0)
                try:
                    self._insert_events(block)
                finally:
                    self._unhold(block)  # the deferral's own hold
        finally:
            if deferred:
                self._deferred[:0] = deferred

    def _free_held(self, block: Block) -> bool:
        """A free that may keep the block back: during a capture, or with extra stream users.
        True when the block went straight back to its pool, False when it is held.

        During a capture ``_captures_for_free`` decides, whichever thread frees: a block of an
        underway capture's own pool goes back to that pool, any other block is kept for the
        graph of every capture underway. Before keeping one for captures begun outside
        graphpool, a free made now asks the device whether they are still underway
        (``_sweep``, one query each): an allocation notices their end only at its
        SWEEP_EVERY-th sweep (``_route``), and a block freed after the end must not be kept
        for the ended capture's graph. A queued free (a finalizer's, carried out later by
        ``_drain``, which sets ``_queued``) does not ask: it may have been queued during the
        capture, and then it counts as made during it (its graph may use the block), so it
        is kept for every capture still registered.

        An extra user stream (``record_stream``) that is capturing, in a capture begun
        outside graphpool and not yet seen, is asked about here (its events cannot be
        queried once recorded into a capture): that capture is adopted first, so the block
        is kept for its graph and its events wait until no capture is underway. The query
        uses no handle the event record below would not use; a stream that is gone fails it
        (on the simulator) and takes the event path's answer (a device synchronize)."""
        if block.stream_uses:
            # Adopting may release destroyed graphs (_poll_released), whose kept blocks go
            # back to their free lists: this block, in none yet, counts as allocated until
            # then, so that no neighbour merges it.
            block.allocated = True
            self._adopt_users(block)  # raising, the block stays marked allocated: _free queues it again
            block.allocated = False
        fl = block.free_list
        size = block.size
        owner = fl.private_pool
        # A MemPool's eager side is no capture's: its blocks are kept like ordinary ones.
        graph_side = owner if owner is not None and not fl.eager else None
        if self._capturing and graph_side is not None and not block.stream_uses:
            # A capture allocating from this pool takes the block back into it: with one capture
            # underway, the one that allocated it if still active (``allocated_in``, typed here
            # so that compiled its fields are read natively), else the first whose pool it is.
            rec: CaptureRecord | None = block.allocated_in
            if rec is None or not rec.active or rec.pool is not graph_side or len(self._captures) != 1:
                rec = None
                for r in self._captures.values():
                    if r.pool is graph_side:
                        rec = r
                        break
            if rec is not None:
                if len(graph_side.returnable) != rec.returnable_count:  # segments of another capture (malloc)
                    self._touch(block, rec)
                self._free_block(block, True)
                return True
        if self._capturing and self._foreign and not self._queued:
            # Which captures begun outside are still underway (the sweep may carry out queued
            # frees and releases: this block counts as allocated meanwhile, as above).
            block.allocated = True
            self._sweep()  # raising, the block stays marked allocated: _free queues it again
            block.allocated = False
        recs = self._captures_for_free(block) if self._capturing else _NO_CAPTURES
        self.stats.on_free(fl.is_small, size)
        if owner is not None:
            owner.stats.on_free(fl.is_small, size)
        if self._capturing:
            if owner is not None and owner.returnable:
                for rec in recs:
                    self._touch(block, rec)
            if recs and (len(recs) > 1 or graph_side is not recs[0].pool):
                # The graphs' kernels may touch this memory on every replay.
                for rec in recs:
                    self._hold(block)
                    rec.kept.append(block)
                if block.stream_uses:
                    self._hold(block)
                    self._deferred.append(block)
                return False
            if block.stream_uses:
                self._hold(block)
                self._deferred.append(block)
                return False
        elif block.stream_uses:
            self._hold(block)
            try:
                self._insert_events(block)
            finally:
                self._unhold(block)  # records the completion itself if this was the last hold
            return False
        self._free_block(block, False)
        return True

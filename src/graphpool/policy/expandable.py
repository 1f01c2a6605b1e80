"""Expandable segments: one virtual range per stream and kind that grows and shrinks in place
(CUDA virtual memory management; ``SizeConfig.expandable_segments``), and stream takeover;
and the fallback chain of a request no cached block fits (``_slow_block``, either kind of
segment).

Ordinary pool only (private pools keep ordinary segments). A range is reserved the size of
the device; ``_grow`` maps granules at its end (or makes the range on first use), ``_shrink``
(``empty_cache``) unmaps the whole free granules of its free end. Expandable segments are
in the heap's registry like others (``_exp``, ``_exp_of``); segments.py gives a whole free
one back.

Note [Expandable segments and the wilderness rule]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A growing segment's free last block is the one block that can grow to fit any request, so
the free lists keep it for last: where the best fit is such a block, malloc takes the next
fitting block that is not (``freelist.past_tails``; wilderness preservation, as dlmalloc's top
chunk), and a request too large for every hole maps only what the end lacks (``_grow``: the
free tail grows into the block asked for). In a growing segment any remainder of a block
splits off, oversize blocks too (PyTorch's ``should_split`` with expandable segments): it
merges back with its neighbours there, and splitting lowers peak reserved. Each granule is
mapped on its own (CUDA unmaps only whole mappings), so a shrink may unmap any tail.

Note [Stream takeover]
~~~~~~~~~~~~~~~~~~~~~~
Blocks are cached per stream. With expandable segments only, before mapping more for a
stream, ``_take_idle`` takes a run of adjacent free blocks that other streams hold when each
of those streams has all its work done (cudaMallocAsync's opportunistic reuse): a free block
was freed in its stream's order, so that stream being idle means its last use is done. Only
streams the device made are asked (``Device.stream_idle``), never the legacy stream, and a
stream is asked only when it freed a block since it last answered idle (``FreeList.idle_at``:
one answer covers every block it had freed before). Taken blocks become the taking stream's
and merge only with its free blocks; ``empty_cache`` gives the free end of a segment back
to the segment's stream after one device synchronize (``_rehome``), so it can shrink. The
out-of-memory retry runs inside an allocation, where a capture begun outside graphpool on
another stream may be underway unseen and a device synchronize would invalidate it: it gives
back the blocks other streams took over only where it can wait for those streams alone, and
leaves mapped the free memory of streams the device made that are capturing (and, while one
is, of the streams it did not make: their unmap waits for the device). Unmapping waits
for the stream of the block unmapped (``Device.vmm_unmap``), not for the device, where the
device made that stream.
"""

from __future__ import annotations

import logging
from typing import Any

from graphpool.device.protocol import (
    CAPTURE_MODE_RELAXED,
    Device,
)
from graphpool.errors import (
    GraphpoolError,
)
from graphpool.policy import logs
from graphpool.policy.block import Block, ExpandableSegment
from graphpool.policy.freelist import FreeList
from graphpool.policy.heap import LEGACY
from graphpool.policy.pools import SizeConfig
from graphpool.policy.private_pools import (
    CaptureRecord,
    CaptureWorld,
)
from graphpool.policy.segments import Segments


def _takeable(b: Block, stream: int, done: dict[int, int]) -> bool:
    """Whether free-list block ``b`` may join a run that ``stream`` takes over: no pending use,
    and ``stream``'s own or filed before its stream last answered idle (``done``, _take_idle)."""
    if b.allocated or b.holds:
        return False
    return b.stream == stream or b.gc_base < done.get(b.stream, 0)


class Expandable(Segments):
    """Growing, shrinking and taking over expandable segments (see the module doc)."""

    def __init__(self, device: Device, sizes: SizeConfig, world: CaptureWorld | None, detect: bool) -> None:
        super().__init__(device, sizes, world, detect)
        self._gran = 0  # the device's mapping granularity, asked on first use (_round_gran)

    def _take_idle(self, fl: FreeList, size: int, stream: int) -> Block | None:
        """Before mapping more for ``stream``: a block of ``fl`` for ``size`` made of free memory
        that other streams, each with all its work done, hold: the smallest run of adjacent
        free blocks of those streams and ``stream`` with room, its other streams' blocks made
        ``stream``'s and merged; returned out of the list. None when no such run has room
        (Note [Stream takeover] in the module doc).

        This is cudaMallocAsync's opportunistic reuse, with expandable segments only (the
        option off keeps PyTorch's per-stream policy exactly). A free block was freed in its
        stream's order, so that stream having finished everything means its last use is
        done. Only streams the device made are asked (``stream_idle``): another library's
        handle may have been destroyed, and the legacy stream's status covers other streams'
        captures. The caller checked that no capture is underway; a capture begun unseen on
        another stream makes that stream not idle. A block taken over keeps its segment and
        merges only with free neighbours of its new stream (``empty_cache`` settles them).
        Only the one run is taken: the other streams keep the rest of their cache. A stream
        is asked only when it freed a block since it last answered idle (``FreeList.idle_at``).
        """
        # One idle answer covers every block the stream had freed before it (``fl.calls`` ticks
        # at each malloc, before this; a block's ``gc_base`` is the tick it was filed at), so a
        # stream is asked only when it has freed a block since its last idle answer.
        done = fl.idle_at
        now = fl.calls
        device: Any = self.device  # untyped: compiled, a truthy non-bool answer is read as plain
        for t, bins in fl.bins.items():  # Python reads it, not refused
            if t == stream or t == LEGACY or not bins.sizes:
                continue
            mark = done.get(t, 0)
            for b in bins.blocks:
                if b.gc_base >= mark:
                    if bool(device.stream_idle(t)):
                        done[t] = now
                    break
        if not done:
            return None
        best: Block | None = None  # the first block of the best run
        best_size = 0
        seen: set[int] = set()  # first blocks of runs already measured
        for t in done:
            theirs = fl.find(t)
            if t == stream or theirs is None:
                continue
            for b in theirs.blocks:
                if not _takeable(b, stream, done):
                    continue
                first = b
                while True:
                    p = first.prev
                    if p is None or not _takeable(p, stream, done):
                        break
                    first = p
                if first.ptr in seen:
                    continue
                seen.add(first.ptr)
                total = 0
                r: Block | None = first
                while r is not None and _takeable(r, stream, done):
                    total += r.size
                    r = r.next
                if total >= size and (best is None or (total, first.ptr) < (best_size, best.ptr)):
                    if total < self._max_split or not self._refuses(total, size):
                        best, best_size = first, total
        if best is None:
            return None
        # make the run's blocks ``stream``'s, one by one, each merged with the one before
        cur = best
        while True:
            if cur.stream != stream:
                old, at, size_was = cur.stream, cur.ptr, cur.size
                fl.remove(cur)
                cur.stream = stream
                cur = self._merge_free(cur)
                if self._history is not None:  # after: the block is filed again (a call out)
                    self._history.record("stream_take", at, size_was, stream, None, from_stream=old)
            nxt = cur.next
            if nxt is None or not _takeable(nxt, stream, done):
                break
            cur = nxt
        block = cur
        assert block is not None and block.size >= size
        fl.remove(block)
        return block

    def _rehome(self, wait: bool) -> None:
        """``empty_cache``: the free blocks at the end of an expandable segment that other streams
        took over (``_take_idle``) go back to the segment's stream and merge, after one device
        synchronize (their last uses done), so the segment can shrink or go back whole. Taken
        blocks between live ones stay with the streams that took them: giving them back would
        free nothing, and would strand them if the segment's stream was destroyed (a destroyed
        stream is never asked whether it is idle, so nothing would take them over again).

        ``wait`` False (the out-of-memory retry, inside an allocation, where a capture begun
        outside graphpool may be underway unseen and a device synchronize would invalidate it):
        no device synchronize. The blocks of a stream go back when the device says it is idle
        (``stream_idle``), or once it has waited for that stream alone, where it made the
        stream and the stream is not capturing (``stream_synchronize_made``); another
        library's stream, the legacy stream's and a capturing one's stay where they are. They
        go home only to a live segment stream the device made that is not capturing
        (``stream_capturing``): a destroyed one's unmap would wait for the whole device, and a
        capturing one's memory stays mapped, where the taker's own is unmapped after the
        taker's work alone."""
        strays: list[tuple[Block, int]] = []
        device: Any = self.device  # untyped: a truthy non-bool answer is read as Python reads it
        ready: dict[int, bool] = {}  # (wait False) each taker asked once
        for seg in self._exp.values():
            b: Block | None = self._segments[seg.base]
            while b is not None and b.next is not None:
                b = b.next
            home_ok: bool | None = None  # (wait False) the segment's stream asked once, if need be
            while b is not None and not b.allocated and b.holds == 0:  # the free end, backwards
                if b.stream != seg.stream:
                    if not wait:
                        if home_ok is None:
                            # home only to a live stream the device made, not capturing: a
                            # destroyed one's unmap could only wait for the whole device, a
                            # capturing one's memory stays mapped; left with its taker, the
                            # block is unmapped after the taker's work alone
                            answer = device.stream_capturing(seg.stream)
                            home_ok = answer is not None and not answer
                        if not home_ok:
                            break
                        t = b.stream
                        done = ready.get(t)
                        if done is None:
                            done = bool(device.stream_idle(t)) or bool(device.stream_synchronize_made(t))
                            ready[t] = done
                        if not done:
                            break  # (it stays: the end before it could not shrink past it)
                    strays.append((b, seg.stream))
                b = b.prev
        if not strays:
            return
        if wait:
            self._synchronize_device()
        for b, home in strays:  # each still a block of its own: only ``home``'s blocks merge away
            b.free_list.remove(b)
            b.stream = home
            self._merge_free(b)

    def _capturing_streams(self) -> frozenset[int]:
        """The streams whose free expandable memory the out-of-memory retry (and the garbage
        collection inside an allocation, ``_collect``) leaves mapped while any stream the device
        made takes part in a capture (``made_streams_capturing``; none otherwise): those made
        streams that are capturing (``stream_capturing``), whose unmap could only wait for the
        whole device, which invalidates the capture; and the streams the device did not make
        (the legacy stream's, another library's: never asked, a handle may have been
        destroyed), whose unmap waits for the whole device too. ``empty_cache`` gives it all
        back once the capture is over."""
        device: Any = self.device  # untyped: a truthy non-bool answer is read as Python reads it
        free: set[int] = set()
        for seg in self._exp.values():
            b: Block | None = self._segments[seg.base]
            while b is not None:
                if not b.allocated:
                    free.add(b.stream)
                b = b.next
        if not free or not bool(device.made_streams_capturing()):
            return frozenset()
        keep: set[int] = set()
        for s in free:
            answer = None if s == LEGACY else device.stream_capturing(s)
            if answer is None or bool(answer):  # not the device's, or capturing
                keep.add(s)
        return frozenset(keep)

    def _round_gran(self, nbytes: int) -> int:
        """``nbytes`` rounded up to the device's mapping granularity (asked once)."""
        if not self._gran:
            self._gran = self.device.vmm_granularity()
        g = self._gran
        return -(-nbytes // g) * g

    def _grow(self, fl: FreeList, size: int, stream: int) -> Block | None:
        """Map enough at the end of ``stream``'s expandable segment of ``fl`` (made on first use)
        for a block of ``size``; return that block, in no free list, or None when the device
        or a limit refuses. The block is the segment's free last block grown, or a new one
        after an allocated last block; its statistics are counted as the caller expects of
        a block taken from the cache (inactive split when it has neighbours)."""
        seg = self._exp_of.get((fl.is_small, stream))
        if seg is None:
            need = self._round_gran(size)
            reserve = self._round_gran(self._total)
            if need > reserve or not self._map_allowed(need):
                return None
            va = self._map_relaxed(0, need, reserve)
            if not va:
                return None
            seg = ExpandableSegment(va, reserve, need, stream, fl.is_small)
            self._exp[va] = seg
            self._exp_of[(fl.is_small, stream)] = seg
            head = self._add_segment(va, need, stream, fl, True)
            self._segment_made(head, "allocated (expandable)", None)
            return head
        tail = self._segments[seg.base]
        while tail.next is not None:
            tail = tail.next
        # A free last block grows into the block asked for, unless it already holds the request:
        # then this request may not take it (an oversize block under max_split_size, which
        # malloc refused), and a new block is mapped after it instead.
        free_tail = not tail.allocated and tail.holds == 0 and tail.size < size and tail.stream == stream
        need = self._round_gran(size - tail.size if free_tail else size)
        end = seg.base + seg.mapped
        if seg.mapped + need > seg.reserved or not self._map_allowed(need):
            return None
        if not self._map_relaxed(end, need):
            return None
        seg.mapped += need
        self._limit_hit = None
        self.stats.num_device_alloc += 1
        k = self.stats.kind(fl.is_small)
        k.add("reserved_bytes", need)
        if free_tail:
            fl.remove(tail)
            tail.size += need
            if tail.prev is not None:
                k.add("inactive_split_bytes", need)
            self._mapped(tail, end, need, stream)
            return tail
        block = Block(end, need, stream, fl)
        block.prev = tail
        tail.next = block
        if tail.prev is None and not tail.allocated and tail.holds == 0:
            # the refused free tail was the segment's only block: with a neighbour now, it is an
            # inactive split block too (the differential test checks it)
            k.add("inactive_split", 1)
            k.add("inactive_split_bytes", tail.size)
        k.add("inactive_split", 1)
        k.add("inactive_split_bytes", need)
        self._mapped(block, end, need, stream)
        return block

    def _map_relaxed(self, va: int, need: int, reserve: int = 0) -> int:
        """Map ``need`` bytes of new memory at ``va`` under the relaxed capture mode (a capture
        underway on any thread is never invalidated); with ``reserve`` > 0, first reserve a
        fresh range of that size and map at its start. Returns the address mapped, 0 when the
        device refused (a fresh range then goes back). Nothing is filed here: on any exception
        (a driver error, or an interrupt that may come after the map took effect) the mapping
        is undone and a fresh range given back, so the range can be mapped again later."""
        prev = self.device.exchange_capture_mode(CAPTURE_MODE_RELAXED)
        mapped = False
        try:
            if reserve:
                va = self.device.vmm_reserve(reserve)
            try:
                mapped = self.device.vmm_map(va, need)
            except BaseException:
                self._unmap_quietly(va, need)
                if reserve:
                    self._release_quietly(va, reserve)
                raise
            if not mapped and reserve:
                self.device.vmm_release(va, reserve)
        finally:
            try:
                self.device.exchange_capture_mode(prev)
            except BaseException:  # (a signal handler in the restore)
                if mapped:
                    self._unmap_quietly(va, need)
                    if reserve:
                        self._release_quietly(va, reserve)
                raise
        return va if mapped else 0

    def _mapped(self, block: Block, end: int, need: int, stream: int) -> None:
        """Record the mapping that grew an expandable segment (``block``, in no free list, holds
        it; the caller hands it out). If the history raises, the block is filed free first."""
        if self._history is not None:
            try:
                self._history.record("segment_map", end, need, stream, None)
            except BaseException:
                block.free_list.insert(block)
                raise

    def _shrink(self, seg: ExpandableSegment, keep: frozenset[int] = frozenset()) -> None:
        """Unmap the whole granules of the free last block of ``seg`` (``empty_cache``; the
        caller runs under the relaxed capture mode, with no capture underway), unless it is a
        block of a stream in ``keep``. A segment left empty was already released whole by
        ``_release_segment``."""
        tail = self._segments[seg.base]
        while tail.next is not None:
            tail = tail.next
        if tail.allocated or tail.holds or tail.prev is None or tail.stream in keep:
            return
        start = seg.base + self._round_gran(tail.ptr - seg.base)
        end = seg.base + seg.mapped
        if start >= end:
            return
        try:
            # first: if it fails, nothing changed; after the work of the tail's stream (its last
            # uses were ordered on it; a stream that took it over may not be the segment's)
            self.device.vmm_unmap(start, end - start, tail.stream)
        except GraphpoolError:
            raise
        except BaseException:  # a signal handler, perhaps after the unmap took effect: make sure
            try:  # it did, and forget the range either way (unmapped memory is never filed)
                self._unmap_quietly(start, end - start, tail.stream)
            finally:
                self._unmapped_tail(seg, tail, start, end)
            raise
        self._unmapped_tail(seg, tail, start, end)
        if self._history is not None:
            self._history.record("segment_unmap", start, end - start, seg.stream, None)

    def _unmapped_tail(self, seg: ExpandableSegment, tail: Block, start: int, end: int) -> None:
        """``_shrink``'s bookkeeping once ``[start, end)`` of free last block ``tail`` is unmapped."""
        fl = tail.free_list
        fl.remove(tail)
        seg.mapped -= end - start
        self.stats.num_device_free += 1
        k = self.stats.kind(fl.is_small)
        k.add("reserved_bytes", start - end)
        if start == tail.ptr:  # the whole block goes
            before = tail.prev
            assert before is not None
            before.next = None
            tail.prev = None
            k.add("inactive_split", -1)
            k.add("inactive_split_bytes", -tail.size)
        else:
            k.add("inactive_split_bytes", start - end)
            tail.size = start - tail.ptr
            fl.insert(tail)

    # -- the out-of-memory retry and the cache release (steps of CachingAllocator._slow_block
    # and empty_cache): here, above both kinds of segment they give back
    def _release_cached(self, retry: bool = False, synced: bool = False) -> None:
        """Synchronize pending stream uses, then give back every segment no graph may use and no
        live MemPool keeps. ``retry`` (the out-of-memory retry): live MemPools' free eager
        segments go back too. ``empty_cache`` (and ``gp.graph``'s, before a capture) leaves a
        live MemPool its cache, as PyTorch does: an upstream may be costly to call again.
        ``synced``: the caller has just synchronized them. In the retry, the expandable memory
        of a stream capturing unseen stays mapped (``_capturing_streams``)."""
        if not synced:
            self._synchronize_events()
        prev = self.device.exchange_capture_mode(CAPTURE_MODE_RELAXED)
        try:
            keep: frozenset[int] = frozenset()
            if self._exp:
                self._rehome(not retry)
                if retry:
                    keep = self._capturing_streams()
            for fl in (self._small, self._large):
                self._release_free_segments(fl, keep)
            for seg in list(self._exp.values()):  # partly free: unmap their free ends
                self._shrink(seg, keep)
            for pool in self._pools.values():  # live pools: segments of failed captures,
                if retry and pool.use_count and pool.eager_small is not None:  # at a retry, and
                    for fl in pool.free_lists()[2:]:  # MemPools' eager side
                        self._release_free_segments(fl)
                if pool.use_count and pool.returnable:
                    for head in list(pool.returnable):
                        creator = head.returns_with
                        whole = head.next is None and not head.allocated and head.holds == 0
                        if whole and creator is not None and creator.failed:
                            head.free_list.remove(head)
                            self._release_segment(head)
            for pid, pool in list(self._freeable.items()):
                for fl in pool.free_lists():
                    self._release_free_segments(fl)
                if pool.segment_count == 0:
                    del self._freeable[pid]
                    del self._pools[pid]
                    if self._history is not None:
                        self._history.pool("pool_release", pool)
                    if logs.enabled(logging.DEBUG):
                        self._log_pool("released", pool)
        finally:
            self.device.exchange_capture_mode(prev)

    def _before_retry(self, fl: FreeList, size: int, stream: int) -> Block | None:
        """The driver refused memory, no capture underway: wait for pending stream uses and
        return a fitting block they freed (out of ``fl``), else release the cache (PyTorch's
        retry) and count the retry; the caller then asks the driver again."""
        self._synchronize_events()
        block = self._cached_fit(fl, size, stream)  # a stream use that just completed freed one
        if block is not None:
            return block
        self._release_cached(True, synced=True)
        self.stats.num_alloc_retries += 1
        if fl.private_pool is not None:
            fl.private_pool.stats.num_alloc_retries += 1
        return None

    def _cached_fit(self, fl: FreeList, size: int, stream: int) -> Block | None:
        """The best fitting free block of ``stream`` in ``fl`` that the split rules allow, out
        of the list; None when there is none."""
        block = fl.best_fit(stream, size, self._max_split)
        if block is None or (block.size >= self._max_split and self._refuses(block.size, size)):
            return None
        fl.remove(block)
        return block

    def _slow_expandable(self, fl: FreeList, size: int, stream: int, nbytes: int) -> Block:
        """``_slow_block`` for the ordinary pool with expandable segments: grow the stream's
        segment; out of memory and no capture underway, wait for pending stream uses, look
        in the cache again, release the cache (``empty_cache``'s work), look again (the release
        merges blocks other streams took over back into this one's) and grow again."""
        block = None if self._world.active else self._take_idle(fl, size, stream)
        if block is None:
            block = self._grow(fl, size, stream)
        if block is None and not self._world.active:
            block = self._before_retry(fl, size, stream)
            if block is None:  # the release gave blocks taken over back to this stream, merged
                block = self._cached_fit(fl, size, stream)
            if block is None:  # the release synchronized: streams busy before may be idle now
                block = self._take_idle(fl, size, stream)
            if block is None:
                block = self._grow(fl, size, stream)
        if block is None:
            block = self._oom_fallback(fl, size, stream)
        if block is None:
            self._raise_oom(nbytes, self._round_gran(size), fl, stream)
        return block

    def _slow_block(
        self, fl: FreeList, size: int, stream: int, nbytes: int, rec: CaptureRecord | None
    ) -> Block:
        """No cached block fits: the fallback chain, each step tried only when those before it
        found nothing. The returned block is in no free list.

        First, with no driver call: graphs the device reports destroyed are released, ended
        captures begun outside are noticed, and with a garbage-collection threshold old free
        segments go back (``_collect``). Then, as PyTorch's ``alloc_block ||
        release_available_cached_blocks && alloc_block || release_cached_blocks && alloc_block``:

        1. a new segment of the usual size (``_device_malloc``); with expandable segments,
           ``_slow_expandable``'s chain instead (takeover, grow, retry);
        2. out of memory with ``max_split_size`` set, in the ordinary pool: give back free
           oversize segments of this stream, and ask again (``_release_oversize``);
        3. out of memory: wait for pending stream uses and take a fitting block they freed,
           else release every cached unsplit segment and ask again (``_before_retry``);
        4. the smallest segment that holds the request (``SizeConfig.least_segment``);
        5. out of memory (``_raise_oom``).

        Steps 2 and 3 free or wait for device work, so they are skipped while any capture is
        underway in the process.
        """
        self._limit_hit = None  # only a refusal during this request may be blamed on a limit
        self._upstream_error = None  # (or on a MemPool's upstream: a refusal retried since is no cause)
        if self._tokens:
            self._poll_released()
        if rec is None and self._foreign:
            # A capture begun outside may have ended since _route last swept (SWEEP_EVERY):
            # notice it before a retry or collection is refused for a capture that is over.
            self._sweep()
        if self._gc_threshold and self.limits.fraction is not None and not self._world.active:
            self._collect(self._gc_threshold)
        if self._expandable and fl.private_pool is None:
            return self._slow_expandable(fl, size, stream, nbytes)
        owner = fl.private_pool
        up = None if owner is None else owner.upstream
        seg = self.sizes.segment_size(size)
        ptr = self._device_malloc(seg, up, stream)
        if (
            ptr is None
            and self._max_split <= self._total
            and fl.private_pool is None
            and not self._world.active
        ):
            if self._release_oversize(fl, size, stream):  # PyTorch's release_available_cached_blocks
                ptr = self._device_malloc(seg)
        if ptr is None and not self._world.active:
            block = self._before_retry(fl, size, stream)
            if block is not None:
                return block
            ptr = self._device_malloc(seg, up, stream)
        if ptr is None:
            least = self.sizes.least_segment(size)
            if least < seg:
                ptr = self._device_malloc(least, up, stream)
                if ptr is not None:
                    seg = least
        if ptr is None:
            block = self._oom_fallback(fl, size, stream)
            if block is not None:
                return block
            self._raise_oom(nbytes, seg, fl, stream)
        head = self._add_segment(ptr, seg, stream, fl)
        if owner is not None and rec is not None:  # may go back with the capture if it fails
            self._set_returns_with(head, rec)  # (see _touch)
        self._segment_made(head, "allocated", owner)
        return head

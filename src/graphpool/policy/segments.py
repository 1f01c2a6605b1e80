"""Segment supply: device allocations and their limits, garbage collection, oversize release,
giving segments back, and the out-of-memory error.

Each step of the allocator's fallback chain (``CachingAllocator._slow_block``) is one method
here: ``_device_malloc`` (refused past a memory limit as the driver refuses when the device
is full), ``_collect`` (PyTorch's ``garbage_collect_cached_blocks``), ``_release_oversize``
(``release_available_cached_blocks``), ``_release_segment`` (the one place device memory is
freed) and ``_raise_oom`` with its message.

Cooperation before an out-of-memory error (graphpool.cooperate sets ``release_others``):
when the device refused a segment (no limit hit, no capture underway, not this thread's
retry), ``_raise_oom`` raises the error uncounted and marked (``_graphpool_cooperate``);
``CachingAllocator._malloc``, the lock released, asks the process's other caches to give
memory back and retries once if they gave any. Only the final failure is counted
(``_count_oom``). The hot path is untouched: all of it runs on the way to the error.

Driver calls run under the relaxed capture mode, so a capture underway on any thread (one
graphpool may not have seen yet) is never invalidated by them; nothing is freed while a
capture is underway anywhere in the process. A segment is filed before the history or the
log hears of it, and forgotten before the device frees it: a call out that raises (a signal
handler inside it) never leaves a segment filed twice or freed twice.
"""

from __future__ import annotations

import logging
import threading
from bisect import bisect_left
from collections.abc import Callable
from typing import Any, NoReturn

from graphpool import _warnings
from graphpool.device.protocol import (
    CAPTURE_MODE_RELAXED,
    Device,
)
from graphpool.errors import (
    CaptureError,
    GraphpoolError,
    OutOfMemoryError,
)
from graphpool.policy import logs, observers
from graphpool.policy.block import Block, iter_segment
from graphpool.policy.freelist import FreeList
from graphpool.policy.limits import MemoryLimits
from graphpool.policy.pools import SizeConfig
from graphpool.policy.private_pools import (
    MANAGED,
    CaptureWorld,
    PrivatePool,
)
from graphpool.policy.stream_uses import StreamUses
from graphpool.policy.units import fmt_bytes

_retrying = threading.local()
"""``on`` while this thread's malloc retries after other caches gave memory back (cooperation):
that retry's failure is final."""


class Segments(StreamUses):
    """Where segments come from and go back to (see the module doc)."""

    def __init__(self, device: Device, sizes: SizeConfig, world: CaptureWorld | None, detect: bool) -> None:
        super().__init__(device, sizes, world, detect)
        # Caps on reserved memory (policy/limits.py), swapped whole by their setters; the
        # description of the cap that refused the last driver allocation, for the OOM message.
        self.limits = MemoryLimits(self._total)
        self._limit_hit: str | None = None
        # Cooperation (graphpool.cooperate): asked, with the lock released, to make other
        # caches of the process give memory back before an out-of-memory error is raised.
        self.release_others: Callable[[int, int], int] | None = None
        # Why a MemPool's upstream last refused a segment (chained to the OOM error).
        self._upstream_error: BaseException | None = None

    def _device_malloc(self, nbytes: int, upstream: Any = None, stream: int = 0) -> int | None:
        """Driver allocation, always under the relaxed capture mode: a capture underway on any
        thread (one graphpool may not have seen yet) is never invalidated by it. ``upstream``:
        where a MemPool's segments come from (None: ``Device.malloc``; see ``_upstream_malloc``).

        Refused, as the driver refuses when the device is full (None), when the segment would
        take reserved memory past a limit (policy/limits.py): the caller's retry and
        out-of-memory error are the same.
        """
        if not self._map_allowed(nbytes):
            return None
        prev = self.device.exchange_capture_mode(CAPTURE_MODE_RELAXED)
        ptr: int | None = None
        try:
            ptr = (
                self.device.malloc(nbytes)
                if upstream is None
                else self._upstream_malloc(upstream, nbytes, stream)
            )
        finally:
            try:
                self.device.exchange_capture_mode(prev)
            except BaseException:  # (a signal handler in the restore): the caller never sees
                if ptr is not None:  # the segment, so the driver gets it back
                    self._free_memory(ptr, nbytes, upstream, stream)
                raise
        if ptr is not None:
            self._limit_hit = None
            self._upstream_error = None
        return ptr

    def _upstream_malloc(self, upstream: Any, nbytes: int, stream: int) -> int | None:
        """A segment from a MemPool's upstream (private_pools.PoolSpec): managed memory
        (``Device.malloc_managed``), or a user object's ``malloc(nbytes, device, stream)``. A
        refusal (None or 0), an exception or a wrong answer is out of memory (None): the caller
        retries and raises the usual OutOfMemoryError, with the upstream's exception chained
        (``_upstream_error``). A signal handler's exception (BaseException) propagates."""
        if upstream is MANAGED:
            fn = getattr(self.device, "malloc_managed", None)
            if fn is None:
                self._upstream_error = GraphpoolError(
                    f"device {self.device.index} ({type(self.device).__name__}) has no managed memory"
                )
                return None
            got: Any = fn(nbytes)
            return None if got is None else int(got)
        try:
            got = upstream.malloc(nbytes, self.device.index, stream)
        except Exception as exc:
            self._upstream_error = exc
            return None
        if got is None or got == 0:
            return None
        if type(got) is not int or got < 0 or got + nbytes >= 1 << 63:
            self._upstream_error = TypeError(  # (a Block keeps its address as a 64-bit int)
                f"the upstream's malloc returned {got!r}, not a device address (a positive int below 2**63)"
            )
            return None
        if self._overlaps(got, nbytes):  # not given back: freeing it could free a live segment
            self._upstream_error = ValueError(
                f"the upstream's malloc returned 0x{got:x}, which overlaps memory graphpool already "
                "holds; the upstream is broken"
            )
            return None
        return got

    def _overlaps(self, ptr: int, nbytes: int) -> bool:
        """Whether ``[ptr, ptr + nbytes)`` meets a segment of this allocator (O(log segments +
        blocks of one segment))."""
        i = bisect_left(self._seg_bases, ptr + nbytes) - 1
        if i < 0:
            return False
        head = self._segments[self._seg_bases[i]]
        end = head.ptr + sum(b.size for b in iter_segment(head))
        return end > ptr

    def _free_memory(self, ptr: int, nbytes: int, upstream: Any, stream: int) -> None:
        """Give a segment back to where it came from (the device's ``free`` for managed memory
        too, as ``cudaFree`` frees both; a user upstream's ``free``)."""
        if upstream is None or upstream is MANAGED:
            self.device.free(ptr)
        else:
            upstream.free(ptr, nbytes, self.device.index, stream)

    def _map_allowed(self, nbytes: int) -> bool:
        """The limit rule: whether ``nbytes`` more of device memory (a segment, or a mapping that
        grows an expandable one) keeps reserved memory within the limits. A refusal is noted
        for the out-of-memory message and logged."""
        limits = self.limits
        if limits.cap is not None and self.stats.current("reserved_bytes") + nbytes > limits.cap:
            self._refuse_by_limit(limits, nbytes)
            return False
        return True

    def _refuse_by_limit(self, limits: MemoryLimits, nbytes: int) -> None:
        """Note (for the OOM message) and log that a limit refused a segment of ``nbytes``."""
        reserved = self.stats.current("reserved_bytes")
        why = limits.refusal(reserved, nbytes, fmt_bytes) or "a memory limit"
        self._limit_hit = why
        if logs.enabled(logging.INFO):
            logs.log.info(
                "device %d: a new segment of %d bytes refused by %s (%d bytes reserved)",
                self.device.index,
                nbytes,
                why,
                reserved,
            )

    def _segment_made(self, head: Block, what: str, owner: PrivatePool | None) -> None:
        """Record and log a new segment, filed and counted, whose head is in no free list yet (the
        caller hands it out). If a call out raises, the head is filed free first: the segment
        stays cached, and the exception propagates."""
        try:
            if self._history is not None:
                self._history.segment_alloc(head.ptr, head.size, head.stream, owner)
            if logs.enabled(logging.DEBUG):
                self._log_segment(what, head)
        except BaseException:
            head.free_list.insert(head)
            raise

    def _log_segment(self, what: str, head: Block) -> None:
        """Log a segment's allocation or release (DEBUG; the caller checked the level)."""
        owner = head.free_list.private_pool
        logs.log.debug(
            "device %d: segment %s at 0x%x, %d bytes, stream 0x%x, %s",
            self.device.index,
            what,
            head.ptr,
            head.size,
            head.stream,
            "ordinary pool" if owner is None else f"private pool {tuple(owner.id)}",
        )

    def _collect(self, threshold: float) -> None:
        """PyTorch's ``garbage_collect_cached_blocks``: while reserved memory passes ``threshold``
        times the memory fraction's cap, release the whole free segments of the ordinary large
        pool whose age (searches of the pool since they went in) is at least the average age,
        pass after pass, until that excess is reclaimed. No event sync, no capture underway."""
        cap = self.limits.fraction_bytes()
        assert cap is not None
        reserved = self.stats.current("reserved_bytes")
        limit = int(threshold * cap)
        if reserved <= limit:
            return
        fl = self._large
        now = fl.calls
        # inside an allocation, where a capture begun unseen may be underway: the expandable
        # memory whose unmap could only wait for the whole device stays (_capturing_streams)
        keep = self._capturing_streams() if self._exp else frozenset()
        blocks = [b for b in fl if b.prev is None and b.next is None and not self._stays_mapped(b, keep)]
        total_age = sum(now - b.gc_base for b in blocks)
        target = reserved - limit
        reclaimed = 0
        freed = True
        prev = self.device.exchange_capture_mode(CAPTURE_MODE_RELAXED)
        try:
            while reclaimed < target and freed and blocks:
                threshold_age = total_age / len(blocks)
                freed = False
                kept = []
                for b in blocks:
                    age = now - b.gc_base
                    if age >= threshold_age:
                        freed = True
                        reclaimed += b.size
                        total_age -= age
                        fl.remove(b)
                        self._release_segment(b)
                    else:
                        kept.append(b)
                blocks = kept
        finally:
            self.device.exchange_capture_mode(prev)

    def _oom_fallback(self, fl: FreeList, size: int, stream: int) -> Block | None:
        """The device is full for an allocation of the ordinary pool: a fitting free block of
        ``stream`` from the eager side of a MemPool made with ``use_on_oom`` (PyTorch's flag),
        out of its list; it goes back there when freed. None if there is none, or the
        allocation is not the ordinary pool's. Never a graph side's block (private_pools.py)."""
        if fl.private_pool is not None:
            return None
        for pool in self._pools.values():
            if not pool.use_on_oom or pool.eager_small is None or pool.eager_large is None:
                continue
            other = pool.eager_small if fl.is_small else pool.eager_large
            block = other.best_fit(stream, size, self._max_split)
            if block is not None and not (block.size >= self._max_split and self._refuses(block.size, size)):
                other.remove(block)
                return block
        return None

    def _release_oversize(self, fl: FreeList, size: int, stream: int) -> bool:
        """Out of memory with ``max_split_size`` set: give back the smallest free oversize
        segment of ``stream`` that holds the request (at least ``max_split_size``), else the
        largest ones until as much is freed (PyTorch's ``release_available_cached_blocks``).
        True when enough was freed. Ordinary pools only, no capture underway (the caller checks)."""
        key = max(size, self._max_split)
        bins = fl.bins.get(stream)
        if bins is None or not bins.sizes:
            return False
        i = bisect_left(bins.sizes, key)
        if i < len(bins.sizes):
            victims = [bins.blocks[i]]
        else:
            victims = []
            freed = 0
            for block in reversed(bins.blocks):
                if freed >= key or block.size < self._max_split:
                    break
                victims.append(block)
                freed += block.size
        # Oversize blocks are never split, so each is a whole segment; check all the same.
        victims = [b for b in victims if b.prev is None and b.next is None]
        prev = self.device.exchange_capture_mode(CAPTURE_MODE_RELAXED)
        try:
            for block in victims:
                fl.remove(block)
                self._release_segment(block)
        finally:
            self.device.exchange_capture_mode(prev)
        return sum(b.size for b in victims) >= key

    def _capturing_streams(self) -> frozenset[int]:
        """The streams whose free expandable memory stays mapped inside an allocation (the
        expandable layer's answer, expandable.py); none without expandable segments."""
        return frozenset()

    def _stays_mapped(self, head: Block, keep: frozenset[int]) -> bool:
        """Whether the whole free segment at ``head`` is an expandable one of a stream in ``keep``
        (``_capturing_streams``: its unmap could only wait for the device), left mapped."""
        return bool(keep) and head.stream in keep and head.ptr in self._exp

    def _release_free_segments(self, fl: FreeList, keep: frozenset[int] = frozenset()) -> None:
        """Give back every whole free segment of ``fl`` but those ``_stays_mapped`` keeps."""
        for block in fl:
            if block.prev is None and block.next is None and not self._stays_mapped(block, keep):
                fl.remove(block)
                self._release_segment(block)

    def _release_segment(self, block: Block) -> None:
        """Give a whole free segment back to the driver: the one place device memory is freed."""
        if self._world.active:
            raise CaptureError("graphpool: no device memory is freed while a capture is underway")
        # The allocator forgets the segment first, then the device gives it back: a device call
        # that raises (a driver error, or a signal handler's exception after the free took
        # effect) never leaves a freed segment filed, to be handed out or freed a second time.
        # What that costs when the driver did not free it: the memory stays with the driver.
        seg = self._forget_segment(block)
        owner = block.free_list.private_pool
        if owner is not None:
            self._set_returns_with(block, None)
        try:
            if seg is None:
                self._free_memory(
                    block.ptr, block.size, None if owner is None else owner.upstream, block.stream
                )
            else:  # a whole free expandable segment: unmap it and give back its range, after the
                # work of its one block's stream (the block's last uses were ordered on it; a stream
                # that took it over may not be the segment's): no device synchronize, which would
                # invalidate a capture begun unseen on another stream (Device.vmm_unmap)
                try:
                    self.device.vmm_unmap(seg.base, seg.mapped, block.stream)
                except GraphpoolError:
                    raise
                except BaseException:  # perhaps after the unmap took effect: finish it
                    try:
                        self._unmap_quietly(seg.base, seg.mapped, block.stream)
                    finally:
                        self._release_quietly(seg.base, seg.reserved)
                    raise
                self.device.vmm_release(seg.base, seg.reserved)
        finally:
            if self._history is not None:
                self._history.segment_free(block.ptr, block.size, block.stream, owner)
            if logs.enabled(logging.DEBUG):
                self._log_segment("released", block)

    def _unmap_quietly(self, va: int, nbytes: int, stream: int | None = None) -> None:
        """Unmap ``[va, va + nbytes)`` of one of this allocator's reservations if it is mapped: a
        map or unmap that raised may or may not have taken effect. The device refusing (nothing
        mapped there) is the answer, not an error. Safe to repeat: nobody else maps into the
        allocator's reservations."""
        try:
            self.device.vmm_unmap(va, nbytes, stream)
        except GraphpoolError:
            pass

    def _release_quietly(self, va: int, nbytes: int) -> None:
        """Give back a reservation that an interrupted call left (a refusal is ignored)."""
        try:
            self.device.vmm_release(va, nbytes)
        except GraphpoolError:
            pass

    def _raise_too_large(self, nbytes: int, stream: int) -> NoReturn:
        """A request larger than the device: out of memory, with no limit or upstream to blame."""
        self._limit_hit = None
        self._upstream_error = None
        self._raise_oom(nbytes, None, None, stream)

    def _raise_oom(self, nbytes: int, seg: int | None, fl: FreeList | None, stream: int = 0) -> NoReturn:
        """Count an out-of-memory (device, and the private pool ``fl`` belongs to), record it in
        the history and raise it; ``_after_oom`` logs it and calls the observers once the lock
        is released. One that other caches might avert goes out uncounted, for malloc to
        cooperate first (see the module doc)."""
        limit, self._limit_hit = self._limit_hit, None
        upstream_error, self._upstream_error = self._upstream_error, None
        err = OutOfMemoryError(self._oom_message(nbytes, seg, limit, fl))
        if upstream_error is not None:
            err.__cause__ = upstream_error
        if (
            self.release_others is not None
            and seg is not None
            and limit is None
            and not self._world.active
            and not getattr(_retrying, "on", False)
        ):
            err._graphpool_cooperate = (nbytes, fl, stream)  # type: ignore[attr-defined]
            raise err
        self._count_oom(err, nbytes, fl, stream)
        raise err

    def _count_oom(self, err: OutOfMemoryError, nbytes: int, fl: FreeList | None, stream: int) -> None:
        """Count a final out-of-memory error (device, private pool), record it in the history,
        and note the observers to call once the lock is released (``_after_oom``)."""
        self.stats.num_ooms += 1
        if fl is not None and fl.private_pool is not None:
            fl.private_pool.stats.num_ooms += 1
        if self._history is not None:  # before the observers: one may take a snapshot
            self._history.oom(nbytes, stream, self._device_free(), None if fl is None else fl.private_pool)
        fns = observers.current()
        # Logging and observers run once the lock is released (``_after_oom``): a logging
        # handler or an observer may take its own locks, call graphpool or wait for threads.
        err._graphpool_oom = (fns, nbytes, self._device_stats() if fns else None)  # type: ignore[attr-defined]

    def _after_oom(self, err: OutOfMemoryError) -> None:
        """An out-of-memory error is leaving malloc, the lock released: log it and call the
        observers with the statistics of the moment it happened (as PyTorch does). An
        observer's exception is chained to ``err`` and warned about; ``err`` is raised after."""
        note = err.__dict__.pop("_graphpool_oom", None)
        if note is None:  # not raised by this allocator, or already followed up
            return
        fns, nbytes, stats = note
        if logs.enabled(logging.INFO):
            logs.log.info("%s", err)
        if not fns:
            return
        errors = observers.call(fns, self.device.index, nbytes, stats)
        if errors:
            err.__context__ = errors[0]
            for exc in errors:
                try:
                    _warnings.warn(
                        f"graphpool: an out-of-memory observer raised {exc!r}; the OutOfMemoryError "
                        "is raised all the same",
                        RuntimeWarning,
                    )
                except Exception:  # warnings turned into errors: the chained exception says it
                    pass

    def _device_free(self) -> int:
        """The device's free memory now, 0 if it cannot tell (for the history's OOM events)."""
        try:
            return self.device.mem_info()[0]
        except GraphpoolError:
            return 0

    def _oom_message(
        self, nbytes: int, seg: int | None, limit: str | None = None, fl: FreeList | None = None
    ) -> str:
        """The out-of-memory message: the request, the limit that refused it if one did, then
        what is allocated, reserved, held in private pools and free on the device, then what
        to do. ``seg`` None: the request alone is larger than the device."""
        st = self.stats
        private = sum(p.stats.current("reserved_bytes") for p in self._pools.values())
        kept = self._kept_bytes()
        try:
            free, total = self.device.mem_info()
            dev = f"{fmt_bytes(free)} free of {fmt_bytes(total)} on the device"
        except GraphpoolError:
            dev = "device free memory unknown"
        during = " during graph capture (the cache cannot be released then)" if self._world.active else ""
        owner = None if fl is None else fl.private_pool
        if owner is not None and owner.upstream is not None:
            source = "managed memory" if owner.upstream is MANAGED else f"upstream {owner.upstream!r}"
            during += f" in MemPool {tuple(owner.id)}, whose segments come from {source}"
        return (
            f"out of memory on device {self.device.index}{during}: tried to allocate {fmt_bytes(nbytes)} "
            + (
                f"(a new segment of {fmt_bytes(seg)}); "
                if seg is not None
                else f"({nbytes} bytes), more than the device's {fmt_bytes(self._total)} in total; "
            )
            + (f"a limit was hit: reserved memory would pass {limit}; " if limit else "")
            + f"{fmt_bytes(st.current('allocated_bytes'))} allocated, "
            f"{fmt_bytes(st.current('reserved_bytes'))} reserved "
            f"({fmt_bytes(private)} of it in private graph pools, and {fmt_bytes(kept)} of ordinary "
            f"blocks kept for captured graphs that may touch them), {dev}. "
            "Free buffers you no longer need, reset graphs you no longer replay, "
            "then call empty_cache()" + ("; or raise the limit." if limit else ".")
        )

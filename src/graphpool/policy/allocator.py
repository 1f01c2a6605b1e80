"""CachingAllocator: the caching policy of one device, with private pools for capture.

Plain Python over a ``Device`` (device/protocol.py). Requests round to 512 B, go to the small
(<= 1 MiB) or large pool, and take the best-fitting free block of their own stream; what no
block fits comes from a new segment. Freed blocks merge with free neighbours and return to
the pool they came from. While a capture is underway, its stream's requests are served from
its private pool.

The class is built in layers, one module per concern, each layer a base class of the next
(single inheritance of native classes: compiled by mypyc, every field read stays a native
read, where traits would cost a table lookup per attribute):

=========================  ====================================================================
heap.Heap                  blocks, split and merge, the segment registry, pointer lookups
                           and errors, the ownership of allocations
captures.Captures          routing (captures, use_mem_pool), begin/adopt/end/abort/release/sweep,
                           private pools, blocks kept for graphs
stream_uses.StreamUses     frees that wait: record_stream events, deferrals, orphans
segments.Segments          device malloc and MemPools' upstreams, limits, garbage
                           collection, oversize release, use_on_oom, giving segments back,
                           the out-of-memory error
expandable.Expandable      expandable segments: grow, shrink, stream takeover; the
                           fallback chain, the out-of-memory retry and the cache release
                           (both kinds of segment)
reports.Reports            statistics, snapshots, the history, the invariant check
CachingAllocator (here)    the lock protocol, the hand-written malloc and free, every public
                           method
=========================  ====================================================================

A layer calls only down, with three exceptions declared where they are needed: ``_drain``
(declared by the heap, defined here: it owns the free path) and ``_insert_events`` /
``_flush_deferred`` (declared by captures.py, defined by stream_uses.py). docs/architecture.rst
follows an allocation through them.

Note [The hand-written hot path]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``_malloc`` and ``_free`` are the cached pair every allocation pays for, so they write out
what the layers below would otherwise do in calls: the rounding (``SizeConfig.round_size``),
the capture test and routing (captures.py is called only while a capture is registered or
the stream is not the legacy one), the best fit (``FreeList.best_fit`` written as one
bisect), the split rule (``SizeConfig.splits``), the lookup of a raw address (heap.py's
``_live_block``) and the statistics. Compiled, each call saved is tens of instructions of a
pair of about 4,000; callgrind counts them (benchmarks/pair_instructions.py). What they write
out must agree with the layers' own methods: the property machines and the differential test
(tests/property) check both, and tests/policy/test_parking.py checks parking's use of them
(``_takes_back``) against real frees and requests. Other
details of the pair: the address is returned as the int object filed in ``_active``, so a
free given that same object finds the block without boxing a new int; ``malloc_owned``'s
Block is returned itself and never filed, saving the dictionary insert and lookup.

Note [Signals and the lock]
~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every public call takes the allocator's reentrant lock and marks the allocator ``_busy``:
a call that re-enters on the same thread (user code run by garbage collection inside a
call) must not see half-updated state, so ``free`` then queues the pointer and anything
else raises. Finalizers never take the lock: ``defer_free`` queues a pointer that the next
call drains (``_pending``, ``_drain``).

A call holding the lock is a critical section for a guarded signal handler
(policy/interrupts.py, both builds): a handler whose signal lands there runs right after
the lock is released (each call tests ``_signals`` then), never with the lock held. The
lock is taken with ``with`` on C methods (compiled through ``_Held``), and nothing runs
between setting ``_busy`` and the ``try`` that clears it, so a KeyboardInterrupt can
neither keep the lock nor leave the allocator busy. Out-of-memory observers and the OOM log
line run after the release too (``_after_oom``). Every call out to Python code in the
middle of an update (the device, the history, logging) finds the state consistent or rolls
its update back if it raises: an unguarded handler's exception there, the only place one
can land compiled, breaks no invariant (docs/behaviour.rst, "Interrupts", states what a
device call that raised may have cost). A handler that raises after a call completed makes
the caller lose its result: malloc and ``begin_capture`` give theirs back (``_undo_malloc``,
the ``undo`` of ``_run_locked``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any, Final, NoReturn, SupportsIndex, TypeVar, cast

from graphpool import _warnings
from graphpool.device.protocol import (
    Device,
)
from graphpool.errors import (
    CaptureError,
    GraphpoolError,
    OutOfMemoryError,
)
from graphpool.policy import interrupts
from graphpool.policy.block import Block
from graphpool.policy.freelist import Bins, FreeList, bisect_sizes, past_tails
from graphpool.policy.heap import LEGACY as _LEGACY
from graphpool.policy.pools import DEFAULT, SizeConfig
from graphpool.policy.private_pools import (
    CaptureRecord,
    CaptureWorld,
    PoolExit,
    PoolId,
    PrivatePool,
    mempools,
)
from graphpool.policy.reports import Reports
from graphpool.policy.segments import _retrying

_Lock: Callable[[], Any]
try:  # the C lock, built with the compiled modules (graphpool/policy/_lock.c)
    from graphpool.policy._lock import RLock as _CLock

    _Lock = _CLock
except ImportError:
    try:  # CuPy's lock (see CachingAllocator.__init__)
        from fastrlock.rlock import FastRLock

        _Lock = FastRLock
    except ImportError:  # no fastrlock wheel (PyPy): the stdlib's reentrant lock, slower
        _Lock = threading.RLock

T = TypeVar("T")

_COMPILED: Final = not __file__.endswith(".py")  # as graphpool.build.compiled() tells


class _Held:
    """The allocator lock's calls, bound once: what ``with self._held`` and ``free_owned`` use in
    the compiled build.

    Compiled, ``with`` on a native class calls its ``__enter__``/``__exit__`` directly, where
    ``with`` on the lock itself looks both methods up on the lock's type at every call; these
    call the lock's C methods, bound here once. No Python code runs between the acquire and
    the ``try`` of the ``with``, so a signal still cannot keep the lock. The plain-Python build
    does not use this class: there ``_held`` is the lock itself, whose enter and exit are C
    code (a Python-level ``__enter__`` could be interrupted after acquiring).
    """

    __slots__ = ("_enter", "_acquire", "_try", "_release")

    def __init__(self, lock: Any) -> None:
        self._enter: Callable[[], object] = lock.__enter__
        self._acquire: Callable[[bool], object] = lock.acquire
        # graphpool.policy._lock's try_acquire takes no arguments (cheaper to call); other locks'
        # acquire(False) does the same
        self._try: Callable[[], object] | None = getattr(lock, "try_acquire", None)
        self._release: Callable[[], object] = lock.release

    def __enter__(self) -> None:
        self._enter()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        self._release()

    def acquire(self, blocking: bool) -> bool:
        try_ = self._try
        if try_ is not None and not blocking:
            return try_() is True
        return bool(self._acquire(blocking))

    def release(self) -> None:
        self._release()


def _reentered(call: str) -> NoReturn:
    raise GraphpoolError(
        f"graphpool: {call} re-entered the allocator while this thread was inside it (a finalizer "
        "run by garbage collection during an allocator call?). From finalizers only free "
        "buffers; graphpool queues those frees."
    )


class CachingAllocator(Reports):
    """The allocator of one device. Every public method is thread-safe."""

    def __init__(
        self,
        device: Device,
        *,
        sizes: SizeConfig = DEFAULT,
        world: CaptureWorld | None = None,
        detect: bool = True,
    ) -> None:
        # Reentrant, and uncontended its acquire and release make no OS call (a threading.Lock
        # makes two): graphpool's C lock compiled (argument-free C methods), else CuPy's
        # fastrlock, else threading.RLock.
        self._lock = _Lock()
        # Its calls as the hot path makes them: bound once, compiled (``_Held``); plain Python,
        # the lock itself. Tests that swap ``_lock`` for a hooked lock swap this too.
        self._held: _Held = _Held(self._lock) if _COMPILED else cast(_Held, self._lock)
        self._busy = False  # a locked call is running (Note [Signals and the lock])
        # Signal handlers deferred until a critical section ends (policy/interrupts.py): the
        # shared list, tested after each section (a native attribute read, compiled).
        self._signals = interrupts.pending
        self._section = interrupts.section(self._lock)  # what the guard asks (interrupts.py)
        self._debug = os.environ.get("GRAPHPOOL_DEBUG", "") == "1"
        super().__init__(device, sizes, world, detect)

    def configure(self, sizes: SizeConfig) -> None:
        """Replace the size policy (``gp.set_allocator_config``): only before the first allocation,
        since blocks already cut follow the policy they were cut under. RuntimeError after."""

        def run() -> None:
            if self.has_allocated():
                raise RuntimeError(
                    f"the allocator of device {self.device.index} has already allocated: its "
                    "configuration can be set only before the first allocation"
                )
            self._apply_sizes(sizes)

        self._run_locked("configure", run)

    def has_allocated(self) -> bool:
        """Whether this allocator ever handed out memory or holds a segment."""
        return bool(self._serial or self._segments)

    @property
    def detect(self) -> bool:
        """Whether every allocation asks the device if its stream is capturing (see the module doc)."""
        return self._detect

    @detect.setter
    def detect(self, on: bool) -> None:
        self._detect = bool(on)

    def _run_locked(self, name: str, fn: Callable[[], T], undo: Callable[[T], None] | None = None) -> T:
        """``fn()`` with the lock held and the allocator marked busy: every call but malloc and
        free (which write the same steps out) goes through here.

        ``with`` on the lock (its enter and exit are C code; compiled, through ``_Held``, which
        calls them with no Python code in between) and no call between setting ``_busy`` and
        the ``try``: a KeyboardInterrupt can neither keep the lock nor leave the allocator
        marked busy.
        """
        try:
            with self._held:
                if self._busy:
                    _reentered(name)
                self._busy = True
                try:
                    if self._parked is not None:  # Note [Parking] (heap.py)
                        self._unpark()
                    out = fn()
                finally:
                    self._busy = False
        except OutOfMemoryError as err:
            pending = err.__dict__.pop("_graphpool_cooperate", None)
            if pending is not None:  # marked for cooperation, but no malloc retries it: count it
                oom = err
                self._run_locked(name, lambda: self._count_oom(oom, *pending))
            self._after_oom(err)
            if self._signals:
                interrupts.run_pending()
            raise
        except BaseException:
            if self._signals:
                interrupts.run_pending()
            raise
        if self._signals:  # a signal came mid-call (policy/interrupts.py): handle it now, the lock
            try:  # released (a handler may wait for a thread)
                interrupts.run_pending()
            except BaseException:  # the caller will not get ``out``: ``undo`` takes it back
                if undo is not None:
                    self._run_locked(name, lambda: undo(out))
                raise
        return out

    def malloc(self, nbytes: SupportsIndex, *, stream: int) -> int:
        """Hand out at least ``nbytes`` for work on ``stream``; return the address.

        Cached path: one bisect, at most one split, no driver call but the capture query
        (when detection is on). Raises ValueError or TypeError for a bad size and
        OutOfMemoryError when the device is full.
        """
        return cast(int, self._malloc(nbytes, stream, False))

    def malloc_owned(self, nbytes: SupportsIndex, *, stream: int) -> Block:
        """``malloc`` for an owner that keeps the allocation's Block (``DeviceBuffer``) and
        gives that same Block to ``free_owned`` or ``defer_free``.

        The block is not filed by address: no dictionary insert here and no lookup at its
        free (together about a fifth of a cached pair). Its
        address is still known to ``lookup`` and to the errors for a wrong ``free``.
        """
        return cast(Block, self._malloc(nbytes, stream, True))

    def _malloc(self, nbytes: SupportsIndex, stream: int, owned: bool) -> object:
        """The one body of ``malloc`` and ``malloc_owned``: the address as the int object
        filed in ``_active`` (a raw allocation; a free given that same object finds the
        block by identity), or the Block itself (``owned``)."""
        # ``nbytes`` is typed SupportsIndex, not int: compiled by mypyc, an ``int`` parameter
        # would admit a bool and refuse numpy integers before the check below could run.
        requested = nbytes if type(nbytes) is int else self._check_size_type(nbytes)
        if requested < 0 or requested > self._total:
            self._reject_size(requested, stream)
        m = self.sizes.min_block
        size = m if requested < m else (requested + m - 1) & -m
        if self._divisions:  # roundup_power2_divisions (pools.py)
            size = self.sizes.round_divisions(requested)
        small = size <= self._small_limit
        out: object
        try:
            with self._held:  # `with`: see _run_locked
                if self._busy:
                    _reentered("malloc")
                self._busy = True
                try:
                    rec = None
                    # the legacy stream (0) never captures: no query for it (CuPy's default)
                    if self._capturing or (self._detect and stream != _LEGACY):
                        # The query takes the handle as an int object: the last one is kept, so
                        # a run of calls on one stream boxes none (CUDA's handles are pointers,
                        # a new int object each).
                        key = self._qkey
                        if stream != self._qstream:
                            self._qstream = -1  # no moment where the kept pair disagrees
                            key = stream
                            self._qkey = key
                            self._qstream = stream
                        if self._capturing:
                            rec = self._route(stream, key)
                        elif self._query(key):
                            rec = self._adopt_found(stream)
                    again: object = None  # the parked block, handed out again
                    if self._parked is not None:  # Note [Parking] (heap.py): the one rule, here
                        parked = self._settle_park()
                        if parked is not None:
                            if (
                                rec is None
                                and not self._capturing
                                and not self._entered
                                and not self._pending  # (queued since the park: carried out first)
                                and not owned
                                and parked.stream == stream
                                and parked.requested == requested
                            ):
                                again = self._take_parked(parked)
                            else:
                                self._queue_parked(parked)
                    owner: PrivatePool | None = None
                    if again is not None:
                        out = again
                        ptr = cast(int, again)
                    else:
                        if self._pending:
                            # After the query: a release or free queued before this allocation finds
                            # the capture it detected registered (events wait for it, frees are kept
                            # for its graph: they may have been queued during it).
                            self._drain()
                            if rec is not None and not rec.active:  # the drain ended it
                                rec = None
                        if rec is None and (self._waiting or self._orphans) and not self._world.active:
                            self._process_events()
                        if rec is not None:
                            fl = rec.pool.small if small else rec.pool.large
                        elif self._entered and (entered := self._entered_pool()) is not None:
                            fl = cast(FreeList, entered.eager_small if small else entered.eager_large)
                        else:
                            fl = self._small if small else self._large
                        fl.calls += 1  # the free blocks' clock (garbage_collection_threshold)
                        # Best fit: the first block of this stream sorted by (size, address) with room
                        # (freelist.py). Written out here: a call would cost more than the bisect.
                        block: Block | None = None
                        bins = fl.find(stream)
                        hit: Bins | None = None  # the bins still holding ``block`` at ``i``
                        i = 0
                        if bins is not None:
                            sizes = bins.sizes
                            i = bisect_sizes(sizes, size)
                            if i < len(sizes):
                                block = bins.blocks[i]
                                if block.next is None and fl.grows:  # a segment's growable end
                                    i = past_tails(bins, i, self._max_split)
                                    block = bins.blocks[i]
                                hit = bins
                        d_cnt = d_bytes = 0
                        rest: Block | None = None
                        if block is None:
                            block = self._slow_block(fl, size, stream, requested, rec)
                            fl = block.free_list  # (a MemPool's block, use_on_oom: its own list)
                        elif block.size >= self._max_split and self._refuses(block.size, size):
                            hit = None  # an oversize block this request may not take (max_split_size)
                            block = self._slow_block(fl, size, stream, requested, rec)
                            fl = block.free_list
                        if block.prev is not None or block.next is not None:
                            d_cnt = -1
                            d_bytes = -block.size
                        remaining = block.size - size
                        if small:
                            split = remaining >= m
                        else:  # max_split_size: an oversize block is never split
                            # A remainder up to small_size stays with the block (PyTorch's rule), but
                            # in a growing segment any remainder splits off, oversize blocks too: it
                            # merges back with its neighbours there, and splitting it lowers peak
                            # reserved (PyTorch's should_split with expandable segments; Note
                            # [Expandable segments and the wilderness rule] in expandable.py).
                            if fl.grows:
                                split = remaining >= m
                            else:
                                split = remaining > self._small_limit and size < self._max_split
                        if split:
                            # split: the front is handed out, the rest stays free (a recycled Block)
                            rest = self._spare1
                            if rest is not None:
                                self._spare1 = None
                            else:
                                rest = self._spare.pop() if self._spare else Block(0, 0, stream, fl)
                            rest.ptr = block.ptr + size
                            rest.size = remaining
                            rest.stream = stream
                            rest.free_list = fl
                            nxt = rest.next = block.next
                            if nxt is not None:
                                nxt.prev = rest
                            rest.prev = block
                            block.next = rest
                            block.size = size
                            d_cnt += 1
                            d_bytes += remaining
                        if hit is not None:
                            fl.place(hit, i, rest)  # the remainder usually takes the block's entry
                        elif rest is not None:
                            fl.insert(rest)
                        block.allocated = True
                        block.requested = requested
                        ptr = block.ptr
                        if owned:
                            block.owned = True
                            out = block
                        else:
                            # boxed once, declared object here: the dict's key and the return value
                            # (assigned to a wider variable, mypyc would unbox and box it again)
                            boxed: object = ptr
                            cast("dict[object, Block]", self._active)[boxed] = block
                            out = boxed
                        serial = self._serial + 1  # allocation order: tells allocations apart (captures)
                        self._serial = serial
                        block.serial = serial
                        self.stats.on_malloc(small, block.size, requested, d_cnt, d_bytes)
                        owner = fl.private_pool
                        if owner is not None:
                            owner.stats.on_malloc(small, block.size, requested, d_cnt, d_bytes)
                            if rec is not None:
                                # another capture's segments
                                if len(owner.returnable) != rec.returnable_count:
                                    self._touch(block, rec)
                                block.allocated_in = rec
                                w = rec.written
                                if w is not None:  # the replay checker's footprint (gp.graph)
                                    w.add(ptr, block.size)
                    if self._history is not None or self._debug:
                        self._after_malloc(out, ptr, requested, stream, owner)
                finally:
                    self._busy = False
        except OutOfMemoryError as err:
            pending = err.__dict__.pop("_graphpool_cooperate", None)
            if pending is not None:  # not counted yet: others give memory back, then one retry
                return self._cooperate(err, pending, nbytes, stream, owned)
            self._after_oom(err)
            if self._signals:  # see _run_locked
                interrupts.run_pending()
            raise
        except BaseException:
            if self._signals:
                interrupts.run_pending()
            raise
        if self._signals:  # a handler deferred by the update that raises gives the block back first
            self._signals_after_malloc(out)
        return out

    def _cooperate(
        self,
        err: OutOfMemoryError,
        pending: tuple[int, FreeList | None, int],
        nbytes: SupportsIndex,
        stream: int,
        owned: bool,
    ) -> object:
        """The lock released, ask the process's other caches to give memory back
        (``release_others``, graphpool.cooperate) and retry the malloc once if they gave any;
        else count ``err`` (``_count_oom``) and raise it. Segments' module doc tells the rule."""
        if self._signals:
            interrupts.run_pending()
        released = 0
        fn = self.release_others
        if fn is not None:
            try:
                released = int(fn(self.device.index, pending[0]))
            except Exception as exc:  # never hides the out-of-memory error
                err.__context__ = exc
        if released > 0:
            _retrying.on = True
            try:
                return self._malloc(nbytes, stream, owned)
            finally:
                _retrying.on = False
        self._run_locked("malloc", lambda: self._count_oom(err, *pending))
        self._after_oom(err)
        raise err

    def _after_malloc(
        self, out: object, ptr: int, requested: int, stream: int, owner: PrivatePool | None
    ) -> None:
        """malloc's calls out once its block is handed out (the history, the debug check): if one
        raises (a signal handler inside it), the caller never gets the block, so it goes back."""
        try:
            if self._history is not None:
                self._history.alloc(ptr, requested, stream, owner)
            if self._debug:
                self._check()
        except BaseException:
            self._undo_malloc(out)
            raise

    def _signals_after_malloc(self, out: object) -> None:
        """Run the signal handlers deferred during a malloc; if one raises, the caller never gets
        the allocation ``out``: it is given back (under the lock), then the exception propagates."""
        try:
            interrupts.run_pending()
        except BaseException:
            self._run_locked("malloc", lambda: self._undo_malloc(out))
            raise

    def _undo_malloc(self, out: object) -> None:
        """Give back the allocation ``out`` (what ``_malloc`` returns) that its caller will not
        receive, as a free made at once, with no call out (no history, no device call: a fresh
        block has no stream uses). Nothing if it is no longer live. The lock is held."""
        if type(out) is Block:
            if not out.owned:
                return
            out.owned = False
            block: Block | None = out
        else:
            block = cast("dict[object, Block]", self._active).pop(out, None)
            if block is None:
                return
        assert block is not None
        block.allocated = False
        if self._capturing:
            self._free_held(block)
        else:
            self._free_block(block, True)

    @staticmethod
    def _check_size_type(nbytes: Any) -> int:
        if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
            raise TypeError(f"size must be an int number of bytes, not {type(nbytes).__name__}")
        return int(nbytes.__index__())

    def _reject_size(self, nbytes: int, stream: int) -> None:
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative number of bytes ({nbytes})")
        self._run_locked("malloc", lambda: self._raise_too_large(nbytes, stream))

    def free(self, ptr: object) -> None:
        """Give back the allocation at ``ptr``. Raises DoubleFreeError or ForeignPointerError.

        ``ptr`` is typed ``object``: compiled, an ``int`` parameter would refuse a wrong type
        with mypyc's message before graphpool's could say what is wrong (the differential
        test, tests/property/test_differential.py, compares the two builds' errors)."""
        if type(ptr) is Block:  # malloc_owned's blocks go back through their owner's free_owned
            raise TypeError("free: expected an int device address, got Block (free_owned takes those)")
        try:
            with self._held:
                self._free_locked(ptr)
        finally:
            if self._signals:  # see _run_locked
                interrupts.run_pending()

    def free_owned(self, ptr: object) -> None:
        """``free`` for the owner of a live allocation (``DeviceBuffer.free``: the Block
        ``malloc_owned`` returned; PyTorch's allocator hook: an address): never waits.

        If another thread holds the lock, the free is queued for the next call instead
        (as CuPy's pool does), so a free from code that runs while this thread holds
        another lock the lock holder needs (a finalizer run inside a kernel of the
        simulated device, say) cannot deadlock.
        """
        if not self._held.acquire(False):
            self._pending.append(ptr)
            return
        try:  # a signal between the acquire and here waits (policy/interrupts.py: "owned")
            self._free_locked(ptr)
        finally:
            self._held.release()
            if self._signals:
                interrupts.run_pending()

    def set_lane(self, lane: Callable[[int, int], tuple[int, bool]] | None) -> None:
        """Let a native lane serve the parked block (heap.py, Note [Parking]): ``lane(0, 0)``
        takes the block back from it and says how often it was handed out meanwhile and whether
        it is out now, ``(hits, live)``; ``lane(ptr, requested)`` does the same and then arms it
        for the block just parked at ``ptr`` (the only block it may keep until the next take).
        None: no lane. The lane it replaces is settled first. TypeError for a non-callable."""
        if lane is not None and not callable(lane):
            raise TypeError(f"set_lane: a lane is a callable lane(ptr, requested) or None, not {lane!r}")
        self._run_locked("set_lane", lambda: self._set_lane(lane))

    def park(self, ptr: object, parkable: bool = True) -> int:
        """``drop`` for a block the next malloc may take back whole (the PyTorch integration's
        free; heap.py, Note [Parking]): parked when nothing makes its free more than a return
        to its stream's cache, returning its requested size; else queued as ``drop`` queues
        it (also when another call holds the lock), returning 0. Never waits.
        ``parkable=False``: queued, after the parked block (the PyTorch hooks' route is stale)."""
        parked = self._parked  # (its block may be out again: the lane's, settled when locked)
        if type(ptr) is not int:
            self.free_owned(ptr)  # as drop: an owned Block is freed, anything else refused
            return 0
        if ptr not in self._active and (parked is None or parked.ptr != ptr):
            self.drop(ptr)  # raises: no live raw allocation
            return 0
        if (parked is None and self._pending) or not self._held.acquire(False):
            self._pending.append(ptr)  # (``_park`` would queue it: a queued free comes first)
            return 0
        try:  # (as free_owned's: a signal here waits, policy/interrupts.py)
            if self._busy:  # re-entered mid-call on this thread
                self._pending.append(ptr)
                return 0
            self._busy = True
            try:
                out = self._park(ptr, parkable)
                if self._debug:
                    self._check()
                return out
            finally:
                self._busy = False
        finally:
            self._held.release()
            if self._signals:
                interrupts.run_pending()

    def _free_locked(self, ptr: object) -> None:
        """The body of ``free`` with the lock held."""
        if self._busy:  # re-entered mid-call on this thread: queue it like a finalizer's free
            self._check_pointer(ptr, "free")
            self.defer_free(ptr)
            return
        self._busy = True
        try:
            if self._parked is not None:
                self._unpark()
            if self._pending:
                self._drain()
            self._free(ptr)
            if self._debug:
                self._check()
        finally:
            self._busy = False

    def defer_free(self, ptr: object, stream: int | None = None) -> None:
        """Queue a free for the next allocator call. Lock-free and no device call: for
        finalizers. ``ptr``: an address ``malloc`` returned, or a Block of ``malloc_owned``.

        ``stream``: another stream that used the block (as ``record_stream`` would say); its
        work queued so far completes before the block is reused.
        """
        self._pending.append(ptr if stream is None else (ptr, stream))

    def defer_release(self, rec: CaptureRecord) -> None:
        """Queue ``release_capture(rec)`` for the next allocator call. Lock-free: for finalizers."""
        self._pending.append(rec)

    def _free(self, ptr: object) -> None:
        """Free the allocation at ``ptr``: the one body of ``free`` and of a free queued by a
        finalizer (whose thread and moment are unknown: ``_queued``, see _free_held)."""
        # The lookup takes the caller's int object as it came: compiled, ``ptr`` narrowed to int
        # is unboxed, and boxing it again allocates (addresses are large ints).
        key: object = ptr
        block: Block | None = None
        if type(ptr) is Block:  # malloc_owned's allocation, given by its owner: no lookup
            if ptr.owned and self._mine(ptr.free_list):  # (another's lists are another lock's)
                ptr.owned = False
                block = ptr
        elif type(ptr) is int:
            block = cast("dict[object, Block]", self._active).pop(key, None)
        if block is None:
            self._bad_pointer(ptr, "free")
        block.allocated = False
        if self._history is not None or self._capturing or block.stream_uses:
            try:
                if self._history is not None:
                    self._free_traced(block)
                else:
                    self._free_held(block)
            except BaseException:
                if block.allocated:  # raised before the block was filed: see _requeue
                    self._requeue(block, key)
                raise
        else:
            self._free_block(block, True)

    def _requeue(self, block: Block, key: object) -> None:
        """A free whose call out raised before its block was filed (a signal handler inside the
        history, or inside a capture query for its stream uses; the block still marked
        allocated): the block is live again and its free is queued, as a finalizer's free is,
        for the next call, under the same rules. Whoever freed it owns it no more either way."""
        if type(key) is Block:
            block.owned = True
        else:
            cast("dict[object, Block]", self._active)[key] = block
        self._pending.append(key)

    def _free_queued(self, ptr: object) -> None:
        """``_free`` for a free a finalizer queued (``_drain``): marked ``_queued`` meanwhile, so
        that ``_free_held`` counts it as possibly made during a capture that has ended since."""
        was = self._queued
        self._queued = True
        try:
            self._free(ptr)
        finally:
            self._queued = was

    def _free_traced(self, block: Block) -> None:
        """A free while the history records: ``free_requested`` now, ``free_completed`` when
        the block is back in its pool (now, or in ``_unhold`` when its last hold ends)."""
        h = self._history
        assert h is not None
        ptr, requested, stream, owner = block.ptr, block.requested, block.stream, block.free_list.private_pool
        block.allocated = True  # until the event is in: raising, the free is queued again (_free)
        frames = h.free_requested(ptr, requested, stream, owner)
        block.allocated = False
        if self._capturing or block.stream_uses:
            if self._free_held(block):
                h.free_completed(ptr, requested, stream, owner, frames)
        else:
            self._free_block(block, True)
            h.free_completed(ptr, requested, stream, owner, frames)

    def record_stream(self, ptr: object, stream: int) -> None:
        """Mark ``stream`` as a user of the allocation at ``ptr`` (docs/behaviour.rst, "Streams")."""
        self._run_locked("record_stream", lambda: self._record_stream(ptr, stream))

    def empty_cache(self) -> None:
        """Return every unsplit free segment of the ordinary and freeable pools to the driver."""
        self._run_locked("empty_cache", self._empty_cache)

    def _empty_cache(self) -> None:
        if self._pending:
            self._drain()
        if self._tokens:
            self._poll_released()
        self._sweep()
        if not self._ask_orphans():  # (asking may adopt a capture begun on an orphan's stream)
            where = (
                f"on device {self.device.index}"
                if self._capturing
                else "on another device (CUDA's capture rules are process-wide)"
            )
            raise CaptureError(
                f"empty_cache() cannot run while a graph capture is underway {where}: it would "
                "free memory the capture may use. Call it before the capture begins or after it ends."
            )
        self._release_cached()

    def _drain(self) -> None:
        """Carry out frees and releases queued by finalizers."""
        pending = self._pending
        later: list[Any] | None = None  # records to retry at a later call (made when needed)
        # What was queued when it began: a free queued again (``_requeue``: a call out raised)
        # waits for the next call, so a call out that always fails cannot make this loop forever.
        todo = len(pending)
        try:
            while todo > 0 and pending:
                todo -= 1
                item = pending.popleft()
                try:
                    if type(item) is int or type(item) is Block:
                        self._free_queued(item)
                    elif type(item) is PoolId:  # a MemPool was collected
                        self._drop_mempool(item)
                    elif type(item) is PoolExit:  # a use_mem_pool block left without __exit__
                        self._abandon_entry(item.pool_id, item.ident)
                    elif type(item) is tuple:  # a free after a use on another stream
                        block = self._live_block(item[0])
                        if block is not None and item[1] != block.stream:
                            if block.stream_uses is None:
                                block.stream_uses = {item[1]}
                            else:
                                block.stream_uses.add(item[1])
                        self._free_queued(item[0])
                    elif self._release_later(item):
                        # only the capturing thread can end its capture
                        if later is None:
                            later = [item]
                        else:
                            later.append(item)
                    else:
                        self._release(item)  # (raising, it queues the rest of its work again)
                except Exception as exc:  # a finalizer's work must not fail an unrelated call
                    _warnings.warn(f"graphpool: deferred work failed: {exc!r}", RuntimeWarning)
        finally:
            if later is not None:
                pending.extend(later)

    def begin_capture(
        self,
        pool_id: PoolId,
        begin: Callable[[], int],
        *,
        stream: int = 0,
        label: str = "",
        footprint: bool = False,
    ) -> CaptureRecord:
        """Route a new capture to ``pool_id``'s private pool (made or revived as needed).

        ``begin`` starts the capture on the device and returns its capture id; it runs
        after the allocator stops querying events and before anything is routed. If it
        raises, nothing changes. ``footprint``: keep every allocation's address and size in
        ``rec.written`` for the replay checker (graphs.py), at a cost per allocation.
        """
        return self._run_locked(
            "begin_capture",
            lambda: self._begin_capture(pool_id, begin, stream, label, footprint),
            self._abort_capture,  # a handler raised after: the caller never gets the record
        )

    def adopt_capture(self, stream: int, *, pool: PoolId | None = None, label: str = "") -> CaptureRecord:
        """Register the capture underway on ``stream``, begun outside graphpool (a framework's
        own capture API), and serve its allocations from a private pool: ``pool``'s, or one
        of its own. The pool is released when the device reports the capture's graph and
        all its executable instances destroyed. Raises CaptureError unless ``stream`` is
        capturing. Returns the registered record (the same one if already registered).
        """
        return self._run_locked("adopt_capture", lambda: self._adopt_capture(stream, pool, label))

    def end_adopted(self, rec: CaptureRecord) -> None:
        """The capture of an adopted record ended (its framework's end-capture call returned):
        stop routing to its pool. The pool stays until the graph is destroyed."""
        self._run_locked("end_adopted", lambda: self._end_capture(rec))

    def end_capture(self, rec: CaptureRecord) -> None:
        """Stop routing to ``rec``'s pool after its device capture ended successfully."""
        self._run_locked("end_capture", lambda: self._end_capture(rec))

    def abort_capture(self, rec: CaptureRecord) -> None:
        """A capture failed: stop routing, give back what it kept, restore the pool's use count."""
        self._run_locked("abort_capture", lambda: self._abort_capture(rec))

    def release_capture(self, rec: CaptureRecord) -> None:
        """The graph of ``rec`` is gone: return its kept blocks and lower the pool's use count."""
        self._run_locked("release_capture", lambda: self._release_capture(rec))

    def ensure_pool(self, pool_id: PoolId) -> PrivatePool:
        """The pool of ``pool_id`` on this device, made now for a live MemPool's id if it does not
        exist yet. ValueError for an id of no pool here and no live MemPool."""

        def run() -> PrivatePool:
            if self._pending:
                self._drain()
            pool = self._pools.get(pool_id)
            if pool is None:
                if pool_id not in mempools:
                    raise ValueError(f"no private pool {tuple(pool_id)} on device {self.device.index}")
                pool = self._make_pool(pool_id)
            return pool

        return self._run_locked("ensure_pool", run)

    def enter_pool(self, pool_id: PoolId) -> None:
        """The calling thread's eager allocations on this device come from the live MemPool
        ``pool_id``'s pool until the matching ``exit_pool`` (``use_mem_pool``; entries nest).
        ValueError for an id of no live MemPool."""
        ident = threading.get_ident()
        self._run_locked(
            "enter_pool",
            lambda: self._enter_pool(pool_id, ident),
            lambda _: self._exit_pool(pool_id, ident),  # a handler raised after: no entry is left
        )

    def exit_pool(self, pool_id: PoolId, ident: int | None = None) -> None:
        """End the innermost ``enter_pool`` of thread ``ident`` (default: the calling thread's),
        which must be ``pool_id``'s (RuntimeError otherwise, and nothing changes)."""
        self._run_locked("exit_pool", lambda: self._exit_pool(pool_id, ident or threading.get_ident()))

    def defer_exit_pool(self, pool_id: PoolId, ident: int) -> None:
        """End thread ``ident``'s innermost entry into ``pool_id`` at the next call, if still there
        (a ``use_mem_pool`` block whose ``__exit__`` Python skipped). Lock-free: for finalizers."""
        if type(pool_id) is not PoolId or type(ident) is not int:  # (queued, it would be a free)
            raise TypeError("defer_exit_pool takes a PoolId and a thread ident")
        self._pending.append(PoolExit(pool_id, ident))

    def defer_forget_thread(self, ident: int) -> None:
        """End every ``use_mem_pool`` entry of the gone thread ``ident`` at the next call, before it
        routes (a new thread given its ident never allocates into its pools). Lock-free."""
        self._pending.append(PoolExit(None, ident))

    def defer_forget_threads(self, keep: int) -> None:
        """``defer_forget_thread`` for each thread with entries but ``keep`` (a forked child's)."""
        for ident in [i for i in self._thread_pools if i != keep]:
            self.defer_forget_thread(ident)

    def defer_mempool_drop(self, pool_id: PoolId) -> None:
        """MemPool ``pool_id`` was collected: its use of this pool ends at the next call. Lock-free."""
        if type(pool_id) is not PoolId:  # (queued, anything else would be taken for a free)
            raise TypeError(f"defer_mempool_drop takes a PoolId, not {type(pool_id).__name__}")
        self._pending.append(pool_id)

    def memory_stats(self, pool: PoolId | None = None) -> dict[str, int]:
        """The flattened statistics of the device, or of one private pool."""
        return self._run_locked("memory_stats", lambda: self._memory_stats(pool))

    def reset_peak(self) -> None:
        """Set every peak (device and private pools) to its current level."""
        self._run_locked("reset_peak", self._reset_peak)

    def reset_accumulated(self) -> None:
        """Zero accumulated counters (device and private pools)."""
        self._run_locked("reset_accumulated", self._reset_accumulated)

    def segment_at(self, ptr: int) -> tuple[int, int, bool, PoolId | None] | None:
        """(base, size, expandable, private pool id or None) of the segment holding address
        ``ptr``, None when no segment does. For IPC, which exports whole driver allocations."""
        return self._run_locked("segment_at", lambda: self._segment_at(ptr))

    def private_pools(self) -> list[PrivatePool]:
        """Every private pool that still exists."""
        return self._run_locked("private_pools", self._private_pools)

    def snapshot(self) -> list[dict[str, Any]]:
        """Segments with their blocks, streams, owning pool and owning graph."""
        return self._run_locked("snapshot", self._snapshot)

    def record_history(self, max_entries: int | None, stacks: bool = True) -> None:
        """Record events (policy/history.py) in a ring buffer of ``max_entries``; None stops
        recording and drops the events. Called again while recording, it keeps the newest
        events that fit the new bound."""
        self._run_locked("record_history", lambda: self._record_history(max_entries, stacks))

    def history_snapshot(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The segments of ``snapshot()`` with their ``frames`` (the stacks that allocated each
        segment and live block, empty if not recorded) and the graphs using each segment's
        private pool (``pool_graphs``), and the recorded events, oldest first; at one moment."""
        return self._run_locked("history_snapshot", self._history_snapshot)

    def check_invariants(self) -> None:
        """Verify every invariant (policy/check.py); raises AssertionError on the first broken one."""
        self._run_locked("check_invariants", self._check)


# Plain-Python build: after these released the lock, their result is still on its way to its
# owner; a guarded signal handler waits until it is there (policy/interrupts.py, "Handoffs").
interrupts.handoff(
    CachingAllocator.malloc,
    CachingAllocator.malloc_owned,
    CachingAllocator._malloc,
    CachingAllocator._signals_after_malloc,
    CachingAllocator._run_locked,
    CachingAllocator.free_owned,
    CachingAllocator.park,
    CachingAllocator.defer_free,
    CachingAllocator.enter_pool,
    CachingAllocator.exit_pool,
)

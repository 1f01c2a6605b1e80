"""CachingAllocator: the caching policy of one device, with private pools for capture.

Plain Python over a ``Device`` (device/protocol.py). Requests round to 512 B, go to
the small (<= 1 MiB) or large pool, and take the best-fitting free block of their own
stream; what no block fits comes from a new segment. Freed blocks merge with free
neighbours and return to the pool they came from.

Captures: while one is underway on this device (``_capturing`` > 0), requests on a
stream that belongs to a registered capture are served from that capture's private
pool. Captures begun outside graphpool (CuPy's ``Stream.begin_capture``, a raw
``cudaStreamBeginCapture``) are *detected*: with detection on (the default) every
malloc asks the device for its stream's capture id (one cheap query, from C on the CUDA
backend) and adopts an unknown capture into a private pool of its own, released when the
device reports the graph and all its executable instances destroyed (a CUDA user object,
see ``Device.attach_release``). During a capture only a block of an underway capture's own
pool goes back at once; every other free is kept for the graphs (``_captures_for_free``).
No event is ever recorded into a capture (``_insert_events``, the one place events are
recorded, asks the device first).

CUDA's capture rules are process-wide, so the captures of every allocator of a runtime
are counted in one shared ``CaptureWorld``. While any is underway the allocator never
queries events, never synchronizes and never frees device memory: those acts each go
through one method that checks it (``_query_event``, ``_synchronize_events``,
``_release_segment``); driver allocations and event queries run under the relaxed
capture mode, so they never invalidate a capture graphpool has not seen yet.

Finalizers never take the lock: ``defer_free`` queues a pointer that the next call drains.
The lock is reentrant, so every locked call marks the allocator ``_busy``: a call that
re-enters on the same thread (user code run by garbage collection inside a call) must not
see half-updated state. ``free`` then queues the pointer; anything else raises.

Signals: a call holding the lock is a critical section for a guarded signal handler
(policy/interrupts.py, both builds): a handler whose signal lands there runs right after the
lock is released (each locked call tests ``_signals`` then), never with the lock held.
Out-of-memory observers and the OOM log line run after the release too (``_after_oom``).
Every call out to Python code in the middle of an update (the device, the history, logging)
finds the state consistent or rolls its update back if it raises: an unguarded handler's
exception there, the only place one can land compiled, breaks no invariant
(docs/behaviour.rst, "Interrupts", states what a device call that raised may have cost).
"""

from __future__ import annotations

import logging
import os
import threading
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Callable
from typing import Any, Final, NoReturn, SupportsIndex, TypeVar, cast

from graphpool import _warnings
from graphpool.device.protocol import (
    CAPTURE_MODE_RELAXED,
    CAPTURE_STATUS_ACTIVE,
    CAPTURE_STATUS_NONE,
    Device,
)
from graphpool.errors import (
    CaptureError,
    DoubleFreeError,
    ForeignPointerError,
    GraphpoolError,
    OutOfMemoryError,
)
from graphpool.policy import interrupts, observers
from graphpool.policy.block import Block, ExpandableSegment, iter_segment
from graphpool.policy.freelist import Bins, FreeList, bisect_sizes, past_tails
from graphpool.policy.history import History
from graphpool.policy.limits import MemoryLimits
from graphpool.policy.pools import DEFAULT, SizeConfig
from graphpool.policy.private_pools import (
    CaptureRecord,
    CaptureWorld,
    PoolId,
    PrivatePool,
    Writes,
    new_graph_pool_id,
    new_release_token,
)
from graphpool.policy.stats import PoolStats
from graphpool.policy.units import fmt_bytes

_Lock: Callable[[], Any]
try:  # the C lock, built with the compiled modules (graphpool/policy/_lock.c; NOTES entry 36)
    from graphpool.policy._lock import RLock as _CLock

    _Lock = _CLock
except ImportError:
    try:  # CuPy's lock (see CachingAllocator.__init__)
        from fastrlock.rlock import FastRLock

        _Lock = FastRLock
    except ImportError:  # no fastrlock wheel (PyPy): the stdlib's reentrant lock, slower
        _Lock = threading.RLock

_log = logging.getLogger("graphpool")
_cached: Any = getattr(_log, "_cache", None)
_LEVELS: dict[int, bool] = _cached if isinstance(_cached, dict) else {}
"""The logger's own cache of ``isEnabledFor`` answers (cleared in place on level changes)."""
_log.isEnabledFor(logging.DEBUG)  # fill it for the levels the allocator tests
_log.isEnabledFor(logging.INFO)


_retrying = threading.local()
"""``on`` while this thread's malloc retries after other caches gave memory back (cooperation):
that retry's failure is final."""


def _enabled(level: int) -> bool:
    """``_log.isEnabledFor(level)``, read from the logger's cache when it holds the answer.

    Compiled, that read runs no Python code, so no signal handler can run inside it (Python
    runs handlers between bytecodes, and ``isEnabledFor`` is bytecode): the allocator tests the
    level in the middle of updates, where a KeyboardInterrupt would leave a block filed
    nowhere (benchmarks/NOTES.md, entry 25). A miss (the first test after a level change)
    asks the logger itself, which fills the cache.
    """
    if _log.disabled:
        return False
    hit = _LEVELS.get(level)
    return _log.isEnabledFor(level) if hit is None else hit


"""Slow paths only (segments, captures, pools, out-of-memory, limits), each behind an
``isEnabledFor`` test: the cached malloc and free never touch it (docs/behaviour.rst, "Logging")."""


def _thread_alive(ident: int) -> bool:
    """Whether a thread with this id still runs (O(threads); rare path)."""
    return any(t.ident == ident for t in threading.enumerate())


T = TypeVar("T")

_COMPILED: Final = not __file__.endswith(".py")  # as graphpool.build.compiled() tells
_LEGACY: Final = 0
"""The legacy stream's handle (device/protocol.py's LEGACY_STREAM), a constant compiled in."""
_NO_CAPTURES: Final[tuple[CaptureRecord, ...]] = ()
SWEEP_EVERY: Final = 64
"""Allocations off any capture, while captures begun outside graphpool are underway, between
two queries of whether those captures ended (``_route``). A sweep also asks the device which
graphs were destroyed (a Python call on CUDA); at 16 it cost about as much per allocation as
the rest of an allocation beside a capture (benchmarks/NOTES.md, entry 40)."""


class _Held:
    """The allocator lock's calls, bound once: what ``with self._held`` and ``free_owned`` use in
    the compiled build (benchmarks/NOTES.md, entry 24).

    Compiled, ``with`` on a native class calls its ``__enter__``/``__exit__`` directly, where
    ``with`` on the lock itself looks both methods up on the lock's type at every call; these
    call the lock's C methods, bound here once. No Python code runs between the acquire and
    the ``try`` of the ``with``, so a signal still cannot keep the lock. The plain-Python build
    does not use this class: there ``_held`` is the lock itself, whose enter and exit are C
    code (a Python-level ``__enter__`` could be interrupted after acquiring; entry 15).
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


def _takeable(b: Block, stream: int, done: dict[int, int]) -> bool:
    """Whether free-list block ``b`` may join a run that ``stream`` takes over: no pending use,
    and ``stream``'s own or filed before its stream last answered idle (``done``, _take_idle)."""
    if b.allocated or b.holds:
        return False
    return b.stream == stream or b.gc_base < done.get(b.stream, 0)


class CachingAllocator:
    """The allocator of one device. Every public method is thread-safe."""

    def __init__(
        self,
        device: Device,
        *,
        sizes: SizeConfig = DEFAULT,
        world: CaptureWorld | None = None,
        detect: bool = True,
    ) -> None:
        self.device = device
        self.sizes = sizes
        # Reentrant, and uncontended its acquire and release make no OS call (a threading.Lock
        # makes two; entry 8): graphpool's C lock compiled (argument-free C methods, entry 36),
        # else CuPy's fastrlock, else threading.RLock.
        self._lock = _Lock()
        # Its calls as the hot path makes them: bound once, compiled (``_Held``); plain Python,
        # the lock itself. Tests that swap ``_lock`` for a hooked lock swap this too.
        self._held: _Held = _Held(self._lock) if _COMPILED else cast(_Held, self._lock)
        self._busy = False  # a locked call is running (see the module docstring)
        self._queued = False  # the free being carried out was queued by a finalizer (_drain)
        # Signal handlers deferred until a critical section ends (policy/interrupts.py): the
        # shared list, tested after each section (a native attribute read, compiled).
        self._signals = interrupts.pending
        self._section = interrupts.section(self._lock)  # what the guard asks (interrupts.py)
        self._small = FreeList(True)
        self._large = FreeList(False)
        self._small_limit = sizes.small_size
        self._total = device.mem_info()[1]
        self._apply_sizes(sizes)
        self._active: dict[int, Block] = {}
        self.stats = PoolStats()
        # Block objects absorbed by merges, reused by splits. The last one waits apart in
        # ``_spare1``: the steady cycle (split, merge) then never resizes the list
        # (benchmarks/NOTES.md, entry 13).
        self._spare: list[Block] = []
        self._spare1: Block | None = None
        self._segments: dict[int, Block] = {}  # base address -> first block
        # Expandable segments (sizes.expandable_segments): base -> segment, and the segment
        # of each (is_small, stream) of the ordinary pool; the device's mapping granularity.
        self._exp: dict[int, ExpandableSegment] = {}
        self._exp_of: dict[tuple[bool, int], ExpandableSegment] = {}
        self._gran = 0
        self._seg_bases: list[int] = []  # sorted base addresses
        # finalizer work: frees (int), frees after a stream use ((ptr, stream)), releases (records)
        self._pending: deque[Any] = deque()
        self._waiting: dict[int, deque[tuple[int, Block]]] = {}  # stream -> (event, block)
        self._event_pool: list[int] = []
        # Captures. ``_capturing`` counts the registered captures of this device (the hot
        # path's only capture test); ``_world`` counts those of every device of the runtime.
        self._world = world if world is not None else CaptureWorld()
        self._capturing = 0
        self._captures: dict[int, CaptureRecord] = {}  # capture id -> record, while underway
        self._records: dict[int, CaptureRecord] = {}  # sequence -> record, until released
        self._foreign: dict[int, CaptureRecord] = {}  # stream -> underway capture begun outside
        self._tokens: dict[int, CaptureRecord] = {}  # release token -> record (Device.attach_release)
        self._dead: set[int] = set()  # ids of captures that can never end (their thread died)
        self._deferred: list[Block] = []  # record_stream frees waiting for all captures to end
        # frees whose user stream vanished (a device sync, later), or whose user streams take part
        # in a capture that is not registered (their events wait until it ends; _insert_events)
        self._orphans: list[Block] = []
        self._pools: dict[PoolId, PrivatePool] = {}
        self._freeable: dict[PoolId, PrivatePool] = {}
        self._capture_seq = 0
        self._serial = 0
        # Caps on reserved memory (policy/limits.py), swapped whole by their setters; the
        # description of the cap that refused the last driver allocation, for the OOM message.
        self.limits = MemoryLimits(self._total)
        self._limit_hit: str | None = None
        self._debug = os.environ.get("GRAPHPOOL_DEBUG", "") == "1"
        # The event history (policy/history.py), None while not recording: malloc and free
        # test it once each.
        self._history: History | None = None
        # Detection of captures begun outside graphpool: the device's capture-id query,
        # bound once (on CUDA a C function; benchmarks/NOTES.md).
        self._detect = bool(detect)
        self._query: Callable[[int], int] = device.capture_id
        # The stream handle malloc queried last, and the same as an int object (see malloc).
        self._qstream = -1
        self._qkey: Any = -1
        self._sweep_due = SWEEP_EVERY  # allocations off capture until the next _sweep (_route)
        # Cooperation (graphpool.cooperate): asked, with the lock released, to make other
        # caches of the process give memory back before an out-of-memory error is raised.
        self.release_others: Callable[[int, int], int] | None = None

    def _apply_sizes(self, sizes: SizeConfig) -> None:
        """Take ``sizes`` and the figures malloc reads from it. With no ``max_split_size``,
        ``_max_split`` is past any block (no block is oversize: one int test in malloc)."""
        self.sizes = sizes
        self._small_limit = sizes.small_size
        self._max_split = self._total + 1 if sizes.max_split_size is None else sizes.max_split_size
        self._non_split = sizes.non_split_rounding()
        self._divisions = bool(sizes.roundup_power2_divisions)
        self._gc_threshold = sizes.garbage_collection_threshold
        self._expandable = sizes.expandable_segments
        self._small.grows = self._large.grows = sizes.expandable_segments

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

    # ------------------------------------------------------------------ malloc
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
        free (together about a fifth of a cached pair; benchmarks/NOTES.md, entry 39). Its
        address is still known to ``lookup`` and to the errors for a wrong ``free``.
        """
        return cast(Block, self._malloc(nbytes, stream, True))

    def _malloc(self, nbytes: SupportsIndex, stream: int, owned: bool) -> object:
        """The one body of ``malloc`` and ``malloc_owned``: the address as the int object
        filed in ``_active`` (a raw allocation; a free given that same object finds the
        block by identity, NOTES entry 36), or the Block itself (``owned``)."""
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
                        # a new int object each; entry 27).
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
                    if self._pending:
                        # After the query: a release or free queued before this allocation finds
                        # the capture it detected registered (events wait for it, frees are kept
                        # for its graph: they may have been queued during it).
                        self._drain()
                        if rec is not None and not rec.active:  # the drain ended it
                            rec = None
                    if rec is None and (self._waiting or self._orphans) and not self._world.active:
                        self._process_events()
                    if rec is None:
                        fl = self._small if small else self._large
                    else:
                        fl = rec.pool.small if small else rec.pool.large
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
                    elif block.size >= self._max_split and self._refuses(block.size, size):
                        hit = None  # an oversize block this request may not take (max_split_size)
                        block = self._slow_block(fl, size, stream, requested, rec)
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
                        # reserved (PyTorch's should_split with expandable segments; entry 44).
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
                        rest.pool = fl
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
                    owner = fl.owner
                    if owner is not None:
                        owner.stats.on_malloc(small, block.size, requested, d_cnt, d_bytes)
                        if rec is not None:
                            if len(owner.fresh) != rec.fresh:  # another capture's segments
                                self._touch(block, rec)
                            block.owner = rec
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

    # ------------------------------------------------- cooperation (one hook)
    # graphpool.cooperate sets ``release_others``. Before an out-of-memory error that other
    # caches might avert (the device refused a segment: no limit hit, no capture underway,
    # not this thread's retry), ``_raise_oom`` raises it uncounted and marked; malloc, the
    # lock released, asks the others to give memory back and, if they gave any, retries
    # once. Only the final failure is counted (num_ooms, the history) and reported to the
    # observers; a marked error that leaves by another path is counted there (_run_locked).
    def _cooperate(
        self,
        err: OutOfMemoryError,
        pending: tuple[int, FreeList | None, int],
        nbytes: SupportsIndex,
        stream: int,
        owned: bool,
    ) -> object:
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

    def _refuses(self, bsize: int, size: int) -> bool:
        """Whether a request of ``size`` may not take an oversize free block of ``bsize`` bytes
        (PyTorch's ``get_free_block``): a request under ``max_split_size`` never takes one; a
        larger one only when the block wastes less than ``max_non_split_rounding``."""
        return size < self._max_split or bsize >= size + self._non_split

    @staticmethod
    def _check_size_type(nbytes: Any) -> int:
        if isinstance(nbytes, bool) or not hasattr(nbytes, "__index__"):
            raise TypeError(f"size must be an int number of bytes, not {type(nbytes).__name__}")
        return int(nbytes.__index__())

    def _reject_size(self, nbytes: int, stream: int) -> None:
        if nbytes < 0:
            raise ValueError(f"cannot allocate a negative number of bytes ({nbytes})")
        self._run_locked("malloc", lambda: self._raise_too_large(nbytes, stream))

    def _raise_too_large(self, nbytes: int, stream: int) -> NoReturn:
        """A request larger than the device: out of memory, with no limit to blame."""
        self._limit_hit = None
        self._raise_oom(nbytes, None, None, stream)

    def _raise_oom(self, nbytes: int, seg: int | None, fl: FreeList | None, stream: int = 0) -> NoReturn:
        """Count an out-of-memory (device, and the private pool ``fl`` belongs to), record it in
        the history and raise it; ``_after_oom`` logs it and calls the observers once the lock
        is released. One that other caches might avert goes out uncounted, for malloc to
        cooperate first (see ``_cooperate``)."""
        limit, self._limit_hit = self._limit_hit, None
        err = OutOfMemoryError(self._oom_message(nbytes, seg, limit))
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
        if fl is not None and fl.owner is not None:
            fl.owner.stats.num_ooms += 1
        if self._history is not None:  # before the observers: one may take a snapshot
            self._history.oom(nbytes, stream, self._device_free(), None if fl is None else fl.owner)
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
        if _enabled(logging.INFO):
            _log.info("%s", err)
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

    def _route(self, stream: int, key: Any) -> CaptureRecord | None:
        """The capture ``stream`` (``key``: the same handle as an int object) belongs to, if
        any (one driver query); adopts an unknown one."""
        cid: Any = self._query(key)  # kept as the query's int object: the lookup boxes none
        if not cid:
            if self._foreign:  # a capture begun outside may have ended: stop routing to it
                # (one query per such capture), at every SWEEP_EVERY-th call that finds its
                # stream not capturing: beside a capture each sweep would double the query
                # cost of an allocation (entry 31). Statistics, snapshots and empty_cache
                # sweep first (_settle), so what they report is never stale.
                self._sweep_due -= 1
                if self._sweep_due <= 0:
                    self._sweep_due = SWEEP_EVERY
                    self._sweep()
            return None
        rec = self._captures.get(cid)
        if rec is None and self._detect:
            rec = self._adopt_found(stream)
        return rec

    def _slow_block(
        self, fl: FreeList, size: int, stream: int, nbytes: int, rec: CaptureRecord | None
    ) -> Block:
        """No cached block fits: get a segment from the driver, or a block the retry freed.

        Out of memory and no capture underway: wait for pending stream uses, look in the
        cache again, release every cached unsplit segment and retry once; then try the
        smallest segment that holds the request. The returned block is in no free list.
        """
        self._limit_hit = None  # only a refusal during this request may be blamed on a limit
        if self._tokens:
            self._poll_released()
        if rec is None and self._foreign:
            # A capture begun outside may have ended since _route last swept (SWEEP_EVERY):
            # notice it before a retry or collection is refused for a capture that is over.
            self._sweep()
        if self._gc_threshold and self.limits.fraction is not None and not self._world.active:
            self._collect(self._gc_threshold)
        if self._expandable and fl.owner is None:
            return self._slow_expandable(fl, size, stream, nbytes)
        seg = self.sizes.segment_size(size)
        ptr = self._device_malloc(seg)
        if ptr is None and self._max_split <= self._total and fl.owner is None and not self._world.active:
            if self._release_oversize(fl, size, stream):  # PyTorch's release_available_cached_blocks
                ptr = self._device_malloc(seg)
        if ptr is None and not self._world.active:
            block = self._before_retry(fl, size, stream)
            if block is not None:
                return block
            ptr = self._device_malloc(seg)
        if ptr is None:
            least = self.sizes.least_segment(size)
            if least < seg:
                ptr = self._device_malloc(least)
                if ptr is not None:
                    seg = least
        if ptr is None:
            self._raise_oom(nbytes, seg, fl, stream)
        head = Block(ptr, seg, stream, fl)
        self._segments[ptr] = head
        insort(self._seg_bases, ptr)
        for st in self._scopes(fl):
            st.num_device_alloc += 1
            k = st.kind(fl.is_small)
            k.add("segment", 1)
            k.add("reserved_bytes", seg)
        owner = fl.owner
        if owner is not None:
            owner.segment_count += 1
            if rec is not None:  # may go back with the capture if it fails (see _touch)
                self._set_creator(head, rec)
        self._segment_made(head, "allocated", owner)
        return head

    def _segment_made(self, head: Block, what: str, owner: PrivatePool | None) -> None:
        """Record and log a new segment, filed and counted, whose head is in no free list yet (the
        caller hands it out). If a call out raises, the head is filed free first: the segment
        stays cached, and the exception propagates."""
        try:
            if self._history is not None:
                self._history.segment_alloc(head.ptr, head.size, head.stream, owner)
            if _enabled(logging.DEBUG):
                self._log_segment(what, head)
        except BaseException:
            head.pool.insert(head)
            raise

    def _before_retry(self, fl: FreeList, size: int, stream: int) -> Block | None:
        """The driver refused memory, no capture underway: wait for pending stream uses and
        return a fitting block they freed (out of ``fl``), else release the cache (PyTorch's
        retry) and count the retry; the caller then asks the driver again."""
        self._synchronize_events()
        block = fl.best_fit(stream, size, self._max_split)
        if block is not None and not (block.size >= self._max_split and self._refuses(block.size, size)):
            fl.remove(block)  # a stream use that just completed freed a fitting block
            return block
        self._release_cached()
        self.stats.num_alloc_retries += 1
        if fl.owner is not None:
            fl.owner.stats.num_alloc_retries += 1
        return None

    # ------------------------------------------------------- expandable segments
    def _slow_expandable(self, fl: FreeList, size: int, stream: int, nbytes: int) -> Block:
        """``_slow_block`` for the ordinary pool with expandable segments: grow the stream's
        segment; out of memory and no capture underway, wait for pending stream uses, look
        in the cache again, release the cache (``empty_cache``'s work) and grow again."""
        block = None if self._world.active else self._take_idle(fl, size, stream)
        if block is None:
            block = self._grow(fl, size, stream)
        if block is None and not self._world.active:
            block = self._before_retry(fl, size, stream)
            if block is None:  # the release synchronized: streams busy before may be idle now
                block = self._take_idle(fl, size, stream)
            if block is None:
                block = self._grow(fl, size, stream)
        if block is None:
            self._raise_oom(nbytes, self._round_gran(size), fl, stream)
        return block

    def _take_idle(self, fl: FreeList, size: int, stream: int) -> Block | None:
        """Before mapping more for ``stream``: a block of ``fl`` for ``size`` made of free memory
        that other streams, each with all its work done, hold: the smallest run of adjacent
        free blocks of those streams and ``stream`` with room, its other streams' blocks made
        ``stream``'s and merged; returned out of the list. None when no such run has room
        (NOTES entry 44).

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
        for t, bins in fl.bins.items():  # Python reads it, not refused (the review's finding)
            if t == stream or t == _LEGACY or not bins.sizes:
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

    def _merge_free(self, block: Block) -> Block:
        """File a free block that is in no free list, merged with its free neighbours of the
        same stream (ordinary pool; no statistics change but the inactive splits'); return the
        merged block."""
        fl = block.pool
        k = self.stats.kind(fl.is_small)
        merged = False
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.holds == 0 and nxt.stream == block.stream:
            fl.remove(nxt)
            block.size += nxt.size
            after = block.next = nxt.next
            if after is not None:
                after.prev = block
            nxt.prev = nxt.next = None
            self._keep_spare(nxt)
            k.add("inactive_split", -1)
            merged = True
        before = block.prev
        if (
            before is not None
            and not before.allocated
            and before.holds == 0
            and before.stream == block.stream
        ):
            fl.remove(before)
            before.size += block.size
            after = before.next = block.next
            if after is not None:
                after.prev = before
            block.prev = block.next = None
            self._keep_spare(block)
            block = before
            k.add("inactive_split", -1)
            merged = True
        if merged and block.prev is None and block.next is None:  # a whole segment again
            k.add("inactive_split", -1)
            k.add("inactive_split_bytes", -block.size)
        fl.insert(block)
        return block

    def _rehome(self) -> None:
        """``empty_cache``: the free blocks at the end of an expandable segment that other streams
        took over (``_take_idle``) go back to the segment's stream and merge, after one device
        synchronize (their last uses done), so the segment can shrink or go back whole. Taken
        blocks between live ones stay with the streams that took them: giving them back would
        free nothing, and would strand them if the segment's stream was destroyed (a destroyed
        stream is never asked whether it is idle, so nothing would take them over again)."""
        strays: list[tuple[Block, int]] = []
        for seg in self._exp.values():
            b: Block | None = self._segments[seg.base]
            while b is not None and b.next is not None:
                b = b.next
            while b is not None and not b.allocated and b.holds == 0:  # the free end, backwards
                if b.stream != seg.stream:
                    strays.append((b, seg.stream))
                b = b.prev
        if not strays:
            return
        self._synchronize_device()
        for b, home in strays:  # each still a block of its own: only ``home``'s blocks merge away
            b.pool.remove(b)
            b.stream = home
            self._merge_free(b)

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
            prev = self.device.exchange_capture_mode(CAPTURE_MODE_RELAXED)
            va = 0
            mapped = False
            try:
                va = self.device.vmm_reserve(reserve)
                try:
                    mapped = self.device.vmm_map(va, need)
                except BaseException:  # a driver error or an interrupt: the range goes back
                    self._unmap_quietly(va, need)  # (an interrupt may come after the map took effect)
                    self._release_quietly(va, reserve)
                    raise
                if not mapped:
                    self.device.vmm_release(va, reserve)
                    return None
            finally:
                try:
                    self.device.exchange_capture_mode(prev)
                except BaseException:  # (a signal handler in the restore): nothing was filed yet
                    if mapped:
                        self._unmap_quietly(va, need)
                        self._release_quietly(va, reserve)
                    raise
            seg = ExpandableSegment(va, reserve, need, stream, fl.is_small)
            self._exp[va] = seg
            self._exp_of[(fl.is_small, stream)] = seg
            head = Block(va, need, stream, fl)
            self._segments[va] = head
            insort(self._seg_bases, va)
            self.stats.num_device_alloc += 1
            k = self.stats.kind(fl.is_small)
            k.add("segment", 1)
            k.add("reserved_bytes", need)
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
        prev = self.device.exchange_capture_mode(CAPTURE_MODE_RELAXED)
        mapped = False
        try:
            try:
                mapped = self.device.vmm_map(end, need)
            except BaseException:  # an interrupt may come after the map took effect: undo it, or
                self._unmap_quietly(end, need)  # the range could never be mapped again
                raise
        finally:
            try:
                self.device.exchange_capture_mode(prev)
            except BaseException:  # (a signal handler in the restore): nothing was counted yet
                if mapped:
                    self._unmap_quietly(end, need)
                raise
        if not mapped:
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
            # inactive split block too (the differential test found this uncounted; entry 43)
            k.add("inactive_split", 1)
            k.add("inactive_split_bytes", tail.size)
        k.add("inactive_split", 1)
        k.add("inactive_split_bytes", need)
        self._mapped(block, end, need, stream)
        return block

    def _mapped(self, block: Block, end: int, need: int, stream: int) -> None:
        """Record the mapping that grew an expandable segment (``block``, in no free list, holds
        it; the caller hands it out). If the history raises, the block is filed free first."""
        if self._history is not None:
            try:
                self._history.record("segment_map", end, need, stream, None)
            except BaseException:
                block.pool.insert(block)
                raise

    def _unmap_quietly(self, va: int, nbytes: int) -> None:
        """Unmap ``[va, va + nbytes)`` of one of this allocator's reservations if it is mapped: a
        map or unmap that raised may or may not have taken effect. The device refusing (nothing
        mapped there) is the answer, not an error. Safe to repeat: nobody else maps into the
        allocator's reservations."""
        try:
            self.device.vmm_unmap(va, nbytes)
        except GraphpoolError:
            pass

    def _release_quietly(self, va: int, nbytes: int) -> None:
        """Give back a reservation that an interrupted call left (a refusal is ignored)."""
        try:
            self.device.vmm_release(va, nbytes)
        except GraphpoolError:
            pass

    def _map_allowed(self, nbytes: int) -> bool:
        """Whether mapping ``nbytes`` more keeps reserved memory within the limits (a refusal
        is noted for the out-of-memory message, as ``_device_malloc`` does)."""
        limits = self.limits
        if limits.cap is not None and self.stats.current("reserved_bytes") + nbytes > limits.cap:
            self._refuse_by_limit(limits, nbytes)
            return False
        return True

    def _shrink(self, seg: ExpandableSegment) -> None:
        """Unmap the whole granules of the free last block of ``seg`` (``empty_cache``; the
        caller runs under the relaxed capture mode, with no capture underway). A segment
        left empty was already released whole by ``_release_segment``."""
        tail = self._segments[seg.base]
        while tail.next is not None:
            tail = tail.next
        if tail.allocated or tail.holds or tail.prev is None:
            return
        start = seg.base + self._round_gran(tail.ptr - seg.base)
        end = seg.base + seg.mapped
        if start >= end:
            return
        try:
            self.device.vmm_unmap(start, end - start)  # first: if it fails, nothing has changed
        except GraphpoolError:
            raise
        except BaseException:  # a signal handler, perhaps after the unmap took effect: make sure
            try:  # it did, and forget the range either way (unmapped memory is never filed)
                self._unmap_quietly(start, end - start)
            finally:
                self._unmapped_tail(seg, tail, start, end)
            raise
        self._unmapped_tail(seg, tail, start, end)
        if self._history is not None:
            self._history.record("segment_unmap", start, end - start, seg.stream, None)

    def _unmapped_tail(self, seg: ExpandableSegment, tail: Block, start: int, end: int) -> None:
        """``_shrink``'s bookkeeping once ``[start, end)`` of free last block ``tail`` is unmapped."""
        fl = tail.pool
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
        blocks = [b for b in fl if b.prev is None and b.next is None]
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

    def _log_segment(self, what: str, head: Block) -> None:
        """Log a segment's allocation or release (DEBUG; the caller checked the level)."""
        owner = head.pool.owner
        _log.debug(
            "device %d: segment %s at 0x%x, %d bytes, stream 0x%x, %s",
            self.device.index,
            what,
            head.ptr,
            head.size,
            head.stream,
            "ordinary pool" if owner is None else f"private pool {tuple(owner.id)}",
        )

    def _device_malloc(self, nbytes: int) -> int | None:
        """Driver allocation, always under the relaxed capture mode: a capture underway on any
        thread (one graphpool may not have seen yet) is never invalidated by it.

        Refused, as the driver refuses when the device is full (None), when the segment would
        take reserved memory past a limit (policy/limits.py): the caller's retry and
        out-of-memory error are the same.
        """
        limits = self.limits
        if limits.cap is not None and self.stats.current("reserved_bytes") + nbytes > limits.cap:
            self._refuse_by_limit(limits, nbytes)
            return None
        prev = self.device.exchange_capture_mode(CAPTURE_MODE_RELAXED)
        ptr: int | None = None
        try:
            ptr = self.device.malloc(nbytes)
        finally:
            try:
                self.device.exchange_capture_mode(prev)
            except BaseException:  # (a signal handler in the restore): the caller never sees
                if ptr is not None:  # the segment, so the driver gets it back
                    self.device.free(ptr)
                raise
        if ptr is not None:
            self._limit_hit = None
        return ptr

    def _refuse_by_limit(self, limits: MemoryLimits, nbytes: int) -> None:
        """Note (for the OOM message) and log that a limit refused a segment of ``nbytes``."""
        reserved = self.stats.current("reserved_bytes")
        why = limits.refusal(reserved, nbytes, fmt_bytes) or "a memory limit"
        self._limit_hit = why
        if _enabled(logging.INFO):
            _log.info(
                "device %d: a new segment of %d bytes refused by %s (%d bytes reserved)",
                self.device.index,
                nbytes,
                why,
                reserved,
            )

    def _oom_message(self, nbytes: int, seg: int | None, limit: str | None = None) -> str:
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

    # -------------------------------------------------------------------- free
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

    def _free_locked(self, ptr: object) -> None:
        """The body of ``free`` with the lock held."""
        if self._busy:  # re-entered mid-call on this thread: queue it like a finalizer's free
            self._check_pointer(ptr, "free")
            self.defer_free(ptr)
            return
        self._busy = True
        try:
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
        # is unboxed, and boxing it again allocates (addresses are large ints; entry 24).
        key: object = ptr
        block: Block | None = None
        if type(ptr) is Block:  # malloc_owned's allocation, given by its owner: no lookup
            if ptr.owned and self._mine(ptr.pool):  # (another's lists are another lock's)
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
        ptr, requested, stream, owner = block.ptr, block.requested, block.stream, block.pool.owner
        block.allocated = True  # until the event is in: raising, the free is queued again (_free)
        frames = h.free_requested(ptr, requested, stream, owner)
        block.allocated = False
        if self._capturing or block.stream_uses:
            if self._free_held(block):
                h.free_completed(ptr, requested, stream, owner, frames)
        else:
            self._free_block(block, True)
            h.free_completed(ptr, requested, stream, owner, frames)

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
        fl = block.pool
        size = block.size
        owner = fl.owner
        if self._capturing and owner is not None and not block.stream_uses:
            # A capture allocating from this pool takes the block back into it: with one capture
            # underway, the one that allocated it if still active (``owner``, typed here so that
            # compiled its fields are read natively), else the first whose pool it is.
            rec: CaptureRecord | None = block.owner
            if rec is None or not rec.active or rec.pool is not owner or len(self._captures) != 1:
                rec = None
                for r in self._captures.values():
                    if r.pool is owner:
                        rec = r
                        break
            if rec is not None:
                if len(owner.fresh) != rec.fresh:  # segments of another capture (malloc)
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
            if owner is not None and owner.fresh:
                for rec in recs:
                    self._touch(block, rec)
            if recs and (len(recs) > 1 or owner is not recs[0].pool):
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

    def _adopt_users(self, block: Block) -> None:
        """Adopt the unseen captures the extra user streams of ``block`` capture in (see
        ``_free_held``), whether or not other captures are underway.

        No sweep: a free queued during a capture begun outside and carried out after its end
        still counts as made during it. A stream with such a capture registered is not asked
        (it is known; if it ended and the stream captures anew, the next sweep or allocation
        on it finds that)."""
        self._streams_capturing(block.stream_uses or set())

    def _streams_capturing(self, streams: set[int]) -> bool:
        """Whether any of ``streams`` takes part in a capture, asked of the device: what must be
        known before an event is recorded on them (``_insert_events``). An event recorded into
        a capture cannot be queried once the capture ends, so every later allocation and
        ``empty_cache`` would raise cudaErrorCapturedEvent.

        An active capture that is not registered (begun outside graphpool, not seen yet) is
        adopted here: its graph then keeps what is freed during it, and the events wait until
        no capture is underway. True also for a capture that cannot be adopted (invalidated,
        or dead with its thread), and when the device cannot tell: CUDA refuses the legacy
        stream's status while a blocking stream captures, and recording on the legacy
        stream then fails. A stream registered for a capture begun outside is not asked. A
        stream that is gone fails the query and counts as not capturing: its event record
        fails the same way, and a device synchronize stands in for it. One capture-id query
        per stream; the full status only for a capturing stream, and for the legacy stream
        (whose id the device may give without asking the driver: it never captures)."""
        capturing = False
        for s in sorted(streams):
            if s in self._foreign:
                capturing = True
                continue
            try:
                if s != _LEGACY and not self._query(s):
                    continue
                status, cid = self.device.capture_info(s)
            except GraphpoolError:
                if s == _LEGACY:
                    capturing = True
                continue
            if status == CAPTURE_STATUS_NONE:
                continue
            capturing = True
            if status == CAPTURE_STATUS_ACTIVE and cid not in self._captures and cid not in self._dead:
                self._register_foreign(s, cid, None, "", False)
        return capturing

    def _scopes(self, fl: FreeList) -> tuple[PoolStats, ...]:
        """The statistics a block of ``fl`` counts in: the device's, and its private pool's."""
        return (self.stats,) if fl.owner is None else (self.stats, fl.owner.stats)

    def _captures_for_free(self, block: Block) -> tuple[CaptureRecord, ...]:
        """The captures a free made now keeps ``block`` for. O(underway captures).

        A block of a pool that an underway capture allocates from goes back to that pool
        (the latest such capture's): it is handed out again only to captures into that pool,
        and reusing it is what pool sharing is for. Nothing else is provably out of reach of
        the underway captures: graphpool cannot see which addresses a captured kernel
        touches, and any live block's address may be handed to one, whichever stream or
        thread allocated it and whenever (before the capture began or during it). So every
        other block, whoever drops it (a worker thread, a garbage-collection pass), is kept
        for the graph of every underway capture (the cupy#9655 rule).
        """
        owner = block.pool.owner
        caps = self._captures
        if owner is not None:
            found: CaptureRecord | None = None
            for r in caps.values():
                if r.pool is owner:
                    found = r  # the latest begun
            if found is not None:
                return (found,)
        return tuple(caps.values())

    @staticmethod
    def _set_creator(head: Block, rec: CaptureRecord | None) -> None:
        """Name the capture segment ``head`` goes back with (None: it stays with its pool);
        keeps the pool's ``fresh`` set and the records' ``fresh`` counts in step."""
        old = head.creator
        if old is rec:
            return
        pool = head.pool.owner
        assert pool is not None, "only a private pool's segments have creators"
        if old is not None:
            old.fresh -= 1
        head.creator = rec
        if rec is None:
            pool.fresh.discard(head)
        else:
            rec.fresh += 1
            rec.created.append(head)
            pool.fresh.add(head)

    @staticmethod
    def _touch(block: Block, rec: CaptureRecord) -> None:
        """Capture ``rec`` uses ``block``: its segment no longer goes back with the capture that
        made it, or, if that capture failed, it goes back with ``rec`` instead (see
        Block.creator). Called only while the pool has such segments; walks the segment to
        its head (O(blocks in the segment))."""
        head = block
        while head.prev is not None:
            head = head.prev
        creator = head.creator
        if creator is not None and creator is not rec:
            # the failed capture is gone: the segment goes back with rec now; else two
            # captures use it and it stays whatever either does
            CachingAllocator._set_creator(head, rec if creator.failed else None)

    def _free_block(self, block: Block, freed: bool) -> None:
        """Return a block with no holds to its free list, merging free neighbours.

        ``freed``: the user is freeing it now (not a hold ending), for the statistics.
        """
        fl = block.pool
        size = block.size
        requested = block.requested
        block.requested = 0
        block.owner = None
        block.stream_uses = None
        d_cnt = d_bytes = 0
        # A merged block takes the free-list entry of a neighbour it absorbed when the
        # order allows (FreeList.replace): no list resize in the usual cycle.
        old: Block | None = None
        old_size = 0
        nxt = block.next
        if nxt is not None and not nxt.allocated and nxt.holds == 0 and nxt.stream == block.stream:
            # absorb the free block after this one (of its stream: _take_idle); keep its object
            old = nxt
            old_size = nxt.size
            d_cnt = -1
            d_bytes = -nxt.size
            block.size = size + nxt.size
            after = block.next = nxt.next
            if after is not None:
                after.prev = block
            nxt.prev = nxt.next = None
            self._keep_spare(nxt)
        prev = block.prev
        if prev is not None and not prev.allocated and prev.holds == 0 and prev.stream == block.stream:
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
        if fl.owner is not None:
            fl.owner.stats.on_release(fl.is_small, size, requested, d_cnt, d_bytes, freed)

    def _keep_spare(self, block: Block) -> None:
        """Keep a Block object a merge absorbed, for a later split (``_spare1`` first)."""
        if self._spare1 is None:
            self._spare1 = block
        else:
            self._spare.append(block)

    def _hold(self, block: Block) -> None:
        """Keep a freed block out of its free list (an event, a graph, a deferral)."""
        if block.holds == 0:
            for st in self._scopes(block.pool):
                st.hold(block.pool.is_small, block.size, 1)
        block.holds += 1

    def _unhold(self, block: Block) -> None:
        """Drop one hold; the last one returns the block to its free list."""
        block.holds -= 1
        if block.holds == 0:
            for st in self._scopes(block.pool):
                st.hold(block.pool.is_small, block.size, -1)
            h = self._history
            if h is None:
                self._free_block(block, False)
                return
            # the block is back in its list before the history (a call out) hears of it
            ptr, requested, stream, owner = block.ptr, block.requested, block.stream, block.pool.owner
            self._free_block(block, False)
            h.free_completed(ptr, requested, stream, owner)

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
            if not self._mine(ptr.pool):
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

    # ------------------------------------------------------------ stream uses
    def record_stream(self, ptr: object, stream: int) -> None:
        """Mark ``stream`` as a user of the allocation at ``ptr`` (docs/behaviour.rst, "Streams")."""
        self._run_locked("record_stream", lambda: self._record_stream(ptr, stream))

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
            if self._orphans:
                self._release_orphans()
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
        """Wait for every pending event and free its block (empty_cache and OOM only)."""
        if self._world.active:
            raise CaptureError("graphpool: no event is synchronized while a capture is underway")
        if self._orphans:
            self._release_orphans()
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

    # ------------------------------------------------------------- the cache
    def empty_cache(self) -> None:
        """Return every unsplit free segment of the ordinary and freeable pools to the driver."""
        self._run_locked("empty_cache", self._empty_cache)

    def _empty_cache(self) -> None:
        if self._pending:
            self._drain()
        if self._tokens:
            self._poll_released()
        self._sweep()
        if self._world.active:
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

    def _release_cached(self) -> None:
        """Synchronize pending stream uses, then give back every segment no graph may use."""
        self._synchronize_events()
        prev = self.device.exchange_capture_mode(CAPTURE_MODE_RELAXED)
        try:
            if self._exp:
                self._rehome()
            for fl in (self._small, self._large):
                self._release_free_segments(fl)
            for seg in list(self._exp.values()):  # partly free: unmap their free ends
                self._shrink(seg)
            for pool in self._pools.values():  # live pools: only segments of failed captures
                if pool.use_count and pool.fresh:
                    for head in list(pool.fresh):
                        creator = head.creator
                        whole = head.next is None and not head.allocated and head.holds == 0
                        if whole and creator is not None and creator.failed:
                            head.pool.remove(head)
                            self._release_segment(head)
            for pid, pool in list(self._freeable.items()):
                self._release_free_segments(pool.small)
                self._release_free_segments(pool.large)
                if pool.segment_count == 0:
                    del self._freeable[pid]
                    del self._pools[pid]
                    if self._history is not None:
                        self._history.pool("pool_release", pool)
                    if _enabled(logging.DEBUG):
                        self._log_pool("released", pool)
        finally:
            self.device.exchange_capture_mode(prev)

    def _release_free_segments(self, fl: FreeList) -> None:
        for block in fl:
            if block.prev is None and block.next is None:
                fl.remove(block)
                self._release_segment(block)

    def _release_segment(self, block: Block) -> None:
        """Give a whole free segment back to the driver: the one place device memory is freed."""
        if self._world.active:
            raise CaptureError("graphpool: no device memory is freed while a capture is underway")
        seg = self._exp.get(block.ptr) if self._exp else None
        # The allocator forgets the segment first, then the device gives it back: a device call
        # that raises (a driver error, or a signal handler's exception after the free took
        # effect) never leaves a freed segment filed, to be handed out or freed a second time.
        # What that costs when the driver did not free it: the memory stays with the driver.
        if seg is not None:
            del self._exp[seg.base]
            del self._exp_of[(seg.is_small, seg.stream)]
        del self._segments[block.ptr]
        self._seg_bases.remove(block.ptr)
        fl = block.pool
        for st in self._scopes(fl):
            st.num_device_free += 1
            k = st.kind(fl.is_small)
            k.add("segment", -1)
            k.add("reserved_bytes", -block.size)
        owner = fl.owner
        if owner is not None:
            owner.segment_count -= 1
            self._set_creator(block, None)
        try:
            if seg is None:
                self.device.free(block.ptr)
            else:  # a whole free expandable segment: unmap it and give back its range
                try:
                    self.device.vmm_unmap(seg.base, seg.mapped)
                except GraphpoolError:
                    raise
                except BaseException:  # perhaps after the unmap took effect: finish it
                    try:
                        self._unmap_quietly(seg.base, seg.mapped)
                    finally:
                        self._release_quietly(seg.base, seg.reserved)
                    raise
                self.device.vmm_release(seg.base, seg.reserved)
        finally:
            if self._history is not None:
                self._history.segment_free(block.ptr, block.size, block.stream, owner)
            if _enabled(logging.DEBUG):
                self._log_segment("released", block)

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

    def _release_later(self, rec: CaptureRecord) -> bool:
        """Whether a queued release of ``rec`` must wait: its capture is still underway on a thread
        that lives (only that thread can end it). If the device query raises (a signal handler
        in it), the release is queued again first."""
        try:
            return (
                rec.active
                and not rec.foreign
                and rec.thread != threading.get_ident()  # asked for a record only
                and self._query(rec.stream) == rec.capture_id
                and _thread_alive(rec.thread)
            )
        except BaseException:
            self._pending.append(rec)
            raise

    # --------------------------------------------------------------- capture
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

    def _begin_capture(
        self, pool_id: PoolId, begin: Callable[[], int], stream: int, label: str, footprint: bool = False
    ) -> CaptureRecord:
        if self._pending:
            self._drain()
        if self._tokens:
            self._poll_released()
        rec = self._new_record(pool_id, stream, label)
        if footprint:
            rec.written = Writes()
        self._capturing += 1
        self._world.active += 1
        try:
            cid = begin()
        except BaseException:
            self._capturing -= 1
            self._world.active -= 1
            self._drop_use(rec.pool)
            raise
        if cid in self._captures:  # pragma: no cover - the device promises unique ids
            self._capturing -= 1
            self._world.active -= 1
            self._drop_use(rec.pool)
            raise CaptureError(f"capture id {cid} is already registered")
        rec.capture_id = cid
        try:  # the calls out before the record is filed: raising, it is as if ``begin`` had raised
            if self._history is not None:
                self._history.capture("capture_begin", stream, rec.pool, cid, rec.label, foreign=False)
            if _enabled(logging.DEBUG):
                self._log_capture("began", rec)
        except BaseException:
            self._capturing -= 1
            self._world.active -= 1
            self._drop_use(rec.pool)
            raise
        self._captures[cid] = rec
        self._records[rec.sequence] = rec
        return rec

    def _log_capture(self, what: str, rec: CaptureRecord) -> None:
        """Log a capture's begin or end (DEBUG; the caller checked the level)."""
        _log.debug(
            "device %d: capture %d %s on stream 0x%x (%s), private pool %s",
            self.device.index,
            rec.capture_id,
            what,
            rec.stream,
            rec.label,
            tuple(rec.pool.id),
        )

    def _log_pool(self, what: str, pool: PrivatePool) -> None:
        """Log a private pool's creation or release (DEBUG; the caller checked the level)."""
        _log.debug("device %d: private pool %s %s", self.device.index, tuple(pool.id), what)

    def _new_record(self, pool_id: PoolId, stream: int, label: str) -> CaptureRecord:
        """A record for a capture into ``pool_id`` (made or revived), with the pool's use counted.

        Its inputs are the outputs of the pool's unreleased captures still allocated:
        O(their allocations), not O(every live block).
        """
        pool = self._pools.get(pool_id)
        if pool is None:
            pool = PrivatePool(pool_id)
            self._pools[pool_id] = pool
            try:
                if self._history is not None:
                    self._history.pool("pool_create", pool)
                if _enabled(logging.DEBUG):
                    self._log_pool("created", pool)
            except BaseException:  # a call out raised: the pool, unused, goes as if never made
                del self._pools[pool_id]
                raise
        self._freeable.pop(pool_id, None)
        pool.use_count += 1
        self._capture_seq += 1
        rec = CaptureRecord(pool, label, threading.get_ident(), self._capture_seq)
        rec.stream = stream
        rec.inputs = [
            (b.ptr, b.size, r, b, serial)
            for r in self._records.values()
            if r.pool is pool
            for (b, serial) in r.outputs
            if b.allocated and b.serial == serial
        ]
        if pool.fresh:  # what it may read keeps its segment (see Block.creator)
            for head in list(pool.fresh):
                if any(b.allocated for b in iter_segment(head)):
                    self._set_creator(head, None)
        return rec

    def adopt_capture(self, stream: int, *, pool: PoolId | None = None, label: str = "") -> CaptureRecord:
        """Register the capture underway on ``stream``, begun outside graphpool (a framework's
        own capture API), and serve its allocations from a private pool: ``pool``'s, or one
        of its own. The pool is released when the device reports the capture's graph and
        all its executable instances destroyed. Raises CaptureError unless ``stream`` is
        capturing. Returns the registered record (the same one if already registered).
        """
        return self._run_locked("adopt_capture", lambda: self._adopt_capture(stream, pool, label))

    def _adopt_capture(self, stream: int, pool: PoolId | None, label: str) -> CaptureRecord:
        if self._pending:
            self._drain()
        status, cid = self.device.capture_info(stream)
        if status != CAPTURE_STATUS_ACTIVE:
            raise CaptureError(f"stream 0x{stream:x} is not capturing (status {status}): nothing to adopt")
        rec = self._captures.get(cid)
        if rec is not None:
            return rec
        return self._register_foreign(stream, cid, pool, label)

    def end_adopted(self, rec: CaptureRecord) -> None:
        """The capture of an adopted record ended (its framework's end-capture call returned):
        stop routing to its pool. The pool stays until the graph is destroyed."""
        self._run_locked("end_adopted", lambda: self._end_capture(rec))

    def _adopt_found(self, stream: int, sweep: bool = True) -> CaptureRecord | None:
        """Detection found ``stream`` capturing under an id it does not know: adopt that capture
        unless it is invalidated or dead (its work never runs, so any memory will do)."""
        status, cid = self.device.capture_info(stream)
        if status != CAPTURE_STATUS_ACTIVE or cid in self._dead:
            return None
        rec = self._captures.get(cid)
        if rec is not None:
            return rec
        return self._register_foreign(stream, cid, None, "", sweep)

    def _register_foreign(
        self, stream: int, cid: int, pool: PoolId | None, label: str, sweep: bool = True
    ) -> CaptureRecord:
        if sweep:  # a capture begun outside that ended on ``stream`` is replaced below
            self._sweep()
        if self._tokens:
            self._poll_released()
        found = self._captures.get(cid)
        if found is not None:  # adopted meanwhile: a graph released above asked about ``stream``
            return found
        rec = self._new_record(pool if pool is not None else new_graph_pool_id(), stream, "")
        rec.label = label or f"capture {cid} on stream 0x{stream:x}"
        rec.foreign = True
        rec.capture_id = cid
        token = new_release_token()
        try:
            self.device.attach_release(stream, token)
        except GraphpoolError as exc:  # no user objects here: protect the capture all the same
            token = 0
            try:
                _warnings.warn(
                    f"graphpool: the pool of {rec.label} cannot be tied to its graph ({exc}); it is "
                    "kept until the process ends",
                    RuntimeWarning,
                )
            except BaseException:
                self._drop_use(rec.pool)
                raise
        except BaseException:
            self._drop_use(rec.pool)
            raise
        if token:
            rec.token = token
            self._tokens[token] = rec
        self._captures[cid] = rec
        self._records[rec.sequence] = rec
        self._foreign[stream] = rec
        self._capturing += 1
        self._world.active += 1
        if self._history is not None:
            self._history.capture("capture_begin", stream, rec.pool, cid, rec.label, foreign=True)
        if _enabled(logging.DEBUG):
            self._log_capture("begun outside graphpool adopted", rec)
        return rec

    def _sweep(self) -> None:
        """Stop routing to captures begun outside graphpool that have ended (one query each).

        Graphs the device reports destroyed are taken first (``_poll_released``): their
        captures stop without a query of their streams, which may be destroyed by then."""
        if not self._foreign:
            return
        if self._tokens:
            self._poll_released()
            if not self._foreign:
                return
        ended: list[CaptureRecord] | None = None  # no list made in the usual case: none ended
        for stream, rec in self._foreign.items():
            if self._query(stream) != rec.capture_id:
                if ended is None:
                    ended = []
                ended.append(rec)
        if ended is not None:
            for rec in ended:
                self._end_capture(rec)

    def _poll_released(self) -> None:
        """Release the records whose graphs the device reports destroyed (Device.attach_release)."""
        recs = []
        for token in self.device.take_released():
            rec = self._tokens.get(token)  # (``_release`` drops the token)
            if rec is not None:
                recs.append(rec)
        for i, rec in enumerate(recs):
            try:
                if rec.active:  # destroyed before it ended: an invalidated or abandoned capture
                    rec.failed = True
                    self._stop_and_release(rec)
                else:
                    self._release(rec)
            except BaseException:  # a call out raised: the others are released at the next call
                self._pending.extend(recs[i + 1 :])
                raise

    def end_capture(self, rec: CaptureRecord) -> None:
        """Stop routing to ``rec``'s pool after its device capture ended successfully."""
        self._run_locked("end_capture", lambda: self._end_capture(rec))

    def _end_capture(self, rec: CaptureRecord) -> None:
        if self._pending:
            self._drain()  # frees queued during the capture still count as made during it
        if not rec.active:
            return
        rec.outputs = self._outputs(rec)  # first: _stop_routing ends with calls out
        for head in rec.created:  # the graph lives: its segments stay with the pool
            if head.creator is rec:
                self._set_creator(head, None)
        rec.created = []
        self._stop_routing(rec)

    def _outputs(self, rec: CaptureRecord) -> list[tuple[Block, int]]:
        """The blocks ``rec`` allocated that are still allocated, with their serials, in
        allocation order (a walk of its pool's segments: malloc marks them ``owner``)."""
        found = [
            (b.serial, b)
            for head in self._segments.values()
            if head.pool.owner is rec.pool
            for b in iter_segment(head)
            if b.allocated and b.owner is rec
        ]
        found.sort(key=lambda pair: pair[0])
        return [(b, serial) for serial, b in found]

    def abort_capture(self, rec: CaptureRecord) -> None:
        """A capture failed: stop routing, give back what it kept, restore the pool's use count."""
        self._run_locked("abort_capture", lambda: self._abort_capture(rec))

    def _abort_capture(self, rec: CaptureRecord) -> None:
        if self._pending:
            self._drain()
        rec.failed = True
        self._stop_and_release(rec)

    def release_capture(self, rec: CaptureRecord) -> None:
        """The graph of ``rec`` is gone: return its kept blocks and lower the pool's use count."""
        self._run_locked("release_capture", lambda: self._release_capture(rec))

    def _release_capture(self, rec: CaptureRecord) -> None:
        if self._pending:
            self._drain()
        self._release(rec)

    def _stop_routing(self, rec: CaptureRecord) -> None:
        """``rec``'s capture is over (ended, failed or dead): route nothing more to its pool."""
        if not rec.active:
            return
        rec.active = False
        del self._captures[rec.capture_id]
        if rec.foreign and self._foreign.get(rec.stream) is rec:
            del self._foreign[rec.stream]
        self._capturing -= 1
        self._world.active -= 1
        if self._history is not None:
            self._history.capture(
                "capture_end", rec.stream, rec.pool, rec.capture_id, rec.label, failed=rec.failed
            )
        if _enabled(logging.DEBUG):
            self._log_capture("failed" if rec.failed else "ended", rec)
        if not self._capturing:
            self._flush_deferred()

    def _release(self, rec: CaptureRecord) -> None:
        """Give back what ``rec`` holds. A graph collected mid-capture: end its device capture
        first; a capture that can never be ended (its thread is gone and its mode binds it
        to that thread) is marked dead, so nothing waits for it."""
        if rec.released:
            return
        try:
            if rec.active:
                rec.failed = True
                if not rec.foreign:
                    try:
                        rec.handles.append(("graph", self.device.end_capture(rec.stream)))
                    except GraphpoolError:
                        if self._query(rec.stream) == rec.capture_id:
                            self._dead.add(rec.capture_id)
                self._stop_routing(rec)
            # One handle, one block at a time, each taken off the record as it is done: an
            # exception out of a call (a signal handler in the device or the history) loses
            # none, and the rest of the release is queued for the next call (below).
            handles = rec.handles
            while handles:
                kind, handle = handles.pop(0)
                try:
                    if kind == "exec":
                        self.device.destroy_graph_exec(handle)
                    else:
                        self.device.destroy_graph(handle)
                except GraphpoolError:
                    pass
            kept = rec.kept
            while kept:
                block = kept.pop(0)
                try:
                    # A replay queued on another stream may still touch the block: it waits for
                    # an event on each such stream, as a record_stream'd block would.
                    uses = rec.replay_streams - {block.stream}
                    if uses:
                        if block.stream_uses:  # still deferred: its coming events cover these too
                            block.stream_uses |= uses
                        else:
                            block.stream_uses = set(uses)
                            self._hold(block)
                            try:
                                self._insert_events(block)  # or it waits, while a capture is underway
                            finally:
                                self._unhold(block)
                finally:
                    self._unhold(block)  # the graph's own hold
        except BaseException:
            self._pending.append(rec)  # the rest of the release, at the next call
            raise
        rec.released = True
        self._records.pop(rec.sequence, None)
        if rec.token:
            self._tokens.pop(rec.token, None)
        self._drop_use(rec.pool)
        if not self._capturing and self._deferred:
            self._flush_deferred()

    def _stop_and_release(self, rec: CaptureRecord) -> None:
        """``_stop_routing`` then ``_release``: a failed or destroyed capture. If the first raises
        after it stopped routing (a call out), the release is queued for the next call."""
        try:
            self._stop_routing(rec)
        except BaseException:
            self._pending.append(rec)
            raise
        self._release(rec)

    def _drop_use(self, pool: PrivatePool) -> None:
        pool.use_count -= 1
        if pool.use_count == 0:
            if pool.segment_count == 0:
                del self._pools[pool.id]
                if self._history is not None:
                    self._history.pool("pool_release", pool)
                if _enabled(logging.DEBUG):
                    self._log_pool("released", pool)
            else:
                self._freeable[pool.id] = pool

    # -------------------------------------------------------------- queries
    def memory_stats(self, pool: PoolId | None = None) -> dict[str, int]:
        """The flattened statistics of the device, or of one private pool."""
        return self._run_locked("memory_stats", lambda: self._memory_stats(pool))

    def _memory_stats(self, pool: PoolId | None) -> dict[str, int]:
        self._settle()
        if pool is None:
            return self._device_stats()
        p = self._pools.get(pool)
        if p is None:
            raise ValueError(f"no private pool {tuple(pool)} on device {self.device.index}")
        out = p.stats.as_dict()
        out["use_count"] = p.use_count
        return out

    def _device_stats(self) -> dict[str, int]:
        """The device's flattened statistics: PyTorch's keys, then the expandable segments'
        mapped bytes (also counted in ``reserved_bytes``) and the address space they hold."""
        out = self.stats.as_dict()
        out["expandable_mapped_bytes"] = sum(seg.mapped for seg in self._exp.values())
        out["expandable_virtual_bytes"] = sum(seg.reserved for seg in self._exp.values())
        return out

    def reset_peak(self) -> None:
        """Set every peak (device and private pools) to its current level."""
        self._run_locked("reset_peak", self._reset_peak)

    def _reset_peak(self) -> None:
        for st in [self.stats] + [p.stats for p in self._pools.values()]:
            st.reset_peak()

    def reset_accumulated(self) -> None:
        """Zero accumulated counters (device and private pools)."""
        self._run_locked("reset_accumulated", self._reset_accumulated)

    def _reset_accumulated(self) -> None:
        for st in [self.stats] + [p.stats for p in self._pools.values()]:
            st.reset_accumulated()

    def lookup(self, ptr: int) -> Block | None:
        """The live allocation that starts at ``ptr``, if any (a DeviceBuffer's too)."""
        block = self._active.get(ptr)
        return block if block is not None else self._owned_at(ptr)

    def _live_block(self, ptr: object) -> Block | None:
        """The live allocation ``ptr`` names: a Block of ``malloc_owned`` still owned, or the
        raw allocation filed at address ``ptr``."""
        if type(ptr) is Block:
            return ptr if ptr.owned and self._mine(ptr.pool) else None
        return self._active.get(ptr) if type(ptr) is int else None

    def _mine(self, fl: FreeList) -> bool:
        """Whether ``fl`` is one of this allocator's free lists (ordinary or a private pool's)."""
        if fl is self._small or fl is self._large:
            return True
        owner = fl.owner
        return owner is not None and self._pools.get(owner.id) is owner

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

    def private_pools(self) -> list[PrivatePool]:
        """Every private pool that still exists."""
        return self._run_locked("private_pools", self._private_pools)

    def _private_pools(self) -> list[PrivatePool]:
        self._settle()
        return list(self._pools.values())

    def snapshot(self) -> list[dict[str, Any]]:
        """Segments with their blocks, streams, owning pool and owning graph."""
        return self._run_locked("snapshot", self._snapshot)

    def _settle(self) -> None:
        """Carry out queued frees and releases, and notice ended and destroyed captures."""
        if self._pending:
            self._drain()
        if self._tokens:
            self._poll_released()
        if self._foreign:
            self._sweep()

    def _kept_for(self) -> dict[int, list[CaptureRecord]]:
        """id(block) -> the unreleased captures keeping it (freed during their capture)."""
        out: dict[int, list[CaptureRecord]] = {}
        for rec in self._records.values():
            for b in rec.kept:
                out.setdefault(id(b), []).append(rec)
        return out

    def _kept_bytes(self) -> int:
        """Bytes of ordinary or other pools' blocks kept for captured graphs (each block once)."""
        seen: dict[int, int] = {}
        for rec in self._records.values():
            for b in rec.kept:
                seen[id(b)] = b.size
        return sum(seen.values())

    def _snapshot(self) -> list[dict[str, Any]]:
        self._settle()
        kept = self._kept_for()
        out = []
        for base in self._seg_bases:
            head = self._segments[base]
            blocks = iter_segment(head)
            owner = head.pool.owner
            seg: dict[str, Any] = {
                "device": self.device.index,
                "address": base,
                "total_size": sum(b.size for b in blocks),
                "allocated_size": sum(b.size for b in blocks if b.allocated),
                "active_size": sum(b.size for b in blocks if b.allocated or b.holds),
                "requested_size": sum(b.requested for b in blocks if b.allocated or b.holds),
                "stream": self._exp[base].stream if base in self._exp else head.stream,
                "segment_type": "small" if head.pool.is_small else "large",
                "segment_pool_id": tuple(owner.id) if owner is not None else None,
                "is_expandable": base in self._exp,
                "blocks": [
                    {
                        "address": b.ptr,
                        "size": b.size,
                        "requested_size": b.requested,
                        "state": (
                            "active_allocated"
                            if b.allocated
                            else "active_pending_free"
                            if b.holds
                            else "inactive"
                        ),
                        # a block kept for graphs (freed during their capture) shows its keeper
                        "owner_graph": (
                            b.owner.label
                            if b.owner is not None
                            else (kept[id(b)][0].label if id(b) in kept else None)
                        ),
                        "kept_for": [r.label for r in kept.get(id(b), ())],
                    }
                    for b in blocks
                ],
            }
            out.append(seg)
        return out

    # -------------------------------------------------------------- history
    def record_history(self, max_entries: int | None, stacks: bool = True) -> None:
        """Record events (policy/history.py) in a ring buffer of ``max_entries``; None stops
        recording and drops the events. Called again while recording, it keeps the newest
        events that fit the new bound."""
        self._run_locked("record_history", lambda: self._record_history(max_entries, stacks))

    def _record_history(self, max_entries: int | None, stacks: bool) -> None:
        if max_entries is None:
            self._history = None
        elif self._history is None:
            self._history = History(self.device.index, max_entries, stacks)
        else:
            self._history.configure(max_entries, stacks)

    @property
    def recording(self) -> bool:
        """Whether the history records events."""
        return self._history is not None

    def history_snapshot(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """The segments of ``snapshot()`` with their ``frames`` (the stacks that allocated each
        segment and live block, empty if not recorded) and the graphs using each segment's
        private pool (``pool_graphs``), and the recorded events, oldest first; at one moment."""
        return self._run_locked("history_snapshot", self._history_snapshot)

    def _history_snapshot(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        segments = self._snapshot()
        graphs: dict[tuple[int, ...], list[str]] = {}
        for rec in self._records.values():
            graphs.setdefault(tuple(rec.pool.id), []).append(rec.label)
        h = self._history
        for seg in segments:
            pool = seg["segment_pool_id"]
            seg["pool_graphs"] = list(graphs.get(pool, ())) if pool is not None else []
            seg["frames"] = h.segment_frames.get(seg["address"], []) if h is not None else []
            for b in seg["blocks"]:
                frames = None
                if h is not None and b["state"] != "inactive":
                    frames = h.block_frames.get(b["address"])
                b["frames"] = frames if frames is not None else []
        return segments, (list(h.entries) if h is not None else [])

    def check_invariants(self) -> None:
        """Verify every invariant (policy/check.py); raises AssertionError on the first broken one."""
        self._run_locked("check_invariants", self._check)

    def _check(self) -> None:
        """check_invariants under the caller's lock; after every malloc and free when
        GRAPHPOOL_DEBUG=1 (O(blocks) each: for tests and bug hunts)."""
        from graphpool.policy.check import check_invariants

        check_invariants(self)

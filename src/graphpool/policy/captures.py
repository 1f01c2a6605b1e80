"""Captures: routing allocations to private pools while a capture is underway (or while a
thread is inside ``use_mem_pool``), and the capture lifecycle (begin, adopt, end, abort,
release, sweep), with the blocks kept for graphs.

Eager allocations into a pool object (``use_mem_pool``): while a thread has entered a
MemPool's pool on this device (``_entered`` > 0 counts the open entries), its allocations
off any capture come from that pool's eager side (private_pools.py, Note [Pool objects]).
A capture's routing comes first: on a capturing stream the capture's pool serves, whatever
pool the thread entered.

While a capture is underway on this device (``_capturing`` > 0), an allocation on a stream
that belongs to a registered capture is served from that capture's private pool
(``_route``). A graph's private pool lives while any of its graphs does; a pool no capture
uses any more but still holding segments is *freeable* (``empty_cache`` and the OOM retry
give it back).

Frees during a capture: only a block of an underway capture's own pool goes back at once;
every other free is kept for the graph of every underway capture (``_captures_for_free``):
graphpool cannot see which addresses a captured kernel touches. A kept block goes back
when the graphs it was kept for are released (``_release``).

CUDA's capture rules are process-wide, so the captures of every allocator of a runtime are
counted in one shared ``CaptureWorld``: while any is underway the allocator never queries
events, never synchronizes and never frees device memory (stream_uses.py, segments.py).

Note [Captures begun outside graphpool]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A capture begun by other code (CuPy's ``Stream.begin_capture``, a raw
``cudaStreamBeginCapture``) is *detected*: with detection on (the default) every malloc on
a stream other than the legacy one asks the device for its stream's capture id (one cheap
query, from C on the CUDA backend) and adopts an unknown capture into a private pool of its
own (``_adopt_found``, ``_register_foreign``). Such a capture ends without telling
graphpool, so:

- its end is noticed by a *sweep* (``_sweep``: one capture-id query per such capture), run
  at every ``SWEEP_EVERY``-th allocation off any capture (``_route``), before a slow
  allocation, by every report and ``empty_cache``, and by a direct free that would keep a
  block for it (``_free_held``, stream_uses.py);
- its pool is released when the device reports the graph and all its executable instances
  destroyed: a CUDA user object carries a release token (``Device.attach_release``), and
  ``_poll_released`` collects the tokens;
- a free queued by a finalizer carries no moment: carried out later, it counts as made
  during every capture still registered;
- a stream that takes part in an unseen capture is asked before any event is recorded on
  it (``_streams_capturing``), and the capture is adopted there, so no event ever goes into
  a capture (stream_uses.py).
A capture that can never end (invalidated, or its thread died) is never adopted, and a
graphpool capture whose thread died is marked dead (``_dead``) so nothing waits for it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Final

from graphpool import _warnings
from graphpool.device.protocol import (
    CAPTURE_STATUS_ACTIVE,
    CAPTURE_STATUS_NONE,
    Device,
)
from graphpool.errors import (
    CaptureError,
    GraphpoolError,
)
from graphpool.policy import logs
from graphpool.policy.block import Block, iter_segment
from graphpool.policy.heap import LEGACY, Heap
from graphpool.policy.pools import SizeConfig
from graphpool.policy.private_pools import (
    CaptureRecord,
    CaptureWorld,
    PoolId,
    PrivatePool,
    Writes,
    mempools,
    new_graph_pool_id,
    new_release_token,
)


def _thread_alive(ident: int) -> bool:
    """Whether a thread with this id still runs (O(threads); rare path)."""
    return any(t.ident == ident for t in threading.enumerate())


SWEEP_EVERY: Final = 64
"""Allocations off any capture, while captures begun outside graphpool are underway, between
two queries of whether those captures ended (``_route``). A sweep also asks the device which
graphs were destroyed (a Python call on CUDA); at 16 it cost about as much per allocation as
the rest of an allocation beside a capture."""


class Captures(Heap):
    """Capture routing, the capture lifecycle and the blocks kept for graphs (see the module doc)."""

    def __init__(self, device: Device, sizes: SizeConfig, world: CaptureWorld | None, detect: bool) -> None:
        super().__init__(device, sizes)
        # ``_capturing`` counts the registered captures of this device (the hot path's only
        # capture test); ``_world`` counts those of every device of the runtime.
        self._world = world if world is not None else CaptureWorld()
        self._capturing = 0
        self._captures: dict[int, CaptureRecord] = {}  # capture id -> record, while underway
        self._records: dict[int, CaptureRecord] = {}  # sequence -> record, until released
        self._foreign: dict[int, CaptureRecord] = {}  # stream -> underway capture begun outside
        self._tokens: dict[int, CaptureRecord] = {}  # release token -> record (Device.attach_release)
        self._dead: set[int] = set()  # ids of captures that can never end (their thread died)
        self._freeable: dict[PoolId, PrivatePool] = {}  # pools no capture uses, holding segments
        self._capture_seq = 0
        # Detection of captures begun outside graphpool: the device's capture-id query, bound
        # once (on CUDA a C function).
        self._detect = bool(detect)
        self._query: Callable[[int], int] = device.capture_id
        # The stream handle malloc queried last, and the same as an int object (see _malloc).
        self._qstream = -1
        self._qkey: Any = -1
        self._sweep_due = SWEEP_EVERY  # allocations off capture until the next _sweep (_route)
        # use_mem_pool: the open entries on this device (the hot path's test), and each
        # thread's entered pools, innermost last.
        self._entered = 0
        self._thread_pools: dict[int, list[PrivatePool]] = {}

    def _insert_events(self, block: Block) -> None:  # pragma: no cover - StreamUses defines it
        """Wait for the extra user streams of ``block`` (stream_uses.py defines it)."""
        raise NotImplementedError

    def _flush_deferred(self) -> None:  # pragma: no cover - StreamUses defines it
        """Record the events of frees deferred during capture (stream_uses.py defines it)."""
        raise NotImplementedError

    def _route(self, stream: int, key: Any) -> CaptureRecord | None:
        """The capture ``stream`` (``key``: the same handle as an int object) belongs to, if
        any (one driver query); adopts an unknown one."""
        cid: Any = self._query(key)  # kept as the query's int object: the lookup boxes none
        if not cid:
            if self._foreign:  # a capture begun outside may have ended: stop routing to it
                # (one query per such capture), at every SWEEP_EVERY-th call that finds its
                # stream not capturing: beside a capture each sweep would double the query
                # cost of an allocation. Statistics, snapshots and empty_cache
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
        if logs.enabled(logging.DEBUG):
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
            if logs.enabled(logging.DEBUG):
                self._log_capture("began", rec)
        except BaseException:
            self._capturing -= 1
            self._world.active -= 1
            self._drop_use(rec.pool)
            raise
        self._captures[cid] = rec
        self._records[rec.sequence] = rec
        return rec

    def _new_record(self, pool_id: PoolId, stream: int, label: str) -> CaptureRecord:
        """A record for a capture into ``pool_id`` (made or revived), with the pool's use counted.

        Its inputs are the outputs of the pool's unreleased captures still allocated:
        O(their allocations), not O(every live block).
        """
        pool = self._pools.get(pool_id)
        if pool is None:
            pool = self._make_pool(pool_id)
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
        if pool.returnable:  # what it may read keeps its segment (see Block.returns_with)
            for head in list(pool.returnable):
                if any(b.allocated for b in iter_segment(head)):
                    self._set_returns_with(head, None)
        return rec

    def _make_pool(self, pool_id: PoolId) -> PrivatePool:
        """Make and file the pool of ``pool_id`` (not filed yet). A live MemPool's id makes its
        kind of pool (``mempools``), with the MemPool's own use counted (``held``)."""
        spec = mempools.get(pool_id)
        pool = PrivatePool(pool_id, spec)
        pool.stats.oversize_at = self.stats.oversize_at  # (max_split_size)
        if spec is not None:
            pool.use_count = 1
            pool.held = True
            if self not in spec.places:
                spec.places.append(self)
            if mempools.get(pool_id) is not spec:
                # The MemPool went meanwhile (its finalizer ran in a collection here, or on
                # another thread) and may have passed this allocator by: its use ends at the
                # next call, as if told (a second drop finds the use gone: held is False).
                self._pending.append(pool_id)
        self._pools[pool_id] = pool
        try:
            if self._history is not None:
                self._history.pool("pool_create", pool)
            if logs.enabled(logging.DEBUG):
                self._log_pool("created", pool)
        except BaseException:  # a call out raised: the pool, unused, goes as if never made
            del self._pools[pool_id]
            raise
        return pool

    def _enter_pool(self, pool_id: PoolId, ident: int) -> None:
        """Thread ``ident`` enters ``use_mem_pool`` of the MemPool ``pool_id``: its eager
        allocations on this device come from that pool until it exits. Counts as a use.

        Only a live MemPool's pool is entered. A dropped (collected) MemPool's pool may live on
        here for its remaining users (live blocks, graphs), but no MemPool owns it any more: it
        goes once they do. Entering it would succeed or fail by whether such a leftover
        happened to exist, and would send new allocations to a pool about to go; so the id of a
        dropped MemPool is refused whether or not its pool is still here (ValueError, nothing
        changed)."""
        if self._pending:
            self._drain()  # (a drop queued by the MemPool's finalizer is carried out first)
        pool = self._pools.get(pool_id)
        if pool_id not in mempools and (pool is None or pool.eager_small is not None):
            why = (
                ""
                if pool is None
                else ": that MemPool was dropped (collected); its pool lives on only for its users"
            )
            raise ValueError(f"{tuple(pool_id)} is not the id of a live MemPool{why}")
        if pool is None:
            pool = self._make_pool(pool_id)
        if pool.eager_small is None:
            raise ValueError(
                f"private pool {tuple(pool_id)} is a graph pool, not a MemPool's: use_mem_pool takes MemPools"
            )
        self._freeable.pop(pool_id, None)
        pool.use_count += 1
        stack = self._thread_pools.get(ident)
        if stack is None:
            self._thread_pools[ident] = [pool]
        else:
            stack.append(pool)
        self._entered += 1

    def _exit_pool(self, pool_id: PoolId, ident: int) -> None:
        """Thread ``ident`` leaves its innermost ``use_mem_pool``, which must be ``pool_id``'s
        (the caller may be another thread: a generator suspended in the block, closed there)."""
        if self._pending:
            self._drain()
        stack = self._thread_pools.get(ident)
        if not stack or stack[-1].id != pool_id:
            inner = tuple(stack[-1].id) if stack else None
            raise RuntimeError(
                f"use_mem_pool of {tuple(pool_id)} exited, but its thread's innermost pool on device "
                f"{self.device.index} is {inner}: contexts must exit in the reverse order of entry"
            )
        pool = stack.pop()
        if not stack:
            del self._thread_pools[ident]
        self._entered -= 1
        self._drop_use(pool)

    def _abandon_entry(self, pool_id: PoolId | None, ident: int) -> None:
        """End thread ``ident``'s innermost entry into ``pool_id``, wherever it is in the thread's
        stack (its block was left without ``__exit__``); nothing if there is none. ``pool_id``
        None: every entry of the thread (it is gone), innermost first."""
        stack = self._thread_pools.get(ident)
        if not stack:
            return
        if pool_id is None:
            while stack:  # one at a time: a call out that raises leaves the rest counted
                pool = stack.pop()
                if not stack:
                    del self._thread_pools[ident]
                self._entered -= 1
                self._drop_use(pool)
            return
        for i in range(len(stack) - 1, -1, -1):
            if stack[i].id == pool_id:
                pool = stack.pop(i)
                if not stack:
                    del self._thread_pools[ident]
                self._entered -= 1
                self._drop_use(pool)
                return

    def _entered_pool(self) -> PrivatePool | None:
        """The pool the calling thread's eager allocations go to (``use_mem_pool``), if any."""
        stack = self._thread_pools.get(threading.get_ident())
        return stack[-1] if stack else None

    def _drop_mempool(self, pool_id: PoolId) -> None:
        """The MemPool of ``pool_id`` is gone: its own use of this device's pool ends. The pool
        goes once nothing else uses it and its segments are back (``_drop_use``)."""
        pool = self._pools.get(pool_id)
        if pool is not None and pool.held:
            pool.held = False
            self._drop_use(pool)

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

    def _end_capture(self, rec: CaptureRecord) -> None:
        if self._pending:
            self._drain()  # frees queued during the capture still count as made during it
        if not rec.active:
            return
        rec.outputs = self._outputs(rec)  # first: _stop_routing ends with calls out
        for head in rec.created:  # the graph lives: its segments stay with the pool
            if head.returns_with is rec:
                self._set_returns_with(head, None)
        rec.created = []
        self._stop_routing(rec)

    def _outputs(self, rec: CaptureRecord) -> list[tuple[Block, int]]:
        """The blocks ``rec`` allocated that are still allocated, with their serials, in
        allocation order (a walk of its pool's segments: malloc marks them ``allocated_in``)."""
        found = [
            (b.serial, b)
            for head in self._segments.values()
            if head.free_list.private_pool is rec.pool
            for b in iter_segment(head)
            if b.allocated and b.allocated_in is rec
        ]
        found.sort(key=lambda pair: pair[0])
        return [(b, serial) for serial, b in found]

    def _abort_capture(self, rec: CaptureRecord) -> None:
        if self._pending:
            self._drain()
        rec.failed = True
        self._stop_and_release(rec)

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
        if logs.enabled(logging.DEBUG):
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
        if not self._capturing:
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
                if logs.enabled(logging.DEBUG):
                    self._log_pool("released", pool)
            else:
                self._freeable[pool.id] = pool

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
                if s != LEGACY and not self._query(s):
                    continue
                status, cid = self.device.capture_info(s)
            except GraphpoolError:
                if s == LEGACY:
                    capturing = True
                continue
            if status == CAPTURE_STATUS_NONE:
                continue
            capturing = True
            if status == CAPTURE_STATUS_ACTIVE and cid not in self._captures and cid not in self._dead:
                self._register_foreign(s, cid, None, "", False)
        return capturing

    def _adopt_users(self, block: Block) -> None:
        """Adopt the unseen captures the extra user streams of ``block`` capture in (see
        ``_free_held``), whether or not other captures are underway.

        No sweep: a free queued during a capture begun outside and carried out after its end
        still counts as made during it. A stream with such a capture registered is not asked
        (it is known; if it ended and the stream captures anew, the next sweep or allocation
        on it finds that)."""
        self._streams_capturing(block.stream_uses or set())

    def _captures_for_free(self, block: Block) -> tuple[CaptureRecord, ...]:
        """The captures a free made now keeps ``block`` for. O(underway captures).

        A block of a pool that an underway capture allocates from goes back to that pool
        (the latest such capture's): it is handed out again only to captures into that pool,
        and reusing it is what pool sharing is for. A block of a MemPool's eager side is not
        such a block: eager code takes it again. Nothing else is provably out of reach of
        the underway captures: graphpool cannot see which addresses a captured kernel
        touches, and any live block's address may be handed to one, whichever stream or
        thread allocated it and whenever (before the capture began or during it). So every
        other block, whoever drops it (a worker thread, a garbage-collection pass), is kept
        for the graph of every underway capture (the cupy#9655 rule).
        """
        owner = block.free_list.private_pool
        caps = self._captures
        if owner is not None and not block.free_list.eager:  # (a MemPool's eager block: as any)
            found: CaptureRecord | None = None
            for r in caps.values():
                if r.pool is owner:
                    found = r  # the latest begun
            if found is not None:
                return (found,)
        return tuple(caps.values())

    @staticmethod
    def _set_returns_with(head: Block, rec: CaptureRecord | None) -> None:
        """Name the capture segment ``head`` goes back with (None: it stays with its pool);
        keeps the pool's ``returnable`` set and the records' ``returnable_count`` in step."""
        old = head.returns_with
        if old is rec:
            return
        pool = head.free_list.private_pool
        assert pool is not None, "only a private pool's segments go back with captures"
        if old is not None:
            old.returnable_count -= 1
        head.returns_with = rec
        if rec is None:
            pool.returnable.discard(head)
        else:
            rec.returnable_count += 1
            rec.created.append(head)
            pool.returnable.add(head)

    @staticmethod
    def _touch(block: Block, rec: CaptureRecord) -> None:
        """Capture ``rec`` uses ``block``: its segment no longer goes back with the capture that
        made it, or, if that capture failed, it goes back with ``rec`` instead (see
        Block.returns_with). Called only while the pool has such segments; walks the segment to
        its head (O(blocks in the segment))."""
        head = block
        while head.prev is not None:
            head = head.prev
        creator = head.returns_with
        if creator is not None and creator is not rec:
            # the failed capture is gone: the segment goes back with rec now; else two
            # captures use it and it stays whatever either does
            Captures._set_returns_with(head, rec if creator.failed else None)

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

    def _log_capture(self, what: str, rec: CaptureRecord) -> None:
        """Log a capture's begin or end (DEBUG; the caller checked the level)."""
        logs.log.debug(
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
        logs.log.debug("device %d: private pool %s %s", self.device.index, tuple(pool.id), what)

"""CUDA graphs: CUDAGraph, the ``graph`` context, pool handles and the replay checker.

A graph captures into a private pool (its own, or a shared one given by ``pool=``).
The allocator keeps a ``CaptureRecord`` for it until ``reset()`` or collection; the
record says what the capture wrote, read and kept, which is what the replay checker
(``set_replay_checks``) reasons about. With checks "off" (the default) a replay is one
string comparison plus the launch.
"""

from __future__ import annotations

import bisect
import gc
import itertools
import threading
import weakref
from collections.abc import Iterable
from typing import Any

from graphpool import _warnings, pinned, runtime
from graphpool.device.protocol import (
    CAPTURE_MODE_RELAXED,
    CAPTURE_MODES,
    CAPTURE_STATUS_NONE,
    LEGACY_STREAM,
    Device,
)
from graphpool.errors import CaptureError, GraphpoolError, ReplayHazardError
from graphpool.memory import current_entry, empty_cache
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.block import Block
from graphpool.policy.private_pools import (
    CaptureRecord,
    PoolId,
    new_graph_pool_id,
    new_shared_pool_id,
)
from graphpool.streams import (
    Event,
    Stream,
    StreamLike,
    as_stream,
    current_stream,
    record_listeners,
    stream,
    sync_listeners,
    synchronize,
    wait_listeners,
)

_labels = itertools.count(1)


def _instantiate(dev: Device, graph: int) -> int:
    """``dev.instantiate(graph)`` under the relaxed capture mode: instantiation is "unsafe"
    while another capture is underway (another thread's in global mode, or an enclosing one
    on this thread), as in CUDA."""
    prev = dev.exchange_capture_mode(CAPTURE_MODE_RELAXED)
    try:
        return dev.instantiate(graph)
    finally:
        dev.exchange_capture_mode(prev)


def graph_pool_handle() -> PoolId:
    """A new pool id ``(0, n)`` that several graphs can pass as ``pool=`` to share memory."""
    return new_shared_pool_id()


class CUDAGraph:
    """A captured sequence of device work that replays on the same addresses.

    ``keep_graph`` is PyTorch's argument and means what it does there: False (the default),
    ``capture_end()`` instantiates the graph; True, it does not: ``instantiate()`` does (the
    first ``replay()`` too, if it was not called), and ``raw_cuda_graph()`` gives the captured
    graph's handle, to inspect or change it before the instantiation.
    """

    def __init__(self, keep_graph: bool = False) -> None:
        if not isinstance(keep_graph, bool):
            raise TypeError(f"keep_graph must be True or False, not {keep_graph!r}")
        self.keep_graph = keep_graph
        self.label = f"graph#{next(_labels)}"
        self._rec: CaptureRecord | None = None
        self._alloc: CachingAllocator | None = None
        self._stream: Stream | None = None
        self._graph: int | None = None
        self._exec: int | None = None
        self._capturing = False
        self._in_block = False  # a `with gp.graph(self)` block owns the capture underway
        self._dev: Device | None = None
        self._replay_streams: set[int] = set()
        self._checked = -1  # runtime.generation() when replay last checked the backend
        # replay-checker state (only touched while checks are on)
        self._last_tick = -1
        self._last_stream: Stream | None = None
        self._last_mark = 0
        self._done_event: Event | None = None
        self._event_stale = False  # replayed since _done_event was last recorded (alone in its pool)
        self._mates: Mates | None = None  # the graphs of its pool, itself included
        self._pool_key: tuple[int, PoolId] | None = None  # (device, pool id) while registered
        self._plan: _Plan | None = None  # what its replays check (Note [Replay plans])
        self._extent: tuple[CaptureRecord, tuple[list[int], list[int]]] | None = None  # (_extent)

    # ------------------------------------------------------------ capture
    def capture_begin(
        self, pool: PoolId | tuple[int, int] | None = None, capture_error_mode: str = "global"
    ) -> None:
        """Begin capturing the current stream into this graph's private pool (or ``pool``)."""
        mode = CAPTURE_MODES.get(capture_error_mode) if isinstance(capture_error_mode, str) else None
        if mode is None:
            raise ValueError(
                f"capture_error_mode must be one of {', '.join(CAPTURE_MODES)}, not {capture_error_mode!r}"
            )
        if self._capturing or self._exec is not None or self._graph is not None:
            raise CaptureError(f"{self.label} already holds a capture; call reset() before capturing again")
        s = current_stream()
        if s.handle == LEGACY_STREAM:
            raise CaptureError(
                "CUDA graphs must be captured on a non-default stream: "
                "run the capture inside `with gp.stream(gp.Stream()):` or use gp.graph(...)"
            )
        pid = new_graph_pool_id() if pool is None else PoolId.coerce(pool)
        rt = runtime.get()
        dev = rt.device(s.device)
        alloc = rt.allocator(s.device)

        def begin() -> int:
            dev.begin_capture(s.handle, mode)
            try:
                return dev.capture_info(s.handle)[1]
            except BaseException:
                dev.end_capture(s.handle)
                raise

        # Record every allocation's footprint: the replay checker may be turned on after this
        # capture and still needs it then. (Captures begun outside graphpool record none:
        # the checker never checks them, and the record would cost each of their allocations.)
        self._rec = alloc.begin_capture(pid, begin, stream=s.handle, label=self.label, footprint=True)
        self._alloc = alloc
        self._stream = s
        self._capturing = True
        pinned.capture_begun(s.device, s.handle)  # pinned buffers freed during it: kept for it

    def capture_end(self) -> None:
        """End the capture on the stream that began it and make the graph replayable."""
        if not self._capturing:
            raise CaptureError(f"{self.label}: capture_end() without a capture_begin()")
        assert self._stream is not None and self._rec is not None and self._alloc is not None
        s = current_stream(self._stream.device)
        if s != self._stream:
            raise CaptureError(
                f"{self.label}: capture_end() must run on the stream that began the capture "
                f"({self._stream!r}), but the current stream is {s!r}"
            )
        dev = runtime.get().device(s.device)
        try:
            graph = dev.end_capture(s.handle)
        except GraphpoolError as exc:
            if dev.capture_info(s.handle)[0] != CAPTURE_STATUS_NONE:
                # refused without ending (e.g. another thread than the capturing one)
                raise CaptureError(
                    f"{self.label}: capture_end() was refused and the capture goes on ({exc}); "
                    "end it from the thread that began it"
                ) from exc
            self._abort()
            raise CaptureError(
                f"{self.label}: the capture failed and was discarded ({exc}). A call that is not "
                "allowed during capture (synchronize, event query, device allocation) invalidates it; "
                "capture_error_mode='thread_local' or 'relaxed' allows some of them."
            ) from exc
        graph_exec = None
        if not self.keep_graph:
            try:
                graph_exec = _instantiate(dev, graph)
            except BaseException:
                dev.destroy_graph(graph)
                self._abort()
                raise
        self._alloc.end_capture(self._rec)
        pinned.capture_ended(s.device, s.handle)
        self._graph, self._exec = graph, graph_exec
        self._dev = dev
        self._replay_streams = self._rec.replay_streams
        self._capturing = False
        _register(self)
        if dev.graph_node_count(graph) == 0:
            _warnings.warn(
                f"{self.label} captured no work: was the work queued on another stream than the "
                "capturing one?",
                UserWarning,
            )

    def _abort(self) -> None:
        """Drop a capture that will never replay; the allocator gets everything back."""
        rec, alloc = self._rec, self._alloc
        if self._stream is not None:
            pinned.capture_ended(self._stream.device, self._stream.handle)
        self._rec = self._alloc = None
        self._stream = None
        self._capturing = False
        if rec is not None and alloc is not None:
            alloc.abort_capture(rec)

    def _abandon(self) -> None:
        """End an underway capture after an exception in its body and discard it."""
        if not self._capturing:
            return
        assert self._stream is not None and self._alloc is not None
        dev = self._alloc.device  # the device it captures on, whatever backend is current
        try:
            dev.destroy_graph(dev.end_capture(self._stream.handle))
        except GraphpoolError:
            pass  # the capture was invalidated; the stream has left capture mode all the same
        self._abort()

    def instantiate(self) -> None:
        """Make the captured graph launchable (PyTorch's ``instantiate``): for a graph made
        with ``keep_graph=True``, after ``capture_end()``; called again, it instantiates the
        graph anew (after a change through ``raw_cuda_graph()``). ``capture_end()`` does it
        for the others (CaptureError here)."""
        graph, dev = self._graph, self._dev
        if self._capturing or graph is None or dev is None:
            raise CaptureError(f"{self.label}: instantiate() needs a successful capture first")
        if not self.keep_graph:
            raise CaptureError(
                f"{self.label}: instantiate() is for graphs made with keep_graph=True; capture_end() "
                "instantiated this one"
            )
        old, self._exec = self._exec, None
        if old is not None:
            dev.destroy_graph_exec(old)
        self._exec = _instantiate(dev, graph)

    def raw_cuda_graph(self) -> int:
        """The captured graph's handle (``cudaGraph_t``; PyTorch's ``raw_cuda_graph``): only
        for a graph made with ``keep_graph=True``, after ``capture_end()``. graphpool destroys
        it at ``reset()`` or collection."""
        if not self.keep_graph:
            raise CaptureError(f"{self.label}: raw_cuda_graph() needs CUDAGraph(keep_graph=True)")
        if self._capturing or self._graph is None:
            raise CaptureError(f"{self.label}: raw_cuda_graph() needs a successful capture first")
        return self._graph

    # ------------------------------------------------------------- replay
    def replay(self) -> None:
        """Launch the graph on the current stream (any stream of its device)."""
        exe = self._exec
        if exe is not None:
            # The fast path: the thread's current stream as gp.alloc keeps it (one generation
            # test), and no backend check while no set_backend ran since the last replay's.
            s = current_entry().stream
            own = self._stream
            if own is not None and s.device == own.device and self._checked == runtime.generation():
                dev = self._dev
                assert dev is not None
                checks = _checks
                if checks == "off":
                    dev.launch(exe, s.handle)
                    self._replay_streams.add(s.handle)
                    return
                mates = self._mates
                if mates is None or len(mates) < 2:
                    # every check is about pool mates: only the replay's order is noted
                    dev.launch(exe, s.handle)
                    self._replay_streams.add(s.handle)
                    _note_alone(self, s)
                    if s._source is not None:
                        _mark_done(self)  # another library's stream: see _note_alone
                    return
                _check_replay(self, s)
                dev.launch(exe, s.handle)
                self._replay_streams.add(s.handle)
                _note_replay(self, s)
                return
        self._replay_slow()

    def _replay_slow(self) -> None:
        """``replay`` when the fast path does not apply: the checks, the checker, the lookup."""
        exe = self._exec
        if exe is None:
            if self.keep_graph and self._graph is not None and not self._capturing:
                self.instantiate()  # keep_graph=True and not instantiated yet, as PyTorch
                exe = self._exec
            if exe is None:
                raise CaptureError(
                    f"{self.label}: replay() needs a successful capture first "
                    "(capture_begin()/capture_end() or `with gp.graph(g):`)"
                )
        assert self._stream is not None and self._dev is not None
        generation = runtime.generation()  # read first: a set_backend from now on moves it
        self._stream._check_backend()  # a graph of a replaced backend: a clear error
        self._checked = generation
        index = self._stream.device
        s = runtime.thread_state().streams.get(index)
        if s is None:
            s = current_stream(index)
        if _checks != "off":
            _check_replay(self, s)
        self._dev.launch(exe, s.handle)
        self._replay_streams.add(s.handle)
        if _checks != "off":
            _note_replay(self, s)

    def reset(self) -> None:
        """Forget the capture; the pool's memory becomes reusable once nothing else uses it.

        The graph objects are destroyed on the device the graph was captured on, whatever
        backend is in use now; the allocator gets its record back even if that fails. During
        a capture begun with ``capture_begin()`` it ends and discards the capture; inside a
        ``with gp.graph(g):`` block it is refused (CaptureError): the block ends the capture
        (raise in its body to discard it), then ``reset()`` may follow.
        """
        if self._capturing:
            if self._in_block:
                raise CaptureError(
                    f"{self.label}: reset() inside `with gp.graph(...)`: the block ends the capture "
                    "when it is left (raise an exception in its body to discard it); reset() after it"
                )
            self._abandon()
            return
        rec, alloc = self._rec, self._alloc
        if rec is None or alloc is None:
            return
        dev = alloc.device
        handles = ((self._exec, dev.destroy_graph_exec), (self._graph, dev.destroy_graph))
        self._exec = self._graph = None
        self._rec = self._alloc = None
        self._stream = None
        _unregister(self, rec)
        try:
            for handle, destroy in handles:
                if handle is not None:
                    destroy(handle)
        finally:
            alloc.release_capture(rec)

    def pool(self) -> PoolId:
        """The id of the pool this graph captured into (share it with ``pool=``)."""
        if self._rec is None or self._capturing:
            raise CaptureError(f"{self.label}: pool() needs a successful capture first")
        return self._rec.pool.id

    def __del__(self) -> None:
        try:
            rec, alloc = self._rec, self._alloc
        except AttributeError:  # __init__ refused its arguments or never ran: nothing is owned
            return
        if rec is None or alloc is None:
            return
        try:
            if self._capturing and rec.active and self._stream is not None:
                # Collected mid-capture: end the capture now if this thread may (the one that
                # began it, or any in relaxed mode), so the stream is usable at once; the
                # allocator discards the graph at its next call. A device call, not a lock.
                try:
                    rec.handles.append(("graph", alloc.device.end_capture(self._stream.handle)))
                except Exception:
                    pass  # another thread's capture, or invalidated: the allocator handles it
            if self._exec is not None:
                rec.handles.append(("exec", self._exec))
            if self._graph is not None:
                rec.handles.append(("graph", self._graph))
            alloc.defer_release(rec)
        except Exception:  # finalizers never raise
            pass

    def __repr__(self) -> str:
        state = "capturing" if self._capturing else ("captured" if self._graph is not None else "empty")
        return f"<graphpool.CUDAGraph {self.label} {state}>"

    def __copy__(self) -> CUDAGraph:
        """Refused: a copy would share the graph's CUDA handles and destroy them when collected."""
        raise TypeError(
            f"a graphpool CUDAGraph ({self.label}) cannot be copied: it owns its captured CUDA graph "
            "and private pool. Capture a new CUDAGraph instead."
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> CUDAGraph:
        """Refused, as ``__copy__``: CUDA graphs are cloned by capturing again."""
        return self.__copy__()

    def __reduce__(self) -> Any:
        """Refused: a captured graph is device state of this process."""
        raise TypeError(
            f"a graphpool CUDAGraph ({self.label}) cannot be pickled: it is device state of this "
            "process. Capture it again where it is needed."
        )


class _SideStreams(threading.local):
    """Each thread's side stream per (runtime generation, device): gp.graph's default stream."""

    def __init__(self) -> None:
        self.by_device: dict[tuple[int, int], Stream] = {}


_side = _SideStreams()


def _side_stream(index: int) -> Stream:
    """This thread's side stream of device ``index``, or a new one while it is capturing
    (a ``gp.graph`` nested in another on the same thread)."""
    rt = runtime.get()
    key = (rt.generation, index)
    s = _side.by_device.get(key)
    if s is None:
        s = _side.by_device[key] = Stream(index)
    elif rt.device(index).capture_id(s.handle):
        return Stream(index)
    return s


class graph:
    """Context manager that captures its body into ``cuda_graph``.

    On entry, when no capture is underway anywhere in the process: synchronize,
    ``gc.collect()`` and ``empty_cache()`` (so the capture starts from a clean cache).
    While another capture is underway (another thread's, or an enclosing ``gp.graph``)
    those steps are skipped: each would break the other capture (CUDA's capture rules are
    process-wide). Then switch to ``stream`` (or this thread's side stream) and begin
    capture. On exit the capture always ends; if the body raised, the capture is
    discarded and the exception propagates.
    """

    def __init__(
        self,
        cuda_graph: CUDAGraph,
        pool: Any = None,
        stream: StreamLike | None = None,
        capture_error_mode: str = "global",
    ) -> None:
        if not isinstance(cuda_graph, CUDAGraph):
            raise TypeError(f"gp.graph needs a CUDAGraph, not {type(cuda_graph).__name__}")
        self.cuda_graph = cuda_graph
        self.pool = pool
        # another library's stream (__cuda_stream__) of the current device is taken too
        self.stream = None if stream is None else as_stream(stream, "gp.graph")
        self.mode = capture_error_mode
        self._ctx: Any = None

    def __enter__(self) -> CUDAGraph:
        rt = runtime.get()
        if not rt.world.active:
            synchronize()
            gc.collect()
            if not rt.world.active:  # a finalizer run by the collection may not start one, but check
                empty_cache()
        s = self.stream
        if s is None:
            s = _side_stream(runtime.thread_state().device)
        self._ctx = stream(s)
        self._ctx.__enter__()
        try:
            self.cuda_graph.capture_begin(self.pool, capture_error_mode=self.mode)
        except BaseException:
            self._ctx.__exit__(None, None, None)
            raise
        self.cuda_graph._in_block = True
        return self.cuda_graph

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.cuda_graph._in_block = False
        try:
            if exc_type is None:
                self.cuda_graph.capture_end()
            else:
                self.cuda_graph._abandon()
        finally:
            self._ctx.__exit__(None, None, None)


# ------------------------------------------------------------ replay checker
_checks = "off"
_checks_lock = threading.Lock()
_tick = itertools.count(1)
_versions = itertools.count(1)


class Mates(dict[int, "weakref.ref[CUDAGraph]"]):
    """The graphs of one pool: ``id(graph)`` -> a weak reference that drops its entry when the
    graph is collected (a dict, not a WeakSet: a replay reads it, and a WeakSet's iteration
    guard costs more than the checks). ``version`` changes whenever a graph joins or leaves:
    a replay plan made at another version is stale (Note [Replay plans])."""

    __slots__ = ("version",)

    def __init__(self) -> None:
        super().__init__()
        self.version = next(_versions)


_by_pool: dict[tuple[int, PoolId], Mates] = {}
_streams_of: set[tuple[int, PoolId]] = set()
"""The pools whose graphs have replayed on two streams or more: from then on each replay of
theirs records an event (its mates on other streams may have to wait for it). A pool whose
graphs all replay on one stream needs none: stream order settles every question."""
_clocks: dict[tuple[int, int], dict[tuple[int, int], int]] = {}
_host: dict[tuple[int, int], int] = {}
"""Per stream, the last replay mark the host is known to have waited for (``note_sync``): a
mate's replay at or below it is finished, whatever its done event says (a late event may
stand behind later work on its stream)."""


def set_replay_checks(mode: str) -> None:
    """Turn the replay hazard checker "off", or make it "warn" or "raise".

    See docs/behaviour.rst, "Replay safety", for what it reports."""
    global _checks
    if mode not in ("off", "warn", "raise"):
        raise ValueError(f"replay checks are 'off', 'warn' or 'raise', not {mode!r}")
    _checks = mode


def replay_checks() -> str:
    """The checker's mode."""
    return _checks


def _key(g: CUDAGraph) -> tuple[int, PoolId]:
    assert g._rec is not None and g._stream is not None
    return (g._stream.device, g._rec.pool.id)


_sweep_at = 64
"""``_register`` drops the pools whose graphs are all gone (collected, not reset) when
``_by_pool`` reaches this many entries, then doubles it: amortized, no pool is kept for long."""


def _register(g: CUDAGraph) -> None:
    global _sweep_at
    with _checks_lock:
        if len(_by_pool) >= _sweep_at:
            for k in [k for k, v in _by_pool.items() if not v]:
                del _by_pool[k]
                _streams_of.discard(k)
            _sweep_at = max(64, 2 * len(_by_pool))
        key = _key(g)
        mates = _by_pool.get(key)
        if mates is None:
            mates = _by_pool[key] = Mates()
        ident = id(g)

        def gone(ref: weakref.ref[CUDAGraph], mates: Mates = mates, ident: int = ident) -> None:
            # No lock: a collection may run this on a thread that holds _checks_lock.
            if mates.get(ident) is ref:  # (the id may name a later graph by then)
                del mates[ident]
                mates.version = next(_versions)

        mates[ident] = weakref.ref(g, gone)
        mates.version = next(_versions)
        g._mates = mates
        g._pool_key = key


def _unregister(g: CUDAGraph, rec: CaptureRecord) -> None:
    with _checks_lock:
        mates, key = g._mates, g._pool_key
        g._mates = g._pool_key = None
        g._plan = g._extent = None
        if mates is not None and key is not None:
            ref = mates.get(id(g))
            if ref is not None and ref() is g:
                del mates[id(g)]
                mates.version = next(_versions)
            if not mates and _by_pool.get(key) is mates:  # (a pool id is never reused)
                del _by_pool[key]
                _streams_of.discard(key)


def note_record(event: Event, s: Stream) -> None:
    """Remember what ``s`` had done when ``event`` was recorded (for the checker's ordering)."""
    if _checks != "off":
        event.clock = dict(_clocks.get((s.device, s.handle), {}))


def note_wait(s: Stream, event: Event) -> None:
    """``s`` now runs after everything ``event`` marks."""
    if _checks != "off" and event.clock:
        mine = _clocks.setdefault((s.device, s.handle), {})
        for k, v in event.clock.items():
            if mine.get(k, 0) < v:
                mine[k] = v


def note_sync(device: int, handle: int | None, event: Event | None) -> None:
    """The host waited for stream ``handle`` of ``device`` (every stream of it: None), or for
    ``event``: the replays noted there so far are finished (``_host``)."""
    if _checks == "off":
        return
    if event is not None:
        done: Iterable[tuple[tuple[int, int], int]] = (getattr(event, "clock", None) or {}).items()
    elif handle is not None:
        k = (device, handle)
        done = ((k, _clocks.get(k, {}).get(k, 0)),)
    else:
        done = tuple((k, c.get(k, 0)) for k, c in _clocks.items() if k[0] == device)
    for k, mark in done:
        if mark and _host.get(k, 0) < mark:
            _host[k] = mark


def _overlaps(a: Iterable[tuple[int, int]] | None, b_ptr: int, b_size: int) -> tuple[int, int] | None:
    """The first allocation of footprint ``a`` (None: not recorded) that meets the range."""
    for ptr, size in a or ():
        if ptr < b_ptr + b_size and b_ptr < ptr + size:
            return ptr, size
    return None


def _extent(g: CUDAGraph) -> tuple[list[int], list[int]]:
    """``g``'s footprint as sorted, disjoint ranges (starts, ends), made once per capture:
    whether a range meets the footprint is then a bisection (``_meets``). Ranges are merged
    only where they overlap, not where they touch: the answer is exactly whether an
    allocation of the footprint meets the range. (Kept with its record, which another thread
    may reset meanwhile: a graph without one has an empty footprint.)"""
    rec = g._rec
    kept = g._extent
    if kept is not None and kept[0] is rec:
        return kept[1]
    starts: list[int] = []
    ends: list[int] = []
    if rec is None:
        return starts, ends
    for ptr, size in sorted(rec.written or ()):
        end = ptr + size
        if ends and ptr < ends[-1]:
            if end > ends[-1]:
                ends[-1] = end
        else:
            starts.append(ptr)
            ends.append(end)
    g._extent = (rec, (starts, ends))
    return starts, ends


def _meets(ext: tuple[list[int], list[int]], ptr: int, size: int) -> bool:
    """Whether the range ``[ptr, ptr + size)`` meets an allocation of the footprint ``ext``."""
    starts, ends = ext
    i = bisect.bisect_right(ends, ptr)  # the first range that ends after ptr
    return i < len(ends) and starts[i] < ptr + size


# Note [Replay plans]
# ~~~~~~~~~~~~~~~~~~~
# What the checks compare is fixed once the graphs have captured: the footprints (``written``),
# inputs and outputs of a CaptureRecord never change after capture_end, and pool mates come and
# go only through _register, _unregister and their collection, each of which moves their Mates'
# ``version``. So a graph's first checked replay at a new version works out which pairs of
# footprints meet (_Plan, _plan) and keeps it on the graph; every replay until the next version
# runs only what changes between replays: the order of the last replays (ticks), whether an
# output or input is still the same allocation (``allocated`` and ``serial``), and whether a
# mate on another stream is done (_finished), asked only of the mates whose footprints meet.
# A replay costs O(mates + inputs + the overlapping outputs), not O(footprint x footprint).
#
# A plan names mates by their weak references, never the graphs: a dropped graph is collected
# at once and gives its pool memory back; until the plan is made again, its dead reference is
# skipped (a collected graph is no mate). Replays read plans without _checks_lock (which
# guards registration): a plan takes its version before it reads the mates, so a change
# during its making leaves it stale (made again at the next replay), never wrong, and the
# graph's ``_plan`` is one attribute store. Versions come from one counter: never reused.
# An output's range is read when the plan is made, if it is still the same allocation (its
# serial): an allocation keeps its range, and a block handed out again gets a new serial.


class _Plan:
    """The static part of ``_check_replay`` for one graph at one version of its pool mates
    (Note [Replay plans]); each entry names a mate by its weak reference."""

    __slots__ = ("version", "others", "meets", "inputs", "clobbers", "quiet")

    def __init__(self, version: int) -> None:
        self.version = version
        # every other mate, in the pool's order (the late events)
        self.others: list[weakref.ref[CUDAGraph]] = []
        # check 1: the mates whose footprint meets this graph's, with the first shared allocation
        self.meets: list[tuple[weakref.ref[CUDAGraph], int, int]] = []
        # check 2: (ptr, size, block, serial, producer, the other mates that write the range)
        self.inputs: list[
            tuple[int, int, Block, int, weakref.ref[CUDAGraph], tuple[weakref.ref[CUDAGraph], ...]]
        ] = []
        # check 3: the mates with outputs in this graph's footprint, and those outputs
        self.clobbers: list[tuple[weakref.ref[CUDAGraph], tuple[tuple[Block, int], ...]]] = []
        self.quiet = True  # none of the three: a replay only catches up with late events


def _plan(g: CUDAGraph, mates: Mates) -> _Plan:
    """Make (and keep on ``g``) ``g``'s replay plan for the present mates (Note [Replay plans])."""
    rec = g._rec
    assert rec is not None
    plan = _Plan(mates.version)  # the version first: a change from here on makes it stale
    found = [
        (r, h, hrec)
        for r in tuple(mates.values())  # (C-level copy: weakref callbacks edit it)
        if (h := r()) is not None and h is not g and (hrec := h._rec) is not None
    ]
    mine = _extent(g)
    for r, _, hrec in found:
        plan.others.append(r)
        for ptr, size in hrec.written or ():
            if _meets(mine, ptr, size):
                hit = _overlaps(rec.written, ptr, size)
                assert hit is not None
                plan.meets.append((r, hit[0], hit[1]))
                break
        outs = tuple(
            (block, serial)
            for block, serial in hrec.outputs
            if block.serial == serial and _meets(mine, block.ptr, block.size)  # (later, never again)
        )
        if outs:
            plan.clobbers.append((r, outs))
    for ptr, size, producer, block, serial in rec.inputs:
        prod = next((r for r, _, hrec in found if hrec is producer), None)
        if prod is None:
            continue  # its producer is gone or reset: never checked again
        writers = tuple(r for r, h, _ in found if r is not prod and _meets(_extent(h), ptr, size))
        if writers:
            plan.inputs.append((ptr, size, block, serial, prod, writers))
    plan.quiet = not (plan.meets or plan.inputs or plan.clobbers)
    g._plan = plan
    return plan


def _finished(h: CUDAGraph, s: Stream) -> bool:
    """Whether ``h``'s last replay is known to be done or ordered before work on ``s``."""
    if h._last_stream is None or h._last_stream == s:
        return True
    seen = _clocks.get((s.device, s.handle), {})
    hk = (h._last_stream.device, h._last_stream.handle)
    if seen.get(hk, 0) >= h._last_mark or _host.get(hk, 0) >= h._last_mark:
        return True  # ordered before ``s``, or the host waited for it
    if h._event_stale and h._last_stream._source is None:
        return False  # its last replay has no event (its stream was capturing): may still run
    if h._done_event is None:
        return True
    dev = runtime.get().device(s.device)
    prev = dev.exchange_capture_mode(CAPTURE_MODE_RELAXED)
    try:
        return bool(dev.query_event(h._done_event.handle))
    finally:
        dev.exchange_capture_mode(prev)


def _report(message: str) -> None:
    if _checks == "raise":
        raise ReplayHazardError(message)
    _warnings.warn(message, RuntimeWarning)


def _check_replay(g: CUDAGraph, s: Stream) -> None:
    """Report the hazards of replaying ``g`` on ``s`` now (docs/behaviour.rst, "Replay safety")."""
    plan = g._plan
    mates = g._mates
    if plan is None or mates is None or plan.version != mates.version:
        if mates is None:
            return
        plan = _plan(g, mates)
    for r in plan.others:
        h = r()
        if h is not None and h._event_stale and h._last_stream is not s:
            _catch_up(g, h, s)
    if plan.quiet:
        return
    # 1. an overlapping replay of a pool mate on another stream
    for r, ptr, size in plan.meets:
        h = r()
        if h is not None and not _finished(h, s):
            _report(
                f"{g.label} replays on {s!r} while {h.label} (same pool {_pool_of(g)}) may still run "
                f"on {h._last_stream!r}; both use 0x{ptr:x} ({size} bytes) for temporaries. "
                f"Make {s!r} wait for {h._last_stream!r} first (stream.wait_stream), "
                "or capture them into separate pools."
            )
    # 2. an input this graph read at capture was overwritten since its producer's last replay
    for ptr, size, block, serial, pr, writers in plan.inputs:
        if block.allocated and block.serial == serial:
            continue  # still the same allocation: no later capture can have been handed it
        prod = pr()
        if prod is None:
            continue
        for r in writers:
            h = r()
            if h is not None and h._last_tick > prod._last_tick:
                _report(
                    f"{g.label} reads 0x{ptr:x} ({size} bytes), made by {prod.label}, but {h.label} "
                    f"(same pool {_pool_of(g)}) overwrote it when it replayed after {prod.label}. "
                    f"Replay the graphs of pool {_pool_of(g)} in capture order, or give them "
                    "separate pools."
                )
                break
    # 3. this replay overwrites a still-referenced output of a graph that replayed after this
    # one last did: out of capture order, or in order around the cycle (g0, g1, g0), where
    # g1's output may live in a temporary of g0 (docs/behaviour.rst, "Replay safety")
    tick = g._last_tick
    for r, outs in plan.clobbers:
        h = r()
        if h is None or h._last_tick <= tick:
            continue
        for block, serial in outs:
            if block.allocated and block.serial == serial:
                _report(
                    f"{g.label} replays after {h.label} and overwrites 0x{block.ptr:x} "
                    f"({block.size} bytes), an output of {h.label} that is still referenced "
                    f"(pool {_pool_of(g)}: {h.label} was handed memory {g.label} uses). Copy or "
                    f"drop that output before replaying {g.label}, or capture into separate pools."
                )
                return


def _catch_up(g: CUDAGraph, h: CUDAGraph, s: Stream) -> None:
    """``h``, a mate of ``g``, replayed last without recording its done event: if that was on
    another stream than ``s`` (graphpool's own), record it now, and from now on record one at
    each replay of the pool's graphs (``_streams_of``; see ``_note_alone``)."""
    hs = h._last_stream
    if hs is not None and hs != s and hs._source is None:  # (another stream object may be s)
        key = _key(g)
        if key not in _streams_of:
            with _checks_lock:
                _streams_of.add(key)
        _mark_done(h)


def _pool_of(g: CUDAGraph) -> tuple[int, ...]:
    """``g``'s pool id as the checker's messages print it."""
    assert g._rec is not None
    return tuple(g._rec.pool.id)


def _note_alone(g: CUDAGraph, s: Stream) -> None:
    """Note a replay of ``g`` on ``s`` in the checker's order, without recording its event.

    Only a pool mate replaying on another stream ever asks whether ``g``'s replay is
    finished. While ``g`` has no mate, or its pool's graphs all replay on one stream, none
    does; the pool's first replay on a second stream records the event then (``_mark_done``,
    from ``_check_replay``). That event is later than the replay, so until the work queued on
    ``s`` before then finishes, that mate is told ``g`` may still run: late, never early.

    Only for streams whose handles outlive any use here: graphpool's own (never destroyed)
    and the legacy stream. Another library's stream may be destroyed (cuda.core's ``close()``)
    before a mate asks, and an event recorded on a destroyed handle can crash the driver; a
    replay on one records its event at once (``_mark_done``), as every replay did before.
    """
    g._last_tick = next(_tick)
    k = (s.device, s.handle)
    clock = _clocks.setdefault(k, {})
    mark = clock.get(k, 0) + 1
    clock[k] = mark
    g._last_mark = mark
    g._last_stream = s
    g._event_stale = True


def _note_replay(g: CUDAGraph, s: Stream) -> None:
    _note_alone(g, s)
    if g._pool_key in _streams_of or s._source is not None:
        _mark_done(g)


def _mark_done(g: CUDAGraph) -> None:
    """Record ``g``'s done event on the stream of its last replay (after that replay)."""
    s = g._last_stream
    assert s is not None
    if g._done_event is None:
        g._done_event = Event(s.device)
    dev = runtime.get().device(s.device)
    # A replay launched into a capture runs nothing now; an event recorded there would become
    # part of the capture, and CUDA refuses to query it afterwards (the checker would raise at
    # every later replay of a pool mate). The event keeps marking the last eager replay.
    if s.handle == LEGACY_STREAM or not dev.capture_id(s.handle):
        dev.record_event(g._done_event.handle, s.handle)
        g._event_stale = False


# The checker hears about event records and waits from streams.py (which never imports us).
record_listeners.append(note_record)
wait_listeners.append(note_wait)
sync_listeners.append(note_sync)

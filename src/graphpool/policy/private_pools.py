"""Private pools for graph capture: ids, pools, and the record of one capture.

A ``PoolId`` is an immutable pair: ``(k, 0)`` for a graph that captured without a pool
(k counts graphs from 1), ``(0, n)`` from ``graph_pool_handle()`` or a ``MemPool`` (n
counts handles from 1). A ``PrivatePool`` owns its own small and large free lists; their
memory is only ever handed to captures routed to it, never to eager code.

Note [Pool objects: the graph side and the eager side]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A pool made for a ``MemPool`` (its ``PoolSpec`` registered in ``mempools``) has two more
free lists, ``eager_small`` and ``eager_large``: what this thread allocates inside
``use_mem_pool`` comes from there, and captures into the pool never take from there (nor
eager code from ``small``/``large``). Memory a graph may touch on replay (every block
handed to a capture into the pool, and each of its free blocks after the capture) is
therefore never handed to eager code, and an eager block stays out of every graph's
reach unless it is freed during a capture, when it is kept for the graph like any
ordinary block. The two sides share the pool's statistics, segment count, lifetime and
upstream; memory moves from one side to the other only through the upstream (a free
segment given back, a new one made).
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterator
from typing import Any, NamedTuple

from graphpool.policy.block import Block
from graphpool.policy.freelist import FreeList
from graphpool.policy.stats import PoolStats


class PoolId(NamedTuple):
    """Identifies a private pool. Exactly one part is non-zero."""

    graph: int
    handle: int

    @classmethod
    def coerce(cls, value: object) -> PoolId:
        """Accept a PoolId, a pair of ints, or a pool object (``MemPool``: its ``id``); raise
        ValueError/TypeError otherwise."""
        named = getattr(type(value), "_graphpool_pool", False)
        if named:
            value = getattr(value, "id", None)
        if isinstance(value, PoolId):
            pid = value
        elif isinstance(value, tuple) and len(value) == 2 and all(type(v) is int for v in value):
            pid = cls(value[0], value[1])
        else:
            raise TypeError(f"a pool id is a pair of ints such as g.pool() returns, not {value!r}")
        if pid.graph < 0 or pid.handle < 0 or (pid.graph == 0) == (pid.handle == 0):
            raise ValueError(f"invalid pool id {tuple(pid)}: exactly one part must be a positive int")
        return pid


_graph_ids = itertools.count(1)
_handle_ids = itertools.count(1)
_tokens = itertools.count(1)
_id_lock = threading.Lock()


def new_release_token() -> int:
    """A process-wide unique token for ``Device.attach_release`` (devices may share a queue)."""
    with _id_lock:
        return next(_tokens)


def new_graph_pool_id() -> PoolId:
    """The next ``(k, 0)`` id, for a graph that captures without a pool."""
    with _id_lock:
        return PoolId(next(_graph_ids), 0)


def new_shared_pool_id() -> PoolId:
    """The next ``(0, n)`` id, as ``graph_pool_handle()`` returns."""
    with _id_lock:
        return PoolId(0, next(_handle_ids))


class PoolExit(NamedTuple):
    """A ``use_mem_pool`` entry of thread ``ident`` into ``pool_id`` whose ``__exit__`` never ran
    (an exception between the block's end and the call): queued by its finalizer, ended by the
    allocator's next call (``CachingAllocator.defer_exit_pool``). ``pool_id`` None: every
    entry of the thread, which is gone (``CachingAllocator.defer_forget_thread``)."""

    pool_id: PoolId | None
    ident: int


class PoolSpec:
    """What a ``MemPool`` asks of its pool on every device: where its segments come from
    (``upstream``: None for the device's own memory, ``MANAGED`` for managed memory, or an
    object with ``malloc(nbytes, device, stream) -> int`` and ``free(ptr, nbytes, device,
    stream)``) and whether allocations outside the pool may take its free eager blocks when
    the device is full (``use_on_oom``). ``places``: the allocators that made its pool."""

    __slots__ = ("upstream", "use_on_oom", "places")

    def __init__(self, upstream: Any, use_on_oom: bool) -> None:
        self.upstream = upstream
        self.use_on_oom = use_on_oom
        # The allocators that made the pool (each counts the MemPool's use: ``PrivatePool.held``),
        # told when the MemPool goes.
        self.places: list[Any] = []


MANAGED: Any = "managed"
"""The built-in upstream of managed memory (``Device.malloc_managed``)."""

mempools: dict[PoolId, PoolSpec] = {}
"""The live MemPools' specs by pool id: an allocator that makes the pool of such an id (for
``use_mem_pool`` or a capture) makes it with the spec and counts the MemPool's own use.
Entries are added and removed whole by graphpool.mempool (under the GIL)."""


class CaptureWorld:
    """The captures underway on every allocator of one runtime.

    CUDA's capture rules are process-wide: while any device captures, no allocator may
    free device memory, synchronize or query events. Each allocator of a runtime shares
    one of these; ``active`` is the sum of their ``_capturing`` counts.
    """

    __slots__ = ("active",)

    def __init__(self) -> None:
        self.active = 0


class PrivatePool:
    """A graph pool: its free lists, how many graphs use it, how many segments it holds.

    Invariant: ``use_count == 0`` exactly when the pool is freeable (listed in the
    allocator's freeable pools), and the pool disappears when, freeable,
    ``segment_count`` reaches 0. ``returnable``: heads of its segments that may still go
    back with the capture that made them (Block.returns_with).
    """

    __slots__ = (
        "id",
        "small",
        "large",
        "use_count",
        "segment_count",
        "stats",
        "returnable",
        "eager_small",
        "eager_large",
        "upstream",
        "use_on_oom",
        "held",
    )

    def __init__(self, pool_id: PoolId, spec: PoolSpec | None = None) -> None:
        self.id = pool_id
        self.small = FreeList(True, self)
        self.large = FreeList(False, self)
        self.use_count = 0
        self.segment_count = 0
        self.stats = PoolStats()
        self.returnable: set[Block] = set()
        # A MemPool's pool (see the module's note): its eager side, its upstream, and whether
        # its MemPool's own use is still counted in ``use_count`` (``held``).
        self.eager_small: FreeList | None = None
        self.eager_large: FreeList | None = None
        self.upstream: Any = None
        self.use_on_oom = False
        self.held = False
        if spec is not None:
            self.eager_small = FreeList(True, self, True)
            self.eager_large = FreeList(False, self, True)
            self.upstream = spec.upstream
            self.use_on_oom = spec.use_on_oom

    def free_lists(self) -> list[FreeList]:
        """Every free list of the pool: the graph side's, then the eager side's."""
        out = [self.small, self.large]
        if self.eager_small is not None and self.eager_large is not None:
            out += [self.eager_small, self.eager_large]
        return out

    def __repr__(self) -> str:
        return f"PrivatePool({tuple(self.id)}, use_count={self.use_count}, segments={self.segment_count})"


class Writes:
    """The footprint of a capture for the replay checker: the address and size of each
    allocation, in order.

    Two flat lists, not a list of tuples: a capture adds one entry per allocation, and a
    tuple is an object the garbage collector tracks. An
    allocation with the address and size of the one before adds nothing: the footprint is
    the same (a loop's temporary handed the same block again). Iterating gives
    ``(ptr, size)`` pairs.
    """

    __slots__ = ("ptrs", "sizes")

    def __init__(self) -> None:
        self.ptrs: list[int] = []
        self.sizes: list[int] = []

    def add(self, ptr: int, size: int) -> None:
        """Record one allocation of the capture."""
        ptrs = self.ptrs
        if ptrs and ptrs[-1] == ptr and self.sizes[-1] == size:
            return
        ptrs.append(ptr)
        self.sizes.append(size)

    def __len__(self) -> int:
        return len(self.ptrs)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self.ptrs, self.sizes, strict=True)


class CaptureRecord:
    """What the allocator remembers of one capture, from begin until the graph is released.

    ``kept``: blocks from outside the pool freed during the capture; the graph's kernels
    may touch them on every replay, so they stay out of every pool until release.
    ``deferred``: blocks with extra stream users freed during the capture; their events
    are recorded once no capture is underway. ``written``: (ptr, size) of the blocks
    handed out during the capture, kept for the replay checker (gp.graph's captures; None
    for captures begun outside graphpool). ``inputs``: (ptr, size,
    producer, block, serial) of the pool's blocks made by earlier captures and alive when
    this one began: what it may read (the replay checker's view of its inputs).
    ``outputs``: blocks handed out during the capture and still allocated at its end.
    ``replay_streams``: streams the graph replayed on; kept blocks wait for them at release.
    ``handles``: ("graph" | "exec", handle) pairs the allocator destroys when it releases
    the record for a graph that was collected, so finalizers make no device calls.
    ``foreign``: begun outside graphpool (detected, or registered by a framework hook);
    ``token`` then names it to ``Device.attach_release``. ``created``: heads of the
    segments it made while it may still fail (Block.returns_with).
    """

    __slots__ = (
        "capture_id",
        "pool",
        "label",
        "thread",
        "kept",
        "written",
        "inputs",
        "outputs",
        "active",
        "released",
        "sequence",
        "stream",
        "handles",
        "replay_streams",
        "failed",
        "foreign",
        "token",
        "created",
        "returnable_count",
    )

    def __init__(self, pool: PrivatePool, label: str, thread: int, sequence: int) -> None:
        self.capture_id = 0
        self.pool = pool
        self.label = label
        self.thread = thread
        self.kept: list[Block] = []
        self.written: Writes | None = None  # its footprint, when the replay checker may ask
        self.inputs: list[tuple[int, int, CaptureRecord, Block, int]] = []
        self.outputs: list[tuple[Block, int]] = []
        self.active = True
        self.released = False
        self.sequence = sequence
        self.stream = 0  # the capturing stream, to end an abandoned capture
        self.handles: list[tuple[str, int]] = []  # device graph objects to destroy at release
        self.replay_streams: set[int] = set()  # streams the graph was replayed on
        self.failed = False  # the capture was aborted: its graph never existed
        self.foreign = False  # begun outside graphpool
        self.token = 0  # its release token, when foreign
        self.created: list[Block] = []  # segment heads it made, until it succeeds
        self.returnable_count = 0  # segments that go back with it if it fails (Block.returns_with)

    def __repr__(self) -> str:
        return f"CaptureRecord({self.label}, pool={tuple(self.pool.id)}, id={self.capture_id})"

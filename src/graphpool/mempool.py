"""Pools as objects: ``MemPool`` and ``use_mem_pool`` (PyTorch's ``torch.cuda.MemPool`` forms).

A ``MemPool`` is a private pool that code other than a capture can own. Its ``id`` is a
``PoolId`` accepted wherever ``pool=`` is (``gp.graph``, ``CUDAGraph.capture_begin``,
``make_graphed_callable(s)``, ``gp.memory_stats``), and the MemPool itself is accepted there
too. ``use_mem_pool(pool)`` sends the calling thread's allocations (``gp.alloc`` and every
integration) to the pool while the block runs.

The capture rules hold inside a MemPool: eager allocations and a graph's allocations come
from two sides of the pool that never lend each other memory (docs/behaviour.rst, "MemPool";
the policy's Note [Pool objects] in policy/private_pools.py). Each device makes the pool on
first use; the MemPool's own use ends when the object is collected, and the pool's free
segments then go back to their upstream at the next ``empty_cache`` once nothing else uses it.
"""

from __future__ import annotations

import os
import threading
import weakref
from types import TracebackType
from typing import Any

from graphpool import runtime
from graphpool.policy import interrupts
from graphpool.policy.private_pools import (
    MANAGED,
    PoolId,
    PoolSpec,
    mempools,
    new_shared_pool_id,
)
from graphpool.streams import _index

UPSTREAMS = ("device", "managed")
"""The built-in upstreams by name: the device's own memory (the default) and managed memory."""


def _upstream(value: object) -> object:
    """The policy's form of ``upstream``: None (device memory), MANAGED, or a user object with
    callable ``malloc`` and ``free``; TypeError/ValueError otherwise."""
    if value is None or value == "device":
        return None
    if value == "managed" or value is MANAGED:
        return MANAGED
    if isinstance(value, str):
        raise ValueError(
            f"unknown upstream {value!r}: choose one of {', '.join(UPSTREAMS)}, or pass an allocator"
        )
    if not (callable(getattr(value, "malloc", None)) and callable(getattr(value, "free", None))):
        raise TypeError(
            "an upstream is 'device', 'managed', or an object with malloc(nbytes, device, stream) -> int "
            f"and free(ptr, nbytes, device, stream), not {type(value).__name__}"
        )
    return value


def _drop(pool_id: PoolId, spec: PoolSpec) -> None:
    """The MemPool is gone (a finalizer: lock-free, no device call): no new device makes its pool,
    and each allocator that made it ends the MemPool's use at its next call."""
    mempools.pop(pool_id, None)
    for a in spec.places:
        a.defer_mempool_drop(pool_id)


def _after_fork_in_child() -> None:
    """In a forked child only the forking thread lives: the ``use_mem_pool`` entries of the
    others end at each allocator's next call, which carries that out before it routes (a new
    thread may get a dead one's ident, and its allocations would go to that thread's pool)."""
    me = threading.get_ident()
    seen: set[int] = set()
    for spec in list(mempools.values()):  # entries exist only where a live MemPool's pool was made
        for a in spec.places:
            if id(a) not in seen:
                seen.add(id(a))
                a.defer_forget_threads(me)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class MemPool:
    """A private pool as an object (see the module doc).

    ``upstream``: where the pool's segments come from: ``None`` or ``"device"`` (the device's
    own memory), ``"managed"`` (CUDA managed memory, for oversubscription), or an object with
    ``malloc(nbytes, device, stream) -> int`` and ``free(ptr, nbytes, device, stream)`` (the
    shape of PyTorch's pluggable allocator pair). ``use_on_oom``: when the device is full,
    allocations outside the pool may take the pool's free eager blocks.
    """

    _graphpool_pool = True  # PoolId.coerce takes a MemPool for its id

    def __init__(self, *, upstream: object = None, use_on_oom: bool = False) -> None:
        up = _upstream(upstream)
        if not isinstance(use_on_oom, bool):
            raise TypeError(f"use_on_oom must be a bool, not {type(use_on_oom).__name__}")
        self._id = new_shared_pool_id()
        self._spec = PoolSpec(up, use_on_oom)
        self._upstream_arg = upstream
        mempools[self._id] = self._spec
        weakref.finalize(self, _drop, self._id, self._spec)
        runtime.allocator(_index(None)).ensure_pool(self._id)  # made on the current device now

    @property
    def id(self) -> PoolId:
        """The pool's id: pass it (or the MemPool) wherever ``pool=`` is taken."""
        return self._id

    @property
    def upstream(self) -> object:
        """Where the pool's segments come from, as given ("device" for the default)."""
        return "device" if self._upstream_arg is None else self._upstream_arg

    @property
    def use_on_oom(self) -> bool:
        """Whether allocations outside the pool may take its free eager blocks when the device is full."""
        return bool(self._spec.use_on_oom)

    def use_count(self, device: object = None) -> int:
        """How many users the pool has on ``device``: this MemPool, each ``use_mem_pool`` block
        open on it, and each graph (or capture underway) into it."""
        return self.memory_stats(device)["use_count"]

    def memory_stats(self, device: object = None) -> dict[str, int]:
        """The pool's own statistics on ``device`` (``gp.memory_stats(pool=self)``'s keys)."""
        a = runtime.allocator(_index(device))
        a.ensure_pool(self._id)
        return a.memory_stats(self._id)

    def snapshot(self, device: object = None) -> list[dict[str, Any]]:
        """This pool's segments on ``device``, in ``gp.memory_snapshot()``'s layout."""
        mine = tuple(self._id)
        return [seg for seg in runtime.allocator(_index(device)).snapshot() if seg["segment_pool_id"] == mine]

    def __copy__(self) -> MemPool:
        return self  # one pool, one object: a copy would be a second owner of the same id

    def __deepcopy__(self, memo: dict[int, Any]) -> MemPool:
        return self

    def __reduce__(self) -> Any:
        raise TypeError("a graphpool MemPool cannot be pickled: it is this process's pool")

    def __repr__(self) -> str:
        return f"MemPool(id={tuple(self._id)}, upstream={self.upstream!r}, use_on_oom={self.use_on_oom})"


class _Life:
    """Whether a thread that entered ``use_mem_pool`` blocks still runs (its ``_Open`` lives)."""

    __slots__ = ("alive",)

    def __init__(self) -> None:
        self.alive = True


class _Open:
    """In a thread's local state from its first ``use_mem_pool``: the allocators it entered
    blocks on. When the thread ends with blocks still open (a generator suspended inside one,
    kept elsewhere), its local state goes and ``__del__`` ends the thread's entries, at each
    allocator's next call, which carries that out before it routes or enters. CPython reuses
    a dead thread's ident: without this, a later thread would allocate into the dead one's
    pools. The blocks it left open see ``life`` dead, and their exit changes nothing."""

    __slots__ = ("ident", "life", "allocs")

    def __init__(self, ident: int) -> None:
        self.ident = ident
        self.life = _Life()
        self.allocs: dict[int, Any] = {}  # id -> allocator

    def __del__(self) -> None:
        try:
            self.life.alive = False
            for a in self.allocs.values():
                a.defer_forget_thread(self.ident)
        except Exception:  # at interpreter exit the modules may be gone: nothing to end
            pass


_local = threading.local()
"""This thread's ``_Open`` (``open``), made at its first ``use_mem_pool``."""


def _opened(alloc: Any, ident: int) -> _Life:
    """Note that thread ``ident`` (the caller) is about to enter a block on ``alloc``; its life.
    (Noted but never entered, it changes nothing at the thread's end.)"""
    o = getattr(_local, "open", None)
    if o is None:
        o = _local.open = _Open(ident)
    o.allocs[id(alloc)] = alloc
    return o.life


class use_mem_pool:  # PyTorch's name: a context manager class
    """``with use_mem_pool(pool):`` the calling thread's allocations on ``device`` (default: the
    one current when the block is entered) come from ``pool`` (``gp.alloc``, CuPy, Numba,
    cuda.core and PyTorch's hooks alike). Blocks nest; other threads are unaffected. On a
    stream a capture is underway on, the capture's own pool serves first. Counts as a use of
    the pool while open. The entry is the entering thread's: ``__exit__`` on another thread
    (a generator closed there) ends it, and it ends with its thread."""

    __slots__ = ("_pool", "_device", "_alloc", "_ident", "_life")

    def __init__(self, pool: MemPool, device: object = None) -> None:
        if not isinstance(pool, MemPool):
            raise TypeError(f"use_mem_pool takes a MemPool, not {type(pool).__name__}")
        self._pool = pool
        # None: the device current at __enter__ (as PyTorch's); an explicit one is checked now
        self._device: int | None = None if device is None else _index(device)
        self._alloc: Any = None  # the allocator entered, while open
        self._ident = 0  # the thread that entered, while open
        self._life: _Life | None = None  # whether that thread still runs

    def __enter__(self) -> MemPool:
        if self._ident:
            raise RuntimeError("this use_mem_pool block is open already: nest a new use_mem_pool(...)")
        ident = threading.get_ident()
        self._alloc = runtime.allocator(_index(self._device))
        life = _opened(self._alloc, ident)  # first: interrupted here, nothing was entered
        self._alloc.enter_pool(self._pool.id)
        self._life = life
        self._ident = ident
        return self._pool

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        ident = self._ident
        if ident:
            life = self._life
            if life is not None and life.alive:  # (else its thread's end ended the entry)
                self._alloc.exit_pool(self._pool.id, ident)
            self._ident = 0

    def __del__(self) -> None:
        # Still open: an exception (a KeyboardInterrupt) came between the block's last statement
        # and the call of __exit__, which Python then skips. The entry ends at the allocator's
        # next call, before that call is routed (lock-free: finalizers may run anywhere).
        ident = getattr(self, "_ident", 0)  # (absent when __init__ raised)
        if ident:
            self._ident = 0
            life = self._life
            if life is not None and life.alive:
                self._alloc.defer_exit_pool(self._pool.id, ident)


# A guarded signal handler that lands in __enter__ after the entry was made runs once it
# returned, inside the with-block, so that __exit__ removes the entry; one that lands in
# __exit__ or __del__ runs once the entry is gone or queued (policy/interrupts.py, "Handoffs").
interrupts.handoff(use_mem_pool.__enter__, use_mem_pool.__exit__, use_mem_pool.__del__)

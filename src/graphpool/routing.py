"""Which allocator and stream serve a ``gp.alloc`` call, and when that answer is stale.

``gp.alloc`` (memory.py) keeps what it found, so that a repeated call reads a few native
fields instead of the thread's state and the runtime:

- a ``Route``: where allocations on one stream go, its handle and its device's allocator.
  A graphpool Stream keeps its own (``Stream._home``).
- an ``Entry``: a stream with its route. Each thread keeps one for its current stream
  (``thread_entry()``). ``routes.cur`` is the last one any thread used, keyed by the
  thread's ident: one C call instead of reading the thread's ``threading.local`` (about
  300 instructions, compiled) while one thread allocates. ``routes.seen`` is the last
  explicit stream ``gp.alloc`` was given, with its route: native fields instead of a
  generic attribute lookup of ``Stream._home``.

One rule keeps them right. Every route records the generation it was found under and is
used only while ``routes.generation`` still has that value; whatever can change an answer
calls ``invalidate()``: ``set_backend`` (new allocators), a change of a thread's current
device or stream, and a fork (in the child a new thread may get a dead thread's ident). A
lookup reads the generation first and the state it keeps after; a change updates the
state first and invalidates after, so a lookup that races a change keeps a route that is
already stale. ``invalidate`` also empties ``routes.cur`` and ``routes.seen``, which then
hold no allocator of a replaced backend (nor its cached memory). ``routes.cur``'s key, a
thread ident, is reused once its thread ends: the thread's ``_Reaper`` empties the entry
then. An integration that keeps answers of its own checks the same generation
(graphpool.cupy's last stream).

Stream followers: a framework with a current stream of its own registers a
``StreamFollower`` (graphpool.cupy does at ``install()``), so that ``gp.stream`` and
``gp.graph`` make graphpool's current stream the framework's too and give the framework
back its own stream on exit. The core never looks an integration up: what it needs of one
is registered here.

Compiled by mypyc (setup.py), so that gp.alloc reads these classes' fields natively.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Final, Protocol

if TYPE_CHECKING:
    from graphpool.policy.allocator import CachingAllocator
    from graphpool.streams import Stream


class Route:
    """Where allocations on one stream go: its ``handle``, its device's allocator
    ``alloc``, and the ``generation`` they were found under (valid while
    ``routes.generation`` is that)."""

    __slots__ = ("handle", "alloc", "generation")

    def __init__(self, handle: int, alloc: CachingAllocator, generation: int) -> None:
        self.handle = handle
        self.alloc = alloc
        self.generation = generation


class Entry:
    """A stream and its route, kept for the thread ``ident`` (its current stream), or for
    the stream itself (``routes.seen``, ident 0).

    One object, replaced by a single write: no reader pairs one stream with another's
    route. The stream does not point back at it, so no reference cycle keeps streams alive
    (graphpool.cupy drops its streams by refcount).
    """

    __slots__ = ("stream", "route", "ident")

    def __init__(self, stream: Stream, route: Route, ident: int) -> None:
        self.stream = stream
        self.route = route
        self.ident = ident


class Routes:
    """The process-wide state: the ``generation`` and the two entries of any thread
    (``cur``: the last thread that allocated on its current stream; ``seen``: the last
    explicit stream)."""

    __slots__ = ("generation", "cur", "seen")

    def __init__(self) -> None:
        self.generation = 0
        self.cur: Entry | None = None
        self.seen: Entry | None = None


routes: Final = Routes()

_tls: Final = threading.local()
"""This thread's ``entry`` (its current stream's) and ``reaper``. A plain ``threading.local``
read with ``getattr``: mypyc cannot compile a subclass of it."""

_lock = threading.RLock()
"""Serializes ``invalidate`` (its read and write of the generation are two steps in plain
Python); reentrant for a signal handler that changes streams. Made anew in a forked child."""


_listeners: list[Callable[[], object]] = []
"""Called by every ``invalidate()``: answers kept where no generation can be read (the
PyTorch shim's native lane, graphpool.torch)."""


def on_invalidate(listener: Callable[[], object]) -> None:
    """Call ``listener()`` (no arguments, cheap, never raising) at every ``invalidate()``."""
    with _lock:
        _listeners.append(listener)


def invalidate() -> None:
    """Make every kept route stale. Call after changing what routes are found from (the
    backend, a thread's current device or stream)."""
    with _lock:
        routes.generation += 1
        routes.cur = None
        routes.seen = None
        for listener in _listeners:
            listener()


def thread_entry() -> Entry | None:
    """This thread's entry for its current stream, or None (stale when its generation is)."""
    entry: Entry | None = getattr(_tls, "entry", None)
    return entry


def keep_current(ident: int, stream: Stream, route: Route) -> Entry:
    """Keep ``route`` for this thread (``ident``) and its current stream ``stream``."""
    entry = Entry(stream, route, ident)
    _tls.entry = entry
    if getattr(_tls, "reaper", None) is None:
        _tls.reaper = _Reaper(ident)
    routes.cur = entry
    return entry


def keep_home(stream: Stream, route: Route) -> Route:
    """Keep ``route`` as graphpool Stream ``stream``'s home (and as ``routes.seen``)."""
    stream._home = route
    routes.seen = Entry(stream, route, 0)  # else a stale entry of the stream would keep winning
    return route


class _Reaper:
    """Kept in a thread's ``_tls``: collected when the thread ends, before its ident can be
    reused, it empties ``routes.cur`` if that names the thread."""

    __slots__ = ("ident",)

    def __init__(self, ident: int) -> None:
        self.ident = ident

    def __del__(self) -> None:
        try:
            cur = routes.cur
            if cur is not None and cur.ident == self.ident:
                routes.cur = None
        except Exception:  # at interpreter exit the module may be gone: nothing to empty
            pass


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.RLock()  # a thread that held it does not exist in the child
    invalidate()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# ------------------------------------------------------------------ stream followers
class StreamFollower(Protocol):
    """A framework whose current stream follows graphpool's, registered with ``add_follower``."""

    framework: str
    """The top-level package of the framework's arrays and streams ("cupy")."""

    def follow(self, stream: Stream) -> None:
        """Make ``stream`` the framework's current stream (graphpool's just became it)."""

    def save(self, device: int) -> object:
        """The framework's current stream of ``device``, for ``restore`` when the ``gp.stream``
        block entered now ends; None when there is nothing to restore."""

    def restore(self, saved: object, device: int) -> None:
        """Make ``saved`` (what ``save`` gave) the framework's current stream of ``device`` again."""


_followers: tuple[StreamFollower, ...] = ()
"""Replaced whole: readers take it without a lock."""
_followers_lock: Final = threading.Lock()


def add_follower(follower: StreamFollower) -> None:
    """Register ``follower`` (once: adding it again changes nothing)."""
    global _followers
    with _followers_lock:
        if follower not in _followers:
            _followers = (*_followers, follower)


def remove_follower(follower: StreamFollower) -> None:
    """Stop telling ``follower`` (nothing if it is not registered)."""
    global _followers
    with _followers_lock:
        _followers = tuple(f for f in _followers if f is not follower)


def followers() -> tuple[StreamFollower, ...]:
    """The registered stream followers, in registration order."""
    return _followers


def following(framework: str) -> bool:
    """Whether a follower of ``framework`` (its top-level package) is registered."""
    return any(f.framework == framework for f in _followers)

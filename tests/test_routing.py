"""graphpool.routing: one generation decides whether a kept route may serve a call.

Every change of what a route is found from (the backend, a thread's current device or
stream, a fork) invalidates; a lookup reads the generation before what it keeps, so a
lookup raced by a change keeps a route that is already stale. And the registry of stream
followers, through which an integration's current stream follows graphpool's.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from typing import Any

import pytest

import graphpool as gp
from graphpool import routing, runtime, streams
from graphpool.sim.device import SimBackend


def _stale_after(change: Any) -> None:
    gp.alloc(8).free()
    gp.alloc(8, gp.Stream()).free()
    before = routing.routes.generation
    assert routing.routes.cur is not None and routing.routes.seen is not None
    change()
    assert routing.routes.generation > before
    assert routing.routes.cur is None and routing.routes.seen is None  # no allocator held on


def test_every_change_a_route_is_found_from_invalidates(sim: Any) -> None:
    s = gp.Stream()
    _stale_after(lambda: streams.set_stream(s))
    _stale_after(lambda: gp.set_device(0))
    _stale_after(lambda: gp.set_backend("sim"))


def test_a_route_raced_by_set_backend_is_not_kept(sim: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A set_backend that lands while gp.alloc looks up the allocator (another thread, just
    after the lookup): the route kept then names the old runtime, and must not serve the
    next call."""
    real = runtime.allocator
    backend = _FakeCuda()  # one driver for every runtime, as CUDA's is the process's
    runtime.set_backend("cuda", backend=backend)
    s = gp.Stream()  # valid under each of them ("cuda" handles are the process's)

    def allocator_then_replace(index: int | None = None) -> Any:
        a = real(index)
        monkeypatch.setattr(runtime, "allocator", real)
        runtime.set_backend("cuda", backend=backend)
        return a

    for call in (lambda: gp.alloc(8), lambda: gp.alloc(8, s)):
        routing.invalidate()  # the next call looks up anew
        monkeypatch.setattr(runtime, "allocator", allocator_then_replace)
        raced = call()  # served by the old runtime's allocator: the call began before
        assert raced._alloc is not runtime.allocator(0)
        later = call()
        assert later._alloc is runtime.allocator(0)
        later.free()
        raced.free()
    gp.set_backend("sim")


class _FakeCuda(SimBackend):
    name = "cuda"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_changes_streams_though_a_parent_thread_held_the_lock(sim: Any) -> None:
    """The child has no thread to release a lock held at the fork: it makes its own."""
    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with routing._lock:
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold)
    t.start()
    held.wait(10)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once
        with gp.stream(gp.Stream()):
            gp.alloc(64).free()
        os.write(w, b"1")
        os._exit(0)
    os.close(w)
    answered = select.select([r], [], [], 20)[0]
    got = os.read(r, 1) if answered else b""
    if not answered:  # deadlocked (in the fork itself, or later)
        os.kill(pid, signal.SIGKILL)
    os.close(r)
    os.waitpid(pid, 0)
    release.set()
    t.join(10)
    assert got == b"1"


class _Follower:
    framework = "fake"

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def follow(self, stream: gp.Stream) -> None:
        self.calls.append(("follow", stream))

    def save(self, device: int) -> object:
        self.calls.append(("save", device))
        return "theirs"

    def restore(self, saved: object, device: int) -> None:
        self.calls.append(("restore", saved))


def test_a_follower_follows_gp_stream_and_gets_its_own_back(sim: Any) -> None:
    f = _Follower()
    routing.add_follower(f)
    try:
        s = gp.Stream()
        prev = gp.current_stream()
        with gp.stream(s):
            assert f.calls == [("save", 0), ("follow", s)]
        assert f.calls[2:] == [("follow", prev), ("restore", "theirs")]
        assert routing.following("fake")
    finally:
        routing.remove_follower(f)
    assert not routing.following("fake")


def test_a_follower_removed_inside_the_block_is_not_asked_to_restore(sim: Any) -> None:
    f = _Follower()
    routing.add_follower(f)
    try:
        with gp.stream(gp.Stream()):
            routing.remove_follower(f)
    finally:
        routing.remove_follower(f)
    assert [name for name, _ in f.calls] == ["save", "follow"]

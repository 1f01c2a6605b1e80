"""gp.alloc's caches in front of the thread's and the stream's state (graphpool.routing).

``routing.routes.seen`` keeps the stream ``gp.alloc`` was last given with its route, and
``routing.routes.cur`` the thread that last allocated on its current stream with that
thread's entry. A stale entry would allocate on the wrong stream, or on a replaced backend:
these tests change streams, threads and backends under them and check where each buffer
went.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import pytest

import graphpool as gp
from graphpool import routing, runtime
from graphpool.policy.stats import PoolStats
from graphpool.sim.device import SimBackend
from threadkit import run_threads


def test_each_thread_allocates_on_its_own_current_stream(sim: Any) -> None:
    streams = [gp.Stream() for _ in range(3)]
    wrong: list[tuple[int, int]] = []

    def work(k: int) -> None:
        s = streams[k]
        for i in range(600):
            if i % 50 == 0:  # leave the stream and come back: every cache entry drops
                with gp.stream(gp.default_stream()):
                    b = gp.alloc(64)
                    if b.stream.handle != 0:
                        wrong.append((k, b.stream.handle))
                    b.free()
            with gp.stream(s):
                b = gp.alloc(64 + k)
                if b.stream is not s:
                    wrong.append((k, b.stream.handle))
                b.free()

    run_threads(work, 3)
    assert wrong == []
    gp.check_invariants()


def test_a_changed_current_stream_is_used_at_once(sim: Any) -> None:
    s = gp.Stream()
    assert gp.alloc(64).stream.handle == 0
    with gp.stream(s):
        assert gp.alloc(64).stream is s
        assert gp.alloc(64).stream is s
    assert gp.alloc(64).stream.handle == 0


def test_an_ended_threads_entry_is_dropped(sim: Any) -> None:
    s = gp.Stream()
    idents: list[int] = []

    def work() -> None:
        idents.append(threading.get_ident())
        with gp.stream(s):
            gp.alloc(64).free()
        gp.alloc(64).free()  # the cache now names this thread

    t = threading.Thread(target=work)
    t.start()
    t.join(10)
    cur = routing.routes.cur
    # its ident may be reused by the next thread: the entry went with the thread
    assert cur is None or cur.ident != idents[0]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_without_an_entry(sim: Any) -> None:
    gp.alloc(64).free()
    assert routing.routes.cur is not None
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once
        os.write(w, b"1" if routing.routes.cur is None else b"0")
        os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    assert got == b"1"


def test_a_rehomed_stream_replaces_the_kept_entry() -> None:
    """A backend set again with the same handle space (as set_backend('cuda') twice) keeps the
    stream valid; its next allocation re-homes it, and the kept entry must follow."""
    b = SimBackend()
    runtime.set_backend("sim", backend=b)
    s = gp.Stream()
    for _ in range(3):
        gp.alloc(8, s).free()
    old = routing.routes.seen
    assert old is not None and old.stream is s
    runtime.set_backend("sim", backend=b)
    assert routing.routes.seen is None and routing.routes.cur is None  # they held the old allocator
    for _ in range(3):
        gp.alloc(8, s).free()
    seen = routing.routes.seen
    assert seen is not None and seen.stream is s and seen.route is s._home
    assert seen.route.generation == routing.routes.generation
    assert seen.route.alloc is runtime.allocator(s.device)
    assert gp.alloc(8, s).stream is s


def test_accumulated_counters_pass_2_to_the_63_in_both_builds() -> None:
    """Levels are 64-bit when compiled (bounded by the device's memory); the accumulated
    counters only grow, so they stay Python ints in both builds."""
    p = PoolStats()
    p.small.allocated_bytes_alloc = 2**63 - 100
    p.on_malloc(True, 512, 512, 0, 0)
    assert p.small.allocated_bytes_alloc == 2**63 + 412
    assert p.as_dict()["allocated_bytes.all.allocated"] == 2**63 + 412

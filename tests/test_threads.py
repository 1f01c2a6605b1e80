"""Thread safety: any number of Python threads may allocate and free at once.

Each thread allocates and frees in a random pattern; a shared registry checks, under its
own lock, that no two live allocations overlap. A range leaves the registry *before* its
free, so another thread may legitimately get it right after. Afterwards the allocator's
invariants hold and every byte comes back.
"""

from __future__ import annotations

import gc
import random
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import graphpool as gp
from graphpool import routing, runtime
from graphpool.policy.allocator import CachingAllocator

sys.path.insert(0, str(Path(__file__).resolve().parent / "policy"))
from fakedevice import SHRUNK, FakeDevice

from simenv import fresh_sim
from threadkit import run_threads

THREADS = 8
OPS = 400


class Registry:
    """Live ranges of every thread; raises on overlap."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: dict[int, int] = {}
        self.errors: list[str] = []

    def add(self, ptr: int, size: int) -> None:
        with self.lock:
            for p, n in self.live.items():
                if ptr < p + n and p < ptr + size:
                    self.errors.append(f"[{ptr:#x}, +{size}) overlaps [{p:#x}, +{n})")
            if ptr in self.live:
                self.errors.append(f"{ptr:#x} handed out twice")
            self.live[ptr] = size

    def remove(self, ptr: int) -> None:
        with self.lock:
            del self.live[ptr]


# --------------------------------------------------------------------------- the policy directly
def test_threads_on_the_allocator_directly() -> None:
    dev = FakeDevice(total=1 << 30)
    a = CachingAllocator(dev, sizes=SHRUNK)
    reg = Registry()

    def work(i: int) -> None:
        rng = random.Random(i)
        mine: list[int] = []
        stream = 1 + i % 3  # threads share streams, so they compete for the same blocks
        for _ in range(OPS):
            r = rng.random()
            if mine and r < 0.45:
                ptr = mine.pop(rng.randrange(len(mine)))
                reg.remove(ptr)
                a.free(ptr)
            elif mine and r < 0.5:
                a.record_stream(rng.choice(mine), 1 + (i + 1) % 3)
            elif r < 0.52:
                dev.complete_all()
            elif r < 0.53:
                a.empty_cache()
            else:
                n = rng.choice([rng.randrange(0, 4096), rng.randrange(0, 60000)])
                ptr = a.malloc(n, stream=stream)
                blk = a.lookup(ptr)
                assert blk is not None
                rounded = max(512, -(-n // 512) * 512)
                if rounded <= a.sizes.small_size:  # small: the remainder always split off
                    assert blk.size == rounded
                else:  # large: a remainder up to small_size may stay attached
                    assert rounded <= blk.size <= rounded + a.sizes.small_size
                reg.add(ptr, blk.size)
                mine.append(ptr)
        for ptr in mine:
            reg.remove(ptr)
            a.free(ptr)

    run_threads(work, THREADS)
    assert reg.errors == []
    a.check_invariants()
    st = a.memory_stats()
    assert st["allocation.all.current"] == 0 and st["allocated_bytes.all.current"] == 0
    a.empty_cache()
    a.check_invariants()
    assert a.memory_stats()["reserved_bytes.all.current"] == 0 and dev.used == 0


def test_threads_stats_add_up_exactly() -> None:
    dev = FakeDevice(total=1 << 30)
    a = CachingAllocator(dev, sizes=SHRUNK)
    per_thread = 300

    def work(i: int) -> None:
        ptrs = [a.malloc(1000, stream=1 + i % 2) for _ in range(per_thread)]
        for p in ptrs:
            a.free(p)

    run_threads(work, THREADS)
    st = a.memory_stats()
    total = THREADS * per_thread
    assert st["allocation.all.allocated"] == total and st["allocation.all.freed"] == total
    assert st["allocated_bytes.all.allocated"] == total * 1024
    assert st["requested_bytes.all.allocated"] == total * 1000
    assert st["allocation.all.current"] == 0
    a.check_invariants()


# --------------------------------------------------------------------------- the public API, sim
@pytest.fixture
def small_sim() -> Any:
    with fresh_sim(1, 256 << 20, sizes=SHRUNK) as rt:
        yield rt


def test_threads_through_gp_alloc_with_patterns(small_sim: Any) -> None:
    dev = small_sim.device(0)
    reg = Registry()
    corrupt: list[str] = []
    streams = [gp.Stream() for _ in range(3)]

    def work(i: int) -> None:
        rng = random.Random(100 + i)
        s = streams[i % 3]
        mine: list[tuple[Any, int]] = []
        with gp.stream(s):
            for k in range(OPS // 2):
                if mine and rng.random() < 0.45:
                    buf, pat = mine.pop(rng.randrange(len(mine)))
                    got = dev.read(buf.ptr, buf.nbytes, s.handle)
                    if got != bytes([pat]) * buf.nbytes:
                        corrupt.append(f"thread {i}: buffer {buf.ptr:#x} changed")
                    reg.remove(buf.ptr)
                    if rng.random() < 0.5:
                        buf.free()
                    else:
                        del buf  # freed by its finalizer, drained by a later call
                else:
                    n = rng.randrange(1, 20000)
                    buf = gp.alloc(n)
                    assert buf.stream == s
                    pat = (i * 31 + k) % 250 + 1
                    dev.write(buf.ptr, bytes([pat]) * n, s.handle)
                    reg.add(buf.ptr, runtime.allocator(0).lookup(buf.ptr).size)
                    mine.append((buf, pat))
            for buf, pat in mine:
                got = dev.read(buf.ptr, buf.nbytes, s.handle)
                if got != bytes([pat]) * buf.nbytes:
                    corrupt.append(f"thread {i}: buffer {buf.ptr:#x} changed")
                reg.remove(buf.ptr)
                buf.free()

    run_threads(work, THREADS)
    assert reg.errors == []
    assert corrupt == []
    gc.collect()
    gp.synchronize()
    gp.check_invariants()
    assert gp.memory_allocated() == 0
    gp.empty_cache()
    assert gp.memory_reserved() == 0


def test_threads_allocate_while_another_thread_captures(small_sim: Any) -> None:
    """Eager threads never get private memory, and never break another thread's capture."""
    from graphpool.sim import xp

    alloc = runtime.allocator(0)
    stop = threading.Event()
    private: list[int] = []
    captured = threading.Event()

    errors: list[BaseException] = []

    def eager(i: int) -> None:
        try:
            s = gp.Stream()
            with gp.stream(s):
                while not stop.is_set():
                    buf = gp.alloc(1000 + 512 * i)
                    if alloc.lookup(buf.ptr).free_list.private_pool is not None:
                        private.append(buf.ptr)
                    buf.free()
        except BaseException as exc:  # re-raised in the main thread below
            errors.append(exc)
            stop.set()

    def capturer() -> None:
        g = gp.CUDAGraph()
        s = gp.Stream()
        with gp.stream(s):
            g.capture_begin()  # global mode: any unsafe call by any thread would break it
            arrays = [xp.ones(100 + k) for k in range(50)]
            g.capture_end()
            g.replay()
            assert all(alloc.lookup(a.data.ptr).free_list.private_pool is not None for a in arrays)
            assert float(arrays[-1].sum().item()) == 149.0
        g.reset()
        captured.set()

    workers = [threading.Thread(target=eager, args=(i,)) for i in range(3)]

    def guarded() -> None:
        try:
            capturer()
        except BaseException as exc:
            errors.append(exc)

    cap = threading.Thread(target=guarded)
    for w in workers:
        w.start()
    cap.start()
    cap.join(timeout=60)
    stop.set()
    for w in workers:
        w.join(timeout=60)
    assert [t for t in (cap, *workers) if t.is_alive()] == [], "a thread hung (deadlock?)"
    if errors:
        raise errors[0]
    assert captured.is_set()
    assert private == [], "eager code got private-pool memory while another thread captured"
    gc.collect()
    gp.check_invariants()


def test_graph_collected_mid_capture_is_ended_at_once(small_sim: Any) -> None:
    from graphpool.sim import capture as sim_capture
    from graphpool.sim import xp

    s = gp.Stream()
    dev = small_sim.device(0)
    try:
        with gp.stream(s):
            g = gp.CUDAGraph()
            g.capture_begin()
            a = xp.ones(100)
            del g
            gc.collect()
            # The finalizer ran on the capturing thread: it ended the device capture at once,
            # so the stream is usable right away (no later call needed).
            assert not s.query_capturing(), "the abandoned capture is still open on the device"
            assert sim_capture.ongoing() == []
            t = threading.Thread(target=gp.memory_stats)  # another thread's call drains the queue
            t.start()
            t.join()
            assert runtime.allocator(0)._capturing == 0  # released: its capture is over
            b = xp.ones(100)
            assert runtime.allocator(0).lookup(b.data.ptr).free_list.private_pool is None
            del a, b
    finally:
        for cap in sim_capture.ongoing():  # leave no capture behind for later tests
            try:
                dev.end_capture(cap.origin)
            except gp.GraphpoolError:
                sim_capture.finish(cap)
        gc.collect()


def test_set_backend_racing_an_alloc_never_leaves_a_thread_on_the_old_allocator(sim: Any) -> None:
    """gp.alloc caches (stream, allocator) per thread; a set_backend from another thread in the
    middle of filling that cache must not leave the old backend's allocator in it."""
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    stale = 0
    try:
        for _ in range(300):
            go, done = threading.Event(), threading.Event()
            out: dict[str, bool] = {}

            def worker(go: threading.Event = go, done: threading.Event = done, out: dict = out) -> None:
                gp.current_stream()
                go.set()
                while not done.is_set():
                    routing.invalidate()  # as after a stream switch: the next alloc finds anew
                    gp.alloc(512).free()
                b = gp.alloc(512)
                out["stale"] = b._alloc is not runtime.allocator(0)
                b.free()

            t = threading.Thread(target=worker)
            t.start()
            go.wait()
            gp.set_backend("sim")
            done.set()
            t.join()
            stale += out["stale"]
    finally:
        sys.setswitchinterval(old_interval)
    assert stale == 0


def test_without_fastrlock_the_allocator_uses_the_stdlib_lock() -> None:
    """fastrlock has no PyPy wheel, and a plain-Python install has no C lock; the allocator then
    takes threading.RLock, same behaviour."""
    import subprocess

    code = (
        "import sys; sys.modules['fastrlock'] = None; sys.modules['fastrlock.rlock'] = None\n"
        "sys.modules['graphpool.policy._lock'] = None\n"
        "import threading, graphpool as gp\n"
        "from graphpool import runtime\n"
        "gp.set_backend('sim')\n"
        "bufs = [gp.alloc(n) for n in (1, 600, 1 << 20, 3 << 20)]\n"
        "[b.free() for b in bufs]\n"
        "gp.check_invariants()\n"
        "print(type(runtime.allocator()._lock) is type(threading.RLock()))\n"
    )
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {"PYTHONPATH": src + ":" + ":".join(sys.path)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "True"

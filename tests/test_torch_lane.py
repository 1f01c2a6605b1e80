"""The PyTorch shim's lane (graphpool/_torch_shim.cpp; policy/heap.py, Note [Parking]), on the
simulator through ctypes: the C entry points PyTorch calls hand a parked block out again
without Python, and only when graphpool's rule would.

Each test counts the calls that reach graphpool's Python hooks: a lane that answers when it
should not, or stops answering when it should, changes those counts or the addresses.
tests/property/test_parking_differential.py compares whole random programs with the rule
run in Python alone.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

import graphpool as gp
from graphpool import routing, runtime
from graphpool.device.protocol import CAPTURE_MODE_GLOBAL
from graphpool.tools.benchkit import torch_entry_points
from twins import counting_query, lane_query_from, torch_shim_or_skip


class Counted:
    """graphpool's hooks, counting the calls that reach Python."""

    def __init__(self, malloc: Any, free: Any) -> None:
        self._malloc, self._free = malloc, free
        self.mallocs = self.frees = 0

    def malloc(self, size: int, device: int, stream: int) -> int:
        self.mallocs += 1
        return int(self._malloc(size, device, stream))

    def free(self, ptr: int, size: int, device: int, stream: int) -> int:
        self.frees += 1
        return int(self._free(ptr, size, device, stream))


@pytest.fixture
def shim() -> Iterator[Any]:

    mod = torch_shim_or_skip()
    gp.set_backend("sim")
    try:
        yield mod
    finally:
        mod.set_lanes_enabled(True)
        mod.close()
        gp.check_invariants()


@pytest.fixture
def counted(shim: Any) -> Counted:
    import graphpool.torch as gtorch

    hooks = Counted(*gtorch.hooks())
    shim.set_hooks(hooks.malloc, hooks.free)
    return hooks


@pytest.fixture
def lib(shim: Any) -> Any:

    dll = torch_entry_points()
    return dll


def test_a_repeated_request_is_served_without_python(shim: Any, counted: Counted, lib: Any) -> None:
    s = gp.Stream()
    stats0 = gp.memory_stats()
    p = lib.graphpool_torch_malloc(1000, 0, s.handle)
    lib.graphpool_torch_free(p, 1000, 0, s.handle)  # parked: the lane keeps it
    assert (counted.mallocs, counted.frees) == (1, 1)
    assert shim.lane_state(0)["state"] == "parked" and shim.lane_state(0)["requested"] == 1000
    for _ in range(50):
        assert lib.graphpool_torch_malloc(1000, 0, s.handle) == p
        lib.graphpool_torch_free(p, 1000, 0, s.handle)
    assert (counted.mallocs, counted.frees) == (1, 1)  # no call reached Python
    assert shim.lane_state(0)["hits"] == 50
    stats = gp.memory_stats()  # settles: the lane's 50 hand-outs are counted
    assert shim.lane_state(0)["state"] == "empty"
    assert stats["allocation.all.allocated"] - stats0["allocation.all.allocated"] == 51
    assert stats["allocated_bytes.all.freed"] - stats0["allocated_bytes.all.freed"] == 51 * 1024
    assert stats["requested_bytes.all.allocated"] - stats0["requested_bytes.all.allocated"] == 51 * 1000
    assert stats["allocated_bytes.all.peak"] - stats0["allocated_bytes.all.peak"] == 1024
    assert gp.memory_allocated() == stats0["allocated_bytes.all.current"]  # the free was carried out


def test_only_the_same_size_and_stream_take_it(shim: Any, counted: Counted, lib: Any) -> None:
    s, t = gp.Stream(), gp.Stream()
    p = lib.graphpool_torch_malloc(1000, 0, s.handle)
    lib.graphpool_torch_free(p, 1000, 0, s.handle)
    q = lib.graphpool_torch_malloc(1024, 0, s.handle)  # another request of the same block size
    assert counted.mallocs == 2 and q == p  # graphpool's best fit: the free was carried out first
    lib.graphpool_torch_free(q, 1024, 0, s.handle)
    r = lib.graphpool_torch_malloc(1024, 0, t.handle)  # another stream: never the parked block
    assert counted.mallocs == 3 and r != q
    assert gp.memory_allocated() == 1024
    lib.graphpool_torch_free(r, 1024, 0, t.handle)


def test_a_capturing_stream_is_never_served_by_the_lane(shim: Any, counted: Counted, lib: Any) -> None:
    """A capture begun outside graphpool on the parked block's stream: the lane asks the
    device, finds it capturing and leaves the request to graphpool, which serves it from the
    capture's private pool; the parked block is freed under the capture's rules."""
    s = gp.Stream()
    dev = runtime.get().device(0)
    p = lib.graphpool_torch_malloc(4096, 0, s.handle)
    lib.graphpool_torch_free(p, 4096, 0, s.handle)
    dev.begin_capture(s.handle, CAPTURE_MODE_GLOBAL)
    try:
        q = lib.graphpool_torch_malloc(4096, 0, s.handle)
        assert counted.mallocs == 2 and q != p
        owner = {b["address"]: seg["segment_pool_id"] for seg in gp.memory_snapshot() for b in seg["blocks"]}
        assert owner[q] is not None  # a private pool's
        lib.graphpool_torch_free(q, 4096, 0, s.handle)
    finally:
        graph = dev.end_capture(s.handle)
    dev.destroy_graph(graph)
    gp.empty_cache()  # notices the capture ended and its graph is gone
    gp.check_invariants()
    assert runtime.allocator(0)._capturing == 0 and gp.memory_allocated() == 0


def test_the_legacy_stream_needs_no_query(shim: Any, counted: Counted, lib: Any) -> None:
    s = gp.Stream()
    lib.graphpool_torch_free(lib.graphpool_torch_malloc(512, 0, 0), 512, 0, 0)  # (binds the lane)
    shim.lane_query(0, 0)  # no capture query: only the legacy stream (which never captures) is served
    for stream in (0, 1, s.handle):  # (1: CUDA's handle of the legacy stream, CU_STREAM_LEGACY)
        p = lib.graphpool_torch_malloc(512, 0, stream)
        lib.graphpool_torch_free(p, 512, 0, stream)
        before = counted.mallocs
        assert lib.graphpool_torch_malloc(512, 0, stream) == p
        assert counted.mallocs == before + (stream > 1)
        lib.graphpool_torch_free(p, 512, 0, stream)


def test_a_lane_settled_or_turned_off_during_its_capture_query_is_not_used(
    shim: Any, counted: Counted, lib: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lane asks the capture query without its lock (the query may take the GIL); another
    thread may settle the lane or turn it off meanwhile: the lane looks again afterwards. A
    query that fails leaves the request to graphpool too."""
    s = gp.Stream()
    dev = runtime.get().device(0)
    query = dev.capture_id
    allocated0 = gp.memory_stats()["allocation.all.allocated"]
    failed: list[int] = []

    def fail_once() -> None:  # the query fails (-1): the lane must not guess
        if not failed:
            failed.append(1)
            raise RuntimeError("capture query failed")

    for meanwhile in (gp.memory_stats, routing.invalidate, fail_once):  # (settles; lanes_off)

        def capture_id(stream: int, meanwhile: Any = meanwhile) -> int:
            meanwhile()
            return query(stream)

        p = lib.graphpool_torch_malloc(1000, 0, s.handle)
        lib.graphpool_torch_free(p, 1000, 0, s.handle)  # parked: the lane holds it
        before = counted.mallocs
        monkeypatch.setattr(dev, "capture_id", capture_id)
        assert lib.graphpool_torch_malloc(1000, 0, s.handle) == p
        monkeypatch.setattr(dev, "capture_id", query)
        assert counted.mallocs == before + 1  # the hooks decided (graphpool took it back)
        lib.graphpool_torch_free(p, 1000, 0, s.handle)
    stats = gp.memory_stats()  # three mallocs, three take-backs: no hand-out counted that was not
    assert stats["allocation.all.allocated"] - allocated0 == 6
    assert gp.memory_allocated() == 0


def test_the_lane_asks_the_capture_query_only_for_a_request_it_could_serve(
    shim: Any, counted: Counted, lib: Any
) -> None:
    """The query costs a driver call (the simulator's: the GIL): the lane asks it only when
    its block is parked, for this size and stream, and the lane is on."""
    s, t = gp.Stream(), gp.Stream()
    p = lib.graphpool_torch_malloc(1000, 0, s.handle)
    lib.graphpool_torch_free(p, 1000, 0, s.handle)  # (binds the lane) parked
    asked: list[int] = []
    with lane_query_from(shim, counting_query(asked)):
        q = lib.graphpool_torch_malloc(2048, 0, s.handle)  # another size
        lib.graphpool_torch_free(q, 2048, 0, s.handle)
        q = lib.graphpool_torch_malloc(1000, 0, t.handle)  # another stream
        lib.graphpool_torch_free(q, 1000, 0, t.handle)
        assert asked == []
        p = lib.graphpool_torch_malloc(1000, 0, s.handle)
        lib.graphpool_torch_free(p, 1000, 0, s.handle)  # parked on s again
        assert lib.graphpool_torch_malloc(1000, 0, s.handle) == p and asked == [s.handle]  # the lane's
        q = lib.graphpool_torch_malloc(1000, 0, s.handle)  # its block is out: nothing to serve
        assert asked == [s.handle]
        lib.graphpool_torch_free(q, 1000, 0, s.handle)
        lib.graphpool_torch_free(p, 1000, 0, s.handle)
        gp.memory_stats()  # (carries out the queued frees)
        p = lib.graphpool_torch_malloc(1000, 0, s.handle)
        lib.graphpool_torch_free(p, 1000, 0, s.handle)  # parked
        assert shim.lane_state(0)["state"] == "parked"
        routing.invalidate()  # the lane is off
        r = lib.graphpool_torch_malloc(1000, 0, s.handle)
        assert asked == [s.handle]
        lib.graphpool_torch_free(r, 1000, 0, s.handle)
        gp.memory_stats()  # settled while the query is ours
        shim.lane_query(0, 0)


def test_the_lane_takes_back_only_its_own_block_and_only_while_enabled_and_on(
    shim: Any, counted: Counted, lib: Any
) -> None:
    s = gp.Stream()
    p = lib.graphpool_torch_malloc(1000, 0, s.handle)
    q = lib.graphpool_torch_malloc(4096, 0, s.handle)
    lib.graphpool_torch_free(p, 1000, 0, s.handle)
    assert lib.graphpool_torch_malloc(1000, 0, s.handle) == p  # the lane's: out now
    frees = counted.frees
    lib.graphpool_torch_free(q, 4096, 0, s.handle)  # not the lane's block: the hooks'
    assert counted.frees == frees + 1
    lib.graphpool_torch_free(p, 1000, 0, s.handle)
    assert gp.memory_allocated() == 0
    for turn_off in (lambda: shim.set_lanes_enabled(False), routing.invalidate):
        p = lib.graphpool_torch_malloc(1000, 0, s.handle)
        lib.graphpool_torch_free(p, 1000, 0, s.handle)
        assert lib.graphpool_torch_malloc(1000, 0, s.handle) == p  # out again, through the lane
        frees = counted.frees
        turn_off()
        lib.graphpool_torch_free(p, 1000, 0, s.handle)  # the hooks only, now
        assert counted.frees == frees + 1
        shim.set_lanes_enabled(True)
        assert gp.memory_allocated() == 0


def test_a_first_free_before_any_malloc_binds_the_allocator(shim: Any) -> None:
    """A block allocated before these hooks served anything (another integration's, say):
    its free finds the allocator itself, binds it to the lane and queues the free (no route
    was used, so none is current)."""
    import graphpool.torch as gtorch

    s = gp.Stream()
    a = runtime.allocator(0)
    p = a.malloc(512, stream=s.handle)
    _, free = gtorch.hooks()
    assert free(p, 512, 0, s.handle) == 0
    assert a.memory_stats()["allocated_bytes.all.current"] == 0


def test_a_null_free_and_a_device_without_a_lane(shim: Any, counted: Counted, lib: Any) -> None:
    """PyTorch frees the null pointer of a 0-byte tensor: nothing reaches graphpool. The lanes
    are the first 64 devices': asking another's is refused."""
    lib.graphpool_torch_free(None, 0, 0, 0)
    assert counted.frees == 0
    for device in (-1, 64):
        with pytest.raises(ValueError, match="has no lane"):
            shim.lane_take(device)
        with pytest.raises(ValueError, match="has no lane"):
            shim.lane_query(device, 0)
    with pytest.raises(ValueError, match="has no lane"):
        shim.lane_take(2**32)  # (not wrapped to device 0)
    with pytest.raises(TypeError, match="1 to 3 arguments"):
        shim.lane_take()
    with pytest.raises(TypeError, match="1 to 3 arguments"):
        shim.lane_take(0, 0, 0, 0)
    with pytest.raises(OverflowError):
        shim.lane_take(0, -1)  # an address is never negative
    with pytest.raises(TypeError):
        shim.lane_take(0, 0, "4096")
    assert shim.lane_take(0) == (0, False)  # nothing since the last take (one shared answer)
    assert shim.lane_take(0) is shim.lane_take(0)


def test_a_free_hook_answering_a_negative_size_parks_nothing(shim: Any, lib: Any) -> None:
    import graphpool.torch as gtorch

    malloc, free = gtorch.hooks()
    shim.set_hooks(malloc, lambda *args: (free(*args), -1)[1])  # (not a size: ignored)
    s = gp.Stream()
    p = lib.graphpool_torch_malloc(512, 0, s.handle)
    lib.graphpool_torch_free(p, 512, 0, s.handle)
    assert shim.lane_state(0)["state"] == "empty"
    assert gp.memory_allocated() == 0


def test_a_lane_bound_to_a_new_runtime_is_no_longer_the_old_allocators(shim: Any, lib: Any) -> None:
    """set_backend, then the new runtime's hooks bind the device's lane to their allocator:
    the old allocator is let go of it first, so its later calls never take the new one's."""
    import graphpool.torch as gtorch

    old = runtime.get().allocator(0)
    shim.set_hooks(*gtorch.hooks())
    s = gp.Stream()
    p = lib.graphpool_torch_malloc(512, 0, s.handle)
    lib.graphpool_torch_free(p, 512, 0, s.handle)  # parked in the old allocator
    gp.set_backend("sim")
    shim.set_hooks(*gtorch.hooks())
    t = gp.Stream()
    q = lib.graphpool_torch_malloc(512, 0, t.handle)  # binds the lane to the new allocator
    lib.graphpool_torch_free(q, 512, 0, t.handle)
    assert lib.graphpool_torch_malloc(512, 0, t.handle) == q  # the lane's: out now
    assert old.memory_stats()["allocated_bytes.all.current"] == 0  # its park: a free
    assert shim.lane_state(0)["state"] == "live"  # still the new allocator's
    lib.graphpool_torch_free(q, 512, 0, t.handle)
    assert gp.memory_allocated() == 0


def test_the_lanes_listen_for_routing_changes_once(shim: Any) -> None:
    import graphpool.torch as gtorch

    gtorch.hooks()
    n = len(routing._listeners)
    gtorch.hooks()
    gtorch.hooks()
    assert len(routing._listeners) == n  # (one shim.lanes_off for the process)


def test_a_routing_change_turns_the_lane_off(shim: Any, counted: Counted, lib: Any) -> None:
    s = gp.Stream()
    p = lib.graphpool_torch_malloc(512, 0, s.handle)
    lib.graphpool_torch_free(p, 512, 0, s.handle)
    routing.invalidate()  # what set_backend, gp.stream and a fork do
    assert shim.lane_state(0)["on"] is False
    assert lib.graphpool_torch_malloc(512, 0, s.handle) == p  # graphpool's rule, in Python
    assert counted.mallocs == 2
    lib.graphpool_torch_free(p, 512, 0, s.handle)  # parked again: the lane is on
    assert shim.lane_state(0)["on"] is True
    assert lib.graphpool_torch_malloc(512, 0, s.handle) == p and counted.mallocs == 2
    lib.graphpool_torch_free(p, 512, 0, s.handle)


def test_a_replaced_backend_is_never_served(shim: Any, counted: Counted, lib: Any) -> None:
    s = gp.Stream()
    p = lib.graphpool_torch_malloc(512, 0, s.handle)
    lib.graphpool_torch_free(p, 512, 0, s.handle)
    old = runtime.get()
    gp.set_backend("sim")
    with pytest.raises(RuntimeError, match="backend was replaced"):
        shim.try_malloc(512, 0, s.handle)
    assert lib.graphpool_torch_free is not None and shim.lane_state(0)["on"] is False
    old.allocator(0).check_invariants()  # settled: the parked block is an ordinary queued free
    assert old.allocator(0).memory_stats()["allocated_bytes.all.current"] == 0


def test_a_block_with_stream_uses_is_not_parked(shim: Any, counted: Counted, lib: Any) -> None:
    s, t = gp.Stream(), gp.Stream()
    p = lib.graphpool_torch_malloc(512, 0, s.handle)
    runtime.allocator(0).record_stream(p, t.handle)  # Tensor.record_stream (graphpool.torch)
    lib.graphpool_torch_free(p, 512, 0, s.handle)
    assert shim.lane_state(0)["state"] == "empty"  # its free waits for t's work: queued
    lib.graphpool_torch_malloc(512, 0, s.handle)
    assert counted.mallocs == 2


def test_freeing_the_parked_block_again_is_refused(
    shim: Any, counted: Counted, lib: Any, monkeypatch: Any
) -> None:
    import sys

    seen: list[Any] = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    s = gp.Stream()
    p = lib.graphpool_torch_malloc(512, 0, s.handle)
    lib.graphpool_torch_free(p, 512, 0, s.handle)
    lib.graphpool_torch_free(p, 512, 0, s.handle)  # the lane holds it parked: not the lane's to take
    assert len(seen) == 1 and type(seen[0].exc_value).__name__ == "DoubleFreeError"
    assert gp.memory_allocated() == 0


def test_graphpool_torch_lane_0_leaves_every_call_to_python(
    shim: Any, lib: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import graphpool.torch as gtorch

    monkeypatch.setenv("GRAPHPOOL_TORCH_LANE", "0")
    hooks = Counted(*gtorch.hooks())
    shim.set_hooks(hooks.malloc, hooks.free)
    s = gp.Stream()
    for stream in (s.handle, 0):  # (the legacy stream: the lane would serve it with no capture query)
        for _ in range(3):
            p = lib.graphpool_torch_malloc(512, 0, stream)
            lib.graphpool_torch_free(p, 512, 0, stream)
    assert (hooks.mallocs, hooks.frees) == (6, 6)


def test_threads_race_the_lane_and_graphpool(shim: Any, counted: Counted, lib: Any) -> None:
    """Two threads allocate and free in turn through the C entry points (the GIL released, as
    in PyTorch) while a third asks graphpool for statistics, which settles the lane each time:
    every address handed out is live once, and the invariants hold at the end."""
    streams = [gp.Stream(), gp.Stream()]
    errors: list[BaseException] = []
    live: set[int] = set()
    guard = threading.Lock()
    stop = threading.Event()

    def worker(k: int) -> None:
        try:
            for i in range(300):
                size = 512 * (1 + (i % 3 == 0))
                p = lib.graphpool_torch_malloc(size, 0, streams[k].handle)
                with guard:
                    assert p not in live, "an address handed out twice"
                    live.add(p)
                with guard:
                    live.discard(p)
                lib.graphpool_torch_free(p, size, 0, streams[k].handle)
        except BaseException as e:  # reported in the test's thread
            errors.append(e)

    def poll() -> None:
        while not stop.is_set():
            gp.memory_stats()

    threads = [threading.Thread(target=worker, args=(k,)) for k in (0, 1)]
    poller = threading.Thread(target=poll)
    poller.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    poller.join()
    assert errors == []
    gp.check_invariants()
    assert gp.memory_allocated() == 0


def test_record_stream_reaches_a_block_the_lane_handed_out(shim: Any, counted: Counted, lib: Any) -> None:
    """Tensor.record_stream (graphpool.torch.forward_calls) of a tensor the lane served: the
    block is graphpool's parked one, out again; graphpool finds it, holds it for the other
    stream, and neither the lane nor graphpool hands it out while that stream's work runs."""
    import graphpool.torch as gtorch
    from test_integrations_torch import _tensor, _torch_for_forwarding

    torch = _torch_for_forwarding()
    gtorch.forward_calls(torch)
    s, side = gp.Stream(), gp.Stream()
    p = lib.graphpool_torch_malloc(4096, 0, s.handle)
    lib.graphpool_torch_free(p, 4096, 0, s.handle)  # parked
    assert lib.graphpool_torch_malloc(4096, 0, s.handle) == p and counted.mallocs == 1  # the lane's
    runtime.get().device(0).launch_sleep(side.handle, rounds=50)  # type: ignore[attr-defined]
    _tensor(torch, p).record_stream(type("S", (), {"cuda_stream": side.handle})())
    lib.graphpool_torch_free(p, 4096, 0, s.handle)
    q = lib.graphpool_torch_malloc(4096, 0, s.handle)
    assert q != p  # side still runs: p waits for it
    side.synchronize()
    lib.graphpool_torch_free(q, 4096, 0, s.handle)
    gp.synchronize()


def test_a_block_taken_before_the_shim_parks_it_is_not_served_again(shim: Any, lib: Any) -> None:
    """Between graphpool parking a block and the shim's lane keeping it (the free hook has
    returned to Python's caller but not yet to C), other Python code may run (a signal
    handler, another thread): here it takes the parked block back for a new tensor. The
    lane must then not keep the block: it is live, and serving it would hand it out twice."""
    import graphpool.torch as gtorch

    malloc, free = gtorch.hooks()
    s = gp.Stream()
    taken: list[int] = []

    def racing_free(ptr: int, size: int, device: int, stream: int) -> int:
        out = int(free(ptr, size, device, stream))  # parked
        taken.append(malloc(size, device, stream))  # meanwhile: the next tensor takes it back
        return out

    shim.set_hooks(malloc, racing_free)
    p = lib.graphpool_torch_malloc(4096, 0, s.handle)
    lib.graphpool_torch_free(p, 4096, 0, s.handle)
    assert taken == [p]  # graphpool's rule handed the parked block to the new tensor
    q = lib.graphpool_torch_malloc(4096, 0, s.handle)
    assert q != p, "the lane handed out a live block"
    shim.set_hooks(malloc, free)
    lib.graphpool_torch_free(q, 4096, 0, s.handle)
    lib.graphpool_torch_free(p, 4096, 0, s.handle)
    assert gp.memory_allocated() == 0


def test_a_free_queued_after_the_park_is_carried_out_before_the_take_back(sim: Any) -> None:
    """Parking changes no address: a free queued after the park (a CuPy array's, say, through
    ``drop``) comes before the next request, as it would were the parked free queued too.
    Here the two freed neighbours merge, and best fit hands out the lower one."""
    a = runtime.allocator(0)
    s = gp.Stream()
    x = a.malloc(1024, stream=s.handle)
    p = a.malloc(1024, stream=s.handle)
    assert p == x + 1024
    assert a.park(p) == 1024  # parked
    a.drop(x)
    assert a.malloc(1024, stream=s.handle) == x  # (both frees queued: x's block, merged with p's)
    a.check_invariants()


def test_a_device_number_past_c_int_is_refused(shim: Any) -> None:
    """The shim's Python functions refuse a device number with no lane, 2**32 too (taken as a
    C int it would wrap to device 0's lane, and read far past the lanes): in a child, since a
    wrong read there would end the interpreter."""
    import os
    import subprocess
    import sys

    code = (
        "import graphpool.torch as g\n"
        "s = g._shim()\n"
        "for f in (s.lane_state, s.lane_take):\n"
        "    for d in (2**32, 2**32 + 1, -1, 64):\n"
        "        try:\n"
        "            f(d)\n"
        "        except (ValueError, OverflowError):\n"
        "            continue\n"
        "        raise SystemExit(f'{f.__name__}({d}) accepted')\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)


def test_a_take_back_ticks_the_free_blocks_clock(sim: Any) -> None:
    """Each malloc ticks its free list's clock (the ages garbage_collection_threshold compares);
    a parked block taken back is a malloc too, through graphpool or through the lane, so the
    clock reads as if every free had been queued."""
    a = runtime.allocator(0)
    s = gp.Stream()
    size = 2 << 20  # a large block
    p = a.malloc(size, stream=s.handle)
    before = a._large.calls
    for _ in range(3):
        assert a.park(p) == size
        assert a.malloc(size, stream=s.handle) == p
    assert a._large.calls - before == 3
    a.free(p)


def test_only_the_block_handed_out_last_is_offered_for_parking(shim: Any, counted: Counted, lib: Any) -> None:
    """A free of an older block is queued without the lock, as drop queues it (the hooks offer
    parking only for the block they handed out last, where the next request may be the same);
    with a block parked, it is queued behind it."""
    s, t = gp.Stream(), gp.Stream()
    a = runtime.allocator(0)
    p = lib.graphpool_torch_malloc(512, 0, t.handle)
    q = lib.graphpool_torch_malloc(512, 0, s.handle)
    lib.graphpool_torch_free(p, 512, 0, t.handle)  # not the last handed out: queued
    assert a._parked is None and list(a._pending) == [p]
    assert shim.lane_state(0)["state"] == "empty"
    gp.memory_stats()  # carries it out
    lib.graphpool_torch_free(q, 512, 0, s.handle)  # the last handed out: parked
    assert a._parked is not None and a._parked.ptr == q
    r = lib.graphpool_torch_malloc(1024, 0, s.handle)  # another request: q's free is queued first
    assert a._parked is None and counted.mallocs == 3
    lib.graphpool_torch_free(r, 1024, 0, s.handle)
    gp.check_invariants()

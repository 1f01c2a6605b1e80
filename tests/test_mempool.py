"""Pools as objects (gp.MemPool, gp.use_mem_pool) and their upstreams. Every `backend` test runs
on the simulator and, marked `gpu`, on a GPU, with the same assertions."""

from __future__ import annotations

import dataclasses
import gc
import os
import select
import signal
import threading
from typing import Any

import pytest

import graphpool as gp
from graphpool import runtime
from graphpool.policy.private_pools import PoolId, mempools
from simenv import fresh_sim

KiB = 1024
MiB = 1024 * KiB


def _dev() -> Any:
    return runtime.get().device(gp.current_device())


def _pool_ptrs(pool: gp.MemPool) -> set[int]:
    """Start addresses of every block in the pool's segments."""
    return {b["address"] for seg in pool.snapshot() for b in seg["blocks"]}


def _in_pool(pool: gp.MemPool, ptr: int) -> bool:
    return any(seg["address"] <= ptr < seg["address"] + seg["total_size"] for seg in pool.snapshot())


def _read(buf: gp.DeviceBuffer) -> bytes:
    return _dev().read(buf.ptr, buf.nbytes, buf.stream.handle)


class CountingUpstream:
    """A user upstream over the device's own malloc/free, counting its calls (PyTorch's
    pluggable allocator pair's shape); ``fail`` makes malloc raise, ``answer`` return that."""

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.mallocs = 0
        self.frees: list[tuple[int, int, int, int]] = []
        self.fail = False
        self.answer: object = None

    def malloc(self, nbytes: int, device: int, stream: int) -> object:
        self.mallocs += 1
        if self.fail:
            raise RuntimeError("registered memory exhausted")
        if callable(self.answer):
            return self.answer(nbytes)
        if self.answer is not None:
            return self.answer
        ptr = runtime.get().device(device).malloc(nbytes)
        if ptr is not None:
            self.live[ptr] = nbytes
        return ptr

    def free(self, ptr: int, nbytes: int, device: int, stream: int) -> None:
        assert self.live.pop(ptr) == nbytes, "freed with another size than it was made with"
        self.frees.append((ptr, nbytes, device, stream))
        runtime.get().device(device).free(ptr)


def test_a_mempool_is_a_pool_id_and_counts_its_users(backend: Any) -> None:
    p = gp.MemPool()
    assert isinstance(p.id, PoolId) and p.id.graph == 0 and p.id.handle > 0
    assert p.upstream == "device" and p.use_on_oom is False
    assert repr(p) == f"MemPool(id={tuple(p.id)}, upstream='device', use_on_oom=False)"
    assert p.use_count() == 1  # the MemPool itself
    with gp.use_mem_pool(p) as entered:
        assert entered is p
        assert p.use_count() == 2
        with gp.use_mem_pool(p):  # nests
            assert p.use_count() == 3
        assert p.use_count() == 2
    assert p.use_count() == 1
    assert gp.memory_stats(pool=p) == p.memory_stats() == gp.memory_stats(pool=p.id)
    assert p.id != gp.MemPool().id


def test_allocations_inside_come_from_the_pool_and_only_there(backend: Any) -> None:
    p = gp.MemPool()
    with gp.use_mem_pool(p):
        a = gp.alloc(3000)
    assert _in_pool(p, a.ptr)
    st = p.memory_stats()
    assert st["allocated_bytes.all.current"] == 3072 and st["allocation.all.current"] == 1
    assert st["reserved_bytes.all.current"] > 0
    where = a.ptr
    a.free()
    outside = gp.alloc(3000)  # the pool's free block is never handed to code outside it
    assert not _in_pool(p, outside.ptr)
    with gp.use_mem_pool(p):
        again = gp.alloc(3000)  # inside, it is reused as in the default pool
    assert again.ptr == where
    assert gp.memory_stats()["allocated_bytes.all.current"] >= 2 * 3072  # the device counts both
    gp.check_invariants()


def test_nested_pools_innermost_wins_and_exit_order_is_enforced(backend: Any) -> None:
    p, q = gp.MemPool(), gp.MemPool()
    with gp.use_mem_pool(p):
        a = gp.alloc(1000)
        with gp.use_mem_pool(q):
            b = gp.alloc(1000)
        c = gp.alloc(1000)
    assert _in_pool(p, a.ptr) and _in_pool(q, b.ptr) and _in_pool(p, c.ptr)
    outer, inner = gp.use_mem_pool(p), gp.use_mem_pool(q)
    outer.__enter__()
    inner.__enter__()
    with pytest.raises(RuntimeError, match="reverse order"):
        outer.__exit__(None, None, None)
    assert p.use_count() == 2 and q.use_count() == 2  # the refused exit changed nothing
    inner.__exit__(None, None, None)
    outer.__exit__(None, None, None)
    assert p.use_count() == q.use_count() == 1
    gp.check_invariants()


def test_other_threads_are_unaffected(backend: Any) -> None:
    p = gp.MemPool()
    entered, done = threading.Event(), threading.Event()
    got: list[int] = []

    def other() -> None:
        entered.wait()
        buf = gp.alloc(2000)
        got.append(buf.ptr)
        buf.free()
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with gp.use_mem_pool(p):
        entered.set()
        done.wait()
        mine = gp.alloc(2000)
    t.join()
    assert not _in_pool(p, got[0]) and _in_pool(p, mine.ptr)


def test_graphs_capture_into_a_mempool_by_object_or_id(backend: Any) -> None:
    p = gp.MemPool()
    s = gp.Stream()
    g1, g2 = gp.CUDAGraph(), gp.CUDAGraph()
    with gp.graph(g1, pool=p, stream=s):
        x = gp.alloc(4096)
        _dev().memset(x.ptr, 1, x.nbytes, s.handle)
    with gp.graph(g2, pool=p.id, stream=s):
        y = gp.alloc(4096)
        _dev().memset(y.ptr, 2, y.nbytes, s.handle)
    assert g1.pool() == g2.pool() == p.id
    assert _in_pool(p, x.ptr) and _in_pool(p, y.ptr)
    assert p.use_count() == 3  # the MemPool and two graphs
    del g1, g2
    gc.collect()
    assert p.use_count() == 1
    x.free()
    y.free()


def test_memory_a_graph_touches_is_never_handed_to_eager_code_in_the_pool(backend: Any) -> None:
    """The capture rule inside a MemPool: a graph's temporary, freed during its capture, is
    rewritten by every replay; eager allocations in use_mem_pool never get it."""
    p = gp.MemPool()
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.graph(g, pool=p, stream=s):
        tmp = gp.alloc(64 * KiB)
        _dev().memset(tmp.ptr, 0xAB, tmp.nbytes, s.handle)
        graph_ptr = tmp.ptr
        tmp.free()
    with gp.stream(s), gp.use_mem_pool(p):
        mine = gp.alloc(64 * KiB)
        assert mine.ptr != graph_ptr
        _dev().memset(mine.ptr, 0x11, mine.nbytes, s.handle)
        g.replay()
        assert set(_read(mine)) == {0x11}  # the replay wrote the graph's own block only
    st = p.memory_stats()
    assert st["allocation.all.current"] == 1
    gp.check_invariants()


def test_an_eager_pool_block_freed_during_a_capture_is_kept_for_the_graph(backend: Any) -> None:
    p = gp.MemPool()
    s = gp.Stream()
    with gp.stream(s), gp.use_mem_pool(p):
        eager = gp.alloc(8 * KiB)
    where = eager.ptr
    g = gp.CUDAGraph()
    with gp.graph(g, pool=p, stream=s):
        _dev().memset(where, 7, 8 * KiB, s.handle)  # the graph writes the eager block
        eager.free()
    with gp.stream(s), gp.use_mem_pool(p):
        other = gp.alloc(8 * KiB)
    assert other.ptr != where  # kept: every replay writes it
    other.free()
    g.reset()
    gc.collect()
    with gp.stream(s), gp.use_mem_pool(p):
        back = gp.alloc(8 * KiB)
    assert back.ptr == where  # the graph is gone: the block is the pool's again
    gp.check_invariants()


def test_a_capture_routes_first_inside_use_mem_pool(backend: Any) -> None:
    p = gp.MemPool()
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.use_mem_pool(p), gp.graph(g, stream=s):
        captured = gp.alloc(4096)  # on the capturing stream: the graph's own pool
        _dev().memset(captured.ptr, 0, 4096, s.handle)
    assert not _in_pool(p, captured.ptr)
    assert g.pool() != p.id
    assert p.memory_stats()["allocation.all.current"] == 0


def test_dropping_the_mempool_gives_its_memory_back_once_freed(backend: Any) -> None:
    gc.collect()
    gp.empty_cache()
    reserved = gp.memory_reserved()
    p = gp.MemPool()
    pid = p.id
    with gp.use_mem_pool(p):
        bufs = [gp.alloc(n) for n in (1000, 200 * KiB, 3 * MiB)]
    assert gp.memory_reserved() > reserved
    del p
    gc.collect()
    assert pid not in mempools
    gp.empty_cache()
    assert gp.memory_reserved() > reserved  # live blocks keep their segments
    for b in bufs:
        b.free()
    gp.empty_cache()
    assert gp.memory_reserved() == reserved
    assert pid not in {pool.id for pool in runtime.allocator(gp.current_device()).private_pools()}
    gp.check_invariants()


def test_a_graph_keeps_a_dropped_mempools_pool(backend: Any) -> None:
    p = gp.MemPool()
    pid = p.id
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.graph(g, pool=p, stream=s):
        t = gp.alloc(4096)
        _dev().memset(t.ptr, 3, 4096, s.handle)
        t.free()
    del p
    gc.collect()
    gp.empty_cache()
    a = runtime.allocator(gp.current_device())
    assert pid in {pool.id for pool in a.private_pools()}
    assert gp.memory_stats(pool=pid)["use_count"] == 1  # the graph's use only
    gp.check_invariants()  # (the pool's use count against its users)
    g.replay()
    g.reset()
    gc.collect()
    gp.synchronize()
    gp.empty_cache()
    assert pid not in {pool.id for pool in a.private_pools()}


def test_use_mem_pool_of_a_dropped_mempools_id_is_refused_while_its_pool_lives_on(backend: Any) -> None:
    """A MemPool dropped (collected) while a block of it lives: its pool stays on the device for
    that block, but no MemPool owns it. Entering it by id (use_mem_pool's allocator call) is
    refused with a ValueError that says so, as it is once the pool has gone, and changes
    nothing: the thread's next allocation comes from outside the pool."""
    p = gp.MemPool()
    pid = p.id
    with gp.use_mem_pool(p):
        buf = gp.alloc(4096)
    del p
    gc.collect()
    a = runtime.allocator(gp.current_device())
    assert pid not in mempools and pid in {q.id for q in a.private_pools()}
    before = gp.memory_stats(pool=pid)
    assert before["use_count"] == 0 and before["allocated_bytes.all.current"] == buf.nbytes
    with pytest.raises(ValueError) as info:
        a.enter_pool(pid)
    assert str(info.value) == (
        f"{tuple(pid)} is not the id of a live MemPool: that MemPool was dropped (collected); "
        "its pool lives on only for its users"
    )
    out = gp.alloc(4096)  # no entry was left: the ordinary pool serves
    assert gp.memory_stats(pool=pid) == before
    out.free()
    buf.free()
    gp.empty_cache()
    assert pid not in {q.id for q in a.private_pools()}
    with pytest.raises(ValueError, match=r"is not the id of a live MemPool$"):
        a.enter_pool(pid)
    gp.check_invariants()


def test_a_live_pool_keeps_its_cache_until_the_device_is_full(backend: Any) -> None:
    """As PyTorch's: empty_cache (and gp.graph's, as a capture begins) leaves a live MemPool its
    free segments; the out-of-memory retry takes the eager side's back; dropping the pool
    gives them all back at the next empty_cache."""
    gc.collect()
    gp.empty_cache()
    reserved = gp.memory_reserved()
    p = gp.MemPool()
    with gp.use_mem_pool(p):
        gp.alloc(3 * MiB).free()
    held = gp.memory_reserved()
    assert held > reserved
    gp.empty_cache()
    g = gp.CUDAGraph()
    s = gp.Stream()
    with gp.graph(g, stream=s):
        t = gp.alloc(512)
        _dev().memset(t.ptr, 0, 512, s.handle)
    t.free()
    g.reset()
    gc.collect()
    gp.empty_cache()
    assert gp.memory_reserved() == held  # kept through both
    gp.set_memory_limit(held)  # the device is "full" for graphpool: the retry takes it back
    try:
        x = gp.alloc(3 * MiB)  # a new segment: refused until the pool gives its own back
    finally:
        gp.set_memory_limit(None)
    assert p.memory_stats()["reserved_bytes.all.current"] == 0
    assert p.memory_stats()["num_alloc_retries"] == 0 and gp.memory_stats()["num_alloc_retries"] >= 1
    x.free()
    with gp.use_mem_pool(p):
        gp.alloc(3 * MiB).free()
    del p
    gc.collect()
    gp.empty_cache()
    assert gp.memory_reserved() == reserved


def test_use_on_oom_lets_outside_allocations_take_the_pools_free_blocks(backend: Any) -> None:
    gc.collect()
    gp.empty_cache()
    for flag in (False, True):
        p = gp.MemPool(use_on_oom=flag)
        with gp.use_mem_pool(p):
            big = gp.alloc(4 * MiB)
            keep = gp.alloc(2 * MiB)  # in big's segment: the OOM retry cannot give it back
        where = big.ptr
        big.free()
        gp.set_memory_limit(gp.memory_reserved())  # the device is "full" for graphpool
        try:
            if flag:
                out = gp.alloc(2 * MiB)
                assert _in_pool(p, out.ptr) and out.ptr == where
                out.free()  # back to the pool's own list
                with gp.use_mem_pool(p):
                    assert gp.alloc(2 * MiB).ptr == where
            else:
                with pytest.raises(gp.OutOfMemoryError):
                    gp.alloc(2 * MiB)
        finally:
            gp.set_memory_limit(None)
        keep.free()
        gp.check_invariants()
        del p
        gc.collect()
        gp.empty_cache()


def test_managed_memory_upstream(backend: Any) -> None:
    p = gp.MemPool(upstream="managed")
    assert p.upstream == "managed"
    s = gp.current_stream()
    with gp.use_mem_pool(p):
        buf = gp.alloc(64 * KiB)
    _dev().memset(buf.ptr, 0x5A, buf.nbytes, s.handle)
    s.synchronize()
    view = _dev().host_view(buf.ptr, buf.nbytes)  # the host reads managed memory directly
    assert set(bytes(view)) == {0x5A}
    view[:4] = b"\x01\x02\x03\x04"
    assert _read(buf)[:4] == b"\x01\x02\x03\x04"
    with pytest.raises(gp.IpcError, match="private pool"):
        buf.ipc_handle()
    buf.free()
    del p, view
    gc.collect()
    gp.empty_cache()
    gp.check_invariants()


def test_a_user_upstream_makes_and_takes_back_the_segments(backend: Any) -> None:
    up = CountingUpstream()
    p = gp.MemPool(upstream=up)
    assert p.upstream is up
    s = gp.Stream()
    with gp.use_mem_pool(p):
        a = gp.alloc(1000, stream=s)
        b = gp.alloc(5 * MiB, stream=s)
    assert up.mallocs == 2 and len(up.live) == 2
    assert all(_in_pool(p, x.ptr) for x in (a, b))
    a.free()
    b.free()
    gp.empty_cache()
    assert len(up.live) == 2  # a live pool keeps its cache
    del p
    gc.collect()
    gp.empty_cache()
    assert up.live == {} and len(up.frees) == 2
    assert {f[2] for f in up.frees} == {gp.current_device()} and {f[3] for f in up.frees} == {s.handle}
    gp.check_invariants()


@pytest.mark.parametrize("failure", ["raises", "zero", "not-an-int", "too-large", "past-int64", "overlaps"])
def test_a_failing_upstream_is_a_clear_out_of_memory_and_loses_nothing(backend: Any, failure: str) -> None:
    up = CountingUpstream()
    p = gp.MemPool(upstream=up)
    with gp.use_mem_pool(p):
        first = gp.alloc(1000)
    before = gp.memory_stats()
    if failure == "raises":
        up.fail = True
    elif failure == "zero":
        up.answer = 0
    elif failure == "not-an-int":
        up.answer = "0x1000"
    elif failure == "too-large":
        up.answer = 1 << 80  # an int, but no address (compiled, a Block refused it deep inside)
    elif failure == "past-int64":
        up.answer = lambda nbytes: (1 << 63) - nbytes  # its last byte would be 2**63: not 64-bit signed
    else:
        up.answer = first.ptr  # memory graphpool already holds
    with gp.use_mem_pool(p), pytest.raises(gp.OutOfMemoryError, match="MemPool") as info:
        gp.alloc(4 * MiB)
    cause = info.value.__cause__
    if failure == "raises":
        assert isinstance(cause, RuntimeError) and "registered memory" in str(cause)
    elif failure in ("not-an-int", "too-large", "past-int64"):
        assert isinstance(cause, TypeError)
    elif failure == "overlaps":
        assert isinstance(cause, ValueError) and "overlaps" in str(cause)
    gp.check_invariants()
    after = gp.memory_stats()
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert after["segment.all.current"] == before["segment.all.current"]
    up.fail, up.answer = False, None
    with gp.use_mem_pool(p):
        ok = gp.alloc(4 * MiB)  # the upstream works again: so does the pool
    ok.free()
    first.free()
    del p
    gc.collect()
    gp.empty_cache()
    assert up.live == {}


def test_an_upstream_failure_retried_away_is_no_cause_of_a_later_out_of_memory(backend: Any) -> None:
    """The upstream refused once and the retry got the segment: a later, unrelated out of memory
    (outside the pool, or a request larger than the device) must not chain that old exception."""
    up = CountingUpstream()
    real = up.malloc

    def flaky(nbytes: int, device: int, stream: int) -> object:
        up.fail = up.mallocs == 0  # only the first call raises
        return real(nbytes, device, stream)

    up.malloc = flaky  # type: ignore[method-assign]
    p = gp.MemPool(upstream=up)
    with gp.use_mem_pool(p):
        buf = gp.alloc(1000)  # raised once, then the retry succeeded
    assert up.mallocs == 2 and _in_pool(p, buf.ptr)
    with pytest.raises(gp.OutOfMemoryError) as too_large:
        gp.alloc(runtime.allocator(gp.current_device())._total + 1)
    assert too_large.value.__cause__ is None
    with gp.use_mem_pool(p):
        gp.alloc(1000).free()
    up.fail, up.mallocs = False, 0
    with gp.use_mem_pool(p):
        buf2 = gp.alloc(8 * MiB)  # fails once more, then succeeds
    gp.set_memory_limit(gp.memory_reserved())
    try:
        with pytest.raises(gp.OutOfMemoryError) as full:
            gp.alloc(4 * MiB)  # the ordinary pool: no upstream of any MemPool is to blame
    finally:
        gp.set_memory_limit(None)
    assert full.value.__cause__ is None
    buf.free()
    buf2.free()
    gp.check_invariants()


def test_the_default_upstream_by_name(backend: Any) -> None:
    p = gp.MemPool(upstream="device")
    assert p.upstream == "device" and repr(p).endswith("upstream='device', use_on_oom=False)")
    with gp.use_mem_pool(p):
        buf = gp.alloc(4096)
    assert _in_pool(p, buf.ptr)
    buf.free()
    del p
    gc.collect()
    gp.empty_cache()
    gp.check_invariants()


def test_managed_memory_used_up_is_an_out_of_memory_counted_in_the_pool() -> None:
    from graphpool.sim import SimBackend

    runtime.set_backend("sim", backend=SimBackend(memory_bytes=64 * MiB, host_memory_bytes=8 * MiB))
    try:
        m = gp.MemPool(upstream="managed")
        with gp.use_mem_pool(m):
            for _ in range(2):
                with pytest.raises(gp.OutOfMemoryError):
                    gp.alloc(16 * MiB)  # the device has room, the managed range has not
        assert m.memory_stats()["num_ooms"] == 2  # each counted in the pool too
        del m
        gc.collect()
        gp.check_invariants()
    finally:
        gp.set_backend("sim")


def test_a_pools_statistics_and_segments_on_another_device() -> None:
    with fresh_sim(2):
        p = gp.MemPool()
        with gp.device(1), gp.use_mem_pool(p):
            buf = gp.alloc(4096)
        assert p.memory_stats(1)["allocated_bytes.all.current"] == 4096
        assert p.memory_stats()["allocated_bytes.all.current"] == 0  # device 0's
        assert len(p.snapshot(1)) == 1 and p.snapshot() == []
        buf.free()
        del p
        gc.collect()


def test_bad_arguments_are_refused(backend: Any) -> None:
    with pytest.raises(ValueError, match="upstream"):
        gp.MemPool(upstream="pinned")
    with pytest.raises(TypeError, match="malloc"):
        gp.MemPool(upstream=object())
    with pytest.raises(TypeError, match="use_on_oom"):
        gp.MemPool(use_on_oom=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"^use_mem_pool takes a MemPool, not tuple$"):
        gp.use_mem_pool((0, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="graph pool"):
        _enter_graph_pool()
    with pytest.raises(ValueError, match="live MemPool"):
        runtime.allocator(gp.current_device()).enter_pool(gp.graph_pool_handle())
    gp.check_invariants()


def test_ensure_pool_refuses_the_id_of_no_pool_and_no_live_mempool(backend: Any) -> None:
    gone = gp.graph_pool_handle()
    with pytest.raises(ValueError) as info:
        runtime.allocator(gp.current_device()).ensure_pool(gone)
    assert str(info.value) == f"no private pool {tuple(gone)} on device {gp.current_device()}"


def _enter_graph_pool() -> None:
    """use_mem_pool's allocator call with a graph's pool: refused (only MemPools have an eager side)."""
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.graph(g, stream=s):
        t = gp.alloc(512)
        _dev().memset(t.ptr, 0, 512, s.handle)
    try:
        runtime.allocator(gp.current_device()).enter_pool(g.pool())
    finally:
        t.free()
        g.reset()


def test_snapshot_lists_only_the_pools_segments(backend: Any) -> None:
    p = gp.MemPool()
    outside = gp.alloc(1000)
    with gp.use_mem_pool(p):
        inside = gp.alloc(1000)
    segs = p.snapshot()
    assert len(segs) == 1 and segs[0]["segment_pool_id"] == tuple(p.id)
    assert segs[0]["address"] <= inside.ptr < segs[0]["address"] + segs[0]["total_size"]
    assert not _in_pool(p, outside.ptr)
    assert set(segs[0]) == set(gp.memory_snapshot()[0])  # the same layout


def test_a_snapshot_tells_the_eager_side_from_the_graph_side(backend: Any) -> None:
    """Both sides of a MemPool carry its id; ``eager_side`` says which side a segment is."""
    p = gp.MemPool()
    s = gp.Stream()
    g = gp.CUDAGraph()
    ordinary = gp.alloc(1000, s)
    with gp.stream(s), gp.use_mem_pool(p):
        eager = gp.alloc(1000)
    with gp.graph(g, pool=p, stream=s):
        captured = gp.alloc(1000)
        _dev().memset(captured.ptr, 1, captured.nbytes, s.handle)

    def side(snapshot: list[dict[str, Any]], ptr: int) -> bool:
        (seg,) = [x for x in snapshot if x["address"] <= ptr < x["address"] + x["total_size"]]
        return bool(seg["eager_side"])

    segs = p.snapshot()
    assert {seg["segment_pool_id"] for seg in segs} == {tuple(p.id)} and len(segs) == 2
    assert side(segs, eager.ptr) and not side(segs, captured.ptr)
    assert not side(gp.memory_snapshot(), ordinary.ptr)
    torch_segs = gp.torch_snapshot()["segments"]
    assert side(torch_segs, eager.ptr) and not side(torch_segs, captured.ptr)
    for buf in (ordinary, eager, captured):
        buf.free()
    g.reset()


def test_the_mempools_of_integrations_follow_use_mem_pool(backend: Any) -> None:
    """Arrays of the backend's array library (CuPy on the GPU, the simulator's xp) allocate
    through graphpool: inside use_mem_pool they come from the pool."""
    xp = backend.xp
    p = gp.MemPool()
    with gp.use_mem_pool(p):
        arr = xp.zeros(4096, dtype="float32")
    assert _in_pool(p, int(arr.data.ptr))
    outside = xp.zeros(4096, dtype="float32")
    assert not _in_pool(p, int(outside.data.ptr))


def test_a_block_left_without_its_exit_ends_at_the_next_call(backend: Any) -> None:
    """Python skips __exit__ when an exception (a KeyboardInterrupt) comes between a with-block's
    last statement and the call: the block's finalizer queues the exit, and the next allocator
    call ends the entry before it is routed."""
    p = gp.MemPool()
    block = gp.use_mem_pool(p)
    block.__enter__()
    with pytest.raises(RuntimeError, match="open already"):
        block.__enter__()
    assert p.use_count() == 2
    del block  # never exited
    gc.collect()
    b = gp.alloc(4096)
    assert not _in_pool(p, b.ptr)
    assert p.use_count() == 1
    with gp.use_mem_pool(p):  # nested entries: the abandoned one (the inner) goes, the outer stays
        inner = gp.use_mem_pool(p)
        inner.__enter__()
        del inner
        gc.collect()
        assert _in_pool(p, gp.alloc(4096).ptr)
        assert p.use_count() == 2
    assert p.use_count() == 1
    gp.check_invariants()


def _suspended_inside(pool: gp.MemPool) -> Any:
    """A generator suspended inside ``use_mem_pool(pool)``: its block stays open until it is
    closed, on whichever thread closes it."""
    with gp.use_mem_pool(pool):
        yield


def test_a_block_closed_on_another_thread_ends_the_entering_threads_entry(backend: Any) -> None:
    """A generator entered use_mem_pool on a worker and is closed on this thread: the entry is
    the worker's, and the close ends it (it raised RuntimeError: this thread had none)."""
    p = gp.MemPool()
    gens: list[Any] = []
    entered, closed, done = threading.Event(), threading.Event(), threading.Event()
    where: list[bool] = []

    def worker() -> None:
        g = _suspended_inside(p)
        next(g)
        gens.append(g)
        entered.set()
        closed.wait(10)
        buf = gp.alloc(4096)  # the worker's block is over: the ordinary pool again
        where.append(_in_pool(p, buf.ptr))
        buf.free()
        done.set()

    t = threading.Thread(target=worker)
    t.start()
    entered.wait(10)
    assert p.use_count() == 2
    gens[0].close()  # GeneratorExit runs the block's __exit__ here
    closed.set()
    done.wait(10)
    t.join(10)
    assert where == [False]
    assert p.use_count() == 1
    gp.check_invariants()


def test_a_thread_that_ends_inside_a_block_leaves_no_entry(backend: Any) -> None:
    """A thread ended while a generator it ran is suspended inside use_mem_pool: its entry ends
    with it (CPython gives a later thread the dead one's ident, whose allocations then went to
    the pool), and closing the generator later changes nothing."""
    p = gp.MemPool()
    gens: list[Any] = []

    def worker() -> None:
        g = _suspended_inside(p)
        next(g)
        gens.append(g)

    t = threading.Thread(target=worker)
    t.start()
    t.join(10)
    assert p.use_count() == 1  # the dead thread's entry is gone
    assert runtime.allocator(gp.current_device())._thread_pools == {}
    outside: list[bool] = []

    def later() -> None:  # one of these usually gets the dead thread's ident
        buf = gp.alloc(4096)
        outside.append(not _in_pool(p, buf.ptr))
        buf.free()

    for _ in range(8):
        u = threading.Thread(target=later)
        u.start()
        u.join(10)
    assert outside == [True] * 8
    gens[0].close()  # the block's __exit__: nothing left to end
    assert p.use_count() == 1
    gp.check_invariants()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_childs_new_thread_does_not_inherit_a_parent_threads_pool(sim: Any) -> None:
    """Only the forking thread lives in a forked child, and a new thread there may get the
    ident of a parent thread that was inside use_mem_pool: its allocations must not go to
    that pool, and the dead thread's entry no longer counts as a use of it."""
    p = gp.MemPool()
    entered, release = threading.Event(), threading.Event()
    idents: list[int] = []

    def inside() -> None:
        idents.append(threading.get_ident())
        with gp.use_mem_pool(p):
            entered.set()
            release.wait(10)

    t = threading.Thread(target=inside)
    t.start()
    entered.wait(10)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave at once
        code = b"?"
        try:
            seen: list[tuple[bool, bool]] = []

            def new_thread() -> None:
                buf = gp.alloc(4096)
                seen.append((threading.get_ident() == idents[0], _in_pool(p, buf.ptr)))
                buf.free()

            c = threading.Thread(target=new_thread)
            c.start()
            c.join()
            gp.check_invariants()
            code = b"%d%d%d" % (seen[0][0], seen[0][1], p.use_count())
        finally:
            os.write(w, code)
            os._exit(0)
    os.close(w)
    answered = select.select([r], [], [], 20)[0]
    got = os.read(r, 8) if answered else b""
    if not answered:
        os.kill(pid, signal.SIGKILL)
    os.close(r)
    os.waitpid(pid, 0)
    release.set()
    t.join(10)
    assert got[1:] == b"01", got  # not in the pool; the pool's one use left is the MemPool's
    assert p.use_count() == 1  # the parent's thread exited its block as usual


class _CollectsInside(list):  # type: ignore[type-arg]
    """A MemPool's ``places`` whose lookup runs a garbage collection: the MemPool's finalizer
    then runs while an allocator makes its pool, as any allocation there may make it run."""

    def __contains__(self, item: object) -> bool:
        gc.collect()
        return super().__contains__(item)


def test_a_mempool_collected_while_a_device_makes_its_pool_is_dropped_there_too(backend: Any) -> None:
    """A capture into a MemPool's id on a device where its pool is not made yet, while the
    MemPool (garbage in a cycle) is collected by a collection inside the making: that device's
    pool counted the MemPool's use for good (its finalizer had passed it by), so the pool and
    its segments stayed after the graph was gone."""
    if runtime.get().count < 2:
        pytest.skip("host has too few GPUs: needs two devices")
    p = gp.MemPool()  # made on device 0
    pid = p.id
    mempools[pid].places = _CollectsInside(mempools[pid].places)
    p.cycle = p  # type: ignore[attr-defined]  # collected only by a collection
    del p
    s = gp.Stream(device=1)
    g = gp.CUDAGraph()
    gc.disable()  # the collection comes where the hook says, not before
    try:
        with gp.stream(s):
            g.capture_begin(pool=pid)  # device 1 makes the pool: the MemPool goes meanwhile
            t = gp.alloc(4096)
            runtime.get().device(1).memset(t.ptr, 0, 4096, s.handle)
            t.free()
            g.capture_end()
    finally:
        gc.enable()
    assert pid not in mempools
    a1 = runtime.allocator(1)
    assert gp.memory_stats(device=1, pool=pid)["use_count"] == 1  # the graph alone
    g.reset()
    del g
    gc.collect()
    gp.synchronize(1)
    gp.empty_cache()
    with gp.device(1):
        gp.empty_cache()
    assert pid not in {pool.id for pool in a1.private_pools()}
    gp.check_invariants()


def test_stats_on_another_device_and_copies(backend: Any) -> None:
    import copy
    import pickle

    p = gp.MemPool()
    last = gp.device_count() - 1
    assert gp.memory_stats(device=last, pool=p) == p.memory_stats(last)  # made there on demand
    assert copy.copy(p) is p and copy.deepcopy(p) is p
    with pytest.raises(TypeError, match="pickled"):
        pickle.dumps(p)


def test_use_on_oom_with_expandable_segments() -> None:
    """The same fallback when the ordinary pool's segments are expandable: the range cannot
    grow under the limit, so the allocation takes the pool's free block of its stream."""
    from graphpool.policy.pools import DEFAULT

    with fresh_sim(1, sizes=dataclasses.replace(DEFAULT, expandable_segments=True)):
        p = gp.MemPool(use_on_oom=True)
        with gp.use_mem_pool(p):
            big = gp.alloc(4 * MiB)
            keep = gp.alloc(2 * MiB)
        where = big.ptr
        big.free()
        gp.set_memory_limit(gp.memory_reserved())
        try:
            out = gp.alloc(2 * MiB)
            assert _in_pool(p, out.ptr) and out.ptr == where
            out.free()
        finally:
            gp.set_memory_limit(None)
        keep.free()
        gp.check_invariants()
        del p
        gc.collect()


def test_an_upstream_without_free_is_refused_by_name(backend: Any) -> None:
    """An object with ``malloc`` but no ``free`` is no upstream: the same TypeError as for one
    with neither (not an AttributeError from the lookup)."""

    class MallocOnly:
        def malloc(self, nbytes: int, device: int, stream: int) -> int:
            return 0

    with pytest.raises(TypeError, match=r"not MallocOnly$"):
        gp.MemPool(upstream=MallocOnly())


def test_use_count_counts_on_the_device_asked() -> None:
    """use_count(1) counts the users on device 1: a use_mem_pool block open there."""
    with fresh_sim(2):
        p = gp.MemPool()
        with gp.device(1), gp.use_mem_pool(p):
            assert p.use_count(1) == 2 and p.use_count(0) == 1
        assert p.use_count(1) == 1
        del p
        gc.collect()


def test_a_block_entered_and_left_on_a_new_thread_ends_its_entry(backend: Any) -> None:
    """The first use_mem_pool of a thread makes its life marker alive: leaving the block ends
    the entry, so the thread allocates outside the pool again."""
    p = gp.MemPool()
    seen: list[object] = []

    def worker() -> None:
        with gp.use_mem_pool(p):
            inside = gp.alloc(4096)
        outside = gp.alloc(4096)
        seen.extend([_in_pool(p, inside.ptr), _in_pool(p, outside.ptr), p.use_count()])
        inside.free()
        outside.free()

    t = threading.Thread(target=worker)
    t.start()
    t.join(10)
    assert seen == [True, False, 1]
    gp.check_invariants()


def test_a_use_mem_pool_block_can_be_entered_again_once_left(backend: Any) -> None:
    """Leaving a block resets it: the same object opens again (no "open already")."""
    p = gp.MemPool()
    block = gp.use_mem_pool(p)
    for _ in range(2):
        with block:
            assert p.use_count() == 2
        assert p.use_count() == 1
    gp.check_invariants()


def test_a_thread_ending_inside_blocks_on_two_devices_ends_both_entries() -> None:
    """A thread that dies inside use_mem_pool blocks on two devices: each device's allocator
    is told, so neither keeps the dead thread's entry (nor counts it as a use)."""
    with fresh_sim(2):
        p = gp.MemPool()
        gens: list[Any] = []

        def inside(device: int) -> Any:
            with gp.device(device), gp.use_mem_pool(p):
                yield

        def worker() -> None:
            for d in (0, 1):
                g = inside(d)
                next(g)
                gens.append(g)

        t = threading.Thread(target=worker)
        t.start()
        t.join(10)
        gc.collect()
        assert (p.use_count(0), p.use_count(1)) == (1, 1)
        assert runtime.allocator(0)._thread_pools == {} and runtime.allocator(1)._thread_pools == {}
        for g in gens:
            g.close()
        gp.check_invariants(0)
        gp.check_invariants(1)
        gens.clear()


def test_the_fork_hook_forgets_every_other_threads_entries_and_keeps_the_callers(backend: Any) -> None:
    """``_after_fork_in_child`` (run in a forked child), called here: the other threads' entries
    end at the allocator's next call; the calling thread's block stays open."""
    from graphpool import mempool

    p = gp.MemPool()
    entered, release = threading.Event(), threading.Event()
    blocks: list[Any] = []

    def inside() -> None:  # never leaves its block (in a forked child, the thread is gone)
        blocks.append(gp.use_mem_pool(p))
        blocks[0].__enter__()
        entered.set()
        release.wait(10)

    t = threading.Thread(target=inside)
    t.start()
    entered.wait(10)
    try:
        with gp.use_mem_pool(p):
            assert p.use_count() == 3
            mempool._after_fork_in_child()
            assert p.use_count() == 2  # the other thread's entry is gone, this one's stays
            buf = gp.alloc(4096)
            assert _in_pool(p, buf.ptr)
            buf.free()
    finally:
        release.set()
        t.join(10)
    blocks.clear()  # the block's finalizer: its thread is gone, nothing to end
    gc.collect()
    assert p.use_count() == 1
    gp.check_invariants()

"""Pools as objects (gp.MemPool, gp.use_mem_pool) and their upstreams. Every `backend` test runs
on the simulator and, marked `gpu`, on a GPU, with the same assertions."""

from __future__ import annotations

import gc
import threading
from typing import Any

import pytest

import graphpool as gp
from graphpool import runtime
from graphpool.policy.private_pools import PoolId, mempools

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
    g.replay()
    g.reset()
    gc.collect()
    gp.synchronize()
    gp.empty_cache()
    assert pid not in {pool.id for pool in a.private_pools()}


def test_empty_cache_returns_a_live_pools_free_eager_segments(backend: Any) -> None:
    gc.collect()
    gp.empty_cache()
    reserved = gp.memory_reserved()
    p = gp.MemPool()
    with gp.use_mem_pool(p):
        gp.alloc(3 * MiB).free()
    assert gp.memory_reserved() > reserved
    gp.empty_cache()
    assert gp.memory_reserved() == reserved
    assert p.use_count() == 1


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
    assert up.live == {} and len(up.frees) == 2
    assert {f[2] for f in up.frees} == {gp.current_device()} and {f[3] for f in up.frees} == {s.handle}
    gp.check_invariants()


@pytest.mark.parametrize("failure", ["raises", "zero", "not-an-int", "overlaps"])
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
    else:
        up.answer = first.ptr  # memory graphpool already holds
    with gp.use_mem_pool(p), pytest.raises(gp.OutOfMemoryError, match="MemPool") as info:
        gp.alloc(4 * MiB)
    cause = info.value.__cause__
    if failure == "raises":
        assert isinstance(cause, RuntimeError) and "registered memory" in str(cause)
    elif failure == "not-an-int":
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
    gp.empty_cache()
    assert up.live == {}


def test_an_upstream_failure_is_not_blamed_for_a_later_out_of_memory(backend: Any) -> None:
    """An upstream that raised once, then gave the retry its segment: an out-of-memory error of
    a later, unrelated request chains no cause (it chained the old exception before)."""

    class FlakyOnce(CountingUpstream):
        def malloc(self, nbytes: int, device: int, stream: int) -> object:
            self.fail, first = False, self.fail
            if first:
                self.mallocs += 1
                raise RuntimeError("transient upstream failure")
            return super().malloc(nbytes, device, stream)

    up = FlakyOnce()
    up.fail = True
    p = gp.MemPool(upstream=up)
    with gp.use_mem_pool(p):
        buf = gp.alloc(1000)  # the first call raises; the retry's call gives the segment
    assert up.mallocs == 2 and len(up.live) == 1
    with pytest.raises(gp.OutOfMemoryError) as info:
        gp.alloc(1 << 60)  # larger than any device
    assert info.value.__cause__ is None
    gp.set_memory_limit(gp.memory_reserved())
    try:
        with pytest.raises(gp.OutOfMemoryError) as info:
            gp.alloc(4 * MiB)  # outside the pool: the device's own refusal
    finally:
        gp.set_memory_limit(None)
    assert info.value.__cause__ is None
    buf.free()
    gp.empty_cache()
    assert up.live == {}


def test_bad_arguments_are_refused(backend: Any) -> None:
    with pytest.raises(ValueError, match="upstream"):
        gp.MemPool(upstream="pinned")
    with pytest.raises(TypeError, match="malloc"):
        gp.MemPool(upstream=object())
    with pytest.raises(TypeError, match="use_on_oom"):
        gp.MemPool(use_on_oom=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="MemPool"):
        gp.use_mem_pool((0, 1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="graph pool"):
        _enter_graph_pool()
    with pytest.raises(ValueError, match="live MemPool"):
        runtime.allocator(gp.current_device()).enter_pool(gp.graph_pool_handle())
    gp.check_invariants()


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

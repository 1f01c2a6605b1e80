"""Pools that cooperate: before raising out of memory, graphpool asks the process's other caches
to give memory back and retries once; its own release is a hook others call."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

import graphpool as gp
import twins
from graphpool import cooperate, runtime
from graphpool.policy import observers
from simenv import fresh_sim

MiB = 1024 * 1024


class OtherCache:
    """Another library's cache on the simulated device: raw device memory it holds free, and
    the releaser that gives it back."""

    def __init__(self, nbytes: int) -> None:
        self.dev = runtime.get().device(0)
        ptr = self.dev.malloc(nbytes)
        assert ptr is not None
        self.held = [(ptr, nbytes)]
        self.calls: list[int] = []
        self.stats_seen: list[int] = []

    def release(self, device: int) -> int:
        self.calls.append(device)
        self.stats_seen.append(gp.memory_stats(device)["num_ooms"])  # graphpool's lock is released
        freed = 0
        for ptr, n in self.held:
            self.dev.free(ptr)
            freed += n
        self.held = []
        return freed


@pytest.fixture
def small() -> Iterator[Any]:
    """A 64 MiB simulated device; cooperation on, no releaser or observer left behind."""
    with fresh_sim(1, 64 * MiB) as rt:
        gp.set_release_other_caches(True)
        try:
            yield rt
        finally:
            for fn in list(cooperate._releasers):
                gp.unregister_cache_releaser(fn)
            for ob in observers.current():
                gp.detach_out_of_memory_observer(ob)
            runtime._release_others = None


def test_other_caches_give_memory_back_and_the_allocation_succeeds(small: Any) -> None:
    other = OtherCache(40 * MiB)
    gp.register_cache_releaser(other.release)
    gp.register_cache_releaser(other.release)  # asked once
    seen: list[int] = []
    gp.attach_out_of_memory_observer(lambda device, requested, stats: seen.append(requested))
    buf = gp.alloc(40 * MiB)  # 24 MiB free: only with the other cache's memory
    assert other.calls == [0] and other.stats_seen == [0]
    stats = gp.memory_stats()
    assert stats["num_ooms"] == 0 and seen == []  # only a final failure counts
    assert stats["num_alloc_retries"] == 1  # graphpool's own retry; the second try fit at once
    buf.free()


def test_off_the_error_is_raised_and_no_one_is_asked(small: Any) -> None:
    other = OtherCache(40 * MiB)
    gp.register_cache_releaser(other.release)
    gp.set_release_other_caches(False)
    with pytest.raises(gp.OutOfMemoryError):
        gp.alloc(40 * MiB)
    assert other.calls == []
    assert gp.memory_stats()["num_ooms"] == 1


def test_nothing_released_counts_one_oom_and_one_retry(small: Any) -> None:
    calls: list[int] = []
    gp.register_cache_releaser(lambda device: calls.append(device) or 0)
    seen: list[int] = []
    gp.attach_out_of_memory_observer(lambda device, requested, stats: seen.append(stats["num_ooms"]))
    keep = gp.alloc(30 * MiB)
    with pytest.raises(gp.OutOfMemoryError, match="out of memory on device 0"):
        gp.alloc(40 * MiB)
    stats = gp.memory_stats()
    assert calls == [0]
    assert stats["num_ooms"] == 1 and seen == [1]  # counted once, observers told once
    assert stats["num_alloc_retries"] == 1  # graphpool's own retry only: nothing to retry after
    calls.clear()
    with pytest.raises(gp.OutOfMemoryError, match="more than the device"):
        gp.alloc(80 * MiB)  # no cache can make room for more than the device holds
    assert calls == []
    keep.free()


def test_a_failing_releaser_is_reported_and_the_others_are_asked(small: Any) -> None:
    other = OtherCache(40 * MiB)

    def broken(device: int) -> int:
        raise RuntimeError("broken releaser")

    gp.register_cache_releaser(broken)
    gp.register_cache_releaser(other.release)
    with pytest.warns(RuntimeWarning, match="broken releaser"):
        buf = gp.alloc(40 * MiB)
    assert other.calls == [0]
    buf.free()
    gp.unregister_cache_releaser(broken)
    with pytest.raises(ValueError):
        gp.unregister_cache_releaser(broken)
    with pytest.raises(TypeError):
        gp.register_cache_releaser(42)  # type: ignore[arg-type]


def test_a_limit_or_a_capture_asks_no_one(small: Any) -> None:
    other = OtherCache(8 * MiB)
    gp.register_cache_releaser(other.release)
    gp.set_memory_limit(16 * MiB)
    try:
        with pytest.raises(gp.OutOfMemoryError, match="limit"):
            gp.alloc(20 * MiB)  # other caches cannot raise graphpool's own cap
    finally:
        gp.set_memory_limit(None)
    assert other.calls == []
    s = gp.Stream()
    g = gp.CUDAGraph()
    with pytest.raises(gp.OutOfMemoryError, match="during graph capture"):
        with gp.graph(g, stream=s):
            gp.alloc(60 * MiB)  # freeing memory during a capture would invalidate it
    assert other.calls == []
    assert gp.memory_stats()["num_ooms"] == 2


def test_configuration_key(small: Any) -> None:
    runtime._release_others = None
    gp.set_allocator_config("release_other_caches:False")
    try:
        assert runtime.alloc_conf().release_other_caches is False
        assert runtime.allocator(0).release_others is None
        gp.set_allocator_config("release_other_caches:True")
        assert runtime.allocator(0).release_others is cooperate.release_other_caches
        with pytest.raises(ValueError, match="release_other_caches:maybe: use True or False"):
            gp.set_allocator_config("release_other_caches:maybe")
    finally:
        gp.set_allocator_config("")
    with pytest.raises(TypeError):
        gp.set_release_other_caches(1)  # type: ignore[arg-type]


def test_release_cached_memory_is_graphpools_hook(small: Any) -> None:
    gp.alloc(3 * MiB).free()
    gp.alloc(30 * MiB).free()
    assert gp.release_cached_memory() == 20 * MiB + 30 * MiB  # the two cached segments
    assert gp.memory_reserved() == 0
    assert gp.release_cached_memory(0) == 0
    keep = gp.alloc(1 * MiB)
    s = gp.Stream()
    g = gp.CUDAGraph()
    with gp.graph(g, stream=s):
        assert gp.release_cached_memory() == 0  # never raises during a capture
        runtime.get().device(0).memset(keep.ptr, 0, 512, s.handle)
    keep.free()
    del g


def test_cupys_default_pool_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """CuPy (the twin) caching 40 MiB of free blocks in its own pool, not through graphpool."""
    fake = twins.make_cupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    runtime.set_backend("cuda", backend=twins.SimAsCuda(device_count=1, memory_bytes=64 * MiB))
    try:
        a = fake.cuda.alloc(40 * MiB)  # CuPy's own pool
        del a  # cached free in CuPy's pool
        pool = fake.get_default_memory_pool()
        assert pool.total_bytes() == 40 * MiB and pool.used_bytes() == 0
        buf = gp.alloc(40 * MiB)
        assert pool.total_bytes() == 0
        assert gp.memory_stats()["num_ooms"] == 0
        buf.free()
    finally:
        gp.set_backend("sim")


def test_pytorchs_cache_is_released_unless_graphpool_serves_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stand-in for PyTorch's CUDA module: 40 MiB reserved, none allocated."""
    with fresh_sim(1, 64 * MiB) as rt:
        dev = rt.device(0)
        ptr = dev.malloc(40 * MiB)
        state = {"reserved": 40 * MiB, "empty_cache": 0}

        def empty_cache() -> None:
            state["empty_cache"] += 1
            if state["reserved"]:
                dev.free(ptr)
                state["reserved"] = 0

        cuda = types.SimpleNamespace(
            is_initialized=lambda: True,
            memory_reserved=lambda device=None: state["reserved"],
            memory_allocated=lambda device=None: 0,
            empty_cache=empty_cache,
        )
        monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=cuda))
        monkeypatch.setattr(cooperate, "_served", {"torch"})
        with pytest.raises(gp.OutOfMemoryError):  # graphpool is PyTorch's allocator: not asked
            gp.alloc(40 * MiB)
        assert state["empty_cache"] == 0
        monkeypatch.setattr(cooperate, "_served", set())
        gp.alloc(40 * MiB).free()
        assert state["empty_cache"] == 1


@pytest.mark.gpu
def test_cupy_cache_released_on_the_gpu() -> None:
    """On a GPU: CuPy's default pool caches most of the free memory; graphpool's allocation
    succeeds once CuPy gives it back (benchmarks/cooperate_gpu.py measures it at full size)."""
    from gpu_guard import cuda_unusable

    reason = cuda_unusable()
    if reason is not None:
        pytest.skip(reason)
    cupy = pytest.importorskip("cupy")
    gp.set_backend("cuda")
    gp.set_release_other_caches(True)
    try:
        free, _total = cupy.cuda.runtime.memGetInfo()
        held = cupy.cuda.alloc(free - (1 << 30))  # CuPy's default pool (not graphpool's)
        del held
        pool = cupy.get_default_memory_pool()
        assert pool.total_bytes() > 0
        buf = gp.alloc(4 << 30)
        assert pool.total_bytes() == 0
        buf.free()
    finally:
        runtime._release_others = None
        gp.empty_cache()


def test_the_retry_is_final_even_when_others_claim_to_free_more(small: Any) -> None:
    """A releaser that always claims memory back (and frees none) gets one retry: its failure
    is counted once and raised, no second round of asking."""
    calls: list[int] = []

    def liar(device: int) -> int:
        calls.append(device)
        return 1 << 20

    gp.register_cache_releaser(liar)
    held = gp.alloc(32 * MiB)
    with pytest.raises(gp.OutOfMemoryError):
        gp.alloc(40 * MiB)  # the device refuses the segment before and after asking
    assert calls == [0]
    assert gp.memory_stats()["num_ooms"] == 1
    held.free()

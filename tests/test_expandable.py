"""Expandable segments (``expandable_segments:True``): one virtual range per stream and kind
that grows in place by mapped granules and gives its free end back on ``empty_cache``.

Each test drives an allocator of its own with the option on, beside the backend's (so the
same test runs on the simulator and on a GPU), through the policy's calls and the Device
protocol: growth, merges across granule boundaries with the bytes intact, shrink and
release with the device's free memory back, out of memory while mapping, and captures,
which keep ordinary segments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

import graphpool as gp
from graphpool import runtime
from graphpool.device.protocol import CAPTURE_MODE_GLOBAL
from graphpool.errors import OutOfMemoryError
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.pools import DEFAULT

MiB = 1 << 20


@pytest.fixture
def exp(backend: Any) -> Iterator[CachingAllocator]:
    """An allocator with expandable segments on device 0, empty at the start and the end."""
    rt = runtime.get()
    a = CachingAllocator(
        rt.device(0), sizes=dataclasses.replace(DEFAULT, expandable_segments=True), world=rt.world
    )
    try:
        yield a
    finally:
        a.device.device_synchronize()
        a.empty_cache()
        a.check_invariants()
        assert a.memory_stats()["reserved_bytes.all.current"] == 0
        assert a._exp == {}


def _segments(a: CachingAllocator) -> list[dict[str, Any]]:
    return a.snapshot()


def test_one_stream_grows_one_segment_in_place(exp: CachingAllocator) -> None:
    a = exp
    gran = a.device.vmm_granularity()
    s = a.device.create_stream()
    try:
        ptrs = [a.malloc(n, stream=s) for n in (3 * MiB, 5 * MiB, 12 * MiB, 30 * MiB)]
        segs = [seg for seg in _segments(a) if seg["segment_type"] == "large"]
        assert len(segs) == 1 and segs[0]["is_expandable"]
        base = segs[0]["address"]
        assert ptrs[0] == base and ptrs == sorted(ptrs)  # one range, filled front to back
        reserved = a.memory_stats()["reserved_bytes.large_pool.current"]
        assert reserved % gran == 0
        # the blocks tile the mapped part; each request took at most a granule more
        assert (
            reserved
            == segs[0]["total_size"]
            <= sum(-(-n // gran) * gran for n in (3, 5, 12, 30) for n in [n * MiB])
        )
        a.check_invariants()
        for p in ptrs:
            a.free(p)
    finally:
        a.device.destroy_stream(s)


def test_blocks_merge_across_granules_and_keep_their_bytes(exp: CachingAllocator) -> None:
    a = exp
    dev = a.device
    gran = dev.vmm_granularity()
    x = a.malloc(gran + MiB + 512, stream=0)  # past the first granule
    y = a.malloc(3 * MiB, stream=0)  # mapped later, right after x
    assert y > x
    a.free(x)
    a.free(y)  # x, y and the free end merge into one block across granule boundaries
    blocks = [b for seg in _segments(a) for b in seg["blocks"] if seg["segment_type"] == "large"]
    assert len(blocks) == 1 and blocks[0]["state"] == "inactive"
    z = a.malloc(gran + 4 * MiB, stream=0)  # spans the old boundary
    assert z == x
    data = bytes(range(256)) * ((gran + 4 * MiB) // 256)
    dev.write(z, data, 0)
    assert dev.read(z, len(data), 0) == data
    a.free(z)


def test_empty_cache_unmaps_the_free_end_and_releases_a_free_segment(exp: CachingAllocator) -> None:
    a = exp
    dev = a.device
    gran = dev.vmm_granularity()
    keep = a.malloc(4 * MiB, stream=0)
    big = a.malloc(64 * MiB, stream=0)
    reserved = a.memory_stats()["reserved_bytes.all.current"]
    assert reserved >= 68 * MiB
    a.free(big)
    dev.device_synchronize()
    free_before = dev.mem_info()[0]
    a.empty_cache()
    left = a.memory_stats()["reserved_bytes.all.current"]
    assert left == -(-4 * MiB // gran) * gran  # what `keep` needs, in whole granules
    assert dev.mem_info()[0] - free_before >= reserved - left - gran  # the driver has it back
    a.check_invariants()
    assert a.malloc(64 * MiB, stream=0) == big  # grows again in place, at the same address
    a.free(big)
    a.free(keep)
    a.empty_cache()
    assert a.memory_stats()["reserved_bytes.all.current"] == 0
    assert a._exp == {} and a.snapshot() == []
    if hasattr(dev, "reservations"):
        assert dev.reservations() == []


def test_out_of_memory_while_mapping_is_clean(exp: CachingAllocator) -> None:
    a = exp
    a.limits = a.limits.with_bytes(32 * MiB)  # the same refusal on both backends
    p = a.malloc(20 * MiB, stream=0)
    with pytest.raises(OutOfMemoryError, match=r"the memory limit of 32\.00 MiB"):
        a.malloc(20 * MiB, stream=0)
    a.check_invariants()
    stats = a.memory_stats()
    assert stats["reserved_bytes.all.current"] <= 32 * MiB and stats["num_ooms"] == 1
    a.free(p)
    q = a.malloc(30 * MiB, stream=0)  # the cache serves it after the failure
    assert q == p
    a.free(q)


def test_out_of_memory_on_the_simulated_device_itself(sim: Any) -> None:
    from graphpool.sim import SimBackend

    runtime.set_backend("sim", backend=SimBackend(memory_bytes=64 * MiB))
    try:
        gp.set_allocator_config("expandable_segments:True")
        x = gp.alloc(40 * MiB)
        with pytest.raises(OutOfMemoryError, match="out of memory"):
            gp.alloc(40 * MiB)
        gp.check_invariants()
        x.free()
        y = gp.alloc(60 * MiB)  # the retry released nothing needed: the range grows in place
        assert y.ptr == x.ptr
        y.free()
        gp.empty_cache()
        assert gp.memory_reserved() == 0
    finally:
        gp.set_backend("sim")
        gp.set_allocator_config("")


def test_max_split_size_with_expandable_segments(backend: Any) -> None:
    """An oversize free block at a segment's end that a smaller request may not take is neither
    grown nor split: the request gets a new block mapped after it."""
    rt = runtime.get()
    sizes = dataclasses.replace(DEFAULT, expandable_segments=True, max_split_size=40 * MiB)
    a = CachingAllocator(rt.device(0), sizes=sizes, world=rt.world)
    try:
        first = a.malloc(10 * MiB, stream=0)
        big = a.malloc(100 * MiB, stream=0)
        a.free(big)  # the segment now ends in a free 100 MiB block (oversize)
        small = a.malloc(20 * MiB, stream=0)
        assert small >= big + 100 * MiB  # mapped after the oversize block, which stays whole
        blocks = [b for seg in a.snapshot() for b in seg["blocks"] if b["state"] == "inactive"]
        assert any(b["address"] == big and b["size"] == 100 * MiB for b in blocks)
        a.check_invariants()
        again = a.malloc(90 * MiB, stream=0)  # big enough to take it (wastes < 20 MiB)
        assert again == big
        for p in (first, small, again):
            a.free(p)
    finally:
        a.device.device_synchronize()
        a.empty_cache()
        a.check_invariants()
        assert a.memory_stats()["reserved_bytes.all.current"] == 0


def test_an_oversize_free_segment_gaining_a_neighbour_counts_as_split(backend: Any) -> None:
    """The oversize free block is the segment's only block: the block mapped after it makes it
    an inactive split block, which the statistics count (the differential test found this)."""
    rt = runtime.get()
    sizes = dataclasses.replace(DEFAULT, expandable_segments=True, max_split_size=40 * MiB)
    a = CachingAllocator(rt.device(0), sizes=sizes, world=rt.world)
    try:
        big = a.malloc(100 * MiB, stream=0)
        a.free(big)  # the segment is one free, oversize block: no split block yet
        assert a.memory_stats()["inactive_split.large_pool.current"] == 0
        small = a.malloc(20 * MiB, stream=0)  # may not take it: mapped after it
        st = a.memory_stats()
        assert st["inactive_split.large_pool.current"] == 1
        assert st["inactive_split_bytes.large_pool.current"] == 100 * MiB
        a.check_invariants()
        a.free(small)
        a.check_invariants()
    finally:
        a.device.device_synchronize()
        a.empty_cache()
        a.check_invariants()
        assert a.memory_stats()["reserved_bytes.all.current"] == 0


def test_captures_keep_ordinary_segments(exp: CachingAllocator) -> None:
    """A capture's private pool gets ordinary segments (no mapping during a capture); the
    eager stream's expandable segment never serves the graph."""
    a = exp
    dev = a.device
    s = dev.create_stream()
    try:
        eager = a.malloc(8 * MiB, stream=0)
        dev.begin_capture(s, CAPTURE_MODE_GLOBAL)  # begun outside graphpool: found by detection
        inside = a.malloc(8 * MiB, stream=s)
        graph = dev.end_capture(s)
        segs = {seg["address"]: seg for seg in _segments(a)}
        private = [seg for seg in segs.values() if seg["segment_pool_id"] is not None]
        assert len(private) == 1 and not private[0]["is_expandable"]
        assert private[0]["address"] <= inside < private[0]["address"] + private[0]["total_size"]
        assert [seg["is_expandable"] for seg in segs.values() if seg["segment_pool_id"] is None] == [True]
        a.free(inside)
        a.free(eager)
        dev.destroy_graph(graph)
    finally:
        dev.destroy_stream(s)


def test_a_stream_takes_over_memory_only_from_an_idle_stream_the_device_made(
    backend: Any, exp: CachingAllocator
) -> None:
    """Before mapping more, a stream takes another stream's free block when that stream has
    finished all its work (as cudaMallocAsync's opportunistic reuse does); a busy
    stream, the legacy stream and streams made outside graphpool keep theirs."""
    a = exp
    dev = a.device
    s1, s2 = dev.create_stream(), dev.create_stream()
    try:
        w = a.malloc(32 * MiB, stream=0)
        a.free(w)
        dev.device_synchronize()
        x = a.malloc(32 * MiB, stream=s1)
        assert x != w  # the legacy stream's block is never taken over
        dev.memset(x, 1, 32 * MiB, s1)
        a.free(x)
        dev.stream_synchronize(s1)  # s1 idle: its last use of x is done
        reserved = a.memory_stats()["reserved_bytes.all.current"]
        y = a.malloc(32 * MiB, stream=s2)
        assert y == x and a.memory_stats()["reserved_bytes.all.current"] == reserved
        dev.memset(y, 2, 32 * MiB, s2)
        a.free(y)  # s2's free block now
        backend.spin(gp.Stream._wrap(0, s2))  # s2 busy: its use of y may still run
        z = a.malloc(32 * MiB, stream=s1)
        assert z not in (x, w)  # mapped anew
        assert a.memory_stats()["reserved_bytes.all.current"] == reserved + 32 * MiB
        a.free(z)
        dev.device_synchronize()
        if backend.name == "cuda":  # a stream made outside graphpool is never queried
            import cupy

            other = cupy.cuda.Stream(non_blocking=True)
            o = a.malloc(64 * MiB, stream=other.ptr)
            a.free(o)
            other.synchronize()
            p = a.malloc(64 * MiB, stream=s2)
            assert p != o
            a.free(p)
            dev.device_synchronize()
        a.empty_cache()  # taken blocks go back to their segments' streams; all goes back
        a.check_invariants()
        assert a.memory_stats()["reserved_bytes.all.current"] == 0
    finally:
        dev.device_synchronize()
        dev.destroy_stream(s1)
        dev.destroy_stream(s2)


def test_a_large_block_splits_off_any_remainder(exp: CachingAllocator) -> None:
    """In a growing segment a large block's remainder under small_size splits off (PyTorch's
    should_split with expandable segments): the allocation holds only its rounded size, and
    the remainder is free memory the next request takes. The option off keeps it attached."""
    a = exp
    x = a.malloc(3 * MiB, stream=0)
    a.free(x)  # a free block of the segment's whole mapped part (4 MiB on 2 MiB granules)
    y = a.malloc(3 * MiB - 100 * 1024, stream=0)  # leaves 1.1 MiB
    z = a.malloc(2 * MiB + 512 * 1024, stream=0)  # leaves 0.6 MiB: split off too
    stats = a.memory_stats()
    assert stats["allocated_bytes.large_pool.current"] == (3 * MiB - 100 * 1024) + (2 * MiB + 512 * 1024)
    w = a.malloc(MiB + 512, stream=0)
    a.free(z)
    a.free(y)
    a.free(w)
    a.check_invariants()
    off = CachingAllocator(a.device, sizes=DEFAULT, world=runtime.get().world)
    v = off.malloc(20 * MiB - 512 * 1024, stream=0)  # 20 MiB segment: 0.5 MiB stays attached
    assert off.memory_stats()["allocated_bytes.large_pool.current"] == 20 * MiB
    off.free(v)
    off.empty_cache()


def test_max_split_size_does_not_keep_a_remainder_attached_in_a_growing_segment(backend: Any) -> None:
    """A request at or above max_split_size may take an oversize free block that wastes less
    than max_non_split_rounding; in a growing segment the rest still splits off (PyTorch's
    should_split with expandable segments ignores max_split_size) and serves the next request."""
    rt = runtime.get()
    sizes = dataclasses.replace(DEFAULT, expandable_segments=True, max_split_size=20 * MiB)
    a = CachingAllocator(rt.device(0), sizes=sizes, world=rt.world)
    try:
        x = a.malloc(24 * MiB, stream=0)
        a.free(x)  # 24 MiB free (whole granules), oversize
        y = a.malloc(22 * MiB, stream=0)  # wastes 2 MiB < 20 MiB (max_non_split_rounding)
        assert y == x and a.memory_stats()["allocated_bytes.large_pool.current"] == 22 * MiB
        reserved = a.memory_stats()["reserved_bytes.all.current"]
        z = a.malloc(MiB + 512, stream=0)  # the split-off 2 MiB serves it: nothing mapped
        assert z == x + 22 * MiB and a.memory_stats()["reserved_bytes.all.current"] == reserved
        a.free(y)
        a.free(z)
        a.check_invariants()
    finally:
        a.device.device_synchronize()
        a.empty_cache()


def test_holes_are_filled_before_a_segments_free_end(exp: CachingAllocator) -> None:
    """Wilderness preservation: where the best fit is a segment's free last block, a request
    takes the smallest hole between live blocks that holds it instead, so the free end stays
    whole for a request no hole holds, and that one maps only what the end lacks."""
    a = exp
    gran = a.device.vmm_granularity()
    hole = a.malloc(8 * MiB, stream=0)
    keep = a.malloc(4 * MiB, stream=0)
    end = a.malloc(6 * MiB, stream=0)
    a.free(end)  # the free end: 6 MiB at least (to the mapped end)
    a.free(hole)  # a hole of 8 MiB between the segment's start and `keep`
    x = a.malloc(5 * MiB, stream=0)  # the end (6 MiB) fits best, but the hole takes it
    assert x == hole
    reserved = a.memory_stats()["reserved_bytes.all.current"]
    y = a.malloc(10 * MiB, stream=0)  # no hole holds it: the end grows by what it lacks
    assert y == end
    # (had the end served x, y would need 10 MiB mapped past x's remainder instead of 4 MiB)
    assert a.memory_stats()["reserved_bytes.all.current"] - reserved == -(-4 * MiB // gran) * gran
    for p in (x, y, keep):
        a.free(p)
    a.check_invariants()


def test_configuration_turns_it_on_for_the_runtime(sim: Any) -> None:
    gp.set_allocator_config("expandable_segments:True")
    try:
        with gp.alloc(3 * MiB), gp.alloc(5 * MiB):
            segs = gp.memory_snapshot()
            assert [s["is_expandable"] for s in segs] == [True]
            assert gp.torch_snapshot()["allocator_settings"]["expandable_segments"] is True
        gp.empty_cache()
        assert gp.memory_reserved() == 0
    finally:
        gp.set_backend("sim")
        gp.set_allocator_config("")

"""Expandable segments against the limits and the graphs: the first segment of a stream is
refused by a memory limit as every later mapping is, and ``empty_cache`` never unmaps a
free end that a captured graph still keeps.

Each test drives an allocator of its own with the option on, beside the backend's (the same
test runs on the simulator and, marked gpu, on a GPU), through the policy's calls and the
Device protocol, as tests/test_expandable.py does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import pytest

from graphpool import runtime
from graphpool.device.protocol import CAPTURE_MODE_GLOBAL
from graphpool.errors import OutOfMemoryError
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.pools import DEFAULT
from graphpool.policy.private_pools import new_graph_pool_id

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


def _limit(a: CachingAllocator, kind: str, nbytes: int) -> str:
    """Cap ``a``'s reserved memory at about ``nbytes`` by ``kind``; the words its refusal says."""
    if kind == "bytes":
        a.limits = a.limits.with_bytes(nbytes)
        return "the memory limit"
    a.limits = a.limits.with_fraction(nbytes / a._total)
    return "the per-process memory fraction"


@pytest.mark.parametrize("kind", ["bytes", "fraction"])
@pytest.mark.parametrize("first", [True, False], ids=["first segment", "growth"])
def test_a_limit_refuses_the_mapping_of_an_expandable_segment(
    exp: CachingAllocator, kind: str, first: bool
) -> None:
    """The first mapping of a stream's segment counts against the limits as its growth does
    (a cap of 16 MiB: a 20 MiB request is refused either way, and nothing is mapped)."""
    a = exp
    s = a.device.create_stream()
    try:
        held = a.malloc(4 * MiB, stream=s) if not first else None
        words = _limit(a, kind, 16 * MiB)
        before = a.memory_stats()
        with pytest.raises(OutOfMemoryError, match=words):
            a.malloc(20 * MiB, stream=s)
        after = a.memory_stats()
        assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
        assert after["expandable_mapped_bytes"] == before["expandable_mapped_bytes"]
        assert after["num_ooms"] == before["num_ooms"] + 1
        a.check_invariants()
        a.limits = a.limits.with_bytes(None).with_fraction(None)
        p = a.malloc(20 * MiB, stream=s)  # no cap: mapped
        a.free(p)
        if held is not None:
            a.free(held)
    finally:
        a.device.device_synchronize()
        a.device.destroy_stream(s)


def _begin(dev: Any, stream: int) -> int:
    dev.begin_capture(stream, CAPTURE_MODE_GLOBAL)
    return int(dev.capture_info(stream)[1])


def _refused_beside_unseen_capture(a: CachingAllocator, cap: int, nbytes: int, stream: int) -> int:
    """Begin a global-mode capture on ``cap`` outside graphpool (not seen yet), set the byte
    limit at what is reserved now, and ask for ``nbytes`` on ``stream``: the out-of-memory
    retry runs, and the request is refused for want of memory. Then the capture must end
    whole (not invalidated by the retry) and the invariants hold. Its graph."""
    dev = a.device
    reserved = a.memory_stats()["reserved_bytes.all.current"]
    _begin(dev, cap)
    words = _limit(a, "bytes", reserved)
    with pytest.raises(OutOfMemoryError, match=words):
        a.malloc(nbytes, stream=stream)
    graph = int(dev.end_capture(cap))
    a.check_invariants()
    return graph


def test_empty_cache_keeps_a_free_end_a_graph_still_writes(exp: CachingAllocator) -> None:
    """The segment's last block, allocated before a capture and freed during it, is kept for
    the graph (its replays write it): ``empty_cache`` unmaps nothing of it while the graph
    lives, the replay writes mapped memory, and once the graph is released the end goes."""
    a = exp
    dev = a.device
    s = dev.create_stream()
    gran = dev.vmm_granularity()
    graph = exe = None
    rec = None
    try:
        keep = a.malloc(4 * MiB, stream=s)
        tail = a.malloc(4 * MiB, stream=s)  # the segment's end
        dev.stream_synchronize(s)
        rec = a.begin_capture(new_graph_pool_id(), lambda: _begin(dev, s), stream=s)
        dev.memset(tail, 7, 4 * MiB, s)  # the graph writes the end ...
        a.free(tail)  # ... and drops it: kept for the graph
        graph = dev.end_capture(s)
        a.end_capture(rec)
        exe = dev.instantiate(graph)
        mapped = a.memory_stats()["expandable_mapped_bytes"]
        a.empty_cache()
        st = a.memory_stats()
        assert st["expandable_mapped_bytes"] == mapped, "empty_cache unmapped memory a graph keeps"
        assert st["reserved_bytes.all.current"] >= 8 * MiB
        a.check_invariants()
        dev.launch(exe, s)  # writes the kept end: still mapped
        dev.stream_synchronize(s)
        assert dev.read(tail, 16, s) == bytes([7]) * 16
        dev.destroy_graph_exec(exe)
        dev.destroy_graph(graph)
        exe = graph = None
        a.release_capture(rec)
        rec = None
        a.empty_cache()  # the graph is gone: the end is unmapped now
        assert a.memory_stats()["expandable_mapped_bytes"] == -(-4 * MiB // gran) * gran
        a.free(keep)
    finally:
        dev.device_synchronize()
        if exe is not None:
            dev.destroy_graph_exec(exe)
        if graph is not None:
            dev.destroy_graph(graph)
        if rec is not None:
            a.release_capture(rec)
        dev.destroy_stream(s)


def _finish(
    a: CachingAllocator,
    cap: int,
    graph: int | None,
    streams: tuple[int, ...],
    frees: tuple[int | None, ...] = (),
) -> None:
    """After a test of the retry beside a capture on ``cap``: end that capture if it still runs
    (an invalidated one fails to end: the test's failure says why), destroy its graph, lift the
    limit, free the allocations ``frees`` still live (None: none) and destroy ``streams``, these
    also when a free fails."""
    dev = a.device
    try:
        if graph is None and dev.capture_info(cap)[0]:
            try:
                graph = dev.end_capture(cap)
            except Exception:
                graph = None
        if graph is not None:
            dev.destroy_graph(graph)
        a.limits = a.limits.with_bytes(None)
        dev.device_synchronize()
        for x in frees:
            if x is not None:
                a.free(x)
    finally:
        for s in streams:
            dev.destroy_stream(s)


def test_the_out_of_memory_retry_never_synchronizes_the_device(exp: CachingAllocator) -> None:
    """The out-of-memory retry runs inside an allocation, where a capture begun outside graphpool
    on another stream may be underway unseen (global mode here). It gives the free end another
    stream took over back to the segment's stream without a device synchronize, which would
    invalidate that capture (tests/property/test_expandable_machine.py found it): the
    allocation is refused for want of memory, the capture ends whole, and the idle taker's
    block went home, so the segment went back."""
    a = exp
    dev = a.device
    home, taker, cap = dev.create_stream(), dev.create_stream(), dev.create_stream()
    graph = None
    try:
        p = a.malloc(4 * MiB, stream=home)
        a.free(p)  # home's segment, all of it free, home idle
        q = a.malloc(4 * MiB, stream=taker)  # taken over from the idle home: no mapping of its own
        assert q == p
        a.free(q)  # the taker's free block at the end of home's segment
        graph = _refused_beside_unseen_capture(a, cap, 8 * MiB, taker)
        assert a.memory_stats()["reserved_bytes.all.current"] == 0  # the block went home, and back
        a.limits = a.limits.with_bytes(None)
    finally:
        _finish(a, cap, graph, (home, taker, cap))


def test_the_out_of_memory_retry_shrinks_a_segment_without_a_device_synchronize(
    exp: CachingAllocator,
) -> None:
    """The same retry unmaps the free end of a segment whose start is live (``_shrink``) after
    the segment stream's work only: a global-mode capture begun unseen on another stream stays
    valid, the request is refused for want of memory, and the free end is unmapped."""
    a = exp
    dev = a.device
    home, cap = dev.create_stream(), dev.create_stream()
    graph = None
    try:
        live = a.malloc(2 * MiB, stream=home)
        p = a.malloc(6 * MiB, stream=home)
        a.free(p)  # the segment's free end
        reserved = a.memory_stats()["reserved_bytes.all.current"]
        graph = _refused_beside_unseen_capture(a, cap, 12 * MiB, home)
        assert a.memory_stats()["reserved_bytes.all.current"] < reserved  # the free end went back
        a.free(live)
    finally:
        _finish(a, cap, graph, (home, cap))


def _spin(dev: Any, stream: int) -> None:
    """Queue long-running work on ``stream`` (a kernel that sleeps)."""
    if hasattr(dev, "launch_sleep"):  # the simulator
        dev.launch_sleep(stream, rounds=50)
    else:
        import graphpool as gp
        from graphpool.tools.benchkit import cuda_spin

        cuda_spin(gp.Stream._wrap(dev.index, stream))


@pytest.mark.parametrize("whole", [True, False], ids=["whole segment", "free end"])
def test_the_out_of_memory_retry_leaves_a_busy_streams_block_while_a_known_stream_captures(
    exp: CachingAllocator, whole: bool
) -> None:
    """The retry gives a busy stream's taken-over block back to its segment's stream only after
    a device synchronize, and synchronizes the device only while no stream graphpool holds
    memory of is capturing: with a capture begun unseen on such a stream, the block stays the
    busy stream's (its segment, all of it that block, is given back after that stream's work
    alone), the request is refused for want of memory, and the capture ends whole. With a live
    block before it (``free end``), the block's granules are unmapped (``_shrink``) after the
    busy stream's work the same way."""
    a = exp
    dev = a.device
    home, taker, cap = dev.create_stream(), dev.create_stream(), dev.create_stream()
    gran = dev.vmm_granularity()
    graph = None
    try:
        c = a.malloc(gran, stream=cap)  # graphpool holds memory of cap (a whole granule: no free end)
        live = None if whole else a.malloc(gran, stream=home)
        p = a.malloc(4 * MiB, stream=home)
        a.free(p)
        q = a.malloc(4 * MiB, stream=taker)  # taken over from the idle home
        assert q == p
        _spin(dev, taker)
        dev.memset(q, 7, 4 * MiB, taker)  # its last use, behind the long work: unmapped only after
        a.free(q)  # the busy taker's block at the end of home's segment
        graph = _refused_beside_unseen_capture(a, cap, 8 * MiB, home)
        # the busy block stayed the taker's, and its memory went back after the taker's work
        # (a stream synchronize): only cap's granule (and the live one) are left
        assert a.memory_stats()["reserved_bytes.all.current"] == gran * (1 if whole else 2)
        a.free(c)
        if live is not None:
            a.free(live)
    finally:
        _finish(a, cap, graph, (home, taker, cap))


@pytest.mark.parametrize("whole", [True, False], ids=["whole segment", "free end"])
def test_the_out_of_memory_retry_leaves_the_free_memory_of_a_stream_capturing_unseen(
    exp: CachingAllocator, whole: bool
) -> None:
    """A capture begun outside graphpool, not seen yet, on a stream whose free memory graphpool
    caches (a whole free segment, or the free end of one): the out-of-memory retry on another
    stream must not unmap that memory, whose unmap would wait for the device (the stream is
    capturing: no stream synchronize), which invalidates the capture. The allocation is
    refused for want of memory, the capture ends whole, and nothing is lost."""
    a = exp
    dev = a.device
    home, cap = dev.create_stream(), dev.create_stream()
    gran = dev.vmm_granularity()
    graph = live = p = None
    try:
        live = None if whole else a.malloc(gran, stream=cap)
        a.free(a.malloc(gran, stream=cap))  # cap's free memory (its segment, or its free end)
        p = a.malloc(4 * MiB, stream=home)
        graph = _refused_beside_unseen_capture(a, cap, 4 * MiB + gran, home)
    finally:
        _finish(a, cap, graph, (home, cap), (p, live))


@pytest.mark.parametrize("holds", ["free", "live", "none"])
def test_the_out_of_memory_retry_spares_a_known_capture_when_it_frees_legacy_stream_memory(
    exp: CachingAllocator, holds: str
) -> None:
    """A stream the device made captures, begun outside graphpool and not seen yet; graphpool
    holds memory of it (free, or only live) or none at all. The out-of-memory retry on another
    stream must not unmap the legacy stream's free memory: that unmap can wait only for the
    whole device, which invalidates the capture. The allocation is refused for want of
    memory, the capture ends whole, and the legacy stream's memory goes back later."""
    a = exp
    dev = a.device
    home, cap = dev.create_stream(), dev.create_stream()
    gran = dev.vmm_granularity()
    graph = c = p = None
    try:
        if holds != "none":
            c = a.malloc(gran, stream=cap)  # graphpool holds memory of cap (a whole granule)
        if holds == "free":
            a.free(c)  # cap's free segment: kept by the retry (it is capturing)
            c = None
        a.free(a.malloc(4 * MiB, stream=0))  # the legacy stream's whole free segment
        dev.device_synchronize()
        p = a.malloc(4 * MiB, stream=home)
        graph = _refused_beside_unseen_capture(a, cap, 8 * MiB, home)
        a.limits = a.limits.with_bytes(None)
        a.empty_cache()  # the capture is over: the legacy stream's segment goes back now
        assert a.memory_stats()["reserved_bytes.all.current"] == 4 * MiB + (gran if c is not None else 0)
    finally:
        _finish(a, cap, graph, (home, cap), (p, c))


def test_the_out_of_memory_retry_gives_back_legacy_stream_memory_with_no_capture(
    exp: CachingAllocator,
) -> None:
    """With no capture underway, the retry does unmap the legacy stream's free memory (the
    rule above keeps it only while a stream captures): the request on another stream, refused
    at first by the limit, then fits."""
    a = exp
    dev = a.device
    home = dev.create_stream()
    p = q = None
    try:
        a.free(a.malloc(4 * MiB, stream=0))  # the legacy stream's whole free segment
        p = a.malloc(4 * MiB, stream=home)
        _limit(a, "bytes", a.memory_stats()["reserved_bytes.all.current"])
        q = a.malloc(4 * MiB, stream=home)  # fits once the legacy stream's segment went back
        a.check_invariants()
        assert a.memory_stats()["num_alloc_retries"] == 1
    finally:
        a.limits = a.limits.with_bytes(None)
        for x in (p, q):
            if x is not None:
                a.free(x)
        dev.device_synchronize()
        dev.destroy_stream(home)


@pytest.mark.parametrize("home_is", ["destroyed", "capturing"])
def test_the_out_of_memory_retry_leaves_a_taken_block_with_its_taker_when_home_cannot_be_waited_for(
    exp: CachingAllocator, home_is: str
) -> None:
    """An idle taker's free block at the end of a segment whose stream was destroyed since, or
    is capturing (begun outside graphpool, unseen): the retry leaves the block with its taker
    rather than giving it home, so its unmap waits for the taker alone. Given home, its unmap
    would wait for the whole device (a destroyed stream is never synchronized), which
    invalidates a capture begun unseen on a third stream graphpool never saw; or it would stay
    mapped (a capturing stream's memory is kept). The request is refused for want of memory,
    the capture ends whole, and the block's memory went back."""
    a = exp
    dev = a.device
    home, taker, third = dev.create_stream(), dev.create_stream(), dev.create_stream()
    cap = third if home_is == "destroyed" else home
    streams = [home, taker, third]
    graph = None
    try:
        p = a.malloc(4 * MiB, stream=home)
        a.free(p)  # home's segment, all of it free, home idle
        q = a.malloc(4 * MiB, stream=taker)  # taken over from the idle home
        assert q == p
        a.free(q)  # the taker's free block, the whole of home's segment
        if home_is == "destroyed":
            dev.destroy_stream(home)
            streams.remove(home)
        graph = _refused_beside_unseen_capture(a, cap, 8 * MiB, taker)
        assert a.memory_stats()["reserved_bytes.all.current"] == 0  # unmapped after the taker
    finally:
        _finish(a, cap, graph, tuple(streams))


def test_garbage_collection_in_an_allocation_leaves_the_free_memory_of_a_stream_capturing_unseen(
    backend: Any,
) -> None:
    """``garbage_collection_threshold`` gives old whole free segments back inside an allocation,
    where a capture begun outside graphpool may be underway unseen: the whole free segment of a
    stream capturing so stays mapped (its unmap could only wait for the whole device, which
    invalidates the capture), as in the out-of-memory retry. The allocation is served, the
    capture ends whole, and the segment goes back once it is over."""
    rt = runtime.get()
    sizes = dataclasses.replace(DEFAULT, expandable_segments=True, garbage_collection_threshold=0.5)
    a = CachingAllocator(rt.device(0), sizes=sizes, world=rt.world)
    dev = a.device
    home, cap = dev.create_stream(), dev.create_stream()
    graph = p = None
    try:
        a.limits = a.limits.with_fraction(64 * MiB / a._total)
        a.free(a.malloc(2 * MiB, stream=home))  # home's segment
        a.free(a.malloc(40 * MiB, stream=cap))  # cap's whole free segment: past the threshold
        for _ in range(4):  # (older than home's block, by the pool's clock)
            a.free(a.malloc(2 * MiB, stream=home))
        _begin(dev, cap)  # begun outside graphpool, not seen yet
        p = a.malloc(8 * MiB, stream=home)  # home's segment grows: the collection runs first
        graph = dev.end_capture(cap)  # not invalidated by the collection
        a.check_invariants()
        assert a.memory_stats()["reserved_bytes.all.current"] == 48 * MiB  # cap's segment kept
    finally:
        try:
            _finish(a, cap, graph, (home, cap), (p,))
        finally:
            a.limits = a.limits.with_fraction(None)
            a.empty_cache()
            a.check_invariants()
            assert a.memory_stats()["reserved_bytes.all.current"] == 0

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

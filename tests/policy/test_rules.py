"""Every policy rule of docs/behaviour.rst, "The caching allocator", with exact figures, on a
scripted FakeDevice.

Each test drives ``CachingAllocator(FakeDevice(...))`` directly, reads the flattened
``memory_stats()`` and calls ``check_invariants()`` after each step. Some tests shrink the
size tunables (``SizeConfig``) so splitting, growth and out-of-memory take small numbers.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from fakedevice import SHRUNK, FakeDevice

from graphpool.errors import DoubleFreeError, ForeignPointerError, GraphpoolError, OutOfMemoryError
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.pools import DEFAULT, SizeConfig
from graphpool.policy.private_pools import PoolId
from graphpool.policy.stats import OVERSIZE_NAMES, POOL_NAMES, SCALAR_NAMES, STAT_NAMES, PoolStats
from graphpool.policy.units import fmt_bytes

KiB = 1024
MiB = 1024 * KiB


S1, S2, S3 = 1, 2, 3  # stream handles (any ints but 0 work for the policy)


def make(total: int = 1 << 34, sizes: SizeConfig = DEFAULT) -> tuple[FakeDevice, CachingAllocator]:
    dev = FakeDevice(total)
    return dev, CachingAllocator(dev, sizes=sizes)


def cur(a: CachingAllocator, stat: str, pool: str = "all", counter: str = "current") -> int:
    return a.memory_stats()[f"{stat}.{pool}.{counter}"]


def ok(a: CachingAllocator) -> None:
    a.check_invariants()


def segments(a: CachingAllocator) -> list[dict]:
    return a.snapshot()


def block_layout(a: CachingAllocator) -> list[list[tuple[int, str]]]:
    """Per segment (by address): [(size, state), ...] of its blocks."""
    return [[(b["size"], b["state"]) for b in seg["blocks"]] for seg in segments(a)]


FREE = "inactive"
ALLOC = "active_allocated"
PENDING = "active_pending_free"


# --------------------------------------------------------------------------- stats shape
def test_memory_stats_has_every_flattened_key_and_starts_at_zero() -> None:
    _, a = make()
    st = a.memory_stats()
    expected = {
        f"{name}.{pool}.{counter}"
        for name in (
            "allocation",
            "allocated_bytes",
            "requested_bytes",
            "segment",
            "reserved_bytes",
            "active",
            "active_bytes",
            "inactive_split",
            "inactive_split_bytes",
        )
        for pool in ("all", "small_pool", "large_pool")
        for counter in ("current", "peak", "allocated", "freed")
    } | {"num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free", "num_sync_all_streams"}
    expected |= {"expandable_mapped_bytes", "expandable_virtual_bytes"}  # graphpool's own two
    expected |= {  # PyTorch's two of max_split_size, for "all" only (as PyTorch keeps them)
        f"{name}.{counter}"
        for name in ("oversize_allocations", "oversize_segments")
        for counter in ("current", "peak", "allocated", "freed")
    }
    assert set(st) == expected
    # the module's name lists match the keys exactly, in PyTorch's order
    assert STAT_NAMES == (
        "allocation",
        "allocated_bytes",
        "requested_bytes",
        "segment",
        "reserved_bytes",
        "active",
        "active_bytes",
        "inactive_split",
        "inactive_split_bytes",
    )
    assert POOL_NAMES == ("all", "small_pool", "large_pool")
    assert SCALAR_NAMES == (
        "num_alloc_retries",
        "num_ooms",
        "num_device_alloc",
        "num_device_free",
        "num_sync_all_streams",
    )
    assert {k.split(".")[0] for k in st if "." in k} == set(STAT_NAMES) | set(OVERSIZE_NAMES)
    assert [k for k in st if "." not in k] == [
        *SCALAR_NAMES,
        "expandable_mapped_bytes",
        "expandable_virtual_bytes",
    ]
    assert st == dict.fromkeys(expected, 0)
    ok(a)


# --------------------------------------------------------------------------- rounding
@pytest.mark.parametrize(
    ("nbytes", "rounded"),
    [(0, 512), (1, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024), (1024, 1024), (4097, 4608)],
)
def test_rounding_to_512(nbytes: int, rounded: int) -> None:
    _, a = make()
    p = a.malloc(nbytes, stream=S1)
    blk = a.lookup(p)
    assert blk is not None and blk.size == rounded
    st = a.memory_stats()
    assert st["allocated_bytes.all.current"] == rounded
    assert st["allocated_bytes.small_pool.current"] == rounded
    assert st["allocated_bytes.large_pool.current"] == 0
    assert st["requested_bytes.all.current"] == nbytes
    assert st["allocation.all.current"] == 1
    assert st["active_bytes.all.current"] == rounded
    assert p % 512 == 0
    ok(a)


def test_size_config_rounding_helpers() -> None:
    assert [DEFAULT.round_size(n) for n in (0, 1, 511, 512, 513)] == [512, 512, 512, 512, 1024]
    assert DEFAULT.is_small(MiB) and not DEFAULT.is_small(MiB + 512)
    assert DEFAULT.segment_size(512) == 2 * MiB
    assert DEFAULT.segment_size(MiB + 512) == 20 * MiB
    assert DEFAULT.segment_size(10 * MiB - 512) == 20 * MiB
    assert DEFAULT.segment_size(10 * MiB) == 10 * MiB
    assert DEFAULT.segment_size(10 * MiB + 512) == 12 * MiB


def test_least_segment_of_a_small_request_is_a_small_segment() -> None:
    """Whatever round_large is: the largest small request too."""
    sizes = SizeConfig(round_large=512 * KiB)
    assert [sizes.least_segment(n) for n in (512, MiB)] == [2 * MiB, 2 * MiB]
    assert sizes.least_segment(MiB + 512) == 1536 * KiB


def test_size_config_validation() -> None:
    with pytest.raises(ValueError):
        SizeConfig(min_block=500)
    with pytest.raises(ValueError):
        SizeConfig(small_size=1000)
    with pytest.raises(ValueError):
        SizeConfig(small_size=4 * MiB, small_segment=2 * MiB)
    with pytest.raises(ValueError):
        SizeConfig(min_large_alloc=40 * MiB, large_segment=20 * MiB)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_block": 0}, "min_block must be a power of two"),
        ({"min_block": -512}, "min_block must be a power of two"),
        ({"min_block": 768}, "min_block must be a power of two"),
        ({"min_block": 1024, "small_size": 1024 * 1024 + 512}, "small_size must be a multiple of min_block"),
        ({"round_large": 2 * MiB + 256}, "round_large must be a multiple of min_block"),
        ({"small_segment": 1 * MiB - 512}, "small_segment must hold the largest small request"),
        ({"large_segment": 10 * MiB - 512}, "large_segment must hold every request below min_large_alloc"),
    ],
)
def test_size_config_rejects_each_bad_tunable_with_its_reason(kwargs: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=f"^{message}$"):
        SizeConfig(**kwargs)


def test_size_config_accepts_the_limits_of_each_rule() -> None:
    """Each rule's boundary is allowed: a 1-byte block (a power of two), a small segment
    exactly the largest small request, a large segment exactly ``min_large_alloc``."""
    one = SizeConfig(
        min_block=1, small_size=3, small_segment=3, large_segment=5, min_large_alloc=5, round_large=7
    )
    assert one.round_size(0) == 1 and one.round_size(2) == 2
    assert [one.segment_size(n) for n in (5, 7, 8, 15)] == [7, 7, 14, 21]  # multiples of 7
    tight = SizeConfig(
        small_size=2 * MiB, small_segment=2 * MiB, large_segment=10 * MiB, min_large_alloc=10 * MiB
    )
    assert tight.segment_size(2 * MiB) == 2 * MiB and tight.segment_size(10 * MiB - 512) == 10 * MiB
    assert SizeConfig(min_block=2048).round_size(2049) == 4096


# --------------------------------------------------------------------------- small / large
def test_one_mib_is_small_and_one_mib_plus_512_is_large() -> None:
    _, a = make()
    p = a.malloc(MiB, stream=S1)
    st = a.memory_stats()
    assert a.lookup(p).size == MiB
    assert st["allocation.small_pool.current"] == 1 and st["allocation.large_pool.current"] == 0
    assert st["segment.small_pool.current"] == 1
    assert st["reserved_bytes.small_pool.current"] == 2 * MiB
    assert st["inactive_split.small_pool.current"] == 1
    assert st["inactive_split_bytes.small_pool.current"] == MiB
    ok(a)

    q = a.malloc(MiB + 1, stream=S1)  # rounds to 1 MiB + 512: large
    st = a.memory_stats()
    assert a.lookup(q).size == MiB + 512
    assert st["allocation.large_pool.current"] == 1
    assert st["allocated_bytes.large_pool.current"] == MiB + 512
    assert st["requested_bytes.large_pool.current"] == MiB + 1
    assert st["segment.large_pool.current"] == 1
    assert st["reserved_bytes.large_pool.current"] == 20 * MiB
    assert st["reserved_bytes.all.current"] == 22 * MiB
    assert st["inactive_split_bytes.large_pool.current"] == 20 * MiB - (MiB + 512)
    assert st["num_device_alloc"] == 2
    ok(a)


# --------------------------------------------------------------------------- segment sizes
@pytest.mark.parametrize(
    ("nbytes", "segment", "block", "split_rest"),
    [
        (512, 2 * MiB, 512, 2 * MiB - 512),
        (MiB, 2 * MiB, MiB, MiB),
        (MiB + 512, 20 * MiB, MiB + 512, 19 * MiB - 512),
        (10 * MiB - 512, 20 * MiB, 10 * MiB - 512, 10 * MiB + 512),
        (10 * MiB, 10 * MiB, 10 * MiB, 0),
        (10 * MiB + 1, 12 * MiB, 10 * MiB + 512, 2 * MiB - 512),
        (19 * MiB, 20 * MiB, 20 * MiB, 0),  # the 1 MiB rest stays attached
        (21 * MiB + 512, 22 * MiB, 22 * MiB, 0),  # rest 1 MiB - 512: attached
        (25 * MiB, 26 * MiB, 26 * MiB, 0),
        (24 * MiB + 512, 26 * MiB, 24 * MiB + 512, 2 * MiB - 512),  # rest > 1 MiB: split
    ],
)
def test_segment_size_and_first_split(nbytes: int, segment: int, block: int, split_rest: int) -> None:
    dev, a = make()
    p = a.malloc(nbytes, stream=S1)
    st = a.memory_stats()
    assert list(dev.live.values()) == [segment]
    assert st["reserved_bytes.all.current"] == segment
    assert st["segment.all.current"] == 1
    assert a.lookup(p).size == block
    assert st["allocated_bytes.all.current"] == block
    assert st["requested_bytes.all.current"] == nbytes
    assert st["inactive_split.all.current"] == (1 if split_rest else 0)
    assert st["inactive_split_bytes.all.current"] == split_rest
    kind = "small_pool" if block <= MiB else "large_pool"
    assert st[f"reserved_bytes.{kind}.current"] == segment
    ok(a)
    a.free(p)
    ok(a)
    st = a.memory_stats()
    assert st["allocated_bytes.all.current"] == 0
    assert st["inactive_split.all.current"] == 0  # the whole segment is one free block again
    assert block_layout(a) == [[(segment, FREE)]]


# --------------------------------------------------------------------------- best fit
def test_best_fit_smallest_then_lowest_address_and_split() -> None:
    _, a = make()
    a_ = a.malloc(4096, stream=S1)
    b = a.malloc(512, stream=S1)
    c = a.malloc(8192, stream=S1)
    d = a.malloc(512, stream=S1)
    e = a.malloc(4096, stream=S1)
    f = a.malloc(512, stream=S1)
    assert [b - a_, c - b, d - c, e - d, f - e] == [4096, 512, 8192, 512, 4096]
    for p in (a_, c, e):
        a.free(p)
        ok(a)
    st = a.memory_stats()
    # free: a_ (4096), c (8192), e (4096) and the tail of the segment
    assert st["inactive_split.all.current"] == 4
    assert st["inactive_split_bytes.all.current"] == 2 * MiB - 3 * 512
    # a tie between a_ and e (both 4096): lowest address wins
    assert a.malloc(4096, stream=S1) == a_
    ok(a)
    # 4000 rounds to 4096: the only 4096 block left is e
    assert a.malloc(4000, stream=S1) == e
    ok(a)
    # 6000 rounds to 6144: the smallest block that fits is c (8192), not the tail; 2048 stays free
    g = a.malloc(6000, stream=S1)
    assert g == c
    assert a.lookup(g).size == 6144
    st = a.memory_stats()
    assert st["inactive_split.all.current"] == 2  # c's rest and the tail
    assert st["inactive_split_bytes.all.current"] == 2048 + (2 * MiB - (4096 + 512 + 8192 + 512 + 4096 + 512))
    # a 2048 request takes c's rest exactly, no new segment
    h = a.malloc(2048, stream=S1)
    assert h == c + 6144
    assert a.memory_stats()["num_device_alloc"] == 1
    ok(a)


def test_block_never_handed_to_another_stream() -> None:
    _, a = make()
    p = a.malloc(4096, stream=S1)
    a.free(p)
    assert a.memory_stats()["num_device_alloc"] == 1
    q = a.malloc(4096, stream=S2)
    assert q != p
    blk = a.lookup(q)
    assert blk.stream == S2
    st = a.memory_stats()
    assert st["num_device_alloc"] == 2
    assert st["segment.all.current"] == 2
    assert st["reserved_bytes.all.current"] == 4 * MiB
    ok(a)
    # the stream-1 segment is still there, untouched, and stream 1 gets it back
    assert a.malloc(4096, stream=S1) == p
    assert a.memory_stats()["num_device_alloc"] == 2
    ok(a)


def test_stream_two_large_requests_do_not_share_stream_one_cache() -> None:
    _, a = make()
    p = a.malloc(5 * MiB, stream=S1)
    a.free(p)
    q = a.malloc(5 * MiB, stream=S2)
    assert q != p and a.memory_stats()["reserved_bytes.large_pool.current"] == 40 * MiB
    ok(a)


# --------------------------------------------------------------------------- split rules
def test_small_remainder_of_512_is_split() -> None:
    _, a = make()
    p = a.malloc(MiB, stream=S1)  # 2 MiB segment: rest 1 MiB
    q = a.malloc(MiB - 512, stream=S1)  # takes the 1 MiB rest: 512 left, split off
    assert q == p + MiB
    assert a.lookup(q).size == MiB - 512
    st = a.memory_stats()
    assert st["inactive_split.small_pool.current"] == 1
    assert st["inactive_split_bytes.small_pool.current"] == 512
    assert st["allocated_bytes.small_pool.current"] == 2 * MiB - 512
    ok(a)
    r = a.malloc(1, stream=S1)
    assert r == q + MiB - 512
    st = a.memory_stats()
    assert st["inactive_split.small_pool.current"] == 0
    assert st["allocated_bytes.small_pool.current"] == 2 * MiB
    assert st["segment.all.current"] == 1
    ok(a)


def test_large_remainder_of_exactly_one_mib_stays_attached() -> None:
    _, a = make()
    p = a.malloc(9 * MiB, stream=S1)  # 20 MiB segment, 11 MiB rest split off
    st = a.memory_stats()
    assert st["inactive_split_bytes.large_pool.current"] == 11 * MiB
    q = a.malloc(10 * MiB, stream=S1)  # best fit: the 11 MiB block; 1 MiB rest is not split
    assert q == p + 9 * MiB
    assert a.lookup(q).size == 11 * MiB
    st = a.memory_stats()
    assert st["allocated_bytes.large_pool.current"] == 20 * MiB  # counts the attached 1 MiB
    assert st["requested_bytes.large_pool.current"] == 19 * MiB
    assert st["active_bytes.large_pool.current"] == 20 * MiB
    assert st["inactive_split.large_pool.current"] == 0
    assert st["inactive_split_bytes.large_pool.current"] == 0
    assert st["num_device_alloc"] == 1
    ok(a)
    a.free(q)  # the whole 11 MiB comes back
    st = a.memory_stats()
    assert st["allocated_bytes.large_pool.current"] == 9 * MiB
    assert st["inactive_split_bytes.large_pool.current"] == 11 * MiB
    ok(a)


@pytest.mark.parametrize(("request_", "rest"), [(10 * MiB - 512, MiB + 512), (9 * MiB, 2 * MiB)])
def test_large_remainder_above_one_mib_is_split(request_: int, rest: int) -> None:
    _, a = make()
    a.malloc(9 * MiB, stream=S1)
    q = a.malloc(request_, stream=S1)
    assert a.lookup(q).size == request_
    st = a.memory_stats()
    assert st["inactive_split.large_pool.current"] == 1
    assert st["inactive_split_bytes.large_pool.current"] == rest
    assert st["allocated_bytes.large_pool.current"] == 9 * MiB + request_
    ok(a)


def test_split_rules_with_shrunken_sizes() -> None:
    _, a = make(sizes=SHRUNK)
    p = a.malloc(4096, stream=S1)  # small: 8192 segment, 4096 rest split
    assert a.lookup(p).size == 4096
    assert a.memory_stats()["inactive_split_bytes.small_pool.current"] == 4096
    q = a.malloc(4097, stream=S1)  # large (4608): 40960 segment, rest 36352 > 4096: split
    assert a.lookup(q).size == 4608
    st = a.memory_stats()
    assert st["reserved_bytes.large_pool.current"] == 40960
    assert st["inactive_split_bytes.large_pool.current"] == 40960 - 4608
    r = a.malloc(40960 - 4608 - 4096, stream=S1)  # rest exactly small_size (4096): attached
    assert a.lookup(r).size == 40960 - 4608
    st = a.memory_stats()
    assert st["inactive_split.large_pool.current"] == 0
    assert st["allocated_bytes.large_pool.current"] == 40960
    s = a.malloc(20480, stream=S1)  # min_large_alloc: its own 24576 segment (rounded to 8192)
    assert a.lookup(s).size == 20480 + 4096  # rest 4096 == small_size: attached
    st = a.memory_stats()
    assert st["reserved_bytes.large_pool.current"] == 40960 + 24576
    assert st["segment.large_pool.current"] == 2
    ok(a)


# --------------------------------------------------------------------------- free / merge
def test_free_merges_with_both_neighbours() -> None:
    _, a = make()
    x = a.malloc(4096, stream=S1)
    y = a.malloc(4096, stream=S1)
    z = a.malloc(4096, stream=S1)
    tail = 2 * MiB - 3 * 4096
    assert block_layout(a) == [[(4096, ALLOC), (4096, ALLOC), (4096, ALLOC), (tail, FREE)]]
    a.free(x)
    ok(a)
    assert block_layout(a) == [[(4096, FREE), (4096, ALLOC), (4096, ALLOC), (tail, FREE)]]
    st = a.memory_stats()
    assert (st["inactive_split.all.current"], st["inactive_split_bytes.all.current"]) == (2, 4096 + tail)
    a.free(z)  # merges with the tail (next)
    ok(a)
    assert block_layout(a) == [[(4096, FREE), (4096, ALLOC), (4096 + tail, FREE)]]
    st = a.memory_stats()
    assert (st["inactive_split.all.current"], st["inactive_split_bytes.all.current"]) == (2, 8192 + tail)
    a.free(y)  # merges with both sides: one unsplit free segment
    ok(a)
    assert block_layout(a) == [[(2 * MiB, FREE)]]
    st = a.memory_stats()
    assert st["inactive_split.all.current"] == 0
    assert st["inactive_split_bytes.all.current"] == 0
    assert st["inactive_split.all.peak"] == 2
    assert st["allocation.all.current"] == 0 and st["active.all.current"] == 0
    assert st["segment.all.current"] == 1


def test_free_merges_with_previous_neighbour() -> None:
    _, a = make()
    x = a.malloc(4096, stream=S1)
    y = a.malloc(4096, stream=S1)
    a.malloc(4096, stream=S1)
    a.free(x)
    a.free(y)  # merges with x (prev) only; its next is allocated
    ok(a)
    assert block_layout(a)[0][:2] == [(8192, FREE), (4096, ALLOC)]
    assert a.malloc(8192, stream=S1) == x  # the merged block fits 8192 exactly


class ContiguousDevice(FakeDevice):
    """Hands out segments back to back, so adjacent segments touch."""

    def malloc(self, nbytes: int) -> int | None:
        self.calls.append("malloc")
        if self.used + nbytes > self.total:
            return None
        ptr = self._next
        self._next += nbytes
        self.live[ptr] = nbytes
        self.used += nbytes
        return ptr


def test_segments_never_merge_even_when_adjacent() -> None:
    dev = ContiguousDevice()
    a = CachingAllocator(dev)
    p = a.malloc(20 * MiB, stream=S1)  # own 20 MiB segment
    q = a.malloc(20 * MiB, stream=S1)  # own 20 MiB segment, right after p's
    assert q == p + 20 * MiB
    a.free(p)
    a.free(q)
    ok(a)
    assert block_layout(a) == [[(20 * MiB, FREE)], [(20 * MiB, FREE)]]
    # 30 MiB would fit in the two segments together; they must not merge
    r = a.malloc(30 * MiB, stream=S1)
    assert r not in (p, q)
    st = a.memory_stats()
    assert st["num_device_alloc"] == 3
    assert st["segment.all.current"] == 3
    ok(a)
    small = [a.malloc(MiB, stream=S2) for _ in range(3)]  # two small segments, back to back
    assert small[2] == small[0] + 2 * MiB
    for s in small:
        a.free(s)
    ok(a)
    layout = block_layout(a)
    assert layout.count([(2 * MiB, FREE)]) == 2


# --------------------------------------------------------------------------- requested, peaks
def test_requested_bytes_tracks_what_was_asked_for() -> None:
    _, a = make()
    p = a.malloc(1000, stream=S1)
    q = a.malloc(3 * MiB + 7, stream=S1)
    st = a.memory_stats()
    assert st["requested_bytes.all.current"] == 3 * MiB + 1007
    assert st["requested_bytes.small_pool.current"] == 1000
    assert st["requested_bytes.large_pool.current"] == 3 * MiB + 7
    assert st["allocated_bytes.all.current"] == 1024 + 3 * MiB + 512
    a.free(p)
    st = a.memory_stats()
    assert st["requested_bytes.all.current"] == 3 * MiB + 7
    assert st["requested_bytes.all.freed"] == 1000
    assert st["requested_bytes.all.allocated"] == 3 * MiB + 1007
    assert st["requested_bytes.all.peak"] == 3 * MiB + 1007
    a.free(q)
    st = a.memory_stats()
    assert st["requested_bytes.all.current"] == 0
    assert st["requested_bytes.all.freed"] == 3 * MiB + 1007
    p = a.malloc(1000, stream=S1)
    q = a.malloc(2000, stream=S1)
    a.free(p)
    a.free(q)
    assert a.memory_stats()["requested_bytes.small_pool.freed"] == 4000
    ok(a)


def test_peaks_and_accumulated_counters_and_their_resets() -> None:
    dev, a = make()
    p = a.malloc(MiB + 512, stream=S1)  # large: 20 MiB segment
    q = a.malloc(512, stream=S1)  # small: 2 MiB segment
    a.free(p)
    st = a.memory_stats()
    assert st["allocated_bytes.all.current"] == 512
    assert st["allocated_bytes.all.peak"] == MiB + 1024
    assert st["allocated_bytes.large_pool.peak"] == MiB + 512
    assert st["allocated_bytes.all.allocated"] == MiB + 1024
    assert st["allocated_bytes.all.freed"] == MiB + 512
    assert st["allocation.all.allocated"] == 2 and st["allocation.all.freed"] == 1
    assert st["allocation.all.peak"] == 2
    assert st["reserved_bytes.all.current"] == 22 * MiB
    assert st["reserved_bytes.all.peak"] == 22 * MiB
    assert st["num_device_alloc"] == 2 and st["num_device_free"] == 0
    ok(a)

    a.reset_peak()
    st = a.memory_stats()
    assert st["allocated_bytes.all.peak"] == 512
    assert st["allocation.all.peak"] == 1
    assert st["reserved_bytes.all.peak"] == 22 * MiB
    assert st["allocated_bytes.all.allocated"] == MiB + 1024  # accumulated untouched

    a.empty_cache()  # returns the unsplit free 20 MiB segment
    st = a.memory_stats()
    assert st["reserved_bytes.all.current"] == 2 * MiB
    assert st["reserved_bytes.all.peak"] == 22 * MiB
    assert st["segment.large_pool.freed"] == 1
    assert st["num_device_free"] == 1
    assert dev.calls.count("free") == 1
    a.reset_peak()
    assert a.memory_stats()["reserved_bytes.all.peak"] == 2 * MiB
    ok(a)

    a.reset_accumulated()
    st = a.memory_stats()
    for k, v in st.items():
        if k.endswith(".allocated") or k.endswith(".freed") or k in SCALAR_NAMES:
            assert v == 0, k
    assert st["allocated_bytes.all.current"] == 512  # levels untouched
    assert st["reserved_bytes.all.current"] == 2 * MiB
    assert st["allocated_bytes.all.peak"] == 512  # peaks untouched
    ok(a)
    blk = a.lookup(q)  # the live allocation survives the reset
    assert blk is not None and (blk.ptr, blk.size, blk.allocated) == (q, 512, True)


def test_reset_peak_counts_held_blocks_in_the_active_peak() -> None:
    """After reset_peak each kind's active peak is its level then, held blocks included: it
    stays there when a hold ends later, while the other kind is the one changing."""
    dev, a = make()
    p = a.malloc(4096, stream=S1)  # small
    q = a.malloc(4096, stream=S1)  # small, stays allocated
    a.record_stream(p, S2)
    a.free(p)  # held on its event: two small blocks active
    a.malloc(2 * MiB + 512, stream=S1)  # large: the large kind changes last
    a.reset_peak()
    dev.complete_all()
    a.malloc(4 * MiB, stream=S1)  # large again; polls the event: p's hold ends
    st = a.memory_stats()
    assert (st["active.small_pool.current"], st["active_bytes.small_pool.current"]) == (1, 4096)
    assert (st["active.small_pool.peak"], st["active_bytes.small_pool.peak"]) == (2, 8192)
    assert a.lookup(q) is not None and a.lookup(p) is None
    ok(a)


def test_free_after_reset_accumulated_keeps_invariants() -> None:
    _, a = make()
    q = a.malloc(512, stream=S1)
    a.reset_accumulated()
    a.free(q)
    st = a.memory_stats()
    assert st["allocation.all.freed"] == 1 and st["allocation.all.allocated"] == 0
    assert st["allocated_bytes.all.freed"] == 512
    assert st["allocated_bytes.all.current"] == 0
    ok(a)


# --------------------------------------------------------------------------- record_stream
def test_record_stream_block_waits_for_its_event_polled_at_next_malloc() -> None:
    dev, a = make()
    p = a.malloc(4096, stream=S1)
    q = a.malloc(4096, stream=S1)  # keeps p from merging with the tail
    a.record_stream(p, S2)
    assert "record" not in dev.calls
    a.free(p)
    assert dev.calls.count("record") == 1
    st = a.memory_stats()
    assert st["allocation.all.current"] == 1
    assert st["allocated_bytes.all.current"] == 4096
    assert st["active.all.current"] == 2  # p still counts as active (waiting on its event)
    assert st["active_bytes.all.current"] == 8192
    assert st["requested_bytes.all.current"] == 8192
    assert block_layout(a)[0][:2] == [(4096, PENDING), (4096, ALLOC)]
    ok(a)
    r = a.malloc(4096, stream=S1)  # polls: event incomplete, p not reusable
    assert "query" in dev.calls
    assert r != p
    ok(a)
    dev.complete_all()
    assert a.lookup(p) is None
    s = a.malloc(4096, stream=S1)  # polls: event complete, p is free again and the best fit
    assert s == p
    st = a.memory_stats()
    assert st["active.all.current"] == 3 and st["allocation.all.current"] == 3
    ok(a)
    for x in (q, r, s):
        a.free(x)
    ok(a)
    assert block_layout(a) == [[(2 * MiB, FREE)]]


def test_record_stream_several_streams_all_events_must_complete() -> None:
    dev, a = make()
    p = a.malloc(4096, stream=S1)
    a.malloc(4096, stream=S1)
    a.record_stream(p, S2)
    a.record_stream(p, S3)
    a.record_stream(p, S3)  # recorded once
    a.free(p)
    assert dev.calls.count("record") == 2
    pending = [ev for ev, done in dev.events.items() if not done]
    assert len(pending) == 2
    dev.events[pending[0]] = True
    assert a.malloc(4096, stream=S1) != p  # one user still running
    ok(a)
    dev.events[pending[1]] = True
    assert a.malloc(4096, stream=S1) == p
    ok(a)


def test_record_stream_on_own_stream_records_nothing() -> None:
    dev, a = make()
    p = a.malloc(4096, stream=S1)
    a.record_stream(p, S1)
    a.free(p)
    assert "record" not in dev.calls
    assert a.malloc(4096, stream=S1) == p
    ok(a)


def test_empty_cache_forces_pending_events_with_event_synchronize() -> None:
    dev, a = make()
    p = a.malloc(4096, stream=S1)
    a.record_stream(p, S2)
    a.free(p)
    st = a.memory_stats()
    assert st["active.all.current"] == 1 and st["segment.all.current"] == 1
    a.empty_cache()
    assert "sync" in dev.calls
    st = a.memory_stats()
    assert st["active.all.current"] == 0
    assert st["segment.all.current"] == 0
    assert st["reserved_bytes.all.current"] == 0
    assert st["num_device_free"] == 1
    assert dev.live == {}
    ok(a)


def test_record_stream_errors() -> None:
    _, a = make()
    p = a.malloc(512, stream=S1)
    a.free(p)
    with pytest.raises(DoubleFreeError):
        a.record_stream(p, S2)
    with pytest.raises(ForeignPointerError):
        a.record_stream(12345 * 4096, S2)
    ok(a)


# --------------------------------------------------------------------------- out of memory
def test_oom_releases_cached_segments_and_retries_once() -> None:
    dev, a = make(total=20480, sizes=SHRUNK)
    p1 = a.malloc(4096, stream=S1)  # segment A (8192)
    a.free(p1)  # A cached, unsplit
    p2 = a.malloc(4096, stream=S2)  # segment B (8192): no room for a third segment now
    assert dev.used == 16384
    p3 = a.malloc(4096, stream=S3)  # refused, A released, retried: segment C
    st = a.memory_stats()
    assert st["num_alloc_retries"] == 1
    assert st["num_ooms"] == 0
    assert st["num_device_alloc"] == 3
    assert st["num_device_free"] == 1
    assert st["segment.all.current"] == 2
    assert st["reserved_bytes.all.current"] == 16384
    assert dev.calls == ["malloc", "malloc", "malloc", "free", "malloc"]
    assert a.lookup(p3).stream == S3
    ok(a)

    before = a.memory_stats()
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc(20000, stream=S3)  # large: a 24576 segment; nothing cached to release
    assert isinstance(info.value, MemoryError)
    after = a.memory_stats()
    assert after["num_ooms"] == 1
    assert after["num_alloc_retries"] == 2
    assert after["num_sync_all_streams"] == before["num_sync_all_streams"] + 1  # the retry's one wait
    changed = {k for k in after if after[k] != before[k]}
    assert changed == {"num_ooms", "num_alloc_retries", "num_sync_all_streams"}
    msg = str(info.value)
    assert "19.53 KiB" in msg or "20000" in msg  # the request
    assert "8.00 KiB" in msg or "8192" in msg  # allocated
    assert "16.00 KiB" in msg or "16384" in msg  # reserved
    assert "4.00 KiB" in msg or "4096" in msg  # free on the device
    for word in ("allocate", "allocated", "reserved", "private", "free"):
        assert word in msg
    ok(a)

    # state stays usable: free everything and give it all back
    a.free(p2)
    a.free(p3)
    a.empty_cache()
    st = a.memory_stats()
    assert st["reserved_bytes.all.current"] == 0 and dev.used == 0
    assert a.lookup(a.malloc(4096, stream=S3)) is not None
    ok(a)


def test_oom_retry_waits_for_pending_events_before_release() -> None:
    dev, a = make(total=8192, sizes=SHRUNK)
    p = a.malloc(4096, stream=S1)
    a.record_stream(p, S2)
    a.free(p)  # waiting on an event; the segment is unsplit but not free yet
    q = a.malloc(4096, stream=S2)  # refused -> events synchronized, segment released -> retry
    assert "sync" in dev.calls
    st = a.memory_stats()
    assert st["num_alloc_retries"] == 1 and st["num_ooms"] == 0 and st["num_device_free"] == 1
    assert a.lookup(q).stream == S2
    ok(a)


def test_oom_retry_takes_the_block_a_completed_stream_use_freed_and_releases_nothing() -> None:
    """Refused, the retry first waits for pending stream uses: a block of this stream they
    freed that fits is taken, with no cache release and no retry counted."""
    dev, a = make(total=8192, sizes=SHRUNK)
    p = a.malloc(8192, stream=S1)  # the whole device (its least segment, after a retry)
    a.record_stream(p, S2)
    a.free(p)  # waiting on an event
    n = len(dev.calls)
    q = a.malloc(8192, stream=S1)  # refused -> events synchronized -> p's block fits
    assert q == p and dev.calls[n:] == ["query", "malloc", "sync"]  # no release, no second ask
    st = a.memory_stats()
    assert (st["num_alloc_retries"], st["num_ooms"], st["num_device_free"]) == (1, 0, 0)  # 1: p's
    ok(a)


def test_oom_retry_never_hands_a_completed_stream_uses_oversize_block_to_a_smaller_request() -> None:
    """The block a completed stream use freed is taken by the retry only as the split rules
    allow: one of exactly max_split_size is oversize, so a smaller request releases it instead."""
    import dataclasses

    m = 6 * 8192  # max_split_size; SHRUNK's large segments round to 8 KiB
    _, a = make(total=m + 8192, sizes=dataclasses.replace(SHRUNK, max_split_size=m))
    p = a.malloc(m, stream=S1)  # one unsplit segment of exactly m
    a.record_stream(p, S2)
    a.free(p)  # waiting on an event
    q = a.malloc(8192, stream=S1)  # a 40 KiB segment refused; the retry frees p, refuses it, releases it
    assert q != p and a.lookup(p) is None
    st = a.memory_stats()
    assert (st["num_alloc_retries"], st["num_device_free"], st["reserved_bytes.all.current"]) == (1, 1, 40960)
    a.free(q)
    ok(a)


def test_oom_retry_hands_a_completed_stream_uses_oversize_block_to_a_request_as_large() -> None:
    """A request of max_split_size or more may take an oversize block that wastes less than
    max_non_split_rounding: the block a completed stream use freed is taken, nothing released."""
    import dataclasses

    m = 6 * 8192  # max_split_size
    _, a = make(total=m + 8192, sizes=dataclasses.replace(SHRUNK, max_split_size=m))
    p = a.malloc(m, stream=S1)
    a.record_stream(p, S2)
    a.free(p)  # waiting on an event
    assert a.malloc(m, stream=S1) == p  # refused; the retry's wait frees p, which fits
    assert a.memory_stats()["num_device_free"] == 0
    ok(a)


def test_a_private_pools_retries_are_counted_in_its_own_statistics() -> None:
    """Each out-of-memory retry of an allocation routed to a MemPool's pool counts once in
    the pool's statistics and once in the device's."""
    from graphpool.policy.private_pools import PoolSpec, mempools

    _, a = make(total=4 * MiB)
    pid = PoolId(0, 994)
    mempools[pid] = PoolSpec(None, False)
    try:
        a.ensure_pool(pid)
        c = a.malloc(512, stream=S2)  # the ordinary pool holds 2 MiB of the 4
        a.enter_pool(pid)
        for n in (1, 2):
            with pytest.raises(OutOfMemoryError):
                a.malloc(3 * MiB, stream=S1)  # refused, retried once, refused again
            assert a.memory_stats(pid)["num_alloc_retries"] == n
        a.exit_pool(pid)
        assert a.memory_stats()["num_alloc_retries"] == 2
        a.free(c)
        ok(a)
    finally:
        mempools.pop(pid, None)


def test_oom_asks_the_driver_again_only_for_a_smaller_segment() -> None:
    """A small request's least segment is its usual one: after the refusal and the retry
    (once the cache is released) the driver is not asked a third time."""
    dev, a = make(total=1 * MiB)
    with pytest.raises(OutOfMemoryError):
        a.malloc(512, stream=S1)
    assert dev.refused == 2
    st = a.memory_stats()
    assert (st["num_alloc_retries"], st["num_ooms"]) == (1, 1)
    ok(a)


def test_pool_stats_hold_of_the_other_kind_raises_its_active_peak() -> None:
    """A hold of one kind, while the other kind changed last, counts in that kind's active
    peak (and in the total's)."""
    st = PoolStats()
    st.on_malloc(True, 512, 512, 0, 0)  # the small kind changes
    st.hold(False, 4096, 1)  # a large block starts being held ...
    st.hold(False, 4096, -1)  # ... and stops
    d = st.as_dict()
    assert (d["active.large_pool.peak"], d["active_bytes.large_pool.peak"]) == (1, 4096)
    assert (d["active.all.peak"], d["active_bytes.all.peak"]) == (2, 4608)
    assert d["active.large_pool.current"] == 0


def test_request_larger_than_the_device_fails_without_touching_state() -> None:
    dev, a = make(total=1 << 30)
    a.malloc(512, stream=S1)
    before = a.memory_stats()
    calls = list(dev.calls)
    with pytest.raises(OutOfMemoryError):
        a.malloc((1 << 30) + 1, stream=S1)
    before["num_ooms"] += 1  # counted, as docs/behaviour.rst says (it can never fit)
    assert a.memory_stats() == before
    assert dev.calls == calls
    ok(a)


def test_bad_sizes_raise_and_change_nothing() -> None:
    dev, a = make()
    before = a.memory_stats()
    with pytest.raises(ValueError, match=r"^cannot allocate a negative number of bytes \(-1\)$"):
        a.malloc(-1, stream=S1)
    for bad in (1.5, "10", None, True, b"x"):
        with pytest.raises(TypeError):
            a.malloc(bad, stream=S1)  # type: ignore[arg-type]
    assert a.memory_stats() == before and dev.calls == []
    p = a.malloc(np.int64(1000), stream=S1)  # an __index__ int is fine
    assert a.lookup(p).size == 1024 and a.lookup(p).requested == 1000
    ok(a)


# --------------------------------------------------------------------------- bad frees
def test_fmt_bytes_names_the_largest_unit_that_keeps_the_figure_at_least_one() -> None:
    assert [fmt_bytes(n) for n in (0, 512, 1023)] == ["0 B", "512 B", "1023 B"]
    assert [fmt_bytes(n) for n in (1024, 1536, 20 * MiB, 3 << 30)] == [
        "1.00 KiB",
        "1.50 KiB",
        "20.00 MiB",
        "3.00 GiB",
    ]
    assert fmt_bytes(5 << 40) == "5.00 TiB"


def test_oom_message_says_what_to_do() -> None:
    _, a = make(total=1 << 30)
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc((1 << 30) + 1, stream=S1)
    assert str(info.value).endswith(
        "Free buffers you no longer need, reset graphs you no longer replay, then call empty_cache()."
    )


def test_free_errors_are_typed_and_change_nothing() -> None:
    _, a = make()
    p = a.malloc(4096, stream=S1)
    q = a.malloc(4096, stream=S1)
    a.free(p)
    before = a.memory_stats()
    with pytest.raises(DoubleFreeError):
        a.free(p)  # freed already
    with pytest.raises(DoubleFreeError):
        a.free(p + 512)  # inside a free block
    with pytest.raises(ForeignPointerError):
        a.free(q + 512)  # inside a live allocation, not its start
    with pytest.raises(ForeignPointerError):
        a.free(0x1234)  # never graphpool's
    with pytest.raises(ForeignPointerError):
        a.free(q + 100 * MiB)  # past every segment
    with pytest.raises(TypeError, match=r"^free: expected an int device address, got str$"):
        a.free("0x10")  # type: ignore[arg-type]
    assert a.memory_stats() == before
    assert a.lookup(q) is not None
    ok(a)
    a.free(q)
    ok(a)


# --------------------------------------------------------------------------- empty_cache
def test_empty_cache_returns_only_unsplit_free_segments() -> None:
    dev, a = make()
    p = a.malloc(4096, stream=S1)  # segment A: p + free tail (split)
    q = a.malloc(4096, stream=S2)  # segment B
    r = a.malloc(12 * MiB, stream=S1)  # segment C (12 MiB, own)
    a.free(q)  # B: unsplit and free
    a.free(r)  # C: unsplit and free
    a.empty_cache()
    st = a.memory_stats()
    assert st["num_device_free"] == 2
    assert st["segment.all.current"] == 1
    assert st["reserved_bytes.all.current"] == 2 * MiB
    assert st["allocated_bytes.all.current"] == 4096
    assert block_layout(a) == [[(4096, ALLOC), (2 * MiB - 4096, FREE)]]
    assert list(dev.live.values()) == [2 * MiB]
    ok(a)
    a.empty_cache()  # idempotent
    assert a.memory_stats()["num_device_free"] == 2
    a.free(p)
    a.empty_cache()
    assert a.memory_stats()["reserved_bytes.all.current"] == 0 and dev.live == {}
    ok(a)


def test_lookup_and_snapshot_describe_blocks() -> None:
    _, a = make()
    p = a.malloc(1000, stream=S1)
    blk = a.lookup(p)
    assert (blk.ptr, blk.size, blk.requested, blk.stream, blk.allocated) == (p, 1024, 1000, S1, True)
    (seg,) = a.snapshot()
    assert seg["address"] == p and seg["total_size"] == 2 * MiB
    assert seg["allocated_size"] == 1024 and seg["requested_size"] == 1000
    assert seg["stream"] == S1 and seg["segment_type"] == "small" and seg["segment_pool_id"] is None
    assert seg["blocks"][0] == {
        "address": p,
        "size": 1024,
        "requested_size": 1000,
        "state": ALLOC,
        "owner_graph": None,
        "kept_for": [],
    }
    assert a.lookup(p + 512) is None
    assert seg["active_size"] == 1024
    q = a.malloc(4096, stream=S1)
    a.malloc(512, stream=S1)
    a.record_stream(q, S2)
    a.free(q)  # held on its event: active, not allocated
    (seg,) = a.snapshot()
    assert (seg["allocated_size"], seg["active_size"]) == (1024 + 512, 1024 + 4096 + 512)


def test_block_repr_says_address_size_stream_and_state() -> None:
    _, a = make()
    p = a.malloc(1000, stream=S1)
    q = a.malloc(4096, stream=S1)
    a.malloc(512, stream=S1)
    a.record_stream(q, S2)
    held = a.lookup(q)
    a.free(q)  # held on its event
    assert repr(a.lookup(p)) == f"Block(0x{p:x}, 1024, stream={S1}, allocated)"
    assert repr(held) == f"Block(0x{q:x}, 4096, stream={S1}, held)"
    tail = a.snapshot()[0]["blocks"][-1]
    assert tail["state"] == FREE
    free_tail = a._segments[p].next.next.next  # type: ignore[union-attr]
    assert repr(free_tail) == f"Block(0x{tail['address']:x}, {tail['size']}, stream={S1}, free)"


# --------------------------------------------------------------------------- finalizer frees
def test_deferred_free_is_carried_out_by_the_next_call() -> None:
    dev, a = make()
    p = a.malloc(4096, stream=S1)
    a.defer_free(p)  # what a finalizer does: no lock, no device call
    assert a.lookup(p) is not None and dev.calls == ["malloc"]
    q = a.malloc(4096, stream=S1)  # drains first, so p is free and the best fit again
    assert q == p
    ok(a)


def test_a_bad_deferred_free_warns_and_does_not_fail_the_next_call() -> None:
    _, a = make()
    p = a.malloc(4096, stream=S1)
    a.free(p)
    a.defer_free(p)  # freed already
    a.defer_free(0x1234)  # never graphpool's
    with pytest.warns(RuntimeWarning) as warned:
        q = a.malloc(512, stream=S1)
    assert a.lookup(q) is not None
    said = [str(w.message) for w in warned]
    assert [m.split("(")[0] for m in said] == ["graphpool: deferred work failed: DoubleFreeError"] + [
        "graphpool: deferred work failed: ForeignPointerError"
    ]
    assert all("free: 0x" in m for m in said)  # the error names the call and the pointer
    ok(a)


def test_a_deferred_free_with_another_stream_waits_for_that_streams_work() -> None:
    dev, a = make()
    p = a.malloc(4096, stream=S1)
    q = a.malloc(4096, stream=S1)  # keeps p from merging with the tail
    a.defer_free(p, S2)  # a finalizer: p was also used on S2
    r = a.malloc(4096, stream=S1)  # carries out the free: p waits on an event of S2
    assert r != p and [s for _, s in dev.recorded] == [S2]
    dev.complete_all()
    assert a.malloc(4096, stream=S1) == p
    a.defer_free(q, S1)  # its own stream: no event, reusable at once
    assert a.malloc(4096, stream=S1) == q and len(dev.recorded) == 1
    ok(a)


def test_the_event_of_a_record_on_a_destroyed_stream_is_reused() -> None:
    dev, a = make()
    p = a.malloc(4096, stream=S1)
    q = a.malloc(4096, stream=S1)
    a.record_stream(p, S3)
    dev.destroyed.add(S3)
    a.free(p)  # S3 is gone: the device is synchronized instead, the event kept for later
    assert dev.recorded == [] and a.lookup(p) is None
    a.record_stream(q, S2)
    a.free(q)
    assert list(dev.events) == [ev for ev, _ in dev.recorded]  # one event made, recorded on S2
    assert [s for _, s in dev.recorded] == [S2]
    ok(a)


def test_debug_mode_checks_invariants_after_every_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRAPHPOOL_DEBUG", "1")
    _, a = make()
    p = a.malloc(512, stream=S1)
    a.stats.small.allocation_cur += 1  # corrupt a level behind the allocator's back
    with pytest.raises(AssertionError, match="allocation"):
        a.free(p)
    monkeypatch.setenv("GRAPHPOOL_DEBUG", "0")
    _, b = make()
    q = b.malloc(512, stream=S1)
    b.stats.small.allocation_cur += 1
    b.free(q)  # not checked without the variable


class _ReenteringDevice(FakeDevice):
    """Runs ``hook`` inside the allocator's next segment allocation, as a finalizer run by
    garbage collection inside a malloc would."""

    hook: object = None

    def malloc(self, nbytes: int) -> int | None:
        hook, self.hook = self.hook, None
        if callable(hook):
            hook()
        return super().malloc(nbytes)


class _ReenteringRecordDevice(FakeDevice):
    """Runs ``hook`` inside the allocator's next event record (in a free, say)."""

    hook: object = None

    def record_event(self, event: int, stream: int) -> None:
        hook, self.hook = self.hook, None
        if callable(hook):
            hook()
        super().record_event(event, stream)


def test_a_call_that_reenters_free_raises_and_a_free_is_queued() -> None:
    dev = _ReenteringRecordDevice()
    a = CachingAllocator(dev)
    p = a.malloc(4096, stream=7)
    q = a.malloc(4096, stream=7)
    a.record_stream(p, 8)
    seen: list[BaseException] = []

    rec = a.begin_capture(PoolId(1, 0), lambda: dev.begin(9), stream=9)
    dev.end(9)
    a.end_capture(rec)
    calls = {
        "memory_stats": a.memory_stats,
        "release_capture": lambda: a.release_capture(rec),
        "check_invariants": a.check_invariants,
    }

    def hook() -> None:
        for call in calls.values():
            try:
                call()
            except GraphpoolError as e:
                seen.append(e)
        a.free(q)  # queued: carried out by the next call

    dev.hook = hook
    a.free(p)  # records an event on stream 8: runs the hook mid-free
    assert [str(e).split(" re-entered")[0] for e in seen] == [f"graphpool: {c}" for c in calls]
    assert a.lookup(q).allocated  # type: ignore[union-attr]
    a.check_invariants()
    assert a.malloc(512, stream=7) == q  # the queued free was carried out first: q is free
    assert a.memory_stats()["allocation.all.current"] == 1
    a.release_capture(rec)
    a.check_invariants()


def test_a_free_that_reenters_malloc_is_queued_not_applied_mid_call() -> None:
    dev = _ReenteringDevice()
    a = CachingAllocator(dev)
    first = a.malloc(512, stream=7)
    dev.hook = lambda: a.free(first)  # re-enters while malloc is mid-call
    second = a.malloc(2 << 20, stream=7)  # needs a new segment: runs the hook
    assert a.lookup(first) is not None and a.lookup(first).allocated  # type: ignore[union-attr]
    a.check_invariants()
    assert a.memory_stats()["allocation.all.current"] == 1  # the next call did the queued free
    a.free(second)
    assert a.memory_stats()["allocation.all.current"] == 0
    with pytest.raises(DoubleFreeError):
        a.free(first)
    a.check_invariants()


def test_a_reentering_free_of_a_bad_pointer_still_raises_at_once() -> None:
    dev = _ReenteringDevice()
    a = CachingAllocator(dev)
    live = a.malloc(1024, stream=7)
    gone = a.malloc(512, stream=7)
    a.free(gone)
    seen: list[BaseException] = []

    def hook() -> None:
        for ptr in (gone, 12345, live, live):  # the second free of ``live`` finds it queued
            try:
                a.free(ptr)
            except (DoubleFreeError, ForeignPointerError) as e:
                seen.append(e)

    dev.hook = hook
    p = a.malloc(4 << 20, stream=7)  # a new segment: runs the hook mid-call
    assert [type(e) for e in seen] == [DoubleFreeError, ForeignPointerError, DoubleFreeError]
    assert "already queued" in str(seen[2])
    a.free(p)  # also carries out the queued free of ``live``
    assert a.lookup(live) is None
    a.check_invariants()


def test_a_reentering_free_of_a_queued_block_says_this_allocation() -> None:
    """A Block queued by a finalizer and freed again from inside a call: a double free,
    named as the allocation (a Block's address may have changed hands since)."""
    dev = _ReenteringDevice()
    a = CachingAllocator(dev)
    owned = a.malloc_owned(1024, stream=7)
    seen: list[BaseException] = []

    def hook() -> None:
        a.defer_free(owned)
        try:
            a.free_owned(owned)
        except DoubleFreeError as e:
            seen.append(e)

    dev.hook = hook
    p = a.malloc(4 << 20, stream=7)  # a new segment: runs the hook mid-call
    assert [str(e) for e in seen] == ["free: this allocation is already queued to be freed"]
    a.free(p)
    dev.complete_all()
    a.check_invariants()


def test_a_reentering_free_finds_a_pointer_queued_with_its_stream() -> None:
    """``defer_free(ptr, stream)`` queues (ptr, stream): a re-entered free of that pointer is
    a double free at once, as for a pointer queued alone."""
    dev = _ReenteringDevice()
    a = CachingAllocator(dev)
    live = a.malloc(1024, stream=7)
    seen: list[BaseException] = []

    def hook() -> None:
        a.defer_free(live, 9)  # a finalizer: the block was also used on stream 9
        try:
            a.free(live)
        except DoubleFreeError as e:
            seen.append(e)

    dev.hook = hook
    p = a.malloc(4 << 20, stream=7)  # a new segment: runs the hook mid-call
    assert len(seen) == 1 and str(seen[0]) == f"free: 0x{live:x} is already queued to be freed"
    a.free(p)  # carries out the queued free of ``live`` (once)
    assert a.lookup(live) is None
    dev.complete_all()
    a.check_invariants()


def test_a_malloc_that_reenters_the_allocator_raises_and_loses_nothing() -> None:
    dev = _ReenteringDevice()
    a = CachingAllocator(dev)
    seen: list[BaseException] = []

    def hook() -> None:
        try:
            a.malloc(512, stream=7)
        except GraphpoolError as e:
            seen.append(e)
        try:
            a.memory_stats()
        except GraphpoolError as e:
            seen.append(e)

    dev.hook = hook
    p = a.malloc(4096, stream=7)
    assert len(seen) == 2 and "malloc re-entered" in str(seen[0]) and "memory_stats" in str(seen[1])
    assert (
        "(a finalizer run by garbage collection during an allocator call?). From finalizers only "
        "free buffers; graphpool queues those frees." in str(seen[0])
    )
    assert a.memory_stats()["allocation.all.current"] == 1
    a.free(p)
    a.empty_cache()
    assert a.memory_stats()["reserved_bytes.all.current"] == 0
    a.check_invariants()


def _corrupt_unfiled(a: CachingAllocator, p: int) -> None:
    a._small.remove(a.lookup(p).next)  # type: ignore[union-attr]


def _corrupt_gap(a: CachingAllocator, p: int) -> None:
    a.lookup(p).size -= 512  # type: ignore[union-attr]


def _corrupt_spare(a: CachingAllocator, p: int) -> None:
    a._spare1 = a.lookup(p)


def _corrupt_stats(a: CachingAllocator, p: int) -> None:
    a.stats.small.allocation_cur += 1


def _corrupt_untracked(a: CachingAllocator, p: int) -> None:
    del a._active[p]


def _corrupt_sizes(a: CachingAllocator, p: int) -> None:
    a._small.bins[0].sizes[0] += 512


@pytest.mark.parametrize(
    "corrupt",
    [_corrupt_unfiled, _corrupt_gap, _corrupt_spare, _corrupt_stats, _corrupt_untracked, _corrupt_sizes],
)
def test_check_invariants_notices_each_kind_of_corruption(corrupt: object) -> None:
    a = CachingAllocator(FakeDevice())
    p = a.malloc(4096, stream=0)
    a.check_invariants()
    corrupt(a, p)  # type: ignore[operator]
    with pytest.raises(AssertionError):
        a.check_invariants()


# --------------------------------------------------------------------------- owned allocations
def test_an_owned_allocation_is_freed_by_its_block_not_by_its_address() -> None:
    """``malloc_owned`` (gp.alloc's call): the owner keeps the Block and frees by it. Its
    address is no raw allocation: ``free(address)`` is refused and changes nothing."""
    _, a = make()
    b = a.malloc_owned(4096, stream=S1)
    p = a.malloc(4096, stream=S1)  # a raw neighbour, filed by address
    assert b.owned and b.allocated and b.ptr not in a._active and p in a._active
    assert a.lookup(b.ptr) is b and a.lookup(p) is not None
    before = a.memory_stats()
    with pytest.raises(ForeignPointerError) as info:
        a.free(b.ptr)
    assert str(info.value) == (
        f"free: 0x{b.ptr:x} is owned by a graphpool DeviceBuffer: free it with the buffer's free() "
        "(or drop the buffer), not by its address"
    )
    with pytest.raises(ForeignPointerError, match=f"^record_stream: 0x{b.ptr:x} is owned by a graphpool"):
        a.record_stream(b.ptr, S2)
    with pytest.raises(DoubleFreeError, match="raw allocation's block"):
        a.free_owned(a.lookup(p))  # a raw allocation's block is not the owner's to give
    with pytest.raises(TypeError, match="got Block"):
        a.free(a.lookup(b.ptr))  # the raw free takes addresses only: no way around the owner
    assert a.memory_stats() == before and b.owned
    ok(a)
    a.free_owned(b)
    assert not b.owned and not b.allocated and a.lookup(b.ptr) is None
    assert cur(a, "allocated_bytes") == 4096  # p only
    with pytest.raises(DoubleFreeError, match="freed already"):
        a.free_owned(b)
    with pytest.raises(TypeError, match="got Block"):
        a.free(b)
    a.free(p)
    assert cur(a, "allocated_bytes") == 0
    ok(a)


def test_owned_blocks_take_the_same_addresses_as_raw_ones() -> None:
    """The owned and the raw call share one policy: the same requests, the same blocks."""
    _, a1 = make()
    _, a2 = make()
    sizes = [4096, 700, 1 << 20, 3 * MiB, 512, 40 * MiB, 4096]
    raw = [a1.malloc(n, stream=S1) for n in sizes]
    owned = [a2.malloc_owned(n, stream=S1) for n in sizes]
    assert [b.ptr for b in owned] == raw
    for i in (1, 3, 5):
        a1.free(raw[i])
        a2.free_owned(owned[i])
    assert a1.memory_stats() == a2.memory_stats() and a1.snapshot() == a2.snapshot()
    assert [a1.malloc(n, stream=S1) for n in sizes] == [a2.malloc_owned(n, stream=S1).ptr for n in sizes]
    ok(a1)
    ok(a2)


def test_an_owned_block_is_queued_recorded_and_refused_twice_as_an_address_is() -> None:
    dev, a = make()
    b = a.malloc_owned(4096, stream=S1)
    keep = a.malloc_owned(4096, stream=S1)  # keeps b from merging with the tail
    a.record_stream(b, S2)
    a.defer_free(b)  # a finalizer's free: carried out by the next call
    assert b.owned
    a.free_owned(keep)  # carries out b's free first: b waits on an event of S2
    assert not b.owned and [s for _, s in dev.recorded] == [S2]
    dev.complete_all()
    assert a.malloc_owned(4096, stream=S1).ptr == b.ptr
    # A free queued twice is refused when a re-entered free asks (the check of _check_pointer)
    c = a.malloc_owned(4096, stream=S3)
    a.defer_free(c)
    a._busy = True
    try:
        with pytest.raises(DoubleFreeError, match="already queued"):
            a._check_pointer(c, "free")
    finally:
        a._busy = False
    a.free_owned(a.malloc_owned(512, stream=S3))  # drains c's free
    assert not c.owned
    ok(a)


def test_an_owned_block_is_refused_by_another_allocator() -> None:
    """A Block goes back only to the allocator that made it: another one's free lists and
    statistics are not its own (and are guarded by another lock)."""
    _, a1 = make()
    _, a2 = make()
    keep = a2.malloc_owned(4096, stream=S1)
    b = a1.malloc_owned(4096, stream=S1)
    before1, before2 = a1.memory_stats(), a2.memory_stats()
    with pytest.raises(ForeignPointerError, match="another allocator"):
        a2.free_owned(b)
    with pytest.raises(ForeignPointerError, match="another allocator"):
        a2.record_stream(b, S2)
    a2.defer_free(b)  # queued: refused when carried out, with a warning, and nothing changes
    with pytest.warns(RuntimeWarning, match="another allocator"):
        a2.free_owned(a2.malloc_owned(512, stream=S1))
    assert a1.memory_stats() == before1 and b.owned
    assert a2.memory_stats()["allocated_bytes.all.current"] == before2["allocated_bytes.all.current"]
    a1.free_owned(b)
    a2.free_owned(keep)
    ok(a1)
    ok(a2)


def test_a_second_free_of_a_reused_block_is_a_double_free() -> None:
    """An owner that frees twice, after its Block object went to a raw allocation: the error
    names a double free, and the raw allocation stays allocated."""
    _, a = make()
    b = a.malloc_owned(4096, stream=S1)
    keep = a.malloc(4096, stream=S1)  # b's neighbour stays allocated: b's block is reused as is
    a.free_owned(b)
    p = a.malloc(4096, stream=S1)
    assert a.lookup(p) is b  # the same Block object, now a raw allocation
    with pytest.raises(DoubleFreeError, match="freed already"):
        a.free_owned(b)
    assert a.lookup(p) is b and b.allocated
    a.free(p)
    a.free(keep)
    ok(a)


def test_each_call_that_reenters_the_allocator_is_named_in_its_error() -> None:
    dev = _ReenteringDevice()
    a = CachingAllocator(dev)
    calls = {
        "reset_peak": a.reset_peak,
        "reset_accumulated": a.reset_accumulated,
        "private_pools": a.private_pools,
    }
    seen: dict[str, str] = {}

    def hook() -> None:
        for name, call in calls.items():
            try:
                call()
            except GraphpoolError as e:
                seen[name] = str(e)

    dev.hook = hook
    p = a.malloc(4096, stream=7)  # a new segment: runs the hook mid-call
    assert sorted(seen) == sorted(calls)
    for name, message in seen.items():
        assert f"{name} re-entered" in message, message
    a.free(p)
    a.check_invariants()


def test_ensure_pool_names_itself_when_it_re_enters() -> None:
    dev = _ReenteringDevice()
    a = CachingAllocator(dev)
    seen: list[str] = []

    def hook() -> None:
        try:
            a.ensure_pool(PoolId(1, 0))
        except GraphpoolError as e:
            seen.append(str(e))

    dev.hook = hook
    a.free(a.malloc(4096, stream=7))
    assert len(seen) == 1 and "ensure_pool re-entered" in seen[0]
    a.check_invariants()


def test_abort_capture_names_itself_when_it_re_enters() -> None:
    dev = _ReenteringDevice()
    a = CachingAllocator(dev)
    rec = a.begin_capture(PoolId(1, 0), lambda: dev.begin(9), stream=9)
    seen: list[str] = []

    def hook() -> None:
        try:
            a.abort_capture(rec)
        except GraphpoolError as e:
            seen.append(str(e))

    dev.hook = hook
    p = a.malloc(4096, stream=9)  # the capture's first segment: runs the hook mid-call
    assert len(seen) == 1 and "abort_capture re-entered" in seen[0]
    a.free(p)
    dev.end(9)
    a.abort_capture(rec)
    a.check_invariants()


def test_a_queued_free_whose_call_out_fails_again_waits_for_the_next_call() -> None:
    """A queued free whose call out raises (the history here) is queued again, and carried
    out at the next call, not again within this one: a call out that always fails cannot
    keep one call looping."""
    from graphpool.policy.history import History

    fails = [2]  # the history's free_requested raises twice, then works
    calls: list[int] = []

    class FailingHistory(History):
        __slots__ = ()

        def free_requested(self, *args: Any, **kw: Any) -> Any:
            if args[0] != p:
                return super().free_requested(*args, **kw)
            calls.append(1)
            if fails[0]:
                fails[0] -= 1
                raise RuntimeError("history unavailable")
            return super().free_requested(*args, **kw)

    _, a = make()
    a._history = FailingHistory(0, 100, False)
    p = a.malloc(4096, stream=S1)
    a.defer_free(p)
    with pytest.warns(RuntimeWarning, match="deferred work failed: RuntimeError"):
        q = a.malloc(512, stream=S1)
    assert len(calls) == 1 and a.lookup(p) is not None  # tried once in this call, still live
    with pytest.warns(RuntimeWarning, match="deferred work failed: RuntimeError"):
        a.free(q)
    assert len(calls) == 2 and a.lookup(p) is not None
    a.empty_cache()
    assert len(calls) == 3 and a.lookup(p) is None  # carried out at last
    ok(a)


def test_a_signal_handler_raising_right_after_enter_pool_leaves_no_entry() -> None:
    """A handler deferred during ``enter_pool`` runs when its lock is released; if it raises,
    the caller never learns it entered, so the entry is taken back before the exception
    propagates."""
    from graphpool.policy import interrupts
    from graphpool.policy.private_pools import PoolSpec, mempools

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    pid = PoolId(0, 997)
    mempools[pid] = PoolSpec(None, False)
    try:
        _, a = make()
        a.ensure_pool(pid)
        interrupts.pending.append((handler, 2, None))  # as if SIGINT came inside the call
        with pytest.raises(KeyboardInterrupt):
            a.enter_pool(pid)
        assert a._thread_pools == {} and a.memory_stats(pid)["use_count"] == 1
        ok(a)
    finally:
        interrupts.pending.clear()
        mempools.pop(pid, None)


def test_an_out_of_memory_event_says_zero_free_when_the_device_cannot_tell() -> None:
    """The history's OOM event records the device's free memory; a device whose memory query
    fails records 0 (unknown), and the OutOfMemoryError is raised all the same."""

    class NoMemInfo(FakeDevice):
        broken = False

        def mem_info(self) -> tuple[int, int]:
            if self.broken:
                raise GraphpoolError("mem_info unavailable")
            return super().mem_info()

    dev = NoMemInfo(1 << 30)
    a = CachingAllocator(dev, sizes=DEFAULT)
    dev.broken = True  # from now on (the allocator asked for the total when it was made)
    a.record_history(10, stacks=False)
    with pytest.raises(OutOfMemoryError):
        a.malloc(2 << 30, stream=S1)
    (oom,) = [e for e in a._history.entries if e["action"] == "oom"]  # type: ignore[union-attr]
    assert oom["device_free"] == 0 and oom["size"] == 2 << 30
    ok(a)


def test_use_mem_pool_calls_that_reenter_the_allocator_name_themselves() -> None:
    dev = _ReenteringDevice()
    a = CachingAllocator(dev)
    seen: dict[str, str] = {}

    def hook() -> None:
        for name in ("enter_pool", "exit_pool"):
            try:
                getattr(a, name)(PoolId(1, 0))
            except GraphpoolError as e:
                seen[name] = str(e)

    dev.hook = hook
    a.free(a.malloc(4096, stream=7))  # a new segment: runs the hook mid-call
    assert sorted(seen) == ["enter_pool", "exit_pool"]
    for name, message in seen.items():
        assert message.startswith(f"graphpool: {name} re-entered the allocator"), message
    ok(a)

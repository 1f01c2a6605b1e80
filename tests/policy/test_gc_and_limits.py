"""The garbage-collection threshold and the memory caps, figure for figure against PyTorch's
arithmetic (c10/cuda/CUDACachingAllocator.cpp: ``garbage_collect_cached_blocks`` and
``set_memory_fraction``), on a scripted device so every byte is known.

* GC frees the free whole segments whose age is at least the average age (``>=``: blocks of
  equal age, the usual case after a burst of frees, are collected);
* its threshold is a share of the memory fraction's cap, not of the binding cap (a byte
  limit below the fraction does not move it);
* the fraction's cap is ``int(fraction * total)``: truncated, never rounded up.
"""

from __future__ import annotations

import pytest
from fakedevice import SHRUNK, FakeDevice

from graphpool.errors import OutOfMemoryError
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.limits import MemoryLimits
from graphpool.policy.pools import SizeConfig

MiB = 1024 * 1024
S1 = 1


def _gc(total: int = 1000 * MiB, threshold: float = 0.5) -> CachingAllocator:
    a = CachingAllocator(FakeDevice(total), sizes=SizeConfig(garbage_collection_threshold=threshold))
    a.limits = a.limits.with_fraction(1.0)
    return a


def _stat(a: CachingAllocator, name: str) -> int:
    return a.memory_stats()[name]


def test_segments_of_equal_age_are_collected() -> None:
    """Three segments freed at the same search have the same age, which is the average: each
    is old enough (PyTorch's ``block_age >= age_threshold``), so they go back."""
    a = _gc()
    p, q, r = (a.malloc(200 * MiB, stream=S1) for _ in range(3))  # searches 1-3
    for x in (p, q, r):
        a.free(x)  # each goes in at 3: ages 1, 1, 1 at search 4
    # 600 MiB reserved > 0.5 x 1000 MiB: the collection must reclaim the 100 MiB excess
    a.malloc(300 * MiB, stream=S1)
    assert _stat(a, "num_device_free") == 3  # one pass frees every block at the threshold age
    assert _stat(a, "reserved_bytes.all.current") == 300 * MiB
    a.check_invariants()


def test_the_collection_passes_again_with_the_younger_segments_until_enough_is_back() -> None:
    """One pass frees the segments at least as old as the average; when they are not enough,
    the next pass averages the rest (PyTorch's loop): here the oldest alone, then the two
    younger ones."""
    a = _gc()
    t = a.malloc(120 * MiB, stream=S1)  # search 1
    p, q, r = (a.malloc(200 * MiB, stream=S1) for _ in range(3))  # searches 2-4
    a.free(p)  # filed at 4
    for _ in range(6):  # searches 5-10 reuse t's own block: the clock moves on
        a.free(t)
        t = a.malloc(120 * MiB, stream=S1)
    a.free(q)
    a.free(r)  # filed at 10: at search 11 the ages are 7, 1, 1 (average 3)
    a.malloc(250 * MiB, stream=S1)  # 720 MiB reserved: 220 MiB over the 500 MiB threshold
    assert _stat(a, "num_device_free") == 3  # p (200 MiB, not enough), then q and r
    assert _stat(a, "reserved_bytes.all.current") == 370 * MiB
    a.check_invariants()


def test_the_threshold_is_a_share_of_the_fraction_not_of_a_smaller_byte_limit() -> None:
    """Fraction 1.0 of 1000 MiB and a byte limit of 700 MiB: the threshold 0.5 means 500 MiB
    (of the fraction's cap), not 350 MiB (of the binding cap). 400 MiB reserved is under it:
    nothing is collected, and the next segment still fits under the byte limit."""
    a = _gc()
    a.limits = a.limits.with_bytes(700 * MiB)
    p, q = (a.malloc(200 * MiB, stream=S1) for _ in range(2))
    a.free(p)
    a.free(q)
    a.malloc(250 * MiB, stream=S1)  # no free block fits: 400 MiB reserved, 650 after
    assert _stat(a, "num_device_free") == 0
    assert _stat(a, "reserved_bytes.all.current") == 650 * MiB
    a.check_invariants()


@pytest.mark.parametrize(
    ("fraction", "total", "cap"),
    [(0.5, 16383, 8191), (1 / 3, 1000, 333), (0.999, 1001, 999), (0.0, 123, 0), (1.0, 4097, 4097)],
)
def test_the_fraction_cap_is_truncated(fraction: float, total: int, cap: int) -> None:
    limits = MemoryLimits(total, fraction)
    assert limits.fraction_bytes() == cap and limits.cap == cap
    assert MemoryLimits(total, fraction, cap + 1).cap == cap  # the smaller cap binds
    assert MemoryLimits(total, fraction, cap - 1 if cap else 0).cap == max(cap - 1, 0)


def test_a_segment_one_byte_past_the_truncated_fraction_is_refused() -> None:
    """Half of 16383 bytes is 8191.5: the cap is 8191, so an 8 KiB segment (SHRUNK's small
    segment) is refused, though rounding the cap up would let it in."""
    a = CachingAllocator(FakeDevice(16383), sizes=SHRUNK)
    a.limits = a.limits.with_fraction(0.5)
    with pytest.raises(OutOfMemoryError, match=r"fraction 0\.5"):
        a.malloc(100, stream=S1)
    assert _stat(a, "reserved_bytes.all.current") == 0
    a.limits = a.limits.with_fraction(None)
    a.free(a.malloc(100, stream=S1))  # without the cap the device holds it
    a.check_invariants()

"""PyTorch's allocator options in the policy (``SizeConfig``), with figures computed by hand
from PyTorch's rules (c10/cuda/CUDACachingAllocator.cpp): ``max_split_size`` (oversize blocks:
``get_free_block``, ``should_split``, ``release_available_cached_blocks``) and
``roundup_power2_divisions`` (``round_size``, ``roundup_power2_next_division``)."""

from __future__ import annotations

import pytest
from fakedevice import FakeDevice

from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.pools import DEFAULT, SizeConfig
from graphpool.policy.stats import PoolStats

KiB = 1024
MiB = 1024 * KiB
S1 = 1
SPLIT40 = SizeConfig(max_split_size=40 * MiB)


def make(sizes: SizeConfig, total: int = 1 << 34) -> CachingAllocator:
    return CachingAllocator(FakeDevice(total), sizes=sizes)


def stat(a: CachingAllocator, name: str) -> int:
    return a.memory_stats()[name]


def reserved(a: CachingAllocator) -> int:
    return stat(a, "reserved_bytes.all.current")


def test_a_request_under_max_split_size_never_takes_an_oversize_block() -> None:
    a = make(SPLIT40)
    a.free(a.malloc(50 * MiB, stream=S1))
    p = a.malloc(30 * MiB, stream=S1)  # the cached 50 MiB block is oversize: a segment of its own
    assert reserved(a) == 80 * MiB
    assert stat(a, "segment.all.current") == 2
    a.free(p)
    a.check_invariants()
    b = make(DEFAULT)  # without the option the cached block is taken and split
    b.free(b.malloc(50 * MiB, stream=S1))
    b.malloc(30 * MiB, stream=S1)
    assert reserved(b) == 50 * MiB


def test_a_large_request_takes_an_oversize_block_only_within_the_rounding_and_never_splits_it() -> None:
    a = make(SPLIT40)
    a.free(a.malloc(100 * MiB, stream=S1))
    p = a.malloc(90 * MiB, stream=S1)  # 100 < 90 + 20: taken whole, not split
    assert stat(a, "active_bytes.all.current") == 100 * MiB
    assert stat(a, "requested_bytes.all.current") == 90 * MiB
    assert reserved(a) == 100 * MiB
    a.free(p)
    a.malloc(60 * MiB, stream=S1)  # 100 >= 60 + 20: wastes too much, a new segment
    assert reserved(a) == 160 * MiB
    assert stat(a, "active_bytes.all.current") == 60 * MiB
    a.check_invariants()


def test_the_oversize_rules_at_their_boundaries() -> None:
    """A request of exactly max_split_size may take an oversize block; a block wasting exactly
    max_non_split_rounding is refused (PyTorch: ``size < max_split`` and ``>= size + rounding``)."""
    a = make(SPLIT40)
    a.free(a.malloc(58 * MiB, stream=S1))
    a.malloc(40 * MiB, stream=S1)  # 40 is not under 40, and 58 < 40 + 20: taken whole
    assert reserved(a) == 58 * MiB
    b = make(SPLIT40)
    b.free(b.malloc(60 * MiB, stream=S1))
    b.malloc(40 * MiB, stream=S1)  # 60 >= 40 + 20: refused, a segment of its own
    assert reserved(b) == 100 * MiB


def test_out_of_memory_gives_back_the_largest_oversize_segments_until_enough() -> None:
    """PyTorch's release_available_cached_blocks: no one cached oversize segment holds the
    request, so the largest go back until they make up the request, and no more."""
    a = make(SPLIT40, total=120 * MiB)
    held = [a.malloc(40 * MiB, stream=S1) for _ in range(3)]  # three oversize segments fill it
    for p in held:
        a.free(p)
    a.malloc(80 * MiB, stream=S1)
    assert reserved(a) == 120 * MiB  # two went back for the 80 MiB one; the third stays cached
    assert stat(a, "segment.all.current") == 2


def test_max_non_split_rounding_widens_what_an_oversize_block_may_waste() -> None:
    a = make(SizeConfig(max_split_size=40 * MiB, max_non_split_rounding=50 * MiB))
    a.free(a.malloc(100 * MiB, stream=S1))
    a.malloc(60 * MiB, stream=S1)  # 100 < 60 + 50
    assert reserved(a) == 100 * MiB
    assert stat(a, "active_bytes.all.current") == 100 * MiB


def test_blocks_under_max_split_size_split_as_before() -> None:
    a = make(SPLIT40)
    a.free(a.malloc(30 * MiB, stream=S1))
    a.malloc(12 * MiB, stream=S1)  # 30 MiB block, not oversize: split, 18 MiB stays free
    assert reserved(a) == 30 * MiB
    assert stat(a, "active_bytes.all.current") == 12 * MiB
    assert stat(a, "inactive_split_bytes.all.current") == 18 * MiB


def test_out_of_memory_releases_oversize_blocks_first_and_keeps_the_rest() -> None:
    a = make(SPLIT40, total=90 * MiB)
    a.free(a.malloc(5 * MiB, stream=S1))  # a 20 MiB segment, cached
    a.free(a.malloc(50 * MiB, stream=S1))  # oversize, cached
    a.malloc(30 * MiB, stream=S1)  # 20 MiB left on the device: the 50 MiB segment goes back
    assert reserved(a) == 50 * MiB  # the 20 MiB segment is kept
    assert stat(a, "num_device_free") == 1
    assert stat(a, "num_alloc_retries") == 0  # no full release was needed
    a.check_invariants()


def test_out_of_memory_releases_the_largest_oversize_blocks_until_enough() -> None:
    a = make(SPLIT40, total=100 * MiB)
    p, q = a.malloc(50 * MiB, stream=S1), a.malloc(44 * MiB, stream=S1)
    a.free(p)
    a.free(q)
    a.malloc(60 * MiB, stream=S1)  # 50 then 44 MiB released: 94 >= 60
    assert reserved(a) == 60 * MiB
    assert stat(a, "num_device_free") == 2
    assert stat(a, "num_alloc_retries") == 0
    b = make(DEFAULT, total=100 * MiB)
    p, q = b.malloc(50 * MiB, stream=S1), b.malloc(44 * MiB, stream=S1)
    b.free(p)
    b.free(q)
    b.malloc(60 * MiB, stream=S1)
    assert stat(b, "num_alloc_retries") == 1  # without the option: the full release


@pytest.mark.parametrize(
    ("divisions", "requested", "expected"),
    [
        (4, 4200, 5120),  # 4096..8192 in steps of 1024
        (4, 2048, 2048),  # a power of two stays
        (4, 1200, 1536),  # not above 4 x 512: plain 512 B rounding
        (4, 1_200_000, 1_310_720),  # 1 MiB..2 MiB in steps of 256 KiB (a large request)
        (2, 1_000_000, 1 * MiB),  # 512 KiB..1 MiB in steps of 512 KiB: still small
        (1, 4200, 4608),  # 1: no power-of-two rounding
        (8, 3 * MiB + 1, 3 * MiB + 256 * KiB),
    ],
)
def test_roundup_power2_divisions_rounds_requests_as_pytorch(
    divisions: int, requested: int, expected: int
) -> None:
    a = make(SizeConfig(roundup_power2_divisions=(divisions,) * 16))
    a.malloc(requested, stream=S1)
    assert stat(a, "active_bytes.all.current") == expected
    assert stat(a, "requested_bytes.all.current") == requested


def test_roundup_power2_divisions_per_size_range() -> None:
    # 1 MiB..2 MiB (the first division) in 2 steps, 2 MiB..4 MiB (the second) in 8
    sizes = SizeConfig(roundup_power2_divisions=(2, 8) + (0,) * 14)
    a = make(sizes)
    a.malloc(MiB + 1, stream=S1)
    assert stat(a, "active_bytes.all.current") == MiB + 512 * KiB
    a.malloc(2 * MiB + 1, stream=S1)
    assert stat(a, "active_bytes.all.current") == MiB + 512 * KiB + 2 * MiB + 256 * KiB
    a.malloc(4 * MiB + 1, stream=S1)  # the third division is 0: plain rounding
    assert stat(a, "active_bytes.all.current") == MiB + 512 * KiB + 2 * MiB + 256 * KiB + 4 * MiB + 512


def test_the_last_division_covers_every_request_from_its_range_up() -> None:
    """The 16th entry rounds 32 GiB and up (a request past the table uses the last entry)."""
    sizes = SizeConfig(roundup_power2_divisions=(0,) * 14 + (2, 8))
    assert sizes.round_divisions(32 * 1024 * MiB + 1) == 36 * 1024 * MiB  # 8 steps of 4 GiB
    assert sizes.round_divisions(16 * 1024 * MiB + 1) == 24 * 1024 * MiB  # the 15th entry: 2 steps


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"max_split_size": 10 * MiB}, "^max_split_size must be at least large_segment$"),
        ({"max_non_split_rounding": MiB}, "^max_non_split_rounding must be at least large_segment$"),
        ({"roundup_power2_divisions": (3,) * 16}, "power of two"),
        ({"roundup_power2_divisions": (2,) * 15}, "16 entries"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SizeConfig(**kwargs)  # type: ignore[arg-type]


def test_configure_only_before_the_first_allocation() -> None:
    a = make(DEFAULT)
    a.configure(SPLIT40)
    a.free(a.malloc(50 * MiB, stream=S1))
    a.malloc(30 * MiB, stream=S1)
    assert reserved(a) == 80 * MiB
    with pytest.raises(RuntimeError, match="before the first allocation"):
        a.configure(DEFAULT)


def gc_allocator(total: int = 1000 * MiB, fraction: float | None = 1.0) -> CachingAllocator:
    a = make(SizeConfig(garbage_collection_threshold=0.5), total=total)
    a.limits = a.limits.with_fraction(fraction)
    return a


def test_garbage_collection_releases_the_blocks_unused_longest() -> None:
    a = gc_allocator()
    p, q, r = (a.malloc(200 * MiB, stream=S1) for _ in range(3))  # searches 1-3
    for x in (p, q, r):
        a.free(x)  # each goes in at 3
    a.free(a.malloc(200 * MiB, stream=S1))  # search 4 takes p's block, back in at 4
    # Search 5 finds nothing: 600 MiB reserved > 0.5 x 1000 MiB. Ages 1, 2, 2 (average 5/3):
    # q's and r's segments go back (400 MiB >= the 100 MiB excess), p's stays.
    a.malloc(300 * MiB, stream=S1)
    assert reserved(a) == 500 * MiB
    assert stat(a, "num_device_free") == 2
    assert stat(a, "segment.all.current") == 2
    a.check_invariants()


def test_garbage_collection_needs_a_memory_fraction_and_an_excess() -> None:
    for a in (gc_allocator(fraction=None), gc_allocator(total=2000 * MiB)):
        p, q, r = (a.malloc(200 * MiB, stream=S1) for _ in range(3))
        for x in (p, q, r):
            a.free(x)
        a.malloc(300 * MiB, stream=S1)  # no fraction, or 600 MiB <= 0.5 x 2000 MiB: nothing freed
        assert stat(a, "num_device_free") == 0
        assert reserved(a) == 900 * MiB


def oversize(a: CachingAllocator, name: str) -> tuple[int, int, int, int]:
    s = a.memory_stats()
    return tuple(s[f"{name}.{c}"] for c in ("current", "peak", "allocated", "freed"))  # type: ignore[return-value]


def test_pytorchs_oversize_statistics_count_blocks_and_segments_of_max_split_size_or_more() -> None:
    """``oversize_allocations`` and ``oversize_segments`` (PyTorch's, which its
    ``memory_summary`` prints): blocks handed out and segments made of ``max_split_size`` or
    more, as current, peak, allocated and freed counts. Without the option nothing is oversize."""
    a = make(SPLIT40)
    p = a.malloc(40 * MiB, stream=S1)  # exactly max_split_size: oversize
    q = a.malloc(50 * MiB, stream=S1)
    r = a.malloc(30 * MiB, stream=S1)  # under it: neither the block nor its 30 MiB segment
    assert oversize(a, "oversize_allocations") == (2, 2, 2, 0)
    assert oversize(a, "oversize_segments") == (2, 2, 2, 0)
    a.free(q)
    assert oversize(a, "oversize_allocations") == (1, 2, 2, 1)
    assert oversize(a, "oversize_segments") == (2, 2, 2, 0)  # cached, not released
    a.reset_peak()
    assert oversize(a, "oversize_allocations")[:2] == (1, 1)
    a.empty_cache()  # q's segment goes back
    assert oversize(a, "oversize_segments") == (1, 2, 2, 1)
    a.reset_accumulated()
    assert oversize(a, "oversize_segments") == (1, 2, 0, 0)
    a.check_invariants()
    for ptr in (p, r):
        a.free(ptr)
    assert oversize(a, "oversize_allocations")[0] == 0
    a.check_invariants()
    a.empty_cache()  # p's segment, exactly max_split_size, goes back: oversize as it leaves too
    assert oversize(a, "oversize_segments") == (0, 2, 0, 1)
    a.check_invariants()
    b = make(DEFAULT)
    b.free(b.malloc(200 * MiB, stream=S1))
    assert oversize(b, "oversize_allocations") == oversize(b, "oversize_segments") == (0, 0, 0, 0)


def test_the_oversize_threshold_is_a_machine_word_for_the_compiled_hot_path() -> None:
    """Every cached allocation and free compares the block's size with ``oversize_at``.
    Compiled by mypyc, an int up to 2**62 - 1 is a tagged machine word and a larger one a heap
    object, whose comparisons cost some 570 instructions a pair. With or without
    ``max_split_size`` it stays a word (a private pool copies the device's), and without it
    it stays above any block the device can hold."""
    assert PoolStats().oversize_at < 2**62
    for sizes in (DEFAULT, SPLIT40):
        a = make(sizes)
        assert 0 < a.stats.oversize_at < 2**62
    assert make(DEFAULT).stats.oversize_at > 1 << 34  # the fake device's memory
    assert make(SPLIT40).stats.oversize_at == 40 * MiB


def test_an_oversize_block_freed_while_another_stream_uses_it_leaves_the_count_at_the_free() -> None:
    """A block of exactly max_split_size, recorded on another stream, is freed by its user:
    it is no longer an oversize allocation (it is held, still active, until that stream's
    work is done), and the free closes the small pool's run first (the peak of both). A peak
    reset meanwhile (the small pool's counters changed last) counts it as active, and the
    large pool keeps that level as its peak once the block is back."""
    dev = FakeDevice(1 << 34)
    a = CachingAllocator(dev, sizes=SPLIT40)
    p = a.malloc(40 * MiB, stream=S1)
    a.record_stream(p, 2)
    small = a.malloc(512, stream=S1)
    a.free(p)
    assert oversize(a, "oversize_allocations") == (0, 1, 1, 1)
    st = a.memory_stats()
    assert (st["allocation.all.peak"], st["allocation.large_pool.freed"]) == (2, 1)
    small2 = a.malloc(512, stream=S1)  # the small pool's counters change last before the reset
    a.reset_peak()
    st = a.memory_stats()
    assert (st["active.all.peak"], st["active_bytes.all.peak"]) == (3, 40 * MiB + 1024)
    assert (st["active.large_pool.peak"], st["active_bytes.large_pool.peak"]) == (1, 40 * MiB)
    a.check_invariants()
    dev.complete_all()
    a.empty_cache()
    assert oversize(a, "oversize_allocations")[0] == oversize(a, "oversize_segments")[0] == 0
    st = a.memory_stats()
    assert st["active.large_pool.current"] == 0  # the peak stays the level at the reset
    assert (st["active.large_pool.peak"], st["active_bytes.large_pool.peak"]) == (1, 40 * MiB)
    q = a.malloc(40 * MiB, stream=S1)
    a.record_stream(q, 2)
    a.free(q)
    st = a.memory_stats()
    assert (st["allocation.large_pool.freed"], st["allocated_bytes.large_pool.freed"]) == (2, 80 * MiB)
    for ptr in (small, small2):
        a.free(ptr)
    dev.complete_all()
    a.reset_accumulated()
    st = a.memory_stats()
    assert [k for k, v in st.items() if k.endswith((".allocated", ".freed")) and v] == []
    a.check_invariants()


def test_without_max_split_size_a_block_as_large_as_the_device_splits_like_any_other() -> None:
    """No block is oversize without the option, not even one of the device's whole memory:
    a smaller request splits the cached one instead of releasing it and allocating again."""
    a = make(DEFAULT, total=64 * MiB)
    a.free(a.malloc(64 * MiB, stream=S1))
    p = a.malloc(4 * MiB, stream=S1)
    st = a.memory_stats()
    assert (st["num_device_alloc"], st["num_device_free"], st["num_alloc_retries"]) == (1, 0, 0)
    a.free(p)
    a.check_invariants()


def test_the_all_pool_peak_is_the_highest_sum_seen_not_the_kinds_peaks_added() -> None:
    """Two small blocks, one freed, then a large one from the cache: never more than two
    at once, though the small pool's peak (2) and the large pool's (1) add up to three. A
    third small one then makes three, counted before the large one's release lowers them."""
    a = make(SPLIT40)
    a.free(a.malloc(40 * MiB, stream=S1))  # cached: the next one makes no segment
    s1, s2 = a.malloc(512, stream=S1), a.malloc(512, stream=S1)
    a.free(s1)
    big = a.malloc(40 * MiB, stream=S1)
    st = a.memory_stats()
    assert (st["allocation.small_pool.peak"], st["allocation.large_pool.peak"]) == (2, 1)
    assert st["allocation.all.peak"] == 2
    assert (st["allocation.all.allocated"], st["allocated_bytes.all.allocated"]) == (4, 80 * MiB + 1024)
    assert st["requested_bytes.all.allocated"] == 80 * MiB + 1024
    s3 = a.malloc(512, stream=S1)  # three at once now
    a.free(big)  # the small pool's run is closed before the large count drops
    assert a.memory_stats()["allocation.all.peak"] == 3
    for ptr in (s2, s3):
        a.free(ptr)
    st = a.memory_stats()
    assert (st["allocation.all.freed"], st["allocated_bytes.all.freed"]) == (5, 80 * MiB + 1536)
    assert st["requested_bytes.all.freed"] == 80 * MiB + 1536
    a.check_invariants()


def test_an_oversize_count_refuses_to_go_negative_by_name() -> None:
    """A release counted twice is the allocator's bug: the statistic says so and stays as it was."""
    st = PoolStats(40 * MiB)
    with pytest.raises(AssertionError) as info:
        st.move_oversize("oversize_segments", -1)
    assert str(info.value) == "statistic oversize_segments would go negative"
    assert st.as_dict()["oversize_segments.current"] == st.as_dict()["oversize_segments.freed"] == 0
    with pytest.raises(AssertionError) as info:
        st.on_free(False, 512)  # a block given back that was never counted
    assert str(info.value) == "allocation would go negative"
    with pytest.raises(AssertionError) as info:
        st.on_release(False, 512, 512, 0, 0, True)
    assert str(info.value) == "allocation would go negative"
    with pytest.raises(AssertionError) as info:
        st.on_release(False, 512, 512, 0, 0, False)  # a hold ending that never began
    assert str(info.value) == "requested_bytes would go negative"


def test_expandable_segments_and_private_pools_keep_oversize_counts_of_their_own() -> None:
    """An expandable segment grows, so it is never an oversize segment (its blocks may be
    oversize allocations); a private pool counts its own oversize blocks and segments."""
    from graphpool.policy.private_pools import PoolId

    dev = FakeDevice(1 << 34)
    a = CachingAllocator(dev, sizes=SizeConfig(max_split_size=40 * MiB, expandable_segments=True))
    p = a.malloc(64 * MiB, stream=S1)
    assert oversize(a, "oversize_allocations")[0] == 1
    assert oversize(a, "oversize_segments")[0] == 0
    pid = PoolId(0, 4242)
    rec = a.begin_capture(pid, lambda: dev.begin(S1), stream=S1)
    g = a.malloc(48 * MiB, stream=S1)
    assert a.memory_stats(pid)["oversize_allocations.current"] == 1
    assert a.memory_stats(pid)["oversize_segments.current"] == 1  # private pools' segments are fixed
    assert oversize(a, "oversize_allocations")[0] == 2
    dev.capturing.pop(S1)
    a.end_capture(rec)
    a.check_invariants()
    a.free(g)
    a.release_capture(rec)
    a.empty_cache()  # the pool's fixed segment goes while p's expandable one stays
    assert oversize(a, "oversize_segments")[0] == 0
    a.check_invariants()
    a.free(p)
    a.empty_cache()
    assert oversize(a, "oversize_allocations")[0] == oversize(a, "oversize_segments")[0] == 0
    a.check_invariants()

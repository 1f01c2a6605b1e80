"""Expandable segments: a stream about to map more takes over the free blocks of another
stream whose work is all done (``CachingAllocator._take_idle``; Note [Stream takeover] in
policy/expandable.py).

The rule, as these tests pin it down:

* only with ``expandable_segments:True`` (off, each stream keeps its own cache, as PyTorch's);
* only from a stream the device made and reports idle (``stream_idle``): never the legacy
  stream, never a stream the device did not make, never one with work left or capturing;
* never while a capture is underway;
* a block taken over is the new stream's: it merges with that stream's free neighbours, and
  ``empty_cache`` gives it back to its segment's stream so the segment can go back whole.
"""

from __future__ import annotations

import dataclasses

import pytest
from fakedevice import SHRUNK, FakeDevice

from graphpool.errors import OutOfMemoryError
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.private_pools import PoolId

A, B, C = 11, 12, 13
BIG = 64 * 1024  # large pool (SHRUNK's small requests end at 4 KiB); 8 granules of 8 KiB


def _alloc(expandable: bool = True, total: int = 1 << 34) -> tuple[FakeDevice, CachingAllocator]:
    dev = FakeDevice(total, streams=True)
    dev.made = {A, B, C}
    a = CachingAllocator(dev, sizes=dataclasses.replace(SHRUNK, expandable_segments=expandable))
    return dev, a


def _reserved(a: CachingAllocator) -> int:
    return a.memory_stats()["reserved_bytes.all.current"]


def test_an_idle_streams_free_block_serves_another_stream_without_mapping() -> None:
    dev, a = _alloc()
    x = a.malloc(BIG, stream=A)
    a.free(x)
    reserved = _reserved(a)
    y = a.malloc(BIG, stream=B)
    assert y == x and _reserved(a) == reserved  # taken over: nothing mapped
    assert dev.idle_asked == [A]
    a.check_invariants()
    a.free(y)
    z = a.malloc(BIG, stream=A)  # and back again, B being idle
    assert z == x and _reserved(a) == reserved
    a.free(z)
    a.check_invariants()


@pytest.mark.parametrize("why", ["busy", "not made", "capturing", "legacy", "option off"])
def test_a_stream_that_may_still_use_its_block_keeps_it(why: str) -> None:
    dev, a = _alloc(expandable=why != "option off")
    src = 0 if why == "legacy" else A
    x = a.malloc(BIG, stream=src)
    if why == "busy":
        dev.queue_work(A)
    elif why == "not made":
        dev.made.discard(A)
    elif why == "capturing":
        dev.begin(A)  # a capture begun outside graphpool, not yet seen by the allocator
    a.free(x)
    y = a.malloc(BIG, stream=B)
    assert y != x  # mapped (or allocated) anew
    assert 0 not in dev.idle_asked  # the legacy stream is never asked
    a.check_invariants()
    if why == "busy":
        dev.finish_work(A)
        a.free(y)
        assert a.malloc(BIG, stream=C) in (x, y)  # idle now: either block serves
    elif why == "capturing":
        dev.end(A)


def test_no_block_changes_stream_while_a_capture_is_underway() -> None:
    dev, a = _alloc()
    x = a.malloc(BIG, stream=A)
    a.free(x)
    rec = a.begin_capture(PoolId(9, 0), lambda: dev.begin(C), stream=C)
    try:
        y = a.malloc(BIG, stream=B)  # an eager allocation beside the capture
        assert y != x and not dev.idle_asked
        a.free(y)
    finally:
        dev.end(C)
        a.end_capture(rec)
    a.check_invariants()


def test_taken_blocks_merge_with_the_new_streams_neighbours() -> None:
    """Free pieces of two streams that lie side by side in one segment merge into a block big
    enough for a request neither piece holds."""
    _, a = _alloc()
    half = BIG // 2
    p = a.malloc(half, stream=A)
    q = a.malloc(half, stream=A)
    keep = a.malloc(half, stream=A)  # the segment goes on after q
    a.free(p)
    r = a.malloc(half, stream=B)  # takes p over
    assert r == p
    a.free(r)  # p is B's free block now
    a.free(q)  # A's: does not merge with B's p
    a.check_invariants()
    assert a.lookup(q) is None
    s = a.malloc(BIG, stream=B)  # takes q over, merged with p: no mapping
    reserved = _reserved(a)
    assert s == p and _reserved(a) == reserved
    a.free(s)
    a.free(keep)
    a.check_invariants()


def _b_takes_the_first_block(a: CachingAllocator) -> tuple[int, int]:
    """A's segment [p][keep]; B takes p over and frees it: (p, keep), keep still A's, live."""
    p = a.malloc(BIG, stream=A)
    keep = a.malloc(BIG, stream=A)
    a.free(p)
    r = a.malloc(BIG, stream=B)
    assert r == p
    a.free(r)
    return p, keep


def test_empty_cache_gives_taken_blocks_back_and_the_segment_goes_whole() -> None:
    dev, a = _alloc()
    _, keep = _b_takes_the_first_block(a)
    a.free(keep)  # A's segment: [B's free p][A's free keep + tail]: not one block
    a.check_invariants()
    syncs = dev.calls.count("device_sync")
    a.empty_cache()
    a.check_invariants()
    assert _reserved(a) == 0 and a._exp == {} and a.snapshot() == []
    assert dev.calls.count("device_sync") == syncs + 1  # B's last use of p: waited for once


def test_empty_cache_leaves_taken_blocks_between_live_ones_with_their_taker() -> None:
    """Only the free end goes back to the segment's stream: a taken block between live blocks
    would free nothing there, and would be stranded if that stream is never idle again (a
    destroyed stream is never asked)."""
    dev, a = _alloc()
    p, keep = _b_takes_the_first_block(a)  # B's free p, before A's live `keep`
    dev.destroyed.add(A)
    a.empty_cache()
    a.check_invariants()
    reserved = _reserved(a)
    assert a.malloc(BIG, stream=B) == p and _reserved(a) == reserved  # still B's: no mapping
    a.free(p)
    a.free(keep)


def test_after_the_out_of_memory_release_an_idle_stream_is_asked_again() -> None:
    """The release before the retry unmaps a free end, which waits for the device: a stream
    busy before is idle then, and its free block serves the request instead of an OOM."""
    g = 8 * 1024  # SHRUNK's granule
    dev = FakeDevice(total=6 * g, streams=True)
    dev.made = {A, B}
    a = CachingAllocator(dev, sizes=dataclasses.replace(SHRUNK, expandable_segments=True))
    p = a.malloc(2 * g, stream=A)
    keep = a.malloc(3 * g, stream=A)
    t = a.malloc(g, stream=A)  # the device is full now
    a.free(t)  # A's free end, one granule: the release unmaps it
    dev.queue_work(A)
    a.free(p)  # A may still use p: not B's yet
    assert a.malloc(2 * g, stream=B) == p  # a new segment for B would need 2 granules, 1 is free
    assert a.memory_stats()["num_alloc_retries"] == 1
    assert a.lookup(p).stream == B  # type: ignore[union-attr]  # taken over for B
    a.check_invariants()
    a.free(p)
    a.free(keep)


def test_a_segments_snapshot_stream_is_its_own_after_a_takeover() -> None:
    _, a = _alloc()
    x = a.malloc(BIG, stream=A)
    a.free(x)
    assert a.malloc(BIG, stream=B) == x  # B now holds the segment's first block
    (seg,) = a.snapshot()
    assert seg["stream"] == A and seg["blocks"][0]["address"] == x
    a.free(x)


def test_a_truthy_answer_from_a_device_reads_as_in_plain_python() -> None:
    """The compiled build reads a device's non-bool answer as Python does (no TypeError)."""

    class IntAnswers(FakeDevice):
        def stream_idle(self, stream: int) -> bool:
            return int(super().stream_idle(stream))  # type: ignore[return-value]

    dev = IntAnswers(streams=True)
    dev.made = {A, B}
    a = CachingAllocator(dev, sizes=dataclasses.replace(SHRUNK, expandable_segments=True))
    x = a.malloc(BIG, stream=A)
    a.free(x)
    assert a.malloc(BIG, stream=B) == x
    a.free(x)
    a.check_invariants()


def test_one_idle_answer_covers_every_block_freed_before_it() -> None:
    """A stream that answered idle is not asked again for blocks it had freed by then, and those
    blocks may be taken even while it is busy with later work; a block it frees afterwards
    needs a new answer."""
    dev, a = _alloc()
    p, k1, q, k2 = (a.malloc(BIG, stream=A) for _ in range(4))
    a.free(p)
    a.free(q)  # two free blocks of A, apart
    x = a.malloc(BIG, stream=B)  # asks A (idle): takes p
    assert x == p and dev.idle_asked == [A]
    dev.queue_work(A)  # A busy with later work
    y = a.malloc(BIG, stream=B)  # q was freed before A's answer: taken, A not asked
    assert y == q and dev.idle_asked == [A]
    a.free(k1)  # freed after the answer, while A is busy: A may still use it
    z = a.malloc(BIG, stream=C)  # A asked anew (busy): k1 stays A's, C maps anew
    assert z not in (p, k1, q, k2) and dev.idle_asked == [A, A]
    for ptr in (x, y, z, k2):
        a.free(ptr)
    a.check_invariants()


def test_a_block_freed_after_its_streams_idle_answer_needs_a_new_answer() -> None:
    """An idle answer covers only the blocks the stream had freed before it: one freed right
    after, with no allocation in between (the free lists' clock has not moved), may still be
    in use by work queued after the answer, and stays its stream's while that stream is busy."""
    dev, a = _alloc()
    k = a.malloc(BIG, stream=A)
    x = a.malloc(BIG, stream=A)
    a.free(x)
    y = a.malloc(BIG, stream=B)  # A answers idle: x is taken over
    assert y == x and dev.idle_asked == [A]
    dev.queue_work(A)  # A uses k after its answer ...
    a.free(k)  # ... and frees it at once: no tick of the clock since the answer
    z = a.malloc(BIG, stream=C)
    assert z != k, "a block freed after the idle answer was taken while its stream was busy"
    assert dev.idle_asked == [A, A]  # asked anew (busy)
    dev.finish_work(A)
    for p in (y, z):
        a.free(p)
    a.check_invariants()


def test_growing_a_segment_never_absorbs_another_streams_free_tail() -> None:
    """A's segment ends in a block B took over and freed while B still uses it: growing A's
    segment maps a new block after it instead of growing B's block into A's request."""
    dev, a = _alloc()
    head = a.malloc(BIG, stream=A)
    tail = a.malloc(BIG, stream=A)
    a.free(tail)  # A's free end
    y = a.malloc(BIG, stream=B)  # A idle: B takes the end over
    assert y == tail
    dev.queue_work(B)  # B's use of y is still running ...
    a.free(y)  # ... when B frees it: the segment ends in B's free block
    z = a.malloc(2 * BIG, stream=A)  # no A block fits, B is busy: A's segment grows
    assert z == tail + BIG, "A's request grew B's busy free block"
    assert a.lookup(z) is not None and a.lookup(z).stream == A  # type: ignore[union-attr]
    blocks = a.snapshot()[0]["blocks"]
    assert [(b["address"], b["size"], b["state"]) for b in blocks] == [
        (head, BIG, "active_allocated"),
        (tail, BIG, "inactive"),
        (z, 2 * BIG, "active_allocated"),
    ]
    dev.finish_work(B)
    a.free(z)
    a.free(head)
    a.check_invariants()


def test_a_run_of_exactly_max_split_size_is_oversize_for_takeover() -> None:
    """A run as large as max_split_size is oversize (PyTorch: ``size >= max_split``): a smaller
    request of another stream may not take it over."""
    split = 2 * BIG  # 128 KiB
    sizes = dataclasses.replace(SHRUNK, expandable_segments=True, max_split_size=split)
    dev = FakeDevice(streams=True)
    dev.made = {A, B}
    a = CachingAllocator(dev, sizes=sizes)
    x = a.malloc(split, stream=A)
    a.free(x)
    reserved = _reserved(a)
    y = a.malloc(BIG, stream=B)  # under max_split_size: the 128 KiB run is not for it
    assert y != x and _reserved(a) == reserved + BIG
    a.free(y)
    a.check_invariants()


def test_takeover_keeps_max_split_size() -> None:
    """An idle stream's oversize free block (at least max_split_size) is taken over only by a
    request that could take it from its own stream's cache (PyTorch's get_free_block): one of
    at least max_split_size that wastes less than max_non_split_rounding."""
    split = 96 * 1024  # SHRUNK's large segment is 40 KiB: the least max_split_size allowed
    sizes = dataclasses.replace(SHRUNK, expandable_segments=True, max_split_size=split)
    dev = FakeDevice(streams=True)
    dev.made = {A, B, C}
    a = CachingAllocator(dev, sizes=sizes)
    x = a.malloc(2 * BIG, stream=A)  # 128 KiB: oversize
    a.free(x)
    reserved = _reserved(a)
    y = a.malloc(BIG, stream=B)  # under max_split_size: may not take A's oversize block
    assert y != x and _reserved(a) == reserved + BIG
    z = a.malloc(2 * BIG - 8192, stream=C)  # oversize too, wastes 8 KiB < 40 KiB: takes it
    assert z == x and _reserved(a) == reserved + BIG
    a.free(y)
    a.free(z)
    a.check_invariants()


def test_a_run_of_two_other_streams_free_blocks_is_taken_whole() -> None:
    """A's free block after B's free block in one segment (B took it over and freed it): C's
    request for both takes the run, walking back from A's block over B's."""
    _, a = _alloc()
    half = BIG // 2
    p = a.malloc(half, stream=A)
    q = a.malloc(half, stream=A)
    keep = a.malloc(half, stream=A)
    a.free(p)
    assert a.malloc(half, stream=B) == p  # taken over by B
    a.free(p)  # B's free block now
    a.free(q)  # A's, beside it
    reserved = _reserved(a)
    s = a.malloc(BIG, stream=C)
    assert s == p and _reserved(a) == reserved  # both taken, merged: nothing mapped
    a.free(s)
    a.free(keep)
    a.check_invariants()


def test_each_mapping_of_an_expandable_segment_counts_as_a_device_allocation() -> None:
    _, a = _alloc()
    x = a.malloc(BIG, stream=A)  # the range made, its first mapping
    y = a.malloc(BIG, stream=A)  # grown
    assert a.memory_stats()["num_device_alloc"] == 2
    a.free(y)
    a.free(x)
    a.empty_cache()
    assert a.memory_stats()["num_device_free"] >= 1 and _reserved(a) == 0


def test_a_history_failing_after_a_growth_leaves_the_mapped_block_free() -> None:
    """The history raises when told of a growth: the exception propagates, and the block mapped
    for the request is filed free (mapped, counted, in no one's hands)."""
    from graphpool.policy.history import History

    class FailingHistory(History):
        __slots__ = ()

        def record(self, action: str, *args: object, **kw: object) -> None:
            if action == "segment_map":
                raise RuntimeError("history unavailable")
            super().record(action, *args, **kw)  # type: ignore[arg-type]

    _, a = _alloc()
    x = a.malloc(BIG, stream=A)
    a._history = FailingHistory(0, 100, False)
    with pytest.raises(RuntimeError, match="history unavailable"):
        a.malloc(BIG, stream=A)
    a.check_invariants()
    a._history = None
    reserved = _reserved(a)
    y = a.malloc(BIG, stream=A)  # the block filed free serves it: nothing mapped
    assert y == x + BIG and _reserved(a) == reserved
    a.free(y)
    a.free(x)
    a.check_invariants()


def test_after_the_retrys_release_a_stream_uses_what_came_back_to_it_before_mapping() -> None:
    """The out-of-memory retry's release gives blocks other streams took over back to their
    segment's stream, merged with its free neighbours; the request then takes that block
    rather than mapping a granule more (here 16 KiB reserved after, not 24 KiB)."""
    dev, a = _alloc(total=24 * 1024)  # 3 granules of 8 KiB
    live = a.malloc(8704, stream=A)
    small = a.malloc(4608, stream=A)
    end = a.malloc(11264, stream=A)  # the device is full: 3 granules of 8 KiB mapped
    a.free(end)
    taken = a.malloc(11264, stream=B)
    assert taken == end  # A idle: B took A's free end over
    a.free(small)
    dev.queue_work(B)
    a.free(taken)  # B's now, B busy: not A's to take
    x = a.malloc(7168, stream=A)  # fits nowhere until the retry's release merges the two
    assert x == small and _reserved(a) == 16 * 1024
    assert a.memory_stats()["num_alloc_retries"] == 1
    a.check_invariants()
    a.free(x)
    a.free(live)
    a.check_invariants()


def test_the_retrys_look_in_the_cache_spares_a_segments_free_end() -> None:
    """Out of memory, the retry waits for pending stream uses and takes a fitting block they
    freed by the usual best fit: a hole between live blocks before the segment's free end."""
    dev, a = _alloc(total=24 * 1024)  # 3 granules of 8 KiB
    hole = a.malloc(10240, stream=A)
    live = a.malloc(5120, stream=A)
    end = a.malloc(9216, stream=A)  # the device is full: 3 granules of 8 KiB mapped
    dev.queue_work(B)
    a.record_stream(hole, B)
    a.record_stream(end, B)
    a.free(hole)
    a.free(end)  # both wait for B's work
    x = a.malloc(8192, stream=A)  # nothing to map: the retry's wait frees both; end fits best
    assert x == hole and _reserved(a) == 24 * 1024
    assert a.memory_stats()["num_alloc_retries"] == 0
    a.check_invariants()
    a.free(x)
    a.free(live)
    a.check_invariants()


def test_after_the_out_of_memory_release_the_stream_maps_what_came_back() -> None:
    """A busy stream's free segment cannot be taken over; the retry's release unmaps it, and
    the requesting stream then maps its own in that room."""
    g = 8 * 1024  # SHRUNK's granule
    dev = FakeDevice(total=4 * g, streams=True)
    dev.made = {A, B}
    a = CachingAllocator(dev, sizes=dataclasses.replace(SHRUNK, expandable_segments=True))
    x = a.malloc(4 * g, stream=A)  # the device is full
    dev.queue_work(A)
    a.free(x)  # A busy: not B's to take
    y = a.malloc(4 * g, stream=B)  # refused; the release unmaps A's segment; B maps its own
    assert a.lookup(y).stream == B  # type: ignore[union-attr]
    st = a.memory_stats()
    assert (st["num_alloc_retries"], st["num_ooms"], _reserved(a)) == (1, 0, 4 * g)
    a.check_invariants()
    a.free(y)
    a.check_invariants()


def test_an_expandable_out_of_memory_names_the_granules_it_asked_for() -> None:
    """The message of an out of memory with expandable segments names the mapping refused
    (the request rounded to granules), not only the request; its history event, the stream."""
    g = 8 * 1024  # SHRUNK's granule
    dev = FakeDevice(total=2 * g, streams=True)
    dev.made = {A, B}
    a = CachingAllocator(dev, sizes=dataclasses.replace(SHRUNK, expandable_segments=True))
    a.record_history(100, stacks=False)
    x = a.malloc(2 * g, stream=A)  # the device is full
    with pytest.raises(OutOfMemoryError, match=r"tried to allocate 6\.00 KiB \(a new segment of 8\.00 KiB\)"):
        a.malloc(6 * 1024, stream=A)
    [oom] = [e for e in a.history_snapshot()[1] if e["action"] == "oom"]
    assert (oom["size"], oom["stream"], oom["pool_id"]) == (6 * 1024, A, None)  # the history names its stream
    a.free(x)
    a.check_invariants()


@pytest.mark.parametrize("gone", ["taker", "bystander"])
def test_the_retrys_release_never_asks_about_a_stream_that_may_be_destroyed(gone: str) -> None:
    """The out-of-memory retry's release, with a taken-over block at a segment's free end whose
    taker is not idle, must not pass a stream the allocator only holds cached memory of to the
    capture query: that stream may have been destroyed since (its free blocks outlive it), and
    a query of a destroyed stream is undefined behaviour in CUDA (it crashed the process on an
    H200, tests/scenarios/test_foreign_captures.py). Here the destroyed stream is the taker
    itself (``taker``: never idle again, so its block makes the release ask), or another
    stream whose free block is cached (``bystander``) while a live taker is busy."""
    dev, a = _alloc(total=32 * 1024)  # 4 granules of 8 KiB
    live = a.malloc(8704, stream=A)
    small = a.malloc(4608, stream=A)
    end = a.malloc(11264, stream=A)  # 3 granules of 8 KiB mapped
    a.free(end)
    taken = a.malloc(11264, stream=B)
    assert taken == end  # A idle: B took A's free end over
    a.free(small)
    c = a.malloc(8192, stream=C)  # the last granule: C's own segment
    if gone == "bystander":
        a.free(c)  # C's free block, cached
        dev.queue_work(B)  # B busy: its block makes the release ask about captures
        dead = C
    else:
        dead = B
    a.free(taken)
    dev.destroyed.add(dead)
    dev.queried.clear()
    try:
        a.free(a.malloc(7168, stream=A))  # the retry's release runs (or an OOM after it)
    except OutOfMemoryError:
        pass
    assert dead not in dev.queried, "the retry asked the capture query about a destroyed stream"
    dev.complete_all()
    if gone == "taker":
        a.free(c)
    a.free(live)
    a.check_invariants()

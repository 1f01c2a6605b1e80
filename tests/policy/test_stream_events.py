"""record_stream with slow work really queued on the user stream (docs/behaviour.rst, "The
caching allocator", "Streams").

``FakeDevice(streams=True)`` completes an event only when the work queued on its stream
before the record is done, so a freed block's reuse shows which stream its event was
recorded on. These tests kill the mutant "record_stream's event recorded on the block's
own stream instead of the user's stream" (``CachingAllocator._insert_events``), which the
rest of the suite let live. Also here: the ``inactive_split`` peak within one epoch.
"""

from __future__ import annotations

import pytest
from fakedevice import SHRUNK, FakeDevice

from graphpool.errors import OutOfMemoryError
from graphpool.policy.allocator import CachingAllocator

S1, S2, S3 = 1, 2, 3


def make() -> tuple[FakeDevice, CachingAllocator]:
    dev = FakeDevice(streams=True)
    return dev, CachingAllocator(dev, sizes=SHRUNK)


def freed_after_use(a: CachingAllocator, *users: int) -> int:
    """A 1024-byte block of S1 (a neighbour keeps it from merging), used on ``users``, freed."""
    p = a.malloc(1024, stream=S1)
    a.malloc(1024, stream=S1)
    for s in users:
        a.record_stream(p, s)
    a.free(p)
    a.check_invariants()
    return p


# ----------------------------------------------------------------- the fake device itself
def test_fake_device_events_follow_their_stream() -> None:
    dev = FakeDevice(streams=True)
    e1, e2, e3 = dev.create_event(), dev.create_event(), dev.create_event()
    dev.record_event(e1, S1)  # idle stream: complete at once
    assert dev.query_event(e1) is True
    dev.queue_work(S1, 2)
    dev.record_event(e2, S1)
    dev.queue_work(S1)  # queued after e2: e2 does not wait for it
    dev.record_event(e3, S1)
    assert (dev.query_event(e2), dev.query_event(e3)) == (False, False)
    dev.queue_work(S2)  # another stream's work changes nothing on S1
    dev.finish_work(S1, 1)
    assert (dev.query_event(e2), dev.query_event(e3)) == (False, False)
    dev.finish_work(S1, 1)
    assert (dev.query_event(e2), dev.query_event(e3)) == (True, False)
    dev.event_synchronize(e3)  # waiting for e3 runs S1's work up to it
    assert dev.query_event(e3) is True and dev.busy(S1) is False and dev.busy(S2) is True
    dev.complete_all()
    assert dev.busy(S2) is False
    assert dev.recorded == [(e1, S1), (e2, S1), (e3, S1)]


def test_fake_device_default_keeps_events_pending_until_completed_by_hand() -> None:
    dev = FakeDevice()
    e = dev.create_event()
    dev.record_event(e, S1)
    assert dev.query_event(e) is False
    dev.complete_all()
    assert dev.query_event(e) is True


# ------------------------------------------------------------------- the race itself
def test_event_is_recorded_on_the_user_stream() -> None:
    dev, a = make()
    freed_after_use(a, S2)
    assert [s for _, s in dev.recorded] == [S2]


def test_block_not_reused_while_the_user_stream_is_busy() -> None:
    dev, a = make()
    dev.queue_work(S2)  # slow work on the user stream, queued before the free
    p = freed_after_use(a, S2)
    for _ in range(3):  # however often the allocator looks, S2 is not done
        q = a.malloc(1024, stream=S1)
        assert q != p
        a.free(q)
        a.check_invariants()
    assert a.snapshot()[0]["blocks"][0]["state"] == "active_pending_free"
    dev.finish_work(S2)
    assert a.malloc(1024, stream=S1) == p  # now the best fit again
    a.check_invariants()


def test_block_reused_at_once_when_the_user_stream_is_idle_even_if_its_own_is_busy() -> None:
    """Work on the block's own stream is ordered before its reuse there: no wait for it."""
    dev, a = make()
    dev.queue_work(S1)
    p = freed_after_use(a, S2)
    assert a.malloc(1024, stream=S1) == p
    a.check_invariants()


def test_block_waits_for_every_user_stream() -> None:
    dev, a = make()
    dev.queue_work(S2)
    dev.queue_work(S3)
    p = freed_after_use(a, S2, S3)
    assert sorted(s for _, s in dev.recorded) == [S2, S3]
    dev.finish_work(S2)
    q = a.malloc(1024, stream=S1)
    assert q != p
    a.free(q)
    dev.finish_work(S3)
    assert a.malloc(1024, stream=S1) == p
    a.check_invariants()


def test_work_queued_after_the_free_does_not_delay_reuse() -> None:
    dev, a = make()
    dev.queue_work(S2)
    p = freed_after_use(a, S2)
    dev.queue_work(S2)  # later work on S2 cannot touch the freed block
    dev.finish_work(S2, 1)
    assert a.malloc(1024, stream=S1) == p


def test_empty_cache_waits_for_the_user_stream() -> None:
    """empty_cache synchronizes the pending event: S2's work up to it is done, then the
    block's segment, whole again, goes back to the driver."""
    dev, a = make()
    dev.queue_work(S2)
    p = a.malloc(1024, stream=S1)
    a.record_stream(p, S2)
    a.free(p)
    assert dev.live != {}
    a.empty_cache()
    assert dev.busy(S2) is False and dev.live == {}
    a.check_invariants()


# --------------------------------------------------------- inactive_split peak in one epoch
@pytest.mark.parametrize("pool", ["all", "small_pool"])
def test_inactive_split_peak_within_one_epoch(pool: str) -> None:
    """Only small blocks move and nothing is read between the steps: one epoch. The peak
    of 2 free fragments is reached and left inside it and must still be reported."""
    _, a = make()
    x = a.malloc(1024, stream=S1)  # [x][free 7168]: 1 split fragment
    y = a.malloc(1024, stream=S1)  # [x][y][free 6144]: still 1
    a.free(x)  # [free 1024][y][free 6144]: 2
    a.free(y)  # all merged into one whole free segment: 0
    st = a.memory_stats()
    assert st[f"inactive_split.{pool}.current"] == 0
    assert st[f"inactive_split.{pool}.peak"] == 2
    assert st[f"inactive_split_bytes.{pool}.peak"] == 1024 + 6144
    a.check_invariants()


def test_out_of_memory_waits_for_the_events_before_it_releases_the_cache() -> None:
    """The driver refuses a segment while a fitting block of the stream waits only for another
    stream's event: the retry first waits for that event and takes the block (no cache
    release, no retry counted). Released first instead, that block's segment, still split
    around a live neighbour, would free nothing, and the request would fail."""
    dev = FakeDevice(total=40960, streams=True)  # room for one large segment (SHRUNK's 40 KiB)
    a = CachingAllocator(dev, sizes=SHRUNK)
    x = a.malloc(10000, stream=S1)
    keep = a.malloc(25000, stream=S1)  # the segment's rest: x never merges back whole
    a.record_stream(x, S2)
    dev.queue_work(S2)  # S2 still uses x ...
    a.free(x)  # ... so x waits for S2's event
    y = a.malloc(10000, stream=S1)  # no block fits, the device is full
    assert y == x
    st = a.memory_stats()
    assert st["num_alloc_retries"] == 0 and st["num_ooms"] == 0 and st["num_device_free"] == 0
    assert dev.calls.count("sync") == 1  # the one event waited for
    assert st["num_sync_all_streams"] == 1  # PyTorch's name for that wait
    a.free(y)
    a.free(keep)
    a.check_invariants()


def test_each_wait_for_every_stream_use_is_counted_once() -> None:
    """``num_sync_all_streams`` counts the waits for every pending stream use, as PyTorch
    counts its synchronize_and_free_events: one per empty_cache and one per out-of-memory
    retry (which then releases the cache without waiting again); reset with the accumulated
    counters."""
    dev = FakeDevice(total=40960, streams=True)
    a = CachingAllocator(dev, sizes=SHRUNK)
    a.empty_cache()
    assert a.memory_stats()["num_sync_all_streams"] == 1
    x = a.malloc(30000, stream=S1)
    with pytest.raises(OutOfMemoryError):
        a.malloc(30000, stream=S2)  # the retry: one wait, then the cache release, then refused
    st = a.memory_stats()
    assert st["num_alloc_retries"] == 1 and st["num_sync_all_streams"] == 2
    a.reset_accumulated()
    assert a.memory_stats()["num_sync_all_streams"] == 0
    a.free(x)
    a.check_invariants()

"""Out-of-memory observers: called as ``fn(device, requested, stats)`` before the error is
raised, with the allocator's lock released; a failing observer corrupts nothing."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

import graphpool as gp
from graphpool.policy import observers
from simenv import fresh_sim

MiB = 1024 * 1024


@pytest.fixture
def small() -> Iterator[Any]:
    """Two simulated devices of 64 MiB; no observer left attached afterwards."""
    with fresh_sim(2, 64 * MiB) as rt:
        try:
            yield rt
        finally:
            for fn in observers.current():
                gp.detach_out_of_memory_observer(fn)


def test_observer_sees_device_request_and_stats_before_the_error(small: Any) -> None:
    calls: list[tuple[int, int, dict[str, int], dict[str, int]]] = []

    def observer(device: int, requested: int, stats: dict[str, int]) -> None:
        # the lock is released: the public calls work from here
        calls.append((device, requested, stats, gp.memory_stats(device)))

    keep = gp.alloc(30 * MiB)
    assert gp.attach_out_of_memory_observer(observer) is observer
    before = gp.memory_stats()
    with pytest.raises(gp.OutOfMemoryError):
        gp.alloc(40 * MiB)
    assert len(calls) == 1
    device, requested, stats, seen = calls[0]
    assert (device, requested) == (0, 40 * MiB)
    assert stats == seen  # memory_stats() of that moment
    assert stats["num_ooms"] == before["num_ooms"] + 1  # counted before the observers run
    assert stats["reserved_bytes.all.current"] == 30 * MiB
    assert gp.memory_stats() == seen  # nothing moved after the observer
    keep.free()


def test_observer_runs_before_the_error_reaches_the_caller(small: Any) -> None:
    order: list[str] = []
    gp.attach_out_of_memory_observer(lambda d, r, s: order.append("observer"))
    try:
        gp.alloc(65 * MiB)  # larger than the device: an out-of-memory too
    except gp.OutOfMemoryError:
        order.append("error")
    assert order == ["observer", "error"]


def test_observer_of_another_device_gets_its_index(small: Any) -> None:
    seen: list[int] = []
    gp.attach_out_of_memory_observer(lambda d, r, s: seen.append(d))
    with gp.device(1), pytest.raises(gp.OutOfMemoryError):
        gp.alloc(80 * MiB)
    assert seen == [1]


def test_observer_may_allocate_and_free(small: Any) -> None:
    got: list[int] = []

    def observer(device: int, requested: int, stats: dict[str, int]) -> None:
        with gp.alloc(1000) as buf:  # the allocator is not locked nor marked busy
            got.append(buf.nbytes)
        gp.memory_snapshot()

    gp.attach_out_of_memory_observer(observer)
    with pytest.raises(gp.OutOfMemoryError):
        gp.alloc(65 * MiB)
    assert got == [1000]
    gp.check_invariants()


def test_another_thread_allocates_while_an_observer_runs(small: Any) -> None:
    """The lock is released during observers: a thread the observer waits for is not blocked."""
    done: list[bool] = []

    def worker() -> None:
        with gp.alloc(4096):
            done.append(True)

    def observer(device: int, requested: int, stats: dict[str, int]) -> None:
        t = threading.Thread(target=worker)
        t.start()
        t.join(timeout=10)
        assert not t.is_alive(), "the worker was blocked on the allocator's lock"

    gp.attach_out_of_memory_observer(observer)
    keep = gp.alloc(60 * MiB)
    with pytest.raises(gp.OutOfMemoryError):
        gp.alloc(20 * MiB)
    assert done == [True]
    keep.free()


def test_a_raising_observer_corrupts_nothing(small: Any) -> None:
    later: list[int] = []

    def bad(device: int, requested: int, stats: dict[str, int]) -> None:
        raise KeyError("observer bug")

    gp.attach_out_of_memory_observer(bad)
    gp.attach_out_of_memory_observer(lambda d, r, s: later.append(r))
    keep = gp.alloc(30 * MiB)
    before = gp.memory_stats()
    with pytest.warns(RuntimeWarning, match="observer raised KeyError"):
        with pytest.raises(gp.OutOfMemoryError) as info:
            gp.alloc(40 * MiB)
    assert isinstance(info.value.__context__, KeyError)  # chained
    assert later == [40 * MiB]  # the next observer still ran
    after = gp.memory_stats()
    assert after["num_ooms"] == before["num_ooms"] + 1
    gp.check_invariants()
    with gp.alloc(20 * MiB):  # still usable
        pass
    keep.free()


def test_an_out_of_memory_inside_an_observer_calls_no_observer(small: Any) -> None:
    calls: list[int] = []
    inner: list[BaseException] = []

    def observer(device: int, requested: int, stats: dict[str, int]) -> None:
        calls.append(requested)
        try:
            gp.alloc(70 * MiB)
        except gp.OutOfMemoryError as exc:
            inner.append(exc)

    gp.attach_out_of_memory_observer(observer)
    with pytest.raises(gp.OutOfMemoryError):
        gp.alloc(65 * MiB)
    assert calls == [65 * MiB]  # not called again for the inner one
    assert len(inner) == 1
    with pytest.raises(gp.OutOfMemoryError):  # the next failure calls it again
        gp.alloc(66 * MiB)
    assert calls == [65 * MiB, 66 * MiB]


def test_observer_runs_for_an_out_of_memory_during_capture(small: Any) -> None:
    seen: list[int] = []

    def observer(device: int, requested: int, stats: dict[str, int]) -> None:
        seen.append(requested)
        gp.memory_snapshot()  # allowed during the capture too

    gp.attach_out_of_memory_observer(observer)
    keep = gp.alloc(30 * MiB)
    g = gp.CUDAGraph()
    with gp.stream(gp.Stream()):
        g.capture_begin()
        with pytest.raises(gp.OutOfMemoryError):
            gp.alloc(40 * MiB)
        assert gp.is_current_stream_capturing()
        g.reset()
    assert seen == [40 * MiB]
    keep.free()


def test_detach_stops_the_calls(small: Any) -> None:
    calls: list[int] = []

    def observer(device: int, requested: int, stats: dict[str, int]) -> None:
        calls.append(requested)

    gp.attach_out_of_memory_observer(observer)
    gp.attach_out_of_memory_observer(observer)  # once is enough: called once
    with pytest.raises(gp.OutOfMemoryError):
        gp.alloc(65 * MiB)
    assert calls == [65 * MiB]
    gp.detach_out_of_memory_observer(observer)
    with pytest.raises(gp.OutOfMemoryError):
        gp.alloc(65 * MiB)
    assert calls == [65 * MiB]
    with pytest.raises(ValueError, match="not an attached"):
        gp.detach_out_of_memory_observer(observer)


def test_attach_wants_a_callable(small: Any) -> None:
    with pytest.raises(TypeError, match="callable"):
        gp.attach_out_of_memory_observer(42)  # type: ignore[arg-type]
    assert observers.current() == ()


def test_a_new_threads_first_out_of_memory_calls_the_observers(small: Any) -> None:
    """A thread that never ran the observers before is not taken to be inside them."""
    seen: list[int] = []
    errors: list[BaseException] = []
    gp.attach_out_of_memory_observer(lambda d, r, s: seen.append(r))

    def fail_once() -> None:
        try:
            gp.alloc(65 * MiB)
        except BaseException as exc:  # the OutOfMemoryError, or whatever broke instead
            errors.append(exc)

    t = threading.Thread(target=fail_once)
    t.start()
    t.join()
    assert seen == [65 * MiB] and [type(e) for e in errors] == [gp.OutOfMemoryError]


def test_attaching_what_cannot_be_called_names_its_type(small: Any) -> None:
    with pytest.raises(TypeError) as info:
        gp.attach_out_of_memory_observer(42)  # type: ignore[arg-type]
    assert str(info.value) == "an out-of-memory observer must be callable, not int"

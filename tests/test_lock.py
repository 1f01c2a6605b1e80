"""The allocator's C lock (graphpool.policy._lock.RLock) behaves as threading.RLock.

Each test runs on every reentrant lock the allocator may use: the C lock (compiled
builds), fastrlock and threading.RLock (the plain-Python build's choices), so the three
are held to one behaviour. The C lock takes no OS lock while nobody waits; the tests with
a second thread cover the hand-over to a waiter.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import graphpool as gp
from graphpool import runtime
from threadkit import run_threads

LOCKS: dict[str, Callable[[], Any]] = {"threading": threading.RLock}
try:
    from graphpool.policy._lock import RLock as CLock

    LOCKS["graphpool.policy._lock"] = CLock
except ImportError:  # the plain-Python build has no C modules
    pass
try:
    from fastrlock.rlock import FastRLock

    LOCKS["fastrlock"] = FastRLock
except ImportError:
    pass


@pytest.fixture(params=sorted(LOCKS))
def make(request: pytest.FixtureRequest) -> Callable[[], Any]:
    return LOCKS[request.param]


def try_acquire(lock: Any) -> bool:
    """The non-blocking acquire the allocator uses (``_Held.acquire(False)``)."""
    fn = getattr(lock, "try_acquire", None)
    return bool(fn() if fn is not None else lock.acquire(False))


def in_thread(fn: Callable[[], Any]) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join(10)
    assert not t.is_alive()
    return out[0]


@contextlib.contextmanager
def held_by_another_thread(lock: Any) -> Iterator[threading.Event]:
    """A thread holds ``lock`` until the block ends or the yielded event is set."""
    holding, release = threading.Event(), threading.Event()

    def holder() -> None:
        with lock:
            holding.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert holding.wait(10)
        yield release
    finally:
        release.set()
        t.join(10)


@contextlib.contextmanager
def alarms(handler: Callable[[int, Any], None], delay: float, interval: float = 0.0) -> Iterator[None]:
    """``handler`` for SIGALRM, which comes after ``delay`` s (then every ``interval`` s)."""
    old = signal.signal(signal.SIGALRM, handler)
    try:
        signal.setitimer(signal.ITIMER_REAL, delay, interval)
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def test_the_compiled_allocator_uses_the_c_lock() -> None:
    lock = runtime.allocator()._lock
    if gp.compiled():
        assert type(lock).__module__ == "graphpool.policy._lock"
    else:
        assert type(lock).__module__ != "graphpool.policy._lock"


def test_reentrant_and_counted(make: Callable[[], Any]) -> None:
    lock = make()
    assert lock.acquire()
    assert try_acquire(lock)
    with lock:
        assert lock._is_owned()
    lock.release()
    assert lock._is_owned()
    lock.release()
    assert not lock._is_owned()
    with pytest.raises(RuntimeError):
        lock.release()


def test_another_thread_cannot_take_or_release_it(make: Callable[[], Any]) -> None:
    lock = make()
    with lock:
        assert in_thread(lambda: try_acquire(lock)) is False
        if make is not LOCKS.get("fastrlock"):  # fastrlock takes no timeout in seconds
            assert in_thread(lambda: lock.acquire(True, 0.05)) is False

        def release() -> str:
            try:
                lock.release()
            except RuntimeError:
                return "refused"
            return "released"

        if make is not LOCKS.get("fastrlock"):  # fastrlock lets any thread release it
            assert in_thread(release) == "refused"
        assert not in_thread(lock._is_owned)
    assert in_thread(lambda: try_acquire(lock)) is True  # that thread ended holding it
    assert not try_acquire(lock)


def test_a_waiter_gets_it_at_the_last_release(make: Callable[[], Any]) -> None:
    lock = make()
    got = threading.Event()
    order: list[str] = []

    def waiter() -> None:
        with lock:
            order.append("waiter")
            got.set()

    lock.acquire()
    lock.acquire()
    t = threading.Thread(target=waiter)
    t.start()
    time.sleep(0.05)
    lock.release()  # still held once: the waiter keeps waiting
    time.sleep(0.05)
    assert not got.is_set()
    order.append("holder")
    lock.release()
    assert got.wait(10)
    t.join(10)
    assert order == ["holder", "waiter"]
    assert try_acquire(lock)  # free again, and taken without an OS wait
    lock.release()


def test_many_threads_count_exactly(make: Callable[[], Any]) -> None:
    lock = make()
    counter = [0]

    def work(_: int) -> None:
        for i in range(2000):
            if i % 3 == 0:
                if not try_acquire(lock):
                    lock.acquire()
            else:
                lock.acquire()
            try:
                v = counter[0]
                if i % 50 == 0:
                    time.sleep(0)  # give the lock up mid-section: others must wait
                counter[0] = v + 1
            finally:
                lock.release()

    run_threads(work, 6)
    assert counter[0] == 6 * 2000
    assert try_acquire(lock)
    lock.release()


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_a_signal_handler_that_raises_interrupts_the_wait(make: Callable[[], Any]) -> None:
    if make is LOCKS.get("fastrlock"):
        pytest.skip("fastrlock's wait cannot be interrupted (it waits until the lock is free)")
    lock = make()

    class Stop(Exception):
        pass

    def handler(signum: int, frame: object) -> None:
        raise Stop

    with held_by_another_thread(lock), alarms(handler, 0.05):
        with pytest.raises(Stop):
            lock.acquire()
        assert not lock._is_owned()
    assert try_acquire(lock)  # nothing was left held
    lock.release()


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_a_wait_resumed_after_a_signal_handler_still_excludes(make: Callable[[], Any]) -> None:
    """A signal handler that returns runs Python code mid-wait: meanwhile the holder releases
    and a third thread takes the lock. The waiter must then wait for that thread too (a C lock
    that went back to its OS wait without looking let both in)."""
    if make is LOCKS.get("fastrlock"):
        pytest.skip("fastrlock's wait cannot be interrupted (it waits until the lock is free)")
    lock = make()
    go, third_has = threading.Event(), threading.Event()
    inside = [0]

    def third() -> None:
        go.wait(10)
        with lock:
            inside[0] += 1
            third_has.set()
            time.sleep(0.3)
            inside[0] -= 1

    t = threading.Thread(target=third)
    t.start()
    try:
        with held_by_another_thread(lock) as release:

            def handler(signum: int, frame: object) -> None:
                release.set()  # the holder lets go while this thread runs the handler, not waiting
                time.sleep(0.1)
                go.set()
                third_has.wait(5)  # the third thread takes it meanwhile

            with alarms(handler, 0.1), lock:
                assert third_has.is_set()
                assert inside[0] == 0  # the third thread had left
    finally:
        go.set()
        t.join(10)
    assert try_acquire(lock)
    lock.release()


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer")
def test_a_timed_wait_keeps_its_deadline_across_signals(make: Callable[[], Any]) -> None:
    if make is LOCKS.get("fastrlock"):
        pytest.skip("fastrlock takes no timeout in seconds")
    lock = make()
    with held_by_another_thread(lock), alarms(lambda signum, frame: None, 0.05, 0.05):
        t0 = time.monotonic()  # a handler that returns comes every 50 ms
        assert lock.acquire(True, 0.3) is False
        took = time.monotonic() - t0
    assert 0.25 < took < 2.0, took  # not restarted at each signal


def test_c_lock_arguments() -> None:
    if "graphpool.policy._lock" not in LOCKS:
        pytest.skip("the plain-Python build has no C lock")
    lock = LOCKS["graphpool.policy._lock"]()
    with pytest.raises(ValueError):
        lock.acquire(False, 1.0)
    with pytest.raises(ValueError):
        lock.acquire(True, -2.0)
    with pytest.raises(ValueError):
        lock.acquire(True, float("nan"))
    with pytest.raises(TypeError):
        LOCKS["graphpool.policy._lock"](1)
    assert "unlocked" in repr(lock)
    with lock:
        assert "locked" in repr(lock)

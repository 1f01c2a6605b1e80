"""Interrupts (policy/interrupts.py): a guarded signal handler never runs inside an allocator's
critical section; it runs right after it, and the allocator stays consistent.

The deferral tests need the allocator's Python frames: they run on the plain-Python build
(compiled methods have no frames and run no handler half-way). A handler is "interrupted
into" a critical section by calling the guarded handler, with the frame of the moment, from a
free-list method patched to do so (what Python does when a signal arrives there). Each test
here fails with the guard removed (``GuardedHandler.__call__`` running the handler at once).
"""

from __future__ import annotations

import inspect
import os
import random
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType, ModuleType, SimpleNamespace
from typing import Any

import pytest

import graphpool as gp
from graphpool.policy import interrupts, observers
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.freelist import FreeList
from graphpool.policy.interrupts import GuardedHandler
from graphpool.sim import SimBackend

SRC = str(Path(__file__).resolve().parents[1] / "src")

plain = pytest.mark.skipif(gp.compiled(), reason="compiled methods have no Python frames: nothing waits")
posix = pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs POSIX signals")
main_only = pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="signals are handled in the main thread"
)


class Interrupt(BaseException):
    """What a user's handler raises (as KeyboardInterrupt would)."""


def new_allocator() -> CachingAllocator:
    return CachingAllocator(SimBackend().get_device(0))


@pytest.fixture(autouse=True)
def _no_pending() -> Iterator[None]:
    yield
    leftover = list(interrupts.pending)
    interrupts.pending.clear()
    assert not leftover, "a deferred handler was never run"


@contextmanager
def interrupted(methods: tuple[str, ...], fire: Callable[[FrameType], None]) -> Iterator[list[FrameType]]:
    """Patch FreeList ``methods``: the first call after entry calls ``fire`` with its frame (an
    update is underway), then does its work. Yields the frames ``fire`` got."""
    fired: list[FrameType] = []
    saved = {name: getattr(FreeList, name) for name in methods}

    def patch(name: str) -> Callable[..., Any]:
        original = saved[name]

        def hooked(*args: Any) -> Any:
            if not fired:
                frame = sys._getframe()
                fired.append(frame)
                fire(frame)
            return original(*args)

        return hooked

    for name in methods:
        setattr(FreeList, name, patch(name))
    try:
        yield fired
    finally:
        for name, fn in saved.items():
            setattr(FreeList, name, fn)


def recording(log: list[tuple[int, FrameType | None, bool]], a: CachingAllocator, then: Any) -> Any:
    """A handler that notes (signal, frame, whether ``a`` was busy) and then calls ``then``."""

    def handler(signum: int, frame: FrameType | None) -> None:
        log.append((signum, frame, a._busy))
        then(signum, frame)

    return handler


def raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupt


# ------------------------------------------------------------------------ deferral
@plain
@pytest.mark.parametrize("call", ["malloc", "malloc_owned"])  # malloc_owned: gp.alloc's entry
def test_a_signal_inside_malloc_runs_its_handler_after_the_call(call: str) -> None:
    a = new_allocator()
    a.free(a.malloc(512, stream=0))  # cached: the next malloc updates the bins in place
    log: list[tuple[int, FrameType | None, bool]] = []
    guarded = gp.guard_signal_handler(recording(log, a, signal.default_int_handler))
    ran_inside: list[int] = []

    def fire(frame: FrameType) -> None:
        guarded(signal.SIGINT, frame)
        ran_inside.append(len(log))

    with interrupted(("place",), fire) as fired, pytest.raises(KeyboardInterrupt):
        getattr(a, call)(512, stream=0)
    assert ran_inside == [0]  # deferred ...
    assert [(s, f, busy) for s, f, busy in log] == [(signal.SIGINT, fired[0], False)]  # ... to after
    a.check_invariants()
    # malloc had succeeded: its block stays allocated, as after an interrupt right after a call
    assert a.memory_stats()["allocated_bytes.all.current"] == 512
    assert not a._lock._is_owned() and not a._busy


@plain
@pytest.mark.parametrize("call", ["free", "free_owned", "free_owned block"])
def test_a_signal_inside_free_runs_its_handler_after_the_call(call: str) -> None:
    a = new_allocator()
    # "free_owned block": a DeviceBuffer's free, by the Block malloc_owned gave it
    ptr = a.malloc_owned(512, stream=0) if call.endswith("block") else a.malloc(512, stream=0)
    call = call.removesuffix(" block")
    log: list[tuple[int, FrameType | None, bool]] = []
    guarded = gp.guard_signal_handler(recording(log, a, raise_interrupt))
    inside: list[int] = []

    def fire(frame: FrameType) -> None:
        guarded(signal.SIGINT, frame)
        inside.append(len(log))

    with interrupted(("insert", "remove", "place"), fire), pytest.raises(Interrupt):
        getattr(a, call)(ptr)
    assert inside == [0] and len(log) == 1 and log[0][2] is False
    a.check_invariants()
    assert a.memory_stats()["allocated_bytes.all.current"] == 0
    assert not a._lock._is_owned()


class HookedLock:
    """The allocator's lock, calling ``hook`` once right after an acquire (while armed)."""

    def __init__(self, lock: Any, hook: Callable[[FrameType], None]) -> None:
        self.lock = lock
        self.hook = hook
        self.armed = False

    def acquire(self, blocking: bool = True) -> bool:
        got = bool(self.lock.acquire(blocking))
        if got and self.armed:
            self.armed = False
            self.hook(sys._getframe())
        return got

    def release(self) -> None:
        self.lock.release()

    def _is_owned(self) -> bool:
        return bool(self.lock._is_owned())

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


@plain
def test_a_signal_between_free_owneds_acquire_and_its_try_keeps_no_lock() -> None:
    a = new_allocator()
    ptr = a.malloc(512, stream=0)
    log: list[tuple[int, FrameType | None, bool]] = []
    guarded = gp.guard_signal_handler(recording(log, a, raise_interrupt))
    a._lock = a._held = lock = HookedLock(a._lock, lambda frame: guarded(signal.SIGINT, frame))  # type: ignore[assignment]
    lock.armed = True
    with pytest.raises(Interrupt):
        a.free_owned(ptr)
    assert len(log) == 1
    assert not lock._is_owned()
    a.check_invariants()
    assert a.memory_stats()["allocated_bytes.all.current"] == 0


@plain
def test_a_handler_deferred_by_nested_sections_runs_when_the_outermost_ends() -> None:
    """A free of another allocator (a finalizer run by garbage collection, say) inside a malloc:
    the inner call ends first, and leaves the handler to the outer one."""
    a, b = new_allocator(), new_allocator()
    a.free(a.malloc(512, stream=0))
    kept = b.malloc(512, stream=0)
    log: list[tuple[int, FrameType | None, bool]] = []
    guarded = gp.guard_signal_handler(recording(log, a, raise_interrupt))
    after_inner: list[int] = []

    def fire(frame: FrameType) -> None:
        guarded(signal.SIGINT, frame)
        b.free_owned(kept)  # (the hook fires once: these calls run unhooked)
        b.free(b.malloc(1024, stream=0))
        b.reset_peak()
        after_inner.append(len(log))

    with interrupted(("place",), fire), pytest.raises(Interrupt):
        a.malloc(512, stream=0)
    assert after_inner == [0] and len(log) == 1 and log[0][2] is False
    a.check_invariants()
    b.check_invariants()


@plain
def test_other_threads_never_run_a_deferred_handler() -> None:
    a, c = new_allocator(), new_allocator()
    a.free(a.malloc(512, stream=0))
    log: list[tuple[int, FrameType | None, bool]] = []
    guarded = gp.guard_signal_handler(recording(log, a, raise_interrupt))
    seen_by_thread: list[tuple[int, int]] = []

    def other() -> None:
        c.free(c.malloc(512, stream=0))  # its section ends with the handler pending
        seen_by_thread.append((len(log), len(interrupts.pending)))

    def fire(frame: FrameType) -> None:
        guarded(signal.SIGINT, frame)
        t = threading.Thread(target=other)
        t.start()
        t.join()

    with interrupted(("place",), fire), pytest.raises(Interrupt):
        a.malloc(512, stream=0)
    assert seen_by_thread == [(0, 1)]  # left to the main thread
    assert len(log) == 1


@plain
def test_a_handler_after_the_section_or_outside_runs_at_once() -> None:
    a = new_allocator()
    a.free(a.malloc(512, stream=0))
    log: list[tuple[int, FrameType | None, bool]] = []
    guarded = gp.guard_signal_handler(recording(log, a, lambda s, f: None))
    frames: list[FrameType] = []
    with interrupted(("place",), lambda frame: frames.append(frame.f_back)):  # type: ignore[arg-type]
        ptr = a.malloc(512, stream=0)
    # the malloc frame of a finished call (as between `_busy = False` and the check): not waiting
    assert frames[0].f_code is CachingAllocator._malloc.__code__  # malloc's body
    guarded(signal.SIGINT, frames[0])
    assert len(log) == 1
    guarded(signal.SIGINT, sys._getframe())  # no allocator frame at all
    assert len(log) == 2

    # an out-of-memory observer runs with the lock released and the allocator not busy
    def observer(device: int, requested: int, stats: dict[str, int]) -> None:
        guarded(signal.SIGINT, sys._getframe())
        log.append((-1, None, a._busy))

    observers.attach(observer)
    try:
        with pytest.raises(gp.OutOfMemoryError):
            a.malloc(1 << 62, stream=0)
    finally:
        observers.detach(observer)
    assert [s for s, _, _ in log[2:]] == [signal.SIGINT, -1]
    a.free(ptr)
    a.check_invariants()


@plain
@posix
@main_only
def test_a_handler_that_raises_lets_the_other_pending_signals_run() -> None:
    """Two real signals inside one malloc: the first handler raises, the second still runs
    (signalled again, as Python does when a handler raises)."""
    a = new_allocator()
    a.free(a.malloc(512, stream=0))
    order: list[str] = []

    def first(signum: int, frame: FrameType | None) -> None:
        order.append(f"usr1 busy={a._busy}")
        raise Interrupt

    def second(signum: int, frame: FrameType | None) -> None:
        order.append(f"usr2 busy={a._busy}")

    old1 = signal.signal(signal.SIGUSR1, gp.guard_signal_handler(first))
    old2 = signal.signal(signal.SIGUSR2, gp.guard_signal_handler(second))
    try:

        def fire(frame: FrameType) -> None:
            signal.raise_signal(signal.SIGUSR1)
            signal.raise_signal(signal.SIGUSR2)
            signal.raise_signal(signal.SIGUSR1)  # not queued twice
            order.append("inside")

        with interrupted(("place",), fire), pytest.raises(Interrupt):
            a.malloc(512, stream=0)
    finally:
        signal.signal(signal.SIGUSR1, old1)
        signal.signal(signal.SIGUSR2, old2)
    assert order == ["inside", "usr1 busy=False", "usr2 busy=False"]
    a.check_invariants()


# ------------------------------------------------------------------ real signals
def _stress(a_factory: Callable[[], CachingAllocator], rounds: int, sigint: bool) -> dict[str, int]:
    """The loop of benchmarks/interrupt_stress.py, short: SIGALRM at a random moment of each
    round of malloc/free pairs; its guarded handler raises (or sends SIGINT, whose guarded
    default handler raises KeyboardInterrupt)."""
    armed = [False]

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        if armed[0]:
            armed[0] = False
            if sigint:
                os.kill(os.getpid(), signal.SIGINT)
            else:
                raise Interrupt

    caught: type[BaseException] = KeyboardInterrupt if sigint else Interrupt
    old_alarm = signal.signal(signal.SIGALRM, on_alarm if sigint else gp.guard_signal_handler(on_alarm))
    old_int = signal.signal(signal.SIGINT, gp.guard_signal_handler(signal.default_int_handler))
    counts = dict(hits=0, leaked=0, busy=0, broken=0)
    rng = random.Random(1234)
    a = a_factory()
    try:
        for i in range(rounds):
            if i % 100 == 0:
                a = a_factory()
            try:
                try:
                    signal.setitimer(signal.ITIMER_REAL, rng.uniform(1e-6, 4e-5))
                    armed[0] = True
                    for j in range(50):
                        if j % 2:
                            a.free(a.malloc(512 * (1 + j % 3), stream=0))
                        else:
                            a.free_owned(a.malloc(512, stream=0))
                finally:
                    armed[0] = False
                    signal.setitimer(signal.ITIMER_REAL, 0)
            except caught:
                counts["hits"] += 1
            if a._lock._is_owned():
                counts["leaked"] += 1
                a._lock.release()
            if a._busy:
                counts["busy"] += 1
                a._busy = False
            try:
                a.check_invariants()
            except AssertionError:
                counts["broken"] += 1
                a = a_factory()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old_alarm)
        signal.signal(signal.SIGINT, old_int)
    return counts


@posix
@main_only
@pytest.mark.parametrize("sigint", [False, True], ids=["SIGALRM", "SIGINT"])
def test_real_signals_at_random_moments_break_nothing(sigint: bool) -> None:
    counts = _stress(new_allocator, 600, sigint)
    assert counts["hits"] >= 30, counts  # the loop was really interrupted
    assert counts["leaked"] == counts["busy"] == counts["broken"] == 0, counts


# ------------------------------------------------------------ the guard itself
def test_guard_wraps_once_and_leaves_non_handlers_alone() -> None:
    def h(signum: int, frame: FrameType | None) -> None:
        pass

    g = gp.guard_signal_handler(h)
    assert isinstance(g, GuardedHandler) and g.handler is h and inspect.unwrap(g) is h
    assert gp.guard_signal_handler(g) is g
    assert "guard_signal_handler" in repr(g)
    for other in (signal.SIG_DFL, signal.SIG_IGN, None):
        assert interrupts.guard(other) is other


def test_importing_graphpool_guards_the_default_sigint_handler_plain_python_only() -> None:
    code = (
        "import signal, graphpool as gp\n"
        "h = signal.getsignal(signal.SIGINT)\n"
        "print(gp.compiled(), type(h).__name__, getattr(h, 'handler', None) is signal.default_int_handler)\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    if gp.compiled():
        assert out.stdout.split() == ["True", "builtin_function_or_method", "False"]
    else:
        assert out.stdout.split() == ["False", "GuardedHandler", "True"]


@main_only
def test_a_handler_the_user_installed_is_left_alone() -> None:
    def mine(signum: int, frame: FrameType | None) -> None:
        pass

    old = signal.signal(signal.SIGINT, mine)
    try:
        assert interrupts.guard_default_sigint() is False
        assert signal.getsignal(signal.SIGINT) is mine
        signal.signal(signal.SIGINT, signal.default_int_handler)
        assert interrupts.guard_default_sigint() is True
        installed = signal.getsignal(signal.SIGINT)
        assert isinstance(installed, GuardedHandler) and installed.handler is signal.default_int_handler
        box: list[bool] = []
        t = threading.Thread(target=lambda: box.append(interrupts.guard_default_sigint()))
        t.start()
        t.join()
        assert box == [False]  # only the main thread installs handlers
    finally:
        signal.signal(signal.SIGINT, old)


@main_only
def test_ipython_cells_get_the_guard_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """ipykernel installs Python's default SIGINT handler before each cell: graphpool's
    ``pre_run_cell`` callback guards it again."""
    callbacks: dict[str, list[Callable[..., Any]]] = {"pre_run_cell": []}
    events = SimpleNamespace(
        callbacks=callbacks, register=lambda name, fn: callbacks.setdefault(name, []).append(fn)
    )
    shell = SimpleNamespace(events=events)
    fake = ModuleType("IPython")
    fake.get_ipython = lambda: shell  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", fake)
    assert interrupts.guard_ipython_cells() is True
    assert interrupts.guard_ipython_cells() is True  # registered once
    assert len(callbacks["pre_run_cell"]) == 1
    old = signal.signal(signal.SIGINT, signal.default_int_handler)  # what ipykernel does
    try:
        callbacks["pre_run_cell"][0](SimpleNamespace(raw_cell="x = 1"))
        installed = signal.getsignal(signal.SIGINT)
        assert isinstance(installed, GuardedHandler) and installed.handler is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, old)
    monkeypatch.setitem(sys.modules, "IPython", ModuleType("IPython"))  # no shell running
    assert interrupts.guard_ipython_cells() is False


@plain
def test_a_deferred_handler_runs_with_the_lock_released() -> None:
    """A handler deferred out of malloc may wait for a thread that allocates (a SIGTERM handler
    joining workers): it runs once the lock is released, not merely once the update is done."""
    a = new_allocator()
    a.free(a.malloc(512, stream=0))
    seen: list[tuple[bool, bool]] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        done = threading.Event()
        worker = threading.Thread(target=lambda: (a.free(a.malloc(1024, stream=0)), done.set()))
        worker.start()
        worker.join(5)
        seen.append((a._lock._is_owned(), done.is_set()))

    guarded = gp.guard_signal_handler(handler)
    with interrupted(("place",), lambda frame: guarded(signal.SIGINT, frame)):
        ptr = a.malloc(512, stream=0)
    assert seen == [(False, True)]
    a.free(ptr)
    a.check_invariants()

"""Interrupts (policy/interrupts.py): a guarded signal handler never runs inside an allocator's
critical section; it runs right after it, and the allocator stays consistent.

The first deferral tests patch free-list methods, which compiled classes do not allow: they run
on the plain-Python build. A handler is "interrupted into" a critical section by calling the
guarded handler, with the frame of the moment, from a free-list method patched to do so (what
Python does when a signal arrives there). The tests of interrupts inside the allocator's calls
out (the device, the history, logging, observers) run in both builds: compiled, those calls
are the only Python code a handler can run in. Each test here fails with the guard removed
(``GuardedHandler.__call__`` running the handler at once).
"""

from __future__ import annotations

import _thread
import gc
import inspect
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import typing
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType, ModuleType, SimpleNamespace
from typing import Any

import pytest

import graphpool as gp
from graphpool import runtime
from graphpool.device.protocol import CAPTURE_MODE_RELAXED
from graphpool.policy import interrupts, observers
from graphpool.policy.allocator import CachingAllocator
from graphpool.policy.freelist import FreeList
from graphpool.policy.interrupts import GuardedHandler
from graphpool.policy.pools import SizeConfig
from graphpool.policy.private_pools import PoolId
from graphpool.sim import SimBackend

SRC = str(Path(__file__).resolve().parents[1] / "src")

plain = pytest.mark.skipif(gp.compiled(), reason="patches FreeList methods (a native class, compiled)")
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
    # malloc had succeeded, but its caller never gets the block: it went back
    assert a.memory_stats()["allocated_bytes.all.current"] == 0
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
    # the malloc frame of a finished call (the lock released, as before the check): not waiting
    # for the lock; a handoff, but this guard is not SIGINT's installed handler, so no signal
    # delivered again would come back to it: it runs at once
    assert frames[0].f_code is CachingAllocator._malloc.__code__  # malloc's body
    assert signal.getsignal(signal.SIGINT) is not guarded
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
    for other in (signal.SIG_DFL, signal.SIG_IGN, None, 0, 1):
        assert interrupts.guard(other) is other
    for bad in ("0", 2, 1.0, [0], object()):  # refused where they were passed, naming the kind
        refused = rf"guard_signal_handler: handler must be .*not {type(bad).__name__}"
        with pytest.raises(TypeError, match=refused):
            gp.guard_signal_handler(bad)  # type: ignore[arg-type]


def test_importing_graphpool_guards_the_default_sigint_handler_in_both_builds() -> None:
    code = (  # (Python's own handler first: a process started in the background inherits SIGINT ignored)
        "import signal\n"
        "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
        "import graphpool as gp\n"
        "h = signal.getsignal(signal.SIGINT)\n"
        "print(gp.compiled(), type(h).__name__, getattr(h, 'handler', None) is signal.default_int_handler)\n"
    )
    env = {**os.environ, "PYTHONPATH": SRC}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(gp.compiled()), "GuardedHandler", "True"]


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


# ---------------------------------------------- interrupts inside every call out (both builds)
# The allocator calls plain Python in the middle of its updates: the device (the simulator here,
# CUDA's wrappers in device/cuda.py), the history, logging, the out-of-memory observers. Compiled,
# those are the only places a signal handler can run; a fault injected there stands for one. Each
# call out is faulted in turn, at each of its calls in a scenario, before and after the real call
# took effect, raising at once ("raise": an unguarded handler) or through a guarded handler
# ("guarded": it must wait until the lock is released). After each: the invariants hold, and once
# everything is freed and the cache emptied nothing stays reserved.

MiB = 1 << 20
DEVICE_CALLS = (
    "malloc", "free", "capture_id", "capture_info", "exchange_capture_mode", "create_event",
    "record_event", "query_event", "event_synchronize", "device_synchronize", "stream_idle",
    "stream_synchronize_made", "stream_capturing", "made_streams_capturing", "vmm_granularity",
    "vmm_reserve", "vmm_map",
    "vmm_unmap", "vmm_release", "take_released",
    "mem_info", "begin_capture", "end_capture", "destroy_graph", "destroy_graph_exec",
)  # fmt: skip
ACQUIRE = {"malloc", "vmm_reserve", "vmm_map"}
"""Calls whose result an interrupt after the driver acted loses (stated in docs/behaviour.rst):
the device keeps what it made."""
RELEASE = {"free", "vmm_release"}
"""Calls the allocator forgets the memory before (stated): interrupted before the driver acted,
the driver keeps it."""


class Fault:
    """Counts the calls out by name; when armed, interrupts the ``k``-th call of ``name``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.calls: dict[str, int] = {}
        self.target: tuple[str, int, str] | None = None  # (name, k, "before" | "after")
        self.fired = False
        self.owned_when_run: list[bool] = []
        self.alloc: CachingAllocator | None = None

    def hit(self, name: str, when: str) -> None:
        if when == "before":
            self.calls[name] = self.calls.get(name, 0) + 1
        t = self.target
        if t is None or self.fired or t[0] != name or t[2] != when or self.calls[name] != t[1]:
            return
        self.fired = True
        if self.kind == "raise":
            raise Interrupt
        a = self.alloc

        def handler(signum: int, frame: FrameType | None) -> None:
            self.owned_when_run.append(a is not None and bool(a._lock._is_owned()))
            raise Interrupt

        gp.guard_signal_handler(handler)(signal.SIGALRM, sys._getframe())


class FaultDevice:
    """A SimDevice whose allocator-facing calls go through ``fault``."""

    def __init__(self, dev: Any, fault: Fault) -> None:
        self._dev = dev
        self._fault = fault
        self.index = dev.index
        self.name = dev.name

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._dev, name)
        if name not in DEVICE_CALLS:
            return real
        fault = self._fault

        def call(*args: Any) -> Any:
            fault.hit(name, "before")
            out = real(*args)
            fault.hit(name, "after")
            return out

        return call


def _faulty_history(fault: Fault) -> Any:
    from graphpool.policy.history import History

    class FaultyHistory(History):
        __slots__ = ()

    for name in ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "record",
                 "oom", "capture", "pool"):  # fmt: skip
        real = getattr(History, name)

        def method(
            self: Any, *args: Any, _real: Any = real, _name: str = "history." + name, **kw: Any
        ) -> Any:
            fault.hit(_name, "before")
            return _real(self, *args, **kw)

        setattr(FaultyHistory, name, method)
    return FaultyHistory(0, 1000, False)


class _FaultLog(logging.Handler):
    def __init__(self, fault: Fault) -> None:
        super().__init__(logging.DEBUG)
        self.fault = fault

    def emit(self, record: logging.LogRecord) -> None:
        self.fault.hit("log", "before")


def _scenario(
    name: str, a: CachingAllocator, sim: Any, s1: int, held: list[int], state: dict[str, Any]
) -> None:
    """One use of the allocator, through the raw API; ``held`` keeps what it owns (a pointer
    leaves it before its free is asked for: an interrupted free is done or queued, never lost)."""

    def free(p: int) -> None:
        held.remove(p)
        a.free(p)

    if name == "cached":
        for n in (512, 4096, 3 * MiB, 12 * MiB, 512):
            held.append(a.malloc(n, stream=0))
        free(held[1])
        free(held[0])
        held.append(a.malloc(4096, stream=0))
        while held:
            free(held[-1])
        held.append(a.malloc(2 * MiB, stream=s1))
        free(held[-1])
    elif name == "record_stream":
        for n in (4096, 2 * MiB):
            p = a.malloc(n, stream=0)
            held.append(p)
            a.record_stream(p, s1)
            sim.launch_sleep(s1, 3)  # the side stream is busy: the event stays pending
            free(p)
        held.append(a.malloc(4096, stream=0))  # queries the events
        free(held[-1])
        a.empty_cache()  # waits for them, gives the segments back
    elif name == "empty_cache":
        for n in (4096, 2 * MiB, 12 * MiB):
            held.append(a.malloc(n, stream=0))
        while held:
            free(held[-1])
        sim.launch_sleep(0, 2)
        a.empty_cache()
    elif name == "capture":
        q = a.malloc(4096, stream=0)
        held.append(q)

        def begin() -> int:
            a.device.begin_capture(s1, CAPTURE_MODE_RELAXED)
            return int(a.device.capture_id(s1))

        rec = state["rec"] = a.begin_capture(PoolId(0, 999), begin, stream=s1)
        p = a.malloc(4096, stream=s1)
        held.append(p)
        free(q)  # eager memory freed during the capture: kept for the graph
        free(p)
        graph = a.device.end_capture(s1)
        rec.handles.append(("graph", graph))
        a.end_capture(rec)
        a.release_capture(rec)
    elif name == "expandable":
        for n in (3 * MiB, 5 * MiB, 4096):
            held.append(a.malloc(n, stream=0))
        free(held[0])
        held.append(a.malloc(7 * MiB, stream=0))
        free(held[1])
        a.empty_cache()  # unmaps the free end
        while held:
            free(held[-1])
        a.empty_cache()  # gives the segment back
    elif name == "expandable_retry":  # the out-of-memory retry gives a busy taker's block home
        s2 = sim.create_stream()
        held.append(a.malloc(8 * MiB, stream=s1))
        free(held[-1])
        held.append(a.malloc(8 * MiB, stream=s2))  # taken over from the idle s1
        sim.launch_sleep(s2, 3)
        free(held[-1])  # s2 busy: the retry waits for it alone, then the block goes home
        try:
            held.append(a.malloc(60 * MiB, stream=0))  # fits once s1's segment went back
            free(held[-1])
            a.malloc(200 * MiB, stream=0)
        except gp.OutOfMemoryError:
            pass
    elif name == "oom":
        held.append(a.malloc(40 * MiB, stream=0))
        free(held[-1])
        try:
            held.append(a.malloc(50 * MiB, stream=0))  # releases the cache and retries
            free(held[-1])
            a.malloc(200 * MiB, stream=0)  # out of memory: history, logging, observers
        except gp.OutOfMemoryError:
            pass


def _run_faulted(scenario: str, kind: str, history: bool, target: tuple[str, int, str] | None) -> Fault:
    """Run ``scenario`` with ``target`` interrupted, then check what it left."""
    from graphpool.sim import capture as sim_capture

    fault = Fault(kind)
    memory = 64 * MiB if scenario in ("oom", "expandable_retry") else 1 << 30
    sim = SimBackend(memory_bytes=memory).get_device(0)
    expandable = scenario in ("expandable", "expandable_retry")
    sizes = SizeConfig(expandable_segments=True) if expandable else SizeConfig()
    a = CachingAllocator(FaultDevice(sim, fault), sizes=sizes)  # type: ignore[arg-type]
    fault.alloc = a
    s1 = sim.create_stream()
    mode = sim_capture.exchange_mode(CAPTURE_MODE_RELAXED)
    sim_capture.exchange_mode(mode)
    log = logging.getLogger("graphpool")
    handler, level = _FaultLog(fault), log.level
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)

    def observer(device: int, requested: int, stats: dict[str, int]) -> None:
        fault.hit("observer", "before")

    observers.attach(observer)
    if history:
        a._history = _faulty_history(fault)
    held: list[int] = []
    state: dict[str, Any] = {}
    fault.target = target
    try:
        _scenario(scenario, a, sim, s1, held, state)
    except Interrupt:
        assert target is not None and fault.fired
    finally:
        fault.target = None
        observers.detach(observer)
        log.removeHandler(handler)
        log.setLevel(level)
        sim_capture.exchange_mode(mode)  # an interrupted exchange may leave it relaxed (stated)
    where = f"{scenario} {kind} history={history} {target}"
    a.check_invariants()
    rec = state.get("rec")
    graph = 0
    if sim.capture_id(s1):  # the scenario's capture was interrupted: end it on the device
        try:
            graph = sim.end_capture(s1)
        except gp.GraphpoolError:
            pass
    if rec is not None and not rec.released:
        if graph:
            rec.handles.append(("graph", graph))
        if rec.active:
            a.abort_capture(rec)
        else:
            a.release_capture(rec)
    elif graph:  # no record came back: an adopted capture, or none; its graph goes
        sim.destroy_graph(graph)
    for p in held:
        a.free(p)
    sim.device_synchronize()
    a.empty_cache()
    a.empty_cache()  # a free or release queued by an interrupt ran at the first call
    a.check_invariants()
    st = a.memory_stats()
    assert st["allocated_bytes.all.current"] == 0, where
    assert st["reserved_bytes.all.current"] == 0, where
    leaked = len(sim.allocations()) + len(sim.reservations())
    name, _, when = target if target is not None else ("", 0, "")
    stated = kind == "raise" and (
        (name in ACQUIRE and when == "after") or (name in RELEASE and when == "before")
    )
    assert leaked == 0 or stated, f"{where}: {leaked} device allocations left"
    assert not any(fault.owned_when_run), f"{where}: a guarded handler ran with the lock held"
    return fault


SCENARIOS = ("cached", "record_stream", "empty_cache", "capture", "expandable", "expandable_retry", "oom")


@pytest.mark.parametrize("history", [False, True], ids=["", "history"])
@pytest.mark.parametrize("kind", ["raise", "guarded"])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_an_interrupt_inside_any_call_out_leaves_the_allocator_whole(
    scenario: str, kind: str, history: bool
) -> None:
    counts = _run_faulted(scenario, kind, history, None).calls
    assert counts, "the scenario calls out"
    ran = 0
    for name, n in sorted(counts.items()):
        whens = ("before", "after") if name in DEVICE_CALLS else ("before",)
        for k in sorted({1, 2, n - 1, n} & set(range(1, n + 1))):  # the first calls and the last
            for when in whens:
                fault = _run_faulted(scenario, kind, history, (name, k, when))
                ran += fault.fired
    assert ran >= len(counts)


def test_a_deferred_handler_that_raises_at_the_end_of_a_malloc_gives_the_block_back() -> None:
    """Compiled too: the handler waits for the lock's release (no Python frames needed), and the
    caller, which never gets the block, does not lose it."""
    fault = Fault("guarded")
    sim = SimBackend().get_device(0)
    a = CachingAllocator(FaultDevice(sim, fault))  # type: ignore[arg-type]
    fault.alloc = a
    fault.target = ("malloc", 1, "after")
    with pytest.raises(Interrupt):
        a.malloc_owned(4096, stream=0)
    assert fault.owned_when_run == [False]
    a.check_invariants()
    assert a.memory_stats()["allocated_bytes.all.current"] == 0
    assert a.memory_stats()["reserved_bytes.all.current"] > 0  # the segment stays cached


# ----------------------------------------------------------------------- handoffs
@posix
@main_only
def test_a_signal_inside_a_handoff_runs_its_handler_in_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    """A real signal (Python delivers it, and the guard delivers it again through
    ``_thread.interrupt_main``) landing in a registered handoff: its handler runs once, in the
    caller, after the handoff returned; not in the handoff, nor in the guard's own frames."""
    got: list[str] = []
    inside: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        got.append(frame.f_code.co_name if frame is not None else "")

    def handoff() -> int:
        signal.raise_signal(signal.SIGUSR1)  # Python checks right after the call, here
        inside.append(len(got))
        return 1

    monkeypatch.setattr(interrupts, "_handoffs", {*interrupts._handoffs})
    interrupts.handoff(handoff)
    guarded = gp.guard_signal_handler(handler)
    old = signal.signal(signal.SIGUSR1, guarded)
    try:
        handoff()
        caller = sys._getframe().f_code.co_name
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert inside == [0]
    assert got == [caller]
    # a guard that is not the signal's installed handler is never called again: it runs at once
    frame = sys._getframe()
    monkeypatch.setattr(interrupts, "_handoffs", {frame.f_code})
    guarded(signal.SIGUSR1, frame)
    assert got == [caller, caller]


class _Trip:
    """``_Trip()[signum]`` marks ``signum`` arrived (as the guard's ``_AGAIN`` does): Python runs
    its handler at the next check, in the frame that made this subscript's caller run."""

    __getitem__ = _thread.interrupt_main


@posix
@main_only
def test_a_second_signal_while_the_guard_decides_waits_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGUSR2 arrives while the guard's own code runs for a SIGUSR1 that landed in a handoff (the
    guard asks each allocator's lock whether this thread owns it: Python code, where Python
    checks for signals). Its handler must not run there (raising, it would leave the guard and
    enter the handoff): both run in the caller, after the handoff."""
    got: list[tuple[int, str]] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        got.append((signum, frame.f_code.co_name if frame is not None else ""))

    class TrippingLock:
        """Asked by the guard, it makes SIGUSR2 arrive (once): Python checks for it right after,
        in the guard's own frame."""

        armed = True

        def _is_owned(self) -> bool:
            if self.armed:
                self.armed = False
                _Trip()[signal.SIGUSR2]
            return False

    lock = TrippingLock()
    keep = interrupts.section(lock)  # registered while this lives
    inside: list[int] = []

    def handoff() -> None:
        signal.raise_signal(signal.SIGUSR1)
        inside.append(len(got))

    monkeypatch.setattr(interrupts, "_handoffs", {*interrupts._handoffs, handoff.__code__})
    old1 = signal.signal(signal.SIGUSR1, gp.guard_signal_handler(handler))
    old2 = signal.signal(signal.SIGUSR2, gp.guard_signal_handler(handler))
    try:
        handoff()
        here = sys._getframe().f_code.co_name
    finally:
        signal.signal(signal.SIGUSR1, old1)
        signal.signal(signal.SIGUSR2, old2)
    del keep
    assert not lock.armed  # the guard asked it
    assert inside == [0], got  # no handler ran before the handoff's end
    assert sorted(got) == [(signal.SIGUSR1, here), (signal.SIGUSR2, here)]


def test_typing_cast_called_by_a_handoff_counts_as_its_caller() -> None:
    def window() -> None:
        pass

    interrupts.handoff(window, len)  # a builtin (as a compiled function) has no code: skipped
    try:
        cast_code = typing.cast.__code__  # type: ignore[attr-defined]
        assert interrupts.in_handoff(SimpleNamespace(f_code=window.__code__, f_back=None))  # type: ignore[arg-type]
        inner = SimpleNamespace(f_code=cast_code, f_back=SimpleNamespace(f_code=window.__code__))
        assert interrupts.in_handoff(inner)  # type: ignore[arg-type]
        elsewhere = SimpleNamespace(f_code=cast_code, f_back=sys._getframe())
        assert not interrupts.in_handoff(elsewhere)  # type: ignore[arg-type]
        assert not interrupts.in_handoff(None)
    finally:
        interrupts._handoffs.discard(window.__code__)


class Emulated:
    """Python's signal checks, emulated at every bytecode (``sys.settrace`` opcode events: CPython
    checks at fewer points, calls and loops, so this is the stricter test). The signal "arrives"
    before the ``at``-th traced bytecode; the guarded handler is then called with that frame, as
    Python calls it, and a signal the guard delivers again (``interrupts._AGAIN``, which this
    replaces) is checked again at the next bytecode. Counts the bytecodes (``seen``)."""

    def __init__(self, guarded: GuardedHandler, at: int) -> None:
        self.guarded = guarded
        self.at = at
        self.seen = 0
        self.tripped = False

    def __getitem__(self, signum: int) -> None:  # what the guard calls to deliver it again
        assert signum == signal.SIGINT
        self.tripped = True

    def trace(self, frame: FrameType, event: str, arg: object) -> Any:
        frame.f_trace_opcodes = True
        if event == "opcode":
            self.seen += 1
            if self.seen == self.at:
                self.tripped = True
            if self.tripped:
                self.tripped = False
                self.guarded(signal.SIGINT, frame)  # its exception enters the traced code here
        return self.trace


def _alloc_free() -> None:
    gp.alloc(4096).free()


def _alloc_drop() -> None:
    b = gp.alloc(4096)
    del b  # the finalizer frees it


def _alloc_on_stream_record_drop() -> None:
    b = gp.alloc(4096, _HANDOFF_STREAMS[0])
    b.record_stream(_HANDOFF_STREAMS[1])
    del b


def _with_block() -> None:
    with gp.alloc(1 << 20):
        pass


_HANDOFF_STREAMS: list[gp.Stream] = []


def _pinned_free() -> None:
    gp.alloc_pinned(4096).free()


def _pinned_drop() -> None:
    b = gp.alloc_pinned(4096)
    del b


def _pinned_with() -> None:
    with gp.alloc_pinned(1 << 20):
        pass


_POOLS: list[gp.MemPool] = []


def _mem_pool_with() -> None:
    with gp.use_mem_pool(_POOLS[0]):
        gp.alloc(4096).free()


HANDOFF_OPS = {
    f.__name__.strip("_"): f
    for f in (
        _alloc_free,
        _alloc_drop,
        _alloc_on_stream_record_drop,
        _with_block,
        _pinned_free,
        _pinned_drop,
        _pinned_with,
        _mem_pool_with,
    )
}


def _run_emulated(op: Callable[[], None], at: int, monkeypatch: pytest.MonkeyPatch) -> tuple[int, int]:
    """``op()`` with a guarded SIGINT arriving before its ``at``-th bytecode (``Emulated``); then
    everything freed. Returns (bytecodes traced, handler runs)."""
    ran: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        ran.append(signum)
        raise Interrupt

    emu = Emulated(GuardedHandler(handler), at)
    monkeypatch.setattr(interrupts, "_AGAIN", emu)
    old = signal.signal(signal.SIGINT, emu.guarded)  # the guard delivers again only its own signal
    try:
        sys.settrace(emu.trace)
        try:
            op()
        finally:
            sys.settrace(None)
        if emu.tripped:  # delivered again after op's last bytecode: Python's next check is here
            emu.guarded(signal.SIGINT, sys._getframe())
    except Interrupt:
        pass
    finally:
        signal.signal(signal.SIGINT, old)
    return emu.seen, len(ran)


@main_only
@pytest.mark.parametrize("op", list(HANDOFF_OPS))
def test_a_guarded_handler_at_any_bytecode_of_an_allocation_or_free_loses_no_owner(
    op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Plain-Python build: between the allocator's release and the DeviceBuffer's creation, and
    between a buffer marking itself freed and its block reaching the allocator, a handler that
    raised lost the allocation (allocated, with no owner). Every bytecode is tried. Compiled,
    those steps have no bytecode and the same checks hold."""
    gp.set_backend("sim")
    _HANDOFF_STREAMS[:] = [gp.Stream(), gp.Stream()]
    _POOLS[:] = [gp.MemPool()]
    fn = HANDOFF_OPS[op]
    fn()  # warm: routes kept, segments cached
    gp.synchronize()
    gp.alloc(512).free()  # carries out the frees a finalizer queued
    total, _ = _run_emulated(fn, 0, monkeypatch)  # no signal: how many bytecodes
    assert total > 0
    missed = []
    for at in range(1, total + 1):
        seen, n = _run_emulated(fn, at, monkeypatch)
        assert n <= 1, f"{op}: the handler ran {n} times for one signal (bytecode {at})"
        if n == 0 and at <= seen:
            missed.append(at)
        gp.synchronize()
        gp.alloc(512).free()
        gp.alloc_pinned(512).free()  # the pinned pool carries out its queued frees too
        for st in (gp.memory_stats(), gp.pinned_memory_stats()):
            assert st["allocated_bytes.all.current"] == 0, (
                f"{op}: an owner was lost (signal at bytecode {at})"
            )
        assert runtime.allocator(0)._entered == 0, f"{op}: a use_mem_pool entry was left (bytecode {at})"
    assert not missed, f"{op}: signals never handled, at bytecodes {missed}"
    gp.check_invariants()
    _POOLS.clear()  # a live MemPool keeps its cache through empty_cache
    gc.collect()
    gp.synchronize()
    gp.empty_cache()
    assert gp.memory_stats()["reserved_bytes.all.current"] == 0
    _HANDOFF_STREAMS.clear()


def test_a_lock_that_cannot_say_who_holds_it_is_taken_as_not_held() -> None:
    """``_owned``: a lock without ``_is_owned`` (a plain threading.Lock) is never taken to be
    this thread's; a reentrant lock says."""
    from graphpool.policy.interrupts import _owned

    plain, reentrant = threading.Lock(), threading.RLock()
    with plain:
        assert _owned(plain) is False
    assert _owned(reentrant) is False
    with reentrant:
        assert _owned(reentrant) is True


def test_the_framework_hooks_free_and_the_drop_are_handoffs() -> None:
    """Plain build: a CuPy array's or PyTorch tensor's free hands its block to the allocator's
    queue outside the lock (``CupyHooks.free``, ``TorchHooks.free``, ``Heap.drop``), so a
    guarded signal landing there waits until the block is queued. Compiled, they have no
    bytecode and nothing is registered."""
    from graphpool.hooks import CupyHooks, TorchHooks
    from graphpool.policy.heap import Heap

    for fn in (CupyHooks.free, TorchHooks.free, Heap.drop):
        code = getattr(fn, "__code__", None)
        if code is not None:  # plain build
            assert code in interrupts._handoffs, fn

"""Signal handlers that wait until the allocator is consistent again (both builds).

Python runs a signal handler in the main thread, between two bytecodes of the Python code
running there. Compiled by mypyc the allocator's own methods have no bytecode, but in the
middle of an update they call plain Python: the device (the simulator, and CUDA's wrappers in
device/cuda.py), the history, logging. In the plain-Python build every line of the allocator
is such a point. A KeyboardInterrupt raised there would leave the update half done.

``guard(handler)`` wraps a handler. When the signal arrives while this thread is inside an
allocator's *critical section* the handler is not run: it is recorded as pending, and the
allocator runs it (``run_pending``) as soon as it leaves the section; anywhere else it runs at
once. A critical section is the time this thread holds the lock of an allocator (every
mutation, and every call out of the allocator, runs with it held), so the test needs no
Python frames and works compiled: each allocator registers its lock (``section``), and the
guard asks each registered lock whether this thread owns it (only when a signal arrives).
The handler then runs once the lock is released, so it may call graphpool or wait for a
thread that does.

Each locked call checks ``pending`` (one attribute read) right after it released the lock and
calls ``run_pending``, which runs the handlers unless an outer section is still underway (a
free run by a finalizer inside another allocator's malloc: the outer one runs them when it
ends). An interrupt that lands after the release but before that check finds no lock held and
runs at once, so a deferred handler is never lost. Handlers run in the main thread only, as
Python runs them: another thread's check sees a pending handler but leaves it to the main
thread. Like POSIX signals, a signal deferred twice runs once.

Handoffs (plain-Python build): a result changes hands outside any lock. ``gp.alloc`` gets a
block from the allocator, whose lock is released by then, and makes the DeviceBuffer that owns
it; a buffer's ``free`` or finalizer marks the buffer freed and then hands the block to the
allocator. Compiled, those steps have no bytecode; plain, a handler that raised between them
would lose the allocation. Their functions are registered (``handoff``), and a signal whose
interrupted frame runs one of them (or ``typing.cast`` called by one) is delivered again at
Python's next check for signals (``_thread.interrupt_main``, ``_Again``) instead of now, until
the frame has left: the handler then runs in the caller, where the result has its owner. This costs
nothing until a signal comes: no code of the hot path changes. It needs the guard to be the
installed handler of the signal (only then does the signal come back to it); a guard called
some other way runs its handler at once, as before. The guard is Python code too, in both
builds: a second signal that arrives while a guard decides about a first, or at a guard's
entry, is delivered again the same way, never run inside the guard.

graphpool guards Python's default SIGINT handler when it is imported, in both builds
(``guard_default_sigint``), and again before each IPython cell (ipykernel puts the default
handler back before running one).
"""

from __future__ import annotations

import _thread
import signal
import sys
import threading
import typing
import weakref
from collections.abc import Callable
from types import CodeType, FrameType
from typing import Any, Final

Handler = Callable[[int, FrameType | None], Any]
"""A Python-level signal handler, as ``signal.signal`` takes it."""

pending: list[tuple[Handler, int, FrameType | None]] = []
"""Handlers deferred until the allocator leaves its critical section: (handler, signal number,
interrupted frame). Every allocator keeps a reference to this list (never replaced) and tests
it after each critical section: the only cost on the hot path."""


class Section:
    """One allocator's critical section for the guard: while this thread holds ``lock``.

    The allocator keeps it (its ``_section``) and the registry holds it weakly, so it goes
    with its allocator (the allocator itself, compiled, and its C lock cannot be weakly
    referenced)."""

    __slots__ = ("lock", "__weakref__")

    def __init__(self, lock: Any) -> None:
        self.lock = lock


_sections: weakref.WeakSet[Section] = weakref.WeakSet()
"""The sections of every live allocator."""


def section(lock: Any) -> Section:
    """Register an allocator's ``lock`` as a critical section; keep the result as long as the
    allocator lives."""
    s = Section(lock)
    _sections.add(s)
    return s


def _owned(lock: Any) -> bool:
    """Whether this thread holds ``lock`` (False when the lock cannot say)."""
    is_owned = getattr(lock, "_is_owned", None)
    return bool(is_owned()) if is_owned is not None else False


def in_critical(frame: FrameType | None = None) -> bool:
    """Whether this thread is inside an allocator's critical section (holds an allocator's
    lock). ``frame``, the interrupted frame, is not needed: compiled there may be none."""
    return any(_owned(s.lock) for s in list(_sections))


_handoffs: set[CodeType] = set()
"""The code of the functions registered with ``handoff``: the handoffs of the plain-Python
build, and in both builds the guard's own ``__call__`` (see below the class)."""

_cast: Final = getattr(typing.cast, "__code__", None)
"""``typing.cast``'s code: called inside handoffs, its frame counts as its caller's."""


def handoff(*functions: object) -> None:
    """Register ``functions`` as ownership handoffs (module docstring). A compiled function has
    no code object and is skipped: compiled, a handoff has no bytecode a handler could run in."""
    for fn in functions:
        code = getattr(fn, "__code__", None)
        if isinstance(code, CodeType):
            _handoffs.add(code)


def in_handoff(frame: FrameType | None) -> bool:
    """Whether ``frame`` (the interrupted frame) runs a registered handoff."""
    if frame is None:
        return False
    code = frame.f_code
    if code is _cast and frame.f_back is not None:
        code = frame.f_back.f_code
    return code in _handoffs


_getsignal: Final[Callable[[int], Any]] = getattr(sys.modules.get("_signal"), "getsignal", signal.getsignal)
"""``signal.getsignal`` without its Python wrapper (which maps the result to an enum): Python
code, where Python would check for signals while the guard decides."""

_deciding = False
"""True while a guard decides what to do with a signal (``GuardedHandler.__call__``)."""


def _installed(signum: int, guard: GuardedHandler) -> bool:
    """Whether ``guard`` is the installed handler of ``signum``: only then does a signal
    delivered again come back to it."""
    try:
        return _getsignal(signum) is guard
    except (ValueError, OSError):  # not a signal number Python handles here
        return False


class _Again:
    """``_AGAIN[signum]`` delivers ``signum`` again at Python's next check for signals.

    ``_thread.interrupt_main(signum)`` only marks the signal as arrived. Called through a
    ``CALL``, Python would check for signals right after it, in the guard's own frame, and
    run the handler there; through the subscript slot no check follows, so the next one is in
    the interrupted code (``__getitem__`` is a builtin: not bound, it gets ``signum`` only)."""

    __getitem__ = _thread.interrupt_main


_AGAIN: Any = _Again()


class GuardedHandler:
    """A signal handler that waits while the interrupted code is inside an allocator's critical
    section or a handoff, and then runs (``guard``). ``handler`` is the handler it wraps."""

    __slots__ = ("handler",)

    def __init__(self, handler: Handler) -> None:
        self.handler = handler

    @property
    def __wrapped__(self) -> Handler:
        """The wrapped handler (``inspect.unwrap`` follows it)."""
        return self.handler

    def __call__(self, signum: int, frame: FrameType | None) -> Any:
        global _deciding
        if _deciding:
            # A second signal, arrived while a guard decides about a first (its checks are
            # Python code, where Python checks for signals). Not run here: raising, its handler
            # would leave the guard into the code the first signal interrupted. Delivered again.
            if _installed(signum, self):
                _AGAIN[signum]
                return None
            return self.handler(signum, frame)
        _deciding = True
        try:
            if in_critical(frame):
                if all(s != signum for _, s, _ in pending):  # a signal is not queued twice
                    pending.append((self.handler, signum, frame))
                return None
            later = in_handoff(frame) and _installed(signum, self)
        finally:
            _deciding = False
        if later:
            # Delivered again until the handoff has left the frame (module docstring). No
            # call from here on: Python checks for signals after each call.
            _AGAIN[signum]
            return None
        return self.handler(signum, frame)

    def __repr__(self) -> str:
        return f"graphpool.guard_signal_handler({self.handler!r})"


# A signal checked for at the entry of a guard, or after its decision (Python handles signals
# one after the other, and each guard is Python code): delivered again too, not run inside the
# guard, which runs inside the code the first signal interrupted.
handoff(GuardedHandler.__call__)


def guard(handler: Any) -> Any:
    """``handler`` wrapped so that it never runs inside an allocator's critical section (it runs
    right after the section instead). Idempotent; ``signal.SIG_DFL``, ``SIG_IGN`` and None
    (no Python code runs for those) come back unchanged; anything else that is not callable is
    refused (TypeError), as ``signal.signal`` would refuse it, but here, where it was passed."""
    if isinstance(handler, GuardedHandler):
        return handler
    if not callable(handler):
        if handler is None or (type(handler) in (int, signal.Handlers) and handler in _DISPOSITIONS):
            return handler
        raise TypeError(
            "guard_signal_handler: handler must be a callable taking (signum, frame), "
            f"signal.SIG_DFL, signal.SIG_IGN or None, not {type(handler).__name__}"
        )
    return GuardedHandler(handler)


_DISPOSITIONS: Final = (signal.SIG_DFL, signal.SIG_IGN)


def run_pending() -> None:
    """Run the deferred handlers, in the order their signals came: called by the allocator right
    after a critical section ends. A handler's exception propagates to the caller, as it would
    have from the interrupted call; handlers still waiting behind it are signalled again, as
    Python does when a handler raises (they run at the next point Python checks for signals)."""
    if not pending or threading.get_ident() != threading.main_thread().ident:
        return  # handlers run in the main thread only
    if in_critical():
        return  # an outer critical section runs them when it ends
    while pending:
        handler, signum, frame = pending.pop(0)
        try:
            handler(signum, frame)
        except BaseException:
            _signal_again()
            raise


def _signal_again() -> None:
    """Deliver the signals still pending again: ``signal.raise_signal`` runs their current
    handlers now (outside any critical section), each after the other even if one raises."""
    while pending:
        signum = pending.pop(0)[1]
        try:
            signal.raise_signal(signum)
        except BaseException:
            _signal_again()
            raise


def guard_default_sigint() -> bool:
    """Guard SIGINT if Python's default handler (KeyboardInterrupt) is installed and this is the
    main thread; a handler the user installed is left alone. True if it installed the guard."""
    if threading.current_thread() is not threading.main_thread():
        return False
    try:
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return False
        signal.signal(signal.SIGINT, GuardedHandler(signal.default_int_handler))
    except (ValueError, OSError):  # not the main interpreter, or no signals here
        return False
    return True


def _before_cell(*args: object) -> None:
    """IPython ``pre_run_cell`` callback: ipykernel installs the default SIGINT handler before
    each cell; guard it again."""
    guard_default_sigint()


def guard_ipython_cells() -> bool:
    """Under IPython (a Jupyter kernel), guard the default SIGINT handler before every cell.

    IPython is not imported: only a running shell is looked for. True if the callback was
    registered."""
    ipython = sys.modules.get("IPython")
    get_shell = getattr(ipython, "get_ipython", None)
    shell = get_shell() if callable(get_shell) else None
    events = getattr(shell, "events", None)
    if events is None:
        return False
    try:
        if _before_cell not in events.callbacks.get("pre_run_cell", []):
            events.register("pre_run_cell", _before_cell)
    except Exception:  # an IPython of another shape: Ctrl-C stays guarded outside cells only
        return False
    return True

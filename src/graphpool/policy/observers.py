"""Out-of-memory observers: functions called before an ``OutOfMemoryError`` is raised.

PyTorch's ``attach_out_of_memory_observer`` for graphpool. An observer is called as
``fn(device, requested, stats)``: the device index, the bytes the failed request asked
for, and that device's ``memory_stats()`` taken at the moment of the failure. The
allocator calls them with its lock released (``CachingAllocator._notify_oom``), so an
observer may call anything in graphpool, allocate included. One observer's exception
never stops the others nor the ``OutOfMemoryError``: the allocator reports it.
The registry is process-wide (every device and backend), like PyTorch's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

Observer = Callable[[int, int, dict[str, int]], object]
"""``fn(device, requested, stats)``; its return value is ignored."""

_observers: tuple[Observer, ...] = ()  # replaced whole: readers take it without the lock
_lock = threading.Lock()
_tls = threading.local()


def attach(fn: Observer) -> None:
    """Add ``fn`` to the observers (once each: attaching it again does nothing)."""
    global _observers
    if not callable(fn):
        raise TypeError(f"an out-of-memory observer must be callable, not {type(fn).__name__}")
    with _lock:
        if not any(f is fn for f in _observers):
            _observers = (*_observers, fn)


def detach(fn: Observer) -> None:
    """Remove ``fn``; ValueError if it is not attached."""
    global _observers
    with _lock:
        if not any(f is fn for f in _observers):
            raise ValueError(f"{fn!r} is not an attached out-of-memory observer")
        _observers = tuple(f for f in _observers if f is not fn)


def current() -> tuple[Observer, ...]:
    """The observers now attached, or none while this thread is already running them (an
    out-of-memory error inside an observer does not call the observers again)."""
    if getattr(_tls, "inside", False):
        return ()
    return _observers


def call(fns: tuple[Observer, ...], device: int, requested: int, stats: dict[str, int]) -> list[Exception]:
    """Call each observer in turn (each with its own copy of ``stats``); return the exceptions
    they raised, in order."""
    errors: list[Exception] = []
    _tls.inside = True
    try:
        for fn in fns:
            try:
                fn(device, requested, dict(stats))
            except Exception as exc:
                errors.append(exc)
    finally:
        _tls.inside = False
    return errors

"""Running test code on several threads at once, switching between them as often as Python can."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable


def run_threads(target: Callable[[int], object], n: int = 8) -> None:
    """``target(i)`` on ``n`` threads, started together at a 1 us switch interval; re-raises the
    first exception a thread raised, and fails if a thread is still running after 120 s."""
    errors: list[BaseException] = []
    barrier = threading.Barrier(n)

    def wrapped(i: int) -> None:
        try:
            barrier.wait()
            target(i)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wrapped, args=(i,)) for i in range(n)]
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    finally:
        sys.setswitchinterval(old)
    assert not any(t.is_alive() for t in threads), "a thread hung (deadlock?)"
    if errors:
        raise errors[0]

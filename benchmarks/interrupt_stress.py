"""Interrupt the allocator at random points and count what an interrupt leaves behind.

A SIGALRM timer raises an exception at a random moment inside a loop of allocator calls,
as a KeyboardInterrupt would. After each round it counts lock acquisitions that were
never released and whether the allocator was left marked busy, and (for ``malloc``)
checks every invariant. benchmarks/NOTES.md, entry 15, records the figures.

    PYTHONPATH=src python benchmarks/interrupt_stress.py malloc|reset_peak|snapshot [rounds]
"""

from __future__ import annotations

import random
import signal
import sys
from types import FrameType

from graphpool.policy.allocator import CachingAllocator
from graphpool.sim import SimBackend


class Interrupt(BaseException):
    pass


def main() -> int:
    call = sys.argv[1] if len(sys.argv) > 1 else "malloc"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 30_000
    a = CachingAllocator(SimBackend().get_device(0))
    armed = [False]

    def handler(signum: int, frame: FrameType | None) -> None:
        if armed[0]:
            armed[0] = False
            raise Interrupt

    signal.signal(signal.SIGALRM, handler)
    hits = leaked = stuck = broken = 0
    for i in range(rounds):
        if i % 500 == 0:  # interrupted rounds lose their pointer; keep the checked state small
            a = CachingAllocator(SimBackend().get_device(0))
        try:
            signal.setitimer(signal.ITIMER_REAL, random.uniform(1e-6, 3e-5))
            armed[0] = True
            for _ in range(50):
                if call == "malloc":
                    a.free(a.malloc(512, stream=0))
                else:
                    getattr(a, call)()
        except Interrupt:
            hits += 1
        armed[0] = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        try:  # a lock this thread still holds can be released here: count it
            a._lock.release()
            leaked += 1
        except RuntimeError:
            pass
        if a._busy:
            stuck += 1
            a._busy = False
        if call == "malloc":
            try:
                a.check_invariants()
            except AssertionError:
                broken += 1
                a = CachingAllocator(SimBackend().get_device(0))
    print(f"{call}: {hits} interrupts, {leaked} leaked lock acquisitions, {stuck} left busy,", end=" ")
    print(f"{broken} broke an invariant")
    return 0


if __name__ == "__main__":
    sys.exit(main())

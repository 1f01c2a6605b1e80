"""Interrupt the allocator at random points and count what an interrupt leaves behind.

A SIGALRM timer fires at a random moment inside a loop of allocator calls. Its handler is
installed through ``graphpool.guard_signal_handler``, as a user's own handler would be, and
raises an exception (as a KeyboardInterrupt would); with ``--sigint`` it sends the process a
real SIGINT instead, which graphpool's guarded default handler turns into KeyboardInterrupt.
``--raw`` installs the handlers unguarded (the behaviour before the guard). After each round
it counts lock acquisitions that were never released, whether the allocator was left marked
busy, handlers left pending, and (for ``malloc`` and ``free_owned``) checks every invariant.
benchmarks/NOTES.md, entries 15 and 22, record the figures.

    PYTHONPATH=src python benchmarks/interrupt_stress.py malloc|free_owned|reset_peak|snapshot \\
        [rounds] [--sigint] [--raw]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
from types import FrameType

import graphpool as gp
from graphpool.policy import interrupts
from graphpool.policy.allocator import CachingAllocator
from graphpool.sim import SimBackend


class Interrupt(BaseException):
    pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("call", nargs="?", default="malloc")
    ap.add_argument("rounds", nargs="?", type=int, default=30_000)
    ap.add_argument("--sigint", action="store_true", help="deliver a real SIGINT (KeyboardInterrupt)")
    ap.add_argument("--raw", action="store_true", help="install the handlers unguarded")
    args = ap.parse_args()
    call: str = args.call
    a = CachingAllocator(SimBackend().get_device(0))
    armed = [False]
    deferred = [0]
    run_pending = interrupts.run_pending.__code__

    def on_alarm(signum: int, frame: FrameType | None) -> None:
        if armed[0]:
            armed[0] = False
            if args.sigint:
                os.kill(os.getpid(), signal.SIGINT)
                return
            if sys._getframe(1).f_code is run_pending:
                deferred[0] += 1
            raise Interrupt

    def on_sigint(signum: int, frame: FrameType | None) -> None:
        if sys._getframe(1).f_code is run_pending:
            deferred[0] += 1
        signal.default_int_handler(signum, frame)

    wrap = (lambda h: h) if args.raw else gp.guard_signal_handler
    signal.signal(signal.SIGALRM, on_alarm if args.sigint else wrap(on_alarm))  # the alarm only signals
    signal.signal(signal.SIGINT, wrap(on_sigint))
    caught: type[BaseException] = KeyboardInterrupt if args.sigint else Interrupt
    hits = leaked = stuck = left = broken = 0
    for i in range(int(args.rounds)):
        if i % 500 == 0:  # interrupted rounds lose their pointer; keep the checked state small
            a = CachingAllocator(SimBackend().get_device(0))
        try:
            try:
                signal.setitimer(signal.ITIMER_REAL, random.uniform(1e-6, 3e-5))
                armed[0] = True
                for _ in range(50):
                    if call == "malloc":
                        a.free(a.malloc(512, stream=0))
                    elif call == "free_owned":
                        a.free_owned(a.malloc(512, stream=0))
                    else:
                        getattr(a, call)()
            finally:  # an alarm that fires in here still lands in the `except` below
                armed[0] = False
                signal.setitimer(signal.ITIMER_REAL, 0)
        except caught:
            hits += 1
        try:  # a lock this thread still holds can be released here: count it
            a._lock.release()
            leaked += 1
        except RuntimeError:
            pass
        if a._busy:
            stuck += 1
            a._busy = False
        if interrupts.pending:
            left += 1
            interrupts.pending.clear()
        if call in ("malloc", "free_owned"):
            try:
                a.check_invariants()
            except AssertionError:
                broken += 1
                a = CachingAllocator(SimBackend().get_device(0))
    signal.signal(signal.SIGINT, signal.default_int_handler)
    build = "compiled" if gp.compiled() else "plain Python"
    how = ("SIGINT" if args.sigint else "SIGALRM") + (", unguarded" if args.raw else "")
    print(f"{build}, {call}, {how}: {hits} interrupts ({deferred[0]} deferred),", end=" ")
    print(f"{leaked} leaked lock acquisitions, {stuck} left busy, {left} left pending,", end=" ")
    print(f"{broken} broke an invariant")
    return 0


if __name__ == "__main__":
    sys.exit(main())

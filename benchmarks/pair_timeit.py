"""The local timing behind benchmarks/NOTES.md: a cached malloc+free pair on the simulator.

Min of 5 x 100,000 calls, 4096 B. `pair` is `gp.alloc(n).free()`, `pair_s` the same with
an explicit stream, `drop` a dropped `gp.alloc(n)` (freed by its finalizer), `pol` the
policy alone. Give the source folder to time (a compiled copy, for instance); `--cpu`
times with the process's CPU clock instead of the wall clock (on a loaded machine):

    python benchmarks/pair_timeit.py [src] [--cpu]
"""

from __future__ import annotations

import sys
import time
import timeit

ARGS = [a for a in sys.argv[1:] if a != "--cpu"]
TIMER = time.process_time if "--cpu" in sys.argv[1:] else time.perf_counter
sys.path[:0] = [ARGS[0] if ARGS else "src"]

import graphpool as gp  # noqa: E402
from graphpool import runtime  # noqa: E402


def main() -> None:
    gp.set_backend("sim")
    s = gp.current_stream()
    a = runtime.allocator()
    cases = {
        "pair": lambda: gp.alloc(4096).free(),
        "pair_s": lambda: gp.alloc(4096, s).free(),
        "drop": lambda: gp.alloc(4096),
        "pol": lambda: a.free(a.malloc(4096, stream=0)),
    }
    print("compiled" if gp.compiled() else "plain Python")
    for name, fn in cases.items():
        best = min(timeit.repeat(fn, number=100_000, repeat=5, timer=TIMER)) / 100_000
        print(name, round(best * 1e6, 3), "us")


if __name__ == "__main__":
    main()

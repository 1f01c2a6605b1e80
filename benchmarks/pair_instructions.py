"""Instructions per cached pair, counted by callgrind (NOTES entry 36): steadier than timing.

    python benchmarks/pair_instructions.py SRC [public|current|policy ...]

SRC is a source tree whose ``graphpool`` is built (compiled or not). For each variant it runs
a loop of N pairs under ``valgrind --tool=callgrind`` for N = 20,000 and 120,000 and prints the
difference of the two instruction totals per pair, so import and warm-up cancel. Simulator
backend, 4096 B on the legacy stream. Needs valgrind.
"""

from __future__ import annotations

import re
import subprocess
import sys

LOOP = """
import sys
sys.path.insert(0, {src!r})
import graphpool as gp
from graphpool import runtime
a = runtime.allocator(0)
s = gp.current_stream()
s2 = gp.Stream()


def run(n: int) -> None:
    alloc, malloc, free = gp.alloc, a.malloc, a.free
    drop, park = getattr(a, 'drop', None), getattr(a, 'park', None)
    for _ in range(n):
        {body}


run(1000)
run({n})
"""
BODIES = {
    "public": "alloc(4096, s).free()",
    "current": "alloc(4096).free()",
    "policy": "free(malloc(4096, stream=0))",
    "drop": "drop(malloc(4096, stream=0))",  # the framework hooks' free: queued, carried out next call
    "park": "park(malloc(4096, stream=0))",  # the hooks' free of the block handed out last
}


def instructions(src: str, variant: str, n: int) -> int:
    code = LOOP.format(src=src, n=n, body=BODIES[variant])
    r = subprocess.run(
        ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
    )
    m = re.search(r"Collected : (\d+)", r.stderr)
    if m is None:
        raise SystemExit(r.stderr[-2000:])
    return int(m.group(1))


def main() -> int:
    src = sys.argv[1]
    for variant in sys.argv[2:] or list(BODIES):
        low, high = instructions(src, variant, 20_000), instructions(src, variant, 120_000)
        print(f"{variant}: {(high - low) / 100_000:.0f} instructions per pair")
    return 0


if __name__ == "__main__":
    sys.exit(main())

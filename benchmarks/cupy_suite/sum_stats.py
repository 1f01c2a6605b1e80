"""Sum the statistics files the plugin wrote (one per pytest-xdist worker, plus the controller's).

    python sum_stats.py OUT_DIR

Prints how many allocations graphpool made for CuPy over all processes (the proof that it
was CuPy's allocator) and how many processes ended with an invariant broken.
"""

from __future__ import annotations

import glob
import json
import sys


def main(out: str) -> int:
    files = sorted(glob.glob(f"{out}/graphpool_stats.json*"))
    stats = [json.load(open(f)) for f in files]
    total = sum(s.get("allocation.all.allocated", 0) for s in stats)
    broken = [f for f, s in zip(files, stats, strict=True) if s.get("invariants", "ok") != "ok"]
    print(
        f"graphpool allocations made for CuPy: {total} over {len(files)} process(es); "
        f"invariants broken in {len(broken)} {broken if broken else ''}".rstrip()
    )
    return 1 if broken or not total else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

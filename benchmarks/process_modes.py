"""Split a frameworks-bench run's worker processes into a fast and a slow mode per side.

On run 17's H100 host (and in run 16's per-process figures), each allocator's worker
processes (CuPy's pool, PyTorch's, RMM's, graphpool's) ran either at about their fastest
time or at 1.6-2.0x of it, for the whole process, pinned to one CPU or not, with
address-space randomization on or off. Which processes land slow is a draw, so a median over
8-10 processes swings with how many slow ones each side drew. This reads the bench's
``--json`` files (``per_process``) and prints, per row and side, how many processes were slow
(above ``--cut`` times the side's fastest process), the median of each mode, and each side's
fast-mode median over the framework's own: the ratio with the draw taken out. It is an
after-the-fact reading of the same numbers, shown beside the median and min the bench
reports, never instead of them. The bench's table now prints the same split for new runs
(``frameworks_bench.modes``); this script reads the JSON of runs made before it did.

Usage: ``python benchmarks/process_modes.py [--cut 1.4] RUN.json [RUN.json ...]``.
"""

from __future__ import annotations

import json
import sys

from graphpool.tools.frameworks_bench import Modes, modes


def split(times: list[float], cut: float) -> Modes:
    """The fast and slow modes of one side's per-process times (us): the bench's own rule."""
    return modes(times, cut)


def report(run: dict[str, object], cut: float) -> list[str]:
    """Lines for one bench JSON: each microbenchmark row (programs are left out: their
    processes do not fall into two clean modes), each side's modes, then fast-mode ratios
    to the first side (the framework's own)."""
    lines = []
    for case, body in run.items():
        if case == "skipped" or not isinstance(body, dict) or "per_process" not in body:
            continue
        per_process: dict[str, dict[str, list[float]]] = body["per_process"]
        sides = list(per_process)
        native = sides[0]
        lines.append(f"== {case}: {len(sides)} sides, modes cut at {cut}x each side's fastest process")
        for row in per_process[native]:
            if row.startswith("program"):
                continue
            modes = {side: split(per_process[side][row], cut) for side in sides if row in per_process[side]}
            parts = [
                f"{side} slow {m.slow}/{m.processes}, fast {m.fast_median:.2f}"
                + (f", slow {m.slow_median:.2f}" if m.slow_median is not None else "")
                for side, m in modes.items()
            ]
            ratios = [
                f"{side}/{native} {m.fast_median / modes[native].fast_median:.2f}x"
                for side, m in modes.items()
                if side != native
            ]
            tail = " | fast-mode " + ", ".join(ratios) if ratios else ""  # (replay: no framework side)
            lines.append(f"  {row}: " + "; ".join(parts) + tail)
    return lines


def main(argv: list[str]) -> int:
    cut = 1.4
    if "--cut" in argv:
        i = argv.index("--cut")
        cut = float(argv[i + 1])
        argv = argv[:i] + argv[i + 2 :]
    if not argv:
        print(__doc__)
        return 2
    for path in argv:
        with open(path) as f:
            print(f"# {path}")
            print("\n".join(report(json.load(f), cut)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

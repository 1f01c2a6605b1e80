"""Compare two junit XML files of a framework's test suite: its own allocator vs graphpool.

    python diff_failures.py cupy_pool.xml graphpool.xml [report.txt]

(CuPy's suite, benchmarks/cupy_suite.sh; numba-cuda's, benchmarks/numba_suite.sh with
``BASELINE_NAME="Numba's memory manager"``.)

Prints (and writes to report.txt) the totals of each run and, among the tests both runs
reached (a run stopped by its time limit reaches fewer), those that fail (failure or error)
with graphpool but not with CuPy's pool, and the reverse. Exits 1 when some
test fails only with graphpool, 2 when a file is missing, 0 otherwise. Standard library
only (no network needed).
"""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET


def load(path: str) -> tuple[dict[str, int], dict[str, str], set[str]]:
    """(totals, {test id: first line of its failure}, every test id run) of one junit XML file."""
    root = ET.parse(path).getroot()
    totals = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    failed: dict[str, str] = {}
    ran: set[str] = set()
    for case in root.iter("testcase"):
        totals["tests"] += 1
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        ran.add(test_id)
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                totals["failures" if kind == "failure" else "errors"] += 1
                text = (node.get("message") or node.text or "").strip().splitlines()
                failed[test_id] = f"{kind}: {text[0][:200] if text else ''}"
        if case.find("skipped") is not None:
            totals["skipped"] += 1
    return totals, failed, ran


def main(argv: list[str]) -> int:
    if len(argv) not in (2, 3):
        print(__doc__, file=sys.stderr)
        return 2
    for path in argv[:2]:
        if not os.path.exists(path):
            print(f"{path}: missing; that run did not get to its tests (see its .log)", file=sys.stderr)
            return 2
    base_totals, base, base_ran = load(argv[0])
    gp_totals, gp, gp_ran = load(argv[1])
    both = base_ran & gp_ran  # a run stopped by its time limit ran fewer: compare what both ran
    only_gp = sorted(t for t in set(gp) - set(base) if t in both)
    only_base = sorted(t for t in set(base) - set(gp) if t in both)
    name = os.environ.get("BASELINE_NAME", "CuPy's pool")
    lines = [
        f"{name}: {base_totals}",
        f"graphpool:   {gp_totals}",
        f"tests run by both: {len(both)} (only with {name}: {len(base_ran - gp_ran)}, "
        f"only with graphpool: {len(gp_ran - base_ran)})",
        f"failing in both: {len(set(gp) & set(base))}",
        f"failing, run by one side only: {len((set(gp) | set(base)) - both)}",
        f"failing only with graphpool: {len(only_gp)}",
        *(f"  {t}  [{gp[t]}]" for t in only_gp),
        f"failing only with {name}: {len(only_base)}",
        *(f"  {t}  [{base[t]}]" for t in only_base),
    ]
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if len(argv) == 3:
        with open(argv[2], "w") as fh:
            fh.write(text)
    return 1 if only_gp else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Run chosen sections of ``python -m graphpool bench`` and write their JSON (GPU scripts).

Used to measure two builds (before and after a change) with the same benchmark code:
copy this tree's ``src/graphpool/tools`` over the other build's and run this there. A section
is named by its key in ``bench.SECTIONS`` (``pair`` and ``mixed`` are short for the pairs').

    python benchmarks/bench_sections.py --backend cuda --sections pair,mixed,traces --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from typing import Any

import graphpool as gp
from graphpool import runtime
from graphpool.tools import bench, benchkit

SHORT = {"pair": "malloc_free_pair_us", "mixed": "malloc_free_mixed_us"}
"""Short names of sections (any other section is named by its key in bench.SECTIONS)."""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--sections", default="pair,mixed,traces")
    ap.add_argument("--number", type=int, default=20000)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    if args.backend:
        gp.set_backend(args.backend)
    benchkit.start_progress(True)
    skipped: list[dict[str, str]] = []
    out: dict[str, Any] = {
        "backend": gp.backend(),
        "device": runtime.get().device(0).name,
        "compiled": gp.compiled(),
        "graphpool": gp.__file__,
        "meta": {"number": args.number, "repeat": args.repeat, "quick": args.quick},
    }
    gc.collect()
    gc.disable()
    try:
        plan = bench.Plan(args.number, args.repeat, args.quick, skipped)
        by_key = {s.key: s for s in bench.SECTIONS}
        for name in args.sections.split(","):
            key = SHORT.get(name, name)
            if key not in by_key:
                raise SystemExit(f"unknown section {name!r} (known: {', '.join([*SHORT, *by_key])})")
            data = by_key[key].run(plan)
            if data is not None:
                out[key] = data
    finally:
        gc.enable()
    out["skipped"] = skipped
    text = json.dumps(out, indent=1, default=str)
    with open(args.json, "w") as fh:
        fh.write(text + "\n")
    print(bench.table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

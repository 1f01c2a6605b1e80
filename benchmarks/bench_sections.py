"""Run chosen sections of ``python -m graphpool bench`` and write their JSON (GPU scripts).

Used to measure two builds (before and after a change) with the same benchmark code:
copy this tree's ``bench.py`` and ``traces.py`` over the other build's and run this there.

    python benchmarks/bench_sections.py --backend cuda --sections pair,mixed,traces --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from typing import Any

import graphpool as gp
from graphpool import bench, runtime


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
    bench._progress = bench.Progress(True)
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
        for section in args.sections.split(","):
            if section == "pair":
                out["malloc_free_pair_us"] = bench.bench_malloc_free(args.number, args.repeat, skipped)
            elif section == "mixed":
                out["malloc_free_mixed_us"] = bench.bench_mixed_sizes(args.number, args.repeat, skipped)
            elif section == "traces":
                out["traces"] = bench.bench_traces(args.repeat, args.quick, skipped)
            else:
                raise SystemExit(f"unknown section {section!r}")
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

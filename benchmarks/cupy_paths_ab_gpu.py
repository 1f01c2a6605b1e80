"""CuPy's allocator paths side by side in ONE process (GPU): CuPy's MemoryPool, graphpool's
default hooks path (CuPy's ``PythonFunctionAllocator`` over the compiled hooks) and its
opt-in C path (CuPy's ``CFunctionAllocator`` over the shim), switched with
``cupy.cuda.set_allocator`` between timed slots, the order rotated each round.

Why: run 14 (H100) read the C path 1.15-1.32x slower than the hooks path on two CuPy
programs, in separate processes. This script asks whether that holds inside one process
(no process placement or start-up drift), and where the time goes:

* ``alloc 4096``: the allocator alone (``allocator(4096)`` and drop), no ndarray;
* ``alloc cycle``: the same over four sizes in turn, so no request repeats the last one
  (the lane never answers; every call reaches the hooks);
* ``hooks.malloc_on``: the policy alone, called from Python (no CuPy);
* ``empty 4096`` / ``empty cycle``: ``cupy.empty`` with the framework's object creation;
* the two programs of ``graphpool.tools.frameworks_bench``.

Usage: ``python benchmarks/cupy_paths_ab_gpu.py [--rounds 7] [--number 20000] [--json F]``.
Run it again with ``GRAPHPOOL_LANE=0`` for the C path with its lanes off.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--number", type=int, default=20000)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    import cupy

    import graphpool as gp
    import graphpool.cupy as gcupy
    from graphpool.tools import frameworks_bench as fb

    gp.set_backend("cuda")
    gcupy.use_c_allocator = True
    gcupy.install()
    c_alloc = cupy.cuda.get_allocator()
    c_hooks = gcupy._hooks
    gcupy.uninstall()
    gcupy.use_c_allocator = False
    gcupy.install()
    h_alloc = cupy.cuda.get_allocator()
    h_hooks = gcupy._hooks
    pool = cupy.cuda.MemoryPool()
    sides: dict[str, Any] = {"cupy pool": pool.malloc, "graphpool hooks": h_alloc, "graphpool C": c_alloc}
    hooks_of = {"graphpool hooks": h_hooks, "graphpool C": c_hooks}
    print(
        "C allocator:",
        type(getattr(c_alloc, "__self__", c_alloc)).__name__,
        "| hooks allocator:",
        type(getattr(h_alloc, "__self__", h_alloc)).__name__,
        "| compiled:",
        gp.compiled(),
        flush=True,
    )

    sync = cupy.cuda.Device().synchronize
    empty, u8 = cupy.empty, cupy.uint8
    progs = fb._cupy_programs(cupy)

    def work(side: str) -> dict[str, tuple[Callable[[], None], int]]:
        alloc = sides[side]
        out: dict[str, tuple[Callable[[], None], int]] = {}

        def a4096() -> None:
            alloc(4096)

        def acycle() -> None:
            alloc(512)
            alloc(4096)
            alloc(65536)
            alloc(1 << 20)

        def e4096() -> None:
            empty(4096, u8)

        def ecycle() -> None:
            empty(512, u8)
            empty(4096, u8)
            empty(65536, u8)
            empty(1 << 20, u8)

        out["alloc 4096"] = (a4096, 1)
        out["alloc cycle (per array)"] = (acycle, 4)
        out["empty 4096"] = (e4096, 1)
        out["empty cycle (per array)"] = (ecycle, 4)
        h = hooks_of.get(side)
        if h is not None:

            def policy() -> None:
                h.free(h.malloc_on(4096, 0, 0), 0)

            out["hooks.malloc_on+free 4096 (Python)"] = (policy, 1)
        for name, prog in progs.items():
            out[name] = (prog, 0)
        return out

    results: dict[str, dict[str, list[float]]] = {}
    names = list(sides)
    for r in range(args.rounds + 1):
        order = names[r % len(names) :] + names[: r % len(names)]
        for side in order:
            cupy.cuda.set_allocator(sides[side])
            for name, (fn, per) in work(side).items():
                n = max(20, args.number // 100) if per == 0 else max(1, args.number // per)
                if r == 0:
                    n = max(1, n // 10)
                gc.collect()
                sync()
                t0 = time.perf_counter()
                for _ in range(n):
                    fn()
                sync()
                us = (time.perf_counter() - t0) / (n * max(per, 1)) * 1e6
                if r:
                    results.setdefault(name, {}).setdefault(side, []).append(us)
            cupy.cuda.set_allocator(h_alloc)
        print(f"round {r} done", flush=True)

    table: dict[str, Any] = {}
    for name, per_side in results.items():
        base = statistics.median(per_side.get("cupy pool", [float("nan")]))
        row = {}
        for side, xs in per_side.items():
            med = statistics.median(xs)
            row[side] = {"median_us": med, "min_us": min(xs), "runs": xs, "ratio_to_pool": med / base}
        hc = per_side.get("graphpool C")
        hh = per_side.get("graphpool hooks")
        if hc and hh:
            row["C / hooks"] = statistics.median(hc) / statistics.median(hh)
            # paired within rounds: the same round's slots ran back to back
            row["C / hooks per round"] = [c / h for c, h in zip(hc, hh, strict=True)]
        table[name] = row
        cells = "  ".join(
            f"{s}: {v['median_us']:.2f} ({v['min_us']:.2f}) {v['ratio_to_pool']:.2f}x"
            for s, v in row.items()
            if isinstance(v, dict)
        )
        extra = f"  C/hooks {row['C / hooks']:.2f}" if "C / hooks" in row else ""
        print(f"{name}: {cells}{extra}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"argv": sys.argv, "rounds": args.rounds, "number": args.number, "table": table}, f, indent=1
            )
    cupy.cuda.set_allocator(h_alloc)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

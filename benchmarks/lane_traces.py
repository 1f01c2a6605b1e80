"""The PyTorch shim's lane on real allocation traces, on the simulator (no GPU needed).

Replays each shipped PyTorch trace (``graphpool.traces``) through the shim's two C entry
points, as PyTorch calls them (ctypes: the GIL released around each call), and reports:

* ``calls``: mallocs + frees; ``python``: how many reached graphpool's Python hooks (the
  rest the lane answered: a parked block handed out again, or parked again when its tensor
  died); ``taken back``: requests served by the parking rule;
* ``peak reserved`` and ``peak allocated``: whether parking (a repeated request reuses its
  own block, not the best fit) costs memory against a tree without it.

    python benchmarks/lane_traces.py --tree lane=src --tree before=/path/to/older/src

Instructions per call (callgrind, as benchmarks/frameworks_cpu.py counts them): run one
worker under valgrind with ``--rounds 1`` and ``--rounds 3`` (``PYTHONHASHSEED=0``) and
divide the difference by twice the trace's calls (each round frees what the trace left live,
so rounds 2 and 3 start from the same state), e.g.
``valgrind --tool=callgrind --callgrind-out-file=/dev/null python benchmarks/lane_traces.py
--worker torch-transformer-train --rounds 3``.

Each tree runs in its own process (``PYTHONPATH``). Stream index 0 is the legacy stream;
others are simulated streams, whose capture query is a Python callback here (a C function
on CUDA), so only the counts, not the times, carry over to a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

TRACES = ("torch-transformer-train", "torch-transformer-infer", "torch-resnet-train")


def worker(name: str, rounds: int = 1) -> dict[str, Any]:
    import graphpool as gp
    import graphpool.torch as gtorch
    from graphpool import runtime
    from graphpool.tools.benchkit import torch_entry_points
    from graphpool.traces import ALLOC, load

    gp.set_backend("sim")
    shim = gtorch._shim()
    counts = {"malloc": 0, "free": 0}
    malloc, free = gtorch.hooks()

    def m(size: int, device: int, stream: int) -> int:
        counts["malloc"] += 1
        return int(malloc(size, device, stream))

    def f(ptr: int, size: int, device: int, stream: int) -> Any:
        counts["free"] += 1
        return free(ptr, size, device, stream)

    shim.set_hooks(m, f)
    lib = torch_entry_points()
    trace = load(name)
    dev = runtime.get().device(0)
    streams = [0] + [dev.create_stream() for _ in range(max(trace.streams - 1, 0))]
    live: dict[int, tuple[int, int, int]] = {}
    calls = 0
    for _ in range(rounds):
        for e in trace.events:
            calls += 1
            if e[0] == ALLOC:
                _, ident, nbytes, si = e
                ptr = lib.graphpool_torch_malloc(nbytes, 0, streams[si]) or 0
                live[ident] = (ptr, nbytes, streams[si])
            else:
                ptr, nbytes, s = live.pop(e[1])
                lib.graphpool_torch_free(ptr, nbytes, 0, s)
        for ptr, nbytes, s in live.values():  # what the trace left live: each round starts empty
            calls += 1
            lib.graphpool_torch_free(ptr, nbytes, 0, s)
        live.clear()
    hits = shim.lane_state(0)["hits"] if hasattr(shim, "lane_state") else 0
    stats = gp.memory_stats()
    gp.check_invariants()
    return {
        "trace": name,
        "calls": calls,
        "python": counts["malloc"] + counts["free"],
        "lane hits (since the last settle)": hits,
        "allocations counted": stats["allocation.all.allocated"],
        "peak reserved": stats["reserved_bytes.all.peak"],
        "peak allocated": stats["allocated_bytes.all.peak"],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tree", action="append", default=[], help="NAME=SRC")
    ap.add_argument("--worker")
    ap.add_argument("--rounds", type=int, default=1, help="replay each trace this many times")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.rounds)))
        return 0
    trees = [t.split("=", 1) for t in args.tree] or [["this", "src"]]
    for name in TRACES:
        for tree, src in trees:
            env = dict(os.environ, PYTHONPATH=os.path.abspath(src))
            r = subprocess.run(
                [sys.executable, __file__, "--worker", name, "--rounds", str(args.rounds)],
                capture_output=True,
                text=True,
                env=env,
                check=False,
            )
            if r.returncode:
                print(f"{name} | {tree}: failed: {r.stderr[-500:]}")
                continue
            out = json.loads(r.stdout.strip().splitlines()[-1])
            share = 100.0 * out["python"] / out["calls"]
            print(
                f"{name} | {tree}: {out['calls']} calls, {out['python']} reached Python ({share:.1f} %), "
                f"peak reserved {out['peak reserved']}, peak allocated {out['peak allocated']}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

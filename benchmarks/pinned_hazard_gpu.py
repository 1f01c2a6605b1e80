"""Pinned host memory freed during a capture, on a real GPU: CuPy's PinnedMemoryPool beside
graphpool's pinned pool (issue 30, item 5).

    python3 benchmarks/pinned_hazard_gpu.py [--n ELEMENTS] [--json PATH]

Two programs, each run with CuPy's own pinned pool (a fresh ``cupy.cuda.PinnedMemoryPool``)
and with graphpool's (``graphpool.cupy.install_pinned()``), on one non-blocking CuPy stream:

* host to device: a pinned buffer ``h`` holds 1.0; CuPy's ``Stream.begin_capture``; a
  ``cudaMemcpyAsync`` from ``h`` to a device array ``d``; ``del h`` (freed during the
  capture); ``end_capture``. Then, eagerly on the same stream, a new pinned buffer of the
  same size is filled with 7.0 and the graph is launched: every element of ``d`` that is not
  1.0 was read from the eager buffer (stale: the replay copied what the eager code wrote).
* device to host: ``d`` holds 3.0; the capture copies ``d`` into a pinned buffer ``out`` and
  frees ``out``; an eager pinned buffer is filled with 7.0 and the graph launched: every
  element of the eager buffer that is not 7.0 was overwritten by the replay.

Expected: CuPy's pool hands the freed buffer to the eager allocation (every element wrong);
graphpool keeps it for the graph (0 wrong). The pinned buffers come from
``cupy.cuda.alloc_pinned_memory`` (CuPy's current pinned allocator), the copies from
``cupy.cuda.runtime.memcpyAsync`` with ``cudaMemcpyDefault``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from typing import Any


def _pinned(cupy: Any, n: int, fill: float) -> tuple[Any, Any]:
    """A pinned float32 buffer of ``n`` elements from CuPy's current pinned allocator, and a
    NumPy view of it (the view keeps the pointer alive)."""
    import numpy as np

    mem = cupy.cuda.alloc_pinned_memory(4 * n)
    view = np.frombuffer(mem, dtype=np.float32, count=n)
    view[:] = fill
    return mem, view


def run(pool: str, direction: str, n: int) -> dict[str, Any]:
    import cupy

    import graphpool as gp
    import graphpool.cupy as gcupy

    if pool == "graphpool":
        gcupy.install_pinned()
    else:
        gcupy.uninstall_pinned()
        cupy.cuda.set_pinned_memory_allocator(cupy.cuda.PinnedMemoryPool().malloc)
    kind = cupy.cuda.runtime.memcpyDefault
    gc.collect()
    cupy.cuda.Device().synchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    d = cupy.full(n, 3.0, dtype=cupy.float32)
    cupy.cuda.Device().synchronize()
    with s:
        mem, view = _pinned(cupy, n, 1.0)
        first = mem.ptr
        s.begin_capture()
        if direction == "host to device":
            cupy.cuda.runtime.memcpyAsync(d.data.ptr, mem.ptr, 4 * n, kind, s.ptr)
        else:
            cupy.cuda.runtime.memcpyAsync(mem.ptr, d.data.ptr, 4 * n, kind, s.ptr)
        del mem, view  # freed during the capture
        gc.collect()
        graph = s.end_capture()
        eager, eager_view = _pinned(cupy, n, 7.0)  # eager, same stream, after the capture
        same = eager.ptr == first
        graph.launch(s)
        s.synchronize()
        if direction == "host to device":
            wrong = int((d != 1.0).sum().item())  # elements the replay read from the eager buffer
        else:
            wrong = int((eager_view != 7.0).sum())  # elements of the eager buffer overwritten
    del graph, eager, eager_view
    gc.collect()
    if pool == "graphpool":
        gp.synchronize()
        gp.empty_pinned_cache()
        gcupy.uninstall_pinned()
    return {"pool": pool, "direction": direction, "elements": n, "wrong": wrong, "same buffer": same}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n", type=int, default=1 << 20, help="float32 elements (default 1,048,576)")
    parser.add_argument("--json", help="write the rows as JSON here too")
    args = parser.parse_args()
    import cupy

    import graphpool as gp

    gp.set_backend("cuda")
    rows = [
        run(pool, direction, args.n)
        for direction in ("host to device", "device to host")
        for pool in ("cupy", "graphpool")
    ]
    print(f"CuPy {cupy.__version__}, {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}")
    print(f"{'pool':<10} {'direction':<15} {'eager got the freed buffer':>27} {'wrong elements':>15}")
    for r in rows:
        same = "yes" if r["same buffer"] else "no"
        wrong = f"{r['wrong']:,} of {r['elements']:,}"
        print(f"{r['pool']:<10} {r['direction']:<15} {same:>27} {wrong:>15}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    ok = all(r["wrong"] == 0 for r in rows if r["pool"] == "graphpool")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

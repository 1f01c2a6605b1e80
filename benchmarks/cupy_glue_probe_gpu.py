"""Where CuPy's C path spends the time the lane does not save (GPU, one process).

Run 21's in-process A/B (``cupy_paths_ab_gpu.py``) read a CuPy allocation that the lane does
not answer 0.4-0.8 us dearer on the C path (``CFunctionAllocator`` over the shim) than on the
hooks path (``PythonFunctionAllocator`` over the same compiled hooks). This probe separates the
shim's glue from the hooks: each variant is ``allocator(4096)`` made and dropped (no ndarray),
its slots taken in turn, the order rotated each round:

* ``pool``: CuPy's MemoryPool;  ``hooks``: graphpool's default path;  ``C``: the opt-in C path;
* ``py trivial``: ``PythonFunctionAllocator`` over two plain functions that return one fixed
  address and do nothing; ``C trivial``: the shim's entry points with those same two functions
  as its hooks (``set_cupy_hooks``). C trivial - py trivial is the shim's glue;
* ``py -> C hooks``: ``PythonFunctionAllocator`` calling the C path's own hooks object.

Usage: ``GRAPHPOOL_LANE=0 python benchmarks/cupy_glue_probe_gpu.py [--rounds 9] [--number 50000]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--number", type=int, default=50000)
    args = p.parse_args(argv)

    import cupy

    import graphpool as gp
    import graphpool.cupy as gcupy
    from graphpool import lanes

    gp.set_backend("cuda")
    gcupy.use_c_allocator = True
    gcupy.install()
    c_alloc = cupy.cuda.get_allocator()
    c_hooks = gcupy._hooks
    gcupy.uninstall()
    gcupy.use_c_allocator = False
    gcupy.install()
    h_alloc = cupy.cuda.get_allocator()
    pool = cupy.cuda.MemoryPool()
    keep = pool.malloc(1 << 20)  # the trivial hooks' one address (never written)
    addr = int(keep.ptr)

    def t_malloc(size: int, device: int, raw: int = 0) -> int:
        return addr

    def t_free(ptr: int, device: int) -> int:
        return 0

    pfa = cupy.cuda.memory.PythonFunctionAllocator
    cfa = cupy.cuda.memory.CFunctionAllocator
    shim = lanes.shim("graphpool.cupy")
    capsule = cupy.cuda.stream.__pyx_capi__["get_current_stream_ptr"]
    em, ef = shim.cupy_entry_points()
    c_trivial = cfa(0, em, ef, shim).malloc
    py_trivial = pfa(t_malloc, t_free).malloc
    py_c_hooks = pfa(lambda s, d: c_hooks.malloc_on(s, d, 0), c_hooks.free).malloc
    sides: dict[str, Any] = {
        "pool": pool.malloc,
        "hooks": h_alloc,
        "C": c_alloc,
        "py trivial": py_trivial,
        "C trivial": c_trivial,
        "py -> C hooks": py_c_hooks,
    }
    res: dict[str, list[float]] = {k: [] for k in sides}
    names = list(sides)
    sync = cupy.cuda.Device().synchronize
    for r in range(args.rounds + 1):
        k = r % len(names)
        for side in names[k:] + names[:k]:
            if side == "C trivial":
                shim.set_cupy_hooks(t_malloc, t_free, capsule)
            alloc = sides[side]
            n = args.number if r else args.number // 10
            gc.collect()
            sync()
            t0 = time.perf_counter()
            for _ in range(n):
                alloc(4096)
            sync()
            us = (time.perf_counter() - t0) / n * 1e6
            if side == "C trivial":
                shim.set_cupy_hooks(c_hooks.malloc_on, c_hooks.free, capsule)
            if r:
                res[side].append(us)
    for side, xs in res.items():
        print(
            f"{side:14s} median {statistics.median(xs):.3f} us  min {min(xs):.3f}  runs "
            + " ".join(f"{x:.2f}" for x in xs)
        )
    med = {k: statistics.median(v) for k, v in res.items()}
    print(f"glue (C trivial - py trivial): {med['C trivial'] - med['py trivial']:+.3f} us")
    print(f"C - hooks: {med['C'] - med['hooks']:+.3f} us")
    print(f"C - (py -> C hooks): {med['C'] - med['py -> C hooks']:+.3f} us")
    del keep
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

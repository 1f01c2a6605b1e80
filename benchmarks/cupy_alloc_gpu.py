"""What a CuPy user pays per allocation with graphpool installed as CuPy's allocator (GPU only).

    python benchmarks/cupy_alloc_gpu.py [--json FILE] [--rounds N] [--calls N]

``cupy.empty(n, dtype=uint8)`` made and dropped, on CuPy's null stream and on a non-blocking
CuPy stream, at 512 B, 64 KiB and 4 MiB, with three allocators set in turn in one process and
interleaved round by round: CuPy's own ``MemoryPool``, ``graphpool.cupy.malloc`` (what
``graphpool.cupy.install()`` sets), and a copy of that function as the previous release had it
(``previous_malloc`` below: a backend check, a key and a weak-dictionary lookup per call).
Prints and writes the medians (us per array) and the ratios within each round.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import weakref
from typing import Any


def previous_malloc_factory() -> Any:
    """graphpool.cupy.malloc as released before NOTES entry 41, for the side-by-side figure."""
    import cupy

    from graphpool import runtime
    from graphpool.memory import alloc
    from graphpool.streams import Stream

    streams: weakref.WeakValueDictionary[tuple[int, int], Stream] = weakref.WeakValueDictionary()

    def previous_malloc(nbytes: int) -> Any:
        if runtime.get().name != "cuda":
            raise RuntimeError("needs the 'cuda' backend")
        if nbytes == 0:
            return cupy.cuda.MemoryPointer(cupy.cuda.Memory(0), 0)
        device = cupy.cuda.runtime.getDevice()
        handle = int(cupy.cuda.get_current_stream(device).ptr)
        key = (device, handle)
        s = streams.get(key)
        if s is None:
            s = Stream._wrap(device, handle)
            streams[key] = s
        buf = alloc(nbytes, stream=s)
        mem = cupy.cuda.UnownedMemory(buf.ptr, nbytes, buf, device)
        return cupy.cuda.MemoryPointer(mem, 0)

    return previous_malloc


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--calls", type=int, default=20000)
    args = ap.parse_args()

    import cupy

    import graphpool as gp
    import graphpool.cupy as gcupy

    gp.set_backend("cuda")
    gcupy.install()
    allocators = {
        "cupy pool": cupy.cuda.MemoryPool().malloc,
        "graphpool": gcupy.malloc,
        "graphpool, previous": previous_malloc_factory(),
    }
    streams = {
        "null stream": cupy.cuda.Stream.null,
        "non-blocking stream": cupy.cuda.Stream(non_blocking=True),
    }
    sizes = (512, 1 << 16, 1 << 22)
    empty, u8 = cupy.empty, cupy.uint8

    def timed(n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(args.calls):
            a = empty(n, dtype=u8)
            del a
        return (time.perf_counter() - t0) / args.calls * 1e6

    times: dict[str, list[float]] = {}
    ratios: dict[str, list[float]] = {}
    gc.collect()
    gc.disable()
    try:
        for _ in range(args.rounds):
            for sname, st in streams.items():
                with st:
                    for n in sizes:
                        row = {}
                        for aname, fn in allocators.items():
                            cupy.cuda.set_allocator(fn)
                            timed(n)  # warm: the pool holds the block, the stream is known
                            row[aname] = timed(n)
                            times.setdefault(f"{sname}, {n} B, {aname}", []).append(row[aname])
                        for aname in ("graphpool", "graphpool, previous"):
                            ratios.setdefault(f"{sname}, {n} B, {aname} / cupy pool", []).append(
                                row[aname] / row["cupy pool"]
                            )
                        ratios.setdefault(f"{sname}, {n} B, graphpool / previous", []).append(
                            row["graphpool"] / row["graphpool, previous"]
                        )
    finally:
        gc.enable()
        cupy.cuda.set_allocator(gcupy.malloc)
    out = {
        "us_per_array_median": {k: statistics.median(v) for k, v in times.items()},
        "ratio_median": {k: statistics.median(v) for k, v in ratios.items()},
        "ratio_min_max": {k: (min(v), max(v)) for k, v in ratios.items()},
        "rounds": args.rounds,
        "calls": args.calls,
        "op": "cupy.empty(n, dtype=uint8), dropped",
        "cupy": cupy.__version__,
    }
    for k, v in out["ratio_median"].items():
        lo, hi = out["ratio_min_max"][k]
        print(f"{k:60s} {v:6.3f} x  (rounds {lo:.3f}-{hi:.3f})")
    for k, v in out["us_per_array_median"].items():
        print(f"{k:60s} {v:7.3f} us")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)
    gp.check_invariants()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a CuPy program's step goes on each allocator path (GPU): one path per process.

Runs 15-16 read CuPy's two small programs (``graphpool.tools.frameworks_bench``) slower on
the C path than on the hooks path by min over processes (FFT pipeline 292 us against 207 us
in run 16), while a single repeated ``cupy.empty`` reads faster on the C path. This runs
one path in one process (``pool``, ``hooks``, ``c``; ``c`` with ``GRAPHPOOL_LANE=0`` in the
environment for the C path without lanes) and reports, per program step: the wall time
(min and median of rounds, no synchronization inside a round, as the bench), the calls that
reached graphpool's Python hooks, how many of those frees parked, graphpool's device
allocations and frees and full synchronizations (``gp.memory_stats``), and then the top
functions by own time under cProfile (what the interpreter sees of the step).

Usage: ``python benchmarks/cupy_program_diag_gpu.py MODE [--steps 30] [--rounds 5]``.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import statistics
import sys
import time
from typing import Any


def main() -> int:
    mode = sys.argv[1]
    steps = int(sys.argv[sys.argv.index("--steps") + 1]) if "--steps" in sys.argv else 30
    rounds = int(sys.argv[sys.argv.index("--rounds") + 1]) if "--rounds" in sys.argv else 5
    import cupy

    from graphpool.tools import frameworks_bench as fb

    counts = {"py_malloc": 0, "py_free": 0, "parked": 0}
    gp: Any = None
    if mode == "pool":
        cupy.cuda.set_allocator(cupy.cuda.MemoryPool().malloc)
    else:
        import graphpool
        import graphpool.cupy as gcupy
        from graphpool import lanes

        gp = graphpool
        gp.set_backend("cuda")
        gcupy.use_c_allocator = mode == "c"
        gcupy.install()
        h = gcupy._hooks
        assert h is not None

        def m(size: int, device: int, raw: int) -> int:
            counts["py_malloc"] += 1
            return h.malloc_on(size, device, raw)

        def f(ptr: int, device: int) -> int:
            counts["py_free"] += 1
            r = h.free(ptr, device)
            counts["parked"] += r != 0
            return r

        if mode == "c":
            shim = lanes.shim("graphpool.cupy")
            shim.set_cupy_hooks(m, f, cupy.cuda.stream.__pyx_capi__["get_current_stream_ptr"])
        else:

            def hm(size: int, device: int) -> int:
                counts["py_malloc"] += 1
                return h.malloc(size, device)

            cupy.cuda.set_allocator(cupy.cuda.memory.PythonFunctionAllocator(hm, f).malloc)
        print(
            f"mode {mode}: allocator {type(cupy.cuda.get_allocator().__self__).__name__}, "
            f"lanes {lanes.enabled()}, lane bound {gp.runtime.allocator(0)._lane is not None}",
            flush=True,
        )
    sync = cupy.cuda.Device().synchronize
    keys = ("num_device_alloc", "num_device_free", "num_sync_all_streams", "allocation.all.allocated")
    for name, prog in fb._cupy_programs(cupy).items():
        for _ in range(5):
            prog()
        sync()
        for k in counts:
            counts[k] = 0
        before = gp.memory_stats() if gp is not None else {}
        times = []
        for _ in range(rounds):
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                prog()
            sync()
            times.append((time.perf_counter() - t0) / steps * 1e6)
        after = gp.memory_stats() if gp is not None else {}
        n = steps * rounds
        line = f"{name}: min {min(times):.1f} us, median {statistics.median(times):.1f} us per step"
        if gp is not None:
            c = {k: v / n for k, v in counts.items()}
            line += f"; per step: python mallocs {c['py_malloc']:.1f} frees {c['py_free']:.1f}"
            line += f" parked {c['parked']:.1f}"
            line += "".join(f", {k} {(after[k] - before[k]) / n:.2f}" for k in keys)
        print(line, flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            prog()
        sync()
        prof.disable()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(12)
        body = [ln for ln in s.getvalue().splitlines() if ln.strip()][3:20]
        print("\n".join("    " + ln for ln in body), flush=True)
    print("env GRAPHPOOL_LANE =", os.environ.get("GRAPHPOOL_LANE"), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

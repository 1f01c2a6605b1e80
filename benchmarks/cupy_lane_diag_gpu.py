"""Does the CuPy lane answer in a process that installs only the C path (GPU)?

Run 15's frameworks bench (one allocator per process) read the C path at 3.2-4.1 us per
``cupy.empty`` + drop against CuPy's pool at 1.9-2.5 us, while the in-process A/B
(``cupy_paths_ab_gpu.py``, which installs the C path, then the hooks path) read the C path
equal to CuPy's pool. This counts the calls that reach the Python hooks (the lane's misses)
in the bench worker's own sequence, and times them, first as the worker does, then after the
A/B's install sequence (``--ab``).
"""

from __future__ import annotations

import sys
import time


def main() -> int:
    import cupy

    import graphpool as gp
    import graphpool.cupy as gcupy
    from graphpool import lanes

    gp.set_backend("cuda")
    if "--ab" in sys.argv:
        gcupy.install()
        c_alloc = cupy.cuda.get_allocator()
        gcupy.uninstall()
        gcupy.use_c_allocator = False
        gcupy.install()
        cupy.cuda.set_allocator(c_alloc)
    else:
        gcupy.install()
    h = gcupy._c_hooks
    shim = lanes.shim("graphpool.cupy")
    capsule = cupy.cuda.stream.__pyx_capi__["get_current_stream_ptr"]
    n_m = [0]
    n_f = [0]
    parked = [0]
    raws: set[int] = set()

    def m(size: int, device: int, raw: int) -> int:
        n_m[0] += 1
        raws.add(raw)
        return h.malloc_on(size, device, raw)

    def f(ptr: int, device: int) -> int:
        n_f[0] += 1
        r = h.free(ptr, device)
        parked[0] += r != 0
        return r

    if "--count" in sys.argv:
        shim.set_cupy_hooks(m, f, capsule)
    a = gp.runtime.allocator(0)
    print(
        "compiled",
        gp.compiled(),
        "| C path",
        gcupy._hooks is h,
        "| lanes enabled",
        lanes.enabled(),
        "| lane bound",
        getattr(a, "_lane", "?") is not None,
        flush=True,
    )
    empty, u8 = cupy.empty, cupy.uint8
    sync = cupy.cuda.Device().synchronize
    for sname, st in (
        ("default", cupy.cuda.Stream.null),
        ("non-blocking", cupy.cuda.Stream(non_blocking=True)),
    ):
        with st:
            for size in (512, 4096, 1 << 20):
                n_m[0] = n_f[0] = parked[0] = 0
                raws.clear()
                sync()
                t0 = time.perf_counter()
                for _ in range(20000):
                    empty(size, u8)
                sync()
                us = (time.perf_counter() - t0) / 20000 * 1e6
                print(
                    f"{sname:12s} {size:8d} B: {us:.2f} us/array  python mallocs {n_m[0]}  frees {n_f[0]}"
                    f"  parked {parked[0]}  raw handles {sorted(raws)[:3]}  lane_bound {a._lane is not None}",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
